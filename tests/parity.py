"""Worker-side check: a parallelized MoE against the single-process reference, on every rank.

Runs inside harness workers. Every rank builds the same float64 reference MoE and the same global
batch (the concatenation of all data-parallel groups' batches), parallelizes a copy, runs its own
slice (under cp and tp its part of each of its group's sequences, as sequence parallelism hands
the MoE), and
compares output, input gradient, every parameter gradient, load-balancing statistics and the
ownership of every weight slice against the reference.
"""

import contextlib
import functools
from dataclasses import dataclass, replace
from unittest import mock

import torch

from dtensor_moe import (
    MoE,
    MoEConfig,
    MoEParallelDims,
    MoERunOptions,
    owned_box,
    ownership,
    parallelize_moe,
    plan_moe,
    record_routing,
    replay_routing,
)
from dtensor_moe.kernels import expert_autograd as swiglu_autograd

# The tests' layer unless a case says otherwise. swiglu_limit 1 is read only by "clamped_swiglu", whose
# clamps then bind at these weight scales.
_MOE = dict(dim=8, hidden_dim=6, aux_loss_coeff=0.1, swiglu_limit=1.0)


def moe_config(*, num_experts: int, top_k: int, **kw) -> MoEConfig:
    """A case's layer; the routing's sizes always spelled out, since most named cases are about them."""
    return MoEConfig(num_experts=num_experts, top_k=top_k, **{**_MOE, **kw})


@dataclass(frozen=True, kw_only=True)
class Case:
    """A parity case: the layer (`moe`), its run options (`run`) and how the test folds, feeds and runs it. Both
    sides run `MoE(moe, run)` as it is, except that the reference never pads to capacity (both modes drop the same
    pairs) and, but with FP8 experts, keeps the standard activations (so activation_memory "minimal" meets the other
    path); under expert_precision "fp8" both quantize the same rows (CPU emulation), so parity stays tight."""

    dp_replicate: int = 1
    ep: int = 1
    etp: int = 1
    cp: int = 1
    tp: int = 1
    moe: MoEConfig
    run: MoERunOptions = MoERunOptions()  # capacity, padding, precisions, activation memory, replicas, rounding
    batch_per_rank: tuple[int, ...]  # sequences per data-parallel group: per rank when cp = tp = 1 (0 allowed)
    seq_len: int = 3  # a multiple of cp * tp: each of those ranks takes seq_len / (cp * tp) of every sequence
    hot_expert: int | None = None  # route (almost) every token to this expert
    zipf: float | None = None  # benchmarks/routing.py's skewed routing with this exponent (needs dim == num_experts)
    seed: int = 0
    dtype: str = "float64"
    microbatches: int = 1  # > 1: the same slice again, gradients accumulating (FSDP syncs on the last)
    nonfinite_token: int | None = None  # this token of the global batch is non-finite: it must stay isolated
    nonfinite_value: float = float("nan")  # its value in the first dim: NaN, +Inf or -Inf
    compile: bool | str = False  # parallelize_moe(compile=...): True (inductor) or a backend name
    replay: bool = False  # the training forwards replay choices recorded by no-grad eval forwards of the same tokens
    # Where both sides run: "cpu", or "cuda" (tests/gpu/gpu_suite.py: ranks sharing the GPU over gloo).
    device: str = "cpu"
    # The parallel layer's dtype where it is not `dtype` (e.g. bfloat16 against a float32 reference): the
    # reference's weights and inputs are rounded through it, so only the arithmetic differs.
    compute_dtype: str | None = None


def build(case: Case, world_size: int):
    cfg, run = case.moe, case.run
    dims = MoEParallelDims(world_size, dp_replicate=case.dp_replicate, cp=case.cp, tp=case.tp, ep=case.ep, etp=case.etp)
    dtype = getattr(torch, case.dtype)
    g = torch.Generator().manual_seed(case.seed)
    # FP8 quantizes other operands on the two paths (dz W2 before the routing weight, not after): there the
    # reference runs the case's own path, and tests/test_activation_memory.py bounds FP8 "minimal" against exact.
    memory = run.activation_memory if run.expert_precision == "fp8" else "standard"
    ref = MoE(cfg, replace(run, pad_to_capacity=False, activation_memory=memory)).to(dtype)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=dtype) * 0.5)
        if cfg.load_balance == "aux_free_bias":
            ref.expert_bias.copy_(torch.randn(cfg.num_experts, generator=g, dtype=dtype) * 0.01)
    total = sum(case.batch_per_rank)
    x = torch.randn(total, case.seq_len, cfg.dim, generator=g, dtype=dtype)
    if case.hot_expert is not None:
        with torch.no_grad():
            x[..., 0] = 1.0 + 0.01 * x[..., 0]
            ref.router.gate.weight[:, 0] = 0.0
            ref.router.gate.weight[case.hot_expert, 0] = 20.0
    if case.zipf is not None:
        _route_skewed(ref, x, case)
    grad_out = torch.randn(total, case.seq_len, cfg.dim, generator=g, dtype=dtype)
    if case.nonfinite_token is not None and total:
        x.view(-1, cfg.dim)[case.nonfinite_token % (total * case.seq_len), 0] = case.nonfinite_value
    if case.compute_dtype:
        low = getattr(torch, case.compute_dtype)
        with torch.no_grad():
            for t in [*ref.parameters(), *ref.buffers(), x]:
                if t.is_floating_point():
                    t.copy_(t.to(low))
    # Drawn on the CPU, then moved: every device sees the same numbers.
    return cfg, dims, ref.to(case.device), x.to(case.device), grad_out.to(case.device)


