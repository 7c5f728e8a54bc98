"""torchtitan hook: torchtitan's Trainer through `--module dtensor_moe.titan` on 4 CPU gloo ranks.

The shrunk DeepSeek-V3 debug model (`deepseek_v3_debugmodel_cpu`), 5 steps, from one seed:
- our EP=2 x ETP=2: the loss falls; the first step's gradients match torchtitan without EP
  (unparallelized experts, FSDP only), as do our EP=2 x ETP=1 ones;
- our EP=2 agrees step by step with torchtitan's own EP=2 on the same mesh, our ETP=2 with ETP=1;
- the step-2 checkpoint torchtitan's checkpointer wrote under our hook loads back and the resumed
  steps 3..5 repeat the uninterrupted run (step 4's loss is the first that the restored optimizer state
  decides, step 5's the first that the restored learning-rate schedule does: step 3 runs at the
  learning rate the optimizer's state holds);
- the documented launcher (torchrun + dtensor_moe.titan.cpu_train) refuses bad degrees in one line (its training
  runs: tests/test_titan_signals.py);
- torchtitan's TP=2, PP=2 (1F1B, 2 microbatches) and CP=2 (its head-tail sequence sharding, our
  all-gather-KV attention) with our EP=2 on 4 ranks, and our EP=2 alone on 2 ranks with torchtitan's blocks
  compiled (aot_eager: the suite's one compiled torchtitan run, its check of compiled blocks against
  eager), 2 steps: losses, gradient norms, first-step gradients (both stages' under PP) and the expert
  biases after the last step match the unparallelized run, our hook at degree 1 on 2 ranks (same
  data-parallel degree, so same batches);
- command-line combinations the hook cannot run are refused while parsing.
The seed checkpoint is written under our hook and loaded by torchtitan's own runs: same keys.

Tolerances. Loss and gradient norm per step: |dloss| < 1e-4, |dnorm| < 1e-4 relative; measured over 5 steps:
ours EP=2 vs torchtitan EP=2 0.0 and 1.2e-7 (the hook clips with per-mesh norms, torchtitan with two: the
same norm, summed in another order; 4.8e-7 in the loss over 10 steps), ETP=2 vs ETP=1 5.7e-6 and 3.2e-7
(3.9e-5 in the loss over 10 steps). Adam hides a wrong gradient scale from the loss (expert gradients 4x too
small moved the loss by < 1e-4 in 10 steps and the norm by < 1e-5), so gradients are compared directly: max
|g - g_ref| / max |g_ref| per parameter < 2e-2; measured 3.4e-3 against torchtitan without EP, from
torchtitan's experts running in bfloat16 (EP groups tokens differently, so bf16 rounding differs), versus
0.75 for that 4x error. TP2 x EP2 and PP2 x EP2 against degree 1 use the same bounds; measured over 2 steps
|dloss| 0.0 (9.5e-7 and 4.8e-7 over 3 steps), |dnorm| 1.1e-7 and 1.0e-7, gradients 4.6e-7 (TP: each EP group
holds one data-parallel rank's tokens, as the reference's ranks do, so the experts' bf16 GEMMs see the same
rows) and 3.4e-3 (PP: the expert weight gradients are bf16 GEMMs per microbatch), expert biases bitwise
equal. CP2 x EP2: |dloss| 0.0 over 2 steps (4.8e-7 over 3), gradients 3.2e-7, biases equal; with the
gathered keys in contiguous order instead of torchtitan's head-tail one the first-step gradient of
layers.0.attention.wq.weight was off by 0.18 relative. EP2 on 2 ranks, blocks compiled (aot_eager): |dloss|
4.8e-7, gradient norms equal, gradients 4.2e-3 (bf16 expert GEMMs over both data-parallel ranks' rows, as in
torchtitan's EP runs), biases equal.
"""


import os
import subprocess
import sys
import time

import pytest
import torch

pytest.importorskip("torchtitan")

from .harness import run_on_ranks  # noqa: E402

