"""Row storage for the consumer's in-flight requests: one contiguous region per request in a large reservation of
virtual memory, so that a finished request's record is a view of its rows (no copy) and a whole message is
appended with a few numpy scatters (socket-free).

One `Arena` per row shape (its row is `row_bytes` bytes). Addresses: a *space* is an anonymous private mapping
reserved without commit (MAP_NORESERVE; 1 TiB where the OS allows, smaller where it does not), and rows are
numbered across spaces (`flat`). A request's rows live under an integer handle `h`: position p is row
`base[h] + p`, `cap[h]` rows are reserved for it (a power of two, at least `min_region_rows`), `n[h]` positions
are held. Only the pages rows are written to take memory; a region too small for a write is replaced by one
twice as large (its rows copied once).

Records: `lease(h, m)` hands positions [0, m) of handle h out as an object numpy arrays can wrap
(`__array_interface__`; every view keeps it alive). `detach(h)` gives the handle back but leaves its region with
the lease: once the last view of the record is gone (any thread), the region returns to the free list. Freed
regions keep their pages (the next request reuses them without page faults) up to `keep_limit` in all; beyond
that their pages go back to the OS (MADV_DONTNEED). `keep_bytes=None` (the default) makes the limit the most this
arena has held at once (`peak_bytes`), at least KEEP_BYTES: a consumer that served one rollout batch serves the next
from the pages it already has, and its memory does not go above what that batch took (a first touch costs a page
fault per 4 KiB, more than the copy that writes the row; bench/pipeline.py --batches measures a warm batch).

Memory: what a request's rows take, rounded up to a page, plus 8 x 6 bytes of bookkeeping per handle.
"""

from __future__ import annotations

import collections
import mmap
import sys

import numpy as np

_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform.startswith("linux") else 0)
_PAGE = mmap.PAGESIZE
SPACE_BYTES = (1 << 40, 1 << 36, 1 << 33, 1 << 30)   # reservation sizes tried in turn (strict overcommit: smaller)
MIN_REGION_BYTES = 32 << 20                         # virtual: costs nothing until written
KEEP_BYTES = 256 << 20                               # pages of freed regions kept for reuse (at least)
_GAP = 1                                             # rows between spaces' numbers, so no run crosses two


def void_rows(buf, row_bytes: int) -> np.ndarray:
    """A bytes-like payload as a 1-D array of `row_bytes`-byte elements (no copy)."""
    return np.frombuffer(buf, dtype=np.dtype((np.void, row_bytes)))


class _Space:
    """One reservation: `rows` is its (size,) void-row view; rows [first, first + size) in arena numbering."""

    __slots__ = ("mm", "rows", "first", "size", "top", "addr")

    def __init__(self, nbytes: int, row_bytes: int, first: int):
        flags = mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", 0x20)
        self.mm = mmap.mmap(-1, nbytes, flags=flags | _NORESERVE)
        if hasattr(self.mm, "madvise") and hasattr(mmap, "MADV_NOHUGEPAGE"):
            self.mm.madvise(mmap.MADV_NOHUGEPAGE)     # a 2 MiB page per request's last rows would double memory
        self.size = nbytes // row_bytes
        self.rows = np.frombuffer(self.mm, dtype=np.dtype((np.void, row_bytes)), count=self.size)
        self.addr = self.rows.ctypes.data
        self.first = first
        self.top = 0                                  # rows [0, top) handed out to regions so far


class _Lease:
    """Positions [0, m) of one region, for numpy to wrap; the region is freed when this goes, if armed. `region`:
    (space index, flat start, cap, rows ever written, m)."""

    __slots__ = ("__array_interface__", "_space", "_freed", "_region", "armed", "__weakref__")

    def __init__(self, space: _Space, freed: collections.deque, region: tuple, shape: tuple, addr: int,
                 typestr: str = "<i2"):
        self.__array_interface__ = {"shape": shape, "typestr": typestr, "data": (addr, False), "version": 3}
        self._space = space                           # keeps the mapping alive while a view exists
        self._freed = freed
        self._region = region
        self.armed = False

    def __del__(self):
        if self.armed:
            try:
                self._freed.append(self._region)      # deque.append: safe from any thread
            except Exception:                         # interpreter shutdown
                pass


