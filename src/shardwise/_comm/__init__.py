"""Every collective shardwise issues, in one place: the one door to `torch.distributed`.

A collective is a frozen record (`_collectives`: kind, group, this rank's piece, the
sizes of uneven pieces, its bytes); `run(record, local)` issues it and `start(record,
local)` issues it without waiting (`_door`). Counting (`comm_log`), tracing
(`shardwise.compile`) and anything else that wants to see collectives hook in with
`intercept(Interceptor)`. Background jobs (`run_async`) keep program order on every rank
(`_async`); point-to-point messages (`_p2p`) and bookkeeping exchanges (`_metadata`) go
through the same door. Timeouts are those of the process groups (`collective_timeout()`),
so a rank that dies or disagrees surfaces as an error, not a hang.

| transition on one mesh dim | record | bytes received per rank |
|---|---|---|
| S(d) -> R | `AllGather` | (n-1) * piece |
| S(d) -> S(e) | `AllToAll` (gloo's all_to_all_single) | (n-1)/n * local (exact sizes) |
| P -> R | `AllReduce` | 2(n-1)/n * local (ring) |
| P -> S(d) | `ReduceScatter` | (n-1) * piece |
| several mesh dims at once, no Partial | `AllToAllBoxes` over the whole mesh | exactly what the rank lacks |
"""

from ._async import has_pending, run_async, wait_pending
from ._bucket import BUCKET_BYTES, all_reduce, all_reduce_coalesced, plan_buckets
from ._collectives import AllGather, AllReduce, AllToAll, AllToAllBoxes, Box, Broadcast, Collective, ReduceScatter
from ._door import (
    CommRecord,
    Interceptor,
    Started,
    comm_log,
    intercept,
    must_be_synchronous,
    notify,
    run,
    start,
    suspended,
)
from ._dry import SIMULATION, Simulation, dry_run_number
from ._fault import CollectiveError, checking
from ._metadata import all_gather_ints, broadcast, broadcast_object, gather_over_mesh
from ._p2p import P2PError, P2PRecord, P2PWork, irecv, isend, received, recv, send
from ._replicas import ReplicaError, replica_all_reduce, replica_recv, replica_send
from ._traced import COLLECTIVE, as_node, forget

__all__ = [
    "BUCKET_BYTES",
    "COLLECTIVE",
    "SIMULATION",
    "AllGather",
    "AllReduce",
    "AllToAll",
    "AllToAllBoxes",
    "Box",
    "Broadcast",
    "Collective",
    "CollectiveError",
    "CommRecord",
    "Interceptor",
    "P2PError",
    "P2PRecord",
    "P2PWork",
    "ReplicaError",
    "ReduceScatter",
    "Simulation",
    "Started",
    "all_gather_ints",
    "all_reduce",
    "all_reduce_coalesced",
    "as_node",
    "broadcast",
    "broadcast_object",
    "checking",
    "dry_run_number",
    "comm_log",
    "forget",
    "gather_over_mesh",
    "has_pending",
    "intercept",
    "irecv",
    "received",
    "isend",
    "must_be_synchronous",
    "notify",
    "plan_buckets",
    "recv",
    "replica_all_reduce",
    "replica_recv",
    "replica_send",
    "run",
    "run_async",
    "send",
    "start",
    "suspended",
    "wait_pending",
]
