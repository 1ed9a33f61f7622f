"""Name what the producer's caller hands its thread (Announce, Step), encode them, and keep per-request books.

Socket-free: `encode_announce`/`encode_step` turn a queue item into wire frames (tested on bytes alone);
`RequestBook` holds the caller-side per-request state (lost ranges, refused ids, ids known to travel).
"""

from __future__ import annotations

import os
import queue
import sys
import threading
from collections import deque
from itertools import chain
from typing import Any, Iterable, NamedTuple, Sequence

import numpy as np

from routing_replay.protocol import wire
from routing_replay.producer.replay import Parts

try:                    # setup.py builds it where a C compiler and Python's headers are (optional: numpy otherwise)
    from routing_replay.producer import _gather
except ImportError:
    _gather = None
# ROUTING_REPLAY_NATIVE=0: the numpy copy even where the C one is built (benchmarks side by side, tests)
NATIVE = _gather is not None and os.environ.get("ROUTING_REPLAY_NATIVE", "1") != "0"


class Announce(NamedTuple):
    """open / finish / abort of one request, as the caller built it."""

    kind: str
    request_id: str
    body: dict
    frames: list              # token-id arrays (open: prompt, finish: output), possibly empty


class Announces(NamedTuple):
    """Several opens or finishes/aborts put in one call (Producer.open_many / end_many): `build(items)`, called on
    the producer's thread, returns their Announce items, in order."""

    build: Any
    items: list


class Step(NamedTuple):
    """One engine step (or a batch of them): request_ids[i] gets counts[i] rows at starts[i]...

    `rows` is an ndarray or a deferred object (result(), release(), dropped); `keep`, when not None, says which
    request parts travel (the others were refused on the caller's thread and are cut out after result()).
    """

    request_ids: list
    starts: list
    counts: list
    rows: Any
    keep: list | None = None


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
        if getattr(self.rows, "deferred", False):   # the worker's raw steps: their keys, starts and counts now
            parts = StepParts(*self.rows.resolve(self.request_ids, self.starts, self.counts), self.rows)
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


class StepRows:
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


