"""Top-k token router: softmax, sigmoid or gpt-oss's top-k-softmax scores, optional gate bias,
aux-free bias and DeepSeek-V3's group-limited selection."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dtensor_moe.config import MoEConfig

__all__ = ["TopKRouter", "Routing", "combine_weights_TE"]


@dataclass(frozen=True)
class Routing:
    """One routing decision. weights_TK in x's dtype; scores_TE (each token's probability per
    expert, what the balance losses measure) and logits_TE in at least float32."""

    weights_TK: torch.Tensor
    experts_TK: torch.Tensor
    scores_TE: torch.Tensor
    logits_TE: torch.Tensor


class _Gate(torch.autograd.Function):
    """logits = x W^T + b computed in `dtype` (>= float32), keeping x in its own dtype for the backward: a
    bf16 layer's input is not kept a second time as a float32 copy ([T, D] float32: at DeepSeek-V3's shape
    almost half of what the experts' minimal path keeps); the backward casts it again."""

    @staticmethod
    def forward(ctx, x_TD, weight_ED, bias_E, dtype):
        ctx.save_for_backward(x_TD, weight_ED)
        ctx.dtype, ctx.bias_dtype = dtype, None if bias_E is None else bias_E.dtype
        return F.linear(x_TD.to(dtype), weight_ED.to(dtype), None if bias_E is None else bias_E.to(dtype))

    @staticmethod
    def backward(ctx, dlogits_TE):
        x_TD, weight_ED = ctx.saved_tensors
        dx_TD = (dlogits_TE @ weight_ED.to(ctx.dtype)).to(x_TD.dtype)
        dlogits_NE = dlogits_TE.reshape(-1, dlogits_TE.shape[-1])
        dweight_ED = dlogits_NE.T @ x_TD.reshape(-1, x_TD.shape[-1]).to(ctx.dtype)
        dbias_E = None if ctx.bias_dtype is None else dlogits_NE.sum(0).to(ctx.bias_dtype)
        return dx_TD, dweight_ED.to(weight_ED.dtype), dbias_E, None


