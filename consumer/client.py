"""Trainer-side client: fetch finished records by request id (lossless) or subscribe to live ones by prefix."""

from __future__ import annotations

import time
from typing import Iterable, Iterator, Sequence

import zmq

from routing_replay.protocol import security, wire
from routing_replay.protocol.ids import default_peer_id


class RecordEvicted(RuntimeError):
    """The consumer had to evict this record (its store bound was hit, no spill dir) before it was fetched."""


class TrainerClient:
    """Own one DEALER socket per consumer endpoint (sharded consumers each hold a part of the requests).

    `fetch(ids)` asks every consumer; the one that owns a request answers as soon as its record is finished
    (at once if it already is). Outstanding ids are asked again every `retry_interval_s`, so a consumer that
    restarted, or a fetch that raced a reconnect, still answers. Not thread-safe: one thread per client.
    """

    def __init__(self, endpoints: str | Sequence[str], *, context: zmq.Context | None = None,
                 client_id: str | None = None, retry_interval_s: float = 1.0,
                 curve_secret: str | None = None, server_key: str | Sequence[str] | None = None):
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
        self._poller = zmq.Poller()
        for ep, key in zip(self.endpoints, keys):
            s = self._ctx.socket(zmq.DEALER)
            self._socks.append(s)
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
        self._prefix = ""
        self._sub_pending: list = []
        self._early: dict[str, wire.Record] = {}
        self._seq = 0

    def close(self) -> None:
        for s in self._socks:
            s.close(0)
        self._socks = []

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

    def _recv(self, timeout_ms: int) -> tuple[str, object] | None:
        """One reply: ('record', Record) or ('error', (request_id, reason)), or None on timeout."""
        deadline = None if timeout_ms < 0 else time.monotonic() + timeout_ms / 1000
        while True:
            left = -1 if deadline is None else max(0, int((deadline - time.monotonic()) * 1000))
            ready = self._poller.poll(left)
            if not ready:
                return None
            frames = ready[0][0].recv_multipart(copy=False)
            try:
                if len(frames) > 8:
                    raise wire.ProtocolError("frame_count", f"reply of {len(frames)} frames")
                h = wire.decode_header(frames[0].buffer)
                if h.kind == "record":
                    return "record", wire.decode_record(h, frames[1:])
                if h.kind == "error":
                    return "error", (h.key, str(h.body.get("reason", "")))
            except wire.ProtocolError:
                self.bad_replies += 1            # a malformed reply is dropped; fetch asks again for what is missing
            if deadline is not None and time.monotonic() >= deadline:
                return None

    def fetch(self, request_ids: Iterable[str], timeout_s: float = 60.0) -> dict[str, wire.Record]:
        """Return {request_id: Record} for every id; raises TimeoutError naming the ids still missing."""
        want = set(request_ids)
        got = {rid: self._early.pop(rid) for rid in list(want) if rid in self._early}
        deadline = time.monotonic() + timeout_s
        next_ask = 0.0
        while len(got) < len(want):
            now = time.monotonic()
            if now >= deadline:
                missing = sorted(want - set(got))
                raise TimeoutError(f"{len(missing)} of {len(want)} records not received in {timeout_s}s: "
                                   f"{missing[:8]}")
            if now >= next_ask:
                outstanding = sorted(want - set(got))
                for i in range(0, len(outstanding), 4096):
                    self._send_all("fetch", outstanding[i:i + 4096],
                                   {"timeout_ms": int(max(deadline - now, 0.001) * 1000)})
                next_ask = now + self.retry_interval_s
            r = self._recv(int(max(1, min(deadline, next_ask) - now) * 1000) or 1)
            if r is None:
                continue
            kind, val = r
            if kind == "record":
                if val.request_id in want:
                    got[val.request_id] = val
                else:
                    self._early[val.request_id] = val
            elif val[1] == "evicted" and val[0] in want:
                raise RecordEvicted(f"record {val[0]!r} was evicted by its consumer before it was fetched")
        return got

    def subscribe(self, prefix: str = "") -> None:
        """Receive live records whose request id starts with prefix (best effort; fetch is the lossless path)."""
        self._prefix = prefix
        self._sub_pending = self._send_all("hello", self.client_id, {"subscribe": prefix})

    def records(self, timeout_s: float | None = None) -> Iterator[wire.Record]:
        """Yield records as they come (from subscribe); stops after timeout_s without one (None: never)."""
        started = time.monotonic()
        while True:
            wait_ms = -1 if timeout_s is None else int(timeout_s * 1000)
            if self._sub_pending:   # a consumer that was not reachable yet is asked again every 100 ms
                self._sub_pending = self._send_all("hello", self.client_id, {"subscribe": self._prefix},
                                                   self._sub_pending)
                wait_ms = 100 if wait_ms < 0 else min(wait_ms, 100)
            r = self._recv(wait_ms)
            if r is None:
                if self._sub_pending and timeout_s is None:
                    continue
                if self._sub_pending and (time.monotonic() - started < timeout_s):
                    continue
                return
            started = time.monotonic()
            if r[0] == "record":
                yield r[1]
