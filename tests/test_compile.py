"""torch.compile and activation checkpointing of the main job's blocks, against eager and the
1-process reference (float64): graph breaks, recompiles as token counts change, collectives per step."""

import copy
import functools
from unittest import mock

import pytest
import torch

from .harness import run_on_ranks
from .parity import inductor_settings


def _model(n_layers=2, run=None, **kw):
    """The main job's model of `kw`'s architecture, its MoE layers run with `run` (a dict of MoERunOptions fields)."""
    from dtensor_moe import MoERunOptions
    from dtensor_moe.train.config import ModelConfig
    from dtensor_moe.train.model import MoETransformer

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=32, dim=16, n_layers=n_layers, n_heads=2, num_experts=4, top_k=2,
                      hidden_dim=8, num_shared_experts=1, **kw)
    return MoETransformer(cfg, MoERunOptions(**(run or {}))).double()


def test_compiled_block_has_no_graph_breaks_and_recompiles_at_most_once():
    from torch._dynamo.utils import counters

    from dtensor_moe.parallel.compile import apply_compile

    # Every feature (groups, gate bias, gpt-oss's experts, all three balance losses, capacity) must trace
    # without breaks.
    model = _model(n_layers=1, load_balance="aux_loss", num_expert_groups=2, num_limited_groups=1, router_bias=True,
                   expert_biases=True, activation="clamped_swiglu", swiglu_limit=1.0, seq_aux_loss_coeff=0.1,
                   z_loss_coeff=0.01, run=dict(capacity_factor=1.0))
    eager = copy.deepcopy(model)
    torch._dynamo.reset()
    counters.clear()
    # Graph breaks and recompiles are dynamo's (the backend only lowers the graphs it is handed); inductor's
    # code is compared with eager in tests/test_parity.py's compiled cases and the EP2 training below.
    block = apply_compile(model.layers["0"], "aot_eager")
    for step, T in enumerate([3, 5, 2, 7, 4]):
        x = torch.randn(2, T, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
        outs = []
        for b in (block, eager.layers["0"]):
            xx = x.clone().requires_grad_(True)
            (b(xx).square().sum() + sum(b.moe.losses())).backward()
            outs.append((xx.grad, [p.grad.clone() for p in b.parameters()]))
        torch.testing.assert_close(outs[0][0], outs[1][0], rtol=1e-12, atol=1e-12)
        for a, e in zip(outs[0][1], outs[1][1]):
            torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])


GLOBAL_BATCH = 4  # sequences per step, split over the ranks: the same batches on 2 and 4 ranks


def train_steps(rank, world_size, ep, compile, ac, steps=3, run=None):
    """Loss per step of parallelize_transformer(compile, ac) on the same global batches at any world size, and
    how many EP/ETP row movements each step ran. `run`: MoERunOptions fields of the MoE layers."""
    import torch.nn.functional as F

    from dtensor_moe import MoEParallelDims
    from dtensor_moe.parallel import exchange
    from dtensor_moe.train.parallel.parallelize_transformer import parallelize_transformer

    torch._dynamo.reset()
    model = _model(load_balance="aux_free_bias", run=run)
    parallelize_transformer(model, MoEParallelDims(world_size, ep=ep), device_type="cpu", compile=compile,
                      activation_checkpoint=ac)
    moved = mock.patch.object(exchange._Topology, "there", autospec=True, side_effect=exchange._Topology.there)
    losses, moves = [], []
    with moved as there, inductor_settings(compile):
        for step in range(steps):
            g = torch.Generator().manual_seed(step)
            # One sequence length: each rank compiles once (recompiles as lengths change are the block test's).
            tokens = torch.randint(0, 32, (GLOBAL_BATCH, 6), generator=g)
            per_rank = GLOBAL_BATCH // world_size
            mine = tokens[rank * per_rank:(rank + 1) * per_rank]
            before = there.call_count
            logits = model(mine[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), mine[:, 1:].flatten())  # float64: the bound is 1e-10
            loss.backward()
            moves.append(there.call_count - before)
            model.update_expert_bias()
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.1 * p.grad
                    p.grad = None
            losses.append(torch.distributed.nn.functional.all_reduce(loss.detach()).item() / world_size)
    return losses, moves


@functools.cache
def _eager_ep2():
    return run_on_ranks(2, train_steps, 2, False, "none")


@pytest.mark.parametrize("compile,ac", [(False, "selective"), (False, "full"), (True, "none")])
def test_ep2_training_compiled_and_checkpointed_matches_eager(compile, ac):
    eager = _eager_ep2()
    got = run_on_ranks(2, train_steps, 2, compile, ac)
    for (l_e, m_e), (l_g, m_g) in zip(eager, got):
        assert max(abs(a - b) for a, b in zip(l_e, l_g)) < 1e-10, (l_e, l_g)
        if ac == "selective" or not compile and ac == "none":
            assert m_g == m_e, (m_e, m_g)  # selective recomputation communicates nothing
        if ac == "full" and not compile:
            assert all(g > e for g, e in zip(m_g, m_e)), (m_e, m_g)  # full recomputation moves tokens again


