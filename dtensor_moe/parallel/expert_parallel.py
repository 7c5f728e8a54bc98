"""The library's face for MoE layers, each step its own function, in torchtitan's order (tp -> ep -> ac ->
compile -> fsdp): `ExpertParallel`, the placement plan as a DTensor `ParallelStyle` (partition and the
dispatch / combine hooks) that goes into a `parallelize_module` plan beside torch's ColwiseParallel /
RowwiseParallel (torchtitan applies its own expert parallelism the same way); `compile_moe`, each placed layer's
forward one graph; `fully_shard_moe`, each placed layer's FSDP2 units; and `parallelize_moe`, the three chained
over a whole module tree.
"""

from dataclasses import replace

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from dtensor_moe.moe import MoE, named_moes
from dtensor_moe.parallel.compile import apply_compile
from dtensor_moe.parallel.mesh import DENSE_AXES, EXPERT_AXES, MoEMeshes, MoEParallelDims, check_device_type
from dtensor_moe.parallel.shard import (
    DEFAULT_TP_GRADS,
    check_tp_grads,
    experts_fsdp_sharded,
    fsdp_kwargs,
    fully_shard_layer,
    moe_placement_plans,
    place_layer,
)

__all__ = ["ExpertParallel", "compile_moe", "fully_shard_moe", "parallelize_moe"]


