#!/usr/bin/env bash
# Issue 17's 200-step loss check on one GPU, results under $OUT (about 4 minutes):
#   OUT=$OUT bash benchmarks/fp8_loss_check.sh
# configs/gpu_2x.toml on 1 GPU for 200 steps, three runs one after the other: bf16 experts; fp8 experts with the
# measured table (the policy runs FP8 only where it was seen to win, so at this shape it may pick bf16); fp8 with
# a table that marks FP8 faster for every GEMM kind at this layer's (I, O), so every expert GEMM runs in FP8 (the
# numerics under test). Writes train_fp8_vs_bf16.json and each run's loss.png (loss_<run>.png).
set -uo pipefail
OUT=${OUT:-/tmp/fp8_loss_out}
source "$(dirname "$0")/device_env.sh"
python3 - "$OUT/fp8_everywhere.json" <<'PY'
import json, sys
gemms = [{"shape": "gpu_2x", "gemm": g, "I": I, "O": O, "E": 16, "rows_per_expert": 4096.0, "bf16_tflops": 1.0,
          "fp8_tflops": 2.0} for g in ("fwd", "dgrad", "wgrad", "wgrad_acc") for I, O in ((1024, 2048), (2048, 1024))]
json.dump({"note": "forces FP8 for every expert GEMM of configs/gpu_2x.toml", "gemms": gemms}, open(sys.argv[1], "w"))
PY
run() {  # name, expert precision, extra environment
  env $3 timeout 150 python3 -m dtensor_moe.cli train --config configs/gpu_2x.toml --run-dir "/tmp/runs/$1" \
    parallel.nproc=1 parallel.ep=1 training.steps=200 model.expert_precision=$2 2>&1 | grep -v 'step/s' | tail -n 25 \
    | tee -a "$LOG"
  cp "/tmp/runs/$1/loss.png" "$OUT/loss_$1.png"
}
run bf16 bf16 ""
run fp8_measured fp8 ""
run fp8_forced fp8 "DTENSOR_MOE_FP8_RATES=$OUT/fp8_everywhere.json"
python3 - "$OUT/train_fp8_vs_bf16.json" <<'PY' 2>&1 | tee -a "$LOG"
import json, statistics, sys
res = {}
for p in ("bf16", "fp8_measured", "fp8_forced"):
    rows = [json.loads(line) for line in open(f"/tmp/runs/{p}/metrics.jsonl")]
    res[p] = {"steps": len(rows), "final_loss": rows[-1]["loss"],
              "last10_mean_loss": statistics.mean(r["loss"] for r in rows[-10:]),
              "median_tokens_per_s": statistics.median(r["tokens_per_s"] for r in rows[4:]),
              "loss_every_20": [rows[i]["loss"] for i in range(0, len(rows), 20)]}
for p in ("fp8_measured", "fp8_forced"):
    res[f"{p}_final_loss_rel_diff"] = res[p]["final_loss"] / res["bf16"]["final_loss"] - 1
    res[f"{p}_last10_rel_diff"] = res[p]["last10_mean_loss"] / res["bf16"]["last10_mean_loss"] - 1
    res[f"{p}_tokens_per_s_ratio"] = res[p]["median_tokens_per_s"] / res["bf16"]["median_tokens_per_s"]
json.dump(res, open(sys.argv[1], "w"), indent=1)
print(json.dumps(res, indent=1))
PY
