"""`dtensor-moe plan`: memory against real sharded runs, node geometry against the meshes, scale."""

import contextlib
import io
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from dtensor_moe.cli.plan import resolve
from dtensor_moe.config import MoERunOptions
from dtensor_moe.parallel.mesh import EXPERT_AXES, PP_STAGES_PER_RANK, MoEParallelDims
from dtensor_moe.parallel.placement import plan_moe, rank_coords
from dtensor_moe.tools import folding as P
from dtensor_moe.tools.presets import PRESETS, TITAN_MODELS, ModelShape, shape_from_model_config

from .harness import run_on_ranks

ROOT = Path(__file__).resolve().parents[1]
# Odd vocab (250) and small dims so FSDP pads some shards and some ranks hold less than others.
TINY = dict(vocab_size=250, dim=24, n_layers=2, n_heads=4, num_experts=4, top_k=2, hidden_dim=20,
            num_shared_experts=1)
FP32 = P.Workload(seq_len=8, micro_batch=2, dtype="float32")


def _spec(model: str) -> ModelShape:
    """A preset's ModelShape (`resolve` also gives how the MoE layers run: a preset runs the defaults)."""
    spec, run = resolve(model)
    assert run == MoERunOptions(), (model, run)
    return spec


def _measure_states(rank, world, model_kwargs, dims_kwargs, schedule="1f1b"):
    """Sharded bytes of params, grads and AdamW state on this rank after one real training step
    (with pp > 1: a pipeline step of 2 microbatches, the main job's Pipeline)."""
    import torch
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor

    from dtensor_moe.train.config import ModelConfig
    from dtensor_moe.train.model import MoETransformer
    from dtensor_moe.train.parallel.parallelize_transformer import parallelize_transformer
    from dtensor_moe.train.parallel.pipeline import Pipeline, stage_view

    torch.manual_seed(0)
    cfg = ModelConfig(**model_kwargs)
    dims = MoEParallelDims(world, **dims_kwargs)
    tokens = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(rank))
    if dims.pp > 1:
        pipe = Pipeline(MoETransformer(cfg), dims.build_meshes("cpu").pp, schedule, 2, 2, 8, 8, torch.float32,
                        torch.device("cpu"), lambda m: parallelize_transformer(m, dims, device_type="cpu"))
        pipe.step(tokens[:, :-1], tokens[:, 1:])
        model = stage_view(pipe.parts)
    else:
        model = parallelize_transformer(MoETransformer(cfg), dims, device_type="cpu")
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt.step()

    def nbytes(t):
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size()

    params = list(model.parameters())
    assert all(p.grad is not None for p in params)
    return {
        "params": sum(nbytes(p) for p in params),
        "grads": sum(nbytes(p.grad) for p in params),
        "optimizer": sum(nbytes(v) for s in opt.state.values() for v in s.values() if torch.is_tensor(v)),
    }


MESHES = [
    (4, dict(ep=4)),
    (4, dict(ep=2, etp=2)),
    (4, dict(dp_replicate=2, ep=2)),
    (8, dict(ep=2, etp=2)),  # EDP2 x EP2 x ETP2
    (8, dict(ep=4)),  # EDP2 x EP4: one expert per EP rank, so EDP shards D
    (8, dict(cp=2, ep=2, etp=2)),  # dense weights shard over dp_shard_cp
    (4, dict(tp=2, ep=2)),  # attention, embedding, head split over tp; norms replicated; router over dp_shard_tp
]


PP_MESHES = [  # uneven stages (3 layers over 2; 5 over 2 x 2 interleaved): stage 0 holds more, the last the head
    (4, dict(pp=2, ep=2), "1f1b", 3),
    (4, dict(pp=2, ep=1, etp=2), "interleaved_1f1b", 5),
]


@pytest.mark.parametrize("world,dims_kwargs,schedule,n_layers", PP_MESHES, ids=[s for _, _, s, _ in PP_MESHES])
def test_pipeline_state_memory_matches_measured(world, dims_kwargs, schedule, n_layers):
    """The main job's summary.json prediction (predicted_state_bytes) per rank of a real pp=2 step:
    each rank holds its stages' layers, sharded over its stage's ranks."""
    from dtensor_moe.train.config import ModelConfig

    kw = {**TINY, "n_layers": n_layers}
    measured = run_on_ranks(world, _measure_states, kw, dims_kwargs, schedule)
    dims = MoEParallelDims(world, **dims_kwargs)
    for rank, got in enumerate(measured):
        want = P.predicted_state_bytes(ModelConfig(**kw), dims, rank, pp_schedule=schedule)
        assert want == got, (rank, want, got)
    assert measured[0]["params"] != measured[-1]["params"]  # the stages differ (so the split is what was checked)
    print(f"\n{world} ranks {dims_kwargs} {schedule}: exact on every rank; bytes {[m['params'] for m in measured]}")


@pytest.mark.parametrize("world,dims_kwargs", MESHES,
                         ids=[f"{w}-{'-'.join(f'{k}{v}' for k, v in d.items())}" for w, d in MESHES])
def test_state_memory_matches_measured(world, dims_kwargs):
    from dtensor_moe.train.config import ModelConfig

    measured = run_on_ranks(world, _measure_states, TINY, dims_kwargs)
    dims = MoEParallelDims(world, **dims_kwargs)
    spec = shape_from_model_config(ModelConfig(**TINY))
    units = P.fsdp_units(spec, dims)
    tensors = sum(u.count * len(u.plans) for u in units)
    worst = 0.0
    for rank, got in enumerate(measured):
        held = P.held_numel(units, dims, rank)
        want = dict(zip(("params", "grads", "optimizer"), P.state_bytes(held, tensors, FP32)))
        for k in want:
            err = abs(want[k] - got[k]) / got[k]
            worst = max(worst, err)
            assert err < 0.05, (rank, k, want[k], got[k])
    # The enumeration path (rank 0's footprint) is the same number as rank 0's owned boxes.
    fp = P.footprint(units, dims)
    assert P.state_bytes(fp.held, fp.tensors, FP32) == P.state_bytes(P.held_numel(units, dims, 0), tensors, FP32)
    print(f"\n{world} ranks {dims_kwargs}: max relative error {worst:.2%}; rank 0 bytes {measured[0]}")


def test_spec_matches_model_parameters():
    import torch

    from dtensor_moe.train.config import ModelConfig
    from dtensor_moe.train.model import MoETransformer

    for kw in (TINY, {**TINY, "tie_embeddings": True, "num_shared_experts": 0}):
        cfg = ModelConfig(**kw)
        with torch.device("meta"):
            model = MoETransformer(cfg)
        units = P.fsdp_units(shape_from_model_config(cfg), MoEParallelDims(1))
        assert P.held_numel(units, MoEParallelDims(1), 0) == sum(p.numel() for p in model.parameters())
        assert sum(u.count * len(u.plans) for u in units) == len(list(model.parameters()))


@pytest.mark.parametrize("name,total", [("deepseek-v3-671b", 671e9), ("qwen3-235b-a22b", 235e9),
                                        ("qwen3-30b-a3b", 30.5e9), ("mixtral-8x7b", 46.7e9)])
