"""Hot-expert replicas (MoERunOptions.expert_replicas) over the unpadded dispatch, TokenDispatch or PairDispatch
(the placement itself: replicas.py).

Each forward: the EP x ETP group all-gathers its per-expert pair counts (one more host sync), every rank computes
the same split of each replicated expert's pairs between owner and replicas (`source_segments`), and the pairs are
re-labelled with virtual slots (a rank's owned experts, then its replica slots), so `exchange_tables` and `ep_move` send
them exactly as they send pairs by expert. Owners send their weight slices (this ETP rank's F slice, the biases
too) to the replica slots over the EP group, one all-to-all (`count_sent_bytes` counts it under
("replica_weights", "there")); the replica rows run through `grouped_swiglu` with those copies, at the same
weight-gradient scale as the owner's rows, and the copies' gradients travel back the same way and add into the
owner's gradient through autograd (the copies are views of the owner's parameters, never parameters themselves:
state dicts and checkpoints hold owners only).
Other experts (torchtitan's, under the hook) get their rows one per pair in expert order: those are sorted by virtual
slot (`relabel_rows`, a stable permutation the combine undoes), and the replica rows run through the experts' own
forward with the copies in place of their parameters (`run_foreign`), so they compute exactly as the owner's rows.

`ReplicaDispatch` wraps the token or pair strategy (dispatch.py) with this: the relabel before its exchange tables,
the replica rows' run after its move, their outputs back beside the owned rows' before its combine.

Placement (which expert each slot holds) changes only every `replan_every` training forwards, from the counts
summed since the last change, and only while no training forward awaits its backward: activation checkpointing
and pipeline schedules recompute a forward with the slots it ran with. The split follows each forward's own
counts. Eager only (the split needs the counts on the host).
"""

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from dtensor_moe.experts import ExpertInput, SwiGLUExperts
from dtensor_moe.grad_scale import ScaleGrad
from dtensor_moe.kernels.expert_autograd import gather_for_compute, grouped_swiglu
from dtensor_moe.kernels.recompute import recomputing
from dtensor_moe.parallel.dispatch import PairDispatch, TokenDispatch
from dtensor_moe.parallel.exchange import all_to_all_rows, gather_host_counts, group_name
from dtensor_moe.parallel.replicas import place_replicas, source_segments
from dtensor_moe.routing.tables import gather_rows, inverse_permutation


class _AllToAll(torch.autograd.Function):
    """Rows over the EP group (split sizes known on the host); the gradient goes back the same way."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (in_splits, out_splits), group
        return all_to_all_rows(x, out_splits, in_splits, group, ("replica_weights", "there"))

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return all_to_all_rows(grad.contiguous(), out_splits, in_splits, ctx.group, ("replica_weights", "back")), \
            *[None] * 3


class _Landmark(torch.autograd.Function):
    """Identity; its backward marks a forward's backward as done (placement may change only between them)."""

    @staticmethod
    def forward(ctx, x, state):
        ctx.state = state
        state.in_flight += 1
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.state.in_flight -= 1
        return grad, None


def _readers(idx: list[int], n: int) -> torch.Tensor:
    """[n, max readers]: the positions of `idx` that read each of n rows (-1: none), for gather_rows."""
    by_row = [[] for _ in range(n)]
    for pos, i in enumerate(idx):
        by_row[i].append(pos)
    width = max(1, max(map(len, by_row), default=1))
    return torch.tensor([row + [-1] * (width - len(row)) for row in by_row], dtype=torch.int64).view(n, width)


