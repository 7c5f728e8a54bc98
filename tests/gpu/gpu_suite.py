"""The GPU suite: every way to use dtensor_moe run on the GPU, several ranks included, each against a
one-process reference on the same GPU and inputs (outputs and every gradient, or every step's loss), and the
one-GPU check scripts beside this file. The one command for every check that needs one GPU:

    python tests/gpu/gpu_suite.py                                  # the GPU machine: writes gpu_suite.json
    python tests/gpu/gpu_suite.py --only 'layer_ep2*' 'hf_*'       # some cases (fnmatch patterns)
    python tests/gpu/gpu_suite.py --device cpu --only layer_ep2_fp32 --out /tmp/s.json   # CPU smoke

One GPU serves several ranks: they share it over gloo, which carries CUDA tensors through the host (NCCL
refuses two ranks on one GPU); one-rank cases run over NCCL. Timings of shared-GPU runs mean nothing here,
correctness does. What each case covers is its `covers` line; the groups:
  check_*  the check scripts gpu_ops_check.py (every registered op through torch.library.opcheck, the Triton
           kernels at ragged counts) and gpu_pad_check.py (pad_to_capacity: no host sync, compiled equal to
           eager), each in a process of its own; CUDA only;
  layer_*  `parallelize_moe` over the parity draw's foldings (EP, ETP, EDP/FSDP2, HSDP, TP+SP, CP), fp32 and
           bf16, FP8 experts and payload, compile, replicas, token rounding, routing replay, capacity padding,
           in-GEMM gradient accumulation: tests/parity.py's check on the GPU (ownership of every slice, output,
           input and every weight gradient, balance statistics), relative to the reference's largest value;
  main_*   the main job (`dtensor-moe train`) on 4 ranks with `--parity` (the 1-process run's losses), PP,
           bf16 + selective AC + FP8, compile, and a Hugging Face checkpoint trained, `export --hf` and loaded
           by transformers' `from_pretrained`;
  hf_*     Hugging Face models trained directly (`parallelize_hf_model`, the four families), EP2 over gloo and
           one rank over NCCL, against transformers' own model trained in this process (tests/test_hf_train.py);
  titan_*  the torchtitan hook (tests/gpu/titan_torch211.py; its `titan_blocker` when it cannot run).
Writes {"date", "torch", "device", "seconds", "cases": [{"name", "covers", "ranks", "backend", "passed",
"max_rel_err", "tol", "seconds", "error"?}], "titan_blocker"} and prints a line per case.

Two GPUs, not run here: `torchrun --nproc-per-node 2 tests/gpu/gpu_parity.py` (parallelize_moe in bf16 over NCCL,
one rank a GPU, against an fp32 reference; benchmarks/run_gpu.sh runs it too).
"""

import argparse
import fnmatch
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from datetime import datetime, timezone

import titan_torch211  # noqa: E402  (its traceback reader; imports no torchtitan)
from _checkout import ROOT  # noqa: E402  (tests/, the references, and dtensor_moe from this checkout)

HERE = os.path.dirname(os.path.abspath(__file__))

os.environ.setdefault("DTENSOR_MOE_TEST_TIMEOUT", "240")  # a hung case fails in minutes, not the harness's 10
os.environ.setdefault("DTENSOR_MOE_TEST_ERROR_GRACE", "30")

import torch  # noqa: E402

from dtensor_moe.train.metrics import write_json  # noqa: E402

# Relative to the reference's largest magnitude: fp32 differs only by summation order; bf16 by its 8 bits of
# mantissa over a few GEMMs; FP8 by e4m3's 3 (the reference quantizes too, but other row blocks under EP).
TOL = {"float32": 1e-4, "bfloat16": 3e-2, "fp8": 0.15}


@dataclass(frozen=True)
class SuiteCase:
    name: str
    covers: str
    ranks: int
    backend: str  # "gloo" (ranks share the GPU), "nccl" (one rank a GPU) or "none" (a check script's own process)
    run: object  # () -> {"max_rel_err", "tol", ...}
    # Runs in a process of its own (this script with --case): it uses the GPU in the calling process, where a
    # CUDA error would leave every later case a broken context.
    isolated: bool = False


