"""`dtensor-moe plan`: choose the folding (dp_replicate, dp_shard, cp; edp, ep, etp) from memory and traffic.

Every number comes from the placement plan: MoE weights from `plan_moe`, the other weights from
what `parallelize_model` does to them (FSDP2 Shard(0) over the same data-parallel axis the plan
uses for the router), and which ranks form each group from the mesh order in `mesh.py` (ETP
innermost, then EP, then EDP). Only tp=1 foldings are enumerated: `plan_moe` rejects tp > 1
(parallelize_moe does not shard the MoE input over TP), so those ranks fold into dp_shard/etp.

Model of one training step of one micro-batch per rank:
- memory per rank (rank 0, which holds the largest slices): fp32 sharded params, fp32 sharded
  grads, optimizer state (AdamW: two fp32 moments and a step scalar per tensor) -- FSDP2's
  MixedPrecisionPolicy keeps sharded params in fp32 and all-gathers in the compute dtype; the
  gathered working set (root unit kept gathered, current + prefetched block, one block's
  unsharded grads in compute and reduce dtype); and an activation estimate.
- bytes each rank sends per step: EP all-to-all and ETP gather/reduce-scatter of routed tokens
  (uniform routing, pairwise), FSDP all-gather (twice per block: forward and backward) and
  reduce-scatter (fp32), HSDP all-reduce over dp_replicate, ring-attention K/V passes under CP.
  Pairwise traffic is split by how many group peers share the rank's node; ring traffic by how
  many ring hops cross a node boundary (ranks r, r' share a node iff r // G == r' // G).
"""

import math
from dataclasses import asdict, dataclass, replace
from functools import lru_cache

from dtensor_moe.parallel.mesh import DENSE_AXES, EXPERT_AXES, MoEParallelDims, divisors
from dtensor_moe.parallel.plan import ShardStep, WeightPlan, axis_sizes, owned_box, plan_moe
from dtensor_moe.tools.presets import ModelSpec, resolve

GiB = 2**30
COMPUTE_BYTES = {"bf16": 2, "fp32": 4}
OPTIMIZER_MOMENTS = {"adamw": 2, "sgd": 0}
MASTER_BYTES = 4  # sharded params, grads and optimizer state are fp32 under either dtype
REDUCE_BYTES = 4  # gradients are reduced in fp32 (torchtitan's default reduce_dtype)
STEP_BYTES = 4  # AdamW's per-tensor step counter (a float32 scalar)
TP_NOTE = (
    "tp=1 only: plan_moe rejects tp > 1 (parallelize_moe does not shard the MoE input over TP); "
    "tensor parallelism of experts is etp"
)


@dataclass(frozen=True)
class Workload:
    seq_len: int = 4096
    micro_batch: int = 1
    dtype: str = "bf16"
    optimizer: str = "adamw"
    recompute: str = "full"  # "full": each block's activations are recomputed in backward

    def __post_init__(self):
        if self.dtype not in COMPUTE_BYTES:
            raise ValueError(f"dtype must be one of {sorted(COMPUTE_BYTES)}, got {self.dtype!r}")
        if self.optimizer not in OPTIMIZER_MOMENTS:
            raise ValueError(f"optimizer must be one of {sorted(OPTIMIZER_MOMENTS)}, got {self.optimizer!r}")
        if self.recompute not in ("none", "full"):
            raise ValueError(f"recompute must be 'none' or 'full', got {self.recompute!r}")
        if self.seq_len < 1 or self.micro_batch < 1:
            raise ValueError(f"seq_len and micro_batch must be >= 1, got {self.seq_len}, {self.micro_batch}")

    @property
    def compute_bytes(self) -> int:
        return COMPUTE_BYTES[self.dtype]