class ExpertParallel(ParallelStyle):
    """A DTensor `ParallelStyle` that shards every `dtensor_moe.MoE` in the module it is applied to by the
    placement plan: key it in a `parallelize_module` plan beside torch's ColwiseParallel / RowwiseParallel.

    It applies to the MoE itself or to any module holding MoE layers (e.g. `"layers.*.moe"` or the whole
    model), as torch's styles do: it partitions the layer's weights and hooks its forward. Expert weights
    become DTensors by the placement plan (`plan_moe`: E over EP, F over ETP), a dispatch strategy moves
    tokens to the experts and back (dispatch / combine hooks), and load-balancing statistics reduce over
    every rank with its own tokens (`DataParallelStats`). The plan's data-parallel steps, the experts over
    EDP / HSDP and the router and shared experts over every rank with its own tokens, are FSDP2 units:
    `fully_shard_moe`. With `fully_shard=True` (the default) the style makes them itself, with
    `fully_shard_moe`'s defaults, so that a plan alone places the layer and a later `fully_shard` of the model
    skips it; `fully_shard=False` leaves them to `fully_shard_moe` (after `compile_moe`, if the layer
    compiles), as `parallelize_moe` does.

    The mesh `parallelize_module` hands every style in the plan (the dense TP mesh, or the world mesh)
    gives only the device type, when `device_type` is None: the expert mesh (dp_replicate, edp, ep, etp)
    folds over the same ranks as the dense one, so no 1-D slice of either is enough; the style builds
    (or takes) both folded meshes and uses all of their axes. `src_data_rank` (`parallelize_module`'s,
    0 by default) is honoured as torch's styles honour it: every rank takes the layer's parameters from
    that group rank on each axis of its pipeline stage (meta weights are not sent);
    `parallelize_module(..., src_data_rank=None)` slices each rank's own copy, so all ranks must hold the
    same weights (`parallelize_moe` applies the style so).

    Args:
        dims (MoEParallelDims | None): the degrees; or leave it None and pass `meshes`.

    Keyword Args:
        meshes (MoEMeshes | None): the meshes of `dims.build_meshes(...)`; its degrees are read off them.
            Default None (the style builds them from `dims`).
        device_type (str | None): "cuda", "cpu", ...; None (default) takes the device type of the mesh
            `parallelize_module` passes.
        tp_grads (str): how the gradients of the tp ranks' copies combine, with `dims.tp > 1` (every TP
            rank holds its own slice of each sequence, sequence parallelism): "sum" (default) sums the MoE's
            weight gradients over the tp ranks as DTensor sums a TP-sharded weight's, so the whole plan
            follows one loss convention (the loss of a tp group, averaged over the data-parallel groups by
            FSDP); "mean" averages over them as over every data-parallel rank, for tp ranks that each compute
            their own loss. Every entry point has the same default. `dtensor_moe.parallel.shard.TP_GRADS`.
        fully_shard (bool): True (default): the layer's FSDP2 units are made here, as `fully_shard_moe`
            makes them with its defaults. False: partition and hooks only; call `fully_shard_moe(model, ...)`
            after the plan (your `mp_policy`, `reshard_after_forward`), or, with `gather_in_forward=True` and
            `dims.tp == 1`, your own `fully_shard` around the layer, which must leave the experts out
            (`ignored_params=ExpertParallel.expert_parameters(model)`).
        gather_in_forward (bool): under EDP / HSDP the experts' weights are DTensors on the whole expert mesh,
            all-gathered over EDP inside the layer's forward and their gradients reduce-scattered back
            (`kernels.expert_autograd.gather_for_compute`), with no FSDP2 unit of their own: what `compile_moe`
            needs, since torch.compile cannot trace FSDP2's hooks (torch 2.11-2.13). Default False: the experts'
            own FSDP2 unit. Without EDP / HSDP the two are the same.

    Returns:
        A `ParallelStyle` for a `parallelize_module` plan; applying it shards the layers in place.

    Raises:
        ValueError: bad arguments, here; bad degrees for a layer, a module with no MoE or one already
            parallelized, when applied, before any collective.

    Example (under torchrun; README.md runs a complete one on 4 CPU ranks)::

        meshes = dims.build_meshes("cuda")
        parallelize_module(model, meshes.tp, {"attn.wq": ColwiseParallel(), ...,
                                              "moe": ExpertParallel(dims)})
        fully_shard(model, mesh=meshes.dp)   # the dense rest; the MoE's own units are left alone
    """

    def __init__(
        self,
        dims: MoEParallelDims | None = None,
        *,
        meshes: MoEMeshes | None = None,
        device_type: str | None = None,
        tp_grads: str = DEFAULT_TP_GRADS,
        fully_shard: bool = True,
        gather_in_forward: bool = False,
    ):
        super().__init__()
        if dims is not None and not isinstance(dims, MoEParallelDims):
            raise ValueError(f"ExpertParallel: dims must be a MoEParallelDims, got {type(dims).__name__}")
        if meshes is not None:
            if not isinstance(meshes, MoEMeshes):
                raise ValueError(f"ExpertParallel: meshes must be the MoEMeshes of MoEParallelDims.build_meshes, "
                                 f"got {type(meshes).__name__}")
            built = meshes_dims(meshes)
            if dims is not None and dims != built:
                raise ValueError(f"ExpertParallel: dims {dims} differ from the degrees of meshes {built}; pass one")
            if device_type not in (None, meshes.dense.device_type):
                raise ValueError(f"ExpertParallel: device_type {device_type!r} differs from the meshes' "
                                 f"{meshes.dense.device_type!r}")
            dims, device_type = built, meshes.dense.device_type
        if dims is None:
            raise ValueError("ExpertParallel needs dims (a MoEParallelDims) or meshes (a MoEMeshes)")
        check_tp_grads(tp_grads, "ExpertParallel: ")
        self.dims, self.meshes, self.device_type, self.tp_grads = dims, meshes, device_type, tp_grads
        self.fully_shard, self.gather_in_forward = fully_shard, gather_in_forward
        self.unit_kwargs = fsdp_kwargs(None, True)

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        layers = moe_placement_plans(module, self.dims, "ExpertParallel")
        if not layers:
            raise ValueError(f"ExpertParallel applies to a dtensor_moe.MoE or a module holding MoE layers; "
                             f"{type(module).__name__} holds none (in a parallelize_module plan, key it by the "
                             "MoE's path, e.g. 'layers.0.moe' or 'layers.*.moe'; torchtitan's MoE: dtensor_moe.titan)")
        device_type = self.device_type or device_mesh.device_type
        if device_mesh is not None and device_mesh.device_type != device_type:
            raise ValueError(f"ExpertParallel: parallelize_module's mesh is on {device_mesh.device_type!r}, the "
                             f"expert meshes on {device_type!r}; valid: the same device type")
        meshes = self.meshes or self.dims.build_meshes(device_type)
        for moe, plans in layers:
            if self.src_data_rank is not None:
                broadcast_parameters(moe, meshes.moe_dp, self.src_data_rank)
            # First of the layer's pre-hooks: under compile, the tp gradient scale's autograd node taken on the
            # AsyncCollectiveTensor itself lost the MoE's input gradient (grad:x off by 0.6, torch 2.13).
            moe.register_forward_pre_hook(_plain_input)
            place_layer(moe, plans, self.dims, meshes, tp_grads=self.tp_grads, gather_in_forward=self.gather_in_forward)
        moes = [moe for moe, _ in layers]
        if self.fully_shard:
            _fully_shard_layers(moes, self.unit_kwargs)
        return module

    @staticmethod
    def expert_parameters(module: nn.Module) -> set[nn.Parameter]:
        """Every MoE's expert weights in `module`: `fully_shard(..., ignored_params=...)` of your own around
        layers placed with `fully_shard=False, gather_in_forward=True`."""
        return {p for m in module.modules() if isinstance(m, MoE) for p in m.experts.parameters()}


