"""Local pieces of random ops and fills: each rank makes only its piece of the global result.

A random op on a DTensor must not run torch's own generator on the local pieces: two
layouts of the same tensor would then get different values, and replicas would disagree.
Instead each op draws one seed per call (`_random.next_seed`, all ranks alike) and
evaluates the counter-based generator at the global indices of the elements this rank
holds, so for one seed every layout gives the same global tensor.

| op | element from a uniform u in [0, 1) (float64) |
|---|---|
| `uniform_(from, to)`, `rand_like` | from + (to - from) * u |
| `normal_(mean, std)`, `randn_like` | mean + std * (Box-Muller normal) |
| `bernoulli_(p)`, `bernoulli(p)`, `bernoulli(probs)` | u < p |
| `exponential_(lambd)` | -log(1 - u) / lambd |
| `cauchy_(median, sigma)` | median + sigma * tan(pi * (u - 1/2)) |
| `log_normal_(mean, std)` | exp(mean + std * (Box-Muller normal)) |
| `geometric_(p)` | ceil(log(1 - u) / log(1 - p)), at least 1 |
| `normal(mean, std)` (tensors) | mean + std * (Box-Muller normal), broadcast |
| `random_(from, to)`, `randint_like` | from + floor(u * (to - from)) |
| `native_dropout(x, p)` | mask = u < 1 - p; out = x * mask / (1 - p) |

In-place fills keep self's layout even when it is Partial: along a P(sum) mesh dim the
value goes to the first rank and the others hold zeros (the terms still sum to the
value); along P(avg)/P(max)/P(min) every rank holds the value. `fill_` is here for that
reason although it is not random. An explicit `generator=` draws the seed from that
generator instead of the shared one.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from .._mesh import DeviceMesh
from .._placement import Partial
from .._spec import DTensorSpec
from . import _random
from ._dispatch import register_local_impl

__all__ = ["local_coordinate", "local_uniform", "local_normal", "zero_partial_terms"]

aten = torch.ops.aten
_RANDOM_FROM = getattr(aten.random_, "from")  # `from` is a Python keyword


def local_coordinate(spec: DTensorSpec) -> tuple[int, ...]:
    """This rank's coordinate in the spec's mesh (origin for ranks outside it)."""
    coordinate: Optional[tuple[int, ...]] = getattr(spec.mesh, "_coordinate", None)
    return coordinate if coordinate is not None else (0,) * spec.mesh.ndim


def local_uniform(spec: DTensorSpec, coordinate: tuple[int, ...], seed: int, base: int = 0) -> torch.Tensor:
    """The piece at `coordinate` of the global uniform [0, 1) draw `seed` (float64)."""
    shape, offset = spec.local_shape_and_offset(coordinate)
    return _random.uniform_local(shape, offset, spec.shape, seed, base, torch.float64)


def local_normal(spec: DTensorSpec, coordinate: tuple[int, ...], seed: int) -> torch.Tensor:
    """The piece at `coordinate` of the global standard normal draw `seed` (float64)."""
    shape, offset = spec.local_shape_and_offset(coordinate)
    return _random.normal_local(shape, offset, spec.shape, seed, 0, torch.float64)


def zero_partial_terms(spec: DTensorSpec, coordinate: tuple[int, ...]) -> bool:
    """Whether this rank's term of a value written into `spec` must be zero: it is not the
    first rank along some P(sum) mesh dim."""
    return any(
        isinstance(p, Partial) and p.reduce_op == "sum" and coordinate[i] != 0 for i, p in enumerate(spec.placements)
    )


def _arg(args: list[Any], kwargs: dict[str, Any], index: int, name: str, default: Any) -> Any:
    if index < len(args):
        return args[index]
    return kwargs.get(name, default)


def _seed(spec: DTensorSpec, kwargs: dict[str, Any]) -> int:
    generator = kwargs.get("generator")
    if generator is not None:
        return int(torch.randint(0, 2**63 - 1, (1,), dtype=torch.int64, generator=generator).item())
    mesh = spec.mesh
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"random ops need a DTensor on a DeviceMesh, got a spec on {mesh!r}")
    return _random.next_seed(mesh)


def _write(self_local: torch.Tensor, values: torch.Tensor, spec: DTensorSpec, coordinate: tuple[int, ...]) -> torch.Tensor:
    """Overwrite self's piece with `values` (zeros on the non-first ranks of P(sum) dims)."""
    if zero_partial_terms(spec, coordinate):
        return self_local.zero_()
    return self_local.copy_(values)


