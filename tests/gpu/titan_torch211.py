"""torchtitan 0.3.0's Trainer with our hook (`--module dtensor_moe.titan`) on torch 2.11, through test-only shims.

torchtitan 0.3.0 asks for torch >= 2.13. Its modules that the Trainer, our hook and the DeepSeek-V3 debug model load
(partial_dtensor, the backend our hook requires) use four torch names torch 2.11.0 lacks, and two behaviours of
torch 2.13's FSDP2 that torch 2.11's lacks. Everything here is added only where torch lacks it (on torch >= 2.13
nothing), only in the processes this script starts; the library never imports this file.

Missing names (`install()`, before torchtitan is imported):
  torch.distributed.fsdp.DataParallelMeshDims   imported at module level by torchtitan/distributed/fsdp.py:13,
      full_dtensor.py:23 and models/deepseek_v3/mtp.py:15. On partial_dtensor only a type: our hook calls
      apply_fsdp_to_decoder with dp_mesh_dims=None, so no fully_shard call gets one. full_dtensor / spmd_types build
      one and pass it to fully_shard, whose torch 2.11 signature refuses it (TypeError). Shim: torch 2.13's
      dataclass, copied (fields, check, shard_names / replicate_names).
  torch.compiler._is_non_strict_tracing         models/common/token_dispatcher.py:259, 326, 354. torch 2.13 returns
      a flag set only inside make_fx's non-strict tracing (torch.export); elsewhere False. Shim: False, exact for
      training, eager or compiled (benchmarks/titan_anchor.py's shim).
  torch.nn.attention.flex_attention.create_block_mask(separate_full_blocks=)  models/common/decoder.py:274 (through
      attention.py:627's compiled create_block_mask; FlexAttention configs such as deepseek_v3_debugmodel).
      torch 2.11 takes no such keyword and always separates full blocks, which is what True (torchtitan's value
      outside its batch-invariant mode) asks. Shim: a wrapper taking the keyword, True -> torch 2.11's function,
      False -> NotImplementedError.
  torch.distributed.set_timeout                 distributed/utils.py:595, after step 1. Missing from torch 2.13 too;
      dtensor_moe/titan/trainer.py maps it to `_set_pg_timeout` (same signature, in torch 2.11). Also set here.

FSDP2 behaviours (after torchtitan is imported; `--shims names` leaves them out):
  `keep_lm_head_unsharded()`  torchtitan's ChunkedLossWrapper (every debug config's loss) calls lm_head.reshard()
      after its chunk loop; torch 2.11 then runs the final norm's backward on the freed unsharded norm.weight
      (SIGSEGV on CPU). Skipping that one reshard keeps the unit unsharded until FSDP's end-of-backward.
  `uniform_grad_dtype()`      with bf16 parameters that unit then reduce-scatters lm_head's fp32 accumulated
      gradient with the norm's bf16 one, which torch 2.11's foreach_reduce refuses; the bf16 one is cast to the
      reduce dtype first (what foreach_reduce does to every gradient anyway).
  Measured on CPU gloo ranks (2 ranks, EP2, 4 steps, from one seed checkpoint; tests/test_titan_torch211.py):
  fp32 parameters, torch 2.11 with these and torch 2.13 without: same losses and gradient norms to the printed
  digits; bf16 parameters: |dloss| <= 4e-5, gradient norms <= 2e-4 relative (bf16 accumulation order).

Not shimmed, not on our path: `torch.distributed.fsdp._fully_shard._fsdp_common.ShardPlacementResult`
(distributed/fsdp.py:261, torchtitan's own EP), `fully_shard(dp_mesh_dims=)` (fsdp.py:101, the VLM encoder;
full_dtensor), `PipelineStage(get_mesh=)` (distributed/pipeline_parallel.py:634: torchtitan's PP does not run on
torch 2.11), `FSDPModule.set_symm_mem_for_comm` (fsdp.py:51, --parallelism.enable_fsdp_symm_mem), `torch.Tag.inplace`
(overrides/fused_mla.py), spmd_types' `torch.distributed._mesh_layout._FlatLayout` (it falls back by itself).

gloo on GPUs (`--backend gloo --device cuda`): every rank on GPU 0 (CUDA_VISIBLE_DEVICES=0: torchtitan's
get_local_device then picks cuda:0), and three test-only adaptations, not torch APIs (`share_gpu_over_gloo()`): the
process group gets backend "gloo" (torchtitan asks nccl for cuda); FSDP reduces with SUM (gloo has no PREMUL_SUM;
the hook does the same on CPU, titan/parallelize_titan.py sum_reductions; torchtitan's divide factor is 1, so the same
values); torchtitan's metric and token-count reductions (distributed/utils.py _dist_reduce_tensor) use plain c10d
all_reduce, not functional collectives, which segfault on a gloo group with CUDA tensors on torch 2.11
(docs/parallelism.md). On CPU ranks these three change no logged digit. `--device cpu`: CPU ranks (use_cpu).

CLI: `python tests/gpu/titan_torch211.py --nproc N --backend nccl|gloo --out CASE.json [--steps 4] [--ep E]
[--device cuda|cpu] [--config NAME] [--seed DIR] [--ref OTHER.json] [--shims all|names|none] [--no-flex-autotune]
[-- TITAN FLAGS]`
runs torchrun with this file as every rank's entry (shims, then torchtitan.train.main) and writes {"name", "ranks",
"backend", "passed", "losses", "grad_norms", "checks", "titan_blocker", "log_tail", ...}. A failed run's first
traceback (torchrun's own skipped), else a rank's fatal signal, becomes titan_blocker: the missing torch API
and the torchtitan line that needs it.

Comparison: `--seed DIR` makes every case start from the same weights (a 1-rank run of the same config writes them
once, torchtitan's create_seed_checkpoint; the others load them), and `--ref` compares with another case on the same
ranks (same data-parallel degree, so the same batches), e.g. `--alone` (torchtitan alone: its own Trainer,
parallelize function and MoE, the GPU suite's reference) against the hook: every step's loss must agree up to bf16
rounding, |dloss| <= --ref-atol (0.02). Measured on CPU (fp32, 2 ranks, 4 steps): 0.0 at every step.
"""

