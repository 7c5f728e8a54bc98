"""One MoE layer's weights between a Hugging Face checkpoint and our `MoE`, both ways.

Loading reads, for every tensor of the layer, only the box this rank owns under the placement
plan (`owned_box`): the expert slices of its EP x ETP x EDP coordinates, its FSDP shard of the
router and shared experts; buffers (DeepSeek-V3's e_score_correction_bias, our `expert_bias`) whole.
"""

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from dtensor_moe.hf.families import Family
from dtensor_moe.hf.layout import GptOss, PerExpert, full_box
from dtensor_moe.moe import MoE
from dtensor_moe.parallel.mesh import MoEParallelDims
from dtensor_moe.parallel.plan import owned_box, plan_moe


def layer_prefix(keys: set[str], fam: Family, layer: int) -> str:
    """Where decoder layer `layer`'s MoE block lives in a checkpoint ("model.layers.3.mlp.")."""
    for block in fam.blocks:
        prefix = f"model.layers.{layer}.{block}."
        if any(k.startswith(prefix) for k in keys):
            return prefix
    raise ValueError(f"no MoE block of layer {layer} in the Hugging Face weights (looked for "
                     f"{[f'model.layers.{layer}.{b}.' for b in fam.blocks]})")


def _tensors(moe: MoE) -> dict[str, torch.Tensor]:
    """Our names of every tensor a checkpoint holds: parameters and persistent buffers."""
    out = dict(moe.named_parameters())
    if moe.expert_bias is not None:
        out["expert_bias"] = moe.expert_bias
    return out


def _read(reader, fam: Family, layout, prefix: str, name: str, box) -> torch.Tensor:
    if name.startswith("experts."):
        t = layout.read(reader, name.removeprefix("experts."), box)
    else:
        if name not in fam.direct:
            raise ValueError(f"{fam.model_type} has no counterpart of our {name}; valid MoE tensors for it: "
                             f"{sorted(fam.direct)} and the experts")
        key = prefix + fam.direct[name]
        if key not in reader.keys():
            raise ValueError(
                f"{key} is missing from the Hugging Face weights ({fam.model_type} stores our {name} there)"
            )
        t = reader.read(key, box)
    want = tuple(s.stop - s.start for s in box)
    if tuple(t.shape) != want:
        raise ValueError(f"{prefix}: our {name} slice {want} reads {tuple(t.shape)} from the Hugging Face weights; "
                         f"the checkpoint does not match this MoEConfig")
    return t


def read_hf_moe(reader, fam: Family, prefix: str, shapes: dict[str, tuple], boxes: dict | None = None) -> dict:
    """Our tensors (name -> global shape in `shapes`) of the layer under `prefix`, each only its box
    in `boxes` (whole where absent), in the checkpoint's dtype."""
    layout = fam.layout(reader.keys(), prefix, shapes["experts.w1"][1])
    boxes = boxes or {}
    return {
        name: _read(reader, fam, layout, prefix, name, boxes.get(name, full_box(shape)))
        for name, shape in shapes.items()
    }


def moe_shapes(config) -> dict[str, tuple]:
    """The global shape of every tensor of an `MoE` with `config`, allocating nothing."""
    with torch.device("meta"):
        return {n: tuple(t.shape) for n, t in _tensors(MoE(config)).items()}


@torch.no_grad()
def load_hf_moe(moe: MoE, reader, fam: Family, prefix: str, dims: MoEParallelDims | None = None) -> MoE:
    """Fills `moe` (plain, or parallelized by `parallelize_moe` with `dims`; then on every rank,
    each reading only its own slices) from the layer under `prefix` (e.g. "model.layers.3.mlp.")."""
    boxes = {}
    if dims is not None:
        rank = dist.get_rank() if dist.is_initialized() else 0
        boxes = {wp.name: owned_box(wp, dims, rank) for wp in plan_moe(moe.config, dims)}
    targets = _tensors(moe)
    read = read_hf_moe(reader, fam, prefix, {n: tuple(t.shape) for n, t in targets.items()}, boxes)
    for name, target in targets.items():
        (target.to_local() if isinstance(target, DTensor) else target).copy_(read[name])
    return moe


def to_hf(state: dict[str, torch.Tensor], fam: Family, prefix: str) -> dict[str, torch.Tensor]:
    """Full tensors of one layer under our names (an unparallelized MoE's state dict) -> the keys and
    layout save_pretrained writes for `fam` (per-expert where the family has one, gpt-oss fused)."""
    out = {prefix + fam.direct[n]: t for n, t in state.items() if not n.startswith("experts.") and n in fam.direct}
    unmapped = sorted(
        n for n in state if not n.startswith("experts.") and n not in fam.direct and n != "tokens_per_expert"
    )
    if unmapped:
        raise ValueError(
            f"{fam.model_type} has no counterpart of our {unmapped}; valid: {sorted(fam.direct)} and the experts"
        )
    layout = PerExpert(prefix, *fam.per_expert) if fam.per_expert else GptOss(prefix)
    experts = {n.removeprefix("experts."): t for n, t in state.items() if n.startswith("experts.")}
    out.update(layout.write(experts))
    return out
