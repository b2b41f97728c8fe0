"""Context parallelism: one long sequence split over the ranks of a cp mesh, attention exact.

`context_parallel(mesh, buffers=[...], buffer_seq_dims=[...])` is torch's experimental
context manager, on CPU and on any device: on entry every listed buffer (input ids,
position ids, labels, rotary tables) is cut in place along its sequence dim to the tokens
this rank holds; inside it, every `F.scaled_dot_product_attention` call of the model (an
unchanged Hugging Face model's sdpa attention included) runs over the whole sequence with
this rank's queries (`_cp_attention`); on exit the buffers get their whole values back,
gathered from the ranks (unless listed in `no_restore_buffers`).

    cp = sw.init_device_mesh("cpu", (4,), mesh_dim_names=("cp",))
    positions = torch.arange(ids.size(1)).expand_as(ids)
    shift = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], 1)  # next-token labels, shifted once
    with context_parallel(cp, buffers=[ids, positions, shift], buffer_seq_dims=[1, 1, 1]):
        # the mean over this rank's tokens (transformers computes a loss when `labels` is given,
        # and takes `shift_labels` as already shifted)
        loss = model(input_ids=ids, position_ids=positions, labels=shift, shift_labels=shift).loss
        loss.backward()

Pass `position_ids`, so the rotary tables are indexed by global positions, and labels
shifted once over the whole sequence (`shift_labels`), since a model that shifts its
`labels` itself would shift within each rank's piece. The cp ranks hold the same
parameters and each computes the gradient of its own tokens' loss: reduce the gradients
over cp as over data parallel (`fully_shard` or `data_parallel` on a mesh that includes
the cp dim), weighting by tokens when pieces differ in length.

Tokens are split head-tail by default (`SequenceLayout`); `set_load_balance(False)` gives
contiguous pieces. `set_rotate_method` picks how K/V reach the queries: `"allgather"`
(default), `"ring"` (point-to-point blocks merged by log-sum-exp), `"alltoall"` (the same
ring, each hop an all_to_all, as torch's) or `"ulysses"` (sequence <-> heads).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from contextvars import ContextVar, Token
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

from .._comm import all_gather_ints
from .._describe import describe
from .._mesh import DeviceMesh
from .._tensor import DTensor
from ._cp_attention import ROTATIONS, CpAttention
from ._cp_comm import CpGroup, gather_pieces
from ._cp_layout import SequenceLayout
from ._cp_mask import WINDOWS as _WINDOWS

__all__ = ["context_parallel", "context_parallel_unshard", "set_load_balance", "set_rotate_method"]


@dataclass
class _Options:
    """What `set_rotate_method` and `set_load_balance` chose (for contexts entered later)."""

    rotate: str = "allgather"
    balanced: bool = True


_OPTIONS = _Options()


def set_rotate_method(method: str) -> None:
    """How keys and values reach the queries of other ranks: "allgather" (default), "ring",
    "alltoall" or "ulysses" (see `_cp_attention`)."""
    if method not in ROTATIONS:
        raise ValueError(f"set_rotate_method({method!r}): the rotations are {list(ROTATIONS)}")
    _OPTIONS.rotate = method


def set_load_balance(balanced: bool) -> None:
    """Head-tail pieces (True, the default: rank r holds chunks r and 2cp-1-r of 2cp), or contiguous ones."""
    _OPTIONS.balanced = bool(balanced)


def cp_group(mesh: Any, what: str = "context_parallel") -> CpGroup:
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"{what} takes the cp DeviceMesh, got {describe(mesh)}")
    if mesh.ndim != 1:
        raise ValueError(f"{what} takes a 1-D cp mesh, got a {mesh.ndim}-D mesh with dims "
                         f"{mesh.mesh_dim_names}: pass its cp sub-mesh, e.g. mesh['cp']")
    return CpGroup(mesh.get_group(0), mesh.size(), mesh.get_local_rank(0), tuple(int(r) for r in mesh.mesh.tolist()))


def make_cp_attention(length: int, cp: CpGroup) -> CpAttention:
    """Attention for sequences of `length` tokens split over `cp`, by the rotation and load
    balance set now (`set_rotate_method`, `set_load_balance`)."""
    return CpAttention(SequenceLayout(length, cp.size, _OPTIONS.balanced), cp, _OPTIONS.rotate)


def _check_buffers(buffers: Sequence[torch.Tensor], dims: Sequence[int]) -> int:
    """The sequence length the buffers share; every problem with them raised at once."""
    problems: list[str] = []
    if len(buffers) != len(dims):
        problems.append(f"{len(buffers)} buffers but {len(dims)} buffer_seq_dims: give one sequence dim per buffer")
    lengths = {}
    for i, (b, d) in enumerate(zip(buffers, dims)):
        if not isinstance(b, torch.Tensor) or isinstance(b, DTensor):
            problems.append(f"buffers[{i}] is {describe(b)}: buffers are plain tensors, whole on every rank")
            continue
        if not -b.dim() <= d < b.dim():
            problems.append(f"buffer_seq_dims[{i}]={d} is out of range for buffers[{i}] of shape {tuple(b.shape)}")
            continue
        lengths[i] = b.size(d)
    if len(set(lengths.values())) > 1:
        problems.append("the buffers' sequence dims differ in length: " +
                        ", ".join(f"buffers[{i}] {n}" for i, n in lengths.items()) +
                        ": list buffers of one sequence, with the dim that runs along it")
    if problems:
        raise ValueError("context_parallel:\n" + "\n".join(f"  - {p}" for p in problems))
    return next(iter(lengths.values()), 0)


_ACTIVE: ContextVar[Optional[CpAttention]] = ContextVar("shardwise_cp_attention", default=None)


def current_cp_attention() -> Optional[CpAttention]:
    """The context-parallel attention running now (its layout says which tokens this rank
    holds), or None outside context parallelism."""
    return _ACTIVE.get()


def cp_mode_on() -> bool:
    """Whether a context-parallel attention mode is on this thread's torch function mode stack
    (it is not in a backward pass: autograd's engine runs without the caller's modes)."""
    return any(isinstance(m, Attention) for m in _get_current_function_mode_stack())  # type: ignore[no-untyped-call]


def recomputed_under(attention: CpAttention, fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` run with `attention` on whenever it is called without it (a checkpointed layer's
    recomputation in backward)."""
    def run(*args: Any, **kwargs: Any) -> Any:
        if cp_mode_on():
            return fn(*args, **kwargs)
        with Attention(attention):
            return fn(*args, **kwargs)
    return run


