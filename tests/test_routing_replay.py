"""Routing replay (dtensor_moe/replay.py): the replay weight formula on hand-made cases, the replayed layer
against a per-token loop, microbatch order under activation checkpointing, compiled blocks (one graph for every
microbatch), bad input; on EP (also compiled), ETP, CP, TP x EDP and PP meshes a rollout records, the router
changes (negated gate), and the replayed training forward chooses the recorded experts, its outputs and every
gradient equal to the single-process layer replaying its own recording of the whole batch (float64)."""

import copy
import math

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from dtensor_moe import (
    MoE,
    MoEConfig,
    MoEParallelDims,
    RoutingReplay,
    balance_loss,
    owned_box,
    parallelize_moe,
    plan_moe,
    record_routing,
    replay_routing,
)
from dtensor_moe.routing.router import TopKRouter

from .harness import run_on_ranks
from .parity import Case, _err, _slice, build, moe_config
from .test_moe_local import _random_moe, naive_moe

TOL = 1e-10


def _hand_router(score_func: str, route_norm: bool, route_scale: float) -> TopKRouter:
    """logits = x: three experts over a 3-dim input, identity gate."""
    router = TopKRouter(MoEConfig(dim=3, hidden_dim=2, num_experts=3, top_k=2, score_func=score_func,
                                  route_norm=route_norm, route_scale=route_scale)).double()
    with torch.no_grad():
        router.gate.weight.copy_(torch.eye(3))
    return router


def _sig(v):
    return 1 / (1 + math.exp(-v))


E1 = math.e
# logits (1, 2, 0): the router would choose experts (1, 0); the replay forces (0, 2).
HAND = [
    ("softmax", False, 2.0, [2 * E1 / (E1 + E1**2 + 1), 2 / (E1 + E1**2 + 1)]),
    ("softmax", True, 2.0, [2 * E1 / (E1 + 1), 2 / (E1 + 1)]),
    ("sigmoid", False, 1.5, [1.5 * _sig(1), 1.5 * 0.5]),
    ("sigmoid", True, 1.0, [_sig(1) / (_sig(1) + 0.5), 0.5 / (_sig(1) + 0.5)]),
    ("topk_softmax", False, 3.0, [3 * E1 / (E1 + 1), 3 / (E1 + 1)]),  # softmax over the chosen logits (1, 0)
]


@pytest.mark.parametrize("score_func,route_norm,route_scale,want", HAND)
def test_replay_weights_on_a_hand_made_case(score_func, route_norm, route_scale, want):
    router = _hand_router(score_func, route_norm, route_scale)
    x = torch.tensor([[1.0, 2.0, 0.0]], dtype=torch.float64)
    assert router(x).experts_TK.tolist() == [[1, 0]]
    r = router(x, experts_TK=torch.tensor([[0, 2]]))
    assert r.experts_TK.tolist() == [[0, 2]]
    torch.testing.assert_close(r.weights_TK, torch.tensor([want], dtype=torch.float64), rtol=1e-14, atol=0)


def test_replay_weights_give_the_gate_its_gradient():
    """sigmoid, no normalization: d(w0 + w1)/d gate = scale * sigmoid'(logit) * x on the replayed rows only."""
    router = _hand_router("sigmoid", False, 1.5)
    x = torch.tensor([[1.0, 2.0, 0.0]], dtype=torch.float64)
    router(x, experts_TK=torch.tensor([[0, 2]])).weights_TK.sum().backward()
    slope = [_sig(1) * (1 - _sig(1)), 0.0, 0.25]
    want = torch.tensor([[1.5 * s * v for v in (1.0, 2.0, 0.0)] for s in slope], dtype=torch.float64)
    torch.testing.assert_close(router.gate.weight.grad, want, rtol=1e-14, atol=0)


