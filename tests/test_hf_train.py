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


def train_on_ranks(rank, world_size, ckpt, out, ep, etp, tokens_BL, probe_BL, device="cpu"):
    """Each rank's part of the test (also tests/gpu/gpu_suite.py's, with device "cuda": ranks may share the GPU)."""
    import torch.distributed as dist

    from dtensor_moe import MoE, MoEParallelDims, balance_loss
    from dtensor_moe.hf import parallelize_hf_model, save_hf

    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    model = _load(ckpt).to(device)
    tokens_BL, probe_BL = tokens_BL.to(device), probe_BL.to(device)
    parallelize_hf_model(model, MoEParallelDims(world_size, ep=ep, etp=etp), device_type=device)
    swapped = sum(isinstance(m, MoE) for m in model.modules())
    n = tokens_BL.shape[0] // world_size

    def loss_fn(m, t_BL):
        # Each rank the mean over its equal share of the batch; FSDP averages the gradients over the ranks.
        return m(input_ids=t_BL, labels=t_BL).loss + balance_loss(m)

    losses = _train(model, tokens_BL[rank * n:(rank + 1) * n], loss_fn)
    for loss in losses:
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)
    with torch.no_grad():
        logits = model(input_ids=probe_BL).logits
    saved = save_hf(model, out) if out is not None else None
    return dict(losses=torch.stack(losses).cpu(), logits=logits.cpu(), saved=saved, swapped=swapped)


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


def _byte_level_qwen3(path):
    """A tiny Qwen3-MoE checkpoint whose vocabulary holds the main job's byte tokens."""
    import transformers as tf

    torch.manual_seed(0)
    config = tf.Qwen3MoeConfig(vocab_size=256, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                               num_key_value_heads=1, head_dim=8, moe_intermediate_size=8, intermediate_size=16,
                               num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=64)
    tf.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def test_main_job_trains_a_hugging_face_checkpoint_and_exports_it(tmp_path, capsys, monkeypatch):
    """`[model] hf_path`: 4 ranks (EDP2 x EP2), --parity against 1 process, the first step's loss is transformers'
    on the same batch, export --hf loads in from_pretrained with the trained weights and generates."""
    import json

    import torch.nn.functional as F

    from dtensor_moe.cli import main
    from dtensor_moe.train.config import ModelConfig
    from dtensor_moe.train.data import Batches, load_tokens
    from dtensor_moe.train.export import load_safetensors_into, read_config
    from dtensor_moe.train.model import build_model

    from .test_train import _ranks_in_pools

    _ranks_in_pools(monkeypatch)
    src, run = _byte_level_qwen3(tmp_path / "qwen3"), tmp_path / "run"
    cfg = tmp_path / "hf.toml"
    cfg.write_text(f'[model]\nhf_path = "{src}"\nload_balance = "aux_loss"\n[parallel]\nnproc = 4\nep = 2\n'
                   "[training]\nsteps = 3\nseq_len = 16\nglobal_batch = 8\n")
    assert main(["train", "--config", str(cfg), "--run-dir", str(run), "--parity", "--checkpoint-every", "3"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert any(line.startswith(f"trained  13k-parameter Hugging Face qwen3_moe from {src} (2 layers") for line in out)
    assert json.loads((run / "parity.json").read_text())["max_abs_delta"] <= 1e-4

    inputs_BL, targets_BL = Batches(load_tokens("corpus", 0), 16, 8, 0, 0, 1)(0)
    ref = _load(src)
    with torch.no_grad():
        first = F.cross_entropy(ref(input_ids=inputs_BL).logits.flatten(0, 1), targets_BL.flatten()).item()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert abs(rows[0]["loss"] - first) < 1e-5, (rows[0]["loss"], first)

    assert main(["export", str(run), str(tmp_path / "plain")]) == 0
    assert main(["export", str(run), "--hf", str(tmp_path / "hf")]) == 0
    trained = build_model(ModelConfig.from_dict(read_config(tmp_path / "plain")))
    load_safetensors_into(trained, tmp_path / "plain")
    back = _load(tmp_path / "hf")
    with torch.no_grad():
        want, got = trained(inputs_BL), back(input_ids=inputs_BL).logits
    assert _rel(got, want) < 1e-5
    assert _rel(want, ref(input_ids=inputs_BL).logits.detach()) > 1e-3  # three steps moved the model
    generated = back.generate(inputs_BL[:1, :4], max_new_tokens=4, do_sample=False)
    assert generated.shape == (1, 8) and torch.equal(generated[0, :4], inputs_BL[0, :4])


@pytest.mark.parametrize("override, message", [
    ("model.num_experts=8", "fixes the architecture; model.num_experts = 8 (the checkpoint's: 4)"),
    ("model.dim=32", "model.dim = 32 (the checkpoint's: 16)"),
    ("model.load_balance=aux_free_bias", "load_balance='aux_free_bias' cannot be saved back"),
    ("parallel.tp=2", "{'parallel.tp': 2} are not supported there"),
])
def test_main_job_refuses_what_the_checkpoint_fixes_in_one_line(override, message, tmp_path, capsys):
    from dtensor_moe.cli import main

    src = _byte_level_qwen3(tmp_path / "qwen3")
    capsys.readouterr()  # transformers' own save progress bar is not the main job's output
    cfg = tmp_path / "hf.toml"
    cfg.write_text(f'[model]\nhf_path = "{src}"\n[parallel]\nnproc = 4\nep = 2\n[training]\nsteps = 1\n')
    assert main(["train", "--config", str(cfg), "--run-dir", str(tmp_path / "run"), override]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
