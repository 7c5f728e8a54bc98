"""`dtensor-moe train` end to end on 8 CPU ranks (EDP2 x EP2 x ETP2) with --parity."""

import json
import os
from pathlib import Path

import pytest

from dtensor_moe.cli import main
from dtensor_moe.cli import train as train_cli
from dtensor_moe.train.config import ParallelConfig, load_config

from .harness import torchrun_on_ranks

ROOT = Path(__file__).resolve().parents[1]


def _ranks_in_pools(monkeypatch):
    """The launcher's torchruns (its ranks and the 1-process parity reference) run on the harness's pools (no
    torch import per rank); tests/test_supervision.py runs the real launcher, torchrun and ranks."""

    def launch(cmd, env, run_dir, nproc, timeout_s):
        return torchrun_on_ranks(cmd, env)

    monkeypatch.setattr(train_cli, "_launch", launch)


def test_tiny_cpu_run_falls_and_matches_one_process(tmp_path, capsys, monkeypatch):
    _ranks_in_pools(monkeypatch)
    run_dir = tmp_path / "run"
    rc = main(["train", "--config", "configs/tiny_cpu.toml", "--steps", "8", "--run-dir", str(run_dir), "--parity"])
    assert rc == 0
    out = capsys.readouterr().out.splitlines()[-8:]  # the launcher's summary, after both progress bars
    assert [line.split()[0] for line in out] == ["trained", "mesh", "loss", "speed", "memory", "load", "parity", "run"]
    assert "MoE LM (2 layers, dim 64, 8 experts top-2 + 1 shared), 8 steps of 1024 tokens, float32" in out[0]
    assert out[1] == "mesh     8 ranks on cpu: experts EDP2 x EP2 x ETP2, dense weights FSDP8"
    assert out[5].startswith("load     worst layer's max/mean rows, mean (max) over 8 steps: per expert ")
    assert out[6].startswith("parity   max |dloss| vs 1 process over 8 steps = ") and out[6].endswith(": pass")
    assert out[7] == (f"run dir  {run_dir}: metrics.jsonl, summary.json, loss.png, load.png, parity.json, "
                      "reference_1proc/")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert all(r["tokens_per_s"] > 0 and len(r["peak_mem_per_rank_gib"]) == 8 for r in rows)
    # Every step routes each of 1024 tokens to 2 experts; the worst layer's rows per EP rank add its experts' rows.
    assert all(sum(r["worst_rows_per_expert"]) == 2048 and len(r["expert_imbalance"]) == 2 for r in rows)
    assert all(r["worst_rows_per_ep_rank"] == [sum(r["worst_rows_per_expert"][:4]), sum(r["worst_rows_per_expert"][4:])]
               for r in rows)
    first, last = sum(r["loss"] for r in rows[:3]) / 3, sum(r["loss"] for r in rows[-3:]) / 3
    assert last < 0.9 * first, (first, last)
    assert (run_dir / "loss.png").stat().st_size > 1000
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["mesh"]["edp"] == 2 and summary["mesh"]["ep"] == 2 and summary["mesh"]["etp"] == 2
    assert {wp["name"] for wp in summary["placement_plan"]} >= {"experts.w13", "experts.w2"}
    for got, want in zip(summary["state_bytes_per_rank"], summary["predicted_state_bytes_per_rank"], strict=True):
        assert all(abs(got[k] - want[k]) <= 0.05 * got[k] for k in ("params", "grads", "optimizer")), (got, want)
    parity = json.loads((run_dir / "parity.json").read_text())
    assert parity["steps"] == 8 and parity["max_abs_delta"] <= 1e-4


@pytest.mark.parametrize("moe_run, tail", [
    ({}, "tokens, bf16"),
    ({"expert_precision": "fp8"}, "tokens, bf16, FP8 experts"),
    ({"expert_precision": "fp8", "dispatch_precision": "fp8"}, "tokens, bf16, FP8 experts, FP8 dispatch"),
])
def test_summary_names_fp8(moe_run, tail):
    """The console's first line says when experts or the dispatch payload ran in FP8 (the dtype alone said bf16):
    [moe_run]'s precisions, as summary.json's config holds them."""
    from dataclasses import asdict

    from dtensor_moe import MoERunOptions
    from dtensor_moe.train.metrics import summary_lines

    m = {"n_layers": 4, "dim": 1024, "num_experts": 16, "top_k": 2, "num_shared_experts": 1}
    summary = {"config": {"model": m, "moe_run": asdict(MoERunOptions(**moe_run)),
                          "training": {"steps": 200, "global_batch": 32, "seq_len": 1024, "dtype": "bf16"}},
               "mesh": {"dp_replicate": 1, "dp_shard": 1, "edp": 1, "ep": 1, "etp": 1}, "model_params": 445e6,
               "world_size": 1, "device": "NVIDIA H200", "final_loss": None}
    assert summary_lines(summary, "/nonexistent")[0].endswith(tail)


