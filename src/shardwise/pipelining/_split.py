"""`pipeline(module, mb_args, split_spec=...)`: a module cut into stage modules at its blocks.

torch's `pipeline` traces the forward with `torch.export` and cuts the graph anywhere. This
one supports the common case without a tracer: a module whose forward runs its blocks one
after the other, each on the previous one's output. The blocks are the module's children in
order, the children of an `nn.Sequential`, `nn.ModuleList` or `nn.ModuleDict` child counted
one by one (`layers.0`, `layers.1`, ...). One forward on `mb_args` (without autograd, the
random state kept) checks that this is what the forward does, and raises a ValueError naming
the first block where it is not. Cuts are `split_spec`'s (`{"layers.2":
SplitPoint.BEGINNING}`: a new stage starts at block `layers.2`; `END`: after it) and the
`pipe_split()` calls of the forward (a new stage starts at the next block).

A stage module holds its blocks under their names in the module (its parameters keep their
names: `layers.2.weight` stays `layers.2.weight`) and shares them with it.

>>> import torch
>>> from torch import nn
>>> model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.ReLU())
>>> pipe = pipeline(model, (torch.zeros(2, 4),), split_spec={"2": SplitPoint.BEGINNING})
>>> pipe.num_stages, [n for n, _ in pipe.get_stage_module(1).named_parameters()]
(2, ['2.weight', '2.bias'])
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from .._describe import describe
from ._stage import PipelineStage

__all__ = ["Pipe", "PipeInfo", "SplitPoint", "build_stage", "pipe_split", "pipeline"]


class SplitPoint(enum.Enum):
    """Where `split_spec` cuts at a block: before it (`BEGINNING`) or after it (`END`)."""

    BEGINNING = 1
    END = 2


@dataclass
class _Run:
    """The blocks a checking forward called, in order, and where `pipe_split()` was called."""

    calls: list[tuple[int, tuple[Any, ...], dict[str, Any], Any]]  # block, args, kwargs, output
    marks: list[int]


_RUN: ContextVar[Optional[_Run]] = ContextVar("shardwise_pipelining_run", default=None)


def pipe_split() -> None:
    """Mark a stage boundary in a module's forward: the next block starts a new stage when
    `pipeline` cuts the module. A no-op when the module runs by itself."""
    run = _RUN.get()
    if run is not None:
        run.marks.append(len(run.calls))


@dataclass(frozen=True)
class PipeInfo:
    """What a stage needs to know of its pipe."""

    num_stages: int
    has_loss_and_backward: bool = False


class _StageModule(nn.Module):
    """Consecutive blocks of a module, under their names there, run one after the other."""

    def __init__(self, blocks: list[tuple[str, nn.Module]]) -> None:
        super().__init__()
        self._names = [name for name, _ in blocks]
        for name, block in blocks:
            parent, _, leaf = name.rpartition(".")
            if parent and parent not in self._modules:
                self.add_module(parent, nn.ModuleDict())
            (self._modules[parent] if parent else self).add_module(leaf, block)  # type: ignore[union-attr]

    def forward(self, *args: Any) -> Any:
        out: Any = args
        for name in self._names:
            block = self.get_submodule(name)
            out = block(*out) if isinstance(out, tuple) else block(out)
        return out

    def extra_repr(self) -> str:
        return f"blocks={self._names}"


class Pipe(nn.Module):
    """A module cut into `num_stages` stage modules (`split_gm.submod_<i>`); running it runs
    them in order."""

    def __init__(self, stages: list[_StageModule]) -> None:
        super().__init__()
        self.split_gm = nn.Module()
        for i, stage in enumerate(stages):
            self.split_gm.add_module(f"submod_{i}", stage)
        self.num_stages = len(stages)
        self.has_loss_and_backward = False

    def forward(self, *args: Any) -> Any:
        out: Any = args
        for i in range(self.num_stages):
            out = self.get_stage_module(i)(*(out if isinstance(out, tuple) else (out,)))
        return out

    def get_stage_module(self, stage_idx: int) -> nn.Module:
        if isinstance(stage_idx, bool) or not isinstance(stage_idx, int) or not 0 <= stage_idx < self.num_stages:
            raise ValueError(f"stage {stage_idx!r} is out of range for a pipe of {self.num_stages} stages: use one in "
                             f"[0, {self.num_stages - 1}]")
        return self.split_gm.get_submodule(f"submod_{stage_idx}")

    def info(self) -> PipeInfo:
        return PipeInfo(self.num_stages, self.has_loss_and_backward)

    def build_stage(self, stage_index: int, device: torch.device | str,
                    group: Optional[dist.ProcessGroup] = None) -> PipelineStage:
        """Stage `stage_index` on `device` (its module moved there), for a schedule."""
        return build_stage(self.get_stage_module(stage_index), stage_index, self.info(), device, group)


def build_stage(stage_module: nn.Module, stage_index: int, pipe_info: PipeInfo, device: torch.device | str,
                group: Optional[dist.ProcessGroup] = None) -> PipelineStage:
    """A `PipelineStage` of `pipe_info`'s pipe running `stage_module` (moved to `device`)."""
    return PipelineStage(stage_module.to(device), stage_index, pipe_info.num_stages, torch.device(device), group=group)