def _uniform_ints(spec: DTensorSpec, coordinate: tuple[int, ...], seed: int, span: int) -> torch.Tensor:
    """Integers uniform in [0, span) (int64; span up to 2**63)."""
    if span <= 2**53:
        u = local_uniform(spec, coordinate, seed)
        return torch.clamp(torch.floor(u * span), max=span - 1).to(torch.int64)
    # 63 random bits from two draws at disjoint counters; the modulo bias is below span / 2**63
    numel = math.prod(spec.shape)
    high = torch.floor(local_uniform(spec, coordinate, seed) * 2**31).to(torch.int64)
    low = torch.floor(local_uniform(spec, coordinate, seed, base=numel) * 2**32).to(torch.int64)
    bits = high * 2**32 + low
    return bits if span >= 2**63 else torch.remainder(bits, span)


def _random_range(dtype: torch.dtype, low: int, high: Optional[int]) -> tuple[int, int]:
    """[low, high) for random_: an omitted `high` means the largest integer the dtype holds exactly, inclusive."""
    if high is not None:
        return low, high
    if dtype == torch.bool:
        return low, 2
    if dtype.is_floating_point:
        return low, 2 ** round(1 - math.log2(torch.finfo(dtype).eps)) + 1
    return low, torch.iinfo(dtype).max + 1


def _spec_of(output_spec: Any) -> DTensorSpec:
    spec = output_spec[0] if isinstance(output_spec, tuple) else output_spec
    assert isinstance(spec, DTensorSpec)
    return spec


@register_local_impl([aten.uniform_.default])
def _uniform_(func: Any, args: list[Any], kwargs: dict[str, Any], output_spec: Any) -> torch.Tensor:
    spec = _spec_of(output_spec)
    c = local_coordinate(spec)
    low, high = float(_arg(args, kwargs, 1, "from", 0.0)), float(_arg(args, kwargs, 2, "to", 1.0))
    u = local_uniform(spec, c, _seed(spec, kwargs))
    return _write(args[0], low + (high - low) * u, spec, c)


@register_local_impl([aten.normal_.default])
def _normal_(func: Any, args: list[Any], kwargs: dict[str, Any], output_spec: Any) -> torch.Tensor:
    spec = _spec_of(output_spec)
    c = local_coordinate(spec)
    mean, std = float(_arg(args, kwargs, 1, "mean", 0.0)), float(_arg(args, kwargs, 2, "std", 1.0))
    z = local_normal(spec, c, _seed(spec, kwargs))
    return _write(args[0], mean + std * z, spec, c)


@register_local_impl([aten.exponential_.default])
def _exponential_(func: Any, args: list[Any], kwargs: dict[str, Any], output_spec: Any) -> torch.Tensor:
    spec = _spec_of(output_spec)
    c = local_coordinate(spec)
    lambd = float(_arg(args, kwargs, 1, "lambd", 1.0))
    u = local_uniform(spec, c, _seed(spec, kwargs))
    return _write(args[0], -torch.log1p(-u) / lambd, spec, c)


@register_local_impl([aten.cauchy_.default])
def _cauchy_(func: Any, args: list[Any], kwargs: dict[str, Any], output_spec: Any) -> torch.Tensor:
    spec = _spec_of(output_spec)
    c = local_coordinate(spec)
    median, sigma = float(_arg(args, kwargs, 1, "median", 0.0)), float(_arg(args, kwargs, 2, "sigma", 1.0))
    u = local_uniform(spec, c, _seed(spec, kwargs))
    return _write(args[0], median + sigma * torch.tan(math.pi * (u - 0.5)), spec, c)


@register_local_impl([aten.log_normal_.default])
def _log_normal_(func: Any, args: list[Any], kwargs: dict[str, Any], output_spec: Any) -> torch.Tensor:
    spec = _spec_of(output_spec)
    c = local_coordinate(spec)
    mean, std = float(_arg(args, kwargs, 1, "mean", 1.0)), float(_arg(args, kwargs, 2, "std", 2.0))
    z = local_normal(spec, c, _seed(spec, kwargs))
    return _write(args[0], torch.exp(mean + std * z), spec, c)


@register_local_impl([aten.geometric_.default])
def _geometric_(func: Any, args: list[Any], kwargs: dict[str, Any], output_spec: Any) -> torch.Tensor:
    spec = _spec_of(output_spec)
    c = local_coordinate(spec)
    p = float(_arg(args, kwargs, 1, "p", 0.5))
    u = local_uniform(spec, c, _seed(spec, kwargs))
    k = torch.ceil(torch.log1p(-u) / math.log1p(-p)) if p < 1 else torch.ones_like(u)
    return _write(args[0], torch.clamp(k, min=1), spec, c)


@register_local_impl([aten.normal.Tensor_Tensor])
def _normal_tensors(func: Any, args: list[Any], kwargs: dict[str, Any], output_spec: Any) -> torch.Tensor:
    spec = _spec_of(output_spec)
    c = local_coordinate(spec)
    mean, std = _arg(args, kwargs, 0, "mean", None), _arg(args, kwargs, 1, "std", None)
    z = local_normal(spec, c, _seed(spec, kwargs)).to(spec.dtype)
    out: torch.Tensor = mean + std * z  # the strategy gives mean and std this rank's piece (or broadcast)
    return out


