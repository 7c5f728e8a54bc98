"""Bad Hugging Face inputs, filesystem faults, missing extras and API misuse (issue 40, classes 3, 4, 5, 7 and the
hf_path / import-then-resume items of 1 and 8): each refused in one line naming the key, file, type or package,
before any rank starts, leaving nothing behind. In-process: `cli.main` returns before a launch, so nothing here
starts a rank (the checks read config.json, the index and the headers, and build transformers' model on the meta
device)."""

import errno
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

from dtensor_moe import cli

from .hf_models import hf_model

GATE0 = "model.layers.0.mlp.experts.0.gate_proj.weight"


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """A tiny byte-level Qwen3-MoE checkpoint the main job can train (vocab 256), in one file and in shards."""
    import transformers as tf

    root = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    config = tf.Qwen3MoeConfig(vocab_size=256, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                               num_key_value_heads=1, head_dim=8, moe_intermediate_size=8, intermediate_size=16,
                               num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=64)
    model = tf.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(root / "one")
    model.save_pretrained(root / "sharded", max_shard_size="20KB")
    assert len(list((root / "sharded").glob("*.safetensors"))) > 2
    return root


def _copy(src: Path, dst: Path, config=None, weights=None) -> Path:
    """`src` copied to `dst`, its config.json passed through `config`, its weights through `weights`."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    if config is not None:
        (dst / "config.json").write_text(json.dumps(config(json.loads((dst / "config.json").read_text()))))
    if weights is not None:
        save_file(weights(load_file(dst / "model.safetensors")), dst / "model.safetensors")
    return dst


def _garbage(d: Path):
    (d / "model.safetensors").write_bytes(os.urandom(4096))


def _truncate(d: Path):
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[:-64])


def _drop_shard(d: Path):
    shard = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]["model.norm.weight"]
    (d / shard).unlink()
    return shard


# name -> (source, config edit, weights edit, a file edit, the words the one line must hold)
CASES = {
    "garbage weights file": ("one", None, None, _garbage, ["model.safetensors", "not a readable safetensors file"]),
    "truncated weights file": ("one", None, None, _truncate, ["model.safetensors", "truncated"]),
    "no weights file": ("one", None, None, lambda d: (d / "model.safetensors").unlink(),
                        ["holds no safetensors weights", "expected"]),
    "missing shard": ("sharded", None, None, _drop_shard, ["is missing", "model.safetensors.index.json names it"]),
    "garbage shard index": ("sharded", None, None,
                            lambda d: (d / "model.safetensors.index.json").write_text("[1, 2"),
                            ["model.safetensors.index.json", "weight_map"]),
    "wrong-shaped tensor": ("one", None, lambda w: {**w, "model.embed_tokens.weight": torch.zeros(256, 8)}, None,
                            ["model.embed_tokens.weight has shape (256, 8), expected (256, 16)"]),
    "extra expert tensor": ("one", None,
                            lambda w: {**w, "model.layers.0.mlp.experts.4.gate_proj.weight": w[GATE0].clone()}, None,
                            ["model.layers.0.mlp.experts.4.gate_proj.weight", "is unexpected"]),
    "config.json disagrees (hidden_size)": ("one", lambda c: {**c, "hidden_size": 32}, None, None,
                                            ["has shape", "expected (32"]),
    "missing non-expert tensor": ("one", None, lambda w: {k: v for k, v in w.items() if k != "model.norm.weight"},
                                  None, ["model.norm.weight (shape (16,)) is missing"]),
    "config.json type error": ("one", lambda c: {**c, "num_experts": "4"}, None, None,
                               ["config.json's 'num_experts' must be an int, got '4'"]),
    "config.json range error": ("one", lambda c: {**c, "num_experts_per_tok": 9}, None, None,
                                ["config.json's 'num_experts_per_tok' (9) must be <= 'num_experts' (4)"]),
}


def _bad(ckpts, tmp_path, case) -> tuple[Path, list[str]]:
    src, config, weights, edit, words = CASES[case]
    d = _copy(ckpts / src, tmp_path / "hf", config, weights)
    if edit is not None:
        edit(d)
    return d, words


def _one_line(capsys, command: str) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"dtensor-moe {command}: "), err
    assert "Traceback" not in err[0]
    return err[0]


def _hf_toml(tmp_path, hf: Path) -> Path:
    cfg = tmp_path / "hf.toml"
    cfg.write_text(f'[model]\nhf_path = "{hf}"\nload_balance = "aux_loss"\n[parallel]\nnproc = 2\nep = 2\n'
                   "[training]\nsteps = 2\nseq_len = 16\nglobal_batch = 4\n")
    return cfg


@pytest.mark.parametrize("case", sorted(CASES))
def test_train_refuses_a_bad_hf_path_checkpoint_before_launch(case, ckpts, tmp_path, capsys):
    """Found from config.json, the index and the headers before any rank starts; the line names the file or key."""
    d, words = _bad(ckpts, tmp_path, case)
    run = tmp_path / "run"
    assert cli.main(["train", "--config", str(_hf_toml(tmp_path, d)), "--run-dir", str(run)]) == 2
    line = _one_line(capsys, "train")
    assert f"model.hf_path '{d}'" in line, line
    for w in words:
        assert w in line, (w, line)
    assert not run.exists()  # no rank started


@pytest.mark.parametrize("case", ["garbage weights file", "truncated weights file", "missing shard",
                                  "extra expert tensor", "config.json type error", "garbage shard index"])
def test_import_hf_refuses_a_bad_checkpoint_in_one_line(case, ckpts, tmp_path, capsys):
    d, words = _bad(ckpts, tmp_path, case)
    assert cli.main(["import", "--hf", str(d), str(tmp_path / "out")]) == 2
    line = _one_line(capsys, "import")
    for w in words:
        assert w in line, (w, line)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss"])
def test_the_check_passes_every_family_saved_by_transformers(model_type, tmp_path):
    """No false alarm: save_pretrained's own checkpoints, in one file and in shards, pass whole."""
    from safetensors.torch import load_file

    from dtensor_moe.hf.checkpoint import check_hf_checkpoint

    model = hf_model(model_type)
    model.save_pretrained(tmp_path / "one")
    model.save_pretrained(tmp_path / "sharded", max_shard_size="4KB")
    keys = set(load_file(tmp_path / "one" / "model.safetensors"))
    assert set(check_hf_checkpoint(tmp_path / "one")) == keys
    assert set(check_hf_checkpoint(tmp_path / "sharded")) == keys


