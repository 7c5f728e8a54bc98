"""Expert-parallel token dispatch and combine (EP all-to-all, then ETP gather / reduce-scatter).

Each rank sends only its own tokens over its EP group; inside the ETP group the received tokens
are gathered so every ETP rank runs the F-sharded GEMMs on all of them, and the partial outputs
are reduce-scattered back. The EP all-to-all is therefore never repeated per ETP rank.
"""

import torch
import torch.distributed as dist

from .moe import gather_rows, inverse_permutation


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with uneven splits; its gradient is the reverse all-to-all."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (in_splits, out_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        in_splits, out_splits = ctx.splits
        return _AllToAll.apply(grad, in_splits, out_splits, ctx.group), None, None, None


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


class ExpertDispatcher:
    """Wraps a GroupedExperts module's forward: `dispatch` runs before it, `combine` after.

    Weight gradients: every rank's expert slice sees tokens from its whole EP x ETP group, and
    FSDP then averages over EDP x dp_replicate only, so the weight gradient must be divided by
    EP*ETP to equal the gradient of the mean loss over all ranks. Done on the activation gradient
    around the experts (and undone for the input gradient), so FSDP's own reduction stays default.
    """

    def __init__(self, num_experts: int, ep_group, etp_group, ep: int, etp: int, grad_divisor: float | None = None):
        """grad_divisor defaults to EP*ETP (mean-loss convention); a trainer whose loss is already a
        global sum and whose FSDP reductions sum (torchtitan) passes 1."""
        self.num_experts, self.ep, self.etp = num_experts, ep, etp
        self.grad_divisor = float(ep * etp) if grad_divisor is None else float(grad_divisor)
        self.ep_group, self.etp_group = ep_group, etp_group
        self.etp_rank = dist.get_rank(etp_group) if etp > 1 else 0
        self._state = None

    def dispatch(self, x_ND: torch.Tensor, counts_E: torch.Tensor):
        ep, etp = self.ep, self.etp
        counts_E = counts_E.to(torch.int64)
        C = _gather_counts(counts_E, ep, etp, self.ep_group, self.etp_group)
        # One host sync, one copy, for all split sizes: uneven all-to-all needs them on the host.
        host = torch.cat([counts_E.view(ep, -1).sum(1), C.flatten()]).cpu()
        send = host[:ep].tolist()
        C_host = host[ep:].view(C.shape)
        recv_per_src = C_host[self.etp_rank].sum(1).tolist()  # what this rank's EP peers sent it
        x = _AllToAll.apply(x_ND, recv_per_src, send, self.ep_group) if ep > 1 else x_ND
        peer_sizes = C_host.sum((1, 2)).tolist()  # tokens each ETP peer received
        if etp > 1:
            x = _AllToAll.apply(x.repeat(etp, 1), peer_sizes, [sum(recv_per_src)] * etp, self.etp_group)
        idx = _expert_major_index(C, int(C_host.sum()))
        inv = inverse_permutation(idx)
        self._state = (idx, inv, send, recv_per_src, peer_sizes)
        x_local = gather_rows(x, idx, inv)
        if self.grad_divisor != 1:  # each scale is a full pass over the routed tokens in backward
            x_local = _ScaleGrad.apply(x_local, self.grad_divisor)
        return x_local, C.sum((0, 1))

    def combine(self, y_local: torch.Tensor) -> torch.Tensor:
        idx, inv, send, recv_per_src, peer_sizes = self._state
        self._state = None
        if self.grad_divisor != 1:
            y_local = _ScaleGrad.apply(y_local, 1.0 / self.grad_divisor)
        y = gather_rows(y_local, inv, idx)
        if self.etp > 1:
            n_self = sum(recv_per_src)
            y = _AllToAll.apply(y, [n_self] * self.etp, peer_sizes, self.etp_group)
            y = y.view(self.etp, n_self, y.shape[-1]).sum(0)
        if self.ep > 1:
            y = _AllToAll.apply(y, send, recv_per_src, self.ep_group)
        return y


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
