"""torchtitan's Trainer with one more config section, `dtensor_moe`: our expert degrees.

`--dtensor_moe.ep`, `--dtensor_moe.etp`, `--dtensor_moe.dp_replicate` on torchtitan's command line;
EDP is what is left: dp_shard * cp * tp / (ep * etp). torchtitan itself keeps seeing a plain FSDP/HSDP job
(its own expert_parallel_degree stays 1) and our parallelize function receives the expert degrees
through `ExpertMeshParallelDims`, torchtitan's ParallelDims plus ours. torchtitan's own
`--parallelism.tensor_parallel_degree` (dense TP with sequence parallelism),
`--parallelism.context_parallel_degree` and `--parallelism.pipeline_parallel_degree` fold in as
MoEParallelDims' tp, cp and pp. Under CP torchtitan shards each batch and the loss as for its own CP
(the token count over the data-parallel ranks, the loss summed over dp * cp, FSDP over dp_shard * cp);
the attention is always ours (titan/cp_sdpa.py), on every device type.
"""

import os
import sys
import time
from dataclasses import dataclass, field, fields

import torch
import torch.distributed as dist
from torchtitan.distributed import ParallelDims
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.common.linear import ScaledBiasRowwiseLinear
from torchtitan.trainer import Trainer as TitanTrainer

from dtensor_moe.config import MoERunOptions, check_replica_mesh, check_replica_slots, check_row_cap
from dtensor_moe.parallel.dispatch import RowCapExceeded
from dtensor_moe.parallel.mesh import MoEParallelDims
from dtensor_moe.routing.token_rounding import check_rounding_reachable
from dtensor_moe.train.supervision import INTERRUPTED_RC, PREEMPTED_RC, ROW_CAP_RC, StopRequests

from . import compat
from .experts import EXPERTS
from .hf import check_hf_export, check_hf_keys, check_hf_load, check_hf_quantized, with_hf_adapter, write_hf_config

compat.install()  # process-wide, so also for torchtitan's own Trainer under this module (titan/compat.py)


@dataclass(kw_only=True, slots=True)
class HookConfig:
    ep: int = 1
    """Expert parallel degree: ranks that split the experts (dim 0 of the expert weights)."""
    etp: int = 1
    """Expert tensor parallel degree: ranks that split each expert's hidden dim F."""
    dp_replicate: int = 1
    """HSDP replicate degree of dense and expert weights (sets parallelism.data_parallel_replicate_degree)."""
    load_balance_coeff: float | None = None
    """Every MoE layer's load_balance_coeff, torchtitan's name for MoEConfig.bias_update_rate (the aux-loss-free
    routing bias expert_bias_E moves by this much a step; not an aux-loss weight): 0 trains no bias; unset keeps
    the model config's (the hook's Qwen3 configs train none)."""
    experts: str = "ours"
    """Who computes the routed experts (titan/experts.py): "ours" (dtensor_moe's `TokenDispatch` and kernels on
    torchtitan's own expert parameters) or "titan" (torchtitan's experts behind our `PairDispatch`). The
    state dict is the same under both: a checkpoint of one resumes under the other."""
    run: MoERunOptions = field(default_factory=MoERunOptions)
    """How our MoE layers run, the main job's `[moe_run]` (`dtensor_moe.MoERunOptions`), as
    `--dtensor_moe.run.<field>`: expert_replicas / replica_replan_every (titan/replicas.py; needs ep > 1 and no
    --compile.enable), max_rows_per_rank, round_tokens_to (titan/token_rounding.py), activation_memory and
    expert_precision (our experts only), dispatch_precision. torchtitan's router drops no tokens here:
    capacity_factor, drop_policy and pad_to_capacity keep their defaults."""


@dataclass
class ExpertMeshParallelDims(ParallelDims):
    """torchtitan's ParallelDims of the dense model, plus the expert degrees our parallelize applies."""

    moe: MoEParallelDims | None = None
    # The hook's `dtensor_moe` section, for what parallelize applies besides the degrees (replicas, row cap).
    hook_config: HookConfig | None = None

    @property
    def ep_enabled(self) -> bool:
        # Expert weights live on our expert mesh, never on torchtitan's dense one, whatever its own ep. torchtitan
        # reads this where that matters to it: its expert-bias update sums the MoEs' token counts over tp only
        # with EP on (under sequence parallelism each TP rank's MoE counts its own tokens). Its clipping also
        # takes the flag, but the hook's Trainer clips with its own norm (compat.train_step_clipping_by_mesh).
        return True


def _only(name: str, value, allowed, hint: str):
    if value != allowed:
        raise ValueError(f"{name}={value!r} is not supported with --module dtensor_moe.titan: {hint}")


