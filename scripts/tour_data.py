"""The tour's data family (issue 47, classes 1-7): what a run trains on and what it writes, tried as a user would.

Each case writes down its expectation: refused before any rank starts (rc 2, one line naming the field or flag and
the way out), or accepted with a note where that is right (a damaged token cache rebuilt), or a signal's exit code
with nothing left behind. Files that must survive are guarded: a changed byte is `data loss`."""

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from tour_base import TIMEOUT_S, TINY_TOML, Result, Tour, cli, env, finish, message_lines, start
from tour_settings import api_refused, hook_refused

AREA = "data"
DOCS = [f"document {i} about experts and routers, tokens and ranks, number {i * 7 % 13}." for i in range(400)]


def _files_toml(tour: Tour, name: str, train: list[Path], held: list[Path] = (), fraction: float = 0.0,
                cache: Path | None = None) -> Path:
    """The tour's tiny job reading `train` (byte tokenizer) into `cache` (default: this family's shared cache)."""
    toml = TINY_TOML.replace('source = "synthetic"', "\n".join([
        'source = "files"', f"paths = {json.dumps([str(p) for p in train])}",
        *([f"eval_paths = {json.dumps([str(p) for p in held])}"] if held else []),
        'tokenizer = "byte"', f"eval_fraction = {fraction}", f'cache_dir = "{cache or tour.scratch / "data_cache"}"']))
    path = tour.scratch / f"{name}.toml"
    path.write_text(toml)
    return path


def _jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def export_cases(tour: Tour):
    """Class 1: export into a directory holding a Hugging Face model."""
    hf = tour.scratch / "data_hf_model"
    hf.mkdir(exist_ok=True)
    (hf / "model.safetensors").write_bytes(b"their weights")
    (hf / "config.json").write_text('{"model_type": "qwen3_moe"}')
    run = tour.scratch / "data_export_run"
    rc = subprocess.run([sys.executable, "-m", "dtensor_moe.cli", "train", "--config", str(tour.scratch / "tiny.toml"),
                         "--run-dir", str(run), "--steps", "2", "--checkpoint-every", "2"], cwd=tour.scratch,
                        env=env(), capture_output=True, timeout=TIMEOUT_S).returncode
    if rc != 0:
        tour.add(Result(AREA, "export into a Hugging Face model's directory", outcome=f"setup rc {rc}",
                        verdict="unclear", why="the tiny run to export did not train"))
        return
    cli(tour, AREA, "export RUN/checkpoints into a directory holding a Hugging Face model",
        ["export", str(run / "checkpoints"), str(hf)], ["--force", "model.safetensors"], guard=[hf])


def resume_cases(tour: Tour):
    """Class 2: resume after the data changed (eval_fraction, appended documents, source)."""
    docs = _jsonl(tour.scratch / "data_resume.jsonl", DOCS)
    toml = _files_toml(tour, "data_resume", [docs])
    run = tour.scratch / "data_resume_run"
    rc = subprocess.run([sys.executable, "-m", "dtensor_moe.cli", "train", "--config", str(toml), "--run-dir",
                         str(run), "--steps", "2", "--checkpoint-every", "2"], cwd=tour.scratch, env=env(),
                        capture_output=True, timeout=TIMEOUT_S).returncode
    if rc != 0:
        tour.add(Result(AREA, "resume on changed data", outcome=f"setup rc {rc}", verdict="unclear",
                        why="the run to resume did not train"))
        return
    base = ["train", "--config", str(toml), "--run-dir", str(run), "--resume", "--steps", "4"]
    cli(tour, AREA, "resume with data.eval_fraction changed (trained sequences would be held out)",
        [*base, "data.eval_fraction=0.2"], ["data.eval_fraction", "--new-data"], guard=[run / "checkpoints"])
    corpus = tour.scratch / "data_resume_corpus.toml"  # the same job reading the built-in corpus instead
    corpus.write_text(TINY_TOML.replace('source = "synthetic"', 'source = "corpus"'))
    cli(tour, AREA, "resume with data.source switched to the built-in corpus",
        ["train", "--config", str(corpus), "--run-dir", str(run), "--resume", "--steps", "4"],
        ["data.source", "--new-data"], guard=[run / "checkpoints"])
    with docs.open("a") as f:
        f.write(json.dumps({"text": "an appended document."}) + "\n")
    cli(tour, AREA, "resume after documents were appended to the training file", base,
        ["data files' content", "--new-data"], guard=[run / "checkpoints"])


