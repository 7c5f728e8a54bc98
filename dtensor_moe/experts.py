"""SwiGLU experts stored stacked: gate and up in one weight, the down projection in torchtitan's layout.

w13 [E, 2, F, D] (w13[:, 0] is torchtitan's w1 / Hugging Face's gate_proj, w13[:, 1] w3 / up_proj), w2 [E, D, F].
Stored together, gate and up are one [E, 2F, D] operand: one GEMM computes both in the forward, one
input-gradient GEMM replaces two and their sum in the backward, one weight-gradient GEMM writes both gradients.
The size-2 dim keeps each half whole under ETP (which splits F, dim 2). With `expert_biases` (gpt-oss) also
b13 [E, 2, F] (added to the gate / up outputs) and b2 [E, D] (added to the w2 output). `activation`
"clamped_swiglu" is gpt-oss's gate (kernels/swiglu.py). The forward and backward are kernels/expert_autograd.py's.
`split_gate_up` / `join_gate_up` move state dicts between this layout and torchtitan's names (w1, w3, b1, b3) for
exports and adapters.
"""

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dtensor_moe.config import effective_activation_memory
from dtensor_moe.kernels.expert_autograd import grouped_swiglu, grouped_swiglu_pairs
from dtensor_moe.routing.tables import PaddedCopies, PairRows, TokenCopies

__all__ = ["GroupedExperts", "SwiGLUExperts", "split_gate_up", "join_gate_up"]


@dataclass(frozen=True)
class ExpertInput:
    """What the experts receive from the expert-parallel dispatcher; they return one output row per input row, in
    the same order.

    x_ND: this rank's rows, grouped by local expert (counts_E[e] rows for local expert e, on the
    device); host_counts: the same counts on the host when the dispatcher has them without a sync
    (eager mode), else None; weight_grad_scale: multiplies only the weight gradients (see
    parallel/dispatch.py); exchange: the strategy's tables for this step, read back by its combine;
    adds_output_bias: whether these experts add their output (w2) bias: the dispatcher sums the
    partial outputs of an ETP group, so exactly one of its ranks adds it; pairs: None where x_ND holds one row
    per pair, else x_ND holds each token once and `pairs` the expert-major pairs over it (counts_E and
    host_counts count pairs): the experts then return each row's routing-weighted sum of its pairs' outputs.
    """

    x_ND: torch.Tensor
    counts_E: torch.Tensor
    host_counts: list[int] | None = None
    weight_grad_scale: float = 1.0
    exchange: Any = None
    adds_output_bias: bool = True
    pairs: PairRows | None = None


def gate_up_halves(key: str) -> tuple[str, str] | None:
    """torchtitan's names of the two halves of our experts' w13 / b13 under state-dict key `key` (`...experts.w1`,
    `...experts.w3`); None for any other key."""
    stem, _, leaf = key.rpartition(".")
    if leaf in ("w13", "b13") and (stem == "experts" or stem.endswith(".experts")):
        return f"{stem}.{leaf[0]}1", f"{stem}.{leaf[0]}3"
    return None


def gate_up_whole(key: str) -> str | None:
    """gate_up_halves' inverse: our w13 / b13 for the key of one of its halves (`...experts.w1` or `.w3`); None for
    any other key."""
    stem, _, leaf = key.rpartition(".")
    whole = f"{stem}.{leaf[0]}13" if leaf in ("w1", "w3", "b1", "b3") else None
    return whole if whole is not None and key in (gate_up_halves(whole) or ()) else None


def split_gate_up(state: dict) -> dict:
    """A state dict with our experts' w13 [E, 2, F, D] / b13 [E, 2, F] under torchtitan's names: w1 and w3 (b1,
    b3) [E, F, D] ([E, F]), views of them (DTensors stay DTensors: dim 1 is never sharded)."""
    out = {}
    for k, t in state.items():
        halves = gate_up_halves(k)
        if halves is None:
            out[k] = t
        else:
            out[halves[0]], out[halves[1]] = t[:, 0], t[:, 1]
    return out


