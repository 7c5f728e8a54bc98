"""Parallel degrees and the two folded meshes (dense and expert) over the same ranks.

Dense mesh  (dp_replicate, dp_shard, cp, tp)
Expert mesh (dp_replicate, edp, ep, etp), with edp * ep * etp == dp_shard * cp * tp.
ETP is innermost, then EP, so those groups are consecutive ranks and stay inside a node.

Under sequence parallelism every TP rank holds its own slice of each sequence and under CP every CP
rank its own part of it, so an MoE layer sees different tokens on every rank of a dp_replicate
replica: its router and shared experts are data-parallel over dp_shard * cp * tp (`moe_dp_axis`).
Pipeline parallelism is outermost: world = pp * stage_size, each pipeline stage holds
`stage_size` consecutive ranks, and both meshes above are meshes of one stage (coordinates,
plans and ownership are per stage; `pp_coord` says which stage a rank is in).
"""

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dtensor_moe.validate import check_fields

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["MoEParallelDims", "MoEMeshes", "DENSE_AXES", "EXPERT_AXES", "PP_STAGES_PER_RANK"]

DENSE_AXES = ("dp_replicate", "dp_shard", "cp", "tp")
# Pipeline schedules (torch.distributed.pipelining) -> stages each rank holds.
PP_STAGES_PER_RANK = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2}
EXPERT_AXES = ("dp_replicate", "edp", "ep", "etp")


