"""Resharding checkpoints of model and optimizer state through torch.distributed.checkpoint (DCP).

Every parameter is a complete n-D DTensor (experts on the expert mesh, dense weights on the dp
mesh), so DCP saves each rank's slice with its global offsets and loads into any other mesh or
world size, a single process included. There is no hand-written sharded format. A pipeline stage
(`pipeline_stage` set: the model's parts on this rank, under the whole model's names) saves its
own weights and loads its own from any checkpoint of the same model config, so checkpoints also
reshard across stage splits (pp=2 -> pp=1 -> pp=2).

API (call on every rank, with the same arguments):

    path = save(root, step, model, optimizer, extra={"data_pos": 7}, keep_last=3)
    extra = load(root_or_path, model, optimizer)   # {"step": step, "data_pos": 7}
    latest(root) -> Path | None                     # newest complete checkpoint under root
    pick(root_or_path) -> Path                      # what load would read, verified

Layout: `root/step_00000042/` holds DCP's files (`.metadata`, `__<rank>_0.distcp`), the model
config (`model_config.json`), `train_state.pt` (rank 0's `extra` plus "step": tensors, numbers,
strings, lists, dicts, e.g. RNG and lr-scheduler state; read back with weights_only=True) and
`manifest.json` (size and sha256 of every other file). The MoE `expert_bias` buffers are part of
the model state dict.

Atomicity: a save is written into `root/.tmp-step_00000042/`; after DCP's final collective (every
rank wrote its files, rank 0 wrote `.metadata`) the ranks hash the files, rank 0 writes the
manifest (fsynced, renamed into place) and only then renames the directory to its final name. A
rank killed mid-save leaves only a temporary directory, which `latest` ignores and the next
successful save removes.

Integrity: `load` checks every file against the manifest before it touches the model. A damaged
step named explicitly raises CheckpointError naming the step and the file; given a root, `load`
takes the newest intact step and says which ones it skipped (one line on stderr). DCP then reads
into copies of the model and optimizer tensors, which are swapped in only when the read succeeded,
so a failing load leaves the model as it was (this costs one extra copy of the state while loading).

A checkpoint of another model config (any field of model_config.json, or keys and shapes) raises
a ValueError listing the differences on every rank before the first collective, so no rank hangs.
"""

import dataclasses
import hashlib
import json
import os
import re
import shutil
import sys
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from dtensor_moe.durable import fsync_path, write_atomic
from dtensor_moe.experts import gate_up_halves, gate_up_whole, split_gate_up

__all__ = ["save", "load", "latest", "pick", "verify", "CheckpointError", "SaveError"]

