"""torch.optim on DTensor parameters, against the same optimizer on plain tensors.

AdamW / Adam / SGD with momentum, in their three implementations (single-tensor `for`
loop, `foreach=True`, `fused=True`), step DTensor parameters sharded on dim 0, on dim 1 and
replicated, over meshes (4,) and (2, 2), with uneven shapes. Their state tensors come from
`torch.zeros_like(p)` on DTensors; the step counters stay plain 0-dim tensors. Strict mode
is on: every op of the step must have a strategy (no replicated fallback). With gradients in
their parameters' layouts the step runs on the local pieces as plain tensors (no DTensor op,
state made in the parameters' layouts); in other layouts, through DTensor dispatch. A step
that raises is undone before the next step and before `state_dict()`. The swap is kept from
step to step, and what a user changes between steps (a state tensor, a group, a piece, a
state_dict round trip) reaches the next step.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import shardwise as sw
from shardwise import Partial, Replicate, Shard
from shardwise.testing import distributed

from ..dist_helpers import make_dtensor


OPTIMIZERS: list[tuple[str, type, dict[str, Any]]] = [
    ("adamw", torch.optim.AdamW, dict(lr=0.01, weight_decay=0.1)),
    ("adamw_foreach", torch.optim.AdamW, dict(lr=0.01, weight_decay=0.1, foreach=True)),
    ("adamw_for_loop", torch.optim.AdamW, dict(lr=0.01, weight_decay=0.1, foreach=False)),
    ("adamw_fused", torch.optim.AdamW, dict(lr=0.01, weight_decay=0.1, fused=True)),
    ("adam_amsgrad_foreach", torch.optim.Adam, dict(lr=0.01, amsgrad=True, foreach=True)),
    ("sgd_momentum", torch.optim.SGD, dict(lr=0.05, momentum=0.9)),
    ("sgd_momentum_foreach", torch.optim.SGD, dict(lr=0.05, momentum=0.9, foreach=True)),
    ("sgd_nesterov_foreach", torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01, foreach=True)),
    ("sgd_momentum_fused", torch.optim.SGD, dict(lr=0.05, momentum=0.9, fused=True)),
]


def _params(mesh_shape: tuple[int, ...]) -> list[tuple[tuple[int, ...], list[Any]]]:
    n = len(mesh_shape)
    rest = [Replicate()] * (n - 1)
    return [
        ((10, 6), [Shard(0)] * n),  # 10 rows over 4 ranks: uneven
        ((7, 5), [Shard(1)] + rest),
        ((3,), [Replicate()] * n),
        ((2, 9), [Shard(1), Shard(0)] if n == 2 else [Shard(1)]),  # a dim smaller than the mesh
    ]


class _DTensorOps(TorchDispatchMode):
    """Counts the aten calls with a DTensor argument (and hands them on to DTensor dispatch)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if any(isinstance(t, sw.DTensor) for t in pytree.tree_leaves((args, kwargs))):
            self.count += 1
            return NotImplemented
        return func(*args, **kwargs)


def _loss(ps: list[torch.Tensor], ts: list[torch.Tensor]) -> torch.Tensor:
    return sum(((p * t).sum() + 0.25 * (p * p * p).sum()) for p, t in zip(ps, ts))  # type: ignore[return-value]