WORLD = 4
STEPS = 5
RESUME_STEP = 2  # the checkpoint interval: saved at steps 2, 4 and 5
LOSS_ATOL = 1e-4
GRAD_NORM_RTOL = 1e-4
GRAD_RTOL = 2e-2
# TP and CP keep the reference's float32 expert GEMMs (measured 4.2e-7 / 4.6e-7); 2e-2 is for torchtitan's bf16
# expert GEMMs per microbatch under PP and its own EP runs, and would let a wrong key order under CP pass.
FP32_GRAD_RTOL = 1e-5
_LOAD_ONLY = ("--checkpoint.enable", "--checkpoint.load_only")  # load the seed, write nothing
# torchtitan's --compile.enable on its blocks (dynamo + AOTAutograd; no codegen: a CPU C++ build costs minutes).
# One 2-rank EP2 run compiles: dynamo traces on every rank (the 4-rank compiled CP2 x EP2 run it replaced cost
# 88 CPU s; the `folded` fixture took 150 CPU s with it, 101 with this one).
_COMPILED = ("--compile.enable", "--compile.backend", "aot_eager")
# The launcher test's torchrun (2 ranks, 2 steps): ~30 s alone, minutes on a loaded 2-core machine.
LAUNCHER_TIMEOUT_S = 1.5 * float(os.environ.get("DTENSOR_MOE_TEST_TIMEOUT", "600"))


def _train(rank: int, world: int, argv: list[str], save_step0: bool = False) -> dict:
    """Runs torchtitan's Trainer as `python -m torchtitan.train argv` would, on this pool rank.

    Returns the logged (step, loss, grad_norm) of every step, the full gradient of every
    parameter of this rank's model part at the first optimizer step (under PP the last stage logs
    the loss) and its MoEs' expert biases after the last step; `save_step0` first writes a step-0
    checkpoint."""
    os.environ["LOCAL_RANK"] = str(rank)
    from dtensor_moe.titan.cpu import use_cpu

    use_cpu()
    from torchtitan.config import ConfigManager

    trainer = ConfigManager().parse_args(argv).build()
    record, grads = [], {}
    log, step = trainer.metrics_processor.log, trainer.optimizers.step

    def capture_log(step, loss, max_loss, grad_norm, **kwargs):
        record.append((step, loss, grad_norm))
        return log(step, loss, max_loss, grad_norm, **kwargs)

    def capture_grads(*args, **kwargs):
        if not grads:
            grads.update((n, p.grad.full_tensor()) for n, p in trainer.model_parts[0].named_parameters())
        return step(*args, **kwargs)

    trainer.metrics_processor.log, trainer.optimizers.step = capture_log, capture_grads
    try:
        if save_step0:  # as the last step, so model only (argv sets last_save_model_only)
            trainer.checkpointer.save(curr_step=0, last_step=True)
        trainer.train()
        biases = {n: b.clone() for n, b in trainer.model_parts[0].named_buffers() if n.endswith("expert_bias_E")}
    finally:
        trainer.close()
    return {"log": record, "grads": grads, "expert_bias": biases}


def _argv(config: str, dump, *extra: str) -> list[str]:
    return ["--module", "dtensor_moe.titan", "--config", config, "--dump_folder", str(dump), *extra]


def _ours(dump, ep: int, etp: int, *extra: str) -> list[str]:
    return _argv("deepseek_v3_debugmodel_cpu", dump, "--dtensor_moe.ep", str(ep), "--dtensor_moe.etp", str(etp), *extra)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """STEPS steps each, from one set of initial weights (CPU ranks initialize their shards
    independently, so the first run writes a step-0 checkpoint that every other run loads)."""
    root = tmp_path_factory.mktemp("titan")
    # Model-only seed: saving optimizer state before the first step would create Adam's state.
    steps = ("--training.steps", str(STEPS))
    etp = run_on_ranks(WORLD, _train, _ours(root / "etp", 2, 2, *steps, "--checkpoint.enable", "--checkpoint.interval",
                                            str(RESUME_STEP), "--checkpoint.last_save_model_only"), True)[0]
    seed = ("--checkpoint.initial_load_path", str(root / "etp" / "checkpoint" / "step-0"), *_LOAD_ONLY)
    titan = _argv("deepseek_v3_debugmodel_cpu_titan_ep", root / "titan", *seed)
    return {
        "root": root,
        "ours_ep2_etp2": etp,
        "ours_ep2": run_on_ranks(WORLD, _train, _ours(root / "ep", 2, 1, *seed, *steps))[0],
        "titan_ep2": run_on_ranks(WORLD, _train, [*titan, *steps, "--parallelism.expert_parallel_degree", "2"])[0],
        # torchtitan without EP: every rank runs every expert, FSDP only (gradients only, one step).
        "titan_fsdp": run_on_ranks(WORLD, _train, [*titan, "--training.steps", "1"])[0],
    }


