"""`--dtensor_moe.round_tokens_to M`: tile-aware token rounding (MoEConfig.round_tokens_to,
dtensor_moe/token_rounding.py) for torchtitan's MoE, the same rule on each rank's tokens as our layer's.

torchtitan's MoE routes, counts (its `tokens_per_expert_E`, which steers the aux-loss-free bias: the router's choices,
before rounding, as ours) and hands the choices to `routed_experts`. A hook on the router keeps its full scores; a
pre-hook on `routed_experts` rounds the choices: a dropped pair gets expert id E and weight 0, so torchtitan's
reordering puts it after every kept row, an added pair the router's weight formula at its expert (route_norm over
the token's chosen experts, times route_scale: torchtitan's routers are softmax or sigmoid). Under EP / ETP the
counts leave the dropped rows out and our dispatcher neither sends nor computes them; without a dispatcher
torchtitan's grouped GEMM runs every row, so the dropped ones (weight 0) count as the last expert's, as in our
single-process layer.
"""

import torch
from torch import nn

from dtensor_moe.config import MoEConfig
from dtensor_moe.router import combine_weights_TE
from dtensor_moe.routing import expert_major
from dtensor_moe.token_rounding import round_tokens


def round_titan_tokens(moe: nn.Module, cfg: MoEConfig, multiple: int, dispatched: bool) -> None:
    """Rounds every forward's pairs of torchtitan MoE `moe` (whose routing `cfg` describes) to multiples of
    `multiple`; `dispatched`: our ExpertDispatcher runs its experts (ep * etp > 1)."""
    router = moe.router
    groups = router.num_expert_groups or 1
    kept = {}

    def keep_scores(module, args, out):
        kept["scores_BLE"] = out[2]

    def round_pairs(module, args):
        x_BLD, w_BLK, ids_BLK, counts_E = args
        E, K = counts_E.numel(), ids_BLK.shape[-1]
        scores_TE, chosen_TK = kept.pop("scores_BLE").reshape(-1, E), ids_BLK.reshape(-1, K)
        # No topk_softmax among torchtitan's routers: the logits are never read.
        weight_TE = combine_weights_TE(cfg, scores_TE, scores_TE, chosen_TK)
        ids_TK, w_TK = round_tokens(chosen_TK, chosen_TK, w_BLK.reshape(-1, K), weight_TE, multiple, None, groups)
        rows_E = expert_major(ids_TK.flatten(), E)[2]
        if not dispatched:
            rows_E = torch.cat([rows_E[:-1], rows_E[-1:] + (ids_TK.numel() - rows_E.sum())])
        return x_BLD, w_TK.view_as(w_BLK), ids_TK.view_as(ids_BLK), rows_E.to(counts_E.dtype)

    router.register_forward_hook(keep_scores)
    moe.routed_experts.register_forward_pre_hook(round_pairs)
