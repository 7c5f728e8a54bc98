"""The experts' weight gradients as one Triton kernel that adds into .grad: out[e] += alpha * g_e^T x_e.

`torch._grouped_mm` has no beta, so accumulating its result into an existing gradient costs a
read-add-write pass over the whole gradient (11 GB per rank at the DeepSeek-like shape); a cuBLAS
`addmm_` per expert does the sum in the GEMM but costs a launch per expert and, for the [F, D]
orientation of w1/w3, cuBLAS picks a slow tile (benchmarks/RESULTS.md). This kernel reads each
output tile once, adds the fp32 product, and writes it back: one launch per weight. Programs run
expert by expert, so an expert's rows stay in L2 while all its output tiles read them.
At few rows per expert the read of the output tile in the epilogue, which nothing overlaps, is what the
kernel waits on (Nsight Compute, RESULTS.md session 7): there the `atomic` epilogue rounds the product to
the gradient's dtype and adds it in L2, which rounds as autograd's `grad += new` does; each element gets
one add, so the result does not depend on timing.
Launched by the `dtensor_moe::add_weight_grad_` op (grouped_mm.py) where policy.weight_grad_accumulation
chooses it, with the tile config policy.wgrad_config picks for the shape; tests run it on CPU under
TRITON_INTERPRET=1. Tried on H200 and slower at every shape (RESULTS.md session 7): loading the output
tile before the K loop, TMA operand loads through per-expert tensor descriptors, and a persistent
kernel, both with a loop per tile and with one flat loop over all of a program's K steps; and (session
8, commit ff72408) Triton 3.6's warp specialization of the K loop over those TMA descriptors
(`tl.range(..., warp_specialize=True)`, 4 or 8 warps): 8.7-12.9 ms against 7.0 at DeepSeek's 256 rows
per expert where it compiled; its pass (NVGPUWarpSpecialization) crashed on two of the four atomic configs.
"""

import functools
from typing import NamedTuple

import torch


class Config(NamedTuple):
    """A tile of BLOCK_O x BLOCK_I outputs, BLOCK_K rows a step, its warps and pipeline stages;
    `atomic`: the epilogue adds the tile into the gradient with one bf16 atomic add per element
    (in L2, nothing for the program to wait on) instead of reading, adding in fp32 and writing it."""
    block_o: int
    block_i: int
    block_k: int
    warps: int
    stages: int
    atomic: bool = False


# Where policy.wgrad_config has no measurement: the best at the DeepSeek shape in session 4 (two
# programs fit on an SM, so one's epilogue overlaps the other's loop), within 7% of the best at Qwen.
CONFIG = Config(128, 128, 64, 4, 3)


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def wgrad_accumulate(g_ptr, x_ptr, ends_ptr, out_ptr, O, I, alpha,
                         BLOCK_O: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr, ATOMIC: tl.constexpr):
        e = tl.program_id(1).to(tl.int64)
        tiles_i = tl.cdiv(I, BLOCK_I)
        to = tl.program_id(0) // tiles_i
        ti = tl.program_id(0) % tiles_i
        start = tl.load(ends_ptr + e - 1, mask=e > 0, other=0).to(tl.int64)
        end = tl.load(ends_ptr + e).to(tl.int64)
        ro = to * BLOCK_O + tl.arange(0, BLOCK_O)
        ri = ti * BLOCK_I + tl.arange(0, BLOCK_I)
        rk = tl.arange(0, BLOCK_K)
        out = out_ptr + e * O * I + ro[:, None].to(tl.int64) * I + ri[None, :]
        in_tile = (ro[:, None] < O) & (ri[None, :] < I)
        acc = tl.zeros([BLOCK_O, BLOCK_I], dtype=tl.float32)
        for k0 in range(start, end, BLOCK_K):
            rows = k0 + rk
            in_rows = rows < end
            g_OK = tl.load(
                g_ptr + rows[None, :] * O + ro[:, None], mask=in_rows[None, :] & (ro[:, None] < O), other=0.0
            )
            x_KI = tl.load(
                x_ptr + rows[:, None] * I + ri[None, :], mask=in_rows[:, None] & (ri[None, :] < I), other=0.0
            )
            acc = tl.dot(g_OK, x_KI, acc)
        if ATOMIC:
            tl.atomic_add(out, (acc * alpha).to(out_ptr.dtype.element_ty), mask=in_tile, sem="relaxed")
        else:
            acc = acc * alpha + tl.load(out, mask=in_tile, other=0.0).to(tl.float32)
            tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=in_tile)

    return triton, wgrad_accumulate


def accumulate(out_EOI: torch.Tensor, g_NO: torch.Tensor, x_NI: torch.Tensor, ends_E: torch.Tensor,
               alpha: float, config: Config = CONFIG) -> None:
    """out_EOI[e] += alpha * g^T x over rows ends_E[e-1]:ends_E[e] (ends_E: the grouped GEMMs' offsets)."""
    E, O, I = out_EOI.shape
    if E == 0 or g_NO.shape[0] == 0:
        return
    triton, kernel = _kernel()
    block_o, block_i, block_k, warps, stages, atomic = Config(*config)
    if atomic and out_EOI.is_cuda and torch.cuda.get_device_capability(out_EOI.device) < (9, 0):
        atomic = False  # 16-bit float atomic adds are native from sm90 on: elsewhere read-add-write
    grid = (triton.cdiv(O, block_o) * triton.cdiv(I, block_i), E)
    kernel[grid](g_NO.contiguous(), x_NI.contiguous(), ends_E, out_EOI, O, I, alpha,
                 BLOCK_O=block_o, BLOCK_I=block_i, BLOCK_K=block_k, ATOMIC=atomic, num_warps=warps, num_stages=stages)
