"""The experts' GEMMs alone, bf16 against FP8 (kernels/fp8.py), and the FP8 ops' checks on the GPU.

    python tools/tune/expert_gemms.py --out expert_gemms.json   # one H200, ~1 min

Per shape (moe_layer.py's four, plus configs/gpu_2x.toml's layer on one GPU) and GEMM, TFLOP/s from
CUDA-event medians (10 after 3 warm-ups) on random routing (uneven expert blocks, as in training):
  fwd    x @ w^T per expert (w1/w3: I=D, O=F; w2: I=F, O=D; gate and up as the experts run them, one
         GEMM over w13: I=D, O=2F);
  dgrad  g @ w   (dh = dy @ w2: I=D, O=F; dx = da @ w1: I=F, O=D; dx = [da, db] @ w13: I=2F, O=D);
  wgrad  g_e^T x_e into a fresh [E, O, I] gradient, and wgrad_acc: into an existing one (bf16: the
         in-GEMM accumulation policy.weight_grad_accumulation picks; FP8: its GEMM then an add).
FP8 times include the fused quantization of the activation operands (rows for fwd/dgrad, per-expert
columns, transposed and padded, for both wgrad operands); the weights' quantization, memoized until
they change, is timed on its own (`weight_quant_ms`, w13 and w2, both layouts). The JSON's
"gemms" list is the table kernels/policy.py reads (copy it to dtensor_moe/kernels/fp8_rates.json).
Checks (JSON "checks"): opcheck of the FP8 ops on CUDA, Triton quantization equal to the torch path,
the FP8 GEMMs against the dequantized math, empty experts.
"""

import argparse
import json
import time
from unittest import mock

import _checkout  # noqa: F401  (this checkout's dtensor_moe on sys.path)
import torch

from dtensor_moe.kernels import fp8, policy
from dtensor_moe.kernels.grouped_mm import add_weight_grad_, grouped_mm, grouped_weight_grad

SHAPES = {  # name: (D, F, E, rows = tokens * K)
    "deepseek": (7168, 2048, 256, 8192 * 8),
    "qwen": (2048, 768, 128, 16384 * 8),
    "mixtral": (4096, 14336, 8, 8192 * 2),
    "e64": (4096, 1536, 64, 16384 * 6),
    "train_gpu": (1024, 2048, 16, 32 * 1024 * 2),
}


