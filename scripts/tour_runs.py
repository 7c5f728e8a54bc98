"""The tour's run families: a real `dtensor-moe train` (the tour's tiny 2-rank job) under the events a scheduler
brings. Signals (SIGTERM / SIGUSR1 preempt, SIGINT once and twice, SIGKILL of the launcher, a signal before the
first step), a stalled rank, a second run into a busy run dir, a full or read-only disk, a diverging run, the
environment (CUDA asked for, none present), and many plain launches in a row (each must end with rc 0).

Each case is judged by what a scheduler sees: the exit code, the one stderr line, how long the job took to end
after the event, whether any process of the job is left, and whether the newest checkpoint is intact.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tour_base import TIMEOUT_S, Result, Tour, descendants, env, message_lines

PREEMPTED_RC, INTERRUPTED_RC, STALLED_RC, DIVERGED_RC = 75, 130, 124, 3
ENDS_WITHIN_S = 60  # after a signal, the job (every process of it) is gone within this
STALL_TIMEOUT_S = 60  # parallel.timeout_s of the stall case; it must end within 150 s of the stall


class Job:
    """`dtensor-moe train` on the tour's tiny config, in a session of its own."""

    def __init__(self, tour: Tour, run_dir: Path, *extra: str):
        self.run_dir = run_dir
        argv = ["train", "--config", str(tour.scratch / "tiny.toml"), "--run-dir", str(run_dir), *extra]
        self.proc = subprocess.Popen([sys.executable, "-m", "dtensor_moe.cli", *argv], cwd=tour.scratch, env=env(),
                                     text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        self.pids: set[int] = set()
        self.err = ""

    def wait_for_step(self, step: int, timeout: float = TIMEOUT_S) -> bool:
        """Until every rank has finished `step` (its heartbeat says so); remembers the job's processes."""
        from dtensor_moe.train.supervision import read_heartbeats

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            self.pids |= set(descendants(self.proc.pid))
            beats = read_heartbeats(self.run_dir)
            if len(beats) == 2 and all((b["step"] or 0) >= step for b in beats.values()):
                self.pids |= {b["pid"] for b in beats.values()}
                return True
            time.sleep(0.05)
        return False

    def end(self, timeout: float) -> int | None:
        """The exit code, or None (and the whole session killed) if the job is still running after `timeout`."""
        try:
            _, self.err = self.proc.communicate(timeout=timeout)
            return self.proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            _, self.err = self.proc.communicate()
            return None

    def left(self, timeout: float = 10) -> list[int]:
        """The job's processes still alive `timeout` s from now at the latest (zombies count as gone)."""
        deadline = time.monotonic() + timeout
        while True:
            alive = [p for p in self.pids | {self.proc.pid} if _alive(p)]
            if not alive or time.monotonic() > deadline:
                return alive
            time.sleep(0.2)

    def lines(self) -> list[str]:
        """The job's own lines on stderr (the progress bar ends its lines with carriage returns)."""
        return [ln for ln in message_lines(self.err.replace("\r", "\n")) if ln.startswith("dtensor-moe")]

    def line(self) -> str:
        return (self.lines() or [""])[-1]


def _last_words(job: Job) -> str:
    """Why a job that should be running is not: its line, or the end of its stderr."""
    job.end(1)
    tail = [ln for ln in job.err.splitlines() if ln.strip() and not ln.startswith("train:")][-2:]
    return job.line() or " / ".join(tail)[-300:]


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _judge(tour: Tour, area: str, tried: str, fn) -> Result:
    """fn(result) fills outcome/message and returns '' when every check held, else (verdict, why)."""
    r, t0 = Result(area, tried), time.perf_counter()
    try:
        bad = fn(r)
    except Exception as e:  # noqa: BLE001 - a bug in the case itself must not stop the tour
        bad = ("unclear", f"the case raised {type(e).__name__}: {e}")
    r.verdict, r.why = ("clear", r.why) if not bad else bad
    r.seconds = time.perf_counter() - t0
    return tour.add(r)


def _ended(job: Job, rc, want_rc: int, since: float, within: float, words: str):
    """The common verdict of a stopped job: rc, time to end, the line, no process left."""
    took = time.monotonic() - since
    if rc is None:
        return "hang", f"still running {within:.0f} s after the event"
    if rc == 0:
        return "silent", "rc 0"
    if rc != want_rc:
        return "unclear", f"rc {rc}, want {want_rc}"
    if took > within:
        return "hang", f"ended {took:.0f} s after the event (> {within:.0f} s)"
    if words not in job.err:
        return "unclear", f"stderr lacks {words!r}"
    if "Traceback" in job.err:
        return "unclear", "traceback on stderr"
    if left := job.left():
        return "hang", f"processes left: {left}"
    return None


def signal_case(tour: Tour, sig: signal.Signals, want_rc: int, twice: bool = False) -> Result:
    """A signal to the launcher mid-run: the step is saved (a verified checkpoint), the job ends with `want_rc`,
    nothing is left, and `--resume` continues from the saved step with no step lost or repeated."""
    from dtensor_moe.train.checkpoint import pick

    name = f"{sig.name}{' twice' if twice else ''} to the launcher mid-run"

    def run(r: Result):
        run_dir = tour.scratch / f"sig_{sig.name}{'_twice' if twice else ''}"
        job = Job(tour, run_dir, "training.steps=100000")
        if not job.wait_for_step(2):
            return "unclear", f"never reached step 2: {_last_words(job)}"
        t0 = time.monotonic()
        job.proc.send_signal(sig)
        if twice:
            time.sleep(0.5)  # two signals sent at once are delivered as one
            job.proc.send_signal(sig)
        rc = job.end(ENDS_WITHIN_S * 2)
        r.outcome, r.message = f"rc {rc}", job.line()
        words = "second SIGINT" if twice else f"stopped by {sig.name} after step"
        took = time.monotonic() - t0
        if bad := _ended(job, rc, want_rc, t0, ENDS_WITHIN_S, words):
            return bad
        if twice:
            r.why = f"ended {took:.1f} s after the first signal, no process left"
            return None
        stopped = json.loads((run_dir / "stopped.json").read_text())
        saved = pick(stopped["checkpoint"])  # every file checked against its manifest
        resumed = Job(tour, run_dir, f"training.steps={stopped['step'] + 2}", "--resume")
        if (rc := resumed.end(TIMEOUT_S)) != 0:
            return "unclear", f"--resume rc {rc}: {resumed.line()}"
        steps = [json.loads(ln)["step"] for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
        if steps != list(range(1, stopped["step"] + 3)):
            return "data loss", f"steps after resume {steps[-5:]}, want 1..{stopped['step'] + 2}"
        r.why = f"saved {saved.name} (verified), ended {took:.1f} s after the signal, resumed to step {steps[-1]}"
        return None

    return _judge(tour, "run: signals", name, run)


def startup_signal_case(tour: Tour) -> Result:
    """SIGTERM once torchrun runs but before any step: nothing to save, the job ends at once with rc 75."""
    def run(r: Result):
        job = Job(tour, tour.scratch / "sig_startup", "training.steps=100000")
        deadline = time.monotonic() + TIMEOUT_S
        while not descendants(job.proc.pid) and time.monotonic() < deadline and job.proc.poll() is None:
            time.sleep(0.05)
        job.pids |= set(descendants(job.proc.pid))
        t0 = time.monotonic()
        job.proc.send_signal(signal.SIGTERM)
        rc = job.end(ENDS_WITHIN_S * 2)
        r.outcome, r.message = f"rc {rc}", job.line()
        return _ended(job, rc, PREEMPTED_RC, t0, ENDS_WITHIN_S, "stopped by SIGTERM")

    return _judge(tour, "run: signals", "SIGTERM to the launcher while the ranks start", run)


def killed_launcher_case(tour: Tour) -> Result:
    """SIGKILL of the launcher (no handler can run): no rank may outlive it."""
    def run(r: Result):
        job = Job(tour, tour.scratch / "sig_kill", "training.steps=100000")
        if not job.wait_for_step(1):
            return "unclear", f"never reached step 1: {_last_words(job)}"
        job.proc.kill()
        job.end(10)
        r.outcome = "killed"
        if left := job.left(ENDS_WITHIN_S):
            return "hang", f"processes left {ENDS_WITHIN_S} s after the kill: {left}"
        r.why = "no process left"
        return None

    return _judge(tour, "run: signals", "SIGKILL to the launcher mid-run", run)


def stall_case(tour: Tour) -> Result:
    """Rank 1 frozen (SIGSTOP) with parallel.timeout_s = 60: the job ends non-zero within 150 s naming the rank."""
    def run(r: Result):
        from dtensor_moe.train.supervision import read_heartbeats

        job = Job(tour, tour.scratch / "stall", "training.steps=100000", f"parallel.timeout_s={STALL_TIMEOUT_S}")
        if not job.wait_for_step(1):
            return "unclear", f"never reached step 1: {_last_words(job)}"
        victim = read_heartbeats(job.run_dir)[1]["pid"]
        t0 = time.monotonic()
        os.kill(victim, signal.SIGSTOP)
        rc = job.end(150)
        r.outcome, r.message = f"rc {rc}", job.line()
        return _ended(job, rc, STALLED_RC, t0, 150, f"rank 1 (pid {victim}")

    return _judge(tour, "run: stall", f"SIGSTOP of rank 1, parallel.timeout_s={STALL_TIMEOUT_S}", run)


def busy_run_dir_case(tour: Tour) -> Result:
    """A second run into a run dir in use: refused in < 30 s with the holder's pid; the first run unaffected."""
    def run(r: Result):
        first = Job(tour, tour.scratch / "busy", "training.steps=200")
        if not first.wait_for_step(1):
            return "unclear", f"the first run never reached step 1: {_last_words(first)}"
        t0 = time.monotonic()
        second = Job(tour, first.run_dir, "training.steps=3")
        rc = second.end(TIMEOUT_S)
        took = time.monotonic() - t0
        r.outcome, r.message = f"rc {rc}", second.line()
        if rc != 2 or f"pid {first.proc.pid}" not in second.err:
            return "silent" if rc == 0 else "unclear", f"second run rc {rc}: {second.line()}"
        if took > 30:
            return "hang", f"refused after {took:.0f} s"
        if (rc := first.end(TIMEOUT_S)) != 0:
            return "data loss", f"the first run ended rc {rc}: {first.line()}"
        r.why = f"refused in {took:.1f} s; the first run finished its 200 steps"
        return None

    return _judge(tour, "run: concurrency", "a second run into a busy run dir", run)


def _mount_tmpfs(path: Path, size: str, readonly: bool = False) -> str:
    """'' once mounted, else why not (the tour runs as root on Linux where it can)."""
    path.mkdir(parents=True, exist_ok=True)
    opts = f"size={size}" + (",ro" if readonly else "")
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True, text=True)
    return "" if p.returncode == 0 else f"cannot mount a tmpfs here: {p.stderr.strip()}"


def disk_cases(tour: Tour) -> list[Result]:
    """A read-only run dir, one too small for a checkpoint (refused before launch), and a disk that fills up
    between two saves (the run ends naming it; the last complete checkpoint stays intact, no temp dir left)."""
    from dtensor_moe.train.checkpoint import pick

    out = []
    for tried, size, ro, words in [("read-only run dir (a read-only mount)", "1M", True, "Read-only file system"),
                                   ("run dir on a 64 KiB disk (less than a checkpoint)", "64k", False, "MiB free")]:
        def refused(r: Result, size=size, ro=ro, words=words):
            mnt = tour.scratch / f"mnt_{size}_{ro}"
            if why := _mount_tmpfs(mnt, size, ro):
                return "unclear", why
            try:
                job = Job(tour, mnt / "run", "training.steps=4")
                rc = job.end(TIMEOUT_S)
                r.outcome, r.message = f"rc {rc}", job.line()
                lines = message_lines(job.err)
                if rc != 2:
                    return ("silent" if rc == 0 else "unclear"), f"rc {rc}"
                if len(lines) != 1 or words not in lines[0] or "--run-dir" not in lines[0]:
                    return "unclear", f"{len(lines)} stderr lines: {lines[:2]}"
                return None
            finally:
                subprocess.run(["umount", "-l", str(mnt)], capture_output=True)

        out.append(_judge(tour, "run: disk", tried, refused))

    def fills(r: Result):
        mnt = tour.scratch / "mnt_fills"
        if why := _mount_tmpfs(mnt, "3M"):
            return "unclear", why
        try:
            job = Job(tour, mnt / "run", "training.steps=400", "--checkpoint-every", "1", "--keep-last", "1000")
            rc = job.end(TIMEOUT_S)
            r.outcome, r.message = f"rc {rc}", job.line()
            ckpts = mnt / "run" / "checkpoints"
            temps = [p.name for p in ckpts.glob(".tmp-*")] if ckpts.is_dir() else []
            if rc is None:
                return "hang", "still running"
            if rc == 0:
                return "silent", "rc 0 on a full disk"
            if "No space left" not in job.err and "disk" not in job.line():
                return "unclear", f"stderr does not say the disk is full: {job.line() or job.err[-200:]}"
            if "Traceback" in job.err or len(job.lines()) != 1:
                return "unclear", f"a traceback or {len(job.lines())} lines on stderr"
            if temps:
                return "data loss", f"temporary checkpoint dirs left: {temps}"
            good = pick(ckpts)
            r.why = f"newest intact {good.name} verified; no temporary dir left"
            return None
        finally:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)

    out.append(_judge(tour, "run: disk", "the disk fills up between two checkpoints", fills))
    return out


