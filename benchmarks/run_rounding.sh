#!/usr/bin/env bash
# Issue 27 items 3-5 on ONE GPU, results under $OUT, in two parts of under 10 minutes each on an H200:
#   OUT=$OUT bash benchmarks/run_rounding.sh layer   # the layer: dropless vs round_tokens_to=128 (+ FP8), torchtitan
#     (ROUNDS="0", "128" or "" runs one, the other or neither of our passes; TITAN=0 TITAN_LOG=file skips torchtitan, reading its log)
#   OUT=$OUT bash benchmarks/run_rounding.sh train   # the 1-GPU job: quality over seeds, tokens/s per option
#   OUT=$OUT bash benchmarks/run_rounding.sh gemms   # tools/tune/expert_gemms.py: every GEMM bf16 vs FP8, gate /
#                                                    # up fused or per half (the table kernels/policy.py reads),
#                                                    # then ragged_gemm_probe.py (64-row tail tiles), ~4 minutes
#   OUT=$OUT bash benchmarks/run_rounding.sh wgrad   # tools/tune/wgrad_probe.py at DeepSeek-like and Mixtral-like:
#                                                    # every way to add a weight gradient into .grad (the layer's
#                                                    # largest term)
# layer: torchtitan 0.3.0 EP=1 (titan_anchor.py) and our layer unparallelized (moe_layer.py --meshes local), fed the
#   same per-token choices (topk: ragged counts; skewed: Zipf $ZIPF); ours once dropless and once with every
#   expert's rows rounded to a multiple of 128 (bf16 and FP8). torchtitan's columns are its dropless run on the
#   same choices: it has no rounding. Writes layer_dropless.json, layer_round128.json.
# train: configs/gpu_2x.toml on 1 GPU (ep 1), 200 steps, seeds $SEEDS (default 0 1 2): top-k bf16, rounding 128 bf16,
#   rounding 128 FP8 (every expert GEMM forced to FP8, as fp8_loss_check.sh does); then seed 0 compiled, with and
#   without rounding. Writes train_rounding.json: mean last-10 loss per option over the seeds, tokens/s per option.
# Needs the carried wheels in .whl/ (torchtitan 0.3.0 and its small deps) for the baseline.
set -uo pipefail
OUT=${OUT:-/tmp/rounding_out}
source "$(dirname "$0")/device_env.sh"
RUN=(python3 -m torch.distributed.run --standalone --nproc-per-node 1)
if [ "${1:-layer}" = gemms ]; then
  timeout 300 python3 tools/tune/expert_gemms.py --out "$OUT/expert_gemms.json" 2>&1 | tee -a "$LOG"
  timeout 240 python3 benchmarks/ragged_gemm_probe.py --out "$OUT/ragged_gemm_probe.json" 2>&1 | tee -a "$LOG"
  exit 0
fi
if [ "${1:-layer}" = wgrad ]; then  # accumulating weight gradients, incl. cuBLAS baddbmm over padded rows, ~3 minutes
  (cd tools/tune && timeout 400 python3 wgrad_probe.py --shapes ${WGRAD_SHAPES:-deepseek mixtral e64 qwen} --out "$OUT/wgrad_probe.json" \
    --configs-out "$OUT/wgrad_configs.json") 2>&1 \
    | tee -a "$LOG"
  exit 0
