"""End-to-end training throughput of real MoE model shapes on one GPU: transformers' own model and the same model
trained through dtensor_moe (`parallelize_hf_model`), side by side in one run.

    python benchmarks/train_e2e.py                                   # every model, impl and option
    python benchmarks/train_e2e.py --budget-s 380 --row-timeout-s 180   # what fits a 10-minute slot
    python benchmarks/train_e2e.py --models qwen3 --options grouped_mm eager compiled
    python benchmarks/train_e2e.py --depths 4 6 --options grouped_mm eager compiled   # per-layer time, fixed part
    python benchmarks/train_e2e.py --device cpu --tiny --compile-backend aot_eager --out x.json   # smoke

Models (transformers configs built here, random weights, nothing downloaded; `--layers` slices them, default):
  qwen3     Qwen3-30B-A3B: D 2048, 32 heads (4 KV) of 128, 128 experts of F 768, top-8 normalized, V 151936; 4
  deepseek  DeepSeek-V3's architecture at DeepSeek-16B sizes: D 2048, 16 heads of MLA (kv_lora_rank 512, no q
            LoRA, qk 128 + 64 RoPE, v 128), 64 routed experts of F 1408, top-6 (sigmoid, one group), 2 shared
            experts, V 102400, every layer MoE; 4
  mixtral   Mixtral-8x7B: D 4096, 32 heads (8 KV) of 128, 8 experts of F 14336, top-2, V 32000; 2
Sequences of `--seq-len` 4096, `--batch` 2 a step, bf16 weights (float32 on CPU), SDPA attention on both sides,
torch.optim.AdamW (fused on CUDA; a parameter group per DTensor mesh), the same seeded random tokens (over the
whole vocabulary, one batch a step) for every row.

Rows (model, impl, option), each trained in its own process, so an OOM or a crash is that row's "error" and
its memory starts clean; the next row's process starts (and imports) while a row trains:
  transformers  grouped_mm | batched_mm | eager: from_config(experts_implementation=...); batched_mm copies every
                (token, expert) pair's weights, so where those copies exceed the GPU's memory the row is an error
                without a run. compiled: each decoder layer `Module.compile`d (graph breaks allowed), on the
                fastest of its implementations in the table.
  dtensor_moe   the same model, built from the same seed (so the same initial weights: step-1 losses agree), its
                sparse blocks swapped for our `MoE` and parallelized on a one-rank process group (NCCL, gloo on
                CPU; FSDP2 units of one rank, parallelize_hf_model's defaults):
                eager (the default minimal activation memory) | standard (activation_memory="standard": every
                intermediate kept) | fp8 (expert_precision="fp8") | selective_ac (activation_checkpoint="selective") |
                rounding (round_tokens_to=128) | chunked_loss (eager's model, the loss by
                dtensor_moe.train.loss.chunked_cross_entropy from the final norm's output, 2,048 tokens a chunk:
                no full fp32 logits; parallelize_hf_model's docstring recipe) through parallelize_hf_model;
                compiled through parallelize_blocks(compile=...), the call parallelize_hf_model makes after swapping
                the blocks, which has the compile argument parallelize_hf_model lacks: each decoder layer one graph,
                compiled before its FSDP unit so every FSDP hook stays outside it. (Compiling the layers after
                parallelize_hf_model would put each MoE's own FSDP unit, whose hooks dynamo cannot trace, inside
                the layer's graph.)
`--options` names options of either impl ("eager" and "compiled" are both's). Rows run in ROWS' order, each for
every model before the next, compilation last; the table and the JSON list them by model.

Balance losses are off on both sides, so the losses compare: transformers' configs say output_router_logits=False
(its models add no router loss), ours keep from_hf_block's load_balance ("none"; DeepSeek's "aux_free_bias",
whose bias nothing here updates, as nothing updates transformers' e_score_correction_bias) and no sequence-wise
or z-loss, so the `balance_loss` every step adds is 0.

A step: forward with labels (transformers' shifted cross-entropy; chunked_loss: the same targets, chunked), backward,
optimizer step, zero_grad; timed
between device syncs. `--warmup` steps (compilation included) then `--steps` timed ones; step_ms is their median,
tokens_per_s = batch * seq_len / step time. loss_step1 is the first (warm-up) step's loss, before any update.
peak_gib: torch.cuda.max_memory_allocated over the row's whole process (model build, warm-up with compilation,
timed steps; no reset), so it includes the weights, gradients and AdamW state; on CPU the process's peak RSS.

MFU = flops_per_token * tokens_per_s / dense_peak, dense_peak the bf16 8192^3 matmul rate measured at the start
of the run (moe_layer.dense_peak_tflops: the best of 3 medians). Model FLOPs per token, training (forward 2,
backward 4 FLOPs per weight per token):
  6 * the matmul weights one token meets: attention projections, router, top_k of the E routed experts (each
      3-D expert weight counts top_k / E of itself), shared experts, LM head; not the embedding (a lookup)
  + causal attention: in one layer a query at position i scores i + 1 keys, ~L/2 on average over the sequence
      (L = seq_len, L/2 taken for L(L+1)/2 / L). Per head and key QK^T costs 2 * d_qk and AV 2 * d_v FLOPs, so
      the forward costs 2 * (L/2) * H * (d_qk + d_v) = L * H * (d_qk + d_v) a token a layer, and training 3x:
      3 * n_layers * L * H * (d_qk + d_v) = 6 * n_layers * L * (H * d_qk + H * d_v) / 2
      (DeepSeek's MLA: d_qk = 128 + 64, d_v = 128; the others d_qk = d_v = head_dim).
Recomputation (selective_ac) and softmax are not model FLOPs. Each row carries the peak its MFU used.

Output (`--out`, written after every row, atomically): {"date", "torch", "transformers", "device",
"dense_peak_tflops", "rows"}; a row {"model", "impl", "option", "tokens_per_s", "mfu", "peak_gib", "loss_step1",
"step_ms", "params", "layers", "seq_len", "batch", ...} with "error" when it failed. Rows already in the file for
another (model, impl, option) are kept, so several runs fill one table; "vs_transformers" is each row's tokens/s
over its model's fastest transformers row (at the same depth) in the file. `--budget-s`: no row starts after that
many seconds. optimizer_ms: the median optimizer step (AdamW's step and zero_grad, between syncs) of the timed steps.

`--depths A B` runs every row at both decoder depths (instead of `--layers`); "projections" then holds, per (model,
impl, option), benchmarks/depths.py's per_layer_ms and fixed_ms from the two rows' step times, and the tokens/s and
MFU projected to the model's real depth (REAL_DEPTH): compare the per-layer times first, since on one GPU the LM head,
the loss and AdamW over every expert make the fixed part far larger than on an EP rank.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from datetime import datetime, timezone

STARTED = time.perf_counter()  # run as a script, --budget-s counts from here: importing torch included

import torch  # noqa: E402
from _checkout import ROOT  # noqa: E402  (this checkout's dtensor_moe on sys.path)
from depths import project  # noqa: E402
from moe_layer import dense_peak_tflops, sync  # noqa: E402

from dtensor_moe.train.config import TrainingConfig  # noqa: E402
from dtensor_moe.train.metrics import peak_memory_bytes, write_json  # noqa: E402
from dtensor_moe.train.optim import build_optimizer  # noqa: E402

OUT = os.path.join(ROOT, "benchmarks", "results", "train_e2e.json")
MODELS = {"qwen3": 4, "deepseek": 4, "mixtral": 2}  # name: default layers
# The real models' decoder depths, where --depths projects to (Qwen3-30B-A3B; the DeepSeek 16B shape; Mixtral-8x7B).
REAL_DEPTH = {"qwen3": 48, "deepseek": 28, "mixtral": 32}
# Run order, each row for every model before the next: the main comparison first, compilation (minutes a row) last,
# so a --budget-s run that stops early has the rows that matter most for every model. transformers' compiled row
# comes after its other rows: it compiles the fastest of them.
ROWS = (("transformers", "grouped_mm"), ("dtensor_moe", "eager"), ("transformers", "eager"),
        ("transformers", "batched_mm"), ("dtensor_moe", "fp8"), ("dtensor_moe", "rounding"),
        ("dtensor_moe", "chunked_loss"), ("dtensor_moe", "standard"), ("dtensor_moe", "selective_ac"),
        ("dtensor_moe", "compiled"), ("transformers", "compiled"))
IMPLS = ("transformers", "dtensor_moe")
# the table's order
OPTIONS = ("grouped_mm", "batched_mm", "eager", "compiled", "fp8", "standard", "selective_ac", "rounding",
           "chunked_loss")
ROUND_TOKENS_TO = 128
LOSS_CHUNK_TOKENS = TrainingConfig.loss_chunk_tokens  # the main job's default
LR, BETAS, WEIGHT_DECAY, SEED = 1e-4, (0.9, 0.95), 0.1, 0
GIB = 2**30


def hf_config(model: str, layers: int, tiny: bool):
    """The transformers config of `model` cut to `layers` decoder layers (tiny: a few dims of the same family)."""
    import transformers as tf

    if model == "qwen3":
        dims = (dict(vocab_size=256, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                     moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2) if tiny else
                dict(vocab_size=151936, hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                     moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8))
        return tf.Qwen3MoeConfig(**dims, num_hidden_layers=layers, norm_topk_prob=True, decoder_sparse_step=1,
                                 mlp_only_layers=[], output_router_logits=False, tie_word_embeddings=False,
                                 rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    if model == "deepseek":
        dims = (dict(vocab_size=256, hidden_size=64, num_attention_heads=4, kv_lora_rank=32, qk_nope_head_dim=16,
                     qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
                     moe_intermediate_size=32) if tiny else
                dict(vocab_size=102400, hidden_size=2048, num_attention_heads=16, kv_lora_rank=512,
                     qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=64,
                     num_experts_per_tok=6, moe_intermediate_size=1408))
        # transformers' DeepSeek-V3 adds no router loss (5.25 records its router logits, only when asked).
        return tf.DeepseekV3Config(**dims, num_hidden_layers=layers, num_key_value_heads=dims["num_attention_heads"],
                                   q_lora_rank=None, n_shared_experts=2, first_k_dense_replace=0, n_group=1,
                                   topk_group=1, norm_topk_prob=True, tie_word_embeddings=False,
                                   rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    if model == "mixtral":
        dims = (dict(vocab_size=256, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                     num_local_experts=4) if tiny else
                dict(vocab_size=32000, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                     intermediate_size=14336, num_local_experts=8))
        return tf.MixtralConfig(**dims, num_hidden_layers=layers, num_experts_per_tok=2, output_router_logits=False,
                                tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    raise ValueError(f"--models: unknown model {model!r}; valid: {list(MODELS)}")


def expert_hidden(cfg) -> int:
    """F of one routed expert (Qwen3-MoE and DeepSeek-V3 also have a dense intermediate_size)."""
    return getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size


def attention_head_dims(cfg) -> tuple[int, int]:
    """(d_qk, d_v) of one head: MLA's qk_head_dim is nope + rope (its config's head_dim is the rope part)."""
    d_qk = (getattr(cfg, "qk_head_dim", None) or getattr(cfg, "head_dim", None)
            or cfg.hidden_size // cfg.num_attention_heads)
    return d_qk, getattr(cfg, "v_head_dim", None) or d_qk


def flops_per_token(model, cfg, seq_len: int) -> int:
    """Training FLOPs per token (module docstring): 6 per matmul weight a token meets, plus causal attention."""
    top_k = cfg.num_experts_per_tok
    weights = 0
    # Duplicates kept: a tied LM head is counted under its own name, its embedding lookup under the other.
    for name, p in model.named_parameters(remove_duplicate=False):
        if "embed_tokens" in name or p.dim() < 2:  # lookups, norms
            continue
        weights += p.numel() * top_k // p.shape[0] if p.dim() == 3 else p.numel()  # [E, ...]: routed experts
    d_qk, d_v = attention_head_dims(cfg)
    return 6 * weights + 3 * cfg.num_hidden_layers * seq_len * cfg.num_attention_heads * (d_qk + d_v)


def batched_mm_bytes(cfg, tokens: int, itemsize: int) -> int:
    """The expert weight copies transformers' batched_mm makes in one layer's forward: T * K pairs, each its
    expert's gate_up and down weights (kept for backward)."""
    return tokens * cfg.num_experts_per_tok * 3 * cfg.hidden_size * expert_hidden(cfg) * itemsize