# --- the check scripts beside this file ---------------------------------------------------------------------------


def check_cases(run_root: str) -> list[SuiteCase]:
    return [
        SuiteCase("check_gpu_ops", "gpu_ops_check.py: every registered op's CUDA implementation through "
                  "torch.library.opcheck, the Triton paths against torch's, the weight-gradient kernel's configs at "
                  "ragged counts, an empty expert, partial tiles and unaligned rows", 1, "none",
                  lambda: _check_script("gpu_ops_check.py")),
        SuiteCase("check_gpu_pad", "gpu_pad_check.py: pad_to_capacity against the unpadded layer, no host sync in its "
                  "forward and backward, compiled equal to eager; the FP8 payload's pack / unpack", 1, "none",
                  lambda: _check_script("gpu_pad_check.py", os.path.join(run_root, "gpu_pad_check.json"))),
    ]


def _check_script(script: str, out: str | None = None) -> dict:
    """`script` in a process of its own (a CUDA error there leaves this one's context whole). It asserts its own
    tolerances, so it passes on exit status 0; `out`: the JSON it writes (--out), kept in the row."""
    proc = subprocess.run([sys.executable, os.path.join(HERE, script), *(["--out", out] if out else [])], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"{script} exited with status {proc.returncode}: {(proc.stdout + proc.stderr)[-1500:]}")
    return {"max_rel_err": 0.0, "tol": 0.0, **({"result": json.load(open(out))} if out else {})}


# --- layer: tests/parity.py's check on the GPU -------------------------------------------------------------------


