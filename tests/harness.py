"""Multi-rank test harness: pools of gloo CPU worker processes, reused across test cases.

`run_on_ranks(n, fn, *args)` runs the module-level function `fn(rank, world_size, *args)` on
every rank of an n-rank pool and returns the per-rank results. Pools stay alive for the whole
pytest session, so hypothesis can draw hundreds of cases without paying process start-up each
time. If every rank raised the same exception type, rank 0's exception is re-raised (so
`pytest.raises` works); any other failure or a timeout kills the pool and raises RankFailure.

Every task starts from the same worker state: only the default (world) process group. After each
task the worker destroys every process group the task created (the DeviceMesh subgroups of each
drawn mesh folding: gloo groups, each with its own threads), empties dtensor_moe's mesh cache
(which would otherwise keep those groups alive and reuse destroyed ones) and DTensor's caches
(sharding propagation, redistribute plans, dynamo: they hold meshes, meshes hold their groups, and
a destroyed gloo group's threads only stop when its last reference goes), and re-creates the
default group if the task destroyed it. Without this an idle worker accumulated hundreds of gloo
threads over a session (about 6 threads per group, 8-16 groups per folding).

Timeouts (seconds), overridable through the environment: DTENSOR_MOE_TEST_TIMEOUT per call
(default 600: torchtitan's Trainer on 4 ranks of a loaded 2-core machine takes minutes; a healthy
parity case takes seconds, so this only bounds how long a real hang takes to be reported), and
DTENSOR_MOE_TEST_START_TIMEOUT for a pool's start-up (start the workers, rendezvous; default
600).
"""

import gc
import os
import queue
import socket
import sys
import time
import traceback
from datetime import timedelta
from multiprocessing.reduction import ForkingPickler

import torch.multiprocessing as mp

# Inductor compiles in the compiling process, not in a pool of compile workers per rank (its pool's
# threads outlive the task, and its processes fork from each rank on an already full 2-core machine).
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

TIMEOUT_S = float(os.environ.get("DTENSOR_MOE_TEST_TIMEOUT", "600"))
START_TIMEOUT_S = float(os.environ.get("DTENSOR_MOE_TEST_START_TIMEOUT", "600"))
# Once a rank has failed, how long the others get to report (the same error, usually) before the
# pool is killed: a rank still inside a collective its failed peer never joins would otherwise
# hold the call for the whole timeout.
ERROR_GRACE_S = float(os.environ.get("DTENSOR_MOE_TEST_ERROR_GRACE", "120"))
# How many pools (distinct world sizes) stay alive at once; the least recently used one is closed
# when a new one would exceed it. Idle workers cost no CPU but ~0.4 GB of memory each.
MAX_POOLS = int(os.environ.get("DTENSOR_MOE_TEST_MAX_POOLS", "5"))
# How often a call waiting for results checks that its workers are still alive.
_ALIVE_CHECK_S = 2.0


# Workers fork from a forkserver that imported torch once (a pool of 8 starts in seconds instead of
# a minute of 8 concurrent `import torch` on a loaded 2-core machine, and the imported pages are
# shared); DTENSOR_MOE_TEST_START_METHOD=spawn starts each worker from scratch instead.
START_METHOD = os.environ.get("DTENSOR_MOE_TEST_START_METHOD", "forkserver")
# torch._dynamo too: the custom ops' autograd imports it lazily, otherwise in every worker (seconds each).
# torch._inductor.compile_fx: compiled tasks and torchtitan (its FlexAttention) import it, ~2 CPU s per worker.
# Not torchtitan's `datasets`: pyarrow starts a jemalloc thread at import, and a forkserver must fork single-threaded.
_PRELOAD = [
    "torch", "torch._dynamo", "torch.distributed", "torch.distributed.tensor", "torch.distributed.fsdp",
    "torch.distributed.checkpoint", "torch.distributed.pipelining", "pytest", "hypothesis", __name__,
    "dtensor_moe", "dtensor_moe.train.model", "dtensor_moe.train.checkpoint", "torch._inductor.compile_fx",
]


