"""The experts' autograd: `grouped_swiglu` (rows grouped by expert through each expert's SwiGLU) and
`grouped_swiglu_pairs` (the same over expert-major pairs of rows that hold each token once: the minimal activation
memory), each a `torch.autograd.Function` whose backward runs the input-, weight- and bias-gradient GEMMs itself
(kernels/grouped_mm.py: in-GEMM accumulation into existing gradients, FP8 where kernels/policy.py picks it), and
`gather_for_compute`, the experts' weights as those GEMMs take them.

The layout (w13 [E, 2, F, D], w2 [E, D, F], biases b13 [E, 2, F], b2 [E, D]) is experts.py's.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate

from dtensor_moe.grad_scale import ScaleGrad
from dtensor_moe.kernels import policy
from dtensor_moe.kernels.grouped_mm import add_weight_grad_, mm, weight_grad
from dtensor_moe.kernels.segment_sum import expand_rows, segment_sum
from dtensor_moe.kernels.swiglu import (
    clamped_swiglu,
    clamped_swiglu_backward,
    swiglu,
    swiglu_backward,
    weighted_gate_backward,
)

__all__ = ["gather_for_compute", "grouped_swiglu", "grouped_swiglu_pairs"]


def _shard(w: torch.Tensor) -> torch.Tensor:
    # Parallelized weights are DTensors; the dispatcher already brought this rank the tokens
    # of exactly the slice it holds, so the GEMM runs on the local shard.
    return w.to_local() if isinstance(w, DTensor) else w


def gather_for_compute(w: torch.Tensor) -> torch.Tensor:
    """A weight on the whole expert mesh (compiled layers under EDP / HSDP: ExpertParallel's
    `gather_in_forward`) as this rank's (ep, etp) slice: all-gathered over the data-parallel axes
    in the forward, its gradient summed over them and reduce-scattered back in the backward, both
    inside the graph (FSDP2 does the same with hooks that torch.compile cannot trace). FSDP2
    averages over those ranks; so does the gradient here. Other weights pass through."""
    if not isinstance(w, DTensor):
        return w
    data = [i for i, n in enumerate(w.device_mesh.mesh_dim_names or ()) if n not in ("ep", "etp")]
    if not data:
        return w
    gathered, grads = list(w.placements), list(w.placements)
    for i in data:
        gathered[i], grads[i] = Replicate(), Partial()
    local = w.redistribute(placements=gathered).to_local(grad_placements=grads)
    return ScaleGrad.apply(local, 1 / math.prod([w.device_mesh.size(i) for i in data]))


def _like_param(g: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """A local weight gradient as the gradient of parameter p (its dtype; a DTensor like p)."""
    g = g.to(p.dtype)
    if isinstance(p, DTensor):
        return DTensor.from_local(g, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
    return g


def _existing_grads(ctx, ws):
    """Each weight's gradient to add into in place (the local shard of the parameter's .grad), or
    None where autograd must accumulate: no gradient yet (it then keeps the GEMM result as is, no
    copy), another dtype or layout, a double-backward graph, or autograd.grad (it returns the
    gradients and must leave .grad alone)."""
    if torch.is_grad_enabled() or not _backward_accumulates(ctx):
        return None
    grads = []
    for p, w in zip(ctx.params, ws):
        if not p.is_leaf:  # a replica's copy of its owner's weights: its gradient flows back through autograd
            return None
        g = p.grad
        if isinstance(g, DTensor):
            g = g.to_local() if g.placements == p.placements else None
        if g is None or g.dtype != w.dtype or g.shape != w.shape or not g.is_contiguous():
            return None
        grads.append(g)
    return grads


def _backward_accumulates(ctx) -> bool:
    """Whether this is .backward() into the weights' .grad. Under autograd.grad the engine refuses
    the question for leaves (RuntimeError); a torch without the query gets autograd's path."""
    try:
        return all(node is not None and torch._C._will_engine_execute_node(node)
                   for node, _ in ctx.next_functions[1:3])
    except (RuntimeError, AttributeError):
        return False


