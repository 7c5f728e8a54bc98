"""Which expert weights FSDP manages, mixed precision on the ones it does not, and how many rows
the dispatch moves."""

import pytest
import torch

from tests.harness import run_on_ranks

TOL = 3e-2  # bf16 compute against a float32 reference


def _mixed_precision_layer(rank: int, world_size: int, ep: int) -> dict:
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy

    from dtensor_moe import MoE, MoEConfig, MoEParallelDims, parallelize_moe

    torch.manual_seed(0)
    cfg = MoEConfig(dim=16, hidden_dim=8, num_experts=4, top_k=2)
    ref = MoE(cfg)
    model = MoE(cfg)
    model.load_state_dict(ref.state_dict())
    parallelize_moe(model, MoEParallelDims(world_size, ep=ep), device_type="cpu",
                    mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    x = torch.randn(world_size, 6, cfg.dim)
    y_ref = ref(x)
    y = model(x[rank : rank + 1])
    y.float().square().sum().backward()  # per-rank loss; gradients follow mean over ranks
    y_ref.square().sum().div(world_size).backward()
    w13 = model.experts.w13
    return {
        "experts_fsdp": isinstance(model.experts, FSDPModule),
        "moe_fsdp": isinstance(model, FSDPModule),
        "out_err": ((y.float() - y_ref[rank]).abs().max() / y_ref.abs().max()).item(),
        "param_dtype": str(w13.dtype),
        "grad_dtype": str(w13.grad.dtype),
        "grad_err": (
            (w13.grad.full_tensor() - ref.experts.w13.grad).abs().max() / ref.experts.w13.grad.abs().max()
        ).item(),
    }


@pytest.mark.parametrize("ep,experts_fsdp", [(2, False), (1, True)])
def test_experts_in_fsdp_only_with_an_expert_data_parallel_axis(ep, experts_fsdp):
    """EP=2 on 2 ranks leaves no EDP axis: experts stay plain DTensors (FSDP on a 1-rank mesh would
    only copy them), yet bf16 mixed precision still applies to them. EDP=2 keeps them in FSDP."""
    for r in run_on_ranks(2, _mixed_precision_layer, ep):
        assert r["experts_fsdp"] is experts_fsdp and r["moe_fsdp"]
        assert r["param_dtype"] == r["grad_dtype"] == "torch.float32"
        assert r["out_err"] < TOL and r["grad_err"] < TOL, r


def _dispatch_rows(rank: int, world_size: int, etp: int) -> list:
    """Rows of width D each all-to-all of one forward moves, with top_k = num_experts."""
    from unittest import mock

    from dtensor_moe import MoE, MoEConfig, MoEParallelDims, parallelize_moe
    from dtensor_moe.parallel import exchange

    torch.manual_seed(0)
    cfg = MoEConfig(dim=16, hidden_dim=8, num_experts=4, top_k=4)
    model = MoE(cfg)
    parallelize_moe(model, MoEParallelDims(world_size, ep=world_size // etp, etp=etp), device_type="cpu")
    rows = []
    real = exchange.all_to_all_rows

    def spy(x, *args, **kwargs):
        if x.dim() == 2 and x.shape[1] == cfg.dim:
            rows.append(x.shape[0])
        return real(x, *args, **kwargs)

    with mock.patch.object(exchange, "all_to_all_rows", spy):
        model(torch.randn(1, 5, cfg.dim))
    return rows


@pytest.mark.parametrize("etp", [1, 2])
def test_dispatch_sends_each_token_once_per_rank(etp):
    """5 tokens, each routed to all 4 experts: the dispatch moves 5 rows per destination (not 5 x its
    experts there), and the combine returns as many (each rank sums a token's experts it holds)."""
    per_rank = run_on_ranks(2, _dispatch_rows, etp)
    for rows in per_rank:
        # EP=2: each token goes to both ranks and comes back from both (10 rows each way; per pair
        # it was 20). ETP=2: the 5 tokens go to both ETP peers and back (10 each way; per pair 40).
        assert rows == [10, 10], rows


def _parallelize_twice(rank, world_size):
    import pytest

    from dtensor_moe import MoE, MoEConfig, MoEParallelDims, parallelize_moe

    moe = MoE(MoEConfig(dim=8, hidden_dim=6, num_experts=4, top_k=2))
    dims = MoEParallelDims(world_size, ep=2)
    parallelize_moe(moe, dims, device_type="cpu")
    before = {n: type(p).__name__ for n, p in moe.named_parameters()}
    with pytest.raises(ValueError, match=r"already parallelized"):
        parallelize_moe(moe, dims, device_type="cpu")
    return before == {n: type(p).__name__ for n, p in moe.named_parameters()}


def test_second_parallelize_raises_before_touching_the_module():
    from .harness import run_on_ranks

    assert all(run_on_ranks(2, _parallelize_twice))