def _naive_weights(moe: MoE, x_TD, experts_TK):
    cfg = moe.config
    logits = x_TD @ moe.router.gate.weight.T
    scores = torch.softmax(logits, -1) if cfg.score_func == "softmax" else torch.sigmoid(logits)
    w = scores.gather(1, experts_TK)
    return (w / w.sum(-1, keepdim=True) if cfg.route_norm else w) * cfg.route_scale


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_replayed_layer_matches_a_per_token_loop(score_func):
    """Recorded in eval mode without grad (a rollout); the gate negated (the choices would all change) and an
    aux-free bias moved: the training forward still runs the recorded experts, weighted by the new gate's scores,
    and the bias statistics count the replayed choices."""
    moe = _random_moe(num_experts=6, top_k=2, score_func=score_func, load_balance="aux_free_bias",
                      num_shared_experts=1)
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    moe.eval()
    with torch.no_grad(), record_routing(moe) as rec:
        moe(x)
    moe.train()
    assert not moe.tokens_per_expert.any()  # eval forwards never count
    (recorded,) = rec.experts[""]
    with torch.no_grad():
        moe.router.gate.weight.neg_()
        moe.expert_bias.normal_(std=1.0)
    assert not torch.equal(moe.router(x.view(-1, 8), moe.expert_bias).experts_TK, recorded)
    with replay_routing(moe, rec):
        y = moe(x)
    want = naive_moe(moe, x, route=lambda m, x_TD: (recorded, _naive_weights(m, x_TD, recorded)))
    torch.testing.assert_close(y, want, rtol=1e-12, atol=1e-12)
    assert torch.equal(moe.tokens_per_expert, torch.bincount(recorded.flatten(), minlength=6))
    assert moe.routing_replay is None  # the context detached itself


def test_microbatches_replay_in_order_and_recomputation_replays_its_own():
    """Two microbatches forward, then both backwards (1F1B's order), each forward checkpointed: the second
    forward replays the second recording, and each recomputation the recording its own forward replayed."""
    moe = _random_moe(num_experts=4, top_k=2, load_balance="aux_loss", aux_loss_coeff=0.1)
    ref = copy.deepcopy(moe)
    xs = [torch.randn(3, 4, 8, dtype=torch.float64) for _ in range(2)]
    with record_routing(moe) as rec:
        for x in xs:
            moe(x)
    seen = []
    moe.router.register_forward_hook(lambda mod, args, r: seen.append(r.experts_TK))
    _negate_gates(moe, ref)
    with replay_routing(moe, rec):
        losses = [checkpoint(moe, x, use_reentrant=False).square().sum() + moe.aux_loss for x in xs]
        for loss in losses:
            loss.backward()
    assert [t.tolist() for t in seen] == [t.tolist() for t in rec.experts[""] * 2]
    with replay_routing(ref, rec):  # the same without checkpointing
        for x in xs:
            (ref(x).square().sum() + ref.aux_loss).backward()
    for (name, p), q in zip(moe.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12, msg=name)
    # The replays count the replayed choices, the recomputations nothing (moe counted its training-mode recording too).
    assert torch.equal(ref.tokens_per_expert, torch.bincount(torch.cat(rec.experts[""]).flatten(), minlength=4))
    assert torch.equal(moe.tokens_per_expert, 2 * ref.tokens_per_expert)


