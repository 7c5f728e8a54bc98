"""Degrees, folding and the placement plan as pure data: validation errors and the ownership invariant."""

import math
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dtensor_moe import MoEConfig, MoEParallelDims, owned_box, ownership, plan_moe
from dtensor_moe.parallel.mesh import divisors
from dtensor_moe.parallel.placement import ShardStep, WeightPlan, _tiles


def test_dp_shard_is_rest_of_world_and_edp_folds():
    d = MoEParallelDims(16, dp_replicate=2, ep=2, etp=2)
    assert d.dp_shard == 8 and d.edp == 2
    assert d.expert_shape == (2, 2, 2, 2) and d.dense_shape == (2, 8, 1, 1)
    # ETP innermost, then EP: consecutive ranks differ in etp first.
    assert [d.expert_coords(r)["etp"] for r in range(4)] == [0, 1, 0, 1]
    assert [d.expert_coords(r)["ep"] for r in range(4)] == [0, 0, 1, 1]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(world_size=8, dp_replicate=3), r"dp_replicate \* cp \* tp = .* must divide world_size 8; valid"),
        (dict(world_size=8, dp_shard=3), r"must equal world_size 8.*valid dp_shard here: 8"),
        (dict(world_size=8, ep=3), r"ep \* etp = 3\*1 must divide dp_shard \* cp \* tp = 8.*Valid ep: \[1, 2, 4, 8\]"),
        (dict(world_size=8, ep=4, etp=4), r"ep \* etp = 4\*4 must divide .*valid \(ep, etp\) pairs"),
        (dict(world_size=8, etp=0), r"etp must be >= 1"),
        (dict(world_size=8, dp_shard=0), r"dp_shard must be >= 1 or -1"),
        (dict(world_size=0), r"world_size must be >= 1"),
    ],
)
def test_bad_degrees_raise_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MoEParallelDims(**kwargs)


@pytest.mark.parametrize(
    "cfg,dims,match",
    [
        (
            dict(num_experts=6),
            dict(ep=4),
            r"num_experts \(6\) must be divisible by ep \(4\).*valid ep for this world: \[1, 2\]",
        ),
        (
            dict(hidden_dim=6),
            dict(etp=4),
            r"hidden_dim \(6\) must be divisible by etp \(4\).*valid etp with ep=1: \[1, 2\]",
        ),
        (
            dict(num_experts=6),
            dict(tp=2, ep=4),
            r"num_experts \(6\) must be divisible by ep \(4\).*valid ep for this world: \[1, 2\]",
        ),
    ],
)
def test_bad_model_for_mesh_raises(cfg, dims, match):
    base = dict(dim=8, hidden_dim=8, num_experts=8, top_k=2)
    with pytest.raises(ValueError, match=match):
        plan_moe(MoEConfig(**{**base, **cfg}), MoEParallelDims(8, **dims))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(top_k=9), r"top_k \(9\) must be <= num_experts \(8\); valid top_k: 1..8"),
        (dict(score_func="relu"), r"score_func must be one of"),
        (dict(load_balance="x"), r"load_balance must be one of"),
        (dict(dim=0), r"dim must be >= 1"),
    ],
)
def test_bad_config_raises(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MoEConfig(**{**dict(dim=8, hidden_dim=8, num_experts=8, top_k=2), **kwargs})


@st.composite
def plan_inputs(draw):
    world = draw(st.sampled_from([1, 2, 4, 6, 8, 12, 16, 32, 64]))
    rep = draw(st.sampled_from(divisors(world)))
    cp = draw(st.sampled_from(divisors(world // rep)))
    tp = draw(st.sampled_from(divisors(world // rep // cp)))
    ep = draw(st.sampled_from(divisors(world // rep)))
    etp = draw(st.sampled_from(divisors(world // rep // ep)))
    E = ep * draw(st.integers(1, 5))
    F = etp * draw(st.integers(1, 5))
    D = draw(st.integers(1, 12))
    shared = draw(st.integers(0, 2))
    cfg = MoEConfig(dim=D, hidden_dim=F, num_experts=E, top_k=1, num_shared_experts=shared)
    return cfg, MoEParallelDims(world, dp_replicate=rep, cp=cp, tp=tp, ep=ep, etp=etp)


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(plan_inputs())
def test_no_double_sharding_invariant(inputs):
    """Every element held by exactly dp_replicate ranks; experts split EP*EDP*ETP ways, evenly when divisible."""
    cfg, dims = inputs
    for wp in plan_moe(cfg, dims):
        own = ownership(wp, dims)
        assert own.copies == dims.dp_replicate
        # Independent count: materialize per-element copy counts from the per-rank boxes.
        count = torch.zeros(wp.global_shape, dtype=torch.int64)
        for r in range(dims.world_size):
            count[owned_box(wp, dims, r)] += 1
        assert bool((count == dims.dp_replicate).all()), wp.name
        if wp.role == "expert":
            assert own.shard_factor == dims.ep * dims.edp * dims.etp
            if not wp.padded:
                assert own.exact and own.max_rank_numel == wp.numel // (dims.ep * dims.edp * dims.etp)
            # FSDP pads only when no dim of the local slice splits evenly over EDP (w13's gate / up pair dim
            # is never split: each rank's GEMM needs both halves of its rows).
            local = [wp.global_shape[0] // dims.ep, *wp.global_shape[1:]]
            local[wp.step_on("etp").dim] //= dims.etp
            if wp.name == "experts.w13":
                del local[1]
            assert wp.padded == all(n % dims.edp for n in local)


def test_fsdp_dim_avoids_padding_when_experts_per_rank_not_divisible():
    cfg = MoEConfig(dim=8, hidden_dim=6, num_experts=4, top_k=2)
    dims = MoEParallelDims(8, ep=4)  # E/EP = 1 expert per rank, EDP = 2
    w13 = next(wp for wp in plan_moe(cfg, dims) if wp.name == "experts.w13")
    assert w13.fsdp_step == ShardStep("edp", 3) and not w13.padded  # D splits evenly, E/EP=1 does not
    assert w13.local_shape == (1, 2, 6, 4)
    assert ownership(w13, dims).exact


def test_tiling_check_detects_overlap_and_holes():
    s = slice
    assert _tiles([(s(0, 2), s(0, 4)), (s(2, 4), s(0, 4))], (4, 4))
    assert not _tiles([(s(0, 3), s(0, 4)), (s(2, 4), s(0, 4))], (4, 4))  # overlap
    assert not _tiles([(s(0, 2), s(0, 4))], (4, 4))  # hole
    nested = WeightPlan(
        "w", "expert", (4, 4), (ShardStep("ep", 0), ShardStep("etp", 0)), ("dp_replicate",), (2, 4), False
    )
    # Sharding dim 0 over ep and again over etp with chunk math is still a tiling; a plan that
    # ignores an axis is caught as double ownership:
    dims = MoEParallelDims(4, ep=2, etp=2)
    assert ownership(nested, dims).copies == 1
    dup = WeightPlan("w", "expert", (4, 4), (ShardStep("ep", 0),), ("dp_replicate",), (2, 4), False)
    with pytest.raises(ValueError, match=r"exactly 1 times \(replicated over \['dp_replicate'\]\)"):
        ownership(dup, dims)
    # Replicated over etp on purpose (the experts' output bias b2): each element held by both ETP ranks.
    assert ownership(replace(dup, replicate_axes=("dp_replicate", "etp")), dims).copies == 2
    assert math.prod(nested.local_shape) == 8
