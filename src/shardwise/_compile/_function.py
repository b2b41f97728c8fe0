"""`compile(fn)`: run a function on DTensors once while tracing, then replay its local program.

Eager DTensor code pays, per op, a plan lookup, argument rewriting and wrapper creation
on top of the local op. For a function called again and again with the same layouts
(a train step), all of that is the same every time: what differs is only the data. So
the first call with a signature runs `fn` eagerly under `make_fx` over the *local*
tensors: DTensor dispatch runs as usual and the tracer records what reaches the local
tensors, the local aten ops, including the backward ops of any `autograd.grad` or
`backward()` inside `fn`, and the collectives, as `shardwise::collective` nodes (see
`_trace`). Later calls with the same signature run that graph on the inputs'
local tensors and wrap the outputs with the specs recorded at trace time: no DTensor
dispatch, no propagation, no plan lookups, but the same collectives.

The signature is the pytree structure of the arguments, each DTensor's spec and
`requires_grad`, each plain tensor's shape, stride, dtype and device, every other value,
grad mode, and the state `fn` may read or write besides its arguments: the parameters and
buffers of `nn.Module` arguments, the `.grad` of every parameter, and the state tensors and
hyperparameters of `torch.optim.Optimizer` arguments (but not Adam's learning rate: see
below). State that `fn` rebinds (a new `.grad`, `zero_grad()` setting it to None, a state
tensor) is rebound again on replay; state changed in place is changed in place by the
replay. A call that creates optimizer state (the first step) is not kept: the next call,
which finds the state, is traced.
A compiled function called inside another's trace runs as part of that trace.

Host work that must happen at every call, not only at the trace, is one `shardwise::host` node
(`_trace.Trace.host`, `_host`): a pipeline's point-to-point messages, whose headers are read in
Python (shapes, a peer's failure), and the ring rotation's. Code that files such steps may
register hooks the replay calls before the graph and when it raises (a pipeline relays the
failure to the stages it owes messages, as its eager step does), or refuse the trace.

What cannot be replayed is refused after the trace: values read back into Python
(`.item()`, data-dependent shapes), random ops (not those with a dropout probability of 0,
as attention is called in eval), collectives outside `shardwise._comm`, what a host step's
owner refuses (`Trace.refuse`), and an input
DTensor whose layout `fn` changed in place. A refused signature is traced once more on its
next call (a first call may read values for one-time work, such as the ranks agreeing on a
plain tensor once); refused again, it runs eagerly from then on, with a one-time warning
naming the reason. Outputs carry no autograd history
(they are detached, on the traced call too): the replay is not differentiable from outside,
so take gradients inside `fn`.

Optimizers: SGD, Adam and AdamW replay. On their for-loop and foreach paths torch's Adam
reads its step count into Python to form the bias corrections and SGD turns a tensor lr back
into a Python number, which a trace would bake in as constants; so while tracing, each
SGD/Adam/AdamW group whose parameters are on the CPU (and that is neither `differentiable`
nor `capturable`) steps on its fused kernel, which reads the step count from the state tensor
and takes the lr as a tensor: the lr is an input, a 0-dim float64 tensor made from the group's
`lr` on every call, so a learning-rate schedule replays one program (`_optim`). The
flags are set for the trace only; a fused step rounds as the user's path does up to the order
of operations. A compiled function keeps its `MAX_SIGNATURES` most recent programs, dropping
the oldest with a one-time warning, so a signature that changes every call is slow but does
not grow. The first step, which creates the optimizer's state and is never kept, runs on the
eager path, so its numbers are eager's exactly. Other optimizers that read a step count with
`.item()` (Adagrad, Adamax, ASGD, NAdam, RAdam, Adafactor) and Adam on other devices run
eagerly, with the warning.

Python control flow on tensor values, and tensors `fn` reads from its closure rather than
its arguments, are traced as they were on the first call (closure tensors by identity,
with a one-time warning: in-place updates to them are seen; rebinding them, and the
`.grad` a `backward()` gives them, are not): pass modules, optimizers and tensors as
arguments. `fn` must not rebind a module's parameters or buffers (they are re-read on
every call, so rebinding them between calls is fine).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Hashable
from typing import Any, Optional, Union

import torch
import torch.utils._pytree as pytree
from torch.fx.experimental.proxy_tensor import make_fx

from .._comm import COLLECTIVE
from .._tensor import DTensor
from ._host import HOST
from ._optim import fused_for_trace, lr_inputs
from ._program import Program, output_kinds, slot_writes
from ._refusal import outside_tensors, refusal
from ._signature import Slot, find_slots, local_piece, tensor_key
from ._trace import collectives_as_nodes

__all__ = ["MAX_SIGNATURES", "CompiledFunction", "compile"]

MAX_SIGNATURES = 32  # programs (and refusals) one compiled function keeps, the most recent
_EAGER = object()  # a signature that runs eagerly (its trace was refused)
_MAKES_STATE = object()  # a signature that runs eagerly (it creates optimizer state: a first step)
_RETRY = object()  # a signature whose first trace was refused: traced once more
_FIRST_STEP = "fn created optimizer state (a first step): later calls, with the state, are traced and replayed"
_TRACING = [False]  # a trace is running (on this process: tracing holds `_trace`'s lock)


class CompiledFunction:
    """`fn` traced once per signature and replayed after (see `shardwise.compile`)."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self._fn = fn
        self._programs: dict[Hashable, Union[Program, object]] = {}
        self._warned: set[str] = set()
        functools.update_wrapper(self, fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if _TRACING[0]:  # called from inside another compiled function's trace: becomes part of it
            return self._fn(*args, **kwargs)
        leaves, tree = pytree.tree_flatten((args, kwargs))
        lrs = lr_inputs(leaves)
        slots, extra = find_slots(leaves, lrs)
        state = [get() for get, _ in slots]
        key = (tree, torch.is_grad_enabled(), tuple(tensor_key(x) for x in leaves),
               tuple(tensor_key(x) for x in state), tuple(extra))
        program = self._programs.get(key)
        if program is None or program is _RETRY:
            return self._trace(key, args, kwargs, leaves, slots, state, lrs)
        if program is _EAGER or program is _MAKES_STATE:
            return self._fn(*args, **kwargs)
        assert isinstance(program, Program)
        return program.run(leaves + state, slots)

    def _remember(self, key: Hashable, program: Union[Program, object]) -> None:
        """Keep `program` for `key`; past MAX_SIGNATURES the oldest is dropped (its graph and
        collective records with it), so a signature that changes every call cannot grow memory."""
        self._programs.pop(key, None)
        self._programs[key] = program
        if len(self._programs) > MAX_SIGNATURES:
            del self._programs[next(iter(self._programs))]
            if "signatures" not in self._warned:
                self._warned.add("signatures")
                warnings.warn(
                    f"shardwise.compile({getattr(self._fn, '__qualname__', repr(self._fn))}) has seen more than "
                    f"{MAX_SIGNATURES} signatures: something it keys on changes from call to call (a Python number "
                    "such as a scheduled learning rate SGD reads, a new shape each call), so it keeps tracing; the "
                    "oldest programs are dropped. Pass changing numbers as tensors, or keep shapes fixed",
                    stacklevel=4,
                )

    def programs(self) -> int:
        """How many signatures have been traced into a replayable program."""
        return sum(isinstance(p, Program) for p in self._programs.values())

    def eager(self) -> int:
        """How many signatures run eagerly because their trace was refused (a warning said why)."""
        return sum(p is _EAGER for p in self._programs.values())

    def _trace(self, key: Hashable, args: tuple[Any, ...], kwargs: dict[str, Any], leaves: list[Any],
               slots: list[Slot], state: list[Any], lrs: dict[int, torch.Tensor]) -> Any:
        inputs = leaves + state
        tensor_ids = {id(t): i for i, t in reversed(list(enumerate(inputs))) if isinstance(t, torch.Tensor)}
        before = [(t._spec, t._local_tensor) if isinstance(t, DTensor) else None for t in inputs]
        seen: dict[str, Any] = {}

        def traced(*local_inputs: torch.Tensor) -> list[torch.Tensor]:
            out = self._fn(*args, **kwargs)
            out_leaves, seen["tree"] = pytree.tree_flatten(out)
            seen["out"], seen["after"] = out, [get() for get, _ in slots]
            results = [local_piece(t) for t in out_leaves if isinstance(t, torch.Tensor) and id(t) not in tensor_ids]
            results += [local_piece(t) for t, old in zip(seen["after"], state)
                        if t is not old and isinstance(t, torch.Tensor) and not isinstance(old, frozenset)]
            return results

        _TRACING[0] = True
        with collectives_as_nodes() as trace:
            # values read into Python are recorded, not refused here: `refusal` names them after the run
            try:
                with fused_for_trace(leaves, lrs):
                    gm = make_fx(traced, tracing_mode="real", _error_on_data_dependent_ops=False)(
                        *[local_piece(t) for t in inputs if isinstance(t, torch.Tensor)]
                    )
            except BaseException:
                trace.forget()
                raise
            finally:
                _TRACING[0] = False
        out, out_tree, after = seen["out"], seen["tree"], seen["after"]
        reason = self._check(inputs, before, pytree.tree_leaves(out), slots, state, after)
        if reason is not _FIRST_STEP:  # a first step is expected, not a problem: the next call traces
            reason = trace.refused or refusal(gm) or reason
        if reason is not None:
            trace.forget()
            # values read on a first call may come from one-time work (caches filling, the ranks
            # checking a plain tensor once): the second call traces again before giving up
            retry = reason is not _FIRST_STEP and self._programs.get(key) is not _RETRY
            self._remember(key, _RETRY if retry else _MAKES_STATE if reason is _FIRST_STEP else _EAGER)
            if not retry and reason not in self._warned and reason is not _FIRST_STEP:
                self._warned.add(reason)
                name = getattr(self._fn, "__qualname__", repr(self._fn))
                warnings.warn(f"shardwise.compile({name}) runs eagerly for this signature: {reason}", stacklevel=3)
            return out
        gm.graph.eliminate_dead_code(lambda n: n.target in (COLLECTIVE, HOST) or n.is_impure())
        gm.recompile()
        self._warn_outside(gm)
        self._remember(key, Program(
            gm, out_tree, output_kinds(pytree.tree_leaves(out), tensor_ids), slot_writes(state, after), trace
        ))
        # replayed outputs carry no autograd history: neither do the traced ones, so both calls agree
        return pytree.tree_map_only(
            torch.Tensor, lambda t: t if id(t) in tensor_ids or not t.requires_grad else t.detach(), out
        )

    def _warn_outside(self, gm: torch.fx.GraphModule) -> None:
        """Warn once if the graph reads tensors from outside fn's arguments (see `_refusal.outside_tensors`)."""
        outside = outside_tensors(gm)
        if outside and "outside" not in self._warned:
            self._warned.add("outside")
            warnings.warn(
                f"shardwise.compile({getattr(self._fn, '__qualname__', repr(self._fn))}) replays with {outside} "
                f"tensor(s) that fn reads from outside its arguments (a closure or global, e.g. a model's "
                f"parameters) baked in by identity: in-place updates to them are seen, but rebinding them is not, "
                f"nor are gradients that backward() gives them; pass the module, optimizer or tensor as an argument",
                stacklevel=4,  # the caller of the compiled function (through _trace and __call__)
            )

    @staticmethod
    def _check(inputs: list[Any], before: list[Any], out_leaves: list[Any], slots: list[Slot],
               state: list[Any], after: list[Any]) -> Optional[str]:
        for t, old in zip(inputs, before):
            if old is not None and (t._spec != old[0] or t._local_tensor is not old[1]):
                return f"fn changed the layout of an input DTensor in place (now {t._spec.layout_str()})"
        for old, new in zip(state, after):
            if isinstance(old, frozenset) and new != old:
                return _FIRST_STEP
        return None


def compile(fn: Callable[..., Any]) -> CompiledFunction:
    """Trace `fn` on its first call with each signature and replay the traced local program after.

    Use as `step = shardwise.compile(step)` or `@shardwise.compile`. Arguments may be
    DTensors, plain tensors, `nn.Module`s and optimizers (their parameters, gradients and
    state are inputs too), and any hashable values, nested in lists, tuples and dicts.
    Results and gradients equal eager; see the module docstring for what runs eagerly.
    """
    if not callable(fn):
        raise TypeError(f"shardwise.compile takes a function, got {type(fn).__name__}: use shardwise.compile(step)")
    return CompiledFunction(fn)
