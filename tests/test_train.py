"""`dtensor-moe train` end to end on 8 CPU ranks (EDP2 x EP2 x ETP2) with --parity."""

import json

import pytest

from dtensor_moe.cli import main
from dtensor_moe.train.config import load_config


def test_tiny_cpu_run_falls_and_matches_one_process(tmp_path):
    run_dir = tmp_path / "run"
    rc = main(["train", "--config", "configs/tiny_cpu.toml", "--steps", "8", "--run-dir", str(run_dir), "--parity"])
    assert rc == 0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert all(r["tokens_per_s"] > 0 and len(r["peak_mem_per_rank_gib"]) == 8 for r in rows)
    first, last = sum(r["loss"] for r in rows[:3]) / 3, sum(r["loss"] for r in rows[-3:]) / 3
    assert last < 0.9 * first, (first, last)
    assert (run_dir / "loss.png").stat().st_size > 1000
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["mesh"]["edp"] == 2 and summary["mesh"]["ep"] == 2 and summary["mesh"]["etp"] == 2
    assert {wp["name"] for wp in summary["placement_plan"]} >= {"experts.w1", "experts.w2", "experts.w3"}
    for got, want in zip(summary["state_bytes_per_rank"], summary["planner_state_bytes_per_rank"], strict=True):
        assert all(abs(got[k] - want[k]) <= 0.05 * got[k] for k in ("params", "grads", "optimizer")), (got, want)
    parity = json.loads((run_dir / "parity.json").read_text())
    assert parity["steps"] == 8 and parity["max_abs_delta"] <= 1e-4


@pytest.mark.parametrize(
    "overrides,match",
    [
        (["model.nope=1"], r"unknown \[model\] keys \['nope'\]"),
        (["parallel.ep=3"], r"ep \* etp = 3\*2 must divide"),
        (["training.global_batch=12", "parallel.ep=1", "parallel.etp=1"], None),
        (["modelx.dim=3"], r"must look like section.key=value"),
    ],
)
def test_config_errors(overrides, match):
    if match is None:
        assert load_config("configs/tiny_cpu.toml", overrides).training.global_batch == 12
        return
    with pytest.raises(ValueError, match=match):
        from dtensor_moe.train.loop import _check

        cfg = load_config("configs/tiny_cpu.toml", overrides)
        _check(cfg, cfg.parallel.nproc)


def test_global_batch_checked_against_the_real_world_size_before_launch():
    from dtensor_moe.train.loop import _check

    cfg = load_config("configs/tiny_cpu_ep_only.toml", ["parallel.ep=16", "model.num_experts=16", "training.global_batch=32"])
    _check(cfg, 32)  # under torchrun on 32 ranks: ep=16 is valid although parallel.nproc says 8
    with pytest.raises(ValueError, match=r"global_batch \(16\) must be divisible by the data-parallel size \(32\)"):
        _check(load_config("configs/tiny_cpu_ep_only.toml", ["parallel.ep=16", "model.num_experts=16", "training.global_batch=16"]), 32)


def test_global_batch_must_split_over_data_ranks():
    from dtensor_moe.train.data import Batches, corpus_tokens

    with pytest.raises(ValueError, match=r"global_batch \(12\) must be divisible by the data-parallel size \(8\)"):
        Batches(corpus_tokens(), 64, 12, 0, 0, 8)


def test_global_batch_is_mesh_independent():
    import torch

    from dtensor_moe.train.data import Batches, corpus_tokens

    tokens = corpus_tokens()
    whole = Batches(tokens, 16, 8, 0, 0, 1)(3)[0]
    parts = torch.cat([Batches(tokens, 16, 8, 0, r, 4)(3)[0] for r in range(4)])
    assert torch.equal(whole, parts)


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_checkpoint_resume_same_mesh_bit_exact_and_other_mesh_close(tmp_path):
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    base = ["train", "--steps", "6", "training.warmup_steps=2"]
    assert main([*base, "--config", "configs/tiny_cpu.toml", "--run-dir", str(a), "--checkpoint-every", "3"]) == 0
    ckpt3 = a / "checkpoints" / "step_00000003"
    assert (ckpt3 / ".metadata").is_file() and (a / "checkpoints" / "step_00000006").is_dir()
    assert main([*base, "--config", "configs/tiny_cpu.toml", "--run-dir", str(b), "--resume", str(ckpt3)]) == 0
    # Another mesh and world size: 8 ranks EDP2xEP2xETP2 -> 4 ranks EP4.
    other_mesh = ["--nproc", "4", "parallel.ep=4"]
    assert main([*base, "--config", "configs/tiny_cpu_ep_only.toml", "--run-dir", str(c), "--resume", str(ckpt3), *other_mesh]) == 0
    full, same, other = _rows(a), _rows(b), _rows(c)
    assert [r["step"] for r in same] == [4, 5, 6]
    assert [r["loss"] for r in same] == [r["loss"] for r in full[3:]]  # bit-exact on the same mesh
    assert max(abs(x["loss"] - y["loss"]) for x, y in zip(other, full[3:])) <= 1e-4
