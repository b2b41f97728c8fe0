"""`dry_run`: one step of a sharded program for a mesh of any size, on one process, with no data.

The model is sharded as usual but on an `AbstractMesh` (plans, styles and `data_parallel`
take one and shard meta parameters over a `DryMesh`, see `_mesh._dry`); `dry_run(fn, *args,
mesh=...)` then calls `fn` as one rank of that mesh. Every op runs its real strategy and
every redistribute its real plan; tensors are meta (shapes, no data) and the door answers
each collective with an empty result of the right shape. What the run sees:

- every collective the rank issues: kind, mesh dims, group size, bytes received, the op
  that caused it (the aten op being dispatched; "-" outside one: an explicit redistribute,
  a gradient hook) and the module path and pass (forward / backward) it fell in;
- the memory the rank holds op by op (`_memory`): every tensor storage made is followed
  from the op that made it to the moment it dies, so the peak is that of the program as
  PyTorch would run it, saved activations included; each storage is counted once, in the
  category it ends in: parameters (the pieces of the modules' parameters), gradients
  (their `.grad`), optimizer state (every tensor in the optimizers' `state`), unsharded
  (the parameters a `fully_shard` unit holds gathered, and its gathers in flight: counted
  from the gather to the free, listed per unit; only for programs with units), activations
  (everything else);
- per experts module that dispatches tokens (`ExpertParallel(tokens="split")`), its
  all_to_all bytes per pass and this rank's expert memory (`_moe`), for the routing given
  as `routing=` (uniform when not given: meta tensors carry no router output).

Modules and optimizers are found among `fn`'s arguments (also inside lists, tuples and
dicts); tensors among them that are not DTensors are moved to the meta device first.
"""

from __future__ import annotations

import contextvars
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Optional

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from .._comm import SIMULATION, CommRecord, Simulation
from .._mesh import AbstractMesh, collective_timeout
from .._mesh import PER_RANK_CACHES, DryMesh, _caches_for, as_device_mesh, simulated_rank, simulating
from .._moe_routing import Routing, routing_in_dry_run
from .._tensor import DTENSOR_CLASSES
from ..pipeline import PipelineError
from ..fsdp._state import snapshot
from ._counter import CommCounter
from ._memory import MemoryTracker
from ._moe import dispatching_experts, moe_section
from ._report import DryCollective, DryRunReport, RankReport

__all__ = ["dry_run"]


