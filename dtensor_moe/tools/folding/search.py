"""The folding search: enumerate the foldings, cost each with the cost model, rank them.

Pipeline parallelism is outermost: pp > 1 only where the schedule runs it (`check_pipeline`: layers
per stage, microbatches) and, beyond one node, with each stage on whole nodes (PP's sends cross
nodes, every other group stays inside a stage). Dense TP stays inside a node with the CP group it
splits the sequence with (cp * tp divides gpus_per_node, seq_len % (cp * tp) == 0); the experts
never split over tp (their tensor parallelism is etp, folded over the same ranks). `plan_moe` stays
the judge of which foldings are valid. Ranking: the foldings that fit in GPU memory first, by
communication time per token (intra / intra_bw + inter / inter_bw, nothing overlapped) stretched by
the pipeline bubble; then the rest by memory.
"""

import gc
from typing import NamedTuple

from dtensor_moe.parallel.mesh import MoEParallelDims, divisors
from dtensor_moe.parallel.placement import check_pipeline
from dtensor_moe.tools.folding.cache import CostCache
from dtensor_moe.tools.folding.memory import Memory, rank_activations
from dtensor_moe.tools.folding.pipeline import PipelineRank, StageShare, bubble_fraction, pipeline_ranks
from dtensor_moe.tools.folding.skew import Balance
from dtensor_moe.tools.folding.tokens import rates
from dtensor_moe.tools.folding.traffic import Held, Traffic, comm_time, ranks_held_costs, seconds, token_traffic
from dtensor_moe.tools.folding.units import UnitPart, share_footprint, share_parts
from dtensor_moe.tools.folding.workload import GiB, Hardware, Workload, step_tokens_per_rank
from dtensor_moe.tools.presets import ModelShape

TP_NOTE = "dense tp (sequence-parallel) with its cp x tp group inside a node; the experts' tensor parallelism is etp"


class Candidate(NamedTuple):  # a tuple: one per folding, tens of thousands per search
    """One folding as the cost model prices it (`evaluate`, `rank_foldings`): the memory of its pipeline rank
    with the most and the traffic of its slowest, per step. `time_per_token` (communication time stretched by
    the bubble, per token) ranks the foldings that fit; `intra` and `inter` sum the traffic's bytes."""

    dims: MoEParallelDims
    memory: Memory  # the pipeline rank with the most
    comm: dict[str, Traffic]  # the slowest pipeline rank's
    comm_time_s: float  # if nothing overlapped: intra / intra_bw + inter / inter_bw
    tokens: float  # the step's tokens per rank of the world
    fits: bool
    bubble: float  # share of the step a pipeline rank idles
    share: StageShare  # what the rank with the most memory holds
    balance: Balance | None = None  # rows per EP rank under skewed routing (Workload.skew > 0)

    @property
    def time_per_token(self) -> float:
        return self.comm_time_s / (1 - self.bubble) / self.tokens

    @property
    def intra(self) -> float:
        return sum(t.intra for t in self.comm.values())

    @property
    def inter(self) -> float:
        return sum(t.inter for t in self.comm.values())


