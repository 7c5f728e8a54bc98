"""The tour's Hugging Face family: each MoE family's tiny checkpoint (made by transformers, as
tests/hf_models.py makes them) through `import --hf` -> `export --hf` -> `import --hf`, which must give back
every tensor bit for bit; then checkpoints that do not match their config.json (a wrong family, a tensor
larger than the config says, a missing key), each to be refused in one line naming the tensor or field."""

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

    return [*[(round_trip, tour, t) for t in FAMILIES], (mismatch_cases, tour)]