def layer_cases(device: str) -> list[SuiteCase]:
    from dtensor_moe import MoERunOptions
    from tests.parity import Case, moe_config

    def layer(name, covers, world, tol_key, **case):
        precision = dict(dtype="float32") if tol_key == "float32" else dict(dtype="float32", compute_dtype="bfloat16")
        return SuiteCase(f"layer_{name}", covers, world, "gloo",
                         lambda: _layer_parity(world, Case(device=device, **precision, **case), TOL[tol_key]))

    def cfg(**kw):  # big enough for the CUDA GEMMs' tiles, small enough for seconds a case
        return moe_config(**{"num_experts": 8, "top_k": 2, "dim": 64, "hidden_dim": 128, **kw})

    seq = dict(batch_per_rank=(2, 3, 1, 2), seq_len=32)
    two = dict(batch_per_rank=(2, 3), seq_len=32)
    return [
        layer("ep2_fp32", "EP2: all-to-all over gloo, host-read split sizes, grouped GEMMs on dispatched ragged counts",
              2, "float32", ep=2, moe=cfg(num_shared_experts=1, load_balance="aux_loss"), **two),
        layer("ep2_bf16", "EP2 in bf16 (the CUDA grouped GEMM), sigmoid routing, aux-free bias", 2, "bfloat16", ep=2,
              moe=cfg(score_func="sigmoid", load_balance="aux_free_bias"), **two),
        layer("etp2_bf16", "ETP2: expert hidden dim sharded, gather / reduce-scatter of rows", 2, "bfloat16", etp=2,
              moe=cfg(), **two),
        layer("ep2_etp2_bf16", "EP2 x ETP2 on 4 ranks, seq aux and z losses", 4, "bfloat16", ep=2, etp=2,
              moe=cfg(load_balance="aux_loss", seq_aux_loss_coeff=0.3, z_loss_coeff=0.01), **seq),
        layer("edp2_ep2_fp32", "EDP2 x EP2: experts FSDP2-sharded over EDP, two microbatches (gradients add into "
              ".grad)", 4, "float32", ep=2, moe=cfg(), microbatches=2, **seq),
        layer("hsdp2_ep2_bf16", "HSDP: dp_replicate 2 x EP2, shared expert", 4, "bfloat16", dp_replicate=2, ep=2,
              moe=cfg(num_shared_experts=1), **seq),
        layer("tp2_ep2_fp32", "dense TP2 (sequence-parallel input) x EP2", 4, "float32", tp=2, ep=2,
              moe=cfg(load_balance="aux_loss", seq_aux_loss_coeff=0.3), batch_per_rank=(2, 3), seq_len=32),
        layer("cp2_ep2_fp32", "CP2 (each rank part of every sequence) x EP2", 4, "float32", cp=2, ep=2,
              moe=cfg(load_balance="aux_loss", seq_aux_loss_coeff=0.3), batch_per_rank=(2, 3), seq_len=32),
        layer("ep4_fp8_experts", "FP8 experts (e4m3 rowwise GEMMs where the policy runs them) under EP4", 4, "fp8",
              ep=4, moe=cfg(dim=128, hidden_dim=256), run=MoERunOptions(expert_precision="fp8"), **seq),
        layer("ep4_fp8_payload", "FP8 dispatch payload (e4m3 rows + a scale per row through the all-to-all), EP4", 4,
              "fp8", ep=4, moe=cfg(dim=128, hidden_dim=256),
              run=MoERunOptions(dispatch_precision="fp8"), **seq),
        layer("ep2_compiled", "torch.compile (inductor, Triton on CUDA) of the EP2 layer, one fullgraph graph", 2,
              "bfloat16", ep=2, compile=True, moe=cfg(), **two),
        layer("ep2_replicas", "hot-expert replicas (expert_replicas 1) with every token on one expert, EP2", 2,
              "bfloat16", ep=2, hot_expert=3, moe=cfg(), run=MoERunOptions(expert_replicas=1), **two),
        layer("ep2_token_rounding", "tile-aware token rounding (round_tokens_to 16), EP2", 2, "bfloat16", ep=2,
              moe=cfg(), run=MoERunOptions(round_tokens_to=16), **two),
        layer("ep2_routing_replay", "routing replay: no-grad eval forwards record, the training forwards replay", 2,
              "bfloat16", ep=2, replay=True, moe=cfg(), **two),
        layer("ep2_capacity_padded", "capacity 1.0 padded to capacity (static splits, pair-wise all-to-all), EP2", 2,
              "bfloat16", ep=2, moe=cfg(),
              run=MoERunOptions(capacity_factor=1.0, pad_to_capacity=True), batch_per_rank=(2, 2),
              seq_len=32),
        # The layers above keep the default minimal activations (received rows + H; the routing weights' gradient
        # from the down projection's input gradient); the reference keeps the standard ones. float32 here: in bf16
        # the clamped gate's limit (1.0) flips between the two sides' roundings and either path misses its
        # reference by that much (w13's gradient 0.40 off on one H200).
        layer("ep2_etp2_gpt_oss_fp32", "EP2 x ETP2, gpt-oss biases and clamped gate, two microbatches", 4, "float32",
              ep=2, etp=2, microbatches=2, moe=cfg(expert_biases=True, activation="clamped_swiglu"), **seq),
        layer("ep2_etp2_standard_bf16", "activation_memory standard (every intermediate kept) under EP2 x ETP2, "
              "gpt-oss biases (silu gate)", 4, "bfloat16", ep=2, etp=2,
              moe=cfg(expert_biases=True),
              run=MoERunOptions(activation_memory="standard"), **seq),
        layer("ep2_compiled_standard", "activation_memory standard compiled (inductor, fullgraph), EP2", 2,
              "bfloat16", ep=2, compile=True, moe=cfg(load_balance="aux_loss"),
              run=MoERunOptions(activation_memory="standard"), **two),
        layer("ep2_accumulate_wgrad", "EP2, D512 F1024, three microbatches: the weight-gradient kernels add into "
              ".grad on dispatched counts", 2, "bfloat16", ep=2, microbatches=3,
              moe=cfg(dim=512, hidden_dim=1024, num_shared_experts=1), **two),
    ]