@dataclass(frozen=True)
class Hardware:
    gpus: int
    gpus_per_node: int = 8
    gpu_mem_gib: float = 80.0
    intra_bw: float = 450e9  # bytes/s one direction per GPU (NVLink)
    inter_bw: float = 50e9  # bytes/s per GPU (one 400 Gb/s NIC each)

    def __post_init__(self):
        if self.gpus < 1 or self.gpus_per_node < 1:
            raise ValueError(f"gpus and gpus_per_node must be >= 1, got {self.gpus}, {self.gpus_per_node}")
        if self.gpus % self.gpus_per_node and self.gpus > self.gpus_per_node:
            raise ValueError(f"gpus ({self.gpus}) must be a multiple of gpus_per_node ({self.gpus_per_node})")


# ---- placement: FSDP units and their weight plans -------------------------------------------


@dataclass(frozen=True)
class Unit:
    """One FSDP unit repeated `count` times (root, dense blocks, MoE blocks)."""

    name: str
    count: int
    plans: tuple[WeightPlan, ...]
    gathers_per_step: int  # all-gathers of its params per step


def _fsdp_plan(name: str, shape: tuple[int, ...], dims: MoEParallelDims, axis: str) -> WeightPlan:
    """What `fully_shard` in parallelize_model does to a weight outside the MoE: Shard(0) over `axis`."""
    wp = WeightPlan(name, "dense", shape, (ShardStep(axis, 0),), ("dp_replicate",), shape, False)
    local = tuple(s.stop - s.start for s in owned_box(wp, dims, 0))
    return replace(wp, local_shape=local, padded=shape[0] % axis_sizes(dims)[axis] != 0)


@lru_cache(maxsize=4096)
def _outer_plans(spec: ModelSpec, dense_dims: MoEParallelDims, axis: str):
    """Plans of the non-MoE weights; they depend on the dense folding only, so cached across ep/etp."""
    def plans(ws):
        return tuple(_fsdp_plan(n, s, dense_dims, axis) for n, s in ws)

    return plans(spec.root_weights()), plans(spec.layer_weights(dense_ffn=True)), plans(spec.layer_weights(dense_ffn=False))


def fsdp_units(spec: ModelSpec, dims: MoEParallelDims) -> tuple[Unit, ...]:
    moe_plans = tuple(plan_moe(spec.moe_config(), dims))
    # The plan shards the router over the data-parallel axis; parallelize_model uses the same mesh.
    dp_axis = next(wp for wp in moe_plans if wp.role == "dense").fsdp_step.axis
    root, dense_block, moe_block = _outer_plans(spec, replace(dims, ep=1, etp=1), dp_axis)
    units = [Unit("root", 1, root, 1)]  # parallelize_model keeps the root gathered after forward
    if spec.n_dense_layers:
        units.append(Unit("dense block", spec.n_dense_layers, dense_block, 2))
    units.append(Unit("moe block", spec.n_moe_layers, (*moe_block, *moe_plans), 2))
    return tuple(units)


def held_numel(units, dims: MoEParallelDims, rank: int) -> int:
    """Elements of all parameters that `rank` holds (its owned boxes)."""
    return sum(u.count * math.prod(s.stop - s.start for s in owned_box(wp, dims, rank)) for u in units for wp in u.plans)


@dataclass(frozen=True)
class Footprint:
    """Rank 0's share of every FSDP unit (rank 0 holds the largest slices): all the planner needs."""

    sharded: tuple[tuple[str, int, int], ...]  # (FSDP axis, all-gathers per step, elements held)
    tensors: int  # parameter tensors (AdamW keeps a step counter per tensor)
    gathered_root: int  # unsharded elements of the root unit
    gathered_block: int  # unsharded elements of the largest block unit (EP x ETP slice for experts)

    @property
    def held(self) -> int:
        return sum(n for _, _, n in self.sharded)


