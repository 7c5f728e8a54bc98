"""Issue 29's done-when for hot-expert replicas: rows per EP rank (max / mean) under Zipf-skewed routing, measured on
CPU gloo ranks without replicas and with `expert_replicas`, float64 parity against one process in both, and
`dtensor-moe plan --skew`'s prediction of the same figures beside them.

    .venv/bin/python benchmarks/replica_balance.py --out benchmarks/results/2026-12-03

`--ep` ranks (all of them EP ranks), E experts, each rank routing `--tokens-per-rank` tokens of every batch with
benchmarks/routing.py's skewed routing (the tests' Case.zipf: a seeded shuffle of the expert ids, weights
1 / rank ** zipf, top_k distinct experts a token, the batch's seed its index): the router is the identity on
features whose chosen experts stand far above the rest, so it picks exactly those. Each rank holds two layers
with the same weights, one without replicas and one with `--replicas` slots re-placed every training forward
(replica_replan_every 1): batch 0 runs with slots placed from its own counts, every later batch with slots placed
from the previous batch's. Rows per EP rank are the layer's `expert_parallel.load.last` after each forward; parity is
the max |difference| of the output, the input gradient and every parameter gradient (each rank's shard against its
box of the reference gradient), over the ranks. The folding search's figure is `folding.balance` on the same E, top_k,
ep, tokens per EP group and zipf: the expected counts, replicas placed from them (the measurement samples the
counts and places from the previous batch's).
"""

import argparse
import json
import math
import os
import socket
import sys
import time

import _checkout  # noqa: F401  (this checkout's dtensor_moe on sys.path)
import routing  # noqa: E402
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dtensor_moe import MoE, MoEConfig, MoEParallelDims, MoERunOptions, owned_box, parallelize_moe, plan_moe
from dtensor_moe.tools import folding

TARGET = 1.15  # issue 29: max / mean rows per EP rank with replicas
PARITY_TOL = 1e-10  # tests/test_parity.py's: float64 sums in another order


def _routed_batch(E: int, K: int, T: int, zipf: float, seed: int) -> torch.Tensor:
    """[T, E] float64 inputs whose top-K features are the skewed routing's choices (tests/parity.py's trick)."""
    g = torch.Generator().manual_seed(1000 + seed)
    x = torch.randn(T, E, generator=g, dtype=torch.float64) * 0.01
    experts_TK = routing.expert_choices_TK("skewed", T, E, K, seed, zipf)
    return x.scatter_add_(1, experts_TK, torch.arange(K, 0, -1, dtype=x.dtype).expand(T, K) + 3)


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item() if a.numel() else 0.0


def measure_rank(rank: int, world: int, args, K: int) -> list[dict]:
    """This rank's part of one top_k's run (the default group: `world` gloo ranks, all EP): per batch and layer,
    rows per EP rank and the worst parity errors over the ranks."""
    E, T = args.experts, args.tokens_per_rank
    cfg = MoEConfig(dim=E, hidden_dim=args.hidden_dim, num_experts=E, top_k=K)
    dims = MoEParallelDims(world, ep=world)
    ref = MoE(cfg).to(torch.float64)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.5)
        ref.router.gate.weight.copy_(torch.eye(E, dtype=torch.float64))  # routing reads the features
    layers = {}
    for r in (0, args.replicas):
        layer = MoE(cfg, MoERunOptions(expert_replicas=r, replica_replan_every=1)).to(torch.float64)
        layer.load_state_dict(ref.state_dict())
        layers[r] = parallelize_moe(layer, dims, device_type="cpu")
    planned = {wp.name: wp for wp in plan_moe(cfg, dims)}
    mine = slice(rank * T, (rank + 1) * T)
    out = []
    for batch in range(args.batches):
        x = _routed_batch(E, K, world * T, args.zipf, batch)
        grad_out = torch.randn(world * T, E, generator=torch.Generator().manual_seed(2000 + batch),
                               dtype=torch.float64)
        ref.zero_grad()
        x_ref = x.clone().requires_grad_(True)
        y_ref = ref(x_ref)
        # One process, the whole batch; the data-parallel loss is the mean over the ranks of each rank's loss.
        ((y_ref * grad_out).sum() / world).backward()
        y_ref = y_ref.detach()
        for r, layer in layers.items():
            layer.zero_grad()
            x_r = x[mine].clone().requires_grad_(True)
            y_r = layer(x_r)
            (y_r * grad_out[mine]).sum().backward()
            errs = [_err(y_r.detach(), y_ref[mine]), _err(x_r.grad, x_ref.grad[mine] * world)]
            for name, p in layer.named_parameters():
                errs.append(_err(p.grad.to_local(), ref.get_parameter(name).grad[owned_box(planned[name], dims, rank)]))
            worst = torch.tensor(errs, dtype=torch.float64)
            dist.all_reduce(worst, dist.ReduceOp.MAX)
            rows = layer.experts.expert_parallel.load.last
            out.append({"replicas": r, "batch": batch, "rows_per_rank": rows,
                        "max_abs_err_out": worst[0].item(), "max_abs_err_grad": worst[1:].max().item()})
    return out