def _layer_parity(world: int, case, tol: float) -> dict:
    from tests.harness import run_on_ranks
    from tests.parity import check_parity

    per_rank = run_on_ranks(world, check_parity, case)
    worst = {k: max(r[k] for r in per_rank) for k in per_rank[0]}
    key = max(worst, key=lambda k: worst[k])
    return {"max_rel_err": worst[key], "worst": key, "tol": tol, "compared": len(worst)}


# --- the main job ------------------------------------------------------------------------------------------------


def _cli(args: list[str], timeout_s: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dtensor_moe.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout_s)


def _checked(proc: subprocess.CompletedProcess) -> str:
    if proc.returncode != 0:  # the ranks' own exceptions first: torchrun's report that follows them names none
        log = proc.stdout + proc.stderr
        raised = [line.strip() for line in log.splitlines()
                  if re.search(r"\w(Error|Exception): ", line) and "ChildFailedError" not in line]
        # The first rank's traceback: our innermost frame and the line that raised (inside torch, perhaps); a bare
        # "ZeroDivisionError" names no place.
        where = titan_torch211.blocker(log, proc.returncode)
        first = next(titan_torch211._tracebacks(titan_torch211._lines(log)), None)
        if first and first[0]:
            path, line, func, _ = first[0][-1]
            where += f", raised at {path}:{line} in {func}"
        raise RuntimeError(f"rc {proc.returncode}: {where}; all: {' | '.join(dict.fromkeys(raised))[:1200]}\n"
                           f"{log[-800:]}")
    warned = [line for line in (proc.stdout + proc.stderr).splitlines() if "Warning" in line]
    if warned:
        raise RuntimeError(f"the console printed warnings: {warned[:3]}")
    return proc.stdout


def _backend(device: str, ranks: int) -> str:
    """One rank on the GPU talks NCCL; several share it over gloo (NCCL refuses two ranks on one GPU)."""
    return "nccl" if device == "cuda" and ranks == 1 else "gloo"


def _main_job(run_root: str, device: str, name: str, nproc: int, overrides: list[str], tol: float) -> dict:
    run = os.path.join(run_root, name)
    _checked(_cli(["train", "--config", "configs/tiny_cpu.toml", "--steps", "6", "--nproc", str(nproc), "--run-dir",
                   run, "--parity", f"parallel.device={device}", f"parallel.backend={_backend(device, nproc)}",
                   f"training.parity_tolerance={tol}", *overrides]))
    report = json.load(open(os.path.join(run, "parity.json")))
    return {"max_abs_dloss": report["max_abs_delta"], "max_rel_err": report["max_abs_delta"], "tol": tol}


def _refused(run_root: str, device: str) -> dict:
    """The main job with 2 pipeline stages over gloo on the GPU ends before any rank starts: exit status 2 and one
    line naming parallel.backend = 'nccl'."""
    proc = _cli(["train", "--config", "configs/tiny_cpu.toml", "--steps", "2", "--nproc", "4", "--run-dir",
                 os.path.join(run_root, "pp2_refused"), f"parallel.device={device}", "parallel.backend=gloo",
                 "parallel.pp=2", "parallel.ep=2", "parallel.etp=1"], timeout_s=120)
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    if proc.returncode != 2 or len(lines) != 1 or "parallel.backend = 'nccl'" not in lines[0]:
        raise RuntimeError(f"expected one refusal line and exit status 2, got rc {proc.returncode}: {lines[-5:]}")
    return {"max_rel_err": 0.0, "tol": 0.0, "refused": lines[0]}