def _context():
    ctx = mp.get_context(START_METHOD)
    if START_METHOD == "forkserver":  # modules that fail to import here are imported by the workers
        ctx.set_forkserver_preload(_PRELOAD)
    return ctx


class RankFailure(RuntimeError):
    pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def thread_count() -> int:
    """OS threads of this process (C++ ones included, unlike threading.active_count())."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("Threads:"):
                return int(line.split()[1])
    return -1


def worker_state(rank: int, world_size: int) -> dict:
    """A task that reports what an idle worker holds (see idle_leaks)."""
    from torch.distributed.distributed_c10d import _world

    mesh = sys.modules.get("dtensor_moe.parallel.mesh")
    return {
        "pid": os.getpid(),
        "threads": thread_count(),
        "process_groups": len(_world.pg_map),
        "mesh_cache": len(getattr(mesh, "_MESH_CACHE", ())),
    }


def live_device_meshes(rank: int, world_size: int) -> int:
    """A task: how many DeviceMesh objects this worker still holds (a full collection first)."""
    from torch.distributed.device_mesh import DeviceMesh

    gc.unfreeze()  # every object, not only those since the last gc.freeze()
    gc.collect()
    return sum(issubclass(type(o), DeviceMesh) for o in gc.get_objects())


class _World:
    """This worker's default process group, re-creatable on a store that outlives it."""

    def __init__(self, rank, world_size, port):
        import torch.distributed as dist

        self.rank, self.world_size, self.generation = rank, world_size, 0
        self.store = dist.TCPStore(
            "127.0.0.1", port, world_size, is_master=rank == 0, timeout=timedelta(seconds=START_TIMEOUT_S)
        )
        self.init()

    def init(self):
        import torch.distributed as dist

        store = dist.PrefixStore(f"world{self.generation}", self.store)
        dist.init_process_group("gloo", store=store, rank=self.rank, world_size=self.world_size)
        self.generation += 1

    def groups(self) -> set:
        from torch.distributed.distributed_c10d import _world

        return set(_world.pg_map)

    def reset(self, before: set):
        """Back to the state before the task: the default group only, no cached meshes."""
        import torch.distributed as dist

        mesh = sys.modules.get("dtensor_moe.parallel.mesh")
        if mesh is not None and hasattr(mesh, "_MESH_CACHE"):
            mesh._MESH_CACHE.clear()
        _clear_dtensor_caches()
        _break_graph_cycles()
        if not dist.is_initialized():  # the task destroyed the default group (and with it every group)
            self.init()
        else:
            for pg in self.groups() - before:
                dist.destroy_process_group(pg)
        # The task's cycles (modules <-> FSDP state): a gloo group's threads stop with its last
        # reference. Freeing one cycle can release C++-held references that expose the next (FSDP's
        # hooks), so collect until nothing more is found.
        for _ in range(8):
            if not gc.collect():
                break


def _break_graph_cycles():
    """Frees what a task left in reference cycles that the garbage collector cannot see.

    A tensor kept on a module together with its autograd graph (a layer's `aux_loss`, say) links
    back to the module through C++ graph nodes (FSDP's hooks hold the module): gc sees no cycle, so
    the module, its DTensors, their meshes and the meshes' process groups (with their threads)
    outlive the task. Dropping such tensors from the modules the task created breaks the cycle.
    Only objects the collector tracks outside the permanent generation are looked at: with
    gc.freeze() before each task, those are the task's own."""
    import torch

    module, tensor = torch.nn.Module, torch.Tensor  # type(), not isinstance(): no __class__ properties
    for obj in gc.get_objects():
        if issubclass(type(obj), module):
            for name, value in list(vars(obj).items()):
                if issubclass(type(value), tensor) and value.grad_fn is not None:
                    delattr(obj, name)


