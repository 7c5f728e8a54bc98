"""torchtitan's Trainer with one more config section, `dtensor_moe`: our expert degrees.

`--dtensor_moe.ep`, `--dtensor_moe.etp`, `--dtensor_moe.dp_replicate` on torchtitan's command line;
EDP is what is left: dp_shard / (ep * etp). torchtitan itself keeps seeing a plain FSDP/HSDP job
(its own expert_parallel_degree stays 1) and our parallelize function receives the expert degrees
through `ExpertMeshParallelDims`, torchtitan's ParallelDims plus ours.
"""

from dataclasses import dataclass, field, fields

import torch.distributed as dist
from torch.distributed.distributed_c10d import _set_pg_timeout
from torchtitan.distributed import ParallelDims
from torchtitan.trainer import Trainer as TitanTrainer

from dtensor_moe.parallel.mesh import MoEParallelDims

# torchtitan 0.3.0 calls torch.distributed.set_timeout after the first step, an API that torch
# 2.13.0 only has under its private name; same signature (timeout, group).
if not hasattr(dist, "set_timeout"):
    dist.set_timeout = _set_pg_timeout


@dataclass(kw_only=True, slots=True)
class ExpertParallelConfig:
    ep: int = 1
    """Expert parallel degree: ranks that split the experts (dim 0 of the expert weights)."""
    etp: int = 1
    """Expert tensor parallel degree: ranks that split each expert's hidden dim F."""
    dp_replicate: int = 1
    """HSDP replicate degree of dense and expert weights (sets parallelism.data_parallel_replicate_degree)."""


@dataclass
class ExpertMeshParallelDims(ParallelDims):
    """torchtitan's ParallelDims of the dense model, plus the expert degrees our parallelize applies."""

    moe: MoEParallelDims | None = None

    @property
    def ep_enabled(self) -> bool:
        # Expert weights live on our expert mesh, not on the dense one: torchtitan's gradient
        # clipping must take its EP path, which norms the two meshes' gradients separately.
        return True


def _only(name: str, value, allowed, hint: str):
    if value != allowed:
        raise ValueError(f"{name}={value!r} is not supported with --module dtensor_moe.titan: {hint}")


class Trainer(TitanTrainer):
    @dataclass(kw_only=True, slots=True)
    class Config(TitanTrainer.Config):
        dtensor_moe: ExpertParallelConfig = field(default_factory=ExpertParallelConfig)

        def __post_init__(self):
            TitanTrainer.Config.__post_init__(self)
            p, ours = self.parallelism, self.dtensor_moe
            _only("parallelism.expert_parallel_degree", p.expert_parallel_degree, 1, "set --dtensor_moe.ep instead")
            _only("parallelism.tensor_parallel_degree", p.tensor_parallel_degree, 1, "use --dtensor_moe.etp for experts")
            _only("parallelism.context_parallel_degree", p.context_parallel_degree, 1, "use 1")
            _only("parallelism.pipeline_parallel_degree", p.pipeline_parallel_degree, 1, "use 1")
            _only("parallelism.spmd_backend", p.spmd_backend, "partial_dtensor", "use 'partial_dtensor'")
            _only(
                "training.disable_cuda_graphs",
                self.training.disable_cuda_graphs,
                True,
                "the expert dispatcher reads token counts on the host; pass --training.disable_cuda_graphs",
            )
            if p.data_parallel_replicate_degree not in (1, ours.dp_replicate):
                raise ValueError(
                    f"parallelism.data_parallel_replicate_degree ({p.data_parallel_replicate_degree}) "
                    f"conflicts with dtensor_moe.dp_replicate ({ours.dp_replicate}); set only "
                    f"--dtensor_moe.dp_replicate"
                )
            p.data_parallel_replicate_degree = ours.dp_replicate

    def init_distributed(self) -> ExpertMeshParallelDims:
        dense = super().init_distributed()
        ours = self.config.dtensor_moe
        # Raises ValueError (same on every rank) before torchtitan builds any mesh.
        moe = MoEParallelDims(
            dense.world_size, dp_replicate=ours.dp_replicate, dp_shard=dense.dp_shard, ep=ours.ep, etp=ours.etp
        )
        init = {f.name: getattr(dense, f.name) for f in fields(ParallelDims) if not f.name.startswith("_")}
        return ExpertMeshParallelDims(**init, moe=moe)
