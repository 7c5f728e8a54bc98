"""SwiGLU experts stored stacked, in torchtitan's GroupedExperts layout and names.

w1 [E, F, D], w2 [E, D, F], w3 [E, F, D]: state dicts map one-to-one to torchtitan.
"""

import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor


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


def grouped_mm(x_TI: torch.Tensor, w_EIO: torch.Tensor, groups) -> torch.Tensor:
    """Rows of x_TI are grouped by expert; row block e is multiplied by w_EIO[e].

    `groups` is the kernel's int32 end offsets (a device tensor), or the per-expert row counts as
    a host list for the exact loop."""
    if isinstance(groups, torch.Tensor):
        return torch._grouped_mm(x_TI, w_EIO, offs=groups)
    outs = [xe @ w_EIO[e] for e, xe in enumerate(torch.split(x_TI, groups, dim=0))]
    return torch.cat(outs, dim=0) if outs else x_TI.new_empty(0, w_EIO.shape[-1])


def grouped_swiglu(x_TD, counts_E, w1_EFD, w2_EDF, w3_EFD, use_kernel: bool | None = None) -> torch.Tensor:
    if use_kernel is None:
        use_kernel = _grouped_mm_supported(x_TD, w1_EFD)
    # Offsets once for the three GEMMs; the loop needs host counts (its only sync).
    groups = torch.cumsum(counts_E, dim=0, dtype=torch.int32) if use_kernel else counts_E.tolist()
    h_TF = F.silu(grouped_mm(x_TD, w1_EFD.transpose(-2, -1), groups))
    h_TF = h_TF * grouped_mm(x_TD, w3_EFD.transpose(-2, -1), groups)
    return grouped_mm(h_TF, w2_EDF.transpose(-2, -1), groups)


def _local(w: torch.Tensor) -> torch.Tensor:
    # Parallelized weights are DTensors; the dispatcher already brought this rank the tokens
    # of exactly the slice it holds, so the GEMM runs on the local shard.
    return w.to_local() if isinstance(w, DTensor) else w


class GroupedExperts(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, num_experts: int):
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))

    def forward(self, x_TD: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        """x_TD holds tokens grouped by expert, counts_E[e] of them for expert e."""
        return grouped_swiglu(x_TD, counts_E, _local(self.w1), _local(self.w2), _local(self.w3))

    def reset_parameters(self, std: float = 0.02):
        for w in (self.w1, self.w2, self.w3):
            nn.init.trunc_normal_(w, std=std)
