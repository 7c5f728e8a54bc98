"""Per-expert bias rows and their gradient: `dtensor_moe::segment_sum`.

Rows are grouped by expert (`offs_E`, the int32 end offsets of each expert's block, on the device).
A bias [E, F] becomes one row per input row by an index_select on each row's expert (searchsorted
on the offsets: no host sync, traceable); its gradient sums each expert's block of rows, a
segmented reduction (CUB on CUDA): deterministic, no atomics, no host sync. Sums in >= fp32.
"""

import torch


def row_expert(offs_E: torch.Tensor, num_rows: int) -> torch.Tensor:
    """The expert of each of num_rows rows grouped by expert."""
    return torch.searchsorted(offs_E, torch.arange(num_rows, device=offs_E.device, dtype=offs_E.dtype), right=True)


def expand_rows(b_EF: torch.Tensor, offs_E: torch.Tensor, num_rows: int) -> torch.Tensor:
    """[num_rows, F]: row n gets its expert's bias."""
    return b_EF.index_select(0, row_expert(offs_E, num_rows))


@torch.library.custom_op("dtensor_moe::segment_sum", mutates_args=())
def segment_sum(x_NF: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """[E, F]: the sum of each expert's block of rows (zeros for an expert without rows)."""
    offsets = torch.cat([offs_E.new_zeros(1), offs_E]).to(torch.int64)
    acc = x_NF.to(torch.promote_types(x_NF.dtype, torch.float32))
    return torch.segment_reduce(acc, "sum", offsets=offsets, axis=0, unsafe=True).to(x_NF.dtype)


@segment_sum.register_fake
def _(x_NF, offs_E):
    return x_NF.new_empty(offs_E.shape[0], *x_NF.shape[1:])


def _setup(ctx, inputs, output):
    x_NF, offs_E = inputs
    ctx.num_rows = x_NF.shape[0]
    ctx.save_for_backward(offs_E)


def _backward(ctx, g_EF):
    (offs_E,) = ctx.saved_tensors
    return expand_rows(g_EF, offs_E, ctx.num_rows), None


segment_sum.register_autograd(_backward, setup_context=_setup)