def test_bad_replays_raise_before_routing():
    moe = _random_moe(num_experts=4, top_k=2)
    x = torch.randn(2, 3, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"nothing recorded for MoE layer\(s\) \[''\]"):
        with replay_routing(moe, RoutingReplay()):
            pass
    with record_routing(moe) as rec:
        moe(x)
    with pytest.raises(ValueError, match=r"layer '', replayed forward 1 has 4 tokens on this rank but its recording "
                                         r"has 6 \(experts_TK of shape \(6, 2\)\)"):
        with replay_routing(moe, rec):
            moe(x[:, :2])
    with pytest.raises(ValueError, match=r"layer '' has 1 recorded forward\(s\); this is forward 2"):
        with replay_routing(moe, rec):
            moe(x)
            moe(x)
    bad = {"shape": torch.zeros(6, 3, dtype=torch.long), "range": torch.full((6, 2), 4),
           "twice": torch.zeros(6, 2, dtype=torch.long)}
    for kind, match in (("shape", r"int64 of shape \[tokens, top_k=2\], got torch.int64 of shape \(6, 3\)"),
                        ("range", r"expert ids must be in 0..3, got 4..4"), ("twice", "chooses one expert twice")):
        with pytest.raises(ValueError, match=match):
            with replay_routing(moe, RoutingReplay({"": [bad[kind]]})):
                pass
    with pytest.raises(ValueError, match=r"recorded layers \['layers.9.moe'\] are not MoE layers"):
        with replay_routing(moe, RoutingReplay({"": rec.experts[""], "layers.9.moe": rec.experts[""]})):
            pass
    with pytest.raises(ValueError, match="do not nest"):
        with record_routing(moe), replay_routing(moe, rec):
            pass
    assert moe.routing_replay is None


def test_a_recording_of_fewer_experts_is_refused():
    """A 4-expert layer's recording names valid ids of an 8-expert layer of the same name: its expert count is
    recorded and checked, on replay and when appending to it."""
    small, large = _random_moe(num_experts=4, top_k=2), _random_moe(num_experts=8, top_k=2)
    with record_routing(small) as rec:
        small(torch.randn(2, 3, 8, dtype=torch.float64))
    assert rec.num_experts == {"": 4}
    with pytest.raises(ValueError, match=r"replay_routing: MoE layer '' has 8 experts, its recording was made by a "
                                         r"layer of 4; valid: replay on the model that recorded"):
        with replay_routing(large, rec):
            pass
    with pytest.raises(ValueError, match=r"record_routing: MoE layer '' has 8 experts, `into` holds a recording of 4"):
        with record_routing(large, into=rec):
            pass
    with replay_routing(small, rec):  # its own model replays it
        small(torch.randn(2, 3, 8, dtype=torch.float64))


def test_compiled_blocks_compile_once_for_every_microbatch():
    """The main job compiles each block's forward (fullgraph), its MoE inside: the replay's hooks sit on the block,
    around the graph, so the position in the recording never enters it (one graph per grad mode, not one per
    microbatch, which fullgraph compilation refuses past the recompile limit); the replay equals the eager one."""
    from torch._dynamo.testing import CompileCounter

    from dtensor_moe.train.config import ModelConfig
    from dtensor_moe.train.model import MoETransformer

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=32, dim=8, n_layers=2, n_heads=2, num_experts=4, top_k=2, hidden_dim=4,
                      load_balance="aux_loss")
    ref = MoETransformer(cfg).double()
    model, graphs = copy.deepcopy(ref), CompileCounter()
    for block in model.layers.values():
        block.forward = torch.compile(block.forward, fullgraph=True, backend=graphs)
    xs = [torch.randint(0, 32, (2, 4)) for _ in range(10)]
    with torch.no_grad(), record_routing(model) as rec:
        for x in xs:
            model(x)
    _negate_gates(model, ref)
    for m in (model, ref):
        with replay_routing(m, rec):
            for x in xs:
                (m(x).square().sum() + balance_loss(m)).backward()
    assert graphs.frame_count == 2, graphs.frame_count
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12, msg=name)


def _negate_gates(*models):
    """A changed router whose own top-k differs from the recording almost everywhere (any placement: pointwise)."""
    with torch.no_grad():
        for m in models:
            for moe in m.modules():
                if isinstance(moe, MoE):
                    moe.router.gate.weight.neg_()