def footprint(units, dims: MoEParallelDims) -> Footprint:
    sharded: dict[tuple[str, int], int] = {}
    gathered = {}
    for u in units:
        # FSDP all-gathers every shard padded to rank 0's (the largest) size.
        gathered[u.name] = sum(math.prod(wp.local_shape) * axis_sizes(dims)[wp.fsdp_step.axis] for wp in u.plans)
        for wp in u.plans:
            key = (wp.fsdp_step.axis, u.gathers_per_step)
            sharded[key] = sharded.get(key, 0) + u.count * math.prod(wp.local_shape)
    return Footprint(
        tuple((a, g, n) for (a, g), n in sharded.items()),
        sum(u.count * len(u.plans) for u in units),
        gathered["root"],
        max(v for name, v in gathered.items() if name != "root"),
    )


# ---- memory ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Memory:
    params: float
    grads: float
    optimizer: float
    gathered: float
    activations: float

    @property
    def states(self) -> float:
        """Params + grads + optimizer state: what stays allocated between steps."""
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> float:
        return self.states + self.gathered + self.activations


def state_bytes(held: int, tensors: int, work: Workload) -> tuple[int, int, int]:
    """(params, grads, optimizer state) bytes of a rank holding `held` elements of `tensors` parameters."""
    moments = OPTIMIZER_MOMENTS[work.optimizer]
    opt = held * MASTER_BYTES * moments + (tensors * STEP_BYTES if moments else 0)
    return held * MASTER_BYTES, held * MASTER_BYTES, opt


def tokens_per_rank(work: Workload, dims: MoEParallelDims) -> int:
    return work.micro_batch * work.seq_len // dims.cp


def activation_bytes(spec: ModelSpec, dims: MoEParallelDims, work: Workload) -> float:
    """Saved activations per rank (estimate): inputs and outputs of every linear, routed copies, logits.

    MoE: after the ETP gather a rank holds etp * top_k * T routed tokens of width D and the same
    tokens' F/etp-wide hidden activations (three of them), so the hidden part is independent of etp;
    the combine keeps the experts' D-wide outputs of those pairs for the routing weights' gradient.
    """
    T, b, D, k = tokens_per_rank(work, dims), work.compute_bytes, spec.dim, spec.top_k
    attn = sum(s[0] + s[-1] for _, s in spec.attention if len(s) == 2)
    common = 3 * D + attn  # two norm inputs and the residual, plus attention
    moe = k * (2 * dims.etp * D + 3 * spec.moe_hidden_dim) + 3 * spec.moe_hidden_dim * spec.num_shared_experts
    moe_layer = T * b * (common + moe) + T * spec.num_experts * 4  # fp32 router scores
    dense_layer = T * b * (common + 3 * spec.dense_hidden_dim)
    logits = T * spec.vocab_size * (b + 8)  # logits, fp32 copy for the loss, its gradient
    if work.recompute == "full":  # block inputs, plus one block's activations while it is recomputed
        biggest = max(moe_layer if spec.n_moe_layers else 0, dense_layer if spec.n_dense_layers else 0)
        return spec.n_layers * T * D * b + biggest + logits
    return spec.n_moe_layers * moe_layer + spec.n_dense_layers * dense_layer + logits


def rank_memory(spec: ModelSpec, dims: MoEParallelDims, work: Workload, fp: Footprint) -> Memory:
    params, grads, opt = state_bytes(fp.held, fp.tensors, work)
    b = work.compute_bytes
    # Root stays gathered; one block computing while the next is prefetched; one block's unsharded
    # grads in compute dtype plus their reduce-dtype copy for the reduce-scatter.
    working = b * (fp.gathered_root + 2 * fp.gathered_block) + fp.gathered_block * (b + REDUCE_BYTES)
    return Memory(params, grads, opt, working, activation_bytes(spec, dims, work))


# ---- communication ---------------------------------------------------------------------------


