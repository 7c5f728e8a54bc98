"""Tile-aware token rounding (MoERunOptions.round_tokens_to, dtensor_moe/routing/token_rounding.py): round_tokens
against a plain Python loop over experts and tokens that follows docs/routing.md's rule, on random draws (ties,
capacity-dropped pairs, groups); the layer's invariants on random configs (every expert's rows a multiple of M, at
most K distinct experts a token, the added pairs weighted by the router's formula, deterministic); statistics and
balance losses before rounding; routing replay; one fullgraph graph under torch.compile; the main job's
override; and EP / ETP meshes (the experts receive multiples of M, parity with one process run per rank's
slice). The parity draw (tests/strategies.py) rounds one case in four too."""

import copy
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dtensor_moe import (
    MoE,
    MoEConfig,
    MoEParallelDims,
    MoERunOptions,
    parallelize_moe,
    record_routing,
    replay_routing,
)
from dtensor_moe.routing import token_rounding
from dtensor_moe.routing.router import combine_weights_TE
from dtensor_moe.routing.token_rounding import CANDIDATES, ROUNDS, round_tokens

from .harness import run_on_ranks
from .parity import Case, moe_config
from .test_parity import assert_parity

SETTINGS = settings(max_examples=60, deadline=None, database=None, suppress_health_check=list(HealthCheck))


