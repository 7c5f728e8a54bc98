"""Tile-aware token rounding (MoERunOptions.round_tokens_to = M > 0): after the router (and capacity dropping), every
expert's pairs on this rank are rounded to a multiple of M, so that the grouped GEMMs run whole M-row tiles.

The rule, on one forward's tokens on one rank (no collective; docs/routing.md, "Token rounding"):

c_e: expert e's pairs, r_e = c_e mod M, need_e = M - r_e. Pairs rank by their combine weight rounded to float32
(the router's precision or below), ties by pair order (token, then choice).

1. Direction. Experts with 2 r_e >= M (nearest, ties up) whose rounded-up count stays within the capacity
   (when capacity_factor is set) are candidates, taken by r_e descending, ties by expert id; the up-set U is the
   longest run of them whose total need fits the slots the rest free: sum_{U} need_e <= (slots already dropped)
   + sum_{e not in U} r_e.
2. Down. Every other expert with r_e > 0 drops its r_e lowest-ranked pairs (id E, weight 0, as capacity does).
3. Up, ROUNDS rounds of matching between U and the free slots. (t, e) is eligible if e is in U, t has a free
   slot, e is none of t's router-chosen experts and, under group-limited routing, e's group holds one of them.
   Each token ranks its eligible experts by weight (descending, ties by id) and keeps its first CANDIDATES:
   pref_te, its candidates. Each expert of U ranks the tokens it is a candidate of by (pref_te ascending,
   weight descending, token id ascending): first the tokens whose best eligible expert it is. In a round, each
   expert of U still short proposes to its first (need_e - got_e) tokens in that order that still have a free
   slot and have not accepted it; each token accepts the proposals of its most preferred experts, as many as it
   has free slots. Acceptances are final.
4. An expert of U that got need_e tokens rounds up (c_e + need_e); any other gives its tokens back and rounds
   down as in 2. Every expert ends at a multiple of M. A token's added experts fill its free slots in slot order,
   in its preference order, each weighted by `weight_TE` (the router's weight for that expert, same
   normalization as the token's own choices: router.combine_weights_TE).

Static shapes ([T, K], [T, E] for eligibility and each token's candidates, [T, CANDIDATES] for the matching, [E]),
no host read, a fixed number of rounds: one graph under torch.compile. A token keeps at most K experts and never
has one twice.
"""

import functools

import torch

from dtensor_moe.kernels import policy
from dtensor_moe.routing.capacity import capacity

__all__ = ["CANDIDATES", "ROUNDS", "check_rounding_reachable", "round_tokens", "round_tokens_compiled"]

# Matching rounds of step 3, measured on uniform routing at M=128: at T=4096, E=64, K=6, 29 of the 30 experts of U
# round up after 4 rounds (25 after 3, still 29 after 8); at T=16384, E=256, K=8, 129 of 139 (132 after 8). Each
# round is a few gathers and cumsums over [T, CANDIDATES].
ROUNDS = 4
# Step 3 considers each token's best CANDIDATES eligible experts only: [T, CANDIDATES] tables instead of [T, E]. On
# the same draws 32 gives what all E give (16: 27 of 30 up at E=64, 125 of 139 at E=256).
CANDIDATES = 32


def _weight_bits(weight: torch.Tensor) -> torch.Tensor:
    """int64 in [0, 2^31): the float32 weight's bits, whose order is the weights' for weights >= 0 (the sign is
    cleared: a weight is never negative, and a NaN's sign must not reach the keys' other fields)."""
    return weight.float().view(torch.int32).to(torch.int64) & 0x7FFFFFFF


