"""Run independent blocks of numpy work on a few threads.

The SEG encoder (:mod:`segnode.node.results.seg_encode`) and its check
(:mod:`segnode.node.results.seg_check`) walk the label map a few slices at a time with numpy
operations (comparisons, ``packbits``, bitwise reductions) that release the GIL. :func:`map_blocks`
hands such blocks to a shared pool of worker threads and returns their results in block order. The
gain is modest because part of each block is Python that holds the GIL: on the H200 machine's CPU
(16 cores) encoding and checking the tissue model's 5-segment SEG of 128 x 512 x 512 took
31.2 + 37.6 ms on one thread, 24.0 + 33.0 ms on four, and more again on eight or sixteen.
The blocks must not write to shared state; their results are combined by the caller.

The pool has ``min(4, os.cpu_count())`` threads (``SEGNODE_ENCODE_THREADS`` overrides it;
1 runs every block in the calling thread). It is created on first use and lives as long as
the process.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from typing import TypeVar

T = TypeVar("T")

_MAX_THREADS = 4
_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None


def threads() -> int:
    """Threads that :func:`map_blocks` uses."""
    configured = os.environ.get("SEGNODE_ENCODE_THREADS", "").strip()
    if configured:
        try:
            return max(1, int(configured))
        except ValueError:
            pass
    return max(1, min(_MAX_THREADS, os.cpu_count() or 1))


def _executor(workers: int) -> ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(workers, thread_name_prefix="segnode-encode")
        return _pool


def blocks(count: int, step: int, parts: int) -> list[tuple[int, int]]:
    """``(start, stop)`` ranges covering ``range(count)`` in about ``parts`` pieces whose
    sizes are multiples of ``step`` (the last one may be shorter)."""
    if count <= 0:
        return []
    steps = -(-count // max(1, step))
    per = -(-steps // max(1, parts)) * max(1, step)
    return [(start, min(count, start + per)) for start in range(0, count, per)]


def map_blocks(fn: Callable[[int, int], T], count: int, step: int) -> list[T]:
    """``[fn(start, stop) for each block]`` over ``range(count)``, in block order.

    Blocks are multiples of ``step`` items, about two per thread (so a slow block does not
    hold up the others long). The first exception raised by a block, in block order, is
    raised here after every block has finished.
    """
    workers = threads()
    ranges = blocks(count, step, 2 * workers)
    if workers == 1 or len(ranges) <= 1:
        return [fn(start, stop) for start, stop in ranges]
    futures = [_executor(workers).submit(fn, start, stop) for start, stop in ranges]
    wait(futures)
    return [future.result() for future in futures]
