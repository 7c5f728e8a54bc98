"""Expert-parallel token dispatch and combine (EP all-to-all, then ETP gather / reduce-scatter).

Each rank sends only its own tokens over its EP group, and each token once per destination rank
however many of its top-k experts live there (at K=8 over EP=2 that is ~2 rows per token, not 8);
the receiver copies it to its experts. Inside the ETP group the received tokens are gathered so
every ETP rank runs the F-sharded GEMMs on all of them, and the partial outputs are
reduce-scattered back. The combine mirrors the dispatch: each rank sums, weighted by the routing
weights, a token's expert outputs that it holds, so the output too travels once per (token, rank).

Dispatch and combine are data movements in opposite directions, so each one's backward is the
reverse movement of the same rows (`_Exchange._forward` / `_reverse`).
"""

import functools

import torch
import torch.distributed as dist

from dtensor_moe.kernels.gather_sum import gather_sum, save_for_weighted_backward, weighted_gather_sum_backward, weighted_sum_rows
from dtensor_moe.routing import inverse_permutation


def _all_to_all(x, out_splits, in_splits, group, async_op=False):
    """(output, work): `work` is None unless async_op, else wait on it before reading the output."""
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    work = dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group, async_op=async_op)
    return out, work


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def _gather_counts(counts_RE, ep, etp, ep_group, etp_group) -> torch.Tensor:
    """[etp, ep, ep, E_local + 1]: in each ETP slice, what EP rank s sends to EP rank r's local
    experts and (last column) how many token rows: counts_RE is this rank's [ep, E_local + 1].
    Every rank gets every count, so a sender knows where its rows land at the receiver."""
    for n, group in ((ep, ep_group), (etp, etp_group)):
        if n > 1:  # stacked along dim 0 (the layout every backend accepts)
            out = counts_RE.new_empty(n * counts_RE.shape[0], counts_RE.shape[1])
            dist.all_gather_into_tensor(out, counts_RE, group=group)
            counts_RE = out
    return counts_RE.view(etp, ep, ep, -1)


class _Rows:
    """One direction's sizes: rows this rank sends to each EP peer, receives from each EP source,
    and each ETP peer holds after the EP step."""

    def __init__(self, send, recv, peer):
        self.send, self.recv, self.peer = send, recv, peer


