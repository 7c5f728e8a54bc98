"""The main job's parallelize function: torchtitan's chain tp -> ep -> ac -> compile -> fsdp over its model."""

from torch import nn
from torch.distributed.fsdp import fully_shard

from dtensor_moe.parallel.compile import apply_activation_checkpointing, apply_compile, check_compile
from dtensor_moe.parallel.mesh import MoEParallelDims
from dtensor_moe.parallel.shard import dp_fsdp_mesh, fsdp_kwargs, moe_layers, shard_and_connect
from dtensor_moe.train.parallel.context_parallel import apply_cp, check_cp_model
from dtensor_moe.train.parallel.tensor_parallel import apply_tp, check_tp_model


def check_model_parallel(dims: MoEParallelDims, compile, prefix: str = ""):
    """What dense TP, CP and PP need of parallelize_model's other options, checked before any collective."""
    if compile and dims.pp > 1:
        raise ValueError(f"{prefix}compile is not supported with pp > 1 yet (each MoE's load-balancing loss is "
                         "attached to its output by a module hook); valid: compile=false, or pp=1")
    if compile and dims.tp * dims.cp > 1:
        # A compiled block is one FSDP unit on the dense mesh, but under TP the MoE's dense weights
        # shard over tp too (another mesh), and CP's K/V all-gather is a DTensor redistribute.
        raise ValueError(f"{prefix}compile with tp={dims.tp}, cp={dims.cp} is not supported yet; valid: compile with "
                         "tp = cp = 1, or tp/cp without compile")


def parallelize_model(
    model: nn.Module,
    dims: MoEParallelDims,
    *,
    device_type: str = "cuda",
    mp_policy=None,
    reshard_after_forward: bool = True,
    compile: bool | str = False,
    activation_checkpoint: str = "none",
) -> nn.Module:
    """torchtitan's chain for any model whose blocks are in `model.layers`: expert sharding (EP,
    ETP), activation checkpointing ("none" | "full" | "selective"), compile (each block one graph),
    then FSDP2/HSDP on each block and the root (embeddings, head; tied embeddings stay there).

    Eagerly each MoE is its own FSDP unit (experts over EDP, router and shared experts over the
    data-parallel ranks); compiled, the block's unit takes the MoE's dense weights too, so every
    FSDP hook runs outside the block's graph, and under EDP / HSDP the experts gather their weights
    inside it (see shard_moe_layer's `experts_unit`).

    `dims.tp > 1`: the main job's model gets dense tensor parallelism with sequence parallelism
    (tensor_parallel.py), FSDP2 then shards its weights over the data-parallel ranks too
    (2-D). `dims.cp > 1`: each rank holds a contiguous part of every sequence; attention gathers
    the keys and values over cp (context_parallel.py).
    """
    check_compile(activation_checkpoint, compile)
    check_model_parallel(dims, compile)
    if dims.tp > 1:
        check_tp_model(model, dims.tp)
    if dims.cp > 1:
        check_cp_model(model, dims.cp)
    layers = moe_layers(model, dims)
    meshes = dims.build_meshes(device_type)
    unit_kwargs = fsdp_kwargs(mp_policy, reshard_after_forward)
    for m, moe_plans in layers:
        shard_and_connect(m, moe_plans, dims, meshes, None if compile else unit_kwargs, experts_unit=not compile,
                          sum_over_tp=True)
    if dims.tp > 1:
        apply_tp(model, meshes.tp)
    if dims.cp > 1:
        apply_cp(model, meshes.dense["cp"])
    # Compiled experts are in no FSDP unit (eagerly the MoE's own units take care of them).
    experts = {p for m, _ in layers for p in m.experts.parameters()} if compile else None
    kwargs = {"mesh": dp_fsdp_mesh(meshes, dims)}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    blocks = model.layers.values() if isinstance(model.layers, nn.ModuleDict) else model.layers
    for block in blocks:
        apply_activation_checkpointing(block, activation_checkpoint)
        if compile:
            apply_compile(block, compile)
        fully_shard(block, reshard_after_forward=reshard_after_forward, ignored_params=experts, **kwargs)
    # The root's parameters are needed again right after forward (loss head), so keep them gathered.
    fully_shard(model, reshard_after_forward=False, ignored_params=experts, **kwargs)
    return model
