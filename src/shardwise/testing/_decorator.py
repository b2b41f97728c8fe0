"""`@distributed(world_size)`: a pytest test function whose body runs on every rank of a pool.

The workers must find the *body*, but pickling the test function by name finds the
wrapper pytest sees (the module attribute). So the wrapper ships a `_Body` -- the
module and name of the test function -- and the worker imports that name, unwraps
down to the wrapper `distributed` made (decorators stacked on top, like
`@pytest.mark.parametrize`, may or may not wrap) and calls the function it decorated.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional, ParamSpec, TypeVar

from ._run import run_distributed
from ._settings import check_timeout, check_world_size

__all__ = ["distributed"]

P = ParamSpec("P")
R = TypeVar("R")

_BODY = "__shardwise_body__"  # set on the wrapper: the function `distributed` decorated


def distributed(world_size: int = 4, timeout: Optional[float] = None) -> Callable[[Callable[P, R]], Callable[P, None]]:
    """Run the decorated test on every rank of a `world_size`-process gloo group.

    When pytest calls the test (with its fixtures and parametrize arguments, which must
    pickle), the body runs on each rank through `run_distributed`; the test fails with
    `DistributedTestError` if any rank fails or the ranks take longer than `timeout`
    seconds (default `default_timeout()`). The test must be a module-level function::

        @pytest.mark.parametrize("n", [1, 3])
        @distributed(world_size=2)
        def test_all_reduce_sums_over_ranks(n: int) -> None:
            t = torch.full((2,), float(dist.get_rank() + n))
            dist.all_reduce(t)
            assert t.tolist() == [2.0 * n + 1, 2.0 * n + 1]
    """
    if callable(world_size):
        raise TypeError("distributed takes arguments: write @distributed() or @distributed(world_size=2)")
    check_world_size(world_size)
    if timeout is not None:
        check_timeout(timeout)

    def decorate(fn: Callable[P, R]) -> Callable[P, None]:
        module, qualname = fn.__module__, fn.__qualname__
        if "." in qualname:
            raise TypeError(
                f"@distributed needs a module-level function (the workers import it by name), "
                f"got {module}.{qualname}: move it to the top level of {module}"
            )
        body = _Body(module, qualname)

        @functools.wraps(fn)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> None:
            __tracebackhide__ = True
            run_distributed(body, world_size, *args, timeout=timeout, **kwargs)

        setattr(wrapper, _BODY, fn)
        return wrapper

    return decorate


@dataclass(frozen=True)
class _Body:
    """A test function decorated with `distributed`, by name; calling it runs the body."""

    body_module: str
    qualname: str

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        found = getattr(importlib.import_module(self.body_module), self.qualname)
        wrapper = inspect.unwrap(found, stop=lambda f: hasattr(f, _BODY))
        return getattr(wrapper, _BODY)(*args, **kwargs)

    def __str__(self) -> str:
        return self.qualname
