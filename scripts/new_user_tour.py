"""The new-user tour: bad inputs and faults tried as a new user (and a cluster scheduler) would, each judged by a
check.

    python scripts/new_user_tour.py [--jobs 3] [--launches 100] [--only all|runs|hf|settings|parity|data]
        [--json OUT.json]

Areas: the Python API (configs, meshes, plan, parallelize, forward, checkpoint load), the CLI
(`train | plan | explain | export | import`), the main job's config, checkpoints (damaged, replaced,
another model, a rank killed mid-save), NaN isolation under EP on 2 gloo ranks, a real run under a
scheduler's events (tour_runs.py: signals, a stalled rank, a busy run dir, full and read-only disks, a
diverging run, CUDA asked for without CUDA, N launches in a row), and Hugging Face round trips and
mismatched checkpoints (tour_hf.py). CLI cases run as subprocesses (`python -m dtensor_moe.cli` with this
checkout first on PYTHONPATH, i.e. `dtensor-moe`) in a scratch directory with a timeout, so a hang is
detected and counted.

Verdicts come from checks, never labels:
- clear: ValueError (API) or rc 2 (CLI) whose message names every expected field (and, where the
  input has valid values, says which: "must be", "valid", "one of", "expects"); for the CLI also
  exactly one stderr line besides argparse's usage, no traceback, no rank started (the run dir was
  not created) and every guarded file byte-identical afterwards. An input that is accepted on
  purpose (a note on stderr, e.g. a checkpoint without manifest) is clear only if the note names
  the fields and the result is checked correct.
- unclear: refused, but with another exception type, a traceback, or a message missing a field.
- silent: accepted (rc 0 / no exception) where a refusal was due, or a wrong result.
- hang: past the timeout. data loss: a guarded file changed or vanished.
Prints a markdown table; writes a JSON summary (< 20 kB).
"""

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tour_base import (
    REPO,
    TIMEOUT_S,
    TINY_TOML,
    Result,
    Tour,
    cli,
    env,
    message_lines,
    names_missing,
    rank_pid,
    run_cli,
)
from tour_data import data_cases
from tour_hf import hf_cases
from tour_parity import parity_cases
from tour_runs import run_cases
from tour_settings import settings_cases

sys.path.insert(0, str(REPO))  # this checkout's dtensor_moe, as the CLI subprocesses get through PYTHONPATH


# --- the Python API: in-process calls -------------------------------------------------------------


class _Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise _Timeout()


def api(tour: Tour, area: str, tried: str, fn, fields, valid: bool = True, exc=ValueError, after=None) -> Result:
    """fn() must raise `exc` naming `fields`; after(), if given, checks nothing was changed ('' if so)."""
    r = Result(area, tried)
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(int(TIMEOUT_S))
    t0 = time.perf_counter()
    try:
        fn()
        r.outcome, r.verdict, r.why = "accepted", "silent", "no exception"
    except _Timeout:
        r.outcome, r.verdict, r.why = "timeout", "hang", f"> {TIMEOUT_S:.0f} s"
    except Exception as e:  # noqa: BLE001 - the tour judges whatever comes out
        r.outcome = type(e).__name__
        r.message = str(e).strip().splitlines()[0] if str(e).strip() else ""
        if not isinstance(e, exc):
            r.verdict, r.why = "unclear", f"{type(e).__name__}, not {exc.__name__}"
        else:
            r.why = names_missing(str(e), fields, valid)
            r.verdict = "unclear" if r.why else "clear"
    finally:
        signal.alarm(0)
    r.seconds = time.perf_counter() - t0
    if after is not None and r.verdict == "clear" and (lost := after()):
        r.verdict, r.why = "data loss", lost
    return tour.add(r)


