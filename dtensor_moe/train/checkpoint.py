"""Resharding checkpoints of model and optimizer state through torch.distributed.checkpoint (DCP).

Every parameter is a complete n-D DTensor (experts on the expert mesh, dense weights on the dp
mesh), so DCP saves each rank's slice with its global offsets and loads into any other mesh or
world size, a single process included. There is no hand-written sharded format.

API (call on every rank, with the same arguments):

    path = save(root, step, model, optimizer, extra={"data_pos": 7}, keep_last=3)
    extra = load(root_or_path, model, optimizer)   # {"step": step, "data_pos": 7}
    latest(root) -> Path | None                     # newest complete checkpoint under root

Layout: `root/step_00000042/` holds DCP's files (`.metadata`, `__<rank>_0.distcp`), the model
config (`model_config.json`) and `train_state.pt` (rank 0's `extra` plus "step": tensors, numbers,
strings, lists, dicts, e.g. RNG and lr-scheduler state; read back with weights_only=True). The
MoE `expert_bias` buffers are part of the model state dict.

Atomicity: a save is written into `root/.tmp-step_00000042/` and renamed to its final name by
rank 0 only after DCP's final collective, i.e. after every rank wrote its files and rank 0 wrote
`.metadata`. A rank killed mid-save leaves only a temporary directory, which `latest` ignores
and the next successful save removes.

A checkpoint whose keys or shapes differ from the model (another model config) raises a
ValueError listing the differences on every rank before the first collective, so no rank hangs.
"""

import dataclasses
import json
import os
import re
import shutil
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

TRAIN_STATE = "train_state.pt"
MODEL_CONFIG = "model_config.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_MAX_LISTED = 10


def step_dir(root, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


def _is_complete(path: Path) -> bool:
    return (path / ".metadata").is_file() and (path / TRAIN_STATE).is_file()


def latest(root) -> Path | None:
    """The highest-step complete checkpoint under `root` (temporary and partial dirs are skipped)."""
    root = Path(root)
    if not root.is_dir():
        return None
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and _is_complete(p)]
    return max(found)[1] if found else None


def resolve(path) -> Path:
    """`path` itself if it is a complete checkpoint, else the latest one under it."""
    path = Path(path)
    if _is_complete(path):
        return path
    found = latest(path)
    if found is None:
        raise ValueError(
            f"no complete checkpoint at or under {str(path)!r}: expected a step_NNNNNNNN directory holding "
            f".metadata and {TRAIN_STATE} (as written by dtensor_moe.train.checkpoint.save)"
        )
    return found


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _on_rank0(fn):
    """Runs fn on rank 0 and re-raises its failure on every rank, so none waits forever for it."""
    error = None
    if _rank() == 0:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - re-raised below on every rank
            error = f"{type(e).__name__}: {e}"
    if dist.is_initialized():
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error is not None:
        raise RuntimeError(f"checkpoint step on rank 0 failed: {error}")


@contextmanager
def single_process_ok():
    """DCP warns whenever no process group exists; one process (export, import, tests) is intended."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _fsync_dir(path: Path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _config_dict(model: nn.Module) -> dict | None:
    cfg = getattr(model, "config", None)
    return dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else None


def save(root, step: int, model: nn.Module, optimizer=None, extra: dict | None = None, keep_last: int | None = 3) -> Path:
    """Writes `root/step_<step>` atomically and keeps the newest `keep_last` (None keeps all)."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 (or None to keep every checkpoint), got {keep_last}")
    if extra is not None and not isinstance(extra, dict):
        raise ValueError(f"extra must be a dict of plain data and tensors, got {type(extra).__name__}")
    root, final = Path(root), step_dir(root, step)
    tmp = root / f".tmp-{final.name}"

    def prepare():
        shutil.rmtree(tmp, ignore_errors=True)  # left by a save that died
        tmp.mkdir(parents=True)
        torch.save({**(extra or {}), "step": step}, tmp / TRAIN_STATE)
        cfg = _config_dict(model)
        if cfg is not None:
            (tmp / MODEL_CONFIG).write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")

    _on_rank0(prepare)
    state = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        state["optim"] = get_optimizer_state_dict(model, optimizer)
    # Returns on every rank only after all ranks wrote their shards and rank 0 wrote .metadata.
    with single_process_ok():
        dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp))
    _on_rank0(lambda: (_publish(tmp, final), _prune(root, keep_last)))
    return final


