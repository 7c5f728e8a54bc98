"""SwiGLU experts stored stacked, in torchtitan's GroupedExperts layout and names.

w1 [E, F, D], w2 [E, D, F], w3 [E, F, D]: state dicts map one-to-one to torchtitan.
"""

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from dtensor_moe.kernels import policy
from dtensor_moe.kernels.grouped_mm import add_weight_grad_, grouped_mm, grouped_weight_grad
from dtensor_moe.kernels.swiglu import swiglu, swiglu_backward
from dtensor_moe.routing import ExpertInput, TokenCopies


def _shard(w: torch.Tensor) -> torch.Tensor:
    # Parallelized weights are DTensors; the dispatcher already brought this rank the tokens
    # of exactly the slice it holds, so the GEMM runs on the local shard.
    return w.to_local() if isinstance(w, DTensor) else w


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
                   for node, _ in ctx.next_functions[1:4])
    except (RuntimeError, AttributeError):
        return False


class _GroupedSwiGLU(torch.autograd.Function):
    """y = (silu(x W1^T) * (x W3^T)) W2^T per expert, with a hand-ordered backward.

    `weight_grad_scale` multiplies only the weight gradients, on the smaller operand of each GEMM
    (F-sized activations rather than D-sized tokens when F < D). In eager mode, when the weights
    already hold gradients (gradient accumulation), `accumulate` (policy.weight_grad_accumulation)
    adds the weight gradients into them inside the GEMMs and autograd gets None; compiled graphs
    leave accumulation to autograd.
    """

    @staticmethod
    def forward(ctx, x_ND, w1, w2, w3, offs_E, weight_grad_scale, accumulate, host_counts):
        # The parameters themselves are the inputs (not their to_local() views): this backward owns
        # their gradients, and a view's backward may turn a skipped gradient into zeros to add.
        w1_EFD, w2_EDF, w3_EFD = (_shard(w).to(x_ND.dtype) for w in (w1, w2, w3))
        a_NF = grouped_mm(x_ND, w1_EFD.transpose(-2, -1), offs_E)
        b_NF = grouped_mm(x_ND, w3_EFD.transpose(-2, -1), offs_E)
        h_NF = swiglu(a_NF, b_NF)
        y_ND = grouped_mm(h_NF, w2_EDF.transpose(-2, -1), offs_E)
        # What autograd would keep but silu(a), which the backward recomputes.
        ctx.save_for_backward(x_ND, a_NF, b_NF, h_NF, w1_EFD, w2_EDF, w3_EFD, offs_E)
        ctx.scale, ctx.accumulate, ctx.host_counts = weight_grad_scale, accumulate, host_counts
        ctx.params = (w1, w2, w3)
        return y_ND

    @staticmethod
    def backward(ctx, dy_ND):
        x_ND, a_NF, b_NF, h_NF, w1_EFD, w2_EDF, w3_EFD, offs_E = ctx.saved_tensors
        scale = ctx.scale
        dy_ND = dy_ND.contiguous()
        dh_NF = grouped_mm(dy_ND, w2_EDF, offs_E)
        da_NF, db_NF = swiglu_backward(dh_NF, a_NF, b_NF)
        dx_ND = grouped_mm(da_NF, w1_EFD, offs_E) + grouped_mm(db_NF, w3_EFD, offs_E)
        grads = _existing_grads(ctx, (w1_EFD, w2_EDF, w3_EFD)) if ctx.accumulate is not None else None
        if grads is not None:
            for out, g, x in zip(grads, (da_NF, dy_ND, db_NF), (x_ND, h_NF, x_ND)):
                add_weight_grad_(out, g, x, offs_E, scale, ctx.host_counts, ctx.accumulate(out.shape))
            return dx_ND, None, None, None, None, None, None, None
        if scale != 1:  # on whichever operand of each weight-gradient GEMM is smaller
            F_, D = h_NF.shape[-1], x_ND.shape[-1]
            if 2 * F_ <= D:
                da_NF, db_NF = da_NF * scale, db_NF * scale
            else:
                x_ND = x_ND * scale
            if F_ <= D:
                h_NF = h_NF * scale
            else:
                dy_ND = dy_ND * scale
        dw2 = grouped_weight_grad(dy_ND, h_NF, offs_E)
        dw1 = grouped_weight_grad(da_NF, x_ND, offs_E)
        dw3 = grouped_weight_grad(db_NF, x_ND, offs_E)
        dws = (_like_param(dw, p) for dw, p in zip((dw1, dw2, dw3), ctx.params))
        return dx_ND, *dws, None, None, None, None


def grouped_swiglu(x_ND, counts_E, w1_EFD, w2_EDF, w3_EFD, weight_grad_scale: float = 1.0,
                   host_counts: list[int] | None = None) -> torch.Tensor:
    """Rows grouped by expert (counts_E[e] rows for expert e) through each expert's SwiGLU.

    The weights may be DTensors: the GEMMs run on their local shards, in x_ND's dtype.
    `host_counts`: counts_E as a host list when the caller has it without a sync (the eager
    dispatcher does); it lets the backward add weight gradients into existing ones per expert."""
    offs_E = torch.cumsum(counts_E, dim=0, dtype=torch.int32)
    accumulate = None
    if not torch.compiler.is_compiling():
        grouped = policy.grouped_mm_supported(x_ND, w1_EFD.shape)
        accumulate = policy.weight_grad_accumulation(x_ND, _shard(w1_EFD).shape, grouped, host_counts is not None)
    return _GroupedSwiGLU.apply(x_ND, w1_EFD, w2_EDF, w3_EFD, offs_E, weight_grad_scale, accumulate, host_counts)


class GroupedExperts(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, num_experts: int):
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))

    def forward(self, x: torch.Tensor | ExpertInput, counts_E: torch.Tensor | None = None,
                copies: TokenCopies | None = None) -> torch.Tensor:
        """Tokens x with their routing `copies`: copied into expert order, run, combined back into
        x's shape. Or, from the expert-parallel dispatcher, an `ExpertInput` (rows already grouped
        by local expert): returns one output row per input row."""
        ws = (self.w1, self.w2, self.w3)
        if isinstance(x, ExpertInput):
            return grouped_swiglu(x.x_ND, x.counts_E, *ws, weight_grad_scale=x.weight_grad_scale,
                                  host_counts=x.host_counts)
        y_ND = grouped_swiglu(copies.expand(x), counts_E, *ws)
        return copies.combine(y_ND, x.shape)

    def reset_parameters(self, std: float = 0.02):
        for w in (self.w1, self.w2, self.w3):
            nn.init.trunc_normal_(w, std=std)
