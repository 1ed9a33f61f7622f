"""Serve trainers: answer `fetch` and `subscribe` from the consumer's finished records (no socket of its own).

The consumer's socket loop owns the ROUTER socket; it hands each trainer message to `TrainerService.on_message`,
each finished record to `on_record`, and calls `tick` and `retry` on its timers. Replies go out through the
`send(client, frames) -> Sent` function the loop gives, so this class is tested on bytes alone.

What a fetch of one request id gets (docs/RELIABILITY.md "Fetch"):
    HELD      finished, not fetched yet (RecordStore): the record, at once
    RETAINED  fetched before, within the retention bound (time and bytes): the same record again, at once
    ON_DISK   in the consumer's npz dir (this run's or an earlier run's): read back and sent, at once; a file
              that cannot be read: an `error` "unreadable: <file>: <why>", at once
    EVICTED   the store had to evict it and it is nowhere else (not retained, not on disk): an `error` "evicted"
    PENDING   open here, not finished (or finished and still on its way to the npz dir): the record when it
              finishes (the client asks again for one on its way to disk), within the fetch's timeout
    UNKNOWN   none of the above: waited for like PENDING (the open may still be on its way); with
              `answer_unknown` in the fetch body, also one `error` "unknown" at once, key = the list of such ids
"""

from __future__ import annotations

import enum
import logging
import time
from collections import OrderedDict, deque
from typing import Callable, NamedTuple

from routing_replay.consumer.npz import NpzIndex
from routing_replay.consumer.store import EVICTED, RecordStore
from routing_replay.protocol import wire

log = logging.getLogger("routing_replay.consumer")

MAX_WAITERS = 1 << 20          # request ids trainers may wait for at once (fetch before the record exists)
MAX_SUBSCRIBERS = 1024
MAX_GONE = 10_000              # unreachable trainers remembered (their outboxes are dropped)
MAX_LIVE_BACKLOG = 4096        # live records waiting, per subscriber whose send queue was full (ids; beyond: dropped)
UNKNOWN = "unknown"            # `error` reason: these ids are neither held, on disk, nor open here
UNREADABLE = "unreadable"      # `error` reason prefix: "unreadable: <file>: <why>" (a record file that cannot be read)
BACKOFF_MIN_S = 0.0005         # first retry after a trainer's send queue was found full; doubles while it stays full
BACKOFF_MAX_S = 0.005          # ... up to this: a queue of large records frees up while the trainer reads one, and a
                               # longer wait after that is idle time on the fetch's critical path


class Sent(enum.Enum):
    """What one send to a trainer did."""

    SENT = "sent"
    FULL = "full"              # its send queue is full: try later
    GONE = "gone"              # the trainer is unreachable


class Where(enum.Enum):
    """Where a fetched request id stands on this consumer (see the module docstring)."""

    HELD = "held"
    RETAINED = "retained"
    ON_DISK = "on_disk"
    EVICTED = "evicted"
    PENDING = "pending"
    UNKNOWN = "unknown"


SERVABLE = frozenset({Where.HELD, Where.RETAINED, Where.ON_DISK, Where.EVICTED})


class Waiter(NamedTuple):
    """A trainer waiting for a record that is not finished yet."""

    client: bytes
    deadline: float
    slice: wire.Slice | None = None        # the part of the record it asked for (None: all of it)


class Backoff(NamedTuple):
    """When to try a trainer whose send queue was full again, and the delay that got it there."""

    at: float
    delay_s: float


class Retained(NamedTuple):
    record: wire.Record
    fetched_at: float


