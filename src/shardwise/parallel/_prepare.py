"""`PrepareModuleInput` / `PrepareModuleOutput` / `PrepareModuleInputOutput`: lay out a module's inputs and outputs.

These styles touch no parameter: they declare how the tensors crossing a module's boundary
are laid out. A plain tensor is wrapped as this rank's piece in the declared layout (no
check, as in torch), then redistributed to the desired layout; `use_local_output` hands
the module (or its caller) plain local tensors again.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional, cast

from torch import nn

from .._describe import refuse_torch
from .._mesh import DeviceMesh
from .._placement import Placement
from ._plan import FrozenMap
from ._style import Layouts, LayoutsLike, ParallelStyle, _as_dtensor, _finish, _layouts, _moved

__all__ = ["PrepareModuleInput", "PrepareModuleOutput", "PrepareModuleInputOutput"]


@dataclass(frozen=True, kw_only=True)
class PrepareModuleInput(ParallelStyle):
    """Lay out a module's inputs: wrap plain tensors as `input_layouts`, redistribute to `desired_input_layouts`.

    One entry per positional input (`None` leaves that input alone); keyword inputs by name.
    The module's parameters are not touched.
    """

    input_layouts: Optional[LayoutsLike] = None
    desired_input_layouts: Optional[LayoutsLike] = None
    input_kwarg_layouts: Optional[Mapping[str, Placement]] = None
    desired_input_kwarg_layouts: Optional[Mapping[str, Placement]] = None
    use_local_output: bool = False

    def __post_init__(self) -> None:
        ins = _layouts(self.input_layouts, "input_layouts")
        want = _layouts(self.desired_input_layouts, "desired_input_layouts")
        if ins is not None and (want is None or len(want) != len(ins)):
            raise ValueError(
                f"PrepareModuleInput got input_layouts={ins} and desired_input_layouts={want}: give one desired "
                f"layout per input layout (None for inputs to leave as they are)"
            )
        object.__setattr__(self, "input_layouts", ins)
        object.__setattr__(self, "desired_input_layouts", want)
        kw = self._kwarg_map(self.input_kwarg_layouts, "input_kwarg_layouts")
        kw_want = self._kwarg_map(self.desired_input_kwarg_layouts, "desired_input_kwarg_layouts")
        if kw_want is not None and set(kw_want) != set(kw or {}):
            raise ValueError(
                f"PrepareModuleInput got input_kwarg_layouts for {sorted(kw or {})} and desired_input_kwarg_layouts "
                f"for {sorted(kw_want)}: give both for the same keyword inputs"
            )
        object.__setattr__(self, "input_kwarg_layouts", kw)
        object.__setattr__(self, "desired_input_kwarg_layouts", kw_want)

    @staticmethod
    def _kwarg_map(value: Any, what: str) -> Optional[FrozenMap[Placement]]:
        if value is None:
            return None
        if not isinstance(value, Mapping) or not all(isinstance(p, Placement) for p in value.values()):
            for key, p in (value.items() if isinstance(value, Mapping) else ()):
                refuse_torch(p, f"{what}[{key!r}]")
            raise TypeError(f"{what} must map keyword names to Placements, got {value!r}")
        return FrozenMap(value)

    def _one(self, x: Any, layout: Optional[Placement], desired: Optional[Placement], mesh: DeviceMesh, where: str) -> Any:
        if layout is None:
            return x
        return _finish(_moved(_as_dtensor(x, mesh, layout, where), desired), self.use_local_output)

    def _prepare(self, mod: nn.Module, args: tuple[Any, ...], kwargs: Optional[dict[str, Any]], mesh: DeviceMesh) -> Any:
        name = type(mod).__name__
        # (string casts: a subscripted type built at run time is a graph break under torch.compile's fullgraph)
        ins, wants = cast("Optional[Layouts]", self.input_layouts), cast("Layouts", self.desired_input_layouts)
        if ins is not None:
            if len(args) != len(ins):
                raise ValueError(
                    f"PrepareModuleInput on {name} has {len(ins)} input_layouts but the module got "
                    f"{len(args)} positional inputs: give one layout per positional input (None to leave one alone)"
                )
            args = tuple(
                self._one(x, lay, want, mesh, f"PrepareModuleInput on {name}, input {i}")
                for i, (x, lay, want) in enumerate(zip(args, ins, wants))
            )
        if kwargs is None:
            return args
        kw_in, kw_want = self.input_kwarg_layouts or {}, self.desired_input_kwarg_layouts or {}
        kwargs = {
            k: self._one(v, kw_in.get(k), kw_want.get(k), mesh, f"PrepareModuleInput on {name}, input {k!r}")
            for k, v in kwargs.items()
        }
        return args, kwargs

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if self.input_kwarg_layouts is not None:
            module.register_forward_pre_hook(
                lambda m, args, kwargs: self._prepare(m, args, kwargs, device_mesh), with_kwargs=True
            )
        else:
            module.register_forward_pre_hook(lambda m, args: self._prepare(m, args, None, device_mesh))
        return module


@dataclass(frozen=True, kw_only=True)
class PrepareModuleOutput(ParallelStyle):
    """Lay out a module's outputs: wrap plain tensors as `output_layouts`, redistribute to `desired_output_layouts`."""

    output_layouts: LayoutsLike
    desired_output_layouts: LayoutsLike
    use_local_output: bool = True

    def __post_init__(self) -> None:
        outs = _layouts(self.output_layouts, "output_layouts")
        want = _layouts(self.desired_output_layouts, "desired_output_layouts")
        if outs is None or want is None or len(outs) != len(want):
            raise ValueError(
                f"PrepareModuleOutput got output_layouts={outs} and desired_output_layouts={want}: give one desired "
                f"layout per output layout"
            )
        object.__setattr__(self, "output_layouts", outs)
        object.__setattr__(self, "desired_output_layouts", want)

    def _prepare(self, mod: nn.Module, outputs: Any, mesh: DeviceMesh) -> Any:
        name = type(mod).__name__
        items: Sequence[Any] = outputs if isinstance(outputs, tuple) else (outputs,)
        outs, wants = cast(Layouts, self.output_layouts), cast(Layouts, self.desired_output_layouts)
        if len(items) != len(outs):
            raise ValueError(
                f"PrepareModuleOutput on {name} has {len(outs)} output_layouts but the module returned "
                f"{len(items)} outputs: give one layout per output (None to leave one alone)"
            )
        done = []
        for i, (x, lay, want) in enumerate(zip(items, outs, wants)):
            if lay is None:
                done.append(x)
            else:
                dt = _moved(_as_dtensor(x, mesh, lay, f"PrepareModuleOutput on {name}, output {i}"), want)
                done.append(_finish(dt, self.use_local_output))
        return done[0] if len(done) == 1 else tuple(done)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.register_forward_hook(lambda m, _args, outputs: self._prepare(m, outputs, device_mesh))
        return module


