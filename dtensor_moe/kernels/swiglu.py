"""The SwiGLU gates between the experts' GEMMs: `dtensor_moe::swiglu`, `dtensor_moe::clamped_swiglu`
and their backwards.

swiglu: h = silu(a) * b; backward da = dh * b * silu'(a), db = dh * silu(a), silu(a) recomputed
rather than kept, returned as one [..., 2F] tensor (da, db): the gradient of the experts' fused gate / up
GEMM output; a and b may be the strided halves of that output or two tensors.
clamped_swiglu (gpt-oss): g = min(a, limit), u = clamp(b, -limit, limit), h = (u + 1) * g * sigmoid(alpha * g);
a clamped input gets no gradient (torch's clamp convention: the bounds themselves pass it). On CUDA one
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

    return triton, swiglu_fwd, swiglu_bwd


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
    triton, fwd, _ = _kernels()
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
    triton, _, bwd = _kernels()
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
