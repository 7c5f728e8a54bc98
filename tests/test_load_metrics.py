"""The main job's expert load: rows per expert and per EP rank, each layer's max/mean, in metrics.jsonl, summary.json,
the console and load.png, from a router forced to known counts, on 1 process and on EP2 meshes with PP, HSDP, CP,
TP and ETP."""

import contextlib
import json
from dataclasses import replace

import pytest
import torch

from dtensor_moe.cli import main
from dtensor_moe.cli import train as train_cli
from dtensor_moe.parallel.mesh import MoEParallelDims
from dtensor_moe.train.config import load_config
from dtensor_moe.train.metrics import expert_ep_ranks, load_summary, worst_layer

from .harness import _as_torchrun_rank, _free_port, run_on_ranks

# Each rank's t-th token of a forward goes to these two experts (8 experts), whatever its hidden state. Per 12
# tokens: layer 0 rows [6, 6, 2, 2, 2, 2, 2, 2] (max/mean 2; EP2 ranks 16:8, 4/3), layer 1 [12, 3, 3, 3, 3, 0, 0, 0]
# (max/mean 4; EP2 ranks 21:3, 1.75). A step is 4 sequences of 48 tokens: 16 x 12 tokens on any split of them
# into forwards of 12k tokens, so every mesh and microbatching counts the same.
FORCED = {0: lambda t_T: (t_T % 2, 2 + t_T % 6), 1: lambda t_T: (0 * t_T, 1 + t_T % 4)}
LAYER1_ROWS = [192, 48, 48, 48, 48, 0, 0, 0]
SHAPE = ["training.global_batch=4", "training.seq_len=48"]


@contextlib.contextmanager
def _forced_routing():
    from dtensor_moe.routing.router import TopKRouter
    from dtensor_moe.train.model import MoETransformer

    route, build = TopKRouter.forward, MoETransformer.__init__

    def tagged(self, cfg, options=None):
        build(self, cfg, options)
        for i, moe in self.moe_layers().items():  # pipeline stages are copies: they keep the tag
            moe.router.layer = i

    def forced(self, x_TD, expert_bias_E=None):
        r = route(self, x_TD, expert_bias_E)
        experts_TK = torch.stack(FORCED[self.layer](torch.arange(x_TD.shape[0], device=x_TD.device)), dim=1)
        return replace(r, experts_TK=experts_TK, weights_TK=r.scores_TE.gather(1, experts_TK).to(r.weights_TK.dtype))

    TopKRouter.forward, MoETransformer.__init__ = forced, tagged
    try:
        yield
    finally:
        TopKRouter.forward, MoETransformer.__init__ = route, build


def _forced_rank(rank, world_size, target, args, environ, port):
    with _forced_routing():
        return _as_torchrun_rank(rank, world_size, target, args, environ, port)


def _forced_launch(cmd, env, run_dir, nproc, timeout_s):
    """The launcher's torchruns (its ranks, the 1-process parity reference) on the harness's pools, as
    tests/test_train.py runs them, each rank routing by FORCED."""
    i = cmd.index("-m", cmd.index("torch.distributed.run"))  # [python, -m, torch.distributed.run, OPTIONS, -m, ...]
    codes = run_on_ranks(nproc, _forced_rank, ("module", cmd[i + 1]), cmd[i + 2:], env, _free_port())
    return next((c for c in codes if c), 0)


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _load(row):
    return {k: v for k, v in row.items() if "imbalance" in k or k.startswith("worst")}


def _want(ep_imbalance, rows_per_ep_rank):
    return {"expert_imbalance": [2.0, 4.0], "ep_imbalance": ep_imbalance, "worst_layer": 1,
            "worst_expert_imbalance": 4.0, "worst_ep_imbalance": ep_imbalance[1], "worst_rows_per_expert": LAYER1_ROWS,
            "worst_rows_per_ep_rank": rows_per_ep_rank}


