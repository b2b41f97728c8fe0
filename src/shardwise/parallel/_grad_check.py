"""The first backward's check: plain parameters beside tensor-parallel layers got one gradient on every rank.

`parallelize_module` leaves what its plan does not name plain, as torch does, and the model
between the parallelized layers runs on plain local tensors. That is right where those
tensors are the same on every rank (embeddings, norms over whole hidden vectors, a router).
It is silently wrong for a module with parameters that sits where each rank holds its own
share of the activations: Qwen3's `q_norm` / `k_norm` between the column-split q/k
projections and the row-split output projection see only this rank's heads, so each
rank's gradient of their weights is a partial sum, each rank steps its own copy, and the
copies drift apart (under torch as well). Nothing fails; the loss is just off.

So at the end of the first backward pass the ranks of the tensor-parallel mesh compare a
fingerprint of every plain parameter's gradient (shape and three sums: one small
all_gather, once, after every reduction of that pass: the end-of-backward registry's
`checks` phase) and, where they differ, raise on every rank a ValueError naming the
parameters and the style that fixes them (`ReplicateParallel`, transformers'
"replicated_with_grad_allreduce"). Then the hooks are removed: later steps cost nothing.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .. import _comm as comm
from .._mesh import DeviceMesh
from .._mesh import DryMesh
from .._tensor import FINGERPRINT_WIDTH, DTensor, Step, arm, fingerprint, is_armed, same_fingerprint

__all__ = ["PlainGradientCheck"]

_NO_GRAD = [-2] * FINGERPRINT_WIDTH


class PlainGradientCheck(Step):
    """Watches `module`'s plain parameters until the end of the first backward pass that gives one a gradient
    (a step of the end-of-backward registry's last phase, `checks`: the gradients are settled by then)."""

    phase = "checks"

    def __init__(self, module: nn.Module, mesh: DeviceMesh) -> None:
        self.module = module
        self.mesh = mesh
        self.names = [n for n, p in module.named_parameters() if p.requires_grad and not isinstance(p, DTensor)]
        self.handles: list[Any] = []

    @classmethod
    def install(cls, module: nn.Module, mesh: DeviceMesh) -> None:
        """Hook `module`'s plain parameters (none: nothing to check, no hook)."""
        if isinstance(mesh, DryMesh) or mesh.size() == 1 or mesh.get_coordinate() is None:
            return
        check = cls(module, mesh)
        params = dict(module.named_parameters())
        for name in check.names:
            check.handles.append(params[name].register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call]
                check._accumulated))

    def _accumulated(self, _param: torch.Tensor) -> None:
        if self.handles and not is_armed(self):
            arm(self)

    def finish(self) -> None:
        # plain parameters' DTensor gradients were made whole (the `layout` phase): compared as such
        for h in self.handles:
            h.remove()
        self.handles.clear()
        params = dict(self.module.named_parameters())
        mine: list[int] = []
        names = [n for n in self.names if n in params and not isinstance(params[n], DTensor)]
        for name in names:
            grad = params[name].grad
            mine.extend(_NO_GRAD if grad is None or grad.is_meta else fingerprint(grad))
        rows = comm.gather_over_mesh(mine, self.mesh.get_all_groups(), self.mesh.shape)
        ranks = self.mesh.mesh.flatten().tolist()
        odd: list[str] = []
        differing: set[int] = set()
        for k, name in enumerate(names):
            pieces = [row[k * FINGERPRINT_WIDTH:(k + 1) * FINGERPRINT_WIDTH] for row in rows]
            differ = [r for r, p in zip(ranks, pieces) if not same_fingerprint(p, pieces[0])]
            if differ:
                odd.append(name)
                differing.update(differ)
        if odd:
            fix = ", ".join(f"'{p}': ReplicateParallel()" for p in sorted({_pattern(n.rpartition(".")[0]) for n in odd}))
            raise ValueError(
                f"parallelize_module left {len(odd)} plain parameter(s) whose gradients differ between the ranks of "
                f"{self.mesh!r} (rank {ranks[0]} and rank(s) {sorted(differing)}) after the first backward: "
                f"{', '.join(odd)}. Their modules run on this rank's share of the activations (its heads or "
                f"columns), so each rank's gradient is a partial sum and each rank would step its own copy: "
                f"training would drift silently. Add them to the plan as ReplicateParallel() (replicated, "
                f"gradients summed over the mesh; transformers' 'replicated_with_grad_allreduce'): {{{fix}}}; "
                f"or, if their inputs should be the same on every rank, give every rank the same inputs"
            )


def _pattern(path: str) -> str:
    """A module path with its layer numbers as wildcards: `model.layers.*.self_attn.q_norm`."""
    return ".".join("*" if part.isdigit() else part for part in path.split("."))
