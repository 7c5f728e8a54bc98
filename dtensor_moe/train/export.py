"""Unsharded safetensors export of a checkpoint's model weights, and import into any mesh.

`dtensor-moe export CKPT OUT` writes OUT/model.safetensors and OUT/config.json (the ModelConfig).
Keys are the checkpoint's: the model's state-dict FQNs under torchtitan's MoE layout (our experts' w13 / b13
held as w1 and w3 / b1 and b3, stacked back on import: experts.split_gate_up / join_gate_up):

    tok_embeddings.weight                    [V, D]
    layers.{i}.attention_norm.weight         [D]
    layers.{i}.attention.w{q,k,v,o}.weight   [D, D]
    layers.{i}.ffn_norm.weight               [D]
    layers.{i}.moe.router.gate.weight        [E, D]
    layers.{i}.moe.experts.w1 / w3           [E, F, D]   experts stacked on dim 0
    layers.{i}.moe.experts.w2                [E, D, F]
    layers.{i}.moe.shared_experts.w{1,3}.weight [F*S, D], .w2.weight [D, F*S]   (num_shared_experts S > 0)
    layers.{i}.moe.expert_bias               [E]         (load_balance = "aux_free_bias")
    norm.weight                              [D]
    output.weight                            [V, D]      (absent with tie_embeddings)

`dtensor-moe import SAFETENSORS OUT_CKPT [--step N]` writes a weights-only checkpoint (resume it
with a fresh optimizer); it refuses to replace an existing step unless --force, and says when that
deletes the step's optimizer state. `load_safetensors_into(model, path)` fills a plain or
parallelized model on any mesh. Bad input is one line on stderr and rc 2 for both commands.
With `--hf` both commands move MoE layers between Hugging Face checkpoints and our layout instead
(dtensor_moe/train/hf_checkpoint.py, docs/hf.md).
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from dtensor_moe.experts import join_gate_up, split_gate_up
from dtensor_moe.hf.model import checked_output_dir, tensor_bytes, write_files
from dtensor_moe.train.checkpoint import (
    MODEL_CONFIG,
    TRAIN_STATE,
    CheckpointError,
    SaveError,
    describe_config_diff,
    describe_mismatch,
    holds_optimizer,
    pick,
    save,
    single_process_ok,
    step_dir,
)

__all__ = ["export_checkpoint", "import_weights", "load_safetensors_into", "read_config", "WEIGHTS", "CONFIG"]

WEIGHTS = "model.safetensors"
CONFIG = "config.json"


def export_checkpoint(ckpt, out_dir, force: bool = False) -> Path:
    """Reads the model part of a checkpoint (any mesh it was saved from) in this one process and writes it to
    `out_dir`; a directory already holding model.safetensors or config.json is refused unless `force`."""
    checked_output_dir(out_dir, force)  # before the read: a refusal costs nothing
    ckpt = pick(ckpt)  # verified against its manifest
    if not (ckpt / MODEL_CONFIG).is_file():
        raise ValueError(
            f"{ckpt} has no {MODEL_CONFIG}; export needs a checkpoint saved from a model with a dataclass config"
        )
    metadata = dcp.FileSystemReader(ckpt).read_metadata()
    tensors = {
        k.removeprefix("model."): torch.empty(md.size, dtype=md.properties.dtype)
        for k, md in metadata.state_dict_metadata.items()
        if k.startswith("model.") and isinstance(md, TensorStorageMetadata)
    }
    try:
        with single_process_ok():
            # no_dist: even inside a distributed job this is a local read, not a collective.
            dcp.load({"model": tensors}, storage_reader=dcp.FileSystemReader(ckpt), no_dist=True)
        step = torch.load(ckpt / TRAIN_STATE, weights_only=True)["step"]
    except (Exception, dcp.api.CheckpointException) as e:  # CheckpointException is a BaseException
        raise CheckpointError(f"checkpoint {ckpt} cannot be read: {type(e).__name__}: {e}") from None
    out = Path(out_dir)
    # Written into a temporary directory and moved into place: an interrupted export leaves no half file behind, a
    # full or read-only disk is one line naming OUT.
    config = (ckpt / MODEL_CONFIG).read_text()
    write_files(out, {WEIGHTS: lambda p: save_file(tensors, p, metadata={"format": "pt", "step": str(step)}),
                      CONFIG: lambda p: p.write_text(config)}, tensor_bytes(tensors))
    return out / WEIGHTS


def _weights_path(path) -> Path:
    path = Path(path)
    return path / WEIGHTS if path.is_dir() else path


def read_config(path) -> dict:
    """The model config an export carries: the config.json written next to its model.safetensors.

    Args:
        path (str | Path): the exported model.safetensors, or the directory holding it.

    Returns:
        dict: the ModelConfig's fields (`ModelConfig.from_dict` builds the model's config from it).

    Raises:
        ValueError: no safetensors file there, no config.json next to it, or a config.json that is not valid JSON.
    """
    weights = _weights_path(path)
    if not weights.is_file():
        raise ValueError(
            f"no safetensors file at {str(weights)!r}; give {WEIGHTS} written by `dtensor-moe export`, or its directory"
        )
    cfg = weights.with_name(CONFIG)
    if not cfg.is_file():
        raise ValueError(f"no {CONFIG} next to {weights}; `dtensor-moe export` writes both files")
    return read_json(cfg)


def read_json(path: Path) -> dict:
    """A JSON file's contents; a malformed one is a ValueError naming the file."""
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None


