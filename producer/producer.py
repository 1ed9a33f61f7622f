"""Publish per-step routing deltas as wire-v1 messages from a background thread; the caller never blocks."""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import shutil
import struct
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import zmq

from routing_replay.protocol import security, wire
from routing_replay.protocol.ids import default_peer_id

log = logging.getLogger("routing_replay.producer")

_STOP = object()


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


def default_producer_id() -> str:
    return default_peer_id("producer")


class _Entry:
    """One data message kept until the broker acks it: its frames in memory, or where they are in the spill."""

    __slots__ = ("seq", "frames", "nbytes", "payload", "spill", "sent_at", "acked")

    def __init__(self, seq: int, frames: list, nbytes: int, payload: int):
        self.seq = seq
        self.frames = frames
        self.nbytes = nbytes
        self.payload = payload
        self.spill = None
        self.sent_at = 0.0
        self.acked = False


class _Spill:
    """Own the replay buffer's overflow: append-only segment files in a private directory, deleted once acked."""

    SEGMENT_BYTES = 64 << 20

    def __init__(self, directory: str | os.PathLike, producer_id: str):
        tag = hashlib.blake2b(producer_id.encode(), digest_size=6).hexdigest()
        self.dir = Path(directory) / f"rr-replay-{tag}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.dir.mkdir(parents=True, mode=0o700)
        self.bytes = 0
        self._seg = -1
        self._fds: dict[int, int] = {}
        self._off: dict[int, int] = {}
        self._live: dict[int, int] = {}

    def _open_segment(self) -> None:
        self._seg += 1
        fd = os.open(self.dir / f"{self._seg:08d}.seg", os.O_CREAT | os.O_RDWR | os.O_TRUNC, 0o600)
        self._fds[self._seg], self._off[self._seg], self._live[self._seg] = fd, 0, 0

    def write(self, frames: list) -> tuple:
        if self._seg < 0 or self._off[self._seg] >= self.SEGMENT_BYTES:
            old = self._seg
            self._open_segment()
            if old >= 0 and self._live[old] == 0:
                self._drop(old)
        seg = self._seg
        fd, off = self._fds[seg], self._off[seg]
        lens = []
        pos = off
        for f in frames:
            mv = memoryview(f).cast("B")
            done = 0
            while done < len(mv):
                done += os.pwrite(fd, mv[done:], pos + done)
            lens.append(done)
            pos += done
        self._off[seg] = pos
        self._live[seg] += 1
        self.bytes += sum(lens)
        return seg, off, lens

    def read(self, ref: tuple) -> list:
        seg, off, lens = ref
        out = []
        for n in lens:
            b = os.pread(self._fds[seg], n, off)
            if len(b) != n:
                raise OSError(f"spill segment {seg} is short: wanted {n} bytes at {off}, got {len(b)}")
            out.append(b)
            off += n
        return out

    def release(self, ref: tuple) -> None:
        seg, _, lens = ref
        self.bytes -= sum(lens)
        self._live[seg] -= 1
        if self._live[seg] == 0 and seg != self._seg:
            self._drop(seg)

    def _drop(self, seg: int) -> None:
        os.close(self._fds.pop(seg))
        del self._off[seg], self._live[seg]
        (self.dir / f"{seg:08d}.seg").unlink(missing_ok=True)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        shutil.rmtree(self.dir, ignore_errors=True)


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
    """

    def __init__(self, endpoint: str, *, num_layers: int, top_k: int, moe_layer_ids: Sequence[int] | None = None,
                 layer_range: tuple[int, int] | None = None, producer_id: str | None = None,
                 context: zmq.Context | None = None, max_queue_bytes: int = 256 << 20,
                 heartbeat_interval_ms: int = 1000, linger_ms: int = 2000, sndhwm: int = 10000,
                 replay_max_bytes: int = 256 << 20, spill_dir: str | os.PathLike | None = None,
                 spill_max_bytes: int = 4 << 30, resend_timeout_ms: int = 5000,
                 curve_secret: str | os.PathLike | None = None, server_key: str | os.PathLike | None = None):
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
        self.row_shape = (hi - lo, top_k)
        self.row_bytes = (hi - lo) * top_k * 2
        self.producer_id = producer_id or default_producer_id()
        if len(self.producer_id) > wire.MAX_PEER_ID_LEN:
            raise ValueError(f"producer id longer than {wire.MAX_PEER_ID_LEN} characters")
        self.epoch = time.time_ns() // 1_000_000
        self.max_queue_bytes = max_queue_bytes
        self.replay_max_bytes = replay_max_bytes
        self.spill_max_bytes = spill_max_bytes if spill_dir is not None else 0
        self.resend_timeout_s = resend_timeout_ms / 1000
        self.heartbeat_interval_s = heartbeat_interval_ms / 1000
        self.linger_ms = linger_ms
        self.curve_secret, self.server_key = curve_secret, server_key
        if curve_secret is not None:
            security.load_secret(curve_secret)            # fail here, in the caller, on a bad key file
            security.load_public(server_key)
        self.stats = ProducerStats()
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._enqueued_bytes = 0          # written by callers under _lock
        self._done_bytes = 0              # written by the thread (taken into the replay buffer, or released)
        self._enqueued_msgs = 0
        self._done_msgs = 0
        self._never_sent = 0              # taken into the replay buffer, not sent yet (thread)
        self._unacked = 0                 # in the replay buffer (thread)
        self._mem_bytes = 0               # replay buffer bytes in memory (thread)
        self._lost: dict[str, list] = {}
        self._closed = False
        self._close_deadline = float("inf")
        self._failure: BaseException | None = None
        self._spill = _Spill(spill_dir, self.producer_id) if spill_dir is not None else None
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

    def _put(self, item: tuple, nbytes: int, droppable: bool) -> bool:
        with self._lock:
            if droppable and self._enqueued_bytes - self._done_bytes + nbytes > self.max_queue_bytes:
                return False
            self._enqueued_bytes += nbytes
            self._enqueued_msgs += 1
        self._q.put(item)
        return True

    def open(self, request_id: str, *, prompt_len: int, num_cached_tokens: int = 0,
             prompt_token_ids: Sequence[int] | np.ndarray | None = None) -> None:
        """Announce a request: its prompt length and how many leading prompt tokens were prefix-cache hits."""
        self._check()
        wire.check_request_id(request_id)
        if not 0 <= num_cached_tokens <= prompt_len:
            raise ValueError(f"num_cached_tokens={num_cached_tokens} outside [0, prompt_len={prompt_len}]")
        body = {"prompt_len": int(prompt_len), "num_cached": int(num_cached_tokens), "num_layers": self.num_layers,
                "top_k": self.top_k, "layer_ids": self.moe_layer_ids}
        frames = []
        if prompt_token_ids is not None:
            toks = np.ascontiguousarray(prompt_token_ids, dtype=wire.TOKEN_DTYPE)
            body["n_prompt_tokens"] = len(toks)
            frames.append(toks)
        self._put(("open", request_id, body, frames), 0, False)

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
        Returns False when the step was dropped by the queue bound (the loss is reported downstream).
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
        nbytes = total * self.row_bytes
        item = ("delta", list(request_ids), list(starts), list(counts), rows)
        if not getattr(rows, "dropped", False) and self._put(item, nbytes, True):
            return True
        self.stats.dropped_msgs += 1
        self.stats.dropped_rows += total
        rel = getattr(rows, "release", None)
        if rel is not None:
            rel()
        with self._lock:
            for rid, s, c in zip(request_ids, starts, counts):
                self._lost.setdefault(rid, []).append([int(s), int(s) + int(c)])
        if self.stats.dropped_msgs == 1 or self.stats.dropped_msgs % 1000 == 0:
            log.warning("producer %s queue full: dropped=%d msgs rows=%d queued_bytes=%d bound=%d "
                        "replay_unacked=%d", self.producer_id, self.stats.dropped_msgs, self.stats.dropped_rows,
                        self.queued_bytes, self.max_queue_bytes, self._unacked)
        return False

    def finish(self, request_id: str, *, num_output_tokens: int, finish_reason: str = "stop",
               prompt_len: int | None = None, num_cached_tokens: int | None = None,
               output_token_ids: Sequence[int] | np.ndarray | None = None) -> None:
        """Close a request: it produced `num_output_tokens` tokens (the last one's row is never computed)."""
        self._check()
        body: dict = {"num_output": int(num_output_tokens), "reason": finish_reason}
        if prompt_len is not None:
            body["prompt_len"] = int(prompt_len)
        if num_cached_tokens is not None:
            body["num_cached"] = int(num_cached_tokens)
        with self._lock:
            lost = self._lost.pop(request_id, None)
        if lost:
            body["lost"] = lost
        frames = []
        if output_token_ids is not None:
            toks = np.ascontiguousarray(output_token_ids, dtype=wire.TOKEN_DTYPE)
            body["n_output_tokens"] = len(toks)
            frames.append(toks)
        self._put(("finish", request_id, body, frames), 0, False)

    def abort(self, request_id: str, reason: str = "abort", num_output_tokens: int | None = None) -> None:
        self._check()
        with self._lock:
            self._lost.pop(request_id, None)
        body: dict = {"reason": reason}
        if num_output_tokens is not None:
            body["num_output"] = int(num_output_tokens)
        self._put(("abort", request_id, body, []), 0, False)

    @property
    def queued_bytes(self) -> int:
        return self._enqueued_bytes - self._done_bytes

    @property
    def queued_msgs(self) -> int:
        return self._enqueued_msgs - self._done_msgs

    @property
    def unacked_msgs(self) -> int:
        """Messages in the replay buffer: taken from the queue, not yet acknowledged by the broker."""
        return self._unacked

    @property
    def replay_bytes(self) -> int:
        """Replay buffer bytes in memory (the spill file holds `spilled_bytes` more)."""
        return self._mem_bytes

    @property
    def spilled_bytes(self) -> int:
        return self._spill.bytes if self._spill is not None else 0

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
        return self._wait(lambda: self.queued_msgs == 0 and self._never_sent == 0, timeout_s)

    def wait_acked(self, timeout_s: float = 10.0) -> bool:
        """Wait until every enqueued message was acknowledged (applied by its consumers). True if in time."""
        return self._wait(lambda: self.queued_msgs == 0 and self._unacked == 0, timeout_s)

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

    # ---- background thread -----------------------------------------------------------------------------------

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
            if self._spill is not None:
                self._spill.close()

    def _send_ctl(self, sock: zmq.Socket, kind: str) -> bool:
        u = self._buf[0].seq if self._buf else self._next_seq
        try:
            sock.send_multipart([wire.pack_header(kind, self.producer_id, self.epoch, 0, self.producer_id,
                                                  {"unacked_from": u})], zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False

    def _encode(self, item: tuple, seq: int) -> _Entry:
        kind = item[0]
        if kind == "delta":
            _, ids, starts, counts, rows = item
            release = None
            if not isinstance(rows, np.ndarray):
                release = getattr(rows, "release", None)
                rows = rows.result()
            try:
                body = wire.delta_body(starts, counts, self.num_layers, self.top_k, self.layer_lo, self.layer_hi)
                head = wire.pack_header("delta", self.producer_id, self.epoch, seq, ids, body)
                payload = memoryview(np.ascontiguousarray(rows)).cast("B")
                if release is not None:
                    payload = bytes(payload)      # copy out of the ring slot before releasing it
            finally:
                if release is not None:
                    release()
            return _Entry(seq, [head, payload], len(head) + len(payload), len(payload))
        _, rid, body, extra = item
        head = wire.pack_header(kind, self.producer_id, self.epoch, seq, rid, body)
        extra = [memoryview(np.ascontiguousarray(x)).cast("B") for x in extra]
        return _Entry(seq, [head, *extra], len(head) + sum(len(x) for x in extra), 0)

    def _room(self) -> bool:
        if self._mem_bytes < self.replay_max_bytes:
            return True
        return self._spill is not None and self._spill.bytes < self.spill_max_bytes

    def _intake(self, item: tuple) -> None:
        seq = self._next_seq
        expect = sum(item[3]) * self.row_bytes if item[0] == "delta" else 0
        try:
            e = self._encode(item, seq)
            self._next_seq = seq + 1
            if self._mem_bytes + e.nbytes > self.replay_max_bytes and self._spill is not None:
                e.spill = self._spill.write(e.frames)      # read back from the file when it is sent
                e.frames = None
                self.stats.spilled_msgs += 1
                self.stats.spilled_bytes += e.nbytes
            else:
                self._mem_bytes += e.nbytes
            self._buf.append(e)
            self._to_send.append(e)
            self._never_sent += 1
            self._unacked += 1
        finally:
            self._done_bytes += expect
            self._done_msgs += 1

    def _on_monitor(self, mon: zmq.Socket, now: float) -> None:
        """Connection events: after a reconnect, say hello and send nothing else until the broker answered (its
        epoch says whether it is the same broker or a new one that needs everything unacknowledged again)."""
        while mon.poll(0):
            # a monitor message: frame 0 = event (uint16) + value (uint32), native order; frame 1 = endpoint
            # (parsed here: zmq.utils.monitor would import asyncio, 40 ms on the first connection)
            ev = struct.unpack("=H", mon.recv_multipart()[0][:2])[0]
            if ev == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._connections += 1
                if self._connections > 1:
                    self._need_hello = True
                    self._hold_data_until = now + self.heartbeat_interval_s
                    log.info("producer %s reconnected to %s: unacked=%d", self.producer_id, self.endpoint,
                             len(self._buf))
            elif ev == zmq.EVENT_DISCONNECTED:
                # hold data from now on: the next connection may be a new broker, which must hear hello first
                # (set here, long before a reconnect, so no data slips out ahead of the hello)
                self._need_hello = True
                self._hold_data_until = float("inf")
                log.info("producer %s disconnected from %s: unacked=%d", self.producer_id, self.endpoint,
                         len(self._buf))
            else:
                self._auth_failures += 1
                if self._auth_failures == 1 or self._auth_failures % 100 == 0:
                    log.error("producer %s: handshake with %s failed (%s, %d times): wrong broker key, or this "
                              "producer's key is not allowed", self.producer_id, self.endpoint,
                              "auth" if ev == zmq.EVENT_HANDSHAKE_FAILED_AUTH else "protocol", self._auth_failures)

    def _pump(self, sock: zmq.Socket, now: float) -> bool:
        """Send what waits, in seq order. True if the socket would block (no connection, or send queue full)."""
        if self._need_hello:
            if not self._send_ctl(sock, "hello"):
                return True
            self._need_hello = False
        if self._hold_data_until > now:
            return False
        ts = self._to_send
        st = self.stats
        n = 0
        while ts and n < 1000:
            e = ts[0]
            if e.acked:
                ts.popleft()
                continue
            frames = e.frames if e.frames is not None else self._spill.read(e.spill)
            try:
                sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return True
            ts.popleft()
            if e.sent_at == 0.0:
                self._never_sent -= 1
                st.sent_msgs += 1
                st.sent_bytes += e.payload
            else:
                st.resent_msgs += 1
            e.sent_at = now
            n += 1
        return False

    def _acked(self, upto: int, now: float) -> None:
        buf = self._buf
        n = 0
        while buf and buf[0].seq <= upto:
            e = buf.popleft()
            e.acked = True
            if e.spill is not None:
                self._spill.release(e.spill)
            else:
                self._mem_bytes -= e.nbytes
            if e.sent_at == 0.0:                            # acked before this producer sent it (a broker bug)
                self._never_sent -= 1
            e.frames = None
            n += 1
        if n:
            self._unacked -= n
            self.stats.acked_msgs += n
            self._last_progress = now
            self._timeout_s = self.resend_timeout_s
            if self._full_since is not None and self._room():
                log.info("producer %s replay buffer has room again after %.1fs: unacked=%d", self.producer_id,
                         now - self._full_since, self._unacked)
                self._full_since = None

    def _rewind(self, why: str, now: float) -> None:
        self._to_send = deque(self._buf)
        self._need_hello = True
        self.stats.rewinds += 1
        self._last_progress = now
        log.info("producer %s rewind why=%s unacked=%d from_seq=%s replay_MB=%.1f spilled_MB=%.1f", self.producer_id,
                 why, len(self._buf), self._buf[0].seq if self._buf else "-", self._mem_bytes / 1e6,
                 self.spilled_bytes / 1e6)

    def _on_rewind_request(self, body: dict, now: float) -> None:
        if body.get("hello"):
            self._need_hello = True
        expect = body.get("expect")
        first = next((e.seq for e in self._to_send if not e.acked), None)
        if type(expect) is int and first is not None and first <= expect and not body.get("hello"):
            return                  # what goes out next already starts at or before what the broker expects
        self._rewind("broker_asked", now)

    def _read(self, sock: zmq.Socket, now: float) -> None:
        for _ in range(1000):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._hold_data_until = 0.0
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
                kind = h.kind
                if kind == "heartbeat":
                    c = h.body.get("consumers")
                    self._broker_consumers = c if type(c) is int else None
                elif kind == "ack":
                    if h.body.get("epoch") != self.epoch:
                        continue
                    upto = wire.int_field(h.body, "upto", -1, (1 << 63) - 1)
                    self._acked(upto, now)
                    if h.body.get("rewind"):
                        self._on_rewind_request(h.body, now)
                elif kind == "error":
                    self.stats.errors_from_broker += 1
                    log.error("producer %s: broker refused a message: %s", self.producer_id,
                              str(h.body.get("reason"))[:300])
            except wire.ProtocolError as e:
                self.stats.bad_replies += 1
                if self.stats.bad_replies == 1 or self.stats.bad_replies % 1000 == 0:
                    log.warning("producer %s: bad reply from broker (%d so far): %s", self.producer_id,
                                self.stats.bad_replies, e)

    def _check_timeout(self, now: float) -> None:
        buf = self._buf
        if not buf or self._broker_epoch is None or self._broker_consumers == 0 or buf[0].sent_at == 0.0:
            return
        if now - max(buf[0].sent_at, self._last_progress) > self._timeout_s:
            self._timeout_s = min(self._timeout_s * 2, 8 * self.resend_timeout_s)
            self._rewind("ack_timeout", now)

    def _closing_done(self, now: float) -> bool:
        if now >= self._close_deadline:
            if self._buf or self.queued_msgs:
                log.warning("producer %s closing with unacked=%d (never sent %d) queued=%d after the timeout",
                            self.producer_id, len(self._buf), self._never_sent, self.queued_msgs)
            return True
        if not self._stopping or self._to_send or self._need_hello:
            return False
        if not self._buf or self._broker_consumers == 0:
            return True
        # a peer that has not answered half a second after everything was sent does not speak acks
        return self._broker_epoch is None and now - self._sent_all_at >= 0.5

    def _loop(self, sock: zmq.Socket, mon: zmq.Socket) -> None:
        self._buf: deque = deque()           # unacked entries, seq increasing
        self._to_send: deque = deque()       # entries to send next, in seq order
        self._next_seq = 1
        self._need_hello = True
        self._broker_epoch: int | None = None
        self._broker_consumers: int | None = None
        self._last_progress = time.monotonic()
        self._timeout_s = self.resend_timeout_s
        self._full_since: float | None = None
        self._stopping = False
        self._connections = 0
        self._auth_failures = 0
        self._hold_data_until = 0.0
        self._sent_all_at = 0.0
        stash = None
        next_hb = time.monotonic() + self.heartbeat_interval_s
        next_io = 0.0
        while True:
            now = time.monotonic()
            for _ in range(512):
                if self._stopping:
                    break
                if not self._room():
                    if self._full_since is None:
                        self._full_since = now
                        self.stats.replay_full += 1
                        log.warning("producer %s replay buffer full: unacked=%d replay_bytes=%d spilled_bytes=%d "
                                    "bounds=%d+%d episodes=%d; new steps wait in the queue (bound %d bytes) and are "
                                    "dropped beyond it, reported lost", self.producer_id, len(self._buf),
                                    self._mem_bytes, self.spilled_bytes, self.replay_max_bytes,
                                    self.spill_max_bytes, self.stats.replay_full, self.max_queue_bytes)
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
            if now >= next_io:                         # replies and connection events: per interval, not per step
                self._on_monitor(mon, now)
                self._read(sock, now)
                self._check_timeout(now)
                next_io = now + 0.005
            blocked = self._pump(sock, now)
            if now >= next_hb:
                self._send_ctl(sock, "heartbeat")
                next_hb = now + self.heartbeat_interval_s
            if self._to_send or self._need_hello:
                self._sent_all_at = now
            if (self._stopping or self._closed) and self._closing_done(now):
                if self._broker_epoch is not None and not self._buf:
                    try:
                        sock.send_multipart([wire.pack_header("bye", self.producer_id, self.epoch, 0,
                                                              self.producer_id, {})], zmq.NOBLOCK)
                    except zmq.Again:
                        pass
                return
            wait_s = max(0.0, min(next_hb - now, 0.05))
            if self._to_send and not blocked and self._hold_data_until <= now:
                continue                               # the send budget ran out: more to send at once
            if blocked or self._hold_data_until > now:
                sock.poll(int(min(wait_s, 0.02) * 1000) or 1, zmq.POLLIN | (zmq.POLLOUT if blocked else 0))
            elif stash is None and not self._stopping and self._room():
                try:
                    stash = self._q.get(timeout=wait_s)
                except queue.Empty:
                    pass
            else:
                sock.poll(int(wait_s * 1000) or 1, zmq.POLLIN)
