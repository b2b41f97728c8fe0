"""`run_distributed`: run one function on every rank of a worker pool and gather what it returns."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any, Optional

from ._asserts import rewritten_by_pytest
from ._pool import pool_for
from ._settings import check_timeout, check_world_size, default_timeout

__all__ = ["run_distributed"]


def run_distributed(
    fn: Callable[..., Any], world_size: int, /, *args: Any, timeout: Optional[float] = None, **kwargs: Any
) -> list[Any]:
    """Run `fn(*args, **kwargs)` on every rank of a gloo group of `world_size` processes.

    Returns the per-rank return values, index = rank. `fn`, the arguments and the return
    values travel by pickle, so `fn` must be importable by name (a module-level function).
    Inside `fn`, `torch.distributed` is initialised: `dist.get_rank()`, collectives on the
    default group, `dist.new_group(...)` all work. If any rank raises, exits, or has not
    finished after `timeout` seconds (default `default_timeout()`), this raises
    `DistributedTestError` naming the ranks and the pool of workers is replaced.

    Each run starts from the state a fresh worker had (RNG, default dtype, grad mode,
    environment, working directory); process groups made with `new_group` persist.
    Workers are daemonic, so a body cannot start `multiprocessing` children.

    >>> import operator
    >>> run_distributed(operator.add, 2, 1, 2)
    [3, 3]
    """
    __tracebackhide__ = True
    check_world_size(world_size)
    limit = default_timeout() if timeout is None else check_timeout(timeout)
    try:
        task = pickle.dumps((fn, args, kwargs), pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        raise TypeError(
            f"run_distributed sends fn, args and kwargs to the workers by pickle, and {_name(fn)} "
            f"or its arguments cannot be pickled ({exc}): pass a module-level function and picklable arguments"
        ) from exc
    module = getattr(fn, "body_module", None) or getattr(fn, "__module__", None)
    rewritten = [module] if isinstance(module, str) and rewritten_by_pytest(module) else []
    return pool_for(world_size).run(task, rewritten, limit, _name(fn))


def _name(fn: object) -> str:
    return str(getattr(fn, "__qualname__", None) or fn)