def _route_skewed(ref: MoE, x: torch.Tensor, case: Case) -> None:
    """The router picks exactly benchmarks/routing.py's skewed choices (Zipf popularity, K distinct experts a
    token): the gate is the identity, and each token's chosen experts' features stand far above the rest."""
    from benchmarks.routing import expert_choices_TK

    E, K = case.moe.num_experts, case.moe.top_k
    assert case.moe.dim == E, "skewed routing reads the logits off the features: dim == num_experts"
    x_TD = x.view(-1, E)
    experts_TK = expert_choices_TK("skewed", x_TD.shape[0], E, K, case.seed, case.zipf)
    with torch.no_grad():
        x_TD.mul_(0.01).scatter_add_(1, experts_TK, torch.arange(K, 0, -1, dtype=x.dtype).expand(x_TD.shape[0], K) + 3)
        ref.router.gate.weight.copy_(torch.eye(E, dtype=x.dtype))
        if ref.router.gate.bias is not None:
            ref.router.gate.bias.zero_()


def inductor_settings(compile: bool | str):
    """Inductor's settings for the tests' compiled runs (forward and the lazily compiled backward):
    scalar C++ kernels. On CPU inductor's cost is building one C++ library per kernel (cold cache:
    ~85% of a compiled case), and a kernel that includes the vectorized ATen headers takes ~2.1 CPU s
    to build against ~1.3 s without them (and two ISA probes less). What these runs guard, the
    lowering of the graph and of our registered ops' outputs (dtypes, shapes, fusion), is the same
    IR either way; only the loops inductor prints differ."""
    if compile is not True:
        return contextlib.nullcontext()
    import torch._inductor.config

    return torch._inductor.config.patch({"cpp.vec_isa_ok": False})


def _err(a, b, relative: bool = False) -> float:
    """Max |a - b| where both are finite (with `relative`, over the largest finite |b|); inf unless a and b are
    non-finite at the same places."""
    if not a.numel():
        return 0.0
    if not torch.equal(a.isfinite(), b.isfinite()):
        return float("inf")
    finite = a.isfinite()
    if not finite.any():
        return 0.0
    a, b = a[finite].double(), b[finite].double()
    err = (a - b).abs().max().item()
    return err / max(b.abs().max().item(), 1e-30) if relative else err


def check_parity(rank: int, world_size: int, case: Case) -> dict:
    return parity_errors(rank, world_size, case)[0]


