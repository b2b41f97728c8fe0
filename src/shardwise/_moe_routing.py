"""How a dry run says the routers spread their routes, and the routes per expert that follow.

Why: dropless token dispatch (`parallel._moe_dispatch.dispatch_dropless`) learns the sizes
of its all_to_alls from the routes' counts, read on the host once per layer. In a dry run
the router's output is a meta tensor, so there is nothing to read: the dry run says how the
routes spread instead (`dry_run(..., routing=...)`), and the dispatch takes its sizes from
that (`parallel._moe_dry.exchanged_sizes`), so the bytes a dry run reports are those a real
run with that routing sends. The routing rides on a context variable the dry run sets for
its simulated ranks, as `_memory_events` carries memory events: a real run reads it once per
layer and finds nothing.

| `routing=` | routes of one ep rank's `tokens` (top-`k` each) to expert `e` of `E` |
|---|---|
| `"uniform"` (the default) | `tokens * k // E`, and one more for the first `tokens * k % E` experts: what a round-robin router sends (slot `j` of token `t` to expert `(t * k + j) % E`) |
| `E` shares, each >= 0, summing to 1 | `tokens * k * share`, rounded by largest remainder (ties to the lower expert) |
| `fn(ep_rank, tokens, top_k, num_experts)` | the `E` ints it returns, each in `[0, tokens]`, summing to `tokens * top_k` |

Every ep rank is taken to hold the same number of tokens (as a dry run takes every rank to
hold pieces of the same sizes); the shares and "uniform" route every ep rank's tokens alike,
a function may route each ep rank's otherwise.

>>> Routing.of("uniform").routes(0, tokens=5, top_k=2, num_experts=4)
(3, 3, 2, 2)
>>> Routing.of([0.5, 0.25, 0.25, 0.0]).routes(0, tokens=4, top_k=2, num_experts=4)
(4, 2, 2, 0)
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Optional

__all__ = ["RouteFunction", "Routing", "routing_in_dry_run", "simulated_routing"]

RouteFunction = Callable[[int, int, int, int], Sequence[int]]  # (ep_rank, tokens, top_k, num_experts) -> routes
_FORMS = ("'uniform', a share per expert (floats >= 0 summing to 1), or a function (ep_rank, tokens, top_k, "
          "num_experts) -> routes per expert")
_TOLERANCE = 1e-6


@dataclass(frozen=True)
class Routing:
    """A routing for simulated dispatch: `kind` "uniform", "shares" (with `shares`) or
    "function" (with `function`); `given`: False where the dry run chose it (no `routing=`)."""

    kind: str
    shares: tuple[float, ...] = ()
    function: Optional[RouteFunction] = None
    given: bool = True

    @staticmethod
    def of(value: Any) -> Routing:
        """`value` (see the module docstring) checked and canonicalised; ValueError / TypeError
        naming the value and the fix."""
        if isinstance(value, Routing):
            return value
        if isinstance(value, str):
            if value != "uniform":
                raise ValueError(f"dry_run(routing={value!r}): give {_FORMS}")
            return Routing("uniform")
        if callable(value):
            return Routing("function", function=value)
        if hasattr(value, "tolist") and not isinstance(value, (list, tuple)):  # a tensor or an array of shares
            value = value.tolist()
        if not isinstance(value, (list, tuple)):
            raise TypeError(f"dry_run(routing=...) takes {_FORMS}; got {type(value).__name__}")
        return Routing("shares", shares=_checked_shares(value))

    @staticmethod
    def default() -> Routing:
        """What a dry run assumes when it is not told: uniform."""
        return Routing("uniform", given=False)

    @property
    def per_rank(self) -> bool:
        """Whether ep ranks may route differently (a function's answer depends on the rank)."""
        return self.kind == "function"

    def describe(self) -> str:
        if self.kind == "uniform":
            return "uniform" + ("" if self.given else " (the default: meta tensors carry no router output; "
                                                       "say dry_run(..., routing=...) for another)")
        if self.kind == "shares":
            top = sorted(range(len(self.shares)), key=lambda e: -self.shares[e])[:3]
            return (f"shares over {len(self.shares)} experts (largest: "
                    + ", ".join(f"expert {e} {self.shares[e]:.3g}" for e in top) + ")")
        return f"given by {getattr(self.function, '__qualname__', repr(self.function))}"

    def routes(self, ep_rank: int, tokens: int, top_k: int, num_experts: int) -> tuple[int, ...]:
        """Routes of ep rank `ep_rank`'s `tokens` (top-`top_k` each) to each of `num_experts` experts."""
        total = tokens * top_k
        if self.kind == "uniform":
            base, extra = divmod(total, num_experts)
            return tuple(base + (e < extra) for e in range(num_experts))
        if self.kind == "shares":
            return self._apportioned(tokens, top_k, num_experts)
        assert self.function is not None
        got = self.function(ep_rank, tokens, top_k, num_experts)
        out = tuple(got.tolist() if hasattr(got, "tolist") else got)
        if (len(out) != num_experts or any(isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= tokens
                                           for n in out) or sum(out) != total):
            name = getattr(self.function, "__qualname__", repr(self.function))
            shown = f"{list(out)[:8]}{' ...' if len(out) > 8 else ''}"
            raise ValueError(f"dry_run(routing={name}) returned {shown} for ep rank {ep_rank}, {tokens} tokens, "
                             f"top_k={top_k}: give {num_experts} ints, each in [0, {tokens}] (a token routes to an "
                             f"expert once), summing to {total} (tokens * top_k)")
        return out

    def _apportioned(self, tokens: int, top_k: int, num_experts: int) -> tuple[int, ...]:
        shares, total = self.shares, tokens * top_k
        if len(shares) != num_experts:
            raise ValueError(f"dry_run(routing=...) gives {len(shares)} shares; the experts module routes over "
                             f"{num_experts} experts: give one share per expert")
        worst = max(range(num_experts), key=lambda e: shares[e])
        if shares[worst] > 1 / top_k + _TOLERANCE:
            raise ValueError(f"dry_run(routing=...) gives expert {worst} the share {shares[worst]:.4g} of the routes, "
                             f"but with top_k={top_k} a token routes to an expert at most once: each share is at "
                             f"most 1/top_k = {1 / top_k:.4g}; spread the shares more evenly")
        exact = [total * s for s in shares]
        out = [math.floor(x) for x in exact]
        left = total - sum(out)
        for e in sorted(range(num_experts), key=lambda e: (out[e] - exact[e], e))[:left]:
            out[e] += 1
        return tuple(min(n, tokens) for n in out)


def _checked_shares(value: Sequence[Any]) -> tuple[float, ...]:
    if not value or any(isinstance(v, (bool, str)) or not isinstance(v, (int, float)) for v in value):
        raise ValueError(f"dry_run(routing={_short(value)}): a share per expert is a non-empty list of numbers; "
                         f"give {_FORMS}")
    shares = tuple(float(v) for v in value)
    bad = [(e, v) for e, v in enumerate(shares) if not math.isfinite(v) or v < 0]
    if bad:
        raise ValueError(f"dry_run(routing={_short(value)}): share {bad[0][1]} of expert {bad[0][0]} is not a "
                         f"number >= 0; give each expert's share of the routes, >= 0, summing to 1 (e.g. counts / "
                         f"counts.sum())")
    if abs(sum(shares) - 1.0) > _TOLERANCE:
        raise ValueError(f"dry_run(routing={_short(value)}): the shares sum to {sum(shares):.6g}, not 1; give each "
                         f"expert's share of the routes, summing to 1 (e.g. counts / counts.sum())")
    return shares


def _short(value: Sequence[Any]) -> str:
    return repr(list(value)[:6])[:-1] + (", ...]" if len(value) > 6 else "]")


_ROUTING: contextvars.ContextVar[Optional[Routing]] = contextvars.ContextVar("shardwise_dry_routing", default=None)


def simulated_routing() -> Optional[Routing]:
    """The routing the dry run under way gives its dispatches (None outside a dry run)."""
    return _ROUTING.get()


@contextlib.contextmanager
def routing_in_dry_run(routing: Routing) -> Iterator[None]:
    """Inside the block (and the threads started with a copy of its context), token dispatch
    takes its sizes from `routing`."""
    token = _ROUTING.set(routing)
    try:
        yield
    finally:
        _ROUTING.reset(token)