def test_ep2_counts_the_global_batch_as_one_process_does(tmp_path, capsys, monkeypatch):
    """EP2 with activation checkpointing (its recomputation must not count again) and its --parity reference on 1
    process: the same rows per expert; EP ranks as the plan splits the experts."""
    monkeypatch.setattr(train_cli, "_launch", _forced_launch)
    run = tmp_path / "run"
    assert main(["train", "--config", "configs/tiny_cpu.toml", "--steps", "2", "--nproc", "2", "--run-dir", str(run),
                 "--parity", "parallel.etp=1", "training.activation_checkpoint=full", *SHAPE]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-3] == ("load     worst layer's max/mean rows, mean (max) over 2 steps: per expert 4.00 (4.00), "
                       "per EP rank 1.75 (1.75)")
    assert out[-1].endswith(": metrics.jsonl, summary.json, loss.png, load.png, parity.json, reference_1proc/")
    assert [_load(r) for r in _rows(run)] == [_want([1.3333, 1.75], [336, 48])] * 2
    assert [_load(r) for r in _rows(run / "reference_1proc")] == [_want([1.0, 1.0], [384])] * 2
    summary = json.loads((run / "summary.json").read_text())
    assert summary["load"] == {"steps": 2, "worst_expert_imbalance": {"mean": 4.0, "max": 4.0},
                               "worst_ep_imbalance": {"mean": 1.75, "max": 1.75}}
    assert (run / "load.png").stat().st_size > 1000 and (run / "reference_1proc" / "load.png").is_file()


@pytest.mark.parametrize("mesh", [
    # 2 microbatches; layer 1 (the worst) lives on the second stage, not rank 0's
    ["parallel.pp=2", "parallel.pp_schedule=gpipe", "parallel.etp=1"],
    ["parallel.dp_replicate=2", "parallel.cp=2", "parallel.etp=1"],  # HSDP2 x CP2 x EP2: each rank half sequences
    ["parallel.tp=2", "parallel.etp=2"],  # TP2 (sequence parallel) x EP2 x ETP2
])
def test_every_mesh_counts_the_global_batch(tmp_path, monkeypatch, mesh):
    monkeypatch.setattr(train_cli, "_launch", _forced_launch)
    run = tmp_path / "run"
    assert main(["train", "--config", "configs/tiny_cpu.toml", "--steps", "1", "--nproc", "4", "--run-dir", str(run),
                 *mesh, *SHAPE]) == 0
    assert [_load(r) for r in _rows(run)] == [_want([1.3333, 1.75], [336, 48])]


@pytest.mark.parametrize("overrides, world", [
    ({"ep": 2, "etp": 2}, 8),  # EDP2 x EP2 x ETP2: ETP and EDP split inside an EP rank's experts
    ({"ep": 4, "etp": 1}, 4),
    ({"ep": 2, "etp": 1, "pp": 2, "dp_replicate": 2}, 8),  # per stage: HSDP2 x EP2
    ({"ep": 1, "etp": 2}, 2),
])
def test_experts_are_owned_by_the_ep_rank_the_plan_names(overrides, world):
    cfg = load_config("configs/tiny_cpu.toml").model.moe_config()
    dims = MoEParallelDims(world, **overrides)
    per_rank = cfg.num_experts // dims.ep
    assert expert_ep_ranks(cfg, dims) == [e // per_rank for e in range(cfg.num_experts)]


def test_worst_layer_is_the_ep_straggler_then_the_expert_imbalance():
    # (expert, EP-rank) imbalance per layer
    assert int(worst_layer(torch.tensor([[4.0, 1.2], [2.0, 1.5], [3.0, 1.5]]))) == 2  # EP first, then experts
    assert int(worst_layer(torch.tensor([[1.5, 1.0], [2.5, 1.0], [2.5, 1.0]]))) == 1  # EP1: experts, then lower
    assert int(worst_layer(torch.tensor([[0.0, 0.0], [1.5, 1.0]]))) == 1  # another stage's layer (0) never wins


def test_load_summary_means_and_maxima_over_steps():
    rows = [{"worst_expert_imbalance": a, "worst_ep_imbalance": b} for a, b in ((2.0, 1.5), (4.0, 1.0), (3.0, 1.25))]
    assert load_summary(rows) == {"steps": 3, "worst_expert_imbalance": {"mean": 3.0, "max": 4.0},
                                  "worst_ep_imbalance": {"mean": 1.25, "max": 1.5}}
