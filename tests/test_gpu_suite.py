"""benchmarks/gpu_suite.py's CPU smoke: the suite's machinery (cases, the parity check on a device, Hugging Face
training against transformers, the JSON) on gloo CPU ranks, so a broken suite shows before a GPU session."""

import json
import subprocess
import sys


def test_gpu_suite_runs_its_cases_on_cpu(tmp_path):
    out = tmp_path / "suite.json"
    proc = subprocess.run([sys.executable, "benchmarks/gpu_suite.py", "--device", "cpu", "--only", "layer_ep2_bf16",
                           "hf_mixtral_1rank", "--out", str(out), "--run-root", str(tmp_path / "runs")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert [c["name"] for c in report["cases"]] == ["layer_ep2_bf16", "hf_mixtral_1rank"]
    assert all(c["passed"] and 0 <= c["max_rel_err"] <= c["tol"] for c in report["cases"]), report["cases"]
    assert "Warning" not in proc.stdout + proc.stderr
