"""The GPU benchmarks run end to end on 2 gloo CPU ranks with tiny shapes and write sound JSON.

Nothing is timed here: this checks the scripts (meshes, numerics check, baseline parsing, byte
accounting) so a GPU run is not spent discovering a bug."""

import contextlib
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import routing

from .harness import _as_torchrun_rank, _free_port, run_on_ranks, torchrun_on_ranks

ROOT = Path(__file__).resolve().parents[1]


def torchrun(script: str, *args: str, nproc: int = 2):
    """The script as `torchrun --nproc-per-node=N` starts it, its ranks run on the harness's pools (a real
    torchrun's fresh processes would spend most of the test importing torch)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(ROOT / "benchmarks" / script), *args]
    assert torchrun_on_ranks(cmd) == 0


def test_moe_layer_smoke(tmp_path):
    titan = tmp_path / "titan.log"
    # A baseline line in titan_anchor.py's format: the ratio column must be computed from it.
    titan.write_text("titan0.3.0 EP=2 D=64 F=32 E=8 K=2 T/rank=64: fwd+bwd 1.00 ms, 7 TFLOP/s/GPU, 1 tok/s/GPU\n")
    out = tmp_path / "moe_layer.json"
    torchrun("moe_layer.py", "--device", "cpu", "--shapes", "tiny", "--iters", "1", "--warmup", "0",
             "--titan-log", str(titan), "--out", str(out))
    res = json.loads(out.read_text())
    rows = {r["mesh"]: r for r in res["rows"]}
    assert set(rows) == {"ep2", "etp2", "edp2", "local"}
    for mesh, r in rows.items():
        assert r["ms"] > 0 and r["tflops"] > 0, mesh
        assert ("profile" in r) == (mesh in ("ep2", "local")), mesh  # the default --profile-meshes
        assert max(r["numerics"].values()) < 3e-2, (mesh, r["numerics"])
        assert set(r["numerics"]) == {"out", "grad:x", "grad:w13", "grad:w2"}
    for mesh in ("ep2", "etp2", "edp2"):
        assert rows[mesh]["ratio"] == 1.00 / rows[mesh]["ms"] and rows[mesh]["step_ms"] > 0
    assert rows["local"]["ratio"] is None  # no EP=1 baseline line given
    assert (
        rows["ep2"]["profile"]["top"] and rows["ep2"]["a2a_ceiling_gbps"] > 0 and "a2a_ceiling_gbps" not in rows["edp2"]
    )
    assert any(t["what"] == "bf16 numerics max rel err" and t["ok"] for t in res["targets"])
    # The FP8 dispatch payload on the same routing (seeded): its token rows cross as D + 4 bytes against bf16's 2D.
    fp8_out = tmp_path / "moe_layer_fp8.json"
    torchrun("moe_layer.py", "--device", "cpu", "--shapes", "tiny", "--meshes", "ep2", "--iters", "1", "--warmup", "0",
             "--profile-meshes", "--dispatch-precision", "fp8", "--out", str(fp8_out))
    (fp8_row,) = json.loads(fp8_out.read_text())["rows"]
    assert fp8_row["dispatch_precision"] == "fp8" and max(fp8_row["numerics"].values()) < 0.2
    bf16_sent, fp8_sent = rows["ep2"]["sent_bytes"], fp8_row["sent_bytes"]
    # Per step, "rows there" is the dispatch's tokens and the combine's gradient (same rows); FP8 only the first.
    assert fp8_sent["rows there"] * 2 == bf16_sent["rows there"]
    assert fp8_sent["rows:fp8 there"] / fp8_sent["rows there"] == (64 + 4) / (2 * 64)
    # Token rounding: the rows (and GEMM columns) are the rounded counts, the numerics those of the rounded layer.
    round_out = tmp_path / "moe_layer_round.json"
    torchrun("moe_layer.py", "--device", "cpu", "--shapes", "tiny", "--meshes", "local", "--iters", "1", "--warmup",
             "0", "--profile-meshes", "--round-tokens-to", "8", "--out", str(round_out))
    (round_row,) = json.loads(round_out.read_text())["rows"]
    assert round_row["round_tokens_to"] == 8 and round_row["rows_max"] % 8 == 0 and round_row["kept_pairs"] <= 1
    assert max(round_row["numerics"].values()) < 3e-2, round_row["numerics"]


# E64's K=6: tokens straddle permutations; K = E (the deepseek_ep32 proxy) and E = 1: every token to every expert.
@pytest.mark.parametrize("T, E, K", [(64, 8, 2), (96, 64, 6), (10, 7, 3), (64, 8, 8), (10, 1, 1)])
def test_routing_modes(T, E, K):
    exact = routing.expert_choices_TK("exact", T, E, K, seed=0)
    counts_E = torch.bincount(exact.flatten(), minlength=E)
    assert counts_E.max() == -(-T * K // E) and counts_E.min() == T * K // E
    skewed = routing.expert_choices_TK("skewed", T, E, K, seed=0, zipf=1.2)
    assert torch.equal(skewed, routing.expert_choices_TK("skewed", T, E, K, seed=0, zipf=1.2))
    if E > 1:  # with one expert there is one draw
        assert not torch.equal(skewed, routing.expert_choices_TK("skewed", T, E, K, seed=1, zipf=1.2))
    with torch.device("meta"):  # a default device does not move the draws (the numerics check runs under cuda's)
        assert torch.equal(skewed, routing.expert_choices_TK("skewed", T, E, K, seed=0, zipf=1.2))
        assert torch.equal(exact, routing.expert_choices_TK("exact", T, E, K, seed=0))
    skewed_E = torch.bincount(skewed.flatten(), minlength=E)
    if K < E:
        assert skewed_E.argmax() == routing.popularity_E(E, 1.2).argmax()
    else:  # no choice left to skew
        assert (skewed_E == T).all()
    for mode in routing.MODES:
        _, weights_TK, experts_TK = routing.routed_inputs(0, T, 4, E, K, "cpu", torch.bfloat16, mode)
        assert experts_TK.shape == weights_TK.shape == (T, K)
        assert (experts_TK.sort(-1).values.diff(dim=-1) != 0).all(), mode  # K distinct experts per token


def _stdout_of_torchrun_rank(rank, world_size, *task):
    """The harness's torchrun rank, with what it printed (titan_anchor.py's result lines, on rank 0)."""
    with contextlib.redirect_stdout(io.StringIO()) as out:
        code = _as_torchrun_rank(rank, world_size, *task)
    return code, out.getvalue()


def test_routing_smoke(tmp_path):
    """torchtitan's anchor and our layer in every routing mode on the same choices: the same rows per expert, a
    baseline for each row."""
    modes = ["--routing", *routing.MODES, "--zipf", "1.2"]
    args = ["64", "32", "8", "2", "64", "1", *modes]
    results = run_on_ranks(2, _stdout_of_torchrun_rank, ("path", str(ROOT / "benchmarks" / "titan_anchor.py")), args,
                           dict(os.environ), _free_port())
    assert [code for code, _ in results] == [0, 0]
    titan = tmp_path / "titan.log"
    titan.write_text(results[0][1])
    loads = {m[0]: (float(m[1]), int(m[2])) for m in re.findall(
        r"(routing=\w+(?: zipf=[\d.]+)?): .* rows/expert mean ([\d.]+) max (\d+)", results[0][1])}
    assert set(loads) == {"routing=topk", "routing=exact", "routing=skewed zipf=1.2"}
    out = tmp_path / "moe_layer.json"
    torchrun("moe_layer.py", "--device", "cpu", "--shapes", "tiny", "--meshes", "ep2", "local", "--iters", "1",
             "--warmup", "0", "--profile-meshes", "--gemm-timing", *modes, "--titan-log", str(titan), "--out", str(out))
    rows = {(r["mesh"], r["routing"]): r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {(mesh, mode) for mesh in ("ep2", "local") for mode in routing.MODES}
    for (mesh, mode), r in rows.items():
        assert r["zipf"] == (1.2 if mode == "skewed" else None)
        assert r["rows_mean"] == (2 if mesh == "ep2" else 1) * 64 * 2 / 8
        assert r["rows_max_over_mean"] == r["rows_max"] / r["rows_mean"]
        assert r["vs_topk"] == rows[(mesh, "topk")]["ms"] / r["ms"]
        if mesh == "ep2":  # torchtitan's EP=2 lines: its counts are ours, its ratio is on them
            assert loads[routing.describe(mode, 1.2)] == (r["rows_mean"], r["rows_max"])
            assert r["ratio"] == r["titan_ms"] / r["ms"] and r["titan_vs_topk"] is not None
        else:  # the GEMMs alone at the routed counts
            assert r["ratio"] is None and all(r[f"{g}_tflops"] > 0 for g in ("fwd", "dgrad", "wgrad"))
    assert rows[("ep2", "exact")]["rows_max_over_mean"] == 1.0
    assert rows[("ep2", "skewed")]["rows_max_over_mean"] > rows[("ep2", "topk")]["rows_max_over_mean"]


def test_ep_proxy_smoke(tmp_path):
    """An EP-rank proxy at tiny size (tiny_ep4: tiny's 8 experts over EP 4, 2 a rank, K = E = 2) and torchtitan's
    anchor at its D F E K T, as run_routing.sh runs them with SHAPES=proxies: the same rows per expert (T*K*EP/E)
    on both sides, the row named as a proxy, in every routing mode."""
    from benchmarks import moe_layer

    assert moe_layer.SHAPES["tiny_ep4"] == (64, 32, 2, 2, 64)
    assert moe_layer.SHAPES["deepseek_ep8"] == (7168, 2048, 32, 8, 8192)  # 2048 rows an expert
    assert moe_layer.shape_names(["proxies"]) == ["deepseek_ep8", "deepseek_ep32", "qwen_ep8", "e64_ep8"]
    modes = ["--routing", *routing.MODES, "--zipf", "1.2"]
    anchor = ("path", str(ROOT / "benchmarks" / "titan_anchor.py"))
    ((code, printed),) = run_on_ranks(1, _stdout_of_torchrun_rank, anchor, ["64", "32", "2", "2", "64", "1", *modes],
                                      dict(os.environ), _free_port())
    assert code == 0
    titan = tmp_path / "titan.log"
    titan.write_text(printed)
    out = tmp_path / "moe_layer.json"
    torchrun("moe_layer.py", "--device", "cpu", "--shapes", "tiny_ep4", "--meshes", "local", "--iters", "1",
             "--warmup", "0", "--profile-meshes", *modes, "--titan-log", str(titan), "--out", str(out), nproc=1)
    rows = json.loads(out.read_text())["rows"]
    assert [r["routing"] for r in rows] == list(routing.MODES)
    for r in rows:
        assert (r["shape"], r["ep_proxy"], r["proxy_of"], r["E"], r["K"]) == ("tiny_ep4", 4, "tiny", 2, 2)
        assert r["rows_mean"] == r["rows_max"] == 64 * 2 * 4 / 8  # every token to both local experts
        assert re.search(rf"T/rank=64 {routing.describe(r['routing'], 1.2)}: .* rows/expert mean 64 max 64 ", printed)
        assert r["ratio"] == r["titan_ms"] / r["ms"] and r["bars"] == {}
    # The bars of a proxy are judged on its one-GPU layer, a model shape's on EP=2 only.
    proxy = {**rows[0], "shape": "deepseek_ep8", "ratio": 1.5, "pct_dense_peak": 79.0}
    proxy["bars"] = moe_layer.bars(proxy)
    assert proxy["bars"] == {"ratio": 1.4, "pct_dense_peak": 80.0}
    assert [(t["what"], t["ok"]) for t in moe_layer.targets([proxy])[:2]] == [
        ("deepseek_ep8 local / titan", True), ("deepseek_ep8 local % dense peak", False)]
    assert moe_layer.bars({**rows[0], "shape": "deepseek", "ep_proxy": None}) == {}


def test_memory_smoke(tmp_path):
    out = tmp_path / "memory.json"
    torchrun("memory.py", "--device", "cpu", "--shape", "64", "32", "8", "2", "--tokens", "16", "--out", str(out))
    res = json.loads(out.read_text())
    lay = res["layouts"]
    assert set(lay) == {"ep_only", "edp_only"} and "target" not in res  # 2 ranks, ep=2: no EP+EDP layout
    assert lay["ep_only"]["dims"]["ep"] == 2 and lay["edp_only"]["dims"]["edp"] == 2
    D, F, E = 64, 32, 8
    per_rank = (3 * E * F * D + E * D) // 2  # experts and router, each halved over 2 ranks
    for r in lay.values():
        assert r["param_bytes"] == 4 * per_rank, r
        assert r["grad_bytes"] == r["param_bytes"]
        assert r["optim_bytes"] >= 2 * r["param_bytes"]  # AdamW: exp_avg and exp_avg_sq (+ step)


def test_replica_balance_smoke():
    """benchmarks/replica_balance.py's ranks on 2 gloo ranks, tiny: rows per EP rank covering every pair, float64
    parity with and without replicas, the folding search's figure beside each row; the replicas even the rows out."""
    from benchmarks import replica_balance as rb
    from dtensor_moe.tools.folding import max_over_mean

    args = rb.parser().parse_args(["--experts", "8", "--ep", "2", "--top-k", "2", "--tokens-per-rank", "32",
                                   "--replicas", "1", "--batches", "2"])
    rows = rb.results(args, 2, run_on_ranks(2, rb.measure_rank, args, 2)[0])
    assert [(r["replicas"], r["batch"]) for r in rows] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    for r in rows:
        assert sum(r["rows_per_rank"]) == 2 * 32 * 2 and r["max_over_mean"] == max_over_mean(r["rows_per_rank"])
        assert max(r["max_abs_err_out"], r["max_abs_err_grad"]) <= rb.PARITY_TOL, r
        assert r["predicted_max_over_mean"] == max_over_mean(r["predicted_rows_per_rank"]) >= 1
    assert all(r["max_over_mean"] < w["max_over_mean"] for w, r in zip(rows[::2], rows[1::2]))
    print("\n" + "\n".join(f"r={r['replicas']} batch {r['batch']}: {r['rows_per_rank']} {r['max_over_mean']:.3f} "
                           f"(predicted {r['predicted_max_over_mean']:.3f})" for r in rows))


@pytest.mark.parametrize("E, N", [(5, 300), (5, 20), (5, 5000), (1, 700)])
def test_small_tile_groups_compute_the_same_grouped_gemm(E, N):
    # ragged_gemm_probe.small_tile_groups: expert e's rows in group G*e, the others empty strided views of the same
    # weights, at most 128 mean rows per group; the grouped product over them equals the one over the experts.
    from benchmarks.ragged_gemm_probe import small_tile_groups

    def grouped(x, w, ends):
        return torch.cat([x[a:b] @ w[g] for g, (a, b) in enumerate(zip([0, *ends[:-1].tolist()], ends.tolist()))])

    gen = torch.Generator().manual_seed(E * N)
    ends = torch.multinomial(torch.ones(E), N, replacement=True, generator=gen).bincount(minlength=E).cumsum(0)
    x = torch.randn(N, 16, dtype=torch.float64, generator=gen)
    w = torch.randn(E, 8, 16, dtype=torch.float64, generator=gen)
    for w_EIO in (w.transpose(-2, -1), w.transpose(-2, -1).contiguous()):
        small = small_tile_groups(w_EIO, ends, N)
        if E == 1 and N > 128:  # no room for empty groups after the only expert
            assert small is None
            continue
        w_small, ends_small = small
        assert N <= 128 * w_small.shape[0]
        assert w_small.untyped_storage().data_ptr() == w_EIO.untyped_storage().data_ptr()  # views, no copy
        torch.testing.assert_close(grouped(x, w_small, ends_small), grouped(x, w_EIO, ends), rtol=0, atol=0)


def test_titan_e2e_smoke(tmp_path):
    """benchmarks/titan_e2e.py on CPU ranks at the hook's tiny DeepSeek-V3 (2 steps, its 1 and 2 layers, eager;
    torchtitan alone and our experts, each a torchrun of ~10 s): torchtitan's own step lines parsed, the same first
    loss in both rows (one seed), the projection made."""
    pytest.importorskip("torchtitan")
    import subprocess

    out = tmp_path / "e2e.json"
    proc = subprocess.run([sys.executable, "benchmarks/titan_e2e.py", "--model", "deepseek_v3_debugmodel_cpu",
                           "--device", "cpu", "--backend", "gloo", "--seq", "32", "--steps", "2", "--warmup", "1",
                           "--modes", "eager", "--rows", "titan", "hook_ours", "--out", str(out)],
                          cwd=Path(__file__).parents[1], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert {c["row"] for c in result["cases"]} == {"titan", "hook_ours"}
    first = {(c["depth"], c["row"]): c["per_step"][0]["loss"] for c in result["cases"]}
    for depth in (1, 2):
        assert len({loss for (d, _), loss in first.items() if d == depth}) == 1, first
    assert all(c["tps"] > 0 for c in result["cases"]) and all(result["projections"].values())
    assert "| hook_ours | eager | none | 2 | 2 |" in proc.stdout  # batch 2, depth 2


def _imports_before_checkout(path: Path) -> list[str]:
    """The module-level imports of this checkout's code (dtensor_moe, tests, tools) that come before
    `import _checkout`."""
    import ast

    early = []
    for node in ast.parse(path.read_text()).body:
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
            [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
        if "_checkout" in names:
            return early
        early += [n for n in names if n.split(".")[0] in ("dtensor_moe", "tests", "tools")]
    return early


def test_scripts_run_without_the_package_installed(tmp_path):
    """`python benchmarks/<script>.py` (or tests/gpu/, tools/tune/) from a clone where dtensor_moe is not installed
    (the GPU machine): every script that imports this checkout's code does so after its folder's `_checkout` puts the
    checkout on sys.path, and train_e2e.py, the GPU suite and a tuner run (`--help`) under `python -S`, which leaves
    out the editable install's .pth, with only torch's site-packages on PYTHONPATH."""
    scripts = sorted(p for folder in ("benchmarks", "tests/gpu", "tools/tune") for p in (ROOT / folder).glob("*.py"))
    late = {str(p.relative_to(ROOT)): _imports_before_checkout(p) for p in scripts}
    assert not {name: early for name, early in late.items() if early}, late
    site = str(Path(torch.__file__).parents[1])
    env = {**os.environ, "PYTHONPATH": site}
    find = "import importlib.util as u; print(u.find_spec('dtensor_moe'))"
    probe = subprocess.run([sys.executable, "-S", "-c", find], cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=60)
    assert probe.stdout.strip() == "None", probe  # the package is not importable there, so the next line proves it
    for script in ("benchmarks/train_e2e.py", "tests/gpu/gpu_suite.py", "tools/tune/wgrad_probe.py"):
        run = subprocess.run([sys.executable, "-S", str(ROOT / script), "--help"], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == 0 and "usage:" in run.stdout, (script, run.stderr[-2000:])
