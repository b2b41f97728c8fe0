"""What torchtitan 0.3 needs to run on CPU and gloo, for either train spec.

torchtitan targets accelerators: with no GPU it still picks "cuda" and calls
`torch.cuda.set_device`. Nothing here touches shardwise or the model; it gives the trainer
a CPU device module, turns off one call that torch 2.13 lacks, and (for torch's own FSDP2
only) sums gradients in the collective, because gloo has no PREMUL_SUM.
"""

import sys
import types

import torch


class _Properties:
    name = "cpu"
    total_memory = 1 << 36


def _cpu_module() -> types.SimpleNamespace:
    return types.SimpleNamespace(
        set_device=lambda device: None, device_count=lambda: 1, current_device=lambda: 0,
        get_device_name=lambda device=None: "cpu", get_device_properties=lambda device=None: _Properties(),
        memory_stats=lambda device=None: {}, reset_peak_memory_stats=lambda device=None: None,
        empty_cache=lambda: None, synchronize=lambda device=None: None, is_available=lambda: True,
        manual_seed=torch.manual_seed, manual_seed_all=torch.manual_seed)


def use_cpu() -> None:
    """Point torchtitan's device type and module at the CPU (call before building a trainer)."""
    import torchtitan.components.metrics  # noqa: F401  (imported so their copies are patched too)
    import torchtitan.distributed.utils as dist_utils
    import torchtitan.tools.utils as utils
    import torchtitan.trainer  # noqa: F401

    module = _cpu_module()
    utils.device_type, utils.device_module = "cpu", module
    for name, loaded in list(sys.modules.items()):
        if name.startswith("torchtitan") and loaded is not None:
            if getattr(loaded, "device_type", None) == "cuda":
                loaded.device_type = "cpu"
            if getattr(loaded, "device_module", None) is torch.cuda:
                loaded.device_module = module
    if not hasattr(torch.distributed, "set_timeout"):  # torch 2.13: keep the launch timeout
        dist_utils.set_pg_timeouts = lambda **kwargs: None


def gloo_sum_reduction(parallelize_fn):
    """torch's FSDP2 reduces with PREMUL_SUM once a divide factor is set, and gloo has
    none: ask it to sum in the collective and divide after (the same numbers)."""
    def parallelize(model, **kwargs):
        from torch.distributed.fsdp import FSDPModule
        model = parallelize_fn(model, **kwargs)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
        return model
    return parallelize
