"""Route wire-v1 messages from producers to the consumer that owns each request id, and carry acks back: the
broker's socket loop.

Sockets: `frontend` ROUTER (producers' DEALERs connect), `backend` ROUTER (consumers' DEALERs connect and
announce themselves with hello/heartbeat). The loop reads a burst from each socket, hands every message to one
handler, and runs the timed work (acks, liveness, stats) between bursts. What it decides with lives in three
socket-free parts: `intake` (per-producer go-back-N: which seq is accepted next, the unacked parts on each
consumer link, the ack frontier), `ownership` (request id -> owner link, sticky rendezvous hashing; a small
`opens` message's requests on one owner; claimed back by their consumers after a restart) and `split` (one delta
into one per owner, zero-copy).

Delivery (wire.py "Delivery", docs/RELIABILITY.md): per producer incarnation the broker accepts data messages
in seq order only (a resend of an earlier seq is accepted, a gap is dropped and answered with a rewind request),
numbers what it sends on each consumer link (lseq, per link generation), and acks a producer's seq once every
consumer part of it was acked, as a contiguous prefix. A data message that can never be valid (its header does not
decode, or its body or payload is refused) is accepted and dropped when its seq is readable: the frontier passes it,
and the producer gets an `error` naming it (`refused_seq`), so one bad request id never stops a stream. A
consumer that stops heartbeating for `liveness` intervals, restarts (new epoch) or becomes unreachable loses its
link: the producers whose messages it had not acked are asked to rewind, and its in-flight requests are reassigned
to a live consumer on their next message (the new owner gets the request's open marked `reassigned: true` and
flags the record "consumer_lost" unless every row arrives anyway); a request whose finish was routed but not yet
acked is in flight too (Ownership keeps it as closing until its producer's frontier passes the finish). A producer silent for `producer_timeout_ms` is
lost: the owners of the requests it opened get an abort with reason "producer_lost". When no consumer is live (or,
after a restart, for a grace period while the old consumers reconnect) messages wait in a bounded queue
(max_pending_bytes).
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict, deque
from dataclasses import dataclass, fields
from typing import Any, NamedTuple

import zmq

from routing_replay.broker.config import BrokerConfig
from routing_replay.broker.intake import Admission, ConsumerLink, Hello, InFlight, Intake, ProducerIntake
from routing_replay.broker.ownership import OpenMsg, OpensEntry, Ownership
from routing_replay.broker.split import apply_plan, plan_split
from routing_replay.protocol import checks, memory, metrics, security, wire
from routing_replay.protocol.loop import (MessageTooLarge, ServiceThread, guarded, recv_frames, send_frames,
                                         start_zero_copy_collector)

log = logging.getLogger("routing_replay.broker")

DATA_KINDS = frozenset({"delta", "open", "opens", "finish", "finishes", "abort"})
MAX_CONSUMERS = 1024
MAX_UNACKED_PER_LINK = 1 << 20       # parts sent to one consumer and not acked; beyond it the link is dropped
MAX_FRONTEND_BURST = 10_000          # frontend messages handled before the loop looks at the backend again
MAX_ERROR_PEERS = 10_000             # (peer, reason) pairs remembered so each gets one `error` reply


def _nbytes(frame) -> int:
    """Bytes of one payload frame as the split hands them out (bytes, a memoryview or numpy array of any item
    size, a zmq.Frame)."""
    buf = getattr(frame, "buffer", None)            # zmq.Frame
    return memoryview(frame if buf is None else buf).nbytes


@dataclass
class BrokerStats:
    msgs_in: int = 0
    bytes_in: int = 0                 # routing row bytes of the deltas routed (each counted once)
    msgs_out: int = 0
    bytes_out: int = 0                # routing row bytes sent to consumers (each owner's share of a split delta)
    deltas_split: int = 0
    split_gathered: int = 0           # owners' shares of split deltas that had to be gathered (copied) from runs
    requests_opened: int = 0
    opens_in: int = 0                 # `opens` messages (several requests' opens in one)
    opens_grouped: int = 0            # of them, those whose new requests all went to one owner (open_group_max)
    prefix_affine: int = 0            # new requests placed on their prefix writer's consumer (prefix_refs)
    opens_unbatched: int = 0          # their entries sent as `open`s (to consumers that do not take `opens`)
    finishes_in: int = 0              # `finishes` messages (several requests' finishes in one)
    finishes_unbatched: int = 0       # their entries sent as `finish`es (to consumers that do not take `finishes`)
    requests_closed: int = 0
    reassigned: int = 0
    owner_hints_out: int = 0          # request -> owner group hints sent to producers (on their acks)
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
    notices_resent: int = 0          # the broker's own messages (refused, abort, reassigned open) sent again after
                                     # a link resync: the consumer had dropped them after its gap
    links_lost: int = 0
    producers_lost: int = 0
    aborted_for_lost_producer: int = 0
    refusals_out: int = 0            # `refused` messages to consumers: a refused delta's requests, per owner
    dropped_bad: int = 0             # data messages refused for good (bad header, body or payload): acked past,
                                     # answered with an `error` naming their seq
    claims_out: int = 0              # `claim` questions to consumers that knew an earlier broker (a restart)
    claimed: int = 0                 # requests given back to the consumer that holds them (its `holds` answers)
    claims_refused: int = 0          # held requests another live consumer owned already (or closing)


_BROKER_HELP = {
    "msgs_in": "messages received from producers", "bytes_in": "bytes received from producers",
    "msgs_out": "messages sent to consumers", "bytes_out": "bytes sent to consumers",
    "requests_opened": "requests opened", "requests_closed": "requests closed (finish acked)",
    "acks_in": "acks received from consumers", "acks_out": "acks sent to producers",
    "dropped_bad": "data messages refused for good (bad header, body or payload)",
    "dropped_no_consumer": "data messages dropped with no live consumer",
    "reassigned": "requests moved to another consumer after their owner was lost",
}


class Held(NamedTuple):
    """A data message waiting in the pending queue for a live consumer."""

    header: wire.Header
    frames: list
    tok: InFlight
    producer: ProducerIntake
    nbytes: int


class Broker(ServiceThread):
    """Own the frontend and backend sockets, and through them the consumer links, the producers' intake, the
    ownership table and the pending queue.

    Sockets are created and used only by the thread running `run()` (or `bind()` + `serve()`).
    """

    _service_name = "broker"

    def __init__(self, frontend: str | None = None, backend: str | None = None, *,
                 config: BrokerConfig | None = None, context: zmq.Context | None = None, **settings):
        """`config`, or the endpoints and keyword arguments that build one (BrokerConfig's fields); with both, the
        arguments replace the config's fields. `context`: a ZeroMQ context to share."""
        for name, value in (("frontend", frontend), ("backend", backend)):
            if value is not None:
                settings[name] = value
        self.config = cfg = checks.resolved_config(BrokerConfig, config, settings)
        self.frontend = cfg.frontend
        self.backend = cfg.backend
        self.curve_secret = cfg.curve_secret
        self.curve_allow = cfg.curve_allow
        self._own_ctx = context is None and cfg.curve_secret is not None
        self._ctx = context or (zmq.Context() if self._own_ctx else zmq.Context.instance())
        self._auth = None
        self._watches: list = []          # security.HandshakeWatch of each CURVE server socket, while serve() runs
        self.heartbeat_interval_s = cfg.heartbeat_interval_ms / 1000
        self.liveness = cfg.liveness
        self.stats_interval_s = cfg.stats_interval_s
        self.max_pending_bytes = cfg.max_pending_bytes
        self.max_open_requests = max_open_requests = cfg.max_open_requests
        self.hwm = cfg.hwm
        self.producer_timeout_s = cfg.producer_timeout_ms / 1000
        self.ack_interval_s = cfg.ack_interval_ms / 1000
        self.restart_grace_s = (2 * self.heartbeat_interval_s if cfg.restart_grace_ms is None
                                else cfg.restart_grace_ms / 1000)
        # an `opens` of at most this many requests puts them all on one consumer (the hash of its first request's
        # id): a step's new requests (a GRPO group) and their rows, finishes and records then travel whole, unsplit;
        # larger ones (a batch's start) are spread request by request. 0: every request by its own hash
        self.open_group_max = cfg.open_group_max
        self.epoch = time.time_ns() // 1000          # a new one per start: consumers and producers see restarts
        self.stats = BrokerStats()
        self.bad: dict[str, int] = defaultdict(int)
        self.links: dict[bytes, ConsumerLink] = {}    # consumer id -> its live link
        self._gen = 0                                 # link generations, broker-wide, increasing
        self._link_nums = 0                           # links made so far (each link's owner group number)
        self.intake = Intake(rewind_interval_s=max(0.5, self.heartbeat_interval_s))
        self.ownership = Ownership(max_open_requests)
        self._pending: deque[Held] = deque()          # held in arrival order
        self._pending_bytes = 0
        self._hold_all = True                         # no live consumer, or a restart's grace period
        self._restart_seen = False
        self._started = time.monotonic()
        self._now = self._started                     # the serve loop's clock, read once per burst
        self._warned: set = set()
        self._init_service(log)
        self._back = None
        self._front = None

    @property
    def producers(self) -> dict[str, ProducerIntake]:
        """Producer id -> its current incarnation."""
        return self.intake.producers

    @property
    def _live(self) -> list[bytes]:
        """Sorted ids of the live consumers."""
        return self.ownership.live_ids

    # ---- the socket loop ----------------------------------------------------------------------------------------------

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
                if self.curve_secret is not None:
                    security.curve_server(s, self.curve_secret)
            # per frame: producers send rows, consumers only headers (the whole-message bounds: recv_frames below)
            self._front.setsockopt(zmq.MAXMSGSIZE, wire.MAX_MESSAGE_BYTES)
            self._back.setsockopt(zmq.MAXMSGSIZE, wire.MAX_CONTROL_MESSAGE_BYTES)
            self._front.bind(self.frontend)
            self._back.bind(self.backend)
        except BaseException:
            self._close_sockets()
            raise
        self.frontend = self._front.getsockopt_string(zmq.LAST_ENDPOINT)
        self.backend = self._back.getsockopt_string(zmq.LAST_ENDPOINT)

    def _close_sockets(self) -> None:
        for w in self._watches:           # kept: their counts go in the last stats line
            w.close()
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
        memory.keep_freed_memory()
        start_zero_copy_collector()
        try:
            poller = zmq.Poller()
            poller.register(front, zmq.POLLIN)
            poller.register(back, zmq.POLLIN)
            if self.curve_secret is not None:
                self._watches = [security.HandshakeWatch(front, "frontend"), security.HandshakeWatch(back, "backend")]
                for w in self._watches:
                    poller.register(w.mon, zmq.POLLIN)
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
                            frames = recv_frames(back, zmq.NOBLOCK, wire.MAX_CONTROL_MESSAGE_BYTES)
                        except zmq.Again:
                            break
                        except MessageTooLarge as e:
                            self._too_large(e, back)
                            continue
                        guarded(self._on_backend, (frames, time.monotonic()), self.bad, log, "broker")
                for w in self._watches:
                    if w.mon in events:
                        w.drain()
                if front in events:
                    self._now = time.monotonic()
                    for _ in range(MAX_FRONTEND_BURST):
                        try:
                            frames = recv_frames(front, zmq.NOBLOCK, wire.MAX_DATA_MESSAGE_BYTES)
                        except zmq.Again:
                            break
                        except MessageTooLarge as e:
                            self._too_large(e, front)
                            continue
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
        log.info("broker msgs_in=%d MB_in=%.1f msgs_out=%d MB_out=%.1f split=%d split_gathered=%d owner_hints_out=%d "
                 "opens_in=%d opens_grouped=%d opens_unbatched=%d finishes_in=%d finishes_unbatched=%d "
                 "requests_opened=%d "
                 "requests_closed=%d open_requests=%d closing=%d consumers=%d "
                 "producers=%d reassigned=%d pending=%d dropped_no_consumer=%d dropped_slow=%d "
                 "dropped_unreachable=%d resent_in=%d refused_gap=%d refused_unknown=%d rewinds_asked=%d "
                 "acks_in=%d acks_out=%d unacked_parts=%d link_resyncs=%d notices_resent=%d links_lost=%d "
                 "producers_lost=%d claims_out=%d claimed=%d claims_refused=%d "
                 "aborted_for_lost_producer=%d refusals_out=%d curve_refused=%d dropped_bad=%d prefix_affine=%d "
                 "bad=%d %s", s.msgs_in, s.bytes_in / 1e6, s.msgs_out,
                 s.bytes_out / 1e6, s.deltas_split, s.split_gathered, s.owner_hints_out, s.opens_in, s.opens_grouped,
                 s.opens_unbatched,
                 s.finishes_in, s.finishes_unbatched, s.requests_opened, s.requests_closed, len(self.ownership),
                 self.ownership.closing, len(self._live), len(self.intake),
                 s.reassigned, len(self._pending), s.dropped_no_consumer, s.dropped_slow_consumer,
                 s.dropped_unreachable, s.resent_in, s.refused_gap, s.refused_unknown, s.rewinds_asked, s.acks_in,
                 s.acks_out, sum(len(k.sent) for k in self.links.values()), s.link_resyncs, s.notices_resent,
                 s.links_lost, s.producers_lost, s.claims_out, s.claimed, s.claims_refused,
                 s.aborted_for_lost_producer, s.refusals_out,
                 (self._auth.refused if self._auth is not None else 0) + sum(w.failed for w in self._watches),
                 s.dropped_bad, s.prefix_affine,
                 sum(self.bad.values()), dict(self.bad) if self.bad else "")

    def metrics(self) -> list:
        """The counters and queue depths of `log_stats` as Prometheus samples (protocol/metrics.py). Runs on the
        metrics server's thread: it reads ints and copies containers, and a container that changes size under the
        copy raises RuntimeError, which the server retries."""
        s = self.stats
        out = [metrics.counter(f"broker_{f.name}", _BROKER_HELP.get(f.name, f"broker counter {f.name}"),
                               getattr(s, f.name)) for f in fields(s)]
        out += [metrics.counter("broker_bad_messages", "messages dropped as bad, by reason", n, reason=r)
                for r, n in dict(self.bad).items()]
        out += [
            metrics.gauge("broker_open_requests", "requests with an owner", len(self.ownership)),
            metrics.gauge("broker_closing_requests", "requests whose finish is routed but not yet acked",
                          self.ownership.closing),
            metrics.gauge("broker_consumers", "live consumer links", len(self._live)),
            metrics.gauge("broker_producers", "producers known to the intake", len(self.intake)),
            metrics.gauge("broker_pending_messages", "data messages held for a live consumer", len(self._pending)),
            metrics.gauge("broker_unacked_parts", "parts sent to consumers and not yet acked",
                          sum(len(k.sent) for k in list(self.links.values()))),
        ]
        return out

    # ---- consumers ----------------------------------------------------------------------------------------------

    def _set_live(self) -> None:
        self.ownership.set_live(self.links)
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
            link = self.links.get(cid)
            kind = h.kind
            if kind in ("hello", "heartbeat"):
                self._on_consumer_hello(cid, link, h, now)
            elif kind == "ack":
                if link is None or link.epoch != h.epoch:
                    self.bad["stale_ack"] += 1
                    return
                self._on_ack(link, wire.parse_link_ack(h))
            elif kind == "holds":
                if link is None or link.epoch != h.epoch:
                    self.bad["stale_holds"] += 1
                    return
                self._on_holds(link, wire.parse_holds(h))
            elif kind == "bye":
                if link is not None and link.epoch == h.epoch:
                    self._link_lost(link, "bye")
            else:
                raise wire.ProtocolError("unexpected_kind", f"consumer sent {kind!r}")
        except wire.ProtocolError as e:
            self._bad(e, cid, self._back)

    def _on_consumer_hello(self, cid: bytes, link: ConsumerLink | None, h: wire.Header, now: float) -> None:
        seen = wire.parse_consumer_hello(h)
        new = link is None or link.epoch != h.epoch
        if new:
            if link is not None:
                self._link_lost(link, "restarted")
            if len(self.links) >= MAX_CONSUMERS:
                raise wire.ProtocolError("too_many_consumers", f"{len(self.links)} consumers, limit {MAX_CONSUMERS}")
            self._gen += 1
            self._link_nums += 1
            link = self.links[cid] = ConsumerLink(cid, h.epoch, self._gen, now, self._link_nums)
            if seen not in (0, self.epoch) and now < self._started + self.restart_grace_s:
                self._restart_seen = True          # it was with an earlier broker: this one is a restart
            self._set_live()
            log.info("broker consumer joined id=%s epoch=%d gen=%d consumers=%d restart_grace=%s", link.name,
                     h.epoch, link.gen, len(self._live), self._hold_all and bool(self._live))
        link.last_seen = now
        takes = wire.parse_takes(h)
        link.takes_opens = wire.FEATURE_OPENS in takes
        link.takes_finishes = wire.FEATURE_FINISHES in takes
        link.takes_holds = wire.FEATURE_HOLDS in takes
        if new and seen not in (0, self.epoch) and link.takes_holds:
            # it got data from an earlier broker: ask which requests it holds, so they stay with it (a restart
            # holds every message for restart_grace_s, long enough for the answer)
            try:
                self._back.send_multipart([cid, wire.pack_header("claim", "broker", self.epoch, 0, "", {})],
                                          zmq.NOBLOCK)
                self.stats.claims_out += 1
            except zmq.ZMQError:
                pass

    def _on_holds(self, link: ConsumerLink, ids: list) -> None:
        """A consumer's answer to `claim`: the requests it holds are its own again (those no other live consumer
        took meanwhile)."""
        claimed, refused = self.ownership.claim(ids, link)
        self.stats.claimed += claimed
        self.stats.claims_refused += refused
        (log.warning if refused else log.info)(
            "broker consumer %s holds=%d claimed=%d refused=%d (owned by another consumer or closing)", link.name,
            len(ids), claimed, refused)

    def _on_ack(self, link: ConsumerLink, ack: wire.LinkAck) -> None:
        self.stats.acks_in += 1
        if ack.broker_epoch != self.epoch or ack.gen != link.gen:
            return                                  # for an earlier broker or link generation
        self.intake.parts_acked(link.sent, ack.upto)
        notices = link.notices
        while notices and notices[0][0] <= ack.upto:
            notices.popleft()
        if ack.gap is not None:
            self._resync(link, ack.gap)

    def _resync(self, link: ConsumerLink, gap: int) -> None:
        """The consumer missed lseq `gap` (dropped what came after it): start a new link generation."""
        n = len(link.sent)
        affected = self.intake.forget_parts(link.sent)
        self._gen += 1
        link.gen = self._gen
        link.lseq = 0
        self.stats.link_resyncs += 1
        # the broker's own messages the consumer dropped after its gap go first in the new generation: before any
        # resent data, as each went before the data that followed it (a producer's rewind resends only its own)
        notices, link.notices = link.notices, deque()
        resent = 0
        for _, head, rest in notices:               # (stops at the first that cannot go: a slow or lost link)
            if not link.alive or not self._send(link, head, rest, None):
                break
            resent += 1
        self.stats.notices_resent += resent
        log.warning("broker link resync consumer=%s gap_at=%r unacked_parts=%d new_gen=%d producers_to_rewind=%d "
                    "notices_resent=%d notices_lost=%d", link.name, gap, n, link.gen, len(affected), resent,
                    len(notices) - resent)
        for ps in affected:
            self._ask_rewind(ps, force=True)

    def _link_lost(self, link: ConsumerLink, why: str) -> None:
        if self.links.get(link.cid) is link:
            del self.links[link.cid]
        link.alive = False
        n_parts = len(link.sent)
        affected = self.intake.forget_parts(link.sent)
        n_req = self.ownership.owned_by(link)
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
        for ps in self.intake.silent_since(now - self.producer_timeout_s):
            self._producer_lost(ps, "producer_lost", now)

    # ---- producers ----------------------------------------------------------------------------------------------

    def _too_large(self, e: MessageTooLarge, sock) -> None:
        """A message refused by its total size (recv_frames): counted and answered like any bad message."""
        self.stats.msgs_in += 1
        self._bad(wire.ProtocolError(e.reason, str(e)), e.first, sock)

    def _bad(self, e: wire.ProtocolError, peer: bytes, sock) -> None:
        self.bad[e.reason] += 1
        n = self.bad[e.reason]
        if n == 1 or n % 1000 == 0:
            log.warning("broker dropped a bad message from %r (%s, %d so far): %s", peer[:48], e.reason, n, e)
        if (peer, e.reason) not in self._warned and len(self._warned) < MAX_ERROR_PEERS:
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
        self.stats.msgs_in += 1
        ident = frames[0].bytes
        try:
            if len(frames) < 2 or len(frames) > wire.MAX_FRAMES:
                raise wire.ProtocolError("frame_count", f"message has {len(frames) - 1} frames")
            try:
                h = wire.decode_header(frames[1].buffer)
            except wire.ProtocolError as e:
                if not self._on_undecodable(ident, frames[1].buffer, e):
                    raise
                return
            kind = h.kind
            if kind in DATA_KINDS:
                self._on_data(ident, h, frames)
            elif kind in ("hello", "heartbeat"):
                self._on_producer_hello(ident, h)
            elif kind == "bye":
                ps = self.intake.current(h.producer, h.epoch, ident)
                if ps is not None:
                    self._producer_lost(ps, "producer_closed", time.monotonic())
            else:
                raise wire.ProtocolError("unexpected_kind", f"producers do not send {kind!r}")
        except wire.ProtocolError as e:
            self._bad(e, ident, self._front)

    def _on_data(self, ident: bytes, h: wire.Header, frames: list) -> None:
        ps = self.intake.current(h.producer, h.epoch, ident)
        if ps is None:
            self._refuse_unknown(ident, h.producer, h.epoch)
            return
        seq = h.seq
        if not self._admit(ps, seq):
            return
        tok = InFlight(ps, seq)
        try:
            self._route(h, frames, tok, ps)
        except wire.ProtocolError as e:
            if tok.parts or tok.refused:
                raise
            self._drop_for_good(ps, h.kind, seq, e, h.key)
        except Exception:
            if not tok.parts and not tok.refused:
                self.intake.complete(ps, seq)     # refused for good: a resend would not make it valid
            raise

    def _admit(self, ps: ProducerIntake, seq: int) -> bool:
        """Whether to route a data message of `ps` with `seq` (go-back-N); a gap is counted and a rewind asked."""
        adm = ps.admit(seq)
        if adm is not Admission.ACCEPT:
            if adm is Admission.GAP:
                self.stats.refused_gap += 1
                self._ask_rewind(ps)
                return False
            self.stats.resent_in += 1
            if adm is Admission.HELD:             # already waiting in the pending queue
                return False
        ps.last_seen = self._now                  # data counts as a sign of life (heartbeats queue behind it)
        return True

    def _on_undecodable(self, ident: bytes, frame, e: wire.ProtocolError) -> bool:
        """A header that decode_header refused: if it is a known producer's data message whose seq is readable and
        due, accept and drop it (True); False to refuse it as any bad message (nothing readable to answer for)."""
        env = wire.peek_envelope(frame)
        if (env is None or env.kind not in DATA_KINDS or env.producer is None or env.epoch is None
                or env.seq is None):
            return False
        ps = self.intake.current(env.producer, env.epoch, ident)
        if ps is None:
            return False
        if self._admit(ps, env.seq):
            self._drop_for_good(ps, env.kind, env.seq, e, env.key)
        return True

    def _drop_for_good(self, ps: ProducerIntake, kind: str, seq: int, e: wire.ProtocolError,
                       key: Any = None) -> None:
        """Accept and drop an admitted data message that can never be valid: the ack frontier passes it once all
        before it is acked (applied by nobody), and its producer hears which seq was refused and why. For a
        delta whose key list reads (`key`), the owners of the requests in it hear it too (_notify_refused)."""
        self.intake.complete(ps, seq)
        if kind == "delta":
            self._notify_refused(ps, seq, key, e.reason)
        self.bad[e.reason] += 1
        st = self.stats
        st.dropped_bad += 1
        n = st.dropped_bad
        if n <= 100 or n % 1000 == 0:
            log.warning("broker dropped bad data producer=%s epoch=%d seq=%d kind=%s reason=%s dropped_bad=%d: %s",
                        ps.pid[:64], ps.epoch, seq, kind, e.reason, n, str(e)[:200])
        self._reply(ps.ident, "error", "", wire.refusal_body(wire.Refusal(f"{e.reason}: {e}", seq, ps.epoch)))

    def _notify_refused(self, ps: ProducerIntake, seq: int, keys: Any, reason: str) -> None:
        """A `refused` message to the owner of each request of a refused delta that has one, on its link in the
        delta's place (before the request's finish): the record names the loss `broker_refused` even when the
        producer learns of it too late to put it in the finish (it sent the finish already)."""
        if not isinstance(keys, list):
            return
        owner = self.ownership.owner
        by_link: dict = {}
        for rid in keys[:wire.MAX_REQUESTS_PER_DELTA]:
            link = owner.get(rid) if type(rid) is str else None
            if link is not None and link.alive:
                by_link.setdefault(link, {})[rid] = None
        for link, rids in by_link.items():
            self.stats.refusals_out += 1
            self._send(link, wire.pack_header("refused", ps.pid, ps.epoch, seq, list(rids), {"reason": reason}), [],
                       None)

    def _refuse_unknown(self, ident: bytes, pid: str, epoch: int) -> None:
        self.stats.refused_unknown += 1
        ack = self.intake.unknown_ask(ident, epoch, time.monotonic())
        if ack is not None:
            self.stats.rewinds_asked += 1
            self._reply(ident, "ack", pid, wire.producer_ack_body(ack))

    def _on_producer_hello(self, ident: bytes, h: wire.Header) -> None:
        now = time.monotonic()
        u = wire.parse_producer_hello(h)
        old = self.intake.replaced_by(h.producer, h.epoch)
        if old is not None:
            self._producer_lost(old, "producer_restarted", now)
        ps, outcome = self.intake.hello(h.producer, h.epoch, ident, u, now)
        if outcome is Hello.JOINED:
            log.info("broker producer joined id=%s epoch=%d unacked_from=%d producers=%d", h.producer[:64],
                     h.epoch, u, len(self.intake))
        elif outcome is Hello.RECONNECTED:
            log.info("broker producer reconnected id=%s", h.producer[:64])
        self._reply(ident, "heartbeat", h.producer, {"consumers": len(self._live), "takes": wire.TAKES})

    def _ask_rewind(self, ps: ProducerIntake, force: bool = False) -> None:
        """Ask a producer to resend everything it has not had acked (once per gap, again after a while)."""
        ack = self.intake.rewind_ask(ps, time.monotonic(), force)
        if ack is not None:
            self.stats.rewinds_asked += 1
            self._reply(ps.ident, "ack", ps.pid, wire.producer_ack_body(ack))

    def _send_acks(self) -> None:
        for ps, ack in self.intake.acks_due():
            self.ownership.release(ps, ack.upto)
            if ps.hints_due:                        # owner hints ride on the ack (wire.take_owner_hints bounds them)
                ack = ack._replace(owners=wire.take_owner_hints(ps.hints_due))
            ok = self._reply(ps.ident, "ack", ps.pid, wire.producer_ack_body(ack))
            self.intake.ack_sent(ps, ack, ok)
            if ok:
                self.stats.acks_out += 1
                if ack.owners:
                    self.stats.owner_hints_out += len(ack.owners[0])
            elif ack.owners:                        # not sent: due again with the next ack
                ps.hints_due.update(zip(*ack.owners))

    def _producer_lost(self, ps: ProducerIntake, reason: str, now: float) -> None:
        """The producer is gone: tell the owners of the requests it opened, so they emit them now."""
        self.intake.remove(ps)
        dropped = self.ownership.drop_producer(ps)
        told = 0
        for rid, link in dropped:
            if link is not None and link.alive:
                head = wire.pack_header("abort", ps.pid, ps.epoch, 0, rid, {"reason": reason})
                if self._send(link, head, (), None):
                    told += 1
        self.stats.producers_lost += 1
        self.stats.aborted_for_lost_producer += told
        (log.info if reason == "producer_closed" and not dropped else log.warning)(
            "broker producer lost id=%s epoch=%d why=%s silent_s=%.1f open_requests=%d aborted=%d "
            "unacked_from=%d", ps.pid[:64], ps.epoch, reason, now - ps.last_seen, len(dropped), told,
            ps.frontier + 1)

    # ---- routing ------------------------------------------------------------------------------------------------

    def _route(self, h: wire.Header, frames: list, tok: InFlight, ps: ProducerIntake) -> None:
        if h.kind == "delta":
            self._route_delta(h, frames, tok, ps)
        elif h.kind == "opens":
            self._route_opens(h, frames, tok, ps)
        elif h.kind == "finishes":
            self._route_finishes(h, frames, tok, ps)
        else:
            self._route_request(h, frames, tok, ps)

    def _owner_of(self, rid: str, ps: ProducerIntake | None = None, prefer: ConsumerLink | None = None
                  ) -> ConsumerLink:
        o = self.ownership.owner_of(rid, prefer)
        if o.reassigned:
            self.stats.reassigned += 1
            if o.reopen is not None:
                self._send(o.link, o.reopen.reassigned_head(), o.reopen.frames, None)
        if ps is not None and ps.hint_of.get(rid) != o.link.num:
            # owner hint for the producer (its next ack): it may put each owner's requests together in its deltas
            if len(ps.hint_of) >= self.ownership.max_open_requests:
                ps.hint_of.clear()                  # (requests evicted from the table leave theirs behind)
            ps.hint_of[rid] = ps.hints_due[rid] = o.link.num
        return o.link

    def _affine(self, rid: str, refs: tuple) -> ConsumerLink | None:
        """For a request not placed yet whose open references a writer's rows: the live consumer that owns or
        owned that writer (Ownership.affine), else None."""
        if not refs or rid in self.ownership.owner:
            return None
        link = self.ownership.affine(refs[0][0])
        if link is not None:
            self.stats.prefix_affine += 1
        return link

    def _route_request(self, h: wire.Header, frames: list, tok: InFlight, ps: ProducerIntake) -> None:
        rid = wire.check_request_id(h.key)
        o = wire.parse_open(h) if h.kind == "open" else None
        if self._hold_all:
            return self._hold(h, frames, tok, ps)
        if o is not None:
            owner = self._owner_of(rid, ps, self._affine(rid, o.prefix_refs))
            self.stats.requests_opened += 1
            self.ownership.opened(rid, ps, OpenMsg(frames[1].bytes, frames[2:]))
        else:
            owner = self._owner_of(rid)
            self.ownership.close(rid, ps, tok.seq)     # kept as closing until this seq is acked
            self.stats.requests_closed += 1
            ps.hint_of.pop(rid, None)
            ps.hints_due.pop(rid, None)
        if not self._send(owner, frames[1].buffer, frames[2:], tok):
            self._unaccept(tok)

    def _route_opens(self, h: wire.Header, frames: list, tok: InFlight, ps: ProducerIntake) -> None:
        """Several requests' opens: each entry owned and kept as an `open` would be, then sent (_route_entries)."""
        o, tokens = wire.parse_opens(h, frames[2:])
        if self._hold_all:
            return self._hold(h, frames, tok, ps)
        self.stats.opens_in += 1
        ids = o.request_ids
        self.stats.requests_opened += len(ids)
        own = self.ownership
        group = None
        if 1 < len(ids) <= self.open_group_max and all(k.takes_holds for k in own.live):
            # one owner for all (each consumer can claim its requests back after a broker restart, so none depends
            # on its own hash to stay put)
            group = own.hashed(ids[0])
            self.stats.opens_grouped += 1
        opened = own.opened
        by_owner: dict = {}
        refs = o.prefix_refs
        for i, rid in enumerate(ids):
            link = self._owner_of(rid, ps, (refs is not None and self._affine(rid, refs[i])) or group)
            opened(rid, ps, OpensEntry(h, o, tokens, i))
            by_owner.setdefault(link, []).append(i)
        self._route_entries(h, frames, tok, by_owner, o, tokens, "takes_opens", "opens_unbatched")

    def _route_entries(self, h: wire.Header, frames: list, tok: InFlight, by_owner: dict, batch, tokens,
                       takes: str, unbatched: str) -> None:
        """An `opens` or `finishes` (`batch`: wire.Opens or wire.Finishes) whose entries `by_owner` groups by owner
        link: the message as received when one owner has them all and takes the kind (`takes`: the link's flag),
        else each owner's entries (_send_entries); refused until the producer rewinds if any part could not be
        queued."""
        only = next(iter(by_owner)) if len(by_owner) == 1 else None
        if only is not None and getattr(only, takes):
            ok = self._send(only, frames[1].buffer, frames[2:], tok)
        else:
            ok = all(self._send_entries(link, getattr(link, takes), h, batch, tokens, idx, tok, unbatched)
                     for link, idx in by_owner.items())
        if not ok:
            self._unaccept(tok)

    def _send_entries(self, link: ConsumerLink, takes: bool, h: wire.Header, batch, tokens, idx: list,
                      tok: InFlight, unbatched: str) -> bool:
        """Entries `idx` of an opens or finishes (`batch`: wire.Opens or wire.Finishes) to `link`: one message of
        the kind if it `takes` it, else one `open` or `finish` each (counted in stats.<unbatched>)."""
        if takes:
            head, *rest = batch.subset(h, tokens, idx)
            return self._send(link, head, rest, tok)
        setattr(self.stats, unbatched, getattr(self.stats, unbatched) + len(idx))
        for i in idx:
            head, rest = batch.single(h, tokens, i)
            if not self._send(link, head, rest, tok):
                return False
        return True

    def _route_finishes(self, h: wire.Header, frames: list, tok: InFlight, ps: ProducerIntake) -> None:
        """Several requests' finishes: each entry closes its request as a `finish` would, then sent
        (_route_entries)."""
        f, tokens = wire.parse_finishes(h, frames[2:])
        if self._hold_all:
            return self._hold(h, frames, tok, ps)
        self.stats.finishes_in += 1
        self.stats.requests_closed += len(f.request_ids)
        close, hint_of, hints_due = self.ownership.close, ps.hint_of, ps.hints_due
        by_owner: dict = {}
        for i, rid in enumerate(f.request_ids):
            link = self._owner_of(rid)
            close(rid, ps, tok.seq)                 # kept as closing until this seq is acked
            hint_of.pop(rid, None)
            hints_due.pop(rid, None)
            by_owner.setdefault(link, []).append(i)
        self._route_entries(h, frames, tok, by_owner, f, tokens, "takes_finishes", "finishes_unbatched")

    def _route_delta(self, h: wire.Header, frames: list, tok: InFlight, ps: ProducerIntake) -> None:
        d = wire.parse_delta(h)
        payload = frames[2:]
        wire.check_payload(d, payload)
        if self._hold_all:      # counted when routed: once, whether it waits here or its producer resends it
            return self._hold(h, frames, tok, ps)
        self.stats.bytes_in += d.total_rows * d.row_bytes
        # the split plan of this producer's last delta holds while the key list, the counts and the ownership
        # table are the same (decode steps): then no per-request work at all
        own = self.ownership
        counts_raw = h.body["count"]
        plan = ps.plan
        if (plan is None or plan.version != own.version or plan.counts != counts_raw or plan.ids != d.request_ids
                or plan.row_bytes != d.row_bytes):
            owners = own.lookup(d.request_ids)
            if owners is None:
                links = [self._owner_of(r, ps) for r in d.request_ids]
                owners = (links, set(links))
            plan = ps.plan = plan_split(d, counts_raw, owners[0], owners[1], own.version)
        if len(plan.parts) == 1:
            ok = self._send(plan.parts[0].owner, frames[1].buffer, payload, tok)      # payload untouched, zero-copy
            if ok:
                self.stats.bytes_out += d.total_rows * d.row_bytes
        else:
            self.stats.deltas_split += 1
            self.stats.split_gathered += plan.gathered
            ok = True
            for p in apply_plan(h, d, plan, payload):
                if not self._send(p.owner, p.head, p.frames, tok):
                    ok = False
                    break
                self.stats.bytes_out += sum(map(_nbytes, p.frames))     # the owner's rows
        if not ok:
            self._unaccept(tok)

    def _send(self, link: ConsumerLink, head, rest, tok: InFlight | None) -> bool:
        """Send one data message (header + payload frames) on a consumer link, numbered with the next lseq. With
        `tok` None it is the broker's own (no producer resends it): kept in link.notices until acked.

        False if it could not be queued (the consumer is slow or gone); the lseq is then not used.
        """
        lseq = link.lseq + 1
        head_in = head
        head = wire.with_link(head, (self.epoch, link.gen, lseq))
        try:
            send_frames(self._back, [link.cid, head, *rest], zmq.NOBLOCK)
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
            tok.parts += 1
        else:
            link.notices.append((lseq, head_in, rest))
        self.stats.msgs_out += 1
        if len(sent) > MAX_UNACKED_PER_LINK:
            self._link_lost(link, f"not_acking_{len(sent)}_parts")
        return True

    def _unaccept(self, tok: InFlight) -> None:
        """A message could not go everywhere it must: refuse it and what follows, until the producer rewinds."""
        ps = self.intake.refuse(tok)              # parts already sent will not ack its seq
        if ps is not None:
            self._ask_rewind(ps, force=True)

    # ---- no consumer yet ----------------------------------------------------------------------------------------

    def _hold(self, h: wire.Header, frames: list, tok: InFlight, ps: ProducerIntake) -> None:
        n = sum(len(f.buffer) for f in frames[1:])
        if self._pending_bytes + n > self.max_pending_bytes:
            self.stats.dropped_no_consumer += 1
            c = self.stats.dropped_no_consumer
            if c == 1 or c % 1000 == 0:
                log.warning("broker has no consumer and %d bytes pending: refused=%d messages (their producers "
                            "keep them and resend)", self._pending_bytes, c)
            self._unaccept(tok)
            return
        ps.held.add(tok.seq)
        self._pending.append(Held(h, frames, tok, ps, n))
        self._pending_bytes += n

    def _flush_pending(self) -> None:
        if not self._pending:
            return
        pending, self._pending = self._pending, deque()
        self._pending_bytes = 0
        log.info("broker routing %d messages held while no consumer was live", len(pending))
        while pending:
            held = pending.popleft()
            h, frames, tok, ps, n = held
            ps.held.discard(tok.seq)
            if tok.refused:
                continue                           # refused meanwhile: its producer resends it
            if self._hold_all:                     # every consumer left again while flushing
                self._pending.append(held)
                self._pending_bytes += n
                ps.held.add(tok.seq)
                continue
            try:
                self._route(h, frames, tok, ps)
            except wire.ProtocolError as e:
                self._bad(e, ps.ident, self._front)
                if not tok.parts and not tok.refused:
                    self.intake.complete(ps, tok.seq)
