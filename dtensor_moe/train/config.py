"""Training configuration: TOML file sections plus `section.key=value` command-line overrides."""

import re
import tomllib
from dataclasses import asdict, dataclass, field, fields

from dtensor_moe.config import MOE_RULES, MoEConfig, MoERunOptions, check_groups, check_run_options
from dtensor_moe.parallel.activation_checkpoint import check_activation_checkpoint
from dtensor_moe.parallel.mesh import PP_STAGES_PER_RANK
from dtensor_moe.train.hf_config import check_hf_parallel, hf_model_fields
from dtensor_moe.train.parallel.tp_styles import check_tp_heads, check_tp_untied
from dtensor_moe.validate import Range, above, at_least, check_fields

__all__ = [
    "Config", "ModelConfig", "ParallelConfig", "TrainingConfig", "DataConfig", "load_config", "parse_overrides",
    "read_toml", "build_section",
]

BYTE_VOCAB = 256  # corpus, synthetic (train/data.py) and the byte tokenizer (train/tokenizer.py)
OVERRIDE = re.compile(r"^([A-Za-z_]\w*)\.([A-Za-z_]\w*)=(.*)$", re.DOTALL)


def is_override(arg: str) -> bool:
    """`section.key=value`; a path like runs/lr=1e-3 is not one."""
    return OVERRIDE.match(arg) is not None


# ModelConfig's MoE fields are MoEConfig's: the same names, types and defaults, plus defaults for the ones
# MoEConfig requires.
MOE_DEFAULTS = {"dim": 64, "hidden_dim": 64, "num_experts": 8, "top_k": 2}


def _with_moe_fields(cls):
    """Adds MoEConfig's fields to `cls` (before @dataclass reads its annotations), after its own."""
    for f in fields(MoEConfig):
        cls.__annotations__[f.name] = f.type
        setattr(cls, f.name, MOE_DEFAULTS.get(f.name, f.default))
    return cls


