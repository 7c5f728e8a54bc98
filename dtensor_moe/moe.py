"""The MoE feed-forward layer: route, group tokens by expert, run experts, combine.

It knows nothing about parallelism. `parallelize_moe` swaps `stats` for a reducer over the
data-parallel ranks and wraps `experts` with the expert-parallel dispatcher.
"""

import torch
import torch.nn.functional as F
from torch import nn

from dtensor_moe.config import MoEConfig
from dtensor_moe.experts import GroupedExperts
from dtensor_moe.router import TopKRouter
from dtensor_moe.routing import TokenCopies


def recomputing() -> bool:
    """Whether this forward is eager activation checkpointing's recomputation (it runs inside
    backward). Compiled graphs recompute inside the backward graph, which never replays mutations."""
    if torch.compiler.is_compiling():
        return False
    current = getattr(torch._C, "_current_graph_task_id", None)
    return current is not None and current() != -1


class LocalStats:
    """Load-balancing statistics on one process: the batch is all the data there is."""

    num_ranks = 1

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        return t


class FeedForward(nn.Module):
    """Dense SwiGLU, used for shared experts."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def reset_parameters(self, std: float = 0.02):
        for lin in (self.w1, self.w2, self.w3):
            nn.init.trunc_normal_(lin.weight, std=std)


class MoE(nn.Module):
    def __init__(self, config: MoEConfig):
        super().__init__()
        self.config = config
        self.router = TopKRouter(config)
        self.experts = GroupedExperts.from_config(config)
        self.shared_experts = (
            FeedForward(config.dim, config.hidden_dim * config.num_shared_experts)
            if config.num_shared_experts > 0
            else None
        )
        # This rank's tokens per expert since the last bias update (summed over ranks only at the
        # update, not per microbatch). Integer: a bf16 model would otherwise count in bf16.
        self.register_buffer("tokens_per_expert", torch.zeros(config.num_experts, dtype=torch.long), persistent=False)
        if config.load_balance == "aux_free_bias":
            self.register_buffer("expert_bias", torch.zeros(config.num_experts))
        else:
            self.expert_bias = None
        self.stats = LocalStats()
        self.aux_loss: torch.Tensor | None = None
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02):
        self.router.reset_parameters(std)
        self.experts.reset_parameters(std)
        if self.shared_experts is not None:
            self.shared_experts.reset_parameters(std)

    def forward(self, x_BLD: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        if x_BLD.dim() < 1 or x_BLD.shape[-1] != cfg.dim or not x_BLD.is_floating_point():
            raise ValueError(f"MoE expects [..., dim={cfg.dim}] floating-point input, got shape {tuple(x_BLD.shape)} "
                             f"of {x_BLD.dtype}")
        x_TD = x_BLD.reshape(-1, x_BLD.shape[-1])
        r = self.router(x_TD, self.expert_bias)
        # Stable sort keeps each expert's tokens in token order: deterministic grouping. Counting
        # on the sorted ids needs no host sync (CUDA bincount reads the max back to size its output).
        sorted_N, order_N = torch.sort(r.experts_TK.flatten(), stable=True)
        bounds = torch.arange(cfg.num_experts + 1, device=sorted_N.device, dtype=sorted_N.dtype)
        counts_E = torch.searchsorted(sorted_N, bounds).diff()
        if not recomputing():  # activation checkpointing's second forward must not count again
            with torch.no_grad():
                self.tokens_per_expert += counts_E
        if cfg.load_balance == "aux_loss":
            self.aux_loss = self._aux_loss(r.scores_TE, self.stats.sum(counts_E.float()))

        y_BLD = self.experts(x_BLD, counts_E, TokenCopies.build(order_N, sorted_N, r.weights_TK))
        if self.shared_experts is not None:
            return y_BLD + self.shared_experts(x_BLD)
        return y_BLD

    def _aux_loss(self, scores_TE: torch.Tensor, global_counts_E: torch.Tensor) -> torch.Tensor:
        """DeepSeek's batch-level balance loss sum_e f_e * P_e over the *global* batch.

        Each rank returns the global value; its gradient is this rank's share scaled so that the
        mean over ranks (the data-parallel loss convention) has exactly the global gradient.
        """
        cfg = self.config
        num_tokens = global_counts_E.sum() / cfg.top_k
        if cfg.score_func == "sigmoid":  # DeepSeek-V3 measures normalized sigmoid scores
            scores_TE = scores_TE / (scores_TE.sum(dim=-1, keepdim=True) + 1e-20)
        f_E = global_counts_E * cfg.num_experts / (cfg.top_k * num_tokens.clamp(min=1))
        local_sum_E = scores_TE.sum(dim=0)
        scale = cfg.aux_loss_coeff / num_tokens.clamp(min=1)
        local = (f_E * local_sum_E).sum() * scale * self.stats.num_ranks
        global_value = (f_E * self.stats.sum(local_sum_E.detach())).sum() * scale
        return local + (global_value - local).detach()

    @torch.no_grad()
    def global_tokens_per_expert(self) -> torch.Tensor:
        """Tokens routed to each expert since the last update, over the global batch (a collective)."""
        return self.stats.sum(self.tokens_per_expert)

    @torch.no_grad()
    def update_expert_bias(self):
        """Aux-loss-free balancing: nudge under-loaded experts up, over-loaded down, then reset counts."""
        if self.expert_bias is not None:
            tpe = self.global_tokens_per_expert().float()
            self.expert_bias += self.config.bias_update_rate * torch.sign(tpe.mean() - tpe)
        self.tokens_per_expert.zero_()
