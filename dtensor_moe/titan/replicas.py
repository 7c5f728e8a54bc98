"""Hot-expert replicas through the hook: `--dtensor_moe.run.expert_replicas R` (with `replica_replan_every`) and the
row cap `--dtensor_moe.run.max_rows_per_rank M`, the MoERunOptions fields of the same names.

torchtitan's experts take one row per (token, expert) pair in expert order. With replicas the dispatcher sorts
those rows by virtual slot (stably; its combine sorts them back), so the replica slots' rows travel as any
expert's, and runs them through `replica_forward`: the experts' own forward (torchtitan's `GroupedExperts`, its
bfloat16 casts and `_grouped_mm` seam, or gpt-oss's `GptOssGroupedExperts` and the hook's `finish`) with the slots'
copies of the owners' parameters in their place. So a row computes exactly as at its owner, and the copies'
gradients go back to the owners through autograd (parallel/replica_dispatch.py); no parameter is added, so the
state dict, DCP checkpoints and Hugging Face adapters see the owners only.
"""


from torch import nn

from .gpt_oss import finish, is_gpt_oss


def replica_forward(experts: nn.Module, x_RD, counts_E, weights: dict, etp: int):
    """`experts`' forward on the rows of its replica slots with `weights` (a copy of each of its parameters, by
    name) in place of its own, swapped in for the call only. Called from the dispatcher's pre-hook, so no module
    hook runs (gpt-oss's row hook is applied here, to the copies' bias)."""
    saved = {name: experts._parameters[name] for name in weights}
    experts._parameters.update(weights)
    try:
        out_RD = experts.forward(x_RD, counts_E)
        return finish(experts, x_RD, counts_E, out_RD, etp) if is_gpt_oss(experts) else out_RD
    finally:
        experts._parameters.update(saved)
