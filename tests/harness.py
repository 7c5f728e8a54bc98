"""Multi-rank test harness: pools of gloo CPU worker processes, reused across test cases.

`run_on_ranks(n, fn, *args)` runs the module-level function `fn(rank, world_size, *args)` on
every rank of an n-rank pool and returns the per-rank results. Pools stay alive for the whole
pytest session, so hypothesis can draw hundreds of cases without paying process start-up each
time. If every rank raised the same exception type, rank 0's exception is re-raised (so
`pytest.raises` works); any other failure or a timeout kills the pool and raises RankFailure.
"""

import os
import queue
import socket
import traceback

import torch.multiprocessing as mp

TIMEOUT_S = float(os.environ.get("DTENSOR_MOE_TEST_TIMEOUT", "180"))


class RankFailure(RuntimeError):
    pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, tasks, results):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args = task
        try:
            results.put((rank, True, fn(rank, world_size, *args)))
        except BaseException as e:  # noqa: BLE001 - shipped back to the test process
            results.put((rank, False, (e, traceback.format_exc())))
    dist.destroy_process_group()


class RankPool:
    def __init__(self, world_size: int):
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        self.results = ctx.Queue()
        port = _free_port()
        self.procs = [
            ctx.Process(target=_worker, args=(r, world_size, port, self.tasks[r], self.results), daemon=True)
            for r in range(world_size)
        ]
        for p in self.procs:
            p.start()

    def run(self, fn, *args):
        for q in self.tasks:
            q.put((fn, args))
        out, errors = [None] * self.world_size, {}
        for _ in range(self.world_size):
            try:
                rank, ok, payload = self.results.get(timeout=TIMEOUT_S)
            except queue.Empty:
                self.kill()
                raise RankFailure(f"timeout after {TIMEOUT_S}s; rank errors so far: {_fmt(errors)}") from None
            if ok:
                out[rank] = payload
            else:
                errors[rank] = payload
        if errors:
            types = {type(e) for e, _ in errors.values()}
            if len(errors) == self.world_size and len(types) == 1:
                raise errors[0][0]
            self.kill()
            raise RankFailure(_fmt(errors))
        return out

    def kill(self):
        for p in self.procs:
            if p.is_alive():
                p.kill()
        _POOLS.pop(self.world_size, None)

    def close(self):
        for q in self.tasks:
            q.put(None)
        for p in self.procs:
            p.join(timeout=10)
        self.kill()


def _fmt(errors) -> str:
    return "\n".join(f"--- rank {r} ---\n{tb}" for r, (_, tb) in sorted(errors.items()))


_POOLS: dict[int, RankPool] = {}


def run_on_ranks(world_size: int, fn, *args):
    if world_size not in _POOLS:
        _POOLS[world_size] = RankPool(world_size)
    return _POOLS[world_size].run(fn, *args)


def close_all():
    for pool in list(_POOLS.values()):
        pool.close()
