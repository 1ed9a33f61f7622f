"""Turn the caller's per-step references into one Step: decode steps of one batch merged into one entry per
request (its rows request-major), and each owner's requests together (OwnerHints, from the broker's acks)."""

from __future__ import annotations

from itertools import chain
from typing import Any, NamedTuple, Sequence

import numpy as np

from routing_replay.protocol import wire
from routing_replay.producer.handover import RowsBase
from routing_replay.producer.items import Step, flat_ids, flat_ints
from routing_replay.producer.outpool import reorder_request_major, request_major


class StepParts(NamedTuple):
    """Consecutive steps as the caller kept them (Producer.publish_steps): per step its list of request ids (steps
    may share one list) and its starts and counts (lists or 1-D integer arrays); `rows` all their rows in order.
    The producer's thread turns it into one Step (`step()`), so the caller's thread touches nothing per request."""

    request_ids: list
    starts: list
    counts: list
    rows: Any

    def step(self, hints: OwnerHints | None = None) -> Step:
        parts = self
        rows = self.rows
        if not isinstance(rows, np.ndarray) and rows.deferred:     # engine ids: the records' keys, starts, counts now
            parts = StepParts(*rows.resolve(self.request_ids, self.starts, self.counts), rows)
        merged = merge_decode_steps(parts, hints)
        if merged is not None:
            return merged
        return Step(flat_ids(parts.request_ids), flat_ints(parts.starts), flat_ints(parts.counts), self.rows, None)


class OwnerHints:
    """Which consumer owns each request, as far as the broker told this producer (owner groups on its acks), and
    the order that puts one owner's requests next to each other in a delta, kept per id list.

    A delta whose requests of one owner are contiguous is split by the broker into one slice of the received
    payload per owner, sent without copying; requests interleaved across owners make it gather each owner's rows
    into a new frame. The producer's thread reorders merged decode steps (the vLLM plugin's message) in the copy
    it makes anyway (RequestMajor), so the broker's copy goes away. Hints are advice: a missing or stale one only
    costs that gather, never correctness."""

    __slots__ = ("groups", "version", "_last")

    MAX_REQUESTS = 1 << 20          # beyond this many (finishes lost?) the table starts over

    def __init__(self):
        self.groups: dict = {}      # request id -> owner group
        self.version = 0
        self._last = (None, -1, None)

    def update(self, ids: list, groups: list) -> None:
        if len(self.groups) + len(ids) > self.MAX_REQUESTS:
            self.groups.clear()
        self.groups.update(zip(ids, groups))
        self.version += 1

    def forget(self, rid: str) -> None:
        """`rid` ended (its later deltas do not exist: cached orders of lists that hold it stay right)."""
        self.groups.pop(rid, None)

    def order(self, ids: list):
        """(order, inverse) that groups `ids` by owner (stable: unknown owners first, then by group, each group in
        its original order), or None when they are grouped already or nothing is known. Cached for the same list
        object, or an equal list, while no hint arrived."""
        last_ids, version, cached = self._last
        # the same list, or an equal one (publish_rows copies the caller's list every step): a C-speed compare of
        # the same str objects
        if version == self.version and (last_ids is ids or last_ids == ids):
            return cached
        out = None
        groups = self.groups
        if groups and len(ids) > 1:
            get = groups.get
            g = np.fromiter((get(r, -1) for r in ids), dtype=np.int64, count=len(ids))
            changes = int(np.count_nonzero(g[1:] != g[:-1]))
            if changes and changes + 1 > len(np.unique(g)):      # some group is split into several runs
                order = np.argsort(g, kind="stable")
                inverse = np.empty_like(order)
                inverse[order] = np.arange(len(order))
                out = (order, inverse)
        self._last = (ids, self.version, out)
        return out


