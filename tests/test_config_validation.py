"""Every config dataclass checks types and ranges when built, naming the field and its valid values."""

import math
import subprocess
import sys
from dataclasses import fields

import pytest

from dtensor_moe.config import MoEConfig, MoERunOptions
from dtensor_moe.parallel.mesh import MoEParallelDims
from dtensor_moe.train.config import Config, DataConfig, ModelConfig, ParallelConfig, TrainingConfig, load_config

MOE = dict(dim=8, hidden_dim=8, num_experts=8, top_k=2)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(top_k=2.5), "MoEConfig.top_k must be an int in 1..num_experts (8), got 2.5"),
        (dict(top_k=True), "MoEConfig.top_k must be an int in 1..num_experts (8), got True (bool)"),
        (dict(num_experts=4.0), "MoEConfig.num_experts must be an int >= 1, got 4.0"),
        (dict(dim="8"), "MoEConfig.dim must be an int >= 1, got '8' (str)"),
        (dict(top_k=0), "MoEConfig.top_k must be in 1..num_experts (8), got 0"),
        (dict(aux_loss_coeff=math.nan), "MoEConfig.aux_loss_coeff must be a finite number >= 0, got nan"),
        (dict(aux_loss_coeff=-1e-3), "MoEConfig.aux_loss_coeff must be >= 0, got -0.001"),
        (dict(bias_update_rate=math.inf), "MoEConfig.bias_update_rate must be a finite number >= 0, got inf"),
        (dict(route_scale=-1.0), "MoEConfig.route_scale must be > 0, got -1.0"),
        (dict(route_scale=0), "MoEConfig.route_scale must be > 0, got 0"),
        (dict(route_norm=1), "MoEConfig.route_norm must be a bool (true or false), got 1 (int)"),
        (
            dict(score_func=None),
            "MoEConfig.score_func must be one of ['softmax', 'sigmoid', 'topk_softmax'], got None (NoneType)",
        ),
        (
            dict(num_expert_groups=3),
            "MoEConfig.num_experts (8) must be divisible by MoEConfig.num_expert_groups (3); "
            "valid num_expert_groups: [1, 2, 4, 8]",
        ),
        (dict(num_expert_groups=0), "MoEConfig.num_expert_groups must be in 1..num_experts (8), got 0"),
        (
            dict(num_expert_groups=16),
            "MoEConfig.num_expert_groups (16) must be <= num_experts (8); valid num_expert_groups: 1..8",
        ),
        (
            dict(num_expert_groups=4, num_limited_groups=5),
            "MoEConfig.num_limited_groups (5) must be <= num_expert_groups (4); valid num_limited_groups: 1..4",
        ),
        (
            dict(num_expert_groups=4, num_limited_groups=0),
            "MoEConfig.num_limited_groups must be in 1..num_expert_groups (4), got 0",
        ),
        (
            dict(num_expert_groups=4, num_limited_groups=1, top_k=3),
            "MoEConfig.top_k (3) must be <= num_limited_groups * "
            "num_experts / num_expert_groups (1 * 8 / 4 = 2), the experts the kept groups hold; valid top_k: 1..2",
        ),
        (dict(router_bias=0), "MoEConfig.router_bias must be a bool (true or false), got 0 (int)"),
        (dict(seq_aux_loss_coeff=-1), "MoEConfig.seq_aux_loss_coeff must be >= 0, got -1"),
        (dict(z_loss_coeff=math.nan), "MoEConfig.z_loss_coeff must be a finite number >= 0, got nan"),
        (dict(activation="gelu"), "MoEConfig.activation must be one of ['swiglu', 'clamped_swiglu'], got 'gelu'"),
        (dict(swiglu_limit=0.0), "MoEConfig.swiglu_limit must be > 0, got 0.0"),
        (dict(expert_biases=1), "MoEConfig.expert_biases must be a bool (true or false), got 1 (int)"),
    ],
)
def test_moe_config_types_and_ranges(kwargs, message):
    with pytest.raises(ValueError) as err:
        MoEConfig(**{**MOE, **kwargs})
    assert str(err.value) == message


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (
            dict(capacity_factor=0),
            "MoERunOptions.capacity_factor must be a finite number > 0, or None (no capacity limit), got 0",
        ),
        (
            dict(capacity_factor="1"),
            "MoERunOptions.capacity_factor must be a finite number > 0, or None (no capacity limit), got '1'",
        ),
        (
            dict(capacity_factor=math.inf),
            "MoERunOptions.capacity_factor must be a finite number > 0, or None (no capacity limit), got inf",
        ),
        (dict(drop_policy="random"), "MoERunOptions.drop_policy must be one of ['probs', 'position'], got 'random'"),
        (
            dict(pad_to_capacity=True),
            "MoERunOptions.pad_to_capacity=True needs MoERunOptions.capacity_factor (a finite "
            "number > 0; every expert gets exactly ceil(tokens * top_k / num_experts * "
            "capacity_factor) rows), got MoERunOptions.capacity_factor=None; valid: "
            "pad_to_capacity false, or a capacity_factor",
        ),
        (
            dict(pad_to_capacity=1, capacity_factor=1.0),
            "MoERunOptions.pad_to_capacity must be a bool (true or false), got 1 (int)",
        ),
        (dict(round_tokens_to=-128), "MoERunOptions.round_tokens_to must be >= 0, got -128"),
        (dict(round_tokens_to=128.0), "MoERunOptions.round_tokens_to must be an int >= 0, got 128.0"),
        (dict(round_tokens_to=True), "MoERunOptions.round_tokens_to must be an int >= 0, got True (bool)"),
        (
            dict(round_tokens_to=128, capacity_factor=1.0, pad_to_capacity=True),
            "MoERunOptions.round_tokens_to (128) needs unpadded routing, got MoERunOptions.pad_to_capacity=True (every "
            "expert's block is its capacity, whatever the counts); valid: round_tokens_to 0, or pad_to_capacity false",
        ),
        (dict(expert_replicas=-1), "MoERunOptions.expert_replicas must be >= 0, got -1"),
        (dict(expert_precision="fp16"), "MoERunOptions.expert_precision must be one of ['bf16', 'fp8'], got 'fp16'"),
        (
            dict(activation_memory="least"),
            "MoERunOptions.activation_memory must be one of ['standard', 'minimal'], got 'least'",
        ),
    ],
)
def test_run_options_types_and_ranges(kwargs, message):
    with pytest.raises(ValueError) as err:
        MoERunOptions(**kwargs)
    assert str(err.value) == message


