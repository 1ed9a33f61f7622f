"""State what an engine may hand the producer as a step's rows: an ndarray, or deferred rows (DeferredRows).

A step's rows are (rows, L, K) int16 (wire.ROW_DTYPE), in the step's request order. An engine that has them on the
host hands a C-order ndarray (`publish_rows`, `publish_steps`), which the producer keeps, unmodified by the caller,
until the broker acknowledges it. An engine whose rows are not ready when the step ends (a device-to-host copy in
flight, a ring slot, router tensors still to be cast) hands *deferred rows*: an object that implements
DeferredRows. The producer reads `shape`, `dtype`, `dropped` and `extra_nbytes` on the caller's thread; everything
else runs on the producer's thread, in this order:

    resolve(request_ids, starts, counts)   once, first, only when `deferred` is true
    result() or result_request_major(...)  at most once (never for `dropped` rows)
    release()                              exactly once, whatever happened (also for dropped rows, refused steps,
                                           and when the queue bound dropped the step on the caller's thread)

The producer never names an engine: an engine's class implements the contract by subclassing `RowsBase` (which
supplies the defaults below), and a caller's object that implements part of it (shape, dtype and result() at
least) is wrapped in `CallerRows` at publish time (`deferred_rows`), which supplies the rest; anything else is
refused there with a TypeError naming what is missing.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from routing_replay.producer.outpool import reorder_request_major


class RowsLost(RuntimeError):
    """Rows a deferred rows object could not deliver for lack of room or time (a ring read that fell behind, a full
    host ring): reported lost in the requests' finishes like a step the queue bound dropped. Any other error from
    its result() is a refusal: the rows failed a check (reported lost and refused)."""


class DeferredRows(Protocol):
    """What the producer reads and calls on rows that are not an ndarray (the module docstring gives the order)."""

    shape: tuple
    """(rows, L, K): rows of the whole step (of all its steps, for publish_steps); after resolve(), the rows it kept.
    The producer counts shape[0] * L * K * 2 bytes against its queue bound."""
    dtype: np.dtype
    """wire.ROW_DTYPE (int16); checked at publish time."""
    dropped: bool
    """True when capture could not keep the rows (its host ring was full): the step is never waited on; its
    positions are reported lost in each request's finish. Read on the caller's thread."""
    owns_result: bool
    """True when result() returns an array of its own (kept after release()); False when it is a view of memory
    that release() gives back (a ring slot): the producer then copies it before release()."""
    extra_nbytes: int
    """Bytes the object holds beyond its int16 rows until the producer's thread takes it (router tensors not yet
    cast): counted against the queue bound with its rows, given back when the thread takes the step."""
    deferred: bool
    """True when the step's ids, starts and counts are the engine's own until resolve() runs (the producer's thread
    calls it before anything else); False: they are the records' already."""

    def resolve(self, request_ids: list, starts: list, counts: list) -> tuple[list, list, list]:
        """Per step: the request ids, starts and counts the records use (record keys, positions), from what was
        published with the rows (engine ids and layouts). A request with no record for the step is left out, and
        so are its rows (`shape` shrinks). Raises when the layout does not resolve (the step is dropped, its rows
        released, and the stream goes on)."""

    def result(self) -> np.ndarray:
        """The rows, (shape[0], L, K) int16 in the step's order (waiting for a copy in flight). Raises RowsLost for
        rows lost for lack of room or time (reported lost), anything else for rows that failed a check (reported
        lost and refused)."""

    def result_request_major(self, steps: int, inverse: np.ndarray | None = None) -> np.ndarray:
        """For `steps` steps of n rows each: request i's rows of every step in a row, then request i + 1's (with
        `inverse`, request i goes to place inverse[i]), as a new array of the caller's own; raises as result()."""

    def release(self) -> None:
        """Give back what the rows occupy (a ring slot, pinned memory); called exactly once."""


class RowsBase:
    """Implement DeferredRows' optional members with their defaults; a subclass supplies shape, dtype and result().

    Defaults: not dropped, result() a view of memory release() gives back (owns_result False), nothing held beyond
    the rows, ids that need no resolving, request-major rows as a reordering copy of result(), nothing to
    release."""

    __slots__ = ()
    dropped = False
    owns_result = False
    extra_nbytes = 0
    deferred = False

    def resolve(self, request_ids: list, starts: list, counts: list) -> tuple[list, list, list]:
        return request_ids, starts, counts

    def result_request_major(self, steps: int, inverse: np.ndarray | None = None) -> np.ndarray:
        return reorder_request_major(np.asarray(self.result()), steps, inverse)

    def release(self) -> None:
        pass


_REQUIRED = ("shape", "dtype", "result")


class CallerRows(RowsBase):
    """Own nothing: present a caller's object that implements part of DeferredRows (shape, dtype, result() at
    least) as the whole of it, each member it lacks taking RowsBase's default."""

    __slots__ = ("rows", "_release", "_direct", "_resolve")

    def __init__(self, rows: Any):
        missing = [name + ("()" if name == "result" else "") for name in _REQUIRED if getattr(rows, name, None) is None]
        if not missing and not callable(rows.result):
            missing.append("result()")
        resolve = getattr(rows, "resolve", None)
        if getattr(rows, "deferred", False) and not callable(resolve):
            missing.append("resolve() (it says deferred=True)")
        release = getattr(rows, "release", None)
        if release is not None and not callable(release):
            missing.append("a callable release")
        if missing:
            raise TypeError(f"rows of type {type(rows).__qualname__} are neither an ndarray nor deferred rows: "
                            f"missing {', '.join(missing)} (producer/handover.py, DeferredRows)")
        self.rows = rows
        self._release = release
        self._direct = getattr(rows, "result_request_major", None)
        self._resolve = resolve

    def __repr__(self) -> str:
        return f"CallerRows({self.rows!r})"

    @property
    def shape(self) -> tuple:
        return tuple(self.rows.shape)

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.rows.dtype)

    @property
    def owns_result(self) -> bool:
        # without release() nothing is given back: its result() stays valid, as an array of its own would
        return self._release is None or bool(getattr(self.rows, "owns_result", False))

    @property
    def extra_nbytes(self) -> int:
        return int(getattr(self.rows, "extra_nbytes", 0) or 0)

    @property
    def dropped(self) -> bool:
        return bool(getattr(self.rows, "dropped", False))

    @property
    def deferred(self) -> bool:
        return self._resolve is not None and bool(getattr(self.rows, "deferred", False))

    def resolve(self, request_ids: list, starts: list, counts: list) -> tuple[list, list, list]:
        if self._resolve is None:
            return request_ids, starts, counts
        return self._resolve(request_ids, starts, counts)

    def result(self) -> np.ndarray:
        return self.rows.result()

    def result_request_major(self, steps: int, inverse: np.ndarray | None = None) -> np.ndarray:
        if self._direct is None:
            return reorder_request_major(np.asarray(self.rows.result()), steps, inverse)
        return self._direct(steps) if inverse is None else self._direct(steps, inverse)

    def release(self) -> None:
        if self._release is not None:
            self._release()


def deferred_rows(rows: Any) -> RowsBase:
    """`rows` (anything but an ndarray) as DeferredRows: itself when its class subclasses RowsBase, else wrapped in
    CallerRows (TypeError naming what it lacks)."""
    if isinstance(rows, RowsBase):
        return rows
    return CallerRows(rows)


def release(rows: Any) -> None:
    """Release `rows` if they are deferred (an ndarray holds nothing to give back)."""
    if not isinstance(rows, np.ndarray):
        rows.release()
