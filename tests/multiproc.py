"""Running a function on N ranks of a ``gloo`` process group on this machine.

Each rank is a ``torch.multiprocessing`` spawn child that joins a process
group on 127.0.0.1, runs ``fn(rank, world_size, *args)`` and sends back either
its result or its formatted traceback through a queue.  The parent waits
for every rank under one deadline: the first rank that fails fails the call
with its traceback (the others are killed rather than left blocking in a
collective), and a rank that neither answers nor exits in time fails it
with a timeout.  Nothing ever waits without a bound.

Example::

    >>> def body(rank, world_size):
    ...     t = torch.tensor([rank])
    ...     torch.distributed.all_reduce(t)
    ...     return t.item()
    >>> run_ranks(body, 2)
    [1, 1]

``fn`` must be importable by name (a module-level function of an importable
module, such as ``tests/dist_workers.py``), as spawn children import it.
"""

from __future__ import annotations

import datetime
import os
import queue as queue_module
import socket
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class RankFailed(AssertionError):
    """A rank raised: carries that rank's traceback."""


class RanksTimedOut(AssertionError):
    """Some ranks neither finished nor failed within the deadline."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank, world_size, port, collective_timeout, threads, fn, args, results, backend="gloo"):
    try:
        torch.set_num_threads(threads)
        if backend == "nccl":
            torch.cuda.set_device(rank)  # one GPU per rank, as torchrun sets it
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=collective_timeout),
        )
        result = fn(rank, world_size, *args)
        results.put((rank, True, result))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass


def run_ranks(
    fn,
    world_size: int,
    *args,
    timeout: float = 120.0,
    collective_timeout: float | None = None,
    threads: int = 1,
    env: dict | None = None,
    backend: str = "gloo",
):
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks of a ``backend``
    process group (gloo; ``"nccl"`` puts rank r on GPU r); return their results by rank.

    Raises :class:`RankFailed` with the traceback of the first rank that
    raised, or :class:`RanksTimedOut` when ranks are still running after
    ``timeout`` seconds.  Every child is gone when this returns or raises.
    ``env`` adds environment variables for the children (read at their
    start, e.g. ``MALLOC_MMAP_THRESHOLD_``); ``threads`` sets their
    intra-op thread count.
    """
    if collective_timeout is None:
        collective_timeout = max(10.0, timeout / 2)
    try:
        return _run_once(fn, world_size, args, timeout, collective_timeout, threads, env, backend)
    except RankFailed as e:
        if "EADDRINUSE" not in str(e) and "address already in use" not in str(e).lower():
            raise
        # The free port was taken between choosing it and binding it: once more.
        return _run_once(fn, world_size, args, timeout, collective_timeout, threads, env, backend)


def _run_once(fn, world_size, args, timeout, collective_timeout, threads, env, backend):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(rank, world_size, port, collective_timeout, threads, fn, args, results, backend),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    child_env = {"OMP_NUM_THREADS": str(threads), **(env or {})}
    env_before = {key: os.environ.get(key) for key in child_env}
    os.environ.update(child_env)  # inherited by the children when they start
    try:
        for p in procs:
            p.start()
    finally:
        for key, value in env_before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    deadline = time.monotonic() + timeout
    answers: dict[int, object] = {}
    try:
        while len(answers) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(world_size)) - answers.keys())
                raise RanksTimedOut(f"ranks {missing} of {world_size} did not finish within {timeout:.0f} s")
            try:
                rank, ok, payload = results.get(timeout=min(left, 1.0))
            except queue_module.Empty:
                dead = [r for r, p in enumerate(procs) if r not in answers and p.exitcode is not None]
                if dead:
                    # Give a rank that just answered a moment to be read.
                    try:
                        rank, ok, payload = results.get(timeout=2.0)
                    except queue_module.Empty:
                        codes = {r: procs[r].exitcode for r in dead}
                        raise RankFailed(f"ranks exited without an answer (exit codes {codes})") from None
                else:
                    continue
            if not ok:
                raise RankFailed(f"rank {rank} of {world_size} failed:\n{payload}")
            answers[rank] = payload
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=5)
        results.close()
        results.join_thread()
    return [answers[r] for r in range(world_size)]
