"""Local implementations of random ops and fills: each rank makes only its piece of the global result.

A random op on a DTensor must not run torch's own generator on the local pieces: two
layouts of the same tensor would then get different values, and replicas would disagree.
Instead each op draws one seed per call (`LocalCall.seed`, all ranks alike) and evaluates
the counter-based generator (`shardwise._rng`) at the global indices of the elements this
rank holds, so for one seed every layout gives the same global tensor. The strategies of
these ops live in `_factory`; its registrations name these functions as their `local`.

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
| `multinomial(probs, n)` | with replacement: the row's inverse CDF at u; without: the n smallest -log(1 - u) / p of the row |

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

from .. import _rng
from .._placement import Partial
from .._spec import DTensorSpec
from ._local import LocalCall, LocalFn

__all__ = ["RANDOM_LOCAL", "local_normal", "local_uniform", "neutral_term"]

aten = torch.ops.aten
_RANDOM_FROM = getattr(aten.random_, "from")  # `from` is a Python keyword


def local_uniform(spec: DTensorSpec, coordinate: tuple[int, ...], seed: int, base: int = 0) -> torch.Tensor:
    """The piece at `coordinate` of the global uniform [0, 1) draw `seed` (float64)."""
    shape, offset = spec.local_shape_and_offset(coordinate)
    return _rng.uniform_local(shape, offset, spec.shape, seed, base, torch.float64)


def local_normal(spec: DTensorSpec, coordinate: tuple[int, ...], seed: int) -> torch.Tensor:
    """The piece at `coordinate` of the global standard normal draw `seed` (float64)."""
    shape, offset = spec.local_shape_and_offset(coordinate)
    return _rng.normal_local(shape, offset, spec.shape, seed, 0, torch.float64)


def neutral_term(spec: DTensorSpec, coordinate: tuple[int, ...]) -> Optional[int]:
    """This rank's term of a value written into `spec`, where it is not the value itself: 0 on
    a rank that is not the first along some P(sum) or P(bxor) mesh dim, else 1 on one that is not the first
    along some P(prod) mesh dim (the terms then reduce to the value in either order); None
    where the rank holds the value."""
    later = {p.reduce_op for i, p in enumerate(spec.placements) if isinstance(p, Partial) and coordinate[i] != 0}
    return 0 if later & {"sum", "bxor"} else 1 if "prod" in later else None


def _spec(call: LocalCall) -> DTensorSpec:
    out = call.output_spec
    spec = out[0] if isinstance(out, tuple) else out
    assert isinstance(spec, DTensorSpec)
    return spec


def _where(call: LocalCall, spec: DTensorSpec) -> tuple[int, ...]:
    """This rank's coordinate (the origin's for a rank outside the mesh: it draws a piece it never uses)."""
    return call.coordinate(spec, outside=(0,) * spec.mesh.ndim)


def _write(call: LocalCall, values: torch.Tensor, spec: DTensorSpec, coordinate: tuple[int, ...]) -> torch.Tensor:
    """Overwrite self's piece with `values` (zeros on the non-first ranks of P(sum) dims)."""
    self_local: torch.Tensor = call.args[0]
    term = neutral_term(spec, coordinate)
    if term is not None:
        return self_local.fill_(term)
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


def _uniform_(call: LocalCall) -> torch.Tensor:
    spec = _spec(call)
    c = _where(call, spec)
    low, high = float(call.arg(1, "from", 0.0)), float(call.arg(2, "to", 1.0))
    u = local_uniform(spec, c, call.seed(spec))
    return _write(call, low + (high - low) * u, spec, c)


def _normal_(call: LocalCall) -> torch.Tensor:
    spec = _spec(call)
    c = _where(call, spec)
    mean, std = float(call.arg(1, "mean", 0.0)), float(call.arg(2, "std", 1.0))
    z = local_normal(spec, c, call.seed(spec))
    return _write(call, mean + std * z, spec, c)


def _exponential_(call: LocalCall) -> torch.Tensor:
    spec = _spec(call)
    c = _where(call, spec)
    lambd = float(call.arg(1, "lambd", 1.0))
    u = local_uniform(spec, c, call.seed(spec))
    return _write(call, -torch.log1p(-u) / lambd, spec, c)


def _cauchy_(call: LocalCall) -> torch.Tensor:
    spec = _spec(call)
    c = _where(call, spec)
    median, sigma = float(call.arg(1, "median", 0.0)), float(call.arg(2, "sigma", 1.0))
    u = local_uniform(spec, c, call.seed(spec))
    return _write(call, median + sigma * torch.tan(math.pi * (u - 0.5)), spec, c)


def _log_normal_(call: LocalCall) -> torch.Tensor:
    spec = _spec(call)
    c = _where(call, spec)
    mean, std = float(call.arg(1, "mean", 1.0)), float(call.arg(2, "std", 2.0))
    z = local_normal(spec, c, call.seed(spec))
    return _write(call, torch.exp(mean + std * z), spec, c)


def _geometric_(call: LocalCall) -> torch.Tensor:
    spec = _spec(call)
    c = _where(call, spec)
    p = float(call.arg(1, "p", 0.5))
    u = local_uniform(spec, c, call.seed(spec))
    k = torch.ceil(torch.log1p(-u) / math.log1p(-p)) if p < 1 else torch.ones_like(u)
    return _write(call, torch.clamp(k, min=1), spec, c)


def _normal_tensors(call: LocalCall) -> torch.Tensor:
    spec = _spec(call)
    c = _where(call, spec)
    mean, std = call.arg(0, "mean"), call.arg(1, "std")
    z = local_normal(spec, c, call.seed(spec)).to(spec.dtype)
    out: torch.Tensor = mean + std * z  # the strategy gives mean and std this rank's piece (or broadcast)
    return out


