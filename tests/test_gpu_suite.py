"""tests/gpu/gpu_suite.py's CPU smoke: the suite's machinery (cases, the parity check on a device, Hugging Face
training against transformers, the JSON) on gloo CPU ranks, so a broken suite shows before a GPU session."""

import json
import subprocess
import sys

import pytest
import torch


def test_gpu_suite_runs_its_cases_on_cpu(tmp_path):
    out = tmp_path / "suite.json"
    proc = subprocess.run([sys.executable, "tests/gpu/gpu_suite.py", "--device", "cpu", "--only", "layer_ep2_bf16",
                           "hf_mixtral_1rank", "--out", str(out), "--run-root", str(tmp_path / "runs")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert [c["name"] for c in report["cases"]] == ["layer_ep2_bf16", "hf_mixtral_1rank"]
    assert all(c["passed"] and 0 <= c["max_rel_err"] <= c["tol"] for c in report["cases"]), report["cases"]
    assert "Warning" not in proc.stdout + proc.stderr


def test_calls_of_one_date_merge_into_one_report(tmp_path):
    """--merge: a second call's rows replace the same-named rows of the first call's report of the same date and
    device and keep its others, in the suite's order; a report of another date is not merged."""
    import time
    from types import SimpleNamespace

    import gpu_suite

    every = [gpu_suite.SuiteCase(name, "", 1, "gloo", None) for name in ("a", "b", "c")]
    out = tmp_path / "suite.json"
    args = SimpleNamespace(merge=True, out=str(out), device="cpu")
    row = dict(passed=True, max_rel_err=0.0, tol=0.0)
    rows = [{"name": "c", **row}, {"name": "a", **row, "max_rel_err": 1.0}]
    first = gpu_suite._report(args, rows, time.perf_counter(), gpu_suite._earlier(args), every)
    assert first["calls"] == 1 and first["not_run"] == ["b"]
    out.write_text(json.dumps(first))
    second = gpu_suite._report(args, [{"name": "a", **row}, {"name": "b", **row}], time.perf_counter(),
                               gpu_suite._earlier(args), every)
    assert [c["name"] for c in second["cases"]] == ["a", "b", "c"] and second["calls"] == 2
    assert second["cases"][0]["max_rel_err"] == 0.0 and second["not_run"] == []
    out.write_text(json.dumps({**first, "date": "2000-01-01T00:00:00+00:00"}))
    assert gpu_suite._earlier(args) is None
    assert gpu_suite._earlier(SimpleNamespace(merge=False, out=str(out), device="cpu")) is None


def test_check_scripts_run_in_a_process_of_their_own(tmp_path):
    """The check_* cases' runner finds the script beside the suite and raises its failure with its output; here the
    failure is the missing CUDA device (the cases themselves run on CUDA only)."""
    import gpu_suite

    if torch.cuda.is_available():
        pytest.skip("the script would pass here")
    with pytest.raises(RuntimeError, match="(?s)gpu_pad_check.py exited with status 1: .*CUDA"):
        gpu_suite._check_script("gpu_pad_check.py", str(tmp_path / "pad.json"))