def build_model(cfg, experts_implementation: str, dev: torch.device, dtype: torch.dtype):
    """transformers' model, every weight drawn on `dev` from SEED: the same weights in every row's process."""
    import transformers as tf

    torch.manual_seed(SEED)
    with torch.device(dev):
        model = tf.AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa",
                                                    experts_implementation=experts_implementation)
    return model.train()


def one_rank_group(dev: torch.device):
    """This process as a process group of one rank (NCCL on CUDA), unless one exists; a HashStore needs no port."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    kwargs = {"device_id": dev} if dev.type == "cuda" else {}
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1,
                            **kwargs)


def parallelize_ours(model, option: str, dev: torch.device, compile_backend: str, tiny: bool):
    """The row's dtensor_moe model (module docstring: which call each option goes through)."""
    from dtensor_moe import MoEParallelDims, MoERunOptions
    from dtensor_moe.hf.model import parallelize_hf_model, swap_moe_blocks
    from dtensor_moe.parallel.blocks import parallelize_blocks

    one_rank_group(dev)
    run = MoERunOptions(**{"fp8": {"expert_precision": "fp8"}, "standard": {"activation_memory": "standard"},
                           "rounding": {"round_tokens_to": 8 if tiny else ROUND_TOKENS_TO}}.get(option, {}))
    # Our MoE is constructed on the device (its weights are then copied from transformers' block): drawing
    # gigabytes of placeholder experts on the host and moving them would take seconds a layer. The blocks are
    # swapped here, so parallelize_hf_model's own swap finds none left.
    with torch.device(dev):
        swap_moe_blocks(model, run)
    dims = MoEParallelDims(1)
    if option == "compiled":
        return parallelize_blocks(model, model.model.layers, dims, device_type=dev.type, compile=compile_backend)
    ac = "selective" if option == "selective_ac" else "none"
    return parallelize_hf_model(model, dims, device_type=dev.type, activation_checkpoint=ac)


