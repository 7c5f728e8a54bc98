"""Token tables of one routing decision: where each token's copies go and how they come back.

`TokenCopies`: where each token's top-k copies go and how they come back; the layer (local experts)
and the expert-parallel dispatcher both read it. `PaddedCopies`: the same for pad_to_capacity, every
expert a block of exactly its capacity in rows.
"""

from dataclasses import dataclass

import torch

from dtensor_moe.kernels.gather_sum import gather_sum

__all__ = ["PaddedCopies", "PairRows", "TokenCopies", "expert_major", "gather_rows", "inverse_permutation"]


@torch.library.custom_op("dtensor_moe::gather_rows", mutates_args=())
def gather_rows(x: torch.Tensor, idx: torch.Tensor, readers_RK: torch.Tensor) -> torch.Tensor:
    """out = x[idx], where readers_RK[r] lists the rows of out that read row r of x (-1: none).

    Advanced indexing would backpropagate through a sort-based scatter-add (index_put_ with
    accumulate); knowing each row's readers, the gradient is a gather-sum: deterministic, no atomics.
    A registered op, so compilers take the row count from idx whatever x holds (an empty rank too).
    """
    return x.index_select(0, idx)


@gather_rows.register_fake
def _(x, idx, readers_RK):
    return x.new_empty(idx.shape[0], *x.shape[1:])


def _gather_rows_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[2])


def _gather_rows_backward(ctx, grad):
    (readers_RK,) = ctx.saved_tensors
    grad = grad.contiguous()
    if readers_RK.shape[1] == 1:  # at most one reader per row: a gather, rows nobody read (-1) get zeros
        # (a token whose every pair was capacity-dropped is sent nowhere). The zero row is appended, not
        # masked in after, so an empty grad works and no 0 * NaN reaches other rows.
        padded = torch.cat([grad, grad.new_zeros(1, *grad.shape[1:])])
        rows = torch.where(readers_RK[:, 0] >= 0, readers_RK[:, 0], grad.shape[0])
        return torch.ops.aten.index_select(padded, 0, rows), None, None
    return gather_sum(grad, readers_RK, readers_RK, None), None, None


gather_rows.register_autograd(_gather_rows_backward, setup_context=_gather_rows_setup)


def expert_major(expert_ids_N: torch.Tensor, num_experts: int):
    """(sorted_N, order_N, counts_E): the ids sorted, pair_N of each sorted row, and the rows with id
    e < num_experts; a stable sort keeps each expert's pairs in pair order (deterministic grouping).
    Counting on the sorted ids needs no host sync (CUDA bincount reads the max back to size its output)."""
    sorted_N, order_N = torch.sort(expert_ids_N, stable=True)
    bounds = torch.arange(num_experts + 1, device=sorted_N.device, dtype=sorted_N.dtype)
    return sorted_N, order_N, torch.searchsorted(sorted_N, bounds).diff()


