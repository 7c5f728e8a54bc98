"""The main job under a skewed router: hot-expert replicas, the per-rank row cap and routing replay, each against
the same run without it."""

import json
import subprocess
import sys

import pytest

from dtensor_moe.cli import main

from .test_train import ROOT, _ranks_in_pools


def _train(run_dir, *overrides) -> list[dict]:
    assert main(["train", "--config", "configs/tiny_cpu.toml", "--run-dir", str(run_dir), *overrides]) == 0
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _max_dloss(a: list[dict], b: list[dict]) -> float:
    assert [r["step"] for r in a] == [r["step"] for r in b]
    return max(abs(x["loss"] - y["loss"]) for x, y in zip(a, b))


def test_replicas_train_exactly_like_no_replicas(tmp_path, capsys, monkeypatch):
    """EP4 with two replica slots per rank, re-placed every 2 forwards (the router unbalanced): the losses are
    those of the run without replicas; the rows each EP rank computed are measured beside the owners' rows."""
    _ranks_in_pools(monkeypatch)
    common = ["--steps", "6", "parallel.nproc=4", "parallel.ep=4", "parallel.etp=1", "model.load_balance=none"]
    base = _train(tmp_path / "off", *common)
    capsys.readouterr()
    rep = _train(tmp_path / "on", *common, "moe_run.expert_replicas=2", "moe_run.replica_replan_every=2")
    assert _max_dloss(base, rep) <= 1e-6
    assert all(len(r["replica_ep_imbalance"]) == 2 and r["worst_replica_ep_imbalance"] >= 1 for r in rep)
    assert "replica_ep_imbalance" not in base[0]
    # The owners' rows are the router's: the same in both runs (the replicas only move who computes them).
    assert [r["worst_rows_per_expert"] for r in rep] == [r["worst_rows_per_expert"] for r in base]
    load = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("load"))
    assert ", computed with replicas " in load


@pytest.mark.parametrize("overrides", [
    ["parallel.nproc=2", "parallel.ep=2", "parallel.etp=1", "training.activation_checkpoint=full"],
    ["parallel.nproc=4", "parallel.pp=2", "parallel.ep=2", "parallel.etp=1"],
], ids=["EP2 with AC", "PP2 x EP2"])
def test_routing_replay_switch_trains_like_the_router(overrides, tmp_path, monkeypatch):
    """training.routing_replay: each step's eval rollout records, the training forward replays; with the same
    weights the router would choose the same, so the run equals the one without replay."""
    _ranks_in_pools(monkeypatch)
    common = ["--steps", "3", *overrides]
    assert _max_dloss(_train(tmp_path / "off", *common), _train(tmp_path / "on", *common,
                                                                "training.routing_replay=true")) <= 1e-6


def test_row_cap_stops_every_rank_with_one_line(tmp_path):
    """moe_run.max_rows_per_rank below what the router sends: the real launcher stops all ranks and prints one line
    naming the layer, the rows and the cap (no traceback, no torchrun report), exit code 4."""
    cmd = [sys.executable, "-m", "dtensor_moe.cli", "train", "--config", "configs/tiny_cpu.toml", "--run-dir",
           str(tmp_path / "run"), "--steps", "2", "parallel.nproc=2", "parallel.ep=2", "parallel.etp=1",
           "moe_run.max_rows_per_rank=100"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 4, out.stderr
    # What stderr holds besides the progress bar (its last frame ends without a newline).
    lines = out.stderr.rpartition("step/s]")[2].strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert lines[0].startswith("dtensor-moe train: MoE layer 'layers.0.moe', forward 1: EP rank ")
    assert "more than max_rows_per_rank (100)" in lines[0] and "last good checkpoint: none" in lines[0]
