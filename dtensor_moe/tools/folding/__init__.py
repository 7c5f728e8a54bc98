"""`dtensor-moe plan`: choose the folding (pp; dp_replicate, dp_shard, cp, tp; edp, ep, etp) from memory and traffic.

The cost model, one concept a module (each imports only those above it):
- `cache`: `CostCache`, the memo tables a search owns (filled by `units` and `tokens`).
- `workload`: the inputs besides the model (`Workload`, `Hardware`), byte sizes, tokens per rank.
- `skew`: skewed routing (`Workload.skew`): Zipf popularity, rows per EP rank without and with hot-expert
  replicas (`Balance`), the straggler factor.
- `geometry`: which ranks form each group and what share of its traffic crosses nodes.
- `pipeline`: what each pipeline rank holds and runs (`StageShare`, `pipeline_ranks`: layers,
  microbatches in flight, stage-boundary sends) and the bubble.
- `units`: FSDP units from the placement plan and rank 0's `Footprint` of them.
- `tokens`: what a folding's tokens cost per unit of a rank's share (`Rates`, `distinct_ranks`).
- `memory`: bytes per rank (state, gathered working set, activations) and `predicted_state_bytes`
  (the training loop's check of the cost model against measured bytes).
- `traffic`: bytes sent per step split intra-/inter-node (`token_traffic`, the weights' `Held`), seconds.
Then `search`: enumerate the foldings (pp the schedule runs, stages of whole nodes; dense tp within a
node), evaluate each (`Candidate`: the worst pipeline rank), rank them (`rank_foldings`); and `report`: the
table, the top choice in plain words, JSON rows (the CLI is `dtensor_moe.cli.plan`).

Torch-free: `dtensor-moe plan` of a preset imports neither torch nor the training code.
"""

from dtensor_moe.tools.folding.cache import CostCache, Memo
from dtensor_moe.tools.folding.geometry import (
    chain_inter_fraction,
    mesh_geometry,
    node_span,
    pairwise_intra_fraction,
    ring_inter_fraction,
)
from dtensor_moe.tools.folding.memory import (
    Memory,
    activation_bytes,
    predicted_state_bytes,
    rank_activations,
    rank_memory,
    state_bytes,
)
from dtensor_moe.tools.folding.pipeline import (
    PipelineRank,
    StageShare,
    bubble_fraction,
    in_flight,
    pipeline_ranks,
    stage_share,
)
from dtensor_moe.tools.folding.report import candidate_dict, explain_choice, table
from dtensor_moe.tools.folding.search import (
    TP_NOTE,
    Candidate,
    evaluate,
    foldings,
    footprint_key,
    pipeline_degrees,
    rank_foldings,
    rates_key,
)
from dtensor_moe.tools.folding.skew import (
    Balance,
    balance,
    expert_rows,
    inclusion,
    max_over_mean,
    popularity,
    popularity_order,
)
from dtensor_moe.tools.folding.tokens import Rates, distinct_ranks, rates
from dtensor_moe.tools.folding.traffic import (
    Held,
    Traffic,
    comm_bytes,
    comm_time,
    held_costs,
    ranks_held_costs,
    seconds,
    token_traffic,
    traffic_of,
)
from dtensor_moe.tools.folding.units import (
    Footprint,
    Unit,
    UnitPart,
    combine,
    footprint,
    fsdp_units,
    held_numel,
    share_footprint,
    share_parts,
    unit_part,
)
from dtensor_moe.tools.folding.workload import (
    COMPUTE_BYTES,
    MASTER_BYTES,
    OPTIMIZER_MOMENTS,
    PRICED_AC_MODES,
    REDUCE_BYTES,
    STEP_BYTES,
    GiB,
    Hardware,
    Workload,
    step_tokens_per_rank,
    tokens_per_rank,
)

__all__ = [
    "COMPUTE_BYTES", "MASTER_BYTES", "OPTIMIZER_MOMENTS", "PRICED_AC_MODES", "REDUCE_BYTES", "STEP_BYTES", "TP_NOTE",
    "Balance", "Candidate", "CostCache", "Footprint", "GiB", "Hardware", "Held", "Memo", "Memory", "PipelineRank",
    "Rates", "StageShare", "Traffic", "Unit", "UnitPart", "Workload", "activation_bytes", "balance", "bubble_fraction",
    "candidate_dict", "chain_inter_fraction", "combine", "comm_bytes", "comm_time", "distinct_ranks", "evaluate",
    "expert_rows", "explain_choice", "foldings", "footprint", "footprint_key", "fsdp_units", "held_costs", "held_numel",
    "in_flight", "inclusion", "max_over_mean", "mesh_geometry", "node_span", "pairwise_intra_fraction",
    "pipeline_degrees", "pipeline_ranks", "popularity", "popularity_order", "predicted_state_bytes", "rank_activations",
    "rank_foldings", "rank_memory", "ranks_held_costs", "rates", "rates_key", "ring_inter_fraction", "seconds",
    "share_footprint", "share_parts", "stage_share", "state_bytes", "step_tokens_per_rank", "table", "token_traffic",
    "tokens_per_rank", "traffic_of", "unit_part",
]
