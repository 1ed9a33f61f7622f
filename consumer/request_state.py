"""Hold what the Accumulator knows of one in-flight request: how it ended (`_Ending`), its rows for each layer
range (`_Rows` in an arena region, or `_Adopted`: still the received frame's bytes), everything else (`_Request`),
and the [lo, hi) range helpers these and the Accumulator's collaborators (consumer/prefix_refs.py,
consumer/records.py) share.

No logic of its own beyond the rows' bookkeeping: the Accumulator (consumer/accumulator.py) moves the state.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from routing_replay.consumer.arena import Arena, void_rows


class _Ending(NamedTuple):
    """How a request ended, as its finish, abort or timeout said: what consumer/records.py turns into a Record."""

    num_output: int
    reason: str               # the engine's finish reason ("stop", "length", ...), or the abort's / "timeout"
    lost: list                # [[lo, hi], ...] positions the producer dropped (finish only)
    output_tokens: object     # np.ndarray of output token ids, or None
    aborted: bool             # an abort or a timeout: the record is incomplete whatever it holds
    refused: list | tuple = ()  # of `lost`: ranges the producer refused to send (their rows failed its checks)
    broker_refused: list | tuple = ()   # of `lost`: ranges of deltas the broker accepted and dropped


class _Rows:
    """Own one request's rows for one layer range: positions [0, n) under a handle of the shape's Arena, and the
    holes below n (positions never written, held as -1 rows)."""

    __slots__ = ("arena", "h", "holes", "row_bytes")

    def __init__(self, arena: Arena, h: int | None = None):
        self.arena = arena
        self.h = arena.new_handle() if h is None else h
        self.holes: list[list[int]] = []
        self.row_bytes = arena.row_bytes

    @property
    def n(self) -> int:
        """Positions [0, n) are held."""
        return int(self.arena.n[self.h])

    @property
    def allocated(self) -> int:
        return self.arena.allocated(self.h)

    def write(self, start: int, count: int, chunk) -> None:
        """Write `count` rows (bytes-like `chunk`) at `start` (the arena counts the positions it holds)."""
        if count == 0:                                  # an entry with no rows says nothing (found by atheris)
            return
        a, h = self.arena, self.h
        end = start + count
        n = int(a.n[h])
        if start > n:                                   # a hole: -1 rows, remembered as missing
            a.write(h, n, np.frombuffer(b"\xff" * ((start - n) * self.row_bytes), dtype=a.vdt))
            self.holes.append([n, start])
        elif start < n and self.holes:
            self.holes = _subtract(self.holes, start, end)
        a.write(h, start, void_rows(chunk, self.row_bytes))

    def missing(self, lo: int, hi: int) -> list[list[int]]:
        """Positions in [lo, hi) that were never written."""
        n = self.n
        out = [[max(a, lo), min(b, hi)] for a, b in self.holes if b > lo and a < hi]
        if n < hi:
            out.append([max(n, lo), hi])
        return _merge(out)

    def copy_into(self, arr: np.ndarray, lo: int, hi: int, upto: int) -> None:
        """Copy positions [0, min(n, upto)) into arr[:, lo:hi] (arr is (T, L, K) of the rows' dtype)."""
        m = min(self.n, upto)
        if m <= 0:
            return
        T, L, K = arr.shape
        if lo == 0 and hi == L and arr.flags.c_contiguous:       # all layers: straight into the record's rows
            self.arena.gather(self.h, m, arr.reshape(T, L * K).view(self.arena.vdt).reshape(T))
            return
        arr[:m, lo:hi] = self.arena.gather(self.h, m).view(arr.dtype).reshape(m, hi - lo, K)

    def release(self) -> int:
        """Give the region back; returns the bytes freed."""
        return self.arena.release(self.h)


class _Adopted:
    """One request's first rows for one layer range, positions [0, n), kept as the bytes of the message they
    arrived in: no copy. They stay so until another message touches the request (then they move to the arena,
    `Accumulator._materialize`: the copy that was saved is made then) or its record is built (its prompt rows a
    view of them, `records.build_adopted`). Every view holds the received frame."""

    __slots__ = ("buf", "row_bytes", "shape", "holes")

    def __init__(self, buf: np.ndarray, row_bytes: int, shape: tuple):
        self.buf = buf              # (n * row_bytes,) uint8, a view of the received frame
        self.row_bytes = row_bytes
        self.shape = shape          # (L, K, layer_lo, layer_hi, id dtype)
        self.holes: list = []       # (none: they start at position 0)

    @property
    def n(self) -> int:
        return len(self.buf) // self.row_bytes

    @property
    def allocated(self) -> int:
        return len(self.buf)

    def release(self) -> int:
        """Let go of the rows (views handed out keep the frame); returns the bytes no longer held."""
        nbytes = len(self.buf)
        self.buf = self.buf[:0]
        return nbytes


def _subtract(holes: list[list[int]], lo: int, hi: int) -> list[list[int]]:
    """`holes` without the positions [lo, hi) (a write there filled them)."""
    out = []
    for a, b in holes:
        if b <= lo or a >= hi:
            out.append([a, b])
            continue
        if a < lo:
            out.append([a, lo])
        if b > hi:
            out.append([hi, b])
    return out


def _in_ranges(n: int, ranges: list[list[int]]) -> np.ndarray:
    """(n,) bool: positions [0, n) that fall in any [lo, hi) of `ranges`."""
    m = np.zeros(n, dtype=bool)
    for a, b in ranges:
        if a < n and b > a:
            m[max(a, 0):min(b, n)] = True
    return m


def _runs(mask: np.ndarray) -> list[list[int]]:
    """The [lo, hi) runs of True in a bool vector."""
    d = np.diff(np.concatenate(([0], mask.view(np.int8), [0])))
    return [[int(a), int(b)] for a, b in zip(np.flatnonzero(d == 1), np.flatnonzero(d == -1))]


def _merge(ranges: list[list[int]]) -> list[list[int]]:
    """`ranges` sorted, the empty ones dropped, the overlapping or touching ones joined."""
    ranges = sorted(r for r in ranges if r[1] > r[0])
    out: list[list[int]] = []
    for a, b in ranges:
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out



class _Request:
    """Own everything known about one in-flight request until its record is emitted."""

    __slots__ = ("rid", "opened", "prompt_len", "num_cached", "prefix_filled", "num_layers", "top_k", "layer_ids",
                 "ranges", "last_seen", "prompt_tokens", "finish", "finish_at", "notes", "refused", "shapes",
                  "seen_n", "key", "damaged", "lease", "refs", "resolved", "entry",
                  "ref_rows", "id_dtype")

    def __init__(self, rid: str, now: float):
        self.rid = rid
        self.opened = False
        self.prompt_len = None
        self.num_cached = 0
        self.prefix_filled = False  # the producer sends rows [0, num_cached) too (its prefix store)
        self.num_layers = None
        self.top_k = None
        self.layer_ids = None
        self.ranges: dict[tuple[int, int], _Rows] = {}
        self.last_seen = now
        self.prompt_tokens = None
        self.finish: _Ending | None = None
        self.finish_at = 0.0
        self.notes: list[str] = []  # reasons gathered on the way (reassigned, refused, ...)
        self.refused = False
        self.shapes: list = []      # the row shapes it holds rows of (see Accumulator._delta)
        self.seen_n = 0
        self.key = None             # (producer, epoch, seq): the newest open/finish/abort applied to it
        self.damaged = False        # a message for it could not be read: its record can never be complete
        self.lease = None           # (layer range, lease) when the last build's arrays are a view of its rows
        self.refs: list = []        # [(source, writer_pos, pos, count)] of its open's prefix_refs; source: the
                                    # writer's _Request (in flight at the open), its PoolEntry (pinned), or None
        self.resolved: list = []    # the last build's refs served whole by a PoolEntry (what compaction drops)
        self.entry = None           # the PoolEntry of its prompt rows, once emitted (referencers in flight)
        self.ref_rows = (0, 0, 0)   # the last build's referenced rows: (resolved, of them from a live writer,
                                    # unresolved)
        self.id_dtype = None        # its rows' dtype, from its open or first delta (None: not known yet)
