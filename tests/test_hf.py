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
    from dtensor_moe.hf import (
        SafetensorsReader,
        StateDictReader,
        family,
        layer_prefix,
        load_hf_moe,
        moe_config_from_hf,
        to_hf,
    )
    from dtensor_moe.moe import MoE

    fam = family(model_type)
    reader = SafetensorsReader(checkpoints[model_type])
    prefix = layer_prefix(reader.keys(), fam, LAYERS - 1)
    cfg = moe_config_from_hf(json.loads((checkpoints[model_type] / "config.json").read_text()))
    moe = load_hf_moe(MoE(cfg).double(), reader, fam, prefix)
    ours = {k: v for k, v in moe.state_dict().items() if k != "tokens_per_expert"}
    theirs = to_hf(ours, fam, prefix)
    assert {k: reader.shape(k) for k in reader.keys() if k.startswith(prefix)} == {
        k: tuple(v.shape) for k, v in theirs.items()
    }
    for k, v in theirs.items():
        assert torch.equal(v, reader.read(k)), k
    again = load_hf_moe(MoE(cfg).double(), StateDictReader(theirs), fam, prefix)
    for k, v in again.state_dict().items():
        assert torch.equal(v, moe.state_dict()[k]), k


def parallel_from_checkpoint(rank, world_size, ckpt_dir, model_type, ep, etp, x, dy, y_ref, grad_x_ref):
    """One rank: the layer parallelized by our plan, loaded lazily from the checkpoint, on this rank's
    slice of the batch, against transformers' block on the whole batch (run by the test process)."""
    import math

    from dtensor_moe import MoE, MoEParallelDims, owned_box, parallelize_moe, plan_moe
    from dtensor_moe.hf import SafetensorsReader, family, layer_prefix, load_hf_moe, moe_config_from_hf

    cfg = moe_config_from_hf(json.loads((ckpt_dir / "config.json").read_text()))
    dims = MoEParallelDims(world_size, ep=ep, etp=etp)
    moe = parallelize_moe(MoE(cfg).double(), dims, device_type="cpu")
    reader = SafetensorsReader(ckpt_dir)
    fam = family(model_type)
    prefix = layer_prefix(reader.keys(), fam, LAYERS - 1)
    load_hf_moe(moe, reader, fam, prefix, dims)
    # What this rank must read: its boxes (gpt-oss's interleaved gate/up: the 2F columns once each
    # for w1 and w3), buffers whole; the layer holds far more.
    owned = sum(
        math.prod(s.stop - s.start for s in owned_box(wp, dims, rank))
        * (2 if model_type == "gpt_oss" and wp.name in ("experts.w1", "experts.w3", "experts.b1", "experts.b3") else 1)
        for wp in plan_moe(cfg, dims)
    )
    owned += 0 if moe.expert_bias is None else moe.expert_bias.numel()
    layer = sum(math.prod(reader.shape(k)) for k in reader.keys() if k.startswith(prefix))

    n = x.shape[0] // world_size
    mine = slice(n * rank, n * rank + n)
    x_r = x[mine].clone().requires_grad_(True)
    y_r = moe(x_r)
    y_r.backward(dy[mine])
    return dict(out=_rel(y_r.detach(), y_ref[mine]), grad_x=_rel(x_r.grad, grad_x_ref[mine]),
                read=reader.elements_read, owned=owned, layer=layer)


