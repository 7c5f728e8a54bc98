"""Hot-expert replicas through the torchtitan hook (`--dtensor_moe.run.expert_replicas`), on 2 CPU gloo ranks.

`deepseek_v3_debugmodel_cpu` (2 MoE layers of 8 experts, top-2, a shared expert) at EP=2, STEPS steps from one
seed checkpoint, with one replica slot per EP rank re-placed every forward (`replica_replan_every 1`: the
placement changes between steps) against the same run without replicas. torchtitan's experts compute in
bfloat16, so moving rows to another rank's replica rounds its weight gradient's sums differently; the replica
rows run through the experts' own forward, so the exact check patches that forward to float32 (in both runs,
replica rows included): losses and gradient norms per step and every first-step gradient then agree to float32
rounding. The unpatched (bfloat16) pair agrees to bfloat16 rounding. The replicas do move weights (the
`replica_weights` all-to-all's bytes). The seed comes from one rank: written on 2 ranks, every rank initializes
its router shard from the same generator state, experts e and e + 4 score alike, and the EP ranks' loads are
equal, leaving nothing to replicate.

Tolerances and measurements (2026-12-03, 2 cores, ~21 s for the file): relative |dloss| and |dnorm| per step
< 1e-5 in both pairs, measured 0.0 and 0.0 (float32 experts; losses bitwise equal), 0.0 and 1.2e-7 (bfloat16).
First-step gradients, max |g - g_ref| / max |g_ref| per parameter: float32 < 1e-5, measured 1.1e-7 to 1.7e-7;
bfloat16 < 2e-2 (tests/test_titan.py's bound for torchtitan's bf16 experts), measured 2.5e-3 to 4.9e-3 (the
owner's and the replica's bf16 weight-gradient GEMMs sum the rows in two parts). With the copies' gradients
dropped (detached) the float32 gradients are off by 0.41 while losses and norms still agree within 2e-6 (Adam).
"""

import contextlib

import pytest
import torch

pytest.importorskip("torchtitan")

from .harness import run_on_ranks  # noqa: E402
from .test_titan import _LOAD_ONLY, _argv, _assert_refused, _train  # noqa: E402

WORLD = 2
STEPS = 4
RTOL = 1e-5  # losses and gradient norms, both; first-step gradients with float32 experts
BF16_GRAD_RTOL = 2e-2  # first-step gradients with torchtitan's bfloat16 experts (tests/test_titan.py's GRAD_RTOL)


def _fp32_experts(self, x, counts):
    """torchtitan's GroupedExperts.forward in float32, one expert at a time (its own casts to bfloat16)."""
    from torch.distributed.tensor import DTensor

    w1, w2, w3 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1_EFD, self.w2_EDF, self.w3_EFD))
    out, start = [], 0
    for e, n in enumerate(counts.tolist()):
        rows = x[start:start + n]
        out.append((torch.nn.functional.silu(rows @ w1[e].T) * (rows @ w3[e].T)) @ w2[e].T)
        start += n
    return torch.cat([*out, x.new_zeros(x.shape[0] - start, w2.shape[1])])


def _run(rank: int, world: int, argv: list[str], fp32: bool, save_step0: bool = False) -> dict:
    """test_titan's _train (optionally with float32 experts), and the bytes the replica weights' all-to-all sent."""
    from dtensor_moe.titan.cpu import use_cpu

    use_cpu()
    from unittest import mock

    from torchtitan.models.common.moe import GroupedExperts

    from dtensor_moe.parallel.exchange import count_sent_bytes

    patch = mock.patch.object(GroupedExperts, "forward", _fp32_experts) if fp32 else contextlib.nullcontext()
    with patch, count_sent_bytes() as sent:
        out = _train(rank, world, argv, save_step0)
    return {**out, "replica_bytes": sent[("replica_weights", "there")]}


def _ep2(dump, *extra: str) -> list[str]:
    return _argv("deepseek_v3_debugmodel_cpu", dump, "--dtensor_moe.ep", "2", "--training.steps", str(STEPS), *extra)


_REPLICAS = ("--dtensor_moe.run.expert_replicas", "1", "--dtensor_moe.run.replica_replan_every", "1")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("titan_replicas")
    # The seed from one rank (the module docstring says why); 1 step, as torchtitan trains at least one.
    run_on_ranks(1, _run, _argv("deepseek_v3_debugmodel_cpu", root / "seed", "--training.steps", "1",
                                "--checkpoint.enable", "--checkpoint.last_save_model_only"), False, True)
    seed = ("--checkpoint.initial_load_path", str(root / "seed" / "checkpoint" / "step-0"), *_LOAD_ONLY)
    return {
        (fp32, r): run_on_ranks(WORLD, _run, _ep2(root / f"{fp32}_{r}", *seed, *(_REPLICAS if r else ())), fp32)
        for fp32 in (True, False) for r in (0, 1)
    }


def _errors(a: dict, b: dict) -> tuple[float, float, float]:
    """(max relative |dloss|, |dnorm| over the steps, max relative first-step gradient error over parameters)."""
    assert [s for s, _, _ in a["log"]] == [s for s, _, _ in b["log"]] == list(range(1, STEPS + 1))
    dloss = max(abs(x[1] - y[1]) / abs(y[1]) for x, y in zip(a["log"], b["log"]))
    dnorm = max(abs(x[2] - y[2]) / y[2] for x, y in zip(a["log"], b["log"]))
    assert sorted(a["grads"]) == sorted(b["grads"])  # no parameter added: the owners only
    dgrad = max(((a["grads"][n] - g).abs().max() / g.abs().max()).item() for n, g in b["grads"].items())
    return dloss, dnorm, dgrad


@pytest.mark.parametrize("fp32, grad_rtol", [(True, RTOL), (False, BF16_GRAD_RTOL)],
                         ids=["fp32_experts", "bf16_experts"])
def test_replicas_match_no_replicas(runs, fp32, grad_rtol):
    with_r, without = runs[fp32, 1], runs[fp32, 0]
    assert any(rank["replica_bytes"] for rank in with_r) and not any(rank["replica_bytes"] for rank in without)
    errors = _errors(with_r[0], without[0])
    print(f"{'fp32' if fp32 else 'bf16'} experts, replicas 1 vs 0: rel dloss {errors[0]:.2e}, rel dnorm "
          f"{errors[1]:.2e}, grads {errors[2]:.2e}; losses {[round(x[1], 6) for x in with_r[0]['log']]}")
    assert errors[0] < RTOL and errors[1] < RTOL and errors[2] < grad_rtol, errors


def test_replicas_refuse_compile(capsys):
    """One line while parsing, before any process group."""
    argv = _argv("deepseek_v3_debugmodel_cpu", "/unused", "--dtensor_moe.ep", "2", *_REPLICAS, "--compile.enable")
    _assert_refused(capsys, argv, "--dtensor_moe.run.expert_replicas 1 with --compile.enable (compile.components "
                                  "['model', 'loss']) is not supported")


def test_replicas_need_ep(capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")  # torchrun's: ep 2 would fit
    _assert_refused(capsys, _argv("deepseek_v3_debugmodel_cpu", "/unused", *_REPLICAS),
                    "--dtensor_moe.run.expert_replicas (1) needs --dtensor_moe.ep > 1 (a replica holds another EP "
                    "rank's expert), got --dtensor_moe.ep 1; valid: --dtensor_moe.run.expert_replicas 0, or "
                    "--dtensor_moe.ep in [2]")
