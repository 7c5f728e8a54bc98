"""The unparallelized MoE (the reference every parallel test trusts) against a naive per-token loop."""

from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from dtensor_moe import MoE, MoEConfig
from dtensor_moe.experts import grouped_swiglu


def naive_moe(moe: MoE, x_BLD):
    cfg = moe.config
    x_TD = x_BLD.reshape(-1, cfg.dim)
    logits = x_TD @ moe.router.gate.weight.T
    scores = torch.softmax(logits, -1) if cfg.score_func == "softmax" else torch.sigmoid(logits)
    sel = scores if moe.expert_bias is None else scores + moe.expert_bias
    out = torch.zeros_like(x_TD)
    for t in range(x_TD.shape[0]):
        top = torch.topk(sel[t], cfg.top_k).indices
        w = scores[t, top]
        if cfg.route_norm and cfg.top_k > 1:
            w = w / w.sum()
        for e, we in zip(top.tolist(), w * cfg.route_scale):
            h = F.silu(moe.experts.w1[e] @ x_TD[t]) * (moe.experts.w3[e] @ x_TD[t])
            out[t] += we * (moe.experts.w2[e] @ h)
    if moe.shared_experts is not None:
        out = out + moe.shared_experts(x_TD)
    return out.view_as(x_BLD)


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("top_k,shared,route_norm", [(1, 0, True), (2, 1, True), (4, 0, False), (4, 2, True)])
def test_moe_matches_naive_loop(score_func, top_k, shared, route_norm):
    torch.manual_seed(0)
    cfg = MoEConfig(dim=8, hidden_dim=6, num_experts=4, top_k=top_k, score_func=score_func,
                    route_norm=route_norm, route_scale=1.5, num_shared_experts=shared)
    moe = MoE(cfg).double()
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.5)
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    torch.testing.assert_close(moe(x), naive_moe(moe, x), rtol=1e-12, atol=1e-12)


def test_aux_free_bias_steers_selection_not_weights():
    torch.manual_seed(0)
    cfg = MoEConfig(dim=8, hidden_dim=6, num_experts=4, top_k=2, load_balance="aux_free_bias")
    moe = MoE(cfg).double()
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.5)
    moe.expert_bias.copy_(torch.tensor([0.0, 5.0, 0.0, 0.0]))  # expert 1 always chosen
    x = torch.randn(2, 3, 8, dtype=torch.float64)
    torch.testing.assert_close(moe(x), naive_moe(moe, x), rtol=1e-12, atol=1e-12)
    assert moe.tokens_per_expert[1] == 6
    moe.update_expert_bias()
    assert moe.expert_bias[1] < 5.0 and moe.tokens_per_expert.sum() == 0


def test_empty_batch():
    moe = MoE(MoEConfig(dim=8, hidden_dim=6, num_experts=4, top_k=2))
    y = moe(torch.randn(0, 3, 8))
    assert y.shape == (0, 3, 8)


def _loop_only(use_kernel: bool):
    """Forces the exact per-expert loop (use_kernel False) or leaves the policy's choice."""
    from dtensor_moe.kernels import policy

    return mock.patch.object(policy, "grouped_mm_supported", return_value=False) if not use_kernel else mock.MagicMock()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm_kernel_matches_loop(dtype):
    from dtensor_moe.kernels import policy

    torch.manual_seed(0)
    E, F_, D = 4, 16, 8
    counts = torch.tensor([5, 0, 7, 4])
    x = torch.randn(int(counts.sum()), D, dtype=dtype, requires_grad=True)
    ws = [torch.randn(E, F_, D, dtype=dtype, requires_grad=True), torch.randn(E, D, F_, dtype=dtype, requires_grad=True),
          torch.randn(E, F_, D, dtype=dtype, requires_grad=True)]
    assert policy.grouped_mm_supported(x, ws[0].shape), f"torch._grouped_mm unavailable on CPU for {dtype}"
    y_kernel = grouped_swiglu(x, counts, *ws)
    with _loop_only(False):
        y_loop = grouped_swiglu(x, counts, *ws)
        g_loop = torch.autograd.grad(y_loop.float().square().sum(), [x, *ws])
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(y_kernel, y_loop, **tol)
    g_kernel = torch.autograd.grad(y_kernel.float().square().sum(), [x, *ws])
    for a, b in zip(g_kernel, g_loop):
        torch.testing.assert_close(a.float(), b.float(), rtol=tol["rtol"] * 10, atol=tol["atol"] * 10)