class Trainer(TitanTrainer):
    @dataclass(kw_only=True, slots=True)
    class Config(TitanTrainer.Config):
        dtensor_moe: HookConfig = field(default_factory=HookConfig)

        def __post_init__(self):
            TitanTrainer.Config.__post_init__(self)
            with_hf_adapter(self)  # gpt-oss: an HF adapter that keeps the experts (titan/hf.py)
            try:
                _check_config(self)
                dims = check_degrees(self, _world_size(self))
                experts = [m.num_experts for m in _moes(self.model_spec.model)]
                if experts:
                    check_replica_mesh(self.dtensor_moe.run.expert_replicas, min(experts), dims,
                                       "--dtensor_moe.run.expert_replicas", "--dtensor_moe.ep")
            except ValueError as e:
                _refuse(e)

    def init_distributed(self) -> ExpertMeshParallelDims:
        dense = super().init_distributed()
        moe = check_degrees(self.config, dense.world_size)  # checked while parsing: the same dims, no error
        init = {f.name: getattr(dense, f.name) for f in fields(ParallelDims) if not f.name.startswith("_")}
        return ExpertMeshParallelDims(**init, moe=moe, hook_config=self.config.dtensor_moe)

    def __init__(self, config: Config):
        super().__init__(config)
        if self.parallel_dims.pp_enabled:
            compat.accept_premade_microbatches(self.pp_schedule)
            for part in self.model_parts:
                compat.uncount_shape_inference(part)
        _write_config_json_on_export(self.checkpointer, self.config)
        # torchrun hands SIGTERM / SIGINT on to every rank and waits for them (30 s) before it kills them.
        self.stop_requests, self.stopped_by = StopRequests().__enter__(), None

    def should_continue_training(self) -> bool:
        """Before each step every rank votes (one scalar all-reduce): a stop signal on any rank stops all of them
        after the same step, saved in full (model, optimizer, data loader; not the model-only last step), so the
        same command resumes from it through torchtitan's own checkpoint loading."""
        if not super().should_continue_training():  # the last step is done: nothing to stop
            return False
        vote = torch.tensor([self.stop_requests.flag], device=self.device)
        dist.all_reduce(vote, op=dist.ReduceOp.MAX)
        if vote.item() == 0:  # the host must know whether to go on: one sync per step
            return True
        self.stopped_by = self.stop_requests.requested or "a stop signal on another rank"
        ckpt = self.checkpointer
        if ckpt.enable and not ckpt.load_only and self.step % ckpt.interval and self.step > 0:
            compat.save_off_interval(ckpt, self.step)
        ckpt.maybe_wait_for_saving()
        return False

    def close(self) -> None:
        super().close()
        self.stop_requests.__exit__()
        if self.stopped_by is None:
            return
        ckpt = self.checkpointer
        saved = (f"checkpoint {ckpt.folder}/step-{self.step}; the same command resumes from it"
                 if ckpt.enable and not ckpt.load_only and self.step > 0 else
                 "no checkpoint (checkpoint.enable is off)")
        if dist.get_rank() == 0:
            print(f"dtensor_moe.titan: stopped by {self.stopped_by} after step {self.step}; {saved}",
                  file=sys.stderr, flush=True)
        dist.destroy_process_group()  # torchtitan's main would; SystemExit skips it
        raise SystemExit(INTERRUPTED_RC if self.stopped_by == "SIGINT" else PREEMPTED_RC)

    def train_step(self, *args, **kwargs):
        """torchtitan's step, clipping per mesh (our parameters live on more meshes than its clipping can norm); a
        row cap exceeded ends the job as the main job's does: one line, exit status ROW_CAP_RC, no traceback."""
        try:
            return _clipping_train_step(self, *args, **kwargs)
        except RowCapExceeded as e:
            _stop_on_row_cap(self, e)


_clipping_train_step = compat.train_step_clipping_by_mesh(TitanTrainer.train_step)


def _stop_on_row_cap(trainer: Trainer, error: RowCapExceeded) -> None:
    """Every rank of the EP x ETP group that exceeded the cap raises alike (parallel/dispatch.py); its first rank
    says so in one line and leaves at once, the others wait for torchrun to stop them (as _refuse's do), and so do
    the ranks of other groups, waiting in a collective that will not complete. No destroy_process_group: a peer
    may be inside a collective."""
    first = True
    for part in trainer.model_parts:
        hooks = next((m.expert_parallel for m in part.modules() if hasattr(m, "expert_parallel")), None)
        if hooks is not None:
            g = hooks.dispatcher.group
            first = dist.get_rank(g.ep_group) == 0 and dist.get_rank(g.etp_group) == 0
            break
    if first:
        print(f"dtensor_moe.titan: {' '.join(str(error).split())}; the run stopped in step {trainer.step} (no "
              "checkpoint of it)", file=sys.stderr, flush=True)
    _exit(ROW_CAP_RC, wait=not first)


