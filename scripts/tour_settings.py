"""The tour's settings family (issue 40, classes 1, 6 and 8): settings accepted and then ignored or degenerate
(a row cap on a mesh without EP, a rounding multiple no expert can reach, more replica slots than experts, `plan`
of an `hf_path` config, `place_replicas`' and `record_routing`'s bad arguments), disagreements one rank finds
(a replay recording that differs on one rank, the torchtitan hook's row cap), and flows that must connect
(replicas turned on at --resume, `plan --replicas` on one GPU).

Each case writes down its expectation: `want` rc 2 (refused before any rank starts, one stderr line naming the
fields and the valid values), rc 0 (accepted on purpose, its result checked), or for the two multi-rank cases
what every rank must say. The hook's cases run torchtitan's entry point as its docs do (`python -m
dtensor_moe.titan.cpu_train ...`; under torchrun for the row cap)."""

import json
import math
import sys
import time
from pathlib import Path

from tour_base import TIMEOUT_S, Result, Tour, cli, finish, message_lines, names_missing, run_cli, start

AREA = "settings"
HOOK = ["--module", "dtensor_moe.titan", "--config", "deepseek_v3_debugmodel_cpu"]


def _run(cmd, cwd, extra_env=None, timeout=TIMEOUT_S):
    """(rc or None on timeout, stderr, stdout, seconds) of `cmd` in a session of its own."""
    t0 = time.perf_counter()
    rc, err, out = finish(start(cmd, cwd, extra_env), timeout)
    return rc, err, out, time.perf_counter() - t0


def hook_refused(tour: Tour, tried: str, argv, fields, world: int = 1) -> Result:
    """Want: the hook's config refuses while parsing: rc 2, one `dtensor_moe.titan:` line naming `fields`."""
    rc, err, _, dt = _run([sys.executable, "-m", "dtensor_moe.titan.cpu_train", *HOOK, "--dump_folder",
                           str(tour.scratch / "hook_unused"), *argv], tour.scratch,
                          {"WORLD_SIZE": str(world), "RANK": "0"})
    ours = [ln for ln in err.splitlines() if ln.startswith("dtensor_moe.titan:")]
    r = Result(AREA, f"hook: {tried}", outcome="timeout" if rc is None else f"rc {rc}",
               message=(ours or message_lines(err) or [""])[0], seconds=dt)
    if rc is None:
        r.verdict, r.why = "hang", f"> {TIMEOUT_S:.0f} s"
    elif rc != 2:
        r.verdict, r.why = ("silent" if rc == 0 else "unclear"), f"rc {rc}, want 2"
    elif "Traceback" in err or len(ours) != 1:
        r.verdict, r.why = "unclear", f"{len(ours)} dtensor_moe.titan lines" + (", a traceback" * ("Traceback" in err))
    elif why := names_missing(ours[0], fields, True):
        r.verdict, r.why = "unclear", why
    else:
        r.verdict = "clear"
    return tour.add(r)


def api_refused(tour: Tour, tried: str, fn, fields, exc: type = ValueError) -> Result:
    """Want: fn() raises `exc` naming `fields` (in process: the folding search and record_routing are torch-light)."""
    r, t0 = Result(AREA, f"API: {tried}"), time.perf_counter()
    try:
        fn()
        r.outcome, r.verdict, r.why = "accepted", "silent", "no exception"
    except Exception as e:  # noqa: BLE001 - judged below
        r.outcome, r.message = type(e).__name__, (str(e).splitlines() or [""])[0]
        if not isinstance(e, exc):
            r.verdict, r.why = "unclear", f"{type(e).__name__}, not {exc.__name__}"
        else:
            r.why = names_missing(str(e), fields, True)
            r.verdict = "unclear" if r.why else "clear"
    r.seconds = time.perf_counter() - t0
    return tour.add(r)


def _tiny(tour: Tour, *extra: str) -> list[str]:
    return ["train", "--config", str(tour.scratch / "tiny.toml"), *extra]


def _qwen3_dir(path: Path) -> Path:
    """tests/hf_models.py's tiny Qwen3-MoE checkpoint (4 experts, dim 8; the built-in model has 8 and 64), what
    `plan` must read for hf_path."""
    from tests.hf_models import hf_model  # the tour puts this checkout first on sys.path

    hf_model("qwen3_moe").save_pretrained(path)
    return path


