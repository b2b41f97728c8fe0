"""`HFTrainerMixin`: a `transformers.Trainer` that trains a model shardwise has already sharded.

Mix it in front of `transformers.Trainer` (or any subclass of it) and pass the sharded model:

    class Trainer(HFTrainerMixin, transformers.Trainer):
        pass

    trainer = Trainer(model=model, args=args, train_dataset=..., eval_dataset=..., mesh=mesh)

Why it is needed, and why it is this small: left alone, the Trainer saves from rank 0 alone
(transformers' `save_pretrained` reads each tensor's storage, which a DTensor does not have as
one piece: it raises), a checkpoint's optimizer state would be rank 0's shards only, the ranks
of a tensor-parallel group read different batches, and one `clip_grad_norm_` cannot take a tp
x dp model's gradients, which live on two meshes. And accelerate, which recognises only torch's
DTensors as already distributed, wraps the model in `DistributedDataParallel`; around a
`fully_shard` model that wrapper happens to be inert (its first broadcast runs through
shardwise's replicated fallback, each parameter gathered whole, and its gradient hooks never
fire because the units reduce the gradients themselves), but nothing promises so.
Everything else the Trainer does already holds for a shardwise model: the loss is each rank's mean over its own
samples, with the token count summed over all ranks when the model takes `num_items_in_batch`
(so every rank's gradient is scaled as accelerate's FSDP2 scales it, and the logged loss is the
ranks' mean; tensor-parallel ranks count their shared tokens once each, and the two factors
cancel); evaluation gathers per-rank losses. So the mixin changes five things:

- accelerate's `prepare` leaves the model as it is: the model is marked prepared, accelerate's
  own mark for a module it must not wrap again (no DDP, no move);
- with `mesh=` given, batches are split over the mesh dims that split the data (every dim but
  `tp` / `cp`), so the ranks of one tensor-parallel group read the same samples;
- gradients are clipped by their global 2-norm computed one mesh at a time: a tp x dp model's
  gradients live on two meshes ((dp, tp) for the split matrices, dp for the norms), which one
  `torch.nn.utils.clip_grad_norm_` (what accelerate calls) cannot stack;
- `save_model` (and the model half of a checkpoint) is `shardwise.checkpoint.save_pretrained`
  on every rank: a `from_pretrained` directory, each rank writing its own pieces, nothing
  gathered; resuming reads it back with `load_pretrained`, each rank its own pieces;
- the optimizer half of a checkpoint is `shardwise.checkpoint.save` of the optimizer's state
  by parameter name (torch DCP's format, sharded), loaded back into each state's layout.

The learning-rate scheduler, RNG states and the trainer state are saved as the Trainer saves them.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any, Optional

import torch

from .._mesh import DeviceMesh
from .._placement import Replicate
from .._tensor import DTensor

__all__ = ["HFTrainerMixin"]

OPTIMIZER_DIR = "optimizer"  # inside a Trainer checkpoint directory: the optimizer's DCP checkpoint
SCHEDULER_NAME = "scheduler.pt"  # the Trainer's own name for the scheduler's state
TRAINING_ARGS_NAME = "training_args.bin"
# mesh dims whose ranks read the same samples (accelerate's names for them, where it has one)
SAME_DATA_DIMS = ("tp", "cp")


class _BatchMesh:
    """The mesh as accelerate's data loader reads it: dim names and sizes, the data dims named
    `dp_shard` (accelerate splits batches over `dp_shard` x `dp_replicate` and gives the ranks of
    `tp` / `cp` the same ones). Ranks are numbered row-major, as on the shardwise mesh."""

    def __init__(self, mesh: DeviceMesh) -> None:
        names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
        same = [i for i, name in enumerate(names) if name in SAME_DATA_DIMS]
        if same != list(range(len(names) - len(same), len(names))):
            raise ValueError(f"HFTrainerMixin(mesh=...): the mesh dims {list(SAME_DATA_DIMS)} must come last, after "
                             f"the data-parallel dims, as accelerate numbers ranks; got mesh_dim_names {names}")
        data = 1
        for name, size in zip(names, mesh.shape):
            data *= 1 if name in SAME_DATA_DIMS else size  # accelerate: rank // (tp * cp) is the data rank
        self._sizes = {"dp_shard": data} | {n: s for n, s in zip(names, mesh.shape) if n in SAME_DATA_DIMS}
        self.mesh_dim_names = tuple(self._sizes)

    def __getitem__(self, name: str) -> "_DimSize":
        return _DimSize(self._sizes[name])


class _DimSize:
    def __init__(self, n: int) -> None:
        self._n = n

    def size(self) -> int:
        return self._n


class HFTrainerMixin:
    """Put before `transformers.Trainer` in a class's bases; the model passed is sharded by shardwise.

    `mesh` (keyword, optional): the model's device mesh over all ranks, needed when it has `tp`
    or `cp` dims (their ranks must read the same batches, and those dims must come last); a mesh
    of data-parallel dims only may be left out. Methods it overrides are the Trainer's own:
    `_clip_grad_norm`, `_save`, `_load_from_checkpoint`, `_save_optimizer_and_scheduler`,
    `_load_optimizer_and_scheduler` (transformers 5.24, accelerate 1.15).
    """

    def __init__(self, *args: Any, mesh: Optional[DeviceMesh] = None, **kwargs: Any) -> None:
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        wrappers = [f"{name}={value!r}" for name in ("fsdp", "deepspeed")
                    if (value := getattr(training_args, name, None))]
        if wrappers:
            raise ValueError(f"HFTrainerMixin trains a model shardwise already sharded, and the TrainingArguments ask "
                             f"accelerate to shard it again ({', '.join(wrappers)}): drop those arguments")
        super().__init__(*args, **kwargs)
        trainer: Any = self
        # accelerate's `prepare_model` returns a module so marked unchanged: no DDP wrap, no move
        trainer.model._is_accelerate_prepared = True
        if mesh is not None:
            trainer.accelerator.state.device_mesh = _BatchMesh(mesh)

    def _clip_grad_norm(self, model: torch.nn.Module) -> torch.Tensor:
        trainer: Any = self
        return _clip_grad_norm_across_meshes(model.parameters(), trainer.args.max_grad_norm)

    def _save(self, output_dir: Optional[str] = None, state_dict: Optional[dict[str, Any]] = None) -> None:
        from .. import checkpoint  # checkpoint is imported when a model saves

        trainer: Any = self
        output_dir = output_dir if output_dir is not None else trainer.args.output_dir
        checkpoint.save_pretrained(trainer.model, output_dir)  # every rank writes its own pieces
        if trainer.args.should_save:
            if trainer.processing_class is not None:
                trainer.processing_class.save_pretrained(output_dir)
            torch.save(trainer.args, os.path.join(output_dir, TRAINING_ARGS_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Optional[torch.nn.Module] = None) -> None:
        from .. import checkpoint

        trainer: Any = self
        checkpoint.load_pretrained(model if model is not None else trainer.model, resume_from_checkpoint)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        from .. import checkpoint
        from ..checkpoint.state_dict import get_optimizer_state_dict

        trainer: Any = self
        state = get_optimizer_state_dict(trainer.model, _unwrapped(trainer.optimizer))
        checkpoint.save(state, checkpoint_id=os.path.join(output_dir, OPTIMIZER_DIR))
        if trainer.args.should_save:
            torch.save(trainer.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_optimizer_and_scheduler(self, checkpoint_dir: Optional[str]) -> None:
        if checkpoint_dir is None:
            return
        from .. import checkpoint
        from ..checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

        trainer: Any = self
        optimizer = _unwrapped(trainer.optimizer)
        state = get_optimizer_state_dict(trainer.model, optimizer)  # this rank's layouts, filled in place
        checkpoint.load(state, checkpoint_id=os.path.join(checkpoint_dir, OPTIMIZER_DIR))
        set_optimizer_state_dict(trainer.model, optimizer, state)
        trainer.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint_dir, SCHEDULER_NAME),
                                                        weights_only=True))


def _clip_grad_norm_across_meshes(parameters: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_` (2-norm) for gradients on several meshes (a tp x dp model's
    matrices and its dp-only norms): one norm per mesh, made whole, then combined; returns the
    total norm as a plain tensor, the same on every rank."""
    groups: dict[Optional[DeviceMesh], list[torch.Tensor]] = {}
    for p in parameters:
        if p.grad is not None:
            groups.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    norms = [torch.nn.utils.get_total_norm([p.grad for p in group if p.grad is not None])
             for group in groups.values()]
    whole = [n.full_tensor() if isinstance(n, DTensor) else n for n in norms]  # each mesh's norm, summed over it
    total: torch.Tensor = torch.linalg.vector_norm(torch.stack(whole))
    for mesh, group in groups.items():
        scale = total if mesh is None else DTensor.from_local(total, mesh, [Replicate()] * mesh.ndim)
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, scale)
    return total


def _unwrapped(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside accelerate's `AcceleratedOptimizer`."""
    while not type(optimizer).__module__.startswith("torch.") and hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    return optimizer  # type: ignore[no-any-return]
