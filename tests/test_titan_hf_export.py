"""Exact Hugging Face round trips through the torchtitan hook (issue 30 item 2), 2 CPU gloo ranks, EP=2.

A tiny Qwen3-MoE and a tiny DeepSeek-V3 written by transformers (tests/test_titan_hf.py's models) are loaded
through torchtitan's `--checkpoint.initial_load_in_hf`, trained STEPS steps under `--module dtensor_moe.titan`
and exported by torchtitan's last-step save in HF (`--checkpoint.last_save_in_hf`, the export dtype left
at the hook's default), or saved as DCP and exported by `dtensor-moe export --hf --titan-config`.
transformers' `from_pretrained` loads the export folder as it is (config.json included), and its logits
equal the trained model's: max |logits - logits_trained| / max |logits_trained| < RTOL. The trained model's
logits are taken with its experts computing in float32 (torchtitan's grouped experts cast to bfloat16
whatever the parameter dtype: 3e-4 against transformers' float32 experts, the size of the routing bias this
checks). Measured: see docs/titan.md, "Hugging Face checkpoints".

gpt-oss (`test_gpt_oss_hf_round_trip`, through the hook's GptOssHFAdapter): the same two routes after
GPT_OSS_STEPS steps, the experts in float32 throughout, so that the first step's loss is also checked against
transformers' on the same batches; without the routing bias (`--dtensor_moe.load_balance_coeff 0`: gpt-oss's
format has no key for it, and its configs train it unless told not to).

Refused while parsing the command line, one line, exit status 2: an HF checkpoint whose config.json has
another architecture (a DeepSeek-V3 checkpoint into the softmax-routing debug config, a Qwen3-MoE one into
a DeepSeek config, a gpt-oss one into a Qwen3 config, a gpt-oss one with other experts, clamp and layer types),
and a Qwen3-MoE HF export of a run that trains the routing bias (the format has no key for it); the hook's
Qwen3 configs train none. `dtensor-moe export` refuses a DCP checkpoint holding a routing bias its family
has no key for (Qwen3-MoE, gpt-oss).
"""

import json
import os

import pytest

pytest.importorskip("torchtitan")
pytest.importorskip("transformers")

import torch  # noqa: E402

from .harness import run_on_ranks  # noqa: E402
from .test_titan_hf import _hf_config, _write_checkpoint  # noqa: E402

WORLD = 2
EP = 2
STEPS = 2
RTOL = 1e-5


def _fp32_experts(self, x, counts):
    """torchtitan's GroupedExperts.forward in float32, one expert at a time (its own casts to bfloat16)."""
    from torch.distributed.tensor import DTensor

    w1, w2, w3 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1_EFD, self.w2_EDF, self.w3_EFD))
    out, start = x.new_zeros(x.shape[0], w2.shape[1]), 0
    for e, n in enumerate(counts.tolist()):
        rows = x[start:start + int(n)]
        out[start:start + int(n)] = (torch.nn.functional.silu(rows @ w1[e].T) * (rows @ w3[e].T)) @ w2[e].T
        start += int(n)
    return out


def _train_and_export(rank: int, world: int, argv: list[str], tokens) -> dict:
    """torchtitan's Trainer with argv (which exports in HF at its last step); the trained model's logits."""
    os.environ["LOCAL_RANK"] = str(rank)
    from dtensor_moe.titan.cpu import use_cpu

    use_cpu()
    from unittest import mock

    from torchtitan.config import ConfigManager
    from torchtitan.models.common.moe import GroupedExperts

    trainer = ConfigManager().parse_args(argv).build()
    try:
        trainer.train()
        model = trainer.model_parts[0]
        with torch.no_grad(), mock.patch.object(GroupedExperts, "forward", _fp32_experts):
            logits = model(tokens)
            if model._skip_lm_head:  # set for torchtitan's chunked loss, which applies lm_head itself
                logits = model.lm_head(logits)
        biases = [b.full_tensor() if hasattr(b, "full_tensor") else b.clone()
                  for n, b in model.named_buffers() if n.endswith("expert_bias_E")]
    finally:
        trainer.close()
    return {"logits": logits, "biases": biases, "step": trainer.step}


