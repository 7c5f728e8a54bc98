"""The expert-parallel exchange at the op boundary: the registered ops every dispatch strategy moves rows with.

`dtensor_moe::exchange_tables` does what torch.compile cannot trace of a dropless step: the counts' all-gather, the one
host sync per layer for the uneven split sizes, and the integer tables (`ExchangeTables`). `dtensor_moe::ep_move`
moves rows one direction over the EP group and then the ETP group (its gradient is the other direction);
`dtensor_moe::pair_move` is the same with equal split sizes known from the shapes (pad_to_capacity: no sync).
Everything between them is traceable torch (dispatch.py): gathers whose gradients are gather-sums.

Each sender's rows go to each EP peer in one block (the split sizes); inside the ETP group the received rows are
gathered so every ETP rank runs its F-slice of the GEMMs on all of them, and the partial outputs are
reduce-scattered back ("back" sums the ETP partials). A kind suffixed ":fp8" crosses "there" as the FP8 payload
(kernels/fp8.py's pack_rows: e4m3 with one fp32 scale per row, (D + 4) bytes a row, about half of bf16's 2D),
dequantized on arrival; its gradient travels back unquantized (DeepEP's and Megatron's choice: gradients have
outliers a rowwise scale flattens badly).
"""

import math
import weakref
from typing import NamedTuple

import torch
import torch.distributed as dist

from dtensor_moe.kernels import counters, fp8, policy, recompute
from dtensor_moe.routing.tables import inverse_permutation

__all__ = ["ExchangeTables", "all_gather", "all_to_all_rows", "count_sent_bytes", "ep_move", "exchange_tables",
           "gather_host_counts", "group_name", "pair_move"]

_GROUPS: "weakref.WeakValueDictionary[str, dist.ProcessGroup]" = weakref.WeakValueDictionary()
# torch 2.13 names all_gather_single in place of the deprecated all_gather_into_tensor (2.11 has only that).
all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def group_name(group) -> str:
    """The name the ops take for a process group (they find the group by it)."""
    _GROUPS[group.group_name] = group
    return group.group_name


def count_sent_bytes():
    """A context manager counting the bytes this rank's all-to-alls send to other ranks inside its block, per
    (kind, direction) of ep_move ("tables" for exchange_tables' result, "replica_weights" for the replicas' copies): a
    `collections.Counter`, what the tests and benchmarks read for the payload's size.

    Example::

        with count_sent_bytes() as sent:
            model(x_BLD).sum().backward()
        print(sent[("tokens", "there")])
    """
    return counters.count("sent_bytes")


def all_to_all_rows(x, out_splits, in_splits, group, key):
    """x's rows over `group` by split sizes known on the host, the bytes sent counted under `key`."""
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
            x = all_to_all_rows(x, rows.recv, rows.send, self.ep_group, key)
        if self.etp > 1:
            x = all_to_all_rows((x + etp_offset).repeat(self.etp, *[1] * (x.dim() - 1)), rows.peer,
                            [sum(rows.recv)] * self.etp, self.etp_group, key)
        return x

    def back(self, y, rows: _Rows, key):
        """Rows of this rank's ETP group (partial sums) -> summed, at their sender."""
        if self.etp > 1:
            n_self = sum(rows.recv)
            y = all_to_all_rows(y, [n_self] * self.etp, rows.peer, self.etp_group, key)
            y = y.view(self.etp, n_self, *y.shape[1:]).sum(0)
        if self.ep > 1:
            y = all_to_all_rows(y, rows.send, rows.recv, self.ep_group, key)
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
    """[etp, ep, *counts_RE.shape]: every rank gets every count (exchange_tables': [etp, ep, ep, E_local + 1]), so a
    sender knows where its rows land."""
    shape = counts_RE.shape
    for n, group in ((topo.ep, topo.ep_group), (topo.etp, topo.etp_group)):
        if n > 1:  # stacked along dim 0 (the layout every backend accepts)
            out = counts_RE.new_empty(n * counts_RE.shape[0], counts_RE.shape[1])
            all_gather(out, counts_RE, group=group)
            counts_RE = out
    return counts_RE.view(topo.etp, topo.ep, *shape)


