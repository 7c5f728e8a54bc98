"""`dtensor-moe import --hf` / `export --hf`: the MoE layers of a Hugging Face checkpoint as a file
in our layout, and back under the family's keys.

import --hf HF_DIR OUT: OUT/model.safetensors holds `layers.{i}.moe.<our name>` for every MoE
decoder layer i (read layer by layer, lazily, each layer's keys and shapes checked first),
OUT/config.json the family, the layers, our `MoEConfig` and the file's sha256. export --hf SRC OUT:
SRC is such a directory or a `dtensor-moe export` of the main job (its config.json a ModelConfig;
then `--model-type` names the family); OUT gets model.safetensors under the family's keys (what
save_pretrained writes for those layers; the main job's other weights have no Hugging Face
counterpart and stay out) and config.json with the family's MoE and layer config fields, so that
import --hf of OUT gives SRC's MoE layers back bit for bit. Both refuse to replace existing files
without --force, check the source (its sha256, its tensors' keys and shapes) before writing, and
write under temporary names renamed into place.
"""

import dataclasses
import hashlib
import json
import re
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import load_file, save_file

from dtensor_moe.config import MoEConfig
from dtensor_moe.experts import gate_up_whole
from dtensor_moe.hf.checkpoint import read_hf_config
from dtensor_moe.hf.convert import check_tensors, layer_prefix, moe_shapes, read_hf_moe, to_hf
from dtensor_moe.hf.families import FAMILIES, family, getter, hf_fields, moe_config_from_hf
from dtensor_moe.hf.model import checked_output_dir, hf_state_dict, tensor_bytes, write_files, write_hf_dir
from dtensor_moe.hf.reader import SafetensorsReader, read_header
from dtensor_moe.train.config import ModelConfig
from dtensor_moe.train.export import export_checkpoint, read_json

WEIGHTS, CONFIG = "model.safetensors", "config.json"


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _json(path: Path) -> dict:
    if not path.is_file():
        raise ValueError(f"no {path.name} in {path.parent}")
    config = read_json(path)
    if not isinstance(config, dict):
        raise ValueError(f"{path} holds a JSON {type(config).__name__}; expected an object of config fields")
    return config


def _write(out_dir, tensors: dict, config: dict, force: bool) -> Path:
    """OUT/model.safetensors and its config.json (with the file's sha256), through `write_files`: atomic, and a full
    or read-only disk is one ValueError that leaves nothing behind."""
    def config_json(path: Path):
        path.write_text(json.dumps({**config, "sha256": _sha256(path.with_name(WEIGHTS))}, indent=2) + "\n")

    out = checked_output_dir(out_dir, force)
    write_files(out, {WEIGHTS: lambda p: save_file(tensors, p, metadata={"format": "pt"}), CONFIG: config_json},
                tensor_bytes(tensors))
    return out / WEIGHTS


def import_hf(hf_dir, out_dir, force: bool = False) -> Path:
    hf_dir = Path(hf_dir)
    hf_config = read_hf_config(hf_dir)
    get = getter(hf_config)
    fam = family(get("model_type"))
    config = moe_config_from_hf(hf_config)
    reader = SafetensorsReader(hf_dir)
    shapes = moe_shapes(config)
    layers = fam.moe_layer_ids(get)
    tensors = {}
    for i in layers:
        layer = read_hf_moe(reader, fam, layer_prefix(reader.keys(), fam, i), shapes)
        tensors.update({f"layers.{i}.moe.{n}": t.contiguous() for n, t in layer.items()})
    return _write(out_dir, tensors, {"hf_model_type": fam.model_type, "moe_layers": layers,
                                     "num_hidden_layers": get("num_hidden_layers"), "moe": dataclasses.asdict(config)},
                  force)


