"""`ContextParallel(seq_dim=1)`: context parallelism as a plan style, for a model's whole forward.

    parallelize_module(model, mesh["cp"], ContextParallel())
    loss = model(input_ids=ids, labels=ids).loss   # ids whole on every cp rank, as one process takes them
    loss.backward()                                # every gradient equals one process's

The style wraps the module's forward. Each call:

1. splits every tensor argument whose `seq_dim` has the sequence's length (the length of
   `input_ids` / `inputs_embeds`, else of the first tensor argument) into this rank's tokens,
   as `context_parallel` cuts its buffers (head-tail by default), on copies: the caller's
   tensors are not touched;
2. gives the model the global `position_ids` of those tokens when it takes them and the
   caller passed none, so rotary tables are indexed by global position (given ones are
   split, and documents packed in a sample are kept apart, as `context_parallel`'s
   `position_ids=` does);
3. runs the forward with every `F.scaled_dot_product_attention` context-parallel;
4. for a Hugging Face model given `labels` (one with a `loss_function`): the labels are
   shifted once over the whole sequence (`shift_labels`) and counted (`num_items_in_batch`,
   unless given), so each rank's loss is its tokens' share of the whole mean, and the loss
   returned is the whole sequence's on every rank (one all_reduce of a number) while its
   gradient stays this rank's share.

The cp ranks hold the same parameters, and each computes the gradient of its own tokens'
share: the style sums them over cp at the end of each backward pass (a `GroupSum`, one
all_reduce per bucket; gradients accumulated over several passes are summed once each).
It asks the end-of-backward registry who already reduces each parameter: one that a
reducer over ranks including the cp ranks reduces (a `fully_shard` unit over dp x cp, the
HSDP / torchtitan `dp_shard_cp` layout) is left to it, and the loss's gradient is scaled
by cp, so that unit's mean over dp x cp ranks is one process's gradient, averaged over
data-parallel replicas only. One reduced over other ranks only (a unit or data_parallel
over dp alone) would miss the sum over cp: that is refused, naming both.

Layers transformers checkpoints (`model.gradient_checkpointing_enable()`) recompute in
backward with context-parallel attention, as their first run had it (autograd runs
backward without the torch function mode that context parallelism is).

The model's outputs other than the loss stay this rank's tokens (logits included:
`context_parallel_unshard` gathers them). A padding mask with zeros and 4-D masks are
refused: pack documents and mark them by `position_ids` instead.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn

from .. import _comm as comm
from .._mesh import AbstractMesh, DeviceMesh
from .._placement import Partial, Placement, Replicate
from .._tensor import DTensor, GroupSum, averaged_within_layout, caller_place, reducers_at
from ._context_parallel import cp_group, split_sequence
from ._cp_attention import CpAttention
from ._cp_comm import CpGroup
from ._cp_session import recomputed_under
from ._style import ParallelStyle

__all__ = ["ContextParallel"]

_IGNORE = -100  # transformers' ignore index


@dataclass(frozen=True, kw_only=True)
class ContextParallel(ParallelStyle):
    """Run a module's forward context-parallel over a 1-D cp mesh (see the module docstring).

    `seq_dim`: the sequence dim of the module's inputs ((batch, seq) ids: 1). Parameters are
    left as they are (plain, or placed by other styles and `fully_shard`)."""

    seq_dim: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.seq_dim, bool) or not isinstance(self.seq_dim, int) or self.seq_dim < 0:
            raise TypeError(f"ContextParallel(seq_dim={self.seq_dim!r}): a non-negative int, the sequence dim of "
                            "the module's inputs (1 for (batch, seq) ids)")

    def validate(self, module: nn.Module, device_mesh: AbstractMesh) -> list[str]:
        problems = super().validate(module, device_mesh)
        if getattr(module.forward, "_shardwise_cp", False):
            problems.append("the module's forward already runs context-parallel (ContextParallel applied twice)")
        return problems

    def param_layouts(self, module: nn.Module, device_mesh: AbstractMesh) -> Mapping[str, tuple[Placement, ...]]:
        return {}

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        names = device_mesh.mesh_dim_names
        runner = _Runner(module, cp_group(device_mesh, "ContextParallel"), self.seq_dim, names[0] if names else "cp")
        forward = functools.wraps(module.forward)(runner)
        forward._shardwise_cp = True  # type: ignore[attr-defined]
        module.forward = forward  # an instance attribute: nn.Module.__call__ (and its hooks) run it
        return module


class _WholeLoss(torch.autograd.Function):
    """Forward: the cp ranks' shares summed (the whole sequence's loss). Backward: this rank's
    share's gradient, times `scale`."""

    @staticmethod
    def forward(ctx: Any, share: torch.Tensor, cp: CpGroup, scale: float) -> torch.Tensor:
        ctx.scale = scale
        record = comm.AllReduce(group=cp.group, size=cp.size, shape=tuple(share.shape), dtype=share.dtype, op="sum",
                                mesh_dims=(cp.mesh_dim,))
        return comm.run(record, share.detach())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return grad * ctx.scale if ctx.scale != 1 else grad, None, None


