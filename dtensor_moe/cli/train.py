"""`dtensor-moe train`: train the small MoE language model on CPU ranks (gloo) or GPUs (NCCL; gloo to share them).

Outside torchrun it starts its local ranks itself through torch.distributed.run; under torchrun
(also multi-node) it uses the environment as given. `--parity` then trains the same model on one
process with the same data and fails if any step's loss differs by more than the tolerance.
"""

import json
import os
import shutil
import sys
from dataclasses import asdict, replace

from dtensor_moe.cli.launch import RunDirLock, Supervisor, clear_run_state
from dtensor_moe.routing.token_rounding import check_rounding_reachable
from dtensor_moe.train.config import (
    Config,
    is_override,
    load_config,
    parse_overrides,
)
from dtensor_moe.train.loop import parallel_dims, train_ranks
from dtensor_moe.train.supervision import LAUNCHED, describe_stop, read_stopped


def add_arguments(p):
    p.add_argument("--config", required=True, help="TOML file (see configs/)")
    p.add_argument("--steps", type=int, help="override training.steps")
    p.add_argument("--run-dir", help="output directory (default runs/<config name>)")
    p.add_argument("--nproc", type=int, help="local ranks to start (default parallel.nproc)")
    p.add_argument("--parity", action="store_true", help="also train on 1 process and compare losses step by step")
    p.add_argument("--checkpoint-every", type=int, default=0, help="save a checkpoint every N steps (0: never)")
    p.add_argument("--resume", nargs="?", const="latest",
                   help="resume from DIR: a step directory, or a checkpoint root (its newest intact step; "
                        "default: the run dir's checkpoints)")
    p.add_argument("--new-data", action="store_true",
                   help="with --resume: continue on data other than the checkpoint's (fine-tuning); without it a "
                        "changed data stream is refused")
    p.add_argument("--keep-last", type=int, default=3, help="checkpoints to keep")
    p.add_argument("overrides", nargs="*", help="section.key=value, e.g. parallel.ep=4 training.lr=1e-3")


def _resolve(args) -> tuple[Config, str]:
    if args.resume is not None and is_override(args.resume):  # `--resume training.steps=5`: no DIR given
        args.overrides, args.resume = [args.resume, *args.overrides], "latest"
    overrides = list(args.overrides)
    given = parse_overrides(overrides)
    for flag, key, value in (("--steps", "training.steps", args.steps), ("--nproc", "parallel.nproc", args.nproc)):
        if value is None:
            continue
        if given.get(key, value) != value:  # equal ones are harmless (the ranks get --nproc as an override too)
            raise ValueError(f"{flag} {value} and the override {key}={given[key]} disagree; give only one of them")
        overrides.append(f"{key}={value}")
    cfg = load_config(args.config, overrides)
    return cfg, _default_run_dir(args.config) if args.run_dir is None else args.run_dir


def _default_run_dir(config: str) -> str:
    return os.path.join("runs", os.path.splitext(os.path.basename(config))[0])


def _worker_argv(args, run_dir: str) -> list[str]:
    argv = ["--config", args.config, "--run-dir", run_dir, "--checkpoint-every", str(args.checkpoint_every)]
    argv += ["--keep-last", str(args.keep_last)]
    if args.steps is not None:
        argv += ["--steps", str(args.steps)]
    if args.resume is not None:
        argv += ["--resume", args.resume]
    # --nproc travels as an override: torchrun would take "--nproc" for its own --nproc-per-node.
    nproc = [] if args.nproc is None else [f"parallel.nproc={args.nproc}"]
    return argv + list(args.overrides) + nproc


# torchrun's standalone rendezvous binds a free port itself: a port picked here and bound later by
# torchrun can be taken in between by another job on the machine (EADDRINUSE).
_TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]