@dataclass(frozen=True)
@_with_moe_fields
class ModelConfig:
    """The main job's model, what a checkpoint holds: these fields, then every MoEConfig field (its layers'
    MoE architecture and routing). How the run computes the MoE layers is the `[moe_run]` section."""

    vocab_size: int = 256
    n_layers: int = 2
    n_heads: int = 4
    tie_embeddings: bool = False
    max_seq_len: int = 1024
    norm_eps: float = 1e-5
    # A Hugging Face MoE checkpoint directory to start from (its transformers model, our MoE layers in place of
    # its sparse blocks): its config.json fixes every architecture field above and the MoE's; the text of that
    # file is kept in hf_config (filled in by load_config), so checkpoints and exports carry it.
    hf_path: str = ""
    hf_config: str = ""

    def __post_init__(self):
        check_fields(self, "model.", vocab_size=at_least(1), n_layers=at_least(1), n_heads=at_least(1),
                     hidden_dim=at_least(1), max_seq_len=at_least(1), norm_eps=above(0), **MOE_RULES)
        check_groups(self, "model.")
        if self.hf_path:  # the transformers model's own attention: its head dims are its config's business
            return
        # Rotary embeddings rotate feature pairs, so the head dim must be even too.
        valid = [h for h in range(1, self.dim + 1) if self.dim % h == 0 and (self.dim // h) % 2 == 0]
        if self.dim % self.n_heads != 0:
            raise ValueError(
                f"model.dim ({self.dim}) must be divisible by model.n_heads ({self.n_heads}); valid n_heads: {valid}"
            )
        if (self.dim // self.n_heads) % 2:
            raise ValueError(
                f"model.dim / model.n_heads = {self.dim // self.n_heads} (the head dim) must be even for rotary "
                f"embeddings; valid n_heads for dim {self.dim}: {valid}"
            )

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        """The `[model]` table `d` (a run's, or a checkpoint's model_config.json), checked as load_config checks it."""
        return build_section("model", d)

    def moe_config(self) -> MoEConfig:
        return MoEConfig(**{f.name: getattr(self, f.name) for f in fields(MoEConfig)})

    def num_params(self) -> int:
        """Parameters of train.model.MoETransformer for this config (of the checkpoint's tensors with hf_path),
        torch-free (the launcher's disk check)."""
        if self.hf_path:
            from dtensor_moe.train.hf_config import checkpoint_numel

            return checkpoint_numel(self.hf_path)
        D, E, F = self.dim, self.num_experts, self.hidden_dim
        moe = E * D + E * self.router_bias + 3 * E * F * D + 3 * self.num_shared_experts * F * D
        moe += (2 * E * F + E * D) * self.expert_biases
        block = 4 * D * D + 2 * D + moe
        return self.vocab_size * D * (1 if self.tie_embeddings else 2) + self.n_layers * block + D


BACKENDS = ("auto", "nccl", "gloo")  # parallel.backend
AUTO_BACKEND = {"cpu": "gloo", "cuda": "nccl"}  # what auto means on each parallel.device


@dataclass(frozen=True)
class ParallelConfig:
    """The `[parallel]` section: how many ranks the launcher starts, on which device and backend, and how they fold
    into the dense mesh (dp_replicate, dp_shard, cp, tp), the expert mesh (ep, etp) and pipeline stages (pp, its
    schedule and microbatches). dp_shard is not set here: it takes the rest of nproc (`MoEParallelDims`). `timeout_s`
    is the watchdog's: a rank with no step done for that long stops the job."""

    nproc: int = 1
    device: str = "cpu"  # cpu | cuda
    # The process groups' backend (BACKENDS): auto is nccl on cuda, gloo on cpu. gloo on cuda lets several ranks
    # share a GPU (more ranks than GPUs, e.g. EP on a one-GPU box): slow, CUDA tensors go through the host.
    backend: str = "auto"
    dp_replicate: int = 1
    ep: int = 1
    etp: int = 1
    tp: int = 1  # dense tensor parallelism of attention, sequence-parallel between blocks
    cp: int = 1  # context parallelism: each rank a contiguous part of every sequence
    pp: int = 1  # pipeline stages (outermost: world = pp * dp_replicate * dp_shard * cp * tp)
    pp_schedule: str = "1f1b"  # gpipe | 1f1b | interleaved_1f1b (2 stages per rank)
    # Per step; the gradient is accumulated over them (also with pp = 1). 0: one per pipeline stage.
    microbatches: int = 0
    # A rank with no progress for this long (no step done) stops the whole job, named with its step (the launcher's
    # watchdog; collectives time out at max(timeout_s, 60)). Long enough for a first compiled step or a large save.
    timeout_s: float = 900.0

    def __post_init__(self):
        check_fields(self, "parallel.", nproc=at_least(1), device=("cpu", "cuda"), backend=BACKENDS,
                     dp_replicate=at_least(1), ep=at_least(1), etp=at_least(1), tp=at_least(1), cp=at_least(1),
                     pp=at_least(1), pp_schedule=tuple(PP_STAGES_PER_RANK), microbatches=at_least(0),
                     timeout_s=above(0))
        if self.backend == "nccl" and self.device != "cuda":
            raise ValueError(f"parallel.backend = 'nccl' needs parallel.device = 'cuda' (NCCL runs on GPUs only), got "
                             f"parallel.device = {self.device!r}; valid: parallel.backend = 'auto' or 'gloo' with "
                             f"parallel.device = {self.device!r}, or parallel.device = 'cuda'")
        if self.pp > 1 and self.device == "cuda" and self.resolved_backend == "gloo":
            raise ValueError(f"parallel.pp = {self.pp} with parallel.backend = 'gloo' on parallel.device = 'cuda': "
                             "gloo's send/recv between pipeline stages takes no CUDA tensors; valid: "
                             "parallel.backend = 'nccl' (one GPU a rank), parallel.pp = 1, or parallel.device = 'cpu'")

    @property
    def resolved_backend(self) -> str:
        """The backend `init_process_group` gets: `backend`, with auto resolved for `device`."""
        return AUTO_BACKEND[self.device] if self.backend == "auto" else self.backend

    @property
    def num_microbatches(self) -> int:
        return self.microbatches or self.pp * (PP_STAGES_PER_RANK[self.pp_schedule] if self.pp > 1 else 1)


@dataclass(frozen=True)
class TrainingConfig:
    """The `[training]` section: the optimizer steps and their batch (global_batch sequences of seq_len tokens per
    step), AdamW's learning rate with its warmup and cosine decay to lr * min_lr_ratio, weight decay and gradient
    clipping, the compute dtype and seed, and what the step runs (torch.compile, activation checkpointing, routing
    replay, the chunked loss); parity_tolerance is the loss difference `dtensor-moe train --parity` accepts."""

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
    compile: bool = False  # torch.compile each block, one graph (experts gather over EDP inside it)
    activation_checkpoint: str = "none"  # activation_checkpoint.AC_MODES; selective recomputes no communication
    # Routing replay (dtensor_moe/replay.py) every step: a no-grad eval forward of the step's microbatches (the
    # "rollout") records each MoE layer's expert choices, and the training forward replays them.
    routing_replay: bool = False
    # The LM head and cross-entropy this many tokens at a time, each chunk's logits computed again in backward
    # (train/loss.py): one chunk of logits alive instead of the whole [B, L, V] and its fp32 copy. 0: full logits.
    loss_chunk_tokens: int = 2048

    def __post_init__(self):
        # Before check_fields, whose type check would name only "a string" for a non-string mode.
        check_activation_checkpoint(self.activation_checkpoint, "training.")
        check_fields(self, "training.", steps=at_least(1), seq_len=at_least(1), global_batch=at_least(1), lr=above(0),
                     min_lr_ratio=Range(0, 1), warmup_steps=at_least(0), weight_decay=at_least(0),
                     max_norm=above(0), dtype=("float32", "bf16"), seed=Range(0, 2**32 - 1),
                     parity_tolerance=at_least(0), loss_chunk_tokens=at_least(0))


DATA_SOURCES = ("corpus", "synthetic", "files")
# [data] keys that only data.source = "files" reads.
FILE_KEYS = ("paths", "eval_paths", "text_field", "tokenizer", "cache_dir")


def _globs(value, name: str) -> tuple[str, ...]:
    """A list of glob strings (one string is a list of one: `data.paths=a.jsonl` on the command line)."""
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v.strip() for v in value):
        raise ValueError(f"data.{name} must be a list of file paths or glob patterns (non-empty strings), e.g. "
                         f'["data/*.jsonl"], got {value!r}')
    return tuple(value)


@dataclass(frozen=True)
class DataConfig:
    """Where the tokens come from. corpus and synthetic are byte-level and built in; files reads the user's
    .txt / .jsonl / .parquet files (or .npy token shards) with a tokenizer into a token cache (token_cache.py)."""

    source: str = "corpus"  # DATA_SOURCES
    paths: tuple = ()  # globs of the training files (source = "files")
    eval_paths: tuple = ()  # globs of held-out files; or eval_fraction
    text_field: str = "text"  # the JSONL field / Parquet column holding each document's text
    # "byte" (UTF-8 bytes, ids 0..255) or a Hugging Face tokenizer directory; "" is model.hf_path's own tokenizer
    # (the checkpoint directory), or "byte" for a model of 256 tokens.
    tokenizer: str = ""
    eval_fraction: float = 0.0  # the last fraction of the token stream held out for evaluation
    eval_every: int = 0  # evaluate every N steps (and after the last one); 0: after the last step only
    eval_batches: int = 4  # global batches of held-out sequences per evaluation (fewer when it has fewer)
    cache_dir: str = ""  # "": $DTENSOR_MOE_CACHE, else $XDG_CACHE_HOME/dtensor_moe (~/.cache/dtensor_moe)

    def __post_init__(self):
        for name in ("paths", "eval_paths"):
            object.__setattr__(self, name, _globs(getattr(self, name), name) if getattr(self, name) else ())
        check_fields(self, "data.", source=DATA_SOURCES, eval_fraction=Range(0, 1), eval_every=at_least(0),
                     eval_batches=at_least(1))
        if self.eval_fraction >= 1:
            raise ValueError(f"data.eval_fraction ({self.eval_fraction}) must be < 1: the held-out split would leave "
                             "no training data; valid: 0 <= eval_fraction < 1, e.g. 0.05")
        if self.source != "files":
            given = [k for k in FILE_KEYS if getattr(self, k) != getattr(DataConfig, k, ())]
            if given:
                raise ValueError(f"data.{given[0]} is read only with data.source = 'files', got data.source = "
                                 f"{self.source!r}; valid: data.source = 'files', or drop data.{given[0]}")
            return
        if not self.paths:
            raise ValueError('data.source = \'files\' needs data.paths: a list of files or glob patterns, e.g. '
                             'paths = ["data/*.jsonl"] (.txt, .jsonl, .parquet or .npy token shards)')
        if not self.text_field.strip():
            raise ValueError("data.text_field must name the JSONL field / Parquet column of the text, e.g. 'text'; "
                             "got ''")
        if self.eval_paths and self.eval_fraction:
            raise ValueError(f"data.eval_paths and data.eval_fraction ({self.eval_fraction}) both choose the held-out "
                             "split; give one of them")

    @property
    def has_eval(self) -> bool:
        """Whether the run holds data out for an evaluation loss."""
        return bool(self.eval_fraction or self.eval_paths)

    def resolved_tokenizer(self, hf_path: str) -> str:
        """The tokenizer data.source = 'files' reads text with: data.tokenizer, else model.hf_path's, else byte."""
        return self.tokenizer or hf_path or "byte"


@dataclass(frozen=True)
class Config:
    """A whole training run, one field per TOML section: `[model]` (ModelConfig, what a checkpoint holds),
    `[moe_run]` (MoERunOptions, how the run computes the MoE layers), `[parallel]` (ParallelConfig), `[training]`
    (TrainingConfig) and `[data]` (DataConfig). `load_config` builds it from a file and `section.key=value`
    overrides; construction checks what spans sections (e.g. training.seq_len against model.max_seq_len and
    parallel.cp * tp, model.vocab_size against the data's tokenizer)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    # How the run computes the MoE layers (token dropping and rounding, precisions, replicas, the row cap): not in
    # checkpoints, so a resume may change them.
    moe_run: MoERunOptions = field(default_factory=MoERunOptions)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    data: DataConfig = field(default_factory=DataConfig)

    def __post_init__(self):
        m, t = self.model, self.training
        if t.seq_len > m.max_seq_len:
            raise ValueError(
                f"training.seq_len ({t.seq_len}) must be <= model.max_seq_len ({m.max_seq_len}); "
                f"valid seq_len: 1..{m.max_seq_len} (or raise model.max_seq_len)"
            )
        p, run = self.parallel, self.moe_run
        check_run_options(m, run, "moe_run.")
        if t.compile and run.expert_replicas:
            raise ValueError(f"training.compile = true with moe_run.expert_replicas ({run.expert_replicas}) is not "
                             "supported: the replicas' split of an expert's rows needs the step's counts on the host, "
                             "eagerly; valid: training.compile = false, or moe_run.expert_replicas = 0")
        if m.hf_path:
            check_hf_parallel(m.hf_path, p, t)
        check_tp_heads(m.n_heads, p.tp, "parallel.")
        if t.seq_len % (p.cp * p.tp):
            raise ValueError(f"training.seq_len ({t.seq_len}) must be divisible by parallel.cp * parallel.tp "
                             f"({p.cp}*{p.tp}): every CP rank holds an equal part of each sequence and every TP rank "
                             f"an equal slice of that; e.g. seq_len {[p.cp * p.tp * k for k in (8, 16, 32)]}")
        check_tp_untied(m.tie_embeddings, p.tp, "parallel.")
        self._check_data()

    def _check_data(self):
        """The static part of the data's checks; the files and the tokenizer are checked before launch too
        (token_cache.prepare)."""
        m, d = self.model, self.data
        if d.eval_every and not d.has_eval:
            raise ValueError(f"data.eval_every ({d.eval_every}) needs a held-out split: data.eval_fraction > 0 "
                             "(e.g. 0.05) or data.eval_paths")
        byte = d.source != "files" or d.resolved_tokenizer(m.hf_path) == "byte"
        if byte and m.vocab_size < BYTE_VOCAB:
            what = f"data.source={d.source!r}" if d.source != "files" else "data.tokenizer='byte'"
            raise ValueError(
                f"model.vocab_size ({m.vocab_size}) must be >= {BYTE_VOCAB}: {what} "
                f"is byte-level (token ids 0..{BYTE_VOCAB - 1})"
            )

    def to_dict(self) -> dict:
        return asdict(self)


SECTIONS = {"model": ModelConfig, "moe_run": MoERunOptions, "parallel": ParallelConfig, "training": TrainingConfig,
            "data": DataConfig}


def build_section(name: str, values: dict):
    """One table of the config, `SECTIONS[name]`, from its keys: an unknown key is refused naming the valid ones (and
    a run option left under [model] naming [moe_run]), a bad value naming it as `name.key`.

    Args:
        name (str): the table, a key of SECTIONS.
        values (dict): its keys and values.

    Returns:
        the section's dataclass.
    """
    cls = SECTIONS[name]
    known = {f.name for f in fields(cls)}
    bad = set(values) - known
    if bad:
        moved = sorted(bad & {f.name for f in fields(MoERunOptions)}) if name == "model" else []
        hint = f"; {moved} are [moe_run] keys (how the run computes the MoE layers)" if moved else ""
        raise ValueError(f"unknown [{name}] keys {sorted(bad)}{hint}; valid keys: {sorted(known)}")
    try:
        return cls(**values)
    except ValueError as e:
        # MoERunOptions names its fields by its class ("MoERunOptions.x"); the user wrote [moe_run] x.
        raise ValueError(str(e).replace(f"{cls.__name__}.", f"{name}.")) from None


def _parse_value(text: str):
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text  # bare strings: data.source=synthetic


def read_toml(path: str) -> dict:
    """The file's tables; a missing or malformed file raises ValueError naming it (and the line)."""
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except FileNotFoundError:
        raise ValueError(f"config file {path!r} not found") from None
    except IsADirectoryError:
        raise ValueError(f"config file {path!r} is a directory, not a TOML file") from None
    except OSError as e:
        raise ValueError(f"config file {path!r} cannot be read: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"config file {path!r} is not valid TOML: {e}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"config file {path!r} is not UTF-8 text: {e}") from None
    return raw


def parse_overrides(overrides) -> dict[str, object]:
    """`section.key=value` items as {"section.key": value}; a key given twice with different values raises
    (which one was meant is a guess, and a silent last-one-wins hides a typo in a long command line)."""
    values, texts = {}, {}
    for item in overrides:
        m = OVERRIDE.match(item)
        if m is None or m.group(1) not in SECTIONS:
            raise ValueError(f"override {item!r} must look like section.key=value with section in {sorted(SECTIONS)}")
        section, name, text = m.groups()
        key, value = f"{section}.{name}", _parse_value(text)
        if key in values and values[key] != value:
            raise ValueError(f"override {key} is given twice with different values ({texts[key]} and {item}); "
                             "give it once")
        values[key], texts[key] = value, item
    return values


def load_config(path: str | None, overrides: list[str] = ()) -> Config:
    """`path`'s tables with `overrides` applied (no path: the defaults with them)."""
    raw: dict = read_toml(path) if path else {}
    where = f" in {path}" if path else ""
    unknown = set(raw) - set(SECTIONS)
    if unknown:
        raise ValueError(f"unknown config sections {sorted(unknown)}{where}; valid: {sorted(SECTIONS)}")
    for section, values in raw.items():
        if not isinstance(values, dict):
            raise ValueError(f"[{section}]{where} must be a table of key = value lines, got {section} = {values!r}")
    if path and not raw.get("model") and not raw.get("training"):
        # An empty, truncated or wrong file would train the built-in defaults: a run nobody described.
        raise ValueError(
            f"config file {path!r} sets no [model] or [training] key; it must set at least one, e.g. "
            "[training] steps = 50 (configs/ has complete examples), rather than train the built-in defaults"
        )
    for key, value in parse_overrides(overrides).items():
        section, name = key.split(".")
        raw.setdefault(section, {})[name] = value
    if raw.get("model", {}).get("hf_path"):
        raw["model"] = hf_model_fields(raw["model"])
    return Config(**{section: build_section(section, raw.get(section, {})) for section in SECTIONS})