class _Exchange:
    """One step's token movement between this rank's tokens and its expert slice (no autograd).

    With `copies`, tokens travel once per destination rank both ways: a token routed to several
    experts of one rank is sent once and copied there, and their outputs are summed there
    (weighted) before they return. Without `copies` (rows already one per (token, expert), as
    torchtitan's experts get them and return them) both directions move those rows.
    """

    def __init__(self, d: "ExpertDispatcher", counts_E: torch.Tensor, copies, token_shape: torch.Size):
        ep, etp = d.ep, d.etp
        self.d, self.out_shape = d, token_shape  # with copies: the tokens' shape, which the combine returns
        num_tokens = token_shape[:-1].numel()
        if copies is not None:
            rank_N = copies.expert_N // (d.num_experts // ep)  # destination of each expert-major pair
            cell_N = rank_N * num_tokens + copies.token_N  # (destination rank, token), rank-major
            need = torch.zeros(ep * num_tokens, dtype=torch.bool, device=counts_E.device)
            need[cell_N] = True
            slot = torch.cumsum(need, 0) - 1  # row of each needed (rank, token) in the send buffer
            rows_R = need.view(ep, num_tokens).sum(1)
        else:
            rows_R = counts_E.view(ep, -1).sum(1)
        C_dev = _gather_counts(torch.cat([counts_E.view(ep, -1), rows_R[:, None]], 1), ep, etp, d.ep_group, d.etp_group)
        # One host sync, one copy, for all split sizes: uneven all-to-all needs them on the host.
        C = C_dev.cpu().tolist()  # C[p][s][r]: ETP slice p, EP source s, EP destination r

        def pairs_of(c):
            return sum(c[:-1])

        me, sent = d.ep_rank, C[d.etp_rank][d.ep_rank]
        to_me = [[C[p][s][me] for s in range(ep)] for p in range(etp)]  # per ETP peer, per EP source
        self.pairs = _Rows([pairs_of(c) for c in sent], [pairs_of(c) for c in to_me[d.etp_rank]],
                           [sum(map(pairs_of, peer)) for peer in to_me])
        self.rows = _Rows([c[-1] for c in sent], [c[-1] for c in to_me[d.etp_rank]],
                          [sum(c[-1] for c in peer) for peer in to_me])
        self.local_counts_host = [sum(c[e] for peer in to_me for c in peer) for e in range(len(sent[0]) - 1)]
        C_mine = C_dev[:, :, me, :-1]  # [etp, ep, E_local]: what this rank's ETP group receives, per expert
        self.local_counts_E = C_mine.sum((0, 1))
        self.idx = _expert_major_index(C_mine, sum(self.pairs.peer))  # pair order -> expert-major
        self.copies = copies
        if copies is not None:
            n_send, K = sum(self.rows.send), copies.weight_TK.shape[1]
            # Non-needed cells land in a dummy slot past the end: a scatter, no sort.
            token = torch.arange(num_tokens, device=need.device).repeat(ep)
            self.send_token = token.new_empty(n_send + 1).scatter_(0, torch.where(need, slot, n_send), token)[:n_send]
            self._slot_of_cell = torch.where(need, slot, -1).view(ep, num_tokens)
            # Each pair carries (the received row it reads at its rank, its top-k slot), packed: its row
            # in the send buffer, less where the block for that rank starts there, plus where that
            # block lands at the receiver (after the blocks of lower EP sources).
            shift_R = [sum(C[d.etp_rank][s][r][-1] for s in range(me)) - sum(self.rows.send[:r]) for r in range(ep)]
            shift_N = torch.tensor(shift_R, device=need.device).index_select(0, rank_N)
            self._row_k = self._pair_rows((slot.index_select(0, cell_N) + shift_N) * K + copies.pair_N % K, K)
            self.row_idx = self._row_k // K
        else:
            self.row_idx = self.idx
        self.pending = None  # (input grad, its reverse exchange in flight), see launch_input_grad

    # Tables the dispatch itself does not need are built on first use, after the GEMMs are queued.
    @functools.cached_property
    def inv(self) -> torch.Tensor:
        return inverse_permutation(self.idx)[:, None]

    @functools.cached_property
    def token_rows(self) -> torch.Tensor:
        """[T, ep]: each token's row in the send buffer per destination rank, -1 where not sent."""
        return self._slot_of_cell.t().contiguous()

    @functools.cached_property
    def row_readers(self) -> torch.Tensor:
        """Who reads each received row: its (row, top-k slot) cell holds the expert-major position."""
        if self.copies is None:
            return self.inv
        row_k, K = self._row_k, self.copies.weight_TK.shape[1]
        cells = torch.full((sum(self.rows.peer) * K,), -1, device=row_k.device, dtype=row_k.dtype)
        return cells.scatter_(0, row_k, torch.arange(row_k.numel(), device=row_k.device)).view(-1, K)

    def _pair_rows(self, row_k_N, K):
        """Expert-major (received row, top-k slot) * K packed, per local (token, expert) pair. The
        sender packed its row at this EP rank; offset here by this ETP rank's share of the rows
        gathered over the ETP group."""
        d, pairs = self.d, self.pairs
        packed = _all_to_all(row_k_N, pairs.recv, pairs.send, d.ep_group)[0] if d.ep > 1 else row_k_N
        if d.etp > 1:
            packed = packed + sum(self.rows.peer[: d.etp_rank]) * K
            packed = _all_to_all(packed.repeat(d.etp), pairs.peer, [sum(pairs.recv)] * d.etp, d.etp_group)[0]
        return packed.index_select(0, self.idx)

    def _forward(self, x, sizes: _Rows, index=None):
        """Sender rows -> the rows this rank received (ETP peers' too), reordered by `index`."""
        d = self.d
        if d.ep > 1:
            x, _ = _all_to_all(x, sizes.recv, sizes.send, d.ep_group)
        if d.etp > 1:
            x, _ = _all_to_all(x.repeat(d.etp, 1), sizes.peer, [sum(sizes.recv)] * d.etp, d.etp_group)
        return x if index is None else x.index_select(0, index)

    def _reverse(self, y, sizes: _Rows, readers=None, async_op=False):
        """Received rows (or expert-major rows summed by `readers` into them) -> the sender's rows;
        returns (result, work): wait on `work` (None when nothing is in flight) before using it."""
        d = self.d
        if readers is not None:
            y = gather_sum(y, readers)
        if d.etp > 1:
            n_self = sum(sizes.recv)
            y, _ = _all_to_all(y, [n_self] * d.etp, sizes.peer, d.etp_group)
            y = y.view(d.etp, n_self, y.shape[-1]).sum(0)
        if d.ep > 1:
            return _all_to_all(y, sizes.send, sizes.recv, d.ep_group, async_op=async_op)
        return y, None

    def to_experts(self, x):
        """Dispatch: tokens (or, without copies, ready-made pair rows) -> expert-major pairs."""
        if self.copies is not None:
            x = x.index_select(0, self.send_token)
        return self._forward(x, self.rows, self.row_idx)

    def _to_tokens(self, rows):
        """Rows back at the sender -> tokens, summed over the ranks each was sent to."""
        return rows if self.copies is None else gather_sum(rows, self.token_rows)

    def tokens_to_rows(self, x_TD):
        """Tokens -> the received rows on their expert ranks (the combine's backward)."""
        return self._forward(x_TD.index_select(0, self.send_token), self.rows)

    def rows_to_tokens(self, z_rows):
        """Received rows (expert outputs already summed per row) -> tokens (the combine)."""
        return self._to_tokens(self._reverse(z_rows, self.rows)[0])

    def from_experts(self, y_local):
        """Pair rows (expert-major) back to the sender: without copies the combine's movement; with
        copies the routing weights' gradients."""
        return self._reverse(y_local, self.pairs, self.inv)[0]

    def pairs_to_experts(self, dy):
        """Sender's pair rows -> expert-major: the combine's backward without copies; with copies
        the routing weights' move to the expert ranks."""
        return self._forward(dy, self.pairs, self.idx)

    def launch_input_grad(self, dx_local):
        """Called by the experts' backward as soon as their input gradient exists: its trip back to
        the token owners then runs while the weight-gradient GEMMs compute."""
        self.pending = (dx_local, *self._start_input_grad(dx_local))

    def _start_input_grad(self, dx_local):
        return self._reverse(dx_local, self.rows, self.row_readers, async_op=True)

    def input_grad(self, dx_local):
        launched, out, work = self.pending or (None, None, None)
        self.pending = None
        if launched is None or launched.data_ptr() != dx_local.data_ptr():
            if work is not None:  # never reached by GroupedExperts; keeps any other caller correct
                work.wait()
            out, work = self._start_input_grad(dx_local)
        if work is not None:
            work.wait()
        return self._to_tokens(out)


