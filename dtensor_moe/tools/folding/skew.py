"""Skewed routing (`Workload.skew`): the rows each EP rank computes when some experts are hot, without and with
hot-expert replicas (MoERunOptions.expert_replicas), and the straggler factor, max / mean rows per EP rank, by which
the slowest EP rank stretches the step's routed rows (all-to-all, ETP gather, expert activations).

The popularity is benchmarks/routing.py's skewed routing (tests/parity.py's `Case.zipf`), so the search prices
what the tests and benchmarks measure: expert weights 1 / rank ** skew, the ranks 1..E a permutation of the
expert ids drawn as `torch.randperm(E)` from a generator seeded 0 (`popularity_order` draws the same one without
torch: torch's CPU generator is MT19937 seeded as in `init_genrand`, its randperm a Fisher-Yates shuffle). The
experts sit where the EP split puts them, contiguous blocks of E / ep ids, so which rank the hottest ones share
is that permutation's. Each token draws top_k distinct experts with those weights (successive sampling,
torch.multinomial without replacement): an expert's expected rows are tokens x its inclusion probability
(`inclusion`), which stays below one row a token where tokens x top_k x its weight would not (the hottest of 64
at skew 1.2 and top_k 4: 0.78 rows a token, not 1.17).

Rows per EP rank: the expected rows per expert (rounded) summed over each owner's block, and split over the
replica slots that parallel/replicas.py's `place_replicas` fills (the dispatcher runs it on counts, `placement` on
expected ones) as the dispatcher splits each forward's rows (`rows_per_rank`).
"""

import math
import random
from typing import NamedTuple

from dtensor_moe.parallel.replicas import place_replicas, rows_per_rank
from dtensor_moe.tools.folding.cache import CostCache

POPULARITY_SEED = 0  # benchmarks/routing.py's
# The dispatcher places replicas from counts summed over replica_replan_every forwards (100 by default); their
# expected values at this many tokens leave no rounding in the slots, which then serve every folding of an ep.
PLACEMENT_TOKENS = 2**20
_MT_N = 624


def popularity_order(E: int, seed: int = POPULARITY_SEED) -> list[int]:
    """torch.randperm(E, generator=torch.Generator().manual_seed(seed)): order[i] is the expert of rank i + 1."""
    state = [seed & 0xFFFFFFFF]
    for j in range(1, _MT_N):
        state.append((1812433253 * (state[-1] ^ (state[-1] >> 30)) + j) & 0xFFFFFFFF)
    mt = random.Random()
    mt.setstate((3, (*state, _MT_N), None))  # index 624: the first draw twists the state, as after seeding
    order = list(range(E))
    for i in range(E - 1):
        z = i + mt.getrandbits(32) % (E - i)
        order[i], order[z] = order[z], order[i]
    return order


def popularity(E: int, skew: float) -> list[float]:
    """Each expert's weight (summing to 1): benchmarks/routing.py's popularity_E."""
    weight = [0.0] * E
    for rank, e in enumerate(popularity_order(E), 1):
        weight[e] = rank ** -skew
    total = sum(weight)
    return [w / total for w in weight]