def _plain_input(module, args):
    """TP styles hand on their local outputs (`use_local_output`) as AsyncCollectiveTensors, and a graph
    compiled on one loses its gradient (torch 2.13: the compiled MoE's input gradient came back None, under
    torch.compile of the layer and under `compile=`): the MoE takes a plain copy (one [T, D] copy a layer)."""
    if isinstance(args[0], AsyncCollectiveTensor):
        return (args[0].clone(), *args[1:])
    return None


# torch.compile(moe) compiles each of moe's hooks written outside torch as a graph of its own, and this one's
# would take the AsyncCollectiveTensor in: never a frame of its own (eager), still traced inside a larger graph.
if hasattr(torch._dynamo.eval_frame, "skip_code"):
    torch._dynamo.eval_frame.skip_code(_plain_input.__code__)


def check_compile_with_replicas(layers, compile, prefix: str) -> None:
    """What a compiled layer needs of `layers` (moe_placement_plans'), checked before any collective."""
    if compile and any(m.options.expert_replicas for m, _ in layers):
        raise ValueError(f"{prefix}compile={compile!r} with expert_replicas > 0 is not supported (the replicas' "
                         "split needs the counts on the host, eagerly); valid: compile=False, or expert_replicas 0")


def meshes_dims(meshes: MoEMeshes) -> MoEParallelDims:
    """The degrees `meshes` were built with (MoEParallelDims.build_meshes)."""
    names = (meshes.dense.mesh_dim_names, meshes.expert.mesh_dim_names)
    if names != (DENSE_AXES, EXPERT_AXES):
        raise ValueError(f"ExpertParallel: meshes must have the dense axes {DENSE_AXES} and the expert axes "
                         f"{EXPERT_AXES} (MoEParallelDims.build_meshes), got {names}")
    dp_replicate, dp_shard, cp, tp = meshes.dense.shape
    ep, etp = meshes.expert.shape[2:]
    pp = 1 if meshes.pp is None else meshes.pp.size()
    return MoEParallelDims(meshes.dense.size() * pp, dp_replicate, dp_shard, cp, tp, ep, etp, pp)


def check_compile_backend(compile, prefix: str = ""):
    """ValueError unless `compile` is True, False or a torch.compile backend name."""
    if isinstance(compile, bool):
        return
    valid = torch.compiler.list_backends(exclude_tags=())
    if not isinstance(compile, str) or compile not in valid:
        raise ValueError(f"{prefix}compile must be True, False or a torch.compile backend name {valid}, "
                         f"got {compile!r}")


@torch.no_grad()
def broadcast_parameters(module: nn.Module, mesh, src_data_rank: int):
    """Every parameter of `module` from group rank `src_data_rank` on each axis of `mesh`, in place."""
    for p in module.parameters():
        if p.is_meta:
            continue
        for axis in range(mesh.ndim):
            if mesh.size(axis) > 1:
                dist.broadcast(p.data, group=mesh.get_group(axis), group_src=src_data_rank)


