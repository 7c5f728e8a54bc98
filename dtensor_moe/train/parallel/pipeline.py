"""Pipeline parallelism: split a model's `layers` into stages run by torch.distributed.pipelining.

Stage s of S holds a contiguous run of layers (the first stage also `tok_embeddings`, the last
`norm` and `output`); a rank holds stages rank, rank + pp, ... (one stage, or `STAGES_PER_RANK`
for the interleaved schedule). Each stage is a pruned copy of the model with the original
parameter names, parallelized by the caller's function on the meshes of its pipeline stage.

The objective is the single-process one with gradient accumulation over the same microbatches:
mean over microbatches of (cross-entropy + every MoE layer's load-balancing loss). The schedule's
loss function (train/loss.py's `lm_loss`: with chunks, the last stage returns its final norm's output and the
loss applies that stage's head) sees only the cross-entropy on the last stage, so each MoE's loss is attached to
its output (`_AttachLoss`): its gradient (weight 1 per microbatch; the schedule divides every
gradient by the microbatch count) enters in the backward of the stage that produced it.
"""

import copy
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from dtensor_moe.moe import MoE, recomputing
from dtensor_moe.parallel.mesh import PP_STAGES_PER_RANK as STAGES_PER_RANK
from dtensor_moe.parallel.placement import stage_layers
from dtensor_moe.train.loss import cross_entropy, lm_loss

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B}


def split_stage(model: nn.Module, layer_ids: list[int], first: bool, last: bool) -> nn.Module:
    """A copy of `model` with only these layers (original names) and the ends this stage owns."""
    part = copy.deepcopy(model)
    keep = {str(i) for i in layer_ids}
    for name in [n for n in part.layers if n not in keep]:
        del part.layers[name]
    if not first:
        part.tok_embeddings = None
    if not last:
        part.norm = part.output = None
    part.pipeline_stage = True  # holds part of the model: checkpoints hold the other stages' weights too
    return part


class _AttachLoss(torch.autograd.Function):
    """Identity on `y` (a copy: FSDP warns about a unit returning a view); backward also gives `loss`
    the gradient 1, as if it were added to the objective."""

    @staticmethod
    def forward(ctx, y, loss):
        ctx.loss_shape = loss.shape
        return y.clone()

    @staticmethod
    def backward(ctx, grad_y):
        return grad_y, grad_y.new_ones(ctx.loss_shape)


