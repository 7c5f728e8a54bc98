"""ExpertParallel in one parallelize_module plan beside torch's TP styles, on a plain toy model, against the
1-process float64 reference (outputs, input gradients, every parameter gradient, the aux loss), with its own
FSDP2 units or with compile_moe and fully_shard_moe after it; torch.compile(fullgraph=True) of parallelized
layers: the supported routes compile and match, the others raise the one error that names them; removed keywords are
refused by Python itself."""

import warnings

import pytest
import torch
from torch import nn

from dtensor_moe import (
    ExpertParallel,
    MoE,
    MoEConfig,
    MoEParallelDims,
    compile_moe,
    fully_shard_moe,
    parallelize_moe,
)

from .harness import run_on_ranks

D, H, V = 8, 8, 6  # model dim, wq's output features, head's output features
B, L = 2, 4  # sequences per data-parallel group, their length (tp ranks take L / tp each)
TOL = 1e-10
ROUTE = "compile_moe(model) of layers placed with ExpertParallel(..., gather_in_forward=True)"  # what the error names
CONFIG = MoEConfig(dim=D, hidden_dim=4, num_experts=4, top_k=2, num_shared_experts=1, load_balance="aux_loss",
                   aux_loss_coeff=0.1)


class Toy(nn.Module):
    """Attention's two projections, an MoE with a residual, an LM head: x -> wq -> relu -> wo -> h + moe(h) -> head."""

    def __init__(self):
        super().__init__()
        self.wq = nn.Linear(D, H, bias=False)
        self.wo = nn.Linear(H, D, bias=False)
        self.moe = MoE(CONFIG)
        self.head = nn.Linear(D, V, bias=False)

    def forward(self, x_BLD):
        h_BLD = self.wo(torch.relu(self.wq(x_BLD)))
        return self.head(h_BLD + self.moe(h_BLD))


def _tp_styles(moe_style) -> dict:
    """Sequence parallelism between wo and head: each tp rank hands the MoE its own slice of every sequence."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"wq": ColwiseParallel(), "wo": RowwiseParallel(output_layouts=Shard(1)), "moe": moe_style,
            "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())}


class Reference:
    """The toy on one process: every data-parallel group's B sequences, loss = mean over the groups of each
    group's loss, plus the aux loss (a global-batch value on every rank)."""

    def __init__(self, dims: MoEParallelDims):
        g = torch.Generator().manual_seed(0)
        self.model = Toy().double()
        with torch.no_grad():
            for p in self.model.parameters():
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.5)
        self.state = {k: v.clone() for k, v in self.model.state_dict().items()}
        self.groups = dims.dp
        self.x_GBLD = torch.randn(self.groups * B, L, D, generator=g, dtype=torch.float64)
        self.grad_GBLV = torch.randn(self.groups * B, L, V, generator=g, dtype=torch.float64)
        x = self.x_GBLD.clone().requires_grad_(True)
        self.y_GBLV = self.model(x)
        loss = (self.y_GBLV * self.grad_GBLV).sum() / self.groups + self.model.moe.aux_loss
        loss.backward()
        self.aux_loss, self.x_grad = self.model.moe.aux_loss.detach(), x.grad

    def copy(self, perturb_moe: bool) -> Toy:
        """A fresh toy with the reference weights; `perturb_moe`: its MoE's weights off (parallelize_module's
        src_data_rank 0 must replace them by rank 0's)."""
        model = Toy().double()
        model.load_state_dict(self.state)
        if perturb_moe:
            with torch.no_grad():
                for p in model.moe.parameters():
                    p.add_(1.0)
        return model

    def errors(self, model: nn.Module, dims: MoEParallelDims, rank: int) -> dict:
        """One step of `model` on this rank's group's sequences; worst relative error of each checked tensor."""
        from torch.distributed.tensor import DTensor

        c = dims.dense_coords(rank)
        first = B * (c["dp_replicate"] * dims.dp_shard + c["dp_shard"])
        mine = slice(first, first + B)
        x = self.x_GBLD[mine].clone().requires_grad_(True)
        y = model(x)
        (y * self.grad_GBLV[mine]).sum().add(model.moe.aux_loss).backward()
        errs = {"out": _rel(y, self.y_GBLV[mine]), "aux_loss": _rel(model.moe.aux_loss, self.aux_loss),
                "grad:x": _rel(x.grad, self.x_grad[mine] * self.groups)}
        for name, p in model.named_parameters():
            name = name.replace("_orig_mod.", "")  # torch.compile's wrapper
            grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            errs[f"grad:{name}"] = _rel(grad, self.model.get_parameter(name).grad)
        return errs


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.detach() - want).abs().max() / want.abs().max()).item()


