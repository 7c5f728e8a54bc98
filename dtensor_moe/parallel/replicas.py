"""Hot-expert replicas (MoERunOptions.expert_replicas): where copies of the hottest experts go, and how each replicated
expert's rows split between its owner and its replicas. Plain, deterministic integer arithmetic, torch-free: the
dispatcher runs it on the counts every rank of an EP x ETP group all-gathered (so every rank computes the same
slots), and `dtensor-moe plan` can run it on predicted counts.

EP rank q owns experts q * E_local .. (q + 1) * E_local - 1 and has `r` replica slots; `slots[q][j]` is the expert
slot j holds (-1: empty), never one q owns and never twice on one rank. A rank's virtual slots are its owned
experts, then its replica slots: virtual slot q * (E_local + r) + j. The dispatch groups rows by virtual slot
exactly as it groups them by expert without replicas.

Split: the hottest replicated experts first, each expert's rows are water-filled over its holders (owner and
replicas) on top of the rows those ranks already have, so each holder ends as close as the integers allow to a
common level. Then the expert's rows are cut in source order (ETP slice, then EP source, then the source's own
order of its pairs): the owner takes the first share, each replica the next, in rank order.
"""

import math
from collections.abc import Sequence

__all__ = ["place_replicas", "rows_per_rank", "shares", "holders", "source_segments"]


def _water_fill(rows: int, levels: Sequence[int]) -> list[int]:
    """Rows to add to each level (summing to `rows`) that raise the lowest levels to a common one; the
    remainder of the integer division goes to the lowest (then first) levels."""
    order = sorted(range(len(levels)), key=lambda i: (levels[i], i))
    left, k = rows, 1
    while True:
        level = levels[order[k - 1]]
        step = (levels[order[k]] - level) * k if k < len(order) else None
        if step is None or step >= left:
            each, extra = divmod(left, k)
            add = [0] * len(levels)
            for n, i in enumerate(order[:k]):
                add[i] = level + each - levels[i] + (n < extra)
            return add
        left -= step
        k += 1


