"""Weight-gradient accumulation into .grad, three ways, at the EP=2 per-rank expert shapes (one GPU):

    python benchmarks/wgrad_probe.py --out wgrad.json

  grouped+add: `torch._grouped_mm` then `grad += result` (autograd's accumulation);
  addmm:       one cuBLAS `addmm_` per expert, beta = 1 (kernels/grouped_mm.add_weight_grad_ with method per_expert);
  triton:      `wgrad_kernel.accumulate`, one launch, for several tile configs.
Both orientations: w1/w3 ([E, F, D] = da^T x) and w2 ([E, D, F] = dy^T h). Uniform random routing.
Prints a table (median ms, TFLOP/s, error against addmm) and writes JSON.
"""

import argparse

import torch

from dtensor_moe.kernels import wgrad as wgrad_kernel
from dtensor_moe.kernels.grouped_mm import add_weight_grad_, grouped_weight_grad
from dtensor_moe.train.metrics import write_json
from expert_gemms import cuda_ms  # run from benchmarks/ or as benchmarks/wgrad_probe.py

SHAPES = {  # per rank at EP=2: D, F, local experts, routed rows
    "deepseek": (7168, 2048, 128, 8192 * 8),
    "qwen": (2048, 768, 64, 16384 * 8),
    "mixtral": (4096, 14336, 4, 8192 * 2),
    "e64": (4096, 1536, 32, 16384 * 6),
}
CONFIGS = [(128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (256, 128, 64, 8, 3), (128, 128, 64, 4, 3),
           (128, 128, 64, 4, 4), (128, 128, 64, 8, 4), (128, 256, 32, 8, 5), (256, 128, 32, 8, 5), (64, 256, 64, 4, 4)]


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30)).item()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dev = torch.device("cuda")
    rows = []
    for shape in args.shapes:
        D, F, E, N = SHAPES[shape]
        torch.manual_seed(0)
        counts = torch.bincount(torch.randint(E, (N,)), minlength=E)
        ends = counts.cumsum(0).to(device=dev, dtype=torch.int32)
        host = counts.tolist()
        for orient, (O, I) in (("w1 [F,D]", (F, D)), ("w2 [D,F]", (D, F))):
            g_NO = torch.randn(N, O, device=dev, dtype=torch.bfloat16)
            x_NI = torch.randn(N, I, device=dev, dtype=torch.bfloat16)
            flop = 2 * N * O * I
            ref = torch.zeros(E, O, I, device=dev, dtype=torch.bfloat16)
            add_weight_grad_(ref, g_NO, x_NI, ends, 0.5, host, "per_expert")
            out = torch.zeros_like(ref)

            def grouped_add():
                out.add_(grouped_weight_grad(g_NO, x_NI, ends), alpha=0.5)

            methods = [("grouped+add", grouped_add), ("addmm", lambda: add_weight_grad_(out, g_NO, x_NI, ends, 0.5, host, "per_expert"))]
            methods += [(f"triton {c}", lambda c=c: wgrad_kernel.accumulate(out, g_NO, x_NI, ends, 0.5, config=c))
                        for c in CONFIGS]
            for name, fn in methods:
                out.zero_()
                try:
                    fn()
                    err = rel(out, ref)
                    ms = cuda_ms(fn, args.iters, warmup=1)
                except Exception as e:  # a config that does not compile or fit: report it, go on
                    print(f"{shape} {orient} {name}: {type(e).__name__}: {str(e)[:200]}")
                    continue
                rows.append({"shape": shape, "orientation": orient, "method": name, "ms": ms,
                             "tflops": flop / ms / 1e9, "rel_err": err})
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    print("| shape | orientation | method | ms | TFLOP/s | err vs addmm |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['orientation']} | {r['method']} | {r['ms']:.3f} | {r['tflops']:.0f} | {r['rel_err']:.1e} |")
    write_json(args.out, {"torch": torch.__version__, "rows": rows})


if __name__ == "__main__":
    main()