def run(args) -> int:
    """Bad input (config, arguments, checkpoints, the machine) is one line on stderr and rc 2, before any rank starts;
    so is a run dir another run holds, with its holder's pid."""
    under_torchrun = "LOCAL_RANK" in os.environ
    owner = not under_torchrun or (int(os.environ.get("RANK", 0)) == 0 and LAUNCHED not in os.environ)
    lock = None
    try:
        cfg, run_dir = _resolve(args)
        _check_run_args(args, cfg, run_dir)  # torch-free: a bad flag is reported before torch is imported
        from dtensor_moe.train.prelaunch import check_before_launch

        check_before_launch(run_dir, args.resume)  # the installed extras, --resume's checkpoint root
        _check(cfg, int(os.environ["WORLD_SIZE"]) if under_torchrun else cfg.parallel.nproc)
        if under_torchrun and args.parity:
            raise ValueError("--parity needs the local launcher: run `dtensor-moe train` without torchrun")
        _check_data(cfg)
        resume = args.resume is not None and not under_torchrun
        # A run dir that does not exist yet has nothing to lock: a missing checkpoint is refused without making it.
        target = _resume_target(args, cfg, run_dir) if resume and not os.path.isdir(run_dir) else None
        if owner:  # a bad config or machine creates no run dir; a held one is refused before its checkpoints are read
            local = os.environ.get("LOCAL_WORLD_SIZE") if under_torchrun else None  # torchrun's, not the config's
            _check_device(cfg, None if local is None else int(local))
            _check_run_dir(cfg, run_dir)
            lock = RunDirLock(run_dir)
        if resume:
            args.resume = str(target or _resume_target(args, cfg, run_dir))  # the ranks load exactly this step
        if owner:
            clear_run_state(run_dir)
    except ValueError as e:
        print(f"dtensor-moe train: {' '.join(str(e).split())}", file=sys.stderr)
        if lock is not None:
            lock.release()
        return 2
    try:
        return _run(args, cfg, run_dir, under_torchrun)
    finally:
        if lock is not None:
            lock.release()


def _run(args, cfg: Config, run_dir: str, under_torchrun: bool) -> int:
    if under_torchrun:  # this process is one rank
        from dtensor_moe.train.checkpoint import CheckpointError

        try:
            train_ranks(cfg, run_dir, args)
        except CheckpointError as e:  # raised alike on every rank (checkpoint checks are collective): say it once
            if int(os.environ.get("RANK", 0)) == 0:
                print(f"dtensor-moe train: {' '.join(str(e).split())}", file=sys.stderr)
            return 2
        if LAUNCHED in os.environ:  # the launcher reports how the run ended
            return 0
        return _report_under_torchrun(run_dir)
    n = cfg.parallel.nproc
    cmd = [*_TORCHRUN, f"--nproc-per-node={n}"]
    cmd += ["-m", "dtensor_moe.cli", "train", *_worker_argv(args, run_dir)]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), LAUNCHED: "1"}
    rc = _launch(cmd, env, run_dir, n, cfg.parallel.timeout_s)
    if rc != 0:
        return rc
    rc, parity_line = parity(cfg, run_dir) if args.parity else (0, None)
    print(console_summary(run_dir, parity_line))
    return rc


def _launch(cmd: list[str], env: dict, run_dir: str, nproc: int, timeout_s: float) -> int:
    return Supervisor(cmd, env, run_dir, nproc, timeout_s).run()


def _report_under_torchrun(run_dir: str) -> int:
    """Under an outside torchrun (no launcher of ours) each rank exits with the run's code; rank 0 says why."""
    stopped = read_stopped(run_dir)
    rank0 = int(os.environ.get("RANK", 0)) == 0
    if stopped is None:
        if rank0:
            print(console_summary(run_dir))
        return 0
    line, code = describe_stop(stopped)
    if rank0:
        print(f"dtensor-moe train: {line}", file=sys.stderr)
    return code


