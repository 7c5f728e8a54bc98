"""Settings accepted and then ignored, disagreements one rank finds, flows that did not connect (issue 40, classes
1, 6 and 8): each refused before launch in one line naming the field, agreed on by every rank, or let through.

In-process checks except where the class needs ranks: a replay recording that differs on one rank (2 gloo ranks,
a 4-expert layer) and the torchtitan hook's row cap (2 ranks, the CPU debug model, one step).
"""

import io
import json
import math
import sys
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import asdict, replace

import pytest
import torch

from dtensor_moe import MoE, MoEConfig, MoEParallelDims, MoERunOptions, parallelize_moe, record_routing, replay_routing

from .harness import run_on_ranks

# --- class 1: settings that cannot act on the mesh, or act degenerately --------------------------------------------


def _main_config(*overrides: str):
    from dtensor_moe.train.config import load_config

    base = ["model.dim=16", "model.n_heads=2", "model.num_experts=4", "model.top_k=2", "model.hidden_dim=8",
            "model.n_layers=1", "model.max_seq_len=16", "training.seq_len=8", "training.global_batch=4",
            "data.source=synthetic", "parallel.nproc=2"]
    return load_config(None, [*base, *overrides])


def test_row_cap_without_expert_parallelism_is_refused_before_launch():
    """max_rows_per_rank is read from the expert-parallel dispatch: on a mesh without one it never acts."""
    from dtensor_moe.cli.train import _check

    cfg = _main_config("moe_run.max_rows_per_rank=100", "parallel.ep=1")
    with pytest.raises(ValueError, match=r"moe_run\.max_rows_per_rank \(100\) needs parallel\.ep > 1") as e:
        _check(cfg, 2)
    assert "valid:" in str(e.value)
    _check(_main_config("moe_run.max_rows_per_rank=100", "parallel.ep=2"), 2)  # EP2: the cap acts


def test_rounding_multiple_above_the_tokens_per_rank_is_refused_before_launch():
    """global_batch 4 over 2 data-parallel ranks, seq_len 8: each rank's MoE sees 16 tokens a forward, so no expert
    ever holds 32 pairs and every pair would be rounded away (the experts compute nothing, rc 0)."""
    from dtensor_moe.cli.train import _check

    with pytest.raises(ValueError, match=r"moe_run\.round_tokens_to \(32\).*16 tokens") as e:
        _check(_main_config("moe_run.round_tokens_to=32", "parallel.ep=2"), 2)
    assert "valid:" in str(e.value)
    _check(_main_config("moe_run.round_tokens_to=16", "parallel.ep=2"), 2)  # reachable: accepted
    # A capacity keeps each expert below the multiple just as well: ceil(16 * 2 / 4 * 0.5) = 4 pairs at most.
    with pytest.raises(ValueError, match=r"moe_run\.round_tokens_to \(8\).*capacity"):
        _check(_main_config("moe_run.round_tokens_to=8", "moe_run.capacity_factor=0.5", "parallel.ep=2"), 2)


def test_place_replicas_refuses_bad_arguments_by_name():
    from dtensor_moe.parallel.replicas import place_replicas

    assert place_replicas([9, 1, 1, 1], 2, 1) == ((-1,), (0,))  # the valid call still plans
    for args, name in ((([1.0, math.nan, 1.0, 1.0], 2, 1), r"load_E\[1\] = nan"),
                       (([1, -3, 1, 1], 2, 1), r"load_E\[1\] = -3"),
                       (([1, math.inf, 1, 1], 2, 1), r"load_E\[1\] = inf"),
                       (([1, 2, 3, 4], 2, -1), r"\br must be an int >= 0, got -1"),
                       (([1, 2, 3, 4], 0, 1), r"\bep must be an int >= 1, got 0")):
        with pytest.raises(ValueError, match=name):
            place_replicas(*args)


def test_recording_a_model_without_moe_layers_is_refused():
    with pytest.raises(ValueError, match=r"record_routing: Linear has no MoE layer"):
        with record_routing(torch.nn.Linear(4, 4)):
            pass


