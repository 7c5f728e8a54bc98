"""`dtensor-moe explain`: which rank holds which slice of every MoE weight, read from the placement plan.

Text: per weight its placement on each mesh axis, its local shape, and the ranks holding each slice.
`--png`: the rank grid (rows: dp_replicate x edp, columns: ep x etp, i.e. the expert mesh in rank
order) once per weight, each rank coloured by the slice it holds; ranks of one colour hold copies.
One more panel draws the dense mesh over the same ranks (rows: dp_replicate x dp_shard, columns:
cp x tp), coloured by the sequences a rank reads: CP and TP ranks of one row split those sequences.
Under tp > 1 the text also lists the dense TP styles (which modules split how) and the TP groups.
Under pp > 1 (outermost) the tables and grids are one pipeline stage's (stage-local ranks; every
stage places its own layers the same way); the text lists the stages and the pipeline groups, and a
last panel draws the stages (rows) over their ranks.
Without matplotlib, `--png` prints a one-line note on stderr and the text alone (exit status 0).
Up to LIST_LIMIT ranks a stage the text lists every rank; `--ranks` (or a larger stage: its first ranks and its
last) lists only those ranks, each with its slice of every weight, so the output and the time stay bounded at any
world size. `--png` draws every rank: at most PNG_LIMIT a stage.
"""

import os
import sys

from dtensor_moe.config import MoEConfig
from dtensor_moe.parallel.mesh import MoEParallelDims
from dtensor_moe.parallel.placement import WeightPlan, owned_box, plan_moe, rank_coords
from dtensor_moe.train.parallel.tp_styles import TP_BLOCK_STYLES, TP_ROOT_STYLES
from dtensor_moe.validate import check_int

Box = tuple[tuple[int, int], ...]
LIST_LIMIT = 256  # ranks a stage whose every rank the text lists (and each slice's holders); beyond: listed ones only
DEFAULT_LISTED = 8  # a larger stage's listed ranks without --ranks: these first ones and its last
PNG_LIMIT = 4096  # ranks a stage --png draws (a cell each)


def _box(wp: WeightPlan, dims: MoEParallelDims, rank: int) -> Box:
    return tuple((s.start, s.stop) for s in owned_box(wp, dims, rank))


def slice_holders(wp: WeightPlan, dims: MoEParallelDims) -> dict[Box, list[int]]:
    """Each distinct slice -> the ranks holding it, in order of first holder."""
    out: dict[Box, list[int]] = {}
    for r in range(dims.stage_size):
        out.setdefault(_box(wp, dims, r), []).append(r)
    return out


def rank_grid(wp: WeightPlan, dims: MoEParallelDims) -> tuple[list[list[int]], list[Box]]:
    """grid[row][col] = index into `boxes` of the slice held by the rank at that cell.

    The expert mesh is row-major over (dp_replicate, edp, ep, etp), so rank = row * ep * etp + col."""
    boxes = list(slice_holders(wp, dims))
    index = {b: i for i, b in enumerate(boxes)}
    cols = dims.ep * dims.etp
    rows = dims.stage_size // cols
    grid = [[index[_box(wp, dims, row * cols + col)] for col in range(cols)] for row in range(rows)]
    return grid, boxes


def fmt_box(box: Box) -> str:
    return "[" + ", ".join(f"{lo}:{hi}" for lo, hi in box) + "]"


def fmt_ranks(ranks: list[int]) -> str:
    """0,1,2,3,8 -> '0-3,8'."""
    runs, start = [], ranks[0]
    for prev, cur in zip(ranks, ranks[1:] + [None]):
        if cur != prev + 1:
            runs.append(str(start) if start == prev else f"{start}-{prev}")
            start = cur
    return ",".join(runs)


def parse_ranks(text: str, stage_size: int) -> list[int]:
    """--ranks '0-3,8' -> [0, 1, 2, 3, 8] (stage-local ranks, each in range; at most LIST_LIMIT of them)."""
    ranks: set[int] = set()
    valid = f"valid: stage-local ranks 0..{stage_size - 1}, e.g. '0-3,{stage_size - 1}'"
    for part in text.split(","):
        lo, dash, hi = part.strip().partition("-")
        try:
            first, last = int(lo), int(hi) if dash else int(lo)
        except ValueError:
            raise ValueError(f"--ranks {text!r}: {part.strip()!r} is not a rank or a range A-B; {valid}") from None
        if not 0 <= first <= last < stage_size:
            raise ValueError(f"--ranks {text!r}: {part.strip()!r} is not within the stage's ranks; {valid}")
        if last - first + 1 + len(ranks) > LIST_LIMIT:
            raise ValueError(f"--ranks {text!r} names more than {LIST_LIMIT} ranks; valid: at most {LIST_LIMIT} "
                             "(the text lists each)")
        ranks.update(range(first, last + 1))
    return sorted(ranks)


