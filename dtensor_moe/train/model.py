"""The main job's models: a small decoder-only MoE language model (`MoETransformer`), or a Hugging Face MoE
causal LM with our MoE layers in its sparse blocks' place (`HFCausalLM`, `[model] hf_path`). No parallel code:
`parallelize_transformer` / `parallelize_hf_model` shard them."""

import json

import torch
import torch.nn.functional as F
from torch import nn

from dtensor_moe.config import MoERunOptions
from dtensor_moe.moe import MoE
from dtensor_moe.train.config import ModelConfig

__all__ = ["MoETransformer", "HFCausalLM", "MoEModel", "build_model"]


def rope(x_BHLK: torch.Tensor, positions_L: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding on the last dim (K = head dim) at the given token positions."""
    K = x_BHLK.shape[-1]
    # At least fp32 (bf16 angles are too coarse); fp64 models get fp64 angles, so a float64 check is exact.
    dtype = torch.promote_types(x_BHLK.dtype, torch.float32)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, K, 2, device=x_BHLK.device, dtype=dtype) / K))
    angles_LK = torch.outer(positions_L.to(dtype), inv_freq)
    cos, sin = angles_LK.cos().to(x_BHLK.dtype), angles_LK.sin().to(x_BHLK.dtype)
    x1, x2 = x_BHLK[..., 0::2], x_BHLK[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class CausalAttention(nn.Module):
    """RoPE and causal softmax attention of one whole sequence (a module, as torchtitan's
    `inner_attention`, so that context parallelism can swap in its own)."""

    def forward(self, q_BHLK, k_BHLK, v_BHLK):
        positions_L = torch.arange(q_BHLK.shape[-2], device=q_BHLK.device)
        return F.scaled_dot_product_attention(
            rope(q_BHLK, positions_L), rope(k_BHLK, positions_L), v_BHLK, is_causal=True
        )


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.dim // cfg.n_heads
        # Separate projections (torchtitan's names): tensor parallelism splits each one by heads.
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.inner_attention = CausalAttention()

    def forward(self, x_BLD):
        B, L, _ = x_BLD.shape
        # -1 heads: the local head count where tensor parallelism splits the heads over ranks.
        q, k, v = (w(x_BLD).view(B, L, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        o_BHLK = self.inner_attention(q, k, v)
        return self.wo(o_BHLK.transpose(1, 2).reshape(B, L, -1))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, options: MoERunOptions | None):
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.moe = MoE(cfg.moe_config(), options)

    def forward(self, x_BLD):
        h_BLD = x_BLD + self.attention(self.attention_norm(x_BLD))
        return h_BLD + self.moe(self.ffn_norm(h_BLD))


class MoEModel(nn.Module):
    """What the training loop reads of a model besides its logits: its MoE layers by layer id, and its head's weight
    for a loss that applies the head itself (train/loss.py's chunked cross-entropy)."""

    return_hidden = False  # set: forward returns the final norm's output, not the head's logits

    def head_weight(self) -> torch.Tensor:
        """The LM head's [V, D] weight (the embedding's when tied)."""
        raise NotImplementedError

    def moe_layers(self) -> dict[int, MoE]:
        raise NotImplementedError

    def update_expert_bias(self):
        for moe in self.moe_layers().values():
            moe.update_expert_bias()


class MoETransformer(MoEModel):
    """`layers` is keyed by layer index (ModuleDict): a pipeline stage keeps a subset under the same
    names, so checkpoints reshard across stage splits. A stage may lack `tok_embeddings` (it takes
    hidden states) or `norm` and `output` (it returns hidden states); forward skips what is absent. `config` is
    what checkpoints hold; `options` (None: the defaults) how the run computes the MoE layers."""

    def __init__(self, cfg: ModelConfig, options: MoERunOptions | None = None):
        super().__init__()
        self.config = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): Block(cfg, options) for i in range(cfg.n_layers)})
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.output = None if cfg.tie_embeddings else nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.reset_parameters()

    def reset_parameters(self):
        nn.init.normal_(self.tok_embeddings.weight, std=0.02)
        std_out = 0.02 / (2 * self.config.n_layers) ** 0.5
        for block in self.layers.values():
            for w in (block.attention.wq, block.attention.wk, block.attention.wv):
                nn.init.normal_(w.weight, std=0.02)
            nn.init.normal_(block.attention.wo.weight, std=std_out)
            block.moe.reset_parameters(std=std_out)
        if self.output is not None:
            nn.init.normal_(self.output.weight, std=self.config.dim**-0.5)

    def forward(self, tokens_BL: torch.Tensor) -> torch.Tensor:
        h_BLD = tokens_BL if self.tok_embeddings is None else self.tok_embeddings(tokens_BL)
        for block in self.layers.values():
            h_BLD = block(h_BLD)
        if self.norm is None:  # a pipeline stage before the last returns hidden states
            return h_BLD
        h_BLD = self.norm(h_BLD)
        if self.return_hidden:
            return h_BLD
        # The head as a module call when untied, so tensor parallelism's hooks on it run.
        return F.linear(h_BLD, self.head_weight()) if self.config.tie_embeddings else self.output(h_BLD)

    def head_weight(self) -> torch.Tensor:
        return self.tok_embeddings.weight if self.config.tie_embeddings else self.output.weight

    def moe_layers(self) -> dict[int, MoE]:
        """The MoE layers by layer id (a pipeline stage: its own layers)."""
        return {int(name): block.moe for name, block in self.layers.items()}