@pytest.mark.parametrize("model_type,ep,etp", [(m, 2, 2) for m in FAMILIES] + [("gpt_oss", 2, 1)])
def test_parallel_layer_from_checkpoint_matches_transformers(model_type, ep, etp, checkpoints):
    """The reference is the block of transformers' from_pretrained of the same checkpoint."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        checkpoints[model_type], dtype=torch.float64, experts_implementation=EXPERTS
    )
    g = torch.Generator().manual_seed(2)
    x = torch.randn(8, 3, 8, generator=g, dtype=torch.float64)
    dy = torch.randn(8, 3, 8, generator=g, dtype=torch.float64)
    x_ref = x.clone().requires_grad_(True)
    y_ref = _forward(moe_block(model, model_type), x_ref)
    y_ref.backward(dy)
    per_rank = run_on_ranks(4, parallel_from_checkpoint, checkpoints[model_type], model_type, ep, etp, x, dy,
                            y_ref.detach(), x_ref.grad)
    for r in per_rank:
        assert r["out"] < TOL and r["grad_x"] < TOL, per_rank
        assert r["read"] == r["owned"] < r["layer"], per_rank


@pytest.mark.parametrize("model_type", FAMILIES)
def test_cli_import_then_export_hf_gives_back_the_checkpoint_layers(model_type, checkpoints, tmp_path):
    """import --hf: every MoE layer in our names; export --hf of that: bit for bit what save_pretrained
    wrote for those layers, and the family's MoE config fields as in its config.json."""
    from safetensors.torch import load_file

    from dtensor_moe import cli
    from dtensor_moe.hf import family, layer_prefix

    src = checkpoints[model_type]
    assert cli.main(["import", "--hf", str(src), str(tmp_path / "ours")]) == 0
    ours = load_file(tmp_path / "ours" / "model.safetensors")
    layers = [LAYERS - 1] if model_type == "deepseek_v3" else list(range(LAYERS))
    assert {k.split(".moe.")[0] for k in ours} == {f"layers.{i}" for i in layers}
    assert cli.main(["export", str(tmp_path / "ours"), "--hf", str(tmp_path / "theirs")]) == 0
    theirs = load_file(tmp_path / "theirs" / "model.safetensors")
    hf = load_file(src / "model.safetensors")
    prefixes = tuple(layer_prefix(set(hf), family(model_type), i) for i in layers)
    assert set(theirs) == {k for k in hf if k.startswith(prefixes)}
    for k, v in theirs.items():
        assert torch.equal(v, hf[k]), k
    fields = json.loads((tmp_path / "theirs" / "config.json").read_text())
    hf_config = json.loads((src / "config.json").read_text())
    assert all(
        hf_config.get(k, v) == v for k, v in fields.items() if k not in ("sha256", "moe_layers", "num_experts")
    ), fields


def test_cli_hf_refuses_bad_input_in_one_line(checkpoints, tmp_path, capsys):
    """No silent replacement, a corrupted import is named, and a main-job model a family cannot
    express is refused naming the fields; one that it can is written under its keys."""
    import dataclasses

    from safetensors.torch import load_file, save_file

    from dtensor_moe import cli
    from dtensor_moe.train.config import ModelConfig
    from dtensor_moe.train.model import MoETransformer

    out = tmp_path / "ours"
    assert cli.main(["import", "--hf", str(checkpoints["qwen3_moe"]), str(out)]) == 0
    before = (out / "model.safetensors").read_bytes()
    assert cli.main(["import", "--hf", str(checkpoints["qwen3_moe"]), str(out)]) == 2
    assert capsys.readouterr().err == (f"dtensor-moe import: {out} already holds ['model.safetensors', 'config.json']; "
                                       "pass --force to replace them, or choose another directory\n")
    assert (out / "model.safetensors").read_bytes() == before
    (out / "model.safetensors").write_bytes(before[:-8] + b"\0" * 8)
    assert cli.main(["export", str(out), "--hf", str(tmp_path / "x")]) == 2
    assert "model.safetensors is corrupted (sha256 differs from config.json)" in capsys.readouterr().err

    cfg = ModelConfig(vocab_size=32, dim=8, n_layers=1, n_heads=2, num_experts=4, top_k=2, moe_hidden_dim=6)
    main = tmp_path / "main"
    main.mkdir()
    save_file(MoETransformer(cfg).state_dict(), main / "model.safetensors")
    (main / "config.json").write_text(json.dumps(dataclasses.asdict(cfg)))
    assert cli.main(["export", str(main), "--hf", str(tmp_path / "oss"), "--model-type", "gpt_oss"]) == 2
    assert capsys.readouterr().err.startswith("dtensor-moe export: this MoE layer cannot be written as gpt_oss: "
                                              "score_func='softmax' (as gpt_oss: 'topk_softmax'), router_bias=False")
    assert cli.main(["export", str(main), "--hf", str(tmp_path / "qwen"), "--model-type", "qwen3_moe"]) == 0
    keys = set(load_file(tmp_path / "qwen" / "model.safetensors"))
    assert keys == {"model.layers.0.mlp.gate.weight"} | {f"model.layers.0.mlp.experts.{e}.{n}_proj.weight"
                                                          for e in range(4) for n in ("gate", "up", "down")}


def test_reader_follows_the_shard_index(tmp_path):
    """A checkpoint save_pretrained split into shards (model.safetensors.index.json) reads like the
    single file: every key, any box, each shard opened once."""
    from safetensors.torch import load_file

    from dtensor_moe.hf import SafetensorsReader

    model = hf_model("qwen3_moe")
    model.save_pretrained(tmp_path / "one")
    model.save_pretrained(tmp_path / "sharded", max_shard_size="4KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    one, reader = load_file(tmp_path / "one" / "model.safetensors"), SafetensorsReader(tmp_path / "sharded")
    assert reader.keys() == set(one)
    for k, v in one.items():
        box = tuple(slice(n // 3, n) for n in v.shape)
        assert torch.equal(reader.read(k, box), v[box]), k
    assert len(reader._open) == len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
