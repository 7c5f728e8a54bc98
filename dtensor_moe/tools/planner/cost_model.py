"""The planner's cost model: what one folding costs a rank in memory and in bytes sent per step.

Every number comes from the placement plan: MoE weights from `plan_moe`, the other weights from
what `parallelize_model` does to them (under tp every 2-D weight split over tp -- attention by heads,
embedding and head by vocabulary -- and 1-D ones replicated; then FSDP2 Shard(0) over the dense
data-parallel axis, dp_shard or dp_shard_cp), and which ranks form each group from the mesh order in
`mesh.py` (ETP innermost, then EP, then EDP; TP innermost in the dense mesh).

Pipeline parallelism (outermost, stages of whole nodes in the search) gives each pipeline rank a
`StageShare`: the layers of its stages (`plan.rank_layers`), the embedding on the first, the norm and
head on the last. A step is `microbatches` microbatches of `micro_batch` sequences per data-parallel
rank; every pipeline rank is costed and the candidate takes the one with the most memory and the
slowest one's traffic (it sets the pipeline's pace). The schedule decides the activations in flight
(gpipe: every microbatch, 1f1b: pp - rank on rank `rank`, interleaved: torch's warm-up count of
chunks) and the bubble ((pp - 1) / v / (microbatches + (pp - 1) / v) for v stages per rank), which
stretches the step: time per token is the communication time / (1 - bubble) per token.

Model of one training step per rank:
- memory per rank (rank 0, which holds the largest slices): fp32 sharded params, fp32 sharded
  grads, optimizer state (AdamW: two fp32 moments and a step scalar per tensor) -- FSDP2's
  MixedPrecisionPolicy keeps sharded params in fp32 and all-gathers in the compute dtype; the
  gathered working set (root unit kept gathered, current + prefetched block, one block's
  unsharded grads in compute and reduce dtype); and an activation estimate.
  Under pp torch.distributed.pipelining keeps every FSDP unit unsharded from its first backward to
  the step's gradient reduction and accumulates the unsharded gradients (reduce dtype), so a
  pipeline rank's working set is all of its units, gathered, twice.
- bytes each rank sends per step: pipeline stage-boundary sends of hidden states (forward) and
  their gradients (backward) per microbatch, EP all-to-all and ETP gather/reduce-scatter of routed tokens
  (uniform routing, pairwise), FSDP all-gather (twice per block: forward and backward) and
  reduce-scatter (fp32), HSDP all-reduce over dp_replicate, K/V all-gather passes under CP, and
  sequence parallelism's all-gather / reduce-scatter of each block's attention input and output
  under TP. Between blocks a rank holds seq_len / (cp * tp) tokens of each sequence; attention works
  on seq_len / cp of them with n_heads / tp heads.
  Pairwise traffic is split by how many group peers share the rank's node; ring traffic by how
  many ring hops cross a node boundary (ranks r, r' share a node iff r // G == r' // G).
"""

import math
from collections.abc import Iterable
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import NamedTuple

from dtensor_moe.parallel.mesh import DENSE_AXES, EXPERT_AXES, PP_STAGES_PER_RANK, MoEParallelDims
from dtensor_moe.parallel.plan import ShardStep, WeightPlan, axis_sizes, owned_box, plan_moe, rank_layers
from dtensor_moe.validate import check_choice, check_int, check_positive
from dtensor_moe.tools.presets import ModelSpec, spec_from_model_config

GiB = 2**30
COMPUTE_BYTES = {"bf16": 2, "fp32": 4}
OPTIMIZER_MOMENTS = {"adamw": 2, "sgd": 0}
RECOMPUTE = ("none", "full")
MASTER_BYTES = 4  # sharded params, grads and optimizer state are fp32 under either dtype
REDUCE_BYTES = 4  # gradients are reduced in fp32 (torchtitan's default reduce_dtype)
STEP_BYTES = 4  # AdamW's per-tensor step counter (a float32 scalar)


@dataclass(frozen=True)
class Workload:
    seq_len: int = 4096
    micro_batch: int = 1  # sequences per data-parallel rank per microbatch
    dtype: str = "bf16"
    optimizer: str = "adamw"
    recompute: str = "full"  # "full": each block's activations are recomputed in backward
    microbatches: int = 1  # per step: pipeline microbatches, or gradient accumulation without pp
    pp_schedule: str = "1f1b"

    def __post_init__(self):
        check_int("Workload.seq_len", self.seq_len)
        check_int("Workload.micro_batch", self.micro_batch)
        check_int("Workload.microbatches", self.microbatches)
        check_choice("Workload.pp_schedule", self.pp_schedule, PP_STAGES_PER_RANK)
        check_choice("Workload.dtype", self.dtype, COMPUTE_BYTES)
        check_choice("Workload.optimizer", self.optimizer, OPTIMIZER_MOMENTS)
        check_choice("Workload.recompute", self.recompute, RECOMPUTE)

    @property
    def compute_bytes(self) -> int:
        return COMPUTE_BYTES[self.dtype]


