"""`dtensor-moe explain`: the text and the picture say what the placement plan says."""

import contextlib
import io
import re
import sys
from pathlib import Path

import pytest

from dtensor_moe.cli import explain as X
from dtensor_moe.cli import main
from dtensor_moe.config import MoEConfig
from dtensor_moe.parallel.mesh import MoEParallelDims
from dtensor_moe.parallel.placement import owned_box, plan_moe

ROOT = Path(__file__).resolve().parents[1]
README_ARGS = ["explain", "--world", "8", "--ep", "2", "--etp", "2", "--num-experts", "4", "--dim", "8", "--hidden-dim", "8", "--shared-experts", "1"]  # noqa: E501
README_CONFIG = MoEConfig(dim=8, hidden_dim=8, num_experts=4, top_k=1, num_shared_experts=1)
CASES = [
    (README_CONFIG, MoEParallelDims(8, ep=2, etp=2)),  # EDP2 x EP2 x ETP2
    (MoEConfig(dim=6, hidden_dim=4, num_experts=2, top_k=1), MoEParallelDims(8, dp_replicate=2, ep=2)),
    (
        MoEConfig(dim=5, hidden_dim=6, num_experts=3, top_k=1, num_shared_experts=2),
        MoEParallelDims(12, cp=2, ep=3, etp=2),
    ),
    (README_CONFIG, MoEParallelDims(8, cp=2, tp=2, ep=2, etp=2)),  # the MoE's dense weights over dp_shard_cp_tp
    (README_CONFIG, MoEParallelDims(16, pp=2, tp=2, ep=2, etp=2)),  # one stage's ranks: the tables are stage-local
]


def _sections(text: str) -> dict[str, dict[int, str]]:
    """weight name -> {rank: slice} parsed back from the text table."""
    out, name = {}, None
    for line in text.splitlines():
        if m := re.match(r"^(\S+) \((expert|dense)\) global", line):
            name = m.group(1)
            out[name] = {}
        elif name and (m := re.match(r"^  (\[[0-9:, ]+\])\s+([0-9,-]+)$", line)):
            for part in m.group(2).split(","):
                lo, _, hi = part.partition("-")
                for r in range(int(lo), int(hi or lo) + 1):
                    out[name][r] = m.group(1)
    return out


@pytest.mark.parametrize("config,dims", CASES)
def test_text_rank_to_slice_agrees_with_owned_box(config, dims):
    sections = _sections(X.describe(config, dims))
    plans = plan_moe(config, dims)
    assert set(sections) == {wp.name for wp in plans}
    for wp in plans:
        want = {r: X.fmt_box(tuple((s.start, s.stop) for s in owned_box(wp, dims, r))) for r in range(dims.stage_size)}
        assert sections[wp.name] == want, wp.name


@pytest.mark.parametrize("config,dims", CASES)
def test_grid_colours_are_slices(config, dims):
    for wp in plan_moe(config, dims):
        grid, boxes = X.rank_grid(wp, dims)
        cols = dims.ep * dims.etp
        assert len(grid) * cols == dims.stage_size
        for i, row in enumerate(grid):
            for j, idx in enumerate(row):
                assert boxes[idx] == tuple((s.start, s.stop) for s in owned_box(wp, dims, i * cols + j))
        # Inside a replica no two ranks share a non-empty slice; replicas repeat the same colours.
        per_replica = len(grid) // dims.dp_replicate
        held = [boxes[idx] for row in grid[:per_replica] for idx in row if all(hi > lo for lo, hi in boxes[idx])]
        assert len(set(held)) == len(held)
        assert all(grid[i] == grid[i % per_replica] for i in range(len(grid)))


def test_text_shows_the_dense_axes():
    dims = MoEParallelDims(8, cp=2, tp=2, ep=2, etp=2)
    text = X.describe(README_CONFIG, dims)
    rows = [line.split() for line in text.splitlines() if re.match(r"^\s+\d+ \|", line)]
    assert [(int(r[-2]), int(r[-1])) for r in rows] == [
        (dims.dense_coords(i)["cp"], dims.dense_coords(i)["tp"]) for i in range(8)
    ]
    assert "dense TP (sequence-parallel between blocks), groups 0-1 2-3 4-5 6-7:" in text
    assert "attention.wq=colwise" in text and "shard over dp_shard_cp_tp" in text