def load_safetensors_into(model: nn.Module, path) -> nn.Module:
    """Fills `model` (plain, or parallelized on any mesh) from an exported file; call on every rank."""
    path = _weights_path(path)
    try:
        tensors = load_file(path)  # read before the model is touched: a damaged file changes nothing
    except FileNotFoundError:
        raise ValueError(f"no safetensors file at {str(path)!r}") from None
    except Exception as e:  # noqa: BLE001 - safetensors raises its own SafetensorError for damaged files
        raise ValueError(f"{path} is not a readable safetensors file ({type(e).__name__}: {e})") from None
    found = {k: tuple(t.shape) for k, t in tensors.items()}
    with torch.device("meta"):  # compared under the file's names
        model_state = {k: torch.empty(v.shape) for k, v in get_model_state_dict(model).items()}
    expected = {k: tuple(v.shape) for k, v in split_gate_up(model_state).items()}
    problems = describe_mismatch(found, expected, "file")
    cfg_file = path.with_name(CONFIG)
    # Fields that keep every shape (n_heads, top_k, ...) still change what the weights mean.
    cfg_diff = describe_config_diff(json.loads(cfg_file.read_text()) if cfg_file.is_file() else None, model)
    if problems or cfg_diff:  # raised on every rank before the collectives that distribute the weights
        raise ValueError(f"{path} does not fit this model:\n" + "\n".join(x for x in (problems, cfg_diff) if x))
    # Each rank holds the full tensors and keeps its own slices of them.
    set_model_state_dict(model, join_gate_up(tensors), options=StateDictOptions(full_state_dict=True))
    return model


def import_weights(safetensors, out_ckpt, step: int = 0, force: bool = False) -> Path:
    """Writes `out_ckpt/step_<step>` (weights only); an existing step is replaced only with force."""
    from dtensor_moe.train.config import ModelConfig
    from dtensor_moe.train.model import build_model

    if step < 0:
        raise ValueError(f"--step must be >= 0, got {step}")
    target = step_dir(out_ckpt, step)
    replaced_optimizer = False
    if target.exists():
        try:
            full = holds_optimizer(target)
        except Exception:  # noqa: BLE001 - unreadable metadata: assume the worst
            full = True
        what = "a full training checkpoint (model + optimizer state)" if full else "a checkpoint"
        if not force:
            raise ValueError(
                f"{target} already exists and holds {what}; pass --force to replace it with weights only, "
                f"or choose another --step"
            )
        replaced_optimizer = full
    model = build_model(ModelConfig.from_dict(read_config(safetensors)))
    load_safetensors_into(model, safetensors)
    try:
        path = save(out_ckpt, step, model, keep_last=None)
    except (SaveError, OSError) as e:  # a full or read-only disk: save leaves no temporary directory behind
        raise ValueError(f"cannot write {target}: {' '.join(str(e).split())}; free space, make it writable, or "
                         "choose another OUT_CKPT") from None
    if replaced_optimizer:
        print(f"replaced {path}: its optimizer state is deleted; resuming it starts AdamW fresh", file=sys.stderr)
    return path
