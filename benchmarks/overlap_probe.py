"""Can the expert-parallel all-to-all run beside the weight-gradient GEMMs, and does an SM carveout help?

    torchrun --nproc-per-node 2 benchmarks/overlap_probe.py --out overlap.json

At the DeepSeek E256 EP=2 backward shape (65,536 routed rows, D 7168, F 2048, 128 local experts):
the input-gradient all-to-all is launched async, then the three weight-gradient GEMMs run, either
as the grouped kernel or as per-expert addmm_ into .grad (gradient accumulation; in both output
orientations, and with cuBLASLt preferred). Prints the median
ms of each alone and of both together, for several `torch._C._set_sm_carveout_experimental` values
(SMs the GEMMs leave free for NCCL), and writes JSON. `overlap` = (alone sum - together) / a2a alone.
"""

import argparse
import os

import torch
import torch.distributed as dist
from moe_layer import host_timed_ms

from dtensor_moe.experts import accumulate_weight_grad, grouped_weight_grad
from dtensor_moe.train.metrics import write_json


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", type=int, nargs=4, default=[7168, 2048, 128, 65536], metavar=("D", "F", "E", "N"))
    ap.add_argument("--carveouts", type=int, nargs="*", default=[0, 16])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    D, F, E, N = args.shape
    counts = [N // E] * E
    counts[-1] += N - sum(counts)
    offs = torch.tensor(counts, device=dev).cumsum(0).to(torch.int32)
    x_ND = torch.randn(N, D, device=dev, dtype=torch.bfloat16)
    g_NF = torch.randn(N, F, device=dev, dtype=torch.bfloat16)
    dx_ND, out_ND = torch.empty_like(x_ND), torch.empty_like(x_ND)
    grads = [torch.zeros(E, F, D, device=dev, dtype=torch.bfloat16) for _ in range(3)]
    grads_T = [g.view(E, D, F) for g in grads]

    def wgrad_grouped():
        for _ in range(3):
            grouped_weight_grad(g_NF, x_ND, offs)

    def wgrad_addmm():  # w1/w3's orientation: [E, F, D] outputs
        for out in grads:
            accumulate_weight_grad(out, g_NF, x_ND, counts, 1.0)

    def wgrad_addmm_T():  # w2's orientation: [E, D, F] outputs
        for out in grads_T:
            accumulate_weight_grad(out, x_ND, g_NF, counts, 1.0)

    def wgrad_addmm_split(parts, dim):
        def run():  # the same sums as wgrad_addmm, in `parts` column (dim -1) or row (dim -2) blocks
            for out in grads:
                xs = x_ND.chunk(parts, -1) if dim == -1 else [x_ND] * parts
                gs = g_NF.chunk(parts, -1) if dim == -2 else [g_NF] * parts
                for o, g, x in zip(out.chunk(parts, dim), gs, xs):
                    accumulate_weight_grad(o, g, x, counts, 1.0)
        return run

    gT_FN, xT_DN = g_NF.t().contiguous(), x_ND.t().contiguous()

    def wgrad_addmm_layout(g_cols: bool, x_cols: bool):
        """Same sums with the operands stored transposed (feature-major), so cuBLAS sees other op flags."""
        g_NF_, x_ND_ = (gT_FN.t() if g_cols else g_NF), (xT_DN.t() if x_cols else x_ND)

        def run():
            for out in grads:
                accumulate_weight_grad(out, g_NF_, x_ND_, counts, 1.0)
        return run

    def wgrad_addmm_lt():
        torch.backends.cuda.preferred_blas_library("cublaslt")
        wgrad_addmm()
        torch.backends.cuda.preferred_blas_library("default")

    def a2a():
        return dist.all_to_all_single(out_ND, dx_ND, async_op=True)

    def together(wgrad):
        def run():
            work = a2a()
            wgrad()
            work.wait()
        return run

    carve = getattr(torch._C, "_set_sm_carveout_experimental", None)
    rows = []
    a2a_ms = host_timed_ms(lambda: a2a().wait(), dev, args.iters, 2)
    for c in args.carveouts:
        if c and carve is None:
            continue
        if carve is not None:
            carve(c or None)
        for name, wgrad in (("grouped", wgrad_grouped), ("addmm_EFD", wgrad_addmm), ("addmm_EDF", wgrad_addmm_T),
                            ("addmm_EFD_cublaslt", wgrad_addmm_lt), ("addmm_EFD_D/2", wgrad_addmm_split(2, -1)),
                            ("addmm_EFD_D/4", wgrad_addmm_split(4, -1)), ("addmm_EFD_F/2", wgrad_addmm_split(2, -2)),
                            ("addmm_EFD_gT", wgrad_addmm_layout(True, False)),
                            ("addmm_EFD_xT", wgrad_addmm_layout(False, True)),
                            ("addmm_EFD_gT_xT", wgrad_addmm_layout(True, True))):
            alone = host_timed_ms(wgrad, dev, args.iters, 2)
            both = host_timed_ms(together(wgrad), dev, args.iters, 2)
            rows.append({"carveout": c, "wgrad": name, "a2a_ms": a2a_ms, "wgrad_ms": alone, "together_ms": both,
                         "overlap": (a2a_ms + alone - both) / a2a_ms})
    if carve is not None:
        carve(None)
    if rank == 0:
        print(f"NCCL_P2P_USE_CUDA_MEMCPY={os.environ.get('NCCL_P2P_USE_CUDA_MEMCPY')}", end=" ")
        print(f"D={D} F={F} E={E} N={N}; all-to-all alone {a2a_ms:.2f} ms ({N * D * 2 / 2 / a2a_ms / 1e6:.0f} GB/s to the peer)")
        print("| carveout | wgrad | wgrad ms | together ms | overlap |\n|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['carveout']} | {r['wgrad']} | {r['wgrad_ms']:.2f} | {r['together_ms']:.2f} | {r['overlap']:.2f} |")
        write_json(args.out, {"torch": torch.__version__, "shape": args.shape, "rows": rows,
                              "NCCL_P2P_USE_CUDA_MEMCPY": os.environ.get("NCCL_P2P_USE_CUDA_MEMCPY")})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
