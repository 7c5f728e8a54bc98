"""The library's two ways to parallelize MoE layers: `ExpertParallel`, the placement plan as a DTensor
`ParallelStyle` that goes into a `parallelize_module` plan beside torch's ColwiseParallel / RowwiseParallel
(torchtitan applies its own expert parallelism the same way), and `parallelize_moe`, that style applied to a
whole module tree.
"""

import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from dtensor_moe.moe import MoE
from dtensor_moe.parallel.compile import apply_compile
from dtensor_moe.parallel.mesh import DENSE_AXES, EXPERT_AXES, MoEMeshes, MoEParallelDims
from dtensor_moe.parallel.shard import (
    check_tp_grads,
    experts_fsdp_sharded,
    fsdp_kwargs,
    moe_layers,
    shard_and_connect,
)

__all__ = ["ExpertParallel", "parallelize_moe"]


class ExpertParallel(ParallelStyle):
    """A DTensor `ParallelStyle` that shards every `dtensor_moe.MoE` in the module it is applied to by the
    placement plan: key it in a `parallelize_module` plan beside torch's ColwiseParallel / RowwiseParallel.

    It applies to the MoE itself or to any module holding MoE layers (e.g. `"layers.*.moe"` or the whole
    model), exactly as `parallelize_moe` does: expert weights become DTensors by the placement plan
    (`plan_moe`: E over EP, F over ETP), `ExpertDispatcher` moves tokens around the experts,
    load-balancing statistics reduce over every rank with its own tokens (`DataParallelStats`), and
    FSDP2 shards the experts over EDP / HSDP and the router and shared experts over those ranks.

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
        fsdp (bool): True (default): the layer's FSDP2 units are made here, so a later `fully_shard` of
            the model or of its blocks skips the MoE's parameters. False: no units here; the caller's
            `fully_shard` around the layer takes its router and shared experts and must leave the
            experts out (`ignored_params=ExpertParallel.expert_parameters(model)`): under EDP / HSDP
            their weights are DTensors on the whole expert mesh, gathered over EDP inside the forward
            and their gradients reduce-scattered back (`experts.gather_for_compute`). False needs
            `dims.tp == 1`, where the caller's data-parallel mesh holds every rank with its own tokens.
        mp_policy (MixedPrecisionPolicy | None): the layer's FSDP2 units' mixed precision (fsdp=True
            only). Default None.
        reshard_after_forward (bool): the layer's FSDP2 units' `reshard_after_forward`. Default True.
        compile (bool | str): True, or a backend name: each MoE's forward compiles as one graph
            (`fullgraph=True`) inside its FSDP2 unit's hooks, the experts then in no unit (gathered in
            the graph, as above). This is the supported route to a compiled layer: FSDP2's hooks cannot
            be traced (torch 2.11-2.13), so `torch.compile(m, fullgraph=True)` of a module `m` that
            holds one of the layer's units fails, with an error that names this route (a hook ahead of
            each unit's own). `torch.compile` of the MoE itself compiles when its experts have no unit
            (no EDP / HSDP): a compiled module's own hooks run outside its graph. With `fsdp=False` no
            unit is in the way of any `fullgraph` compile. Default False.
        tp_grads (str): how the gradients of the tp ranks' copies combine, with `dims.tp > 1` (every TP
            rank holds its own slice of each sequence, sequence parallelism): "sum" (default) sums the MoE's
            weight gradients over the tp ranks as DTensor sums a TP-sharded weight's, so the whole plan
            follows one loss convention (the loss of a tp group, averaged over the data-parallel groups by
            FSDP); "mean" averages over them as over every data-parallel rank, each rank's loss its own
            (`parallelize_moe`'s default). `dtensor_moe.parallel.shard.TP_GRADS`.
        tp_reduce (str | None): deprecated (one release): `tp_grads`, its old name; a DeprecationWarning.

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
        fsdp: bool = True,
        mp_policy=None,
        reshard_after_forward: bool = True,
        compile: bool | str = False,
        tp_grads: str = "sum",
        tp_reduce: str | None = None,
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
        check_backend(compile, "ExpertParallel: ")
        if tp_reduce is not None:
            warnings.warn(f"ExpertParallel(tp_reduce={tp_reduce!r}) is deprecated and will be removed in the next "
                          f"release: use ExpertParallel(..., tp_grads={tp_reduce!r})", DeprecationWarning,
                          stacklevel=2)
            check_tp_grads(tp_reduce, "ExpertParallel: ", "tp_reduce")
            tp_grads = tp_reduce
        check_tp_grads(tp_grads, "ExpertParallel: ")
        if not fsdp and mp_policy is not None:
            raise ValueError("ExpertParallel: mp_policy is the layer's FSDP2 units' and fsdp=False makes none; "
                             "valid: fsdp=True with mp_policy, or mp_policy on your own fully_shard")
        if not fsdp and dims.tp > 1:
            # The router and shared experts see other tokens on every tp rank, so their gradients must
            # be reduced over tp too: a unit on the caller's data-parallel mesh (dp_shard) would miss it.
            raise ValueError(f"ExpertParallel: fsdp=False with tp={dims.tp} is not supported (the router and "
                             f"shared experts must be sharded over every rank with its own tokens, "
                             f"{dims.moe_dp_axis}); valid: fsdp=True, or tp=1")
        self.dims, self.meshes, self.device_type = dims, meshes, device_type
        self.fsdp, self.compile, self.tp_grads = fsdp, compile, tp_grads
        self.unit_kwargs = fsdp_kwargs(mp_policy, reshard_after_forward) if fsdp else None

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        layers = moe_layers(module, self.dims, "ExpertParallel")
        if not layers:
            raise ValueError(f"ExpertParallel applies to a dtensor_moe.MoE or a module holding MoE layers; "
                             f"{type(module).__name__} holds none (in a parallelize_module plan, key it by the "
                             "MoE's path, e.g. 'layers.0.moe' or 'layers.*.moe'; torchtitan's MoE: dtensor_moe.titan)")
        device_type = self.device_type or device_mesh.device_type
        if device_mesh is not None and device_mesh.device_type != device_type:
            raise ValueError(f"ExpertParallel: parallelize_module's mesh is on {device_mesh.device_type!r}, the "
                             f"expert meshes on {device_type!r}; valid: the same device type")
        check_compilable(layers, self.compile, "ExpertParallel: ")
        meshes = self.meshes or self.dims.build_meshes(device_type)
        for moe, plans in layers:
            if self.src_data_rank is not None:
                broadcast_parameters(moe, meshes.moe_dp, self.src_data_rank)
            # First of the layer's pre-hooks: under compile, the tp gradient scale's autograd node taken on the
            # AsyncCollectiveTensor itself lost the MoE's input gradient (grad:x off by 0.6, torch 2.13).
            moe.register_forward_pre_hook(_plain_input)
            shard_and_connect(moe, plans, self.dims, meshes, self.unit_kwargs,
                              experts_unit=self.fsdp and not self.compile, tp_grads=self.tp_grads)
            if self.compile:
                apply_compile(moe, self.compile)
            refuse_tracing_fsdp_hooks(moe, experts_fsdp_sharded(self.dims))
        return module

    @staticmethod
    def expert_parameters(module: nn.Module) -> set[nn.Parameter]:
        """Every MoE's expert weights in `module`: `fully_shard(..., ignored_params=...)` with `fsdp=False`."""
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


