"""Config functions for `--module dtensor_moe.titan --config <name>` (torchtitan 0.3.0), and `wrap_config`,
which makes any torchtitan config (a user's own included) one for this hook.

Each is torchtitan's own config through `wrap_config`: our parallelize function and our Trainer (its
`dtensor_moe` section holds the expert degrees). torchtitan 0.3.0's MoE configs, under torchtitan's names, at
their own sizes (`TITAN_MODELS`; `dtensor-moe plan` prices each under the same name, `dtensor-moe plan --model NAME`):

  deepseek_v3_16b                     torchtitan's, as it is (tokenizer ./assets/hf/deepseek-moe-16b-base, c4)
  deepseek_v3_671b                    torchtitan's, as it is (./assets/hf/DeepSeek-V3.1-Base, c4)
  qwen3_30b_a3b                       torchtitan's, without its routing bias (./assets/hf/Qwen3-30B-A3B, c4)
  gpt_oss_20b, gpt_oss_120b           torchtitan's, as they are (./assets/hf/gpt-oss-20b, -120b, c4)
  deepseek_v3_236b, qwen3_235b_a22b   models torchtitan registers (flavors "236B", "235B-A22B") without a
                                      config function: deepseek_v3_671b's / qwen3_30b_a3b's settings with
                                      that model, tokenizer ./assets/hf/DeepSeek-V2 / ./assets/hf/Qwen3-235B-A22B
  moonlight_16b_a3b, kimi_k2          Moonshot's DeepSeek-V3-architecture text decoders (titan/moonshot.py:
                                      torchtitan's kimi_k2_7 text towers as DeepSeekV3Model, without its
                                      vision tower, torchvision and DistMuon) with deepseek_v3_16b's /
                                      deepseek_v3_671b's settings (AdamW), tokenizer ./assets/hf/Moonlight-16B-A3B
                                      / ./assets/hf/Kimi-K2-Base
  deepseek_v3_debugmodel              torchtitan's debug configs (GPU: FlexAttention), reading the tiny
  deepseek_v3_debugmodel_mtp          tokenizer and corpus shipped in dtensor_moe/titan_data instead of
  qwen3_moe_debug                     torchtitan's test assets (not in its wheel)
  qwen3_debugmodel_moe_param_groups
  gpt_oss_debugmodel                  (GPU: varlen attention)
  gpt_oss_debugmodel_flex             (GPU: FlexAttention)

gpt-oss's experts (biased, gate and up interleaved in one weight) take our plan through titan/gpt_oss.py.
wrap_config refuses torchtitan's other MoE configs: the hybridep / minimal_async_ep / deepep variants swap
torchtitan's token dispatcher, which the hook replaces with its own; the float8 / mxfp8 ones swap its experts.

CPU configs, for tests on gloo ranks:

  deepseek_v3_debugmodel_cpu          the same DeepSeek-V3 architecture shrunk for CPU gloo ranks
  deepseek_v3_hf_cpu                  that model with DeepSeek-V3's own routing (Hugging Face's DeepseekV3)
  qwen3_moe_tiny_cpu                  qwen3 debugmodel_moe's architecture at the same tiny sizes
  qwen3_moe_debug_cpu                 qwen3 debugmodel_moe cut to one layer for CPU (slow: ~10 s a step)
  gpt_oss_tiny_cpu                    gpt_oss debugmodel's architecture at the same tiny sizes (attention in
                                      plain torch ops: sinks, sliding windows of 8)
  deepseek_v3_debugmodel_cpu_titan_ep the DeepSeek CPU model under torchtitan's own parallelize (its own EP
                                      via --parallelism.expert_parallel_degree): the reference

The Qwen3 ones train no aux-loss-free routing bias (torchtitan's do: Hugging Face's Qwen3-MoE has no key for it,
so an HF export would drop it) and export HF in float32 (`_no_routing_bias`; docs/titan.md, "Hugging Face
checkpoints"). The gpt-oss ones keep torchtitan's bias (they train as torchtitan's own gpt-oss configs do): an HF
export of them needs --dtensor_moe.load_balance_coeff 0, and without it is refused in one line (transformers'
GptOss has no key for the bias; titan/hf.py, GptOssHFAdapter).

A `--config` name that is not here ends the job with one line listing the valid ones (as a bad degree does),
not torchtitan's traceback.
"""

