"""Accumulate routing rows per request from decoded messages and turn finished requests into Records.

No sockets here: `Accumulator.apply(header, payload_frames, now)` takes one validated message and returns the
records it finished. Rows of one request live in a bytearray per layer range (appends are amortised O(1));
positions are absolute, so a re-sent position overwrites and a jump leaves a hole that is filled with -1 and
reported as missing unless a later delta fills it.

Replays are harmless: the link below delivers each producer's messages in seq order, and a resend is always a
suffix of that order, so re-applying deltas leaves the newest write of every position in place. Request-level
messages are made idempotent here: a finished request remembers the (producer, epoch, seq) that closed it, so
a re-sent open, delta, finish or abort for it is counted as late and never resurrects or duplicates the record,
and a re-sent open of a request in flight keeps its rows.
"""

from __future__ import annotations

import itertools
import logging
from bisect import bisect_right
from collections import OrderedDict
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from routing_replay.protocol import wire

log = logging.getLogger("routing_replay.consumer")

_FILL = 0xFF  # int16 -1 is 0xFFFF
_JITTER = itertools.count()


@dataclass
class AccumulatorStats:
    opened: int = 0
    finished: int = 0
    complete: int = 0
    incomplete: int = 0
    aborted: int = 0
    timed_out: int = 0
    delta_msgs: int = 0
    rows: int = 0
    bytes: int = 0
    late_msgs: int = 0
    refused_msgs: int = 0
    refused_rows: int = 0
    replayed_opens: int = 0


class _Ending(NamedTuple):
    """How a request ended, as its finish, abort or timeout said: what `_build` turns into a Record."""

    num_output: int
    reason: str               # the engine's finish reason ("stop", "length", ...), or the abort's / "timeout"
    lost: list                # [[lo, hi], ...] positions the producer dropped (finish only)
    output_tokens: object     # np.ndarray of output token ids, or None
    aborted: bool             # an abort or a timeout: the record is incomplete whatever it holds


class _Rows:
    """Own one request's rows for one layer range: positions [0, n) in blocks, and the holes below n.

    Blocks are preallocated bytearrays (the next one holds max(16 rows, n/8, the rows being written); the first
    one 16-31 rows, varied so that requests in lockstep do not all grow at the same step), so an
    append is one copy into free space: no realloc ever re-copies earlier rows, and unused capacity stays
    below about 1/8 of what is held.
    """

    __slots__ = ("blocks", "starts", "n", "cap", "holes", "row_bytes", "allocated", "view", "boff", "bend")

    def __init__(self, row_bytes: int):
        self.blocks: list[bytearray] = []
        self.starts: list[int] = []       # first position of each block
        self.n = 0                        # positions [0, n) are held
        self.cap = 0                      # positions [0, cap) fit in the blocks
        self.holes: list[list[int]] = []
        self.row_bytes = row_bytes
        self.allocated = 0
        # append cursor: the last block, the byte offset of position n in it, and its end (the fast path)
        self.view = memoryview(b"")
        self.boff = 0
        self.bend = 0

    def _grow(self, need_rows: int) -> None:
        # the first block's size varies by 0-15 rows from one _Rows to the next, so requests decoding in lockstep
        # grow at different steps (at most ~8 of 128 per step, not all 128 at once: a latency spike)
        rows = max(16 + next(_JITTER) % 16 if not self.cap else 16, self.cap >> 3, need_rows)
        self.blocks.append(bytearray(rows * self.row_bytes))
        self.starts.append(self.cap)
        self.cap += rows
        self.allocated += rows * self.row_bytes

    def _put(self, pos: int, chunk) -> None:
        """Copy chunk (whole rows) to positions starting at pos < cap, across blocks as needed."""
        rb = self.row_bytes
        i = bisect_right(self.starts, pos) - 1
        done = 0
        total = len(chunk)
        while done < total:
            blk = self.blocks[i]
            off = (pos - self.starts[i]) * rb
            k = min(len(blk) - off, total - done)
            blk[off:off + k] = chunk[done:done + k]
            done += k
            pos += k // rb
            i += 1

    def write(self, start: int, count: int, chunk) -> None:
        if count == 0:                                  # an entry with no rows says nothing (found by atheris)
            return
        end = start + count
        if end > self.cap:
            self._grow(end - self.cap)
        n = self.n
        if start > n:                                   # a hole: -1 rows, remembered as missing
            self._put(n, b"\xff" * ((start - n) * self.row_bytes))
            self.holes.append([n, start])
        elif start < n and self.holes:
            self.holes = _subtract(self.holes, start, end)
        self._put(start, chunk)
        if end > n:
            self.n = end
        last = self.blocks[-1]
        self.view = memoryview(last)
        self.boff = (self.n - self.starts[-1]) * self.row_bytes
        self.bend = len(last)

    def missing(self, lo: int, hi: int) -> list[list[int]]:
        """Positions in [lo, hi) that were never written."""
        out = [[max(a, lo), min(b, hi)] for a, b in self.holes if b > lo and a < hi]
        if self.n < hi:
            out.append([max(self.n, lo), hi])
        return _merge(out)

    def copy_into(self, arr: np.ndarray, lo: int, hi: int, upto: int) -> None:
        """Copy positions [0, min(n, upto)) into arr[:, lo:hi] (arr is (T, L, K) int16)."""
        m = min(self.n, upto)
        K = arr.shape[2]
        for blk, s in zip(self.blocks, self.starts):
            if s >= m:
                break
            k = min(m, s + len(blk) // self.row_bytes) - s
            arr[s:s + k, lo:hi] = np.frombuffer(blk, dtype=wire.ROW_DTYPE, count=k * (hi - lo) * K).reshape(
                k, hi - lo, K)


def _subtract(holes: list[list[int]], lo: int, hi: int) -> list[list[int]]:
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
                 "ranges", "last_seen", "prompt_tokens", "finish", "finish_at", "notes", "refused", "cursor_shapes",
                 "seen_n", "key", "damaged")

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
        self.cursor_shapes: list = []  # the append cursors this request has (see Accumulator._delta)
        self.seen_n = 0
        self.key = None             # (producer, epoch, seq): the newest open/finish/abort applied to it
        self.damaged = False        # a message for it could not be read: its record can never be complete