def _clear_dtensor_caches():
    """DTensor's caches keyed on specs hold their DeviceMesh, and a mesh holds its process groups:
    a destroyed gloo group only stops its threads once the last reference is gone."""
    if "torch.distributed.tensor" not in sys.modules:
        return
    from torch.distributed.tensor import _collective_utils, _redistribute
    from torch.distributed.tensor._api import DTensor
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()  # the Python propagation cache (this thread's) and the C++ fast path's
    DTensor._op_dispatcher.sharding_propagator._propagate_tensor_meta_cached.cache_clear()
    _redistribute._gen_transform_infos.cache_clear()
    _redistribute.clear_redistribute_planner_cache()
    _collective_utils.MeshTopoInfo.build_from_mesh.cache_clear()
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None:  # compiled graphs guard on (and hold) the meshes they were traced with
        dynamo.reset()


def _worker(rank, world_size, port, tasks, results, environ):
    import torch

    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    os.environ.clear()  # the test process's environment now, not the forkserver's from its start
    os.environ.update(environ)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    try:
        world = _World(rank, world_size, port)
    except BaseException as e:  # noqa: BLE001
        results.put((rank, False, (e, traceback.format_exc())))
        return
    results.put((rank, True, thread_count()))  # ready
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args = task
        # Everything alive now (test modules imported by unpickling the task included) is not the
        # task's: the permanent generation keeps it out of the collections and scans after it.
        gc.freeze()
        before = world.groups()
        try:
            out = (rank, True, fn(rank, world_size, *args))
        except BaseException as e:  # noqa: BLE001 - shipped back to the test process
            # The traceback's frames hold the task's locals (its modules, meshes and their groups' threads).
            tb = traceback.format_exc()
            traceback.clear_frames(e.__traceback__)
            out = (rank, False, (e.with_traceback(None), tb))
        try:
            world.reset(before)
        except BaseException as e:  # noqa: BLE001 - a worker that cannot reset must not take more tasks
            out = (rank, False, (RankFailure(f"worker reset failed: {e!r}"), traceback.format_exc()))
        results.put(out)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


