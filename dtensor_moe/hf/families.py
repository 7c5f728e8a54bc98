"""The Hugging Face MoE families we map: their key names, which decoder layers are MoE, and their
configuration as a `MoEConfig`.

Keys are relative to the MoE block (`model.layers.{i}.mlp.` on disk; Mixtral's checkpoints say
`block_sparse_moe.`, its transformers 5 modules `mlp.`). Read from transformers 5.x's modeling files:
Qwen3MoeSparseMoeBlock, MixtralSparseMoeBlock, DeepseekV3MoE, GptOssMLP.
"""

import math
import re
from dataclasses import dataclass, replace
from typing import Callable

from dtensor_moe.config import MoEConfig, MoERunOptions
from dtensor_moe.hf.layout import Fused, GptOss, PerExpert


@dataclass(frozen=True)
class Family:
    model_type: str  # config.json's model_type
    blocks: tuple[str, ...]  # the MoE block's name in a decoder layer: as save_pretrained writes it first
    direct: dict  # our MoE name -> their key, for tensors that map one-to-one (boxes pass through)
    per_expert: tuple[str, str, str] | None  # (gate, up, down) names of the per-expert layout, if it has one
    config: Callable[[Callable], MoEConfig]  # get(field, default) of their config -> ours
    moe_layer_ids: Callable[[Callable], list[int]]
    fields: Callable[[MoEConfig], dict]  # ours -> their config's MoE fields (the inverse of `config`)
    # (MoE layers, num_hidden_layers) -> their config's fields that `moe_layer_ids` reads (its inverse)
    layer_fields: Callable[[list[int], int], dict]

    def layout(self, keys: set[str], prefix: str, num_hidden: int):
        """The expert layout the keys under `prefix` use."""
        if self.per_expert is None:
            return GptOss(prefix)
        if f"{prefix}experts.gate_up_proj" in keys:
            return Fused(prefix, num_hidden)
        return PerExpert(prefix, *self.per_expert)


def _silu(get, model_type: str):
    act = get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{model_type}: hidden_act={act!r} is not supported; our experts are SwiGLU, valid: 'silu'")


def _qwen3_experts(get) -> int:
    # The Hub's config.json says num_experts; transformers 5 writes its alias num_local_experts.
    n = get("num_experts", None)
    n = get("num_local_experts", None) if n is None else n
    if n is None:
        raise ValueError("the Hugging Face config (config.json) has no 'num_experts' (qwen3_moe's routed experts; "
                         "transformers 5 also writes it as 'num_local_experts'); expected an int")
    return n


def _qwen3(get) -> MoEConfig:
    _silu(get, "qwen3_moe")
    K = get("num_experts_per_tok")
    return MoEConfig(dim=get("hidden_size"), hidden_dim=get("moe_intermediate_size"), num_experts=_qwen3_experts(get),
                     top_k=K, route_norm=get("norm_topk_prob", False))


def _qwen3_layers(get) -> list[int]:
    skip, step = set(get("mlp_only_layers", None) or []), get("decoder_sparse_step", 1)
    return [
        i for i in range(get("num_hidden_layers")) if i not in skip and _qwen3_experts(get) > 0 and (i + 1) % step == 0
    ]


def _mixtral(get) -> MoEConfig:
    _silu(get, "mixtral")
    if get("router_jitter_noise", 0.0):
        raise ValueError(f"mixtral: router_jitter_noise={get('router_jitter_noise', 0.0)} (random input scaling in "
                         "training) is not supported; valid: 0")
    K = get("num_experts_per_tok")
    return MoEConfig(dim=get("hidden_size"), hidden_dim=get("intermediate_size"), num_experts=get("num_local_experts"),
                     top_k=K, route_norm=True)


def _deepseek_v3(get) -> MoEConfig:
    _silu(get, "deepseek_v3")
    K = get("num_experts_per_tok")
    # e_score_correction_bias is the aux-loss-free bias: the buffer exists only with that balancing.
    return MoEConfig(
        dim=get("hidden_size"),
        hidden_dim=get("moe_intermediate_size"),
        num_experts=get("n_routed_experts"),
        top_k=K,
        score_func="sigmoid",
        route_norm=get("norm_topk_prob", True),
        route_scale=float(get("routed_scaling_factor", 1.0)),
        num_shared_experts=get("n_shared_experts", 0),
        load_balance="aux_free_bias",
        num_expert_groups=get("n_group", 1),
        num_limited_groups=get("topk_group", 1),
    )