def diverged_case(tour: Tour) -> Result:
    """training.lr=1e6: the run stops before the update that would write NaN, naming the step (rc 3)."""
    def run(r: Result):
        job = Job(tour, tour.scratch / "diverged", "training.lr=1e6", "training.steps=50")
        rc = job.end(TIMEOUT_S)
        r.outcome, r.message = f"rc {rc}", job.line()
        if rc != DIVERGED_RC:
            return ("silent" if rc == 0 else "unclear"), f"rc {rc}, want {DIVERGED_RC}"
        if "step" not in job.line() or "Traceback" in job.err:
            return "unclear", "the line does not name the step, or a traceback"
        return None

    return _judge(tour, "run: numerics", "training.lr=1e6 (diverges)", run)


def cuda_case(tour: Tour) -> Result:
    """parallel.device=cuda on a machine without CUDA: one line before any rank starts."""
    def run(r: Result):
        import torch

        if torch.cuda.is_available():
            return "unclear", "this machine has CUDA: the case cannot run here"
        job = Job(tour, tour.scratch / "cuda", "parallel.device=cuda")
        rc = job.end(TIMEOUT_S)
        lines = message_lines(job.err)
        r.outcome, r.message = f"rc {rc}", lines[0] if lines else ""
        if rc != 2 or len(lines) != 1 or "parallel.device" not in lines[0] or "valid" not in lines[0]:
            return ("silent" if rc == 0 else "unclear"), f"rc {rc}, {len(lines)} lines"
        if (tour.scratch / "cuda" / "metrics.jsonl").exists():
            return "unclear", "ranks started"
        return None

    return _judge(tour, "run: environment", "parallel.device=cuda without CUDA", run)


