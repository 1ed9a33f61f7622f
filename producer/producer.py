"""Publish per-step routing deltas as wire-v1 messages from a background thread; the caller never blocks."""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterable, NamedTuple, Sequence

import numpy as np
import zmq

from routing_replay.protocol import security, wire
from routing_replay.protocol.ids import default_peer_id
from routing_replay.producer.connection import Link, LinkEvent, SilenceWatch
from routing_replay.producer.messages import (Announce, Geometry, RequestBook, Step, encode_announce, encode_step,
                                              escaped_id, with_lost)
from routing_replay.producer.replay import Entry, ReplayBuffer, Spill

log = logging.getLogger("routing_replay.producer")

_STOP = object()
_U63 = (1 << 63) - 1
_MAX_LATE_LOST = 1 << 12        # requests whose late-found losses wait for their finish (thread side)


@dataclass
class ProducerStats:
    sent_msgs: int = 0          # data messages sent (first time)
    sent_bytes: int = 0         # their payload bytes
    queued_msgs: int = 0
    queued_bytes: int = 0
    dropped_msgs: int = 0       # steps refused by the queue bound (their positions are reported lost)
    dropped_rows: int = 0
    errors_from_broker: int = 0
    acked_msgs: int = 0         # data messages the broker acknowledged (applied by every consumer they went to)
    resent_msgs: int = 0        # sends of a message that had been sent before (after a rewind)
    rewinds: int = 0            # times the producer went back to its first unacknowledged message
    spilled_msgs: int = 0       # messages whose replay copy went to the spill file
    spilled_bytes: int = 0
    replay_full: int = 0        # episodes where the replay buffer (memory and spill) was full
    broker_epochs: int = 0      # broker incarnations seen
    bad_replies: int = 0
    dropped_parts: int = 0      # request parts (open/delta part/finish/abort) of an id that cannot travel or was refused
    encode_errors: int = 0      # messages the thread could not encode (dropped; a delta's positions reported lost)
    refused_by_broker: int = 0  # data messages the broker accepted-and-dropped as undecodable (error refused_seq)


def default_producer_id() -> str:
    return default_peer_id("producer")


class Refusal(NamedTuple):
    """broker -> producer `error` {reason, refused_seq, epoch}: the broker dropped that data message of that
    producer epoch (it could not decode it) and moved its ack frontier past it."""

    reason: str
    seq: int
    epoch: int


def parse_refusal(h: wire.Header) -> Refusal | None:
    """The Refusal an `error` carries, None for a plain error (no refused_seq)."""
    if h.body.get("refused_seq") is None:
        return None
    return Refusal(wire.parse_error(h), wire.int_field(h.body, "refused_seq", 1, _U63),
                   wire.int_field(h.body, "epoch", 0, _U63))


