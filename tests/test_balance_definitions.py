"""The batch aux loss and the aux-free bias update against their definitions, on one process.

The parity suite compares every parallel path with the same `MoE` run on one process, so a wrong formula
there passes it on every mesh. These pin the single-process values to the published ones: hand-made routings
with their numbers worked out below, and random ones against Megatron's and Hugging Face's code. (The
sequence-wise and z-losses: tests/test_moe_local.py.)

- aux loss (DeepSeek-V2/V3's batch-level loss, Megatron's `switch_load_balancing_loss_func`):
  coeff * sum_e f_e * P_e, f_e = E / (K * T) * (pairs routed to e), P_e = mean over the T tokens of e's score
  (sigmoid scores normalized per token; topk_softmax: the full softmax). Balanced routing gives coeff * sum_e P_e.
- aux-free bias (DeepSeek-V3 sec. 2.1.2): after each step, bias_e += rate * sign(mean_e' n_e' - n_e), n_e the
  pairs routed to e by the training forwards since the last update (before capacity dropping). torchtitan 0.3
  also subtracts the mean of that delta; this library follows the paper (docs/routing.md).
"""

import math

import pytest
import torch

from dtensor_moe import MoE, MoEConfig, MoERunOptions

# The layer counts in float32 (counts_E.float()) whatever its dtype, so its aux loss and bias update carry float32
# rounding (~1e-8 relative) in a float64 layer; every formula mutation moves them by far more.
F32 = dict(rtol=1e-6, atol=1e-8)
BIAS_ATOL = 1e-9

# Hand-made router probabilities, T = 4 tokens over E = 4 experts, K = 2: each row's top-2 is unambiguous.
# Choices {0,1} {0,1} {3,2} {0,3}: pairs per expert n = (3, 2, 1, 2), f = n * E / (K * T) = (1.5, 1, 0.5, 1);
# P = column means = (0.325, 0.225, 0.225, 0.225); sum_e f_e P_e = 0.4875 + 0.225 + 0.1125 + 0.225 = 1.05.
SKEWED_TE = [[0.4, 0.3, 0.2, 0.1], [0.4, 0.3, 0.2, 0.1], [0.1, 0.2, 0.3, 0.4], [0.4, 0.1, 0.2, 0.3]]
# Choices {0,1} {3,2}: n = (1, 1, 1, 1), f = 1 everywhere, so sum_e f_e P_e = sum_e P_e = 1.
BALANCED_TE = [[0.4, 0.3, 0.2, 0.1], [0.1, 0.2, 0.3, 0.4]]


def _identity_router_moe(score_func: str, run: MoERunOptions | None = None, **kw) -> MoE:
    """dim = E = 4 and gate = identity: the router's logits are the input rows."""
    moe = MoE(MoEConfig(dim=4, hidden_dim=4, num_experts=4, score_func=score_func, **kw), run).double()
    with torch.no_grad():
        moe.router.gate.weight.copy_(torch.eye(4, dtype=torch.float64))
    return moe


def _logits_for(probs_TE: torch.Tensor, score_func: str) -> torch.Tensor:
    """Logits whose balance scores are probs_TE and whose top-k is probs_TE's: log p under softmax (and
    topk_softmax, which picks on the logits); under sigmoid logit(2p), whose sigmoid 2p normalizes back to p."""
    if score_func == "sigmoid":
        return torch.logit(2 * probs_TE)
    return probs_TE.log()


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid", "topk_softmax"])
@pytest.mark.parametrize("probs,want", [(SKEWED_TE, 1.05), (BALANCED_TE, 1.0)])
def test_aux_loss_hand_computed(score_func, probs, want):
    moe = _identity_router_moe(score_func, top_k=2, load_balance="aux_loss", aux_loss_coeff=0.1)
    probs_TE = torch.tensor(probs, dtype=torch.float64)
    moe(_logits_for(probs_TE, score_func).view(2, -1, 4))  # [B, L, D]: the loss is over all B * L tokens
    torch.testing.assert_close(moe.aux_loss, torch.tensor(0.1 * want, dtype=torch.float64), **F32)


def megatron_aux_loss(scores_TE, tokens_per_expert_E, top_k, coeff):
    """Megatron-LM's switch_load_balancing_loss_func (moe_utils.py), written as it is there."""
    num_tokens, num_experts = scores_TE.shape
    aggregated_probs_per_expert = scores_TE.sum(dim=0)
    return torch.sum(aggregated_probs_per_expert * tokens_per_expert_E) * (
        num_experts * coeff / (num_tokens * num_tokens * top_k))


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid", "topk_softmax"])
@pytest.mark.parametrize("capacity_factor", [None, 0.5])
def test_aux_loss_matches_megatron(score_func, capacity_factor):
    """Value and router gradient on a random batch (E = 6, K = 2); with capacity dropping the loss still
    counts every routed pair (the router's choices, before dropping)."""
    torch.manual_seed(0)
    moe = MoE(MoEConfig(dim=8, hidden_dim=6, num_experts=6, top_k=2, score_func=score_func, load_balance="aux_loss",
                        aux_loss_coeff=0.3), MoERunOptions(capacity_factor=capacity_factor)).double()
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.5)
    x_BLD = torch.randn(3, 5, 8, dtype=torch.float64)
    moe(x_BLD)
    w = moe.router.gate.weight
    logits_TE = x_BLD.view(-1, 8) @ w.T
    if score_func == "sigmoid":
        scores_TE = torch.sigmoid(logits_TE)
        scores_TE = scores_TE / scores_TE.sum(-1, keepdim=True)
    else:
        scores_TE = torch.softmax(logits_TE, -1)
    chosen_TK = torch.stack([torch.topk(logits_TE[t], 2).indices for t in range(15)])
    tokens_per_expert_E = torch.stack([(chosen_TK == e).sum() for e in range(6)]).double()
    want = megatron_aux_loss(scores_TE, tokens_per_expert_E, 2, 0.3)
    torch.testing.assert_close(moe.aux_loss, want, **F32)
    got_grad, want_grad = (torch.autograd.grad(v, w, retain_graph=True)[0] for v in (moe.aux_loss, want))
    torch.testing.assert_close(got_grad, want_grad, **F32)