def _assert_same_steps(a, b, steps: int = STEPS):
    assert [s for s, _, _ in a] == [s for s, _, _ in b] == list(range(1, steps + 1))
    for (step, loss_a, gn_a), (_, loss_b, gn_b) in zip(a, b):
        assert abs(loss_a - loss_b) < LOSS_ATOL, (step, loss_a, loss_b)
        assert abs(gn_a - gn_b) < GRAD_NORM_RTOL * gn_b, (step, gn_a, gn_b)


def _assert_same_grads(a, b, rtol=GRAD_RTOL):
    assert sorted(a) == sorted(b)  # parameter names stay torchtitan's
    for name, g in b.items():
        err = (a[name] - g).abs().max() / g.abs().max()
        assert err < rtol, (name, err.item())


def test_ep_etp_loss_falls(runs):
    losses = [loss for _, loss, _ in runs["ours_ep2_etp2"]["log"]]
    assert len(losses) == STEPS and losses[-1] < losses[0] - 0.25, losses  # measured 5.98 -> 5.52


def test_gradients_match_unparallelized_experts(runs):
    _assert_same_grads(runs["ours_ep2_etp2"]["grads"], runs["titan_fsdp"]["grads"])
    _assert_same_grads(runs["ours_ep2"]["grads"], runs["titan_fsdp"]["grads"])


def test_loss_parity_with_titan_ep(runs):
    _print_errors("ours ep2 vs titan ep2", runs["ours_ep2"], runs["titan_ep2"])
    _assert_same_grads(runs["ours_ep2"]["grads"], runs["titan_ep2"]["grads"])
    _assert_same_steps(runs["ours_ep2"]["log"], runs["titan_ep2"]["log"])


def test_loss_parity_etp2_vs_etp1(runs):
    _print_errors("etp2 vs etp1", runs["ours_ep2_etp2"], runs["ours_ep2"])
    _assert_same_steps(runs["ours_ep2_etp2"]["log"], runs["ours_ep2"]["log"])


def test_checkpoint_resume(runs):
    """Resumes from the step-2 checkpoint that torchtitan's checkpointer wrote under our hook."""
    argv = _ours(runs["root"] / "etp", 2, 2, "--training.steps", str(STEPS), "--checkpoint.enable",
                 "--checkpoint.load_only", "--checkpoint.load_step", str(RESUME_STEP))
    resumed = run_on_ranks(WORLD, _train, argv)[0]["log"]
    full = runs["ours_ep2_etp2"]["log"]
    assert [s for s, _, _ in resumed] == list(range(RESUME_STEP + 1, STEPS + 1))
    for (step, loss, gn), (_, loss_full, gn_full) in zip(resumed, full[RESUME_STEP:]):
        assert loss == pytest.approx(loss_full, rel=1e-5), step
        assert gn == pytest.approx(gn_full, rel=1e-4), step


@pytest.mark.parametrize("flags, message", [
    (("--parallelism.expert_parallel_degree", "2"), "set --dtensor_moe.ep instead"),
    (("--parallelism.tensor_parallel_degree", "3"), "must divide layers[0].attention.n_heads (4)"),
    (("--parallelism.tensor_parallel_degree", "2", "--parallelism.no-enable_sequence_parallel"),
     "needs parallelism.enable_sequence_parallel"),
    (("--parallelism.context_parallel_degree", "2", "--parallelism.context_parallel_load_balancer", "ptrr"),
     "context_parallel_load_balancer='ptrr' with parallelism.context_parallel_degree=2 is not supported"),
    (("--config", "deepseek_v3_debugmodel", "--parallelism.context_parallel_degree", "2"),
     "needs SDPA attention: layers[0].attention.inner_attention is FlexAttention.Config"),
    (("--dtensor_moe.experts", "theirs"), "--dtensor_moe.experts 'theirs' is not one of ['ours', 'titan']"),
    (("--dtensor_moe.experts", "titan", "--dtensor_moe.run.activation_memory", "standard"),
     "--dtensor_moe.run.activation_memory standard acts on dtensor_moe's experts only, not with --dtensor_moe.experts "
     "titan; valid: --dtensor_moe.experts ours, or --dtensor_moe.run.activation_memory minimal"),
    (("--dtensor_moe.experts", "titan", "--dtensor_moe.run.expert_precision", "fp8"),
     "--dtensor_moe.run.expert_precision fp8 acts on dtensor_moe's experts only"),
    (("--dtensor_moe.run.dispatch_precision", "fp8"), "--dtensor_moe.run.dispatch_precision fp8 sets the payload of "
                                                      "the EP / ETP token exchange, and --dtensor_moe.ep 1 "
                                                      "--dtensor_moe.etp 1 exchanges none"),
    # MoERunOptions' own checks, named as the flag (the hook reads the values off the command line first).
    (("--dtensor_moe.run.activation_memory", "least"), "--dtensor_moe.run.activation_memory must be one of "
                                                       "['standard', 'minimal'], got 'least'"),
    # torchtitan's router drops no pairs: the capacity options keep their defaults.
    (("--dtensor_moe.run.capacity_factor", "1.0"), "--dtensor_moe.run.capacity_factor 1.0 is not supported with "
                                                   "--module dtensor_moe.titan (the hook's dispatch is dropless); "
                                                   "valid: --dtensor_moe.run.capacity_factor None"),
    (("--dtensor_moe.run.drop_policy", "position"), "--dtensor_moe.run.drop_policy 'position' is not supported with "
                                                    "--module dtensor_moe.titan"),
])
def test_config_rejects_bad_combinations(capsys, monkeypatch, flags, message):
    """Our Config's checks while torchtitan parses the command line: one line and exit status 2, no process group."""
    _assert_refused(capsys, _argv("deepseek_v3_debugmodel_cpu", "/unused", *flags), message, monkeypatch)