def _exit(code: int, wait: bool) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    if wait:
        time.sleep(REFUSE_WAIT_S)
    os._exit(code)


def _check_config(config: Trainer.Config) -> None:
    """What the hook supports of torchtitan's settings; sets torchtitan's replicate degree to ours."""
    p, ours = config.parallelism, config.dtensor_moe
    _only("parallelism.expert_parallel_degree", p.expert_parallel_degree, 1, "set --dtensor_moe.ep instead")
    _check_experts(config)
    _check_replicas(config)
    _check_rounding(config)
    if p.context_parallel_degree > 1:
        _check_cp(config, p.context_parallel_degree)
    if p.tensor_parallel_degree > 1:
        _check_tp(config, p.tensor_parallel_degree)
    _only("parallelism.spmd_backend", p.spmd_backend, "partial_dtensor", "use 'partial_dtensor'")
    _only(
        "training.disable_cuda_graphs",
        config.training.disable_cuda_graphs,
        True,
        "the expert dispatcher reads token counts on the host; pass --training.disable_cuda_graphs",
    )
    if p.data_parallel_replicate_degree not in (1, ours.dp_replicate):
        raise ValueError(
            f"parallelism.data_parallel_replicate_degree ({p.data_parallel_replicate_degree}) "
            f"conflicts with dtensor_moe.dp_replicate ({ours.dp_replicate}); set only "
            f"--dtensor_moe.dp_replicate"
        )
    p.data_parallel_replicate_degree = ours.dp_replicate
    if ours.load_balance_coeff is not None:
        if ours.load_balance_coeff < 0:
            raise ValueError(f"dtensor_moe.load_balance_coeff={ours.load_balance_coeff} is negative; valid: 0 (no "
                             "routing bias) or a positive step size (torchtitan's default 1e-3)")
        model = config.model_spec.model
        for layer in [*(getattr(model, "layers", None) or []), *(getattr(model, "mtp_layers", None) or [])]:
            if getattr(layer, "moe", None) is not None:
                layer.moe.load_balance_coeff = ours.load_balance_coeff or None
    c = config.checkpoint
    if c.enable and c.last_save_in_hf:
        check_hf_export(config)
    if c.initial_load_in_hf and c.initial_load_path:
        check_hf_keys(config, "checkpoint.initial_load_in_hf")
        check_hf_quantized(config)
        check_hf_load(config.model_spec.model, c.initial_load_path)


def check_degrees(config: Trainer.Config, world_size: int) -> MoEParallelDims:
    """Our expert degrees folded with torchtitan's dense ones over `world_size` ranks.

    A ValueError names the degrees as typed, the constraint and the valid values (MoEParallelDims' checks),
    also where torchtitan's own ParallelDims would only assert (dp_replicate not dividing the world)."""
    p, ours = config.parallelism, config.dtensor_moe
    degrees = {
        "dtensor_moe.dp_replicate": ours.dp_replicate,
        "parallelism.data_parallel_shard_degree": p.data_parallel_shard_degree,
        "parallelism.context_parallel_degree": p.context_parallel_degree,
        "parallelism.tensor_parallel_degree": p.tensor_parallel_degree,
        "parallelism.pipeline_parallel_degree": p.pipeline_parallel_degree,
        "dtensor_moe.ep": ours.ep,
        "dtensor_moe.etp": ours.etp,
    }
    try:
        return MoEParallelDims(world_size, dp_replicate=ours.dp_replicate, dp_shard=p.data_parallel_shard_degree,
                               cp=p.context_parallel_degree, tp=p.tensor_parallel_degree, ep=ours.ep, etp=ours.etp,
                               pp=p.pipeline_parallel_degree)
    except ValueError as e:
        # The ones set (the defaults, dp_shard -1 for the rest of the world and 1 for the others, always fold).
        given = " ".join(f"--{k} {v}" for k, v in degrees.items() if v != (-1 if "shard" in k else 1))
        raise ValueError(f"{given} on WORLD_SIZE={world_size} ranks: {e}") from None