class _Move(torch.autograd.Function):
    """Rows moved by `there` (no autograd inside); their gradient moves back by `back`."""

    @staticmethod
    def forward(ctx, x, there, back):
        ctx.back = back
        return there(x)

    @staticmethod
    def backward(ctx, grad):
        return ctx.back(grad), None, None


class _Combine(torch.autograd.Function):
    """Expert outputs (expert-major pairs) -> tokens: each received row sums its pairs weighted on
    the expert rank, then travels back once and the sender sums over ranks. Backward goes the
    dispatch's way and finishes with the pairs' gradients and the routing weights' (on the
    expert rank; the weights' own move, in `ExpertDispatcher.combine`, takes those home)."""

    @staticmethod
    def forward(ctx, y_local, w_local, ex, out_shape):
        save_for_weighted_backward(ctx, y_local, w_local)
        ctx.ex = ex
        # Shaped here: FSDP2 hooks the layer's output, which must not be a view made outside.
        return ex.rows_to_tokens(weighted_sum_rows(y_local, ex.row_readers, w_local)).view(out_shape)

    @staticmethod
    def backward(ctx, dy):
        y_local, w_local = ctx.saved_tensors
        dz_rows = ctx.ex.tokens_to_rows(dy.reshape(-1, dy.shape[-1]))
        dy_local, dw_local = weighted_gather_sum_backward(dz_rows, ctx.ex.row_idx, w_local, y_local, ctx.y_dtype)
        return dy_local, dw_local, None, None