def _run(mesh: sw.DeviceMesh, cls: type, kw: dict[str, Any], grad_layouts: Any = None) -> None:
    spec = _params(tuple(mesh.shape))
    g = torch.Generator().manual_seed(0)
    fulls = [torch.randn(*s, generator=g) for s, _ in spec]
    targets = [torch.randn(*s, generator=g) for s, _ in spec]
    ref = [f.clone().requires_grad_() for f in fulls]
    params = [sw.distribute_tensor(f.clone(), mesh, pl).requires_grad_() for f, (_, pl) in zip(fulls, spec)]
    dtargets = [sw.distribute_tensor(t, mesh, pl) for t, (_, pl) in zip(targets, spec)]
    opt_ref, opt = cls(ref, **kw), cls(params, **kw)
    for step in range(5):
        opt_ref.zero_grad()
        _loss(ref, targets).backward()
        opt.zero_grad(set_to_none=step % 2 == 0)
        if grad_layouts is None:
            _loss(params, dtargets).backward()
            for p, r in zip(params, ref):  # backward, too, matches single-device
                assert p.grad is not None and p.grad.placements == p.placements
                torch.testing.assert_close(p.grad.full_tensor(), r.grad, atol=1e-5, rtol=1e-5)
        else:  # gradients arriving in other layouts than their parameters
            for p, r, lay in zip(params, ref, grad_layouts):
                p.grad = make_dtensor(r.grad, mesh, lay)  # type: ignore[arg-type]
        opt_ref.step()
        with sw.comm_log() as log, _DTensorOps() as seen:
            opt.step()
        if grad_layouts is None:
            assert len(log) == 0, f"{cls.__name__}{kw}: the step communicated: {[c.op for c in log]}"
            # elementwise optimizers step the local pieces as plain tensors (`_local_step`)
            assert seen.count == 0, f"{cls.__name__}{kw}: {seen.count} DTensor ops in the step"
            for p in params:  # the state the local step made is in the parameter's layout
                for k, v in opt.state[p].items():
                    assert (v.placements == p.placements if v.dim() else not isinstance(v, sw.DTensor)), (k, v)
        for p, r, (_, placements) in zip(params, ref, spec):
            assert p.placements == tuple(placements)
            # fused kernels vectorize over the local piece: rounding may differ in the last bit
            torch.testing.assert_close(p.full_tensor(), r.detach(), atol=1e-6, rtol=1e-6,
                                       msg=lambda m: f"{cls.__name__}{kw} step {step}: {m}")


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)])
@distributed(world_size=4)
def test_optimizers_step_dtensor_parameters_like_single_device(mesh_shape: tuple[int, ...]) -> None:
    mesh = sw.init_device_mesh("cpu", mesh_shape)
    sw.set_strict(True)
    try:
        for _, cls, kw in OPTIMIZERS:
            _run(mesh, cls, kw)
    finally:
        sw.set_strict(False)


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)])
@distributed(world_size=4)
def test_optimizers_accept_gradients_in_other_layouts(mesh_shape: tuple[int, ...]) -> None:
    mesh = sw.init_device_mesh("cpu", mesh_shape)
    n = len(mesh_shape)
    grad_layouts = [[Replicate()] * n, [Partial()] * n, [Shard(0)] * n, [Partial()] + [Shard(0)] * (n - 1)]
    sw.set_strict(True)
    try:
        for name, cls, kw in OPTIMIZERS:
            if name in ("adamw", "adamw_foreach", "adamw_fused", "sgd_momentum_foreach", "sgd_momentum_fused"):
                _run(mesh, cls, kw, grad_layouts)
    finally:
        sw.set_strict(False)


@distributed(world_size=2)
def test_a_step_that_raises_is_undone_before_the_next_step_and_before_state_dict() -> None:
    mesh = sw.init_device_mesh("cpu", (2,))
    full = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
    ref = full.clone().requires_grad_()
    p = sw.distribute_tensor(full.clone(), mesh, [Shard(0)]).requires_grad_()
    opt, opt_ref = torch.optim.AdamW([p], lr=0.1, foreach=True), torch.optim.AdamW([ref], lr=0.1, foreach=True)

    def boom(*_: Any) -> None:
        raise RuntimeError("a user's pre-hook failed")

    for step in range(3):
        for q, o in ((p, opt), (ref, opt_ref)):
            o.zero_grad()
            (q * q).sum().backward()
        handle = opt.register_step_pre_hook(boom) if step == 1 else None  # (runs after the swap)
        if handle is not None:
            with pytest.raises(RuntimeError, match="pre-hook failed"):
                opt.step()
            handle.remove()
            saved = opt.state_dict()  # the swap is undone first: the state is the parameter's
            assert opt.param_groups[0]["params"][0] is p and list(opt.state) == [p]
            assert isinstance(saved["state"][0]["exp_avg"], sw.DTensor)
        opt.step()
        opt_ref.step()
        torch.testing.assert_close(p.full_tensor(), ref.detach())


@distributed(world_size=2)
def test_load_state_dict_frees_the_state_it_replaces_at_once() -> None:
    """The kept swap holds the state's pieces between steps; loading a checkpoint must not keep
    the replaced state alive until the next step (a second copy of every moment)."""
    import gc
    import weakref

    mesh = sw.init_device_mesh("cpu", (2,))
    p = sw.distribute_tensor(torch.randn(6, 4, generator=torch.Generator().manual_seed(0)), mesh,
                             [Shard(0)]).requires_grad_()
    opt = torch.optim.AdamW([p], lr=0.1, foreach=True)
    for _ in range(2):
        (p * p).sum().backward()
        opt.step()
        opt.zero_grad()
    saved = opt.state_dict()
    saved["state"] = {k: {n: v.clone() for n, v in s.items()} for k, s in saved["state"].items()}
    old = weakref.ref(opt.state[p]["exp_avg"]._local_tensor)  # type: ignore[attr-defined]
    opt.load_state_dict(saved)
    gc.collect()
    assert old() is None, "the replaced state is still held"
    (p * p).sum().backward()
    opt.step()  # and the next step builds the swap afresh, from the loaded state
    assert opt.state[p]["exp_avg"] is not None and int(opt.state[p]["step"]) == 3


