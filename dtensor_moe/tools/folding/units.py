"""What a rank holds of the weights: the FSDP units of its share of the model, their weight plans, and
rank 0's `Footprint` (rank 0 holds the largest slices).

Every number comes from the placement plan: MoE weights from `plan_moe`, the other weights from
what `parallelize_transformer` does to them (under tp every 2-D weight split over tp -- attention by heads,
embedding and head by vocabulary -- and 1-D ones replicated; then FSDP2 Shard(0) over the dense
data-parallel axis, dp_shard or dp_shard_cp). Plans read only a few sizes of the folding, so a
search memoizes them in its `CostCache` on those sizes and the model.
"""

import math
from dataclasses import dataclass, replace
from typing import NamedTuple

from dtensor_moe.parallel.mesh import MoEParallelDims
from dtensor_moe.parallel.placement import ShardStep, WeightPlan, axis_sizes, owned_box, plan_moe
from dtensor_moe.tools.folding.cache import CostCache
from dtensor_moe.tools.folding.pipeline import StageShare
from dtensor_moe.tools.presets import ModelShape


@dataclass(frozen=True)
class Unit:
    """One FSDP unit repeated `count` times (root, dense blocks, MoE blocks)."""

    name: str
    count: int
    plans: tuple[WeightPlan, ...]
    gathers_per_step: int  # all-gathers of its params per step


class Footprint(NamedTuple):  # a tuple: one per pipeline rank of every (footprint_key, pp) of a search
    """Rank 0's share of every FSDP unit: all the cost model needs of the weights."""

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


# ---- weight plans ----------------------------------------------------------------------------