@pytest.mark.parametrize("model_type, want", [
    # (dim, experts, top_k, expert hidden, vocab, layers, dense layers, dense hidden); the built-in model's
    # defaults would be (64, 8, 2, 64, 256, 2, 0, 0).
    ("qwen3_moe", (8, 4, 2, 6, 32, 2, 0, 0)),
    ("deepseek_v3", (8, 8, 2, 6, 32, 2, 1, 12)),
])
def test_plan_of_an_hf_path_config_plans_the_checkpoint(model_type, want, tmp_path):
    """Not the built-in model's defaults: the checkpoint's config.json (a tiny transformers checkpoint)."""
    pytest.importorskip("transformers")
    from dtensor_moe.cli.plan import resolve

    from .hf_models import hf_model

    ckpt = tmp_path / model_type
    hf_model(model_type).save_pretrained(ckpt)
    toml = tmp_path / "ft.toml"
    toml.write_text(f'[model]\nhf_path = "{ckpt}"\naux_loss_coeff = 0.01\n')
    spec, run = resolve(str(toml))
    assert run == MoERunOptions()  # no [moe_run]: the defaults
    got = (spec.dim, spec.moe.num_experts, spec.moe.top_k, spec.moe.hidden_dim, spec.vocab_size, spec.n_layers,
           spec.n_dense_layers, spec.dense_hidden_dim)
    assert got == want
    assert spec.moe.aux_loss_coeff == 0.01  # [model]'s balance fields kept
    if model_type == "qwen3_moe":  # 2 heads of 4, 1 KV head
        assert dict(spec.attention)["attention.wq.weight"] == (8, 8)
        assert dict(spec.attention)["attention.wk.weight"] == (4, 8)
    else:  # multi-head latent attention
        assert "attention.wkv_a.weight" in dict(spec.attention)


def _cli(*argv) -> tuple[int, str, str]:
    from dtensor_moe.cli import main

    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = main(list(argv))
    return rc, out.getvalue(), err.getvalue()


def test_plan_replicas_on_one_gpu_says_they_need_ep():
    rc, out, err = _cli("plan", "--model", "mixtral-8x7b", "--gpus", "1", "--replicas", "1")
    assert rc == 2 and "Nothing fits" not in out, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "--replicas 1 needs ep > 1" in lines[0] and "--gpus 1" in lines[0], err
    rc, out, _ = _cli("plan", "--model", "mixtral-8x7b", "--gpus", "8", "--replicas", "1")
    assert rc == 0 and "1 replica slot(s) per EP rank" in out


# --- class 8: a resume with replicas turned on or off is the same model ---------------------------------------------


def test_resume_check_ignores_settings_that_change_no_weight():
    """Replicas, their re-placement and the row cap are [moe_run] options: the model config the resume check
    compares (what a checkpoint holds) is the same under any of them."""
    from dtensor_moe.train.checkpoint import config_diff

    saved = asdict(_main_config().model)
    for change in ("moe_run.expert_replicas=2", "moe_run.replica_replan_every=7", "moe_run.max_rows_per_rank=500"):
        cfg = _main_config(change)
        assert cfg.moe_run != MoERunOptions() and config_diff(saved, asdict(cfg.model)) == [], change
    assert config_diff(saved, asdict(replace(_main_config().model, top_k=1))) == ["top_k: saved 2 vs model 1"]


def test_resume_with_replicas_turned_on_is_accepted(tmp_path):
    """--resume of a run saved without replicas, now with moe_run.expert_replicas = 1: same weights, accepted."""
    from dtensor_moe.cli.train import _resume_target
    from dtensor_moe.train.checkpoint import MODEL_CONFIG, save

    cfg = _main_config("parallel.ep=2", "training.steps=4")
    from dtensor_moe.train.model import build_model

    root = tmp_path / "run" / "checkpoints"
    save(root, 2, build_model(cfg.model), keep_last=1)
    assert "expert_replicas" not in json.loads(next(root.glob(f"step_*/{MODEL_CONFIG}")).read_text())
    args = type("Args", (), {"resume": "latest"})()
    on = replace(cfg, moe_run=replace(cfg.moe_run, expert_replicas=1))
    assert _resume_target(args, on, str(tmp_path / "run")).name.startswith("step_")
    other = replace(cfg, model=replace(cfg.model, top_k=1))
    with pytest.raises(ValueError, match="another model config"):
        _resume_target(args, other, str(tmp_path / "run"))


# --- the torchtitan hook: the same checks as the main job's --------------------------------------------------------