@pytest.mark.parametrize("field", sorted(f.name for f in fields(MoERunOptions)))
def test_run_options_are_no_moe_config_fields(field):
    """What a run computes the layer with is MoERunOptions alone: MoEConfig, what a checkpoint holds, takes none."""
    assert field not in {f.name for f in fields(MoEConfig)}
    with pytest.raises(TypeError, match=rf"unexpected keyword argument '{field}'"):
        MoEConfig(**MOE, **{field: getattr(MoERunOptions(), field)})


def test_ints_are_fine_for_float_fields():
    assert MoEConfig(**MOE, route_scale=2, aux_loss_coeff=0).route_scale == 2


@pytest.mark.parametrize(
    "args,kwargs,message",
    [
        ((8,), dict(ep=2.0), "MoEParallelDims.ep must be an int >= 1, got 2.0"),
        ((8,), dict(ep="2"), "MoEParallelDims.ep must be an int >= 1, got '2' (str)"),
        ((8,), dict(etp=True), "MoEParallelDims.etp must be an int >= 1, got True (bool)"),
        ((8.0,), dict(), "MoEParallelDims.world_size must be an int >= 1, got 8.0"),
        (
            (8,),
            dict(dp_shard=None),
            "MoEParallelDims.dp_shard must be an int -1 (the rest of the world) or >= 1, got None (NoneType)",
        ),
        ((8,), dict(ep=0), "ep must be >= 1, got 0"),  # the range messages stay as they were
    ],
)
def test_parallel_dims_types(args, kwargs, message):
    with pytest.raises(ValueError) as err:
        MoEParallelDims(*args, **kwargs)
    assert str(err.value) == message


