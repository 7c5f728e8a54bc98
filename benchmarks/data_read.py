"""How fast a rank reads its batches from the main job's token cache (data.source = "files"), against how fast the
fastest GPU training step in RESULTS.md consumes tokens.

A .npy shard of random token ids goes through the real path: `token_cache.prepare` (the launcher's step: the cache
built, here a copy of the shard) and `load_data` (a rank's memory map), then `PackedBatches` of the GPU job's shape
(sequences of 1,024 tokens, global batch 32), as the loop calls it each step. Rows: the storage dtype (uint16 for a
vocabulary up to 65,536, int32 above: Qwen3's 151,936) times the ranks the batch is split over (1: the one-GPU job
reads the whole batch; 8: each rank its 4 sequences). `cold` is the first pass after the cache file's pages are
dropped from the page cache (posix_fadvise DONTNEED after fsync: reads from the disk), `warm` the same steps again,
both read back to back; `cold, prefetched` reads rank 0's share as training does, the GPU step's time (its tokens at
the fastest step's rate) slept between reads while the next step's pages are prefetched. tokens/s is the tokens one
rank receives per second of its reading (the median call's and the whole pass's); the ratio divides the median's by
the GPU step's tokens/s (per GPU). Prints a table and writes JSON (--out). Quote the load average with the numbers:
the machine is often shared.
"""

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import _checkout  # noqa: F401  (this checkout's dtensor_moe on sys.path, for the imports inside main)

# benchmarks/RESULTS.md, "torch.compile": `dtensor-moe train`, 445M MoE LM, one H200, 32k tokens a step, eager.
FASTEST_GPU_TOKENS_PER_S = 469_033
VOCABS = {"uint16": 32_000, "int32": 151_936}


