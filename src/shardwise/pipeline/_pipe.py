"""`Pipe`: an `nn.Sequential` cut into partitions on several devices, run as a GPipe pipeline.

`Pipe(module, balance=[2, 2], devices=["cuda:0", "cuda:1"], chunks=4)` puts layers 0-1
on the first device and 2-3 on the second, splits each input into 4 micro-batches
and runs them through the partitions in the fill-drain schedule, one worker thread
per device. The result, and every gradient, equals the plain module's. Checkpointing
keeps only partition-boundary activations of a micro-batch and recomputes the rest in
backward (`"always"`, `"except_last"` micro-batch, or `"never"`; never in eval).
Skip connections (`@skippable` layers) are verified before the module is split, and
each skip travels straight from the partition that stashes it to the one that pops it.

Everything runs on `devices=["cpu", "cpu"]`, which is how it is tested here.

>>> import torch
>>> from torch import nn
>>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
>>> pipe = Pipe(model, balance=[2, 1], devices=["cpu", "cpu"], chunks=3)
>>> x = torch.randn(7, 4)
>>> torch.allclose(pipe(x), model(x), atol=1e-6), len(pipe), pipe.balance  # matmul blocking may differ by rows
(True, 3, [2, 1])
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Optional, Union, cast

import torch
from torch import Tensor, nn

from .._describe import describe
from ._batchnorm import DeferredBatchNorm
from ._engine import Pipeline
from ._microbatch import BatchValue, check, gather, scatter
from ._stream import AbstractStream, as_device, new_stream
from .skip import SkipRoutes, inspect_skip_layout, verify_skippables

__all__ = ["Pipe"]

Device = Union[torch.device, str, int]
MODES = ("always", "except_last", "never")


def recommend_auto_balance(message: str) -> str:
    """Append how to compute a balance automatically to `message`."""
    return (f"{message}\n\nIf your model is still under development, its optimal balance would change "
            "frequently. In this case, we highly recommend 'shardwise.pipeline.balance_by_time' (or "
            "'balance_by_size') for naive automatic balancing:\n\n"
            "  from shardwise.pipeline import Pipe, balance_by_time\n\n"
            "  partitions = torch.cuda.device_count()  # or the number of devices you pass\n"
            "  sample = torch.empty(...)\n"
            "  balance = balance_by_time(partitions, model, sample)\n\n"
            "  model = Pipe(model, balance, chunks=8)\n")


def as_given_by_torchgpipe(chunks: Any, checkpoint: Any) -> tuple[Any, Any]:
    """`chunks` and `checkpoint` as torchgpipe reads them where their meaning is plain: a whole
    float is that many micro-batches (`chunks=8.0`), and any object whose `str()` names a mode
    (a `str` subclass, an enum-like value) is that mode, as a plain `str`. Anything else is
    returned as given, for `check_arguments` to refuse (2.5, NaN, "8", None)."""
    if isinstance(chunks, float) and chunks.is_integer():
        chunks = int(chunks)
    if type(checkpoint) is not str and not isinstance(checkpoint, (bool, int, float, type(None))):
        try:
            text = str(checkpoint)
        except Exception:
            return chunks, checkpoint
        if text in MODES:
            checkpoint = text
    return chunks, checkpoint


def _moving_denied(devices: Sequence[torch.device]) -> TypeError:
    return TypeError(
        "denied to move parameters and buffers, because Pipe should manage device placement "
        f"(partition j lives on devices[j], devices: {[str(d) for d in devices]}): build a new Pipe "
        "with the devices you want instead; changing the dtype (.half(), .to(torch.float64)) is allowed")


def _default_devices(n: int) -> list[torch.device]:
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return [torch.device("cuda", k) for k in range(torch.cuda.device_count())]
    return [torch.device("cpu")] * n


def _verify_module(module: nn.Module) -> None:
    if not isinstance(module, nn.Sequential):
        raise TypeError(f"module must be nn.Sequential to be partitioned, got {describe(module)}: wrap its "
                        "layers in nn.Sequential (each child is one indivisible layer)")
    seen: dict[int, str] = {}
    duplicates = []
    for name, layer in module._modules.items():
        if layer is None:
            continue
        if id(layer) in seen:
            duplicates.append(f"'{name}' is the same {type(layer).__name__} as '{seen[id(layer)]}'")
        else:
            seen[id(layer)] = name
    if duplicates:
        raise ValueError("module with duplicate children is not supported (" + "; ".join(duplicates) +
                         "): use a separate instance for each position")


def _argument_problems(balance: list[Any], chunks: int, checkpoint: str,
                       module: nn.Sequential) -> tuple[list[str], bool]:
    """Problems with chunks, checkpoint and balance, and whether balance is one of them."""
    problems = []
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks <= 0:
        problems.append(f"number of chunks must be positive integer (chunks: {chunks!r}): pass chunks >= 1, the "
                        "number of micro-batches")
    if checkpoint not in MODES:
        problems.append(f"checkpoint is not one of 'always', 'except_last', or 'never' (checkpoint: "
                        f"{checkpoint!r})")
    if any(isinstance(b, bool) or not isinstance(b, int) or b <= 0 for b in balance):
        problems.append(f"all balance numbers must be positive integer (balance: {balance}): give each "
                        "partition at least one layer")
    elif len(module) != sum(balance):
        problems.append(f"module and sum of balance have different length (module: {len(module)}, sum of "
                        f"balance: {sum(balance)}): balance[j] is the number of layers of partition j (balance: "
                        f"{balance}), and they must add up to len(module)")
    return problems, any("balance" in p for p in problems)


def check_arguments(module: nn.Sequential, balance: Iterable[int], chunks: int, checkpoint: str,
                    what: str, *, allow_shared: bool = False) -> list[int]:
    """Every check a pipeline makes before cutting `module` (shared by `Pipe` and the
    multi-process runtime); all argument problems raised at once. Returns the balance.
    `allow_shared`: partitions may share parameters (the runtime sums their gradients)."""
    _verify_module(module)
    if isinstance(balance, (str, bytes)) or not isinstance(balance, Iterable):
        raise TypeError(recommend_auto_balance(
            f"balance must be a list of layers per partition, got {describe(balance)}: e.g. [2, 2]"))
    balance = list(balance)
    problems, balance_is_wrong = _argument_problems(balance, chunks, checkpoint, module)
    if problems:
        message = problems[0] if len(problems) == 1 else \
            f"{len(problems)} problems with the {what} arguments:\n" + "\n".join(f"  - {p}" for p in problems)
        raise ValueError(recommend_auto_balance(message) if balance_is_wrong else message)
    verify_skippables(module)
    shared = [] if allow_shared else _shared_parameter_problems(module, balance)
    if shared:
        raise ValueError(shared[0])
    return balance


def _shared_parameter_problems(module: nn.Sequential, balance: list[int]) -> list[str]:
    owner: dict[int, tuple[str, int, str]] = {}  # id(param) -> (layer name, partition, param name)
    layer_partition = [j for j, size in enumerate(balance) for _ in range(size)]
    problems = []
    for (name, layer), j in zip(module._modules.items(), layer_partition):
        assert layer is not None
        for pname, param in layer.named_parameters(remove_duplicate=False):
            first = owner.setdefault(id(param), (name, j, pname))
            if first[1] != j:
                problems.append(f"parameter '{first[0]}.{first[2]}' (partition {first[1]}) is also "
                                f"'{name}.{pname}' (partition {j})")
    if problems:
        return ["module with duplicate parameters in distinct partitions is not supported (" +
                "; ".join(problems) + "): keep the layers that share a parameter in one partition (change "
                "balance) or give each its own copy"]
    return []


class Pipe(nn.Module):
    """Run `module` (an `nn.Sequential`) as a pipeline of `len(balance)` partitions (GPipe).

    Args:
        module: the layers, in order; each child is one indivisible layer.
        balance: layers per partition, e.g. `[2, 2]`; see `balance_by_time` / `balance_by_size`.
        devices: one per partition (extra ones are dropped); default: the CUDA devices if any,
            else `["cpu"] * len(balance)`.
        chunks: number of micro-batches each input is split into (along tensor dim 0).
        checkpoint: `"always"`, `"except_last"` (all micro-batches but the last) or `"never"`.
        deferred_batch_norm: replace batch norms by `DeferredBatchNorm`, so running statistics are
            those of the whole mini-batch.
    """

    partitions: nn.ModuleList

    def __init__(self, module: nn.Sequential, balance: Optional[Iterable[int]] = None, *,
                 devices: Optional[Iterable[Device]] = None, chunks: int = 1, checkpoint: str = "except_last",
                 deferred_batch_norm: bool = False) -> None:
        super().__init__()
        if balance is None:
            raise ValueError(recommend_auto_balance(
                "balance is required: pass balance=[layers of partition 0, layers of partition 1, ...]"))
        chunks, checkpoint = as_given_by_torchgpipe(chunks, checkpoint)
        balance = check_arguments(module, balance, chunks, checkpoint, "Pipe")
        if devices is not None and (isinstance(devices, (str, bytes, torch.device)) or not isinstance(devices, Iterable)):
            raise TypeError(f"devices must be a list of devices, one per partition, got {describe(devices)}: e.g. "
                            f"{['cpu'] * len(balance)}")
        device_list = ([as_device(d, f"devices[{j}]") for j, d in enumerate(devices)] if devices is not None
                       else _default_devices(len(balance)))
        if len(device_list) < len(balance):
            raise ValueError(f"too few devices to hold given partitions (devices: {len(device_list)} "
                             f"{[str(d) for d in device_list]}, partitions: {len(balance)}): pass one device per "
                             f"partition, e.g. devices={['cpu'] * len(balance)}, or fewer partitions")

        self.chunks = chunks
        self.checkpoint = checkpoint
        self.balance = balance
        self.devices = device_list[:len(balance)]
        if deferred_batch_norm:
            module = DeferredBatchNorm.convert_deferred_batch_norm(module, chunks)
        layers = iter(module._modules.items())
        partitions = []
        for size, device in zip(balance, self.devices):
            part = nn.Sequential(OrderedDict(next(layers) for _ in range(size)))
            partitions.append(part.to(device))
        self.partitions = nn.ModuleList(partitions)
        self.skip_routes: SkipRoutes = inspect_skip_layout(partitions)
        self._copy_streams: list[list[AbstractStream]] = []

    # -- Sequential-like access to the layers -----------------------------------------------

    def _parts(self) -> list[nn.Sequential]:
        return cast(list[nn.Sequential], list(self.partitions))

    def __len__(self) -> int:
        return sum(len(p) for p in self._parts())

    def __getitem__(self, index: int) -> nn.Module:
        layers = [layer for p in self._parts() for layer in p]
        if not -len(layers) <= index < len(layers):
            raise IndexError(f"layer index {index} is out of range for a Pipe of {len(layers)} layers")
        return layers[index]

    def __iter__(self) -> Iterator[nn.Module]:
        for partition in self._parts():
            yield from partition

    # -- device placement belongs to the Pipe -----------------------------------------------

    def cuda(self, device: Any = None) -> Pipe:
        raise _moving_denied(self.devices)

    def cpu(self) -> Pipe:
        raise _moving_denied(self.devices)

    def to(self, *args: Any, **kwargs: Any) -> Pipe:
        if "device" in kwargs or "tensor" in kwargs:
            raise _moving_denied(self.devices)
        if args and isinstance(args[0], (torch.device, int, str, Tensor)):
            raise _moving_denied(self.devices)
        return super().to(*args, **kwargs)

    # -- running ----------------------------------------------------------------------------

    def _ensure_copy_streams(self, m: int) -> list[list[AbstractStream]]:
        """One copy stream per (partition, micro-batch), kept across steps."""
        if not self._copy_streams or len(self._copy_streams[0]) < m:
            self._copy_streams = [[new_stream(d) for _ in range(max(m, self.chunks))] for d in self.devices]
        return self._copy_streams

    def forward(self, input: BatchValue) -> BatchValue:
        """Run `input` (a tensor or a tuple) through the pipeline; the output is on `devices[-1]`."""
        check(input)
        if not self.devices:
            return input
        input = _to_device(input, self.devices[0])
        batches = scatter(input, self.chunks)
        m = len(batches)
        stop = {"always": m, "except_last": m - 1, "never": 0}[self.checkpoint] if self.training else 0
        Pipeline(self._parts(), self.devices, self._ensure_copy_streams(m), self.skip_routes,
                 stop).run(batches)
        if self.training:
            for layer in self.modules():
                if isinstance(layer, DeferredBatchNorm):
                    layer.commit_pending()
        return gather(batches)


#: torchgpipe's name for `Pipe` (the fill-drain schedule is `ScheduleGPipe`).
GPipe = Pipe


def _to_device(value: BatchValue, device: torch.device) -> BatchValue:
    if isinstance(value, Tensor):
        return value.to(device)
    return tuple(v.to(device) if isinstance(v, Tensor) else v for v in value)
