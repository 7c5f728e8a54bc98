"""The planner's search: enumerate the foldings, cost each with the cost model, rank them.

Pipeline parallelism is outermost: pp > 1 only where the schedule runs it (`check_pipeline`: layers
per stage, microbatches) and, beyond one node, with each stage on whole nodes (PP's sends cross
nodes, every other group stays inside a stage). Dense TP stays inside a node with the CP group it splits the sequence with (cp * tp divides
gpus_per_node, seq_len % (cp * tp) == 0); the experts never split over tp (their tensor parallelism is etp, folded over the
same ranks). `plan_moe` stays the judge of which foldings are valid. Ranking: the foldings that fit
in GPU memory first, by communication time per token (intra / intra_bw + inter / inter_bw, nothing
overlapped) stretched by the pipeline bubble; then the rest by memory.
"""

import gc
from typing import NamedTuple

from dtensor_moe.parallel.mesh import MoEParallelDims, divisors
from dtensor_moe.parallel.plan import check_pipeline
from dtensor_moe.tools.planner.cost_model import (
    GiB,
    Hardware,
    Held,
    Memory,
    StageShare,
    Traffic,
    UnitPart,
    Workload,
    bubble_fraction,
    footprint,
    fsdp_units,
    pipeline_ranks,
    held_costs,
    memory_of,
    rates,
    traffic_of,
    share_footprint,
    share_parts,
    step_tokens_per_rank,
)
from dtensor_moe.tools.presets import ModelSpec

TP_NOTE = "dense tp (sequence-parallel) with its cp x tp group inside a node; the experts' tensor parallelism is etp"


class Candidate(NamedTuple):  # a tuple: one per folding, tens of thousands per search
    dims: MoEParallelDims
    memory: Memory  # the pipeline rank with the most
    comm: dict[str, Traffic]  # the slowest pipeline rank's
    comm_time_s: float  # if nothing overlapped: intra / intra_bw + inter / inter_bw
    tokens: float  # the step's tokens per rank of the world
    fits: bool
    bubble: float  # share of the step a pipeline rank idles
    share: StageShare  # what the rank with the most memory holds

    @property
    def time_per_token(self) -> float:
        return self.comm_time_s / (1 - self.bubble) / self.tokens

    @property
    def intra(self) -> float:
        return sum(t.intra for t in self.comm.values())

    @property
    def inter(self) -> float:
        return sum(t.inter for t in self.comm.values())


def pipeline_degrees(world: int, spec: ModelSpec, work: Workload, gpus_per_node: int = 8) -> list[int]:
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


def foldings(world: int, spec: ModelSpec, work: Workload, gpus_per_node: int = 8, pp: int | None = None):
    """Every MoEParallelDims that could be valid, with `pp` or each of `pipeline_degrees`. The
    divisibility filters only prune the search (cp and tp must split the sequence, a CP x TP group with
    tp > 1 stays in a node); plan_moe remains the judge of validity."""
    for p in (pipeline_degrees(world, spec, work, gpus_per_node) if pp is None else (pp,)):
        yield from _stage_foldings(world, p, spec, work, gpus_per_node)


