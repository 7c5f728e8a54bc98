#!/usr/bin/env bash
# FP8 experts on one H200 (issue 17), results under $OUT (about 5 minutes):
#   OUT=$OUT bash benchmarks/run_fp8.sh
# 1. expert_gemms.py: the FP8 ops' checks on CUDA and the per-GEMM bf16/FP8 table (the policy's input);
# 2. moe_layer.py --meshes local, bf16 and fp8 rows side by side, the FP8 policy reading that table.
# The 200-step training loss check, bf16 against FP8 over seeds, is benchmarks/fp8_loss_check.sh.
set -uo pipefail
OUT=${OUT:-/tmp/fp8_out}
source "$(dirname "$0")/device_env.sh"
timeout 170 python3 benchmarks/expert_gemms.py --out "$OUT/expert_gemms.json" 2>&1 | tee -a "$LOG"
export DTENSOR_MOE_FP8_RATES=$OUT/expert_gemms.json
timeout 260 python3 -m torch.distributed.run --standalone --nproc-per-node 1 benchmarks/moe_layer.py --meshes local \
  --precisions bf16 fp8 --gemm-rates "$OUT/expert_gemms.json" --profile-meshes --budget-s 170 --out "$OUT/moe_layer.json" 2>&1 \
  | grep -v '^ ' | tee -a "$LOG"
