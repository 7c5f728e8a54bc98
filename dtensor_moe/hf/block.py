"""`from_hf_block`: our `MoE` from a transformers sparse-MoE module, same weights, buffers and routing."""

import torch

from dtensor_moe.config import MoEConfig, MoERunOptions
from dtensor_moe.hf.convert import load_hf_moe
from dtensor_moe.hf.families import family, with_balance_fields
from dtensor_moe.hf.reader import StateDictReader
from dtensor_moe.moe import MoE

SPARSE_BLOCKS = ("Qwen3MoeSparseMoeBlock", "MixtralSparseMoeBlock", "DeepseekV3MoE", "GptOssMLP")


def _config(block) -> tuple[str, MoEConfig]:
    """(model_type, our config) from the module itself: only DeepseekV3MoE keeps its config."""
    name = type(block).__name__
    ex = block.experts
    if name == "DeepseekV3MoE":
        return "deepseek_v3", family("deepseek_v3").config(lambda k, d=None: getattr(block.config, k, d))
    if name in ("Qwen3MoeSparseMoeBlock", "MixtralSparseMoeBlock"):
        model_type = "qwen3_moe" if name.startswith("Qwen3") else "mixtral"
        fields = dict(hidden_size=ex.hidden_dim, num_experts_per_tok=block.gate.top_k,
                      hidden_act="silu" if "SiLU" in type(ex.act_fn).__name__ else type(ex.act_fn).__name__)
        if model_type == "qwen3_moe":
            fields.update(moe_intermediate_size=ex.intermediate_dim, num_experts=ex.num_experts,
                          norm_topk_prob=block.gate.norm_topk_prob)
        else:
            fields.update(intermediate_size=ex.intermediate_dim, num_local_experts=ex.num_experts,
                          router_jitter_noise=block.jitter_noise)
        return model_type, family(model_type).config(lambda k, d=None: fields.get(k, d))
    if name == "GptOssMLP":
        fields = dict(hidden_size=ex.hidden_size, intermediate_size=ex.intermediate_size,
                      num_local_experts=ex.num_experts, num_experts_per_tok=block.router.top_k,
                      swiglu_alpha=ex.alpha, swiglu_limit=ex.limit)
        return "gpt_oss", family("gpt_oss").config(lambda k, d=None: fields.get(k, d))
    raise ValueError(f"from_hf_block takes one of {SPARSE_BLOCKS}, got {name}")


def from_hf_block(block: torch.nn.Module, options: MoERunOptions | None = None, **balance_fields) -> MoE:
    """Our `MoE` equal to `block` (its dtype, device, weights, e_score_correction_bias as expert_bias,
    routing configuration); parallelize it like any other `MoE`. `options`: how the run computes it (None: the
    defaults). `balance_fields`: `MoEConfig` fields the Hugging Face config does not fix (aux_loss_coeff,
    z_loss_coeff, ..., and load_balance where the family stores no routing bias: "none" or "aux_loss")."""
    model_type, config = _config(block)
    config = with_balance_fields(family(model_type), config, balance_fields)
    p = next(block.parameters())
    moe = MoE(config, options).to(device=p.device, dtype=p.dtype)
    return load_hf_moe(moe, StateDictReader(block.state_dict()), family(model_type), "")