@pytest.mark.parametrize("route", ["last_save_in_hf", "dtensor-moe export"])
@pytest.mark.parametrize(
    "model_type, config", [("qwen3_moe", "qwen3_moe_tiny_cpu"), ("deepseek_v3", "deepseek_v3_hf_cpu")]
)
def test_hf_export_is_the_trained_model(tmp_path, capsys, model_type, config, route):
    """Two routes to the export: torchtitan's last-step save in HF, or its DCP save read afterwards by
    `dtensor-moe export CKPT --hf OUT --titan-config NAME` (which refuses the folder without the flag)."""
    import transformers as tf
    from safetensors import safe_open

    from dtensor_moe.cli import main

    tokens = torch.randint(0, 382, (2, 32), generator=torch.Generator().manual_seed(1))
    initial, _ = _write_checkpoint(model_type, tmp_path / "hf", tokens)
    argv = ["--module", "dtensor_moe.titan", "--config", config, "--dump_folder", str(tmp_path / "run"),
            "--dtensor_moe.ep", str(EP), "--training.steps", str(STEPS),
            "--checkpoint.enable", "--checkpoint.initial_load_path", str(tmp_path / "hf"),
            "--checkpoint.initial_load_in_hf", "--checkpoint.initial_load_model_only",
            "--checkpoint.last_save_model_only"]
    if route == "last_save_in_hf":
        argv.append("--checkpoint.last_save_in_hf")
    ranks = run_on_ranks(WORLD, _train_and_export, argv, tokens)
    trained = ranks[0]["logits"]
    moved = (trained - initial).abs().max().item()
    assert moved > 1e-2, moved  # the steps trained: the export is not the checkpoint loaded
    export = tmp_path / "run" / "checkpoint" / f"step-{STEPS}"
    if route == "dtensor-moe export":
        capsys.readouterr()
        assert main(["export", str(export), "--hf", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--hf OUT_DIR --titan-config NAME" in err[0], err
        other = "deepseek_v3_hf_cpu" if model_type == "qwen3_moe" else "qwen3_moe_tiny_cpu"
        assert main(["export", str(export), "--hf", str(tmp_path / "out"), "--titan-config", other]) == 2
        assert f"is not a checkpoint of --titan-config {other}" in capsys.readouterr().err
        assert main(["export", str(export), "--hf", str(tmp_path / "out"), "--titan-config", config]) == 0
        export = tmp_path / "out"

    with open(export / "config.json") as f:
        assert json.load(f)["dtype"] == "float32"
    dtypes = set()
    for file in export.glob("*.safetensors"):
        with safe_open(file, "pt") as sf:
            dtypes |= {sf.get_slice(k).get_dtype() for k in sf.keys()}
    assert dtypes == {"F32"}, dtypes
    model = tf.AutoModelForCausalLM.from_pretrained(export, experts_implementation="eager").eval()
    assert model.dtype == torch.float32
    with torch.no_grad():
        logits = model(tokens).logits
    err = ((logits - trained).abs().max() / trained.abs().max()).item()
    bias = [b.abs().max().item() for b in ranks[0]["biases"]]
    print(f"{model_type} ({route}): export vs trained, max |dlogits| / max |logits| {err:.2e} (logits up to "
          f"{trained.abs().max():.2f}, moved {moved:.2e} by training); routing biases: {bias}")
    assert err < RTOL, err
    if model_type == "qwen3_moe":  # the hook's Qwen3 configs train no routing bias
        assert ranks[0]["biases"] == []


GPT_OSS_STEPS = 3


def _fp32_gpt_oss_experts(self, x, counts):
    """torchtitan's GptOssGroupedExperts.forward in float32, one expert at a time (its own casts to bfloat16);
    rows past the experts' (padding) stay zero, as its bias leaves them."""
    from torch.distributed.tensor import DTensor
    from torchtitan.models.gpt_oss.moe import swiglu

    w1, b1, w2, b2 = (w.to_local() if isinstance(w, DTensor) else w
                      for w in (self.mlp1_weight_EGD, self.mlp1_bias_EG, self.mlp2_weight_EDF, self.mlp2_bias_ED))
    out, start = x.new_zeros(x.shape[0], w2.shape[1]), 0
    for e, n in enumerate(counts.tolist()):
        rows = x[start:start + int(n)]
        out[start:start + int(n)] = swiglu(rows @ w1[e].T + b1[e], limit=self.swiglu_limit) @ w2[e].T + b2[e]
        start += int(n)
    return out


def _train_gpt_oss(rank: int, world: int, argv: list[str], tokens) -> dict:
    """torchtitan's Trainer with argv, gpt-oss's experts in float32 throughout: this rank's first batch, the
    logged losses, and the trained model's logits on tokens."""
    os.environ["LOCAL_RANK"] = str(rank)
    from dtensor_moe.titan.cpu import use_cpu

    use_cpu()
    from unittest import mock

    from torchtitan.config import ConfigManager
    from torchtitan.models.gpt_oss.moe import GptOssGroupedExperts

    with mock.patch.object(GptOssGroupedExperts, "forward", _fp32_gpt_oss_experts):
        trainer = ConfigManager().parse_args(argv).build()
        batches, losses = [], []
        process, log = trainer.post_dataloading_process, trainer.metrics_processor.log

        def capture_batch(input_dict, labels):
            batches.append((input_dict["input"].clone(), labels.clone()))
            return process(input_dict, labels)

        def capture_log(step, loss, max_loss, grad_norm, **kwargs):
            losses.append(loss)
            return log(step, loss, max_loss, grad_norm, **kwargs)

        trainer.post_dataloading_process, trainer.metrics_processor.log = capture_batch, capture_log
        try:
            trainer.train()
            model = trainer.model_parts[0]
            with torch.no_grad():
                logits = model(tokens)
                if model._skip_lm_head:
                    logits = model.lm_head(logits)
        finally:
            trainer.close()
    return {"logits": logits, "first_batch": batches[0], "losses": losses}


@pytest.mark.parametrize("route", ["last_save_in_hf", "dtensor-moe export"])
def test_gpt_oss_hf_round_trip(tmp_path, capsys, route):
    """gpt-oss (torchtitan's architecture; `GptOssHFAdapter` maps the experts to transformers' layout): a
    transformers checkpoint loaded through the hook gives transformers' first-step loss on the same batch
    (the experts in float32 on both sides), GPT_OSS_STEPS steps train, and transformers' from_pretrained of
    the export gives the trained model's logits. Without the routing bias (gpt-oss's format has no key for
    it: --dtensor_moe.load_balance_coeff 0)."""
    import transformers as tf
    from safetensors import safe_open

    from dtensor_moe.cli import main

    tokens = torch.randint(0, 382, (2, 32), generator=torch.Generator().manual_seed(1))
    initial, hf_keys = _write_checkpoint("gpt_oss", tmp_path / "hf", tokens)
    argv = ["--module", "dtensor_moe.titan", "--config", "gpt_oss_tiny_cpu", "--dump_folder", str(tmp_path / "run"),
            "--dtensor_moe.ep", str(EP), "--dtensor_moe.load_balance_coeff", "0",
            "--training.steps", str(GPT_OSS_STEPS), "--checkpoint.enable",
            "--checkpoint.initial_load_path", str(tmp_path / "hf"), "--checkpoint.initial_load_in_hf",
            "--checkpoint.initial_load_model_only", "--checkpoint.last_save_model_only"]
    if route == "last_save_in_hf":
        argv.append("--checkpoint.last_save_in_hf")
    ranks = run_on_ranks(WORLD, _train_gpt_oss, argv, tokens)

    # The first step's loss (the mean over both ranks' batches) against transformers' on those batches.
    loaded = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", experts_implementation="eager").eval()
    inputs, labels = (torch.cat(t) for t in zip(*(r["first_batch"] for r in ranks)))
    with torch.no_grad():
        loss_hf = torch.nn.functional.cross_entropy(loaded(inputs).logits.flatten(0, 1), labels.flatten()).item()
    losses = ranks[0]["losses"]
    assert len(losses) == GPT_OSS_STEPS and losses[-1] < losses[0], losses
    dloss = abs(losses[0] - loss_hf)

    trained = ranks[0]["logits"]
    moved = (trained - initial).abs().max().item()
    assert moved > 1e-2, moved
    export = tmp_path / "run" / "checkpoint" / f"step-{GPT_OSS_STEPS}"
    if route == "dtensor-moe export":
        capsys.readouterr()
        assert main(["export", str(export), "--hf", str(tmp_path / "out"), "--titan-config", "qwen3_moe_tiny_cpu"]) == 2
        assert "is not a checkpoint of --titan-config qwen3_moe_tiny_cpu" in capsys.readouterr().err
        assert main(["export", str(export), "--hf", str(tmp_path / "out"), "--titan-config", "gpt_oss_tiny_cpu"]) == 0
        export = tmp_path / "out"
    with open(export / "config.json") as f:
        assert json.load(f)["dtype"] == "float32"
    keys, dtypes = set(), set()
    for file in export.glob("*.safetensors"):
        with safe_open(file, "pt") as sf:
            keys |= set(sf.keys())
            dtypes |= {sf.get_slice(k).get_dtype() for k in sf.keys()}
    assert keys == hf_keys and dtypes == {"F32"}, (keys ^ hf_keys, dtypes)  # every tensor transformers holds
    model = tf.AutoModelForCausalLM.from_pretrained(export, experts_implementation="eager").eval()
    with torch.no_grad():
        logits = model(tokens).logits
    err = ((logits - trained).abs().max() / trained.abs().max()).item()
    print(f"gpt_oss ({route}): first-step loss {losses[0]:.6f}, transformers' {loss_hf:.6f} (|d| {dloss:.2e}); "
          f"export vs trained, max |dlogits| / max |logits| {err:.2e} (logits up to {trained.abs().max():.2f}, "
          f"moved {moved:.2e} by training); losses {losses}")
    assert dloss < 1e-5 * loss_hf, (losses[0], loss_hf)
    assert err < RTOL, err


def _refused(capsys, argv) -> str:
    from torchtitan.config import ConfigManager

    with pytest.raises(SystemExit) as exit_:
        ConfigManager().parse_args(argv)
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dtensor_moe.titan: "), lines
    return lines[0]


@pytest.mark.parametrize("model_type, changes, config, fields", [
    ("deepseek_v3", {}, "deepseek_v3_debugmodel_cpu", ("scoring_func 'sigmoid' (model: 'softmax')",
                                                       "n_group 4 (model: 1)", "topk_group 2 (model: 1)")),
    ("qwen3_moe", {}, "deepseek_v3_hf_cpu", ("model_type is 'qwen3_moe'",)),
    ("gpt_oss", {}, "qwen3_moe_tiny_cpu", ("model_type is 'gpt_oss'",)),
    ("gpt_oss", {"num_local_experts": 4, "swiglu_limit": 1.0, "layer_types": ["full_attention"] * 2},
     "gpt_oss_tiny_cpu", ("num_local_experts 4 (model: 8)", "swiglu_limit 1.0 (model: 7.0)",
                          "layer_types ['full_attention', 'full_attention'] (model: ['sliding_attention', ")),
])
def test_hf_load_of_another_architecture_is_refused(tmp_path, capsys, monkeypatch, model_type, changes, config,
                                                    fields):
    monkeypatch.delenv("RANK", raising=False)
    hf_config = _hf_config(model_type)
    for name, value in changes.items():
        setattr(hf_config, name, value)
    hf_config.save_pretrained(tmp_path)  # config.json alone: refused before any weight is read
    argv = ["--module", "dtensor_moe.titan", "--config", config, "--checkpoint.enable",
            "--checkpoint.initial_load_path", str(tmp_path), "--checkpoint.initial_load_in_hf"]
    line = _refused(capsys, argv)
    assert "checkpoint.initial_load_path" in line and "valid:" in line, line
    for field in fields:
        assert field in line, line


def test_hf_load_of_the_same_architecture_passes(tmp_path):
    from torchtitan.config import ConfigManager

    for model_type, config in (("qwen3_moe", "qwen3_moe_tiny_cpu"), ("deepseek_v3", "deepseek_v3_hf_cpu"),
                               ("gpt_oss", "gpt_oss_tiny_cpu")):
        _hf_config(model_type).save_pretrained(tmp_path / model_type)
        ConfigManager().parse_args(["--module", "dtensor_moe.titan", "--config", config, "--checkpoint.enable",
                                    "--checkpoint.initial_load_path", str(tmp_path / model_type),
                                    "--checkpoint.initial_load_in_hf"])


def test_qwen3_hf_export_of_a_trained_routing_bias_is_refused(capsys, monkeypatch):
    from dataclasses import replace

    from torchtitan.config import ConfigManager
    from torchtitan.models.qwen3.config_registry import qwen3_moe_debug

    from dtensor_moe.titan import wrap_config

    monkeypatch.delenv("RANK", raising=False)
    export = ["--module", "dtensor_moe.titan", "--checkpoint.enable", "--checkpoint.last_save_model_only",
              "--checkpoint.last_save_in_hf"]
    # torchtitan's own Qwen3 config trains the bias (load_balance_coeff 1e-3): wrapped with an HF export, refused.
    theirs = qwen3_moe_debug()
    theirs.checkpoint = replace(theirs.checkpoint, enable=True, last_save_model_only=True, last_save_in_hf=True)
    with pytest.raises(SystemExit):
        wrap_config(theirs)
    assert "has no key for layers.0.moe.expert_bias_E" in capsys.readouterr().err
    line = _refused(capsys, [*export, "--config", "qwen3_moe_tiny_cpu", "--dtensor_moe.load_balance_coeff", "1e-3"])
    assert "layers.0.moe.expert_bias_E" in line and "--dtensor_moe.load_balance_coeff 0" in line, line
    # The hook's Qwen3 configs train none (and export float32); DeepSeek-V3's format keeps the bias.
    config = ConfigManager().parse_args([*export, "--config", "qwen3_moe_tiny_cpu"])
    assert all(layer.moe.load_balance_coeff is None for layer in config.model_spec.model.layers)
    assert config.checkpoint.export_dtype == "float32"
    config = ConfigManager().parse_args([*export, "--config", "deepseek_v3_hf_cpu"])
    assert all(layer.moe.load_balance_coeff == 1e-3 for layer in config.model_spec.model.layers[1:])
    config = ConfigManager().parse_args([*export, "--config", "qwen3_moe_tiny_cpu", "--checkpoint.export_dtype",
                                         "bfloat16", "--dtensor_moe.load_balance_coeff", "0"])
    assert config.checkpoint.export_dtype == "bfloat16"


def test_cli_export_of_a_torchtitan_checkpoint_refuses_a_trained_qwen3_bias(tmp_path, capsys):
    """A DCP checkpoint of the hook's tiny Qwen3 config plus the routing bias a --dtensor_moe.load_balance_coeff run
    trains (which Qwen3-MoE's format has no key for): refused in one line naming it; without it, exported."""
    import torch.distributed.checkpoint as dcp

    from dtensor_moe.cli import main
    from dtensor_moe.titan.config_registry import CONFIGS
    from dtensor_moe.train.checkpoint import single_process_ok

    torch.manual_seed(0)
    state = CONFIGS["qwen3_moe_tiny_cpu"]().model_spec.model.build().state_dict()
    with single_process_ok():
        dcp.save(state, checkpoint_id=tmp_path / "plain", no_dist=True)
        dcp.save({**state, "layers.0.moe.expert_bias_E": torch.ones(8)}, checkpoint_id=tmp_path / "biased",
                 no_dist=True)
    argv = ["--titan-config", "qwen3_moe_tiny_cpu"]
    assert main(["export", str(tmp_path / "biased"), "--hf", str(tmp_path / "out"), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds layers.0.moe.expert_bias_E" in err[0] and "load_balance_coeff" in err[0], err
    assert main(["export", str(tmp_path / "plain"), "--hf", str(tmp_path / "out"), *argv]) == 0
    assert main(["export", str(tmp_path / "nothing"), "--hf", str(tmp_path / "out2"), *argv]) == 2
    assert "is not a DCP checkpoint" in capsys.readouterr().err


def test_cli_export_of_a_gpt_oss_checkpoint(tmp_path, capsys):
    """A DCP checkpoint of gpt_oss_tiny_cpu, which trains the routing bias unless told not to: refused in one line
    naming it (gpt-oss's format has none); without it, exported under transformers' keys and shapes."""
    import torch.distributed.checkpoint as dcp
    import transformers as tf
    from safetensors import safe_open

    from dtensor_moe.cli import main
    from dtensor_moe.titan.config_registry import CONFIGS
    from dtensor_moe.train.checkpoint import single_process_ok

    torch.manual_seed(0)
    state = CONFIGS["gpt_oss_tiny_cpu"]().model_spec.model.build().state_dict()
    assert "layers.0.moe.expert_bias_E" in state
    with single_process_ok():
        dcp.save(state, checkpoint_id=tmp_path / "biased", no_dist=True)
        dcp.save({k: t for k, t in state.items() if not k.endswith("expert_bias_E")}, checkpoint_id=tmp_path / "plain",
                 no_dist=True)
    argv = ["--titan-config", "gpt_oss_tiny_cpu"]
    assert main(["export", str(tmp_path / "biased"), "--hf", str(tmp_path / "out"), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds layers.0.moe.expert_bias_E" in err[0] and "load_balance_coeff 0" in err[0], err
    assert main(["export", str(tmp_path / "plain"), "--hf", str(tmp_path / "out"), *argv]) == 0
    with safe_open(tmp_path / "out" / "model.safetensors", "pt") as sf:
        shapes = {k: tuple(sf.get_slice(k).get_shape()) for k in sf.keys()}
    with torch.device("meta"):
        theirs = tf.AutoModelForCausalLM.from_config(tf.AutoConfig.from_pretrained(tmp_path / "out")).state_dict()
    assert shapes == {k: tuple(t.shape) for k, t in theirs.items()}
    assert shapes["model.layers.0.mlp.experts.gate_up_proj"] == (8, 64, 64)
    assert shapes["model.layers.0.mlp.experts.down_proj"] == (8, 32, 64)
