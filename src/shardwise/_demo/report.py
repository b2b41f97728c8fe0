"""What rank 0 prints at the end of the demo: loss curves, memory, the layout picture."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, Optional

from ..debug._picture import ParamLayout, layout_png, layout_text

__all__ = ["report"]

_SPARK = " .:-=+*#%@"


def report(cfg: Any, result: Any, memory: Sequence[dict[str, int]], reference: Optional[list[float]],
           png_path: str, tolerance: float, schedule: Optional[str] = None) -> bool:
    """Print the report; False if the loss curves disagree by more than `tolerance`. A
    pipelined run (`schedule`: its picture) shows the schedule instead of the layouts."""
    ok = True
    losses = result.losses
    tps = result.tokens / result.seconds if result.seconds else 0.0
    print(f"\ntrained {len(losses)} steps in {result.seconds:.1f} s ({tps:,.0f} tokens/s): "
          f"loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    print("\nloss curve, sharded vs single process:")
    print(f"  sharded    {_sparkline(losses)}")
    if reference is not None:
        print(f"  reference  {_sparkline(reference)}")
        every = max(1, len(losses) // 6)
        print(f"  {'step':>6} {'sharded':>10} {'reference':>10} {'|diff|':>9}")
        for i in list(range(0, len(losses), every)) + ([len(losses) - 1] if (len(losses) - 1) % every else []):
            print(f"  {i + 1:>6} {losses[i]:>10.5f} {reference[i]:>10.5f} {abs(losses[i] - reference[i]):>9.1e}")
        worst = max(abs(a - b) for a, b in zip(losses, reference))
        ok = worst <= tolerance
        verdict = "equal" if ok else "NOT EQUAL"
        print(f"parity: max |sharded - single process| = {worst:.1e} over {len(losses)} steps "
              f"(tolerance {tolerance:.0e}): {verdict}")
    _memory(memory)
    if schedule is not None:
        pp, dp, tp = cfg.mesh
        print(f"\nthe 1F1B schedule of the {pp} pipeline stages (one row per pp rank; F/B = forward/backward of a "
              f"micro-batch; each stage is {dp} (dp, ZeRO-3) x {tp} (tp) ranks running it in step):")
        for line in schedule.splitlines():
            print("  " + line)
        return ok
    dp, tp = cfg.mesh
    layouts = [p for p in result.layouts if isinstance(p, ParamLayout)]
    print(f"\nhow each parameter is laid out on the {dp} (dp) x {tp} (tp) mesh (rank = dp * {tp} + tp):")
    for line in layout_text(layouts, (dp, tp), ("dp", "tp")):
        print("  " + line)
    with open(png_path, "wb") as f:
        f.write(layout_png(layouts, (dp, tp)))
    print(f"layout picture written to {os.path.abspath(png_path)}")
    return ok


def _memory(memory: Sequence[dict[str, int]]) -> None:
    print("\nmemory per rank (parameters + gradients + optimizer state), against the unsharded model:")
    full = memory[0]["unsharded_total"]
    print(f"  {'rank':>4} {'params':>10} {'grads':>10} {'optimizer':>10} {'total':>10} {'vs unsharded':>13}")
    for rank, m in enumerate(memory):
        total = m["parameters"] + m["gradients"] + m["optimizer_state"]
        print(f"  {rank:>4} {_kb(m['parameters']):>10} {_kb(m['gradients']):>10} {_kb(m['optimizer_state']):>10} "
              f"{_kb(total):>10} {total / full:>12.2f}x")
    print(f"  unsharded model: {_kb(full)} (parameters, gradients and AdamW's two moments)")


def _kb(n: int) -> str:
    return f"{n / 1024:.1f} KiB"


def _sparkline(values: Sequence[float], width: int = 60) -> str:
    lo, hi = min(values), max(values)
    step = max(1, len(values) // width)
    picked = values[::step]
    return "".join(_SPARK[int((v - lo) / (hi - lo + 1e-12) * (len(_SPARK) - 1))] for v in picked) + \
        f"  ({hi:.3f} .. {lo:.3f})"
