"""Routing modes of the layer benchmarks: `moe_layer.py` and `titan_anchor.py` both take their inputs and per-token
expert choices from `routed_inputs`, so for a given shape, mode and rank (the seed) they route the same tokens to
the same experts, and their ratio is on the same per-expert counts.

  topk    top-k of the softmax of random logits: balanced in expectation, ragged in fact (the only routing before
          the modes, with the same draws, so earlier results stay comparable);
  exact   every expert gets T*K/E rows (floor or ceil where E does not divide T*K; exact at the benchmarks' shapes),
          each token K distinct experts: consecutive K-slices of a chain of seeded random permutations of the experts;
  skewed  Zipf-like popularity: expert e's probability is proportional to 1 / rank_e ** zipf, the ranks a random
          permutation of the expert ids seeded alike on every rank (a layer's hot experts are hot in every batch);
          each token draws K distinct experts from it without replacement (seeded by the rank).

Every mode's routing weights are the softmax of the same random logits at the chosen experts (topk: its top K).
Where K == E (moe_layer.py's EP-rank proxy deepseek_ep32; E == 1 alike) every mode sends every token to every
expert, T rows each: the modes then differ only in the order of a token's choices, which weight goes with which row.
"""

import argparse

import torch
import torch.distributed as dist

MODES = ("topk", "exact", "skewed")
POPULARITY_SEED = 0


def add_arguments(ap: argparse.ArgumentParser):
    """The scripts' shared flags: a result row (line) for each mode, in one process."""
    ap.add_argument("--routing", nargs="+", default=["topk"], choices=MODES,
                    help="routing modes (benchmarks/routing.py): topk (ragged), exact (equal counts), skewed (Zipf)")
    ap.add_argument("--zipf", type=float, default=1.2, help="skewed routing's Zipf exponent")


def zipf_of(mode: str, zipf: float) -> float | None:
    """The exponent a result names: only skewed routing has one."""
    return zipf if mode == "skewed" else None


def label(mode: str, zipf: float | None) -> str:
    """The routing as tables name it: `topk`, `exact`, `skewed 1.2`."""
    return f"{mode} {zipf:g}" if mode == "skewed" else mode


def describe(mode: str, zipf: float) -> str:
    """The routing as titan_anchor.py's lines name it (read by moe_layer.py's TITAN_LINE): `routing=skewed zipf=1.2`."""
    return f"routing={mode}" + (f" zipf={zipf:g}" if mode == "skewed" else "")


def popularity_E(E: int, zipf: float) -> torch.Tensor:
    """Each expert's probability: the expert at position r of the seeded permutation has rank r + 1."""
    if zipf < 0:
        raise ValueError(f"--zipf must be >= 0 (0: uniform), got {zipf}")
    perm_E = torch.randperm(E, generator=torch.Generator().manual_seed(POPULARITY_SEED), device="cpu")
    p_E = torch.empty(E, dtype=torch.float64, device="cpu")
    p_E[perm_E] = torch.arange(1, E + 1, dtype=torch.float64, device="cpu") ** -zipf
    return p_E / p_E.sum()


def _exact_TK(T: int, E: int, K: int, gen: torch.Generator) -> torch.Tensor:
    P = -(-T * K // E)
    slots = torch.rand(P, E, generator=gen, device="cpu").argsort(-1).flatten()
    # Where E is not a multiple of K (E64 with K=6) a token's slots straddle two permutations and could name one
    # expert twice: the later permutation puts the experts that token's tail did not take first. It stays a
    # permutation, so the counts hold.
    for start in range(E, P * E, E):
        tail = start % K
        if tail:
            nxt = slots[start:start + E]
            clash = torch.isin(nxt, slots[start - tail:start])
            slots[start:start + E] = torch.cat([nxt[~clash], nxt[clash]])
    return slots[: T * K].view(T, K)


def expert_choices_TK(mode: str, T: int, E: int, K: int, seed: int, zipf: float = 1.2) -> torch.Tensor:
    """exact and skewed routing's [T, K] expert ids, K distinct per token, a function of the arguments: drawn on the
    CPU (a CPU generator's draws, under any default device; moe_layer.py's numerics check runs under one)."""
    if not 0 < K <= E:
        raise ValueError(f"top-k must be in [1, E={E}] for {mode} routing, got {K}")
    gen = torch.Generator().manual_seed(seed)
    if mode == "exact":
        return _exact_TK(T, E, K, gen)
    if mode == "skewed":
        return torch.multinomial(popularity_E(E, zipf).expand(T, E), K, replacement=False, generator=gen)
    raise ValueError(f"routing mode must be one of {MODES[1:]} here (topk draws its own logits), got {mode!r}")


def routing_TK(probs_TE: torch.Tensor, K: int, mode: str, zipf: float, seed: int):
    """(weights_TK, experts_TK) for router probabilities `probs_TE`: their top K, or the mode's drawn experts
    weighted by those probabilities."""
    if mode == "topk":
        return probs_TE.topk(K, -1)
    T, E = probs_TE.shape
    experts_TK = expert_choices_TK(mode, T, E, K, seed, zipf).to(probs_TE.device)
    return probs_TE.gather(-1, experts_TK), experts_TK


def routed_inputs(rank: int, T: int, D: int, E: int, K: int, dev, dtype, mode: str = "topk", zipf: float = 1.2,
                  with_probs: bool = False):
    """The benchmarks' input x_1TD and routing (weights_TK in `dtype`, experts_TK; `with_probs`: also the float32
    probs_TE they were drawn from, which token rounding weighs added pairs by) on this rank: seeded by the rank,
    the input and logits drawn in the same order as before the modes existed."""
    torch.manual_seed(rank)
    x_1TD = torch.randn(1, T, D, device=dev, dtype=dtype, requires_grad=True)
    probs_TE = torch.softmax(torch.randn(T, E, device=dev), -1)
    weights_TK, experts_TK = routing_TK(probs_TE, K, mode, zipf, seed=rank)
    if with_probs:
        return x_1TD, weights_TK.to(dtype), experts_TK, probs_TE
    return x_1TD, weights_TK.to(dtype), experts_TK


def load_stats(experts_TK: torch.Tensor, E: int, all_ranks: bool) -> dict:
    """Rows per expert (mean, max, max / mean), over every rank's tokens when `all_ranks` (a collective: every
    rank calls it), as the experts of an EP layer receive them."""
    counts_E = torch.bincount(experts_TK.flatten(), minlength=E)
    if all_ranks:
        dist.all_reduce(counts_E)
    mean, peak = counts_E.sum().item() / E, counts_E.max().item()
    return {"rows_mean": mean, "rows_max": peak, "rows_max_over_mean": peak / mean}