import argparse
import inspect
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
GPU_CONFIG = "deepseek_v3_debugmodel"  # torchtitan's DeepSeek-V3 debug model (FlexAttention), our shipped data
CPU_CONFIG = "deepseek_v3_debugmodel_cpu"
LOSS_ATOL = 0.02  # bf16 runs from one seed: |dloss| at every step of a short run
# Packages whose versions decide an import failure on the device (carried wheels or the image's own).
VERSIONS = ("torch", "triton", "torchtitan", "spmd_types", "torch_checkpointing", "torchdata", "tyro", "datasets",
            "fsspec", "pyarrow", "huggingface_hub", "tokenizers", "numpy")


# ---- the shims -----------------------------------------------------------------------------------------------


@dataclass
class DataParallelMeshDims:
    """torch 2.13's torch.distributed.fsdp.DataParallelMeshDims: which dims of a full SPMD mesh are data
    parallel (FSDP shards over `shard`, HSDP replicates over `replicate`; a tuple of names is flattened)."""

    shard: str | tuple[str, ...] | None = None
    replicate: str | tuple[str, ...] | None = None

    def __post_init__(self):
        if self.shard is None and self.replicate is None:
            raise ValueError("At least one of shard or replicate must be set in DataParallelMeshDims")

    @property
    def shard_names(self) -> tuple[str, ...]:
        return () if self.shard is None else (self.shard,) if isinstance(self.shard, str) else tuple(self.shard)

    @property
    def replicate_names(self) -> tuple[str, ...]:
        if self.replicate is None:
            return ()
        return (self.replicate,) if isinstance(self.replicate, str) else tuple(self.replicate)


