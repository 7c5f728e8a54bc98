"""The main job's parallelize function: torchtitan's chain tp -> ep -> ac -> compile -> fsdp over its model."""

from torch import nn

from dtensor_moe.parallel.blocks import parallelize_blocks
from dtensor_moe.parallel.compile import check_compile_with_ac
from dtensor_moe.parallel.mesh import MoEParallelDims
from dtensor_moe.train.parallel.context_parallel import apply_cp, check_cp_model
from dtensor_moe.train.parallel.tensor_parallel import apply_tp, check_tp_model

__all__ = ["parallelize_transformer"]


def check_compile_with_dense_parallel(dims: MoEParallelDims, compile, prefix: str = ""):
    """What dense TP, CP and PP need of parallelize_transformer's other options, checked before any collective."""
    if compile and dims.pp > 1:
        raise ValueError(f"{prefix}compile is not supported with pp > 1 yet (each MoE's load-balancing loss is "
                         "attached to its output by a module hook); valid: compile=false, or pp=1")
    if compile and dims.tp * dims.cp > 1:
        # A compiled block is one FSDP unit on the dense mesh, but under TP the MoE's dense weights
        # shard over tp too (another mesh), and CP's K/V all-gather is a DTensor redistribute.
        raise ValueError(f"{prefix}compile with tp={dims.tp}, cp={dims.cp} is not supported yet; valid: compile with "
                         "tp = cp = 1, or tp/cp without compile")


def parallelize_transformer(
    model: nn.Module,
    dims: MoEParallelDims,
    *,
    device_type: str = "cuda",
    mp_policy=None,
    reshard_after_forward: bool = True,
    compile: bool | str = False,
    activation_checkpoint: str = "none",
) -> nn.Module:
    """`parallelize_blocks` (ep -> ac -> compile -> fsdp) for any model whose blocks are in `model.layers`,
    with the main job's dense TP and CP between expert sharding and FSDP.

    `dims.tp > 1`: the main job's model gets dense tensor parallelism with sequence parallelism
    (tensor_parallel.py), FSDP2 then shards its weights over the data-parallel ranks too
    (2-D). `dims.cp > 1`: each rank holds a contiguous part of every sequence; attention gathers
    the keys and values over cp (context_parallel.py).
    """
    check_compile_with_ac(activation_checkpoint, compile)
    check_compile_with_dense_parallel(dims, compile)
    if dims.tp > 1:
        check_tp_model(model, dims.tp)
    if dims.cp > 1:
        check_cp_model(model, dims.cp)

    def dense(meshes):
        if dims.tp > 1:
            apply_tp(model, meshes.tp)
        if dims.cp > 1:
            apply_cp(model, meshes.dense["cp"])

    blocks = model.layers.values() if isinstance(model.layers, nn.ModuleDict) else model.layers
    # The main job's loss is replicated over tp (its dense TP weights' gradients sum over tp): so do the MoEs'.
    return parallelize_blocks(model, blocks, dims, device_type=device_type, mp_policy=mp_policy,
                              reshard_after_forward=reshard_after_forward, compile=compile,
                              activation_checkpoint=activation_checkpoint, dense=dense, tp_grads="sum")