def inclusion(p: list[float], k: int) -> list[float]:
    """P(expert e is among k distinct draws, each drawn with probability proportional to p among those left).

    Successive sampling is exponential order sampling: expert j's clock X_j ~ Exp(p_j), the k smallest win, so
    pi_e = integral over t of p_e exp(-p_e t) P(fewer than k other clocks < t) dt, the count a sum of
    Bernoulli(1 - exp(-p_j t)) (prefix and suffix distributions truncated at k leave e out). The integrand is
    smooth and decays fast in y = log t, where the trapezoid rule converges geometrically (steps of 0.25: the
    pi sum to k within ~1e-11)."""
    E = len(p)
    if k >= E:
        return [1.0] * E
    live = [q for q in p if q > 0]
    lo, hi = math.log(1e-12 / max(live)), math.log(40 / min(live))  # below: < 1e-12 of any pi; above: exp(-40)
    steps = math.ceil((hi - lo) / 0.25)
    h = (hi - lo) / steps
    out = [0.0] * E
    for i in range(steps + 1):
        t = math.exp(lo + i * h)
        q = [-math.expm1(-pj * t) for pj in p]
        pre = [[1.0] + [0.0] * (k - 1)]  # pre[j]: distribution of the count among experts < j, below k
        for qj in q:
            d = pre[-1]
            pre.append([d[0] * (1 - qj)] + [d[m] * (1 - qj) + d[m - 1] * qj for m in range(1, k)])
        below = [1.0] * k  # P(count among experts > e is <= m), m < k
        for e in range(E - 1, -1, -1):
            fewer = sum(pre[e][m] * below[k - 1 - m] for m in range(k))
            out[e] += (0.5 if i in (0, steps) else 1.0) * h * p[e] * t * math.exp(-p[e] * t) * fewer
            qe, acc = q[e], []
            for m in range(k):  # fold e into the suffix: cumulative P(count <= m)
                acc.append(below[m] * (1 - qe) + (below[m - 1] * qe if m else 0.0))
            below = acc
    return out


def expert_rows(E: int, k: int, tokens: int, skew: float, cache: CostCache | None = None) -> list[int]:
    """Expected rows per expert (rounded) when `tokens` tokens each route to k distinct experts."""

    def make():
        return inclusion(popularity(E, skew), k)

    pis = make() if cache is None else cache.inclusion.get_or_make((E, k, skew), make)
    return [round(tokens * pi) for pi in pis]


def max_over_mean(rows) -> float:
    """The straggler factor of `rows` (rows per EP rank): the largest over their mean, 1.0 when balanced.

    Example:
        >>> max_over_mean([3, 1, 2, 2])
        1.5
    """
    return max(rows) * len(rows) / sum(rows)


class Balance(NamedTuple):
    """An EP group's rows under skewed routing."""

    rows: tuple[int, ...]  # rows each EP rank computes without replicas
    replica_rows: tuple[int, ...]  # with the model's replica slots, placed by `slots` (rows, without any)
    slots: tuple[tuple[int, ...], ...]  # place_replicas' slots: slots[q][j] the expert slot j holds, -1 empty
    copies: int  # weight copies the busiest EP rank sends or receives per forward (owners send to replica slots)
    hottest: int  # the expert with the largest weight

    @property
    def imbalance(self) -> float:
        return max_over_mean(self.rows)

    @property
    def replica_imbalance(self) -> float:
        return max_over_mean(self.replica_rows)


def placement(E: int, k: int, ep: int, skew: float, replicas: int,
              cache: CostCache | None = None) -> tuple[tuple[int, ...], ...]:
    """The replica slots parallel/replicas.py places from the expected rows of PLACEMENT_TOKENS tokens."""

    def make():
        return place_replicas(expert_rows(E, k, PLACEMENT_TOKENS, skew, cache), ep, replicas)

    return make() if cache is None else cache.placement.get_or_make((E, k, ep, skew, replicas), make)


def balance(E: int, k: int, ep: int, tokens: int, skew: float, replicas: int,
            cache: CostCache | None = None) -> Balance:
    """Rows per EP rank for `tokens` tokens of an EP x ETP group routed with `skew`, and `replicas` slots a rank."""
    load, E_local = expert_rows(E, k, tokens, skew, cache), E // ep
    slots = placement(E, k, ep, skew, replicas, cache)
    sent, got = [0] * ep, [0] * ep
    for q, row in enumerate(slots):
        for e in row:
            if e >= 0:
                sent[e // E_local] += 1
                got[q] += 1
    return Balance(tuple(sum(load[q * E_local:(q + 1) * E_local]) for q in range(ep)),
                   tuple(rows_per_rank(load, ep, slots)), slots, max(max(sent), max(got)), popularity_order(E)[0])