def pipeline(module: nn.Module, mb_args: tuple[Any, ...], mb_kwargs: Optional[dict[str, Any]] = None,
             split_spec: Optional[dict[str, SplitPoint]] = None,
             split_policy: Optional[Callable[..., Any]] = None) -> Pipe:
    """`module` cut into stages at `split_spec`'s blocks and its forward's `pipe_split()` calls
    (see the module docstring); `mb_args` is one micro-batch's positional arguments."""
    if split_policy is not None:
        raise ValueError("pipeline(split_policy=...) is not supported: name the cuts with split_spec "
                         "({'layers.2': SplitPoint.BEGINNING}) or call pipe_split() in the forward")
    if mb_kwargs:
        raise ValueError(f"pipeline(mb_kwargs={sorted(mb_kwargs)}) is not supported: the stages pass one block's "
                         "output to the next, so the module's inputs must be positional (mb_args)")
    if not isinstance(module, nn.Module):
        raise TypeError(f"pipeline cuts an nn.Module, got {describe(module)}")
    args = mb_args if isinstance(mb_args, tuple) else (mb_args,)
    blocks = list(_blocks(module))
    cuts = _cuts(split_spec or {}, [name for name, _ in blocks])
    cuts |= set(_check_forward(module, blocks, args))
    cuts.discard(0)
    bounds = [0, *sorted(c for c in cuts if c < len(blocks)), len(blocks)]
    return Pipe([_StageModule(blocks[a:b]) for a, b in zip(bounds, bounds[1:])])


def _blocks(module: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """The module's blocks in order (see the module docstring)."""
    for name, child in module.named_children():
        if isinstance(child, (nn.Sequential, nn.ModuleList, nn.ModuleDict)) and not isinstance(module, nn.Sequential):
            yield from ((f"{name}.{n}", c) for n, c in child.named_children())
        else:
            yield name, child


def _cuts(split_spec: dict[str, SplitPoint], names: list[str]) -> set[int]:
    """The block numbers where `split_spec` starts a stage."""
    problems, cuts = [], set()
    for name, point in split_spec.items():
        if name not in names:
            problems.append(f"split_spec names {name!r}, which is not one of the module's blocks {names}: cut at one of "
                            "those (cutting inside a block needs torch's traced split)")
        elif not isinstance(point, SplitPoint):
            problems.append(f"split_spec[{name!r}] is {point!r}: use SplitPoint.BEGINNING or SplitPoint.END")
        else:
            cuts.add(names.index(name) + (point is SplitPoint.END))
    if problems:
        raise ValueError("\n".join(problems) if len(problems) == 1 else
                         f"{len(problems)} problems with split_spec:\n" + "\n".join(f"  - {p}" for p in problems))
    return cuts


def _check_forward(module: nn.Module, blocks: list[tuple[str, nn.Module]], args: tuple[Any, ...]) -> list[int]:
    """Run the forward once on `args`: check that it is the blocks in a chain, return where
    `pipe_split()` was called."""
    run = _Run([], [])
    with _recording(run, blocks), torch.no_grad(), torch.random.fork_rng():
        output = module(*args)
    names = [name for name, _ in blocks]
    order = [k for k, *_ in run.calls]
    rule = ("pipeline (without a tracer) cuts a module whose forward runs its blocks once each, in order, each on "
            "the previous one's output")
    if order != list(range(len(blocks))):
        raise ValueError(f"{rule}; this forward called {[names[k] for k in order]}, the blocks are {names}: use "
                         "torch.distributed.pipelining.pipeline for other forwards, or build each stage's module by hand "
                         "(PipelineStage)")
    expected: Any = args
    for k, call_args, call_kwargs, out in run.calls:
        given = expected if isinstance(expected, tuple) else (expected,)
        if call_kwargs or len(call_args) != len(given) or any(a is not b for a, b in zip(call_args, given)):
            what = "the module's inputs" if k == 0 else f"the output of {names[k - 1]!r}"
            raise ValueError(f"{rule}; block {names[k]!r} was not called on exactly {what} (the forward computes "
                             "something between them): move that computation into a block, or build the stages "
                             "by hand (PipelineStage)")
        expected = out
    outs = output if isinstance(output, tuple) else (output,)
    last = expected if isinstance(expected, tuple) else (expected,)
    if len(outs) != len(last) or any(a is not b for a, b in zip(outs, last)):
        raise ValueError(f"{rule}; the forward returns something other than the output of its last block "
                         f"{names[-1]!r}: move that computation into a block")
    return run.marks


@contextmanager
def _recording(run: _Run, blocks: list[tuple[str, nn.Module]]) -> Iterator[None]:
    handles = []
    for k, (_, block) in enumerate(blocks):
        def hook(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any, k: int = k) -> None:
            run.calls.append((k, args, kwargs, out))
        handles.append(block.register_forward_hook(hook, with_kwargs=True))
    token = _RUN.set(run)
    try:
        yield
    finally:
        _RUN.reset(token)
        for h in handles:
            h.remove()
