"""The SwiGLU gate between the experts' GEMMs as one Triton pass each way.

Forward h = silu(a) * b; backward da = dh * b * silu'(a), db = dh * silu(a). In torch that is
two passes forward (and silu(a) kept for backward) and three backward; here each direction
reads its inputs once and writes its outputs once, and silu(a) is recomputed instead of kept.
Math in fp32. Used where combine.runs_triton; tests run it on CPU under TRITON_INTERPRET=1.
"""

import functools

import torch

BLOCK = 2048


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def swiglu_fwd(a_ptr, b_ptr, h_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        a = tl.load(a_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        h = a * tl.sigmoid(a) * b
        tl.store(h_ptr + offs, h.to(h_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def swiglu_bwd(dh_ptr, a_ptr, b_ptr, da_ptr, db_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        dh = tl.load(dh_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        a = tl.load(a_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        sig = tl.sigmoid(a)
        silu = a * sig
        da = dh * b * (sig + silu * (1.0 - sig))
        tl.store(da_ptr + offs, da.to(da_ptr.dtype.element_ty), mask=mask)
        tl.store(db_ptr + offs, (dh * silu).to(db_ptr.dtype.element_ty), mask=mask)

    return triton, swiglu_fwd, swiglu_bwd


def forward(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """h = silu(a) * b (no autograd; a, b contiguous, same shape)."""
    triton, fwd, _ = _kernels()
    h = torch.empty_like(a)
    n = a.numel()
    if n:
        fwd[(triton.cdiv(n, BLOCK),)](a, b, h, n, BLOCK=BLOCK)
    return h


def backward(dh: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(da, db) of h = silu(a) * b."""
    triton, _, bwd = _kernels()
    da, db = torch.empty_like(a), torch.empty_like(b)
    n = a.numel()
    if n:
        bwd[(triton.cdiv(n, BLOCK),)](dh.contiguous(), a, b, da, db, n, BLOCK=BLOCK)
    return da, db