def main_cases(device: str, run_root: str) -> list[SuiteCase]:
    def job(name, covers, nproc, overrides, tol=1e-4):
        return SuiteCase(f"main_{name}", covers, nproc, _backend(device, nproc),
                         lambda: _main_job(run_root, device, name, nproc, overrides, tol))

    return [
        job("edp2_ep2_etp2_parity", "dtensor-moe train, 4 ranks EP2 x ETP2 (EDP1) --parity vs 1 process, float32", 4,
            ["parallel.ep=2", "parallel.etp=2"]),
        job("pp2_ep2_parity", "the main job with 2 pipeline stages (1f1b) x EP2 --parity", 4,
            ["parallel.pp=2", "parallel.ep=2", "parallel.etp=1"]) if device == "cpu" else
        SuiteCase("main_pp2_shared_gpu_refused", "2 pipeline stages on ranks sharing the GPU over gloo: refused "
                  "before launch in one line (gloo's send/recv takes no CUDA tensors; PP's parity is the CPU "
                  "suite's and NCCL's, one GPU a rank)", 4, "gloo", lambda: _refused(run_root, device)),
        job("bf16_selective_ac_fp8_parity", "bf16 mixed precision, selective AC, FP8 experts and payload, EDP2 x EP2 "
            "--parity", 4, ["parallel.ep=2", "parallel.etp=1", "training.dtype=bf16",
                            "training.activation_checkpoint=selective", "moe_run.expert_precision=fp8",
                            "moe_run.dispatch_precision=fp8", "model.dim=128", "model.hidden_dim=256"], tol=5e-2),
        # EP4, not EDP: a compiled layer gathers EDP-sharded experts with DTensor's functional collectives, which
        # crash on gloo with CUDA tensors (torch 2.11); EDP compiles over NCCL, one rank a GPU.
        job("compiled_ep4_parity", "training.compile (each block one graph) on 4 ranks EP4 --parity", 4,
            ["parallel.ep=4", "parallel.etp=1", "training.compile=true"]),
        job("1rank_nccl_bf16_compiled", "one rank over NCCL, bf16, compiled, --parity", 1,
            ["parallel.ep=1", "parallel.etp=1", "training.dtype=bf16", "training.compile=true"], tol=5e-2),
        SuiteCase("main_hf_checkpoint_export_from_pretrained",
                  "[model] hf_path (a Qwen3-MoE checkpoint) on 4 ranks EDP2 x EP2 --parity, export --hf, transformers' "
                  "from_pretrained logits vs the trained model's", 4, "gloo",
                  lambda: _main_hf_export(run_root, device), isolated=True),
    ]


def _main_hf_export(run_root: str, device: str) -> dict:
    import torch.nn.functional as F

    from dtensor_moe.train.config import ModelConfig
    from dtensor_moe.train.data import Batches, load_tokens
    from dtensor_moe.train.export import load_safetensors_into, read_config
    from dtensor_moe.train.model import build_model
    from tests.test_hf_train import _byte_level_qwen3, _load, _rel

    root = os.path.join(run_root, "hf_export")
    src, run = _byte_level_qwen3(os.path.join(root, "qwen3")), os.path.join(root, "run")
    cfg = os.path.join(root, "hf.toml")
    backend = "gloo"
    with open(cfg, "w") as f:
        f.write(f'[model]\nhf_path = "{src}"\nload_balance = "aux_loss"\n[parallel]\nnproc = 4\nep = 2\n'
                f'device = "{device}"\nbackend = "{backend}"\n[training]\nsteps = 3\nseq_len = 16\nglobal_batch = 8\n')
    _checked(_cli(["train", "--config", cfg, "--run-dir", run, "--parity", "--checkpoint-every", "3"]))
    parity = json.load(open(os.path.join(run, "parity.json")))["max_abs_delta"]
    _checked(_cli(["export", run, os.path.join(root, "plain")]))
    _checked(_cli(["export", run, "--hf", os.path.join(root, "hf")]))
    inputs_BL, targets_BL = (t.to(device) for t in Batches(load_tokens("corpus", 0), 16, 8, 0, 0, 1)(0))
    trained = build_model(ModelConfig.from_dict(read_config(os.path.join(root, "plain"))))
    load_safetensors_into(trained, os.path.join(root, "plain"))
    with torch.no_grad():
        want = trained.to(device)(inputs_BL)
        got = _load(os.path.join(root, "hf")).to(device)(input_ids=inputs_BL).logits
        first = F.cross_entropy(_load(src).to(device)(input_ids=inputs_BL).logits.flatten(0, 1), targets_BL.flatten())
    step1 = json.loads(open(os.path.join(run, "metrics.jsonl")).readline())["loss"]
    errs = {"logits": _rel(got, want), "parity_dloss": parity, "step1_loss_vs_transformers": abs(step1 - first.item())}
    return {"max_rel_err": max(errs.values()), "errors": errs, "tol": 1e-4}


