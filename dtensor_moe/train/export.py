"""Unsharded safetensors export of a checkpoint's model weights, and import into any mesh.

`dtensor-moe export CKPT OUT` writes OUT/model.safetensors and OUT/config.json (the ModelConfig).
Keys are the model's own state-dict FQNs, so they map one-to-one to torchtitan's MoE layout:

    tok_embeddings.weight                    [V, D]
    layers.{i}.attention_norm.weight         [D]
    layers.{i}.attention.wqkv.weight         [3D, D]
    layers.{i}.attention.wo.weight           [D, D]
    layers.{i}.ffn_norm.weight               [D]
    layers.{i}.moe.router.gate.weight        [E, D]
    layers.{i}.moe.experts.w1 / w3           [E, F, D]   experts stacked on dim 0
    layers.{i}.moe.experts.w2                [E, D, F]
    layers.{i}.moe.shared_experts.w{1,3}.weight [F*S, D], .w2.weight [D, F*S]   (num_shared_experts S > 0)
    layers.{i}.moe.expert_bias               [E]         (load_balance = "aux_free_bias")
    norm.weight                              [D]
    output.weight                            [V, D]      (absent with tie_embeddings)

`dtensor-moe import SAFETENSORS OUT_CKPT` writes a weights-only checkpoint (resume it with a fresh
optimizer); `load_safetensors_into(model, path)` fills a plain or parallelized model on any mesh.
"""

import json
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from dtensor_moe.train.checkpoint import MODEL_CONFIG, TRAIN_STATE, single_process_ok, describe_config_diff, describe_mismatch, resolve, save

WEIGHTS = "model.safetensors"
CONFIG = "config.json"


def export_checkpoint(ckpt, out_dir) -> Path:
    """Reads the model part of a checkpoint (any mesh it was saved from) in this one process."""
    ckpt = resolve(ckpt)
    if not (ckpt / MODEL_CONFIG).is_file():
        raise ValueError(f"{ckpt} has no {MODEL_CONFIG}; export needs a checkpoint saved from a model with a dataclass config")
    metadata = dcp.FileSystemReader(ckpt).read_metadata()
    tensors = {
        k.removeprefix("model."): torch.empty(md.size, dtype=md.properties.dtype)
        for k, md in metadata.state_dict_metadata.items()
        if k.startswith("model.") and isinstance(md, TensorStorageMetadata)
    }
    with single_process_ok():
        # no_dist: even inside a distributed job this is a local read, not a collective.
        dcp.load({"model": tensors}, storage_reader=dcp.FileSystemReader(ckpt), no_dist=True)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    step = torch.load(ckpt / TRAIN_STATE, weights_only=True)["step"]
    save_file(tensors, out / WEIGHTS, metadata={"format": "pt", "step": str(step)})
    (out / CONFIG).write_text((ckpt / MODEL_CONFIG).read_text())
    return out / WEIGHTS


def _weights_path(path) -> Path:
    path = Path(path)
    return path / WEIGHTS if path.is_dir() else path


def read_config(path) -> dict:
    cfg = _weights_path(path).with_name(CONFIG)
    if not cfg.is_file():
        raise ValueError(f"no {CONFIG} next to {_weights_path(path)}; `dtensor-moe export` writes both files")
    return json.loads(cfg.read_text())


def load_safetensors_into(model: nn.Module, path) -> nn.Module:
    """Fills `model` (plain, or parallelized on any mesh) from an exported file; call on every rank."""
    path = _weights_path(path)
    with safe_open(path, framework="pt") as f:
        found = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    expected = {k: tuple(v.shape) for k, v in get_model_state_dict(model).items()}
    problems = describe_mismatch(found, expected, "file")
    if problems:  # raised on every rank before the collectives that distribute the weights
        cfg_file = path.with_name(CONFIG)
        cfg_diff = describe_config_diff(json.loads(cfg_file.read_text()) if cfg_file.is_file() else None, model)
        raise ValueError(f"{path} does not fit this model:\n{problems}" + (f"\n{cfg_diff}" if cfg_diff else ""))
    # Each rank holds the full tensors and keeps its own slices of them.
    set_model_state_dict(model, load_file(path), options=StateDictOptions(full_state_dict=True))
    return model


def add_export_arguments(parser):
    parser.add_argument("ckpt", help="checkpoint directory, or a run's checkpoint root (its latest is used)")
    parser.add_argument("out", help=f"output directory for {WEIGHTS} and {CONFIG}")


def run_export(args) -> int:
    print(export_checkpoint(args.ckpt, args.out))
    return 0


def add_import_arguments(parser):
    parser.add_argument("safetensors", help=f"{WEIGHTS} written by `dtensor-moe export`, or its directory")
    parser.add_argument("out_ckpt", help="checkpoint root to write step_<step>/ into (resume from it with --resume)")
    parser.add_argument("--step", type=int, default=0, help="step number to record in the checkpoint (default 0)")


def run_import(args) -> int:
    from dtensor_moe.train.config import ModelConfig
    from dtensor_moe.train.model import MoETransformer

    model = MoETransformer(ModelConfig.from_dict(read_config(args.safetensors)))
    load_safetensors_into(model, args.safetensors)
    print(save(args.out_ckpt, args.step, model, keep_last=None))
    return 0
