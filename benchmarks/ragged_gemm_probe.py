"""Issue 27 item 2, a probe: does a Triton grouped GEMM that cuts each expert's rows into whole 128-row tiles
plus 64-row tail tiles beat torch._grouped_mm on ragged counts? One GPU, bf16, before any library change.

    python benchmarks/ragged_gemm_probe.py --out ragged_gemm_probe.json   # one H200, ~2 minutes

torch._grouped_mm (CUTLASS on sm90) runs each expert's rows in fixed-height tiles: at 256 +- 15 rows per expert half
the experts spill into a third tile and the forward loses ~27% (measured on one H200: this probe's `exact` counts
against its `topk` ones show it). Here two launches of one
kernel: every expert's first 128 * floor(c / 128) rows in 128-row tiles, then the rest in 64-row tiles, so a tile
wastes at most 63 rows. Tiles are scheduled from the device counts alone (no host read): program t of a launch
belongs to the expert whose cumulative tile count first exceeds t (a binary search over E), programs past the last
tile exit; within an expert the row tile varies fastest, so the tiles sharing a column block of its weight run
together. Per shape (moe_layer.py's four) and counts (`exact`: equal; `topk`: top-k of random logits, as the layer
benchmarks route; `round128`: topk's rounded to multiples of 128), the forward x @ w^T ([N, D] x [E, F, D]) and the
input gradient dy @ w ([N, F] x [E, F, D]), TFLOP/s from CUDA-event medians, for torch._grouped_mm and the best
of CONFIGS; the outputs are checked against torch._grouped_mm. Also torch._grouped_mm itself made to pick its
small tiles (small_tile_groups; --no-triton: only that). Correctness of the launcher runs on CPU under
TRITON_INTERPRET=1 (tests/test_triton_kernels.py).
"""

import functools
import json

import _checkout  # noqa: F401  (this checkout on sys.path: tools/tune/ holds the GEMM timer)
import torch

from tools.tune.expert_gemms import cuda_ms, probe_cli, rel

SHAPES = {"deepseek": (7168, 2048, 256, 8, 8192), "qwen": (2048, 768, 128, 8, 16384),
          "mixtral": (4096, 14336, 8, 2, 8192), "e64": (4096, 1536, 64, 6, 16384)}  # D, F, E, K, T