import sys
from dataclasses import fields, replace
from pathlib import Path

from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
from torchtitan.models import deepseek_v3, qwen3
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.common.config_utils import decoder_vocab_size
from torchtitan.models.common.moe import GroupedExperts, MoE
from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher, LocalTokenDispatcher
from torchtitan.models.deepseek_v3 import config_registry as titan_deepseek_v3
from torchtitan.models.gpt_oss import config_registry as titan_gpt_oss
from torchtitan.models.gpt_oss.moe import GptOssGroupedExperts, GptOssMoE
from torchtitan.models.qwen3 import config_registry as titan_qwen3
from torchtitan.tools.utils import device_type
from torchtitan.trainer import Trainer as TitanTrainer

from dtensor_moe.config import MoERunOptions
from dtensor_moe.tools.presets import TITAN_MODELS

from . import moonshot
from .models import deepseek_v3_tiny, gpt_oss_tiny, qwen3_moe_tiny
from .parallelize_titan import parallelize_titan, sum_reductions
from .trainer import HookConfig, Trainer, _refuse

DATA = Path(__file__).resolve().parent.parent / "titan_data"
TINY_VOCAB = 384  # >= the shipped tokenizer's 382 entries
# torchtitan's dispatchers that leave the tokens on their rank (EP 1), so that ours moves them.
_LOCAL_DISPATCH = (LocalTokenDispatcher.Config, AllToAllTokenDispatcher.Config)
# The experts our plan shards: torchtitan's grouped ones and gpt-oss's (titan/gpt_oss.py).
_EXPERTS = (GroupedExperts.Config, GptOssGroupedExperts.Config)


def wrap_config(config: TitanTrainer.Config) -> Trainer.Config:
    """`config`, a torchtitan 0.3.0 `Trainer.Config` of an MoE decoder (DeepSeek-V3, Qwen3 MoE, gpt-oss, or a
    model of its own built from torchtitan's `MoE`), as a config of this hook: our Trainer (its `dtensor_moe` section:
    the expert degrees, 1 until `--dtensor_moe.ep` / `.etp` / `.dp_replicate` say otherwise) and our
    parallelize function, with what the hook needs: spmd_backend "partial_dtensor", CUDA graphs off, and
    torchtitan's own expert_parallel_degree 1 (EP is ours). Model, data, optimizer, schedule and checkpoint
    settings stay `config`'s. A config of ours comes back with its `dtensor_moe` section kept.

    Raises ValueError, naming the field, for what the hook cannot run: a Trainer.Config subclass (its fields
    and checks would be lost), a model without MoE layers, or an MoE whose experts or token dispatcher are
    not torchtitan's standard ones. Settings the hook refuses on the command line (docs/titan.md, "Limits")
    end the process the same way, from our Trainer.Config's checks."""
    if type(config) not in (TitanTrainer.Config, Trainer.Config):
        raise ValueError(f"wrap_config takes a torchtitan.trainer.Trainer.Config, got {type(config).__qualname__} "
                         f"(from {type(config).__module__}); valid: torchtitan's own Trainer.Config")
    _check_moe_layers(getattr(config.model_spec, "model", None))
    return _as(config, Trainer, parallelize_titan, expert_parallel_degree=1)


def _check_moe_layers(model) -> None:
    """The model's MoE layers are torchtitan's `MoE` (or gpt-oss's) with its grouped experts (w1_EFD, w2_EDF,
    w3_EFD) or gpt-oss's (titan/gpt_oss.py), what our placement plan shards, and a dispatcher that keeps tokens
    local (ours moves them)."""
    layers = [(f"layers[{i}]", layer) for i, layer in enumerate(getattr(model, "layers", None) or [])]
    layers += [(f"mtp_layers[{i}]", layer) for i, layer in enumerate(getattr(model, "mtp_layers", None) or [])]
    moes = [(f"model_spec.model.{where}.moe", layer.moe) for where, layer in layers
            if getattr(layer, "moe", None) is not None]
    if not moes:
        raise ValueError(f"wrap_config: model_spec.model ({type(model).__qualname__}) has no MoE layers; valid: a "
                         "torchtitan decoder whose layers have a `moe` (DeepSeek-V3, Qwen3 MoE, gpt-oss)")
    for where, moe in moes:
        experts = moe.routed_experts.inner_experts
        dispatcher = moe.routed_experts.token_dispatcher
        for what, cfg, valid in ((f"{where}.routed_experts.inner_experts", experts, _EXPERTS),
                                 (f"{where}.routed_experts.token_dispatcher", dispatcher, _LOCAL_DISPATCH),
                                 (where, moe, (MoE.Config, GptOssMoE.Config))):
            if type(cfg) not in valid:
                names = " or ".join(c.__qualname__ for c in valid)
                raise ValueError(f"wrap_config: {what} is {type(cfg).__qualname__}, which dtensor_moe.titan cannot "
                                 f"run; valid: {names} (torchtitan's standard MoE or gpt-oss's, comm_backend "
                                 "'standard', no float8 / mxfp8 converters)")