def _spawned(rank: int, world: int, port: int, args, K: int, queue) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.set_num_threads(1)  # 8 ranks on a few cores
    out = measure_rank(rank, world, args, K)
    if rank == 0:
        queue.put(out)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(args, K: int) -> list[dict]:
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_spawned, args=(args.ep, _free_port(), args, K, queue), nprocs=args.ep)
    return queue.get()


def results(args, K: int, measured: list[dict]) -> list[dict]:
    """The measured rows with the folding search's prediction beside them."""
    predicted = folding.balance(args.experts, K, args.ep, args.ep * args.tokens_per_rank, args.zipf, args.replicas)
    out = []
    for m in measured:
        rows, ratio = ((predicted.replica_rows, predicted.replica_imbalance) if m["replicas"]
                       else (predicted.rows, predicted.imbalance))
        out.append({"top_k": K, **m, "max_over_mean": folding.max_over_mean(m["rows_per_rank"]),
                    "predicted_rows_per_rank": list(rows), "predicted_max_over_mean": ratio})
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--ep", type=int, default=8, help="gloo ranks, all of them EP ranks")
    p.add_argument("--top-k", type=int, nargs="+", default=[2, 4], help="a row group per top_k")
    p.add_argument("--tokens-per-rank", type=int, default=128)
    p.add_argument("--hidden-dim", type=int, default=4, help="experts' hidden dim (small: the rows are the point)")
    p.add_argument("--zipf", type=float, default=1.2)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--batches", type=int, default=3, help="batch 0 placed from its own counts, later ones from "
                   "the previous batch's")
    p.add_argument("--out", default=None, help="folder for replica_balance.json")
    return p


def main() -> int:
    args = parser().parse_args()
    ours, theirs = folding.popularity(args.experts, args.zipf), routing.popularity_E(args.experts, args.zipf).tolist()
    assert all(math.isclose(a, b, rel_tol=1e-12) for a, b in zip(ours, theirs)), "the search's popularity is routing's"
    t0 = time.perf_counter()
    rows = [r for K in args.top_k for r in results(args, K, measure(args, K))]
    elapsed = time.perf_counter() - t0
    print(f"E={args.experts} EP={args.ep} (CPU gloo), {args.tokens_per_rank} tokens a rank, skewed routing zipf "
          f"{args.zipf:g}, float64; {elapsed:.0f} s")
    print("| top_k | replicas | batch (slots from) | rows per EP rank | max/mean measured | predicted "
          "| max abs err out / grads |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        placed = "" if not r["replicas"] else " (own counts)" if r["batch"] == 0 else f" (batch {r['batch'] - 1})"
        print(f"| {r['top_k']} | {r['replicas']} | {r['batch']}{placed} | {r['rows_per_rank']} | "
              f"{r['max_over_mean']:.3f} | {r['predicted_max_over_mean']:.3f} | "
              f"{r['max_abs_err_out']:.1e} / {r['max_abs_err_grad']:.1e} |")
    parity = max(max(r["max_abs_err_out"], r["max_abs_err_grad"]) for r in rows)
    met = {f"top_k {K}": max(r["max_over_mean"] for r in rows if r["replicas"] and r["top_k"] == K) <= TARGET
           for K in args.top_k}
    print(f"with {args.replicas} replicas max/mean <= {TARGET}: "
          + ", ".join(f"{k} {'PASS' if v else 'FAIL'}" for k, v in met.items())
          + f"; parity: max abs err {parity:.1e} over every output and gradient (tolerance {PARITY_TOL:g})")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "replica_balance.json"), "w") as f:
            json.dump({"experts": args.experts, "ep": args.ep, "tokens_per_rank": args.tokens_per_rank,
                       "hidden_dim": args.hidden_dim, "zipf": args.zipf, "replicas": args.replicas,
                       "dtype": "float64", "backend": "gloo (CPU)", "target_with_replicas": TARGET,
                       "target_met": met, "max_abs_err": parity, "elapsed_s": elapsed, "rows": rows}, f, indent=1)
    return 0 if all(met.values()) and parity <= PARITY_TOL else 1


if __name__ == "__main__":
    sys.exit(main())
