"""What every family of the new-user tour shares: its results, its tiny job, and running the CLI as a user would
(a subprocess in a session of its own, so a hang is detected and the whole job killed)."""

import hashlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VALID = re.compile(
    r"must be|must equal|valid|one of|expects|expected| in \[|needs|pass --|not found|is a file|is a directory|"
    r"nothing left|already"
)
TIMEOUT_S = 240.0
TINY_TOML = """\
# The tour's own tiny job: 2 CPU ranks, EP2, 4 steps.
[model]
dim = 16
n_layers = 1
n_heads = 2
num_experts = 4
top_k = 2
hidden_dim = 8
max_seq_len = 16

[parallel]
nproc = 2
ep = 2

[training]
steps = 4
seq_len = 8
global_batch = 4
warmup_steps = 1

[data]
source = "synthetic"
"""


@dataclass
class Result:
    area: str
    tried: str
    outcome: str = ""  # "rc 2", "ValueError", "accepted", "timeout"
    message: str = ""  # first line of the message (stderr's, or the exception's)
    seconds: float = 0.0
    verdict: str = ""
    why: str = ""  # which check decided a verdict other than clear
    order: int = 0


@dataclass
class Tour:
    scratch: Path
    results: list = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    pristine: Path | None = None  # the tiny job's checkpoint root (None until made, or if making it failed)
    setup_s: float = 0.0

    def add(self, r: Result) -> Result:
        with self.lock:
            r.order = len(self.results)
            self.results.append(r)
        print(f"  [{r.verdict:>9}] {r.seconds:6.1f}s {r.area}: {r.tried}", file=sys.stderr, flush=True)
        return r


def names_missing(message: str, fields, valid: bool) -> str:
    """'' if the message names every field (and valid values when asked), else what is missing."""
    missing = [f for f in fields if f not in message]
    if missing:
        return f"message lacks {missing}"
    if valid and not VALID.search(message):
        return "message gives no valid values"
    return ""


def snapshot(*roots) -> dict:
    """sha256 of every file under the roots (a guarded tree must come out byte-identical)."""
    out = {}
    for root in roots:
        root = Path(root)
        files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file()) if root.exists() else []
        for p in files:
            out[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def lost(before: dict, after: dict) -> str:
    changed = [Path(p).name for p in before if after.get(p) != before[p]]
    return f"changed or deleted: {changed[:4]}" if changed else ""


# --- the CLI: subprocesses ---------------------------------------------------------------------


def env() -> dict:
    return {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}


def start(cmd, cwd, extra_env=None) -> subprocess.Popen:
    """`cmd` in a session of its own (so a hang's whole process group can be killed), its output captured."""
    return subprocess.Popen(cmd, cwd=cwd, env={**env(), **(extra_env or {})}, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)


def finish(p: subprocess.Popen, timeout=TIMEOUT_S) -> tuple[int | None, str, str]:
    """(rc or None on timeout, stderr, stdout) of a `start`ed job; a timed-out job's process group is killed."""
    try:
        out, err = p.communicate(timeout=timeout)
        return p.returncode, err, out
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)  # the session this call started: the launcher and its ranks
        out, err = p.communicate()
        return None, err, out


def run_cli(argv, cwd, timeout=TIMEOUT_S):
    """(rc or None on timeout, stderr, stdout, seconds); a timed-out job's process group is killed."""
    t0 = time.perf_counter()
    rc, err, out = finish(start([sys.executable, "-m", "dtensor_moe.cli", *argv], cwd), timeout)
    return rc, err, out, time.perf_counter() - t0


def message_lines(stderr: str) -> list[str]:
    """stderr's non-empty lines without argparse's usage block (which precedes its one `error:` line)."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    if lines and lines[0].startswith("usage:"):
        lines = lines[next((i for i, ln in enumerate(lines) if ": error: " in ln), 0):]
    return lines


def cli(tour: Tour, area: str, tried: str, argv, fields, *, valid: bool = True, guard=(), run_dir=None,
        expect_rc: int = 2, accepted_check=None, absent=()) -> Result:
    """`dtensor-moe ARGV` must exit `expect_rc` (2: refused) with one stderr line naming `fields`, before any
    rank starts (`run_dir` is not created, or is unchanged) and with every file under `guard` intact.
    With expect_rc 0 (accepted on purpose) the stderr note must name the fields and accepted_check(stdout)
    return '' (the result is right). `absent`: strings the message must not contain."""
    guard = [*guard, *([run_dir] if run_dir else [])]
    before = snapshot(*guard)
    existed = run_dir is not None and Path(run_dir).exists()
    rc, err, out, dt = run_cli(argv, tour.scratch)
    lines = message_lines(err)
    r = Result(area, tried, outcome="timeout" if rc is None else f"rc {rc}", message=lines[0] if lines else "",
               seconds=dt)
    first_line = " / ".join(lines)
    if rc is None:
        r.verdict, r.why = "hang", f"> {TIMEOUT_S:.0f} s"
    elif changed := lost(before, snapshot(*guard)):
        r.verdict, r.why = "data loss", changed
    elif rc != expect_rc:
        r.verdict = "silent" if rc == 0 else "unclear"
        r.why = f"rc {rc}, want {expect_rc}"
    elif "Traceback" in err:
        r.verdict, r.why = "unclear", "traceback on stderr"
    elif expect_rc != 0 and len(lines) != 1:
        r.verdict, r.why = "unclear", f"{len(lines)} stderr lines"
    elif why := names_missing(first_line, fields, valid) or next(
        (f"message has {a!r}" for a in absent if a in first_line), ""
    ):
        r.verdict, r.why = "unclear", why
    elif run_dir is not None and not existed and Path(run_dir).exists():
        r.verdict, r.why = "unclear", "a run dir was created: ranks started"
    elif accepted_check is not None and (why := accepted_check(out)):
        r.verdict, r.why = "silent", why
    else:
        r.verdict = "clear"
    return tour.add(r)


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                kids = [int(k) for k in (task / "children").read_text().split()]
            except OSError:
                kids = []
            out += kids
            todo += kids
    return out


def rank_pid(launcher: int, rank: int) -> int | None:
    for p in descendants(launcher):
        try:
            env = Path(f"/proc/{p}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env and b"LOCAL_RANK=" + str(rank).encode() in env:
            return p
    return None
