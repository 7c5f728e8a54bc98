"""The main job's loss: the LM head's cross-entropy, from full logits or chunk by chunk over tokens.

`chunked_cross_entropy(h, W, targets)` is `cross_entropy((h @ W.T).float(), targets)` without the full logits: its
forward keeps each token's log-sum-exp and target logit, its backward computes each chunk's logits again, so at most
one chunk of logits (and of their fp32 copy and gradient) is alive at a time. For DeepSeek's 102,400-word vocabulary
at 32,768 tokens the full fp32 logits alone are 12.5 GiB; chunks of 2,048 tokens hold 0.8 GiB.

Under the main job's tensor parallelism the head is sharded by vocabulary rows (tp_styles.py's "head" style): each TP
rank takes its rows' logits of every token and the ranks combine each token's log-sum-exp and target logit (two
all-reduces a batch, none in backward), as torchtitan's loss parallelism does.
"""

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

__all__ = ["IGNORE_INDEX", "chunked_cross_entropy", "cross_entropy", "hf_lm_loss", "lm_loss"]

IGNORE_INDEX = -100  # F.cross_entropy's default: targets of this value add nothing to the loss or its mean


def _loss_dtype(dtype: torch.dtype) -> torch.dtype:
    # At least fp32 (bf16 logits are too coarse for the loss); fp64 stays fp64, so a float64 check is exact.
    return torch.promote_types(dtype, torch.float32)


def cross_entropy(logits_BLV: torch.Tensor, targets_BL: torch.Tensor) -> torch.Tensor:
    """The mean cross-entropy of full logits, upcast to at least fp32 (the job's loss with `loss_chunk_tokens = 0`).

    Args:
        logits_BLV (Tensor): [B, L, V] logits.
        targets_BL (Tensor): [B, L] target token ids; `IGNORE_INDEX` where a position has none.

    Returns:
        Tensor: the scalar mean over the targets that are not `IGNORE_INDEX`.
    """
    return F.cross_entropy(logits_BLV.flatten(0, 1).to(_loss_dtype(logits_BLV.dtype)), targets_BL.flatten())


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of `h_TD @ w_VD.T` (w: this rank's vocabulary rows from `vocab_start`, all of them
    without `group`), `chunk` tokens at a time; backward recomputes each chunk's logits."""

    @staticmethod
    def forward(ctx, h_TD, w_VD, targets_T, chunk: int, ignore_index: int, vocab_start: int, group):
        dtype = _loss_dtype(h_TD.dtype)
        valid_T = targets_T != ignore_index
        local_T = targets_T - vocab_start
        mine_T = valid_T & (local_T >= 0) & (local_T < w_VD.shape[0])  # the target's logit is on this rank
        local_T = torch.where(mine_T, local_T, 0)
        lse_T = torch.empty(h_TD.shape[0], dtype=dtype, device=h_TD.device)
        target_T = torch.empty_like(lse_T)
        for s in range(0, h_TD.shape[0], chunk):
            z_NV = F.linear(h_TD[s:s + chunk], w_VD).to(dtype)
            target_T[s:s + chunk] = z_NV.gather(1, local_T[s:s + chunk, None]).squeeze(1)
            # logsumexp in place: torch.logsumexp would hold a second chunk of logits for its exp.
            max_N = z_NV.amax(-1)
            lse_T[s:s + chunk] = max_N + z_NV.sub_(max_N[:, None]).exp_().sum(-1).log()
            del z_NV  # before the next chunk's logits: one chunk alive, not two
        target_T = torch.where(mine_T, target_T, 0)
        if group is not None:  # each rank's sum of exp over its rows, with a common max so that none overflows
            max_T = lse_T.clone()
            dist.all_reduce(max_T, dist.ReduceOp.MAX, group=group)
            both_2T = torch.stack([(lse_T - max_T).exp(), target_T])
            dist.all_reduce(both_2T, group=group)
            lse_T, target_T = max_T + both_2T[0].log(), both_2T[1]
        ctx.count = valid_T.sum()
        ctx.chunk = chunk
        ctx.save_for_backward(h_TD, w_VD, lse_T, local_T, mine_T, valid_T)
        return torch.where(valid_T, lse_T - target_T, 0).sum() / ctx.count

    @staticmethod
    def backward(ctx, grad):
        h_TD, w_VD, lse_T, local_T, mine_T, valid_T = ctx.saved_tensors
        want_h, want_w = ctx.needs_input_grad[:2]
        # d loss / d logit = (softmax - one-hot of the target) * grad / count, 0 for an ignored target.
        scale_T = torch.where(valid_T, grad / ctx.count, 0).to(lse_T.dtype)
        grad_h_TD = torch.empty_like(h_TD) if want_h else None
        # The head's gradient summed over chunks at fp32 at least (the full path sums it inside one GEMM).
        grad_w_VD = torch.zeros(w_VD.shape, dtype=_loss_dtype(w_VD.dtype), device=w_VD.device) if want_w else None
        for s in range(0, h_TD.shape[0], ctx.chunk):
            h_ND = h_TD[s:s + ctx.chunk]
            p_NV = F.linear(h_ND, w_VD).to(lse_T.dtype).sub_(lse_T[s:s + ctx.chunk, None]).exp_()
            rows_N = torch.arange(h_ND.shape[0], device=h_ND.device)
            p_NV.index_put_((rows_N, local_T[s:s + ctx.chunk]), -mine_T[s:s + ctx.chunk].to(p_NV.dtype),
                            accumulate=True)
            # The gradient reaches the logits in their own dtype, as autograd casts it back through .float().
            g_NV = p_NV.mul_(scale_T[s:s + ctx.chunk, None]).to(h_TD.dtype)
            del p_NV
            if want_h:
                grad_h_TD[s:s + ctx.chunk] = g_NV @ w_VD
            if want_w:
                grad_w_VD += (g_NV.T @ h_ND).to(grad_w_VD.dtype)
            del g_NV
        return grad_h_TD, None if grad_w_VD is None else grad_w_VD.to(w_VD.dtype), None, None, None, None, None