def config_cases(tour: Tour) -> list[Result]:
    """Class 1 and 8 through the CLI: refused before launch, or accepted and checked."""
    s, out = tour.scratch, []
    # The tiny job: global_batch 4 over 2 data-parallel ranks, seq_len 8: 16 tokens per rank per forward.
    out.append(cli(tour, AREA, "train: moe_run.max_rows_per_rank=100 with parallel.ep=1 (never enforced)",
                   _tiny(tour, "--run-dir", str(s / "st_cap_ep1"), "parallel.ep=1", "moe_run.max_rows_per_rank=100"),
                   ["moe_run.max_rows_per_rank", "parallel.ep"], run_dir=str(s / "st_cap_ep1")))
    out.append(cli(tour, AREA, "train: moe_run.round_tokens_to=64 above the 16 tokens a rank's MoE sees per forward",
                   _tiny(tour, "--run-dir", str(s / "st_round"), "moe_run.round_tokens_to=64"),
                   ["moe_run.round_tokens_to", "16"], run_dir=str(s / "st_round")))
    out.append(cli(tour, AREA, "train: moe_run.round_tokens_to=8 above the capacity (capacity_factor 0.5: 4 pairs)",
                   _tiny(tour, "--run-dir", str(s / "st_round_cap"), "moe_run.round_tokens_to=8",
                         "moe_run.capacity_factor=0.5"), ["moe_run.round_tokens_to", "capacity"],
                   run_dir=str(s / "st_round_cap")))
    out.append(cli(tour, AREA, "train: moe_run.expert_replicas=1 with parallel.ep=1",
                   _tiny(tour, "--run-dir", str(s / "st_rep_ep1"), "parallel.ep=1", "moe_run.expert_replicas=1"),
                   ["expert_replicas", "ep"], run_dir=str(s / "st_rep_ep1")))
    out.append(cli(tour, AREA, "train: moe_run.expert_replicas=5 (the model has 4 experts)",
                   _tiny(tour, "--run-dir", str(s / "st_rep_many"), "moe_run.expert_replicas=5"),
                   ["expert_replicas", "num_experts"], run_dir=str(s / "st_rep_many")))
    # plan: the checkpoint's architecture (4 experts: ep in {1, 2, 4}; the built-in 8 would allow ep 8).
    ckpt = _qwen3_dir(s / "st_qwen")
    toml = s / "st_hf.toml"
    toml.write_text(f'[model]\nhf_path = "{ckpt}"\n')

    def planned_the_checkpoint(stdout: str) -> str:
        try:
            doc = json.loads(stdout)
        except ValueError:
            return "no JSON on stdout"
        eps = {c.get("ep", c.get("dims", {}).get("ep")) for c in doc["candidates"]}
        return "" if eps and eps <= {1, 2, 4} else f"ep {sorted(e for e in eps if e)}: not the checkpoint's 4 experts"

    out.append(cli(tour, AREA, "plan --model CONFIG with hf_path (4 experts): plans the checkpoint, not the built-in",
                   ["plan", "--model", str(toml), "--gpus", "8", "--json", "--top", "50"], [], valid=False, expect_rc=0,
                   accepted_check=planned_the_checkpoint))
    missing = s / "st_hf_missing.toml"
    missing.write_text(f'[model]\nhf_path = "{s / "no_such_checkpoint"}"\n')
    out.append(cli(tour, AREA, "plan --model CONFIG whose hf_path has no config.json",
                   ["plan", "--model", str(missing), "--gpus", "8"], ["hf_path", "config.json"], valid=False))
    out.append(cli(tour, AREA, "plan --replicas 1 on one GPU (every folding has ep 1)",
                   ["plan", "--model", "mixtral-8x7b", "--gpus", "1", "--replicas", "1"],
                   ["--replicas 1", "ep > 1", "--gpus 1"]))
    out.append(cli(tour, AREA, "plan --replicas 9 for mixtral-8x7b (8 experts)",
                   ["plan", "--model", "mixtral-8x7b", "--gpus", "8", "--replicas", "9"], ["--replicas", "8"]))
    out.append(cli(tour, AREA, "plan --replicas 1 on 8 GPUs: accepted, priced",
                   ["plan", "--model", "mixtral-8x7b", "--gpus", "8", "--replicas", "1"], [], valid=False, expect_rc=0,
                   accepted_check=lambda o: "" if "1 replica slot(s) per EP rank" in o else "replicas not shown"))
    return out