def divisors(n: int) -> list[int]:
    """n's divisors, ascending; up to sqrt(n) steps, so an error message about a huge world stays instant."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def _listed(values: list, most: int = 24) -> str:
    """values as a list, or its first and last few and how many (an error line stays a line at any world size)."""
    if len(values) <= most:
        return str(values)
    head, tail = ", ".join(map(str, values[:most // 2])), ", ".join(map(str, values[-4:]))
    return f"[{head}, ..., {tail}] ({len(values)} in all)"


@dataclass(frozen=True)
class MoEParallelDims:
    """The parallel degrees of a run: the dense mesh (dp_replicate, dp_shard, cp, tp) and the expert mesh
    (dp_replicate, edp, ep, etp) folded over the same ranks, inside each of `pp` pipeline stages.

    Plain data, checked at construction (no torch needed): degrees that do not fold raise ValueError
    naming the valid ones. The expert data-parallel degree is derived, edp = dp_shard * cp * tp /
    (ep * etp). `build_meshes(device_type)` creates the process groups (`MoEMeshes`); `plan_moe`,
    `ExpertParallel` and `parallelize_moe` take the degrees.

    Args:
        world_size (int): ranks in the job; >= 1.
        dp_replicate (int): HSDP replicas (data-parallel groups holding full copies); >= 1. Default 1.
        dp_shard (int): FSDP2 sharding degree; -1 (default) takes the rest of a stage:
            world_size / (pp * dp_replicate * cp * tp).
        cp (int): context-parallel degree (each sequence split over cp ranks); >= 1. Default 1.
        tp (int): dense tensor-parallel degree (with sequence parallelism); >= 1. Default 1.
        ep (int): expert-parallel degree (the experts split over ep ranks); >= 1, and ep * etp must
            divide dp_shard * cp * tp. Default 1.
        etp (int): expert tensor-parallel degree (each expert's hidden dim F split over etp ranks);
            >= 1. Default 1.
        pp (int): pipeline stages, outermost; must divide world_size. Default 1.

    Example:
        >>> from dtensor_moe import MoEParallelDims
        >>> dims = MoEParallelDims(world_size=8, ep=2, etp=2)
        >>> dims.dp_shard, dims.edp, dims.expert_shape
        (8, 2, (1, 2, 2, 2))
    """

    world_size: int
    dp_replicate: int = 1
    dp_shard: int = -1
    cp: int = 1
    tp: int = 1
    ep: int = 1
    etp: int = 1
    pp: int = 1

    def __post_init__(self):
        # Types only (the descriptions go into the type error); the checks below say what folds.
        check_fields(self, "MoEParallelDims.", dp_shard="-1 (the rest of the world) or >= 1",
                     **{n: ">= 1" for n in ("world_size", "dp_replicate", "cp", "tp", "ep", "etp", "pp")})
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        for name in ("dp_replicate", "cp", "tp", "ep", "etp", "pp"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.world_size % self.pp:
            raise ValueError(f"pp ({self.pp}) must divide world_size {self.world_size} (pipeline stages of equal "
                             f"size); valid pp: {_listed(divisors(self.world_size))}")
        # Everything below folds the ranks of one pipeline stage.
        w = self.stage_size
        of = f"world_size {w}" if self.pp == 1 else f"the {w} ranks of a pipeline stage (world_size / pp)"
        if self.dp_shard == 0 or self.dp_shard < -1:
            raise ValueError(f"dp_shard must be >= 1 or -1 (the rest of the world), got {self.dp_shard}")
        fixed = self.dp_replicate * self.cp * self.tp
        if w % fixed != 0:
            raise ValueError(
                f"dp_replicate * cp * tp = {self.dp_replicate}*{self.cp}*{self.tp} = {fixed} must divide "
                f"{of}; valid values for that product: {_listed(divisors(w))}"
            )
        dp_shard = w // fixed if self.dp_shard == -1 else self.dp_shard
        if dp_shard * fixed != w:
            raise ValueError(
                f"dp_replicate * dp_shard * cp * tp must equal {of}, got "
                f"{self.dp_replicate}*{dp_shard}*{self.cp}*{self.tp} = {dp_shard * fixed}; "
                f"valid dp_shard here: {w // fixed} (or -1)"
            )
        object.__setattr__(self, "dp_shard", dp_shard)
        folded = dp_shard * self.cp * self.tp
        if folded % (self.ep * self.etp) != 0:
            pairs = [(e, t) for e in divisors(folded) for t in divisors(folded // e)]
            raise ValueError(
                f"ep * etp = {self.ep}*{self.etp} must divide dp_shard * cp * tp = {folded}: the expert mesh "
                f"(edp, ep, etp) folds over the same ranks as the dense (dp_shard, cp, tp). "
                f"Valid ep: {_listed(divisors(folded))}; valid (ep, etp) pairs: {_listed(pairs)}"
            )

    @property
    def stage_size(self) -> int:
        """Ranks of one pipeline stage: dp_replicate * dp_shard * cp * tp."""
        return self.world_size // self.pp

    def pp_coord(self, rank: int) -> int:
        return rank // self.stage_size

    @property
    def edp(self) -> int:
        return self.dp_shard * self.cp * self.tp // (self.ep * self.etp)

    @property
    def dense_shape(self) -> tuple[int, ...]:
        return (self.dp_replicate, self.dp_shard, self.cp, self.tp)

    @property
    def moe_dp_axis(self) -> str:
        """The flattened axis an MoE's dense weights are sharded on: every rank with its own tokens."""
        return "dp_shard" + "_cp" * (self.cp > 1) + "_tp" * (self.tp > 1)

    @property
    def expert_shape(self) -> tuple[int, ...]:
        return (self.dp_replicate, self.edp, self.ep, self.etp)

    @property
    def dp(self) -> int:
        """Ranks that see different sequences (data-parallel, including context-parallel shards)."""
        return self.dp_replicate * self.dp_shard * self.cp

    def expert_coords(self, rank: int) -> dict[str, int]:
        return _coords(rank % self.stage_size, EXPERT_AXES, self.expert_shape)

    def dense_coords(self, rank: int) -> dict[str, int]:
        return _coords(rank % self.stage_size, DENSE_AXES, self.dense_shape)

    def build_meshes(self, device_type: str = "cuda") -> "MoEMeshes":
        """Creates the process groups (collective); cached so repeated calls reuse them. A device type this machine
        lacks (the default "cuda" on a CPU-only one) is a ValueError, before any collective."""
        check_device_type(device_type)
        key = (self, device_type)
        if key not in _MESH_CACHE:
            _MESH_CACHE[key] = _build(self, device_type)
        return _MESH_CACHE[key]


def check_device_type(device_type) -> None:
    """ValueError unless this machine has `device_type` ("cpu", or an accelerator torch sees: "cuda", ...)."""
    import torch

    if device_type == "cpu":
        return
    module = getattr(torch, device_type, None) if isinstance(device_type, str) else None
    if module is None or not hasattr(module, "is_available") or not module.is_available():
        raise ValueError(f"device_type {device_type!r}: this machine has no such device (torch sees "
                         f"{'cuda' if torch.cuda.is_available() else 'no accelerator'}); valid: 'cpu' (gloo ranks)"
                         f"{', cuda' if torch.cuda.is_available() else ''}")


def _coords(rank: int, axes, shape) -> dict[str, int]:
    out = {}
    for name, size in zip(reversed(axes), reversed(shape)):
        out[name] = rank % size
        rank //= size
    return {a: out[a] for a in axes}


@dataclass(frozen=True)
class MoEMeshes:
    """The device meshes of one `MoEParallelDims`, made by `MoEParallelDims.build_meshes(device_type)`
    (a collective, cached): with pp > 1 each is the mesh of this rank's pipeline stage.

    Attributes:
        dense (DeviceMesh): (dp_replicate, dp_shard, cp, tp).
        expert (DeviceMesh): (dp_replicate, edp, ep, etp), over the same ranks as `dense`.
        dp (DeviceMesh): (dp_replicate, dp_shard), or (dp_replicate, dp_shard_cp) with cp > 1: where the
            dense weights are FSDP-sharded (the mesh of the caller's own `fully_shard`).
        tp (DeviceMesh): dense tensor parallelism, on the same root mesh as `dp`, so FSDP2 composes them
            (the mesh of a `parallelize_module` plan).
        moe_dp (DeviceMesh): (dp_replicate, `MoEParallelDims.moe_dp_axis`): every rank with its own
            tokens, where an MoE's dense weights are sharded and its statistics summed.
        pp (DeviceMesh | None): this rank's pipeline (one rank per stage); None when pp == 1.

    Example (under torchrun, 4 ranks)::

        dims = MoEParallelDims(world_size=4, ep=2, etp=2)
        meshes = dims.build_meshes("cuda")
        parallelize_module(model, meshes.tp, {"*.moe": ExpertParallel(meshes=meshes)})
        fully_shard(model, mesh=meshes.dp)
    """

    dense: "DeviceMesh"
    expert: "DeviceMesh"
    dp: "DeviceMesh"
    tp: "DeviceMesh"
    moe_dp: "DeviceMesh"
    pp: "DeviceMesh | None"

    @functools.cached_property
    def expert_weights(self) -> "DeviceMesh":
        """The (ep, etp) submesh expert weights are DTensors on (FSDP2 adds EDP / HSDP to it), without
        its size-1 axes ("ep" when both are 1): see expert_by_plan."""
        names = tuple(n for n in ("ep", "etp") if self.expert[n].size() > 1) or ("ep",)
        return self.expert[names]

    @functools.cached_property
    def expert_by_plan(self) -> "DeviceMesh":
        """The expert mesh with its axes in the plan's order of application (dp_replicate, ep, etp,
        edp): DTensor splits a dim sharded by several mesh axes left to right, so EDP then chunks
        each EP rank's experts as FSDP2 would. Built on first use (a collective), by compiled layers
        whose experts gather over EDP inside the graph (so EDP or dp_replicate is > 1). Size-1 axes
        are left out: a placement on one is the identity, and DTensor's sharding propagation tries
        every combination of an op's strategies over every mesh axis, at every new shape (RESULTS.md)."""
        from torch.distributed.device_mesh import DeviceMesh

        mesh = self.expert.mesh.permute(0, 2, 3, 1)
        names = ("dp_replicate", "ep", "etp", "edp")
        keep = [i for i, size in enumerate(mesh.shape) if size > 1]
        return DeviceMesh(self.expert.device_type, mesh.reshape([mesh.shape[i] for i in keep]),
                          mesh_dim_names=tuple(names[i] for i in keep))


_MESH_CACHE: dict = {}


def _build(dims: MoEParallelDims, device_type: str) -> MoEMeshes:
    # torch is imported here so the degrees and the plan stay usable without it (fast CLI start).
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    if not dist.is_initialized():
        raise ValueError("torch.distributed must be initialized before building meshes (init_process_group)")
    if dist.get_world_size() != dims.world_size:
        raise ValueError(
            f"MoEParallelDims.world_size ({dims.world_size}) must equal the process group size "
            f"({dist.get_world_size()})"
        )
    ranks = torch.arange(dims.world_size)

    def stage_mesh(shape, names):
        """The `shape` mesh, or with pp > 1 the (pp, *shape) mesh over the world (group creation is
        collective over every rank): slicing any of `names` out of it gives this rank's stage's
        submesh, with the root shared (FSDP2 composes with TP only on one root)."""
        if dims.pp == 1:
            return DeviceMesh(device_type, ranks.view(shape), mesh_dim_names=names)
        return DeviceMesh(device_type, ranks.view(dims.pp, *shape), mesh_dim_names=("pp", *names))

    dense_root, expert_root = stage_mesh(dims.dense_shape, DENSE_AXES), stage_mesh(dims.expert_shape, EXPERT_AXES)
    dense, expert = (dense_root, expert_root) if dims.pp == 1 else (dense_root[DENSE_AXES], expert_root[EXPERT_AXES])
    pp = None if dims.pp == 1 else dense_root["pp"]
    if dims.cp == 1:
        dp, tp = dense_root["dp_replicate", "dp_shard"], dense_root["tp"]
    else:
        # Context-parallel shards see different tokens, so dense weights are sharded over them too.
        dp_shape = (dims.dp_replicate, dims.dp_shard * dims.cp, dims.tp)
        root = stage_mesh(dp_shape, ("dp_replicate", "dp_shard_cp", "tp"))
        dp, tp = root["dp_replicate", "dp_shard_cp"], root["tp"]
    moe_dp = dp
    if dims.tp > 1:
        moe_shape = (dims.dp_replicate, dims.stage_size // dims.dp_replicate)
        root = stage_mesh(moe_shape, ("dp_replicate", dims.moe_dp_axis))
        moe_dp = root if dims.pp == 1 else root["dp_replicate", dims.moe_dp_axis]
    return MoEMeshes(dense=dense, expert=expert, dp=dp, tp=tp, moe_dp=moe_dp, pp=pp)
