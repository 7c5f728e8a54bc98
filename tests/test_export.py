"""Export to safetensors and import back: bit-exact, into a single process and into a sharded mesh."""

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from dtensor_moe import cli
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


@pytest.fixture
def exported(tmp_path):
    """A checkpoint saved on 4 ranks, exported with the CLI; returns (weights file, full model state)."""
    want = run_on_ranks(4, _train_and_save, str(tmp_path / "run"))[0]
    assert cli.main(["export", str(tmp_path / "run"), str(tmp_path / "out")]) == 0
    return tmp_path / "out" / export.WEIGHTS, want


def test_export_file_opens_with_safetensors_and_keeps_names(exported):
    path, want = exported
    got = load_file(path)
    assert got.keys() == want.keys()
    assert "layers.0.moe.experts.w1" in got and got["layers.0.moe.experts.w1"].shape == (CFG.num_experts, CFG.moe_hidden_dim, CFG.dim)
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
    with pytest.raises(ValueError, match=r"layers\.0\.moe\.experts\.w1: file \[4, 8, 16\] vs model \[8, 8, 16\]") as err:
        export.load_safetensors_into(model, path)
    assert "num_experts: saved 4 vs model 8" in str(err.value)
