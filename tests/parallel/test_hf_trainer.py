"""A `transformers.Trainer` script (accelerate underneath) fine-tuning a model shardwise sharded.

One script, `_train`: a small Llama from a config (float32, fixed seeds), 64 samples of 16 tokens,
4 optimizer steps of gradient accumulation 2, `max_grad_norm=1.0` (active: the norms are 1.6-1.9),
linear learning-rate decay, an evaluation every 2 steps, a checkpoint every 2 steps, `save_model`
at the end. It runs on 4 gloo ranks:

- under accelerate's own FSDP2 (`fsdp_config={"fsdp_version": 2}`, torch's `fully_shard` on each
  decoder layer and the root): the reference. accelerate turns FSDP on only for accelerator devices
  (its state keeps `MULTI_CPU` on CPU whatever the plugin), so `_AccelerateFSDP2Trainer` sets, after
  the Accelerator is made, the state a GPU run gets from the same arguments (distributed type FSDP,
  the plugin the Trainer built); the rest is accelerate's and transformers' own code. It does not
  save (its full-state-dict save reads torch DTensors' storage on CPU and fails: the comparison
  needs only its losses);
- with the model sharded by shardwise (`fully_shard` over dp = 4, and `parallelize_module(...,
  HFPlanner())` over tp = 2 with `fully_shard` over dp = 2), trained by
  `class Trainer(HFTrainerMixin, transformers.Trainer)`.

The logged losses, gradient norms and evaluation losses equal the reference to float32 rounding
(dp: the losses bit for bit; dp x tp: tp splits sums, ~1e-6 relative). A run resumed from the step-2
checkpoint logs what the uninterrupted run logged and ends with the same parameters, and the model
`save_model` wrote loads in one process with `from_pretrained` as the trained parameters.
TrainingArguments that would have accelerate shard the model again (`fsdp=`) are refused.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

import shardwise as sw
from shardwise.fsdp import fully_shard
from shardwise.parallel import HFPlanner, HFTrainerMixin, parallelize_module
from shardwise.testing import run_distributed

transformers = pytest.importorskip("transformers")  # test dependencies (pyproject's [test] extra)
accelerate = pytest.importorskip("accelerate")

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=32, initializer_range=0.2)
GLOBAL_BATCH = 8  # samples per micro-batch over all data-parallel ranks
LOGGED = ("loss", "grad_norm", "eval_loss", "learning_rate")


class Trainer(HFTrainerMixin, transformers.Trainer):
    """The documented way: the mixin before transformers' Trainer."""


class _AccelerateFSDP2Trainer(transformers.Trainer):
    """transformers' Trainer with accelerate's FSDP2 switched on on CPU (see the module docstring)."""

    def create_accelerator_and_postprocess(self) -> None:
        from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

        super().create_accelerator_and_postprocess()
        self.accelerator.state.distributed_type = DistributedType.FSDP
        self.accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
        self.is_fsdp_enabled = True


def _model() -> Any:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL))


