"""SwiGLU experts stored stacked, in torchtitan's GroupedExperts layout and names.

w1 [E, F, D], w2 [E, D, F], w3 [E, F, D]: state dicts map one-to-one to torchtitan.
"""

import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from dtensor_moe.kernels import swiglu, wgrad
from dtensor_moe.kernels.gather_sum import runs_triton


def _grouped_mm_supported(x_TD: torch.Tensor, w1_EFD: torch.Tensor) -> bool:
    if not hasattr(torch, "_grouped_mm"):
        return False
    # The kernels (CUDA and CPU) need 16-byte aligned row strides for every operand layout used.
    if any(n * x_TD.element_size() % 16 for n in w1_EFD.shape[-2:]):
        return False
    if x_TD.is_cuda:
        return x_TD.dtype == torch.bfloat16
    # The CPU kernel exists from torch 2.13 for these dtypes; float64 takes the exact loop below.
    return x_TD.device.type == "cpu" and x_TD.dtype in (torch.float32, torch.bfloat16) and _cpu_grouped_mm_ok()


@functools.cache
def _cpu_grouped_mm_ok() -> bool:
    """Probed once: whether this torch build has the CPU grouped-GEMM kernel."""
    try:
        torch._grouped_mm(torch.ones(4, 4), torch.ones(1, 4, 4), offs=torch.tensor([4], dtype=torch.int32))
        return True
    except (RuntimeError, NotImplementedError):
        return False


def grouped_mm(x_NI: torch.Tensor, w_EIO: torch.Tensor, groups) -> torch.Tensor:
    """Rows of x_NI are grouped by expert; row block e is multiplied by w_EIO[e].

    `groups` is the kernel's int32 end offsets (a device tensor), or the per-expert row counts as
    a host list for the exact loop."""
    if isinstance(groups, torch.Tensor):
        return torch._grouped_mm(x_NI, w_EIO, offs=groups)
    outs = [xe @ w_EIO[e] for e, xe in enumerate(torch.split(x_NI, groups, dim=0))]
    return torch.cat(outs, dim=0) if outs else x_NI.new_empty(0, w_EIO.shape[-1])


def grouped_weight_grad(g_NO: torch.Tensor, x_NI: torch.Tensor, groups) -> torch.Tensor:
    """[E, O, I]: g_e^T x_e per expert over its row block (the weight gradient of grouped_mm)."""
    if isinstance(groups, torch.Tensor):
        return torch._grouped_mm(g_NO.t(), x_NI, offs=groups)
    pairs = zip(torch.split(g_NO, groups, dim=0), torch.split(x_NI, groups, dim=0))
    return torch.stack([ge.t() @ xe for ge, xe in pairs])


def _shard(w: torch.Tensor) -> torch.Tensor:
    # Parallelized weights are DTensors; the dispatcher already brought this rank the tokens
    # of exactly the slice it holds, so the GEMM runs on the local shard.
    return w.to_local() if isinstance(w, DTensor) else w


