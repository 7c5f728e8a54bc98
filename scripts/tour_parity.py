"""The tour's parity and explain family (issue 40, class 2 and explain at any world size).

`train --parity` on settings whose one-process reference is not simply the run on one rank: expert replicas and
the row cap (the reference goes without them: it crashed with "ep in []"), a capacity factor and token rounding
(applied per rank's tokens of a forward, which the reference must do too: a correct run read FAIL), alone and on
TP and pipeline meshes, with routing replay. Each must exit 0 with the summary's parity line reading "pass"; under
an outside torchrun --parity is refused in one line. `explain` at worlds of a billion ranks: bounded output in
seconds, the ranks asked for with --ranks, and its refusals (a rank outside the stage, --png past its bound, a
folding that does not divide the world) in one line, in seconds.

Each case writes down its expectation (`want`): rc 0 with its result checked, or rc 2 with one stderr line naming
the fields and the valid values; explain's cases also a time bound (EXPLAIN_S)."""

import re
import sys

from tour_base import Result, Tour, cli, message_lines, names_missing, run_cli
from tour_settings import _run

AREA = "parity"
EXPLAIN_S = 10.0  # explain answers within this (0.1 s at any world on the 2-core machine); 3x that is a hang
BIG = "1000000000"


def _tiny(tour: Tour, run: str, *overrides: str) -> list[str]:
    return ["train", "--config", str(tour.scratch / "tiny.toml"), "--run-dir", str(tour.scratch / run), "--parity",
            *overrides]


def _passed(stdout: str) -> str:
    """'' if the summary's parity line compares every step and reads pass."""
    line = next((ln for ln in stdout.splitlines() if ln.startswith("parity")), None)
    if line is None:
        return "no parity line in the summary"
    m = re.search(r"max \|dloss\| vs 1 process over (\d+) steps = (\S+) \(tolerance (\S+)\): (pass|FAIL)$", line)
    if not m:
        return f"parity line not a comparison: {line[:100]!r}"
    return "" if m.group(4) == "pass" and m.group(1) == "4" else f"{line[9:]}"


# (tried, run dir, overrides): the tiny job is 2 CPU ranks EP2, global batch 4 of 8 tokens: 16 tokens per rank and
# forward (8 on TP2, 8 per microbatch under PP2).
TRAIN = [
    ("moe_run.expert_replicas=1 and the row cap moe_run.max_rows_per_rank=64 (EP2): the reference goes without both",
     "pa_replicas", ["moe_run.expert_replicas=1", "moe_run.max_rows_per_rank=64"]),
    ("moe_run.capacity_factor=1.0 (EP2): each rank drops among its own 16 tokens' pairs", "pa_capacity",
     ["moe_run.capacity_factor=1.0"]),
    ("moe_run.round_tokens_to=4 (EP2): each rank rounds its own pairs", "pa_rounding", ["moe_run.round_tokens_to=4"]),
    ("4 ranks TP2 x EP2, capacity_factor 1.25 + round_tokens_to 2 + sequence-wise aux loss: each rank's slice of "
     "each sequence", "pa_tp", ["parallel.nproc=4", "parallel.tp=2", "moe_run.capacity_factor=1.25",
                                "moe_run.round_tokens_to=2", "model.seq_aux_loss_coeff=0.01"]),
    ("4 ranks PP2 x EP2, 2 microbatches, capacity_factor 1.0, aux-free bias, routing replay", "pa_pp",
     ["parallel.nproc=4", "parallel.pp=2", "parallel.microbatches=2", "model.n_layers=2",
      "moe_run.capacity_factor=1.0", "model.load_balance=aux_free_bias", "training.routing_replay=true"]),
]


def train_case(tour: Tour, tried: str, run: str, overrides: list[str]) -> Result:
    """Want: rc 0, the summary's parity line 'pass' over the 4 steps (a correct run)."""
    return cli(tour, AREA, f"train --parity, {tried}", _tiny(tour, run, *overrides), [], valid=False, expect_rc=0,
               accepted_check=_passed)


def under_torchrun_case(tour: Tour) -> Result:
    """Want: rc 2, one line naming --parity and the local launcher (the reference needs the launcher's process)."""
    rc, err, _, dt = _run([sys.executable, "-m", "dtensor_moe.cli", *_tiny(tour, "pa_torchrun")], tour.scratch,
                          {"LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"})
    lines = message_lines(err)
    r = Result(AREA, "train --parity under an outside torchrun (RANK 0 of 2)", outcome="timeout" if rc is None else
               f"rc {rc}", message=lines[0] if lines else "", seconds=dt)
    _judge(r, rc, err, lines, 2, ["--parity", "torchrun"])
    return tour.add(r)