def _window_of(module: torch.nn.Module) -> tuple[bool, Optional[int]]:
    """(whether `module` is an attention layer, its sliding window): transformers' attention
    modules carry `is_causal`; Qwen2's and Gemma's a `sliding_window` of their own (None on
    full layers), Mistral's only in its config."""
    if not hasattr(module, "is_causal"):
        return False, None
    window = module.sliding_window if hasattr(module, "sliding_window") else getattr(
        getattr(module, "config", None), "sliding_window", None)
    return True, window if isinstance(window, int) and not isinstance(window, bool) and window > 0 else None


def _enter_layer(module: torch.nn.Module, _args: Any) -> None:
    if _ACTIVE.get() is not None:
        is_attention, window = _window_of(module)
        if is_attention:
            _WINDOWS.set(_WINDOWS.get() + (window,))


def _leave_layer(module: torch.nn.Module, _args: Any, _out: Any) -> None:
    if _ACTIVE.get() is not None and _WINDOWS.get() and _window_of(module)[0]:
        _WINDOWS.set(_WINDOWS.get()[:-1])


_SDPA = F.scaled_dot_product_attention  # torch's own, whatever torch.nn.functional holds later
_HOLDERS = [0]  # open blocks that need `_sdpa_or_recompute` in torch.nn.functional
_HOOKS: list[Any] = []  # the global module hooks that follow sliding windows, while a block is open


def _sdpa_or_recompute(*args: Any, **kwargs: Any) -> Any:
    """`F.scaled_dot_product_attention` while a `context_parallel` block is open. A call with the
    block's attention set but its mode off is a recomputation in backward (torch.utils.checkpoint,
    transformers' gradient checkpointing: autograd runs backward without the caller's torch
    function modes); it runs context-parallel, as the forward did. Any other call is torch's."""
    attention = _ACTIVE.get()
    if attention is not None and not cp_mode_on():
        with Attention(attention):
            return _SDPA(*args, **kwargs)
    return _SDPA(*args, **kwargs)


