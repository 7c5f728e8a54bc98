"""Does the suite fail where it matters? Applies realistic one-line bugs to a temporary copy of the repository,
one at a time, runs the tests that should catch each, and prints which test did (or NOT CAUGHT).

    python scripts/mutation_check.py              # baseline, then every mutation (minutes)
    python scripts/mutation_check.py --list       # the mutations and their target tests
    python scripts/mutation_check.py --only aux_loss_E_factor --only bias_update_sign

The parity suite compares every parallel path with the same `MoE` run on one process, so a bug in that code
passes it on every mesh: the definitional tests (tests/test_balance_definitions.py, tests/test_moe_local.py)
must catch those, the parity tests the parallel paths'. Each mutation replaces one exact piece of one line (the
script refuses a mutation whose text is not found exactly once, so a refactor cannot make it silently vacuous);
its target tests run with -x in the copy (PYTHONPATH points there, checked). The baseline first runs every
target test unmutated: a test that already fails would catch everything. Exit status 1 if any mutation
survives or the baseline fails. Not part of pytest.
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PARITY = "tests/test_parity.py::test_named_configuration"
CHECKPOINT = "tests/test_checkpoint.py"


@dataclass(frozen=True)
class Mutation:
    name: str
    path: str
    old: str  # replaced once; must occur exactly once in path
    new: str
    tests: tuple[str, ...]  # pytest node ids that should catch it
    what: str


MUTATIONS = (
    # Clipping over meshes: every mesh's gradients are scaled, not only the first group's.
    Mutation("clip_one_mesh_only", "dtensor_moe/train/optim.py", "for group in by_mesh(params):",
             "for group in by_mesh(params)[:1]:", ("tests/test_dense_parallel.py", "tests/test_pipeline.py"),
             "clipping skips the expert mesh's grads"),
    # The floors: a core file importing a floor above it (as routing replay once imported moe.py).
    Mutation("routing_imports_the_layer", "dtensor_moe/routing/capacity.py", "import math\n",
             "import math\n\nfrom dtensor_moe.moe import MoE  # noqa: F401\n", ("tests/test_import_floors.py",),
             "routing/ imports the MoE layer above it"),
    # Gradient scales: the dispatcher divides the expert weight gradients by EP * ETP, the experts apply it.
    Mutation("dispatcher_grad_scale", "dtensor_moe/parallel/dispatch.py",
             "self.weight_grad_scale = 1.0 / self.ep_etp_divisor", "self.weight_grad_scale = 1.0",
             (f"{PARITY}[ep8]",), "expert weight gradients not divided by EP*ETP"),
    Mutation("grad_divisor_without_etp", "dtensor_moe/parallel/shard.py",
             "else dims.ep * dims.etp\n", "else dims.ep\n",
             (f"{PARITY}[etp8]",), "the divisor forgets ETP"),
    Mutation("experts_grad_scale_one_operand", "dtensor_moe/kernels/expert_autograd.py",
             "dab_N2F = dab_N2F * scale",
             "dab_N2F = torch.cat([dab_N2F.chunk(2, -1)[0] * scale, dab_N2F.chunk(2, -1)[1]], -1)",
             ("tests/test_moe_local.py::test_weight_grad_scale_scales_only_weight_grads",),
             "w3's gradient unscaled where F is the scaled operand"),
    Mutation("experts_bias_grad_scale", "dtensor_moe/kernels/expert_autograd.py",
             "_like_param(segment_sum(g, offs_E).view(shape) * scale, p)",
             "_like_param(segment_sum(g, offs_E).view(shape), p)",
             (f"{PARITY}[gpt_oss_experts_edp2_ep2_etp2]",), "expert bias gradients unscaled"),
    Mutation("accumulated_wgrad_scale", "dtensor_moe/kernels/expert_autograd.py",
             "add_weight_grad_(out, g, x, offs_E, scale, host,", "add_weight_grad_(out, g, x, offs_E, 1.0, host,",
             ("tests/test_moe_local.py::test_weight_grads_accumulate_in_the_gemm",),
             "in-GEMM accumulation drops the scale"),
    # Balance losses and the aux-free bias.
    Mutation("aux_loss_E_factor", "dtensor_moe/moe.py",
             "f_E = global_counts_E * cfg.num_experts / (cfg.top_k * num_tokens)",
             "f_E = global_counts_E / (cfg.top_k * num_tokens)",
             ("tests/test_balance_definitions.py",), "aux loss f_e without E (1/E of the loss)"),
    Mutation("aux_loss_tokens_as_pairs", "dtensor_moe/moe.py",
             "num_tokens = (global_counts_E.sum() / cfg.top_k).clamp(min=1)",
             "num_tokens = global_counts_E.sum().clamp(min=1)",
             ("tests/test_balance_definitions.py",), "aux loss counts T*K tokens"),
    Mutation("balance_scores_unnormalized", "dtensor_moe/moe.py",
             "return scores_TE / (scores_TE.sum(dim=-1, keepdim=True) + 1e-20)", "return scores_TE",
             ("tests/test_balance_definitions.py",), "sigmoid scores not normalized in the balance losses"),
    Mutation("global_loss_share", "dtensor_moe/moe.py",
             "mine = local * scale * self.stats.num_ranks", "mine = local * scale",
             (f"{PARITY}[hsdp2_ep2_etp2]",), "balance-loss gradient share not scaled by the ranks"),
    Mutation("seq_aux_E_factor", "dtensor_moe/moe.py",
             "f_BE = counts_BE * E / (K * length_B1)", "f_BE = counts_BE / (K * length_B1)",
             ("tests/test_moe_local.py::test_sequence_aux_and_z_losses_match_their_definitions",),
             "sequence-wise loss without E"),
    Mutation("z_loss_unsquared", "dtensor_moe/moe.py",
             "torch.logsumexp(logits_TE, dim=-1).square().sum()", "torch.logsumexp(logits_TE, dim=-1).sum()",
             ("tests/test_moe_local.py::test_sequence_aux_and_z_losses_match_their_definitions",),
             "z-loss without the square"),
    Mutation("sequence_sum_without_tp", "dtensor_moe/parallel/shard.py",
             'for a in ("cp", "tp") if getattr(dims, a) > 1]', 'for a in ("cp",) if getattr(dims, a) > 1]',
             (f"{PARITY}[tp2_ep2]",), "sequence statistics not summed over TP pieces"),
    Mutation("tp_output_grad_scale", "dtensor_moe/parallel/shard.py",
             "ScaleGrad.apply(out, float(tp))", "ScaleGrad.apply(out, 1.0)",
             ("tests/test_expert_parallel_style.py::test_expert_parallel_among_tp_styles_matches_the_reference",),
             "under sequence-parallel TP the MoE's gradients are not summed over tp"),
    Mutation("bias_update_sign", "dtensor_moe/moe.py",
             "torch.sign(tpe.mean() - tpe)", "(tpe.mean() - tpe)",
             ("tests/test_balance_definitions.py",), "bias update without torch.sign"),
    Mutation("bias_update_direction", "dtensor_moe/moe.py",
             "torch.sign(tpe.mean() - tpe)", "torch.sign(tpe - tpe.mean())",
             ("tests/test_balance_definitions.py",), "bias update pushes overloaded experts up"),
    Mutation("bias_counts_eval_forwards", "dtensor_moe/moe.py",
             "if self.training and not recomputing():", "if not recomputing():",
             ("tests/test_moe_local.py::test_eval_forwards_leave_the_bias_statistics_alone",),
             "eval forwards move the bias"),
    # Routing and capacity.
    Mutation("capacity_floor", "dtensor_moe/routing/capacity.py",
             "return math.ceil(num_tokens * top_k / num_experts * capacity_factor)",
             "return int(num_tokens * top_k / num_experts * capacity_factor)",
             ("tests/test_moe_local.py::test_capacity_drops_exactly_megatrons_pairs",), "capacity rounded down"),
    Mutation("capacity_probs_ascending", "dtensor_moe/routing/capacity.py",
             "descending=True, stable=True", "descending=False, stable=True",
             ("tests/test_moe_local.py::test_capacity_drops_exactly_megatrons_pairs",),
             '"probs" keeps the lowest weights'),
    Mutation("route_scale_dropped", "dtensor_moe/routing/router.py",
             "weights_TK = weights_TK * cfg.route_scale", "weights_TK = weights_TK",
             ("tests/test_moe_local.py::test_moe_matches_naive_loop",), "route_scale ignored"),
    Mutation("group_score_top1", "dtensor_moe/routing/router.py",
             "topk(min(2, E // num_groups)", "topk(min(1, E // num_groups)",
             ("tests/test_moe_local.py::test_group_limited_routing_matches_deepseek_v3",),
             "group score from one expert, not two"),
    # Dispatch tables and the combine.
    Mutation("dispatch_etp_offset", "dtensor_moe/parallel/exchange.py",
             "etp_offset=sum(sz.rows.peer[: topo.etp_rank]) * K", "etp_offset=sum(sz.rows.peer[: topo.etp_rank])",
             (f"{PARITY}[etp8]", f"{PARITY}[edp2_ep2_etp2]"), "ETP row offset not packed by K"),
    Mutation("dispatch_send_shift", "dtensor_moe/parallel/exchange.py",
             "sum(C[etp_rank][s][r][-1] for s in range(ep_rank))",
             "sum(C[etp_rank][s][r][-1] for s in range(ep_rank + 1))",
             (f"{PARITY}[ep8]", f"{PARITY}[ep4_accumulate]"), "receive offset off by one source"),
    Mutation("expert_major_offset", "dtensor_moe/parallel/exchange.py",
             "run_start = torch.cumsum(sizes_t, 0) - sizes_t", "run_start = torch.cumsum(sizes_t, 0)",
             (f"{PARITY}[ep8]",), "expert-major index off by one block"),
    Mutation("etp_partials_averaged", "dtensor_moe/parallel/exchange.py",
             "y = y.view(self.etp, n_self, *y.shape[1:]).sum(0)", "y = y.view(self.etp, n_self, *y.shape[1:]).mean(0)",
             (f"{PARITY}[etp8]",), "ETP partial outputs averaged, not summed"),
    Mutation("combine_unweighted", "dtensor_moe/parallel/dispatch.py",
             "gather_rows(w_sent, ex.idx, ex.inv)[:, 0])",
             "torch.ones_like(gather_rows(w_sent, ex.idx, ex.inv)[:, 0]))",
             (f"{PARITY}[ep8]",), "EP dispatch drops the routing weights its pairs carry to the experts' sums"),
    Mutation("padded_slot_offset", "dtensor_moe/routing/tables.py",
             "within_N = torch.arange(T * K, device=dev) - (counts_E.cumsum(0) - counts_E)",
             "within_N = torch.arange(T * K, device=dev) - counts_E.cumsum(0)",
             ("tests/test_parity.py::test_compiled_and_non_finite[compiled_padded_ep2]",
              "tests/test_parity.py::test_padded_path_static_splits_and_no_host_sync"),
             "padded slot index off by one block"),
    # Checkpoint verification.
    Mutation("checkpoint_size_unchecked", "dtensor_moe/train/checkpoint.py",
             "elif f.stat().st_size != size:", "elif False:",
             (f"{CHECKPOINT}::test_damaged_step_fails_naming_step_and_file_and_leaves_model_alone",),
             "truncated files pass verification"),
    Mutation("checkpoint_digest_unchecked", "dtensor_moe/train/checkpoint.py",
             "problems += [\n", "problems + [\n",
             (f"{CHECKPOINT}::test_damaged_step_fails_naming_step_and_file_and_leaves_model_alone",),
             "sha256 mismatches dropped"),
    Mutation("checkpoint_config_unchecked", "dtensor_moe/train/checkpoint.py",
             "if problems or cfg_diff:", "if problems:",
             (f"{CHECKPOINT}::test_config_change_that_keeps_shapes_is_refused",),
             "a checkpoint of another config loads when its shapes fit"),
    Mutation("checkpoint_manifest_optional", "dtensor_moe/train/checkpoint.py",
             'if os.environ.get(ALLOW_UNVERIFIED) != "1":', "if False:",
             (f"{CHECKPOINT}::test_checkpoint_without_manifest_is_refused_unless_allowed",),
             "a checkpoint without a manifest loads unverified"),
    # `dtensor-moe train --parity` against its 1-process reference (which goes without replicas): a correct run passes.
    Mutation("parity_flag_replica_grad_scale", "dtensor_moe/parallel/replica_dispatch.py",
             "counts_rep, host[E_local:], scale, g.adds_output_bias)",
             "counts_rep, host[E_local:], 1.0, g.adds_output_bias)",
             ("tests/test_parity_flag.py::test_parity_passes_a_correct_run[replicas_ep2]",),
             "replica slots' weight gradients not divided by EP*ETP: --parity must read FAIL"),
    # Our experts inside torchtitan's MoE (--dtensor_moe.experts ours) against torchtitan alone.
    Mutation("titan_experts_gate_up_swapped", "dtensor_moe/titan/experts.py",
             "torch.stack([w1, w3], dim=1)", "torch.stack([w3, w1], dim=1)",
             ("tests/test_titan_experts.py::test_ours_minimal_matches_torchtitan[ep2_etp2]",),
             "torchtitan's w1 (gate) and w3 (up) swapped in our kernels' operand"),
    # Nothing lost, nothing silently different: the data a run trains on and the files it writes.
    Mutation("cache_memo_trusts_mtime", "dtensor_moe/train/token_cache.py",
             "if entry and entry[:-1] == _stamp(st):", "if entry and entry[:2] == _stamp(st)[:2]:",
             ("tests/test_data_files.py::test_the_cache_follows_content_not_names",),
             "a file edited with its size and mtime kept (cp -p) reuses the stale cache"),
    Mutation("fingerprint_ignores_eval_fraction", "dtensor_moe/train/data.py",
             '"eval_fraction": d.eval_fraction, "seed"', '"eval_fraction": 0.0, "seed"',
             ("tests/test_train.py::test_resume_refuses_another_data_stream",),
             "a resume with another held-out fraction (trained sequences held out) is accepted"),
    Mutation("export_overwrites", "dtensor_moe/train/export.py",
             "checked_output_dir(out_dir, force)", "checked_output_dir(out_dir, True)",
             ("tests/test_export.py::test_export_refuses_to_replace_files_without_force",),
             "export replaces a directory's model.safetensors / config.json without --force"),
    Mutation("eval_file_same_content_accepted", "dtensor_moe/train/token_cache.py",
             "if h in trained]", "if h in ()]",
             ("tests/test_data_files.py::test_held_out_by_content_and_empty_documents_are_refused",),
             "an eval file with a training file's content is trained on and held out"),
    # The data streams' invariants (tests/test_data_invariants.py): each split, the order's seed, the eval count.
    Mutation("cache_split_overlaps", "dtensor_moe/train/token_cache.py",
             'return {"train": [0, cut], "eval": [cut, n]}', 'return {"train": [0, cut + 1], "eval": [cut, n]}',
             ("tests/test_data_invariants.py::test_training_and_held_out_tokens_are_disjoint",),
             "the files' training part reaches into the held-out tokens"),
    Mutation("corpus_split_overlaps", "dtensor_moe/train/data.py",
             "(tokens[:cut], tokens[cut:])", "(tokens[:cut + 1], tokens[cut:])",
             ("tests/test_data_invariants.py::test_training_and_held_out_tokens_are_disjoint",),
             "the corpus's training part reaches into the held-out tokens"),
    Mutation("order_ignores_seed", "dtensor_moe/train/data.py",
             "manual_seed((self.seed * 1_000_003 + epoch) ^ EPOCH_SEED)", "manual_seed(epoch ^ EPOCH_SEED)",
             ("tests/test_data_invariants.py::test_the_seed_decides_the_order",),
             "the epoch permutation ignores training.seed"),
    Mutation("eval_batches_floor", "dtensor_moe/train/data.py",
             "math.ceil(self.n_seq / global_batch)", "self.n_seq // global_batch",
             ("tests/test_data_invariants.py::test_every_evaluation_has_a_batch",),
             "fewer held-out sequences than a batch make 0 eval batches (a division by zero mid-run)"),
    Mutation("hf_check_drops_ignored_keys", "dtensor_moe/hf/checkpoint.py",
             "and not any(re.search(p, k) for p in ignored)}", "}",
             ("tests/test_bad_hf_inputs.py::test_keys_transformers_ignores_pass_the_check",),
             "a real DeepSeek-V3 checkpoint (MTP keys model.layers.61.*) refused before launch"),
    Mutation("cost_model_minimal_with_replicas", "dtensor_moe/config.py",
             "and not options.pad_to_capacity and not options.expert_replicas:",
             "and not options.pad_to_capacity:",
             ("tests/test_activation_memory.py::test_the_folding_search_prices_what_the_layer_keeps",),
             "the folding search prices minimal memory for layers with replicas, which keep the standard path's"),
    Mutation("moe_run_options_unchecked", "dtensor_moe/moe.py",
             "        check_run_options(config, options)\n", "",
             ("tests/test_replicas.py::test_replica_slots_are_bounded_by_the_layers_experts",),
             "more replica slots than the layer has experts accepted, copies of experts that do not exist"),
    Mutation("hook_run_values_unchecked", "dtensor_moe/titan/config_registry.py",
             "        MoERunOptions(**{k: v for k, v in run.items() if v is not _UNPARSED})",
             "        pass",
             ("tests/test_titan.py::test_config_rejects_bad_combinations",),
             "a bad --dtensor_moe.run value becomes the parser's error box on every rank, not one line"),
    Mutation("writer_copies_into_place", "dtensor_moe/durable.py",
             "os.replace(tmp / name, out / name)", "shutil.copyfile(tmp / name, out / name)",
             ("tests/test_export.py::test_writers_publish_by_rename",),
             "the atomic writer copies into place: a kill mid-copy leaves a half file"),
    Mutation("cache_key_ignores_tokenizer_content", "dtensor_moe/train/token_cache.py",
             '"tokenizer": fingerprint(spec, m.hf_path) if texts else None', '"tokenizer": spec if texts else None',
             ("tests/test_data_files.py::test_the_cache_follows_content_not_names",),
             "a tokenizer retrained into the same directory reuses the old cache"),
    Mutation("held_out_document_trained", "dtensor_moe/train/token_cache.py",
             "if held and text.strip() and _doc_key(text) in held:", "if False:",
             ("tests/test_data_files.py::test_held_out_by_content_and_empty_documents_are_refused",),
             "a training file holding a held-out document is trained on"),
)


def copy_repo(dest: Path) -> Path:
    root = dest / "repo"
    shutil.copytree(REPO, root, ignore=shutil.ignore_patterns(
        ".venv", ".git", "__pycache__", ".pytest_cache", ".ruff_cache", "*.egg-info", "runs"))
    return root


def env_for(root: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(root), *filter(None, [env.get("PYTHONPATH")])])
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # a reverted file keeps no stale bytecode of its mutant
    env.setdefault("DTENSOR_MOE_TEST_TIMEOUT", "180")  # a hang is reported (as caught) in minutes, not 10
    return env


def check_imports_from(root: Path, env: dict) -> None:
    code = "import dtensor_moe, tests; print(dtensor_moe.__file__, tests.__file__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True,
                         check=True).stdout.split()
    if not all(Path(p).resolve().is_relative_to(root.resolve()) for p in out):
        sys.exit(f"the copy's modules are shadowed: {out}")


def pytest(root: Path, env: dict, tests, *extra: str, timeout: float) -> tuple[int, str]:
    cmd = [sys.executable, "-m", "pytest", "-q", "-n0", "-p", "no:cacheprovider", "-rf", *extra, *tests]
    try:
        p = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        return -1, (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
    return p.returncode, p.stdout + p.stderr


def failed_tests(output: str) -> list[str]:
    """The short test summary's node ids (not captured log lines, which may start with ERROR too)."""
    return re.findall(r"^(?:FAILED|ERROR) (tests/.+?)(?: - .*)?$", output, flags=re.M)