def dry_run(fn: Callable[..., Any], *args: Any, mesh: AbstractMesh, ranks: Optional[Sequence[int]] = None,
            routing: Any = None, **kwargs: Any) -> DryRunReport:
    """Run `fn(*args, **kwargs)` as rank(s) `ranks` (default: rank 0) of the abstract `mesh`
    with meta tensors, and report what each rank would send and hold (see the module docstring).

    The model must be sharded on the same abstract mesh (`parallelize_module(model, mesh,
    plan)`, `data_parallel(model, mesh, ...)` with an `AbstractMesh`), its parameters on the
    meta device (`with torch.device("meta"): model = Model(config)`). With several `ranks`,
    each starts from the state the first found (the parameters' `.grad` and the optimizers'
    state are put back between ranks), so every rank runs the same step.

    Each simulated rank runs in a thread of its own, one at a time; they take turns where one
    waits for a point-to-point message from another (pipeline stages), so `fn` may build and
    step a `DistributedPipe` on the abstract mesh: then give the ranks of every stage, and
    let `fn` build the model (each rank keeps only its stages) and return the pipe and its
    optimizer, for the memory split.

    `routing` says how the routers of experts modules under `ExpertParallel(tokens="split")`
    spread their routes, since meta tensors carry no router output: "uniform" (the default),
    a share per expert, or a function `(ep_rank, tokens, top_k, num_experts) -> routes per
    expert` (`shardwise._moe_routing`). Dropless dispatch sizes its all_to_alls from it, so
    the bytes reported are those a real run routed that way sends; each rank's report then
    has a MoE section (`RankReport.moe`): per experts module, the all_to_all bytes per pass
    and the rank's expert parameters, gradients and optimizer state.
    """
    if not callable(fn):
        raise TypeError(f"dry_run runs a callable (one training step), got {type(fn).__name__}")
    dry = _dry_mesh(mesh)
    if ranks is None:
        ranks = [0]
    ranks = list(ranks)
    bad = [r for r in ranks if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < dry.size()]
    if bad or not ranks or len(set(ranks)) != len(ranks):
        raise ValueError(f"dry_run(ranks={ranks!r}): give ranks of the mesh {dry.shape}, ints in [0, {dry.size() - 1}], each once")
    _check_meshes(args, kwargs, dry)
    start = time.perf_counter()
    found = list(_walk((args, kwargs)))
    saved = _State(found)
    reports: dict[int, RankReport] = {}
    errors: dict[int, BaseException] = {}
    sim = Simulation(ranks, _caches_for)
    for clear in PER_RANK_CACHES:  # every dry run starts as a process's first step: ops plan (and check) afresh
        clear()
    given = Routing.default() if routing is None else Routing.of(routing)
    _check_routing(given, found)
    with routing_in_dry_run(given):  # the caller's door hooks (a comm_log around the dry run) hold inside too
        parent = contextvars.copy_context()

    def play(number: int, rank: int) -> None:
        sim.wait_turn(rank)
        try:
            if number:
                saved.restore()
            reports[rank] = _one_rank(fn, args, kwargs, found, dry, rank, given)
        except BaseException as exc:
            errors[rank] = exc
        finally:
            sim.end(rank)

    threads = [threading.Thread(target=parent.copy().run, args=(play, n, r), name=f"dry rank {r}", daemon=True)
               for n, r in enumerate(ranks)]
    SIMULATION[0] = sim
    try:
        for t in threads:
            t.start()
        sim.begin()
        deadline = time.monotonic() + collective_timeout().total_seconds()
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        stuck = [r for t, r in zip(threads, ranks) if t.is_alive()]
        if stuck:  # fn blocked on something a dry run cannot answer (a real process group, a lock)
            raise RuntimeError(f"dry run: simulated ranks {stuck} did not finish within SHARDWISE_COLLECTIVE_TIMEOUT "
                               f"({collective_timeout().total_seconds():.0f} s); fn may wait on a real process group "
                               f"or another thread, which a dry run cannot answer")
    finally:
        SIMULATION[0] = None
        _caches_for(simulated_rank())
    _relocalize(found)  # the pieces back to the sizes of the rank played outside the dry run
    if errors:  # the rank where it began (others stop with PipelineError when a stage fails)
        failed = [r for r in ranks if r in errors]
        rank = next((r for r in failed if not isinstance(errors[r], PipelineError)), failed[0])
        exc = errors[rank]
        if hasattr(exc, "add_note") and len(ranks) > 1:
            exc.add_note(f"(dry run: raised on simulated rank {rank}; simulated ranks {failed} failed)")
        raise exc
    return DryRunReport(dry.shape, dry.mesh_dim_names, [reports[r] for r in ranks], time.perf_counter() - start)


def _check_routing(routing: Routing, found: list[Any]) -> None:
    """Shares for as many experts as the dispatching experts modules among the arguments have."""
    if routing.kind != "shares":
        return
    wrong = sorted({(path, int(getattr(m, "num_experts"))) for path, m in
                    dispatching_experts([x for x in found if isinstance(x, nn.Module)])
                    if getattr(m, "num_experts") != len(routing.shares)})
    if wrong:
        path, n = wrong[0]
        raise ValueError(f"dry_run(routing=...) gives {len(routing.shares)} shares, but {path or '(model)'} routes over "
                         f"{n} experts: give one share per expert")


def _dry_mesh(mesh: Any) -> DryMesh:
    found = as_device_mesh(mesh)
    if not isinstance(found, DryMesh):
        raise TypeError(f"dry_run(mesh=...) takes an AbstractMesh (shape and dim names, no processes), got {mesh!r}: "
                        f"e.g. shardwise.AbstractMesh((8, 8), ('dp', 'tp')), the mesh the model was sharded on")
    return found


def _walk(value: Any, seen: Optional[set[int]] = None) -> Iterator[Any]:
    """Every module, optimizer and tensor in `value` (through lists, tuples and dicts)."""
    seen = set() if seen is None else seen
    if id(value) in seen:
        return
    seen.add(id(value))
    if isinstance(value, (nn.Module, torch.optim.Optimizer, torch.Tensor)):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _walk(v, seen)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _walk(v, seen)