@pytest.mark.parametrize(
    "cls,kwargs,message",
    [
        (ModelConfig, dict(top_k=2.5), "model.top_k must be an int in 1..num_experts (8), got 2.5"),
        (ModelConfig, dict(top_k=9), "model.top_k (9) must be <= num_experts (8); valid top_k: 1..8"),
        (
            ModelConfig,
            dict(n_heads=3),
            "model.dim (64) must be divisible by model.n_heads (3); valid n_heads: [1, 2, 4, 8, 16, 32]",
        ),
        (
            ModelConfig,
            dict(n_heads=64),
            "model.dim / model.n_heads = 1 (the head dim) must be even for rotary embeddings; "
            "valid n_heads for dim 64: [1, 2, 4, 8, 16, 32]",
        ),
        (ModelConfig, dict(hidden_dim=0), "model.hidden_dim must be >= 1, got 0"),
        (ModelConfig, dict(route_scale=math.nan), "model.route_scale must be a finite number > 0, got nan"),
        (ModelConfig, dict(norm_eps=0.0), "model.norm_eps must be > 0, got 0.0"),
        (ModelConfig, dict(max_seq_len=0), "model.max_seq_len must be >= 1, got 0"),
        (
            ModelConfig,
            dict(tie_embeddings="yes"),
            "model.tie_embeddings must be a bool (true or false), got 'yes' (str)",
        ),
        (
            ModelConfig,
            dict(num_expert_groups=3),
            "model.num_experts (8) must be divisible by model.num_expert_groups (3); "
            "valid num_expert_groups: [1, 2, 4, 8]",
        ),
        (ParallelConfig, dict(ep=2.0), "parallel.ep must be an int >= 1, got 2.0"),
        (ParallelConfig, dict(nproc=0), "parallel.nproc must be >= 1, got 0"),
        (ParallelConfig, dict(device="tpu"), "parallel.device must be one of ['cpu', 'cuda'], got 'tpu'"),
        (ParallelConfig, dict(backend="mpi"), "parallel.backend must be one of ['auto', 'nccl', 'gloo'], got 'mpi'"),
        (ParallelConfig, dict(backend=None), "parallel.backend must be one of ['auto', 'nccl', 'gloo'], got None "
                                             "(NoneType)"),
        (
            ParallelConfig,
            dict(backend="nccl"),
            "parallel.backend = 'nccl' needs parallel.device = 'cuda' (NCCL runs on GPUs only), got parallel.device "
            "= 'cpu'; valid: parallel.backend = 'auto' or 'gloo' with parallel.device = 'cpu', or parallel.device = "
            "'cuda'",
        ),
        (
            ParallelConfig,
            dict(pp=2, device="cuda", backend="gloo"),
            "parallel.pp = 2 with parallel.backend = 'gloo' on parallel.device = 'cuda': gloo's send/recv between "
            "pipeline stages takes no CUDA tensors; valid: parallel.backend = 'nccl' (one GPU a rank), "
            "parallel.pp = 1, or parallel.device = 'cpu'",
        ),
        (TrainingConfig, dict(steps="ten"), "training.steps must be an int >= 1, got 'ten' (str)"),
        (TrainingConfig, dict(steps=-5), "training.steps must be >= 1, got -5"),
        (TrainingConfig, dict(global_batch=0), "training.global_batch must be >= 1, got 0"),
        (TrainingConfig, dict(seq_len=0), "training.seq_len must be >= 1, got 0"),
        (TrainingConfig, dict(lr=0), "training.lr must be > 0, got 0"),
        (TrainingConfig, dict(lr=math.inf), "training.lr must be a finite number > 0, got inf"),
        (TrainingConfig, dict(min_lr_ratio=2), "training.min_lr_ratio must be in 0..1, got 2"),
        (TrainingConfig, dict(warmup_steps=-1), "training.warmup_steps must be >= 0, got -1"),
        (TrainingConfig, dict(max_norm=0), "training.max_norm must be > 0, got 0"),
        (TrainingConfig, dict(loss_chunk_tokens=-1), "training.loss_chunk_tokens must be >= 0, got -1"),
        (TrainingConfig, dict(loss_chunk_tokens=2.5), "training.loss_chunk_tokens must be an int >= 0, got 2.5"),
        (TrainingConfig, dict(dtype="fp16"), "training.dtype must be one of ['float32', 'bf16'], got 'fp16'"),
        (TrainingConfig, dict(seed=-1), "training.seed must be in 0..4294967295, got -1"),
        (
            TrainingConfig,
            dict(activation_checkpoint="some"),
            "training.activation_checkpoint must be one of ['none', 'full', 'selective'], got 'some'",
        ),
        (
            TrainingConfig,
            dict(activation_checkpoint=1),
            "training.activation_checkpoint must be one of ['none', 'full', 'selective'], got 1",
        ),
        (DataConfig, dict(source="web"), "data.source must be one of ['corpus', 'synthetic', 'files'], got 'web'"),
    ],
)
def test_training_config_types_and_ranges(cls, kwargs, message):
    with pytest.raises(ValueError) as err:
        cls(**kwargs)
    assert str(err.value) == message