@pytest.mark.parametrize("ac", ["selective", "full"])
def test_standard_activation_memory_checkpointed_matches_eager(ac):
    """activation_memory "standard" under selective / full recomputation: the eager layer's losses (the default
    minimal experts; float64), and selective recomputation still moves no row again. (Compiled, both paths run
    in the parity draw and tests/test_parity.COMPILED.)"""
    eager = _eager_ep2()
    got = run_on_ranks(2, train_steps, 2, False, ac, 3, {"activation_memory": "standard"})
    for (l_e, m_e), (l_g, m_g) in zip(eager, got):
        assert max(abs(a - b) for a, b in zip(l_e, l_g)) < 1e-10, (l_e, l_g)
        if ac == "selective":
            assert m_g == m_e, (m_e, m_g)


def test_selective_checkpointing_of_padded_dispatch_moves_no_row_again():
    """pad_to_capacity moves rows by its own op (pair_move): selective recomputation must keep its output too, so
    the checkpointed step exchanges exactly what the plain step does (full recomputation exchanges more)."""
    padded = dict(capacity_factor=1.0, pad_to_capacity=True)
    plain, selective, full = (run_on_ranks(2, train_steps, 2, False, ac, 2, padded)
                              for ac in ("none", "selective", "full"))
    for (l_p, m_p), (l_s, m_s), (_, m_f) in zip(plain, selective, full):
        assert max(abs(a - b) for a, b in zip(l_p, l_s)) < 1e-10, (l_p, l_s)
        assert m_s == m_p, (m_p, m_s)
        assert all(f > p for f, p in zip(m_f, m_p)), (m_p, m_f)


def test_training_compiled_with_experts_fsdp_sharded_matches_eager():
    """EDP2 x EP2 on 4 ranks: compiled blocks gather the experts over EDP inside the graph (no FSDP unit, no
    graph break); losses equal eager EP2's on 2 ranks (the same global batches), whose experts have no EDP."""
    eager = _eager_ep2()[0][0]
    got = run_on_ranks(4, train_steps, 2, "aot_eager", "none")
    for l_g, _ in got:
        assert max(abs(a - b) for a, b in zip(eager, l_g)) < 1e-10, (eager, l_g)


def opcheck_dispatch_ops(rank, world_size):
    """torch.library.opcheck of the dispatcher's ops on a real EP group, with and without copies."""
    from dtensor_moe import MoEParallelDims
    from dtensor_moe.parallel.exchange import ep_move, exchange_tables, group_name, pair_move
    from dtensor_moe.routing.tables import TokenCopies, expert_major

    meshes = MoEParallelDims(world_size, ep=world_size).build_meshes("cpu")
    groups = (group_name(meshes.expert["ep"].get_group()), group_name(meshes.expert["etp"].get_group()))
    torch.manual_seed(rank)
    T, K, E = 3, 2, 4
    experts_TK = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    sorted_N, order_N = torch.sort(experts_TK.flatten(), stable=True)
    counts_E = torch.bincount(sorted_N, minlength=E)
    copies = TokenCopies.build(order_N, sorted_N, torch.rand(T, K, dtype=torch.float64))
    torch.library.opcheck(exchange_tables, (counts_E, copies.expert_N, copies.pair_N, T, K, *groups))
    none = counts_E.new_empty(0)
    torch.library.opcheck(exchange_tables, (counts_E, none, none, T * K, 0, *groups))
    C_host = exchange_tables(counts_E, copies.expert_N, copies.pair_N, T, K, *groups)[0]
    x = torch.randn(int(C_host[0, rank, :, -1].sum()), 4, dtype=torch.float64, requires_grad=True)
    torch.library.opcheck(ep_move, ([x], C_host, "rows", "there", *groups, [x.shape[0]]))
    # A capacity-dropped pair (expert id E, last): left out of the plan; "there" leaves its row behind.
    sorted_N, order_N, kept_E = expert_major(torch.where(torch.arange(T * K) == rank, E, experts_TK.flatten()), E)
    dropped = TokenCopies.build(order_N, sorted_N, torch.rand(T, K, dtype=torch.float64))
    torch.library.opcheck(exchange_tables, (kept_E, dropped.expert_N, dropped.pair_N, T, K, *groups))
    C_host = exchange_tables(kept_E, dropped.expert_N, dropped.pair_N, T, K, *groups)[0]
    w = dropped.weight_N[:, None].detach().requires_grad_(True)
    torch.library.opcheck(ep_move, ([w], C_host, "pairs", "there", *groups, [T * K]))
    # pad_to_capacity's movement: 3 rows to each EP peer.
    rows = torch.randn(3 * world_size, 4, dtype=torch.float64, requires_grad=True)
    for direction in ("there", "back"):
        torch.library.opcheck(pair_move, (rows, 3, "slots", direction, *groups))
    return int(C_host[0, rank, :, :-1].sum()) == T * K - 1


