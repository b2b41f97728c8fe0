"""torchtitan's Llama 3 FSDP x TP training step with only its imports switched to shardwise
(issue 50): its loss, logged loss and parameters equal one process's.

The torchtitan files run from a vendored copy (`torchtitan_vendored`, commit and edits noted
there): the Llama 3 model, `parallelize_llama` (`apply_tp` with its Colwise / Rowwise /
Sequence-parallel plan and loss parallel on the output, per-layer selective activation
checkpointing, `apply_fsdp` with `MixedPrecisionPolicy` and the default reshard policy, its
gradient division turned off), `ParallelDims` (the world mesh unflattened into its
dataloading / dense / sparse meshes, the loss mesh flattened), `set_determinism`, the
trainer's `train_step` (global valid-token count by `dist_sum`, the loss under
`torch.distributed.tensor.parallel.loss_parallel()`, `clip_grad_norm_`, AdamW fused, the
logged `dist_sum` / `dist_max` over the loss mesh by torch's functional collectives with
`group=mesh`). On 4 gloo ranks, dp_shard = 2 x tp = 2, the debug model (2 layers, float32):
3 steps equal the same model, unsharded, trained in one process on the whole batch.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

import shardwise as sw
from shardwise.testing import distributed

from .torchtitan_vendored import activation_checkpoint
from .torchtitan_vendored.args import llama3_args
from .torchtitan_vendored.config import JobConfig
from .torchtitan_vendored.dist_utils import clip_grad_norm_
from .torchtitan_vendored.loss import cross_entropy_loss, IGNORE_INDEX
from .torchtitan_vendored.model import Transformer
from .torchtitan_vendored.train import build_optimizer, Trainer

STEPS, LOCAL_BATCH, SEQ_LEN, DP, TP = 3, 2, 32, 2, 2
RTOL = 1e-5  # float32: a sum split over ranks rounds differently from the whole


def _job_config() -> JobConfig:
    """torchtitan's debug_model.toml, with a short sequence and small batch, float32 parameters
    (its default is bfloat16), a fixed seed and the (dp_shard, tp) = (2, 2) mesh."""
    job = JobConfig()
    job.training.local_batch_size, job.training.seq_len = LOCAL_BATCH, SEQ_LEN
    job.training.mixed_precision_param = "float32"
    job.parallelism.data_parallel_shard_degree, job.parallelism.tensor_parallel_degree = -1, TP
    job.debug.seed = 3  # (its default, None, seeds every rank with rank 0's unseeded draw)
    return job


def _batches(vocab: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The global batch of every step: inputs and next-token labels, a different number of
    labels ignored in each data-parallel piece (so each piece's mean loss differs)."""
    g = torch.Generator().manual_seed(7)
    out = []
    for step in range(STEPS):
        tokens = torch.randint(0, vocab, (LOCAL_BATCH * DP, SEQ_LEN + 1), generator=g)
        labels = tokens[:, 1:].clone()
        labels[0, : 3 + step] = IGNORE_INDEX
        labels[LOCAL_BATCH, : 9 + 2 * step] = IGNORE_INDEX
        out.append((tokens[:, :-1].contiguous(), labels))
    return out


def _one_process(model: Any, job: JobConfig, batches: list[tuple[torch.Tensor, torch.Tensor]]
                 ) -> tuple[list[tuple[float, float, float]], list[list[torch.Tensor]], list[torch.Tensor]]:
    """The same steps on the unsharded model, whole batches: (mean loss, the largest data-parallel
    piece's mean loss, grad norm) and the clipped gradients per step, and the final parameters."""
    optimizer = build_optimizer(model, job.optimizer)
    logged, grads = [], []
    for inputs, labels in batches:
        optimizer.zero_grad()
        valid = (labels != IGNORE_INDEX).sum()
        pred = model(inputs)
        loss = cross_entropy_loss(pred, labels) / valid.float()
        loss.backward()
        pieces = [slice(i * LOCAL_BATCH, (i + 1) * LOCAL_BATCH) for i in range(DP)]
        with torch.no_grad():
            piece_means = [cross_entropy_loss(pred[s], labels[s]) / (labels[s] != IGNORE_INDEX).sum() for s in pieces]
        norm = clip_grad_norm_(list(model.parameters()), job.training.max_norm, foreach=True)
        grads.append([p.grad.clone() for p in model.parameters()])
        optimizer.step()
        logged.append((loss.item(), max(m.item() for m in piece_means), norm.item()))
    return logged, grads, [p.detach() for p in model.parameters()]


