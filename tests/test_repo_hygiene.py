"""What git tracks stays small: no raw benchmark dumps, traces or other big files in the repository. And it
stands alone: no path outside the checkout, no lab notebook (sessions, issue numbers, commits) in the library.

Sizes are those of the blobs in the index (what the next commit records), not of the working tree.
"""

import os
import re
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_BYTES = 200 * 1024
# Data the package ships on purpose (the training corpora); still capped, so a bigger file is a decision.
ALLOWED_PREFIXES = ("dtensor_moe/corpus/", "dtensor_moe/titan_data/")
ALLOWED_MAX_BYTES = 2 * 1024 * 1024
# benchmarks/results/ and tests/gpu/results/ keep small summary JSON files only (benchmarks/RESULTS.md cites them);
# raw per-run logs, text captures and profiler traces stay on the machine that made them (see .gitignore).
RESULTS_DIRS = ("benchmarks/results/", "tests/gpu/results/")
RESULTS_MAX_BYTES = 20 * 1024


def _tracked_sizes() -> dict[str, int]:
    if shutil.which("git") is None:
        pytest.skip("git not installed")
    ls = subprocess.run(["git", "ls-files", "-s", "-z"], cwd=ROOT, capture_output=True, text=True)
    if ls.returncode != 0:
        pytest.skip(f"not a git checkout: {ls.stderr.strip()}")
    blobs = {}
    for entry in filter(None, ls.stdout.split("\0")):
        meta, path = entry.split("\t", 1)
        mode, obj, _stage = meta.split()
        if mode != "160000":  # submodules have no blob
            blobs[path] = obj
    check = subprocess.run(
        ["git", "cat-file", "--batch-check=%(objectname) %(objectsize)"],
        cwd=ROOT, input="\n".join(blobs.values()) + "\n", capture_output=True, text=True, check=True,
    )
    size_of = dict(line.split() for line in check.stdout.splitlines() if not line.endswith("missing"))
    return {path: int(size_of[obj]) for path, obj in blobs.items() if obj in size_of}


def _kib(n: int) -> str:
    return f"{n / 1024:.0f} kB"


def test_no_big_tracked_files():
    sizes = _tracked_sizes()
    too_big = {
        p: n for p, n in sizes.items()
        if n > (ALLOWED_MAX_BYTES if p.startswith(ALLOWED_PREFIXES) else MAX_BYTES)
    }
    listing = "\n".join(f"  {_kib(n):>8}  {p}" for p, n in sorted(too_big.items(), key=lambda kv: -kv[1]))
    assert not too_big, (
        f"tracked files over {_kib(MAX_BYTES)} ({_kib(ALLOWED_MAX_BYTES)} under {', '.join(ALLOWED_PREFIXES)}); "
        f"untrack them (git rm --cached) or, for data the package needs, extend ALLOWED_PREFIXES:\n{listing}"
    )


def test_benchmark_results_hold_only_small_summaries():
    sizes = _tracked_sizes()
    bad = {
        p: n for p, n in sizes.items()
        if p.startswith(RESULTS_DIRS) and (not p.endswith(".json") or n > RESULTS_MAX_BYTES)
    }
    listing = "\n".join(f"  {_kib(n):>8}  {p}" for p, n in sorted(bad.items()))
    assert not bad, (
        f"{' and '.join(RESULTS_DIRS)} track only summary .json files of at most {_kib(RESULTS_MAX_BYTES)}; raw "
        f"per-run dumps (logs, text captures, traces, full benchmark dumps) stay untracked:\n{listing}"
    )


# The library states the why of its current design; the lab notebook (which session measured what, issue numbers,
# commits) lives in git history and benchmarks/RESULTS.md. Ordinals too ("the fifth session").
NOTEBOOK = re.compile(r"\b(?:session|issue) \d+|\b(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth)"
                      r" session\b|\bcommit [0-9a-f]{7,40}\b", re.IGNORECASE)
# A path outside the repository that no clone has (a scratch directory beside the checkout).
OUTSIDE_PATH = re.compile(r"\.\./shared\b")


def _listed_files() -> list[str]:
    """Tracked files and untracked ones git does not ignore (what a commit could add), as paths under ROOT."""
    if shutil.which("git") is None:
        pytest.skip("git not installed")
    ls = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                        capture_output=True, text=True)
    if ls.returncode != 0:
        pytest.skip(f"not a git checkout: {ls.stderr.strip()}")
    return sorted({p for p in ls.stdout.split("\0") if p and os.path.isfile(os.path.join(ROOT, p))})


def _matches(paths, pattern) -> list[str]:
    hits = []
    for path in paths:
        with open(os.path.join(ROOT, path), encoding="utf-8", errors="replace") as f:
            for n, line in enumerate(f, 1):
                if pattern.search(line):
                    hits.append(f"  {path}:{n}: {line.strip()[:160]}")
    return hits


def test_library_cites_no_sessions_issues_or_commits():
    library = [p for p in _listed_files() if p.startswith("dtensor_moe/") and p.endswith((".py", ".md"))]
    hits = _matches(library, NOTEBOOK)
    assert not hits, ("dtensor_moe/ comments and docstrings cite sessions, issue numbers or commits; say what was "
                      "measured (or point to benchmarks/) instead:\n" + "\n".join(hits))


def test_no_paths_outside_the_repository():
    text = [p for p in _listed_files() if p.endswith((".py", ".md", ".sh", ".toml", ".txt", ".cfg", ".yml", ".yaml"))
            or "." not in os.path.basename(p)]
    hits = _matches(text, OUTSIDE_PATH)
    assert not hits, ("files cite the shared/ directory beside the checkout, which no clone has; say what was "
                      "measured or point to what benchmarks/ holds:\n" + "\n".join(hits))
