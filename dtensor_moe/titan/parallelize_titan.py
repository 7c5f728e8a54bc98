"""Our parallelize function for torchtitan's MoE decoders (DeepSeek-V3, Qwen3 MoE, gpt-oss: its experts through
gpt_oss.py).

torchtitan's chain with our expert sharding in place of its own: CP attention (ours) -> dense TP ->
EP (ours) -> AC -> compile -> FSDP2. Under CP every block's SDPA attends over the keys and values
gathered over cp (context_parallel.py); torchtitan shards the batches, so each cp rank's MoE takes
its own part of the sequence. Dense TP with sequence parallelism is torchtitan's own
(`Module.parallelize`, its sharding configs for attention, dense FFN, embeddings, norms and head)
with the MoEs left out: every torchtitan `MoE` gets dtensor_moe's placement plan instead. Expert
weights become DTensors on our expert mesh (EP splits experts, ETP splits F), `PairDispatch`
moves tokens around torchtitan's grouped-GEMM experts, and FSDP2 shards the experts over EDP and the
router/shared experts over every rank with its own tokens (dp_shard * cp * tp: under sequence
parallelism each TP rank hands its MoE its own slice of the sequence), each with the plan's shard
dim. The dense rest gets torchtitan's own FSDP2/HSDP (over dp_shard * cp, torchtitan's "fsdp" mesh).
With `--dtensor_moe.experts ours` (the default) our routed experts compute inside torchtitan's MoE (experts.py):
`TokenDispatch` and our kernels on torchtitan's own expert parameters; `titan` keeps torchtitan's
experts behind our `PairDispatch`.
Under pipeline parallelism torchtitan calls this once per stage's model part and our meshes are that
stage's. Parameters keep torchtitan's names, so its checkpointer and Hugging Face state-dict
adapters see the usual keys.
"""

from dataclasses import replace
from functools import partial

from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import PrepareModuleInputOutput, parallelize_module
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.distributed.fsdp import apply_fsdp_to_decoder, get_fsdp_reshard_after_forward_policy
from torchtitan.models.common.moe import MoE
from torchtitan.models.deepseek_v3.mtp import apply_fsdp_to_mtp_decoder
from torchtitan.tools.utils import device_type

from dtensor_moe.config import MoEConfig, MoERunOptions
from dtensor_moe.parallel.compile import apply_compile
from dtensor_moe.parallel.mesh import MoEParallelDims
from dtensor_moe.parallel.placement import WeightPlan, plan_moe, split_gate_up_plans
from dtensor_moe.parallel.shard import shard_moe_layer

from .cp_sdpa import apply_cp
from .experts import adopt
from .gpt_oss import expert_dims, finish_rows, gpt_oss_plans, is_gpt_oss, moe_fields
from .replicas import replica_forward
from .token_rounding import round_titan_tokens
from .trainer import ExpertMeshParallelDims

# Plan names (dtensor_moe's MoE) -> torchtitan's names, relative to the MoE module.
_EXPERTS = "routed_experts.inner_experts"
_TITAN_NAMES = {
    "experts.w1": f"{_EXPERTS}.w1_EFD",
    "experts.w2": f"{_EXPERTS}.w2_EDF",
    "experts.w3": f"{_EXPERTS}.w3_EFD",
}


def moe_config(moe: MoE) -> MoEConfig:
    """The MoEConfig the plan needs, read off a torchtitan MoE module (works on the meta device): torchtitan's
    grouped experts or gpt-oss's (biases, fused gate / up, clamped SwiGLU)."""
    experts, router = moe.routed_experts.inner_experts, moe.router
    gpt_oss = is_gpt_oss(experts)
    E, F, D = expert_dims(experts) if gpt_oss else experts.w1_EFD.shape
    shared = 0
    if moe.shared_experts is not None:
        Fs = moe.shared_experts.w1.weight.shape[0]
        if Fs % F:
            raise ValueError(f"shared experts' hidden dim ({Fs}) must be a multiple of the routed experts' ({F})")
        shared = Fs // F
    return MoEConfig(
        dim=D,
        hidden_dim=F,
        num_experts=E,
        top_k=router.top_k,
        score_func=router.score_func,
        route_norm=router.route_norm,
        route_scale=router.route_scale,
        num_shared_experts=shared,
        router_bias=router.gate.bias is not None,
        **(moe_fields(experts) if gpt_oss else {}),
    )


def titan_plan(moe: MoE, dims: MoEParallelDims) -> tuple[WeightPlan, ...]:
    """plan_moe for a torchtitan MoE, under torchtitan's parameter names."""
    plans = split_gate_up_plans(plan_moe(moe_config(moe), dims))
    if is_gpt_oss(moe.routed_experts.inner_experts):
        plans = gpt_oss_plans(plans, _EXPERTS)
    plans = tuple(replace(wp, name=_TITAN_NAMES.get(wp.name, wp.name)) for wp in plans)
    unplanned = {n for n, _ in moe.named_parameters()} - {wp.name for wp in plans}
    if unplanned:
        raise ValueError(f"MoE parameters {sorted(unplanned)} have no placement in dtensor_moe's plan")
    return plans


def _blocks(model) -> list[nn.Module]:
    return [*model.layers.values(), *(getattr(model, "mtp_layers", None) or [])]