# --- Hugging Face models trained directly --------------------------------------------------------------------------


def hf_cases(device: str, run_root: str) -> list[SuiteCase]:
    from tests.test_hf_train import FAMILIES

    cases = []
    for family in FAMILIES:
        cases.append(SuiteCase(f"hf_{family}_ep2_gloo", f"parallelize_hf_model({family}) EP2 on 2 ranks sharing the "
                               "GPU: 3 AdamW steps' losses and the trained logits vs transformers' own model", 2,
                               "gloo", lambda f=family: _hf(run_root, device, f, 2), isolated=True))
        cases.append(SuiteCase(f"hf_{family}_1rank", f"parallelize_hf_model({family}) on one rank over "
                               f"{'NCCL' if device == 'cuda' else 'gloo'}, saved by save_hf and loaded by "
                               "from_pretrained", 1, _backend(device, 1),
                               lambda f=family: _hf(run_root, device, f, 1), isolated=True))
    return cases


def _hf(run_root: str, device: str, family: str, world: int) -> dict:
    import torch.distributed as dist

    from tests.harness import _free_port, run_on_ranks
    from tests.hf_models import GPU_ATTENTION, hf_model
    from tests.test_hf_train import _batch, _load, _rel, _train, train_on_ranks

    ckpt = os.path.join(run_root, "hf", family)
    if not os.path.isdir(ckpt):
        hf_model(family, **GPU_ATTENTION.get(family, {})).float().save_pretrained(ckpt)
    tokens_BL, probe_BL = _batch()
    ref = _load(ckpt).to(device)
    ref_losses = torch.stack(_train(ref, tokens_BL.to(device), lambda m, t: m(input_ids=t, labels=t).loss)).cpu()
    with torch.no_grad():
        ref_logits = ref(input_ids=probe_BL.to(device)).logits.cpu()
    out = os.path.join(run_root, "hf_trained", f"{family}_{world}")
    if world == 1:  # this process: a one-rank group on the GPU's own backend
        if not dist.is_initialized():
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1")
            dist.init_process_group(_backend(device, 1), rank=0, world_size=1)
        ours = train_on_ranks(0, 1, ckpt, out, 1, 1, tokens_BL, probe_BL, device)
    else:
        ours = run_on_ranks(world, train_on_ranks, ckpt, None, 2, 1, tokens_BL, probe_BL, device)[0]
    errs = {"losses": _rel(ours["losses"], ref_losses), "logits": _rel(ours["logits"], ref_logits)}
    if world == 1:
        with torch.no_grad():
            back = _load(out).to(device)(input_ids=probe_BL.to(device)).logits.cpu()
        errs["from_pretrained_logits"] = _rel(back, ours["logits"])
    return {"max_rel_err": max(errs.values()), "errors": errs, "tol": 1e-4}


# --- the torchtitan hook -------------------------------------------------------------------------------------------


def titan_cases(device: str, run_root: str) -> list[SuiteCase]:
    def titan(nproc, backend):
        return SuiteCase(f"titan_hook_{nproc}rank_{backend}", "torchtitan 0.3.0's Trainer with --module "
                         f"dtensor_moe.titan on {nproc} rank(s) over {backend} (tests/gpu/titan_torch211.py)", nproc,
                         backend,
                         lambda: _titan(run_root, nproc, backend))

    return [titan(1, _backend(device, 1)), titan(2, _backend(device, 2))]


