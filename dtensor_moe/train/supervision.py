"""What a rank does for the scheduler above it: stop on a signal with its state saved, show it is alive, die with
its parent.

- SIGTERM and SIGUSR1 (what SLURM and Kubernetes send ahead of preemption) and SIGINT set a flag; the ranks agree
  on it inside the per-step metrics all-gather they already do, so all of them finish the same step, save a
  checkpoint and stop. No extra collective, and no rank stops a step early while its peers wait for it.
- A heartbeat file per rank (`RUN_DIR/.ranks/rank_<r>.json`: pid, step, time) lets the launcher name a stalled
  rank and its step, and find the ranks to forward a signal to.
- On Linux a rank asks the kernel for SIGKILL when its parent (torchrun) dies, so no rank outlives its job.
- `STOPPED` (rank 0, `RUN_DIR/stopped.json`) says why the run ended early: the launcher turns it into one line
  and an exit code.
"""

import ctypes
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

RANKS_DIR = ".ranks"
STOPPED = "stopped.json"
# EX_TEMPFAIL: stopped for the scheduler with the state saved; `dtensor-moe train --resume` continues.
PREEMPTED_RC = 75
INTERRUPTED_RC = 130
DIVERGED_RC = 3
SAVE_FAILED_RC = 74  # sysexits EX_IOERR
ROW_CAP_RC = 4  # moe_run.max_rows_per_rank exceeded
LAUNCHED = "DTENSOR_MOE_LAUNCHED"  # set for the ranks our launcher starts: it prints the summary and stops them
STOP_SIGNALS = {signal.SIGTERM: "SIGTERM", signal.SIGUSR1: "SIGUSR1", signal.SIGINT: "SIGINT"}
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> bool:
    """SIGKILL this process when its parent exits (Linux prctl); False where the platform has no such call."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def heartbeat_path(run_dir, rank: int) -> Path:
    return Path(run_dir) / RANKS_DIR / f"rank_{rank}.json"


def read_heartbeats(run_dir) -> dict[int, dict]:
    """rank -> {"pid", "step", "time"} for every rank that has beaten (a file mid-replace is skipped)."""
    beats = {}
    for path in (Path(run_dir) / RANKS_DIR).glob("rank_*.json"):
        try:
            beats[int(path.stem.split("_")[1])] = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
    return beats


class StopRequests:
    """The first stop signal a process gets (`requested`: its name), as a context: the previous handlers come back
    on exit (a process that trains more than once, a test's worker, keeps its own). Only the main thread may set
    handlers; elsewhere no signal is caught."""

    def __init__(self):
        self.requested = None

    def __enter__(self):
        main = threading.current_thread() is threading.main_thread()
        self._previous = {sig: signal.signal(sig, self._on_signal) for sig in STOP_SIGNALS} if main else {}
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _on_signal(self, signum, _frame):
        self.requested = self.requested or STOP_SIGNALS[signal.Signals(signum)]

    @property
    def flag(self) -> float:
        """This rank's vote in a per-step collective: 0 run on, 1 stop (a signal arrived)."""
        return 0.0 if self.requested is None else 1.0


class RankSupervision(StopRequests):
    """One rank of the main job: its stop signals and its heartbeat."""

    def __init__(self, run_dir, rank: int):
        super().__init__()
        self.rank = rank
        self.path = heartbeat_path(run_dir, rank)

    def __enter__(self):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        super().__enter__()
        die_with_parent()
        self.beat(None)
        return self

    def beat(self, step: int | None):
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"pid": os.getpid(), "step": step, "time": time.time()}))
        os.replace(tmp, self.path)


def write_stopped(run_dir, reason: str, step: int, **details):
    path = Path(run_dir) / STOPPED
    tmp = path.with_suffix(f".{os.getpid()}.tmp")  # the ranks of one EP group may all write it (a row cap)
    tmp.write_text(json.dumps({"reason": reason, "step": step, **details}))
    os.replace(tmp, path)


def read_stopped(run_dir) -> dict | None:
    try:
        return json.loads((Path(run_dir) / STOPPED).read_text())
    except (OSError, ValueError):
        return None


def describe_stop(stopped: dict) -> tuple[str, int]:
    """The one line and exit code for a run that `write_stopped` ended early (under our launcher or torchrun)."""
    if stopped["reason"] == "save failed":
        return (f"{stopped['what']} (a full or read-only disk?); the run stopped after step {stopped['step']}; last "
                f"good checkpoint: {stopped.get('last_checkpoint') or 'none'}", SAVE_FAILED_RC)
    if stopped["reason"] == "row cap":
        return (f"{stopped['what']}; the run stopped in step {stopped['step']}; last good checkpoint: "
                f"{stopped.get('last_checkpoint') or 'none'}", ROW_CAP_RC)
    if stopped["reason"] == "diverged":
        return (f"{stopped['what']} at step {stopped['step']}: stopped before the optimizer step; last good "
                f"checkpoint: {stopped.get('last_checkpoint') or 'none'}", DIVERGED_RC)
    return (f"stopped by {stopped['signal']} after step {stopped['step']}; checkpoint {stopped['checkpoint']}; "
            "continue with the same command and --resume",
            INTERRUPTED_RC if stopped["signal"] == "SIGINT" else PREEMPTED_RC)
