"""Hugging Face MoE causal LMs trained directly: their sparse blocks swapped for our `MoE`, the model
parallelized (EP / ETP / EDP for the experts, FSDP2 / HSDP for the rest) and saved back as a directory
`from_pretrained` loads.

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    parallelize_hf_model(model, MoEParallelDims(world, ep=2), device_type="cuda")
    ...  # train: loss = model(input_ids, labels=labels).loss + balance_loss(model)
    save_hf(model, out_dir)  # every rank calls it; rank 0 writes

Decoder layers are `model.model.layers` in every family we map (Qwen3-MoE, Mixtral, DeepSeek-V3, gpt-oss).
"""

import json
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import SafetensorError
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from dtensor_moe.config import MoERunOptions
from dtensor_moe.durable import publish_files
from dtensor_moe.hf.block import SPARSE_BLOCKS, from_hf_block
from dtensor_moe.hf.convert import to_hf
from dtensor_moe.hf.families import family
from dtensor_moe.moe import MoE
from dtensor_moe.parallel.blocks import parallelize_blocks
from dtensor_moe.parallel.mesh import MoEParallelDims

WEIGHTS, CONFIG = "model.safetensors", "config.json"


class TupleMoE(MoE):
    """gpt-oss's decoder layer unpacks its MLP's output as (hidden states, router scores)."""

    def forward(self, x_BLD: torch.Tensor):
        return super().forward(x_BLD), None


def swap_moe_blocks(model: nn.Module, options: MoERunOptions | None = None, **balance_fields) -> dict[str, MoE]:
    """Replaces every sparse-MoE block of a transformers model (Qwen3MoeSparseMoeBlock, MixtralSparseMoeBlock,
    DeepseekV3MoE, GptOssMLP) by our `MoE` with the same weights and routing (`from_hf_block`), in place, run with
    `options`; `balance_fields` are the `MoEConfig` fields the Hugging Face config does not fix (aux_loss_coeff,
    ...; see `from_hf_block`). Returns the swapped layers by qualified name."""
    swapped = {}
    for name, block in list(model.named_modules()):
        if type(block).__name__ in SPARSE_BLOCKS:
            moe = from_hf_block(block, options, **balance_fields)
            if type(block).__name__ == "GptOssMLP":
                moe.__class__ = TupleMoE
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent), attr, moe)
            swapped[name] = moe
    return swapped


def parallelize_hf_model(
    model: nn.Module,
    dims: MoEParallelDims,
    *,
    device_type: str = "cuda",
    mp_policy=None,
    reshard_after_forward: bool = True,
    activation_checkpoint: str = "none",
    options: MoERunOptions | None = None,
    **balance_fields,
) -> nn.Module:
    """A transformers MoE causal LM (every rank holding the same weights) trained by this library: its sparse
    blocks swapped for our `MoE` run with `options` (`swap_moe_blocks`; `balance_fields`: the `MoEConfig` fields
    its Hugging Face config does not fix, e.g. aux_loss_coeff), the experts sharded by the placement
    plan (EP, ETP, FSDP2 over EDP / HSDP), each decoder layer and the root one FSDP2 / HSDP unit on the
    data-parallel ranks (`parallelize_blocks`, activation checkpointing per layer). Dense tensor, context and
    pipeline parallelism need the family's own plans: `dims` must have tp = cp = pp = 1 (so the tp gradient
    convention, `tp_grads`, does not arise).

    The loss without full fp32 logits, as the main job computes it: `dtensor_moe.train.loss.hf_lm_loss`, the
    final norm's output and the head's weight to the chunked cross-entropy (FSDP2 warns once that
    `hidden_states[0]`, the embeddings', is a view: nothing writes it in place; tests/test_loss.py runs this):

        from dtensor_moe.train.loss import hf_lm_loss

        loss = hf_lm_loss(model, tokens_BL, chunk_tokens=2048)
        (loss + balance_loss(model)).backward()  # loss: model(input_ids=tokens_BL, labels=tokens_BL).loss's
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"parallelize_hf_model takes a transformers causal LM (an nn.Module), got "
                        f"{type(model).__name__}")
    if not isinstance(dims, MoEParallelDims):
        raise TypeError(f"parallelize_hf_model's dims must be a MoEParallelDims (e.g. MoEParallelDims(world_size, "
                        f"ep=2)), got {type(dims).__name__} {dims!r}")
    bad = {a: getattr(dims, a) for a in ("tp", "cp", "pp") if getattr(dims, a) != 1}
    if bad:
        raise ValueError(f"parallelize_hf_model shards the experts (ep, etp, edp) and the dense weights (FSDP2 / "
                         f"HSDP over dp_replicate x dp_shard); {bad} would need the family's own tensor / context / "
                         "pipeline plan; valid: tp = cp = pp = 1")
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError(f"parallelize_hf_model takes a transformers causal LM with its decoder layers at "
                         f"model.model.layers, got {type(model).__name__}")
    swap_moe_blocks(model, options, **balance_fields)
    if not any(isinstance(m, MoE) for m in model.modules()):
        raise ValueError(f"{type(model).__name__} has no sparse-MoE block we map; valid blocks: {SPARSE_BLOCKS}")
    return parallelize_blocks(model, layers, dims, device_type=device_type, mp_policy=mp_policy,
                              reshard_after_forward=reshard_after_forward, activation_checkpoint=activation_checkpoint)


_ROUTER = re.compile(r"^(.*\.)router\.gate\.weight$")


def hf_state_dict(state: dict[str, torch.Tensor], model_type: str, tied: bool = False) -> dict[str, torch.Tensor]:
    """A swapped model's full state dict (our MoE names inside transformers' keys) -> the keys save_pretrained
    writes: each MoE layer through the family's converter, the rest as it is (without lm_head.weight when
    `tied`: save_pretrained leaves the tied head out)."""
    fam = family(model_type)
    prefixes = {m.group(1) for k in state if (m := _ROUTER.match(k))}
    out = {k: v for k, v in state.items() if not any(k.startswith(p) for p in prefixes)}
    if tied:
        out.pop("lm_head.weight", None)
    for prefix in sorted(prefixes):
        out.update(to_hf({k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)}, fam, prefix))
    return {k: v.contiguous() for k, v in out.items()}


def checked_output_dir(out_dir, force: bool) -> Path:
    """`out_dir` as a Path, refused (ValueError) if it is a file, holds our files and not `force`, or cannot be
    written (read-only)."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"output {str(out)!r} is a file; give a directory for {WEIGHTS} and {CONFIG}")
    existing = [n for n in (WEIGHTS, CONFIG) if (out / n).exists()]
    if existing and not force:
        raise ValueError(f"{out} already holds {existing}; pass --force to replace them, or choose another directory")
    return out