def _dtensors(found: list[Any]) -> Iterator[Any]:
    for item in found:
        if isinstance(item, nn.Module):
            yield from (t for t in item.parameters() if type(t) in DTENSOR_CLASSES or isinstance(t, nn.Parameter))
            yield from item.buffers()
            yield from (p.grad for p in item.parameters() if p.grad is not None)
        elif isinstance(item, torch.optim.Optimizer):
            for state in item.state.values():
                yield from (v for v in state.values() if isinstance(v, torch.Tensor))
        else:
            yield item


def _check_meshes(args: tuple[Any, ...], kwargs: dict[str, Any], dry: DryMesh) -> None:
    """Refuse DTensors on a mesh with processes, or on another dry mesh: a dry run sends nothing."""
    problems = []
    for t in _dtensors(list(_walk((args, kwargs)))):
        if type(t) in DTENSOR_CLASSES:
            mesh = t._spec.mesh
            if not isinstance(mesh, DryMesh):
                problems.append(f"a DTensor of shape {tuple(t.shape)} lives on {mesh!r}, which has processes")
            elif mesh._root != dry._root:
                problems.append(f"a DTensor of shape {tuple(t.shape)} lives on {mesh!r}, not on {dry!r}")
    if problems:
        raise ValueError("dry_run: " + "; ".join(problems[:3]) + (f" (and {len(problems) - 3} more)" if len(problems) > 3 else "")
                         + ": shard the model on the AbstractMesh given as mesh= (e.g. parallelize_module(model, "
                         "AbstractMesh(shape, names), plan)), with its parameters on the meta device")


def _to_meta(value: Any, memo: Optional[dict[int, torch.Tensor]] = None) -> Any:
    """Plain tensors of the arguments as meta tensors of this simulated rank's own (DTensors,
    modules and optimizers kept): a rank may change its tensors in place (`context_parallel`
    cuts its buffers) while another rank, waiting for a message, still holds them whole. A
    tensor passed twice is one tensor."""
    memo = {} if memo is None else memo
    if isinstance(value, torch.Tensor):
        if type(value) in DTENSOR_CLASSES:
            return value
        if id(value) not in memo:
            memo[id(value)] = torch.empty_like(value, device="meta").requires_grad_(value.requires_grad)
        return memo[id(value)]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_to_meta(v, memo) for v in value)
    if isinstance(value, list):
        return [_to_meta(v, memo) for v in value]
    if isinstance(value, dict):
        return {k: _to_meta(v, memo) for k, v in value.items()}
    return value


def _relocalize(found: list[Any]) -> None:
    """Give every DTensor on a dry mesh the piece the simulated rank holds (a meta tensor of
    that rank's shape): pieces made while another rank was simulated differ where uneven."""
    for t in _dtensors(found):
        if type(t) not in DTENSOR_CLASSES or not isinstance(t._spec.mesh, DryMesh):
            continue
        spec, local = t._spec, t._local_tensor
        coordinate = spec.mesh.get_coordinate()
        shape = spec.local_shape_and_offset(coordinate)[0]
        if tuple(local.shape) != shape:
            t._local_tensor = torch.empty(shape, dtype=local.dtype, device="meta")


class _State:
    """The parameters' gradients and the optimizers' state as a dry run found them, to put back
    before the next simulated rank runs the step again (meta tensors: only shapes to keep)."""

    def __init__(self, found: list[Any]) -> None:
        self.grads = [(p, p.grad) for m in found if isinstance(m, nn.Module) for p in m.parameters()]
        self.states = [(o, {p: {k: v.clone() if isinstance(v, torch.Tensor) and not v.is_meta else v
                                for k, v in st.items()} for p, st in o.state.items()})
                       for o in found if isinstance(o, torch.optim.Optimizer)]
        self.units = snapshot([m for m in found if isinstance(m, nn.Module)])  # fully_shard's learnt order

    def restore(self) -> None:
        self.units()
        for p, g in self.grads:
            p.grad = g
        for o, state in self.states:
            o.state.clear()
            o.state.update({p: dict(st) for p, st in state.items()})