@pytest.mark.parametrize(
    "overrides,match",
    [
        (["model.nope=1"], r"unknown \[model\] keys \['nope'\]"),
        (["parallel.ep=3"], r"ep \* etp = 3\*2 must divide"),
        (["training.global_batch=12", "parallel.ep=1", "parallel.etp=1"], None),
        (["modelx.dim=3"], r"must look like section.key=value"),
        (["parallel.pp=3"], r"pp \(3\) must divide world_size 8"),
        (["parallel.pp=2", "model.tie_embeddings=true"], r"tie_embeddings=true is not supported with parallel.pp > 1"),
        (
            ["parallel.pp=2", "parallel.microbatches=1"],
            r"microbatches \(1\) must be >= parallel.pp \(2\) for pp_schedule '1f1b'",
        ),
        (
            ["parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b"],
            r"model.n_layers \(2\) must be >= the pipeline stages \(4",
        ),
        (["training.compile=true", "moe_run.expert_replicas=1"],
         r"training.compile = true with moe_run.expert_replicas \(1\) is not supported"),
        (["parallel.pp_schedule=zb"], r"parallel.pp_schedule must be one of \['gpipe', '1f1b', 'interleaved_1f1b'\]"),
        (
            ["parallel.pp=2", "parallel.microbatches=3", "parallel.pp_schedule=gpipe"],
            r"global_batch \(16\) must be divisible by the data-parallel size \(4\) times "
            r"parallel.microbatches \(3\) = 12",
        ),
        (
            ["parallel.pp=2", "model.n_layers=4", "parallel.microbatches=5", "parallel.pp_schedule=interleaved_1f1b"],
            r"microbatches \(5\) must be a multiple of max\(1, microbatches // pp\) = 2",
        ),
    ],
)
def test_config_errors(overrides, match):
    if match is None:
        assert load_config("configs/tiny_cpu.toml", overrides).training.global_batch == 12
        return
    with pytest.raises(ValueError, match=match):
        from dtensor_moe.cli.train import _check

        cfg = load_config("configs/tiny_cpu.toml", overrides)
        _check(cfg, cfg.parallel.nproc)


def test_global_batch_checked_against_the_real_world_size_before_launch():
    from dtensor_moe.cli.train import _check

    cfg = load_config(
        "configs/tiny_cpu_ep_only.toml", ["parallel.ep=16", "model.num_experts=16", "training.global_batch=32"]
    )
    _check(cfg, 32)  # under torchrun on 32 ranks: ep=16 is valid although parallel.nproc says 8
    with pytest.raises(ValueError, match=r"global_batch \(16\) must be divisible by the data-parallel size \(32\)"):
        _check(
            load_config(
                "configs/tiny_cpu_ep_only.toml", ["parallel.ep=16", "model.num_experts=16", "training.global_batch=16"]
            ),
            32,
        )


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


def test_checkpoint_resume_same_mesh_bit_exact_and_other_mesh_close(tmp_path, monkeypatch):
    # 4 ranks EDP2 x EP2 (FSDP-sharded optimizer state), then 2 ranks EP2: the 8-rank foldings reshard in
    # test_checkpoint.py; here the launcher's --resume path is what is tested, at half the processes.
    _ranks_in_pools(monkeypatch)
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    base = ["train", "--config", "configs/tiny_cpu.toml", "--steps", "6", "training.warmup_steps=2", "parallel.etp=1"]
    assert main([*base, "--nproc", "4", "--run-dir", str(a), "--checkpoint-every", "3"]) == 0
    ckpt3 = a / "checkpoints" / "step_00000003"
    assert (ckpt3 / ".metadata").is_file() and (a / "checkpoints" / "step_00000006").is_dir()
    from dtensor_moe.train.checkpoint import data_of

    # what --resume checks the data stream against (test_resume_refuses_another_data_stream)
    assert data_of(ckpt3) == {"source": "corpus", "content": None, "eval_fraction": 0.0, "seed": 0}
    assert main([*base, "--nproc", "4", "--run-dir", str(b), "--resume", str(ckpt3)]) == 0
    assert main([*base, "--nproc", "2", "--run-dir", str(c), "--resume", str(ckpt3)]) == 0
    full, same, other = _rows(a), _rows(b), _rows(c)
    assert [r["step"] for r in same] == [4, 5, 6]
    assert [r["loss"] for r in same] == [r["loss"] for r in full[3:]]  # bit-exact on the same mesh
    assert max(abs(x["loss"] - y["loss"]) for x, y in zip(other, full[3:])) <= 1e-4


