"""The mechanics of applying the placement plan to one MoE layer, in place: expert weights as DTensors, the
dispatcher's hooks, FSDP2 units, the data-parallel statistics, and the tp gradient convention (`TP_GRADS`).
`ExpertParallel` and `fully_shard_moe` (expert_parallel.py) and the main job's `parallelize_transformer` place a
layer of ours with `place_layer` and make its FSDP2 units with `fully_shard_layer`; the torchtitan hook does both
at once with `shard_moe_layer`."""

import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.utils.hooks import RemovableHandle

from dtensor_moe.config import MoERunOptions, check_replica_mesh
from dtensor_moe.experts import SwiGLUExperts
from dtensor_moe.grad_scale import ScaleGrad
from dtensor_moe.moe import LocalStats, MoE
from dtensor_moe.parallel.dispatch import (
    DispatchGroup,
    PairDispatch,
    RowCap,
    RowLoad,
    SlotDispatch,
    TokenDispatch,
    dispatch_hooks,
)
from dtensor_moe.parallel.mesh import MoEMeshes, MoEParallelDims
from dtensor_moe.parallel.placement import WeightPlan, plan_moe
from dtensor_moe.parallel.replica_dispatch import ReplicaDispatch, Replicas

# `tp_grads`: how the gradients of the tp ranks' copies of an MoE's weights combine under sequence parallelism
# (dims.tp > 1: every tp rank hands the layer its own slice of each sequence, so each holds a copy of the router
# and shared experts and sends its own tokens to the experts). Every entry point takes this one argument:
#   "sum":  summed over tp, as DTensor sums a TP-sharded weight's gradient: the loss of a tp group is one loss,
#           replicated over its ranks, as torch's TP styles make it (every entry point's default: the one
#           convention of a plan with dense TP);
#   "mean": averaged over tp like over every data-parallel rank: each rank's loss is its own, for a caller whose
#           tp ranks compute separate losses over their own tokens.
DEFAULT_TP_GRADS = "sum"
# With tp = 1 both are the same. Averaging over the data-parallel ranks is FSDP2's default reduction; callers whose
# reductions sum instead (the torchtitan hook: `fsdp_sums`) sum over tp too.
TP_GRADS = ("sum", "mean")


def check_tp_grads(tp_grads, prefix: str = "", name: str = "tp_grads") -> None:
    """ValueError unless `tp_grads` is one of TP_GRADS (`name`: the argument as the caller spells it)."""
    if tp_grads not in TP_GRADS:
        raise ValueError(f"{prefix}{name} must be one of {list(TP_GRADS)}, got {tp_grads!r}")


@dataclass(frozen=True)
class MoEPlacement:
    """Kept on a placed `MoE` as `placement` (`place_layer`): what its FSDP2 units and its compile read.

    Attributes:
        dims (MoEParallelDims): the degrees it was placed by.
        meshes (MoEMeshes): the meshes it was placed on.
        plans (tuple[WeightPlan, ...]): its plan (`plan_moe`).
        gather_in_forward (bool): under EDP / HSDP the experts' weights are DTensors on the whole expert mesh,
            gathered inside the forward (no FSDP2 unit for them: a compiled forward traces it).
        compiled (bool): its forward is compiled (`compile_moe`), which must happen once.
    """

    dims: MoEParallelDims
    meshes: MoEMeshes
    plans: tuple[WeightPlan, ...]
    gather_in_forward: bool
    compiled: bool = False


@dataclass(frozen=True)
class ExpertParallelHooks:
    """Kept on a parallelized experts module as `expert_parallel`: its dispatch strategy (dispatch.py), the rows
    its forwards computed per EP rank (`load`, read by the main job's metrics), and the hook handles."""

    dispatcher: object
    load: RowLoad
    pre_handle: RemovableHandle
    post_handle: RemovableHandle


def _all_reduce(t: torch.Tensor, groups) -> torch.Tensor:
    t = t.clone()
    for g in groups:
        dist.all_reduce(t, group=g)
    return t