class _Runner:
    """The wrapped forward of one module: split, run, make the loss whole; the gradient sums."""

    def __init__(self, module: nn.Module, cp: CpGroup, seq_dim: int, over: str) -> None:
        self.forward = module.forward
        self.module_ref = module  # (the module keeps this runner as its forward: a cycle, freed by gc)
        self.cp, self.seq_dim = cp, seq_dim
        self.signature = inspect.signature(self.forward)
        params = self.signature.parameters
        self.var_kw = next((n for n, p in params.items() if p.kind is inspect.Parameter.VAR_KEYWORD), None)
        self.hf = hasattr(module, "loss_function") and "labels" in params
        self.hooked: tuple[int, ...] = ()
        self.over, self.where = over, caller_place()  # (the parallelize_module call: the user's line)
        self.scale = 1.0
        self.sums = self._sums(1.0)
        self.length = 0  # this call's sequence length (set by _prepare)
        self.made_positions = False  # this call's position ids were made 0..S-1 here

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        bound = self.signature.bind(*args, **kwargs)
        named = dict(bound.arguments)
        extra = dict(named.pop(self.var_kw, None) or {}) if self.var_kw else {}
        problem: Optional[Exception] = None
        whole_loss = False
        positions = None
        try:
            whole_loss, positions = self._prepare(named, extra)
        except (TypeError, ValueError) as exc:
            problem = exc
        self._hook_gradients()
        names = [n for n, v in {**named, **extra}.items() if self._along(v)]
        tensors = {n: (named[n] if n in named else extra[n]).clone() for n in names}
        for n, t in tensors.items():
            (named if n in named else extra)[n] = t
        if problem is None and not tensors:
            problem = ValueError(f"ContextParallel: no tensor argument of {type(self.module_ref).__name__}.forward has "
                                 f"a dim {self.seq_dim} of the sequence's length ({self.length}); pass (batch, seq) "
                                 "inputs, or set seq_dim")
        buffers = list(tensors.values())
        # whether the loss is made whole (one all_reduce after the call) must agree over cp
        agree = ("whether labels were passed (1) or not (0)", int(whole_loss))
        with split_sequence(self.cp, buffers, [self.seq_dim] * len(buffers), {id(b) for b in buffers}, positions,
                            problem, self.made_positions, agree) as attention, \
                _checkpoints_under(self.module_ref, attention):
            if self.var_kw:
                named[self.var_kw] = extra
            call = inspect.BoundArguments(self.signature, named)  # type: ignore[arg-type,unused-ignore]
            out = self.forward(*call.args, **call.kwargs)
        if whole_loss:
            out = self._whole(out)
        return out

    def _along(self, value: Any) -> bool:
        return (isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.dim() > self.seq_dim
                and value.size(self.seq_dim) == self.length)

    def _prepare(self, named: dict[str, Any], extra: dict[str, Any]) -> tuple[bool, Optional[torch.Tensor]]:
        """Find the sequence length; add positions, shifted labels and their count; check masks.
        Returns (whether the loss is made whole, the whole position ids: the model may build
        its mask from them, and context-parallel attention then recognises and rebuilds it)."""
        both = {**named, **extra}
        first = next((both[n] for n in ("input_ids", "inputs_embeds") if isinstance(both.get(n), torch.Tensor)),
                     None)
        if first is None:
            first = next((v for v in both.values() if isinstance(v, torch.Tensor) and v.dim() > self.seq_dim), None)
        self.length = 0
        if first is None:
            raise ValueError(f"ContextParallel: {type(self.module_ref).__name__}.forward got no tensor with a dim "
                             f"{self.seq_dim} to split; pass (batch, seq) inputs, or set seq_dim")
        self.length = first.size(self.seq_dim)
        mask = both.get("attention_mask")
        if isinstance(mask, torch.Tensor):
            if mask.dim() != 2 or mask.size(1) != self.length:
                raise ValueError(f"ContextParallel: attention_mask of shape {tuple(mask.shape)}: takes a (batch, "
                                 f"{self.length}) mask of ones; pack documents and mark them by position_ids instead")
            if not bool(mask.all()):
                raise ValueError(f"ContextParallel: attention_mask has {int((mask == 0).sum())} padded positions: "
                                 "padding inside a context-parallel sequence is not supported; pack documents "
                                 "(position_ids restarting at each) or drop the padding")
        accepts = set(self.signature.parameters) | ({"*"} if self.var_kw else set())
        given = both.get("position_ids")
        self.made_positions = given is None and "position_ids" in accepts
        if self.made_positions:
            batch = first.size(0) if self.seq_dim > 0 else 1
            given = torch.arange(self.length, device=first.device).expand(batch, self.length).clone()
            named["position_ids"] = given
        labels = both.get("labels")
        whole_loss = self.hf and isinstance(labels, torch.Tensor) and self.var_kw is not None
        if whole_loss:
            assert isinstance(labels, torch.Tensor)
            shift = both.get("shift_labels")
            if shift is None:
                pad = torch.full_like(labels.narrow(-1, 0, 1), _IGNORE)
                shift = torch.cat([labels.narrow(-1, 1, labels.size(-1) - 1), pad], -1)
            named["labels"] = shift
            extra["shift_labels"] = shift.clone()
            if extra.get("num_items_in_batch") is None:
                extra["num_items_in_batch"] = (shift != _IGNORE).sum()
        return whole_loss, given if isinstance(given, torch.Tensor) else None

    def _whole(self, out: Any) -> Any:
        loss = out.get("loss") if isinstance(out, Mapping) else (out[0] if isinstance(out, tuple) and out else None)
        if not isinstance(loss, torch.Tensor):
            return out
        if isinstance(loss, DTensor):  # under loss_parallel: a DTensor over the tp mesh; its pieces are summed over cp
            # (a Partial piece's gradient is the whole gradient: declared Replicate, not Partial)
            back = tuple(Replicate() if isinstance(p, Partial) else p for p in loss.placements)
            summed = _WholeLoss.apply(  # type: ignore[no-untyped-call]
                loss.to_local(grad_placements=back), self.cp, self.scale)
            whole = DTensor.from_local(summed, loss.device_mesh, loss.placements, shape=loss.shape,
                                       stride=loss.stride())
        else:
            whole = _WholeLoss.apply(loss, self.cp, self.scale)  # type: ignore[no-untyped-call]
        if isinstance(out, Mapping):
            out["loss"] = whole  # type: ignore[index]
            return out
        return (whole,) + tuple(out[1:])

    # -- gradients ---------------------------------------------------------------------------

    def _hook_gradients(self) -> None:
        """Sum over cp the gradients of the parameters that no reducer over ranks including the
        cp ranks reduces (again when the module's parameters were replaced since the last call)."""
        self.sums.recover()
        key = tuple(id(p) for m in self.module_ref.modules() for p in m._parameters.values()
                    if p is not None and p.requires_grad)
        if key == self.hooked:
            return
        self.sums.release()
        slots = [(f"{prefix}.{n}" if prefix else n, p) for prefix, m in self.module_ref.named_modules()
                 for n, p in m._parameters.items() if p is not None and p.requires_grad]
        owners, want = reducers_at("replicas"), set(self.cp.ranks)
        covered = {id(p) for _, p in slots if id(p) in owners and want <= set(owners[id(p)][1].ranks)}
        self.scale = float(self.cp.size) if covered else 1.0
        self.sums = self._sums(self.scale)
        # whole experts per rank, whose token dispatch already gathers every cp rank's share
        dispatched = averaged_within_layout(self.cp.ranks, ("avg", "sum"))
        self.sums.take([(n, p) for n, p in slots if id(p) not in covered | dispatched], _HINT)  # (refused: asked again)
        self.hooked = key

    def _sums(self, scale: float) -> GroupSum:
        cp = self.cp
        return GroupSum("ContextParallel", cp.group, cp.size, cp.ranks, over=self.over, where=self.where,
                        scale=scale, mesh_dims=(cp.mesh_dim,))