def test_keys_transformers_ignores_pass_the_check(tmp_path):
    """A real DeepSeek-V3 checkpoint holds its multi-token-prediction layer as model.layers.61.* , which
    transformers' model ignores on load (`_keys_to_ignore_on_load_unexpected`): the check before launch ignores
    them too instead of refusing the checkpoint as holding keys the model does not have."""
    from safetensors.torch import load_file, save_file

    from dtensor_moe.hf.checkpoint import check_hf_checkpoint

    hf_model("deepseek_v3").save_pretrained(tmp_path / "ds")
    weights = load_file(tmp_path / "ds" / "model.safetensors")
    mtp = {"model.layers.61.enorm.weight": torch.ones(4), "model.layers.61.eh_proj.weight": torch.zeros(4, 8)}
    save_file({**weights, **mtp}, tmp_path / "ds" / "model.safetensors", metadata={"format": "pt"})
    assert set(check_hf_checkpoint(tmp_path / "ds")) == set(weights) | set(mtp)


def test_checkpoint_numel_counts_the_index_once(ckpts):
    from safetensors.torch import load_file

    from dtensor_moe.train.hf_config import checkpoint_numel

    want = sum(t.numel() for t in load_file(ckpts / "one" / "model.safetensors").values())
    assert checkpoint_numel(str(ckpts / "one")) == checkpoint_numel(str(ckpts / "sharded")) == want


# --- filesystem faults: one line, rc 2, nothing left behind ------------------------------------------------------


def _no_space(*args, **kwargs):
    from safetensors import SafetensorError

    path = Path(args[1])
    path.write_bytes(b"half a file")  # what a full disk leaves: a partial file
    raise SafetensorError(f"Error while serializing: I/O error: No space left on device (os error 28) at path {path}")


def _leftovers(*dirs: Path) -> list[str]:
    return [str(p) for d in dirs if d.exists() for p in d.rglob(".*")]


def test_import_hf_on_a_full_disk_leaves_no_temporary_file(ckpts, tmp_path, capsys, monkeypatch):
    import dtensor_moe.train.hf_checkpoint as hf_checkpoint

    monkeypatch.setattr(hf_checkpoint, "save_file", _no_space)
    out = tmp_path / "target" / "out"
    assert cli.main(["import", "--hf", str(ckpts / "one"), str(out)]) == 2
    line = _one_line(capsys, "import")
    assert f"cannot write {out}: No space left on device" in line, line
    assert not _leftovers(tmp_path / "target") and not (out / "model.safetensors").exists()