# --- bad input to the launcher: one line on stderr, rc 2, before any rank starts ----------------

TINY = ["train", "--config", "configs/tiny_cpu.toml"]


@pytest.mark.parametrize(
    "argv,message",
    [
        (["training.steps=ten"], "training.steps must be an int >= 1, got 'ten' (str)"),
        (["training.global_batch=0"], "training.global_batch must be >= 1, got 0"),
        (["training.seq_len=0"], "training.seq_len must be >= 1, got 0"),
        (
            ["training.seq_len=2048"],
            "training.seq_len (2048) must be <= model.max_seq_len (1024); valid seq_len: 1..1024 "
            "(or raise model.max_seq_len)",
        ),
        (["--steps", "-3"], "training.steps must be >= 1, got -3"),
        (["--nproc", "0"], "parallel.nproc must be >= 1, got 0"),
        (["--checkpoint-every", "-1"], "--checkpoint-every must be >= 0 (steps between saves; 0: never), got -1"),
        (["--new-data"], "--new-data goes with --resume (it lets a resume continue on other data)"),
        (["--keep-last", "0"], "--keep-last must be >= 1 (checkpoints kept on disk), got 0"),
        (["model.top_k=2.5"], "model.top_k must be an int in 1..num_experts (8), got 2.5"),
        (["parallel.ep=3"], "ep * etp = 3*2 must divide dp_shard * cp * tp = 8"),
        (
            ["parallel.tp=3"],
            "model.n_heads (4) must be divisible by parallel.tp (3) so each TP rank owns whole heads; "
            "valid tp: [1, 2, 4]",
        ),
        (
            ["parallel.cp=2", "parallel.tp=2", "training.seq_len=6"],
            "training.seq_len (6) must be divisible by parallel.cp * parallel.tp (2*2)",
        ),
        (["parallel.tp=2", "model.tie_embeddings=true"], "parallel.tp=2 needs model.tie_embeddings = false"),
        (["parallel.cp=4", "parallel.tp=4"], "dp_replicate * cp * tp = 1*4*4 = 16 must divide world_size 8"),
        (
            ["parallel.tp=2", "parallel.ep=4", "training.compile=true"],
            "training.compile with tp=2, cp=1 is not supported yet",
        ),
        (
            ["parallel.cp=2", "parallel.tp=2", "training.global_batch=5"],
            "training.global_batch (5) must be divisible by the data-parallel size (2)",
        ),
        (["parallel.backend=nccl"], "parallel.backend = 'nccl' needs parallel.device = 'cuda'"),
    ],
)
def test_launcher_rejects_bad_input_in_one_line(tmp_path, capsys, argv, message):
    assert main([*TINY, "--run-dir", str(tmp_path / "run"), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"dtensor-moe train: {message}") and err.count("\n") == 1, err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "argv,message",
    [
        (["training.lr=1", "training.lr=2"],
         "override training.lr is given twice with different values (training.lr=1 and training.lr=2); give it once"),
        (["--steps", "2", "training.steps=3"],
         "--steps 2 and the override training.steps=3 disagree; give only one of them"),
        (["parallel.nproc=4", "--nproc", "2"], "--nproc 2 and the override parallel.nproc=4 disagree"),
    ],
)
def test_launcher_refuses_a_setting_given_twice_differently(tmp_path, capsys, argv, message):
    assert main([*TINY, "--run-dir", str(tmp_path / "run"), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"dtensor-moe train: {message}") and err.count("\n") == 1, err
    assert not (tmp_path / "run").exists()


def test_launcher_accepts_a_setting_given_twice_alike():
    """The ranks' command line repeats --nproc as an override: equal values are one setting."""
    args = _parsed(["--config", "configs/tiny_cpu.toml", "--steps", "3", "--nproc", "2", "training.steps=3",
                    "parallel.nproc=2", "training.lr=1e-3", "training.lr=0.001"])
    cfg, _ = train_cli._resolve(args)
    assert (cfg.training.steps, cfg.parallel.nproc, cfg.training.lr) == (3, 2, 1e-3)


def test_launcher_refuses_an_empty_run_dir(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where the default runs/tiny_cpu would be made
    assert main(["train", "--config", str(ROOT / "configs" / "tiny_cpu.toml"), "--run-dir", ""]) == 2
    assert capsys.readouterr().err == (
        f"dtensor-moe train: --run-dir '' names no directory; give a path, or leave --run-dir out for the default "
        f"{os.path.join('runs', 'tiny_cpu')}\n"
    )
    assert list(tmp_path.iterdir()) == []


# --- parallel.device = cuda: GPUs and backends, checked before launch (torch.cuda mocked) ---------------


def _gpus(monkeypatch, n: int):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)


def _launched(monkeypatch) -> list:
    """The torchrun commands the launcher would start; each "run" fails with rc 7, so nothing else follows."""
    cmds = []

    def launch(cmd, env, run_dir, nproc, timeout_s):
        cmds.append(cmd)
        return 7

    monkeypatch.setattr(train_cli, "_launch", launch)
    return cmds


@pytest.mark.parametrize("backend", ["auto", "nccl"])
def test_launcher_refuses_more_nccl_ranks_than_gpus(tmp_path, capsys, monkeypatch, backend):
    import torch

    _gpus(monkeypatch, 1)
    cmds = _launched(monkeypatch)
    argv = [*TINY, "--run-dir", str(tmp_path / "run"), "parallel.device=cuda", f"parallel.backend={backend}"]
    assert main(argv) == 2
    name = "'nccl'" if backend == "nccl" else "'auto' (nccl on parallel.device = 'cuda')"
    assert capsys.readouterr().err == (
        f"dtensor-moe train: parallel.backend = {name} runs one rank per GPU: parallel.nproc = 8 on a machine with 1 "
        f"GPU (torch {torch.__version__}); valid: parallel.nproc <= 1, or parallel.backend = 'gloo' to share the GPUs "
        "(CUDA tensors through the host: slow, for debugging)\n"
    )
    assert cmds == [] and not (tmp_path / "run").exists()


def test_launcher_lets_gloo_ranks_share_gpus(tmp_path, monkeypatch):
    _gpus(monkeypatch, 1)
    cmds = _launched(monkeypatch)
    assert main([*TINY, "--run-dir", str(tmp_path / "run"), "parallel.device=cuda", "parallel.backend=gloo"]) == 7
    assert "--nproc-per-node=8" in cmds[0] and "parallel.backend=gloo" in cmds[0]
    _gpus(monkeypatch, 2)  # nccl with one rank per GPU starts too
    argv = [*TINY, "--run-dir", str(tmp_path / "run2"), "parallel.device=cuda", "--nproc", "2", "parallel.etp=1"]
    assert main(argv) == 7
    assert "--nproc-per-node=2" in cmds[1]


def test_launcher_refuses_cuda_without_a_gpu(tmp_path, capsys, monkeypatch):
    import torch

    _gpus(monkeypatch, 0)
    cmds = _launched(monkeypatch)
    for backend in ("auto", "gloo"):  # sharing GPUs needs one to share
        argv = [*TINY, "--run-dir", str(tmp_path / "run"), "parallel.device=cuda", f"parallel.backend={backend}"]
        assert main(argv) == 2
        assert capsys.readouterr().err == (
            f"dtensor-moe train: parallel.device = 'cuda' needs a GPU; this machine has none that torch "
            f"{torch.__version__} can use (torch.cuda.is_available() is False); valid: parallel.device = 'cpu'\n"
        )
    assert cmds == [] and not (tmp_path / "run").exists()


def test_under_torchrun_nccl_ranks_are_counted_from_torchrun(tmp_path, capsys, monkeypatch):
    """An outside torchrun says how many ranks share this node, whatever parallel.nproc says."""
    _gpus(monkeypatch, 2)
    for key, value in {"LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv(train_cli.LAUNCHED, raising=False)
    argv = [*TINY, "--run-dir", str(tmp_path / "run"), "parallel.device=cuda", "parallel.nproc=2"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "torchrun's local ranks = 4 on a machine with 2 GPUs" in err and "torchrun --nproc-per-node <= 2" in err
    assert not (tmp_path / "run").exists()


def test_parity_reference_runs_on_the_jobs_device_with_its_own_backend(tmp_path, monkeypatch):
    """One rank shares no GPU: the reference of a gloo-on-GPUs job is nccl on the same device."""
    cmds = _launched(monkeypatch)
    for device, backend in (("cuda", "gloo"), ("cpu", "gloo"), ("cuda", "nccl")):
        cfg = load_config("configs/tiny_cpu.toml", [f"parallel.device={device}", f"parallel.backend={backend}"])
        rc, line = train_cli.parity(cfg, str(tmp_path))
        assert rc == 7 and line == "the 1-process reference run failed (rc 7); nothing compared"
        assert "--nproc-per-node=1" in cmds[-1]
        ref = ParallelConfig(**json.loads(cmds[-1][-2])["parallel"])  # python -m dtensor_moe.train.loop CONFIG DIR
        assert (ref.device, ref.nproc, ref.resolved_backend) == (device, 1, {"cuda": "nccl", "cpu": "gloo"}[device])


def test_launcher_refuses_an_empty_config_file(tmp_path, capsys):
    empty = tmp_path / "empty.toml"
    empty.write_text("")
    assert main(["train", "--config", str(empty), "--run-dir", str(tmp_path / "run"), "--steps", "2"]) == 2
    assert capsys.readouterr().err.startswith(
        f"dtensor-moe train: config file {str(empty)!r} sets no [model] or [training] key; it must set at least one"
    )
    assert not (tmp_path / "run").exists()


def test_launcher_names_a_missing_or_malformed_config_file(tmp_path, capsys):
    assert main(["train", "--config", str(tmp_path / "nope.toml")]) == 2
    assert capsys.readouterr().err == f"dtensor-moe train: config file '{tmp_path / 'nope.toml'}' not found\n"
    bad = tmp_path / "bad.toml"
    bad.write_text("[training]\nsteps = 5\nlr = 3e-3e\n")
    assert main(["train", "--config", str(bad)]) == 2
    assert capsys.readouterr().err == f"dtensor-moe train: config file '{bad}' is not valid TOML: Expected newline or end of document after a statement (at line 3, column 10)\n"  # noqa: E501


def _parsed(argv):
    import argparse


    p = argparse.ArgumentParser()
    train_cli.add_arguments(p)
    return p.parse_args(argv)


def test_resume_does_not_swallow_an_override():
    from dtensor_moe.cli.train import _resolve

    args = _parsed(["--config", "configs/tiny_cpu.toml", "--resume", "training.steps=5", "parallel.ep=1"])
    cfg, _ = _resolve(args)
    assert args.resume == "latest" and cfg.training.steps == 5 and cfg.parallel.ep == 1
    args = _parsed(["--config", "configs/tiny_cpu.toml", "--resume", "runs/lr=1e-3/checkpoints"])
    assert (
        _resolve(args)[0].training.steps == 50 and args.resume == "runs/lr=1e-3/checkpoints"
    )  # a path, not an override


def _tiny_checkpoint(root, step):
    from dtensor_moe.train.checkpoint import save
    from dtensor_moe.train.model import MoETransformer

    model = MoETransformer(load_config("configs/tiny_cpu.toml").model)
    return save(root, step, model)


def test_resume_problems_are_caught_by_the_launcher(tmp_path, capsys):
    run = tmp_path / "run"
    assert main([*TINY, "--run-dir", str(run), "--resume"]) == 2
    assert capsys.readouterr().err.startswith(
        f"dtensor-moe train: no complete checkpoint at or under '{run / 'checkpoints'}'"
    )
    ckpt = _tiny_checkpoint(run / "checkpoints", 4)
    assert main([*TINY, "--run-dir", str(run), "--resume", "model.n_heads=2", "model.top_k=1"]) == 2
    assert capsys.readouterr().err == (
        f"dtensor-moe train: --resume {ckpt} was saved with another model config (n_heads: saved 4 vs config 2; "
        f"top_k: saved 2 vs config 1); train with the config it was saved with ({ckpt / 'model_config.json'}) or "
        f"start a new --run-dir\n"
    )
    assert main([*TINY, "--run-dir", str(run), "--resume", str(ckpt), "--steps", "4"]) == 2
    assert capsys.readouterr().err == (f"dtensor-moe train: --resume {ckpt} is at step 4, training.steps is 4: nothing "
                                       f"left to train; raise --steps above 4\n")
    (ckpt / "__0_0.distcp").write_bytes(b"")
    assert main([*TINY, "--run-dir", str(run), "--resume", str(ckpt)]) == 2
    assert capsys.readouterr().err.startswith(
        f"dtensor-moe train: checkpoint {ckpt} cannot be loaded: __0_0.distcp is truncated"
    )


def test_resume_refuses_another_data_stream(tmp_path, capsys):
    """A checkpoint knows its data (train/data.py data_fingerprint): a resume on other data files, another held-out
    fraction, source or seed is refused in one line naming what changed; --new-data continues on purpose; a
    checkpoint without a fingerprint (an import) resumes as before. A changed file's content (documents appended)
    changes the fingerprint, whatever its name."""
    from dtensor_moe.cli.train import _resolve, _resume_target
    from dtensor_moe.train.checkpoint import save
    from dtensor_moe.train.data import data_fingerprint
    from dtensor_moe.train.model import MoETransformer

    docs = tmp_path / "docs.txt"
    docs.write_text("one document about experts.\n" * 400)
    files = ["data.source=files", f"data.paths=[\"{docs}\"]", f"data.cache_dir=\"{tmp_path / 'cache'}\""]
    run = tmp_path / "run"
    cfg = load_config("configs/tiny_cpu.toml", files)
    ckpt = save(run / "checkpoints", 2, MoETransformer(cfg.model), extra={"data": data_fingerprint(cfg)})
    for overrides, named in (([*files, "data.eval_fraction=0.1"], "data.eval_fraction: saved 0.0 vs now 0.1"),
                             ([*files, "training.seed=7"], "training.seed: saved 0 vs now 7"),
                             ([], "data.source: saved 'files' vs now 'corpus'")):
        assert main([*TINY, "--run-dir", str(run), "--resume", *overrides]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"dtensor-moe train: --resume {ckpt} was trained on another data stream ({named}") and \
            err.endswith("pass --new-data to continue on this data on purpose (fine-tuning)\n"), err
    with docs.open("a") as f:  # documents appended: same name, other content
        f.write("another document.\n" * 50)
    assert main([*TINY, "--run-dir", str(run), "--resume", *files]) == 2
    assert "(the data files' content or their tokenizer (data.paths, data.eval_paths, data.tokenizer))" in \
        capsys.readouterr().err
    args = _parsed(["--config", "configs/tiny_cpu.toml", "--run-dir", str(run), "--resume", "--new-data", *files])
    assert _resume_target(args, _resolve(args)[0], str(run)) == ckpt
    _tiny_checkpoint(run / "checkpoints", 3)  # no fingerprint: imported weights
    args = _parsed(["--config", "configs/tiny_cpu.toml", "--run-dir", str(run), "--resume"])
    assert _resume_target(args, _resolve(args)[0], str(run)).name == "step_00000003"


def test_run_results_survive_a_missing_matplotlib(tmp_path, monkeypatch, capsys):
    import sys

    from dtensor_moe.train.metrics import RunWriter

    for png in ("loss.png", "load.png"):
        (tmp_path / png).write_bytes(b"an earlier run's plot")
    writer = RunWriter(str(tmp_path), 1)
    writer.step({"step": 1, "loss": 5.0, "tokens_per_s": 100.0, "peak_mem_per_rank_gib": [0.5],
                 "expert_imbalance": [1.5], "ep_imbalance": [1.0]})
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    writer.finish({"final_loss": 5.0})
    assert json.loads((tmp_path / "summary.json").read_text()) == {"final_loss": 5.0}
    assert not (tmp_path / "loss.png").exists() and not (tmp_path / "load.png").exists()
    assert capsys.readouterr().err.splitlines()[-2:] == [
        "loss.png not written: matplotlib is not installed (pip install matplotlib); the losses are in metrics.jsonl",
        "load.png not written: matplotlib is not installed (pip install matplotlib); the loads are in metrics.jsonl",
    ]