def _gpt_oss(get) -> MoEConfig:
    return MoEConfig(dim=get("hidden_size"), hidden_dim=get("intermediate_size"), num_experts=get("num_local_experts"),
                     top_k=get("num_experts_per_tok"), score_func="topk_softmax", router_bias=True, expert_biases=True,
                     activation="clamped_swiglu", swiglu_alpha=float(get("swiglu_alpha", 1.702)),
                     swiglu_limit=float(get("swiglu_limit", 7.0)))


def _qwen3_fields(c: MoEConfig) -> dict:
    return dict(hidden_size=c.dim, moe_intermediate_size=c.hidden_dim, num_experts=c.num_experts,
                num_experts_per_tok=c.top_k, norm_topk_prob=c.route_norm)


def _mixtral_fields(c: MoEConfig) -> dict:
    return dict(hidden_size=c.dim, intermediate_size=c.hidden_dim, num_local_experts=c.num_experts,
                num_experts_per_tok=c.top_k)


def _deepseek_v3_fields(c: MoEConfig) -> dict:
    return dict(hidden_size=c.dim, moe_intermediate_size=c.hidden_dim, n_routed_experts=c.num_experts,
                num_experts_per_tok=c.top_k, norm_topk_prob=c.route_norm, routed_scaling_factor=c.route_scale,
                n_shared_experts=c.num_shared_experts, n_group=c.num_expert_groups, topk_group=c.num_limited_groups)


def _gpt_oss_fields(c: MoEConfig) -> dict:
    return dict(hidden_size=c.dim, intermediate_size=c.hidden_dim, num_local_experts=c.num_experts,
                num_experts_per_tok=c.top_k, swiglu_alpha=c.swiglu_alpha, swiglu_limit=c.swiglu_limit)


def _all_layers(get) -> list[int]:
    return list(range(get("num_hidden_layers")))


def _after_dense(get) -> list[int]:
    return list(range(get("first_k_dense_replace", 0), get("num_hidden_layers")))


def _qwen3_layer_fields(layers: list[int], n: int) -> dict:
    return dict(num_hidden_layers=n, decoder_sparse_step=1, mlp_only_layers=[i for i in range(n) if i not in layers])


def _all_layer_fields(layers: list[int], n: int) -> dict:
    return dict(num_hidden_layers=n)


def _after_dense_fields(layers: list[int], n: int) -> dict:
    return dict(num_hidden_layers=n, first_k_dense_replace=min(layers, default=n))


_SHARED = {"shared_experts.w1.weight": "shared_experts.gate_proj.weight",
           "shared_experts.w3.weight": "shared_experts.up_proj.weight",
           "shared_experts.w2.weight": "shared_experts.down_proj.weight"}

FAMILIES = {f.model_type: f for f in (
    Family("qwen3_moe", ("mlp",), {"router.gate.weight": "gate.weight"}, ("gate_proj", "up_proj", "down_proj"),
           _qwen3, _qwen3_layers, _qwen3_fields, _qwen3_layer_fields),
    Family("mixtral", ("block_sparse_moe", "mlp"), {"router.gate.weight": "gate.weight"}, ("w1", "w3", "w2"),
           _mixtral, _all_layers, _mixtral_fields, _all_layer_fields),
    Family("deepseek_v3", ("mlp",), {"router.gate.weight": "gate.weight", "expert_bias": "gate.e_score_correction_bias",
                                     **_SHARED}, ("gate_proj", "up_proj", "down_proj"), _deepseek_v3, _after_dense,
           _deepseek_v3_fields, _after_dense_fields),
    Family("gpt_oss", ("mlp",), {"router.gate.weight": "router.weight", "router.gate.bias": "router.bias"}, None,
           _gpt_oss, _all_layers, _gpt_oss_fields, _all_layer_fields),
)}


def family(model_type: str) -> Family:
    if model_type not in FAMILIES:
        raise ValueError(f"Hugging Face model_type {model_type!r} is not supported; valid: {sorted(FAMILIES)}")
    return FAMILIES[model_type]


