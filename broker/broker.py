"""Route wire-v1 messages from producers to the consumer that owns each request id.

Sockets: `frontend` ROUTER (producers' DEALERs connect), `backend` ROUTER (consumers' DEALERs connect and
announce themselves with hello/heartbeat). Ownership: a request id is assigned when first seen, by rendezvous
hashing over the live consumers, and stays with that consumer until its finish/abort (sticky), so adding a
consumer never moves an in-flight request. A delta that spans requests of several consumers is split: each
owner gets a re-encoded header with its requests and the matching slices of the payload, forwarded zero-copy
(large runs) or gathered into one frame (rows smaller than COPY_THRESHOLD on average, e.g. decode steps).

A consumer that stops heartbeating for `liveness` intervals is dropped. Its in-flight requests are reassigned
to a live consumer on their next message; the new owner gets the request's open header marked
`reassigned: true` and emits the record as incomplete (reason "consumer_lost") unless every row arrives anyway.
When no consumer is live, messages wait in a bounded queue (max_pending_bytes) and are routed when one joins.
"""

from __future__ import annotations

import logging
import threading
import time
import zlib
from collections import defaultdict, deque
from dataclasses import dataclass

import msgpack
import numpy as np
import zmq

from routing_replay import wire

log = logging.getLogger("routing_replay.broker")


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


def _hrw(rid: bytes, consumers: list[bytes]) -> bytes:
    best, best_score = consumers[0], -1
    for c in consumers:
        s = zlib.crc32(rid, zlib.crc32(c))
        if s > best_score:
            best, best_score = c, s
    return best


