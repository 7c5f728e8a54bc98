"""Model shapes the folding search needs: published MoE models, torchtitan's MoE configs and the training configs
(`configs/*.toml`).

A `ModelShape` lists the shapes of the weights *outside* the MoE modules (attention, norms, dense
FFN layers, embeddings) and the `MoEConfig` of the MoE layers; the placement of the MoE weights
always comes from `dtensor_moe.parallel.placement.plan_moe`. Published dims (the hyphenated names) are from
each model's released config.json (Hugging Face), with the main job's attention weights. The names with
underscores are the torchtitan hook's `--config` names (dtensor_moe/titan/config_registry.py): torchtitan
0.3.0's models as that hook trains them (torchtitan's fused wqkv, its routing), kept here so that the
folding search needs no torch; tests/test_titan_configs.py checks each equals what
`dtensor_moe.titan.models.shape_from_titan_config` reads off torchtitan's own model. Multi-token-prediction layers
are left out (671B counts the main model only).
"""

from dataclasses import dataclass, replace

from dtensor_moe.config import MoEConfig
from dtensor_moe.validate import check_int, check_type

Shape = tuple[int, ...]


@dataclass(frozen=True)
class ModelShape:
    name: str
    vocab_size: int
    n_layers: int
    moe: MoEConfig  # the MoE layers, checked by MoEConfig itself; its dim is the model's
    attention: tuple[tuple[str, Shape], ...]  # one layer's attention weights, norms included
    kv_width: int  # K plus V features per token (what ring attention passes around under CP)
    n_dense_layers: int = 0  # leading layers with a dense FFN instead of an MoE
    dense_hidden_dim: int = 0
    tie_embeddings: bool = False

    def __post_init__(self):
        if not (isinstance(self.name, str) and self.name):
            raise ValueError(f"ModelShape.name must be a non-empty string, got {self.name!r}")
        for field in ("vocab_size", "n_layers", "kv_width"):
            check_int(f"ModelShape.{field}", getattr(self, field))
        check_type("ModelShape.moe", self.moe, MoEConfig, "a dtensor_moe.config.MoEConfig")
        check_int("ModelShape.n_dense_layers", self.n_dense_layers, 0, self.n_layers)
        check_int("ModelShape.dense_hidden_dim", self.dense_hidden_dim, 1 if self.n_dense_layers else 0)
        check_type("ModelShape.tie_embeddings", self.tie_embeddings, bool, "a bool")
        what = "a tuple of (weight name, shape) pairs, each shape a tuple of integers >= 1"
        check_type("ModelShape.attention", self.attention, tuple, what)
        for entry in self.attention:
            if not (isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[0], str)
                    and isinstance(entry[1], tuple) and entry[1]
                    and all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in entry[1])):
                raise ValueError(f"ModelShape.attention must be {what}, got entry {entry!r}")

    @property
    def dim(self) -> int:
        """The model dim: the MoE layers' own, so it is given (and checked) once."""
        return self.moe.dim

    @property
    def n_moe_layers(self) -> int:
        return self.n_layers - self.n_dense_layers

    def layer_weights(self, dense_ffn: bool) -> tuple[tuple[str, Shape], ...]:
        """Weights of one transformer block outside its MoE module (the block's own FSDP unit)."""
        D = self.dim
        norms = (("attention_norm.weight", (D,)), ("ffn_norm.weight", (D,)))
        ffn = ()
        if dense_ffn:
            Fd = self.dense_hidden_dim
            ffn = (("feed_forward.w1.weight", (Fd, D)), ("feed_forward.w2.weight", (D, Fd)),
                   ("feed_forward.w3.weight", (Fd, D)))
        return (*norms, *self.attention, *ffn)

    def root_weights(self, first: bool = True, last: bool = True) -> tuple[tuple[str, Shape], ...]:
        """Weights of the root FSDP unit: the embedding (on the first pipeline stage), the final norm
        and the output head (on the last)."""
        V, D = self.vocab_size, self.dim
        head = (("norm.weight", (D,)),) + ((("output.weight", (V, D)),) if not self.tie_embeddings else ())
        return (("tok_embeddings.weight", (V, D)),) * first + head * last