def limit_groups(select_TE: torch.Tensor, num_groups: int, num_limited: int) -> torch.Tensor:
    """DeepSeek-V3's group limit: a group's score is the sum of its top-2 selection scores; experts
    outside the num_limited best groups become unselectable (-inf, since biased scores may be < 0)."""
    T, E = select_TE.shape
    select_TGE = select_TE.view(T, num_groups, E // num_groups)
    # Groups of one expert (allowed here, unlike DeepSeek's code) score by that expert alone.
    group_TG = select_TGE.topk(min(2, E // num_groups), dim=-1).values.sum(dim=-1)
    kept_TG = torch.zeros_like(group_TG, dtype=torch.bool).scatter_(1, group_TG.topk(num_limited, dim=-1).indices, True)
    return select_TGE.masked_fill(~kept_TG[..., None], float("-inf")).view(T, E)


def combine_weights_TE(config: MoEConfig, scores_TE: torch.Tensor, logits_TE: torch.Tensor,
                       experts_TK: torch.Tensor) -> torch.Tensor:
    """[T, E]: the combine weight the router's formula gives each expert for each token, normalized over the
    token's chosen experts_TK as its own weights are (route_norm's sum, topk_softmax's softmax), times route_scale.
    At a chosen expert it is that pair's weight; token rounding weighs the experts it adds with it."""
    if config.score_func == "topk_softmax":
        weights_TE = torch.exp(logits_TE - torch.logsumexp(logits_TE.gather(-1, experts_TK), dim=-1, keepdim=True))
    elif config.route_norm:
        weights_TE = scores_TE / (scores_TE.gather(-1, experts_TK).sum(dim=-1, keepdim=True) + 1e-20)
    else:
        weights_TE = scores_TE
    return weights_TE * config.route_scale


class TopKRouter(nn.Module):
    """The MoE layer's top-k router: a gate Linear [num_experts, dim] scores every expert for every token,
    and each token's top_k experts are chosen with their combine weights.

    Scores by `score_func` (softmax, sigmoid, or gpt-oss's softmax over the chosen logits), renormalized
    over the chosen experts with `route_norm`, times `route_scale`; DeepSeek-V3's group limit and the
    aux-free bias steer only which experts are chosen, never the weights. The gate runs in at least
    float32 whatever the activations' dtype, since routing decisions are sensitive to rounding.
    `MoE` builds one (`MoE.router`); build one directly to route outside a layer.

    Args:
        config (MoEConfig): read for dim, num_experts, top_k, score_func, route_norm, route_scale,
            router_bias, num_expert_groups and num_limited_groups.

    Forward args: x_TD [tokens, dim]; `expert_bias_E` (the aux-free bias, or None); `experts_TK` (routing
    replay's recorded choices, or None). Returns a `Routing`: weights_TK in x's dtype, experts_TK,
    and scores_TE, logits_TE in at least float32.

    Example:
        >>> import torch
        >>> from dtensor_moe import MoEConfig, TopKRouter
        >>> router = TopKRouter(MoEConfig(dim=16, hidden_dim=32, num_experts=8, top_k=2))
        >>> r = router(torch.randn(5, 16))
        >>> r.experts_TK.shape, r.weights_TK.sum(dim=-1).allclose(torch.ones(5))
        (torch.Size([5, 2]), True)
    """

    def __init__(self, config: MoEConfig):
        super().__init__()
        self.config = config
        self.gate = nn.Linear(config.dim, config.num_experts, bias=config.router_bias)

    def forward(self, x_TD: torch.Tensor, expert_bias_E: torch.Tensor | None = None,
                experts_TK: torch.Tensor | None = None) -> Routing:
        """`experts_TK` (routing replay, dtensor_moe/replay.py): these choices instead of the top-k; the combine
        weights are then the current scores' at them, as if the router had chosen them, so gradients reach the gate."""
        cfg = self.config
        # Routing decisions are sensitive to rounding: the gate runs in >= float32 even for bf16
        # activations, so a bf16 model routes like its float32 upcast (and like every other mesh).
        dtype = torch.promote_types(x_TD.dtype, torch.float32)
        logits_TE = _Gate.apply(x_TD, self.gate.weight, self.gate.bias, dtype)
        if cfg.score_func == "sigmoid":
            scores_TE = torch.sigmoid(logits_TE)
        else:
            scores_TE = torch.softmax(logits_TE, dim=-1)
        if experts_TK is None:
            experts_TK = self._select(logits_TE, scores_TE, expert_bias_E)
        if cfg.score_func == "topk_softmax":  # softmax over the K chosen logits: normalized already
            weights_TK = torch.softmax(logits_TE.gather(-1, experts_TK), dim=-1)
        else:
            weights_TK = scores_TE.gather(-1, experts_TK)
            # At top_k = 1 too: torchtitan, Megatron and Hugging Face's norm_topk_prob give weight 1 * route_scale.
            if cfg.route_norm:
                weights_TK = weights_TK / (weights_TK.sum(dim=-1, keepdim=True) + 1e-20)
        weights_TK = weights_TK * cfg.route_scale
        return Routing(weights_TK.to(x_TD.dtype), experts_TK, scores_TE, logits_TE)

    def _select(self, logits_TE: torch.Tensor, scores_TE: torch.Tensor,
                expert_bias_E: torch.Tensor | None) -> torch.Tensor:
        cfg = self.config
        # gpt-oss picks on the logits; the others on the scores.
        select_TE = logits_TE if cfg.score_func == "topk_softmax" else scores_TE
        # The aux-free bias only steers which experts are chosen, never the combine weights (DeepSeek-V3).
        if expert_bias_E is not None:
            select_TE = select_TE + expert_bias_E
        if cfg.num_expert_groups > 1:
            select_TE = limit_groups(select_TE, cfg.num_expert_groups, cfg.num_limited_groups)
        return torch.topk(select_TE, cfg.top_k, dim=-1).indices

    def reset_parameters(self, std: float = 0.02):
        nn.init.normal_(self.gate.weight, std=std)
        if self.gate.bias is not None:
            nn.init.zeros_(self.gate.bias)
