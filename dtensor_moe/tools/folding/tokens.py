"""What a folding's tokens cost per unit of a pipeline rank's share: `Rates`, once per folding (a
search: once per `rates_key`), shared by its pipeline ranks (memory.rank_activations and
traffic.token_traffic multiply them by what the rank holds).

Between blocks a rank holds T = seq_len / (cp * tp) tokens of each sequence; attention works on
seq_len / cp of them with n_heads / tp heads. Routed tokens go once to each EP rank holding one of
their experts (`distinct_ranks`, uniform routing), each way. Under skewed routing (`Workload.skew`) the
busiest EP rank sets the step: its routed rows (all-to-all, ETP gather, expert activations) are the
balanced ones times its max / mean rows (`skew.Balance`, with the model's replica slots), and the
replicas add their weight copies (held with the layer's activations, their gradient as large while it
runs backward) and the copies' all-to-all over EP, each way.
"""

import math
from typing import NamedTuple

from dtensor_moe.config import effective_activation_memory
from dtensor_moe.parallel.mesh import MoEParallelDims
from dtensor_moe.tools.folding.cache import CostCache
from dtensor_moe.tools.folding.geometry import chain_inter_fraction, pairwise_intra_fraction, ring_inter_fraction
from dtensor_moe.tools.folding.skew import Balance, balance
from dtensor_moe.tools.folding.workload import Workload, tokens_per_rank
from dtensor_moe.tools.presets import ModelShape

__all__ = ["Rates", "rates", "distinct_ranks"]


def distinct_ranks(num_experts: int, top_k: int, ep: int, groups: int = 1, limited: int = 1) -> float:
    """Expected EP ranks a token's top-k experts land on under uniform routing: the rows the
    dispatch sends per token, and the combine returns. Group-limited routing (`limited` of
    `groups` groups uniformly, then top_k experts uniformly among theirs) sends fewer when the
    groups align with the ranks (each rank inside one group, or holding whole groups): with
    groups == ep at most `limited` ranks. Groups that straddle ranks are priced as ungrouped."""
    if groups % ep and ep % groups:
        groups = limited = 1
    per_rank, per_group = num_experts // ep, num_experts // groups
    pool = limited * per_group

    def hit(candidates: int) -> float:  # P(some of the top_k land on `candidates` of the pool)
        return 1 - math.comb(pool - candidates, top_k) / math.comb(pool, top_k)

    if ep % groups == 0:  # a rank lies inside one group and can be hit only if that group is kept
        return ep * limited / groups * hit(per_rank)
    g = groups // ep  # whole groups per rank, of which j are kept (hypergeometric)
    return ep * sum(math.comb(g, j) * math.comb(groups - g, limited - j) / math.comb(groups, limited)
                    * hit(j * per_group) for j in range(min(g, limited) + 1))


class Rates(NamedTuple):
    """What one folding's tokens cost per unit of a pipeline rank's share (per layer, per send), with
    the node fractions of the groups they cross. Integer products are exact whichever factor comes
    last; the float ones keep the operand order of the per-rank formula."""

    # activations (bytes)
    recompute: bool
    block_input: int  # one layer's saved input per microbatch: T * D * b
    moe_layer: int
    dense_layer: int
    logits: int
    logits_grad: int
    # traffic (bytes per step and unit, and the share of it crossing nodes)
    send: int  # per stage-boundary send per microbatch
    send_inter: float
    routed: float  # dispatched + combined rows per MoE layer, before the ep / etp factor
    ep: int
    ep_inter: float
    etp: int
    etp_inter: float
    seq: int  # per sequence-parallel gather / scatter
    seq_per_layer: int
    tp_inter: float
    kv: int  # per layer
    cp_inter: float
    # skewed routing and hot-expert replicas
    balance: Balance | None  # rows per EP rank under Workload.skew; None: balanced (skew 0)
    replica_copies: int  # one MoE layer's replica slots' weights (bytes); their gradient as many, transient
    replica_sent: int  # the busiest EP rank's replica weight copies per MoE layer per step, both ways (bytes)


def expert_activations(moe, options, dims: MoEParallelDims, ranks_per_token: float) -> float:
    """Elements the routed experts keep for the backward per token of a rank (MoERunOptions.activation_memory;
    docs/parallelism.md, "Activation memory"). After the ETP gather a rank holds etp * top_k pairs per token of
    F/etp-wide hidden activations, so those parts do not depend on etp. standard: per pair the token's copy and
    the expert's output (D each, etp of them) and three F-wide tensors; minimal: per pair the gate / up
    pre-activation (2F), and each token row received once per EP rank it reaches (etp of them; without EP x ETP
    the rows are the layer's own input). `moe`: MoEConfig; `options`: MoERunOptions."""
    k, D, F = moe.top_k, moe.dim, moe.hidden_dim
    if effective_activation_memory(options) == "minimal":
        received = 0 if dims.ep * dims.etp == 1 else dims.etp * D * ranks_per_token
        return k * 2 * F + received
    return k * (2 * dims.etp * D + 3 * F)