# config.json's keys we read, each with the JSON type it must hold ("number": an int or a finite float); a key
# given null reads as absent where it has a default.
KEY_TYPES = {
    "model_type": str, "hidden_act": str, "hidden_size": int, "moe_intermediate_size": int, "intermediate_size": int,
    "num_experts": int, "num_local_experts": int, "n_routed_experts": int, "num_experts_per_tok": int,
    "norm_topk_prob": bool, "routed_scaling_factor": "number", "n_shared_experts": int, "n_group": int,
    "topk_group": int, "swiglu_alpha": "number", "swiglu_limit": "number", "router_jitter_noise": "number",
    "num_hidden_layers": int, "decoder_sparse_step": int, "first_k_dense_replace": int, "mlp_only_layers": list,
    "vocab_size": int, "num_attention_heads": int, "tie_word_embeddings": bool, "max_position_embeddings": int,
    "rms_norm_eps": "number",
}
_WHAT = {int: "an int", bool: "a bool (true or false)", str: "a string", list: "a list of layer numbers",
         "number": "a finite number"}


def _typed(kind, v) -> bool:
    if kind == "number":
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    if kind is int:
        return isinstance(v, int) and not isinstance(v, bool)
    if kind is list:
        return isinstance(v, (list, tuple)) and all(isinstance(i, int) and not isinstance(i, bool) for i in v)
    return isinstance(v, kind)


def getter(hf_config) -> Callable:
    """get(key, default) over a transformers config object or config.json's dict, each value checked against its
    JSON type (KEY_TYPES): a missing key without a default, or a value of another type, is a ValueError naming
    config.json's key (the one the user edits) and what it must hold."""
    if isinstance(hf_config, (str, bytes, list, tuple, int, float)) or hf_config is None:
        raise TypeError(f"a Hugging Face config is a transformers config object or config.json's dict (a JSON "
                        f"object); got {type(hf_config).__name__}")
    missing = object()

    def get(name, default=missing):
        v = hf_config.get(name, default) if isinstance(hf_config, dict) else getattr(hf_config, name, default)
        if v is None and default is not missing:
            v = default
            if v is None:
                return None
        kind = KEY_TYPES.get(name)
        if v is missing or (v is None and kind is not None):
            want = f"; expected {_WHAT[kind]}" if kind else ""
            raise ValueError(f"the Hugging Face config (config.json) has no {name!r}{want}")
        if kind is not None and v is not None and not _typed(kind, v):
            raise ValueError(f"config.json's {name!r} must be {_WHAT[kind]}, got {v!r} ({type(v).__name__})")
        return v
    return get


class _Names:
    """Stands in for a MoEConfig whose every field is its own name: `fam.fields(_Names())` maps their config keys to
    our field names."""

    def __getattr__(self, name):
        return name


def _renamed(message: str, fam: "Family") -> str:
    """A MoEConfig error in their words: each of our field names that the family reads from a config key, as that
    key ("MoEConfig.top_k ... num_experts" -> "config.json's 'num_experts_per_tok' ... 'n_routed_experts'")."""
    ours = {field: key for key, field in fam.fields(_Names()).items() if isinstance(field, str)}
    message = re.sub(r"MoEConfig\.(\w+)", lambda m: f"config.json's {ours.get(m.group(1), m.group(1))!r}", message)
    word = r"(?<!')\b(" + "|".join(map(re.escape, ours)) + r")\b(?!')"
    return re.sub(word, lambda m: repr(ours[m.group(1)]), message)


def moe_config_from_hf(hf_config) -> MoEConfig:
    """The `MoEConfig` of one MoE layer of a transformers config (object or config.json dict); a ValueError names
    the config.json key to edit."""
    get = getter(hf_config)
    fam = family(get("model_type"))
    try:
        return fam.config(get)
    except ValueError as e:
        message = str(e)
        if "config.json" in message:
            raise
        message = _renamed(message, fam)
        where = "" if "config.json" in message else " config.json"
        raise ValueError(f"{fam.model_type}{where}: {message}") from None