def merge_decode_steps(parts: StepParts, hints: OwnerHints | None = None) -> Step | None:
    """Consecutive decode steps of one unchanged batch (every step the same id list, one row per request, each
    request one position further than in the step before) as one entry per request: its rows of all the steps
    in a row, at its first position. The records are the same; the delta carries n entries instead of steps x n
    (the header's id list, the broker's split and the consumer's scatter work per entry, and each request's rows
    move as one run instead of one row at a time). The rows are reordered step-major -> request-major in the one
    copy the producer's thread makes anyway (RequestMajor). None when the steps are not like that."""
    ids = parts.request_ids
    k = len(ids)
    if k < 2:
        return None
    first = ids[0]
    n = len(first)
    if not n or any(x is not first and x != first for x in ids):
        return None
    if all(type(c) is list for c in parts.counts) and all(type(x) is list for x in parts.starts):
        # publish_rows' lists (Python ints): counted and read in C loops (list.count, not a Python loop per entry)
        if not all(len(c) == n and c.count(1) == n for c in parts.counts):
            return None
        if not all(len(x) == n for x in parts.starts):
            return None
        try:
            starts = np.fromiter(chain.from_iterable(parts.starts), dtype=np.int64, count=k * n).reshape(k, n)
        except (TypeError, ValueError, OverflowError):
            return None
    else:
        try:
            counts = np.asarray(parts.counts, dtype=np.int64)
            starts = np.asarray(parts.starts, dtype=np.int64)
        except ValueError:              # ragged: the steps differ
            return None
        if counts.shape != (k, n) or starts.shape != (k, n) or not (counts == 1).all():
            return None
    if not (starts == starts[0] + np.arange(k, dtype=np.int64)[:, None]).all():
        return None
    grouped = hints.order(first) if hints is not None else None
    if grouped is None:
        return Step(list(first), starts[0].tolist(), [k] * n, RequestMajor(parts.rows, k), None)
    order, inverse = grouped              # requests of one owner together (OwnerHints), in the same one copy
    return Step([first[i] for i in order.tolist()], starts[0][order].tolist(), [k] * n,
                RequestMajor(parts.rows, k, inverse), None)


def merge_coalesced_steps(items: Sequence[Step], row_shape: tuple, hints: OwnerHints | None = None) -> Step | None:
    """Steps published one by one (publish_rows, the caller's arrays) that queued up behind the producer's thread
    and go out as one message: when they are decode steps of one unchanged batch (as merge_decode_steps wants),
    one entry per request, its rows of every step in a row (and each owner's requests together, with `hints`),
    in one copy. None when they are not like that, or a step was screened or holds deferred rows."""
    if len(items) < 2:
        return None
    first = items[0].request_ids
    n = len(first)
    arrays = []
    for it in items:
        rows = it.rows
        if (it.keep is not None or type(rows) is not np.ndarray or rows.dtype != wire.ROW_DTYPE
                or rows.shape != (n, *row_shape)):
            return None
        arrays.append(rows)
    return merge_decode_steps(StepParts([it.request_ids for it in items], [it.starts for it in items],
                                        [it.counts for it in items], StepRows(arrays)), hints)


class StepRows(RowsBase):
    """The rows of consecutive steps as the caller handed them, one (n, L, K) array per step: step-major through
    result(), request-major through result_request_major() in one copy (merge_coalesced_steps)."""

    __slots__ = ("_arrays", "shape", "dtype", "dropped")
    owns_result = True

    def __init__(self, arrays: list):
        self._arrays = arrays
        a = arrays[0]
        self.shape = (sum(len(x) for x in arrays), *a.shape[1:])
        self.dtype = a.dtype
        self.dropped = False

    def result(self) -> np.ndarray:
        return np.concatenate(self._arrays)

    def result_request_major(self, steps: int, inverse: np.ndarray | None = None) -> np.ndarray:
        return request_major(self._arrays, inverse)


class RequestMajor(RowsBase):
    """Deferred rows of `steps` steps of n rows each (step-major, as the caller handed them: an ndarray or deferred
    rows) handed out request-major: request i's rows of every step, then request i + 1's. One copy: the deferred
    rows' own `result_request_major(steps, inverse)`, or a reordering copy of the ndarray. The result is the
    caller's own array (`owns_result`), not a view of the source's memory."""

    __slots__ = ("_rows", "_steps", "_inverse", "shape", "dtype", "dropped")
    owns_result = True

    def __init__(self, rows: Any, steps: int, inverse: np.ndarray | None = None):
        # inverse: request i of each step goes to place inverse[i] (OwnerHints.order), else the steps' order
        self._rows, self._steps, self._inverse = rows, steps, inverse
        self.shape = tuple(rows.shape)
        self.dtype = rows.dtype
        self.dropped = not isinstance(rows, np.ndarray) and bool(rows.dropped)

    def result(self) -> np.ndarray:
        rows = self._rows
        if isinstance(rows, np.ndarray):
            return reorder_request_major(rows, self._steps, self._inverse)
        return rows.result_request_major(self._steps, self._inverse)

    def release(self) -> None:
        if not isinstance(self._rows, np.ndarray):
            self._rows.release()
