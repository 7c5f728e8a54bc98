"""Activation checkpointing's side of the kernels: which registered ops selective checkpointing keeps, declared
beside each op's definition, and whether a forward is a recomputation.

Recomputing an op that communicates repeats its communication, which "selective" promises not to do, and an
expert GEMM is the most FLOPs per byte kept; everything else is recomputed. Each such op calls `keep` where it is
registered, so a new communication op cannot be left out of a list kept by hand elsewhere
(parallel/compile.py's policy reads `is_kept`).
"""

import torch

__all__ = ["keep", "is_kept", "recomputing"]

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


def recomputing() -> bool:
    """Whether this forward is eager activation checkpointing's recomputation (it runs inside backward), so that
    what a forward counts or records once is not counted again. Compiled graphs recompute inside the backward
    graph, which never replays mutations.

    Returns:
        bool: True inside an eager recomputation.
    """
    if torch.compiler.is_compiling():
        return False
    current = getattr(torch._C, "_current_graph_task_id", None)
    return current is not None and current() != -1