class FetchedRecords:
    """Own records already sent to a trainer, for a time and byte bound, so a trainer that crashed after a fetch
    can fetch them again. Oldest first out; nothing here is the only copy a trainer has not seen. The last record
    fetched is kept even when it alone passes the byte bound (until the next one or its time runs out): a record
    of a long sample is the one whose fetch is likeliest to fail on its way; max_bytes 0 keeps none."""

    def __init__(self, retention_s: float = 600.0, max_bytes: int = 256 << 20):
        self.retention_s = retention_s
        self.max_bytes = max_bytes
        self._recs: OrderedDict[str, Retained] = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._recs)

    def __contains__(self, rid: str) -> bool:
        return rid in self._recs

    def get(self, rid: str) -> wire.Record | None:
        got = self._recs.get(rid)
        return None if got is None else got.record

    def put(self, rec: wire.Record, now: float) -> None:
        if self.retention_s <= 0 or self.max_bytes <= 0:
            return
        old = self._recs.pop(rec.request_id, None)
        if old is not None:
            self.bytes -= old.record.nbytes
        self._recs[rec.request_id] = Retained(rec, now)
        self.bytes += rec.nbytes
        while self.bytes > self.max_bytes and len(self._recs) > 1:
            self._pop_oldest()

    def expire(self, now: float) -> None:
        while self._recs and next(iter(self._recs.values())).fetched_at < now - self.retention_s:
            self._pop_oldest()

    def _pop_oldest(self) -> None:
        _, old = self._recs.popitem(last=False)
        self.bytes -= old.record.nbytes


