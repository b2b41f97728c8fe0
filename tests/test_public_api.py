"""Pins the public surface of `shardwise`, runs every module's doctests, and checks that
nothing under `src/` imports what the library replaces (DESIGN.md, "must not do")."""

from __future__ import annotations

import ast
import doctest
import importlib
import pkgutil
import re
from pathlib import Path

import pytest

import shardwise

SRC = Path(__file__).resolve().parent.parent / "src" / "shardwise"

PUBLIC = [
    "AbstractMesh",
    "COST_MODEL",
    "CollectiveError",
    "CommRecord",
    "DTensor",
    "DTensorSpec",
    "DeviceMesh",
    "ImplicitRedistributionError",
    "Partial",
    "Placement",
    "RedistributePlan",
    "Replicate",
    "Shard",
    "TensorMeta",
    "comm_log",
    "compile",
    "current_mesh",
    "distribute_module",
    "distribute_tensor",
    "empty",
    "explain_redistribute",
    "explicit",
    "from_local",
    "full",
    "get_current_mesh",
    "implicit_replication",
    "init_device_mesh",
    "manual_seed",
    "ones",
    "plan_for",
    "rand",
    "randn",
    "set_strict",
    "zeros",
]


def test_public_surface_is_pinned() -> None:
    assert list(shardwise.__all__) == PUBLIC, "update PUBLIC here when the public surface changes on purpose"


PARALLEL = [
    "ColwiseParallel", "ContextParallel", "Coverage", "ExpertLoadBalancer", "ExpertParallel", "FusedColwiseParallel", "HFPlanner", "HFTrainerMixin", "MegatronPlanner", "ParallelStyle",
    "PrepareModuleInput", "PrepareModuleInputOutput", "PrepareModuleOutput",
    "ReplicateParallel", "RowwiseParallel", "SequenceParallel", "Sharder", "ShardingPlan", "ShardingPlanner", "coverage",
    "data_parallel",
    "distribute_module", "from_pretrained", "global_mean", "global_router_loss", "loss_parallel", "memory_report", "no_sync", "parallelize_module", "route_counts",
    "shard_module",
]


SPMD = [
    "HybridMesh", "Mesh", "ShardingSpec", "ShardingType", "clear_sharding", "disable_manual_sharding",
    "enable_manual_sharding", "get_1d_mesh", "get_global_mesh", "mark_sharding", "mark_sharding_module",
    "mark_sharding_with_gradients", "psum", "set_global_mesh", "shard_map",
]


PIPELINE = [
    "Action", "Batch", "DeferredBatchNorm", "DistributedPipe", "GPipe", "Namespace", "Pipe", "PipelineError",
    "PipelineStage", "Schedule", "Schedule1F1B", "ScheduleDualPipeV", "ScheduleGPipe", "ScheduleInterleaved1F1B",
    "ScheduleInterleavedZeroBubble", "ScheduleLoopedBFS", "ScheduleZBVZeroBubble", "Timeline",
    "TimelineEvent", "balance_by_size", "balance_by_time", "balance_cost", "check", "clock_cycles",
    "current_timeline", "gather", "hf_loss", "hf_sequential", "inspect_skip_layout", "is_checkpointing", "is_recomputing", "pop", "scatter",
    "skip", "skippable", "split_module", "stash", "verify_skippables",
]


def test_pipeline_surface_is_pinned() -> None:
    import shardwise.pipeline

    assert list(shardwise.pipeline.__all__) == PIPELINE
    assert shardwise.pipeline.GPipe is shardwise.pipeline.Pipe  # torchgpipe's name


PIPELINING = [
    "Pipe", "PipelineStage", "Schedule1F1B", "ScheduleDualPipeV", "ScheduleGPipe", "ScheduleInterleaved1F1B",
    "ScheduleInterleavedZeroBubble", "ScheduleLoopedBFS", "ScheduleZBVZeroBubble", "SplitPoint", "build_stage",
    "pipe_split", "pipeline",
]


def test_pipelining_surface_is_torchs() -> None:
    import torch.distributed.pipelining

    import shardwise.pipelining

    assert list(shardwise.pipelining.__all__) == PIPELINING
    assert set(PIPELINING) == set(torch.distributed.pipelining.__all__)  # so the switch is an import change


