"""The Triton kernels of wgrad.accumulate (module-level, so one @triton.jit function can call another)."""

import triton
import triton.language as tl


@triton.jit
def accumulate_tile(g_ptr, x_ptr, ends_ptr, out_ptr, out_desc, g_desc, x_desc, e, to, ti, O, I, alpha,
                    BLOCK_O: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr, ATOMIC: tl.constexpr,
                    TMA: tl.constexpr, TMA_LOADS: tl.constexpr):
    start = tl.load(ends_ptr + e - 1, mask=e > 0, other=0).to(tl.int64)
    end = tl.load(ends_ptr + e).to(tl.int64)
    ro = to * BLOCK_O + tl.arange(0, BLOCK_O)
    ri = ti * BLOCK_I + tl.arange(0, BLOCK_I)
    rk = tl.arange(0, BLOCK_K)
    out = out_ptr + e * O * I + ro[:, None].to(tl.int64) * I + ri[None, :]
    in_tile = (ro[:, None] < O) & (ri[None, :] < I)
    acc = tl.zeros([BLOCK_O, BLOCK_I], dtype=tl.float32)
    tail = start
    if TMA_LOADS:  # whole BLOCK_K steps through TMA; the expert's last, partial one masked below
        tail = end - (end - start) % BLOCK_K
        for k0 in range(start.to(tl.int32), tail.to(tl.int32), BLOCK_K):  # descriptors take int32 offsets
            g_KO = g_desc.load([k0, to * BLOCK_O])
            x_KI = x_desc.load([k0, ti * BLOCK_I])
            acc = tl.dot(g_KO.T, x_KI, acc)
    for k0 in range(tail, end, BLOCK_K):
        rows = k0 + rk
        in_rows = rows < end
        g_OK = tl.load(
            g_ptr + rows[None, :] * O + ro[:, None], mask=in_rows[None, :] & (ro[:, None] < O), other=0.0
        )
        x_KI = tl.load(
            x_ptr + rows[:, None] * I + ri[None, :], mask=in_rows[:, None] & (ri[None, :] < I), other=0.0
        )
        acc = tl.dot(g_OK, x_KI, acc)
    if TMA:  # out_desc: [E, O, I] in [1, BLOCK_O, BLOCK_I] boxes, so a tile never spills into the next expert
        out_desc.atomic_add([e.to(tl.int32), to * BLOCK_O, ti * BLOCK_I],
                            (acc * alpha).to(out_ptr.dtype.element_ty).reshape(1, BLOCK_O, BLOCK_I))
    elif ATOMIC:
        tl.atomic_add(out, (acc * alpha).to(out_ptr.dtype.element_ty), mask=in_tile, sem="relaxed")
    else:
        acc = acc * alpha + tl.load(out, mask=in_tile, other=0.0).to(tl.float32)
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=in_tile)


@triton.jit
def wgrad_accumulate(g_ptr, x_ptr, ends_ptr, out_ptr, out_desc, g_desc, x_desc, E, O, I, alpha,
                     BLOCK_O: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr, ATOMIC: tl.constexpr,
                     TMA: tl.constexpr, TMA_LOADS: tl.constexpr):
    tiles_i = tl.cdiv(I, BLOCK_I)
    accumulate_tile(g_ptr, x_ptr, ends_ptr, out_ptr, out_desc, g_desc, x_desc, tl.program_id(1).to(tl.int64),
                    tl.program_id(0) // tiles_i, tl.program_id(0) % tiles_i, O, I, alpha,
                    BLOCK_O, BLOCK_I, BLOCK_K, ATOMIC, TMA, TMA_LOADS)


@triton.jit
def wgrad_accumulate_persistent(g_ptr, x_ptr, ends_ptr, out_ptr, out_desc, g_desc, x_desc, E, O, I, alpha,
                                BLOCK_O: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr,
                                ATOMIC: tl.constexpr, TMA: tl.constexpr, TMA_LOADS: tl.constexpr):
    # Consecutive tiles run at once on different programs: one expert's, so its rows stay in L2.
    tiles_i = tl.cdiv(I, BLOCK_I)
    tiles = tl.cdiv(O, BLOCK_O) * tiles_i
    for t in range(tl.program_id(0), E * tiles, tl.num_programs(0)):
        r = t % tiles
        accumulate_tile(g_ptr, x_ptr, ends_ptr, out_ptr, out_desc, g_desc, x_desc, (t // tiles).to(tl.int64),
                        r // tiles_i, r % tiles_i, O, I, alpha, BLOCK_O, BLOCK_I, BLOCK_K, ATOMIC, TMA, TMA_LOADS)