def refuse_tracing_fsdp_hooks(moe: nn.Module, experts_sharded: bool):
    """Ahead of each FSDP2 unit's hooks in the layer, one that dynamo cannot trace either but whose reason
    names the supported route: `fullgraph=True` then stops there with that error, not FSDP2's bare
    "Attempted to call function marked as skipped"; without fullgraph the graph breaks there as it would at
    FSDP2's hook. Eagerly (and for a compiled module's own hooks, which run outside its graph) a no-op."""
    for name, unit in moe.named_modules():
        if not isinstance(unit, FSDPModule):
            continue
        what = ("its experts are an FSDP2 unit over EDP / HSDP" if name and experts_sharded else
                "it is an FSDP2 unit (the router and shared experts over the data-parallel ranks)")
        reason = (f"dtensor_moe: this MoE layer cannot be traced into a graph: {what}, and torch.compile cannot trace "
                  "FSDP2's hooks. Supported: parallelize_moe(..., compile=True), or compile_moe(model) of layers "
                  "placed with ExpertParallel(..., gather_in_forward=True) (the layer's forward one fullgraph graph "
                  "inside its FSDP2 hooks; a string names the backend); torch.compile of the MoE module itself "
                  "when its experts have no EDP / HSDP unit; or ExpertParallel(..., fully_shard=False, "
                  "gather_in_forward=True) with your own FSDP2 units outside the compiled module")

        def fsdp2_hooks_cannot_be_traced(module, args):
            return None

        unit.register_forward_pre_hook(torch.compiler.disable(fsdp2_hooks_cannot_be_traced, reason=reason),
                                       prepend=True)


def _refuse_no_moe(module: nn.Module, caller: str) -> None:
    """A tree without one `MoE` is a mistake (e.g. a Hugging Face model whose sparse blocks were not swapped):
    doing nothing would leave every expert unsharded and unsaid."""
    raise ValueError(f"{caller}: {type(module).__name__} holds no dtensor_moe.MoE layer, so there is nothing to "
                     "shard; a Hugging Face model's sparse blocks become ours with parallelize_hf_model (or "
                     "dtensor_moe.hf.model.swap_moe_blocks) first; valid: a module holding dtensor_moe.MoE layers")


def _placed(module: nn.Module, caller: str) -> list[MoE]:
    """Every MoE in `module`, each placed by ExpertParallel (or parallelize_moe), else ValueError."""
    moes = named_moes(module, type(module).__name__)
    if not moes:
        _refuse_no_moe(module, caller)
    unplaced = [n for n, m in moes.items() if getattr(m, "placement", None) is None]
    if unplaced:
        raise ValueError(f"{caller}: MoE layers {unplaced} are not placed yet; valid: ExpertParallel(..., "
                         "fully_shard=False) in a parallelize_module plan first (parallelize_moe chains both)")
    return list(moes.values())


def _fully_shard_layers(moes: list[MoE], unit_kwargs: dict) -> None:
    for moe in moes:
        fully_shard_layer(moe, unit_kwargs)
        refuse_tracing_fsdp_hooks(moe, experts_fsdp_sharded(moe.placement.dims))


def _compile_layers(moes: list[MoE], backend) -> None:
    for moe in moes:
        apply_compile(moe, backend)
        moe.placement = replace(moe.placement, compiled=True)


def check_mp_policy(mp_policy, caller: str) -> None:
    """TypeError unless `mp_policy` is None or FSDP2's MixedPrecisionPolicy (a string would fail at the first
    forward, inside FSDP2)."""
    if mp_policy is not None and not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"{caller}: mp_policy must be torch.distributed.fsdp.MixedPrecisionPolicy or None, got "
                        f"{mp_policy!r}; e.g. MixedPrecisionPolicy(param_dtype=torch.bfloat16)")