def check_compilable(layers, compile, prefix: str) -> None:
    """What a compiled layer needs of `layers` (moe_layers'), checked before any collective."""
    if compile and any(m.config.expert_replicas for m, _ in layers):
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


def check_backend(compile, prefix: str = ""):
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
                  "FSDP2's hooks. Supported: ExpertParallel(..., compile=True) or parallelize_moe(..., compile=True) "
                  "(the layer's forward one fullgraph graph inside its FSDP2 hooks; a string names the backend); "
                  "torch.compile of the MoE module itself when its experts have no EDP / HSDP unit; or "
                  "ExpertParallel(..., fsdp=False) with your own FSDP2 units outside the compiled module")

        def fsdp2_hooks_cannot_be_traced(module, args):
            return None

        unit.register_forward_pre_hook(torch.compiler.disable(fsdp2_hooks_cannot_be_traced, reason=reason),
                                       prepend=True)


def parallelize_moe(
    module: nn.Module,
    dims: MoEParallelDims,
    *,
    device_type: str = "cuda",
    mp_policy=None,
    reshard_after_forward: bool = True,
    compile: bool | str = False,
    tp_grads: str = "mean",
) -> nn.Module:
    """Shard every `MoE` in `module` in place by its placement plan (EP, ETP, FSDP2 over EDP / HSDP).

    The `ExpertParallel` style applied to the whole tree by `parallelize_module(..., src_data_rank=None)`:
    each rank slices its own copy of the weights (no broadcast: every rank must hold the same weights, e.g.
    from the same seed). Dense parts outside the MoE layers are left for the caller's own `fully_shard` (on
    `dims.build_meshes(...).dp`), as in torchtitan's parallelize functions. Must run on every rank (it builds
    the meshes: a collective).

    Args:
        module (nn.Module): a model holding `MoE` layers, or an `MoE`; one with no MoE is returned as is.
        dims (MoEParallelDims): the degrees; world_size must be the process group's size.

    Keyword Args:
        device_type (str): the meshes' device type. Default "cuda".
        mp_policy (MixedPrecisionPolicy | None): the layers' FSDP2 units' mixed precision. Default None.
        reshard_after_forward (bool): the layers' FSDP2 units' `reshard_after_forward`. Default True.
        compile (bool | str): each MoE's forward becomes one graph (its FSDP unit's hooks run around it);
            a string names the backend. This, not `torch.compile(..., fullgraph=True)` of a module holding
            the layer's FSDP2 units, is how a parallelized layer compiles (see `ExpertParallel`).
            Default False.
        tp_grads (str): with `dims.tp > 1`, how the tp ranks' gradients combine (`ExpertParallel`'s
            `tp_grads`): "mean" (default) averages over them like over every data-parallel rank, each rank's
            loss its own; "sum" sums them as DTensor sums a TP-sharded weight's.

    Returns:
        nn.Module: `module`, its MoE layers sharded.

    Raises:
        ValueError: degrees that do not fit a layer, or a layer already parallelized, before any collective.

    Example (under torchrun, 4 ranks; docs/compile.md and docs/hf.md run complete ones)::

        dims = MoEParallelDims(world_size=4, ep=2, etp=2)
        parallelize_moe(model, dims, device_type="cuda")
        fully_shard(model, mesh=dims.build_meshes("cuda").dp)  # the dense rest
    """
    check_backend(compile, "parallelize_moe: ")
    check_tp_grads(tp_grads, "parallelize_moe: ")
    layers = moe_layers(module, dims)
    if not layers:
        return module
    check_compilable(layers, compile, "parallelize_moe: ")
    meshes = dims.build_meshes(device_type)
    style = ExpertParallel(meshes=meshes, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward,
                           compile=compile, tp_grads=tp_grads)
    return parallelize_module(module, meshes.tp, style, src_data_rank=None)
