"""Run a function on N ranks as real processes, for tests.

``run_distributed(fn, world_size, *args)`` runs ``fn(*args)`` on every rank of a
``torch.distributed`` job (NCCL when there is a GPU per rank, else gloo on the CPU) and returns the per-rank
results as a list indexed by rank.

Workers are started once per ``(world_size, backend)`` and reused by later calls, so a test
suite pays the process start-up (mostly ``import torch``) once per world size rather than once
per test. A failure tears the pool down so the next call starts clean.

Failures are bounded and named:

* a rank that raises -> :class:`RankFailed` with that rank's traceback;
* a rank whose process dies (segfault, ``os._exit``, OOM kill) -> :class:`RankDied` with the
  exit code;
* ranks that do not finish within ``timeout`` seconds (a hung collective, a deadlock) ->
  :class:`RankTimeout` with each hung rank's Python stack.

``fn`` must be picklable: a module-level function of an importable module (test modules in a
package with ``__init__.py`` qualify). Workers are started with ``spawn``, so a script calling
``run_distributed`` needs the usual ``if __name__ == "__main__":`` guard. Results should be CPU tensors or plain Python objects;
CUDA tensors are moved to the CPU before they are sent back.
"""

from __future__ import annotations

import atexit
import datetime
import faulthandler
import multiprocessing as mp
import os
import signal
import tempfile
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

__all__ = [
    "DistributedTestError",
    "RankDied",
    "RankFailed",
    "RankTimeout",
    "run_distributed",
    "shutdown_pools",
]

DEFAULT_TIMEOUT_S = 120.0
# After one rank fails, the others usually block in a collective waiting for it; give them this
# long to finish on their own before the pool is stopped.
FAILURE_GRACE_S = 5.0


class DistributedTestError(AssertionError):
    """Base class of the harness's failures (an AssertionError so pytest reports it as a failure)."""


class RankFailed(DistributedTestError):
    """A rank raised an exception; the message holds its traceback."""


class RankDied(DistributedTestError):
    """A rank's process exited without returning a result."""


class RankTimeout(DistributedTestError):
    """Ranks did not finish within the time bound; the message holds their stacks."""


def _to_cpu(obj: Any) -> Any:
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def _worker_main(
    rank: int,
    world_size: int,
    backend: str,
    init_file: str,
    conn: Connection,
    stack_file: str,
    threads: int,
    collective_timeout_s: float,
) -> None:
    # SIGUSR1 dumps every thread's stack to stack_file, so the parent can show where a hung rank is.
    dump = open(stack_file, "w")  # noqa: SIM115 - lives as long as the process
    faulthandler.register(signal.SIGUSR1, file=dump, all_threads=True)
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size)
    )
    import torch
    import torch.distributed as dist

    if backend == "gloo" and torch.cuda.is_available() and torch.cuda.device_count() < world_size:
        # Fewer GPUs than ranks: a gloo job computes on the CPU rather than sharing GPUs.
        os.environ["MG_FORCE_CPU"] = "1"
    torch.set_num_threads(threads)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    try:
        dist.init_process_group(
            backend,
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=collective_timeout_s),
        )
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ready", None))
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            break
        if msg is None:
            break
        fn, args, kwargs = msg
        try:
            result = _to_cpu(fn(*args, **kwargs))
            conn.send(("ok", result))
        except BaseException:
            conn.send(("error", traceback.format_exc()))
    try:
        dist.destroy_process_group()
    except Exception:
        pass


