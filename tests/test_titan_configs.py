"""The torchtitan hook's configs (`--module dtensor_moe.titan --config NAME`) and `wrap_config`, on the meta
device: no process group, no training.

- every config builds through the hook: our Trainer and parallelize function, and every MoE layer, MTP ones
  included, gets a placement from our plan whose shapes are its parameters' (what parallelize_titan checks
  before its first collective);
- the configs of torchtitan's models build torchtitan's own model (same parameter names and shapes as the
  model of torchtitan's config, or flavor, of that name), and `dtensor-moe plan`'s preset of that name is what
  `shape_from_titan_config` reads off it, with torchtitan's parameter count;
- the real-size names parse through torchtitan's own ConfigManager with our degrees; a bad name is one line;
- every MoE config torchtitan 0.3.0 registers is a config here or refused by wrap_config with a ValueError.
"""

import importlib
import inspect
import re

import pytest
import torch

pytest.importorskip("torchtitan")

from torchtitan.config import ConfigManager  # noqa: E402
from torchtitan.models import deepseek_v3, qwen3  # noqa: E402
from torchtitan.models.common.moe import MoE  # noqa: E402
from torchtitan.trainer import Trainer as TitanTrainer  # noqa: E402

from dtensor_moe.parallel.mesh import MoEParallelDims  # noqa: E402
from dtensor_moe.titan import config_registry as registry  # noqa: E402
from dtensor_moe.titan import moonshot  # noqa: E402
from dtensor_moe.titan.models import shape_from_titan_config  # noqa: E402
from dtensor_moe.titan.parallelize_titan import parallelize_titan, titan_plan  # noqa: E402
from dtensor_moe.titan.trainer import Trainer  # noqa: E402
from dtensor_moe.tools import folding as P  # noqa: E402
from dtensor_moe.tools.presets import PRESETS, TITAN_MODELS  # noqa: E402

REAL_SIZE = ("deepseek_v3_16b", "deepseek_v3_236b", "deepseek_v3_671b", "qwen3_30b_a3b", "qwen3_235b_a22b",
             "gpt_oss_20b", "gpt_oss_120b", "moonlight_16b_a3b", "kimi_k2")
# Moonshot's decoders: torchtitan has them in kimi_k2_7, which needs torchvision; test_moonshot_decoders_are_hf_s
# checks them against transformers' DeepseekV3 with the Hugging Face configs' values instead.
MOONSHOT = {"moonlight_16b_a3b": "moonlight_16b_a3b_spec", "kimi_k2": "kimi_k2_spec"}
DIMS = MoEParallelDims(16, ep=4, etp=2)  # divides every config's experts and expert hidden dim


def _titans_own(name: str):
    """torchtitan's ModelSpec for the hook config `name`: its config function of that name, or for the two models
    it registers without one, its flavor."""
    flavors = {"deepseek_v3_236b": (deepseek_v3, "236B"), "qwen3_235b_a22b": (qwen3, "235B-A22B")}
    if name in MOONSHOT:
        return getattr(moonshot, MOONSHOT[name])()
    if name in flavors:
        family, flavor = flavors[name]
        return family.model_registry(flavor)
    family = next(f for f in ("deepseek_v3", "gpt_oss", "qwen3") if name.startswith(f))
    return getattr(importlib.import_module(f"torchtitan.models.{family}.config_registry"), name)().model_spec


def _build(model_config):
    with torch.device("meta"):
        return model_config.build()


def _shapes(model) -> dict:
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


@pytest.mark.parametrize("name", list(registry.CONFIGS))
def test_config_builds_through_the_hook(name):
    config = registry.CONFIGS[name]()
    hook = name != "deepseek_v3_debugmodel_cpu_titan_ep"  # the reference, under torchtitan's own parallelize
    assert type(config) is (Trainer.Config if hook else TitanTrainer.Config)
    assert (config.model_spec.parallelize_fn is parallelize_titan) == hook
    assert config.parallelism.expert_parallel_degree == 1 and config.parallelism.spmd_backend == "partial_dtensor"
    assert config.training.disable_cuda_graphs
    model = _build(config.model_spec.model)
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    assert moes
    for moe in moes:
        params = dict(moe.named_parameters())
        plans = {wp.name: wp for wp in titan_plan(moe, DIMS)}
        assert set(plans) == set(params)
        assert all(wp.global_shape == tuple(params[n].shape) for n, wp in plans.items())
    if name not in TITAN_MODELS:
        return
    own = _titans_own(name)
    assert type(own.model) is type(config.model_spec.model) and own.flavor == config.model_spec.flavor
    titans = _build(own.model)
    assert _shapes(model) == _shapes(titans)
    # The preset of this name: torchtitan's sizes (its parameter count, multi-token prediction left out).
    spec = PRESETS[name]
    assert spec == shape_from_titan_config(config.model_spec.model, name)
    mtp = sum(p.numel() for n, p in titans.named_parameters() if n.startswith("mtp_layers."))
    one = MoEParallelDims(1)
    assert P.held_numel(P.fsdp_units(spec, one), one, 0) == sum(p.numel() for p in titans.parameters()) - mtp