def test_text_shows_the_pipeline():
    dims = MoEParallelDims(16, pp=2, tp=2, ep=2, etp=2)
    text = X.describe(README_CONFIG, dims)
    assert text.startswith("world 16 = pp 2 x 8: pipeline stage s holds ranks s*8 .. s*8+7; below, one stage")
    assert "\n  groups 0,8 1,9 2,10 3,11 4,12 5,13 6,14 7,15\n" in text
    assert "dense TP (sequence-parallel between blocks), groups 0-1 2-3 4-5 6-7:" in text  # stage-local
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()) as out:
        assert main([*README_ARGS[:2], "16", *README_ARGS[3:], "--pp", "2"]) == 0
        assert out.getvalue().startswith("world 16 = pp 2 x 8") and err.getvalue() == ""
        assert main([*README_ARGS, "--pp", "3"]) == 2
    assert err.getvalue() == ("dtensor-moe explain: pp (3) must divide world_size 8 (pipeline stages of equal size); "
                              "valid pp: [1, 2, 4, 8]\n")


def test_png(tmp_path):
    import matplotlib.image

    path = tmp_path / "grid.png"
    X.save_png(*CASES[0], str(path))
    X.save_png(*CASES[-1], str(tmp_path / "pp.png"))  # with the pipeline panel
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    img = matplotlib.image.imread(path)
    assert img.shape[0] > 200 and img.shape[1] > 400
    # The cells are coloured: far more than the few greys of axes and text.
    colours = {tuple(px) for px in img.reshape(-1, img.shape[-1])[::97].round(2).tolist()}
    assert len(colours) > 8


def test_png_without_matplotlib(tmp_path, monkeypatch):
    """`--png` without matplotlib: the text still prints, one line on stderr says why no picture, rc 0."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ModuleNotFoundError
    path = tmp_path / "grid.png"
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        assert main([*README_ARGS, "--png", str(path)]) == 0
    assert X.describe(*CASES[0]) in out.getvalue() and "written" not in out.getvalue()
    assert (
        err.getvalue() == f"dtensor-moe explain: --png needs matplotlib (pip install matplotlib); {path} not written\n"
    )
    assert not path.exists()


def test_fmt_ranks():
    assert X.fmt_ranks([0, 1, 2, 3, 8]) == "0-3,8"
    assert X.fmt_ranks([5]) == "5"
    assert X.fmt_ranks([1, 3, 4]) == "1,3-4"


def test_cli_bad_folding_names_constraint():
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        assert main(["explain", "--world", "8", "--ep", "3", "--num-experts", "4"]) == 2
    assert "Valid ep" in err.getvalue()


@pytest.mark.parametrize("flag,value,valid", [
    ("--num-experts", "0", "an int >= 1, got 0"),
    ("--hidden-dim", "0", "an int >= 1, got 0"),
    ("--dim", "-8", "an int >= 1, got -8"),
    ("--world", "0", "an int >= 1, got 0"),
    ("--shared-experts", "-1", "an int >= 0, got -1"),
    ("--pp", "0", "an int >= 1, got 0"),
])
def test_cli_bad_flags_are_named_as_typed(flag, value, valid):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()) as out:
        assert main([*README_ARGS, flag, value]) == 2
    assert err.getvalue() == f"dtensor-moe explain: {flag} must be {valid}\n" and out.getvalue() == ""


def test_png_into_a_missing_directory_is_refused_before_any_output(tmp_path):
    path = tmp_path / "no_such_dir" / "grid.png"
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()) as out:
        assert main([*README_ARGS, "--png", str(path)]) == 2
    assert (
        err.getvalue() == f"dtensor-moe explain: --png {str(path)!r}: directory {str(path.parent)!r} does not exist\n"
    )
    assert out.getvalue() == ""


def test_png_is_written_at_the_path_reported(tmp_path):
    """A name without .png is the file written (matplotlib alone would write NAME.png and the CLI report NAME)."""
    path = tmp_path / "grid"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["explain", "--world", "2", "--num-experts", "2", "--png", str(path)]) == 0
    assert out.getvalue().endswith(f"rank grid written to {path}\n")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and not (tmp_path / "grid.png").exists()


@pytest.mark.parametrize("suffix", [None, "", "/"])
def test_png_naming_a_directory_or_nothing_is_refused_before_any_output(tmp_path, suffix):
    """An existing directory (or a path ending in /) is refused rather than given a file name never typed."""
    (tmp_path / "dir").mkdir()
    png = "" if suffix is None else str(tmp_path / "dir") + suffix
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()) as out:
        assert main([*README_ARGS, "--png", png]) == 2
    said = "--png '' names no file" if suffix is None else (
        f"--png {png!r} names a directory; --png takes the PNG file to write, e.g. "
        f"{str(tmp_path / 'dir' / 'explain.png')!r}")
    assert err.getvalue().startswith(f"dtensor-moe explain: {said}") and err.getvalue().count("\n") == 1
    assert out.getvalue() == "" and sorted(p.name for p in tmp_path.iterdir()) == ["dir"]
    assert not any((tmp_path / "dir").iterdir())


def test_readme_shows_current_output():
    """docs/plan_explain.md holds the 8-rank EDP2 x EP2 x ETP2 explain output verbatim, and its picture."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(README_ARGS) == 0
    doc = (ROOT / "docs" / "plan_explain.md").read_text()
    assert out.getvalue().strip() in doc
    assert "dtensor-moe " + " ".join(README_ARGS) in doc
    assert (ROOT / "docs" / "explain_edp2_ep2_etp2.png").read_bytes()[:4] == b"\x89PNG"


