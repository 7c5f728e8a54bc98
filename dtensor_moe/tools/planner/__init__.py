"""`dtensor-moe plan`: choose the folding (pp; dp_replicate, dp_shard, cp, tp; edp, ep, etp) from memory and traffic.

- `cost_model`: inputs (`Workload`, `Hardware`), what each pipeline rank holds (`StageShare`,
  `pipeline_ranks`: layers, microbatches in flight, stage-boundary sends), FSDP units and rank 0's
  footprint from the placement plan, what a rank's weights cost (`Held`, once per footprint key and pp in a
  search) and its tokens (`Rates`, once per `rates_key`), memory per rank, bytes sent per step split intra-/inter-node,
  the pipeline bubble, and `predicted_state_bytes` (the training loop's check of the planner against
  measured bytes).
- `search`: enumerate the foldings (pp the schedule runs, stages of whole nodes; dense tp within a
  node), evaluate each (`Candidate`: the worst pipeline rank), rank them (`plan`).
- `report`: the table, the top choice in plain words, JSON, and the CLI's `add_arguments` / `run`.

Torch-free: planning a preset imports neither torch nor the training code.
"""

from dtensor_moe.tools.planner.cost_model import (
    COMPUTE_BYTES,
    GiB,
    MASTER_BYTES,
    OPTIMIZER_MOMENTS,
    RECOMPUTE,
    REDUCE_BYTES,
    STEP_BYTES,
    Footprint,
    Hardware,
    Held,
    Memory,
    PipelineRank,
    Rates,
    StageShare,
    Traffic,
    Unit,
    UnitPart,
    Workload,
    activation_bytes,
    bubble_fraction,
    chain_inter_fraction,
    combine,
    comm_bytes,
    comm_time,
    distinct_ranks,
    footprint,
    fsdp_units,
    held_costs,
    held_numel,
    in_flight,
    memory_of,
    mesh_geometry,
    node_span,
    pairwise_intra_fraction,
    pipeline_ranks,
    predicted_state_bytes,
    rank_activations,
    rank_memory,
    ranks_held_costs,
    rates,
    ring_inter_fraction,
    seconds,
    share_footprint,
    share_parts,
    stage_share,
    state_bytes,
    step_tokens_per_rank,
    tokens_per_rank,
    token_traffic,
    traffic_of,
    unit_part,
)
from dtensor_moe.tools.planner.report import candidate_dict, explain_choice, table
from dtensor_moe.tools.planner.search import (
    TP_NOTE, Candidate, evaluate, footprint_key, foldings, pipeline_degrees, plan, rates_key,
)

__all__ = [
    "COMPUTE_BYTES", "GiB", "MASTER_BYTES", "OPTIMIZER_MOMENTS", "RECOMPUTE", "REDUCE_BYTES", "STEP_BYTES", "TP_NOTE",
    "Candidate", "Footprint", "Hardware", "Held", "Memory", "PipelineRank", "Rates", "StageShare", "Traffic", "Unit",
    "UnitPart", "Workload", "activation_bytes", "bubble_fraction", "candidate_dict", "chain_inter_fraction", "combine",
    "comm_bytes", "comm_time", "distinct_ranks", "evaluate", "explain_choice", "footprint", "footprint_key", "foldings",
    "fsdp_units", "held_costs", "held_numel", "in_flight", "memory_of", "mesh_geometry", "node_span",
    "pairwise_intra_fraction", "pipeline_degrees", "pipeline_ranks", "plan", "predicted_state_bytes",
    "rank_activations", "rank_memory", "ranks_held_costs", "rates", "rates_key", "ring_inter_fraction", "seconds",
    "share_footprint", "share_parts", "stage_share", "state_bytes", "step_tokens_per_rank", "table", "token_traffic",
    "tokens_per_rank", "traffic_of", "unit_part",
]
