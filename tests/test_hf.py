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
@pytest.mark.parametrize("top_k", [2, 1])
def test_from_hf_block_matches_transformers(model_type, top_k):
    """top_k = 1 too: each family's renormalization (qwen3_moe's norm_topk_prob, deepseek_v3's, the softmax over
    the kept choice) gives the one choice weight route_scale, which route_norm must reproduce."""
    from dtensor_moe.hf import from_hf_block

    block = moe_block(hf_model(model_type, top_k=top_k), model_type)
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


def test_from_hf_block_takes_run_options_apart_from_training_options():
    """How the block runs is `options` (MoERunOptions); `balance_fields` are the MoEConfig fields its config does
    not fix. A run option given as a training option is refused, naming where it goes."""
    from dtensor_moe import MoERunOptions
    from dtensor_moe.hf import from_hf_block, swap_moe_blocks

    model = hf_model("qwen3_moe")
    run = MoERunOptions(capacity_factor=1.5, activation_memory="standard")
    moe = from_hf_block(moe_block(model, "qwen3_moe"), run, aux_loss_coeff=0.01)
    assert moe.options == run and moe.config.aux_loss_coeff == 0.01
    assert from_hf_block(moe_block(model, "qwen3_moe")).options == MoERunOptions()
    with pytest.raises(ValueError) as err:
        from_hf_block(moe_block(model, "qwen3_moe"), expert_precision="fp8", capacity_factor=1.0)
    assert str(err.value) == ("qwen3_moe: ['capacity_factor', 'expert_precision'] are run options, not MoEConfig "
                              "fields; valid: pass them as options=MoERunOptions(capacity_factor=..., "
                              "expert_precision=...)")
    with pytest.raises(ValueError, match=r"\['expert_precision'\] are run options, not MoEConfig fields; valid: pass "
                                         r"them as options=MoERunOptions\(expert_precision=\.\.\.\)"):
        swap_moe_blocks(hf_model("qwen3_moe"), expert_precision="fp8")
    swapped = swap_moe_blocks(model, run)
    assert swapped and all(m.options == run for m in swapped.values())


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
    # for gate and up), buffers whole; the layer holds far more.
    owned = sum(
        math.prod(s.stop - s.start for s in owned_box(wp, dims, rank))
        * (2 if model_type == "gpt_oss" and wp.name in ("experts.w13", "experts.b13") else 1)
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
def test_cli_import_export_import_hf_round_trips_bit_exactly(model_type, checkpoints, tmp_path):
    """import --hf: every MoE layer in our names; export --hf of that: bit for bit what save_pretrained
    wrote for those layers, and the family's MoE and layer config fields as in its config.json; import
    --hf of that export: our file again, every tensor and its dtype, and the same config.json."""
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
    assert all(hf_config.get(k, v) == v for k, v in fields.items() if k not in ("sha256", "num_experts")), fields
    assert cli.main(["import", "--hf", str(tmp_path / "theirs"), str(tmp_path / "again")]) == 0
    again = load_file(tmp_path / "again" / "model.safetensors")
    assert set(again) == set(ours)
    for k, v in again.items():
        assert v.dtype == ours[k].dtype == torch.float64 and torch.equal(v, ours[k]), k
    assert json.loads((tmp_path / "again" / "config.json").read_text()) == json.loads(
        (tmp_path / "ours" / "config.json").read_text()
    )


def test_cli_hf_refuses_bad_input_in_one_line(checkpoints, tmp_path, capsys):
    """No silent replacement, a corrupted import is named, and a main-job model a family cannot
    express is refused naming the fields; one that it can is written under its keys."""
    from safetensors.torch import load_file

    from dtensor_moe import cli

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

    main = tmp_path / "main"
    _main_job_export(main, n_layers=1)
    assert cli.main(["export", str(main), "--hf", str(tmp_path / "oss"), "--model-type", "gpt_oss"]) == 2
    assert capsys.readouterr().err.startswith("dtensor-moe export: this MoE layer cannot be written as gpt_oss: "
                                              "score_func='softmax' (as gpt_oss: 'topk_softmax'), router_bias=False")
    assert cli.main(["export", str(main), "--hf", str(tmp_path / "qwen"), "--model-type", "qwen3_moe"]) == 0
    keys = set(load_file(tmp_path / "qwen" / "model.safetensors"))
    assert keys == {"model.layers.0.mlp.gate.weight"} | {f"model.layers.0.mlp.experts.{e}.{n}_proj.weight"
                                                          for e in range(4) for n in ("gate", "up", "down")}


def _main_job_export(out, n_layers: int, **moe) -> dict:
    """A `dtensor-moe export` of the main job's model (`moe`: its MoE fields) with random weights in
    bfloat16, the aux-free bias in float32 (as DeepSeek-V3 keeps its correction bias); its tensors."""
    import dataclasses

    from safetensors.torch import save_file

    from dtensor_moe.train.config import ModelConfig
    from dtensor_moe.train.model import MoETransformer

    cfg = ModelConfig(vocab_size=32, dim=8, n_layers=n_layers, n_heads=2, hidden_dim=6,
                      **{"num_experts": 4, "top_k": 2, **moe})
    g = torch.Generator().manual_seed(3)
    state = {k: torch.randn(v.shape, generator=g).to(torch.float32 if k.endswith("expert_bias") else torch.bfloat16)
             for k, v in MoETransformer(cfg).state_dict().items()}
    out.mkdir()
    save_file(state, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(dataclasses.asdict(cfg)))
    return state


# A main-job MoE that each family expresses.
MAIN_JOB_MOE = {
    "qwen3_moe": {},
    "mixtral": {},
    "deepseek_v3": dict(num_experts=8, score_func="sigmoid", num_expert_groups=4, num_limited_groups=2,
                        route_scale=2.5, num_shared_experts=1, load_balance="aux_free_bias"),
    "gpt_oss": dict(score_func="topk_softmax", router_bias=True, expert_biases=True, activation="clamped_swiglu"),
}


@pytest.mark.parametrize("model_type", FAMILIES)
def test_cli_main_job_export_hf_then_import_hf_round_trips_bit_exactly(model_type, tmp_path):
    """export --hf of the main job's weights, then import --hf of what it wrote: every MoE tensor of
    every layer again, equal and in its dtype."""
    from safetensors.torch import load_file

    from dtensor_moe import cli

    main = _main_job_export(tmp_path / "main", n_layers=2, **MAIN_JOB_MOE[model_type])
    argv = ["export", str(tmp_path / "main"), "--hf", str(tmp_path / "hf"), "--model-type", model_type]
    assert cli.main(argv) == 0
    assert cli.main(["import", "--hf", str(tmp_path / "hf"), str(tmp_path / "ours")]) == 0
    ours = load_file(tmp_path / "ours" / "model.safetensors")
    moe = {k: v for k, v in main.items() if ".moe." in k}
    assert set(ours) == set(moe) and {k.split(".moe.")[0] for k in ours} == {"layers.0", "layers.1"}
    for k, v in ours.items():
        assert v.dtype == moe[k].dtype and torch.equal(v, moe[k]), k
    assert {v.dtype for v in ours.values()} == {torch.bfloat16, torch.float32} if model_type == "deepseek_v3" else {
        torch.bfloat16
    }


def _edited_copy(src, out, edit):
    """A copy of checkpoint directory `src` (Hugging Face's, or import --hf's: then its sha256 is
    brought up to date) with `edit(tensors, config)` applied."""
    import hashlib

    from safetensors.torch import load_file, save_file

    tensors, config = load_file(src / "model.safetensors"), json.loads((src / "config.json").read_text())
    edit(tensors, config)
    out.mkdir()
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    if "sha256" in config:
        config["sha256"] = hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()
    (out / "config.json").write_text(json.dumps(config))
    return out


def _zeros(tensors, key, shape):
    tensors[key] = torch.zeros(shape, dtype=torch.float64)


def _not_a_layer(layer: int, model_type: str, problem: str) -> str:
    return (f"dtensor-moe import: the Hugging Face weights under 'model.layers.{layer}.mlp.' are not a {model_type} "
            f"MoE layer of this config: {problem}")


IMPORT_REFUSALS = {  # an edit of the tiny Qwen3-MoE checkpoint (tensors, config.json) -> the line import --hf prints
    "fewer_experts_in_config": (
        lambda t, c: c.update(num_local_experts=3),
        _not_a_layer(0, "qwen3_moe", "model.layers.0.mlp.gate.weight has shape (4, 8), expected (3, 8) (and 3 more)"),
    ),
    "larger_tensor": (
        lambda t, c: _zeros(t, "model.layers.0.mlp.experts.1.down_proj.weight", (8, 7)),
        _not_a_layer(0, "qwen3_moe", "model.layers.0.mlp.experts.1.down_proj.weight has shape (8, 7), expected (8, 6)"),
    ),
    "missing_key": (
        lambda t, c: t.pop("model.layers.1.mlp.experts.3.up_proj.weight"),
        _not_a_layer(1, "qwen3_moe", "model.layers.1.mlp.experts.3.up_proj.weight (shape (6, 8)) is missing"),
    ),
    "unexpected_key": (
        lambda t, c: _zeros(t, "model.layers.0.mlp.experts.4.gate_proj.weight", (6, 8)),
        _not_a_layer(0, "qwen3_moe", "model.layers.0.mlp.experts.4.gate_proj.weight (shape (6, 8)) is unexpected"),
    ),
    "wrong_family": (
        lambda t, c: c.update(model_type="mixtral"),
        _not_a_layer(0, "mixtral", "model.layers.0.mlp.experts.0.w1.weight (shape (12, 8)) is missing (and 23 more)"),
    ),
    "unknown_family": (
        lambda t, c: c.update(model_type="qwen2_moe"),
        "dtensor-moe import: Hugging Face model_type 'qwen2_moe' is not supported; valid: ['deepseek_v3', 'gpt_oss', "
        "'mixtral', 'qwen3_moe']",
    ),
}


@pytest.mark.parametrize("case", IMPORT_REFUSALS)
def test_cli_import_hf_refuses_checkpoint_config_mismatch_in_one_line(case, checkpoints, tmp_path, capsys):
    """A tensor of another shape than config.json implies (never a silent slice of a larger one), a
    missing or unexpected key, or a wrong family: one line naming it and rc 2, nothing written."""
    from dtensor_moe import cli

    edit, line = IMPORT_REFUSALS[case]
    bad = _edited_copy(checkpoints["qwen3_moe"], tmp_path / "bad", edit)
    assert cli.main(["import", "--hf", str(bad), str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == line + "\n"
    assert not (tmp_path / "out").exists()


def _not_its_layers(problem: str) -> str:
    return ("dtensor-moe export: {}/model.safetensors does not hold the mixtral MoE layers [0, 1] its config.json "
            f"describes: {problem}")


EXPORT_REFUSALS = {  # an edit of import --hf's directory of the tiny Mixtral -> the line export --hf prints ({}: it)
    "larger_tensor": (
        lambda t, c: _zeros(t, "layers.0.moe.experts.w2", (4, 8, 7)),
        _not_its_layers("layers.0.moe.experts.w2 has shape (4, 8, 7), expected (4, 8, 6)"),
    ),
    "missing_key": (
        lambda t, c: t.pop("layers.1.moe.router.gate.weight"),
        _not_its_layers("layers.1.moe.router.gate.weight (shape (4, 8)) is missing"),
    ),
    "unexpected_key": (
        lambda t, c: _zeros(t, "layers.2.moe.router.gate.weight", (4, 8)),
        _not_its_layers("layers.2.moe.router.gate.weight (shape (4, 8)) is unexpected"),
    ),
    "config_without_layer_count": (
        lambda t, c: c.pop("num_hidden_layers"),
        "dtensor-moe export: {}/config.json lacks ['num_hidden_layers'], which import --hf writes; import the "
        "checkpoint again",
    ),
    "dense_layer": (
        lambda t, c: c.update(moe_layers=[1]),
        "dtensor-moe export: this MoE layer cannot be written as mixtral: MoE layers [1] of 2 (as mixtral: [0, 1]); "
        "valid model types: ['qwen3_moe']",
    ),
}


@pytest.mark.parametrize("case", EXPORT_REFUSALS)
def test_cli_export_hf_refuses_a_source_unlike_its_config_in_one_line(case, checkpoints, tmp_path, capsys):
    """What import --hf of export --hf's output would refuse or read differently is refused before
    writing: one line naming the tensor or field, rc 2."""
    from dtensor_moe import cli

    assert cli.main(["import", "--hf", str(checkpoints["mixtral"]), str(tmp_path / "ours")]) == 0
    edit, line = EXPORT_REFUSALS[case]
    bad = _edited_copy(tmp_path / "ours", tmp_path / "bad", edit)
    assert cli.main(["export", str(bad), "--hf", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == line.format(bad) + "\n"
    assert not (tmp_path / "out").exists()


def test_cli_export_hf_refuses_deepseek_v3_without_its_correction_bias(tmp_path, capsys):
    """DeepSeek-V3 always stores e_score_correction_bias: a main-job layer without aux-free balancing
    (no expert_bias) would come back with one, so it is refused as such."""
    from dtensor_moe import cli

    _main_job_export(tmp_path / "main", n_layers=1, **{**MAIN_JOB_MOE["deepseek_v3"], "load_balance": "aux_loss"})
    argv = ["export", str(tmp_path / "main"), "--hf", str(tmp_path / "out"), "--model-type", "deepseek_v3"]
    assert cli.main(argv) == 2
    assert capsys.readouterr().err == ("dtensor-moe export: this MoE layer cannot be written as deepseek_v3: "
                                       "load_balance='aux_loss' (as deepseek_v3: 'aux_free_bias'); valid model types: "
                                       "[]\n")
    assert not (tmp_path / "out").exists()


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
