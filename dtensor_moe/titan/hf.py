"""Hugging Face round trips through the hook (torchtitan's `--checkpoint.initial_load_in_hf` and
`--checkpoint.last_save_in_hf`): the family's config.json of a torchtitan model config (`hf_config`), the
check of a checkpoint's config.json against the model (`check_hf_load`) and of what the export can hold
(`check_hf_export`). Families: Qwen3-MoE (torchtitan's `Qwen3Model`), DeepSeek-V3 (`DeepSeekV3Model`) and
gpt-oss (`GptOssModel`, through `GptOssHFAdapter`, which `with_hf_adapter` puts in place of torchtitan's);
other models pass unchecked and export without config.json. `check_hf_keys` builds the model on the meta device.
"""

import json
import os
from dataclasses import replace

import torch
from torchtitan.models.deepseek_v3 import DeepSeekV3Model
from torchtitan.models.gpt_oss import GptOssModel
from torchtitan.models.gpt_oss.state_dict_adapter import GptOssStateDictAdapter
from torchtitan.models.qwen3 import Qwen3Model

from dtensor_moe.hf.layout import GptOss

# The routing and size fields compared on load, and transformers' defaults for those a config.json may leave
# out (save_pretrained writes only the fields that differ from its class's defaults). DeepseekV3Config has no
# score function field: its router is sigmoid (DeepSeek's own config.json says "scoring_func": "sigmoid").
_DEFAULTS = {
    "qwen3_moe": dict(scoring_func="softmax", num_experts=128, num_experts_per_tok=8, hidden_size=2048,
                      moe_intermediate_size=768, num_hidden_layers=24, norm_topk_prob=False),
    "deepseek_v3": dict(scoring_func="sigmoid", n_group=8, topk_group=4, n_routed_experts=256, num_experts_per_tok=8,
                        hidden_size=7168, moe_intermediate_size=2048, intermediate_size=18432, num_hidden_layers=61,
                        first_k_dense_replace=3, n_shared_experts=1, norm_topk_prob=True, routed_scaling_factor=2.5),
    # gpt-oss's router is always top-k of the biased logits, softmax over the k (torchtitan's softmax, route_norm).
    "gpt_oss": dict(num_local_experts=128, num_experts_per_tok=4, hidden_size=2880, intermediate_size=2880,
                    num_hidden_layers=36, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                    swiglu_limit=7.0, sliding_window=128,
                    layer_types=lambda c: ["sliding_attention" if i % 2 == 0 else "full_attention"
                                           for i in range(c.get("num_hidden_layers", 36))]),
}
# Other names transformers writes for the same field (its attribute_map): Qwen3-MoE's num_experts is saved
# as num_local_experts by transformers 5.
_ALIASES = {"num_experts": "num_local_experts"}
_ARCHITECTURES = {"qwen3_moe": "Qwen3MoeForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
                  "gpt_oss": "GptOssForCausalLM"}


def hf_model_type(model_config) -> str | None:
    """The Hugging Face model_type of a torchtitan model config, None for models of other families."""
    if isinstance(model_config, Qwen3Model.Config):
        return "qwen3_moe"
    if isinstance(model_config, DeepSeekV3Model.Config):
        return "deepseek_v3"
    if isinstance(model_config, GptOssModel.Config):
        return "gpt_oss"
    return None


def _moe_layers(model_config) -> list[tuple[int, object]]:
    return [(i, layer.moe) for i, layer in enumerate(model_config.layers) if getattr(layer, "moe", None) is not None]