CHECKPOINT = ["load", "save", "async_save", "save_pretrained", "HuggingFaceStorageWriter", "HuggingFaceStorageReader", "load_pretrained", "FileSystemReader", "FileSystemWriter"]


def test_checkpoint_surface_is_pinned() -> None:
    import shardwise.checkpoint

    assert list(shardwise.checkpoint.__all__) == CHECKPOINT  # torch.distributed.checkpoint's names


def test_experimental_surface_is_pinned() -> None:
    import shardwise.experimental

    assert list(shardwise.experimental.__all__) == ["ContextParallel", "context_parallel", "context_parallel_unshard",
                                                    "set_load_balance", "set_rotate_method"]
    assert shardwise.experimental.ContextParallel is shardwise.parallel.ContextParallel


def test_ft_surface_is_pinned() -> None:
    import shardwise.ft

    # torchft's names where they fit (Manager, DistributedDataParallel, Optimizer); the lighthouse is ours
    assert list(shardwise.ft.__all__) == ["DiLoCo", "DistributedDataParallel", "Lighthouse", "LocalSGD", "Manager",
                                          "Optimizer", "Quorum", "QuorumRule", "ReplicaSampler", "ft_init_device_mesh"]


DEBUG = [
    "CommCounter", "CommRecord", "DryCollective", "DryRunReport", "GradientReducer", "ImplicitRedistributionError",
    "MemoryReport", "MoeLayer", "MoeReport", "RankReport", "cache_info", "comm_log", "dry_mesh", "dry_run",
    "explain_redistribute", "explicit", "gradient_reducers", "layout_table", "moe_report", "plan_for", "simulating",
    "visualize_sharding",
]


def test_debug_surface_is_pinned() -> None:
    import shardwise.debug

    assert list(shardwise.debug.__all__) == DEBUG  # issue 46 added GradientReducer, gradient_reducers, dry_mesh, simulating; issue 47 MoeLayer, MoeReport, moe_report


def test_checkpoint_state_dict_mirrors_torchs_functions() -> None:
    import inspect

    import torch.distributed.checkpoint.state_dict as theirs

    import shardwise.checkpoint.state_dict as ours

    assert ours.StateDictOptions is theirs.StateDictOptions
    for name in ours.__all__:
        if name != "StateDictOptions":
            assert list(inspect.signature(getattr(ours, name)).parameters) == \
                list(inspect.signature(getattr(theirs, name)).parameters), name


FSDP = ["CPUOffloadPolicy", "FSDPModule", "MixedPrecisionPolicy", "OffloadPolicy", "UnshardHandle", "fully_shard"]


def test_fsdp_surface_is_pinned() -> None:
    import torch.distributed.fsdp

    import shardwise.fsdp

    assert list(shardwise.fsdp.__all__) == FSDP
    assert set(FSDP) <= set(torch.distributed.fsdp.__all__)  # torch's FSDP2 names, so the switch is an import change


def test_spmd_surface_is_pinned() -> None:
    import shardwise.spmd

    assert list(shardwise.spmd.__all__) == SPMD


def test_parallel_surface_is_pinned() -> None:
    import shardwise.parallel

    assert list(shardwise.parallel.__all__) == PARALLEL
    assert shardwise.distribute_module is shardwise.parallel.distribute_module


def test_all_is_sorted_and_unique() -> None:
    assert list(shardwise.__all__) == sorted(set(shardwise.__all__))


@pytest.mark.parametrize("name", PUBLIC)
def test_every_public_name_exists(name: str) -> None:
    assert getattr(shardwise, name, None) is not None, name


def test_star_import_gives_exactly_the_public_names() -> None:
    namespace: dict[str, object] = {}
    exec("from shardwise import *", namespace)
    assert sorted(k for k in namespace if k != "__builtins__") == PUBLIC


def test_public_objects_live_in_private_modules() -> None:
    # public modules re-export; the implementation is private (STYLE.md, point 2)
    for name in PUBLIC:
        obj = getattr(shardwise, name)
        module = getattr(obj, "__module__", None)
        if module is not None and isinstance(obj, type | type(test_public_surface_is_pinned)):
            assert any(part.startswith("_") for part in module.split(".")[1:]), (name, module)