class Arena:
    """Own the regions of every request of one row shape, their sizes and fill counts.

    A decode step (one row per request) is one gather of `base + n`, one scatter of the rows and two in-place
    updates, whatever the number of requests. `live_blocks * block_bytes` is the bytes of positions held (each
    handle's high-water position; block_bytes is one row).
    """

    def __init__(self, row_bytes: int, min_region_bytes: int = MIN_REGION_BYTES, keep_bytes: int | None = None,
                 space_bytes: tuple = SPACE_BYTES):
        self.row_bytes = row_bytes
        self.block_bytes = row_bytes
        self.vdt = np.dtype((np.void, row_bytes))
        self.min_region_rows = 1 << max(4, (max(1, min_region_bytes // row_bytes) - 1).bit_length())
        self.keep_bytes = keep_bytes                     # None: up to the peak held (keep_limit)
        self.space_bytes = space_bytes
        self.spaces: list[_Space] = []
        self._firsts = np.zeros(0, dtype=np.int64)
        self.free: dict[int, list] = {}                 # cap -> [(space index, flat start, cap, hw)], LIFO
        self.kept_bytes = 0                              # pages of freed regions not given back (their hw rows)
        self._freed: collections.deque = collections.deque()   # regions whose record views are all gone
        self.n = np.zeros(16, dtype=np.int64)            # positions held per handle
        self.base = np.zeros(16, dtype=np.int64)         # flat row of position 0
        self.cap = np.zeros(16, dtype=np.int64)          # rows reserved
        self.alloc = np.zeros(16, dtype=np.int64)        # positions accounted (high-water)
        self.hw = np.zeros(16, dtype=np.int64)           # rows of the region ever written (by anyone before)
        self.sp = np.zeros(16, dtype=np.int64)           # space index
        self._free_handles: list[int] = []
        self._next_handle = 0
        self.live_blocks = 0
        self.leased_blocks = 0                           # rows of records handed out (detach) not yet gone
        self.peak_blocks = 0                             # the most live_blocks + leased_blocks has been
        self.regions_grown = 0
        self.regions_returned = 0

    # ---- handles ------------------------------------------------------------------------------------------------

    def new_handle(self, hint: int = 0) -> int:
        return self.new_handles(1, hint)[0]

    def new_handles(self, k: int, hint: int = 0) -> list:
        """k handles with no rows yet, each with a region of at least max(hint, min_region_rows) rows."""
        self.reclaim()
        hs = []
        for _ in range(k):
            if self._free_handles:
                h = self._free_handles.pop()
            else:
                h = self._next_handle
                self._next_handle += 1
                if h >= len(self.n):
                    cap = 2 * len(self.n)
                    for name in ("n", "base", "cap", "alloc", "hw", "sp"):
                        setattr(self, name, np.resize(getattr(self, name), cap))
            self._give_region(h, self._region_rows(hint))
            self.n[h] = 0
            self.alloc[h] = 0
            hs.append(h)
        return hs

    def release(self, h: int) -> int:
        """Give handle `h` and its region back; returns the bytes freed."""
        freed = int(self.alloc[h]) * self.row_bytes
        self._free_region(self._region(h))
        self._drop_handle(h)
        return freed

    def detach(self, h: int, lease: _Lease) -> int:
        """Give handle `h` back; its region now belongs to `lease` (freed when its last view goes). Returns the
        bytes no longer held for in-flight requests."""
        freed = int(self.alloc[h]) * self.row_bytes
        lease.armed = True
        self._drop_handle(h)
        self.leased_blocks += lease._region[4]        # the record's rows, its -1 tail included, until it goes
        self._note_peak()
        return freed

    def _drop_handle(self, h: int) -> None:
        self.live_blocks -= int(self.alloc[h])
        self.n[h] = 0
        self.alloc[h] = 0
        self.cap[h] = 0
        self._free_handles.append(h)

    def allocated(self, h: int) -> int:
        return int(self.alloc[h]) * self.row_bytes

    @property
    def held_bytes(self) -> int:
        return self.live_blocks * self.row_bytes

    def _note_peak(self) -> None:
        in_use = self.live_blocks + self.leased_blocks
        if in_use > self.peak_blocks:
            self.peak_blocks = in_use

    @property
    def peak_bytes(self) -> int:
        return self.peak_blocks * self.row_bytes

    @property
    def keep_limit(self) -> int:
        """Bytes of freed regions' pages kept for reuse: keep_bytes, or (None) the peak held, at least KEEP_BYTES."""
        if self.keep_bytes is not None:
            return self.keep_bytes
        return max(KEEP_BYTES, self.peak_bytes)

    # ---- regions ------------------------------------------------------------------------------------------------

    def _region(self, h: int, written: int = 0) -> tuple:
        """Handle h's region as the free lists keep it: (space index, flat start, cap, rows ever written)."""
        return (int(self.sp[h]), int(self.base[h]), int(self.cap[h]),
                max(int(self.hw[h]), int(self.n[h]), written))

    def _region_rows(self, want: int) -> int:
        return max(self.min_region_rows, 1 << max(0, int(want) - 1).bit_length())

    def _give_region(self, h: int, cap: int) -> None:
        lst = self.free.get(cap)
        if lst:
            si, flat, cap, hw = lst.pop()
            self.kept_bytes -= hw * self.row_bytes
        else:
            si, flat = self._carve(cap)
            hw = 0
        self.sp[h], self.base[h], self.cap[h], self.hw[h] = si, flat, cap, hw

    def _carve(self, cap: int) -> tuple:
        """Fresh rows [flat, flat + cap) at the top of a space (a new space if none has room)."""
        for si in range(len(self.spaces) - 1, -1, -1):
            s = self.spaces[si]
            if s.size - s.top >= cap:
                s.top += cap
                return si, s.first + s.top - cap
        first = self.spaces[-1].first + self.spaces[-1].size + _GAP if self.spaces else 0
        err = None
        for i, nbytes in enumerate(self.space_bytes):
            nbytes = max(nbytes, cap * self.row_bytes)
            try:
                s = _Space(nbytes, self.row_bytes, first)
                break
            except (OSError, OverflowError, ValueError) as e:      # strict overcommit, address-space limits
                err = e
        else:
            raise MemoryError(f"consumer arena: cannot reserve {cap * self.row_bytes} bytes of address space: {err}")
        if i:       # a smaller reservation than asked for (it may count against a strict commit limit): regions
            # shrink so that one space still holds a few hundred requests (longer ones move to larger regions)
            self.min_region_rows = min(self.min_region_rows, max(16, 1 << max(0, (s.size // 256).bit_length() - 1)))
        self.spaces.append(s)
        self._firsts = np.array([x.first for x in self.spaces], dtype=np.int64)
        s.top = cap
        return len(self.spaces) - 1, first

    def _free_region(self, region: tuple) -> None:
        si, flat, cap, hw = region
        if hw and self.kept_bytes + hw * self.row_bytes > self.keep_limit:
            self._give_back(si, flat, hw)
            hw = 0
        self.kept_bytes += hw * self.row_bytes
        self.free.setdefault(cap, []).append((si, flat, cap, hw))

    def _give_back(self, si: int, flat: int, rows: int) -> None:
        """Return the whole pages of rows [flat, flat + rows) to the OS (they read as zeros afterwards)."""
        s = self.spaces[si]
        a = (flat - s.first) * self.row_bytes
        b = a + rows * self.row_bytes
        a = -(-a // _PAGE) * _PAGE
        b = b // _PAGE * _PAGE
        if b > a and hasattr(s.mm, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
            s.mm.madvise(mmap.MADV_DONTNEED, a, b - a)
            self.regions_returned += 1

    def reclaim(self) -> None:
        """Put the regions of records whose views are all gone back on the free lists."""
        q = self._freed
        while q:
            *region, m = q.popleft()
            self.leased_blocks -= m
            self._free_region(tuple(region))

    def _grow(self, h: int, need: int) -> None:
        """Move handle h to a region of at least `need` rows, copying its positions [0, n)."""
        self.reclaim()
        old = self._region(h)
        m = int(self.n[h])
        self._give_region(h, self._region_rows(max(need, 2 * old[2])))
        if m:
            so, sn = self.spaces[old[0]], self.spaces[int(self.sp[h])]
            o, b = old[1] - so.first, int(self.base[h]) - sn.first
            sn.rows[b:b + m] = so.rows[o:o + m]
        self._free_region(old)
        self.regions_grown += 1

    def ensure(self, hs: np.ndarray, upto: np.ndarray) -> None:
        """Make room for positions [0, upto[i]) of each handle hs[i] (distinct) and count them as held."""
        over = upto > self.cap[hs]
        if over.any():
            for h, u in zip(hs[over].tolist(), upto[over].tolist()):
                self._grow(h, u)
        inc = upto - self.alloc[hs]
        up = inc > 0
        if up.any():
            self.alloc[hs[up]] = upto[up]
            self.live_blocks += int(inc[up].sum())
            self._note_peak()

    def append_one(self, hd: np.ndarray) -> np.ndarray:
        """One row for each of the distinct handles hd at its position n: returns the flat row of each, and moves
        n on (a region that is full moves to a larger one first)."""
        v = self.n[hd]
        self.ensure(hd, v + 1)
        self.n[hd] = v + 1
        return self.base[hd] + v

    def rows_at(self, rh: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """The flat row of position pos[i] of handle rh[i] (room must be ensured)."""
        return self.base[rh] + pos

    def scatter(self, flat: np.ndarray, src: np.ndarray) -> None:
        """Write src[i] (void rows) to flat row flat[i]. Long runs of consecutive rows (prefill) are one slice copy
        each; short runs (decode: one row per request) one fancy assignment per space."""
        n = len(flat)
        if not n:
            return
        if n >= 64:
            brk = np.flatnonzero(np.diff(flat) != 1) + 1
            if len(brk) * 32 < n:
                for a, b in zip([0, *brk.tolist()], [*brk.tolist(), n]):
                    f0 = int(flat[a])
                    s = self._space_of(f0)
                    s.rows[f0 - s.first:f0 - s.first + b - a] = src[a:b]
                return
        if len(self.spaces) == 1:
            self.spaces[0].rows[flat] = src
            return
        si = np.searchsorted(self._firsts, flat, side="right") - 1
        for i in np.flatnonzero(np.bincount(si)).tolist():     # (np.unique imports numpy.ma on first use)
            m = si == i
            s = self.spaces[i]
            s.rows[flat[m] - s.first] = src[m]

    def _space_of(self, flat: int) -> _Space:
        if len(self.spaces) == 1:
            return self.spaces[0]
        return self.spaces[int(np.searchsorted(self._firsts, flat, side="right")) - 1]

    def view(self, h: int, m: int) -> np.ndarray:
        """Positions [0, m) of handle h as (m,) void rows, a view of its region (m <= cap)."""
        s = self.spaces[int(self.sp[h])]
        b = int(self.base[h]) - s.first
        return s.rows[b:b + m]

    def gather(self, h: int, m: int, out: np.ndarray | None = None) -> np.ndarray:
        """Positions [0, m) of handle h as (m,) void rows, copied into `out` (or a new array)."""
        if out is None:
            out = np.empty(max(m, 0), dtype=self.vdt)
        if m > 0:
            out[:m] = self.view(h, m)
        return out

    def lease(self, h: int, m: int, shape: tuple, dtype: np.dtype = np.dtype("<i2")) -> _Lease:
        """Positions [0, m) of handle h (its region grown first if it is smaller) for numpy to wrap as an array of
        `shape` and `dtype` (the rows' expert id dtype; no copy); armed by `detach`."""
        if m > self.cap[h]:
            self._grow(h, m)
        s = self.spaces[int(self.sp[h])]
        return _Lease(s, self._freed, (*self._region(h, m), m), shape,
                      s.addr + (int(self.base[h]) - s.first) * self.row_bytes, dtype.str)

    def write(self, h: int, start: int, src: np.ndarray) -> None:
        """Write void rows `src` at positions [start, start + len(src)) of handle h; n[h] becomes at least
        start + len(src)."""
        k = len(src)
        if not k:
            return
        hs = np.array([h], dtype=np.int64)
        self.ensure(hs, np.array([start + k], dtype=np.int64))
        s = self.spaces[int(self.sp[h])]
        b = int(self.base[h]) - s.first + start
        s.rows[b:b + k] = src
        if start + k > self.n[h]:
            self.n[h] = start + k