class Pipeline:
    """This rank's stages and the schedule; `step` runs one global batch (all microbatches).
    `loss_chunk_tokens`: the loss's chunks of tokens (`lm_loss`), 0 for full logits."""

    def __init__(self, model: nn.Module, pp_mesh, schedule: str, microbatches: int, local_batch: int,
                 seq_len: int, hidden_len: int, activation_dtype: torch.dtype, device: torch.device,
                 parallelize: Callable[[nn.Module], None], loss_chunk_tokens: int = 0):
        pp, rank = pp_mesh.size(), pp_mesh.get_local_rank()
        num_stages = pp * STAGES_PER_RANK[schedule]
        layers = stage_layers(len(model.layers), num_stages)
        self.microbatches = microbatches
        self.parts, stages = [], []
        self._aux: list[torch.Tensor] = []
        mb, L, S = local_batch // microbatches, seq_len, hidden_len
        cfg = model.config
        # Called on the last stage only; a schedule without a loss function would run no backward on any rank.
        loss_fn = cross_entropy
        for s in range(rank, num_stages, pp):
            first, last = s == 0, s == num_stages - 1
            part = split_stage(model, layers[s], first, last)
            if last:
                loss_fn = lm_loss(part, loss_chunk_tokens)
            for m in part.modules():
                if isinstance(m, MoE):
                    m.register_forward_hook(self._attach_aux)
            parallelize(part)
            # Static stage metadata: torch's dynamic inference would run an extra forward and backward,
            # counting tokens per expert twice. Tokens and logits are this rank's L positions (its CP part),
            # hidden states between blocks its S of them (sequence parallelism splits them over tp); the last
            # stage's final norm output, for a chunked loss, L of them (a DTensor under tp: its global shape).
            # (requires_grad says that gradients flow back through the stage boundary.)
            x = torch.zeros(mb, L, dtype=torch.long, device=device) if first else \
                torch.empty(mb, S, cfg.dim, dtype=activation_dtype, device=device, requires_grad=True)
            y_shape = ((L, cfg.dim) if part.return_hidden else (L, cfg.vocab_size)) if last else (S, cfg.dim)
            y = torch.empty(mb, *y_shape, dtype=activation_dtype, device=device, requires_grad=True)
            stages.append(PipelineStage(part, s, num_stages, device, input_args=x, output_args=y,
                                        group=pp_mesh.get_group()))
            self.parts.append(part)
        self.has_first = stages[0].is_first
        self.has_last = stages[-1].is_last
        cls = SCHEDULES[schedule]
        self.schedule = cls(stages if STAGES_PER_RANK[schedule] > 1 else stages[0], n_microbatches=microbatches,
                            loss_fn=loss_fn, scale_grads=True)

    def _attach_aux(self, moe: MoE, args, y):
        losses = moe.losses()  # balance loss, sequence-wise balance loss, router z-loss: those enabled
        if not losses:
            return None
        loss = sum(losses)
        if not recomputing():
            self._aux.append(loss.detach())
        return _AttachLoss.apply(y, loss)

    def step(self, inputs_BL: torch.Tensor, targets_BL: torch.Tensor) -> tuple[float, float]:
        """Forward and backward of every microbatch. Returns this rank's (cross-entropy, aux loss),
        each the mean over microbatches: the cross-entropy on the last stage (else 0), the aux loss
        summed over this rank's stages' MoE layers (the caller sums it over stages). Contiguous copies:
        torch 2.11's stages check each microbatch's strides against the contiguous shapes they were built
        for (a batch's inputs are a column slice of its sequences)."""
        self._aux.clear()
        losses: list[torch.Tensor] = []
        self.schedule.step(
            inputs_BL.contiguous() if self.has_first else None,
            target=targets_BL.contiguous() if self.has_last else None,
            losses=losses,
            return_outputs=False,
        )
        ce = sum(float(x.detach()) for x in losses) / self.microbatches if self.has_last else 0.0
        return ce, float(sum(self._aux)) / self.microbatches


    def rollout(self, inputs_BL: torch.Tensor, targets_BL: torch.Tensor) -> None:
        """The forwards of every microbatch (the schedule's eval), as `step` runs them: what routing replay
        records."""
        self.schedule.eval(inputs_BL.contiguous() if self.has_first else None,
                           target=targets_BL.contiguous() if self.has_last else None)

    def evaluate(self, inputs_BL: torch.Tensor, targets_BL: torch.Tensor) -> float:
        """This rank's mean cross-entropy over the microbatches of a held-out batch (the last stage's; else 0)."""
        losses: list[torch.Tensor] = []
        self.schedule.eval(inputs_BL.contiguous() if self.has_first else None,
                           target=targets_BL.contiguous() if self.has_last else None, losses=losses)
        return sum(float(x) for x in losses) / self.microbatches if self.has_last else 0.0


def stage_view(parts: list[nn.Module]) -> nn.Module:
    """One module over this rank's stages with the whole model's parameter names (for the optimizer
    and checkpoints): the single part itself, or a container of the parts' layers and ends."""
    if len(parts) == 1:
        return parts[0]
    view = nn.Module()
    view.config, view.pipeline_stage = parts[0].config, True
    view.layers = nn.ModuleDict({n: b for part in parts for n, b in part.layers.items()})
    for name in ("tok_embeddings", "norm", "output"):
        setattr(view, name, next((getattr(p, name) for p in parts if getattr(p, name) is not None), None))
    return view