def _hold() -> None:
    """While at least one context-parallel attention is on: `_sdpa_or_recompute` in
    torch.nn.functional (the name a model looks up at call time, as transformers' sdpa
    attention does), and hooks on every module's forward that note the sliding window of the
    attention layer running."""
    if _HOLDERS[0] == 0:
        F.scaled_dot_product_attention = _sdpa_or_recompute
        _HOOKS.append(torch.nn.modules.module.register_module_forward_pre_hook(_enter_layer))
        _HOOKS.append(torch.nn.modules.module.register_module_forward_hook(_leave_layer, always_call=True))
    _HOLDERS[0] += 1


def _release() -> None:
    _HOLDERS[0] -= 1
    if _HOLDERS[0] == 0:
        F.scaled_dot_product_attention = _SDPA
        while _HOOKS:
            _HOOKS.pop().remove()


class Attention(TorchFunctionMode):
    """Runs every `F.scaled_dot_product_attention` inside the context context-parallel."""

    def __init__(self, attention: CpAttention) -> None:
        super().__init__()
        self.attention = attention
        self.tokens: list[Token[Optional[CpAttention]]] = []

    def __enter__(self) -> Attention:
        self.tokens.append(_ACTIVE.set(self.attention))
        _hold()
        super().__enter__()  # type: ignore[no-untyped-call]
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)  # type: ignore[no-untyped-call]
        _release()
        _ACTIVE.reset(self.tokens.pop())

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (),
                           kwargs: Optional[dict[str, Any]] = None) -> Any:
        kwargs = kwargs or {}
        if func is _SDPA:
            return self.attention(_SDPA, *args, **kwargs)
        return func(*args, **kwargs)


def _whole_positions(position_ids: Optional[torch.Tensor], length: int) -> Optional[torch.Tensor]:
    """A copy of the whole (batch, seq) position ids (taken before the buffers are cut)."""
    if position_ids is None:
        return None
    if not isinstance(position_ids, torch.Tensor) or isinstance(position_ids, DTensor):
        raise TypeError(f"context_parallel(position_ids=...) takes a plain tensor, got {describe(position_ids)}")
    positions = position_ids.unsqueeze(0) if position_ids.dim() == 1 else position_ids
    if positions.dim() != 2 or positions.size(-1) != length or positions.is_floating_point():
        raise ValueError(f"context_parallel(position_ids=...) takes integer position ids of shape (batch, {length}) "
                         f"(the buffers' sequence length), got {positions.dtype} of shape {tuple(position_ids.shape)}")
    return positions.detach().clone()


def _set(buffer: torch.Tensor, value: torch.Tensor) -> None:
    if buffer.requires_grad:  # a leaf the block made require grad: autograd refuses resize_ on it
        buffer.data = value.detach().clone()
        return
    with torch.no_grad():
        buffer.resize_(value.shape)
        buffer.copy_(value)


@contextlib.contextmanager
def context_parallel(mesh: DeviceMesh, *, buffers: Optional[Sequence[torch.Tensor]] = None,
                     buffer_seq_dims: Optional[Sequence[int]] = None,
                     no_restore_buffers: Optional[set[torch.Tensor]] = None,
                     position_ids: Optional[torch.Tensor] = None) -> Iterator[CpAttention]:
    """Split `buffers` along `buffer_seq_dims` over the 1-D cp `mesh` and run attention
    context-parallel until the block ends (see the module docstring). Yields the attention
    object (`explain()` says what it does).

    `position_ids` (a shardwise addition; (batch, seq), whole, and usually one of the
    buffers too): when several documents are packed in a sample (positions restarting),
    attention stays within each document, and a model's own mask built from the position
    ids of this rank's tokens is recognised and replaced by the global one."""
    with split_sequence(cp_group(mesh), list(buffers or []), [int(d) for d in (buffer_seq_dims or [])],
                        {id(b) for b in (no_restore_buffers or ())}, position_ids) as attention:
        yield attention