def _samples(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(0, SMALL["vocab_size"], (n, 16), generator=torch.Generator().manual_seed(seed))
    return [{"input_ids": row, "labels": row} for row in ids]


def _args(out: str, data_ranks: int, **extra: Any) -> Any:
    return transformers.TrainingArguments(
        out, per_device_train_batch_size=GLOBAL_BATCH // data_ranks, per_device_eval_batch_size=16 // data_ranks,
        gradient_accumulation_steps=2, max_grad_norm=1.0, max_steps=4, learning_rate=1e-2, seed=0,
        logging_steps=1, eval_strategy="steps", eval_steps=2, save_steps=2, report_to=[], use_cpu=True,
        disable_tqdm=True, **extra)


def _train(trainer_cls: type, model: Any, out: str, data_ranks: int, resume: Any = None, **kwargs: Any
           ) -> tuple[Any, list[tuple[int, str, float]]]:
    """The script: train, evaluate, checkpoint (and resume); returns the trainer and its logged curve."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)  # accelerate's singletons outlive a Trainer
    GradientState._reset_state()
    environ = dict(os.environ)
    try:
        extra = kwargs.pop("args", {})
        trainer = trainer_cls(model=model, args=_args(out, data_ranks, **extra), train_dataset=_samples(64, 1),
                              eval_dataset=_samples(16, 2), **kwargs)
        trainer.train(resume_from_checkpoint=resume)
    finally:
        os.environ.clear()
        os.environ.update(environ)
    curve = [(entry["step"], key, float(entry[key])) for entry in trainer.state.log_history
             for key in LOGGED if key in entry]
    return trainer, curve


def _accelerate_fsdp2(out: str) -> list[tuple[int, str, float]]:
    fsdp = {"fsdp": "full_shard", "save_strategy": "no",
            "fsdp_config": {"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
                            "reshard_after_forward": True}}
    trainer, curve = _train(_AccelerateFSDP2Trainer, _model(), out, 4, args=fsdp)
    assert type(trainer.model).__module__.startswith("torch.distributed.fsdp")  # accelerate sharded it
    return curve


def _sharded(mesh_shape: tuple[int, ...]) -> tuple[Any, Any]:
    model = _model()
    if len(mesh_shape) == 1:
        mesh = sw.init_device_mesh("cpu", mesh_shape, mesh_dim_names=("dp",))
        dp = mesh
    else:
        mesh = sw.init_device_mesh("cpu", mesh_shape, mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], HFPlanner())
        dp = mesh["dp"]
    for layer in model.model.layers:
        fully_shard(layer, mesh=dp)
    fully_shard(model, mesh=dp)
    return model, mesh


def _full(model: Any) -> dict[str, torch.Tensor]:
    return {name: (p.full_tensor() if isinstance(p, sw.DTensor) else p).detach().clone()
            for name, p in model.named_parameters()}


def _shardwise(out: str, mesh_shape: tuple[int, ...]) -> dict[str, Any]:
    """Train uninterrupted, save the model, resume a fresh model from the step-2 checkpoint."""
    import torch.distributed as dist

    data_ranks = mesh_shape[0]
    model, mesh = _sharded(mesh_shape)
    trainer, curve = _train(Trainer, model, out, data_ranks, mesh=mesh)
    assert trainer.model_wrapped is model, f"accelerate wrapped the model: {type(trainer.model_wrapped)}"
    trainer.save_model(os.path.join(out, "final"))
    trained = _full(model)

    again, _ = _sharded(mesh_shape)
    _, resumed = _train(Trainer, again, os.path.join(out, "resumed"), data_ranks, mesh=mesh,
                        resume=os.path.join(out, "checkpoint-2"))
    assert all(torch.equal(p, trained[name]) for name, p in _full(again).items()), "resumed parameters differ"

    dist.barrier()
    saved = {}
    if dist.get_rank() == 0:
        loaded = transformers.LlamaForCausalLM.from_pretrained(os.path.join(out, "final"))
        saved = {name: p.detach() for name, p in loaded.named_parameters()}
    return {"curve": curve, "resumed": resumed, "trained": trained, "saved": saved}


def _check_against(reference: list[tuple[int, str, float]], got: dict[str, Any], rtol: float) -> None:
    curve = got["curve"]
    assert [c[:2] for c in curve] == [r[:2] for r in reference]
    assert any(key == "grad_norm" and value > 1.0 for _, key, value in curve), "clipping was never active"
    torch.testing.assert_close(torch.tensor([c[2] for c in curve], dtype=torch.float64),
                               torch.tensor([r[2] for r in reference], dtype=torch.float64), rtol=rtol, atol=0)
    # the resumed run restores steps 1-2 from the checkpoint's trainer state and logs steps 3-4 itself
    assert got["resumed"] == curve, "the resumed run logged otherwise than the uninterrupted one"
    assert got["saved"].keys() == got["trained"].keys()
    for name, p in got["trained"].items():
        assert torch.equal(got["saved"][name], p), f"save_model wrote another {name}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[int, str, float]]:
    out = str(tmp_path_factory.mktemp("accelerate_fsdp2"))
    curves = run_distributed(_accelerate_fsdp2, 4, out)
    assert all(c == curves[0] for c in curves)
    return curves[0]  # type: ignore[no-any-return]


def test_trainer_on_a_fully_sharded_model_logs_accelerates_fsdp2_curve_and_resumes_exactly(
        reference: list[tuple[int, str, float]], tmp_path: Any) -> None:
    got = run_distributed(_shardwise, 4, str(tmp_path), (4,))
    _check_against(reference, got[0], rtol=1e-6)  # the same sums in the same order: equal but for clipping's norm


def test_trainer_on_a_tensor_parallel_and_fully_sharded_model_logs_accelerates_fsdp2_curve(
        reference: list[tuple[int, str, float]], tmp_path: Any) -> None:
    got = run_distributed(_shardwise, 4, str(tmp_path), (2, 2))
    _check_against(reference, got[0], rtol=1e-5)  # tp splits the matmuls' sums: float32 rounding


def test_the_mixin_refuses_training_arguments_that_would_shard_the_model_again(tmp_path: Any) -> None:
    args = transformers.TrainingArguments(str(tmp_path), use_cpu=True, report_to=[], fsdp=True,
                                          fsdp_config={"fsdp_version": 2})
    with pytest.raises(ValueError, match=r"shard it again \(fsdp=True\): drop those arguments"):
        Trainer(model=_model(), args=args)
