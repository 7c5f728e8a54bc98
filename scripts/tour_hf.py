"""The tour's Hugging Face family: each MoE family's tiny checkpoint (made by transformers, as
tests/hf_models.py makes them) through `import --hf` -> `export --hf` -> `import --hf`, which must give back
every tensor bit for bit; then checkpoints that do not match their config.json (a wrong family, a tensor
larger than the config says, a missing key), each to be refused in one line naming the tensor or field. Issue 40's
cases follow: damaged or mismatched checkpoints as model.hf_path (refused before any rank starts) and for import
--hf, export / import targets on read-only and full disks (tmpfs), missing optional packages, the Python API given
the wrong types, and import-then-resume."""

import json
from pathlib import Path

from tour_base import Result, Tour, cli, run_cli

FAMILIES = ("qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss")


def _save(model_type: str, out: Path) -> None:
    from tests.hf_models import hf_model  # the tour puts this checkout first on sys.path

    hf_model(model_type).save_pretrained(out)


def round_trip(tour: Tour, model_type: str) -> Result:
    from safetensors.torch import load_file

    s = tour.scratch / f"hf_{model_type}"
    r = Result("HF round trip", f"{model_type}: import --hf -> export --hf -> import --hf")
    _save(model_type, s / "hf")
    steps = [["import", "--hf", str(s / "hf"), str(s / "ours")], ["export", str(s / "ours"), "--hf", str(s / "back")],
             ["import", "--hf", str(s / "back"), str(s / "again")]]
    for argv in steps:
        rc, err, _, dt = run_cli(argv, tour.scratch)
        r.seconds += dt
        if rc != 0:
            r.outcome, r.message = f"rc {rc}", (err.strip().splitlines() or [""])[-1]
            r.verdict, r.why = ("hang", "timeout") if rc is None else ("unclear", f"{argv[0]} failed")
            return tour.add(r)
    ours, again = load_file(s / "ours" / "model.safetensors"), load_file(s / "again" / "model.safetensors")
    bad = [k for k in ours if k not in again or again[k].dtype != ours[k].dtype or not again[k].equal(ours[k])]
    r.outcome = "rc 0"
    if bad or set(again) != set(ours):
        r.verdict, r.why = "data loss", f"tensors differ: {bad[:3] or sorted(set(again) ^ set(ours))[:3]}"
    else:
        r.verdict, r.why = "clear", f"{len(ours)} tensors bit-identical"
    return tour.add(r)


def mismatch_cases(tour: Tour) -> list[Result]:
    """A qwen3_moe checkpoint edited three ways; import --hf must refuse each in one line, writing nothing."""
    import torch
    from safetensors.torch import load_file, save_file

    base = tour.scratch / "hf_mismatch"
    _save("qwen3_moe", base / "hf")
    weights = load_file(base / "hf" / "model.safetensors")
    gate = next(k for k in weights if k.endswith("mlp.gate.weight"))
    edits = {
        "config.json names family 'mixtral'": (lambda c: {**c, "model_type": "mixtral"}, None, ["mixtral"]),
        f"{gate} one expert larger than the config": (
            None, lambda w: {**w, gate: torch.cat([w[gate], w[gate][:1]])}, [gate, "expected"]),
        f"{gate} missing": (None, lambda w: {k: v for k, v in w.items() if k != gate}, [gate]),
    }
    out = []
    for i, (tried, (config_edit, weights_edit, fields)) in enumerate(edits.items()):
        d = base / f"edit_{i}"
        d.mkdir(parents=True)
        config = json.loads((base / "hf" / "config.json").read_text())
        (d / "config.json").write_text(json.dumps(config_edit(config) if config_edit else config))
        save_file(weights_edit(weights) if weights_edit else weights, d / "model.safetensors")
        out.append(cli(tour, "HF mismatch", f"import --hf: {tried}", ["import", "--hf", str(d), str(d / "ours")],
                       fields, valid=False, run_dir=str(d / "ours")))
    return out


