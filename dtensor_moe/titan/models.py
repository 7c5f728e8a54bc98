"""Tiny torchtitan MoE models for CPU ranks (torchtitan's own debug flavors need a GPU), and the folding
search's view of any torchtitan MoE decoder (`shape_from_titan_config`).

`deepseek_v3_tiny`: the architecture of torchtitan's `deepseek_v3` "debugmodel" (MLA attention, one
dense layer then MoE layers with shared experts, softmax top-k routing, YaRN RoPE), built with
torchtitan's own `build_mla_moe_layers`; only the sizes are smaller. `**routing` switches it to
DeepSeek-V3's own routing (sigmoid, groups, route_norm, route_scale), as Hugging Face's
DeepseekV3 has it. `qwen3_moe_tiny`: torchtitan's qwen3 "debugmodel_moe" architecture (GQA with
q/k norms, every layer MoE, softmax top-k renormalized), shrunk the same way. Attention is plain
causal SDPA in both because FlexAttention has no CPU backward (documents packed into one sequence
attend across boundaries). `gpt_oss_tiny`: torchtitan's gpt_oss "debugmodel" architecture (GQA with
biases and attention sinks, sliding-window layers alternating with full ones, biased router and experts
with the clamped SwiGLU) at those sizes; its attention is `SinkWindowAttention`, which hands the sinks their
log-sum-exp as torchtitan's Flex and varlen backends do (those need a GPU).
"""

from dataclasses import dataclass, replace
from functools import partial

import torch
from torch import nn
from torchtitan.models.common import ComplexRoPE, CosSinRoPE, Embedding, Linear, RMSNorm
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.deepseek_v3 import DeepSeekV3Model, build_mla_moe_layers
from torchtitan.models.gpt_oss import GptOssModel, _build_gptoss_layers, _make_gptoss_attn_config
from torchtitan.models.qwen3 import Qwen3Model, _build_qwen3_moe_layers
from torchtitan.protocols.module import Module

from dtensor_moe.config import MoEConfig
from dtensor_moe.tools.presets import ModelShape

from .parallelize_titan import moe_config

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


class SinkWindowAttention(Module):
    """Causal attention in plain torch ops (CPU: backward everywhere), within the last `window_size` positions
    when set (the query's own included, as torchtitan's sliding-window mask). Like torchtitan's Flex and varlen
    backends it hands the model's `out_transform` (gpt-oss's sinks) the log-sum-exp of each query's scores."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        window_size: int | None = None

    def __init__(self, config: Config):
        super().__init__()
        self.window_size = config.window_size

    def forward(self, q_BLHK, k_BLHK, v_BLHK, *, scale=None, enable_gqa=False, out_transform=None, **kwargs):
        q_BHLK, k_BHLK, v_BHLK = (t.transpose(1, 2) for t in (q_BLHK, k_BLHK, v_BLHK))
        if enable_gqa:  # query head h reads key head h // (n_heads / n_kv_heads), as SDPA's enable_gqa
            k_BHLK, v_BHLK = (t.repeat_interleave(q_BHLK.shape[1] // t.shape[1], dim=1) for t in (k_BHLK, v_BHLK))
        L = q_BHLK.shape[2]
        back_LL = torch.arange(L)[:, None] - torch.arange(L)[None, :]
        keep_LL = (back_LL >= 0) & (back_LL < (self.window_size or L))
        scores_BHLL = (q_BHLK @ k_BHLK.transpose(-2, -1)) * (scale or q_BHLK.shape[-1] ** -0.5)
        scores_BHLL = scores_BHLL.masked_fill(~keep_LL.to(scores_BHLL.device), float("-inf"))
        out_BLHK = (torch.softmax(scores_BHLL, dim=-1) @ v_BHLK).transpose(1, 2)
        if out_transform is None:
            return out_BLHK
        return out_transform(out_BLHK, torch.logsumexp(scores_BHLL, dim=-1).transpose(1, 2))


def gpt_oss_tiny(vocab_size: int, max_seq_len: int = 256, window: int = 8) -> GptOssModel.Config:
    """`window`: the sliding-window layers' (torchtitan's 128 would not bind at the CPU configs' 32 positions)."""
    dim, head_dim = 64, 16
    rope = CosSinRoPE.Config(dim=head_dim, max_seq_len=max_seq_len, theta=150000.0, scaling="yarn", rope_factor=32,
                             beta_fast=32.0, beta_slow=1.0, truncate=False, original_seq_len=max_seq_len)
    layers = _build_gptoss_layers(dim=dim, n_layers=2, hidden_dim=32, num_experts=8, top_k=2, load_balance_coeff=1e-3,
                                  attn_backend="flex", moe_comm_backend="standard", rope=rope)
    for i, layer in enumerate(layers):
        sliding = window if layer.attention.sliding_window_size is not None else None
        layer.attention = _make_gptoss_attn_config(dim=dim, layer_id=i, attn_backend="flex", n_heads=4, n_kv_heads=2,
                                                   head_dim=head_dim, sliding_window_size=sliding, rope=rope)
    # eps: torchtitan's RMSNorm default, as its gpt-oss layers' norms have it.
    config = GptOssModel.Config(**_decoder(vocab_size, dim, layers, embedding_std=0.02, eps=1e-5))
    for layer in layers:
        layer.attention.inner_attention = SinkWindowAttention.Config(window_size=layer.attention.sliding_window_size)
    return config


