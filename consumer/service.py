"""Run a consumer: receive routed messages from a broker, accumulate, and hand finished records to the sinks.

Sinks: an npz directory (NpzWriter), a callback, and the trainer endpoint (`serve`): a ROUTER socket that
answers `fetch` (lossless: records are kept in a RecordStore until fetched) and `subscribe` (live records whose
request id starts with a prefix; a subscriber that cannot keep up loses records from the live view, which is
counted and logged, never from the store).

Delivery: every data message from the broker carries a link number (wire.py "Delivery"). `LinkIn` applies only
the next one, drops everything after a gap and asks the broker for a resync; the consumer acks the highest
applied link number every `ack_interval_ms` (one ack per interval, whatever the message rate).
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict, deque
from typing import Callable

import zmq

from routing_replay.consumer.accumulator import Accumulator
from routing_replay.consumer.npz import NpzWriter, Progress
from routing_replay.consumer.store import EVICTED, RecordStore
from routing_replay.protocol import security, wire
from routing_replay.protocol.loop import ServiceThread, guarded
from routing_replay.protocol.ids import default_peer_id

log = logging.getLogger("routing_replay.consumer")

DATA_KINDS = frozenset({"open", "delta", "finish", "abort"})
MAX_WAITERS = 1 << 20          # request ids trainers may wait for at once (fetch before the record exists)
MAX_SUBSCRIBERS = 1024
TRAINER_SNDHWM = 8             # records queued to one trainer connection; beyond it they stay in the store


class LinkIn:
    """Own this consumer's view of its link from the broker: the next lseq to apply and what to ack.

    One connection delivers in order, so a jump in lseq means messages were lost (a reconnect, or a send queue
    that was dropped): everything after the gap is dropped until the broker starts a new generation at lseq 1,
    and the producers resend (the broker asks them to rewind). Nothing is ever applied out of order.
    """

    __slots__ = ("bepoch", "gen", "expect", "upto", "acked", "gap", "gap_sent_at", "dropped")

    def __init__(self):
        self.bepoch = 0
        self.gen = -1
        self.expect = 1
        self.upto = 0          # highest lseq applied in (bepoch, gen)
        self.acked = 0         # highest lseq acked
        self.gap = None        # the lseq that never came, while waiting for a resync
        self.gap_sent_at = -1e9
        self.dropped = 0       # messages dropped after gaps or from stale generations

    def accept(self, link) -> bool:
        be, gen, lseq = link
        if be != self.bepoch or gen != self.gen:
            if be == self.bepoch and gen < self.gen:
                self.dropped += 1
                return False                    # sent before a resync
            self.bepoch, self.gen, self.upto, self.acked = be, gen, 0, 0
            self.expect, self.gap = 1, None
        if self.gap is not None or lseq != self.expect:
            if self.gap is None and lseq > self.expect:
                self.gap = self.expect
                log.warning("consumer link gap broker_epoch=%d gen=%d expected=%d got=%d: dropping until resync",
                            be, gen, self.expect, lseq)
            self.dropped += 1
            return False
        self.expect = lseq + 1
        self.upto = lseq
        return True

    def ack_body(self, now: float, gap_retry_s: float) -> dict | None:
        """The ack to send now, or None. A gap is reported at once and again every gap_retry_s until resolved."""
        if self.gen < 0:
            return None
        gap = self.gap is not None and now - self.gap_sent_at >= gap_retry_s
        if self.upto == self.acked and not gap:
            return None
        body = {"link": [self.bepoch, self.gen, self.upto]}
        self.acked = self.upto
        if gap:
            body["gap"] = self.gap
            self.gap_sent_at = now
        return body


class Consumer(ServiceThread):
    """Own a consumer's sockets (DEALER to the broker, optional ROUTER for trainers) and its accumulator.

    All sockets are created and used by the thread that calls `run()` (or the one `start()` makes).
    """

    def __init__(self, connect: str, *, consumer_id: str | None = None, npz_dir: str | None = None,
                 shard_size: int = 0, serve: str | None = None, context: zmq.Context | None = None,
                 store_max_bytes: int = 2 << 30, spill_dir: str | None = None,
                 heartbeat_interval_ms: int = 1000, finish_grace_s: float = 0.5, request_timeout_s: float = 600.0,
                 max_bytes: int = 16 << 30, on_record: Callable[[wire.Record], None] | None = None,
                 progress: bool = False, stats_interval_s: float = 10.0, rcvhwm: int = 100_000,
                 ack_interval_ms: int = 20, curve_secret: str | None = None, broker_key: str | None = None,
                 curve_allow: str | None = None, remember_finished: int = 100_000):
        self.connect = connect
        self.consumer_id = consumer_id or default_peer_id("consumer")
        if not 0 < len(self.consumer_id.encode()) <= 255:
            raise ValueError(f"consumer id must be 1..255 bytes of UTF-8, got {self.consumer_id[:64]!r}")
        self.serve = serve
        if (curve_secret is None) != (broker_key is None):
            raise ValueError("CURVE towards the broker needs both curve_secret and broker_key")
        if serve and curve_secret is not None and curve_allow is None:
            raise ValueError("serving trainers over CURVE needs curve_allow (the directory of trainers' public "
                             "certs); without it any client key would be accepted")
        self.curve_secret, self.broker_key, self.curve_allow = curve_secret, broker_key, curve_allow
        self._own_ctx = context is None and curve_allow is not None
        self._ctx = context or (zmq.Context() if self._own_ctx else zmq.Context.instance())
        self.epoch = time.time_ns() // 1000       # this incarnation: the broker forgets what the last one held
        self.acc = Accumulator(finish_grace_s=finish_grace_s, request_timeout_s=request_timeout_s,
                               max_bytes=max_bytes, remember_finished=remember_finished)
        self.writer = NpzWriter(npz_dir, shard_size) if npz_dir else None
        self.store = RecordStore(store_max_bytes, spill_dir) if serve else None
        self.on_record = on_record
        self.progress = Progress() if progress else None
        self.heartbeat_interval_s = heartbeat_interval_ms / 1000
        self.stats_interval_s = stats_interval_s
        self.rcvhwm = rcvhwm
        self.ack_interval_s = ack_interval_ms / 1000
        self.link = LinkIn()
        self.acks_sent = 0
        self.bad: dict[str, int] = defaultdict(int)
        self.records_out = 0
        self.msgs_in = 0
        self.subscriber_drops = 0
        self._waiters: dict[str, tuple[bytes, float]] = {}
        self._outbox: dict[bytes, deque] = {}      # trainer -> request ids whose records wait in the store for it
        self._retry: dict[bytes, tuple] = {}       # trainer -> (next try, backoff) while its send queue is full
        self._gone: set = set()                    # trainers found unreachable (their outboxes were dropped)
        self._subscribers: dict[bytes, str] = {}
        self._service_name = f"consumer-{self.consumer_id}"
        self._init_service(log)
        self._seq = 0

    # ---- lifecycle ----------------------------------------------------------------------------------------------

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the loop, write what is queued to disk, close sockets. Idempotent."""
        self._join(timeout_s)
        if self.writer is not None:
            self.writer.close()

    # ---- loop ---------------------------------------------------------------------------------------------------

    def run(self) -> None:
        """Serve until stop() (or SIGINT in the CLI). Owns and closes its sockets."""
        auth = None
        if self.serve and self.curve_allow is not None:
            auth = security.start_authenticator(self._ctx, self.curve_allow)
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.ROUTING_ID, self.consumer_id.encode())
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.RCVHWM, self.rcvhwm)
        dealer.setsockopt(zmq.MAXMSGSIZE, wire.MAX_MESSAGE_BYTES)
        server = None
        try:
            if self.curve_secret is not None:
                security.curve_client(dealer, self.curve_secret, self.broker_key)
            dealer.connect(self.connect)
            poller = zmq.Poller()
            poller.register(dealer, zmq.POLLIN)
            if self.serve:
                server = self._ctx.socket(zmq.ROUTER)
                server.setsockopt(zmq.LINGER, 0)
                server.setsockopt(zmq.ROUTER_MANDATORY, 1)
                server.setsockopt(zmq.SNDHWM, TRAINER_SNDHWM)
                server.setsockopt(zmq.MAXMSGSIZE, wire.MAX_HEADER_BYTES)
                if self.curve_secret is not None:
                    security.curve_server(server, self.curve_secret)
                server.bind(self.serve)
                self.serve = server.getsockopt_string(zmq.LAST_ENDPOINT)
                poller.register(server, zmq.POLLIN)
            self._send_ctl(dealer, "hello")
            self.ready.set()
            log.info("consumer %s connected to %s serve=%s npz_dir=%s epoch=%d curve=%s", self.consumer_id,
                     self.connect, self.serve, self.writer.dir if self.writer else None, self.epoch,
                     "on" if self.curve_secret else "off")
            cid = self.consumer_id
            now = time.monotonic()
            next_hb = now + self.heartbeat_interval_s
            next_tick = now + 0.1
            next_stats = now + self.stats_interval_s
            next_ack = now + self.ack_interval_s
            while not self._stop.is_set():
                wait_ms = 100 if self.link.upto == self.link.acked else max(1, int(self.ack_interval_s * 1000))
                if self._outbox:
                    wait_ms = min(wait_ms, max(1, int(self._retry_outboxes(server, time.monotonic()) * 1000)))
                events = dict(poller.poll(wait_ms))
                now = time.monotonic()
                if dealer in events:
                    # a burst bounded in count and in time: acks (the producers' replay buffers wait on them)
                    # and timers get their turn at least every ack interval, however large the messages
                    for _ in range(1000):
                        try:
                            frames = dealer.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        guarded(self._on_broker_message, (frames, now, server), self.bad, log, cid)
                        now = time.monotonic()
                        if now >= next_ack:
                            break
                if server is not None and server in events:
                    while True:
                        try:
                            frames = server.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        guarded(self._on_client_message, (server, frames, now), self.bad, log, cid)
                now = time.monotonic()
                if now >= next_ack:
                    body = self.link.ack_body(now, max(0.2, self.heartbeat_interval_s / 2))
                    if body is not None:
                        self._send_ctl(dealer, "ack", body)
                        self.acks_sent += 1
                    next_ack = now + self.ack_interval_s
                if now >= next_tick:
                    for rec in self.acc.poll(now):
                        self._emit(rec, server)
                    self._expire_waiters(now)
                    next_tick = now + 0.1
                if now >= next_hb:
                    self._send_ctl(dealer, "heartbeat", {"broker": self.link.bepoch})
                    next_hb = now + self.heartbeat_interval_s
                if self.progress is not None and self.writer is not None:
                    self.progress.maybe(self.writer.records, self.writer.rows, self.writer.bytes, self.acc.in_flight)
                if now >= next_stats:
                    self._log_stats()
                    next_stats = now + self.stats_interval_s
            try:
                body = self.link.ack_body(time.monotonic(), 0)
                if body is not None:
                    self._send_ctl(dealer, "ack", body)
                self._send_ctl(dealer, "bye")
            except zmq.ZMQError:
                pass
        except zmq.ContextTerminated:
            pass
        finally:
            self.ready.set()
            dealer.close(0)
            if server is not None:
                server.close(0)
            if auth is not None:
                auth.stop()
            if self._own_ctx:
                self._ctx.term()
            self._log_stats()

    def _send_ctl(self, sock: zmq.Socket, kind: str, body: dict | None = None) -> None:
        self._seq += 1
        if body is None:
            body = {"broker": self.link.bepoch} if kind == "hello" else {}
        try:
            sock.send_multipart([wire.pack_header(kind, self.consumer_id, self.epoch, self._seq, self.consumer_id,
                                                  body)], zmq.NOBLOCK)
        except zmq.Again:          # not connected yet, or the broker is not reading: the next tick sends again
            pass

    def _log_stats(self) -> None:
        s = self.acc.stats
        log.info("consumer %s records=%d complete=%d incomplete=%d aborted=%d timed_out=%d in_flight=%d "
                 "delta_msgs=%d rows=%d MB=%.1f held_MB=%.1f late=%d replayed_opens=%d refused=%d link=%d/%d/%d "
                 "acks=%d link_dropped=%d bad=%d %s store=%s store_MB=%.1f spilled=%d evicted=%d "
                 "subscriber_drops=%d waiters=%d outbox=%d", self.consumer_id, s.finished, s.complete, s.incomplete,
                 s.aborted, s.timed_out, self.acc.in_flight, s.delta_msgs, s.rows, s.bytes / 1e6,
                 self.acc.bytes_held / 1e6, s.late_msgs, s.replayed_opens, s.refused_msgs, self.link.bepoch % 1000,
                 self.link.gen, self.link.upto, self.acks_sent, self.link.dropped, sum(self.bad.values()),
                 dict(self.bad) if self.bad else "", len(self.store) if self.store is not None else "-",
                 self.store.bytes / 1e6 if self.store is not None else 0.0,
                 self.store.spilled if self.store is not None else 0,
                 self.store.evicted if self.store is not None else 0, self.subscriber_drops, len(self._waiters),
                 sum(len(q) for q in self._outbox.values()))

    def _count_bad(self, reason: str, err: Exception) -> None:
        self.bad[reason] += 1
        n = self.bad[reason]
        if n == 1 or n % 1000 == 0:
            log.warning("consumer %s dropped a bad message (%s, %d so far): %s", self.consumer_id, reason, n, err)

    def _on_broker_message(self, frames: list, now: float, server) -> None:
        self.msgs_in += 1
        try:
            if len(frames) > wire.MAX_FRAMES:
                raise wire.ProtocolError("frame_count", f"{len(frames)} frames")
            h = wire.decode_header(frames[0].buffer)
            if h.kind not in DATA_KINDS:
                if h.kind == "error":
                    log.error("consumer %s: broker says: %s", self.consumer_id, str(h.body.get("reason"))[:300])
                return
            if h.link is None:
                raise wire.ProtocolError("no_link", f"{h.kind} from the broker without a link number")
            if not self.link.accept(h.link):
                return
            recs = self.acc.apply(h, frames[1:], now)
        except wire.ProtocolError as e:
            self._count_bad(e.reason, e)
            return
        for rec in recs:
            self._emit(rec, server)

    # ---- sinks --------------------------------------------------------------------------------------------------

    def _emit(self, rec: wire.Record, server) -> None:
        self.records_out += 1
        if not rec.complete:
            log.warning("consumer %s record %r incomplete: reason=%s missing=%s", self.consumer_id,
                        rec.request_id[:64], rec.reason, rec.missing[:4])
        if self.writer is not None:
            self.writer.put(rec)
        if self.on_record is not None:
            self.on_record(rec)
        if server is None:
            return
        frames = None
        for client, prefix in list(self._subscribers.items()):
            if rec.request_id.startswith(prefix):
                frames = frames or wire.encode_record(rec, self.consumer_id, 0)
                self._send_client(server, client, frames, subscriber=True)
        w = self._waiters.pop(rec.request_id, None)
        if w is not None and not self._outbox.get(w[0]):
            if self._send_client(server, w[0], frames or wire.encode_record(rec, self.consumer_id, 0)):
                return
            if w[0] not in self._gone:
                self._outbox.setdefault(w[0], deque()).append(rec.request_id)     # its queue is full: later
        elif w is not None:
            self._outbox[w[0]].append(rec.request_id)
        self.store.put(rec)

    def _drain_outbox(self, server, client: bytes, now: float) -> None:
        """Send a trainer the records it asked for, in order, until its send queue is full (then back off)."""
        q = self._outbox.get(client)
        while q:
            rid = q[0]
            got = self.store.peek(rid)
            if got is None:                        # fetched meanwhile through another connection
                q.popleft()
                continue
            if got == EVICTED:
                self._send_client(server, client, [wire.pack_header("error", self.consumer_id, 0, 0, rid,
                                                                    {"reason": "evicted"})])
                q.popleft()
                continue
            if not self._send_client(server, client, wire.encode_record(got, self.consumer_id, 0)):
                if client in self._gone:
                    break
                backoff = min(0.1, 2 * self._retry.get(client, (0.0, 0.0005))[1])
                self._retry[client] = (now + backoff, backoff)
                return
            self.store.discard(rid)
            q.popleft()
        self._outbox.pop(client, None)
        self._retry.pop(client, None)

    def _retry_outboxes(self, server, now: float) -> float:
        """Retry trainers whose send queue was full; returns seconds until the next retry is due (or 0.1)."""
        nxt = 0.1
        for client in list(self._outbox):
            at = self._retry.get(client, (0.0, 0.0))[0]
            if at <= now:
                self._drain_outbox(server, client, now)
                at = self._retry.get(client, (now + 0.1, 0.0))[0]
            nxt = min(nxt, max(0.0, at - now))
        return nxt

    def _send_client(self, server, client: bytes, frames: list, subscriber: bool = False) -> bool:
        try:
            server.send_multipart([client, *frames], zmq.NOBLOCK, copy=False)
            return True
        except zmq.Again:
            if subscriber:
                self.subscriber_drops += 1
                if self.subscriber_drops == 1 or self.subscriber_drops % 1000 == 0:
                    log.warning("consumer %s: subscriber %r is slow, live records dropped=%d (fetch still has them)",
                                self.consumer_id, client[:32], self.subscriber_drops)
            return False
        except zmq.ZMQError as e:  # EHOSTUNREACH: the client went away
            if subscriber:
                self._subscribers.pop(client, None)
            self._outbox.pop(client, None)
            self._retry.pop(client, None)
            self._gone.add(client)
            if len(self._gone) > 10_000:
                self._gone.clear()
            log.info("consumer %s: client %r unreachable (%s)", self.consumer_id, client[:32], e)
            return False

    def _on_client_message(self, server, frames: list, now: float) -> None:
        client = frames[0].bytes
        try:
            if len(frames) != 2:
                raise wire.ProtocolError("frame_count", f"client message has {len(frames) - 1} frames, expected 1")
            h = wire.decode_header(frames[1].buffer)
            if h.kind == "fetch":
                ids = h.key if isinstance(h.key, list) else [h.key]
                if len(ids) > wire.MAX_REQUESTS_PER_DELTA:
                    raise wire.ProtocolError("too_large", f"fetch of {len(ids)} ids")
                for rid in ids:
                    wire.check_request_id(rid)
                timeout_ms = wire.int_field(h.body, "timeout_ms", 0, 1 << 31, 60_000)
                if len(self._waiters) + len(ids) > MAX_WAITERS:
                    raise wire.ProtocolError("too_many_waiters", f"{len(self._waiters)} ids already waited for, "
                                             f"limit {MAX_WAITERS}")
                self._fetch(server, client, ids, now + timeout_ms / 1000)
            elif h.kind == "hello" and "subscribe" in h.body:
                prefix = h.body["subscribe"]
                if type(prefix) is not str or len(prefix) > wire.MAX_REQUEST_ID_BYTES:
                    raise wire.ProtocolError("bad_field", "subscribe prefix must be a str")
                if client not in self._subscribers and len(self._subscribers) >= MAX_SUBSCRIBERS:
                    raise wire.ProtocolError("too_many_subscribers", f"limit {MAX_SUBSCRIBERS}")
                self._subscribers[client] = prefix
                log.info("consumer %s: subscriber %r prefix=%r subscribers=%d", self.consumer_id, client[:32],
                         prefix, len(self._subscribers))
            elif h.kind == "bye":
                self._subscribers.pop(client, None)
            elif h.kind == "heartbeat":
                pass
            else:
                raise wire.ProtocolError("unexpected_kind", f"trainer endpoint does not take {h.kind!r}")
        except wire.ProtocolError as e:
            self._count_bad(e.reason, e)
            self._send_client(server, client, [wire.pack_header("error", self.consumer_id, 0, 0, "",
                                                                {"reason": f"{e.reason}: {e}"[:200]})])

    def _fetch(self, server, client: bytes, ids: list, deadline: float) -> None:
        self._gone.discard(client)
        q = self._outbox.get(client)
        queued = set(q) if q else ()
        for rid in ids:
            if rid not in self.store:
                self._waiters[rid] = (client, deadline)
            elif rid not in queued:
                self._outbox.setdefault(client, deque()).append(rid)
        if client in self._outbox and client not in self._retry:
            self._drain_outbox(server, client, time.monotonic())

    def _expire_waiters(self, now: float) -> None:
        if self._waiters:
            for rid in [r for r, (_, d) in self._waiters.items() if d < now]:
                del self._waiters[rid]