def _progression(first: int, step: int, n: int) -> str:
    """n ranks first, first + step, ...: all of them up to 4, else the first two, '...' and the last."""
    items = [first + i * step for i in range(n)] if n <= 4 else [first, first + step, "...", first + (n - 1) * step]
    return ",".join(map(str, items))


def describe(config: MoEConfig, dims: MoEParallelDims, ranks: list[int] | None = None) -> str:
    """The text; `ranks` (stage-local) lists only those ranks, each with its slices. Without it a stage of more than
    LIST_LIMIT ranks lists its first DEFAULT_LISTED ranks and its last."""
    plans = plan_moe(config, dims)
    S = dims.stage_size
    every, asked = ranks is None and S <= LIST_LIMIT, ranks is not None
    if ranks is None:
        ranks = list(range(S)) if every else sorted({*range(min(DEFAULT_LISTED, S)), S - 1})
    coords = {r: rank_coords(dims, r) for r in ranks}
    # Columns as wide as their header, or their widest listed value (a stage of millions of ranks).
    widths = {k: max(w, *(len(str(c[k])) for c in coords.values()))
              for k, w in (("dp_replicate", 12), ("edp", 4), ("ep", 4), ("etp", 4), ("dp_shard", 8), ("cp", 3),
                           ("tp", 3))}
    rw = max(5, len(str(ranks[-1])))

    def row(rank, c) -> str:
        return (f"{rank:>{rw}} | " + " ".join(f"{c[k]:>{widths[k]}}" for k in ("dp_replicate", "edp", "ep", "etp"))
                + " | " + " ".join(f"{c[k]:>{widths[k]}}" for k in ("dp_shard", "cp", "tp")))
    lines = [
        *(
            [
                f"world {dims.world_size} = pp {dims.pp} x {dims.stage_size}: pipeline stage s holds ranks "
                f"s*{dims.stage_size} .. s*{dims.stage_size}+{dims.stage_size - 1}; "
                "below, one stage (stage-local ranks):"
            ]
            if dims.pp > 1
            else []
        ),
        f"{'stage' if dims.pp > 1 else 'world'} {dims.stage_size}: dense mesh dp_replicate={dims.dp_replicate} x "
        f"dp_shard={dims.dp_shard} x cp={dims.cp} x tp={dims.tp}; "
        f"expert mesh dp_replicate={dims.dp_replicate} x edp={dims.edp} x "
        f"ep={dims.ep} x etp={dims.etp}",
        f"MoE: {config.num_experts} experts, dim {config.dim}, hidden {config.hidden_dim}, "
        f"{config.num_shared_experts} shared expert(s). ETP ranks are consecutive, then EP, then EDP.",
        "",
        row("rank", {k: k for k in widths}),
        *(row(r, c) for r, c in coords.items()),
    ]
    if asked:
        lines.append(f"(ranks {fmt_ranks(ranks)} of {S} listed, as --ranks asked)")
    elif not every:
        lines.append(f"(ranks {fmt_ranks(ranks)} of {S} listed: a stage of more than {LIST_LIMIT} ranks lists its "
                     f"first {DEFAULT_LISTED} and last; --ranks A-B,C lists others)")
    if dims.pp > 1:
        groups = [_progression(r, S, dims.pp) for r in ranks]
        lines += ["", f"pipeline (pp={dims.pp}, outermost): each stage runs its own layers; neighbouring stages send "
                      "hidden states forward and their gradients back within a group of one rank per stage:",
                  "  groups " + " ".join(groups) + ("" if every else " (the listed ranks' groups)")]
    if dims.tp > 1:
        starts = sorted({r // dims.tp * dims.tp for r in ranks})
        groups = " ".join(fmt_ranks(list(range(g, g + dims.tp))) for g in starts) + ("" if every else " ...")
        lines += ["", f"dense TP (sequence-parallel between blocks), groups {groups}:",
                  "  " + ", ".join(f"{m}={s}" for m, s in TP_ROOT_STYLES),
                  "  per block: " + ", ".join(f"{m}={s}" for m, s in TP_BLOCK_STYLES),
                  f"  each MoE takes its rank's sequence slice; its dense weights shard over {dims.moe_dp_axis}"]
    for wp in plans:
        placements = ", ".join(f"{a}={p}" for a, p in wp.placements().items())
        lines += [
            "",
            f"{wp.name} ({wp.role}) global {list(wp.global_shape)} -> local {list(wp.local_shape)} on rank 0"
            + (" (FSDP pads the last shards)" if wp.padded else ""),
            f"  placements: {placements}",
        ]
        if not every:  # each listed rank's slice: no walk over every rank
            boxes = {r: fmt_box(_box(wp, dims, r)) for r in ranks}
            lines.append(f"  {'rank':>{rw}}  slice")
            lines += [f"  {r:>{rw}}  {b}" for r, b in boxes.items()]
            continue
        holders = slice_holders(wp, dims)
        width = max(len(fmt_box(b)) for b in holders)
        lines.append(f"  {'slice':<{width}}  ranks")
        lines += [f"  {fmt_box(b):<{width}}  {fmt_ranks(rs)}" for b, rs in holders.items()]
    return "\n".join(lines)


def save_png(config: MoEConfig, dims: MoEParallelDims, path: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plans = plan_moe(config, dims)
    panels = len(plans) + 1 + (dims.pp > 1)
    ncols = min(3, panels)
    nrows = -(-panels // ncols)
    rows, cols = dims.stage_size // (dims.ep * dims.etp), dims.ep * dims.etp
    fig, axes = plt.subplots(
        nrows, ncols, figsize=(ncols * max(3.0, 0.9 * cols + 1), nrows * max(2.5, 0.7 * rows + 1.2)), squeeze=False
    )
    for ax, wp in zip(axes.flat, plans):
        grid, boxes = rank_grid(wp, dims)
        cmap = plt.get_cmap("tab20" if len(boxes) <= 20 else "viridis", len(boxes))
        ax.imshow(grid, cmap=cmap, vmin=-0.5, vmax=len(boxes) - 0.5, aspect="auto")
        if rows * cols <= 256:  # labels are unreadable beyond that
            for i in range(rows):
                for j in range(cols):
                    ax.text(
                        j, i, f"r{i * cols + j}\n{fmt_box(boxes[grid[i][j]])}", ha="center", va="center", fontsize=6
                    )
        ax.set_title(f"{wp.name}\n" + " ".join(f"{a}:{p}" for a, p in wp.placements().items()), fontsize=7)
        ax.set_xlabel(f"ep x etp = {dims.ep} x {dims.etp}", fontsize=7)
        ax.set_ylabel(f"dp_replicate x edp = {dims.dp_replicate} x {dims.edp}", fontsize=7)
        ax.set_xticks(range(cols))
        ax.set_yticks(range(rows))
        ax.tick_params(labelsize=6)
    _dense_panel(list(axes.flat)[len(plans)], dims, plt)
    if dims.pp > 1:
        _pipeline_panel(list(axes.flat)[len(plans) + 1], dims, plt)
    for ax in list(axes.flat)[panels:]:
        ax.axis("off")
    stages = f" (pp {dims.pp} stages of {dims.stage_size}; grids: one stage)" if dims.pp > 1 else ""
    fig.suptitle(
        f"world {dims.world_size}{stages}: colour = slice held (same colour = copies over dp_replicate)", fontsize=9
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120, format="png")  # exactly `path`: without a format matplotlib appends .png
    plt.close(fig)


def _dense_panel(ax, dims: MoEParallelDims, plt):
    """The dense mesh in rank order: a row per data-parallel group, its CP x TP ranks across."""
    cols = dims.cp * dims.tp
    _row_panel(
        ax,
        plt,
        dims.stage_size // cols,
        cols,
        lambda i, j: f"r{i * cols + j}\ncp{j // dims.tp} tp{j % dims.tp}",
        "dense mesh: colour = sequences read\n(cp parts, tp slices of each)",
        f"cp x tp = {dims.cp} x {dims.tp}",
        f"dp_replicate x dp_shard = {dims.dp_replicate} x {dims.dp_shard}",
    )


def _pipeline_panel(ax, dims: MoEParallelDims, plt):
    """The world in rank order: a row per pipeline stage, its ranks across (one column: one pipeline group)."""
    cols = dims.stage_size
    _row_panel(ax, plt, dims.pp, cols, lambda i, j: f"r{i * cols + j}",
               "pipeline: colour = stage\n(a column sends hidden states down)", f"ranks of a stage ({cols})",
               f"pp = {dims.pp}")


def _row_panel(ax, plt, rows: int, cols: int, label, title: str, xlabel: str, ylabel: str):
    """A rows x cols grid of ranks coloured by row, each cell labelled label(row, col)."""
    ax.imshow([[row] * cols for row in range(rows)], cmap=plt.get_cmap("tab20" if rows <= 20 else "viridis", rows),
              vmin=-0.5, vmax=rows - 0.5, aspect="auto")
    if rows * cols <= 256:  # labels are unreadable beyond that
        for i in range(rows):
            for j in range(cols):
                ax.text(j, i, label(i, j), ha="center", va="center", fontsize=6)
    ax.set_title(title, fontsize=7)
    ax.set_xlabel(xlabel, fontsize=7)
    ax.set_ylabel(ylabel, fontsize=7)
    ax.set_xticks(range(cols))
    ax.set_yticks(range(rows))
    ax.tick_params(labelsize=6)


def add_arguments(p):
    p.add_argument("--world", type=int, required=True, help="number of ranks")
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--etp", type=int, default=1)
    p.add_argument("--dp-replicate", type=int, default=1)
    p.add_argument("--cp", type=int, default=1)
    p.add_argument("--tp", type=int, default=1, help="dense tensor parallelism (sequence-parallel)")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (outermost)")
    p.add_argument("--num-experts", type=int, required=True)
    p.add_argument("--dim", type=int, default=8)
    p.add_argument("--hidden-dim", type=int, default=8, help="expert hidden dim F")
    p.add_argument("--shared-experts", type=int, default=0)
    p.add_argument("--ranks", metavar="A-B,C",
                   help=f"list only these stage-local ranks, each with its slices (default: every rank up to "
                        f"{LIST_LIMIT} a stage, else the first {DEFAULT_LISTED} and the last)")
    p.add_argument("--png", metavar="FILE", help="also draw the rank grid coloured by slice held, as FILE (PNG)")


def _check_flags(args):
    """The flags by their own names, as the user typed them (MoEConfig's messages would name its fields)."""
    for flag in (
        "world",
        "ep",
        "etp",
        "dp_replicate",
        "cp",
        "tp",
        "pp",
        "num_experts",
        "dim",
        "hidden_dim",
        "shared_experts",
    ):
        check_int("--" + flag.replace("_", "-"), getattr(args, flag), minimum=0 if flag == "shared_experts" else 1)
    if args.png is not None:
        if not args.png.strip():
            raise ValueError(f"--png {args.png!r} names no file; give the PNG file to write, e.g. 'explain.png'")
        parent = os.path.dirname(os.path.abspath(args.png))
        if not os.path.isdir(parent):
            raise ValueError(f"--png {args.png!r}: directory {parent!r} does not exist")
        if os.path.isdir(args.png) or args.png.endswith(os.sep):  # a file name picked here would be one never typed
            raise ValueError(f"--png {args.png!r} names a directory; --png takes the PNG file to write, e.g. "
                             f"{os.path.join(args.png, 'explain.png')!r}")


def run(args) -> int:
    try:
        _check_flags(args)
        config = MoEConfig(dim=args.dim, hidden_dim=args.hidden_dim, num_experts=args.num_experts, top_k=1,
                           num_shared_experts=args.shared_experts)
        dims = MoEParallelDims(
            args.world, dp_replicate=args.dp_replicate, cp=args.cp, tp=args.tp, ep=args.ep, etp=args.etp, pp=args.pp
        )
        if args.png and dims.stage_size > PNG_LIMIT:
            raise ValueError(f"--png draws a cell per rank, valid up to {PNG_LIMIT} ranks a stage; this one has "
                             f"{dims.stage_size}: leave --png out (the text lists the ranks --ranks names)")
        ranks = None if getattr(args, "ranks", None) is None else parse_ranks(args.ranks, dims.stage_size)
        print(describe(config, dims, ranks))
    except ValueError as e:
        print(f"dtensor-moe explain: {e}", file=sys.stderr)
        return 2
    if args.png:
        try:
            save_png(config, dims, args.png)
        except ModuleNotFoundError as e:
            if e.name != "matplotlib":
                raise
            print(f"dtensor-moe explain: --png needs matplotlib (pip install matplotlib); {args.png} not written",
                  file=sys.stderr)
            return 0
        print(f"\nrank grid written to {args.png}")
    return 0