class DataParallelStats(LocalStats):
    """Sums load-balancing statistics over exactly the ranks that see different tokens, and
    per-sequence statistics over the CP and (sequence-parallel) TP ranks, which hold pieces of the
    same sequences."""

    def __init__(self, meshes: MoEMeshes, dims: MoEParallelDims):
        dp_mesh = meshes.moe_dp
        self.groups = [dp_mesh.get_group(i) for i in range(dp_mesh.ndim) if dp_mesh.size(i) > 1]
        self.num_ranks = dp_mesh.size()
        self.sequence_groups = [meshes.dense.get_group(a) for a in ("cp", "tp") if getattr(dims, a) > 1]

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        return _all_reduce(t, self.groups)

    def sequence_sum(self, t: torch.Tensor) -> torch.Tensor:
        return _all_reduce(t, self.sequence_groups) if self.sequence_groups else t


def _fsdp_mesh(mesh, dims: MoEParallelDims, shard_axis: str):
    return mesh["dp_replicate", shard_axis] if dims.dp_replicate > 1 else mesh[shard_axis]


def _placement_fn(module: nn.Module, plans: tuple[WeightPlan, ...]):
    by_param = {module.get_parameter(wp.name): Shard(wp.fsdp_step.dim) for wp in plans}
    return lambda p: by_param.get(p)


def shard_moe_layer(
    moe: nn.Module,
    plans: tuple[WeightPlan, ...],
    dims: MoEParallelDims,
    meshes: MoEMeshes,
    fsdp_kwargs: dict | None,
    *,
    tp_grads: str = DEFAULT_TP_GRADS,
    fsdp_sums: bool = False,
    gather_in_forward: bool = False,
    options: MoERunOptions | None = None,
    layer: str = "an MoE layer",
    replica_forward=None,
):
    """Apply `plans` (names relative to `moe`) to one MoE layer of any model family.

    Expert weights become DTensors on the (ep, etp) submesh (its axes of size > 1), the dispatcher wraps the module that
    owns them, and FSDP2 shards them over EDP (HSDP over dp_replicate) and the dense weights over
    the data-parallel ranks, each along the plan's dim. `tp_grads`: TP_GRADS. `fsdp_sums`: the
    data-parallel reductions sum instead of averaging (torchtitan's loss is a global sum and its FSDP2 units'
    divide factor 1): the dispatcher then leaves the expert weight gradients sums (no EP*ETP division,
    dispatch.py), and the tp ranks' copies sum by those reductions themselves (`tp_grads` must be "sum").
    `fsdp_kwargs` None: no FSDP units here (`fully_shard_layer` makes them later, or the caller's unit around
    the layer takes its dense weights: compiled blocks, whose FSDP hooks must stay outside the graph).
    `gather_in_forward` (compiled layers): no FSDP unit for our experts; under EDP / HSDP their weights are
    DTensors on the whole expert mesh, gathered over EDP in the forward and their gradients reduce-scattered
    back, both DTensor redistributions inside the graph (kernels/expert_autograd.py, gather_for_compute).
    `options` (MoERunOptions; None: the defaults): the dispatch's padding, token payload, replicas and row cap, the
    layer named `layer` in the row cap's errors; replicas run with our experts, or others given a `replica_forward`
    (experts, rows, counts, weights) -> rows.
    """
    check_tp_grads(tp_grads, "shard_moe_layer: ")
    if fsdp_sums and tp_grads != "sum" and dims.tp > 1:
        raise ValueError("shard_moe_layer: with fsdp_sums the tp ranks' gradients sum with every other rank's; "
                         f"valid: tp_grads='sum', got {tp_grads!r}")
    experts = _experts(moe, plans)
    ep_etp = meshes.expert["ep", "etp"]
    ours = isinstance(experts, SwiGLUExperts)  # takes ExpertInput and the weight-gradient scale
    options = MoERunOptions() if options is None else options
    if not ours and options.expert_replicas and replica_forward is None:
        raise ValueError(f"expert_replicas needs dtensor_moe's experts (SwiGLUExperts: they run the replicas' rows) or "
                         f"a replica_forward for {type(experts).__name__} (the torchtitan hook's); valid: "
                         f"expert_replicas 0")
    in_graph = ours and gather_in_forward and experts_fsdp_sharded(dims)
    weight_mesh = meshes.expert_by_plan if in_graph else meshes.expert_weights
    for wp in plans:
        if wp.role != "expert":
            continue
        attr = wp.name.rsplit(".", 1)[1]
        param = getattr(experts, attr)
        placements = [Shard(s.dim) if s else Replicate() for s in map(wp.step_on, weight_mesh.mesh_dim_names)]
        # src_data_rank=None: every rank already holds the same full (or meta) weight, so slice locally.
        dt = distribute_tensor(param.data, weight_mesh, placements, src_data_rank=None)
        setattr(experts, attr, nn.Parameter(dt, requires_grad=param.requires_grad))
    if dims.ep * dims.etp > 1:
        # Averaging reductions cover EDP x dp_replicate only: the EP*ETP peers' share is divided here.
        divisor = 1.0 if fsdp_sums else dims.ep * dims.etp
        group = DispatchGroup(ep_etp.get_group("ep"), ep_etp.get_group("etp"), divisor, options.dispatch_precision)
        d, load = make_dispatcher(group, ours, options, layer, replica_forward), RowLoad()
        pre, post = dispatch_hooks(d, load, ours)
        experts.expert_parallel = ExpertParallelHooks(
            d, load, experts.register_forward_pre_hook(pre), experts.register_forward_hook(post))
    if fsdp_kwargs is not None:
        _fully_shard(moe, plans, dims, meshes, fsdp_kwargs, gather_in_forward)
    if tp_grads == "sum" and dims.tp > 1 and not fsdp_sums:
        scale_moe_gradients(moe, dims.tp)


