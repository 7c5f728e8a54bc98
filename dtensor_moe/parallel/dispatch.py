"""Expert-parallel token dispatch and combine (EP all-to-all, then ETP gather / reduce-scatter).

Each rank sends only its own tokens over its EP group, and each token once per destination rank
however many of its top-k experts live there (at K=8 over EP=2 that is ~2 rows per token, not 8);
the receiver copies it to its experts. Inside the ETP group the received tokens are gathered so
every ETP rank runs the F-sharded GEMMs on all of them, and the partial outputs are
reduce-scattered back. The combine mirrors the dispatch: each rank sums, weighted by the routing
weights, a token's expert outputs that it holds, so the output too travels once per (token, rank).

Two registered ops carry everything torch.compile cannot trace: `dtensor_moe::ep_plan` (the
counts' all-gather, the one host sync per layer for the uneven split sizes, and the integer tables)
and `dtensor_moe::ep_move` (one direction of the row movement; its gradient is the other one).
Everything between them is traceable torch: gathers whose gradients are gather-sums.

Capacity-dropped pairs (TokenCopies puts them last, with expert id E, outside the counts) are
filtered out of the plan: a token none of whose kept pairs goes to a rank is not sent there, and
no dropped pair is sent, received or computed. Their number is known only on the host, after the
sync the split sizes need anyway, so the ops slice them off inside.

FP8 payload (MoEConfig.dispatch_precision "fp8"): the forward's token rows cross as e4m3 with one
fp32 scale per row (kernels/fp8.py's pack_rows: (D + 4) bytes a row, about half of bf16's 2D) and
are dequantized into the activations' dtype on arrival; their gradient travels back unquantized
(DeepEP's and Megatron's choice: gradients have outliers a rowwise scale flattens badly), and the
combine moves outputs in the activations' dtype both ways.

pad_to_capacity (routing.PaddedCopies) takes a second path with static shapes: one row per slot
(every kept pair, not deduplicated by rank, and the padding), E_local * capacity rows to each EP peer
by one `dtensor_moe::pair_move` (equal splits known from the shapes: no counts all-gather, no host
sync), the same ETP gather / reduce-scatter, and the padded rows selected away in the combine. It
needs the same token count on every rank of the EP x ETP group (the static shape it exists for).
"""

import math
import weakref
from typing import NamedTuple

import torch
import torch.distributed as dist

from dtensor_moe.kernels import counters, fp8, policy, recompute
from dtensor_moe.moe import recomputing
from dtensor_moe.parallel.replica_dispatch import Replicas
from dtensor_moe.routing import ExpertInput, PaddedCopies, ScaleGrad, TokenCopies, gather_rows, inverse_permutation

__all__ = ["RowCapExceeded", "ExpertDispatcher", "PlanTables", "count_sent_bytes", "ep_plan", "ep_move", "pair_move"]

_GROUPS: "weakref.WeakValueDictionary[str, dist.ProcessGroup]" = weakref.WeakValueDictionary()
# torch 2.13 names all_gather_single in place of the deprecated all_gather_into_tensor (2.11 has only that).
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _name(group) -> str:
    _GROUPS[group.group_name] = group
    return group.group_name


def count_sent_bytes():
    """A context manager counting the bytes this rank's all-to-alls send to other ranks inside its block, per
    (kind, direction) of ep_move ("plan" for ep_plan's tables, "replica_weights" for the replicas' copies): a
    `collections.Counter`, what the tests and benchmarks read for the payload's size.

    Example::

        with count_sent_bytes() as sent:
            model(x_BLD).sum().backward()
        print(sent[("tokens", "there")])
    """
    return counters.count("sent_bytes")


def _all_to_all(x, out_splits, in_splits, group, key):
    sent = (sum(in_splits) - in_splits[dist.get_rank(group)]) * math.prod(x.shape[1:]) * x.element_size()
    counters.add("sent_bytes", key, sent)
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


class _Rows:
    """One kind of row's sizes: sent to each EP peer, received from each EP source, and held by
    each ETP peer after the EP step."""

    def __init__(self, send, recv, peer):
        self.send, self.recv, self.peer = send, recv, peer


