"""Expert-parallel token dispatch and combine (EP all-to-all, then ETP gather / reduce-scatter).

Each rank sends only its own tokens over its EP group; inside the ETP group the received tokens
are gathered so every ETP rank runs the F-sharded GEMMs on all of them, and the partial outputs
are reduce-scattered back. The EP all-to-all is therefore never repeated per ETP rank.

Dispatch and combine are the same two data movements in opposite directions, so each one's
backward is the other's forward (`_Exchange.to_experts` / `from_experts`).
"""

import torch
import torch.distributed as dist

from .moe import inverse_permutation


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


def _gather_counts(counts_E, ep, etp, ep_group, etp_group) -> torch.Tensor:
    """[etp, ep, E_local]: tokens each (ETP peer, EP source) sends to each local expert."""
    recv = torch.empty_like(counts_E)
    dist.all_to_all_single(recv, counts_E, group=ep_group)
    if etp == 1:
        return recv.view(1, ep, -1)
    parts = [torch.empty_like(recv) for _ in range(etp)]
    dist.all_gather(parts, recv, group=etp_group)
    return torch.stack(parts).view(etp, ep, -1)


class _Exchange:
    """One step's token movement between this rank's tokens and its expert slice (no autograd)."""

    def __init__(self, d: "ExpertDispatcher", counts_E: torch.Tensor):
        ep, etp = d.ep, d.etp
        C = _gather_counts(counts_E, ep, etp, d.ep_group, d.etp_group)
        # One host sync, one copy, for all split sizes: uneven all-to-all needs them on the host.
        host = torch.cat([counts_E.view(ep, -1).sum(1), C.flatten()]).cpu()
        self.d, self.send = d, host[:ep].tolist()
        C_host = host[ep:].view(C.shape)
        self.recv = C_host[d.etp_rank].sum(1).tolist()  # what this rank's EP peers sent it
        self.peer_sizes = C_host.sum((1, 2)).tolist()  # tokens each ETP peer received
        self.idx = _expert_major_index(C, int(C_host.sum()))
        self.inv = inverse_permutation(self.idx)
        self.local_counts_E = C.sum((0, 1))
        self.local_counts_host = C_host.sum((0, 1)).tolist()  # for the experts' per-expert GEMMs
        self.pending = None  # (input grad, its reverse exchange in flight), see launch_input_grad

    def to_experts(self, x_ND):
        d = self.d
        if d.ep > 1:
            x_ND, _ = _all_to_all(x_ND, self.recv, self.send, d.ep_group)
        if d.etp > 1:
            x_ND, _ = _all_to_all(x_ND.repeat(d.etp, 1), self.peer_sizes, [sum(self.recv)] * d.etp, d.etp_group)
        return x_ND.index_select(0, self.idx)

    def from_experts(self, y_ND, async_op=False):
        """Returns (result, work): wait on `work` (None when nothing is in flight) before using it."""
        d = self.d
        y_ND = y_ND.index_select(0, self.inv)
        if d.etp > 1:
            n_self = sum(self.recv)
            y_ND, _ = _all_to_all(y_ND, [n_self] * d.etp, self.peer_sizes, d.etp_group)
            y_ND = y_ND.view(d.etp, n_self, y_ND.shape[-1]).sum(0)
        if d.ep > 1:
            return _all_to_all(y_ND, self.send, self.recv, d.ep_group, async_op=async_op)
        return y_ND, None

    def launch_input_grad(self, dx_local):
        """Called by the experts' backward as soon as their input gradient exists: its trip back to
        the token owners then runs while the weight-gradient GEMMs compute."""
        self.pending = (dx_local, *self.from_experts(dx_local, async_op=True))

    def input_grad(self, dx_local):
        launched, out, work = self.pending or (None, None, None)
        self.pending = None
        if launched is None or launched.data_ptr() != dx_local.data_ptr():
            if work is not None:  # never reached by GroupedExperts; keeps any other caller correct
                work.wait()
            out, work = self.from_experts(dx_local, async_op=True)
        if work is not None:
            work.wait()
        return out


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_ND, ex: _Exchange):
        ctx.ex = ex
        return ex.to_experts(x_ND)

    @staticmethod
    def backward(ctx, dx_local):
        return ctx.ex.input_grad(dx_local), None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_local, ex: _Exchange):
        ctx.ex = ex
        out, _ = ex.from_experts(y_local)
        return out

    @staticmethod
    def backward(ctx, dy):
        return ctx.ex.to_experts(dy), None


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
        self.etp_rank = dist.get_rank(etp_group) if etp > 1 else 0
        self._ex = None

    def dispatch(self, x_ND: torch.Tensor, counts_E: torch.Tensor, hooked_experts: bool = False) -> tuple:
        """The experts' forward arguments: tokens grouped by local expert, their counts, and for
        `hooked_experts` the weight-gradient scale, the input-gradient hook and the counts on the host."""
        self._ex = ex = _Exchange(self, counts_E.to(torch.int64))
        x_local = _Dispatch.apply(x_ND, ex)
        if hooked_experts:
            return x_local, ex.local_counts_E, 1.0 / self.grad_divisor, ex.launch_input_grad, ex.local_counts_host
        if self.grad_divisor != 1:  # each scale is a full pass over the routed tokens in backward
            x_local = _ScaleGrad.apply(x_local, self.grad_divisor)
        return x_local, ex.local_counts_E

    def combine(self, y_local: torch.Tensor, hooked_experts: bool = False) -> torch.Tensor:
        ex, self._ex = self._ex, None
        if not hooked_experts and self.grad_divisor != 1:
            y_local = _ScaleGrad.apply(y_local, 1.0 / self.grad_divisor)
        return _Combine.apply(y_local, ex)


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
