"""Model configuration for one MoE feed-forward layer. Pure data; no parallelism here."""

from dataclasses import dataclass

from dtensor_moe.validate import Range, above, at_least, check_fields

SCORE_FUNCS = ("softmax", "sigmoid", "topk_softmax")
LOAD_BALANCE = ("none", "aux_loss", "aux_free_bias")
DROP_POLICIES = ("probs", "position")
ACTIVATIONS = ("swiglu", "clamped_swiglu")
EXPERT_PRECISIONS = ("bf16", "fp8")
DISPATCH_PRECISIONS = ("bf16", "fp8")

# Shared with train.config.ModelConfig, whose expert hidden dim is called moe_hidden_dim.
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
    capacity_factor="> 0, or None (no capacity limit)",
    drop_policy=DROP_POLICIES,
    activation=ACTIVATIONS,
    swiglu_alpha=above(0),
    swiglu_limit=above(0),
    # The routed experts' GEMMs: "fp8" runs them in FP8 e4m3 where it is faster (kernels/fp8.py, policy.py).
    expert_precision=EXPERT_PRECISIONS,
    # The EP all-to-all's forward token payload: "fp8" sends e4m3 rows + one fp32 scale each
    # (parallel/dispatch.py); gradients travel in the activations' dtype either way.
    dispatch_precision=DISPATCH_PRECISIONS,
    # Hot-expert replicas (parallel/replicas.py): replica slots per EP rank, re-placed every that many forwards.
    expert_replicas=Range(0, "num_experts"),
    replica_replan_every=at_least(1),
    # A dropless forward in which an EP rank would compute more expert rows raises, naming them; 0: no cap.
    max_rows_per_rank=at_least(0),
    # Tile-aware token rounding (token_rounding.py): each expert's pairs on a rank a multiple of this; 0: off.
    round_tokens_to=at_least(0),
)


def check_routing(cfg, prefix: str):
    """The constraints between routing fields beyond MOE_RULES, for MoEConfig and the main job's
    ModelConfig alike (after check_fields)."""
    check_groups(cfg, prefix)
    _check_capacity(cfg, prefix)
    if cfg.round_tokens_to and cfg.pad_to_capacity:
        # Padding gives every expert exactly its capacity in rows whatever the routing: nothing left to round.
        raise ValueError(f"{prefix}round_tokens_to ({cfg.round_tokens_to}) needs unpadded routing, got "
                         f"{prefix}pad_to_capacity=True (every expert's block is its capacity, whatever the counts); "
                         "valid: round_tokens_to 0, or pad_to_capacity false")
    if cfg.expert_replicas and cfg.pad_to_capacity:
        # Padded dispatch has static per-expert blocks; replicas split an expert's rows by the step's counts.
        raise ValueError(f"{prefix}expert_replicas ({cfg.expert_replicas}) needs the dropless dispatch, got "
                         f"{prefix}pad_to_capacity=True; valid: expert_replicas 0, or pad_to_capacity false")


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


def _check_capacity(cfg, prefix: str):
    cf = cfg.capacity_factor
    if cf is not None and (isinstance(cf, bool) or not isinstance(cf, (int, float)) or not 0 < cf < float("inf")):
        raise ValueError(
            f"{prefix}capacity_factor must be a finite number > 0, or None (no capacity limit), got {cf!r}"
        )
    if cfg.pad_to_capacity and cf is None:
        # Padding fills every expert's block to its capacity, which only a capacity factor defines.
        raise ValueError(f"{prefix}pad_to_capacity=True needs {prefix}capacity_factor (a finite number > 0; "
                         "every expert gets exactly ceil(tokens * top_k / num_experts * capacity_factor) rows), "
                         f"got {prefix}capacity_factor=None; valid: pad_to_capacity false, or a capacity_factor")


@dataclass(frozen=True)
class MoEConfig:
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
    # DeepSeek-V3's group-limited routing: experts in num_expert_groups equal groups, top-k only
    # over the experts of the num_limited_groups best groups.
    num_expert_groups: int = 1
    num_limited_groups: int = 1
    router_bias: bool = False  # the gate Linear has a bias (gpt-oss)
    seq_aux_loss_coeff: float = 0.0  # DeepSeek-V3's sequence-wise balance loss
    z_loss_coeff: float = 0.0  # router z-loss: mean over tokens of logsumexp(logits)^2
    # Megatron's token dropping: each expert keeps at most ceil(tokens * top_k / num_experts *
    # capacity_factor) of one rank's (token, expert) pairs.
    capacity_factor: float | None = None
    drop_policy: str = "probs"
    # Megatron's --moe-pad-expert-input-to-capacity: every expert gets exactly its capacity in rows
    # (padded with zero rows), so GEMM sizes and all-to-all splits are static (docs/routing.md).
    pad_to_capacity: bool = False
    # Experts as gpt-oss defines them: per-expert biases on the gate / up outputs [E, 2, F] and the w2
    # output [E, D]; "clamped_swiglu": g = min(a, limit), u = clamp(b, -limit, limit),
    # (u + 1) * g * sigmoid(alpha * g) (swiglu_alpha, swiglu_limit are read only then).
    expert_biases: bool = False
    activation: str = "swiglu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # FP8 experts (kernels/fp8.py): "bf16" | "fp8"
    expert_precision: str = "bf16"
    # The dispatched tokens' payload under EP / ETP: "bf16" (the activations' dtype) | "fp8"
    dispatch_precision: str = "bf16"
    # Hot-expert replicas under EP (parallel/replicas.py): this many replica slots per EP rank hold copies of the
    # hottest experts, so each EP rank computes about the mean rows (0: off). The copies are placed from the counts
    # of the last replica_replan_every training forwards; the math is that of no replicas.
    expert_replicas: int = 0
    replica_replan_every: int = 100
    # > 0: an eager dropless forward in which an EP rank would compute more expert rows than this raises ValueError
    # on every rank, naming the layer, the forward and the rows per rank (never an out-of-memory at an unknown step).
    max_rows_per_rank: int = 0
    # > 0: tile-aware token rounding (token_rounding.py, docs/routing.md "Token rounding"): after the router and any
    # capacity dropping, each expert's (token, expert) pairs of one forward on one rank are rounded to a multiple of
    # this (the grouped GEMMs' row tile, 128 on Hopper; any positive int) by dropping its lowest-weight pairs or
    # adding the next-best experts of tokens that lost one. 0: off.
    round_tokens_to: int = 0

    def __post_init__(self):
        check_fields(self, "MoEConfig.", hidden_dim=at_least(1), **MOE_RULES)
        check_routing(self, "MoEConfig.")