def cuda_ms(fn, iters=10, warmup=3) -> float:
    """CUDA-event median; on CPU (moe_layer.py's smoke test) the wall time of one call."""
    if not torch.cuda.is_available():
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def measure(name, D, F, E, N, dev, counts_E=None, precisions=("bf16", "fp8")) -> tuple[list[dict], dict]:
    """The GEMM records (and the weights' quantization time, with fp8) at `counts_E` rows per expert (default:
    random routing); moe_layer.py's --gemm-timing passes a layer's routed counts and its one precision."""
    torch.manual_seed(0)
    bf = dict(device=dev, dtype=torch.bfloat16)
    if counts_E is None:
        counts_E = torch.bincount(torch.randint(E, (N,), device=dev), minlength=E)
    offs, host_counts = torch.cumsum(counts_E, 0, dtype=torch.int32), counts_E.tolist()
    x, dy = torch.randn(N, D, **bf), torch.randn(N, D, **bf)
    h, dab = torch.randn(N, F, **bf), torch.randn(N, 2 * F, **bf)
    w13, w2 = torch.randn(E, 2 * F, D, **bf) * 0.02, torch.randn(E, D, F, **bf) * 0.02
    w1, da = w13[:, :F], dab[:, :F].contiguous()

    def rows_mm(a, qw, sw):
        q, s = fp8.quantize_rows(a)
        return fp8.fp8_grouped_mm(q, s, qw, sw, offs, torch.bfloat16)

    def fwd_weights(w):
        q, s = fp8._quantize(w, "rows", None)
        return q.transpose(-2, -1), s

    def dgrad_weights(w):
        q, s = fp8._quantize(w, "weight_cols", None)
        return q.transpose(-2, -1), s

    def fp8_wgrad(g, a):
        qg, sg, ends = fp8._quantize(g, "token_cols", offs)
        qa, sa, _ = fp8._quantize(a, "token_cols", offs)
        return fp8.fp8_grouped_weight_grad(qg, sg, qa, sa, ends, torch.bfloat16)

    weight_quant = {}
    if "fp8" in precisions:  # only then are the FP8 GEMMs below called, with these weights
        weight_quant["weight_quant_ms"] = cuda_ms(
            lambda: [f(w) for w in (w13, w2) for f in (fwd_weights, dgrad_weights)], iters=3, warmup=1)
        fw1, fw2, dw2q, dw1q = fwd_weights(w1), fwd_weights(w2), dgrad_weights(w2), dgrad_weights(w1)
        fw13, dw13q = fwd_weights(w13), dgrad_weights(w13)
    accumulate = policy.weight_grad_accumulation(x, w1.shape, True, True)
    entries = []
    gemms = [
        ("fwd", D, F, lambda: grouped_mm(x, w1.transpose(-2, -1), offs), lambda: rows_mm(x, *fw1)),
        ("fwd", F, D, lambda: grouped_mm(h, w2.transpose(-2, -1), offs), lambda: rows_mm(h, *fw2)),
        ("dgrad", D, F, lambda: grouped_mm(dy, w2, offs), lambda: rows_mm(dy, *dw2q)),
        ("dgrad", F, D, lambda: grouped_mm(da, w1, offs), lambda: rows_mm(da, *dw1q)),
        ("wgrad", D, F, lambda: grouped_weight_grad(da, x, offs), lambda: fp8_wgrad(da, x)),
        ("wgrad", F, D, lambda: grouped_weight_grad(dy, h, offs), lambda: fp8_wgrad(dy, h)),
        ("fwd", D, 2 * F, lambda: grouped_mm(x, w13.transpose(-2, -1), offs), lambda: rows_mm(x, *fw13)),
        ("dgrad", 2 * F, D, lambda: grouped_mm(dab, w13, offs), lambda: rows_mm(dab, *dw13q)),
        ("wgrad", D, 2 * F, lambda: grouped_weight_grad(dab, x, offs), lambda: fp8_wgrad(dab, x)),
    ]
    for g, a, (I, O) in ((da, x, (D, F)), (dy, h, (F, D))):
        out = torch.zeros(E, O, I, **bf)

        def bf16_acc(g=g, a=a, out=out):
            if accumulate is None:
                out.add_(grouped_weight_grad(g, a, offs))
            else:
                add_weight_grad_(out, g, a, offs, 1.0, host_counts, accumulate(out.shape))

        gemms.append(("wgrad_acc", I, O, bf16_acc, lambda g=g, a=a, out=out: out.add_(fp8_wgrad(g, a))))
    for gemm, I, O, f_bf16, f_fp8 in gemms:
        flops = 2 * N * I * O
        ms = {p: cuda_ms(f) for p, f in (("bf16", f_bf16), ("fp8", f_fp8)) if p in precisions}
        entries.append({"shape": name, "gemm": gemm, "I": I, "O": O, "E": E, "rows_per_expert": N / E,
                        **{f"{p}_ms": v for p, v in ms.items()},
                        **{f"{p}_tflops": flops / (v / 1e3) / 1e12 for p, v in ms.items()}})
    torch.cuda.empty_cache()
    return entries, {"shape": name, **weight_quant}


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def checks(dev) -> dict:
    out = {}
    torch.manual_seed(0)
    x = torch.randn(70, 64, device=dev, dtype=torch.bfloat16) * 3
    offs = torch.tensor([20, 20, 70], device=dev, dtype=torch.int32)  # an empty expert, uneven blocks
    w = torch.randn(3, 48, 64, device=dev, dtype=torch.bfloat16)
    g = torch.randn(70, 48, device=dev, dtype=torch.bfloat16)
    # Triton against the torch path on the same GPU tensors.
    for label, fn in [
        ("rows", lambda: fp8.quantize_rows(x)),
        ("weight_cols", lambda: fp8._quantize(w, "weight_cols", None)),
        ("token_cols", lambda: fp8._quantize(x, "token_cols", offs)),
    ]:
        tri = fn()
        with mock.patch.object(policy, "runs_triton", lambda t: False):
            ref = fn()
        q_t, q_r = tri[0].float(), ref[0].float()
        if label == "token_cols":
            q_t, q_r = q_t[:, : int(ref[2][-1])], q_r[:, : int(ref[2][-1])]
        out[f"triton_vs_torch:{label}"] = {"codes_differ": int((q_t != q_r).sum()), "codes": q_r.numel(),
                                           "scale_max_rel": ((tri[1] - ref[1]).abs() / ref[1]).max().item()}
    # The CUDA GEMMs against the same quantized operands dequantized (fp32 math on the CPU).
    cpu = lambda t: t.cpu()  # noqa: E731
    got = fp8.grouped_mm(x, w.transpose(-2, -1), offs)
    q, s = fp8.quantize_rows(x)
    qw, sw = fp8.quantize_rows(w.reshape(-1, 64))
    want = fp8.fp8_grouped_mm(cpu(q), cpu(s), cpu(qw).view(3, 48, 64).transpose(-2, -1), cpu(sw).view(3, 48), cpu(offs),
                              torch.float32)
    out["gemm_fwd_vs_dequantized"] = rel(got.cpu(), want)
    got = fp8.grouped_mm(g, w, offs)
    qg, sg = fp8.quantize_rows(g)
    qw, sw = fp8._quantize(w, "weight_cols", None)
    want = fp8.fp8_grouped_mm(cpu(qg), cpu(sg), cpu(qw).transpose(-2, -1), cpu(sw), cpu(offs), torch.float32)
    out["gemm_dgrad_vs_dequantized"] = rel(got.cpu(), want)
    dw = fp8.grouped_weight_grad(g, x, offs)
    qg, sg, ends = fp8._quantize(g, "token_cols", offs)
    qx, sx, _ = fp8._quantize(x, "token_cols", offs)
    want = fp8.fp8_grouped_weight_grad(cpu(qg), cpu(sg), cpu(qx), cpu(sx), cpu(ends), torch.float32)
    out["gemm_wgrad_vs_dequantized"] = rel(dw.cpu(), want)
    out["wgrad_empty_expert_max_abs"] = dw[1].abs().max().item()
    out["fp8_vs_bf16_fwd_rel"] = rel(
        fp8.grouped_mm(x, w.transpose(-2, -1), offs), grouped_mm(x, w.transpose(-2, -1), offs)
    )
    for name, op, args in [
        ("quantize_rows", fp8.quantize_rows, (x,)),
        (
            "quantize_cols",
            fp8.quantize_cols,
            (x, offs.new_tensor([0, 20]), offs.new_tensor([20, 70]), offs.new_tensor([0, 20]), [64, 70], 0, 70, 1),
        ),
        (
            "fp8_grouped_mm",
            fp8.fp8_grouped_mm,
            (
                q,
                s,
                fp8.quantize_rows(w.reshape(-1, 64))[0].view(3, 48, 64).transpose(-2, -1),
                fp8.quantize_rows(w.reshape(-1, 64))[1].view(3, 48),
                offs,
                torch.bfloat16,
            ),
        ),
        ("fp8_grouped_weight_grad", fp8.fp8_grouped_weight_grad, (qg, sg, qx, sx, ends, torch.bfloat16)),
    ]:
        for utils, label in (
            (None, ""),
            (("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic"), " without test_schema"),
        ):
            try:
                torch.library.opcheck(op, args, **({} if utils is None else {"test_utils": utils}))
                out[f"opcheck:{name}{label}"] = "ok"
                break
            except Exception as e:  # recorded, not raised: the benchmark still runs
                out[f"opcheck:{name}{label}"] = f"{type(e).__name__}: {str(e)[:300]}"
    return out