@register_local_impl([aten.bernoulli_.float, aten.bernoulli_.Tensor])
def _bernoulli_(func: Any, args: list[Any], kwargs: dict[str, Any], output_spec: Any) -> torch.Tensor:
    spec = _spec_of(output_spec)
    c = local_coordinate(spec)
    p = _arg(args, kwargs, 1, "p", 0.5)
    u = local_uniform(spec, c, _seed(spec, kwargs))
    if isinstance(p, torch.Tensor):
        p = p.to(torch.float64)
    return _write(args[0], u < p, spec, c)


@register_local_impl([aten.bernoulli.default, aten.bernoulli.p])
def _bernoulli(func: Any, args: list[Any], kwargs: dict[str, Any], output_spec: Any) -> torch.Tensor:
    spec = _spec_of(output_spec)
    c = local_coordinate(spec)
    u = local_uniform(spec, c, _seed(spec, kwargs))
    p = args[0].to(torch.float64) if func is aten.bernoulli.default else float(_arg(args, kwargs, 1, "p", 0.5))
    return (u < p).to(spec.dtype)


@register_local_impl([aten.random_.default, aten.random_.to, _RANDOM_FROM])
def _random_(func: Any, args: list[Any], kwargs: dict[str, Any], output_spec: Any) -> torch.Tensor:
    spec = _spec_of(output_spec)
    c = local_coordinate(spec)
    if func is _RANDOM_FROM:
        low, high = _random_range(spec.dtype, int(_arg(args, kwargs, 1, "from", 0)), _arg(args, kwargs, 2, "to", None))
    elif func is aten.random_.to:
        low, high = 0, int(_arg(args, kwargs, 1, "to", 1))
    else:
        low, high = _random_range(spec.dtype, 0, None)
    if high <= low:
        raise ValueError(f"random_ expects from < to, got from={low}, to={high}: pass a non-empty range")
    ints = _uniform_ints(spec, c, _seed(spec, kwargs), high - low) + low
    return _write(args[0], ints, spec, c)


@register_local_impl([aten.rand_like.default])
def _rand_like(func: Any, args: list[Any], kwargs: dict[str, Any], output_spec: Any) -> torch.Tensor:
    spec = _spec_of(output_spec)
    return local_uniform(spec, local_coordinate(spec), _seed(spec, kwargs)).to(spec.dtype)


@register_local_impl([aten.randn_like.default])
def _randn_like(func: Any, args: list[Any], kwargs: dict[str, Any], output_spec: Any) -> torch.Tensor:
    spec = _spec_of(output_spec)
    return local_normal(spec, local_coordinate(spec), _seed(spec, kwargs)).to(spec.dtype)


@register_local_impl([aten.randint_like.default, aten.randint_like.low_dtype])
def _randint_like(func: Any, args: list[Any], kwargs: dict[str, Any], output_spec: Any) -> torch.Tensor:
    spec = _spec_of(output_spec)
    if func is aten.randint_like.low_dtype:
        low, high = int(args[1]), int(args[2])
    else:
        low, high = 0, int(args[1])
    if high <= low:
        raise ValueError(f"randint_like expects low < high, got low={low}, high={high}: pass a non-empty range")
    return (_uniform_ints(spec, local_coordinate(spec), _seed(spec, kwargs), high - low) + low).to(spec.dtype)


@register_local_impl([aten.native_dropout.default])
def _native_dropout(func: Any, args: list[Any], kwargs: dict[str, Any], output_spec: Any) -> tuple[torch.Tensor, torch.Tensor]:
    x = args[0]
    p = float(_arg(args, kwargs, 1, "p", 0.5))
    train = _arg(args, kwargs, 2, "train", None)
    if train is False:
        return x.clone(), torch.ones_like(x, dtype=torch.bool)
    assert isinstance(output_spec, tuple)
    mask_spec = output_spec[1]
    assert isinstance(mask_spec, DTensorSpec)
    u = local_uniform(mask_spec, local_coordinate(mask_spec), _seed(mask_spec, kwargs))
    mask = u < 1.0 - p
    scale = 0.0 if p >= 1.0 else 1.0 / (1.0 - p)
    return x * mask.to(x.dtype) * scale, mask


@register_local_impl([aten.fill_.Scalar, aten.fill_.Tensor])
def _fill_(func: Any, args: list[Any], kwargs: dict[str, Any], output_spec: Any) -> torch.Tensor:
    spec = _spec_of(output_spec)
    c = local_coordinate(spec)
    if zero_partial_terms(spec, c):
        return args[0].zero_()  # type: ignore[no-any-return]
    return func(*args, **kwargs)  # type: ignore[no-any-return]