def gather_host_counts(counts_1E: torch.Tensor, ep_group: str, etp_group: str) -> torch.Tensor:
    """counts_1E of every rank of the EP x ETP group, on the host: [etp, ep, 1, E] (one counted host sync)."""
    policy.host_synced("split_sizes", counts_1E.device)
    return _gather_counts(counts_1E, _Topology(ep_group, etp_group)).cpu()


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


class ExchangeTables(NamedTuple):
    """`exchange_tables`'s result: one step's exchange tables (a custom op returns a tuple; these are its fields)."""

    C_host: torch.Tensor  # [etp, ep, ep, E_local + 1] on the host: every rank's rows per (ETP slice, source, dest)
    local_counts_E: torch.Tensor  # rows per local expert this rank computes, on the device
    local_counts_host: torch.Tensor  # the same on the host
    idx: torch.Tensor  # received pair order -> expert-major order
    inv: torch.Tensor  # its inverse, [P, 1]
    send_token: torch.Tensor  # with copies: the token each sent row carries (empty without)
    token_rows: torch.Tensor  # with copies: [T, ep] the send row of each (token, destination), -1 for none
    row_idx: torch.Tensor  # with copies: the received row each expert-major pair reads
    row_readers: torch.Tensor  # with copies: [rows, K] the expert-major pairs that read each received row


@torch.library.custom_op("dtensor_moe::exchange_tables", mutates_args=())
def exchange_tables(counts_E: torch.Tensor, expert_N: torch.Tensor, pair_N: torch.Tensor, num_tokens: int,
            top_k: int, ep_group: str, etp_group: str) -> tuple[(torch.Tensor,) * len(ExchangeTables._fields)]:
    """One step's tables (`ExchangeTables`). counts_E: rows per global expert from this rank; with copies (top_k > 0)
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
        return ExchangeTables(C_host, C_mine.sum((0, 1)), local_counts, idx, inv, idx.new_empty(0), idx.new_empty(0, 1),
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
        packed, sz.pairs, ("tables", "there"), etp_offset=sum(sz.rows.peer[: topo.etp_rank]) * K
    ).index_select(0, idx)
    cells = torch.full((sum(sz.rows.peer) * K,), -1, device=dev, dtype=row_k.dtype)
    row_readers = cells.scatter_(0, row_k, torch.arange(row_k.numel(), device=dev)).view(-1, K)
    return ExchangeTables(C_host, C_mine.sum((0, 1)), local_counts, idx, inv, send_token, token_rows, row_k // K,
                          row_readers)


recompute.keep(torch.ops.dtensor_moe.exchange_tables.default)  # communicates (the counts' all-gather, the row tables)


@exchange_tables.register_fake
def _(counts_E, expert_N, pair_N, num_tokens, top_k, ep_group, etp_group):
    ctx = torch.library.get_ctx()
    topo = _Topology(ep_group, etp_group)
    E_local = counts_E.numel() // topo.ep
    P = ctx.new_dynamic_size()
    host = torch.empty(topo.etp, topo.ep, topo.ep, E_local + 1, dtype=torch.int64, device="cpu")
    i64 = counts_E.new_empty(0, dtype=torch.int64)
    if not top_k:
        return ExchangeTables(host, i64.new_empty(E_local), host.new_empty(E_local), i64.new_empty(P),
                              i64.new_empty(P, 1), i64.new_empty(0), i64.new_empty(0, 1), i64.new_empty(P),
                              i64.new_empty(P, 1))
    S, R = ctx.new_dynamic_size(), ctx.new_dynamic_size()
    return ExchangeTables(host, i64.new_empty(E_local), host.new_empty(E_local), i64.new_empty(P),
                          i64.new_empty(P, 1), i64.new_empty(S), i64.new_empty(num_tokens, topo.ep),
                          i64.new_empty(P), i64.new_empty(R, top_k))
