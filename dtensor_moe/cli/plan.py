"""`dtensor-moe plan`: rank the foldings of a model over a cluster (dtensor_moe.tools.folding).

`--model` is a preset (tools/presets.py: published models, and the torchtitan hook's `--config` names of
torchtitan's models), a training config TOML or its name under `configs/`.
"""

import math
from dataclasses import asdict, replace
from pathlib import Path

from dtensor_moe.config import MoERunOptions
from dtensor_moe.parallel.mesh import PP_STAGES_PER_RANK, MoEParallelDims, divisors
from dtensor_moe.parallel.placement import check_pipeline
from dtensor_moe.tools.folding.report import candidate_dict, explain_choice, table
from dtensor_moe.tools.folding.search import TP_NOTE, pipeline_degrees, rank_foldings
from dtensor_moe.tools.folding.workload import COMPUTE_BYTES, OPTIMIZER_MOMENTS, PRICED_AC_MODES, Hardware, Workload
from dtensor_moe.tools.presets import PRESETS, TITAN_MODELS, ModelShape, shape_from_hf_config, shape_from_model_config
from dtensor_moe.validate import check_int, check_positive

PUBLISHED = sorted(set(PRESETS) - set(TITAN_MODELS))  # the other presets: published models


def _config_dirs() -> list[Path]:
    return [Path.cwd() / "configs", Path(__file__).resolve().parents[2] / "configs"]  # the checkout's, when editable


def shape_from_training_config(path: Path) -> tuple[ModelShape, MoERunOptions]:
    """The model a training config trains and how its MoE layers run: the built-in model of its [model] fields, or
    with `hf_path` the checkpoint's own architecture (its config.json, read as the main job reads it; [model] adds
    balance fields), and its [moe_run] section."""
    from dtensor_moe.train.config import ModelConfig, build_section, read_toml

    data = read_toml(str(path))  # a malformed file is named, with tomllib's line
    try:
        run = build_section("moe_run", data.get("moe_run", {}))
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    if "model" not in data:
        raise ValueError(
            f"{path}: a training config needs a [model] table (fields of dtensor_moe.train.config.ModelConfig)"
        )
    if data["model"].get("hf_path"):
        import json

        from dtensor_moe.train.hf_config import hf_model_fields

        try:
            cfg = ModelConfig.from_dict(hf_model_fields(data["model"]))
            return shape_from_hf_config(json.loads(cfg.hf_config), cfg.moe_config(), name=path.stem), run
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
    return shape_from_model_config(ModelConfig.from_dict(data["model"]), name=path.stem), run


def resolve(model: str) -> tuple[ModelShape, MoERunOptions]:
    """A preset name (run with the default options), a path to a training config TOML, or the stem of one in a
    `configs/` folder."""
    if model in PRESETS:
        return PRESETS[model], MoERunOptions()
    path = Path(model)
    if path.is_file():
        return shape_from_training_config(path)
    for d in _config_dirs():
        if (d / f"{model}.toml").is_file():
            return shape_from_training_config(d / f"{model}.toml")
    configs = sorted({p.stem for d in _config_dirs() if d.is_dir() for p in d.glob("*.toml")})
    raise ValueError(f"unknown model {model!r}; valid: presets {PUBLISHED}, torchtitan configs {list(TITAN_MODELS)} "
                     f"(--module dtensor_moe.titan --config), configs {configs}, or a path to a .toml")


def add_arguments(p):
    p.add_argument("--model", required=True, help=f"preset ({', '.join(PUBLISHED)}), torchtitan config "
                   f"({', '.join(TITAN_MODELS)}), a training config .toml, or its name under configs/")
    p.add_argument("--gpus", type=int, required=True)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--gpu-mem", type=float, default=80.0, help="GiB per GPU")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per data-parallel rank per microbatch")
    p.add_argument("--microbatches", type=int, default=1, help="microbatches per step (pipeline, or accumulation)")
    p.add_argument("--pp", type=int, default=0, help="pipeline stages (0: try every pp the schedule and layers allow)")
    p.add_argument("--pp-schedule", choices=list(PP_STAGES_PER_RANK), default="1f1b")
    p.add_argument("--dtype", choices=sorted(COMPUTE_BYTES), default="bf16", help="compute dtype (master weights fp32)")
    p.add_argument("--optimizer", choices=sorted(OPTIMIZER_MOMENTS), default="adamw")
    p.add_argument("--activation-checkpoint", choices=PRICED_AC_MODES, default="full",
                   help="activation checkpointing per block (training.activation_checkpoint's none or full)")
    p.add_argument("--intra-bw", type=float, default=450.0, help="GB/s per GPU inside a node")
    p.add_argument("--inter-bw", type=float, default=50.0, help="GB/s per GPU across nodes")
    p.add_argument("--skew", type=float, default=0.0,
                   help="routing skew: each token draws its top-k experts with weights 1 / rank ** SKEW (Zipf, "
                   "benchmarks/routing.py's skewed routing), the ranks a seeded shuffle of the expert ids (of 64 "
                   "experts, expert 44 is the hottest), the experts in the EP split's contiguous blocks of ids; shows "
                   "max/mean rows per EP rank without and with --replicas and prices the busiest EP rank "
                   "(0, the default: balanced routing)")
    p.add_argument("--replicas", type=int, default=None,
                   help="hot-expert replica slots per EP rank (MoERunOptions.expert_replicas, 0..num_experts; "
                   "default: the model's own)")
    p.add_argument("--top", type=int, default=10, help="rows to show (>= 1)")
    p.add_argument("--json", action="store_true")


