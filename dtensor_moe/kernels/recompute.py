"""Which registered ops selective activation checkpointing keeps, declared beside each op's definition.

Recomputing an op that communicates repeats its communication, which "selective" promises not to do, and an
expert GEMM is the most FLOPs per byte kept; everything else is recomputed. Each such op calls `keep` where it is
registered, so a new communication op cannot be left out of a list kept by hand elsewhere
(parallel/compile.py's policy reads `is_kept`).
"""

__all__ = ["keep", "is_kept"]

_KEPT: set = set()


def keep(*ops) -> None:
    """Marks ops whose outputs selective checkpointing saves instead of recomputing.

    Args:
        ops (torch._ops.OpOverload): the ops, e.g. ``torch.ops.dtensor_moe.ep_move.default``.
    """
    _KEPT.update(ops)


def is_kept(op) -> bool:
    """Whether `op` (an OpOverload, as checkpointing's policy sees it) was marked by `keep`.

    Returns:
        bool: True for a kept op.
    """
    return op in _KEPT
