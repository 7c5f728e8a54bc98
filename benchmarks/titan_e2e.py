"""torchtitan's Trainer end to end on one GPU, by torchtitan's own meter: torchtitan alone against our hook.

Rows (each a torchtitan 0.3.0 Trainer run, its own torchrun of one rank over NCCL, through tests/gpu/titan_torch211.py's
test-only shims while the GPU machine has torch 2.11):
  titan       torchtitan alone: its Trainer, its parallelize function and its MoE (EP 1);
  hook_titan  `--module dtensor_moe.titan --dtensor_moe.experts titan`: torchtitan's experts behind our dispatch;
  hook_ours   `--module dtensor_moe.titan` (experts ours, activation_memory minimal): our experts.
each eager or with torchtitan's compile of the model (`--compile.components model,loss`; torchtitan compiles the loss
in both), with or without torchtitan's selective AC. Models: torchtitan's `deepseek_v3_16b` and `qwen3_30b_a3b` at
their real dims and vocabularies with the decoder cut to `--depths` layers (one GPU holds a few), reading the tokenizer
and corpus shipped in dtensor_moe/titan_data (the model keeps its own vocabulary size; the ids stay below it).

Each row records what torchtitan's metrics print at every step (log_freq 1): tokens/s, TFLOP/s and MFU (its
`num_flops_per_token` of the cut model and its peak for the GPU), peak reserved memory (its memory monitor), and the
loss; the speed is the median over the steps after `--warmup`. Two depths per model give, from their difference, the
time per decoder layer and the fixed rest of the step, and from those a projection to the model's real depth (tokens/s
and MFU; the FLOPs per token extrapolated the same way). On one GPU the LM head and AdamW over every expert weigh far
more than in a real EP run: compare the per-layer times first. Writes `--out` (JSON) and prints a table.

    python benchmarks/titan_e2e.py --model deepseek_v3_16b --out $OUT/titan_e2e_deepseek.json
    python benchmarks/titan_e2e.py --model deepseek_v3_16b --rows titan hook_ours --modes eager --ac none selective \
        --depths 5 --batch 4 6 8 --out $OUT/titan_e2e_batches.json   # the largest batch each fits, one depth

This file is also the runs' torchtitan config registry (`--module benchmarks.titan_e2e --config e2e_hook` or
`e2e_titan`): the config functions read TITAN_E2E_MODEL, TITAN_E2E_LAYERS and TITAN_E2E_AC from the environment.
"""

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
from dataclasses import replace
from types import SimpleNamespace

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import _checkout  # noqa: E402,F401  (this checkout on sys.path: tests/gpu/ holds the shims)
from depths import project as depths_project  # noqa: E402

from tests.gpu import titan_torch211  # noqa: E402  (the shims and the launcher; imports no torchtitan)

# The models' real decoder depths, for the projection; deepseek_v3_debugmodel_cpu: the CPU smoke test's tiny model
# (tests/test_benchmarks_smoke.py), 2 layers of which the first is dense.
REAL_DEPTH = {"deepseek_v3_16b": 28, "qwen3_30b_a3b": 48, "deepseek_v3_debugmodel_cpu": 2}
DEPTHS = {"deepseek_v3_16b": (3, 5), "qwen3_30b_a3b": (2, 4), "deepseek_v3_debugmodel_cpu": (1, 2)}
ROWS = ("titan", "hook_titan", "hook_ours")
_LINE = re.compile(r"step:\s*(\d+)\s+loss:\s*([-0-9.naif]+)\s+grad_norm:\s*([-0-9.naif]+)\s+memory:\s*(-?[0-9.]+)GiB"
                   r"\((-?[0-9.]+)%\)\s+tps:\s*([0-9,]+)\s+tflops:\s*([0-9,.]+)\s+mfu:\s*([0-9.]+|N/A)%?")


# ---- the config registry (read in the rank processes, after the shims) -------------------------------------------


def _cut(config, layers: int | None, ac: str | None):
    """`config` with its decoder cut to `layers` (None: all), `ac` ("selective", "none"; None: the config's own),
    no checkpoint, the shipped data."""
    from torchtitan.distributed.activation_checkpoint import SelectiveAC

    from dtensor_moe.titan.config_registry import _shipped_data

    model = config.model_spec.model
    model.layers = model.layers[:layers]
    if ac is not None:
        config.activation_checkpoint = SelectiveAC.Config() if ac == "selective" else None
    config.checkpoint = replace(config.checkpoint, enable=False)
    return _shipped_data(config)


def _env():
    """TITAN_E2E_MODEL (a config function of torchtitan's and of the hook's registry), TITAN_E2E_LAYERS (unset: all)
    and TITAN_E2E_AC (unset: the config's own)."""
    layers = os.environ.get("TITAN_E2E_LAYERS")
    return (os.environ.get("TITAN_E2E_MODEL", "deepseek_v3_16b"), None if layers is None else int(layers),
            os.environ.get("TITAN_E2E_AC"))


