"""Carry items from the producer's callers to its thread: the FIFO (Inbox) and the count of what waits in it
(QueueLedger)."""

from __future__ import annotations

import queue
import threading
from collections import deque
from typing import Any

STOP = object()                 # the queue's sentinel: close() puts it after the last item


class Inbox:
    """The queue from the caller to the producer's thread: every item in one FIFO, in the order put; only the items
    that need the thread now wake it (`put(item, wake=True)`: steps, close).

    Opens, finishes and aborts are put without waking it (`wake=False`): they wait for the next step, a flush or the
    thread's own timeout (at most Sender.IDLE_WAIT_S). Waking the thread for each one would make it take the GIL
    from the engine thread once per request besides once per step. Their order against the steps is kept: the
    thread takes items in the order they were put."""

    __slots__ = ("_items", "_bell")

    def __init__(self):
        self._items: deque = deque()            # append/popleft: atomic, no lock on the caller's side
        self._bell: queue.SimpleQueue = queue.SimpleQueue()

    def put(self, item: Any, wake: bool = True) -> None:
        self._items.append(item)
        if wake:
            self._bell.put(None)

    def wake(self) -> None:
        """Wake the thread for what is queued (flush, close)."""
        self._bell.put(None)

    def get_nowait(self) -> Any:
        try:
            return self._items.popleft()
        except IndexError:
            raise queue.Empty from None

    def get(self, timeout: float) -> Any:
        """The next item, waiting up to `timeout` s for a wake-up when there is none; queue.Empty if none came."""
        items = self._items
        if not items:
            bell = self._bell
            try:
                bell.get(timeout=timeout)
            except queue.Empty:
                pass
            try:                    # wake-ups of items already in the FIFO: taken now, not woken for again
                while True:
                    bell.get_nowait()
            except queue.Empty:
                pass
        try:
            return items.popleft()
        except IndexError:
            raise queue.Empty from None

    def __len__(self) -> int:
        return len(self._items)


class QueueLedger:
    """Own the count of what waits between the caller and the thread: bytes and messages put (callers, under
    `lock`) and taken (the thread); the difference is the queue, bounded for droppable steps."""

    def __init__(self, lock: threading.Lock):
        self.lock = lock
        self.put_bytes = self.taken_bytes = 0
        self.put_msgs = self.taken_msgs = 0

    def put(self, nbytes: int, bound: int | None, msgs: int = 1) -> bool:
        """Count one item in (`msgs` messages); False (nothing counted) if `bound` is given and the queue would
        pass it."""
        with self.lock:
            if bound is not None and self.put_bytes - self.taken_bytes + nbytes > bound:
                return False
            self.put_bytes += nbytes
            self.put_msgs += msgs
        return True

    def taken(self, nbytes: int) -> None:
        self.taken_bytes += nbytes
        self.taken_msgs += 1

    def shrunk(self, nbytes: int) -> None:
        """An item taken out of the queue carries `nbytes` less than was put (rows its resolution left out)."""
        with self.lock:
            self.put_bytes -= nbytes

    @property
    def bytes(self) -> int:
        return self.put_bytes - self.taken_bytes

    @property
    def msgs(self) -> int:
        return self.put_msgs - self.taken_msgs
