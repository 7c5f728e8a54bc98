"""Parallelism: the folded meshes, the placement plan, the expert-parallel dispatch, and parallelize_* that applies them."""
