"""Push trained weights to an inference mesh every step. Run: shardwise run -n 6 examples/weight_sync.py

Ranks 0-3 train an MLP on a (dp, tp) = (2, 2) mesh (Megatron's cuts over tp, the batch split
over dp); ranks 4 and 5 serve it on a mesh of their own, in another layout (every weight
split by columns). After each step each weight moves
with `redistribute(device_mesh=inference_mesh, ...)`: the two replicas of every training
piece share the sending, and each inference rank receives exactly its pieces, no more (the
lower bound, printed next to what arrived). At the end the inference model's output on a
batch equals the training model's.
"""

import os

import torch
import torch.distributed as dist
from torch import nn

import shardwise as sw
from shardwise import DeviceMesh, Replicate, Shard, comm_log
from shardwise._comm import P2PRecord

STEPS = 3
R = Replicate()
# Megatron's cuts on the training mesh (replicated over dp, split over tp) and a column split for serving
TRAIN = {"0.weight": [R, Shard(0)], "0.bias": [R, Shard(0)], "2.weight": [R, Shard(1)], "2.bias": [R, R]}
SERVE = {"0.weight": [Shard(1)], "0.bias": [Shard(0)], "2.weight": [Shard(1)], "2.bias": [Shard(0)]}


def _model(mesh: DeviceMesh, layouts: dict) -> nn.Sequential:
    """The MLP with every parameter a DTensor on `mesh` (a rank outside it holds nothing)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
    for name, p in list(model.named_parameters()):
        layer, attr = name.split(".")
        setattr(model[int(layer)], attr, nn.Parameter(sw.distribute_tensor(p.detach(), mesh, layouts[name])))
    return model


def main() -> None:
    if int(os.environ.get("WORLD_SIZE", "1")) != 6:
        raise SystemExit("weight_sync.py needs 6 processes: shardwise run -n 6 examples/weight_sync.py")
    sw.init_device_mesh("cpu", (6,))  # the process group (every rank builds every mesh, in the same order)
    train_mesh = DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("dp", "tp"))
    serve_mesh = DeviceMesh("cpu", [4, 5], mesh_dim_names=("tp",))
    rank = dist.get_rank()
    training = train_mesh.get_coordinate() is not None
    model, served = _model(train_mesh, TRAIN), _model(serve_mesh, SERVE)  # every rank builds both
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))

    for step in range(STEPS):
        if training:  # the batch split over dp, each replica its half
            optimizer.zero_grad()
            model(sw.distribute_tensor(x, train_mesh, [Shard(0), R])).pow(2).mean().backward()
            optimizer.step()
        received = bound = 0
        with torch.no_grad(), comm_log() as records:
            for p, q in zip(model.parameters(), served.parameters()):
                moved = p.redistribute(serve_mesh, q.placements)  # every rank of either mesh calls it
                if not training:
                    q.to_local().copy_(moved.to_local())
                    bound += q.to_local().numel() * q.element_size()  # its pieces: held nothing before
        received = sum(r.bytes_received for r in records if isinstance(r, P2PRecord))
        if not training:
            print(f"step {step}: rank {rank} received {received} B of weights (lower bound {bound} B)", flush=True)
            assert received == bound

    with torch.no_grad():  # the served model computes what the trained one does
        want = model(sw.distribute_tensor(x, train_mesh, [R, R])).full_tensor() if training else None
        out = served(sw.distribute_tensor(x, serve_mesh, [R])).full_tensor() if not training else None
    check = want if rank == 0 else torch.zeros(8, 16)
    dist.broadcast(check, src=0)
    if not training:
        same = torch.allclose(out, check, atol=1e-6)
        print(f"rank {rank}: the served model's output equals the trained model's: {same}", flush=True)
        assert same
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