def token_batches_NBL(vocab: int, steps: int, batch: int, seq_len: int, dev: torch.device) -> torch.Tensor:
    """Every step's tokens, uniform over the vocabulary, from SEED: the same in every row."""
    g = torch.Generator().manual_seed(SEED)
    return torch.randint(0, vocab, (steps, batch, seq_len), generator=g).to(dev)


def lm_loss(model, tokens_BL: torch.Tensor, chunk_tokens: int) -> torch.Tensor:
    """transformers' shifted cross-entropy of `tokens_BL`: from its full logits (`labels=`), or with `chunk_tokens`
    by hf_lm_loss (parallelize_hf_model's docstring recipe)."""
    from dtensor_moe.train.loss import hf_lm_loss

    if not chunk_tokens:
        return model(input_ids=tokens_BL, labels=tokens_BL, use_cache=False).loss
    return hf_lm_loss(model, tokens_BL, chunk_tokens, use_cache=False)


def train(model, optimizer, tokens_NBL: torch.Tensor, dev: torch.device, chunk_tokens: int = 0
          ) -> tuple[list[float], list[float], list[float]]:
    """One training step per batch (`chunk_tokens`: lm_loss's); returns (losses, seconds, optimizer seconds) per
    step."""
    from dtensor_moe import balance_loss

    losses, seconds, optimizer_s = [], [], []
    for tokens_BL in tokens_NBL:
        sync(dev)
        t0 = time.perf_counter()
        # 0 for transformers' model (no MoE of ours) and while our balance losses are off (module docstring).
        loss = lm_loss(model, tokens_BL, chunk_tokens) + balance_loss(model)
        loss.backward()
        sync(dev)  # the optimizer's own time: one more sync a step, both impls alike
        t1 = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync(dev)
        t2 = time.perf_counter()
        seconds.append(t2 - t0)
        optimizer_s.append(t2 - t1)
        losses.append(loss.detach())
    return [float(v) for v in losses], seconds, optimizer_s