_HINT = ("ContextParallel sums every parameter's gradient over the cp ranks; one already reduced over other "
         "ranks (a fully_shard unit or data_parallel over dp alone) needs that sum as well: shard it over a mesh "
         "that holds the cp ranks too (fully_shard(module, mesh=mesh['dp', 'cp']._flatten('dp_cp')), the "
         "dp_shard_cp layout), whose reduction then covers cp")


@contextlib.contextmanager
def _checkpoints_under(module: nn.Module, attention: CpAttention) -> Iterator[None]:
    """While the forward runs, the layers transformers checkpoints (`gradient_checkpointing_enable`)
    recompute in backward with context-parallel attention on, as their first run had it."""
    changed = []
    for m in module.modules():
        func = m.__dict__.get("_gradient_checkpointing_func")
        if getattr(m, "gradient_checkpointing", False) and callable(func):
            setattr(m, "_gradient_checkpointing_func", functools.partial(_checkpoint_under, func, attention))
            changed.append((m, func))
    try:
        yield
    finally:
        for m, func in changed:
            setattr(m, "_gradient_checkpointing_func", func)


def _checkpoint_under(checkpoint: Callable[..., Any], attention: CpAttention, fn: Callable[..., Any], *args: Any,
                      **kwargs: Any) -> Any:
    return checkpoint(recomputed_under(attention, fn), *args, **kwargs)