def parity_errors(rank: int, world_size: int, case: Case) -> tuple[dict, MoE]:
    """check_parity's errors, and the parallelized layer after its backward. Float64 cases compare absolute
    differences; lower precisions (the GPU suite's) relative to the reference's largest magnitude."""
    if case.device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())  # ranks may share a GPU (gloo)
    cfg, dims, ref, x, grad_out = build(case, world_size)
    dtype = getattr(torch, case.compute_dtype or case.dtype)
    err = functools.partial(_err, relative=dtype != torch.float64)

    model = MoE(cfg, case.run).to(dtype=dtype, device=case.device)
    model.load_state_dict(ref.state_dict())
    full = {n: p.detach().clone() for n, p in ref.named_parameters()}
    R = world_size
    mine = _slice(case, dims, rank)

    # Reference: one process, the concatenated batch, loss = mean over ranks of each rank's loss.
    x_ref = x.clone().requires_grad_(True)
    y_ref = ref(x_ref)
    if case.run.capacity_factor is None and not case.run.round_tokens_to:
        outs = [y_ref[_slice(case, dims, r)] for r in range(R)]
    else:
        # Capacity and token rounding are per rank's tokens: the reference output runs each rank's slice on its
        # own; the balance losses and statistics stay the whole batch's (they see the router's choices, before
        # dropping and rounding).
        losses, counts = (ref.aux_loss, ref.seq_aux_loss, ref.z_loss), ref.tokens_per_expert.clone()
        outs = [ref(x_ref[_slice(case, dims, r)]) for r in range(R)]
        (ref.aux_loss, ref.seq_aux_loss, ref.z_loss) = losses
        ref.tokens_per_expert.copy_(counts)
    loss_ref = sum((outs[r] * grad_out[_slice(case, dims, r)]).sum() for r in range(R)) / R
    loss_ref = loss_ref + sum(ref.losses())
    loss_ref.backward()

    if case.compile:
        torch._dynamo.reset()  # each case compiles a new module; keep the cache to this one
    # Each rank's own loss over its own tokens (the reference's), so the tp ranks' copies average.
    parallelize_moe(model, dims, device_type=case.device, compile=case.compile, tp_grads="mean")
    errs = {}
    for wp in plan_moe(cfg, dims):  # the plan's ownership is the real local slice on this rank
        local = model.get_parameter(wp.name).to_local()
        want = full[wp.name][owned_box(wp, dims, rank)]
        assert local.shape == want.shape, (wp.name, tuple(local.shape), tuple(want.shape))
        errs[f"own:{wp.name}"] = err(local, want)
        ownership(wp, dims)
    x_r = x[mine].to(dtype, copy=True).requires_grad_(True)
    replaying = contextlib.nullcontext()
    if case.replay:  # a rollout (eval, no grad: it counts nothing) records; each microbatch replays its forward
        model.eval()
        with torch.no_grad(), record_routing(model) as recorded:
            for _ in range(case.microbatches):
                model(x_r)
        model.train()
        replaying = replay_routing(model, recorded)
    counted = mock.patch.object(swiglu_autograd, "add_weight_grad_", wraps=swiglu_autograd.add_weight_grad_)
    with counted as fused, inductor_settings(case.compile), replaying:
        for mb in range(case.microbatches):
            model.set_requires_gradient_sync(mb == case.microbatches - 1)
            y_r = model(x_r)
            loss_r = (y_r * grad_out[mine]).sum()
            loss_r = loss_r + sum(model.losses())
            for name in ("aux_loss", "seq_aux_loss", "z_loss"):
                if getattr(ref, name) is not None:
                    errs[name] = err(getattr(model, name).detach(), getattr(ref, name).detach())
            loss_r.backward()

    errs["out"] = err(y_r.detach(), outs[rank].detach())
    n = case.microbatches
    # From the second microbatch on, every expert weight gradient is summed by the GEMMs themselves.
    # Compiled graphs leave accumulation to autograd (the in-GEMM sum reads .grad, which a graph cannot),
    # and so do FP8 weight gradients (a fresh GEMM output).
    in_gemm = 0 if case.compile or case.run.expert_precision == "fp8" else 2 * (n - 1)  # w13 and w2
    errs["accumulated_outside_gemm"] = float(n > 1 and fused.call_count != in_gemm)
    errs["grad:x"] = err(x_r.grad, x_ref.grad[mine] * R * n)
    # Each rank's gradient shard against its owned box of the reference gradient: the boxes tile every
    # weight (ownership above), and no full_tensor(): on expert weights sharded twice along E (EP, then
    # EDP) DTensor plans that gather by graph search, ~2 s a call on 8 ranks.
    planned = {wp.name: wp for wp in plan_moe(cfg, dims)}
    for name, p in model.named_parameters():
        assert type(p).__name__ == "DTensor", name
        assert p.grad.placements == p.placements, (name, p.grad.placements, p.placements)
        want = ref.get_parameter(name).grad[owned_box(planned[name], dims, rank)] * n
        errs[f"grad:{name}"] = err(p.grad.to_local(), want)
    errs["tokens_per_expert"] = err(model.global_tokens_per_expert(), ref.tokens_per_expert * n)
    if cfg.load_balance == "aux_free_bias":
        model.update_expert_bias()
        ref.update_expert_bias()
        errs["expert_bias"] = err(model.expert_bias, ref.expert_bias)
    return errs, model


def _slice(case: Case, dims: MoEParallelDims, rank: int) -> tuple[slice, slice]:
    """(sequences, positions) of the global batch that `rank` holds."""
    c = dims.dense_coords(rank)
    group = c["dp_replicate"] * dims.dp_shard + c["dp_shard"]
    lo = sum(case.batch_per_rank[:group])
    part = case.seq_len // (dims.cp * dims.tp)
    first = (c["cp"] * dims.tp + c["tp"]) * part
    return slice(lo, lo + case.batch_per_rank[group]), slice(first, first + part)


def parallelize_with_bad_input(rank: int, world_size: int, kind: str):
    """Every rank must raise the same ValueError before any collective (the harness would time out otherwise)."""
    cfg = MoEConfig(dim=8, hidden_dim=6, num_experts=6, top_k=2)
    dims = {
        "world_mismatch": lambda: MoEParallelDims(world_size * 2, ep=2),
        "experts_not_divisible": lambda: MoEParallelDims(world_size, ep=4),
        "hidden_not_divisible": lambda: MoEParallelDims(world_size, etp=4),
    }[kind]()
    parallelize_moe(MoE(cfg), dims, device_type="cpu")