@pytest.mark.parametrize("dim,hidden", [(8, 8), (6, 6)])  # 16-byte aligned rows: grouped-GEMM kernel; not: loop
def test_float32_moe_matches_naive_on_kernel_and_fallback(dim, hidden):
    from dtensor_moe.kernels import policy

    torch.manual_seed(0)
    moe = MoE(MoEConfig(dim=dim, hidden_dim=hidden, num_experts=4, top_k=2))
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.5)
    x = torch.randn(3, 5, dim)
    assert policy.grouped_mm_supported(x.view(-1, dim), moe.experts.w1.shape) == (dim == 8)
    torch.testing.assert_close(moe(x), naive_moe(moe, x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dim,hidden", [(16, 4), (8, 16)])  # both sides of the scale's F-vs-D choice
@pytest.mark.parametrize("use_kernel", [False, True])
def test_weight_grad_scale_scales_only_weight_grads(dim, hidden, use_kernel):
    """The dispatcher's contract: only weight gradients are scaled."""
    dtype = torch.float32 if use_kernel else torch.float64
    torch.manual_seed(0)
    counts = torch.tensor([5, 0, 7, 4])
    x = torch.randn(16, dim, dtype=dtype, requires_grad=True)
    ws = [torch.randn(s, dtype=dtype, requires_grad=True) for s in ((4, hidden, dim), (4, dim, hidden), (4, hidden, dim))]
    g = torch.randn(16, dim, dtype=dtype)
    with _loop_only(use_kernel):
        ref = torch.autograd.grad(grouped_swiglu(x, counts, *ws), [x, *ws], g)
        got = torch.autograd.grad(grouped_swiglu(x, counts, *ws, weight_grad_scale=0.25), [x, *ws], g)
    tol = dict(rtol=1e-5, atol=1e-5) if use_kernel else dict(rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got[0], ref[0], **tol)
    for a, b in zip(got[1:], ref[1:]):
        torch.testing.assert_close(a, 0.25 * b, **tol)


@pytest.mark.parametrize("use_kernel,min_macs,fused", [(False, None, True), (True, 0, True), (True, None, False)])
def test_weight_grads_accumulate_in_the_gemm(use_kernel, min_macs, fused, monkeypatch):
    """Gradient accumulation: with host counts and existing .grad, the per-expert GEMMs add the
    scaled weight gradients into .grad themselves; otherwise (no grad yet, or GEMMs too small to
    outlast their launch) autograd accumulates. Either way .grad is the sum over microbatches."""
    from dtensor_moe import experts as experts_mod
    from dtensor_moe.kernels import policy

    if min_macs is not None:
        monkeypatch.setattr(policy, "MIN_MACS_PER_EXPERT_GEMM", min_macs)
    dtype = torch.float32 if use_kernel else torch.float64
    torch.manual_seed(0)
    counts = torch.tensor([5, 0, 7, 4])
    x = torch.randn(16, 8, dtype=dtype, requires_grad=True)
    ws = [torch.randn(s, dtype=dtype, requires_grad=True) for s in ((4, 16, 8), (4, 8, 16), (4, 16, 8))]
    gs = [torch.randn(16, 8, dtype=dtype) for _ in range(2)]
    with _loop_only(use_kernel):
        refs = [torch.autograd.grad(grouped_swiglu(x, counts, *ws), [x, *ws], g) for g in gs]
        spy = mock.patch.object(experts_mod, "add_weight_grad_", wraps=experts_mod.add_weight_grad_)
        with spy as accumulate:
            for g in gs:
                grouped_swiglu(x, counts, *ws, weight_grad_scale=0.25, host_counts=counts.tolist()).backward(g)
            # autograd.grad returns the gradients and leaves .grad alone, even where .grad exists
            held = [w.grad.clone() for w in ws]
            y = grouped_swiglu(x, counts, *ws, weight_grad_scale=0.25, host_counts=counts.tolist())
            got = torch.autograd.grad(y, ws, gs[0])
    assert accumulate.call_count == (3 if fused else 0)  # the second microbatch's three weights
    tol = dict(rtol=1e-5, atol=1e-5) if use_kernel else dict(rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x.grad, refs[0][0] + refs[1][0], **tol)
    for i, w in enumerate(ws):
        torch.testing.assert_close(w.grad, 0.25 * (refs[0][i + 1] + refs[1][i + 1]), **tol)
        torch.testing.assert_close(w.grad, held[i], rtol=0, atol=0)
        torch.testing.assert_close(got[i], 0.25 * refs[0][i + 1], **tol)


@pytest.mark.parametrize("x", [torch.randn(2, 3, 7), torch.ones(2, 3, 8, dtype=torch.long), torch.tensor(1.0)])
def test_forward_names_the_expected_input(x):
    moe = MoE(MoEConfig(dim=8, hidden_dim=6, num_experts=4, top_k=2))
    with pytest.raises(ValueError, match=r"MoE expects \[\.\.\., dim=8\] floating-point input, got shape"):
        moe(x)