@pytest.mark.parametrize("kind", ["foreach", "fused", "for_loop"])
@distributed(world_size=2)
def test_the_kept_swap_sees_what_changed_between_steps(kind: str) -> None:
    """The local step's swap is kept from step to step (`_local_step._Cache`): a plain parameter
    beside the DTensors, a state tensor replaced, a group added, a parameter's whole state
    replaced, a state_dict round trip and a parameter's piece replaced between steps each reach
    the next step as they would plain."""
    mesh = sw.init_device_mesh("cpu", (2,))
    flags = {"foreach": dict(foreach=True), "fused": dict(fused=True), "for_loop": dict(foreach=False)}[kind]
    g = torch.Generator().manual_seed(0)
    fulls = [torch.randn(6, 4, generator=g), torch.randn(5, generator=g), torch.randn(3, 2, generator=g)]
    ref = [f.clone().requires_grad_() for f in fulls]
    params = [sw.distribute_tensor(fulls[0].clone(), mesh, [Shard(0)]).requires_grad_(),
              fulls[1].clone().requires_grad_(),  # a plain parameter in the same group
              sw.distribute_tensor(fulls[2].clone(), mesh, [Shard(1)]).requires_grad_()]
    extra_full = torch.randn(4, 4, generator=g)
    extra_ref = extra_full.clone().requires_grad_()
    extra = sw.distribute_tensor(extra_full.clone(), mesh, [Shard(1)]).requires_grad_()
    opt, opt_ref = torch.optim.AdamW(params, lr=0.1, **flags), torch.optim.AdamW(ref, lr=0.1, **flags)
    for step in range(8):
        for qs, o in ((params + ([extra] if step >= 3 else []), opt), (ref + ([extra_ref] if step >= 3 else []), opt_ref)):
            o.zero_grad()
            sum(((q * q * q).sum() for q in qs)).backward()  # type: ignore[union-attr]
        if step == 2:  # a state tensor replaced (a user resetting a moment)
            for q, r in ((params[0], ref[0]), (params[1], ref[1])):
                opt.state[q]["exp_avg"] = torch.zeros_like(q)
                opt_ref.state[r]["exp_avg"] = torch.zeros_like(r)
        if step == 3:
            opt.add_param_group({"params": [extra], "lr": 0.05})
            opt_ref.add_param_group({"params": [extra_ref], "lr": 0.05})
        if step == 5:  # a parameter's whole state replaced: it starts afresh
            for o, q in ((opt, params[2]), (opt_ref, ref[2]), (opt, params[1]), (opt_ref, ref[1])):
                o.state[q] = {}
        if step == 6:  # a checkpoint round trip
            opt.load_state_dict(opt.state_dict())
        if step == 7:  # a parameter given a new piece (its values copied)
            with torch.no_grad():
                params[0]._local_tensor = params[0]._local_tensor.clone()  # type: ignore[attr-defined]
        opt.step()
        opt_ref.step()
        for q, r in zip(params + [extra], ref + [extra_ref]):
            whole = q.full_tensor() if isinstance(q, sw.DTensor) else q
            torch.testing.assert_close(whole, r.detach(), msg=lambda m: f"step {step}: {m}")
        assert all(isinstance(v, sw.DTensor) for q in (params[0], params[2]) for v in opt.state[q].values() if v.dim())
        assert set(opt.state) == set(params + ([extra] if step >= 3 else [])), "the state is keyed by the parameters"


@distributed(world_size=4)
def test_an_op_over_dtensors_on_two_meshes_names_both_and_the_fix() -> None:
    # the per-parameter norms of a tp x dp model (matrices on (dp, tp), norms' weights on dp) run per mesh,
    # but stacking them (what torch's clip_grad_norm_ does next) met two meshes: an IndexError deep in the
    # stack strategy before
    mesh = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    a = sw.distribute_tensor(torch.ones(4, 4), mesh, [Shard(0), Shard(1)])
    b = sw.distribute_tensor(torch.ones(4), mesh["dp"], [Shard(0)])
    norms = torch._foreach_norm([a, b])  # per mesh: fine
    assert [n.device_mesh for n in norms] == [mesh, mesh["dp"]]
    with pytest.raises(ValueError, match=r"aten\.stack\.default got DTensors on 2 meshes, DeviceMesh.*\('dp', 'tp'\)"
                                         r".* and DeviceMesh.*\('dp',\).*redistribute\(device_mesh=\.\.\.\)"):
        torch.stack(norms)
    whole = torch.stack([n.full_tensor() for n in norms])  # the fix the message names
    assert torch.allclose(whole, torch.tensor([4.0, 2.0]))