def _replay_on_mesh(rank: int, world_size: int, case: Case, checkpointed: bool) -> dict:
    """Rollout: each rank records its slice of two microbatches (eval, no grad), the reference the whole
    batch; gates negated; the training forwards replay (checkpointed: both forwards, then both backwards)."""
    cfg, dims, ref, x, grad_out = build(case, world_size)
    model = MoE(cfg).to(x.dtype)
    model.load_state_dict(ref.state_dict())
    parallelize_moe(model, dims, device_type="cpu", compile=case.compile, tp_grads="mean")  # as tests/parity.py
    mine, R, K = _slice(case, dims, rank), world_size, cfg.top_k
    xs = (x, x.roll(1, dims=-1))  # the second microbatch routes differently
    recs = []
    for m, part in ((ref, (slice(None),)), (model, mine)):
        m.eval()
        with torch.no_grad(), record_routing(m) as rec:
            for xb in xs:
                m(xb[part])
        m.train()
        recs.append(rec)
    errs = {f"recorded:{k}": float(not torch.equal(whole.view(*x.shape[:2], K)[mine].reshape(-1, K), local))
            for k, (whole, local) in enumerate(zip(recs[0].experts[""], recs[1].experts[""]))}
    _negate_gates(ref, model)
    fresh = ref.router(xs[0].view(-1, cfg.dim), ref.expert_bias).experts_TK
    errs["fresh_routing_is_the_recording"] = float(torch.equal(fresh, recs[0].experts[""][0]))

    with replay_routing(ref, recs[0]):
        xs_ref = [xb.clone().requires_grad_(True) for xb in xs]
        for xb in xs_ref:
            y = ref(xb)
            loss = sum((y[_slice(case, dims, r)] * grad_out[_slice(case, dims, r)]).sum() for r in range(R)) / R
            (loss + sum(ref.losses())).backward()
            ref_losses = [t.detach() for t in ref.losses()]
    seen = []
    model.router.register_forward_hook(lambda mod, args, r: seen.append(r.experts_TK))
    forward = (lambda t: checkpoint(model, t, use_reentrant=False)) if checkpointed else model
    with replay_routing(model, recs[1]):
        xs_r = [xb[mine].clone().requires_grad_(True) for xb in xs]
        losses = []
        for xb in xs_r:
            y_r = forward(xb)
            losses.append((y_r * grad_out[mine]).sum() + sum(model.losses()))
        for loss in losses:
            loss.backward()
    errs["out"] = _err(y_r.detach(), y[mine].detach())
    errs["losses"] = max([_err(a.detach(), b) for a, b in zip(model.losses(), ref_losses)], default=0.0)
    expected = recs[1].experts[""] * (2 if checkpointed else 1)
    errs["replayed_choices"] = float([t.tolist() for t in seen] != [t.tolist() for t in expected])
    for k, (xb, xb_ref) in enumerate(zip(xs_r, xs_ref)):
        errs[f"grad:x{k}"] = _err(xb.grad, xb_ref.grad[mine] * R)
    planned = {wp.name: wp for wp in plan_moe(cfg, dims)}
    for name, p in model.named_parameters():
        want = ref.get_parameter(name).grad[owned_box(planned[name], dims, rank)]
        errs[f"grad:{name}"] = _err(p.grad.to_local(), want)
    errs["tokens_per_expert"] = _err(model.global_tokens_per_expert(), ref.tokens_per_expert)
    return errs


MESHES = {
    "ep2_checkpointed": (2, Case(ep=2, batch_per_rank=(2, 1), moe=moe_config(
        num_experts=4, top_k=2, load_balance="aux_loss", seq_aux_loss_coeff=0.3, z_loss_coeff=0.01)), True),
    # The layer forward compiled (aot_eager), the replay's hooks around it.
    "ep2_compiled": (2, Case(ep=2, batch_per_rank=(1, 2), compile="aot_eager", moe=moe_config(
        num_experts=4, top_k=2, load_balance="aux_loss", num_shared_experts=1)), False),
    "etp2": (2, Case(etp=2, batch_per_rank=(1, 2), moe=moe_config(
        num_experts=4, top_k=2, score_func="sigmoid", route_scale=2.0, load_balance="aux_free_bias",
        num_shared_experts=1)), False),
    "cp2_ep2": (4, Case(cp=2, ep=2, batch_per_rank=(2, 1), seq_len=4, moe=moe_config(
        num_experts=4, top_k=2, score_func="topk_softmax", router_bias=True, load_balance="aux_loss",
        seq_aux_loss_coeff=0.3)), False),
    "tp2_edp2": (4, Case(tp=2, batch_per_rank=(1, 2), seq_len=4, moe=moe_config(
        num_experts=4, top_k=2, num_expert_groups=2, num_limited_groups=1, load_balance="aux_free_bias")), False),
}