@dataclass(frozen=True, kw_only=True)
class PrepareModuleInputOutput(ParallelStyle):
    """`PrepareModuleInput` on a module's inputs and `PrepareModuleOutput` on its outputs, in one style.

    The arguments are theirs (`use_local_input` is the input side's `use_local_output`) and are
    checked as they check them, when the style is made.
    """

    input_layouts: Optional[LayoutsLike] = None
    desired_input_layouts: Optional[LayoutsLike] = None
    input_kwarg_layouts: Optional[Mapping[str, Placement]] = None
    desired_input_kwarg_layouts: Optional[Mapping[str, Placement]] = None
    use_local_input: bool = False
    output_layouts: LayoutsLike
    desired_output_layouts: LayoutsLike
    use_local_output: bool = True

    def __post_init__(self) -> None:
        self._sides()  # one style's checks, and its errors, for each side

    @property
    def prepare_module_input(self) -> PrepareModuleInput:
        """The input side, as its own style (torch's attribute)."""
        return self._sides()[0]

    @property
    def prepare_module_output(self) -> PrepareModuleOutput:
        """The output side, as its own style (torch's attribute)."""
        return self._sides()[1]

    def _sides(self) -> tuple[PrepareModuleInput, PrepareModuleOutput]:
        inputs = PrepareModuleInput(
            input_layouts=self.input_layouts, desired_input_layouts=self.desired_input_layouts,
            input_kwarg_layouts=self.input_kwarg_layouts, desired_input_kwarg_layouts=self.desired_input_kwarg_layouts,
            use_local_output=self.use_local_input)
        outputs = PrepareModuleOutput(output_layouts=self.output_layouts, desired_output_layouts=self.desired_output_layouts,
                                      use_local_output=self.use_local_output)
        return inputs, outputs

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for side in self._sides():
            side._apply(module, device_mesh)
        return module