def _source(src: Path, model_type: str | None) -> tuple[str, MoEConfig, list[int], int]:
    """(family, our config, MoE layers, num_hidden_layers) of an import --hf or export directory."""
    cfg = _json(src / CONFIG)
    if "hf_model_type" in cfg:  # written by import --hf
        missing = [k for k in ("moe", "moe_layers", "num_hidden_layers", "sha256") if k not in cfg]
        if missing:
            raise ValueError(f"{src / CONFIG} lacks {missing}, which import --hf writes; import the checkpoint again")
        if model_type not in (None, cfg["hf_model_type"]):
            raise ValueError(f"{src} holds {cfg['hf_model_type']} layers; --model-type {model_type} differs")
        if _sha256(src / WEIGHTS) != cfg["sha256"]:
            raise ValueError(f"{src / WEIGHTS} is corrupted (sha256 differs from {CONFIG})")
        return cfg["hf_model_type"], MoEConfig(**cfg["moe"]), list(cfg["moe_layers"]), cfg["num_hidden_layers"]
    if model_type is None:
        raise ValueError(f"{src} is the main job's export; name the Hugging Face family with --model-type "
                         f"(valid: {sorted(FAMILIES)})")
    model = ModelConfig.from_dict(cfg)
    return model_type, model.moe_config(), list(range(model.n_layers)), model.n_layers


def export_hf(src, out_dir, model_type: str | None = None, force: bool = False) -> Path:
    """`src`: an import --hf or export directory, or a main-job checkpoint (exported first, to a
    temporary directory)."""
    src = Path(src)
    if not (src / WEIGHTS).is_file():
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            export_checkpoint(src, tmp)
            return export_hf(tmp, out_dir, model_type, force)
    if _json(src / CONFIG).get("hf_config"):
        return _export_hf_model(src, out_dir, model_type, force)
    model_type, config, layers, num_hidden_layers = _source(src, model_type)
    fam = family(model_type)
    fields = hf_fields(fam, config, layers, num_hidden_layers)
    out = {}
    read_header(src / WEIGHTS)  # a damaged file is named before safetensors reads it
    with safe_open(src / WEIGHTS, framework="pt") as f:
        have = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys() if re.match(r"layers\.\d+\.moe\.", k)}
        # The main job's export holds the experts' gate and up as its checkpoints do, torchtitan's w1 / w3 (b1 / b3);
        # import --hf writes our w13 (b13). Each is checked in its own layout; to_hf takes either.
        shapes = moe_shapes(config, halves=any(gate_up_whole(k) for k in have))
        check_tensors(have, {f"layers.{i}.moe.{n}": s for i in layers for n, s in shapes.items()},
                      f"{src / WEIGHTS} does not hold the {model_type} MoE layers {layers} its {CONFIG} describes")
        for i in layers:
            state = {n: f.get_tensor(f"layers.{i}.moe.{n}") for n in shapes}
            out.update(to_hf(state, fam, f"model.layers.{i}.{fam.blocks[0]}."))
    return _write(out_dir, out, fields, force)


# Besides the weights and config.json, what from_pretrained and generate read from the checkpoint the run started
# from (copied when it is still there).
_COMPANIONS = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
               "tokenizer.model", "vocab.json", "merges.txt")


def _export_hf_model(src: Path, out_dir, model_type: str | None, force: bool) -> Path:
    """A main-job export of a run started from a Hugging Face checkpoint (`[model] hf_path`): the whole model
    under the family's keys with the checkpoint's config.json, a directory from_pretrained loads."""
    model = ModelConfig.from_dict(_json(src / CONFIG))
    hf_config = json.loads(model.hf_config)
    if model_type not in (None, hf_config["model_type"]):
        raise ValueError(f"{src} holds a {hf_config['model_type']} model; --model-type {model_type} differs")
    read_header(src / WEIGHTS)
    tensors = hf_state_dict(load_file(src / WEIGHTS), hf_config["model_type"], model.tie_embeddings)
    companions = [Path(model.hf_path) / name for name in _COMPANIONS if (Path(model.hf_path) / name).is_file()]
    return write_hf_dir(out_dir, tensors, hf_config, force, companions) / WEIGHTS
