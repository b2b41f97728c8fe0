"""`DistributedPipe`: an `nn.Sequential` cut into stages on the ranks of a mesh's `pp` dim,
trained with GPipe, 1F1B or interleaved 1F1B, skips sent straight from stash to pop.

Every rank builds the same `DistributedPipe(module, balance, mesh, ...)`; each keeps only
the partitions its schedule gives it (`schedule.rank_stages`), and `step(input, target)`
runs that rank's actions in the schedule's `rank_order`: a forward receives its input
(and the skips it pops) from the ranks that made them, runs, and posts its output (and
the skips it stashes) without waiting; a backward receives the output's gradient (and
its skips' gradients) and posts the input's gradient back. Because sends never block,
following `rank_order` cannot deadlock (see `_schedule`).

Loss rule: the last stage computes `loss_fn(output_i, target_i)` per micro-batch, which
should be a mean over the micro-batch's rows, and weights it by the micro-batch's share
of the rows, `n_i / N` (from the target's micro-batches; `1 / m` without a target). The
step's loss, `sum_i n_i / N * loss_i`, is then the mean over the whole batch, equal micro-
batches or not, and the gradients are that loss's gradients. `step` returns it on the
rank holding the last stage and `None` elsewhere. Only the first stage's rank reads
`input`, only the last stage's rank reads `target` (other ranks may pass `None`).

With a `dp` mesh dim, each data-parallel replica runs its own pipeline on its own batch
(as under DDP, each rank passes its replica's share), and after the step each rank
averages its parameters' gradients over its dp group, bucketed, one `all_reduce` per
bucket; a parameter that no replica gave a gradient keeps `grad=None`.

With a `tp` mesh dim and a `tp_plan`, each stage is tensor-parallel over the ranks that
share its pp and dp index (see `_tensor_parallel`): activations that are DTensors travel as
each rank's piece to the rank of the next stage with the same tp index, and the dp
average takes each parameter's piece.

Stages of different widths: `mesh` may instead be a list of one DeviceMesh per pp index,
each (tp,) or (dp, tp) over its own ranks (see `_topology`). Where consecutive stages'
tp rows have the same size, messages go partner to partner as above; where they differ,
they cross by the cross-mesh planner (see `_crossing`): each receiving rank gets exactly
its piece of the landing layout, from the senders the plan deals it to.

Shared parameters: stages on different pp ranks may use one parameter (embeddings tied to
the LM head). Each of those ranks keeps its own copy; after the step they sum their
gradients (one all_reduce per set of ranks, in a group of just those ranks), so every
copy gets the whole gradient and steps alike, as the one parameter would. Copies on stages
of different widths are split differently, so their holders swap gradients across meshes
instead and each sums every holder's term in pp order (ZeRO-3 copies must be of one width).

Failures: a stage that raises tells every stage waiting on it (see `_wire`), which tell
theirs, and all stop; at the end of every step the pp ranks compare outcomes (one small
all_gather), so a rank that had finished its part still fails when another did. The
failing rank re-raises its own exception; the others raise `PipelineError` naming their
stage, rank, micro-batch, what they waited for and where the failure began. A dead
process is noticed when its connection closes or after `SHARDWISE_COLLECTIVE_TIMEOUT`.
After a failure the pipe refuses further steps (its channels may hold stale messages).

Point-to-point messages use a process group of their own per pp slice, created by every
process like a mesh's groups; `close()` releases it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import nullcontext
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .. import _comm as comm
from .._describe import describe
from .._groups import POINT_TO_POINT
from .._mesh import DeviceMesh, collective_timeout
from .._mesh_dry import DryGroup, DryMesh, as_device_mesh
from .._source_names import carry_source
from .._tensor import DTensor
from .._tensor._compile_comm import current_trace
from ..parallel._context_parallel import Attention, cp_group, make_cp_attention
from ..parallel._cp_attention import CpAttention
from ..parallel._data_parallel import data_parallel
from ._arguments import check_arguments, check_staged
from ._gradients import (check_shared, reduce_gradients, shared_across_ranks, shared_groups, sum_cp_gradients,
                         sum_shared_gradients, whole_loss)
from ._microbatch import Batch, BatchValue, gather
from ._replay import ReplayedStep, traced_step
from ._schedule import Action, Schedule, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from ._pipe import as_given_by_torchgpipe
from ._stage import PipelineStage, split_module
from ._step import StepRun
from ._tensor_parallel import check_tp_plan, shard_stage
from ._topology import stage_topology, uniform_topology
from ._wire import ChannelPlan, PipelineError, RemoteFailure, Wire
from .skip._routes import inspect_skip_layout

__all__ = ["DistributedPipe", "PipelineError"]

LossFn = Callable[..., Tensor]


class DistributedPipe(nn.Module):
    """`module` as a pipeline over `mesh`'s `pp_dim` (see the module docstring).

    Args:
        module: the layers, in order (`@skippable` layers may stash and pop across stages).
        balance: layers per stage; `len(balance)` stages, the pp size of them for `"gpipe"`
            and `"1f1b"`, a multiple of it for `"interleaved"` (stage `s` on pp rank `s % pp`).
        mesh: a `DeviceMesh` with dim `pp_dim`, and optionally data- and tensor-parallel dims;
            or a list of one DeviceMesh per pp index, each `("tp",)` or `("dp", "tp")` over
            its own ranks, the tp sizes free (a 4-wide stage may feed a 2-wide one).
        dp_dim: the data-parallel mesh dim (default: `"dp"` when the mesh has one).
        tp_dim: the tensor-parallel mesh dim (default: `"tp"` when the mesh has one).
        cp_dim: the context-parallel mesh dim (default: `"cp"` when the mesh has one). Every
            cp rank passes the whole sequences (the first stage's input, the last stage's
            target); each runs the pipeline on its piece of every sequence (split as
            `context_parallel` splits it), attention sees the whole sequence, the loss
            returned is the whole batch's and the gradients are summed over cp. A loss
            function is taken as a mean over the target's counted tokens (-100 ignored); one
            that `shifts_labels` (`hf_loss`) gets labels shifted over the whole sequence.
        shard_parameters: ZeRO-3 over dp: each stage's parameters (and gradients and optimizer
            state) split over the dp dim as `data_parallel(shard_parameters=True)` does,
            gathered for compute, their gradients reduce-scattered in each backward (as FSDP);
            the gradients of parameters that stay replicated on dp are averaged once per step.
        tp_plan: module patterns of the whole model -> ParallelStyles (as `parallelize_module`
            takes): each stage shards the layers it holds over its tp sub-mesh, and DTensor
            activations cross to the next stage piece by piece (see `_tensor_parallel`).
        schedule: `"gpipe"` (fill-drain), `"1f1b"` or `"interleaved"` (1F1B with
            `virtual_stages` stages per rank; `chunks` must be a multiple of the pp size).
        chunks: micro-batches per step (`Tensor.chunk` along dim 0; each must be non-empty).
        checkpoint: `"always"`, `"except_last"` (every micro-batch but the last) or `"never"`.
        loss_fn: `loss_fn(output, target)` (or `loss_fn(output)`), a mean over the micro-batch.
        device: where this rank's stages live (default: cpu, or the current CUDA device).
        bucket_cap_mb: size of the gradient buckets averaged over dp.

    `parameters()` and `partitions` hold this rank's stages only (`partitions["2"]` is stage
    2), so an optimizer built on `pipe.parameters()` steps what this rank trains. On two
    processes (``torchrun --nproc-per-node=2 train.py``)::

        mesh = shardwise.init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
        pipe = DistributedPipe(model, [4, 4], mesh, schedule="1f1b", chunks=4, loss_fn=F.mse_loss)
        optimizer = torch.optim.AdamW(pipe.parameters())
        for x, y in batches:
            optimizer.zero_grad()
            loss = pipe.step(x, y)  # the batch's mean loss on rank 1 (last stage), None on rank 0
            optimizer.step()
        pipe.close()
    """

    partitions: nn.ModuleDict

    def __init__(self, module: nn.Sequential, balance: Sequence[int], mesh: DeviceMesh | Sequence[DeviceMesh], *,
                 pp_dim: str = "pp",
                 dp_dim: Optional[str] = None, tp_dim: Optional[str] = None, cp_dim: Optional[str] = None,
                 tp_plan: Optional[Mapping[str, Any]] = None, shard_parameters: bool = False, schedule: str = "gpipe",
                 virtual_stages: Optional[int] = None,
                 chunks: int = 1, checkpoint: str = "except_last", loss_fn: Optional[LossFn] = None,
                 device: Optional[torch.device | str] = None, bucket_cap_mb: float = 25.0) -> None:
        super().__init__()
        chunks, checkpoint = as_given_by_torchgpipe(chunks, checkpoint)
        staged = isinstance(mesh, (list, tuple))
        mesh = mesh if staged else as_device_mesh(mesh)  # an AbstractMesh: a dry run's pipe
        if not isinstance(mesh, DeviceMesh) and not staged:
            raise TypeError(f"DistributedPipe runs over a DeviceMesh with a pp dim, or a list of one DeviceMesh per "
                            f"stage, got {describe(mesh)}: build one with shardwise.init_device_mesh(..., "
                            "mesh_dim_names=('pp',))")
        if isinstance(balance, (str, bytes)) or not isinstance(balance, Iterable):
            raise TypeError(f"balance must be a list of layers per stage, got {describe(balance)}: e.g. [2, 2]")
        balance = list(balance)
        if isinstance(mesh, DeviceMesh):
            dp_dim, tp_dim, cp_dim = check_arguments(mesh, pp_dim, dp_dim, tp_dim, cp_dim, tp_plan, schedule,
                                                      virtual_stages, len(balance), chunks)
            topology, stage_mesh = uniform_topology(mesh, pp_dim, dp_dim, tp_dim, cp_dim), mesh
            tp_mesh = mesh[tp_dim] if tp_dim is not None else None
            zero_mesh = mesh[tuple(d for d in (dp_dim, tp_dim) if d is not None)] if dp_dim is not None else None
        else:  # one mesh per stage: (tp,) or (dp, tp), tp sizes free
            if cp_dim is not None:
                raise ValueError(f"cp_dim={cp_dim!r} needs one mesh with pp and cp dims (e.g. ('pp', 'cp') or "
                                 "('pp', 'dp', 'cp', 'tp')), not a list of stage meshes")
            topology, stage_mesh, dp_dim, tp_dim = stage_topology(mesh, dp_dim, tp_dim)
            check_staged(topology, tp_plan, schedule, virtual_stages, len(balance), chunks)
            tp_mesh = stage_mesh[tp_dim] if stage_mesh.ndim == 2 else stage_mesh
            zero_mesh = stage_mesh
        if shard_parameters and dp_dim is None:
            raise ValueError("shard_parameters=True splits parameters over the data-parallel dim, but the mesh has "
                             "none: build it with a 'dp' dim (e.g. ('pp', 'dp', 'tp'), or ('dp', 'tp') stage meshes) "
                             "or pass dp_dim=")
        partitions = split_module(module, balance, chunks=chunks, checkpoint=checkpoint, allow_shared=True)
        check_tp_plan(tp_plan, partitions)
        pp = topology.pp
        self.mesh, self.pp_dim, self.dp_dim, self.topology = mesh, pp_dim, dp_dim, topology
        self.chunks, self.checkpoint, self.loss_fn, self.balance = chunks, checkpoint, loss_fn, balance
        self.bucket_cap_mb = bucket_cap_mb
        self.schedule: Schedule = (ScheduleGPipe(len(balance), chunks) if schedule == "gpipe" else
                                   Schedule1F1B(len(balance), chunks) if schedule == "1f1b" else
                                   ScheduleInterleaved1F1B(pp, len(balance) // pp, chunks))
        self.device = torch.device(device) if device is not None else _default_device(stage_mesh)
        self.rank = stage_mesh.get_rank()
        self.pp_rank = topology.pp_rank
        self.skip_routes = inspect_skip_layout(partitions)  # every partition's declarations, once
        local = self.schedule.rank_stages(self.pp_rank)
        shared = shared_across_ranks(partitions, self.schedule.stage_rank)  # before sharding makes new objects
        check_shared(topology, shared, shard_parameters)
        # a stage built on meta stays there (split and sharded as it is) until `pipe.to_empty(device=...)`
        mine = {j: partitions[j] if _on_meta(partitions[j]) else partitions[j].to(self.device) for j in local}
        self.tp_dim, self.tp_mesh = tp_dim, tp_mesh
        for part in mine.values():  # each stage's layers sharded over its tp sub-mesh (and over dp: ZeRO-3)
            shard_stage(part, self.tp_mesh, tp_plan)
            if shard_parameters:
                assert zero_mesh is not None  # a dp dim was required above
                data_parallel(part, zero_mesh, dp_dim=dp_dim, shard_parameters=True, bucket_cap_mb=bucket_cap_mb)
        self.shard_parameters = shard_parameters
        self.partitions = nn.ModuleDict({str(j): part for j, part in mine.items()})
        carry_source(module, self, {f"partitions.{j}.": "" for j in mine})  # the names of hf_sequential's model
        self.stages = {j: PipelineStage(part, j, len(balance), self.rank) for j, part in mine.items()}
        self.num_stages = len(balance)
        del partitions, mine  # the other ranks' layers are not kept here

        where = [self.schedule.stage_rank(s) for s in range(self.num_stages)]
        self.plan = ChannelPlan(self.num_stages, self.skip_routes, [topology.partner(p) for p in where],
                                rows=[topology.row(p) for p in where])
        if isinstance(mesh, DeviceMesh):  # messages stay within this rank's pp slice
            self._group, self._group_size = _p2p_group(mesh, mesh.mesh_dim_index(pp_dim)), pp
        else:  # stages of different widths: a crossing may reach any rank of the next stage
            self._group, self._group_size = _world_group(stage_mesh.device_type), dist.get_world_size()
        self._wire = Wire(self._group, self.device, len(self.plan.channels), tp_mesh=self.tp_mesh)
        self._shared = shared_groups(topology, shared, self.partitions, stage_mesh.device_type)
        self._dp_group = stage_mesh.get_group(dp_dim) if dp_dim is not None else None
        self._dp_size = stage_mesh.size(dp_dim) if dp_dim is not None else 1
        self.cp_dim = cp_dim
        self._cp = cp_group(stage_mesh[cp_dim], "DistributedPipe") if cp_dim is not None else None
        self._broken: Optional[str] = None
        self._steps = 0  # steps begun, named in errors ("... of micro-batch 2 of step 3")
        self._abandoned: list[comm.P2PWork] = []  # sends no one will receive; their buffers must outlive them

    # -- public -------------------------------------------------------------------------------

    def step(self, input: Optional[BatchValue] = None, target: Any = None) -> Optional[Tensor]:
        """Forward and backward of every micro-batch in the schedule's order; gradients land in
        `.grad` of this rank's parameters (averaged over dp). Returns the loss on the last
        stage's rank, `None` elsewhere."""
        if self.loss_fn is None:
            raise ValueError("step() trains, so it needs loss_fn: pass DistributedPipe(..., loss_fn=...) "
                             "or call the pipe (forward only) for outputs")
        run = StepRun(self, train=True)
        self._execute(run, self.schedule.rank_order(self.pp_rank), input, target)
        sum_shared_gradients(self)
        sum_cp_gradients(self)
        reduce_gradients(self)
        if not self._holds(self.num_stages - 1):
            return None
        loss = run.loss.full_tensor() if isinstance(run.loss, DTensor) else run.loss
        return whole_loss(self, loss) if loss is not None else None

    def forward(self, input: Optional[BatchValue] = None) -> Optional[BatchValue]:
        """Forward only, without autograd: the joined outputs on the last stage's rank, `None`
        elsewhere (under cp_dim, each cp rank's tokens of them)."""
        run = StepRun(self, train=False)
        with torch.no_grad():
            order = [a for a in self.schedule.rank_order(self.pp_rank) if a.kind == "F"]
            self._execute(run, order, input, None)
        if not self._holds(self.num_stages - 1):
            return None
        return gather([run.outputs[i] for i in range(self.schedule.num_microbatches)])

    def close(self) -> None:
        """Release the point-to-point process group (collective: every process calls it)."""
        if self._group is not None:
            if type(self._group) is not DryGroup:
                dist.destroy_process_group(self._group)
            self._group = None
        for shared in self._shared:
            if shared.group is not None and type(shared.group) is not DryGroup:
                dist.destroy_process_group(shared.group)
        self._shared = []

    def extra_repr(self) -> str:
        return (f"schedule={self.schedule!r}, balance={self.balance}, pp_rank={self.pp_rank}, "
                f"stages={sorted(self.stages)}, checkpoint={self.checkpoint!r}")

    # -- running ------------------------------------------------------------------------------

    def _holds(self, stage: int) -> bool:
        return stage in self.stages

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise RuntimeError(f"this DistributedPipe failed in an earlier step ({self._broken}); its channels "
                               "may hold undelivered messages: build a new pipe (after a dead process, new "
                               "process groups too)")

    def _execute(self, run: StepRun, order: list[Action], input: Any, target: Any) -> None:
        self._check_usable()
        k = 0
        self._steps += 1
        failure: Optional[tuple[BaseException, RemoteFailure]] = None
        trace = current_trace()
        replayed = traced_step(self, trace, order)
        attention = self._cp_attention(input) if self._cp is not None else None
        try:
            with Attention(attention) if attention is not None else nullcontext():
                run.prepare(input, target)
                for k, action in enumerate(order):
                    run.current = action
                    if replayed is not None:
                        replayed.k = k
                    run.do(action)
            run.current = None
        except BaseException as exc:
            failure = self._notify(exc, order[k:], run)
        finally:
            self._wire.traced = None
        if failure is None and replayed is not None and trace is not None:
            trace.host(replayed.conclude, [])  # the end-of-step check, at every replay too
        else:
            self._conclude(failure)

    def _cp_attention(self, input: Any) -> CpAttention:
        """The step's context-parallel attention: the first stage's ranks tell the others the
        sequence length (one small all_gather over the pp ranks)."""
        assert self._cp is not None
        length = -1
        if self._holds(0) and input is not None:
            first = Batch(input).tensors[0]
            length = first.size(1) if first.dim() >= 2 else -1
        rows = comm.all_gather_ints([length], self._group, self._group_size) if self._group_size > 1 else [[length]]
        lengths = {n for (n,) in rows if n >= 0}
        if len(lengths) != 1:
            raise ValueError(f"DistributedPipe(cp_dim={self.cp_dim!r}): the first stage's input must be (batch, seq, "
                             f"...) whole sequences, one length; the first stage's ranks gave lengths "
                             f"{sorted(n for (n,) in rows if n >= 0) or 'none'}")
        return make_cp_attention(lengths.pop(), self._cp)

    def _notify(self, exc: BaseException, remaining: list[Action],
                run: StepRun | ReplayedStep) -> tuple[BaseException, RemoteFailure]:
        """Tell every stage this rank still owes a message that the step failed; return the error to raise here."""
        action = run.current
        where = (f"before its first micro-batch of step {self._steps}" if action is None else
                 f"in the {'forward' if action.kind == 'F' else 'backward'} of micro-batch {action.microbatch} of "
                 f"step {self._steps}")
        stage = action.stage if action is not None else min(self.stages)
        if isinstance(exc, RemoteFailure):
            relay = exc
            local: BaseException = PipelineError(f"stage {stage} on rank {self.rank} stopped {where} {exc.doing}: "
                                                 f"{exc.cause}")
        else:
            relay = RemoteFailure(f"stage {stage} on rank {self.rank} raised {type(exc).__name__}: {exc} ({where})",
                                  False, stage, self.rank)
            local = exc
            if hasattr(exc, "add_note"):
                exc.add_note(f"(raised by stage {stage} on rank {self.rank} {where}; the other stages were told "
                             "and stop with PipelineError)")
        for a in remaining:
            for channel in self.plan.outgoing(a):
                if (channel.index, a.microbatch) not in run.sent:
                    run.sent.add((channel.index, a.microbatch))
                    try:
                        self._wire.send_failure(channel, a.microbatch, relay)
                    except RemoteFailure:  # that stage's process is gone; it needs no news
                        pass
        return local, relay

    def _conclude(self, failure: Optional[tuple[BaseException, RemoteFailure]]) -> None:
        """Agree with the other pp ranks on the step's outcome; wait for the sends, or raise."""
        if failure is not None and failure[1].died:  # a process may be gone: no collective can complete
            self._give_up(failure[1].cause)
            raise failure[0]
        me = [0, -1, -1] if failure is None else [1, failure[1].origin_stage, failure[1].origin_rank]
        try:
            outcomes = comm.all_gather_ints(me, self._group, self._group_size) if self._group_size > 1 else [me]
        except RuntimeError as exc:
            self._give_up(str(exc))
            if failure is not None:
                raise failure[0]
            raise PipelineError(
                f"stages {sorted(self.stages)} on rank {self.rank} finished their part of the step, but the check "
                f"of the step's outcome over the pp ranks failed ({exc}): another stage's process has probably "
                "died or is stuck") from exc
        if failure is not None:
            self._give_up(failure[1].cause)
            raise failure[0]
        failed = [(stage, rank) for code, stage, rank in outcomes if code]
        if failed:
            origin = ", ".join(sorted({f"stage {s} on rank {r}" for s, r in failed}))
            self._give_up(f"failure at {origin}")
            raise PipelineError(f"stages {sorted(self.stages)} on rank {self.rank} finished their part of the step, "
                                f"but it failed at {origin} (see that rank's error); the gradients of this step "
                                "are partial")
        try:
            self._wire.finish()
        except comm.P2PError as exc:
            self._give_up(str(exc))
            raise PipelineError(f"rank {self.rank}: a message of the step was never received: {exc}") from exc

    def _give_up(self, reason: str) -> None:
        self._broken = reason
        self._abandoned += self._wire.abandon()

