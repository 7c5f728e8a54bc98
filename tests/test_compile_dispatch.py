"""The EP dispatch around plain-tensor experts (torchtitan's) inside a block compiled as the torchtitan
hook compiles it: no graph break at the dispatcher's ops, and the 1-process float64 reference's
outputs and gradients."""

import torch
from torch import nn
from torch._dynamo.backends.registry import lookup_backend, register_backend

from .harness import run_on_ranks

E, D = 4, 4
COMPILED_MOVES: list[str] = []  # the direction of every ep_move in a graph aot_eager compiled, in this process


@register_backend
def aot_eager_recording(gm, example_inputs):
    compiled = lookup_backend("aot_eager")(gm, example_inputs)
    COMPILED_MOVES.extend(n.args[3] for n in gm.graph.nodes if n.target is torch.ops.dtensor_moe.ep_move.default)
    return compiled


class PlainExperts(nn.Module):
    """torchtitan's experts' interface: (rows grouped by local expert, their counts) in, one row out
    per row, plain tensors; here one D x D matrix per expert (float64: torch._grouped_mm has none)."""

    def __init__(self, w_EDD: torch.Tensor):
        super().__init__()
        self.w_EDD = nn.Parameter(w_EDD)

    def forward(self, x_ND, counts_E):
        expert_N = torch.repeat_interleave(torch.arange(self.w_EDD.shape[0]), counts_E, output_size=x_ND.shape[0])
        return torch.bmm(x_ND[:, None, :], self.w_EDD[expert_N])[:, 0]


class Block(nn.Module):
    def __init__(self, experts: nn.Module):
        super().__init__()
        self.experts = experts

    def forward(self, x_ND, counts_E):
        return self.experts(x_ND.tanh(), counts_E) + x_ND


def _batch(rank: int, step: int):
    """One rank's rows in expert-major order and their per-expert counts (an expert with none at step 1)."""
    g = torch.Generator().manual_seed(10 * step + rank)
    expert_N = torch.sort(torch.randint(0, E - step, (5 + rank + 2 * step,), generator=g)).values
    return torch.randn(expert_N.shape[0], D, dtype=torch.float64, generator=g), torch.bincount(expert_N, minlength=E)


def compiled_plain_experts(rank: int, world_size: int):
    """EP over every rank, PairDispatch's hooks for foreign experts, and no-op compiler-disabled hooks
    where FSDP2's sit (before ours and after ours: they split the block into frames, as the experts' FSDP2
    unit does under the hook); the block compiled by apply_compile(fullgraph=False), the hook's call.
    Returns the graph breaks and backend failures naming a dtensor_moe op, the others, the compiled
    movements' directions and the worst relative error against the reference."""
    from torch._dynamo.utils import counters

    from dtensor_moe import MoEParallelDims
    from dtensor_moe.parallel.compile import apply_compile
    from dtensor_moe.parallel.dispatch import DispatchGroup, PairDispatch, RowLoad, dispatch_hooks

    meshes = MoEParallelDims(world_size, ep=world_size).build_meshes("cpu")
    w_EDD = torch.randn(E, D, D, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    E_local = E // world_size
    experts = PlainExperts(w_EDD[rank * E_local:(rank + 1) * E_local].clone())
    # The dispatcher's weight-gradient convention (a mean loss over ranks); the hook's is 1 (sums).
    group = DispatchGroup(meshes.expert["ep"].get_group(), meshes.expert["etp"].get_group(), world_size)
    pre, post = dispatch_hooks(PairDispatch(group), RowLoad(), ours=False)
    experts.register_forward_pre_hook(torch.compiler.disable(lambda m, a: None))
    experts.register_forward_pre_hook(pre)
    experts.register_forward_hook(post)
    experts.register_forward_hook(torch.compiler.disable(lambda m, a, o: None))
    block = apply_compile(Block(experts), "aot_eager_recording", fullgraph=False)
    reference = Block(PlainExperts(w_EDD.clone()))
    torch._dynamo.reset()
    counters.clear()
    COMPILED_MOVES.clear()
    worst = 0.0
    for step in range(2):
        batches = [_batch(r, step) for r in range(world_size)]
        x_ND = batches[rank][0].clone().requires_grad_(True)
        y_ND = block(x_ND, batches[rank][1])
        y_ND.square().sum().backward()
        ref_x = [x.clone().requires_grad_(True) for x, _ in batches]
        ref_y = [reference(x, c) for x, (_, c) in zip(ref_x, batches)]
        sum(y.square().sum() for y in ref_y).backward()
        # Each rank's own loss; the expert weights' gradient is the ranks' mean (the divisor).
        w_grad = reference.experts.w_EDD.grad[rank * E_local:(rank + 1) * E_local] / world_size
        for got, want in ((y_ND, ref_y[rank]), (x_ND.grad, ref_x[rank].grad), (experts.w_EDD.grad, w_grad)):
            worst = max(worst, ((got - want).abs().max() / want.abs().max()).item())
        experts.w_EDD.grad = reference.experts.w_EDD.grad = None
    # A backend's failure (a frame run eagerly) is counted as "unimplemented", not as a graph break.
    reasons = [*counters["graph_break"], *counters["unimplemented"]]
    return (
        [r for r in reasons if "dtensor_moe" in r],
        [r for r in reasons if "dtensor_moe" not in r],
        COMPILED_MOVES,
        worst,
    )


def test_dispatch_around_plain_experts_compiles_without_break():
    """Without capturing data-dependent sizes in every frame (apply_compile) the pre-hook's frame broke at
    exchange_tables ("Dynamic shape operator") and the post-hook's frame ran eagerly ("Backend compiler aot_eager
    failed with dtensor_moe.ep_move.default": its backward, the movement "there", makes a row count). With
    them captured but the activation gradient scaled on the dispatched rows, the input gradient was 0.37-0.45
    off (see dispatch.dispatch_hooks)."""
    for breaks, others, moves, worst in run_on_ranks(2, compiled_plain_experts):
        assert not breaks, breaks
        assert any("torch.compiler.disable" in r for r in others), others  # the frames split as under the hook
        assert "there" in moves and "back" in moves, moves  # the dispatch and the combine compiled
        assert worst < 1e-12, worst
