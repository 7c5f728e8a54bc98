"""Run torchtitan on CPU gloo ranks.

torchtitan picks its device once, at import of `torchtitan.tools.utils` (`"cuda"` when no
accelerator is visible), and other modules bind that choice with `from ... import device_type`.
`use_cpu()` points torchtitan (that module and every loaded module that bound its choice)
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
    """Make torchtitan run on CPU ranks (gloo). Safe to call at any time, also after torchtitan modules
    were imported: the modules that bound the device with `from torchtitan.tools.utils import ...` read
    it only when called, so their bindings are pointed at the CPU too (a test process that imported
    torchtitan for another purpose first is the usual case)."""
    import torchtitan.tools.utils as titan_utils

    bound = {"device_type": titan_utils.device_type, "device_module": titan_utils.device_module}
    cpu = {"device_type": "cpu", "device_module": CPU_DEVICE_MODULE}
    for name, mod in list(sys.modules.items()):
        if name == "torchtitan" or name.startswith("torchtitan."):
            for attr, old in bound.items():
                if getattr(mod, attr, None) is old:
                    setattr(mod, attr, cpu[attr])