def _not_tracing() -> bool:
    """torch.compiler._is_non_strict_tracing outside torch 2.13's non-strict tracing context."""
    return False


def _block_mask_separating_full_blocks(create_block_mask):
    """torch 2.11's create_block_mask, taking torch 2.13's separate_full_blocks keyword: True is what torch 2.11
    always does (fully unmasked blocks kept apart, so kernels skip mask_mod there); False, which torchtitan asks
    for only in its batch-invariant mode, torch 2.11 cannot do."""

    def create_block_mask_211(mask_mod, B, H, Q_LEN, KV_LEN, device=None, BLOCK_SIZE=_SPARSE_BLOCK,
                              _compile=False, separate_full_blocks=True):
        if not separate_full_blocks:
            raise NotImplementedError("create_block_mask(separate_full_blocks=False) needs torch >= 2.13")
        return create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device, BLOCK_SIZE, _compile)

    create_block_mask_211.__doc__ = create_block_mask.__doc__
    return create_block_mask_211


_SPARSE_BLOCK = 128  # torch.nn.attention.flex_attention._DEFAULT_SPARSE_BLOCK_SIZE, both versions


def install() -> list[str]:
    """Adds the torch names torchtitan 0.3.0 needs on our path that this torch lacks; returns their names."""
    import torch.compiler
    import torch.distributed as dist
    import torch.distributed.fsdp as fsdp
    import torch.nn.attention.flex_attention as flex
    from torch.distributed.distributed_c10d import _set_pg_timeout

    assert flex._DEFAULT_SPARSE_BLOCK_SIZE == _SPARSE_BLOCK
    added = []
    if not hasattr(fsdp, "DataParallelMeshDims"):
        DataParallelMeshDims.__module__ = "torch.distributed.fsdp"
        fsdp.DataParallelMeshDims = DataParallelMeshDims
        added.append("torch.distributed.fsdp.DataParallelMeshDims")
    if not hasattr(torch.compiler, "_is_non_strict_tracing"):
        torch.compiler._is_non_strict_tracing = _not_tracing
        added.append("torch.compiler._is_non_strict_tracing")
    if not hasattr(dist, "set_timeout"):
        dist.set_timeout = _set_pg_timeout
        added.append("torch.distributed.set_timeout")
    if "separate_full_blocks" not in inspect.signature(flex.create_block_mask).parameters:
        flex.create_block_mask = _block_mask_separating_full_blocks(flex.create_block_mask)
        added.append("torch.nn.attention.flex_attention.create_block_mask(separate_full_blocks=True)")
    return added


def _torch_before_2_13() -> bool:
    import torch

    return tuple(int(x) for x in re.findall(r"\d+", torch.__version__)[:2]) < (2, 13)


def keep_lm_head_unsharded() -> bool:
    """torch < 2.13: torchtitan's ChunkedLossWrapper ends its chunk loop with `lm_head.reshard()`, which frees the
    unsharded parameters of lm_head's FSDP unit, fully_shard([norm, lm_head]) (components/loss.py). The decoder's
    backward then runs the final norm's backward, which reads norm.weight: torch 2.13's FSDP unshards the unit again
    first, torch 2.11's does not (it warns that the norm "did not run forward before backward") and the multiply
    reads freed storage (SIGSEGV on CPU; on CUDA an illegal access or garbage). Here that one reshard is skipped:
    the unit stays unsharded until FSDP's end-of-backward callback reshards it and reduce-scatters the norm's
    gradient. Memory only; on CPU from one seed checkpoint, torch 2.11 with this and torch 2.13 without it log the
    same losses and gradient norms (tests/test_titan_torch211.py's docstring has the numbers). Returns whether it
    patched."""
    if not _torch_before_2_13():
        return False
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.components.loss import ChunkedLossWrapper

    call = ChunkedLossWrapper.__call__

    def chunked_loss(self, *args, **kwargs):
        lm_head = self.lm_head
        if not isinstance(lm_head, FSDPModule):
            return call(self, *args, **kwargs)
        lm_head.reshard = _no_reshard  # an instance attribute: only ChunkedLossWrapper's own call sees it
        try:
            return call(self, *args, **kwargs)
        finally:
            del lm_head.reshard

    ChunkedLossWrapper.__call__ = chunked_loss
    return True