def _check_run_dir(cfg: Config, run_dir: str):
    """A writable run dir with room for a checkpoint."""
    try:
        os.makedirs(run_dir, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--run-dir {run_dir!r} cannot be created: {e.strerror}") from None
    if not os.access(run_dir, os.W_OK | os.X_OK):
        raise ValueError(f"--run-dir {run_dir!r} is not writable; choose another --run-dir")
    # fp32 weights and AdamW's two moments; a save writes into a temporary directory before the old one goes.
    need = 3 * 4 * cfg.model.num_params()
    free = shutil.disk_usage(run_dir).free
    if free < need:
        raise ValueError(
            f"--run-dir {run_dir!r} has {free / 2**20:.1f} MiB free; a checkpoint of this model needs "
            f"about {need / 2**20:.1f} MiB (weights + AdamW state); free space or choose another --run-dir"
        )


def _check_device(cfg: Config, torchrun_local: int | None = None):
    """parallel.device = 'cuda' needs a GPU, and NCCL one GPU per rank on this node: `torchrun_local` ranks under an
    outside torchrun, else parallel.nproc. gloo ranks share GPUs (loop.py maps LOCAL_RANK onto them in turn)."""
    p = cfg.parallel
    if p.device != "cuda":
        return
    import torch

    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have == 0:
        raise ValueError(f"parallel.device = 'cuda' needs a GPU; this machine has none that torch {torch.__version__} "
                         "can use (torch.cuda.is_available() is False); valid: parallel.device = 'cpu'")
    ranks = p.nproc if torchrun_local is None else torchrun_local
    if p.resolved_backend == "nccl" and ranks > have:
        what, fix = (("parallel.nproc", "parallel.nproc") if torchrun_local is None
                     else ("torchrun's local ranks", "torchrun --nproc-per-node"))
        backend = "'nccl'" if p.backend == "nccl" else "'auto' (nccl on parallel.device = 'cuda')"
        raise ValueError(f"parallel.backend = {backend} runs one rank per GPU: {what} = {ranks} on a machine with "
                         f"{have} GPU{'s' if have > 1 else ''} (torch {torch.__version__}); valid: {fix} <= {have}, "
                         "or parallel.backend = 'gloo' to share the GPUs (CUDA tensors through the host: slow, for "
                         "debugging)")


def console_summary(run_dir: str, parity_line: str | None = None) -> str:
    from dtensor_moe.train.metrics import summary_lines

    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    return "\n".join(summary_lines(summary, run_dir, parity_line))


def _check_run_args(args, cfg: Config, run_dir: str):
    if args.checkpoint_every < 0:
        raise ValueError(
            f"--checkpoint-every must be >= 0 (steps between saves; 0: never), got {args.checkpoint_every}"
        )
    if args.keep_last < 1:
        raise ValueError(f"--keep-last must be >= 1 (checkpoints kept on disk), got {args.keep_last}")
    if args.new_data and args.resume is None:
        raise ValueError("--new-data goes with --resume (it lets a resume continue on other data); without --resume "
                         "there is nothing to continue: drop it")
    if not run_dir.strip():  # not the default's stand-in: an empty path is a slip (an unset shell variable)
        raise ValueError(f"--run-dir {run_dir!r} names no directory; give a path, or leave --run-dir out for the "
                         f"default {_default_run_dir(args.config)}")
    if os.path.exists(run_dir) and not os.path.isdir(run_dir):
        raise ValueError(f"--run-dir {run_dir!r} is a file, not a directory")


def _resume_target(args, cfg: Config, run_dir: str):
    """The verified step directory --resume names (or the newest intact one), fit for this model config."""
    from dtensor_moe.train.checkpoint import config_diff, data_of, pick, saved_config, step_of
    from dtensor_moe.train.data import data_fingerprint, fingerprint_diff

    where = os.path.join(run_dir, "checkpoints") if args.resume == "latest" else args.resume
    ckpt = pick(where)
    diffs = config_diff(saved_config(ckpt), asdict(cfg.model), now="config")
    if diffs:
        raise ValueError(
            f"--resume {ckpt} was saved with another model config ({'; '.join(diffs)}); train with the config "
            f"it was saved with ({ckpt / 'model_config.json'}) or start a new --run-dir"
        )
    saved = data_of(ckpt)
    changed = [] if saved is None or args.new_data else fingerprint_diff(saved, data_fingerprint(cfg))
    if changed:
        raise ValueError(
            f"--resume {ckpt} was trained on another data stream ({'; '.join(changed)}): resuming would train on "
            "sequences it has not planned (and may hold out ones it trained on); resume with the data it was saved "
            "with, or pass --new-data to continue on this data on purpose (fine-tuning)")
    step = step_of(ckpt)
    if step is not None and step >= cfg.training.steps:
        raise ValueError(
            f"--resume {ckpt} is at step {step}, training.steps is {cfg.training.steps}: nothing left to "
            f"train; raise --steps above {step}"
        )
    return ckpt


def _check(cfg: Config, world: int):
    """Every config error, raised before any process group or collective exists."""
    from dtensor_moe.config import check_replica_mesh, check_row_cap
    from dtensor_moe.parallel.compile import check_compile_with_ac
    from dtensor_moe.parallel.placement import check_pipeline, plan_moe
    from dtensor_moe.train.data import check_global_batch
    from dtensor_moe.train.parallel.parallelize_transformer import check_compile_with_dense_parallel

    p, m = cfg.parallel, cfg.model  # types and ranges of every field were checked when the config was built
    dims = parallel_dims(cfg, world)
    plan_moe(m.moe_config(), dims)
    check_replica_mesh(cfg.moe_run.expert_replicas, m.num_experts, dims, "moe_run.expert_replicas", "parallel.ep")
    check_compile_with_ac(cfg.training.activation_checkpoint, cfg.training.compile, "training.")
    check_compile_with_dense_parallel(dims, cfg.training.compile, "training.")
    check_pipeline(dims, p.pp_schedule, p.num_microbatches, m.n_layers, m.tie_embeddings)
    # CP and TP ranks split each sequence; the other ranks read different sequences.
    check_global_batch(cfg.training.global_batch, dims.dp_replicate * dims.dp_shard, p.num_microbatches)
    check_row_cap(cfg.moe_run.max_rows_per_rank, dims.ep, dims.etp,
                  ("moe_run.max_rows_per_rank", "parallel.ep", "parallel.etp"))
    dp = dims.dp_replicate * dims.dp_shard
    tokens = cfg.training.global_batch // (dp * p.num_microbatches) * (cfg.training.seq_len // (dims.cp * dims.tp))
    check_rounding_reachable(
        cfg.moe_run.round_tokens_to, tokens, m.top_k, m.num_experts, cfg.moe_run.capacity_factor,
        f"each rank's MoE per forward: training.global_batch {cfg.training.global_batch} / {dp} data-parallel ranks"
        + (f" / {p.num_microbatches} microbatches" if p.num_microbatches > 1 else "")
        + f" x training.seq_len {cfg.training.seq_len}" + (f" / cp*tp {dims.cp * dims.tp}" if dims.cp * dims.tp > 1
                                                            else ""))


def _check_data(cfg: Config):
    """data.source = 'files': the files found, read and tokenized into the token cache (once; a progress bar),
    then checked against the config (vocabulary, a global batch of tokens, the held-out split): bad data is one
    line before any rank starts, and the ranks only memory-map the cache."""
    if cfg.data.source == "files":
        from dtensor_moe.train.token_cache import prepare

        prepare(cfg)


def parity(cfg: Config, run_dir: str) -> tuple[int, str]:
    """Train the same model on one process with the same global batches; compare per-step loss.

    Returns (rc, the line that says how it went)."""
    # The reference is the plain eager single process: no compile, no activation checkpointing.
    # It accumulates gradients over the same microbatches (each MoE's load-balancing loss is per microbatch).
    # One rank has no GPU to share: it takes the device's own backend (nccl on cuda, gloo on cpu) whatever the job's.
    ref_dir = os.path.join(run_dir, "reference_1proc")
    ref = json.dumps(_reference_config(cfg).to_dict())
    cmd = [*_TORCHRUN, "--nproc-per-node=1", "-m", "dtensor_moe.train.loop", ref, ref_dir, *_reference_slices(cfg)]
    clear_run_state(ref_dir)  # a previous reference's stop note must not decide this one's exit code
    rc = _launch(cmd, dict(os.environ), ref_dir, 1, cfg.parallel.timeout_s)
    if rc != 0:
        return rc, f"the 1-process reference run failed (rc {rc}); nothing compared"
    ours = _losses(run_dir)
    ref = _losses(ref_dir)
    if not ours or len(ours) != len(ref):
        return 1, f"{len(ours)} steps here vs {len(ref)} in the 1-process run; nothing to compare: FAIL"
    deltas = [abs(a - b) for a, b in zip(ours, ref)]
    tol = cfg.training.parity_tolerance
    report = {"steps": len(deltas), "max_abs_delta": max(deltas), "tolerance": tol, "per_step_abs_delta": deltas}
    from dtensor_moe.train.metrics import write_json

    write_json(os.path.join(run_dir, "parity.json"), report)
    ok = max(deltas) <= tol
    line = (f"max |dloss| vs 1 process over {len(deltas)} steps = {max(deltas):.1e} (tolerance {tol:g}): "
            f"{'pass' if ok else 'FAIL'}")
    return (0 if ok else 1), line


def _reference_config(cfg: Config) -> Config:
    """The run's config on one process. Replicas and the row cap act only on an EP mesh, and change no math (where
    an expert's rows are computed; a refusal past a bound): the reference goes without them."""
    return replace(cfg, parallel=replace(cfg.parallel, nproc=1, dp_replicate=1, ep=1, etp=1, tp=1, cp=1, pp=1,
                                         microbatches=cfg.parallel.num_microbatches, backend="auto"),
                   moe_run=replace(cfg.moe_run, expert_replicas=0, max_rows_per_rank=0),
                   training=replace(cfg.training, compile=False, activation_checkpoint="none"))


def _reference_slices(cfg: Config) -> list[str]:
    """[DP, SEQ] for the reference where the MoE's math depends on the tokens one forward sees together (a capacity
    factor drops and round_tokens_to rounds each rank's own pairs): its MoE layers then run each of the run's
    data-parallel ranks' share of a microbatch (DP groups of sequences), under cp / tp each rank's part of them (SEQ
    parts of each sequence), on its own (train/reference.py); [] otherwise."""
    run = cfg.moe_run
    if run.capacity_factor is None and not run.round_tokens_to:
        return []
    dims = parallel_dims(cfg, cfg.parallel.nproc)
    dp, seq = dims.dp_replicate * dims.dp_shard, dims.cp * dims.tp
    return [] if dp * seq == 1 else [str(dp), str(seq)]


def _losses(run_dir: str) -> list[float]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line)["loss"] for line in f]
