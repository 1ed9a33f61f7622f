"""Shared socket-loop helpers: a service thread's start/stop/close, a handler call a bug cannot kill, and the hot
loops' multipart send and receive."""

from __future__ import annotations

import logging
import threading
from typing import Callable, MutableMapping, Sequence

import numpy as np
import zmq

try:                                    # pyzmq's backend socket (Cython, or CFFI on PyPy): what zmq.Socket wraps
    from zmq.backend import Socket as _Backend
    _bsend, _brecv = _Backend.send, _Backend.recv
except (ImportError, AttributeError):  # pragma: no cover - every pyzmq >= 25 has both
    _bsend = _brecv = None
if not hasattr(zmq.Frame, "more"):     # pragma: no cover - recv_frames reads it (else recv_multipart)
    _brecv = None
_SNDMORE = int(zmq.SNDMORE)             # plain ints: an IntFlag `|` builds an enum member each time
_FAST_TYPES = frozenset({bytes, memoryview, zmq.Frame, np.ndarray})


def send_frames(sock: zmq.Socket, frames: Sequence, flags: int = 0) -> None:
    """sock.send_multipart(frames, flags, copy=False), without pyzmq's Python layer around each frame.

    The same calls to the backend (frames under zmq.COPY_THRESHOLD are still copied, larger ones sent zero-copy),
    the same errors (zmq.Again, zmq.ZMQError), without the sugar's per-frame wrapper and IntFlag arithmetic
    (bench/zmq_calls.py compares the two). Frames of any type
    but bytes, memoryview, zmq.Frame or ndarray go through send_multipart, which checks every frame before it
    sends the first (so no message is ever cut short by a frame that cannot be sent)."""
    if _bsend is None or not set(map(type, frames)) <= _FAST_TYPES:
        sock.send_multipart(frames, flags, copy=False)
        return
    flags = int(flags)
    more = flags | _SNDMORE
    last = len(frames) - 1
    for i in range(last):
        _bsend(sock, frames[i], more, False)
    _bsend(sock, frames[last], flags, False)


class MessageTooLarge(ValueError):
    """A multipart message above the receiving socket's total bound; `first`: its first frame's bytes (up to 255:
    a ROUTER's routing id names the peer), `total` and `frames`: what it had."""

    reason = "message_too_large"

    def __init__(self, total: int, frames: int, max_bytes: int, first: bytes):
        super().__init__(f"message of {frames} frames and {total} bytes exceeds {max_bytes} bytes")
        self.total, self.frames, self.first = total, frames, first


def recv_frames(sock: zmq.Socket, flags: int = 0, max_bytes: int | None = None) -> list:
    """sock.recv_multipart(flags, copy=False) (a list of zmq.Frame) without pyzmq's Python layer: each frame's
    `more` flag instead of a getsockopt(RCVMORE) per frame (bench/zmq_calls.py compares the two).

    max_bytes: the message's total bound. Past it, every frame already read is released and the rest are read and
    released one by one (the message is taken off the socket whole, so the next receive starts on a message
    boundary); then MessageTooLarge. (libzmq has delivered the message whole by then: wire.MAX_DATA_MESSAGE_BYTES
    says what that means for memory.)"""
    if _brecv is None:
        parts = sock.recv_multipart(flags, copy=False)
        total = sum(len(f) for f in parts)
        if max_bytes is not None and total > max_bytes:
            raise MessageTooLarge(total, len(parts), max_bytes, parts[0].bytes[:255])
        return parts
    flags = int(flags)
    f = _brecv(sock, flags, False)
    parts = [f]
    total = len(f)
    while f.more:
        f = _brecv(sock, flags, False)
        total += len(f)
        if max_bytes is not None and total > max_bytes:
            first, n = parts[0].bytes[:255], len(parts) + 1
            parts = None                    # released now, not at the end of the message
            while f.more:
                f = _brecv(sock, flags, False)
                total += len(f)
                n += 1
            raise MessageTooLarge(total, n, max_bytes, first)
        parts.append(f)
    if max_bytes is not None and total > max_bytes:
        raise MessageTooLarge(total, 1, max_bytes, parts[0].bytes[:255])
    return parts


def guarded(handler: Callable, args: tuple, bad: MutableMapping[str, int], log: logging.Logger, who: str) -> None:
    """Call handler(*args); an exception it raises on some input is counted in bad["internal_error"] and logged
    with its traceback (the first time and every 1000th), and the loop goes on. The message is then dropped like a
    malformed one: the rows it carried are missing from their records, which say so."""
    try:
        handler(*args)
    except Exception as e:  # noqa: BLE001 (the loop must survive any input; the traceback is logged)
        bad["internal_error"] += 1
        n = bad["internal_error"]
        if n == 1 or n % 1000 == 0:
            log.exception("%s internal error on a message (%d so far): %s", who, n, e)


class ServiceThread:
    """Own the background thread of a socket loop: start it, wait until it is ready, keep its failure, stop it.

    A subclass implements run() (binds or connects its sockets, sets self.ready, serves until self._stop is set,
    closes its sockets) and sets `_service_name` (thread name and log text). Used by the broker and the consumer.
    """

    _service_name = "service"
    _start_timeout_s = 10.0

    def _init_service(self, log: logging.Logger) -> None:
        self._service_log = log
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None
        self.ready = threading.Event()

    @property
    def failure(self) -> BaseException | None:
        """What ended the loop's thread, or None while it has not failed."""
        return self._failure

    @property
    def healthy(self) -> bool:
        """True while the loop's thread runs and has not failed (a liveness probe reads this). A bad message, a
        refused request or a lost peer never makes it False: those are counted in `bad` and the stats."""
        return self._failure is None and self._thread is not None and self._thread.is_alive()

    def run(self) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def start(self):
        """Run the loop on a daemon thread; return once it is ready. RuntimeError, chained, if it failed to start."""
        self._thread = threading.Thread(target=self._run_guarded, name=f"rr-{self._service_name}", daemon=True)
        self._thread.start()
        self.ready.wait(self._start_timeout_s)
        if self._failure is not None:
            raise RuntimeError(f"{self._service_name} failed to start: {self._failure}") from self._failure
        return self

    def _run_guarded(self) -> None:
        try:
            self.run()
        except BaseException as e:
            self._failure = e
            self._service_log.exception("%s failed", self._service_name)
            self.ready.set()

    def stop(self) -> None:
        """Ask the loop to stop (any thread, signal handlers included); close() also waits for it."""
        self._stop.set()

    def _join(self, timeout_s: float) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)


def start_zero_copy_collector() -> bool:
    """Start pyzmq's zero-copy release thread now, at start-up, instead of inside the first zero-copy send (a
    thread, a context and an inproc socket pair: milliseconds on the first message). False where this pyzmq has
    no such thread."""
    try:
        from zmq.utils.garbage import gc
        if not gc.is_alive():
            gc.start()
        return True
    except Exception:  # noqa: BLE001 -- an optimisation only; pyzmq versions differ
        return False
