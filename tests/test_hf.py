"""Our MoE against transformers' own Qwen3-MoE, Mixtral, DeepSeek-V3 (n_group > 1) and gpt-oss MoE
blocks on the same weights, float64: from_hf_block on 1 process, and checkpoints written by
save_pretrained loaded lazily into parallelized layers (EP2 x ETP2, EP2 x EDP2 on 4 ranks), each
rank reading only its own slices.

Tolerance: transformers computes the router in float32 even in a float64 model (Qwen3-MoE, Mixtral,
DeepSeek-V3), so outputs and input gradients agree to ~1e-7 relative to their largest magnitude
(measured 3e-8..9e-8); gpt-oss routes in the model's dtype and agrees to ~1e-15.
"""

import json

import pytest
import torch

from .harness import run_on_ranks
from .hf_models import EXPERTS, LAYERS, hf_model, moe_block

FAMILIES = ["qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss"]
TOL = 1e-6


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def _forward(block, x):
    y = block(x)
    return y[0] if isinstance(y, tuple) else y  # GptOssMLP also returns its router scores


@pytest.mark.parametrize("model_type", FAMILIES)
def test_from_hf_block_matches_transformers(model_type):
    from dtensor_moe.hf import from_hf_block

    block = moe_block(hf_model(model_type), model_type)
    moe = from_hf_block(block)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 4, 8, generator=g, dtype=torch.float64)
    dy = torch.randn(3, 4, 8, generator=g, dtype=torch.float64)
    outs = []
    for m in (block, moe):
        xx = x.clone().requires_grad_(True)
        y = _forward(m, xx)
        y.backward(dy)
        outs.append((y.detach(), xx.grad))
    assert _rel(outs[1][0], outs[0][0]) < TOL and _rel(outs[1][1], outs[0][1]) < TOL


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    dirs = {}
    for model_type in FAMILIES:
        dirs[model_type] = tmp_path_factory.mktemp(model_type)
        hf_model(model_type).save_pretrained(dirs[model_type])
    return dirs


@pytest.mark.parametrize("model_type", FAMILIES)
def test_to_hf_writes_save_pretrained_keys_and_round_trips(model_type, checkpoints):
    """Our layer -> their keys: exactly the keys and shapes save_pretrained wrote for that layer, and
    reading them back gives our tensors again."""
    from dtensor_moe.hf import SafetensorsReader, StateDictReader, family, layer_prefix, load_hf_moe, moe_config_from_hf, to_hf
    from dtensor_moe.moe import MoE

    fam = family(model_type)
    reader = SafetensorsReader(checkpoints[model_type])
    prefix = layer_prefix(reader.keys(), fam, LAYERS - 1)
    cfg = moe_config_from_hf(json.loads((checkpoints[model_type] / "config.json").read_text()))
    moe = load_hf_moe(MoE(cfg).double(), reader, fam, prefix)
    ours = {k: v for k, v in moe.state_dict().items() if k != "tokens_per_expert"}
    theirs = to_hf(ours, fam, prefix)
    assert {k: reader.shape(k) for k in reader.keys() if k.startswith(prefix)} == {k: tuple(v.shape) for k, v in theirs.items()}
    for k, v in theirs.items():
        assert torch.equal(v, reader.read(k)), k
    again = load_hf_moe(MoE(cfg).double(), StateDictReader(theirs), fam, prefix)
    for k, v in again.state_dict().items():
        assert torch.equal(v, moe.state_dict()[k]), k


def parallel_vs_transformers(rank, world_size, ckpt_dir, model_type, ep, etp):
    """One rank: the layer parallelized by our plan, loaded lazily from the checkpoint, on this rank's
    slice of the batch, against transformers' model (from_pretrained) on the whole batch."""
    import math

    from transformers import AutoModelForCausalLM

    from dtensor_moe import MoE, MoEParallelDims, owned_box, parallelize_moe, plan_moe
    from dtensor_moe.hf import SafetensorsReader, family, layer_prefix, load_hf_moe, moe_config_from_hf

    model = AutoModelForCausalLM.from_pretrained(ckpt_dir, dtype=torch.float64, experts_implementation=EXPERTS)
    block = moe_block(model, model_type)
    cfg = moe_config_from_hf(json.loads((ckpt_dir / "config.json").read_text()))
    dims = MoEParallelDims(world_size, ep=ep, etp=etp)
    moe = parallelize_moe(MoE(cfg).double(), dims, device_type="cpu")
    reader = SafetensorsReader(ckpt_dir)
    fam = family(model_type)
    prefix = layer_prefix(reader.keys(), fam, LAYERS - 1)
    load_hf_moe(moe, reader, fam, prefix, dims)
    # What this rank must read: its boxes (gpt-oss's interleaved gate/up: the 2F columns once each
    # for w1 and w3), buffers whole; the layer holds far more.
    owned = sum(math.prod(s.stop - s.start for s in owned_box(wp, dims, rank))
                * (2 if model_type == "gpt_oss" and wp.name in ("experts.w1", "experts.w3", "experts.b1", "experts.b3") else 1)
                for wp in plan_moe(cfg, dims))
    owned += 0 if moe.expert_bias is None else moe.expert_bias.numel()
    layer = sum(math.prod(reader.shape(k)) for k in reader.keys() if k.startswith(prefix))

    g = torch.Generator().manual_seed(2)
    x = torch.randn(2 * world_size, 3, 8, generator=g, dtype=torch.float64)
    dy = torch.randn(2 * world_size, 3, 8, generator=g, dtype=torch.float64)
    mine = slice(2 * rank, 2 * rank + 2)
    x_ref = x.clone().requires_grad_(True)
    y_ref = _forward(block, x_ref)
    y_ref.backward(dy)
    x_r = x[mine].clone().requires_grad_(True)
    y_r = moe(x_r)
    y_r.backward(dy[mine])
    return dict(out=_rel(y_r.detach(), y_ref[mine].detach()), grad_x=_rel(x_r.grad, x_ref.grad[mine]),
                read=reader.elements_read, owned=owned, layer=layer)


@pytest.mark.parametrize("model_type,ep,etp", [(m, 2, 2) for m in FAMILIES] + [("gpt_oss", 2, 1)])
def test_parallel_layer_from_checkpoint_matches_transformers(model_type, ep, etp, checkpoints):
    per_rank = run_on_ranks(4, parallel_vs_transformers, checkpoints[model_type], model_type, ep, etp)
    for r in per_rank:
        assert r["out"] < TOL and r["grad_x"] < TOL, per_rank
        assert r["read"] == r["owned"] < r["layer"], per_rank