def _no_reshard() -> None:
    return None


def uniform_grad_dtype() -> bool:
    """torch < 2.13, bf16 parameters: in the same [norm, lm_head] unit, torch 2.11's FSDP reduce-scatters
    lm_head's gradient, accumulated over the loss chunks in the reduce dtype (float32) because the chunks before
    the last skip gradient sync, together with the norm's fresh bf16 gradient; foreach_reduce refuses mixed dtypes
    ("FSDP reduce-scatter expects uniform gradient dtype but got {torch.bfloat16, torch.float32}"). Here a
    parameter group that holds an accumulated gradient first moves its other fresh gradients into accumulated
    ones (FSDPParam.to_accumulated_grad_if_needed: the cast to the reduce dtype foreach_reduce applies anyway), so
    every gradient is reduced in float32 as before. Returns whether it patched."""
    if not _torch_before_2_13():
        return False
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    post_backward = FSDPParamGroup.post_backward

    def post_backward_uniform(self, *args, **kwargs):
        if self.reduce_grads:
            params = [p for p in self.fsdp_params if hasattr(p, "_unsharded_param")]
            if any(p.unsharded_accumulated_grad is not None for p in params):
                for p in params:
                    if p.unsharded_accumulated_grad is None:
                        p.to_accumulated_grad_if_needed()
        return post_backward(self, *args, **kwargs)

    FSDPParamGroup.post_backward = post_backward_uniform
    return True


def flex_without_autotune() -> bool:
    """--no-flex-autotune: torchtitan's FlexAttention compiles flex_attention with max_autotune and coordinate
    descent tuning (minutes of kernel benchmarking per process); this compiles it with inductor's default kernel
    choice instead. Speed only: the same attention, other tile sizes."""
    import torch
    from torch.nn.attention.flex_attention import flex_attention
    from torchtitan.models.common.attention import FlexAttention

    options = {**FlexAttention.inductor_configs, "max_autotune": False, "coordinate_descent_tuning": False}
    FlexAttention.inductor_configs = options
    FlexAttention._compiled_flex_attn = torch.compile(flex_attention, options=options)
    return True


def share_gpu_over_gloo() -> None:
    """Ranks sharing a GPU over gloo (module docstring): gloo process group, SUM reductions, c10d metrics."""
    import torch.distributed as dist
    import torchtitan.distributed.fsdp as titan_fsdp
    import torchtitan.distributed.utils as titan_utils
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    init = dist.init_process_group

    def init_gloo(*args, backend=None, **kwargs):
        return init(*args, backend="gloo", **{k: v for k, v in kwargs.items() if k != "device_id"})

    dist.init_process_group = init_gloo
    divide = titan_fsdp.disable_fsdp_gradient_division

    def sum_reductions(model):
        divide(model)
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_force_sum_reduction_for_comms(True)

    titan_fsdp.disable_fsdp_gradient_division = sum_reductions
    ops = {"SUM": dist.ReduceOp.SUM, "MAX": dist.ReduceOp.MAX, "AVG": dist.ReduceOp.SUM}  # gloo has no AVG

    def reduce_c10d(x, reduceOp, mesh, extra_pg):
        """torchtitan's _dist_reduce_tensor (a functional all_reduce over extra_pg, then over every dim of mesh)."""
        if isinstance(x, DTensor):
            x = x.to_local()
        x = x.detach().clone()
        groups = [extra_pg] if extra_pg is not None else []
        if isinstance(mesh, DeviceMesh):
            groups += [mesh.get_group(d) for d in range(mesh.ndim)]
        elif mesh is not None:
            groups.append(mesh)
        size = 1
        for group in groups:
            dist.all_reduce(x, op=ops[reduceOp], group=group)
            size *= dist.get_world_size(group)
        return x / size if reduceOp == "AVG" else x

    titan_utils._dist_reduce_tensor = reduce_c10d