def _judge(r: Result, rc, err: str, lines: list[str], want: int, fields, check=None, within: float | None = None):
    if rc is None:
        r.verdict, r.why = "hang", "timeout"
    elif rc != want:
        r.verdict, r.why = ("silent" if rc == 0 else "unclear"), f"rc {rc}, want {want}"
    elif "Traceback" in err:
        r.verdict, r.why = "unclear", "traceback on stderr"
    elif want != 0 and len(lines) != 1:
        r.verdict, r.why = "unclear", f"{len(lines)} stderr lines"
    elif want != 0 and (why := names_missing(lines[0], fields, True)):
        r.verdict, r.why = "unclear", why
    elif check is not None and (why := check()):
        r.verdict, r.why = "silent", why
    elif within is not None and r.seconds > within:
        r.verdict, r.why = "unclear", f"{r.seconds:.1f} s, want < {within:.0f} s"
    else:
        r.verdict = "clear"


def explain_case(tour: Tour, tried: str, args: list[str], want: int, fields=(), check=None) -> Result:
    """Want: rc `want` within EXPLAIN_S (a hang past 3x); rc 0: check(stdout) == ''; rc 2: one line naming
    `fields` and the valid values."""
    rc, err, out, dt = run_cli(["explain", *args], tour.scratch, timeout=3 * EXPLAIN_S)
    lines = message_lines(err)
    r = Result(AREA, f"explain {tried}", outcome="timeout" if rc is None else f"rc {rc}",
               message=lines[0] if lines else "", seconds=dt)
    _judge(r, rc, err, lines, want, fields, None if check is None else (lambda: check(out)), EXPLAIN_S)
    if want == 2 and rc == 2 and out:
        r.verdict, r.why = "unclear", "refused after printing"
    return tour.add(r)


def _rows(out: str) -> list[int]:
    return [int(ln.split()[0]) for ln in out.splitlines() if re.match(r"^\s*\d+ \|", ln)]


def _bounded(out: str, ranks: list[int], max_lines: int = 200) -> str:
    n = len(out.splitlines())
    if n > max_lines:
        return f"{n} lines, want <= {max_lines}"
    return "" if _rows(out) == ranks else f"rank rows {_rows(out)[:12]}, want {ranks}"


def explain_cases(tour: Tour) -> list[Result]:
    mesh = ["--ep", "2", "--etp", "2", "--tp", "2", "--pp", "2", "--num-experts", "4", "--shared-experts", "1"]
    stage = int(BIG) // 2
    return [
        explain_case(tour, f"--world {BIG} (PP2, TP2, EP2 x ETP2): the first ranks and the last, in seconds",
                     ["--world", BIG, *mesh], 0, check=lambda o: _bounded(o, [*range(8), stage - 1])),
        explain_case(tour, f"--world {BIG} --ranks 123456789,{stage - 1}: those ranks' rows and slices",
                     ["--world", BIG, *mesh, "--ranks", f"123456789,{stage - 1}"], 0,
                     check=lambda o: _bounded(o, [123456789, stage - 1])),
        explain_case(tour, "--world 256: every rank listed, as before", ["--world", "256", "--ep", "2", "--num-experts",
                                                                        "4"], 0,
                     check=lambda o: _bounded(o, list(range(256)), 2000)),
        explain_case(tour, "--world 514 --pp 2 (stages of 257 ranks: past the full listing): the first 8 and the last",
                     ["--world", "514", "--pp", "2", "--num-experts", "4"], 0,
                     check=lambda o: _bounded(o, [*range(8), 256])),
        explain_case(tour, f"--world {BIG} --ranks {stage} (a rank of the next stage: ranks are stage-local)",
                     ["--world", BIG, *mesh, "--ranks", str(stage)], 2, ["--ranks", str(stage), f"0..{stage - 1}"]),
        explain_case(tour, "--world 4096 --ranks 0-300 (more ranks than the text lists)",
                     ["--world", "4096", "--num-experts", "4", "--ranks", "0-300"], 2, ["--ranks", "0-300", "256"]),
        explain_case(tour, "--world 8 --ranks 2-x (not a range)",
                     ["--world", "8", "--num-experts", "4", "--ranks", "2-x"], 2, ["--ranks", "2-x", "0..7"]),
        explain_case(tour, "--world 1000000 --png grid.png (a cell per rank)",
                     ["--world", "1000000", "--num-experts", "4", "--png", str(tour.scratch / "pa_grid.png")], 2,
                     ["--png", "4096", "1000000"]),
        explain_case(tour, f"--world {BIG} --ep 3 (does not divide the world)",
                     ["--world", BIG, "--ep", "3", "--num-experts", "3"], 2, ["ep"]),
        explain_case(tour, f"--world {BIG} --pp 7 (does not divide the world)",
                     ["--world", BIG, "--pp", "7", "--num-experts", "4"], 2, ["pp", "7"]),
    ]


def parity_cases(tour: Tour) -> list:
    """Every parity and explain case, as (fn, args) for the tour's threads."""
    return [*[(train_case, tour, *case) for case in TRAIN], (under_torchrun_case, tour), (explain_cases, tour)]