def hf_config(model_config, dtype: str = "float32") -> dict | None:
    """The Hugging Face config.json of the model `model_config` builds (its family's fields), None outside
    the three families. Routing and sizes are read off the first MoE layer (the families have one MoE shape)."""
    kind = hf_model_type(model_config)
    if kind is None:
        return None
    layers, moes = model_config.layers, _moe_layers(model_config)
    moe = moes[0][1]
    router, attention = moe.router, layers[0].attention
    rope = attention.rope
    config = dict(
        architectures=[_ARCHITECTURES[kind]], model_type=kind, dtype=dtype, vocab_size=model_config.vocab_size,
        hidden_size=model_config.dim, num_hidden_layers=len(layers), num_attention_heads=attention.n_heads,
        rms_norm_eps=model_config.norm.eps,
        # YaRN's context: the original one times the factor (transformers warns on any other ratio).
        max_position_embeddings=int(rope.original_seq_len * rope.rope_factor) if rope.scaling == "yarn" else
        rope.max_seq_len,
        tie_word_embeddings=bool(model_config.enable_weight_tying), num_experts_per_tok=router.top_k, use_cache=True,
    )
    if kind == "gpt_oss":
        return {**config, **_gpt_oss_fields(model_config)}
    config.update(attention_bias=False, moe_intermediate_size=moe.routed_experts.inner_experts.hidden_dim,
                  norm_topk_prob=bool(router.route_norm))
    if kind == "qwen3_moe":
        config.update(
            num_key_value_heads=attention.n_kv_heads or attention.n_heads, head_dim=attention.head_dim,
            num_experts=moe.num_experts, intermediate_size=moe.routed_experts.inner_experts.hidden_dim,
            decoder_sparse_step=1, mlp_only_layers=[i for i, layer in enumerate(layers) if layer.moe is None],
            rope_parameters={"rope_type": "default", "rope_theta": rope.theta}, rope_theta=rope.theta,
        )
        return config
    dense = [layer for layer in layers if layer.moe is None]
    rope_parameters = {"rope_type": "default", "rope_theta": rope.theta}
    if rope.scaling == "yarn":
        # torchtitan's MLA scales its softmax by its one mscale: transformers' mscale_all_dim (the two equal
        # leave the rotary embedding unscaled, as torchtitan's is).
        rope_parameters = {"rope_type": "yarn", "rope_theta": rope.theta, "factor": rope.rope_factor,
                           "beta_fast": rope.beta_fast, "beta_slow": rope.beta_slow, "mscale": attention.mscale,
                           "mscale_all_dim": attention.mscale,
                           "original_max_position_embeddings": rope.original_seq_len}
    shared = moe.shared_experts
    config.update(
        num_key_value_heads=attention.n_heads, n_routed_experts=moe.num_experts,
        n_shared_experts=shared.w1.out_features // moe.routed_experts.inner_experts.hidden_dim if shared else 0,
        n_group=router.num_expert_groups or 1, topk_group=router.num_limited_groups or 1,
        routed_scaling_factor=router.route_scale, scoring_func=router.score_func,
        first_k_dense_replace=len(dense), intermediate_size=dense[0].feed_forward.w1.out_features if dense else
        moe.routed_experts.inner_experts.hidden_dim,
        q_lora_rank=attention.q_lora_rank or None, kv_lora_rank=attention.kv_lora_rank,
        qk_rope_head_dim=attention.qk_rope_head_dim, qk_nope_head_dim=attention.qk_nope_head_dim,
        v_head_dim=attention.v_head_dim, rope_parameters=rope_parameters, rope_theta=rope.theta,
        rope_interleave=True,
    )
    return config


def _gpt_oss_fields(model_config) -> dict:
    """GptOssConfig's fields past the common ones: attention with biases and sinks (always, in transformers'
    GptOss), sliding windows by layer, YaRN with fractional cutoffs (`truncate`), experts with the clamped
    SwiGLU. transformers scales cos / sin by YaRN's mscale where torchtitan scales the softmax by its square:
    the same scores, so no mscale field is written (transformers then takes 0.1 ln(factor) + 1, torchtitan's)."""
    layers = model_config.layers
    attention, moe = layers[0].attention, _moe_layers(model_config)[0][1]
    rope, experts = attention.rope, moe.routed_experts.inner_experts
    windows = [layer.attention.sliding_window_size for layer in layers]
    rope_parameters = {"rope_type": "default", "rope_theta": rope.theta}
    if rope.scaling == "yarn":
        rope_parameters = {"rope_type": "yarn", "rope_theta": rope.theta, "factor": float(rope.rope_factor),
                           "beta_fast": rope.beta_fast, "beta_slow": rope.beta_slow, "truncate": rope.truncate,
                           "original_max_position_embeddings": rope.original_seq_len}
    return dict(
        num_key_value_heads=attention.n_kv_heads, head_dim=attention.head_dim, attention_bias=True,
        intermediate_size=experts.hidden_dim, num_local_experts=moe.num_experts, swiglu_limit=experts.swiglu_limit,
        swiglu_alpha=1.702,  # torchtitan's swiglu has no other
        sliding_window=next((w for w in windows if w is not None), None),
        layer_types=["full_attention" if w is None else "sliding_attention" for w in windows],
        rope_parameters=rope_parameters,
    )


