"""Where a folding's groups sit on the nodes: which ranks form each group, from the mesh order in
`mesh.py` (ETP innermost, then EP, then EDP; TP innermost in the dense mesh; stages outermost), and
what share of a group's traffic crosses a node boundary.

A group is rank 0's: members 0, s, 2s, ... (size, stride s); ranks r, r' share a node of G GPUs iff
r // G == r' // G. Pairwise traffic is split by how many peers share the rank's node, ring traffic
by how many ring hops cross a node boundary.
"""

from dtensor_moe.parallel.mesh import DENSE_AXES, EXPERT_AXES, MoEParallelDims


def mesh_geometry(dims: MoEParallelDims) -> dict[str, tuple[int, int]]:
    """(group size, rank stride) of every mesh axis, from the mesh order (row-major, last axis innermost)."""
    geo = {}
    for axes, shape in ((DENSE_AXES, dims.dense_shape), (EXPERT_AXES, dims.expert_shape)):
        stride = 1
        for axis, size in zip(reversed(axes), reversed(shape)):
            geo[axis] = (size, stride)
            stride *= size
    geo["pp"] = (dims.pp, dims.stage_size)
    geo["dp_shard_cp"] = (dims.dp_shard * dims.cp, geo["cp"][1])  # the flattened (dp_shard, cp) pair
    # The MoE's dense axis: every rank of a replica (tp is innermost, so consecutive ranks).
    geo["dp_shard_tp"] = geo["dp_shard_cp_tp"] = (dims.dp_shard * dims.cp * dims.tp, 1)
    return geo


def pairwise_intra_fraction(size: int, stride: int, G: int) -> float:
    """Share of a rank's peers (rank 0's group) that sit on its node: members are 0, s, 2s, ..."""
    if size == 1:
        return 0.0
    on_node = min(size, -(-G // stride)) if stride < G else 1
    return (on_node - 1) / (size - 1)


def node_span(size: int, stride: int, G: int) -> int:
    """Nodes of `G` GPUs that rank 0's group (members 0, s, 2s, ...) touches."""
    return size if stride >= G else (size - 1) * stride // G + 1


def ring_inter_fraction(size: int, stride: int, G: int) -> float:
    """Share of ring hops (rank 0's group, in rank order) that cross a node boundary."""
    nodes = node_span(size, stride, G)
    return 0.0 if nodes == 1 else nodes / size


def chain_inter_fraction(size: int, stride: int, G: int) -> float:
    """Share of the hops between neighbours of a chain (the pipeline, no wrap-around) that cross a node."""
    return 0.0 if size == 1 else (node_span(size, stride, G) - 1) / (size - 1)
