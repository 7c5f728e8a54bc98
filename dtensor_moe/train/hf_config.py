"""`[model] hf_path`: the main job's model fields read from a Hugging Face MoE checkpoint's config.json.

The checkpoint fixes the architecture (sizes, layers, heads, vocabulary, routing); [model] may add only the
balance fields of the MoE (load_balance and the loss coefficients; how it runs is [moe_run]). Torch is imported
only when hf_path is set.
"""

import importlib.util
import json
from pathlib import Path

# ModelConfig's dense fields -> their config.json field (and its default where transformers has one).
_DENSE = {"vocab_size": ("vocab_size",), "n_layers": ("num_hidden_layers",), "n_heads": ("num_attention_heads",),
          "tie_embeddings": ("tie_word_embeddings", False), "max_seq_len": ("max_position_embeddings",),
          "norm_eps": ("rms_norm_eps",)}


def _read_config(path: str) -> tuple[dict, str]:
    cfg = Path(path) / "config.json"
    if not cfg.is_file():
        raise ValueError(f"model.hf_path {path!r} has no config.json; give a Hugging Face checkpoint directory "
                         "(what save_pretrained writes)")
    text = cfg.read_text()
    try:
        return json.loads(text), text
    except ValueError as e:
        raise ValueError(f"{cfg} is not valid JSON: {e}") from None


def hf_model_fields(values: dict) -> dict:
    """[model]'s `values` (with hf_path) completed from the checkpoint's config.json: a ValueError names a given
    field the checkpoint fixes otherwise, or a balance field the family cannot save back."""
    path = values["hf_path"]
    missing = [m for m in ("transformers", "safetensors") if importlib.util.find_spec(m) is None]
    if missing:  # checked before dtensor_moe.hf, which imports them, is
        raise ValueError(f"model.hf_path {path!r} needs {' and '.join(missing)} (transformers >= 5), not installed "
                         "here: pip install 'dtensor_moe[hf]'")
    from dtensor_moe.config import MoEConfig
    from dtensor_moe.hf.checkpoint import check_hf_checkpoint
    from dtensor_moe.hf.families import HF_FIXED_FIELDS, family, getter, moe_config_from_hf, with_balance_fields

    hf, text = _read_config(path)
    try:
        get = getter(hf)
        moe = moe_config_from_hf(hf)
        fixed = {name: get(*field) for name, field in _DENSE.items()}
        check_hf_checkpoint(path, hf)
    except (ValueError, TypeError) as e:
        raise ValueError(f"model.hf_path {path!r}: {e}") from None
    arch = [*HF_FIXED_FIELDS, *(("load_balance",) if moe.load_balance == "aux_free_bias" else ())]
    fixed.update({n: getattr(moe, n) for n in arch})
    fixed["hf_config"] = text
    conflicts = [f"model.{k} = {values[k]!r} (the checkpoint's: {v!r})" for k, v in fixed.items()
                 if k in values and values[k] != v and k != "hf_config"]
    if "hf_config" in values and values["hf_config"] != text:
        conflicts.append(f"model.hf_config differs from {path}/config.json (it is filled in from there)")
    if conflicts:
        raise ValueError(f"model.hf_path {path!r} fixes the architecture; {'; '.join(conflicts)}: drop these keys "
                         "from [model] (only the MoE's balance fields may be given), or start from another "
                         "checkpoint")
    options = {k: v for k, v in values.items() if k in MoEConfig.__dataclass_fields__}
    try:
        with_balance_fields(family(get("model_type")), moe, {k: v for k, v in options.items() if k not in arch})
    except ValueError as e:
        raise ValueError(f"model.hf_path {path!r}: {e}") from None
    return {**values, **fixed}


def check_hf_parallel(path: str, parallel, training) -> None:
    """What training a transformers model supports: expert axes and FSDP2 / HSDP, eagerly."""
    bad = {f"parallel.{a}": getattr(parallel, a) for a in ("tp", "cp", "pp") if getattr(parallel, a) != 1}
    if training.compile:
        bad["training.compile"] = True
    if bad:
        raise ValueError(f"model.hf_path {path!r} trains the transformers model with expert parallelism (ep, etp, "
                         f"edp) and FSDP2 / HSDP (dp_replicate x dp_shard) for the rest; {bad} are not supported "
                         "there; valid: parallel.tp = cp = pp = 1, training.compile = false")


def checkpoint_numel(path: str) -> int:
    """Elements of every tensor of the checkpoint directory (its index's, else its safetensors files'), from their
    headers alone."""
    from dtensor_moe.hf.reader import checkpoint_files

    total = 0
    for entry in checkpoint_files(path).values():
        count = 1
        for d in entry.shape:
            count *= d
        total += count
    return total