def hf_cases(tour: Tour) -> list:
    """Every HF case, as (fn, args) for the tour's threads (each builds a transformers model)."""
    # transformers resolves its classes lazily, and two threads doing it at once can miss one: resolve it here.
    from transformers import AutoModelForCausalLM  # noqa: F401

    return [*[(round_trip, tour, t) for t in FAMILIES], (mismatch_cases, tour), (bad_checkpoint_cases, tour),
            (disk_cases, tour), (extras_cases, tour), (api_cases, tour), (resume_after_import_case, tour)]


# --- issue 40: bad checkpoints before launch, filesystem faults, missing extras, API misuse ----------------------
# Each case's expectation is its `fields`: the one stderr line (rc 2, no traceback, no rank started) must name them.

def _byte_qwen3(out: Path, shards: bool = False) -> Path:
    """A Qwen3-MoE checkpoint the main job can train (vocabulary 256: its synthetic data is bytes)."""
    import torch
    import transformers as tf

    torch.manual_seed(0)
    config = tf.Qwen3MoeConfig(vocab_size=256, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                               num_key_value_heads=1, head_dim=8, moe_intermediate_size=8, intermediate_size=16,
                               num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=64)
    tf.AutoModelForCausalLM.from_config(config).save_pretrained(out, **({"max_shard_size": "20KB"} if shards else {}))
    return out


def _edited(src: Path, dst: Path, config=None, weights=None, files=None) -> Path:
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    if config is not None:
        (dst / "config.json").write_text(json.dumps(config(json.loads((dst / "config.json").read_text()))))
    if weights is not None:
        save_file(weights(load_file(dst / "model.safetensors")), dst / "model.safetensors")
    if files is not None:
        files(dst)
    return dst


def _hf_toml(d: Path) -> Path:
    toml = d.with_suffix(".toml")
    toml.write_text(f'[model]\nhf_path = "{d}"\nload_balance = "aux_loss"\n[parallel]\nnproc = 2\nep = 2\n'
                    "[training]\nsteps = 2\nseq_len = 16\nglobal_batch = 4\n")
    return toml