def make_dispatcher(group: DispatchGroup, ours: bool, options: MoERunOptions, layer: str = "an MoE layer",
                    replica_forward=None):
    """The dispatch strategy for one layer (dispatch.py) as `options` (MoERunOptions) ask: SlotDispatch for
    pad_to_capacity, TokenDispatch for our experts, PairDispatch for others; hot-expert replicas (expert_replicas
    slots per EP rank, re-placed every replica_replan_every training forwards) wrap the last two; max_rows_per_rank
    and `layer`: the row cap (RowCap)."""
    if options.pad_to_capacity:
        return SlotDispatch(group)
    cap = RowCap(options.max_rows_per_rank, layer)
    inner = TokenDispatch(group, cap) if ours else PairDispatch(group, cap)
    if not options.expert_replicas:
        return inner
    replicas = Replicas(options.expert_replicas, options.replica_replan_every, group.ep_group, group.etp_group)
    return ReplicaDispatch(inner, replicas, replica_forward)


def _experts(moe: nn.Module, plans: tuple[WeightPlan, ...]) -> nn.Module:
    """The module that owns the layer's expert weights."""
    return moe.get_submodule(next(wp for wp in plans if wp.role == "expert").name.rsplit(".", 1)[0])


def _fully_shard(moe: nn.Module, plans: tuple[WeightPlan, ...], dims: MoEParallelDims, meshes: MoEMeshes,
                 fsdp_kwargs: dict, gather_in_forward: bool) -> None:
    """The layer's FSDP2 units: the experts over EDP (HSDP over dp_replicate), unless ours need none, and the
    layer's dense weights (router, shared experts) over every rank with its own tokens, each along the plan's dim."""
    experts = _experts(moe, plans)
    # With no expert data-parallel axis every expert slice has one owner: FSDP on a 1-rank mesh
    # would only copy the weights in and out around each use (~60 ms per step at DeepSeek scale).
    # Gathered in the forward, they are sharded over EDP by their DTensor placements already.
    ours = isinstance(experts, SwiGLUExperts)
    ignored = set(experts.parameters()) if ours and (gather_in_forward or not experts_fsdp_sharded(dims)) else None
    if ignored is None:
        fully_shard(
            experts,
            mesh=_fsdp_mesh(meshes.expert, dims, "edp"),
            shard_placement_fn=_placement_fn(moe, tuple(wp for wp in plans if wp.role == "expert")),
            **fsdp_kwargs,
        )
    fully_shard(
        moe,
        mesh=_fsdp_mesh(meshes.moe_dp, dims, dims.moe_dp_axis),
        shard_placement_fn=_placement_fn(moe, tuple(wp for wp in plans if wp.role == "dense")),
        ignored_params=ignored,
        **fsdp_kwargs,
    )


