"""Route wire-v1 messages from producers to the consumer that owns each request id, and carry acks back.

Sockets: `frontend` ROUTER (producers' DEALERs connect), `backend` ROUTER (consumers' DEALERs connect and
announce themselves with hello/heartbeat). Ownership: a request id is assigned when first seen, by rendezvous
hashing over the live consumers, and stays with that consumer until its finish/abort (sticky), so adding a
consumer never moves an in-flight request. A delta that spans requests of several consumers is split: each
owner gets a re-encoded header with its requests and the matching slices of the payload, forwarded zero-copy
(large runs) or gathered into one frame (rows smaller than COPY_THRESHOLD on average, e.g. decode steps).

Delivery (wire.py "Delivery", docs/RELIABILITY.md): per producer incarnation the broker accepts data messages
in seq order only (a resend of an earlier seq is accepted, a gap is dropped and answered with a rewind request),
numbers what it sends on each consumer link (lseq, per link generation), and acks a producer's seq once every
consumer part of it was acked, as a contiguous prefix. A consumer that stops heartbeating for `liveness`
intervals, restarts (new epoch) or becomes unreachable loses its link: the producers whose messages it had not
acked are asked to rewind, and its in-flight requests are reassigned to a live consumer on their next message
(the new owner gets the request's open marked `reassigned: true` and flags the record "consumer_lost" unless
every row arrives anyway). A producer silent for `producer_timeout_ms` is lost: the owners of the requests it
opened get an abort with reason "producer_lost". When no consumer is live (or, after a restart, for a grace
period while the old consumers reconnect) messages wait in a bounded queue (max_pending_bytes).
"""

from __future__ import annotations

import logging
import os
import time
import zlib
from collections import defaultdict, deque
from dataclasses import dataclass

import msgpack
import numpy as np
import zmq

from routing_replay.protocol import security, wire
from routing_replay.protocol.loop import ServiceThread, guarded

log = logging.getLogger("routing_replay.broker")

DATA_KINDS = frozenset({"delta", "open", "finish", "abort"})
MAX_PRODUCERS = 4096
MAX_CONSUMERS = 1024
MAX_UNACKED_PER_LINK = 1 << 20       # parts sent to one consumer and not acked; beyond it the link is dropped


@dataclass
class BrokerStats:
    msgs_in: int = 0
    bytes_in: int = 0
    msgs_out: int = 0
    bytes_out: int = 0
    deltas_split: int = 0
    requests_opened: int = 0
    requests_closed: int = 0
    reassigned: int = 0
    dropped_no_consumer: int = 0
    dropped_slow_consumer: int = 0
    dropped_unreachable: int = 0
    resent_in: int = 0               # data messages that were a producer's resend (seq below the next expected)
    refused_gap: int = 0             # data messages after a gap in a producer's seqs (dropped, rewind asked)
    refused_unknown: int = 0         # data messages from a producer that has not said hello to this broker
    rewinds_asked: int = 0
    acks_in: int = 0
    acks_out: int = 0
    link_resyncs: int = 0
    links_lost: int = 0
    producers_lost: int = 0
    aborted_for_lost_producer: int = 0


def _hrw(rid: bytes, consumers: list[bytes]) -> bytes:
    best, best_score = consumers[0], -1
    for c in consumers:
        s = zlib.crc32(rid, zlib.crc32(c))
        if s > best_score:
            best, best_score = c, s
    return best


class _Link:
    """Own the broker's side of one consumer incarnation: its lseq numbering and the parts it has not acked."""

    __slots__ = ("cid", "epoch", "gen", "lseq", "sent", "alive", "last_seen", "name")

    def __init__(self, cid: bytes, epoch: int, gen: int, now: float):
        self.cid = cid
        self.epoch = epoch
        self.gen = gen
        self.lseq = 0
        self.sent: deque = deque()          # (lseq, token or None), lseq increasing
        self.alive = True
        self.last_seen = now
        self.name = cid.decode(errors="replace")