def bad_checkpoint_cases(tour: Tour) -> list[Result]:
    """A trainable checkpoint edited one way each; `train` with it as model.hf_path must refuse before any rank
    starts, and `import --hf` of it in one line, naming the file or key (issue 40 classes 1 and 3)."""
    import os

    import torch

    base = tour.scratch / "hf_bad"
    one, sharded = _byte_qwen3(base / "one"), _byte_qwen3(base / "sharded", shards=True)
    gate0 = "model.layers.0.mlp.experts.0.gate_proj.weight"
    index = json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]
    norm_shard = index["model.norm.weight"]

    def truncate(d):
        (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:-64])

    def lying_index(d):  # the index places a key in a shard that does not hold it
        idx = json.loads((d / "model.safetensors.index.json").read_text())
        other = next(f for f in idx["weight_map"].values() if f != norm_shard)
        idx["weight_map"]["model.norm.weight"] = other
        (d / "model.safetensors.index.json").write_text(json.dumps(idx))

    cases = [  # (tried, source, config edit, weights edit, files edit, fields, also import --hf)
        ("garbage model.safetensors", one, None, None,
         lambda d: (d / "model.safetensors").write_bytes(os.urandom(4096)), ["model.safetensors"], True),
        ("truncated model.safetensors", one, None, None, truncate, ["model.safetensors", "truncated"], True),
        ("no safetensors file", one, None, None, lambda d: (d / "model.safetensors").unlink(),
         ["no safetensors weights"], True),
        (f"missing shard {norm_shard}", sharded, None, None, lambda d: (d / norm_shard).unlink(), [norm_shard], True),
        ("index names a key its shard lacks", sharded, None, None, lying_index, ["model.norm.weight"], True),
        ("garbage model.safetensors.index.json", sharded, None, None,
         lambda d: (d / "model.safetensors.index.json").write_text("{"), ["model.safetensors.index.json"], True),
        ("model.embed_tokens.weight of another shape", one, None,
         lambda w: {**w, "model.embed_tokens.weight": torch.zeros(256, 8)}, None,
         ["model.embed_tokens.weight", "(256, 16)"], False),
        ("an extra expert tensor (expert 4 of 4)", one, None,
         lambda w: {**w, gate0.replace("experts.0", "experts.4"): w[gate0].clone()}, None,
         [gate0.replace("experts.0", "experts.4"), "unexpected"], True),
        ("config.json hidden_size 32, tensors 16", one, lambda c: {**c, "hidden_size": 32}, None, None,
         ["has shape", "(32"], True),
        ("config.json num_hidden_layers 1, tensors for 2", one, lambda c: {**c, "num_hidden_layers": 1}, None, None,
         ["model.layers.1.", "unexpected"], False),
        ("model.norm.weight missing (class 1: would train from random init)", one, None,
         lambda w: {k: v for k, v in w.items() if k != "model.norm.weight"}, None, ["model.norm.weight", "missing"],
         False),
        ("config.json num_experts = \"4\" (a string)", one, lambda c: {**c, "num_experts": "4"}, None, None,
         ["config.json", "'num_experts'", "int"], True),
        ("config.json num_experts_per_tok = 9 > num_experts 4", one, lambda c: {**c, "num_experts_per_tok": 9}, None,
         None, ["'num_experts_per_tok'", "'num_experts'"], True),
        ("config.json a JSON list", one, None, None, lambda d: (d / "config.json").write_text("[]"),
         ["config.json", "object"], True),
    ]
    out = []
    for i, (tried, src, config, weights, files, fields, also_import) in enumerate(cases):
        d = _edited(src, base / f"case_{i}", config, weights, files)
        run = base / f"run_{i}"
        out.append(cli(tour, "HF checkpoint", f"train hf_path: {tried}",
                       ["train", "--config", str(_hf_toml(d)), "--run-dir", str(run)], fields, valid=False,
                       run_dir=str(run), guard=[d]))
        if also_import:
            out.append(cli(tour, "HF checkpoint", f"import --hf: {tried}",
                           ["import", "--hf", str(d), str(base / f"imported_{i}")], fields, valid=False,
                           run_dir=str(base / f"imported_{i}"), guard=[d]))
    return out


def _mount(path: Path, size: str, readonly: bool = False) -> str:
    from tour_runs import _mount_tmpfs

    return _mount_tmpfs(path, size, readonly)


def _umount(path: Path):
    import subprocess

    subprocess.run(["umount", "-l", str(path)], capture_output=True)


def disk_cases(tour: Tour) -> list[Result]:
    """export / import targets on a read-only or full disk (tmpfs mounts; class 4): one line naming the target and
    the OS's reason, rc 2, no temporary file left; a disk smaller than the file is refused before writing."""
    base = tour.scratch / "hf_disk"
    _save("qwen3_moe", base / "hf")
    rc, err, _, _ = run_cli(["import", "--hf", str(base / "hf"), str(base / "ours")], tour.scratch)
    out = []
    for tried, argv, size, ro, fields in [
        ("import --hf into a read-only disk", ["import", "--hf", str(base / "hf")], "1M", True,
         ["Read-only file system"]),
        ("export --hf into a read-only disk", ["export", str(base / "ours"), "--hf"], "1M", True,
         ["Read-only file system"]),
        ("import --hf onto an 8 KiB disk (smaller than the file: refused before writing)",
         ["import", "--hf", str(base / "hf")], "8k", False, ["needs about", "free"]),
        ("import --hf onto a 12 KiB disk (room for the tensors, full before config.json)",
         ["import", "--hf", str(base / "hf")], "12k", False, ["No space left on device"]),
    ]:
        mnt = base / f"mnt_{len(out)}"
        if why := _mount(mnt, size, ro):
            r = Result("HF disk", tried, outcome="not run", verdict="unclear", why=why)
            out.append(tour.add(r))
            continue
        try:
            target = mnt / "out"
            r = cli(tour, "HF disk", tried, [*argv, str(target)], [str(target), *fields], valid=False,
                    guard=[base / "hf", base / "ours"])
            left = [p.name for p in mnt.rglob("*")] if not ro else []
            if r.verdict == "clear" and left:
                r.verdict, r.why = "data loss", f"left behind: {left[:4]}"
            out.append(r)
        finally:
            _umount(mnt)
    return out