# --- doctests -------------------------------------------------------------------------

# shardwise.testing starts worker processes in its examples; these tests stay pure.
SPAWNS_PROCESSES = ("shardwise.testing",)


def _modules() -> list[str]:
    names = ["shardwise"] + [m.name for m in pkgutil.walk_packages(shardwise.__path__, "shardwise.")]
    return [n for n in names if not n.startswith(SPAWNS_PROCESSES)]


MODULES = _modules()


@pytest.mark.parametrize("name", MODULES)
def test_module_doctests_pass(name: str) -> None:
    module = importlib.import_module(name)
    result = doctest.testmod(module, verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} doctest examples in {name} failed"


def test_the_layout_and_planning_modules_teach_by_example() -> None:
    # the docstring examples must not silently disappear
    for name in ("shardwise", "shardwise._placement", "shardwise._layout", "shardwise._redistribute._planner", "shardwise._explain"):
        tests = doctest.DocTestFinder().find(importlib.import_module(name))
        assert sum(len(t.examples) for t in tests) >= 1, name


def test_every_module_file_has_its_doctests_run() -> None:
    # a .py file outside any package (no __init__.py) would escape the doctest sweep
    files = {
        ".".join(("shardwise",) + p.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__")
        for p in SRC.rglob("*.py")
    }
    assert {n for n in files if not n.startswith(SPAWNS_PROCESSES)} == set(MODULES)


# --- forbidden imports ----------------------------------------------------------------

FORBIDDEN = (
    "torch.distributed.tensor",
    "torch.distributed._tensor",
    "torch.distributed.device_mesh",
    "torch.distributed.pipelining",
    "torch.distributed._shard",
    "torch.distributed.fsdp",
    "torch_xla",
)
_FORBIDDEN_RE = "|".join(re.escape(f) for f in FORBIDDEN)
# `import x`, `import a, x as y`, `from x import y`, `from x.sub import y`
IMPORT_LINE = re.compile(rf"^\s*(?:import\s+(?:[\w.]+(?:\s+as\s+\w+)?\s*,\s*)*|from\s+)(?:{_FORBIDDEN_RE})(?![\w])", re.M)


def forbidden_imports(source: str) -> list[str]:
    """Forbidden modules imported by `source`, by AST (any nesting) and by regex on the text."""
    found = [m.group(0).strip() for m in IMPORT_LINE.finditer(source)]
    for node in ast.walk(ast.parse(source)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            if any(name == f or name.startswith(f + ".") for f in FORBIDDEN):
                found.append(name)
    return found


@pytest.mark.parametrize(
    "source",
    [
        "import torch.distributed.tensor",
        "import torch.distributed.tensor as dt",
        "import os, torch_xla",
        "from torch.distributed.device_mesh import DeviceMesh",
        "from torch.distributed import fsdp",
        "from torch.distributed._shard.sharding_plan import ShardingPlan",
        "def f():\n    from torch.distributed.pipelining import pipeline\n",
        "from torch_xla.distributed import spmd as xs",
        "from torch.distributed._tensor import DTensor",
    ],
)
def test_the_forbidden_import_check_catches(source: str) -> None:
    assert forbidden_imports(source)


@pytest.mark.parametrize(
    "source",
    [
        "import torch.distributed as dist",
        "from torch.distributed import ProcessGroup",
        "import torch.distributed.tensor_parallel_helpers_of_ours",
        '"""Mirrors torch.distributed.tensor and torch_xla."""',
        "# from torch.distributed.tensor import DTensor",
        "from torch.utils import _pytree",
    ],
)
def test_the_forbidden_import_check_allows(source: str) -> None:
    assert forbidden_imports(source) == []


def test_no_file_under_src_imports_what_shardwise_replaces() -> None:
    files = sorted(SRC.rglob("*.py"))
    assert len(files) > 5
    offenders = {str(p.relative_to(SRC)): found for p in files if (found := forbidden_imports(p.read_text()))}
    assert offenders == {}
