"""The placement plan: the one place that decides which rank owns which slice of each weight.

Pipeline stages (`stage_layers`, `rank_layers`): stage s of pp * stages-per-rank holds a contiguous
run of layers and rank r of the pipeline the stages r, r + pp, ...; `check_pipeline` says what a
schedule needs.

Plain data. `parallelize_moe` applies it, the ownership checks and the CLI (`plan`, `explain`)
read it; nothing else decides placements.

Expert weights shard in this order: EP splits experts (dim 0), ETP splits the expert hidden dim F
(dim 2 of w13 [E, 2, F, D], w2 [E, D, F] and b13 [E, 2, F]; b2 [E, D] has no F and is replicated over ETP), then
FSDP2 splits the local slice over EDP along a dim chosen so that no padding is needed, replicated
over dp_replicate (HSDP). Dense weights (router, shared experts) are FSDP-sharded over every rank
with its own tokens (`MoEParallelDims.moe_dp_axis`: data-parallel, CP and, under sequence
parallelism, TP ranks): they stay whole over tp, so the MoE's input needs no all-gather over tp and
its output no reduce-scatter.
"""

import math
from dataclasses import dataclass, replace

from dtensor_moe.config import MoEConfig
from dtensor_moe.parallel.mesh import PP_STAGES_PER_RANK, MoEParallelDims, divisors

__all__ = [
    "plan_moe", "WeightPlan", "ShardStep", "owned_box", "ownership", "Ownership", "rank_coords", "check_pipeline",
    "stage_layers", "rank_layers",
]


@dataclass(frozen=True)
class ShardStep:
    """One step of a weight's placement: split tensor dim `dim` over mesh axis `axis`.

    Attributes:
        axis (str): the mesh axis's name ("ep", "etp", "edp", or a dense data-parallel axis such as
            "dp_shard").
        dim (int): the tensor dim split over that axis, applied to the slice the earlier steps left
            (torch.chunk's split: ceil-sized chunks, the last ones short or empty).

    Example:
        >>> from dtensor_moe import MoEConfig, MoEParallelDims, plan_moe
        >>> plan_moe(MoEConfig(dim=8, hidden_dim=16, num_experts=4, top_k=2),
        ...          MoEParallelDims(world_size=8, ep=2, etp=2))[0].steps  # experts.w13 [E, 2, F, D]
        (ShardStep(axis='ep', dim=0), ShardStep(axis='etp', dim=2), ShardStep(axis='edp', dim=0))
    """

    axis: str
    dim: int


@dataclass(frozen=True)
class WeightPlan:
    """The placement of one parameter of an `MoE` layer, as `plan_moe` decides it: which slice each rank
    holds follows from `steps` alone (`owned_box`), and every element is held once per replica
    (`ownership` checks it).

    Attributes:
        name (str): the parameter's name relative to the MoE module, e.g. "experts.w13".
        role (str): "expert" (sharded over ep, etp, edp) or "dense" (router, shared experts: sharded over
            the data-parallel ranks).
        global_shape (tuple[int, ...]): the full parameter's shape.
        steps (tuple[ShardStep, ...]): the splits, in application order; the last is FSDP2's.
        replicate_axes (tuple[str, ...]): the mesh axes that hold full copies of each slice.
        local_shape (tuple[int, ...]): the slice rank 0 holds, the largest.
        padded (bool): FSDP2 pads the last slices (no dim split evenly).

    Example:
        >>> from dtensor_moe import MoEConfig, MoEParallelDims, plan_moe
        >>> w13 = plan_moe(MoEConfig(dim=8, hidden_dim=16, num_experts=4, top_k=2),
        ...                MoEParallelDims(world_size=8, ep=2, etp=2))[0]
        >>> w13.name, w13.global_shape, w13.local_shape
        ('experts.w13', (4, 2, 16, 8), (1, 2, 8, 8))
        >>> w13.placements()
        {'dp_replicate': 'Replicate()', 'ep': 'Shard(0)', 'etp': 'Shard(2)', 'edp': 'Shard(0) of local'}
    """

    name: str
    role: str
    global_shape: tuple[int, ...]
    steps: tuple[ShardStep, ...]
    replicate_axes: tuple[str, ...]
    local_shape: tuple[int, ...]
    padded: bool

    @property
    def fsdp_step(self) -> ShardStep:
        return self.steps[-1]

    def step_on(self, axis: str) -> ShardStep | None:
        return next((s for s in self.steps if s.axis == axis), None)

    @property
    def numel(self) -> int:
        return math.prod(self.global_shape)

    def placements(self) -> dict[str, str]:
        """Human-readable placement per mesh axis, e.g. {"ep": "Shard(0)", "edp": "Shard(0) of local"}."""
        out = {a: "Replicate()" for a in self.replicate_axes}
        for i, s in enumerate(self.steps):
            out[s.axis] = f"Shard({s.dim})" + (" of local" if i == len(self.steps) - 1 and i > 0 else "")
        return out


