"""Context parallelism: each CP rank holds a contiguous part of every sequence.

Attention is the only place where a token needs the others: each rank rotates its own queries and
keys at their global positions, all-gathers the keys and values over cp (a DTensor redistribute,
whose backward reduce-scatters their gradients) and masks causally by global position
(`attend_over_cp`; the torchtitan hook uses it too, on torchtitan's head-tail parts of the
sequence). Everything else (norms, the MoE, the loss) is per token. torch's experimental
`context_parallel` (ring attention) patches SDPA for CUDA backends; this all-gather form runs on
every backend, gloo included, at the cost of holding a whole sequence's K and V per rank.
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from dtensor_moe.train.model import CausalAttention, rope


def attend_over_cp(q_BHLK, k_BHLK, v_BHLK, cp_mesh, key_order, **sdpa_kwargs):
    """Attention of this rank's queries over the keys and values of every cp rank, causal by
    sequence index. `key_order`: the index in the whole sequence of each gathered key row (the cp
    ranks' parts in rank order), so this rank's queries are its `get_local_rank()`-th part of it;
    None: not causal. `sdpa_kwargs` go to scaled_dot_product_attention (scale, enable_gqa)."""
    # Every rank's queries take gradients from every key: the gathered K/V gradient is a partial sum.
    k_all, v_all = (DTensor.from_local(t, cp_mesh, [Shard(2)]).redistribute(cp_mesh, [Replicate()])
                    .to_local(grad_placements=[Partial()]) for t in (k_BHLK, v_BHLK))
    mask = None
    if key_order is not None:
        L = q_BHLK.shape[-2]
        first = cp_mesh.get_local_rank() * L
        mask = key_order[None, :] <= key_order[first:first + L, None]
    return F.scaled_dot_product_attention(q_BHLK, k_all, v_all, attn_mask=mask, **sdpa_kwargs)


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
    bad = [i for i, b in blocks.items() if not isinstance(getattr(getattr(b, "attention", None), "inner_attention", None),
                                                             CausalAttention)]
    if bad or not blocks:
        raise ValueError(f"cp={cp} needs the main job's model (dtensor_moe.train.model.MoETransformer): blocks {bad} "
                         "have no attention.inner_attention of type CausalAttention")


def apply_cp(model: nn.Module, cp_mesh) -> None:
    for block in model.layers.values():
        block.attention.inner_attention = ContextParallelAttention(cp_mesh)