def hook_cases(tour: Tour) -> list[Result]:
    """The torchtitan hook's config: the main job's checks, while parsing."""
    return [
        hook_refused(tour, "--dtensor_moe.run.max_rows_per_rank 100 without --dtensor_moe.ep",
                     ["--dtensor_moe.run.max_rows_per_rank", "100"], ["max_rows_per_rank", "--dtensor_moe.ep"],
                     world=2),
        hook_refused(tour, "--dtensor_moe.run.expert_replicas 9 at ep 2 (the model's layers have 8 experts)",
                     ["--dtensor_moe.ep", "2", "--dtensor_moe.run.expert_replicas", "9"],
                     ["expert_replicas", "num_experts"], world=2),
        hook_refused(tour, "--dtensor_moe.run.round_tokens_to 64 above 2 x 16 tokens per forward",
                     ["--dtensor_moe.ep", "2", "--dtensor_moe.run.round_tokens_to", "64", "--training.local_batch_size",
                      "2", "--training.seq_len", "16"], ["round_tokens_to", "32 tokens"], world=2),
        hook_refused(tour, "--dtensor_moe.run.expert_replicas -1", ["--dtensor_moe.run.expert_replicas", "-1"],
                     ["expert_replicas"], world=1),
    ]


def api_cases(tour: Tour) -> list[Result]:
    import torch

    from dtensor_moe import MoE, MoEConfig, record_routing, replay_routing
    from dtensor_moe.parallel.replicas import place_replicas

    def record_linear():
        with record_routing(torch.nn.Linear(4, 4)):
            pass

    def replay(recorded):
        def run():
            with replay_routing(MoE(MoEConfig(dim=8, hidden_dim=4, num_experts=4, top_k=2)), recorded):
                pass
        return run

    return [
        api_refused(tour, "place_replicas with a NaN load", lambda: place_replicas([1.0, math.nan, 2.0, 3.0], 2, 1),
                    ["load_E[1]"]),
        api_refused(tour, "place_replicas with a negative load", lambda: place_replicas([1, -5, 2, 3], 2, 1),
                    ["load_E[1]"]),
        api_refused(tour, "place_replicas with r = -1", lambda: place_replicas([1, 2, 3, 4], 2, -1), ["r must"]),
        api_refused(tour, "place_replicas with ep = 0", lambda: place_replicas([1, 2, 3, 4], 0, 1), ["ep must"]),
        api_refused(tour, "record_routing of a tree without an MoE layer", record_linear, ["no MoE layer"]),
        # Want: the type replay_routing takes, named (TypeError), not an AttributeError from inside.
        api_refused(tour, "replay_routing given a dict", replay({"moe": [torch.zeros(3, 2, dtype=torch.long)]}),
                    ["RoutingReplay", "dict"], TypeError),
        api_refused(tour, "replay_routing given nested lists", replay([[0, 1], [2, 3]]), ["RoutingReplay", "list"],
                    TypeError),
    ]


_REPLAY = '''
import os, sys, torch
from dtensor_moe import MoE, MoEConfig, MoEParallelDims, parallelize_moe, record_routing, replay_routing
torch.distributed.init_process_group("gloo")
rank = torch.distributed.get_rank()
torch.manual_seed(0)
model = MoE(MoEConfig(dim=4, hidden_dim=4, num_experts=4, top_k=2))
parallelize_moe(model, MoEParallelDims(2, ep=2), device_type="cpu")
x = torch.randn(2, 3, 4)
with record_routing(model) as rec:
    model(x); model(x)
if sys.argv[1] == "missing" and rank == 1:
    rec.experts[""] = rec.experts[""][:1]
try:
    with replay_routing(model, rec):
        model(x[:1] if sys.argv[1] == "tokens" and rank == 1 else x)
        model(x)
except ValueError as e:  # a file per rank: two ranks' stderr lines can interleave
    open(os.path.join(sys.argv[2], f"rank{rank}.txt"), "w").write(f"ValueError: {e}")
    os._exit(3)
os._exit(0)
'''


def replay_case(tour: Tour, what: str) -> Result:
    """Want: rank 1's recording does not fit (another token count / a forward it lacks), rank 0's does; both
    ranks raise ValueError naming rank 1, neither dies with "Connection closed by peer", within the timeout."""
    script, said_dir = tour.scratch / "st_replay.py", tour.scratch / f"st_replay_{what}"
    script.write_text(_REPLAY)
    said_dir.mkdir()
    rc, err, _, dt = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(script), what, str(said_dir)], tour.scratch)
    said = {p.stem.upper(): p.read_text() for p in said_dir.glob("rank*.txt")}
    r = Result(AREA, f"replay: the recording differs on rank 1 only ({what})",
               outcome="timeout" if rc is None else f"rc {rc}", message=said.get("RANK0", ""), seconds=dt)
    if rc is None:
        r.verdict, r.why = "hang", f"> {TIMEOUT_S:.0f} s"
    elif set(said) != {"RANK0", "RANK1"}:
        r.verdict, r.why = "unclear", f"ValueError on {sorted(said)} only" + (
            "; another rank: Connection closed" if "Connection closed" in err else "")
    elif not all("rank(s) [1]" in ln for ln in said.values()):
        r.verdict, r.why = "unclear", "a rank's message does not name rank 1"
    else:
        r.verdict = "clear"
    return tour.add(r)