def _drop_pages(path: str) -> None:
    """The file's pages out of the page cache, so the next read comes from the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _read_times(batches, steps: list[int]) -> tuple[list[float], list[float]]:
    """Wall and CPU seconds of each rank's read of each step (one process reads every rank's share in turn). On a
    shared machine the wall time also holds the wait for a CPU; the CPU time is the read's own cost (a cold read's
    wait for the disk is in the wall time alone)."""
    wall, cpu = [], []
    for step in steps:
        for b in batches:
            t0, c0 = time.perf_counter(), time.thread_time()
            b(step)
            wall.append(time.perf_counter() - t0)
            cpu.append(time.thread_time() - c0)
    return wall, cpu


def measure(tokens: int, dtype: str, ranks: int, steps: int, paced_steps: int, seq_len: int, global_batch: int,
            work: str) -> dict:
    import numpy as np

    from dtensor_moe.train import token_cache
    from dtensor_moe.train.config import load_config
    from dtensor_moe.train.data import PackedBatches, load_data
    from dtensor_moe.train.token_cache import prefetcher

    shard = os.path.join(work, f"{dtype}.npy")
    if not os.path.exists(shard):
        np.save(shard, np.random.default_rng(0).integers(0, VOCABS[dtype], tokens, dtype=np.int32))
    cfg = load_config(None, ["data.source=files", f'data.paths=["{shard}"]', f"model.vocab_size={VOCABS[dtype]}",
                             f"data.cache_dir={os.path.join(work, 'cache')}", f"training.seq_len={seq_len}",
                             f"training.global_batch={global_batch}", "model.max_seq_len=4096"])
    t0 = time.perf_counter()
    meta = token_cache.prepare(cfg, progress=False)
    build_s = time.perf_counter() - t0
    train, _, info = load_data(cfg)
    assert meta["dtype"] == dtype, meta["dtype"]
    # Each rank's batches as its loop makes them; one process reads for all of them in turn.
    batches = [PackedBatches(train, seq_len, global_batch, 0, r, ranks) for r in range(ranks)]
    cache = os.path.join(info["cache"], "tokens.bin")
    timed = list(range(1, steps + 1))
    for b in batches:
        b._perm(0)  # the epoch's permutation, drawn once an epoch, not part of a step's read
    _drop_pages(cache)
    cold, warm = _read_times(batches, timed), _read_times(batches, timed)
    # A rank's tokens a step over the time of its read: the median call (robust to other processes on a shared
    # machine), the mean (what a whole pass took), and the warm read's median CPU time.
    rank_tokens = global_batch // ranks * seq_len
    per_rank = {f"{name}_{stat}": rank_tokens / f(t) for name, t in (("cold", cold[0]), ("warm", warm[0]))
                for stat, f in (("median", statistics.median), ("mean", statistics.fmean))}
    per_rank["warm_cpu_median"] = rank_tokens / max(statistics.median(warm[1]), 1e-9)
    # As in training: rank 0 reads a step, then its GPU consumes those tokens at the fastest step's rate while the
    # next step's pages are prefetched (rank_batches' prefetcher); cold cache, steps not read above.
    gpu_s = rank_tokens / FASTEST_GPU_TOKENS_PER_S
    paced = PackedBatches(train, seq_len, global_batch, 0, 0, ranks, prefetch=prefetcher(info["cache"],
                                                                                        train.element_size()))
    _drop_pages(cache)
    paced_times = []
    for step in range(steps + 1, steps + 1 + paced_steps):
        t0 = time.perf_counter()
        paced(step)
        paced_times.append(time.perf_counter() - t0)
        time.sleep(gpu_s)
    per_rank["cold_prefetched_median"] = rank_tokens / statistics.median(paced_times[1:])  # the first: no prefetch
    per_rank["cold_prefetched_mean"] = rank_tokens / statistics.fmean(paced_times[1:])
    return {"dtype": dtype, "vocab": VOCABS[dtype], "ranks": ranks, "cache_tokens": info["train_tokens"],
            "cache_mib": os.path.getsize(os.path.join(info["cache"], "tokens.bin")) / 2**20, "steps": steps,
            "seq_len": seq_len, "global_batch": global_batch, "build_s": build_s,
            "tokens_per_s_per_rank": per_rank,
            "x_fastest_gpu_step": {k: v / FASTEST_GPU_TOKENS_PER_S for k, v in per_rank.items()}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1 << 26, help="tokens in the cache (default 67M)")
    ap.add_argument("--steps", type=int, default=200, help="steps read per pass")
    ap.add_argument("--paced-steps", type=int, default=40, help="steps read with the GPU step's time between them")
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--dtypes", nargs="+", default=list(VOCABS), choices=list(VOCABS))
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--global-batch", type=int, default=32)
    ap.add_argument("--out", default=None, help="JSON file for the results")
    a = ap.parse_args(argv)
    import torch

    rows = []
    with tempfile.TemporaryDirectory(prefix="data_read.") as work:
        for dtype in a.dtypes:
            for ranks in a.ranks:
                rows.append(measure(a.tokens, dtype, ranks, a.steps, a.paced_steps, a.seq_len, a.global_batch, work))
    load = os.getloadavg()[0]
    print(f"token cache reads, {a.steps} steps of {a.global_batch} x {a.seq_len} tokens, "
          f"{rows[0]['cache_tokens']:,} tokens cached; fastest GPU step {FASTEST_GPU_TOKENS_PER_S:,} tokens/s "
          f"(load {load:.1f}, torch threads {torch.get_num_threads()})")
    print("| dtype (vocab) | ranks | cache MiB | tokens/s a rank (median call / pass): cold | warm | cold, prefetched "
          "during the GPU step | warm, per CPU second (median) | x GPU step: cold | warm | cold, prefetched | "
          "warm CPU |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    kinds = ("cold", "warm", "cold_prefetched")
    for r in rows:
        t, x = r["tokens_per_s_per_rank"], r["x_fastest_gpu_step"]
        cells = [f"{t[k + '_median']:,.0f} / {t[k + '_mean']:,.0f}" for k in kinds] + [f"{t['warm_cpu_median']:,.0f}"]
        ratios = [f"{x[k + '_median']:.0f}x" for k in kinds] + [f"{x['warm_cpu_median']:.0f}x"]
        print(f"| {r['dtype']} ({r['vocab']:,}) | {r['ranks']} | {r['cache_mib']:.0f} | {' | '.join(cells)} | "
              f"{' | '.join(ratios)} |")
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump({"machine": {"cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                                   "load_average_1min": load, "torch": torch.__version__},
                       "fastest_gpu_tokens_per_s": FASTEST_GPU_TOKENS_PER_S, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
