"""`--dtensor_moe.run.round_tokens_to M`: tile-aware token rounding (MoERunOptions.round_tokens_to,
dtensor_moe/routing/token_rounding.py) for torchtitan's MoE, the same rule on each rank's tokens as our layer's.

torchtitan's MoE routes, counts (its `tokens_per_expert_E`, which steers the aux-loss-free bias: the router's
choices, before rounding, as ours) and hands the choices to `routed_experts`. The rounding needs the router's full
scores, which go no further than that forward, and must come after the count: so the MoE's forward is replaced by
torchtitan's own steps with the rounding between the count and `routed_experts`, the scores a local variable. No
state passes between modules: a router run without its experts holds nothing back, and torch.compile and activation
checkpointing's recomputation see one plain forward. A dropped pair gets expert id E and weight 0, so torchtitan's
reordering puts it after every kept row, an added pair the router's weight formula at its expert (route_norm over the
token's chosen experts, times route_scale: torchtitan's routers are softmax or sigmoid). Under EP / ETP the counts
leave the dropped rows out and our dispatcher neither sends nor computes them; without a dispatcher torchtitan's
grouped GEMM runs every row, so the dropped ones (weight 0) count as the last expert's, as in our single-process
layer.
"""

import types

import torch
from torch import nn
from torchtitan.models.common.moe import MoE

from dtensor_moe.config import MoEConfig
from dtensor_moe.routing.router import combine_weights_TE
from dtensor_moe.routing.tables import expert_major
from dtensor_moe.routing.token_rounding import round_tokens_compiled


def round_titan_tokens(moe: nn.Module, cfg: MoEConfig, multiple: int, dispatched: bool) -> None:
    """Rounds every forward's pairs of torchtitan MoE `moe` (whose routing `cfg` describes) to multiples of
    `multiple`; `dispatched`: our dispatch strategy runs its experts (ep * etp > 1)."""
    if type(moe).forward is not MoE.forward:  # its steps are the ones repeated below
        raise ValueError(f"--dtensor_moe.run.round_tokens_to is not supported for {type(moe).__name__}, which has its "
                         f"own forward; valid: torchtitan's MoE and its subclasses that keep MoE.forward")
    groups = moe.router.num_expert_groups or 1

    def forward(self, x_BLD: torch.Tensor) -> torch.Tensor:
        # torchtitan's MoE.forward (models/common/moe.py) with the rounding after its count.
        w_BLK, ids_BLK, scores_BLE = self.router(x_BLD, self.expert_bias_E)
        routing_map_BLE = torch.zeros_like(scores_BLE, dtype=torch.bool).scatter_(-1, ids_BLK, True)
        counts_E = routing_map_BLE.sum(dim=(0, 1))
        if self.training:
            with torch.no_grad():
                self.tokens_per_expert_E.add_(counts_E)
        w_BLK, ids_BLK, rows_E = _round(cfg, multiple, dispatched, groups, w_BLK, ids_BLK, scores_BLE, counts_E)
        out_BLD = self.routed_experts(x_BLD, w_BLK, ids_BLK, rows_E)
        if self.shared_experts is not None:
            out_BLD = out_BLD + self.shared_experts(x_BLD)
        return out_BLD

    # Bound, not a closure over `moe`: a deepcopy of the module then runs its own weights.
    moe.forward = types.MethodType(forward, moe)


def _round(cfg: MoEConfig, multiple: int, dispatched: bool, groups: int, w_BLK: torch.Tensor, ids_BLK: torch.Tensor,
           scores_BLE: torch.Tensor, counts_E: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rounded (weights, expert ids, rows per expert) that `routed_experts` takes in place of the router's."""
    E, K = counts_E.numel(), ids_BLK.shape[-1]
    scores_TE, chosen_TK = scores_BLE.reshape(-1, E), ids_BLK.reshape(-1, K)
    # No topk_softmax among torchtitan's routers: the logits are never read.
    weight_TE = combine_weights_TE(cfg, scores_TE, scores_TE, chosen_TK)
    ids_TK, w_TK = round_tokens_compiled(chosen_TK, chosen_TK, w_BLK.reshape(-1, K), weight_TE, multiple, None, groups)
    rows_E = expert_major(ids_TK.flatten(), E)[2]
    if not dispatched:
        rows_E = torch.cat([rows_E[:-1], rows_E[-1:] + (ids_TK.numel() - rows_E.sum())])
    return w_TK.view_as(w_BLK), ids_TK.view_as(ids_BLK), rows_E.to(counts_E.dtype)
