#!/usr/bin/env bash
# FP8 experts on one H200 (issue 17), results under $OUT (about 8 minutes):
#   OUT=$OUT bash benchmarks/run_fp8.sh
# 1. expert_gemms.py: the FP8 ops' checks on CUDA and the per-GEMM bf16/FP8 table (the policy's input);
# 2. moe_layer.py --meshes local, bf16 and fp8 rows side by side, the FP8 policy reading that table;
# 3. dtensor-moe train, configs/gpu_2x.toml on 1 GPU, 200 steps, bf16 then fp8 experts: loss curves and a summary.
set -uo pipefail
OUT=${OUT:-/tmp/fp8_out}
source "$(dirname "$0")/device_env.sh"
timeout 170 python3 benchmarks/expert_gemms.py --out "$OUT/expert_gemms.json" 2>&1 | tee -a "$LOG"
export DTENSOR_MOE_FP8_RATES=$OUT/expert_gemms.json
timeout 260 python3 -m torch.distributed.run --standalone --nproc-per-node 1 benchmarks/moe_layer.py --meshes local \
  --precisions bf16 fp8 --gemm-rates "$OUT/expert_gemms.json" --profile-meshes --budget-s 170 --out "$OUT/moe_layer.json" 2>&1 \
  | grep -v '^ ' | tee -a "$LOG"
for p in bf16 fp8; do
  timeout 110 python3 -m dtensor_moe.cli train --config configs/gpu_2x.toml --run-dir "/tmp/runs/$p" parallel.nproc=1 \
    parallel.ep=1 training.steps=200 model.expert_precision=$p 2>&1 | grep -v 'step/s' | tail -n 40 | tee -a "$LOG"
  cp "/tmp/runs/$p/loss.png" "$OUT/loss_$p.png"
done
python3 - "$OUT/train_fp8_vs_bf16.json" <<'PY' 2>&1 | tee -a "$LOG"
import json, statistics, sys
res = {}
for p in ("bf16", "fp8"):
    rows = [json.loads(line) for line in open(f"/tmp/runs/{p}/metrics.jsonl")]
    res[p] = {"steps": len(rows), "final_loss": rows[-1]["loss"],
              "last10_mean_loss": statistics.mean(r["loss"] for r in rows[-10:]),
              "median_tokens_per_s": statistics.median(r["tokens_per_s"] for r in rows[4:]),
              "loss_every_20": [rows[i]["loss"] for i in range(0, len(rows), 20)]}
res["final_loss_rel_diff"] = res["fp8"]["final_loss"] / res["bf16"]["final_loss"] - 1
res["last10_rel_diff"] = res["fp8"]["last10_mean_loss"] / res["bf16"]["last10_mean_loss"] - 1
res["tokens_per_s_ratio"] = res["fp8"]["median_tokens_per_s"] / res["bf16"]["median_tokens_per_s"]
json.dump(res, open(sys.argv[1], "w"), indent=1)
print(json.dumps(res, indent=1))
PY