def _as(config: TitanTrainer.Config, cls, parallelize_fn, **parallelism) -> TitanTrainer.Config:
    """`config` as a `cls` config with `parallelize_fn`, the settings every hook run needs and `parallelism`."""
    _refuse_bad_flags(sys.argv[1:])
    known = {f.name for f in fields(cls.Config)}
    kwargs = {f.name: getattr(config, f.name) for f in fields(config) if f.init and f.name in known}
    kwargs.update(
        model_spec=replace(config.model_spec, parallelize_fn=parallelize_fn),
        parallelism=replace(config.parallelism, spmd_backend="partial_dtensor", **parallelism),
        training=replace(config.training, disable_cuda_graphs=True),
    )
    return cls.Config(**kwargs)


def _shipped_data(config: TitanTrainer.Config) -> TitanTrainer.Config:
    """`config` reading the tokenizer and corpus shipped in dtensor_moe/titan_data (torchtitan's debug configs
    read its test assets, which are not in its wheel)."""
    config.hf_assets_path = str(DATA / "tokenizer")
    config.dataloader = HuggingFaceTextDataLoader.Config(dataset="c4_test", dataset_path=str(DATA / "corpus"))
    return config


def _refuse_bad_flags(argv: list[str]) -> None:
    """An unknown `--dtensor_moe.*` flag, or `--dtensor_moe.run.*` values MoERunOptions refuses, in one line from
    rank 0 while torchtitan loads the config function (every config function here comes through `_as`), before
    its own parser prints an error box on every rank."""
    known = {f.name for f in fields(HookConfig) if f.name != "run"}
    run_types = {f.name: f.type for f in fields(MoERunOptions)}
    known |= {f"run.{name}" for name in run_types}
    run = {}
    for i, arg in enumerate(argv):
        if arg.startswith("--dtensor_moe."):
            name, eq, value = arg.removeprefix("--dtensor_moe.").partition("=")
            name = name.replace("-", "_")
            if name not in known:
                _refuse(ValueError(f"--dtensor_moe.{name} is not an option of the hook; valid: "
                                   f"{', '.join(f'--dtensor_moe.{k}' for k in sorted(known))}"))
            if name.startswith("run.") and (eq or i + 1 < len(argv)):
                field = name.removeprefix("run.")
                run[field] = _typed(value if eq else argv[i + 1], run_types[field])
    try:
        MoERunOptions(**{k: v for k, v in run.items() if v is not _UNPARSED})
    except ValueError as e:
        _refuse(ValueError(str(e).replace("MoERunOptions.", "--dtensor_moe.run.")))


_UNPARSED = object()  # a value of the wrong type: torchtitan's parser names it


def _typed(text: str, kind):
    """A flag's text as the MoERunOptions field of type `kind` holds it (the parser's conversions)."""
    if kind is bool:
        return {"true": True, "false": False}.get(text.lower(), _UNPARSED)
    if kind is str:
        return text
    if text == "None" and kind == float | None:
        return None
    try:
        return int(text) if kind is int else float(text)
    except ValueError:
        return _UNPARSED


# ---- torchtitan's MoE configs ------------------------------------------------------------------------


def deepseek_v3_16b() -> Trainer.Config:
    return wrap_config(titan_deepseek_v3.deepseek_v3_16b())


def deepseek_v3_671b() -> Trainer.Config:
    return wrap_config(titan_deepseek_v3.deepseek_v3_671b())


