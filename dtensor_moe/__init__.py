"""dtensor_moe: DTensor-native Mixture-of-Experts parallelism (EP x EDP x ETP folded over FSDP2)."""

from .config import MoEConfig
from .experts import GroupedExperts, grouped_swiglu
from .mesh import MoEMeshes, MoEParallelDims
from .moe import MoE
from .parallelize import parallelize_moe
from .plan import Ownership, ShardStep, WeightPlan, owned_box, ownership, plan_moe
from .router import TopKRouter

__all__ = [
    "GroupedExperts",
    "MoE",
    "MoEConfig",
    "MoEMeshes",
    "MoEParallelDims",
    "Ownership",
    "ShardStep",
    "TopKRouter",
    "WeightPlan",
    "grouped_swiglu",
    "owned_box",
    "ownership",
    "parallelize_moe",
    "plan_moe",
]