def _publish(tmp: Path, final: Path):
    old = final.with_name(f".old-{final.name}")
    if final.exists():  # re-saving a step (e.g. after resuming from an earlier one)
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
    tmp.rename(final)
    _fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def _prune(root: Path, keep_last: int | None):
    for p in root.iterdir():
        if p.name.startswith((".tmp-", ".old-")):
            shutil.rmtree(p, ignore_errors=True)
    if keep_last is None:
        return
    steps = sorted((int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)))
    for _, p in steps[:-keep_last]:
        shutil.rmtree(p)


def _listed(items: list[str]) -> str:
    more = f" ... and {len(items) - _MAX_LISTED} more" if len(items) > _MAX_LISTED else ""
    return ", ".join(items[:_MAX_LISTED]) + more


def describe_mismatch(found: dict[str, tuple], expected: dict[str, tuple], source: str) -> str:
    """Which keys/shapes of `found` (in `source`) differ from `expected` (the model); '' if none."""
    lines = []
    missing = sorted(expected.keys() - found.keys())
    unexpected = sorted(found.keys() - expected.keys())
    shapes = [
        f"{k}: {source} {list(found[k])} vs model {list(expected[k])}"
        for k in sorted(expected.keys() & found.keys())
        if tuple(found[k]) != tuple(expected[k])
    ]
    if missing:
        lines.append(f"  missing in {source}: {_listed(missing)}")
    if unexpected:
        lines.append(f"  in {source} but not in the model: {_listed(unexpected)}")
    if shapes:
        lines.append(f"  shape differs: {_listed(shapes)}")
    return "\n".join(lines)


def describe_config_diff(saved: dict | None, model: nn.Module) -> str:
    current = _config_dict(model)
    if saved is None or current is None:
        return ""
    diffs = [f"{k}: saved {saved.get(k)!r} vs model {current.get(k)!r}" for k in sorted(saved.keys() | current.keys()) if saved.get(k) != current.get(k)]
    return f"  model config differs: {_listed(diffs)}" if diffs else ""


def _check_compatible(ckpt: Path, metadata, model: nn.Module, model_sd: dict, want_optim: bool):
    saved = {
        k.removeprefix("model."): tuple(md.size)
        for k, md in metadata.state_dict_metadata.items()
        if k.startswith("model.") and isinstance(md, TensorStorageMetadata)
    }
    problems = describe_mismatch(saved, {k: tuple(v.shape) for k, v in model_sd.items()}, "checkpoint")
    if problems:
        cfg_path = ckpt / MODEL_CONFIG
        saved_cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else None
        cfg_diff = describe_config_diff(saved_cfg, model)
        raise ValueError(
            f"checkpoint {ckpt} does not fit this model (saved from another model config?):\n{problems}"
            + (f"\n{cfg_diff}" if cfg_diff else "")
            + f"\nBuild the model with the checkpoint's config ({cfg_path}) or load another checkpoint."
        )
    if want_optim and not any(k.startswith("optim.") for k in metadata.state_dict_metadata):
        raise ValueError(
            f"checkpoint {ckpt} holds model weights only (written by `dtensor-moe import` or save(optimizer=None)); "
            f"pass optimizer=None to load the weights and start the optimizer fresh"
        )


def load(path, model: nn.Module, optimizer=None) -> dict:
    """Loads `path` (a checkpoint, or a root: its latest) into `model` / `optimizer` on any mesh.

    Returns the saved `extra` dict with "step". Call on every rank of the model's process group.
    """
    ckpt = resolve(path)
    metadata = dcp.FileSystemReader(ckpt).read_metadata()  # every rank reads it: no collective
    model_sd = get_model_state_dict(model)
    _check_compatible(ckpt, metadata, model, model_sd, optimizer is not None)
    state = {"model": model_sd}
    if optimizer is not None:
        state["optim"] = get_optimizer_state_dict(model, optimizer)  # allocates moments if still empty
    with single_process_ok():
        dcp.load(state, storage_reader=dcp.FileSystemReader(ckpt))
    set_model_state_dict(model, state["model"])
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state["optim"])
    return torch.load(ckpt / TRAIN_STATE, weights_only=True)
