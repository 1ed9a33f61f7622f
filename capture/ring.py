"""Hand out contiguous row ranges of a circular arena, freed in any order, reused only once their copy has landed.

The arena is `capacity` rows. `alloc(n)` takes rows [lo, lo + n) at the head, wrapping to row 0 when the rows
left before the end are too few (the skipped tail is wasted until the tail pointer passes it). Ranges are
reclaimed in allocation order: a range freed early waits until every older range is freed too. A range can be
freed before the copy into it has finished (a dropped delta is released before anyone waited on it); then it
carries a `fence` (anything with `query() -> bool`, a CUDA event) and its rows stay taken until the fence has
passed. Nothing here blocks: a full arena makes `alloc` return None.

With capacity (S + 1) * M, an allocation of at most M rows always fits while fewer than S ranges are
unreclaimed (at most one wasted tail of under M rows is live at a time). Ranges come back in allocation order,
so for a consumer that releases in order (the Producer's thread does) these are exactly the ranges in flight.
`AsyncCopier` sizes the arena that way for S worst-case steps in flight; small steps pack densely.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any


class RingRange:
    """One allocation of a RowRing: rows [lo, hi), whether it was freed, the fence its reuse waits on, and the rows
    it charged against the arena (its own plus a wasted tail when it wrapped)."""

    __slots__ = ("lo", "hi", "freed", "fence", "charged")

    def __init__(self, lo: int, hi: int, charged: int):
        self.lo = lo
        self.hi = hi
        self.freed = False
        self.fence: Any = None
        self.charged = charged


class RowRing:
    """Own the allocation state (head, tail, live ranges) of a circular arena of `capacity` rows."""

    __slots__ = ("capacity", "_head", "_tail", "_live", "_lock", "_used")

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"ring capacity must be at least 1 row, got {capacity}")
        self.capacity = capacity
        self._head = 0            # next row to hand out
        self._tail = 0            # oldest row still taken
        self._used = 0            # rows between tail and head, wasted tails included
        self._live: deque[RingRange] = deque()   # ranges made by alloc(), oldest first
        self._lock = threading.Lock()

    @property
    def used_rows(self) -> int:
        """Rows not available to `alloc` right now (live ranges, freed ones behind a live one, wasted tails)."""
        return self._used

    @property
    def free_rows(self) -> int:
        """Rows not taken after reclaiming what can be (an allocation of fewer may still not fit when it would
        wrap: the rows before the end are skipped then)."""
        with self._lock:
            self._reclaim()
            return self.capacity - self._used

    @property
    def live_ranges(self) -> int:
        return len(self._live)

    def _reclaim(self) -> None:
        live = self._live
        while live:
            entry = live[0]
            if not entry.freed:
                return
            if entry.fence is not None:
                if not entry.fence.query():
                    return
                entry.fence = None
            live.popleft()
            self._used -= entry.charged
            self._tail = entry.hi % self.capacity
        self._head = self._tail = 0      # empty: start over at row 0, nothing wasted

    def alloc(self, n: int) -> tuple[int, RingRange] | None:
        """Take n contiguous rows. Returns (lo, handle) or None when they do not fit now."""
        if not 0 < n <= self.capacity:
            raise ValueError(f"cannot allocate {n} rows from a ring of {self.capacity}")
        with self._lock:
            self._reclaim()
            head, free = self._head, self.capacity - self._used
            if head + n <= self.capacity:
                lo, charged = head, n
            else:                                   # wrap: the rows before the end are wasted
                lo, charged = 0, n + self.capacity - head
            if charged > free:
                return None
            entry = RingRange(lo, lo + n, charged)
            self._used += charged
            self._live.append(entry)
            self._head = (lo + n) % self.capacity
            return lo, entry

    def free(self, handle: RingRange, fence: Any = None) -> None:
        """Give a range back; with a fence its rows are reused only once `fence.query()` is true. Idempotent."""
        with self._lock:
            if handle.freed:
                return
            handle.fence = fence
            handle.freed = True
            self._reclaim()