def _expert_major_ranks(expert_N: torch.Tensor, bits_N: torch.Tensor,
                        num_ids: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rank_N, counts): each pair's rank within its id (weight descending, ties by pair order), and the pairs per
    id. One stable sort on (id, weight descending)."""
    N, dev = expert_N.numel(), expert_N.device
    sorted_key, order_N = torch.sort((expert_N << 31) | (0x7FFFFFFF - bits_N), stable=True)
    starts = torch.searchsorted(sorted_key, torch.arange(num_ids + 1, device=dev) << 31)
    rank_sorted = torch.arange(N, device=dev) - starts[:-1].index_select(0, sorted_key >> 31)
    return torch.empty_like(rank_sorted).scatter_(0, order_N, rank_sorted), starts.diff()


def _up_set(r_E: torch.Tensor, candidate_E: torch.Tensor, multiple: int, dropped: torch.Tensor) -> torch.Tensor:
    """Step 1: the candidates by r descending whose total need fits the slots the others free."""
    order = torch.sort(torch.where(candidate_E, r_E, -1), descending=True, stable=True).indices
    r_sorted, cand_sorted = r_E.index_select(0, order), candidate_E.index_select(0, order)
    demand = torch.cumsum(torch.where(cand_sorted, multiple - r_sorted, 0), 0)
    supply = dropped + r_E.sum() - torch.cumsum(r_sorted, 0)
    run = torch.cumprod((cand_sorted & (demand <= supply)).to(torch.int32), 0).bool()
    return torch.zeros_like(candidate_E).scatter_(0, order, run)


def round_tokens(chosen_TK: torch.Tensor, experts_TK: torch.Tensor, weights_TK: torch.Tensor,
                 weight_TE: torch.Tensor, multiple: int, capacity: int | None = None,
                 num_groups: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(experts_TK, weights_TK) with every expert's pairs a multiple of `multiple` (the module docstring's rule).

    chosen_TK: the router's choices; experts_TK / weights_TK: the pairs to round (capacity-dropped ones: id E,
    weight 0); weight_TE: each expert's combine weight for each token (router.combine_weights_TE, differentiable:
    the added pairs' weights); capacity: no expert rounds up past it; num_groups: the router's expert groups."""
    T, K = experts_TK.shape
    E, M, dev = weight_TE.shape[1], multiple, experts_TK.device
    bits_TE = _weight_bits(weight_TE.detach())
    # Step 1: counts, remainders and the direction of each expert.
    rank_TK, counts = _expert_major_ranks(experts_TK.flatten(),
                                          bits_TE.gather(1, experts_TK.clamp(max=E - 1)).flatten(), E + 1)
    rank_TK, counts_E = rank_TK.view(T, K), counts[:E]
    r_E = counts_E % M
    candidate_E = 2 * r_E >= M
    if capacity is not None:
        candidate_E &= counts_E - r_E + M <= capacity
    up_E = _up_set(r_E, candidate_E, M, counts[E])
    # Step 2: the others round down; an id's pairs are kept while their rank is below its limit (none for id E).
    zero = counts.new_zeros(1)
    down_limit = torch.cat([counts_E - r_E, zero])
    first_keep_TK = rank_TK < torch.where(torch.cat([up_E, zero.bool()]), counts, down_limit).index_select(
        0, experts_TK.flatten()).view(T, K)
    free_T = K - first_keep_TK.sum(1)
    # Step 3: eligibility, then each token's best CANDIDATES eligible experts, best first (ties by id): one unique
    # int64 key per (token, expert), the weight's bits then the id.
    chosen_TE = torch.zeros(T, E, dtype=torch.bool, device=dev).scatter_(1, chosen_TK, True)
    eligible_TE = up_E[None, :] & ~chosen_TE & (free_T > 0)[:, None]
    if num_groups > 1:
        held_TG = chosen_TE.view(T, num_groups, E // num_groups).any(-1)
        eligible_TE &= held_TG.repeat_interleave(E // num_groups, dim=1)
    L = min(E, CANDIDATES)
    ids_E = torch.arange(E, device=dev)
    pick_TE = torch.where(eligible_TE, bits_TE * E + (E - 1 - ids_E), -1)
    pick_TL = torch.topk(pick_TE, L, dim=1).values
    valid_TL = pick_TL >= 0
    cand_TL = torch.where(valid_TL, E - 1 - pick_TL % E, E)  # expert ids, E: none
    # The candidate pairs in the experts' order: expert, then the token's rank of it (l), weight descending, token
    # (one stable sort: the pairs are token-major).
    cand_P = cand_TL.flatten()
    tier_P = cand_P * L + torch.arange(T * L, device=dev) % L
    weight_P = bits_TE.gather(1, cand_TL.clamp(max=E - 1)).flatten()
    order_P = torch.sort((tier_P << 31) | (0x7FFFFFFF - weight_P), stable=True).indices
    expert_P, token_P = cand_P.index_select(0, order_P), order_P // L
    starts = torch.searchsorted(expert_P, torch.arange(E + 1, device=dev, dtype=expert_P.dtype))
    need_E = torch.cat([torch.where(up_E, M - r_E, 0), zero])  # with id E: needs none
    got_E, avail_T = torch.zeros_like(need_E), free_T
    added_TL = torch.zeros_like(valid_TL)
    for _ in range(ROUNDS):
        open_P = (valid_TL & ~added_TL).flatten().index_select(0, order_P) & (avail_T.index_select(0, token_P) > 0)
        seen = torch.cat([zero, torch.cumsum(open_P, 0)])  # open pairs before each position
        wanted = (need_E - got_E + seen.index_select(0, starts)).index_select(0, expert_P)
        proposed_TL = torch.zeros_like(open_P).scatter_(0, order_P, open_P & (seen[1:] <= wanted)).view(T, L)
        accepted_TL = proposed_TL & (torch.cumsum(proposed_TL, 1) <= avail_T[:, None])
        added_TL |= accepted_TL
        avail_T = avail_T - accepted_TL.sum(1)
        # Per expert, from the experts' order (a scan, not E-way contended atomic adds).
        took = torch.cat([zero, torch.cumsum(accepted_TL.flatten().index_select(0, order_P), 0)])
        got_E = got_E + took.index_select(0, starts).diff(append=took[-1:])
    # Step 4: whole up-roundings stay; the others round down.
    rounded_up_E = up_E & (got_E[:E] == need_E[:E])
    added_TL &= torch.cat([rounded_up_E, zero.bool()]).index_select(0, cand_P).view(T, L)
    keep_TK = rank_TK < torch.where(torch.cat([rounded_up_E | (r_E == 0), zero.bool()]), counts,
                                    down_limit).index_select(0, experts_TK.flatten()).view(T, K)
    # The added experts (in each token's preference order already) into its free slots in slot order.
    nth = torch.where(added_TL, torch.cumsum(added_TL, 1) - 1, K)
    added_TK = torch.full((T, K + 1), E, dtype=experts_TK.dtype, device=dev).scatter_(1, nth, cand_TL)[:, :K]
    slot_TK = torch.cumsum(~keep_TK, 1) - 1
    fills_TK = ~keep_TK & (slot_TK < added_TL.sum(1, keepdim=True))
    out_TK = torch.where(keep_TK, experts_TK, torch.where(fills_TK, added_TK.gather(1, slot_TK.clamp(0, K - 1)), E))
    added_w = weight_TE.gather(1, out_TK.clamp(max=E - 1)).to(weights_TK.dtype)
    return out_TK, torch.where(keep_TK, weights_TK, torch.where(fills_TK, added_w, 0))


@functools.cache
def _compiled(backend: str):
    return torch.compile(round_tokens, backend=backend, fullgraph=True)


def round_tokens_compiled(*args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """round_tokens, compiled on its own inside an eager layer where policy.rounding_backend says so (one graph:
    eager, its ~100 small ops cost more than the rounded GEMMs gain); inside a compiled graph it is traced with it."""
    backend = policy.rounding_backend(args[1])
    return (round_tokens if backend is None else _compiled(backend))(*args, **kwargs)


def check_rounding_reachable(multiple: int, tokens: int, top_k: int, num_experts: int, capacity_factor, where: str,
                             name: str = "moe_run.round_tokens_to"):
    """round_tokens_to above what any expert can hold in one forward on one rank (each token's experts differ, so
    at most `tokens` pairs; with a capacity factor at most its capacity, routing/capacity.py's ceil formula) rounds
    every expert's pairs down to 0: the experts would compute nothing and the run end with rc 0. `where` says how
    `tokens` (each rank's MoE tokens per forward) follows from the config."""
    if not multiple:
        return
    most, why = tokens, f"{tokens} tokens ({where}), and no expert takes a token twice"
    if capacity_factor is not None:
        cap = capacity(tokens, top_k, num_experts, capacity_factor)
        if cap < most:
            most, why = cap, (f"the capacity ceil({tokens} tokens * top_k {top_k} / {num_experts} experts * "
                              f"capacity_factor {capacity_factor}) = {cap} pairs ({tokens} tokens: {where})")
    if multiple > most:
        raise ValueError(f"{name} ({multiple}) is more than any expert can hold in one forward on one rank: at most "
                         f"{most}, {why}; every expert's pairs would be rounded down to 0 and the experts compute "
                         f"nothing; valid: {name} 1..{most} (the grouped GEMMs' row tile, e.g. "
                         f"{min(128, most)}), or 0 (off)")
