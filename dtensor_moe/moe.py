"""The MoE feed-forward layer: route, group tokens by expert, run experts, combine.

It knows nothing about parallelism. `parallelize_moe` swaps `stats` for a reducer over the
data-parallel ranks and wraps `experts` with the expert-parallel dispatcher.
"""

import math
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from dtensor_moe.config import MoEConfig, MoERunOptions, check_run_options
from dtensor_moe.experts import GroupedExperts
from dtensor_moe.kernels.recompute import recomputing
from dtensor_moe.routing.capacity import capacity, kept_pairs
from dtensor_moe.routing.router import TopKRouter, combine_weights_TE
from dtensor_moe.routing.tables import PaddedCopies, TokenCopies, expert_major
from dtensor_moe.routing.token_rounding import check_rounding_reachable, round_tokens_compiled

__all__ = ["MoE", "balance_loss", "named_moes"]


class LocalStats:
    """Load-balancing statistics on one process: the batch is all the data there is.

    `sum`: over every rank holding different tokens. `sequence_sum`: per-sequence statistics
    (leading dim = the rows of x_BLD) over the ranks holding pieces of the same sequences; the
    identity while every rank holds whole sequences."""

    num_ranks = 1

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def sequence_sum(self, t: torch.Tensor) -> torch.Tensor:
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
    """A Mixture-of-Experts feed-forward layer: each token goes to its top-k routed experts, their outputs
    are weighted by the routing weights and summed, and the shared experts' output (if any) is added.

    The layer holds no parallel code: `parallelize_moe` or `ExpertParallel` shard it in place (experts over
    EP / ETP / EDP, the rest over the data-parallel ranks) and swap `stats` for a reducer over the ranks,
    so the same module runs on one process and on any mesh. Submodules: `router` (`TopKRouter`),
    `experts` (`GroupedExperts`), `shared_experts` (a dense SwiGLU of hidden dim
    hidden_dim * num_shared_experts, or None).

    After each forward, `aux_loss`, `seq_aux_loss` and `z_loss` hold the enabled balance losses (global-batch
    values, None when disabled) and `losses()` lists them, to add to the training loss. With
    load_balance="aux_free_bias", call `update_expert_bias()` once per optimizer step (it sums the routed
    counts over the ranks). docs/routing.md describes the routing and the losses.

    Args:
        config (MoEConfig): the layer's architecture and routing. The weights are initialized at construction
            (`reset_parameters(std=0.02)`: normal or truncated-normal weights, zero biases).
        options (MoERunOptions | None): how this run computes it (token dropping and rounding, precisions, what
            the backward keeps, replicas, the row cap); None: `MoERunOptions()`, dropless in bf16.

    Shape:
        input x_BLD [..., dim], floating point, any leading dims (batch, sequence); the output has its
        shape and dtype.

    Example:
        >>> import torch
        >>> from dtensor_moe import MoE, MoEConfig
        >>> moe = MoE(MoEConfig(dim=16, hidden_dim=32, num_experts=4, top_k=2, load_balance="aux_loss"))
        >>> y_BLD = moe(torch.randn(2, 8, 16))
        >>> y_BLD.shape
        torch.Size([2, 8, 16])
        >>> (y_BLD.square().mean() + sum(moe.losses())).backward()
    """

    def __init__(self, config: MoEConfig, options: MoERunOptions | None = None):
        super().__init__()
        options = MoERunOptions() if options is None else options
        check_run_options(config, options)
        self.config, self.options = config, options
        self.router = TopKRouter(config)
        self.experts = GroupedExperts.from_config(config, options)
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
        # The last forward's balance losses, each the global-batch value (None when disabled).
        self.aux_loss: torch.Tensor | None = None
        self.seq_aux_loss: torch.Tensor | None = None
        self.z_loss: torch.Tensor | None = None
        # dtensor_moe.replay.LayerReplay while this layer records or replays its routing.
        self.routing_replay = None
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02):
        self.router.reset_parameters(std)
        self.experts.reset_parameters(std)
        if self.shared_experts is not None:
            self.shared_experts.reset_parameters(std)

    def forward(self, x_BLD: torch.Tensor) -> torch.Tensor:
        cfg, run = self.config, self.options
        if x_BLD.dim() < 1 or x_BLD.shape[-1] != cfg.dim or not x_BLD.is_floating_point():
            raise ValueError(f"MoE expects [..., dim={cfg.dim}] floating-point input, got shape {tuple(x_BLD.shape)} "
                             f"of {x_BLD.dtype}")
        x_TD = x_BLD.reshape(-1, x_BLD.shape[-1])
        replay = self.routing_replay  # record_routing / replay_routing (replay.py)
        replayed_TK = None if replay is None else replay.replayed(len(x_TD), recomputing())
        # Only a replayed forward passes its choices: a router swapped in by a user keeps the (x, bias) signature.
        r = self.router(x_TD, self.expert_bias) if replayed_TK is None else self.router(x_TD, self.expert_bias,
                                                                                        replayed_TK)
        if replay is not None:
            replay.chosen = r.experts_TK
        sorted_N, order_N, counts_E = expert_major(r.experts_TK.flatten(), cfg.num_experts)
        # Only training forwards steer the aux-free bias: an eval batch (module.eval()) must not move the next update,
        # and activation checkpointing's second forward must not count again.
        if self.training and not recomputing():
            with torch.no_grad():
                self.tokens_per_expert += counts_E
        if cfg.load_balance == "aux_loss":
            self.aux_loss = self._aux_loss(r.scores_TE, self.stats.sum(counts_E.float()))
        if cfg.seq_aux_loss_coeff:
            self.seq_aux_loss = self._seq_aux_loss(r.scores_TE, r.experts_TK, x_BLD.shape)
        if cfg.z_loss_coeff:
            self.z_loss = self._z_loss(r.logits_TE)

        weights_TK, experts_TK = r.weights_TK, r.experts_TK
        if run.capacity_factor is not None:
            # Statistics and balance losses above see what the router asked for, before dropping.
            keep_TK = kept_pairs(weights_TK, r.experts_TK, counts_E, run.capacity_factor, run.drop_policy)
            weights_TK = weights_TK * keep_TK
            # Dropped pairs get expert id E: they sort last and counts_E no longer counts them.
            experts_TK = torch.where(keep_TK, r.experts_TK, cfg.num_experts)
        if run.round_tokens_to:  # after capacity, and after the statistics too (docs/routing.md, "Token rounding")
            C = None if run.capacity_factor is None else capacity(len(x_TD), cfg.top_k, cfg.num_experts,
                                                                   run.capacity_factor)
            if len(x_TD) and not torch.compiler.is_compiling():  # an empty forward rounds nothing away
                _warn_unreachable_rounding(cfg, run, len(x_TD))
            experts_TK, weights_TK = round_tokens_compiled(
                r.experts_TK, experts_TK, weights_TK, combine_weights_TE(cfg, r.scores_TE, r.logits_TE, r.experts_TK),
                run.round_tokens_to, C, cfg.num_expert_groups)
        if experts_TK is not r.experts_TK:
            sorted_N, order_N, counts_E = expert_major(experts_TK.flatten(), cfg.num_experts)
        if run.pad_to_capacity:  # every expert a block of exactly C rows: static shapes downstream
            C = capacity(x_TD.shape[0], cfg.top_k, cfg.num_experts, run.capacity_factor)
            copies = PaddedCopies.build(order_N, sorted_N, counts_E, weights_TK, C)
            counts_E = torch.full_like(counts_E, C)
        else:
            copies = TokenCopies.build(order_N, sorted_N, weights_TK)
        # The dispatcher sits around this call. Unplaced, the experts run every routed copy here (GroupedExperts.forward
        # takes x, counts and copies). Placed (parallel/shard.py's place_layer), the experts module carries the
        # dispatch strategy's hooks (parallel/dispatch.py's dispatch_hooks): the pre-hook moves the copies to the
        # ranks of their experts and hands the module an ExpertInput of this rank's rows; the post-hook combines
        # their outputs back into x's tokens. This module never knows which.
        y_BLD = self.experts(x_BLD, counts_E, copies)
        if self.shared_experts is not None:
            return y_BLD + self.shared_experts(x_BLD)
        return y_BLD

    def losses(self) -> list[torch.Tensor]:
        """The enabled balance losses of the last forward (aux, sequence-wise, z), to add to the loss."""
        return [t for t in (self.aux_loss, self.seq_aux_loss, self.z_loss) if t is not None]

    def _global(self, local: torch.Tensor, scale) -> torch.Tensor:
        """scale * (sum of `local` over the ranks) on every rank, with this rank's share of the
        gradient scaled so that the mean over ranks (the data-parallel loss convention) has exactly
        the global gradient."""
        mine = local * scale * self.stats.num_ranks
        return mine + (self.stats.sum(local.detach()) * scale - mine).detach()

    def _balance_scores(self, scores_TE: torch.Tensor) -> torch.Tensor:
        if self.config.score_func == "sigmoid":  # DeepSeek-V3 measures normalized sigmoid scores
            return scores_TE / (scores_TE.sum(dim=-1, keepdim=True) + 1e-20)
        return scores_TE

    def _aux_loss(self, scores_TE: torch.Tensor, global_counts_E: torch.Tensor) -> torch.Tensor:
        """DeepSeek's batch-level balance loss sum_e f_e * P_e over the *global* batch."""
        cfg = self.config
        num_tokens = (global_counts_E.sum() / cfg.top_k).clamp(min=1)
        f_E = global_counts_E * cfg.num_experts / (cfg.top_k * num_tokens)
        return self._global((f_E * self._balance_scores(scores_TE).sum(dim=0)).sum(), cfg.aux_loss_coeff / num_tokens)

    def _seq_aux_loss(self, scores_TE: torch.Tensor, experts_TK: torch.Tensor, shape) -> torch.Tensor:
        """DeepSeek-V3's sequence-wise balance loss, mean over the global batch's sequences of
        sum_e f_be * P_be, f_be = E / (K * L_b) * (tokens of b routed to e), P_be = mean over b's
        tokens of the (normalized) scores; sequences are the rows of x_BLD."""
        cfg = self.config
        E, K = cfg.num_experts, cfg.top_k
        B, L = math.prod(shape[:-2]), (shape[-2] if len(shape) > 1 else 1)
        p_BLE = self._balance_scores(scores_TE).view(B, L, E)
        # Per sequence: tokens per expert, and its length, both over every piece of the sequence.
        counts_BE = p_BLE.new_zeros(B, E).scatter_add_(1, experts_TK.reshape(B, L * K), p_BLE.new_ones(B, L * K))
        whole = self.stats.sequence_sum(torch.cat([counts_BE, p_BLE.new_full((B, 1), L)], dim=1))
        counts_BE, length_B1 = whole[:, :E], whole[:, E:].clamp(min=1)
        f_BE = counts_BE * E / (K * length_B1)
        # Linear in this piece's score sums once f is known: the pieces' terms add up to the sequence's.
        local = (f_BE * p_BLE.sum(dim=1) / length_B1).sum()
        num_sequences = self.stats.sum((L / length_B1).sum()).clamp(min=1)  # each sequence once over its pieces
        return self._global(local, cfg.seq_aux_loss_coeff / num_sequences)

    def _z_loss(self, logits_TE: torch.Tensor) -> torch.Tensor:
        """Router z-loss (ST-MoE): mean over the global batch's tokens of logsumexp(logits)^2."""
        local = torch.logsumexp(logits_TE, dim=-1).square().sum()
        num_tokens = self.stats.sum(logits_TE.new_full((), logits_TE.shape[0])).clamp(min=1)
        return self._global(local, self.config.z_loss_coeff / num_tokens)

    @torch.no_grad()
    def global_tokens_per_expert(self) -> torch.Tensor:
        """Tokens routed to each expert since the last update, over the global batch (a collective)."""
        return self.stats.sum(self.tokens_per_expert)

    @torch.no_grad()
    def update_expert_bias(self, global_counts_E: torch.Tensor | None = None):
        """Aux-loss-free balancing: nudge under-loaded experts up, over-loaded down, then reset counts.
        `global_counts_E`: `global_tokens_per_expert()` from a caller that summed it already (the main job's load
        metrics), so the counts cross the ranks once."""
        if self.expert_bias is not None:
            tpe = (self.global_tokens_per_expert() if global_counts_E is None else global_counts_E).float()
            self.expert_bias += self.config.bias_update_rate * torch.sign(tpe.mean() - tpe)
        self.tokens_per_expert.zero_()