class Accumulator:
    """Own every in-flight request's rows; emit a Record when a request finishes, aborts or times out.

    finish_grace_s: a finish that leaves rows missing waits this long for late deltas (they may come from
    another producer, e.g. another pipeline stage) before the record is emitted as incomplete.
    request_timeout_s: a request with no message for this long is emitted as incomplete (reason "timeout").
    max_positions: per request; max_bytes: all in-flight rows together. Deltas beyond either are refused,
    counted, and the request's record is marked incomplete. max_record_bytes: an open, finish or abort that
    announces a record larger than this (positions x layers x top_k x 2) is refused as a protocol error
    ("too_large") before anything is allocated; the request then times out as incomplete.
    remember_finished: how many finished request ids (and the message that closed each) are remembered, so
    that a re-sent message for one of them is recognised as late.
    """

    def __init__(self, *, finish_grace_s: float = 0.5, request_timeout_s: float = 600.0,
                 max_positions: int = 1 << 21, max_bytes: int = 16 << 30, max_record_bytes: int = 4 << 30,
                 remember_finished: int = 100_000):
        if remember_finished < 0:
            raise ValueError(f"remember_finished must be >= 0, got {remember_finished}")
        self.finish_grace_s = finish_grace_s
        self.request_timeout_s = request_timeout_s
        self.max_positions = max_positions
        self.max_bytes = max_bytes
        self.max_record_bytes = max_record_bytes
        self.requests: dict[str, _Request] = {}
        self.pending_finish: dict[str, _Request] = {}
        self._finished_ids: OrderedDict[str, tuple | None] = OrderedDict()
        self._pids: dict[str, str] = {}
        self._remember = remember_finished
        self.bytes_held = 0
        self.stats = AccumulatorStats()
        # per row shape (L, K, layer_lo, layer_hi): request id -> append cursor into its last block
        self._cursors: dict[tuple, dict[str, list]] = {}

    # ---- input --------------------------------------------------------------------------------------------------

    def apply(self, h: wire.Header, frames: list, now: float) -> list[wire.Record]:
        """Apply one message (header already decoded). Raises wire.ProtocolError for a malformed one."""
        kind = h.kind
        if kind == "delta":
            self._delta(wire.parse_delta(h), frames, now)
            return self._ready(now) if self.pending_finish else []
        # who sent a request-level message, kept per request (and per finished id): producer ids interned
        key = (self._pids.setdefault(h.producer, h.producer) if len(self._pids) < 4096 else h.producer,
               h.epoch, h.seq)
        if kind == "open":
            o = wire.parse_open(h)
            if self._open(o, frames, now, key) and h.body.get("reassigned"):
                self.mark(o.request_id, "consumer_lost", now)
            return []
        if kind == "finish":
            return self._finish(wire.parse_finish(h), frames, now, key)
        if kind == "abort":
            rid, reason, n = wire.parse_abort(h)
            return self._abort(rid, reason, n, now, key)
        raise wire.ProtocolError("unexpected_kind", f"consumer does not take {kind!r} messages")

    def _get(self, rid: str, now: float) -> _Request | None:
        st = self.requests.get(rid)
        if st is None:
            if rid in self._finished_ids:
                return None
            st = self.requests[rid] = _Request(rid, now)
        return st

    def _check_size(self, rid: str, positions: int, L: int, K: int, what: str) -> None:
        nbytes = positions * L * K * wire.ROW_DTYPE.itemsize
        if positions > self.max_positions or nbytes > self.max_record_bytes:
            raise wire.ProtocolError("too_large", f"{what} for {rid[:64]!r} announces {positions} positions of "
                                     f"({L}, {K}) = {nbytes} bytes; limits: max_positions={self.max_positions}, "
                                     f"max_record_bytes={self.max_record_bytes}")

    @staticmethod
    def _older(key: tuple | None, new: tuple) -> bool:
        """True if `new` (producer, epoch, seq) is a re-send of something at or before `key` (same producer)."""
        return key is not None and key[0] == new[0] and key[1] == new[1] and new[2] <= key[2]

    def _open(self, o: wire.Open, frames: list, now: float, key: tuple) -> bool:
        """Apply an open; False if it was a re-sent open of a request already closed (counted, ignored)."""
        self._check_size(o.request_id, o.prompt_len, o.num_layers, o.top_k, "open")
        tokens = None
        if o.n_prompt_tokens:
            if len(frames) != 1:
                raise wire.ProtocolError("frame_count", f"open announces {o.n_prompt_tokens} prompt tokens "
                                         f"but has {len(frames)} payload frames")
            tokens = wire.tokens_from_frame(frames[0], o.n_prompt_tokens, "prompt token")
        st = self.requests.get(o.request_id)
        closed = self._finished_ids.get(o.request_id) if st is None else (st.key if st.finish is not None else None)
        if self._older(closed, key):
            self.stats.replayed_opens += 1
            return False
        if st is None or st.finish is not None:
            self._finished_ids.pop(o.request_id, None)
            if st is not None:
                self.pending_finish.pop(o.request_id, None)
                self._drop(st)
            st = self.requests[o.request_id] = _Request(o.request_id, now)
        if st.num_layers is not None and (st.num_layers, st.top_k) != (o.num_layers, o.top_k):
            raise wire.ProtocolError("shape_mismatch", f"open for {o.request_id!r} says L={o.num_layers} "
                                     f"K={o.top_k}, its rows so far are L={st.num_layers} K={st.top_k}")
        if tokens is not None:
            st.prompt_tokens = tokens
        if not st.opened:
            self.stats.opened += 1
        st.opened = True
        st.prompt_len, st.num_cached, st.prefix_filled = o.prompt_len, o.num_cached, o.prefix_filled
        st.num_layers, st.top_k, st.layer_ids = o.num_layers, o.top_k, o.layer_ids
        st.last_seen = now
        if st.key is None or not self._older(st.key, key):
            st.key = key
        return True

    def mark(self, rid: str, note: str, now: float) -> None:
        """Attach a reason (e.g. 'consumer_lost') that explains rows this consumer could not have seen."""
        st = self._get(rid, now)
        if st is not None and note not in st.notes:
            st.notes.append(note)

    def mark_damaged(self, rid: str, note: str) -> bool:
        """A message for `rid` could not be read (its rows, or how it ended, are unknown): if the request is held
        here, its record is marked incomplete with `note` as a reason. False if `rid` is not held."""
        st = self.requests.get(rid) if type(rid) is str else None
        if st is None:
            return False
        st.damaged = True
        if note not in st.notes:
            st.notes.append(note)
        return True

    def _delta(self, d: wire.Delta, frames: list, now: float) -> None:
        wire.check_payload(d, frames)
        # read the frames in place: their boundaries fall on request boundaries (check_payload), so a request's
        # rows never straddle two frames (a broker's split sends one frame per run of requests)
        views = [memoryview(f.buffer if hasattr(f, "buffer") else f).cast("B") for f in frames]
        fi = 0
        mv = views[0] if views else memoryview(b"")
        lim = len(mv)
        rb = d.row_bytes
        key = (d.layer_lo, d.layer_hi)
        L, K = d.num_layers, d.top_k
        self.stats.delta_msgs += 1
        self.stats.rows += d.total_rows
        self.stats.bytes += d.total_rows * rb
        starts, counts = d.starts.tolist(), d.counts.tolist()
        n = len(starts)
        # bounds once per message; only a message that could break them takes the checked path
        in_bounds = (not n or int(d.starts.max()) + int(d.counts.max()) <= self.max_positions) and \
            self.bytes_held + d.total_rows * rb <= self.max_bytes
        shape = (L, K, d.layer_lo, d.layer_hi)
        cursors = self._cursors.get(shape)
        if cursors is None:
            cursors = self._cursors[shape] = {}
        get = cursors.get
        added = 0
        off = 0
        for rid, s, c in zip(d.request_ids, starts, counts):
            end = off + c * rb
            while end > lim:               # this request's rows start in the next frame
                fi += 1
                mv = views[fi]
                lim = len(mv)
                end -= off
                off = 0
            r = get(rid)
            if r is not None and r.n == s and in_bounds:
                o = r.boff
                e = o + end - off
                if e <= r.bend:            # the common case: append into free space of the last block
                    r.view[o:e] = mv[off:end]
                    r.n = s + c
                    r.boff = e
                    off = end
                    continue
            added += self._delta_slow(rid, s, c, mv[off:end], key, shape, cursors, rb, now)
            off = end
        self.bytes_held += added

    def _delta_slow(self, rid: str, s: int, c: int, chunk, key, shape, cursors: dict, rb: int, now: float) -> int:
        """A delta for a request that is new, overwrites, leaves a hole, or needs its bounds checked."""
        L, K = shape[0], shape[1]
        st = self.requests.get(rid)
        if st is None:
            st = self._get(rid, now)
            if st is None:
                self.stats.late_msgs += 1
                return 0
        if st.num_layers is None:
            st.num_layers, st.top_k = L, K
        elif st.num_layers != L or st.top_k != K:
            self._refuse(st, c, f"delta with L={L} K={K} for a request of L={st.num_layers} K={st.top_k}")
            return 0
        nb = c * rb
        if s + c > self.max_positions or self.bytes_held + nb > self.max_bytes:
            self._refuse(st, c, f"rows up to position {s + c} ({self.bytes_held + nb} bytes held) exceed "
                                f"max_positions={self.max_positions} / max_bytes={self.max_bytes}")
            return 0
        rows = st.ranges.get(key)
        if rows is None:
            rows = st.ranges[key] = _Rows(rb)
        before = rows.allocated
        rows.write(s, c, chunk)
        st.last_seen = now
        st.seen_n = sum(r.n for r in st.ranges.values())
        cursors[rid] = rows
        if shape not in st.cursor_shapes:
            st.cursor_shapes.append(shape)
        return rows.allocated - before

    def _refuse(self, st: _Request, rows: int, why: str) -> None:
        self.stats.refused_msgs += 1
        self.stats.refused_rows += rows
        if not st.refused:
            log.warning("consumer refused rows for %r: %s", st.rid, why)
        st.refused = True
        if "consumer_refused" not in st.notes:
            st.notes.append("consumer_refused")

    def _finish(self, f: wire.Finish, frames: list, now: float, key: tuple) -> list[wire.Record]:
        out_tokens = None
        if f.n_output_tokens:
            if len(frames) != 1:
                raise wire.ProtocolError("frame_count", f"finish announces {f.n_output_tokens} output tokens "
                                         f"but has {len(frames)} payload frames")
            out_tokens = wire.tokens_from_frame(frames[0], f.n_output_tokens, "output token")
        st = self.requests.get(f.request_id)            # sizes checked before anything is kept for the id
        P = f.prompt_len if st is None or st.prompt_len is None else st.prompt_len
        if st is not None and st.num_layers is not None:
            self._check_size(f.request_id, (P or 0) + f.num_output, st.num_layers, st.top_k, "finish")
        else:
            self._check_size(f.request_id, (P or 0) + f.num_output, 1, 1, "finish")
        st = self._get(f.request_id, now)
        if st is None:
            self.stats.late_msgs += 1
            return []
        if st.finish is not None and self._older(st.key, key):
            self.stats.late_msgs += 1               # a re-sent finish while the record waits for late rows
            return []
        st.key = key
        if st.prompt_len is None:
            if f.prompt_len is None:
                st.notes.append("no_open")
                st.prompt_len = 0
            else:
                st.prompt_len = f.prompt_len
                st.num_cached = f.num_cached or 0
        st.finish = _Ending(f.num_output, f.reason, f.lost, out_tokens, False)
        st.finish_at = now
        st.last_seen = now
        return self._try_emit(st, now, force="no_open" in st.notes)

    def _abort(self, rid: str, reason: str, n: int | None, now: float, key: tuple) -> list[wire.Record]:
        st = self.requests.get(rid)
        if st is None:
            self.stats.late_msgs += rid in self._finished_ids
            return []
        if n is not None and st.num_layers is not None:
            self._check_size(rid, (st.prompt_len or 0) + n, st.num_layers, st.top_k, "abort")
        elif n is not None and n > self.max_positions:
            self._check_size(rid, n, 1, 1, "abort")
        if st.key is None or not self._older(st.key, key):
            st.key = key
        self.stats.aborted += 1
        if st.prompt_len is None:
            st.prompt_len = 0
        st.finish = _Ending(n if n is not None else self._computed_outputs(st), reason, [], None, True)
        st.finish_at = now
        return self._try_emit(st, now, force=True)

    def _computed_outputs(self, st: _Request) -> int:
        n = max((r.n for r in st.ranges.values()), default=0)
        return max(0, n - (st.prompt_len or 0))

    # ---- output -------------------------------------------------------------------------------------------------

    def _try_emit(self, st: _Request, now: float, force: bool) -> list[wire.Record]:
        rec = self._build(st)
        if not rec.complete and not force and now - st.finish_at < self.finish_grace_s:
            self.pending_finish[st.rid] = st
            return []
        self.pending_finish.pop(st.rid, None)
        self._emit_done(st, rec)
        return [rec]

    def _ready(self, now: float) -> list[wire.Record]:
        out = []
        for st in list(self.pending_finish.values()):
            rec = self._build(st)
            if rec.complete or now - st.finish_at >= self.finish_grace_s:
                del self.pending_finish[st.rid]
                self._emit_done(st, rec)
                out.append(rec)
        return out

    def poll(self, now: float) -> list[wire.Record]:
        """Emit what waited out its grace period, and time out silent requests. Call about once a second."""
        out = self._ready(now) if self.pending_finish else []
        cutoff = now - self.request_timeout_s
        for st in [s for s in self.requests.values() if s.last_seen < cutoff and s.finish is None]:
            n = sum(r.n for r in st.ranges.values())
            if n != st.seen_n:            # rows arrived through the append fast path since the last look
                st.seen_n = n
                st.last_seen = now
                continue
            self.stats.timed_out += 1
            if st.prompt_len is None:
                st.prompt_len = 0
            st.finish = _Ending(self._computed_outputs(st), "timeout", [], None, True)
            st.notes.append("timeout")
            rec = self._build(st)
            self._emit_done(st, rec)
            out.append(rec)
        return out

    def _emit_done(self, st: _Request, rec: wire.Record) -> None:
        self._drop(st)
        self.requests.pop(st.rid, None)
        self._finished_ids[st.rid] = st.key
        if len(self._finished_ids) > self._remember:
            self._finished_ids.popitem(last=False)
        self.stats.finished += 1
        if rec.complete:
            self.stats.complete += 1
        else:
            self.stats.incomplete += 1

    def _drop(self, st: _Request) -> None:
        for r in st.ranges.values():
            self.bytes_held -= r.allocated
        st.ranges = {}
        for shape in st.cursor_shapes:
            self._cursors[shape].pop(st.rid, None)
        st.cursor_shapes = []

    def _build(self, st: _Request) -> wire.Record:
        end = st.finish
        G, finish_reason, lost, aborted = end.num_output, end.reason, end.lost, end.aborted
        P, C = st.prompt_len, min(st.num_cached, st.prompt_len)
        # rows below `floor` carry no routing by design (prefix-cache hits, sentinel mode); with prefix_filled the
        # producer sent them too, and every row below need_hi must be there
        F = C if st.prefix_filled else 0
        floor = 0 if st.prefix_filled else C
        L = st.num_layers or 0
        K = st.top_k or 0
        total = P + G
        need_hi = P + G - 1 if G > 0 else P        # the last output token is never fed to the model
        keys = sorted(st.ranges)
        disjoint = all(a[1] <= b[0] for a, b in zip(keys, keys[1:]))
        # disjoint layer ranges (the normal case) write each byte once: copy what is held, -1 only for the rest
        if disjoint:
            arr = np.empty((total, L, K), dtype=wire.ROW_DTYPE)
        else:
            arr = np.full((total, L, K), -1, dtype=wire.ROW_DTYPE)
        missing: list[list[int]] = []
        covered = np.zeros(L, dtype=bool)
        for (lo, hi), rows in st.ranges.items():
            rows.copy_into(arr, lo, hi, total)
            if disjoint and rows.n < total:
                arr[rows.n:, lo:hi] = -1            # never written (holes below n are -1 in the blocks already)
            covered[lo:hi] = True
            missing += rows.missing(floor, need_hi)
        if disjoint and L and not covered.all():
            arr[:, ~covered] = -1
        arr[:floor] = -1
        if G > 0:
            arr[total - 1] = -1
        if L and not covered.all():
            missing.append([floor, need_hi])
        not_found: list[list[int]] = []
        if F and L:
            # prefix rows the producer sent as -1: their source was gone from its store (evicted, invalidated)
            sent = np.zeros(F, dtype=bool)
            for rows in st.ranges.values():
                sent[:min(rows.n, F)] = True
            bad = sent & (arr[:F] < 0).reshape(F, -1).any(axis=1)
            bad &= ~_in_ranges(F, missing)
            if bad.any():
                not_found = _runs(bad)
                missing += not_found
                arr[:F][bad] = -1
        for a, b in lost:                           # the producer dropped rows here: whatever the positions hold
            if b > floor and a < need_hi:           # now may be older rows that those would have overwritten
                missing.append([max(a, floor), min(b, need_hi)])
                arr[max(a, floor):min(b, need_hi)] = -1
        missing = _merge(missing)
        notes = list(st.notes)
        if L == 0 and need_hi > floor:
            missing = [[floor, need_hi]]
        reason = ""
        complete = not missing and not aborted and "no_open" not in notes and not st.damaged
        if not complete:
            if aborted:
                reason = finish_reason if finish_reason else "abort"
            elif lost and any(a < m[1] and m[0] < b for a, b in lost for m in missing):
                reason = "producer_queue_full"
            elif notes:
                reason = notes[0]
            elif L and not covered.all():
                reason = "layers_missing"
            elif not_found:
                reason = "prefix_not_found"
            else:
                reason = "rows_not_delivered"
            if aborted:
                finish_reason = "abort" if finish_reason in ("", "timeout") and not notes else finish_reason
        layer_ids = np.asarray(st.layer_ids if st.layer_ids is not None else range(L), dtype=np.int32)
        return wire.Record(st.rid, arr[:P], arr[P:], C, layer_ids, complete, [tuple(m) for m in missing],
                           reason, finish_reason, st.prompt_tokens, end.output_tokens, F)

    @property
    def in_flight(self) -> int:
        return len(self.requests)
