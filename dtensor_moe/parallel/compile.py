"""Activation checkpointing and torch.compile of transformer blocks (torchtitan's tp -> ep -> ac -> compile -> fsdp).

Both wrap a module's `forward` in place, so parameter names stay unchanged, and module hooks, which
FSDP2 uses and torch 2.11-2.13 never trace (its hooks are dynamo-disabled), run outside the graph.
"""

import functools

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from dtensor_moe.kernels import recompute

# The modes live in a torch-free module: train/config.py checks them before torch is imported.
from dtensor_moe.parallel.activation_checkpoint import check_activation_checkpoint
from dtensor_moe.parallel.inductor_grid import guard_empty_y_grid

__all__ = ["apply_activation_checkpointing", "apply_compile", "check_compile_with_ac"]

# Selective checkpointing keeps the outputs of our ops that declare it (kernels/recompute.py: the expert-parallel
# exchange, the expert GEMMs) and of torch's own: the statistics' all-reduce (so recomputation repeats no
# communication) and the dense matmuls.
_TORCH_KEPT = {torch.ops.c10d.allreduce_.default, torch.ops._c10d_functional.all_reduce.default,
               torch.ops._c10d_functional.wait_tensor.default, torch.ops.aten.mm.default}


def _selective_policy(ctx, op, *args, **kwargs):
    kept = op in _TORCH_KEPT or recompute.is_kept(op)
    return CheckpointPolicy.MUST_SAVE if kept else CheckpointPolicy.PREFER_RECOMPUTE


def _keep_nothing(ctx, op, *args, **kwargs):
    return CheckpointPolicy.PREFER_RECOMPUTE


def apply_activation_checkpointing(module: nn.Module, mode: str) -> nn.Module:
    """"full": keep only the block's input and recompute everything (the exchange included);
    "selective": also keep the exchange's and the GEMMs' outputs, so recomputation communicates nothing."""
    check_activation_checkpoint(mode)
    if mode == "none":
        return module
    policy = _selective_policy if mode == "selective" else _keep_nothing
    inner = module.forward

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        return checkpoint(inner, *args, use_reentrant=False,
                          context_fn=functools.partial(create_selective_checkpoint_contexts, policy), **kwargs)

    module.forward = forward
    return module


_NO_REPLAY = "skip_fwd_side_effects_in_bwd_under_checkpoint"


def apply_compile(module: nn.Module, compile: bool | str = True, fullgraph: bool = True) -> nn.Module:
    """Compiles `module.forward`, as one graph unless `fullgraph` is False (then graph breaks are
    allowed: around FSDP hooks inside it); a string `compile` names the torch.compile backend
    (e.g. "aot_eager": the same tracing, no codegen)."""
    backend = compile if isinstance(compile, str) else "inductor"
    if backend == "inductor":
        guard_empty_y_grid()  # torch 2.11: an EP rank that receives no token would crash the launch
    compiled = torch.compile(module.forward, fullgraph=fullgraph, backend=backend)
    # The dispatcher's ops (exchange_tables; ep_move's backward) make data-dependent row counts, which dynamo
    # captures under fullgraph but, without it, breaks the graph at (and falls back to eager for the
    # frame whose backward makes one): capture them in every frame, as fullgraph does.
    patch = {"capture_dynamic_output_shape_ops": True}
    if hasattr(torch._dynamo.config, _NO_REPLAY):
        # Under activation checkpointing the MoE's token counts must not be replayed by the
        # recomputation (eagerly it skips them itself): dynamo's switch for exactly that.
        patch[_NO_REPLAY] = True

    @functools.wraps(compiled)
    def forward(*args, **kwargs):
        with torch._dynamo.config.patch(**patch):
            return compiled(*args, **kwargs)

    module.forward = forward
    return module


def check_compile_with_ac(activation_checkpoint: str, compile, prefix: str = ""):
    """What compile and activation checkpointing need, checked before any collective."""
    check_activation_checkpoint(activation_checkpoint, prefix)
    if not compile:
        return
    if activation_checkpoint != "none":
        # torch 2.13's AOTAutograd fails to save the DeviceMesh of DTensor weight gradients inside a
        # compiled checkpoint region ("tensors_saved_with_vc_check").
        raise ValueError(
            f"{prefix}activation_checkpoint={activation_checkpoint!r} together with {prefix}compile is not "
            f"supported yet; valid: {prefix}compile with activation_checkpoint 'none', or activation "
            "checkpointing without compile"
        )