def _listed(text: str) -> dict[str, dict[int, str]]:
    """weight name -> {rank: slice} from the listed-ranks tables (`--ranks`, or a stage past LIST_LIMIT)."""
    out, name = {}, None
    for line in text.splitlines():
        if m := re.match(r"^(\S+) \((expert|dense)\) global", line):
            name = m.group(1)
            out[name] = {}
        elif name and (m := re.match(r"^\s+(\d+)  (\[[0-9:, ]+\])$", line)):
            out[name][int(m.group(1))] = m.group(2)
    return out


def test_huge_world_lists_a_few_ranks_quickly():
    """Issue 40: --world 1000000000 ran for minutes (a line per rank, every rank's slice walked). Past LIST_LIMIT
    ranks a stage the text lists the first ranks and the last, each with its own slices: bounded lines and time."""
    import time

    argv = ["explain", "--world", "1000000000", "--pp", "2", "--tp", "2", "--ep", "2", "--etp", "2", "--num-experts",
            "4", "--shared-experts", "1"]
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()) as out:
        assert main(argv) == 0
    took = time.perf_counter() - t0
    print(f"explain --world 1e9: {took:.3f} s")  # ~0.01 s on the 2-core machine (was minutes)
    text = out.getvalue()
    assert len(text.splitlines()) < 150
    dims = MoEParallelDims(10**9, pp=2, tp=2, ep=2, etp=2)
    last = dims.stage_size - 1
    assert f"(ranks 0-7,{last} of {dims.stage_size} listed: a stage of more than {X.LIST_LIMIT} ranks" in text
    assert "\n  groups 0,500000000 1,500000001 " in text
    listed = _listed(text)
    for wp in plan_moe(README_CONFIG, dims):
        assert listed[wp.name] == {r: X.fmt_box(tuple((s.start, s.stop) for s in owned_box(wp, dims, r)))
                                   for r in [*range(8), last]}, wp.name


@pytest.mark.parametrize("config,dims", CASES)
def test_ranks_flag_lists_those_ranks_slices(config, dims):
    ranks = [1, dims.stage_size - 2, dims.stage_size - 1]
    text = X.describe(config, dims, ranks)
    rows = [int(line.split()[0]) for line in text.splitlines() if re.match(r"^\s+\d+ \|", line)]
    assert rows == ranks
    listed = _listed(text)
    for wp in plan_moe(config, dims):
        assert listed[wp.name] == {r: X.fmt_box(tuple((s.start, s.stop) for s in owned_box(wp, dims, r)))
                                   for r in ranks}


@pytest.mark.parametrize("extra,said", [
    (["--ranks", "3-9"], "--ranks '3-9': '3-9' is not within the stage's ranks; valid: stage-local ranks 0..7"),
    (["--ranks", "x"], "--ranks 'x': 'x' is not a rank or a range A-B; valid: stage-local ranks 0..7"),
    (["--world", "4096", "--ranks", "0-300"], "--ranks '0-300' names more than 256 ranks"),
    (["--world", "1000000", "--png", "grid.png"], "--png draws a cell per rank, valid up to 4096 ranks a stage; "
                                                  "this one has 1000000"),
])
def test_ranks_and_png_bounds_refused_in_one_line(tmp_path, monkeypatch, extra, said):
    monkeypatch.chdir(tmp_path)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()) as out:
        assert main([*README_ARGS, *extra]) == 2
    assert err.getvalue().startswith(f"dtensor-moe explain: {said}") and err.getvalue().count("\n") == 1
    assert out.getvalue() == "" and not any(tmp_path.iterdir())
