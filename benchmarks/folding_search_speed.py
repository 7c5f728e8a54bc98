"""CPU time of `dtensor-moe plan` searches (torch-free, any machine): DeepSeek-V3 at 16,384 GPUs with the
default search (pp 1) and with the pipeline search (--microbatches 16: pp 1..16). Each search runs in a fresh
process (nothing memoized across runs), timed by time.process_time() around rank_foldings(); prints a table of
medians and writes JSON (--out). Quote the load average with the numbers: the machine is often shared."""

import argparse
import json
import os
import statistics
import subprocess
import sys

SEARCHES = {
    "default (pp 1)": ["--model", "deepseek-v3-671b", "--gpus", "16384", "--gpus-per-node", "8", "--gpu-mem", "141"],
    "pp search (--microbatches 16)": ["--model", "deepseek-v3-671b", "--gpus", "16384", "--gpus-per-node", "8",
                                      "--gpu-mem", "141", "--microbatches", "16"],
}

_ONE = """
import argparse, json, sys, time
from dtensor_moe.cli import plan as report
p = argparse.ArgumentParser()
report.add_arguments(p)
args = p.parse_args(sys.argv[1:])
spec, run = report.resolve(args.model)
work = report.Workload(args.seq_len, args.micro_batch, args.dtype, args.optimizer, args.activation_checkpoint,
                       args.microbatches, args.pp_schedule, moe_run=run)
hw = report.Hardware(args.gpus, args.gpus_per_node, args.gpu_mem, args.intra_bw * 1e9, args.inter_bw * 1e9)
t0 = time.process_time()
cands = report.rank_foldings(spec, work, hw, args.pp or None)
print(json.dumps({"cpu_s": time.process_time() - t0, "candidates": len(cands)}))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None, help="JSON file for the results")
    a = ap.parse_args()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root}
    results = []
    for name, argv in SEARCHES.items():
        runs = [json.loads(subprocess.run([sys.executable, "-c", _ONE, *argv], env=env, check=True,
                                          capture_output=True, text=True).stdout) for _ in range(a.repeats)]
        cpu = [r["cpu_s"] for r in runs]
        results.append({"search": name, "candidates": runs[0]["candidates"], "cpu_s": cpu,
                        "median_cpu_s": statistics.median(cpu)})
    load = os.getloadavg()[0]
    print(f"| search | foldings | rank_foldings() CPU s, median of {a.repeats} | runs |   (load {load:.1f})")
    print("|---|---|---|---|")
    for r in results:
        print(f"| {r['search']} | {r['candidates']} | {r['median_cpu_s']:.2f} | "
              f"{', '.join(f'{c:.2f}' for c in r['cpu_s'])} |")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"load_average_1min": load, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
