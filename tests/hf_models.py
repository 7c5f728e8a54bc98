"""Tiny transformers models of the four Hugging Face MoE families, random weights, float64."""

import torch

LAYERS = 2
# transformers picks grouped_mm for the experts by default, which takes no float64: their per-expert loop.
EXPERTS = "eager"
LIMIT = 1.0  # gpt-oss's swiglu_limit: small enough that both clamps bind at these weight scales


# Attention dims a GPU's SDPA kernels take: transformers' DeepSeek-V3 (MLA) at the dims below raised a CUDA
# "misaligned address" inside scaled_dot_product_attention (torch 2.11, one H200); tests/gpu/gpu_suite.py uses these.
GPU_ATTENTION = {"deepseek_v3": dict(qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, kv_lora_rank=16)}


def hf_config(model_type: str, top_k: int = 2, **overrides):
    """The family's tiny config; `overrides` replace its fields (e.g. GPU_ATTENTION[model_type])."""
    config = _config(model_type, top_k)
    return type(config)(**{**config.to_dict(), **overrides}) if overrides else config  # derived fields anew


def _config(model_type: str, top_k: int):
    import transformers as tf

    attn = dict(vocab_size=32, hidden_size=8, num_hidden_layers=LAYERS, num_attention_heads=2)
    if model_type == "qwen3_moe":
        return tf.Qwen3MoeConfig(**attn, num_key_value_heads=1, head_dim=4, moe_intermediate_size=6,
                                 intermediate_size=12, num_experts=4, num_experts_per_tok=top_k, norm_topk_prob=True)
    if model_type == "mixtral":
        return tf.MixtralConfig(**attn, num_key_value_heads=1, intermediate_size=6, num_local_experts=4,
                                num_experts_per_tok=top_k)
    if model_type == "deepseek_v3":  # 8 experts in 4 groups, 2 kept; layer 0 dense
        return tf.DeepseekV3Config(**attn, num_key_value_heads=2, moe_intermediate_size=6, intermediate_size=12,
                                   n_routed_experts=8, num_experts_per_tok=top_k, n_group=4, topk_group=2,
                                   n_shared_experts=1, routed_scaling_factor=2.5, first_k_dense_replace=1,
                                   q_lora_rank=None, kv_lora_rank=4, qk_rope_head_dim=2, qk_nope_head_dim=2,
                                   v_head_dim=4)
    return tf.GptOssConfig(**attn, num_key_value_heads=1, head_dim=4, intermediate_size=6, num_local_experts=4,
                           num_experts_per_tok=top_k, swiglu_limit=LIMIT, layer_types=["full_attention"] * LAYERS)


def hf_model(model_type: str, seed: int = 0, top_k: int = 2, **overrides):
    """The model in float64 with every weight and buffer random (transformers zeroes biases and
    the correction bias, which would leave their mapping untested); `overrides` as hf_config's."""
    import transformers as tf

    torch.manual_seed(seed)
    config = hf_config(model_type, top_k, **overrides)
    model = tf.AutoModelForCausalLM.from_config(config, experts_implementation=EXPERTS).double()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        corrections = [b for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")]
        for t in [*model.parameters(), *corrections]:
            t.copy_(torch.randn(t.shape, generator=g, dtype=t.dtype) * (0.5 if t.dim() > 1 else 0.1))
    return model.eval()


def moe_block(model, model_type: str):
    """The last decoder layer's MoE block (layer 0 of the DeepSeek-V3 model is dense)."""
    return model.model.layers[LAYERS - 1].mlp
