#!/usr/bin/env bash
# Benchmarks that route like models do (issues 27 and 29), on ONE GPU, results under $OUT (about 3 minutes on an H200):
#   OUT=$OUT bash benchmarks/run_routing.sh
# At moe_layer.py's four shapes, torchtitan 0.3.0 EP=1 (titan_anchor.py) and our layer unparallelized
# (moe_layer.py --meshes local), each in every routing mode of benchmarks/routing.py: topk (ragged counts), exact
# (equal counts), skewed (Zipf, exponent $ZIPF, default 1.2), both fed the same per-token expert choices. $ITERS
# (default 20) timed steps a row. Prints one table, ours / torchtitan on the same counts and each side's speed against
# its own topk row, and writes routing_summary.json (moe_layer.py's full rows: moe_layer_routing.json).
# Needs the carried wheels in .whl/ (torchtitan 0.3.0 and its small deps) for the baseline.
set -uo pipefail
OUT=${OUT:-/tmp/routing_out}
source "$(dirname "$0")/device_env.sh"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PYTHONPATH
MODES=(--routing topk exact skewed --zipf "${ZIPF:-1.2}")
RUN=(python3 -m torch.distributed.run --standalone --nproc-per-node 1)  # an array: `timeout` runs no shell function
for s in "7168 2048 256 8 8192" "2048 768 128 8 16384" "4096 14336 8 2 8192" "4096 1536 64 6 16384"; do
  # shellcheck disable=SC2086  # the shape is four arguments
  OMP_NUM_THREADS=8 timeout 150 "${RUN[@]}" benchmarks/titan_anchor.py $s "${ITERS:-20}" "${MODES[@]}" 2>&1 \
    | tee -a "$OUT/titan.log" | grep titan0 || echo "titan EP=1 failed: $s" | tee -a "$LOG"
done
timeout 330 "${RUN[@]}" benchmarks/moe_layer.py --meshes local --profile-meshes --gemm-timing --iters "${ITERS:-20}" \
  "${MODES[@]}" --titan-log "$OUT/titan.log" --out "$OUT/moe_layer_routing.json" 2>&1 | tee -a "$LOG" | grep '^\[' \
  || echo "moe_layer.py failed" | tee -a "$LOG"
python3 - "$OUT" <<'PY' 2>&1 | tee -a "$LOG"
import json, sys
out = sys.argv[1]
res = json.load(open(f"{out}/moe_layer_routing.json"))
keys = ("shape", "routing", "zipf", "rows_mean", "rows_max", "rows_max_over_mean", "titan_ms", "ms", "ratio",
        "titan_vs_topk", "vs_topk", "fwd_tflops", "dgrad_tflops", "wgrad_tflops", "tflops", "pct_dense_peak",
        "peak_mem_gib")
rows = [{k: r.get(k) for k in keys} for r in res["rows"]]
f = lambda v, spec: "-" if v is None else format(v, spec)
print(f"\n{res['device']}, torch {res['torch']}, dense bf16 peak {res['dense_peak_tflops']:.0f} TFLOP/s; one GPU, "
      "the same expert choices on both sides; speed vs topk = topk row's ms / this row's ms")
print("| shape | routing | rows/expert mean / max (max/mean) | torchtitan ms | ours ms | ours / torchtitan "
      "| torchtitan speed vs topk | ours speed vs topk | ours fwd / dgrad / wgrad TFLOP/s |\n|" + "---|" * 9)
for r in rows:
    routing = r["routing"] + (f" {r['zipf']:g}" if r["zipf"] is not None else "")
    gemms = " / ".join(f(r[f"{g}_tflops"], ".0f") for g in ("fwd", "dgrad", "wgrad"))
    print(f"| {r['shape']} | {routing} | {r['rows_mean']:.0f} / {r['rows_max']} ({r['rows_max_over_mean']:.2f}x) "
          f"| {f(r['titan_ms'], '.2f')} | {r['ms']:.2f} | {f(r['ratio'], '.2f')} | {f(r['titan_vs_topk'], '.2f')} "
          f"| {f(r['vs_topk'], '.2f')} | {gemms} |")
summary = {k: res[k] for k in ("torch", "device", "dense_peak_tflops", "skipped")}
json.dump({**summary, "rows": rows}, open(f"{out}/routing_summary.json", "w"), indent=1)
PY
