"""Redistribute a local piece from one layout to another on its mesh.

A `Move` is the plan between two specs (`_redistribute.plan_between`, the plan propagation
priced) and this rank's program for it (collective records and local steps), built once
per pair of specs; every later move of the same pair only runs the program.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .. import _comm as comm
from .._mesh import CACHE_SIZES, PER_RANK_CACHES
from .._mesh import DeviceMesh
from .._redistribute import (LocalStep, Program, RedistributePlan, StridedStep, build_program, plan_between, plan_parts,
                             run_program)
from .._spec import DTensorSpec

__all__ = ["Move", "describe_move", "move_between", "redistribute_local", "run_move", "start_redistribute"]


@dataclass(frozen=True)
class Move:
    """What this rank does to move a piece from `src` to `dst`: `plan` (the same on every
    rank) and `program` (empty on a rank outside the mesh, which holds nothing to move)."""

    src: DTensorSpec
    dst: DTensorSpec
    plan: RedistributePlan
    program: Program

    @property
    def single(self) -> Optional[comm.Collective]:
        """The program's one collective, when it is exactly that."""
        if len(self.program) == 1 and isinstance(self.program[0], comm.Collective):
            return self.program[0]
        return None


_MOVES: dict[tuple[DTensorSpec, DTensorSpec], Move] = {}
PER_RANK_CACHES.append(_MOVES.clear)
CACHE_SIZES["redistribute moves"] = _MOVES.__len__


def move_between(src: DTensorSpec, dst: DTensorSpec) -> Move:
    """The (cached) move from `src` to `dst` on their mesh."""
    key = (src, dst)
    found = _MOVES.get(key)
    if found is None:
        mesh = src.mesh
        if not isinstance(mesh, DeviceMesh):
            raise TypeError(f"moving a piece needs a DTensor on a DeviceMesh, got a spec on {mesh!r}")
        plan = plan_between(src, dst)
        coordinate = mesh.get_coordinate()
        program: Program = ()
        if coordinate is not None:
            groups, whole = mesh.get_all_groups(), mesh.get_mesh_group()
            for part in plan_parts(src, dst) if plan.steps or src != dst else ():
                if isinstance(part, StridedStep):
                    program += (LocalStep(part.kind, part.tensor_dim, coordinate[part.mesh_dim], 0, part.parts, part.ways),)
                else:
                    program += build_program(part[0], src.dtype, part[1].shard_order, groups, tuple(coordinate), whole)
        found = _MOVES[key] = Move(src, dst, plan, program)
    return found


def describe_move(src: DTensorSpec, dst: DTensorSpec) -> str:
    """'redistribute (S(0), R) -> (R, R) of a [8, 6] tensor on mesh (2, 2) ('dp', 'tp')', for errors."""
    mesh = src.mesh
    names = f" {tuple(mesh.mesh_dim_names)}" if mesh.mesh_dim_names else ""
    return (f"redistribute {src.layout_str()} -> {dst.layout_str()} of a {list(src.shape)} tensor on mesh "
            f"{tuple(mesh.shape)}{names}")


def run_move(move: Move, local: torch.Tensor) -> torch.Tensor:
    """Run `move`'s program on `local`; a failed collective names the move."""
    try:
        return run_program(move.program, local)
    except comm.CollectiveError as exc:
        raise exc.add_operation(describe_move(move.src, move.dst))


def redistribute_local(local: torch.Tensor, src: DTensorSpec, dst: DTensorSpec) -> torch.Tensor:
    """This rank's piece of the same global tensor in layout `dst` (same mesh)."""
    if src.placements == dst.placements and src.shard_order == dst.shard_order:
        return local
    found = _MOVES.get((src, dst))
    if found is None:
        found = move_between(src, dst)
    return run_move(found, local)


def start_redistribute(local: torch.Tensor, src: DTensorSpec, dst: DTensorSpec) -> Optional[comm.Started]:
    """Issue a redistribute that is one collective without waiting (None otherwise)."""
    single = move_between(src, dst).single
    return None if single is None else comm.start(single, local)
