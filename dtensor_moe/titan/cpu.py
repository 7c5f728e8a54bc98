"""Run torchtitan on CPU gloo ranks.

torchtitan picks its device once, at import of `torchtitan.tools.utils` (`"cuda"` when no
accelerator is visible), and other modules bind that choice with `from ... import device_type`.
`use_cpu()` must therefore run before any other torchtitan module is imported; it points torchtitan
at the CPU and a device-module stand-in with the few calls the Trainer makes (set_device, memory
statistics, ...). torch.distributed then picks gloo for the "cpu" device type.
"""

import os
import sys
import types


def _no_op(*args, **kwargs):
    return None


def _properties(device=None):
    pages, page_size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    return types.SimpleNamespace(total_memory=pages * page_size, name="cpu")


CPU_DEVICE_MODULE = types.SimpleNamespace(
    set_device=_no_op,
    device_count=lambda: 1,
    current_device=lambda: 0,
    synchronize=_no_op,
    get_device_name=lambda device=None: "cpu",
    get_device_properties=_properties,
    reset_peak_memory_stats=_no_op,
    empty_cache=_no_op,
    memory_stats=lambda device=None: {},
    is_available=lambda: True,
)


def use_cpu() -> None:
    """Make torchtitan run on CPU ranks (gloo). Call before importing any other torchtitan module."""
    import torchtitan.tools.utils as titan_utils

    titan_utils.device_type, titan_utils.device_module = "cpu", CPU_DEVICE_MODULE
    stale = [
        name
        for name, mod in list(sys.modules.items())
        if name.startswith("torchtitan.") and getattr(mod, "device_type", "cpu") != "cpu"
    ]
    if stale:
        raise ValueError(
            f"use_cpu() must run before these torchtitan modules are imported (they bound the device "
            f"type already): {stale}. Call it first, as `python -m dtensor_moe.titan.cpu_train` does."
        )
