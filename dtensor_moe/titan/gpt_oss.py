"""gpt-oss's experts (torchtitan's `GptOssGroupedExperts`) under our placement plan.

They hold gate and up in one weight, interleaved along 2F (`mlp1_weight_EGD` row 2i is gate unit i, row
2i + 1 up unit i), each with a bias (`mlp1_bias_EG`), and the down projection with its bias (`mlp2_bias_ED`),
through gpt-oss's clamped SwiGLU. Our plan of an MoE with expert biases (`MoEConfig.expert_biases`) splits
w1 / w3 and b1 / b3 along F over ETP: the fused weight and bias take w1's and b1's placement along 2F, where a
contiguous slice of 2F / etp rows is F / etp whole (gate, up) pairs, the same F slice w2's placement gives the
rank. The down bias is replicated over ETP, as b2 is. ETP sums the ranks' partial outputs, and each rank's
experts add the whole bias, so each rank takes (etp - 1) / etp of it back out in the forward only
(`finish_rows`): every ETP rank's bias gradient stays the whole one, as under torchtitan's own TP (its
`ScaleBiasForward`).
"""

from dataclasses import replace

import torch
from torch.distributed.tensor import DTensor
from torchtitan.models.gpt_oss.moe import GptOssGroupedExperts

from dtensor_moe.parallel.placement import WeightPlan

# Plan names (dtensor_moe's MoE) -> gpt-oss's, relative to the experts module; w3 and b3 are mlp1's odd rows.
_NAMES = {"experts.w1": "mlp1_weight_EGD", "experts.b1": "mlp1_bias_EG", "experts.w2": "mlp2_weight_EDF",
          "experts.b2": "mlp2_bias_ED"}
_FUSED = ("experts.w1", "experts.b1")  # F -> 2F along dim 1
_IN_MLP1 = ("experts.w3", "experts.b3")


def is_gpt_oss(experts) -> bool:
    return isinstance(experts, GptOssGroupedExperts)


def expert_dims(experts) -> tuple[int, int, int]:
    """(E, F, D) of gpt-oss's experts (mlp1 has 2F rows)."""
    E, G, D = experts.mlp1_weight_EGD.shape
    return E, G // 2, D


def moe_fields(experts) -> dict:
    """MoEConfig fields of gpt-oss's experts: biases, and torchtitan's clamped SwiGLU (its alpha is fixed)."""
    return dict(expert_biases=True, activation="clamped_swiglu", swiglu_alpha=1.702, swiglu_limit=experts.swiglu_limit)


def _twice_dim1(shape: tuple[int, ...]) -> tuple[int, ...]:
    return (shape[0], 2 * shape[1], *shape[2:])


def gpt_oss_plans(plans: tuple[WeightPlan, ...], experts_path: str) -> tuple[WeightPlan, ...]:
    """`plans` (plan_moe's, expert biases on) under gpt-oss's names. The fused weights double w1's / b1's dim 1
    in both shapes: the local shape is exact because EDP's FSDP dim is one that F / etp splits evenly (or
    another dim), so 2F / etp splits the same way."""
    out = []
    for wp in plans:
        if wp.name in _IN_MLP1:
            continue
        if wp.name in _FUSED:
            wp = replace(wp, global_shape=_twice_dim1(wp.global_shape), local_shape=_twice_dim1(wp.local_shape))
        if wp.name in _NAMES:
            wp = replace(wp, name=f"{experts_path}.{_NAMES[wp.name]}")
        out.append(wp)
    return tuple(out)


def finish_rows(experts: GptOssGroupedExperts, etp: int) -> None:
    """A forward hook ahead of the dispatcher's combine: `finish` on the experts' rows."""
    experts.register_forward_hook(lambda module, args, out_RD: finish(module, *args, out_RD, etp), prepend=True)


def finish(module: GptOssGroupedExperts, x_RD, counts_E, out_RD, etp: int):
    """gpt-oss's expert rows as the dispatcher combines them. torchtitan's gpt-oss experts return bfloat16 rows
    whatever their input (its grouped experts return the input's dtype): under float32 parameters torchtitan's
    own combine would fail (scatter_add of bfloat16 rows into float32), so the rows come back in the input's
    dtype. Under ETP the ranks' outputs are summed: each rank keeps 1 / etp of the down bias it added (the
    subtracted part is detached, so the bias gradient stays whole). Replica rows (titan/replicas.py) take it too,
    with their copy of the bias in the module's place."""
    out_RD = out_RD.to(x_RD.dtype)
    if etp == 1:
        return out_RD
    b_ED = module.mlp2_bias_ED
    b_ED = b_ED.to_local() if isinstance(b_ED, DTensor) else b_ED
    counts = counts_E.long()
    # Rows past the experts' (padding) get no bias, as in torchtitan's forward.
    slack = (x_RD.shape[0] - counts.sum()).reshape(1)
    b_RD = torch.cat([b_ED, b_ED.new_zeros(1, b_ED.shape[1])]).repeat_interleave(
        torch.cat([counts, slack]), dim=0, output_size=x_RD.shape[0])
    # torchtitan adds the bias rounded to its rows' dtype: the same share of that comes back out.
    return out_RD - ((1.0 - 1.0 / etp) * b_RD.to(torch.bfloat16)).detach().to(out_RD.dtype)
