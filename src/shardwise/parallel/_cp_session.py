"""One open context-parallel block, as a session object that owns the block's state.

A `CpSession` is what `context_parallel(...)`, the `ContextParallel` style and a
context-parallel pipeline stage enter. It holds the block's `CpAttention` (layout, cp
group, the rotation chosen when it was made), the buffers it cut (`SplitBuffers`), the
rules of the attention layers running now (sliding window, chunks), and, while open, the torch function
mode that sends every `F.scaled_dot_product_attention` call to that attention. On exit the
buffers are whole again, the mode is popped, and nothing of the block remains.

Two things must be process-wide, and are kept to these:

- `_SESSION`, a ContextVar: the session open in this context. Code that runs inside a
  block without being handed the session finds it there: the module hooks below, SDPA
  called in backward, and the pipeline's micro-batch code (`current_cp_attention`). A
  ContextVar rather than a plain global, so each thread (a dry run's simulated ranks run
  one thread each) sees its own.
- `_HOOKS`, the two hooks a block needs in tables torch keeps per process, installed when
  the first session opens and removed when the last one closes (a reference count: blocks
  nest, and a dry run opens one per simulated rank):
  (a) `torch.nn.functional.scaled_dot_product_attention` replaced by `_sdpa_or_recompute`.
  Autograd runs backward without the caller's torch function modes, so a checkpointed
  layer recomputed in backward (torch.utils.checkpoint, transformers' gradient
  checkpointing) would call torch's SDPA over this rank's tokens alone; the function a
  model looks up at call time (as transformers' sdpa attention does) sends that call to the
  open session instead. (b) A forward pre-hook and a forward hook on every module, which
  note the attention layer running (its sliding window or chunks, `LayerNote`):
  `context_parallel` is not given the model, so its layers can be found no other way.

One layer kind reads positions without position ids: Llama 4's NoPE layers with
`attn_temperature_tuning` scale each query by `torch.arange(tokens)`, which on a cp rank
counts its own piece from 0. While such a layer runs, the mode answers exactly that call
(`torch.arange(n)` for this rank's n tokens) with the global positions of the rank's tokens,
so each query is scaled as in one process.
Outside every block `F.scaled_dot_product_attention` is torch's own and no hook is left.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from contextvars import ContextVar, Token
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack
from torch.utils.hooks import RemovableHandle

from ._cp_attention import CpAttention
from ._cp_buffers import SplitBuffers
from ._cp_mask import WHOLE_PAST, LayerRule

__all__ = ["CpSession", "LayerNote", "cp_mode_on", "current_cp_attention", "current_session", "recomputed_under"]

_TORCH_SDPA = F.scaled_dot_product_attention  # torch's own (a constant: what the module held at import)


class CpSession:
    """One context-parallel block: `attention` on every SDPA call while the session is open, and
    `buffers` (if any) cut on entry and whole again on exit. Entered once; make one per block."""

    def __init__(self, attention: CpAttention, buffers: Optional[SplitBuffers] = None) -> None:
        self.attention = attention
        self.buffers = buffers
        self.layers: list[LayerNote] = []  # the attention layers running, innermost last
        self._open: Optional[tuple[Token[Optional[CpSession]], _CpMode]] = None

    @property
    def layer(self) -> LayerNote:
        """The attention layer running now (outside every one: the whole causal past)."""
        return self.layers[-1] if self.layers else _NO_LAYER

    def attend(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """One `F.scaled_dot_product_attention(*args, **kwargs)` call, context-parallel."""
        return self.attention(_TORCH_SDPA, self.layer.rule, *args, **kwargs)

    def positions(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Optional[torch.Tensor]:
        """The global positions of this rank's tokens, for a `torch.arange(*args, **kwargs)` call
        that counts them inside a layer that reads positions so (see the module docstring);
        None for any other call."""
        mine = self.attention.layout.lengths[self.attention.cp.rank]
        if not (self.layer.counts_positions and len(args) == 1 and isinstance(args[0], int) and args[0] == mine
                and set(kwargs) <= {"device"}):
            return None
        return self.attention.layout.index(self.attention.cp.rank, kwargs.get("device") or "cpu")

    def __enter__(self) -> CpAttention:
        if self._open is not None:
            raise RuntimeError("a CpSession is entered once at a time: make one per block")
        outer = _SESSION.get()  # a block opened inside an attention layer keeps that layer's rules
        self.layers = list(outer.layers) if outer is not None else []
        if self.buffers is not None:
            self.buffers.cut()
        token = _SESSION.set(self)
        _HOOKS.hold()
        mode = _CpMode(self)
        mode.__enter__()  # type: ignore[no-untyped-call]
        self._open = (token, mode)
        return self.attention

    def __exit__(self, kind: Optional[type[BaseException]], exc: Optional[BaseException], tb: Any) -> None:
        assert self._open is not None
        token, mode = self._open
        self._open = None
        mode.__exit__(kind, exc, tb)  # type: ignore[no-untyped-call]
        _HOOKS.release()
        _SESSION.reset(token)
        if self.buffers is not None:
            self.buffers.restore(failed=kind is not None)

    def enter_layer(self, module: torch.nn.Module) -> None:
        note = _note_of(module)
        if note is not None:
            self.layers.append(note)

    def leave_layer(self, module: torch.nn.Module) -> None:
        if self.layers and _note_of(module) is not None:
            self.layers.pop()


class _CpMode(TorchFunctionMode):
    """Sends every `F.scaled_dot_product_attention` call to its session's attention."""

    def __init__(self, session: CpSession) -> None:
        super().__init__()
        self.session = session

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (),
                           kwargs: Optional[dict[str, Any]] = None) -> Any:
        kwargs = kwargs or {}
        if func is _TORCH_SDPA:
            return self.session.attend(args, kwargs)
        if func is torch.arange:
            positions = self.session.positions(args, kwargs)
            if positions is not None:
                return positions
        return func(*args, **kwargs)