@pytest.mark.parametrize("device,backend,resolved", [
    ("cpu", "auto", "gloo"), ("cuda", "auto", "nccl"), ("cpu", "gloo", "gloo"), ("cuda", "gloo", "gloo"),
    ("cuda", "nccl", "nccl"),
])
def test_backend_auto_resolves_per_device(device, backend, resolved):
    """What `init_process_group` gets: auto is the device's own backend; gloo on cuda is kept (ranks share GPUs)."""
    assert ParallelConfig(device=device, backend=backend).resolved_backend == resolved
    overrides = [f"parallel.device={device}", f"parallel.backend={backend}"]
    assert load_config("configs/tiny_cpu.toml", overrides).parallel.resolved_backend == resolved


def test_backend_defaults_to_auto():
    assert ParallelConfig().backend == "auto" and load_config("configs/tiny_cpu.toml").parallel.backend == "auto"


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["training.seq_len=2048"], "training.seq_len (2048) must be <= model.max_seq_len (1024); valid seq_len: "
                                    "1..1024 (or raise model.max_seq_len)"),
        (["model.vocab_size=100"], "model.vocab_size (100) must be >= 256: data.source='corpus' is byte-level "
                                   "(token ids 0..255)"),
        (["training.steps=ten"], "training.steps must be an int >= 1, got 'ten' (str)"),
        (["model.route_norm=True"], "model.route_norm must be a bool (true or false), got 'True' (str)"),
        (["model.num_expert_groups=4", "model.num_limited_groups=1", "model.top_k=3"],
         "model.top_k (3) must be <= num_limited_groups * num_experts / num_expert_groups (1 * 8 / 4 = 2), the experts "
         "the kept groups hold; valid top_k: 1..2"),
        # [moe_run]: MoERunOptions' checks, named as the section's keys.
        (["moe_run.capacity_factor=-1.0"],
         "moe_run.capacity_factor must be a finite number > 0, or None (no capacity limit), got -1.0"),
        (["moe_run.pad_to_capacity=true"],
         "moe_run.pad_to_capacity=True needs moe_run.capacity_factor (a finite number > 0; every expert gets exactly "
         "ceil(tokens * top_k / num_experts * capacity_factor) rows), got moe_run.capacity_factor=None; valid: "
         "pad_to_capacity false, or a capacity_factor"),
        # ... and against [model]: a slot holds a copy of one of the layer's experts.
        (["moe_run.expert_replicas=9"],
         "moe_run.expert_replicas (9) must be in 0..num_experts (8): each slot holds a copy of one expert, and more "
         "slots than experts have nothing to hold; valid: moe_run.expert_replicas 0..8"),
    ],
)
def test_cross_section_and_override_values(overrides, message):
    with pytest.raises(ValueError) as err:
        load_config("configs/tiny_cpu.toml", overrides)
    assert str(err.value) == message


