"""A Hugging Face checkpoint directory checked whole before anything loads it (`[model] hf_path`'s pre-launch
check): config.json's fields (each under its own key and JSON type), the shard index and every shard's header, the
MoE layers' tensors in the family's layout, and every other tensor transformers' model of that config.json holds
(built on the meta device: no weight is read or allocated). The first problem is one ValueError naming the file or
the tensor key and what was expected: a checkpoint missing a tensor never trains from a random one."""

import json
import re
from pathlib import Path

import torch

from dtensor_moe.hf.convert import check_hf_layer, check_tensors, layer_prefix, moe_shapes
from dtensor_moe.hf.families import family, getter, moe_config_from_hf
from dtensor_moe.hf.reader import Entry, checkpoint_files

CONFIG = "config.json"


def read_hf_config(directory) -> dict:
    """config.json of a checkpoint directory, a JSON object; a ValueError names the file otherwise."""
    path = Path(directory) / CONFIG
    if not path.is_file():
        raise ValueError(f"{Path(directory)} has no {CONFIG}; expected a Hugging Face checkpoint directory (what "
                         "save_pretrained writes)")
    try:
        config = json.loads(path.read_text())
    except (ValueError, OSError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} holds a JSON {type(config).__name__}; expected an object of config fields")
    return config


def _model_tensors(hf_config: dict) -> tuple[dict[str, tuple], set[str], list[str]]:
    """(key -> shape of every tensor transformers' model of `hf_config` loads, the keys it may leave out (a tied
    head), the patterns of keys it ignores in a checkpoint), from the model built on the meta device."""
    import transformers
    from transformers.utils import logging as hf_logging

    try:
        config = transformers.AutoConfig.for_model(**hf_config)
    except Exception as e:  # noqa: BLE001 - transformers' own validation (type errors, unknown values)
        raise ValueError(f"{CONFIG}: transformers refuses it: {' '.join(str(e).split())[:400]}") from None
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
    finally:
        hf_logging.set_verbosity(verbosity)
    shapes = {k: tuple(t.shape) for k, t in model.state_dict().items()}
    tied = set(getattr(model, "_tied_weights_keys", None) or ()) if getattr(config, "tie_word_embeddings", False) \
        else set()
    return shapes, tied, list(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())


def check_hf_checkpoint(directory, hf_config: dict | None = None) -> dict[str, Entry]:
    """Every tensor of the checkpoint at `directory` (key -> file, dtype, shape) once config.json (`hf_config`, read
    from there if None) and the tensors agree: every key transformers' model of it loads is there in its shape,
    the MoE layers hold exactly their family's keys and shapes, and no other key is left over. A ValueError names
    the first problem (its file or key, and what was expected)."""
    directory = Path(directory)
    hf_config = read_hf_config(directory) if hf_config is None else hf_config
    get = getter(hf_config)
    fam = family(get("model_type"))
    moe = moe_config_from_hf(hf_config)
    files = checkpoint_files(directory)
    have = {k: e.shape for k, e in files.items()}
    shapes = moe_shapes(moe)
    theirs, ours = [], []  # the MoE blocks' prefixes: on disk (Mixtral's may say block_sparse_moe), in the model
    for i in fam.moe_layer_ids(get):
        prefix = layer_prefix(set(have), fam, i)
        check_hf_layer(have, fam, prefix, shapes)
        theirs.append(prefix)
        ours.append(f"model.layers.{i}.{fam.blocks[-1]}.")
    want, optional, ignored = _model_tensors(hf_config)
    want = {k: s for k, s in want.items() if not k.startswith(tuple(ours))}
    rest = {k: s for k, s in have.items() if not k.startswith(tuple(theirs))
            and not any(re.search(p, k) for p in ignored)}
    rest.update({k: want[k] for k in optional if k in want and k not in rest})
    check_tensors(rest, want, f"{directory} does not hold the {fam.model_type} model its {CONFIG} describes")
    return files