def reference_rounding(chosen_TK, experts_TK, weights_TK, weight_TE, M, capacity=None, num_groups=1,
                       rounds=ROUNDS, candidates=CANDIDATES):
    """docs/routing.md's "Token rounding" rule, one expert and one token at a time, in plain Python."""
    T, K = experts_TK.shape
    E = weight_TE.shape[1]
    w = weight_TE.detach().float().tolist()
    chosen, ids = chosen_TK.tolist(), experts_TK.tolist()
    # Each expert's pairs, best first: weight descending, ties by pair order.
    pairs = {e: sorted(((t, k) for t in range(T) for k in range(K) if ids[t][k] == e),
                       key=lambda tk: (-w[tk[0]][e], tk[0] * K + tk[1])) for e in range(E)}
    c = {e: len(pairs[e]) for e in range(E)}
    r = {e: c[e] % M for e in range(E)}
    dropped = sum(row.count(E) for row in ids)
    # 1. The up-set: candidates by remainder descending (ties by id), while their need fits the others' frees.
    candidate = {e: 2 * r[e] >= M and (capacity is None or c[e] - r[e] + M <= capacity) for e in range(E)}
    order = sorted(range(E), key=lambda e: (-(r[e] if candidate[e] else -1), e))
    up, demand = [], 0
    for i, e in enumerate(order):
        demand += M - r[e]
        if not candidate[e] or demand > dropped + sum(r[x] for x in order[i + 1:]):
            break
        up.append(e)

    def kept_after(rounded_up):
        keep = [[False] * K for _ in range(T)]
        for e in range(E):
            n = c[e] if e in rounded_up or r[e] == 0 else c[e] - r[e]
            for t, k in pairs[e][:n]:
                keep[t][k] = True
        return keep

    # 2. Down: the free slots.
    keep = kept_after(up)
    free = [K - sum(row) for row in keep]
    # 3. Up: eligibility, preferences, rounds.
    size = E // num_groups

    def eligible(t, e):
        groups = {x // size for x in chosen[t]}
        return e in up and free[t] > 0 and e not in chosen[t] and (num_groups == 1 or e // size in groups)

    # Each token's best `candidates` eligible experts (weight descending, ties by id) are all it may be added to.
    prefs = {t: sorted((e for e in range(E) if eligible(t, e)), key=lambda e: (-w[t][e], e))[:candidates]
             for t in range(T)}
    rank = {(t, e): i for t in range(T) for i, e in enumerate(prefs[t])}
    order_of = {e: sorted((t for t in range(T) if (t, e) in rank), key=lambda t: (rank[t, e], -w[t][e], t))
                for e in up}
    need = {e: M - r[e] for e in up}
    got, added, avail = dict.fromkeys(up, 0), {t: [] for t in range(T)}, list(free)
    for _ in range(rounds):
        proposals = {t: [] for t in range(T)}
        for e in up:
            open_ = [t for t in order_of[e] if avail[t] > 0 and e not in added[t]]
            for t in open_[:need[e] - got[e]]:
                proposals[t].append(e)
        for t in range(T):
            for e in sorted(proposals[t], key=lambda e: rank[t, e])[:avail[t]]:
                added[t].append(e)
                avail[t] -= 1
                got[e] += 1
    # 4. Whole up-roundings only; the added experts fill the free slots in slot order, in preference order.
    rounded_up = {e for e in up if got[e] == need[e]}
    keep = kept_after(rounded_up)
    out, out_w = [[E] * K for _ in range(T)], [[0.0] * K for _ in range(T)]
    for t in range(T):
        fill = iter(sorted((e for e in added[t] if e in rounded_up), key=lambda e: rank[t, e]))
        for k in range(K):
            if keep[t][k]:
                out[t][k], out_w[t][k] = ids[t][k], weights_TK[t, k].item()
            elif (e := next(fill, None)) is not None:
                out[t][k], out_w[t][k] = e, weight_TE[t, e].to(weights_TK.dtype).item()
    return torch.tensor(out, dtype=torch.int64).view(T, K), torch.tensor(out_w, dtype=weights_TK.dtype).view(T, K)


@st.composite
def routings(draw):
    """A router's choices, some capacity-dropped (id E), weights with ties, and a tile."""
    E = draw(st.integers(1, 8))
    K = draw(st.integers(1, E))
    T = draw(st.integers(0, 24))
    groups = draw(st.sampled_from([g for g in range(1, E + 1) if E % g == 0]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    chosen_TK = torch.rand(T, E, generator=g).argsort(dim=1)[:, :K]
    # Few distinct values: ties between tokens and between one token's experts.
    weight_TE = torch.randint(0, draw(st.sampled_from([2, 5, 1000])), (T, E), generator=g).double() / 7
    drop_TK = torch.rand(T, K, generator=g) < draw(st.sampled_from([0.0, 0.3]))
    experts_TK = torch.where(drop_TK, E, chosen_TK)
    weights_TK = torch.where(drop_TK, 0.0, weight_TE.gather(1, chosen_TK))
    M = draw(st.integers(1, 6))
    capacity = draw(st.sampled_from([None, 1, 3, 6, 12]))
    # The module's constants mostly, sometimes fewer rounds or candidates than these few experts need.
    rounds = draw(st.sampled_from([ROUNDS, ROUNDS, 1, 2]))
    candidates = draw(st.sampled_from([CANDIDATES, CANDIDATES, 1, 2, 3]))
    return chosen_TK, experts_TK, weights_TK, weight_TE, M, capacity, groups, rounds, candidates


@settings(SETTINGS, max_examples=300)
@given(routings())
def test_round_tokens_is_the_documented_rule(case):
    chosen_TK, experts_TK, weights_TK, weight_TE, M, capacity, groups, rounds, candidates = case
    E = weight_TE.shape[1]
    with mock.patch.multiple(token_rounding, ROUNDS=rounds, CANDIDATES=candidates):
        out_TK, out_w = round_tokens(chosen_TK, experts_TK, weights_TK, weight_TE, M, capacity, groups)
    ref_TK, ref_w = reference_rounding(chosen_TK, experts_TK, weights_TK, weight_TE, M, capacity, groups, rounds,
                                       candidates)
    assert torch.equal(out_TK, ref_TK), (out_TK, ref_TK)
    assert torch.equal(out_w, ref_w), (out_w, ref_w)
    counts = torch.bincount(out_TK.flatten(), minlength=E + 1)[:E]
    assert (counts % M == 0).all(), counts
    before = torch.bincount(experts_TK.flatten(), minlength=E + 1)[:E]
    assert ((counts == before // M * M) | (counts == -(-before // M) * M)).all(), (before, counts)
    if capacity is not None:
        assert (counts <= torch.maximum(before, torch.tensor(capacity))).all()


def test_round_tokens_on_skewed_routing_rounds_most_experts_up():
    """At T=4096, E=64, K=6, M=128 a uniform router leaves ~16% of the pairs in partial tiles: rounding down alone
    drops them; the rule keeps ~97.5% of the router's pairs and runs ~99.5% of its rows (the CPU numbers that
    ROUNDS was picked with). Every count a multiple of 128, distinct experts per token."""
    T, E, K, M = 4096, 64, 6, 128
    cfg = MoEConfig(dim=8, hidden_dim=8, num_experts=E, top_k=K)
    logits = torch.randn(T, E, generator=torch.Generator().manual_seed(0))
    scores = logits.softmax(-1)
    chosen = scores.topk(K, dim=1).indices
    weight_TE = combine_weights_TE(cfg, scores, logits, chosen)
    out, _ = round_tokens(chosen, chosen, weight_TE.gather(1, chosen), weight_TE, M)
    counts = torch.bincount(out.flatten(), minlength=E + 1)
    assert (counts[:E] % M == 0).all()
    ids = out.sort(dim=1).values
    assert not ((ids.diff(dim=1) == 0) & (ids[:, 1:] < E)).any()
    kept, rows = (out == chosen).sum().item() / (T * K), counts[:E].sum().item() / (T * K)
    down_only = (torch.bincount(chosen.flatten(), minlength=E) // M * M).sum().item() / (T * K)
    assert down_only < 0.85 and kept > 0.97 and rows > 0.99, (down_only, kept, rows)


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid", "topk_softmax"])
@pytest.mark.parametrize("route_norm", [True, False])
def test_combine_weights_at_the_chosen_experts_are_the_routers(score_func, route_norm):
    cfg = MoEConfig(dim=8, hidden_dim=8, num_experts=6, top_k=3, score_func=score_func, route_norm=route_norm,
                    route_scale=2.5)
    moe = MoE(cfg).double()
    r = moe.router(torch.randn(10, 8, dtype=torch.float64), None)
    w_TE = combine_weights_TE(cfg, r.scores_TE, r.logits_TE, r.experts_TK)
    torch.testing.assert_close(w_TE.gather(1, r.experts_TK), r.weights_TK, rtol=1e-14, atol=0)


def _routed(moe: MoE, x: torch.Tensor):
    """(experts_TK, weights_TK, counts_E) the experts got in one forward of the single-process layer."""
    got = []
    handle = moe.experts.register_forward_pre_hook(lambda m, args: got.append(args))
    try:
        y = moe(x)
    finally:
        handle.remove()
    _, counts_E, copies = got[0]
    return copies.expert_N[copies.row_TK], copies.weight_TK, counts_E, y


@st.composite
def layers(draw):
    E = draw(st.sampled_from([1, 2, 4, 6]))
    K = draw(st.integers(1, E))
    groups = draw(st.sampled_from([g for g in range(1, E + 1) if E % g == 0]))
    limited = draw(st.integers(-(-K // (E // groups)), groups))
    cfg = MoEConfig(dim=6, hidden_dim=4, num_experts=E, top_k=K, num_expert_groups=groups, num_limited_groups=limited,
                    score_func=draw(st.sampled_from(["softmax", "sigmoid", "topk_softmax"])),
                    route_norm=draw(st.booleans()), route_scale=draw(st.sampled_from([1.0, 2.5])))
    run = MoERunOptions(capacity_factor=draw(st.sampled_from([None, 0.5, 1.0, 2.0])),
                        round_tokens_to=draw(st.integers(1, 8)))
    return cfg, run, draw(st.integers(0, 40)), draw(st.integers(0, 2**16))


@SETTINGS
@given(layers())
def test_layer_invariants(case):
    """Every expert's rows a multiple of M, at most K distinct experts a token, a kept pair's weight the router's,
    an added pair's the router's formula at that expert (never one the router chose), the same twice
    (deterministic)."""
    cfg, run, T, seed = case
    E, M = cfg.num_experts, run.round_tokens_to
    torch.manual_seed(seed)
    moe = MoE(cfg, run).double()
    x = torch.randn(T, cfg.dim, dtype=torch.float64)
    experts_TK, weights_TK, counts_E, _ = _routed(moe, x)
    again_TK, again_w, _, _ = _routed(moe, x)
    assert torch.equal(experts_TK, again_TK) and torch.equal(weights_TK, again_w)
    assert torch.equal(counts_E, torch.bincount(experts_TK.flatten(), minlength=E + 1)[:E])
    assert (counts_E % M == 0).all(), counts_E
    ids = experts_TK.sort(dim=1).values
    assert not ((ids.diff(dim=1) == 0) & (ids[:, 1:] < E)).any()
    r = moe.router(x, None)
    router_w_TE = combine_weights_TE(cfg, r.scores_TE, r.logits_TE, r.experts_TK)
    kept = experts_TK == r.experts_TK
    added = (experts_TK < E) & ~kept
    torch.testing.assert_close(weights_TK[kept], r.weights_TK[kept], rtol=0, atol=0)
    torch.testing.assert_close(weights_TK[added], router_w_TE.gather(1, experts_TK.clamp(max=E - 1))[added],
                               rtol=0, atol=0)
    assert (weights_TK[experts_TK == E] == 0).all()
    assert not (added & (r.experts_TK.unsqueeze(1) == experts_TK.unsqueeze(2)).any(2)).any()  # never re-added


def test_statistics_and_balance_losses_see_the_routers_choices():
    """tokens_per_expert, the aux loss, the sequence-wise loss and the z-loss are those of the layer without
    rounding: they measure the router's choices before rounding (docs/routing.md)."""
    kw = dict(dim=8, hidden_dim=6, num_experts=4, top_k=2, load_balance="aux_loss", seq_aux_loss_coeff=0.3,
              z_loss_coeff=0.01)
    torch.manual_seed(0)
    plain = MoE(MoEConfig(**kw)).double()
    rounded = MoE(MoEConfig(**kw), MoERunOptions(round_tokens_to=4)).double()
    rounded.load_state_dict(plain.state_dict())
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    y_plain, y_rounded = plain(x), rounded(x)
    assert not torch.equal(y_plain, y_rounded)  # the rounding did change the routing
    assert torch.equal(plain.tokens_per_expert, rounded.tokens_per_expert)
    for a, b in zip(plain.losses(), rounded.losses()):
        assert torch.equal(a, b)


def test_routing_replay_records_the_routers_choices_and_replays_exactly():
    """Replay records the router's choices (before rounding); the replayed forward rounds them again, the same
    way, so with the same weights it is the recorded forward, bitwise, and its gradients reach the gate."""
    torch.manual_seed(0)
    moe = MoE(MoEConfig(dim=8, hidden_dim=6, num_experts=4, top_k=2),
              MoERunOptions(round_tokens_to=3, capacity_factor=1.5)).double()
    x = torch.randn(2, 7, 8, dtype=torch.float64)
    with torch.no_grad(), record_routing(moe) as recorded:
        y = moe(x)
    assert torch.equal(recorded.experts[""][0], moe.router(x.view(-1, 8), None).experts_TK)
    with replay_routing(moe, recorded):
        y_replayed = moe(x)
        y_replayed.square().sum().backward()
    assert torch.equal(y, y_replayed)
    assert moe.router.gate.weight.grad.abs().sum() > 0


def test_compiled_layer_is_one_graph():
    """torch.compile(fullgraph=True) of the layer with rounding (and capacity, groups): one graph, no break, the
    eager layer's outputs and gradients (float64), as token counts change (one recompile at most: dynamic T)."""
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    cfg = MoEConfig(dim=8, hidden_dim=6, num_experts=4, top_k=2, num_expert_groups=2, load_balance="aux_loss")
    eager = MoE(cfg, MoERunOptions(round_tokens_to=3, capacity_factor=1.0)).double()
    model = copy.deepcopy(eager)
    torch._dynamo.reset()
    counters.clear()
    backend = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    for step, T in enumerate([6, 9, 5]):
        x = torch.randn(T, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
        grads = []
        for m, run in ((model, compiled), (eager, eager)):
            m.zero_grad()
            xx = x.clone().requires_grad_(True)
            (run(xx).square().sum() + m.aux_loss).backward()
            grads.append([xx.grad, *(p.grad for p in m.parameters())])
        for a, b in zip(*grads):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert backend.frame_count <= 2 and backend.graphs and all(g is not None for g in backend.graphs)


def test_eager_layer_rounds_in_its_own_compiled_graph(monkeypatch):
    """Where policy.rounding_backend names a backend (CUDA), an eager layer's rounding runs as one compiled graph:
    outputs and every gradient as the rounding's eager ops give them (float64, bitwise), token counts changing."""
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    from dtensor_moe.kernels import policy

    torch.manual_seed(0)
    cfg = MoEConfig(dim=8, hidden_dim=6, num_experts=4, top_k=2, num_expert_groups=2)
    eager = MoE(cfg, MoERunOptions(round_tokens_to=3, capacity_factor=1.0)).double()
    model = copy.deepcopy(eager)
    torch._dynamo.reset()
    counters.clear()
    backend = CompileCounterWithBackend("aot_eager")
    monkeypatch.setattr(token_rounding, "_compiled", lambda name: torch.compile(
        round_tokens, backend=backend if name == "counted" else name, fullgraph=True))
    for step, T in enumerate([6, 9, 5]):
        x = torch.randn(T, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
        grads = []
        for m, name in ((model, "counted"), (eager, None)):
            monkeypatch.setattr(policy, "rounding_backend", lambda experts_TK, name=name: name)
            m.zero_grad()
            xx = x.clone().requires_grad_(True)
            m(xx).square().sum().backward()
            grads.append([xx.grad, *(p.grad for p in m.parameters())])
        for a, b in zip(*grads):
            assert torch.equal(a, b)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert backend.frame_count >= 1  # the compiled rounding ran (one recompile at most: dynamic T)


def test_main_job_override():
    from dtensor_moe.train.config import load_config

    cfg = load_config(None, ["moe_run.round_tokens_to=128"])
    assert cfg.moe_run.round_tokens_to == 128
    with pytest.raises(ValueError, match=r"moe_run.round_tokens_to must be >= 0, got -1"):
        load_config(None, ["moe_run.round_tokens_to=-1"])


def _rows_at_the_experts(rank, world_size, M):
    """EP2 x ETP2, 16 tokens a rank: (the rows each local expert got, the rows the single-process rounding of every
    rank's tokens sends to this rank's experts)."""
    import torch.distributed as dist


    cfg = MoEConfig(dim=8, hidden_dim=6, num_experts=4, top_k=2)
    torch.manual_seed(0)
    moe = MoE(cfg, MoERunOptions(round_tokens_to=M)).double()
    xs = [torch.randn(16, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(r))
          for r in range(world_size)]
    sent_E = sum(_routed(moe, x)[2] for x in xs)  # one process on each rank's tokens
    parallelize_moe(moe, MoEParallelDims(world_size, ep=2, etp=2), device_type="cpu")
    got = []
    moe.experts.register_forward_pre_hook(lambda m, args: got.append(args[0].counts_E.tolist()))
    moe(xs[rank]).sum().backward()
    ep_rank = dist.get_rank(moe.experts.expert_parallel.dispatcher.group.ep_group)
    # Under ETP each rank runs the rows of its whole ETP group: both ranks' tokens of each EP source.
    return got[0], sent_E[2 * ep_rank: 2 * ep_rank + 2].tolist()


def test_experts_receive_multiples_of_the_tile_under_ep_and_etp():
    """Each source's per-expert rows are multiples of M, so each expert's received rows are too, on every mesh."""
    for got, sent in run_on_ranks(4, _rows_at_the_experts, 4):
        assert got == sent and all(n % 4 == 0 for n in got), (got, sent)


PARITY = {
    "ep2_aux_free_bias": (2, Case(ep=2, batch_per_rank=(3, 2), moe=moe_config(
        num_experts=4, top_k=2, load_balance="aux_free_bias"), run=MoERunOptions(round_tokens_to=2))),
    # Capacity, then rounding (never past the capacity), groups, a second microbatch, a rank without tokens.
    "edp2_ep2_capacity_groups": (4, Case(ep=2, batch_per_rank=(2, 3, 0, 2), microbatches=2, moe=moe_config(
        num_experts=4, top_k=2, num_expert_groups=2, num_limited_groups=1, load_balance="aux_loss",
        seq_aux_loss_coeff=0.3), run=MoERunOptions(round_tokens_to=3, capacity_factor=1.0))),
    "compiled_ep2_etp1": (2, Case(ep=2, batch_per_rank=(2, 3), compile="aot_eager", moe=moe_config(
        num_experts=4, top_k=2, score_func="topk_softmax"), run=MoERunOptions(round_tokens_to=4))),
}


@pytest.mark.parametrize("name", PARITY)
def test_parity_under_meshes(name):
    """The parallel layer equals the single-process layer run on each rank's slice (float64, every gradient)."""
    assert_parity(*PARITY[name])


def _titan_moe(E=8, groups=None, seed=0):
    """torchtitan's MoE of the hook's tiny DeepSeek-V3 (8 experts, top 2, a shared expert), float32 weights."""
    from dtensor_moe.titan.models import deepseek_v3_tiny

    routing = {} if groups is None else dict(router_num_expert_groups=groups, router_num_limited_groups=groups // 2)
    moe = deepseek_v3_tiny(32, **routing).layers[1].moe.build()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    moe.tokens_per_expert_E = torch.zeros(E)
    return moe


def _titan_rows(moe):
    """The (rows, counts) torchtitan's experts get in each forward, after any dispatcher."""
    got = []
    moe.routed_experts.inner_experts.register_forward_pre_hook(lambda m, args: got.append(args))
    return got


def test_titan_hook_rounds_as_our_layer():
    """One process, no dispatcher: torchtitan's routed experts get the choices round_tokens gives for its router's
    output (dropped pairs: id E, weight 0), their kept rows are multiples of M (the dropped ones run, weight 0, as
    the last expert's rows), the router's statistics count its own choices, and the gate gets gradients."""
    pytest.importorskip("torchtitan")
    from dtensor_moe.titan.parallelize_titan import moe_config
    from dtensor_moe.titan.token_rounding import round_titan_tokens

    M = 4
    moe = _titan_moe(groups=4)
    moe.train()
    x = torch.randn(2, 9, 64, generator=torch.Generator().manual_seed(1))
    w_BLK, ids_BLK, scores_BLE = moe.router(x, moe.expert_bias_E)
    round_titan_tokens(moe, moe_config(moe), M, dispatched=False)
    routed = []  # what the rounding hands torchtitan's routed experts
    moe.routed_experts.register_forward_pre_hook(lambda m, args: routed.append(args))
    rows = _titan_rows(moe)
    moe(x).square().sum().backward()
    cfg = moe_config(moe)
    chosen = ids_BLK.reshape(-1, 2)
    want_ids, want_w = round_tokens(chosen, chosen, w_BLK.reshape(-1, 2),
                                    combine_weights_TE(cfg, scores_BLE.reshape(-1, 8), None, chosen), M, None, 4)
    _, w_got, ids_got, counts = routed[0]
    assert torch.equal(ids_got.reshape(-1, 2), want_ids) and torch.equal(w_got.reshape(-1, 2), want_w.detach())
    kept = torch.bincount(want_ids.flatten(), minlength=9)
    assert (kept[:8] % M == 0).all() and kept[8] > 0  # something was dropped
    assert counts.tolist() == [*kept[:7].tolist(), kept[7].item() + kept[8].item()]
    assert rows[0][0].shape[0] == 36 and torch.equal(rows[0][1], counts)
    assert torch.equal(moe.tokens_per_expert_E, torch.bincount(chosen.flatten(), minlength=8).float())
    assert moe.router.gate.weight.grad.abs().sum() > 0


def test_titan_hook_keeps_no_state():
    """The rounding lives in the MoE's forward, the router's scores a local there: a router run on its own holds
    nothing back, and a deep copy rounds with its own weights, the same under activation checkpointing's
    recomputation and under torch.compile (output and every gradient bitwise)."""
    pytest.importorskip("torchtitan")
    import weakref

    from torch.utils.checkpoint import checkpoint

    from dtensor_moe.titan.parallelize_titan import moe_config
    from dtensor_moe.titan.token_rounding import round_titan_tokens

    moe = _titan_moe(groups=4)
    moe.train()
    round_titan_tokens(moe, moe_config(moe), 4, dispatched=False)
    x = torch.randn(2, 9, 64, generator=torch.Generator().manual_seed(1))
    out = moe.router(x, moe.expert_bias_E)
    scores = weakref.ref(out[2])
    del out
    assert scores() is None
    checkpointed, compiled = copy.deepcopy(moe), copy.deepcopy(moe)
    want = moe(x)
    want.square().sum().backward()
    got = checkpoint(checkpointed, x, use_reentrant=False)
    got.square().sum().backward()
    assert torch.equal(got, want)
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        got = torch.compile(compiled, backend="aot_eager", fullgraph=True)(x)
        got.square().sum().backward()
    assert torch.equal(got, want)
    for p, q, r in zip(moe.parameters(), checkpointed.parameters(), compiled.parameters()):
        assert torch.equal(q.grad, p.grad) and torch.equal(r.grad, p.grad)


def _titan_ep(rank, world_size, M, ours):
    """torchtitan's MoE under our EP2 x ETP2 plan and dispatcher, rounding on, with torchtitan's experts or ours
    (`--dtensor_moe.experts ours`: titan/experts.py): (its output on this rank's tokens, the output of the
    unparallelized layer with the hook on them, the rows each local expert got)."""
    from dtensor_moe.experts import ExpertInput
    from dtensor_moe.parallel.shard import shard_moe_layer
    from dtensor_moe.titan.experts import adopt
    from dtensor_moe.titan.parallelize_titan import moe_config, titan_plan
    from dtensor_moe.titan.token_rounding import round_titan_tokens

    ref, moe = _titan_moe(), _titan_moe()
    x = torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(10 + rank))
    for m, dispatched in ((ref, False), (moe, True)):
        round_titan_tokens(m, moe_config(m), M, dispatched=dispatched)
        if ours:
            adopt(m, moe_config(m), MoERunOptions())
    with torch.no_grad():
        want = ref(x)
    unrounded = _titan_moe()
    if ours:
        adopt(unrounded, moe_config(unrounded), MoERunOptions())
    with torch.no_grad():
        unrounded = unrounded(x)
    dims = MoEParallelDims(world_size, ep=2, etp=2)
    shard_moe_layer(moe, titan_plan(moe, dims), dims, dims.build_meshes("cpu"), None, fsdp_sums=True)
    rows = _titan_rows(moe)
    with torch.no_grad():
        got = moe(x)
    counts = rows[0][0].counts_E if isinstance(rows[0][0], ExpertInput) else rows[0][1]
    return got, want, unrounded, counts.tolist()


@pytest.mark.parametrize("ours, rtol", [(False, 5e-3), (True, 1e-5)], ids=["titan_experts", "our_experts"])
def test_titan_hook_under_ep_and_etp(ours, rtol):
    """EP2 x ETP2: the experts get multiples of M (each EP source sends multiples; the dropped pairs never
    travel), and the output is the unparallelized layer's on each rank's tokens, far from the output without
    rounding: with torchtitan's experts up to their bf16 GEMMs (ETP sums bf16 partial outputs: measured 1.2e-3 of
    the largest output, with rounding or without), with ours (float32 here) to float32 rounding."""
    pytest.importorskip("torchtitan")
    for got, want, unrounded, rows in run_on_ranks(4, _titan_ep, 4, ours):
        assert all(n % 4 == 0 for n in rows), rows
        scale = want.abs().max()
        assert (got - want).abs().max() < rtol * scale < (unrounded - want).abs().max(), (got, want, unrounded)


@pytest.mark.parametrize("flags, message", [
    (("--dtensor_moe.run.round_tokens_to", "-1"), "--dtensor_moe.run.round_tokens_to must be >= 0, got -1"),
    (("--dtensor_moe.run.round_tokens_to=-1",), "--dtensor_moe.run.round_tokens_to must be >= 0, got -1"),
    (("--dtensor_moe.run.round_tokens_to", "128", "--dtensor_moe.ep", "2", "--dtensor_moe.run.expert_replicas", "1"),
     "--dtensor_moe.run.round_tokens_to 128 with --dtensor_moe.run.expert_replicas 1 is not supported"),
])
def test_titan_flag_is_checked_while_parsing(capsys, monkeypatch, flags, message):
    """As torchrun's ranks parse the command line (sys.argv): one line naming the flag, exit status 2."""
    pytest.importorskip("torchtitan")
    from .test_titan import _argv, _assert_refused

    _assert_refused(capsys, _argv("deepseek_v3_debugmodel_cpu", "/unused", *flags), message, monkeypatch)


def test_titan_flag_value_parsed_from_other_argv_still_names_the_field(capsys):
    """ConfigManager().parse_args(argv) on an argv that is not the process's: MoERunOptions' own check, raised
    inside torchtitan's parser, still ends it with exit status 2 and a message naming the field."""
    pytest.importorskip("torchtitan")
    from torchtitan.config import ConfigManager

    from .test_titan import _argv

    with pytest.raises(SystemExit) as exit_:
        ConfigManager().parse_args(_argv("deepseek_v3_debugmodel_cpu", "/unused", "--dtensor_moe.run.round_tokens_to",
                                         "-1"))
    assert exit_.value.code == 2
    err = " ".join(capsys.readouterr().err.split())  # the parser's error box wraps its lines
    assert "round_tokens_to must be >= 0, got -1" in err, err


def test_titan_flag_reaches_parallelize():
    pytest.importorskip("torchtitan")
    from torchtitan.config import ConfigManager

    from .test_titan import _argv

    config = ConfigManager().parse_args(_argv("deepseek_v3_debugmodel_cpu", "/unused",
                                              "--dtensor_moe.run.round_tokens_to", "16"))
    assert config.dtensor_moe.run.round_tokens_to == 16


def test_a_forward_too_small_for_the_multiple_warns_once_it_rounds_every_pair_away():
    """MoE(...) used directly: 5 tokens cannot fill a tile of 8 for any expert, so every pair would be rounded
    away and the experts compute nothing: a warning naming the field (the main job and the hook refuse it)."""
    moe = MoE(MoEConfig(dim=8, hidden_dim=4, num_experts=4, top_k=2), MoERunOptions(round_tokens_to=8))
    with pytest.warns(UserWarning, match=r"MoERunOptions.round_tokens_to \(8\) is more than any expert can hold"):
        moe(torch.randn(1, 5, 8))
