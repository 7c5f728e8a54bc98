"""One DeepSeek-like E256 weight-gradient accumulation (kernels/wgrad.py, the policy's config) and one
fresh `torch._grouped_mm` weight gradient at the same shape, for Nsight Compute to read counters of:

    ncu --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis \\
        -k regex:'wgrad|cutlass' -c 2 python3 benchmarks/wgrad_counters.py

(RESULTS.md session 7: whether these kernels are bound by L2 or DRAM throughput.)
"""

import torch

from dtensor_moe.kernels import wgrad
from dtensor_moe.kernels.grouped_mm import grouped_weight_grad

D, F, E, N = 7168, 2048, 256, 8192 * 8


def main():
    dev = torch.device("cuda")
    torch.manual_seed(0)
    counts = torch.bincount(torch.randint(E, (N,)), minlength=E)
    ends = counts.cumsum(0).to(device=dev, dtype=torch.int32)
    g_NO = torch.randn(N, F, device=dev, dtype=torch.bfloat16)
    x_NI = torch.randn(N, D, device=dev, dtype=torch.bfloat16)
    out = torch.randn(E, F, D, device=dev, dtype=torch.bfloat16)
    wgrad.accumulate(out, g_NO, x_NI, ends, 0.5)
    grouped_weight_grad(g_NO, x_NI, ends)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