@distributed(world_size=4, timeout=180)  # about 25 s alone; headroom for a loaded machine
def test_torchtitans_llama3_fsdp_x_tp_step_with_its_imports_switched_trains_as_one_process() -> None:
    job = _job_config()
    model_args = dataclasses.replace(llama3_args["debugmodel"], n_layers=2)
    activation_checkpoint._layer_sac_count = 0  # torchtitan's module-level count (a worker runs many tests)
    trainer = Trainer(job, dataclasses.replace(model_args), world_size=4)
    model = trainer.model_parts[0]

    # torchtitan's layouts on the dense (fsdp, tp) mesh: FSDP's Shard(0) beside TP's placement
    wq = model.layers["0"].attention.wq.weight
    assert isinstance(wq, sw.DTensor) and wq.device_mesh.mesh_dim_names == ("fsdp", "tp")
    assert [str(p) for p in wq.placements] == ["S(0)", "S(0)"]
    assert [str(p) for p in model.layers["1"].attention.wo.weight.placements] == ["S(0)", "S(1)"]
    assert [str(p) for p in model.norm.weight.placements] == ["S(0)", "R"]
    # selective AC, every 2nd layer
    assert isinstance(model.layers["1"], CheckpointWrapper) and not isinstance(model.layers["0"], CheckpointWrapper)
    # the loss is computed on logits sharded over the vocabulary (loss parallel)
    logits: list[Any] = []
    model.output.register_forward_hook(lambda m, a, out: logits.append(out))

    initial = [p.full_tensor() for p in model.parameters()]  # as torchtitan's init_weights drew them, sharded
    batches = _batches(model_args.vocab_size)
    rows = slice(trainer.batch_rank * LOCAL_BATCH, (trainer.batch_rank + 1) * LOCAL_BATCH)
    mine = iter([({"input": inputs[rows]}, labels[rows]) for inputs, labels in batches])
    got, got_grads = [], []
    for _ in range(STEPS):
        got.append(trainer.train_step(mine))
        got_grads.append([p.grad.full_tensor() for p in model.parameters()])
    assert isinstance(logits[0], sw.DTensor) and [str(p) for p in logits[0].placements] == ["S(2)"]

    reference = Transformer(trainer.model_args)  # (update_from_config set max_seq_len to seq_len)
    with torch.no_grad():
        for p, q in zip(reference.parameters(), initial):
            p.copy_(q)
    want, want_grads, want_params = _one_process(reference, job, batches)
    # the steps differ, and the largest piece's loss is not the mean
    assert want[0][0] != want[1][0] and want[0][1] > want[0][0]
    names = [n.replace("_checkpoint_wrapped_module.", "") for n, _ in model.named_parameters()]
    assert names == [n for n, _ in reference.named_parameters()]
    for step, ((avg, worst, norm, ntokens), (avg1, worst1, norm1)) in enumerate(zip(got, want)):
        assert abs(avg - avg1) <= RTOL * abs(avg1), (step, avg, avg1)
        assert abs(worst - worst1) <= RTOL * abs(worst1), (step, worst, worst1)
        # each rank's piece's norm, then the root of their squares' sum (as torch's DTensor): torch's
        # float32 CPU norm kernel is itself off by up to ~1e-4 on a tensor of this size, and the
        # one process and the pieces round apart (the sum of squares agrees to ~1e-7)
        assert abs(norm - norm1) <= 20 * RTOL * abs(norm1), (step, norm, norm1)
        assert ntokens == (step + 1) * LOCAL_BATCH * DP * SEQ_LEN
        # float32 sums in another order: errors relative to the gradient's scale, not each
        # element's; from step 1 on, also through the parameters' differences (below)
        scale = RTOL if step == 0 else 10 * RTOL
        # the gradients were clipped by max_norm / norm: compared as clipped by the same norm
        # (the norms' own rounding is checked above)
        same_clip = min(1.0, job.training.max_norm / (norm1 + 1e-6)) / min(1.0, job.training.max_norm / (norm + 1e-6))
        for name, g, g1 in zip(names, got_grads[step], want_grads[step]):
            torch.testing.assert_close(g * same_clip, g1, rtol=RTOL, atol=scale * g1.abs().max().item(),
                                       msg=lambda m: f"step {step}, {name}.grad: {m}")
    for name, p, q in zip(names, want_params, model.parameters()):
        _assert_adamw_close(name, q.full_tensor(), p, job.optimizer.lr)


def _assert_adamw_close(name: str, got: torch.Tensor, want: torch.Tensor, lr: float) -> None:
    """Parameters after AdamW steps equal within float32 rounding, but for a few elements:
    AdamW moves an element by about lr whatever its gradient's size (g / (|g| + eps)), so an
    element whose gradient is float32 noise (|g| near eps = 1e-8) may move differently, by at
    most lr a step. A layout or reduction error moves many elements, by far more than rounding."""
    off = (got - want).abs() > 1e-6 + RTOL * want.abs()
    assert off.sum().item() <= max(2, want.numel() // 10_000), f"{name}: {off.sum().item()} of {want.numel()} differ"
    assert (got - want).abs().max().item() <= lr * STEPS, f"{name}: {(got - want).abs().max().item()}"