def _without(tour: Tour, packages: list[str]) -> dict:
    """An environment in which `packages` are not installed (a sitecustomize marks them absent in sys.modules:
    import and importlib.util.find_spec both fail), this checkout first."""
    from tour_base import env

    d = tour.scratch / f"without_{'_'.join(packages)}"
    d.mkdir(parents=True, exist_ok=True)
    (d / "sitecustomize.py").write_text("import sys\n" + "".join(f"sys.modules[{p!r}] = None\n" for p in packages))
    e = env()
    e["PYTHONPATH"] = f"{d}:{e['PYTHONPATH']}"
    return e


def extras_cases(tour: Tour) -> list[Result]:
    """Missing optional packages (class 5): one line before launch with an install hint."""
    import subprocess
    import sys
    import time

    from tour_base import message_lines

    hf = _byte_qwen3(tour.scratch / "hf_extras")
    (tour.scratch / "hf_extras_main").mkdir(exist_ok=True)
    out = []
    for tried, missing, argv, fields in [
        ("train with model.hf_path, transformers not installed", ["transformers"],
         ["train", "--config", str(_hf_toml(hf))], ["transformers", "pip install"]),
        ("train with model.hf_path, safetensors not installed", ["safetensors"],
         ["train", "--config", str(_hf_toml(hf))], ["safetensors", "pip install"]),
        ("train, tqdm not installed", ["tqdm"], ["train", "--config", str(tour.scratch / "tiny.toml")],
         ["tqdm", "pip install"]),
        ("export, safetensors not installed", ["safetensors"],
         ["export", str(tour.scratch / "hf_extras_main"), str(tour.scratch / "x_out")], ["safetensors", "pip install"]),
        ("export --titan-config, torchtitan not installed", ["torchtitan"],
         ["export", str(tour.scratch / "hf_extras_main"), "--hf", str(tour.scratch / "x_out"), "--titan-config",
          "qwen3_debug"], ["torchtitan", "pip install"]),
    ]:
        run = tour.scratch / f"extras_run_{len(out)}"
        if argv[0] == "train":
            argv = [*argv, "--run-dir", str(run)]
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, "-m", "dtensor_moe.cli", *argv], cwd=tour.scratch, capture_output=True,
                           text=True, env=_without(tour, missing), timeout=240)
        lines = message_lines(p.stderr)
        r = Result("HF extras", tried, outcome=f"rc {p.returncode}", message=lines[0] if lines else "",
                   seconds=time.perf_counter() - t0)
        if p.returncode != 2:
            r.verdict, r.why = ("silent" if p.returncode == 0 else "unclear"), f"rc {p.returncode}, want 2"
        elif "Traceback" in p.stderr or len(lines) != 1:
            r.verdict, r.why = "unclear", f"a traceback or {len(lines)} stderr lines"
        elif missing_words := [f for f in fields if f not in lines[0]]:
            r.verdict, r.why = "unclear", f"message lacks {missing_words}"
        elif run.exists():
            r.verdict, r.why = "unclear", "a run dir was created: ranks started"
        else:
            r.verdict = "clear"
        out.append(tour.add(r))
    return out


