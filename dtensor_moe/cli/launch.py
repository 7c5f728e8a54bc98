"""The launcher owns its ranks: an exclusive run dir, signals forwarded, stalls caught, no orphans.

torchrun runs in a session of its own, so a terminal's Ctrl-C reaches only the launcher, which decides:
SIGTERM / SIGUSR1 / a first SIGINT go to every rank (they finish the step, save a checkpoint and stop;
train/supervision.py), a second SIGINT kills the job at once. torchrun dies with the launcher (Linux
parent-death signal) and each rank with torchrun, so killing the launcher, even with SIGKILL, ends the job.
A rank whose heartbeat is older than `parallel.timeout_s` stops the whole job, named with its step.
"""

import fcntl
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from dtensor_moe.train.supervision import (
    INTERRUPTED_RC,
    PREEMPTED_RC,
    RANKS_DIR,
    STOP_SIGNALS,
    STOPPED,
    describe_stop,
    die_with_parent,
    read_heartbeats,
    read_stopped,
)

LOCK = ".lock"
STALLED_RC = 124  # coreutils' timeout: the job was stopped for making no progress
STARTUP_S = 300  # importing torch and building the model on a loaded machine is no stall


class RunDirLock:
    """An exclusive lock on the run dir (flock: released by the kernel on any exit, so a dead holder leaves none)."""

    def __init__(self, run_dir: str):
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        self.path = Path(run_dir) / LOCK
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self.fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(self.fd)
            raise ValueError(f"run dir {run_dir!r} is in use by another `dtensor-moe train` (pid {holder}); wait for "
                             "it to end, stop it, or choose another --run-dir") from None
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, str(os.getpid()).encode(), 0)

    def release(self):
        os.close(self.fd)  # closing drops the flock; the file stays, harmless to the next run


def clear_run_state(run_dir: str):
    """A previous run's heartbeats and stop note would mislead this run's watchdog and exit line."""
    for path in (Path(run_dir) / RANKS_DIR).glob("rank_*"):
        path.unlink(missing_ok=True)
    (Path(run_dir) / STOPPED).unlink(missing_ok=True)


def _process_state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "?"


def _child_setup():
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    die_with_parent()


class Supervisor:
    """Runs `cmd` (torchrun) for `nproc` ranks writing heartbeats under `run_dir`; `run()` returns its exit code."""

    def __init__(self, cmd: list[str], env: dict, run_dir: str, nproc: int, timeout_s: float):
        self.cmd, self.env, self.run_dir, self.nproc, self.timeout_s = cmd, env, run_dir, nproc, timeout_s
        self.signals: list[str] = []
        self.stalled: str | None = None

    def _on_signal(self, signum, _frame):
        name = STOP_SIGNALS[signal.Signals(signum)]
        self.signals.append(name)
        if name == "SIGINT" and self.signals.count("SIGINT") > 1:
            print("dtensor-moe train: second SIGINT: stopping every rank now", file=sys.stderr, flush=True)
            self._kill()
            return
        ranks = read_heartbeats(self.run_dir)
        if len(ranks) < self.nproc:  # still starting: nothing trained yet that a checkpoint could keep
            self._kill()
            return
        print(f"dtensor-moe train: {name}: every rank finishes its step, saves a checkpoint and stops "
              "(SIGINT again: stop at once)", file=sys.stderr, flush=True)
        for beat in ranks.values():
            try:
                os.kill(beat["pid"], signum)
            except ProcessLookupError:
                pass

    def _kill(self):
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def _check_stall(self, started: float):
        now = time.time()
        ranks = read_heartbeats(self.run_dir)
        missing = sorted(set(range(self.nproc)) - set(ranks))
        if missing and now - started > max(self.timeout_s, STARTUP_S):
            self.stalled = f"ranks {missing} did not start within {max(self.timeout_s, STARTUP_S):g} s; stopped the job"
        # Before its first step a rank builds and compiles: the start-up allowance, not timeout_s, applies.
        stale = {r: b for r, b in ranks.items()
                 if now - b["time"] > (self.timeout_s if b["step"] is not None else max(self.timeout_s, STARTUP_S))}
        if stale and not missing:
            states = {r: {"T": "stopped (SIGSTOP?)", "D": "in uninterruptible I/O"}.get(_process_state(b["pid"]), "")
                      for r, b in stale.items()}
            # The rank to name: one the kernel shows stuck, else the one furthest behind, else the longest silent
            # (its peers wait for it in a collective, silent as well but often a step further).
            r, beat = min(stale.items(), key=lambda kv: (not states[kv[0]], kv[1]["step"] is not None,
                                                         kv[1]["step"] or 0, kv[1]["time"]))
            state = states[r]
            where = "before its first step" if beat["step"] is None else f"after step {beat['step']}"
            self.stalled = (f"rank {r} (pid {beat['pid']}{', ' + state if state else ''}) made no progress for "
                            f"{now - beat['time']:.0f} s {where} (parallel.timeout_s = {self.timeout_s:g}); "
                            "stopped the job")
        if self.stalled:
            self._kill()

    def run(self) -> int:
        previous = {sig: signal.signal(sig, self._on_signal) for sig in STOP_SIGNALS}
        try:
            # A signal landing between the fork and Popen's return would find no self.proc to stop: held until then
            # (the child, which inherits the mask, takes the signals again before it runs torchrun).
            signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
            try:
                self.proc = subprocess.Popen(self.cmd, env=self.env, start_new_session=True, preexec_fn=_child_setup)
            finally:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
            started = time.time()
            while self.proc.poll() is None:
                time.sleep(0.2)
                if not self.stalled:
                    self._check_stall(started)
                stopped = read_stopped(self.run_dir)
                if stopped and stopped["reason"] == "row cap":
                    # Its EP group stopped in a forward, the other ranks wait in a collective for it: all stop now.
                    self._kill()
            rc = self.proc.returncode
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return self._outcome(rc)

    def _outcome(self, rc: int) -> int:
        """One line for a run that ended early, and its exit code; torchrun's own for the rest."""
        if self.stalled:
            print(f"dtensor-moe train: {self.stalled}", file=sys.stderr)
            return STALLED_RC
        stopped = read_stopped(self.run_dir)
        if stopped:
            line, code = describe_stop(stopped)
            print(f"dtensor-moe train: {line}", file=sys.stderr)
            return code
        if self.signals:
            print(f"dtensor-moe train: stopped by {self.signals[0]} before a step could be saved", file=sys.stderr)
            return INTERRUPTED_RC if self.signals[0] == "SIGINT" else PREEMPTED_RC
        return rc