def test_unknown_hook_flag_is_one_line(capsys, monkeypatch):
    """Refused while torchtitan loads the config function, before its parser's error box on every rank."""
    argv = _argv("deepseek_v3_debugmodel_cpu", "/unused", "--dtensor_moe.expert_parallel", "2")
    _assert_refused(capsys, argv, "--dtensor_moe.expert_parallel is not an option of the hook; valid: "
                                  "--dtensor_moe.dp_replicate, --dtensor_moe.ep, --dtensor_moe.etp, "
                                  "--dtensor_moe.experts, --dtensor_moe.load_balance_coeff, "
                                  "--dtensor_moe.run.activation_memory, --dtensor_moe.run.capacity_factor, "
                                  "--dtensor_moe.run.dispatch_precision, --dtensor_moe.run.drop_policy, "
                                  "--dtensor_moe.run.expert_precision, --dtensor_moe.run.expert_replicas, "
                                  "--dtensor_moe.run.max_rows_per_rank, --dtensor_moe.run.pad_to_capacity, "
                                  "--dtensor_moe.run.replica_replan_every, --dtensor_moe.run.round_tokens_to",
                    monkeypatch)


def _assert_refused(capsys, argv, message, monkeypatch=None):
    """`argv` refused while parsing, in one line. With `monkeypatch`, as torchrun's ranks parse it: also the
    process's sys.argv, which the hook reads its flags off while torchtitan loads the config function."""
    from torchtitan.config import ConfigManager

    if monkeypatch is not None:
        monkeypatch.setattr(sys, "argv", ["torchtitan.train", *argv])  # what torchrun's ranks parse
        monkeypatch.delenv("RANK", raising=False)

    with pytest.raises(SystemExit) as exit_:
        ConfigManager().parse_args(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err  # also torchtitan's own warnings, one line each
    ours = [line for line in err.splitlines() if line.startswith("dtensor_moe.titan: ")]
    assert len(ours) == 1 and message in ours[0] and "Traceback" not in err and "╭" not in err, err


@pytest.mark.parametrize("world, degrees, message", [
    (2, dict(dp_replicate=3), "--dtensor_moe.dp_replicate 3 on WORLD_SIZE=2 ranks: dp_replicate * cp * tp = 3*1*1 = 3 "
                              "must divide world_size 2; valid values for that product: [1, 2]"),
    (2, dict(ep=3), "--dtensor_moe.ep 3 on WORLD_SIZE=2 ranks: ep * etp = 3*1 must divide dp_shard * cp * tp = 2: the "
                    "expert mesh (edp, ep, etp) folds over the same ranks as the dense (dp_shard, cp, tp). Valid ep: "
                    "[1, 2]; valid (ep, etp) pairs: [(1, 1), (1, 2), (2, 1)]"),
    (4, dict(ep=2, etp=2, tensor_parallel_degree=2, pipeline_parallel_degree=2),
     "--parallelism.tensor_parallel_degree 2 --parallelism.pipeline_parallel_degree 2 --dtensor_moe.ep 2 "
     "--dtensor_moe.etp 2 "
     "on WORLD_SIZE=4 ranks: ep * etp = 2*2 must divide dp_shard * cp * tp = 2"),
    (2, dict(etp=0), "--dtensor_moe.etp 0 on WORLD_SIZE=2 ranks: etp must be >= 1, got 0"),
])
def test_degrees_are_checked_against_the_world(world, degrees, message):
    """The check the hook's Config runs while parsing (torchtitan's own ParallelDims would assert, after
    init_process_group, or our MoEParallelDims raise on every rank)."""
    from dtensor_moe.titan.config_registry import deepseek_v3_debugmodel_cpu
    from dtensor_moe.titan.trainer import check_degrees

    config = deepseek_v3_debugmodel_cpu()
    for name, value in degrees.items():
        setattr(config.dtensor_moe if hasattr(config.dtensor_moe, name) else config.parallelism, name, value)
    with pytest.raises(ValueError) as err:
        check_degrees(config, world)
    assert str(err.value).startswith(message), str(err.value)
    config.dtensor_moe.ep = config.dtensor_moe.etp = 1
    config.dtensor_moe.dp_replicate = config.parallelism.data_parallel_replicate_degree = 1
    assert check_degrees(config, world).edp == world // config.parallelism.pipeline_parallel_degree


def test_bad_degrees_end_the_parse_in_one_line(capsys, monkeypatch):
    """Against torchrun's WORLD_SIZE, before init_process_group: not torchtitan's bare AssertionError."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("RANK", raising=False)
    _assert_refused(capsys, _ours("/unused", 1, 1, "--dtensor_moe.dp_replicate", "3"),
                    "--dtensor_moe.dp_replicate 3 on WORLD_SIZE=2 ranks: dp_replicate * cp * tp = 3*1*1 = 3")


def test_cpu_launcher_refuses_bad_degrees_in_one_line(tmp_path):
    """Under torchrun: rank 0's one line, no traceback from any rank (torchrun's own failure report stays), and
    the other rank stopped by torchrun when rank 0 exits, not after its own wait."""
    from dtensor_moe.titan.trainer import REFUSE_WAIT_S

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += ["-m", "dtensor_moe.titan.cpu_train", *_ours(tmp_path, 3, 1)]
    started = time.monotonic()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=LAUNCHER_TIMEOUT_S)
    log = out.stdout + out.stderr
    assert out.returncode != 0 and time.monotonic() - started < REFUSE_WAIT_S, log[-3000:]
    ours = [line for line in log.splitlines() if line.startswith("dtensor_moe.titan: ")]
    assert ours == [
        "dtensor_moe.titan: --dtensor_moe.ep 3 on WORLD_SIZE=2 ranks: ep * etp = 3*1 must divide dp_shard * cp * tp = "
        "2: the expert mesh (edp, ep, etp) folds over the same ranks as the dense (dp_shard, cp, tp). Valid ep: "
        "[1, 2]; valid (ep, etp) pairs: [(1, 1), (1, 2), (2, 1)]"
    ], log[-3000:]
    rank_failures = ("dtensor_moe/titan/", "ValueError", "AssertionError", "╭")  # a rank's traceback or tyro box
    assert log.count("Traceback") <= 1 and not any(s in log for s in rank_failures), log[-3000:]


def test_qwen3_moe_plan_keeps_torchtitan_names():
    """torchtitan's qwen3 debug MoE (64 experts, no shared experts), built on the meta device."""
    import torch

    from dtensor_moe import MoEParallelDims
    from dtensor_moe.titan.config_registry import qwen3_moe_debug
    from dtensor_moe.titan.parallelize_titan import titan_plan

    with torch.device("meta"):
        model = qwen3_moe_debug().model_spec.model.build()
    dims = MoEParallelDims(16, ep=4, etp=2)
    for block in model.layers.values():
        plans = {wp.name: wp for wp in titan_plan(block.moe, dims)}
        params = dict(block.moe.named_parameters())
        assert set(plans) == set(params)
        for name, wp in plans.items():
            assert wp.global_shape == tuple(params[name].shape), name
        w1 = plans["routed_experts.inner_experts.w1_EFD"]
        assert [(s.axis, s.dim) for s in w1.steps[:2]] == [("ep", 0), ("etp", 1)]


