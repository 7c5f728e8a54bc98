"""Config functions for `--module dtensor_moe.titan --config <name>` (torchtitan 0.3.0).

Each is torchtitan's own config of that model with our parallelize function and our Trainer
(its `dtensor_moe` section holds the expert degrees), reading the tiny tokenizer and corpus
shipped in dtensor_moe/titan_data (torchtitan's test assets are not in its wheel).

  deepseek_v3_debugmodel              torchtitan's deepseek_v3 debugmodel (GPU)
  qwen3_moe_debug                     torchtitan's qwen3 debugmodel_moe (GPU)
  deepseek_v3_debugmodel_cpu          the same DeepSeek-V3 architecture shrunk for CPU gloo ranks
  deepseek_v3_hf_cpu                  that model with DeepSeek-V3's own routing (Hugging Face's DeepseekV3)
  qwen3_moe_tiny_cpu                  qwen3 debugmodel_moe's architecture at the same tiny sizes
  qwen3_moe_debug_cpu                 qwen3 debugmodel_moe cut to one layer for CPU (slow: ~10 s a step)
  deepseek_v3_debugmodel_cpu_titan_ep the DeepSeek CPU model under torchtitan's own parallelize (its own EP
                                      via --parallelism.expert_parallel_degree): the reference
"""

from dataclasses import fields, replace
from pathlib import Path

from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.deepseek_v3 import parallelize_deepseekv3
from torchtitan.models.deepseek_v3.config_registry import deepseek_v3_debugmodel as _titan_deepseek_v3
from torchtitan.models.qwen3.config_registry import qwen3_moe_debug as _titan_qwen3_moe
from torchtitan.tools.utils import device_type
from torchtitan.trainer import Trainer as TitanTrainer

from .models import deepseek_v3_tiny, qwen3_moe_tiny
from .parallelize import parallelize_titan, sum_reductions
from .trainer import Trainer

DATA = Path(__file__).resolve().parent.parent / "titan_data"
TINY_VOCAB = 384  # >= the shipped tokenizer's 382 entries


def _with(config: TitanTrainer.Config, cls, parallelize_fn) -> TitanTrainer.Config:
    """`config` as a `cls` config with `parallelize_fn`, our data, and settings every hook run needs."""
    kwargs = {f.name: getattr(config, f.name) for f in fields(config) if f.init and f.name != "dtensor_moe"}
    kwargs.update(
        model_spec=replace(config.model_spec, parallelize_fn=parallelize_fn),
        hf_assets_path=str(DATA / "tokenizer"),
        dataloader=HuggingFaceTextDataLoader.Config(dataset="c4_test", dataset_path=str(DATA / "corpus")),
        parallelism=replace(config.parallelism, spmd_backend="partial_dtensor"),
        training=replace(config.training, disable_cuda_graphs=True),
    )
    return cls.Config(**kwargs)


def deepseek_v3_debugmodel() -> Trainer.Config:
    return _with(_titan_deepseek_v3(), Trainer, parallelize_titan)


def qwen3_moe_debug() -> Trainer.Config:
    return _with(_titan_qwen3_moe(), Trainer, parallelize_titan)


def _tiny_cpu(config: TitanTrainer.Config, flavor: str, model) -> TitanTrainer.Config:
    """`config` with a tiny `model` and the CPU run settings of this module's tiny configs."""
    config.model_spec = replace(config.model_spec, flavor=flavor, model=model)
    config.loss = ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size=TINY_VOCAB))
    config.training = replace(
        config.training, local_batch_size=2, seq_len=32, steps=10, mixed_precision_param="float32"
    )
    config.optimizer.param_groups[0].optimizer_kwargs["lr"] = 3e-3
    config.activation_checkpoint = None
    config.checkpoint = replace(config.checkpoint, interval=5)
    config.debug.seed = 0
    return config


def deepseek_v3_debugmodel_cpu() -> Trainer.Config:
    return _with(
        _tiny_cpu(_titan_deepseek_v3(), "debugmodel_cpu", deepseek_v3_tiny(TINY_VOCAB)), Trainer, parallelize_titan
    )


def deepseek_v3_hf_cpu() -> Trainer.Config:
    """The tiny DeepSeek-V3 with DeepSeek-V3's own routing, as Hugging Face's DeepseekV3 has it: sigmoid
    scores, 4 groups of 2 experts (2 kept), renormalized and scaled by 2.5; every norm's eps 1e-6."""
    model = deepseek_v3_tiny(TINY_VOCAB, eps=1e-6, router_score_func="sigmoid", router_num_expert_groups=4,
                             router_num_limited_groups=2, router_route_norm=True, router_route_scale=2.5)
    return _with(_tiny_cpu(_titan_deepseek_v3(), "hf_cpu", model), Trainer, parallelize_titan)


def qwen3_moe_tiny_cpu() -> Trainer.Config:
    """torchtitan's qwen3 MoE architecture at deepseek_v3_debugmodel_cpu's sizes and run settings."""
    return _with(_tiny_cpu(_titan_qwen3_moe(), "tiny_cpu", qwen3_moe_tiny(TINY_VOCAB)), Trainer, parallelize_titan)


def _titan_parallelize(model, **kwargs):
    model = parallelize_deepseekv3(model, **kwargs)
    return sum_reductions(model) if device_type == "cpu" else model


def deepseek_v3_debugmodel_cpu_titan_ep() -> TitanTrainer.Config:
    return _with(deepseek_v3_debugmodel_cpu(), TitanTrainer, _titan_parallelize)


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
    return config
