"""Make the producer thread's request-major copies of step-major rows (request_major, reorder_request_major) into
memory reused once nothing refers to it (OutPool); in C where producer/_gather.c is built, else numpy."""

from __future__ import annotations

import os
import sys
import threading

import numpy as np

try:                    # setup.py builds it where a C compiler and Python's headers are (optional: numpy otherwise)
    from routing_replay.producer import _gather
except ImportError:
    _gather = None
# ROUTING_REPLAY_NATIVE=0: the numpy copy even where the C one is built (benchmarks side by side, tests)
NATIVE = _gather is not None and os.environ.get("ROUTING_REPLAY_NATIVE", "1") != "0"


class OutPool:
    """Memory for the producer thread's request-major copies, used again once nothing refers to it.

    A merged message's rows are a fresh array of megabytes that the replay buffer holds until the consumers ack it;
    a fresh allocation of that size comes from the OS every time, and its first touch (a page fault per 4 KiB) costs
    several times the copy itself into memory in use (docs/PERFORMANCE.md, "Copies into reused memory"). So each
    copy of at least MIN_BYTES goes
    into a view of a pooled root (a 1-D uint8 array, sized up to GRAIN). A root is reused only when CPython counts
    no reference to it but the pool's own: every view of it, every memoryview or ZeroMQ frame made from one, holds
    the root (numpy views refer to the array that owns the memory), so a root still sent, kept for replay, spilled
    or handed to a caller is never written. Beyond MAX_FREE_BYTES of free roots the longest idle go back to the OS.
    One pool per thread (`out_pool()`): no lock."""

    MIN_BYTES = 256 << 10
    GRAIN = 1 << 20
    MAX_FREE_BYTES = 64 << 20

    def __init__(self):
        self.lent: list = []                # roots handed out as views
        self.free: list = []                # roots nothing else refers to
        self.free_bytes = 0
        self.reused = 0                     # takes served from a free root

    @staticmethod
    def _unreferenced(roots: list) -> list:
        """Indexes of the roots that only `roots` refers to."""
        return [i for i, c in enumerate(_refcounts(roots)) if c <= _BASE]

    def _collect(self) -> None:
        idle = set(self._unreferenced(self.lent))
        if not idle:
            return
        keep, free = [], self.free
        for i, r in enumerate(self.lent):
            (free if i in idle else keep).append(r)
        self.lent = keep
        self.free_bytes = sum(r.nbytes for r in free)
        while self.free_bytes > self.MAX_FREE_BYTES:      # the longest idle go back to the OS
            self.free_bytes -= free.pop(0).nbytes

    def empty(self, shape: tuple, dtype) -> np.ndarray:
        """An uninitialised C-order array of `shape`, from a pooled root when it is large."""
        dtype = np.dtype(dtype)
        nbytes = dtype.itemsize * int(np.prod(shape))
        if nbytes < self.MIN_BYTES:
            return np.empty(shape, dtype)
        self._collect()
        root = None
        for i, r in enumerate(self.free):
            if nbytes <= r.nbytes <= 2 * nbytes:
                root = self.free.pop(i)
                self.free_bytes -= root.nbytes
                self.reused += 1
                break
        if root is None:
            root = np.empty(-(-nbytes // self.GRAIN) * self.GRAIN, np.uint8)
        self.lent.append(root)
        return root[:nbytes].view(dtype).reshape(shape)


def _refcounts(roots: list) -> list:
    return [sys.getrefcount(r) for r in roots]


# what _refcounts reports for an array that only its list refers to (measured, not assumed: the same code)
_BASE = _refcounts([np.empty(1, np.uint8)])[0]
_pools = threading.local()


def out_pool() -> OutPool:
    """This thread's OutPool."""
    p = getattr(_pools, "pool", None)
    if p is None:
        p = _pools.pool = OutPool()
    return p


def request_major(arrays: list, inverse: np.ndarray | None = None, native: bool | None = None) -> np.ndarray:
    """Steps of n rows each (one (n, L, K) array per step) as one new C-order array, request-major: request i's rows
    of every step in a row, then request i + 1's; with `inverse`, request i goes to place inverse[i]. One copy, into
    memory of this thread's OutPool: in C (_gather: one sequential pass, streaming stores, the GIL released) where
    it is built and the steps are C-contiguous arrays of one shape and dtype, else numpy. `native`: force one
    (tests, benchmarks); None: NATIVE."""
    a0 = arrays[0]
    n = a0.shape[0]
    out = out_pool().empty((n, len(arrays), *a0.shape[1:]), a0.dtype)
    if (NATIVE if native is None else native) and n and a0.itemsize and _same_contiguous(arrays):
        _gather.gather_rows(out, arrays, _order_of(inverse, n), a0.nbytes // n)
    elif inverse is None:
        np.stack(arrays, axis=1, out=out)
    else:
        for s, a in enumerate(arrays):
            out[inverse, s] = a
    return out.reshape(n * len(arrays), *a0.shape[1:])


def _same_contiguous(arrays: list) -> bool:
    a0 = arrays[0]
    shape, dtype = a0.shape, a0.dtype
    return all(type(a) is np.ndarray and a.flags.c_contiguous and a.shape == shape and a.dtype == dtype
               for a in arrays)


def _order_of(inverse: np.ndarray | None, n: int) -> np.ndarray:
    """The source row of each place: order[inverse[i]] = i (int64), or 0..n-1 without `inverse`."""
    if inverse is None:
        return np.arange(n, dtype=np.int64)
    order = np.empty(n, np.int64)
    order[inverse] = np.arange(n, dtype=np.int64)
    return order


def reorder_request_major(a: np.ndarray, steps: int, inverse: np.ndarray | None = None) -> np.ndarray:
    """Step-major rows `a` of `steps` steps of n rows each as a new array, request-major (DeferredRows.
    result_request_major), in memory of this thread's OutPool."""
    out = out_pool().empty(a.shape, a.dtype)
    n = a.shape[0] // steps
    src = a.reshape(steps, n, *a.shape[1:]).swapaxes(0, 1)
    if inverse is None:
        out.reshape(n, steps, *a.shape[1:])[...] = src
    else:
        out.reshape(n, steps, *a.shape[1:])[inverse] = src
    return out
