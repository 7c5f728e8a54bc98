"""torchtitan's parallelize chain for any decoder whose blocks sit in one container: ep -> (the caller's dense
parallelism) -> ac -> compile -> fsdp. The main job's model and Hugging Face causal LMs both go through it.
`parallelize_moe` is the same chain for MoE layers alone."""

from typing import Callable, Iterable

from torch import nn
from torch.distributed.fsdp import fully_shard

from dtensor_moe.moe import MoE
from dtensor_moe.parallel.compile import apply_activation_checkpointing, apply_compile, check_compile_with_ac
from dtensor_moe.parallel.mesh import MoEMeshes, MoEParallelDims
from dtensor_moe.parallel.shard import (
    DEFAULT_TP_GRADS,
    check_tp_grads,
    dp_fsdp_mesh,
    fsdp_kwargs,
    fully_shard_layer,
    moe_placement_plans,
    place_layer,
)

__all__ = ["parallelize_blocks"]


def parallelize_blocks(
    model: nn.Module,
    blocks: Iterable[nn.Module],
    dims: MoEParallelDims,
    *,
    device_type: str = "cuda",
    mp_policy=None,
    reshard_after_forward: bool = True,
    compile: bool | str = False,
    activation_checkpoint: str = "none",
    dense: Callable[[MoEMeshes], None] | None = None,
    tp_grads: str = DEFAULT_TP_GRADS,
) -> nn.Module:
    """Expert sharding of every `MoE` in `model` (EP, ETP: `place_layer`, as `ExpertParallel` places a layer), then
    `dense(meshes)` (the model's own TP / CP, if any), then per block activation checkpointing ("none" | "full" |
    "selective"), compile (each block one graph) and an FSDP2/HSDP unit, and one unit for the root (embeddings,
    head; tied embeddings stay there).

    Eagerly each MoE is its own FSDP unit (experts over EDP, router and shared experts over the data-parallel
    ranks: `fully_shard_layer`, made just before its block's); compiled, the block's unit takes the MoE's dense
    weights too, so every FSDP hook runs outside the block's graph, and under EDP / HSDP the experts gather their
    weights inside it (`gather_in_forward`). `tp_grads` (dtensor_moe.parallel.shard.TP_GRADS): with
    `dims.tp > 1`, how the MoEs' gradients combine over the tp ranks; "sum" (default) matches the dense TP
    weights' (the loss of a tp group)."""
    check_compile_with_ac(activation_checkpoint, compile)
    check_tp_grads(tp_grads)
    layers = moe_placement_plans(model, dims)
    meshes = dims.build_meshes(device_type)
    unit_kwargs = fsdp_kwargs(mp_policy, reshard_after_forward)
    for m, moe_plans in layers:
        place_layer(m, moe_plans, dims, meshes, tp_grads=tp_grads, gather_in_forward=bool(compile))
    if dense is not None:
        dense(meshes)
    # Compiled experts are in no FSDP unit (eagerly the MoE's own units take care of them).
    experts = {p for m, _ in layers for p in m.experts.parameters()} if compile else None
    kwargs = {"mesh": dp_fsdp_mesh(meshes, dims)}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    unsharded = [] if compile else [m for m, _ in layers]  # eagerly, each MoE's units before its block's
    for block in blocks:
        apply_activation_checkpointing(block, activation_checkpoint)
        if compile:
            apply_compile(block, compile)
        unsharded = _fully_shard_moes(unsharded, unit_kwargs, inside=block)
        fully_shard(block, reshard_after_forward=reshard_after_forward, ignored_params=experts, **kwargs)
    _fully_shard_moes(unsharded, unit_kwargs)
    # The root's parameters are needed again right after forward (loss head), so keep them gathered.
    fully_shard(model, reshard_after_forward=False, ignored_params=experts, **kwargs)
    return model


def _fully_shard_moes(moes: list[MoE], unit_kwargs: dict, inside: nn.Module | None = None) -> list[MoE]:
    """The FSDP2 units of those of `moes` inside `inside` (all, if None); returns the others."""
    held = set(inside.modules()) if inside is not None else None
    for m in moes:
        if held is None or m in held:
            fully_shard_layer(m, unit_kwargs)
    return [m for m in moes if held is not None and m not in held]
