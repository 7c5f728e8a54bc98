"""AdamW, warmup + cosine LR, and gradient clipping whose norm is global across meshes.

Dense and expert parameters are DTensors on different meshes, so one `clip_grad_norm_` over all of
them cannot combine their norms (torchtitan issue #1541). Each mesh's norm is reduced on its own
mesh, then the squares are added: every element is counted exactly once, whatever the placements.
"""

import math
from collections import defaultdict

import torch
from torch.distributed.tensor import DTensor


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
    by_mesh = defaultdict(list)
    for p in params:
        if p.grad is not None:
            by_mesh[p.grad.device_mesh if isinstance(p.grad, DTensor) else None].append(p.grad)
    norms = []
    for grads in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(grads, foreach=False)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    return torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.tensor(0.0)


def clip_grad_norm_(params, max_norm: float, pp_group=None) -> torch.Tensor:
    """`pp_group`: the pipeline stages of this rank (each holds other parameters); their norms combine too."""
    params = [p for p in params if p.grad is not None]
    norm = global_grad_norm(params)
    if pp_group is not None:
        norm = norm**2
        torch.distributed.all_reduce(norm, group=pp_group)
        norm = norm.sqrt()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=False)
    return norm
