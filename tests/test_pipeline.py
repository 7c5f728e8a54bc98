"""Pipeline parallelism: per-step loss, aux loss, every gradient and the clipped global norm on 4
ranks (PP2 x 2 ranks per stage) equal the single-process run with gradient accumulation over the
same microbatches (float64), for each schedule, with full logits or the chunked loss on the last stage."""

import pytest
import torch

from tests.harness import run_on_ranks

STEPS, SEQ, BATCH = 2, 4, 8


def _train_pp_and_reference(rank: int, world_size: int, schedule: str, n_layers: int, microbatches: int,
                            load_balance: str, ep: int, etp: int, tp: int, chunk: int) -> dict:
    import copy

    from dtensor_moe.parallel.mesh import MoEParallelDims
    from dtensor_moe.train.config import ModelConfig
    from dtensor_moe.train.data import Batches
    from dtensor_moe.train.loop import _accumulating
    from dtensor_moe.train.loss import cross_entropy
    from dtensor_moe.train.model import MoETransformer
    from dtensor_moe.train.optim import clip_grad_norm_
    from dtensor_moe.train.parallel.parallelize_transformer import parallelize_transformer
    from dtensor_moe.train.parallel.pipeline import Pipeline, stage_view

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=32, dim=8, n_layers=n_layers, n_heads=2, num_experts=4, top_k=2, hidden_dim=4,
                      num_shared_experts=1, load_balance=load_balance, aux_loss_coeff=0.1, bias_update_rate=0.05,
                      **({"seq_aux_loss_coeff": 0.05, "z_loss_coeff": 0.01} if tp == 1 else {}))
    ref = MoETransformer(cfg).double()
    dims = MoEParallelDims(world_size, ep=ep, etp=etp, tp=tp, pp=2)
    pp_mesh = dims.build_meshes("cpu").pp
    # Sequence parallelism hands each TP rank its own slice of the hidden states between stages.
    pipe = Pipeline(
        copy.deepcopy(ref),
        pp_mesh,
        schedule,
        microbatches,
        BATCH // dims.dp,
        SEQ,
        SEQ // tp,
        torch.float64,
        torch.device("cpu"),
        lambda m: parallelize_transformer(m, dims, device_type="cpu"),
        chunk,
    )
    model = stage_view(pipe.parts)
    tokens = torch.randint(0, cfg.vocab_size, (500,), generator=torch.Generator().manual_seed(1))
    ours = Batches(tokens, SEQ, BATCH, 0, dims.dense_coords(rank)["dp_shard"], dims.dp_shard, microbatches=microbatches)
    whole = Batches(tokens, SEQ, BATCH, 0, 0, 1, microbatches=microbatches)
    ref_step = _accumulating(ref, microbatches, cross_entropy)
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, ref)]
    out = {"ce": [], "aux": [], "norm": [], "grad_err": [], "bias_err": []}
    for step in range(STEPS):
        ce, aux = pipe.step(*ours(step))
        ref_ce, ref_aux = ref_step(*whole(step))
        norm = clip_grad_norm_(model.parameters(), 0.05, pp_mesh.get_group())
        ref_norm = clip_grad_norm_(ref.parameters(), 0.05)
        aux_t = torch.tensor([aux], dtype=torch.float64)
        torch.distributed.all_reduce(aux_t, group=pp_mesh.get_group())  # each stage's MoE layers
        ref_grads = dict(ref.named_parameters())
        out["grad_err"].append(max((p.grad.full_tensor() - ref_grads[n].grad).abs().max().item()
                                   for n, p in model.named_parameters()))
        if pipe.has_last:  # this rank's share of the batch
            out["ce"].append((ce, ref_ce))
        out["aux"].append(abs(aux_t.item() - ref_aux))
        out["norm"].append(abs(norm.item() - ref_norm.item()))
        for opt in opts:
            opt.step()
            opt.zero_grad()
        for m in (*pipe.parts, ref):
            m.update_expert_bias()
        ref_buffers = dict(ref.named_buffers())
        out["bias_err"].append(max([(b - ref_buffers[n]).abs().max().item()
                                    for n, b in model.named_buffers() if n.endswith("expert_bias")], default=0.0))
    out["names"] = sorted(n for n, _ in model.named_parameters())
    out["hidden_out"] = [part.return_hidden for part in pipe.parts if part.norm is not None]
    return out


# chunk: the loss's tokens per chunk (training.loss_chunk_tokens), 0 for full logits; 3 does not divide a
# microbatch's 4 or 8 tokens a rank.
@pytest.mark.parametrize("schedule,n_layers,microbatches,load_balance,ep,etp,tp,chunk", [
    ("gpipe", 2, 2, "aux_loss", 2, 1, 1, 0),
    ("1f1b", 3, 4, "aux_free_bias", 1, 2, 1, 0),
    ("interleaved_1f1b", 4, 2, "aux_loss", 2, 1, 1, 3),
    ("1f1b", 2, 2, "aux_loss", 2, 1, 2, 0),  # PP2 x TP2 (sequence parallel) x EP2
    ("1f1b", 2, 2, "aux_loss", 2, 1, 2, 3),  # the same, the head sharded by vocabulary rows in the loss
])
def test_pipeline_matches_one_process(schedule, n_layers, microbatches, load_balance, ep, etp, tp, chunk):
    results = run_on_ranks(4, _train_pp_and_reference, schedule, n_layers, microbatches, load_balance, ep, etp, tp,
                           chunk)
    assert [r["hidden_out"] for r in results] == [[], [], [bool(chunk)], [bool(chunk)]]
    for r in results:
        assert max(r["grad_err"]) < 1e-12 and max(r["norm"]) < 1e-12 and max(r["aux"]) < 1e-12, r
        assert max(r["bias_err"]) == 0.0, r
    assert not results[0]["ce"] and not results[1]["ce"]  # only the last stage computes the loss
    for step in range(STEPS):  # the mean over the last stage's ranks is the global loss (the same under TP)
        (a, ref_ce), (b, _) = results[2]["ce"][step], results[3]["ce"][step]
        assert abs((a + b) / 2 - ref_ce) < 1e-12, (a, b, ref_ce)
    # Stages hold disjoint layers; together (first ranks of each stage) the whole model.
    first, last = results[0]["names"], results[2]["names"]
    assert "tok_embeddings.weight" in first and "output.weight" in last and not set(first) & set(last)
    assert {n.split(".")[1] for n in first + last if n.startswith("layers.")} == {str(i) for i in range(n_layers)}