def test_aux_loss_matches_hugging_face_mixtral():
    """transformers' Mixtral load_balancing_loss_func (Switch Transformer's loss over top-k choices) is
    E * sum_e (n_e / T) * P_e, K times DeepSeek's f_e = E * n_e / (K * T); it runs in float32."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    torch.manual_seed(0)
    moe = MoE(MoEConfig(dim=8, hidden_dim=6, num_experts=8, top_k=3, load_balance="aux_loss",
                        aux_loss_coeff=0.2)).double()
    torch.nn.init.normal_(moe.router.gate.weight, std=0.5)
    x_TD = torch.randn(20, 8, dtype=torch.float64)
    moe(x_TD)
    hf = load_balancing_loss_func((x_TD @ moe.router.gate.weight.T,), num_experts=8, top_k=3)
    torch.testing.assert_close(moe.aux_loss.float(), 0.2 * hf / 3, rtol=1e-6, atol=1e-7)


def _routed_tokens(pairs_T2) -> torch.Tensor:
    """Logits [T, 4] that route token t to pairs_T2[t] (first, second): scores about 0.73, 0.27 and 0, so a
    bias of a few hundredths changes no choice."""
    logits_TE = torch.zeros(len(pairs_T2), 4, dtype=torch.float64)
    for t, (first, second) in enumerate(pairs_T2):
        logits_TE[t, first], logits_TE[t, second] = 10.0, 9.0
    return logits_TE


@pytest.mark.parametrize("capacity_factor", [None, 0.5])
def test_aux_free_bias_update_hand_computed(capacity_factor):
    """Two training forwards route n = (3, 1, 1, 1) + (1, 1, 0, 0) = (4, 2, 1, 1) pairs, mean 2: the update
    adds rate * (-1, 0, +1, +1) to the bias (sign(0) = 0: an expert at the mean stays), whatever the size of
    each imbalance, and resets the counts; an update with no forward since moves nothing. At capacity 0.5
    (one pair per expert in either forward: two of expert 0's three pairs in the first are dropped) the counts
    are the same: the update balances what the router asks for."""
    moe = _identity_router_moe("softmax", MoERunOptions(capacity_factor=capacity_factor), top_k=2,
                               load_balance="aux_free_bias", bias_update_rate=0.05)
    bias0_E = torch.tensor([0.01, -0.02, 0.0, 0.03], dtype=torch.float64)
    moe.expert_bias.copy_(bias0_E)
    moe(_routed_tokens([(0, 1), (0, 2), (0, 3)]))
    moe(_routed_tokens([(0, 1)]))
    assert moe.global_tokens_per_expert().tolist() == [4, 2, 1, 1]
    moe.update_expert_bias()
    want_E = bias0_E + 0.05 * torch.tensor([-1.0, 0.0, 1.0, 1.0], dtype=torch.float64)
    torch.testing.assert_close(moe.expert_bias, want_E, rtol=0, atol=BIAS_ATOL)
    assert moe.tokens_per_expert.tolist() == [0, 0, 0, 0]
    moe.update_expert_bias()
    torch.testing.assert_close(moe.expert_bias, want_E, rtol=0, atol=BIAS_ATOL)


def test_aux_free_bias_update_matches_its_definition():
    """A random routing over E = 8 (K = 3, two forwards): bias_e += rate * sign(mean - n_e), n_e counted by a
    per-token loop over the biased selection scores (the bias steers the choice, DeepSeek-V3 eq. 16)."""
    torch.manual_seed(0)
    moe = MoE(MoEConfig(dim=8, hidden_dim=6, num_experts=8, top_k=3, score_func="sigmoid",
                        load_balance="aux_free_bias", bias_update_rate=0.01)).double()
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.5)
    moe.expert_bias.normal_(std=0.1)
    bias0_E = moe.expert_bias.clone()
    n_E = [0] * 8
    for x_TD in (torch.randn(7, 8, dtype=torch.float64), torch.randn(5, 8, dtype=torch.float64)):
        moe(x_TD)
        select_TE = torch.sigmoid(x_TD @ moe.router.gate.weight.T) + bias0_E
        for t in range(x_TD.shape[0]):
            for e in torch.topk(select_TE[t], 3).indices.tolist():
                n_E[e] += 1
    mean = sum(n_E) / 8
    assert any(n != mean for n in n_E)
    moe.update_expert_bias()
    want_E = [b + 0.01 * math.copysign(1.0, mean - n) if n != mean else b for b, n in zip(bias0_E.tolist(), n_E)]
    torch.testing.assert_close(moe.expert_bias, torch.tensor(want_E, dtype=torch.float64), rtol=0, atol=BIAS_ATOL)