def _stage_foldings(world: int, pp: int, spec: ModelSpec, work: Workload, gpus_per_node: int):
    moe = spec.moe_config()
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
                for ep in rest_divs:
                    if moe.num_experts % ep:
                        continue
                    for etp in rest_divs:
                        if (rest // ep) % etp == 0 and moe.hidden_dim % etp == 0:
                            yield MoEParallelDims(world, dp_replicate=dp_rep, cp=cp, tp=tp, ep=ep, etp=etp, pp=pp)


def footprint_key(dims: MoEParallelDims) -> tuple:
    """What rank 0's footprint depends on: the sizes of the axes the plan shards over (dp_shard*cp,
    tp, ep, etp and so edp) and whether the dense axis is dp_shard or dp_shard_cp. tests/test_planner.py
    checks this against a fresh plan for every folding of a smaller world."""
    return dims.dp_shard * dims.cp, dims.cp > 1, dims.tp, dims.ep, dims.etp


def evaluate(spec: ModelSpec, dims: MoEParallelDims, work: Workload, hw: Hardware,
             held: tuple[Held, ...] | None = None) -> Candidate:
    """Every pipeline rank that can be the worst (`pipeline_ranks`, with what its weights cost): the
    most memory, the slowest traffic."""
    if held is None:
        parts = share_parts(spec, dims, work.microbatches)
        held = tuple(held_costs(dims, work, hw.gpus_per_node, share_footprint(parts, r.share), r)
                     for r in pipeline_ranks(spec, dims.pp, work))
    (mem, share), (comm, t) = _worst(rates(spec, dims, work, hw.gpus_per_node), hw, held)
    return Candidate(dims, mem, comm, t, step_tokens_per_rank(work, dims), mem.total <= hw.gpu_mem_gib * GiB,
                     bubble_fraction(dims.pp, work), share)


def _worst(r, hw, held):
    """((memory, share) of the rank with the most memory, (traffic, time) of the slowest rank); ties
    go to the earlier rank."""
    worst_mem = worst_comm = None
    for h in held:
        mem, comm = memory_of(r, h), traffic_of(r, h)
        total = mem.total
        t = sum(c.intra / hw.intra_bw + c.inter / hw.inter_bw for c in comm.values())
        if worst_mem is None or total > worst_mem[2]:
            worst_mem = (mem, h.rank.share, total)
        if worst_comm is None or t > worst_comm[1]:
            worst_comm = (comm, t)
    return worst_mem[:2], worst_comm


def plan(spec: ModelSpec, work: Workload, hw: Hardware, pp: int | None = None) -> list[Candidate]:
    """All valid candidates (with `pp`, or every pp the search tries): those that fit first, by
    communication time per token; then the rest by memory."""
    # What each pipeline rank's weights cost depends only on footprint_key and pp: memoized across
    # foldings (and the units' parts on footprint_key alone, across pp).
    parts: dict[tuple, dict[str, UnitPart]] = {}
    held: dict[tuple, tuple[Held, ...] | None] = {}
    cands = []
    # Hundreds of thousands of acyclic tuples: reference counting frees them; the cyclic collector's
    # passes over the growing list of candidates cost a quarter of a 16k-GPU search.
    collecting = gc.isenabled()
    gc.disable()
    try:
        for dims in foldings(hw.gpus, spec, work, hw.gpus_per_node, pp):
            key = (footprint_key(dims), dims.pp)
            if key not in held:
                try:
                    held[key] = tuple(held_costs(dims, work, hw.gpus_per_node, fp, r)
                                      for r, fp in _rank_footprints(spec, dims, work, parts))
                except ValueError:  # plan_moe rejected the folding
                    held[key] = None
            if held[key] is not None:
                cands.append(evaluate(spec, dims, work, hw, held[key]))
    finally:
        if collecting:
            gc.enable()
    return sorted(cands, key=lambda c: (not c.fits, c.time_per_token if c.fits else c.memory.total, c.memory.total))


def _rank_footprints(spec: ModelSpec, dims: MoEParallelDims, work: Workload, parts: dict) -> tuple:
    """(pipeline rank, its footprint) for pipeline_ranks; with pp > 1 the plans are read once per
    footprint_key (`parts`) and combined per share, with pp == 1 (one share) read directly."""
    ranks = pipeline_ranks(spec, dims.pp, work)
    if dims.pp == 1:
        return ((ranks[0], footprint(fsdp_units(spec, dims, ranks[0].share, work.microbatches), dims)),)
    key = footprint_key(dims)
    if key not in parts:
        parts[key] = share_parts(spec, dims, work.microbatches)
    return tuple((r, share_footprint(parts[key], r.share)) for r in ranks)