TRAIN_STATE = "train_state.pt"
RUN_CHECKPOINTS = "checkpoints"  # RUN_DIR/checkpoints: where the main job saves
MODEL_CONFIG = "model_config.json"
MANIFEST = "manifest.json"
ALLOW_UNVERIFIED = "DTENSOR_MOE_ALLOW_UNVERIFIED"
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


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: missing, incomplete, truncated, corrupted, or of another model."""


class SaveError(RuntimeError):
    """A save that failed on some rank (a full or read-only disk, an I/O error), raised alike on every rank once
    its temporary directory is gone: the checkpoints saved before it are untouched."""


def _steps(root: Path) -> list[tuple[int, Path]]:
    """Every step_NNNNNNNN directory under root, newest first (complete or not)."""
    if not root.is_dir():
        return []
    return sorted(
        ((int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()), reverse=True
    )


def _incomplete(path: Path) -> str:
    missing = [n for n in (".metadata", TRAIN_STATE) if not (path / n).is_file()]
    return f"incomplete: {', '.join(missing)} missing"


def pick(path) -> Path:
    """The checkpoint `load(path)` reads, checked against its manifest (a collective when distributed).

    A step directory must be intact, else CheckpointError naming the step and the file. A root (or a run
    dir, whose `checkpoints/` is one) gives its newest intact step; newer damaged or incomplete ones are
    skipped with a one-line note.
    """
    path = Path(path)
    if not _steps(path) and (path / RUN_CHECKPOINTS).is_dir():  # a run dir: the main job saves under it
        path = path / RUN_CHECKPOINTS
    if _is_complete(path) or _STEP_DIR.match(path.name):
        problem = verify(path) if _is_complete(path) else _incomplete(path) if path.is_dir() else "no such directory"
        if problem:
            raise CheckpointError(f"checkpoint {path} cannot be loaded: {problem}")
        return path
    skipped = []
    for _, candidate in _steps(path):
        problem = verify(candidate) if _is_complete(candidate) else _incomplete(candidate)
        if problem is None:
            if skipped:
                _note(f"checkpoint: skipping {'; '.join(skipped)}; loading {candidate.name}, the newest intact step")
            return candidate
        skipped.append(f"{candidate.name} ({problem})")
    if skipped:
        raise CheckpointError(f"no intact checkpoint under {str(path)!r}: {'; '.join(skipped)}")
    raise CheckpointError(
        f"no complete checkpoint at or under {str(path)!r}: expected a step_NNNNNNNN directory holding "
        f".metadata and {TRAIN_STATE} (as written by dtensor_moe.train.checkpoint.save)"
    )


def _note(msg: str):
    if _rank() == 0:
        print(msg, file=sys.stderr, flush=True)


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _digests(directory: Path, names: list[str]) -> tuple[dict[str, str], list[str]]:
    """sha256 of each file, every rank hashing its share of them; also the files that could not be read."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    mine, errors = {}, []
    for name in names[rank::world]:
        try:
            mine[name] = _sha256(directory / name)
        except OSError as e:
            errors.append(f"{name}: {e.strerror}")
    if not dist.is_initialized():
        return mine, errors
    everyone = [None] * world
    dist.all_gather_object(everyone, (mine, errors))
    return {k: v for d, _ in everyone for k, v in d.items()}, sorted({e for _, es in everyone for e in es})


def verify(ckpt) -> str | None:
    """None if every file of `ckpt` matches its manifest, else what is wrong (collective when distributed).

    A checkpoint without a manifest is a problem too (its bytes cannot be checked), unless
    ALLOW_UNVERIFIED is set in the environment (for checkpoints saved before manifests existed): then
    it passes with a one-line note.
    """
    ckpt = Path(ckpt)
    try:
        files = json.loads((ckpt / MANIFEST).read_text())["files"]
        sizes = {name: int(entry["bytes"]) for name, entry in files.items()}
        shas = {name: str(entry["sha256"]) for name, entry in files.items()}
    except FileNotFoundError:
        if os.environ.get(ALLOW_UNVERIFIED) != "1":
            return (f"{MANIFEST} is missing, so its files cannot be checked (every save writes one); "
                    f"{ALLOW_UNVERIFIED}=1 loads a checkpoint saved before manifests existed, unverified")
        _note(f"checkpoint: {ckpt.name} has no {MANIFEST} ({ALLOW_UNVERIFIED}=1); loading it unverified")
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{MANIFEST} is unreadable ({type(e).__name__}: {e})"
    problems = []
    for name, size in sorted(sizes.items()):
        f = ckpt / name
        if not f.is_file():
            problems.append(f"{name} is missing")
        elif f.stat().st_size != size:
            problems.append(f"{name} is truncated or altered ({f.stat().st_size} bytes, manifest says {size})")
    sized = sorted(n for n in sizes if (ckpt / n).is_file() and (ckpt / n).stat().st_size == sizes[n])
    digests, errors = _digests(ckpt, sized)
    problems += errors
    problems += [
        f"{n} is corrupted (sha256 differs from {MANIFEST})" for n in sized if n in digests and digests[n] != shas[n]
    ]
    return "; ".join(problems) or None


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
        raise SaveError(f"rank 0: {error}")


@contextmanager
def single_process_ok():
    """DCP warns whenever no process group exists; one process (export, import, tests) is intended."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _config_dict(model: nn.Module) -> dict | None:
    cfg = getattr(model, "config", None)
    return dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else None


def save(
    root, step: int, model: nn.Module, optimizer=None, extra: dict | None = None, keep_last: int | None = 3
) -> Path:
    """Writes `root/step_<step>` atomically and keeps the newest `keep_last` (None keeps all)."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 (or None to keep every checkpoint), got {keep_last}")
    if extra is not None and not isinstance(extra, dict):
        raise ValueError(f"extra must be a dict of plain data and tensors, got {type(extra).__name__}")
    root, final = Path(root), step_dir(root, step)
    tmp = root / f".tmp-{final.name}"
    try:
        _save(root, step, model, optimizer, extra, keep_last, tmp, final)
    except SaveError as e:
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise SaveError(f"saving checkpoint step {step} into {root} failed: {e}") from None
    return final