def test_export_hf_into_a_read_only_directory_is_one_line(ckpts, tmp_path, capsys, monkeypatch):
    assert cli.main(["import", "--hf", str(ckpts / "one"), str(tmp_path / "ours")]) == 0
    capsys.readouterr()

    def read_only(self, *args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", str(self))

    monkeypatch.setattr(Path, "mkdir", read_only)
    out = tmp_path / "ro" / "out"
    assert cli.main(["export", str(tmp_path / "ours"), "--hf", str(out)]) == 2
    assert f"cannot write {out}: Read-only file system" in _one_line(capsys, "export")
    assert not _leftovers(tmp_path / "ro")


def test_export_hf_refused_before_writing_when_the_disk_is_too_small(ckpts, tmp_path, capsys, monkeypatch):
    import shutil as sh

    assert cli.main(["import", "--hf", str(ckpts / "one"), str(tmp_path / "ours")]) == 0
    capsys.readouterr()
    monkeypatch.setattr(sh, "disk_usage", lambda p: sh._ntuple_diskusage(1 << 20, 1 << 20, 1000))
    assert cli.main(["export", str(tmp_path / "ours"), "--hf", str(tmp_path / "out")]) == 2
    assert "its disk has 1000 bytes free; free space or choose another directory" in _one_line(capsys, "export")
    assert not (tmp_path / "out").exists()


def _main_job_export(out: Path) -> Path:
    """A main-job model's weights as `dtensor-moe export` writes them (model.safetensors + config.json)."""
    from dataclasses import asdict

    from safetensors.torch import save_file

    from dtensor_moe.experts import split_gate_up
    from dtensor_moe.train.config import ModelConfig
    from dtensor_moe.train.model import MoETransformer

    cfg = ModelConfig(dim=16, n_layers=1, n_heads=2, num_experts=4, top_k=2, hidden_dim=8, max_seq_len=16)
    out.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in split_gate_up(MoETransformer(cfg).state_dict()).items()},
              out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(asdict(cfg)))
    return out / "model.safetensors"


def test_export_of_a_main_job_checkpoint_on_a_full_disk_is_one_line(tmp_path, capsys, monkeypatch):
    import dtensor_moe.train.export as export

    assert cli.main(["import", str(_main_job_export(tmp_path / "w")), str(tmp_path / "ckpt")]) == 0
    capsys.readouterr()
    monkeypatch.setattr(export, "save_file", _no_space)
    out = tmp_path / "t" / "out"
    assert cli.main(["export", str(tmp_path / "ckpt"), str(out)]) == 2
    assert f"cannot write {out}: No space left on device" in _one_line(capsys, "export")
    assert not _leftovers(tmp_path / "t")


def test_import_into_a_full_disk_is_one_line(tmp_path, capsys, monkeypatch):
    import dtensor_moe.train.export as export
    from dtensor_moe.train.checkpoint import SaveError

    def full(*args, **kwargs):
        raise SaveError("saving checkpoint step 0 into X failed: rank 0: OSError: [Errno 28] No space left on device")

    monkeypatch.setattr(export, "save", full)
    weights = _main_job_export(tmp_path / "w")
    assert cli.main(["import", str(weights), str(tmp_path / "ckpt")]) == 2
    assert "No space left on device" in _one_line(capsys, "import")


# --- class 8: import then train --resume ------------------------------------------------------------------------


def test_train_resume_after_import_into_the_run_dir_names_the_fix(tmp_path, capsys):
    run = tmp_path / "run"
    assert cli.main(["import", str(_main_job_export(tmp_path / "w")), str(run)]) == 0
    capsys.readouterr()
    cfg = tmp_path / "tiny.toml"
    cfg.write_text("[model]\ndim = 16\nn_layers = 1\nn_heads = 2\nnum_experts = 4\ntop_k = 2\nhidden_dim = 8\n"
                   "max_seq_len = 16\n[training]\nsteps = 2\nseq_len = 8\nglobal_batch = 2\n")
    assert cli.main(["train", "--config", str(cfg), "--run-dir", str(run), "--resume"]) == 2
    line = _one_line(capsys, "train")
    assert f"--resume looks for checkpoints in {run / 'checkpoints'}" in line and f"pass --resume {run}" in line, line


# --- class 5: missing optional packages, each one line with an install hint before launch -----------------------


def _without(monkeypatch, package: str, *purge: str):
    """`package` not installed (import and find_spec both fail), and the modules that imported it forgotten."""
    for name in list(sys.modules):
        if name == package or name.startswith(f"{package}.") or name.startswith(purge):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, package, None)


def test_export_without_safetensors_says_how_to_install_it(tmp_path, capsys, monkeypatch):
    _without(monkeypatch, "safetensors", "dtensor_moe.cli.export", "dtensor_moe.train.export",
             "dtensor_moe.train.hf_checkpoint", "dtensor_moe.hf", "dtensor_moe.titan.hf_export")
    assert cli.main(["export", str(tmp_path / "ckpt"), str(tmp_path / "out")]) == 2
    assert "needs safetensors, which is not installed: pip install safetensors" in _one_line(capsys, "export")


