"""A torchtitan 0.3 train spec whose parallelize function is shardwise's.

torchtitan's `Trainer` builds the model on meta, calls `model_spec.parallelize_fn`, then
moves the result to the device and runs the model's own `init_weights`. Everything the
trainer does afterwards (optimizer, loss, gradient clipping, checkpoints, metrics) works on
whatever tensors that function leaves in the model. So the whole of shardwise's part is one
function: tensor parallel (with sequence parallel) on the "tp" dim and `fully_shard` on the
data-shard dim, on a shardwise mesh with the same ranks as the trainer's own.

    from shardwise_spec import llama3_spec
    config = llama3_debugmodel()
    config.model_spec = llama3_spec(config.model_spec)
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

import shardwise as sw
from shardwise.fsdp import MixedPrecisionPolicy, fully_shard
from shardwise.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def shardwise_mesh(parallel_dims) -> sw.DeviceMesh:
    """A shardwise mesh over the trainer's ranks, laid out as torchtitan lays out its own:
    the data-shard dim outer, tp inner."""
    unsupported = {name: degree for name, degree in (("pp", parallel_dims.pp), ("cp", parallel_dims.cp),
                   ("ep", parallel_dims.ep), ("dp_replicate", parallel_dims.dp_replicate)) if degree > 1}
    if unsupported:
        raise ValueError(
            f"the shardwise train spec builds dp_shard x tp meshes; this run asks for {unsupported}: "
            "set those degrees to 1 (parallelism.*_degree)")
    return sw.init_device_mesh("cpu" if not torch.cuda.is_available() else "cuda",
                               (parallel_dims.dp_shard, parallel_dims.tp), mesh_dim_names=("dp_shard", "tp"))


def apply_tp(model: nn.Module, tp_mesh: sw.DeviceMesh, *, sequence_parallel: bool) -> None:
    """Megatron's plan on torchtitan 0.3's Llama: the fused qkv projection and w1/w3 by
    columns, wo and w2 by rows; with sequence parallel the norms and the residual stream
    between blocks are sharded on the sequence dim. The vocabulary projection keeps its
    logits sharded on the vocabulary (the loss gathers what it needs)."""
    stream = sw.Shard(1) if sequence_parallel else sw.Replicate()
    parallelize_module(model, tp_mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=sw.Replicate(), output_layouts=stream),
        **({"norm": SequenceParallel()} if sequence_parallel else {}),
        "lm_head": ColwiseParallel(input_layouts=stream, output_layouts=sw.Shard(-1), use_local_output=False),
    })
    for block in model.layers.values():
        plan = {
            "attention": PrepareModuleInput(input_layouts=(stream, None, None),
                                             desired_input_layouts=(sw.Replicate(), None, None)),
            "attention.qkv_linear.wqkv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=stream),
            "feed_forward": PrepareModuleInput(input_layouts=(stream,), desired_input_layouts=(sw.Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=stream),
            "feed_forward.w3": ColwiseParallel(),
        }
        if sequence_parallel:
            plan.update({"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel()})
        parallelize_module(block, tp_mesh, plan)


def apply_fsdp(model: nn.Module, mesh: sw.DeviceMesh, mp_policy: MixedPrecisionPolicy) -> None:
    """One unit per block, one for the embedding, one for the norm and vocabulary projection
    together, and the root. The trainer's loss divides by the global token count, so the
    reduction sums instead of averaging (torchtitan's own choice)."""
    units = [model.tok_embeddings, *model.layers.values()]
    for unit in units:
        fully_shard(unit, mesh=mesh, mp_policy=mp_policy)
    fully_shard([model.norm, model.lm_head], mesh=mesh, mp_policy=mp_policy, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    for module in model.modules():
        if hasattr(module, "set_gradient_divide_factor"):
            module.set_gradient_divide_factor(1.0)


def parallelize_llama(model: nn.Module, *, parallel_dims, training, parallelism, compile_config,
                      ac_config, dump_folder, **_):
    """torchtitan's `parallelize_fn` contract, done with shardwise."""
    if compile_config.enable and compile_config.enable_async_tensor_parallel:
        raise ValueError("async tensor parallel is torch's symmetric-memory pass over its own process groups: "
                         "set compile.enable_async_tensor_parallel=False for the shardwise train spec")
    mesh = shardwise_mesh(parallel_dims)
    if parallel_dims.tp > 1:
        apply_tp(model, mesh["tp"], sequence_parallel=parallelism.enable_sequence_parallel)
    # torchtitan's own activation checkpointing and per-block torch.compile, in its spec's order
    if ac_config is not None:
        ac_config.build(dump_folder=dump_folder).apply(model)
    if compile_config.enable and "model" in compile_config.components:
        from torchtitan.distributed.compile import apply_compile
        apply_compile(model, compile_config=compile_config, parallel_dims=parallel_dims)
    mp_policy = MixedPrecisionPolicy(param_dtype=_DTYPES[training.mixed_precision_param],
                                     reduce_dtype=_DTYPES[training.mixed_precision_reduce])
    apply_fsdp(model, mesh["dp_shard"], mp_policy)
    return model


def pieces_share_storage() -> None:
    """torchtitan's checkpointer keeps its cached state dict in step by asking whether two
    tensors share storage, and reaches a DTensor's piece only through
    `isinstance(x, torch.distributed.tensor.DTensor)`. A shardwise DTensor is its own class
    (answering torch's isinstance for every caller breaks torch.compile's tracing), so the
    check is taught shardwise's: compare the pieces."""
    from torchtitan.components.checkpointer import base

    shares = base._shares_storage
    if getattr(shares, "shardwise", False):
        return

    def pieces(a, b):
        return shares(a.to_local() if isinstance(a, sw.DTensor) else a,
                      b.to_local() if isinstance(b, sw.DTensor) else b)

    pieces.shardwise = True
    base._shares_storage = pieces


def llama3_spec(spec):
    """torchtitan's Llama 3 spec with shardwise's parallelize function and no pipelining."""
    pieces_share_storage()
    return dataclasses.replace(spec, name=spec.name + "_shardwise", parallelize_fn=parallelize_llama,
                               pipelining_fn=None)