def inverse_permutation(perm: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(perm).scatter_(0, perm, torch.arange(perm.numel(), device=perm.device))


@dataclass(frozen=True)
class TokenCopies:
    """Expert-major row n is pair pair_N[n] = t * K + k (token t's k-th choice) for expert
    expert_N[n]; weight_TK[t, k] weighs it in the combine. Capacity-dropped pairs come last, with
    expert id E and weight 0: whoever holds the per-expert counts runs only the rows before them. The
    experts expand the tokens and combine their outputs with it; an expert-parallel dispatcher instead
    sends each token once per rank, copies it there, and sums its outputs there before they return."""

    pair_N: torch.Tensor
    expert_N: torch.Tensor
    weight_TK: torch.Tensor
    row_TK: torch.Tensor  # token t's k-th copy is expert-major row row_TK[t, k]
    token_N: torch.Tensor
    weight_N: torch.Tensor  # the routing weights in expert-major order (differentiable)

    @classmethod
    def build(cls, pair_N: torch.Tensor, expert_N: torch.Tensor, weight_TK: torch.Tensor) -> "TokenCopies":
        row_TK = inverse_permutation(pair_N).view(weight_TK.shape)
        weight_N = gather_rows(weight_TK.reshape(-1, 1), pair_N, row_TK.reshape(-1, 1)).view(-1)
        return cls(pair_N, expert_N, weight_TK, row_TK, pair_N // weight_TK.shape[1], weight_N)

    def pair_rows(self, out_shape) -> "PairRows":
        """These pairs over the token rows, the combine's output shaped out_shape ([..., D])."""
        return PairRows(self.token_N, self.row_TK.view(*out_shape[:-1], self.row_TK.shape[1]), self.weight_N)

    def expert_blocks(self, counts_E: torch.Tensor) -> tuple[torch.Tensor, None]:
        """The experts' row blocks over expand()'s rows, and their sizes on the host (unknown here).
        Capacity-dropped pairs (the last rows, weight 0) run with the last expert: leaving them out
        would need their number on the host. The expert-parallel dispatcher leaves them out."""
        return torch.cat([counts_E[:-1], counts_E[-1:] + (self.pair_N.shape[0] - counts_E.sum())]), None


@dataclass(frozen=True)
class PairRows:
    """Expert-major pairs over rows that hold each token once: pair n reads row row_N[n] and weighs its output
    by weight_N[n]; row r is read by the pairs readers_RK[r, :] (-1: none). The layer's own tokens
    (`TokenCopies.pair_rows`) or the rows an expert-parallel rank received (each token once per rank).
    `expand` copies the rows into pair order, `combine` sums each row's weighted outputs back."""

    row_N: torch.Tensor
    readers_RK: torch.Tensor  # leading dims: the combine's output rows
    weight_N: torch.Tensor

    def expand(self, x_RD: torch.Tensor) -> torch.Tensor:
        return gather_rows(x_RD, self.row_N, self.readers_RK.reshape(-1, self.readers_RK.shape[-1]))

    def combine(self, y_ND: torch.Tensor) -> torch.Tensor:
        return gather_sum(y_ND, self.readers_RK, self.row_N, self.weight_N)


@dataclass(frozen=True)
class PaddedCopies:
    """pad_to_capacity's tables: E blocks of exactly `capacity` rows (slots), expert e's kept pairs
    first in its block e * capacity + (0, 1, ...), the rest padding. slot_TK[t, k]: the slot of token
    t's k-th pair (-1: dropped); token_Q: the token each slot reads (T, a zero row, for padding);
    weight_Q: the routing weights by slot (0 for padding, differentiable). Every shape follows from
    T, K, E and the capacity alone, so nothing here or downstream needs a count on the host."""

    capacity: int
    num_experts: int
    slot_TK: torch.Tensor
    token_Q: torch.Tensor
    weight_Q: torch.Tensor

    @classmethod
    def build(cls, pair_N: torch.Tensor, expert_N: torch.Tensor, counts_E: torch.Tensor, weight_TK: torch.Tensor,
              capacity: int) -> "PaddedCopies":
        """From the expert-major order of the capacity-dropped routing (dropped pairs: id E, last,
        outside counts_E, which are then each <= capacity)."""
        T, K = weight_TK.shape
        E, Q, dev = counts_E.numel(), counts_E.numel() * capacity, pair_N.device
        kept_N = expert_N < E
        e_N = expert_N.clamp(max=E - 1)
        within_N = torch.arange(T * K, device=dev) - (counts_E.cumsum(0) - counts_E).index_select(0, e_N)
        slot_N = torch.where(kept_N, e_N * capacity + within_N, Q)  # dropped: a dummy slot Q, cut off below
        slot_TK = torch.full((T * K,), -1, dtype=torch.int64, device=dev).scatter_(
            0, pair_N, torch.where(kept_N, slot_N, -1)).view(T, K)
        pair_Q = torch.full((Q + 1,), T * K, dtype=torch.int64, device=dev).scatter_(0, slot_N, pair_N)[:Q]
        # Each pair's weight is read by its slot only; padding reads an appended zero.
        w_pairs = torch.cat([weight_TK.reshape(-1, 1), weight_TK.new_zeros(1, 1)])
        weight_Q = gather_rows(w_pairs, pair_Q, torch.cat([slot_TK.reshape(-1, 1), slot_TK.new_full((1, 1), -1)]))
        return cls(capacity, E, slot_TK, torch.where(pair_Q < T * K, pair_Q // K, T), weight_Q.view(-1))

    def expand(self, x: torch.Tensor) -> torch.Tensor:
        """[E * capacity, D]: each slot's token row, zeros for padding (a zero row, never a token's
        value: a non-finite token stays in its own slots)."""
        x_TD = x.reshape(-1, x.shape[-1])
        readers = torch.cat([self.slot_TK, self.slot_TK.new_full((1, self.slot_TK.shape[1]), -1)])
        return gather_rows(torch.cat([x_TD, x_TD.new_zeros(1, x_TD.shape[1])]), self.token_Q, readers)

    def expert_blocks(self, counts_E: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """counts_E (capacity each) and the same on the host: static, no sync."""
        return counts_E, [self.capacity] * self.num_experts

    def combine(self, y_QD: torch.Tensor, out_shape) -> torch.Tensor:
        """Token t's output: sum_k weight_TK[t, k] * y_QD[slot_TK[t, k]] over its kept pairs. Padded
        rows are selected away (not weighted by 0), so neither they nor their gradient touch a token,
        whatever the gradient holds."""
        T = self.slot_TK.shape[0]
        real_Q = self.token_Q < T
        y_QD = torch.where(real_Q[:, None], y_QD, 0)
        return gather_sum(y_QD, self.slot_TK.view(*out_shape[:-1], self.slot_TK.shape[1]),
                          torch.where(real_Q, self.token_Q, 0), self.weight_Q)