FOLDED_STEPS = 2  # the second step runs on weights and expert biases the first one updated
_PP = ("--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "1F1B",
       "--parallelism.pipeline_parallel_microbatch_size", "1")  # 2 microbatches of one sequence each
_CP = ("--parallelism.context_parallel_degree", "2")  # torchtitan's head-tail sequence sharding


@pytest.fixture(scope="module")
def folded(tmp_path_factory):
    """torchtitan's TP=2, PP=2 and CP=2 with our EP=2 on 4 ranks (data-parallel degree 2, so the same
    batches as 2 data-parallel ranks), our EP=2 with compiled blocks on 2 ranks, and the unparallelized
    reference: our hook at degree 1 on 2 ranks (every rank runs every expert, FSDP only). FOLDED_STEPS steps
    each, from the step-0 checkpoint the reference writes (a set-up of its own: `runs` can run on the other
    test process meanwhile)."""
    root = tmp_path_factory.mktemp("titan_folded")
    steps = ("--training.steps", str(FOLDED_STEPS))
    reference = run_on_ranks(2, _train, _ours(root / "dp2", 1, 1, *steps, "--checkpoint.enable",
                                              "--checkpoint.last_save_model_only"), True)[0]
    seed = ("--checkpoint.initial_load_path", str(root / "dp2" / "checkpoint" / "step-0"), *_LOAD_ONLY)
    tp = ("--parallelism.tensor_parallel_degree", "2")
    return {
        "reference": reference,
        "tp2_ep2": run_on_ranks(WORLD, _train, _ours(root / "tp2", 2, 1, *seed, *steps, *tp)),
        "pp2_ep2": run_on_ranks(WORLD, _train, _ours(root / "pp2", 2, 1, *seed, *steps, *_PP)),
        "cp2_ep2": run_on_ranks(WORLD, _train, _ours(root / "cp2", 2, 1, *seed, *steps, *_CP)),
        "ep2_compiled": run_on_ranks(2, _train, _ours(root / "ep2c", 2, 1, *seed, *_COMPILED, *steps)),
    }