def fully_shard_moe(module: nn.Module, *, mp_policy=None, reshard_after_forward: bool = True) -> nn.Module:
    """The FSDP2 units of every placed `MoE` in `module`, in place: the plan's data-parallel steps.

    Each layer's experts become a unit over EDP (HSDP over dp_replicate), along the plan's dim, unless they
    have no such axis (FSDP2 on one rank would only copy them around each use) or gather in the forward
    (`ExpertParallel(..., gather_in_forward=True)`); the layer itself a unit of its router and shared
    experts over every rank with its own tokens (`dims.moe_dp_axis`). Ahead of each unit's hooks one that
    names the supported compile routes when torch.compile meets it (it cannot trace FSDP2's hooks). Run it
    after the placement plan and after `compile_moe`, before your own `fully_shard` of the dense rest, which
    then skips the layers (torchtitan's order: ... compile -> fsdp).

    Args:
        module (nn.Module): a model holding MoE layers placed by `ExpertParallel(..., fully_shard=False)`, or
            one such MoE.

    Keyword Args:
        mp_policy (MixedPrecisionPolicy | None): the units' mixed precision. Default None.
        reshard_after_forward (bool): the units' `reshard_after_forward`. Default True.

    Returns:
        nn.Module: `module`, its MoE layers FSDP2 units.

    Raises:
        ValueError: no MoE in `module`, a layer not placed yet, or one that is an FSDP2 unit already
            (`ExpertParallel`'s default `fully_shard=True` makes them), before any unit is made.

    Example (under torchrun; docs/parallelism.md runs a complete one on 2 CPU ranks)::

        parallelize_module(model, meshes.tp, {"layers.*.moe": ExpertParallel(dims, fully_shard=False)})
        fully_shard_moe(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
        fully_shard(model, mesh=meshes.dp)  # the dense rest
    """
    check_mp_policy(mp_policy, "fully_shard_moe")
    moes = _placed(module, "fully_shard_moe")
    done = [n for n, m in named_moes(module, type(module).__name__).items() if isinstance(m, FSDPModule)]
    if done:
        raise ValueError(f"fully_shard_moe: MoE layers {done} are FSDP2 units already (ExpertParallel's default "
                         "fully_shard=True makes them); valid: ExpertParallel(..., fully_shard=False), then "
                         "fully_shard_moe once")
    _fully_shard_layers(moes, fsdp_kwargs(mp_policy, reshard_after_forward))
    return module


def compile_moe(module: nn.Module, backend: str = "inductor") -> nn.Module:
    """Each placed `MoE`'s forward in `module` compiled as one graph (`fullgraph=True`), in place.

    The layer's dispatch, experts and combine are one graph; module hooks (FSDP2's, made before or after
    this call) run outside it. Under EDP / HSDP the experts must gather their weights inside the forward
    (`ExpertParallel(..., gather_in_forward=True)`: torch.compile cannot trace FSDP2's hooks, torch
    2.11-2.13). Run it after the placement plan and before `fully_shard_moe` (torchtitan's order).

    Args:
        module (nn.Module): a model holding placed MoE layers, or one such MoE.
        backend (str): the torch.compile backend: "inductor" (default) or another, e.g. "aot_eager" (the
            same tracing, no codegen).

    Returns:
        nn.Module: `module`, its MoE layers' forwards compiled.

    Raises:
        ValueError: a bad backend, no MoE in `module`, a layer not placed yet, one compiled already, one whose
            experts take EDP / HSDP from an FSDP2 unit, or one with `expert_replicas > 0` (their split needs the
            counts on the host, eagerly).

    Example (under torchrun; `parallelize_moe(..., compile=...)` is this chain)::

        parallelize_module(model, meshes.tp, {"layers.*.moe": ExpertParallel(dims, fully_shard=False,
                                                                             gather_in_forward=True)})
        compile_moe(model, "inductor")
        fully_shard_moe(model)
    """
    if not isinstance(backend, str) or backend not in torch.compiler.list_backends(exclude_tags=()):
        raise ValueError(f"compile_moe: backend must be a torch.compile backend name "
                         f"{torch.compiler.list_backends(exclude_tags=())}, got {backend!r}")
    moes = _placed(module, "compile_moe")
    check_compile_with_replicas([(m, None) for m in moes], backend, "compile_moe: ")
    twice = [n for n, m in named_moes(module, type(module).__name__).items() if m.placement.compiled]
    if twice:
        raise ValueError(f"compile_moe: MoE layers {twice} are compiled already; valid: compile_moe once per model")
    unit = [n for n, m in named_moes(module, type(module).__name__).items()
            if experts_fsdp_sharded(m.placement.dims) and not m.placement.gather_in_forward]
    if unit:
        raise ValueError(f"compile_moe: the experts of MoE layers {unit} take EDP / HSDP from an FSDP2 unit of their "
                         "own, whose hooks torch.compile cannot trace; valid: place them with "
                         "ExpertParallel(..., gather_in_forward=True), or parallelize_moe(..., compile=...)")
    _compile_layers(moes, backend)
    return module


