"""What a mesh's size-1 axes cost DTensor's sharding propagation (CPU, one process, no communication).

    python benchmarks/sharding_prop.py [--repeats 5] [--json benchmarks/results/2026-12-02/sharding_prop.json]

An in-place add of two expert-weight-shaped DTensors (a gradient accumulating into .grad), placed as the
plan places compiled layers' in-graph weights, on the same ranks with and without the size-1 axes: CPU
seconds of the first (uncached) propagation, median over repeats (the cache is cleared before each).
A fake process group of 8 ranks stands in for the world (a 4-rank mesh takes its first 4): propagation never
communicates.
"""

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import _clear_sharding_prop_cache
from torch.testing._internal.distributed.fake_pg import FakeStore

# (name, mesh shape, axis names, placements): EDP2 x EP2 x ETP2 with dp_replicate = 1, and HSDP2 x EP2 x ETP2.
CASES = [
    ("EDP2 x EP2 x ETP2, 4-D (dp_replicate 1)", (1, 2, 2, 2), ("dp_replicate", "ep", "etp", "edp"),
     [Replicate(), Shard(0), Shard(1), Shard(0)]),
    ("EDP2 x EP2 x ETP2, size-1 axes left out", (2, 2, 2), ("ep", "etp", "edp"), [Shard(0), Shard(1), Shard(0)]),
    ("EDP2 x EP2, 4-D (dp_replicate 1, etp 1)", (1, 2, 1, 2), ("dp_replicate", "ep", "etp", "edp"),
     [Replicate(), Shard(0), Replicate(), Shard(0)]),
    ("EDP2 x EP2, size-1 axes left out", (2, 2), ("ep", "edp"), [Shard(0), Shard(0)]),
    ("HSDP2 x EP2 x ETP2, 4-D (edp 1)", (2, 2, 2, 1), ("dp_replicate", "ep", "etp", "edp"),
     [Replicate(), Shard(0), Shard(1), Replicate()]),
    ("HSDP2 x EP2 x ETP2, size-1 axes left out", (2, 2, 2), ("dp_replicate", "ep", "etp"),
     [Replicate(), Shard(0), Shard(1)]),
]


def first_add_cpu_s(shape, names, placements, repeats: int) -> float:
    mesh = DeviceMesh("cpu", torch.arange(math.prod(shape)).view(shape), mesh_dim_names=names)
    w = distribute_tensor(torch.zeros(8, 16, 8), mesh, placements, src_data_rank=None)
    g = distribute_tensor(torch.ones(8, 16, 8), mesh, placements, src_data_rank=None)
    times = []
    for _ in range(repeats):
        _clear_sharding_prop_cache()
        t = time.process_time()
        w.add_(g)
        times.append(time.process_time() - t)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    rows = [{"case": name, "mesh": list(shape), "first_add_cpu_s": first_add_cpu_s(shape, names, pl, args.repeats)}
            for name, shape, names, pl in CASES]
    dist.destroy_process_group()
    print(f"torch {torch.__version__}, median of {args.repeats}\n")
    print("| mesh | shape | first add_ (CPU s) |\n|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {tuple(r['mesh'])} | {r['first_add_cpu_s']:.4f} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps({"torch": torch.__version__, "repeats": args.repeats, "rows": rows}, indent=1) + "\n"
        )


if __name__ == "__main__":
    main()