def _on_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def _default_device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def _world_group(device_type: str) -> Any:
    """A new process group of every process, for a pipe whose crossings may reach any rank."""
    group = dist.new_group(list(range(dist.get_world_size())), timeout=collective_timeout(),
                           backend="nccl" if device_type == "cuda" else None)
    comm.all_gather_ints([0], group, dist.get_world_size())  # every member connected before any send
    POINT_TO_POINT.add(group.group_name)  # its ranks' message counts differ by nature (crossings fan out)
    return group


def _p2p_group(mesh: DeviceMesh, pp_index: int) -> Any:
    """A new process group for this rank's pp slice (every process creates every slice's, in order)."""
    pp = mesh.shape[pp_index]
    if pp == 1:
        return None
    if isinstance(mesh, DryMesh):  # a dry run: the slice's label, no process group
        dry = mesh.get_group(pp_index)
        comm.all_gather_ints([0], dry, pp)
        return dry
    rows = mesh.mesh.movedim(pp_index, -1).reshape(-1, pp).tolist()
    mine = None
    backend = "nccl" if mesh.device_type == "cuda" else None
    for row in rows:
        group = dist.new_group(row, timeout=collective_timeout(), backend=backend)
        if dist.get_rank() in row:
            mine = group
    # A member may return from new_group before its peers have finished connecting; one exchange
    # makes sure they have, so that close() right away cannot cut a peer's connection short.
    comm.all_gather_ints([0], mine, pp)
    return mine