def rank_main(backend: str, device: str, shims: str, titan_args: list[str]) -> None:
    """One torchrun rank: the shims (`shims`: all, names or none), then torchtitan's entry point on `titan_args`."""
    import torch

    added = install() if shims != "none" else []
    if device == "cpu":
        from dtensor_moe.titan.cpu import use_cpu

        use_cpu()
    elif backend == "gloo":
        assert torch.cuda.is_available(), "--device cuda needs a GPU"
        share_gpu_over_gloo()
    if shims == "all" and keep_lm_head_unsharded():
        added.append("ChunkedLossWrapper keeps lm_head unsharded (torch < 2.13 FSDP)")
    if os.environ.get("TITAN211_NO_FLEX_AUTOTUNE") and flex_without_autotune():
        added.append("FlexAttention compiled without max_autotune (--no-flex-autotune)")
    if shims == "all" and uniform_grad_dtype():
        added.append("FSDP reduces a group's mixed bf16/fp32 gradients in fp32 (torch < 2.13 FSDP)")
    if os.environ.get("RANK", "0") == "0":
        print(f"titan_torch211 shims: {added or 'none needed'}", flush=True)
    sys.argv = [sys.argv[0], *titan_args]
    from torchtitan.train import main

    main()


# ---- the failure ------------------------------------------------------------------------------------------

_TRACEBACK = "Traceback (most recent call last):"
_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+), in (\S+)')  # a traceback's frame
_FAULT_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+) in (\S+)')  # faulthandler's (no comma)
_EXC = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit|Failure)):\s?(.*)$")
_FATAL = re.compile(r"^Fatal Python error: (.+)$")
_RANK_PREFIX = re.compile(r"^\[(?:rank|default)\d+\]:")
_OURS = ("torchtitan", "dtensor_moe", "spmd_types", "torch_checkpointing", "torchdata")
_LAUNCHER = ("torch/distributed/run.py", "torch/distributed/launcher/", "<frozen runpy>")


def _strip(log: str) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", log)


def _lines(log: str) -> list[str]:
    return [_RANK_PREFIX.sub("", line) for line in _strip(log).splitlines()]


def _tracebacks(lines: list[str]):
    """Every traceback in `lines`, in order: (frames [(file, line, function, code)], exception type, message)."""
    i = 0
    while i < len(lines):
        if not lines[i].strip().endswith(_TRACEBACK):
            i += 1
            continue
        frames, i = [], i + 1
        while i < len(lines):
            m = _FRAME.match(lines[i])
            if m:
                nxt = lines[i + 1] if i + 1 < len(lines) else ""
                code = "" if _FRAME.match(nxt) or _EXC.match(nxt.strip()) else nxt.strip()
                frames.append((m.group(1), int(m.group(2)), m.group(3), code))
            elif frames and _EXC.match(lines[i].strip()):
                e = _EXC.match(lines[i].strip())
                yield frames, e.group(1), e.group(2)
                break
            elif lines[i].strip().endswith(_TRACEBACK):
                break
            i += 1
        else:
            if frames:
                yield frames, "", ""


def _launcher_only(frames) -> bool:
    """torchrun's own traceback (the agent's ChildFailedError), not a rank's."""
    return all(any(s in path.replace("\\", "/") for s in _LAUNCHER) or path.endswith("errors/__init__.py")
               for path, *_ in frames)


def _where(frames) -> str:
    """The innermost frame in torchtitan (or our hook, spmd_types, ...): the line that needs the API."""
    for path, line, func, code in reversed(frames):
        parts = path.replace("\\", "/").split("/")
        for i, part in enumerate(parts):
            if part in _OURS:
                return f"{'/'.join(parts[i:])}:{line} in {func}" + (f": {code}" if code else "")
    if frames:
        path, line, func, code = frames[-1]
        return f"{path}:{line} in {func}" + (f": {code}" if code else "")
    return "?"


