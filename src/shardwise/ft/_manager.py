"""`Manager`: one replica group's part in per-step fault tolerance (torchft's `Manager`, on shardwise).

A step under a manager:

| call | what happens |
|---|---|
| `start_quorum()` | the group asks the lighthouse; the quorum names the members, the step, who heals |
| (rebuild) | the group across members is made anew when the members changed or the last step failed |
| (heal) | a member behind the quorum's step receives the state of an up-to-date one, point to point |
| forward, backward | gradients reduced across the members (`DistributedDataParallel`, or `allreduce`) |
| `should_commit()` | every rank of every member votes; the step commits everywhere or nowhere |

Any failure between the quorum and the vote (a member dead or hung, a message that timed
out) is recorded, not raised: this rank votes no, no member applies the step, and the next
quorum goes on without whoever is gone. A heal counts only with its step: when the step is
discarded, every rank of the healed group goes back to the step it had before, so the group
asks as behind again and each of its ranks receives the state anew (one rank's heal can fail
where another's succeeded). Failures inside a group (its own collectives) are
the group's: its processes fail and `shardwise run --ft` restarts that group alone, which
then heals from a live member. The healing transfer is the state of `state_dict()` plus
the manager's step and the RNG state, as tensors and a JSON header (`_wire`): nothing
received runs code. A group whose loop has ended stays in `shutdown()` until every live
group has finished, giving its state to one that missed the last step (`_quorum`'s final
quorum), so that no group ends the job with a step of its own.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional, Union

import torch
import torch.distributed as dist

from .. import _comm
from .._mesh import replica_group
from ._client import QuorumClient
from ._lighthouse import valid_id
from ._quorum import Quorum
from ._transfer import messages_of
from ._wire import MAX_HEADER_BYTES, pack, unpack

__all__ = ["Manager"]

class Manager:
    """Fault tolerance for the replica group this process belongs to.

    `state_dict()` / `load_state_dict(state)`: the group's state that a healing group
    receives (model, optimizer, data position...). `lighthouse_addr` (default:
    `SHARDWISE_FT_LIGHTHOUSE`), `replica_id` (default: `SHARDWISE_FT_REPLICA_ID`); `rank` /
    `world_size` within the group (default: the group's own world, else 0 / 1). `timeout`
    bounds every message between groups and the vote: a dead or hung member fails the step
    within it. A quorum of fewer than `min_replica_size` groups does not commit.
    `checkpoint_dir` / `checkpoint_every`: the fallback for a start with no live group to heal
    from (see the module docstring); `state_dict()` must then hold the optimizer's state
    before its first step too (`shardwise.checkpoint.state_dict.get_state_dict` creates it).
    The checkpoint holds rank 0's RNG state for every rank; healing from a peer gives each
    rank its own.
    """

    def __init__(self, pg: Any = None, load_state_dict: Optional[Callable[[Any], None]] = None,
                 state_dict: Optional[Callable[[], Any]] = None, min_replica_size: int = 1, *,
                 timeout: timedelta = timedelta(seconds=10), quorum_timeout: timedelta = timedelta(seconds=60),
                 connect_timeout: timedelta = timedelta(seconds=60),
                 heartbeat_interval: timedelta = timedelta(milliseconds=100), rank: Optional[int] = None,
                 world_size: Optional[int] = None, lighthouse_addr: Optional[str] = None,
                 replica_id: Optional[str] = None, checkpoint_dir: Union[str, os.PathLike[str], None] = None,
                 checkpoint_every: int = 0) -> None:
        if pg is not None:
            raise ValueError("Manager(pg=...): shardwise makes the group across replica groups itself, anew for "
                             "each membership; pass pg=None")
        if (load_state_dict is None) != (state_dict is None):
            raise ValueError("Manager: give both load_state_dict and state_dict (what a healing group receives), "
                             "or neither")
        if checkpoint_every < 0 or (checkpoint_every > 0) != (checkpoint_dir is not None):
            raise ValueError(f"Manager(checkpoint_dir={checkpoint_dir!r}, checkpoint_every={checkpoint_every}): give "
                             "both (a directory every rank shares, and a number of steps > 0) or neither")
        if min_replica_size < 1:
            raise ValueError(f"Manager(min_replica_size={min_replica_size}): at least 1")
        address = lighthouse_addr or os.environ.get("SHARDWISE_FT_LIGHTHOUSE")
        rid = replica_id or os.environ.get("SHARDWISE_FT_REPLICA_ID")
        if not address or not rid:
            raise ValueError("Manager: no lighthouse address or replica id; pass lighthouse_addr= and replica_id= or "
                             "set SHARDWISE_FT_LIGHTHOUSE and SHARDWISE_FT_REPLICA_ID (`shardwise run --ft` does)")
        if not valid_id(rid):
            raise ValueError(f"Manager(replica_id={rid!r}): up to 128 letters, digits and _.:-")
        in_world = dist.is_initialized()
        self.rank = rank if rank is not None else (dist.get_rank() if in_world else int(os.environ.get("RANK", 0)))
        self.world_size = world_size if world_size is not None else (
            dist.get_world_size() if in_world else int(os.environ.get("WORLD_SIZE", 1)))
        self.replica_id, self.timeout, self.quorum_timeout = rid, timeout, quorum_timeout
        self.min_replica_size = min_replica_size
        # what a healing group receives, by key (torchft's `register_state_dict_fn`)
        self._user: dict[str, tuple[Callable[[Any], None], Callable[[], Any]]] = {}
        if load_state_dict is not None and state_dict is not None:
            self.register_state_dict_fn("default", load_state_dict, state_dict)
        self._nonce = self._group_nonce(in_world)
        self._client = QuorumClient(address, rid, self.rank, self.world_size, connect_timeout, heartbeat_interval)
        self._asked = 0
        self._step = 0
        self._batches = 0
        self._quorum: Optional[Quorum] = None
        self._group: Any = None
        self._rebuild = True
        self._error: Optional[BaseException] = None
        self._healing_from: Optional[tuple[int, int]] = None  # (step, batches) before this step's heal
        self._last_committed = False  # whether the last vote committed (then this group holds the job's state)
        self.healed = 0  # times this group received a live member's state
        self.committed = self.discarded = 0  # this process's steps that committed / that no member applied
        self._since = time.monotonic()
        self.resumed_from: Optional[int] = None  # the step of the checkpoint this group started from, if it did
        self._checkpoint = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self._checkpoint_every, self._saved_step = checkpoint_every, 0
        self._saving: Any = None  # the async save under way (a SaveFuture)
        self.samples = 1.0  # this group's weight in the next reduction (samples it contributed)

    def _group_nonce(self, in_world: bool) -> int:
        """A random number every rank of the group shares (rank 0's): its asks are named by it,
        so a restarted group never reuses an answered name. Made before the group's world (as
        torchft's programs make it, before `ft_init_device_mesh`), it is drawn from torchrun's
        run id and restart count, which every rank of one launch attempt shares."""
        mine = secrets.randbits(62)
        if self.world_size == 1:
            return mine
        if in_world:
            return _comm.all_gather_ints([mine], dist.group.WORLD, self.world_size)[0][0]
        run, life = os.environ.get("TORCHELASTIC_RUN_ID"), os.environ.get("TORCHELASTIC_RESTART_COUNT")
        if not run or life is None:
            raise ValueError(f"Manager(world_size={self.world_size}) made before the group's process group, outside "
                             "torchrun: make it after init_device_mesh / init_process_group, or launch with "
                             "`shardwise run --ft` (its ranks share torchrun's run id)")
        return int.from_bytes(hashlib.sha256(f"{run}/{life}".encode()).digest()[:7], "big")

    # -- the step ---------------------------------------------------------------------------
    def start_quorum(self) -> None:
        """Join the next step's quorum; heal first if this group is behind it."""
        self._error = None
        self._healing_from = None
        self._save_if_due()
        self._asked += 1
        try:
            quorum = self._client.quorum(f"{self._nonce:x}.{self._asked}", self._step, self.quorum_timeout)
        except TimeoutError as exc:
            self._quorum = None
            self.report_error(exc)
            return
        if quorum.members != (self._quorum.members if self._quorum else ()) or self._rebuild:
            self._join(quorum)
        self._quorum, self._rebuild = quorum, quorum.final
        if self._group is None:
            return
        if self._step == 0 and quorum.step == 0 and self._checkpoint is not None:
            self._resume(quorum)
        try:
            self._heal(quorum)
        except _comm.ReplicaError as exc:
            self.report_error(exc)

    def _join(self, quorum: Quorum) -> None:
        """Make the group across the quorum's members (its ranks of this rank's place)."""
        self._group = None
        try:
            self._group = replica_group(self._client.prefix(f"pg/{quorum.quorum_id}/{self.rank}"),
                                        quorum.rank_of(self.replica_id), len(quorum.members), self.timeout)
        except RuntimeError as exc:
            self.report_error(_comm.ReplicaError(f"making the group of quorum {quorum.quorum_id}", exc))

    def _heal(self, quorum: Quorum) -> None:
        source = quorum.heal_from.get(self.replica_id)
        if source is not None:
            self._healing_from = (self._step, self._batches)
            self._receive(quorum.rank_of(source))
            self._step = quorum.step
            self.healed += 1
        for healer, giver in sorted(quorum.heal_from.items()):
            if giver == self.replica_id:
                self._send(quorum.rank_of(healer))

    def should_commit(self) -> bool:
        """Vote on this step and return the outcome, the same on every rank of every member: True
        when every one of them succeeded (then the step counts), else False (nobody applies it)."""
        quorum = self._quorum
        if quorum is None:
            self._rebuild = True
            return False
        if quorum.final:
            return self._end_heal(quorum)
        ok = self._error is None and len(quorum.members) >= self.min_replica_size
        committed = self._last_committed = self._client.vote(quorum, ok, self.timeout)
        if committed:
            self._step += 1
            self._batches += len(quorum.members)
            self.committed += 1
        else:
            self._rebuild = True
            if self._healing_from is not None:
                # a heal counts only with its step: every rank of this group goes back to where it was,
                # so that the group asks as behind again and each of its ranks receives the state anew
                # (one rank's heal may have failed where another's succeeded)
                self._step, self._batches = self._healing_from
            why = (repr(self._error) if self._error is not None else f"{len(quorum.members)} groups, fewer than "
                   f"min_replica_size={self.min_replica_size}" if not ok else "another member failed or timed out")
            self.discarded += 1
            self._say(f"step {self._step} of quorum {quorum.quorum_id} discarded: {why}")
        return committed

    def _end_heal(self, quorum: Quorum) -> bool:
        """A final quorum: the groups behind voted on their heal alone (the finished ones do not
        vote); no step was taken, so False either way. The heal stands if every rank of every
        healed group received its state; else each goes back, as after a discarded step."""
        healed = self._last_committed = self._client.vote(quorum, self._error is None, self.timeout)
        if healed:
            self._say(f"healed to step {quorum.step} from {quorum.heal_from[self.replica_id]}, which finished "
                      f"there (quorum {quorum.quorum_id}): no step to take")
        else:
            if self._healing_from is not None:
                self._step, self._batches = self._healing_from
            why = repr(self._error) if self._error is not None else "another healed rank failed"
            self._say(f"the heal of quorum {quorum.quorum_id} from a finished group failed: {why}")
        return False

    def _say(self, line: str) -> None:
        print(f"[shardwise.ft {self.replica_id} rank {self.rank}] {line}", file=sys.stderr, flush=True)

    # -- reductions -------------------------------------------------------------------------
    def allreduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Average `tensor` in place over the quorum's members (torchft's `allreduce`); a failure
        is recorded (the step will not commit) and `tensor` is left as it was."""
        if self._group is None or self._error is not None or self._quorum is None or self._quorum.final:
            return tensor
        flat = tensor.detach().contiguous()
        try:
            _comm.replica_all_reduce(flat, self._group, len(self._quorum.members), self.timeout, "a tensor")
        except _comm.ReplicaError as exc:
            self.report_error(exc)
            return tensor
        with torch.no_grad():
            tensor.copy_(flat / len(self._quorum.members))
        return tensor

    def reduce_gradients(self, grads: list[torch.Tensor]) -> None:
        """Replace each of `grads` (local tensors) by the members' mean weighted by the samples each
        contributed (`samples`): one all_reduce per dtype. The samples' sum rides at the end of
        the float64 (else float32) gradients, which hold a count exactly; without either it is a
        reduction of its own."""
        if self._group is None or self._error is not None or self._quorum is None or self._quorum.final or not grads:
            return
        size, weight = len(self._quorum.members), float(self.samples)
        dtypes = sorted({g.dtype for g in grads}, key=str)
        carrier = next((d for d in (torch.float64, torch.float32) if d in dtypes), None)
        try:
            total: Optional[float] = None
            if carrier is None:
                count = torch.tensor([weight], dtype=torch.float64)
                _comm.replica_all_reduce(count, self._group, size, self.timeout, "the samples of each group")
                total = count.item()
            else:
                dtypes = [carrier, *(d for d in dtypes if d != carrier)]
            for dtype in dtypes:
                same = [g for g in grads if g.dtype == dtype]
                n = sum(g.numel() for g in same)
                # room for the count (carrier), zero-padded to a multiple of the members: no copy to split it
                room = -(-(n + 1) // size) * size if dtype == carrier else n
                flat = torch.empty(room, dtype=dtype)
                torch.cat([g.reshape(-1) for g in same], out=flat[:n])
                flat[:n].mul_(weight)
                if dtype == carrier:
                    flat[n:].zero_()
                    flat[n] = weight
                _comm.replica_all_reduce(flat, self._group, size, self.timeout, f"{dtype} gradients")
                if dtype == carrier:
                    total = flat[n].item()
                assert total is not None
                flat[:n].div_(total)
                offset = 0
                for g in same:
                    g.copy_(flat[offset:offset + g.numel()].view_as(g))
                    offset += g.numel()
        except _comm.ReplicaError as exc:
            self.report_error(exc)

    # -- state ------------------------------------------------------------------------------
    def _state(self) -> dict[str, Any]:
        user = {key: save() for key, (_, save) in sorted(self._user.items())}
        return {"user": user, "step": self._step, "batches": self._batches, "rng": torch.get_rng_state()}

    def _send(self, dst: int) -> None:
        header, tensors = pack(self._state())
        sizes = torch.tensor([len(header), len(tensors)], dtype=torch.int64)
        messages, _ = messages_of(tensors, sending=True)
        pieces = [sizes, torch.frombuffer(bytearray(header), dtype=torch.uint8), *messages]
        _comm.replica_send(pieces, dst, self._group, self.timeout, "the state of a live group")

    def _receive(self, src: int) -> None:
        sizes = torch.empty(2, dtype=torch.int64)
        _comm.replica_recv([sizes], src, self._group, self.timeout, "the size of a live group's state")
        n, count = int(sizes[0]), int(sizes[1])
        if not 0 < n <= MAX_HEADER_BYTES:
            raise _comm.ReplicaError("receiving a live group's state", ValueError(f"a header of {n} bytes: refused"))
        header = torch.empty(n, dtype=torch.uint8)
        _comm.replica_recv([header], src, self._group, self.timeout, "the header of a live group's state")
        try:
            state, buffers = unpack(header.numpy().tobytes(), self._state())
        except ValueError as exc:
            raise _comm.ReplicaError("receiving a live group's state", exc) from exc
        if len(buffers) != count:
            raise _comm.ReplicaError("receiving a live group's state",
                                     ValueError(f"the header lists {len(buffers)} tensors, the sender {count}"))
        messages, unbundle = messages_of(buffers, sending=False)
        _comm.replica_recv(messages, src, self._group, self.timeout, "a live group's tensors")
        unbundle()
        if not isinstance(state.get("user"), dict) or set(state["user"]) != set(self._user):
            keys = sorted(state["user"]) if isinstance(state.get("user"), dict) else state.get("user")
            raise _comm.ReplicaError("receiving a live group's state", ValueError(
                f"it holds the parts {keys}, this group registers {sorted(self._user)}: every group must "
                "register the same state_dict keys"))
        for key, (load, _) in sorted(self._user.items()):
            load(state["user"][key])
        self._step, self._batches = int(state["step"]), int(state["batches"])
        torch.set_rng_state(state["rng"])

    # -- torchft's questions ----------------------------------------------------------------
    def register_state_dict_fn(self, key: str, load_state_dict: Callable[[Any], None],
                               state_dict: Callable[[], Any]) -> None:
        """Add `state_dict()` under `key` to what a healing group receives; it gets it back through
        `load_state_dict(state)` (the constructor's pair is key "default"; wrappers such as
        `DiLoCo` add their own). Every group must register the same keys."""
        if key in self._user:
            raise ValueError(f"Manager.register_state_dict_fn({key!r}): {key!r} is registered already; use a key "
                             "of its own for each part of the state")
        self._user[key] = (load_state_dict, state_dict)

    def report_error(self, error: BaseException) -> None:
        """Record a failure of this step: this rank will vote no."""
        if self._error is None:
            self._error = error

    def errored(self) -> Optional[BaseException]:
        return self._error

    def current_step(self) -> int:
        """Committed steps so far (the same on every member after each quorum)."""
        return self._step

    def batches_committed(self) -> int:
        """Batches in committed steps, one per member per step."""
        return self._batches

    def num_participants(self) -> int:
        return len(self._quorum.members) if self._quorum is not None else 0

    def participating_rank(self) -> Optional[int]:
        """This group's place among the quorum's members (None outside a quorum)."""
        return self._quorum.rank_of(self.replica_id) if self._quorum is not None else None

    def is_participating(self) -> bool:
        return self._quorum is not None

    def quorum(self) -> Optional[Quorum]:
        return self._quorum

    # -- the checkpoint, for a start with no live peer ------------------------------------------
    def _save_if_due(self) -> None:
        """Every `checkpoint_every` committed steps, at the step boundary (after the optimizer step),
        the first member of the last quorum saves the state in the background, by the one save
        transaction of `shardwise.checkpoint` (the last complete checkpoint stays until this one
        is whole). A failed save is logged; training goes on."""
        quorum, step = self._quorum, self._step
        if (self._checkpoint is None or step == 0 or step % self._checkpoint_every or step == self._saved_step
                or quorum is None or quorum.members[:1] != (self.replica_id,)):
            return
        from .. import checkpoint

        self._saved_step = step
        self._wait_for_save()
        self._saving = checkpoint.async_save(self._state(), checkpoint_id=self._checkpoint)
        self._say(f"saving step {step} to {self._checkpoint}")

    def _wait_for_save(self) -> None:
        saving, self._saving = self._saving, None
        if saving is not None:
            try:
                saving.result()
            except Exception as exc:  # noqa: BLE001 - a fallback copy: the last complete checkpoint stays
                self._say(f"a checkpoint save failed ({type(exc).__name__}: {exc}); the last complete one stays")

    def _resume(self, quorum: Quorum) -> None:
        """Start from the last complete checkpoint: every member of this quorum is at step 0, so no
        live group is ahead to heal from, and each of them loads the same checkpoint."""
        if self._checkpoint is None or not (self._checkpoint / "metadata.json").exists():
            return
        from .. import checkpoint

        state = self._state()
        try:
            checkpoint.load(state, checkpoint_id=self._checkpoint)
        except ValueError as exc:
            raise ValueError(f"replica group {self.replica_id}: cannot resume from {self._checkpoint}: {exc}\n"
                             "The state_dict= given to Manager must hold every tensor the checkpoint does, "
                             "before the first step too: build it with shardwise.checkpoint.state_dict."
                             "get_state_dict(model, optimizer), which creates the optimizer's state") from None
        for key, (load, _) in sorted(self._user.items()):
            load(state["user"][key])
        self._step, self._batches = int(state["step"]), int(state["batches"])
        self._saved_step = self.resumed_from = self._step
        torch.set_rng_state(state["rng"])
        self._say(f"no live group ahead in quorum {quorum.quorum_id}: resumed from the checkpoint of step "
                  f"{self._step} in {self._checkpoint}")

    def goodput(self) -> float:
        """Committed steps per wall-clock second since this manager was made."""
        return self.committed / max(time.monotonic() - self._since, 1e-9)

    def shutdown(self, wait: bool = True) -> None:
        """Wait for a checkpoint save under way; then, with `wait` and a last step that committed,
        stay until every live group has finished, giving this group's state to any that asks
        behind it (one that missed the last quorum would otherwise take the last step again
        alone), for at most `quorum_timeout`. Stop the heartbeat, and report (group rank 0) the
        steps committed and discarded and the goodput."""
        self._wait_for_save()
        if wait and self._last_committed:
            self._give_until_all_finished()
        if self.rank == 0:
            self._say(f"{self.committed} steps committed and {self.discarded} discarded in "
                      f"{time.monotonic() - self._since:.1f} s: goodput {self.goodput():.2f} steps/s; healed "
                      f"{self.healed} time(s)" + (f", resumed from step {self.resumed_from}"
                                                  if self.resumed_from is not None else ""))
        self._client.close()
        self._group = None


    def _give_until_all_finished(self) -> None:
        deadline = time.monotonic() + self.quorum_timeout.total_seconds()
        while (left := deadline - time.monotonic()) > 0:
            self._asked += 1
            try:
                quorum = self._client.linger(f"{self._nonce:x}.{self._asked}", self._step, timedelta(seconds=left))
            except TimeoutError:
                self._say(f"left at step {self._step} after quorum_timeout: a live group had not finished")
                return
            if quorum is None:
                return
            self._error = None
            self._join(quorum)
            if self._group is not None:
                try:
                    self._heal(quorum)
                except _comm.ReplicaError as exc:
                    self._say(f"could not give this group's state in quorum {quorum.quorum_id}: {exc}")
            self._group = None
