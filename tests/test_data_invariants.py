"""Invariants of the main job's data streams, stated directly (a test comparing two runs that share the data path
cannot see that path's bug): training and held-out tokens disjoint at every place the split is made, the seed and
nothing else deciding the order, every held-out evaluation at least one batch. Tokens are unique ids (arange), so a
token read tells exactly where it came from."""

import pytest
import torch

from dtensor_moe.train import token_cache
from dtensor_moe.train.config import load_config
from dtensor_moe.train.data import EvalBatches, PackedBatches, load_data

SEQ, BATCH = 8, 4


def _read(batches, steps) -> set[int]:
    out = set()
    for step in steps:
        inputs, targets = batches(step)
        out |= set(inputs.flatten().tolist()) | set(targets.flatten().tolist())
    return out


@pytest.mark.parametrize("fraction", [0.05, 0.1, 0.37])
def test_training_and_held_out_tokens_are_disjoint(fraction):
    """The token cache's split (files), load_data's cut (corpus, synthetic) and the batches read from each part:
    no held-out token is ever a training input or target, and the training part loses nothing but the held-out."""
    n = 1001
    parts = token_cache.split({"tokens": n, "eval_start": n}, fraction)
    assert parts["train"][1] == parts["eval"][0] and parts["eval"][1] == n and parts["train"][0] == 0
    tokens = torch.arange(n)
    train, held = tokens[slice(*parts["train"])], tokens[slice(*parts["eval"])]
    packed = PackedBatches(train, SEQ, BATCH, seed=0, dp_rank=0, dp_size=1)
    steps = range(2 * packed.n_seq // BATCH + 1)  # two epochs and more
    evals = EvalBatches(held, SEQ, BATCH, batches=10, dp_rank=0, dp_size=1)
    seen_train, seen_eval = _read(packed, steps), _read(evals, range(evals.batches))
    assert not seen_train & seen_eval
    assert seen_eval <= set(held.tolist()) and seen_train <= set(train.tolist())
    for source in ("corpus", "synthetic"):
        cfg = load_config(None, [f"data.source={source}", f"data.eval_fraction={fraction}"])
        train, held, _ = load_data(cfg)
        assert train.untyped_storage().data_ptr() == held.untyped_storage().data_ptr()  # one stream, cut once
        end = train.storage_offset() + train.numel()
        assert end <= held.storage_offset(), source


def test_the_seed_decides_the_order():
    """The same seed the same batches; another seed another order of the same sequences (one epoch each)."""
    tokens = torch.arange(8 * SEQ * BATCH + 1)

    def epoch(seed):
        b = PackedBatches(tokens, SEQ, BATCH, seed=seed, dp_rank=0, dp_size=1)
        return [b.starts(step).tolist() for step in range(b.n_seq // BATCH)]

    assert epoch(0) == epoch(0)
    assert epoch(0) != epoch(1)
    assert sorted(sum(epoch(0), [])) == sorted(sum(epoch(1), []))


@pytest.mark.parametrize("n_seq", [1, 3, BATCH, BATCH + 1])
def test_every_evaluation_has_a_batch(n_seq):
    """Fewer held-out sequences than a global batch still make one batch (wrapping around), never zero (a zero
    would divide the mean eval loss by zero mid-run); every held-out sequence is read."""
    held = torch.arange(n_seq * SEQ + 1)
    evals = EvalBatches(held, SEQ, BATCH, batches=4, dp_rank=0, dp_size=1)
    assert evals.batches >= 1 and evals.tokens_per_eval > 0
    assert _read(evals, range(evals.batches)) == set(held.tolist())
