"""torchtitan 0.3's own `Trainer` training its Llama 3 debug model, parallelized by shardwise.

    pip install torchtitan==0.3.0 triton          # torchtitan is not a shardwise dependency
    torchrun --nproc-per-node 4 examples/torchtitan_trainer/train.py --out /tmp/run

`--spec torchtitan` runs the same trainer with torchtitan's own parallelize function (torch's
DTensor and FSDP2), so the two can be compared step for step; `--seed-checkpoint` (one
process) writes the initial weights both load, as torchtitan's docs do for reproducible
runs. The run is torchtitan's `llama3_debugmodel` config unchanged except for what a CPU run
needs: a short sequence and batch, the attention backend (CPU has no FlexAttention
backward, so causal SDPA), float32, no CUDA graphs.
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cpu import gloo_sum_reduction, use_cpu  # noqa: E402
from data import make_assets  # noqa: E402


def build_config(args):
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    config = llama3_debugmodel()
    for _, _, parent, attr in list(config.model_spec.model.traverse(FlexAttention.Config)):
        setattr(parent, attr, ScaledDotProductAttention.Config())
    tokenizer_dir, text_dir = make_assets(os.path.join(args.out, "assets"))
    config.hf_assets_path, config.dataloader.dataset_path = tokenizer_dir, text_dir
    config.dump_folder = args.out
    config.training.seq_len, config.training.local_batch_size, config.training.steps = 64, 2, args.steps
    config.training.disable_cuda_graphs = True
    config.training.mixed_precision_param = "float32"
    config.parallelism.spmd_backend = "partial_dtensor"
    config.parallelism.data_parallel_shard_degree = args.dp_shard
    config.parallelism.tensor_parallel_degree = args.tp
    if args.max_norm is not None:
        config.training.max_norm = args.max_norm
    config.validator.enable = False
    config.compile.enable = args.compile
    config.debug.seed = 0
    config.metrics.enable_tensorboard = False
    config.checkpoint.enable = bool(args.seed_checkpoint or args.initial_load or args.save_every)
    config.checkpoint.create_seed_checkpoint = args.seed_checkpoint
    config.checkpoint.initial_load_path = args.initial_load
    config.checkpoint.interval = args.save_every or 10**6
    config.checkpoint.last_save_model_only = False
    if args.spec == "shardwise":
        from shardwise_spec import llama3_spec
        config.model_spec = llama3_spec(config.model_spec)
    else:
        config.model_spec.parallelize_fn = gloo_sum_reduction(config.model_spec.parallelize_fn)
    return config


def record_metrics(path):
    """Keep each logged step's loss and gradient norm, written as JSON by rank 0 at exit."""
    from torchtitan.components.metrics import MetricsProcessor

    steps, log = [], MetricsProcessor.log

    def logged(self, step, global_avg_loss, global_max_loss, grad_norm, *args, **kwargs):
        weight = self.model_parts[0].layers["0"].attention.qkv_linear.wqkv.weight
        layout = f"{type(weight).__module__.split('.')[0]} {list(getattr(weight, 'placements', []))}"
        steps.append({"step": step, "loss": float(global_avg_loss), "grad_norm": float(grad_norm), "layout": layout})
        return log(self, step, global_avg_loss, global_max_loss, grad_norm, *args, **kwargs)

    MetricsProcessor.log = logged
    return lambda: path and torch.distributed.get_rank() == 0 and json.dump(steps, open(path, "w"))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", choices=("shardwise", "torchtitan"), default="shardwise")
    parser.add_argument("--out", required=True)
    parser.add_argument("--dp-shard", type=int, default=2)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seed-checkpoint", action="store_true")
    parser.add_argument("--initial-load", default=None)
    parser.add_argument("--max-norm", type=float, default=None, help="gradient clipping (the config's 1.0 if unset)")
    parser.add_argument("--compile", action="store_true", help="torch.compile each block (torchtitan's compile.enable)")
    parser.add_argument("--save-every", type=int, default=0)
    parser.add_argument("--record", default=None, help="a JSON file for rank 0's losses and grad norms")
    args = parser.parse_args()

    from torchtitan.tools.logging import init_logger

    init_logger()
    use_cpu()
    write = record_metrics(args.record)
    config = build_config(args)
    trainer = config.build()
    try:
        if args.seed_checkpoint:
            trainer.checkpointer.save(curr_step=0, last_step=True)
        else:
            trainer.train()
        write()
    finally:
        trainer.close()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
