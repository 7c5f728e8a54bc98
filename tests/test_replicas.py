"""Hot-expert replicas (MoERunOptions.expert_replicas): their placement alone, and the dispatched layer against the
single-process float64 reference (outputs, every gradient) with replicas on gloo CPU ranks; the row cap."""

from dataclasses import replace

import pytest

from dtensor_moe import MoERunOptions

from .harness import run_on_ranks
from .parity import Case, moe_config, parity_errors
from .test_parity import TOL, assert_parity

NAMED = {
    "ep2_r1": (2, Case(ep=2, moe=moe_config(num_experts=4, top_k=2), run=MoERunOptions(expert_replicas=1),
                       batch_per_rank=(2, 1))),
    "ep2_etp2_r2_biases": (4, Case(ep=2, etp=2, batch_per_rank=(2, 1, 0, 3),
                                   moe=moe_config(num_experts=4, top_k=2, expert_biases=True),
                                   run=MoERunOptions(expert_replicas=2))),
    "edp2_ep2_r1_accumulate": (4, Case(ep=2, moe=moe_config(num_experts=4, top_k=2),
                                       run=MoERunOptions(expert_replicas=1), batch_per_rank=(2, 1, 0, 3),
                                       microbatches=2)),
    "ep4_r2_one_hot_expert": (4, Case(ep=4, moe=moe_config(num_experts=4, top_k=1),
                                      run=MoERunOptions(expert_replicas=2), batch_per_rank=(2, 3, 1, 2),
                                      hot_expert=3)),
}


@pytest.mark.parametrize("name", NAMED)
def test_replicas_parity(name):
    assert_parity(*NAMED[name])


def _balance(rank: int, world_size: int, case: Case):
    """Parity errors, rows per EP rank (the slots placed from the batch's own counts, then on the next batch from
    this one's), and the bytes the replica weights' all-to-alls sent from this rank."""
    import torch

    from dtensor_moe.parallel.exchange import count_sent_bytes

    from .parity import _slice, build

    with count_sent_bytes() as counted:
        errs, model = parity_errors(rank, world_size, case)
    sent = {k[1]: v for k, v in counted.items() if k[0] == "replica_weights"}
    load = model.experts.expert_parallel.load
    rows = [load.last]
    _, dims, _, x_next, _ = build(replace(case, seed=case.seed + 1), world_size)
    with torch.no_grad():
        model(x_next[_slice(case, dims, rank)])
    return errs, [*rows, load.last], sent


SKEWED = dict(ep=8, zipf=1.2, batch_per_rank=(4,) * 8, seq_len=32)  # 128 tokens a rank, K=2: 256 pairs a rank


@pytest.mark.parametrize("r", [0, 2])
def test_skewed_rows_per_rank(r, record_property):
    """E=64 over EP=8, Zipf 1.2 routing (benchmarks/routing.py's skewed mode): rows per EP rank max / mean, exact
    parity either way; replicas (r=2) bring the hottest rank within 15% of the mean and move weights both ways."""
    case = Case(**SKEWED, moe=moe_config(num_experts=64, top_k=2, dim=64, hidden_dim=2),
                run=MoERunOptions(expert_replicas=r, replica_replan_every=1))
    per_rank = run_on_ranks(8, _balance, case)
    worst = {k: max(errs[k] for errs, _, _ in per_rank) for k in per_rank[0][0]}
    assert all(v <= TOL for v in worst.values()), {k: v for k, v in worst.items() if not v <= TOL}
    rows_now, rows_next = per_rank[0][1]
    assert all(got == [rows_now, rows_next] for _, got, _ in per_rank) and sum(rows_now) == 8 * 128 * 2
    ratios = [max(rows) / (sum(rows) / len(rows)) for rows in (rows_now, rows_next)]
    record_property("rows_max_over_mean", ratios)
    print(f"r={r}: rows per EP rank {rows_now}, max / mean {ratios[0]:.3f}; the next batch, placed from this "
          f"one's counts: {rows_next}, {ratios[1]:.3f}")
    if r:
        assert max(ratios) <= 1.15
        assert any(sent.get("there") for _, _, sent in per_rank) and any(sent.get("back") for _, _, sent in per_rank)
    else:
        assert min(ratios) > 2  # the skew the replicas are for


