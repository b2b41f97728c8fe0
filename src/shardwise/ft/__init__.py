"""Per-step fault tolerance across replica groups (torchft's API, on shardwise): `shardwise.ft`.

Replica groups are separate launches of the same program, each with its own world (and
anything inside it: `fully_shard`, TP, CP, pipelines). A `Lighthouse` hosts the quorum
service on torch.distributed's own `TCPStore`; each group's `Manager` joins a quorum every
step, heals from a live group when it is behind, and commits a step only when every member
succeeded. A group that fails leaves the quorum, the others go on, and the group, restarted
alone, heals from a live peer instead of a checkpoint.

    manager = shardwise.ft.Manager(load_state_dict=load, state_dict=save)
    model = shardwise.ft.DistributedDataParallel(manager, model)
    optimizer = shardwise.ft.Optimizer(manager, torch.optim.AdamW(model.parameters()))
    for batch in data:
        optimizer.zero_grad()          # the step's quorum (and healing)
        loss_fn(model(batch)).backward()  # gradients averaged over the live groups
        optimizer.step()               # applied only if every group committed

Semi-synchronous on the same machinery: `LocalSGD` and `DiLoCo` meet every `sync_every`
steps instead of every step.
"""

from ._device_mesh import ft_init_device_mesh
from ._lighthouse import Lighthouse
from ._manager import Manager
from ._quorum import Quorum, QuorumRule
from ._sampler import ReplicaSampler
from ._semisync import DiLoCo, LocalSGD
from ._wrappers import DistributedDataParallel, Optimizer

__all__ = ["DiLoCo", "DistributedDataParallel", "Lighthouse", "LocalSGD", "Manager", "Optimizer", "Quorum", "QuorumRule",
           "ReplicaSampler", "ft_init_device_mesh"]
