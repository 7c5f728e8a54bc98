"""Bytes each rank sends per step, per collective kind, split intra-/inter-node, and their seconds.

- its tokens' (`token_traffic`, from the folding's `Rates`): pipeline stage-boundary sends of hidden
  states (forward) and their gradients (backward) per microbatch, EP all-to-all and ETP
  gather/reduce-scatter of routed tokens (uniform routing, pairwise; under skewed routing the
  busiest EP rank's), K/V all-gather passes under CP, sequence parallelism's all-gather /
  reduce-scatter of each block's attention input and output under TP, and with hot-expert replicas
  the owners' weight copies to the replica slots and their gradients back (`replica_weights`);
- its weights' (`Held`, from rank 0's footprint): FSDP all-gather (twice per block: forward and
  backward) and reduce-scatter (fp32), HSDP all-reduce over dp_replicate.

Time is intra / intra_bw + inter / inter_bw per collective, nothing overlapped.
"""

from collections.abc import Iterable
from typing import NamedTuple

from dtensor_moe.parallel.mesh import MoEParallelDims
from dtensor_moe.tools.folding.geometry import mesh_geometry, ring_inter_fraction
from dtensor_moe.tools.folding.memory import held_memory
from dtensor_moe.tools.folding.pipeline import PipelineRank, whole_model
from dtensor_moe.tools.folding.tokens import Rates, rates
from dtensor_moe.tools.folding.units import Footprint
from dtensor_moe.tools.folding.workload import REDUCE_BYTES, Hardware, Workload
from dtensor_moe.tools.presets import ModelShape


class Traffic(NamedTuple):  # a tuple: built a dozen times per folding, tens of thousands of foldings
    """Bytes one rank sends per step in one kind of collective: `intra` inside its node, `inter` across nodes
    (`seconds` prices them)."""

    intra: float
    inter: float


def _part(total: float, inter_fraction: float) -> Traffic:
    """`total` bytes split intra-/inter-node."""
    return Traffic(total * (1 - inter_fraction), total * inter_fraction) if total else Traffic(0, 0)


class Held(NamedTuple):
    """What a pipeline rank costs through the weights it holds, whatever its tokens: state and
    working-set bytes, FSDP's and HSDP's traffic. It depends on the folding only through
    footprint_key and pp (the sizes and strides of the axes it is sharded and replicated over follow
    from them), so a search computes it once per (footprint_key, pp) and pipeline rank."""

    rank: PipelineRank
    fp: Footprint
    memory: tuple[int, int, int, int]  # params, grads, optimizer state, gathered working set
    traffic: dict[str, Traffic]  # fsdp_all_gather, fsdp_reduce_scatter, hsdp_all_reduce


def held_costs(dims: MoEParallelDims, work: Workload, gpus_per_node: int, fp: Footprint, rank: PipelineRank
               ) -> Held:
    """What pipeline rank `rank` of folding `dims` costs through the weights it holds (footprint `fp`): its
    `Held`, from `ranks_held_costs` of that one rank."""
    return ranks_held_costs(dims, work, gpus_per_node, ((rank, fp),))[0]


def ranks_held_costs(dims: MoEParallelDims, work: Workload, gpus_per_node: int,
                     ranks: Iterable[tuple[PipelineRank, Footprint]]) -> tuple[Held, ...]:
    """held_costs of each (pipeline rank, its footprint) of one folding, the folding's geometry read
    once. FSDP all-gathers (compute dtype) and reduce-scatters (fp32) ring over each axis a unit is
    sharded on; HSDP all-reduces the sharded gradients over dp_replicate."""
    G, geo, r, b = gpus_per_node, mesh_geometry(dims), dims.dp_replicate, work.compute_bytes
    # Without pp every microbatch's backward reduces the gradients; pipelining reduces them once a step.
    reductions = work.microbatches if dims.pp == 1 else 1
    hsdp_rate, hsdp_inter = reductions * 2 * (r - 1) / r, ring_inter_fraction(*geo["dp_replicate"], G)
    rings: dict[str, tuple[int, float, float]] = {}  # axis: (peers, share of ring hops crossing nodes, the rest)
    out = []
    for rank, fp in ranks:
        # Each sharded axis's ring traffic split intra-/inter-node, summed in the footprint's order.
        gather_intra = gather_inter = scatter_intra = scatter_inter = 0
        for axis, gathers, n in fp.sharded:
            if axis not in rings:
                size, stride = geo[axis]
                inter = ring_inter_fraction(size, stride, G)
                rings[axis] = (size - 1, inter, 1 - inter)
            peers, inter, intra = rings[axis]
            if gathered := gathers * peers * n * b:
                gather_intra, gather_inter = gather_intra + gathered * intra, gather_inter + gathered * inter
            if scattered := reductions * peers * n * REDUCE_BYTES:
                scatter_intra, scatter_inter = scatter_intra + scattered * intra, scatter_inter + scattered * inter
        traffic = {"fsdp_all_gather": Traffic(gather_intra, gather_inter),
                   "fsdp_reduce_scatter": Traffic(scatter_intra, scatter_inter),
                   "hsdp_all_reduce": _part(hsdp_rate * fp.held * REDUCE_BYTES, hsdp_inter)}
        out.append(Held(rank, fp, held_memory(work, dims.pp, fp), traffic))
    return tuple(out)


def token_traffic(r: Rates, rank: PipelineRank) -> dict[str, Traffic]:
    """What a pipeline rank's tokens send: its traffic but the weights' (`Held.traffic`)."""
    s, routed = rank.share, r.routed * rank.share.n_moe_layers
    return {
        "pp_send_recv": _part(rank.sends * r.send, r.send_inter),
        "ep_all_to_all": _part(routed * (r.ep - 1) / r.ep, r.ep_inter),
        "etp_gather_scatter": _part(routed * (r.etp - 1), r.etp_inter),
        "tp_sequence": _part((r.seq_per_layer * s.layers + 2 * (s.first + s.last)) * r.seq, r.tp_inter),
        "cp_ring_kv": _part(s.layers * r.kv, r.cp_inter),
        **({"replica_weights": _part(r.replica_sent * s.n_moe_layers, r.ep_inter)} if r.replica_copies else {}),
    }


def traffic_of(r: Rates, held: Held) -> dict[str, Traffic]:
    """A pipeline rank's traffic per step, per collective kind: its tokens' under the folding's `Rates` `r`
    (`token_traffic`), then its weights' (`held.traffic`)."""
    return {**token_traffic(r, held.rank), **held.traffic}


def comm_bytes(spec: ModelShape, dims: MoEParallelDims, work: Workload, gpus_per_node: int, fp: Footprint,
               rank: PipelineRank | None = None) -> dict[str, Traffic]:
    """Bytes one (pipeline) rank sends per step, per collective kind, split intra-/inter-node."""
    held = held_costs(dims, work, gpus_per_node, fp, rank or whole_model(spec))
    return traffic_of(rates(spec, dims, work, gpus_per_node), held)


def seconds(c: Traffic, hw: Hardware) -> float:
    """One collective's time: intra / intra_bw + inter / inter_bw."""
    return c.intra / hw.intra_bw + c.inter / hw.inter_bw


def comm_time(traffic, hw: Hardware, start: float = 0) -> float:
    """Seconds of `traffic` (Traffic values) if nothing overlapped, added left to right from `start`:
    a rank's total added up in two parts (its tokens' collectives, then its weights') is the same
    float (sum() compensates from Python 3.12)."""
    for c in traffic:
        start += seconds(c, hw)
    return start