def test_moe_run_section_of_a_config_file(tmp_path):
    """[moe_run] is Config.moe_run, a MoERunOptions (what [model], the checkpoint's architecture, no longer holds);
    overrides set its keys as moe_run.<key>, and an unknown key is refused naming the valid ones."""
    path = tmp_path / "run.toml"
    path.write_text("[model]\nnum_experts = 8\ntop_k = 2\n[moe_run]\ncapacity_factor = 1.25\n"
                    "drop_policy = \"position\"\nexpert_replicas = 2\nactivation_memory = \"standard\"\n")
    cfg = load_config(str(path), ["moe_run.round_tokens_to=4"])
    assert cfg.moe_run == MoERunOptions(capacity_factor=1.25, drop_policy="position", expert_replicas=2,
                                        activation_memory="standard", round_tokens_to=4)
    assert not hasattr(cfg.model, "capacity_factor") and cfg.model.moe_config().top_k == 2
    assert load_config(None).moe_run == MoERunOptions()  # no [moe_run]: the defaults
    valid = sorted(f.name for f in fields(MoERunOptions))
    path.write_text("[model]\ntop_k = 2\n[moe_run]\ncapacity = 1.25\n")
    with pytest.raises(ValueError) as err:
        load_config(str(path))
    assert str(err.value) == f"unknown [moe_run] keys ['capacity']; valid keys: {valid}"
    with pytest.raises(ValueError) as err:
        load_config(None, ["moe_run.replicas=1"])
    assert str(err.value) == f"unknown [moe_run] keys ['replicas']; valid keys: {valid}"
    # A run option under [model] (where it was before MoERunOptions) is an unknown [model] key.
    path.write_text("[model]\ntop_k = 2\ncapacity_factor = 1.25\n")
    moved = r"^unknown \[model\] keys \['capacity_factor'\]; \['capacity_factor'\] are \[moe_run\] keys "
    with pytest.raises(ValueError, match=moved):
        load_config(str(path))


def test_missing_and_malformed_config_files(tmp_path):
    with pytest.raises(ValueError, match=r"^config file '.*nope\.toml' not found$"):
        load_config(str(tmp_path / "nope.toml"))
    bad = tmp_path / "bad.toml"
    bad.write_text("[model]\ndim = 64\nn_heads = = 4\n")
    with pytest.raises(ValueError, match=r"bad\.toml' is not valid TOML: Invalid value \(at line 3, column 11\)"):
        load_config(str(bad))
    bad.write_text("model = 3\n")
    with pytest.raises(
        ValueError, match=r"\[model\] in .*bad\.toml must be a table of key = value lines, got model = 3"
    ):
        load_config(str(bad))
    with pytest.raises(ValueError, match="is a directory, not a TOML file"):
        load_config(str(tmp_path))