@dataclass(frozen=True)
class Hardware:
    gpus: int
    gpus_per_node: int = 8
    gpu_mem_gib: float = 80.0
    intra_bw: float = 450e9  # bytes/s one direction per GPU (NVLink)
    inter_bw: float = 50e9  # bytes/s per GPU (one 400 Gb/s NIC each)

    def __post_init__(self):
        check_int("Hardware.gpus", self.gpus)
        check_int("Hardware.gpus_per_node", self.gpus_per_node)
        for name in ("gpu_mem_gib", "intra_bw", "inter_bw"):
            check_positive(f"Hardware.{name}", getattr(self, name))
        if self.gpus % self.gpus_per_node and self.gpus > self.gpus_per_node:
            raise ValueError(
                f"Hardware.gpus must be <= gpus_per_node or a multiple of gpus_per_node ({self.gpus_per_node}), got {self.gpus}"
            )


# ---- placement: FSDP units and their weight plans -------------------------------------------


@dataclass(frozen=True)
class Unit:
    """One FSDP unit repeated `count` times (root, dense blocks, MoE blocks)."""

    name: str
    count: int
    plans: tuple[WeightPlan, ...]
    gathers_per_step: int  # all-gathers of its params per step


class StageShare(NamedTuple):
    """What one pipeline rank holds (with pp == 1, the whole model)."""

    dense_layers: int
    moe_layers: int
    first: bool  # the embedding
    last: bool  # the final norm and the head

    @property
    def layers(self) -> int:
        return self.dense_layers + self.moe_layers


def stage_share(spec: ModelSpec, pp: int, schedule: str, pp_rank: int) -> StageShare:
    layers = rank_layers(spec.n_layers, pp, schedule, pp_rank)
    dense = sum(i < spec.n_dense_layers for i in layers)  # the dense layers lead
    return StageShare(dense, len(layers) - dense, pp_rank == 0, pp_rank == pp - 1)


class PipelineRank(NamedTuple):
    share: StageShare
    in_flight: float  # microbatches whose saved activations (of all its layers) it holds at peak
    sends: int  # stage-boundary sends per microbatch: hidden states forward, their gradients backward


def in_flight(work: Workload, pp: int, pp_rank: int) -> float:
    """Microbatches in flight on pipeline rank `pp_rank` at its peak (torch.distributed.pipelining's
    warm-up: 1F1B runs pp - rank forwards before its first backward; interleaved 1F1B counts chunks of
    one stage, 1/v of the rank's layers, and adds one to its warm-up before the first backward)."""
    M, v = work.microbatches, PP_STAGES_PER_RANK[work.pp_schedule]
    if pp == 1:
        return 1  # gradient accumulation runs the microbatches one after another
    if work.pp_schedule == "gpipe":
        return M
    if work.pp_schedule == "1f1b":
        return min(M, pp - pp_rank)
    per_round = M // max(1, M // pp)
    return min((v - 1) * per_round + 2 * (pp - 1 - pp_rank) + 1, M * v) / v


def bubble_fraction(pp: int, work: Workload) -> float:
    """Share of a step a pipeline rank idles: (pp - 1) / v slots of warm-up and drain beside M of work."""
    idle = (pp - 1) / PP_STAGES_PER_RANK[work.pp_schedule]
    return idle / (work.microbatches + idle)


@lru_cache(maxsize=1024)
def pipeline_ranks(spec: ModelSpec, pp: int, work: Workload) -> tuple[PipelineRank, ...]:
    """The pipeline ranks that can be the worst, one per distinct share (the most in flight, the most
    sends): memory and traffic only grow with those. A rank that an earlier one dominates (a share
    holding no more units, no more in flight, no more sends) is left out: every cost is a sum of
    non-negative terms monotone in those, so it never exceeds the earlier rank's, which wins ties."""
    v = PP_STAGES_PER_RANK[work.pp_schedule] if pp > 1 else 0
    worst: dict[StageShare, PipelineRank] = {}
    for r in range(pp):
        share = stage_share(spec, pp, work.pp_schedule, r)
        sends = 2 * v - (r == 0) - (r == pp - 1) if pp > 1 else 0
        old = worst.get(share)
        worst[share] = PipelineRank(share, max(in_flight(work, pp, r), old.in_flight if old else 0),
                                    max(sends, old.sends if old else 0))
    ranks = tuple(worst.values())
    return tuple(a for i, a in enumerate(ranks) if not any(_dominates(b, a) for b in ranks[:i]))


