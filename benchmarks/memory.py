"""Per-rank memory of one MoE layer's training step: EP-only vs EP+EDP vs EDP-only, same world size.

    torchrun --nproc-per-node 2 benchmarks/memory.py --out memory.json                 # GPUs: peaks too
    torchrun --nproc-per-node 4 benchmarks/memory.py --device cpu --out memory4.json   # gloo: bytes only

Over W ranks with expert-parallel degree `--ep`:
  ep_only:  dp_replicate = W/ep, ep     (experts replicated over the rest: edp = 1)
  ep_edp:   ep, edp = W/ep              (FSDP2 over the expert-data-parallel ranks)
  edp_only: edp = W                     (no EP: every rank gathers every expert)
Bytes are of the tensors each rank holds (local shards) after one AdamW step: parameters, gradients,
optimizer state; on CUDA also the peak allocated during the step. Target (the issue):
ep_edp param+grad+optimizer bytes <= ep_only bytes / edp * 1.05. It needs W >= 2*ep (else ep_edp
is ep_only and is skipped).
"""

import argparse

import _checkout  # noqa: F401  (this checkout's dtensor_moe on sys.path)
import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy

from dtensor_moe import MoE, MoEConfig, MoEParallelDims, parallelize_moe
from dtensor_moe.train.metrics import local_state_bytes, write_json
from dtensor_moe.train.optim import build_optimizer

TARGET_SLACK = 1.05


def layouts(world: int, ep: int) -> dict:
    if world % ep:
        raise ValueError(f"--ep {ep} must divide the world size {world}; valid: "
                         f"{[d for d in range(1, world + 1) if world % d == 0]}")
    out = {"ep_only": dict(dp_replicate=world // ep, ep=ep)}
    if world // ep > 1:
        out["ep_edp"] = dict(ep=ep)
    out["edp_only"] = {}
    return out


def measure(cfg, layout: dict, world, T, dev) -> dict:
    dims = MoEParallelDims(world, **layout)
    torch.manual_seed(0)
    with torch.device(dev):
        moe = MoE(cfg)
    # On GPUs, compute in bf16 (the grouped GEMM kernel) with fp32 master weights and reductions.
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if dev.type == "cuda" else None
    parallelize_moe(moe, dims, device_type=dev.type, mp_policy=mp)
    opt = build_optimizer(moe, lr=1e-3, weight_decay=0.0)
    torch.manual_seed(1 + dist.get_rank())
    x = torch.randn(1, T, cfg.dim, device=dev)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
    moe(x).float().square().mean().backward()
    opt.step()
    state = local_state_bytes(moe, opt)
    out = {
        "dims": {"dp_replicate": dims.dp_replicate, "edp": dims.edp, "ep": dims.ep, "etp": dims.etp},
        "param_bytes": state["params"],
        "grad_bytes": state["grads"],
        "optim_bytes": state["optimizer"],
    }
    out["total_bytes"] = out["param_bytes"] + out["grad_bytes"] + out["optim_bytes"]
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        out["peak_step_bytes"] = torch.cuda.max_memory_allocated(dev)
        out["peak_above_start_bytes"] = out["peak_step_bytes"] - base
    del moe, opt
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return out


def gather_max(d: dict) -> dict:
    """Worst rank's value of every byte count (ranks can differ when shards are uneven)."""
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, d)
    return {k: (max(r[k] for r in per_rank) if k.endswith("bytes") else v) for k, v in d.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--shape", nargs=4, type=int, default=[2048, 768, 128, 8], metavar=("D", "F", "E", "K"))
    ap.add_argument("--tokens", type=int, default=16384, help="tokens per rank")
    ap.add_argument("--ep", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda needs a GPU; use --device cpu (gloo)")
    D, F, E, K = args.shape
    cfg = MoEConfig(dim=D, hidden_dim=F, num_experts=E, top_k=K)
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    plans = layouts(world, args.ep)  # validated before any collective
    dev = torch.device(f"cuda:{rank}") if args.device == "cuda" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    results = {name: gather_max(measure(cfg, layout, world, args.tokens, dev)) for name, layout in plans.items()}
    if rank == 0:
        res = {"torch": torch.__version__, "device": dev.type, "world": world, "shape": args.shape,
               "tokens_per_rank": args.tokens, "layouts": results}
        if "ep_edp" in results:
            edp = results["ep_edp"]["dims"]["edp"]
            bound = results["ep_only"]["total_bytes"] / edp * TARGET_SLACK
            res["target"] = {"ep_edp_total_bytes": results["ep_edp"]["total_bytes"], "bound_bytes": bound,
                             "ratio_to_ep_only_over_edp": results["ep_edp"]["total_bytes"] * edp
                             / results["ep_only"]["total_bytes"],
                             "ok": results["ep_edp"]["total_bytes"] <= bound}
        print(f"torch {res['torch']} {dev.type} world {world} shape D,F,E,K={args.shape} T/rank={args.tokens}")
        print("| layout | dp_rep | edp | ep | params MiB | grads MiB | optim MiB | total MiB | step peak MiB |")
        print("|---|---|---|---|---|---|---|---|---|")
        mib = 2**20
        for name, r in results.items():
            peak = f"{r['peak_step_bytes'] / mib:.0f}" if "peak_step_bytes" in r else "-"
            d = r["dims"]
            print(
                f"| {name} | {d['dp_replicate']} | {d['edp']} | {d['ep']} | {r['param_bytes'] / mib:.1f} | "
                f"{r['grad_bytes'] / mib:.1f} | {r['optim_bytes'] / mib:.1f} | {r['total_bytes'] / mib:.1f} | {peak} |"
            )
        if "target" in res:
            t = res["target"]
            print(f"target ep_edp total <= ep_only / edp * {TARGET_SLACK}: ratio {t['ratio_to_ep_only_over_edp']:.4f} "
                  f"-> {'PASS' if t['ok'] else 'MISS'}")
        write_json(args.out, res)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
