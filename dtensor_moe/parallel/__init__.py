"""Parallelism: the folded meshes, the placement plan, the expert-parallel dispatch, and ExpertParallel /
parallelize_moe that apply them."""