def api_cases(tour: Tour, ckpt_ready):
    import torch
    import torch.distributed as dist

    from dtensor_moe import MoE, MoEConfig, MoEParallelDims, MoERunOptions, parallelize_moe, plan_moe
    from dtensor_moe.train.config import ModelConfig
    from dtensor_moe.train.model import MoETransformer
    from dtensor_moe.train.parallel.parallelize_transformer import parallelize_transformer

    def moe_cfg(**kw):
        return MoEConfig(**{"dim": 16, "hidden_dim": 8, "num_experts": 8, "top_k": 2, **kw})

    A = "API config"
    api(tour, A, "MoEConfig(top_k=2.5)", lambda: moe_cfg(top_k=2.5), ["top_k"])
    api(tour, A, "MoEConfig(top_k=True)", lambda: moe_cfg(top_k=True), ["top_k"])
    api(tour, A, "MoEConfig(num_experts=4.0)", lambda: moe_cfg(num_experts=4.0), ["num_experts"])
    api(tour, A, "MoEConfig(top_k=9) with num_experts=8", lambda: moe_cfg(top_k=9), ["top_k", "num_experts"])
    api(tour, A, "MoEConfig(aux_loss_coeff=nan)", lambda: moe_cfg(aux_loss_coeff=float("nan")), ["aux_loss_coeff"])
    api(tour, A, "MoEConfig(route_scale=-1.0)", lambda: moe_cfg(route_scale=-1.0), ["route_scale"])
    api(tour, A, "MoEConfig(score_func='relu')", lambda: moe_cfg(score_func="relu"), ["score_func", "softmax"])
    api(tour, A, "MoEConfig(num_expert_groups=3) with num_experts=8", lambda: moe_cfg(num_expert_groups=3),
        ["num_expert_groups"])
    api(tour, A, "MoERunOptions(capacity_factor=0)", lambda: MoERunOptions(capacity_factor=0), ["capacity_factor"])
    api(tour, A, "MoERunOptions(pad_to_capacity=True) without a capacity_factor",
        lambda: MoERunOptions(pad_to_capacity=True), ["pad_to_capacity", "capacity_factor"])
    api(tour, A, "MoE(num_experts=8, MoERunOptions(expert_replicas=9))",
        lambda: MoE(moe_cfg(), MoERunOptions(expert_replicas=9)), ["expert_replicas", "num_experts"])
    api(tour, A, "ModelConfig(dim=64, n_heads=3)", lambda: ModelConfig(n_heads=3), ["n_heads"])
    M = "API mesh/plan"
    api(tour, M, "MoEParallelDims(8, ep=2.0)", lambda: MoEParallelDims(8, ep=2.0), ["ep"])
    api(tour, M, "MoEParallelDims(8, ep='2')", lambda: MoEParallelDims(8, ep="2"), ["ep"])
    api(tour, M, "MoEParallelDims(8, ep=3)", lambda: MoEParallelDims(8, ep=3), ["ep", "Valid ep"])
    api(tour, M, "MoEParallelDims(8, dp_shard=3)", lambda: MoEParallelDims(8, dp_shard=3), ["dp_shard"])
    api(tour, M, "MoEParallelDims(0)", lambda: MoEParallelDims(0), ["world_size"])
    api(tour, M, "plan_moe(num_experts=6, MoEParallelDims(8, ep=4))",
        lambda: plan_moe(moe_cfg(num_experts=6), MoEParallelDims(8, ep=4)), ["num_experts", "ep"])
    api(tour, M, "plan_moe(hidden_dim=6, MoEParallelDims(8, etp=4))",
        lambda: plan_moe(moe_cfg(hidden_dim=6), MoEParallelDims(8, etp=4)), ["hidden_dim", "etp"])

    P = "API parallelize"
    api(tour, P, "parallelize_moe before init_process_group",
        lambda: parallelize_moe(MoE(moe_cfg()), MoEParallelDims(1), device_type="cpu"), ["init_process_group"])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        api(tour, P, "parallelize_moe(MoEParallelDims(2)) on a 1-process group",
            lambda: parallelize_moe(MoE(moe_cfg()), MoEParallelDims(2), device_type="cpu"), ["world_size"])
        model = MoETransformer(ModelConfig(num_experts=4, hidden_dim=8, dim=16, n_heads=2, max_seq_len=16))
        api(tour, P, "parallelize_transformer(activation_checkpoint='some')",
            lambda: parallelize_transformer(model, MoEParallelDims(1), device_type="cpu", activation_checkpoint="some"),
            ["activation_checkpoint", "selective"])
        api(tour, P, "parallelize_transformer(compile=True, activation_checkpoint='full')",
            lambda: parallelize_transformer(model, MoEParallelDims(1), device_type="cpu", compile=True,
                                      activation_checkpoint="full"), ["activation_checkpoint", "compile"])
        moe = parallelize_moe(MoE(moe_cfg()), MoEParallelDims(1), device_type="cpu")
        before = {k: v.full_tensor().clone() for k, v in moe.state_dict().items()}

        def unchanged():
            bad = [k for k, v in moe.state_dict().items() if not torch.equal(v.full_tensor(), before[k])]
            return f"changed: {bad}" if bad else ""

        api(
            tour,
            P,
            "parallelize_moe twice on the same module",
            lambda: parallelize_moe(moe, MoEParallelDims(1), device_type="cpu"),
            ["already parallelized"],
            after=unchanged,
        )
        F = "API forward"
        api(tour, F, "MoE(dim=16)(x of shape [2, 3, 15])", lambda: moe(torch.randn(2, 3, 15)), ["dim=16", "15"])
        api(tour, F, "MoE(dim=16)(integer tensor [2, 3, 16])", lambda: moe(torch.ones(2, 3, 16, dtype=torch.long)),
            ["floating-point", "int64"])
        api(tour, F, "MoE(dim=16)(0-d tensor)", lambda: moe(torch.tensor(1.0)), ["dim=16"])
    finally:
        dist.destroy_process_group()

    ckpt_ready.wait()
    if tour.pristine is None:
        return
    from dtensor_moe.train.checkpoint import load, step_dir

    cfg = ModelConfig(**{**json.loads((step_dir(tour.pristine, 4) / "model_config.json").read_text()), "top_k": 1})
    other = MoETransformer(cfg)
    state = {k: v.clone() for k, v in other.state_dict().items()}
    opt = torch.optim.AdamW(other.parameters())
    api(
        tour,
        "API checkpoint",
        "load(step_4 saved with top_k=2, model with top_k=1)",
        lambda: load(step_dir(tour.pristine, 4), other, opt),
        ["top_k", "step_00000004"],
        valid=False,
        after=lambda: (
            "" if all(torch.equal(v, state[k]) for k, v in other.state_dict().items()) else "model was modified"
        ),
    )


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- the CLI: subprocesses ---------------------------------------------------------------------


