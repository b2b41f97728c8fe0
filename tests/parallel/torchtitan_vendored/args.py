# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.
#
# Copyright (c) Meta Platforms, Inc. All Rights Reserved.

# Vendored from torchtitan/models/llama3/model/args.py (and BaseModelArgs from
# torchtitan/protocols/model.py) at
# https://github.com/pytorch/torchtitan/tree/238fa9953e4aec2a62582121564273d7cbb1e9f1
# shardwise: get_nparams_and_flops cut (it needs models/utils.py's flop counting), logger
# from the standard library; the "debugmodel" flavor copied from models/llama3/__init__.py.

import logging
from dataclasses import dataclass, field

from .config import JobConfig

logger = logging.getLogger("torchtitan")  # shardwise: was torchtitan.tools.logging.logger


@dataclass
class BaseModelArgs:
    """All ModelArgs should inherit from this class.

    The only usage of this class is type checking but allows us to extend common
    arguments to all models in the future.
    """

    _enforced: str = "This field is used to enforce all fields have defaults."


@dataclass
class RoPEScalingArgs:
    scaling_factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass
class TransformerModelArgs(BaseModelArgs):
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None
    vocab_size: int = 128256
    multiple_of: int = 256  # make SwiGLU hidden layer size multiple of large power of 2
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 10000
    rope_scaling_args: RoPEScalingArgs = field(default_factory=RoPEScalingArgs)

    max_seq_len: int = 131072
    # If `True`, then each transformer block init uses its layer ID, and if
    # `False`, each uses the total number of transformer blocks
    depth_init: bool = True

    attn_type: str = "sdpa"
    attn_mask_type: str = "causal"
    eos_id: int = 0

    def update_from_config(self, job_config: JobConfig, **kwargs) -> None:
        seq_len = job_config.training.seq_len
        if seq_len > self.max_seq_len:
            logger.warning(
                f"Sequence length {seq_len} exceeds original maximum {self.max_seq_len}."
            )
        self.max_seq_len = seq_len

        if (
            job_config.parallelism.context_parallel_degree > 1
            and self.attn_type == "varlen"
        ):
            raise NotImplementedError(
                f"Context Parallel only supports SDPA and FlexAttention."
                f"Got attn_type='{self.attn_type}'. "
                f"Varlen attention is not supported with CP."
            )


# shardwise: from torchtitan/models/llama3/__init__.py, its debug flavor only
llama3_args = {
    "debugmodel": TransformerModelArgs(
        dim=256, n_layers=6, n_heads=16, vocab_size=2048, rope_theta=500000
    ),
}