def e2e_hook():
    """Our hook on the model (`--dtensor_moe.*` flags choose the experts)."""
    from dtensor_moe.titan import config_registry

    model, layers, ac = _env()
    return _cut(getattr(config_registry, model)(), layers, ac)


def e2e_titan():
    """torchtitan alone: its own config function, Trainer and parallelize function (EP 1, the partial_dtensor backend
    as the hook's, CUDA graphs off). Also the GPU suite's reference (titan_torch211.py --alone)."""
    from torchtitan.models.deepseek_v3 import config_registry as deepseek
    from torchtitan.models.qwen3 import config_registry as qwen3
    from torchtitan.trainer import Trainer

    from dtensor_moe.titan import config_registry
    from dtensor_moe.titan.config_registry import _as

    model, layers, ac = _env()
    if model.endswith("_cpu"):  # the hook's tiny CPU model under torchtitan's own parallelize
        return _cut(getattr(config_registry, f"{model}_titan_ep")(), layers, ac)
    registry = deepseek if model.startswith("deepseek") else qwen3
    if not hasattr(registry, model):
        raise ValueError(f"TITAN_E2E_MODEL={model!r} is not a config function of {registry.__name__}")
    config = getattr(registry, model)()
    config = _as(config, Trainer, config.model_spec.parallelize_fn, expert_parallel_degree=1)
    if model.startswith("qwen3"):  # the hook's Qwen3 configs train no routing bias (config_registry._no_routing_bias)
        for layer in config.model_spec.model.layers:
            if layer.moe is not None:
                layer.moe.load_balance_coeff = None
    return _cut(config, layers, ac)


# ---- the driver ------------------------------------------------------------------------------------------------


def parse_metrics(log: str) -> list[dict]:
    """torchtitan's step lines (rank 0's, the first of each step): step, loss, grad norm, peak reserved GiB, tokens/s,
    TFLOP/s, MFU %."""
    rows = {}
    for m in _LINE.finditer(titan_torch211._strip(log)):
        step = int(m.group(1))
        rows.setdefault(step, dict(step=step, loss=float(m.group(2)), grad_norm=float(m.group(3)),
                                   memory_gib=float(m.group(4)), tps=float(m.group(6).replace(",", "")),
                                   tflops=float(m.group(7).replace(",", "")),
                                   mfu=None if m.group(8) == "N/A" else float(m.group(8))))
    return [rows[s] for s in sorted(rows)]


def summarize(steps: list[dict], warmup: int) -> dict:
    """Medians over the steps after `warmup`; the loss at the first and last step; the peak memory (the monitor's
    running maximum, so the last step's)."""
    timed = [s for s in steps if s["step"] > warmup] or steps
    med = {k: statistics.median(s[k] for s in timed) for k in ("tps", "tflops")}
    mfus = [s["mfu"] for s in timed if s["mfu"] is not None]
    return dict(tps=med["tps"], tflops=med["tflops"], mfu=statistics.median(mfus) if mfus else None,
                peak_gib=max(s["memory_gib"] for s in steps), loss_first=steps[0]["loss"], loss_last=steps[-1]["loss"],
                steps=len(steps))


def project(tokens: int, depths: tuple[int, int], at: tuple[dict, dict], real_depth: int) -> dict | None:
    """depths.project of one row at two depths (None unless both ran), from torchtitan's tokens/s, TFLOP/s and MFU
    (its FLOPs per token and its peak); the MFU in percent, as torchtitan prints it."""
    if not (at[0] and at[1] and at[0].get("tps") and at[1].get("tps")):
        return None
    mfu = all(c.get("mfu") for c in at)
    fpt = tuple(c["tflops"] * 1e12 / c["tps"] for c in at) if mfu else None
    peak = at[0]["tflops"] * 1e12 / (at[0]["mfu"] / 100) if mfu else None
    out = depths_project(tokens, depths, (at[0]["tps"], at[1]["tps"]), fpt, real_depth, peak)
    out["projected_mfu"] = None if out["projected_mfu"] is None else 100 * out["projected_mfu"]
    return out


def _flags(row: str, compiled: bool, batch: int, args) -> list[str]:
    flags = ["--module", "benchmarks.titan_e2e", "--config", "e2e_titan" if row == "titan" else "e2e_hook",
             "--training.local_batch_size", str(batch), "--training.seq_len", str(args.seq)]
    flags += ["--compile.enable", "--compile.components", "model,loss"] if compiled else ["--compile.components",
                                                                                           "loss"]
    if row == "hook_titan":
        flags += ["--dtensor_moe.experts", "titan"]
    elif row == "hook_ours":
        flags += ["--dtensor_moe.run.activation_memory", args.activation_memory]
    return flags