def _titan(run_root: str, nproc: int, backend: str) -> dict:
    """The hook (our experts, the default) against torchtitan alone on the same ranks, both from one seed checkpoint:
    every step's loss within titan_torch211's --ref-atol (bf16 on the GPU)."""
    seed = os.path.join(run_root, "titan_seed")
    ref = _titan_run(run_root, nproc, backend, f"titan_alone_{nproc}_{backend}", "--seed", seed, "--alone")
    case = _titan_run(run_root, nproc, backend, f"titan_{nproc}_{backend}", "--seed", seed, "--ref", ref["path"])
    diffs = case["checks"]["ref"]["loss_abs_diffs"]
    return {"max_rel_err": max(diffs), "tol": case["checks"]["ref"]["atol"], "losses": case.get("losses"),
            "losses_titan_alone": ref.get("losses")}


def _titan_run(run_root: str, nproc: int, backend: str, name: str, *flags: str) -> dict:
    out = os.path.join(run_root, f"{name}.json")
    # FlexAttention compiled without max-autotune (other tiles, the same math), so a case takes minutes, not ten.
    proc = subprocess.run([sys.executable, titan_torch211.__file__, "--nproc", str(nproc),
                           "--backend", backend, "--out", out, "--steps", "4", "--no-flex-autotune", *flags,
                           "--timeout", os.environ.get("GPU_SUITE_TITAN_TIMEOUT_S", "240")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    if not os.path.exists(out):
        raise RuntimeError(f"titan_torch211.py wrote no result (rc {proc.returncode}): {proc.stderr[-1500:]}")
    case = json.load(open(out))
    if not case.get("passed"):
        raise RuntimeError(case.get("titan_blocker") or str(case.get("checks", {}).get("ref"))
                           or case.get("log_tail", "")[-1500:])
    return {**case, "path": out}


# --- the run -------------------------------------------------------------------------------------------------------


def run_case(case: SuiteCase, args) -> dict:
    t0 = time.perf_counter()
    row = {"name": case.name, "covers": case.covers, "ranks": case.ranks, "backend": case.backend}
    try:
        result = _in_child(case, args) if case.isolated and args.case is None else case.run()
        row.update(result, passed=bool(result["max_rel_err"] <= result["tol"]))
    except Exception as e:  # a case's failure is its row; the suite goes on
        row.update(passed=False, error=f"{type(e).__name__}: {e}"[-2000:])
        traceback.print_exc()
    row["seconds"] = round(time.perf_counter() - t0, 1)
    return row


def _in_child(case: SuiteCase, args) -> dict:
    """`case` run by this script in a new process (--case); its result, or its failure raised here."""
    out = os.path.join(args.run_root, f"{case.name}.json")
    # Synchronous launches: a CUDA error's traceback names the kernel's caller, not a later call.
    env = {**os.environ, "CUDA_LAUNCH_BLOCKING": "1"}
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--device", args.device, "--case", case.name,
                           "--run-root", args.run_root, "--out", out], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env=env)
    if not os.path.exists(out):
        raise RuntimeError(f"the case's process wrote no result (rc {proc.returncode}): {proc.stderr[-1500:]}")
    row = json.load(open(out))
    if "error" in row:
        raise RuntimeError(row["error"] + "\n" + proc.stderr[-1500:])
    return {k: v for k, v in row.items() if k not in ("name", "covers", "ranks", "backend", "passed", "seconds")}


def _earlier(args) -> dict | None:
    """--merge: the report at --out when it is a run of today's date (UTC) on this device, else None."""
    if not (args.merge and os.path.exists(args.out)):
        return None
    with open(args.out) as f:
        earlier = json.load(f)
    today = datetime.now(timezone.utc).date().isoformat()
    return earlier if earlier.get("date", "").startswith(today) and earlier.get("device") == _device(args) else None


def _device(args) -> str:
    return torch.cuda.get_device_name() if args.device == "cuda" else "cpu"