def _existing(path: Path) -> Path:
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path


def _reason(e: Exception) -> str:
    """The OS's words for a failed write (safetensors wraps them: '... I/O error: No space left on device (os error
    28) ...')."""
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    m = re.search(r"(?:I/O error|IoError)[:(]\s*(.*?)(?: \(os error \d+\)|$)", str(e))
    return m.group(1) if m else " ".join(str(e).split())


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


def write_files(out: Path, writers: dict, need_bytes: int = 0) -> Path:
    """`durable.publish_files(out, writers)`: every file or none, durably. A directory that cannot hold
    `need_bytes` more is refused before anything is written; a fault while writing (a full or
    read-only disk, an I/O error) is a ValueError naming `out` and the OS's reason, the temporary directory gone."""
    free = shutil.disk_usage(_existing(out.parent)).free
    if need_bytes > free:
        raise ValueError(f"cannot write {out}: it needs about {_size(need_bytes)}, its disk has {_size(free)} free; "
                         "free space or choose another directory")
    try:
        publish_files(out, writers)
    except (OSError, SafetensorError) as e:
        raise ValueError(f"cannot write {out}: {_reason(e)}; free space, make it writable, or choose another "
                         "directory") from None
    return out


def tensor_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def write_hf_dir(out_dir, tensors: dict[str, torch.Tensor], hf_config: dict, force: bool = False,
                 companions: list[Path] = ()) -> Path:
    """`out_dir`/model.safetensors and config.json (its dtype the tensors'), and a copy of each file in `companions`
    (a tokenizer, generation_config.json), written by `write_files`. Existing files are replaced only with
    `force`."""
    out = checked_output_dir(out_dir, force)
    dtypes = {str(t.dtype).removeprefix("torch.") for t in tensors.values() if t.is_floating_point()}
    config = {**hf_config, "dtype": dtypes.pop() if len(dtypes) == 1 else hf_config.get("dtype")}
    config.pop("torch_dtype", None)
    copies = {c.name: lambda p, c=c: shutil.copyfile(c, p) for c in companions}
    return write_files(out, {WEIGHTS: lambda p: save_file(tensors, p, metadata={"format": "pt"}),
                             CONFIG: lambda p: p.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n"),
                             **copies}, tensor_bytes(tensors) + sum(c.stat().st_size for c in companions))


def save_hf(model: nn.Module, out_dir, force: bool = False) -> Path | None:
    """Writes a swapped (and possibly parallelized) transformers model as a directory `from_pretrained` loads:
    the full weights under the family's keys and its config.json. A collective when parallelized (every rank
    calls it, rank 0 writes and returns the path; the others None)."""
    if not isinstance(model, nn.Module) or getattr(model, "config", None) is None:
        raise TypeError(f"save_hf takes a transformers causal LM (an nn.Module with .config), got "
                        f"{type(model).__name__}")
    if not any(isinstance(m, MoE) for m in model.modules()):
        raise ValueError(f"save_hf writes a model whose sparse blocks were swapped for our MoE (parallelize_hf_model "
                         f"or swap_moe_blocks); this {type(model).__name__} has none: save a plain transformers "
                         "model with its own model.save_pretrained(dir)")
    cfg = model.config
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    tensors = hf_state_dict(state, cfg.model_type, bool(getattr(cfg, "tie_word_embeddings", False)))
    return write_hf_dir(out_dir, tensors, cfg.to_dict(), force)

