"""The main job's model under dense TP (sequence parallel) and CP, folded with EP x ETP x EDP:
per-step loss, aux loss, gradient norm and every first-step gradient against one process (float64)."""

import pytest

from .harness import run_on_ranks
from .model_parity import ModelCase, check_model_parity

TOL = 1e-10

CASES = {
    "tp2_ep2": ModelCase(dict(tp=2, ep=2)),
    "cp2_etp2": ModelCase(dict(cp=2, etp=2), dict(load_balance="aux_free_bias")),
    "cp2_tp2_ep4": ModelCase(dict(cp=2, tp=2, ep=4), dict(num_shared_experts=0)),
    "hsdp2_tp2_ep2": ModelCase(dict(dp_replicate=2, tp=2, ep=2)),
}


@pytest.mark.parametrize("name", CASES)
def test_model_parity(name):
    per_rank = run_on_ranks(4, check_model_parity, CASES[name])
    worst = {k: max(r[k] for r in per_rank) for k in per_rank[0]}
    bad = {k: v for k, v in worst.items() if not v <= TOL}
    assert not bad, f"{name} mismatches: {bad}"
    assert any(k.startswith("grad:layers.0.attention.wq") for k in worst)