def _with_bias(y_NO, b_EO, offs_E):
    return y_NO if b_EO is None else y_NO + expand_rows(b_EO, offs_E, y_NO.shape[0])


def _gate_up(w13_E2FD: torch.Tensor) -> torch.Tensor:
    """w13's two halves as one [E, 2F, D] operand (rows: gate's F, then up's F)."""
    E, _, F_, D = w13_E2FD.shape
    return w13_E2FD.reshape(E, 2 * F_, D)


@dataclass(frozen=True)
class _SwiGLUOptions:
    """_GroupedSwiGLU's non-tensor arguments, as one argument: its backward returns one None for
    all of them (offs_E, a tensor, stays a positional input of its own).

    `weight_grad_scale` multiplies only the weight (and bias) gradients. `accumulate`
    (policy.weight_grad_accumulation; None under torch.compile) picks how the backward adds weight
    gradients into existing ones. `host_counts`: the per-expert row counts on the host, or None.
    `clamp`: (alpha, limit) of the clamped gate, None for silu. `add_b2` False: another rank adds b2
    to these partial outputs. `precision`: MoERunOptions.expert_precision."""

    weight_grad_scale: float
    accumulate: Callable[[torch.Size], str] | None
    host_counts: list[int] | None
    clamp: tuple[float, float] | None
    add_b2: bool
    precision: str


def _weights(w13, w2, b13, b2, dtype):
    """The experts' local shards in the compute dtype."""
    w13_E2FD, w2_EDF = (_shard(w).to(dtype) for w in (w13, w2))
    b13_E2F, b2_ED = (None if b is None else _shard(b).to(dtype) for b in (b13, b2))
    return w13_E2FD, w2_EDF, b13_E2F, b2_ED


def _pre_activation(x_ND, w13_E2FD, b13_E2F, offs_E, opts) -> tuple[torch.Tensor, torch.Tensor]:
    """(a_NF, b_NF): the gate and up outputs, one fused GEMM (views of one [N, 2F] tensor) or one per half."""
    precision, host = opts.precision, opts.host_counts
    E, _, F_, D = w13_E2FD.shape
    if policy.gate_up_fused(precision, "fwd", x_ND, E, D, F_):
        ab_N2F = mm(x_ND, _gate_up(w13_E2FD).transpose(-2, -1), offs_E, host_counts=host)
        if b13_E2F is not None:
            ab_N2F = _with_bias(ab_N2F, b13_E2F.reshape(E, 2 * F_), offs_E)
        return ab_N2F.chunk(2, dim=-1)
    # two tensors, which the gate reads as they are
    return tuple(_with_bias(mm(x_ND, w13_E2FD[:, i].transpose(-2, -1), offs_E, precision, host_counts=host),
                            None if b13_E2F is None else b13_E2F[:, i], offs_E) for i in (0, 1))


def _activation(a_NF, b_NF, opts):
    return swiglu(a_NF, b_NF) if opts.clamp is None else clamped_swiglu(a_NF, b_NF, *opts.clamp)


def _activation_backward(dh_NF, a_NF, b_NF, opts):
    if opts.clamp is None:
        return swiglu_backward(dh_NF, a_NF, b_NF)
    return clamped_swiglu_backward(dh_NF, a_NF, b_NF, *opts.clamp)


def _down(h_NF, w2_EDF, b2_ED, offs_E, opts):
    return _with_bias(mm(h_NF, w2_EDF.transpose(-2, -1), offs_E, opts.precision, host_counts=opts.host_counts),
                      b2_ED if opts.add_b2 else None, offs_E)