def _layout(t: torch.Tensor) -> str:
    return f"{tuple(t.placements)} on {t.device_mesh}" if isinstance(t, DTensor) else "a plain tensor"


def _vocab_shard(hidden: DTensor, weight: DTensor) -> tuple[torch.Tensor, torch.Tensor, int, object]:
    """A vocabulary-sharded head's local rows and where they start, and every token's hidden state on each rank:
    (h, w, vocab_start, group). h's gradient leaves as a partial sum over the head's ranks (each rank's rows add
    their part), which its redistribution back to `hidden`'s placement reduces."""
    if not (isinstance(hidden, DTensor) and isinstance(weight, DTensor) and weight.device_mesh.ndim == 1
            and tuple(weight.placements) == (Shard(0),) and hidden.device_mesh == weight.device_mesh):
        raise ValueError(f"chunked_cross_entropy takes a plain head weight, or one sharded by vocabulary rows "
                         f"(Shard(0)) on a 1-D mesh with the hidden states a DTensor on that mesh; got the weight as "
                         f"{_layout(weight)}, the hidden states as {_layout(hidden)}. An FSDP-sharded weight is "
                         "gathered only between the root module's forward and its backward: call it on the forward's "
                         "output")
    mesh = weight.device_mesh
    h = hidden.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()])
    rows = -(-weight.shape[0] // mesh.size())  # Shard(0) splits as torch.chunk does
    return h, weight.to_local(), min(mesh.get_local_rank() * rows, weight.shape[0]), mesh.get_group()


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_tokens: int = 2048,
                          ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """The mean cross-entropy of the LM head's logits, computed `chunk_tokens` tokens at a time and recomputed in
    backward: equal (to fp32 rounding) to `cross_entropy((hidden @ weight.T).float(), targets)` with at most one
    chunk of logits alive.

    Args:
        hidden (Tensor): [..., D] hidden states before the head (the final norm's output). A DTensor when `weight`
            is sharded by vocabulary rows over that mesh (tensor parallelism), else a plain tensor.
        weight (Tensor): the head's [V, D] weight, plain (FSDP2 leaves it gathered after the root module's forward),
            or a DTensor sharded by vocabulary rows (`Shard(0)`) on a 1-D mesh.
        targets (Tensor): [...] target ids (hidden's leading shape); `ignore_index` where a position has none.
        chunk_tokens (int): tokens per chunk; the logits alive at once are chunk_tokens x V (x V / tp).
        ignore_index (int): the target value that adds nothing to the loss or its mean.

    Returns:
        Tensor: the scalar mean over the targets that are not `ignore_index`, in at least fp32 (nan if there are
        none, as F.cross_entropy's).

    Example:
        >>> h, w = torch.randn(6, 4, dtype=torch.float64), torch.randn(10, 4, dtype=torch.float64)
        >>> y = torch.tensor([1, 2, -100, 3, 4, 5])
        >>> full = F.cross_entropy(h @ w.T, y)
        >>> bool(torch.allclose(chunked_cross_entropy(h, w, y, chunk_tokens=4), full))
        True
    """
    if not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be an int >= 1, got {chunk_tokens!r}")
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(f"targets' shape {tuple(targets.shape)} must be hidden's without its last dim "
                         f"{tuple(hidden.shape[:-1])}")
    vocab_start, group = 0, None
    if isinstance(hidden, DTensor) or isinstance(weight, DTensor):
        hidden, weight, vocab_start, group = _vocab_shard(hidden, weight)
    return _ChunkedLinearCrossEntropy.apply(hidden.reshape(-1, hidden.shape[-1]), weight, targets.reshape(-1),
                                            chunk_tokens, ignore_index, vocab_start, group)


def lm_loss(model, chunk_tokens: int) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The main job's loss of (what `model`'s forward returns, targets) for `training.loss_chunk_tokens`: with
    chunks, `model` returns its final norm's output (`model.return_hidden = True`) and the loss applies its head
    (`model.head_weight()`, read at each call: FSDP2 gathers it in the forward) chunk by chunk; with 0, the model
    returns full logits and the loss is `cross_entropy`.

    Args:
        model (MoEModel): the model, or the pipeline stage holding its head; its forward's output is the loss's input.
        chunk_tokens (int): tokens per chunk; 0 for full logits.

    Returns:
        Callable: loss(output_BL*, targets_BL) -> the scalar mean cross-entropy.
    """
    model.return_hidden = chunk_tokens > 0
    if not chunk_tokens:
        return cross_entropy
    return lambda h_BLD, targets_BL: chunked_cross_entropy(h_BLD, model.head_weight(), targets_BL, chunk_tokens)


def hf_lm_loss(model, tokens_BL: torch.Tensor, chunk_tokens: int = 2048, **forward_kwargs) -> torch.Tensor:
    """A transformers causal LM's loss on `tokens_BL` without full fp32 logits: `model(input_ids=tokens_BL,
    labels=tokens_BL).loss` (transformers' shifted cross-entropy), from the final norm's output and the head's
    weight (which FSDP2's root unit keeps gathered from its forward to its backward) by `chunked_cross_entropy`.
    `logits_to_keep=1` leaves transformers' own head one position; the last position predicts nothing.

    Args:
        model (nn.Module): the causal LM (e.g. after `parallelize_hf_model`), with an `lm_head`.
        tokens_BL (Tensor): [B, L] token ids, the inputs and (shifted by one) the targets.
        chunk_tokens (int): tokens per chunk of logits. Default 2048.
        forward_kwargs: more arguments for the model's forward (e.g. use_cache=False).

    Returns:
        Tensor: the scalar mean cross-entropy; add `dtensor_moe.balance_loss(model)` for the balance losses.

    Example::

        loss = hf_lm_loss(model, tokens_BL)
        (loss + balance_loss(model)).backward()
    """
    out = model(input_ids=tokens_BL, output_hidden_states=True, logits_to_keep=1, **forward_kwargs)
    targets_BL = F.pad(tokens_BL[:, 1:], (0, 1), value=IGNORE_INDEX)
    return chunked_cross_entropy(out.hidden_states[-1], model.lm_head.weight, targets_BL, chunk_tokens)
