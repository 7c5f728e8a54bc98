"""The layer's compute kernels as registered `torch.library` ops (`torch.ops.dtensor_moe.*`).

Each op has a torch implementation (every device; exact in float64), a CUDA implementation where a
Triton kernel pays, a fake implementation for torch.compile, and autograd where it is differentiated
directly. `policy.py` alone decides which implementation runs.
"""

# Nothing is re-exported here: the public modules, each imported by its own name.
# wgrad_triton holds wgrad's Triton kernels and imports Triton: wgrad loads it where it runs.
__all__ = [
    "counters", "expert_autograd", "fp8", "gather_sum", "grouped_mm", "policy", "recompute", "segment_sum", "swiglu",
    "wgrad",
]
