"""`--dtensor_moe.experts ours` (the default): dtensor_moe's routed experts inside torchtitan's MoE.

torchtitan's router, its load-balancing count (`tokens_per_expert_E`, which moves the aux-loss-free bias) and its
shared experts stay torchtitan's. From the router's choice to the combined output it is ours: the choices become our
routing tables (`TokenCopies`), `TokenDispatch` moves each token once per EP x ETP rank that holds one of its
experts, and our grouped SwiGLU kernels run the experts (`activation_memory` "minimal" by default, FP8 experts and
payload, the Triton weight-gradient kernels where kernels/policy.py picks them).

Nothing is added to the model and nothing renamed: torchtitan's experts module keeps its own parameters (w1_EFD,
w2_EDF, w3_EFD; gpt-oss's interleaved mlp1 and its biases), so DCP checkpoints, torchtitan's Hugging Face adapters
and a run with `--dtensor_moe.experts titan` see the same state dict, and the same seed gives the same weights.
`adopt` gives the existing modules a subclass (as FSDP2's `fully_shard` does): torchtitan's class stays a base, so
its weight initialization and every isinstance check still see its own module. Our kernels take gate and up as one
[E, 2, F, D] operand: torchtitan's w1 and w3 are stacked into it in the compute dtype each forward (a copy of the
size its own experts' bfloat16 casts make), gpt-oss's interleaved mlp1 is viewed as it (no copy).
"""

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from dtensor_moe.config import MoEConfig, MoERunOptions, effective_activation_memory
from dtensor_moe.experts import SwiGLUExperts
from dtensor_moe.routing.tables import TokenCopies, expert_major

from .gpt_oss import is_gpt_oss

EXPERTS = ("ours", "titan")  # --dtensor_moe.experts


def _local(w: torch.Tensor) -> torch.Tensor:
    """This rank's slice (differentiable: its gradient goes back to the DTensor parameter)."""
    return w.to_local() if isinstance(w, DTensor) else w


class _TitanSwiGLU(SwiGLUExperts):
    """torchtitan's GroupedExperts (w1_EFD, w2_EDF, w3_EFD) run by our kernels."""

    def swiglu_weights(self, dtype: torch.dtype) -> tuple:
        w1, w3 = (_local(w).to(dtype) for w in (self.w1_EFD, self.w3_EFD))
        return torch.stack([w1, w3], dim=1), self.w2_EDF, None, None


class _GptOssSwiGLU(SwiGLUExperts):
    """torchtitan's GptOssGroupedExperts: mlp1's rows 2i / 2i + 1 (gate / up unit i) viewed as [E, 2, F, D], its bias
    as [E, 2, F]; the down bias is b2, added by one rank of an ETP group (the dispatcher sums their outputs)."""

    def swiglu_weights(self, dtype: torch.dtype) -> tuple:
        w, b = _local(self.mlp1_weight_EGD), _local(self.mlp1_bias_EG)
        E, G, D = w.shape
        return (w.view(E, G // 2, 2, D).transpose(1, 2), self.mlp2_weight_EDF, b.view(E, G // 2, 2).transpose(1, 2),
                self.mlp2_bias_ED)


class _OurRouting:
    """Over torchtitan's RoutedExperts: our routing tables in place of its token dispatcher: the router's choices and
    weights go to the experts as `TokenCopies` (dropped pairs, expert id E from --dtensor_moe.run.round_tokens_to, are
    neither sent nor computed under EP / ETP)."""

    def forward(self, x_BLD, topk_scores_BLK, topk_expert_ids_BLK, num_local_tokens_per_expert_E):
        K = topk_expert_ids_BLK.shape[-1]
        sorted_N, order_N, counts_E = expert_major(topk_expert_ids_BLK.reshape(-1), self.inner_experts.num_experts)
        copies = TokenCopies.build(order_N, sorted_N, topk_scores_BLK.reshape(-1, K))
        return self.inner_experts(x_BLD, counts_E, copies)


_SUBCLASSES: dict[tuple[type, type], type] = {}


def _swap_class(module: nn.Module, ours: type) -> None:
    """`module` becomes an instance of (ours, its class), one such class per pair (as fully_shard's FSDP classes)."""
    base = type(module)
    cls = _SUBCLASSES.get((ours, base))
    if cls is None:
        cls = _SUBCLASSES[(ours, base)] = type(base.__name__, (ours, base), {"__module__": __name__})
    module.__class__ = cls


def adopt(moe: nn.Module, config: MoEConfig, options: MoERunOptions) -> None:
    """torchtitan MoE `moe`'s routed experts computed by ours, with `options`' expert_precision and activation_memory
    and `config`'s (gpt-oss) clamped gate. Before the placement: `shard_moe_layer` then hooks `TokenDispatch`
    on them."""
    routed = moe.routed_experts
    experts = routed.inner_experts
    _swap_class(experts, _GptOssSwiGLU if is_gpt_oss(experts) else _TitanSwiGLU)
    experts.precision, experts.activation_memory = options.expert_precision, effective_activation_memory(options)
    experts.clamp = (config.swiglu_alpha, config.swiglu_limit) if config.activation == "clamped_swiglu" else None
    _swap_class(routed, _OurRouting)
