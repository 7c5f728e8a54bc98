"""The planner's output and command line: the ranked table, the top choice in plain words, JSON,
and `dtensor-moe plan`'s `add_arguments` / `run`."""

from dataclasses import asdict

from dtensor_moe.parallel.mesh import PP_STAGES_PER_RANK, MoEParallelDims, divisors
from dtensor_moe.parallel.plan import check_pipeline
from dtensor_moe.validate import check_int, check_positive
from dtensor_moe.tools.planner.cost_model import (
    COMPUTE_BYTES,
    OPTIMIZER_MOMENTS,
    RECOMPUTE,
    Hardware,
    Workload,
    mesh_geometry,
    node_span,
)
from dtensor_moe.tools.planner.search import TP_NOTE, Candidate, pipeline_degrees, plan
from dtensor_moe.tools.presets import PRESETS, ModelSpec, resolve


def _size(x: float, base: int) -> str:
    """Bytes with a unit that keeps 3 significant digits: GiB/MiB/KiB (base 1024) or GB/MB/kB (1000)."""
    units = ("GiB", "MiB", "KiB") if base == 1024 else ("GB", "MB", "kB")
    for i, u in enumerate(units):
        scale = base ** (3 - i)
        if abs(x) >= scale or u in ("KiB", "kB"):
            return f"{x / scale:.3g} {u}"


def table(cands: list[Candidate]) -> str:
    cols = ("#", "pp", "dp_rep", "dp_shard", "cp", "tp", "edp", "ep", "etp", "params", "grads", "optim", "gather",
            "activ", "total", "intra/step", "inter/step", "comm ms", "bubble", "us/token")
    rows = [cols]
    for i, c in enumerate(cands, 1):
        d, m = c.dims, c.memory
        mem = [_size(v, 1024) for v in (m.params, m.grads, m.optimizer, m.gathered, m.activations, m.total)]
        rows.append((str(i), *(str(v) for v in (d.pp, d.dp_replicate, d.dp_shard, d.cp, d.tp, d.edp, d.ep, d.etp)), *mem,
                     _size(c.intra, 1000), _size(c.inter, 1000), f"{c.comm_time_s * 1e3:.1f}", f"{c.bubble:.0%}",
                     f"{c.time_per_token * 1e6:.2f}"))
    widths = [max(len(r[j]) for r in rows) for j in range(len(cols))]
    # Bars after pp, between the dense axes, the expert axes, memory and traffic.
    return "\n".join(
        " ".join(v.rjust(w) + (" |" if j in (1, 5, 8, 14, 16) else "") for j, (v, w) in enumerate(zip(r, widths)))
        for r in rows
    )


def explain_choice(spec: ModelSpec, best: Candidate, runner_up: Candidate | None, hw: Hardware,
                   work: Workload = Workload()) -> str:
    d, m, G, s = best.dims, best.memory, hw.gpus_per_node, best.share
    E = spec.num_experts
    ep_nodes = node_span(*mesh_geometry(d)["ep"], G)
    a2a = best.comm["ep_all_to_all"]
    a2a_total = a2a.intra + a2a.inter
    parts = {"parameters": m.params, "gradients": m.grads, "optimizer state": m.optimizer,
             "gathered FSDP buffers": m.gathered, "activations": m.activations}
    biggest = max(parts, key=parts.get)
    lines = [
        f"Top choice: ep={d.ep}, etp={d.etp}, edp={d.edp} for the experts; dp_replicate={d.dp_replicate}, "
        f"dp_shard={d.dp_shard}, cp={d.cp}, tp={d.tp} for the dense weights; pp={d.pp}.",
        f"- Each rank holds {E // d.ep} of the {E} experts"
        + (" whole (etp=1: no expert tensor parallelism, so no token gather inside an expert)." if d.etp == 1
           else f", each split {d.etp} ways along its hidden dim over {d.etp} neighbouring ranks (ETP)."),
        f"- EDP is not DP: the {d.dp_shard * d.cp * d.tp} ranks of a replica with their own tokens fold into "
        f"edp x ep x etp = {d.edp} x {d.ep} x {d.etp}; "
        + (f"FSDP shards each EP x ETP slice over the {d.edp} EDP ranks" if d.edp > 1 else "EP x ETP alone shard the experts (edp=1)")
        + (f", and {d.dp_replicate} replicas (HSDP) all-reduce the sharded gradients." if d.dp_replicate > 1 else "."),
        *([f"- Dense TP={d.tp} (sequence-parallel): attention split by heads over {d.tp} neighbouring ranks, each of "
           f"which routes its own {best.tokens} tokens through the MoE."] if d.tp > 1 else []),
        *([f"- PP={d.pp} outermost ({work.pp_schedule}, {work.microbatches} microbatches): {d.stage_size} ranks per stage; "
           f"the rank with the most memory holds {s.layers} layer(s)" + " and the embedding" * s.first
           + " and the head" * s.last + f"; pipeline bubble {best.bubble:.0%} of the step."] if d.pp > 1 else []),
        f"- An EP group spans {ep_nodes} node(s) of {G} GPUs: "
        + (f"{a2a.intra / a2a_total:.0%} of the all-to-all bytes stay inside a node." if a2a_total else "no all-to-all traffic."),
        f"- Memory per rank: {_size(m.total, 1024)} of {hw.gpu_mem_gib:g} GiB; the largest part is {biggest} "
        f"({_size(parts[biggest], 1024)}).",
        f"- Communication per step: {_size(best.intra, 1000)} intra-node, {_size(best.inter, 1000)} inter-node "
        f"(~{best.comm_time_s * 1e3:.0f} ms if not overlapped, for {best.tokens:g} tokens per rank).",
    ]
    if runner_up is not None:
        r = runner_up.dims
        lines.append(
            f"- Runner-up ep={r.ep}, etp={r.etp}, edp={r.edp}, dp_replicate={r.dp_replicate}, cp={r.cp}, tp={r.tp}, "
            f"pp={r.pp} costs "
            f"{runner_up.time_per_token / best.time_per_token:.2f}x the communication time per token "
            f"({_size(runner_up.inter, 1000)} inter-node vs {_size(best.inter, 1000)})."
        )
    return "\n".join(lines)


