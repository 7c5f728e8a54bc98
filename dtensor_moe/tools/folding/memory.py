"""Memory per rank in one training step: sharded state, the gathered FSDP working set, activations.

- fp32 sharded params, fp32 sharded grads, optimizer state (AdamW: two fp32 moments and a step
  scalar per tensor): FSDP2's MixedPrecisionPolicy keeps sharded params in fp32 and all-gathers in
  the compute dtype.
- the gathered working set: root unit kept gathered, current + prefetched block, one block's
  unsharded grads in compute and reduce dtype. Under pp torch.distributed.pipelining keeps every
  FSDP unit unsharded from its first backward to the step's gradient reduction and accumulates the
  unsharded gradients (reduce dtype), so a pipeline rank's working set is all of its units,
  gathered, twice.
- activations (an estimate), for each microbatch in flight: under skewed routing the busiest EP
  rank's routed rows, with hot-expert replicas their weight copies (tokens.py).

The weights' part (`held_memory`) follows from rank 0's footprint, the activations from the
folding's `Rates` times the rank's share.
"""

from typing import NamedTuple

from dtensor_moe.parallel.mesh import MoEParallelDims
from dtensor_moe.tools.folding.pipeline import PipelineRank, stage_share, whole_model
from dtensor_moe.tools.folding.tokens import Rates, rates
from dtensor_moe.tools.folding.units import Footprint, fsdp_units, held_numel
from dtensor_moe.tools.folding.workload import MASTER_BYTES, OPTIMIZER_MOMENTS, REDUCE_BYTES, STEP_BYTES, Workload
from dtensor_moe.tools.presets import ModelShape, shape_from_model_config


class Memory(NamedTuple):  # a tuple, like Traffic: built for every pipeline rank of every folding
    """Bytes one rank holds at its peak in a training step, by part (`rank_memory`).

    Attributes:
        params (float): its sharded fp32 parameters.
        grads (float): its sharded fp32 gradients.
        optimizer (float): its optimizer state (AdamW: two fp32 moments and a step counter per tensor).
        gathered (float): the FSDP working set: unsharded parameters and gradients while they are in use.
        activations (float): saved activations, an estimate (`rank_activations`).
    """

    params: float
    grads: float
    optimizer: float
    gathered: float
    activations: float

    @property
    def states(self) -> float:
        """Params + grads + optimizer state: what stays allocated between steps."""
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> float:
        return self.states + self.gathered + self.activations


def state_bytes(held: int, tensors: int, work: Workload) -> tuple[int, int, int]:
    """(params, grads, optimizer state) bytes of a rank holding `held` elements of `tensors` parameters."""
    moments = OPTIMIZER_MOMENTS[work.optimizer]
    opt = held * MASTER_BYTES * moments + (tensors * STEP_BYTES if moments else 0)
    return held * MASTER_BYTES, held * MASTER_BYTES, opt


def held_memory(work: Workload, pp: int, fp: Footprint) -> tuple[int, int, int, int]:
    """(params, grads, optimizer state, gathered working set) bytes of a rank with footprint `fp`."""
    b = work.compute_bytes
    if pp == 1:
        # Root stays gathered; one block computing while the next is prefetched; one block's unsharded
        # grads in compute dtype plus their reduce-dtype copy for the reduce-scatter.
        working = b * (fp.gathered_root + 2 * fp.gathered_block) + fp.gathered_block * (b + REDUCE_BYTES)
    else:  # every unit gathered, its gradients accumulated unsharded, one block's fresh gradient
        working = (b + REDUCE_BYTES) * (fp.gathered_root + fp.gathered_blocks) + b * fp.gathered_block
    return (*state_bytes(fp.held, fp.tensors, work), working)


def rank_activations(r: Rates, rank: PipelineRank) -> float:
    """Saved activation bytes of pipeline rank `rank` under its folding's `Rates` `r` (an estimate): per
    microbatch in flight, its layers' saved activations (only their block inputs when recomputing) and, on the
    last stage, the logits; once, one layer's activations while it is recomputed, the logits' gradient (last
    stage) and, with hot-expert replicas, one MoE layer's replica weights' gradient."""
    s = rank.share
    logits, logits_grad = (r.logits, r.logits_grad) if s.last else (0, 0)
    if r.recompute:  # block inputs, plus one block's activations while it is recomputed
        saved = s.layers * r.block_input
        recomputed = max(r.moe_layer if s.n_moe_layers else 0, r.dense_layer if s.n_dense_layers else 0)
    else:
        saved, recomputed = s.n_moe_layers * r.moe_layer + s.n_dense_layers * r.dense_layer, 0
    replica_grads = r.replica_copies if s.n_moe_layers else 0  # one MoE layer's, while its backward runs
    return rank.in_flight * (saved + logits) + recomputed + logits_grad + replica_grads


def activation_bytes(spec: ModelShape, dims: MoEParallelDims, work: Workload, rank: PipelineRank | None = None
                     ) -> float:
    """Saved activations of a (pipeline) rank (estimate): inputs and outputs of every linear, routed
    copies, logits, for each microbatch in flight; one block's more while it is recomputed.

    MoE: after the ETP gather a rank holds etp * top_k * T routed tokens of width D and the same
    tokens' F/etp-wide hidden activations (three of them), so the hidden part is independent of etp;
    the combine keeps the experts' D-wide outputs of those pairs for the routing weights' gradient.
    """
    return rank_activations(rates(spec, dims, work), rank or whole_model(spec))


def rank_memory(spec: ModelShape, dims: MoEParallelDims, work: Workload, fp: Footprint,
                rank: PipelineRank | None = None) -> Memory:
    """Bytes of one rank of folding `dims`: its weights' state and working set from its footprint `fp` (the units
    it holds, `units.footprint`), its activations (`activation_bytes`) running `work`. `rank`: the pipeline rank
    it is (default: the one rank of pp == 1, the whole model)."""
    return Memory(*held_memory(work, dims.pp, fp), activation_bytes(spec, dims, work, rank))


def predicted_state_bytes(model_cfg, dims: MoEParallelDims, rank: int, optimizer: str = "adamw",
                          pp_schedule: str = "1f1b") -> dict[str, int]:
    """Params, grads and optimizer-state bytes the cost model predicts for `rank` of a training run of
    `dtensor_moe.train.config.ModelConfig` (sharded state is fp32 whatever the compute dtype): the
    layers of its pipeline stages, sharded over its stage's ranks."""
    spec = shape_from_model_config(model_cfg)
    units = fsdp_units(spec, dims, stage_share(spec, dims.pp, pp_schedule, dims.pp_coord(rank)))
    tensors = sum(u.count * len(u.plans) for u in units)
    work = Workload(dtype="float32", optimizer=optimizer)
    return dict(zip(("params", "grads", "optimizer"), state_bytes(held_numel(units, dims, rank), tensors, work)))
