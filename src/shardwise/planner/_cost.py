"""The cost model the automatic planner minimises: a training step's modelled time and memory per rank.

    time = FLOPs / flops_per_second                      (compute: the matmuls, convolutions
                                                          and attentions of the step, on this
                                                          rank's pieces, as the dry run counts)
         + sum over collectives of (latency + bytes received / bandwidth of its mesh dims)

A collective over several mesh dims runs at the slowest of their bandwidths; a point-to-point
message at `p2p_bandwidth`. Compute and communication are added, not overlapped (an upper
bound). Memory per rank is the dry run's peak: parameters, gradients, optimizer state and
every activation the backward keeps alive, checked against the budget.

Defaults (`CostModel.gloo_cpu()`, `CostModel.gpu_cluster()`) are stated below; `calibrate(mesh)`
measures the bandwidth and latency of each mesh dim's real process group and this machine's
matmul rate in a few seconds (a collective: every rank calls it).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch

__all__ = ["CostModel", "StepCost"]


@dataclass(frozen=True)
class CostModel:
    """Rates a step is modelled with. `bandwidth`: bytes per second per mesh dim, by name or
    index (`default_bandwidth` for the dims not named); `latency`: seconds per collective;
    `memory_bandwidth`: bytes per second an op writes (what the layout solver charges
    elementwise ops, which do few FLOPs)."""

    flops_per_second: float = 5e10
    default_bandwidth: float = 1e9
    bandwidth: Mapping[Union[str, int], float] = field(default_factory=dict)
    latency: float = 1e-4
    p2p_bandwidth: Optional[float] = None
    memory_bandwidth: float = 2e10

    def __post_init__(self) -> None:
        bad = {k: v for k, v in {"flops_per_second": self.flops_per_second, "default_bandwidth": self.default_bandwidth,
                                 "memory_bandwidth": self.memory_bandwidth,
                                 **{f"bandwidth[{d!r}]": b for d, b in self.bandwidth.items()}}.items()
               if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0}
        if bad or not isinstance(self.latency, (int, float)) or self.latency < 0:
            raise ValueError(f"CostModel rates must be positive numbers (latency >= 0), got {bad or self.latency!r}")

    @classmethod
    def gloo_cpu(cls) -> CostModel:
        """gloo over localhost TCP on a small CPU box: ~1 GB/s per link, ~100 us per collective,
        ~50 GFLOP/s of fp32 matmul and ~20 GB/s of memory traffic per process."""
        return cls(flops_per_second=5e10, default_bandwidth=1e9, latency=1e-4, memory_bandwidth=2e10)

    @classmethod
    def gpu_cluster(cls, inner: str = "tp", outer: Sequence[str] = ("dp", "pp")) -> CostModel:
        """H100-class GPUs: ~400 TFLOP/s bf16 at 60% use; NVLink ~300 GB/s for the `inner` dim,
        InfiniBand ~25 GB/s per GPU for the `outer` dims; ~20 us per collective;
        ~2 TB/s of HBM traffic."""
        return cls(flops_per_second=2.4e14, default_bandwidth=2.5e10,
                   bandwidth={inner: 3e11, **{d: 2.5e10 for d in outer}}, latency=2e-5, memory_bandwidth=2e12)

    def bandwidth_of(self, mesh_dims: Sequence[Union[str, int]]) -> float:
        if not mesh_dims:
            return self.p2p_bandwidth or self.default_bandwidth
        return min(self.bandwidth.get(d, self.default_bandwidth) for d in mesh_dims)

    def collective_seconds(self, nbytes: int, mesh_dims: Sequence[Union[str, int]]) -> float:
        return self.latency + nbytes / self.bandwidth_of(mesh_dims)

    def step(self, rank_report: Any) -> StepCost:
        """The modelled time and memory of a dry run's rank (`RankReport`)."""
        flops = sum(rank_report.flops.values())
        comm = sum(self.collective_seconds(c.bytes, c.mesh_dims) for c in rank_report.collectives)
        nbytes = sum(c.bytes for c in rank_report.collectives)
        return StepCost(flops / self.flops_per_second, comm, flops, nbytes, len(rank_report.collectives),
                        rank_report.memory.peak, dict(rank_report.memory.peaks))

    @classmethod
    def calibrate(cls, mesh: Any, *, nbytes: int = 1 << 22, repeats: int = 5) -> CostModel:
        """Measure each mesh dim's all_reduce bandwidth and latency on `mesh`'s process groups,
        and the local fp32 matmul rate; every rank calls it and gets the same model (the
        slowest rank's numbers)."""
        from .. import _comm as comm

        bandwidth: dict[Union[str, int], float] = {}
        latencies = []
        names = mesh.mesh_dim_names or tuple(range(mesh.ndim))
        for d, name in enumerate(names):
            n = mesh.size(d)
            if n == 1:
                continue
            group = mesh.get_group(d)
            small, big = torch.zeros(1), torch.zeros(nbytes // 4)
            comm.all_reduce(small, group, n, "sum", (d,))  # warm the connection
            t_small, t_big = _timed(lambda: comm.all_reduce(small, group, n, "sum", (d,)), repeats), \
                _timed(lambda: comm.all_reduce(big, group, n, "sum", (d,)), repeats)
            moved = 2 * (n - 1) / n * nbytes  # a ring all_reduce's bytes in per rank
            bandwidth[name] = moved / max(t_big - t_small, 1e-9)
            latencies.append(t_small)
        a = torch.randn(512, 512)
        flops = 2 * 512 ** 3 / max(_timed(lambda: a @ a, repeats), 1e-9)
        mine = [flops, min(bandwidth.values(), default=1e9)] + [bandwidth.get(n, 1e9) for n in names] + \
               [max(latencies, default=0.0)]
        agreed = _agree(mine, mesh)
        return cls(flops_per_second=agreed[0], default_bandwidth=agreed[1],
                   bandwidth={n: agreed[2 + i] for i, n in enumerate(names)}, latency=agreed[-1])


def _timed(fn: Any, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _agree(values: list[float], mesh: Any) -> list[float]:
    """The slowest rank's rates and the largest latency, the same on every rank."""
    from .. import _comm as comm

    t = torch.tensor([-v for v in values[:-1]] + [values[-1]], dtype=torch.float64)
    for d in range(mesh.ndim):
        if mesh.size(d) > 1:
            t = comm.all_reduce(t, mesh.get_group(d), mesh.size(d), "max", (d,))
    out = t.tolist()
    return [-v for v in out[:-1]] + [out[-1]]


@dataclass(frozen=True)
class StepCost:
    """One rank's modelled step: seconds of compute and of communication, FLOPs, bytes
    received, collectives, peak memory and each category's peak."""

    compute_seconds: float
    comm_seconds: float
    flops: int
    comm_bytes: int
    collectives: int
    peak_bytes: int
    peaks: dict[str, int]

    @property
    def seconds(self) -> float:
        return self.compute_seconds + self.comm_seconds

    def scaled(self, base: StepCost, layers: int) -> StepCost:
        """This cost (a model of 2 repeated layers) extrapolated from `base` (1 layer) to
        `layers`: what one more layer adds, `layers - 1` times."""
        def grow(a: float, b: float) -> float:
            return b + (layers - 2) * (b - a)
        return StepCost(grow(base.compute_seconds, self.compute_seconds), grow(base.comm_seconds, self.comm_seconds),
                        int(grow(base.flops, self.flops)), int(grow(base.comm_bytes, self.comm_bytes)),
                        int(grow(base.collectives, self.collectives)), int(grow(base.peak_bytes, self.peak_bytes)),
                        {k: int(grow(base.peaks.get(k, 0), v)) for k, v in self.peaks.items()})
