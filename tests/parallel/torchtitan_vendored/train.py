# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

# Vendored from torchtitan/train.py (Trainer) and torchtitan/components/optimizer.py
# (build_optimizers' optimizer kwargs) at
# https://github.com/pytorch/torchtitan/tree/238fa9953e4aec2a62582121564273d7cbb1e9f1
# shardwise: the part of Trainer.__init__ that builds the parallel dims, seeds, builds the
# model on meta, parallelizes and initializes it, and builds the optimizer, loss and train
# context; forward_backward_step and train_step without their pipeline-parallel branches.
# Cut: process setup (the harness starts gloo), tokenizer and dataloader (the caller passes
# batches), model converters, metrics processor (train_step returns what it would log),
# checkpointer, lr scheduler, validator, gc handler.

import logging
from collections.abc import Iterator
from typing import Any, cast

import torch

from . import dist_utils
from .args import TransformerModelArgs
from .config import JobConfig
from .loss import build_cross_entropy_loss, IGNORE_INDEX
from .model import ModelProtocol, Transformer
from .parallel_dims import device_type, ParallelDims
from .parallelize import parallelize_llama

logger = logging.getLogger("torchtitan")  # shardwise: was torchtitan.tools.logging.logger


# shardwise: from torchtitan/components/optimizer.py build_optimizers (one model part, no
# OptimizersContainer: it steps and zeroes each part's optimizer in turn)
def build_optimizer(model: torch.nn.Module, optimizer_config) -> torch.optim.Optimizer:
    optim_implementation = optimizer_config.implementation
    assert optim_implementation in ["fused", "foreach", "for-loop"]

    fused = optim_implementation == "fused"
    foreach = optim_implementation == "foreach"

    optimizer_kwargs = {
        "lr": optimizer_config.lr,
        "betas": (optimizer_config.beta1, optimizer_config.beta2),
        "eps": optimizer_config.eps,
        "weight_decay": optimizer_config.weight_decay,
        "fused": fused,
        "foreach": foreach,
    }
    optimizer_classes = {
        "Adam": torch.optim.Adam,
        "AdamW": torch.optim.AdamW,
    }
    return optimizer_classes[optimizer_config.name](model.parameters(), **optimizer_kwargs)


