"""`ExpertLoadBalancer`: DeepSeek-V3's auxiliary-loss-free load balancing, over every rank's tokens.

DeepSeek-V3 routes by `scores + e_score_correction_bias` and weighs by the scores alone; the
bias is not learned by gradient but nudged once per step towards even load: each expert's
bias rises by `coeff` when it took fewer routes than the mean and falls by `coeff` when it
took more (arXiv 2408.15664; torchtitan's `load_balance_coeff`, 1e-3). transformers keeps
the bias as a buffer and never updates it; a trainer does.

The load that counts is the global batch's. The balancer hooks each experts module and counts
the routes of the tokens it is given, on every forward (micro-batches and accumulation
included), then `step()` sums the counts over the ranks whose tokens differ (`mesh`: the
data-parallel or ep ranks; None in one process) with one all_reduce of every layer's counts
together, updates every router's bias in place and starts counting afresh. Call it once per
optimizer step, on every rank. Ranks that hold the same tokens (tensor parallelism) count the
same routes and are left out of `mesh`.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from .. import _comm as comm
from .._describe import describe
from .._mesh import DeviceMesh

__all__ = ["ExpertLoadBalancer"]

_BIAS = "e_score_correction_bias"


class ExpertLoadBalancer:
    """Count the routes every experts module of `model` takes and nudge its router's
    `e_score_correction_bias` towards even load at each `step()` (see the module docstring)."""

    def __init__(self, model: nn.Module, *, coeff: float = 1e-3, mesh: Optional[DeviceMesh] = None) -> None:
        if isinstance(coeff, bool) or not isinstance(coeff, (int, float)) or not coeff > 0:
            raise ValueError(f"ExpertLoadBalancer(coeff={coeff!r}): a number > 0 (DeepSeek-V3 uses 1e-3)")
        if mesh is not None and (not isinstance(mesh, DeviceMesh) or mesh.ndim != 1):
            raise ValueError(f"ExpertLoadBalancer(mesh={describe(mesh)}): the 1-D mesh of the ranks whose tokens "
                             f"differ (mesh['dp'] or the ep mesh; flatten several dims into one), or None in one process")
        self.coeff, self.mesh = float(coeff), mesh
        self.layers: list[tuple[str, nn.Module, torch.Tensor]] = []  # (path, experts module, its router's bias)
        self.counts: list[Optional[torch.Tensor]] = []
        self.handles: list[Any] = []
        for path, module in model.named_modules():
            bias = _router_bias(module)
            if bias is None:
                continue
            experts = module.get_submodule("experts")
            self.layers.append((path, experts, bias))
            self.counts.append(None)
            self.handles.append(experts.register_forward_pre_hook(self._counter(len(self.layers) - 1), with_kwargs=True))
        if not self.layers:
            raise ValueError(f"{type(model).__name__} has no MoE block whose router keeps an {_BIAS} buffer beside an "
                             f"`experts` module (DeepSeek-V3's layout): there is nothing to balance")

    def _counter(self, k: int) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            index = args[1] if len(args) > 1 else kwargs.get("top_k_index", kwargs.get("router_indices"))
            if not isinstance(index, torch.Tensor) or index.is_meta:
                return
            bias = self.layers[k][2]
            flat = index.detach().reshape(-1).to(torch.int64)
            counted = torch.zeros(bias.numel(), dtype=torch.int64, device=flat.device)
            counted.scatter_add_(0, flat, torch.ones_like(flat))
            before = self.counts[k]
            self.counts[k] = counted if before is None else before + counted

        return hook

    def load(self) -> list[torch.Tensor]:
        """Routes each expert took since the last `step()`, per MoE layer, on this rank."""
        return [c if c is not None else torch.zeros(b.numel(), dtype=torch.int64) for c, (_, _, b) in
                zip(self.counts, self.layers)]

    @torch.no_grad()
    def step(self) -> list[torch.Tensor]:
        """Sum the counts over `mesh`, update every router's bias in place, start counting afresh;
        returns the global load per layer."""
        local = self.load()
        together = torch.cat(local)
        if self.mesh is not None and self.mesh.size() > 1:
            record = comm.AllReduce(group=self.mesh.get_group(0), size=self.mesh.size(), shape=tuple(together.shape),
                                    dtype=together.dtype, op="sum", mesh_dims=(0,))
            together = comm.run(record, together.contiguous())
        loads = list(torch.split(together, [c.numel() for c in local]))
        for (_, _, bias), load in zip(self.layers, loads):
            towards = torch.sign(load.double().mean() - load.double()).to(bias.dtype)  # + under-loaded, - over-loaded
            bias.add_(towards.to(bias.device), alpha=self.coeff)
        self.counts = [None] * len(self.layers)
        return loads

    def remove(self) -> None:
        """Stop counting (the hooks removed)."""
        for h in self.handles:
            h.remove()
        self.handles = []


def _router_bias(block: nn.Module) -> Optional[torch.Tensor]:
    """The `e_score_correction_bias` of a MoE block's router beside its `experts`, if it has one."""
    if "experts" not in block._modules:
        return None
    for name, child in block.named_children():
        if name != "experts" and isinstance(getattr(child, _BIAS, None), torch.Tensor):
            bias: torch.Tensor = getattr(child, _BIAS)
            return bias
    return None