def candidate_dict(c: Candidate) -> dict:
    d = c.dims
    return {
        "pp": d.pp, "dp_replicate": d.dp_replicate, "dp_shard": d.dp_shard, "cp": d.cp, "tp": d.tp,
        "edp": d.edp, "ep": d.ep, "etp": d.etp, "bubble": c.bubble, "stage": c.share._asdict(),
        "memory_bytes": {**c.memory._asdict(), "total": c.memory.total},
        "comm_bytes": {k: v._asdict() for k, v in c.comm.items()},
        "comm_time_s": c.comm_time_s, "tokens_per_rank": c.tokens, "fits": c.fits,
    }


def add_arguments(p):
    p.add_argument("--model", required=True, help=f"preset ({', '.join(PRESETS)}), a training config .toml, "
                   "or its name under configs/")
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
    p.add_argument("--recompute", choices=RECOMPUTE, default="full", help="activation checkpointing per block")
    p.add_argument("--intra-bw", type=float, default=450.0, help="GB/s per GPU inside a node")
    p.add_argument("--inter-bw", type=float, default=50.0, help="GB/s per GPU across nodes")
    p.add_argument("--top", type=int, default=10, help="rows to show (>= 1)")
    p.add_argument("--json", action="store_true")


def _check_flags(args):
    """The flags by their own names, before they become Workload / Hardware fields (GB/s -> bytes/s)."""
    for flag in ("gpus", "gpus_per_node", "seq_len", "micro_batch", "microbatches", "top"):
        check_int("--" + flag.replace("_", "-"), getattr(args, flag))
    check_int("--pp", args.pp, minimum=0)
    for flag in ("gpu_mem", "intra_bw", "inter_bw"):
        check_positive("--" + flag.replace("_", "-"), getattr(args, flag))
    if args.pp and args.gpus % args.pp:
        raise ValueError(f"--pp ({args.pp}) must divide --gpus ({args.gpus}): pipeline stages of equal size; "
                         f"valid --pp: {divisors(args.gpus)} (or 0: try each)")


def _check_pipeline_flags(args, spec: ModelSpec):
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
        spec = resolve(args.model)
        _check_pipeline_flags(args, spec)
        work = Workload(args.seq_len, args.micro_batch, args.dtype, args.optimizer, args.recompute, args.microbatches,
                        args.pp_schedule)
        hw = Hardware(args.gpus, args.gpus_per_node, args.gpu_mem, args.intra_bw * 1e9, args.inter_bw * 1e9)
    except ValueError as e:
        print(f"dtensor-moe plan: {e}", file=sys.stderr)
        return 2
    cands = plan(spec, work, hw, args.pp or None)
    fitting = [c for c in cands if c.fits]
    elapsed = time.perf_counter() - t0
    tried = [args.pp] if args.pp else pipeline_degrees(hw.gpus, spec, work, hw.gpus_per_node)
    pp_note = f"pp tried: {tried}" + (" (pp > 1 needs --microbatches >= pp under 1f1b)"
                                      if tried == [1] and work.pp_schedule == "1f1b" else "")
    if args.json:
        print(json.dumps({
            "model": spec.name, "hardware": asdict(hw), "workload": asdict(work), "note": TP_NOTE,
            "pp_tried": tried, "enumerated": len(cands), "fitting": len(fitting), "elapsed_s": elapsed,
            "candidates": [candidate_dict(c) for c in cands[: args.top]],
        }, indent=1))
        return 0
    print(f"{spec.name} on {hw.gpus} GPUs ({hw.gpus_per_node}/node, {hw.gpu_mem_gib:g} GiB), seq {work.seq_len} x "
          f"micro-batch {work.micro_batch} x {work.microbatches} microbatch(es), {work.dtype} compute / fp32 master, "
          f"{work.optimizer}, recompute={work.recompute}, pp schedule {work.pp_schedule}")
    print(f"{len(cands)} foldings enumerated ({TP_NOTE}; {pp_note}); {len(fitting)} fit; planned in {elapsed:.2f} s")
    shown = fitting[: args.top] if fitting else cands[: args.top]
    if not fitting:
        print("Nothing fits; the smallest footprints:")
    print(table(shown))
    if fitting:
        print()
        print(explain_choice(spec, fitting[0], fitting[1] if len(fitting) > 1 else None, hw, work))
    return 0
