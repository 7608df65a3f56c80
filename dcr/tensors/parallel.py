"""Worker threads for construction: an ordered map over blocks with a bounded window.

Change detection and the gathers around it are numpy calls on blocks of about a million
elements; numpy releases the GIL inside them, so blocks of one owner run on several cores.
Results come back in submission order (records stay sorted per destination) and at most
``window`` blocks are in flight, so the extra memory is bounded by a few blocks per thread
whatever the size of the model.  One process-wide pool serves every owner; it is recreated
in a forked child, where the parent's worker threads do not exist.

Owners hosted in one process often build at the same time, each from its own thread (one
per owner).  The maps running at once share the threads they ask for: a map whose share is
a single thread runs its tasks in the thread that consumes it, so two owners on two cores
use the two cores without handing every block to a pool thread and back.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

__all__ = ["default_threads", "ordered_map"]

_T = TypeVar("_T")
_R = TypeVar("_R")

_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_pool_pid = 0
_pool_size = 0
_running = 0
"""Ordered maps of this process between their first task and their end (under ``_lock``)."""
_running_pid = 0
"""The process ``_running`` counts in (a forked child starts from none)."""


def default_threads() -> int:
    """The CPUs this process may run on: its affinity mask, so that a trainer rank or a
    serving worker pinned to a few cores sizes its worker threads to those (construction,
    apply, proofs and the engines' worker threads start from this)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no affinity API on this platform
        return os.cpu_count() or 1


def _executor(threads: int) -> ThreadPoolExecutor:
    global _pool, _pool_pid, _pool_size
    with _lock:
        pid = os.getpid()
        if _pool is None or _pool_pid != pid or _pool_size < threads:
            # A smaller pool of this process keeps serving the blocks already submitted to it.
            _pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="dcr-build")
            _pool_pid, _pool_size = pid, threads
        return _pool


def ordered_map(
    fn: Callable[[_T], _R], tasks: Iterable[_T], *, threads: int, window: int | None = None
) -> Iterator[_R]:
    """``fn`` over ``tasks`` on up to ``threads`` worker threads, results in task order.

    At most ``window`` (default ``2 * threads``) tasks are submitted ahead of the one being
    consumed.  With ``threads <= 1`` everything runs in the calling thread, and so does each
    task for which the maps running in this process at the time leave this one a share of
    ``threads`` below two (``threads // maps``): the consuming thread is a CPU's worth of
    work already.  Closing the iterator early cancels the tasks not yet started.  An
    exception raised by ``fn`` propagates when its result is reached.
    """
    if threads <= 1:
        for task in tasks:
            yield fn(task)
        return
    global _running, _running_pid
    pid = os.getpid()
    with _lock:
        if _running_pid != pid:
            _running, _running_pid = 0, pid
        _running += 1
    pending: deque[Future[_R]] = deque()
    try:
        pool = _executor(threads)
        ahead = max(1, window if window is not None else 2 * threads)
        for task in tasks:
            if threads // _running < 2:
                while pending:
                    yield pending.popleft().result()
                yield fn(task)
                continue
            pending.append(pool.submit(fn, task))
            if len(pending) >= ahead:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        for f in pending:
            f.cancel()
        with _lock:
            if _running_pid == pid:  # a map a forked child inherited counts in the parent
                _running -= 1
