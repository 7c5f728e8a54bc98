"""Hugging Face MoE causal LMs trained directly (dtensor_moe.hf.parallelize_hf_model), float32, CPU gloo.

For each family: a checkpoint written by save_pretrained, loaded by transformers on every rank, our layers
swapped in and parallelized (EP2 on 2 ranks, EP2 x ETP2 on 4), 3 AdamW steps on the ranks' slices of one
global batch, saved back by save_hf. The reference is transformers' own model from the same checkpoint,
trained by the same optimizer on the whole batch in this process: every step's loss (the first one is
transformers' loss on the batch before any update) and the trained logits agree, and from_pretrained of the
saved directory gives the trained model's logits. Tolerance: float32 with transformers' per-expert loop
against our grouped GEMMs, over 3 steps of Adam (losses measured within 2.1e-7).
"""

import pytest
import torch

from .harness import run_on_ranks
from .hf_models import EXPERTS, hf_model

FAMILIES = ["qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss"]
STEPS, LR, TOL = 3, 1e-2, 2e-5


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def _batch():
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, 32, (8, 6), generator=g), torch.randint(0, 32, (2, 5), generator=g)


def _load(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, experts_implementation=EXPERTS)


def _train(model, tokens_BL, loss_fn):
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for _ in range(STEPS):
        loss = loss_fn(model, tokens_BL)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


def train_on_ranks(rank, world_size, ckpt, out, ep, etp, tokens_BL, probe_BL):
    import torch.distributed as dist

    from dtensor_moe import MoE, MoEParallelDims
    from dtensor_moe.hf import moe_aux_loss, parallelize_hf_model, save_hf

    model = _load(ckpt)
    parallelize_hf_model(model, MoEParallelDims(world_size, ep=ep, etp=etp), device_type="cpu")
    swapped = sum(isinstance(m, MoE) for m in model.modules())
    n = tokens_BL.shape[0] // world_size

    def loss_fn(m, t_BL):
        # Each rank the mean over its equal share of the batch; FSDP averages the gradients over the ranks.
        return m(input_ids=t_BL, labels=t_BL).loss + moe_aux_loss(m)

    losses = _train(model, tokens_BL[rank * n:(rank + 1) * n], loss_fn)
    for loss in losses:
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)
    with torch.no_grad():
        logits = model(input_ids=probe_BL).logits
    saved = save_hf(model, out)
    return dict(losses=torch.stack(losses), logits=logits, saved=saved, swapped=swapped)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    dirs = {}
    for model_type in FAMILIES:
        dirs[model_type] = tmp_path_factory.mktemp(model_type)
        hf_model(model_type).float().save_pretrained(dirs[model_type])
    return dirs


@pytest.mark.parametrize("ep,etp,world", [(2, 1, 2), (2, 2, 4)])
@pytest.mark.parametrize("model_type", FAMILIES)
def test_hf_model_trains_like_transformers_and_saves_back(model_type, ep, etp, world, checkpoints, tmp_path):
    tokens_BL, probe_BL = _batch()
    ref = _load(checkpoints[model_type])
    ref_losses = torch.stack(_train(ref, tokens_BL, lambda m, t: m(input_ids=t, labels=t).loss))
    with torch.no_grad():
        ref_logits = ref(input_ids=probe_BL).logits

    out = tmp_path / "trained"
    results = run_on_ranks(world, train_on_ranks, checkpoints[model_type], out, ep, etp, tokens_BL, probe_BL)
    ours = results[0]
    assert ours["saved"] == out and all(r["saved"] is None for r in results[1:])
    assert ours["swapped"] == (1 if model_type == "deepseek_v3" else 2)  # DeepSeek-V3's layer 0 is dense
    assert _rel(ours["losses"], ref_losses) < TOL, (ours["losses"], ref_losses)
    assert _rel(ours["logits"], ref_logits) < TOL
    # The trained model changed the logits: the comparisons above are not of the initial model.
    assert _rel(ref_logits, _load(checkpoints[model_type])(input_ids=probe_BL).logits.detach()) > 1e-2

    with torch.no_grad():
        back = _load(out)(input_ids=probe_BL).logits
    assert _rel(back, ours["logits"]) < 1e-5
