"""Multi-process test helpers: gloo process groups on localhost, and MPI-launched ones.

``run_distributed(fn, world_size, *args)`` runs ``fn(rank, world_size, *args)`` once in ``world_size``
fresh processes. ``DistributedPool`` keeps the processes (and their process group) alive across calls,
so a test module pays the ~2-3 s spawn (importing torch) once per world size, not once per test.

Robustness: a rank that raises reports its traceback at once; a rank that hangs (e.g. waiting in a
collective that a failed rank never joins) is killed after a grace period or the timeout, and the call
fails with every traceback collected. Nothing here can hang pytest. A call's timeout counts from when
the workers are up (start-up has its own generous limit, since importing torch on a loaded machine is
slow and says nothing about the code under test).

``fn`` must be a module-level function (pickled by name; the workers import its module).
"""
from __future__ import annotations

import datetime
import os
import queue as queue_mod
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_HOST = "127.0.0.1"
_GRACE_S = 10.0     # how long the other ranks may still take after one rank has failed
_STARTUP_S = 180.0  # spawn + import torch + rendezvous; slow on a loaded 2-core machine, never counted
                    # against a call's timeout
_READY = -1         # task id of the "process group is up" message


def _connect(rank: int, world_size: int, port: int, timeout_s: float) -> None:
    """Join the gloo group served by the TCPStore on ``port`` (created by the parent, so no port race)."""
    store = dist.TCPStore(_HOST, port, world_size, is_master=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))


