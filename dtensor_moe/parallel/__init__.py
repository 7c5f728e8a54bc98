"""Parallelism: the folded meshes, the placement plan, the expert-parallel dispatch, and ExpertParallel /
parallelize_moe that apply them."""

# Nothing is re-exported here: the public modules, each imported by its own name.
__all__ = [
    "activation_checkpoint", "blocks", "compile", "cp_attention", "dispatch", "exchange", "expert_parallel",
    "inductor_grid", "mesh", "placement", "replica_dispatch", "replicas", "shard",
]