def _input_grad(dab_N2F, w13_E2FD, offs_E, opts):
    """dx_ND from the gate / up pre-activations' gradient."""
    precision, host = opts.precision, opts.host_counts
    E, _, F_, D = w13_E2FD.shape
    if policy.gate_up_fused(precision, "dgrad", dab_N2F, E, F_, D):
        return mm(dab_N2F, _gate_up(w13_E2FD), offs_E, host_counts=host)
    da_NF, db_NF = dab_N2F.chunk(2, dim=-1)
    return (mm(da_NF, w13_E2FD[:, 0], offs_E, precision, "dgrad", host)
            + mm(db_NF, w13_E2FD[:, 1], offs_E, precision, "dgrad", host))


def _parameter_grads(ctx, opts, offs_E, w13_E2FD, w2_EDF, dab_N2F, x_ND, dy_ND, h_NF, dy_bias_ND):
    """(dw13, dw2, db13, db2), each the gradient of its parameter, or None where it was added into .grad in place.

    The weight gradients are dw13 = dab^T x and dw2 = dy^T h per expert; the bias gradients the per-expert sums of
    dab and dy_bias (the down projection's output gradient where dy is another factorization of it)."""
    scale, precision, host = opts.weight_grad_scale, opts.precision, opts.host_counts
    E, _, F_, D = w13_E2FD.shape
    dbs = [None if p is None else _like_param(segment_sum(g, offs_E).view(shape) * scale, p)
           for g, p, shape in zip((dab_N2F, dy_bias_ND), ctx.biases, ((E, 2, F_), (E, D)))]
    grads = _existing_grads(ctx, (w13_E2FD, w2_EDF)) if opts.accumulate is not None else None
    if grads is not None:
        # The method as measured per weight: gate / up by one half's shape.
        for out, g, x, shape in zip((_gate_up(grads[0]), grads[1]), (dab_N2F, dy_ND), (x_ND, h_NF),
                                    ((E, F_, D), grads[1].shape)):
            add_weight_grad_(out, g, x, offs_E, scale, host, opts.accumulate(shape))
        return None, None, *dbs
    if scale != 1:  # on whichever operand of each weight-gradient GEMM is smaller
        if 2 * F_ <= D:
            dab_N2F = dab_N2F * scale
        else:
            x_ND = x_ND * scale
        if F_ <= D:
            h_NF = h_NF * scale
        else:
            dy_ND = dy_ND * scale
    dw2 = weight_grad(dy_ND, h_NF, offs_E, precision, host)
    if policy.gate_up_fused(precision, "wgrad", x_ND, E, D, F_):
        dw13 = weight_grad(dab_N2F, x_ND, offs_E, host_counts=host).view(E, 2, F_, D)
    else:
        dw13 = torch.stack([weight_grad(g, x_ND, offs_E, precision, host) for g in dab_N2F.chunk(2, dim=-1)], 1)
    return *(_like_param(dw, p) for dw, p in zip((dw13, dw2), ctx.params)), *dbs


