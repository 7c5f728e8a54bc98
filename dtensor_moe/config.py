"""One MoE feed-forward layer's configuration, as plain data in two parts: `MoEConfig`, what the layer computes
from its weights (architecture and routing: a checkpoint holds it, a resume must match it), and `MoERunOptions`, how
this run computes it (token dropping and rounding, precisions, what the backward keeps, replicas, the row cap: a
resume may change any of them). No parallelism here."""

from dataclasses import dataclass

from dtensor_moe.validate import Range, above, at_least, check_fields

__all__ = [
    "MoEConfig", "MoERunOptions", "SCORE_FUNCS", "LOAD_BALANCE", "DROP_POLICIES", "ACTIVATIONS", "EXPERT_PRECISIONS",
    "DISPATCH_PRECISIONS", "check_run_options", "check_replica_slots", "check_replica_mesh", "check_row_cap",
    "effective_activation_memory",
]

SCORE_FUNCS = ("softmax", "sigmoid", "topk_softmax")
LOAD_BALANCE = ("none", "aux_loss", "aux_free_bias")
DROP_POLICIES = ("probs", "position")
ACTIVATIONS = ("swiglu", "clamped_swiglu")
EXPERT_PRECISIONS = ("bf16", "fp8")
ACTIVATION_MEMORY = ("standard", "minimal")
DISPATCH_PRECISIONS = ("bf16", "fp8")

# Shared with train.config.ModelConfig, which holds every MoEConfig field under the same name.
MOE_RULES = dict(
    dim=at_least(1),
    num_experts=at_least(1),
    top_k=Range(1, "num_experts"),
    score_func=SCORE_FUNCS,
    route_scale=above(0),
    num_shared_experts=at_least(0),
    load_balance=LOAD_BALANCE,
    aux_loss_coeff=at_least(0),
    bias_update_rate=at_least(0),
    num_expert_groups=Range(1, "num_experts"),
    num_limited_groups=Range(1, "num_expert_groups"),
    seq_aux_loss_coeff=at_least(0),
    z_loss_coeff=at_least(0),
    activation=ACTIVATIONS,
    swiglu_alpha=above(0),
    swiglu_limit=above(0),
)

RUN_RULES = dict(
    capacity_factor="> 0, or None (no capacity limit)",
    drop_policy=DROP_POLICIES,
    # The routed experts' GEMMs: "fp8" runs them in FP8 e4m3 where it is faster (kernels/fp8.py, policy.py).
    expert_precision=EXPERT_PRECISIONS,
    # What the routed experts keep for their backward (kernels/expert_autograd.py).
    activation_memory=ACTIVATION_MEMORY,
    # The EP all-to-all's forward token payload: "fp8" sends e4m3 rows + one fp32 scale each
    # (parallel/dispatch.py); gradients travel in the activations' dtype either way.
    dispatch_precision=DISPATCH_PRECISIONS,
    # Hot-expert replicas (parallel/replicas.py): replica slots per EP rank, re-placed every that many forwards.
    # At most num_experts: `check_run_options` bounds it against the layer's MoEConfig.
    expert_replicas=at_least(0),
    replica_replan_every=at_least(1),
    # A dropless forward in which an EP rank would compute more expert rows raises, naming them; 0: no cap.
    max_rows_per_rank=at_least(0),
    # Tile-aware token rounding (routing/token_rounding.py): each expert's pairs on a rank a multiple of this; 0: off.
    round_tokens_to=at_least(0),
)


