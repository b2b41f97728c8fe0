"""The two contenders behind one interface: shardwise and torch.distributed.tensor, same names for the same things.

Each benchmark is written once against `Lib` and run for both, so the two sides cannot
drift apart in shapes, placements or step code. torch's DTensor is imported here and in
the benchmark bodies only: it is the reference we measure against (allowed in bench/,
never under src/).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Lib", "LIBS", "load", "placements", "math_attention"]

LIBS = ("shardwise", "torch")


@dataclass(frozen=True)
class Lib:
    """One library's entry points, by the names both share."""

    name: str
    init_device_mesh: Callable[..., Any]
    Shard: Callable[..., Any]
    Replicate: Callable[..., Any]
    Partial: Callable[..., Any]
    DTensor: Any
    distribute_tensor: Callable[..., Any]
    implicit_replication: Callable[[], Any]
    parallelize_module: Callable[..., Any]
    ColwiseParallel: Callable[..., Any]
    RowwiseParallel: Callable[..., Any]

    def mesh(self, shape: Sequence[int], names: Any = None) -> Any:
        return self.init_device_mesh("cpu", tuple(shape), mesh_dim_names=names)


def load(name: str) -> Lib:
    """The `Lib` for "shardwise" or "torch" (imports it)."""
    if name == "shardwise":
        import shardwise as sw
        import shardwise.parallel as swp

        return Lib(name, sw.init_device_mesh, sw.Shard, sw.Replicate, sw.Partial, sw.DTensor, sw.distribute_tensor,
                   sw.implicit_replication, swp.parallelize_module, swp.ColwiseParallel, swp.RowwiseParallel)
    if name == "torch":
        import torch.distributed.tensor as tdt
        import torch.distributed.tensor.parallel as tdp
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import implicit_replication

        return Lib(name, init_device_mesh, tdt.Shard, tdt.Replicate, tdt.Partial, tdt.DTensor, tdt.distribute_tensor,
                   implicit_replication, tdp.parallelize_module, tdp.ColwiseParallel, tdp.RowwiseParallel)
    raise ValueError(f"unknown library {name!r}: use one of {LIBS}")


def placements(lib: Lib, spec: str) -> list[Any]:
    """'S0,R' -> [Shard(0), Replicate()]; 'P' is Partial('sum')."""
    out = []
    for p in spec.split(","):
        p = p.strip()
        if p == "R":
            out.append(lib.Replicate())
        elif p == "P":
            out.append(lib.Partial())
        elif p.startswith("S"):
            out.append(lib.Shard(int(p[1:])))
        else:
            raise ValueError(f"placement {p!r} in {spec!r}: use S<dim>, R or P")
    return out


@contextlib.contextmanager
def math_attention() -> Iterator[None]:
    """Run scaled_dot_product_attention as its math decomposition.

    torch's DTensor has no strategy for the CPU flash-attention kernel
    (`_scaled_dot_product_flash_attention_for_cpu`), so the GPT step runs attention as
    plain matmul/softmax for both libraries and the single-process reference alike.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.MATH]):
        yield