class Producer:
    """Own one DEALER socket (in a background thread) that carries this engine rank's routing to a broker.

    Thread model: `open`, `publish`, `publish_rows`, `finish`, `abort` only enqueue (no network, no encoding,
    no waiting); the background thread encodes, waits for deferred rows (`result()`), numbers the messages
    (seq 1, 2, 3, ...), keeps each one in the replay buffer, sends, and drops it once the broker acks it.

    Delivery (wire.py "Delivery", docs/RELIABILITY.md): at least once. Unacknowledged messages are resent, in
    seq order from the first unacknowledged one, when the broker asks (`rewind`), when a new broker incarnation
    answers, or when no ack came for `resend_timeout_ms` (doubling while nothing is acked, up to 8x). While the
    broker is unreachable nothing is queued in ZeroMQ (ZMQ_IMMEDIATE): messages wait in the replay buffer.

    Bounds: the caller's queue holds at most `max_queue_bytes` of rows not yet taken by the thread; the replay
    buffer holds at most `replay_max_bytes` in memory and, with `spill_dir`, `spill_max_bytes` more in a local
    file. When both are full the thread stops taking steps from the queue (logged once per episode, counted in
    `stats.replay_full`), so the queue fills and further steps are dropped at once (the engine never stalls),
    counted in `stats.dropped_msgs/dropped_rows`; the positions they carried are reported as lost in that
    request's `finish`, so the consumer marks the record incomplete (reason "producer_queue_full") instead of
    emitting a wrong one. open/finish/abort are never dropped.

    Rows are handed over: after `publish_rows(..., rows)` the caller must not modify `rows` (it is kept until
    acked). `rows` may also be a deferred object with `result() -> np.ndarray` (called in the background thread)
    and optionally `release()` (called once its bytes were copied, or when it is dropped). A deferred object with
    `dropped=True` (capture's host ring was full) is counted and reported lost the same way, never waited on.

    Security: with `curve_secret` (this producer's NAME.key_secret) and `server_key` (the broker's NAME.key) the
    connection is CURVE-encrypted and the broker is authenticated (routing_replay/security.py).

    Bad input never stops the thread: `open` of an id that cannot travel raises wire.ProtocolError
    ("bad_request_id") to the caller; parts (deltas, finish, abort) of such an id, or of a request whose open
    failed or that the broker refused, are dropped and counted (`stats.dropped_parts`); a message that fails to
    encode in the thread is dropped, counted (`stats.encode_errors`) and logged, and the thread goes on. When the
    broker accepts-and-drops an undecodable message (`error` with `refused_seq`), a refused delta's positions are
    reported lost in each request's finish and a refused open makes its request refused.

    Broker silence is said: a hello or heartbeat not answered within `silence_warn_after_ms` logs a WARNING with
    the unacknowledged count and bytes and the bound, repeated every `silence_warn_every_ms` while it lasts; the
    first answer logs one INFO line with the time it took.
    """

    def __init__(self, endpoint: str, *, num_layers: int, top_k: int, moe_layer_ids: Sequence[int] | None = None,
                 layer_range: tuple[int, int] | None = None, producer_id: str | None = None,
                 context: zmq.Context | None = None, max_queue_bytes: int = 256 << 20,
                 heartbeat_interval_ms: int = 1000, linger_ms: int = 2000, sndhwm: int = 10000,
                 replay_max_bytes: int = 256 << 20, spill_dir: str | os.PathLike | None = None,
                 spill_max_bytes: int = 4 << 30, resend_timeout_ms: int = 5000,
                 curve_secret: str | os.PathLike | None = None, server_key: str | os.PathLike | None = None,
                 silence_warn_after_ms: int = 3000, silence_warn_every_ms: int = 10_000):
        if not 1 <= num_layers <= wire.MAX_LAYERS or not 1 <= top_k <= wire.MAX_TOP_K:
            raise ValueError(f"num_layers={num_layers} top_k={top_k} outside protocol limits")
        if (curve_secret is None) != (server_key is None):
            raise ValueError("CURVE needs both curve_secret (this producer's secret cert) and server_key "
                             "(the broker's public cert)")
        self.endpoint = endpoint
        self.num_layers = num_layers
        self.top_k = top_k
        self.moe_layer_ids = list(range(num_layers)) if moe_layer_ids is None else [int(x) for x in moe_layer_ids]
        if len(self.moe_layer_ids) != num_layers:
            raise ValueError(f"moe_layer_ids has {len(self.moe_layer_ids)} entries for num_layers={num_layers}")
        lo, hi = layer_range if layer_range is not None else (0, num_layers)
        if not 0 <= lo < hi <= num_layers:
            raise ValueError(f"layer_range {layer_range} not inside [0, {num_layers}]")
        self.layer_lo, self.layer_hi = lo, hi
        self._geometry = Geometry(num_layers, top_k, lo, hi)
        self.row_shape = (hi - lo, top_k)
        self.row_bytes = (hi - lo) * top_k * 2
        self.producer_id = producer_id or default_producer_id()
        if len(self.producer_id) > wire.MAX_PEER_ID_LEN:
            raise ValueError(f"producer id longer than {wire.MAX_PEER_ID_LEN} characters")
        try:
            self.producer_id.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"producer id {escaped_id(self.producer_id)} is not encodable as UTF-8") from None
        self.epoch = time.time_ns() // 1_000_000
        self.max_queue_bytes = max_queue_bytes
        self.replay_max_bytes = replay_max_bytes
        self.spill_max_bytes = spill_max_bytes if spill_dir is not None else 0
        self.resend_timeout_s = resend_timeout_ms / 1000
        self.heartbeat_interval_s = heartbeat_interval_ms / 1000
        self.silence_warn_after_s = silence_warn_after_ms / 1000
        self.silence_warn_every_s = silence_warn_every_ms / 1000
        self.linger_ms = linger_ms
        self.curve_secret, self.server_key = curve_secret, server_key
        if curve_secret is not None:
            security.load_secret(curve_secret)            # fail here, in the caller, on a bad key file
            security.load_public(server_key)
        self.stats = ProducerStats()
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._book = RequestBook()
        self._lock = self._book.lock
        self._enqueued_bytes = 0          # written by callers under _lock
        self._done_bytes = 0              # written by the thread (taken into the replay buffer, or released)
        self._enqueued_msgs = 0
        self._done_msgs = 0
        self._closed = False
        self._close_deadline = float("inf")
        self._failure: BaseException | None = None
        self._replay = ReplayBuffer(replay_max_bytes, Spill(spill_dir, self.producer_id) if spill_dir is not None
                                    else None, self.spill_max_bytes)
        # An own context by default: its term() in close() is what makes linger wait for queued messages to
        # reach the wire (socket.close() alone returns at once, and a process that exits then loses them).
        self._own_ctx = context is None
        self._ctx = context or zmq.Context(io_threads=1)
        self._sndhwm = sndhwm
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"rr-producer-{self.producer_id}", daemon=True)
        self._thread.start()
        self._ready.wait(10)
        self._check()

    # ---- caller side -----------------------------------------------------------------------------------------

    def _check(self) -> None:
        if self._failure is not None:
            raise RuntimeError(f"routing-replay producer thread failed: {self._failure}") from self._failure
        if self._closed:
            raise RuntimeError("producer is closed")

    def _put(self, item: Announce | Step, nbytes: int, droppable: bool) -> bool:
        with self._lock:
            if droppable and self._enqueued_bytes - self._done_bytes + nbytes > self.max_queue_bytes:
                return False
            self._enqueued_bytes += nbytes
            self._enqueued_msgs += 1
        self._q.put(item)
        return True

    def _drop_parts(self, what: str, request_id: Any, n: int = 1) -> None:
        with self._lock:
            self.stats.dropped_parts += n
            total = self.stats.dropped_parts
        if total == n or total // 1000 != (total - n) // 1000:
            log.warning("producer %s dropped %s of request %s (%s); dropped_parts=%d", self.producer_id, what,
                        escaped_id(request_id), self._book.problem(request_id) or "refused", total)

    def open(self, request_id: str, *, prompt_len: int, num_cached_tokens: int = 0,
             prompt_token_ids: Sequence[int] | np.ndarray | None = None) -> None:
        """Announce a request: its prompt length and how many leading prompt tokens were prefix-cache hits.

        Raises wire.ProtocolError("bad_request_id") for an id that cannot travel; that id's later parts are
        dropped and counted, as are those of a request whose open raised anything else.
        """
        self._check()
        problem = wire.request_id_problem(request_id)
        if problem is not None:
            raise wire.ProtocolError("bad_request_id", f"{problem}: {escaped_id(request_id)}")
        try:
            if not 0 <= num_cached_tokens <= prompt_len:
                raise ValueError(f"num_cached_tokens={num_cached_tokens} outside [0, prompt_len={prompt_len}]")
            body = {"prompt_len": int(prompt_len), "num_cached": int(num_cached_tokens),
                    "num_layers": self.num_layers, "top_k": self.top_k, "layer_ids": self.moe_layer_ids}
            frames = []
            if prompt_token_ids is not None:
                toks = np.ascontiguousarray(prompt_token_ids, dtype=wire.TOKEN_DTYPE)
                body["n_prompt_tokens"] = len(toks)
                frames.append(toks)
        except BaseException:
            self._book.refuse(request_id)
            raise
        self._book.opened(request_id)
        self._put(Announce("open", request_id, body, frames), 0, False)

    def publish(self, step: Iterable[tuple[str, int, np.ndarray]]) -> bool:
        """Publish one engine step given as (request_id, start_position, rows (n, L, K) int16) tuples.

        Concatenates the rows (one copy); engine adapters holding one contiguous buffer use publish_rows.
        """
        ids, starts, counts, parts = [], [], [], []
        for rid, start, rows in step:
            rows = np.asarray(rows)
            ids.append(rid)
            starts.append(int(start))
            counts.append(rows.shape[0] if rows.ndim == 3 else -1)
            parts.append(rows)
        if not ids:
            return True
        for p in parts:
            self._check_rows_shape(p.shape, p.dtype)
        payload = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)
        return self.publish_rows(ids, starts, counts, np.ascontiguousarray(payload))

    def _check_rows_shape(self, shape, dtype) -> None:
        if len(shape) != 3 or tuple(shape[1:]) != self.row_shape or np.dtype(dtype) != wire.ROW_DTYPE:
            raise ValueError(f"rows must be (n, {self.row_shape[0]}, {self.row_shape[1]}) int16, "
                             f"got {tuple(shape)} {np.dtype(dtype)}")

    def publish_rows(self, request_ids: Sequence[str], starts: Sequence[int], counts: Sequence[int],
                     rows: Any) -> bool:
        """Publish one engine step: request_ids[i] gets counts[i] rows at positions starts[i]...

        `rows` is (sum(counts), L, K) int16 in request order, an ndarray or a deferred object (see class doc).
        Returns False when the step was dropped by the queue bound (the loss is reported downstream). The parts
        of ids that cannot travel or were refused are dropped and counted (stats.dropped_parts).
        """
        self._check()
        if not (len(request_ids) == len(starts) == len(counts)):
            raise ValueError(f"{len(request_ids)} request ids, {len(starts)} starts, {len(counts)} counts")
        total = sum(counts)
        shape = getattr(rows, "shape", None)
        if shape is not None:
            self._check_rows_shape(shape, getattr(rows, "dtype", wire.ROW_DTYPE))
            if shape[0] != total:
                raise ValueError(f"rows has {shape[0]} rows, counts add up to {total}")
        screen = self._book.screen(request_ids)
        keep = screen.keep
        if keep is not None:
            bad = next(rid for rid, k in zip(request_ids, keep) if not k)
            self._drop_parts(f"{screen.dropped} delta part(s)", bad, screen.dropped)
            if not any(keep):
                rel = getattr(rows, "release", None)
                if rel is not None:
                    rel()
                return True
            total = sum(c for c, k in zip(counts, keep) if k)
        nbytes = total * self.row_bytes
        item = Step(list(request_ids), list(starts), list(counts), rows, keep)
        if not getattr(rows, "dropped", False) and self._put(item, nbytes, True):
            return True
        self.stats.dropped_msgs += 1
        self.stats.dropped_rows += total
        rel = getattr(rows, "release", None)
        if rel is not None:
            rel()
        if keep is None:
            self._book.add_lost(request_ids, starts, counts)
        else:
            self._book.add_lost(*zip(*[(r, s, c) for r, s, c, k in zip(request_ids, starts, counts, keep) if k]))
        if self.stats.dropped_msgs == 1 or self.stats.dropped_msgs % 1000 == 0:
            log.warning("producer %s queue full: dropped=%d msgs rows=%d queued_bytes=%d bound=%d "
                        "replay_unacked=%d", self.producer_id, self.stats.dropped_msgs, self.stats.dropped_rows,
                        self.queued_bytes, self.max_queue_bytes, len(self._replay))
        return False

    def finish(self, request_id: str, *, num_output_tokens: int, finish_reason: str = "stop",
               prompt_len: int | None = None, num_cached_tokens: int | None = None,
               output_token_ids: Sequence[int] | np.ndarray | None = None) -> None:
        """Close a request: it produced `num_output_tokens` tokens (the last one's row is never computed)."""
        self._check()
        refused, lost = self._book.ended(request_id)
        if refused or self._book.problem(request_id) is not None:
            self._drop_parts("finish", request_id)
            return
        body: dict = {"num_output": int(num_output_tokens), "reason": finish_reason}
        if prompt_len is not None:
            body["prompt_len"] = int(prompt_len)
        if num_cached_tokens is not None:
            body["num_cached"] = int(num_cached_tokens)
        if lost:
            body["lost"] = lost
        frames = []
        if output_token_ids is not None:
            toks = np.ascontiguousarray(output_token_ids, dtype=wire.TOKEN_DTYPE)
            body["n_output_tokens"] = len(toks)
            frames.append(toks)
        self._put(Announce("finish", request_id, body, frames), 0, False)

    def abort(self, request_id: str, reason: str = "abort", num_output_tokens: int | None = None) -> None:
        self._check()
        refused, _ = self._book.ended(request_id)
        if refused or self._book.problem(request_id) is not None:
            self._drop_parts("abort", request_id)
            return
        body: dict = {"reason": reason}
        if num_output_tokens is not None:
            body["num_output"] = int(num_output_tokens)
        self._put(Announce("abort", request_id, body, []), 0, False)

    @property
    def queued_bytes(self) -> int:
        return self._enqueued_bytes - self._done_bytes

    @property
    def queued_msgs(self) -> int:
        return self._enqueued_msgs - self._done_msgs

    @property
    def unacked_msgs(self) -> int:
        """Messages in the replay buffer: taken from the queue, not yet acknowledged by the broker."""
        return len(self._replay)

    @property
    def replay_bytes(self) -> int:
        """Replay buffer bytes in memory (the spill file holds `spilled_bytes` more)."""
        return self._replay.mem_bytes

    @property
    def spilled_bytes(self) -> int:
        return self._replay.spilled_bytes

    def _wait(self, done, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while not done():
            if self._failure is not None:
                self._check()
            if time.monotonic() > deadline:
                return False
            time.sleep(0.001)
        return True

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every enqueued message was handed to the socket. True if it was within the timeout."""
        return self._wait(lambda: self.queued_msgs == 0 and self._replay.never_sent == 0, timeout_s)

    def wait_acked(self, timeout_s: float = 10.0) -> bool:
        """Wait until every enqueued message was acknowledged (applied by its consumers). True if in time."""
        return self._wait(lambda: self.queued_msgs == 0 and len(self._replay) == 0, timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        """Send what is queued and wait for its acks (up to timeout_s), then stop. Idempotent.

        Acks are not waited for when the broker never answered (an endpoint that does not speak acks) or says it
        has no live consumer (it holds the messages until one comes; docs/RELIABILITY.md).
        """
        if self._closed:
            return
        self._close_deadline = time.monotonic() + timeout_s
        self._closed = True
        self._q.put(_STOP)
        self._thread.join(timeout_s + 5)
        if self._thread.is_alive():
            log.warning("producer %s: thread still sending after %.1fs, %d msgs queued", self.producer_id,
                        timeout_s, self.queued_msgs)
        elif self._own_ctx:
            self._ctx.term()     # returns when queued messages are on the wire or linger_ms has passed

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- background thread: socket set-up and teardown ------------------------------------------------------

    def _run(self) -> None:
        sock = mon = None
        try:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, self.linger_ms)
            sock.setsockopt(zmq.SNDHWM, self._sndhwm)
            sock.setsockopt(zmq.MAXMSGSIZE, wire.MAX_HEADER_BYTES)
            sock.setsockopt(zmq.IMMEDIATE, 1)            # no connection: EAGAIN, the replay buffer holds it
            # a routing id stable across reconnects, so acks find this producer after a network blip
            sock.setsockopt(zmq.ROUTING_ID, b"P" + hashlib.blake2b(
                f"{self.producer_id}\0{self.epoch}".encode(), digest_size=15).digest())
            if self.curve_secret is not None:
                security.curve_client(sock, self.curve_secret, self.server_key)
            mon = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
                                          | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)
            sock.connect(self.endpoint)
            self._ready.set()
            self._loop(sock, mon)
        except zmq.ContextTerminated:
            pass
        except BaseException as e:  # kept and re-raised on the caller's next call
            self._failure = e
            log.exception("producer %s thread failed", self.producer_id)
        finally:
            self._ready.set()
            if mon is not None:
                try:
                    sock.disable_monitor()
                except zmq.ZMQError:
                    pass
                mon.close(0)
            if sock is not None:
                sock.close(linger=self.linger_ms if self._failure is None else 0)
            self._replay.close()

    # ---- background thread: the socket loop -----------------------------------------------------------------

    def _loop(self, sock: zmq.Socket, mon: zmq.Socket) -> None:
        """Take steps from the queue into the replay buffer, read replies and connection events, send in seq
        order, heartbeat, and on close wait for the acks; every wait is a poll with a timeout."""
        start = time.monotonic()
        self._link = Link(self.heartbeat_interval_s)
        self._watch = SilenceWatch(self.silence_warn_after_s, self.silence_warn_every_s, start)
        self._broker_epoch: int | None = None       # None: no broker has answered yet
        self._broker_consumers: int | None = None
        self._last_progress = start
        self._timeout_s = self.resend_timeout_s
        self._full_since: float | None = None
        self._stopping = False                      # the caller's close() sentinel was taken
        self._connections = 0
        self._auth_failures = 0
        self._sent_all_at = 0.0
        self._late_lost: dict[str, list] = {}       # losses found in the thread, for finishes not yet encoded
        stash = None                                # an item taken from the queue, waiting for room
        next_hb = start + self.heartbeat_interval_s
        next_io = 0.0
        while True:
            now = time.monotonic()
            stash = self._take(stash, now)
            if now >= next_io:                      # replies and connection events: per interval, not per step
                self._on_monitor(mon, now)
                self._read(sock, now)
                self._check_timeout(now)
                self._check_silence(now)
                next_io = now + 0.005
            self._link.move(LinkEvent.TICK, now)
            blocked = self._pump(sock, now)
            if now >= next_hb:
                self._send_ctl(sock, "heartbeat", now)
                next_hb = now + self.heartbeat_interval_s
            if self._replay.pending() or self._link.hello_due:
                self._sent_all_at = now
            if (self._stopping or self._closed) and self._closing_done(now):
                if self._broker_epoch is not None and not len(self._replay):
                    self._send_ctl(sock, "bye", now)
                return
            wait_s = max(0.0, min(next_hb - now, 0.05))
            held = self._link.data_held(now)
            if self._replay.pending() and not blocked and not held:
                continue                            # the send budget ran out: more to send at once
            if blocked or held:
                sock.poll(int(min(wait_s, 0.02) * 1000) or 1, zmq.POLLIN | (zmq.POLLOUT if blocked else 0))
            elif stash is None and not self._stopping and self._replay.has_room():
                try:
                    stash = self._q.get(timeout=wait_s)
                except queue.Empty:
                    pass
            else:
                sock.poll(int(wait_s * 1000) or 1, zmq.POLLIN)

    def _take(self, stash: Any, now: float) -> Any:
        """Move queued items into the replay buffer while it has room; returns the item left waiting, if any."""
        for _ in range(512):
            if self._stopping:
                break
            if not self._replay.has_room():
                if self._full_since is None:
                    r = self._replay
                    self._full_since = now
                    self.stats.replay_full += 1
                    log.warning("producer %s replay buffer full: unacked=%d replay_bytes=%d spilled_bytes=%d "
                                "bounds=%d+%d episodes=%d; new steps wait in the queue (bound %d bytes) and are "
                                "dropped beyond it, reported lost", self.producer_id, len(r), r.mem_bytes,
                                r.spilled_bytes, self.replay_max_bytes, self.spill_max_bytes,
                                self.stats.replay_full, self.max_queue_bytes)
                break
            if stash is None:
                try:
                    stash = self._q.get_nowait()
                except queue.Empty:
                    break
            item, stash = stash, None
            if item is _STOP:
                self._stopping = True
            else:
                self._intake(item)
        return stash

    # ---- background thread: intake (encode into the replay buffer) ------------------------------------------

    def _intake(self, item: Announce | Step) -> None:
        expect = 0
        try:
            if isinstance(item, Step):
                expect = sum(c for c, k in zip(item.counts, item.keep or [True] * len(item.counts)) if k) \
                    * self.row_bytes
                self._intake_step(item)
            else:
                self._intake_announce(item)
        finally:
            self._done_bytes += expect
            self._done_msgs += 1

    def _intake_step(self, item: Step) -> None:
        if self._book.any_refused:                  # refused after the caller enqueued this step
            screen = self._book.screen(item.request_ids)
            if screen.keep is not None:
                before = item.keep or [True] * len(item.request_ids)
                keep = [a and b for a, b in zip(screen.keep, before)]
                self.stats.dropped_parts += before.count(True) - keep.count(True)
                item = item._replace(keep=keep)
        if item.keep is not None and not any(item.keep):
            release = getattr(item.rows, "release", None)
            if release is not None:
                release()
            return
        seq = self._replay.next_seq
        try:
            enc = encode_step(item, self.producer_id, self.epoch, seq, self._geometry)
        except Exception as e:  # noqa: BLE001 (one message's failure; the stream goes on)
            kept = [(r, s, c) for i, (r, s, c) in enumerate(zip(item.request_ids, item.starts, item.counts))
                    if item.keep is None or item.keep[i]]
            for rid, s, c in kept:
                self._note_lost(rid, [int(s), int(s) + int(c)], seq - 1)
            self._encode_failed("delta", len(kept), e)
            return
        self._keep(enc)

    def _intake_announce(self, item: Announce) -> None:
        rid = item.request_id
        if item.kind != "open" and self._book.is_refused(rid):  # refused after the caller enqueued this
            self._book.ended(rid)
            self._late_lost.pop(rid, None)
            self.stats.dropped_parts += 1
            return
        if item.kind == "finish":
            late = self._late_lost.pop(rid, None)
            if late:
                item = with_lost(item, late)
        elif item.kind == "abort":
            self._late_lost.pop(rid, None)
        try:
            enc = encode_announce(item, self.producer_id, self.epoch, self._replay.next_seq)
        except Exception as e:  # noqa: BLE001 (one message's failure; the stream goes on)
            if item.kind == "open":
                self._book.refuse(rid)
            self._encode_failed(item.kind, 1, e)
            return
        self._keep(enc)

    def _keep(self, enc) -> None:
        e = self._replay.add(enc.parts, enc.frames, enc.payload)
        if e.spill is not None:
            self.stats.spilled_msgs += 1
            self.stats.spilled_bytes += e.nbytes

    def _encode_failed(self, kind: str, requests: int, e: Exception) -> None:
        self.stats.encode_errors += 1
        log.warning("producer %s dropped a %s message of %d request(s) it could not encode (%d so far): %s: %s",
                    self.producer_id, kind, requests, self.stats.encode_errors, type(e).__name__, str(e)[:200])

    def _note_lost(self, rid: Any, rng: list, seq: int) -> str:
        """Report positions `rng` of request `rid` lost in its finish: the finish held after `seq` if it was not
        sent yet (re-encoded), else the finish still to come. Returns what was done, for the log line."""
        if type(rid) is not str:
            return "not a request id"
        for f in self._replay.after(seq):
            if f.parts.kind in ("finish", "abort") and f.parts.request_ids[0] == rid:
                if f.parts.kind == "abort":
                    return "aborted"
                if f.sent_at != 0.0:
                    return "finish already sent"
                frames = list(self._replay.frames(f))
                h = wire.decode_header(frames[0])
                body = dict(h.body)
                body["lost"] = list(body.get("lost", ())) + [rng]
                frames[0] = wire.pack_header("finish", self.producer_id, self.epoch, f.seq, rid, body)
                self._replay.replace_frames(f, frames)
                return "finish re-encoded"
        if rid not in self._late_lost and len(self._late_lost) >= _MAX_LATE_LOST:
            self._late_lost.pop(next(iter(self._late_lost)))
        self._late_lost.setdefault(rid, []).append(rng)
        return "reported in its finish"

    # ---- background thread: connection ----------------------------------------------------------------------

    def _send_ctl(self, sock: zmq.Socket, kind: str, now: float) -> bool:
        if kind != "bye":
            self._watch.asked(now)
        body = {"unacked_from": self._replay.first_unacked} if kind != "bye" else {}
        try:
            sock.send_multipart([wire.pack_header(kind, self.producer_id, self.epoch, 0, self.producer_id, body)],
                                zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False

    def _on_monitor(self, mon: zmq.Socket, now: float) -> None:
        """Connection events: after a reconnect, say hello and send nothing else until the broker answered (its
        epoch says whether it is the same broker or a new one that needs everything unacknowledged again)."""
        while mon.poll(0):
            # a monitor message: frame 0 = event (uint16) + value (uint32), native order; frame 1 = endpoint
            # (parsed here: zmq.utils.monitor imports asyncio, slow on the first connection)
            ev = struct.unpack("=H", mon.recv_multipart()[0][:2])[0]
            if ev == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._connections += 1
                if self._connections > 1:
                    self._link.move(LinkEvent.RECONNECTED, now)
                    log.info("producer %s reconnected to %s: unacked=%d", self.producer_id, self.endpoint,
                             len(self._replay))
            elif ev == zmq.EVENT_DISCONNECTED:
                # hold data from now on: the next connection may be a new broker, which must hear hello first
                # (set here, long before a reconnect, so no data slips out ahead of the hello)
                self._link.move(LinkEvent.DISCONNECTED, now)
                log.info("producer %s disconnected from %s: unacked=%d", self.producer_id, self.endpoint,
                         len(self._replay))
            else:
                self._auth_failures += 1
                if self._auth_failures == 1 or self._auth_failures % 100 == 0:
                    log.error("producer %s: handshake with %s failed (%s, %d times): wrong broker key, or this "
                              "producer's key is not allowed", self.producer_id, self.endpoint,
                              "auth" if ev == zmq.EVENT_HANDSHAKE_FAILED_AUTH else "protocol", self._auth_failures)

    def _check_silence(self, now: float) -> None:
        s = self._watch.due(now)
        if s is None:
            return
        r = self._replay
        log.warning("producer %s: no answer from broker %s for %.1fs (report %d; connections=%d "
                    "handshake_failures=%d): unacked=%d msgs unacked_bytes=%d (memory %d + spill %d) bound=%d+%d "
                    "bytes; steps wait in the replay buffer", self.producer_id, self.endpoint, s.silent_s,
                    s.reports, self._connections, self._auth_failures, len(r), r.mem_bytes + r.spilled_bytes,
                    r.mem_bytes, r.spilled_bytes, self.replay_max_bytes, self.spill_max_bytes)

    def _heard(self, now: float) -> None:
        self._link.move(LinkEvent.HEARD, now)
        a = self._watch.heard(now)
        if a is None:
            return
        if a.first:
            log.info("producer %s: broker answered at %s in %d ms", self.producer_id, self.endpoint,
                     round(a.after_s * 1000))
        else:
            log.info("producer %s: broker at %s answered again after %.1fs of silence: unacked=%d",
                     self.producer_id, self.endpoint, a.after_s, len(self._replay))

    # ---- background thread: sending, acks, rewinds ----------------------------------------------------------

    def _pump(self, sock: zmq.Socket, now: float) -> bool:
        """Send what waits, in seq order. True if the socket would block (no connection, or send queue full)."""
        link = self._link
        if link.hello_due:
            if not self._send_ctl(sock, "hello", now):
                return True
            link.move(LinkEvent.HELLO_SENT, now)
        if link.data_held(now):
            return False
        r = self._replay
        st = self.stats
        for _ in range(1000):
            e = r.next_to_send()
            if e is None:
                break
            try:
                sock.send_multipart(r.frames(e), zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return True
            if r.mark_sent(e, now):
                st.sent_msgs += 1
                st.sent_bytes += e.payload
            else:
                st.resent_msgs += 1
        return False

    def _acked(self, upto: int, now: float) -> None:
        n = self._replay.ack(upto).msgs
        if n:
            self.stats.acked_msgs += n
            self._last_progress = now
            self._timeout_s = self.resend_timeout_s
            if self._full_since is not None and self._replay.has_room():
                log.info("producer %s replay buffer has room again after %.1fs: unacked=%d", self.producer_id,
                         now - self._full_since, len(self._replay))
                self._full_since = None

    def _rewind(self, why: str, now: float) -> None:
        r = self._replay
        r.rewind()
        self._link.move(LinkEvent.REWIND, now)
        self.stats.rewinds += 1
        self._last_progress = now
        log.info("producer %s rewind why=%s unacked=%d from_seq=%s replay_MB=%.1f spilled_MB=%.1f", self.producer_id,
                 why, len(r), r.first_unacked if len(r) else "-", r.mem_bytes / 1e6, r.spilled_bytes / 1e6)

    def _on_rewind_request(self, ack: wire.ProducerAck, now: float) -> None:
        if ack.hello:
            self._link.move(LinkEvent.REWIND, now)
        nxt = self._replay.next_to_send()
        if ack.expect is not None and nxt is not None and nxt.seq <= ack.expect and not ack.hello:
            return                  # what goes out next already starts at or before what the broker expects
        self._rewind("broker_asked", now)

    def _on_refusal(self, r: Refusal) -> None:
        """The broker accepted-and-dropped seq r.seq: flag what it carried (lost positions, a refused request)."""
        self.stats.refused_by_broker += 1
        e = self._replay.get(r.seq)
        if e is None:
            log.warning("producer %s: broker refused seq=%d (no longer held here): %s", self.producer_id, r.seq,
                        r.reason)
            return
        p = e.parts
        if p.kind == "delta":
            done = [self._note_lost(rid, [s, s + c], e.seq) for rid, s, c in zip(p.request_ids, p.starts, p.counts)]
            log.warning("producer %s: broker refused seq=%d kind=delta requests=%d rows=%d (%s): %s",
                        self.producer_id, r.seq, len(p.request_ids), sum(p.counts),
                        ", ".join(sorted(set(done))) or "nothing to report", r.reason)
        elif p.kind == "open":
            self._book.refuse(p.request_ids[0])
            log.warning("producer %s: broker refused seq=%d kind=open request=%s; its later parts are dropped: %s",
                        self.producer_id, r.seq, escaped_id(p.request_ids[0]), r.reason)
        else:
            log.warning("producer %s: broker refused seq=%d kind=%s request=%s: %s", self.producer_id, r.seq,
                        p.kind, escaped_id(p.request_ids[0]), r.reason)

    def _read(self, sock: zmq.Socket, now: float) -> None:
        for _ in range(1000):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._heard(now)
            try:
                h = wire.decode_header(frames[0])
                if h.epoch != self._broker_epoch:
                    if self._broker_epoch is not None:
                        log.info("producer %s: new broker epoch=%d (was %d)", self.producer_id, h.epoch,
                                 self._broker_epoch)
                        self._broker_epoch = h.epoch
                        self._rewind("new_broker", now)
                    self._broker_epoch = h.epoch
                    self.stats.broker_epochs += 1
                if h.kind == "heartbeat":
                    self._broker_consumers = wire.parse_broker_hello(h) if "consumers" in h.body else None
                elif h.kind == "ack":
                    if h.body.get("epoch") != self.epoch:
                        continue
                    ack = wire.parse_producer_ack(h)
                    self._acked(ack.upto, now)
                    if ack.rewind:
                        self._on_rewind_request(ack, now)
                elif h.kind == "error":
                    self.stats.errors_from_broker += 1
                    refusal = parse_refusal(h)
                    if refusal is None:
                        log.error("producer %s: broker refused a message: %s", self.producer_id, wire.parse_error(h))
                    elif refusal.epoch == self.epoch:
                        self._on_refusal(refusal)
                    else:
                        log.warning("producer %s: broker refused seq=%d of another epoch %d (this one %d): %s",
                                    self.producer_id, refusal.seq, refusal.epoch, self.epoch, refusal.reason)
            except wire.ProtocolError as e:
                self.stats.bad_replies += 1
                if self.stats.bad_replies == 1 or self.stats.bad_replies % 1000 == 0:
                    log.warning("producer %s: bad reply from broker (%d so far): %s", self.producer_id,
                                self.stats.bad_replies, e)

    def _check_timeout(self, now: float) -> None:
        r = self._replay
        first = r.get(r.first_unacked)
        if first is None or self._broker_epoch is None or self._broker_consumers == 0 or first.sent_at == 0.0:
            return
        if now - max(first.sent_at, self._last_progress) > self._timeout_s:
            self._timeout_s = min(self._timeout_s * 2, 8 * self.resend_timeout_s)
            self._rewind("ack_timeout", now)

    def _closing_done(self, now: float) -> bool:
        r = self._replay
        if now >= self._close_deadline:
            if len(r) or self.queued_msgs:
                log.warning("producer %s closing with unacked=%d (never sent %d) queued=%d after the timeout",
                            self.producer_id, len(r), r.never_sent, self.queued_msgs)
            return True
        if not self._stopping or r.pending() or self._link.hello_due:
            return False
        if not len(r) or self._broker_consumers == 0:
            return True
        # a peer that has not answered half a second after everything was sent does not speak acks
        return self._broker_epoch is None and now - self._sent_all_at >= 0.5