def test_preset_parameter_counts(name, total):
    dims = MoEParallelDims(1)
    n = P.held_numel(P.fsdp_units(PRESETS[name], dims), dims, 0)
    assert abs(n - total) / total < 0.005, n


def _brute_group(dims, axis, rank=0):
    """Ranks sharing every expert-mesh coordinate but `axis` with `rank`, straight from rank_coords."""
    axes = EXPERT_AXES if axis in EXPERT_AXES else ("dp_replicate", "dp_shard", "cp")
    me = rank_coords(dims, rank)
    return [r for r in range(dims.world_size) if all(rank_coords(dims, r)[a] == me[a] for a in axes if a != axis)]


@pytest.mark.parametrize("G", [4, 8, 6])
def test_node_fractions_match_rank_placement(G):
    for kw in (dict(ep=8), dict(ep=4, etp=2), dict(dp_replicate=2, ep=2, etp=4), dict(cp=2, ep=4),
               dict(dp_replicate=4, ep=2)):
        for world in (64, 48):
            try:
                d = MoEParallelDims(world, **kw)
            except ValueError:
                continue
            geo = P.mesh_geometry(d)
            for axis in ("ep", "etp", "edp", "dp_replicate", "cp", "dp_shard"):
                group = _brute_group(d, axis)
                size, stride = geo[axis]
                assert group == [j * stride for j in range(size)], (kw, axis)
                nodes = [r // G for r in group]
                on_node = nodes.count(nodes[0])
                want_pair = (on_node - 1) / (size - 1) if size > 1 else 0.0
                assert P.pairwise_intra_fraction(size, stride, G) == pytest.approx(want_pair)
                hops = sum(nodes[i] != nodes[(i + 1) % size] for i in range(size))
                assert P.ring_inter_fraction(size, stride, G) == pytest.approx(hops / size if size > 1 else 0.0)


def test_rates_node_fractions_follow_the_mesh_geometry():
    """Rates takes each group's (size, stride) from the degrees, not mesh_geometry: they must agree;
    foldings sharing a rates_key share their Rates."""
    spec, G = _spec("mixtral-8x7b"), 4
    work = _work("gpipe", 1, seq_len=64)
    seen = {}
    for dims in P.foldings(32, spec, work, G):
        assert replace(dims) == dims  # the search's foldings pass MoEParallelDims' checks
        r, geo = P.rates(spec, dims, work, G), P.mesh_geometry(dims)
        assert seen.setdefault(P.rates_key(dims), r) == r, dims  # the search's memo on rates_key is sound
        assert (r.ep_inter, r.etp_inter) == tuple(1 - P.pairwise_intra_fraction(*geo[a], G) for a in ("ep", "etp"))
        assert (r.tp_inter, r.cp_inter) == tuple(P.ring_inter_fraction(*geo[a], G) for a in ("tp", "cp"))
        assert r.send_inter == P.chain_inter_fraction(*geo["pp"], G)
    assert len(seen) < len(list(P.foldings(32, spec, work, G)))


def test_footprint_key_covers_what_the_plan_reads():
    """Foldings that share a footprint key get the same footprint from a fresh plan (the memo is sound):
    no CostCache, so every folding's weights are planned anew."""
    spec = _spec("qwen3-30b-a3b")
    seen = {}
    for dims in P.foldings(256, spec, P.Workload(seq_len=64)):
        fp = P.footprint(P.fsdp_units(spec, dims), dims)
        assert seen.setdefault(P.footprint_key(dims), fp) == fp, dims
    assert len(seen) > 20


def test_rank_foldings_puts_fitting_candidates_first_and_explains():
    spec, work = _spec("mixtral-8x7b"), P.Workload(seq_len=4096)
    hw = P.Hardware(gpus=64, gpus_per_node=8, gpu_mem_gib=80)
    cands = P.rank_foldings(spec, work, hw)
    fits = [c for c in cands if c.fits]
    assert fits and len(fits) < len(cands)
    assert all(c.memory.total <= 80 * P.GiB for c in fits)
    keys = [c.time_per_token for c in fits]
    assert keys == sorted(keys)
    for c in cands:  # every candidate is a folding plan_moe accepts
        plan_moe(spec.moe, c.dims)
        assert c.dims.edp * c.dims.ep * c.dims.etp == c.dims.dp_shard * c.dims.cp * c.dims.tp
    best = fits[0]
    # Within one node every byte stays intra-node.
    if best.dims.ep * best.dims.etp <= 8:
        assert best.comm["ep_all_to_all"].inter == 0
    text = P.explain_choice(spec, best, fits[1], hw)
    assert f"ep={best.dims.ep}, etp={best.dims.etp}, edp={best.dims.edp}" in text
    # More memory per GPU never removes a fitting candidate.
    more = P.rank_foldings(spec, work, P.Hardware(gpus=64, gpus_per_node=8, gpu_mem_gib=141))
    assert sum(c.fits for c in more) >= len(fits)


def test_comm_model_limits():
    """A single rank sends nothing; EP traffic grows with top_k; ETP inside a node is intra-only."""
    spec = _spec("qwen3-30b-a3b")
    work = P.Workload(seq_len=1024)
    one = P.evaluate(spec, MoEParallelDims(1), work, P.Hardware(1, 8, 80))
    assert one.intra == one.inter == 0
    c = P.evaluate(spec, MoEParallelDims(64, ep=8, etp=2), work, P.Hardware(64, 8, 80))
    assert c.comm["etp_gather_scatter"].inter == 0 and c.comm["etp_gather_scatter"].intra > 0
    assert c.comm["ep_all_to_all"].inter > 0  # EP groups have stride 2, so 8 of them span 2 nodes


def test_bad_inputs_name_the_constraint():
    with pytest.raises(ValueError, match="dtype must be one of"):
        P.Workload(dtype="fp8")
    with pytest.raises(ValueError, match="deepseek-v3-671b"):
        resolve("no-such-model")
    with pytest.raises(ValueError,
                       match=r"Hardware\.gpus must be <= gpus_per_node or a multiple of gpus_per_node \(8\), got 12"):
        P.Hardware(gpus=12, gpus_per_node=8)


MIXTRAL = _spec("mixtral-8x7b")
NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("make,field,valid", [
    (lambda: P.Hardware(64, gpu_mem_gib=0), "Hardware.gpu_mem_gib", "a finite number > 0, got 0"),
    (lambda: P.Hardware(64, gpu_mem_gib=-80.0), "Hardware.gpu_mem_gib", "a finite number > 0"),
    (lambda: P.Hardware(64, intra_bw=0), "Hardware.intra_bw", "a finite number > 0"),
    (lambda: P.Hardware(64, inter_bw=NAN), "Hardware.inter_bw", "a finite number > 0, got nan"),
    (lambda: P.Hardware(64, inter_bw=INF), "Hardware.inter_bw", "a finite number > 0, got inf"),
    (lambda: P.Hardware(64, gpu_mem_gib=True), "Hardware.gpu_mem_gib", "a finite number > 0, got True"),
    (lambda: P.Hardware(64, gpu_mem_gib="80"), "Hardware.gpu_mem_gib", "a finite number > 0, got '80'"),
    (lambda: P.Hardware(64.0), "Hardware.gpus", "an int >= 1, got 64.0"),
    (lambda: P.Hardware(True), "Hardware.gpus", "an int >= 1, got True"),
    (lambda: P.Hardware(64, gpus_per_node=0), "Hardware.gpus_per_node", "an int >= 1, got 0"),
    (lambda: P.Hardware(64, gpus_per_node=8.0), "Hardware.gpus_per_node", "an int >= 1, got 8.0"),
    (lambda: P.Workload(seq_len=4096.0), "Workload.seq_len", "an int >= 1, got 4096.0"),
    (lambda: P.Workload(seq_len=0), "Workload.seq_len", "an int >= 1, got 0"),
    (lambda: P.Workload(micro_batch=True), "Workload.micro_batch", "an int >= 1, got True"),
    (lambda: P.Workload(dtype=None), "Workload.dtype", "one of ['bf16', 'float32'], got None"),
    (lambda: P.Workload(optimizer="lion"), "Workload.optimizer", "one of ['adamw', 'sgd'], got 'lion'"),
    (lambda: P.Workload(activation_checkpoint=True), "Workload.activation_checkpoint",
     "one of ['full', 'none'], got True"),
    (lambda: P.Workload(skew=-0.5), "Workload.skew", ">= 0, got -0.5"),
    (lambda: P.Workload(skew=INF), "Workload.skew", "a finite number >= 0, got inf"),
    (lambda: replace(MIXTRAL, n_layers=0), "ModelShape.n_layers", "an int >= 1, got 0"),
    (lambda: replace(MIXTRAL, n_layers=32.0), "ModelShape.n_layers", "an int >= 1, got 32.0"),
    (lambda: replace(MIXTRAL, vocab_size=True), "ModelShape.vocab_size", "an int >= 1, got True"),
    (lambda: replace(MIXTRAL, moe=None), "ModelShape.moe", "a dtensor_moe.config.MoEConfig, got None"),
    # The MoE fields are MoEConfig's, checked by it alone.
    (lambda: replace(MIXTRAL, moe=replace(MIXTRAL.moe, dim=4096.0)), "MoEConfig.dim", "an int >= 1, got 4096.0"),
    (lambda: replace(MIXTRAL, moe=replace(MIXTRAL.moe, num_shared_experts=-1)), "MoEConfig.num_shared_experts",
     ">= 0, got -1"),
    (lambda: replace(MIXTRAL, n_dense_layers=33), "ModelShape.n_dense_layers", "an int in 0..32, got 33"),
    (lambda: replace(MIXTRAL, n_dense_layers=1), "ModelShape.dense_hidden_dim", "an int >= 1, got 0"),
    (lambda: replace(MIXTRAL, kv_width=0), "ModelShape.kv_width", "an int >= 1, got 0"),
    (lambda: replace(MIXTRAL, tie_embeddings=1), "ModelShape.tie_embeddings", "a bool, got 1"),
    (lambda: replace(MIXTRAL, name=""), "ModelShape.name", "a non-empty string, got ''"),
    (lambda: replace(MIXTRAL, attention=list(MIXTRAL.attention)), "ModelShape.attention",
     "a tuple of (weight name, shape)"),
    (lambda: replace(MIXTRAL, attention=(("wq", (0, 8)),)), "ModelShape.attention", "got entry ('wq', (0, 8))"),
])
def test_input_dataclasses_name_the_field_and_range(make, field, valid):
    """Types and ranges are checked at construction; booleans are not ints, floats not ints."""
    with pytest.raises(ValueError) as e:
        make()
    msg = str(e.value)
    assert msg.startswith(f"{field} must be ") and valid in msg and "\n" not in msg, msg


def _cli(argv):
    from dtensor_moe.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("flag,value,valid", [
    ("--intra-bw", "0", "a finite number > 0, got 0.0"),
    ("--inter-bw", "0", "a finite number > 0, got 0.0"),
    ("--inter-bw", "-50", "a finite number > 0, got -50.0"),
    ("--intra-bw", "nan", "a finite number > 0, got nan"),
    ("--inter-bw", "inf", "a finite number > 0, got inf"),
    ("--gpu-mem", "0", "a finite number > 0, got 0.0"),
    ("--gpu-mem", "-1", "a finite number > 0, got -1.0"),
    ("--gpus-per-node", "0", "an int >= 1, got 0"),
    ("--gpus-per-node", "-8", "an int >= 1, got -8"),
    ("--seq-len", "0", "an int >= 1, got 0"),
    ("--micro-batch", "0", "an int >= 1, got 0"),
    ("--top", "-3", "an int >= 1, got -3"),
    ("--top", "0", "an int >= 1, got 0"),
    ("--microbatches", "0", "an int >= 1, got 0"),
    ("--pp", "-1", "an int >= 0, got -1"),
    ("--skew", "-1", "a finite number >= 0 (0: balanced routing), got -1.0"),
    ("--skew", "nan", "a finite number >= 0 (0: balanced routing), got nan"),
    ("--replicas", "-1", "an int in 0..num_experts (8 for mixtral-8x7b; MoERunOptions.expert_replicas' range), got -1"),
    ("--replicas", "9", "an int in 0..num_experts (8 for mixtral-8x7b; MoERunOptions.expert_replicas' range), got 9"),
])
def test_plan_cli_rejects_bad_flags_in_one_line(flag, value, valid):
    """Zero bandwidths used to divide by zero, `--top -3` silently dropped rows: now rc 2 and one line."""
    rc, out, err = _cli(["plan", "--model", "mixtral-8x7b", "--gpus", "64", flag, value])
    assert rc == 2 and out == ""
    assert err == f"dtensor-moe plan: {flag} must be {valid}\n", err


@pytest.mark.parametrize("name", TITAN_MODELS)
def test_plan_prices_the_torchtitan_hooks_configs(name):
    """`--model` takes the `--config` names of `--module dtensor_moe.titan` (their presets equal torchtitan's models:
    tests/test_titan_configs.py)."""
    rc, out, err = _cli(["plan", "--model", name, "--gpus", "64", "--top", "2"])
    lines = out.splitlines()
    assert rc == 0 and err == "" and lines[0].startswith(f"{name} on 64 GPUs"), out
    header = next(i for i, line in enumerate(lines) if line.startswith("# pp |"))
    assert [line[:1] for line in lines[header + 1:header + 3]] == ["1", "2"], out


def test_plan_cli_bad_model_is_one_line_of_valid_names():
    rc, out, err = _cli(["plan", "--model", "deepseek_v3_7b", "--gpus", "64"])
    assert rc == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith("dtensor-moe plan: unknown model 'deepseek_v3_7b'; valid: presets ['deepseek-v3-671b', "), err
    assert f"torchtitan configs {list(TITAN_MODELS)} (--module dtensor_moe.titan --config)" in err, err


def test_plan_cli_gpus_flag():
    rc, _, err = _cli(["plan", "--model", "mixtral-8x7b", "--gpus", "0"])
    assert rc == 2 and err == "dtensor-moe plan: --gpus must be an int >= 1, got 0\n"
    rc, out, _ = _cli(["plan", "--model", "mixtral-8x7b", "--gpus", "64", "--top", "1"])
    rows = [l for l in out.splitlines() if l.strip()[:1].isdigit() and "|" in l]
    assert rc == 0 and len(rows) == 1


def test_folding_package_layout_and_torch_free():
    """The cost model is one module per concept, each importing only those before it (no cycles);
    the package re-exports their names; planning a preset from the CLI, a torchtitan config's too, imports
    neither torch nor the training code (with skewed routing and replicas too)."""
    import ast
    import importlib

    from dtensor_moe.cli import SUBCOMMANDS
    from dtensor_moe.tools.folding import (
        cache,
        geometry,
        memory,
        pipeline,
        predicted_state_bytes,
        report,
        search,
        skew,
        tokens,
        traffic,
        units,
        workload,
    )

    assert predicted_state_bytes is memory.predicted_state_bytes
    assert P.rank_foldings is search.rank_foldings and P.explain_choice is report.explain_choice
    assert P.Workload is workload.Workload and P.Hardware is workload.Hardware
    assert P.mesh_geometry is geometry.mesh_geometry
    assert P.pipeline_ranks is pipeline.pipeline_ranks and P.Footprint is units.Footprint
    assert P.Rates is tokens.Rates and P.distinct_ranks is tokens.distinct_ranks
    assert P.Memory is memory.Memory and P.Traffic is traffic.Traffic and P.CostCache is cache.CostCache
    assert P.balance is skew.balance and P.Balance is skew.Balance
    assert all(getattr(P, name) is not None for name in P.__all__)
    order = ["cache", "workload", "skew", "geometry", "pipeline", "units", "tokens", "memory", "traffic", "search",
             "report"]
    pkg = ROOT / "dtensor_moe" / "tools" / "folding"
    assert sorted(order + ["__init__"]) == sorted(p.stem for p in pkg.glob("*.py"))
    for i, name in enumerate(order):
        tree = ast.parse((pkg / f"{name}.py").read_text())
        modules = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        modules |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        siblings = {m.rsplit(".", 1)[-1] for m in modules if m.startswith("dtensor_moe.tools.folding.")}
        assert siblings <= set(order[:i]), (name, siblings - set(order[:i]))
        # Memo tables are a CostCache's, made per search: no functools caches at module level.
        assert "functools" not in modules and "lru_cache" not in (pkg / f"{name}.py").read_text(), name
        importlib.import_module(f"dtensor_moe.tools.folding.{name}")
    mod = __import__(SUBCOMMANDS["plan"][0], fromlist=["run"])
    assert callable(mod.add_arguments) and callable(mod.run)
    code = ("import sys, io, contextlib; from dtensor_moe.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    assert main(['plan', '--model', 'qwen3-30b-a3b', '--gpus', '64']) == 0\n"
            "    assert main(['plan', '--model', 'deepseek_v3_671b', '--gpus', '64']) == 0\n"
            "    assert main(['plan', '--model', 'mixtral-8x7b', '--gpus', '64', '--skew', '1.2', '--replicas', '2'])"
            " == 0\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch' or m.startswith('dtensor_moe.train')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[]", out.stdout


def test_config_toml(tmp_path):
    path = tmp_path / "tiny.toml"
    path.write_text("[model]\n" + "\n".join(f"{k} = {v}" for k, v in TINY.items()) + "\n[train]\nsteps = 3\n")
    spec, run = resolve(str(path))
    assert spec.vocab_size == 250 and spec.moe.num_shared_experts == 1 and spec.name == "tiny"
    assert run == MoERunOptions()  # no [moe_run]: the defaults
    path.write_text(path.read_text() + "[moe_run]\nexpert_replicas = 2\nactivation_memory = \"standard\"\n")
    spec_run, run = resolve(str(path))
    assert spec_run == spec and run == MoERunOptions(expert_replicas=2, activation_memory="standard")
    path.write_text("[model]\nbogus = 1\n")
    with pytest.raises(ValueError, match="unknown \\[model\\] keys"):
        resolve(str(path))
    path.write_text("[model]\ntop_k = 2\n[moe_run]\nactivation_memory = \"least\"\n")
    # The main job's reading of [moe_run] (train.config.build_section): its keys as the file names them.
    with pytest.raises(ValueError, match=r"tiny\.toml: moe_run\.activation_memory must be one of "
                                         r"\['standard', 'minimal'\], got 'least'"):
        resolve(str(path))
    path.write_text("[model]\ntop_k = 2\n[moe_run]\nreplicas = 1\n")
    with pytest.raises(ValueError, match=r"tiny\.toml: unknown \[moe_run\] keys \['replicas'\]; valid keys: \["):
        resolve(str(path))


def test_malformed_config_toml_names_the_file_and_line(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[model]\ndim = 64\nn_heads = 4e\n")
    rc, out, err = _cli(["plan", "--model", str(path), "--gpus", "8"])
    assert rc == 2 and out == ""
    assert err.startswith(f"dtensor-moe plan: config file '{path}' is not valid TOML: ") and "(at line 3" in err, err


def _fake_pg_main(rank: int):
    """Runs in a fresh process: the fake process group at 16,384 ranks, meshes, plan and ownership."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from dtensor_moe.parallel.placement import ownership

    world = 16384
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    spec, work = _spec("deepseek-v3-671b"), P.Workload()
    hw = P.Hardware(world, 8, 141)
    best = next(c for c in P.rank_foldings(spec, work, hw) if c.fits).dims
    report = {}
    for dims in (best, MoEParallelDims(world, dp_replicate=4, cp=2, ep=64, etp=4)):
        t0 = time.perf_counter()
        meshes = dims.build_meshes("cpu")
        t_mesh = time.perf_counter() - t0
        assert tuple(meshes.expert.shape) == dims.expert_shape and tuple(meshes.dense.shape) == dims.dense_shape
        assert tuple(meshes.expert.get_coordinate()) == tuple(dims.expert_coords(rank).values())
        geo = P.mesh_geometry(dims)
        for axis in ("dp_replicate", "edp", "ep", "etp"):  # the search's groups are the real process groups
            size, stride = geo[axis]
            base = rank - dims.expert_coords(rank)[axis] * stride
            group = dist.get_process_group_ranks(meshes.expert.get_group(axis))
            assert group == [base + j * stride for j in range(size)]
        t0 = time.perf_counter()
        if dims == best:  # every element of every MoE weight held dp_replicate times: O(world) per weight
            for wp in plan_moe(spec.moe, dims):
                assert ownership(wp, dims).copies == dims.dp_replicate
        t_own = time.perf_counter() - t0
        c = P.evaluate(spec, dims, work, hw)
        report[str(dims.expert_shape)] = {"mesh_s": t_mesh, "ownership_s": t_own, "mem_gib": c.memory.total / P.GiB}
    dist.destroy_process_group()
    print(json.dumps(report))


def test_fake_process_group_16k():
    code = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); "
            "from tests.test_folding_search import _fake_pg_main; _fake_pg_main(12345)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(report) == 2
    print("\nfake PG, 16384 ranks:", report)


def test_plan_cli_16k():
    """The CLI at 16,384 GPUs: its table and choice (its time is benchmarks/folding_search_speed.py's)."""
    cmd = [sys.executable, "-m", "dtensor_moe.cli", "plan", "--model", "deepseek-v3-671b", "--gpus", "16384",
           "--gpus-per-node", "8", "--gpu-mem", "141"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    header = next(i for i, l in enumerate(lines) if "edp" in l and "etp" in l and " ep " in l)
    rows = [l for l in lines[header + 1 :] if l.strip()[:1].isdigit()]
    assert len(rows) == 10 and rows[0].split()[0] == "1"
    assert "Top choice: ep=" in out.stdout


def test_plan_json():
    import contextlib
    import io

    from dtensor_moe.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        argv = ["plan", "--model", "qwen3-30b-a3b", "--gpus", "64", "--gpu-mem", "80", "--json", "--top", "3"]
        assert main(argv) == 0
    data = json.loads(buf.getvalue())
    assert data["enumerated"] >= data["fitting"] > 0 and len(data["candidates"]) == 3
    c = data["candidates"][0]
    assert c["fits"] and c["edp"] * c["ep"] * c["etp"] == c["dp_shard"] * c["cp"]
    assert math.isclose(c["memory_bytes"]["total"], sum(v for k, v in c["memory_bytes"].items() if k != "total"))


def test_distinct_ranks_matches_sampled_routing():
    """The dispatch's rows per token (the search's all-to-all volume) against uniform top-k draws."""
    import torch

    from dtensor_moe.tools.folding import distinct_ranks

    g = torch.Generator().manual_seed(0)
    for E, K, ep in [(16, 4, 4), (256, 8, 2), (8, 2, 2), (6, 6, 3)]:
        experts_TK = torch.rand(20000, E, generator=g).topk(K, -1).indices
        ranks_per_token = torch.zeros(20000, ep).scatter_(1, experts_TK // (E // ep), 1.0).sum(1)
        assert abs(ranks_per_token.mean().item() - distinct_ranks(E, K, ep)) < 0.02, (E, K, ep)
    assert distinct_ranks(256, 8, 1) == 1.0
    # Group-limited: `limited` groups uniformly, then K experts uniformly among theirs; groups inside
    # ranks (8 groups / ep 4), ranks inside groups (2 / 4), one group per rank (DeepSeek-V3 at ep 8).
    for E, K, ep, G, M in [(16, 4, 4, 8, 3), (16, 3, 4, 2, 1), (256, 8, 8, 8, 4)]:
        kept_TG = torch.rand(20000, G, generator=g).argsort(-1) < M
        pool_TE = kept_TG.repeat_interleave(E // G, dim=1)
        experts_TK = torch.rand(20000, E, generator=g).masked_fill(~pool_TE, -1).topk(K, -1).indices
        ranks_per_token = torch.zeros(20000, ep).scatter_(1, experts_TK // (E // ep), 1.0).sum(1)
        assert abs(ranks_per_token.mean().item() - distinct_ranks(E, K, ep, G, M)) < 0.02, (E, K, ep, G, M)
        assert ranks_per_token.max() <= M * max(1, ep // G)
    assert distinct_ranks(256, 8, 8, 8, 4) < 4 < distinct_ranks(256, 8, 8)  # ~3.6 ranks instead of ~5.3


def test_group_limited_routing_shrinks_the_priced_all_to_all():
    spec, work = _spec("deepseek-v3-671b"), P.Workload()
    assert (spec.moe.num_expert_groups, spec.moe.num_limited_groups) == (8, 4)
    dims = MoEParallelDims(64, ep=8, etp=1)
    fp = P.footprint(P.fsdp_units(spec, dims), dims)
    grouped = P.comm_bytes(spec, dims, work, 8, fp)["ep_all_to_all"]
    ungrouped = replace(spec, moe=replace(spec.moe, num_expert_groups=1, num_limited_groups=1))
    free = P.comm_bytes(ungrouped, dims, work, 8, fp)["ep_all_to_all"]
    ratio = P.distinct_ranks(256, 8, 8, 8, 4) / P.distinct_ranks(256, 8, 8)
    assert math.isclose(grouped.intra + grouped.inter, ratio * (free.intra + free.inter))
    with pytest.raises(ValueError,
                       match=r"MoEConfig.num_experts \(256\) must be divisible by MoEConfig.num_expert_groups"):
        replace(spec.moe, num_expert_groups=3, num_limited_groups=1)


def _work(schedule, microbatches, **kw):
    return P.Workload(microbatches=microbatches, pp_schedule=schedule, **kw)


def test_pipeline_stages_schedules_and_bubble_by_hand():
    spec = _spec("deepseek-v3-671b")
    # 61 layers over 16 stages: stages 0-12 hold 4, 13-15 hold 3; the 3 dense layers lead.
    assert P.stage_share(spec, 16, "1f1b", 0) == P.StageShare(3, 1, True, False)
    assert P.stage_share(spec, 16, "1f1b", 1) == P.StageShare(0, 4, False, False)
    assert P.stage_share(spec, 16, "1f1b", 15) == P.StageShare(0, 3, False, True)
    # Interleaved pp 4: 8 stages (5 of 8 layers, 3 of 7); rank 0 holds stages 0 and 4, rank 3 stages 3 and 7.
    assert P.stage_share(spec, 4, "interleaved_1f1b", 0) == P.StageShare(3, 13, True, False)
    assert P.stage_share(spec, 4, "interleaved_1f1b", 3) == P.StageShare(0, 15, False, True)
    assert P.stage_share(spec, 1, "1f1b", 0) == P.StageShare(3, 58, True, True)
    assert [P.in_flight(_work("gpipe", 8), 4, r) for r in range(4)] == [8] * 4
    assert [P.in_flight(_work("1f1b", 8), 4, r) for r in range(4)] == [4, 3, 2, 1]
    # 2 rounds of 4; warm-up (v - 1) * 4 + 2 * (3 - r) chunks and one more, a chunk being half the rank's layers.
    assert [P.in_flight(_work("interleaved_1f1b", 8), 4, r) for r in range(4)] == [5.5, 4.5, 3.5, 2.5]
    assert P.in_flight(_work("interleaved_1f1b", 2), 4, 0) == 2  # capped at every chunk of every microbatch
    assert P.in_flight(_work("gpipe", 8), 1, 0) == 1  # accumulation without pp: one microbatch at a time
    assert P.bubble_fraction(4, _work("1f1b", 8)) == P.bubble_fraction(4, _work("gpipe", 8)) == 3 / 11
    assert P.bubble_fraction(4, _work("interleaved_1f1b", 8)) == 1.5 / 9.5
    assert P.bubble_fraction(1, _work("gpipe", 8)) == 0
    ranks = P.pipeline_ranks(spec, 4, _work("1f1b", 8))  # one per distinct share: ranks 1 and 2 hold 15 MoE layers
    assert [(r.share.layers, r.in_flight, r.sends) for r in ranks] == [(16, 4, 1), (15, 3, 2), (15, 1, 1)]


def test_pipeline_traffic_and_memory_by_hand():
    from dtensor_moe.train.config import ModelConfig

    spec = shape_from_model_config(ModelConfig(**{**TINY, "n_layers": 4}))
    T, D, V, b, M = 2 * 64, 24, 250, 2, 4
    work = _work("1f1b", M, seq_len=64, micro_batch=2)
    dims = MoEParallelDims(32, pp=4, ep=2)  # a stage of 8 ranks per node of 8: every stage boundary crosses nodes
    whole = MoEParallelDims(8, ep=2)
    comm, held, tensors = [], 0, 0
    for r in range(4):
        share = P.stage_share(spec, 4, "1f1b", r)
        assert share == P.StageShare(0, 1, r == 0, r == 3)
        rank = P.PipelineRank(share, min(M, 4 - r), 2 - (r == 0) - (r == 3))
        fp = P.footprint(P.fsdp_units(spec, dims, share, M), dims)
        c = P.comm_bytes(spec, dims, work, 8, fp, rank)
        # Hidden states (the rank's T tokens of width D) forward, their gradients back, per microbatch.
        assert c["pp_send_recv"] == P.Traffic(0, M * rank.sends * T * D * b)
        comm.append(c)
        held, tensors = held + fp.held, tensors + fp.tensors
        mem = P.rank_memory(spec, dims, work, fp, rank)
        # Every unit stays gathered with its accumulated fp32 gradient, plus one block's fresh gradient.
        assert mem.gathered == (b + 4) * (fp.gathered_root + fp.gathered_blocks) + b * fp.gathered_block
        fewer = P.activation_bytes(spec, dims, work, rank._replace(in_flight=rank.in_flight - 1))
        # One microbatch more in flight: one block input per layer (recompute), its logits on the last stage.
        assert mem.activations - fewer == T * D * b + (T * V * (b + 4) if r == 3 else 0)
    # The stages partition the model: states and per-layer traffic add up to one stage-sized pp=1 run's.
    fp1 = P.footprint(P.fsdp_units(spec, whole, None, M), whole)
    assert (held, tensors) == (fp1.held, fp1.tensors)
    c1 = P.comm_bytes(spec, whole, work, 8, fp1)
    assert sum(c["ep_all_to_all"].intra for c in comm) == pytest.approx(c1["ep_all_to_all"].intra)
    # pp=1 reduces every microbatch's gradients (and re-gathers the root), the pipeline once a step.
    assert sum(c["fsdp_reduce_scatter"].intra for c in comm) == pytest.approx(c1["fsdp_reduce_scatter"].intra / M)
    # Stages inside one node: the sends stay there.
    small = MoEParallelDims(8, pp=2, ep=2)
    share = P.stage_share(spec, 2, "1f1b", 0)
    fp = P.footprint(P.fsdp_units(spec, small, share, M), small)
    sends = P.comm_bytes(spec, small, work, 8, fp, P.PipelineRank(share, 2, 1))["pp_send_recv"]
    assert sends == P.Traffic(M * T * D * b, 0)


PLANS = P.CostCache()  # the weight plans of _exhaustive's foldings, across its searches


def _exhaustive(spec, dims, work, hw):
    """The candidate from every pipeline rank (range(pp), none skipped as dominated), each rank's footprint
    summed from its units' weight plans: what rank_foldings' memos (share_parts, footprint_key, rates_key), Rates/Held
    split and rank pruning must reproduce exactly. The plans themselves are memoized on what they read
    (test_footprint_key_covers_what_the_plan_reads plans every folding afresh)."""
    worst_mem = worst_comm = None
    for r in range(dims.pp):
        share = P.stage_share(spec, dims.pp, work.pp_schedule, r)
        sends = 2 * PP_STAGES_PER_RANK[work.pp_schedule] - (r == 0) - (r == dims.pp - 1) if dims.pp > 1 else 0
        rank = P.PipelineRank(share, P.in_flight(work, dims.pp, r), sends)
        fp = P.footprint(P.fsdp_units(spec, dims, share, work.microbatches, PLANS), dims)
        mem = P.rank_memory(spec, dims, work, fp, rank)
        comm = P.comm_bytes(spec, dims, work, hw.gpus_per_node, fp, rank)
        t = P.comm_time(comm.values(), hw)
        if worst_mem is None or mem.total > worst_mem[0].total:
            worst_mem = (mem, share)
        if worst_comm is None or t > worst_comm[1]:
            worst_comm = (comm, t)
    (mem, share), (comm, t) = worst_mem, worst_comm
    return P.Candidate(dims, mem, comm, t, P.step_tokens_per_rank(work, dims), mem.total <= hw.gpu_mem_gib * P.GiB,
                       P.bubble_fraction(dims.pp, work), share)


def test_pipeline_search():
    spec = _spec("deepseek-v3-671b")
    assert P.pipeline_degrees(16384, spec, P.Workload()) == [1]  # 1f1b needs microbatches >= pp
    assert P.pipeline_degrees(16384, spec, _work("1f1b", 16)) == [1, 2, 4, 8, 16]
    assert P.pipeline_degrees(16384, spec, _work("gpipe", 1)) == [1, 2, 4, 8, 16, 32]  # pp * 1 <= 61 layers
    assert P.pipeline_degrees(16384, spec, _work("interleaved_1f1b", 16)) == [1, 2, 4, 8, 16]  # 2 * pp <= 61
    assert P.pipeline_degrees(8, spec, _work("gpipe", 1), 8) == [1, 2, 4, 8]  # inside one node any pp
    assert P.pipeline_degrees(64, spec, _work("gpipe", 1), 16) == [1, 2, 4]  # stages of whole 16-GPU nodes
    spec, work = _spec("qwen3-30b-a3b"), _work("1f1b", 8, seq_len=1024)
    cands = P.rank_foldings(spec, work, P.Hardware(64, 8, 80))
    assert {c.dims.pp for c in cands} == {1, 2, 4, 8}
    for c in cands[:50] + [c for c in cands if c.dims.pp == 8][:5]:
        assert c.tokens == 8 * 1024 / (c.dims.cp * c.dims.tp * c.dims.pp)
        assert c.time_per_token == c.comm_time_s / (1 - c.bubble) / c.tokens
        assert c.bubble == P.bubble_fraction(c.dims.pp, work)
        # The memo's footprints are the plan's (share_parts combined per share).
        parts = P.share_parts(spec, c.dims, 8)
        for r in P.pipeline_ranks(spec, c.dims.pp, work):
            want = P.footprint(P.fsdp_units(spec, c.dims, r.share, 8), c.dims)
            assert P.share_footprint(parts, r.share) == want
    assert P.rank_foldings(spec, work, P.Hardware(64, 8, 80), pp=4) == [c for c in cands if c.dims.pp == 4]


@pytest.mark.parametrize("model,gpus,schedule,microbatches,top", [
    ("qwen3-30b-a3b", 64, "1f1b", 8, None),  # every candidate
    ("mixtral-8x7b", 32, "interleaved_1f1b", 8, None),
    ("deepseek-v3-671b", 16384, "1f1b", 16, 12),  # the 16k search's top rows
])
def test_rank_foldings_equals_exhaustive_search(model, gpus, schedule, microbatches, top):
    """Every candidate rank_foldings returns (memoized footprints and weight costs, per-folding rates, dominated
    pipeline ranks skipped) equals the one built from every pipeline rank and fresh plans, in the same
    order: the ranked table cannot change."""
    spec, work = _spec(model), _work(schedule, microbatches, seq_len=1024 if top is None else 4096)
    hw = P.Hardware(gpus, 8, 80 if top is None else 141)
    cands = P.rank_foldings(spec, work, hw)
    assert len({c.dims.pp for c in cands}) > 2
    for c in cands[:top]:
        assert c == _exhaustive(spec, c.dims, work, hw), c.dims


@pytest.mark.parametrize("argv,msg", [
    (["--pp", "3"], "--pp (3) must divide --gpus (64): pipeline stages of equal size; "
                    "valid --pp: [1, 2, 4, 8, 16, 32, 64] (or 0: try each)"),
    (["--pp", "2"], "--microbatches (1) must be >= --pp (2) for pp_schedule '1f1b'"),
    (["--pp", "64", "--microbatches", "64"],
     "model.n_layers (32) must be >= the pipeline stages (64 = --pp 64 x 1 per rank"),
    (["--pp", "2", "--pp-schedule", "interleaved_1f1b", "--microbatches", "5"],
     "--microbatches (5) must be a multiple of max(1, microbatches // pp) = 2 for pp_schedule 'interleaved_1f1b'"),
])
def test_plan_cli_pp_errors(argv, msg):
    rc, out, err = _cli(["plan", "--model", "mixtral-8x7b", "--gpus", "64", *argv])
    assert rc == 2 and out == "" and err.startswith(f"dtensor-moe plan: {msg}") and err.count("\n") == 1, err


def test_plan_cli_pp():
    mixtral = ["plan", "--model", "mixtral-8x7b", "--gpus", "64"]
    rc, out, _ = _cli([*mixtral, "--pp", "2", "--microbatches", "8", "--top", "3"])
    rows = [l.split() for l in out.splitlines() if l.strip()[:1].isdigit() and "|" in l]
    assert rc == 0 and len(rows) == 3 and all(r[1] == "2" for r in rows)
    assert "pp=2." in out and "- PP=2 outermost (1f1b, 8 microbatches): 32 ranks per stage" in out
    rc, out, _ = _cli([*mixtral, "--microbatches", "8", "--json", "--top", "400"])
    data = json.loads(out)
    assert rc == 0 and {c["pp"] for c in data["candidates"]} == {1, 2, 4, 8} and data["pp_tried"] == [1, 2, 4, 8]
    rc, out, _ = _cli(["plan", "--model", "mixtral-8x7b", "--gpus", "64", "--top", "1"])
    assert rc == 0 and "; pp tried: [1] (pp > 1 needs --microbatches >= pp under 1f1b)); " in out


# ---- skewed routing (Workload.skew, --skew) and hot-expert replicas (--replicas) ------------------------------------

DSV3_16B = _spec("deepseek_v3_16b")  # 64 experts, top-6


def test_skew_popularity_is_the_benchmarks():
    """The search's Zipf popularity, drawn without torch, is benchmarks/routing.py's (tests/parity.py's Case.zipf):
    the same seeded shuffle of the expert ids, the same weights."""
    import torch

    from benchmarks.routing import popularity_E

    for E in (1, 8, 64, 128, 256):
        assert P.popularity_order(E) == torch.randperm(E, generator=torch.Generator().manual_seed(0)).tolist()
        assert P.popularity(E, 1.2) == pytest.approx(popularity_E(E, 1.2).tolist(), rel=1e-12, abs=0)
    assert P.popularity_order(64)[0] == 44  # `--skew`'s help names it


def test_inclusion_matches_sampled_routing():
    """Expected rows per expert a token: the chance an expert is among a token's K distinct draws, against
    benchmarks/routing.py's skewed draws; one draw is the weight itself, balanced weights give K / E."""
    import torch

    from benchmarks.routing import expert_choices_TK

    T = 100_000
    for E, K in [(64, 2), (64, 6), (16, 4)]:
        pi = P.inclusion(P.popularity(E, 1.2), K)
        counts = torch.bincount(expert_choices_TK("skewed", T, E, K, seed=0, zipf=1.2).flatten(), minlength=E)
        assert sum(pi) == pytest.approx(K, abs=1e-9)
        assert max(abs(a - n / T) for a, n in zip(pi, counts.tolist())) < 0.005, (E, K)
    p = P.popularity(64, 1.2)
    assert P.inclusion(p, 1) == pytest.approx(p, abs=1e-10)
    assert P.inclusion(P.popularity(64, 0.0), 4) == pytest.approx([4 / 64] * 64, abs=1e-10)
    assert P.inclusion(p, 64) == [1.0] * 64
    assert P.inclusion(p, 4)[44] < 1 < 4 * p[44]  # tokens x top_k x weight would overshoot one row a token


def test_skewed_rows_per_ep_rank_e64_ep8():
    """E=64 over EP=8 at Zipf 1.2: rows per EP rank are the owners' contiguous blocks of the expected rows, by hand
    from benchmarks/routing.py's popularity at K=1 (one draw a token: tokens x weight), and at K=2 the max / mean
    that many sampled tokens give (tests/test_replicas.py measures 3.664 on one batch of 1024); with 2 replica
    slots a rank within 15% of the mean, the rows the same in total."""
    import torch

    from benchmarks.routing import expert_choices_TK, popularity_E

    tokens = 8 * 128
    by_hand = [sum(round(tokens * w) for w in popularity_E(64, 1.2).tolist()[q * 8:(q + 1) * 8]) for q in range(8)]
    assert list(P.balance(64, 1, 8, tokens, 1.2, 0).rows) == by_hand
    T = 200_000
    blocks = torch.bincount(expert_choices_TK("skewed", T, 64, 2, seed=0, zipf=1.2).flatten(), minlength=64)
    sampled = P.max_over_mean(blocks.view(8, 8).sum(1).tolist())
    for K, r in [(2, 2), (6, 2)]:
        b = P.balance(64, K, 8, tokens, 1.2, r)
        assert b.rows == P.balance(64, K, 8, tokens, 1.2, 0).rows
        if K == 2:
            assert b.imbalance == pytest.approx(sampled, rel=0.01), (b.imbalance, sampled)
        assert b.imbalance > 2.5 and b.replica_imbalance <= 1.15, (K, b)
        assert sum(b.replica_rows) == sum(b.rows) and b.hottest == 44
        assert all(e // 8 != q for q, row in enumerate(b.slots) for e in row if e >= 0)  # never a rank's own expert
    flat = P.balance(64, 2, 8, tokens, 0.0, 2)
    assert flat.rows == flat.replica_rows == (256,) * 8 and flat.copies == 0


def _skewed(skew: float, replicas: int, dims=MoEParallelDims(64, ep=8), spec=DSV3_16B, memory="minimal"):
    work = P.Workload(skew=skew, moe_run=MoERunOptions(expert_replicas=replicas, activation_memory=memory))
    return P.evaluate(spec, dims, work, P.Hardware(64, 8, 80))


def _total(t: P.Traffic) -> float:
    return t.intra + t.inter


def test_skew_prices_the_busiest_ep_rank():
    """Skew 0 is the balanced model; under skew the all-to-all and the routed activations are the balanced ones
    times max / mean rows per EP rank, and the step is slower; replicas bring the rows back near the mean at the
    price of their weight copies (sent to the slots each forward and again when recomputing, their gradients
    back; held with the layer's activations, their gradients while it runs backward), and the step is faster."""
    # The standard experts' activations, which replicas keep (expert_activations): the same formula both ways.
    standard = MoERunOptions(activation_memory="standard")
    r = 2  # replica slots per EP rank
    flat, skewed, replicas = (_skewed(s, n, memory="standard") for s, n in ((0, 0), (1.2, 0), (1.2, r)))
    assert flat == P.evaluate(DSV3_16B, MoEParallelDims(64, ep=8), P.Workload(moe_run=standard), P.Hardware(64, 8, 80))
    assert flat.balance is None and "replica_weights" not in flat.comm
    b = skewed.balance
    assert b.imbalance == b.replica_imbalance > 2.5
    a2a = _total(flat.comm["ep_all_to_all"])
    assert _total(skewed.comm["ep_all_to_all"]) == pytest.approx(a2a * b.imbalance, rel=1e-12)
    assert _total(replicas.comm["ep_all_to_all"]) == pytest.approx(a2a * replicas.balance.replica_imbalance, rel=1e-12)
    assert replicas.balance.replica_imbalance <= 1.15 and replicas.balance.rows == b.rows
    # By hand: 26 MoE layers, seq 4096 a rank, bf16, full recompute; a slot is w1, w2, w3 of one expert.
    T, D, F, K = 4096, DSV3_16B.dim, DSV3_16B.moe.hidden_dim, DSV3_16B.moe.top_k
    slot = 3 * F * D * 2
    assert _total(replicas.comm["replica_weights"]) == 26 * 3 * replicas.balance.copies * slot
    routed = T * 2 * K * (2 * D + 3 * F)  # one MoE layer's routed activations at the mean rows
    assert skewed.memory.activations - flat.memory.activations == pytest.approx(routed * (b.imbalance - 1))
    assert replicas.memory.activations - flat.memory.activations == pytest.approx(
        routed * (replicas.balance.replica_imbalance - 1) + 2 * r * slot)  # the r slots' copies and their gradients
    assert flat.comm_time_s < replicas.comm_time_s < skewed.comm_time_s
    # Slots without skew: held (the dispatcher allocates them), never filled under balanced routing.
    assert _skewed(0, r, memory="standard").comm["replica_weights"] == P.Traffic(0, 0)


def test_skewed_search_is_never_faster():
    """Every folding's step under skew takes at least its balanced time (equal where ep = 1); the foldings and
    their weights' costs do not change."""
    spec, work, hw = _spec("qwen3-30b-a3b"), P.Workload(seq_len=1024), P.Hardware(64, 8, 80)
    flat = {c.dims: c for c in P.rank_foldings(spec, work, hw)}
    skewed = P.rank_foldings(spec, replace(work, skew=1.2), hw)
    assert len(skewed) == len(flat)
    for c in skewed:
        f = flat[c.dims]
        assert c.comm_time_s >= f.comm_time_s and c.memory[:4] == f.memory[:4]
        assert (c.comm_time_s == f.comm_time_s) == (c.dims.ep == 1), c.dims


def test_search_with_replicas_skips_foldings_without_ep():
    """Workload.moe_run's replica slots hold other EP ranks' experts: the search ranks only ep > 1 foldings with
    them (the placement plan, the architecture's, accepts ep 1 either way), the same ones as without replicas."""
    spec, hw = _spec("mixtral-8x7b"), P.Hardware(8, 8, 80)
    work = P.Workload(seq_len=1024)
    plain = P.rank_foldings(spec, work, hw)
    with_r = P.rank_foldings(spec, replace(work, moe_run=MoERunOptions(expert_replicas=1)), hw)
    assert any(c.dims.ep == 1 for c in plain) and with_r and all(c.dims.ep > 1 for c in with_r)
    assert {c.dims for c in with_r} == {c.dims for c in plain if c.dims.ep > 1}
    with pytest.raises(ValueError,
                       match=r"Workload\.moe_run must be a dtensor_moe\.MoERunOptions, got \{'expert_replicas': 1\}"):
        P.Workload(moe_run={"expert_replicas": 1})


def test_plan_cli_skew_and_replicas():
    """--skew adds max / mean rows per EP rank (and with --replicas the same under the replicas) to every row and
    the JSON; --skew 0 prints the balanced table."""
    base = ["plan", "--model", "deepseek_v3_16b", "--gpus", "64", "--top", "4"]
    rc, out, err = _cli([*base, "--skew", "1.2", "--replicas", "2"])
    lines = out.splitlines()
    assert rc == 0 and err == "" and lines[0].endswith(", routing skew 1.2 (Zipf), 2 replica slot(s) per EP rank")
    header = next(i for i, line in enumerate(lines) if line.startswith("# pp |"))
    assert "| rows max/mean with r=2 |" in lines[header]
    for line in lines[header + 1:header + 5]:
        without, with_replicas = map(float, line.split("|")[3].split())
        assert without >= with_replicas >= 1, line
    assert "- Skewed routing (1.2, hottest expert 44): the busiest EP rank computes " in out
    rc, out, _ = _cli([*base, "--skew", "1.2", "--replicas", "2", "--json"])
    data = json.loads(out)
    assert rc == 0 and data["replicas"] == 2 and data["workload"]["skew"] == 1.2
    for c in data["candidates"]:
        rows = c["ep_rows"]
        assert len(rows["rows_per_rank"]) == len(rows["replica_rows_per_rank"]) == len(rows["replica_slots"]) == c["ep"]
        assert rows["max_over_mean"] == P.max_over_mean(rows["rows_per_rank"]) >= rows["replica_max_over_mean"]
        assert ("replica_weights" in c["comm_bytes"]) and rows["hottest_expert"] == 44
    flat = _cli(base)[1].splitlines()
    assert _cli([*base, "--skew", "0"])[1].splitlines()[2:] == flat[2:]  # all but the planning time
    rc, out, _ = _cli([*base, "--skew", "1.2"])
    assert rc == 0 and "| rows max/mean |" in out and "with r=" not in out and "replica slot" not in out


@pytest.mark.parametrize("ep,etp", [(1, 1), (8, 1), (4, 2)])
def test_minimal_activation_memory_prices_pre_activations_and_received_rows(ep, etp):
    """activation_memory "minimal": per token the MoE layer's routed experts keep top_k * 2F (the gate / up
    pre-activation) plus, under EP x ETP, each received token row once (etp * D per EP rank it reaches), where
    "standard" keeps top_k * (2 etp D + 3F); everything else in the layer is unchanged."""
    spec = PRESETS["deepseek-v3-671b"]
    minimal = P.Workload(seq_len=4096, activation_checkpoint="none")  # the default
    assert minimal.moe_run.activation_memory == "minimal"
    work = replace(minimal, moe_run=MoERunOptions(activation_memory="standard"))
    dims = MoEParallelDims(64, ep=ep, etp=etp)
    T, b, k, D, F = 4096, 2, spec.moe.top_k, spec.dim, spec.moe.hidden_dim
    routing = spec.moe.num_experts, k, ep, spec.moe.num_expert_groups, spec.moe.num_limited_groups
    received = 0 if ep * etp == 1 else etp * D * P.distinct_ranks(*routing)
    per_layer = P.rates(spec, dims, work).moe_layer - P.rates(spec, dims, minimal).moe_layer
    assert per_layer == pytest.approx(T * b * (k * (2 * etp * D + 3 * F) - (k * 2 * F + received)))
    # The whole model's estimate drops by that much per MoE layer, nothing else.
    drop = P.activation_bytes(spec, dims, work) - P.activation_bytes(spec, dims, minimal)
    assert drop == pytest.approx(spec.n_moe_layers * per_layer)
