"""Tensor-parallel styles: frozen, declarative `Sharder`s for one module (Megatron's column / row split).

A style is a value (a frozen dataclass); applying it to a module places the module's
parameters and installs hooks, and never changes the style, so one style object can be
shared by every layer of a plan. The styles mirror `torch.distributed.tensor.parallel`:

| style | nn.Linear (weight (out, in)) | nn.Embedding (weight (vocab, dim)) | Conv1D (weight (in, out)) | input -> output |
|---|---|---|---|---|
| ColwiseParallel | weight S(0), bias S(0) | weight S(1) | weight S(1), bias S(0) | R -> S(-1) |
| RowwiseParallel | weight S(1), bias R | weight S(0) (vocab) | weight S(0), bias R | S(-1) (ids: R) -> P -> R |

In Megatron's terms a column-parallel layer is `f` (identity forward, all-reduce of the
input gradient backward) and a row-parallel layer is `g` (all-reduce of the partial
output forward): here both fall out of the DTensor layouts; the hooks only declare them.
Input hooks wrap plain tensors as DTensors of the declared `input_layouts` (each rank's
piece, no check) and redistribute to what the module needs; output hooks redistribute to
`output_layouts` and return local tensors when `use_local_output`. A plain input wrapped
as `Shard(d)` is taken as an even piece (global size = local size x ranks), as in torch,
except where the module says its size: a row-split Linear / Conv1D takes a plain input's
last dim as its weight's input features, so a column-split layer's local output feeds it
even when the hidden size does not divide the mesh (torch reads an uneven piece as even).

`Conv1D` is Hugging Face GPT-2's linear layer with a transposed weight; it is recognised by
its shape (a 2-D `weight` whose second dim is the module's `nf`), not by importing it.

Differences from torch, on purpose: an input that already is a DTensor is redistributed
to the layout the module needs whatever its placements (torch compares only declared
layouts); `RowwiseParallel()` on an embedding takes replicated ids by default (torch's
`Shard(-1)` default would read the ids as sequence pieces); `src_data_rank` is a field,
set with `dataclasses.replace`, not by mutating the style.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Optional, Union

import torch
from torch import nn

from .._describe import refuse_torch
from .._layout import contiguous_strides
from .._mesh import AbstractMesh, DeviceMesh
from .._placement import Placement, Replicate, Shard, _StridedShard
from .._tensor import DTensor, redistribute_node, to_local
from ._distribute import distribute_module, place_parameter
from ._fused import fused_parts
from ._plan import Sharder

__all__ = [
    "ParallelStyle",
    "ColwiseParallel",
    "FusedColwiseParallel",
    "RowwiseParallel",
    "SequenceParallel",
]

Layouts = tuple[Optional[Placement], ...]  # canonical: one entry per input / output
LayoutsLike = Union[Placement, Sequence[Optional[Placement]]]


def module_kind(module: nn.Module) -> Optional[str]:
    """'linear', 'embedding' or 'conv1d' (HF GPT-2's transposed linear, by duck typing), else None."""
    if isinstance(module, nn.Linear):
        return "linear"
    if isinstance(module, nn.Embedding):
        return "embedding"
    w, nf = getattr(module, "weight", None), getattr(module, "nf", None)
    if isinstance(w, torch.Tensor) and w.ndim == 2 and isinstance(nf, int) and w.shape[1] == nf:
        return "conv1d"
    return None


def _one_placement(value: Any, what: str, default: Optional[Placement]) -> Optional[Placement]:
    if value is None:
        return default
    if isinstance(value, (tuple, list)) and len(value) == 1:
        value = value[0]
    if not isinstance(value, Placement):
        refuse_torch(value, what)
        raise TypeError(f"{what} must be a Placement (Shard(d), Replicate() or Partial()), got {value!r}")
    return value


def _layouts(value: Any, what: str) -> Optional[Layouts]:
    if value is None:
        return None
    items = (value,) if isinstance(value, Placement) else value
    if not isinstance(items, (tuple, list)) or not all(p is None or isinstance(p, Placement) for p in items):
        if isinstance(items, (tuple, list)):
            for i, p in enumerate(items):
                refuse_torch(p, f"{what}[{i}]")
        refuse_torch(items, what)
        raise TypeError(f"{what} must be a Placement or a tuple of Placement / None (one per input), got {value!r}")
    return tuple(items)


def _as_dtensor(x: Any, mesh: DeviceMesh, layout: Placement, where: str, features: Optional[int] = None) -> DTensor:
    """`x` as a DTensor; a plain `x` is this rank's piece, taken as even unless `features`
    gives the global size of its last dim (what a row-split Linear's weight says it takes)."""
    if isinstance(x, DTensor):
        return x
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{where} expected a tensor to lay out as {layout}, got {type(x).__name__}")
    if features is not None and x.ndim and isinstance(layout, Shard) and layout.dim in (-1, x.ndim - 1):
        shape = (*x.shape[:-1], features)
        return DTensor.from_local(x, mesh, (layout,), run_check=False, shape=shape, stride=contiguous_strides(shape))
    return DTensor.from_local(x, mesh, (layout,), run_check=False)


def _input_features(mod: nn.Module) -> Optional[int]:
    """Global input features of a Linear (weight (out, in)) or HF Conv1D (weight (in, out), `nf`)."""
    weight = getattr(mod, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.ndim != 2:
        return None
    if isinstance(mod, nn.Linear):
        return int(weight.shape[1])
    return int(weight.shape[0]) if hasattr(mod, "nf") else None


def _moved(x: DTensor, layout: Optional[Placement]) -> DTensor:
    return x if layout is None else redistribute_node(x, (layout,))


def _finish(x: DTensor, use_local: bool) -> Union[DTensor, torch.Tensor]:
    if not use_local:
        return x
    # a piece still arriving: its own to_local waits for it; under torch.compile the method is what
    # dynamo follows (an in-graph DTensor's spec cannot be handed to a function), and AOTAutograd's
    # functionalization lets a model change the piece in place anyway
    if torch.compiler.is_compiling() or type(x._local_tensor) is not torch.Tensor:
        return x.to_local()
    return to_local(x, handed_over=True)


@dataclass(frozen=True)
class ParallelStyle(Sharder):
    """A tensor-parallel `Sharder` for one module on a 1-D mesh; subclasses are frozen dataclasses."""

    def shard(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        problems = self.validate(module, device_mesh)
        if problems:
            raise ValueError(f"{self!r} cannot shard {type(module).__name__}:\n" + "\n".join(f"  - {p}" for p in problems))
        return self._apply(module, device_mesh)

    def validate(self, module: nn.Module, device_mesh: AbstractMesh) -> list[str]:
        if device_mesh.ndim != 1 and not getattr(self, "spans_mesh_dims", False):
            names = f" with dims {device_mesh.mesh_dim_names}" if device_mesh.mesh_dim_names else ""
            return [
                f"{type(self).__name__} needs a 1-D mesh, got shape {device_mesh.shape}{names}: pass the "
                f"tensor-parallel sub-mesh, e.g. mesh['tp']"
            ]
        return []

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        raise NotImplementedError(f"{type(self).__name__} does not implement _apply")


@dataclass(frozen=True, kw_only=True)
class _LinearStyle(ParallelStyle):
    """What Colwise and Rowwise share: which modules they take, parameter placement, the hooks."""

    input_layouts: Optional[Placement] = None
    output_layouts: Optional[Placement] = None
    use_local_output: bool = True
    src_data_rank: Optional[int] = 0

    _PARAMS: ClassVar[Mapping[str, Mapping[str, Placement]]] = {}  # module kind -> parameter -> placement
    _NEEDS: ClassVar[Mapping[str, Placement]] = {}  # module kind -> the input layout it computes on

    def validate(self, module: nn.Module, device_mesh: AbstractMesh) -> list[str]:
        problems = super().validate(module, device_mesh)
        if module_kind(module) is None:
            problems.append(
                f"{type(self).__name__} cannot apply to {type(module).__name__}: it shards nn.Linear, nn.Embedding "
                f"and Conv1D (a 2-D `weight` of shape (in, nf) and an `nf` attribute); use SequenceParallel or "
                f"PrepareModuleInput / PrepareModuleOutput for other modules, or leave it out of the plan to replicate it"
            )
        return problems

    def param_layouts(self, module: nn.Module, device_mesh: AbstractMesh) -> Mapping[str, tuple[Placement, ...]]:
        kind = module_kind(module)
        return {} if kind is None else {k: (p,) for k, p in self._PARAMS[kind].items()}

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        kind = module_kind(module)
        assert kind is not None  # validate() ran in shard()
        layouts = self.param_layouts(module, device_mesh)
        src = self.src_data_rank

        def partition(name: str, m: nn.Module, mesh: DeviceMesh) -> None:
            if m is module:
                for attr, pl in layouts.items():
                    if m._parameters.get(attr) is not None:
                        place_parameter(m, attr, pl, mesh, src_data_rank=src, where=f"{type(m).__name__}.{attr}")

        needs, out = self._NEEDS[kind], self.output_layouts
        assert out is not None  # set in __post_init__
        return distribute_module(
            module,
            device_mesh,
            partition,
            functools.partial(_prepare_first_input, self.input_layouts or needs, needs, type(self).__name__),
            functools.partial(_prepare_output, out, self.use_local_output, type(self).__name__),
        )


def _prepare_first_input(layout: Placement, desired: Placement, style: str, mod: nn.Module, inputs: tuple[Any, ...],
                         mesh: DeviceMesh) -> tuple[Any, ...]:
    if not inputs:
        raise ValueError(f"{style} on {type(mod).__name__} needs a positional input tensor, got none")
    x = _moved(_as_dtensor(inputs[0], mesh, layout, f"{style} on {type(mod).__name__}", _input_features(mod)), desired)
    return (x, *inputs[1:])


def _prepare_output(layout: Placement, use_local: bool, style: str, mod: nn.Module, outputs: Any,
                    mesh: DeviceMesh) -> Any:
    if not isinstance(outputs, DTensor):
        raise TypeError(f"{style} on {type(mod).__name__} expected a DTensor output, got {type(outputs).__name__}")
    return _finish(_moved(outputs, layout), use_local)


@dataclass(frozen=True, kw_only=True)
class ColwiseParallel(_LinearStyle):
    """Split a Linear / Conv1D by output features (an Embedding by embedding dim): input R, output S(-1).

    >>> ColwiseParallel()
    ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(dim=-1), use_local_output=True, src_data_rank=0)
    """

    def __post_init__(self) -> None:
        object.__setattr__(self, "input_layouts", _one_placement(self.input_layouts, "input_layouts", Replicate()))
        object.__setattr__(self, "output_layouts", _one_placement(self.output_layouts, "output_layouts", Shard(-1)))

    def validate_at(self, path: str, module: nn.Module, device_mesh: AbstractMesh) -> list[str]:
        problems = self.validate(module, device_mesh)
        parts = fused_parts(path)
        local_split = self.use_local_output and isinstance(self.output_layouts, Shard)
        if parts is None or problems or not local_split or module_kind(module) == "embedding" or isinstance(
                self, FusedColwiseParallel):  # (its parts declared: the user knows how the model cuts them)
            return problems
        name = path.rpartition(".")[2]
        fix = (f"FusedColwiseParallel(parts={parts}, use_local_output=False) (each part split by columns: the "
               f"model's cut into parts moves nothing)")
        return [f"{name} fuses {parts} projections side by side ({'q|k|v' if parts == 3 else 'gate|up'}), which the "
                f"model cuts apart by their global sizes after the layer; {type(self).__name__} with local outputs "
                f"gives each rank a contiguous slice of the whole, so that cut fails or mixes the parts (under torch "
                f"too). Use {fix}, or ColwiseParallel(output_layouts=Replicate()) here and "
                f"RowwiseParallel(input_layouts=Replicate()) on the layer that reads its parts (transformers' "
                f"colwise_gather_output / rowwise_split_input: one all_gather per layer)"]

    _PARAMS: ClassVar[Mapping[str, Mapping[str, Placement]]] = {
        "linear": {"weight": Shard(0), "bias": Shard(0)},
        "embedding": {"weight": Shard(1)},
        "conv1d": {"weight": Shard(1), "bias": Shard(0)},
    }
    _NEEDS: ClassVar[Mapping[str, Placement]] = {"linear": Replicate(), "embedding": Replicate(), "conv1d": Replicate()}


@dataclass(frozen=True, kw_only=True)
class FusedColwiseParallel(ColwiseParallel):
    """`ColwiseParallel` for a fused projection whose output features hold `parts` equal
    projections side by side (GPT-2's `c_attn` = q|k|v, Phi-3's `gate_up_proj` = gate|up):
    each part is split by columns separately (`_StridedShard(dim, split_factor=parts)`), so a
    rank holds its piece of every part and the model's own `split` / `chunk` of the output
    into its parts needs no communication: each part comes out `Shard(-1)`, as if the
    projections were separate colwise layers. Where a part does not split evenly over the
    mesh, the layer is split like `ColwiseParallel` (same values; the model's split gathers).

    >>> FusedColwiseParallel(parts=3, use_local_output=False).output_layouts
    _StridedShard(dim=-1, sf=3)
    """

    parts: int = 2

    def __post_init__(self) -> None:
        if isinstance(self.parts, bool) or not isinstance(self.parts, int) or self.parts < 2:
            raise ValueError(f"FusedColwiseParallel(parts={self.parts!r}) needs an int of at least 2: the fused projections' count")
        if self.output_layouts is None:
            object.__setattr__(self, "output_layouts", _StridedShard(-1, split_factor=self.parts))
        super().__post_init__()

    def validate(self, module: nn.Module, device_mesh: AbstractMesh) -> list[str]:
        problems = super().validate(module, device_mesh)
        if module_kind(module) == "embedding":
            problems.append("FusedColwiseParallel splits fused projections (Linear, Conv1D), not an Embedding: use ColwiseParallel")
        return problems

    def _even(self, module: nn.Module, device_mesh: AbstractMesh) -> bool:
        kind = module_kind(module)
        width = int(getattr(module, "weight").shape[0 if kind == "linear" else 1])
        return width % (self.parts * device_mesh.shape[0]) == 0

    def _plain(self) -> ColwiseParallel:
        out = self.output_layouts
        return ColwiseParallel(input_layouts=self.input_layouts,
                               output_layouts=Shard(out.dim) if isinstance(out, _StridedShard) else out,
                               use_local_output=self.use_local_output, src_data_rank=self.src_data_rank)

    def param_layouts(self, module: nn.Module, device_mesh: AbstractMesh) -> Mapping[str, tuple[Placement, ...]]:
        kind = module_kind(module)
        if kind is None or not self._even(module, device_mesh):
            return self._plain().param_layouts(module, device_mesh)
        return {k: (_StridedShard(p.dim, split_factor=self.parts) if isinstance(p, Shard) else p,)
                for k, p in self._PARAMS[kind].items()}

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        # parts that do not split evenly: split by columns as a whole (the model's split then gathers)
        return super()._apply(module, device_mesh) if self._even(module, device_mesh) else self._plain()._apply(module, device_mesh)


@dataclass(frozen=True, kw_only=True)
class RowwiseParallel(_LinearStyle):
    """Split a Linear / Conv1D by input features (an Embedding by vocab): input S(-1), output P -> R.

    `input_layouts=None` means the module's natural input: `Shard(-1)` for Linear / Conv1D,
    `Replicate()` (token ids) for an Embedding.

    >>> RowwiseParallel(use_local_output=False)
    RowwiseParallel(input_layouts=None, output_layouts=Replicate(), use_local_output=False, src_data_rank=0)
    """

    def __post_init__(self) -> None:
        object.__setattr__(self, "input_layouts", _one_placement(self.input_layouts, "input_layouts", None))
        object.__setattr__(self, "output_layouts", _one_placement(self.output_layouts, "output_layouts", Replicate()))

    _PARAMS: ClassVar[Mapping[str, Mapping[str, Placement]]] = {
        "linear": {"weight": Shard(1), "bias": Replicate()},
        "embedding": {"weight": Shard(0)},
        "conv1d": {"weight": Shard(0), "bias": Replicate()},
    }
    _NEEDS: ClassVar[Mapping[str, Placement]] = {"linear": Shard(-1), "embedding": Replicate(), "conv1d": Shard(-1)}


@dataclass(frozen=True, kw_only=True)
class SequenceParallel(ParallelStyle):
    """Replicate a module's parameters and run it on inputs split along `sequence_dim` (norms, dropout).

    A plain input is taken as this rank's piece of the sequence; a DTensor input is
    redistributed to `Shard(sequence_dim)`. The output stays split along the sequence.
    """

    sequence_dim: int = 1
    use_local_output: bool = False
    src_data_rank: Optional[int] = 0

    def __post_init__(self) -> None:
        if isinstance(self.sequence_dim, bool) or not isinstance(self.sequence_dim, int):
            raise TypeError(f"sequence_dim must be an int tensor dim, got {self.sequence_dim!r}")

    def param_layouts(self, module: nn.Module, device_mesh: AbstractMesh) -> Mapping[str, tuple[Placement, ...]]:
        return {name: (Replicate(),) * device_mesh.ndim for name, _ in module.named_parameters(remove_duplicate=False)}

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        seq = Shard(self.sequence_dim)
        return distribute_module(
            module,
            device_mesh,
            None,
            functools.partial(_prepare_first_input, seq, seq, type(self).__name__),
            functools.partial(_prepare_output, seq, self.use_local_output, type(self).__name__),
        )
