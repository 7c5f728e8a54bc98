"""`dtensor-moe export CKPT --hf OUT --titan-config NAME`: a torchtitan checkpoint written through the hook as a
Hugging Face directory, afterwards and in one process (torchtitan's own `--checkpoint.last_save_in_hf` writes one
only at a run's last step)."""

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from dtensor_moe.hf.convert import check_tensors
from dtensor_moe.hf.model import write_hf_dir
from dtensor_moe.titan.config_registry import CONFIGS
from dtensor_moe.titan.hf import hf_config, hf_model_type
from dtensor_moe.train.checkpoint import single_process_ok


def export_checkpoint_hf(ckpt, out_dir, config_name: str, force: bool = False):
    """`dtensor-moe export CKPT --hf OUT --titan-config NAME`: a torchtitan DCP checkpoint written through the hook
    (`DUMP/checkpoint/step-N`, full or model-only) as a Hugging Face directory, in this one process: the model
    `NAME` builds (on the meta device) names every tensor read, the family's state-dict adapter maps them to
    its keys (its offline path: whole experts split per expert, or gpt-oss's transposed), and the family's
    config.json is written with the checkpoint's dtype. A tensor the checkpoint lacks or holds in another shape,
    or a trained tensor the family has no key for (the routing bias of Qwen3-MoE and gpt-oss), is a ValueError
    naming it."""
    if config_name not in CONFIGS:
        raise ValueError(f"--titan-config {config_name!r} is not one of the hook's configs; valid: {list(CONFIGS)}")
    spec = CONFIGS[config_name]().model_spec
    kind = hf_model_type(spec.model)
    if kind is None or spec.state_dict_adapter is None:
        raise ValueError(f"--titan-config {config_name}: only Qwen3-MoE, DeepSeek-V3 and gpt-oss models export to "
                         "Hugging Face; valid: a qwen3_*, deepseek_v3_* or gpt_oss_* config")
    adapter = spec.state_dict_adapter(spec.model, None)
    with torch.device("meta"):
        want = {k: (tuple(t.shape), t.dtype) for k, t in spec.model.build().state_dict().items()}
    # The aux-loss-free routing bias: a tensor of the checkpoint's where the family holds it (DeepSeek-V3),
    # otherwise the run must have trained without it (gpt-oss's configs train it unless told not to).
    keeps_bias = "layers.{}.moe.expert_bias_E" in set(getattr(adapter, "from_hf_map", {}).values())
    if not keeps_bias:
        want = {k: v for k, v in want.items() if not k.endswith("moe.expert_bias_E")}
    ckpt = Path(ckpt)
    try:
        metadata = dcp.FileSystemReader(ckpt).read_metadata()
    except Exception as e:  # noqa: BLE001 - a missing or foreign folder: FileNotFoundError, pickle errors, ...
        raise ValueError(f"{ckpt} is not a DCP checkpoint ({type(e).__name__}: {e})") from None
    held = {k: md for k, md in metadata.state_dict_metadata.items() if isinstance(md, TensorStorageMetadata)}
    check_tensors({k: tuple(held[k].size) for k in want if k in held}, {k: s for k, (s, _) in want.items()},
                  f"{ckpt} is not a checkpoint of --titan-config {config_name}")
    trained_bias = sorted(k for k in held if k.endswith("moe.expert_bias_E") and k not in want)
    if trained_bias:
        raise ValueError(f"{ckpt} holds {trained_bias[0]} ({len(trained_bias)} layers), a routing bias trained with "
                         f"--dtensor_moe.load_balance_coeff that {config_name} has no place for in {kind}'s Hugging "
                         "Face format; valid: a run trained without it (--dtensor_moe.load_balance_coeff 0)")
    state = {k: torch.empty(s, dtype=held[k].properties.dtype) for k, (s, _) in want.items()}
    with single_process_ok():
        dcp.load(state, storage_reader=dcp.FileSystemReader(ckpt), no_dist=True)
    tensors = adapter.to_hf(state)
    dtypes = {str(t.dtype).removeprefix("torch.") for t in tensors.values()}
    return write_hf_dir(out_dir, {k: v.contiguous() for k, v in tensors.items()},
                        hf_config(spec.model, dtypes.pop() if len(dtypes) == 1 else "float32"), force)
