"""The SwiGLU gates between the experts' GEMMs: `dtensor_moe::swiglu`, `dtensor_moe::clamped_swiglu`
and their backwards.

swiglu: h = silu(a) * b; backward da = dh * b * silu'(a), db = dh * silu(a), silu(a) recomputed
rather than kept, returned as one [..., 2F] tensor (da, db): the gradient of the experts' fused gate / up
GEMM output; a and b may be the strided halves of that output or two tensors.
clamped_swiglu (gpt-oss): g = min(a, limit), u = clamp(b, -limit, limit), h = (u + 1) * g * sigmoid(alpha * g);
a clamped input gets no gradient (torch's clamp convention: the bounds themselves pass it).
weighted_gate_backward: the minimal-memory experts' backward of either gate with each row's routing weight w
applied after it (z = w * h W2): from du = dz W2 (unweighted) and the kept a, b it recomputes h and returns
[da, db] of w * du, w * h (the down projection's weight-gradient operand) and dw = <du, h> (fp32), one pass. On CUDA one
Triton pass each way (torch needs two forward, three backward, and keeps silu(a)); elsewhere torch ops,
exact in the inputs' dtype, in transformers' GptOssExperts order. Math in fp32 on the Triton path. Tests
run the Triton launchers on CPU under TRITON_INTERPRET=1.
"""

import functools

import torch
import torch.nn.functional as F

from dtensor_moe.kernels import policy

