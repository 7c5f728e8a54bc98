"""dtensor_moe: DTensor-native Mixture-of-Experts parallelism (EP x EDP x ETP folded over FSDP2).

The layer: `MoE` (configured by `MoEConfig`, its architecture, and `MoERunOptions`, how a run computes it; its
parts `TopKRouter`, `GroupedExperts`, `grouped_swiglu`).
Parallelizing it: `MoEParallelDims` (the degrees; `MoEMeshes` their meshes), then `ExpertParallel` in a
`parallelize_module` plan (with `compile_moe` and `fully_shard_moe` after it) or `parallelize_moe`, the three
chained over a module tree. The placement plan they follow:
`plan_moe` (`WeightPlan`, `ShardStep`), `owned_box`, `ownership` (`Ownership`). Routing replay:
`record_routing`, `replay_routing` (`RoutingReplay`). Raised to be caught: `RowCapExceeded`.
Subpackages: `dtensor_moe.hf` (Hugging Face weights and models), `dtensor_moe.titan` (the torchtitan hook),
`dtensor_moe.train` (the `dtensor-moe train` job), `dtensor_moe.tools.folding` (the folding search).

Exports resolve lazily (PEP 562) so torch-free tools (`dtensor-moe plan`) start fast.
"""

import importlib

_EXPORTS = {
    "ExpertParallel": "parallel.expert_parallel",
    "compile_moe": "parallel.expert_parallel",
    "fully_shard_moe": "parallel.expert_parallel",
    "GroupedExperts": "experts",
    "grouped_swiglu": "kernels.expert_autograd",
    "MoE": "moe",
    "balance_loss": "moe",
    "MoEConfig": "config",
    "MoERunOptions": "config",
    "MoEMeshes": "parallel.mesh",
    "MoEParallelDims": "parallel.mesh",
    "Ownership": "parallel.placement",
    "ShardStep": "parallel.placement",
    "WeightPlan": "parallel.placement",
    "owned_box": "parallel.placement",
    "ownership": "parallel.placement",
    "plan_moe": "parallel.placement",
    "record_routing": "replay",
    "replay_routing": "replay",
    "RoutingReplay": "replay",
    "RowCapExceeded": "parallel.dispatch",
    "parallelize_moe": "parallel.expert_parallel",
    "TopKRouter": "routing.router",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'dtensor_moe' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
