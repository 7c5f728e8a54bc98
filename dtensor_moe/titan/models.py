"""Tiny torchtitan MoE models for CPU ranks (torchtitan's own debug flavors need a GPU).

`deepseek_v3_tiny`: the architecture of torchtitan's `deepseek_v3` "debugmodel" (MLA attention, one
dense layer then MoE layers with shared experts, softmax top-k routing, YaRN RoPE), built with
torchtitan's own `build_mla_moe_layers`; only the sizes are smaller. `**routing` switches it to
DeepSeek-V3's own routing (sigmoid, groups, route_norm, route_scale), as Hugging Face's
DeepseekV3 has it. `qwen3_moe_tiny`: torchtitan's qwen3 "debugmodel_moe" architecture (GQA with
q/k norms, every layer MoE, softmax top-k renormalized), shrunk the same way. Attention is plain
causal SDPA in both because FlexAttention has no CPU backward (documents packed into one sequence
attend across boundaries).
"""

from functools import partial

from torch import nn
from torchtitan.models.common import ComplexRoPE, CosSinRoPE, Embedding, Linear, RMSNorm
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.deepseek_v3 import DeepSeekV3Model, build_mla_moe_layers
from torchtitan.models.qwen3 import Qwen3Model, _build_qwen3_moe_layers

_LINEAR = {"weight": partial(nn.init.trunc_normal_, std=0.02), "bias": nn.init.zeros_}
_EXPERTS = {name: partial(nn.init.trunc_normal_, std=0.02) for name in ("w1_EFD", "w2_EDF", "w3_EFD")}
_NORM = {"weight": nn.init.ones_}


def deepseek_v3_tiny(vocab_size: int, max_seq_len: int = 256, eps: float = 1e-5, **routing) -> DeepSeekV3Model.Config:
    """`routing`: build_mla_moe_layers' router_* arguments (default: softmax, no groups); `eps`: every
    RMSNorm's (Hugging Face's DeepseekV3 fixes its kv_a_layernorm's at 1e-6)."""
    dim, rope_dim = 64, 8
    layers = build_mla_moe_layers(
        n_layers=3,
        n_dense_layers=1,
        dim=dim,
        n_heads=4,
        q_lora_rank=0,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=rope_dim,
        v_head_dim=16,
        mscale=0.70,
        dense_hidden_dim=128,
        moe_hidden_dim=32,
        num_experts=8,
        num_shared_experts=1,
        router_top_k=2,
        **{"router_score_func": "softmax", **routing},
        attn_backend="flex",
        moe_comm_backend="standard",
        non_blocking_capacity_factor=None,
        linear_init=_LINEAR,
        norm_init=_NORM,
        depth_init=lambda layer_id: _LINEAR,
        depth_experts_init=lambda layer_id: _EXPERTS,
        rope=ComplexRoPE.Config(
            dim=rope_dim,
            max_seq_len=max_seq_len,
            theta=10000.0,
            scaling="yarn",
            rope_factor=40.0,
            beta_fast=32.0,
            beta_slow=1.0,
            original_seq_len=max_seq_len,
        ),
    )
    for layer in layers:
        layer.attention_norm.eps = layer.ffn_norm.eps = layer.attention.kv_norm.eps = eps
    return DeepSeekV3Model.Config(**_decoder(vocab_size, dim, layers, embedding_std=1.0, eps=eps))


def _decoder(vocab_size: int, dim: int, layers, embedding_std: float, eps: float) -> dict:
    """The model config's fields around the layers (embedding, final norm, head), with SDPA attention."""
    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return dict(
        vocab_size=vocab_size,
        dim=dim,
        tok_embeddings=Embedding.Config(
            num_embeddings=vocab_size, embedding_dim=dim,
            param_init={"weight": partial(nn.init.normal_, std=embedding_std)},
        ),
        norm=RMSNorm.Config(normalized_shape=dim, eps=eps, param_init=_NORM),
        lm_head=Linear.Config(in_features=dim, out_features=vocab_size, param_init=_LINEAR),
        layers=layers,
    )


def qwen3_moe_tiny(vocab_size: int, max_seq_len: int = 256) -> Qwen3Model.Config:
    dim, head_dim = 64, 16
    layers = _build_qwen3_moe_layers(
        fuse_qkv=True,
        n_layers=2,
        dim=dim,
        n_heads=4,
        n_kv_heads=2,
        head_dim=head_dim,
        moe_hidden_dim=32,
        num_experts=8,
        top_k=2,
        attn_backend="flex",
        moe_comm_backend="standard",
        rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=max_seq_len, theta=1000000.0),
    )
    return Qwen3Model.Config(**_decoder(vocab_size, dim, layers, embedding_std=0.02, eps=1e-6))