def _gqa(D: int, n_heads: int, n_kv_heads: int, head_dim: int, qk_norm: bool, fused: bool = False):
    """Grouped-query attention; `fused`: torchtitan's one wqkv weight for Q, K and V."""
    q, kv = n_heads * head_dim, n_kv_heads * head_dim
    qkv = ([("attention.qkv_linear.wqkv.weight", (q + 2 * kv, D))] if fused else
           [("attention.wq.weight", (q, D)), ("attention.wk.weight", (kv, D)), ("attention.wv.weight", (kv, D))])
    w = [*qkv, ("attention.wo.weight", (D, q))]
    if qk_norm:
        w += [("attention.q_norm.weight", (head_dim,)), ("attention.k_norm.weight", (head_dim,))]
    return tuple(w), 2 * kv


def _gpt_oss_attention(D: int, n_heads: int = 64, n_kv_heads: int = 8, head_dim: int = 64):
    """gpt-oss's grouped-query attention as torchtitan builds it: one sink logit per head, fused wqkv and wo with
    biases."""
    q, kv = n_heads * head_dim, n_kv_heads * head_dim
    return (("attention.sinks", (n_heads,)), ("attention.qkv_linear.wqkv.weight", (q + 2 * kv, D)),
            ("attention.qkv_linear.wqkv.bias", (q + 2 * kv,)), ("attention.wo.weight", (D, q)),
            ("attention.wo.bias", (D,))), 2 * kv


def _gpt_oss_moe(D: int, F: int, E: int) -> MoEConfig:
    """gpt-oss's MoE: biased router and experts, softmax top-4 renormalized, the clamped SwiGLU."""
    return MoEConfig(dim=D, hidden_dim=F, num_experts=E, top_k=4, router_bias=True, expert_biases=True,
                     activation="clamped_swiglu")


def _mla(D: int, n_heads: int, q_lora: int, kv_lora: int = 512, nope: int = 128, rope: int = 64, v: int = 128):
    """DeepSeek multi-head latent attention (joint low-rank KV; low-rank Q unless `q_lora` is 0)."""
    q = (("attention.wq.weight", (n_heads * (nope + rope), D)),) if q_lora == 0 else (
        ("attention.wq_a.weight", (q_lora, D)),
        ("attention.q_norm.weight", (q_lora,)),
        ("attention.wq_b.weight", (n_heads * (nope + rope), q_lora)),
    )
    w = (
        *q,
        ("attention.wkv_a.weight", (kv_lora + rope, D)),
        ("attention.kv_norm.weight", (kv_lora,)),
        ("attention.wkv_b.weight", (n_heads * (nope + v), kv_lora)),
        ("attention.wo.weight", (D, n_heads * v)),
    )
    return w, n_heads * (nope + rope + v)


def _preset(name, *, attention, **kw) -> ModelShape:
    weights, kv_width = attention
    return ModelShape(name=name, attention=weights, kv_width=kv_width, **kw)


