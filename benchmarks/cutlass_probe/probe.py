"""Issue 27 probe: CUTLASS grouped GEMMs built as torch's are, with what torch does not expose (grouped.cu):
the weight gradient added into .grad in the epilogue (beta = 1), and the row-ragged forward with its 2-CTA
clusters along the columns (N) instead of the rows (M), so that no expert's rows are rounded up to 256.

    # CUTLASS's headers (include/, tools/util/include/) in .cutlass/ (git-ignored, 29 MB: carried to the device)
    nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -shared -Xcompiler -fPIC \
        -I.cutlass/include -I.cutlass/tools/util/include -o grouped.so benchmarks/cutlass_probe/grouped.cu
    python benchmarks/cutlass_probe/smoke.py grouped.so   # loads and adds correctly on this GPU
    python benchmarks/cutlass_probe/probe.py --lib grouped.so --out cutlass_probe.json   # one H200

Each result is checked against torch (relative Frobenius error on the first 8 experts) before it is timed
(CUDA-event medians). Counts: top-k of random logits (ragged_gemm_probe.counts_for), and rounded to 128.
"""

import ctypes
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from expert_gemms import cuda_ms, probe_cli, rel  # noqa: E402
from ragged_gemm_probe import SHAPES, counts_for  # noqa: E402

from dtensor_moe.kernels import policy, wgrad  # noqa: E402

KINDS = {"wgrad cluster 2x1": 0, "wgrad cluster 1x2": 1, "fwd cluster 2x1": 2, "fwd cluster 1x2": 3,
         "dgrad cluster 2x1": 4, "dgrad cluster 1x2": 5}


def load(path: str) -> ctypes.CDLL:
    """grouped.so with its one entry point's C signature: grouped_gemm(kind, a, b, d, ends, E, O, I, alpha, beta,
    SM count, stream) -> 0 or a negative step that failed."""
    lib = ctypes.CDLL(path)
    lib.grouped_gemm.restype = ctypes.c_int
    lib.grouped_gemm.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 4 + [ctypes.c_int] * 3 + [ctypes.c_float] * 2 + [
        ctypes.c_int, ctypes.c_void_p]
    return lib


def main():
    shapes = {k: SHAPES[k] for k in ("deepseek", "mixtral", "e64")}
    args, dev, res = probe_cli(__doc__, shapes, (("--lib",), {"required": True}),
                               (("--row-gemms-only",), {"action": "store_true",
                                                        "help": "the forward and input-gradient GEMMs only"}))
    lib = load(args.lib)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count

    def cutlass(kind, a, b, d, ends, E, O, I, alpha, beta):
        rc = lib.grouped_gemm(KINDS[kind], a.data_ptr(), b.data_ptr(), d.data_ptr(), ends.data_ptr(), E, O, I, alpha,
                              beta, sms, torch.cuda.current_stream().cuda_stream)
        if rc:
            raise RuntimeError(f"{kind}: rc {rc}")

    rows = res["rows"] = []

    def record(**r):
        rows.append(r)
        print(json.dumps(r), flush=True)

    def timed(key, fn, flops, check=None):
        try:
            fn()
            err = None if check is None else check()
            t = cuda_ms(fn)
        except Exception as e:  # noqa: BLE001 - a kernel that fails is recorded, the others still run
            record(**key, error=str(e)[:300])
            return
        record(**key, ms=t, tflops=flops / t / 1e9, rel_err=err)

    def row_gemm(name, mode, gemm, ends, E, I, O):
        """y [N, O] = x [N, I] @ W_e: fwd takes W_e = w[e]^T of w [E, O, I] (w13, w2 as stored), dgrad W_e = w[e]
        of w [E, I, O]."""
        N = int(ends[-1])
        x = torch.randn(N, I, device=dev, dtype=torch.bfloat16)
        shape = (E, O, I) if gemm.startswith("fwd") else (E, I, O)
        w = torch.randn(*shape, device=dev, dtype=torch.bfloat16) * 0.02
        w_op = w.transpose(-2, -1) if gemm.startswith("fwd") else w
        want = torch._grouped_mm(x, w_op, offs=ends).float()
        y = torch.empty(N, O, device=dev, dtype=torch.bfloat16)
        key = dict(shape=name, counts=mode, gemm=gemm)
        flops = 2 * N * I * O
        timed({**key, "method": "torch._grouped_mm"}, lambda: torch._grouped_mm(x, w_op, offs=ends), flops)
        for kind in [k for k in KINDS if k.startswith(gemm.split()[0])]:
            timed({**key, "method": kind}, lambda kind=kind: cutlass(kind, x, w, y, ends, E, O, I, 1.0, 0.0),
                  flops, lambda: rel(y, want))

    def weight_grad(name, mode, gemm, x, ends, E, O, I):  # .grad [E, O, I] += 0.5 * g^T a
        N = x.shape[0]
        g = torch.randn(N, O, device=dev, dtype=torch.bfloat16)
        a = x if I == x.shape[1] else torch.randn(N, I, device=dev, dtype=torch.bfloat16)
        out0 = torch.randn(E, O, I, device=dev, dtype=torch.bfloat16)
        E8 = min(E, 8)
        ref = out0[:E8].float() + 0.5 * torch._grouped_mm(g.t(), a, offs=ends)[:E8].float()  # first 8: memory
        out = out0.clone()
        key = dict(shape=name, counts=mode, gemm=gemm)
        flops = 2 * N * O * I
        timed({**key, "method": "fresh torch._grouped_mm"}, lambda: torch._grouped_mm(g.t(), a, offs=ends), flops)
        cfg = policy.wgrad_config(out.shape, N)
        out.copy_(out0)
        timed({**key, "method": f"triton {tuple(cfg)}"}, lambda: wgrad.accumulate(out, g, a, ends, 0.5, cfg), flops,
              lambda: rel(out[:E8], ref))
        for kind in ("wgrad cluster 2x1", "wgrad cluster 1x2"):
            out.copy_(out0)
            timed({**key, "method": kind}, lambda kind=kind: cutlass(kind, g, a, out, ends, E, O, I, 0.5, 1.0), flops,
                  lambda: rel(out[:E8], ref))

    for name in args.shapes:
        D, F, E, K, T = SHAPES[name]
        for mode in ("topk", "round128"):
            ends = torch.cumsum(counts_for(mode, T, E, K, dev), 0).to(torch.int32)
            for gemm, I, O in (("fwd w13", D, 2 * F), ("fwd w2", F, D), ("dgrad w13", 2 * F, D), ("dgrad w2", D, F)):
                row_gemm(name, mode, gemm, ends, E, I, O)
                torch.cuda.empty_cache()
            if args.row_gemms_only:
                continue
            x = torch.randn(int(ends[-1]), D, device=dev, dtype=torch.bfloat16)
            for gemm, O, I in (("wgrad w13", 2 * F, D), ("wgrad w2", D, F)):
                weight_grad(name, mode, gemm, x, ends, E, O, I)
                torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