def config_cases(tour: Tour, jobs):
    """The main job's config and flags, and plan/explain: each refused before any rank starts."""
    s = tour.scratch
    bad_toml = s / "bad.toml"
    bad_toml.write_text("[training]\nsteps = 5\nlr = 3e-3e\n")
    (s / "sections.toml").write_text("[optim]\nlr = 1e-3\n")
    (s / "nontable.toml").write_text("model = 3\n")
    (s / "unknown_key.toml").write_text("[model]\nn_head = 4\n")
    (s / "adir.toml").mkdir(exist_ok=True)
    (s / "afile").write_text("not a directory\n")
    tiny = str(REPO / "configs" / "tiny_cpu.toml")
    T = "CLI train config"

    def train(tried, extra, fields, run_dir=None, **kw):
        run_dir = run_dir or s / f"run_{len(jobs)}"
        jobs.append((cli, tour, T, tried, ["train", "--config", tiny, "--run-dir", str(run_dir), *extra], fields,
                     {"run_dir": str(run_dir), **kw}))

    train("training.steps=ten", ["training.steps=ten"], ["training.steps", "int"])
    train("training.global_batch=0", ["training.global_batch=0"], ["training.global_batch"])
    train("training.seq_len=0", ["training.seq_len=0"], ["training.seq_len"])
    train(
        "training.seq_len=2048 (> model.max_seq_len 1024)",
        ["training.seq_len=2048"],
        ["training.seq_len", "max_seq_len"],
    )
    train("model.top_k=16 (> num_experts 8)", ["model.top_k=16"], ["model.top_k", "num_experts"])
    train("parallel.ep=3 (ep*etp=6 does not divide 8 ranks)", ["parallel.ep=3"], ["ep", "Valid ep"])
    train("training.global_batch=12 on 8 ranks", ["training.global_batch=12"], ["training.global_batch", "8"])
    train("training.lr=nan", ["training.lr=nan"], ["training.lr"])
    train("training.dtype=fp16", ["training.dtype=fp16"], ["training.dtype", "bf16"])
    train("parallel.device=tpu", ["parallel.device=tpu"], ["parallel.device", "cuda"])
    train("data.source=wikipedia", ["data.source=wikipedia"], ["data.source", "synthetic"])
    train("model.dim=60 (head dim 15, odd)", ["model.dim=60"], ["model.n_heads", "even"])
    train("model.vocab_size=100 (byte data needs 256)", ["model.vocab_size=100"], ["model.vocab_size", "256"])
    train("training.compile=true with activation_checkpoint=full", ["training.compile=true",
          "training.activation_checkpoint=full"], ["training.activation_checkpoint", "compile"])
    train("parallel.tp=3 on 8 ranks", ["parallel.tp=3"], ["parallel.tp", "valid tp"])
    train("training.activation_checkpoint=some", ["training.activation_checkpoint=some"],
          ["training.activation_checkpoint", "selective"])
    train("model.n_head=4 (unknown key)", ["model.n_head=4"], ["n_head", "n_heads"])
    train("optim.lr=1e-3 (unknown section)", ["optim.lr=1e-3"], ["optim", "training"])
    train("training.steps (override without =)", ["training.steps"], ["training.steps", "section.key=value"])
    train("--steps -5", ["--steps", "-5"], ["training.steps"])
    train("--nproc 0", ["--nproc", "0"], ["parallel.nproc"])
    train("--checkpoint-every -1", ["--checkpoint-every", "-1"], ["--checkpoint-every"])
    train("--keep-last 0", ["--keep-last", "0"], ["--keep-last"])
    train("--run-dir pointing at a file", [], ["--run-dir", "afile"], run_dir=s / "afile")
    train("--steps ten (argparse)", ["--steps", "ten"], ["--steps", "ten"])
    train("--stepz 5 (unknown flag)", ["--stepz", "5"], ["--stepz"], valid=False)
    train("--resume training.steps=6 in a fresh run dir (no checkpoint)", ["--resume", "training.steps=6"],
          ["checkpoint"], valid=False, absent=["training.steps=6"])
    train("--resume /nonexistent/step_00000004", ["--resume", "/nonexistent/step_00000004"],
          ["/nonexistent/step_00000004", "no such directory"], valid=False)
    F = "CLI train file"
    for tried, path, fields in [
        ("--config missing.toml", s / "missing.toml", ["missing.toml", "not found"]),
        ("--config with a TOML syntax error (line 3)", bad_toml, ["bad.toml", "line 3"]),
        ("--config with an unknown section [optim]", s / "sections.toml", ["optim", "sections.toml"]),
        ("--config with `model = 3` (not a table)", s / "nontable.toml", ["[model]", "table"]),
        ("--config with an unknown [model] key n_head", s / "unknown_key.toml", ["n_head", "n_heads"]),
        ("--config a directory", s / "adir.toml", ["adir.toml", "directory"]),
    ]:
        run_dir = s / f"run_{len(jobs)}"
        jobs.append((cli, tour, F, tried, ["train", "--config", str(path), "--run-dir", str(run_dir)], fields,
                     {"run_dir": str(run_dir)}))
    jobs.append((cli, tour, "CLI", "dtensor-moe trian (typo)", ["trian"], ["trian", "train"], {}))
    PL = "CLI plan/explain"
    for case in [
        ("plan --gpus 0", ["plan", "--model", "tiny_cpu", "--gpus", "0"], ["--gpus"]),
        ("plan --gpus eight", ["plan", "--model", "tiny_cpu", "--gpus", "eight"], ["--gpus", "eight"]),
        ("plan --inter-bw 0", ["plan", "--model", "tiny_cpu", "--gpus", "16", "--inter-bw", "0"], ["--inter-bw"]),
        ("plan --top -3", ["plan", "--model", "tiny_cpu", "--gpus", "8", "--top", "-3"], ["--top"]),
        ("plan --model nope", ["plan", "--model", "nope", "--gpus", "8"], ["nope", "presets"]),
        (
            "plan --model bad.toml (syntax error)",
            ["plan", "--model", str(bad_toml), "--gpus", "8"],
            ["bad.toml", "line 3"],
        ),
        (
            "plan --activation-checkpoint some",
            ["plan", "--model", "tiny_cpu", "--gpus", "8", "--activation-checkpoint", "some"],
            ["--activation-checkpoint", "full"],
        ),
        ("explain --world 8 --ep 3", ["explain", "--world", "8", "--ep", "3", "--num-experts", "4"],
         ["ep", "Valid ep"]),
        ("explain --num-experts 6 --ep 4", ["explain", "--world", "8", "--ep", "4", "--num-experts", "6"],
         ["ep", "experts"]),
        ("explain --num-experts 0", ["explain", "--world", "2", "--num-experts", "0"], ["--num-experts"]),
        (
            "explain --hidden-dim 0",
            ["explain", "--world", "2", "--num-experts", "4", "--hidden-dim", "0"],
            ["--hidden-dim"],
        ),
        (
            "explain --png into a missing directory",
            ["explain", "--world", "2", "--num-experts", "4", "--png", str(s / "no_such_dir" / "grid.png")],
            ["--png", "no_such_dir", "does not exist"],
            {"valid": False},
        ),
    ]:
        tried, argv, fields, *kw = case
        jobs.append((cli, tour, PL, tried, argv, fields, kw[0] if kw else {}))


