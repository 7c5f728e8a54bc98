"""`dtensor-moe train --parity` on settings whose one-process reference is not simply the run on one rank (issue 40,
class 2): expert replicas (the reference goes without them), a capacity factor and token rounding (the reference's
MoE layers take each rank's tokens of a forward on their own, dtensor_moe/train/reference.py). Correct runs pass;
scripts/mutation_check.py's `parity_flag_replica_grad_scale` checks that a wrong one still fails."""

import json

import pytest

from dtensor_moe.cli import main
from dtensor_moe.cli import train as train_cli
from dtensor_moe.train.config import load_config

from .harness import torchrun_on_ranks

TINY = """\
[model]
dim = 32
n_layers = 2
n_heads = 4
num_experts = 8
top_k = 2
hidden_dim = 32
num_shared_experts = 1
load_balance = "aux_loss"

[parallel]
device = "cpu"

[training]
steps = 3
seq_len = 16
global_batch = 4
lr = 3e-3
warmup_steps = 1
dtype = "float32"
# Correct runs differ by float rounding (<= 5e-7 here); a wrong gradient scale on some expert rows moves AdamW's
# loss by ~4e-5 in 3 steps, under the default 1e-4 (scripts/mutation_check.py's parity_flag_replica_grad_scale).
parity_tolerance = 1e-5

[data]
source = "corpus"
"""


def _ranks_in_pools(monkeypatch) -> list:
    """The launcher's torchruns (the run's ranks and the reference) on the harness's pools; the commands kept."""
    cmds = []

    def launch(cmd, env, run_dir, nproc, timeout_s):
        cmds.append(cmd)
        return torchrun_on_ranks(cmd, env)

    monkeypatch.setattr(train_cli, "_launch", launch)
    return cmds


def _train_with_parity(tmp_path, capsys, monkeypatch, overrides: list[str]) -> tuple[int, str, dict, list]:
    cmds = _ranks_in_pools(monkeypatch)
    config, run_dir = tmp_path / "tiny.toml", tmp_path / "run"
    config.write_text(TINY)
    rc = main(["train", "--config", str(config), "--run-dir", str(run_dir), "--parity", *overrides])
    parity = [line for line in capsys.readouterr().out.splitlines() if line.startswith("parity")]
    report = json.loads((run_dir / "parity.json").read_text()) if (run_dir / "parity.json").exists() else {}
    return rc, parity[-1] if parity else "", report, cmds


# Each a correct run that the reference used to fail: replicas crashed it ("ep in []"), capacity and rounding
# applied to the global batch read FAIL (4e-3 at 2 ranks). The meshes cover the slice geometry: data-parallel
# ranks, cp parts and sequence-parallel tp parts of each sequence, microbatches; the balance losses that sum over
# the ranks (aux, sequence-wise over the cp / tp pieces, z) and the aux-free bias; routing replay's entries.
CASES = {
    "replicas_ep2": ["parallel.nproc=2", "parallel.ep=2", "moe_run.expert_replicas=1", "moe_run.max_rows_per_rank=128"],
    "capacity_cp2_ep2": ["parallel.nproc=4", "parallel.cp=2", "parallel.ep=2", "moe_run.capacity_factor=1.0",
                         "model.seq_aux_loss_coeff=0.01", "model.z_loss_coeff=0.001"],
    "rounding_tp2_ep2_microbatches": ["parallel.nproc=4", "parallel.tp=2", "parallel.ep=2", "parallel.microbatches=2",
                                      "moe_run.round_tokens_to=4", "model.load_balance=aux_free_bias",
                                      "model.seq_aux_loss_coeff=0.01"],
    "capacity_rounding_replicas_replay": ["parallel.nproc=2", "parallel.ep=2", "moe_run.capacity_factor=1.25",
                                          "moe_run.round_tokens_to=2", "moe_run.expert_replicas=1",
                                          "training.routing_replay=true"],
}


@pytest.mark.parametrize("overrides", CASES.values(), ids=CASES.keys())
def test_parity_passes_a_correct_run(tmp_path, capsys, monkeypatch, overrides):
    rc, line, report, cmds = _train_with_parity(tmp_path, capsys, monkeypatch, overrides)
    assert rc == 0 and line.endswith(": pass"), line
    assert report["steps"] == 3 and report["tolerance"] == 1e-5, report
    ref_cmd = cmds[-1]
    ref = json.loads(ref_cmd[ref_cmd.index("dtensor_moe.train.loop") + 1])
    assert ref["parallel"]["nproc"] == 1 and ref["moe_run"]["expert_replicas"] == 0
    assert ref["moe_run"]["max_rows_per_rank"] == 0


@pytest.mark.parametrize("overrides, slices", [
    ([], []),  # no capacity, no rounding: the reference sees the global batch, as before
    (["parallel.nproc=2", "parallel.ep=2", "moe_run.expert_replicas=1"], []),
    (["parallel.nproc=2", "parallel.ep=2", "moe_run.capacity_factor=1.0"], ["2", "1"]),
    (["parallel.nproc=8", "parallel.dp_replicate=2", "parallel.cp=2", "parallel.tp=2", "moe_run.round_tokens_to=2"],
     ["2", "4"]),
    (["parallel.nproc=4", "parallel.pp=2", "parallel.ep=2", "parallel.microbatches=2", "moe_run.capacity_factor=2.0"],
     ["2", "1"]),  # the slices are one pipeline stage's data-parallel ranks
    (["parallel.nproc=1", "moe_run.capacity_factor=1.0"], []),  # one rank is the reference
])
def test_reference_command(tmp_path, overrides, slices):
    cfg = load_config_text(tmp_path, overrides)
    assert train_cli._reference_slices(cfg) == slices
    ref = train_cli._reference_config(cfg)
    run = ref.moe_run
    assert (ref.parallel.nproc, ref.parallel.ep, run.expert_replicas, run.max_rows_per_rank) == (1, 1, 0, 0)
    assert ref.moe_run.capacity_factor == cfg.moe_run.capacity_factor
    assert ref.moe_run.round_tokens_to == cfg.moe_run.round_tokens_to


def load_config_text(tmp_path, overrides):
    path = tmp_path / "tiny.toml"
    path.write_text(TINY)
    return load_config(str(path), overrides)
