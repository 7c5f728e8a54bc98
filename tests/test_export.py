"""Export to safetensors and import back: bit-exact, into a single process and into a sharded mesh."""

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from dtensor_moe import cli
from dtensor_moe.experts import split_gate_up
from dtensor_moe.train import export
from dtensor_moe.train.checkpoint import latest, load, save
from dtensor_moe.train.config import ModelConfig

from .harness import run_on_ranks
from .test_checkpoint import CFG, _full, build, train


def _train_and_save(rank, world, root):
    model, opt, sched = build(world, SAVED_DIMS, seed=0)
    train(model, opt, sched, range(3), rank, world)
    save(root, 3, model, opt)
    state = {k: _full(v) for k, v in get_model_state_dict(model).items()}
    return state if rank == 0 else None


SAVED_DIMS = {"ep": 2}  # EDP2 x EP2 on 4 ranks: experts are FSDP-sharded on the EP dim (strided)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A checkpoint saved on 4 ranks, exported with the CLI; returns (weights file, full model state).
    Once per module: the tests only read it."""
    tmp_path = tmp_path_factory.mktemp("exported")
    want = run_on_ranks(4, _train_and_save, str(tmp_path / "run"))[0]
    assert cli.main(["export", str(tmp_path / "run"), str(tmp_path / "out")]) == 0
    return tmp_path / "out" / export.WEIGHTS, want


def test_export_file_opens_with_safetensors_and_keeps_names(exported):
    path, want = exported
    got = load_file(path)
    want = split_gate_up(want)  # the file holds torchtitan's names: our w13 as w1 and w3
    assert got.keys() == want.keys()
    assert "layers.0.moe.experts.w1" in got and got["layers.0.moe.experts.w1"].shape == (
        CFG.num_experts,
        CFG.hidden_dim,
        CFG.dim,
    )
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    assert json.loads(path.with_name(export.CONFIG).read_text()) == dataclasses.asdict(CFG)


def test_import_cli_round_trip_bit_exact(exported, tmp_path):
    path, want = exported
    assert cli.main(["import", str(path), str(tmp_path / "imported"), "--step", "5"]) == 0
    ckpt = latest(tmp_path / "imported")
    assert ckpt.name == "step_00000005"
    model, _, _ = build(1, None, seed=1)
    assert load(ckpt, model)["step"] == 5
    for k, v in want.items():
        assert torch.equal(model.state_dict()[k], v), k


def _import_sharded(rank, world, path, dims):
    model, _, _ = build(world, dims, seed=1)
    export.load_safetensors_into(model, path)
    state = {k: _full(v) for k, v in get_model_state_dict(model).items()}
    return state if rank == 0 else None


@pytest.mark.parametrize("dims", [{"ep": 2}, {"dp_replicate": 2, "etp": 2}], ids=["EDP2xEP2", "HSDP2xETP2"])
def test_load_safetensors_into_sharded_mesh_bit_exact(exported, dims):
    path, want = exported
    got = run_on_ranks(4, _import_sharded, str(path), dims)[0]
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert torch.equal(got[k], v), k


def test_import_into_other_config_names_the_differences(exported):
    path, _ = exported
    model, _, _ = build(1, None, seed=0, cfg=ModelConfig(**{**CFG.__dict__, "num_experts": 8}))
    with pytest.raises(
        ValueError, match=r"layers\.0\.moe\.experts\.w1: file \[4, 8, 16\] vs model \[8, 8, 16\]"
    ) as err:
        export.load_safetensors_into(model, path)
    assert "num_experts: saved 4 vs model 8" in str(err.value)


# --- bad input: one line on stderr, rc 2, nothing replaced ------------------------------------


@pytest.fixture
def one_process_export(tmp_path):
    """A full checkpoint (model + AdamW) at step 3 saved by one process, and its export."""
    model, opt, sched = build(1, None, seed=0)
    train(model, opt, sched, range(3), 0, 1)
    save(tmp_path / "run", 3, model, opt)
    assert cli.main(["export", str(tmp_path / "run"), str(tmp_path / "out")]) == 0
    return tmp_path / "run", tmp_path / "out" / export.WEIGHTS


def _optim_keys(ckpt):
    import torch.distributed.checkpoint as dcp

    return [k for k in dcp.FileSystemReader(ckpt).read_metadata().state_dict_metadata if k.startswith("optim.")]


def test_import_refuses_to_replace_a_training_checkpoint_without_force(one_process_export, capsys):
    root, weights = one_process_export
    ckpt = root / "step_00000003"
    before = {p.name: p.read_bytes() for p in ckpt.iterdir()}
    assert cli.main(["import", str(weights), str(root), "--step", "3"]) == 2
    err = capsys.readouterr().err
    assert err == (f"dtensor-moe import: {ckpt} already exists and holds a full training checkpoint (model + optimizer "
                   f"state); pass --force to replace it with weights only, or choose another --step\n")
    assert {p.name: p.read_bytes() for p in ckpt.iterdir()} == before and _optim_keys(ckpt)

    assert cli.main(["import", str(weights), str(root), "--step", "3", "--force"]) == 0
    assert f"replaced {ckpt}: its optimizer state is deleted; resuming it starts AdamW fresh" in capsys.readouterr().err
    assert not _optim_keys(ckpt)


def test_export_refuses_to_replace_files_without_force(one_process_export, tmp_path, capsys):
    """An output directory that already holds a model (here a Hugging Face one's two files) is left as it was, in one
    line naming --force; with --force the export replaces them."""
    root, _ = one_process_export
    out = tmp_path / "hf_model"
    out.mkdir()
    theirs = {export.WEIGHTS: b"their weights", export.CONFIG: b'{"model_type": "qwen3_moe"}', "tokenizer.json": b"{}"}
    for name, data in theirs.items():
        (out / name).write_bytes(data)
    assert cli.main(["export", str(root), str(out)]) == 2
    assert capsys.readouterr().err == (f"dtensor-moe export: {out} already holds ['model.safetensors', 'config.json']; "
                                       "pass --force to replace them, or choose another directory\n")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == theirs
    assert cli.main(["export", str(root), str(out), "--force"]) == 0
    capsys.readouterr()
    assert (out / export.WEIGHTS).read_bytes() != theirs[export.WEIGHTS]
    assert (out / "tokenizer.json").read_bytes() == b"{}"


def test_sigterm_during_export_leaves_nothing(one_process_export, tmp_path, capsys, monkeypatch):
    """SIGTERM while the weights are written: rc 143, one line, no hidden partial folder beside OUT, OUT not made."""
    import os
    import signal

    root, _ = one_process_export
    save_file = export.save_file

    def killed(*args, **kwargs):
        save_file(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(export, "save_file", killed)
    out = tmp_path / "exported"
    assert cli.main(["export", str(root), str(out)]) == 128 + signal.SIGTERM
    assert capsys.readouterr().err == "dtensor-moe export: stopped by SIGTERM; its temporary files were removed\n"
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".exported")]


def test_export_of_a_damaged_checkpoint_names_it(one_process_export, tmp_path, capsys):
    root, _ = one_process_export
    from .test_checkpoint import _flip

    _flip(root / "step_00000003" / "__0_0.distcp")
    assert cli.main(["export", str(root / "step_00000003"), str(tmp_path / "out2")]) == 2
    assert capsys.readouterr().err == (f"dtensor-moe export: checkpoint {root / 'step_00000003'} cannot be loaded: "
                                       f"__0_0.distcp is corrupted (sha256 differs from manifest.json)\n")
    assert not (tmp_path / "out2").exists()


@pytest.mark.parametrize("argv,message", [
    ([], "export CKPT needs an output: OUT (a directory for model.safetensors and config.json) or --hf OUT_DIR"),
    (["out", "--model-type", "mixtral"], "--model-type goes with --hf; export CKPT OUT does not take it"),
])
def test_export_without_output_or_with_hf_only_flags_says_which(tmp_path, capsys, argv, message):
    assert cli.main(["export", str(tmp_path / "ckpt"), *argv]) == 2
    assert capsys.readouterr().err == f"dtensor-moe export: {message}\n"


@pytest.mark.parametrize(
    "setup,message",
    [
        (
            lambda w: w.unlink(),
            "no safetensors file at '{w}'; give model.safetensors written by `dtensor-moe export`, or its directory",
        ),
        (lambda w: w.write_bytes(b"\0" * 7), "{w} is not a readable safetensors file"),
        (lambda w: w.with_name(export.CONFIG).write_text("{"), "{c} is not valid JSON"),
    ],
    ids=["missing", "damaged", "bad-config-json"],
)
def test_import_bad_files(one_process_export, tmp_path, capsys, setup, message):
    _, weights = one_process_export
    setup(weights)
    assert cli.main(["import", str(weights), str(tmp_path / "new")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dtensor-moe import: " + message.format(w=weights, c=weights.with_name(export.CONFIG))), err
    assert err.count("\n") == 1


def test_safetensors_into_a_model_whose_config_keeps_the_shapes(one_process_export):
    _, weights = one_process_export
    model, _, _ = build(1, None, seed=0, cfg=ModelConfig(**{**CFG.__dict__, "n_heads": 4, "top_k": 1}))
    with pytest.raises(
        ValueError, match=r"model config differs: n_heads: saved 2 vs model 4, top_k: saved 2 vs model 1"
    ):
        export.load_safetensors_into(model, weights)


# --- export --hf of a main-job checkpoint -----------------------------------------------------

QWEN3_CFG = ModelConfig(**{**CFG.__dict__, "num_shared_experts": 0, "load_balance": "aux_loss"})  # qwen3_moe's MoE


def _train_and_save_qwen3(rank, world, root):
    model, opt, sched = build(world, {"ep": 2}, seed=0, cfg=QWEN3_CFG)
    train(model, opt, sched, range(2), rank, world)
    save(root, 2, model, opt)
    state = {k: _full(v) for k, v in get_model_state_dict(model).items()}
    return state if rank == 0 else None


def test_export_hf_of_a_main_job_checkpoint_round_trips(tmp_path):
    """export --hf --model-type qwen3_moe of a checkpoint the main job saved on 2 ranks (EP2; its files hold the
    experts' gate and up as torchtitan's w1 / w3), then import --hf of what it wrote: every MoE tensor of the
    trained model again, bit for bit; the Hugging Face file's gate_proj / up_proj / down_proj are w13's halves and
    w2 expert by expert."""
    want = run_on_ranks(2, _train_and_save_qwen3, str(tmp_path / "run"))[0]
    assert cli.main(["export", str(tmp_path / "run"), "--hf", str(tmp_path / "hf"), "--model-type", "qwen3_moe"]) == 0
    hf = load_file(tmp_path / "hf" / "model.safetensors")
    E = QWEN3_CFG.num_experts
    for i in range(QWEN3_CFG.n_layers):
        w13, w2 = want[f"layers.{i}.moe.experts.w13"], want[f"layers.{i}.moe.experts.w2"]
        assert torch.equal(hf[f"model.layers.{i}.mlp.gate.weight"], want[f"layers.{i}.moe.router.gate.weight"])
        for e in range(E):
            for name, w in (("gate", w13[e, 0]), ("up", w13[e, 1]), ("down", w2[e])):
                assert torch.equal(hf[f"model.layers.{i}.mlp.experts.{e}.{name}_proj.weight"], w), (i, e, name)
    assert len(hf) == QWEN3_CFG.n_layers * (1 + 3 * E)
    assert cli.main(["import", "--hf", str(tmp_path / "hf"), str(tmp_path / "ours")]) == 0
    ours = load_file(tmp_path / "ours" / "model.safetensors")
    moe = {k: v for k, v in want.items() if ".moe." in k}
    assert ours.keys() == moe.keys()
    for k, v in ours.items():
        assert torch.equal(v, moe[k]), k


def test_our_checkpoint_without_its_manifest_is_not_taken_for_torchtitans(tmp_path):
    """A main-job checkpoint whose manifest.json was lost is still ours (the loader then names the opt-in); only a
    DCP directory with none of our files is torchtitan's (export --titan-config)."""
    from dtensor_moe.cli.export import _torchtitan_checkpoint

    ours, titan = tmp_path / "step_00000004", tmp_path / "step-4"
    for d in (ours, titan):
        d.mkdir()
        (d / ".metadata").write_bytes(b"")
        (d / "__0_0.distcp").write_bytes(b"")
    (ours / "model_config.json").write_text("{}")
    (ours / "train_state.pt").write_bytes(b"")
    assert not _torchtitan_checkpoint(ours) and _torchtitan_checkpoint(titan)


def test_writers_publish_by_rename(tmp_path):
    """The atomic writers' invariant: the file a reader finds is the very file written in full beside it (moved by a
    rename, the same inode), never a copy made into place (a kill mid-copy leaves a half file); the old file is
    whole until then, and a writer that fails leaves it as it was."""
    import os

    from dtensor_moe.durable import write_atomic
    from dtensor_moe.hf.model import write_files

    out = tmp_path / "out"
    out.mkdir()
    (out / "a.bin").write_bytes(b"old")
    written = {}

    def write(p):
        p.write_bytes(b"new" * 1000)
        written["ino"] = os.stat(p).st_ino

    def fail(p):
        p.write_bytes(b"half")
        raise OSError(28, "No space left on device")

    with pytest.raises(ValueError, match="No space left on device"):
        write_files(out, {"a.bin": fail})
    assert (out / "a.bin").read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    write_files(out, {"a.bin": write})
    assert os.stat(out / "a.bin").st_ino == written["ino"] and (out / "a.bin").read_bytes() == b"new" * 1000
    target = tmp_path / "meta.json"
    target.write_bytes(b"old")
    before = os.stat(target).st_ino
    write_atomic(target, lambda f: f.write(b"{}"))
    assert target.read_bytes() == b"{}" and os.stat(target).st_ino != before  # a new file renamed over the old