# What a Hugging Face config fixes; the other MoEConfig fields, the balance fields (load_balance and the loss
# coefficients), are the training run's.
HF_FIXED_FIELDS = ("dim", "hidden_dim", "num_experts", "top_k", "score_func", "route_norm", "route_scale",
                        "num_shared_experts", "num_expert_groups", "num_limited_groups", "router_bias",
                        "expert_biases", "activation", "swiglu_alpha", "swiglu_limit")


def hf_fields(fam: Family, config: MoEConfig, layers: list[int], num_hidden_layers: int) -> dict:
    """Their config's fields for our `config` in MoE layers `layers` of `num_hidden_layers`: what
    `moe_config_from_hf` and `moe_layer_ids` read back as these; a ValueError naming every field the family
    cannot express (e.g. sigmoid scores as Qwen3-MoE, shared experts as Mixtral, a dense layer as gpt-oss)."""
    fields, diff = _written(fam, config, layers, num_hidden_layers)
    if diff:
        raise ValueError(f"this MoE layer cannot be written as {fam.model_type}: {', '.join(diff)}; valid model types: "
                         f"{[t for t, f in FAMILIES.items() if _expresses(f, config, layers, num_hidden_layers)]}")
    return fields


def _written(fam: Family, config: MoEConfig, layers: list[int], num_hidden_layers: int) -> tuple[dict, list[str]]:
    """`fam`'s config fields for ours, and what they read back differently."""
    fields = {"model_type": fam.model_type, "hidden_act": "silu", **fam.fields(config),
              **fam.layer_fields(layers, num_hidden_layers)}
    get = getter(fields)
    back = fam.config(get)
    diff = [f"{n}={getattr(config, n)!r} (as {fam.model_type}: {getattr(back, n)!r})"
            for n in HF_FIXED_FIELDS if getattr(config, n) != getattr(back, n)]
    # Aux-free balancing is a tensor as well (our expert_bias, DeepSeek-V3's e_score_correction_bias), which
    # the family stores always or never.
    if (config.load_balance == "aux_free_bias") != (back.load_balance == "aux_free_bias"):
        diff.append(f"load_balance={config.load_balance!r} (as {fam.model_type}: {back.load_balance!r})")
    if fam.moe_layer_ids(get) != layers:
        diff.append(f"MoE layers {layers} of {num_hidden_layers} (as {fam.model_type}: {fam.moe_layer_ids(get)})")
    return fields, diff


def _expresses(fam: Family, config: MoEConfig, layers: list[int], num_hidden_layers: int) -> bool:
    try:
        return not _written(fam, config, layers, num_hidden_layers)[1]
    except ValueError:
        return False


def with_balance_fields(fam: Family, config: MoEConfig, fields: dict) -> MoEConfig:
    """`config` (read from a Hugging Face config) with the balance fields in `fields`; a ValueError names a
    field that would change what the checkpoint fixes (HF_FIXED_FIELDS, and load_balance where the family holds an
    aux-free routing bias or cannot hold one)."""
    run = sorted(set(fields) & set(MoERunOptions.__dataclass_fields__))
    if run:
        raise ValueError(f"{fam.model_type}: {run} are run options, not MoEConfig fields; valid: pass them as "
                         f"options=MoERunOptions({', '.join(f'{n}=...' for n in run)})")
    fixed = sorted(set(fields) & set(HF_FIXED_FIELDS))
    if fixed:
        raise ValueError(f"{fam.model_type}: {fixed} are fixed by the Hugging Face config; valid: the balance "
                         f"fields {sorted(n for n in MoEConfig.__dataclass_fields__ if n not in HF_FIXED_FIELDS)}")
    new = replace(config, **fields)
    if (new.load_balance == "aux_free_bias") != (config.load_balance == "aux_free_bias"):
        valid = ["aux_free_bias"] if config.load_balance == "aux_free_bias" else ["none", "aux_loss"]
        raise ValueError(f"{fam.model_type}: load_balance={new.load_balance!r} cannot be saved back (the family "
                         f"{'holds' if config.load_balance == 'aux_free_bias' else 'has no place for'} an aux-free "
                         f"routing bias); valid: {valid}")
    return new


def balance_fields(config: MoEConfig) -> dict:
    """The fields of `config` a Hugging Face config does not fix: load_balance and the loss coefficients."""
    return {n: getattr(config, n) for n in MoEConfig.__dataclass_fields__ if n not in HF_FIXED_FIELDS}