# --- checkpoints: one tiny 2-rank run, then faults on copies of its checkpoints --------------------


def make_checkpoints(tour: Tour) -> bool:
    """The tour's tiny EP2 job with --checkpoint-every 2 (steps 2 and 4), and an export of step 4."""
    s = tour.scratch
    rc, err, _, dt = run_cli(["train", "--config", str(s / "tiny.toml"), "--run-dir", str(s / "base"),
                              "--checkpoint-every", "2"], s)
    tour.setup_s = dt
    if rc != 0:
        print(f"checkpoint setup failed (rc {rc}):\n{err[-3000:]}", file=sys.stderr)
        return False
    from dtensor_moe.train.export import export_checkpoint

    t0 = time.perf_counter()
    export_checkpoint(s / "base" / "checkpoints" / "step_00000004", s / "export4")
    tour.setup_s += time.perf_counter() - t0
    tour.pristine = s / "base" / "checkpoints"
    return True


def _copy(tour: Tour, name: str) -> Path:
    """A fresh run dir holding a copy of the pristine checkpoints; returns its checkpoint root."""
    run = tour.scratch / name
    shutil.copytree(tour.pristine, run / "checkpoints")
    return run / "checkpoints"


def _flip(path: Path, at: float = 0.5, n: int = 8):
    data = bytearray(path.read_bytes())
    i = int(len(data) * at)
    data[i : i + n] = bytes(b ^ 0xFF for b in data[i : i + n])
    path.write_bytes(bytes(data))


