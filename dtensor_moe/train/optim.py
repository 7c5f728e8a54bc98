"""AdamW, warmup + cosine LR, and gradient clipping whose norm is global across meshes.

Dense and expert parameters are DTensors on different meshes, so one `clip_grad_norm_` over all of
them cannot combine their norms (torchtitan issue #1541). Each mesh's squared norm is summed over the
mesh dims its gradients are split on, then the squares are added: every element is counted exactly
once, whatever the placements.
"""

import math
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

__all__ = ["build_optimizer", "build_scheduler", "clip_grad_norm_", "global_grad_norm"]


def build_optimizer(model, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    # foreach kernels group tensors by device and dtype, not by mesh; per-parameter is mesh-safe.
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, betas=(0.9, 0.95), foreach=False)


def build_scheduler(optimizer, warmup_steps: int, total_steps: int, min_ratio: float):
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def global_grad_norm(params) -> torch.Tensor:
    """The 2-norm of all of `params`' gradients together, the same on every rank.

    The sums over mesh dims are plain c10d all-reduces, not DTensor's full_tensor / redistribute: those issue
    functional collectives, which crash a gloo process group on CUDA tensors (torch 2.11; parallel.backend = gloo on
    GPUs), and this runs every step. Replicate dims hold copies, so only the other dims are summed over."""
    by_split = defaultdict(list)  # (mesh, the mesh dims the local gradients are disjoint parts over) -> gradients
    for p in params:
        g = p.grad
        if g is None:
            continue
        if isinstance(g, DTensor):
            if any(pl.is_partial() for pl in g.placements):  # a norm of partial sums is no sum of norms
                g = g.redistribute(placements=[Replicate() if pl.is_partial() else pl for pl in g.placements])
            split = tuple(i for i, pl in enumerate(g.placements) if not pl.is_replicate())
            by_split[g.device_mesh, split].append(g.to_local())
        else:
            by_split[None, ()].append(g)
    squares = []
    for (mesh, split), grads in by_split.items():
        square = torch.nn.utils.get_total_norm(grads, foreach=False) ** 2
        for dim in split:
            dist.all_reduce(square, group=mesh.get_group(dim))
        squares.append(square)
    return torch.stack(squares).sum().sqrt() if squares else torch.tensor(0.0)


def clip_grad_norm_(params, max_norm: float, pp_group=None) -> torch.Tensor:
    """`pp_group`: the pipeline stages of this rank (each holds other parameters); their norms combine too."""
    params = [p for p in params if p.grad is not None]
    norm = global_grad_norm(params)
    if pp_group is not None:
        norm = norm**2
        dist.all_reduce(norm, group=pp_group)
        norm = norm.sqrt()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=False)
    return norm
