"""Top-k token router: a bias-free gate, softmax or sigmoid scores, optional aux-free bias."""

import torch
import torch.nn.functional as F
from torch import nn

from dtensor_moe.config import MoEConfig


class TopKRouter(nn.Module):
    def __init__(self, config: MoEConfig):
        super().__init__()
        self.config = config
        self.gate = nn.Linear(config.dim, config.num_experts, bias=False)

    def forward(self, x_TD: torch.Tensor, expert_bias_E: torch.Tensor | None = None):
        """Returns (weights_TK in x's dtype, experts_TK, scores_TE in at least float32)."""
        cfg = self.config
        # Routing decisions are sensitive to rounding: the gate runs in >= float32 even for bf16
        # activations, so a bf16 model routes like its float32 upcast (and like every other mesh).
        dtype = torch.promote_types(x_TD.dtype, torch.float32)
        logits_TE = F.linear(x_TD.to(dtype), self.gate.weight.to(dtype))
        if cfg.score_func == "softmax":
            scores_TE = torch.softmax(logits_TE, dim=-1)
        else:
            scores_TE = torch.sigmoid(logits_TE)
        # The aux-free bias only steers which experts are chosen, never the combine weights (DeepSeek-V3).
        select_TE = scores_TE if expert_bias_E is None else scores_TE + expert_bias_E
        _, experts_TK = torch.topk(select_TE, cfg.top_k, dim=-1)
        weights_TK = scores_TE.gather(-1, experts_TK)
        if cfg.route_norm and cfg.top_k > 1:
            weights_TK = weights_TK / (weights_TK.sum(dim=-1, keepdim=True) + 1e-20)
        weights_TK = weights_TK * cfg.route_scale
        return weights_TK.to(x_TD.dtype), experts_TK, scores_TE

    def reset_parameters(self, std: float = 0.02):
        nn.init.normal_(self.gate.weight, std=std)
