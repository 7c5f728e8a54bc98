"""The Triton kernels (CUDA fast paths) against torch, run by Triton's CPU interpreter: the combine
and its unweighted use (the dispatcher's gather_sum), and the weight-gradient accumulation."""

import os
import subprocess
import sys

CHECK = r"""
import torch
from dtensor_moe import combine_kernel
from dtensor_moe.moe import _WeightedSum, gather_rows, inverse_permutation

torch.manual_seed(0)
for T, K, D in [(7, 1, 5), (6, 2, 1030), (5, 3, 16), (4, 8, 24), (0, 2, 8)]:
    N = T * K
    order_N = torch.randperm(N)
    rank_N = inverse_permutation(order_N)
    y_ND = torch.randn(N, D, requires_grad=True)
    w_TK = torch.rand(T, K, requires_grad=True)
    dy = torch.randn(T, 1, D)
    ref = _WeightedSum.apply(w_TK, gather_rows(y_ND, rank_N, order_N).view(T, K, D), (T, 1, D))
    got = combine_kernel.gather_weighted_sum(y_ND, rank_N.view(T, K), w_TK, (T, 1, D))
    g_ref = torch.autograd.grad(ref, [y_ND, w_TK], dy)
    g_got = torch.autograd.grad(got, [y_ND, w_TK], dy)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    for a, b in zip(g_got, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # Without a router gradient the kernel skips the dot products but still returns the row gradients.
    w_fixed = w_TK.detach()
    out = combine_kernel.gather_weighted_sum(y_ND, rank_N.view(T, K), w_fixed, (T, 1, D))
    (g_rows,) = torch.autograd.grad(out, [y_ND], dy)
    torch.testing.assert_close(g_rows, g_ref[0], rtol=1e-5, atol=1e-5)

# gather_sum (the dispatcher's gradient of its token copies): empty slots (-1) are skipped.
from dtensor_moe.dispatch import _gather_sum
for R, K, D, N in [(6, 3, 1030, 9), (4, 2, 5, 3), (0, 2, 8, 4)]:
    y_ND = torch.randn(N, D)
    idx_RK = torch.randint(-1, N, (R, K))
    want = torch.stack([sum((y_ND[i] for i in row if i >= 0), torch.zeros(D)) for row in idx_RK.tolist()]) if R else y_ND[:0]
    torch.testing.assert_close(combine_kernel.gather_sum(y_ND, idx_RK), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(_gather_sum(y_ND, idx_RK), want, rtol=1e-5, atol=1e-5)  # the torch path on CPU

# wgrad_kernel: out[e] += alpha * g_e^T x_e; empty experts, rows not a multiple of the tile, partial tiles.
from dtensor_moe import wgrad_kernel
for counts, O, I in [([5, 0, 70, 16], 40, 24), ([0, 0], 8, 8), ([33], 17, 130)]:
    N = sum(counts)
    g_NO, x_NI = torch.randn(N, O), torch.randn(N, I)
    out = torch.randn(len(counts), O, I)
    want = out + 0.25 * torch.stack([a.t() @ b for a, b in zip(g_NO.split(counts), x_NI.split(counts))])
    ends = torch.tensor(counts).cumsum(0).to(torch.int32)
    wgrad_kernel.accumulate(out, g_NO, x_NI, ends, 0.25, config=(16, 32, 16, 4, 2))
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
print("ok")
"""


def test_triton_kernels_match_torch_in_triton_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=600,
                          check=False)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