def content_cases(tour: Tour):
    """Class 3: content, not names."""
    train = _jsonl(tour.scratch / "data_train.jsonl", DOCS)
    twin = tour.scratch / "data_twin.jsonl"
    twin.write_bytes(train.read_bytes())
    cli(tour, AREA, "data.eval_paths a copy of a training file under another name",
        ["train", "--config", str(_files_toml(tour, "data_twin", [train], [twin])), "--run-dir",
         str(tour.scratch / "data_twin_run")], ["data.eval_paths", "data.paths"], valid=False,
        run_dir=tour.scratch / "data_twin_run")
    empty = _jsonl(tour.scratch / "data_empty.jsonl", [""] * 300)
    cli(tour, AREA, "a JSONL whose every text is empty",
        ["train", "--config", str(_files_toml(tour, "data_empty", [empty])), "--run-dir",
         str(tour.scratch / "data_empty_run")], ["data.paths", "empty"], valid=False,
        run_dir=tour.scratch / "data_empty_run")


def cache_cases(tour: Tour):
    """Class 4: a damaged cache is rebuilt with a note (rc 0), an unwritable one refused in one line."""
    train = _jsonl(tour.scratch / "data_cache_src.jsonl", DOCS)
    toml = _files_toml(tour, "data_cache", [train])
    argv = ["train", "--config", str(toml), "--run-dir", str(tour.scratch / "data_cache_run"), "--steps", "1"]
    first = subprocess.run([sys.executable, "-m", "dtensor_moe.cli", *argv], cwd=tour.scratch, env=env(),
                           capture_output=True, timeout=TIMEOUT_S)
    caches = [p for p in (tour.scratch / "data_cache").iterdir() if (p / "tokens.bin").is_file()] \
        if first.returncode == 0 else []
    if not caches:
        tour.add(Result(AREA, "a damaged token cache", outcome=f"setup rc {first.returncode}", verdict="unclear",
                        why="no cache was built"))
        return
    tokens = caches[0] / "tokens.bin"
    tokens.write_bytes(tokens.read_bytes()[:-6])
    shutil.rmtree(tour.scratch / "data_cache_run")
    cli(tour, AREA, "a truncated tokens.bin in the cache", argv, ["damaged", "rebuilding"], valid=False,
        expect_rc=0, accepted_check=lambda out: "" if tokens.stat().st_size % 2 == 0 else "not rebuilt")
    (tour.scratch / "data_ro_parent").write_text("a file where the cache's parent should be")
    bad = _files_toml(tour, "data_bad_cache", [train], cache=tour.scratch / "data_ro_parent" / "c")
    cli(tour, AREA, "data.cache_dir under a file (cannot be created)",
        ["train", "--config", str(bad), "--run-dir",
         str(tour.scratch / "data_bad_cache_run")], ["data.cache_dir"], run_dir=tour.scratch / "data_bad_cache_run")