@pytest.mark.parametrize("text", ["", "# nothing yet\n", "[model]\n[training]\n", "[parallel]\nnproc = 2\n"])
def test_a_config_file_that_sets_no_model_or_training_key_is_refused(tmp_path, text):
    """It would train the built-in defaults (50 steps) in silence: an empty, truncated or wrong file."""
    path = tmp_path / "empty.toml"
    path.write_text(text)
    with pytest.raises(ValueError) as err:
        load_config(str(path), ["training.steps=2"])  # an override does not make the file describe a run
    assert str(err.value) == (
        f"config file {str(path)!r} sets no [model] or [training] key; it must set at least one, e.g. [training] "
        "steps = 50 (configs/ has complete examples), rather than train the built-in defaults"
    )
    path.write_text("[parallel]\nnproc = 2\n[training]\nsteps = 2\n")
    assert load_config(str(path)).training.steps == 2
    assert load_config(None).training.steps == 50  # code asking for the defaults gets them


def test_an_override_given_twice_with_different_values_is_refused():
    with pytest.raises(ValueError) as err:
        load_config("configs/tiny_cpu.toml", ["training.lr=1", "parallel.ep=1", "training.lr=2"])
    assert str(err.value) == (
        "override training.lr is given twice with different values (training.lr=1 and training.lr=2); give it once"
    )
    assert load_config("configs/tiny_cpu.toml", ["training.lr=1e-3", "training.lr=0.001"]).training.lr == 1e-3


def test_validation_is_torch_free():
    code = (
        "import sys, dtensor_moe.validate, dtensor_moe.config, dtensor_moe.parallel.mesh, dtensor_moe.train.config; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def _message(fn) -> str:
    with pytest.raises(ValueError) as err:
        fn()
    return str(err.value)


@pytest.mark.parametrize(
    "model,tp,message",
    [
        (dict(n_heads=4), 3, "model.n_heads (4) must be divisible by parallel.tp (3) so each TP rank owns whole heads; "
                             "valid tp: [1, 2, 4]"),
        (dict(tie_embeddings=True), 2, "parallel.tp=2 needs model.tie_embeddings = false (the embedding is sharded by "
                                       "vocabulary rows, the head by output features); valid: model.tie_embeddings = "
                                       "false, or parallel.tp = 1"),
    ],
)
def test_tp_rules_read_the_same_from_the_config_and_the_model(model, tp, message):
    """One rule, two entry points: the config names the field parallel.tp, parallelize_transformer's check the
    argument tp; the rest of the message is the same."""
    from dtensor_moe.train.model import MoETransformer
    from dtensor_moe.train.parallel.tensor_parallel import check_tp_model

    cfg = ModelConfig(vocab_size=256, dim=16, n_layers=1, hidden_dim=8, num_experts=4, **model)
    assert _message(lambda: Config(model=cfg, parallel=ParallelConfig(tp=tp))) == message
    assert _message(lambda: check_tp_model(MoETransformer(cfg), tp)) == message.replace("parallel.", "")


@pytest.mark.parametrize("mode", ["some", 1, None])
def test_activation_checkpoint_modes_read_the_same_everywhere(mode):
    """The config, check_compile_with_ac and apply_activation_checkpointing share one check of the modes."""
    from torch import nn

    from dtensor_moe.parallel.compile import apply_activation_checkpointing, check_compile_with_ac

    message = f"activation_checkpoint must be one of ['none', 'full', 'selective'], got {mode!r}"
    assert _message(lambda: TrainingConfig(activation_checkpoint=mode)) == f"training.{message}"
    assert _message(lambda: check_compile_with_ac(mode, False, "training.")) == f"training.{message}"
    assert _message(lambda: apply_activation_checkpointing(nn.Linear(2, 2), mode)) == message


@pytest.mark.parametrize("model", [
    {},
    {"tie_embeddings": True, "num_shared_experts": 2, "n_layers": 3},
    {"router_bias": True, "expert_biases": True, "num_experts": 6, "top_k": 3, "hidden_dim": 24},
])
def test_num_params_counts_the_models_parameters(model):
    """The launcher's checkpoint-size estimate counts what MoETransformer actually holds."""
    from dtensor_moe.train.model import MoETransformer

    cfg = ModelConfig(**model)
    assert cfg.num_params() == sum(p.numel() for p in MoETransformer(cfg).parameters())