def run_row(spec: dict) -> dict:
    """Builds, trains and measures one row (in its own process, or in this one with --in-process)."""
    dev = torch.device(spec["device"])
    if dev.type == "cuda":
        dev = torch.device("cuda", torch.cuda.current_device())
        # Our router runs its gate GEMM in float32 on purpose (routing decisions are sensitive to rounding;
        # transformers' DeepSeek-V3 router does so too), which makes inductor advise TF32 when it compiles a
        # layer: TF32 would change the routing, for a GEMM of D x E a token, a negligible part of the step.
        warnings.filterwarnings("ignore", message="TensorFloat32 tensor cores for float32 matrix multiplication",
                                category=UserWarning)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model_name, impl, option = spec["model"], spec["impl"], spec["option"]
    cfg = hf_config(model_name, spec["layers"], spec["tiny"])
    implementation = option if option in ("grouped_mm", "batched_mm", "eager") and impl == "transformers" else (
        spec.get("experts_implementation") or "grouped_mm")
    t0 = time.perf_counter()
    model = build_model(cfg, implementation, dev, dtype)
    row = {"params": sum(p.numel() for p in model.parameters()),
           "flops_per_token": flops_per_token(model, cfg, spec["seq_len"])}
    if impl == "dtensor_moe":
        import torch.distributed as dist

        try:
            parallelize_ours(model, option, dev, spec["compile_backend"], spec["tiny"])
            return {**row, **measure(model, cfg, spec, dev, t0)}
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    if option == "compiled":
        row["experts_implementation"] = implementation
        for layer in model.model.layers:
            layer.compile(backend=spec["compile_backend"])
    return {**row, **measure(model, cfg, spec, dev, t0)}