fi
if [ "${1:-layer}" = layer ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PYTHONPATH
  MODES=(--routing topk skewed --zipf "${ZIPF:-1.2}")
  for s in "7168 2048 256 8 8192" "2048 768 128 8 16384" "4096 14336 8 2 8192" "4096 1536 64 6 16384"; do
    [ "${TITAN:-1}" = 1 ] || break  # TITAN=0: a second call reuses the first one's titan.log (TITAN_LOG)
    # shellcheck disable=SC2086  # the shape is four arguments
    OMP_NUM_THREADS=8 timeout 100 "${RUN[@]}" benchmarks/titan_anchor.py $s "${ITERS:-10}" "${MODES[@]}" 2>&1 \
      | tee -a "$OUT/titan.log" | grep titan0 || echo "titan EP=1 failed: $s" | tee -a "$LOG"
  done
  for m in ${ROUNDS-0 128}; do
    name=$([ "$m" = 0 ] && echo dropless || echo "round$m")
    precisions=$([ "$m" = 0 ] && echo bf16 || echo "bf16 fp8")
    profile=$([ "$m" = 0 ] && echo local)  # the dropless step's top kernels: where the non-GEMM time goes
    # shellcheck disable=SC2086  # the precisions are words
    timeout 260 "${RUN[@]}" benchmarks/moe_layer.py --meshes local --profile-meshes $profile --gemm-timing \
      --iters "${ITERS:-10}" "${MODES[@]}" --precisions $precisions --round-tokens-to "$m" \
      --titan-log "${TITAN_LOG:-$OUT/titan.log}" --out "$OUT/layer_$name.json" 2>&1 | tee -a "$LOG" | grep '^|' \
      || echo "moe_layer.py --round-tokens-to $m failed" | tee -a "$LOG"
  done
  exit 0
fi
FORCE=/tmp/fp8_everywhere.json
python3 - "$FORCE" <<'PY'
import json, sys
gemms = [{"shape": "gpu_2x", "gemm": g, "I": I, "O": O, "E": 16, "rows_per_expert": 4096.0, "bf16_tflops": 1.0,
          "fp8_tflops": 2.0} for g in ("fwd", "dgrad", "wgrad", "wgrad_acc") for I, O in ((1024, 2048), (2048, 1024))]
json.dump({"note": "forces FP8 for every expert GEMM of configs/gpu_2x.toml", "gemms": gemms}, open(sys.argv[1], "w"))
PY
mkdir -p /tmp/runs
# A signal to this script stops its training runs too (TOGETHER's run in the background; each launcher stops its
# ranks on SIGTERM), so none is left behind.
trap 'pkill -TERM -f "dtensor_moe.cli train --config configs/gpu_2x.toml --run-dir /tmp/runs/"; exit 143' INT TERM
run() {  # name, seed, extra environment, overrides...; its summary line joins /tmp/runs/summary.jsonl at once, so a
  local name=$1 seed=$2 envs=$3  # call cut at its time limit keeps the runs it finished
  shift 3
  env $envs timeout "$RUN_LIMIT" python3 -m dtensor_moe.cli train --config configs/gpu_2x.toml --run-dir "/tmp/runs/${name}_s$seed" \
    parallel.nproc=1 parallel.ep=1 training.steps=200 training.seed="$seed" "$@" 2>&1 | grep -v 'step/s' | tail -n 9 \
    | tee -a "$LOG"
  python3 - "/tmp/runs/${name}_s$seed" "$name" "$seed" "$AT_ONCE" <<'PY' >>/tmp/runs/summary.jsonl
import json, statistics, sys
rows = [json.loads(line) for line in open(f"{sys.argv[1]}/metrics.jsonl")]
print(json.dumps({"option": sys.argv[2], "seed": int(sys.argv[3]), "runs_at_once": int(sys.argv[4]),
                  "steps": len(rows), "final_loss": rows[-1]["loss"],
                  "last10_mean_loss": statistics.mean(r["loss"] for r in rows[-10:]),
                  "median_tokens_per_s": statistics.median(r["tokens_per_s"] for r in rows[4:])}))
PY
  cp /tmp/runs/summary.jsonl "$OUT/train_runs.jsonl"
}
# OPTIONS: which of topk, round128, round128_fp8 (each over SEEDS) and compiled (seed 0, with and without rounding)
# run; nine eager runs fill one 10-minute device call, so a second call (same machine) runs OPTIONS=compiled.
# TOGETHER=1: a seed's eager options train side by side on the GPU (their losses count, not their tokens/s: the
# summary's tokens/s are of runs that had the GPU alone), so that three seeds' quality check fits one call.
OPTIONS=" ${OPTIONS:-topk round128 round128_fp8 compiled} "
AT_ONCE=1 RUN_LIMIT=150 BG=""
[ "${TOGETHER:-0}" = 1 ] && AT_ONCE=$(grep -ow -E 'topk|round128|round128_fp8' <<<"$OPTIONS" | wc -l) RUN_LIMIT=300 BG="&"
for seed in ${SEEDS:-0 1 2}; do  # interleaved, so that a drift of the GPU over the minutes falls on no one option
  [[ $OPTIONS == *" topk "* ]] && eval run topk "$seed" '""' "$BG"
  [[ $OPTIONS == *" round128 "* ]] && eval run round128 "$seed" '""' moe_run.round_tokens_to=128 "$BG"
  [[ $OPTIONS == *" round128_fp8 "* ]] && eval run round128_fp8 "$seed" "DTENSOR_MOE_FP8_RATES=$FORCE" \
    moe_run.round_tokens_to=128 moe_run.expert_precision=fp8 "$BG"
  wait
done
AT_ONCE=1 RUN_LIMIT=150
if [[ $OPTIONS == *" compiled "* ]]; then
  run topk_compiled 0 "" training.compile=true
  run round128_compiled 0 "" training.compile=true moe_run.round_tokens_to=128
fi
python3 - "$OUT/train_rounding.json" <<'PY' 2>&1 | tee -a "$LOG"
import json, statistics, sys
runs = [json.loads(line) for line in open("/tmp/runs/summary.jsonl")]  # this machine's runs, every call
res = {"runs": runs}
for p in ("topk", "round128", "round128_fp8", "topk_compiled", "round128_compiled"):
    mine = [r for r in runs if r["option"] == p]
    if mine:
        alone = [r["median_tokens_per_s"] for r in mine if r.get("runs_at_once", 1) == 1]
        res[p] = {"last10_mean_loss": statistics.mean(r["last10_mean_loss"] for r in mine), "seeds": len(mine),
                  "median_tokens_per_s": statistics.mean(alone) if alone else None, "runs_alone": len(alone)}
for p in ("round128", "round128_fp8"):
    if p in res and "topk" in res:
        res[f"{p}_over_topk_last10_loss"] = res[p]["last10_mean_loss"] / res["topk"]["last10_mean_loss"]
json.dump(res, open(sys.argv[1], "w"), indent=1)
print(json.dumps({k: v for k, v in res.items() if k != "runs"}, indent=1))
PY
