"""The experts' weight gradients as one Triton kernel that adds into .grad: out[e] += alpha * g_e^T x_e.

`torch._grouped_mm` has no beta, so accumulating its result into an existing gradient costs a
read-add-write pass over the whole gradient (11 GB per rank at the DeepSeek-like shape); a cuBLAS
`addmm_` per expert does the sum in the GEMM but costs a launch per expert and, for the [F, D]
orientation of w1/w3, cuBLAS picks a slow tile (benchmarks/RESULTS.md). This kernel reads each
output tile once, adds the fp32 product, and writes it back: one launch per weight. Programs run
expert by expert, so an expert's rows stay in L2 while all its output tiles read them.
At few rows per expert the kernel waits on the epilogue's read of the output tile, which nothing overlaps
(Nsight Compute): the `atomic` epilogue instead rounds the product to the gradient's dtype and adds it in
L2, which rounds as autograd's `grad += new` does; each element gets one add, so the result does not depend
on timing. The `tma` epilogue does that add as one bulk tensor reduction per tile (the SM issues one
instruction and moves on), which paid at 256 rows per expert; `per_sm` makes the grid persistent, so the
next tile's loop overlaps the last one's reduction (it paid only with the wide tile). The variants that
measured slower on H200 (the output tile loaded before the K loop, persistent read-add-write kernels,
Triton's warp specialization of the K loop) are recorded in benchmarks/RESULTS.md.

Launched by the `dtensor_moe::add_weight_grad_` op (grouped_mm.py) where policy.weight_grad_accumulation
chooses it, with the tile config policy.wgrad_config picks for the shape; tests run it on CPU under
TRITON_INTERPRET=1 (the interpreter has no tensor reductions: there `tma` runs the atomic epilogue;
tests/gpu/gpu_ops_check.py checks it on the GPU).
"""

from typing import NamedTuple

import torch


class TileConfig(NamedTuple):
    """A tile of BLOCK_O x BLOCK_I outputs, BLOCK_K rows a step, its warps and pipeline stages;
    `atomic`: the epilogue adds the tile into the gradient with one bf16 atomic add per element
    (in L2, nothing for the program to wait on) instead of reading, adding in fp32 and writing it;
    `tma`: that add as one bulk tensor reduction per tile (TMA's reduce-add, sm90), not one per element;
    `per_sm`: a persistent grid of that many programs per SM, each looping over tiles (0: a program per tile);
    `tma_loads`: the operands' whole BLOCK_K steps through TMA (sm90), an expert's partial last step masked."""
    block_o: int
    block_i: int
    block_k: int
    warps: int
    stages: int
    atomic: bool = False
    tma: bool = False
    per_sm: int = 0
    tma_loads: bool = False


# Where policy.wgrad_config has no measurement: the best measured at the DeepSeek-like shape (two
# programs fit on an SM, so one's epilogue overlaps the other's loop), within 7% of the best at Qwen's.
DEFAULT_TILES = TileConfig(128, 128, 64, 4, 3)


def accumulate(out_EOI: torch.Tensor, g_NO: torch.Tensor, x_NI: torch.Tensor, ends_E: torch.Tensor,
               alpha: float, config: TileConfig = DEFAULT_TILES) -> None:
    """out_EOI[e] += alpha * g^T x over rows ends_E[e-1]:ends_E[e] (ends_E: the grouped GEMMs' offsets)."""
    E, O, I = out_EOI.shape
    if E == 0 or g_NO.shape[0] == 0:
        return
    import triton

    from dtensor_moe.kernels import wgrad_triton  # imports Triton: only where a kernel runs

    block_o, block_i, block_k, warps, stages, atomic, tma, per_sm, tma_loads = TileConfig(*config)
    sm90 = out_EOI.is_cuda and torch.cuda.get_device_capability(out_EOI.device) >= (9, 0)
    if out_EOI.is_cuda and not sm90:
        atomic = False  # 16-bit float atomic adds are native from sm90 on: elsewhere read-add-write
    # TMA (sm90; Triton's interpreter has no tensor reductions) needs 16-byte aligned rows and bases.
    g_NO, x_NI = g_NO.contiguous(), x_NI.contiguous()
    tma = tma and sm90 and _tma_ok(out_EOI)
    tma_loads = tma_loads and (sm90 or not out_EOI.is_cuda) and _tma_ok(g_NO) and _tma_ok(x_NI)
    out_desc, g_desc, x_desc = out_EOI, g_NO, x_NI
    if tma or tma_loads:
        from triton.tools.tensor_descriptor import TensorDescriptor
    if tma:
        out_desc = TensorDescriptor.from_tensor(out_EOI, [1, block_o, block_i])
    if tma_loads:
        g_desc = TensorDescriptor.from_tensor(g_NO, [block_k, block_o])
        x_desc = TensorDescriptor.from_tensor(x_NI, [block_k, block_i])
    tiles = triton.cdiv(O, block_o) * triton.cdiv(I, block_i)
    if per_sm:
        sms = torch.cuda.get_device_properties(out_EOI.device).multi_processor_count if out_EOI.is_cuda else 2
        kernel, grid = wgrad_triton.wgrad_accumulate_persistent, (min(E * tiles, per_sm * sms),)
    else:
        kernel, grid = wgrad_triton.wgrad_accumulate, (tiles, E)
    kernel[grid](g_NO, x_NI, ends_E, out_EOI, out_desc, g_desc, x_desc, E, O, I, alpha,
                 BLOCK_O=block_o, BLOCK_I=block_i, BLOCK_K=block_k, ATOMIC=atomic or tma, TMA=tma, TMA_LOADS=tma_loads,
                 num_warps=warps, num_stages=stages)


def _tma_ok(t: torch.Tensor) -> bool:
    return t.is_contiguous() and t.shape[-1] * t.element_size() % 16 == 0 and t.data_ptr() % 16 == 0
