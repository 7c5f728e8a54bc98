"""Model configuration for one MoE feed-forward layer. Pure data; no parallelism here."""

from dataclasses import dataclass

from dtensor_moe.validate import Range, above, at_least, check_fields

SCORE_FUNCS = ("softmax", "sigmoid")
LOAD_BALANCE = ("none", "aux_loss", "aux_free_bias")

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
)


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

    def __post_init__(self):
        check_fields(self, "MoEConfig.", hidden_dim=at_least(1), **MOE_RULES)