def apply(root: Path, m: Mutation) -> tuple[str, int]:
    """Mutates the copy; returns the original text and the mutated line's number."""
    f = root / m.path
    text = f.read_text()
    if text.count(m.old) != 1:
        raise SystemExit(f"{m.name}: {m.old!r} occurs {text.count(m.old)} times in {m.path}, not once: update it")
    f.write_text(text.replace(m.old, m.new))
    return text, text[: text.index(m.old)].count("\n") + 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--list", action="store_true", help="list the mutations and their target tests")
    ap.add_argument("--only", action="append", metavar="NAME", help="run only this mutation (repeatable)")
    ap.add_argument("--no-baseline", action="store_true", help="skip the unmutated run of the target tests")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per pytest run (default 600)")
    args = ap.parse_args()
    chosen = MUTATIONS
    if args.only:
        unknown = set(args.only) - {m.name for m in MUTATIONS}
        if unknown:
            ap.error(f"unknown mutation(s) {sorted(unknown)}; --list names them")
        chosen = tuple(m for m in MUTATIONS if m.name in args.only)
    if args.list:
        for m in chosen:
            print(f"{m.name:32s} {m.path}: {m.what}\n{'':32s} {' '.join(m.tests)}")
        return 0
    with tempfile.TemporaryDirectory(prefix="dtensor_moe_mutation_") as tmp:
        root = copy_repo(Path(tmp))
        env = env_for(root)
        check_imports_from(root, env)
        for m in chosen:  # every mutation's text is checked before minutes of tests
            (root / m.path).write_text(apply(root, m)[0])
        if not args.no_baseline:
            targets = list(dict.fromkeys(t for m in chosen for t in m.tests))
            t0 = time.monotonic()
            rc, out = pytest(root, env, targets, timeout=args.timeout * 2)
            print(f"baseline: {len(targets)} targets, rc {rc}, {time.monotonic() - t0:.0f} s")
            if rc != 0:
                print(out[-4000:])
                print(f"baseline fails ({failed_tests(out)}): fix the suite first")
                return 1
        rows = []
        for m in chosen:
            original, line = apply(root, m)
            t0 = time.monotonic()
            try:
                rc, out = pytest(root, env, m.tests, "-x", timeout=args.timeout)
            finally:
                (root / m.path).write_text(original)
            failed = failed_tests(out)
            if rc == 0:
                verdict = "NOT CAUGHT"
            elif rc == -1:
                verdict = "caught by a timeout (hang)"
            elif failed:
                verdict = f"caught by {failed[0]}"
            else:
                verdict = f"caught? pytest rc {rc} without a failed test: {out.strip().splitlines()[-1:]}"
            rows.append((m, line, verdict))
            print(f"{m.name:32s} {m.path}:{line:<5d} {time.monotonic() - t0:4.0f} s  {verdict}", flush=True)
    survivors = [m.name for m, _, v in rows if v.startswith(("NOT", "caught?"))]
    print("\n| mutation | where | what | result |\n|---|---|---|---|")
    for m, line, verdict in rows:
        print(f"| {m.name} | {m.path}:{line} | {m.what} | {verdict} |")
    print(f"\n{len(rows) - len(survivors)} of {len(rows)} caught" + (f"; NOT CAUGHT: {survivors}" if survivors else ""))
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