def test_dispatch_ops_pass_opcheck():
    assert all(run_on_ranks(2, opcheck_dispatch_ops))


def test_expert_gate_and_bias_ops_pass_opcheck():
    """opcheck (fake impl, autograd registration, schema) and gradcheck of the clamped SwiGLU and the
    per-expert bias gradient (segment_sum), empty experts included."""
    from dtensor_moe.kernels.segment_sum import segment_sum
    from dtensor_moe.kernels.swiglu import clamped_swiglu, weighted_gate_backward

    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(6, 5, dtype=torch.float64, generator=g).mul(2).requires_grad_() for _ in range(2))
    torch.library.opcheck(clamped_swiglu, (a, b, 1.702, 1.5))
    torch.autograd.gradcheck(lambda a, b: clamped_swiglu(a, b, 1.702, 1.5), (a, b))
    # The minimal-memory experts' fused gate backward (a backward itself: schema and fake impl), both gates.
    du, w = torch.randn(6, 5, dtype=torch.float64, generator=g), torch.rand(6, dtype=torch.float64, generator=g)
    for clamped in (False, True):
        torch.library.opcheck(weighted_gate_backward, (du, a.detach(), b.detach(), w, clamped, 1.702, 1.5))
    offs_E = torch.tensor([2, 2, 6], dtype=torch.int32)
    torch.library.opcheck(segment_sum, (a, offs_E))
    torch.autograd.gradcheck(lambda a: segment_sum(a, offs_E), (a,))
    torch.testing.assert_close(segment_sum(a, offs_E), torch.stack([a[:2].sum(0), a[:0].sum(0), a[2:].sum(0)]))


def test_empty_rank_launch_grid_is_guarded_where_torch_divides_by_zero():
    """inductor_grid: torch 2.11's 2D launch grid divides by zero when ynumel is 0 (an EP rank with no token); the
    guard makes that grid empty and leaves every other grid as it was; a torch that guards it itself is left alone."""
    from torch._inductor.runtime.triton_heuristics import Grid2DWithYZOverflow, get_max_y_grid

    from dtensor_moe.parallel import inductor_grid

    class Unguarded(Grid2DWithYZOverflow):  # torch 2.11's generate (meta alone)
        def generate(self, meta):
            self.x_grid = self.ceildiv("xnumel", meta.get("XBLOCK"))
            self.prefix.extend([self.assign_tmp("y_grid_raw_", self.ceildiv("ynumel", meta.get("YBLOCK"))),
                                self.assign_tmp("y_grid_div_", self.ceildiv("y_grid_raw_", get_max_y_grid()))])
            self.y_grid = self.ceildiv("y_grid_raw_", "y_grid_div_")
            self.z_grid = "y_grid_div_"

    def grid(cls, ynumel):
        g = cls(inductor_meta={}, mode="python")
        g.generate({"XBLOCK": 8, "YBLOCK": 4})
        scope = {"xnumel": 100, "ynumel": ynumel}
        exec("\n".join([*g.prefix, f"grid = ({g.x_grid}, {g.y_grid}, {g.z_grid})"]), scope)
        return scope["grid"]

    assert inductor_grid._divides_by_zero(Unguarded)
    with pytest.raises(ZeroDivisionError):
        grid(Unguarded, 0)
    Guarded = type("Guarded", (Unguarded,), {"generate": inductor_grid.with_empty_y_guard(Unguarded.generate)})
    assert not inductor_grid._divides_by_zero(Guarded)
    assert grid(Guarded, 0) == (13, 0, 0)  # nothing launched
    for ynumel in (1, 4, 5, 4 * 65535, 4 * 65535 + 1, 10**7):
        assert grid(Guarded, ynumel) == grid(Unguarded, ynumel), ynumel
    g = Guarded(inductor_meta={}, mode="cpp")
    g.generate({"XBLOCK": 8, "YBLOCK": 4})
    assert g.y_grid.startswith("(y_grid_div_ == 0 ? 0 : ")
    # The patch itself: inductor's class given the unguarded form is patched once, then left alone.
    with mock.patch.object(Grid2DWithYZOverflow, "generate", Unguarded.generate):
        assert inductor_grid.guard_empty_y_grid()
        assert grid(Grid2DWithYZOverflow, 0) == (13, 0, 0)
        assert not inductor_grid.guard_empty_y_grid()
    # This torch (2.13) generates the guard itself: nothing to patch.
    generate = Grid2DWithYZOverflow.generate
    assert not inductor_grid.guard_empty_y_grid() and Grid2DWithYZOverflow.generate is generate