class RankPool:
    def __init__(self, world_size: int):
        ctx = _context()
        self.world_size = world_size
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        self.results = ctx.Queue()
        environ = dict(os.environ)
        for attempt in range(3):
            # _free_port's port is free when asked, not when rank 0 binds it: another process (a launcher's
            # torchrun in a test beside this one) may take it in between. Then start again on another port.
            port = _free_port()
            self.procs = [
                ctx.Process(target=_worker, args=(r, world_size, port, self.tasks[r], self.results, environ),
                            daemon=True)
                for r in range(world_size)
            ]
            for p in self.procs:
                p.start()
            try:
                # A slow start is not charged to the first task. Threads per idle worker, for idle_leaks.
                self.start_threads = self._collect(START_TIMEOUT_S, "start-up")
                break
            except (RankFailure, RuntimeError) as e:
                if "EADDRINUSE" not in str(e) or attempt == 2:
                    raise
                self.kill()
                self.results = ctx.Queue()

    def _collect(self, timeout: float, what: str):
        out, errors = [None] * self.world_size, {}
        deadline = time.monotonic() + timeout
        reported = set()
        for _ in range(self.world_size):
            while True:
                try:  # in slices: a worker that died (killed, out of memory) fails the call now, not at the timeout
                    rank, ok, payload = self.results.get(timeout=min(max(deadline - time.monotonic(), 0.01),
                                                                     _ALIVE_CHECK_S))
                    break
                except queue.Empty:
                    dead = {r: p.exitcode for r, p in enumerate(self.procs) if r not in reported and not p.is_alive()}
                    if dead:  # what a worker put before exiting (a start-up error) is in the pipe by now
                        try:
                            rank, ok, payload = self.results.get(timeout=1.0)
                            break
                        except queue.Empty:
                            pass
                    elif time.monotonic() < deadline:
                        continue
                    self.kill()
                    why = (f"rank(s) {sorted(dead)} died (exit codes {list(dead.values())}, a negative one the signal "
                           f"that ended it)" if dead else
                           f"timeout after {timeout}s on {self.world_size} ranks (DTENSOR_MOE_TEST_TIMEOUT / "
                           f"DTENSOR_MOE_TEST_START_TIMEOUT raise it)")
                    raise RankFailure(f"{what}: {why}; rank errors so far: {_fmt(errors)}") from None
            reported.add(rank)
            if ok:
                out[rank] = payload
            else:
                if not errors:  # ranks still out after one failed are likely stuck in a collective
                    # A rank 0 that could not listen (RankPool starts again elsewhere) leaves the others waiting.
                    grace = 0 if "EADDRINUSE" in str(payload[0]) else ERROR_GRACE_S
                    deadline = min(deadline, time.monotonic() + grace)
                errors[rank] = payload
        if errors:
            types = {type(e) for e, _ in errors.values()}
            if len(errors) == self.world_size and len(types) == 1 and types != {RankFailure}:
                exc, tb = errors[0]
                exc.add_note(f"--- rank 0 of {self.world_size} (every rank raised {type(exc).__name__}) ---\n{tb}")
                raise exc
            self.kill()
            raise RankFailure(_fmt(errors))
        return out

    def run(self, fn, *args, timeout: float | None = None):
        # A task the queue's feeder thread cannot pickle would never arrive: fail here, not by timeout.
        ForkingPickler.dumps((fn, args))
        for q in self.tasks:
            q.put((fn, args))
        return self._collect(TIMEOUT_S if timeout is None else timeout, getattr(fn, "__name__", str(fn)))

    def leaked_threads(self) -> int:
        """The most threads any worker holds beyond its start-up count (0 where /proc cannot say)."""
        most = 0
        for p, start in zip(self.procs, self.start_threads):
            try:
                with open(f"/proc/{p.pid}/status") as f:
                    threads = next(int(line.split()[1]) for line in f if line.startswith("Threads:"))
            except (OSError, StopIteration, ValueError):
                continue
            most = max(most, threads - start)
        return most

    def kill(self):
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(timeout=10)
        if _POOLS.get(self.world_size) is self:
            del _POOLS[self.world_size]

    def close(self):
        for q in self.tasks:
            q.put(None)
        for p in self.procs:
            p.join(timeout=30)
        self.kill()


def _fmt(errors) -> str:
    return "\n".join(f"--- rank {r} ---\n{tb}" for r, (_, tb) in sorted(errors.items()))


_POOLS: dict[int, RankPool] = {}  # insertion order = least recently used first


def run_on_ranks(world_size: int, fn, *args, timeout: float | None = None):
    pool = _POOLS.pop(world_size, None)
    if pool is None:
        while len(_POOLS) >= max(MAX_POOLS, 1):
            _POOLS[next(iter(_POOLS))].close()
        pool = RankPool(world_size)
    _POOLS[world_size] = pool  # most recently used last
    out = pool.run(fn, *args, timeout=timeout)
    if pool.leaked_threads() > RECYCLE_THREADS:
        # Threads of process groups a task left referenced keep polling while the pool idles (~10% of a
        # core per worker at ~200 threads): a fresh pool from the forkserver costs less than keeping them.
        pool.close()
    return out


