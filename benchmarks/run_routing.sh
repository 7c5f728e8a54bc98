#!/usr/bin/env bash
# Benchmarks that route like models do (issues 27 and 29), on ONE GPU, results under $OUT (about 3 minutes on an H200):
#   OUT=$OUT bash benchmarks/run_routing.sh
# At moe_layer.py's four model shapes (by default; SHAPES below), torchtitan 0.3.0 EP=1 (titan_anchor.py) and our
# layer unparallelized (moe_layer.py --meshes local), each in every routing mode of benchmarks/routing.py: topk
# (ragged counts), exact (equal counts), skewed (Zipf, exponent $ZIPF, default 1.2), both fed the same per-token
# expert choices. $ITERS (default 20) timed steps a row. Prints one table, ours / torchtitan on the same counts and
# each side's speed against its own topk row (beside it, the row's bars where moe_layer.py sets some), and writes
# routing_summary.json (moe_layer.py's full rows: moe_layer_routing.json).
# SHAPES picks moe_layer.py's shapes (names, or its sets), the same on both sides. EP-rank proxies, each one rank's
# experts at EP N with the rows EP gives them (moe_layer.py's docstring), and torchtitan on the same D F E K T:
#   SHAPES=proxies OUT=$OUT bash benchmarks/run_routing.sh  # deepseek_ep8 deepseek_ep32 qwen_ep8 e64_ep8, ~3 minutes
# Needs the carried wheels in .whl/ (torchtitan 0.3.0 and its small deps) for the baseline.
set -uo pipefail
OUT=${OUT:-/tmp/routing_out}
source "$(dirname "$0")/device_env.sh"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PYTHONPATH
MODES=(--routing topk exact skewed --zipf "${ZIPF:-1.2}")
RUN=(python3 -m torch.distributed.run --standalone --nproc-per-node 1)  # an array: `timeout` runs no shell function
read -ra NAMES <<< "${SHAPES:-deepseek qwen mixtral e64}"
# D F E K T of each shape from moe_layer.py's table, so torchtitan runs exactly the layers ours does.
mapfile -t DIMS < <(python3 -c 'import sys; sys.path.insert(0, "benchmarks"); import moe_layer as m
for n in m.shape_names(sys.argv[1:]): print(*m.SHAPES[n])' "${NAMES[@]}")
for s in "${DIMS[@]}"; do
  # shellcheck disable=SC2086  # the shape is five arguments
  OMP_NUM_THREADS=8 timeout 150 "${RUN[@]}" benchmarks/titan_anchor.py $s "${ITERS:-20}" "${MODES[@]}" 2>&1 \
    | tee -a "$OUT/titan.log" | grep titan0 || echo "titan EP=1 failed: $s" | tee -a "$LOG"
done
timeout 330 "${RUN[@]}" benchmarks/moe_layer.py --shapes "${NAMES[@]}" --meshes local --profile-meshes --gemm-timing \
  --iters "${ITERS:-20}" "${MODES[@]}" --titan-log "$OUT/titan.log" --out "$OUT/moe_layer_routing.json" 2>&1 \
  | tee -a "$LOG" | grep '^\[' || echo "moe_layer.py failed" | tee -a "$LOG"
python3 - "$OUT" <<'PY' 2>&1 | tee -a "$LOG"
import json, sys
out = sys.argv[1]
res = json.load(open(f"{out}/moe_layer_routing.json"))
keys = ("shape", "ep_proxy", "proxy_of", "routing", "zipf", "rows_mean", "rows_max", "rows_max_over_mean",
        "titan_ms", "ms", "ratio", "titan_vs_topk", "vs_topk", "fwd_tflops", "dgrad_tflops", "wgrad_tflops", "tflops",
        "pct_dense_peak", "peak_mem_gib", "bars")
rows = [{k: r.get(k) for k in keys} for r in res["rows"]]
f = lambda v, spec: "-" if v is None else format(v, spec)
print(f"\n{res['device']}, torch {res['torch']}, dense bf16 peak {res['dense_peak_tflops']:.0f} TFLOP/s; one GPU, "
      "the same expert choices on both sides; speed vs topk = topk row's ms / this row's ms")
print("| shape | proxy of | routing | rows/expert mean / max (max/mean) | torchtitan ms | ours ms | ours / torchtitan "
      "(bar) | % dense peak (bar) | torchtitan speed vs topk | ours speed vs topk | ours fwd / dgrad / wgrad TFLOP/s |"
      "\n|" + "---|" * 11)
for r in rows:
    routing = r["routing"] + (f" {r['zipf']:g}" if r["zipf"] is not None else "")
    proxy = f"{r['proxy_of']}, one rank of EP{r['ep_proxy']}" if r["ep_proxy"] else "-"
    gemms = " / ".join(f(r[f"{g}_tflops"], ".0f") for g in ("fwd", "dgrad", "wgrad"))
    bar = lambda field, spec: f" (>= {r['bars'][field]:{spec}})" if field in r["bars"] else ""
    print(f"| {r['shape']} | {proxy} | {routing} | {r['rows_mean']:.0f} / {r['rows_max']} "
          f"({r['rows_max_over_mean']:.2f}x) | {f(r['titan_ms'], '.2f')} | {r['ms']:.2f} | {f(r['ratio'], '.2f')}"
          f"{bar('ratio', '.2f')} | {f(r['pct_dense_peak'], '.0f')}{bar('pct_dense_peak', '.0f')} "
          f"| {f(r['titan_vs_topk'], '.2f')} | {f(r['vs_topk'], '.2f')} | {gemms} |")
res.setdefault("targets", [])  # written when moe_layer.py finishes: a run cut short has its rows but none
for t in res["targets"]:
    print(f"target {t['what']}: want {t['want']:.3g}, got {t['got']:.3g} -> {'PASS' if t['ok'] else 'MISS'}")
summary = {k: res[k] for k in ("torch", "device", "dense_peak_tflops", "skipped", "targets")}
json.dump({**summary, "rows": rows}, open(f"{out}/routing_summary.json", "w"), indent=1)
PY
