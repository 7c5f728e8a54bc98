"""Compiled vs eager, side by side in one run: bf16 forward+backward of a transformer block and of a
DeepSeek-like MoE layer on one GPU (unparallelized: EP needs two GPUs), graph breaks counted.

    python benchmarks/compile_bench.py --out compile.json
    python benchmarks/compile_bench.py --device cpu --sizes tiny --out x.json   # smoke
"""

import argparse
import copy
import statistics
import time

import _checkout  # noqa: F401  (this checkout's dtensor_moe on sys.path)
import torch

from dtensor_moe import MoE, MoEConfig
from dtensor_moe.train.config import ModelConfig
from dtensor_moe.train.metrics import write_json
from dtensor_moe.train.model import Block

SIZES = {  # name: (kind, config, tokens as (B, L))
    "block_d1024_e16_k2": ("block", ModelConfig(dim=1024, n_heads=16, num_experts=16, top_k=2, hidden_dim=1024,
                                                num_shared_experts=1), (8, 1024)),
    "moe_deepseek_like": ("moe", MoEConfig(dim=7168, hidden_dim=2048, num_experts=256, top_k=8, score_func="sigmoid",
                                           num_shared_experts=1), (1, 8192)),
    "tiny": ("block", ModelConfig(dim=64, n_heads=4, num_experts=8, top_k=2, hidden_dim=32,
                                  num_shared_experts=1), (2, 16)),
}


def build(kind, cfg, dev, dtype):
    torch.manual_seed(0)
    m = Block(cfg) if kind == "block" else MoE(cfg)
    return m.to(dev, dtype)


def timed_ms(fn, dev, iters, warmup):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        fn()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def bench(name, args, dev, dtype) -> dict:
    kind, cfg, (B, L) = SIZES[name]
    eager = build(kind, cfg, dev, dtype)
    compiled = copy.deepcopy(eager)
    dim = cfg.dim
    x = torch.randn(B, L, dim, device=dev, dtype=dtype)
    g = torch.randn(B, L, dim, device=dev, dtype=dtype)
    explained = torch._dynamo.explain(copy.deepcopy(eager))(x)
    torch._dynamo.reset()
    fn_c = torch.compile(compiled, fullgraph=True)
    row = {"name": name, "graphs": explained.graph_count, "graph_breaks": explained.graph_break_count}
    outs = {}
    for label, m, f in (("eager", eager, eager), ("compiled", compiled, fn_c)):
        xx = x.clone().requires_grad_(True)

        def step():
            m.zero_grad(set_to_none=True)
            xx.grad = None
            f(xx).backward(g)

        t0 = time.perf_counter()
        step()  # compiles on the first call
        row[f"{label}_first_call_s"] = time.perf_counter() - t0
        row[f"{label}_ms"] = timed_ms(step, dev, args.iters, args.warmup)
        outs[label] = (f(xx).detach().float(), xx.grad.float())
    row["speedup"] = row["eager_ms"] / row["compiled_ms"]
    if sum(p.numel() for p in eager.parameters()) > 5e8:  # an fp32 copy with gradients would not fit beside
        return row
    # Numerics: each bf16 run against a float32 copy of the same weights on the same inputs.
    ref_m = build(kind, cfg, dev, torch.float32)
    xr = x.float().requires_grad_(True)
    ref_m(xr).backward(g.float())
    ref = (ref_m(xr).detach(), xr.grad)
    for label in ("eager", "compiled"):
        for i, what in enumerate(("out", "xgrad")):
            row[f"{label}_rel_err_{what}_vs_fp32"] = ((outs[label][i] - ref[i]).abs().max() / ref[i].abs().max()).item()
    return row


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda")
    p.add_argument("--sizes", nargs="*", default=["block_d1024_e16_k2", "moe_deepseek_like"])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--out", default="compile_bench.json")
    args = p.parse_args()
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    rows = []
    for name in args.sizes:
        rows.append(bench(name, args, dev, dtype))
        r = rows[-1]
        errs = {k: f"{v:.1e}" for k, v in r.items() if k.endswith("vs_fp32")}
        print(
            f"{name:22s} graphs {r['graphs']} breaks {r['graph_breaks']}  eager {r['eager_ms']:8.2f} ms  "
            f"compiled {r['compiled_ms']:8.2f} ms  x{r['speedup']:.2f}  "
            f"(first call {r['compiled_first_call_s']:.1f} s) {errs}",
            flush=True,
        )
        torch._dynamo.reset()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    write_json(args.out, {"torch": torch.__version__, "device": str(dev) if dev.type != "cuda" else
                          torch.cuda.get_device_name(dev), "dtype": str(dtype), "rows": rows})


if __name__ == "__main__":
    main()