def _hook_refusal(capsys, monkeypatch, world: int, *extra: str) -> str:
    pytest.importorskip("torchtitan")
    from torchtitan.config import ConfigManager

    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.delenv("RANK", raising=False)
    argv = ["--module", "dtensor_moe.titan", "--config", "deepseek_v3_debugmodel_cpu", "--dump_folder", "/unused",
            *extra]
    with pytest.raises(SystemExit) as exit_:
        ConfigManager().parse_args(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    ours = [line for line in err.splitlines() if line.startswith("dtensor_moe.titan: ")]
    assert len(ours) == 1 and "Traceback" not in err, err
    return ours[0]


def test_hook_row_cap_without_expert_parallelism_is_refused(capsys, monkeypatch):
    line = _hook_refusal(capsys, monkeypatch, 2, "--dtensor_moe.run.max_rows_per_rank", "100")
    assert "--dtensor_moe.run.max_rows_per_rank (100) needs --dtensor_moe.ep > 1" in line and "valid:" in line, line


def test_hook_refuses_more_replica_slots_than_experts(capsys, monkeypatch):
    """The main job refuses moe_run.expert_replicas > model.num_experts; the hook did not (8 experts here)."""
    line = _hook_refusal(capsys, monkeypatch, 2, "--dtensor_moe.ep", "2", "--dtensor_moe.run.expert_replicas", "9")
    assert "expert_replicas (9)" in line and "num_experts (8)" in line and "valid:" in line, line


def test_hook_rounding_multiple_above_the_tokens_per_rank_is_refused(capsys, monkeypatch):
    line = _hook_refusal(capsys, monkeypatch, 2, "--dtensor_moe.ep", "2", "--dtensor_moe.run.round_tokens_to", "64",
                         "--training.local_batch_size", "2", "--training.seq_len", "16")
    assert "--dtensor_moe.run.round_tokens_to (64)" in line and "32 tokens" in line and "valid:" in line, line


# --- class 6: what one rank finds, every rank reports ---------------------------------------------------------------


def _replay_differs_on_rank_1(rank: int, world_size: int, what: str):
    torch.manual_seed(0)
    cfg = MoEConfig(dim=4, hidden_dim=4, num_experts=4, top_k=2)
    model = MoE(cfg).double()
    parallelize_moe(model, MoEParallelDims(world_size, ep=2), device_type="cpu")
    x = torch.randn(2, 3, cfg.dim, dtype=torch.float64)
    with record_routing(model) as rec:
        for _ in range(2):
            model(x)
    if what == "missing forward" and rank == 1:
        rec.experts[""] = rec.experts[""][:1]
    with replay_routing(model, rec):
        model(x[:1] if what == "token count" and rank == 1 else x)
        model(x)


@pytest.mark.parametrize("what, says", [
    ("token count", r"forward 1 does not match the recording on rank\(s\) \[1\].*rank 1: 3 tokens, its recording 6"),
    ("missing forward", r"forward 2 does not match the recording on rank\(s\) \[1\].*rank 1: no recorded forward 2"),
])
def test_replay_that_differs_on_one_rank_raises_alike_on_every_rank(what, says):
    """Rank 1's recording does not fit; rank 0's does. Both raise the ValueError naming rank 1 (rank 0's is
    re-raised here), neither dies in the dispatch with gloo's "Connection closed by peer"."""
    with pytest.raises(ValueError, match=says):
        run_on_ranks(2, _replay_differs_on_rank_1, what)


class _Exit(Exception):
    pass


def _hook_row_cap(rank: int, world: int, dump: str) -> tuple[tuple, list[str]]:
    """One step of the CPU debug model at EP2 with a row cap no forward fits; the exit is caught, not taken."""
    import os
    from unittest import mock

    os.environ["LOCAL_RANK"] = str(rank)
    from dtensor_moe.titan.cpu import use_cpu

    use_cpu()
    from torchtitan.config import ConfigManager

    from dtensor_moe.titan import trainer as hook

    argv = ["--module", "dtensor_moe.titan", "--config", "deepseek_v3_debugmodel_cpu", "--dump_folder", dump,
            "--dtensor_moe.ep", "2", "--dtensor_moe.run.max_rows_per_rank", "1", "--training.steps", "1"]
    err = io.StringIO()

    def leave(code, wait):
        raise _Exit(code, wait)

    t = ConfigManager().parse_args(argv).build()
    try:
        with mock.patch.object(hook, "_exit", leave), redirect_stderr(err):
            t.train()
    except _Exit as e:
        return e.args, [ln for ln in err.getvalue().splitlines() if ln.startswith("dtensor_moe.titan")]
    finally:
        sys.stderr.flush()
    return (), []


def test_hook_row_cap_ends_in_one_line_and_the_main_jobs_exit_status(tmp_path):
    pytest.importorskip("torchtitan")
    from dtensor_moe.train.supervision import ROW_CAP_RC

    (exit0, lines0), (exit1, lines1) = run_on_ranks(2, _hook_row_cap, str(tmp_path))
    # Rank 0 says why and leaves; rank 1 waits for torchrun to stop it (rank 0's line must get out first).
    assert exit0 == (ROW_CAP_RC, False) and exit1 == (ROW_CAP_RC, True), (exit0, exit1)
    assert len(lines0) == 1 and lines1 == [], (lines0, lines1)
    assert "more than max_rows_per_rank (1)" in lines0[0] and "stopped in step 1" in lines0[0], lines0


def test_the_cpu_launcher_without_torchtitan_names_the_extra(tmp_path):
    """The hook's CPU entry point with torchtitan missing: one line naming the extra to install, rc 2, where each
    rank printed an ImportError traceback."""
    import os
    import subprocess
    import sys

    (tmp_path / "sitecustomize.py").write_text(
        "import importlib.util as u\n_find = u.find_spec\n"
        "u.find_spec = lambda name, *a: None if name == 'torchtitan' else _find(name, *a)\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-m", "dtensor_moe.titan.cpu_train", "--help"], capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": f"{tmp_path}:{root}"}, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and "dtensor-moe[titan]" in proc.stderr