class HFCausalLM(MoEModel):
    """A transformers MoE causal LM as the main job's model: token ids in, logits (or its final norm's output) out.
    Its backbone and head keep transformers' names (`model.`, `lm_head.`), so checkpoints hold their keys with our
    MoE inside."""

    def __init__(self, hf_model: nn.Module, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model, self.lm_head = hf_model.model, hf_model.lm_head

    @classmethod
    def from_config(cls, cfg: ModelConfig, options: MoERunOptions | None = None) -> "HFCausalLM":
        """The checkpoint at cfg.hf_path in float32, its sparse blocks swapped for our MoE with cfg's training
        choices and `options`; refused if its config.json is no longer the one the run was configured from."""
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        from dtensor_moe.hf.families import balance_fields
        from dtensor_moe.hf.model import swap_moe_blocks

        hf_logging.disable_progress_bar()  # one bar per rank per load would bury the run's own
        with open(f"{cfg.hf_path}/config.json") as f:
            if json.load(f) != json.loads(cfg.hf_config):
                raise ValueError(f"{cfg.hf_path}/config.json changed since this run was configured; start it again")
        hf = AutoModelForCausalLM.from_pretrained(cfg.hf_path, dtype=torch.float32)
        swap_moe_blocks(hf, options, **balance_fields(cfg.moe_config()))
        return cls(hf, cfg)

    @property
    def layers(self) -> nn.ModuleList:
        return self.model.layers

    def forward(self, tokens_BL: torch.Tensor) -> torch.Tensor:
        h_BLD = self.model(input_ids=tokens_BL, use_cache=False).last_hidden_state  # after the final norm
        return h_BLD if self.return_hidden else self.lm_head(h_BLD)

    def head_weight(self) -> torch.Tensor:
        return self.lm_head.weight

    def moe_layers(self) -> dict[int, MoE]:
        return {i: block.mlp for i, block in enumerate(self.model.layers) if isinstance(block.mlp, MoE)}


def build_model(cfg: ModelConfig, options: MoERunOptions | None = None) -> MoEModel:
    """The main job's model of `cfg` (a transformers model with cfg.hf_path), its MoE layers run with `options`."""
    return HFCausalLM.from_config(cfg, options) if cfg.hf_path else MoETransformer(cfg, options)
