"""The torchtitan hook under a scheduler: SIGTERM to torchrun mid-run stops every rank after the same step, saves
that step in full (not at the checkpoint interval) and exits 75 with one line (torchrun itself then ends with its
own SignalException report, which no rank can change); the same command resumes from it.
One real torchrun of 2 CPU ranks (EP2) and one resumed run. They are also the test of the documented launcher
(torchrun + dtensor_moe.titan.cpu_train, docs/titan.md): its steps log falling losses and a run that reaches its last
step exits 0 (a launch of its own cost what this test's two cost, twice)."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from .test_titan import LAUNCHER_TIMEOUT_S, _ours


def _torchrun(dump: Path, *extra: str, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "dtensor_moe.titan.cpu_train",
           *_ours(dump, 2, 1, "--checkpoint.enable", "--checkpoint.interval", "1000", *extra)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)


def _losses(log: Path) -> dict[int, float]:
    text = re.sub(r"\x1b\[[0-9;]*m", "", log.read_text())
    return {int(s): float(v) for s, v in re.findall(r"step:\s+(\d+)\s+loss:\s+([0-9.]+)", text)}


def _steps(log: Path) -> list[int]:
    return sorted(_losses(log))


def test_sigterm_saves_the_step_and_the_same_command_resumes(tmp_path):
    dump, log = tmp_path / "dump", tmp_path / "first.log"
    proc = _torchrun(dump, "--training.steps", "100000", log=log)
    deadline = time.time() + LAUNCHER_TIMEOUT_S
    while not [s for s in _steps(log) if s >= 2]:
        assert proc.poll() is None and time.time() < deadline, log.read_text()[-3000:]
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)  # torchrun hands it on to both ranks
    proc.wait(120)
    text = log.read_text()
    found = re.findall(r"dtensor_moe\.titan: stopped by SIGTERM after step (\d+); checkpoint (\S+); the same", text)
    assert len(found) == 1, text[-3000:]
    step, path = int(found[0][0]), Path(found[0][1])
    assert path.name == f"step-{step}" and (path / ".metadata").is_file(), text[-3000:]
    assert max(_steps(log)) == step  # no step ran after the saved one
    losses = _losses(log)  # the documented launcher trains: every step up to the saved one logged, the loss falls
    assert sorted(losses) == list(range(1, step + 1)) and losses[2] < losses[1], text[-3000:]
    resumed_log = tmp_path / "resumed.log"
    resumed = _torchrun(dump, "--training.steps", str(step + 1), log=resumed_log)
    assert resumed.wait(LAUNCHER_TIMEOUT_S) == 0, resumed_log.read_text()[-3000:]
    assert set(_steps(resumed_log)) == {step + 1}, resumed_log.read_text()[-3000:]  # each rank logs it