def _one_rank(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], found: list[Any], dry: DryMesh,
              rank: int, routing: Routing) -> RankReport:
    modules = [m for m in found if isinstance(m, nn.Module)]
    optimizers = [o for o in found if isinstance(o, torch.optim.Optimizer)]
    memo: dict[int, torch.Tensor] = {}
    args, kwargs = _to_meta(args, memo), _to_meta(kwargs, memo)
    with simulating(rank):
        _relocalize(found)
        counter = _Recorder(modules[0] if len(modules) == 1 else None)
        memory = MemoryTracker(counter)
        counter.memory = memory
        params = {id(p) for m in modules for p in m.parameters()}
        for t in _dtensors(found):
            memory.track(t, pinned=id(t) in params)
        with counter, memory, _AsOnCpu():
            returned = fn(*args, **kwargs)
        memory.close()
        more = [x for x in _walk(returned) if isinstance(x, (nn.Module, torch.optim.Optimizer)) and
                all(x is not y for y in found)]  # what fn built and returned (a pipe, its optimizer)
        modules += [m for m in more if isinstance(m, nn.Module)]
        optimizers += [o for o in more if isinstance(o, torch.optim.Optimizer)]
        collectives = counter.collectives(dry)
        moe = moe_section(modules, optimizers, [(c.kind, c.module, c.pass_, c.bytes) for c in collectives],
                          routing.describe())
        return RankReport(rank, tuple(dry.get_coordinate() or ()), collectives, memory.report(modules, optimizers),
                          sorted(memory.uneven, key=str), dict(memory.flops), moe)


class _Recorder(CommCounter):
    """A CommCounter that also keeps every record with the op that caused it."""

    def __init__(self, model: Optional[nn.Module]) -> None:
        super().__init__(model)
        self.records: list[tuple[CommRecord, str, str, str]] = []
        self.memory: Optional[MemoryTracker] = None

    def _file(self, record: CommRecord) -> None:
        super()._file(record)
        backward = torch._C._current_graph_task_id() != -1
        op = self.memory.op if self.memory is not None and self.memory.op is not None else "-"
        self.records.append((record, op, self.module_path(backward), "backward" if backward else "forward"))

    def module_path(self, backward: Optional[bool] = None) -> str:
        if backward is None:
            backward = torch._C._current_graph_task_id() != -1
        stack = self._forward if self._forward else (self._backward if backward else [])
        return stack[-1] if stack else ""

    def collectives(self, dry: DryMesh) -> list[DryCollective]:
        names = dry.mesh_dim_names
        out = []
        for record, op, path, which in self.records:
            # (a group of its own grid, as reshard_after_forward=int makes, has no dim of this mesh)
            dims = tuple(names[d] if names and d < len(names) else str(d) for d in record.mesh_dims)
            out.append(DryCollective(record.op, dims, record.group_size, record.bytes_received, op, path, which))
        return out

_SDPA = torch._C._nn.scaled_dot_product_attention
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
_FLASH_CPU = 1  # torch's SDPBackend.flash_attention


class _AsOnCpu(TorchFunctionMode):
    """Attention picks its kernel by device: on meta tensors torch takes the unfused math path,
    whose ops would shard (and communicate) otherwise than a CPU rank's fused kernel. Here
    the kernel is the one a CPU rank would pick, asked of CPU stand-ins of one row each with
    the same dtypes and head sizes (what the choice depends on)."""

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        if func is _SDPA:
            bound = dict(zip(_SDPA_ARGS, args), **kwargs)
            q = bound.get("query")
            if isinstance(q, torch.Tensor) and q.is_meta:  # (the CPU kernel takes fewer kv heads itself: GQA)
                choice = torch.ops.aten._fused_sdp_choice.default(
                    *[_stand_in(a) for a in args], **{k: _stand_in(v) for k, v in kwargs.items()})
                if choice == _FLASH_CPU:
                    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(
                        bound["query"], bound["key"], bound["value"], bound.get("dropout_p", 0.0),
                        bound.get("is_causal", False), attn_mask=bound.get("attn_mask"), scale=bound.get("scale"))[0]
        return func(*args, **kwargs)


def _stand_in(t: Any) -> Any:
    if not isinstance(t, torch.Tensor):
        return t
    return torch.empty((1,) * (t.ndim - 1) + (t.shape[-1],), dtype=t.dtype, device="cpu")