def launches_case(tour: Tour, n: int) -> Result:
    """`n` tiny runs one after another: every one ends with rc 0 and its summary (none crashes at exit)."""
    def run(r: Result):
        bad = []
        for i in range(n):
            job = Job(tour, tour.scratch / "launches" / f"run_{i}")
            rc = job.end(TIMEOUT_S)
            if rc != 0 or not (job.run_dir / "summary.json").is_file():
                bad.append(f"run {i}: rc {rc} {job.err.strip().splitlines()[-1:] if job.err.strip() else ''}")
        r.outcome = f"{n - len(bad)} of {n} rc 0"
        if bad:
            return "unclear", "; ".join(bad[:3])
        return None

    return _judge(tour, "run: launches", f"{n} tiny launches in a row", run)


def run_cases(tour: Tour, launches: int) -> list:
    """Every run family, as (fn, args) for the tour's long-run threads (each case starts ranks)."""
    return [
        (signal_case, tour, signal.SIGTERM, PREEMPTED_RC),
        (signal_case, tour, signal.SIGUSR1, PREEMPTED_RC),
        (signal_case, tour, signal.SIGINT, INTERRUPTED_RC),
        (signal_case, tour, signal.SIGINT, INTERRUPTED_RC, True),
        (startup_signal_case, tour),
        (killed_launcher_case, tour),
        (stall_case, tour),
        (busy_run_dir_case, tour),
        (disk_cases, tour),
        (diverged_case, tour),
        (cuda_case, tour),
        *([(launches_case, tour, launches)] if launches else []),
    ]
