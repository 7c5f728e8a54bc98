"""Megatron's token dropping (--moe-expert-capacity-factor): each expert keeps at most
ceil(T * top_k / num_experts * capacity_factor) of the T tokens' (token, expert) pairs it is
given, T being the tokens of one forward on one rank (no collective: Megatron's choice).

A dropped pair contributes nothing: its routing weight is zeroed (so neither it nor its router
gradient counts) and the token keeps its other experts and the shared experts. The layer then
gives it expert id E (TokenCopies: last, outside the counts), so the expert-parallel dispatcher
neither sends nor computes it. With pad_to_capacity every expert gets exactly the capacity in
rows instead, its kept pairs then zero rows (routing.PaddedCopies): static shapes; see docs/routing.md.
"""

import math

import torch

__all__ = ["capacity", "kept_pairs"]


def capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    return math.ceil(num_tokens * top_k / num_experts * capacity_factor)


def kept_pairs(weights_TK: torch.Tensor, experts_TK: torch.Tensor, counts_E: torch.Tensor, capacity_factor: float,
               drop_policy: str) -> torch.Tensor:
    """keep_TK: whether each (token, choice) pair is within its expert's capacity. "position": an
    expert keeps its pairs in token order; "probs": its highest-weight pairs first. Stable sorts
    break every tie by token order, so the choice is deterministic."""
    T, K = weights_TK.shape
    C = capacity(T, K, counts_E.numel(), capacity_factor)
    pair_N = torch.arange(T * K, device=weights_TK.device)
    if drop_policy == "probs":
        pair_N = torch.sort(weights_TK.detach().flatten(), descending=True, stable=True).indices
    expert_N, within = torch.sort(experts_TK.flatten().index_select(0, pair_N), stable=True)
    pair_N = pair_N.index_select(0, within)  # expert-major, each expert's pairs in policy order
    rank_N = torch.arange(T * K, device=pair_N.device) - (counts_E.cumsum(0) - counts_E).index_select(0, expert_N)
    return torch.zeros(T * K, dtype=torch.bool, device=pair_N.device).scatter_(0, pair_N, rank_N < C).view(T, K)
