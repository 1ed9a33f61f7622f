"""Paged row storage for the consumer's in-flight requests, like a KV cache: fixed-size blocks in a few large
chunks, a block table per request, and appends of a whole message as a few numpy scatters (socket-free).

One `Arena` per row shape (its row is `row_bytes` bytes). A request's rows for that shape live under an integer
handle: `n[h]` positions are held, `bt[h, :nblk[h]]` are its blocks, and position p is row `p % B` of block
`bt[h, p // B]`. Blocks come from a free stack (the blocks of finished requests are reused first); chunks are
anonymous mappings of CHUNK_BYTES with their pages populated at once (MAP_POPULATE, small pages: about twice as
cheap per byte as faulting them in row by row on the 2-vCPU VM of docs/PERFORMANCE.md, and no 2 MiB fault or
compaction stall in the middle of a message); they are never returned to the system.

Memory: each request holds at most B rows it does not use (B = BLOCK_ROWS), plus 4 bytes per
block-table entry: the table is (handles, widest request's blocks) int32, so one request of 1M positions makes
the table 256 KiB per handle slot (1,024 slots: 256 MiB; fine for thousands of requests of up to ~64k positions,
costly when a few requests run to the default max_positions of 2M: docs/PERFORMANCE.md).
"""

from __future__ import annotations

import mmap

import numpy as np

BLOCK_ROWS = 16
CHUNK_BYTES = 2 << 20            # one mapping per this many bytes of blocks (populated at once: ~1 ms here)
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


def _map_chunk(nbytes: int) -> mmap.mmap:
    """An anonymous private mapping of `nbytes`, populated where the OS can (Linux), small pages."""
    flags = mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", 0x20)
    m = mmap.mmap(-1, nbytes, flags=flags | _POPULATE)
    if hasattr(m, "madvise") and hasattr(mmap, "MADV_NOHUGEPAGE"):
        m.madvise(mmap.MADV_NOHUGEPAGE)      # a 2 MiB fault (zeroing, compaction) would stall one message
    return m


def void_rows(buf, row_bytes: int) -> np.ndarray:
    """A bytes-like payload as a 1-D array of `row_bytes`-byte elements (no copy)."""
    return np.frombuffer(buf, dtype=np.dtype((np.void, row_bytes)))