def _reshard_pp2_pp1_pp2(rank: int, world_size: int, root: str) -> dict:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    from dtensor_moe.parallel.mesh import MoEParallelDims
    from dtensor_moe.train import checkpoint
    from dtensor_moe.train.config import ModelConfig
    from dtensor_moe.train.model import MoETransformer
    from dtensor_moe.train.optim import build_optimizer
    from dtensor_moe.train.parallel.parallelize_transformer import parallelize_transformer
    from dtensor_moe.train.parallel.pipeline import Pipeline, stage_view

    cfg = ModelConfig(vocab_size=32, dim=8, n_layers=4, n_heads=2, num_experts=4, top_k=2, hidden_dim=4,
                      load_balance="aux_free_bias")
    pp1 = MoEParallelDims(world_size, ep=2)
    pp2 = MoEParallelDims(world_size, ep=2, pp=2)

    def build(dims, seed):
        torch.manual_seed(seed)
        model = MoETransformer(cfg).double()
        if dims.pp == 1:
            return parallelize_transformer(model, dims, device_type="cpu"), None
        pipe = Pipeline(model, dims.build_meshes("cpu").pp, "interleaved_1f1b", 2, BATCH // dims.dp, SEQ, SEQ,
                        torch.float64, torch.device("cpu"),
                        lambda m: parallelize_transformer(m, dims, device_type="cpu"))
        return stage_view(pipe.parts), pipe

    def states(model, opt) -> dict:
        from torch.distributed.tensor import DTensor

        flat = {f"model.{k}": v for k, v in get_model_state_dict(model).items()}
        for fqn, state in get_optimizer_state_dict(model, opt)["state"].items():
            flat.update({f"optim.{fqn}.{n}": t for n, t in state.items()})
        # Sorted: the ranks of a stage gather the same DTensors in the same order.
        return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in sorted(flat.items())}

    a, pipe = build(pp2, 0)  # trained one step, so AdamW holds moments
    opt_a = build_optimizer(a, 1e-2, 0.0)
    tokens = torch.randint(0, cfg.vocab_size, (BATCH // pp2.dp, SEQ), generator=torch.Generator().manual_seed(rank % 2))
    pipe.step(tokens, tokens)
    opt_a.step()
    checkpoint.save(root + "/pp2", 1, a, opt_a)
    b = build(pp1, 1)[0]
    opt_b = build_optimizer(b, 1e-2, 0.0)
    checkpoint.load(root + "/pp2", b, opt_b)
    checkpoint.save(root + "/pp1", 1, b, opt_b)
    c = build(pp2, 2)[0]
    opt_c = build_optimizer(c, 1e-2, 0.0)
    checkpoint.load(root + "/pp1", c, opt_c)
    sa, sb, sc = states(a, opt_a), states(b, opt_b), states(c, opt_c)
    return {"stage_keys": sorted(sa), "all_keys": sorted(sb),
            "err_pp1": max((sa[k] - sb[k]).abs().max().item() for k in sa),
            "err_back": max((sa[k] - sc[k]).abs().max().item() for k in sa)}


def test_checkpoint_reshards_pp2_to_pp1_and_back(tmp_path):
    results = run_on_ranks(4, _reshard_pp2_pp1_pp2, str(tmp_path))
    assert all(r["err_pp1"] == 0.0 and r["err_back"] == 0.0 for r in results), results
    stage0, stage1 = set(results[0]["stage_keys"]), set(results[2]["stage_keys"])
    assert not stage0 & stage1 and stage0 | stage1 == set(results[0]["all_keys"])
    assert any(k.startswith("optim.") and k.endswith(".exp_avg") for k in stage0)


def test_step_hands_the_schedule_contiguous_microbatches():
    """torch 2.11's pipeline stages refuse inputs whose strides differ from the contiguous shapes they were
    built for (PipeliningShapeError); the main job's batches are column slices of their sequences."""
    from types import SimpleNamespace

    from dtensor_moe.train.parallel.pipeline import Pipeline

    seen = {}

    def step(inputs, target, losses, return_outputs):
        seen.update(inputs=inputs, target=target)
        losses.append(torch.tensor(2.0))

    pipe = SimpleNamespace(_aux=[], has_first=True, has_last=True, microbatches=1, schedule=SimpleNamespace(step=step))
    seq = torch.arange(18).view(2, 9)
    assert Pipeline.step(pipe, seq[:, :-1], seq[:, 1:]) == (2.0, 0.0)
    assert seen["inputs"].is_contiguous() and seen["target"].is_contiguous()
    assert torch.equal(seen["inputs"], seq[:, :-1]) and torch.equal(seen["target"], seq[:, 1:])