BLOCK = 2048


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    # a and b are [N, F] with their own row strides (the two halves of one [N, 2F] GEMM output, or two
    # tensors); h is [N, F] and the gradient [N, 2F] (da then db in each row), both contiguous. A program
    # takes one row's BLOCK columns: no per-element division to find them.
    @triton.jit
    def swiglu_fwd(a_ptr, b_ptr, h_ptr, F, stride_a, stride_b, alpha, limit, CLAMPED: tl.constexpr,
                   BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = col < F
        a = tl.load(a_ptr + row * stride_a + col, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + row * stride_b + col, mask=mask, other=0.0).to(tl.float32)
        if CLAMPED:
            g = tl.minimum(a, limit)
            h = (tl.minimum(tl.maximum(b, -limit), limit) + 1.0) * g * tl.sigmoid(alpha * g)
        else:
            h = a * tl.sigmoid(a) * b
        tl.store(h_ptr + row * F + col, h.to(h_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def swiglu_bwd(dh_ptr, a_ptr, b_ptr, dab_ptr, F, stride_a, stride_b, alpha, limit, CLAMPED: tl.constexpr,
                   BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = col < F
        dh = tl.load(dh_ptr + row * F + col, mask=mask, other=0.0).to(tl.float32)
        a = tl.load(a_ptr + row * stride_a + col, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + row * stride_b + col, mask=mask, other=0.0).to(tl.float32)
        if CLAMPED:
            g = tl.minimum(a, limit)
            u = tl.minimum(tl.maximum(b, -limit), limit)
            sig = tl.sigmoid(alpha * g)
            da = tl.where(a <= limit, dh * (u + 1.0) * (sig + alpha * g * sig * (1.0 - sig)), 0.0)
            db = tl.where((b >= -limit) & (b <= limit), dh * g * sig, 0.0)
        else:
            sig = tl.sigmoid(a)
            silu = a * sig
            da = dh * b * (sig + silu * (1.0 - sig))
            db = dh * silu
        da_at = dab_ptr + row * 2 * F + col
        tl.store(da_at, da.to(dab_ptr.dtype.element_ty), mask=mask)
        tl.store(da_at + F, db.to(dab_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def weighted_bwd(du_ptr, a_ptr, b_ptr, w_ptr, dab_ptr, hw_ptr, dw_ptr, F, stride_a, stride_b, alpha, limit,
                     CLAMPED: tl.constexpr, BLOCK: tl.constexpr):
        # One program a row: dw is the row's sum over all F columns, kept in registers (deterministic).
        row = tl.program_id(0).to(tl.int64)
        w = tl.load(w_ptr + row).to(tl.float32)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for c0 in range(0, F, BLOCK):
            col = c0 + tl.arange(0, BLOCK)
            mask = col < F
            du = tl.load(du_ptr + row * F + col, mask=mask, other=0.0).to(tl.float32)
            a = tl.load(a_ptr + row * stride_a + col, mask=mask, other=0.0).to(tl.float32)
            b = tl.load(b_ptr + row * stride_b + col, mask=mask, other=0.0).to(tl.float32)
            dh = du * w
            if CLAMPED:
                g = tl.minimum(a, limit)
                u = tl.minimum(tl.maximum(b, -limit), limit)
                sig = tl.sigmoid(alpha * g)
                h = (u + 1.0) * g * sig
                da = tl.where(a <= limit, dh * (u + 1.0) * (sig + alpha * g * sig * (1.0 - sig)), 0.0)
                db = tl.where((b >= -limit) & (b <= limit), dh * g * sig, 0.0)
            else:
                sig = tl.sigmoid(a)
                silu = a * sig
                h = silu * b
                da = dh * b * (sig + silu * (1.0 - sig))
                db = dh * silu
            acc += du * h
            da_at = dab_ptr + row * 2 * F + col
            tl.store(da_at, da.to(dab_ptr.dtype.element_ty), mask=mask)
            tl.store(da_at + F, db.to(dab_ptr.dtype.element_ty), mask=mask)
            tl.store(hw_ptr + row * F + col, (h * w).to(hw_ptr.dtype.element_ty), mask=mask)
        tl.store(dw_ptr + row, tl.sum(acc, axis=0))

    return triton, swiglu_fwd, swiglu_bwd, weighted_bwd


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t as [N, F] with unit column stride, copied only where it is not one already."""
    t = t.reshape(-1, t.shape[-1]) if t.dim() != 2 else t
    return t if t.stride(-1) == 1 else t.contiguous()


def _grid(triton, a2: torch.Tensor) -> tuple[tuple[int, int], int]:
    N, F_ = a2.shape
    block = min(BLOCK, triton.next_power_of_2(F_))
    return (N, triton.cdiv(F_, block)), block


def triton_forward(a: torch.Tensor, b: torch.Tensor, clamp: tuple[float, float] | None = None) -> torch.Tensor:
    """`clamp`: (alpha, limit) of the clamped gate, None for silu(a) * b."""
    triton, fwd, *_ = _kernels()
    a2, b2 = _rows(a), _rows(b)
    h = torch.empty(a.shape, dtype=a.dtype, device=a.device)
    if a.numel():
        grid, block = _grid(triton, a2)
        fwd[grid](a2, b2, h, a2.shape[1], a2.stride(0), b2.stride(0), *(clamp or (1.0, 0.0)),
                  CLAMPED=clamp is not None, BLOCK=block)
    return h


def triton_backward(dh: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                    clamp: tuple[float, float] | None = None) -> torch.Tensor:
    """The gradient [..., 2F]: da then db along the last dim."""
    triton, _, bwd, _ = _kernels()
    a2, b2 = _rows(a), _rows(b)
    dab = torch.empty(*a.shape[:-1], 2 * a.shape[-1], dtype=a.dtype, device=a.device)
    if a.numel():
        grid, block = _grid(triton, a2)
        bwd[grid](dh.contiguous(), a2, b2, dab, a2.shape[1], a2.stride(0), b2.stride(0), *(clamp or (1.0, 0.0)),
                  CLAMPED=clamp is not None, BLOCK=block)
    return dab


def torch_backward(dh: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.cat([torch.ops.aten.silu_backward(dh * b, a), dh * F.silu(a)], dim=-1)


@torch.library.custom_op("dtensor_moe::swiglu", mutates_args=())
def swiglu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """h = silu(a) * b."""
    return triton_forward(a, b) if policy.runs_triton(a) else F.silu(a) * b


@swiglu.register_fake
def _(a, b):
    return torch.empty_like(a)


@torch.library.custom_op("dtensor_moe::swiglu_backward", mutates_args=())
def swiglu_backward(dh: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[da, db] of h = silu(a) * b, concatenated along the last dim (the layout of gate and up in w13)."""
    return triton_backward(dh, a, b) if policy.runs_triton(a) else torch_backward(dh, a, b)


def _gate_up_like(a: torch.Tensor) -> torch.Tensor:
    return a.new_empty(*a.shape[:-1], 2 * a.shape[-1])


@swiglu_backward.register_fake
def _(dh, a, b):
    return _gate_up_like(a)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, dh):
    return swiglu_backward(dh, *ctx.saved_tensors).chunk(2, dim=-1)


swiglu.register_autograd(_backward, setup_context=_setup)


def torch_clamped_forward(a: torch.Tensor, b: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    g = a.clamp(max=limit)
    return (b.clamp(-limit, limit) + 1) * (g * torch.sigmoid(g * alpha))


def torch_clamped_backward(dh, a, b, alpha: float, limit: float) -> torch.Tensor:
    g = a.clamp(max=limit)
    sig = torch.sigmoid(g * alpha)
    dg = dh * (b.clamp(-limit, limit) + 1) * (sig + alpha * g * sig * (1 - sig))
    return torch.cat([dg * (a <= limit), dh * g * sig * ((b >= -limit) & (b <= limit))], dim=-1)


@torch.library.custom_op("dtensor_moe::clamped_swiglu", mutates_args=())
def clamped_swiglu(a: torch.Tensor, b: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """h = (clamp(b, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(a, limit) (gpt-oss)."""
    if policy.runs_triton(a):
        return triton_forward(a, b, (alpha, limit))
    return torch_clamped_forward(a, b, alpha, limit)


@clamped_swiglu.register_fake
def _(a, b, alpha, limit):
    return torch.empty_like(a)


@torch.library.custom_op("dtensor_moe::clamped_swiglu_backward", mutates_args=())
def clamped_swiglu_backward(dh: torch.Tensor, a: torch.Tensor, b: torch.Tensor, alpha: float,
                            limit: float) -> torch.Tensor:
    """[da, db] of clamped_swiglu, concatenated along the last dim."""
    if policy.runs_triton(a):
        return triton_backward(dh, a, b, (alpha, limit))
    return torch_clamped_backward(dh, a, b, alpha, limit)


@clamped_swiglu_backward.register_fake
def _(dh, a, b, alpha, limit):
    return _gate_up_like(a)


def _clamped_setup(ctx, inputs, output):
    a, b, ctx.alpha, ctx.limit = inputs
    ctx.save_for_backward(a, b)


def _clamped_backward(ctx, dh):
    return *clamped_swiglu_backward(dh, *ctx.saved_tensors, ctx.alpha, ctx.limit).chunk(2, dim=-1), None, None


clamped_swiglu.register_autograd(_clamped_backward, setup_context=_clamped_setup)


WEIGHTED_BLOCK = 1024


def triton_weighted_backward(du, a, b, w, clamp):
    triton, *_, bwd = _kernels()
    a2, b2 = _rows(a), _rows(b)
    N, F_ = a2.shape
    dab = torch.empty(N, 2 * F_, dtype=a.dtype, device=a.device)
    hw = torch.empty(N, F_, dtype=a.dtype, device=a.device)
    dw = torch.empty(N, dtype=torch.float32, device=a.device)
    if N:
        block = min(WEIGHTED_BLOCK, triton.next_power_of_2(max(F_, 1)))
        bwd[(N,)](du.contiguous(), a2, b2, w.contiguous(), dab, hw, dw, F_, a2.stride(0), b2.stride(0),
                  *(clamp or (1.0, 0.0)), CLAMPED=clamp is not None, BLOCK=block)
    return dab, hw, dw


def torch_weighted_backward(du, a, b, w, clamp):
    h = F.silu(a) * b if clamp is None else torch_clamped_forward(a, b, *clamp)
    acc = torch.promote_types(du.dtype, torch.float32)
    w_N1 = w.to(du.dtype)[:, None]
    dh = du * w_N1
    dab = torch_backward(dh, a, b) if clamp is None else torch_clamped_backward(dh, a, b, *clamp)
    return dab, h * w_N1.to(h.dtype), (du.to(acc) * h.to(acc)).sum(-1).to(torch.promote_types(w.dtype, torch.float32))


@torch.library.custom_op("dtensor_moe::weighted_gate_backward", mutates_args=())
def weighted_gate_backward(du: torch.Tensor, a: torch.Tensor, b: torch.Tensor, w: torch.Tensor, clamped: bool,
                           alpha: float, limit: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dab [N, 2F], hw [N, F], dw [N]) for h = gate(a, b) (swiglu, or clamped_swiglu with alpha and limit)
    weighted by w [N] after the gate: dab is [da, db] of dh = w * du, hw = w * h, dw = <du, h> in >= fp32."""
    clamp = (alpha, limit) if clamped else None
    impl = triton_weighted_backward if policy.runs_triton(a) else torch_weighted_backward
    return impl(du, a, b, w, clamp)


@weighted_gate_backward.register_fake
def _(du, a, b, w, clamped, alpha, limit):
    N = a.shape[0]
    return _gate_up_like(a), torch.empty_like(a), a.new_empty(N, dtype=torch.promote_types(w.dtype, torch.float32))