def pipeline_degrees(world: int, spec: ModelShape, work: Workload, gpus_per_node: int = 8) -> list[int]:
    """The pp the search tries: those the schedule runs, with whole nodes per stage beyond one node."""
    out = []
    for pp in divisors(world):
        try:
            check_pipeline(MoEParallelDims(world, pp=pp), work.pp_schedule, work.microbatches, spec.n_layers,
                           spec.tie_embeddings)
        except ValueError:
            continue
        if pp == 1 or world <= gpus_per_node or (world // pp) % gpus_per_node == 0:
            out.append(pp)
    return out


def foldings(world: int, spec: ModelShape, work: Workload, gpus_per_node: int = 8, pp: int | None = None):
    """Every MoEParallelDims that could be valid, with `pp` or each of `pipeline_degrees`. The
    divisibility filters only prune the search (cp and tp must split the sequence, a CP x TP group with
    tp > 1 stays in a node); plan_moe remains the judge of validity."""
    for p in (pipeline_degrees(world, spec, work, gpus_per_node) if pp is None else (pp,)):
        yield from _stage_foldings(world, p, spec, work, gpus_per_node)


def _stage_foldings(world: int, pp: int, spec: ModelShape, work: Workload, gpus_per_node: int):
    moe = spec.moe
    stage = world // pp
    stage_divs = divisors(stage)
    for dp_rep in stage_divs:
        rest = stage // dp_rep
        rest_divs = [d for d in stage_divs if rest % d == 0]
        for cp in rest_divs:
            for tp in rest_divs:
                # tp > 1 only with the sequence's whole CP x TP group in one node (both all-gather
                # activations every layer); that also keeps the search within ~1.5x of tp = 1 alone.
                if (rest // cp) % tp or work.seq_len % (cp * tp) or (tp > 1 and gpus_per_node % (cp * tp)):
                    continue
                dense = MoEParallelDims(world, dp_replicate=dp_rep, cp=cp, tp=tp, pp=pp)
                for ep in rest_divs:
                    if moe.num_experts % ep:
                        continue
                    for etp in rest_divs:
                        if (rest // ep) % etp == 0 and moe.hidden_dim % etp == 0:
                            yield _with_experts(dense, ep, etp)


def _with_experts(dense: MoEParallelDims, ep: int, etp: int) -> MoEParallelDims:
    """replace(dense, ep=ep, etp=etp) without re-running MoEParallelDims' checks per folding (a large
    share of a big search's function calls): `dense` passed them, and all that ep and etp add is
    that ep * etp divides dp_shard * cp * tp, which the loops above ensure (tests/test_folding_search.py
    rebuilds every folding of a search through the constructor)."""
    dims = object.__new__(MoEParallelDims)
    dims.__dict__.update(dense.__dict__, ep=ep, etp=etp)
    return dims


def footprint_key(dims: MoEParallelDims) -> tuple:
    """What rank 0's footprint depends on: the sizes of the axes the plan shards over (dp_shard*cp,
    tp, ep, etp and so edp) and whether the dense axis is dp_shard or dp_shard_cp. tests/test_folding_search.py
    checks this against a fresh plan for every folding of a smaller world."""
    return dims.dp_shard * dims.cp, dims.cp > 1, dims.tp, dims.ep, dims.etp


def rates_key(dims: MoEParallelDims) -> tuple:
    """What a folding's `Rates` depend on (a search's world fixes the stage size by pp): all but
    dp_replicate, whose replicas route, send and hold activations alike. Checked like footprint_key."""
    return dims.pp, dims.cp, dims.tp, dims.ep, dims.etp


class _Weights(NamedTuple):
    """A pipeline rank's `Held`, Memory.total's sum of its terms but the activations (in the
    property's order: params, grads, optimizer, gathered) and each of its collectives' time: once
    per (footprint_key, pp)."""

    held: Held
    bytes: float
    seconds: tuple[float, ...]


class _RankTokens(NamedTuple):
    """A pipeline rank's token costs under one `Rates`: activations, traffic and its time."""

    activations: float
    traffic: dict[str, Traffic]
    seconds: float


class _Tokens(NamedTuple):
    """What a folding's tokens cost, once per rates_key: per pipeline rank, and the step's tokens per
    rank, bubble (they follow from cp, tp and pp) and rows per EP rank."""

    ranks: tuple[_RankTokens, ...]
    tokens: float
    bubble: float
    balance: Balance | None


def evaluate(spec: ModelShape, dims: MoEParallelDims, work: Workload, hw: Hardware,
             held: tuple[Held, ...] | None = None, cache: CostCache | None = None) -> Candidate:
    """Every pipeline rank that can be the worst (`pipeline_ranks`, with what its weights cost): the
    most memory, the slowest traffic."""
    cache = CostCache() if cache is None else cache
    if held is None:
        held = _held(spec, dims, work, hw, pipeline_ranks(spec, dims.pp, work), {}, cache)
    ranks = tuple(h.rank for h in held)
    return _candidate(dims, hw, _weights(held, hw), _tokens(spec, dims, work, hw, ranks, cache))[0]


def _held(spec: ModelShape, dims: MoEParallelDims, work: Workload, hw: Hardware, ranks: tuple[PipelineRank, ...],
          parts: dict, cache: CostCache) -> tuple[Held, ...]:
    """What each rank's weights cost; the units' parts memoized in `parts` on footprint_key and
    whether pp is 1 (the root's all-gathers per step differ), across pp and dp_replicate."""
    key = footprint_key(dims), dims.pp == 1
    if key not in parts:
        parts[key] = share_parts(spec, dims, work.microbatches, cache)
    return ranks_held_costs(dims, work, hw.gpus_per_node, [(r, share_footprint(parts[key], r.share)) for r in ranks])


def _weights(held: tuple[Held, ...], hw: Hardware) -> tuple[_Weights, ...]:
    return tuple([_Weights(h, h.memory[0] + h.memory[1] + h.memory[2] + h.memory[3],
                           tuple([seconds(c, hw) for c in h.traffic.values()])) for h in held])


def _tokens(spec: ModelShape, dims: MoEParallelDims, work: Workload, hw: Hardware,
            ranks: tuple[PipelineRank, ...], cache: CostCache) -> _Tokens:
    r, out = rates(spec, dims, work, hw.gpus_per_node, cache), []
    for rank in ranks:
        traffic = token_traffic(r, rank)
        out.append(_RankTokens(rank_activations(r, rank), traffic, comm_time(traffic.values(), hw)))
    return _Tokens(tuple(out), step_tokens_per_rank(work, dims), bubble_fraction(dims.pp, work), r.balance)


def _candidate(dims: MoEParallelDims, hw: Hardware, weights: tuple[_Weights, ...], tokens: _Tokens
               ) -> tuple[Candidate, tuple]:
    """The rank with the most memory and the slowest rank (its time added up as comm_time adds its
    traffic: the tokens' collectives, then the weights'); ties go to the earlier rank. With rank_foldings'
    sort key: those that fit first, by time per token; then the rest by memory."""
    worst_mem = worst_comm = None
    for w, t in zip(weights, tokens.ranks):
        total, time = w.bytes + t.activations, t.seconds
        for s in w.seconds:
            time += s
        if worst_mem is None or total > worst_mem[0]:
            worst_mem = (total, w, t)
        if worst_comm is None or time > worst_comm[0]:
            worst_comm = (time, w, t)
    (total, w, t), (time, slow_w, slow_t) = worst_mem, worst_comm
    c = Candidate(dims, Memory(*w.held.memory, t.activations), {**slow_t.traffic, **slow_w.held.traffic}, time,
                  tokens.tokens, total <= hw.gpu_mem_gib * GiB, tokens.bubble, w.held.rank.share, tokens.balance)
    # total is c.memory.total (its terms added in the property's order), the time per token c's.
    return c, (not c.fits, time / (1 - c.bubble) / c.tokens if c.fits else total, total)


_UNSEEN = object()


def rank_foldings(spec: ModelShape, work: Workload, hw: Hardware, pp: int | None = None, cache: CostCache | None = None
         ) -> list[Candidate]:
    """All valid candidates (with `pp`, or every pp the search tries), sorted by `_candidate`'s key.
    The cost model's memo tables are `cache`'s, a fresh CostCache unless given one."""
    cache = CostCache() if cache is None else cache
    # What a pipeline rank's weights cost depends on the folding only through footprint_key and pp,
    # what its tokens cost only through rates_key: each computed once, shared by the foldings. These
    # tables are keyed without spec, work and hw, which one search fixes, so they live only here.
    ranks: dict[int, tuple[PipelineRank, ...]] = {}
    parts: dict[tuple, dict[str, UnitPart]] = {}
    weights: dict[tuple, tuple[_Weights, ...] | None] = {}
    tokens: dict[tuple, _Tokens] = {}
    cands, keys = [], []
    # Hundreds of thousands of acyclic tuples: reference counting frees them, and the cyclic
    # collector's passes over the growing list of candidates would be a large part of a big search.
    collecting = gc.isenabled()
    gc.disable()
    try:
        for dims in foldings(hw.gpus, spec, work, hw.gpus_per_node, pp):
            if work.moe_run.expert_replicas and dims.ep == 1:  # a replica slot holds another EP rank's expert
                continue
            if dims.pp not in ranks:
                ranks[dims.pp] = pipeline_ranks(spec, dims.pp, work)
            key = footprint_key(dims), dims.pp
            if (w := weights.get(key, _UNSEEN)) is _UNSEEN:
                try:
                    w = _weights(_held(spec, dims, work, hw, ranks[dims.pp], parts, cache), hw)
                except ValueError:  # plan_moe rejected the folding
                    w = None
                weights[key] = w
            if w is None:
                continue
            if (t := tokens.get(rkey := rates_key(dims))) is None:
                t = tokens[rkey] = _tokens(spec, dims, work, hw, ranks[dims.pp], cache)
            c, key = _candidate(dims, hw, w, t)
            cands.append(c)
            keys.append(key)
    finally:
        if collecting:
            gc.enable()
    return [cands[i] for i in sorted(range(len(cands)), key=keys.__getitem__)]  # stable: ties keep the search's order