def _no_routing_bias(config: Trainer.Config) -> Trainer.Config:
    """The hook's Qwen3-MoE settings on torchtitan's: no aux-loss-free routing bias (torchtitan trains one,
    load_balance_coeff 1e-3, that Hugging Face's Qwen3-MoE has no key for: an HF export would drop it), and HF
    exports in float32, the parameters' dtype (torchtitan's Qwen3 configs export float16). Each stays a flag:
    --dtensor_moe.load_balance_coeff, --checkpoint.export_dtype."""
    for layer in config.model_spec.model.layers:
        if layer.moe is not None:
            layer.moe.load_balance_coeff = None
    config.checkpoint = replace(config.checkpoint, export_dtype="float32")
    return config


def qwen3_30b_a3b() -> Trainer.Config:
    return _no_routing_bias(wrap_config(titan_qwen3.qwen3_30b_a3b()))


def gpt_oss_20b() -> Trainer.Config:
    return wrap_config(titan_gpt_oss.gpt_oss_20b())


def gpt_oss_120b() -> Trainer.Config:
    return wrap_config(titan_gpt_oss.gpt_oss_120b())


def _loss(vocab_size: int) -> ChunkedLossWrapper.Config:
    return ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size=vocab_size))


def _with_model(config: TitanTrainer.Config, model_spec, hf_assets_path: str) -> TitanTrainer.Config:
    """`config`'s settings for another model of its family (its loss sized to that model's vocabulary)."""
    config.model_spec, config.hf_assets_path = model_spec, hf_assets_path
    config.loss = _loss(decoder_vocab_size(model_spec))
    return config


def deepseek_v3_236b() -> Trainer.Config:
    """torchtitan's "236B" DeepSeek model (DeepSeek-V2's sizes) with deepseek_v3_671b's settings."""
    model_spec = deepseek_v3.model_registry("236B", attn_backend="flex")
    return wrap_config(_with_model(titan_deepseek_v3.deepseek_v3_671b(), model_spec, "./assets/hf/DeepSeek-V2"))


def qwen3_235b_a22b() -> Trainer.Config:
    """torchtitan's "235B-A22B" Qwen3 MoE model with qwen3_30b_a3b's settings."""
    model_spec = qwen3.model_registry("235B-A22B")
    config = _with_model(titan_qwen3.qwen3_30b_a3b(), model_spec, "./assets/hf/Qwen3-235B-A22B")
    return _no_routing_bias(wrap_config(config))


def moonlight_16b_a3b() -> Trainer.Config:
    """Moonlight-16B-A3B with deepseek_v3_16b's settings."""
    config = _with_model(titan_deepseek_v3.deepseek_v3_16b(), moonshot.moonlight_16b_a3b_spec(),
                         "./assets/hf/Moonlight-16B-A3B")
    return wrap_config(config)


def kimi_k2() -> Trainer.Config:
    """Kimi K2's text tower with deepseek_v3_671b's settings."""
    config = _with_model(titan_deepseek_v3.deepseek_v3_671b(), moonshot.kimi_k2_spec(), "./assets/hf/Kimi-K2-Base")
    return wrap_config(config)


def deepseek_v3_debugmodel() -> Trainer.Config:
    return _shipped_data(wrap_config(titan_deepseek_v3.deepseek_v3_debugmodel()))


def deepseek_v3_debugmodel_mtp() -> Trainer.Config:
    return _shipped_data(wrap_config(titan_deepseek_v3.deepseek_v3_debugmodel_mtp()))


def qwen3_moe_debug() -> Trainer.Config:
    return _no_routing_bias(_shipped_data(wrap_config(titan_qwen3.qwen3_moe_debug())))


def qwen3_debugmodel_moe_param_groups() -> Trainer.Config:
    return _no_routing_bias(_shipped_data(wrap_config(titan_qwen3.qwen3_debugmodel_moe_param_groups())))


def gpt_oss_debugmodel() -> Trainer.Config:
    return _shipped_data(wrap_config(titan_gpt_oss.gpt_oss_debugmodel()))


def gpt_oss_debugmodel_flex() -> Trainer.Config:
    return _shipped_data(wrap_config(titan_gpt_oss.gpt_oss_debugmodel_flex()))


# ---- CPU configs -------------------------------------------------------------------------------------