def _world_size(config: Trainer.Config) -> int:
    """The world torchtitan's init_distributed will have, read before any process group exists."""
    if dist.is_initialized():  # torchtitan then keeps the existing group
        return dist.get_world_size()
    if config.comm.mode in ("fake_backend", "local_tensor"):  # its dry runs simulate NGPU ranks
        return int(os.environ.get("NGPU", "1"))
    return int(os.environ.get("WORLD_SIZE", "1"))


# Every rank parses the same command line and fails alike; rank 0 alone says why. The others wait for
# torchrun to stop them when rank 0 exits (it polls every 0.1 s): exiting first, one of them could get
# rank 0 killed before its line is out. The wait is bounded for a rank 0 that never gets this far.
REFUSE_WAIT_S = 60


def _refuse(error: ValueError):
    """A bad config ends the job before any process group exists: one line on the console, exit status 2
    (a command-line error, as tyro's), no traceback or error box per rank."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"dtensor_moe.titan: {' '.join(str(error).split())}", file=sys.stderr, flush=True)
    else:
        time.sleep(REFUSE_WAIT_S)
    raise SystemExit(2)


def _write_config_json_on_export(checkpointer, config: Trainer.Config) -> None:
    """torchtitan's last-step save in HF format writes the safetensors only: rank 0 adds the family's
    config.json (dtype: checkpoint.export_dtype), so the folder loads with transformers' from_pretrained."""
    if not getattr(checkpointer, "last_save_in_hf", False):
        return
    save_last_step = checkpointer._save_last_step

    def save_with_config(curr_step: int) -> None:
        save_last_step(curr_step)
        if dist.get_rank() == 0:
            write_hf_config(config.model_spec.model, checkpointer._create_checkpoint_id(curr_step),
                            config.checkpoint.export_dtype)

    checkpointer._save_last_step = save_with_config


def _check_tp(config: Trainer.Config, tp: int) -> None:
    """What torchtitan's dense TP under our expert plan needs, checked while parsing the command line."""
    if not config.parallelism.enable_sequence_parallel:
        # Without it every TP rank would hand its MoE the same tokens: each would be routed tp times.
        raise ValueError(f"parallelism.tensor_parallel_degree={tp} with --module dtensor_moe.titan needs "
                         "parallelism.enable_sequence_parallel (each TP rank's MoE takes its own sequence slice); "
                         "valid: enable_sequence_parallel true, or tensor_parallel_degree 1")
    for i, layer in enumerate(config.model_spec.model.layers):
        attention = layer.attention
        if isinstance(getattr(attention, "wo", None), ScaledBiasRowwiseLinear.Config):
            raise ValueError(
                f"parallelism.tensor_parallel_degree={tp} with --module dtensor_moe.titan: layers[{i}].attention.wo is "
                "torchtitan's ScaledBiasRowwiseLinear (gpt-oss: its bias divided by tp in the forward), with which "
                "the hook's TP gives wrong gradients (measured: first-step gradients off by up to 0.38 relative under "
                "TP=2); valid: tensor_parallel_degree 1")
        for name in ("n_heads", "n_kv_heads"):
            heads = getattr(attention, name, None)
            if heads is not None and heads % tp:
                raise ValueError(
                    f"parallelism.tensor_parallel_degree ({tp}) must divide layers[{i}].attention.{name} ({heads}) "
                    f"so each TP rank owns whole heads; valid: {[d for d in range(1, heads + 1) if heads % d == 0]}")


def _check_experts(config: Trainer.Config) -> None:
    """--dtensor_moe.experts and the run options only our experts read (titan/experts.py), checked while parsing;
    MoERunOptions checked its own fields when it was built. Which experts a model may have is wrap_config's check
    (config_registry._check_moe_layers: torchtitan's GroupedExperts or gpt-oss's, under either option), made before
    this config exists."""
    ours, run = config.dtensor_moe, config.dtensor_moe.run
    if ours.experts not in EXPERTS:
        raise ValueError(f"--dtensor_moe.experts {ours.experts!r} is not one of {list(EXPERTS)}")
    default = MoERunOptions()
    for name in ("capacity_factor", "drop_policy", "pad_to_capacity"):
        # torchtitan's router and our TokenDispatch and PairDispatch keep every pair: no capacity to drop or pad to.
        if getattr(run, name) != getattr(default, name):
            raise ValueError(f"--dtensor_moe.run.{name} {getattr(run, name)!r} is not supported with --module "
                             f"dtensor_moe.titan (the hook's dispatch is dropless); valid: "
                             f"--dtensor_moe.run.{name} {getattr(default, name)!r}")
    if ours.experts == "titan":
        for name in ("activation_memory", "expert_precision"):
            if getattr(run, name) != getattr(default, name):
                raise ValueError(f"--dtensor_moe.run.{name} {getattr(run, name)} acts on dtensor_moe's experts only, "
                                 f"not with --dtensor_moe.experts titan; valid: --dtensor_moe.experts ours, or "
                                 f"--dtensor_moe.run.{name} {getattr(default, name)}")
    if run.dispatch_precision == "fp8" and ours.ep * ours.etp == 1:
        raise ValueError("--dtensor_moe.run.dispatch_precision fp8 sets the payload of the EP / ETP token exchange, "
                         "and --dtensor_moe.ep 1 --dtensor_moe.etp 1 exchanges none; valid: --dtensor_moe.ep or "
                         "--dtensor_moe.etp > 1, or --dtensor_moe.run.dispatch_precision bf16")


