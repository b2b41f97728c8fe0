"""Semi-synchronous training across replica groups: `LocalSGD` and `DiLoCo` (torchft's, on shardwise).

Each replica group steps its own (inner) optimizer alone, on its own batches, and the
groups meet only every `sync_every` steps: one quorum, one averaging, one vote per sync
instead of per step. Both keep a *backup*, the parameters of the last sync that committed
(this rank's pieces, detached copies), so a sync that fails changes nothing: the model goes
back to the backup, and every group is again where all of them last agreed.

A sync, after the inner optimizer's `sync_every`-th step (its `step()` post-hook):

| part | `LocalSGD` | `DiLoCo` |
|---|---|---|
| `start_quorum()` | a group behind the quorum heals: model, inner optimizer, backup | ... and the outer optimizer |
| averaged over the live groups | the parameters `p` | the pseudo-gradients `backup - p` |
| (then) | | `p <- backup` |
| `should_commit()` true | `p <- mean(p)`, `backup <- p` | `p.grad <- mean(backup - p)`, outer `step()`, `backup <- p` |
| `should_commit()` false | `p <- backup` | (`p` is the backup already; no outer step) |

One all_reduce per dtype carries every parameter (or pseudo-gradient) of the model,
flattened. A DTensor parameter (`fully_shard`, TP inside a group) is averaged by its local
piece: groups have the same layout, so piece `i` of one group meets piece `i` of another.

A healing group receives, at a sync's `start_quorum`, the manager's constructor state (the
user's model and inner optimizer, as in per-step training) and what these classes register
with `Manager.register_state_dict_fn`: the backup (`"LocalSGD"`) or the backup and the outer
optimizer's state (`"DiLoCo/fragment0"`). It then averages the live group's state as its own
contribution (as in torchft: that group's batches count twice in that sync).

Where this differs from torchft:
- `LocalSGD` keeps a backup and restores it when a sync does not commit (torchft leaves each
  group at its own local parameters, or a half-averaged state), and registers it for healing.
- Averaging is one all_reduce per dtype (torchft: one per parameter, or buckets when
  `use_bucketization`); `use_bucketization` and `bucket_cap_mb` are accepted and change
  nothing.
- `DiLoCo` takes one fragment (a model, or a list of one): streaming DiLoCo (several
  fragments, `fragment_sync_delay`, `fragment_update_alpha`) and `should_quantize` are refused
  with a ValueError naming the option. The backup lives beside the parameters unless
  `backup_device` says otherwise (torchft: on the CPU by default).
- The optimizers are checked against the model: an inner optimizer over other tensors, or an
  outer one that misses a trainable parameter, is refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import TracebackType
from typing import Any, Optional, TypeVar, Union

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .._tensor import DTensor
from ._manager import Manager

__all__ = ["DiLoCo", "LocalSGD"]

S = TypeVar("S", bound="_SemiSync")


def _local(p: torch.Tensor) -> torch.Tensor:
    """`p`'s piece on this rank (itself for a plain tensor); call under `torch.no_grad()`, where
    a DTensor hands out its own piece, so writing it writes `p`."""
    return p.to_local() if isinstance(p, DTensor) else p


def _like(p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`local` (this rank's piece) as a tensor of `p`'s kind and layout: a gradient for `p`."""
    if isinstance(p, DTensor):
        return DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
    return local


class _Backup:
    """The parameters of the last committed sync: one detached copy of each piece."""

    def __init__(self, params: list[torch.Tensor], device: Optional[torch.device], pin_memory: bool) -> None:
        self.params = params
        with torch.no_grad():
            self.saved = [_copy(_local(p), device, pin_memory) for p in params]

    def save(self) -> None:
        """backup <- parameters"""
        with torch.no_grad():
            for b, p in zip(self.saved, self.params):
                b.copy_(_local(p))

    def restore(self) -> None:
        """parameters <- backup"""
        with torch.no_grad():
            for b, p in zip(self.saved, self.params):
                _local(p).copy_(b)

    def state_dict(self) -> list[torch.Tensor]:
        return list(self.saved)

    def load_state_dict(self, state: Any, who: str) -> None:
        shapes = [list(b.shape) for b in self.saved]
        theirs = [list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__ for t in state] \
            if isinstance(state, list) else type(state).__name__
        if theirs != shapes:
            raise ValueError(f"{who}: a live group's backup holds pieces {theirs}, this group's parameters are "
                             f"{shapes}: every group must wrap the same model, sharded alike")
        with torch.no_grad():
            for b, t in zip(self.saved, state):
                b.copy_(t)