def measure(model, cfg, spec: dict, dev: torch.device, t0: float) -> dict:
    """The row's training measurements; `t0`: when its model's build began."""
    # Before any forward: FSDP2 swaps in unsharded parameters there. The main job's AdamW: a group per mesh, fused.
    optimizer = build_optimizer(model, LR, WEIGHT_DECAY, BETAS)
    tokens_NBL = token_batches_NBL(cfg.vocab_size, spec["warmup"] + spec["steps"], spec["batch"], spec["seq_len"], dev)
    sync(dev)
    build_s = time.perf_counter() - t0
    # Tiny: chunks of 16 of its 64 tokens a step, so the smoke test runs several.
    chunk_tokens = (16 if spec["tiny"] else LOSS_CHUNK_TOKENS) if spec["option"] == "chunked_loss" else 0
    losses, seconds, optimizer_s = train(model, optimizer, tokens_NBL, dev, chunk_tokens)
    step_s, opt_s = (sorted(t[spec["warmup"]:])[len(t[spec["warmup"]:]) // 2] for t in (seconds, optimizer_s))
    return dict(tokens_per_s=spec["batch"] * spec["seq_len"] / step_s, step_ms=step_s * 1e3, optimizer_ms=opt_s * 1e3,
                peak_gib=peak_memory_bytes(dev) / GIB, loss_step1=losses[0], loss_last=losses[-1], build_s=build_s,
                warmup_s=sum(seconds[:spec["warmup"]]))


def worker():
    """A row's process: imports first (while the row before it trains), then runs the spec read from stdin."""
    import transformers as tf

    import dtensor_moe.hf.model  # noqa: F401

    for family in ("Qwen3MoeForCausalLM", "DeepseekV3ForCausalLM", "MixtralForCausalLM"):
        getattr(tf, family)  # transformers imports a model's module on first use
    line = sys.stdin.readline()
    if not line:  # no row came (the run ended)
        return
    spec = json.loads(line)
    try:
        row = run_row(spec)
    except Exception as e:  # an OOM or any failure is the row's result
        row = {"error": f"{type(e).__name__}: {e}"[:2000]}
    write_json(spec["result"], row)


class Workers:
    """Row processes, one started ahead of its row. A process's output goes to a log, echoed after its row."""

    def __init__(self, tmp: str):
        self.tmp, self.spare, self.count = tmp, None, 0

    def _start(self):
        self.count += 1
        log = os.path.join(self.tmp, f"row{self.count}.log")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (ROOT, os.environ.get("PYTHONPATH"))))}
        with open(log, "w") as f:
            proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker"], stdin=subprocess.PIPE,
                                    stdout=f, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env)
        return proc, log

    def run(self, spec: dict, timeout_s: float, more: bool) -> dict:
        """The row's result from a process of its own; `more`: start the next row's process now."""
        proc, log = self.spare or self._start()
        self.spare = self._start() if more else None
        result = os.path.join(self.tmp, f"row{self.count}.json")
        try:
            proc.stdin.write(json.dumps({**spec, "result": result}) + "\n")
            proc.stdin.close()
        except BrokenPipeError:  # it died importing: its log says why
            pass
        timed_out = False
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            proc.kill()
            proc.wait()
        with open(log) as f:
            output = f.read().strip()
        if output:
            print("\n".join(f"  | {line}" for line in output.splitlines()[-40:]), flush=True)
        if os.path.exists(result):
            with open(result) as f:
                return json.load(f)
        why = f"timed out after {timeout_s:.0f} s" if timed_out else f"exit status {proc.returncode}"
        return {"error": f"the row's process wrote no result ({why}): {output[-1500:]}"}

    def close(self):
        """Ends the process started for a row that will not come (it has only imported: nothing to lose)."""
        if self.spare is not None:
            proc, _ = self.spare
            proc.kill()
            proc.wait()
            proc.stdin.close()
            self.spare = None