class _GroupedSwiGLU(torch.autograd.Function):
    """y = (gate(x W1^T + b1, x W3^T + b3)) W2^T + b2 per expert, with a hand-ordered backward.

    W1 and W3 are w13's halves, computed as one GEMM each way (policy.gate_up_fused) unless FP8 runs
    that GEMM: the FP8 table measured the F-wide GEMMs, so those run on each half. `weight_grad_scale`
    is applied on the smaller operand of each weight-gradient GEMM (F-sized activations rather than
    D-sized tokens when F < D). In eager mode, when the weights already hold gradients (gradient
    accumulation), `accumulate` adds the weight gradients into them inside the GEMMs and autograd gets
    None; compiled graphs leave accumulation to autograd. With `add_b2` False (ETP sums the partial
    outputs) b2's gradient is computed here too, so every replica holds the same one. The weights stay
    inputs 1-2: _backward_accumulates reads their autograd nodes.
    """

    @staticmethod
    def forward(ctx, x_ND, w13, w2, b13, b2, offs_E, opts: _SwiGLUOptions):
        # The parameters themselves are the inputs (not their to_local() views): this backward owns
        # their gradients, and a view's backward may turn a skipped gradient into zeros to add.
        w13_E2FD, w2_EDF, b13_E2F, b2_ED = _weights(w13, w2, b13, b2, x_ND.dtype)
        a_NF, b_NF = _pre_activation(x_ND, w13_E2FD, b13_E2F, offs_E, opts)
        h_NF = _activation(a_NF, b_NF, opts)
        y_ND = _down(h_NF, w2_EDF, b2_ED, offs_E, opts)
        # What autograd would keep but silu(a), which the backward recomputes.
        ctx.save_for_backward(x_ND, a_NF, b_NF, h_NF, w13_E2FD, w2_EDF, offs_E)
        ctx.opts = opts
        ctx.params, ctx.biases = (w13, w2), (b13, b2)
        return y_ND

    @staticmethod
    def backward(ctx, dy_ND):
        x_ND, a_NF, b_NF, h_NF, w13_E2FD, w2_EDF, offs_E = ctx.saved_tensors
        opts = ctx.opts
        dy_ND = dy_ND.contiguous()
        dh_NF = mm(dy_ND, w2_EDF, offs_E, opts.precision, "dgrad", opts.host_counts)
        dab_N2F = _activation_backward(dh_NF, a_NF, b_NF, opts)
        dx_ND = _input_grad(dab_N2F, w13_E2FD, offs_E, opts)
        grads = _parameter_grads(ctx, opts, offs_E, w13_E2FD, w2_EDF, dab_N2F, x_ND, dy_ND, h_NF, dy_ND)
        return dx_ND, *grads, None, None


class _PairSwiGLU(torch.autograd.Function):
    """The minimal-memory path (MoERunOptions.activation_memory = "minimal"): the rows x_RD, each token once, in;
    each row's routing-weighted sum of its pairs' expert outputs out, z_r = sum_n weight_n y_n over the pairs n
    that read row r (`PairRows`). The same math as expand -> _GroupedSwiGLU -> combine, keeping less.

    Kept for the backward: x_RD (the caller's tensor: the layer's input, or under EP the received rows), the
    gate / up pre-activation [N, 2F] and the O(N) tables; not the pair-order copy of x (re-gathered), the
    SwiGLU output (recomputed from the pre-activation) or the expert outputs y (the routing weights' gradient
    <dz_r, y_n> is computed as <dz_r W2, h_n> + <dz_r, b2>, from the down projection's input gradient before it
    is weighted, as SonicMoE does). The weight_N input stays differentiable (it trains the router).
    """

    @staticmethod
    def forward(ctx, x_RD, w13, w2, b13, b2, weight_N, row_N, readers_RK, offs_E, opts: _SwiGLUOptions):
        w13_E2FD, w2_EDF, b13_E2F, b2_ED = _weights(w13, w2, b13, b2, x_RD.dtype)
        x_ND = x_RD.index_select(0, row_N)
        a_NF, b_NF = _pre_activation(x_ND, w13_E2FD, b13_E2F, offs_E, opts)
        y_ND = _down(_activation(a_NF, b_NF, opts), w2_EDF, b2_ED, offs_E, opts)
        z_RD = torch.ops.dtensor_moe.gather_sum(y_ND, readers_RK, row_N, weight_N)
        ctx.save_for_backward(x_RD, a_NF, b_NF, weight_N, row_N, readers_RK, w13_E2FD, w2_EDF, b2_ED, offs_E)
        ctx.opts = opts
        ctx.params, ctx.biases = (w13, w2), (b13, b2)
        return z_RD

    @staticmethod
    def backward(ctx, dz_RD):
        x_RD, a_NF, b_NF, weight_N, row_N, readers_RK, w13_E2FD, w2_EDF, b2_ED, offs_E = ctx.saved_tensors
        opts = ctx.opts
        g_ND = dz_RD.reshape(-1, dz_RD.shape[-1]).index_select(0, row_N)  # dz at each pair: dy / weight
        du_NF = mm(g_ND, w2_EDF, offs_E, opts.precision, "dgrad", opts.host_counts)  # dh / weight
        # One pass: SwiGLU recomputed, the weighted gate's gradient, weight * h for dw2, <du, h> for the weights.
        dab_N2F, hw_NF, dweight_N = weighted_gate_backward(du_NF, a_NF, b_NF, weight_N, opts.clamp is not None,
                                                           *(opts.clamp or (1.0, 0.0)))
        if b2_ED is not None and opts.add_b2:
            acc = dweight_N.dtype
            dweight_N = dweight_N + (g_ND.to(acc) * expand_rows(b2_ED, offs_E, g_ND.shape[0]).to(acc)).sum(-1)
        dx_RD = torch.ops.dtensor_moe.gather_sum(_input_grad(dab_N2F, w13_E2FD, offs_E, opts),
                                                  readers_RK.reshape(-1, readers_RK.shape[-1]), row_N, None)
        # dw2 = dy^T h = g^T (weight * h): the weight on the F-wide operand, no [N, D] dy kept beside g.
        dy_bias_ND = None if ctx.biases[1] is None else g_ND * weight_N.to(g_ND.dtype)[:, None]
        grads = _parameter_grads(ctx, opts, offs_E, w13_E2FD, w2_EDF, dab_N2F, x_RD.index_select(0, row_N), g_ND,
                                 hw_NF, dy_bias_ND)
        return dx_RD, *grads, dweight_N.to(weight_N.dtype), None, None, None, None