def _check_flags(args):
    """The flags by their own names, before they become Workload / Hardware fields (GB/s -> bytes/s)."""
    for flag in ("gpus", "gpus_per_node", "seq_len", "micro_batch", "microbatches", "top"):
        check_int("--" + flag.replace("_", "-"), getattr(args, flag))
    check_int("--pp", args.pp, minimum=0)
    if not (math.isfinite(args.skew) and args.skew >= 0):
        raise ValueError(f"--skew must be a finite number >= 0 (0: balanced routing), got {args.skew!r}")
    for flag in ("gpu_mem", "intra_bw", "inter_bw"):
        check_positive("--" + flag.replace("_", "-"), getattr(args, flag))
    if args.pp and args.gpus % args.pp:
        raise ValueError(f"--pp ({args.pp}) must divide --gpus ({args.gpus}): pipeline stages of equal size; "
                         f"valid --pp: {divisors(args.gpus)} (or 0: try each)")


def _with_replicas(args, spec: ModelShape, run: MoERunOptions) -> MoERunOptions:
    """`run` with --replicas slots per EP rank, in MoERunOptions.expert_replicas' range."""
    if args.replicas is None:
        return run
    E = spec.moe.num_experts
    if not 0 <= args.replicas <= E:
        raise ValueError(f"--replicas must be an int in 0..num_experts ({E} for {spec.name}; "
                         f"MoERunOptions.expert_replicas' range), got {args.replicas}")
    return replace(run, expert_replicas=args.replicas)


def _check_pipeline_flags(args, spec: ModelShape):
    if args.pp > 1:
        check_pipeline(MoEParallelDims(args.gpus, pp=args.pp), args.pp_schedule, args.microbatches, spec.n_layers,
                       spec.tie_embeddings, prefix="--")


def run(args) -> int:
    import json
    import sys
    import time

    t0 = time.perf_counter()
    try:
        _check_flags(args)
        spec, run = resolve(args.model)
        run = _with_replicas(args, spec, run)
        _check_pipeline_flags(args, spec)
        work = Workload(args.seq_len, args.micro_batch, args.dtype, args.optimizer, args.activation_checkpoint,
                        args.microbatches, args.pp_schedule, args.skew, run)
        hw = Hardware(args.gpus, args.gpus_per_node, args.gpu_mem, args.intra_bw * 1e9, args.inter_bw * 1e9)
    except ValueError as e:
        print(f"dtensor-moe plan: {e}", file=sys.stderr)
        return 2
    cands = rank_foldings(spec, work, hw, args.pp or None)
    replicas = run.expert_replicas
    if replicas and not cands:
        # The search skips ep 1 with replicas, so no folding of this world was left to rank.
        print(f"dtensor-moe plan: --replicas {replicas} needs ep > 1 (a replica slot holds another "
              f"EP rank's expert), and no folding of --gpus {hw.gpus} has ep > 1 for {spec.name} "
              f"({spec.moe.num_experts} experts); valid: --replicas 0, or --gpus 2 or more (ep must divide the "
              f"experts)", file=sys.stderr)
        return 2
    fitting = [c for c in cands if c.fits]
    elapsed = time.perf_counter() - t0
    tried = [args.pp] if args.pp else pipeline_degrees(hw.gpus, spec, work, hw.gpus_per_node)
    pp_note = f"pp tried: {tried}" + (" (pp > 1 needs --microbatches >= pp under 1f1b)"
                                      if tried == [1] and work.pp_schedule == "1f1b" else "")
    if args.json:
        print(json.dumps({
            "model": spec.name, "replicas": replicas, "hardware": asdict(hw), "workload": asdict(work),
            "note": TP_NOTE, "pp_tried": tried, "enumerated": len(cands), "fitting": len(fitting), "elapsed_s": elapsed,
            "candidates": [candidate_dict(c) for c in cands[: args.top]],
        }, indent=1))
        return 0
    print(f"{spec.name} on {hw.gpus} GPUs ({hw.gpus_per_node}/node, {hw.gpu_mem_gib:g} GiB), seq {work.seq_len} x "
          f"micro-batch {work.micro_batch} x {work.microbatches} microbatch(es), {work.dtype} compute / fp32 master, "
          f"{work.optimizer}, activation_checkpoint={work.activation_checkpoint}, pp schedule {work.pp_schedule}"
          + (f", routing skew {work.skew:g} (Zipf)" if work.skew else "")
          + (f", {replicas} replica slot(s) per EP rank" if replicas else ""))
    print(f"{len(cands)} foldings enumerated ({TP_NOTE}; {pp_note}); {len(fitting)} fit; planned in {elapsed:.2f} s")
    shown = fitting[: args.top] if fitting else cands[: args.top]
    if not fitting:
        print("Nothing fits; the smallest footprints:")
    print(table(shown))
    if fitting:
        print()
        print(explain_choice(spec, fitting[0], fitting[1] if len(fitting) > 1 else None, hw, work))
    return 0
