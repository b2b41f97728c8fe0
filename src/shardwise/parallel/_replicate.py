"""`ReplicateParallel`: a module replicated on every rank that runs on this rank's share of the activations.

Between a column-parallel and a row-parallel layer each rank holds its own heads (or its own
columns). A module there with parameters of its own, such as Qwen3's `q_norm` / `k_norm`
(an RMSNorm over each head's vector, one weight shared by every head), computes the same way
on every rank, with the same weights, on different heads: its forward needs no
communication, but each rank's gradient of those weights covers only its heads, and the
whole gradient is their sum. Left plain, each rank would step its weights with its own
partial sum and the copies would drift apart, silently (the same happens under torch).

Under `ReplicateParallel` the module's parameters are replicated DTensors; given plain
(local) inputs, its own forward runs on their local pieces, whose gradients flow back as
`Partial` terms and are summed over the mesh once, at the end of backward, with the other
gradients (`_tensor._grad_reduce`). Given DTensor inputs it runs on DTensors, and their
layouts say what to reduce. The style registers itself with the end-of-backward registry as
those parameters' reducer at level `layout` (the sum over its mesh), so the public query
(`shardwise.debug.gradient_reducers`) names it. transformers calls this style "replicated_with_grad_allreduce";
torchtitan writes `SequenceParallel(sequence_dim=2)` for the same modules, which needs the
split dim.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from .._mesh import AbstractMesh, DeviceMesh
from .._placement import Partial, Placement, Replicate
from .._tensor import DTensor, GradientReducer, caller_place, register
from ._distribute import place_parameter
from ._local_params import local_parameters
from ._style import ParallelStyle

__all__ = ["ReplicateParallel"]


@dataclass(frozen=True, kw_only=True)
class ReplicateParallel(ParallelStyle):
    """Replicate a module's parameters; run it on local inputs; sum their gradients over the mesh.

    >>> ReplicateParallel()
    ReplicateParallel(src_data_rank=0)
    """

    src_data_rank: Optional[int] = 0

    def validate(self, module: nn.Module, device_mesh: AbstractMesh) -> list[str]:
        problems = super().validate(module, device_mesh)
        if not any(True for _ in module.parameters()):
            problems.append(f"ReplicateParallel replicates a module's parameters; {type(module).__name__} has none")
        return problems

    def param_layouts(self, module: nn.Module, device_mesh: AbstractMesh) -> Mapping[str, tuple[Placement, ...]]:
        return {name: (Replicate(),) for name, _ in module.named_parameters()}

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        owners: list[tuple[nn.Module, list[str]]] = []
        placed: list[tuple[str, nn.Module, str]] = []
        for path, sub in module.named_modules():
            names = [k for k, p in sub._parameters.items() if p is not None]
            for k in names:
                where = f"{type(module).__name__}{'.' + path if path else ''}.{k}"
                place_parameter(sub, k, (Replicate(),), device_mesh, src_data_rank=self.src_data_rank, where=where)
                placed.append((where, sub, k))
            if names:
                owners.append((sub, names))
        registered = _Registered(device_mesh, placed)
        register(registered)
        forward = module.forward

        def replicated_forward(*args: Any, **kwargs: Any) -> Any:
            if any(isinstance(a, DTensor) for a in (*args, *kwargs.values())):
                return forward(*args, **kwargs)  # DTensors: their layouts say what to reduce
            with contextlib.ExitStack() as stack:
                for sub, names in owners:  # each rank's gradient is a term of the whole one
                    stack.enter_context(local_parameters(sub, names, grad_placements=(Partial(),)))
                return forward(*args, **kwargs)

        replicated_forward._shardwise_reducer = registered  # type: ignore[attr-defined]  # (registered weakly)
        module.forward = replicated_forward
        return module


class _Registered:
    """A style as the end-of-backward registry sees it: the reducer, at level `layout`, of the
    parameters it placed, found where it placed them (`(name, module, attribute)`, the module
    held weakly). ReplicateParallel sums over its mesh; ExpertParallel's token dispatch averages
    over ep. Not the parameters themselves: a weak reference on a parameter would stop
    `module.to(...)` from swapping it in place, as it does for DTensor parameters."""

    def __init__(self, mesh: DeviceMesh, params: list[tuple[str, nn.Module, str]], registrant: str = "ReplicateParallel",
                 op: str = "sum") -> None:
        names = mesh.mesh_dim_names
        ranks = tuple(int(r) for r in mesh.mesh.flatten().tolist())
        over = f"mesh dim {names[0]!r}" if names else "its 1-D mesh"
        self.record = GradientReducer(registrant, "layout", op, ranks, over, caller_place())
        self.params = [(name, weakref.ref(owner), attr) for name, owner, attr in params]

    def gradient_reducer(self) -> GradientReducer:
        return self.record

    def reduced_params(self) -> list[tuple[str, torch.Tensor]]:
        found: list[tuple[str, torch.Tensor]] = []
        for name, ref, attr in self.params:
            owner = ref()
            p = owner._parameters.get(attr) if owner is not None else None
            if p is not None:
                found.append((name, p))
        return found
