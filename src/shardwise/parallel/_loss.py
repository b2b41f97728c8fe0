"""`loss_parallel()`: cross entropy on logits split along the class (vocab) dim, without
gathering them.

The last layer of a tensor-parallel language model leaves its logits split along the
vocabulary, and they are the biggest activation of the model (tokens x vocab). Gathering
them for the loss would undo the split; instead, inside this block, log_softmax and
nll_loss run on each rank's classes and exchange only per-row numbers:

| step | what crosses the ranks that split the classes |
|---|---|
| log_softmax forward | all_reduce of each row's max, then of its sum of exp: 2 x rows |
| nll_loss forward | nothing (each target's log-probability is picked where it lives: the loss is a P(sum)); a mean all-reduces its total weight (one number) when class weights or split samples spread it over ranks |
| log_softmax backward | all_reduce of each row's sum of the incoming gradient: rows |
| nll_loss backward | nothing (each rank writes its own class range) |

The mechanism is a mode (`op_mode(LOSS_PARALLEL)`): while it is on, those ops run by their
loss-parallel rules, which may keep the class dim split (`shardwise._ops._loss_parallel`,
`_loss_parallel_local`); outside the block every op plans and runs exactly as before. Run the backward inside the block too:
outside it the gradient is still right, but the backward ops gather the class dim.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from .._ops import LOSS_PARALLEL, active_modes, op_mode

__all__ = ["loss_parallel"]


@contextlib.contextmanager
def loss_parallel() -> Iterator[None]:
    """Inside this block, `F.cross_entropy(logits, target)` (and `F.nll_loss(F.log_softmax(
    logits, dim), target)`) on DTensor logits split along the class dim keeps them split.

    The logits may be split on the class dim (`Shard(1)` for (N, C), or the class dim of
    (N, C, d1, ...); language-model logits (B, S, V) split on V go in as
    `logits.flatten(0, 1)`) on some mesh dims and on sample dims on others; targets may be
    replicated or split like the samples; class `weight` may be replicated or split like
    the classes (`Shard(0)`). `reduction`, `ignore_index` and `label_smoothing` work as in
    PyTorch. Label smoothing's extra term runs through ordinary ops: its forward sums the
    log-probabilities per row (a P(sum)) and gathers the C class weights, but its gradient
    currently takes another layout on the way back, which moves gradient-sized data. The
    loss is a `Partial("sum")` over the ranks that split the classes (and over those that
    split the samples for mean and sum; `reduction="none"` stays split like the samples);
    the gradient with respect to the logits keeps their layout::

        logits = sw.distribute_tensor(full, mesh, [Shard(1)])  # (N, C), classes split
        target = sw.distribute_tensor(labels, mesh, [Replicate()])
        with loss_parallel():
            loss = F.cross_entropy(logits, target)
            loss.backward()  # inside too, so the backward keeps the classes split

    Blocks nest (the outermost one owns the mode). The mode is process-wide, like
    `set_strict`: it covers the autograd engine's threads as well.
    """
    if LOSS_PARALLEL in active_modes():  # an outer block already turned it on
        yield
        return
    with op_mode(LOSS_PARALLEL):
        yield
