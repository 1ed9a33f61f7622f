"""Trainer-side client: fetch finished records by request id (lossless) or subscribe to live ones by prefix."""

from __future__ import annotations

import logging
import time
from typing import Iterable, Iterator, NamedTuple, Sequence

import zmq

from routing_replay.protocol import security, wire
from routing_replay.protocol.ids import default_peer_id
from routing_replay.protocol.loop import MessageTooLarge, recv_frames

log = logging.getLogger("routing_replay.consumer.client")

HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
MONITORED = zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | HANDSHAKE_FAILED


# a reply's whole-message bound (recv_frames): a record's rows come in frames of at most wire.MAX_PAYLOAD_FRAME_BYTES,
# 64 GiB in all is a record of 48 layers x top-8 (768-byte rows) and 89M tokens, beyond wire.MAX_POSITION
MAX_REPLY_BYTES = 64 << 30
UNKNOWN_GRACE_S = 10.0     # fetch's default: how long an id every consumer says it never saw is waited for


class RecordsNotServed(RuntimeError):
    """A consumer answered some ids of a fetch with an error instead of a record (the fetch still waited for the
    rest). `failed`: {request id: reason}; `records`: what the same fetch did get; `missing`: ids neither received
    nor failed (unknown, or not finished in time)."""

    def __init__(self, failed: dict, records: dict, missing: list | None = None):
        shown = dict(list(sorted(failed.items()))[:8])
        super().__init__(f"{len(failed)} of {len(failed) + len(records) + len(missing or ())} records not served "
                         f"(got {len(records)}): {shown}")
        self.failed = failed
        self.records = records
        self.missing = missing or []


class RecordEvicted(RecordsNotServed):
    """The consumer had to evict these records (its store bound was hit, no spill dir, no npz dir) before they were
    fetched; every failed id of the fetch was evicted."""


class RecordUnreadable(RecordsNotServed):
    """At least one record's file on its consumer cannot be read: its reason names the file
    ("unreadable: <file> is unreadable: <why>")."""


class SliceRefused(RecordsNotServed):
    """A consumer refused the slice asked for some records ("bad_slice: ..." naming the layer range and the
    record's MoE layers): the layer range holds none of their MoE layers."""


class FetchTimeout(TimeoutError):
    """Not every record came within the fetch's timeout. `request_ids`: the ids still missing; `records`: what the
    fetch did get."""

    def __init__(self, message: str, request_ids: list, records: dict):
        super().__init__(message)
        self.request_ids = request_ids
        self.records = records


class RecordUnknown(TimeoutError):
    """No consumer holds, has on disk, or has open these request ids (`fetch(..., unknown="raise")`, or for longer
    than the grace of the default unknown="grace").

    `request_ids`: the unknown ids; `records`: what the same fetch did get. A TimeoutError, so code written for a
    fetch that waited out its timeout on such ids still catches it.
    """

    def __init__(self, request_ids: list[str], records: dict):
        super().__init__(f"{len(request_ids)} request ids unknown to every consumer: {request_ids[:8]}")
        self.request_ids = request_ids
        self.records = records


class SubscriptionGap(NamedTuple):
    """A subscription that was cut: its consumer's connection went down at lost_at and the subscription was sent
    again at resubscribed_at (time.monotonic()). Live records that finished there meanwhile were not delivered;
    fetch still has them."""

    endpoint: str
    lost_at: float
    resubscribed_at: float


class Reply(NamedTuple):
    """One reply from a consumer: kind 'record' (value: Record) or 'error' (value: (key, reason)); `sock`: which
    consumer (its index in the client's endpoints)."""

    kind: str
    value: object
    sock: int