class _Sizes:
    """Every split size of one step, from the all-gathered counts C[p][s][r] (ETP slice p, EP
    source s, EP destination r: rows per local expert of r, then token rows)."""

    def __init__(self, C: list, ep_rank: int, etp_rank: int):
        ep, etp = len(C[0]), len(C)
        sent = C[etp_rank][ep_rank]
        to_me = [[C[p][s][ep_rank] for s in range(ep)] for p in range(etp)]  # per ETP peer, per EP source

        def pairs_of(c):
            return sum(c[:-1])

        self.pairs = _Rows([pairs_of(c) for c in sent], [pairs_of(c) for c in to_me[etp_rank]],
                           [sum(map(pairs_of, peer)) for peer in to_me])
        self.rows = _Rows([c[-1] for c in sent], [c[-1] for c in to_me[etp_rank]],
                          [sum(c[-1] for c in peer) for peer in to_me])
        self.local_counts = [sum(c[e] for peer in to_me for c in peer) for e in range(len(sent[0]) - 1)]
        # Where the block this rank sends to EP rank r starts at r (after lower EP sources' blocks),
        # less where it starts in this rank's send buffer.
        self.shift = [sum(C[etp_rank][s][r][-1] for s in range(ep_rank)) - sum(self.rows.send[:r]) for r in range(ep)]


class _Topology:
    def __init__(self, ep_group: str, etp_group: str):
        self.ep_group, self.etp_group = _GROUPS[ep_group], _GROUPS[etp_group]
        self.ep, self.etp = dist.get_world_size(self.ep_group), dist.get_world_size(self.etp_group)
        self.ep_rank, self.etp_rank = dist.get_rank(self.ep_group), dist.get_rank(self.etp_group)

    def sizes(self, C_host: torch.Tensor) -> _Sizes:
        return _Sizes(C_host.tolist(), self.ep_rank, self.etp_rank)

    def there(self, x, rows: _Rows, key, etp_offset: int = 0):
        """Sender rows -> the rows this rank's ETP group received, peer by peer."""
        if self.ep > 1:
            x = _all_to_all(x, rows.recv, rows.send, self.ep_group, key)
        if self.etp > 1:
            x = _all_to_all((x + etp_offset).repeat(self.etp, *[1] * (x.dim() - 1)), rows.peer,
                            [sum(rows.recv)] * self.etp, self.etp_group, key)
        return x

    def back(self, y, rows: _Rows, key):
        """Rows of this rank's ETP group (partial sums) -> summed, at their sender."""
        if self.etp > 1:
            n_self = sum(rows.recv)
            y = _all_to_all(y, [n_self] * self.etp, rows.peer, self.etp_group, key)
            y = y.view(self.etp, n_self, *y.shape[1:]).sum(0)
        if self.ep > 1:
            y = _all_to_all(y, rows.send, rows.recv, self.ep_group, key)
        return y


@torch.library.custom_op("dtensor_moe::ep_move", mutates_args=())
def ep_move(xs: list[torch.Tensor], C_host: torch.Tensor, kinds: str, direction: str, ep_group: str,
            etp_group: str, lengths: list[int]) -> list[torch.Tensor]:
    """Each xs[i], rows of the i-th comma-separated kind ("rows": tokens, once per destination rank; "pairs": one per
    (token, expert)), moved "there" (sender -> expert ranks) or "back" (expert ranks -> sender, ETP
    partials summed), in list order. lengths[i]: the sender's row count of xs[i]. "there" sends a
    sender's first rows only, as many as its split sizes say (the rest are capacity-dropped
    pairs); "back" returns lengths[i] rows, zeros for those that stayed (their gradient). A kind
    suffixed ":fp8" goes "there" as the FP8 payload, dequantized into its dtype on arrival; "back"
    (its gradient) ignores the suffix.
    Movements whose gradients could otherwise come back in rank-dependent order (a compiled rank
    with no tokens schedules its graph differently) travel in one call, so the backward moves
    them in one call, in one order, too."""
    topo = _Topology(ep_group, etp_group)
    sizes = topo.sizes(C_host)
    out = []
    for x, kind, n in zip(xs, kinds.split(","), lengths, strict=True):
        rows = getattr(sizes, kind.partition(":")[0])
        if direction == "there":
            out.append(_move(topo, x[: sum(rows.send)], rows, kind, direction))
        else:
            y = _move(topo, x, rows, kind, direction)
            out.append(torch.cat([y, y.new_zeros(n - y.shape[0], *y.shape[1:])]) if n > y.shape[0] else y)
    return out


