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
These sums (dp, tied stages, cp) are the registered end-of-backward reducers of their
parameters (`_gradients`), finished once after the schedule: `shardwise.debug.gradient_reducers`
names them, and a parameter that already has a reducer at their level is refused.

Failures: a stage that raises tells every stage waiting on it (see `_wire`), which tell
theirs, and all stop; at the end of every step the pp ranks compare outcomes (one small
all_gather), so a rank that had finished its part still fails when another did. The
failing rank re-raises its own exception; the others raise `PipelineError` naming their
stage, rank, micro-batch, what they waited for and where the failure began. A dead
process is noticed when its connection closes or after `SHARDWISE_COLLECTIVE_TIMEOUT`.
After a failure the pipe refuses further steps (its channels may hold stale messages).

Point-to-point messages use a process group of their own per pp slice, made by every
process through `shardwise._mesh`; `close()` gives it back and unregisters the reducers.

The pipe itself is thin: its arguments become a frozen `PipeLayout` (`_layout`: validated
once), its stages are placed and sharded, and a `StepContext` (`_context`: the stages, the
process groups, the wire, the step guard, the gradient reducers) is what the step (`_step`,
`_execute`) and its replay (`_replay`) work with.

`DistributedPipe.from_stages` is the second way to build one, for stages made one by one
(`shardwise.pipelining`'s `PipelineStage`, as torch.distributed.pipelining makes them): each
rank gives only its own stages' modules and the schedule as a value; the step is the same.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Generic, Optional, TypeVar, overload

import torch
from torch import Tensor, nn

from .._mesh import DeviceMesh
from .._source_names import carry_source
from ._context import place_stages, step_context
from ._execute import execute
from ._layout import PipeLayout, plan_pipe, plan_stages
from ._microbatch import BatchValue, gather
from ._schedule import Schedule
from ._stage import PipelineStage
from ._step import LossFn, StepRun
from ._wire import PipelineError

__all__ = ["DistributedPipe", "PipelineError"]

T = TypeVar("T")


class _FromLayout(Generic[T]):
    """A read-only attribute of the pipe that is a value of its layout (the names it has always had)."""

    def __init__(self, get: Callable[[PipeLayout], T]) -> None:
        self.get = get

    @overload
    def __get__(self, pipe: None, owner: Any) -> _FromLayout[T]: ...
    @overload
    def __get__(self, pipe: DistributedPipe, owner: Any) -> T: ...
    def __get__(self, pipe: Optional[DistributedPipe], owner: Any) -> T | _FromLayout[T]:
        return self if pipe is None else self.get(pipe.layout)


class DistributedPipe(nn.Module):
    """`module` as a pipeline over `mesh`'s `pp_dim` (see the module docstring).

    Args:
        module: the layers, in order (`@skippable` layers may stash and pop across stages).
        balance: layers per stage; `len(balance)` stages, the pp size of them for `"gpipe"`
            and `"1f1b"`, a multiple of it for `"interleaved"`, `"looped_bfs"` and
            `"zero_bubble"` (stage `s` on pp rank `s % pp`), twice it (rank `k`
            holds stages `k` and `2 pp - 1 - k`) for `"zbv"` and `"dualpipev"`.
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
        schedule: `"gpipe"` (fill-drain), `"1f1b"`, `"interleaved"` (1F1B with
            `virtual_stages` stages per rank; `chunks` must be a multiple of the pp size),
            `"looped_bfs"`, or the zero-bubble ones, whose backwards run in two halves (the
            inputs' gradients, then the weights'): `"zero_bubble"` (ZB-H1 with one stage per
            rank, interleaved with several), `"zbv"` and `"dualpipev"` (two stages per rank in
            a V; DualPipeV needs `chunks >= 2 * pp`).
        chunks: micro-batches per step (`Tensor.chunk` along dim 0; each must be non-empty).
        checkpoint: `"always"`, `"except_last"` (every micro-batch but the last) or `"never"`.
        loss_fn: `loss_fn(output, target)` (or `loss_fn(output)`), a mean over the micro-batch.
        device: where this rank's stages live (default: cpu, or the current CUDA device).
        bucket_cap_mb: size of the gradient buckets averaged over dp.

    `parameters()` and `partitions` hold this rank's stages only (`partitions["2"]` is stage
    2), so an optimizer built on `pipe.parameters()` steps what this rank trains. `layout` is
    the pipe's frozen `PipeLayout` (its schedule, topology, channels and groups; `schedule`,
    `topology`, `pp_rank` and the other attributes named like arguments read it). On two
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
    stages: dict[int, PipelineStage]  # this rank's stages by index

    # the layout's values, under the names the pipe's attributes have always had
    mesh = _FromLayout(lambda lay: lay.mesh)
    pp_dim, dp_dim = _FromLayout(lambda lay: lay.pp_dim), _FromLayout(lambda lay: lay.dp_dim)
    tp_dim, cp_dim = _FromLayout(lambda lay: lay.tp_dim), _FromLayout(lambda lay: lay.cp_dim)
    tp_mesh, topology = _FromLayout(lambda lay: lay.tp_mesh), _FromLayout(lambda lay: lay.topology)
    schedule, plan = _FromLayout(lambda lay: lay.schedule), _FromLayout(lambda lay: lay.channels)
    balance = _FromLayout(lambda lay: list(lay.balance))
    num_stages, chunks = _FromLayout(lambda lay: lay.num_stages), _FromLayout(lambda lay: lay.chunks)
    checkpoint, device = _FromLayout(lambda lay: lay.checkpoint), _FromLayout(lambda lay: lay.device)
    rank, pp_rank = _FromLayout(lambda lay: lay.rank), _FromLayout(lambda lay: lay.pp_rank)
    skip_routes = _FromLayout(lambda lay: lay.skip_routes)
    shard_parameters = _FromLayout(lambda lay: lay.shard_parameters)
    bucket_cap_mb = _FromLayout(lambda lay: lay.bucket_cap_mb)

    def __init__(self, module: nn.Sequential, balance: Sequence[int], mesh: DeviceMesh | Sequence[DeviceMesh], *,
                 pp_dim: str = "pp",
                 dp_dim: Optional[str] = None, tp_dim: Optional[str] = None, cp_dim: Optional[str] = None,
                 tp_plan: Optional[Mapping[str, Any]] = None, shard_parameters: bool = False, schedule: str = "gpipe",
                 virtual_stages: Optional[int] = None,
                 chunks: int = 1, checkpoint: str = "except_last", loss_fn: Optional[LossFn] = None,
                 device: Optional[torch.device | str] = None, bucket_cap_mb: float = 25.0) -> None:
        super().__init__()
        layout, partitions = plan_pipe(module, balance, mesh, pp_dim=pp_dim, dp_dim=dp_dim, tp_dim=tp_dim,
                                       cp_dim=cp_dim, tp_plan=tp_plan, shard_parameters=shard_parameters,
                                       schedule=schedule, virtual_stages=virtual_stages, chunks=chunks,
                                       checkpoint=checkpoint, device=device, bucket_cap_mb=bucket_cap_mb)
        self.layout = layout
        self.loss_fn = loss_fn
        mine = place_stages(layout, partitions, tp_plan)
        del partitions  # the other ranks' layers are not kept here
        self.partitions = nn.ModuleDict({str(j): part for j, part in mine.items()})
        carry_source(module, self, {f"partitions.{j}.": "" for j in mine})  # the names of hf_sequential's model
        self._context = step_context(layout, self.partitions)
        self.stages = self._context.stages

    @classmethod
    def from_stages(cls, partitions: Mapping[int, nn.Sequential], mesh: DeviceMesh, schedule: Schedule, *,
                    device: torch.device, loss_fn: Optional[LossFn] = None,
                    p2p_rows: Optional[Sequence[tuple[int, ...]]] = None) -> DistributedPipe:
        """A pipe of stages given one by one: `partitions[s]` runs stage `s` (exactly the stages
        `schedule.rank_stages` gives this rank), on `device`, as they are (not moved or split),
        over the one-dim `("pp",)` `mesh` (collective: every process builds its pipe; where
        several pipelines run side by side, `p2p_rows` lists every one's ranks). No skips, tied
        parameters or checkpointing; `step` and `forward` are as for any pipe."""
        layout = plan_stages(mesh, schedule, torch.device(device), p2p_rows)
        if sorted(partitions) != list(layout.local_stages):
            raise ValueError(f"{schedule!r} runs stages {list(layout.local_stages)} on pp rank {layout.pp_rank}, "
                             f"got stages {sorted(partitions)}: give this rank exactly those")
        pipe = cls.__new__(cls)
        nn.Module.__init__(pipe)
        pipe.layout, pipe.loss_fn = layout, loss_fn
        pipe.partitions = nn.ModuleDict({str(j): partitions[j] for j in layout.local_stages})
        pipe._context = step_context(layout, pipe.partitions)
        pipe.stages = pipe._context.stages
        return pipe

    # -- public -------------------------------------------------------------------------------

    def step(self, input: Optional[BatchValue] = None, target: Any = None) -> Optional[Tensor]:
        """Forward and backward of every micro-batch in the schedule's order; gradients land in
        `.grad` of this rank's parameters (averaged over dp). Returns the loss on the last
        stage's rank, `None` elsewhere."""
        if self.loss_fn is None:
            raise ValueError("step() trains, so it needs loss_fn: pass DistributedPipe(..., loss_fn=...) "
                             "or call the pipe (forward only) for outputs")
        ctx, layout = self._context, self.layout
        run = StepRun(ctx, train=True, training=self.training, loss_fn=self.loss_fn)
        execute(ctx, run, layout.schedule.rank_order(layout.pp_rank), input, target)
        ctx.gradients.finish()  # the registered reducers' sums: over dp, then tied stages and cp
        return run.whole_loss()

    def forward(self, input: Optional[BatchValue] = None) -> Optional[BatchValue]:
        """Forward only, without autograd: the joined outputs on the last stage's rank, `None`
        elsewhere (under cp_dim, each cp rank's tokens of them)."""
        ctx, layout = self._context, self.layout
        run = StepRun(ctx, train=False, training=self.training)
        with torch.no_grad():
            order = [a for a in layout.schedule.rank_order(layout.pp_rank) if a.kind == "F"]
            execute(ctx, run, order, input, None)
        if not layout.holds(layout.num_stages - 1):
            return None
        return gather([run.outputs[i] for i in range(layout.schedule.num_microbatches)])

    def close(self) -> None:
        """Release the pipe's process groups and its gradient reducers (collective: every process
        calls it)."""
        self._context.close()

    def extra_repr(self) -> str:
        layout = self.layout
        return (f"schedule={layout.schedule!r}, balance={list(layout.balance)}, pp_rank={layout.pp_rank}, "
                f"stages={sorted(self.stages)}, checkpoint={layout.checkpoint!r}")