def missing_api(message: str) -> str | None:
    """The name an ImportError / AttributeError / TypeError message says is missing, else None."""
    patterns = (
        (r"cannot import name '([\w.]+)' from '([\w.]+)'", lambda m: f"{m.group(2)}.{m.group(1)}"),
        (r"No module named '([\w.]+)'", lambda m: m.group(1)),
        (r"module '([\w.]+)' has no attribute '(\w+)'", lambda m: f"{m.group(1)}.{m.group(2)}"),
        (r"type object '([\w.]+)' has no attribute '(\w+)'", lambda m: f"{m.group(1)}.{m.group(2)}"),
        (r"'([\w.]+)' object has no attribute '(\w+)'", lambda m: f"{m.group(1)}.{m.group(2)}"),
        (r"([\w.]+)\(\) got an unexpected keyword argument '(\w+)'", lambda m: f"{m.group(1)}({m.group(2)}=...)"),
        (r"Unexpected optimization option ([\w.]+)", lambda m: f"torch._inductor.config.{m.group(1)}"),
    )
    for pattern, name in patterns:
        m = re.search(pattern, message)
        if m:
            return name(m)
    return None


def _fatal(lines: list[str]) -> str | None:
    """A rank's fatal signal (faulthandler's report): what, and the current thread's innermost torch frame and
    torchtitan (or hook) frame."""
    for i, line in enumerate(lines):
        m = _FATAL.match(line.strip())
        if not m:
            continue
        frames = []
        for j in range(i + 1, len(lines)):
            if lines[j].startswith("Current thread"):
                for k in range(j + 1, len(lines)):
                    f = _FAULT_FRAME.match(lines[k])
                    if not f:
                        break
                    frames.append((f.group(1), int(f.group(2)), f.group(3), ""))
                break
        frames.reverse()  # faulthandler lists the innermost first
        inner = f"{frames[-1][0]}:{frames[-1][1]} in {frames[-1][2]}" if frames else "no Python frame"
        return f"a rank crashed: {m.group(1)} in {inner}, called from {_where(frames)}"
    return None


def blocker(log: str, returncode: int) -> str | None:
    """What stopped the run: the missing torch API and where torchtitan needs it, else a rank's first exception,
    else a rank's fatal signal; None for a run that exited 0."""
    if returncode == 0:
        return None
    lines = _lines(log)
    for frames, exc_type, message in _tracebacks(lines):
        if _launcher_only(frames):
            continue
        api = missing_api(message)
        where = _where(frames)
        if api:
            into_torch = "/torch/" in frames[-1][0].replace("\\", "/")  # the call failed inside torch
            kind = "missing torch API" if api == "torch" or api.startswith("torch.") or into_torch else "missing"
            return f"{kind} {api} ({exc_type}: {message}), needed at {where}"
        return f"{exc_type}: {message} (at {where})"
    fatal = _fatal(lines)
    if fatal:
        return fatal
    signal = re.search(r"exitcode\s*:\s*-(\d+)", "\n".join(lines))
    if signal:
        return f"a rank died by signal {signal.group(1)} (see log_tail)"
    return f"exit status {returncode} without a traceback (see log_tail)"


# ---- the run ------------------------------------------------------------------------------------------------

_STEP = re.compile(r"step:\s+(\d+)\s+loss:\s+([-0-9.naif]+)\s+grad_norm:\s+([-0-9.naif]+)")


def parse_steps(log: str) -> tuple[list[float], list[float]]:
    """Losses and gradient norms by step, from torchtitan's step lines (rank 0's, the first of each step)."""
    steps = {}
    for s, loss, norm in _STEP.findall(_strip(log)):
        steps.setdefault(int(s), (float(loss), float(norm)))
    order = sorted(steps)
    return [steps[s][0] for s in order], [steps[s][1] for s in order]


