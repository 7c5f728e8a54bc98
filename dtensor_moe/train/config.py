"""Training configuration: TOML file sections plus `section.key=value` command-line overrides."""

import tomllib
from dataclasses import asdict, dataclass, field, fields

from dtensor_moe.config import MoEConfig


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    num_experts: int = 8
    top_k: int = 2
    moe_hidden_dim: int = 64
    num_shared_experts: int = 0
    score_func: str = "softmax"
    route_norm: bool = True
    route_scale: float = 1.0
    load_balance: str = "none"
    aux_loss_coeff: float = 1e-3
    bias_update_rate: float = 1e-3
    tie_embeddings: bool = False
    max_seq_len: int = 1024
    norm_eps: float = 1e-5

    def __post_init__(self):
        if self.dim % self.n_heads != 0:
            raise ValueError(f"model.dim ({self.dim}) must be divisible by model.n_heads ({self.n_heads})")

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown [model] keys {sorted(unknown)}; valid keys: {sorted(known)}")
        return cls(**d)

    def moe_config(self) -> MoEConfig:
        return MoEConfig(
            dim=self.dim,
            hidden_dim=self.moe_hidden_dim,
            num_experts=self.num_experts,
            top_k=self.top_k,
            score_func=self.score_func,
            route_norm=self.route_norm,
            route_scale=self.route_scale,
            num_shared_experts=self.num_shared_experts,
            load_balance=self.load_balance,
            aux_loss_coeff=self.aux_loss_coeff,
            bias_update_rate=self.bias_update_rate,
        )


@dataclass(frozen=True)
class ParallelConfig:
    nproc: int = 1
    device: str = "cpu"  # cpu (gloo) | cuda (nccl)
    dp_replicate: int = 1
    ep: int = 1
    etp: int = 1


@dataclass(frozen=True)
class TrainingConfig:
    steps: int = 50
    seq_len: int = 64
    global_batch: int = 16
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 5
    weight_decay: float = 0.0
    max_norm: float = 1.0
    dtype: str = "float32"  # float32 | bf16 (mixed precision: bf16 compute, fp32 params and reductions)
    seed: int = 0
    parity_tolerance: float = 1e-4


@dataclass(frozen=True)
class DataConfig:
    source: str = "corpus"  # corpus | synthetic


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    data: DataConfig = field(default_factory=DataConfig)

    def to_dict(self) -> dict:
        return asdict(self)


SECTIONS = {"model": ModelConfig, "parallel": ParallelConfig, "training": TrainingConfig, "data": DataConfig}


def _parse_value(text: str):
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text  # bare strings: data.source=synthetic


def load_config(path: str | None, overrides: list[str] = ()) -> Config:
    raw: dict = {}
    if path:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    unknown = set(raw) - set(SECTIONS)
    if unknown:
        raise ValueError(f"unknown config sections {sorted(unknown)}; valid: {sorted(SECTIONS)}")
    for item in overrides:
        key, sep, value = item.partition("=")
        section, dot, name = key.partition(".")
        if not sep or not dot or section not in SECTIONS:
            raise ValueError(f"override {item!r} must look like section.key=value with section in {sorted(SECTIONS)}")
        raw.setdefault(section, {})[name] = _parse_value(value)
    built = {}
    for section, cls in SECTIONS.items():
        values = raw.get(section, {})
        known = {f.name for f in fields(cls)}
        bad = set(values) - known
        if bad:
            raise ValueError(f"unknown [{section}] keys {sorted(bad)}; valid keys: {sorted(known)}")
        built[section] = cls(**values)
    return Config(**built)