def rates(spec: ModelShape, dims: MoEParallelDims, work: Workload, gpus_per_node: int = 8,
          cache: CostCache | None = None) -> Rates:
    """The `Rates` of folding `dims` of `spec` running `work`: activation bytes per layer and microbatch,
    traffic bytes per layer and per stage-boundary send with the share crossing nodes (`gpus_per_node` GPUs a
    node), and the rows per EP rank under skewed routing. `cache`: a search's memo tables (routing statistics,
    replica placement); None computes them afresh."""
    G, b, M, moe = gpus_per_node, work.compute_bytes, work.microbatches, spec.moe
    T, D, k, F = tokens_per_rank(work, dims), spec.dim, moe.top_k, moe.hidden_dim
    recompute = work.activation_checkpoint == "full"
    # Inputs plus outputs of one layer's attention linears per token: attention sees the whole CP
    # part of the sequence (tp times T tokens) with 1/tp of the heads.
    attention = sum(s[0] + s[-1] for _, s in spec.attention if len(s) == 2)
    common = T * b * 3 * D + T * b * attention  # two norm inputs and the residual, plus attention
    skewed = None if not work.skew else balance(moe.num_experts, k, dims.ep, dims.ep * dims.etp * T, work.skew,
                                                work.moe_run.expert_replicas, cache)
    straggler = 1 if skewed is None else skewed.replica_imbalance  # an int 1 keeps the balanced bytes exact
    # A replica slot holds this ETP rank's F slice of w13 (two) and w2 (and of b13, with all of b2).
    slot = 3 * (F // dims.etp) * D + (2 * (F // dims.etp) + D) * moe.expert_biases
    # Dispatch and combine (a token once per rank holding one of its experts, each way) in forward,
    # their reverses in backward, forward again when recomputing.
    routing = moe.num_experts, k, dims.ep, moe.num_expert_groups, moe.num_limited_groups
    ranks_per_token = (distinct_ranks(*routing) if cache is None
                       else cache.distinct_ranks.get_or_make(routing, lambda: distinct_ranks(*routing)))
    rows = 2 * ranks_per_token
    experts = expert_activations(moe, work.moe_run, dims, ranks_per_token) * straggler + 3 * F * moe.num_shared_experts
    # (size, stride) of the groups as mesh_geometry has them (etp innermost, then ep; tp innermost,
    # then cp; stages outermost), without building it: a search has one Rates per rates_key.
    return Rates(
        recompute,
        block_input=T * D * b,
        # fp32 router scores; the replica slots' weight copies, saved for the layer's backward
        moe_layer=common + T * b * experts + T * moe.num_experts * 4 + work.moe_run.expert_replicas * slot * b,
        dense_layer=common + T * b * 3 * spec.dense_hidden_dim,
        # Logits (replicated over tp) and their fp32 copy for the loss per microbatch; one gradient of them.
        logits=T * dims.tp * spec.vocab_size * (b + 4), logits_grad=T * dims.tp * spec.vocab_size * 4,
        send=M * T * D * b,  # hidden states under SP: the rank's T tokens
        send_inter=chain_inter_fraction(dims.pp, dims.stage_size, G),
        routed=M * (2 + recompute) * T * rows * D * b * straggler,
        ep=dims.ep, ep_inter=1 - pairwise_intra_fraction(dims.ep, dims.etp, G),
        etp=dims.etp, etp_inter=1 - pairwise_intra_fraction(dims.etp, 1, G),
        # Sequence parallelism: each block's attention all-gathers its input and reduce-scatters its output
        # (the reverses in backward, again when recomputing); the embedding and the head once each way.
        seq=M * (dims.tp - 1) * T * D * b, seq_per_layer=4 + 2 * recompute,
        tp_inter=ring_inter_fraction(dims.tp, 1, G),
        # The K/V of the CP part (tp * T tokens, 1/tp of the heads) pass to every CP peer.
        kv=M * (3 + recompute) * (dims.cp - 1) * T * spec.kv_width * b,
        cp_inter=ring_inter_fraction(dims.cp, dims.tp, G),
        balance=skewed,
        replica_copies=work.moe_run.expert_replicas * slot * b,
        # Owners send the copies each forward (again when recomputing); their gradients come back.
        replica_sent=0 if skewed is None else M * (2 + recompute) * skewed.copies * slot * b,
    )