class Broker:
    """Own the frontend and backend sockets, the live-consumer table and the request -> consumer table.

    Sockets are created and used only by the thread running `run()`.
    """

    def __init__(self, frontend: str, backend: str, *, context: zmq.Context | None = None,
                 heartbeat_interval_ms: int = 1000, liveness: int = 3, stats_interval_s: float = 10.0,
                 max_pending_bytes: int = 512 << 20, max_open_requests: int = 1 << 20, hwm: int = 100_000):
        self.frontend = frontend
        self.backend = backend
        self._ctx = context or zmq.Context.instance()
        self.heartbeat_interval_s = heartbeat_interval_ms / 1000
        self.liveness = liveness
        self.stats_interval_s = stats_interval_s
        self.max_pending_bytes = max_pending_bytes
        self.max_open_requests = max_open_requests
        self.hwm = hwm
        self.stats = BrokerStats()
        self.bad: dict[str, int] = defaultdict(int)
        self.consumers: dict[bytes, float] = {}       # id -> last seen (monotonic)
        self._live: list[bytes] = []
        self._live_set: frozenset = frozenset()
        self.owner: dict[str, bytes] = {}              # request id -> consumer id
        self._open_hdr: dict[str, bytes] = {}          # request id -> its open header (for reassignment)
        self.producers: dict[bytes, float] = {}
        self._pending: deque = deque()
        self._pending_bytes = 0
        self._warned: set = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None
        self.ready = threading.Event()
        self._back = None
        self._front = None

    # ---- lifecycle ----------------------------------------------------------------------------------------------

    def start(self) -> "Broker":
        self._thread = threading.Thread(target=self._run_guarded, name="rr-broker", daemon=True)
        self._thread.start()
        self.ready.wait(10)
        if self._failure is not None:
            raise RuntimeError(f"broker failed to start: {self._failure}") from self._failure
        return self

    def _run_guarded(self) -> None:
        try:
            self.run()
        except BaseException as e:
            self._failure = e
            log.exception("broker failed")
            self.ready.set()

    def stop(self) -> None:
        self._stop.set()

    def close(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def bind(self) -> None:
        """Create and bind both sockets (in the calling thread, which must then call serve())."""
        self._front = self._ctx.socket(zmq.ROUTER)
        self._back = self._ctx.socket(zmq.ROUTER)
        for s in (self._front, self._back):
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.ROUTER_MANDATORY, 1)
            s.setsockopt(zmq.SNDHWM, self.hwm)
            s.setsockopt(zmq.RCVHWM, self.hwm)
            s.setsockopt(zmq.MAXMSGSIZE, wire.MAX_MESSAGE_BYTES)
        self._front.bind(self.frontend)
        self._back.bind(self.backend)
        self.frontend = self._front.getsockopt_string(zmq.LAST_ENDPOINT)
        self.backend = self._back.getsockopt_string(zmq.LAST_ENDPOINT)

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
            self.ready.set()
            log.info("broker frontend=%s backend=%s", self.frontend, self.backend)
            now = time.monotonic()
            next_hb = now + self.heartbeat_interval_s
            next_stats = now + self.stats_interval_s
            while not self._stop.is_set():
                events = dict(poller.poll(100))
                if back in events:
                    while True:
                        try:
                            frames = back.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        self._on_backend(frames, time.monotonic())
                if front in events:
                    for _ in range(10_000):
                        try:
                            frames = front.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        self._on_frontend(frames)
                now = time.monotonic()
                if now >= next_hb:
                    self._expire_consumers(now)
                    next_hb = now + self.heartbeat_interval_s
                if now >= next_stats:
                    self.log_stats()
                    next_stats = now + self.stats_interval_s
        except zmq.ContextTerminated:
            pass
        finally:
            self.ready.set()
            front.close(0)
            back.close(0)
            self.log_stats()

    def log_stats(self) -> None:
        s = self.stats
        log.info("broker msgs_in=%d MB_in=%.1f msgs_out=%d MB_out=%.1f split=%d open_requests=%d consumers=%d "
                 "producers=%d reassigned=%d pending=%d dropped_no_consumer=%d dropped_slow=%d "
                 "dropped_unreachable=%d bad=%d %s", s.msgs_in, s.bytes_in / 1e6, s.msgs_out, s.bytes_out / 1e6,
                 s.deltas_split, len(self.owner), len(self._live), len(self.producers), s.reassigned,
                 len(self._pending), s.dropped_no_consumer, s.dropped_slow_consumer, s.dropped_unreachable,
                 sum(self.bad.values()), dict(self.bad) if self.bad else "")

    # ---- consumers ----------------------------------------------------------------------------------------------

    def _set_live(self) -> None:
        self._live = sorted(self.consumers)
        self._live_set = frozenset(self._live)

    def _on_backend(self, frames: list, now: float) -> None:
        cid = frames[0].bytes
        try:
            if len(frames) != 2:
                raise wire.ProtocolError("frame_count", f"consumer sent {len(frames) - 1} frames, expected 1")
            h = wire.decode_header(frames[1].buffer)
        except wire.ProtocolError as e:
            self._bad(e, cid, self._back)
            return
        if h.kind in ("hello", "heartbeat"):
            new = cid not in self.consumers
            self.consumers[cid] = now
            if new:
                self._set_live()
                log.info("broker consumer joined id=%s consumers=%d", cid.decode(errors="replace"), len(self._live))
                self._flush_pending()
        elif h.kind == "bye":
            if self.consumers.pop(cid, None) is not None:
                self._set_live()
                log.info("broker consumer left id=%s consumers=%d", cid.decode(errors="replace"), len(self._live))
        elif h.kind == "ack":
            pass
        else:
            self._bad(wire.ProtocolError("unexpected_kind", f"consumer sent {h.kind!r}"), cid, self._back)

    def _expire_consumers(self, now: float) -> None:
        cutoff = now - self.liveness * self.heartbeat_interval_s
        dead = [c for c, t in self.consumers.items() if t < cutoff]
        for c in dead:
            seen = self.consumers.pop(c)
            n = sum(1 for o in self.owner.values() if o == c)
            log.warning("broker consumer expired id=%s silent_s=%.1f in_flight_requests=%d consumers=%d",
                        c.decode(errors="replace"), now - seen, n, len(self.consumers))
        if dead:
            self._set_live()
        cutoff_p = now - 10 * self.heartbeat_interval_s
        for p in [p for p, t in self.producers.items() if t < cutoff_p]:
            del self.producers[p]

    # ---- producers ----------------------------------------------------------------------------------------------

    def _bad(self, e: wire.ProtocolError, peer: bytes, sock) -> None:
        self.bad[e.reason] += 1
        n = self.bad[e.reason]
        if n == 1 or n % 1000 == 0:
            log.warning("broker dropped a bad message from %r (%s, %d so far): %s", peer[:48], e.reason, n, e)
        if (peer, e.reason) not in self._warned and len(self._warned) < 10_000:
            self._warned.add((peer, e.reason))
            try:
                sock.send_multipart([peer, wire.pack_header("error", "broker", 0, 0, "", {"reason": f"{e.reason}: {e}"[:300]})],
                                    zmq.NOBLOCK)
            except zmq.ZMQError:
                pass

    def _on_frontend(self, frames: list) -> None:
        st = self.stats
        st.msgs_in += 1
        pid = frames[0].bytes
        try:
            if len(frames) < 2 or len(frames) > wire.MAX_FRAMES:
                raise wire.ProtocolError("frame_count", f"message has {len(frames) - 1} frames")
            h = wire.decode_header(frames[1].buffer)
            kind = h.kind
            if kind == "delta":
                self._route_delta(h, frames)
            elif kind in wire.REQUEST_KINDS:
                self._route_request(h, frames)
            elif kind in ("hello", "heartbeat"):
                if pid not in self.producers and kind == "hello":
                    log.info("broker producer joined id=%s", h.producer[:64])
                self.producers[pid] = time.monotonic()
            elif kind == "bye":
                self.producers.pop(pid, None)
            else:
                raise wire.ProtocolError("unexpected_kind", f"producers do not send {kind!r}")
        except wire.ProtocolError as e:
            self._bad(e, pid, self._front)

    def _assign(self, rid: str) -> bytes:
        owner = _hrw(rid.encode("utf-8", "surrogatepass"), self._live)
        if len(self.owner) >= self.max_open_requests:
            old = next(iter(self.owner))
            del self.owner[old]
            self._open_hdr.pop(old, None)
        self.owner[rid] = owner
        return owner

    def _owner_of(self, rid: str) -> bytes:
        o = self.owner.get(rid)
        if o is None:
            return self._assign(rid)
        if o in self._live_set:
            return o
        new = self._assign(rid)
        self.stats.reassigned += 1
        hdr = self._open_hdr.get(rid)
        if hdr is not None:
            h = msgpack.unpackb(hdr, raw=False)
            h[6] = dict(h[6], reassigned=True, n_prompt_tokens=0)
            self._send(new, [msgpack.packb(h, use_bin_type=True)])
        return new

    def _route_request(self, h: wire.Header, frames: list) -> None:
        rid = wire._request_id(h.key)
        if not self._live:
            return self._hold(frames)
        if h.kind == "open":
            wire.parse_open(h)
            self.stats.requests_opened += 1
            owner = self._owner_of(rid)
            self._open_hdr[rid] = frames[1].bytes
        else:
            owner = self._owner_of(rid)
            self.owner.pop(rid, None)
            self._open_hdr.pop(rid, None)
            self.stats.requests_closed += 1
        self._send(owner, frames[1:])

    def _route_delta(self, h: wire.Header, d_frames: list) -> None:
        d = wire.parse_delta(h)
        payload = d_frames[2:]
        wire.check_payload(d, payload)
        self.stats.bytes_in += d.total_rows * d.row_bytes
        if not self._live:
            return self._hold(d_frames)
        ids = d.request_ids
        owners = list(map(self.owner.get, ids))
        uniq = set(owners)
        if None in uniq or not uniq <= self._live_set:
            owners = [self._owner_of(r) for r in ids]
            uniq = set(owners)
        if len(uniq) == 1:
            self._send(owners[0], d_frames[1:])          # untouched, zero-copy
            return
        self.stats.deltas_split += 1
        self._split(h, d, owners, uniq, payload)

    def _split(self, h: wire.Header, d: wire.Delta, owners: list, uniq: set, payload: list) -> None:
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
                parts = [np.frombuffer(mv, dtype=np.uint8).reshape(-1, per)[idx]]
            else:
                parts = [b"".join(mv[a:b] for a, b in zip(a_bytes.tolist(), b_bytes.tolist()))]
            self._send(o, [head, *parts])

    def _send(self, owner: bytes, frames: list) -> None:
        try:
            self._back.send_multipart([owner, *frames], zmq.NOBLOCK, copy=False)
            st = self.stats
            st.msgs_out += 1
        except zmq.Again:
            self.stats.dropped_slow_consumer += 1
            n = self.stats.dropped_slow_consumer
            if n == 1 or n % 1000 == 0:
                log.warning("broker consumer %s is slow (send queue full): dropped=%d messages; their requests "
                            "will be marked incomplete", owner.decode(errors="replace"), n)
        except zmq.ZMQError as e:
            if e.errno != zmq.EHOSTUNREACH:
                raise
            self.stats.dropped_unreachable += 1
            if self.consumers.pop(owner, None) is not None:
                self._set_live()
                log.warning("broker consumer unreachable id=%s consumers=%d", owner.decode(errors="replace"),
                            len(self._live))

    # ---- no consumer yet ----------------------------------------------------------------------------------------

    def _hold(self, frames: list) -> None:
        n = sum(len(f.buffer) for f in frames[1:])
        if self._pending_bytes + n > self.max_pending_bytes:
            self.stats.dropped_no_consumer += 1
            c = self.stats.dropped_no_consumer
            if c == 1 or c % 1000 == 0:
                log.warning("broker has no consumer and %d bytes pending: dropped=%d messages", self._pending_bytes, c)
            return
        self._pending.append(frames)
        self._pending_bytes += n

    def _flush_pending(self) -> None:
        if not self._pending:
            return
        pending, self._pending = self._pending, deque()
        self._pending_bytes = 0
        log.info("broker routing %d messages held while no consumer was live", len(pending))
        for frames in pending:
            self.stats.msgs_in -= 1
            self._on_frontend(frames)
