"""`--parity`'s 1-process reference with the run's per-rank MoE semantics (`slice_moe_layers`).

A capacity factor drops, and `round_tokens_to` rounds, each rank's own pairs of one forward: the run's MoE layers
apply them to the tokens of one data-parallel rank (under cp / tp its part of its sequences), not to the global
batch. The reference's MoE layers therefore run each such slice of their input on its own, as those ranks do, with
the load-balancing statistics summed over the slices as the run sums them over its ranks (`MoE.stats`): each slice
runs the layer's own forward in a thread of its own, the threads taking turns (one runs at a time, in slice order)
and meeting at every statistics sum, so the balance losses, the aux-free bias's counts and routing replay are
the run's, exactly.
"""

import threading
import types

import torch
from torch import nn

from dtensor_moe.kernels.recompute import recomputing
from dtensor_moe.moe import LocalStats, MoE

__all__ = ["slice_moe_layers"]


def slice_moe_layers(model: nn.Module, dp: int, seq: int) -> None:
    """Every MoE layer of `model` (its `moe_layers()`) runs its input [B, L, D] as dp x seq slices: dp contiguous
    groups of sequences (the data-parallel ranks' shares of a microbatch, data.py) times seq contiguous parts of
    each sequence (cp x tp: a CP rank's part, then its sequence-parallel TP slice), each its own forward."""
    for moe in model.moe_layers().values():
        moe.forward = types.MethodType(_make_forward(dp, seq), moe)


def _make_forward(dp: int, seq: int):
    def forward(moe: MoE, x_BLD: torch.Tensor) -> torch.Tensor:
        return _sliced_forward(moe, x_BLD, dp, seq)

    return forward