def _chunk(start: int, stop: int, parts: int, idx: int) -> tuple[int, int]:
    """torch.chunk semantics (used by DTensor and FSDP2): ceil-sized chunks, trailing ones short or empty."""
    size = -(-(stop - start) // parts)
    lo = min(start + idx * size, stop)
    return lo, min(lo + size, stop)


def fsdp_dim(local_shape: tuple[int, ...], parts: int, prefer: tuple[int, ...]) -> int:
    """First dim in `prefer` that splits evenly over `parts`; dim 0 (FSDP pads it) if none does."""
    for d in prefer:
        if local_shape[d] % parts == 0:
            return d
    return 0


def _validate(config: MoEConfig, dims: MoEParallelDims):
    E, F = config.num_experts, config.hidden_dim
    if E % dims.ep != 0:
        valid = [d for d in divisors(dims.dp_shard * dims.cp * dims.tp) if E % d == 0]
        raise ValueError(
            f"num_experts ({E}) must be divisible by ep ({dims.ep}) so each EP rank owns whole experts; "
            f"valid ep for this world: {valid}"
        )
    if F % dims.etp != 0:
        valid = [d for d in divisors(dims.dp_shard * dims.cp * dims.tp // dims.ep) if F % d == 0]
        raise ValueError(
            f"hidden_dim ({F}) must be divisible by etp ({dims.etp}) so each ETP rank owns an equal F slice; "
            f"valid etp with ep={dims.ep}: {valid}"
        )


def _local_shape(global_shape, steps, sizes) -> tuple[int, ...]:
    shape = list(global_shape)
    for s in steps:
        lo, hi = _chunk(0, shape[s.dim], sizes[s.axis], 0)
        shape[s.dim] = hi - lo
    return tuple(shape)


def axis_sizes(dims: MoEParallelDims) -> dict[str, int]:
    return {
        "dp_replicate": dims.dp_replicate,
        "dp_shard": dims.dp_shard,
        "dp_shard_cp": dims.dp_shard * dims.cp,
        "cp": dims.cp,
        "tp": dims.tp,
        "dp_shard_tp": dims.dp_shard * dims.tp,
        "dp_shard_cp_tp": dims.dp_shard * dims.cp * dims.tp,
        "edp": dims.edp,
        "ep": dims.ep,
        "etp": dims.etp,
    }


def rank_coords(dims: MoEParallelDims, rank: int) -> dict[str, int]:
    """A rank's coordinate on every mesh axis a placement step can name: the dense mesh's, the expert mesh's
    and the flattened data-parallel axes (dp_shard_cp, dp_shard_tp, dp_shard_cp_tp).

    Args:
        dims (MoEParallelDims): the degrees.
        rank (int): a global rank; with pp > 1 its coordinates inside its pipeline stage.

    Returns:
        dict[str, int]: axis name -> the rank's index along that axis (the keys of `axis_sizes`).

    Example:
        >>> from dtensor_moe import MoEParallelDims
        >>> from dtensor_moe.parallel.placement import rank_coords
        >>> c = rank_coords(MoEParallelDims(world_size=8, tp=2, ep=2), rank=5)
        >>> c["dp_shard"], c["tp"], c["edp"], c["ep"], c["dp_shard_tp"]
        (2, 1, 2, 1, 5)
    """
    c = {**dims.dense_coords(rank), **dims.expert_coords(rank)}
    c["dp_shard_cp"] = c["dp_shard"] * dims.cp + c["cp"]
    c["dp_shard_tp"] = c["dp_shard"] * dims.tp + c["tp"]
    c["dp_shard_cp_tp"] = c["dp_shard_cp"] * dims.tp + c["tp"]
    return c


def _weight(name, role, shape, steps, replicate, sizes) -> WeightPlan:
    *pre, last = steps
    local_before = _local_shape(shape, pre, sizes)
    return WeightPlan(
        name=name,
        role=role,
        global_shape=tuple(shape),
        steps=tuple(steps),
        replicate_axes=replicate,
        local_shape=_local_shape(shape, steps, sizes),
        padded=local_before[last.dim] % sizes[last.axis] != 0,
    )


def plan_moe(config: MoEConfig, dims: MoEParallelDims) -> tuple[WeightPlan, ...]:
    """The placement plan of one `MoE` layer: which rank holds which slice of each of its parameters.

    The single source of truth for placements: `parallelize_moe` / `ExpertParallel` shard by it, and the
    checkpoints, the folding search and `dtensor-moe explain` read it. Expert weights split E over EP, F over
    ETP, then FSDP2 splits the local slice over EDP along a dim that needs no padding where one exists,
    replicated over dp_replicate (HSDP); the router and shared experts are FSDP-sharded over every rank
    with its own tokens (`MoEParallelDims.moe_dp_axis`). Plain data: no torch, no collective.

    Args:
        config (MoEConfig): the layer.
        dims (MoEParallelDims): the degrees; num_experts must be divisible by ep and hidden_dim by etp.

    Returns:
        tuple[WeightPlan, ...]: one plan per parameter, named relative to the MoE module (experts first).

    Raises:
        ValueError: the degrees do not fit the layer (naming the valid ones).

    Example:
        >>> from dtensor_moe import MoEConfig, MoEParallelDims, plan_moe
        >>> plans = plan_moe(MoEConfig(dim=8, hidden_dim=16, num_experts=4, top_k=2, num_shared_experts=1),
        ...                  MoEParallelDims(world_size=4, ep=2))
        >>> [(wp.name, wp.local_shape) for wp in plans][:3]
        [('experts.w13', (1, 2, 16, 8)), ('experts.w2', (1, 8, 16)), ('router.gate.weight', (1, 8))]
    """
    _validate(config, dims)
    sizes = axis_sizes(dims)
    E, F, D = config.num_experts, config.hidden_dim, config.dim
    plans = []
    # (name, shape, F dim, FSDP's dims by preference: experts, then D, then F; never w13's gate / up dim)
    experts = [("experts.w13", (E, 2, F, D), 2, (0, 3, 2)), ("experts.w2", (E, D, F), 2, (0, 1, 2))]
    if config.expert_biases:
        # b2 is added after ETP's sum of partial outputs: every ETP rank holds all of it (and adds it once).
        experts += [("experts.b13", (E, 2, F), 2, (0, 2)), ("experts.b2", (E, D), None, (0, 1))]
    for name, shape, f_dim, prefer in experts:
        model_steps = [ShardStep("ep", 0)] + ([ShardStep("etp", f_dim)] if f_dim is not None else [])
        local = _local_shape(shape, model_steps, sizes)
        d = fsdp_dim(local, dims.edp, prefer=prefer)
        replicate = ("dp_replicate",) if f_dim is not None else ("dp_replicate", "etp")
        plans.append(_weight(name, "expert", shape, [*model_steps, ShardStep("edp", d)], replicate, sizes))
    dense = [("router.gate.weight", (E, D))] + ([("router.gate.bias", (E,))] if config.router_bias else [])
    if config.num_shared_experts:
        Fs = F * config.num_shared_experts
        dense += [
            ("shared_experts.w1.weight", (Fs, D)),
            ("shared_experts.w2.weight", (D, Fs)),
            ("shared_experts.w3.weight", (Fs, D)),
        ]
    dp_axis = dims.moe_dp_axis
    for name, shape in dense:
        d = fsdp_dim(shape, sizes[dp_axis], prefer=tuple(range(len(shape))))
        plans.append(_weight(name, "dense", shape, [ShardStep(dp_axis, d)], ("dp_replicate",), sizes))
    return tuple(plans)


def select_gate_up(wp: WeightPlan, half: int, name: str) -> WeightPlan:
    """The plan of w13[:, half] (b13[:, half]) as a weight of its own, named `name`: torchtitan's and Hugging
    Face's w1 / w3 (gate / up), which hold what each rank's w13 slice holds of them (dim 1 is never split)."""
    if any(s.dim == 1 for s in wp.steps) or half not in (0, 1):
        raise ValueError(f"{wp.name}: dim 1 is split or half {half} is not 0 or 1; no per-half plan")

    def drop(shape):
        return (shape[0], *shape[2:])

    steps = tuple(ShardStep(s.axis, s.dim - (s.dim > 1)) for s in wp.steps)
    return replace(wp, name=name, global_shape=drop(wp.global_shape), steps=steps, local_shape=drop(wp.local_shape))


def split_gate_up_plans(plans: tuple[WeightPlan, ...]) -> tuple[WeightPlan, ...]:
    """`plans` with experts.w13 / b13 replaced by experts.w1, w3 / b1, b3 (select_gate_up): the layout of
    torchtitan's experts and of Hugging Face checkpoints."""
    out = []
    for wp in plans:
        if wp.name in ("experts.w13", "experts.b13"):
            kind = wp.name.removeprefix("experts.")[0]  # w or b
            out += [select_gate_up(wp, half, f"experts.{kind}{1 + 2 * half}") for half in (0, 1)]
        else:
            out.append(wp)
    return tuple(out)


def owned_box(wp: WeightPlan, dims: MoEParallelDims, rank: int) -> tuple[slice, ...]:
    """The slice of a parameter's full tensor that one rank holds, from the plan alone.

    Each of `wp.steps` chunks the slice the earlier ones left, as DTensor and FSDP2 do.

    Args:
        wp (WeightPlan): the parameter's plan (from `plan_moe`).
        dims (MoEParallelDims): the degrees the plan was made for.
        rank (int): a global rank; with pp > 1 its coordinates inside its pipeline stage count.

    Returns:
        tuple[slice, ...]: one slice per dim of `wp.global_shape`: `full[box]` is the rank's local tensor
        (empty slices where FSDP2's padding leaves a rank nothing).

    Example:
        >>> from dtensor_moe import MoEConfig, MoEParallelDims, owned_box, plan_moe
        >>> dims = MoEParallelDims(world_size=4, ep=2, etp=2)
        >>> w13 = plan_moe(MoEConfig(dim=8, hidden_dim=16, num_experts=4, top_k=2), dims)[0]
        >>> owned_box(w13, dims, rank=3)
        (slice(2, 4, None), slice(0, 2, None), slice(8, 16, None), slice(0, 8, None))
    """
    coords = rank_coords(dims, rank)
    sizes = axis_sizes(dims)
    box = [(0, n) for n in wp.global_shape]
    for s in wp.steps:
        box[s.dim] = _chunk(*box[s.dim], sizes[s.axis], coords[s.axis])
    return tuple(slice(lo, hi) for lo, hi in box)


@dataclass(frozen=True)
class Ownership:
    """How the ranks of a pipeline stage hold one parameter, counted by `ownership` from its plan.

    Attributes:
        name (str): the parameter's name relative to the MoE module.
        numel (int): the full parameter's elements.
        copies (int): how many ranks hold each element (the product of the replicate axes' sizes,
            the same for every element).
        max_rank_numel (int): the most elements one rank holds.
        min_rank_numel (int): the fewest elements one rank holds.
        shard_factor (int): the product of the shard degrees applied (EP * ETP * EDP for experts).

    Example:
        >>> from dtensor_moe import MoEConfig, MoEParallelDims, ownership, plan_moe
        >>> dims = MoEParallelDims(world_size=4, dp_replicate=2, ep=2)
        >>> w2 = plan_moe(MoEConfig(dim=8, hidden_dim=16, num_experts=4, top_k=2), dims)[1]
        >>> ownership(w2, dims)
        Ownership(name='experts.w2', numel=512, copies=2, max_rank_numel=256, min_rank_numel=256, shard_factor=2)
    """

    name: str
    numel: int
    copies: int
    max_rank_numel: int
    min_rank_numel: int
    shard_factor: int

    @property
    def exact(self) -> bool:
        """Per-rank elements == numel / shard_factor on every rank."""
        return self.max_rank_numel == self.min_rank_numel == self.numel // self.shard_factor and (
            self.numel % self.shard_factor == 0
        )


def ownership(wp: WeightPlan, dims: MoEParallelDims) -> Ownership:
    """Counts, from the plan alone, how many ranks hold each element of the weight, and checks the count.

    Args:
        wp (WeightPlan): the parameter's plan (from `plan_moe`).
        dims (MoEParallelDims): the degrees the plan was made for.

    Returns:
        Ownership: the copies of each element and the elements per rank.

    Raises:
        ValueError: some element is held by a number of ranks other than the product of the replicate
            axes' sizes (double sharding or a hole).

    Example:
        >>> from dtensor_moe import MoEConfig, MoEParallelDims, ownership, plan_moe
        >>> dims = MoEParallelDims(world_size=8, ep=2, etp=2)
        >>> own = ownership(plan_moe(MoEConfig(dim=8, hidden_dim=16, num_experts=4, top_k=2), dims)[0], dims)
        >>> own.copies, own.shard_factor, own.exact
        (1, 8, True)
    """
    sizes = axis_sizes(dims)
    want = math.prod(sizes[a] for a in wp.replicate_axes)
    vols, total = [], 0
    # Each element is held `want` times iff the boxes of every replica tile the tensor and the
    # volumes of all ranks' boxes add up to numel * want (no rank duplicates another).
    groups: dict[tuple, list] = {}
    for r in range(dims.stage_size):
        box = owned_box(wp, dims, r)
        vol = math.prod(s.stop - s.start for s in box)
        vols.append(vol)
        total += vol
        coords = rank_coords(dims, r)
        groups.setdefault(tuple(coords[a] for a in wp.replicate_axes), []).append(box)
    copies, rem = divmod(total, wp.numel)
    if rem or copies != want or not all(_tiles(b, wp.global_shape) for b in groups.values()):
        raise ValueError(f"{wp.name}: placement plan does not cover each element exactly {want} times "
                         f"(replicated over {list(wp.replicate_axes)})")
    factor = math.prod(sizes[s.axis] for s in wp.steps)
    return Ownership(wp.name, wp.numel, copies, max(vols), min(vols), factor)


def _tiles(boxes, shape) -> bool:
    """True if the non-empty boxes of one replica tile the tensor exactly (no overlap, no hole).

    Each box is a product of per-dim intervals; they tile iff every dim's distinct intervals
    partition [0, n) and the distinct boxes are exactly the grid those partitions span."""
    nonempty = {tuple((s.start, s.stop) for s in b) for b in boxes if all(s.stop > s.start for s in b)}
    grid = 1
    for d, n in enumerate(shape):
        ivals = sorted({b[d] for b in nonempty})
        if not ivals or ivals[0][0] != 0 or ivals[-1][1] != n:
            return False
        if any(a[1] != b[0] for a, b in zip(ivals, ivals[1:])):
            return False
        grid *= len(ivals)
    return grid == len(nonempty)


def check_pipeline(dims: MoEParallelDims, schedule: str, microbatches: int, n_layers: int, tie_embeddings: bool,
                   prefix: str = "parallel."):
    """What the pipeline needs, checked before any collective (nothing when dims.pp == 1)."""
    if schedule not in PP_STAGES_PER_RANK:
        raise ValueError(f"{prefix}pp_schedule must be one of {list(PP_STAGES_PER_RANK)}, got {schedule!r}")
    pp, per_rank = dims.pp, PP_STAGES_PER_RANK[schedule]
    if pp == 1:
        return
    stages = pp * per_rank
    if n_layers < stages:
        raise ValueError(f"model.n_layers ({n_layers}) must be >= the pipeline stages ({stages} = {prefix}pp {pp} x "
                         f"{per_rank} per rank for {schedule!r}): every stage holds a layer; valid "
                         f"{prefix}pp here: {[p for p in range(1, n_layers + 1) if p * per_rank <= n_layers]}")
    if tie_embeddings:
        raise ValueError(f"model.tie_embeddings=true is not supported with {prefix}pp > 1 (the embedding and the "
                         "output head live on different stages); valid: model.tie_embeddings=false, or pp=1")
    if schedule == "1f1b" and microbatches < pp:
        raise ValueError(f"{prefix}microbatches ({microbatches}) must be >= {prefix}pp ({pp}) for pp_schedule '1f1b'; "
                         f"valid: {list(range(pp, 4 * pp + 1))}, ... or pp_schedule 'gpipe'")
    if schedule == "interleaved_1f1b":
        rounds = max(1, microbatches // pp)
        if microbatches % rounds:
            valid = [m for m in range(1, 4 * pp + 1) if m % max(1, m // pp) == 0]
            raise ValueError(f"{prefix}microbatches ({microbatches}) must be a multiple of max(1, microbatches // pp) "
                             f"= {rounds} for pp_schedule 'interleaved_1f1b'; valid up to {4 * pp}: {valid}")


def stage_layers(n_layers: int, num_stages: int) -> list[list[int]]:
    """Contiguous layer ids per stage, as even as possible (the first stages take the remainder)."""
    base, extra = divmod(n_layers, num_stages)
    out, lo = [], 0
    for s in range(num_stages):
        hi = lo + base + (s < extra)
        out.append(list(range(lo, hi)))
        lo = hi
    return out


def rank_layers(n_layers: int, pp: int, schedule: str, pp_rank: int) -> list[int]:
    """Layer ids that pipeline rank `pp_rank` holds (its stages pp_rank, pp_rank + pp, ...); it holds
    the embedding iff pp_rank == 0 and the final norm and head iff pp_rank == pp - 1."""
    stages = stage_layers(n_layers, pp * (PP_STAGES_PER_RANK[schedule] if pp > 1 else 1))
    return [i for s in stages[pp_rank::pp] for i in s]
