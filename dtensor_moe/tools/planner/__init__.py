"""`dtensor-moe plan`: choose the folding (dp_replicate, dp_shard, cp; edp, ep, etp) from memory and traffic.

- `cost_model`: inputs (`Workload`, `Hardware`), FSDP units and rank 0's footprint from the
  placement plan, memory per rank, bytes sent per step split intra-/inter-node, and
  `predicted_state_bytes` (the training loop's check of the planner against measured bytes).
- `search`: enumerate the foldings (dense tp within a node), evaluate each (`Candidate`), rank them (`plan`).
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
    Memory,
    Traffic,
    Unit,
    Workload,
    activation_bytes,
    comm_bytes,
    distinct_ranks,
    footprint,
    fsdp_units,
    held_numel,
    mesh_geometry,
    node_span,
    pairwise_intra_fraction,
    predicted_state_bytes,
    rank_memory,
    ring_inter_fraction,
    state_bytes,
    tokens_per_rank,
)
from dtensor_moe.tools.planner.report import candidate_dict, explain_choice, table
from dtensor_moe.tools.planner.search import TP_NOTE, Candidate, evaluate, footprint_key, foldings, plan

__all__ = [
    "COMPUTE_BYTES", "GiB", "MASTER_BYTES", "OPTIMIZER_MOMENTS", "RECOMPUTE", "REDUCE_BYTES", "STEP_BYTES", "TP_NOTE",
    "Candidate", "Footprint", "Hardware", "Memory", "Traffic", "Unit", "Workload",
    "activation_bytes", "candidate_dict", "comm_bytes", "distinct_ranks", "evaluate", "explain_choice", "footprint",
    "footprint_key", "foldings", "fsdp_units", "held_numel", "mesh_geometry", "node_span", "pairwise_intra_fraction",
    "plan", "predicted_state_bytes", "rank_memory", "ring_inter_fraction", "state_bytes", "table", "tokens_per_rank",
]
