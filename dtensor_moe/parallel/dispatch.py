"""Expert-parallel dispatch: one class per communication strategy, each exchange tables -> move -> (experts) ->
combine.

A strategy moves a layer's tokens to the EP x ETP ranks that hold their experts' slices (`dispatch`, returning the
rows this rank's experts compute as an `ExpertInput`) and the outputs back (`combine`), with the ops of
exchange.py. One per way the rows are laid out:

- `TokenDispatch` (our experts, `routing.TokenCopies`): each rank sends only its own tokens, each once per
  destination rank however many of its top-k experts live there (at K=8 over EP=2 about 2 rows per token, not 8);
  the receiver copies it to its experts, and the combine sums there, weighted by the routing weights, the outputs
  of a token's experts it holds, so the output too travels once per (token, rank). Capacity-dropped pairs (id E,
  last) are neither sent nor computed: `exchange_tables` slices them off.
- `PairDispatch` (other experts, e.g. torchtitan's, which take one row per (token, expert) pair in expert
  order and the counts): the rows travel one per pair.
- `SlotDispatch` (pad_to_capacity, `routing.PaddedCopies`): static shapes, one row per slot, equal splits known
  from the shapes: no counts all-gather, no host sync. It needs the same token count on every rank of the group.
- `ReplicaDispatch` (replica_dispatch.py): hot-expert replica slots over a token or pair strategy.

Weight gradients: every rank's expert slice sees tokens from its whole EP x ETP group, and FSDP then averages over
EDP x dp_replicate only, so the weight gradient must be divided by EP*ETP (`DispatchGroup.ep_etp_divisor`; 1 where
the reductions sum, as under torchtitan) to equal the gradient of the mean loss over all ranks. Our experts take
that as ExpertInput.weight_grad_scale and apply it to the weight gradients alone; for any other module the
activation gradient around it is scaled (and unscaled for its input): `dispatch_hooks`.

What a forward computed is the caller's to keep: each exchange names `rows_per_rank` (rows each EP rank computes;
eager dropless steps), which the hooks add to the caller's `RowLoad`. `RowCap` (MoERunOptions.max_rows_per_rank)
raises before the tokens move.
"""

from typing import NamedTuple, Protocol

import torch
import torch.distributed as dist

from dtensor_moe.experts import ExpertInput
from dtensor_moe.grad_scale import ScaleGrad
from dtensor_moe.kernels import policy
from dtensor_moe.kernels.gather_sum import gather_sum
from dtensor_moe.kernels.recompute import recomputing
from dtensor_moe.parallel.exchange import ExchangeTables, all_gather, ep_move, exchange_tables, group_name, pair_move
from dtensor_moe.routing.tables import PaddedCopies, PairRows, TokenCopies, gather_rows, inverse_permutation

__all__ = ["DispatchGroup", "DispatchStrategy", "TokenDispatch", "PairDispatch", "SlotDispatch", "SentPairs",
           "RowCap", "RowCapExceeded", "RowLoad", "dispatch_hooks"]


class DispatchGroup:
    """The EP x ETP group a strategy moves rows over, and what every strategy reads of it.

    Args:
        ep_group, etp_group: the process groups (EP: experts split, ETP: each expert's F split).
        ep_etp_divisor: the weight gradients are divided by it (module docstring): EP*ETP under averaging
            reductions, 1 where they sum.
        dispatch_precision: MoERunOptions.dispatch_precision; "fp8" sends the tokens as the FP8 payload.
    """

    def __init__(self, ep_group, etp_group, ep_etp_divisor: float = 1.0, dispatch_precision: str = "bf16"):
        self.ep_group, self.etp_group = ep_group, etp_group
        self.names = (group_name(ep_group), group_name(etp_group))  # what the ops take
        self.ep, self.etp = dist.get_world_size(ep_group), dist.get_world_size(etp_group)
        self.ep_etp_divisor = float(ep_etp_divisor)
        self.weight_grad_scale = 1.0 / self.ep_etp_divisor
        self.payload = ":fp8" if dispatch_precision == "fp8" else ""
        # The combine sums an ETP group's partial outputs: exactly one of its ranks adds the output bias.
        self.adds_output_bias = dist.get_rank(etp_group) == 0


