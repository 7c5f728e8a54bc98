"""Grouped GEMMs over rows grouped by expert, as registered ops (opaque to torch.compile).

`offs_E` are the int32 end offsets of each expert's row block (a device tensor): torch._grouped_mm
takes them where it supports the dtype; elsewhere (float64, odd alignments) an exact per-expert
loop reads them on the host, inside the op, so a compiled graph never holds that sync, unless the
caller passes them as `host_counts` (known without a sync: the eager dispatcher's, padded blocks).
"""

import torch

from dtensor_moe.kernels import fp8, policy, recompute, wgrad


def _blocks(offs_E: torch.Tensor, host_counts: list[int] | None = None) -> list[int]:
    if host_counts is not None:
        return host_counts
    ends = policy.host_list(offs_E, "exact_loop")
    return [b - a for a, b in zip([0, *ends[:-1]], ends)]


@torch.library.custom_op("dtensor_moe::grouped_mm", mutates_args=())
def grouped_mm(x_NI: torch.Tensor, w_EIO: torch.Tensor, offs_E: torch.Tensor,
               host_counts: list[int] | None = None) -> torch.Tensor:
    """Row block e of x_NI times w_EIO[e]: [N, O]. host_counts: the blocks' sizes, when known on the host."""
    if policy.grouped_mm_supported(x_NI, w_EIO.shape):
        return torch._grouped_mm(x_NI, w_EIO, offs=offs_E)
    outs = [xe @ w_EIO[e] for e, xe in enumerate(torch.split(x_NI, _blocks(offs_E, host_counts), dim=0))]
    return torch.cat(outs, dim=0) if outs else x_NI.new_empty(0, w_EIO.shape[-1])


@grouped_mm.register_fake
def _(x_NI, w_EIO, offs_E, host_counts=None):
    return x_NI.new_empty(x_NI.shape[0], w_EIO.shape[-1])


recompute.keep(torch.ops.dtensor_moe.grouped_mm.default)  # the expert GEMM: the most FLOPs per byte kept


@torch.library.custom_op("dtensor_moe::grouped_weight_grad", mutates_args=())
def grouped_weight_grad(g_NO: torch.Tensor, x_NI: torch.Tensor, offs_E: torch.Tensor,
                        host_counts: list[int] | None = None) -> torch.Tensor:
    """[E, O, I]: g_e^T x_e per expert over its row block (the weight gradient of grouped_mm)."""
    E = offs_E.shape[0]
    if policy.grouped_mm_supported(x_NI, (E, g_NO.shape[1], x_NI.shape[1])):
        return torch._grouped_mm(g_NO.t(), x_NI, offs=offs_E)
    blocks = _blocks(offs_E, host_counts)
    pairs = zip(torch.split(g_NO, blocks, dim=0), torch.split(x_NI, blocks, dim=0))
    return torch.stack([ge.t() @ xe for ge, xe in pairs]) if E else g_NO.new_empty(0, g_NO.shape[1], x_NI.shape[1])


@grouped_weight_grad.register_fake
def _(g_NO, x_NI, offs_E, host_counts=None):
    return g_NO.new_empty(offs_E.shape[0], g_NO.shape[1], x_NI.shape[1])


@torch.library.custom_op("dtensor_moe::add_weight_grad_", mutates_args=("out_EOI",))
def add_weight_grad_(out_EOI: torch.Tensor, g_NO: torch.Tensor, x_NI: torch.Tensor, offs_E: torch.Tensor,
                     alpha: float, host_counts: list[int] | None, method: str) -> None:
    """out_EOI[e] += alpha * g_e^T x_e, the sum done by the GEMM (beta = 1): no separate pass that
    reads and rewrites the whole gradient, as autograd's accumulation does. `method` (policy):
    "per_expert" (one addmm_ per expert, host counts) or "triton" (kernels/wgrad.py)."""
    if method == "triton":
        wgrad.accumulate(out_EOI, g_NO, x_NI, offs_E, alpha, policy.wgrad_config(out_EOI.shape, x_NI.shape[0]))
        return
    counts = _blocks(offs_E, host_counts)
    for o_OI, g_nO, x_nI in zip(out_EOI.unbind(0), g_NO.split(counts), x_NI.split(counts)):
        o_OI.addmm_(g_nO.t(), x_nI, alpha=alpha)


@add_weight_grad_.register_fake
def _(out_EOI, g_NO, x_NI, offs_E, alpha, host_counts, method):
    return None


def mm(x_NI: torch.Tensor, w_EIO: torch.Tensor, offs_E: torch.Tensor, precision: str = "bf16",
       gemm: str = "fwd", host_counts: list[int] | None = None) -> torch.Tensor:
    """grouped_mm, or its FP8 form (kernels/fp8.py) where policy.gemm_precision picks it for this
    `gemm` ("fwd" or "dgrad") of an expert layer in `precision`."""
    if policy.gemm_precision(precision, gemm, x_NI, *w_EIO.shape) == "fp8":
        return fp8.grouped_mm(x_NI, w_EIO, offs_E)
    return grouped_mm(x_NI, w_EIO, offs_E, host_counts)


def weight_grad(g_NO: torch.Tensor, x_NI: torch.Tensor, offs_E: torch.Tensor, precision: str = "bf16",
                host_counts: list[int] | None = None) -> torch.Tensor:
    """grouped_weight_grad, or its FP8 form where the policy picks it."""
    if policy.gemm_precision(precision, "wgrad", x_NI, offs_E.shape[0], x_NI.shape[1], g_NO.shape[1]) == "fp8":
        return fp8.grouped_weight_grad(g_NO, x_NI, offs_E)
    return grouped_weight_grad(g_NO, x_NI, offs_E, host_counts)
