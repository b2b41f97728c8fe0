"""Context parallelism as one session object: a block leaves nothing behind, the rotation is chosen once.

A `context_parallel` block is a `CpSession` that owns its state. While blocks are open,
`F.scaled_dot_product_attention` is replaced and two global module hooks are in place,
counted across nested blocks; after the last block exits (normally or by an exception),
torch's own function is back, no hook is left and no session is current. The rotation is
looked up by name once, in `set_rotate_method`; the block takes the `Rotation` object, and
no context-parallel module compares rotation names.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.experimental import context_parallel, set_load_balance, set_rotate_method
from shardwise.parallel import _context_parallel, _cp_session
from shardwise.parallel._cp_attention import CpAttention
from shardwise.parallel._cp_comm import CpGroup
from shardwise.parallel._cp_layout import SequenceLayout
from shardwise.parallel._cp_ring import all_to_all_hop, point_to_point
from shardwise.parallel._cp_rotation import ROTATIONS, AllGather, Ring, Ulysses
from shardwise.parallel._cp_session import CpSession, current_session
from shardwise.testing import run_distributed

PARALLEL = Path(sw.__file__).resolve().parent / "parallel"
TORCH_SDPA = torch._C._nn.scaled_dot_product_attention


def _no_state_left() -> None:
    assert F.scaled_dot_product_attention is TORCH_SDPA  # torch's own
    assert current_session() is None and _context_parallel.current_cp_attention() is None
    assert _cp_session._HOOKS.holders == 0 and not _cp_session._HOOKS._handles
    pre = torch.nn.modules.module._global_forward_pre_hooks.values()
    post = torch.nn.modules.module._global_forward_hooks.values()
    assert _cp_session._enter_layer not in pre and _cp_session._leave_layer not in post


def _one_rank_attention() -> CpAttention:
    return CpAttention(SequenceLayout(8, 1), CpGroup(None, 1, 0, (0,)))


def _blocks() -> None:
    set_rotate_method("ring")
    set_load_balance(True)
    mesh = sw.init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    _no_state_left()
    ids, labels = torch.arange(16).expand(2, 16).clone(), torch.arange(12).expand(2, 12).clone()
    with context_parallel(mesh, buffers=[ids], buffer_seq_dims=[1]) as outer:
        session = current_session()
        assert session is not None and session.attention is outer and outer.rotation is ROTATIONS["ring"]
        assert F.scaled_dot_product_attention is _cp_session._sdpa_or_recompute and _cp_session._HOOKS.holders == 1
        set_rotate_method("ulysses")  # for blocks entered later: this one keeps the rotation it was made with
        assert outer.rotation is ROTATIONS["ring"]
        with context_parallel(mesh, buffers=[labels], buffer_seq_dims=[1]) as inner:  # a nested block
            assert current_session() is not session and _cp_session._HOOKS.holders == 2
            assert inner.rotation is ROTATIONS["ulysses"] and labels.shape == (2, 6)
        assert current_session() is session and _cp_session._HOOKS.holders == 1
        assert F.scaled_dot_product_attention is _cp_session._sdpa_or_recompute  # the outer block still needs it
        assert labels.shape == (2, 12) and ids.shape == (2, 8)
    _no_state_left()
    assert torch.equal(ids, torch.arange(16).expand(2, 16))
    with pytest.raises(KeyError, match="inside"):
        with context_parallel(mesh, buffers=[ids], buffer_seq_dims=[1]):
            raise KeyError("inside")
    _no_state_left()
    assert torch.equal(ids, torch.arange(16).expand(2, 16))  # the whole value saved on entry, no collective
    set_rotate_method("allgather")


def test_a_block_leaves_no_context_parallel_state_behind_nested_or_failed() -> None:
    run_distributed(_blocks, 2, timeout=120)


def _window_now() -> Optional[int]:
    session = current_session()
    return session.layer.rule.window if session is not None else -1  # -1: no session


class _Probe(nn.Module):
    """Not an attention layer: notes the window it runs under."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[Optional[int]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(_window_now())
        return x


class _Layer(_Probe):
    """An attention layer as transformers marks one (`is_causal`), with a sliding window; `inner`
    runs in a session opened inside the layer."""

    is_causal = True

    def __init__(self, window: Optional[int], inner: Optional[nn.Module] = None) -> None:
        super().__init__()
        self.sliding_window, self.inner = window, inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = super().forward(x)
        if self.inner is not None:
            with CpSession(_one_rank_attention()):
                return self.inner(x)
        return x


def test_the_session_notes_the_window_of_the_layer_running_and_lets_go_of_it() -> None:
    _no_state_left()
    probe, full = _Probe(), _Layer(None)
    sliding = _Layer(3, nn.Sequential(nn.Identity(), probe))
    with CpSession(_one_rank_attention()) as attention:
        session = current_session()
        assert session is not None and session.attention is attention
        sliding(torch.zeros(1))
        full(torch.zeros(1))
        probe(torch.zeros(1))
        assert session.layers == []  # every layer left
    full(torch.zeros(1))  # outside every session
    # a session opened inside the sliding layer keeps its window; a full layer has none
    assert sliding.seen == [3] and probe.seen == [3, None] and full.seen == [None, -1]
    _no_state_left()


def test_a_session_is_entered_once_at_a_time() -> None:
    session = CpSession(_one_rank_attention())
    with session:
        with pytest.raises(RuntimeError, match="once at a time"):
            session.__enter__()
    _no_state_left()
    with session:  # and again after it closed
        assert current_session() is session
    _no_state_left()


def test_the_rotation_is_looked_up_once_by_name() -> None:
    assert isinstance(ROTATIONS["allgather"], AllGather) and isinstance(ROTATIONS["ulysses"], Ulysses)
    ring, alltoall = ROTATIONS["ring"], ROTATIONS["alltoall"]
    assert isinstance(ring, Ring) and ring.hop is point_to_point
    assert isinstance(alltoall, Ring) and alltoall.hop is all_to_all_hop
    cp = CpGroup(None, 2, 0, (0, 1))
    try:
        set_rotate_method("alltoall")
        made = _context_parallel.make_cp_attention(8, cp)
        assert made.rotation is alltoall and made.rotate == "alltoall"
        set_rotate_method("ulysses")
        assert made.rotation is alltoall  # a made attention keeps its rotation
        assert _context_parallel.make_cp_attention(8, cp).rotation is ROTATIONS["ulysses"]
        with pytest.raises(ValueError, match=r"set_rotate_method\('zigzag'\): the rotations are"):
            set_rotate_method("zigzag")
    finally:
        set_rotate_method("allgather")


def _rotation_name_comparisons(path: Path) -> list[str]:
    names = set(ROTATIONS)
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Compare):
            continue
        for side in [node.left, *node.comparators]:
            values: list[Any] = [side] + (list(side.elts) if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [])
            if any(isinstance(v, ast.Constant) and v.value in names for v in values):
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_context_parallel_module_compares_rotation_names() -> None:
    files = [PARALLEL / "_context_parallel.py", *sorted(PARALLEL.glob("_cp_*.py"))]
    assert len(files) > 5
    assert [f for path in files for f in _rotation_name_comparisons(path)] == []