def _zipf_counts(E: int, ep: int, K: int, T: int, seed: int) -> list[list[int]]:
    """Per EP source rank, pairs per expert under benchmarks/routing.py's skewed routing (Zipf 1.2)."""
    import torch

    from benchmarks.routing import expert_choices_TK

    return [torch.bincount(expert_choices_TK("skewed", T, E, K, seed * ep + s, 1.2).flatten(), minlength=E).tolist()
            for s in range(ep)]


def test_place_replicas_is_deterministic_and_balances():
    """The slots are a function of the loads alone; each replica copies another rank's expert, at most once a rank;
    placed on one batch's counts they keep the next batches' rows per EP rank within 15% of the mean (the split
    follows each batch's own counts), from 3.7x without replicas."""
    from dtensor_moe.parallel.replicas import place_replicas, rows_per_rank, source_segments

    E, ep, K, T = 64, 8, 2, 256
    counts = _zipf_counts(E, ep, K, T, seed=0)
    load = [sum(c[e] for c in counts) for e in range(E)]
    slots = place_replicas(load, ep, 2)
    assert slots == place_replicas(list(load), ep, 2)
    for q, row in enumerate(slots):
        held = [e for e in row if e >= 0]
        assert len(set(held)) == len(held) and all(e // (E // ep) != q for e in held)

    def ratio(rows):
        return max(rows) / (sum(rows) / len(rows))

    assert ratio(rows_per_rank(load, ep, place_replicas(load, ep, 0))) > 3
    for seed in (1, 2, 3):
        later = _zipf_counts(E, ep, K, T, seed)
        later_load = [sum(c[e] for c in later) for e in range(E)]
        assert ratio(rows_per_rank(later_load, ep, slots)) <= 1.15
        # Each source's segments cover exactly its pairs, expert by expert.
        segments = source_segments(later, ep, slots)
        assert [sum(n for _, n in seg) for seg in segments] == [sum(c) for c in later]


def test_water_fill():
    from dtensor_moe.parallel.replicas import _water_fill

    assert _water_fill(10, [0, 0]) == [5, 5]
    assert _water_fill(5, [4, 0, 1]) == [0, 3, 2]
    assert _water_fill(7, [0, 0, 0]) == [3, 2, 2]
    assert _water_fill(0, [3, 1]) == [0, 0]
    assert _water_fill(2, [9, 0]) == [0, 2]


def _hot_expert_grads(rank: int, world_size: int, case: Case):
    errs, model = parity_errors(rank, world_size, case)
    return errs, model.experts.expert_parallel.load.last, sorted(model.state_dict())


def test_replica_gradients_land_in_the_owner():
    """One expert takes (almost) every token: with replicas its rows spread over every EP rank, and its owner's
    weight gradient (every gradient) still equals the single-process one; the state dict is the owners' alone."""
    base = Case(ep=4, batch_per_rank=(2, 3, 1, 2), hot_expert=1, seq_len=4,
                moe=moe_config(num_experts=4, top_k=1, expert_biases=True))
    without = run_on_ranks(4, _hot_expert_grads, base)
    with_r = run_on_ranks(4, _hot_expert_grads, replace(base, run=replace(base.run, expert_replicas=1)))
    for errs, _, _ in with_r:
        assert all(v <= TOL for v in errs.values()), errs
    rows0, rows1 = without[0][1], with_r[0][1]
    assert max(rows0) >= 0.9 * sum(rows0) and max(rows1) < 0.5 * sum(rows1), (rows0, rows1)
    assert without[0][2] == with_r[0][2]


def test_placement_changes_between_forwards_only():
    """Slots are re-placed from the summed counts every replan_every training forwards, never while a forward
    awaits its backward (its recomputation must run with its slots), and never by an evaluation forward."""
    from dtensor_moe.parallel.replica_dispatch import Replicas

    rep = Replicas.__new__(Replicas)
    rep.r, rep.replan_every, rep.ep = 1, 2, 2
    rep.slots, rep.summed_E, rep.forwards, rep.in_flight = None, None, 0, 0
    hot0, hot2 = [9, 1, 1, 1], [1, 1, 9, 1]  # expert 0 (rank 0's), then expert 2 (rank 1's) the hot one
    assert rep._placement(hot0, True) == ((-1,), (0,))
    assert rep._placement(hot2, False) == ((-1,), (0,))  # evaluation: counted nowhere
    assert rep._placement(hot2, True) == ((-1,), (0,))  # one forward since the placement: not yet due
    rep.in_flight = 1
    assert rep._placement(hot2, True) == ((-1,), (0,))  # due, but a forward awaits its backward
    rep.in_flight = 0
    assert rep._placement(hot2, True) == ((2,), (-1,))  # from hot0 + 2 * hot2: expert 2 the hot one


def _checkpointed_steps(rank: int, world_size: int):
    """Three steps of EP2 with one replica slot a rank, re-placed every forward while the hot expert moves, under
    activation checkpointing (its recomputation runs in the backward, after the placement could have changed) and
    without: the same gradients, and no forward left awaiting its backward."""
    import torch
    from torch.utils.checkpoint import checkpoint

    from dtensor_moe import MoE, MoEConfig, MoEParallelDims, parallelize_moe

    cfg = MoEConfig(dim=4, hidden_dim=2, num_experts=4, top_k=1)
    run = MoERunOptions(expert_replicas=1, replica_replan_every=1)
    torch.manual_seed(0)
    models = [MoE(cfg, run).double() for _ in range(2)]
    with torch.no_grad():
        models[0].router.gate.weight[:, 0] = torch.tensor([1.0, 0.0, -1.0, 0.0], dtype=torch.float64)
    models[1].load_state_dict(models[0].state_dict())
    for m in models:
        parallelize_moe(m, MoEParallelDims(world_size, ep=2), device_type="cpu")
    placements = []
    for step in range(3):
        x = torch.randn(2, 3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(10 * step + rank))
        x[..., 0] = 5.0 * (step % 2 * 2 - 1)  # the hot expert flips between steps
        for m, ac in zip(models, (False, True)):
            y = checkpoint(m, x, use_reentrant=False) if ac else m(x)
            y.square().sum().backward()
        placements.append([m.experts.expert_parallel.dispatcher.replicas.slots for m in models])
    grads = [(a.grad.to_local() - b.grad.to_local()).abs().max().item()
             for a, b in zip(models[0].parameters(), models[1].parameters())]
    # Two forwards before either backward (a pipeline schedule's order): the second may not re-place the slots
    # the first one's recomputation needs.
    hot = torch.zeros(4, dtype=torch.float64)
    hot[0] = 5.0
    for y in [checkpoint(models[1], torch.randn(2, 3, 4, dtype=torch.float64) + sign * hot, use_reentrant=False)
              for sign in (1, -1)]:
        y.sum().backward()
    return grads, placements, [m.experts.expert_parallel.dispatcher.replicas.in_flight for m in models]


def test_replanning_under_activation_checkpointing():
    for grads, placements, in_flight in run_on_ranks(2, _checkpointed_steps):
        assert max(grads) <= TOL and in_flight == [0, 0]
        assert all(a == b for a, b in placements) and len({p[0] for p in placements}) > 1, placements


def _capped_forward(rank: int, world_size: int, cap: int):
    import torch
    from torch import nn

    from dtensor_moe import MoE, MoEConfig, MoEParallelDims, parallelize_moe

    cfg = MoEConfig(dim=4, hidden_dim=2, num_experts=4, top_k=1)
    model = nn.ModuleDict({"block": nn.ModuleDict({"moe": MoE(cfg, MoERunOptions(max_rows_per_rank=cap))})})
    with torch.no_grad():
        model.block.moe.router.gate.weight[:, 0] = torch.tensor([9.0, 0.0, 0.0, 0.0])  # rank 0's expert 0 is hot
    parallelize_moe(model, MoEParallelDims(world_size, ep=2), device_type="cpu")
    x = torch.randn(1, 4 + 2 * rank, 4)
    x[..., 0] = 1.0
    for _ in range(2):
        model.block.moe(x)
    return model.block.moe.experts.expert_parallel.load.last


def test_row_cap_raises_on_every_rank():
    """max_rows_per_rank: the forward that would exceed it raises the same ValueError on every rank (no rank left
    in a collective), naming the layer, the forward and the rows per EP rank; under the cap nothing changes."""
    assert run_on_ranks(2, _capped_forward, 10) == [[10, 0]] * 2
    with pytest.raises(ValueError, match=r"MoE layer 'block.moe', forward 1: EP rank 0 would compute 10 expert rows, "
                                         r"more than max_rows_per_rank \(9\); rows per EP rank \[10, 0\]"):
        run_on_ranks(2, _capped_forward, 9)


@pytest.mark.parametrize("options,match", [
    (dict(expert_replicas=-1), r"MoERunOptions.expert_replicas must be >= 0, got -1"),
    # The options alone hold 5 slots; the layer of 4 experts refuses them.
    (dict(expert_replicas=5), r"MoERunOptions.expert_replicas \(5\) must be in 0..num_experts \(4\): each slot holds "
                              r"a copy of one expert, .*; valid: MoERunOptions.expert_replicas 0..4"),
    (dict(replica_replan_every=0), r"MoERunOptions.replica_replan_every must be >= 1, got 0"),
    (dict(max_rows_per_rank=-1), r"MoERunOptions.max_rows_per_rank must be >= 0, got -1"),
    (dict(expert_replicas=1, capacity_factor=1.0, pad_to_capacity=True),
     r"MoERunOptions.expert_replicas \(1\) needs the dropless dispatch, got MoERunOptions.pad_to_capacity=True"),
])
def test_bad_replica_options(options, match):
    from dtensor_moe import MoE, MoEConfig

    with pytest.raises(ValueError, match=match):
        MoE(MoEConfig(dim=4, hidden_dim=2, num_experts=4, top_k=1), MoERunOptions(**options))


def test_replica_slots_are_bounded_by_the_layers_experts():
    """MoERunOptions knows no num_experts: check_run_options (which MoE calls) bounds the slots by the config's."""
    from dtensor_moe import MoE, MoEConfig
    from dtensor_moe.config import check_run_options

    run = MoERunOptions(expert_replicas=5)  # fine on its own
    check_run_options(MoEConfig(dim=4, hidden_dim=2, num_experts=8, top_k=1), run)
    with pytest.raises(ValueError, match=r"^moe_run.expert_replicas \(5\) must be in 0..num_experts \(4\)"):
        check_run_options(MoEConfig(dim=4, hidden_dim=2, num_experts=4, top_k=1), run, "moe_run.")
    with pytest.raises(ValueError, match=r"^MoERunOptions.expert_replicas \(5\) must be in 0..num_experts \(4\)"):
        MoE(MoEConfig(dim=4, hidden_dim=2, num_experts=4, top_k=1), run)  # the layer checks them at construction


def test_replicas_need_ep():
    """The placement plan is the architecture's (replicas place nothing in it); parallelizing a layer with replica
    slots on ep 1 is refused before any collective, by parallelize_moe and ExpertParallel alike."""
    from dtensor_moe import ExpertParallel, MoE, MoEConfig, MoEParallelDims, parallelize_moe, plan_moe

    cfg = MoEConfig(dim=4, hidden_dim=2, num_experts=4, top_k=1)
    dims = MoEParallelDims(4)
    assert plan_moe(cfg, dims) == plan_moe(cfg, dims)  # no run options in the plan: nothing to refuse there
    match = r"expert_replicas \(1\) needs ep > 1 .*, got ep 1; valid: expert_replicas 0, or ep in \[2, 4\]"
    with pytest.raises(ValueError, match=match):
        parallelize_moe(MoE(cfg, MoERunOptions(expert_replicas=1)), dims, device_type="cpu")
    with pytest.raises(ValueError, match=match):
        ExpertParallel(dims, fully_shard=False)._apply(MoE(cfg, MoERunOptions(expert_replicas=1)), None)


def _adam_steps(rank: int, world_size: int):
    """Two Adam steps of EP2 x EDP2 (FSDP2 on the experts) with and without replicas, one expert hot: the largest
    difference of any parameter shard and optimizer moment, whether both state dicts have the same keys, and the rows
    per EP rank of both."""
    import torch

    from dtensor_moe import MoE, MoEConfig, MoEParallelDims, parallelize_moe

    out = []
    for r in (0, 2):
        cfg = MoEConfig(dim=4, hidden_dim=2, num_experts=4, top_k=2, expert_biases=True)
        torch.manual_seed(0)
        model = MoE(cfg, MoERunOptions(expert_replicas=r)).double()
        with torch.no_grad():
            model.router.gate.weight[3, 0] = 9.0
        parallelize_moe(model, MoEParallelDims(world_size, ep=2), device_type="cpu")
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        for step in range(2):
            x = torch.randn(2, 3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(10 * step + rank))
            x[..., 0] = 1.0
            model(x).square().sum().backward()
            opt.step()
            opt.zero_grad()
        moments = [t.to_local() for s in opt.state.values() for k, t in sorted(s.items()) if k != "step"]
        out.append(([p.to_local() for p in model.parameters()] + moments, sorted(model.state_dict()),
                    model.experts.expert_parallel.load.last))
    (a, keys_a, rows_a), (b, keys_b, rows_b) = out
    return max((x - y).abs().max().item() for x, y in zip(a, b)), keys_a == keys_b, (rows_a, rows_b)


def test_optimizer_steps_equal_without_replicas():
    for diff, same_keys, (rows, replicated) in run_on_ranks(4, _adam_steps):
        assert diff <= TOL and same_keys
        assert max(replicated) < max(rows), (rows, replicated)


def _unitless_experts(rank: int, world_size: int):
    """ExpertParallel(fully_shard=False, gather_in_forward=True) over EP2 x EDP2, eager: the experts have no FSDP2
    unit and gather their weights over EDP themselves; the replicas take the same gathered slices. Expert gradients
    with and without replicas."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from dtensor_moe import ExpertParallel, MoE, MoEConfig, MoEParallelDims

    grads = []
    for r in (0, 1):
        torch.manual_seed(0)
        model = MoE(MoEConfig(dim=4, hidden_dim=2, num_experts=4, top_k=2), MoERunOptions(expert_replicas=r)).double()
        with torch.no_grad():
            model.router.gate.weight[0, 0] = 9.0
        parallelize_module(model, init_device_mesh("cpu", (world_size,)),
                           ExpertParallel(MoEParallelDims(world_size, ep=2), fully_shard=False,
                                          gather_in_forward=True))
        x = torch.randn(2, 3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
        x[..., 0] = 1.0
        model(x).square().sum().backward()
        grads.append([p.grad.to_local() for p in model.experts.parameters()])
    return max((a - b).abs().max().item() for a, b in zip(*grads))


def test_replicas_of_unitless_experts():
    assert max(run_on_ranks(4, _unitless_experts)) <= TOL