def _dominates(b: PipelineRank, a: PipelineRank) -> bool:
    return all(x >= y for x, y in zip((*b.share, b.in_flight, b.sends), (*a.share, a.in_flight, a.sends)))


def _fsdp_plan(name: str, shape: tuple[int, ...], dims: MoEParallelDims, axis: str) -> WeightPlan:
    """What parallelize_model does to a weight outside the MoE: under tp a 2-D weight is split over
    tp (1-D ones replicated), then `fully_shard` takes Shard(0) of the local slice over `axis`."""
    split = dims.tp > 1 and len(shape) == 2
    steps = (ShardStep("tp", 0),) * split + (ShardStep(axis, 0),)
    replicate = ("dp_replicate",) + ("tp",) * (dims.tp > 1 and not split)
    wp = WeightPlan(name, "dense", shape, steps, replicate, shape, False)
    local = tuple(s.stop - s.start for s in owned_box(wp, dims, 0))
    before = -(-shape[0] // dims.tp) if split else shape[0]
    return replace(wp, local_shape=local, padded=before % axis_sizes(dims)[axis] != 0)


@lru_cache(maxsize=4096)
def _outer_plans(spec: ModelSpec, tp: int, axis: str, size: int):
    """Plans of the non-MoE weights (root, dense block, MoE block). They read only tp and their FSDP
    axis, so they are planned once per (tp, axis, its size), on the smallest stage with those."""
    dims = _dense_stage(tp, axis, size)
    plans = {n: _fsdp_plan(n, s, dims, axis) for n, s in (*spec.root_weights(), *spec.layer_weights(dense_ffn=True))}

    def of(ws):
        return tuple(plans[n] for n, _ in ws)

    return of(spec.root_weights()), of(spec.layer_weights(dense_ffn=True)), of(spec.layer_weights(dense_ffn=False))


def _dense_stage(tp: int, axis: str, size: int) -> MoEParallelDims:
    """The smallest stage whose dense FSDP axis is `axis` of `size` ranks (dp_shard, or cp, = size)."""
    return MoEParallelDims(size * tp, cp=size if axis == "dp_shard_cp" else 1, tp=tp)


@lru_cache(maxsize=64)
def _moe_config(spec: ModelSpec):
    return spec.moe_config()  # validated at construction: once per model, not once per folding


_MOE_PLANS: dict[tuple, tuple[WeightPlan, ...]] = {}
_MOE_PARTS: dict[tuple, "UnitPart"] = {}


def _memo(cache: dict, key, make):
    """cache[key], made on a miss; cleared when full, so a long-lived process stays bounded."""
    if key not in cache:
        if len(cache) > 16384:
            cache.clear()
        cache[key] = make()
    return cache[key]


def _moe_key(spec: ModelSpec, dims: MoEParallelDims) -> tuple:
    """What plan_moe reads: the sizes of the axes it shards over."""
    return spec, dims.ep, dims.etp, dims.edp, dims.moe_dp_axis, dims.dp_shard * dims.cp * dims.tp


def _moe_plans(spec: ModelSpec, dims: MoEParallelDims) -> tuple[WeightPlan, ...]:
    return _memo(_MOE_PLANS, _moe_key(spec, dims), lambda: tuple(plan_moe(_moe_config(spec), dims)))


def _moe_part(spec: ModelSpec, dims: MoEParallelDims, gathers: int) -> "UnitPart":
    """unit_part of one MoE block's MoE weights. plan_moe reads their dense axis (moe_dp_axis, every
    rank of a replica with its own tokens: ep * etp * edp of them) for its name and size only, so the
    part is planned once per (ep, etp, edp), on the stage where that axis is dp_shard, and renamed:
    a quarter of the plans in a search."""
    ep, etp, edp, axis = dims.ep, dims.etp, dims.edp, dims.moe_dp_axis

    def plan():
        stage = MoEParallelDims(ep * etp * edp, ep=ep, etp=etp)
        return unit_part(Unit("moe", 1, _moe_plans(spec, stage), gathers), stage)

    part = _memo(_MOE_PARTS, (spec, ep, etp, edp, gathers), plan)
    if axis == "dp_shard":
        return part
    return part._replace(sharded=tuple(((axis if a == "dp_shard" else a, g), n) for (a, g), n in part.sharded))


def _dense_axis(dims: MoEParallelDims) -> tuple[str, int]:
    """parallelize_model's FSDP axis for the dense weights (MoEMeshes.dp) and its size; the MoE's own axis includes tp."""
    return ("dp_shard_cp", dims.dp_shard * dims.cp) if dims.cp > 1 else ("dp_shard", dims.dp_shard)


def _gathers(dims: MoEParallelDims, microbatches: int) -> tuple[int, int]:
    """All-gathers per step of the root unit (kept gathered after forward; under pp also after
    backward, so gathered once a step) and of a block unit (forward and backward of each microbatch)."""
    return microbatches if dims.pp == 1 else 1, 2 * microbatches


def fsdp_units(spec: ModelSpec, dims: MoEParallelDims, share: StageShare | None = None, microbatches: int = 1
               ) -> tuple[Unit, ...]:
    """The FSDP units of `share` (default: the whole model) with their all-gathers per step."""
    share = share or StageShare(spec.n_dense_layers, spec.n_moe_layers, True, True)
    moe_plans = _moe_plans(spec, dims)
    root, dense_block, moe_block = _outer_plans(spec, dims.tp, *_dense_axis(dims))
    root_gathers, block_gathers = _gathers(dims, microbatches)
    if not (share.first and share.last):  # a pipeline stage: the ends it holds
        held_root = {n for n, _ in spec.root_weights(share.first, share.last)}
        root = tuple(wp for wp in root if wp.name in held_root)
    units = []
    if root:
        units.append(Unit("root", 1, root, root_gathers))
    if share.dense_layers:
        units.append(Unit("dense block", share.dense_layers, dense_block, block_gathers))
    if share.moe_layers:
        units.append(Unit("moe block", share.moe_layers, (*moe_block, *moe_plans), block_gathers))
    return tuple(units)


def held_numel(units, dims: MoEParallelDims, rank: int) -> int:
    """Elements of all parameters that `rank` holds (its owned boxes)."""
    return sum(u.count * math.prod(s.stop - s.start for s in owned_box(wp, dims, rank)) for u in units for wp in u.plans)


class Footprint(NamedTuple):  # a tuple: one per pipeline rank of every (footprint_key, pp) of a search
    """Rank 0's share of every FSDP unit (rank 0 holds the largest slices): all the planner needs."""

    sharded: tuple[tuple[str, int, int], ...]  # (FSDP axis, all-gathers per step, elements held)
    tensors: int  # parameter tensors (AdamW keeps a step counter per tensor)
    gathered_root: int  # unsharded elements of the root unit
    gathered_block: int  # unsharded elements of the largest block unit (EP x ETP slice for experts)
    gathered_blocks: int  # unsharded elements of all block units together
    held: int  # elements held: the sum over `sharded`


class UnitPart(NamedTuple):
    """One copy of a unit on rank 0: elements per (FSDP axis, all-gathers per step), tensors, and its
    unsharded elements (FSDP all-gathers every shard padded to rank 0's, the largest, size)."""

    sharded: tuple[tuple[tuple[str, int], int], ...]
    tensors: int
    gathered: int


def unit_part(u: Unit, dims: MoEParallelDims) -> UnitPart:
    sizes, sharded, gathered = axis_sizes(dims), {}, 0
    for wp in u.plans:
        axis, n = wp.steps[-1].axis, math.prod(wp.local_shape)
        sharded[axis, u.gathers_per_step] = sharded.get((axis, u.gathers_per_step), 0) + n
        gathered += n * sizes[axis]
    return UnitPart(tuple(sharded.items()), len(u.plans), gathered)


def combine(parts) -> Footprint:
    """The footprint of (is_root, count, UnitPart) triples: a rank's units, or parts of them."""
    sharded: dict[tuple[str, int], int] = {}
    tensors = root = biggest = blocks = 0
    for is_root, count, part in parts:
        for key, n in part.sharded:
            sharded[key] = sharded.get(key, 0) + count * n
        tensors += count * part.tensors
        if is_root:
            root += part.gathered
        else:
            biggest, blocks = max(biggest, part.gathered), blocks + count * part.gathered
    return Footprint(tuple([(a, g, n) for (a, g), n in sharded.items()]), tensors, root, biggest, blocks,
                     sum(sharded.values()))


def footprint(units, dims: MoEParallelDims) -> Footprint:
    return combine((u.name == "root", u.count, unit_part(u, dims)) for u in units)


def share_parts(spec: ModelSpec, dims: MoEParallelDims, microbatches: int = 1) -> dict[str, UnitPart]:
    """One copy of each unit a pipeline rank can hold, the root split into the embedding and the head
    (the search combines them per share instead of re-reading the plans), from parts cached on what
    the plans read."""
    root_gathers, block_gathers = _gathers(dims, microbatches)
    embedding, head, dense_block, attention = _outer_parts(spec, dims.tp, *_dense_axis(dims), root_gathers, block_gathers)
    return {"embedding": embedding, "head": head, "dense block": dense_block,
            "moe block": _join(attention, _moe_part(spec, dims, block_gathers))}


@lru_cache(maxsize=4096)
def _outer_parts(spec: ModelSpec, tp: int, axis: str, size: int, root_gathers: int, block_gathers: int):
    """share_parts of the weights outside the MoE: the embedding, the head, a dense block, a MoE block's attention."""
    dims = _dense_stage(tp, axis, size)
    root, dense_block, moe_block = _outer_plans(spec, tp, axis, size)
    embedding = {n for n, _ in spec.root_weights(first=True, last=False)}

    def part(plans, gathers):
        return unit_part(Unit("", 1, plans, gathers), dims)

    return (part(tuple(wp for wp in root if wp.name in embedding), root_gathers),
            part(tuple(wp for wp in root if wp.name not in embedding), root_gathers),
            part(dense_block, block_gathers), part(moe_block, block_gathers))


def _join(a: UnitPart, b: UnitPart) -> UnitPart:
    """The part of a unit holding a's plans then b's: unit_part of the concatenation."""
    sharded = dict(a.sharded)
    for key, n in b.sharded:
        sharded[key] = sharded.get(key, 0) + n
    return UnitPart(tuple(sharded.items()), a.tensors + b.tensors, a.gathered + b.gathered)


def share_footprint(parts: dict[str, UnitPart], share: StageShare) -> Footprint:
    """footprint(fsdp_units(spec, dims, share, microbatches), dims) from `share_parts`."""
    return combine(((True, 1, parts["embedding"]),) * share.first + ((True, 1, parts["head"]),) * share.last
                   + ((False, share.dense_layers, parts["dense block"]),) * (share.dense_layers > 0)
                   + ((False, share.moe_layers, parts["moe block"]),) * (share.moe_layers > 0))


# ---- memory ----------------------------------------------------------------------------------


class Memory(NamedTuple):  # a tuple, like Traffic: built for every pipeline rank of every folding
    params: float
    grads: float
    optimizer: float
    gathered: float
    activations: float

    @property
    def states(self) -> float:
        """Params + grads + optimizer state: what stays allocated between steps."""
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> float:
        return self.states + self.gathered + self.activations


def state_bytes(held: int, tensors: int, work: Workload) -> tuple[int, int, int]:
    """(params, grads, optimizer state) bytes of a rank holding `held` elements of `tensors` parameters."""
    moments = OPTIMIZER_MOMENTS[work.optimizer]
    opt = held * MASTER_BYTES * moments + (tensors * STEP_BYTES if moments else 0)
    return held * MASTER_BYTES, held * MASTER_BYTES, opt


def tokens_per_rank(work: Workload, dims: MoEParallelDims) -> int:
    """Tokens of a microbatch a rank holds between blocks (and routes through each MoE): its CP part,
    its TP slice."""
    return work.micro_batch * work.seq_len // (dims.cp * dims.tp)


def step_tokens_per_rank(work: Workload, dims: MoEParallelDims) -> float:
    """The step's tokens over the world: a pipeline of pp ranks carries each microbatch."""
    return work.microbatches * tokens_per_rank(work, dims) / dims.pp


def activation_bytes(spec: ModelSpec, dims: MoEParallelDims, work: Workload, rank: PipelineRank | None = None) -> float:
    """Saved activations of a (pipeline) rank (estimate): inputs and outputs of every linear, routed
    copies, logits, for each microbatch in flight; one block's more while it is recomputed.

    MoE: after the ETP gather a rank holds etp * top_k * T routed tokens of width D and the same
    tokens' F/etp-wide hidden activations (three of them), so the hidden part is independent of etp;
    the combine keeps the experts' D-wide outputs of those pairs for the routing weights' gradient.
    """
    return rank_activations(rates(spec, dims, work), rank or _whole_model(spec))


def rank_activations(r: "Rates", rank: PipelineRank) -> float:
    s = rank.share
    logits, logits_grad = (r.logits, r.logits_grad) if s.last else (0, 0)
    if r.recompute:  # block inputs, plus one block's activations while it is recomputed
        saved = s.layers * r.block_input
        recomputed = max(r.moe_layer if s.moe_layers else 0, r.dense_layer if s.dense_layers else 0)
    else:
        saved, recomputed = s.moe_layers * r.moe_layer + s.dense_layers * r.dense_layer, 0
    return rank.in_flight * (saved + logits) + recomputed + logits_grad


def rank_memory(spec: ModelSpec, dims: MoEParallelDims, work: Workload, fp: Footprint,
                rank: PipelineRank | None = None) -> Memory:
    return Memory(*_held_memory(work, dims.pp, fp), rank_activations(rates(spec, dims, work), rank or _whole_model(spec)))


def memory_of(r: "Rates", held: "Held") -> Memory:
    return Memory(*held.memory, rank_activations(r, held.rank))


def _held_memory(work: Workload, pp: int, fp: Footprint) -> tuple[int, int, int, int]:
    """(params, grads, optimizer state, gathered working set) bytes of a rank with footprint `fp`."""
    b = work.compute_bytes
    if pp == 1:
        # Root stays gathered; one block computing while the next is prefetched; one block's unsharded
        # grads in compute dtype plus their reduce-dtype copy for the reduce-scatter.
        working = b * (fp.gathered_root + 2 * fp.gathered_block) + fp.gathered_block * (b + REDUCE_BYTES)
    else:  # every unit gathered, its gradients accumulated unsharded, one block's fresh gradient
        working = (b + REDUCE_BYTES) * (fp.gathered_root + fp.gathered_blocks) + b * fp.gathered_block
    return (*state_bytes(fp.held, fp.tensors, work), working)


def predicted_state_bytes(model_cfg, dims: MoEParallelDims, rank: int, optimizer: str = "adamw",
                          pp_schedule: str = "1f1b") -> dict[str, int]:
    """Params, grads and optimizer-state bytes the planner predicts for `rank` of a training run of
    `dtensor_moe.train.model.ModelConfig` (sharded state is fp32 whatever the compute dtype): the
    layers of its pipeline stages, sharded over its stage's ranks."""
    spec = spec_from_model_config(model_cfg)
    units = fsdp_units(spec, dims, stage_share(spec, dims.pp, pp_schedule, dims.pp_coord(rank)))
    tensors = sum(u.count * len(u.plans) for u in units)
    work = Workload(dtype="fp32", optimizer=optimizer)
    return dict(zip(("params", "grads", "optimizer"), state_bytes(held_numel(units, dims, rank), tensors, work)))


# ---- communication ---------------------------------------------------------------------------


@lru_cache(maxsize=8)  # every pipeline rank of a folding reads the same (read-only) geometry
def mesh_geometry(dims: MoEParallelDims) -> dict[str, tuple[int, int]]:
    """(group size, rank stride) of every mesh axis, from the mesh order (row-major, last axis innermost)."""
    geo = {}
    for axes, shape in ((DENSE_AXES, dims.dense_shape), (EXPERT_AXES, dims.expert_shape)):
        stride = 1
        for axis, size in zip(reversed(axes), reversed(shape)):
            geo[axis] = (size, stride)
            stride *= size
    geo["pp"] = (dims.pp, dims.stage_size)
    geo["dp_shard_cp"] = (dims.dp_shard * dims.cp, geo["cp"][1])  # the flattened (dp_shard, cp) pair
    # The MoE's dense axis: every rank of a replica (tp is innermost, so consecutive ranks).
    geo["dp_shard_tp"] = geo["dp_shard_cp_tp"] = (dims.dp_shard * dims.cp * dims.tp, 1)
    return geo


def pairwise_intra_fraction(size: int, stride: int, G: int) -> float:
    """Share of a rank's peers (rank 0's group) that sit on its node: members are 0, s, 2s, ..."""
    if size == 1:
        return 0.0
    on_node = min(size, -(-G // stride)) if stride < G else 1
    return (on_node - 1) / (size - 1)


def node_span(size: int, stride: int, G: int) -> int:
    """Nodes of `G` GPUs that rank 0's group (members 0, s, 2s, ...) touches."""
    return size if stride >= G else (size - 1) * stride // G + 1


def ring_inter_fraction(size: int, stride: int, G: int) -> float:
    """Share of ring hops (rank 0's group, in rank order) that cross a node boundary."""
    nodes = node_span(size, stride, G)
    return 0.0 if nodes == 1 else nodes / size


def chain_inter_fraction(size: int, stride: int, G: int) -> float:
    """Share of the hops between neighbours of a chain (the pipeline, no wrap-around) that cross a node."""
    return 0.0 if size == 1 else (node_span(size, stride, G) - 1) / (size - 1)


class Traffic(NamedTuple):  # a tuple: built a dozen times per folding, tens of thousands of foldings
    intra: float
    inter: float


@lru_cache(maxsize=1024)
def distinct_ranks(num_experts: int, top_k: int, ep: int, groups: int = 1, limited: int = 1) -> float:
    """Expected EP ranks a token's top-k experts land on under uniform routing: the rows the
    dispatch sends per token, and the combine returns. Group-limited routing (`limited` of
    `groups` groups uniformly, then top_k experts uniformly among theirs) sends fewer when the
    groups align with the ranks (each rank inside one group, or holding whole groups): with
    groups == ep at most `limited` ranks. Groups that straddle ranks are priced as ungrouped."""
    if groups % ep and ep % groups:
        groups = limited = 1
    per_rank, per_group = num_experts // ep, num_experts // groups
    pool = limited * per_group

    def hit(candidates: int) -> float:  # P(some of the top_k land on `candidates` of the pool)
        return 1 - math.comb(pool - candidates, top_k) / math.comb(pool, top_k)

    if ep % groups == 0:  # a rank lies inside one group and can be hit only if that group is kept
        return ep * limited / groups * hit(per_rank)
    g = groups // ep  # whole groups per rank, of which j are kept (hypergeometric)
    return ep * sum(math.comb(g, j) * math.comb(groups - g, limited - j) / math.comb(groups, limited) * hit(j * per_group)
                    for j in range(min(g, limited) + 1))


class Held(NamedTuple):
    """What a pipeline rank costs through the weights it holds, whatever its tokens: state and
    working-set bytes, FSDP's and HSDP's traffic. It depends on the folding only through
    footprint_key and pp (the sizes and strides of the axes it is sharded and replicated over follow
    from them), so a search computes it once per (footprint_key, pp) and pipeline rank."""

    rank: PipelineRank
    fp: Footprint
    memory: tuple[int, int, int, int]  # params, grads, optimizer state, gathered working set
    traffic: dict[str, Traffic]  # fsdp_all_gather, fsdp_reduce_scatter, hsdp_all_reduce


def held_costs(dims: MoEParallelDims, work: Workload, gpus_per_node: int, fp: Footprint, rank: PipelineRank) -> Held:
    return ranks_held_costs(dims, work, gpus_per_node, ((rank, fp),))[0]


def ranks_held_costs(dims: MoEParallelDims, work: Workload, gpus_per_node: int,
                     ranks: Iterable[tuple[PipelineRank, Footprint]]) -> tuple[Held, ...]:
    """held_costs of each (pipeline rank, its footprint) of one folding, the folding's geometry read once.
    FSDP all-gathers (compute dtype) and reduce-scatters (fp32) ring over each axis a unit is sharded
    on; HSDP all-reduces the sharded gradients over dp_replicate."""
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
        out.append(Held(rank, fp, _held_memory(work, dims.pp, fp), traffic))
    return tuple(out)


@lru_cache(maxsize=64)
def _attention_width(spec: ModelSpec) -> int:
    """Inputs plus outputs of one layer's attention linears per token: attention sees the whole CP
    part of the sequence (tp times T tokens) with 1/tp of the heads."""
    return sum(s[0] + s[-1] for _, s in spec.attention if len(s) == 2)


class Rates(NamedTuple):
    """What one folding's tokens cost per unit of a pipeline rank's share (per layer, per send), with
    the node fractions of the groups they cross: computed once per folding, shared by its pipeline
    ranks (`memory_of`, `traffic_of`). Integer products are exact whichever factor comes last; the
    float ones keep the operand order of the per-rank formula."""

    # activations (bytes)
    recompute: bool
    block_input: int  # one layer's saved input per microbatch: T * D * b
    moe_layer: int
    dense_layer: int
    logits: int
    logits_grad: int
    # traffic (bytes per step and unit, and the share of it crossing nodes)
    send: int  # per stage-boundary send per microbatch
    send_inter: float
    routed: float  # dispatched + combined rows per MoE layer, before the ep / etp factor
    ep: int
    ep_inter: float
    etp: int
    etp_inter: float
    seq: int  # per sequence-parallel gather / scatter
    seq_per_layer: int
    tp_inter: float
    kv: int  # per layer
    cp_inter: float


def rates(spec: ModelSpec, dims: MoEParallelDims, work: Workload, gpus_per_node: int = 8) -> Rates:
    G, b, M = gpus_per_node, work.compute_bytes, work.microbatches
    T, D, k = tokens_per_rank(work, dims), spec.dim, spec.top_k
    recompute = work.recompute == "full"
    common = T * b * 3 * D + T * b * _attention_width(spec)  # two norm inputs and the residual, plus attention
    moe = k * (2 * dims.etp * D + 3 * spec.moe_hidden_dim) + 3 * spec.moe_hidden_dim * spec.num_shared_experts
    # Dispatch and combine (a token once per rank holding one of its experts, each way) in forward,
    # their reverses in backward, forward again when recomputing.
    rows = 2 * distinct_ranks(spec.num_experts, spec.top_k, dims.ep, spec.num_expert_groups, spec.num_limited_groups)
    # (size, stride) of the groups as mesh_geometry has them (etp innermost, then ep; tp innermost,
    # then cp; stages outermost), without building it: once per folding of a search.
    return Rates(
        recompute,
        block_input=T * D * b,
        moe_layer=common + T * b * moe + T * spec.num_experts * 4,  # fp32 router scores
        dense_layer=common + T * b * 3 * spec.dense_hidden_dim,
        # Logits (replicated over tp) and their fp32 copy for the loss per microbatch; one gradient of them.
        logits=T * dims.tp * spec.vocab_size * (b + 4), logits_grad=T * dims.tp * spec.vocab_size * 4,
        send=M * T * D * b,  # hidden states under SP: the rank's T tokens
        send_inter=chain_inter_fraction(dims.pp, dims.stage_size, G),
        routed=M * (2 + recompute) * T * rows * D * b,
        ep=dims.ep, ep_inter=1 - pairwise_intra_fraction(dims.ep, dims.etp, G),
        etp=dims.etp, etp_inter=1 - pairwise_intra_fraction(dims.etp, 1, G),
        # Sequence parallelism: each block's attention all-gathers its input and reduce-scatters its output
        # (the reverses in backward, again when recomputing); the embedding and the head once each way.
        seq=M * (dims.tp - 1) * T * D * b, seq_per_layer=4 + 2 * recompute,
        tp_inter=ring_inter_fraction(dims.tp, 1, G),
        # The K/V of the CP part (tp * T tokens, 1/tp of the heads) pass to every CP peer.
        kv=M * (3 + recompute) * (dims.cp - 1) * T * spec.kv_width * b,
        cp_inter=ring_inter_fraction(dims.cp, dims.tp, G),
    )


def comm_bytes(spec: ModelSpec, dims: MoEParallelDims, work: Workload, gpus_per_node: int, fp: Footprint,
               rank: PipelineRank | None = None) -> dict[str, Traffic]:
    """Bytes one (pipeline) rank sends per step, per collective kind, split intra-/inter-node."""
    held = held_costs(dims, work, gpus_per_node, fp, rank or _whole_model(spec))
    return traffic_of(rates(spec, dims, work, gpus_per_node), held)


def traffic_of(r: Rates, held: Held) -> dict[str, Traffic]:
    return {**token_traffic(r, held.rank), **held.traffic}


def token_traffic(r: Rates, rank: PipelineRank) -> dict[str, Traffic]:
    """What a pipeline rank's tokens send: its traffic but the weights' (`Held.traffic`)."""
    s, routed = rank.share, r.routed * rank.share.moe_layers
    return {
        "pp_send_recv": _part(rank.sends * r.send, r.send_inter),
        "ep_all_to_all": _part(routed * (r.ep - 1) / r.ep, r.ep_inter),
        "etp_gather_scatter": _part(routed * (r.etp - 1), r.etp_inter),
        "tp_sequence": _part((r.seq_per_layer * s.layers + 2 * (s.first + s.last)) * r.seq, r.tp_inter),
        "cp_ring_kv": _part(s.layers * r.kv, r.cp_inter),
    }


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


def _part(total: float, inter_fraction: float) -> Traffic:
    """`total` bytes split intra-/inter-node."""
    return Traffic(total * (1 - inter_fraction), total * inter_fraction) if total else Traffic(0, 0)


def _whole_model(spec: ModelSpec) -> PipelineRank:
    return PipelineRank(StageShare(spec.n_dense_layers, spec.n_moe_layers, True, True), 1, 0)