def _warn_unreachable_rounding(cfg: MoEConfig, run: MoERunOptions, tokens: int) -> None:
    """A forward too small for round_tokens_to rounds every pair away: warned, not raised, since under EP another
    rank with more tokens may be inside a collective already (the main job and the hook refuse it before launch)."""
    try:
        check_rounding_reachable(run.round_tokens_to, tokens, cfg.top_k, cfg.num_experts, run.capacity_factor,
                                 "this forward's", "MoERunOptions.round_tokens_to")
    except ValueError as e:
        warnings.warn(str(e))  # one location: Python's default filter shows it once


def balance_loss(module: nn.Module) -> torch.Tensor | float:
    """The balance losses (aux, sequence-wise, z: `MoE.losses()`) of every `MoE` in `module` from its last forward,
    summed: what a training step adds to its loss.

    Args:
        module (nn.Module): a model, a pipeline stage (its own layers) or one MoE.

    Returns:
        torch.Tensor | float: the sum, or 0.0 when no layer has a balance loss enabled.

    Example:
        >>> import torch
        >>> from dtensor_moe import MoE, MoEConfig, balance_loss
        >>> moe = MoE(MoEConfig(dim=8, hidden_dim=8, num_experts=4, top_k=2, load_balance="aux_loss"))
        >>> y_BLD = moe(torch.randn(2, 3, 8))
        >>> bool(balance_loss(moe) > 0)
        True
    """
    return sum(t for m in module.modules() if isinstance(m, MoE) for t in m.losses()) or 0.0


def named_moes(module: nn.Module, root: str = "") -> dict[str, MoE]:
    """Every `MoE` in `module` by qualified name.

    Args:
        module (nn.Module): a model, a pipeline stage (which keeps the whole model's names) or an MoE.
        root (str): the name of `module` itself when it is an MoE: "" (its qualified name, what routing replay
            records under) or e.g. its class name for messages. Default "".

    Returns:
        dict[str, MoE]: name -> layer, in `named_modules` order.
    """
    return {n or root: m for n, m in module.named_modules() if isinstance(m, MoE)}
