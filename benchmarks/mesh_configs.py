"""Train the same model under several expert meshes and tabulate throughput, memory and parity.

    python benchmarks/mesh_configs.py --config configs/tiny_cpu.toml --steps 20 --out results.json
    python benchmarks/mesh_configs.py --config configs/gpu_8x.toml --nproc 8 ...   # 8 GPUs

Each mesh runs `dtensor-moe train --parity` (the 1-process run of the same model and data is the
reference), and the table puts `dtensor-moe plan`'s predicted param+grad+optimizer bytes next to the
measured local bytes of rank 0.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys

import _checkout  # noqa: F401  (this checkout's dtensor_moe on sys.path)

from dtensor_moe.train.metrics import write_json

MESHES = {  # name -> overrides (world size from --nproc)
    "EDP2xEP2xETP2": ["parallel.ep=2", "parallel.etp=2", "parallel.dp_replicate=1"],
    "EP8": ["parallel.ep=8", "parallel.etp=1", "parallel.dp_replicate=1"],
    "EP4xETP2": ["parallel.ep=4", "parallel.etp=2", "parallel.dp_replicate=1"],
    "HSDP2xEP4": ["parallel.ep=4", "parallel.etp=1", "parallel.dp_replicate=2"],
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--nproc", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--run-root", default="runs/mesh_configs")
    ap.add_argument("--out", default="mesh_configs.json")
    ap.add_argument("--tolerance", type=float, help="parity tolerance (default: the config's)")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    rows = []
    for name, overrides in MESHES.items():
        run_dir = os.path.join(args.run_root, name)
        cmd = [sys.executable, "-m", "dtensor_moe.cli", "train", "--config", args.config, "--nproc", str(args.nproc),
               "--steps", str(args.steps), "--run-dir", run_dir, "--parity", *overrides, *args.overrides]
        if args.tolerance is not None:
            cmd.append(f"training.parity_tolerance={args.tolerance}")
        shutil.rmtree(run_dir, ignore_errors=True)  # never report an earlier run's files as this one's
        rc = subprocess.call(cmd, stdout=subprocess.DEVNULL)
        if not os.path.exists(os.path.join(run_dir, "parity.json")):
            print(f"{name}: training failed (rc={rc}); see the output above")
            rows.append({"mesh": name, "rc": rc or 1})
            continue
        with open(os.path.join(run_dir, "summary.json")) as f:
            s = json.load(f)
        with open(os.path.join(run_dir, "parity.json")) as f:
            p = json.load(f)
        got, want = s["state_bytes_per_rank"][0], s["predicted_state_bytes_per_rank"][0]
        rows.append({
            "mesh": name, "rc": rc, "tokens_per_s_per_rank": s["median_tokens_per_s_per_rank"],
            "peak_mem_gib_max": max(s["peak_mem_per_rank_gib"]), "parity_max_abs_dloss": p["max_abs_delta"],
            "parity_tolerance": p["tolerance"], "state_bytes_rank0": got, "predicted_state_bytes_rank0": want,
            "final_loss": s["final_loss"], "device": s["device"], "torch": s["torch"],
        })
    print(
        f"{'mesh':<14} {'tok/s/rank':>10} {'peak GiB':>9} {'max|dloss|':>11} {'state MiB meas':>15} {'pred MiB':>8} rc"
    )
    for r in rows:
        if "final_loss" not in r:
            print(f"{r['mesh']:<14} {'failed':>10} {'':>9} {'':>11} {'':>15} {'':>8} {r['rc']}")
            continue
        meas = sum(r["state_bytes_rank0"].values()) / 2**20
        pred = sum(r["predicted_state_bytes_rank0"].values()) / 2**20
        print(f"{r['mesh']:<14} {r['tokens_per_s_per_rank']:>10.0f} {r['peak_mem_gib_max']:>9.2f} "
              f"{r['parity_max_abs_dloss']:>11.2e} {meas:>15.2f} {pred:>8.2f} {r['rc']}")
    write_json(args.out, rows)
    return max(r["rc"] for r in rows)


if __name__ == "__main__":
    sys.exit(main())