PRESETS: dict[str, ModelShape] = {
    s.name: s
    for s in (
        _preset(
            "deepseek-v3-671b",
            vocab_size=129280, n_layers=61, n_dense_layers=3, dense_hidden_dim=18432,
            moe=MoEConfig(dim=7168, hidden_dim=2048, num_experts=256, top_k=8, num_shared_experts=1,
                          num_expert_groups=8, num_limited_groups=4),
            attention=_mla(7168, n_heads=128, q_lora=1536, kv_lora=512, nope=128, rope=64, v=128),
        ),
        _preset(
            "qwen3-235b-a22b",
            vocab_size=151936, n_layers=94, moe=MoEConfig(dim=4096, hidden_dim=1536, num_experts=128, top_k=8),
            attention=_gqa(4096, n_heads=64, n_kv_heads=4, head_dim=128, qk_norm=True),
        ),
        _preset(
            "qwen3-30b-a3b",
            vocab_size=151936, n_layers=48, moe=MoEConfig(dim=2048, hidden_dim=768, num_experts=128, top_k=8),
            attention=_gqa(2048, n_heads=32, n_kv_heads=4, head_dim=128, qk_norm=True),
        ),
        _preset(
            "mixtral-8x7b",
            vocab_size=32000, n_layers=32, moe=MoEConfig(dim=4096, hidden_dim=14336, num_experts=8, top_k=2),
            attention=_gqa(4096, n_heads=32, n_kv_heads=8, head_dim=128, qk_norm=False),
        ),
        # torchtitan 0.3.0's models (the hook's --config names), as its deepseek_v3, qwen3 and gpt_oss model
        # registries build them.
        _preset(
            "deepseek_v3_16b",
            vocab_size=102400, n_layers=27, n_dense_layers=1, dense_hidden_dim=10944,
            moe=MoEConfig(dim=2048, hidden_dim=1408, num_experts=64, top_k=6, route_norm=False, num_shared_experts=2),
            attention=_mla(2048, n_heads=16, q_lora=0),
        ),
        _preset(
            "deepseek_v3_236b",
            vocab_size=102400, n_layers=60, n_dense_layers=1, dense_hidden_dim=12288,
            moe=MoEConfig(dim=5120, hidden_dim=1536, num_experts=160, top_k=6, route_norm=False, route_scale=16.0,
                          num_shared_experts=2, num_expert_groups=8, num_limited_groups=3),
            attention=_mla(5120, n_heads=128, q_lora=1536),
        ),
        _preset(
            "deepseek_v3_671b",
            vocab_size=129280, n_layers=61, n_dense_layers=3, dense_hidden_dim=18432,
            moe=MoEConfig(dim=7168, hidden_dim=2048, num_experts=256, top_k=8, score_func="sigmoid", route_scale=2.5,
                          num_shared_experts=1, num_expert_groups=8, num_limited_groups=4),
            attention=_mla(7168, n_heads=128, q_lora=1536),
        ),
        _preset(
            "qwen3_30b_a3b",
            vocab_size=151936, n_layers=48, moe=MoEConfig(dim=2048, hidden_dim=768, num_experts=128, top_k=8),
            attention=_gqa(2048, n_heads=32, n_kv_heads=4, head_dim=128, qk_norm=True, fused=True),
        ),
        _preset(
            "qwen3_235b_a22b",
            vocab_size=151936, n_layers=94, moe=MoEConfig(dim=4096, hidden_dim=1536, num_experts=128, top_k=8),
            attention=_gqa(4096, n_heads=64, n_kv_heads=4, head_dim=128, qk_norm=True, fused=True),
        ),
        # Moonshot's DeepSeek-V3-architecture decoders (dtensor_moe/titan/moonshot.py)
        _preset(
            "moonlight_16b_a3b",
            vocab_size=163840, n_layers=27, n_dense_layers=1, dense_hidden_dim=11264,
            moe=MoEConfig(dim=2048, hidden_dim=1408, num_experts=64, top_k=6, score_func="sigmoid",
                          route_scale=2.446, num_shared_experts=2),
            attention=_mla(2048, n_heads=16, q_lora=0),
        ),
        _preset(
            "kimi_k2",
            vocab_size=163840, n_layers=61, n_dense_layers=1, dense_hidden_dim=18432,
            moe=MoEConfig(dim=7168, hidden_dim=2048, num_experts=384, top_k=8, score_func="sigmoid",
                          route_scale=2.827, num_shared_experts=1),
            attention=_mla(7168, n_heads=64, q_lora=1536),
        ),
        _preset(
            "deepseek_v3_debugmodel",
            vocab_size=2048, n_layers=6, n_dense_layers=1, dense_hidden_dim=1024,
            moe=MoEConfig(dim=256, hidden_dim=256, num_experts=8, top_k=3, route_norm=False, num_shared_experts=2),
            attention=_mla(256, n_heads=16, q_lora=0),
        ),
        _preset(
            "gpt_oss_20b",
            vocab_size=201088, n_layers=24, moe=_gpt_oss_moe(2880, 2880, 32), attention=_gpt_oss_attention(2880),
        ),
        _preset(
            "gpt_oss_120b",
            vocab_size=201088, n_layers=36, moe=_gpt_oss_moe(2880, 2880, 128), attention=_gpt_oss_attention(2880),
        ),
        _preset(
            "gpt_oss_debugmodel",
            vocab_size=2048, n_layers=4, moe=_gpt_oss_moe(256, 2880, 8), attention=_gpt_oss_attention(256),
        ),
        _preset(
            "qwen3_moe_debug",
            vocab_size=2048, n_layers=8, moe=MoEConfig(dim=256, hidden_dim=768, num_experts=64, top_k=8),
            attention=_gqa(256, n_heads=16, n_kv_heads=8, head_dim=128, qk_norm=True, fused=True),
        ),
    )
}
# torchtitan's variants of a model above (its multi-token-prediction layer, its optimizer's parameter groups, its
# FlexAttention backend).
PRESETS |= {variant: replace(PRESETS[model], name=variant) for variant, model in (
    ("deepseek_v3_debugmodel_mtp", "deepseek_v3_debugmodel"),
    ("qwen3_debugmodel_moe_param_groups", "qwen3_moe_debug"),
    ("gpt_oss_debugmodel_flex", "gpt_oss_debugmodel"),
)}
# The torchtitan hook's --config names of torchtitan's own models, each a preset above (config_registry.py has a
# config function of each name).
TITAN_MODELS = ("deepseek_v3_16b", "deepseek_v3_236b", "deepseek_v3_671b", "qwen3_30b_a3b", "qwen3_235b_a22b",
                "gpt_oss_20b", "gpt_oss_120b", "moonlight_16b_a3b", "kimi_k2", "deepseek_v3_debugmodel",
                "deepseek_v3_debugmodel_mtp",
                "qwen3_moe_debug", "qwen3_debugmodel_moe_param_groups", "gpt_oss_debugmodel", "gpt_oss_debugmodel_flex")


