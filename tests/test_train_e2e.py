"""benchmarks/train_e2e.py on CPU with tiny models of its three families (float32, gloo): every row trains and
the JSON is sound, ours' first-step loss is transformers' (same seed, same weights), rows merge across runs, and a
row's process that does not finish is that row's error. Nothing is timed."""

import json
import math

import pytest
import torch

from benchmarks import train_e2e

OURS = ["eager", "compiled", "selective_ac", "rounding", "fp8", "chunked_loss"]
# Options whose first step computes what transformers' model does (rounding and fp8 change the experts' math;
# chunked_loss sums the same loss chunk by chunk).
SAME_MATH = {"eager", "compiled", "selective_ac", "chunked_loss"}
ROW_FIELDS = {"model", "impl", "option", "tokens_per_s", "mfu", "peak_gib", "loss_step1", "step_ms", "params", "layers",
              "seq_len", "batch"}


@pytest.fixture(autouse=True)
def one_thread(monkeypatch):
    """One CPU thread a process (this one and the rows' own): the suite's two test processes share the cores, and
    oversubscribed threads slowed these tests several times over."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _run(out, *argv):
    tiny = ["--device", "cpu", "--tiny", "--compile-backend", "aot_eager", "--steps", "1"]
    return train_e2e.main([*tiny, "--out", str(out), *argv])


@pytest.mark.parametrize("model", list(train_e2e.MODELS))
def test_family_rows(model, tmp_path):
    out = tmp_path / "e2e.json"
    _run(out, "--in-process", "--models", model, "--impls", "transformers", "--options", "grouped_mm")
    res = _run(out, "--in-process", "--models", model, "--impls", "dtensor_moe", "--options", *OURS)
    assert json.loads(out.read_text()) == json.loads(json.dumps(res))
    assert {"date", "torch", "transformers", "device", "dense_peak_tflops", "rows"} <= set(res)
    rows = {(r["impl"], r["option"]): r for r in res["rows"]}
    assert set(rows) == {("transformers", "grouped_mm")} | {("dtensor_moe", o) for o in OURS}
    ref = rows["transformers", "grouped_mm"]
    for (impl, option), r in rows.items():
        assert "error" not in r, (impl, option, r.get("error"))
        assert ROW_FIELDS <= set(r), (impl, option)
        assert all(math.isfinite(r[k]) and r[k] > 0 for k in ("tokens_per_s", "mfu", "peak_gib", "loss_step1"))
        assert (r["params"], r["flops_per_token"]) == (ref["params"], ref["flops_per_token"])
        assert r["vs_transformers"] == r["tokens_per_s"] / ref["tokens_per_s"]
        tol = 1e-5 if option in SAME_MATH else 5e-2
        assert r["loss_step1"] == pytest.approx(ref["loss_step1"], rel=tol), (impl, option)


def test_flops_per_token_of_mla():
    """The tiny DeepSeek-V3 (MLA, shared experts) counted by hand: 2 layers, D 64, 4 heads, kv_lora_rank 32, qk
    16 + 8 RoPE, v 16, 8 experts of F 32 top-2, 2 shared (one MLP of F 64), V 256, 32 positions."""
    import transformers

    cfg = train_e2e.hf_config("deepseek", 2, tiny=True)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    D, H, F, V, L = 64, 4, 32, 256, 32
    attention = D * H * 24 + D * (32 + 8) + 32 * H * (16 + 16) + H * 16 * D  # q, kv_a (+ rope key), kv_b, o
    per_layer = attention + 8 * D + 2 * 3 * D * F + 3 * D * 2 * F  # + router, 2 routed experts, shared experts
    expected = 6 * (2 * per_layer + V * D) + 3 * 2 * L * H * (24 + 16)
    assert train_e2e.flops_per_token(model, cfg, L) == expected


def test_isolated_rows_merge_and_time_out(tmp_path):
    out = tmp_path / "e2e.json"
    out.write_text(json.dumps({"rows": [
        # another model's row: kept
        {"model": "qwen3", "impl": "dtensor_moe", "option": "eager", "tokens_per_s": 1.0, "mfu": 0.5, "peak_gib": 1.0,
         "loss_step1": 12.0},
        {"model": "mixtral", "impl": "transformers", "option": "grouped_mm", "error": "an older run's"},  # replaced
    ]}))
    # Two rows in processes of their own, the second started while the first trains; compiled takes grouped_mm,
    # the only (so fastest) transformers implementation in the table.
    _run(out, "--models", "mixtral", "--impls", "transformers", "--options", "grouped_mm", "compiled")
    res = _run(out, "--models", "mixtral", "--impls", "dtensor_moe", "--options", "eager", "--row-timeout-s", "1")
    rows = {(r["model"], r["impl"], r["option"]): r for r in res["rows"]}
    assert set(rows) == {("qwen3", "dtensor_moe", "eager"), ("mixtral", "transformers", "grouped_mm"),
                         ("mixtral", "transformers", "compiled"), ("mixtral", "dtensor_moe", "eager")}
    assert rows["qwen3", "dtensor_moe", "eager"]["tokens_per_s"] == 1.0
    for option in ("grouped_mm", "compiled"):
        r = rows["mixtral", "transformers", option]
        assert "error" not in r and math.isfinite(r["loss_step1"]) and r["tokens_per_s"] > 0, r
    assert rows["mixtral", "transformers", "compiled"]["experts_implementation"] == "grouped_mm"
    timed_out = rows["mixtral", "dtensor_moe", "eager"]
    assert "timed out after 1 s" in timed_out["error"] and timed_out["vs_transformers"] is None


def test_two_depths_give_the_per_layer_time(tmp_path):
    """--depths: every row at both depths (the optimizer step timed on its own), and a projection per (model, impl,
    option) from the shallowest and deepest rows: projected to the deeper depth itself, it is that row's tokens/s
    and MFU (the algebra is exact there)."""
    import depths

    res = _run(tmp_path / "e2e.json", "--in-process", "--models", "qwen3", "--impls", "transformers", "dtensor_moe",
               "--options", "grouped_mm", "eager", "--depths", "1", "2", "--warmup", "0")
    rows = {(r["impl"], r["layers"]): r for r in res["rows"]}
    assert set(rows) == {(impl, n) for impl in ("transformers", "dtensor_moe") for n in (1, 2)}
    assert all("error" not in r and r["optimizer_ms"] > 0 for r in rows.values()), rows
    assert {(p["impl"], p["depths"]) for p in res["projections"]} == {("transformers", (1, 2)),
                                                                      ("dtensor_moe", (1, 2))}
    for p in res["projections"]:
        assert p["real_depth"] == 48 and all(math.isfinite(p[k]) for k in ("per_layer_ms", "fixed_ms"))
        a, b = rows[p["impl"], 1], rows[p["impl"], 2]
        at_b = depths.project(b["batch"] * b["seq_len"], (1, 2), (a["tokens_per_s"], b["tokens_per_s"]),
                              (a["flops_per_token"], b["flops_per_token"]), 2, b["dense_peak_tflops"] * 1e12)
        assert at_b["projected_tokens_per_s"] == pytest.approx(b["tokens_per_s"], rel=1e-9)
        assert at_b["projected_mfu"] == pytest.approx(b["mfu"], rel=1e-9)
    with pytest.raises(ValueError, match="--depths needs two different positive layer counts"):
        train_e2e.parse_args(["--depths", "2", "2"])