def shape_from_titan_config(model_config, name: str) -> ModelShape:
    """The folding search's `ModelShape` (dtensor_moe/tools/presets.py) of the torchtitan decoder `model_config` builds,
    read off that model on the meta device: torchtitan's own sizes. Multi-token-prediction layers are left
    out, as the presets leave DeepSeek-V3's out. The folding search prices one attention and one MoE shape
    for every layer, with the dense-FFN layers first: a model that differs raises ValueError."""
    with torch.device("meta"):
        model = model_config.build()
    blocks = list(model.layers.values())
    moes = [b.moe for b in blocks if getattr(b, "moe_enabled", False)]
    n_dense = len(blocks) - len(moes)
    if not moes or any(getattr(b, "moe_enabled", False) for b in blocks[:n_dense]):
        raise ValueError(f"{name}: `dtensor-moe plan` needs MoE layers after the dense-FFN ones; got MoE layers "
                         f"{[i for i, b in enumerate(blocks) if getattr(b, 'moe_enabled', False)]} of {len(blocks)}")
    config = _moe_config(moes[0])
    attention = tuple((f"attention.{n}", tuple(p.shape)) for n, p in blocks[0].attention.named_parameters())
    for i, block in enumerate(blocks):
        if tuple((f"attention.{n}", tuple(p.shape)) for n, p in block.attention.named_parameters()) != attention:
            raise ValueError(f"{name}: layers[{i}].attention differs from layers[0].attention; "
                             "`dtensor-moe plan` prices one attention shape for every layer")
    if any(_moe_config(m) != config for m in moes):
        raise ValueError(f"{name}: its MoE layers differ; `dtensor-moe plan` prices one MoE shape for every layer")
    vocab_size, dim = model.tok_embeddings.weight.shape
    return ModelShape(
        name=name,
        vocab_size=vocab_size,
        n_layers=len(blocks),
        moe=config,
        attention=attention,
        kv_width=_kv_width(model_config.layers[0].attention, name),
        n_dense_layers=n_dense,
        dense_hidden_dim=blocks[0].feed_forward.w1.weight.shape[0] if n_dense else 0,
        tie_embeddings=bool(getattr(model_config, "enable_weight_tying", False)),
    )


def _moe_config(moe) -> MoEConfig:
    """The hook's MoEConfig of a torchtitan MoE plus its routing groups (which set the search's dispatch rows)."""
    router = moe.router
    return replace(moe_config(moe), num_expert_groups=router.num_expert_groups or 1,
                   num_limited_groups=router.num_limited_groups or 1)


def _kv_width(attention, name: str) -> int:
    """K plus V features per token, as the hook's CP attention gathers them (MLA's after its up-projection)."""
    if hasattr(attention, "qk_nope_head_dim"):  # DeepSeek's multi-head latent attention
        return attention.n_heads * (attention.qk_nope_head_dim + attention.qk_rope_head_dim + attention.v_head_dim)
    if hasattr(attention, "head_dim"):  # grouped-query attention
        return 2 * (attention.n_kv_heads or attention.n_heads) * attention.head_dim
    raise ValueError(f"{name}: layers[0].attention is {type(attention).__qualname__}; `dtensor-moe plan` knows "
                     "DeepSeek's MLA (qk_nope_head_dim) and grouped-query attention (head_dim)")
