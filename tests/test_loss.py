"""The chunked LM-head cross-entropy (dtensor_moe/train/loss.py) against full logits: loss and the gradients of the
hidden states and the head (float64, drawn shapes, ignored targets, chunks that do not divide the tokens; bf16 to its
rounding), the largest tensor it ever makes (one chunk of logits, never all of them), the vocabulary-sharded head of
tensor parallelism on 2 ranks, and the main job trained with it against full logits, step by step."""

import json

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from dtensor_moe.cli import main
from dtensor_moe.train.loss import IGNORE_INDEX, chunked_cross_entropy, cross_entropy, hf_lm_loss, lm_loss

from .harness import run_on_ranks
from .test_train import _ranks_in_pools

TOL = 1e-12  # float64


def _full(h, w, y):
    """The reference: full logits, upcast, F.cross_entropy."""
    return F.cross_entropy((h @ w.T).to(torch.promote_types(h.dtype, torch.float32)), y, ignore_index=IGNORE_INDEX)


def _loss_and_grads(loss_fn, h, w, y):
    h, w = h.detach().requires_grad_(), w.detach().requires_grad_()
    loss = loss_fn(h, w, y)
    return (loss.detach(), *torch.autograd.grad(loss, (h, w)))


def _case(T, D, V, ignored, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    h, w = torch.randn(T, D, generator=g, dtype=dtype), torch.randn(V, D, generator=g, dtype=dtype)
    y = torch.randint(0, V, (T,), generator=g)
    y[torch.rand(T, generator=g) < ignored] = IGNORE_INDEX
    return h, w, y


def _assert_close(got, want, tol):
    for name, a, b in zip(("loss", "grad h", "grad W"), got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert (a.double() - b.double()).abs().max().item() <= tol * max(1.0, b.double().abs().max().item()), name


@pytest.mark.parametrize("T, chunk, ignored", [(37, 5, 0.0), (37, 5, 0.3), (40, 8, 0.0), (7, 64, 0.2), (1, 1, 0.0)])
def test_equals_full_logits(T, chunk, ignored):
    h, w, y = _case(T, 8, 50, ignored, seed=T)
    got = _loss_and_grads(lambda h, w, y: chunked_cross_entropy(h, w, y, chunk), h, w, y)
    _assert_close(got, _loss_and_grads(_full, h, w, y), TOL)


@settings(max_examples=60, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(T=st.integers(1, 70), D=st.integers(1, 9), V=st.integers(1, 70), chunk=st.integers(1, 80),
       ignored=st.sampled_from([0.0, 0.25, 0.9]), seed=st.integers(0, 2**16), lead=st.booleans())
def test_drawn_shapes_equal_full_logits(T, D, V, chunk, ignored, seed, lead):
    h, w, y = _case(T, D, V, ignored, seed)
    y[0] = 0  # at least one target: with none both are nan
    if lead and T % 2 == 0:  # [B, L, D] hidden states and [B, L] targets, as the main job passes them
        h, y = h.view(2, T // 2, D), y.view(2, T // 2)
    got = _loss_and_grads(lambda h, w, y: chunked_cross_entropy(h, w, y, chunk), h, w, y)
    want = _loss_and_grads(lambda h, w, y: _full(h.reshape(-1, D), w, y.flatten()), h, w, y)
    _assert_close(got, want, TOL)


def test_bf16_equals_full_logits_to_its_rounding():
    """The GPU job's dtype: the loss at fp32 from bf16 logits, the gradients in bf16 (the head's summed over chunks
    at fp32, rounded once: the full path rounds once too, so they differ by at most about one bf16 step)."""
    h, w, y = _case(96, 32, 300, 0.1, seed=3, dtype=torch.bfloat16)
    got = _loss_and_grads(lambda h, w, y: chunked_cross_entropy(h, w, y, 16), h, w, y)
    want = _loss_and_grads(_full, h, w, y)
    assert got[0].dtype == torch.float32 and got[1].dtype == got[2].dtype == torch.bfloat16
    _assert_close(got, want, 2**-7)
    assert abs(got[0] - want[0]) <= 1e-6 * want[0]


class _LargestTensor(TorchDispatchMode):
    """The most elements of any tensor an op makes (every allocation passes through an op)."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.numel = max([self.numel, *(t.numel() for t in tree_leaves(out) if isinstance(t, torch.Tensor))])
        return out


def test_never_makes_the_full_logits():
    """Forward and backward make nothing larger than one chunk of logits (the head's gradient, V x D, is smaller
    here); full logits are T x V, 8 times as many."""
    T, D, V, chunk = 256, 16, 512, 32
    h, w, y = _case(T, D, V, 0.1, seed=0, dtype=torch.float32)
    for loss_fn, bound in ((lambda h, w, y: chunked_cross_entropy(h, w, y, chunk), chunk * V), (_full, None)):
        h_, w_ = h.clone().requires_grad_(), w.clone().requires_grad_()
        with _LargestTensor() as largest:
            loss_fn(h_, w_, y).backward()
        if bound is None:  # the probe sees the full path's logits
            assert largest.numel >= T * V
        else:
            assert largest.numel <= bound, (largest.numel, bound)


def test_refuses_bad_arguments():
    h, w, y = _case(4, 3, 5, 0.0, seed=0)
    with pytest.raises(ValueError, match="chunk_tokens must be an int >= 1, got 0"):
        chunked_cross_entropy(h, w, y, 0)
    with pytest.raises(ValueError, match=r"targets' shape \(3,\) must be hidden's without its last dim \(4,\)"):
        chunked_cross_entropy(h, w, y[:3])


def test_lm_loss_switches_the_model_to_hidden_states():
    from dtensor_moe.train.config import ModelConfig
    from dtensor_moe.train.model import MoETransformer

    torch.manual_seed(0)
    for tie in (False, True):
        model = MoETransformer(ModelConfig(vocab_size=40, dim=8, n_layers=1, n_heads=2, num_experts=4, top_k=2,
                                           hidden_dim=8, tie_embeddings=tie)).double()
        x, y = torch.randint(0, 40, (2, 6)), torch.randint(0, 40, (2, 6))
        assert lm_loss(model, 0) is cross_entropy and not model.return_hidden
        want = cross_entropy(model(x), y)
        loss = lm_loss(model, 5)
        assert model(x).shape == (2, 6, 8)  # the final norm's output
        assert abs(loss(model(x), y) - want).item() < TOL


def _vocab_sharded(rank: int, world_size: int) -> dict:
    """The head sharded by vocabulary rows over tp = 2 ranks (51 rows: 26 and 25), the hidden states sequence-
    sharded as the main job's TP styles hand them over, against full logits on every rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    h, w, y = _case(2 * 10, 6, 51, 0.2, seed=7)
    h, y = h.view(2, 10, 6), y.view(2, 10)
    want = _loss_and_grads(lambda h, w, y: _full(h.flatten(0, 1), w, y.flatten()), h, w, y)
    h_d = distribute_tensor(h, mesh, [Shard(1)]).requires_grad_()
    w_d = distribute_tensor(w, mesh, [Shard(0)]).requires_grad_()
    loss = chunked_cross_entropy(h_d, w_d, y, chunk_tokens=3)
    loss.backward()
    got = (loss.detach(), h_d.grad.full_tensor(), w_d.grad.full_tensor())
    err = {name: (a - b).abs().max().item() for name, a, b in zip(("loss", "grad h", "grad W"), got, want)}
    err["placements"] = (tuple(h_d.grad.placements), tuple(w_d.grad.placements)) == ((Shard(1),), (Shard(0),))
    with pytest.raises(ValueError, match="An FSDP-sharded weight is gathered only between"):
        chunked_cross_entropy(h, w_d, y)  # plain hidden states beside a sharded head: refused, not mixed
    return err


def test_vocab_sharded_head_equals_full_logits():
    for err in run_on_ranks(2, _vocab_sharded):
        assert err.pop("placements") and max(err.values()) < TOL, err


def _hf_recipe(rank: int, world_size: int, model_type: str) -> dict:
    """parallelize_hf_model's docstring recipe (float64, EP2) against full logits on a copy: the loss and every
    gradient (and transformers' `labels=` loss, which it computes in float32)."""
    import copy

    from dtensor_moe import MoEParallelDims, balance_loss
    from dtensor_moe.hf import parallelize_hf_model

    from .hf_models import hf_model

    theirs = hf_model(model_type).train()
    model = copy.deepcopy(theirs)
    for m in (model, theirs):
        parallelize_hf_model(m, MoEParallelDims(world_size, ep=2), device_type="cpu", load_balance="aux_loss")
    tokens_BL = torch.randint(0, 32, (2, 7), generator=torch.Generator().manual_seed(rank))
    ref = theirs(input_ids=tokens_BL, labels=tokens_BL)
    want = F.cross_entropy(ref.logits[:, :-1].flatten(0, 1), tokens_BL[:, 1:].flatten())
    (want + balance_loss(theirs)).backward()

    loss = hf_lm_loss(model, tokens_BL, chunk_tokens=3)
    (loss + balance_loss(model)).backward()
    grads = dict(theirs.named_parameters())
    err = {n: (p.grad.full_tensor() - grads[n].grad.full_tensor()).abs().max().item()
           for n, p in model.named_parameters()}
    return {"loss": abs(loss.item() - want.item()), "labels_loss": abs(loss.item() - ref.loss.item()) * 1e-6, **err}


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_parallelize_hf_model_docstring_recipe(model_type):
    for err in run_on_ranks(2, _hf_recipe, model_type):
        assert "lm_head.weight" in err and max(err.values()) < TOL, err


def _train(run_dir, *overrides) -> list[dict]:
    assert main(["train", "--config", "configs/tiny_cpu.toml", "--run-dir", str(run_dir), *overrides]) == 0
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("overrides", [
    ["parallel.nproc=2", "parallel.ep=2", "parallel.etp=1"],
    ["parallel.nproc=4", "parallel.pp=2", "parallel.tp=2", "parallel.ep=1", "parallel.etp=1"],
], ids=["EP2", "PP2 x TP2"])
def test_main_job_trains_alike_with_chunks_and_full_logits(overrides, tmp_path, monkeypatch):
    """training.loss_chunk_tokens = 100 (512 tokens a rank: 6 chunks, the last short) against 0, float32: the same
    losses, gradient norms and held-out losses step by step (the pipeline's last stage applies the head in the loss,
    in training and in its schedule's eval; under TP the head is sharded by vocabulary rows)."""
    _ranks_in_pools(monkeypatch)
    common = ["--steps", "4", "data.eval_fraction=0.05", "data.eval_every=2", *overrides]
    full = _train(tmp_path / "full", *common, "training.loss_chunk_tokens=0")
    chunked = _train(tmp_path / "chunked", *common, "training.loss_chunk_tokens=100")
    pairs = {key: [(a[key], b[key]) for a, b in zip(full, chunked, strict=True) if key in a]
             for key in ("loss", "grad_norm", "eval_loss")}
    assert len(pairs["loss"]) == 4 and len(pairs["eval_loss"]) == 2
    assert all(abs(a - b) <= 1e-5 * abs(a) for p in pairs.values() for a, b in p), pairs
    # Summed in another order, some fp32 loss differs in its last bits: the runs did not both take full logits.
    assert any(a != b for p in pairs.values() for a, b in p), pairs


def test_main_job_trains_a_hugging_face_model_alike_with_chunks(tmp_path, monkeypatch):
    """`[model] hf_path`: the transformers model returns its final norm's output and the loss applies its lm_head."""
    from .test_hf_train import _byte_level_qwen3

    _ranks_in_pools(monkeypatch)
    src = _byte_level_qwen3(tmp_path / "qwen3")
    cfg = tmp_path / "hf.toml"
    cfg.write_text(f'[model]\nhf_path = "{src}"\nload_balance = "aux_loss"\n[parallel]\nnproc = 2\nep = 2\n'
                   "[training]\nsteps = 3\nseq_len = 16\nglobal_batch = 8\n")

    def losses(name, chunk):
        run = tmp_path / name
        assert main(["train", "--config", str(cfg), "--run-dir", str(run), f"training.loss_chunk_tokens={chunk}"]) == 0
        return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]

    full, chunked = losses("full", 0), losses("chunked", 5)  # 64 tokens a rank: 13 chunks
    assert len(full) == 3 and all(abs(a - b) <= 1e-5 * a for a, b in zip(full, chunked, strict=True)), (full, chunked)
    assert full != chunked  # fp32 sums in another order: the chunked run did take its own path