def probe_cli(doc: str, shapes: dict, *extra: tuple[tuple, dict]) -> tuple[argparse.Namespace, torch.device, dict]:
    """The GPU probes' command line (--shapes of `shapes`, --out, and each `extra` (flags, options) argument), their
    GPU, and their JSON's header: torch, the device, when measured."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=list(shapes), choices=list(shapes))
    ap.add_argument("--out", required=True)
    for flags, options in extra:
        ap.add_argument(*flags, **options)
    dev = torch.device("cuda")
    return ap.parse_args(), dev, {"torch": torch.__version__,
                                  "device": torch.cuda.get_device_name(dev) if torch.cuda.is_available() else None,
                                  "measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def main():
    args, dev, res = probe_cli(__doc__, SHAPES)
    res["measured"] += (" by tools/tune/expert_gemms.py: CUDA-event medians of 10, random routing, FP8 including "
                        "activation quantization")
    res.update(checks={}, gemms=[], weight_quant=[])
    try:
        res["checks"] = checks(dev)
    except Exception as e:  # recorded: the measurements still run
        res["checks"] = {"error": f"{type(e).__name__}: {str(e)[:800]}"}
    print(json.dumps(res["checks"], indent=1), flush=True)
    for name in args.shapes:
        try:
            entries, wq = measure(name, *SHAPES[name], dev)
        except Exception as e:  # recorded: the other shapes still run
            res.setdefault("errors", {})[name] = f"{type(e).__name__}: {str(e)[:500]}"
            print(f"{name}: {res['errors'][name]}", flush=True)
            torch.cuda.empty_cache()
            continue
        res["gemms"] += entries
        res["weight_quant"].append(wq)
        for e in entries:
            print(
                f"{name:9s} {e['gemm']:9s} I={e['I']:5d} O={e['O']:5d} "
                f"bf16 {e['bf16_tflops']:6.0f} fp8 {e['fp8_tflops']:6.0f} "
                f"TFLOP/s ({e['fp8_tflops'] / e['bf16_tflops']:.2f}x)",
                flush=True,
            )
        print(f"{name:9s} weight quantization (w13 and w2, 2 layouts): {wq['weight_quant_ms']:.2f} ms", flush=True)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