def check_groups(cfg, prefix: str):
    """Group-limited routing's constraints."""
    E, G = cfg.num_experts, cfg.num_expert_groups
    if E % G:
        valid = [g for g in range(1, E + 1) if E % g == 0]
        raise ValueError(f"{prefix}num_experts ({E}) must be divisible by {prefix}num_expert_groups ({G}); "
                         f"valid num_expert_groups: {valid}")
    reachable = cfg.num_limited_groups * (E // G)
    if cfg.top_k > reachable:
        raise ValueError(f"{prefix}top_k ({cfg.top_k}) must be <= num_limited_groups * num_experts / num_expert_groups "
                         f"({cfg.num_limited_groups} * {E} / {G} = {reachable}), the experts the kept groups hold; "
                         f"valid top_k: 1..{reachable}")


@dataclass(frozen=True)
class MoEConfig:
    """Configuration of one MoE feed-forward layer (`MoE`): router, experts, load balancing, token dropping.

    Frozen plain data, checked at construction: a bad field or combination of fields raises ValueError
    naming the field and its valid values. It is what a checkpoint holds: how a run computes the layer (token
    dropping, precisions, replicas) is `MoERunOptions`, and how the layer is parallelized `MoEParallelDims`;
    docs/routing.md describes the routing fields at length.

    Attributes:
        dim (int): the model dim D, the layer's input and output width; >= 1.
        hidden_dim (int): the hidden dim F of each routed expert (and of each shared expert); >= 1.
        num_experts (int): routed experts E; >= 1.
        top_k (int): experts each token is routed to, 1..num_experts (under group-limited routing at most
            the experts of the kept groups).
        score_func (str): "softmax" (Qwen3-MoE, Mixtral), "sigmoid" (DeepSeek-V3) or "topk_softmax"
            (gpt-oss: top-k over the logits, softmax over the chosen ones). Default "softmax".
        route_norm (bool): renormalize each token's chosen scores to sum to 1 (moot for "topk_softmax").
            Default True.
        route_scale (float): factor on every combine weight (DeepSeek-V3's routed_scaling_factor); > 0.
            Default 1.0.
        num_shared_experts (int): S dense SwiGLU experts every token also goes through, run as one
            feed-forward of hidden dim hidden_dim * S; >= 0. Default 0.
        load_balance (str): "none", "aux_loss" (the global-batch loss sum_e f_e * P_e, `MoE.aux_loss`) or
            "aux_free_bias" (DeepSeek-V3's bias on the selection scores, moved by
            `MoE.update_expert_bias`). Default "none".
        aux_loss_coeff (float): the aux loss's weight (load_balance "aux_loss"); >= 0. Default 1e-3.
        bias_update_rate (float): the aux-free bias's step per update (load_balance "aux_free_bias");
            >= 0. Default 1e-3.
        num_expert_groups (int): DeepSeek-V3's group-limited routing: the experts in this many equal
            groups; divides num_experts. Default 1 (no groups).
        num_limited_groups (int): top-k runs only over the experts of this many best groups,
            1..num_expert_groups. Default 1.
        router_bias (bool): the gate Linear has a bias (gpt-oss). Default False.
        seq_aux_loss_coeff (float): weight of DeepSeek-V3's sequence-wise balance loss (`MoE.seq_aux_loss`);
            >= 0, 0 is off. Default 0.0.
        z_loss_coeff (float): weight of the router z-loss, the mean over tokens of logsumexp(logits)^2
            (`MoE.z_loss`); >= 0, 0 is off. Default 0.0.
        expert_biases (bool): gpt-oss's per-expert biases, b13 [E, 2, F] on the gate / up outputs and
            b2 [E, D] on the down projection's. Default False.
        activation (str): "swiglu" or gpt-oss's "clamped_swiglu": g = min(a, limit),
            u = clamp(b, -limit, limit), (u + 1) * g * sigmoid(alpha * g). Default "swiglu".
        swiglu_alpha (float): clamped_swiglu's alpha (read only with that activation); > 0. Default 1.702.
        swiglu_limit (float): clamped_swiglu's limit (read only with that activation); > 0. Default 7.0.
    Example:
        >>> from dtensor_moe import MoEConfig
        >>> cfg = MoEConfig(dim=64, hidden_dim=128, num_experts=8, top_k=2, load_balance="aux_loss")
        >>> cfg.score_func, cfg.route_norm
        ('softmax', True)
    """

    dim: int
    hidden_dim: int
    num_experts: int
    top_k: int
    score_func: str = "softmax"
    route_norm: bool = True
    route_scale: float = 1.0
    num_shared_experts: int = 0
    load_balance: str = "none"
    aux_loss_coeff: float = 1e-3
    bias_update_rate: float = 1e-3
    num_expert_groups: int = 1
    num_limited_groups: int = 1
    router_bias: bool = False
    seq_aux_loss_coeff: float = 0.0
    z_loss_coeff: float = 0.0
    expert_biases: bool = False
    activation: str = "swiglu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    def __post_init__(self):
        check_fields(self, "MoEConfig.", hidden_dim=at_least(1), **MOE_RULES)
        check_groups(self, "MoEConfig.")


@dataclass(frozen=True)
class MoERunOptions:
    """How a run computes an MoE layer (`MoE`): token dropping and rounding, the precisions, what the backward
    keeps, hot-expert replicas, the row cap. None of them is a weight or changes what one means, so a checkpoint
    does not hold them and a resume may change any of them (`MoEConfig` is what it holds).

    Frozen plain data, checked at construction (a bad field or combination raises ValueError naming it);
    `check_run_options` checks them against a layer's `MoEConfig` (`MoE` calls it).

    Attributes:
        capacity_factor (float | None): Megatron's token dropping: each expert keeps at most
            ceil(tokens * top_k / num_experts * capacity_factor) of one rank's (token, expert) pairs;
            a finite number > 0, or None (dropless). Default None.
        drop_policy (str): which pairs an expert over capacity keeps: "probs" (the highest-weight ones)
            or "position" (the first in token order). Default "probs".
        pad_to_capacity (bool): Megatron's --moe-pad-expert-input-to-capacity: every expert gets exactly
            its capacity in rows (zero rows pad it), so GEMM sizes and all-to-all splits are static;
            needs capacity_factor. Default False.
        expert_precision (str): the routed experts' GEMMs: "bf16", or "fp8" (e4m3 where the measured
            policy picks it, kernels/fp8.py; docs/fp8.md). Default "bf16".
        activation_memory (str): what the routed experts keep for the backward: "standard" (the pair-order copy
            of the tokens, the gate / up output, the SwiGLU output and the expert outputs) or "minimal" (the
            token rows once, under EP the received rows, and the gate / up pre-activation; the rest recomputed
            or, for the routing weights' gradient, derived from the down projection's input gradient).
            Dropless routing only: pad_to_capacity and expert_replicas run "standard". Default "minimal" (on one
            H200 within 3% of "standard"'s layer time at four EP-rank shapes; benchmarks/RESULTS.md).
        dispatch_precision (str): the dispatched tokens' payload under EP / ETP: "bf16" (the activations'
            dtype), or "fp8" (e4m3 rows with one fp32 scale each; gradients travel unquantized).
            Default "bf16".
        expert_replicas (int): hot-expert replicas under EP (parallel/replicas.py): this many replica
            slots per EP rank hold copies of the hottest experts, so each EP rank computes about the mean
            rows; the math is that of no replicas. 0..num_experts, 0 is off; needs ep > 1 and no
            pad_to_capacity. Default 0.
        replica_replan_every (int): the replicas are placed from the counts of the last this many
            training forwards; >= 1. Default 100.
        max_rows_per_rank (int): > 0: an eager dropless forward in which an EP rank would compute more
            expert rows than this raises `RowCapExceeded` (a ValueError) on every rank, naming the layer,
            the forward and the rows per rank, rather than running out of memory at an unknown step;
            0 is no cap. Default 0.
        round_tokens_to (int): > 0: tile-aware token rounding (routing/token_rounding.py; docs/routing.md,
            "Token rounding"): after the router and any capacity dropping, each expert's pairs of one
            forward on one rank are rounded to a multiple of this (the grouped GEMMs' row tile, 128 on
            Hopper) by dropping its lowest-weight pairs or adding the next-best experts of tokens that
            lost one; needs pad_to_capacity off. 0 is off. Default 0.

    Example:
        >>> from dtensor_moe import MoE, MoEConfig, MoERunOptions
        >>> moe = MoE(MoEConfig(dim=16, hidden_dim=32, num_experts=4, top_k=2),
        ...           MoERunOptions(capacity_factor=1.25, expert_precision="fp8"))
        >>> moe.options.drop_policy
        'probs'
    """

    capacity_factor: float | None = None
    drop_policy: str = "probs"
    pad_to_capacity: bool = False
    expert_precision: str = "bf16"
    activation_memory: str = "minimal"
    dispatch_precision: str = "bf16"
    expert_replicas: int = 0
    replica_replan_every: int = 100
    max_rows_per_rank: int = 0
    round_tokens_to: int = 0

    def __post_init__(self):
        check_fields(self, "MoERunOptions.", **RUN_RULES)
        check_run_combinations(self, "MoERunOptions.")


def check_run_combinations(options, prefix: str):
    """The constraints between run options beyond RUN_RULES (after check_fields)."""
    _check_capacity(options, prefix)
    if options.round_tokens_to and options.pad_to_capacity:
        # Padding gives every expert exactly its capacity in rows whatever the routing: nothing left to round.
        raise ValueError(f"{prefix}round_tokens_to ({options.round_tokens_to}) needs unpadded routing, got "
                         f"{prefix}pad_to_capacity=True (every expert's block is its capacity, whatever the counts); "
                         "valid: round_tokens_to 0, or pad_to_capacity false")
    if options.expert_replicas and options.pad_to_capacity:
        # Padded dispatch has static per-expert blocks; replicas split an expert's rows by the step's counts.
        raise ValueError(f"{prefix}expert_replicas ({options.expert_replicas}) needs the dropless dispatch, got "
                         f"{prefix}pad_to_capacity=True; valid: expert_replicas 0, or pad_to_capacity false")


def _check_capacity(options, prefix: str):
    cf = options.capacity_factor
    if cf is not None and (isinstance(cf, bool) or not isinstance(cf, (int, float)) or not 0 < cf < float("inf")):
        raise ValueError(
            f"{prefix}capacity_factor must be a finite number > 0, or None (no capacity limit), got {cf!r}"
        )
    if options.pad_to_capacity and cf is None:
        # Padding fills every expert's block to its capacity, which only a capacity factor defines.
        raise ValueError(f"{prefix}pad_to_capacity=True needs {prefix}capacity_factor (a finite number > 0; "
                         "every expert gets exactly ceil(tokens * top_k / num_experts * capacity_factor) rows), "
                         f"got {prefix}capacity_factor=None; valid: pad_to_capacity false, or a capacity_factor")


def check_run_options(config: MoEConfig, options: MoERunOptions, prefix: str = "MoERunOptions."):
    """The run options a layer of `config` can take: replica slots hold copies of its experts, at most all of them.

    Args:
        config (MoEConfig): the layer's architecture.
        options (MoERunOptions): the run's options for it.
        prefix (str): how messages name the options' fields, e.g. "moe_run." for the main job's section.

    Raises:
        ValueError: naming the field, the bound and the valid values.
    """
    check_replica_slots(options.expert_replicas, config.num_experts, f"{prefix}expert_replicas")


def check_replica_slots(replicas: int, num_experts: int, name: str = "expert_replicas", experts: str = "num_experts",
                        valid: str = "") -> None:
    """Replica slots per EP rank within 0..num_experts (MoERunOptions.expert_replicas' range), named as the caller's
    user wrote them: `check_run_options`, the torchtitan hook's flag and `dtensor-moe plan --replicas`."""
    if not 0 <= replicas <= num_experts:
        raise ValueError(f"{name} ({replicas}) must be in 0..{experts} ({num_experts}): each slot holds a copy of "
                         f"one expert, and more slots than experts have nothing to hold; valid: {name} "
                         f"0..{num_experts}{valid}")


def check_replica_mesh(replicas: int, num_experts: int, dims, name: str = "expert_replicas", ep: str = "ep") -> None:
    """Replica slots need an EP mesh: a slot holds a copy of another EP rank's expert. `dims`: MoEParallelDims;
    `name`, `ep`: the option and the EP degree as the caller's user wrote them (the main job's
    `moe_run.expert_replicas` and `parallel.ep`, the hook's flags)."""
    if replicas and dims.ep == 1:
        n = dims.dp_shard * dims.cp * dims.tp
        valid = [d for d in range(2, n + 1) if n % d == 0 and num_experts % d == 0]
        other = (f"{ep} in {valid}" if valid
                 else f"more ranks ({n} rank(s) fold no {ep} > 1 that divides {num_experts} experts)")
        raise ValueError(f"{name} ({replicas}) needs {ep} > 1 (a replica holds another EP rank's expert), got "
                         f"{ep} 1; valid: {name} 0, or {other}")


def check_row_cap(max_rows: int, ep: int, etp: int, names=("max_rows_per_rank", "ep", "etp")):
    """A row cap acts in the expert-parallel dispatch only: on a mesh without expert axes (ep * etp = 1) no
    forward reads it, so it would be accepted and never enforced. `names`: the cap's, ep's and etp's as the user
    wrote them (the main job's fields; the torchtitan hook's flags)."""
    cap, ep_name, etp_name = names
    if max_rows and ep * etp == 1:
        raise ValueError(f"{cap} ({max_rows}) needs {ep_name} > 1 (or {etp_name} > 1): the cap is read in the "
                         f"expert-parallel dispatch, which a mesh without expert axes does not run, so it would never "
                         f"act; valid: {cap} 0 (no cap), or {ep_name} 2 or more")


def effective_activation_memory(options: MoERunOptions) -> str:
    """What a layer's routed experts keep for the backward, as the layer runs and `dtensor-moe plan` prices it:
    `options.activation_memory`, except that "minimal" (each token row once with its pairs) needs the dropless
    path's pairs: `pad_to_capacity` runs fixed slots and `expert_replicas` copies the pairs out, so both keep
    "standard".

    Args:
        options (MoERunOptions): the layer's run options.

    Returns:
        str: "minimal" or "standard".

    Example:
        >>> effective_activation_memory(MoERunOptions(expert_replicas=1))
        'standard'
    """
    if options.activation_memory == "minimal" and not options.pad_to_capacity and not options.expert_replicas:
        return "minimal"
    return "standard"

