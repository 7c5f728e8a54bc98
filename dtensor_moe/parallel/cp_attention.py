"""Context parallelism's attention: each CP rank holds a part of every sequence.

Attention is the only place where a token needs the others: each rank rotates its own queries and
keys at their global positions, all-gathers the keys and values over cp (a DTensor redistribute,
whose backward reduce-scatters their gradients) and masks causally by global position
(`attend_over_cp`: the main job's contiguous parts, torchtitan's head-tail parts under the hook).
Everything else (norms, the MoE, the loss) is per token. torch's experimental `context_parallel`
(ring attention) patches SDPA for CUDA backends; this all-gather form runs on every backend, gloo
included, at the cost of holding a whole sequence's K and V per rank.
"""

import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

__all__ = ["attend_over_cp"]


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