def mesh_geometry(dims: MoEParallelDims) -> dict[str, tuple[int, int]]:
    """(group size, rank stride) of every mesh axis, from the mesh order (row-major, last axis innermost)."""
    geo = {}
    for axes, shape in ((DENSE_AXES, dims.dense_shape), (EXPERT_AXES, dims.expert_shape)):
        stride = 1
        for axis, size in zip(reversed(axes), reversed(shape)):
            geo[axis] = (size, stride)
            stride *= size
    geo["dp_shard_cp"] = (dims.dp_shard * dims.cp, geo["cp"][1])  # the flattened (dp_shard, cp) pair
    return geo


def pairwise_intra_fraction(size: int, stride: int, G: int) -> float:
    """Share of a rank's peers (rank 0's group) that sit on its node: members are 0, s, 2s, ..."""
    if size == 1:
        return 0.0
    on_node = min(size, -(-G // stride)) if stride < G else 1
    return (on_node - 1) / (size - 1)


def ring_inter_fraction(size: int, stride: int, G: int) -> float:
    """Share of ring hops (rank 0's group, in rank order) that cross a node boundary."""
    nodes = size if stride >= G else (size - 1) * stride // G + 1
    return 0.0 if nodes == 1 else nodes / size


@dataclass(frozen=True)
class Traffic:
    intra: float
    inter: float


def _split(total: float, inter_fraction: float) -> Traffic:
    return Traffic(total * (1 - inter_fraction), total * inter_fraction)


def distinct_ranks(num_experts: int, top_k: int, ep: int) -> float:
    """Expected EP ranks a token's top-k experts land on under uniform routing: the rows the
    dispatch sends per token, and the combine returns."""
    local = num_experts // ep
    return ep * (1 - math.comb(num_experts - local, top_k) / math.comb(num_experts, top_k))


def comm_bytes(spec: ModelSpec, dims: MoEParallelDims, work: Workload, gpus_per_node: int, fp: Footprint) -> dict[str, Traffic]:
    """Bytes one rank sends per step, per collective kind, split intra-/inter-node."""
    G, b = gpus_per_node, work.compute_bytes
    T = tokens_per_rank(work, dims)
    recompute = work.recompute == "full"
    geo = mesh_geometry(dims)

    def pair(axis, total):
        return _split(total, 1 - pairwise_intra_fraction(*geo[axis], G)) if total else Traffic(0, 0)

    def ring(axis, total):
        return _split(total, ring_inter_fraction(*geo[axis], G)) if total else Traffic(0, 0)

    # Dispatch and combine (a token once per rank holding one of its experts, each way) in forward,
    # their reverses in backward, forward again when recomputing.
    rows = 2 * distinct_ranks(spec.num_experts, spec.top_k, dims.ep)
    routed = (2 + recompute) * T * rows * spec.dim * b * spec.n_moe_layers
    r = dims.dp_replicate
    return {
        "ep_all_to_all": pair("ep", routed * (dims.ep - 1) / dims.ep),
        "etp_gather_scatter": pair("etp", routed * (dims.etp - 1)),
        "cp_ring_kv": ring("cp", (3 + recompute) * (dims.cp - 1) * T * spec.kv_width * b * spec.n_layers),
        "fsdp_all_gather": _sum(ring(a, g * (geo[a][0] - 1) * n * b) for a, g, n in fp.sharded),
        "fsdp_reduce_scatter": _sum(ring(a, (geo[a][0] - 1) * n * REDUCE_BYTES) for a, _, n in fp.sharded),
        "hsdp_all_reduce": ring("dp_replicate", 2 * (r - 1) / r * fp.held * REDUCE_BYTES),
    }


def _sum(traffics) -> Traffic:
    ts = list(traffics)
    return Traffic(sum(t.intra for t in ts), sum(t.inter for t in ts))


# ---- enumeration and ranking -----------------------------------------------------------------


@dataclass(frozen=True)
class Candidate:
    dims: MoEParallelDims
    memory: Memory
    comm: dict[str, Traffic]
    comm_time_s: float  # if nothing overlapped: intra / intra_bw + inter / inter_bw
    tokens: int  # per rank per step
    fits: bool

    @property
    def time_per_token(self) -> float:
        return self.comm_time_s / self.tokens

    @property
    def intra(self) -> float:
        return sum(t.intra for t in self.comm.values())

    @property
    def inter(self) -> float:
        return sum(t.inter for t in self.comm.values())


def foldings(world: int, spec: ModelSpec, work: Workload):
    """Every MoEParallelDims with tp=1 that could be valid. The divisibility filters only prune the
    search (cp must split the sequence); plan_moe remains the judge of validity."""
    moe = spec.moe_config()
    world_divs = divisors(world)
    for dp_rep in world_divs:
        rest = world // dp_rep
        rest_divs = [d for d in world_divs if rest % d == 0]
        for cp in rest_divs:
            if work.seq_len % cp:
                continue
            for ep in rest_divs:
                if moe.num_experts % ep:
                    continue
                for etp in rest_divs:
                    if (rest // ep) % etp == 0 and moe.hidden_dim % etp == 0:
                        yield MoEParallelDims(world, dp_replicate=dp_rep, cp=cp, ep=ep, etp=etp)


def footprint_key(dims: MoEParallelDims) -> tuple:
    """What rank 0's footprint depends on: the sizes of the axes the plan shards over (dp_shard*cp,
    ep, etp and so edp) and whether the dense axis is dp_shard or dp_shard_cp. tests/test_planner.py
    checks this against a fresh plan for every folding of a smaller world."""
    return dims.dp_shard * dims.cp, dims.cp > 1, dims.ep, dims.etp


def evaluate(spec: ModelSpec, dims: MoEParallelDims, work: Workload, hw: Hardware, fp: Footprint | None = None) -> Candidate:
    fp = fp or footprint(fsdp_units(spec, dims), dims)
    mem = rank_memory(spec, dims, work, fp)
    comm = comm_bytes(spec, dims, work, hw.gpus_per_node, fp)
    t = sum(c.intra / hw.intra_bw + c.inter / hw.inter_bw for c in comm.values())
    return Candidate(dims, mem, comm, t, tokens_per_rank(work, dims), mem.total <= hw.gpu_mem_gib * GiB)


def plan(spec: ModelSpec, work: Workload, hw: Hardware) -> list[Candidate]:
    """All valid candidates: those that fit first, by communication time per token; then the rest by memory."""
    footprints: dict[tuple, Footprint | None] = {}
    cands = []
    for dims in foldings(hw.gpus, spec, work):
        key = footprint_key(dims)
        if key not in footprints:
            try:
                footprints[key] = footprint(fsdp_units(spec, dims), dims)
            except ValueError:  # plan_moe rejected the folding
                footprints[key] = None
        if footprints[key] is not None:
            cands.append(evaluate(spec, dims, work, hw, footprints[key]))
    return sorted(cands, key=lambda c: (not c.fits, c.time_per_token if c.fits else c.memory.total, c.memory.total))


# ---- output ----------------------------------------------------------------------------------


def _size(x: float, base: int) -> str:
    """Bytes with a unit that keeps 3 significant digits: GiB/MiB/KiB (base 1024) or GB/MB/kB (1000)."""
    units = ("GiB", "MiB", "KiB") if base == 1024 else ("GB", "MB", "kB")
    for i, u in enumerate(units):
        scale = base ** (3 - i)
        if abs(x) >= scale or u in ("KiB", "kB"):
            return f"{x / scale:.3g} {u}"


def table(cands: list[Candidate]) -> str:
    cols = ("#", "dp_rep", "dp_shard", "cp", "edp", "ep", "etp", "params", "grads", "optim", "gather", "activ",
            "total", "intra/step", "inter/step", "comm ms", "us/token")
    rows = [cols]
    for i, c in enumerate(cands, 1):
        d, m = c.dims, c.memory
        mem = [_size(v, 1024) for v in (m.params, m.grads, m.optimizer, m.gathered, m.activations, m.total)]
        rows.append((str(i), *(str(v) for v in (d.dp_replicate, d.dp_shard, d.cp, d.edp, d.ep, d.etp)), *mem,
                     _size(c.intra, 1000), _size(c.inter, 1000), f"{c.comm_time_s * 1e3:.1f}", f"{c.time_per_token * 1e6:.2f}"))
    widths = [max(len(r[j]) for r in rows) for j in range(len(cols))]
    # Bars between the dense axes, the expert axes, memory and traffic.
    return "\n".join(
        " ".join(v.rjust(w) + (" |" if j in (3, 6, 12, 14) else "") for j, (v, w) in enumerate(zip(r, widths))) for r in rows
    )


def _node_span(dims: MoEParallelDims, axis: str, G: int) -> int:
    size, stride = mesh_geometry(dims)[axis]
    return size if stride >= G else (size - 1) * stride // G + 1


def explain_choice(spec: ModelSpec, best: Candidate, runner_up: Candidate | None, hw: Hardware) -> str:
    d, m, G = best.dims, best.memory, hw.gpus_per_node
    E = spec.num_experts
    ep_nodes = _node_span(d, "ep", G)
    a2a = best.comm["ep_all_to_all"]
    a2a_total = a2a.intra + a2a.inter
    parts = {"parameters": m.params, "gradients": m.grads, "optimizer state": m.optimizer,
             "gathered FSDP buffers": m.gathered, "activations": m.activations}
    biggest = max(parts, key=parts.get)
    lines = [
        f"Top choice: ep={d.ep}, etp={d.etp}, edp={d.edp} for the experts; dp_replicate={d.dp_replicate}, "
        f"dp_shard={d.dp_shard}, cp={d.cp} for the dense weights.",
        f"- Each rank holds {E // d.ep} of the {E} experts"
        + (" whole (etp=1: no expert tensor parallelism, so no token gather inside an expert)." if d.etp == 1
           else f", each split {d.etp} ways along its hidden dim over {d.etp} neighbouring ranks (ETP)."),
        f"- EDP is not DP: the {d.dp_shard * d.cp} data-parallel ranks of a replica fold into "
        f"edp x ep x etp = {d.edp} x {d.ep} x {d.etp}; "
        + (f"FSDP shards each EP x ETP slice over the {d.edp} EDP ranks" if d.edp > 1 else "EP x ETP alone shard the experts (edp=1)")
        + (f", and {d.dp_replicate} replicas (HSDP) all-reduce the sharded gradients." if d.dp_replicate > 1 else "."),
        f"- An EP group spans {ep_nodes} node(s) of {G} GPUs: "
        + (f"{a2a.intra / a2a_total:.0%} of the all-to-all bytes stay inside a node." if a2a_total else "no all-to-all traffic."),
        f"- Memory per rank: {_size(m.total, 1024)} of {hw.gpu_mem_gib:g} GiB; the largest part is {biggest} "
        f"({_size(parts[biggest], 1024)}).",
        f"- Communication per step: {_size(best.intra, 1000)} intra-node, {_size(best.inter, 1000)} inter-node "
        f"(~{best.comm_time_s * 1e3:.0f} ms if not overlapped, for {best.tokens} tokens per rank).",
    ]
    if runner_up is not None:
        r = runner_up.dims
        lines.append(
            f"- Runner-up ep={r.ep}, etp={r.etp}, edp={r.edp}, dp_replicate={r.dp_replicate}, cp={r.cp} costs "
            f"{runner_up.time_per_token / best.time_per_token:.2f}x the communication time per token "
            f"({_size(runner_up.inter, 1000)} inter-node vs {_size(best.inter, 1000)})."
        )
    return "\n".join(lines)


def candidate_dict(c: Candidate) -> dict:
    d = c.dims
    return {
        "dp_replicate": d.dp_replicate, "dp_shard": d.dp_shard, "cp": d.cp, "tp": d.tp,
        "edp": d.edp, "ep": d.ep, "etp": d.etp,
        "memory_bytes": {**asdict(c.memory), "total": c.memory.total},
        "comm_bytes": {k: asdict(v) for k, v in c.comm.items()},
        "comm_time_s": c.comm_time_s, "tokens_per_rank": c.tokens, "fits": c.fits,
    }


def add_arguments(p):
    p.add_argument("--model", required=True, help="preset (deepseek-v3-671b, qwen3-235b-a22b, qwen3-30b-a3b, "
                   "mixtral-8x7b), a training config .toml, or its name under configs/")
    p.add_argument("--gpus", type=int, required=True)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--gpu-mem", type=float, default=80.0, help="GiB per GPU")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per rank per step")
    p.add_argument("--dtype", choices=sorted(COMPUTE_BYTES), default="bf16", help="compute dtype (master weights fp32)")
    p.add_argument("--optimizer", choices=sorted(OPTIMIZER_MOMENTS), default="adamw")
    p.add_argument("--recompute", choices=("none", "full"), default="full", help="activation checkpointing per block")
    p.add_argument("--intra-bw", type=float, default=450.0, help="GB/s per GPU inside a node")
    p.add_argument("--inter-bw", type=float, default=50.0, help="GB/s per GPU across nodes")
    p.add_argument("--top", type=int, default=10)
    p.add_argument("--json", action="store_true")


def run(args) -> int:
    import json
    import sys
    import time

    t0 = time.perf_counter()
    try:
        spec = resolve(args.model)
        work = Workload(args.seq_len, args.micro_batch, args.dtype, args.optimizer, args.recompute)
        hw = Hardware(args.gpus, args.gpus_per_node, args.gpu_mem, args.intra_bw * 1e9, args.inter_bw * 1e9)
    except ValueError as e:
        print(f"dtensor-moe plan: {e}", file=sys.stderr)
        return 2
    cands = plan(spec, work, hw)
    fitting = [c for c in cands if c.fits]
    elapsed = time.perf_counter() - t0
    if args.json:
        print(json.dumps({
            "model": spec.name, "hardware": asdict(hw), "workload": asdict(work), "note": TP_NOTE,
            "enumerated": len(cands), "fitting": len(fitting), "elapsed_s": elapsed,
            "candidates": [candidate_dict(c) for c in cands[: args.top]],
        }, indent=1))
        return 0
    print(f"{spec.name} on {hw.gpus} GPUs ({hw.gpus_per_node}/node, {hw.gpu_mem_gib:g} GiB), seq {work.seq_len} x "
          f"micro-batch {work.micro_batch}, {work.dtype} compute / fp32 master, {work.optimizer}, recompute={work.recompute}")
    print(f"{len(cands)} foldings enumerated ({TP_NOTE}); {len(fitting)} fit; planned in {elapsed:.2f} s")
    shown = fitting[: args.top] if fitting else cands[: args.top]
    if not fitting:
        print("Nothing fits; the smallest footprints:")
    print(table(shown))
    if fitting:
        print()
        print(explain_choice(spec, fitting[0], fitting[1] if len(fitting) > 1 else None, hw))
    return 0


def predicted_state_bytes(model_cfg, dims: MoEParallelDims, rank: int, optimizer: str = "adamw") -> dict[str, int]:
    """Params, grads and optimizer-state bytes the planner predicts for `rank` of a training run of
    `dtensor_moe.train.model.ModelConfig` (sharded state is fp32 whatever the compute dtype)."""
    from dtensor_moe.tools.presets import spec_from_model_config

    units = fsdp_units(spec_from_model_config(model_cfg), dims)
    tensors = sum(u.count * len(u.plans) for u in units)
    work = Workload(dtype="fp32", optimizer=optimizer)
    return dict(zip(("params", "grads", "optimizer"), state_bytes(held_numel(units, dims, rank), tensors, work)))
