# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# Vendored from torchtitan/config/job_config.py and torchtitan/config/__init__.py at
# https://github.com/pytorch/torchtitan/tree/238fa9953e4aec2a62582121564273d7cbb1e9f1
# shardwise: only the sections and fields the Llama 3 FSDP x TP training step reads, with
# torchtitan's defaults; their docstrings, the TOML / CLI manager and the other sections cut.

from dataclasses import dataclass, field
from typing import Literal

import torch

TORCH_DTYPE_MAP = {
    "float16": torch.float16,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
}


@dataclass
class Job:
    dump_folder: str = "./torchtitan/outputs"


@dataclass
class Model:
    name: str = "llama3"
    flavor: str = "debugmodel"
    converters: list[str] = field(default_factory=list)


@dataclass
class Optimizer:
    name: str = "AdamW"
    lr: float = 8e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    implementation: Literal["for-loop", "foreach", "fused"] = "fused"


@dataclass
class Training:
    local_batch_size: int = 8
    seq_len: int = 2048
    max_norm: float | int = 1.0
    steps: int = 10000
    enable_cpu_offload: bool = False
    mixed_precision_param: Literal["bfloat16", "float32"] = "bfloat16"
    mixed_precision_reduce: Literal["float32"] = "float32"


@dataclass
class Parallelism:
    data_parallel_replicate_degree: int = 1
    data_parallel_shard_degree: int = -1
    fsdp_reshard_after_forward: Literal["default", "always", "never"] = "default"
    tensor_parallel_degree: int = 1
    disable_loss_parallel: bool = False
    enable_async_tensor_parallel: bool = False
    pipeline_parallel_degree: int = 1
    context_parallel_degree: int = 1
    expert_parallel_degree: int = 1
    expert_tensor_parallel_degree: int = 1


@dataclass
class ActivationCheckpoint:
    mode: Literal["selective", "full", "memory_budget", "none"] = "selective"
    selective_ac_option: str = "2"
    early_stop: bool = False
    preserve_rng_state: bool = True
    determinism_check: str = "default"
    debug: bool = False


@dataclass
class Compile:
    enable: bool = False
    components: list[str] = field(default_factory=lambda: ["model", "loss"])
    backend: str = "inductor"


@dataclass
class Float8Linear:
    recipe_name: Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"] | None = None


@dataclass
class QuantizedLinear:
    float8: Float8Linear = field(default_factory=Float8Linear)


@dataclass
class Quantize:
    linear: QuantizedLinear = field(default_factory=QuantizedLinear)


@dataclass
class Debug:
    seed: int | None = None
    deterministic: bool = False
    deterministic_warn_only: bool = False


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    optimizer: Optimizer = field(default_factory=Optimizer)
    training: Training = field(default_factory=Training)
    parallelism: Parallelism = field(default_factory=Parallelism)
    activation_checkpoint: ActivationCheckpoint = field(
        default_factory=ActivationCheckpoint
    )
    compile: Compile = field(default_factory=Compile)
    quantize: Quantize = field(default_factory=Quantize)
    debug: Debug = field(default_factory=Debug)
