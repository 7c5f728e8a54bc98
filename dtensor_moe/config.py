"""Model configuration for one MoE feed-forward layer. Pure data; no parallelism here."""

from dataclasses import dataclass

SCORE_FUNCS = ("softmax", "sigmoid")
LOAD_BALANCE = ("none", "aux_loss", "aux_free_bias")


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
        for name in ("dim", "hidden_dim", "num_experts", "top_k"):
            if getattr(self, name) < 1:
                raise ValueError(f"MoEConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.top_k > self.num_experts:
            raise ValueError(
                f"MoEConfig.top_k ({self.top_k}) must be <= num_experts ({self.num_experts}); "
                f"valid top_k: 1..{self.num_experts}"
            )
        if self.score_func not in SCORE_FUNCS:
            raise ValueError(f"MoEConfig.score_func must be one of {SCORE_FUNCS}, got {self.score_func!r}")
        if self.load_balance not in LOAD_BALANCE:
            raise ValueError(f"MoEConfig.load_balance must be one of {LOAD_BALANCE}, got {self.load_balance!r}")
        if self.num_shared_experts < 0:
            raise ValueError(f"MoEConfig.num_shared_experts must be >= 0, got {self.num_shared_experts}")
