"""Worker-side check: the main job's model under parallelize_transformer against one process.

Every rank builds the same float64 model and the same global batches; the reference trains on the
whole batch, the parallel copy on this rank's part (its data-parallel group's sequences, its CP part
of each). Plain SGD, so a gradient scaled wrong cannot hide behind Adam's normalization.
"""

import copy
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dtensor_moe import MoEParallelDims, balance_loss
from dtensor_moe.train.config import ModelConfig
from dtensor_moe.train.model import MoETransformer
from dtensor_moe.train.optim import clip_grad_norm_
from dtensor_moe.train.parallel.parallelize_transformer import parallelize_transformer

MODEL = dict(vocab_size=32, dim=16, n_layers=2, n_heads=4, num_experts=4, top_k=2, hidden_dim=8,
             num_shared_experts=1, load_balance="aux_loss", aux_loss_coeff=0.1, bias_update_rate=0.05)


@dataclass(frozen=True)
class ModelCase:
    mesh: dict  # MoEParallelDims' degrees (the world is the pool's ranks)
    model: dict = field(default_factory=dict)  # ModelConfig fields over MODEL
    steps: int = 3
    global_batch: int = 4
    seq_len: int = 8
    max_norm: float = 0.5  # below the first steps' norms: clipping acts


def _loss(model, inputs_BL, targets_BL):
    logits_BLV = model(inputs_BL)
    return F.cross_entropy(logits_BLV.flatten(0, 1), targets_BL.flatten()), balance_loss(model)


def check_model_parity(rank: int, world_size: int, case: ModelCase) -> dict:
    cfg = ModelConfig(**{**MODEL, **case.model})
    torch.manual_seed(0)
    ref = MoETransformer(cfg).double()
    model = copy.deepcopy(ref)
    dims = MoEParallelDims(world_size, **case.mesh)
    parallelize_transformer(model, dims, device_type="cpu")
    tokens = torch.randint(0, cfg.vocab_size, (case.steps, case.global_batch, case.seq_len + 1),
                           generator=torch.Generator().manual_seed(1))
    c = dims.dense_coords(rank)
    groups = dims.dp_replicate * dims.dp_shard
    per_group, part = case.global_batch // groups, case.seq_len // dims.cp
    rows = slice((c["dp_replicate"] * dims.dp_shard + c["dp_shard"]) * per_group, None)
    rows = slice(rows.start, rows.start + per_group)
    cols = slice(c["cp"] * part, (c["cp"] + 1) * part)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.5, foreach=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, foreach=False)
    errs = {}
    for step in range(case.steps):
        inputs_BL, targets_BL = tokens[step, :, :-1], tokens[step, :, 1:]
        ce_ref, aux_ref = _loss(ref, inputs_BL, targets_BL)
        (ce_ref + aux_ref).backward()
        ce, aux = _loss(model, inputs_BL[rows, cols], targets_BL[rows, cols])
        (ce + aux).backward()
        mean_ce = ce.detach().clone()
        dist.all_reduce(mean_ce)  # TP ranks hold the same value: the mean over all ranks is the global mean
        errs[f"loss:{step}"] = (mean_ce / world_size - ce_ref).abs().item()
        if cfg.load_balance == "aux_loss":
            errs[f"aux:{step}"] = (aux - aux_ref).abs().item()
        if step == 0:
            for name, p in model.named_parameters():
                errs[f"grad:{name}"] = (p.grad.full_tensor() - ref.get_parameter(name).grad).abs().max().item()
        errs[f"grad_norm:{step}"] = (clip_grad_norm_(model.parameters(), case.max_norm)
                                     - clip_grad_norm_(ref.parameters(), case.max_norm)).abs().item()
        for o, m in ((opt, model), (opt_ref, ref)):
            o.step()
            o.zero_grad(set_to_none=True)
            m.update_expert_bias()
    if cfg.load_balance == "aux_free_bias":
        errs["expert_bias"] = max((a.moe.expert_bias - b.moe.expert_bias).abs().max().item()
                                  for a, b in zip(model.layers.values(), ref.layers.values()))
    return errs