def _tiny_cpu(config: TitanTrainer.Config, flavor: str, model) -> TitanTrainer.Config:
    """`config` with a tiny `model` and the CPU run settings of this module's tiny configs."""
    config.model_spec = replace(config.model_spec, flavor=flavor, model=model)
    config.loss = _loss(TINY_VOCAB)
    config.training = replace(
        config.training, local_batch_size=2, seq_len=32, steps=10, mixed_precision_param="float32"
    )
    config.optimizer.param_groups[0].optimizer_kwargs["lr"] = 3e-3
    config.activation_checkpoint = None
    config.checkpoint = replace(config.checkpoint, interval=5)
    config.debug.seed = 0
    return config


def deepseek_v3_debugmodel_cpu() -> Trainer.Config:
    return _tiny_cpu(deepseek_v3_debugmodel(), "debugmodel_cpu", deepseek_v3_tiny(TINY_VOCAB))


def deepseek_v3_hf_cpu() -> Trainer.Config:
    """The tiny DeepSeek-V3 with DeepSeek-V3's own routing, as Hugging Face's DeepseekV3 has it: sigmoid
    scores, 4 groups of 2 experts (2 kept), renormalized and scaled by 2.5; every norm's eps 1e-6."""
    model = deepseek_v3_tiny(TINY_VOCAB, eps=1e-6, router_score_func="sigmoid", router_num_expert_groups=4,
                              router_num_limited_groups=2, router_route_norm=True, router_route_scale=2.5)
    return _tiny_cpu(deepseek_v3_debugmodel(), "hf_cpu", model)


def qwen3_moe_tiny_cpu() -> Trainer.Config:
    """torchtitan's qwen3 MoE architecture at deepseek_v3_debugmodel_cpu's sizes and run settings."""
    return _no_routing_bias(_tiny_cpu(qwen3_moe_debug(), "tiny_cpu", qwen3_moe_tiny(TINY_VOCAB)))


def gpt_oss_tiny_cpu() -> Trainer.Config:
    """torchtitan's gpt_oss debugmodel architecture at deepseek_v3_debugmodel_cpu's sizes and run settings, its
    attention in plain torch ops (sinks and sliding windows; titan/models.py)."""
    return _tiny_cpu(gpt_oss_debugmodel(), "tiny_cpu", gpt_oss_tiny(TINY_VOCAB))


def _titan_parallelize(model, **kwargs):
    model = deepseek_v3.parallelize_deepseekv3(model, **kwargs)
    return sum_reductions(model) if device_type == "cpu" else model


def deepseek_v3_debugmodel_cpu_titan_ep() -> TitanTrainer.Config:
    return _as(deepseek_v3_debugmodel_cpu(), TitanTrainer, _titan_parallelize)


def qwen3_moe_debug_cpu() -> Trainer.Config:
    """torchtitan's qwen3 debugmodel_moe (64 experts, top-8) cut to one layer, with SDPA attention."""
    config = qwen3_moe_debug()
    model = config.model_spec.model
    model.layers = model.layers[:1]
    model.layers[0].attention.inner_attention = ScaledDotProductAttention.Config()
    config.model_spec = replace(config.model_spec, flavor="debugmodel_moe_cpu")
    config.training = replace(config.training, local_batch_size=1, seq_len=32, steps=3, mixed_precision_param="float32")
    config.activation_checkpoint = None
    config.debug.seed = 0
    return _no_routing_bias(config)


# ---- the names -----------------------------------------------------------------------------------------

# TITAN_MODELS (torchtitan's own models at their own sizes) are `dtensor-moe plan`'s presets of the same names, which
# tests/test_titan_configs.py checks equal to what these configs build.
CPU_MODELS = ("deepseek_v3_debugmodel_cpu", "deepseek_v3_hf_cpu", "qwen3_moe_tiny_cpu", "qwen3_moe_debug_cpu",
              "gpt_oss_tiny_cpu", "deepseek_v3_debugmodel_cpu_titan_ep")
CONFIGS = {name: globals()[name] for name in TITAN_MODELS + CPU_MODELS}


def __getattr__(name: str):
    """A name not defined here. Looked up by torchtitan's ConfigManager (`getattr(module, name, None)` for
    `--config`): the job ends with one line, exit status 2. Any other look-up gets Python's AttributeError."""
    if sys._getframe(1).f_code.co_name == "_load_config":
        _refuse(ValueError(f"--config {name!r} is not one of its config functions; valid: {list(CONFIGS)}"))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
