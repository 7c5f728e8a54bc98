"""A fix torch 2.11's inductor needs for expert parallelism: a launch grid that divides by zero on an empty rank.

Inductor launches a 2D Triton kernel whose y extent may exceed CUDA's limit through `Grid2DWithYZOverflow`: the
y blocks are split over y and z, y = ceil(y_blocks / z) with z = ceil(y_blocks / 65535). With ynumel 0 (an EP rank
that receives no token for its experts, an ordinary event under learned routing) z is 0 and the launcher raises
ZeroDivisionError before any kernel runs. torch fixed it upstream (pytorch/pytorch#179222; torch 2.13 generates
`0 if y_grid_div_ == 0 else ...`); `guard_empty_y_grid` gives older versions the same guard, and does nothing
where the generated grid already survives ynumel 0 (checked by running it), so it goes with torch 2.11.
"""

import functools

__all__ = ["guard_empty_y_grid"]


def _divides_by_zero(grid_cls) -> bool:
    """Whether `grid_cls`'s python grid code raises for ynumel 0."""
    grid = grid_cls(inductor_meta={}, mode="python")
    grid.generate({"XBLOCK": 1, "YBLOCK": 1})
    scope = {"xnumel": 1, "ynumel": 0}
    try:
        exec("\n".join([*grid.prefix, f"y = {grid.y_grid}", f"z = {grid.z_grid}"]), scope)
    except ZeroDivisionError:
        return True
    return False


def with_empty_y_guard(generate):
    """`Grid2DWithYZOverflow.generate` whose y grid is 0 when the z split is (no y block): Triton's launcher then
    launches nothing, as for any empty grid."""

    @functools.wraps(generate)
    def guarded(self, meta, *args, **kwargs):  # torch 2.11 passes meta alone; later ones add is_lazy
        generate(self, meta, *args, **kwargs)
        if self.mode == "python":
            self.y_grid = f"(0 if y_grid_div_ == 0 else {self.y_grid})"
        else:
            self.y_grid = f"(y_grid_div_ == 0 ? 0 : {self.y_grid})"

    return guarded


def guard_empty_y_grid() -> bool:
    """Patches inductor's `Grid2DWithYZOverflow` (process-wide, once) if its grid divides by zero for ynumel 0.

    Returns:
        bool: whether this torch needed the patch (False also without Triton, where no such grid is launched).
    """
    try:
        from torch._inductor.runtime.triton_heuristics import Grid2DWithYZOverflow
    except ImportError:  # no Triton: inductor generates no Triton launcher
        return False
    if not _divides_by_zero(Grid2DWithYZOverflow):
        return False
    Grid2DWithYZOverflow.generate = with_empty_y_guard(Grid2DWithYZOverflow.generate)
    return True
