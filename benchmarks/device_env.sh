# Sourced by the device scripts (fp8_loss_check.sh) after they set OUT: the run's folder, environment
# and log, headed by the GPU, driver, torch, CUDA and Triton versions.
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
LOG=$OUT/run.log
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"; } 2>&1 | tee "$LOG"