class _Prod:
    """Own what the broker knows of one producer incarnation: next seq expected, ack frontier, rewind state."""

    __slots__ = ("pid", "epoch", "ident", "next", "frontier", "done", "acked_sent", "last_seen", "nacked_at",
                 "nacked_for", "held")

    def __init__(self, pid: str, epoch: int, ident: bytes, unacked_from: int, now: float):
        self.pid = pid
        self.epoch = epoch
        self.ident = ident
        self.next = unacked_from            # the seq accepted next (anything lower is a resend)
        self.frontier = unacked_from - 1    # every seq <= frontier is done (applied everywhere it went)
        self.done: set = set()              # done seqs above frontier + 1
        self.acked_sent = self.frontier
        self.last_seen = now
        self.nacked_at = -1e9
        self.nacked_for = -1                # `next` when the last rewind was asked (one ask per gap episode)
        self.held: set = set()              # seqs waiting in the pending queue


class Broker(ServiceThread):
    """Own the frontend and backend sockets, the consumer links, the producers' delivery state and the
    request -> consumer table.

    Sockets are created and used only by the thread running `run()` (or `bind()` + `serve()`).
    """

    _service_name = "broker"

    def __init__(self, frontend: str, backend: str, *, context: zmq.Context | None = None,
                 heartbeat_interval_ms: int = 1000, liveness: int = 3, stats_interval_s: float = 10.0,
                 max_pending_bytes: int = 512 << 20, max_open_requests: int = 1 << 20, hwm: int = 100_000,
                 producer_timeout_ms: int = 10_000, ack_interval_ms: int = 20, restart_grace_ms: int | None = None,
                 curve_secret: str | None = None, curve_allow: str | None = None):
        self.frontend = frontend
        self.backend = backend
        self.curve_secret = curve_secret
        self.curve_allow = curve_allow
        if (curve_secret is None) != (curve_allow is None):
            raise ValueError("CURVE needs both curve_secret (the broker's own secret cert) and curve_allow "
                             "(the directory of allowed clients' public certs)")
        self._own_ctx = context is None and curve_secret is not None
        self._ctx = context or (zmq.Context() if self._own_ctx else zmq.Context.instance())
        self._auth = None
        self.heartbeat_interval_s = heartbeat_interval_ms / 1000
        self.liveness = liveness
        self.stats_interval_s = stats_interval_s
        self.max_pending_bytes = max_pending_bytes
        self.max_open_requests = max_open_requests
        self.hwm = hwm
        self.producer_timeout_s = producer_timeout_ms / 1000
        self.ack_interval_s = ack_interval_ms / 1000
        self.restart_grace_s = (2 * self.heartbeat_interval_s if restart_grace_ms is None
                                else restart_grace_ms / 1000)
        self.epoch = time.time_ns() // 1000          # a new one per start: consumers and producers see restarts
        self.stats = BrokerStats()
        self.bad: dict[str, int] = defaultdict(int)
        self.links: dict[bytes, _Link] = {}           # consumer id -> its live link
        self._live: list[bytes] = []                  # sorted live consumer ids (for rendezvous hashing)
        self._live_set: frozenset = frozenset()       # live _Link objects
        self._gen = 0                                 # link generations, broker-wide, increasing
        self.owner: dict[str, _Link] = {}             # request id -> the link of its consumer
        self._open_msg: dict[str, tuple] = {}         # request id -> (open header bytes, token frames)
        self._req_prod: dict[str, _Prod] = {}         # request id -> the producer that opened it
        self.producers: dict[str, _Prod] = {}         # producer id -> its current incarnation
        self._ack_dirty: set = set()
        self._nacked_idents: dict[bytes, float] = {}
        self._pending: deque = deque()                # (header, frames, token, producer) held in order
        self._pending_bytes = 0
        self._hold_all = True                         # no live consumer, or a restart's grace period
        self._restart_seen = False
        self._started = time.monotonic()
        self._now = self._started                     # the serve loop's clock, read once per burst
        self._warned: set = set()
        self._init_service(log)
        self._back = None
        self._front = None

    # ---- lifecycle ----------------------------------------------------------------------------------------------


    def close(self, timeout_s: float = 10.0) -> None:
        self._join(timeout_s)

    def bind(self) -> None:
        """Create and bind both sockets (in the calling thread, which must then call serve())."""
        if self.curve_secret is not None:
            self._auth = security.start_authenticator(self._ctx, self.curve_allow)
        self._front = self._ctx.socket(zmq.ROUTER)
        self._back = self._ctx.socket(zmq.ROUTER)
        try:
            for s in (self._front, self._back):
                s.setsockopt(zmq.LINGER, 0)
                s.setsockopt(zmq.ROUTER_MANDATORY, 1)
                s.setsockopt(zmq.ROUTER_HANDOVER, 1)     # a peer that reconnects with its routing id takes over
                s.setsockopt(zmq.SNDHWM, self.hwm)
                s.setsockopt(zmq.RCVHWM, self.hwm)
                s.setsockopt(zmq.MAXMSGSIZE, wire.MAX_MESSAGE_BYTES)
                if self.curve_secret is not None:
                    security.curve_server(s, self.curve_secret)
            self._front.bind(self.frontend)
            self._back.bind(self.backend)
        except BaseException:
            self._close_sockets()
            raise
        self.frontend = self._front.getsockopt_string(zmq.LAST_ENDPOINT)
        self.backend = self._back.getsockopt_string(zmq.LAST_ENDPOINT)

    def _close_sockets(self) -> None:
        for s in (self._front, self._back):
            if s is not None:
                s.close(0)
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        if self._own_ctx:
            self._ctx.term()

    def run(self) -> None:
        if self._front is None:
            self.bind()
        self.serve()

    def serve(self) -> None:
        front, back = self._front, self._back
        try:
            poller = zmq.Poller()
            poller.register(front, zmq.POLLIN)
            poller.register(back, zmq.POLLIN)
            self._started = time.monotonic()
            self.ready.set()
            log.info("broker frontend=%s backend=%s epoch=%d curve=%s", self.frontend, self.backend, self.epoch,
                     "on" if self.curve_secret else "off")
            now = time.monotonic()
            next_hb = now + self.heartbeat_interval_s
            next_stats = now + self.stats_interval_s
            next_ack = now + self.ack_interval_s
            while not self._stop.is_set():
                events = dict(poller.poll(min(100, max(1, int(self.ack_interval_s * 1000)))))
                if back in events:
                    while True:
                        try:
                            frames = back.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        guarded(self._on_backend, (frames, time.monotonic()), self.bad, log, "broker")
                if front in events:
                    self._now = time.monotonic()
                    for _ in range(10_000):
                        try:
                            frames = front.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        guarded(self._on_frontend, (frames,), self.bad, log, "broker")
                now = time.monotonic()
                if now >= next_ack:
                    self._send_acks()
                    next_ack = now + self.ack_interval_s
                if now >= next_hb:
                    self._expire(now)
                    next_hb = now + self.heartbeat_interval_s
                if self._hold_all or self._pending:
                    self._update_hold(now)
                if now >= next_stats:
                    self.log_stats()
                    next_stats = now + self.stats_interval_s
        except zmq.ContextTerminated:
            pass
        finally:
            self.ready.set()
            self._close_sockets()
            self.log_stats()

    def log_stats(self) -> None:
        s = self.stats
        log.info("broker msgs_in=%d MB_in=%.1f msgs_out=%d MB_out=%.1f split=%d open_requests=%d consumers=%d "
                 "producers=%d reassigned=%d pending=%d dropped_no_consumer=%d dropped_slow=%d "
                 "dropped_unreachable=%d resent_in=%d refused_gap=%d refused_unknown=%d rewinds_asked=%d "
                 "acks_in=%d acks_out=%d unacked_parts=%d link_resyncs=%d links_lost=%d producers_lost=%d "
                 "aborted_for_lost_producer=%d bad=%d %s", s.msgs_in, s.bytes_in / 1e6, s.msgs_out,
                 s.bytes_out / 1e6, s.deltas_split, len(self.owner), len(self._live), len(self.producers),
                 s.reassigned, len(self._pending), s.dropped_no_consumer, s.dropped_slow_consumer,
                 s.dropped_unreachable, s.resent_in, s.refused_gap, s.refused_unknown, s.rewinds_asked, s.acks_in,
                 s.acks_out, sum(len(k.sent) for k in self.links.values()), s.link_resyncs, s.links_lost,
                 s.producers_lost, s.aborted_for_lost_producer, sum(self.bad.values()),
                 dict(self.bad) if self.bad else "")

    # ---- consumers ----------------------------------------------------------------------------------------------

    def _set_live(self) -> None:
        self._live = sorted(self.links)
        self._live_set = frozenset(self.links.values())
        self._update_hold(time.monotonic())

    def _update_hold(self, now: float) -> None:
        grace = self._restart_seen and now < self._started + self.restart_grace_s
        hold = not self._live or grace
        was = self._hold_all
        self._hold_all = hold
        if not hold and (was or self._pending):
            self._flush_pending()

    def _on_backend(self, frames: list, now: float) -> None:
        cid = frames[0].bytes
        try:
            if len(frames) != 2:
                raise wire.ProtocolError("frame_count", f"consumer sent {len(frames) - 1} frames, expected 1")
            h = wire.decode_header(frames[1].buffer)
        except wire.ProtocolError as e:
            self._bad(e, cid, self._back)
            return
        link = self.links.get(cid)
        kind = h.kind
        if kind in ("hello", "heartbeat"):
            if link is None or link.epoch != h.epoch:
                if link is not None:
                    self._link_lost(link, "restarted")
                if len(self.links) >= MAX_CONSUMERS:
                    self._bad(wire.ProtocolError("too_many_consumers", f"{len(self.links)} consumers"), cid,
                              self._back)
                    return
                self._gen += 1
                link = self.links[cid] = _Link(cid, h.epoch, self._gen, now)
                seen = h.body.get("broker", 0)
                if type(seen) is int and seen not in (0, self.epoch) and now < self._started + self.restart_grace_s:
                    self._restart_seen = True          # it was with an earlier broker: this one is a restart
                self._set_live()
                log.info("broker consumer joined id=%s epoch=%d gen=%d consumers=%d restart_grace=%s", link.name,
                         h.epoch, link.gen, len(self._live), self._hold_all and bool(self._live))
            link.last_seen = now
        elif kind == "ack":
            if link is None or link.epoch != h.epoch:
                self.bad["stale_ack"] += 1
                return
            try:
                self._on_ack(link, h.body)
            except wire.ProtocolError as e:
                self._bad(e, cid, self._back)
        elif kind == "bye":
            if link is not None and link.epoch == h.epoch:
                self._link_lost(link, "bye")
        else:
            self._bad(wire.ProtocolError("unexpected_kind", f"consumer sent {kind!r}"), cid, self._back)

    def _on_ack(self, link: _Link, body: dict) -> None:
        lk = body.get("link")
        if (not isinstance(lk, list) or len(lk) != 3
                or not all(type(x) is int and 0 <= x < 1 << 63 for x in lk)):
            raise wire.ProtocolError("bad_field", "ack link must be [broker_epoch, gen, upto]")
        self.stats.acks_in += 1
        if lk[0] != self.epoch or lk[1] != link.gen:
            return                                  # for an earlier broker or link generation
        upto = lk[2]
        sent = link.sent
        while sent and sent[0][0] <= upto:
            tok = sent.popleft()[1]
            if tok is not None:
                tok[0] -= 1
                if tok[0] == 0 and tok[1] is not None:
                    self._complete(tok[1], tok[2])
        gap = body.get("gap")
        if gap is not None:
            self._resync(link, gap)

    def _resync(self, link: _Link, gap) -> None:
        """The consumer missed lseq `gap` (dropped what came after it): start a new link generation."""
        n = len(link.sent)
        affected = self._poison(link)
        self._gen += 1
        link.gen = self._gen
        link.lseq = 0
        self.stats.link_resyncs += 1
        log.warning("broker link resync consumer=%s gap_at=%r unacked_parts=%d new_gen=%d producers_to_rewind=%d",
                    link.name, gap, n, link.gen, len(affected))
        for ps in affected:
            self._ask_rewind(ps, force=True)

    def _poison(self, link: _Link) -> set:
        """Forget the parts sent on this link that it has not acked: their seqs will never be acked through it.

        Go back N: each affected producer's next accepted seq becomes its lowest seq lost here, so nothing that
        follows it reaches any consumer again before the producer has resent it (in seq order, from its first
        unacked). Otherwise a consumer could apply a later message of a request before an earlier one it never
        got, and emit a record whose rows the earlier message should have overwritten.
        """
        low: dict = {}
        for _, tok in link.sent:
            if tok is not None and tok[1] is not None:
                ps = tok[1]
                if tok[2] < low.get(ps, 1 << 63):
                    low[ps] = tok[2]
                tok[1] = None
        link.sent.clear()
        for ps, seq in low.items():
            if seq < ps.next and self.producers.get(ps.pid) is ps:
                ps.next = seq
        return set(low)

    def _link_lost(self, link: _Link, why: str) -> None:
        if self.links.get(link.cid) is link:
            del self.links[link.cid]
        link.alive = False
        n_parts = len(link.sent)
        affected = self._poison(link)
        n_req = sum(1 for o in self.owner.values() if o is link)
        self.stats.links_lost += 1
        self._set_live()
        (log.info if why == "bye" and not n_req and not n_parts else log.warning)(
            "broker consumer %s id=%s why=%s in_flight_requests=%d unacked_parts=%d "
                    "producers_to_rewind=%d consumers=%d", "expired" if why.startswith("silent") else "lost",
                    link.name, why, n_req, n_parts, len(affected), len(self._live))
        for ps in affected:
            self._ask_rewind(ps, force=True)

    def _expire(self, now: float) -> None:
        cutoff = now - self.liveness * self.heartbeat_interval_s
        for link in [k for k in self.links.values() if k.last_seen < cutoff]:
            self._link_lost(link, f"silent_{now - link.last_seen:.1f}s")
        cutoff_p = now - self.producer_timeout_s
        for ps in [p for p in self.producers.values() if p.last_seen < cutoff_p]:
            self._producer_lost(ps, "producer_lost", now)
        if len(self._nacked_idents) > 10_000:
            self._nacked_idents.clear()

    # ---- producers ----------------------------------------------------------------------------------------------

    def _bad(self, e: wire.ProtocolError, peer: bytes, sock) -> None:
        self.bad[e.reason] += 1
        n = self.bad[e.reason]
        if n == 1 or n % 1000 == 0:
            log.warning("broker dropped a bad message from %r (%s, %d so far): %s", peer[:48], e.reason, n, e)
        if (peer, e.reason) not in self._warned and len(self._warned) < 10_000:
            self._warned.add((peer, e.reason))
            try:
                sock.send_multipart([peer, wire.pack_header("error", "broker", self.epoch, 0, "",
                                                            {"reason": f"{e.reason}: {e}"[:300]})], zmq.NOBLOCK)
            except zmq.ZMQError:
                pass

    def _reply(self, ident: bytes, kind: str, key, body: dict) -> bool:
        try:
            self._front.send_multipart([ident, wire.pack_header(kind, "broker", self.epoch, 0, key, body)],
                                       zmq.NOBLOCK)
            return True
        except zmq.ZMQError:        # EAGAIN (slow producer) or EHOSTUNREACH (gone): it asks again or rewinds
            return False

    def _on_frontend(self, frames: list) -> None:
        st = self.stats
        st.msgs_in += 1
        ident = frames[0].bytes
        try:
            if len(frames) < 2 or len(frames) > wire.MAX_FRAMES:
                raise wire.ProtocolError("frame_count", f"message has {len(frames) - 1} frames")
            h = wire.decode_header(frames[1].buffer)
            kind = h.kind
            if kind in DATA_KINDS:
                ps = self.producers.get(h.producer)
                if ps is None or ps.epoch != h.epoch or ps.ident != ident:
                    st.refused_unknown += 1
                    self._ask_rewind_unknown(ident, h)
                    return
                seq = h.seq
                if seq != ps.next:
                    if seq > ps.next:
                        st.refused_gap += 1
                        self._ask_rewind(ps)
                        return
                    st.resent_in += 1
                    if seq in ps.held:                # already waiting in the pending queue
                        ps.next = seq + 1
                        return
                ps.next = seq + 1
                ps.last_seen = self._now             # data counts as a sign of life (heartbeats queue behind it)
                tok = [0, ps, seq]
                try:
                    self._route(h, frames, tok, ps)
                except Exception:
                    if tok[0] == 0 and tok[1] is not None:
                        self._complete(ps, seq)       # refused for good: a resend would not make it valid
                    raise
            elif kind in ("hello", "heartbeat"):
                self._on_producer_hello(ident, h)
            elif kind == "bye":
                ps = self.producers.get(h.producer)
                if ps is not None and ps.epoch == h.epoch and ps.ident == ident:
                    self._producer_lost(ps, "producer_closed", time.monotonic())
            else:
                raise wire.ProtocolError("unexpected_kind", f"producers do not send {kind!r}")
        except wire.ProtocolError as e:
            self._bad(e, ident, self._front)

    def _on_producer_hello(self, ident: bytes, h: wire.Header) -> None:
        now = time.monotonic()
        u = wire.int_field(h.body, "unacked_from", 0, (1 << 63) - 1, 1)
        ps = self.producers.get(h.producer)
        if ps is not None and ps.epoch != h.epoch:
            if h.epoch < ps.epoch:
                raise wire.ProtocolError("stale_epoch", f"producer {h.producer[:64]!r} epoch {h.epoch} is older "
                                         f"than its current epoch {ps.epoch}")
            self._producer_lost(ps, "producer_restarted", now)
            ps = None
        if ps is None:
            if len(self.producers) >= MAX_PRODUCERS:
                raise wire.ProtocolError("too_many_producers", f"{len(self.producers)} producers")
            ps = self.producers[h.producer] = _Prod(h.producer, h.epoch, ident, u, now)
            log.info("broker producer joined id=%s epoch=%d unacked_from=%d producers=%d", h.producer[:64],
                     h.epoch, u, len(self.producers))
        else:
            if ps.ident != ident:
                log.info("broker producer reconnected id=%s", h.producer[:64])
                ps.ident = ident
            if u > ps.next:                  # everything below u was acked: nothing missing there
                ps.next = u
            if u - 1 > ps.frontier:
                ps.frontier = u - 1
                ps.done = {s for s in ps.done if s >= u}
                if u in ps.done:
                    ps.done.discard(u)
                    self._complete(ps, u)
        ps.last_seen = now
        self._reply(ident, "heartbeat", h.producer, {"consumers": len(self._live)})

    def _ask_rewind(self, ps: _Prod, force: bool = False) -> None:
        """Ask a producer to resend everything it has not had acked (once per gap, again after a while)."""
        now = time.monotonic()
        if not force and ps.nacked_for == ps.next and now - ps.nacked_at < max(0.5, self.heartbeat_interval_s):
            return
        ps.nacked_for, ps.nacked_at = ps.next, now
        self.stats.rewinds_asked += 1
        self._reply(ps.ident, "ack", ps.pid, {"epoch": ps.epoch, "upto": ps.frontier, "rewind": True,
                                              "expect": ps.next})

    def _ask_rewind_unknown(self, ident: bytes, h: wire.Header) -> None:
        now = time.monotonic()
        if now - self._nacked_idents.get(ident, -1e9) < 0.5:
            return
        self._nacked_idents[ident] = now
        self.stats.rewinds_asked += 1
        self._reply(ident, "ack", h.producer, {"epoch": h.epoch, "upto": -1, "rewind": True, "hello": True})

    def _complete(self, ps: _Prod, seq: int) -> None:
        f = ps.frontier
        if seq == f + 1:
            f = seq
            done = ps.done
            if done:
                while f + 1 in done:
                    f += 1
                    done.discard(f)
            ps.frontier = f
            self._ack_dirty.add(ps)
        elif seq > f:
            ps.done.add(seq)

    def _send_acks(self) -> None:
        if not self._ack_dirty:
            return
        dirty, self._ack_dirty = self._ack_dirty, set()
        for ps in dirty:
            if ps.frontier > ps.acked_sent and self.producers.get(ps.pid) is ps:
                if self._reply(ps.ident, "ack", ps.pid, {"epoch": ps.epoch, "upto": ps.frontier}):
                    ps.acked_sent = ps.frontier
                    self.stats.acks_out += 1
                else:
                    self._ack_dirty.add(ps)

    def _producer_lost(self, ps: _Prod, reason: str, now: float) -> None:
        """The producer is gone: tell the owners of the requests it opened, so they emit them now."""
        if self.producers.get(ps.pid) is ps:
            del self.producers[ps.pid]
        rids = [rid for rid, p in self._req_prod.items() if p is ps]
        told = 0
        for rid in rids:
            del self._req_prod[rid]
            self._open_msg.pop(rid, None)
            link = self.owner.pop(rid, None)
            if link is not None and link.alive:
                head = wire.pack_header("abort", ps.pid, ps.epoch, 0, rid, {"reason": reason})
                if self._send(link, head, (), None):
                    told += 1
        self.stats.producers_lost += 1
        self.stats.aborted_for_lost_producer += told
        (log.info if reason == "producer_closed" and not rids else log.warning)(
            "broker producer lost id=%s epoch=%d why=%s silent_s=%.1f open_requests=%d aborted=%d "
                    "unacked_from=%d", ps.pid[:64], ps.epoch, reason, now - ps.last_seen, len(rids), told,
                    ps.frontier + 1)

    # ---- routing ------------------------------------------------------------------------------------------------

    def _route(self, h: wire.Header, frames: list, tok: list, ps: _Prod) -> None:
        if h.kind == "delta":
            self._route_delta(h, frames, tok, ps)
        else:
            self._route_request(h, frames, tok, ps)

    def _assign(self, rid: str) -> _Link:
        owner = self.links[_hrw(rid.encode("utf-8", "surrogatepass"), self._live)]
        if len(self.owner) >= self.max_open_requests:
            old = next(iter(self.owner))
            del self.owner[old]
            self._open_msg.pop(old, None)
            self._req_prod.pop(old, None)
        self.owner[rid] = owner
        return owner

    def _owner_of(self, rid: str) -> _Link:
        o = self.owner.get(rid)
        if o is None:
            return self._assign(rid)
        if o.alive:
            return o
        new = self._assign(rid)
        self.stats.reassigned += 1
        msg = self._open_msg.get(rid)
        if msg is not None:
            h = msgpack.unpackb(msg[0], raw=False)
            h[6] = dict(h[6], reassigned=True)
            self._send(new, msgpack.packb(h[:7], use_bin_type=True), msg[1], None)
        return new

    def _route_request(self, h: wire.Header, frames: list, tok: list, ps: _Prod) -> None:
        rid = wire.check_request_id(h.key)
        if h.kind == "open":
            wire.parse_open(h)
        if self._hold_all:
            return self._hold(h, frames, tok, ps)
        if h.kind == "open":
            self.stats.requests_opened += 1
            owner = self._owner_of(rid)
            self._open_msg[rid] = (frames[1].bytes, frames[2:])
            self._req_prod[rid] = ps
        else:
            owner = self._owner_of(rid)
            self.owner.pop(rid, None)
            self._open_msg.pop(rid, None)
            self._req_prod.pop(rid, None)
            self.stats.requests_closed += 1
        if not self._send(owner, frames[1].buffer, frames[2:], tok):
            self._unaccept(ps, tok)

    def _route_delta(self, h: wire.Header, d_frames: list, tok: list, ps: _Prod) -> None:
        d = wire.parse_delta(h)
        payload = d_frames[2:]
        wire.check_payload(d, payload)
        self.stats.bytes_in += d.total_rows * d.row_bytes
        if self._hold_all:
            return self._hold(h, d_frames, tok, ps)
        ids = d.request_ids
        owners = list(map(self.owner.get, ids))
        uniq = set(owners)
        if None in uniq or not uniq <= self._live_set:
            owners = [self._owner_of(r) for r in ids]
            uniq = set(owners)
        if len(uniq) == 1:
            ok = self._send(owners[0], d_frames[1].buffer, payload, tok)      # payload untouched, zero-copy
        else:
            self.stats.deltas_split += 1
            ok = self._split(h, d, owners, uniq, payload, tok)
        if not ok:
            self._unaccept(ps, tok)

    def _split(self, h: wire.Header, d: wire.Delta, owners: list, uniq: set, payload: list, tok: list) -> bool:
        rb = d.row_bytes
        ids = d.request_ids
        index = {o: i for i, o in enumerate(uniq)}
        codes = np.fromiter(map(index.__getitem__, owners), dtype=np.int16, count=len(owners))
        if len(payload) == 1:
            mv = memoryview(payload[0].buffer)
        else:
            mv = memoryview(b"".join(bytes(f.buffer) for f in payload))
        counts = d.counts
        uniform = d.total_rows == len(counts) * int(counts[0]) and int(counts.min()) == int(counts[0])
        per = int(counts[0]) * rb
        if not uniform:
            offs = np.zeros(len(counts) + 1, dtype=np.int64)
            np.cumsum(counts, out=offs[1:])
            offs *= rb
        for o, c in index.items():
            idx = np.flatnonzero(codes == c)
            sub = idx.tolist()
            body = wire.delta_body(d.starts[idx], counts[idx], d.num_layers, d.top_k, d.layer_lo, d.layer_hi)
            head = wire.pack_header("delta", h.producer, h.epoch, h.seq, [ids[i] for i in sub], body)
            # contiguous runs of this owner's requests: [run_lo, run_hi) in request index space
            brk = np.flatnonzero(np.diff(idx) != 1)
            run_lo = np.concatenate(([idx[0]], idx[brk + 1]))
            run_hi = np.concatenate((idx[brk] + 1, [idx[-1] + 1]))
            if uniform:
                a_bytes, b_bytes = run_lo * per, run_hi * per
            else:
                a_bytes, b_bytes = offs[run_lo], offs[run_hi]
            total = int((b_bytes - a_bytes).sum())
            if len(run_lo) == 1:
                parts = [mv[int(a_bytes[0]):int(b_bytes[0])]]
            elif total >= wire.COPY_THRESHOLD * len(run_lo):
                parts = [mv[a:b] for a, b in zip(a_bytes.tolist(), b_bytes.tolist())]
            elif uniform and per:
                parts = [np.frombuffer(mv, dtype=np.dtype((np.void, per))).take(idx)]
            else:
                parts = [b"".join(mv[a:b] for a, b in zip(a_bytes.tolist(), b_bytes.tolist()))]
            if not self._send(o, head, parts, tok):
                return False
        return True

    def _send(self, link: _Link, head, rest, tok: list | None) -> bool:
        """Send one data message (header + payload frames) on a consumer link, numbered with the next lseq.

        False if it could not be queued (the consumer is slow or gone); the lseq is then not used.
        """
        lseq = link.lseq + 1
        head = wire.with_link(head, (self.epoch, link.gen, lseq))
        try:
            self._back.send_multipart([link.cid, head, *rest], zmq.NOBLOCK, copy=False)
        except zmq.Again:
            self.stats.dropped_slow_consumer += 1
            n = self.stats.dropped_slow_consumer
            if n == 1 or n % 1000 == 0:
                log.warning("broker consumer %s is slow (send queue full): refused=%d messages; their producers "
                            "resend them", link.name, n)
            return False
        except zmq.ZMQError as e:
            if e.errno != zmq.EHOSTUNREACH:
                raise
            self.stats.dropped_unreachable += 1
            self._link_lost(link, "unreachable")
            return False
        link.lseq = lseq
        sent = link.sent
        sent.append((lseq, tok))
        if tok is not None:
            tok[0] += 1
        self.stats.msgs_out += 1
        if len(sent) > MAX_UNACKED_PER_LINK:
            self._link_lost(link, f"not_acking_{len(sent)}_parts")
        return True

    def _unaccept(self, ps: _Prod, tok: list) -> None:
        """A message could not go everywhere it must: refuse it and what follows, until the producer rewinds."""
        tok[1] = None                              # parts already sent will not ack this seq
        if self.producers.get(ps.pid) is ps and tok[2] < ps.next:
            ps.next = tok[2]
        self._ask_rewind(ps, force=True)

    # ---- no consumer yet ----------------------------------------------------------------------------------------

    def _hold(self, h: wire.Header, frames: list, tok: list, ps: _Prod) -> None:
        n = sum(len(f.buffer) for f in frames[1:])
        if self._pending_bytes + n > self.max_pending_bytes:
            self.stats.dropped_no_consumer += 1
            c = self.stats.dropped_no_consumer
            if c == 1 or c % 1000 == 0:
                log.warning("broker has no consumer and %d bytes pending: refused=%d messages (their producers "
                            "keep them and resend)", self._pending_bytes, c)
            self._unaccept(ps, tok)
            return
        ps.held.add(tok[2])
        self._pending.append((h, frames, tok, ps, n))
        self._pending_bytes += n

    def _flush_pending(self) -> None:
        if not self._pending:
            return
        pending, self._pending = self._pending, deque()
        self._pending_bytes = 0
        log.info("broker routing %d messages held while no consumer was live", len(pending))
        while pending:
            h, frames, tok, ps, n = pending.popleft()
            ps.held.discard(tok[2])
            if tok[1] is None:
                continue                           # refused meanwhile: its producer resends it
            if self._hold_all:                     # every consumer left again while flushing
                self._pending.append((h, frames, tok, ps, n))
                self._pending_bytes += n
                ps.held.add(tok[2])
                continue
            try:
                self._route(h, frames, tok, ps)
            except wire.ProtocolError as e:
                self._bad(e, ps.ident, self._front)
                if tok[0] == 0 and tok[1] is not None:
                    self._complete(ps, tok[2])