def _api(tour: Tour, tried: str, fn, exc, fields) -> Result:
    """fn() must raise `exc` (a ValueError or TypeError) whose message names every field (class 7); in this thread,
    no alarm (the tour's own `api` needs the main thread)."""
    import time

    r, t0 = Result("HF API", tried), time.perf_counter()
    try:
        fn()
        r.outcome, r.verdict, r.why = "accepted", "silent", "no exception"
    except Exception as e:  # noqa: BLE001 - the tour judges whatever comes out
        r.outcome, r.message = type(e).__name__, (str(e).strip().splitlines() or [""])[0]
        if not isinstance(e, exc):
            r.verdict, r.why = "unclear", f"{type(e).__name__}, not {exc.__name__}"
        elif lacks := [f for f in fields if f not in str(e)]:
            r.verdict, r.why = "unclear", f"message lacks {lacks}"
        else:
            r.verdict = "clear"
    r.seconds = time.perf_counter() - t0
    return tour.add(r)


def api_cases(tour: Tour) -> list[Result]:
    from dtensor_moe.hf import moe_config_from_hf, parallelize_hf_model, save_hf
    from tests.hf_models import hf_config, hf_model

    qwen = hf_config("qwen3_moe").to_dict()
    no_experts = {k: v for k, v in qwen.items() if k not in ("num_experts", "num_local_experts")}
    return [
        _api(tour, "parallelize_hf_model(model, 'ep2')",
             lambda: parallelize_hf_model(hf_model("qwen3_moe"), "ep2", device_type="cpu"), TypeError,
             ["MoEParallelDims", "str"]),
        _api(tour, "moe_config_from_hf(qwen3_moe config without num_experts)", lambda: moe_config_from_hf(no_experts),
             ValueError, ["'num_experts'", "int"]),
        _api(tour, "moe_config_from_hf(mixtral config, num_local_experts='4')",
             lambda: moe_config_from_hf({**hf_config("mixtral").to_dict(), "num_local_experts": "4"}), ValueError,
             ["config.json", "'num_local_experts'", "int"]),
        _api(tour, "moe_config_from_hf(a list)", lambda: moe_config_from_hf(list(qwen.items())), TypeError,
             ["dict", "list"]),
        _api(tour, "save_hf(a plain transformers model, dir)",
             lambda: save_hf(hf_model("mixtral"), tour.scratch / "save_hf_plain"), ValueError,
             ["save_pretrained", "swap_moe_blocks"]),
        _api(tour, "save_hf({'not': 'a model'}, dir)", lambda: save_hf({"not": "a model"}, tour.scratch / "x"),
             TypeError, ["save_hf", "dict"]),
    ]


def resume_after_import_case(tour: Tour) -> Result:
    """Class 8: `import model.safetensors RUN` then `train --run-dir RUN --resume` (which reads RUN/checkpoints):
    refused in one line naming the fix (--resume RUN)."""
    from dataclasses import asdict

    from safetensors.torch import save_file

    from dtensor_moe.experts import split_gate_up
    from dtensor_moe.train.config import ModelConfig
    from dtensor_moe.train.model import MoETransformer

    base = tour.scratch / "hf_resume"
    cfg = ModelConfig(dim=16, n_layers=1, n_heads=2, num_experts=4, top_k=2, hidden_dim=8, max_seq_len=16)
    (base / "w").mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in split_gate_up(MoETransformer(cfg).state_dict()).items()},
              base / "w" / "model.safetensors")
    (base / "w" / "config.json").write_text(json.dumps(asdict(cfg)))
    run = base / "run"
    run_cli(["import", str(base / "w" / "model.safetensors"), str(run)], tour.scratch)
    return cli(tour, "HF flow", "import model.safetensors RUN, then train --run-dir RUN --resume",
               ["train", "--config", str(tour.scratch / "tiny.toml"), "--run-dir", str(run), "--resume"],
               ["--resume", str(run / "checkpoints"), f"--resume {run}"], guard=[run])