class Replicas:
    """One dispatcher's replica slots: the placement in use, the counts since it was made, and the forwards."""

    def __init__(self, r: int, replan_every: int, ep_group, etp_group):
        self.r, self.replan_every = r, replan_every
        self.ep_group = ep_group
        self.names = (group_name(ep_group), group_name(etp_group))  # for the counts' all-gather
        self.ep, self.ep_rank = dist.get_world_size(ep_group), dist.get_rank(ep_group)
        self.etp, self.etp_rank = dist.get_world_size(etp_group), dist.get_rank(etp_group)
        self.slots: tuple[tuple[int, ...], ...] | None = None
        self.summed_E: list[int] | None = None  # pairs per expert since the placement was made
        self.forwards = 0  # training forwards since then
        self.in_flight = 0  # training forwards whose backward has not run
        self.slots_now: tuple[tuple[int, ...], ...] = ()  # this forward's, and whether it counts as a new one
        self.counting = False

    def _group_counts(self, counts_E: torch.Tensor) -> list[list[int]]:
        """[sources][E] pair counts of the EP x ETP group, ETP slice major (one host sync)."""
        stacked = gather_host_counts(counts_E.to(torch.int64).view(1, -1), *self.names)
        return stacked.reshape(self.etp * self.ep, -1).tolist()

    def _placement(self, load_E: list[int], training: bool) -> tuple[tuple[int, ...], ...]:
        """The slots for this forward: re-placed from the counts summed since the last placement once
        `replan_every` training forwards ran and none awaits its backward; other forwards never change them."""
        if self.slots is None or (training and self.forwards >= self.replan_every and self.in_flight == 0):
            self.slots = place_replicas(self.summed_E if self.forwards else load_E, self.ep, self.r)
            self.summed_E, self.forwards = [0] * len(load_E), 0
        if training:
            self.summed_E = [a + b for a, b in zip(self.summed_E, load_E)]
            self.forwards += 1
        return self.slots

    def _segments(self, counts_E: torch.Tensor, training: bool) -> tuple[list[tuple[int, int]], int]:
        """(this rank's (virtual slot, pairs) segments in the order of its expert-major pairs, the virtual slots)."""
        counts_RE = self._group_counts(counts_E)
        # A recomputation (activation checkpointing) is no new forward: it must run with its forward's slots.
        self.counting = training and not recomputing()
        slots = self._placement([sum(c[e] for c in counts_RE) for e in range(len(counts_RE[0]))], self.counting)
        self.slots_now = slots
        E = len(counts_RE[0])
        mine = source_segments(counts_RE, self.ep, slots)[self.etp_rank * self.ep + self.ep_rank]
        return mine, self.ep * (E // self.ep + self.r)

    @staticmethod
    def _slot_order(mine, n_virtual: int, N: int, dev) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(pairs per virtual slot, each of the N expert-major pairs' slot in slot-major order, the stable order
        that sorts the pairs by slot); pairs past the segments (capacity-dropped) get slot n_virtual, last."""
        kept = sum(n for _, n in mine)
        v = torch.tensor([s for s, _ in mine] + [n_virtual], dtype=torch.int64)
        n = torch.tensor([c for _, c in mine] + [N - kept], dtype=torch.int64)
        slot_counts = torch.zeros(n_virtual + 1, dtype=torch.int64).index_add_(0, v, n)[:n_virtual].to(dev)
        slot_N, order_N = torch.sort(torch.repeat_interleave(v.to(dev), n.to(dev), output_size=N), stable=True)
        return slot_counts, slot_N, order_N

    def relabel(self, copies, counts_E: torch.Tensor, training: bool):
        """(slot_counts, slot_N, pair_N, weight_N): the pairs by virtual slot, in slot-major order (capacity-dropped
        pairs, id E, last with id n_virtual), for exchange_tables as if they were pairs by expert."""
        mine, n_virtual = self._segments(counts_E, training)
        slot_counts, slot_N, order_N = self._slot_order(mine, n_virtual, copies.pair_N.shape[0], copies.pair_N.device)
        inv_N = inverse_permutation(order_N)[:, None]
        weight_N = gather_rows(copies.weight_N[:, None], order_N, inv_N)[:, 0]
        return slot_counts, slot_N, copies.pair_N.index_select(0, order_N), weight_N

    def relabel_rows(self, counts_E: torch.Tensor, N: int, training: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(slot_counts, order_N) for N rows given one per pair in expert order (counts_E per expert: torchtitan's
        experts' input): the stable order that groups them by virtual slot, for exchange_tables as rows by expert."""
        mine, n_virtual = self._segments(counts_E, training)
        slot_counts, _, order_N = self._slot_order(mine, n_virtual, N, counts_E.device)
        return slot_counts, order_N

    def weights(self, params: list, dtype: torch.dtype | None) -> list[torch.Tensor | None]:
        """The replica slots' copies of the experts' weights `params` ([r, ...] each, None for an absent one, e.g.
        our experts' biases), this ETP rank's slices, from their owners over the EP group, in `dtype` (our experts:
        the compute dtype, as they cast the owners' weights, so the copies round as they do; None: the parameters'
        own, for experts that cast them in their forward); empty slots are zeros (no rows reach them)."""
        present = [p for p in params if p is not None]
        # The (ep, etp) slice, as the experts take it: under FSDP2 the unsharded parameter; without an experts
        # unit (ExpertParallel(fully_shard=False, gather_in_forward=True)) gathered over EDP here too, its
        # gradient reduce-scattered back.
        local = [w.to_local() if isinstance(w, DTensor) else w for w in map(gather_for_compute, present)]
        E_local = local[0].shape[0]
        owned_flat = torch.cat([w.reshape(E_local, -1) for w in local], 1)
        owned_flat = owned_flat if dtype is None else owned_flat.to(dtype)
        me, slots = self.ep_rank, self.slots_now
        send = [[e % E_local for e in slots[q] if e >= 0 and e // E_local == me] for q in range(self.ep)]
        recv = [[j for j, e in enumerate(slots[me]) if e >= 0 and e // E_local == s] for s in range(self.ep)]
        send_idx = [i for block in send for i in block]
        recv_slot = [j for block in recv for j in block]
        dev = owned_flat.device
        sent = gather_rows(owned_flat, torch.tensor(send_idx, dtype=torch.int64, device=dev),
                           _readers(send_idx, E_local).to(dev))
        got = _AllToAll.apply(sent, [len(b) for b in recv], [len(b) for b in send], self.ep_group)
        got = torch.cat([got, got.new_zeros(1, got.shape[1])])  # empty slots read this zero row
        source = [len(recv_slot)] * self.r
        for i, j in enumerate(recv_slot):
            source[j] = i
        readers = _readers(source, len(recv_slot) + 1)
        readers[-1] = -1  # the zero row's gradient goes nowhere
        slot_flat = gather_rows(got, torch.tensor(source, dtype=torch.int64, device=dev), readers[:, :1].to(dev))
        if slot_flat.requires_grad and self.counting:
            slot_flat = _Landmark.apply(slot_flat, self)
        out, col = [], 0
        for w in local:
            width = w[0].numel()
            out.append(slot_flat[:, col: col + width].reshape(self.r, *w.shape[1:]))
            col += width
        it = iter(out)
        return [None if p is None else next(it) for p in params]

    def run(self, experts: SwiGLUExperts, x_ND, counts_E, host_counts, weight_grad_scale, adds_output_bias):
        """The replica slots' rows through the owners' weights."""
        w13, w2, b13, b2 = self.weights(list(experts.swiglu_weights(x_ND.dtype)), x_ND.dtype)
        biases = None if b13 is None else (b13, b2)
        return grouped_swiglu(x_ND, counts_E, w13, w2, weight_grad_scale=weight_grad_scale,
                              host_counts=host_counts, biases=biases, clamp=experts.clamp, add_b2=adds_output_bias,
                              precision=experts.precision)

    def run_foreign(self, experts, forward, x_RD, counts_E, weight_grad_scale: float):
        """The replica slots' rows through other experts (torchtitan's): `forward(experts, x_RD, counts_E, weights)`
        runs them with `weights` (a copy of each of the module's own parameters, by name) in place of the owned
        ones. Their gradient is scaled as the hooks scale the owned rows' output gradient (`dispatch_hooks`)."""
        names, params = zip(*experts.named_parameters(recurse=False))
        y_RD = forward(experts, x_RD, counts_E, dict(zip(names, self.weights(list(params), None))))
        return y_RD if weight_grad_scale == 1 else ScaleGrad.apply(y_RD, weight_grad_scale)


class _ReplicaExchange:
    """The inner strategy's exchange, the replica slots' outputs, and the pairs to sum (dropless) or the sort to
    undo (expert-order rows)."""

    def __init__(self, inner, y_replicas: torch.Tensor, pairs, unsort):
        self.inner, self.y_replicas, self.pairs, self.unsort = inner, y_replicas, pairs, unsort
        self.rows_per_rank = inner.rows_per_rank


class ReplicaDispatch:
    """Hot-expert replica slots (MoERunOptions.expert_replicas) over a token or pair strategy (TokenDispatch,
    PairDispatch).

    Args:
        inner (TokenDispatch | PairDispatch): the strategy the relabelled pairs travel by (its
            `send_relabelled`; dispatch.DispatchStrategy).
        replicas (Replicas): the slots and their placement.
        replica_forward: for other experts (expert-order rows), `replica_forward(experts, x_RD, counts_E, weights)`
            runs their own math with `weights` (copies of their parameters, by name); None for ours.
    """

    def __init__(self, inner: TokenDispatch | PairDispatch, replicas: Replicas, replica_forward=None):
        self.inner, self.replicas, self.replica_forward = inner, replicas, replica_forward
        self.group = inner.group

    def dispatch(self, x: torch.Tensor, counts_E: torch.Tensor, copies=None, experts=None) -> ExpertInput:
        if torch.compiler.is_compiling():
            raise ValueError("expert_replicas > 0 runs eagerly only (its split needs the counts on the host); "
                             "valid: expert_replicas 0 with torch.compile, or an eager layer")
        g = self.group
        inp, unsort = self.inner.send_relabelled(x, counts_E, copies, self.replicas, experts.training)
        # The replica slots' pairs come after the owned experts' pairs; they run here, the experts get their own,
        # so the pairs are copied out here (the experts' minimal path does not apply).
        x_pairs = inp.x_ND if inp.pairs is None else inp.pairs.expand(inp.x_ND)
        host = inp.host_counts
        E_local = len(host) - self.replicas.r
        n_own = sum(host[:E_local])
        x_rep, counts_rep, scale = x_pairs[n_own:], inp.counts_E[E_local:], g.weight_grad_scale
        y = self.inner.run_replicas(self.replicas, experts, self.replica_forward, x_rep, counts_rep, host[E_local:],
                                    scale, g.adds_output_bias)
        return ExpertInput(x_pairs[:n_own], inp.counts_E[:E_local], host[:E_local], scale,
                           _ReplicaExchange(inp.exchange, y, inp.pairs, unsort), g.adds_output_bias)

    def combine(self, y_local: torch.Tensor, ex: _ReplicaExchange) -> torch.Tensor:
        y_pairs = torch.cat([y_local, ex.y_replicas])
        y = self.inner.combine(y_pairs if ex.pairs is None else ex.pairs.combine(y_pairs), ex.inner)
        return y if ex.unsort is None else gather_rows(y, *ex.unsort)