def _apply_dense_tp(model, moes: list[MoE], parallel_dims) -> None:
    """torchtitan's own dense TP with sequence parallelism, our MoEs excluded.

    torchtitan's MoE sharding configs would shard the experts over tp (or over its own EP): they
    are dropped, so `Module.parallelize` leaves every MoE's weights plain for our plan. Each MoE
    then takes its TP rank's sequence slice of the sequence-parallel hidden states as a local
    tensor and hands its output back as that slice. No gradient rescaling (`tp_grads="sum"` with
    `fsdp_sums`, shard_moe_layer): torchtitan's loss is a global sum and every FSDP reduction a sum, so
    each token's gradient is the same on whichever rank holds it, and the MoE's weight gradients (summed
    over the ranks holding its tokens) are the single-process ones."""
    for moe in moes:
        for m in moe.modules():
            m._sharding_config = None
    model.parallelize(parallel_dims)
    boundary = PrepareModuleInputOutput(
        input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),), use_local_input=True,
        output_layouts=(Shard(1),), desired_output_layouts=(Shard(1),), use_local_output=False)
    for moe in moes:
        parallelize_module(moe, parallel_dims.get_mesh("tp"), boundary)


def parallelize_titan(model, *, parallel_dims, training, parallelism, compile_config, ac_config, dump_folder):
    """torchtitan `ModelSpec.parallelize_fn`: torchtitan's dense TP, our expert sharding, then AC,
    compile and torchtitan's dense FSDP2 (on torchtitan's data-parallel mesh, the TP weights' root)."""
    if not isinstance(parallel_dims, ExpertMeshParallelDims):
        raise ValueError(
            "parallelize_titan needs dtensor_moe.titan's Trainer (it carries the expert degrees): "
            "use `--module dtensor_moe.titan --config <one of its config functions>`"
        )
    dims = parallel_dims.moe
    moes = [b.moe for b in _blocks(model) if getattr(b, "moe_enabled", False)]
    plans = [titan_plan(m, dims) for m in moes]  # every check before the first collective
    meshes = dims.build_meshes(device_type)
    if dims.cp > 1:  # before TP, so that its local_map wraps our attention (see context_parallel.py)
        apply_cp(_blocks(model), parallel_dims.get_mesh("cp"), parallelism.context_parallel_load_balancer)
    if dims.tp > 1:
        _apply_dense_tp(model, moes, parallel_dims)
    mp_policy = MixedPrecisionPolicy(
        param_dtype=TORCH_DTYPE_MAP[training.mixed_precision_param],
        reduce_dtype=TORCH_DTYPE_MAP[training.mixed_precision_reduce],
        cast_forward_inputs=False,
    )
    reshard = get_fsdp_reshard_after_forward_policy(parallelism.fsdp_reshard_after_forward, parallel_dims.pp_enabled)
    names = {m: n for n, m in model.named_modules()}
    hook = parallel_dims.hook_config
    options = MoERunOptions() if hook is None else hook.run
    ours = hook is None or hook.experts == "ours"
    for moe, moe_plans in zip(moes, plans):
        config = moe_config(moe)
        if options.round_tokens_to:  # --dtensor_moe.run.round_tokens_to (titan/token_rounding.py)
            round_titan_tokens(moe, config, options.round_tokens_to, dims.ep * dims.etp > 1)
        if ours:  # --dtensor_moe.experts ours (titan/experts.py)
            adopt(moe, config, options)
        # torchtitan's loss is a global sum and its FSDP reductions sum (divide factor 1): expert
        # weight gradients must stay sums too (fsdp_sums: no EP*ETP division in the dispatcher), and the tp
        # ranks' copies sum like torchtitan's TP weights' (tp_grads="sum", by those reductions themselves).
        fsdp_kwargs = {"mp_policy": mp_policy, "reshard_after_forward": reshard}
        # Replicas and the row cap (titan/replicas.py): --dtensor_moe.run.expert_replicas, max_rows_per_rank.
        shard_moe_layer(moe, moe_plans, dims, meshes, fsdp_kwargs, tp_grads="sum", fsdp_sums=True,
                        options=options, layer=f"MoE layer {names[moe]!r}",
                        replica_forward=partial(replica_forward, etp=dims.etp))
        if not ours and is_gpt_oss(moe.routed_experts.inner_experts):
            finish_rows(moe.routed_experts.inner_experts, dims.etp)

    if ac_config is not None:
        ac_config.build(dump_folder=dump_folder).apply(model)
    if compile_config.enable and "model" in compile_config.components:
        # torchtitan compiles each block with fullgraph=True; here the experts' FSDP2 unit sits inside
        # the block, and its hooks break the graph (the dispatcher's hooks around them compile).
        for block in _blocks(model):
            apply_compile(block, compile_config.backend, fullgraph=False)
    apply_fsdp = apply_fsdp_to_mtp_decoder if hasattr(model, "mtp_layers") else apply_fsdp_to_decoder
    apply_fsdp(
        model,
        parallel_dims.get_mesh(["dp_replicate", "fsdp"] if dims.dp_replicate > 1 else "fsdp"),
        param_dtype=mp_policy.param_dtype,
        reduce_dtype=mp_policy.reduce_dtype,
        pp_enabled=parallel_dims.pp_enabled,
        cpu_offload=training.enable_cpu_offload,
        reshard_after_forward_policy=parallelism.fsdp_reshard_after_forward,
        enable_symm_mem=parallelism.enable_fsdp_symm_mem,
    )
    if device_type == "cpu":
        sum_reductions(model)
    return model


def sum_reductions(model: nn.Module) -> nn.Module:
    """Gloo has no PREMUL_SUM, which FSDP2 uses for torchtitan's divide factor 1: reduce with SUM."""
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)
    return model