def _report(args, rows: list[dict], start: float, earlier: dict | None, every: list[SuiteCase]) -> dict:
    """This run's rows, after those of `earlier` (the same date's calls) that it did not run again."""
    ran = {r["name"] for r in rows}
    merged = [r for r in (earlier or {}).get("cases", []) if r["name"] not in ran] + rows
    order = {c.name: i for i, c in enumerate(every)}
    merged.sort(key=lambda r: order.get(r["name"], len(order)))
    titan = [r for r in merged if r["name"].startswith("titan_")]
    blocker = next((r["error"] for r in titan if not r["passed"]), None) if titan else "not run"
    seconds = round(time.perf_counter() - start, 1) + (earlier or {}).get("seconds", 0)
    done = {r["name"] for r in merged if "not run" not in r.get("error", "")}
    calls = earlier["calls"] + 1 if earlier else 1
    return {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "torch": torch.__version__,
            "device": _device(args), "seconds": round(seconds, 1), "calls": calls,
            "titan_blocker": blocker, "not_run": [c.name for c in every if c.name not in done], "cases": merged}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--only", nargs="+", default=["*"], help="fnmatch patterns of case names")
    ap.add_argument("--budget-s", type=float, default=540, help="start no case after this many seconds")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "gpu_suite.json"))
    ap.add_argument("--run-root", default=None, help="the cases' run directories (default: a temporary one)")
    ap.add_argument("--merge", action="store_true", help="keep the cases of --out's run of the same date (UTC) and "
                    "device that this call does not run: one file from several calls")
    ap.add_argument("--case", help=argparse.SUPPRESS)  # one isolated case, its row written to --out
    args = ap.parse_args()
    # A scheduler's SIGTERM unwinds like Ctrl-C: subprocess.run kills the case's process (the launcher it started
    # stops its ranks), and the harness's pools end with this process.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_suite.py: no CUDA device here; --device cpu runs the CPU smoke")
    if args.device == "cuda":  # workers forked from the harness's forkserver cannot initialize CUDA
        os.environ.setdefault("DTENSOR_MOE_TEST_START_METHOD", "spawn")
        # CUDA's own threads in each worker are no leaked process group: keep the pools (a spawned pool costs ~13 s)
        os.environ.setdefault("DTENSOR_MOE_TEST_RECYCLE_THREADS", "1000")
    run_root = args.run_root = args.run_root or tempfile.mkdtemp(prefix="gpu_suite_")
    import transformers

    transformers.utils.logging.disable_progress_bar()  # its load and save bars, a few per case
    patterns = [args.case] if args.case else args.only
    every = (*(check_cases(run_root) if args.device == "cuda" else ()), *layer_cases(args.device),
             *main_cases(args.device, run_root), *hf_cases(args.device, run_root), *titan_cases(args.device, run_root))
    # In the order of the patterns that name them (the suite's order within one pattern).
    cases = [c for p in patterns for c in every if fnmatch.fnmatch(c.name, p)]
    cases = list({c.name: c for c in cases}.values())
    if args.case:
        write_json(args.out, run_case(cases[0], args))
        return 0
    start, rows, earlier = time.perf_counter(), [], _earlier(args)
    for i, case in enumerate(cases):
        if time.perf_counter() - start > args.budget_s:
            rows.append({"name": case.name, "covers": case.covers, "ranks": case.ranks, "backend": case.backend,
                         "passed": False, "error": "not run: the suite's time budget was spent"})
        else:
            rows.append(run_case(case, args))
        r = rows[-1]
        err = f"{r['max_rel_err']:.1e} (tol {r['tol']:g})" if "max_rel_err" in r else r.get("error", "")[:160]
        print(f"[{i + 1:2d}/{len(cases)}] {'ok  ' if r['passed'] else 'FAIL'} {r['name']:44s} "
              f"{r.get('seconds', 0):6.1f} s  {err}", flush=True)
        write_json(args.out, _report(args, rows, start, earlier, every))  # a run cut short keeps what it did
    from tests.harness import close_all

    close_all()
    passed = sum(r["passed"] for r in rows)
    print(f"gpu suite: {passed}/{len(rows)} passed in {time.perf_counter() - start:.0f} s -> {args.out}")
    return 0 if passed == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