_SESSION: ContextVar[Optional[CpSession]] = ContextVar("shardwise_cp_session", default=None)


def current_session() -> Optional[CpSession]:
    """The context-parallel session open in this context, or None."""
    return _SESSION.get()


def current_cp_attention() -> Optional[CpAttention]:
    """The context-parallel attention running now (its layout says which tokens this rank
    holds), or None outside context parallelism."""
    session = _SESSION.get()
    return session.attention if session is not None else None


def cp_mode_on() -> bool:
    """Whether a session's torch function mode is on this thread's mode stack (it is not in a
    backward pass: autograd's engine runs without the caller's modes)."""
    return any(isinstance(m, _CpMode) for m in _get_current_function_mode_stack())  # type: ignore[no-untyped-call]


def recomputed_under(attention: CpAttention, fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` run in a session of `attention` whenever it is called outside one's mode (a
    checkpointed layer's recomputation in backward)."""
    def run(*args: Any, **kwargs: Any) -> Any:
        if cp_mode_on():
            return fn(*args, **kwargs)
        with CpSession(attention):
            return fn(*args, **kwargs)
    return run


def _sdpa_or_recompute(*args: Any, **kwargs: Any) -> Any:
    """`F.scaled_dot_product_attention` while a session is open. A call with a session open but
    its mode off is a recomputation in backward (see the module docstring): it runs
    context-parallel, as the forward did. Any other call is torch's."""
    session = _SESSION.get()
    if session is not None and not cp_mode_on():
        return session.attend(args, kwargs)
    return _TORCH_SDPA(*args, **kwargs)


@dataclass(frozen=True)
class LayerNote:
    """An attention layer as context parallelism sees it: its `rule` (sliding window, chunks)
    and whether it `counts_positions` with `torch.arange` (Llama 4's temperature tuning)."""

    rule: LayerRule = WHOLE_PAST
    counts_positions: bool = False


_NO_LAYER = LayerNote()


def _note_of(module: torch.nn.Module) -> Optional[LayerNote]:
    """`module`'s note if it is an attention layer, else None. transformers' attention modules
    carry `is_causal`; Qwen2's and Gemma's a `sliding_window` of their own (None on full
    layers), Mistral's only in its config; Llama 4's chunked layers are named in
    `config.layer_types` and chunk by `config.attention_chunk_size`."""
    if not hasattr(module, "is_causal"):
        return None
    config = getattr(module, "config", None)
    window = module.sliding_window if hasattr(module, "sliding_window") else getattr(config, "sliding_window", None)
    types, index = getattr(config, "layer_types", None), getattr(module, "layer_idx", None)
    chunked = isinstance(types, (list, tuple)) and isinstance(index, int) and index < len(types) and \
        types[index] == "chunked_attention"
    chunk = getattr(config, "attention_chunk_size", None) if chunked else None
    return LayerNote(LayerRule(_positive(window), _positive(chunk)),
                     counts_positions=bool(getattr(module, "attn_temperature_tuning", False))
                     and not getattr(module, "use_rope", True))


def _positive(value: Any) -> Optional[int]:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _enter_layer(module: torch.nn.Module, _args: Any) -> None:
    session = _SESSION.get()
    if session is not None:
        session.enter_layer(module)


def _leave_layer(module: torch.nn.Module, _args: Any, _out: Any) -> None:
    session = _SESSION.get()
    if session is not None:
        session.leave_layer(module)


class _ProcessHooks:
    """`_sdpa_or_recompute` in torch.nn.functional and the layer hooks on every module, in
    place while `holders` sessions are open (see the module docstring)."""

    def __init__(self) -> None:
        self.holders = 0
        self._handles: list[RemovableHandle] = []
        self._lock = threading.Lock()

    def hold(self) -> None:
        with self._lock:
            if self.holders == 0:
                F.scaled_dot_product_attention = _sdpa_or_recompute
                self._handles = [
                    torch.nn.modules.module.register_module_forward_pre_hook(_enter_layer),
                    torch.nn.modules.module.register_module_forward_hook(_leave_layer, always_call=True)]
            self.holders += 1

    def release(self) -> None:
        with self._lock:
            self.holders -= 1
            if self.holders == 0:
                F.scaled_dot_product_attention = _TORCH_SDPA
                for handle in self._handles:
                    handle.remove()
                self._handles = []


_HOOKS = _ProcessHooks()
