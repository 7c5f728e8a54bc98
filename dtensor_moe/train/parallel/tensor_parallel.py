"""Dense tensor parallelism with sequence parallelism: tp_styles.py's styles as DTensor parallel styles.

Only `parallelize_module` styles move activations (no hand-written collectives). Sequence
parallelism hands each TP rank its own slice of every sequence between blocks, so an MoE there is
data-parallel over tp: see `dtensor_moe.parallel.shard.scale_moe_gradients` for the one thing that changes
around it.
"""

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from dtensor_moe.train.parallel.tp_styles import TP_BLOCK_STYLES, TP_ROOT_STYLES, check_tp_heads, check_tp_untied

_STYLES = {
    "embedding": lambda: RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
    "sequence": lambda: SequenceParallel(),
    "sequence_local": lambda: SequenceParallel(use_local_output=True),
    "gather_seq": lambda: PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
    "colwise": lambda: ColwiseParallel(),
    "rowwise": lambda: RowwiseParallel(output_layouts=Shard(1)),
    "head": lambda: ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
}


def check_tp_model(model: nn.Module, tp: int):
    """What the TP styles need from the model, checked before any collective."""
    cfg = getattr(model, "config", None)
    check_tp_untied(getattr(cfg, "tie_embeddings", False), tp)
    # A pipeline stage has None for the ends another stage holds.
    missing = [p for p, _ in TP_ROOT_STYLES if getattr(model, p, False) is not None and not _has(model, p)]
    missing += [f"layers.{i}.{p}" for i, b in getattr(model, "layers", {}).items() for p, _ in TP_BLOCK_STYLES
                if not _has(b, p)]
    if missing or cfg is None:
        raise ValueError(f"tp={tp} needs the main job's model (dtensor_moe.train.model.MoETransformer); "
                         f"missing modules {missing or ['config']}")
    check_tp_heads(cfg.n_heads, tp)


def _has(module: nn.Module, path: str) -> bool:
    try:
        module.get_submodule(path)
    except AttributeError:
        return False
    return True


def apply_tp(model: nn.Module, tp_mesh) -> None:
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, {p: _STYLES[s]() for p, s in TP_BLOCK_STYLES})
    parallelize_module(model, tp_mesh, {p: _STYLES[s]() for p, s in TP_ROOT_STYLES if getattr(model, p) is not None})
