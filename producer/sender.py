"""Run a producer's socket loop in its own thread: send what the intake (producer/intake.py) queued, in seq order,
and hand it every reply and connection event; heartbeat; the only user of the socket."""

from __future__ import annotations

import hashlib
import logging
import math
import queue
import struct
import threading
import time

import zmq

from routing_replay.protocol import security, wire
from routing_replay.protocol.loop import MessageTooLarge, recv_frames, send_frames, start_zero_copy_collector
from routing_replay.producer.books import RequestBook
from routing_replay.producer.inbox import Inbox, QueueLedger
from routing_replay.producer.intake import Intake, SenderSettings
from routing_replay.producer.resend import ReplayBuffer

log = logging.getLogger("routing_replay.producer")


class Sender:
    """Own the producer's DEALER socket, its monitor and the thread that uses them; what goes out and what a reply
    means is its Intake's (`intake`).

    `closing`/`close_deadline` are set by the caller's close() before it puts STOP; a failure of the thread is kept
    in `failure` for the caller to re-raise.
    """

    # the longest the thread sleeps with nothing to send: also the longest an open, finish or abort put without a
    # step behind it waits to be taken (Inbox)
    IDLE_WAIT_S = 0.05

    def __init__(self, cfg: SenderSettings, ctx: zmq.Context, q: Inbox, ledger: QueueLedger,
                 book: RequestBook, replay: ReplayBuffer, stats):
        self.cfg = cfg
        self._ctx = ctx
        self._q = q
        self._replay = replay
        self.closing = False
        self.close_deadline = math.inf
        self.failure: BaseException | None = None
        self.intake = Intake(cfg, q, ledger, book, replay, stats, time.monotonic())
        self._ready = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"rr-producer-{cfg.producer_id}", daemon=True)

    def start(self, timeout_s: float = 10.0) -> None:
        """Start the thread; return once its socket is connecting (or it failed)."""
        self.thread.start()
        self._ready.wait(timeout_s)

    # ---- socket set-up and teardown ----------------------------------------------------------------------------------

    def _run(self) -> None:
        sock = mon = None
        start_zero_copy_collector()     # not inside the first step's send
        try:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, self.cfg.linger_ms)
            sock.setsockopt(zmq.SNDHWM, self.cfg.sndhwm)
            sock.setsockopt(zmq.MAXMSGSIZE, wire.MAX_HEADER_BYTES)
            sock.setsockopt(zmq.IMMEDIATE, 1)            # no connection: EAGAIN, the replay buffer holds it
            # a routing id stable across reconnects, so acks find this producer after a network blip
            sock.setsockopt(zmq.ROUTING_ID, b"P" + hashlib.blake2b(
                f"{self.cfg.producer_id}\0{self.cfg.epoch}".encode(), digest_size=15).digest())
            if self.cfg.curve_secret is not None:
                security.curve_client(sock, self.cfg.curve_secret, self.cfg.server_key)
            mon = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
                                          | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)
            sock.connect(self.cfg.endpoint)
            self._ready.set()
            self._loop(sock, mon)
        except zmq.ContextTerminated:
            pass
        except BaseException as e:  # kept and re-raised on the caller's next call
            self.failure = e
            log.exception("producer %s thread failed", self.cfg.producer_id)
        finally:
            self._ready.set()
            if mon is not None:
                try:
                    sock.disable_monitor()
                except zmq.ZMQError:
                    pass
                mon.close(0)
            if sock is not None:
                sock.close(linger=self.cfg.linger_ms if self.failure is None else 0)
            self._replay.close()

    # ---- the socket loop ---------------------------------------------------------------------------------------------

    def _loop(self, sock: zmq.Socket, mon: zmq.Socket) -> None:
        """Take steps from the queue into the replay buffer, read replies and connection events, send in seq
        order, heartbeat, and on close wait for the acks; every wait is a poll with a timeout."""
        it = self.intake
        start = time.monotonic()
        stash = None                                # an item taken from the queue, waiting for room
        next_hb = start + self.cfg.heartbeat_interval_s
        next_io = 0.0
        while True:
            now = time.monotonic()
            stash = it.take(stash, now)
            if now >= next_io:                      # replies and connection events: per interval, not per step
                self._on_monitor(mon, now)
                self._read(sock, now)
                it.check(now)
                next_io = now + 0.005
            it.tick(now)
            blocked = self._pump(sock, now)
            if now >= next_hb:
                self._send_ctl(sock, "heartbeat", now)
                next_hb = now + self.cfg.heartbeat_interval_s
            if (it.stopping or self.closing) and it.closing_done(now, self.close_deadline):
                if it.bye_due():
                    self._send_ctl(sock, "bye", now)
                return
            wait_s = max(0.0, min(next_hb - now, self.IDLE_WAIT_S))
            held = it.link.data_held(now)
            if self._replay.pending() and not blocked and not held:
                continue                            # the send budget ran out: more to send at once
            if blocked or held:
                sock.poll(int(min(wait_s, 0.02) * 1000) or 1, zmq.POLLIN | (zmq.POLLOUT if blocked else 0))
            elif stash is None and not it.stopping and self._replay.has_room():
                try:
                    stash = self._q.get(timeout=wait_s)
                except queue.Empty:
                    pass
            else:
                sock.poll(int(wait_s * 1000) or 1, zmq.POLLIN)

    def _pump(self, sock: zmq.Socket, now: float) -> bool:
        """Send what waits, in seq order. True if the socket would block (no connection, or send queue full)."""
        it = self.intake
        if it.link.hello_due:
            if not self._send_ctl(sock, "hello", now):
                return True
            it.hello_sent(now)
        for _ in range(1000):
            e = it.next_to_send(now)
            if e is None:
                break
            try:
                send_frames(sock, it.frames(e), zmq.NOBLOCK)
            except zmq.Again:
                return True
            it.sent(e, now)
        return False

    def _send_ctl(self, sock: zmq.Socket, kind: str, now: float) -> bool:
        try:
            sock.send_multipart(self.intake.control(kind, now), zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False

    def _on_monitor(self, mon: zmq.Socket, now: float) -> None:
        """Connection events, to the intake."""
        while mon.poll(0):
            # a monitor message: frame 0 = event (uint16) + value (uint32), native order; frame 1 = endpoint
            # (parsed here: zmq.utils.monitor imports asyncio, slow on the first connection)
            ev = struct.unpack("=H", mon.recv_multipart()[0][:2])[0]
            if ev == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.intake.on_connected(now)
            elif ev == zmq.EVENT_DISCONNECTED:
                self.intake.on_disconnected(now)
            else:
                self.intake.on_handshake_failed(ev == zmq.EVENT_HANDSHAKE_FAILED_AUTH)

    def _read(self, sock: zmq.Socket, now: float) -> None:
        """Replies, to the intake: each one's header frame (a reply too large is handed over as its error)."""
        for _ in range(1000):
            try:
                frames = recv_frames(sock, zmq.NOBLOCK, wire.MAX_CONTROL_MESSAGE_BYTES)
            except zmq.Again:
                return
            except MessageTooLarge as e:
                self.intake.on_reply(e, now)
                continue
            self.intake.on_reply(frames[0].buffer, now)