def plan(args) -> list[tuple[str, str, str, int]]:
    """(model, impl, option, layers) in run order (ROWS), at each of --depths (else the model's --layers)."""
    return [(m, impl, o, n) for impl, o in ROWS if impl in args.impls and o in args.options for m in args.models
            for n in (args.depths or (args.layers[m],))]


def table_order(rows: list[dict]) -> list[dict]:
    """By model, impl, then option (unknown names last)."""
    def rank(names, name):
        return names.index(name) if name in names else len(names)

    return sorted(rows, key=lambda r: (rank(list(MODELS), r["model"]), rank(IMPLS, r["impl"]),
                                       rank(OPTIONS, r["option"]), r.get("layers", 0)))


def fastest_transformers(rows: list[dict], model: str, layers: int) -> dict | None:
    ok = [r for r in rows if (r["model"], r.get("layers")) == (model, layers) and r["impl"] == "transformers"
          and "error" not in r]
    return max(ok, key=lambda r: r["tokens_per_s"], default=None)


def merged(rows: list[dict], row: dict) -> list[dict]:
    """`rows` with `row` in place of the one of its (model, impl, option, layers), or appended."""
    def key(r):
        return r["model"], r["impl"], r["option"], r.get("layers")

    out = [row if key(r) == key(row) else r for r in rows]
    return out if row in out else [*out, row]


def with_ratios(rows: list[dict]) -> list[dict]:
    for r in rows:
        best = fastest_transformers(rows, r["model"], r.get("layers"))
        r["vs_transformers"] = r["tokens_per_s"] / best["tokens_per_s"] if best and "error" not in r else None
    return rows


HEADER = (f"{'model':9s} {'impl':12s} {'option':12s} {'layers':>6s} {'tokens/s':>10s} {'MFU':>6s} {'peak GiB':>9s} "
          f"{'step-1 loss':>11s} {'/ tf best':>9s} {'optim ms':>8s}")


def projections(rows: list[dict]) -> list[dict]:
    """depths.project of every (model, impl, option) with rows at two depths or more (the shallowest and the
    deepest), against its rows' measured dense peak."""
    out = []
    for model, impl, option in dict.fromkeys((r["model"], r["impl"], r["option"]) for r in rows):
        ok = sorted((r for r in rows if (r["model"], r["impl"], r["option"]) == (model, impl, option)
                     and "error" not in r and r.get("layers")), key=lambda r: r["layers"])
        if len({r["layers"] for r in ok}) < 2:
            continue
        a, b = ok[0], ok[-1]
        p = project(a["batch"] * a["seq_len"], (a["layers"], b["layers"]), (a["tokens_per_s"], b["tokens_per_s"]),
                    (a["flops_per_token"], b["flops_per_token"]), REAL_DEPTH[model], a["dense_peak_tflops"] * 1e12)
        out.append(dict(model=model, impl=impl, option=option, depths=(a["layers"], b["layers"]),
                        optimizer_ms=(a["optimizer_ms"], b["optimizer_ms"]), **p))
    return out