class TrainerService:
    """Own what trainers asked for: fetch waiters, per-trainer outboxes of records to send, subscribers, and the
    retention of fetched records. Records wait in `store` until a trainer has them; then they are retained."""

    def __init__(self, consumer_id: str, store: RecordStore, send: Callable[[bytes, list], Sent], *,
                 is_open: Callable[[str], bool] = lambda rid: False, disk: NpzIndex | None = None,
                 fetched: FetchedRecords | None = None, bad: Callable[[str, Exception], None] | None = None,
                 disk_pending: Callable[[str], bool] = lambda rid: False):
        self.consumer_id = consumer_id
        self.store = store
        self.send = send
        self.is_open = is_open
        self.disk = disk
        self.disk_pending = disk_pending
        self.fetched = fetched if fetched is not None else FetchedRecords()
        self.count_bad = bad or (lambda reason, err: None)
        self.waiters: dict[str, Waiter] = {}
        self.outbox: dict[bytes, deque] = {}       # trainer -> request ids whose records it asked for, in order
        self.backoff: dict[bytes, Backoff] = {}    # trainer -> when to try again, while its send queue is full
        self.gone: set[bytes] = set()              # trainers found unreachable (their outboxes were dropped)
        self.subscribers: dict[bytes, str] = {}    # trainer -> request id prefix
        self.sub_slices: dict[bytes, wire.Slice] = {}     # subscriber -> the part of each record it asked for
        self.slices: dict[bytes, dict] = {}        # trainer -> {request id in its outbox: the Slice it asked for}
        self.bad_slices = 0            # records answered "bad_slice" (a layer range holding none of their layers)
        self.sliced = 0                # records encoded as a slice (only the asked layers' columns and rows)
        # subscriber -> ids of live records that found its send queue full (TRAINER_SNDHWM), sent in order as it
        # drains; the records stay where they are (store, retention): a burst of finishes is not lost
        self.live_backlog: dict[bytes, deque] = {}
        self.subscriber_drops = 0
        self.unknown_answers = 0
        self.disk_reads = 0
        self.unreadable = 0            # fetches answered "unreadable" (a record file that cannot be read)

    # ---- records in ---------------------------------------------------------------------------------------------

    def on_record(self, rec: wire.Record, now: float) -> None:
        """A finished record: to live subscribers, to a trainer waiting for it, and into the store."""
        encoded: dict = {}                         # slice -> frames: each part encoded once for every trainer
        for client, prefix in list(self.subscribers.items()):
            if rec.request_id.startswith(prefix):
                if self.live_backlog.get(client):         # behind the ones already waiting: order kept
                    self._live_wait(client, rec.request_id)
                    continue
                frames = self._frames(client, rec, self.sub_slices.get(client), encoded)
                if frames is not None and self._send(client, frames) is Sent.FULL:
                    self._live_wait(client, rec.request_id)
        w = self.waiters.pop(rec.request_id, None)
        if w is not None and not self.outbox.get(w.client):
            frames = self._frames(w.client, rec, w.slice, encoded)
            if frames is None:                         # a slice it cannot have: answered; the record stays
                self.store.put(rec)
                return
            if self._send(w.client, frames) is Sent.SENT:
                self.fetched.put(rec, now)
                return
            if w.client not in self.gone:
                self.outbox.setdefault(w.client, deque()).append(rec.request_id)    # its queue is full: later
                self._set_slice(w.client, rec.request_id, w.slice)
        elif w is not None:
            self.outbox[w.client].append(rec.request_id)
            self._set_slice(w.client, rec.request_id, w.slice)
        self.store.put(rec)

    def _set_slice(self, client: bytes, rid: str, sl: wire.Slice | None) -> None:
        if sl is not None:
            self.slices.setdefault(client, {})[rid] = sl
        elif client in self.slices:
            self.slices[client].pop(rid, None)

    def _frames(self, client: bytes, rec: wire.Record, sl: wire.Slice | None, encoded: dict | None = None):
        """The record's frames for a trainer that asked for `sl`: only that slice's columns and rows are encoded.
        None (the trainer got an `error` "bad_slice" naming the range) where the slice holds none of its layers."""
        if encoded is not None and sl in encoded:
            return encoded[sl]
        try:
            part = wire.slice_record(rec, sl)
        except wire.ProtocolError as e:
            self.bad_slices += 1
            log.warning("consumer %s: fetch of %r by %r refused: %s (bad_slices=%d)", self.consumer_id,
                        rec.request_id[:64], client[:32], e, self.bad_slices)
            self._send(client, [wire.pack_header("error", self.consumer_id, 0, 0, rec.request_id,
                                                 {"reason": f"{e.reason}: {e}"[:300]})])
            return None
        self.sliced += sl is not None
        frames = wire.encode_record(part, self.consumer_id, 0)
        if encoded is not None:
            encoded[sl] = frames
        return frames

    # ---- trainer messages ---------------------------------------------------------------------------------------

    def on_message(self, client: bytes, frames: list, now: float) -> None:
        """One message from a trainer (frames without the routing id); a bad one is counted and answered."""
        try:
            if len(frames) != 1:
                raise wire.ProtocolError("frame_count", f"client message has {len(frames)} frames, expected 1")
            h = wire.decode_header(frames[0].buffer if hasattr(frames[0], "buffer") else frames[0])
            if h.kind == "fetch":
                f = wire.parse_fetch(h)
                if len(self.waiters) + len(f.request_ids) > MAX_WAITERS:
                    raise wire.ProtocolError("too_many_waiters", f"{len(self.waiters)} ids already waited for, "
                                             f"limit {MAX_WAITERS}")
                self.fetch(client, f.request_ids, now + f.timeout_ms / 1000, f.answer_unknown, f.slice)
            elif h.kind == "hello":
                prefix = wire.parse_subscribe(h)
                if prefix is not None:
                    self.subscribe(client, prefix, wire.parse_slice(h.body))
            elif h.kind == "bye":
                self.subscribers.pop(client, None)
                self.sub_slices.pop(client, None)
                self.live_backlog.pop(client, None)
            elif h.kind != "heartbeat":
                raise wire.ProtocolError("unexpected_kind", f"trainer endpoint does not take {h.kind!r}")
        except wire.ProtocolError as e:
            self.count_bad(e.reason, e)
            self._send(client, [wire.pack_header("error", self.consumer_id, 0, 0, "",
                                                 {"reason": f"{e.reason}: {e}"[:200]})])

    def subscribe(self, client: bytes, prefix: str, sl: wire.Slice | None = None) -> None:
        if client not in self.subscribers and len(self.subscribers) >= MAX_SUBSCRIBERS:
            raise wire.ProtocolError("too_many_subscribers", f"limit {MAX_SUBSCRIBERS}")
        self.subscribers[client] = prefix
        if sl is None:
            self.sub_slices.pop(client, None)
        else:
            self.sub_slices[client] = sl
        log.info("consumer %s: subscriber %r prefix=%r subscribers=%d%s", self.consumer_id, client[:32], prefix,
                 len(self.subscribers), "" if sl is None else f" layers={sl.layers} tokens={sl.tokens}")

    def where(self, rid: str) -> Where:
        """Every copy is looked for before "evicted": an evicted record that is retained or on disk is served."""
        evicted = self.store.is_evicted(rid)
        if not evicted and rid in self.store:
            return Where.HELD
        if rid in self.fetched:
            return Where.RETAINED
        if self.is_open(rid):
            return Where.PENDING
        if self.disk is not None and rid in self.disk:
            return Where.ON_DISK
        if self.disk_pending(rid):
            return Where.PENDING
        return Where.EVICTED if evicted else Where.UNKNOWN

    def fetch(self, client: bytes, ids: list, deadline: float, answer_unknown: bool = False,
              sl: wire.Slice | None = None) -> None:
        """Queue what can be answered now, wait for the rest until `deadline`; say at once which ids are unknown
        when the trainer asked for that. `sl`: only that part of each record is sent."""
        self.gone.discard(client)
        q = self.outbox.get(client)
        queued = set(q) if q else ()
        unknown = []
        for rid in ids:
            where = self.where(rid)
            if where in SERVABLE:
                if rid not in queued:
                    self.outbox.setdefault(client, deque()).append(rid)
                self._set_slice(client, rid, sl)
                continue
            self.waiters[rid] = Waiter(client, deadline, sl)
            if where is Where.UNKNOWN:
                unknown.append(rid)
        if unknown and answer_unknown:
            self.unknown_answers += len(unknown)
            self._send(client, [wire.pack_header("error", self.consumer_id, 0, 0, unknown, {"reason": UNKNOWN})])
        if client in self.outbox and client not in self.backoff:
            self._drain(client, time.monotonic())

    # ---- sending ------------------------------------------------------------------------------------------------

    def _lookup(self, rid: str) -> tuple[wire.Record | str | None, bool]:
        """(record or EVICTED or None, whether it came from the store). Every copy (retained, on disk) is looked
        for before EVICTED. UnreadableRecord (npz) if the copy found is a file that cannot be read."""
        got = self.store.peek(rid)
        if got is not None and not isinstance(got, str):
            return got, True
        rec = self.fetched.get(rid)
        if rec is None and self.disk is not None:
            rec = self.disk.read(rid)
            self.disk_reads += rec is not None
        return (got if rec is None else rec), False

    def _unservable(self, client: bytes, rid: str, err: Exception) -> None:
        """A record that cannot be served (its file is unreadable): the trainer gets an error naming the file."""
        self.unreadable += 1
        log.error("consumer %s: fetch of %r by %r answered %s: %s (unreadable=%d)", self.consumer_id, rid[:64],
                  client[:32], UNREADABLE, err, self.unreadable)
        self._send(client, [wire.pack_header("error", self.consumer_id, 0, 0, rid,
                                             {"reason": f"{UNREADABLE}: {err}"[:300]})])

    def _drain(self, client: bytes, now: float) -> None:
        """Send a trainer the records it asked for, in order, until its send queue is full (then back off)."""
        q = self.outbox.get(client)
        slices = self.slices.get(client, {})
        while q:
            rid = q[0]
            sl = slices.get(rid)
            try:
                got, from_store = self._lookup(rid)
                part = None if got is None or isinstance(got, str) else wire.slice_record(got, sl)
                frames = None if part is None else wire.encode_record(part, self.consumer_id, 0)
            except Exception as e:  # noqa: BLE001 -- a file's content (or a record read from it) is input
                q.popleft()
                slices.pop(rid, None)
                if isinstance(e, wire.ProtocolError) and e.reason == "bad_slice":
                    self._frames(client, got, sl)    # answered "bad_slice" (its layers miss the range); it stays
                else:
                    self._unservable(client, rid, e)
                continue
            self.sliced += sl is not None
            if got is None:                        # retention ran out meanwhile: the trainer asks again
                q.popleft()
                continue
            if isinstance(got, str):              # EVICTED
                self._send(client, [wire.pack_header("error", self.consumer_id, 0, 0, rid, {"reason": EVICTED})])
                q.popleft()
                continue
            if from_store:            # out of the store before the trainer can see it; back if the send fails
                self.store.discard(rid)
            sent = self._send(client, frames)
            if sent is not Sent.SENT:
                if from_store:
                    self.store.put(got)
                if sent is Sent.GONE:
                    break
                # full: try again soon, later each time it is still full; one successful send starts over, so
                # a trainer that keeps up is never held back by a delay grown while it was briefly behind
                delay = min(BACKOFF_MAX_S, 2 * self.backoff.get(client, Backoff(0.0, BACKOFF_MIN_S / 2)).delay_s)
                self.backoff[client] = Backoff(now + delay, delay)
                return
            self.backoff.pop(client, None)
            self.fetched.put(got, now)
            q.popleft()
            slices.pop(rid, None)
        self.outbox.pop(client, None)
        self.backoff.pop(client, None)
        self.slices.pop(client, None)

    def retry(self, now: float) -> float:
        """Retry trainers whose send queue was full; returns seconds until the next retry is due (at most 0.1)."""
        nxt = 0.1
        for client in list(self.live_backlog):
            self._drain_live(client)
        if self.live_backlog:
            nxt = 0.002                     # a subscriber's queue drains as fast as its connection carries it
        for client in list(self.outbox):
            at = self.backoff.get(client, Backoff(0.0, 0.0)).at
            if at <= now:
                self._drain(client, now)
                at = self.backoff.get(client, Backoff(now + 0.1, 0.0)).at
            nxt = min(nxt, max(0.0, at - now))
        return nxt

    def _live_wait(self, client: bytes, rid: str) -> None:
        q = self.live_backlog.setdefault(client, deque())
        if len(q) >= MAX_LIVE_BACKLOG:
            q.popleft()
            self._live_dropped(client)
        q.append(rid)

    def _live_dropped(self, client: bytes) -> None:
        self.subscriber_drops += 1
        if self.subscriber_drops == 1 or self.subscriber_drops % 1000 == 0:
            log.warning("consumer %s: subscriber %r is slow, live records dropped=%d (fetch still has them)",
                        self.consumer_id, client[:32], self.subscriber_drops)

    def _drain_live(self, client: bytes) -> None:
        """Send a subscriber the live records that waited for room, in order, until its queue is full again."""
        q = self.live_backlog.get(client)
        while q:
            try:
                got, _ = self._lookup(q[0])
            except Exception as e:  # noqa: BLE001 -- an unreadable file: fetch names it; live is best effort
                log.error("consumer %s: live record %r for %r: %s", self.consumer_id, q[0][:64], client[:32], e)
                got = None
            if got is None or isinstance(got, str):     # gone from the store and the retention meanwhile
                q.popleft()
                self._live_dropped(client)
                continue
            frames = self._frames(client, got, self.sub_slices.get(client))
            if frames is None:
                q.popleft()
                continue
            sent = self._send(client, frames)
            if sent is Sent.FULL:
                return
            if sent is Sent.GONE:
                break
            q.popleft()
        self.live_backlog.pop(client, None)

    def _send(self, client: bytes, frames: list) -> Sent:
        sent = self.send(client, frames)
        if sent is Sent.GONE:
            self.subscribers.pop(client, None)
            self.sub_slices.pop(client, None)
            self.live_backlog.pop(client, None)
            self.outbox.pop(client, None)
            self.slices.pop(client, None)
            self.backoff.pop(client, None)
            self.gone.add(client)
            if len(self.gone) > MAX_GONE:
                self.gone.clear()
        return sent

    # ---- timers -------------------------------------------------------------------------------------------------

    def tick(self, now: float) -> None:
        """Forget waiters whose fetch timed out, and fetched records past their retention."""
        if self.waiters:
            for rid in [r for r, w in self.waiters.items() if w.deadline < now]:
                del self.waiters[rid]
        self.fetched.expire(now)

    @property
    def queued(self) -> int:
        return sum(len(q) for q in self.outbox.values())
