"""FP8 expert GEMMs: fused e4m3 quantization with rowwise scales and the three grouped GEMMs (`dtensor_moe::fp8_*`).

Each GEMM operand is quantized along the GEMM's reduced dim with one fp32 scale per row of the
other dims, the rowwise scaling `torch._scaled_grouped_mm` runs on sm90: q = clamp(t * 448 / amax,
+-448) in float8_e4m3fn and s = amax / 448, so t ~ q * s; the GEMM multiplies the products by both
scales and writes bf16. Two layouts:
  rows: [N, I] -> q [N, I], s [N] (amax over each row): the forward's x, h and weights, the dgrad's dy, da, db;
  cols: groups of rows -> q transposed, each group's rows contiguous, s [G, C] (amax over a group's
        rows per column): the dgrad's weights (each expert's [R, C] block as [C, R]) and the wgrad's
        tokens (each expert's row block, zero-padded to a multiple of 16 rows so that every block
        starts 16-byte aligned, as the 2d x 2d grouped kernel's loads need).
On CUDA each layout is one Triton pass (amax, scale, cast and the transpose); elsewhere torch ops do
the same fp32 arithmetic and the GEMMs run on the dequantized operands in fp32, so CPU tests see
FP8's numerics (up to summation order). Master weights, gradients and optimizer state stay as they are.

`quantized` memoizes per tensor and version: x feeds both w1 and w3, and a weight is quantized once
until it is written again (an optimizer step, FSDP's all-gather), e.g. once per gradient-accumulation
window. The memo holds 1 byte per element per layout for as long as the tensor lives.
"""

import functools
import weakref

import torch

