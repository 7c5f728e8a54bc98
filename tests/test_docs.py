"""Every fenced block of README.md and docs/*.md runs as written or says why not, and the files and
modules the docs name exist (the rules: CONTRIBUTING.md, "Documentation").

Python blocks, and the ranks `dtensor-moe train` starts, run on the harness's pools: a fresh torchrun
would spend seconds of CPU importing torch per rank, and the whole doc test has about a minute. Each
page runs in a scratch directory of its own (with `configs/` and an empty `docs/`), so relative
outputs stay out of the checkout and a page's later blocks read what its earlier ones wrote.
"""

import os
import re
import shlex
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

from .harness import torchrun_on_ranks

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# And the READMEs of the script folders, whose tables give each script's command.
NAMING_PAGES = [*PAGES, ROOT / "CONTRIBUTING.md",
                *(ROOT / folder / "README.md" for folder in ("benchmarks", "tests/gpu", "tools/tune"))]
LANGS = ("python", "bash", "text", "toml")
NOT_RUN = re.compile(r"<!--\s*not run:\s*(\S.*?)\s*-->")
TORCHRUN = re.compile(r"<!--\s*run:\s*torchrun\s+(\d+)\s*-->")
FENCE = re.compile(r"^(\s*)```(.*)$")

# Runs a doc block (a file, or the module a launcher starts) inside the page's scratch directory. Pool
# workers outlive the task, so the working directory goes back afterwards.
SHIM = """\
import os, runpy, sys
cwd, kind, name, *args = sys.argv[1:]
back, sys.argv = os.getcwd(), [name, *args]
os.chdir(cwd)
try:
    if kind == "module":
        runpy.run_module(name, run_name="__main__", alter_sys=True)
    else:
        runpy.run_path(name, run_name="__main__")
finally:
    os.chdir(back)
"""


@dataclass(frozen=True)
class Block:
    page: str
    line: int  # of the opening fence, 1-based
    indent: str
    lang: str
    body: str
    not_run: str | None  # the reason, when marked so
    nproc: int | None  # python under torchrun

    def __str__(self) -> str:
        return f"{self.page}:{self.line} ({self.lang or 'no language'})"


