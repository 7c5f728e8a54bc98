"""Issue 29's check that hot-expert replicas change nothing but who computes: the main job for N steps on CPU gloo
ranks (EP = nproc), once without replicas and once with `moe_run.expert_replicas`, the same seed and data; prints the
per-step loss and gradient-norm differences and the load both runs measured, writes a small JSON.

    .venv/bin/python benchmarks/replica_losses.py --steps 200 --out benchmarks/results/2026-12-03

The router is left unbalanced (`load_balance = "none"`), so the replicas have skew to even out.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def _train(run_dir: str, args, replicas: int) -> list[dict]:
    cmd = [sys.executable, "-m", "dtensor_moe.cli", "train", "--config", "configs/tiny_cpu.toml", "--run-dir", run_dir,
           f"parallel.nproc={args.nproc}", f"parallel.ep={args.nproc}", "parallel.etp=1",
           f"training.steps={args.steps}",
           "model.load_balance=none", f"moe_run.expert_replicas={replicas}",
           f"moe_run.replica_replan_every={args.replan_every}"]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    print(f"  replicas={replicas}: {time.perf_counter() - t0:.0f} s", flush=True)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--nproc", type=int, default=4, help="ranks, all of them EP ranks (8 experts: 2, 4 or 8)")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--replan-every", type=int, default=10, help="training forwards between placements")
    p.add_argument("--out", default=None, help="folder for replica_losses.json")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base = _train(os.path.join(tmp, "off"), args, 0)
        rep = _train(os.path.join(tmp, "on"), args, args.replicas)
    dloss = [abs(a["loss"] - b["loss"]) for a, b in zip(base, rep)]
    dnorm = [abs(a["grad_norm"] - b["grad_norm"]) / a["grad_norm"] for a, b in zip(base, rep)]
    result = {
        "steps": len(base), "nproc": args.nproc, "replicas": args.replicas, "replan_every": args.replan_every,
        "config": "configs/tiny_cpu.toml, load_balance none, EP = nproc",
        "max_abs_dloss": max(dloss), "max_rel_dgrad_norm": max(dnorm),
        "final_loss": [base[-1]["loss"], rep[-1]["loss"]],
        "mean_worst_ep_imbalance_without": statistics.fmean(r["worst_ep_imbalance"] for r in base),
        "mean_worst_ep_imbalance_computed_with": statistics.fmean(r["worst_replica_ep_imbalance"] for r in rep),
    }
    print(f"{'steps':>6} {'max |dloss|':>12} {'max rel dgrad_norm':>19} {'EP max/mean without':>20} "
          f"{'with replicas':>14}")
    print(f"{result['steps']:>6} {result['max_abs_dloss']:>12.2e} {result['max_rel_dgrad_norm']:>19.2e} "
          f"{result['mean_worst_ep_imbalance_without']:>20.3f} "
          f"{result['mean_worst_ep_imbalance_computed_with']:>14.3f}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "replica_losses.json"), "w") as f:
            json.dump(result, f, indent=2)
    return 0 if result["max_abs_dloss"] <= 1e-6 else 1


if __name__ == "__main__":
    sys.exit(main())
