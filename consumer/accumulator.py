"""Accumulate routing rows per request from decoded messages and turn finished requests into Records.

No sockets here: `Accumulator.apply(header, payload_frames, now)` takes one validated message and returns the
records it finished. Rows live in an arena per row shape (consumer/arena.py: one contiguous region per request),
and a record of one full layer range is a view of its request's region (no copy; the region is reused once every
view of the record is gone); a delta's entries that continue their request's rows are appended as a few numpy scatters for the whole
message, the others (a new request, an overwrite, a hole) one by one. Positions are absolute, so a re-sent
position overwrites and a jump leaves a hole that is filled with -1 and reported as missing unless a later delta
fills it.

Rows are held in the dtype they travel in (a request's `ids`: uint8, uint16 or int16); "-1" below means that
dtype's missing value (wire.missing_id: 255, 65535 or -1, all one-bits in each). A delta whose dtype differs from
its request's is refused for that request (like a delta of another L or K).

A message whose every entry is a new request's first rows (a prefill step's; `adopt_min_bytes`) is not copied at
all: the rows stay in the received frames (`_Adopted`), a request that ends with them gets a record whose prompt
rows are a view of them, and anything else that comes for the request moves them into the arena first.

Replays are harmless: the link below delivers each producer's messages in seq order, and a resend is always a
suffix of that order, so re-applying deltas leaves the newest write of every position in place. Request-level
messages are made idempotent here: a finished request remembers the (producer, epoch, seq) that closed it, so
a re-sent open, delta, finish or abort for it is counted as late and never resurrects or duplicates the record,
and a re-sent open of a request in flight keeps its rows.

Collaborators: consumer/request_state.py holds each request's state (`_Request`, its `_Rows` / `_Adopted`, how it
ended); consumer/prefix_refs.py's `PrefixRefs` resolves prefix references and hands finished records to the pool;
consumer/records.py builds a finished request's Record from its state (`build_adopted`, `build_whole`,
`build_record`).
"""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from routing_replay.consumer.arena import Arena, void_rows
from routing_replay.consumer.prefix_pool import PREFIX_POOL_BYTES, PrefixPool
from routing_replay.consumer.prefix_refs import PrefixRefs
from routing_replay.consumer.records import build_adopted, build_record, build_whole
from routing_replay.consumer.request_state import _Adopted, _Ending, _Request, _Rows
from routing_replay.protocol import wire

log = logging.getLogger("routing_replay.consumer")

ADOPT_MIN_BYTES = 64 << 10      # smaller first chunks (a new request's decode rows) are copied: see Accumulator



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
    key_collisions: int = 0     # opens of an id in flight here by another producer (two engines' requests)
    adopted: int = 0            # requests whose first rows were kept as received (no copy; _Adopted)
    adopted_records: int = 0    # records whose prompt rows are a view of a received message
    materialized: int = 0       # adopted rows copied into the arena after all (another message touched them)
    prefix_ref_rows: int = 0    # prompt rows resolved by reference (prefix_refs), from the pool or a live writer
    prefix_live_rows: int = 0   # of them, copied from a writer still in flight (the record holds them itself)
    prefix_unresolved_rows: int = 0   # referenced rows this consumer could not resolve (-1, missing)
    prefix_unresolved: int = 0  # records with such rows (reason prefix_unresolved)


class EntriesRefused(wire.ProtocolError):
    """Entries of an `opens` or `finishes` this consumer refused (the message's other entries were applied):
    `failed` holds (request id, ProtocolError) of each, `request_ids` their ids. `records`: what the applied
    entries let out."""

    def __init__(self, kind: str, failed: list, records: list = ()):
        first = failed[0][1]
        super().__init__(first.reason, f"{len(failed)} of a {kind} message's entries refused; the first, "
                         f"{failed[0][0][:64]!r}: {first}")
        self.records = list(records)
        self.failed = failed
        self.request_ids = [rid for rid, _ in failed]


_NONE_SLOW = np.zeros(0, dtype=bool)      # Accumulator._append applied every entry