def grouped_swiglu(
    x_ND,
    counts_E,
    w13_E2FD,
    w2_EDF,
    weight_grad_scale: float = 1.0,
    host_counts: list[int] | None = None,
    biases: tuple | None = None,
    clamp: tuple[float, float] | None = None,
    add_b2: bool = True,
    precision: str = "bf16",
) -> torch.Tensor:
    """Rows grouped by expert (counts_E[e] rows for expert e) through each expert's SwiGLU:
    y = (silu(x W1^T) * x W3^T) W2^T per expert, differentiable in x and every weight.

    The experts' compute, as `GroupedExperts` runs it. The weights may be DTensors: the GEMMs run on
    their local shards, in x_ND's dtype.

    Args:
        x_ND (Tensor): [N, D] rows, expert 0's first, then expert 1's, ...
        counts_E (Tensor): [E] integer rows per expert, in row order.
        w13_E2FD (Tensor): [E, 2, F, D] gate and up weights.
        w2_EDF (Tensor): [E, D, F] down weights.
        weight_grad_scale (float): multiplies only the weight (and bias) gradients. Default 1.0.
        host_counts (list[int] | None): counts_E as a host list when the caller has it without a sync (the
            eager dispatcher does, padded blocks always); the exact per-expert loop then reads no counts
            off the device, and the backward may add weight gradients into existing ones per expert.
            Default None.
        biases (tuple | None): (b13_E2F, b2_ED), or None. Default None.
        clamp (tuple[float, float] | None): (alpha, limit) of gpt-oss's clamped SwiGLU, None for silu.
            Default None.
        add_b2 (bool): False where another rank adds b2 to these partial outputs (ETP). Default True.
        precision (str): "fp8" runs the GEMMs in FP8 where kernels/policy.py picks it
            (`MoERunOptions.expert_precision`); "bf16" never. Default "bf16".

    Returns:
        Tensor: y_ND [N, D], one output row per input row, in x_ND's dtype.

    Example:
        >>> import torch
        >>> from dtensor_moe import grouped_swiglu
        >>> w13_E2FD, w2_EDF = torch.randn(2, 2, 8, 4), torch.randn(2, 4, 8)
        >>> x_ND = torch.randn(3, 4)  # rows 0-1 for expert 0, row 2 for expert 1
        >>> y_ND = grouped_swiglu(x_ND, torch.tensor([2, 1]), w13_E2FD, w2_EDF)
        >>> gate, up = x_ND[2] @ w13_E2FD[1, 0].T, x_ND[2] @ w13_E2FD[1, 1].T
        >>> torch.allclose(y_ND[2], (torch.nn.functional.silu(gate) * up) @ w2_EDF[1].T, atol=1e-5)
        True
    """
    w13_E2FD, w2_EDF, biases, offs_E, opts = _prepare(x_ND, counts_E, w13_E2FD, w2_EDF, biases, weight_grad_scale,
                                                      host_counts, clamp, add_b2, precision)
    return _GroupedSwiGLU.apply(x_ND, w13_E2FD, w2_EDF, *(biases or (None, None)), offs_E, opts)