class Arena:
    """Own the blocks of every request of one row shape, their block tables and fill counts.

    Invariant: every live handle has room for its next row: `cur[h]` is the arena row of position n[h] and
    `left[h] >= 1` rows are free in that block, so a decode step (one row per request) is one gather of `cur`,
    one scatter of the rows and three in-place updates, whatever the number of requests.
    """

    def __init__(self, row_bytes: int, block_rows: int = BLOCK_ROWS, chunk_bytes: int = CHUNK_BYTES):
        self.row_bytes = row_bytes
        self.B = block_rows
        self.block_bytes = block_rows * row_bytes
        self.bpc = max(1, chunk_bytes // self.block_bytes)      # blocks per chunk
        self.crows = self.bpc * block_rows                       # rows per chunk
        self.vdt = np.dtype((np.void, row_bytes))
        self.chunks: list[np.ndarray] = []                       # (crows,) void rows each
        self.free = np.empty(0, dtype=np.int64)                  # stack of free block ids: free[:nfree]
        self.nfree = 0
        self.n = np.zeros(16, dtype=np.int64)                    # positions held per handle
        self.nblk = np.zeros(16, dtype=np.int64)                 # blocks per handle
        self.cur = np.zeros(16, dtype=np.int64)                  # arena row of position n[h]
        self.left = np.zeros(16, dtype=np.int64)                 # free rows in that block (>= 1)
        self.bt = np.zeros((16, 8), dtype=np.int32)              # block table (block ids < 2**31)
        self._free_handles: list[int] = []
        self._next_handle = 0
        self.live_blocks = 0

    # ---- handles ------------------------------------------------------------------------------------------------

    def new_handle(self) -> int:
        return self.new_handles(1)[0]

    def new_handles(self, k: int) -> list:
        """k handles with no rows yet (each with room for its first row), made with one block allocation."""
        hs = []
        for _ in range(k):
            if self._free_handles:
                hs.append(self._free_handles.pop())
                continue
            h = self._next_handle
            self._next_handle += 1
            if h >= len(self.n):
                cap = 2 * len(self.n)
                for name in ("n", "nblk", "cur", "left"):
                    setattr(self, name, np.resize(getattr(self, name), cap))
                bt = np.zeros((cap, self.bt.shape[1]), dtype=np.int32)
                bt[:len(self.bt)] = self.bt
                self.bt = bt
            hs.append(h)
        if hs:
            arr = np.array(hs, dtype=np.int64)
            self.n[arr] = 0
            self.nblk[arr] = 0
            self.fix(arr)
        return hs

    def release(self, h: int) -> int:
        """Give handle `h` and its blocks back; returns the bytes freed."""
        k = int(self.nblk[h])
        if k:
            self._push(self.bt[h, :k][::-1])
            self.live_blocks -= k
        self.nblk[h] = 0
        self.n[h] = 0
        self._free_handles.append(h)
        return k * self.block_bytes

    def allocated(self, h: int) -> int:
        return int(self.nblk[h]) * self.block_bytes

    @property
    def held_bytes(self) -> int:
        return self.live_blocks * self.block_bytes

    # ---- blocks -------------------------------------------------------------------------------------------------

    def _push(self, ids: np.ndarray) -> None:
        k = len(ids)
        if self.nfree + k > len(self.free):
            self.free = np.resize(self.free, max(2 * len(self.free), self.nfree + k))
        self.free[self.nfree:self.nfree + k] = ids
        self.nfree += k

    def _alloc(self, k: int) -> np.ndarray:
        while self.nfree < k:
            c = len(self.chunks)
            self.chunks.append(np.frombuffer(_map_chunk(self.crows * self.row_bytes), dtype=self.vdt))
            self._push(np.arange((c + 1) * self.bpc - 1, c * self.bpc - 1, -1, dtype=np.int64))
        self.nfree -= k
        return self.free[self.nfree:self.nfree + k][::-1].copy()

    def ensure(self, hs: np.ndarray, upto: np.ndarray) -> None:
        """Give each handle hs[i] (distinct) blocks for positions [0, upto[i])."""
        want = (upto + self.B - 1) // self.B
        need = want - self.nblk[hs]
        grow = need > 0
        if not grow.any():
            return
        hs, need, want = hs[grow], need[grow], want[grow]
        total = int(need.sum())
        wmax = int(want.max())
        if wmax > self.bt.shape[1]:
            w = max(wmax, 2 * self.bt.shape[1])
            bt = np.zeros((len(self.bt), w), dtype=np.int32)
            bt[:, :self.bt.shape[1]] = self.bt
            self.bt = bt
        ids = self._alloc(total)
        first = np.cumsum(need) - need
        rep = np.repeat(hs, need)
        col = np.repeat(self.nblk[hs] - first, need) + np.arange(total)
        self.bt[rep, col] = ids
        self.nblk[hs] += need
        self.live_blocks += total

    def fix(self, hs: np.ndarray) -> None:
        """Restore the invariant for handles hs (distinct) after n moved: room for the next row, cur and left."""
        v = self.n[hs]
        self.ensure(hs, v + 1)
        self.cur[hs] = self.bt[hs, v // self.B].astype(np.int64) * self.B + v % self.B
        self.left[hs] = self.nblk[hs] * self.B - v

    def append_one(self, hd: np.ndarray) -> np.ndarray:
        """One row for each of the distinct handles hd at its position n: returns the arena row of each, and
        moves n on (allocating blocks for those whose block is now full)."""
        flat = self.cur[hd]
        self.cur[hd] = flat + 1
        left = self.left[hd] - 1
        self.left[hd] = left
        self.n[hd] += 1
        if not left.all():
            self.fix(hd[left == 0])
        return flat

    def rows_at(self, rh: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """The arena-wide row index of position pos[i] of handle rh[i] (its block must exist)."""
        return self.bt[rh, pos // self.B].astype(np.int64) * self.B + pos % self.B

    def scatter(self, flat: np.ndarray, src: np.ndarray) -> None:
        """Write src[i] (void rows) to arena row flat[i]. Where the target rows run on consecutively (a long entry
        whose blocks were allocated together: prefill chunks) each run is one slice copy; short runs (decode: one
        row per request) go row by row in one fancy assignment."""
        n = len(flat)
        if not n:
            return
        if n >= 64:
            brk = np.flatnonzero((np.diff(flat) != 1) | (flat[1:] % self.crows == 0)) + 1
            if len(brk) * 32 < n:
                cr = self.crows
                for a, b in zip([0, *brk.tolist()], [*brk.tolist(), n]):
                    f0 = int(flat[a])
                    c = f0 // cr
                    self.chunks[c][f0 - c * cr:f0 - c * cr + b - a] = src[a:b]
                return
        self._put_rows(flat, src)

    def _put_rows(self, flat: np.ndarray, src: np.ndarray) -> None:
        if len(self.chunks) == 1:
            self.chunks[0][flat] = src
            return
        c = flat // self.crows
        c0, c1 = int(c.min()), int(c.max())
        if c0 == c1:
            self.chunks[c0][flat - c0 * self.crows] = src
            return
        for ci in np.unique(c).tolist():
            m = c == ci
            self.chunks[ci][flat[m] - ci * self.crows] = src[m]

    def gather(self, h: int, m: int, out: np.ndarray | None = None) -> np.ndarray:
        """Positions [0, m) of handle h as (m,) void rows, copied into `out` (or a new array): runs of consecutive
        blocks as one slice each, scattered blocks a block at a time."""
        if out is None:
            out = np.empty(max(m, 0), dtype=self.vdt)
        if m <= 0:
            return out
        B = self.B
        nb = (m + B - 1) // B
        blocks = self.bt[h, :nb]
        brk = np.flatnonzero((np.diff(blocks) != 1) | (blocks[1:] % self.bpc == 0)) + 1
        if len(brk) * 8 < nb:                       # long runs: one slice copy each
            cr = self.crows
            for a, b in zip([0, *brk.tolist()], [*brk.tolist(), nb]):
                f0 = int(blocks[a]) * B
                c = f0 // cr
                lo, hi = a * B, min(b * B, m)
                out[lo:hi] = self.chunks[c][f0 - c * cr:f0 - c * cr + hi - lo]
            return out
        full = m // B
        dst = out[:full * B].reshape(full, B)
        if len(self.chunks) == 1:
            src = self.chunks[0].reshape(self.bpc, B)
            np.take(src, blocks[:full], axis=0, out=dst, mode="clip")
            if full < nb:
                out[full * B:m] = src[blocks[full], :m - full * B]
            return out
        c = blocks // self.bpc
        local = blocks - c * self.bpc
        for ci in np.unique(c[:full]).tolist():
            sel = c[:full] == ci
            dst[sel] = self.chunks[ci].reshape(self.bpc, B)[local[:full][sel]]
        if full < nb:
            out[full * B:m] = self.chunks[int(c[full])].reshape(self.bpc, B)[local[full], :m - full * B]
        return out

    def write(self, h: int, start: int, src: np.ndarray) -> None:
        """Write void rows `src` at positions [start, start + len(src)) of handle h (allocating blocks); n[h]
        becomes at least start + len(src)."""
        k = len(src)
        if not k:
            return
        hs = np.array([h], dtype=np.int64)
        self.ensure(hs, np.array([start + k], dtype=np.int64))
        self.scatter(self.rows_at(np.full(k, h, dtype=np.int64), np.arange(start, start + k, dtype=np.int64)),
                     src)
        if start + k > self.n[h]:
            self.n[h] = start + k
            self.fix(hs)
