"""The Triton kernels (CUDA fast paths), run by Triton's CPU interpreter, against a direct loop and
against the torch paths: the weighted gather-sum of both combines and its gradients, its
unweighted use (the dispatcher's gather_sum), the weight-gradient accumulation and the SwiGLU gate."""

import os
import subprocess
import sys

CHECK = r"""
import torch
from dtensor_moe.kernels import gather_sum as combine
from dtensor_moe.kernels import policy

def both(fn):
    # The same registered op through the Triton kernels (interpreted) and through the torch ops.
    out = []
    for use in (True, False):
        policy.runs_triton = lambda t, use=use: use
        out.append(fn())
    return out

torch.manual_seed(0)
# Weighted gather-sum: as the local combine (idx a permutation of the rows, [T, K]) and as the
# expert-side combine (rows read by up to K slots, empty slots -1, rows nobody reads have none).
CASES = [(7, 1, 5, 7, 0.0), (6, 2, 1030, 12, 0.0), (4, 8, 24, 32, 0.0), (9, 3, 16, 11, 0.6), (0, 2, 8, 0, 0.0)]
for R, K, D, N, empty in CASES:
    slots = torch.randperm(R * K)
    keep = slots[: N] if empty else slots
    idx = torch.full((R * K,), -1, dtype=torch.long)
    idx[keep] = torch.arange(keep.numel())
    idx_RK = idx.view(R, K)
    tok_N = keep // K  # the row whose slot reads each y row
    y_ND = torch.randn(keep.numel(), D, requires_grad=True)
    w_N = torch.rand(keep.numel(), requires_grad=True)
    dout = torch.randn(R, 1, D)
    want = torch.zeros(R, D)
    for r in range(R):
        for k in range(K):
            n = int(idx_RK[r, k])
            if n >= 0:
                want[r] += w_N[n].detach() * y_ND[n].detach()
    for got in both(lambda: combine.gather_sum(y_ND, idx_RK, tok_N, w_N).view(R, 1, D)):
        torch.testing.assert_close(got.view(R, D), want, rtol=1e-5, atol=1e-5)
    g_tri, g_torch = both(lambda: torch.autograd.grad(combine.gather_sum(y_ND, idx_RK, tok_N, w_N).view(R, 1, D),
                                                      [y_ND, w_N], dout))
    torch.testing.assert_close(g_tri[0], w_N.detach()[:, None] * dout.view(R, D)[tok_N], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(g_tri[1], (dout.view(R, D)[tok_N] * y_ND.detach()).sum(-1), rtol=1e-5, atol=1e-5)
    for a, b in zip(g_tri, g_torch):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # Without a router gradient the kernel skips the dot products but still returns the row gradients.
    for g_rows in both(lambda: torch.autograd.grad(
            combine.gather_sum(y_ND, idx_RK, tok_N, w_N.detach()).view(R, 1, D), [y_ND], dout)[0]):
        torch.testing.assert_close(g_rows, g_tri[0], rtol=1e-5, atol=1e-5)

# gather_sum (unweighted, the gradients of the dispatcher's token copies): empty slots (-1) are skipped.
for R, K, D, N in [(6, 3, 1030, 9), (4, 2, 5, 3), (0, 2, 8, 4)]:
    y_ND = torch.randn(N, D)
    idx_RK = torch.randint(-1, N, (R, K))
    rows = [sum((y_ND[i] for i in row if i >= 0), torch.zeros(D)) for row in idx_RK.tolist()]
    want = torch.stack(rows) if R else y_ND[:0]
    for got in both(lambda: combine.gather_sum(y_ND, idx_RK, idx_RK, None)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

# A non-finite row reaches only the rows whose slots read it: empty slots are masked, not weighted by 0.
y_ND = torch.randn(5, 8)
y_ND[0] = float("nan")
idx_RK = torch.tensor([[0, -1], [1, -1], [-1, -1], [2, 3], [4, -1]])
for got in both(lambda: combine.gather_sum(y_ND, idx_RK, idx_RK, torch.rand(5))) + both(
        lambda: combine.gather_sum(y_ND, idx_RK, idx_RK, None)):
    assert got[0].isnan().all() and got[1:].isfinite().all(), got

# wgrad_kernel: out[e] += alpha * g_e^T x_e; empty experts, rows not a multiple of the tile, partial tiles.
from dtensor_moe.kernels import wgrad as wgrad_kernel
for counts, O, I in [([5, 0, 70, 16], 40, 24), ([0, 0], 8, 8), ([33], 17, 130), ([3, 40], 24, 64)]:
    N = sum(counts)
    g_NO, x_NI = torch.randn(N, O), torch.randn(N, I)
    out = torch.randn(len(counts), O, I)
    want = out + 0.25 * torch.stack([a.t() @ b for a, b in zip(g_NO.split(counts), x_NI.split(counts))])
    ends = torch.tensor(counts).cumsum(0).to(torch.int32)
    # wide, tall, atomic epilogue; TMA's (the interpreter has no tensor reductions: there the atomic one); persistent
    # TMA operand loads (the interpreter runs them), alone and persistent
    for config in [(16, 32, 16, 4, 2), (32, 16, 16, 4, 2), (16, 32, 16, 4, 2, True), (16, 32, 16, 4, 2, True, True),
                   (16, 32, 16, 4, 2, False, False, 1), (32, 16, 16, 4, 2, True, False, 2),
                   (16, 32, 16, 4, 2, True, False, 0, True), (32, 16, 16, 4, 2, False, False, 1, True)]:
        got = out.clone()
        wgrad_kernel.accumulate(got, g_NO, x_NI, ends, 0.25, config=config)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
# A non-finite row of one expert reaches only that expert's gradient, also where whole steps load through TMA.
g_NO, x_NI, ends = torch.randn(60, 32), torch.randn(60, 16), torch.tensor([20, 60], dtype=torch.int32)
x_NI[20] = float("inf")
for config in [(16, 16, 16, 4, 2), (16, 16, 16, 4, 2, False, False, 0, True)]:
    got = torch.zeros(2, 32, 16)
    wgrad_kernel.accumulate(got, g_NO, x_NI, ends, 1.0, config=config)
    assert got[0].isfinite().all() and not got[1].isfinite().all()

# swiglu_kernel: h = silu(a) * b and its gradient [da, db], against autograd on the torch ops (fp32 math);
# a and b also as the strided halves of one [N, 2F] GEMM output, as the experts pass them.
from dtensor_moe.kernels import swiglu as swiglu_kernel
for shape in [(0, 4), (7,), (50, 100)]:
    a, b, dh = torch.randn(shape), torch.randn(shape), torch.randn(shape)
    a_, b_ = a.clone().requires_grad_(True), b.clone().requires_grad_(True)
    h = torch.nn.functional.silu(a_) * b_
    h.backward(dh)
    ab = torch.cat([a, b], dim=-1)
    for a_in, b_in in [(a, b), ab.chunk(2, dim=-1)]:
        torch.testing.assert_close(swiglu_kernel.triton_forward(a_in, b_in), h.detach(), rtol=1e-5, atol=1e-6)
        dab = swiglu_kernel.triton_backward(dh, a_in, b_in)
        torch.testing.assert_close(dab, torch.cat([a_.grad, b_.grad], dim=-1), rtol=1e-5, atol=1e-6)
    # The clamped gate (gpt-oss) against its torch path, inputs spread past the limit on both sides.
    a, b = a * 3, b * 3
    h = swiglu_kernel.torch_clamped_forward(a, b, 1.702, 2.0)
    torch.testing.assert_close(swiglu_kernel.triton_forward(a, b, (1.702, 2.0)), h, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(swiglu_kernel.triton_backward(dh, a, b, (1.702, 2.0)),
                               swiglu_kernel.torch_clamped_backward(dh, a, b, 1.702, 2.0), rtol=1e-5, atol=1e-6)
# The minimal-memory experts' weighted gate backward (a row per program, F looped in blocks: F 2500 takes three)
# against its torch path, both gates, a and b the strided halves of one [N, 2F] output.
for N, F_ in [(0, 8), (9, 100), (3, 2500)]:
    ab, du, w = torch.randn(N, 2 * F_) * 3, torch.randn(N, F_), torch.rand(N)
    for clamp in (None, (1.702, 2.0)):
        got = swiglu_kernel.triton_weighted_backward(du, *ab.chunk(2, dim=-1), w, clamp)
        want = swiglu_kernel.torch_weighted_backward(du, *ab.chunk(2, dim=-1), w, clamp)
        for g, t in zip(got, want):
            torch.testing.assert_close(g, t, rtol=1e-5, atol=1e-4)
# fp8: the two quantization kernels' indexing, padding and scales against the torch path. The values
# are e4m3 codes with amax 448 per scaled span, so no rounding happens: the interpreter rounds
# float32 -> e4m3 wrongly at exponent carries (126.8 -> 64); CUDA's rounding is checked on the GPU.
from dtensor_moe.kernels import fp8

def codes(*shape):
    return torch.randn(*shape).mul(100).clamp(-448, 448).to(fp8.FP8).float()

for M, K in [(5, 40), (3, 1030), (0, 16)]:
    x = codes(M, K)
    x[:, 0] = 448
    a, b = both(lambda: fp8.quantize_rows(x))
    assert torch.equal(a[0].float(), b[0].float()) and torch.equal(a[1], b[1])
    assert torch.equal(a[0].float(), x)
    if M:  # rows of a strided view (the up half of a [M, 2K] gradient) read in place
        wide = torch.cat([codes(M, K), x], dim=1)
        a, b = both(lambda: fp8.quantize_rows(wide[:, K:]))
        assert torch.equal(a[0].float(), x) and torch.equal(a[1], b[1])
offs = torch.tensor([5, 5, 22], dtype=torch.int32)
x, w = codes(22, 70), codes(3, 20, 70)
x[[0, 5]] = 448
w[:, 0] = -448
for t, layout, args in [(x, "token_cols", (offs,)), (w, "weight_cols", (None,))]:
    a, b = both(lambda: fp8._quantize(t, layout, *args))
    assert torch.equal(a[1], b[1])
    valid = torch.ones(b[0].shape, dtype=torch.bool)  # token_cols leaves the tail after the last block unset
    if layout == "token_cols":
        valid[:, int(b[2][-1]):] = False
    assert torch.equal(a[0].float()[valid], b[0].float()[valid])
# benchmarks/ragged_gemm_probe.py's grouped GEMM (128-row tiles, then 64-row tails, scheduled on the device)
# against a per-expert loop: empty experts, whole tiles, tails under and over 64 rows, both weight layouts.
import sys
sys.path.insert(0, "benchmarks")
from ragged_gemm_probe import ragged_mm
for counts in ([0, 130, 5, 200], [128, 0, 0, 64], [0, 0, 0, 0], [300, 1, 63, 65]):
    ends = torch.cumsum(torch.tensor(counts), 0)
    x = torch.randn(int(ends[-1]), 48)
    for w_EIO in (torch.randn(4, 40, 48).transpose(-2, -1), torch.randn(4, 48, 40)):
        want = torch.cat([x[a:b] @ w_EIO[e] for e, (a, b) in enumerate(zip([0, *ends[:-1].tolist()], ends.tolist()))])
        got = ragged_mm(x, w_EIO, ends.to(torch.int32), (32, 16, 4, 2))
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
print("ok")
"""