def grouped_swiglu_pairs(x_RD, pairs, counts_E, w13_E2FD, w2_EDF, weight_grad_scale: float = 1.0,
                         host_counts: list[int] | None = None, biases: tuple | None = None,
                         clamp: tuple[float, float] | None = None, add_b2: bool = True,
                         precision: str = "bf16") -> torch.Tensor:
    """`pairs.combine(grouped_swiglu(pairs.expand(x_RD), counts_E, ...))` keeping only x_RD, the gate / up
    pre-activation and O(pairs) tables for the backward (`_PairSwiGLU`; MoERunOptions.activation_memory "minimal").

    Args: x_RD [R, D] rows, each token once; pairs (routing/tables.py's PairRows, read by its row_N, weight_N and
    readers_RK): the expert-major pairs over them, counts_E [E] of them per expert; the rest as
    `grouped_swiglu`'s. Returns: [*pairs.readers_RK.shape[:-1], D], each row's routing-weighted sum of its
    pairs' outputs.
    """
    # The GEMMs' rows are the pairs: the policy reads their count, dtype and device off a stand-in of that shape.
    rows_ND = x_RD.new_empty(1, 1).expand(pairs.row_N.shape[0], x_RD.shape[1])
    w13_E2FD, w2_EDF, biases, offs_E, opts = _prepare(rows_ND, counts_E, w13_E2FD, w2_EDF, biases, weight_grad_scale,
                                                      host_counts, clamp, add_b2, precision)
    return _PairSwiGLU.apply(x_RD, w13_E2FD, w2_EDF, *(biases or (None, None)), pairs.weight_N, pairs.row_N,
                             pairs.readers_RK, offs_E, opts)


def _prepare(x_ND, counts_E, w13_E2FD, w2_EDF, biases, weight_grad_scale, host_counts, clamp, add_b2, precision):
    """The experts' weights as the GEMMs take them, offs_E and the options, for GEMMs over x_ND's rows."""
    w13_E2FD, w2_EDF = (gather_for_compute(w) for w in (w13_E2FD, w2_EDF))
    if biases is not None:
        biases = tuple(None if b is None else gather_for_compute(b) for b in biases)
    # .to(), not cumsum(dtype=): inductor folds the padded layer's constant counts into an int64 cumsum.
    offs_E = torch.cumsum(counts_E, dim=0).to(torch.int32)
    accumulate = None
    if not torch.compiler.is_compiling():
        E, _, F_, D = _shard(w13_E2FD).shape
        grouped = policy.grouped_mm_supported(x_ND, (E, F_, D))
        accumulate = policy.weight_grad_accumulation(x_ND, (E, F_, D), grouped, host_counts is not None, precision)
    opts = _SwiGLUOptions(weight_grad_scale=weight_grad_scale, accumulate=accumulate, host_counts=host_counts,
                          clamp=clamp, add_b2=add_b2, precision=precision)
    return w13_E2FD, w2_EDF, biases, offs_E, opts