def _worker(rank: int, world_size: int, port: int, timeout_s: float, tasks, results) -> None:
    torch.set_num_threads(1)  # P workers share few cores; intra-op threads would only fight
    try:
        _connect(rank, world_size, port, timeout_s)
    except BaseException:
        results.put((_READY, rank, False, "process group init failed:\n" + traceback.format_exc()))
        return
    results.put((_READY, rank, True, None))
    try:
        while True:
            task = tasks.get()
            if task is None:
                break
            task_id, fn, args = task
            try:
                results.put((task_id, rank, True, fn(rank, world_size, *args)))
            except BaseException:
                results.put((task_id, rank, False, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


class DistributedPool:
    """``world_size`` worker processes in one gloo group, reused across ``run`` calls.

    Start lazily on the first ``run``; after a hang the workers are killed and the next ``run`` starts
    fresh ones. Use as a context manager or call ``close()``.
    """

    def __init__(self, world_size: int, timeout: float = 120):
        self.world_size = world_size
        self.timeout = timeout
        self._procs = None
        self._next_id = 0

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        # The parent serves the rendezvous store on an OS-chosen free port: no race for a port.
        self._store = dist.TCPStore(_HOST, 0, None, is_master=True,
                                    timeout=datetime.timedelta(seconds=_STARTUP_S), wait_for_workers=False)
        self._results = ctx.Queue()
        self._tasks = [ctx.SimpleQueue() for _ in range(self.world_size)]
        self._procs = [ctx.Process(target=_worker, daemon=True,
                                   args=(r, self.world_size, self._store.port, _STARTUP_S,
                                         self._tasks[r], self._results))
                       for r in range(self.world_size)]
        for p in self._procs:
            p.start()
        self._collect(_READY, _STARTUP_S, "start-up")

    def _collect(self, task_id: int, timeout: float, what: str) -> list:
        """Wait for every rank's message for ``task_id``; kill the workers on a hang or death."""
        done: dict[int, tuple[bool, object]] = {}
        deadline = time.monotonic() + timeout
        why, in_grace = None, False
        while len(done) < self.world_size:
            now = time.monotonic()
            if now >= deadline:
                missing = sorted(set(range(self.world_size)) - set(done))
                limit = "the grace period after another rank failed" if in_grace else f"{timeout:.0f} s"
                why = f"rank(s) {missing} did not finish {what} within {limit} (hang?); workers killed"
                break
            try:
                tid, rank, ok, value = self._results.get(timeout=min(0.2, deadline - now))
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive() and r not in done]
                if dead:
                    codes = {r: self._procs[r].exitcode for r in dead}
                    why = f"rank(s) {dead} died without a result (exit codes {codes}); workers killed"
                    break
                continue
            if tid != task_id:
                continue  # a late message of an earlier, failed call
            done[rank] = (ok, value)
            if not ok and not in_grace:
                deadline, in_grace = min(deadline, time.monotonic() + min(_GRACE_S, timeout)), True
        if why is not None:
            self._kill()
        failures = {r: v for r, (ok, v) in sorted(done.items()) if not ok}
        if why is not None or failures:
            if task_id == _READY and why is None:
                self._kill()
            text = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in failures.items())
            raise AssertionError(f"{what} failed on {self.world_size} ranks{': ' + why if why else ''}\n{text}")
        return [done[r][1] for r in range(self.world_size)]

    def run(self, fn, *args, timeout: float | None = None) -> list:
        """Run ``fn(rank, world_size, *args)`` on every rank; return the per-rank results (rank order).

        Raises:
            AssertionError: some rank raised (its traceback text is in the message), died, or did not
                finish within ``timeout`` seconds (default: the pool's) -- then all workers are killed.
        """
        timeout = self.timeout if timeout is None else timeout
        if self._procs is None:
            self._start()
        task_id, self._next_id = self._next_id, self._next_id + 1
        for q in self._tasks:
            q.put((task_id, fn, args))
        return self._collect(task_id, timeout, getattr(fn, "__name__", repr(fn)))

    def _kill(self) -> None:
        for p in self._procs or []:
            if p.is_alive():
                p.kill()
        for p in self._procs or []:
            p.join(timeout=5)
        self._procs = None
        self._store = None

    def close(self) -> None:
        """Stop the workers (politely, then by kill after a few seconds)."""
        if self._procs is None:
            return
        for q in self._tasks:
            q.put(None)
        end = time.monotonic() + 10
        for p in self._procs:
            p.join(timeout=max(0.0, end - time.monotonic()))
        self._kill()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def run_distributed(fn, world_size: int, *args, timeout: float = 120) -> list:
    """Spawn ``world_size`` processes in a fresh gloo group, run ``fn(rank, world_size, *args)`` in each.

    Returns the per-rank return values (they must pickle). Raises AssertionError (with every failing
    rank's traceback) if a rank raises, dies or hangs past ``timeout`` seconds (counted once the process
    group is up); hung ranks are killed.
    """
    with DistributedPool(world_size, timeout=timeout) as pool:
        return pool.run(fn, *args, timeout=timeout)


def init_from_mpi(timeout: float = 120) -> tuple[int, int]:
    """Init a gloo default process group across the ranks of ``mpirun``; return ``(rank, world_size)``.

    Rank and size come from mpi4py's COMM_WORLD; rank 0 serves the rendezvous TCPStore on a free port
    chosen by the OS and broadcasts the port over MPI (also exported as MASTER_ADDR / MASTER_PORT).
    Idempotent: returns the existing group's rank and size if torch.distributed is already initialised.
    """
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    td = datetime.timedelta(seconds=timeout)
    store = None
    if rank == 0:
        store = dist.TCPStore(_HOST, 0, None, is_master=True, timeout=td, wait_for_workers=False)
    port = comm.bcast(store.port if rank == 0 else None, root=0)
    if rank != 0:
        store = dist.TCPStore(_HOST, port, size, is_master=False, timeout=td)
    os.environ.setdefault("MASTER_ADDR", _HOST)
    os.environ.setdefault("MASTER_PORT", str(port))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=size, timeout=td)
    return rank, size


def error_of(fn, *args, **kwargs) -> str:
    """The message of the ValueError/TypeError that ``fn`` raises, or "" if it returns (a rank's result
    in tests that check every rank raises together)."""
    try:
        fn(*args, **kwargs)
    except (TypeError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return ""