def test_triton_kernels_match_torch_in_triton_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=600,
                          check=False, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def test_wgrad_config_follows_the_measured_table(tmp_path, monkeypatch):
    from dtensor_moe.kernels import policy, wgrad
    # The committed table: DeepSeek-like gradients (256 rows per expert) take BLOCK_K 32 with TMA's loads and
    # reduce-add, Mixtral-like w1/w3 ones ([F, D] = [14336, 4096], 2048 rows) BLOCK_K 16 in 6 stages, E64's w1/w3
    # the wide tile persistent; an unmeasured (O, I) the default; gate and up's [2F, D] its own row.
    assert policy.wgrad_config((256, 2048, 7168), 65536) == wgrad.TileConfig(128, 128, 32, 4, 4, True, True, 0, True)
    assert policy.wgrad_config((8, 14336, 4096), 16384) == wgrad.TileConfig(128, 128, 16, 4, 6, True, True)
    assert policy.wgrad_config((64, 1536, 4096), 98304) == wgrad.TileConfig(128, 256, 64, 8, 3, True, True, 1)
    assert policy.wgrad_config((8, 14336, 2048), 16384) == wgrad.DEFAULT_TILES
    assert policy.wgrad_config((256, 4096, 7168), 65536) == wgrad.TileConfig(128, 128, 32, 4, 4, True, True, 0, True)
    table = tmp_path / "wgrad.json"
    table.write_text('{"configs": [{"O": 64, "I": 32, "rows_per_expert": 100, "config": [16, 32, 16, 4, 2]},'
                     ' {"O": 64, "I": 32, "rows_per_expert": 1000, "config": [32, 16, 16, 4, 2]}]}')
    monkeypatch.setenv("DTENSOR_MOE_WGRAD_CONFIGS", str(table))
    # The nearest measured rows per expert on a log scale: 250 is nearer 100 than 1000, 400 nearer 1000.
    assert policy.wgrad_config((4, 64, 32), 4 * 250) == wgrad.TileConfig(16, 32, 16, 4, 2)
    assert policy.wgrad_config((4, 64, 32), 4 * 400) == wgrad.TileConfig(32, 16, 16, 4, 2)
    assert policy.wgrad_config((4, 32, 64), 4 * 400) == wgrad.DEFAULT_TILES
    # Gate and up's gradient together ([2F, D]) where only one half's was measured: the tiles measured for a half.
    assert policy.wgrad_config((4, 128, 32), 4 * 100) == wgrad.TileConfig(16, 32, 16, 4, 2)