def signal_case(tour: Tour, sig: int):
    """Class 5: a signal while the cache is built: exit 128 + N, one line, no hidden build left in the cache root."""
    big = tour.scratch / f"data_big_{sig}.txt"
    big.write_text("\n".join(DOCS) * 400)  # a few MB: seconds of tokenizing
    cache = tour.scratch / f"data_sig_cache_{sig}"
    toml = _files_toml(tour, f"data_sig_{sig}", [big], cache=cache)
    t0 = time.perf_counter()
    p = start([sys.executable, "-m", "dtensor_moe.cli", "train", "--config", str(toml), "--run-dir",
               str(tour.scratch / f"sig_run{sig}")], tour.scratch)
    deadline = time.time() + 60
    while time.time() < deadline and not (cache.is_dir() and any(cache.glob(".*"))):
        time.sleep(0.05)  # the build's temporary directory exists: tokenizing
    p.send_signal(sig)
    rc, err, _ = finish(p)
    name = signal.Signals(sig).name
    lines = message_lines(err)
    r = Result(AREA, f"{name} while the token cache is built", outcome="timeout" if rc is None else f"rc {rc}",
               message=lines[-1] if lines else "", seconds=time.perf_counter() - t0)
    left = [q.name for q in cache.glob(".*") if q.is_dir()] if cache.is_dir() else []
    if rc is None:
        r.verdict, r.why = "hang", f"> {TIMEOUT_S:.0f} s"
    elif left:
        r.verdict, r.why = "data loss", f"left behind: {left}"
    elif rc != 128 + sig or "Traceback" in err or len(lines) != 1:
        r.verdict, r.why = "unclear", f"rc {rc} (want {128 + sig}), {len(lines)} lines"
    else:
        r.verdict = "clear"
    tour.add(r)


def hook_flag_case(tour: Tour):
    """Class 7: an unknown --dtensor_moe.* flag of the torchtitan hook."""
    hook_refused(tour, "an unknown flag --dtensor_moe.expert_parallel 2", ["--dtensor_moe.expert_parallel", "2"],
                 ["--dtensor_moe.expert_parallel", "--dtensor_moe.ep"])


def api_cases(tour: Tour):
    """Class 6: API calls that did nothing, picked a side silently, or failed inside torch (in process, no
    process group: each must be refused before one is needed)."""
    import torch
    from torch import nn

    from dtensor_moe import (
        ExpertParallel,
        MoE,
        MoEConfig,
        MoEParallelDims,
        parallelize_moe,
        record_routing,
        replay_routing,
    )

    cfg = MoEConfig(dim=8, hidden_dim=8, num_experts=4, top_k=2)
    api_refused(tour, "parallelize_moe on a model holding no dtensor_moe.MoE",
                lambda: parallelize_moe(nn.Sequential(nn.Linear(8, 8)), MoEParallelDims(1), device_type="cpu"),
                ["dtensor_moe.MoE", "parallelize_hf_model"])
    api_refused(tour, "ExpertParallel(tp_grads='max')",
                lambda: ExpertParallel(MoEParallelDims(2, ep=2), tp_grads="max"), ["tp_grads", "sum", "mean"])
    api_refused(tour, "parallelize_moe(model, a DeviceMesh) where the dims belong",
                lambda: parallelize_moe(MoE(cfg), object(), device_type="cpu"), ["dims", "MoEParallelDims"],
                exc=TypeError)
    api_refused(tour, "parallelize_moe(mp_policy='bf16')",
                lambda: parallelize_moe(MoE(cfg), MoEParallelDims(1), device_type="cpu", mp_policy="bf16"),
                ["mp_policy", "MixedPrecisionPolicy"], exc=TypeError)
    small = MoE(cfg)
    with record_routing(small) as rec:
        small(torch.randn(2, 3, 8))

    def replay_into_more_experts():
        with replay_routing(MoE(MoEConfig(dim=8, hidden_dim=8, num_experts=8, top_k=2)), rec):
            pass

    api_refused(tour, "a 4-expert layer's routing replayed into an 8-expert layer", replay_into_more_experts,
                ["8 experts", "of 4"])


def data_cases(tour: Tour) -> list:
    """Every data case, as (fn, args) for the tour's threads."""
    if not (tour.scratch / "tiny.toml").exists():
        (tour.scratch / "tiny.toml").write_text(TINY_TOML)
    return [(export_cases, tour), (resume_cases, tour), (content_cases, tour), (cache_cases, tour),
            (signal_case, tour, signal.SIGINT), (signal_case, tour, signal.SIGTERM), (hook_flag_case, tour),
            (api_cases, tour)]

