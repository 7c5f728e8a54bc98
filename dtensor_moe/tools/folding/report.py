"""The folding search's output: the ranked table, the top choice in plain words, JSON rows."""

from dtensor_moe.tools.folding.geometry import mesh_geometry, node_span
from dtensor_moe.tools.folding.search import Candidate
from dtensor_moe.tools.folding.workload import Hardware, Workload
from dtensor_moe.tools.presets import ModelShape


def _size(x: float, base: int) -> str:
    """Bytes with a unit that keeps 3 significant digits: GiB/MiB/KiB (base 1024) or GB/MB/kB (1000)."""
    units = ("GiB", "MiB", "KiB") if base == 1024 else ("GB", "MB", "kB")
    for i, u in enumerate(units):
        scale = base ** (3 - i)
        if abs(x) >= scale or u in ("KiB", "kB"):
            return f"{x / scale:.3g} {u}"


def table(cands: list[Candidate]) -> str:
    """The ranked rows; under skewed routing also max / mean rows per EP rank, without replicas and with the
    model's replica slots."""
    skewed = next((c.balance for c in cands if c.balance is not None), None)
    replicas = len(skewed.slots[0]) if skewed else 0
    rows_cols = ("rows max/mean",) * (skewed is not None) + (f"with r={replicas}",) * (replicas > 0)
    cols = ("#", "pp", "dp_rep", "dp_shard", "cp", "tp", "edp", "ep", "etp", *rows_cols, "params", "grads", "optim",
            "gather", "activ", "total", "intra/step", "inter/step", "comm ms", "bubble", "us/token")
    rows = [cols]
    for i, c in enumerate(cands, 1):
        d, m, b = c.dims, c.memory, c.balance
        mem = [_size(v, 1024) for v in (m.params, m.grads, m.optimizer, m.gathered, m.activations, m.total)]
        degrees = (d.pp, d.dp_replicate, d.dp_shard, d.cp, d.tp, d.edp, d.ep, d.etp)
        balance = (f"{b.imbalance:.3f}", f"{b.replica_imbalance:.3f}")[:len(rows_cols)] if b else ()
        rows.append((str(i), *(str(v) for v in degrees), *balance, *mem, _size(c.intra, 1000), _size(c.inter, 1000),
                     f"{c.comm_time_s * 1e3:.1f}", f"{c.bubble:.0%}", f"{c.time_per_token * 1e6:.2f}"))
    widths = [max(len(r[j]) for r in rows) for j in range(len(cols))]
    # Bars after pp, between the dense axes, the expert axes (and their rows per EP rank), memory and traffic.
    n = len(rows_cols)
    bars = (1, 5, 8, 8 + n, 14 + n, 16 + n) if n else (1, 5, 8, 14, 16)
    return "\n".join(
        " ".join(v.rjust(w) + (" |" if j in bars else "") for j, (v, w) in enumerate(zip(r, widths)))
        for r in rows
    )


def explain_choice(spec: ModelShape, best: Candidate, runner_up: Candidate | None, hw: Hardware,
                   work: Workload = Workload()) -> str:
    """The top choice in plain words (`dtensor-moe plan`'s closing lines): its degrees, how the experts are
    split and sharded, dense TP and PP where used, how many nodes an EP group spans, memory per rank and its
    largest part, the traffic per step, the rows per EP rank under skewed routing, and the runner-up's cost
    relative to it. `best`, `runner_up` (or None): the first two fitting candidates of `rank_foldings`; `spec`,
    `hw` and `work` what they were searched for (`work` names the schedule, microbatches and skew)."""
    d, m, G, s = best.dims, best.memory, hw.gpus_per_node, best.share
    E = spec.moe.num_experts
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
        + (f"FSDP shards each EP x ETP slice over the {d.edp} EDP ranks" if d.edp > 1
           else "EP x ETP alone shard the experts (edp=1)")
        + (f", and {d.dp_replicate} replicas (HSDP) all-reduce the sharded gradients." if d.dp_replicate > 1 else "."),
        *([f"- Dense TP={d.tp} (sequence-parallel): attention split by heads over {d.tp} neighbouring ranks, each of "
           f"which routes its own {best.tokens} tokens through the MoE."] if d.tp > 1 else []),
        *([f"- PP={d.pp} outermost ({work.pp_schedule}, {work.microbatches} microbatches): "
           f"{d.stage_size} ranks per stage; the rank with the most memory holds {s.layers} layer(s)"
           + " and the embedding" * s.first + " and the head" * s.last
           + f"; pipeline bubble {best.bubble:.0%} of the step."] if d.pp > 1 else []),
        f"- An EP group spans {ep_nodes} node(s) of {G} GPUs: "
        + (f"{a2a.intra / a2a_total:.0%} of the all-to-all bytes stay inside a node." if a2a_total
           else "no all-to-all traffic."),
        f"- Memory per rank: {_size(m.total, 1024)} of {hw.gpu_mem_gib:g} GiB; the largest part is {biggest} "
        f"({_size(parts[biggest], 1024)}).",
        f"- Communication per step: {_size(best.intra, 1000)} intra-node, {_size(best.inter, 1000)} inter-node "
        f"(~{best.comm_time_s * 1e3:.0f} ms if not overlapped, for {best.tokens:g} tokens per rank).",
    ]
    if (b := best.balance) is not None:
        slots = len(b.slots[0])
        lines.append(
            f"- Skewed routing ({work.skew:g}, hottest expert {b.hottest}): the busiest EP rank computes "
            f"{b.imbalance:.2f}x the mean rows"
            + (f", {b.replica_imbalance:.2f}x with {slots} replica slot(s) per EP rank" if slots else "")
            + "; its routed rows set the all-to-all and the expert activations priced above.")
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
    """Candidate `c` as a JSON row (`dtensor-moe plan --json`): its degrees, the bubble, the stage of the rank with
    the most memory, memory bytes by part with their total, traffic bytes per collective ({"intra", "inter"}),
    the communication time, tokens per rank and whether it fits; under skewed routing also "ep_rows", the rows
    per EP rank without and with replica slots."""
    d, b = c.dims, c.balance
    return {
        "pp": d.pp, "dp_replicate": d.dp_replicate, "dp_shard": d.dp_shard, "cp": d.cp, "tp": d.tp,
        "edp": d.edp, "ep": d.ep, "etp": d.etp, "bubble": c.bubble, "stage": c.share._asdict(),
        "memory_bytes": {**c.memory._asdict(), "total": c.memory.total},
        "comm_bytes": {k: v._asdict() for k, v in c.comm.items()},
        "comm_time_s": c.comm_time_s, "tokens_per_rank": c.tokens, "fits": c.fits,
        **({"ep_rows": {
            "hottest_expert": b.hottest, "rows_per_rank": list(b.rows), "max_over_mean": b.imbalance,
            "replica_slots": [list(row) for row in b.slots], "replica_rows_per_rank": list(b.replica_rows),
            "replica_max_over_mean": b.replica_imbalance, "replica_copies_busiest_rank": b.copies,
        }} if b else {}),
    }