def test_export_titan_config_without_torchtitan_says_how_to_install_it(tmp_path, capsys, monkeypatch):
    _without(monkeypatch, "torchtitan", "dtensor_moe.titan")
    argv = ["export", str(tmp_path / "ckpt"), "--hf", str(tmp_path / "out"), "--titan-config", "qwen3_debug"]
    assert cli.main(argv) == 2
    assert "needs torchtitan, which is not installed: pip install 'dtensor_moe[titan]'" in _one_line(capsys, "export")


@pytest.mark.parametrize("package", ["transformers", "safetensors"])
def test_train_hf_path_without_its_extras_says_how_to_install_them(package, ckpts, tmp_path, capsys, monkeypatch):
    _without(monkeypatch, package, "dtensor_moe.hf", "dtensor_moe.train.hf_config")
    run = tmp_path / "run"
    assert cli.main(["train", "--config", str(_hf_toml(tmp_path, ckpts / "one")), "--run-dir", str(run)]) == 2
    line = _one_line(capsys, "train")
    assert f"needs {package}" in line and "pip install 'dtensor_moe[hf]'" in line, line
    assert not run.exists()


def test_train_without_tqdm_is_refused_before_launch(tmp_path, capsys, monkeypatch):
    _without(monkeypatch, "tqdm")
    cfg = tmp_path / "tiny.toml"
    cfg.write_text("[model]\ndim = 16\nn_layers = 1\nn_heads = 2\nnum_experts = 4\ntop_k = 2\nhidden_dim = 8\n"
                   "max_seq_len = 16\n[training]\nsteps = 1\nseq_len = 8\nglobal_batch = 2\n")
    assert cli.main(["train", "--config", str(cfg), "--run-dir", str(tmp_path / "run")]) == 2
    assert "needs tqdm for the progress bar: pip install tqdm" in _one_line(capsys, "train")
    assert not (tmp_path / "run").exists()


def test_a_broken_tqdm_is_refused_before_launch(tmp_path, monkeypatch):
    """Installed (found) but failing to import: it would fail on every rank after launch; now one line before."""
    from dtensor_moe.train.prelaunch import check_before_launch

    broken = tmp_path / "site" / "tqdm"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise RuntimeError('half-installed')\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.delitem(sys.modules, "tqdm", raising=False)
    with pytest.raises(ValueError, match=r"needs tqdm for the progress bar: .*; it is installed but fails to import "
                                         r"\(RuntimeError: half-installed\)"):
        check_before_launch(str(tmp_path / "run"), None)


# --- class 7: the Python API names the type it wanted ------------------------------------------------------------


def test_parallelize_hf_model_given_a_string_for_dims_names_the_type():
    from dtensor_moe.hf import parallelize_hf_model

    with pytest.raises(TypeError, match=r"dims must be a MoEParallelDims \(e.g. MoEParallelDims\(world_size, ep=2\)\)"
                                        r", got str 'ep2'"):
        parallelize_hf_model(hf_model("qwen3_moe"), "ep2", device_type="cpu")


def test_save_hf_of_a_plain_transformers_model_says_to_use_save_pretrained(tmp_path):
    from dtensor_moe.hf import save_hf

    with pytest.raises(ValueError, match=r"has none: save a plain transformers model with its own "
                                         r"model.save_pretrained\(dir\)"):
        save_hf(hf_model("mixtral"), tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(TypeError, match="save_hf takes a transformers causal LM"):
        save_hf({"weights": 1}, tmp_path / "out")


@pytest.mark.parametrize("config, error, message", [
    ({"model_type": "qwen3_moe", "hidden_size": 8, "moe_intermediate_size": 6, "num_experts_per_tok": 2},
     ValueError, "config.json) has no 'num_experts' (qwen3_moe's routed experts"),
    ({"model_type": "mixtral", "hidden_size": 8, "intermediate_size": 6, "num_local_experts": "4",
      "num_experts_per_tok": 2}, ValueError, "config.json's 'num_local_experts' must be an int, got '4' (str)"),
    ({"model_type": "deepseek_v3", "hidden_size": 8, "moe_intermediate_size": 6, "n_routed_experts": 4,
      "num_experts_per_tok": 8}, ValueError, "config.json's 'num_experts_per_tok' (8) must be <= 'n_routed_experts'"),
    ({"model_type": "qwen3_moe", "hidden_size": 8, "moe_intermediate_size": 6, "num_experts": 4,
      "num_experts_per_tok": 2, "norm_topk_prob": "yes"}, ValueError, "config.json's 'norm_topk_prob' must be a bool"),
    ([("model_type", "qwen3_moe")], TypeError, "transformers config object or config.json's dict"),
])
def test_moe_config_from_hf_names_the_config_json_key(config, error, message):
    from dtensor_moe.hf import moe_config_from_hf

    with pytest.raises(error) as e:
        moe_config_from_hf(config)
    assert message in str(e.value), str(e.value)
