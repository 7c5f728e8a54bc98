#!/usr/bin/env bash
# The whole GPU benchmark on the 2-GPU machine (torchtitan baseline, moe_layer.py, memory.py), and the 2-GPU
# check tests/gpu/gpu_parity.py, results under $OUT:
#   bash benchmarks/run_gpu.sh
# TITAN_EP1=1 adds the 1-GPU torchtitan runs (~30 s each; the "local" rows' baseline); MOE_LAYER_ARGS replaces moe_layer.py's
# extra arguments (default: stop starting new layers after 240 s, so the whole run fits in 10 minutes).
# Needs the carried wheels in .whl/ (torchtitan 0.3.0 and its small deps) for the baseline.
set -euo pipefail
OUT=${OUT:-/tmp/bench_out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
LOG=$OUT/run.log
run() { python3 -m torch.distributed.run --standalone --nproc-per-node "$@"; }
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv; nvidia-smi topo -m
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"; } 2>&1 | tee "$LOG"
SHAPES=("7168 2048 256 8 8192" "2048 768 128 8 16384" "4096 14336 8 2 8192" "4096 1536 64 6 16384")
for s in "${SHAPES[@]}"; do
  OMP_NUM_THREADS=8 run 2 benchmarks/titan_anchor.py $s 20 2>&1 | tee -a "$OUT/titan.log" | grep titan0 || echo "titan EP=2 failed: $s" | tee -a "$LOG"
  if [ "${TITAN_EP1:-0}" = 1 ]; then
    OMP_NUM_THREADS=8 run 1 benchmarks/titan_anchor.py $s 20 2>&1 | tee -a "$OUT/titan.log" | grep titan0 || echo "titan EP=1 failed: $s" | tee -a "$LOG"
  fi
done
run 2 benchmarks/moe_layer.py --titan-log "$OUT/titan.log" --out "$OUT/moe_layer.json" ${MOE_LAYER_ARGS:---budget-s 240} 2>&1 | tee -a "$LOG" || echo "moe_layer.py failed" | tee -a "$LOG"
# EP-only vs EDP-only peaks; the EP+EDP byte target needs 4 ranks and runs on CPU (see RESULTS.md).
run 2 benchmarks/memory.py --out "$OUT/memory_gpu2.json" 2>&1 | tee -a "$LOG"
run 2 tests/gpu/gpu_parity.py > "$OUT/gpu_parity.txt" 2>&1 || echo "gpu_parity.py failed" | tee -a "$LOG"
grep -v Warn "$OUT/gpu_parity.txt" | tail -n 8 | tee -a "$LOG"