def _fsdp_plan(name: str, shape: tuple[int, ...], dims: MoEParallelDims, axis: str) -> WeightPlan:
    """What parallelize_transformer does to a weight outside the MoE: under tp a 2-D weight is split over
    tp (1-D ones replicated), then `fully_shard` takes Shard(0) of the local slice over `axis`."""
    split = dims.tp > 1 and len(shape) == 2
    steps = (ShardStep("tp", 0),) * split + (ShardStep(axis, 0),)
    replicate = ("dp_replicate",) + ("tp",) * (dims.tp > 1 and not split)
    wp = WeightPlan(name, "dense", shape, steps, replicate, shape, False)
    local = tuple(s.stop - s.start for s in owned_box(wp, dims, 0))
    before = -(-shape[0] // dims.tp) if split else shape[0]
    return replace(wp, local_shape=local, padded=before % axis_sizes(dims)[axis] != 0)


def _dense_stage(tp: int, axis: str, size: int) -> MoEParallelDims:
    """The smallest stage whose dense FSDP axis is `axis` of `size` ranks (dp_shard, or cp, = size)."""
    return MoEParallelDims(size * tp, cp=size if axis == "dp_shard_cp" else 1, tp=tp)


def _dense_axis(dims: MoEParallelDims) -> tuple[str, int]:
    """parallelize_transformer's FSDP axis for the dense weights (MoEMeshes.dp) and its size; the MoE's own
    axis includes tp."""
    return ("dp_shard_cp", dims.dp_shard * dims.cp) if dims.cp > 1 else ("dp_shard", dims.dp_shard)


def _outer_plans(spec: ModelShape, tp: int, axis: str, size: int, cache: CostCache):
    """Plans of the non-MoE weights (root, dense block, MoE block). They read only tp and their FSDP
    axis, so they are planned once per (tp, axis, its size), on the smallest stage with those."""

    def make():
        dims = _dense_stage(tp, axis, size)
        weights = (*spec.root_weights(), *spec.layer_weights(dense_ffn=True))
        plans = {n: _fsdp_plan(n, s, dims, axis) for n, s in weights}

        def of(ws):
            return tuple(plans[n] for n, _ in ws)

        return of(spec.root_weights()), of(spec.layer_weights(dense_ffn=True)), of(spec.layer_weights(dense_ffn=False))

    return cache.outer_plans.get_or_make((spec, tp, axis, size), make)


def _moe_plans(spec: ModelShape, dims: MoEParallelDims, cache: CostCache) -> tuple[WeightPlan, ...]:
    # What plan_moe reads: the sizes of the axes it shards over.
    key = spec, dims.ep, dims.etp, dims.edp, dims.moe_dp_axis, dims.dp_shard * dims.cp * dims.tp
    return cache.moe_plans.get_or_make(key, lambda: tuple(plan_moe(spec.moe, dims)))


def _gathers(dims: MoEParallelDims, microbatches: int) -> tuple[int, int]:
    """All-gathers per step of the root unit (kept gathered after forward; under pp also after
    backward, so gathered once a step) and of a block unit (forward and backward of each microbatch)."""
    return microbatches if dims.pp == 1 else 1, 2 * microbatches


# ---- units -----------------------------------------------------------------------------------


def fsdp_units(spec: ModelShape, dims: MoEParallelDims, share: StageShare | None = None, microbatches: int = 1,
               cache: CostCache | None = None) -> tuple[Unit, ...]:
    """The FSDP units of `share` (default: the whole model) with their all-gathers per step."""
    cache = CostCache() if cache is None else cache
    share = share or StageShare(spec.n_dense_layers, spec.n_moe_layers, True, True)
    moe_plans = _moe_plans(spec, dims, cache)
    root, dense_block, moe_block = _outer_plans(spec, dims.tp, *_dense_axis(dims), cache)
    root_gathers, block_gathers = _gathers(dims, microbatches)
    if not (share.first and share.last):  # a pipeline stage: the ends it holds
        held_root = {n for n, _ in spec.root_weights(share.first, share.last)}
        root = tuple(wp for wp in root if wp.name in held_root)
    units = []
    if root:
        units.append(Unit("root", 1, root, root_gathers))
    if share.n_dense_layers:
        units.append(Unit("dense block", share.n_dense_layers, dense_block, block_gathers))
    if share.n_moe_layers:
        units.append(Unit("moe block", share.n_moe_layers, (*moe_block, *moe_plans), block_gathers))
    return tuple(units)


def held_numel(units, dims: MoEParallelDims, rank: int) -> int:
    """Elements of all parameters that `rank` holds (its owned boxes)."""
    return sum(u.count * math.prod(s.stop - s.start for s in owned_box(wp, dims, rank))
               for u in units for wp in u.plans)


# ---- footprints ------------------------------------------------------------------------------


def unit_part(u: Unit, dims: MoEParallelDims) -> UnitPart:
    """One copy of unit `u` on rank 0 of `dims`: its plans' local elements summed per (FSDP axis, all-gathers per
    step), its tensors, and the elements its all-gathers materialize (rank 0's slice, the largest, times its FSDP
    axis's size)."""
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
    """Rank 0's `Footprint` of `units` (`fsdp_units` of a share of the model) under folding `dims`: their
    `unit_part`s combined, the root unit's apart."""
    return combine((u.name == "root", u.count, unit_part(u, dims)) for u in units)


def share_parts(spec: ModelShape, dims: MoEParallelDims, microbatches: int = 1, cache: CostCache | None = None
                ) -> dict[str, UnitPart]:
    """One copy of each unit a pipeline rank can hold, the root split into the embedding and the head
    (the search combines them per share instead of re-reading the plans), from parts memoized on what
    the plans read."""
    cache = CostCache() if cache is None else cache
    root_gathers, block_gathers = _gathers(dims, microbatches)
    embedding, head, dense_block, attention = _outer_parts(spec, dims.tp, *_dense_axis(dims), root_gathers,
                                                           block_gathers, cache)
    return {"embedding": embedding, "head": head, "dense block": dense_block,
            "moe block": _join(attention, _moe_part(spec, dims, block_gathers, cache))}


def _outer_parts(spec: ModelShape, tp: int, axis: str, size: int, root_gathers: int, block_gathers: int,
                 cache: CostCache):
    """share_parts of the weights outside the MoE: the embedding, the head, a dense block, a MoE
    block's attention."""

    def make():
        dims = _dense_stage(tp, axis, size)
        root, dense_block, moe_block = _outer_plans(spec, tp, axis, size, cache)
        embedding = {n for n, _ in spec.root_weights(first=True, last=False)}

        def part(plans, gathers):
            return unit_part(Unit("", 1, plans, gathers), dims)

        return (part(tuple(wp for wp in root if wp.name in embedding), root_gathers),
                part(tuple(wp for wp in root if wp.name not in embedding), root_gathers),
                part(dense_block, block_gathers), part(moe_block, block_gathers))

    return cache.outer_parts.get_or_make((spec, tp, axis, size, root_gathers, block_gathers), make)


def _moe_part(spec: ModelShape, dims: MoEParallelDims, gathers: int, cache: CostCache) -> UnitPart:
    """unit_part of one MoE block's MoE weights. plan_moe reads their dense axis (moe_dp_axis, every
    rank of a replica with its own tokens: ep * etp * edp of them) for its name and size only, so the
    part is planned once per (ep, etp, edp), on the stage where that axis is dp_shard, and renamed."""
    ep, etp, edp, axis = dims.ep, dims.etp, dims.edp, dims.moe_dp_axis

    def make():
        stage = MoEParallelDims(ep * etp * edp, ep=ep, etp=etp)
        return unit_part(Unit("moe", 1, _moe_plans(spec, stage, cache), gathers), stage)

    part = cache.moe_parts.get_or_make((spec, ep, etp, edp, gathers), make)
    if axis == "dp_shard":
        return part
    return part._replace(sharded=tuple(((axis if a == "dp_shard" else a, g), n) for (a, g), n in part.sharded))


def _join(a: UnitPart, b: UnitPart) -> UnitPart:
    """The part of a unit holding a's plans then b's: unit_part of the concatenation."""
    sharded = dict(a.sharded)
    for key, n in b.sharded:
        sharded[key] = sharded.get(key, 0) + n
    return UnitPart(tuple(sharded.items()), a.tensors + b.tensors, a.gathered + b.gathered)


def share_footprint(parts: dict[str, UnitPart], share: StageShare) -> Footprint:
    """footprint(fsdp_units(spec, dims, share, microbatches), dims) from `share_parts`."""
    return combine(((True, 1, parts["embedding"]),) * share.first + ((True, 1, parts["head"]),) * share.last
                   + ((False, share.n_dense_layers, parts["dense block"]),) * (share.n_dense_layers > 0)
                   + ((False, share.n_moe_layers, parts["moe block"]),) * (share.n_moe_layers > 0))