def hook_row_cap_case(tour: Tour) -> Result:
    """Want: the hook on 2 CPU ranks (torchrun, EP2) with a row cap no forward fits ends as the main job does: one
    `dtensor_moe.titan:` line naming max_rows_per_rank, no RowCapExceeded traceback from any rank, a rank exit
    status of 4 (ROW_CAP_RC; torchrun's own failure report names it)."""
    rc, err, out, dt = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                             "-m", "dtensor_moe.titan.cpu_train", *HOOK, "--dump_folder", str(tour.scratch / "st_hook"),
                             "--dtensor_moe.ep", "2", "--dtensor_moe.run.max_rows_per_rank", "1", "--training.steps",
                             "2"],
                            tour.scratch)
    text = err + out
    ours = [ln for ln in text.splitlines() if ln.startswith("dtensor_moe.titan:")]
    r = Result(AREA, "hook: --dtensor_moe.run.max_rows_per_rank 1 exceeded on 2 ranks (EP2)",
               outcome="timeout" if rc is None else f"rc {rc}", message=(ours or [""])[0], seconds=dt)
    if rc is None:
        r.verdict, r.why = "hang", f"> {TIMEOUT_S:.0f} s"
    elif rc == 0:
        r.verdict, r.why = "silent", "rc 0"
    elif "Traceback" in text and "RowCapExceeded" in text:
        r.verdict, r.why = "unclear", "a RowCapExceeded traceback"
    elif len(ours) != 1 or "max_rows_per_rank (1)" not in ours[0]:
        r.verdict, r.why = "unclear", f"{len(ours)} dtensor_moe.titan lines naming the cap"
    elif "exitcode  : 4" not in text and "exitcode: 4" not in text and "exit code 4" not in text:
        r.verdict, r.why = "unclear", "no rank exited 4"
    else:
        r.verdict = "clear"
    return tour.add(r)


def resume_cases(tour: Tour) -> list[Result]:
    """Class 8: a 2-step run saved without replicas resumes with moe_run.expert_replicas=1 (rc 0, step 4 reached);
    a changed top_k is still refused in one line (another model)."""
    run_dir = tour.scratch / "st_resume"
    rc, err, _, dt = run_cli(_tiny(tour, "--run-dir", str(run_dir), "--steps", "2", "--checkpoint-every", "2"),
                             tour.scratch)
    if rc != 0:
        return [tour.add(Result(AREA, "resume with replicas: the first run", outcome=f"rc {rc}", seconds=dt,
                                message=(message_lines(err) or [""])[-1], verdict="unclear",
                                why="the 2-step run failed"))]

    def reached_4(_stdout: str) -> str:
        steps = [json.loads(ln)["step"] for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]
        return "" if steps and max(steps) == 4 else f"steps {steps}"

    return [
        cli(tour, AREA, "train --resume with moe_run.expert_replicas=1 (saved without): same weights, resumed",
            _tiny(tour, "--run-dir", str(run_dir), "--resume", "moe_run.expert_replicas=1"), [], valid=False,
            expect_rc=0, accepted_check=reached_4),
        cli(tour, AREA, "train --resume with model.top_k=1 (saved with 2): another model, refused",
            _tiny(tour, "--run-dir", str(run_dir), "--resume", "--steps", "6", "model.top_k=1"),
            ["top_k", "another model config"], valid=False, guard=[str(run_dir / "checkpoints")]),
    ]


def settings_cases(tour: Tour) -> list:
    """Every settings case, as (fn, args) for the tour's threads."""
    # transformers resolves its classes lazily, and two threads doing it at once can miss one (tour_hf.py).
    from transformers import AutoModelForCausalLM  # noqa: F401

    return [(config_cases, tour), (hook_cases, tour), (api_cases, tour), (replay_case, tour, "tokens"),
            (replay_case, tour, "missing"), (hook_row_cap_case, tour), (resume_cases, tour)]