class TrainerClient:
    """Own one DEALER socket per consumer endpoint (sharded consumers each hold a part of the requests).

    `fetch(ids)` asks every consumer; the one that owns a request answers as soon as its record is finished
    (at once if it already is). Outstanding ids are asked again every `retry_interval_s`, so a consumer that
    restarted, or a fetch that raced a reconnect, still answers. Not thread-safe: one thread per client.

    Each socket's connection events are watched (a ZeroMQ socket monitor, read while the client waits for
    replies): after a consumer restarts, a subscription is sent to it again, and the cut is logged and kept in
    `gaps` (SubscriptionGap); a refused CURVE handshake is logged (WARNING, once per endpoint) and counted in
    `handshake_failures`, instead of the client only timing out.
    """

    def __init__(self, endpoints: str | Sequence[str], *, context: zmq.Context | None = None,
                 client_id: str | None = None, retry_interval_s: float = 1.0,
                 curve_secret: str | None = None, server_key: str | Sequence[str] | None = None,
                 max_reply_bytes: int = MAX_REPLY_BYTES):
        self.max_reply_bytes = max_reply_bytes
        self.endpoints = [endpoints] if isinstance(endpoints, str) else list(endpoints)
        if (curve_secret is None) != (server_key is None):
            raise ValueError("CURVE needs both curve_secret (this trainer's secret cert) and server_key (the "
                             "consumers' public cert)")
        keys = [server_key] * len(self.endpoints) if isinstance(server_key, (str, bytes)) or server_key is None \
            else list(server_key)
        if len(keys) == 1:
            keys = keys * len(self.endpoints)
        if len(keys) != len(self.endpoints):
            raise ValueError(f"{len(keys)} server keys for {len(self.endpoints)} endpoints (give one, or one each)")
        self._ctx = context or zmq.Context.instance()
        self.client_id = client_id or default_peer_id("trainer")
        self.retry_interval_s = retry_interval_s
        self._socks = []
        self._monitors: dict = {}          # monitor socket -> index of the socket it watches
        self._poller = zmq.Poller()
        for ep, key in zip(self.endpoints, keys):
            s = self._ctx.socket(zmq.DEALER)
            self._socks.append(s)
            mon = s.get_monitor_socket(MONITORED)
            self._monitors[mon] = len(self._socks) - 1
            self._poller.register(mon, zmq.POLLIN)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.MAXMSGSIZE, wire.MAX_MESSAGE_BYTES)
            if curve_secret is not None:
                try:
                    security.curve_client(s, curve_secret, key)
                except ValueError:
                    self.close()
                    raise
            s.connect(ep)
            self._poller.register(s, zmq.POLLIN)
        self.bad_replies = 0
        self.unsent = 0
        self.gaps: list[SubscriptionGap] = []
        self.handshake_failures = 0
        self._down_since: dict[int, float] = {}     # socket index -> when its connection went down
        self._ever_up: set[int] = set()
        self._handshake_warned: set[int] = set()
        self._subscribed = False
        self._prefix = ""
        self._sub_pending: list = []
        self._early: dict[str, wire.Record] = {}
        self._seq = 0
        self._sub_slice: wire.Slice | None = None
        self._sub_ids = "int16"
        self.reply_bytes = 0          # bytes of every reply frame received (what left the consumers for this client)
        self.sliced_locally = 0       # records a consumer sent whole although a slice was asked (an older one)
        self._warned_whole: set[int] = set()

    def close(self) -> None:
        for mon in self._monitors:
            mon.close(0)
        self._monitors = {}
        for s in self._socks:
            try:
                s.disable_monitor()
            except zmq.ZMQError:
                pass
            s.close(0)
        self._socks = []

    def _on_event(self, mon: zmq.Socket) -> None:
        """A connection event of one consumer's socket: resubscribe after a reconnect, report cuts and refusals."""
        from zmq.utils.monitor import recv_monitor_message
        i = self._monitors[mon]
        ev = recv_monitor_message(mon, zmq.NOBLOCK)["event"]
        ep, now = self.endpoints[i], time.monotonic()
        if ev == zmq.EVENT_DISCONNECTED:
            self._down_since.setdefault(i, now)
            if self._subscribed:
                log.warning("trainer %s: consumer %s disconnected: subscription prefix=%r cut; resubscribing when "
                            "it is back (live records finished meanwhile are not delivered; fetch has them)",
                            self.client_id, ep, self._prefix)
        elif ev == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            lost = self._down_since.pop(i, None)
            again = i in self._ever_up
            self._ever_up.add(i)
            self._handshake_warned.discard(i)
            if again and self._subscribed:
                self._send_all("hello", self.client_id, self._sub_body(), [self._socks[i]])
                gap = SubscriptionGap(ep, now if lost is None else lost, now)
                self.gaps.append(gap)
                log.warning("trainer %s: consumer %s back after %.3fs: resubscribed prefix=%r gaps=%d",
                            self.client_id, ep, gap.resubscribed_at - gap.lost_at, self._prefix, len(self.gaps))
        elif ev & HANDSHAKE_FAILED:
            self.handshake_failures += 1
            if i not in self._handshake_warned:
                self._handshake_warned.add(i)
                log.warning("trainer %s: consumer %s refused the handshake (event %d, %s): check this trainer's key "
                            "is in its allow-list and the server key is its own; handshake_failures=%d",
                            self.client_id, ep, ev, "auth" if ev == zmq.EVENT_HANDSHAKE_FAILED_AUTH else "protocol",
                            self.handshake_failures)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _send_all(self, kind: str, key, body: dict, socks=None) -> list:
        """Send one header to each consumer without blocking; returns the sockets that could not take it."""
        self._seq += 1
        head = wire.pack_header(kind, self.client_id, 0, self._seq, key, body)
        failed = []
        for s in self._socks if socks is None else socks:
            try:
                s.send(head, zmq.NOBLOCK)
            except zmq.Again:       # not connected (or its handshake failed): asked again later
                self.unsent += 1
                failed.append(s)
        return failed

    def _recv(self, timeout_ms: int) -> Reply | None:
        """One reply, or None on timeout."""
        deadline = None if timeout_ms < 0 else time.monotonic() + timeout_ms / 1000
        while True:
            left = -1 if deadline is None else max(0, int((deadline - time.monotonic()) * 1000))
            ready = self._poller.poll(left)
            if not ready:
                return None
            for sock, _ in ready:
                if sock in self._monitors:
                    self._on_event(sock)
            sock = next((sock for sock, _ in ready if sock not in self._monitors), None)
            if sock is None:
                if deadline is not None and time.monotonic() >= deadline:
                    return None
                continue
            try:
                frames = recv_frames(sock, 0, self.max_reply_bytes)
            except MessageTooLarge:
                self.bad_replies += 1            # dropped like a malformed one: fetch asks again
                continue
            self.reply_bytes += sum(f.buffer.nbytes if hasattr(f, "buffer") else len(f) for f in frames)
            try:
                if len(frames) > wire.MAX_FRAMES:       # (a record over 1 GiB comes in several row frames)
                    raise wire.ProtocolError("frame_count", f"reply of {len(frames)} frames")
                h = wire.decode_header(frames[0].buffer)
                if h.kind == "record":
                    return Reply("record", wire.decode_record(h, frames[1:]), self._socks.index(sock))
                if h.kind == "error":
                    return Reply("error", (h.key, wire.parse_error(h)), self._socks.index(sock))
            except wire.ProtocolError:
                self.bad_replies += 1            # a malformed reply is dropped; fetch asks again for what is missing
            if deadline is not None and time.monotonic() >= deadline:
                return None

    def _as_asked(self, rec: wire.Record, sl: wire.Slice | None, sock: int | None) -> wire.Record | None:
        """The record as the slice `sl` asks for it: as it came when the consumer sliced it; sliced here (and
        counted in `sliced_locally`) when a consumer that does not take slices sent it whole (ProtocolError
        "bad_slice" when its layers hold none of the record's); None when it is some other slice."""
        if sl is None:
            return rec if rec.layer_range is None and rec.token_range is None else None
        if rec.layer_range is None and rec.token_range is None:
            self.sliced_locally += 1
            if sock not in self._warned_whole:
                self._warned_whole.add(sock)
                log.warning("trainer %s: consumer %s sent record %r whole although layers=%s tokens=%s was asked "
                            "(it does not take slices): sliced here; sliced_locally=%d", self.client_id,
                            self.endpoints[sock] if sock is not None else "?", rec.request_id[:64], sl.layers,
                            sl.tokens, self.sliced_locally)
            return wire.slice_record(rec, sl)
        tr = rec.token_range
        if rec.layer_range == sl.layers and (
                (tr is None and sl.tokens is None)
                or (tr is not None and sl.tokens is not None and tr[1] <= sl.tokens[1]
                    and (tr[0] == sl.tokens[0] or tr[0] == tr[1]))):
            return rec
        return None

    def fetch(self, request_ids: Iterable[str], timeout_s: float = 60.0, *, unknown: str = "grace",
              unknown_grace_s: float = UNKNOWN_GRACE_S, layers: tuple[int, int] | None = None,
              tokens: tuple[int, int] | None = None, ids: str = "int16") -> dict[str, wire.Record]:
        """Return {request_id: Record} for every id, within timeout_s.

        Each trainer rank fetches only its slice (only those bytes leave the consumer): `request_ids` its samples
        (data-parallel rank); `layers=(lo, hi)` model layer ids [lo, hi), a pipeline stage's own layers (the
        record keeps the MoE layers among them: `moe_layer_ids`, `layer_range`); `tokens=(lo, hi)` absolute
        positions [lo, hi) of prompt + output, a context-parallel rank's chunk (clipped to the record's length;
        `token_range` (lo, hi, n) says which rows came, of n). A bad range is a ValueError naming it; a layer range
        that holds none of a record's MoE layers is SliceRefused (a RecordsNotServed) naming both.

        Every id is waited for until it is received, a consumer answers it with an error, or (by `unknown`) every
        consumer says it never saw it; only then does a failure raise, carrying what was received (`records`):
        RecordEvicted / RecordUnreadable (RecordsNotServed: `failed` {id: reason}) if a consumer answered an error
        (evicted; a record file it cannot read, named); RecordUnknown naming ids no consumer knows; FetchTimeout (a
        TimeoutError) naming the ids still missing at the deadline.

        unknown="grace" (the default): an id every consumer says it never saw is waited for unknown_grace_s (its
        request may not have reached a consumer yet), then RecordUnknown. unknown="raise": no grace. unknown="wait":
        waited for until the timeout (requests that may sit in an engine's queue longer than the grace).

        ids="int16" (the default): rows as int16, -1 where never computed, whatever the consumer stores (Record.
        widened()); ids="compact": as the consumer holds them and sent them (uint8/uint16 for a producer that
        narrows: `Record.id_dtype`, `Record.missing_id`), no widening copy.
        """
        wire.check_ids_choice(ids)
        if unknown not in ("wait", "raise", "grace"):
            raise ValueError(f"unknown must be 'grace', 'raise' or 'wait', got {unknown!r}")
        grace = {"raise": 0.0, "grace": unknown_grace_s, "wait": None}[unknown]
        sl = wire.make_slice(layers, tokens)
        want = set(request_ids)
        got = {}
        for rid in list(want):
            if rid in self._early:
                try:
                    rec = self._as_asked(self._early.pop(rid), sl, None)
                except wire.ProtocolError:
                    rec = None                   # asked of the consumers, which answer why
                if rec is not None:
                    got[rid] = rec.as_ids(ids)
        failed: dict[str, str] = {}              # id -> a consumer's error reason
        unknown_at: dict[str, set] = {}          # id -> the consumers that said, since the last ask, it is unknown
        unknown_since: dict[str, float] = {}     # id -> when an ask was first answered "unknown" by every consumer
        n_socks = len(self._socks)
        deadline = time.monotonic() + timeout_s
        next_ask = asked_at = 0.0
        while True:
            now = time.monotonic()
            outstanding = want - got.keys() - failed.keys()
            if not outstanding:
                break
            if grace is not None:
                gone = sorted(rid for rid in outstanding if len(unknown_at.get(rid, ())) >= n_socks)
                for rid in gone:
                    unknown_since.setdefault(rid, asked_at)
                if gone and len(gone) == len(outstanding) and all(now - unknown_since[r] >= grace for r in gone):
                    if failed:
                        raise self._not_served(failed, got, gone)
                    raise RecordUnknown(gone, got)
            if now >= deadline:
                missing = sorted(outstanding)
                if failed:
                    raise self._not_served(failed, got, missing)
                raise FetchTimeout(f"{len(missing)} of {len(want)} records not received in {timeout_s}s: "
                                   f"{missing[:8]}", missing, got)
            if now >= next_ask:
                ask = sorted(outstanding)
                body = {"timeout_ms": max(1, int((deadline - now) * 1000))}
                if sl is not None:
                    body.update(sl.body())
                if grace is not None:
                    body["answer_unknown"] = True
                    unknown_at.clear()           # asked again: the answers start over
                for i in range(0, len(ask), 4096):
                    self._send_all("fetch", ask[i:i + 4096], body)
                asked_at = now
                next_ask = now + self.retry_interval_s
            wake = min(deadline, next_ask)
            if grace is not None:            # the moment an id's grace runs out (past ones: nothing to wake for)
                wake = min([wake] + [t + grace for t in unknown_since.values() if t + grace > now])
            r = self._recv(max(1, int((wake - now) * 1000)))
            if r is None:
                continue
            if r.kind == "record":
                if r.value.request_id in want:
                    try:
                        rec = self._as_asked(r.value, sl, r.sock)
                    except wire.ProtocolError as e:      # sliced here: the slice holds none of its layers
                        failed[r.value.request_id] = f"{e.reason}: {e}"
                        continue
                    if rec is None:
                        self.bad_replies += 1     # another slice than asked: dropped, asked again
                        continue
                    got[r.value.request_id] = rec.as_ids(ids)
                    failed.pop(r.value.request_id, None)
                else:
                    self._early[r.value.request_id] = r.value
                continue
            key, reason = r.value
            if type(key) is str and key in want and key not in got and (
                    reason == "evicted" or reason.startswith("unreadable") or reason.startswith("bad_slice")):
                failed[key] = reason
            elif reason == "unknown" and isinstance(key, list):
                for rid in key:
                    if type(rid) is str and rid in want:
                        unknown_at.setdefault(rid, set()).add(r.sock)
        if failed:
            raise self._not_served(failed, got, [])
        return got

    @staticmethod
    def _not_served(failed: dict, got: dict, missing: list) -> RecordsNotServed:
        unreadable = any(reason.startswith("unreadable") for reason in failed.values())
        if not unreadable and any(reason.startswith("bad_slice") for reason in failed.values()):
            return SliceRefused(failed, got, missing)
        return (RecordUnreadable if unreadable else RecordEvicted)(failed, got, missing)

    def _sub_body(self) -> dict:
        return {"subscribe": self._prefix, **(self._sub_slice.body() if self._sub_slice is not None else {})}

    def subscribe(self, prefix: str = "", *, layers: tuple[int, int] | None = None,
                  tokens: tuple[int, int] | None = None, ids: str = "int16") -> None:
        """Receive live records whose request id starts with prefix (best effort; fetch is the lossless path);
        `layers`, `tokens`: only that slice of each record, `ids`: their rows' dtype, as in `fetch`."""
        self._sub_ids = wire.check_ids_choice(ids)
        self._sub_slice = wire.make_slice(layers, tokens)
        self._prefix = prefix
        self._subscribed = True
        self._sub_pending = self._send_all("hello", self.client_id, self._sub_body())

    def records(self, timeout_s: float | None = None) -> Iterator[wire.Record]:
        """Yield records as they come (from subscribe); stops after timeout_s without one (None: never)."""
        started = time.monotonic()
        while True:
            wait_ms = -1 if timeout_s is None else int(timeout_s * 1000)
            if self._sub_pending:   # a consumer that was not reachable yet is asked again every 100 ms
                self._sub_pending = self._send_all("hello", self.client_id, self._sub_body(), self._sub_pending)
                wait_ms = 100 if wait_ms < 0 else min(wait_ms, 100)
            r = self._recv(wait_ms)
            if r is None:
                if self._sub_pending and timeout_s is None:
                    continue
                if self._sub_pending and (time.monotonic() - started < timeout_s):
                    continue
                return
            started = time.monotonic()
            if r.kind == "record":
                try:
                    rec = self._as_asked(r.value, self._sub_slice, r.sock)
                except wire.ProtocolError:
                    rec = None
                if rec is None:
                    self.bad_replies += 1      # another slice than subscribed to (a late reply of a sliced fetch)
                    continue
                yield rec.as_ids(self._sub_ids)
