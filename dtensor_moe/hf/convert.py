"""One MoE layer's weights between a Hugging Face checkpoint and our `MoE`, both ways.

Loading reads, for every tensor of the layer, only the box this rank owns under the placement
plan (`owned_box`): the expert slices of its EP x ETP x EDP coordinates, its FSDP shard of the
router and shared experts; buffers (DeepSeek-V3's e_score_correction_bias, our `expert_bias`) whole.
"""

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from dtensor_moe.experts import split_gate_up
from dtensor_moe.hf.families import Family
from dtensor_moe.hf.layout import GptOss, PerExpert, full_box
from dtensor_moe.moe import MoE
from dtensor_moe.parallel.mesh import MoEParallelDims
from dtensor_moe.parallel.placement import owned_box, plan_moe


def layer_prefix(keys: set[str], fam: Family, layer: int) -> str:
    """Where decoder layer `layer`'s MoE block lives in a checkpoint ("model.layers.3.mlp.")."""
    for block in fam.blocks:
        prefix = f"model.layers.{layer}.{block}."
        if any(k.startswith(prefix) for k in keys):
            return prefix
    raise ValueError(f"no MoE block of layer {layer} in the Hugging Face weights; expected keys under "
                     f"{' or '.join(f'model.layers.{layer}.{b}.' for b in fam.blocks)} ({fam.model_type}'s config "
                     "says that layer is an MoE layer)")


def _tensors(moe: MoE) -> dict[str, torch.Tensor]:
    """Our names of every tensor a checkpoint holds: parameters and persistent buffers."""
    out = dict(moe.named_parameters())
    if moe.expert_bias is not None:
        out["expert_bias"] = moe.expert_bias
    return out


def _read(reader, fam: Family, layout, prefix: str, name: str, box) -> torch.Tensor:
    if name in ("experts.w13", "experts.b13"):  # gate and up, each read as torchtitan's w1 / w3 (b1 / b3)
        kind, rest = name.removeprefix("experts.")[0], (box[0], *box[2:])
        return torch.stack([layout.read(reader, f"{kind}{i}", rest) for i in (1, 3)], dim=1)
    if name.startswith("experts."):
        return layout.read(reader, name.removeprefix("experts."), box)
    return reader.read(prefix + fam.direct[name], box)


def check_tensors(have: dict[str, tuple], want: dict[str, tuple], mismatch: str) -> None:
    """A ValueError, `mismatch` then the first wrongly shaped, missing or unexpected tensor of `have`
    (key -> shape) against `want` and how many more there are, unless they agree."""
    problems = [f"{k} has shape {have[k]}, expected {s}" for k, s in sorted(want.items()) if have.get(k, s) != s]
    problems += [f"{k} (shape {s}) is missing" for k, s in sorted(want.items()) if k not in have]
    problems += [f"{k} (shape {have[k]}) is unexpected" for k in sorted(have) if k not in want]
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise ValueError(f"{mismatch}: {problems[0]}{more}")


def check_hf_layer(have: dict[str, tuple], fam: Family, prefix: str, shapes: dict[str, tuple]) -> None:
    """A ValueError naming the first key under `prefix` of `have` (key -> shape, a checkpoint's) that is missing,
    unexpected or of another shape than the layer of our tensors `shapes` (name -> global shape) in the family's
    layout the keys use."""
    layout = fam.layout(set(have), prefix, shapes["experts.w13"][2])
    with torch.device("meta"):
        want = _their_tensors({n: torch.empty(s) for n, s in shapes.items()}, fam, layout, prefix)
    check_tensors({k: s for k, s in have.items() if k.startswith(prefix)}, {k: tuple(t.shape) for k, t in want.items()},
                  f"the Hugging Face weights under {prefix!r} are not a {fam.model_type} MoE layer of this config")


def read_hf_moe(reader, fam: Family, prefix: str, shapes: dict[str, tuple], boxes: dict | None = None) -> dict:
    """Our tensors (name -> global shape in `shapes`) of the layer under `prefix`, each only its box
    in `boxes` (whole where absent), in the checkpoint's dtype. First every key under `prefix` and its
    shape are checked (a box would silently cut a larger tensor): a ValueError names the first that
    differs."""
    check_hf_layer({k: reader.shape(k) for k in reader.keys() if k.startswith(prefix)}, fam, prefix, shapes)
    layout = fam.layout(reader.keys(), prefix, shapes["experts.w13"][2])
    boxes = boxes or {}
    return {
        name: _read(reader, fam, layout, prefix, name, boxes.get(name, full_box(shape)))
        for name, shape in shapes.items()
    }


def moe_shapes(config, halves: bool = False) -> dict[str, tuple]:
    """The global shape of every tensor of an `MoE` with `config`, allocating nothing; `halves`: the experts'
    w13 / b13 as torchtitan's w1 and w3 / b1 and b3 (experts.split_gate_up), as the main job's checkpoints and
    exports hold them."""
    with torch.device("meta"):
        tensors = _tensors(MoE(config))
        return {n: tuple(t.shape) for n, t in (split_gate_up(tensors) if halves else tensors).items()}


@torch.no_grad()
def load_hf_moe(moe: MoE, reader, fam: Family, prefix: str, dims: MoEParallelDims | None = None) -> MoE:
    """Fills `moe` (plain, or parallelized by `parallelize_moe` with `dims`; then on every rank,
    each reading only its own slices, after checking every key and shape under it) from the layer under
    `prefix` (e.g. "model.layers.3.mlp.")."""
    boxes = {}
    if dims is not None:
        rank = dist.get_rank() if dist.is_initialized() else 0
        boxes = {wp.name: owned_box(wp, dims, rank) for wp in plan_moe(moe.config, dims)}
    targets = _tensors(moe)
    read = read_hf_moe(reader, fam, prefix, {n: tuple(t.shape) for n, t in targets.items()}, boxes)
    for name, target in targets.items():
        (target.to_local() if isinstance(target, DTensor) else target).copy_(read[name])
    return moe


def _their_tensors(state: dict[str, torch.Tensor], fam: Family, layout, prefix: str) -> dict[str, torch.Tensor]:
    """Our tensors of one layer under `fam`'s keys in `layout`."""
    state = split_gate_up(state)
    unmapped = sorted(n for n in state if not n.startswith("experts.") and n not in fam.direct)
    if unmapped:
        raise ValueError(
            f"{fam.model_type} has no counterpart of our {unmapped}; valid: {sorted(fam.direct)} and the experts"
        )
    out = {prefix + fam.direct[n]: t for n, t in state.items() if not n.startswith("experts.")}
    out.update(layout.write({n.removeprefix("experts."): t for n, t in state.items() if n.startswith("experts.")}))
    return out


def to_hf(state: dict[str, torch.Tensor], fam: Family, prefix: str) -> dict[str, torch.Tensor]:
    """Full tensors of one layer under our names (an unparallelized MoE's state dict; gate and up as w13 / b13
    or as their halves w1 and w3 / b1 and b3) -> the keys and layout save_pretrained writes for `fam`
    (per-expert where the family has one, gpt-oss fused)."""
    return _their_tensors(state, fam, PerExpert(prefix, *fam.per_expert) if fam.per_expert else GptOss(prefix), prefix)
