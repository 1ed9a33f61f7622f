"""Run a consumer: receive routed messages from a broker, accumulate, and hand finished records to the sinks.

Sinks: an npz directory (NpzWriter), a callback, and the trainer endpoint (`serve`): a ROUTER socket whose
messages TrainerService answers (`fetch`, lossless: records are kept in a RecordStore until fetched, then
retained for a while; `subscribe`: live records whose request id starts with a prefix).

Delivery: every data message from the broker carries a link number (wire.py "Delivery"). `LinkIn` applies only
the next one, drops everything after a gap and asks the broker for a resync; the consumer acks the highest
applied link number every `ack_interval_ms` (one ack per interval, whatever the message rate). A data message
that cannot be read at all is still taken as its link number if it is the next one (wire.peek_envelope): it is
counted as bad, the held requests it names are marked incomplete ("undecodable"), and the link goes on.
"""

from __future__ import annotations

import enum
import logging
import time
from collections import defaultdict
from dataclasses import dataclass, fields
from typing import Callable, NamedTuple

import zmq

from routing_replay.consumer.accumulator import Accumulator, EntriesRefused
from routing_replay.consumer.config import ConsumerConfig
from routing_replay.consumer.keys import RecordKeys
from routing_replay.consumer.npz import NpzWriter, Progress
from routing_replay.consumer.prefix_pool import CompactRecord
from routing_replay.consumer.store import RecordStore
from routing_replay.consumer.trainer_service import FetchedRecords, Sent, TrainerService
from routing_replay.protocol import checks, memory, metrics, security, wire
from routing_replay.protocol.loop import (MessageTooLarge, ServiceThread, guarded, recv_frames, send_frames,
                                         start_zero_copy_collector)
from routing_replay.protocol.ids import default_peer_id

log = logging.getLogger("routing_replay.consumer")

DATA_KINDS = frozenset({"open", "opens", "delta", "finish", "finishes", "abort", "refused"})
TRAINER_SNDHWM = 8             # records queued to one trainer connection; beyond it they stay in the store
BURST_MAX_MSGS = 1000          # broker messages read in one go before acks and timers get their turn
TICK_INTERVAL_S = 0.1          # grace periods, timeouts, fetch waiters, write backlog
MAX_DAMAGED_IDS = 1 << 16      # request ids of one undecodable message looked up to be marked


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

    def ack(self, now: float, gap_retry_s: float) -> wire.LinkAck | None:
        """The ack to send now, or None. A gap is reported at once and again every gap_retry_s until resolved."""
        if self.gen < 0:
            return None
        gap = self.gap is not None and now - self.gap_sent_at >= gap_retry_s
        if self.upto == self.acked and not gap:
            return None
        self.acked = self.upto
        if gap:
            self.gap_sent_at = now
        return wire.LinkAck(self.bepoch, self.gen, self.upto, self.gap if gap else None)


class Intake(enum.Enum):
    """Whether the consumer takes messages from the broker."""

    OPEN = "open"
    PAUSED = "paused"          # records it could not write fill the memory bound: nothing more is taken or acked


class Sockets(NamedTuple):
    """What run() opens and closes: the broker DEALER, the trainers' ROUTER (or None), the CURVE authenticator."""

    dealer: zmq.Socket
    server: zmq.Socket | None
    auth: object | None


@dataclass
class Timers:
    """When each periodic job of the loop is due next (time.monotonic())."""

    ack: float
    tick: float
    heartbeat: float
    stats: float


class RecordCounts:
    """Own the counts of emitted records by outcome (the metrics endpoint reads them)."""

    def __init__(self):
        self.complete = 0
        self.incomplete: dict[str, int] = defaultdict(int)    # by the record's reason
        self.rows = 0
        self.prefix_rows = 0          # prompt rows the engine's prefix cache served (num_cached_tokens)
        self.prefix_filled = 0        # of them, filled from the engine's prefix store
        self.missing_rows = 0

    def count(self, rec: wire.Record) -> None:
        if rec.complete:
            self.complete += 1
        else:
            self.incomplete[rec.reason or "unknown"] += 1
        P = rec.prompt_len if type(rec) is CompactRecord else rec.prompt_routed_experts.shape[0]
        self.rows += P + rec.routed_experts.shape[0]
        self.prefix_rows += rec.num_cached_tokens
        self.prefix_filled += rec.num_prefix_filled
        self.missing_rows += sum(hi - lo for lo, hi in rec.missing)