def _as_torchrun_rank(rank, world_size, target, args, environ, port):
    """A task: `python -m MODULE *args` (target ("module", MODULE)) or `python SCRIPT *args` (("path", SCRIPT))
    as torchrun would run it on this rank: it creates its own default group on `port`, as under torchrun's
    rendezvous (the pool's is re-created after the task)."""
    import runpy
    import warnings

    import torch.distributed as dist

    dist.destroy_process_group()
    saved_environ, saved_argv = dict(os.environ), sys.argv
    os.environ.clear()
    os.environ.update(environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    kind, name = target
    sys.argv = [name, *args]
    try:
        with warnings.catch_warnings():  # the module was imported already (by the forkserver's preload)
            warnings.filterwarnings("ignore", message=".*found in sys.modules after import of package",
                                    category=RuntimeWarning)
            if kind == "module":
                runpy.run_module(name, run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(name, run_name="__main__")
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else int(e.code is not None)
    finally:
        os.environ.clear()
        os.environ.update(saved_environ)
        sys.argv = saved_argv
    return 0


def torchrun_on_ranks(cmd: list[str], env: dict | None = None) -> int:
    """The exit status of `cmd`, a `python -m torch.distributed.run --standalone --nproc-per-node=N (-m MODULE |
    SCRIPT) ARGS` command, run on an N-rank pool instead: every rank runs `python -m MODULE ARGS` (or `python
    SCRIPT ARGS`) in torchrun's environment (`env`, or this process's, plus RANK, LOCAL_RANK, WORLD_SIZE,
    MASTER_ADDR/PORT). For tests of what a launcher starts, not of the launcher: a real torchrun costs
    several CPU seconds per rank importing torch."""
    i = cmd.index("torch.distributed.run") + 1
    options = []
    while cmd[i].startswith("--"):
        options.append(cmd[i])
        i += 1
    nproc = [o for o in options if o.startswith("--nproc-per-node=")]
    if sorted(options) != sorted(["--standalone", *nproc]) or len(nproc) != 1:
        raise ValueError(f"torchrun_on_ranks emulates --standalone --nproc-per-node=N only, got {options}")
    target, args = (("module", cmd[i + 1]), cmd[i + 2:]) if cmd[i] == "-m" else (("path", cmd[i]), cmd[i + 1:])
    environ = dict(os.environ if env is None else env)
    codes = run_on_ranks(int(nproc[0].split("=")[1]), _as_torchrun_rank, target, args, environ, _free_port())
    return next((c for c in codes if c), 0)


LEAK_THREADS = 4  # a leaked gloo group keeps 3 threads; a few more threads than at start-up is noise
# About eight leaked groups: run_on_ranks then replaces the pool. Compiled tasks leak this way on torch 2.13: a
# torch.compile'd function that used a process group (a compiled all_reduce on a dist.new_group, backend "eager",
# is enough) keeps the group and its 3 gloo threads alive after torch._dynamo.reset() and destroy_process_group;
# no Python container or lru_cache holds it, its dynamo cache entry is gone. The session's leak report then names
# those pools.
# DTENSOR_MOE_TEST_RECYCLE_THREADS raises it where workers hold threads of their own that are no leak (CUDA's, on
# the GPU suite's ranks), which would otherwise replace the pool after every task.
RECYCLE_THREADS = int(os.environ.get("DTENSOR_MOE_TEST_RECYCLE_THREADS", "24"))


def idle_leaks() -> dict:
    """Live pools whose idle workers hold more than at start-up (another process group, cached
    meshes, a leaked group's threads): {world_size: [per-rank state]}; cheap, no gc scan."""
    leaks = {}
    for world_size, pool in list(_POOLS.items()):
        try:
            states = pool.run(worker_state, timeout=min(TIMEOUT_S, 120))
        except Exception as e:  # noqa: BLE001 - a report, not a test
            leaks[world_size] = repr(e)
            continue
        if any(
            s["process_groups"] != 1 or s["mesh_cache"] or s["threads"] > start + LEAK_THREADS
            for s, start in zip(states, pool.start_threads)
        ):
            leaks[world_size] = [{**s, "threads_at_start": start} for s, start in zip(states, pool.start_threads)]
    return leaks


def close_all():
    for pool in list(_POOLS.values()):
        pool.close()
