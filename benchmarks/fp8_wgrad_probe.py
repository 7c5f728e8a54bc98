"""Where the FP8 weight gradient's time goes, against bf16 (one GPU):

    python benchmarks/fp8_wgrad_probe.py --out fp8_wgrad.json

Per shape and weight orientation (w1/w3: da^T x into [F, D]; w2: dy^T h into [D, F]), CUDA-event
medians of 10: the bf16 fresh `torch._grouped_mm` gradient; FP8's two per-expert-column quantizations
(transposed, 16-row padded: kernels/fp8.py "token_cols") and its 2d x 2d `_scaled_grouped_mm` alone on
pre-quantized operands; and each weight's two quantizations (forward "rows", input-gradient
"weight_cols"), which the layer redoes whenever the weight changes (every optimizer step).
"""

import argparse

import torch

from dtensor_moe.kernels import fp8
from dtensor_moe.kernels.grouped_mm import grouped_weight_grad
from dtensor_moe.train.metrics import write_json
from expert_gemms import SHAPES, cuda_ms, routing_offsets  # run from benchmarks/


def measure(name, D, F, E, N, dev) -> list[dict]:
    torch.manual_seed(0)
    bf = dict(device=dev, dtype=torch.bfloat16)
    offs, _ = routing_offsets(N, E, dev)
    rows = []
    for orient, O, I in (("w1 [F,D]", F, D), ("w2 [D,F]", D, F)):
        g, a = torch.randn(N, O, **bf), torch.randn(N, I, **bf)
        qg, sg, ends = fp8._quantize(g, "token_cols", offs)
        qa, sa, _ = fp8._quantize(a, "token_cols", offs)
        ref = grouped_weight_grad(g, a, offs).float()
        got = fp8.fp8_grouped_weight_grad(qg, sg, qa, sa, ends, torch.bfloat16).float()
        ms = {"bf16_fresh": cuda_ms(lambda: grouped_weight_grad(g, a, offs)),
              "quant_g": cuda_ms(lambda: fp8._quantize(g, "token_cols", offs)),
              "quant_x": cuda_ms(lambda: fp8._quantize(a, "token_cols", offs)),
              "fp8_gemm": cuda_ms(lambda: fp8.fp8_grouped_weight_grad(qg, sg, qa, sa, ends, torch.bfloat16))}
        w = torch.randn(E, O, I, **bf) * 0.02
        ms["weight_rows"] = cuda_ms(lambda: fp8._quantize(w, "rows", None), iters=3, warmup=1)
        ms["weight_cols"] = cuda_ms(lambda: fp8._quantize(w, "weight_cols", None), iters=3, warmup=1)
        flops = 2 * N * O * I
        r = {"shape": name, "orientation": orient, "O": O, "I": I, "rows_per_expert": N / E, **ms,
             "fp8_total": ms["quant_g"] + ms["quant_x"] + ms["fp8_gemm"],
             "bf16_tflops": flops / ms["bf16_fresh"] / 1e9, "fp8_gemm_tflops": flops / ms["fp8_gemm"] / 1e9,
             "fp8_rel_err": ((got - ref).norm() / ref.norm()).item(),
             "weight_gbytes": w.numel() * 2 / 1e9}
        rows.append(r)
        print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()), flush=True)
        torch.cuda.empty_cache()
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["deepseek", "mixtral"], choices=list(SHAPES))
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dev = torch.device("cuda")
    rows = [r for name in args.shapes for r in measure(name, *SHAPES[name], dev)]
    write_json(args.out, {"torch": torch.__version__, "device": torch.cuda.get_device_name(), "rows": rows})


if __name__ == "__main__":
    main()