def page_blocks(path: Path) -> list[Block]:
    lines = path.read_text().splitlines()
    page, out, i = str(path.relative_to(ROOT)), [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
        if end is None:
            raise AssertionError(f"{page}:{i + 1}: code fence never closed")
        markers, k = [], i - 1
        while k >= 0 and lines[k].strip().startswith("<!--"):
            markers.append(lines[k].strip())
            k -= 1
        not_run = next((r.group(1) for r in map(NOT_RUN.fullmatch, markers) if r), None)
        nproc = next((int(r.group(1)) for r in map(TORCHRUN.fullmatch, markers) if r), None)
        out.append(Block(page, i + 1, m.group(1), m.group(2).strip(), "\n".join(lines[i + 1:end]) + "\n",
                         not_run, nproc))
        i = end + 1
    return out


def commands(body: str) -> list[list[str]]:
    """The block's commands, continuation lines joined, comments dropped."""
    return [argv for line in body.replace("\\\n", " ").splitlines() if (argv := shlex.split(line, comments=True))]


def problems(block: Block) -> list[str]:
    if block.indent:
        return ["indented fence: put code blocks at the start of the line"]
    if block.lang not in LANGS:
        return [f"language {block.lang!r}: name one of {LANGS} (```text for output)"]
    if block.nproc is not None and (block.lang != "python" or block.not_run):
        return ["`run: torchrun N` marks a python block that runs"]
    if block.lang == "bash" and not block.not_run:
        return [f"runs only `dtensor-moe ...` commands, got {shlex.join(argv)!r}; mark it "
                "<!-- not run: REASON --> instead" for argv in commands(block.body) if argv[0] != "dtensor-moe"]
    return []


def runnable(block: Block) -> bool:
    return block.lang in ("python", "bash", "toml") and block.not_run is None


ALL_BLOCKS = [b for p in PAGES for b in page_blocks(p)]
RUN_PAGES = sorted({b.page for b in ALL_BLOCKS if runnable(b)})


def test_every_block_is_run_or_says_why():
    bad = [f"{b}: {why}" for b in ALL_BLOCKS for why in problems(b)]
    assert not bad, "\n".join(bad)
    assert any(b.lang == "python" and b.nproc for b in ALL_BLOCKS), "no multi-rank example found: parser broken?"


def test_readme_test_command_is_what_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert any(b.body.strip() == ci for b in page_blocks(ROOT / "README.md")), ci


# A path under one of these folders (not preceded by a path character: "../benchmarks/..." is a link,
# checked below), or a dotted name under dtensor_moe.
PATH = re.compile(r"(?<![\w./-])((?:dtensor_moe|benchmarks|configs|docs|scripts|tests|tools)/[\w./*-]*[\w/*])")
DOTTED = re.compile(r"(?<![\w./-])dtensor_moe(?:\.\w+)+")
LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")


def _names_exist(name: str) -> bool:
    """dtensor_moe.a.b.c: the longest module prefix is a file or package, and the first name after it
    appears in that file (or the package's __init__.py)."""
    path, parts = ROOT, name.split(".")
    for i, part in enumerate(parts):
        if (path / part).is_dir():
            path = path / part
            continue
        rest = parts[i:]
        if (path / f"{part}.py").is_file():
            path, rest = path / f"{part}.py", parts[i + 1:]
        elif (path / "__init__.py").is_file():
            path = path / "__init__.py"
        else:
            return False
        return not rest or re.search(rf"\b{re.escape(rest[0])}\b", path.read_text()) is not None
    return True


def _exists(path: str) -> bool:
    return any(ROOT.glob(path)) if "*" in path else (ROOT / path).exists()


def test_named_paths_and_modules_exist():
    missing = []
    for page in NAMING_PAGES:
        text, name = page.read_text(), page.relative_to(ROOT)
        for p in set(PATH.findall(text)):
            # The pages name the package's folders from inside it (`kernels/`, `tools/folding/`): a `tools/...` path
            # is the repository's tools/ or the package's.
            if not any(_exists(q) for q in ([p, f"dtensor_moe/{p}"] if p.startswith("tools/") else [p])):
                missing.append(f"{name}: {p}")
        for d in set(DOTTED.findall(text)):
            if not _names_exist(d):
                missing.append(f"{name}: {d}")
        for link in set(LINK.findall(text)):
            if "://" not in link and not (page.parent / link).exists():
                missing.append(f"{name}: link {link}")
    assert not missing, "named in the docs but not in the tree:\n" + "\n".join(sorted(missing))


def _on_pools(cmd: list[str], shim: Path, cwd: Path, kind: str, target: str, args: list[str], env) -> int:
    return torchrun_on_ranks([*cmd, str(shim), str(cwd), kind, target, *args], env)


@pytest.mark.parametrize("page", RUN_PAGES)
def test_page_runs(page, tmp_path, monkeypatch):
    from dtensor_moe.cli import main
    from dtensor_moe.cli import train as train_cli

    scratch = tmp_path / "scratch"
    (scratch / "docs").mkdir(parents=True)
    (scratch / "configs").symlink_to(ROOT / "configs")
    shim = tmp_path / "shim.py"
    shim.write_text(SHIM)
    monkeypatch.chdir(scratch)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def launch(cmd, env, *_):  # the launcher's torchrun: [python, -m, torch.distributed.run, OPTIONS, -m, MODULE, ARGS]
        i = cmd.index("-m", cmd.index("torch.distributed.run"))
        return _on_pools(cmd[:i], shim, scratch, "module", cmd[i + 1], cmd[i + 2:], env)

    monkeypatch.setattr(train_cli, "_launch", launch)
    for n, block in enumerate(b for b in ALL_BLOCKS if b.page == page and runnable(b)):
        try:
            if block.lang == "toml":
                tomllib.loads(block.body)
            elif block.lang == "python":
                script = scratch / f"block_{n}_line{block.line}.py"
                script.write_text(block.body)
                torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                            f"--nproc-per-node={block.nproc or 1}"]
                assert _on_pools(torchrun, shim, scratch, "path", str(script), [], env) == 0
            else:
                for argv in commands(block.body):
                    try:
                        rc = main(argv[1:])
                    except SystemExit as e:  # argparse's errors
                        rc = e.code
                    assert rc == 0, f"{shlex.join(argv)} exited {rc}"
        except BaseException as e:
            e.add_note(f"in the block at {block}")
            raise