def _move(topo: _Topology, x, rows: _Rows, kind: str, direction: str):
    """One movement of x (see ep_move); the FP8 payload only "there"."""
    key = (kind, direction)
    if direction == "back":
        return topo.back(x, rows, key)
    if kind.endswith(":fp8"):
        return fp8.unpack_rows(topo.there(fp8.pack_rows(x), rows, key), x.dtype)
    return topo.there(x, rows, key)


@ep_move.register_fake
def _(xs, C_host, kinds, direction, ep_group, etp_group, lengths):
    ctx = torch.library.get_ctx()
    if direction == "back":
        return [x.new_empty(n, *x.shape[1:]) for x, n in zip(xs, lengths)]
    return [x.new_empty(ctx.new_dynamic_size(), *x.shape[1:]) for x in xs]


def _move_setup(ctx, inputs, output):
    xs, ctx.C_host, ctx.kinds, direction, ctx.ep_group, ctx.etp_group, _ = inputs
    ctx.reverse = "back" if direction == "there" else "there"
    ctx.lengths = [x.shape[0] for x in xs]


def _move_backward(ctx, grads):
    grads = [g.contiguous() for g in grads]
    return ep_move(grads, ctx.C_host, ctx.kinds, ctx.reverse, ctx.ep_group, ctx.etp_group, ctx.lengths), *[None] * 6


ep_move.register_autograd(_move_backward, setup_context=_move_setup)
recompute.keep(torch.ops.dtensor_moe.ep_move.default)  # communicates


def _equal_rows(topo: _Topology, per_peer: int) -> _Rows:
    return _Rows([per_peer] * topo.ep, [per_peer] * topo.ep, [per_peer * topo.ep] * topo.etp)


@torch.library.custom_op("dtensor_moe::pair_move", mutates_args=())
def pair_move(x: torch.Tensor, rows_per_peer: int, kind: str, direction: str, ep_group: str,
              etp_group: str) -> torch.Tensor:
    """pad_to_capacity's row movement, every split rows_per_peer: "there" [ep * rows_per_peer, ...]
    (block r for EP rank r) -> [etp * ep * rows_per_peer, ...] ordered (ETP peer, EP source); "back"
    the reverse, ETP partials summed. kind "slots", or "slots:fp8" for the FP8 payload (as ep_move's).
    Its gradient is the other direction."""
    topo = _Topology(ep_group, etp_group)
    return _move(topo, x, _equal_rows(topo, rows_per_peer), kind, direction)


@pair_move.register_fake
def _(x, rows_per_peer, kind, direction, ep_group, etp_group):
    topo = _Topology(ep_group, etp_group)
    n = rows_per_peer * topo.ep
    return x.new_empty(n * topo.etp if direction == "there" else n, *x.shape[1:])


def _pair_move_setup(ctx, inputs, output):
    _, ctx.rows_per_peer, ctx.kind, direction, ctx.ep_group, ctx.etp_group = inputs
    ctx.reverse = "back" if direction == "there" else "there"


def _pair_move_backward(ctx, grad):
    grad = pair_move(grad.contiguous(), ctx.rows_per_peer, ctx.kind, ctx.reverse, ctx.ep_group, ctx.etp_group)
    return grad, *[None] * 5


pair_move.register_autograd(_pair_move_backward, setup_context=_pair_move_setup)
recompute.keep(torch.ops.dtensor_moe.pair_move.default)  # communicates


def _gather_counts(counts_RE, topo: _Topology) -> torch.Tensor:
    """[etp, ep, *counts_RE.shape]: every rank gets every count (ep_plan's: [etp, ep, ep, E_local + 1]), so a
    sender knows where its rows land."""
    shape = counts_RE.shape
    for n, group in ((topo.ep, topo.ep_group), (topo.etp, topo.etp_group)):
        if n > 1:  # stacked along dim 0 (the layout every backend accepts)
            out = counts_RE.new_empty(n * counts_RE.shape[0], counts_RE.shape[1])
            _all_gather(out, counts_RE, group=group)
            counts_RE = out
    return counts_RE.view(topo.etp, topo.ep, *shape)


def _expert_major_index(C: torch.Tensor, total: int) -> torch.Tensor:
    """Row of the received buffer, ordered (etp peer, ep source, local expert), that each row of
    the expert-major order reads. Built on the device from the counts."""
    sizes = C.flatten()
    starts = torch.cumsum(sizes, 0) - sizes
    sizes_t = sizes.view(C.shape).permute(2, 0, 1).flatten()
    starts_t = starts.view(C.shape).permute(2, 0, 1).flatten()
    run_start = torch.cumsum(sizes_t, 0) - sizes_t
    offset = torch.repeat_interleave(starts_t - run_start, sizes_t, output_size=total)
    return offset + torch.arange(total, device=C.device)