def test_every_preset_of_torchtitan_is_a_config():
    assert set(TITAN_MODELS) <= set(registry.CONFIGS) and set(TITAN_MODELS) <= set(PRESETS)
    assert set(REAL_SIZE) <= set(TITAN_MODELS)


@pytest.mark.parametrize("name", REAL_SIZE)
def test_real_size_configs_parse_on_torchtitans_command_line(name, monkeypatch):
    """What `torchrun ... -m torchtitan.train --module dtensor_moe.titan --config NAME --dtensor_moe.ep 8` parses."""
    monkeypatch.setenv("WORLD_SIZE", "64")
    config = ConfigManager().parse_args(["--module", "dtensor_moe.titan", "--config", name, "--dtensor_moe.ep", "8",
                                         "--dtensor_moe.etp", "2"])
    assert type(config) is Trainer.Config and (config.dtensor_moe.ep, config.dtensor_moe.etp) == (8, 2)
    assert config.model_spec.parallelize_fn is parallelize_titan
    assert config.hf_assets_path.startswith("./assets/hf/")  # torchtitan's, not the shipped tiny tokenizer


def test_bad_config_name_is_one_line(capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit) as exit_:
        ConfigManager().parse_args(["--module", "dtensor_moe.titan", "--config", "deepseek_v3_7b"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err == (f"dtensor_moe.titan: --config 'deepseek_v3_7b' is not one of its config functions; valid: "
                   f"{list(registry.CONFIGS)}\n"), err
    assert not hasattr(registry, "deepseek_v3_7b")  # any other look-up: Python's AttributeError
    with pytest.raises(ImportError):
        from dtensor_moe.titan.config_registry import deepseek_v3_7b  # noqa: F401


def test_wrap_config_wraps_a_users_own_config(monkeypatch):
    """The documented way (docs/titan.md): torchtitan's config, changed, then wrapped."""
    from torchtitan.models.qwen3.config_registry import qwen3_30b_a3b

    from dtensor_moe.titan import wrap_config

    assert wrap_config is registry.wrap_config
    theirs = qwen3_30b_a3b()
    theirs.training.seq_len = 8192
    theirs.parallelism.expert_parallel_degree = 8
    config = wrap_config(theirs)
    assert type(config) is Trainer.Config and config.model_spec.parallelize_fn is parallelize_titan
    assert config.training.seq_len == 8192 and config.training.disable_cuda_graphs
    assert config.parallelism.expert_parallel_degree == 1 and config.dtensor_moe.ep == 1
    assert config.hf_assets_path == theirs.hf_assets_path and config.model_spec.model is theirs.model_spec.model
    assert theirs.parallelism.expert_parallel_degree == 8 and not theirs.training.disable_cuda_graphs  # not changed
    config.dtensor_moe.ep = 4
    monkeypatch.setenv("WORLD_SIZE", "16")  # our Config checks its degrees against the world it will run on
    again = wrap_config(config)
    assert again.dtensor_moe.ep == 4 and again.model_spec.parallelize_fn is parallelize_titan


def test_wrap_config_refuses_what_the_hook_cannot_shard():
    from dataclasses import dataclass

    from torchtitan.models.common.moe import GroupedExperts
    from torchtitan.models.deepseek_v3.config_registry import deepseek_v3_debugmodel_hybridep
    from torchtitan.models.llama3.config_registry import llama3_debugmodel
    from torchtitan.models.qwen3.config_registry import qwen3_moe_debug

    @dataclass(kw_only=True, slots=True)
    class OtherExperts(GroupedExperts.Config):  # as torchtitan's float8 / mxfp8 converters swap them
        pass

    config = qwen3_moe_debug()
    routed = config.model_spec.model.layers[0].moe.routed_experts
    routed.inner_experts = OtherExperts(**{f: getattr(routed.inner_experts, f) for f in ("dim", "hidden_dim",
                                                                                            "num_experts")})
    with pytest.raises(ValueError, match=r"model_spec\.model\.layers\[0\]\.moe\.routed_experts\.inner_experts is "
                                         r".*OtherExperts, .*valid: GroupedExperts\.Config or GptOssGroupedExperts"):
        registry.wrap_config(config)
    with pytest.raises(ValueError, match=r"layers\[1\]\.moe\.routed_experts\.token_dispatcher is "
                                         r"HybridEPTokenDispatcher\.Config"):
        registry.wrap_config(deepseek_v3_debugmodel_hybridep())
    with pytest.raises(ValueError, match=r"model_spec\.model \(Llama3Model\.Config\) has no MoE layers"):
        registry.wrap_config(llama3_debugmodel())

    class Subclass(TitanTrainer.Config):
        pass

    with pytest.raises(ValueError, match="wrap_config takes a torchtitan.trainer.Trainer.Config, got "):
        registry.wrap_config(Subclass(model_spec=llama3_debugmodel().model_spec))


def _titan_config_functions():
    """Every config function of torchtitan's model registries that imports here (not kimi_k2_7 and qwen3_5: they
    need torchvision / fla) and runs here (not the torchao ones, those needing a Hopper GPU, nor muse_glimmer's
    multimodal ones: torchvision)."""
    from torchtitan.models import _supported_models

    for family in sorted(_supported_models):
        try:
            module = importlib.import_module(f"torchtitan.models.{family}.config_registry")
        except ImportError:
            continue
        for name, fn in inspect.getmembers(module, inspect.isfunction):
            if name.startswith("_") or fn.__module__ != module.__name__ or inspect.signature(fn).parameters:
                continue
            try:
                yield name, fn()
            except (ImportError, ValueError):  # torchao, or FlexAttention's flash backend without Hopper
                continue


def test_every_torchtitan_moe_config_is_here_or_refused():
    here, refused = [], []
    for name, config in _titan_config_functions():
        layers = getattr(config.model_spec.model, "layers", None) or []
        if not any(getattr(layer, "moe", None) is not None for layer in layers):
            continue
        if name in registry.CONFIGS:
            here.append(name)
            continue
        with pytest.raises(ValueError, match="wrap_config: "):
            registry.wrap_config(config)
        refused.append(name)
    assert set(here) == set(TITAN_MODELS) - {"deepseek_v3_236b", "qwen3_235b_a22b", *MOONSHOT}, here
    # the variants with another token dispatcher (its comm backends)
    assert refused and all(re.search("hybridep|minimal_async_ep|deepep", name) for name in refused), refused


# The Hugging Face configs (config.json) of moonshotai/Moonlight-16B-A3B and moonshotai/Kimi-K2-Base: their
# DeepseekV3 fields that set parameter shapes and routing.
HF_MOONSHOT = {
    "moonlight_16b_a3b": dict(hidden_size=2048, intermediate_size=11264, moe_intermediate_size=1408,
                              n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6, num_attention_heads=16,
                              num_key_value_heads=16, q_lora_rank=None, routed_scaling_factor=2.446),
    "kimi_k2": dict(hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, n_routed_experts=384,
                    n_shared_experts=1, num_experts_per_tok=8, num_attention_heads=64, num_key_value_heads=64,
                    q_lora_rank=1536, routed_scaling_factor=2.827),
}


def _per_expert(shapes: dict) -> dict:
    """transformers' fused expert parameters (gate_up_proj [E, 2F, D], down_proj [E, D, F]) as the checkpoint's
    per-expert weights, which torchtitan's adapter writes."""
    out = {}
    for name, shape in shapes.items():
        prefix, _, last = name.rpartition(".")
        if not prefix.endswith("mlp.experts"):
            out[name] = shape
            continue
        E, rows, cols = shape
        for e in range(E):
            if last == "gate_up_proj":
                out |= {f"{prefix}.{e}.{p}.weight": (rows // 2, cols) for p in ("gate_proj", "up_proj")}
            else:
                out[f"{prefix}.{e}.down_proj.weight"] = (rows, cols)
    return out


@pytest.mark.parametrize("name", list(HF_MOONSHOT))
def test_moonshot_decoders_are_hf_s(name):
    """What torchtitan's DeepSeek-V3 state-dict adapter writes of our Moonshot decoder (cut to 3 layers) has the
    names and shapes of transformers' DeepseekV3 built from the model's Hugging Face config, and the router
    routes as that config says."""
    tf = pytest.importorskip("transformers")
    from torchtitan.models.deepseek_v3.state_dict_adapter import DeepSeekV3StateDictAdapter

    from dtensor_moe.titan.parallelize_titan import moe_config

    hf_config = tf.DeepseekV3Config(**HF_MOONSHOT[name], num_hidden_layers=3, vocab_size=163840, kv_lora_rank=512,
                                    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                                    first_k_dense_replace=1, n_group=1, topk_group=1, norm_topk_prob=True,
                                    tie_word_embeddings=False)
    with torch.device("meta"):
        hf = tf.AutoModelForCausalLM.from_config(hf_config)
    spec = registry.CONFIGS[name]().model_spec
    spec.model.layers = spec.model.layers[:3]
    ours = _build(spec.model)
    to_hf = DeepSeekV3StateDictAdapter(spec.model, None).to_hf(ours.state_dict())
    bias = {n: tuple(b.shape) for n, b in hf.named_buffers() if n.endswith("e_score_correction_bias")}
    assert {n: tuple(t.shape) for n, t in to_hf.items()} == _per_expert(_shapes(hf)) | bias
    moe = ours.layers["1"].moe
    routing = moe_config(moe)
    assert (routing.score_func, routing.top_k, routing.route_norm, routing.route_scale) == (
        "sigmoid", hf_config.num_experts_per_tok, True, hf_config.routed_scaling_factor)
    assert moe.router.num_expert_groups in (None, 1)
