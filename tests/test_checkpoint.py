"""Checkpoints reshard exactly across expert meshes, survive a killed rank, and reject other configs.

The worker functions run on harness ranks (or, for the kill test, in their own processes). Every
run trains a tiny MoE transformer with AdamW and a step lr schedule on a global batch that is split
evenly over the data-parallel ranks, so the mean of the rank losses is comparable across meshes.
"""

import multiprocessing
import os
import signal
import time

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.distributed.tensor import DTensor

from dtensor_moe import MoEParallelDims
from dtensor_moe.train.checkpoint import latest, load, save, step_dir
from dtensor_moe.train.config import ModelConfig
from dtensor_moe.train.model import MoETransformer
from dtensor_moe.train.parallel.parallelize_transformer import parallelize_transformer

from .harness import _free_port, run_on_ranks

CFG = ModelConfig(vocab_size=32, dim=16, n_layers=2, n_heads=2, num_experts=4, top_k=2, hidden_dim=8,
                  num_shared_experts=1, load_balance="aux_free_bias", bias_update_rate=1e-2, max_seq_len=16)
GLOBAL_BATCH, SEQ = 8, 9
SAVE_STEP = 3  # AdamW steps before the save: moments, lr schedule and expert_bias are all non-zero


def build(world: int, dims: dict | None, seed: int, cfg: ModelConfig = CFG):
    """Model (parallelized over `dims`, or plain when None), AdamW and a step lr schedule."""
    torch.manual_seed(seed)
    model = MoETransformer(cfg)
    if dims is not None:
        parallelize_transformer(model, MoEParallelDims(world, **dims), device_type="cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    return model, opt, sched


def train(model, opt, sched, steps: range, rank: int, world: int) -> list[float]:
    losses = []
    per = GLOBAL_BATCH // world
    for s in steps:
        tokens = torch.randint(0, CFG.vocab_size, (GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(s))
        t = tokens[rank * per : (rank + 1) * per]
        logits = model(t[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), t[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        model.update_expert_bias()
        losses.append(loss.item())
    return losses


def _full(v):
    return v.full_tensor() if isinstance(v, DTensor) else v.detach().clone()


def full_state(model, opt) -> dict:
    """Every model tensor (buffers included) and optimizer moment as a full tensor (collective)."""
    out = {f"model.{k}": _full(v) for k, v in get_model_state_dict(model).items()}
    osd = get_optimizer_state_dict(model, opt)
    for fqn, st in osd["state"].items():
        out.update({f"optim.{fqn}.{name}": _full(v) for name, v in st.items()})
    out["param_groups"] = [{k: v for k, v in g.items() if k != "params"} for g in osd["param_groups"]]
    return out


def assert_bit_identical(got: dict, want: dict):
    assert got.keys() == want.keys()
    assert got["param_groups"] == want["param_groups"]
    for k in want.keys() - {"param_groups"}:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
    assert any("exp_avg_sq" in k and want[k].abs().sum() > 0 for k in want)
    assert any(k.endswith("expert_bias") and want[k].abs().sum() > 0 for k in want)


def extra_for(sched) -> dict:
    return {
        "data_pos": SAVE_STEP * GLOBAL_BATCH,
        "rng": torch.Generator().manual_seed(7).get_state(),
        "lr_scheduler": sched.state_dict(),
    }


def _save_and_resume_same_mesh(rank, world, root, dims):
    model, opt, sched = build(world, dims, seed=0)
    train(model, opt, sched, range(SAVE_STEP), rank, world)
    save(root, SAVE_STEP, model, opt, extra=extra_for(sched))
    saved = full_state(model, opt)
    continued = train(model, opt, sched, range(SAVE_STEP, SAVE_STEP + 2), rank, world)

    model, opt, sched = build(world, dims, seed=1)
    extra = load(root, model, opt)
    sched.load_state_dict(extra["lr_scheduler"])
    resumed = train(model, opt, sched, range(extra["step"], extra["step"] + 2), rank, world)
    return saved if rank == 0 else None, continued, resumed


def _load_and_continue(rank, world, root, dims):
    model, opt, sched = build(world, dims, seed=1)
    extra = load(root, model, opt)
    sched.load_state_dict(extra["lr_scheduler"])
    state = full_state(model, opt)
    losses = train(model, opt, sched, range(extra["step"], extra["step"] + 2), rank, world)
    return state if rank == 0 else None, losses, extra


def _mean_losses(per_rank: list[list[float]]) -> list[float]:
    return [sum(step) / len(step) for step in zip(*per_rank)]


def test_reshard_8_ranks_to_ep4_etp2_and_one_process(tmp_path):
    root = str(tmp_path)
    out = run_on_ranks(8, _save_and_resume_same_mesh, root, {"ep": 2, "etp": 2})  # EDP2 x EP2 x ETP2
    saved = out[0][0]
    continued = _mean_losses([o[1] for o in out])
    # Same mesh: resuming gives the uninterrupted run's losses bit for bit.
    assert [o[2] for o in out] == [o[1] for o in out]

    for world, dims in ((4, {"ep": 4}), (2, {"etp": 2}), (1, None)):
        res = run_on_ranks(world, _load_and_continue, root, dims)
        assert_bit_identical(res[0][0], saved)
        extra = res[0][2]
        assert extra["step"] == SAVE_STEP and extra["data_pos"] == SAVE_STEP * GLOBAL_BATCH
        assert torch.equal(extra["rng"], torch.Generator().manual_seed(7).get_state())
        # Another mesh sums in another order: same training within float32 rounding.
        assert _mean_losses([r[1] for r in res]) == pytest.approx(continued, rel=1e-6), (world, dims)


def _plain_model_steps(tmp_path, steps, keep_last):
    model, opt, sched = build(1, None, seed=0)
    for s in steps:
        train(model, opt, sched, range(s, s + 1), 0, 1)
        save(tmp_path, s + 1, model, opt, extra=extra_for(sched), keep_last=keep_last)
    return model, opt


def test_keep_last_and_latest_ignore_partial_dirs(tmp_path):
    _plain_model_steps(tmp_path, range(4), keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000003", "step_00000004"]
    (tmp_path / ".tmp-step_00000009").mkdir()  # a save that died
    (tmp_path / "step_00000008").mkdir()  # a copy without .metadata
    assert latest(tmp_path) == step_dir(tmp_path, 4)
    assert latest(tmp_path / "nothing") is None
    with pytest.raises(ValueError, match="no complete checkpoint"):
        load(tmp_path / "nothing", *build(1, None, seed=0)[:2])


def test_weights_only_checkpoint_needs_optimizer_none(tmp_path):
    model, opt, _ = build(1, None, seed=0)
    save(tmp_path, 0, model)
    with pytest.raises(ValueError, match="optimizer=None"):
        load(tmp_path, model, opt)
    fresh, _, _ = build(1, None, seed=1)
    assert load(tmp_path, fresh) == {"step": 0}
    for k, v in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k


def _load_other_config(rank, world, root):
    cfg = ModelConfig(**{**CFG.__dict__, "n_layers": 3, "hidden_dim": 16})
    model, opt, _ = build(world, {"ep": 2}, seed=0, cfg=cfg)
    load(root, model, opt)


def test_incompatible_config_raises_on_every_rank(tmp_path):
    _plain_model_steps(tmp_path, range(1), keep_last=1)
    # harness re-raises only when every rank raised the same type; a hang would time out instead.
    with pytest.raises(ValueError) as err:
        run_on_ranks(2, _load_other_config, str(tmp_path))
    msg = str(err.value)
    assert "missing in checkpoint: layers.2." in msg
    assert "layers.0.moe.experts.w1: checkpoint [4, 8, 16] vs model [4, 16, 16]" in msg
    assert "n_layers: saved 2 vs model 3" in msg


# --- a rank SIGKILLed in the middle of a save ---------------------------------------------------

KILL_DIMS = {"ep": 2}


def _die_after_writing_own_shard():
    """Test hook: this rank writes its shard files, then is SIGKILLed before the save completes."""
    from torch.distributed.checkpoint import FileSystemWriter

    write_data = FileSystemWriter.write_data

    def dying(self, plan, planner):
        write_data(self, plan, planner).wait()
        os.kill(os.getpid(), signal.SIGKILL)

    FileSystemWriter.write_data = dying


def _killed_group_worker(rank, world, port, root):
    import json

    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model, opt, sched = build(world, KILL_DIMS, seed=0)
    train(model, opt, sched, range(SAVE_STEP), rank, world)
    save(root, SAVE_STEP, model, opt, extra=extra_for(sched))
    losses = train(model, opt, sched, range(SAVE_STEP, SAVE_STEP + 2), rank, world)
    with open(os.path.join(root, f"losses_{rank}.json"), "w") as f:
        json.dump(losses, f)
    if rank == 1:
        _die_after_writing_own_shard()
    save(root, SAVE_STEP + 2, model, opt, extra=extra_for(sched))


def _resume_and_save(rank, world, root):
    model, opt, sched = build(world, KILL_DIMS, seed=1)
    extra = load(root, model, opt)
    sched.load_state_dict(extra["lr_scheduler"])
    losses = train(model, opt, sched, range(extra["step"], extra["step"] + 2), rank, world)
    save(root, extra["step"] + 2, model, opt, extra=extra_for(sched))
    return extra["step"], losses


def test_rank_killed_mid_save_keeps_previous_checkpoint(tmp_path):
    import json

    root, world = str(tmp_path), 2
    ctx = multiprocessing.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_killed_group_worker, args=(r, world, port, root)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        procs[1].join(timeout=150)
        assert procs[1].exitcode == -signal.SIGKILL
        time.sleep(1)  # the survivor is stuck in (or failing out of) DCP's collective
    finally:  # end the survivors as a launcher would
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()

    partial = tmp_path / f".tmp-step_{SAVE_STEP + 2:08d}"
    assert (partial / "__1_0.distcp").is_file() and not (partial / ".metadata").exists()
    assert latest(root) == step_dir(root, SAVE_STEP)

    resumed = run_on_ranks(world, _resume_and_save, root)
    for rank, (step, losses) in enumerate(resumed):
        assert step == SAVE_STEP
        assert losses == json.loads((tmp_path / f"losses_{rank}.json").read_text())  # bit-exact resume
    assert latest(root) == step_dir(root, SAVE_STEP + 2) and not partial.exists()


# --- damaged checkpoints: verified against manifest.json before the model is touched ----------

from dtensor_moe.train.checkpoint import MANIFEST, CheckpointError  # noqa: E402


def _saved_steps(root, steps=(1, 2)):
    """A plain model trained and saved after each of `steps`; returns the model's state at the end."""
    model, opt, sched = build(1, None, seed=0)
    for s in steps:
        train(model, opt, sched, range(s - 1, s), 0, 1)
        save(root, s, model, opt, extra=extra_for(sched), keep_last=None)
    return model


def _flip(path, at=0.5, n=8):
    data = bytearray(path.read_bytes())
    i = int(len(data) * at)
    data[i : i + n] = bytes(b ^ 0xFF for b in data[i : i + n])
    path.write_bytes(bytes(data))


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def _unchanged(model, before):
    return [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]


def test_manifest_lists_every_file_with_its_sha256(tmp_path):
    import hashlib
    import json

    _saved_steps(tmp_path, steps=(1,))
    ckpt = step_dir(tmp_path, 1)
    files = json.loads((ckpt / MANIFEST).read_text())["files"]
    assert sorted(files) == sorted(p.name for p in ckpt.iterdir() if p.name != MANIFEST)
    for name, entry in files.items():
        data = (ckpt / name).read_bytes()
        assert entry == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


@pytest.mark.parametrize("damage,problem", [(_flip, "is corrupted"), (_truncate, "is truncated or altered")])
def test_damaged_step_fails_naming_step_and_file_and_leaves_model_alone(tmp_path, damage, problem):
    _saved_steps(tmp_path)
    damage(step_dir(tmp_path, 2) / "__0_0.distcp")
    model, opt, _ = build(1, None, seed=1)
    before = _state(model)
    with pytest.raises(CheckpointError, match=rf"step_00000002 cannot be loaded: __0_0\.distcp {problem}"):
        load(step_dir(tmp_path, 2), model, opt)
    assert _unchanged(model, before) == [] and not opt.state


def test_checkpoint_without_manifest_is_refused_unless_allowed(tmp_path, capsys, monkeypatch):
    """A missing manifest is refused (its bytes cannot be checked); with the opt-in for older saves,
    DCP's own error on a damaged file is translated, and nothing was swapped in either way."""
    _saved_steps(tmp_path, steps=(1,))
    ckpt = step_dir(tmp_path, 1)
    (ckpt / MANIFEST).unlink()
    _truncate(ckpt / "__0_0.distcp")
    model, opt, _ = build(1, None, seed=1)
    before = _state(model)
    with pytest.raises(CheckpointError, match=r"step_00000001 cannot be loaded: manifest.json is missing.*"
                                              r"DTENSOR_MOE_ALLOW_UNVERIFIED=1 loads"):
        load(ckpt, model, opt)
    assert _unchanged(model, before) == []
    monkeypatch.setenv("DTENSOR_MOE_ALLOW_UNVERIFIED", "1")
    # CheckpointException derives from BaseException; what escapes here is a ValueError subclass.
    with pytest.raises(CheckpointError, match=r"step_00000001 cannot be read: rank 0: RuntimeError"):
        load(ckpt, model, opt)
    assert _unchanged(model, before) == []
    assert (
        "step_00000001 has no manifest.json (DTENSOR_MOE_ALLOW_UNVERIFIED=1); loading it unverified"
        in capsys.readouterr().err
    )


def test_root_falls_back_to_newest_intact_step_and_says_so(tmp_path, capsys):
    _saved_steps(tmp_path, steps=(1, 2, 3))
    _flip(step_dir(tmp_path, 3) / ".metadata", at=0.3)
    (step_dir(tmp_path, 2) / "train_state.pt").unlink()
    model, opt, _ = build(1, None, seed=1)
    assert load(tmp_path, model, opt)["step"] == 1
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "checkpoint: skipping step_00000003 (.metadata is corrupted (sha256 differs from manifest.json)); "
        "step_00000002 (incomplete: train_state.pt missing); loading step_00000001, the newest intact step"
    ]
    _truncate(step_dir(tmp_path, 1) / "__0_0.distcp")
    with pytest.raises(
        CheckpointError, match=r"no intact checkpoint under .*step_00000001 \(__0_0\.distcp is truncated"
    ):
        load(tmp_path, model, opt)


def _load_damaged(rank, world, root):
    model, opt, _ = build(world, {"ep": 2}, seed=1)
    load(root, model, opt)


def test_damage_is_found_on_every_rank(tmp_path):
    """Ranks hash their shares of the files and share the verdict: all raise, none hangs."""
    _saved_steps(tmp_path, steps=(1,))
    _flip(step_dir(tmp_path, 1) / "__0_0.distcp")
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp is corrupted"):
        run_on_ranks(2, _load_damaged, str(step_dir(tmp_path, 1)))


@pytest.mark.parametrize(
    "change,listed",
    [
        ({"n_heads": 4}, "n_heads: saved 2 vs model 4"),
        (
            {"top_k": 1, "score_func": "sigmoid"},
            "score_func: saved 'softmax' vs model 'sigmoid', top_k: saved 2 vs model 1",
        ),
        ({"route_scale": 2.0}, "route_scale: saved 1.0 vs model 2.0"),
    ],
)
def test_config_change_that_keeps_shapes_is_refused(tmp_path, change, listed):
    _saved_steps(tmp_path, steps=(1,))
    model, opt, _ = build(1, None, seed=1, cfg=ModelConfig(**{**CFG.__dict__, **change}))
    before = _state(model)
    with pytest.raises(ValueError, match="was saved from another model config") as err:
        load(tmp_path, model, opt)
    assert f"model config differs: {listed}" in str(err.value)
    assert _unchanged(model, before) == []


def test_checkpoint_holds_the_architecture_not_the_run_options(tmp_path):
    """model_config.json is the ModelConfig (the architecture) and nothing of [moe_run]: a model saved while running
    with capacity, rounding, standard activations and FP8 loads into one run with the defaults, bit for bit, and
    the main job's --resume takes other moe_run values while it refuses another model.top_k."""
    import json
    from dataclasses import asdict, fields, replace

    from dtensor_moe import MoERunOptions
    from dtensor_moe.cli.train import _resume_target
    from dtensor_moe.train.checkpoint import MODEL_CONFIG
    from dtensor_moe.train.config import Config, TrainingConfig

    arch = replace(CFG, vocab_size=256)  # the main job's Config: byte-level data
    run = MoERunOptions(capacity_factor=1.25, drop_policy="position", round_tokens_to=2, activation_memory="standard",
                        expert_precision="fp8", max_rows_per_rank=64)
    torch.manual_seed(0)
    model = MoETransformer(arch, run)
    assert all(layer.moe.options == run for layer in model.layers.values())
    save(tmp_path / "run" / "checkpoints", 1, model)
    saved = json.loads((step_dir(tmp_path / "run" / "checkpoints", 1) / MODEL_CONFIG).read_text())
    assert saved == json.loads(json.dumps(asdict(arch)))
    run_fields = {f.name for f in fields(MoERunOptions)}
    assert not run_fields & set(saved), run_fields & set(saved)  # e.g. no "capacity_factor", no "expert_replicas"

    torch.manual_seed(1)
    fresh = MoETransformer(arch)  # MoERunOptions() everywhere
    assert load(tmp_path / "run" / "checkpoints", fresh) == {"step": 1}
    for k, v in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k

    cfg = Config(model=arch, moe_run=run, training=TrainingConfig(steps=4, seq_len=8))
    args = type("Args", (), {"resume": "latest"})()
    for other in (MoERunOptions(), MoERunOptions(expert_replicas=2, dispatch_precision="fp8", round_tokens_to=4)):
        assert _resume_target(args, replace(cfg, moe_run=other), str(tmp_path / "run")).name == "step_00000001"
    with pytest.raises(ValueError, match=r"was saved with another model config \(top_k: saved 2 vs config 1\)"):
        _resume_target(args, replace(cfg, model=replace(arch, top_k=1)), str(tmp_path / "run"))


def test_keep_last_never_deletes_the_step_just_saved(tmp_path):
    """Resumed from step 1 with steps 5 and 6 of an earlier run on disk: saving step 2 keeps step 2."""
    _saved_steps(tmp_path, steps=(1, 5, 6))
    model, opt, sched = build(1, None, seed=0)
    save(tmp_path, 2, model, opt, extra=extra_for(sched), keep_last=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000002", "step_00000006"]


def test_weights_only_checkpoint_with_fresh_optimizer_ok(tmp_path, capsys):
    model, opt, _ = build(1, None, seed=0)
    save(tmp_path, 4, model)
    fresh, fresh_opt, _ = build(1, None, seed=1)
    assert load(tmp_path, fresh, fresh_opt, fresh_optimizer_ok=True) == {"step": 4}
    assert not fresh_opt.state
    assert "step_00000004 holds model weights only; the optimizer starts fresh at step 4" in capsys.readouterr().err



def test_checkpoint_holds_torchtitan_names_for_gate_and_up(tmp_path):
    """The experts' w13 is saved (weights and AdamW moments) as torchtitan's w1 and w3, so checkpoints written
    before w13 existed, and tools reading torchtitan's names, see the same keys; loading stacks them back."""
    import torch.distributed.checkpoint as dcp

    model, opt = _plain_model_steps(tmp_path, range(1), keep_last=1)
    keys = set(dcp.FileSystemReader(latest(tmp_path)).read_metadata().state_dict_metadata)
    assert {"model.layers.0.moe.experts.w1", "model.layers.0.moe.experts.w3"} <= keys
    assert {"optim.state.layers.0.moe.experts.w1.exp_avg", "optim.state.layers.0.moe.experts.w3.exp_avg_sq"} <= keys
    assert not any("w13" in k for k in keys)
    fresh, fresh_opt, _ = build(1, None, seed=1)
    load(tmp_path, fresh, fresh_opt)
    assert_bit_identical(full_state(fresh, fresh_opt), full_state(model, opt))


def test_load_refuses_gate_up_halves_that_are_copies(tmp_path, monkeypatch):
    """The load fills w13 through views of its halves: were they copies (another torch), it says so instead of
    leaving the weights unloaded."""
    from dtensor_moe.experts import split_gate_up
    from dtensor_moe.train import checkpoint

    _plain_model_steps(tmp_path, range(1), keep_last=1)
    monkeypatch.setattr(checkpoint, "split_gate_up",
                        lambda sd: {k: v.clone() for k, v in split_gate_up(sd).items()})
    fresh, fresh_opt, _ = build(1, None, seed=1)
    with pytest.raises(RuntimeError, match="is not a view of its w13"):
        load(tmp_path, fresh, fresh_opt)