def _print_errors(name, a, b):
    dloss = max(abs(x[1] - y[1]) for x, y in zip(a["log"], b["log"]))
    dnorm = max(abs(x[2] - y[2]) / y[2] for x, y in zip(a["log"], b["log"]))
    dgrad = max(((a["grads"][n] - g).abs().max() / g.abs().max()).item() for n, g in b["grads"].items())
    dbias = max((a["expert_bias"][n] - t).abs().max().item() for n, t in b["expert_bias"].items())
    print(f"{name}: max |dloss| {dloss:.2e}, max rel dnorm {dnorm:.2e}, max rel grad err {dgrad:.2e}, "
          f"max |dbias| {dbias:.2e}")


def _assert_matches_reference(name, folded_run, ref, grad_rtol=GRAD_RTOL):
    assert any(b.abs().max() > 0 for b in ref["expert_bias"].values())  # the biases did move
    _print_errors(name, folded_run, ref)
    _assert_same_grads(folded_run["grads"], ref["grads"], grad_rtol)
    _assert_same_steps(folded_run["log"], ref["log"], FOLDED_STEPS)
    assert sorted(folded_run["expert_bias"]) == sorted(ref["expert_bias"])
    for n, bias in ref["expert_bias"].items():
        assert torch.equal(folded_run["expert_bias"][n], bias), (n, folded_run["expert_bias"][n], bias)


def test_tp2_ep2_matches_unparallelized(folded):
    _assert_matches_reference("tp2_ep2", folded["tp2_ep2"][0], folded["reference"], FP32_GRAD_RTOL)


def test_pp2_ep2_matches_unparallelized(folded):
    first, last = folded["pp2_ep2"][0], folded["pp2_ep2"][-1]
    assert not set(first["grads"]) & set(last["grads"]) and "tok_embeddings.weight" in first["grads"]
    merged = {"log": last["log"], **{k: {**first[k], **last[k]} for k in ("grads", "expert_bias")}}
    _assert_matches_reference("pp2_ep2", merged, folded["reference"])


def test_cp2_ep2_matches_unparallelized(folded):
    """Our all-gather-KV attention on torchtitan's head-tail sequence parts; the MoEs fold over dp_shard * cp."""
    _assert_matches_reference("cp2_ep2", folded["cp2_ep2"][0], folded["reference"], FP32_GRAD_RTOL)


def test_compiled_ep2_matches_unparallelized(folded):
    """torchtitan's blocks compiled (aot_eager) around our EP dispatch (the hook's frames: the dispatch before
    the experts, the combine after), against the eager reference. GRAD_RTOL: each EP group holds both
    data-parallel ranks' tokens, so the experts' bf16 GEMMs group rows differently from the reference's."""
    _assert_matches_reference("ep2_compiled", folded["ep2_compiled"][0], folded["reference"])