def projection_line(p: dict) -> str:
    return (f"{p['model']:9s} {p['impl']:12s} {p['option']:12s} layers {p['depths'][0]}, {p['depths'][1]}: "
            f"{p['per_layer_ms']:7.2f} ms a layer, fixed {p['fixed_ms']:7.1f} ms (optimizer {p['optimizer_ms'][0]:.1f}"
            f", {p['optimizer_ms'][1]:.1f}); at {p['real_depth']} layers {p['projected_tokens_per_s']:,.0f} tokens/s, "
            f"MFU {100 * (p['projected_mfu'] or 0):.1f}%")


def row_line(r: dict) -> str:
    head = f"{r['model']:9s} {r['impl']:12s} {r['option']:12s} {r.get('layers', 0):6d}"
    if "error" in r:
        return f"{head} error: {r['error'][:300]}"
    ratio = f"{r['vs_transformers']:.2f}" if r.get("vs_transformers") is not None else "-"
    return (f"{head} {r['tokens_per_s']:10,.0f} {100 * r['mfu']:5.1f}% {r['peak_gib']:9.1f} "
            f"{r['loss_step1']:11.5f} {ratio:>9s} {r.get('optimizer_ms', float('nan')):8.1f}")


def parse_layers(items: list[str]) -> dict:
    """--layers: N (every model) or MODEL=N items."""
    layers = {}
    for item in items:
        name, _, n = item.rpartition("=")
        if name and name not in MODELS:
            raise ValueError(f"--layers: unknown model {name!r}; valid: {list(MODELS)}")
        if not n.isdigit() or int(n) < 1:
            raise ValueError(f"--layers: {item!r} needs a positive layer count (N or MODEL=N)")
        layers.update({name: int(n)} if name else dict.fromkeys(MODELS, int(n)))
    return layers


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    p.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS))
    p.add_argument("--options", nargs="+", choices=OPTIONS, default=list(OPTIONS),
                   help="options of either impl (eager and compiled are both's)")
    p.add_argument("--layers", nargs="*", default=[], help="N or MODEL=N; default: qwen3=4 deepseek=4 mixtral=2")
    p.add_argument("--depths", type=int, nargs=2, help="every row at these two decoder depths (instead of "
                   "--layers), and from their difference the per-layer time, the fixed part and the projection to "
                   f"the real depth {REAL_DEPTH}")
    p.add_argument("--seq-len", type=int, help="default 4096 (32 with --tiny)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--steps", type=int, help="timed steps; default 10 (2 with --tiny)")
    p.add_argument("--warmup", type=int, help="default 3 (1 with --tiny)")
    p.add_argument("--out", default=OUT)
    p.add_argument("--budget-s", type=float, help="start no row after this many seconds")
    p.add_argument("--row-timeout-s", type=float, default=300)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tiny", action="store_true", help="a few dims of each family (the CPU smoke test)")
    p.add_argument("--compile-backend", default="inductor", help="e.g. aot_eager: dynamo and AOTAutograd, no codegen")
    p.add_argument("--in-process", action="store_true", help="every row in this process (no isolation)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for name, default, tiny in (("seq_len", 4096, 32), ("steps", 10, 2), ("warmup", 3, 1)):
        if getattr(args, name) is None:
            setattr(args, name, tiny if args.tiny else default)
    args.layers = {**{m: 2 if args.tiny else n for m, n in MODELS.items()}, **parse_layers(args.layers)}
    if args.depths and (min(args.depths) < 1 or args.depths[0] == args.depths[1]):
        raise ValueError(f"--depths needs two different positive layer counts, got {args.depths}")
    if min(args.steps, args.batch, args.seq_len) < 1 or args.warmup < 0:
        raise ValueError("--steps, --batch and --seq-len must be >= 1 and --warmup >= 0")
    return args


def precheck(spec: dict, dev: torch.device) -> str | None:
    """Why the row cannot run, found without running it (batched_mm's weight copies), or None."""
    if spec["impl"] != "transformers" or spec["option"] != "batched_mm" or dev.type != "cuda":
        return None
    cfg = hf_config(spec["model"], spec["layers"], spec["tiny"])
    need = batched_mm_bytes(cfg, spec["batch"] * spec["seq_len"], 2)
    have = torch.cuda.get_device_properties(dev).total_memory
    if need > have:
        return (f"not run: batched_mm copies each (token, expert) pair's expert weights, {need / GIB:,.0f} GiB a "
                f"layer here, more than the GPU's {have / GIB:.0f} GiB")
    return None


def main(argv=None, started: float | None = None) -> dict:
    """Runs the rows; returns the written JSON's content. `started`: the perf_counter time --budget-s counts
    from (default: now)."""
    started = time.perf_counter() if started is None else started
    args = parse_args(argv)
    if args.worker:
        worker()
        return {}
    import transformers

    if int(os.environ.get("WORLD_SIZE", "1")) != 1:
        raise ValueError("train_e2e.py measures one GPU; run it as one process (python, or torchrun with one)")
    dev = torch.device(args.device)
    peak_tflops = dense_peak_tflops(dev, iters=20)
    if dev.type == "cuda":
        torch.cuda.empty_cache()  # the matmul's operands: the parent keeps only its context while rows run
    old = {}
    if os.path.exists(args.out):
        with open(args.out) as f:
            old = json.load(f)
    res = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "torch": torch.__version__,
           "transformers": transformers.__version__,
           "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
           "dense_peak_tflops": peak_tflops, "rows": old.get("rows", [])}
    print(f"torch {res['torch']}, transformers {res['transformers']} on {res['device']}; dense bf16 peak "
          f"{peak_tflops:.4g} TFLOP/s\n{HEADER}", flush=True)
    todo = plan(args)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="train_e2e.")
    workers = Workers(tmp)
    not_run = []
    try:
        for i, (model, impl, option, layers) in enumerate(todo):
            if args.budget_s is not None and time.perf_counter() - started > args.budget_s:
                not_run = todo[i:]
                break
            spec = {"model": model, "impl": impl, "option": option, "layers": layers,
                    "seq_len": args.seq_len, "batch": args.batch, "steps": args.steps, "warmup": args.warmup,
                    "device": args.device, "tiny": args.tiny, "compile_backend": args.compile_backend}
            if impl == "transformers" and option == "compiled":
                best = fastest_transformers([r for r in res["rows"] if r["option"] != "compiled"], model, layers)
                spec["experts_implementation"] = best["option"] if best else None
            row = {k: spec[k] for k in ("model", "impl", "option", "layers", "seq_len", "batch")}
            why = precheck(spec, dev)
            if why:
                row["error"] = why
            elif impl == "transformers" and option == "compiled" and spec["experts_implementation"] is None:
                row["error"] = "not run: no transformers experts implementation of this model has a result to compile"
            elif args.in_process:
                try:
                    row.update(run_row(spec))
                except Exception as e:
                    row["error"] = f"{type(e).__name__}: {e}"[:2000]
                torch._dynamo.reset()
            else:
                row.update(workers.run(spec, args.row_timeout_s, more=i + 1 < len(todo)))
            if "error" not in row:
                row.update(dense_peak_tflops=peak_tflops, mfu=row["flops_per_token"] * row["tokens_per_s"] /
                           (peak_tflops * 1e12))
            res["rows"] = table_order(with_ratios(merged(res["rows"], row)))
            res["projections"] = projections(res["rows"])
            write_json(args.out, res)
            print(row_line(row), flush=True)
    finally:
        workers.close()
        shutil.rmtree(tmp, ignore_errors=True)
    if not_run:
        print(f"--budget-s {args.budget_s:.0f} reached; not run: "
              f"{', '.join('/'.join(map(str, k)) for k in not_run)}")
    print(f"\n{args.out} ({time.perf_counter() - started:.0f} s):\n{HEADER}")
    for r in res["rows"]:
        print(row_line(r))
    for p in res.get("projections", []):
        print(projection_line(p))
    return res


if __name__ == "__main__":
    main(started=STARTED)