def dp_fsdp_mesh(meshes: MoEMeshes, dims: MoEParallelDims):
    """The mesh dense weights are FSDP-sharded on: data-parallel ranks, HSDP over dp_replicate."""
    return _fsdp_mesh(meshes.dp, dims, meshes.dp.mesh_dim_names[-1])


def experts_fsdp_sharded(dims: MoEParallelDims) -> bool:
    """Whether the experts are sharded or replicated over data-parallel ranks (EDP or HSDP)."""
    return dims.edp * dims.dp_replicate > 1


def moe_placement_plans(module: nn.Module, dims: MoEParallelDims, caller: str = "parallelize_moe"):
    """Every MoE in `module` with its placement plan (`plan_moe`), after every check before the first collective
    (and before any module changes), so a bad config never hangs a rank or leaves a half-parallelized model.
    Remembers each layer's path in `module` for the dispatcher's errors (`place_layer`)."""
    moes = [m for m in module.modules() if isinstance(m, MoE)]
    plans = [plan_moe(m.config, dims) for m in moes]
    for m in moes:
        check_replica_mesh(m.options.expert_replicas, m.config.num_experts, dims)
    _LAYER_NAMES.update((m, n or type(module).__name__) for n, m in module.named_modules() if isinstance(m, MoE))
    done = [n for n, m in module.named_modules() if isinstance(m, MoE) and isinstance(m.experts.w2, DTensor)]
    if done:
        raise ValueError(f"{caller}: MoE layers {done} are already parallelized (their expert weights are "
                         "DTensors); parallelize a fresh copy of the unparallelized module instead")
    return list(zip(moes, plans))


# Each MoE's path in the module it was parallelized from, for the dispatcher's errors.
_LAYER_NAMES: "weakref.WeakKeyDictionary[nn.Module, str]" = weakref.WeakKeyDictionary()


def fsdp_kwargs(mp_policy, reshard_after_forward: bool) -> dict:
    kwargs = {"reshard_after_forward": reshard_after_forward}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    return kwargs


def scale_moe_gradients(moe: nn.Module, tp: int) -> None:
    """`tp_grads="sum"` under averaging reductions: FSDP2 averages an MoE's gradients over every rank with its
    own tokens, tp ranks included, while a TP-sharded weight's sum over tp (the loss is replicated over tp, each
    TP rank's loss its data-parallel group's). The MoE's output gradient is scaled by tp, so its weight
    gradients are sums over tp, and its input gradient back by 1/tp."""
    moe.register_forward_pre_hook(lambda _, args: (ScaleGrad.apply(args[0], 1.0 / tp), *args[1:]))
    moe.register_forward_hook(lambda _, args, out: ScaleGrad.apply(out, float(tp)))


def place_layer(moe: MoE, plans: tuple[WeightPlan, ...], dims: MoEParallelDims, meshes: MoEMeshes, *,
              tp_grads: str, gather_in_forward: bool) -> None:
    """One `MoE` of this library placed by its plan, without FSDP2 units: `shard_moe_layer` (DTensor weights,
    dispatcher hooks, `tp_grads`: TP_GRADS), its statistics over the data-parallel ranks, and its `placement`
    (MoEPlacement) for `fully_shard_layer` and compile_moe. ExpertParallel and parallelize_blocks both call it."""
    shard_moe_layer(moe, plans, dims, meshes, None, tp_grads=tp_grads, gather_in_forward=gather_in_forward,
                    options=moe.options, layer=f"MoE layer {_LAYER_NAMES.get(moe, '')!r}")
    moe.stats = DataParallelStats(meshes, dims)
    moe.placement = MoEPlacement(dims, meshes, plans, gather_in_forward)


def fully_shard_layer(moe: MoE, fsdp_kwargs: dict) -> None:
    """A placed `MoE`'s FSDP2 units (`place_layer`; `fsdp_kwargs`: `fsdp_kwargs(...)`): its experts over EDP /
    HSDP unless they gather in the forward or have no such axis, its router and shared experts over every
    rank with its own tokens."""
    p = moe.placement
    _fully_shard(moe, p.plans, p.dims, p.meshes, fsdp_kwargs, p.gather_in_forward)