class OutPool:
    """Memory for the producer thread's request-major copies, used again once nothing refers to it.

    A merged message's rows are a fresh array of megabytes that the replay buffer holds until the consumers ack it;
    a fresh allocation of that size comes from the OS every time, and its first touch (a page fault per 4 KiB) costs
    several times the copy itself into memory in use (docs/PERFORMANCE.md, "Copies into reused memory"). So each
    copy of at least MIN_BYTES goes
    into a view of a pooled root (a 1-D uint8 array, sized up to GRAIN). A root is reused only when CPython counts
    no reference to it but the pool's own: every view of it, every memoryview or ZeroMQ frame made from one, holds
    the root (numpy views refer to the array that owns the memory), so a root still sent, kept for replay, spilled
    or handed to a caller is never written. Beyond MAX_FREE_BYTES of free roots the longest idle go back to the OS.
    One pool per thread (`out_pool()`): no lock."""

    MIN_BYTES = 256 << 10
    GRAIN = 1 << 20
    MAX_FREE_BYTES = 64 << 20

    def __init__(self):
        self.lent: list = []                # roots handed out as views
        self.free: list = []                # roots nothing else refers to
        self.free_bytes = 0
        self.reused = 0                     # takes served from a free root

    @staticmethod
    def _unreferenced(roots: list) -> list:
        """Indexes of the roots that only `roots` refers to."""
        return [i for i, c in enumerate(_refcounts(roots)) if c <= _BASE]

    def _collect(self) -> None:
        idle = set(self._unreferenced(self.lent))
        if not idle:
            return
        keep, free = [], self.free
        for i, r in enumerate(self.lent):
            (free if i in idle else keep).append(r)
        self.lent = keep
        self.free_bytes = sum(r.nbytes for r in free)
        while self.free_bytes > self.MAX_FREE_BYTES:      # the longest idle go back to the OS
            self.free_bytes -= free.pop(0).nbytes

    def empty(self, shape: tuple, dtype) -> np.ndarray:
        """An uninitialised C-order array of `shape`, from a pooled root when it is large."""
        dtype = np.dtype(dtype)
        nbytes = dtype.itemsize * int(np.prod(shape))
        if nbytes < self.MIN_BYTES:
            return np.empty(shape, dtype)
        self._collect()
        root = None
        for i, r in enumerate(self.free):
            if nbytes <= r.nbytes <= 2 * nbytes:
                root = self.free.pop(i)
                self.free_bytes -= root.nbytes
                self.reused += 1
                break
        if root is None:
            root = np.empty(-(-nbytes // self.GRAIN) * self.GRAIN, np.uint8)
        self.lent.append(root)
        return root[:nbytes].view(dtype).reshape(shape)


def _refcounts(roots: list) -> list:
    return [sys.getrefcount(r) for r in roots]


# what _refcounts reports for an array that only its list refers to (measured, not assumed: the same code)
_BASE = _refcounts([np.empty(1, np.uint8)])[0]
_pools = threading.local()


def out_pool() -> OutPool:
    """This thread's OutPool."""
    p = getattr(_pools, "pool", None)
    if p is None:
        p = _pools.pool = OutPool()
    return p


def request_major(arrays: list, inverse: np.ndarray | None = None, native: bool | None = None) -> np.ndarray:
    """Steps of n rows each (one (n, L, K) array per step) as one new C-order array, request-major: request i's rows
    of every step in a row, then request i + 1's; with `inverse`, request i goes to place inverse[i]. One copy, into
    memory of this thread's OutPool: in C (_gather: one sequential pass, streaming stores, the GIL released) where
    it is built and the steps are C-contiguous arrays of one shape and dtype, else numpy. `native`: force one
    (tests, benchmarks); None: NATIVE."""
    a0 = arrays[0]
    n = a0.shape[0]
    out = out_pool().empty((n, len(arrays), *a0.shape[1:]), a0.dtype)
    if (NATIVE if native is None else native) and n and a0.itemsize and _same_contiguous(arrays):
        _gather.gather_rows(out, arrays, _order_of(inverse, n), a0.nbytes // n)
    elif inverse is None:
        np.stack(arrays, axis=1, out=out)
    else:
        for s, a in enumerate(arrays):
            out[inverse, s] = a
    return out.reshape(n * len(arrays), *a0.shape[1:])


def _same_contiguous(arrays: list) -> bool:
    a0 = arrays[0]
    shape, dtype = a0.shape, a0.dtype
    return all(type(a) is np.ndarray and a.flags.c_contiguous and a.shape == shape and a.dtype == dtype
               for a in arrays)


def _order_of(inverse: np.ndarray | None, n: int) -> np.ndarray:
    """The source row of each place: order[inverse[i]] = i (int64), or 0..n-1 without `inverse`."""
    if inverse is None:
        return np.arange(n, dtype=np.int64)
    order = np.empty(n, np.int64)
    order[inverse] = np.arange(n, dtype=np.int64)
    return order


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


class RequestMajor:
    """Deferred rows of `steps` steps of n rows each (step-major, as the caller handed them: an ndarray or a
    deferred object) handed out request-major: request i's rows of every step, then request i + 1's. One copy: a
    deferred object's own `result_request_major(steps)` when it has one, else a reordering copy of its result.
    The result is the caller's own array (`owns_result`), not a view of the source's memory."""

    __slots__ = ("_rows", "_steps", "_inverse", "shape", "dtype", "dropped")
    owns_result = True

    def __init__(self, rows: Any, steps: int, inverse: np.ndarray | None = None):
        # inverse: request i of each step goes to place inverse[i] (OwnerHints.order), else the steps' order
        self._rows, self._steps, self._inverse = rows, steps, inverse
        self.shape = tuple(rows.shape)
        self.dtype = rows.dtype
        self.dropped = bool(getattr(rows, "dropped", False))

    def result(self) -> np.ndarray:
        rows, k = self._rows, self._steps
        direct = getattr(rows, "result_request_major", None)
        if direct is not None:
            return direct(k) if self._inverse is None else direct(k, self._inverse)
        a = np.asarray(rows if isinstance(rows, np.ndarray) else rows.result())
        out = out_pool().empty(a.shape, a.dtype)
        n = a.shape[0] // k
        src = a.reshape(k, n, *a.shape[1:]).swapaxes(0, 1)
        if self._inverse is None:
            out.reshape(n, k, *a.shape[1:])[...] = src
        else:
            out.reshape(n, k, *a.shape[1:])[self._inverse] = src
        return out

    def release(self) -> None:
        release = getattr(self._rows, "release", None)
        if release is not None:
            release()


def flat_ids(parts: Sequence[Sequence]) -> list:
    """Per-step id lists as one new list."""
    return list(parts[0]) if len(parts) == 1 else list(chain.from_iterable(parts))


def flat_ints(parts: Sequence) -> list:
    """Per-step integer lists or 1-D arrays as one list of ints (arrays: one C loop)."""
    if len(parts) == 1:
        p = parts[0]
        return p.tolist() if isinstance(p, np.ndarray) else [int(x) for x in p]
    return np.concatenate([np.asarray(p, dtype=np.int64).reshape(-1) for p in parts]).tolist()


class Geometry(NamedTuple):
    num_layers: int
    top_k: int
    layer_lo: int
    layer_hi: int
    id_dtype: np.dtype = wire.ROW_DTYPE     # the rows' dtype on the wire: int16 rows are narrowed to it once, here


class Encoded(NamedTuple):
    """One data message ready for the replay buffer."""

    parts: Parts
    frames: list
    payload: int              # routing-row bytes


_TOKEN_KEYS = {"open": "n_prompt_tokens", "finish": "n_output_tokens"}


def token_frames(item: Announce) -> tuple[Announce, str | None]:
    """The announce with its token ids as int32 arrays: the caller's thread handed a list as a tuple, or as the
    list itself when it never modifies it (producer._tokens). Ids that are not int32 integers are left out, with
    the body's count of them: the announce still travels (the record has no token ids then), and the error is
    returned to be reported."""
    if not any(type(x) is tuple or type(x) is list for x in item.frames):
        return item, None
    try:
        frames = []
        for x in item.frames:
            a = np.asarray(x, dtype=wire.TOKEN_DTYPE) if type(x) is tuple or type(x) is list else x
            if a.ndim != 1:
                raise ValueError(f"token ids must be a flat sequence, got shape {a.shape}")
            frames.append(a)
    except (TypeError, ValueError, OverflowError) as e:
        body = dict(item.body)
        body.pop(_TOKEN_KEYS.get(item.kind, ""), None)
        return item._replace(body=body, frames=[]), f"{type(e).__name__}: {str(e)[:200]}"
    return item._replace(frames=frames), None


def encode_announce(item: Announce, producer_id: str, epoch: int, seq: int) -> Encoded:
    head = wire.pack_header(item.kind, producer_id, epoch, seq, item.request_id, item.body)
    extra = [memoryview(np.ascontiguousarray(x)).cast("B") for x in item.frames]
    return Encoded(Parts(item.kind, (item.request_id,)), [head, *extra], 0)


def encode_opens(items: list, producer_id: str, epoch: int, seq: int) -> Encoded:
    """Several requests' open Announces (distinct ids, token ids already int32 arrays, one producer's geometry) as
    one `opens` message."""
    first = items[0].body
    L, K, layer_ids, id_code = first["num_layers"], first["top_k"], first["layer_ids"], first.get("ids", "i2")
    ids, P, C, NT, filled, toks = [], [], [], [], [], []
    for it in items:
        b = it.body
        if (b["num_layers"] != L or b["top_k"] != K or b["layer_ids"] != layer_ids
                or b.get("ids", "i2") != id_code):
            raise ValueError(f"opens of one message must share num_layers, top_k, layer_ids and ids; "
                             f"{escaped_id(it.request_id)} differs")
        ids.append(it.request_id)
        P.append(b["prompt_len"])
        C.append(b["num_cached"])
        filled.append(b.get("prefix_filled", False))
        t = it.frames[0] if it.frames else None
        NT.append(0 if t is None else len(t))
        if t is not None and len(t):
            toks.append(t)
    body = wire.opens_body(P, C, L, K, layer_ids, NT if any(NT) else None, filled, id_code)
    head = wire.pack_header("opens", producer_id, epoch, seq, ids, body)
    extra = [memoryview(np.concatenate(toks).astype(wire.TOKEN_DTYPE, copy=False)).cast("B")] if toks else []
    return Encoded(Parts("opens", ids), [head, *extra], 0)


def encode_finishes(items: list, producer_id: str, epoch: int, seq: int) -> Encoded:
    """Several requests' finish Announces (distinct ids, token ids already int32 arrays) as one `finishes`
    message: each entry's body as its `finish` would carry it."""
    ids = [it.request_id for it in items]
    toks = [it.frames[0] for it in items if it.frames and len(it.frames[0])]
    head = wire.pack_header("finishes", producer_id, epoch, seq, ids, {"entries": [it.body for it in items]})
    extra = [memoryview(np.concatenate(toks).astype(wire.TOKEN_DTYPE, copy=False)).cast("B")] if toks else []
    return Encoded(Parts("finishes", ids), [head, *extra], 0)


def kept_rows(rows: np.ndarray, counts: Sequence[int], keep: Sequence[bool]) -> np.ndarray:
    """The rows of the kept request parts, in order (one copy)."""
    pieces, at = [], 0
    for c, k in zip(counts, keep):
        if k:
            pieces.append(rows[at:at + c])
        at += c
    return np.concatenate(pieces, axis=0) if pieces else rows[:0]


def resolved_step(item: Step) -> Step:
    """The step with its rows as an ndarray of its own to keep: deferred rows waited for and their slot released
    here, whatever happens (copied out of it first, unless result() hands out an array of its own or cutting out
    refused parts copied them already); refused parts cut out (keep None)."""
    rows = item.rows
    if isinstance(rows, np.ndarray) and item.keep is None:
        return item
    release = None if isinstance(rows, np.ndarray) else getattr(rows, "release", None)
    try:
        if not isinstance(rows, np.ndarray):
            rows = rows.result()
        rows = np.asarray(rows)
        ids, starts, counts = item.request_ids, item.starts, item.counts
        if item.keep is not None:
            rows = kept_rows(rows, counts, item.keep)
            ids, starts, counts = ([x for x, k in zip(v, item.keep) if k] for v in (ids, starts, counts))
        elif release is not None and not getattr(item.rows, "owns_result", False):
            rows = rows.copy()          # out of the ring slot before it is released
    finally:
        if release is not None:
            release()
    return Step(ids, starts, counts, rows)


def encode_step(item: Step, producer_id: str, epoch: int, seq: int, g: Geometry) -> Encoded:
    """Wait for deferred rows, cut out refused parts, and encode the delta (the deferred slot is released here,
    whatever happens: resolved_step)."""
    item = resolved_step(item)
    ids, starts, counts = item.request_ids, item.starts, item.counts
    rows = item.rows
    if g.id_dtype != wire.ROW_DTYPE and rows.dtype == wire.ROW_DTYPE:
        rows = wire.narrow_rows(rows, g.id_dtype)       # ValueError naming an id that does not fit: refused
    body = wire.delta_body(starts, counts, g.num_layers, g.top_k, g.layer_lo, g.layer_hi, rows.dtype)
    head = wire.pack_header("delta", producer_id, epoch, seq, ids, body)
    payload = memoryview(np.ascontiguousarray(rows)).cast("B")
    parts = Parts("delta", ids, starts, counts)        # references: read only when the broker refuses the message
    return Encoded(parts, [head, payload], len(payload))


# What one delta may hold so that every receiver takes it (protocol/wire.py's limits: a receiver refuses more rows
# or entries, a longer header, and its socket drops a larger frame). A step beyond them goes as several deltas.
DELTA_HEADER_BUDGET = wire.MAX_HEADER_BYTES - (64 << 10)    # for the key list and the start/count arrays
ENTRY_HEADER_BOUND = 13         # an entry's header bytes beyond 4 per id character: str head, start and count
SAFE_ENTRIES = DELTA_HEADER_BUDGET // (wire.MAX_REQUEST_ID_BYTES + ENTRY_HEADER_BOUND)   # never over the budget


def delta_rows_limit(row_bytes: int) -> int:
    """The most rows one delta may carry: the wire's bound, and one frame's (a step's rows are one frame)."""
    return min(wire.MAX_ROWS_PER_DELTA, wire.MAX_PAYLOAD_FRAME_BYTES // row_bytes)


def header_too_long(chars: int, entries: int) -> bool:
    """Whether a delta's key list of `entries` ids of `chars` characters in all, with its start/count arrays, could
    pass the header budget (UTF-8: at most 4 bytes a character)."""
    return 4 * chars + ENTRY_HEADER_BOUND * entries > DELTA_HEADER_BUDGET


def oversized(rows: int, ids: Sequence[str], max_rows: int) -> bool:
    """Whether a step of `rows` rows and these entries is too large for one delta (split_step). Constant time
    unless it has more than SAFE_ENTRIES entries."""
    n = len(ids)
    return rows > max_rows or (n > SAFE_ENTRIES and (n > wire.MAX_REQUESTS_PER_DELTA
                                                     or header_too_long(sum(map(len, ids)), n)))


def split_step(item: Step, max_rows: int, max_entries: int = wire.MAX_REQUESTS_PER_DELTA,
               header_budget: int = DELTA_HEADER_BUDGET) -> list[Step]:
    """A step too large for one delta (oversized) as consecutive steps that each fit, with ndarray rows (views of
    one array). Deferred rows are waited for and their slot released here, whatever happens (copied out of it
    first); refused parts are cut out. The entries are cut in order, a request's rows between two steps where
    they must be (positions are absolute: each part is a delta of its own). ValueError if the rows are not
    (sum(counts), ...)."""
    item = resolved_step(item)
    ids, starts, counts, rows = item.request_ids, item.starts, item.counts, item.rows
    total = int(sum(counts))
    if rows.ndim != 3 or rows.shape[0] != total:
        raise ValueError(f"rows are {rows.shape}, the step's counts add up to {total} rows")
    out: list = []
    part: tuple = ([], [], [])
    lo = at = cost = 0                  # the part's first row, the next row, its header bound
    for rid, s, c in zip(ids, starts, counts):
        s, c = int(s), int(c)
        e = 4 * len(rid) + ENTRY_HEADER_BOUND
        while True:
            if part[0] and (len(part[0]) >= max_entries or cost + e > header_budget or at - lo >= max_rows):
                out.append(Step(*part, rows[lo:at]))
                part, lo, cost = ([], [], []), at, 0
            take = min(c, max_rows - (at - lo))
            part[0].append(rid)
            part[1].append(s)
            part[2].append(take)
            cost += e
            at += take
            s += take
            c -= take
            if c == 0:
                break
    if part[0]:
        out.append(Step(*part, rows[lo:at]))
    return out


def step_rows(item: Step) -> int:
    """Rows a queued step carries (all of them, kept or not)."""
    shape = getattr(item.rows, "shape", None)
    return int(shape[0]) if shape is not None else int(sum(item.counts))


def encode_steps(items: Sequence[Step], producer_id: str, epoch: int, seq: int, g: Geometry,
                 row_shape: tuple) -> tuple[Encoded | None, list]:
    """Several queued steps as one delta: their entries in order, each step's rows one payload frame (frame
    boundaries fall on request boundaries, as wire.check_payload wants; ndarray rows are not copied, deferred rows
    are copied out of their slot once). Every deferred slot is released here, whatever happens. A step whose rows
    cannot be had (result() raises, or the rows are not (sum(counts), L, K) int16) is left out and returned with
    its error, so its positions can be reported lost; the others still travel. Returns (the message or None if no
    step is left, [(step, error)])."""
    ids: list = []
    starts: list = []
    counts: list = []
    frames: list = []
    failed: list = []
    for item in items:
        rows = item.rows
        release = None if isinstance(rows, np.ndarray) else getattr(rows, "release", None)
        owned = release is not None and bool(getattr(rows, "owns_result", False))
        try:
            try:
                if not isinstance(rows, np.ndarray):
                    rows = rows.result()
                rows = np.asarray(rows)
                if rows.dtype != wire.ROW_DTYPE or rows.shape != (sum(item.counts), *row_shape):
                    raise ValueError(f"rows are {rows.shape} {rows.dtype}, expected ({sum(item.counts)}, "
                                     f"{row_shape[0]}, {row_shape[1]}) int16")
                narrowed = g.id_dtype != wire.ROW_DTYPE
                if narrowed:        # the one copy (out of a deferred slot too, before its release)
                    rows = wire.narrow_rows(rows, g.id_dtype)
            except Exception as e:  # noqa: BLE001 (this step's failure; the others go on)
                failed.append((item, e))
                continue
            if item.keep is None:
                ids += item.request_ids
                starts += item.starts
                counts += item.counts
                copied = narrowed
            else:
                rows = kept_rows(rows, item.counts, item.keep)
                copied = True
                for r, st, c, k in zip(item.request_ids, item.starts, item.counts, item.keep):
                    if k:
                        ids.append(r)
                        starts.append(st)
                        counts.append(c)
            if len(rows):
                payload = memoryview(np.ascontiguousarray(rows)).cast("B")
                frames.append(bytes(payload) if release is not None and not copied and not owned else payload)
        finally:
            if release is not None:
                release()
    if not ids:
        return None, failed
    body = wire.delta_body(starts, counts, g.num_layers, g.top_k, g.layer_lo, g.layer_hi, g.id_dtype)
    head = wire.pack_header("delta", producer_id, epoch, seq, ids, body)
    return Encoded(Parts("delta", ids, starts, counts), [head, *frames], sum(len(f) for f in frames)), failed


class RowsLost(RuntimeError):
    """Rows a deferred rows object could not deliver for lack of room or time (a ring read that fell behind, a full
    host ring): reported lost in the requests' finishes like a step the queue bound dropped. Any other error from
    its result() is a refusal: the rows failed a check (reported lost and refused)."""


def lost_body(body: dict, lost: Sequence, refused: Sequence = (), broker_refused: Sequence = ()) -> dict:
    """A finish's body (a new dict) that also reports `lost` position ranges (after those it already carries), and
    of them the `refused` ones (rows the producer would not send: they failed its checks) and the `broker_refused`
    ones (rows of a delta the broker accepted and dropped: it could not take the message)."""
    body = dict(body)
    body["lost"] = list(body.get("lost", ())) + [list(r) for r in lost]
    for key, ranges in (("refused", refused), ("broker_refused", broker_refused)):
        if ranges:
            body[key] = list(body.get(key, ())) + [list(r) for r in ranges]
    return body


def with_lost(item: Announce, lost: list, refused: list = (), broker_refused: list = ()) -> Announce:
    """A finish item that also reports `lost` (and `refused`, `broker_refused`) position ranges: lost_body."""
    return item._replace(body=lost_body(item.body, lost, refused, broker_refused))


def escaped_id(request_id: Any, limit: int = 80) -> str:
    """A request id as printable ASCII (escapes for anything else, lone surrogates included), at most `limit`
    characters of it."""
    text = ascii(request_id) if type(request_id) is str else f"<{type(request_id).__name__}> {ascii(request_id)}"
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters escaped)"


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


class Screen(NamedTuple):
    """Which request parts of one call may travel: `keep` None means all of them."""

    keep: list | None
    dropped: int


class RequestBook:
    """Own the caller-side per-request state, under one lock: position ranges lost to drops (reported in the
    request's finish), ids refused (by a failed open, or by the broker), and a bounded set of ids known to
    travel (validated once; a cache, cleared when it reaches `known_limit`)."""

    def __init__(self, known_limit: int = 1 << 16):
        self.lock = threading.Lock()
        self.known_limit = known_limit
        self._lost: dict[str, list] = {}
        self._refused: set[str] = set()
        self._known: set[str] = set()
        self.refusals = 0               # moves on every refuse(): a screen that passed before may not pass now

    def problem(self, request_id: Any) -> str | None:
        """Why this id's parts may not travel (None if they may). Caller holds no lock."""
        if type(request_id) is not str:
            return wire.request_id_problem(request_id)
        with self.lock:
            if request_id in self._known and request_id not in self._refused:
                return None
            if request_id in self._refused:
                return "refused"
        p = wire.request_id_problem(request_id)
        if p is None:
            with self.lock:
                if len(self._known) >= self.known_limit:
                    self._known.clear()
                self._known.add(request_id)
        return p

    def screen(self, request_ids: Iterable) -> Screen:
        with self.lock:
            try:
                if not self._refused and self._known.issuperset(request_ids):
                    return Screen(None, 0)
            except TypeError:             # an unhashable "id": checked one by one below
                pass
        keep = [self.problem(r) is None for r in request_ids]
        n = keep.count(False)
        return Screen(None if n == 0 else keep, n)

    def opened(self, request_id: str) -> None:
        with self.lock:
            self._refused.discard(request_id)
            if len(self._known) >= self.known_limit:
                self._known.clear()
            self._known.add(request_id)

    def opened_many(self, request_ids: list) -> None:
        with self.lock:
            self._refused.difference_update(request_ids)
            if len(self._known) + len(request_ids) > self.known_limit:
                self._known.clear()
            self._known.update(request_ids)

    def refuse(self, request_id: Any) -> None:
        if type(request_id) is not str:
            return
        with self.lock:
            self._refused.add(request_id)
            self._lost.pop(request_id, None)
            self.refusals += 1

    def is_refused(self, request_id: Any) -> bool:
        with self.lock:
            return type(request_id) is str and request_id in self._refused

    @property
    def any_refused(self) -> bool:
        return bool(self._refused)

    def ended(self, request_id: Any) -> tuple[bool, list | None]:
        """A finish/abort: (was it refused, the lost ranges to report); the request's state is forgotten."""
        with self.lock:
            lost = self._lost.pop(request_id, None) if type(request_id) is str else None
            if type(request_id) is str and request_id in self._refused:
                self._refused.discard(request_id)
                return True, None
            return False, lost

    def ended_many(self, request_ids: list) -> list[tuple[bool, list | None, bool]]:
        """ended() for several ids under one lock: per id (was it refused, its lost ranges, is it known to travel
        (False: not known, check it with problem()))."""
        out = []
        with self.lock:
            lost, refused, known = self._lost, self._refused, self._known
            for rid in request_ids:
                if type(rid) is not str:
                    out.append((False, None, False))
                    continue
                ranges = lost.pop(rid, None) if lost else None
                if rid in refused:
                    refused.discard(rid)
                    out.append((True, None, False))
                else:
                    out.append((False, ranges, rid in known))
        return out

    def add_lost(self, request_ids: Sequence, starts: Sequence[int], counts: Sequence[int]) -> None:
        with self.lock:
            for rid, s, c in zip(request_ids, starts, counts):
                if type(rid) is str and rid not in self._refused:
                    self._lost.setdefault(rid, []).append([int(s), int(s) + int(c)])
