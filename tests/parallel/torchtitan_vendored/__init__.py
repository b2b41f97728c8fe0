"""The few torchtitan files its Llama 3 FSDP x TP training step needs, with only the imports
switched from torch's DTensor / FSDP2 / DeviceMesh to shardwise's (issue 50).

Source: https://github.com/pytorch/torchtitan at commit
238fa9953e4aec2a62582121564273d7cbb1e9f1 (2026-02-23, "fix varlen op saving for simple fsdp
(#2396)"), the last commit with the `models/llama3/{model,infra}` layout, before the config
system refactor (#2386) moved the plans into `spmd_types` sharding configs. BSD 3-Clause
License, Copyright (c) Meta Platforms, Inc. and affiliates: see LICENSE beside this file.

| file here                  | torchtitan file                                                   |
|----------------------------|-------------------------------------------------------------------|
| `args.py`                  | torchtitan/models/llama3/model/args.py, protocols/model.py         |
| `model.py`                 | torchtitan/models/llama3/model/model.py, models/attention.py, models/utils.py, protocols/model.py |
| `parallelize.py`           | torchtitan/models/llama3/infra/parallelize.py                      |
| `activation_checkpoint.py` | torchtitan/distributed/activation_checkpoint.py                    |
| `parallel_dims.py`         | torchtitan/distributed/parallel_dims.py                            |
| `dist_utils.py`            | torchtitan/distributed/utils.py                                    |
| `loss.py`                  | torchtitan/components/loss.py                                      |
| `config.py`                | torchtitan/config/job_config.py, config/__init__.py                |
| `train.py`                 | torchtitan/train.py (Trainer.forward_backward_step, train_step), components/optimizer.py |

Edits are marked `# shardwise:`. The imports are switched: `torch.distributed.tensor` ->
`shardwise`, `torch.distributed.tensor.parallel` -> `shardwise.parallel`,
`torch.distributed.fsdp` (and `torch.distributed._composable.fsdp`) -> `shardwise.fsdp`,
`torch.distributed.device_mesh` -> `shardwise`. What torchtitan calls by full path stays so:
`torch.distributed._functional_collectives` with `group=mesh`,
`torch.distributed.tensor.parallel.loss_parallel()`,
`torch.distributed.tensor._random.manual_seed(seed, mesh)`. Cut: the code paths the default
debug config does not take and that need further files (flex / varlen attention, float8,
torch.compile, context parallel, pipeline parallel, DDP, expert parallel, op-level selective
activation checkpointing, the metrics, checkpoint and data loading machinery); what is left
runs as torchtitan runs it.
"""