class PlanTables(NamedTuple):
    """`ep_plan`'s result: one step's exchange tables (a custom op returns a tuple; these are its fields)."""

    C_host: torch.Tensor  # [etp, ep, ep, E_local + 1] on the host: every rank's rows per (ETP slice, source, dest)
    local_counts_E: torch.Tensor  # rows per local expert this rank computes, on the device
    local_counts_host: torch.Tensor  # the same on the host
    idx: torch.Tensor  # received pair order -> expert-major order
    inv: torch.Tensor  # its inverse, [P, 1]
    send_token: torch.Tensor  # with copies: the token each sent row carries (empty without)
    token_rows: torch.Tensor  # with copies: [T, ep] the send row of each (token, destination), -1 for none
    row_idx: torch.Tensor  # with copies: the received row each expert-major pair reads
    row_readers: torch.Tensor  # with copies: [rows, K] the expert-major pairs that read each received row


@torch.library.custom_op("dtensor_moe::ep_plan", mutates_args=())
def ep_plan(counts_E: torch.Tensor, expert_N: torch.Tensor, pair_N: torch.Tensor, num_tokens: int,
            top_k: int, ep_group: str, etp_group: str) -> tuple[(torch.Tensor,) * len(PlanTables._fields)]:
    """One step's tables (`PlanTables`). counts_E: rows per global expert from this rank; with copies (top_k > 0)
    expert_N / pair_N are TokenCopies' (tokens travel once per destination rank), else empty and the rows are
    already one per (token, expert)."""
    topo = _Topology(ep_group, etp_group)
    ep, dev, T, K = topo.ep, counts_E.device, num_tokens, top_k
    counts_E = counts_E.to(torch.int64)
    if K:
        # Destination of each expert-major pair; a dropped pair (id E) is no (rank, token) cell's need.
        rank_N = (expert_N // (counts_E.numel() // ep)).clamp(max=ep - 1)
        cell_N = torch.where(expert_N < counts_E.numel(), rank_N * T + pair_N // K, ep * T)
        need = torch.zeros(ep * T + 1, dtype=torch.bool, device=dev)
        need[cell_N] = True
        need = need[:-1]
        slot = torch.cumsum(need, 0) - 1  # row of each needed (rank, token) in the send buffer
        rows_R = need.view(ep, T).sum(1)
    else:
        rows_R = counts_E.view(ep, -1).sum(1)
    C_dev = _gather_counts(torch.cat([counts_E.view(ep, -1), rows_R[:, None]], 1), topo)
    C_host = C_dev.cpu()  # one host sync, one copy, for all split sizes of the step (fwd and bwd)
    policy.host_synced("split_sizes", dev)
    sz = _Sizes(C_host.tolist(), topo.ep_rank, topo.etp_rank)
    C_mine = C_dev[:, :, topo.ep_rank, :-1]  # [etp, ep, E_local]: what this rank's ETP group receives
    idx = _expert_major_index(C_mine, sum(sz.pairs.peer))  # pair order -> expert-major
    inv = inverse_permutation(idx)[:, None]
    local_counts = torch.tensor(sz.local_counts, dtype=torch.int64)
    if not K:
        return PlanTables(C_host, C_mine.sum((0, 1)), local_counts, idx, inv, idx.new_empty(0), idx.new_empty(0, 1),
                          idx.clone(), inv.clone())
    n_send, n_pairs = sum(sz.rows.send), sum(sz.pairs.send)  # n_pairs: the kept pairs, which come first
    rank_N, cell_N, pair_N = rank_N[:n_pairs], cell_N[:n_pairs], pair_N[:n_pairs]
    # Non-needed cells land in a dummy slot past the end: a scatter, no sort.
    token = torch.arange(T, device=dev).repeat(ep)
    send_token = token.new_empty(n_send + 1).scatter_(0, torch.where(need, slot, n_send), token)[:n_send]
    token_rows = torch.where(need, slot, -1).view(ep, T).t().contiguous()
    # Each pair carries (the received row it reads at its rank, its top-k slot), packed; offset at
    # the receiver by this ETP rank's share of the rows gathered over the ETP group.
    shift_N = torch.tensor(sz.shift, device=dev).index_select(0, rank_N)
    packed = (slot.index_select(0, cell_N) + shift_N) * K + pair_N % K
    row_k = topo.there(
        packed, sz.pairs, ("plan", "there"), etp_offset=sum(sz.rows.peer[: topo.etp_rank]) * K
    ).index_select(0, idx)
    cells = torch.full((sum(sz.rows.peer) * K,), -1, device=dev, dtype=row_k.dtype)
    row_readers = cells.scatter_(0, row_k, torch.arange(row_k.numel(), device=dev)).view(-1, K)
    return PlanTables(C_host, C_mine.sum((0, 1)), local_counts, idx, inv, send_token, token_rows, row_k // K,
                      row_readers)


recompute.keep(torch.ops.dtensor_moe.ep_plan.default)  # communicates (the counts' all-gather, the row tables)


@ep_plan.register_fake
def _(counts_E, expert_N, pair_N, num_tokens, top_k, ep_group, etp_group):
    ctx = torch.library.get_ctx()
    topo = _Topology(ep_group, etp_group)
    E_local = counts_E.numel() // topo.ep
    P = ctx.new_dynamic_size()
    host = torch.empty(topo.etp, topo.ep, topo.ep, E_local + 1, dtype=torch.int64, device="cpu")
    i64 = counts_E.new_empty(0, dtype=torch.int64)
    if not top_k:
        return PlanTables(host, i64.new_empty(E_local), host.new_empty(E_local), i64.new_empty(P), i64.new_empty(P, 1),
                          i64.new_empty(0), i64.new_empty(0, 1), i64.new_empty(P), i64.new_empty(P, 1))
    S, R = ctx.new_dynamic_size(), ctx.new_dynamic_size()
    return PlanTables(host, i64.new_empty(E_local), host.new_empty(E_local), i64.new_empty(P), i64.new_empty(P, 1),
                      i64.new_empty(S), i64.new_empty(num_tokens, topo.ep), i64.new_empty(P),
                      i64.new_empty(R, top_k))


class _Exchange:
    """One step's tables, named: what `dispatch` leaves in ExpertInput.exchange for `combine`."""

    def __init__(self, tables, copies, out_shape, groups):
        t = PlanTables(*tables)
        self.C_host, self.local_counts_E, self.idx, self.inv = t.C_host, t.local_counts_E, t.idx, t.inv
        self.send_token, self.token_rows, self.row_idx, self.row_readers = (t.send_token, t.token_rows, t.row_idx,
                                                                            t.row_readers)
        # The per-expert host counts serve only eager gradient accumulation; a compiled graph has none.
        self.local_counts_host = None if torch.compiler.is_compiling() else t.local_counts_host.tolist()
        self.copies, self.out_shape, self.groups = copies, out_shape, groups
        self.w_local = None  # with copies: the routing weights at the expert ranks, moved with the tokens
        self.y_replicas = None  # with replicas: the replica slots' outputs, after the experts' own rows
        self.unsort = None  # without copies, with replicas: (inverse, readers) of the rows' sort by virtual slot

    def move(self, xs, kinds, direction, lengths=None):
        """lengths: the senders' row counts, for "back" (for "there" they are xs')."""
        return ep_move(xs, self.C_host, kinds, direction, *self.groups, lengths or [x.shape[0] for x in xs])


class _PaddedExchange:
    """pad_to_capacity's step: the layer's slot tables and the static block sizes."""

    def __init__(self, copies: PaddedCopies, out_shape, ep: int, etp: int):
        self.copies, self.out_shape = copies, out_shape
        self.experts = copies.num_experts // ep  # E_local
        self.sources = ep * etp  # blocks each local expert receives, one per (ETP peer, EP source)


def _eager_replicas() -> None:
    if torch.compiler.is_compiling():
        raise ValueError("expert_replicas > 0 runs eagerly only (its split needs the counts on the host); "
                         "valid: expert_replicas 0 with torch.compile, or an eager layer")


class RowCapExceeded(ValueError):
    """Raised when a forward would exceed `MoEConfig.max_rows_per_rank`: an EP rank would compute more
    expert rows than the cap.

    Raised alike on every rank of the EP x ETP group, before the tokens move, with a message naming the
    layer, the forward, the worst EP rank and the rows per EP rank. Ranks of other EP groups do not raise
    and may wait in a later collective, so catch it to report and stop, not to carry on (the main job
    writes a "row cap" stop note and exits). A ValueError: `except ValueError` catches it too.

    Example::

        from dtensor_moe import RowCapExceeded

        try:
            model(tokens).sum().backward()
        except RowCapExceeded as e:
            print(f"stopping: {e}")
            raise  # end the job: other EP groups may be waiting in a collective
    """


class ExpertDispatcher:
    """Moves tokens to the experts that hold their slice and the outputs back.

    Weight gradients: every rank's expert slice sees tokens from its whole EP x ETP group, and
    FSDP then averages over EDP x dp_replicate only, so the weight gradient must be divided by
    EP*ETP (`ep_etp_divisor`; 1 where the reductions sum, as under torchtitan) to equal the gradient of the mean
    loss over all ranks. Our experts take that as
    ExpertInput.weight_grad_scale and apply it to the weight gradients alone; for any other module
    the activation gradient around it is scaled (and unscaled for its input).

    `replicas` > 0 (MoEConfig.expert_replicas; dropless dispatch): that many replica slots per EP rank, placed every
    `replan_every` training forwards (replica_dispatch.py); our experts run the replica rows themselves, other ones
    (rows in expert order, no copies: torchtitan's) through `replica_forward(experts, x_RD, counts_E, weights)`,
    their own math with `weights` (copies of their parameters, by name) in place of theirs. `max_rows_per_rank` > 0: a
    (eager) forward in which any EP rank would compute more rows raises ValueError on every rank of the group
    alike, naming `layer`, the forward and the rows (MoEConfig.max_rows_per_rank).
    """

    def __init__(self, ep_group, etp_group, ep_etp_divisor: float, dispatch_precision: str = "bf16",
                 replicas: int = 0, replan_every: int = 100, max_rows_per_rank: int = 0, layer: str = "an MoE layer",
                 replica_forward=None):
        self.ep_etp_divisor = float(ep_etp_divisor)
        self.replica_forward = replica_forward
        self.replicas = Replicas(replicas, replan_every, ep_group, etp_group) if replicas else None
        self.max_rows_per_rank, self.layer = max_rows_per_rank, layer
        self.forwards = 0  # dispatched forwards, named by the row cap's error
        self.rows_per_rank: list[int] | None = None  # rows each EP rank computed in the last dropless forward
        # The same, summed over the training forwards since `take_rows` (the main job's per-step load metrics).
        self.rows_counted: list[int] | None = None
        self.payload = ":fp8" if dispatch_precision == "fp8" else ""  # MoEConfig.dispatch_precision
        self.groups = (_name(ep_group), _name(etp_group))
        self.adds_output_bias = dist.get_rank(etp_group) == 0
        self.ep, self.etp = dist.get_world_size(ep_group), dist.get_world_size(etp_group)
        self.in_flight: list[ExpertInput] = []
        self.capacity_checked = False  # pad_to_capacity: the group's equal capacities, checked once (eagerly)

    def dispatch(self, x: torch.Tensor, counts_E: torch.Tensor,
                 copies: TokenCopies | PaddedCopies | None = None, experts=None) -> ExpertInput:
        """x: the tokens with their `copies` (they then travel once per rank), or without copies one
        row per (token, expert) pair in expert order (counts_E per global expert either way). Padded
        copies take the static path (_dispatch_padded). `experts`: the module, which replicas need."""
        self.forwards += 1
        if isinstance(copies, PaddedCopies):
            return self._dispatch_padded(x, copies)
        scale = 1.0 / self.ep_etp_divisor
        if copies is not None:
            x_TD = x.reshape(-1, x.shape[-1])
            expert_N, pair_N, weight_N = copies.expert_N, copies.pair_N, copies.weight_N
            if self.replicas is not None:
                _eager_replicas()
                counts_E, expert_N, pair_N, weight_N = self.replicas.relabel(
                    copies, counts_E, self._host_counts, experts.training)
            tables = ep_plan(counts_E, expert_N, pair_N, x_TD.shape[0], copies.weight_TK.shape[1], *self.groups)
            ex = _Exchange(tables, copies, x.shape, self.groups)
            self._check_rows(ex.C_host, experts)
            x_send = gather_rows(x_TD, ex.send_token, ex.token_rows)
            # The routing weights go where the sums are (autograd: they train the router).
            x_recv, w_sent = ex.move([x_send, weight_N[:, None]], f"rows{self.payload},pairs", "there")
            x_local = gather_rows(x_recv, ex.row_idx, ex.row_readers)
            ex.w_local = gather_rows(w_sent, ex.idx, ex.inv)[:, 0]
            if self.replicas is not None:
                return self._run_replicas(x_local, ex, experts, scale)
        else:
            order = None
            if self.replicas is not None:  # the rows sorted by virtual slot (the combine sorts them back)
                _eager_replicas()
                counts_E, order = self.replicas.relabel_rows(counts_E, x.shape[0], self._host_counts, experts.training)
                inv = inverse_permutation(order)
                x = gather_rows(x, order, inv[:, None])
            none = counts_E.new_empty(0, dtype=torch.int64)
            ex = _Exchange(ep_plan(counts_E, none, none, x.shape[0], 0, *self.groups), None, x.shape, self.groups)
            self._check_rows(ex.C_host)
            x_local = gather_rows(ex.move([x], f"pairs{self.payload}", "there")[0], ex.idx, ex.inv)
            if order is not None:
                ex.unsort = (inv, order[:, None])
                return self._run_replicas(x_local, ex, experts, scale)
        return ExpertInput(x_local, ex.local_counts_E, ex.local_counts_host, scale, ex, self.adds_output_bias)

    def _host_counts(self, counts_1E: torch.Tensor) -> torch.Tensor:
        """counts_1E of every rank of the EP x ETP group, on the host: [etp, ep, 1, E]."""
        policy.host_synced("split_sizes", counts_1E.device)  # the split of replicated experts
        return _gather_counts(counts_1E, _Topology(*self.groups)).cpu()

    def _run_replicas(self, x_local: torch.Tensor, ex: _Exchange, experts, scale: float) -> ExpertInput:
        """The replica slots' rows (after the owned experts' rows) run here, their outputs kept for the combine;
        the experts get their own rows."""
        host = ex.local_counts_host
        E_local = len(host) - self.replicas.r
        n_own = sum(host[:E_local])
        if ex.copies is None:  # other experts: their own forward on the copies (the output gradient scaled as theirs)
            ex.y_replicas = self.replicas.run_foreign(experts, self.replica_forward, x_local[n_own:],
                                                      ex.local_counts_E[E_local:], scale, _all_to_all)
        else:
            ex.y_replicas = self.replicas.run(experts, x_local[n_own:], ex.local_counts_E[E_local:], host[E_local:],
                                              scale, self.adds_output_bias, _all_to_all)
        return ExpertInput(x_local[:n_own], ex.local_counts_E[:E_local], host[:E_local], scale, ex,
                           self.adds_output_bias)

    def _check_rows(self, C_host: torch.Tensor, experts=None) -> None:
        """Rows per EP rank from the all-gathered table (the same on every rank of the group, so a cap raises on
        all of them alike, before the tokens move)."""
        if torch.compiler.is_compiling():
            return
        self.rows_per_rank = C_host[..., :-1].sum((0, 1, 3)).tolist()
        if experts is not None and experts.training and not recomputing():
            counted = self.rows_counted or [0] * len(self.rows_per_rank)
            self.rows_counted = [a + b for a, b in zip(counted, self.rows_per_rank)]
        cap = self.max_rows_per_rank
        if cap and max(self.rows_per_rank) > cap:
            worst = max(range(len(self.rows_per_rank)), key=self.rows_per_rank.__getitem__)
            raise RowCapExceeded(
                f"{self.layer}, forward {self.forwards}: EP rank {worst} would compute {self.rows_per_rank[worst]} "
                f"expert rows, more than max_rows_per_rank ({cap}); rows per EP rank {self.rows_per_rank}. Valid: "
                f"a larger max_rows_per_rank (0: no cap), fewer tokens per rank, expert_replicas, or a more "
                f"balanced router")

    def take_rows(self) -> list[int] | None:
        """`rows_counted`, reset: rows per EP rank of the training forwards since the last call."""
        rows, self.rows_counted = self.rows_counted, None
        return rows

    def _dispatch_padded(self, x: torch.Tensor, copies: PaddedCopies) -> ExpertInput:
        if not self.capacity_checked and not torch.compiler.is_compiling():
            self._check_equal_capacity(copies.capacity, x)
        ex = _PaddedExchange(copies, x.shape, self.ep, self.etp)
        C, D = copies.capacity, x.shape[-1]
        x_recv = pair_move(copies.expand(x), ex.experts * C, f"slots{self.payload}", "there", *self.groups)
        # (source, local expert, slot) -> (local expert, source, slot): each expert's rows contiguous.
        x_local = x_recv.view(ex.sources, ex.experts, C, D).transpose(0, 1).reshape(-1, D)
        rows = ex.sources * C
        counts_E = torch.full((ex.experts,), rows, dtype=torch.int64, device=x.device)
        return ExpertInput(x_local, counts_E, [rows] * ex.experts, 1.0 / self.ep_etp_divisor, ex,
                           self.adds_output_bias)

    def _check_equal_capacity(self, capacity: int, x: torch.Tensor) -> None:
        """The static splits assume every rank of the EP x ETP group has the same capacity (the same
        token count): unequal ones would misread rows or hang in the all-to-all. The first padded
        forward all-gathers them once (one counted host sync) and raises naming the ranks' values;
        later forwards trust it, as they must to stay sync-free."""
        caps = []
        for group in (_GROUPS[n] for n in self.groups):
            out = torch.empty(dist.get_world_size(group), dtype=torch.int64, device=x.device)
            _all_gather(out, torch.tensor([capacity], dtype=torch.int64, device=x.device), group=group)
            caps.append(policy.host_list(out, "capacity_check"))
        if any(len(set(c)) > 1 for c in caps):
            raise ValueError(f"pad_to_capacity needs the same token count on every rank of the EP x ETP group (its "
                             f"capacity C = ceil(T*K/E*capacity_factor) sets the static all-to-all splits); capacities "
                             f"over the EP group {caps[0]}, over the ETP group {caps[1]}: give every rank the same "
                             f"number of tokens per forward, or set pad_to_capacity=False")
        self.capacity_checked = True

    def combine(self, y_local: torch.Tensor, inp: ExpertInput) -> torch.Tensor:
        ex = inp.exchange
        if isinstance(ex, _PaddedExchange):
            C, D = ex.copies.capacity, y_local.shape[-1]
            y_sent = y_local.reshape(ex.experts, ex.sources, C, D).transpose(0, 1).reshape(-1, D)
            y_back = pair_move(y_sent, ex.experts * C, "slots", "back", *self.groups)
            return ex.copies.combine(y_back, ex.out_shape)
        if ex.y_replicas is not None:
            y_local = torch.cat([y_local, ex.y_replicas])
        if ex.copies is None:
            y = ex.move([gather_rows(y_local, ex.inv[:, 0], ex.idx[:, None])], "pairs", "back", [ex.out_shape[0]])[0]
            return y if ex.unsort is None else gather_rows(y, *ex.unsort)
        z_rows = torch.ops.dtensor_moe.gather_sum(y_local, ex.row_readers, ex.row_idx, ex.w_local)
        z_back = ex.move([z_rows], "rows", "back", [ex.send_token.shape[0]])[0]
        token_rows = ex.token_rows.view(*ex.out_shape[:-1], ex.token_rows.shape[1])
        return torch.ops.dtensor_moe.gather_sum(z_back, token_rows, ex.send_token, None)

    def hooks(self, ours: bool):
        """(pre, post) forward hooks for the experts module: `dispatch` before it, `combine` after.

        Ours take the ExpertInput, and the post-hook reads the step's exchange from the input it
        was called with. Other experts (torchtitan's) take (rows, counts): their activation
        gradient is scaled instead, and the exchange in flight between the two hooks is the one
        piece of state kept on the dispatcher (`in_flight`, a stack, empty between forwards)."""
        if ours:
            def pre(module, args):
                return (self.dispatch(*args, experts=module),)

            def post(module, args, out):
                return self.combine(out, args[0])
            return pre, post

        def pre_foreign(module, args):
            x, counts_E = args
            # Scaled at the senders' rows (the dispatch is linear), not on the dispatched ones: those are
            # also kept in `in_flight`, and a compiled frame that outputs a tensor and a view of it (ScaleGrad's)
            # rebuilds the view from the tensor outside the graph, without ScaleGrad's backward (torch 2.13).
            scaled = ScaleGrad.apply(x, self.ep_etp_divisor) if self.ep_etp_divisor != 1 else x
            inp = self.dispatch(scaled, counts_E, experts=module)
            self.in_flight.append(inp)
            return inp.x_ND, inp.counts_E

        def post_foreign(module, args, out):
            if self.ep_etp_divisor != 1:
                out = ScaleGrad.apply(out, 1.0 / self.ep_etp_divisor)
            return self.combine(out, self.in_flight.pop())
        return pre_foreign, post_foreign
