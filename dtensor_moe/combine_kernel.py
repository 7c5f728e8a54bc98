"""The top-k combine as one Triton kernel: y_TD[t] = sum_k w_TK[t, k] * y_ND[idx_TK[t, k]].

The torch path (moe.py) gathers the expert outputs back to (token, k) order and then reduces
them with a batched matmul: the gather writes and re-reads a full N x D copy in forward, and
backward writes another. Here forward reads each expert-output row once, and backward writes
each row's gradient straight into expert order. Rows are accumulated in fp32, like the bmm.
Used on CUDA when Triton imports; tests run it on CPU under TRITON_INTERPRET=1.
"""

import functools

import torch


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def combine_fwd(y_ptr, idx_ptr, w_ptr, out_ptr, D, K, BLOCK_D: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        mask = offs < D
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for k in range(K):
            n = tl.load(idx_ptr + t * K + k).to(tl.int64)  # < 0: an empty slot (gather_sum)
            w = tl.load(w_ptr + t * K + k).to(tl.float32)
            filled = mask & (tl.full([BLOCK_D], n, tl.int64) >= 0)
            acc += w * tl.load(y_ptr + n * D + offs, mask=filled, other=0.0).to(tl.float32)
        tl.store(out_ptr + t * D + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def combine_bwd(dy_ptr, y_ptr, idx_ptr, w_ptr, dy_rows_ptr, dw_ptr, D, K,
                    NEED_DW: tl.constexpr, BLOCK_D: tl.constexpr):
        p = tl.program_id(0).to(tl.int64)  # one (token, k) pair
        t = p // K
        n = tl.load(idx_ptr + p).to(tl.int64)
        w = tl.load(w_ptr + p).to(tl.float32)
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            offs = d0 + tl.arange(0, BLOCK_D)
            mask = offs < D
            g = tl.load(dy_ptr + t * D + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(dy_rows_ptr + n * D + offs, (w * g).to(dy_rows_ptr.dtype.element_ty), mask=mask)
            if NEED_DW:
                acc += g * tl.load(y_ptr + n * D + offs, mask=mask, other=0.0).to(tl.float32)
        if NEED_DW:
            tl.store(dw_ptr + p, tl.sum(acc, axis=0))

    return triton, combine_fwd, combine_bwd


BLOCK_D = 1024


class _GatherWeightedSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_ND, idx_TK, w_TK, out_shape):
        triton, fwd, _ = _kernels()
        (T, K), D = idx_TK.shape, y_ND.shape[1]
        out_TD = y_ND.new_empty(T, D)
        if T:
            fwd[(T, triton.cdiv(D, BLOCK_D))](y_ND, idx_TK, w_TK, out_TD, D, K, BLOCK_D=BLOCK_D)
        ctx.save_for_backward(y_ND, idx_TK, w_TK)
        # Shaped here: FSDP2 hooks the layer's output, which must not be a view made outside.
        return out_TD.view(out_shape)

    @staticmethod
    def backward(ctx, dy):
        _, _, bwd = _kernels()
        y_ND, idx_TK, w_TK = ctx.saved_tensors
        (T, K), D = idx_TK.shape, y_ND.shape[1]
        dy_TD = dy.reshape(T, D).contiguous()
        need_dw = ctx.needs_input_grad[2]
        dy_ND = torch.empty_like(y_ND)  # idx_TK is a permutation of the rows: each is written once
        dw_TK = torch.empty(T, K, device=y_ND.device, dtype=torch.float32) if need_dw else dy_ND
        if T:
            bwd[(T * K,)](dy_TD, y_ND, idx_TK, w_TK, dy_ND, dw_TK, D, K, NEED_DW=need_dw, BLOCK_D=BLOCK_D)
        return dy_ND, None, dw_TK.to(w_TK.dtype) if need_dw else None, None


def gather_weighted_sum(y_ND, idx_TK, w_TK, out_shape) -> torch.Tensor:
    """idx_TK: the row of y_ND holding token t's k-th expert output (every row exactly once)."""
    return _GatherWeightedSum.apply(y_ND.contiguous(), idx_TK.contiguous(), w_TK.contiguous(), out_shape)


def gather_sum(y_ND: torch.Tensor, idx_RK: torch.Tensor) -> torch.Tensor:
    """out[r] = sum_k y_ND[idx_RK[r, k]] over the slots with idx >= 0, accumulated in fp32 (no autograd)."""
    (R, K), D = idx_RK.shape, y_ND.shape[1]
    out = y_ND.new_empty(R, D)
    if R:
        triton, fwd, _ = _kernels()
        ones = torch.ones(R, K, device=y_ND.device, dtype=torch.float32)
        fwd[(R, triton.cdiv(D, BLOCK_D))](y_ND.contiguous(), idx_RK.contiguous(), ones, out, D, K, BLOCK_D=BLOCK_D)
    return out


@functools.cache
def available() -> bool:
    """Whether Triton imports here (the CUDA build of torch ships it)."""
    try:
        _kernels()
        return True
    except ImportError:
        return False
