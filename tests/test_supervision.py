"""`dtensor-moe train` under a scheduler, with real processes: SIGTERM preempts with the step saved and `--resume`
continues it, a second run into the same run dir is refused, a stalled rank stops the job naming it, and killing the
launcher leaves no rank behind. Two ranks of a small model, so each launch costs a few CPU seconds."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dtensor_moe.train.supervision import read_heartbeats

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["parallel.nproc=2", "parallel.ep=2", "parallel.etp=1", "model.dim=32", "model.n_layers=1",
         "model.hidden_dim=32", "training.seq_len=32", "training.global_batch=4", "data.source=synthetic"]


def _launch(run_dir: Path, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "dtensor_moe.cli", "train", "--config", "configs/tiny_cpu.toml", "--run-dir",
           str(run_dir), *SMALL, *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _wait_for_step(run_dir: Path, proc: subprocess.Popen, step: int, timeout: float = 120) -> dict[int, dict]:
    deadline = time.time() + timeout
    while time.time() < deadline:
        beats = read_heartbeats(run_dir)
        if len(beats) == 2 and all((b["step"] or 0) >= step for b in beats.values()):
            return beats
        assert proc.poll() is None, proc.stderr.read()
        time.sleep(0.2)
    raise AssertionError(f"no step {step} within {timeout} s: {read_heartbeats(run_dir)}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return (
        Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z" if sys.platform == "linux" else True
    )


def _all_gone(pids, timeout: float = 20) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if not any(_alive(p) for p in pids):
            return True
        time.sleep(0.2)
    return False


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


STEPS = 60  # ~3 s of steps: the SIGTERM below lands well before the end


def test_sigterm_saves_the_step_and_resume_continues_bit_identically(tmp_path):
    """Preempted at whatever step the signal finds, then resumed: every step's loss and gradient norm equal an
    uninterrupted run's bit for bit (same config, same steps), and no step is lost or repeated."""
    run_dir = tmp_path / "run"
    first = _launch(run_dir, f"training.steps={STEPS}")
    beats = _wait_for_step(run_dir, first, 2)
    t0 = time.time()
    first.send_signal(signal.SIGTERM)
    assert first.wait(60) == 75
    assert time.time() - t0 < 60
    err = first.stderr.read()
    stopped = json.loads((run_dir / "stopped.json").read_text())
    step = stopped["step"]
    assert step < STEPS, "the run ended before the signal: nothing was tested"
    assert f"stopped by SIGTERM after step {step}; checkpoint" in err, err
    assert Path(stopped["checkpoint"]).name == f"step_{step:08d}" and Path(stopped["checkpoint"]).is_dir()
    assert _rows(run_dir)[-1]["step"] == step  # the step every rank finished is the one saved: nothing lost
    assert _all_gone([b["pid"] for b in beats.values()])
    resumed = _launch(run_dir, f"training.steps={STEPS}", "--resume")
    whole = _launch(tmp_path / "whole", f"training.steps={STEPS}")
    assert resumed.wait(120) == 0, resumed.stderr.read()
    assert whole.wait(120) == 0, whole.stderr.read()
    got, want = _rows(run_dir), _rows(tmp_path / "whole")
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))  # appended after the saved step
    assert [(r["loss"], r["grad_norm"], r["lr"]) for r in got] == [(r["loss"], r["grad_norm"], r["lr"]) for r in want]


def test_sigint_stops_the_job_and_a_second_one_at_once(tmp_path):
    """A second run into a busy run dir is refused at once; a first SIGINT (Ctrl-C) stops after the step with a
    checkpoint (rc 130); in another run, SIGINT twice kills every rank at once. Either way no process is left."""
    run_dir = tmp_path / "run"
    proc = _launch(run_dir, "training.steps=100000")
    beats = _wait_for_step(run_dir, proc, 1)
    second, t0 = _launch(run_dir, "training.steps=3"), time.time()
    assert second.wait(60) == 2 and time.time() - t0 < 30
    assert f"is in use by another `dtensor-moe train` (pid {proc.pid})" in second.stderr.read()
    assert proc.poll() is None  # the first run goes on
    proc.send_signal(signal.SIGINT)
    assert proc.wait(60) == 130
    assert "stopped by SIGINT after step" in proc.stderr.read()
    assert _all_gone([b["pid"] for b in beats.values()])
    proc = _launch(tmp_path / "again", "training.steps=100000")
    beats = _wait_for_step(tmp_path / "again", proc, 1)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.5)  # one signal pending at a time: two sent at once arrive as one
    proc.send_signal(signal.SIGINT)
    assert proc.wait(60) == 130
    assert "second SIGINT: stopping every rank now" in proc.stderr.read()
    assert _all_gone([b["pid"] for b in beats.values()])


def test_a_stalled_rank_stops_the_job_naming_it(tmp_path):
    run_dir = tmp_path / "run"
    proc = _launch(run_dir, "training.steps=100000", "parallel.timeout_s=6")
    beats = _wait_for_step(run_dir, proc, 1)
    os.kill(beats[1]["pid"], signal.SIGSTOP)
    t0 = time.time()
    assert proc.wait(60) == 124
    assert time.time() - t0 < 6 + 10
    err = proc.stderr.read()
    assert f"rank 1 (pid {beats[1]['pid']}, stopped (SIGSTOP?)) made no progress for" in err, err
    assert _all_gone([b["pid"] for b in beats.values()])


def test_killing_the_launcher_leaves_no_rank(tmp_path):
    run_dir = tmp_path / "run"
    proc = _launch(run_dir, "training.steps=100000")
    beats = _wait_for_step(run_dir, proc, 1)
    proc.kill()
    proc.wait(10)
    assert _all_gone([b["pid"] for b in beats.values()]), "ranks outlived their launcher"


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root (CI runs as root)")
def test_a_full_disk_stops_the_run_with_one_line_and_keeps_the_last_checkpoint(tmp_path):
    """A disk that fills between two saves: every rank stops after the failed save (rc 74), one line names the
    error and the last good checkpoint, no temporary checkpoint dir is left, the earlier steps stay loadable."""
    from dtensor_moe.train.checkpoint import pick

    mnt = tmp_path / "disk"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3M", "tmpfs", str(mnt)], check=True)
    try:
        proc = _launch(mnt / "run", "training.steps=1000", "--checkpoint-every", "1", "--keep-last", "1000")
        assert proc.wait(120) == 74
        lines = [ln for ln in proc.stderr.read().replace("\r", "\n").splitlines() if ln.startswith("dtensor-moe")]
        # The failing write's own words vary (ENOSPC, or torch.save's "unexpected pos" on a short write).
        assert len(lines) == 1 and re.search(r"saving checkpoint step \d+ into .* failed: rank", lines[0]), lines
        ckpts = mnt / "run" / "checkpoints"
        assert not list(ckpts.glob(".tmp-*"))
        good = pick(ckpts)  # verified against its manifest
        assert f"last good checkpoint: {good}" in lines[0], lines
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.parametrize("resume", [[], ["/nonexistent/step_00000004"]], ids=["latest", "a missing step"])
def test_resume_without_a_checkpoint_makes_no_run_dir(tmp_path, capsys, resume):
    """Refused in one line before anything is made: a run dir left behind looks like a run that started."""
    from dtensor_moe.cli import main

    run_dir = tmp_path / "fresh"
    argv = ["train", "--config", str(ROOT / "configs" / "tiny_cpu.toml"), "--run-dir", str(run_dir), "--resume"]
    assert main([*argv, *resume]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and ("no complete checkpoint" in err or "no such directory" in err), err
    assert not run_dir.exists()
