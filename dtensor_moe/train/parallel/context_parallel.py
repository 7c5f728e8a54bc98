"""Context parallelism for the main job's model: each CP rank holds a contiguous part of every sequence.

Its CausalAttention runs on the rank's part with global RoPE positions, keys and values gathered over
cp by the library's `attend_over_cp`; everything else (norms, the MoE, the loss) is per token.
"""

import torch
from torch import nn

from dtensor_moe.parallel.cp_attention import attend_over_cp
from dtensor_moe.train.model import CausalAttention, rope


class ContextParallelAttention(nn.Module):
    """The main job's CausalAttention on its cp rank's contiguous part of the sequence."""

    def __init__(self, cp_mesh):
        super().__init__()
        self.mesh = cp_mesh

    def forward(self, q_BHLK, k_BHLK, v_BHLK):
        L = q_BHLK.shape[-2]  # this rank's part; the whole sequence is cp * L
        key_order = torch.arange(self.mesh.size() * L, device=q_BHLK.device)
        first = self.mesh.get_local_rank() * L
        q_pos_L = key_order[first:first + L]
        q_BHLK, k_BHLK = rope(q_BHLK, q_pos_L), rope(k_BHLK, q_pos_L)
        return attend_over_cp(q_BHLK, k_BHLK, v_BHLK, self.mesh, key_order)


def check_cp_model(model: nn.Module, cp: int):
    """Every attention must be the main job's CausalAttention, which this module knows how to split."""
    blocks = getattr(model, "layers", {})
    bad = [
        i
        for i, b in blocks.items()
        if not isinstance(getattr(getattr(b, "attention", None), "inner_attention", None), CausalAttention)
    ]
    if bad or not blocks:
        raise ValueError(f"cp={cp} needs the main job's model (dtensor_moe.train.model.MoETransformer): blocks {bad} "
                         "have no attention.inner_attention of type CausalAttention")


def apply_cp(model: nn.Module, cp_mesh) -> None:
    for block in model.layers.values():
        block.attention.inner_attention = ContextParallelAttention(cp_mesh)
