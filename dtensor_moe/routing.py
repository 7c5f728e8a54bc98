"""Token tables of one routing decision: where each token's top-k copies go and how they return.

Both the layer (local experts) and the expert-parallel dispatcher read them.
"""

import functools
from dataclasses import dataclass

import torch

from dtensor_moe.kernels.gather_sum import weighted_gather_sum


class _GatherRows(torch.autograd.Function):
    """out = x[idx]; `inv` maps each row of x to the rows of out that read it, `fan_out` per row.

    Advanced indexing would backpropagate through a sort-based scatter-add (index_put_ with
    accumulate); here idx is a permutation, or each row is read exactly `fan_out` times (the
    top-k copies of a token), so the gradient is another gather plus a sum over the copies:
    deterministic and without atomics.
    """

    @staticmethod
    def forward(ctx, x, idx, inv, fan_out):
        ctx.save_for_backward(inv)
        ctx.fan_out = fan_out
        return x.index_select(0, idx)

    @staticmethod
    def backward(ctx, grad):
        (inv,) = ctx.saved_tensors
        g = grad.index_select(0, inv)
        if ctx.fan_out > 1:
            g = g.view(-1, ctx.fan_out, g.shape[-1]).sum(1)
        return g, None, None, None


def gather_rows(x: torch.Tensor, idx: torch.Tensor, inv: torch.Tensor, fan_out: int = 1) -> torch.Tensor:
    return _GatherRows.apply(x, idx, inv, fan_out)


@dataclass(frozen=True)
class TokenCopies:
    """Where each token's top-k copies go and how they come back: expert-major row n is pair
    pair_N[n] = t * K + k (token t's k-th choice) for expert expert_N[n], and weight_TK[t, k]
    weighs it in the combine. The experts expand the tokens and combine their outputs with it; an
    expert-parallel dispatcher instead sends each token once per rank, copies it there, and sums
    its outputs there before they return. The other tables are built on first use: under expert
    parallelism that is after the GEMMs are queued, off the path to the first one."""

    pair_N: torch.Tensor
    expert_N: torch.Tensor
    weight_TK: torch.Tensor

    @functools.cached_property
    def row_TK(self) -> torch.Tensor:
        """Token t's k-th copy is expert-major row row_TK[t, k]."""
        return inverse_permutation(self.pair_N).view(self.weight_TK.shape)

    @functools.cached_property
    def token_N(self) -> torch.Tensor:
        return self.pair_N // self.weight_TK.shape[1]

    @functools.cached_property
    def weight_N(self) -> torch.Tensor:
        """The routing weights in expert-major order (autograd flows back to weight_TK)."""
        return gather_rows(self.weight_TK.reshape(-1, 1), self.pair_N, self.row_TK.flatten()).view(-1)

    def expand(self, x: torch.Tensor) -> torch.Tensor:
        x_TD = x.reshape(-1, x.shape[-1])
        return gather_rows(x_TD, self.token_N, self.row_TK.flatten(), fan_out=self.weight_TK.shape[1])

    def combine(self, y_ND: torch.Tensor, out_shape) -> torch.Tensor:
        """Token t's output: sum_k weight_TK[t, k] * y_ND[row_TK[t, k]], shaped out_shape."""
        return weighted_gather_sum(y_ND, self.weight_N, self.row_TK, self.token_N, out_shape)


def inverse_permutation(perm: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(perm).scatter_(0, perm, torch.arange(perm.numel(), device=perm.device))
