"""Moonshot AI's DeepSeek-V3-architecture text decoders as torchtitan `DeepSeekV3Model` configs: Moonlight-16B-A3B
and Kimi K2's text tower (the sizes of Kimi K2 / K2.5 / K2.6 without K2.5's vision tower).

torchtitan 0.3.0 has both in `torchtitan.models.kimi_k2_7` (`KimiK25Model`, a `DeepSeekV3Model` with a vision
tower), which imports torchvision and trains with its DistMuon optimizer over flex_shard layouts. Their text
towers are DeepSeek-V3's architecture (MLA, dense first layer, sigmoid top-k routing renormalized and scaled,
shared experts, no expert groups), and Hugging Face names them `DeepseekV3ForCausalLM`, so here they are built with
torchtitan's own `deepseek_v3` layer builder, its initialization and its state-dict adapter: the same parameter
names and shapes as kimi_k2_7's text tower, and what `--checkpoint.initial_load_in_hf` reads from the HF
checkpoints.
"""

from dataclasses import replace

from torchtitan.models import deepseek_v3
from torchtitan.models.common import ComplexRoPE
from torchtitan.models.deepseek_v3 import DeepSeekV3Model, _build_dsv3_layers
from torchtitan.protocols.model_spec import ModelSpec

VOCAB_SIZE = 163840  # the Kimi / Moonlight tokenizer's


def _decoder(flavor: str, *, dim: int, n_layers: int, n_heads: int, q_lora_rank: int, dense_hidden_dim: int,
             moe_hidden_dim: int, num_experts: int, num_shared_experts: int, top_k: int, route_scale: float,
             rope: ComplexRoPE.Config) -> ModelSpec:
    """torchtitan's 16B DeepSeek-V3 model spec (its parallelize, pipeline, HF adapter) with Moonshot's sizes."""
    layers = _build_dsv3_layers(
        n_layers=n_layers, n_dense_layers=1, dim=dim, n_heads=n_heads, q_lora_rank=q_lora_rank, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, mscale=1.0, dense_hidden_dim=dense_hidden_dim,
        moe_hidden_dim=moe_hidden_dim, num_experts=num_experts, num_shared_experts=num_shared_experts,
        router_top_k=top_k, router_score_func="sigmoid", router_route_scale=route_scale, router_route_norm=True,
        attn_backend="flex", moe_comm_backend="standard", non_blocking_capacity_factor=None, rope=rope)
    base = deepseek_v3.model_registry("16B")
    head = base.model
    model = DeepSeekV3Model.Config(
        vocab_size=VOCAB_SIZE, dim=dim,
        tok_embeddings=replace(head.tok_embeddings, num_embeddings=VOCAB_SIZE, embedding_dim=dim),
        norm=replace(head.norm, normalized_shape=dim),
        lm_head=replace(head.lm_head, in_features=dim, out_features=VOCAB_SIZE),
        layers=layers,
    )
    return replace(base, flavor=flavor, model=model)


def moonlight_16b_a3b_spec() -> ModelSpec:
    """Moonlight-16B-A3B (moonshotai/Moonlight-16B-A3B): 27 layers, 64 experts top-6, 2 shared, RoPE theta 5e4."""
    return _decoder("moonlight-16B-A3B", dim=2048, n_layers=27, n_heads=16, q_lora_rank=0, dense_hidden_dim=11264,
                    moe_hidden_dim=1408, num_experts=64, num_shared_experts=2, top_k=6, route_scale=2.446,
                    rope=ComplexRoPE.Config(dim=64, max_seq_len=8192, theta=50000.0))


def kimi_k2_spec() -> ModelSpec:
    """Kimi K2's text tower (moonshotai/Kimi-K2-Base; K2.5 and K2.6 share it): 61 layers, 384 experts top-8, 1
    shared, YaRN RoPE (factor 64 over 4096 positions)."""
    return _decoder("Kimi-K2", dim=7168, n_layers=61, n_heads=64, q_lora_rank=1536, dense_hidden_dim=18432,
                    moe_hidden_dim=2048, num_experts=384, num_shared_experts=1, top_k=8, route_scale=2.827,
                    rope=ComplexRoPE.Config(dim=64, max_seq_len=262144, theta=50000.0, scaling="yarn",
                                            rope_factor=64.0, beta_fast=32.0, beta_slow=1.0, original_seq_len=4096))
