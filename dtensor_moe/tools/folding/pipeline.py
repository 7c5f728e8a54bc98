"""What each pipeline rank holds and runs: its stages' layers, microbatches in flight, stage-boundary
sends, and the bubble.

Pipeline parallelism is outermost. A pipeline rank's `StageShare` is the layers of its stages
(`placement.rank_layers`), the embedding on the first, the norm and head on the last. The schedule
decides the activations in flight (gpipe: every microbatch, 1f1b: pp - rank on rank `rank`,
interleaved: torch's warm-up count of chunks) and the bubble ((pp - 1) / v / (microbatches + (pp -
1) / v) for v stages per rank), which stretches the step: time per token is the communication time
/ (1 - bubble) per token. Every pipeline rank that can be the worst is costed; a candidate takes
the one with the most memory and the slowest one's traffic (it sets the pipeline's pace).
"""

from typing import NamedTuple

from dtensor_moe.parallel.mesh import PP_STAGES_PER_RANK
from dtensor_moe.parallel.placement import rank_layers
from dtensor_moe.tools.folding.workload import Workload
from dtensor_moe.tools.presets import ModelShape


class StageShare(NamedTuple):
    """What one pipeline rank holds (with pp == 1, the whole model)."""

    n_dense_layers: int
    n_moe_layers: int
    first: bool  # the embedding
    last: bool  # the final norm and the head

    @property
    def layers(self) -> int:
        return self.n_dense_layers + self.n_moe_layers


def stage_share(spec: ModelShape, pp: int, schedule: str, pp_rank: int) -> StageShare:
    """What pipeline rank `pp_rank` of `pp` holds of `spec` under `schedule` ("gpipe", "1f1b",
    "interleaved_1f1b"): the dense and MoE layers of its stages (`placement.rank_layers`; the dense
    layers lead the model), the embedding on rank 0, the final norm and head on rank pp - 1.

    Example:
        >>> from dtensor_moe.tools.presets import PRESETS
        >>> stage_share(PRESETS["deepseek-v3-671b"], 16, "1f1b", 0)  # 61 layers, the first 3 dense
        StageShare(n_dense_layers=3, n_moe_layers=1, first=True, last=False)
    """
    layers = rank_layers(spec.n_layers, pp, schedule, pp_rank)
    dense = sum(i < spec.n_dense_layers for i in layers)  # the dense layers lead
    return StageShare(dense, len(layers) - dense, pp_rank == 0, pp_rank == pp - 1)


class PipelineRank(NamedTuple):
    """A pipeline rank as the cost model prices it: what it holds, the microbatches whose activations it
    keeps at its peak, and its stage-boundary sends (`pipeline_ranks`; `whole_model` for pp == 1)."""

    share: StageShare
    in_flight: float  # microbatches whose saved activations (of all its layers) it holds at peak
    sends: int  # stage-boundary sends per microbatch: hidden states forward, their gradients backward


def whole_model(spec: ModelShape) -> PipelineRank:
    """The one rank of pp == 1: every layer, one microbatch at a time, nothing sent to a stage."""
    return PipelineRank(StageShare(spec.n_dense_layers, spec.n_moe_layers, True, True), 1, 0)


def in_flight(work: Workload, pp: int, pp_rank: int) -> float:
    """Microbatches in flight on pipeline rank `pp_rank` at its peak (torch.distributed.pipelining's
    warm-up: 1F1B runs pp - rank forwards before its first backward; interleaved 1F1B counts chunks of
    one stage, 1/v of the rank's layers, and adds one to its warm-up before the first backward)."""
    M, v = work.microbatches, PP_STAGES_PER_RANK[work.pp_schedule]
    if pp == 1:
        return 1  # gradient accumulation runs the microbatches one after another
    if work.pp_schedule == "gpipe":
        return M
    if work.pp_schedule == "1f1b":
        return min(M, pp - pp_rank)
    per_round = M // max(1, M // pp)
    return min((v - 1) * per_round + 2 * (pp - 1 - pp_rank) + 1, M * v) / v


def bubble_fraction(pp: int, work: Workload) -> float:
    """Share of a step a pipeline rank idles: (pp - 1) / v slots of warm-up and drain beside M of work."""
    idle = (pp - 1) / PP_STAGES_PER_RANK[work.pp_schedule]
    return idle / (work.microbatches + idle)


def pipeline_ranks(spec: ModelShape, pp: int, work: Workload) -> tuple[PipelineRank, ...]:
    """The pipeline ranks that can be the worst, one per distinct share (the most in flight, the most
    sends): memory and traffic only grow with those. A rank that an earlier one dominates (a share
    holding no more units, no more in flight, no more sends) is left out: every cost is a sum of
    non-negative terms monotone in those, so it never exceeds the earlier rank's, which wins ties."""
    v = PP_STAGES_PER_RANK[work.pp_schedule] if pp > 1 else 0
    worst: dict[StageShare, PipelineRank] = {}
    for r in range(pp):
        share = stage_share(spec, pp, work.pp_schedule, r)
        sends = 2 * v - (r == 0) - (r == pp - 1) if pp > 1 else 0
        old = worst.get(share)
        worst[share] = PipelineRank(share, max(in_flight(work, pp, r), old.in_flight if old else 0),
                                    max(sends, old.sends if old else 0))
    ranks = tuple(worst.values())
    return tuple(a for i, a in enumerate(ranks) if not any(_dominates(b, a) for b in ranks[:i]))


def _dominates(b: PipelineRank, a: PipelineRank) -> bool:
    return all(x >= y for x, y in zip((*b.share, b.in_flight, b.sends), (*a.share, a.in_flight, a.sends)))