@contextlib.contextmanager
def split_sequence(cp: CpGroup, buffers: list[torch.Tensor], dims: list[int], keep: set[int],
                   position_ids: Optional[torch.Tensor], problem: Optional[Exception] = None,
                   one_document: bool = False, agree: Optional[tuple[str, int]] = None) -> Iterator[CpAttention]:
    """`context_parallel`'s body on the cp group: agree, cut `buffers` in place, run
    attention context-parallel, restore the buffers not in `keep` (ids). `problem`: an error
    the caller found in its own input, raised on this rank after the ranks agreed;
    `one_document`: the position ids were made 0..S-1 (no documents to look for); `agree`: a
    (what, value) every rank must give the same value for (say, whether labels were passed),
    checked in the same exchange, so that ranks that would issue different collectives after
    the call stop with an error instead."""
    length, layout, positions = 0, None, None
    try:
        if problem is not None:
            raise problem
        length = _check_buffers(buffers, dims)
        if not buffers:
            raise ValueError("context_parallel needs the buffers that carry the sequence (input ids, position ids, "
                             "labels) and their sequence dims: buffers=[...], buffer_seq_dims=[...]")
        layout = SequenceLayout(length, cp.size, _OPTIONS.balanced)
        positions = _whole_positions(position_ids, length)
    except (TypeError, ValueError) as exc:
        problem = exc
    # the cp ranks agree before any buffer is cut: a rank with bad input, or a sequence of
    # another length, stops every rank with an error instead of a collective that never matches
    rows = all_gather_ints([int(problem is not None), length, agree[1] if agree else 0], cp.group, cp.size)
    if problem is not None:
        raise problem
    failed = [r for r, (bad, _, _) in enumerate(rows) if bad]
    if failed:
        raise ValueError(f"context_parallel: the input of cp rank(s) {failed} was refused (see their errors); "
                         "nothing was cut")
    values = [v for _, _, v in rows]
    if agree and len(set(values)) > 1:
        raise ValueError(f"ContextParallel: the cp ranks differ in {agree[0]}: {values} by cp rank; every cp rank "
                         "makes the same call, with the same arguments")
    lengths = [n for _, n, _ in rows]
    if len(set(lengths)) > 1:
        raise ValueError(f"context_parallel: the cp ranks hold sequences of lengths {lengths}; every cp rank passes "
                         "the whole sequence (the same buffers), and context_parallel cuts it")
    assert layout is not None
    # the whole values, for an exit by exception: the ranks may then be out of step, and a
    # collective to gather the pieces back could wait for ranks that never come
    saved = [b.clone() if id(b) not in keep else None for b in buffers]
    for b, d in zip(buffers, dims):
        _set(b, b.index_select(d, layout.index(cp.rank, b.device)))
    attention = CpAttention(layout, cp, _OPTIONS.rotate, positions, one_document)
    try:
        with Attention(attention):
            yield attention
    except BaseException:
        for b, whole in zip(buffers, saved):
            if whole is not None:
                _set(b, whole)
        raise
    for b, d, whole in zip(buffers, dims, saved):
        if whole is not None:
            _set(b, _unshard(b, d % b.dim(), layout, cp))  # gathered: what the block wrote into its pieces


def _unshard(local: torch.Tensor, dim: int, layout: SequenceLayout, cp: CpGroup) -> torch.Tensor:
    """The whole buffer from every rank's piece (gathered rank by rank, then put in sequence order)."""
    gathered = gather_pieces(local, dim, layout.lengths, cp)
    whole = torch.empty_like(gathered)
    return whole.index_copy_(dim, layout.gathered_index(local.device), gathered)


def context_parallel_unshard(mesh: DeviceMesh, buffers: Sequence[torch.Tensor], seq_dims: Sequence[int]
                             ) -> list[torch.Tensor]:
    """The whole tensors of `buffers`, each one rank's piece of a sequence split by
    `context_parallel` (with the load balance in effect), gathered over the cp `mesh`."""
    cp = cp_group(mesh)
    out = []
    for b, d in zip(buffers, seq_dims):
        d = d % b.dim()
        lengths = [n for (n,) in all_gather_ints([b.size(d)], cp.group, cp.size)]
        layout = SequenceLayout(sum(lengths), cp.size, _OPTIONS.balanced)
        if tuple(lengths) != layout.lengths:
            raise ValueError(f"context_parallel_unshard: the ranks hold {lengths} tokens, but a "
                             f"{sum(lengths)}-token sequence split {'head-tail' if layout.balanced else 'contiguously'}"
                             f" gives {list(layout.lengths)}: unshard with the load balance the sequence was split by")
        out.append(_unshard(b, d, layout, cp))
    return out
