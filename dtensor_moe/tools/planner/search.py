"""The planner's search: enumerate the foldings, cost each with the cost model, rank them.

Dense TP stays inside a node with the CP group it splits the sequence with (cp * tp divides
gpus_per_node, seq_len % (cp * tp) == 0); the experts never split over tp (their tensor parallelism is etp, folded over the
same ranks). `plan_moe` stays the judge of which foldings are valid. Ranking: the foldings that fit
in GPU memory first, by communication time per token (intra / intra_bw + inter / inter_bw, nothing
overlapped); then the rest by memory.
"""

from dataclasses import dataclass

from dtensor_moe.parallel.mesh import MoEParallelDims, divisors
from dtensor_moe.tools.planner.cost_model import (
    GiB,
    Footprint,
    Hardware,
    Memory,
    Traffic,
    Workload,
    comm_bytes,
    footprint,
    fsdp_units,
    rank_memory,
    tokens_per_rank,
)
from dtensor_moe.tools.presets import ModelSpec

TP_NOTE = "dense tp (sequence-parallel) with its cp x tp group inside a node; the experts' tensor parallelism is etp"


@dataclass(frozen=True)
class Candidate:
    dims: MoEParallelDims
    memory: Memory
    comm: dict[str, Traffic]
    comm_time_s: float  # if nothing overlapped: intra / intra_bw + inter / inter_bw
    tokens: int  # per rank per step
    fits: bool

    @property
    def time_per_token(self) -> float:
        return self.comm_time_s / self.tokens

    @property
    def intra(self) -> float:
        return sum(t.intra for t in self.comm.values())

    @property
    def inter(self) -> float:
        return sum(t.inter for t in self.comm.values())


def foldings(world: int, spec: ModelSpec, work: Workload, gpus_per_node: int = 8):
    """Every MoEParallelDims that could be valid. The divisibility filters only prune the search (cp
    and tp must split the sequence, a CP x TP group with tp > 1 stays in a node); plan_moe remains the judge
    of validity."""
    moe = spec.moe_config()
    world_divs = divisors(world)
    for dp_rep in world_divs:
        rest = world // dp_rep
        rest_divs = [d for d in world_divs if rest % d == 0]
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
                            yield MoEParallelDims(world, dp_replicate=dp_rep, cp=cp, tp=tp, ep=ep, etp=etp)


def footprint_key(dims: MoEParallelDims) -> tuple:
    """What rank 0's footprint depends on: the sizes of the axes the plan shards over (dp_shard*cp,
    tp, ep, etp and so edp) and whether the dense axis is dp_shard or dp_shard_cp. tests/test_planner.py
    checks this against a fresh plan for every folding of a smaller world."""
    return dims.dp_shard * dims.cp, dims.cp > 1, dims.tp, dims.ep, dims.etp


def evaluate(spec: ModelSpec, dims: MoEParallelDims, work: Workload, hw: Hardware, fp: Footprint | None = None) -> Candidate:
    fp = fp or footprint(fsdp_units(spec, dims), dims)
    mem = rank_memory(spec, dims, work, fp)
    comm = comm_bytes(spec, dims, work, hw.gpus_per_node, fp)
    t = sum(c.intra / hw.intra_bw + c.inter / hw.inter_bw for c in comm.values())
    return Candidate(dims, mem, comm, t, tokens_per_rank(work, dims), mem.total <= hw.gpu_mem_gib * GiB)


def plan(spec: ModelSpec, work: Workload, hw: Hardware) -> list[Candidate]:
    """All valid candidates: those that fit first, by communication time per token; then the rest by memory."""
    footprints: dict[tuple, Footprint | None] = {}
    cands = []
    for dims in foldings(hw.gpus, spec, work, hw.gpus_per_node):
        key = footprint_key(dims)
        if key not in footprints:
            try:
                footprints[key] = footprint(fsdp_units(spec, dims), dims)
            except ValueError:  # plan_moe rejected the folding
                footprints[key] = None
        if footprints[key] is not None:
            cands.append(evaluate(spec, dims, work, hw, footprints[key]))
    return sorted(cands, key=lambda c: (not c.fits, c.time_per_token if c.fits else c.memory.total, c.memory.total))