def parallelize_moe(
    module: nn.Module,
    dims: MoEParallelDims,
    *,
    device_type: str = "cuda",
    mp_policy=None,
    reshard_after_forward: bool = True,
    compile: bool | str = False,
    tp_grads: str = DEFAULT_TP_GRADS,
) -> nn.Module:
    """Shard every `MoE` in `module` in place by its placement plan (EP, ETP, FSDP2 over EDP / HSDP).

    torchtitan's chain for the MoE layers: ep (the `ExpertParallel` style over the whole tree, by
    `parallelize_module(..., src_data_rank=None)`) -> compile (`compile_moe`, with `compile`) -> fsdp
    (`fully_shard_moe`). Each rank slices its own copy of the weights (no broadcast: every rank must hold the
    same weights, e.g. from the same seed). Your dense TP styles go before it (their own
    `parallelize_module` call), activation checkpointing per block around it (`parallelize_blocks` does both
    for a decoder), and the dense rest's `fully_shard` (on `dims.build_meshes(...).dp`) after it, as in
    torchtitan's parallelize functions. Must run on every rank (it builds the meshes: a collective).

    Args:
        module (nn.Module): a model holding `MoE` layers, or an `MoE`.
        dims (MoEParallelDims): the degrees; world_size must be the process group's size.

    Keyword Args:
        device_type (str): the meshes' device type. Default "cuda".
        mp_policy (MixedPrecisionPolicy | None): the layers' FSDP2 units' mixed precision. Default None.
        reshard_after_forward (bool): the layers' FSDP2 units' `reshard_after_forward`. Default True.
        compile (bool | str): each MoE's forward becomes one graph (its FSDP unit's hooks run around it);
            a string names the backend. This, not `torch.compile(..., fullgraph=True)` of a module holding
            the layer's FSDP2 units, is how a parallelized layer compiles (see `compile_moe`).
            Default False.
        tp_grads (str): with `dims.tp > 1`, how the tp ranks' gradients combine (`ExpertParallel`'s
            `tp_grads`): "sum" (default, as every entry point's) sums them as DTensor sums a TP-sharded weight's,
            for the loss of a tp group replicated over its ranks (your dense TP styles'); "mean" averages them like
            over every data-parallel rank, for tp ranks that each compute their own loss.

    Returns:
        nn.Module: `module`, its MoE layers sharded.

    Raises:
        ValueError: no MoE in `module`, degrees that do not fit a layer, or a layer already parallelized, before
            any collective.

    Example (under torchrun, 4 ranks; docs/compile.md and docs/hf.md run complete ones)::

        dims = MoEParallelDims(world_size=4, ep=2, etp=2)
        parallelize_moe(model, dims, device_type="cuda")
        fully_shard(model, mesh=dims.build_meshes("cuda").dp)  # the dense rest
    """
    if not isinstance(dims, MoEParallelDims):
        raise TypeError(f"parallelize_moe(module, dims): dims must be a MoEParallelDims (the degrees; it builds the "
                        f"meshes itself), got {type(dims).__name__}")
    check_compile_backend(compile, "parallelize_moe: ")
    check_tp_grads(tp_grads, "parallelize_moe: ")
    check_mp_policy(mp_policy, "parallelize_moe")
    check_device_type(device_type)
    layers = moe_placement_plans(module, dims)
    if not layers:
        _refuse_no_moe(module, "parallelize_moe")
    check_compile_with_replicas(layers, compile, "parallelize_moe: ")
    meshes = dims.build_meshes(device_type)
    style = ExpertParallel(dims, meshes=meshes, tp_grads=tp_grads, fully_shard=False, gather_in_forward=bool(compile))
    parallelize_module(module, meshes.tp, style, src_data_rank=None)
    if compile:
        compile_moe(module, "inductor" if compile is True else compile)
    return fully_shard_moe(module, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward)