def _sliced_forward(moe: MoE, x_BLD: torch.Tensor, dp: int, seq: int) -> torch.Tensor:
    if x_BLD.dim() != 3 or x_BLD.shape[0] % dp or x_BLD.shape[1] % seq:
        raise ValueError(f"parity reference: an MoE input of shape {tuple(x_BLD.shape)} does not split into {dp} "
                         f"data-parallel groups of sequences x {seq} parts of each sequence")
    B, L, _ = x_BLD.shape
    b, ell = B // dp, L // seq
    boxes = [(slice(d * b, (d + 1) * b), slice(c * ell, (c + 1) * ell)) for d in range(dp) for c in range(seq)]
    meeting = _Meeting(len(boxes), group=[s // seq for s in range(len(boxes))])
    replay, current_TK = moe.routing_replay, None
    if replay is not None:  # the layer's whole forward replays (or records) one entry: each slice its rows of it
        current_TK = replay.replayed(B * L, recomputing())
    token_BL = torch.arange(B * L, device=x_BLD.device).view(B, L)
    rows = [token_BL[box].reshape(-1) for box in boxes]
    views = [_SliceView(moe, _SliceStats(meeting, s), None if replay is None else
                        _SliceReplay(None if current_TK is None else current_TK[rows[s]]))
             for s in range(len(boxes))]
    ys = meeting.run(lambda s: MoE.forward(views[s], x_BLD[boxes[s]]))
    for name in ("aux_loss", "seq_aux_loss", "z_loss"):
        # Each slice's loss has the global value and its own share of the gradient times the slices (MoE._global),
        # as on the run's ranks, whose gradients data parallelism averages: so their mean.
        losses = [getattr(v, name) for v in views]
        setattr(moe, name, None if losses[0] is None else torch.stack(losses).mean())
    if replay is not None:
        chosen = [v.routing_replay.chosen for v in views]
        whole = chosen[0].new_empty(B * L, *chosen[0].shape[1:])
        for s, c in enumerate(chosen):
            whole[rows[s]] = c
        replay.chosen = whole
    return torch.cat([torch.cat(ys[d * seq:(d + 1) * seq], dim=1) for d in range(dp)], dim=0)


class _SliceView:
    """The layer as one rank sees it: its own statistics, balance losses and replay entry; everything else (weights,
    submodules, the aux-free bias and its counts) the layer's own."""

    def __init__(self, moe: MoE, stats, routing_replay):
        self._moe, self.stats, self.routing_replay = moe, stats, routing_replay
        self.aux_loss = self.seq_aux_loss = self.z_loss = None

    def __getattr__(self, name):
        method = getattr(MoE, name, None)
        if isinstance(method, types.FunctionType):  # MoE's methods run on this view (its stats, its losses)
            return types.MethodType(method, self)
        return getattr(self._moe, name)


class _SliceReplay:
    """A slice's part of the layer's replay entry (None: recording), and what the slice chose."""

    def __init__(self, current_TK: torch.Tensor | None):
        self.current, self.chosen = current_TK, None

    def replayed(self, num_tokens: int, recomputation: bool) -> torch.Tensor | None:
        return self.current


class _SliceStats(LocalStats):
    """MoE.stats of one slice: sums over every slice, sequence sums over the slices holding parts of the same
    sequences (DataParallelStats over the run's ranks)."""

    def __init__(self, meeting: "_Meeting", slice_id: int):
        self.meeting, self.slice_id, self.num_ranks = meeting, slice_id, meeting.n

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        return self.meeting.exchange(self.slice_id, "sum", t)

    def sequence_sum(self, t: torch.Tensor) -> torch.Tensor:
        return self.meeting.exchange(self.slice_id, "sequence_sum", t)


class _Aborted(Exception):
    """Another slice failed: this one stops where it waits."""


class _Meeting:
    """n threads taking turns in slice order (one runs at a time, so the layer's state sees one forward at once), each
    running until its next statistics sum; the last to arrive sums every slice's tensor (or, for sequence sums, those
    of its own `group`) in slice order and hands the turn back to slice 0."""

    def __init__(self, n: int, group: list[int]):
        self.n, self.group = n, group
        self.cond = threading.Condition()
        self.turn, self.failed = 0, False
        self.posted: list = [None] * n
        self.calls = [0] * n
        self.results: list = [None] * n

    def run(self, fn) -> list:
        out, errors = [None] * self.n, [None] * self.n
        grad = torch.is_grad_enabled()  # thread-local: the threads take the caller's

        def work(s: int):
            try:
                with self.cond:
                    self._wait(s)
                with torch.set_grad_enabled(grad):
                    out[s] = fn(s)
            except BaseException as e:  # noqa: BLE001 - re-raised by the caller's thread
                errors[s] = e
                with self.cond:
                    self.failed = True
                    self.cond.notify_all()
                return
            with self.cond:
                self.turn = s + 1
                if s == self.n - 1 and len(set(self.calls)) > 1:
                    self.failed = True  # a slice still waits for a sum the last slice will never join
                self.cond.notify_all()

        threads = [threading.Thread(target=work, args=(s,), name=f"parity-slice-{s}") for s in range(self.n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        first = next((e for e in errors if e is not None and not isinstance(e, _Aborted)), None)
        if first is not None:
            raise first
        if self.failed or len(set(self.calls)) > 1:
            raise RuntimeError(f"parity reference: the MoE slices' forwards made different numbers of statistics "
                               f"sums ({self.calls})")
        return out

    def _wait(self, s: int):
        self.cond.wait_for(lambda: self.turn == s or self.failed)
        if self.failed:
            raise _Aborted

    def exchange(self, s: int, kind: str, t: torch.Tensor) -> torch.Tensor:
        with self.cond:
            self.posted[s], self.calls[s] = (kind, t.detach()), self.calls[s] + 1
            if s == self.n - 1:
                if any(c != self.calls[s] for c in self.calls) or any(p[0] != kind for p in self.posted):
                    self.failed = True
                else:
                    for j in range(self.n):
                        take = [p[1] for i, p in enumerate(self.posted)
                                if kind == "sum" or self.group[i] == self.group[j]]
                        self.results[j] = torch.stack(take).sum(0)
                self.turn = 0
            else:
                self.turn = s + 1
            self.cond.notify_all()
            self._wait(s)
            return self.results[s]
