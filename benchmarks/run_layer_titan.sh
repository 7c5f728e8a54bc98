#!/usr/bin/env bash
# Issue 17 on one H200, results under $OUT (about 9 minutes):
#   OUT=$OUT bash benchmarks/run_layer_titan.sh
# 1. wgrad_probe.py at PROBE_SHAPES (default deepseek): every weight-gradient accumulation method and
#    config (skipped with PROBE=0; session 8 ran it with the warp-specialized configs of commit ff72408);
# 2. torchtitan 0.3.0 on one GPU at the four local shapes (needs the carried wheels in .whl/; TITAN=0 skips);
# 3. moe_layer.py (LAYER=0 skips) --meshes local, bf16 and fp8 rows, torchtitan's columns beside them; each row also times
#    the one-microbatch step with fresh gradients (step ms) next to the accumulating steady state (ms);
#    LAYER_ARGS: more moe_layer.py arguments (e.g. --profile-fresh);
set -uo pipefail
OUT=${OUT:-/tmp/layer_titan_out}
source "$(dirname "$0")/device_env.sh"
[ "${PROBE:-1}" = 0 ] || (cd benchmarks && timeout "${PROBE_S:-150}" python3 wgrad_probe.py \
  --shapes ${PROBE_SHAPES:-deepseek} --out "$OUT/wgrad.json" --configs-out "$OUT/wgrad_configs.json") 2>&1 | grep -v '^|' | tee -a "$LOG"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
if [ "${TITAN:-1}" = 1 ]; then
  for s in "7168 2048 256 8 8192" "2048 768 128 8 16384" "4096 14336 8 2 8192" "4096 1536 64 6 16384"; do
    PYTHONPATH=/tmp/site:$PWD OMP_NUM_THREADS=8 timeout 60 python3 -m torch.distributed.run --standalone --nproc-per-node 1 \
      benchmarks/titan_anchor.py $s 20 2>&1 | tee -a "$OUT/titan.log" | grep titan0 || echo "titan EP=1 failed: $s" | tee -a "$LOG"
  done
fi
[ "${LAYER:-1}" = 0 ] || timeout "${LAYER_S:-290}" python3 -m torch.distributed.run --standalone --nproc-per-node 1 benchmarks/moe_layer.py \
  --meshes local --precisions ${PRECISIONS:-bf16 fp8} --titan-log "$OUT/titan.log" --budget-s $((${LAYER_S:-290} - 60)) ${LAYER_ARGS:-} \
  --out "$OUT/moe_layer.json" 2>&1 | grep -v '^ ' | tee -a "$LOG"
# 4. FP8=1: where the FP8 weight gradient's time goes (fp8_wgrad_probe.py), and torchtitan with fresh gradients.
if [ "${FP8:-0}" = 1 ]; then
  (cd benchmarks && timeout 150 python3 fp8_wgrad_probe.py --out "$OUT/fp8_wgrad.json") 2>&1 | tee -a "$LOG"
  for s in "7168 2048 256 8 8192" "2048 768 128 8 16384" "4096 14336 8 2 8192" "4096 1536 64 6 16384"; do
    PYTHONPATH=/tmp/site:$PWD OMP_NUM_THREADS=8 timeout 60 python3 -m torch.distributed.run --standalone --nproc-per-node 1 \
      benchmarks/titan_anchor.py $s 20 fresh 2>&1 | tee -a "$OUT/titan.log" | grep titan0 || echo "titan fresh failed: $s" | tee -a "$LOG"
  done
fi