def _save(root: Path, step: int, model, optimizer, extra, keep_last, tmp: Path, final: Path):
    def prepare():
        shutil.rmtree(tmp, ignore_errors=True)  # left by a save that died
        tmp.mkdir(parents=True)
        write_atomic(tmp / TRAIN_STATE, lambda f: torch.save({**(extra or {}), "step": step}, f))
        cfg = _config_dict(model)
        if cfg is not None:
            text = json.dumps(cfg, indent=2, sort_keys=True) + "\n"
            write_atomic(tmp / MODEL_CONFIG, lambda f: f.write(text.encode()))

    _on_rank0(prepare)
    state = {"model": split_gate_up(get_model_state_dict(model))}
    if optimizer is not None:
        state["optim"] = _optim_in_file(get_optimizer_state_dict(model, optimizer))
    # Returns on every rank only after all ranks wrote (and fsynced) their shards and rank 0 wrote .metadata.
    try:
        with single_process_ok():
            dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp))
    except CheckpointException as e:  # a BaseException: would escape `except Exception` handlers
        raise SaveError(_failures(e)) from None
    names = sorted(p.name for p in tmp.iterdir() if p.is_file() and not p.name.endswith(".tmp"))
    digests, errors = _digests(tmp, names)
    if errors:
        raise SaveError(f"cannot read back {'; '.join(errors)}")

    def publish():
        manifest = {
            "step": step,
            "files": {n: {"bytes": (tmp / n).stat().st_size, "sha256": digests[n]} for n in names},
        }
        write_atomic(
            tmp / MANIFEST, lambda f: f.write((json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode())
        )
        fsync_path(tmp)
        _publish(tmp, final)
        _prune(root, keep_last, final)

    _on_rank0(publish)


def _failures(e: CheckpointException) -> str:
    """One line per failing rank: its exception's type and message."""
    per_rank = getattr(e, "failures", None) or {}
    if not per_rank:
        return str(e)
    return "; ".join(
        f"rank {r}: {type(f[0] if isinstance(f, tuple) else f).__name__}: {f[0] if isinstance(f, tuple) else f}"
        for r, f in sorted(per_rank.items())
    )


def _publish(tmp: Path, final: Path):
    old = final.with_name(f".old-{final.name}")
    if final.exists():  # re-saving a step (e.g. after resuming from an earlier one)
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
    tmp.rename(final)
    fsync_path(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def _prune(root: Path, keep_last: int | None, just_saved: Path):
    """Keeps the newest `keep_last` complete steps and always the one just saved (it may not be the
    highest: after resuming from an earlier step, or next to a damaged newer one). Incomplete step
    directories are not ours to judge and stay."""
    for p in root.iterdir():
        if p.name.startswith((".tmp-", ".old-")):
            shutil.rmtree(p, ignore_errors=True)
    if keep_last is None:
        return
    complete = [p for _, p in _steps(root) if _is_complete(p)]
    for p in complete[keep_last:]:
        if p != just_saved:
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


def config_diff(saved: dict | None, current: dict | None, now: str = "model") -> list[str]:
    """`field: saved X vs <now> Y` for each field both configs have and that differs. Both are model configs, the
    architecture: how a run computes the model (the main job's `[moe_run]`) is not saved, so a resume may change it."""
    if saved is None or current is None:
        return []
    return [
        f"{k}: saved {saved[k]!r} vs {now} {current[k]!r}"
        for k in sorted(saved.keys() & current.keys())
        if saved[k] != current[k]
    ]


def saved_config(ckpt) -> dict | None:
    """The checkpoint's model_config.json, or None if it has none."""
    path = Path(ckpt) / MODEL_CONFIG
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {ckpt}: {MODEL_CONFIG} is unreadable ({e})") from None


def describe_config_diff(saved: dict | None, model: nn.Module) -> str:
    diffs = config_diff(saved, _config_dict(model))
    return f"  model config differs: {_listed(diffs)}" if diffs else ""


def step_of(ckpt) -> int | None:
    """The step a checkpoint holds: from its step_NNNNNNNN name, else its manifest (None if neither says)."""
    ckpt = Path(ckpt)
    if m := _STEP_DIR.match(ckpt.name):
        return int(m.group(1))
    try:
        return int(json.loads((ckpt / MANIFEST).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def data_of(ckpt) -> dict | None:
    """The data fingerprint a checkpoint was trained on (train/data.py data_fingerprint), None where it has none (a
    `dtensor-moe import` or an older save)."""
    try:
        state = torch.load(Path(ckpt) / TRAIN_STATE, weights_only=True)
    except (OSError, RuntimeError, ValueError, EOFError):
        return None
    data = state.get("data") if isinstance(state, dict) else None
    return data if isinstance(data, dict) else None


def _holds_optimizer(metadata) -> bool:
    return any(k.startswith("optim.") for k in metadata.state_dict_metadata)


def holds_optimizer(ckpt) -> bool:
    """Whether a complete checkpoint has optimizer state (not one from `dtensor-moe import`)."""
    ckpt = Path(ckpt)
    return _is_complete(ckpt) and _holds_optimizer(dcp.FileSystemReader(ckpt).read_metadata())


def _check_compatible(ckpt: Path, metadata, model: nn.Module, model_sd: dict, want_optim: bool):
    """`model_sd`: the model's state dict under the checkpoint's names."""
    saved = {
        k.removeprefix("model."): tuple(md.size)
        for k, md in metadata.state_dict_metadata.items()
        if k.startswith("model.") and isinstance(md, TensorStorageMetadata)
    }
    if getattr(model, "pipeline_stage", False):  # the other stages' weights are not this rank's to load
        saved = {k: v for k, v in saved.items() if k in model_sd}
    problems = describe_mismatch(saved, {k: tuple(v.shape) for k, v in model_sd.items()}, "checkpoint")
    # Fields that keep every shape (n_heads, top_k, score_func, ...) still change what the weights mean.
    cfg_diff = describe_config_diff(saved_config(ckpt), model)
    if problems or cfg_diff:
        head = (
            "does not fit this model (saved from another model config?)"
            if problems
            else "was saved from another model config"
        )
        raise CheckpointError(
            f"checkpoint {ckpt} {head}:\n" + "\n".join(x for x in (problems, cfg_diff) if x)
            + f"\nBuild the model with the checkpoint's config ({ckpt / MODEL_CONFIG}) or load another checkpoint."
        )
    if want_optim and not _holds_optimizer(metadata):
        raise CheckpointError(
            f"checkpoint {ckpt} holds model weights only (written by `dtensor-moe import` or save(optimizer=None)); "
            f"pass optimizer=None to load the weights and start the optimizer fresh"
        )


def _optim_in_file(osd: dict) -> dict:
    """An optimizer state dict (get_optimizer_state_dict's, by parameter name) under the names a checkpoint holds:
    the experts' w13 / b13 moments as views of their halves (split_gate_up), a scalar such as the step shared."""
    state = {}
    for fqn, s in osd["state"].items():
        halves = gate_up_halves(fqn)
        for i, name in enumerate(halves or (fqn,)):
            state[name] = s if halves is None else {
                k: v[:, i] if isinstance(v, torch.Tensor) and v.dim() > 1 and v.shape[1] == 2 else v
                for k, v in s.items()}
    groups = [{**g, "params": [n for p in g["params"] for n in gate_up_halves(p) or (p,)]} for g in osd["param_groups"]]
    return {"state": state, "param_groups": groups}


def _optim_from_file(staged: dict, loaded: dict) -> dict:
    """_optim_in_file's inverse after a load into `loaded` (made by _optim_in_file from `staged`): the tensors are
    staged's, filled through loaded's views; the other values, replaced by the load, are taken from loaded."""
    state = {}
    for fqn, s in staged["state"].items():
        src = loaded["state"][(gate_up_halves(fqn) or (fqn,))[0]]
        state[fqn] = {k: v if isinstance(v, torch.Tensor) else src[k] for k, v in s.items()}
    # The loaded groups name every parameter the checkpoint's optimizer had (under PP, other stages' too).
    own = {p for g in staged["param_groups"] for p in g["params"]}
    groups = [{**g, "params": list(dict.fromkeys(p if p in own else gate_up_whole(p) or p for p in g["params"]))}
              for g in loaded["param_groups"]]
    return {"state": state, "param_groups": groups}


def _check_views(staged: dict, state: dict) -> None:
    """Every tensor the load fills through a view (a half of w13, of its moments) shares its storage with the staged
    tensor: DCP copies into the views in place, so a copy there would leave the staged tensor unloaded."""
    checks = [(h, t, state["model"][h]) for k, t in staged["model"].items() for h in gate_up_halves(k) or ()]
    if "optim" in staged:
        checks += [(f"{h} {name}", v, state["optim"]["state"][h][name])
                   for k, s in staged["optim"]["state"].items() for h in gate_up_halves(k) or ()
                   for name, v in s.items() if isinstance(v, torch.Tensor) and v.dim() > 1]
    for name, whole, view in checks:
        if _local(whole).untyped_storage().data_ptr() != _local(view).untyped_storage().data_ptr():
            raise RuntimeError(f"checkpoint load: {name} is not a view of its w13 (this torch copies DTensor slices)")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _staged(obj):
    """The same nested state with every tensor replaced by an uninitialized copy (DTensors stay DTensors)."""
    if isinstance(obj, torch.Tensor):
        return torch.empty_like(obj)
    if isinstance(obj, dict):
        return {k: _staged(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_staged(v) for v in obj]
    return obj


def load(path, model: nn.Module, optimizer=None, *, fresh_optimizer_ok: bool = False) -> dict:
    """Loads `path` (a checkpoint, or a root: its newest intact step) into `model` / `optimizer` on any mesh.

    Returns the saved `extra` dict with "step". Call on every rank of the model's process group.
    Raises CheckpointError (a ValueError) for a damaged checkpoint, ValueError for another model;
    either way the model and optimizer are left as they were. A weights-only checkpoint (from
    `dtensor-moe import`) needs optimizer=None, or fresh_optimizer_ok=True: then the optimizer is
    left untouched (fresh) and a one-line note says so.
    """
    ckpt = pick(path)
    try:
        metadata = dcp.FileSystemReader(ckpt).read_metadata()  # every rank reads it: no collective
        extra = torch.load(ckpt / TRAIN_STATE, weights_only=True)
    except Exception as e:  # noqa: BLE001 - an unverified (manifest-less) checkpoint may hold anything
        raise CheckpointError(f"checkpoint {ckpt} cannot be read: {type(e).__name__}: {e}") from None
    if optimizer is not None and fresh_optimizer_ok and not _holds_optimizer(metadata):
        _note(f"checkpoint: {ckpt.name} holds model weights only; the optimizer starts fresh at step {extra['step']}")
        optimizer = None
    model_sd = get_model_state_dict(model)
    _check_compatible(ckpt, metadata, model, split_gate_up(model_sd), optimizer is not None)
    staged = {"model": _staged(model_sd)}
    # Loaded in place through views under the checkpoint's names (torchtitan's w1 / w3 for our w13).
    state = {"model": split_gate_up(staged["model"])}
    if optimizer is not None:
        staged["optim"] = _staged(get_optimizer_state_dict(model, optimizer))  # allocates moments if still empty
        state["optim"] = _optim_in_file(staged["optim"])
    _check_views(staged, state)
    try:
        with single_process_ok():
            dcp.load(state, storage_reader=dcp.FileSystemReader(ckpt))
    except CheckpointException as e:  # a BaseException: would escape `except Exception` handlers
        raise CheckpointError(f"checkpoint {ckpt} cannot be read: {_failures(e)}") from None
    except Exception as e:  # noqa: BLE001 - named, with the step, instead of a bare torch traceback
        raise CheckpointError(f"checkpoint {ckpt} cannot be read: {type(e).__name__}: {e}") from None
    set_model_state_dict(model, staged["model"])
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, _optim_from_file(staged["optim"], state["optim"]))
    return extra