def join_gate_up(state: dict) -> dict:
    """split_gate_up's inverse: torchtitan's w1 / w3 (b1 / b3) stacked into w13 (b13)."""
    out = dict(state)
    for whole in dict.fromkeys(w for w in map(gate_up_whole, state) if w is not None):
        first, second = gate_up_halves(whole)
        if first in state and second in state:
            out[whole] = torch.stack([out.pop(first), out.pop(second)], dim=1)
    return out


class SwiGLUExperts:
    """What the expert-parallel dispatcher and the replicas need of routed experts that run this module's kernels,
    whatever stores their weights: our `GroupedExperts`, or another family's experts module adopted by the torchtitan
    hook (dtensor_moe/titan/experts.py: its parameters, names and shapes stay that family's).

    A subclass provides `swiglu_weights(dtype)` and the attributes `clamp` ((alpha, limit) of the clamped gate, or
    None), `precision` (MoERunOptions.expert_precision) and `activation_memory` (MoERunOptions.activation_memory); the
    forward below is the same for all of them.
    """

    clamp: tuple[float, float] | None = None
    precision: str = "bf16"
    activation_memory: str = "minimal"

    def swiglu_weights(self, dtype: torch.dtype) -> tuple:
        """(w13_E2FD, w2_EDF, b13_E2F, b2_ED) as the kernels take them (biases None where absent): parameters, or
        differentiable views / copies of them whose gradients reach the parameters through autograd. `dtype`: the
        compute dtype, for a subclass that must copy its weights anyway (copying in it costs least)."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor | ExpertInput, counts_E: torch.Tensor | None = None,
                copies: TokenCopies | PaddedCopies | None = None) -> torch.Tensor:
        """Tokens x with their routing `copies`: copied into expert order, run, combined back into
        x's shape. Or, from the expert-parallel dispatcher, an `ExpertInput` (rows already grouped
        by local expert): returns one output row per input row."""
        if isinstance(x, ExpertInput):
            opts = dict(weight_grad_scale=x.weight_grad_scale, host_counts=x.host_counts, add_b2=x.adds_output_bias)
            if x.pairs is None:
                return self._rows(x.x_ND, x.counts_E, **opts)
            return self._pairs(x.x_ND, x.pairs, x.counts_E, **opts)
        counts_E, host_counts = copies.expert_blocks(counts_E)
        if isinstance(copies, TokenCopies):
            return self._pairs(x.reshape(-1, x.shape[-1]), copies.pair_rows(x.shape), counts_E, host_counts=host_counts)
        return copies.combine(self._rows(copies.expand(x), counts_E, host_counts=host_counts), x.shape)

    def _kernel_inputs(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, dict]:
        w13, w2, b13, b2 = self.swiglu_weights(dtype)
        return w13, w2, dict(biases=None if b13 is None else (b13, b2), clamp=self.clamp, precision=self.precision)

    def _rows(self, x_ND, counts_E, **opts) -> torch.Tensor:
        """One output row per row of x_ND (grouped by expert)."""
        w13, w2, kernel = self._kernel_inputs(x_ND.dtype)
        return grouped_swiglu(x_ND, counts_E, w13, w2, **opts, **kernel)

    def _pairs(self, x_RD, pairs: PairRows, counts_E, **opts) -> torch.Tensor:
        """Each row's weighted sum of its pairs' outputs: the pairs copied, run and summed (standard), or
        grouped_swiglu_pairs (minimal)."""
        if self.activation_memory == "minimal":
            w13, w2, kernel = self._kernel_inputs(x_RD.dtype)
            return grouped_swiglu_pairs(x_RD, pairs, counts_E, w13, w2, **opts, **kernel)
        return pairs.combine(self._rows(pairs.expand(x_RD), counts_E, **opts))


class GroupedExperts(SwiGLUExperts, nn.Module):
    """The routed experts of one MoE layer: `num_experts` SwiGLU feed-forwards stored stacked and run as
    grouped GEMMs over rows grouped by expert.

    Parameters: w13 [E, 2, F, D] (gate and up; w13[:, 0] is torchtitan's w1 / Hugging Face's gate_proj,
    w13[:, 1] w3 / up_proj), w2 [E, D, F] (down), and with `biases` b13 [E, 2, F] and b2 [E, D]. Under
    `parallelize_moe` they become DTensors (E over EP, F over ETP, FSDP2 over EDP) and the forward takes
    an `ExpertInput` from the expert-parallel dispatcher. `MoE` builds one from its config
    (`GroupedExperts.from_config`); the weights are uninitialized until `reset_parameters()`.

    Args:
        dim (int): the model dim D.
        hidden_dim (int): each expert's hidden dim F.
        num_experts (int): the experts E.
        biases (bool): add gpt-oss's per-expert biases b13 (gate / up outputs) and b2 (down output).
            Default False.
        clamp (tuple[float, float] | None): (alpha, limit) of gpt-oss's clamped SwiGLU, None for plain
            SwiGLU. Default None.
        precision (str): the GEMMs' precision, `MoERunOptions.expert_precision`: "bf16" or "fp8".
            Default "bf16".
        activation_memory (str): what the backward keeps, `MoERunOptions.activation_memory`: "standard" (every
            intermediate) or "minimal" (the token rows once and the gate / up pre-activation). Default "minimal".

    Forward: `experts(x, counts_E, copies)` copies tokens x [..., D] into expert order by their routing
    `copies` (`routing.TokenCopies` / `PaddedCopies`), runs them and combines the outputs into x's shape;
    `experts(expert_input)` returns one output row per row of an `ExpertInput`.

    Example:
        >>> import torch
        >>> from dtensor_moe import GroupedExperts, grouped_swiglu
        >>> experts = GroupedExperts(dim=16, hidden_dim=32, num_experts=4)
        >>> experts.reset_parameters()
        >>> counts_E = torch.tensor([3, 0, 2, 1])  # rows per expert, rows grouped by expert
        >>> y_ND = grouped_swiglu(torch.randn(6, 16), counts_E, experts.w13, experts.w2)
        >>> y_ND.shape
        torch.Size([6, 16])
    """

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, biases: bool = False,
                 clamp: tuple[float, float] | None = None, precision: str = "bf16",
                 activation_memory: str = "minimal"):
        super().__init__()
        self.activation_memory = activation_memory
        self.num_experts = num_experts
        self.clamp = clamp
        self.precision = precision
        self.w13 = nn.Parameter(torch.empty(num_experts, 2, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        if biases:
            self.b13 = nn.Parameter(torch.empty(num_experts, 2, hidden_dim))
            self.b2 = nn.Parameter(torch.empty(num_experts, dim))
        else:
            self.b13 = self.b2 = None

    @classmethod
    def from_config(cls, config, options) -> "GroupedExperts":
        """The experts of a layer of `config` (MoEConfig) run with `options` (MoERunOptions)."""
        clamp = (config.swiglu_alpha, config.swiglu_limit) if config.activation == "clamped_swiglu" else None
        return cls(config.dim, config.hidden_dim, config.num_experts, config.expert_biases, clamp,
                   options.expert_precision, effective_activation_memory(options))

    def swiglu_weights(self, dtype: torch.dtype) -> tuple:
        return self.w13, self.w2, self.b13, self.b2

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02):
        # torchtitan's order (w1, w2, w3), each drawn whole: the same seed gives the same weights in either layout
        # (a strided half draws its numbers in another order).
        for w in (self.w13[:, 0], self.w2, self.w13[:, 1]):
            w.copy_(nn.init.trunc_normal_(torch.empty_like(w, memory_format=torch.contiguous_format), std=std))
        for b in (self.b13, self.b2):
            if b is not None:
                nn.init.zeros_(b)