class _Pool:
    """``world_size`` worker processes sharing one process group."""

    def __init__(self, world_size: int, backend: str, threads: int, timeout_s: float) -> None:
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.tmpdir = tempfile.TemporaryDirectory(prefix="mg-dist-")
        init_file = os.path.join(self.tmpdir.name, "store")
        self.stack_files = [os.path.join(self.tmpdir.name, f"stack-{r}.txt") for r in range(world_size)]
        self.conns: list[Connection] = []
        self.procs: list[mp.process.BaseProcess] = []
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_worker_main,
                args=(rank, world_size, backend, init_file, child, self.stack_files[rank], threads, timeout_s),
                daemon=True,
                name=f"mg-rank{rank}",
            )
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)
        statuses = self._collect("process group start-up", timeout_s, expect="ready")
        del statuses

    def run(self, fn: Callable[..., Any], args: tuple, kwargs: dict, timeout_s: float) -> list[Any]:
        for conn in self.conns:
            conn.send((fn, args, kwargs))
        return self._collect(getattr(fn, "__qualname__", repr(fn)), timeout_s, expect="ok")

    def _collect(self, what: str, timeout_s: float, expect: str) -> list[Any]:
        results: list[Any] = [None] * self.world_size
        errors: dict[int, str] = {}
        died: dict[int, int | None] = {}
        pending = set(range(self.world_size))
        deadline = time.monotonic() + timeout_s
        while pending:
            now = time.monotonic()
            if now >= deadline:
                break
            handles: list[Any] = []
            for r in pending:
                handles += [self.conns[r], self.procs[r].sentinel]
            for h in wait(handles, timeout=deadline - now):
                for r in list(pending):
                    conn, proc = self.conns[r], self.procs[r]
                    if h is conn or (h == proc.sentinel and conn.poll()):
                        try:
                            status, payload = conn.recv()
                        except EOFError:  # the process exited: its pipe closed
                            proc.join(5)
                            died[r] = proc.exitcode
                            pending.discard(r)
                            continue
                        if status == expect:
                            results[r] = payload
                        else:
                            errors[r] = payload
                        pending.discard(r)
                    elif h == proc.sentinel:
                        proc.join(1)
                        died[r] = proc.exitcode
                        pending.discard(r)
            if (errors or died) and pending:
                # The survivors are most likely blocked on the failed rank: allow a short grace.
                deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
        if not (errors or died or pending):
            return results

        stacks = self._stacks(sorted(pending)) if pending and not (errors or died) else ""
        self.close(force=True)
        stopped = f" ranks {sorted(pending)} were still running and were stopped." if pending else ""
        if died:
            r = min(died)
            code = died[r]
            how = f"signal {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"
            raise RankDied(
                f"rank {r} of {self.world_size} died ({how}) while running {what} without returning a result."
                f"{' Ranks ' + str(sorted(errors)) + ' raised afterwards.' if errors else ''}{stopped}"
            )
        if errors:
            r = min(errors)
            others = f" (ranks {sorted(errors)} raised)" if len(errors) > 1 else ""
            raise RankFailed(f"rank {r} of {self.world_size} raised in {what}{others}.{stopped}\n{errors[r]}")
        raise RankTimeout(
            f"ranks {sorted(pending)} of {self.world_size} did not finish {what} within {timeout_s:.0f} s "
            f"(a hung collective or a deadlock); they were stopped. Their stacks:\n{stacks}"
        )

    def _stacks(self, ranks: list[int]) -> str:
        for r in ranks:
            try:
                os.kill(self.procs[r].pid, signal.SIGUSR1)
            except OSError:
                pass
        time.sleep(0.5)
        out = []
        for r in ranks:
            try:
                with open(self.stack_files[r]) as f:
                    out.append(f"--- rank {r} ---\n{f.read().strip()}")
            except OSError:
                out.append(f"--- rank {r} --- (no stack available)")
        return "\n".join(out)

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def close(self, force: bool = False) -> None:
        if not force:
            for conn in self.conns:
                try:
                    conn.send(None)
                except OSError:
                    pass
            for p in self.procs:
                p.join(5)
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        for conn in self.conns:
            conn.close()
        self.tmpdir.cleanup()


_POOLS: dict[tuple[int, str, int], _Pool] = {}


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = DEFAULT_TIMEOUT_S,
    backend: str | None = None,
    threads: int = 1,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks and return the results by rank.

    Each rank is a separate process with ``torch.distributed`` initialised (default group of
    ``world_size`` ranks) and ``RANK``/``LOCAL_RANK``/``WORLD_SIZE`` set in its environment.

    Args:
        fn: a picklable (module-level) function.
        world_size: number of ranks.
        timeout: seconds within which every rank must return.
        backend: ``"gloo"`` or ``"nccl"``; default NCCL when CUDA is available with a GPU per rank,
            else gloo (on the CPU when there are fewer GPUs than ranks).
        threads: intra-op threads per rank (``torch.set_num_threads``).

    Raises:
        RankFailed: a rank raised (its traceback is in the message).
        RankDied: a rank's process exited without a result.
        RankTimeout: ranks did not return within ``timeout`` s (their stacks are in the message).
        ValueError: ``world_size < 1``, or ``backend="nccl"`` with fewer GPUs than ranks.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if backend is None:
        from mg_parallel.device import default_backend

        backend = default_backend()
        if backend == "nccl" and _gpu_count() < world_size:
            backend = "gloo"  # NCCL needs one GPU per rank; the ranks run on the CPU instead
    elif backend == "nccl" and _gpu_count() < world_size:
        raise ValueError(f"backend='nccl' needs one GPU per rank, but {world_size} ranks see {_gpu_count()} GPU(s); "
                         f"use backend='gloo' or fewer ranks")
    key = (world_size, backend, threads)
    pool = _POOLS.get(key)
    if pool is not None and not pool.alive():
        pool.close(force=True)
        pool = None
    if pool is None:
        try:
            pool = _Pool(world_size, backend, threads, timeout_s=max(timeout, 60.0))
        finally:
            _POOLS.pop(key, None)
        _POOLS[key] = pool
    try:
        return pool.run(fn, args, kwargs, timeout)
    except DistributedTestError:
        _POOLS.pop(key, None)
        raise


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def shutdown_pools() -> None:
    """Stop every worker pool (called automatically at interpreter exit)."""
    while _POOLS:
        _, pool = _POOLS.popitem()
        pool.close()


atexit.register(shutdown_pools)
