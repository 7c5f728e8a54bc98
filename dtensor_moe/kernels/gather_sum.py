"""The gather-sum behind every combine: out[r] = sum_k w_N[idx[r, k]] * y_N[idx[r, k]] (`dtensor_moe::gather_sum`).

idx[r, k] < 0 is an empty slot: it reads nothing, so a non-finite row never reaches another row's
sum (NaN * 0 is NaN, so empty slots are masked, not weighted by 0). The local top-k combine uses it
with r = token, idx = where each of its k copies sits in expert order; the expert-parallel combine
uses it on the expert side with r = received token row, summing that token's experts on this rank
before anything travels back; unweighted, it sums a token's rows over the ranks it went to.
Backward, every y row is read by exactly one slot, `tok_N[n]` being that slot's r, so the
gradients are a gather: dy_N[n] = w_N[n] * dout[tok_N[n]], dw_N[n] = <dout[tok_N[n]], y_N[n]>.
Deterministic, no scatter-add, no atomics; sums in fp32 (fp64 for fp64 inputs).

On CUDA one Triton kernel each way (forward reads each y row once, backward writes each gradient
row straight into expert order); elsewhere torch ops. Tests run the Triton launchers on CPU under
TRITON_INTERPRET=1.
"""

import functools

import torch

from dtensor_moe.kernels import policy


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def gather_sum_fwd(y_ptr, idx_ptr, w_ptr, out_ptr, D, K, WEIGHTED: tl.constexpr, BLOCK_D: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        mask = offs < D
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for k in range(K):
            n = tl.load(idx_ptr + r * K + k).to(tl.int64)
            n_D = tl.full([BLOCK_D], n, tl.int64)
            filled = mask & (n_D >= 0)
            row = tl.load(y_ptr + n * D + offs, mask=filled, other=0.0).to(tl.float32)
            if WEIGHTED:  # the row's weight, broadcast over the block
                row *= tl.load(w_ptr + n_D, mask=filled, other=0.0).to(tl.float32)
            acc += row
        tl.store(out_ptr + r * D + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def gather_sum_bwd(dout_ptr, y_ptr, tok_ptr, w_ptr, dy_ptr, dw_ptr, D, NEED_DW: tl.constexpr,
                       BLOCK_D: tl.constexpr):
        n = tl.program_id(0).to(tl.int64)
        r = tl.load(tok_ptr + n).to(tl.int64)
        w = tl.load(w_ptr + n).to(tl.float32)
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            offs = d0 + tl.arange(0, BLOCK_D)
            mask = offs < D
            g = tl.load(dout_ptr + r * D + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(dy_ptr + n * D + offs, (w * g).to(dy_ptr.dtype.element_ty), mask=mask)
            if NEED_DW:
                acc += g * tl.load(y_ptr + n * D + offs, mask=mask, other=0.0).to(tl.float32)
        if NEED_DW:
            tl.store(dw_ptr + n, tl.sum(acc, axis=0))

    return triton, gather_sum_fwd, gather_sum_bwd


BLOCK_D = 1024


def _acc_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)


def triton_forward(y_ND, idx_RK, w_N):
    *lead, K = idx_RK.shape
    D = y_ND.shape[1]
    out = y_ND.new_empty(*lead, D)
    R = out.numel() // max(D, 1)
    if R and D:
        triton, fwd, _ = _kernels()
        w = y_ND if w_N is None else w_N.contiguous()
        fwd[(R, triton.cdiv(D, BLOCK_D))](y_ND.contiguous(), idx_RK.contiguous(), w, out, D, K,
                                          WEIGHTED=w_N is not None, BLOCK_D=BLOCK_D)
    return out


def torch_forward(y_ND, idx_RK, w_N):
    D = y_ND.shape[1]
    if not y_ND.shape[0]:  # every slot is empty, and there is no row 0 to read in their place
        return y_ND.new_zeros(*idx_RK.shape[:-1], D)
    filled = idx_RK >= 0
    safe = torch.where(filled, idx_RK, 0)
    acc = _acc_dtype(y_ND)
    rows = y_ND.index_select(0, safe.flatten()).view(*idx_RK.shape, D).to(acc)
    rows = torch.where(filled[..., None], rows, 0)
    if w_N is not None:
        rows = rows * torch.where(filled, w_N.index_select(0, safe.flatten()).view(idx_RK.shape).to(acc), 0)[..., None]
    return rows.sum(-2).to(y_ND.dtype)


def triton_backward(dout_RD, tok_N, w_N, y_ND, dy_dtype):
    N, D = tok_N.numel(), dout_RD.shape[1]
    dy_ND = torch.empty(N, D, device=dout_RD.device, dtype=dy_dtype)
    need_dw = y_ND is not None
    dw_N = torch.empty(N if need_dw else 0, device=dout_RD.device, dtype=torch.float32)
    if N:
        _, _, bwd = _kernels()
        w = w_N.contiguous() if w_N is not None else torch.ones(N, device=dout_RD.device, dtype=torch.float32)
        bwd[(N,)](dout_RD.contiguous(), y_ND.contiguous() if need_dw else dy_ND, tok_N.contiguous(), w,
                  dy_ND, dw_N if need_dw else dy_ND, D, NEED_DW=need_dw, BLOCK_D=BLOCK_D)
    return dy_ND, dw_N.to(w_N.dtype if w_N is not None else dy_dtype)


def torch_backward(dout_RD, tok_N, w_N, y_ND, dy_dtype):
    g_ND = dout_RD.index_select(0, tok_N)
    dy_ND = (g_ND if w_N is None else g_ND * w_N.to(g_ND.dtype).unsqueeze(-1)).to(dy_dtype)
    if y_ND is None:
        return dy_ND, dout_RD.new_empty(0)
    acc = _acc_dtype(y_ND)
    return dy_ND, (g_ND.to(acc) * y_ND.to(acc)).sum(-1).to(w_N.dtype)


@torch.library.custom_op("dtensor_moe::gather_sum", mutates_args=())
def gather_sum(y_ND: torch.Tensor, idx_RK: torch.Tensor, tok_N: torch.Tensor, w_N: torch.Tensor | None) -> torch.Tensor:
    """[..., D] for idx of shape [..., K]: out[r] = sum over slots k with idx_RK[r, k] >= 0 of
    w_N[n] * y_ND[n], n = idx_RK[r, k] (w_N None: unweighted); tok_N[n] is the flat r whose slot
    reads row n (for the backward). Leading dims come out as allocated, never as a view: FSDP2
    cannot hook the gradient of a module output that is a view."""
    return (triton_forward if policy.runs_triton(y_ND) else torch_forward)(y_ND, idx_RK, w_N)


@gather_sum.register_fake
def _(y_ND, idx_RK, tok_N, w_N):
    return y_ND.new_empty(*idx_RK.shape[:-1], y_ND.shape[1])


@torch.library.custom_op("dtensor_moe::gather_sum_backward", mutates_args=())
def gather_sum_backward(dout_RD: torch.Tensor, tok_N: torch.Tensor, w_N: torch.Tensor | None,
                        y_ND: torch.Tensor | None, dy_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(dy_N in dy_dtype, dw_N) of gather_sum; y_ND is None (and dw_N empty) when w_N takes no gradient."""
    impl = triton_backward if policy.runs_triton(dout_RD) else torch_backward
    return impl(dout_RD, tok_N, w_N, y_ND, dy_dtype)


@gather_sum_backward.register_fake
def _(dout_RD, tok_N, w_N, y_ND, dy_dtype):
    dw_dtype = w_N.dtype if w_N is not None else dy_dtype
    return (dout_RD.new_empty(tok_N.shape[0], dout_RD.shape[1], dtype=dy_dtype),
            dout_RD.new_empty(tok_N.shape[0] if y_ND is not None else 0, dtype=dw_dtype))


def _setup(ctx, inputs, output):
    y_ND, _, tok_N, w_N = inputs
    # y is kept only when the weights take a gradient: it is the largest tensor, and under expert
    # parallelism it holds every ETP peer's pairs.
    need_dw = w_N is not None and ctx.needs_input_grad[3]
    ctx.save_for_backward(tok_N, w_N, y_ND if need_dw else None)
    ctx.y_dtype = y_ND.dtype


def _backward(ctx, dout_RD):
    tok_N, w_N, y_ND = ctx.saved_tensors
    dout_RD = dout_RD.reshape(-1, dout_RD.shape[-1]).contiguous()
    dy_ND, dw_N = gather_sum_backward(dout_RD, tok_N, w_N, y_ND, ctx.y_dtype)
    return dy_ND, None, None, (dw_N if y_ND is not None else None)


gather_sum.register_autograd(_backward, setup_context=_setup)