def shape_from_model_config(cfg, name: str = "config") -> ModelShape:
    """The shapes of `dtensor_moe.train.model.MoETransformer(cfg)` (wq, wk, wv, wo; every layer an MoE).
    `cfg` is the main job's ModelConfig, read through its own `moe_config()` (tools do not import train)."""
    D = cfg.dim
    return ModelShape(
        name=name,
        vocab_size=cfg.vocab_size,
        n_layers=cfg.n_layers,
        moe=cfg.moe_config(),
        attention=tuple((f"attention.{w}.weight", (D, D)) for w in ("wq", "wk", "wv", "wo")),
        kv_width=2 * D,
        tie_embeddings=cfg.tie_embeddings,
    )


def shape_from_hf_config(hf: dict, moe: MoEConfig, name: str = "config") -> ModelShape:
    """The shapes of a Hugging Face MoE checkpoint's model from its config.json (`hf`), its MoE layers `moe` (the
    family's MoEConfig with the balance fields given beside hf_path). The dense layers (qwen3_moe's mlp_only_layers,
    deepseek_v3's first_k_dense_replace) count as leading ones, the folding search's one layout: the same weights and
    activations per layer."""
    from dtensor_moe.hf.families import family, getter

    get = getter(hf)
    kind, D, n_layers = get("model_type"), get("hidden_size"), get("num_hidden_layers")
    heads = get("num_attention_heads")
    kv_heads = get("num_key_value_heads", None) or heads
    head_dim = get("head_dim", None) or D // heads
    if kind == "deepseek_v3":
        attention = _mla(D, heads, q_lora=get("q_lora_rank", None) or 0, kv_lora=get("kv_lora_rank"),
                         nope=get("qk_nope_head_dim"), rope=get("qk_rope_head_dim"), v=get("v_head_dim"))
    elif kind == "gpt_oss":
        attention = _gpt_oss_attention(D, heads, kv_heads, head_dim)
    else:  # qwen3_moe (its q/k norms), mixtral
        attention = _gqa(D, heads, kv_heads, head_dim, qk_norm=kind == "qwen3_moe")
    n_dense = n_layers - len(family(kind).moe_layer_ids(get))
    return _preset(name, vocab_size=get("vocab_size"), n_layers=n_layers, n_dense_layers=n_dense,
                   dense_hidden_dim=get("intermediate_size") if n_dense else 0, moe=moe, attention=attention,
                   tie_embeddings=bool(get("tie_word_embeddings", False)))