def _fullgraph_error(module: nn.Module, x) -> str:
    """torch.compile(module, fullgraph=True)'s error (only traced: it stops before any graph runs)."""
    try:
        torch.compile(module, fullgraph=True, backend="aot_eager")(x)
    except RuntimeError as e:
        return str(e)
    return "compiled"


def tp_and_ep(rank: int, world_size: int) -> dict:
    """tp=2, ep=2 on 4 ranks (edp=2: the experts are an FSDP2 unit), one parallelize_module call on the TP
    mesh, then the user's fully_shard of the dense rest: eagerly, with the style's own units; compiled in
    torchtitan's order (the style with the experts gathered over EDP inside the graph, compile_moe, then
    fully_shard_moe); then fullgraph compile of the eager layer."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    from dtensor_moe.parallel.shard import dp_fsdp_mesh

    dims = MoEParallelDims(world_size, tp=2, ep=2)
    ref = Reference(dims)
    meshes = dims.build_meshes("cpu")
    out = {}
    for name, style, backend in (
        ("eager", ExpertParallel(dims), None),
        ("compiled", ExpertParallel(meshes=meshes, fully_shard=False, gather_in_forward=True), "aot_eager"),
    ):
        torch._dynamo.reset()
        model = parallelize_module(ref.copy(perturb_moe=rank > 0), meshes.tp, _tp_styles(style))
        if backend:
            compile_moe(model, backend)
            fully_shard_moe(model)
        fully_shard(model, mesh=dp_fsdp_mesh(meshes, dims))
        out[name] = ref.errors(model, dims, rank)
        if name == "eager":
            eager = model
    with pytest.raises(ValueError, match=r"ExpertParallel: MoE layers \['moe'\] are already parallelized"):
        parallelize_module(eager, meshes.tp, {"": ExpertParallel(dims)})
    out["fullgraph_layer"] = _fullgraph_error(eager.moe, torch.zeros(B, L // 2, D, dtype=torch.float64))
    return out


def test_expert_parallel_among_tp_styles_matches_the_reference():
    """Every output and gradient of the toy under TP x EP x EDP equals the reference's (a wrong tp gradient
    scale is off by 2, a wrong src_data_rank by the MoE's perturbation), eagerly and with the MoE's forward
    compiled (compile_moe); then torch.compile(layer, fullgraph=True) of the
    eager one stops at the experts' FSDP2 unit with the error naming the supported route."""
    for r in run_on_ranks(4, tp_and_ep):
        for mode in ("eager", "compiled"):
            assert max(r[mode].values()) < TOL, (mode, r[mode])
            assert len(r[mode]) == 3 + 9, r[mode]  # wq, wo, head, router, shared w1/w2/w3, experts w13/w2
        assert ROUTE in r["fullgraph_layer"] and "experts are an FSDP2 unit" in r["fullgraph_layer"], r
        assert "marked as skipped" not in r["fullgraph_layer"], r["fullgraph_layer"]


