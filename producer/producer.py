"""Publish per-step routing deltas as wire-v1 messages from a background thread; the caller never blocks."""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import numpy as np
import zmq

from routing_replay import wire
from routing_replay.ids import default_peer_id

log = logging.getLogger("routing_replay.producer")

_STOP = object()


@dataclass
class ProducerStats:
    sent_msgs: int = 0
    sent_bytes: int = 0
    queued_msgs: int = 0
    queued_bytes: int = 0
    dropped_msgs: int = 0
    dropped_rows: int = 0
    errors_from_broker: int = 0


def default_producer_id() -> str:
    return default_peer_id("producer")


class Producer:
    """Own one DEALER socket (in a background thread) that carries this engine rank's routing to a broker.

    Thread model: `open`, `publish`, `publish_rows`, `finish`, `abort` only enqueue (no network, no encoding,
    no waiting); the background thread encodes, waits for deferred rows (`result()`), sends, and releases them.

    Back-pressure: queued payload bytes are bounded by `max_queue_bytes`. A delta that would exceed the bound
    is dropped at once (the engine never stalls), counted in `stats.dropped_msgs/dropped_rows`, and the
    positions it carried are reported as lost in that request's `finish`, so the consumer marks the record
    incomplete (reason "producer_queue_full") instead of emitting a wrong one. open/finish/abort are never
    dropped.

    Rows are handed over: after `publish_rows(..., rows)` the caller must not modify `rows`. `rows` may also be a
    deferred object with `result() -> np.ndarray` (called in the background thread) and optionally `release()`
    (called once its bytes were copied into the socket, or when it is dropped). A deferred object with
    `dropped=True` (capture's host ring was full) is counted and reported lost the same way, never waited on.
    """

    def __init__(self, endpoint: str, *, num_layers: int, top_k: int, moe_layer_ids: Sequence[int] | None = None,
                 layer_range: tuple[int, int] | None = None, producer_id: str | None = None,
                 context: zmq.Context | None = None, max_queue_bytes: int = 256 << 20,
                 heartbeat_interval_ms: int = 1000, linger_ms: int = 2000, sndhwm: int = 10000):
        if not 1 <= num_layers <= wire.MAX_LAYERS or not 1 <= top_k <= wire.MAX_TOP_K:
            raise ValueError(f"num_layers={num_layers} top_k={top_k} outside protocol limits")
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
        self.epoch = time.time_ns() // 1_000_000
        self.max_queue_bytes = max_queue_bytes
        self.heartbeat_interval_s = heartbeat_interval_ms / 1000
        self.linger_ms = linger_ms
        self.stats = ProducerStats()
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._enqueued_bytes = 0          # written by callers under _lock
        self._done_bytes = 0              # written by the thread (sent or released)
        self._enqueued_msgs = 0
        self._done_msgs = 0
        self._lost: dict[str, list] = {}
        self._closed = False
        self._failure: BaseException | None = None
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
        wire._request_id(request_id)
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
            log.warning("producer %s queue full: dropped=%d msgs rows=%d queued_bytes=%d bound=%d",
                        self.producer_id, self.stats.dropped_msgs, self.stats.dropped_rows,
                        self.queued_bytes, self.max_queue_bytes)
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

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every enqueued message was handed to the socket. True if it was within the timeout."""
        deadline = time.monotonic() + timeout_s
        while self.queued_msgs > 0:
            if self._failure is not None:
                self._check()
            if time.monotonic() > deadline:
                return False
            time.sleep(0.001)
        return True

    def close(self, timeout_s: float = 10.0) -> None:
        """Send what is queued (up to timeout_s, then linger_ms for the socket to drain), stop. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._q.put(_STOP)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("producer %s: thread still sending after %.1fs, %d msgs queued",
                        self.producer_id, timeout_s, self.queued_msgs)
        elif self._own_ctx:
            self._ctx.term()     # returns when queued messages are on the wire or linger_ms has passed

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- background thread -----------------------------------------------------------------------------------

    def _run(self) -> None:
        sock = None
        try:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, self.linger_ms)
            sock.setsockopt(zmq.SNDHWM, self._sndhwm)
            sock.setsockopt(zmq.MAXMSGSIZE, wire.MAX_HEADER_BYTES)
            sock.connect(self.endpoint)
            self._ready.set()
            self._loop(sock)
        except zmq.ContextTerminated:
            pass
        except BaseException as e:  # kept and re-raised on the caller's next call
            self._failure = e
            log.exception("producer %s thread failed", self.producer_id)
        finally:
            self._ready.set()
            if sock is not None:
                sock.close(linger=self.linger_ms if self._failure is None else 0)

    def _send(self, sock: zmq.Socket, frames: list) -> None:
        # Block in this thread only; poll so that a dead broker still lets close() finish.
        while True:
            try:
                sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
                return
            except zmq.Again:
                if self._closed and self._q.empty() and not sock.poll(100, zmq.POLLOUT):
                    raise TimeoutError("broker unreachable while closing") from None
                sock.poll(100, zmq.POLLOUT)

    def _drain_replies(self, sock: zmq.Socket) -> None:
        while sock.poll(0, zmq.POLLIN):
            frames = sock.recv_multipart(copy=True)
            try:
                h = wire.decode_header(frames[0])
            except wire.ProtocolError as e:
                log.warning("producer %s: bad reply from broker: %s", self.producer_id, e)
                continue
            if h.kind == "error":
                self.stats.errors_from_broker += 1
                log.error("producer %s: broker refused a message: %s", self.producer_id, h.body.get("reason"))

    def _run_item(self, sock: zmq.Socket, item: tuple, seq: int) -> int:
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
                self._send(sock, [head, payload])
                nbytes = len(payload)
            finally:
                if release is not None:
                    release()
        else:
            _, rid, body, extra = item
            head = wire.pack_header(kind, self.producer_id, self.epoch, seq, rid, body)
            self._send(sock, [head, *extra])
            nbytes = 0
        self.stats.sent_msgs += 1
        self.stats.sent_bytes += nbytes
        return nbytes

    def _loop(self, sock: zmq.Socket) -> None:
        seq = 0
        hb = wire.pack_header("hello", self.producer_id, self.epoch, 0, self.producer_id, {})
        sock.send_multipart([hb])
        next_hb = time.monotonic() + self.heartbeat_interval_s
        while True:
            try:
                item = self._q.get(timeout=self.heartbeat_interval_s)
            except queue.Empty:
                item = None
            now = time.monotonic()
            if now >= next_hb:
                sock.send_multipart([wire.pack_header("heartbeat", self.producer_id, self.epoch, seq,
                                                      self.producer_id, {})], flags=zmq.NOBLOCK) \
                    if sock.poll(0, zmq.POLLOUT) else None
                next_hb = now + self.heartbeat_interval_s
                self._drain_replies(sock)
            if item is None:
                continue
            if item is _STOP:
                return
            seq += 1
            expect = 0
            if item[0] == "delta":
                expect = sum(item[3]) * self.row_bytes
            try:
                self._run_item(sock, item, seq)
            finally:
                self._done_bytes += expect
                self._done_msgs += 1