# (BLOCK_N, BLOCK_K, warps, stages) of the 128-row launch; the 64-row tails take (BLOCK_N, BLOCK_K, 4, stages).
CONFIGS = [(256, 64, 8, 3), (128, 64, 4, 4), (128, 128, 8, 3), (256, 32, 8, 4)]


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def ragged_mm(x_ptr, w_ptr, y_ptr, begin_ptr, end_ptr, tile_end_ptr, E, O, I, stride_we, stride_wo, stride_wi,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # y[rows of e] = x[rows of e] @ W_e, W_e[k, n] at w_ptr + e * stride_we + n * stride_wo + k * stride_wi.
        # Programs run expert by expert, column block by column block, row tile fastest: the row tiles of one
        # expert that share a column block of W_e run side by side and read it once from HBM.
        t = tl.program_id(0)
        lo = t * 0  # int32 tensors, not constants: the loop below reassigns them (E may be specialized to 1)
        hi = lo + E
        while lo < hi:  # the expert of program t: the first whose cumulative tile count exceeds t
            mid = (lo + hi) // 2
            if tl.load(tile_end_ptr + mid) > t:
                hi = mid
            else:
                lo = mid + 1
        if lo < E:
            e = lo
            local = t - tl.load(tile_end_ptr + e - 1, mask=e > 0, other=0)
            begin = tl.load(begin_ptr + e).to(tl.int64)
            row_end = tl.load(end_ptr + e).to(tl.int64)
            row_tiles = (row_end - begin + BLOCK_M - 1) // BLOCK_M
            rm = begin + (local % row_tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
            rn = (local // row_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
            rk = tl.arange(0, BLOCK_K)
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            w_e = w_ptr + e.to(tl.int64) * stride_we
            for k0 in range(0, I, BLOCK_K):
                kk = k0 + rk
                a = tl.load(x_ptr + rm[:, None] * I + kk[None, :], mask=(rm[:, None] < row_end) & (kk[None, :] < I),
                            other=0.0)
                b = tl.load(w_e + rn[None, :] * stride_wo + kk[:, None] * stride_wi,
                            mask=(rn[None, :] < O) & (kk[:, None] < I), other=0.0)
                acc = tl.dot(a, b, acc)
            tl.store(y_ptr + rm[:, None] * O + rn[None, :], acc.to(y_ptr.dtype.element_ty),
                     mask=(rm[:, None] < row_end) & (rn[None, :] < O))

    return triton, ragged_mm


def ragged_mm(x_NI: torch.Tensor, w_EIO: torch.Tensor, offs_E: torch.Tensor, config=CONFIGS[0]) -> torch.Tensor:
    """torch._grouped_mm(x_NI, w_EIO, offs=offs_E) (w_EIO may be a transposed view) in 128-row tiles, then 64-row
    tails. No host read: the grid is the tile count's bound, cdiv(N, BLOCK_M) + E."""
    triton, kernel = _kernel()
    block_n, block_k, warps, stages = config
    N, I = x_NI.shape
    E, O = w_EIO.shape[0], w_EIO.shape[2]
    y = torch.empty(N, O, dtype=x_NI.dtype, device=x_NI.device)
    ends = offs_E.to(torch.int64)
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    bulk_end = starts + (ends - starts) // 128 * 128
    col_blocks = triton.cdiv(O, block_n)
    for block_m, begin, end, w in ((128, starts, bulk_end, warps), (64, bulk_end, ends, 4)):
        tile_end = torch.cumsum((end - begin + block_m - 1) // block_m * col_blocks, 0)
        grid = ((triton.cdiv(N, block_m) + E) * col_blocks,)
        kernel[grid](x_NI.contiguous(), w_EIO, y, begin, end, tile_end, E, O, I, w_EIO.stride(0), w_EIO.stride(2),
                     w_EIO.stride(1), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=w,
                     num_stages=stages)
    return y


def small_tile_groups(w_EIO: torch.Tensor, offs_E: torch.Tensor, rows: int):
    """The same GEMM as torch._grouped_mm(x, w_EIO, offs_E) over `rows` rows in G * (E - 1) + 1 groups, expert e's
    rows in group G * e and the others empty, G the smallest power of two that brings the mean rows per group to
    128 or fewer: there torch's sm90 kernel picks 64 x 128 tiles (128-row granularity with its 2 x 1 cluster), else
    128 x 256 tiles (256-row granularity). The extra groups are views 1/G of an expert apart into the same weights
    (no copy); having no rows, they read nothing. None where that needs 1024 groups or more (the kernel's limit)."""
    E, G = w_EIO.shape[0], 1
    while rows > 128 * (G * (E - 1) + 1) or w_EIO.stride(0) % G:
        G *= 2
        if E == 1 or G * (E - 1) + 1 >= 1024:  # one expert has no room for views after it
            return None
    n = G * (E - 1) + 1
    w = w_EIO.as_strided((n, *w_EIO.shape[1:]), (w_EIO.stride(0) // G, *w_EIO.stride()[1:]))
    return w, offs_E.repeat_interleave(G)[:n]


def counts_for(mode: str, T: int, E: int, K: int, dev) -> torch.Tensor:
    ids = torch.randn(T, E, device=dev, generator=torch.Generator(dev).manual_seed(0)).topk(K, -1).indices
    topk = torch.bincount(ids.flatten(), minlength=E)
    if mode == "exact":
        c = torch.full((E,), T * K // E, device=dev, dtype=torch.int64)
        c[-1] += T * K - int(c.sum())
        return c
    return topk if mode == "topk" else (torch.round(topk.float() / 128) * 128).long()


def main():
    args, dev, res = probe_cli(__doc__, SHAPES, (("--no-triton",), {"action": "store_true",
                                                                     "help": "torch._grouped_mm's two ways only"}))
    res["rows"] = []
    for name in args.shapes:
        D, F, E, K, T = SHAPES[name]
        w = torch.randn(E, F, D, device=dev, dtype=torch.bfloat16) * 0.02
        for mode in ("exact", "topk", "round128"):
            c = counts_for(mode, T, E, K, dev)
            offs = torch.cumsum(c, 0).to(torch.int32)
            N = int(offs[-1])
            for gemm, x, w_op in (("fwd", torch.randn(N, D, device=dev, dtype=torch.bfloat16), w.transpose(-2, -1)),
                                  ("dgrad", torch.randn(N, F, device=dev, dtype=torch.bfloat16), w)):
                flops = 2 * N * D * F
                want = torch._grouped_mm(x, w_op, offs=offs).float()
                row = {"shape": name, "counts": mode, "gemm": gemm, "rows_max": int(c.max()), "rows_mean": N / E,
                       "torch_tflops": flops / cuda_ms(lambda: torch._grouped_mm(x, w_op, offs=offs)) / 1e9}
                small = small_tile_groups(w_op, offs, N)
                if small is not None:
                    w_small, offs_small = small
                    got = torch._grouped_mm(x, w_small, offs=offs_small)
                    row["small_rel_err"] = rel(got, want)
                    row["torch_small_tflops"] = flops / cuda_ms(
                        lambda: torch._grouped_mm(x, w_small, offs=offs_small)) / 1e9
                for cfg in [] if args.no_triton else CONFIGS:
                    try:
                        got = ragged_mm(x, w_op, offs, cfg)
                        err = rel(got, want)
                        tf = flops / cuda_ms(lambda cfg=cfg: ragged_mm(x, w_op, offs, cfg)) / 1e9
                    except Exception as e:  # noqa: BLE001 - a config that does not compile is recorded, not fatal
                        row.setdefault("errors", {})[str(cfg)] = f"{type(e).__name__}: {str(e)[:200]}"
                        continue
                    if tf > row.get("triton_tflops", 0):
                        row.update(triton_tflops=tf, triton_config=cfg, rel_err=err)
                row["ratio"] = row.get("triton_tflops", 0) / row["torch_tflops"]
                res["rows"].append(row)
                print(f"{name:9s} {mode:8s} {gemm:5s} rows {N / E:.0f}/{int(c.max())}: torch._grouped_mm "
                      f"{row['torch_tflops']:.0f}, in small tiles {row.get('torch_small_tflops', 0):.0f} "
                      f"(err {row.get('small_rel_err', float('nan')):.1e}), "
                      f"ragged tiles {row.get('triton_tflops', 0):.0f} TFLOP/s "
                      f"({row['ratio']:.2f}x, {row.get('triton_config')}, err {row.get('rel_err', float('nan')):.1e})",
                      flush=True)
                with open(args.out, "w") as f:
                    json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