class Trainer:
    def __init__(self, job_config: JobConfig, model_args: TransformerModelArgs, world_size: int):
        self.job_config = job_config
        self.device = torch.device(device_type)  # shardwise: was f"{device_type}:{LOCAL_RANK}"

        # shardwise: from Trainer.init_distributed (torch.distributed is already initialized)
        parallelism_config = job_config.parallelism
        self.parallel_dims = parallel_dims = ParallelDims(
            dp_shard=parallelism_config.data_parallel_shard_degree,
            dp_replicate=parallelism_config.data_parallel_replicate_degree,
            cp=parallelism_config.context_parallel_degree,
            tp=parallelism_config.tensor_parallel_degree,
            pp=parallelism_config.pipeline_parallel_degree,
            ep=parallelism_config.expert_parallel_degree,
            etp=parallelism_config.expert_tensor_parallel_degree,
            world_size=world_size,
        )

        if parallel_dims.dp_enabled:
            batch_mesh = parallel_dims.get_mesh("batch")
            batch_degree, batch_rank = batch_mesh.size(), batch_mesh.get_local_rank()
        else:
            batch_degree, batch_rank = 1, 0
        self.batch_degree, self.batch_rank = batch_degree, batch_rank  # shardwise: for the caller's batches

        # Set random seed, and maybe enable deterministic mode
        # (mainly for debugging, expect perf loss).
        dist_utils.set_determinism(
            parallel_dims,
            self.device,
            job_config.debug,
            distinct_seed_mesh_dims=["pp"],
        )

        # build model (using meta init)
        # set the model args from training job configs
        model_args.update_from_config(job_config)
        self.model_args = model_args

        # shardwise: utils.set_default_dtype(TORCH_DTYPE_MAP[job_config.training.dtype]) cut
        # (training.dtype is "float32", torch's default)
        with torch.device("meta"):
            model = Transformer(model_args)

        # move sharded model to CPU/GPU and initialize weights via DTensor
        buffer_device: torch.device | None
        if job_config.training.enable_cpu_offload:
            init_device = "cpu"
            buffer_device = torch.device(device_type)
        else:
            init_device = device_type
            buffer_device = None

        self.loss_fn = build_cross_entropy_loss(job_config, parallel_dims=parallel_dims)

        # calculate gradient accumulation steps
        # shardwise: training.global_batch_size is -1: one step
        self.gradient_accumulation_steps = 1

        # apply PT-D Tensor Parallel, activation checkpointing, torch.compile, Data Parallel
        model = parallelize_llama(model, parallel_dims, job_config)

        model.to_empty(device=init_device)
        with torch.no_grad():
            cast(ModelProtocol, model).init_weights(buffer_device=buffer_device)
        model.train()

        self.model_parts = [model]

        # build optimizer after applying parallelisms to the model
        self.optimizers = [build_optimizer(m, job_config.optimizer) for m in self.model_parts]

        self.step = 0
        self.ntokens_seen = 0

        loss_parallel_enabled = (
            parallel_dims.tp_enabled
            and not job_config.parallelism.disable_loss_parallel
        )
        self.train_context = dist_utils.get_train_context(loss_parallel_enabled)
        self.maybe_enable_amp = dist_utils.maybe_enable_amp(
            parallel_dims,
            job_config.training.mixed_precision_param,
            device_type,
        )

    def post_dataloading_process(
        self, input_dict: dict[str, torch.Tensor], labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor], dict[str, Any]]:
        inputs = input_dict["input"]
        extra_inputs = {k: v for k, v in input_dict.items() if k != "input"}
        # For arguments, like attention_masks, we have to put them in a separate
        # dict as extra_inputs are not forwarded to other stages in PP, but
        # extra_kwargs are.
        extra_kwargs: dict[str, Any] = {}
        # shardwise: flex / varlen attention masks and context parallel inputs cut
        return inputs, labels, extra_inputs, extra_kwargs

    def forward_backward_step(
        self,
        *,
        input_dict: dict[str, torch.Tensor],
        labels: torch.Tensor,
        global_valid_tokens: torch.Tensor,
    ) -> torch.Tensor:
        model_parts = self.model_parts

        inputs, labels, extra_inputs, extra_kwargs = self.post_dataloading_process(
            input_dict, labels
        )

        # shardwise: the pipeline-parallel branch cut
        # Non-PP forward / backward
        assert len(model_parts) == 1
        with self.train_context():
            with self.maybe_enable_amp:
                pred = model_parts[0](inputs, **extra_inputs, **extra_kwargs)
                # Compute loss sum (reduction='sum')
                loss_sum = self.loss_fn(pred, labels)

                # Scale the loss by the inverse of the total weight denominator before backward
                # This ensures gradients are properly normalized across all microbatches
                loss = loss_sum / global_valid_tokens

            # need to free pred before bwd to avoid peaking memory
            del pred
            loss.backward()

        # The returned loss here is local SUM loss / global_valid_tokens
        return loss

    def train_step(
        self, data_iterator: Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]
    ):
        for optimizer in self.optimizers:  # shardwise: was self.optimizers.zero_grad()
            optimizer.zero_grad()

        # Keep these variables local to shorten the code as these are
        # the major variables that are used in the training loop.
        parallel_dims = self.parallel_dims

        # Collect all microbatches on CPU and count total valid tokens
        microbatches = []
        local_valid_tokens = torch.tensor(0, dtype=torch.int64)
        for _microbatch in range(self.gradient_accumulation_steps):
            input_dict, labels = next(data_iterator)
            self.ntokens_seen += labels.numel()  # shardwise: from batch_generator
            local_valid_tokens += (labels != IGNORE_INDEX).sum()
            microbatches.append((input_dict, labels))

        # All-reduce to get global token count across DP ranks
        # Move to GPU for distributed communication
        local_valid_tokens = local_valid_tokens.to(self.device)
        if parallel_dims.dp_enabled:
            batch_mesh = parallel_dims.get_mesh("batch")
            global_valid_tokens = dist_utils.dist_sum(local_valid_tokens, batch_mesh)
        else:
            global_valid_tokens = local_valid_tokens.float()

        # Process each microbatch: move to GPU, forward/backward, then free
        accumulated_losses = []
        for input_dict, labels in microbatches:
            # Move tensors to GPU
            for k, v in input_dict.items():
                if isinstance(v, torch.Tensor):
                    input_dict[k] = v.to(self.device)
            labels = labels.to(self.device)

            loss = self.forward_backward_step(
                input_dict=input_dict,
                labels=labels,
                # pyrefly: ignore [bad-argument-type]
                global_valid_tokens=global_valid_tokens,
            )
            accumulated_losses.append(loss.detach())

        grad_norm = dist_utils.clip_grad_norm_(
            [p for m in self.model_parts for p in m.parameters()],
            self.job_config.training.max_norm,
            foreach=True,
            pp_mesh=parallel_dims.get_optional_mesh("pp"),
            ep_enabled=parallel_dims.ep_enabled,
        )
        for optimizer in self.optimizers:  # shardwise: was self.optimizers.step()
            optimizer.step()
        self.step += 1  # shardwise: from Trainer.train

        # Reduce the data collected over gradient accumulation steps.
        loss = torch.sum(torch.stack(accumulated_losses))

        # log metrics
        if parallel_dims.dp_cp_enabled:
            loss = loss.detach()
            loss_mesh = parallel_dims.get_optional_mesh("loss")

            # For global_avg_loss, we want the average loss across all ranks:
            # loss = local_loss_sum / global_valid_tokens
            # global_avg_loss = sum(local_loss_sum) / global_valid_tokens
            #                 = sum(loss)
            #
            # For global_max_loss, we want the max of local average losses across ranks:
            # local_avg_loss = local_loss_sum / local_valid_tokens
            #                = (loss * global_valid_tokens) / local_valid_tokens
            # global_max_loss = max(local_avg_loss)
            local_avg_loss = loss * global_valid_tokens / local_valid_tokens
            global_avg_loss, global_max_loss, global_ntokens_seen = (
                dist_utils.dist_sum(loss, loss_mesh),
                dist_utils.dist_max(local_avg_loss, loss_mesh),
                dist_utils.dist_sum(
                    torch.tensor(
                        self.ntokens_seen, dtype=torch.int64, device=self.device
                    ),
                    loss_mesh,
                ),
            )
        else:
            global_avg_loss = global_max_loss = loss.detach().item()
            global_ntokens_seen = self.ntokens_seen

        # shardwise: returned instead of self.metrics_processor.log(...)
        return global_avg_loss, global_max_loss, grad_norm.item(), global_ntokens_seen
