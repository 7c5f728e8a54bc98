"""The cost model's memo tables, in one object a search owns.

A search costs tens of thousands of foldings that share a few hundred placements, so the costly
steps (planning weights, summing them into per-unit parts, the routing statistics) are memoized on
what they read. The tables live in a `CostCache` rather than in module globals: `rank_foldings`
makes one per search unless the caller passes one, so a search starts cold and leaves nothing
behind, and a caller that keeps one (a benchmark, a test) can `clear()` it. Keys name everything a
result depends on, the `ModelShape` included, so one cache may serve several models and workloads.
Functions that take `cache=None` memoize nothing without one.
"""

MAXSIZE = 16384  # entries per table: far more than one search fills, so only a long-lived cache reaches it


class Memo(dict):
    """One bounded table: `get_or_make(key, make)` is the entry for `key`, made on a miss. A full
    table is emptied: cheaper than tracking recency, and a search never fills one."""

    __slots__ = ("maxsize",)

    def __init__(self, maxsize: int = MAXSIZE):
        super().__init__()
        self.maxsize = maxsize

    def get_or_make(self, key, make):
        try:
            return self[key]
        except KeyError:
            if len(self) >= self.maxsize:
                self.clear()
            value = self[key] = make()
            return value


class CostCache:
    """The cost model's memo tables, by what they hold (units.py and tokens.py name their keys)."""

    __slots__ = ("outer_plans", "outer_parts", "moe_plans", "moe_parts", "distinct_ranks", "inclusion", "placement")

    def __init__(self, maxsize: int = MAXSIZE):
        self.outer_plans = Memo(maxsize)  # weight plans outside the MoE (root, dense block, MoE block)
        self.outer_parts = Memo(maxsize)  # their per-unit parts: embedding, head, dense block, attention
        self.moe_plans = Memo(maxsize)  # plan_moe's plans
        self.moe_parts = Memo(maxsize)  # one MoE block's MoE weights as a unit part
        self.distinct_ranks = Memo(maxsize)  # EP ranks a token's experts land on
        self.inclusion = Memo(maxsize)  # skewed routing: each expert's share of the tokens
        self.placement = Memo(maxsize)  # skewed routing: the replica slots per ep

    def tables(self) -> dict[str, Memo]:
        return {name: getattr(self, name) for name in self.__slots__}

    def clear(self) -> None:
        for table in self.tables().values():
            table.clear()