class RowCapExceeded(ValueError):
    """Raised when a forward would exceed `MoERunOptions.max_rows_per_rank`: an EP rank would compute more
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


class RowCap:
    """MoERunOptions.max_rows_per_rank for one layer (0: no cap), read from each dropless step's counts table.

    The table is all-gathered, the same on every rank of the EP x ETP group, so the cap raises `RowCapExceeded`
    on all of them alike, before the tokens move. `layer` names the layer in the message, with the forward."""

    def __init__(self, max_rows: int = 0, layer: str = "an MoE layer"):
        self.max_rows, self.layer = max_rows, layer
        self.forwards = 0

    def rows(self, C_host: torch.Tensor) -> list[int] | None:
        """Rows each EP rank computes in this step (None while compiling: no host table is read then)."""
        self.forwards += 1
        if torch.compiler.is_compiling():
            return None
        rows = C_host[..., :-1].sum((0, 1, 3)).tolist()
        if self.max_rows and max(rows) > self.max_rows:
            worst = max(range(len(rows)), key=rows.__getitem__)
            raise RowCapExceeded(
                f"{self.layer}, forward {self.forwards}: EP rank {worst} would compute {rows[worst]} expert rows, "
                f"more than max_rows_per_rank ({self.max_rows}); rows per EP rank {rows}. Valid: a larger "
                f"max_rows_per_rank (0: no cap), fewer tokens per rank, expert_replicas, or a more balanced router")
        return rows


class RowLoad:
    """Rows each EP rank computed, kept by the caller of a dispatch (`dispatch_hooks` adds every forward's).

    Attributes:
        last (list[int] | None): rows per EP rank in the last eager dropless forward.
    """

    def __init__(self):
        self.last: list[int] | None = None
        self._counted: list[int] | None = None  # summed over the training forwards since `take`

    def record(self, rows: list[int] | None, training: bool) -> None:
        if rows is None:
            return
        self.last = rows
        if training:
            counted = self._counted or [0] * len(rows)
            self._counted = [a + b for a, b in zip(counted, rows)]

    def take(self) -> list[int] | None:
        """Rows per EP rank summed over the training forwards since the last call (None: none), reset."""
        rows, self._counted = self._counted, None
        return rows


class SentPairs(NamedTuple):
    """The (token, expert) pairs a dropless step sends, in expert-major order (`routing.TokenCopies`' or
    relabelled by replica slot): expert_N (E for a dropped pair, last), pair_N = t * top_k + k, weight_N."""

    expert_N: torch.Tensor
    pair_N: torch.Tensor
    weight_N: torch.Tensor
    top_k: int

    @classmethod
    def of(cls, copies: TokenCopies) -> "SentPairs":
        return cls(copies.expert_N, copies.pair_N, copies.weight_N, copies.weight_TK.shape[1])


class _Exchange:
    """One token or pair step's tables (`ExchangeTables`, named), what its combine reads back."""

    def __init__(self, tables, out_shape, groups, rows_per_rank):
        t = ExchangeTables(*tables)
        self.C_host, self.local_counts_E, self.idx, self.inv = t.C_host, t.local_counts_E, t.idx, t.inv
        self.send_token, self.token_rows, self.row_idx, self.row_readers = (t.send_token, t.token_rows, t.row_idx,
                                                                            t.row_readers)
        # The per-expert host counts serve only eager gradient accumulation; a compiled graph has none.
        self.local_counts_host = None if torch.compiler.is_compiling() else t.local_counts_host.tolist()
        self.out_shape, self.groups, self.rows_per_rank = out_shape, groups, rows_per_rank

    def move(self, xs, kinds, direction, lengths=None):
        """lengths: the senders' row counts, for "back" (for "there" they are xs')."""
        return ep_move(xs, self.C_host, kinds, direction, *self.groups, lengths or [x.shape[0] for x in xs])


def _expect(copies, kind: type, strategy) -> None:
    if not isinstance(copies, kind):
        raise TypeError(f"{type(strategy).__name__} moves rows laid out as {kind.__name__}, got "
                        f"{type(copies).__name__}: the layer's routing and its dispatch strategy disagree")


class DispatchStrategy(Protocol):
    """What every strategy here is (and ReplicaDispatch over one): the experts module's pre-hook calls `dispatch`,
    its post-hook `combine` with the ExpertInput's `exchange`. A strategy that hot-expert replicas can ride on
    (TokenDispatch and PairDispatch; not SlotDispatch) adds `send_relabelled` and `run_replicas`
    (replica_dispatch.py)."""

    group: DispatchGroup

    def dispatch(self, x: torch.Tensor, counts_E: torch.Tensor, copies=None, experts=None) -> ExpertInput:
        """This rank's rows for its experts (an ExpertInput), moved from the routed copies of `x`."""

    def combine(self, y: torch.Tensor, exchange) -> torch.Tensor:
        """The experts' output rows back at the senders, one row per token (or per sent row)."""


class TokenDispatch:
    """Tokens once per destination rank, copied to their experts there (`routing.TokenCopies`).

    Args:
        group (DispatchGroup): the EP x ETP group.
        cap (RowCap): the row cap (default: none).
    """

    def __init__(self, group: DispatchGroup, cap: RowCap | None = None):
        self.group, self.cap = group, cap or RowCap()

    def dispatch(self, x: torch.Tensor, counts_E: torch.Tensor, copies: TokenCopies, experts=None) -> ExpertInput:
        """x [..., D]: the tokens; counts_E: pairs per global expert; copies: their routing (TokenCopies)."""
        _expect(copies, TokenCopies, self)
        return self.send(x, counts_E, SentPairs.of(copies))

    def send(self, x: torch.Tensor, counts_E: torch.Tensor, pairs: SentPairs) -> ExpertInput:
        """Exchange tables, then move: the rows of `pairs` (counts_E per expert id) at their experts' ranks."""
        g = self.group
        x_TD = x.reshape(-1, x.shape[-1])
        tables = exchange_tables(counts_E, pairs.expert_N, pairs.pair_N, x_TD.shape[0], pairs.top_k, *g.names)
        ex = _Exchange(tables, x.shape, g.names, self.cap.rows(tables[0]))
        x_send = gather_rows(x_TD, ex.send_token, ex.token_rows)
        # The routing weights go where the sums are (autograd: they train the router).
        x_recv, w_sent = ex.move([x_send, pairs.weight_N[:, None]], f"rows{g.payload},pairs", "there")
        # Each received token once, with its pairs here: the experts copy, run and sum them (GroupedExperts).
        received = PairRows(ex.row_idx, ex.row_readers, gather_rows(w_sent, ex.idx, ex.inv)[:, 0])
        return ExpertInput(x_recv, ex.local_counts_E, ex.local_counts_host, g.weight_grad_scale, ex,
                           g.adds_output_bias, received)

    def send_relabelled(self, x: torch.Tensor, counts_E: torch.Tensor, copies: TokenCopies, replicas,
                        training: bool) -> tuple[ExpertInput, None]:
        """`send` of the pairs relabelled by `replicas` (replica_dispatch.Replicas) to virtual slots (the owned
        experts', then the replica slots'); nothing to undo at the combine."""
        _expect(copies, TokenCopies, self)
        counts, expert_N, pair_N, weight_N = replicas.relabel(copies, counts_E, training)
        return self.send(x, counts, SentPairs(expert_N, pair_N, weight_N, copies.weight_TK.shape[1])), None

    @staticmethod
    def run_replicas(replicas, experts, replica_forward, x_RD, counts_E, host_counts, scale, adds_output_bias):
        """The replica slots' rows through our experts' kernels on the slots' weight copies."""
        return replicas.run(experts, x_RD, counts_E, host_counts, scale, adds_output_bias)

    def combine(self, z_rows: torch.Tensor, ex: _Exchange) -> torch.Tensor:
        """Each received token's weighted sum over its experts here (the experts' output) -> each token's sum
        over the ranks it went to."""
        z_back = ex.move([z_rows], "rows", "back", [ex.send_token.shape[0]])[0]
        token_rows = ex.token_rows.view(*ex.out_shape[:-1], ex.token_rows.shape[1])
        return gather_sum(z_back, token_rows, ex.send_token, None)


class PairDispatch:
    """Rows one per (token, expert) pair in expert order, as other experts (torchtitan's) take and return them.

    Args:
        group (DispatchGroup): the EP x ETP group.
        cap (RowCap): the row cap (default: none).
    """

    def __init__(self, group: DispatchGroup, cap: RowCap | None = None):
        self.group, self.cap = group, cap or RowCap()

    def dispatch(self, x: torch.Tensor, counts_E: torch.Tensor, copies=None, experts=None) -> ExpertInput:
        """x [N, D]: the rows in expert order; counts_E: rows per global expert."""
        return self.send(x, counts_E)

    def send(self, x: torch.Tensor, counts_E: torch.Tensor) -> ExpertInput:
        g = self.group
        none = counts_E.new_empty(0, dtype=torch.int64)
        tables = exchange_tables(counts_E, none, none, x.shape[0], 0, *g.names)
        ex = _Exchange(tables, x.shape, g.names, self.cap.rows(tables[0]))
        x_local = gather_rows(ex.move([x], f"pairs{g.payload}", "there")[0], ex.idx, ex.inv)
        return ExpertInput(x_local, ex.local_counts_E, ex.local_counts_host, g.weight_grad_scale, ex,
                           g.adds_output_bias)

    def send_relabelled(self, x: torch.Tensor, counts_E: torch.Tensor, copies, replicas,
                        training: bool) -> tuple[ExpertInput, tuple[torch.Tensor, torch.Tensor]]:
        """`send` of the rows sorted by `replicas`' virtual slots (replica_dispatch.Replicas); the gather that
        sorts them back, for after the combine."""
        counts, order = replicas.relabel_rows(counts_E, x.shape[0], training)
        inv = inverse_permutation(order)
        return self.send(gather_rows(x, order, inv[:, None]), counts), (inv, order[:, None])

    @staticmethod
    def run_replicas(replicas, experts, replica_forward, x_RD, counts_E, host_counts, scale, adds_output_bias):
        """The replica slots' rows through the other experts' own forward (`replica_forward`) on weight copies."""
        return replicas.run_foreign(experts, replica_forward, x_RD, counts_E, scale)

    def combine(self, y_local: torch.Tensor, ex: _Exchange) -> torch.Tensor:
        """The experts' output rows -> the senders' rows, in their order."""
        return ex.move([gather_rows(y_local, ex.inv[:, 0], ex.idx[:, None])], "pairs", "back", [ex.out_shape[0]])[0]


class _PaddedExchange:
    """pad_to_capacity's step: the layer's slot tables and the static block sizes."""

    rows_per_rank = None  # every rank computes its full blocks

    def __init__(self, copies: PaddedCopies, out_shape, ep: int, etp: int):
        self.copies, self.out_shape = copies, out_shape
        self.local_experts = copies.num_experts // ep
        self.sources = ep * etp  # blocks each local expert receives, one per (ETP peer, EP source)


class SlotDispatch:
    """pad_to_capacity: every expert a block of `capacity` slots from every rank, moved with equal splits.

    Args:
        group (DispatchGroup): the EP x ETP group.
    """

    def __init__(self, group: DispatchGroup):
        self.group = group
        self.capacity_checked = False  # the group's equal capacities, checked once (eagerly)

    def dispatch(self, x: torch.Tensor, counts_E: torch.Tensor, copies: PaddedCopies, experts=None) -> ExpertInput:
        """x [..., D]: the tokens; copies: their slots (PaddedCopies); counts_E is the capacity for every expert."""
        _expect(copies, PaddedCopies, self)
        g = self.group
        if not self.capacity_checked and not torch.compiler.is_compiling():
            self._check_equal_capacity(copies.capacity, x)
        ex = _PaddedExchange(copies, x.shape, g.ep, g.etp)
        C, D = copies.capacity, x.shape[-1]
        x_recv = pair_move(copies.expand(x), ex.local_experts * C, f"slots{g.payload}", "there", *g.names)
        # (source, local expert, slot) -> (local expert, source, slot): each expert's rows contiguous.
        x_local = x_recv.view(ex.sources, ex.local_experts, C, D).transpose(0, 1).reshape(-1, D)
        rows = ex.sources * C
        counts = torch.full((ex.local_experts,), rows, dtype=torch.int64, device=x.device)
        return ExpertInput(x_local, counts, [rows] * ex.local_experts, g.weight_grad_scale, ex, g.adds_output_bias)

    def _check_equal_capacity(self, capacity: int, x: torch.Tensor) -> None:
        """The static splits assume every rank of the EP x ETP group has the same capacity (the same
        token count): unequal ones would misread rows or hang in the all-to-all. The first padded
        forward all-gathers them once (one counted host sync) and raises naming the ranks' values;
        later forwards trust it, as they must to stay sync-free."""
        caps = []
        for group in (self.group.ep_group, self.group.etp_group):
            out = torch.empty(dist.get_world_size(group), dtype=torch.int64, device=x.device)
            all_gather(out, torch.tensor([capacity], dtype=torch.int64, device=x.device), group=group)
            caps.append(policy.host_list(out, "capacity_check"))
        if any(len(set(c)) > 1 for c in caps):
            raise ValueError(f"pad_to_capacity needs the same token count on every rank of the EP x ETP group (its "
                             f"capacity C = ceil(T*K/E*capacity_factor) sets the static all-to-all splits); capacities "
                             f"over the EP group {caps[0]}, over the ETP group {caps[1]}: give every rank the same "
                             f"number of tokens per forward, or set pad_to_capacity=False")
        self.capacity_checked = True

    def combine(self, y_local: torch.Tensor, ex: _PaddedExchange) -> torch.Tensor:
        """The slots' output rows -> each token's weighted sum (padding selected away)."""
        C, D = ex.copies.capacity, y_local.shape[-1]
        y_sent = y_local.reshape(ex.local_experts, ex.sources, C, D).transpose(0, 1).reshape(-1, D)
        y_back = pair_move(y_sent, ex.local_experts * C, "slots", "back", *self.group.names)
        return ex.copies.combine(y_back, ex.out_shape)


def dispatch_hooks(dispatcher, load: RowLoad, ours: bool):
    """(pre, post) forward hooks for the experts module: `dispatcher.dispatch` before it, `combine` after, each
    forward's rows added to `load`.

    Ours take the ExpertInput, and the post-hook reads the step's exchange from the input it was called with.
    Other experts (torchtitan's) take (rows, counts): their activation gradient is scaled instead, and the
    exchange in flight between the two hooks is the one piece of state the hooks keep (a stack, empty between
    forwards)."""
    divisor = dispatcher.group.ep_etp_divisor

    def dispatch(module, *args):
        inp = dispatcher.dispatch(*args, experts=module)
        load.record(inp.exchange.rows_per_rank, module.training and not recomputing())
        return inp

    if ours:
        def pre(module, args):
            return (dispatch(module, *args),)

        def post(module, args, out):
            return dispatcher.combine(out, args[0].exchange)
        return pre, post

    in_flight: list[ExpertInput] = []

    def pre_foreign(module, args):
        x, counts_E = args
        # Scaled at the senders' rows (the dispatch is linear), not on the dispatched ones: those are
        # also kept in `in_flight`, and a compiled frame that outputs a tensor and a view of it (ScaleGrad's)
        # rebuilds the view from the tensor outside the graph, without ScaleGrad's backward (torch 2.13).
        scaled = ScaleGrad.apply(x, divisor) if divisor != 1 else x
        inp = dispatch(module, scaled, counts_E)
        in_flight.append(inp)
        return inp.x_ND, inp.counts_E

    def post_foreign(module, args, out):
        if divisor != 1:
            out = ScaleGrad.apply(out, 1.0 / divisor)
        return dispatcher.combine(out, in_flight.pop().exchange)
    return pre_foreign, post_foreign