def _check_replicas(config: Trainer.Config) -> None:
    """The replica and row-cap options (titan/replicas.py), checked while parsing."""
    ours, compile_ = config.dtensor_moe, config.compile
    r = ours.run.expert_replicas
    check_row_cap(ours.run.max_rows_per_rank, ours.ep, ours.etp,
                  ("--dtensor_moe.run.max_rows_per_rank", "--dtensor_moe.ep", "--dtensor_moe.etp"))
    experts = [m.num_experts for m in _moes(config.model_spec.model)]
    if experts:  # MoERunOptions' range against the model, 0..num_experts (the fewest experts of any layer)
        check_replica_slots(r, min(experts), "--dtensor_moe.run.expert_replicas", "num_experts")
    if r and compile_.enable and "model" in compile_.components:
        raise ValueError(f"--dtensor_moe.run.expert_replicas {r} with --compile.enable (compile.components "
                         f"{list(compile_.components)}) is not supported: the replicas' split of an expert's rows "
                         "needs each step's counts on the host, eagerly; valid: --dtensor_moe.run.expert_replicas 0, "
                         "or no --compile.enable (or --compile.components without 'model')")


def _check_rounding(config: Trainer.Config) -> None:
    """--dtensor_moe.run.round_tokens_to (titan/token_rounding.py), checked while parsing."""
    run = config.dtensor_moe.run
    M = run.round_tokens_to
    if M and run.expert_replicas:
        # The replicas' split of torchtitan's rows by virtual slot has not been checked with dropped rows.
        raise ValueError(f"--dtensor_moe.run.round_tokens_to {M} with --dtensor_moe.run.expert_replicas "
                         f"{run.expert_replicas} is not supported; valid: one of them 0")
    if M:
        p, t = config.parallelism, config.training
        pp = p.pipeline_parallel_degree > 1
        batch = p.pipeline_parallel_microbatch_size if pp else t.local_batch_size
        split = p.context_parallel_degree * p.tensor_parallel_degree
        flag = "parallelism.pipeline_parallel_microbatch_size" if pp else "training.local_batch_size"
        where = (f"each rank's MoE per forward: --{flag} {batch} x --training.seq_len {t.seq_len}"
                 + (f" / cp*tp {split}" if split > 1 else ""))
        for m in _moes(config.model_spec.model):
            check_rounding_reachable(M, batch * (t.seq_len // split), m.router.top_k, m.num_experts, None, where,
                                     "--dtensor_moe.run.round_tokens_to")


def _moes(model) -> list:
    """The model config's MoE layer configs (decoder layers, then multi-token-prediction layers)."""
    layers = [*(getattr(model, "layers", None) or []), *(getattr(model, "mtp_layers", None) or [])]
    return [layer.moe for layer in layers if getattr(layer, "moe", None) is not None]


def _check_cp(config: Trainer.Config, cp: int) -> None:
    """What our context-parallel attention (titan/cp_sdpa.py) needs, checked while parsing."""
    p = config.parallelism
    if p.context_parallel_load_balancer not in ("headtail", None):
        raise ValueError(f"parallelism.context_parallel_load_balancer={p.context_parallel_load_balancer!r} with "
                         f"parallelism.context_parallel_degree={cp} is not supported with --module dtensor_moe.titan "
                         "(ptrr needs FlexAttention's block masks); valid: 'headtail', or none")
    model = config.model_spec.model
    for where in ("layers", "mtp_layers"):
        for i, layer in enumerate(getattr(model, where, None) or []):
            inner = type(layer.attention.inner_attention)
            if inner is not ScaledDotProductAttention.Config:
                raise ValueError(
                    f"parallelism.context_parallel_degree={cp} with --module dtensor_moe.titan needs SDPA attention: "
                    f"{where}[{i}].attention.inner_attention is {inner.__qualname__}; valid: "
                    "ScaledDotProductAttention (the *_cpu configs), or context_parallel_degree 1")