def _copy(t: torch.Tensor, device: Optional[torch.device], pin_memory: bool) -> torch.Tensor:
    out = torch.empty(t.shape, dtype=t.dtype, device=device if device is not None else t.device)
    if pin_memory and out.device.type == "cpu" and torch.cuda.is_available():
        out = out.pin_memory()
    return out.copy_(t)


def _average(manager: Manager, tensors: list[torch.Tensor]) -> None:
    """Average each of `tensors` in place over the quorum's members: one all_reduce per dtype. A
    failure is recorded by the manager (the sync will not commit) and leaves them as they were."""
    for dtype in sorted({t.dtype for t in tensors}, key=str):
        same = [t for t in tensors if t.dtype == dtype]
        flat = torch.cat([t.reshape(-1) for t in same])
        manager.allreduce(flat)
        offset = 0
        for t in same:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


def _check_sync_every(who: str, sync_every: int) -> None:
    if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
        raise ValueError(f"{who}(sync_every={sync_every!r}): the inner steps between syncs, an int of at least 1")


def _check_optimizer(who: str, name: str, optimizer: Any, params: list[torch.Tensor], cover: bool) -> None:
    """`optimizer` steps only `params` (and, if `cover`, every one of them that requires grad)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"{who}({name}=...): a torch.optim.Optimizer, got {type(optimizer).__name__} (pass the "
                        "optimizer itself, not a wrapper such as shardwise.ft.Optimizer)")
    mine = {id(p) for p in params}
    held = [p for group in optimizer.param_groups for p in group["params"]]
    stray = sum(1 for p in held if id(p) not in mine)
    missing = sum(1 for p in params if p.requires_grad and id(p) not in {id(q) for q in held})
    if stray or not held:
        raise ValueError(f"{who}({name}=...): it holds {len(held)} tensors, {stray} of which are not the model's "
                         f"parameters: make it over the wrapped model's parameters (model.parameters()), after "
                         "any fully_shard of the model")
    if cover and missing:
        raise ValueError(f"{who}({name}=...): {missing} of the model's {len(params)} trainable parameters are not "
                         "in it; they would go back to the backup at every sync: make it over model.parameters()")


class _SemiSync:
    """The inner optimizer's post-hook that counts steps and syncs every `sync_every`."""

    def __init__(self, manager: Manager, optimizer: torch.optim.Optimizer, sync_every: int) -> None:
        self._manager, self._inner, self._sync_every = manager, optimizer, sync_every
        self._local_step = 0
        self._hooks: list[RemovableHandle] = []

    def __enter__(self: S) -> S:
        if self._hooks:
            raise ValueError(f"{type(self).__name__} is entered already: use one `with` block at a time")
        self._hooks.append(self._inner.register_step_post_hook(self._step_post_hook))
        return self

    def __exit__(self, exc_type: Optional[type[BaseException]], exc_value: Optional[BaseException],
                 traceback: Optional[TracebackType]) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    def _step_post_hook(self, _optim: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        self._local_step += 1
        if self._local_step >= self._sync_every:
            self.sync()

    def sync(self) -> bool:
        """Meet the other groups now (see the module docstring); returns whether the sync committed."""
        self._local_step = 0
        self._manager.start_quorum()
        return self._perform_sync()

    def _perform_sync(self) -> bool:
        raise NotImplementedError


class LocalSGD(_SemiSync):
    """Every `sync_every` steps of `optimizer`, the parameters of `model` averaged over the live
    replica groups (`with LocalSGD(manager, model, optimizer, sync_every): ...train...`)."""

    def __init__(self, manager: Manager, model: nn.Module, optimizer: torch.optim.Optimizer,
                 sync_every: int) -> None:
        _check_sync_every("LocalSGD", sync_every)
        params: list[torch.Tensor] = list(model.parameters())
        _check_optimizer("LocalSGD", "optimizer", optimizer, params, cover=False)
        super().__init__(manager, optimizer, sync_every)
        self._model = model
        self._backup = _Backup(params, None, False)
        manager.register_state_dict_fn("LocalSGD", lambda s: self._backup.load_state_dict(s, "LocalSGD"),
                                       self._backup.state_dict)

    def _perform_sync(self) -> bool:
        with torch.no_grad():
            averaged = [_local(p).clone() for p in self._backup.params]
            _average(self._manager, averaged)
            committed = self._manager.should_commit()
            if committed:
                for p, a in zip(self._backup.params, averaged):
                    _local(p).copy_(a)
                self._backup.save()
            else:
                self._backup.restore()
        return committed


class DiLoCo(_SemiSync):
    """DiLoCo: `inner_optimizer` steps each group alone; every `sync_every` steps the groups
    average their pseudo-gradients (last synced parameters minus their own) and
    `outer_optimizer` applies the average to the last synced parameters, on every group alike
    (`with DiLoCo(manager, [model], inner, outer, sync_every): ...train...`)."""

    def __init__(self, manager: Manager, model_fragments: Union[nn.Module, Sequence[nn.Module]],
                 inner_optimizer: torch.optim.Optimizer,
                 outer_optimizer: Union[torch.optim.Optimizer, Sequence[torch.optim.Optimizer]], sync_every: int,
                 backup_device: Optional[torch.device] = None, pin_memory: bool = True,
                 use_bucketization: bool = False, bucket_cap_mb: Optional[int] = None,
                 should_quantize: bool = False, fragment_sync_delay: int = 0,
                 fragment_update_alpha: float = 0.0) -> None:
        _check_sync_every("DiLoCo", sync_every)
        fragments = [model_fragments] if isinstance(model_fragments, nn.Module) else list(model_fragments)
        outers = list(outer_optimizer) if isinstance(outer_optimizer, Sequence) else [outer_optimizer]
        refused = [f"model_fragments: {len(fragments)} fragments (streaming DiLoCo)"] if len(fragments) != 1 else []
        refused += [f"outer_optimizer: a list of {len(outers)}"] if len(outers) != 1 else []
        refused += [f"fragment_sync_delay={fragment_sync_delay}"] if fragment_sync_delay != 0 else []
        refused += [f"fragment_update_alpha={fragment_update_alpha}"] if fragment_update_alpha != 0.0 else []
        refused += ["should_quantize=True"] if should_quantize else []
        if refused:
            raise ValueError(f"DiLoCo({', '.join(refused)}): not built in shardwise; DiLoCo syncs one fragment, "
                             "the whole model, unquantized: pass model_fragments=[model] (or the model), one outer "
                             "optimizer, fragment_sync_delay=0, fragment_update_alpha=0.0, should_quantize=False")
        if not isinstance(fragments[0], nn.Module):
            raise TypeError(f"DiLoCo(model_fragments=...): an nn.Module or a list of one, got "
                            f"{type(fragments[0]).__name__}")
        params: list[torch.Tensor] = list(fragments[0].parameters())
        _check_optimizer("DiLoCo", "inner_optimizer", inner_optimizer, params, cover=False)
        _check_optimizer("DiLoCo", "outer_optimizer", outers[0], params, cover=True)
        if outers[0] is inner_optimizer:
            raise ValueError("DiLoCo: inner_optimizer and outer_optimizer are the same object; the outer one "
                             "steps only at syncs (e.g. torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, "
                             "nesterov=True)): make a second optimizer")
        super().__init__(manager, inner_optimizer, sync_every)
        self._model, self._outer = fragments[0], outers[0]
        self._backup = _Backup(params, backup_device, pin_memory)
        manager.register_state_dict_fn("DiLoCo/fragment0", self._load_state_dict, self._state_dict)

    def _state_dict(self) -> dict[str, Any]:
        return {"backup": self._backup.state_dict(), "outer": self._outer.state_dict()}

    def _load_state_dict(self, state: Any) -> None:
        if not isinstance(state, dict) or set(state) != {"backup", "outer"}:
            raise ValueError(f"DiLoCo: a live group's state {str(state)[:80]}: a dict of 'backup' and 'outer'")
        self._backup.load_state_dict(state["backup"], "DiLoCo")
        self._outer.load_state_dict(state["outer"])

    def _perform_sync(self) -> bool:
        params = self._backup.params
        with torch.no_grad():
            pseudo = [b.to(_local(p).device) - _local(p) for b, p in zip(self._backup.saved, params)]
            _average(self._manager, pseudo)
            self._backup.restore()
        committed = self._manager.should_commit()
        if committed:
            for p, g in zip(params, pseudo):
                p.grad = _like(p, g)
            self._outer.step()
            self._backup.save()
        self._outer.zero_grad()
        return committed