def fullgraph_compiles(rank: int, world_size: int) -> dict:
    """torch.compile(..., fullgraph=True) by the user: of the MoE layer, whose experts have no FSDP2 unit
    (tp=2, ep=2, etp=2: no EDP), in the TP toy; of the whole toy, once with the style's units nested in it (the
    error), once placed by ExpertParallel(fully_shard=False, gather_in_forward=True) with the user's FSDP2 root
    outside the graph (ep=2, edp=2: the experts gathered inside it)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    from dtensor_moe.parallel.shard import dp_fsdp_mesh

    out = {}
    dims = MoEParallelDims(world_size, tp=2, ep=2, etp=2)
    ref, meshes = Reference(dims), dims.build_meshes("cpu")
    torch._dynamo.reset()
    model = parallelize_module(ref.copy(perturb_moe=False), meshes.tp, _tp_styles(ExpertParallel(dims)))
    model.moe = torch.compile(model.moe, fullgraph=True, backend="aot_eager")
    fully_shard(model, mesh=dp_fsdp_mesh(meshes, dims))
    out["layer"] = ref.errors(model, dims, rank)
    out["whole_model"] = _fullgraph_error(model, torch.zeros(B, L, D, dtype=torch.float64))

    dims = MoEParallelDims(world_size, ep=2)
    ref, meshes = Reference(dims), dims.build_meshes("cpu")
    torch._dynamo.reset()
    # Any mesh of the ranks does for the style (here the world's): it builds the expert meshes from dims.
    model = parallelize_module(ref.copy(perturb_moe=rank > 0), init_device_mesh("cpu", (world_size,)),
                               {"moe": ExpertParallel(dims, fully_shard=False, gather_in_forward=True)})
    fully_shard(model, mesh=dp_fsdp_mesh(meshes, dims), ignored_params=ExpertParallel.expert_parameters(model))
    out["fsdp_false"] = ref.errors(torch.compile(model, fullgraph=True, backend="aot_eager"), dims, rank)
    return out


def test_fullgraph_compile_of_parallelized_layers():
    for r in run_on_ranks(4, fullgraph_compiles):
        for case in ("layer", "fsdp_false"):
            assert max(r[case].values()) < TOL, (case, r[case])
        assert len(r["fsdp_false"]) == 3 + 9, r["fsdp_false"]  # as in the eager plan: experts w13 and w2
        assert ROUTE in r["whole_model"] and "it is an FSDP2 unit" in r["whole_model"], r["whole_model"]


@pytest.mark.parametrize("kwargs,match", [
    ({}, r"needs dims \(a MoEParallelDims\) or meshes"),
    ({"dims": (4, 2)}, r"dims must be a MoEParallelDims, got tuple"),
    ({"meshes": "world"}, r"meshes must be the MoEMeshes of MoEParallelDims.build_meshes, got str"),
    ({"tp_grads": "max"}, r"tp_grads must be one of \['sum', 'mean'\], got 'max'"),
])
def test_bad_arguments_raise_at_construction(kwargs, match):
    kwargs = {"dims": MoEParallelDims(4, ep=2), **kwargs} if kwargs else kwargs
    with pytest.raises(ValueError, match=match):
        ExpertParallel(**kwargs)


@pytest.mark.parametrize("keyword", ["fsdp", "mp_policy", "reshard_after_forward", "compile", "tp_reduce"])
def test_removed_keywords_are_refused(keyword):
    """The keywords of before fully_shard_moe / compile_moe are gone, not kept alive with a warning."""
    with pytest.raises(TypeError, match=f"unexpected keyword argument '{keyword}'"):
        ExpertParallel(MoEParallelDims(4, ep=2), **{keyword: None})


def test_the_readme_spelling_warns_nothing():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        style = ExpertParallel(MoEParallelDims(4, ep=2, etp=2), device_type="cpu")
    assert (style.fully_shard, style.gather_in_forward, style.tp_grads) == (True, False, "sum")


@pytest.mark.parametrize("call,match", [
    (lambda: compile_moe(MoE(CONFIG), "no_such_backend"), r"compile_moe: backend must be a torch.compile backend name"),
    (lambda: compile_moe(nn.Sequential(MoE(CONFIG)), "aot_eager"), r"compile_moe: MoE layers \['0'\] are not placed"),
    (lambda: fully_shard_moe(MoE(CONFIG)), r"fully_shard_moe: MoE layers \['MoE'\] are not placed yet; valid: "
                                           r"ExpertParallel\(\.\.\., fully_shard=False\)"),
])
def test_compile_moe_and_fully_shard_moe_refuse_unplaced_layers(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_misuse_is_named_at_the_door(monkeypatch):
    """What surfaced as torch internals (AttributeError 'ep', an AssertionError, a failure at the first forward) is
    one typed error naming the argument, before any collective."""
    from torch.distributed.device_mesh import DeviceMesh

    moe = MoE(CONFIG)
    with pytest.raises(TypeError, match=r"dims must be a MoEParallelDims \(the degrees; it builds the meshes itself\), "
                                        r"got DeviceMesh"):
        parallelize_moe(moe, DeviceMesh.__new__(DeviceMesh), device_type="cpu")
    for call in (lambda: parallelize_moe(moe, MoEParallelDims(1), device_type="cpu", mp_policy="bf16"),
                 lambda: fully_shard_moe(moe, mp_policy="bf16")):
        with pytest.raises(TypeError, match=r"mp_policy must be torch.distributed.fsdp.MixedPrecisionPolicy or None, "
                                            r"got 'bf16'"):
            call()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"device_type 'cuda': this machine has no such device \(torch sees no "
                                         r"accelerator\); valid: 'cpu' \(gloo ranks\)"):
        parallelize_moe(moe, MoEParallelDims(1))  # the default device_type


def _compile_twice(rank, world_size):
    moe = parallelize_moe(MoE(CONFIG), MoEParallelDims(world_size), device_type="cpu", compile="aot_eager")
    try:
        compile_moe(moe, "aot_eager")
    except ValueError as e:
        return str(e)


def test_compile_moe_twice_is_refused():
    assert run_on_ranks(1, _compile_twice)[0] == ("compile_moe: MoE layers ['FSDPMoE'] are compiled already; valid: "
                                                  "compile_moe once per model")


@pytest.mark.parametrize("call", [
    lambda m: parallelize_moe(m, MoEParallelDims(1), device_type="cpu"),
    lambda m: fully_shard_moe(m),
    lambda m: compile_moe(m, "aot_eager"),
], ids=["parallelize_moe", "fully_shard_moe", "compile_moe"])
def test_a_tree_without_moe_is_refused(call):
    """A model whose MoE blocks are not ours (a Hugging Face model not swapped) would otherwise come back unchanged,
    every expert unsharded, without a word; refused before any collective (no process group here)."""
    model = nn.Sequential(nn.Linear(D, D), nn.ReLU())
    with pytest.raises(ValueError, match=r"holds no dtensor_moe.MoE layer, so there is nothing to shard; a Hugging "
                                         r"Face model's sparse blocks become ours with parallelize_hf_model"):
        call(model)


@pytest.mark.parametrize(
    "module,dims,match",
    [
        (
            nn.Linear(D, D),
            MoEParallelDims(4, ep=2),
            r"applies to a dtensor_moe.MoE or a module holding MoE layers; "
            r"Linear holds none",
        ),
        (MoE(CONFIG), MoEParallelDims(3, etp=3), r"hidden_dim \(4\) must be divisible by etp \(3\)"),
        (
            nn.Sequential(nn.Linear(D, D), MoE(CONFIG)),
            MoEParallelDims(3, ep=3),
            r"num_experts \(4\) must be divisible by ep",
        ),
    ],
)
def test_bad_modules_raise_before_any_collective(module, dims, match):
    """No process group exists in this process: a collective would fail with another error."""
    with pytest.raises(ValueError, match=match):
        ExpertParallel(dims, device_type="cpu")._apply(module, None)