from dtensor_moe.kernels import policy

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
AMAX_FLOOR = 1e-12  # an all-zero row quantizes to zeros instead of dividing by zero
ALIGN = 16  # rows per padded expert block in the weight gradient's operands


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def quantize_rows(x_ptr, q_ptr, s_ptr, I, stride_x, BLOCK: tl.constexpr):
        n = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < I
        x = tl.load(x_ptr + n * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-12)  # AMAX_FLOOR
        q = tl.clamp(x * (448.0 / amax), -448.0, 448.0)  # FP8_MAX
        tl.store(q_ptr + n * I + offs, q.to(tl.float8e4nv), mask=mask)
        tl.store(s_ptr + n, amax / 448.0)

    @triton.jit
    def quantize_cols(x_ptr, q_ptr, s_ptr, starts_ptr, ends_ptr, dsts_ptr, C, SG, SC,
                      PAD: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        # Group g's rows [start, end) of x [*, C] -> q[g * SG + c * SC + dst + (r - start)], its
        # padded tail zero; two sweeps over the rows (amax, then cast), the second from L2.
        g = tl.program_id(1).to(tl.int64)
        cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
        in_cols = cols < C
        start = tl.load(starts_ptr + g).to(tl.int64)
        end = tl.load(ends_ptr + g).to(tl.int64)
        dst = tl.load(dsts_ptr + g).to(tl.int64)
        rr = tl.arange(0, BLOCK_R)
        amax = tl.zeros([BLOCK_C], dtype=tl.float32)
        for r0 in range(start, end, BLOCK_R):
            rows = r0 + rr
            tile = tl.load(x_ptr + rows[:, None] * C + cols[None, :], mask=(rows[:, None] < end) & in_cols[None, :],
                           other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.max(tl.abs(tile), axis=0))
        amax = tl.maximum(amax, 1e-12)
        inv = 448.0 / amax
        tl.store(s_ptr + g * C + cols, amax / 448.0, mask=in_cols)
        padded_end = start + tl.cdiv(end - start, PAD) * PAD
        for r0 in range(start, padded_end, BLOCK_R):
            rows = r0 + rr
            tile = tl.load(x_ptr + rows[:, None] * C + cols[None, :], mask=(rows[:, None] < end) & in_cols[None, :],
                           other=0.0).to(tl.float32)
            q = tl.clamp(tile * inv[None, :], -448.0, 448.0).to(tl.float8e4nv)
            out = q_ptr + g * SG + cols[None, :].to(tl.int64) * SC + dst + (rows[:, None] - start)
            tl.store(out, q, mask=(rows[:, None] < padded_end) & in_cols[None, :])

    return triton, quantize_rows, quantize_cols


def _scale_inv(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    amax = amax.float().clamp_min(AMAX_FLOOR)
    return FP8_MAX / amax, amax / FP8_MAX


@torch.library.custom_op("dtensor_moe::fp8_quantize_rows", mutates_args=())
def quantize_rows(x_NI: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [N, I] e4m3, s [N] fp32) with x ~ q * s[:, None]: one scale per row, over the reduced dim I. Rows may
    have any stride (the experts' gate / up halves of one [N, 2F] gradient)."""
    x_NI = x_NI if x_NI.stride(-1) == 1 else x_NI.contiguous()
    N, I = x_NI.shape
    if policy.runs_triton(x_NI):
        q = torch.empty(N, I, device=x_NI.device, dtype=FP8)
        s = torch.empty(N, device=x_NI.device, dtype=torch.float32)
        if N and I:
            triton, kernel, _ = _kernels()
            block = triton.next_power_of_2(I)
            kernel[(N,)](x_NI, q, s, I, x_NI.stride(0), BLOCK=block, num_warps=max(1, min(16, block // 512)))
        return q, s
    inv, s = _scale_inv(x_NI.abs().amax(-1) if I else x_NI.new_zeros(N))
    return (x_NI.float() * inv[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), s


@quantize_rows.register_fake
def _(x_NI):
    return x_NI.new_empty(x_NI.shape, dtype=FP8), x_NI.new_empty(x_NI.shape[0], dtype=torch.float32)


@torch.library.custom_op("dtensor_moe::fp8_quantize_cols", mutates_args=())
def quantize_cols(
    x_NC: torch.Tensor,
    starts_G: torch.Tensor,
    ends_G: torch.Tensor,
    dsts_G: torch.Tensor,
    out_shape: list[int],
    group_stride: int,
    col_stride: int,
    pad: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per group g and column c, amax over rows starts_G[g]:ends_G[g] of x_NC: q (flat layout
    q[g * group_stride + c * col_stride + dsts_G[g] + row - start], each group's rows padded with
    zeros to a multiple of `pad`, of shape out_shape) and s [G, C]. Slots no group writes are left unset."""
    x_NC = x_NC.contiguous()
    G, C = starts_G.shape[0], x_NC.shape[1]
    q = torch.empty(out_shape, device=x_NC.device, dtype=FP8)
    s = torch.empty(G, C, device=x_NC.device, dtype=torch.float32)
    if policy.runs_triton(x_NC):
        if G and C:
            triton, _, kernel = _kernels()
            kernel[(triton.cdiv(C, 64), G)](x_NC, q, s, starts_G, ends_G, dsts_G, C, group_stride, col_stride,
                                            PAD=pad, BLOCK_R=64, BLOCK_C=64, num_warps=4)
        return q, s
    flat = q.view(-1)
    spans = zip(*(policy.host_list(t, "exact_loop") for t in (starts_G, ends_G, dsts_G)))
    for g, (a, b, dst) in enumerate(spans):
        rows = x_NC[a:b].float()
        inv, s[g] = _scale_inv(rows.abs().amax(0) if b > a else x_NC.new_zeros(C))
        n = -(-(b - a) // pad) * pad
        block = torch.zeros(n, C, device=x_NC.device)
        block[: b - a] = rows * inv
        at = (g * group_stride + dst + torch.arange(C, device=x_NC.device)[None, :] * col_stride
              + torch.arange(n, device=x_NC.device)[:, None])
        flat[at.flatten()] = block.clamp(-FP8_MAX, FP8_MAX).to(FP8).flatten()
    return q, s


@quantize_cols.register_fake
def _(x_NC, starts_G, ends_G, dsts_G, out_shape, group_stride, col_stride, pad):
    return (x_NC.new_empty(out_shape, dtype=FP8), x_NC.new_empty(starts_G.shape[0], x_NC.shape[1], dtype=torch.float32))


def _padded_offsets(offs_E: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each expert block's start and end in the 16-row padded token layout (device tensors, no sync)."""
    counts = torch.diff(offs_E, prepend=offs_E.new_zeros(1))
    ends = torch.cumsum((counts + ALIGN - 1) // ALIGN * ALIGN, 0, dtype=torch.int32)
    return ends - (counts + ALIGN - 1) // ALIGN * ALIGN, ends


def _quantize(t: torch.Tensor, layout: str, offs_E: torch.Tensor | None):
    if layout == "rows":  # [..., I] along I
        q, s = quantize_rows(t.reshape(-1, t.shape[-1]))
        return q.view(t.shape), s.view(t.shape[:-1])
    if layout == "weight_cols":  # [E, R, C] along R -> q [E, C, R], s [E, C]
        E, R, C = t.shape
        starts = torch.arange(E, device=t.device, dtype=torch.int32) * R
        q, s = quantize_cols(t.reshape(E * R, C), starts, starts + R, torch.zeros_like(starts), [E, C, R], C * R, R, 1)
        return q, s
    # "token_cols": [N, C] with expert blocks ending at offs_E -> q [C, N_pad], s [E, C], padded ends
    N, C = t.shape
    dsts, ends_pad = _padded_offsets(offs_E)
    starts = torch.cat([offs_E.new_zeros(1), offs_E[:-1]])
    n_pad = -(-N // ALIGN) * ALIGN + ALIGN * offs_E.shape[0]
    q, s = quantize_cols(t, starts, offs_E, dsts, [C, n_pad], 0, n_pad, ALIGN)
    return q, s, ends_pad


_MEMO: dict = {}


def quantized(t: torch.Tensor, layout: str, offs_E: torch.Tensor | None = None):
    """`t` quantized in `layout` ("rows", "weight_cols", "token_cols"), memoized while t's base
    tensor lives at the same version (views included: the key holds the view's geometry)."""
    if torch.compiler.is_compiling():
        return _quantize(t, layout, offs_E)
    root = t._base if t._base is not None else t
    key = (layout, t.storage_offset(), tuple(t.shape), t.stride(), id(offs_E))
    slot = _MEMO.get(id(root))
    if slot is None or slot[0]() is not root:
        slot = _MEMO[id(root)] = (weakref.ref(root), {})
        weakref.finalize(root, _MEMO.pop, id(root), None)
    hit = slot[1].get(key)
    if hit is not None and hit[0] == root._version and hit[1] is offs_E:
        return hit[2]
    out = _quantize(t, layout, offs_E)
    slot[1][key] = (root._version, offs_E, out)  # offs_E kept alive so its id is not reused
    return out


@torch.library.custom_op("dtensor_moe::fp8_grouped_mm", mutates_args=())
def fp8_grouped_mm(q_NI: torch.Tensor, s_N: torch.Tensor, qw_EIO: torch.Tensor, sw_EO: torch.Tensor,
                   offs_E: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Row block e of (q_NI * s_N) times (qw_EIO * sw_EO[:, None, :]) [N, O]; qw_EIO column-major in
    its last two dims. CUDA: torch._scaled_grouped_mm, bf16 out; elsewhere the dequantized operands
    in fp32 (fp64 for an fp64 out_dtype, so float64 parity checks stay tight)."""
    if q_NI.is_cuda:
        return torch._scaled_grouped_mm(q_NI, qw_EIO, s_N, sw_EO, offs=offs_E, out_dtype=torch.bfloat16).to(out_dtype)
    acc = torch.promote_types(out_dtype, torch.float32)
    x, w = q_NI.to(acc) * s_N.unsqueeze(-1), qw_EIO.to(acc) * sw_EO.unsqueeze(-2)
    ends = policy.host_list(offs_E, "exact_loop")
    outs = [x[a:b] @ w[e] for e, (a, b) in enumerate(zip([0, *ends[:-1]], ends))]
    return torch.cat(outs).to(out_dtype) if outs else x.new_empty(0, w.shape[-1], dtype=out_dtype)


@fp8_grouped_mm.register_fake
def _(q_NI, s_N, qw_EIO, sw_EO, offs_E, out_dtype):
    return q_NI.new_empty(q_NI.shape[0], qw_EIO.shape[-1], dtype=out_dtype)


@torch.library.custom_op("dtensor_moe::fp8_grouped_weight_grad", mutates_args=())
def fp8_grouped_weight_grad(qg_ON: torch.Tensor, sg_EO: torch.Tensor, qx_IN: torch.Tensor, sx_EI: torch.Tensor,
                            ends_E: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """[E, O, I]: per expert block (columns up to ends_E[e] of the padded token layouts) the product
    (qg * sg[e][:, None]) (qx * sx[e][:, None])^T, reduced over the block's tokens."""
    if qg_ON.is_cuda:
        return torch._scaled_grouped_mm(qg_ON, qx_IN.t(), sg_EO.flatten(), sx_EI.flatten(), offs=ends_E,
                                        out_dtype=torch.bfloat16).to(out_dtype)
    acc = torch.promote_types(out_dtype, torch.float32)
    ends = policy.host_list(ends_E, "exact_loop")
    outs = [(qg_ON[:, a:b].to(acc) * sg_EO[e, :, None]) @ (qx_IN[:, a:b].to(acc) * sx_EI[e, :, None]).t()
            for e, (a, b) in enumerate(zip([0, *ends[:-1]], ends))]
    E, O, I = sg_EO.shape[0], qg_ON.shape[0], qx_IN.shape[0]
    return torch.stack(outs).to(out_dtype) if outs else qg_ON.new_empty(E, O, I, dtype=out_dtype)


@fp8_grouped_weight_grad.register_fake
def _(qg_ON, sg_EO, qx_IN, sx_EI, ends_E, out_dtype):
    return qg_ON.new_empty(sg_EO.shape[0], qg_ON.shape[0], qx_IN.shape[0], dtype=out_dtype)


def pack_rows(x_NI: torch.Tensor) -> torch.Tensor:
    """[N, I + 4] uint8: each row of x quantized rowwise (quantize_rows) followed by its fp32 scale's
    bytes, one tensor so that a row and its scale travel together (the FP8 dispatch payload; uint8
    because gloo and NCCL's all-to-all need no float8 support to move bytes)."""
    q, s = quantize_rows(x_NI)
    return torch.cat([q.view(torch.uint8), s.view(torch.uint8).view(-1, 4)], 1)


def unpack_rows(p_NP: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """pack_rows' rows dequantized into `dtype` (computed in at least fp32)."""
    acc = torch.promote_types(dtype, torch.float32)
    q = p_NP[:, :-4].view(FP8).to(acc)
    return (q * p_NP[:, -4:].contiguous().view(torch.float32).to(acc)).to(dtype)


def grouped_mm(x_NI: torch.Tensor, w_EIO: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """x_NI's row block e times w_EIO[e] in FP8, out in x's dtype. w_EIO is a transposed view of a
    stored [E, O, I] weight (the forward: its rows are the reduced dim, quantized rowwise) or the
    stored [E, I, O] weight itself (the input gradient: quantized per column, transposed)."""
    q, s = quantized(x_NI, "rows")
    if w_EIO.stride(-2) == 1:  # already column-major: a transposed view of [E, O, I]
        qw, sw = quantized(w_EIO.transpose(-2, -1), "rows")
        qw = qw.transpose(-2, -1)
    else:
        qw, sw = quantized(w_EIO, "weight_cols")
        qw = qw.transpose(-2, -1)
    return fp8_grouped_mm(q, s, qw, sw, offs_E, x_NI.dtype)


def grouped_weight_grad(g_NO: torch.Tensor, x_NI: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """[E, O, I]: g_e^T x_e per expert in FP8 (both operands scaled per expert and column)."""
    qg, sg, ends = quantized(g_NO, "token_cols", offs_E)
    qx, sx, _ = quantized(x_NI, "token_cols", offs_E)
    return fp8_grouped_weight_grad(qg, sg, qx, sx, ends, g_NO.dtype)