class _Shape:
    """One row shape's (L, K, layer_lo, layer_hi, id dtype) arena and the handle there of each request holding
    rows."""

    __slots__ = ("arena", "handle")

    def __init__(self, row_bytes: int, keep_bytes: int | None = None):
        self.arena = Arena(row_bytes, keep_bytes=keep_bytes)
        self.handle: dict[str, int] = {}




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
    adopt_min_bytes: a delta whose every entry is the first rows of a request (from position 0, each request
    once, at least this many bytes each) is not copied: the rows stay in the received frames (`_adopt`), and a
    request that ends with them has its prompt rows as a view of them. None: every row is copied into the arena.
    """

    def __init__(self, *, finish_grace_s: float = 0.5, request_timeout_s: float = 600.0,
                 max_positions: int = 1 << 21, max_bytes: int = 16 << 30, max_record_bytes: int = 4 << 30,
                 remember_finished: int = 100_000, keep_bytes: int | None = None,
                 adopt_min_bytes: int | None = ADOPT_MIN_BYTES, prefix_pool_bytes: int = PREFIX_POOL_BYTES):
        # keep_bytes: pages of finished requests' rows kept for the next requests (consumer.arena; None: up to the
        # most held at once, at least arena.KEEP_BYTES)
        if remember_finished < 0:
            raise ValueError(f"remember_finished must be >= 0, got {remember_finished}")
        if keep_bytes is not None and keep_bytes < 0:
            raise ValueError(f"keep_bytes must be >= 0 or None, got {keep_bytes}")
        self.keep_bytes = keep_bytes
        # a message whose every entry is a new request's first rows, each at least this many bytes, is kept as
        # received (None: never; see _adopt)
        self.adopt_min_bytes = adopt_min_bytes
        self.finish_grace_s = finish_grace_s
        self.request_timeout_s = request_timeout_s
        self.max_positions = max_positions
        self.max_bytes = max_bytes
        self.max_record_bytes = max_record_bytes
        self.requests: dict[str, _Request] = {}
        self.pending_finish: dict[str, _Request] = {}
        self._early: list = []          # records an open let out (the open's id was waiting out its grace)
        self._finished_ids: OrderedDict[str, tuple | None] = OrderedDict()
        self._pids: dict[str, str] = {}
        self._remember = remember_finished
        self.bytes_held = 0
        self.stats = AccumulatorStats()
        # per row shape (L, K, layer_lo, layer_hi, id dtype): its arena and request id -> handle there
        self._shapes: dict[tuple, _Shape] = {}
        # prefix_refs' sources, pins and the hand-over of finished records to the pool (consumer/prefix_refs.py) of
        # finished records' prompt rows that later opens reference (consumer/prefix_pool.py)
        self.prefix = PrefixRefs(PrefixPool(prefix_pool_bytes), self.requests, self.stats)

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
            return self._take_early()
        if kind == "opens":
            try:
                self._opens(*wire.parse_opens(h, frames), now, key)
            except EntriesRefused as e:
                e.records = self._take_early() + e.records
                raise
            return self._take_early()
        if kind == "finishes":
            return self._finishes(*wire.parse_finishes(h, frames), now, key)
        if kind == "finish":
            return self._finish(wire.parse_finish(h), frames, now, key)
        if kind == "abort":
            rid, reason, n = wire.parse_abort(h)
            return self._abort(rid, reason, n, now, key)
        if kind == "refused":
            self._refused(wire.parse_refused(h)[0])
            return []
        raise wire.ProtocolError("unexpected_kind", f"consumer does not take {kind!r} messages")

    def _take_early(self) -> list[wire.Record]:
        out, self._early = self._early, [] if self._early else self._early
        return out

    def _refused(self, ids: list) -> None:
        """The broker dropped a delta with rows of these requests (`refused`): each one held here names that
        loss `broker_refused` if its record comes out incomplete (no request is made for an id not held)."""
        for rid in ids:
            st = self.requests.get(rid)
            if st is not None and "broker_refused" not in st.notes:
                st.notes.append("broker_refused")

    def _get(self, rid: str, now: float) -> _Request | None:
        st = self.requests.get(rid)
        if st is None:
            if rid in self._finished_ids:
                return None
            st = self.requests[rid] = _Request(rid, now)
        return st

    def _check_size(self, rid: str, positions: int, L: int, K: int, what: str, itemsize: int = 2) -> None:
        nbytes = positions * L * K * itemsize
        if positions > self.max_positions or nbytes > self.max_record_bytes:
            raise wire.ProtocolError("too_large", f"{what} for {rid[:64]!r} announces {positions} positions of "
                                     f"({L}, {K}) = {nbytes} bytes; limits: max_positions={self.max_positions}, "
                                     f"max_record_bytes={self.max_record_bytes}")

    @staticmethod
    def _older(key: tuple | None, new: tuple) -> bool:
        """True if `new` (producer, epoch, seq) is a re-send of something at or before `key` (same producer)."""
        return key is not None and key[0] == new[0] and key[1] == new[1] and new[2] <= key[2]

    def _opens(self, o: wire.Opens, tokens: np.ndarray | None, now: float, key: tuple) -> None:
        """Apply the entries of an `opens` one by one, as their `open`s would be; an entry this consumer refuses
        (too large, a shape that differs from its rows so far) leaves the others applied: EntriesRefused names
        it (and the message's other refused entries)."""
        failed = []
        for i, rid in enumerate(o.request_ids):
            t = o.tokens_of(i, tokens)
            try:
                self._open(o.open_at(i), (), now, key, None if t is None else t.copy())
            except wire.ProtocolError as e:
                failed.append((rid, e))
        if failed:
            raise EntriesRefused("opens", failed)

    def _finishes(self, f: wire.Finishes, tokens: np.ndarray | None, now: float, key: tuple) -> list[wire.Record]:
        """Apply the entries of a `finishes` one by one, as their `finish`es would be (EntriesRefused names those
        this consumer refuses, with the records the others let out)."""
        out, failed = [], []
        for i, fin in enumerate(f.finishes):
            try:
                out += self._finish(fin, f.token_frames(i, tokens), now, key)
            except wire.ProtocolError as e:
                failed.append((fin.request_id, e))
        if failed:
            raise EntriesRefused("finishes", failed, out)
        return out

    def _open(self, o: wire.Open, frames: list | tuple, now: float, key: tuple,
              tokens: np.ndarray | None = None) -> bool:
        """Apply an open; False if it was a re-sent open of a request already closed (counted, ignored). `tokens`:
        its prompt token ids, taken out of an `opens` already (else they are read from `frames`)."""
        self._check_size(o.request_id, o.prompt_len, o.num_layers, o.top_k, "open", o.id_dtype.itemsize)
        if o.n_prompt_tokens and tokens is None:
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
            if st is not None:
                # a newer open of an id whose record waits out finish_grace_s: the id's next request. The waiting
                # record goes out now, as it is (not dropped), before the new request takes the id
                self.pending_finish.pop(o.request_id, None)
                self._early.append(self._emit_done(st, self._build(st)))
            self._finished_ids.pop(o.request_id, None)
            st = self.requests[o.request_id] = _Request(o.request_id, now)
        elif st.opened and st.key is not None and st.key[0] != key[0]:
            # another producer opens an id held open here: requests of two engines share a record key (an engine
            # keeps keys unique among its own requests only). Their rows cannot be told apart: the record is
            # marked, never silently mixed
            st.damaged = True
            if "key_collision" not in st.notes:
                st.notes.insert(0, "key_collision")
            self.stats.key_collisions += 1
            log.warning("request %r opened by producer %s while producer %s's request of that id is in flight: "
                        "its record is marked incomplete (key_collision; key_collisions=%d)", o.request_id[:64],
                        key[0][:64], st.key[0][:64], self.stats.key_collisions)
        if st.num_layers is not None and (st.num_layers, st.top_k) != (o.num_layers, o.top_k):
            raise wire.ProtocolError("shape_mismatch", f"open for {o.request_id!r} says L={o.num_layers} "
                                     f"K={o.top_k}, its rows so far are L={st.num_layers} K={st.top_k}")
        if st.id_dtype is not None and st.id_dtype != o.id_dtype:
            raise wire.ProtocolError("shape_mismatch", f"open for {o.request_id!r} says ids "
                                     f"{wire.ids_code(o.id_dtype)}, its rows so far are {wire.ids_code(st.id_dtype)}")
        if tokens is not None:
            st.prompt_tokens = tokens
        if not st.opened:
            self.stats.opened += 1
        st.opened = True
        st.prompt_len, st.num_cached, st.prefix_filled = o.prompt_len, o.num_cached, o.prefix_filled
        st.num_layers, st.top_k, st.layer_ids = o.num_layers, o.top_k, o.layer_ids
        st.id_dtype = o.id_dtype
        self.prefix.set_refs(st, o.prefix_refs, key[0])
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
        """Apply a delta: the entries of requests that only append go in as a few numpy scatters for the whole
        message (`_append`); the others (a new request, an overwrite, a hole, bounds to check) one by one."""
        wire.check_payload(d, frames)
        rb = d.row_bytes
        L, K = d.num_layers, d.top_k
        self.stats.delta_msgs += 1
        self.stats.rows += d.total_rows
        self.stats.bytes += d.total_rows * rb
        n = len(d.request_ids)
        if not n:
            return
        shape = (L, K, d.layer_lo, d.layer_hi, d.dtype)
        sh = self._shapes.get(shape)
        if sh is None:
            sh = self._shapes[shape] = _Shape(rb, self.keep_bytes)
        # the frames are read in place: their boundaries fall on request boundaries (check_payload), so an entry's
        # rows never straddle two frames (a broker's split sends one frame per run of requests)
        bufs = [f.buffer if hasattr(f, "buffer") else f for f in frames]
        # bounds once per message; only a message that could break them takes the checked path
        in_bounds = int(d.starts.max()) + int(d.counts.max()) <= self.max_positions and \
            self.bytes_held + d.total_rows * rb <= self.max_bytes
        if in_bounds and self.adopt_min_bytes is not None and self._adopt(d, bufs, sh, now):
            return
        slow = self._append(d, bufs, sh, now) if in_bounds else None
        if slow is not _NONE_SLOW:
            self._delta_entries(d, bufs, sh, shape, now, slow)

    def _adopt(self, d: wire.Delta, bufs: list, sh: "_Shape", now: float) -> bool:
        """Keep the rows of `d` as received when every entry is the first rows of a request new to this row shape:
        from position 0, each request once, at least adopt_min_bytes each, in writable frames (what a socket
        gives). True if it did (the whole message); False leaves everything to the copying paths.

        A prefill step's message is like that; its requests' rows are then copied only if another message comes
        for them (`_materialize`), and a request that ends with them has its prompt rows as a view of them."""
        c = d.counts
        rb = d.row_bytes
        least = int(c.min())
        if int(d.starts.max()) != 0 or least <= 0 or least * rb < self.adopt_min_bytes:
            return False
        ids = d.request_ids
        handle, requests, finished = sh.handle, self.requests, self._finished_ids
        key = (d.layer_lo, d.layer_hi)
        L, K = d.num_layers, d.top_k
        for rid in ids:
            if rid in handle:
                return False
            st = requests.get(rid)
            if st is None:
                if rid in finished:
                    return False
            elif key in st.ranges or (st.num_layers is not None and (st.num_layers != L or st.top_k != K)) \
                    or (st.id_dtype is not None and st.id_dtype != d.dtype):
                return False
        if len(set(ids)) != len(ids):
            return False
        frames = [np.frombuffer(b, dtype=np.uint8) for b in bufs]
        if not all(f.flags.writeable for f in frames):
            return False                        # (bytes: a record must be an array its user may write)
        shape = (L, K, d.layer_lo, d.layer_hi, d.dtype)
        fi, base, end = 0, 0, len(frames[0]) // rb
        at = 0
        for rid, cnt in zip(ids, c.tolist()):
            while at >= end:                    # (an entry never straddles two frames: check_payload)
                fi += 1
                base, end = end, end + len(frames[fi]) // rb
            o = (at - base) * rb
            st = requests.get(rid)
            if st is None:
                st = requests[rid] = _Request(rid, now)
            if st.num_layers is None:
                st.num_layers, st.top_k = L, K
            if st.id_dtype is None:
                st.id_dtype = d.dtype
            st.ranges[key] = _Adopted(frames[fi][o:o + cnt * rb], rb, shape)
            st.shapes.append(shape)
            st.last_seen = now
            st.seen_n = sum(r.n for r in st.ranges.values())
            at += cnt
        self.bytes_held += d.total_rows * rb
        self.stats.adopted += len(ids)
        return True

    def _materialize(self, st: _Request, key: tuple) -> "_Rows":
        """Move an adopted range of `st` into its arena (one copy); the arena's growth is the caller's to count."""
        ad = st.ranges[key]
        sh = self._shapes[ad.shape]
        rows = _Rows(sh.arena, sh.arena.new_handle(st.prompt_len or 0))
        rows.write(0, ad.n, ad.buf)
        st.ranges[key] = rows
        sh.handle[st.rid] = rows.h
        self.bytes_held -= ad.release()
        self.stats.materialized += 1
        return rows

    def _new_rows(self, rids: set, sh: "_Shape", d: wire.Delta, now: float) -> list:
        """Give the requests of `rids` that may take rows of this shape (held, or new; same L and K) their rows
        here, so that their first entries can be appended with the others. Returns those requests."""
        shape = (d.num_layers, d.top_k, d.layer_lo, d.layer_hi, d.dtype)
        key = (d.layer_lo, d.layer_hi)
        made, moved = [], []
        for rid in rids:
            st = self.requests.get(rid)
            if st is None:
                st = self._get(rid, now)
                if st is None:
                    continue                    # finished: the entry-by-entry path counts it late
            if st.id_dtype is not None and st.id_dtype != d.dtype:
                continue                        # refused there
            if st.num_layers is None:
                st.num_layers, st.top_k = d.num_layers, d.top_k
            elif st.num_layers != d.num_layers or st.top_k != d.top_k:
                continue                        # refused there
            if st.id_dtype is None:
                st.id_dtype = d.dtype
            r = st.ranges.get(key)
            if r is not None:
                if type(r) is _Adopted:         # its rows go to the arena; this message's append to them
                    self._materialize(st, key)
                    st.last_seen = now
                    moved.append(st)
                continue
            made.append(st)
        hint = max((st.prompt_len or 0 for st in made), default=0)
        for st, h in zip(made, sh.arena.new_handles(len(made), hint)):
            st.ranges[key] = _Rows(sh.arena, h)
            sh.handle[st.rid] = h
            st.shapes.append(shape)
            st.last_seen = now
        return made + moved

    def _append(self, d: wire.Delta, bufs: list, sh: "_Shape", now: float) -> np.ndarray | None:
        """Append the rows of every request whose entries in `d` all continue where its rows end (in entry order),
        as numpy work over the whole message. Returns the mask of entries left for `_delta_entries` (None: no
        entry was applied here)."""
        a, rb = sh.arena, d.row_bytes
        ids = d.request_ids
        n = len(ids)
        before = a.live_blocks
        hd = np.fromiter(map(sh.handle.get, ids, itertools.repeat(-1)), dtype=np.int64, count=n)
        fresh = self._new_rows(set(itertools.compress(ids, hd < 0)), sh, d, now) if int(hd.min()) < 0 else ()
        if fresh:
            hd = np.fromiter(map(sh.handle.get, ids, itertools.repeat(-1)), dtype=np.int64, count=n)
            self.bytes_held += (a.live_blocks - before) * a.block_bytes     # their first rows
            before = a.live_blocks
        c, s = d.counts, d.starts
        if d.total_rows == n and int(c.min()) == 1 and len(set(ids)) == n:
            # a decode step: one row for each of n distinct requests
            if int(hd.min()) >= 0 and np.array_equal(a.n[hd], s):
                self._scatter(a, a.append_one(hd), bufs, rb)
                self.bytes_held += (a.live_blocks - before) * a.block_bytes
                self._seen(fresh)
                return _NONE_SLOW
        s = s.astype(np.int64)
        c = c.astype(np.int64)
        e = s + c
        # group the entries by handle (stable: entry order within a request); each group must be a chain
        # n[h] = s0, s0 + c0 = s1, ... (unknown requests, handle -1, are one group that never matches)
        order = np.argsort(hd, kind="stable")
        hs, ss, es = hd[order], s[order], e[order]
        first = np.empty(n, dtype=bool)
        first[0] = True
        np.not_equal(hs[1:], hs[:-1], out=first[1:])
        expect = np.empty(n, dtype=np.int64)
        expect[0] = 0
        expect[1:] = es[:-1]
        fh = hs[first]
        known = fh >= 0
        expect[first] = np.where(known, a.n[np.maximum(fh, 0)], -1)
        starts_at = np.flatnonzero(first)
        gbad = (np.add.reduceat(ss != expect, starts_at) > 0) | ~known
        last = np.empty(n, dtype=bool)
        last[-1] = True
        last[:-1] = first[1:]
        gend = es[last]
        row_off = np.cumsum(c) - c                 # each entry's first row in the payload
        if gbad.any():
            if gbad.all():
                self._seen(fresh)
                return None
            ok = ~gbad
            slow = np.empty(n, dtype=bool)
            slow[order] = np.repeat(gbad, np.diff(np.append(starts_at, n)))
            fast = ~slow
            u, new_n = fh[ok], gend[ok]
            cf = c[fast]
            T = int(cf.sum())
            fo = np.cumsum(cf) - cf
            rh = np.repeat(hd[fast], cf)
            pos = np.repeat(s[fast] - fo, cf) + np.arange(T)
            src = np.repeat(row_off[fast] - fo, cf) + np.arange(T)      # payload row of each fast row
        else:
            slow = _NONE_SLOW
            u, new_n = fh, gend
            T = d.total_rows
            rh = np.repeat(hd, c)
            pos = np.repeat(s - row_off, c) + np.arange(T)
            src = None
        a.ensure(u, new_n)
        if len(rh):
            flat = a.rows_at(rh, pos)
            if src is None:
                self._scatter(a, flat, bufs, rb)
            elif len(bufs) == 1:
                a.scatter(flat, void_rows(bufs[0], rb)[src])
            else:
                r0 = 0
                for b in bufs:
                    k = len(b) // rb
                    if k:
                        sel = (src >= r0) & (src < r0 + k)
                        if sel.any():
                            a.scatter(flat[sel], void_rows(b, rb)[src[sel] - r0])
                    r0 += k
        a.n[u] = new_n
        self.bytes_held += (a.live_blocks - before) * a.block_bytes
        self._seen(fresh)
        return slow

    @staticmethod
    def _seen(fresh) -> None:
        """Requests given rows by this message: their timeout counts from now (as on the entry-by-entry path)."""
        for st in fresh:
            st.seen_n = sum(r.n for r in st.ranges.values())

    @staticmethod
    def _scatter(a: Arena, flat: np.ndarray, bufs: list, rb: int) -> None:
        """Write every payload row, in order, to the arena rows `flat`."""
        if len(bufs) == 1:
            a.scatter(flat, void_rows(bufs[0], rb))
            return
        r0 = 0
        for b in bufs:
            k = len(b) // rb
            if k:
                a.scatter(flat[r0:r0 + k], void_rows(b, rb))
            r0 += k

    def _delta_entries(self, d: wire.Delta, bufs: list, sh: "_Shape", shape: tuple, now: float,
                       only: np.ndarray | None) -> None:
        """Apply the entries of `d` one by one (those in the mask `only`, or all), in entry order."""
        rb = d.row_bytes
        key = (d.layer_lo, d.layer_hi)
        counts = d.counts.tolist()
        starts = d.starts.tolist()
        offs = (np.cumsum(d.counts, dtype=np.int64) - d.counts).tolist()      # each entry's first row
        ends = np.cumsum([len(b) // rb for b in bufs]).tolist()               # each frame's end row
        views = [memoryview(b).cast("B") for b in bufs]
        idx = range(len(counts)) if only is None else np.flatnonzero(only).tolist()
        ids = d.request_ids
        added = 0
        fi = 0
        for i in idx:
            c = counts[i]
            chunk = b""
            if c:
                o = offs[i]
                while ends[fi] <= o:
                    fi += 1
                base = ends[fi - 1] if fi else 0
                chunk = views[fi][(o - base) * rb:(o - base + c) * rb]
            added += self._delta_slow(ids[i], starts[i], c, chunk, key, shape, sh, rb, now)
        self.bytes_held += added

    def _delta_slow(self, rid: str, s: int, c: int, chunk, key, shape, sh: "_Shape", rb: int, now: float) -> int:
        """A delta entry for a request that is new, overwrites, leaves a hole, or needs its bounds checked."""
        L, K = shape[0], shape[1]
        st = self.requests.get(rid)
        if st is None:
            st = self._get(rid, now)
            if st is None:
                self.stats.late_msgs += 1
                return 0
        dt = shape[4]
        if st.id_dtype is not None and st.id_dtype != dt:
            self._refuse(st, c, f"delta with ids {wire.ids_code(dt)} for a request of ids "
                                f"{wire.ids_code(st.id_dtype)}")
            return 0
        if st.num_layers is None:
            st.num_layers, st.top_k = L, K
        elif st.num_layers != L or st.top_k != K:
            self._refuse(st, c, f"delta with L={L} K={K} for a request of L={st.num_layers} K={st.top_k}")
            return 0
        if st.id_dtype is None:
            st.id_dtype = dt
        nb = c * rb
        if s + c > self.max_positions or self.bytes_held + nb > self.max_bytes:
            self._refuse(st, c, f"rows up to position {s + c} ({self.bytes_held + nb} bytes held) exceed "
                                f"max_positions={self.max_positions} / max_bytes={self.max_bytes}")
            return 0
        before = sh.arena.live_blocks
        rows = st.ranges.get(key)
        if type(rows) is _Adopted:
            rows = self._materialize(st, key)
        if rows is None:
            rows = st.ranges[key] = _Rows(sh.arena)
            sh.handle[rid] = rows.h
            st.shapes.append(shape)
        rows.write(s, c, chunk)
        st.last_seen = now
        st.seen_n = sum(r.n for r in st.ranges.values())
        return (sh.arena.live_blocks - before) * sh.arena.block_bytes

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
        st.finish = _Ending(f.num_output, f.reason, f.lost, out_tokens, False, f.refused, f.broker_refused)
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
        return [self._emit_done(st, rec)]

    def _ready(self, now: float) -> list[wire.Record]:
        out = []
        for st in list(self.pending_finish.values()):
            rec = self._build(st)
            if rec.complete or now - st.finish_at >= self.finish_grace_s:
                del self.pending_finish[st.rid]
                out.append(self._emit_done(st, rec))
        return out

    def poll(self, now: float) -> list[wire.Record]:
        """Emit what waited out its grace period, and time out silent requests. Call about once a second."""
        out = self._ready(now) if self.pending_finish else []
        for sh in self._shapes.values():
            sh.arena.reclaim()              # regions of records whose views are gone: reused, or pages returned
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
            out.append(self._emit_done(st, self._build(st)))
        return out

    def _emit_done(self, st: _Request, rec: wire.Record) -> wire.Record:
        """The request is done: its state goes, its record is counted and returned (compact where pool entries
        serve some of its prompt rows), and, with prefix rows, its prompt rows become the pool's entry of its id
        (both through self.prefix: consumer/prefix_refs.py)."""
        if st.refs:
            rec = self.prefix.compact(st, rec)
        if st.prefix_filled and self.prefix.pool.max_bytes:
            self.prefix.keep(st, rec)
        if st.lease is not None:            # the record is a view of its rows: their region goes with it
            key, lease = st.lease
            st.lease = None
            rows = st.ranges.pop(key)
            self.bytes_held -= rows.arena.detach(rows.h, lease)
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
        return rec

    def _drop(self, st: _Request) -> None:
        for r in st.ranges.values():
            self.bytes_held -= r.release()
        st.ranges = {}
        for shape in st.shapes:
            self._shapes[shape].handle.pop(st.rid, None)
        st.shapes = []

    def _build(self, st: _Request) -> wire.Record:
        """`st`'s record as it stands (consumer/records.py builds it): a view of the received frame where its rows
        all still are (build_adopted), else from the arena: the usual end's view (build_whole) or the general
        path (build_record)."""
        adopted = [k for k, r in st.ranges.items() if type(r) is _Adopted]
        if adopted:
            rec = build_adopted(st)
            if rec is not None:
                self.stats.adopted_records += 1
                return rec
            for k in adopted:               # every other way to end: from the arena, as any request
                a = self._shapes[st.ranges[k].shape].arena
                before = a.live_blocks
                self._materialize(st, k)
                self.bytes_held += (a.live_blocks - before) * a.block_bytes
        rec = build_whole(st)
        if rec is not None:
            return rec
        return build_record(st, self.prefix)

    @property
    def pool(self) -> PrefixPool:
        """Finished records' prompt rows that later opens reference (held by self.prefix)."""
        return self.prefix.pool

    @pool.setter
    def pool(self, pool: PrefixPool) -> None:
        self.prefix.pool = pool

    @property
    def in_flight(self) -> int:
        return len(self.requests)

    @property
    def kept_bytes(self) -> int:
        """Pages of finished records' rows kept for the next requests (as of the last poll), all row shapes."""
        return sum(sh.arena.kept_bytes for sh in self._shapes.values())

    @property
    def peak_bytes(self) -> int:
        """The most row bytes held at once (in flight plus records handed out), per row shape, added up."""
        return sum(sh.arena.peak_bytes for sh in self._shapes.values())
