"""A main-job checkpoint (`dtensor-moe train` on 2 CPU ranks, EP2, 2 steps) -> `export RUN/checkpoints --hf OUT` ->
transformers' `from_pretrained(OUT)` computes what the trained model computes -> `import --hf OUT` gives the trained
MoE tensors back bit for bit (issue 40: the w13 change broke this export of a main-job checkpoint, no test caught it).

Two kinds of main job: the built-in model (`export --hf --model-type qwen3_moe` writes its MoE layers only, the rest
has no Hugging Face counterpart: transformers' sparse blocks loaded from OUT are compared with the trained MoE layers
on the same hidden states), and a run started from a Hugging Face checkpoint (`[model] hf_path`: OUT is the whole
model, its logits compared with the trained model's on the same tokens).
"""

import torch
from safetensors.torch import load_file

from dtensor_moe.cli import main
from dtensor_moe.train.config import ModelConfig
from dtensor_moe.train.export import load_safetensors_into, read_config
from dtensor_moe.train.model import build_model

from .hf_models import EXPERTS
from .test_hf_train import _byte_level_qwen3
from .test_train import _ranks_in_pools

TOL = 1e-5  # float32, transformers' per-expert loop against our grouped GEMMs


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def _train_export(tmp_path, monkeypatch, model_toml: str, *export_args: str):
    """The main job on 2 ranks, saved at its last step; its checkpoint exported with --hf and in our names; the
    trained model (float32, one process) read back from the latter."""
    _ranks_in_pools(monkeypatch)
    cfg, run = tmp_path / "job.toml", tmp_path / "run"
    cfg.write_text(f"[model]\n{model_toml}[parallel]\nnproc = 2\nep = 2\n"
                   "[training]\nsteps = 2\nseq_len = 16\nglobal_batch = 4\nlr = 1e-2\nwarmup_steps = 1\n")
    assert main(["train", "--config", str(cfg), "--run-dir", str(run), "--checkpoint-every", "2"]) == 0
    assert main(["export", str(run / "checkpoints"), "--hf", str(tmp_path / "hf"), *export_args]) == 0
    assert main(["export", str(run / "checkpoints"), str(tmp_path / "plain")]) == 0
    trained = build_model(ModelConfig.from_dict(read_config(tmp_path / "plain")))
    load_safetensors_into(trained, tmp_path / "plain")
    assert main(["import", "--hf", str(tmp_path / "hf"), str(tmp_path / "ours")]) == 0
    return trained.eval(), _from_pretrained(tmp_path / "hf"), load_file(tmp_path / "ours" / "model.safetensors")


def _from_pretrained(path):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # the built-in model's export: every non-MoE weight is "newly initialized"
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, experts_implementation=EXPERTS).eval()


def _assert_imported_back(imported: dict, trained_state: dict, prefix: str):
    """import --hf's `layers.{i}.moe.<name>` are the trained model's tensors at `prefix.format(i) + name`."""
    assert imported
    for key, tensor in imported.items():
        layer, name = key.split(".", 2)[1], key.split(".", 3)[3]
        assert torch.equal(tensor, trained_state[prefix.format(layer) + name]), key


def test_built_in_model_checkpoint_to_transformers_and_back(tmp_path, monkeypatch):
    model = ('dim = 32\nn_layers = 2\nn_heads = 4\nnum_experts = 4\ntop_k = 2\nhidden_dim = 16\n'
             'num_shared_experts = 0\nload_balance = "aux_loss"\n')
    trained, hf, imported = _train_export(tmp_path, monkeypatch, model, "--model-type", "qwen3_moe")
    x_BLD = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for i, moe in trained.moe_layers().items():
            theirs = hf.model.layers[i].mlp(x_BLD)
            theirs = theirs[0] if isinstance(theirs, tuple) else theirs  # (hidden states, router logits) in some
            assert _rel(theirs, moe(x_BLD)) < TOL, i
    state = trained.state_dict()
    _assert_imported_back(imported, state, "layers.{}.moe.")
    assert len(imported) == 3 * len(trained.moe_layers())  # router gate, w13, w2 a layer
    # Two steps moved the experts (a checkpoint of the initial model would prove less).
    fresh = build_model(ModelConfig.from_dict(read_config(tmp_path / "plain")))
    assert not torch.equal(state["layers.0.moe.experts.w13"], fresh.state_dict()["layers.0.moe.experts.w13"])


def test_hf_path_checkpoint_to_transformers_logits_and_back(tmp_path, monkeypatch):
    src = _byte_level_qwen3(tmp_path / "qwen3")
    trained, hf, imported = _train_export(tmp_path, monkeypatch, f'hf_path = "{src}"\nload_balance = "aux_loss"\n')
    tokens_BL = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = trained(tokens_BL), hf(input_ids=tokens_BL).logits
        before = _from_pretrained(src)(input_ids=tokens_BL).logits
    assert _rel(got, want) < TOL
    assert _rel(before, want) > 1e-3  # two steps moved the model
    _assert_imported_back(imported, trained.state_dict(), "model.layers.{}.mlp.")