class ExpertDispatcher:
    """Wraps an experts module's forward: `dispatch` runs before it, `combine` after.

    Weight gradients: every rank's expert slice sees tokens from its whole EP x ETP group, and
    FSDP then averages over EDP x dp_replicate only, so the weight gradient must be divided by
    EP*ETP to equal the gradient of the mean loss over all ranks. Experts that take a
    `weight_grad_scale` (ours) apply it to the weight gradients alone and also get the overlap hook;
    for any other module the activation gradient around it is scaled (and unscaled for its input).
    """

    def __init__(self, num_experts: int, ep_group, etp_group, ep: int, etp: int, grad_divisor: float | None = None):
        """grad_divisor defaults to EP*ETP (mean-loss convention); a trainer whose loss is already a
        global sum and whose FSDP reductions sum (torchtitan) passes 1."""
        self.num_experts, self.ep, self.etp = num_experts, ep, etp
        self.grad_divisor = float(ep * etp) if grad_divisor is None else float(grad_divisor)
        self.ep_group, self.etp_group = ep_group, etp_group
        self.ep_rank = dist.get_rank(ep_group) if ep > 1 else 0
        self.etp_rank = dist.get_rank(etp_group) if etp > 1 else 0
        self._ex = None

    def dispatch(self, x: torch.Tensor, counts_E: torch.Tensor, copies=None, hooked_experts: bool = False) -> tuple:
        """The experts' forward arguments: tokens grouped by local expert, their counts, and for
        `hooked_experts` no copies (done here), the weight-gradient scale, the input-gradient hook
        and the counts on the host. x holds one row per (token, expert) pair in expert order, or
        with `copies` (moe.TokenCopies) the tokens themselves, which then travel once per rank."""
        self._ex = ex = _Exchange(self, counts_E.to(torch.int64), copies, x.shape)
        if copies is not None:  # tokens of any leading shape; the combine returns that shape
            x = x.reshape(-1, x.shape[-1])
        x_local = _Move.apply(x, ex.to_experts, ex.input_grad)
        if hooked_experts:
            return x_local, ex.local_counts_E, None, 1.0 / self.grad_divisor, ex.launch_input_grad, ex.local_counts_host
        if self.grad_divisor != 1:  # each scale is a full pass over the routed tokens in backward
            x_local = _ScaleGrad.apply(x_local, self.grad_divisor)
        return x_local, ex.local_counts_E

    def combine(self, y_local: torch.Tensor, hooked_experts: bool = False) -> torch.Tensor:
        ex, self._ex = self._ex, None
        if not hooked_experts and self.grad_divisor != 1:
            y_local = _ScaleGrad.apply(y_local, 1.0 / self.grad_divisor)
        if ex.copies is not None:  # the routing weights go where the sums are (autograd: they train the router)
            w_local = _Move.apply(ex.copies.weight_N[:, None], ex.pairs_to_experts, ex.from_experts)[:, 0]
            return _Combine.apply(y_local, w_local, ex, ex.out_shape)
        return _Move.apply(y_local, ex.from_experts, ex.pairs_to_experts)


def _expert_major_index(C: torch.Tensor, total: int) -> torch.Tensor:
    """Row of the received buffer, ordered (etp peer, ep source, local expert), that each row of
    the expert-major order reads. Built on the device from the counts: no host round trip."""
    sizes = C.flatten()
    starts = torch.cumsum(sizes, 0) - sizes
    sizes_t = sizes.view(C.shape).permute(2, 0, 1).flatten()
    starts_t = starts.view(C.shape).permute(2, 0, 1).flatten()
    run_start = torch.cumsum(sizes_t, 0) - sizes_t
    offset = torch.repeat_interleave(starts_t - run_start, sizes_t, output_size=total)
    return offset + torch.arange(total, device=C.device)