def _truncate(path: Path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _exported_like(reference: Path, step: str):
    """accepted_check for export: the written weights equal `reference`'s and record `step`."""
    def check(stdout: str) -> str:
        from safetensors import safe_open
        from safetensors.torch import load_file

        path = Path(stdout.strip().splitlines()[-1]) if stdout.strip() else None
        if path is None or not path.is_file():
            return "no file written"
        with safe_open(path, framework="pt") as f:
            if f.metadata().get("step") != step:
                return f"exported step {f.metadata().get('step')}, want {step}"
        got, want = load_file(path), load_file(reference)
        bad = [k for k in want if k not in got or not got[k].equal(want[k])]
        return f"weights differ: {bad[:3]}" if bad else ""
    return check


def checkpoint_cases(tour: Tour, jobs):
    s, tiny = tour.scratch, str(tour.scratch / "tiny.toml")
    C = "checkpoint"
    step4 = "step_00000004"
    ref4 = s / "export4" / "model.safetensors"

    def resume(tried, name, damage, target, fields, extra=(), **kw):
        root = _copy(tour, name)
        damage(root)
        jobs.append(
            (
                cli,
                tour,
                C,
                tried,
                ["train", "--config", tiny, "--run-dir", str(root.parent), "--resume", str(target(root)), *extra],
                fields,
                {"run_dir": str(root.parent), "valid": False, **kw},
            )
        )

    resume("--resume step_4 with __1_0.distcp truncated", "c_trunc", lambda r: _truncate(r / step4 / "__1_0.distcp"),
           lambda r: r / step4, [step4, "__1_0.distcp", "truncated"], ["training.steps=6"])
    resume(
        "--resume step_4 with 8 bytes flipped in __0_0.distcp",
        "c_flip",
        lambda r: _flip(r / step4 / "__0_0.distcp"),
        lambda r: r / step4,
        [step4, "__0_0.distcp", "corrupted"],
        ["training.steps=6"],
    )
    resume("--resume step_4 with .metadata deleted", "c_nometa", lambda r: (r / step4 / ".metadata").unlink(),
           lambda r: r / step4, [step4, ".metadata", "missing"], ["training.steps=6"])
    resume("--resume step_4 with model.top_k=1 (another config, same shapes)", "c_topk", lambda r: None,
           lambda r: r / step4, ["top_k", "saved 2"], ["training.steps=6", "model.top_k=1"])
    resume("--resume step_4 with training.steps=4 (nothing left)", "c_done", lambda r: None,
           lambda r: r / step4, ["training.steps", "step 4"])
    resume("--resume (root) when every step is damaged", "c_all",
           lambda r: [_flip(r / d / "__0_0.distcp") for d in ("step_00000002", step4)],
           lambda r: r, ["step_00000002", step4, "__0_0.distcp"], ["training.steps=6"])

    root = _copy(tour, "c_fallback")
    _flip(root / step4 / "__1_0.distcp")
    jobs.append((cli, tour, C, "export ROOT whose newest step_4 has a flipped byte (falls back to step_2)",
                 ["export", str(root), str(s / "out_fallback")], [step4, "__1_0.distcp", "step_00000002"],
                 {"expect_rc": 0, "valid": False, "guard": [str(root)],
                  "accepted_check": _exported_step(s / "out_fallback", "2")}))
    root = _copy(tour, "c_nomanifest")
    (root / step4 / "manifest.json").unlink()
    jobs.append(
        (
            cli,
            tour,
            C,
            "export step_4 with manifest.json deleted (refused; the opt-in is named)",
            ["export", str(root / step4), str(s / "out_nomanifest")],
            [step4, "manifest.json", "DTENSOR_MOE_ALLOW_UNVERIFIED"],
            {"valid": False, "guard": [str(root)]},
        )
    )
    root = _copy(tour, "c_nomanifest_flip")
    (root / step4 / "manifest.json").unlink()
    _flip(root / step4 / "__0_0.distcp")
    jobs.append((cli, tour, C, "export step_4 with manifest.json deleted and __0_0.distcp flipped",
                 ["export", str(root / step4), str(s / "out_nomanifest_flip")], [step4, "manifest.json"],
                 {"valid": False, "guard": [str(root)]}))
    root = _copy(tour, "c_import")
    jobs.append((cli, tour, C, "import onto existing step_4 (model + optimizer) without --force",
                 ["import", str(ref4), str(root), "--step", "4"], [step4, "--force"], {"guard": [str(root)]}))
    garbage = s / "garbage"
    garbage.mkdir(exist_ok=True)
    (garbage / "model.safetensors").write_bytes(os.urandom(4096))
    shutil.copy(s / "export4" / "config.json", garbage / "config.json")
    jobs.append((cli, tour, C, "import a model.safetensors of random bytes",
                 ["import", str(garbage / "model.safetensors"), str(s / "imp_garbage")], ["model.safetensors"],
                 {"valid": False}))
    jobs.append(
        (
            cli,
            tour,
            C,
            "import --hf from a missing directory",
            ["import", "--hf", str(s / "no_hf"), str(s / "imp_hf")],
            ["no_hf"],
            {"valid": False},
        )
    )
    jobs.append((cli, tour, C, "export CKPT with neither OUT nor --hf", ["export", str(tour.pristine / step4)],
                 ["OUT", "--hf"], {"absent": ["--force"]}))
    (s / "out_is_file").write_text("x\n")
    jobs.append((cli, tour, C, "export onto a path that is a file",
                 ["export", str(tour.pristine / step4), str(s / "out_is_file")], ["out_is_file", "file"],
                 {"guard": [str(s / "out_is_file")]}))


def _exported_step(out_dir: Path, step: str):
    def check(stdout: str) -> str:
        from safetensors import safe_open

        path = out_dir / "model.safetensors"
        if not path.is_file():
            return "no file written"
        with safe_open(path, framework="pt") as f:
            got = f.metadata().get("step")
        return "" if got == step else f"exported step {got}, want {step}"
    return check


def killed_rank_case(tour: Tour) -> Result:
    """Rank 1 of a 2-rank job is SIGKILLed while a checkpoint is being written (a .tmp-step dir exists):
    the job must end (no hang), a complete earlier step must stay loadable and --resume must continue."""
    from dtensor_moe.train.checkpoint import pick

    s = tour.scratch
    run = s / "killed"
    argv = ["train", "--config", str(s / "tiny.toml"), "--run-dir", str(run), "--checkpoint-every", "1",
            "training.steps=400"]
    r = Result("checkpoint", "SIGKILL rank 1 of 2 while a checkpoint is written (.tmp-step dir present)")
    t0 = time.perf_counter()
    p = subprocess.Popen([sys.executable, "-m", "dtensor_moe.cli", *argv], cwd=s, env=env(), text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    ckpts, victim, mid_save = run / "checkpoints", None, False
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline and p.poll() is None:
        if ckpts.is_dir() and any(d.name.startswith("step_") for d in ckpts.iterdir()) and \
                any(d.name.startswith(".tmp-step_") for d in ckpts.iterdir()):
            victim = rank_pid(p.pid, 1)
            if victim is not None:
                os.kill(victim, signal.SIGKILL)
                mid_save = any(d.name.startswith(".tmp-step_") for d in ckpts.iterdir())
                break
        time.sleep(0.005)
    killed_at = time.perf_counter()
    try:
        _, err = p.communicate(timeout=120)
        rc = p.returncode
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        _, err = p.communicate()
        rc = None
    ended_after = time.perf_counter() - killed_at
    (s / "killed.stderr").write_text(err)
    lines = message_lines(err)
    r.message = next((ln.strip() for ln in lines if "SIGKILL" in ln), "")
    r.outcome = "timeout" if rc is None else f"rc {rc}"
    if victim is None:
        r.verdict, r.why = "unclear", "never caught a save in progress; no rank killed"
    elif rc is None:
        r.verdict, r.why = "hang", "job still running 120 s after the kill"
    elif rc == 0:
        r.verdict, r.why = "silent", "rc 0 after a rank was killed"
    elif "SIGKILL" not in err:
        r.verdict, r.why = "unclear", "stderr does not say a rank was killed"
    else:
        try:  # the newest intact step, every file checked against its manifest
            good = pick(ckpts)
            r.verdict = "clear"
            r.why = (f"ended {ended_after:.1f} s after the kill; newest intact {good.name} verified"
                     + ("" if mid_save else "; the save had finished when the kill landed"))
        except ValueError as e:
            r.verdict, r.why = "data loss", f"no intact step left: {e}"
    r.seconds = time.perf_counter() - t0
    return tour.add(r)


# --- NaN isolation under EP=2 on 2 gloo ranks ------------------------------------------------------


def nan_worker(out_path: str):
    """Each rank: the 1-process float64 reference on the concatenated batch (token 0 of rank 0 NaN) and the
    EP2 layer on its half; outputs, aux loss and every gradient must be NaN exactly where the reference is."""
    import copy

    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from dtensor_moe import MoE, MoEConfig, MoEParallelDims, parallelize_moe

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    report = {}
    for lb in ("none", "aux_loss"):
        torch.manual_seed(0)
        cfg = MoEConfig(dim=8, hidden_dim=8, num_experts=4, top_k=2, num_shared_experts=1, load_balance=lb)
        ref = MoE(cfg).double()
        moe = parallelize_moe(copy.deepcopy(ref), MoEParallelDims(world, ep=world), device_type="cpu")
        x = torch.randn(world, 6, 8, dtype=torch.float64)
        x[0, 0, 0] = float("nan")
        g = torch.randn_like(x)
        xr = x.clone().requires_grad_()
        yr = ref(xr)
        aux_r = ref.aux_loss if lb == "aux_loss" else torch.zeros((), dtype=torch.float64)
        ((yr * g).sum() / world + aux_r).backward()
        xl = x[rank].clone().requires_grad_()
        yl = moe(xl)
        aux_l = moe.aux_loss if lb == "aux_loss" else torch.zeros((), dtype=torch.float64)
        ((yl * g[rank]).sum() + aux_l).backward()

        def same(a, b):
            return torch.equal(a.isnan(), b.isnan()) and torch.allclose(
                a.nan_to_num(0.0), b.nan_to_num(0.0), atol=1e-10
            )

        grads = {n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for n, p in moe.named_parameters()}
        ref_grads = dict((n, p.grad) for n, p in ref.named_parameters())
        report[lb] = {
            "reference_nan_tokens": int(yr.isnan().any(-1).sum()),  # 1: the NaN stays in its token (sanity)
            "nan_tokens_here": int(yl.isnan().any(-1).sum()),
            "outputs_match": same(yl, yr[rank]),
            "input_grad_match": same(xl.grad, xr.grad[rank] * world),  # the reference's loss is the rank mean
            "aux_loss_match": bool(same(aux_l.reshape(1), aux_r.reshape(1))),
            "grads_mismatched": [n for n in ref_grads if grads[n] is None or not same(grads[n], ref_grads[n])],
        }
    everyone = [None] * world
    dist.all_gather_object(everyone, report)
    if rank == 0:
        Path(out_path).write_text(json.dumps(everyone))
    dist.destroy_process_group()


def nan_case(tour: Tour) -> Result:
    out = tour.scratch / "nan.json"
    r = Result("NaN isolation", "EP2 on 2 gloo ranks, one NaN element in token 0 of rank 0 (aux loss off / on)")
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={_free_port()}",
           str(Path(__file__).resolve()), "--nan-worker", str(out)]
    try:
        p = subprocess.run(cmd, cwd=tour.scratch, env=env(), capture_output=True, text=True, timeout=TIMEOUT_S)
        rc = p.returncode
    except subprocess.TimeoutExpired:
        rc = None
    r.seconds = time.perf_counter() - t0
    r.outcome = "timeout" if rc is None else f"rc {rc}"
    if rc is None:
        r.verdict, r.why = "hang", f"> {TIMEOUT_S:.0f} s"
        return tour.add(r)
    if rc != 0 or not out.is_file():
        r.verdict, r.why = "unclear", f"worker failed: {message_lines(p.stderr)[-1:]}"
        return tour.add(r)
    ranks = json.loads(out.read_text())
    problems = []
    for rank, rep in enumerate(ranks):
        for lb, c in rep.items():
            if c["reference_nan_tokens"] != 1:
                problems.append(f"{lb}: reference has {c['reference_nan_tokens']} NaN tokens")
            bad = [k for k in ("outputs_match", "input_grad_match", "aux_loss_match") if not c[k]]
            bad += c["grads_mismatched"]
            if bad:
                problems.append(f"rank {rank} {lb}: {bad}")
    nan_here = [rep["none"]["nan_tokens_here"] for rep in ranks]
    r.message = (f"NaN tokens per rank {nan_here} (reference: 1, on rank 0); outputs, input grads, aux loss and "
                 f"every parameter gradient NaN exactly where the reference is: {'yes' if not problems else 'no'}")
    r.verdict, r.why = ("silent", "; ".join(problems)[:300]) if problems else ("clear", "")
    return tour.add(r)


# --- report ---------------------------------------------------------------------------------------


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def table(results) -> str:
    rows = ["| # | area | tried | outcome | message (first line) | s | verdict |", "|---|---|---|---|---|---|---|"]
    for i, r in enumerate(results, 1):
        verdict = r.verdict if not r.why else f"{r.verdict} ({r.why})"
        rows.append(f"| {i} | {r.area} | {_cell(r.tried)} | {r.outcome} | {_cell(r.message)} | {r.seconds:.1f} | "
                    f"{_cell(verdict)} |")
    return "\n".join(rows)


def write_json(path: Path, results, total_s: float, setup_s: float):
    import torch

    counts = {v: sum(r.verdict == v for r in results) for v in ("clear", "unclear", "silent", "hang", "data loss")}
    for limit in (160, 100, 60, 30, 0):
        doc = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "cases": len(results), "verdicts": counts,
               "total_s": round(total_s, 1), "checkpoint_setup_s": round(setup_s, 1),
               "results": [{"area": r.area, "tried": r.tried, "outcome": r.outcome, "message": r.message[:limit],
                            "s": round(r.seconds, 1), "verdict": r.verdict, **({"why": r.why[:limit]} if r.why else {})}
                           for r in results]}
        text = "{\n" + ",\n".join(f" {json.dumps(k)}: {json.dumps(v)}" for k, v in doc.items() if k != "results")
        text += ',\n "results": [\n' + ",\n".join("  " + json.dumps(x) for x in doc["results"]) + "\n ]\n}\n"
        if len(text.encode()) <= 20_000:
            break
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return counts


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=3, help="CLI cases run at once")
    ap.add_argument("--json", default=str(REPO / "benchmarks" / "results" / "2026-12-01" / "new_user_tour.json"))
    ap.add_argument("--keep", action="store_true", help="keep the scratch directory")
    ap.add_argument("--launches", type=int, default=100, help="tiny runs launched one after another (0: none)")
    ap.add_argument("--only", choices=("all", "runs", "hf", "settings", "parity", "data"), default="all",
                    help="runs: only the run families (signals, stalls, concurrency, disk, environment, launches); "
                         "hf: only the Hugging Face round trips and mismatches; settings: only tour_settings.py's; "
                         "parity: only tour_parity.py's (train --parity, explain at any world size); data: only "
                         "tour_data.py's (what a run trains on and writes)")
    ap.add_argument("--nan-worker", metavar="OUT", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.nan_worker:
        return nan_worker(args.nan_worker)
    t0 = time.perf_counter()
    scratch = Path(tempfile.mkdtemp(prefix="dtensor_moe_tour_"))
    tour = Tour(scratch)
    ckpt_ready = threading.Event()
    jobs, late = [], []  # late: the checkpoint cases, submitted once their checkpoints exist
    (scratch / "tiny.toml").write_text(TINY_TOML)
    if args.only == "all":
        config_cases(tour, jobs)
    # The long runs (each starts ranks) get threads of their own: the CLI cases need not wait for them. Two at a
    # time: the run families time what a job does after an event, which a machine loaded past its cores distorts.
    long_runs = ThreadPoolExecutor(max_workers=2)
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        def setup():
            try:
                if make_checkpoints(tour):
                    faults = []
                    checkpoint_cases(tour, faults)
                    late.extend(pool.submit(fn, *a, **kw) for fn, *a, kw in faults)
            finally:
                ckpt_ready.set()

        futures = []
        if args.only == "all":
            futures += [long_runs.submit(fn) for fn in (setup, lambda: nan_case(tour), lambda: killed_rank_case(tour))]
            futures += [pool.submit(fn, *a, **kw) for fn, *a, kw in jobs]
            futures += [pool.submit(fn, *a) for fn, *a in hf_cases(tour)]
        if args.only in ("all", "runs"):
            futures += [long_runs.submit(fn, *a) for fn, *a in run_cases(tour, args.launches)]
        if args.only == "hf":
            futures += [pool.submit(fn, *a) for fn, *a in hf_cases(tour)]
        if args.only in ("all", "settings"):
            futures += [pool.submit(fn, *a) for fn, *a in settings_cases(tour)]
        if args.only in ("all", "parity"):
            futures += [pool.submit(fn, *a) for fn, *a in parity_cases(tour)]
        if args.only in ("all", "data"):
            futures += [pool.submit(fn, *a) for fn, *a in data_cases(tour)]
        if args.only == "all":
            api_cases(tour, ckpt_ready)
            ckpt_ready.wait()  # every checkpoint case is submitted before the pool shuts down
        for f in futures + late:
            f.result()  # a bug in the tour itself surfaces here
    long_runs.shutdown()
    results = sorted(tour.results, key=lambda r: (r.area.startswith("API") is False, r.order))
    total = time.perf_counter() - t0
    print(table(results))
    counts = write_json(Path(args.json), results, total, tour.setup_s)
    print(f"\n{len(results)} cases in {total:.0f} s (checkpoint setup {tour.setup_s:.0f} s): "
          + ", ".join(f"{n} {v}" for v, n in counts.items()))
    if not args.keep:
        shutil.rmtree(scratch, ignore_errors=True)
    else:
        print(f"scratch kept: {scratch}", file=sys.stderr)
    return 0 if counts["clear"] == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