@pytest.mark.parametrize("name", MESHES)
def test_replay_on_mesh_matches_one_process(name):
    world_size, case, checkpointed = MESHES[name]
    per_rank = run_on_ranks(world_size, _replay_on_mesh, case, checkpointed)
    worst = {k: max(r[k] for r in per_rank) for k in per_rank[0]}
    bad = {k: v for k, v in worst.items() if not v <= TOL}
    assert not bad, f"{name} mismatches: {bad}"
    assert any(k.startswith("grad:experts") for k in worst)


def _replay_bad_token_count(rank: int, world_size: int):
    cfg = moe_config(num_experts=4, top_k=2)
    model = MoE(cfg).double()
    parallelize_moe(model, MoEParallelDims(world_size, ep=2), device_type="cpu")
    x = torch.randn(2, 3, cfg.dim, dtype=torch.float64)
    with record_routing(model) as rec:
        model(x)
    with replay_routing(model, rec):
        model(x[:1])


def test_bad_token_count_raises_on_every_rank_before_the_dispatch():
    with pytest.raises(ValueError, match=r"replayed forward 1 has 3 tokens on this rank but its recording has 6"):
        run_on_ranks(2, _replay_bad_token_count)


def _replay_under_pipeline(rank: int, world_size: int, schedule: str, n_layers: int) -> dict:
    """PP2 x EP2 over two microbatches, full activation checkpointing: the rollout is the schedule's forward-only
    pass (eval mode, no grad), the training step replays; the reference replays its own recording of the whole
    batch under gradient accumulation over the same microbatches. Interleaved: two stages a rank, recorded and
    replayed through their stage_view."""
    from dtensor_moe.kernels.recompute import recomputing
    from dtensor_moe.moe import named_moes
    from dtensor_moe.train.config import ModelConfig
    from dtensor_moe.train.data import Batches
    from dtensor_moe.train.loop import _accumulating
    from dtensor_moe.train.loss import cross_entropy
    from dtensor_moe.train.model import MoETransformer
    from dtensor_moe.train.parallel.parallelize_transformer import parallelize_transformer
    from dtensor_moe.train.parallel.pipeline import Pipeline, stage_view

    seq, batch, mbs = 4, 8, 2
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=32, dim=8, n_layers=n_layers, n_heads=2, num_experts=4, top_k=2, hidden_dim=4,
                      load_balance="aux_loss", aux_loss_coeff=0.1, seq_aux_loss_coeff=0.05, z_loss_coeff=0.01)
    ref = MoETransformer(cfg).double()
    dims = MoEParallelDims(world_size, ep=2, pp=2)
    pp_mesh = dims.build_meshes("cpu").pp
    pipe = Pipeline(copy.deepcopy(ref), pp_mesh, schedule, mbs, batch // dims.dp, seq, seq, torch.float64,
                    torch.device("cpu"), lambda m: parallelize_transformer(m, dims, device_type="cpu",
                                                                     activation_checkpoint="full"))
    model = stage_view(pipe.parts)
    tokens = torch.randint(0, cfg.vocab_size, (500,), generator=torch.Generator().manual_seed(1))
    dp_rank = dims.dense_coords(rank)["dp_shard"]
    inputs, targets = Batches(tokens, seq, batch, 0, dp_rank, dims.dp_shard, microbatches=mbs)(0)
    whole_inputs, whole_targets = Batches(tokens, seq, batch, 0, 0, 1, microbatches=mbs)(0)

    for m in (*pipe.parts, ref):
        m.eval()
    with torch.no_grad(), record_routing(model) as rec:
        pipe.schedule.eval(inputs if pipe.has_first else None, target=targets if pipe.has_last else None)
    with torch.no_grad(), record_routing(ref) as ref_rec:
        for x in whole_inputs.tensor_split(mbs):
            ref(x)
    for m in (*pipe.parts, ref):
        m.train()
    local = batch // mbs // dims.dp_shard
    errs = {f"recorded:{name}:{k}": float(not torch.equal(
        whole.view(-1, seq, 2)[dp_rank * local:(dp_rank + 1) * local].reshape(-1, 2), mine))
        for name, entries in rec.experts.items() for k, (whole, mine) in enumerate(zip(ref_rec.experts[name], entries))}
    _negate_gates(ref, *pipe.parts)
    seen = {name: [] for name in rec.experts}
    for name, moe in named_moes(model).items():
        moe.router.register_forward_hook(lambda mod, args, r, name=name: seen[name].append((recomputing(), r)))
    with replay_routing(model, rec):
        ce, aux = pipe.step(inputs, targets)
    with replay_routing(ref, ref_rec):
        ref_ce, ref_aux = _accumulating(ref, mbs, cross_entropy)(whole_inputs, whole_targets)
    for name, entries in rec.experts.items():  # forwards in order, and each recomputation its own forward's
        for again in (False, True):
            replayed = [r.experts_TK.tolist() for a, r in seen[name] if a == again]
            errs[f"replayed:{name}:{again}"] = float(replayed != [t.tolist() for t in entries])
    ref_grads = dict(ref.named_parameters())
    for n, p in model.named_parameters():
        errs[f"grad:{n}"] = (p.grad.full_tensor() - ref_grads[n].grad).abs().max().item()
    aux_t = torch.tensor([aux], dtype=torch.float64)
    torch.distributed.all_reduce(aux_t, group=pp_mesh.get_group())  # each stage's MoE layers
    errs["aux"] = abs(aux_t.item() - ref_aux)
    ce_t = torch.tensor([ce], dtype=torch.float64)
    torch.distributed.all_reduce(ce_t)  # the last stage's ranks: the mean of their shares is the batch's
    errs["ce"] = abs(ce_t.item() / dims.dp - ref_ce)
    errs["layers"] = float(len(rec.experts) != n_layers // 2)  # this rank's share of the layers
    return errs


@pytest.mark.parametrize("schedule,n_layers", [("1f1b", 2), ("interleaved_1f1b", 4)])
def test_replay_under_pipeline_matches_one_process(schedule, n_layers):
    per_rank = run_on_ranks(4, _replay_under_pipeline, schedule, n_layers)
    for r in per_rank:
        bad = {k: v for k, v in r.items() if not v <= TOL}
        assert not bad, bad
        assert any(k.startswith("grad:layers") for k in r) and any(k.startswith("replayed:") for k in r)


@pytest.mark.parametrize("recorded", [{"moe": [torch.zeros(3, 2, dtype=torch.long)]}, [[0, 1], [2, 3]]],
                         ids=["dict", "nested_lists"])
def test_replay_names_the_type_it_wants(recorded):
    moe = MoE(MoEConfig(dim=8, hidden_dim=4, num_experts=4, top_k=2))
    with pytest.raises(TypeError, match="recorded must be a RoutingReplay"):
        with replay_routing(moe, recorded):
            pass


@pytest.mark.parametrize("experts", [[("moe", [])], {"moe": torch.zeros(3, 2, dtype=torch.long)}, {"moe": [[0, 1]]}],
                         ids=["pairs", "one_tensor", "nested_lists"])
def test_recording_names_the_layout_it_wants(experts):
    with pytest.raises(TypeError, match="RoutingReplay"):
        RoutingReplay(experts)