def check_hf_load(model_config, path: str) -> None:
    """Refuses (ValueError, one line) a Hugging Face checkpoint whose config.json (in `path`) has another
    architecture than `model_config`'s: model type, routing score function, expert groups, experts, top-k,
    hidden sizes, layers (gpt-oss: heads, the SwiGLU's clamp, sliding windows). Without a config.json, or
    outside the three families, nothing is checked."""
    ours = hf_config(model_config)
    file = os.path.join(path, "config.json")
    if ours is None or not os.path.isfile(file):
        return
    with open(file) as f:
        theirs = json.load(f)
    kind = theirs.get("model_type")
    if kind != ours["model_type"]:
        raise ValueError(f"checkpoint.initial_load_path {path}: config.json's model_type is {kind!r}, the model "
                         f"(model_spec.model) is {ours['model_type']!r}; valid: a {ours['model_type']} checkpoint, "
                         "or the --config of the checkpoint's architecture")
    router = _moe_layers(model_config)[0][1].router
    ours = {**ours, "scoring_func": router.score_func}
    diff = []
    for name, default in _DEFAULTS[kind].items():
        default = default(theirs) if callable(default) else default  # gpt-oss's layer_types: by layer count
        given = theirs.get(name, theirs.get(_ALIASES.get(name), default))
        if name == "scoring_func" and kind == "qwen3_moe":
            given = "softmax"  # Qwen3-MoE's router has no other
        mine = ours.get(name)
        if isinstance(mine, float) or isinstance(given, float):
            same = None not in (mine, given) and abs(float(mine) - float(given)) <= 1e-6 * abs(float(mine))
        else:
            same = mine == given
        if not same:
            diff.append(f"{name} {given!r} (model: {mine!r})")
    if diff:
        raise ValueError(f"checkpoint.initial_load_path {path}: config.json's architecture differs from the "
                         f"model's: {', '.join(diff)}; valid: the --config of the checkpoint's architecture")


def bias_keys_lost(config) -> list[str]:
    """The trained routing biases (`layers.{i}.moe.expert_bias_E`, torchtitan's aux-loss-free load balancing,
    trained where an MoE's load_balance_coeff is set) that `config`'s state-dict adapter has no Hugging Face
    key for: an export in that format would drop them."""
    model_spec, model = config.model_spec, config.model_spec.model
    if model_spec.state_dict_adapter is None:
        return []
    adapter = model_spec.state_dict_adapter(model, None)
    held = set(getattr(adapter, "from_hf_map", {}).values())
    return [f"layers.{i}.moe.expert_bias_E" for i, moe in _moe_layers(model)
            if moe.load_balance_coeff is not None and "layers.{}.moe.expert_bias_E" not in held]


def check_hf_export(config) -> None:
    """Refuses (ValueError, one line) `--checkpoint.last_save_in_hf` where the family's format cannot hold a
    tensor the run trains (Qwen3-MoE, gpt-oss: the routing bias) or the state-dict adapter drops one
    (`check_hf_keys`)."""
    check_hf_keys(config, "checkpoint.last_save_in_hf")
    lost = bias_keys_lost(config)
    if lost:
        kind = hf_model_type(config.model_spec.model)
        # gpt-oss's one router bias is the gate's, on the logits (torchtitan's router.gate.bias, exported).
        gate = "; its mlp.router.bias is the router gate's, exported" if kind == "gpt_oss" else ""
        raise ValueError(
            f"checkpoint.last_save_in_hf: {kind or 'this model'}'s Hugging Face format "
            f"has no key for {lost[0]} ({len(lost)} layers{gate}), the routing bias that load_balance_coeff trains, so "
            "the export would not be the trained model; valid: --dtensor_moe.load_balance_coeff 0 (train without "
            "the bias), or no --checkpoint.last_save_in_hf")


def check_hf_keys(config, flag: str) -> None:
    """Refuses (ValueError, one line) an HF save or load (`flag`) where the model's state-dict adapter maps some of
    its tensors to no Hugging Face key and back (the model built on the meta device), which torchtitan's
    checkpointer would drop from an export, or leave at their initial values in a load (it loads non-strictly):
    torchtitan 0.3.0's own gpt-oss adapter maps `mlp1_weight`, `mlp2_bias`, ... while the experts' parameters are
    `mlp1_weight_EGD`, ... (`with_hf_adapter` swaps in `GptOssHFAdapter`). The routing bias is left to
    `bias_keys_lost` (a load without it starts it at zero, as a fresh run)."""
    model_spec = config.model_spec
    if model_spec.state_dict_adapter is None:
        return
    with torch.device("meta"):
        state = model_spec.model.build().state_dict()
    adapter = model_spec.state_dict_adapter(model_spec.model, None)
    kept = set(adapter.from_hf(adapter.to_hf(state)))
    lost = sorted(k for k in state if k not in kept and not k.endswith(".moe.expert_bias_E"))
    if lost:
        raise ValueError(
            f"{flag}: {type(adapter).__name__} (torchtitan's state-dict adapter of model_spec {model_spec.name!r}) "
            f"maps no Hugging Face key to {lost[0]} ({len(lost)} tensors: {', '.join(lost[:4])}, ...), so the "
            "checkpoint would not be the trained model; valid: no --" + flag + " (torchtitan's DCP checkpoints work)")