def _local(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # Weights FSDP does not manage (no expert data-parallel axis) get mixed precision's compute dtype here.
    return _shard(w).to(dtype)


def _like_param(g: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """A local weight gradient as the gradient of parameter p (its dtype; a DTensor like p)."""
    g = g.to(p.dtype)
    if isinstance(p, DTensor):
        return DTensor.from_local(g, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
    return g


# A cuBLAS call per expert accumulates into the gradient only when each call outlasts its launch
# (~10 us from Python, ~6 GFLOP on an H200); below that the launches, not the GEMMs, set the time.
MIN_MACS_PER_EXPERT_GEMM = 2**32


def accumulate_weight_grad(out_EOI, g_NO, x_NI, host_counts, alpha):
    """out_EOI[e] += alpha * g_e^T x_e, the sum done by the GEMM (beta = 1): no separate pass that
    reads and rewrites the whole gradient, as autograd's accumulation does."""
    for o_OI, g_nO, x_nI in zip(out_EOI.unbind(0), g_NO.split(host_counts), x_NI.split(host_counts)):
        o_OI.addmm_(g_nO.t(), x_nI, alpha=alpha)


# cuBLAS runs an [O, I] weight gradient with O < I (w1/w3's [F, D] when F < D) with a slow tile when
# each expert reduces over few rows (~375 TFLOP/s at 512 rows, DeepSeek-like), fast at >= 2048 rows.
CUBLAS_WIDE_MIN_ROWS = 2048


def _weight_grad_adder(x_ND, groups, host_counts, w1_EFD):
    """How the backward adds weight gradients into existing ones: `adder(out_EOI, g_NO, x_NI, alpha)`,
    or None where autograd accumulates. One cuBLAS addmm_ per expert (needs the counts on the host)
    only where it measured fastest on 2xH200: per-expert GEMMs large enough to outlast their
    launches, in an orientation cuBLAS runs well (see CUBLAS_WIDE_MIN_ROWS). Everywhere else on
    CUDA one Triton launch per weight (kernels/wgrad.py; benchmarks/wgrad_probe.py, RESULTS.md)."""
    E, F_, D = w1_EFD.shape
    per_expert = host_counts is not None and (
        not isinstance(groups, torch.Tensor) or x_ND.shape[0] * F_ * D >= MIN_MACS_PER_EXPERT_GEMM * max(E, 1))
    triton = isinstance(groups, torch.Tensor) and runs_triton(x_ND)
    long_rows = x_ND.shape[0] >= CUBLAS_WIDE_MIN_ROWS * max(E, 1)

    def adder(out_EOI, g_NO, x_NI, alpha):
        if per_expert and (not triton or long_rows or out_EOI.shape[1] >= out_EOI.shape[2]):
            accumulate_weight_grad(out_EOI, g_NO, x_NI, host_counts, alpha)
        else:
            wgrad.accumulate(out_EOI, g_NO, x_NI, groups, alpha)

    return adder if per_expert or triton else None


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
                   for node, _ in ctx.next_functions[2:5])
    except (RuntimeError, AttributeError):
        return False


class _GroupedSwiGLU(torch.autograd.Function):
    """y = (silu(x W1^T) * (x W3^T)) W2^T per expert, with a hand-ordered backward.

    The input gradient is computed first and handed to `on_input_grad` before the weight-gradient
    GEMMs are queued: the expert-parallel dispatcher starts its all-to-all there, so the transfer
    may run beside them (on 2xH200 it mostly waits for SMs the GEMMs hold; benchmarks/RESULTS.md).
    `weight_grad_scale` multiplies only the weight gradients, on the smaller operand of each GEMM
    (F-sized activations rather than D-sized tokens when F < D). When the weights already hold
    gradients (gradient accumulation), `add_weight_grad` (see _weight_grad_adder) adds the weight
    gradients into them inside the GEMMs and autograd gets None.
    """

    @staticmethod
    def forward(ctx, x_ND, groups, w1, w2, w3, weight_grad_scale, on_input_grad, add_weight_grad):
        # The parameters themselves are the inputs (not their to_local() views): this backward owns
        # their gradients, and a view's backward may turn a skipped gradient into zeros to add.
        w1_EFD, w2_EDF, w3_EFD = (_local(w, x_ND.dtype) for w in (w1, w2, w3))
        a_NF = grouped_mm(x_ND, w1_EFD.transpose(-2, -1), groups)
        b_NF = grouped_mm(x_ND, w3_EFD.transpose(-2, -1), groups)
        if runs_triton(x_ND):  # one pass; backward recomputes silu(a) in its own
            silu_a_NF, h_NF = None, swiglu.forward(a_NF, b_NF)
        else:
            silu_a_NF = F.silu(a_NF)
            h_NF = silu_a_NF * b_NF
        y_ND = grouped_mm(h_NF, w2_EDF.transpose(-2, -1), groups)
        # What autograd would keep; recomputing h instead costs F-wide passes.
        ctx.save_for_backward(x_ND, a_NF, b_NF, silu_a_NF, h_NF, w1_EFD, w2_EDF, w3_EFD)
        ctx.groups, ctx.scale, ctx.on_input_grad = groups, weight_grad_scale, on_input_grad
        ctx.add_weight_grad, ctx.params = add_weight_grad, (w1, w2, w3)
        return y_ND

    @staticmethod
    def backward(ctx, dy_ND):
        x_ND, a_NF, b_NF, silu_a_NF, h_NF, w1_EFD, w2_EDF, w3_EFD = ctx.saved_tensors
        groups, scale = ctx.groups, ctx.scale
        dy_ND = dy_ND.contiguous()
        dh_NF = grouped_mm(dy_ND, w2_EDF, groups)
        if silu_a_NF is None:
            da_NF, db_NF = swiglu.backward(dh_NF, a_NF, b_NF)
        else:
            da_NF = torch.ops.aten.silu_backward(dh_NF * b_NF, a_NF)
            db_NF = dh_NF * silu_a_NF
        dx_ND = grouped_mm(da_NF, w1_EFD, groups)
        dx_ND += grouped_mm(db_NF, w3_EFD, groups)
        if ctx.on_input_grad is not None:
            ctx.on_input_grad(dx_ND)
        grads = _existing_grads(ctx, (w1_EFD, w2_EDF, w3_EFD)) if ctx.add_weight_grad is not None else None
        if grads is not None:
            for out, g, x in zip(grads, (da_NF, dy_ND, db_NF), (x_ND, h_NF, x_ND)):
                ctx.add_weight_grad(out, g, x, scale)
            return dx_ND, None, None, None, None, None, None, None
        if scale != 1:  # on whichever operand of each weight-gradient GEMM is smaller
            F_, D = h_NF.shape[-1], x_ND.shape[-1]
            if 2 * F_ <= D:
                da_NF.mul_(scale)  # dx above is already queued, so in place is safe
                db_NF.mul_(scale)
            else:
                x_ND = x_ND * scale
            if F_ <= D:
                h_NF = h_NF * scale
            else:
                dy_ND = dy_ND * scale
        dw2 = grouped_weight_grad(dy_ND, h_NF, groups)
        dw1 = grouped_weight_grad(da_NF, x_ND, groups)
        dw3 = grouped_weight_grad(db_NF, x_ND, groups)
        dws = (_like_param(dw, p) for dw, p in zip((dw1, dw2, dw3), ctx.params))
        return dx_ND, None, *dws, None, None, None


def grouped_swiglu(
    x_TD, counts_E, w1_EFD, w2_EDF, w3_EFD, use_kernel: bool | None = None, weight_grad_scale: float = 1.0,
    on_input_grad=None, host_counts: list[int] | None = None,
) -> torch.Tensor:
    """The weights may be DTensors: the GEMMs run on their local shards, in x_TD's dtype.
    `host_counts`: counts_E as a host list, when the caller has it without a sync (the dispatcher
    does); it lets the backward add weight gradients into existing ones per expert (see _weight_grad_adder)."""
    w1_local = _shard(w1_EFD)
    if use_kernel is None:
        use_kernel = _grouped_mm_supported(x_TD, w1_local)
    # Offsets once for all six GEMMs; the loop needs host counts (its only sync).
    if use_kernel:
        groups = torch.cumsum(counts_E, dim=0, dtype=torch.int32)
    else:
        groups = host_counts = counts_E.tolist() if host_counts is None else host_counts
    adder = _weight_grad_adder(x_TD, groups, host_counts, w1_local)
    return _GroupedSwiGLU.apply(x_TD, groups, w1_EFD, w2_EDF, w3_EFD, weight_grad_scale, on_input_grad, adder)


class GroupedExperts(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, num_experts: int):
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))

    def forward(self, x: torch.Tensor, counts_E: torch.Tensor, copies=None, weight_grad_scale: float = 1.0,
                on_input_grad=None, host_counts: list[int] | None = None) -> torch.Tensor:
        """Rows grouped by expert, counts_E[e] of them for expert e, in and out; or with `copies`
        (moe.TokenCopies) x holds tokens: they are copied into that order and the outputs are
        combined back into tokens of x's shape. The other arguments come from the expert-parallel
        dispatcher (see _GroupedSwiGLU)."""
        y_ND = grouped_swiglu(x if copies is None else copies.expand(x), counts_E, self.w1, self.w2, self.w3,
                              weight_grad_scale=weight_grad_scale, on_input_grad=on_input_grad, host_counts=host_counts)
        return y_ND if copies is None else copies.combine(y_ND, x.shape)

    def reset_parameters(self, std: float = 0.02):
        for w in (self.w1, self.w2, self.w3):
            nn.init.trunc_normal_(w, std=std)