def _versions() -> dict:
    from importlib import metadata

    out = {}
    for name in VERSIONS:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def _launch(args, nproc: int, titan: list[str], timeout: float) -> tuple[str, int, float]:
    """torchrun of `nproc` ranks, each this file's rank_main; returns (stdout + stderr, exit status, seconds)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           os.path.abspath(__file__), "--rank", args.backend, args.device, args.shims, *titan]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    if args.device == "cuda" and args.backend == "gloo":
        env["CUDA_VISIBLE_DEVICES"] = env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    if not args.flex_autotune:
        env["TITAN211_NO_FLEX_AUTOTUNE"] = "1"
    t0 = time.time()
    with tempfile.TemporaryFile("w+") as out:
        # Its own session: at the deadline torchrun gets SIGTERM (it stops its ranks), then the group SIGKILL, so no
        # rank is left holding a GPU.
        proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
                try:
                    os.killpg(proc.pid, sig)
                    proc.wait(timeout=wait)
                    break
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    continue
            rc = 124
            out.write(f"\n[titan_torch211] timed out after {timeout} s")
        out.seek(0)
        log = out.read()
    return log, rc, round(time.time() - t0, 1)


def _seed_flags(args, config: str) -> tuple[list[str], str | None]:
    """--seed DIR: the initial weights every case loads, written once by a 1-rank run of the same config (model
    only, torchtitan's create_seed_checkpoint). Returns the flags that load it and the failure, if any."""
    if not args.seed:
        return [], None
    step0 = os.path.join(args.seed, "checkpoint", "step-0")
    if not os.path.isdir(step0):  # no forward runs: a short deadline
        write = ["--module", "dtensor_moe.titan", "--config", config, "--dump_folder", args.seed, "--debug.seed", "0",
                 "--checkpoint.enable", "--checkpoint.create_seed_checkpoint", "--checkpoint.last_save_model_only"]
        log, rc, _ = _launch(args, 1, write, min(args.timeout, 150))
        if rc != 0 or not os.path.isdir(step0):
            return [], f"writing the seed checkpoint: {blocker(log, rc or 1)}"
    return ["--checkpoint.enable", "--checkpoint.initial_load_path", step0, "--checkpoint.load_only"], None


def run_case(args) -> dict:
    device = args.device
    config = args.config or (GPU_CONFIG if device == "cuda" else CPU_CONFIG)
    ep = args.nproc if args.ep is None else args.ep
    name = args.name or (f"torchtitan alone {config} {args.backend} {device} x{args.nproc}" if args.alone else
                         f"titan-torch211 {config} {args.backend} {device} x{args.nproc} ep{ep}")
    seed, found = _seed_flags(args, config)
    log, rc, seconds = "", 1, 0.0
    if found is None:
        if args.alone:  # torchtitan's own Trainer, parallelize and MoE (benchmarks/titan_e2e.py's e2e_titan)
            os.environ["TITAN_E2E_MODEL"] = config
            module = ["--module", "benchmarks.titan_e2e", "--config", "e2e_titan"]
        else:
            module = ["--module", "dtensor_moe.titan", "--config", config, "--dtensor_moe.ep", str(ep)]
        titan = [*module, "--dump_folder", tempfile.mkdtemp(prefix="t211_"), "--training.steps", str(args.steps),
                 "--debug.seed", "0", "--metrics.log_freq", "1", *seed, *args.titan_args]
        log, rc, seconds = _launch(args, args.nproc, titan, args.timeout)
        found = blocker(log, rc)  # None for a run that exited 0: a traceback it logged is no blocker
        if rc == 124:
            last = [line for line in _lines(log) if " - INFO - " in line][-1:] or ["(no log line)"]
            found = f"timed out after {args.timeout:.0f} s; last log line: {last[0].strip()}"
    if args.log:
        with open(args.log, "w") as f:
            f.write(log)
    losses, norms = parse_steps(log)
    if found is None and len(losses) != args.steps:
        found = f"exit status {rc} after {len(losses)} of {args.steps} steps (see log_tail)"
    shims = re.search(r"titan_torch211 shims: (.*)", log)
    checks = {"steps_logged": len(losses) == args.steps,
              "finite": all(math.isfinite(x) for x in losses + norms),
              "loss_falls": len(losses) >= 2 and losses[-1] < losses[0]}
    judged = [checks["steps_logged"], checks["finite"]]
    if args.ref:
        with open(args.ref) as f:
            ref = json.load(f)
        ref_losses = ref.get("losses") or []
        diffs = [round(abs(a - b), 6) for a, b in zip(losses, ref_losses)]
        same_start = bool(args.seed) and ref.get("seed_checkpoint") == args.seed  # the same initial weights
        checks["ref"] = {"name": ref["name"], "losses_ref": ref_losses, "loss_abs_diffs": diffs,
                         "atol": args.ref_atol, "judged": same_start,
                         "agree": len(diffs) == args.steps and max(diffs) <= args.ref_atol}
        if same_start:
            judged.append(checks["ref"]["agree"])
    passed = rc == 0 and found is None and all(judged)
    return {"name": name, "ranks": args.nproc, "backend": args.backend, "device": device, "config": config, "ep": ep,
            "steps": args.steps, "seed_checkpoint": args.seed, "versions": _versions(), "shims_asked": args.shims,
            "shims": shims.group(1) if shims else None, "passed": passed, "returncode": rc, "seconds": seconds,
            "losses": losses, "grad_norms": norms, "checks": checks, "titan_blocker": found,
            "log_tail": _strip(log)[-args.tail:]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, required=True, help="local ranks (nccl: one a GPU; gloo: they share GPU 0)")
    ap.add_argument("--backend", choices=("nccl", "gloo"), required=True)
    ap.add_argument("--out", required=True, help="the case's JSON")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--ep", type=int, default=None, help="--dtensor_moe.ep (default: --nproc)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda where torch sees one")
    ap.add_argument("--config", default=None, help=f"default: {GPU_CONFIG} on cuda, {CPU_CONFIG} on cpu")
    ap.add_argument("--ref", default=None, help="another case's JSON to compare the losses with")
    ap.add_argument("--ref-atol", type=float, default=LOSS_ATOL, help="|dloss| allowed at every step against --ref")
    ap.add_argument("--alone", action="store_true", help="torchtitan alone: its own Trainer and MoE, not the hook "
                    "(the reference for --ref; needs --config to be a torchtitan config function)")
    ap.add_argument("--seed", default=None, help="a folder: every case starts from the weights saved there (written "
                    "by the first case that names it)")
    ap.add_argument("--shims", choices=("all", "names", "none"), default="all",
                    help="all: the missing names and the FSDP fixes; names: the missing names only; none: neither")
    ap.add_argument("--no-flex-autotune", dest="flex_autotune", action="store_false",
                    help="compile FlexAttention without max_autotune (faster start, same attention)")
    ap.add_argument("--name", default=None)
    ap.add_argument("--log", default=None, help="also write the whole log here")
    ap.add_argument("--timeout", type=float, default=480)
    ap.add_argument("--tail", type=int, default=4000, help="characters of the log kept in log_tail")
    ap.add_argument("titan_args", nargs="*", help="after --: more torchtitan flags")
    args = ap.parse_args(argv)
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cpu" and args.backend == "nccl":
        ap.error("--backend nccl needs --device cuda")
    case = run_case(args)
    with open(args.out, "w") as f:
        json.dump(case, f, indent=1)
    ref = case["checks"].get("ref", {})
    print(json.dumps({**{k: case[k] for k in ("name", "passed", "losses", "grad_norms", "titan_blocker", "seconds")},
                      "ref_loss_abs_diffs": ref.get("loss_abs_diffs")}), flush=True)
    return 0 if case["passed"] else 1


if __name__ == "__main__":
    if len(sys.argv) > 4 and sys.argv[1] == "--rank":
        rank_main(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5:])
    else:
        sys.exit(main())