def run_row(args, row: str, depth: int, compiled: bool, ac: str, batch: int) -> dict:
    os.environ.update(TITAN_E2E_MODEL=args.model, TITAN_E2E_LAYERS=str(depth), TITAN_E2E_AC=ac)
    launch = SimpleNamespace(backend=args.backend, device=args.device, shims="all", flex_autotune=False)
    titan = ["--dump_folder", tempfile.mkdtemp(prefix="titan_e2e_"), "--training.steps", str(args.steps),
             "--debug.seed", "0", "--metrics.log_freq", "1", *_flags(row, compiled, batch, args)]
    log, rc, seconds = titan_torch211._launch(launch, args.nproc, titan, args.timeout)
    steps = parse_metrics(log)
    case = dict(row=row, depth=depth, compiled=compiled, ac=ac, batch=batch, returncode=rc, seconds=seconds,
                per_step=steps)
    if rc != 0 or len(steps) != args.steps:
        case["error"] = titan_torch211.blocker(log, rc or 1) or f"{len(steps)} of {args.steps} steps logged"
        case["log_tail"] = titan_torch211._strip(log)[-3000:]
    else:
        case.update(summarize(steps, args.warmup))
    print(json.dumps({k: v for k, v in case.items() if k not in ("per_step", "log_tail")}), flush=True)
    return case


def table(result: dict) -> str:
    lines = [f"{result['model']} (seq {result['seq']}, {result['device_name']})",
             "| row | mode | AC | batch | depth | tokens/s | MFU % | peak GiB | loss 1 -> last | per layer ms | "
             f"fixed ms | tokens/s at {result['real_depth']} layers | MFU % there |", "|" + "---|" * 13]
    for key, p in result["projections"].items():
        for case in (c for c in result["cases"] if c["key"] == key):
            head = f"| {case['row']} | {key.split('/')[1]} | {case['ac']} | {case['batch']} | {case['depth']} |"
            if "error" in case:
                lines.append(f"{head} error: {case['error'][:80]} |")
                continue
            proj = p or {}
            lines.append(
                f"{head} {case['tps']:,.0f} | "
                f"{case['mfu'] or 0:.1f} | {case['peak_gib']:.1f} | {case['loss_first']:.3f} -> "
                f"{case['loss_last']:.3f} | {proj.get('per_layer_ms', float('nan')):.1f} | "
                f"{proj.get('fixed_ms', float('nan')):.1f} | {proj.get('projected_tokens_per_s', float('nan')):,.0f} | "
                f"{proj.get('projected_mfu') or float('nan'):.1f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=list(REAL_DEPTH), required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", nargs="+", choices=ROWS, default=list(ROWS))
    ap.add_argument("--modes", nargs="+", choices=("eager", "compiled"), default=["eager", "compiled"])
    ap.add_argument("--ac", nargs="+", choices=("none", "selective"), default=["none"])
    ap.add_argument("--depths", type=int, nargs="+", default=None, help="two depths (their difference: the time per "
                    "layer and the projection) or one (no projection); default: 3 5 (DeepSeek), 2 4 (Qwen3)")
    ap.add_argument("--batch", type=int, nargs="+", default=[2], help="local batch sizes, each a run of every row "
                    "(e.g. 4 6 8 with --ac none selective: the largest batch each fits; an OOM is that case's error)")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=4, help="steps left out of the medians")
    ap.add_argument("--activation-memory", choices=("minimal", "standard"), default="minimal")
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--backend", choices=("nccl", "gloo"), default="nccl")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--timeout", type=float, default=300)
    args = ap.parse_args(argv)
    depths = tuple(args.depths or DEPTHS[args.model])
    if len(depths) not in (1, 2) or len(set(depths)) != len(depths):
        ap.error(f"--depths takes one depth or two different ones, got {list(depths)}")
    cases, projections = [], {}
    result = dict(model=args.model, batch=args.batch, seq=args.seq, depths=depths, real_depth=REAL_DEPTH[args.model],
                  steps=args.steps, warmup=args.warmup, device_name=_device_name(args.device),
                  versions=titan_torch211._versions(), cases=cases, projections=projections)
    for batch in args.batch:
        for mode in args.modes:
            for ac in args.ac:
                for row in args.rows:
                    key, at = f"{row}/{mode}/{ac}/b{batch}", []
                    for depth in depths:
                        case = run_row(args, row, depth, mode == "compiled", ac, batch)
                        case["key"] = key
                        cases.append(case)
                        at.append(None if "error" in case else case)
                        _write(args.out, result)  # so far: a call cut short keeps its finished rows
                    projections[key] = (project(batch * args.seq, depths, tuple(at), REAL_DEPTH[args.model])
                                        if len(depths) == 2 else None)
    _write(args.out, result)
    print(table(result), flush=True)
    return 0 if all("error" not in c for c in cases) else 1


def _write(path: str, result: dict) -> None:
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


def _device_name(device: str) -> str:
    import torch

    return torch.cuda.get_device_name() if device == "cuda" and torch.cuda.is_available() else device


if __name__ == "__main__":
    sys.exit(main())
