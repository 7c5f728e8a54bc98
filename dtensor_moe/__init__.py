"""dtensor_moe: DTensor-native Mixture-of-Experts parallelism (EP x EDP x ETP folded over FSDP2).

Exports resolve lazily (PEP 562) so torch-free tools (`dtensor-moe plan`) start fast.
"""

import importlib

_EXPORTS = {
    "GroupedExperts": "experts",
    "grouped_swiglu": "experts",
    "MoE": "moe",
    "MoEConfig": "config",
    "MoEMeshes": "mesh",
    "MoEParallelDims": "mesh",
    "Ownership": "plan",
    "ShardStep": "plan",
    "WeightPlan": "plan",
    "owned_box": "plan",
    "ownership": "plan",
    "plan_moe": "plan",
    "parallelize_moe": "parallelize",
    "parallelize_model": "parallelize",
    "TopKRouter": "router",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'dtensor_moe' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
