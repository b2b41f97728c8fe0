"""A multi-node job rehearsed on one machine: two `shardwise run --nnodes 2` launches form one job.

Each launch is one "node" of 2 processes (`--node-rank 0` and `1`, one rendezvous endpoint on
localhost), as torchrun runs on two hosts. The script builds a `HybridMesh` with the node
boundary on the outer (DCN) dim, turns it into a (replicate, shard) DeviceMesh and trains
an MLP under HSDP (`fully_shard` on that 2-D mesh) for 3 AdamW steps, each rank on its rows
of the batch. Checked: the 4 ranks know which node they are on; the inner (shard) dim's
groups stay inside a node and the outer (replicate) dim's cross them; parameter gathers and
gradient reduce-scatters run on the inner dim only, so only the replicas' gradient sums
cross nodes; and the parameters equal one process's on the whole batch.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = '''
import json, os, sys
import torch
import torch.nn.functional as F
from torch import nn
import shardwise as sw
from shardwise.fsdp import fully_shard
from shardwise.spmd import HybridMesh


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)).double()


hybrid = HybridMesh(ici_mesh_shape=(1, 2), dcn_mesh_shape=(2, 1), axis_names=("replicate", "shard"))
mesh = hybrid.to_device_mesh("cpu")
rank = torch.distributed.get_rank()
g = torch.Generator().manual_seed(1)
x, y = torch.randn(8, 8, generator=g, dtype=torch.float64), torch.randn(8, 8, generator=g, dtype=torch.float64)
ref, sharded = model(), fully_shard(model(), mesh=mesh)
ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01)
opt = torch.optim.AdamW(sharded.parameters(), lr=0.01)
records = []
for step in range(3):
    with sw.comm_log() as log:
        F.mse_loss(sharded(x[2 * rank:2 * rank + 2]), y[2 * rank:2 * rank + 2]).backward()
    records += [(r.op, r.group_size, list(r.mesh_dims)) for r in log]
    opt.step()
    opt.zero_grad()
    F.mse_loss(ref(x), y).backward()
    ref_opt.step()
    ref_opt.zero_grad()
err = max((p.full_tensor() - q).abs().max().item() for p, q in zip(sharded.parameters(), ref.parameters()))
with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
    json.dump({"node": int(os.environ["GROUP_RANK"]), "shard": mesh["shard"].mesh.flatten().tolist(),
               "replicate": mesh["replicate"].mesh.flatten().tolist(), "err": err, "records": records}, f)
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_two_launches_with_nnodes_2_form_one_hsdp_job_with_the_node_boundary_on_the_outer_dim(tmp_path: Path) -> None:
    script = tmp_path / "hsdp.py"
    script.write_text(SCRIPT)
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")
    nodes = [subprocess.Popen([sys.executable, "-m", "shardwise.cli", "run", "-n", "2", "--nnodes", "2", "--node-rank",
                               str(node), "--rdzv-endpoint", f"127.0.0.1:{port}", str(script), str(tmp_path)],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for node in (0, 1)]
    logs = []
    try:
        for proc in nodes:
            logs.append(proc.communicate(timeout=240)[0])
    finally:
        for proc in nodes:
            proc.kill()
    results = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)
               if (tmp_path / f"rank{r}.json").exists()}
    assert sorted(results) == [0, 1, 2, 3], "\n".join(log[-3000:] for log in logs)
    # (gloo may abort a process at exit after its script finished: the results above are what counts)
    for rank, r in results.items():
        assert r["node"] == rank // 2, (rank, r["node"])  # node 0 holds ranks 0 and 1, node 1 ranks 2 and 3
        assert r["shard"] == [2 * r["node"], 2 * r["node"] + 1], (rank, r)  # the inner dim stays in the node
        assert r["replicate"] == [rank % 2, rank % 2 + 2], (rank, r)  # the outer dim crosses nodes
        gathers = [(op, size, dims) for op, size, dims in r["records"] if op in ("all_gather", "reduce_scatter")]
        assert gathers and all(size == 2 and dims == [1] for _, size, dims in gathers), (rank, r["records"])
        crossing = [op for op, _, dims in r["records"] if dims != [1]]
        assert crossing and set(crossing) == {"all_reduce"}, (rank, r["records"])  # only the replicas' gradient sums
        assert r["err"] <= 1e-12, (rank, r["err"])
