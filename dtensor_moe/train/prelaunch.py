"""What `dtensor-moe train` checks before any rank starts, beyond the config (train/config.py) and the data
(token_cache.prepare): the optional packages every rank imports (tqdm, the progress bar; transformers and
safetensors for model.hf_path are checked with the config, its checkpoint's headers too), and a `--resume` that
would look where the checkpoints are not (`dtensor-moe import SAFETENSORS RUN` writes RUN/step_N, train's default
--resume reads RUN/checkpoints). Torch-free; each problem is one ValueError naming the fix."""

import importlib.util
import re
from pathlib import Path

# Optional packages every run imports, with how to install them.
RUN_EXTRAS = {"tqdm": "the progress bar: pip install tqdm (or pip install 'dtensor_moe[train]')"}
_STEP = re.compile(r"step_\d+$")


def _steps(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.is_dir() and _STEP.match(p.name)) if root.is_dir() else []


def check_before_launch(run_dir: str, resume: str | None) -> None:
    """The installed extras and --resume's checkpoint root (`resume`: "latest" for the run dir's, a path, or None)."""
    for module, why in RUN_EXTRAS.items():
        # Imported, not only found: an installed but broken (or hidden) package would fail on every rank after launch.
        try:
            importlib.import_module(module)
        except Exception as e:  # noqa: BLE001 - whatever the import raises, it would raise on every rank
            found = importlib.util.find_spec(module) is not None if not isinstance(e, ImportError) else False
            state = f"installed but fails to import ({type(e).__name__}: {e})" if found else "not importable"
            raise ValueError(f"dtensor-moe train needs {module} for {why}; it is {state}") from None
    if resume != "latest":
        return
    root, run = Path(run_dir) / "checkpoints", Path(run_dir)
    here = _steps(run)
    if here and not _steps(root):
        raise ValueError(f"--resume looks for checkpoints in {root}, which holds none; {run} itself holds "
                         f"{here[-1]} (`dtensor-moe import SAFETENSORS {run}` writes there): pass --resume {run} "
                         f"(or --resume {run / here[-1]}), or import into {root}")
