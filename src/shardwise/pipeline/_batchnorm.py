"""`DeferredBatchNorm`: batch norm whose running statistics are those of the whole mini-batch.

Under a pipeline a batch-norm layer sees micro-batches, and plain `BatchNorm` would
update its running mean and variance once per micro-batch, from micro-batch
statistics: `chunks` updates per step, each with a noisier estimate. `DeferredBatchNorm`
normalises each micro-batch with that micro-batch's statistics, exactly as `BatchNorm`
does in training, but only *accumulates* the statistics (count, mean and sum of
squared deviations, merged exactly) and commits one running-statistics update per
mini-batch, after its `chunks`-th micro-batch. The result equals a plain `BatchNorm`
run on the full batch: same running mean, same (unbiased) running variance, same
`num_batches_tracked`. Recomputation (checkpointing) is not counted twice.

>>> import torch
>>> bn, deferred = torch.nn.BatchNorm1d(3), DeferredBatchNorm(3, chunks=2)
>>> x = torch.randn(8, 3, 5)
>>> _ = bn(x); _ = deferred(x[:4]); _ = deferred(x[4:])
>>> torch.allclose(bn.running_var, deferred.running_var), int(deferred.num_batches_tracked)
(True, 1)
"""

from __future__ import annotations

from typing import Optional, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from ._checkpoint import is_recomputing

__all__ = ["DeferredBatchNorm"]

M = TypeVar("M", bound=nn.Module)


class DeferredBatchNorm(_BatchNorm):
    """Batch norm over micro-batches that updates running statistics once per `chunks` of them."""

    sum_count: Tensor
    sum_mean: Tensor
    sum_m2: Tensor

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: Optional[float] = 0.1,
                 affine: bool = True, chunks: int = 1) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats=True)
        if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
            raise ValueError(f"DeferredBatchNorm needs chunks >= 1 (micro-batches per mini-batch), got {chunks!r}")
        self.chunks = chunks
        self.tracked = 0
        # Running merge of this mini-batch's micro-batch statistics (Chan et al.).
        self.register_buffer("sum_count", torch.zeros(()), persistent=False)
        self.register_buffer("sum_mean", torch.zeros(num_features), persistent=False)
        self.register_buffer("sum_m2", torch.zeros(num_features), persistent=False)

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"DeferredBatchNorm expects input of shape (N, C, ...), got {input.dim()}-D input "
                             f"of shape {tuple(input.shape)}")

    def _track(self, input: Tensor) -> None:
        with torch.no_grad():
            dims = [d for d in range(input.dim()) if d != 1]
            x = input.detach().to(self.sum_mean.dtype)
            n = x.numel() // x.shape[1]
            mean = x.mean(dims)
            m2 = ((x - mean.view(1, -1, *([1] * (x.dim() - 2)))) ** 2).sum(dims)
            total = self.sum_count + n
            delta = mean - self.sum_mean
            self.sum_m2 += m2 + delta**2 * (self.sum_count * n / total)
            self.sum_mean += delta * (n / total)
            self.sum_count.fill_(total)
        self.tracked += 1
        if self.tracked == self.chunks:
            self._commit()

    def _commit(self) -> None:
        assert self.running_mean is not None and self.running_var is not None
        assert self.num_batches_tracked is not None
        with torch.no_grad():
            self.num_batches_tracked += 1
            m = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
            n = float(self.sum_count)
            var = self.sum_m2 / max(n - 1.0, 1.0)  # unbiased, as BatchNorm's running_var
            self.running_mean.mul_(1 - m).add_(self.sum_mean, alpha=m)
            self.running_var.mul_(1 - m).add_(var, alpha=m)
            self.sum_count.zero_()
            self.sum_mean.zero_()
            self.sum_m2.zero_()
        self.tracked = 0

    def commit_pending(self) -> None:
        """Commit the statistics of micro-batches tracked so far, if any (a mini-batch cut into
        fewer than `chunks` micro-batches); `Pipe` calls it after each training forward."""
        if self.tracked:
            self._commit()

    def forward(self, input: Tensor) -> Tensor:
        self._check_input_dim(input)
        if not self.training:
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight, self.bias,
                                False, 0.0, self.eps)
        if not is_recomputing():
            self._track(input)
        # Normalise with this micro-batch's statistics; running statistics are ours to update.
        return F.batch_norm(input, None, None, self.weight, self.bias, True, 0.0, self.eps)

    @classmethod
    def convert_deferred_batch_norm(cls, module: M, chunks: int = 1) -> M:
        """Replace every `BatchNorm*d` with running statistics in `module` by a `DeferredBatchNorm`
        (same parameters and statistics); returns the converted module (`module` itself unless
        it is a batch norm)."""
        if isinstance(module, DeferredBatchNorm) and module.chunks == chunks:
            return module
        converted: nn.Module = module
        if isinstance(module, _BatchNorm) and module.track_running_stats:
            converted = DeferredBatchNorm(module.num_features, module.eps, module.momentum, module.affine, chunks)
            converted.to(device=module.running_mean.device if module.running_mean is not None else None)
            if module.affine:
                converted.register_parameter("weight", module.weight)
                converted.register_parameter("bias", module.bias)
            converted.running_mean = module.running_mean
            converted.running_var = module.running_var
            converted.num_batches_tracked = module.num_batches_tracked
            converted.train(module.training)
        for name, child in module.named_children():
            converted.add_module(name, cls.convert_deferred_batch_norm(child, chunks))
        return converted  # type: ignore[return-value]
