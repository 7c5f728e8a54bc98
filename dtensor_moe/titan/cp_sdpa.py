"""Context parallelism in the torchtitan hook: dtensor_moe's all-gather-KV attention in torchtitan's SDPA.

torchtitan 0.3.0 shards each batch for CP in its train step (`prepare_context_parallel_input`: inputs,
labels and RoPE positions split along the sequence, in head-tail order by default), independently of
the attention; the model then rotates every token at its own position. Its attention side wraps SDPA
in DTensors for torch's context-parallel dispatcher, which fails on CPU gloo ranks ("aten.add got
mixed torch.Tensor and DTensor"). The hook keeps torchtitan's sharding and replaces only the attention
side: every `ScaledDotProductAttention` attends over the keys and values of the whole sequence,
all-gathered over cp, causally by sequence index (`attend_over_cp`, the main job's CP attention).
The index of each gathered key is torchtitan's own sharding of `arange(seq_len)`, all-gathered once
per sequence length, so any load balancer torchtitan shards SDPA's inputs with lines up.

Installed, like torchtitan's own CP wrapper, as the inner attention's `forward` before dense TP's
`Module.parallelize`, so that under TP it runs inside torchtitan's local_map on local tensors (each
TP rank's heads).
"""

import torch
from torch.distributed.tensor import DTensor, Shard
from torchtitan.distributed.context_parallel import cp_shard

from dtensor_moe.parallel.cp_attention import attend_over_cp


class _AttendOverCP:
    """torchtitan's ScaledDotProductAttention.forward (same arguments, (B, L, H, K) layout) on this
    cp rank's part of every sequence."""

    def __init__(self, cp_mesh, load_balancer: str | None):
        self.mesh, self.load_balancer = cp_mesh, load_balancer
        self.key_orders: dict[int, torch.Tensor] = {}  # whole sequence length -> gathered key order

    def key_order(self, seq_len: int, device) -> torch.Tensor:
        if seq_len not in self.key_orders:
            with torch.no_grad():
                (mine,), _ = cp_shard(self.mesh, (torch.arange(seq_len, device=device)[None],), None,
                                      self.load_balancer)
                self.key_orders[seq_len] = DTensor.from_local(mine[0], self.mesh, [Shard(0)]).full_tensor()
        return self.key_orders[seq_len]

    def __call__(self, q_BLHK, k_BLHK, v_BLHK, *, attention_masks=None, scale=None, enable_gqa=False,
                 is_causal=True, **kwargs):
        if attention_masks is not None:  # as torchtitan's SDPA: causal or not, no masks
            raise ValueError("ScaledDotProductAttention does not support attention_masks")
        q_BHLK, k_BHLK, v_BHLK = (t.transpose(1, 2) for t in (q_BLHK, k_BLHK, v_BLHK))
        key_order = self.key_order(self.mesh.size() * q_BHLK.shape[-2], q_BHLK.device) if is_causal else None
        o_BHLK = attend_over_cp(q_BHLK, k_BHLK, v_BHLK, self.mesh, key_order, scale=scale, enable_gqa=enable_gqa)
        return o_BHLK.transpose(1, 2)


def apply_cp(blocks, cp_mesh, load_balancer: str | None) -> None:
    """Every block's inner attention (SDPA, checked while parsing) attends over the gathered keys
    and values; one forward for all, so the key order is gathered once per sequence length."""
    forward = _AttendOverCP(cp_mesh, load_balancer)
    for block in blocks:
        block.attention.inner_attention.forward = forward