def write_hf_config(model_config, folder: str, dtype: str) -> None:
    """Writes the family's config.json into the export folder (nothing outside the three families)."""
    config = hf_config(model_config, dtype)
    if config is not None:
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(config, f, indent=2)


# transformers' GptOss keys (dtensor_moe/hf/layout.py's GptOss, the direct path's) -> the experts' parameters.
_HF_EXPERTS = GptOss("model.layers.{}.mlp.")
_TITAN_EXPERTS = "layers.{}.moe.routed_experts.inner_experts."
_GPT_OSS_EXPERTS = {
    _HF_EXPERTS.gate_up: _TITAN_EXPERTS + "mlp1_weight_EGD",
    _HF_EXPERTS.gate_up_bias: _TITAN_EXPERTS + "mlp1_bias_EG",
    _HF_EXPERTS.down: _TITAN_EXPERTS + "mlp2_weight_EDF",
    _HF_EXPERTS.down_bias: _TITAN_EXPERTS + "mlp2_bias_ED",
}


def _transposed(t):
    """(E, a, b) -> (E, b, a), contiguous: safetensors' row-major bytes (a DTensor keeps its shards, dims
    1 and 2 swapped). A copy: torchtitan's HF load fills the copies, maps them back (`from_hf`) and loads those."""
    return t.transpose(1, 2).contiguous()


class GptOssHFAdapter(GptOssStateDictAdapter):
    """torchtitan's gpt-oss state-dict adapter for transformers' unquantized `GptOss` layout, under the experts'
    parameter names: `mlp1_weight_EGD` (E, 2F, D), gate and up interleaved along 2F (row 2i gate unit i), is
    `mlp.experts.gate_up_proj` (E, D, 2F) transposed (column 2i gate unit i, as transformers' `_apply_gate`
    reads it); `mlp1_bias_EG` is `gate_up_proj_bias` (E, 2F), interleaved alike; `mlp2_weight_EDF` (E, D, F) is
    `down_proj` (E, F, D) transposed; `mlp2_bias_ED` is `down_proj_bias`. The rest is torchtitan's map (router
    weight and bias, attention with biases and sinks, norms, embedding, head). torchtitan's own adapter maps
    the experts to MXFP4 names without the suffixes, so it keeps no expert tensor (`check_hf_keys`)."""

    def __init__(self, model_config, hf_assets_path):
        super().__init__(model_config, hf_assets_path)
        self.from_hf_map = {**{k: v for k, v in self.from_hf_map.items() if ".mlp.experts." not in k},
                            **_GPT_OSS_EXPERTS}

    def to_hf(self, state_dict):
        hf = super().to_hf(state_dict)
        return {k: _transposed(v) if k.endswith(("gate_up_proj", "down_proj")) else v for k, v in hf.items()}

    def from_hf(self, hf_state_dict):
        return super().from_hf({k: _transposed(v) if k.endswith(("gate_up_proj", "down_proj")) else v
                                for k, v in hf_state_dict.items()})


def with_hf_adapter(config) -> None:
    """`config`'s model_spec with `GptOssHFAdapter` where it has torchtitan's gpt-oss adapter (set in place;
    torchtitan's Trainer builds its checkpointer's adapter from it)."""
    spec = config.model_spec
    if spec is not None and spec.state_dict_adapter is GptOssStateDictAdapter:
        config.model_spec = replace(spec, state_dict_adapter=GptOssHFAdapter)


def check_hf_quantized(config) -> None:
    """Refuses (ValueError, one line) `--checkpoint.initial_load_in_hf_quantized` for gpt-oss: `GptOssHFAdapter`
    reads transformers' unquantized layout, not the Hub's MXFP4 blocks (gate_up_proj_blocks / _scales)."""
    if config.checkpoint.initial_load_in_hf_quantized and config.model_spec.state_dict_adapter is GptOssHFAdapter:
        raise ValueError(
            "checkpoint.initial_load_in_hf_quantized: the hook reads gpt-oss Hugging Face checkpoints in transformers' "
            "unquantized layout (mlp.experts.gate_up_proj (E, D, 2F), ...), not MXFP4 blocks; valid: an unquantized "
            "checkpoint (transformers' from_pretrained with Mxfp4Config(dequantize=True), then save_pretrained), "
            "without --checkpoint.initial_load_in_hf_quantized")