class Consumer(ServiceThread):
    """Own a consumer's sockets (DEALER to the broker, optional ROUTER for trainers), its accumulator and sinks.

    All sockets are created and used by the thread that calls `run()` (or the one `start()` makes).
    Records (`on_record`, npz, trainers) carry the rows in the dtype their producer sent (Record.id_dtype: uint8 or
    uint16 from a producer told its model's expert count, else int16); `rec.widened()` gives the int16 record.
    """

    # the optional data kinds it tells the broker it takes (wire.CONSUMER_TAKES); without "opens" ("finishes") the
    # broker sends it the entries of an opens (finishes) as open (finish) messages (what a consumer of an earlier
    # version gets); without "holds" it is never asked `claim`, and no `opens` is grouped onto one consumer
    takes: list = wire.CONSUMER_TAKES

    def __init__(self, connect: str | None = None, *, config: ConsumerConfig | None = None,
                 context: zmq.Context | None = None, on_record: Callable[[wire.Record], None] | None = None,
                 **settings):
        """`config`, or the broker address and keyword arguments that build one (ConsumerConfig's fields); with
        both, the arguments replace the config's fields. `context`: a ZeroMQ context to share; `on_record`: called
        with each finished record, in the consumer's thread."""
        if connect is not None:
            settings["connect"] = connect
        self.config = cfg = checks.resolved_config(ConsumerConfig, config, settings)
        self.connect = connect = cfg.connect
        self.consumer_id = cfg.consumer_id or default_peer_id("consumer")
        self.serve = serve = cfg.serve
        self.curve_secret, self.broker_key, self.curve_allow = cfg.curve_secret, cfg.broker_key, cfg.curve_allow
        self._own_ctx = context is None and cfg.curve_allow is not None
        self._ctx = context or (zmq.Context() if self._own_ctx else zmq.Context.instance())
        self.epoch = time.time_ns() // 1000       # this incarnation: the broker forgets what the last one held
        # adopt_min_bytes (Accumulator): a prefill message's rows stay in the received frames, records are views
        # of them. Never over inproc: a frame there can be the sender's own memory (a zero-copy send), which a
        # record must not alias.
        adopt_min_bytes = None if connect.startswith("inproc://") else cfg.adopt_min_bytes
        self.acc = Accumulator(finish_grace_s=cfg.finish_grace_s, request_timeout_s=cfg.request_timeout_s,
                               max_bytes=cfg.max_bytes, remember_finished=cfg.remember_finished,
                               keep_bytes=cfg.keep_bytes, adopt_min_bytes=adopt_min_bytes,
                               prefix_pool_bytes=cfg.prefix_pool_bytes)
        npz_dir, store_max_bytes, spill_dir = cfg.npz_dir, cfg.store_max_bytes, cfg.spill_dir
        self.writer = NpzWriter(npz_dir, cfg.shard_size, hold_max_bytes=store_max_bytes, spill_dir=spill_dir,
                                retry_max_s=cfg.write_retry_max_s) if npz_dir else None
        self.store = RecordStore(store_max_bytes, spill_dir, pool=self.acc.pool) if serve else None
        self.keys = RecordKeys(self.acc.requests.__contains__,
                               self.writer.index.read if self.writer is not None else None, cfg.remember_finished)
        self.trainers = TrainerService(
            self.consumer_id, self.store, self._send_trainer, is_open=self.acc.requests.__contains__,
            disk=self.writer.index if self.writer is not None else None,
            disk_pending=self.writer.pending if self.writer is not None else (lambda rid: False),
            fetched=FetchedRecords(cfg.fetched_retention_s, cfg.fetched_retention_bytes),
            bad=self._count_bad) if serve else None
        self.on_record = on_record
        self.progress = Progress() if cfg.progress else None
        self.heartbeat_interval_s = cfg.heartbeat_interval_ms / 1000
        self.stats_interval_s = cfg.stats_interval_s
        self.rcvhwm = cfg.rcvhwm
        self.ack_interval_s = cfg.ack_interval_ms / 1000
        self.link = LinkIn()
        self.intake = Intake.OPEN
        self.acks_sent = 0
        self.bad: dict[str, int] = defaultdict(int)
        self.records_out = 0
        self.out = RecordCounts()
        self.msgs_in = 0
        self.skipped_undecodable = 0              # link messages taken without being read (see module docstring)
        self._server: zmq.Socket | None = None
        self._auth = None                         # the trainers' CURVE authenticator, while run() serves
        self._watch = None                        # its handshake failures before the allow-list (HandshakeWatch)
        self._dealer: zmq.Socket | None = None    # to the broker (run's thread only): `holds` answers go on it
        self._service_name = f"consumer-{self.consumer_id}"
        self._init_service(log)
        self._seq = 0

    @property
    def subscriber_drops(self) -> int:
        return self.trainers.subscriber_drops if self.trainers is not None else 0

    # ---- lifecycle ----------------------------------------------------------------------------------------------

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the loop, write what is queued to disk, close sockets. Idempotent."""
        self._join(timeout_s)
        if self.writer is not None:
            self.writer.close()

    # ---- loop ---------------------------------------------------------------------------------------------------

    def run(self) -> None:
        """Serve until stop() (or SIGINT in the CLI). Owns and closes its sockets."""
        memory.keep_freed_memory()
        start_zero_copy_collector()
        socks = self._open_sockets()
        watch = None
        try:
            poll_all, poll_trainers = zmq.Poller(), zmq.Poller()
            poll_all.register(socks.dealer, zmq.POLLIN)
            if socks.server is not None:
                poll_all.register(socks.server, zmq.POLLIN)
                poll_trainers.register(socks.server, zmq.POLLIN)
                if self.curve_secret is not None:
                    watch = self._watch = security.HandshakeWatch(socks.server, "trainer endpoint")
                    poll_all.register(watch.mon, zmq.POLLIN)
                    poll_trainers.register(watch.mon, zmq.POLLIN)
            self._send_ctl(socks.dealer, "hello")
            self.ready.set()
            log.info("consumer %s connected to %s serve=%s npz_dir=%s epoch=%d curve=%s", self.consumer_id,
                     self.connect, self.serve, self.writer.dir if self.writer else None, self.epoch,
                     "on" if self.curve_secret else "off")
            now = time.monotonic()
            timers = Timers(ack=now + self.ack_interval_s, tick=now + TICK_INTERVAL_S,
                            heartbeat=now + self.heartbeat_interval_s, stats=now + self.stats_interval_s)
            while not self._stop.is_set():
                poller = poll_all if self.intake is Intake.OPEN else poll_trainers
                events = dict(poller.poll(self._wait_ms()))
                if socks.dealer in events:
                    self._read_broker(socks.dealer, timers.ack)
                if socks.server is not None and socks.server in events:
                    self._read_trainers(socks.server)
                if watch is not None and watch.mon in events:
                    watch.drain()
                self._run_timers(socks.dealer, timers, time.monotonic())
            self._say_goodbye(socks.dealer)
        except zmq.ContextTerminated:
            pass
        finally:
            self.ready.set()
            if watch is not None:
                watch.close()
            self._close_sockets(socks)
            self._log_stats()

    def _open_sockets(self) -> Sockets:
        auth = None
        if self.serve and self.curve_allow is not None:
            auth = security.start_authenticator(self._ctx, self.curve_allow)
            self._auth = auth
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.ROUTING_ID, self.consumer_id.encode())
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.RCVHWM, self.rcvhwm)
        dealer.setsockopt(zmq.MAXMSGSIZE, wire.MAX_MESSAGE_BYTES)
        socks = Sockets(dealer, None, auth)
        self._dealer = dealer
        try:
            if self.curve_secret is not None:
                security.curve_client(dealer, self.curve_secret, self.broker_key)
            dealer.connect(self.connect)
            if self.serve:
                server = self._ctx.socket(zmq.ROUTER)
                socks = Sockets(dealer, server, auth)
                server.setsockopt(zmq.LINGER, 0)
                server.setsockopt(zmq.ROUTER_MANDATORY, 1)
                server.setsockopt(zmq.SNDHWM, TRAINER_SNDHWM)
                server.setsockopt(zmq.MAXMSGSIZE, wire.MAX_HEADER_BYTES)
                if self.curve_secret is not None:
                    security.curve_server(server, self.curve_secret)
                server.bind(self.serve)
                self.serve = server.getsockopt_string(zmq.LAST_ENDPOINT)
                self._server = server
        except BaseException:
            self._close_sockets(socks)
            raise
        return socks

    def _close_sockets(self, socks: Sockets) -> None:
        self._dealer = None
        socks.dealer.close(0)
        if socks.server is not None:
            socks.server.close(0)
        self._server = None
        if socks.auth is not None:
            socks.auth.stop()
        if self._own_ctx:
            self._ctx.term()

    def _wait_ms(self) -> int:
        """How long the next poll may wait: until the next ack is due if one is owed, a trainer retry, or 100 ms."""
        wait_ms = 100 if self.link.upto == self.link.acked else max(1, int(self.ack_interval_s * 1000))
        if self.trainers is not None and (self.trainers.outbox or self.trainers.live_backlog):
            try:
                wait_ms = min(wait_ms, max(1, int(self.trainers.retry(time.monotonic()) * 1000)))
            except Exception as e:  # noqa: BLE001 -- a bug here must not stop the consumer: its records are in it
                self.bad["internal_error"] += 1
                log.exception("consumer %s: trainer retry failed (internal_error=%d); outboxes dropped, trainers "
                              "ask again: %s", self.consumer_id, self.bad["internal_error"], e)
                self.trainers.outbox.clear()
                self.trainers.slices.clear()
                self.trainers.backoff.clear()
                self.trainers.live_backlog.clear()
        return wait_ms

    def _read_broker(self, dealer: zmq.Socket, ack_due: float) -> None:
        """A burst bounded in count and in time: acks (the producers' replay buffers wait on them) and timers get
        their turn at least every ack interval, however large the messages."""
        now = time.monotonic()
        for _ in range(BURST_MAX_MSGS):
            try:
                frames = recv_frames(dealer, zmq.NOBLOCK, wire.MAX_DATA_MESSAGE_BYTES)
            except zmq.Again:
                break
            except MessageTooLarge as e:      # its link number is never applied: the broker's resync resends
                self._count_bad(e.reason, e)
                continue
            guarded(self._on_broker_message, (frames, now), self.bad, log, self.consumer_id)
            now = time.monotonic()
            if now >= ack_due:
                break

    def _read_trainers(self, server: zmq.Socket) -> None:
        now = time.monotonic()
        while True:
            try:
                frames = recv_frames(server, zmq.NOBLOCK, wire.MAX_CONTROL_MESSAGE_BYTES)
            except zmq.Again:
                break
            except MessageTooLarge as e:
                self._count_bad(e.reason, e)
                continue
            guarded(self.trainers.on_message, (frames[0].bytes, frames[1:], now), self.bad, log,
                    self.consumer_id)

    def _run_timers(self, dealer: zmq.Socket, timers: Timers, now: float) -> None:
        if now >= timers.ack:
            ack = self.link.ack(now, max(0.2, self.heartbeat_interval_s / 2))
            if ack is not None:
                self._send_ctl(dealer, "ack", wire.link_ack_body(ack))
                self.acks_sent += 1
            timers.ack = now + self.ack_interval_s
        if now >= timers.tick:
            for rec in self.acc.poll(now):
                self._emit(rec)
            if self.trainers is not None:
                self.trainers.tick(now)
            self._update_intake()
            timers.tick = now + TICK_INTERVAL_S
        if now >= timers.heartbeat:
            self._send_ctl(dealer, "heartbeat", {"broker": self.link.bepoch, "takes": self.takes})
            timers.heartbeat = now + self.heartbeat_interval_s
        if self.progress is not None and self.writer is not None:
            self.progress.maybe(self.writer.records, self.writer.rows, self.writer.bytes, self.acc.in_flight)
        if now >= timers.stats:
            self._log_stats()
            timers.stats = now + self.stats_interval_s

    def _update_intake(self) -> None:
        """Pause taking broker messages while unwritable records fill the writer's memory bound; resume after."""
        backlogged = self.writer is not None and self.writer.backlogged
        if backlogged and self.intake is Intake.OPEN:
            self.intake = Intake.PAUSED
            log.error("consumer %s intake paused: %d records could not be written to %s (write_failed=%d); "
                      "nothing more is taken from the broker or acknowledged until they are", self.consumer_id,
                      self.writer.retry_pending, self.writer.dir, self.writer.write_failed)
        elif not backlogged and self.intake is Intake.PAUSED:
            self.intake = Intake.OPEN
            log.info("consumer %s intake resumed: write_retry_pending=%d", self.consumer_id,
                     self.writer.retry_pending)

    def _say_goodbye(self, dealer: zmq.Socket) -> None:
        try:
            ack = self.link.ack(time.monotonic(), 0)
            if ack is not None:
                self._send_ctl(dealer, "ack", wire.link_ack_body(ack))
            self._send_ctl(dealer, "bye")
        except zmq.ZMQError:
            pass

    def _send_ctl(self, sock: zmq.Socket, kind: str, body: dict | None = None, key=None) -> bool:
        """One control message to the broker (key: this consumer's id unless given); False if it could not go."""
        self._seq += 1
        if body is None:
            body = {"broker": self.link.bepoch, "takes": self.takes} if kind == "hello" else {}
        try:
            sock.send_multipart([wire.pack_header(kind, self.consumer_id, self.epoch, self._seq,
                                                  self.consumer_id if key is None else key, body)], zmq.NOBLOCK)
            return True
        except zmq.Again:          # not connected yet, or the broker is not reading: the next tick sends again
            return False

    def _send_trainer(self, client: bytes, frames: list) -> Sent:
        try:
            send_frames(self._server, [client, *frames], zmq.NOBLOCK)
            return Sent.SENT
        except zmq.Again:
            return Sent.FULL
        except zmq.ZMQError as e:  # EHOSTUNREACH: the client went away
            log.info("consumer %s: client %r unreachable (%s)", self.consumer_id, client[:32], e)
            return Sent.GONE

    def _log_stats(self) -> None:
        s = self.acc.stats
        st, tr, w = self.store, self.trainers, self.writer
        log.info("consumer %s records=%d complete=%d incomplete=%d aborted=%d timed_out=%d in_flight=%d "
                 "delta_msgs=%d rows=%d adopted=%d adopted_records=%d materialized=%d MB=%.1f held_MB=%.1f "
                 "kept_MB=%.1f peak_MB=%.1f late=%d replayed_opens=%d "
                 "refused=%d link=%d/%d/%d acks=%d link_dropped=%d bad=%d %s store=%s store_MB=%.1f spilled=%d evicted=%d "
                 "subscriber_drops=%d waiters=%d outbox=%d written=%d write_failed=%d write_retry_pending=%d "
                 "intake=%s undecodable_skipped=%d fetched_retained=%d fetched_MB=%.1f unknown_answers=%d "
                 "disk_reads=%d renamed=%d unreadable=%d curve_refused=%d prefix_ref_rows=%d prefix_live_rows=%d "
                 "prefix_unresolved=%d prefix_unresolved_rows=%d pool=%d pool_MB=%.1f pool_evicted=%d "
                 "compact_records=%d", self.consumer_id, s.finished, s.complete,
                 s.incomplete,
                 s.aborted, s.timed_out, self.acc.in_flight, s.delta_msgs, s.rows, s.adopted, s.adopted_records,
                 s.materialized, s.bytes / 1e6,
                 self.acc.bytes_held / 1e6, self.acc.kept_bytes / 1e6, self.acc.peak_bytes / 1e6, s.late_msgs,
                 s.replayed_opens, s.refused_msgs, self.link.bepoch % 1000,
                 self.link.gen, self.link.upto, self.acks_sent, self.link.dropped, sum(self.bad.values()),
                 dict(self.bad) if self.bad else "", len(st) if st is not None else "-",
                 st.bytes / 1e6 if st is not None else 0.0, st.spilled if st is not None else 0,
                 st.evicted if st is not None else 0, self.subscriber_drops,
                 len(tr.waiters) if tr is not None else 0, tr.queued if tr is not None else 0,
                 w.records if w is not None else 0, w.write_failed if w is not None else 0,
                 w.retry_pending if w is not None else 0, self.intake.value, self.skipped_undecodable,
                 len(tr.fetched) if tr is not None else 0, tr.fetched.bytes / 1e6 if tr is not None else 0.0,
                 tr.unknown_answers if tr is not None else 0, tr.disk_reads if tr is not None else 0,
                 self.keys.renamed, tr.unreadable if tr is not None else 0, self._curve_refused(), s.prefix_ref_rows,
                 s.prefix_live_rows, s.prefix_unresolved, s.prefix_unresolved_rows, len(self.acc.pool),
                 self.acc.pool.bytes / 1e6, self.acc.pool.evicted, self.acc.pool.compacted)

    def _curve_refused(self) -> int:
        """Trainer handshakes refused: by the allow-list, and before it (another server key, no CURVE)."""
        return ((self._auth.refused if self._auth is not None else 0)
                + (self._watch.failed if self._watch is not None else 0))

    def metrics(self) -> list:
        """The counters and queue depths of `_log_stats` as Prometheus samples (protocol/metrics.py). Runs on the
        metrics server's thread: it reads ints and copies containers (a change of size under the copy raises
        RuntimeError, which the server retries)."""
        s, st, tr, w, o = self.acc.stats, self.store, self.trainers, self.writer, self.out
        out = [metrics.counter(f"consumer_{f.name}", f"accumulator counter {f.name}", getattr(s, f.name))
               for f in fields(s)]
        out += [
            metrics.counter("consumer_records", "records emitted", o.complete, state="complete"),
            *[metrics.counter("consumer_records", "records emitted", n, state="incomplete", reason=r)
              for r, n in dict(o.incomplete).items()],
            metrics.counter("consumer_record_rows", "rows (tokens) in emitted records", o.rows),
            metrics.counter("consumer_prefix_rows", "prompt rows served from the engine's prefix cache",
                            o.prefix_rows - o.prefix_filled, mode="sentinel"),
            metrics.counter("consumer_prefix_rows", "prompt rows served from the engine's prefix cache",
                            o.prefix_filled, mode="fill"),
            metrics.counter("consumer_missing_rows", "rows never delivered (-1 in the record and in `missing`)",
                            o.missing_rows),
            metrics.counter("consumer_msgs_in", "messages received from the broker", self.msgs_in),
            metrics.counter("consumer_acks_sent", "acks sent to the broker", self.acks_sent),
            metrics.counter("consumer_curve_refused", "trainer CURVE handshakes refused", self._curve_refused()),
            metrics.counter("consumer_records_renamed", "records stored as key#n: their request id was taken",
                            self.keys.renamed),
            *[metrics.counter("consumer_bad_messages", "messages dropped as bad, by reason", n, reason=r)
              for r, n in dict(self.bad).items()],
            metrics.gauge("consumer_in_flight_requests", "requests open in the accumulator", self.acc.in_flight),
            metrics.gauge("consumer_held_bytes", "bytes of rows held for open requests", self.acc.bytes_held),
            metrics.gauge("consumer_prefix_pool_bytes", "bytes the prefix pool keeps", self.acc.pool.bytes),
            metrics.counter("consumer_prefix_pool_evicted", "prefix pool entries evicted", self.acc.pool.evicted),
        ]
        if st is not None:
            out += [metrics.gauge("consumer_store_records", "records waiting for a trainer", len(st)),
                    metrics.gauge("consumer_store_bytes", "bytes of records waiting for a trainer", st.bytes),
                    metrics.counter("consumer_store_spilled", "records spilled to disk", st.spilled),
                    metrics.counter("consumer_store_evicted", "records evicted unfetched", st.evicted)]
        if tr is not None:
            out += [metrics.gauge("consumer_trainer_waiters", "trainer fetches waiting", len(tr.waiters)),
                    metrics.gauge("consumer_trainer_outbox", "replies queued for trainers", tr.queued),
                    metrics.counter("consumer_subscriber_drops", "records a subscriber missed", self.subscriber_drops),
                    metrics.counter("consumer_unreadable_records", "fetches of records whose file was unreadable",
                                    tr.unreadable)]
        if w is not None:
            out += [metrics.counter("consumer_npz_records_written", "records written to npz", w.records),
                    metrics.counter("consumer_npz_write_failed", "npz writes that failed", w.write_failed),
                    metrics.gauge("consumer_npz_retry_pending", "records waiting for a write retry", w.retry_pending)]
        return out

    def _count_bad(self, reason: str, err: Exception) -> None:
        self.bad[reason] += 1
        n = self.bad[reason]
        if n == 1 or n % 1000 == 0:
            log.warning("consumer %s dropped a bad message (%s, %d so far): %s", self.consumer_id, reason, n, err)

    # ---- broker messages ----------------------------------------------------------------------------------------

    def _on_broker_message(self, frames: list, now: float) -> None:
        self.msgs_in += 1
        h = None
        taken = False             # the message's link number was applied
        try:
            if len(frames) > wire.MAX_FRAMES:
                raise wire.ProtocolError("frame_count", f"{len(frames)} frames")
            h = wire.decode_header(frames[0].buffer)
            if h.kind not in DATA_KINDS:
                if h.kind == "error":
                    log.error("consumer %s: broker says: %s", self.consumer_id, wire.parse_error(h))
                elif h.kind == "claim":
                    self._send_holds(h.epoch)
                return
            if h.link is None:
                raise wire.ProtocolError("no_link", f"{h.kind} from the broker without a link number")
            if not self.link.accept(h.link):
                return
            taken = True
            recs = self.acc.apply(h, frames[1:], now)
        except EntriesRefused as e:       # entries of an opens or finishes: each counted as the message it stands for
            for rid, err in e.failed:
                self._count_bad(err.reason, err)
            self._mark_damaged(e.request_ids, e.reason, h.link)
            recs = e.records
        except wire.ProtocolError as e:
            self._count_bad(e.reason, e)
            if taken:
                self._mark_damaged(h.key, e.reason, h.link)
            elif h is None:
                self._skip_undecodable(frames[0], e)
            return
        for rec in recs:
            self._emit(rec)

    def _send_holds(self, broker_epoch: int) -> None:
        """A restarted broker asks (`claim`) which requests this consumer holds: their ids, in `holds` messages of
        at most wire.MAX_HOLDS_IDS, so it gives them back to this consumer before it places any request."""
        ids = list(self.acc.requests)
        n = wire.MAX_HOLDS_IDS
        sent = 0
        for i in range(0, max(len(ids), 1), n):
            chunk = ids[i:i + n]
            if not self._send_ctl(self._dealer, "holds", {}, chunk):
                break
            sent += len(chunk)
        log.info("consumer %s told broker epoch=%d the requests it holds: holds=%d sent=%d", self.consumer_id,
                 broker_epoch, len(ids), sent)

    def _skip_undecodable(self, frame, err: wire.ProtocolError) -> None:
        """A data message whose header cannot be decoded: if its link number (read leniently) is the next one,
        take it, so that one bad message never leaves a gap that no resync can fill (the broker would resend it)."""
        env = wire.peek_envelope(frame.buffer if hasattr(frame, "buffer") else frame)
        if env is None or env.link is None or not self.link.accept(env.link):
            return
        self.skipped_undecodable += 1
        self._mark_damaged(env.key, err.reason, env.link)

    def _mark_damaged(self, key, reason: str, link: tuple) -> None:
        ids = key if isinstance(key, list) else [key]
        marked = [rid for rid in ids[:MAX_DAMAGED_IDS] if self.acc.mark_damaged(rid, "undecodable")]
        n = self.skipped_undecodable + sum(self.bad.values())
        if marked or n < 10 or n % 1000 == 0:
            log.warning("consumer %s took link message %s without applying it (%s): %d held records marked "
                        "incomplete %s", self.consumer_id, list(link), reason, len(marked),
                        [r[:64] for r in marked[:8]])

    # ---- sinks --------------------------------------------------------------------------------------------------

    def _emit(self, rec: wire.Record) -> None:
        self.records_out += 1
        rec = self.keys.name(rec, self.consumer_id)      # a reused request id never replaces a stored record
        # a record held compact (prefix references, consumer/prefix_pool.py) leaves whole: to npz, on_record,
        # subscribers and a waiting trainer; only the store keeps it compact (and materialises it at fetch)
        pool = self.acc.pool
        tr = self.trainers
        direct = tr is not None and (tr.subscribers or rec.request_id in tr.waiters)
        compact = type(rec) is CompactRecord
        whole = rec
        if compact and (self.writer is not None or self.on_record is not None or tr is None or direct):
            whole = pool.materialize(rec)
        self.out.count(rec)
        if not rec.complete:
            log.warning("consumer %s record %r incomplete: reason=%s missing=%s", self.consumer_id,
                        rec.request_id[:64], rec.reason, rec.missing[:4])
        if self.writer is not None:
            self.writer.put(whole)
        if self.on_record is not None:
            self.on_record(whole)
        if tr is not None:
            if compact and not direct:
                tr.on_record(rec, time.monotonic())         # into the store, compact
                return
            tr.on_record(whole, time.monotonic())
        pool.release(rec)
