"""The folding search's inputs besides the model: what a step runs (`Workload`), on what (`Hardware`), and
the byte sizes both imply.

A step is `microbatches` microbatches of `micro_batch` sequences per data-parallel rank. Between
blocks a rank holds seq_len / (cp * tp) tokens of each sequence (`tokens_per_rank`). Routing is balanced
across the experts unless `skew` > 0 (Zipf popularity: skew.py). `moe_run`: how the MoE layers run (replica
slots, what the experts keep for the backward), the main job's `[moe_run]`.
"""

from dataclasses import dataclass, field

from dtensor_moe.config import MoERunOptions
from dtensor_moe.parallel.mesh import PP_STAGES_PER_RANK, MoEParallelDims
from dtensor_moe.validate import at_least, check_choice, check_fields, check_int, check_positive, check_type

GiB = 2**30
COMPUTE_BYTES = {"bf16": 2, "float32": 4}  # the main job's training.dtype values
OPTIMIZER_MOMENTS = {"adamw": 2, "sgd": 0}
# The activation_checkpoint modes (parallel/activation_checkpoint.AC_MODES) the cost model prices; not "selective".
PRICED_AC_MODES = ("none", "full")
MASTER_BYTES = 4  # sharded params, grads and optimizer state are fp32 under either dtype
REDUCE_BYTES = 4  # gradients are reduced in fp32 (torchtitan's default reduce_dtype)
STEP_BYTES = 4  # AdamW's per-tensor step counter (a float32 scalar)


@dataclass(frozen=True)
class Workload:
    """What a training step runs, the folding search's input besides the model and the hardware; checked at
    construction (ValueError naming the field).

    Attributes:
        seq_len (int): tokens per sequence. Default 4096.
        micro_batch (int): sequences per data-parallel rank per microbatch. Default 1.
        dtype (str): the compute dtype, "bf16" (default) or "float32"; sharded state is fp32 under either.
        optimizer (str): "adamw" (default: two fp32 moments and a step counter per tensor) or "sgd" (no state).
        activation_checkpoint (str): "full" (default: each block's activations recomputed in backward) or "none".
        microbatches (int): per step: pipeline microbatches, or gradient accumulation without pp. Default 1.
        pp_schedule (str): "gpipe", "1f1b" (default) or "interleaved_1f1b".
        skew (float): routing skew, expert popularity 1 / rank ** skew (skew.py); 0 (default): balanced.
        moe_run (MoERunOptions): how the MoE layers run (replica slots, activation memory), the main job's
            `[moe_run]`.
    """

    seq_len: int = 4096
    micro_batch: int = 1  # sequences per data-parallel rank per microbatch
    dtype: str = "bf16"
    optimizer: str = "adamw"
    activation_checkpoint: str = "full"  # "full": each block's activations are recomputed in backward
    microbatches: int = 1  # per step: pipeline microbatches, or gradient accumulation without pp
    pp_schedule: str = "1f1b"
    skew: float = 0.0  # expert popularity 1 / rank ** skew (skew.py); 0: every expert alike
    moe_run: MoERunOptions = field(default_factory=MoERunOptions)

    def __post_init__(self):
        check_int("Workload.seq_len", self.seq_len)
        check_int("Workload.micro_batch", self.micro_batch)
        check_int("Workload.microbatches", self.microbatches)
        check_choice("Workload.pp_schedule", self.pp_schedule, PP_STAGES_PER_RANK)
        check_choice("Workload.dtype", self.dtype, COMPUTE_BYTES)
        check_choice("Workload.optimizer", self.optimizer, OPTIMIZER_MOMENTS)
        check_choice("Workload.activation_checkpoint", self.activation_checkpoint, PRICED_AC_MODES)
        check_fields(self, "Workload.", skew=at_least(0))
        check_type("Workload.moe_run", self.moe_run, MoERunOptions, "a dtensor_moe.MoERunOptions")

    @property
    def compute_bytes(self) -> int:
        return COMPUTE_BYTES[self.dtype]


@dataclass(frozen=True)
class Hardware:
    """The machines the folding search plans for; checked at construction (ValueError naming the field).

    Attributes:
        gpus (int): GPUs in all: at most gpus_per_node, or a multiple of it.
        gpus_per_node (int): GPUs per node. Default 8.
        gpu_mem_gib (float): memory per GPU in GiB. Default 80.
        intra_bw (float): bytes/s per GPU one direction inside a node (NVLink). Default 450e9.
        inter_bw (float): bytes/s per GPU across nodes (one 400 Gb/s NIC each). Default 50e9.
    """

    gpus: int
    gpus_per_node: int = 8
    gpu_mem_gib: float = 80.0
    intra_bw: float = 450e9  # bytes/s one direction per GPU (NVLink)
    inter_bw: float = 50e9  # bytes/s per GPU (one 400 Gb/s NIC each)

    def __post_init__(self):
        check_int("Hardware.gpus", self.gpus)
        check_int("Hardware.gpus_per_node", self.gpus_per_node)
        for name in ("gpu_mem_gib", "intra_bw", "inter_bw"):
            check_positive(f"Hardware.{name}", getattr(self, name))
        if self.gpus % self.gpus_per_node and self.gpus > self.gpus_per_node:
            raise ValueError(f"Hardware.gpus must be <= gpus_per_node or a multiple of gpus_per_node "
                             f"({self.gpus_per_node}), got {self.gpus}")


def tokens_per_rank(work: Workload, dims: MoEParallelDims) -> int:
    """Tokens of a microbatch a rank holds between blocks (and routes through each MoE): its CP part,
    its TP slice."""
    return work.micro_batch * work.seq_len // (dims.cp * dims.tp)


def step_tokens_per_rank(work: Workload, dims: MoEParallelDims) -> float:
    """The step's tokens over the world: a pipeline of pp ranks carries each microbatch."""
    return work.microbatches * tokens_per_rank(work, dims) / dims.pp