def _bernoulli_(call: LocalCall) -> torch.Tensor:
    spec = _spec(call)
    c = _where(call, spec)
    p = call.arg(1, "p", 0.5)
    u = local_uniform(spec, c, call.seed(spec))
    if isinstance(p, torch.Tensor):
        p = p.to(torch.float64)
    return _write(call, u < p, spec, c)


def _bernoulli(call: LocalCall) -> torch.Tensor:
    spec = _spec(call)
    c = _where(call, spec)
    u = local_uniform(spec, c, call.seed(spec))
    p = call.args[0].to(torch.float64) if call.func is aten.bernoulli.default else float(call.arg(1, "p", 0.5))
    return (u < p).to(spec.dtype)


def _multinomial(call: LocalCall) -> torch.Tensor:
    """Each row's draws from uniforms at the row's global indices: with replacement, the
    inverse of the row's cumulative distribution at (rows, num_samples) uniforms; without, the
    `num_samples` smallest of -log(u) / p over (rows, categories) uniforms (an exponential
    race: the same law as drawing one by one). Rows split over ranks draw locally."""
    probs = call.args[0].to(torch.float64)
    n = int(call.arg(1, "num_samples"))
    out_spec = _spec(call)
    seed = call.seed(out_spec)
    if bool(call.arg(2, "replacement", False)):
        u = local_uniform(out_spec, _where(call, out_spec), seed)
        cdf = probs.cumsum(-1)
        cdf = cdf / cdf[..., -1:]
        return torch.searchsorted(cdf, u.contiguous(), right=True).clamp_(max=probs.size(-1) - 1)
    in_spec = call.input_specs[0]
    u = local_uniform(in_spec, _where(call, in_spec), seed)
    keys = -torch.log1p(-u) / probs  # zero probability: +inf, never drawn before a positive one
    chosen: torch.Tensor = keys.topk(n, dim=-1, largest=False).indices
    return chosen


def _random_(call: LocalCall) -> torch.Tensor:
    spec = _spec(call)
    c = _where(call, spec)
    if call.func is _RANDOM_FROM:
        low, high = _random_range(spec.dtype, int(call.arg(1, "from", 0)), call.arg(2, "to", None))
    elif call.func is aten.random_.to:
        low, high = 0, int(call.arg(1, "to", 1))
    else:
        low, high = _random_range(spec.dtype, 0, None)
    if high <= low:
        raise ValueError(f"random_ expects from < to, got from={low}, to={high}: pass a non-empty range")
    ints = _uniform_ints(spec, c, call.seed(spec), high - low) + low
    return _write(call, ints, spec, c)


def _rand_like(call: LocalCall) -> torch.Tensor:
    spec = _spec(call)
    return local_uniform(spec, _where(call, spec), call.seed(spec)).to(spec.dtype)


def _randn_like(call: LocalCall) -> torch.Tensor:
    spec = _spec(call)
    return local_normal(spec, _where(call, spec), call.seed(spec)).to(spec.dtype)


def _randint_like(call: LocalCall) -> torch.Tensor:
    spec = _spec(call)
    if call.func is aten.randint_like.low_dtype:
        low, high = int(call.args[1]), int(call.args[2])
    else:
        low, high = 0, int(call.args[1])
    if high <= low:
        raise ValueError(f"randint_like expects low < high, got low={low}, high={high}: pass a non-empty range")
    return (_uniform_ints(spec, _where(call, spec), call.seed(spec), high - low) + low).to(spec.dtype)


def _native_dropout(call: LocalCall) -> tuple[torch.Tensor, torch.Tensor]:
    x = call.args[0]
    p = float(call.arg(1, "p", 0.5))
    train = call.arg(2, "train", None)
    if train is False:
        return x.clone(), torch.ones_like(x, dtype=torch.bool)
    assert isinstance(call.output_spec, tuple)
    mask_spec = call.output_spec[1]
    assert isinstance(mask_spec, DTensorSpec)
    u = local_uniform(mask_spec, _where(call, mask_spec), call.seed(mask_spec))
    mask = u < 1.0 - p
    scale = 0.0 if p >= 1.0 else 1.0 / (1.0 - p)
    return x * mask.to(x.dtype) * scale, mask


def _fill_(call: LocalCall) -> torch.Tensor:
    spec = _spec(call)
    term = neutral_term(spec, _where(call, spec))
    if term is not None:
        return call.args[0].fill_(term)  # type: ignore[no-any-return]
    return call.run_op()  # type: ignore[no-any-return]


# op -> its local implementation (the `local=` of its registration in `_factory`)
RANDOM_LOCAL: dict[Any, LocalFn] = {
    aten.uniform_.default: _uniform_,
    aten.normal_.default: _normal_,
    aten.exponential_.default: _exponential_,
    aten.cauchy_.default: _cauchy_,
    aten.log_normal_.default: _log_normal_,
    aten.geometric_.default: _geometric_,
    aten.normal.Tensor_Tensor: _normal_tensors,
    aten.bernoulli_.float: _bernoulli_,
    aten.bernoulli_.Tensor: _bernoulli_,
    aten.bernoulli.default: _bernoulli,
    aten.bernoulli.p: _bernoulli,
    aten.random_.default: _random_,
    aten.random_.to: _random_,
    _RANDOM_FROM: _random_,
    aten.rand_like.default: _rand_like,
    aten.randn_like.default: _randn_like,
    aten.randint_like.default: _randint_like,
    aten.randint_like.low_dtype: _randint_like,
    aten.native_dropout.default: _native_dropout,
    aten.multinomial.default: _multinomial,
    aten.fill_.Scalar: _fill_,
    aten.fill_.Tensor: _fill_,
}
