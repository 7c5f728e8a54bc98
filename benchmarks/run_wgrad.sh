#!/usr/bin/env bash
# The bf16 weight-gradient kernel on one H200 (issue 17), results under $OUT (about 8 minutes):
#   OUT=$OUT bash benchmarks/run_wgrad.sh
# 1. wgrad_probe.py (skipped with PROBE=0): every accumulation method and Triton config at the layer's
#    shapes, checked against fp32; $OUT/wgrad_configs.json a table of the form the policy reads;
# 2. moe_layer.py --meshes local twice, side by side: with the single config of before (an empty table)
#    and with the committed dtensor_moe/kernels/wgrad_configs.json, bf16 and fp8, a profiled step each;
# 3. with TRACE=1, the DeepSeek-like bf16 layer's profiled step as a trace, its GPU idle gaps (trace_gaps.py).
set -uo pipefail
OUT=${OUT:-/tmp/wgrad_out}
source "$(dirname "$0")/device_env.sh"
[ "${PROBE:-1}" = 0 ] || (cd benchmarks && timeout "${PROBE_S:-230}" python3 wgrad_probe.py ${PROBE_SHAPES:+--shapes $PROBE_SHAPES} --out "$OUT/wgrad.json" --configs-out "$OUT/wgrad_configs.json") 2>&1 \
  | grep -v '^|' | tee -a "$LOG"
echo '{"configs": []}' > /tmp/empty_wgrad.json
for table in /tmp/empty_wgrad.json "$PWD/dtensor_moe/kernels/wgrad_configs.json"; do
  name=$(basename "$table" .json)
  DTENSOR_MOE_WGRAD_CONFIGS=$table timeout "${LAYER_S:-170}" python3 -m torch.distributed.run --standalone --nproc-per-node 1 \
    benchmarks/moe_layer.py --meshes local --precisions ${PRECISIONS:-bf16 fp8} --budget-s $((${LAYER_S:-170} - 30)) \
    --out "$OUT/layer_$name.json" 2>&1 | grep -v '^ ' | tee -a "$LOG"
done
if [ -n "${TRACE:-}" ]; then
  mkdir -p /tmp/trace
  timeout 120 python3 -m torch.distributed.run --standalone \
    --nproc-per-node 1 benchmarks/moe_layer.py --meshes local --shapes deepseek --iters 5 --trace-dir /tmp/trace \
    --out /tmp/trace/layer.json 2>&1 | grep -v '^ ' | tail -n 3 | tee -a "$LOG"
  python3 benchmarks/trace_gaps.py /tmp/trace/deepseek_local_rank0.json 2>&1 | tee -a "$LOG"
fi