def holders(E: int, ep: int, slots: Sequence[Sequence[int]]) -> list[list[tuple[int, int]]]:
    """For each expert, its holders as (EP rank, virtual slot): the owner first, then its replicas by rank."""
    E_local, r = E // ep, len(slots[0]) if slots else 0
    out = [[(e // E_local, e // E_local * (E_local + r) + e % E_local)] for e in range(E)]
    for q, row in enumerate(slots):
        for j, e in enumerate(row):
            if e >= 0:
                out[e].append((q, q * (E_local + r) + E_local + j))
    return out


def shares(load_E: Sequence[int], ep: int, slots: Sequence[Sequence[int]]) -> tuple[list[list[int]], list[int]]:
    """(rows of each expert per holder, in `holders` order; rows per EP rank) for per-expert rows `load_E`."""
    E = len(load_E)
    held = holders(E, ep, slots)
    level = [0] * ep
    out = [[load_E[e]] for e in range(E)]
    for e in range(E):
        if len(held[e]) == 1:
            level[held[e][0][0]] += load_E[e]
    for e in sorted((e for e in range(E) if len(held[e]) > 1), key=lambda e: (-load_E[e], e)):
        ranks = [q for q, _ in held[e]]
        out[e] = _water_fill(load_E[e], [level[q] for q in ranks])
        for q, n in zip(ranks, out[e]):
            level[q] += n
    return out, level


def rows_per_rank(load_E: Sequence[int], ep: int, slots: Sequence[Sequence[int]]) -> list[int]:
    """The rows each EP rank computes under `slots` (the folding search's prediction; the dispatcher's split)."""
    return shares(load_E, ep, slots)[1]


def place_replicas(load_E: Sequence[int], ep: int, r: int, candidates: int = 4) -> tuple[tuple[int, ...], ...]:
    """slots[q][j] (-1: empty) for per-expert rows `load_E` (integers, e.g. counts summed over recent steps):
    one replica at a time, of the copies that one of the `candidates` least loaded ranks with a free slot could
    take of one of the `candidates` largest shares on the `candidates` most loaded ranks, the one whose re-split of
    that expert leaves the lowest maximum load (then the lowest sum of squared loads). Stops when no copy lowers
    them. Deterministic: ties go to the lower expert, then rank.

    Judged by the resulting split rather than by a rule such as "the hottest rank's largest share to the least
    loaded rank": that rule spends the slots of the loaded ranks (which cannot shed rows by taking copies) and
    stalls above the mean when top_k > 2 spreads the hot rows over several experts. Each trial re-fills only its
    expert (O(holders)), so a placement costs O(ep * r * candidates^3 + ep * r * E)."""
    _check_place_args(load_E, ep, r, candidates)
    E = len(load_E)
    if E % ep:
        raise ValueError(f"place_replicas: the experts ({E}) must split evenly over ep ({ep})")
    slots = [[-1] * r for _ in range(ep)]
    for _ in range(ep * r):
        out, level = shares(load_E, ep, slots)
        held = holders(E, ep, slots)
        mine = [{} for _ in range(ep)]  # per rank: expert -> its rows there
        for e in range(E):
            for (q, _), n in zip(held[e], out[e]):
                mine[q][e] = n
        hot = sorted(range(ep), key=lambda q: (-level[q], q))[:candidates]
        free = sorted((q for q in range(ep) if -1 in slots[q]), key=lambda q: (level[q], q))[:candidates]
        experts = sorted({e for q in hot for e in sorted(mine[q], key=lambda e: (-mine[q][e], e))[:candidates]
                          if mine[q][e] > 0})
        best_key, best = (max(level), sum(v * v for v in level)), None
        for e in experts:
            ranks = [q for q, _ in held[e]]
            base = list(level)
            for q, n in zip(ranks, out[e]):
                base[q] -= n
            for q in free:
                if q in ranks:
                    continue
                trial = list(base)
                for x, n in zip([*ranks, q], _water_fill(load_E[e], [base[x] for x in [*ranks, q]])):
                    trial[x] += n
                key = (max(trial), sum(v * v for v in trial))
                if key < best_key:
                    best_key, best = key, (e, q)
        if best is None:
            break
        e, q = best
        slots[q][slots[q].index(-1)] = e
    return tuple(tuple(row) for row in slots)


def _check_place_args(load_E, ep, r, candidates) -> None:
    """place_replicas's arguments by name: a NaN, infinite or negative load would place copies by garbage (NaN
    compares false both ways), a negative slot count would place none without saying so."""
    for name, value, low in (("ep", ep, 1), ("r", r, 0), ("candidates", candidates, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"place_replicas: {name} must be an int >= {low}, got {value!r}")
    if isinstance(load_E, (str, bytes)) or not isinstance(load_E, Sequence):
        raise ValueError(f"place_replicas: load_E must be a sequence of per-expert rows (numbers >= 0), got "
                         f"{type(load_E).__name__}")
    bad = [(e, v) for e, v in enumerate(load_E)
           if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v >= 0)]
    if bad:
        e, v = bad[0]
        raise ValueError(f"place_replicas: load_E must be finite numbers >= 0 (rows per expert), got load_E[{e}] = "
                         f"{v!r}" + (f" and {len(bad) - 1} more" if len(bad) > 1 else ""))


def source_segments(counts_RE: Sequence[Sequence[int]], ep: int,
                    slots: Sequence[Sequence[int]]) -> list[list[tuple[int, int]]]:
    """counts_RE[s][e]: pairs of source s (the EP x ETP group's ranks, ETP slice major) for expert e. Returns, per
    source, (virtual slot, pairs) in the order of its expert-major pairs: each expert's pairs cut, in source
    order, into its holders' shares (owner first)."""
    E = len(counts_RE[0])
    load_E = [sum(c[e] for c in counts_RE) for e in range(E)]
    out_E, _ = shares(load_E, ep, slots)
    held = holders(E, ep, slots)
    segments = [[] for _ in counts_RE]
    for e in range(E):
        h, taken = 0, 0  # the holder being filled, and its pairs so far
        for s, counts_E in enumerate(counts_RE):
            n = counts_E[e]
            while n:
                while taken == out_E[e][h]:
                    h, taken = h + 1, 0
                cut = min(n, out_E[e][h] - taken)
                segments[s].append((held[e][h][1], cut))
                taken, n = taken + cut, n - cut
    return segments
