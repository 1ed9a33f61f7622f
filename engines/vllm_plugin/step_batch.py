"""Batch consecutive engine steps' rows and hand them to the producer as one delta: StepBatch (engine thread) and
BatchedRows (the deferred rows the producer's thread resolves, checks, reads and releases).

A step enters the batch as one part, in one of these forms (told apart by type, never by length):
  SlotRef      rows [first, first + n) of a step-ring slot, by reference: the producer's thread takes their
               host-ring rows (AsyncCopier.take_slot). With `layout_dtypes`, the step went raw (add_raw): its
               layout travels as bytes and its ids are engine ids, resolved on the producer's thread.
  HostRef      an eager CPU step's routers' top-k tensors, as they are (add_host), raw: turned into HostRows by
               BatchedRows.resolve on the producer's thread.
  rows object  anything with result()/release() (PendingRows from AsyncCopier.submit or submit_gather, HostRows):
               added by add(); a whole step copied raw (add_copied) carries its layout dtypes in `tag`.

BatchedRows implements the producer's contract for deferred rows (producer/handover.py, DeferredRows): `deferred`,
`resolve(request_ids, starts, counts)`, `result()`, `result_request_major(steps, inverse)`, `release()`, `dropped`,
`owns_result`, `shape`, `dtype`, `extra_nbytes`.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from routing_replay.capture import AsyncCopier, HostRows
from routing_replay.capture.copier import ROW_DTYPE, launch_rows
from routing_replay.engines.vllm_plugin.stamps import LostHookError, RingReadLost, StampCheck
from routing_replay.producer.handover import RowsBase
from routing_replay.producer.items import flat_ids, flat_ints
from routing_replay.producer.outpool import request_major

MAX_BATCH_STEPS = 16          # steps per delta message at most


class SlotRef(NamedTuple):
    """A step-ring step's rows [first, first + n) of slot `ring_slot`, by reference, until the producer's thread
    takes them (named apart from PendingRows' `slot`, which capture/copier.py reads on whatever parts it gets). `layout_dtypes`: the step went raw with its layout as bytes of these (query start locations, computed
    positions) dtypes (StepBatch.add_raw); None: added with its keys (StepBatch.add_slot)."""
    first: int
    n: int
    ring_slot: int
    layout_dtypes: tuple | None = None


class HostRef(NamedTuple):
    """An eager CPU step, raw (StepBatch.add_host): each MoE layer's top-k tensor as its router made it
    (`tensor_nbytes` bytes each, not checked yet), the step's `n` rows, and the dtypes of its layout bytes."""
    tensors: list
    tensor_nbytes: int
    n: int
    layout_dtypes: tuple


class BatchedRows(RowsBase):        # implements producer.handover.DeferredRows
    """Own the PendingRows of consecutive steps on their way through the producer as one delta: the producer's
    thread concatenates them (C speed), refuses rows no router wrote (-1, or a stale step stamp), sends, and
    releases every part."""

    __slots__ = ("_parts", "_strict", "_forwards", "_stamps", "_ckpt_forward", "_copier", "_slots", "shape",
                 "dtype", "dropped", "_raw", "_table", "_select", "extra_nbytes", "_gone", "_top_k")

    def __init__(self, parts: list, strict: list, stamps: StampCheck | None = None, forwards: list | None = None,
                 ckpt_forward: int | None = None, copier: AsyncCopier | None = None, slots=None, rows: int = 0,
                 raw: list | None = None, table: dict | None = None, extra_nbytes: int = 0,
                 gone: set | None = None, top_k: int | None = None):
        self._parts = parts
        self._top_k = top_k             # host steps added raw (StepBatch.add_host): their HostRows' top-k
        self._gone = gone               # keys whose open the producer refused at this hand-over: left out too
        self.extra_nbytes = extra_nbytes    # bytes the parts hold beyond their int16 rows (HostRows' tensors)
        self._raw = raw                 # indices of the parts added raw (StepBatch.add_raw) until resolve(); or None
        self._table = table             # engine id -> (record key, first forward it holds for) for resolve()
        self._select = None             # per part: the rows resolve() kept (an index array), or None for all
        self._ckpt_forward = ckpt_forward   # step-ring parts: the engine's forward count at the hand-over
        self._strict = strict           # per part: -1 rows are a lost hook (computed rows) or not (prefix rows)
        self._forwards = forwards       # per part: the engine's forward count at its step (stamped parts)
        self._stamps = stamps
        self._copier = copier           # parts handed over by reference, (first, n, slot): taken from it here
        self._slots = slots             # their SlotBatch (mark_batch(slots=...))
        if copier is not None:
            self.shape = (rows, copier.cache.num_layers, copier.cache.top_k)
            self.dtype = ROW_DTYPE
        elif type(parts[0]) is HostRef:     # (the step's tensors, one per MoE layer)
            self.shape = (rows, len(parts[0].tensors), top_k)
            self.dtype = ROW_DTYPE
        else:
            self.shape = (rows, *parts[0].shape[1:])
            self.dtype = parts[0].dtype
        self.dropped = False

    @property
    def owns_result(self) -> bool:
        """result() of several steps is a new array (their concatenation); of one step, a view of the host ring
        (unless resolve() left some of its rows out)."""
        return len(self._parts) > 1 or (self._select is not None and self._select[0] is not None)

    @property
    def strict(self) -> tuple:
        """Per step (part): True where -1 rows are a lost hook (computed rows), False for prefix rows gathered from
        the prefix store (-1 there means "not found" and travels as it is)."""
        return tuple(self._strict)

    @property
    def deferred(self) -> bool:
        """Some steps were added raw: their id lists are engine ids until resolve() runs (producer's thread)."""
        return self._raw is not None

    def resolve(self, request_ids: list, starts: list, counts: list) -> tuple[list, list, list]:
        """On the producer's thread, before anything else reads the batch: the steps added raw (StepBatch.add_raw:
        the runner's engine ids, computed positions and query start locations) as record keys, starts and counts,
        as post_step would have made them on the engine thread. A request with no key for the step (not captured,
        or captured only from a later step on) or no rows in it is left out, and so are its rows. Steps not added
        raw pass as they are. Returns the per-step (keys, starts, counts) for Producer.publish_steps' StepParts."""
        raw, table = self._raw, self._table
        if raw is None:
            return request_ids, starts, counts
        self._raw = None
        parts = self._parts
        starts, counts = host_layouts(parts, raw, starts, counts)
        grown = 0
        for i in raw:   # the rows each step's layout spans: host steps' tensors as HostRows (checked in result()),
            p = parts[i]            # step-ring steps' rows of their slot
            if _in_bytes(p):
                qsl = counts[i]
                lo = int(qsl[0])
                n = int(qsl[-1]) - lo
                kind = type(p)
                if kind is SlotRef:
                    parts[i] = SlotRef(lo, n, p.ring_slot)
                    grown += n - p.n
                elif kind is HostRef:
                    parts[i] = HostRows(p.tensors, [(lo, n)], self._top_k, p.tensor_nbytes, checked=False)
                    grown += n - p.n        # (the rows the worker counted: the scheduler's, V1's too)
                elif lo != 0 or n != p.shape[0]:    # a step copied whole (StepBatch.add_copied): its rows are fixed
                    raise LostHookError(f"routing-replay: a step's layout spans rows [{lo}, {lo + n}) but its "
                                        f"copy holds rows [0, {p.shape[0]}); refusing to publish them")
        if grown:
            self.shape = (self.shape[0] + grown, *self.shape[1:])
        keys_out, starts_out, counts_out, select, cut = resolve_raw_steps(raw, table, self._forwards, request_ids,
                                                                          starts, counts, self._gone)
        if cut:
            self._select = select
            self.shape = (self.shape[0] - cut, *self.shape[1:])
        return keys_out, starts_out, counts_out

    def _taken(self) -> None:
        """The parts handed over by reference get their host-ring rows now (on this thread, not the engine's)."""
        if self._slots is None:
            return
        parts, copier, sb = self._parts, self._copier, self._slots
        check, forwards = self._stamps, self._forwards
        off, mask, ring = check.offset, check.mask, copier.cache.slots
        for i, p in enumerate(parts):           # (a part taken is no SlotRef: a second call takes the rest only)
            if type(p) is SlotRef:
                # the slot the device wrote for this forward, by the offset now: the one the engine thread used,
                # unless a refused batch before this one moved the offset to the device's count since
                slot = ((forwards[i] + off) & mask) % ring if off is not None else p.ring_slot
                parts[i] = copier.take_slot(p.first, p.n, slot, sb)
        lost = sum(p.dropped for p in parts)
        if lost:
            raise RingReadLost(f"routing-replay: the host ring was full when the producer's thread took this "
                               f"batch's step-ring rows ({lost} of {len(parts)} steps): the batch's rows are lost")

    def _checked(self) -> list:
        self._taken()
        launch_rows(self._parts)            # consecutive steps: one host copy for all of them
        arrays = [p.result() for p in self._parts]
        if self._select is not None:        # resolve() left rows of raw steps out
            arrays = [a if k is None else a[k] for a, k in zip(arrays, self._select)]
        check = self._stamps
        ring = None                         # a part read from the step ring: it carries the batch's checkpoint
        try:
            for i, (p, a, strict) in enumerate(zip(self._parts, arrays, self._strict)):
                if strict and a.size:
                    if getattr(p, "slot", None) is not None:
                        ring = p
                        check.exact(p.stamps(), self._forwards[i], f"step ring slot {p.slot[0]}")
                    elif check is not None and p.stamped:
                        check(p.stamps(), self._forwards[i])
                    if int(a.min()) < 0:
                        self._lost_hook(a)
        except (LostHookError, RingReadLost):
            if ring is not None:            # a lost flush: later batches read the slots the device writes now
                check.resync(ring.checkpoint(), self._ckpt_forward)
            raise
        if ring is not None:
            check.checkpoint(ring.checkpoint(), self._ckpt_forward)
        return arrays

    def result(self) -> np.ndarray:
        arrays = self._checked()
        return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)

    def result_request_major(self, steps: int, inverse: np.ndarray | None = None) -> np.ndarray:
        """The rows of `steps` steps of n rows each, request-major (producer.coalesce.RequestMajor): one copy out
        of the host ring, as result() makes. With `inverse`, request i of each step goes to place inverse[i] (the
        producer's owner grouping), in the same copy."""
        arrays = self._checked()
        if len(arrays) != steps or len({a.shape for a in arrays}) != 1:
            raise ValueError(f"{len(arrays)} parts of shapes {sorted({a.shape for a in arrays})}: not {steps} "
                             "steps of equal size")
        return request_major(arrays, inverse)

    @staticmethod
    def _lost_hook(rows: np.ndarray):
        bad = np.argwhere((rows < 0).any(axis=2))
        raise LostHookError(f"routing-replay: {len(bad)} (row, layer) cells were never written by a router "
                            f"(first: row {bad[0][0]} of {len(rows)}, local MoE layer {bad[0][1]}); a capture "
                            "hook was lost (e.g. a layer rebuilt after binding). Refusing to publish stale "
                            "routing.")

    def release(self) -> None:
        for p in self._parts:
            kind = type(p)
            if kind is SlotRef:             # never taken: its share of the batch's event goes back
                self._copier.forget_slot(self._slots)
            elif kind is not HostRef:
                p.release()


def _in_bytes(part) -> bool:
    """A step added raw with its layout as bytes (StepBatch.add_host, add_raw with dtypes, add_copied)."""
    return _layout_dtypes(part) is not None


def _layout_dtypes(part):
    """The dtypes of the query start locations and computed positions of a step added raw with its layout as bytes:
    a SlotRef's or HostRef's `layout_dtypes` (add_raw, add_host), a copied step's tag (add_copied); None for any
    other part."""
    kind = type(part)
    if kind is SlotRef or kind is HostRef:
        return part.layout_dtypes
    return getattr(part, "tag", None)


def host_layouts(parts: list, raw: list, starts: list, counts: list) -> tuple[list, list]:
    """`starts` and `counts` of a batch's steps (per step) with those of the steps added raw as bytes (the runner's
    computed positions and query start locations: StepBatch.add_host, add_raw with dtypes) as arrays; the lists
    themselves when there are none. Consecutive steps with the same bytes share one array (decode steps repeat
    their layout)."""
    if not any(_in_bytes(parts[i]) for i in raw):
        return starts, counts
    starts, counts = list(starts), list(counts)
    prev = (None, None, None, None)         # (bytes, array) of the last such step's two layouts
    for i in raw:
        if not _in_bytes(parts[i]):
            continue
        dtypes = _layout_dtypes(parts[i])
        qb, cb = counts[i], starts[i]
        qsl = prev[1] if qb == prev[0] else np.frombuffer(qb, dtype=dtypes[0])
        comp = prev[3] if cb == prev[2] else np.frombuffer(cb, dtype=dtypes[1])
        prev = (qb, qsl, cb, comp)
        counts[i], starts[i] = qsl, comp
    return starts, counts


def _kept_rows(firsts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The rows of the kept entries of a step, in order: entry j's `counts[j]` rows from row `firsts[j]` on."""
    ends = np.cumsum(counts)
    return np.repeat(firsts - (ends - counts), counts) + np.arange(int(ends[-1]) if len(ends) else 0)


def resolve_raw_steps(raw: list, table: dict, forwards: list, request_ids: list, starts: list, counts: list,
                      gone: set | None = None):
    """BatchedRows.resolve's work, without changing the batch: for the steps at indices `raw`, per step (keys,
    starts, counts), each step's kept rows (an index array into the step's rows, or None for all of them) and the
    rows left out in all. `gone`: record keys whose open the producer refused after their steps were batched; the
    steps not added raw leave them out too (those added raw do through `table`, which no longer holds them)."""
    keys_out, starts_out, counts_out = list(request_ids), list(starts), list(counts)
    select = [None] * len(request_ids)
    cut = 0
    get = table.get
    last_ids = last_keys = last_qsl = last_count = None
    for i in raw:
        ids, computed, qsl = request_ids[i], starts[i], counts[i]
        fwd = forwards[i]
        if ids is last_ids:
            keys = last_keys            # (the same id list as the step before, all captured by then: still so)
        else:
            keys = [k[0] if k is not None and k[1] <= fwd else None for k in map(get, ids)]
            # decode steps share one id list: mapped once while every id of it was captured by its step
            last_ids, last_keys = (ids, keys) if None not in keys else (None, None)
        if qsl is last_qsl:
            count = last_count
        else:
            count = last_count = qsl[1:] - qsl[:-1]
            last_qsl = qsl
        if None not in keys and np.count_nonzero(count) == len(count):
            keys_out[i], starts_out[i], counts_out[i] = keys, computed, count
            continue
        idx = np.flatnonzero(np.array([k is not None for k in keys], dtype=bool) & (count > 0))
        keys_out[i] = [keys[j] for j in idx.tolist()]
        cn = count[idx]
        starts_out[i], counts_out[i] = computed[idx], cn
        select[i] = _kept_rows((qsl[:-1] - qsl[0])[idx], cn)    # from each kept request's first row in the step
        cut += int(qsl[-1] - qsl[0]) - len(select[i])
    if gone:
        done = set(raw)
        for i, keys in enumerate(request_ids):
            if i in done or gone.isdisjoint(keys):
                continue
            on = np.array([k not in gone for k in keys], dtype=bool)
            cn = np.asarray(counts[i], dtype=np.int64)
            firsts = np.cumsum(cn) - cn                  # each entry's first row in the step
            keys_out[i] = [k for k, o in zip(keys, on.tolist()) if o]
            starts_out[i], counts_out[i] = np.asarray(starts[i])[on], cn[on]
            select[i] = _kept_rows(firsts[on], cn[on])
            cut += int(cn.sum()) - len(select[i])
    return keys_out, starts_out, counts_out, select, cut


class StepBatch:
    """Own the copied-but-unpublished rows of consecutive engine steps until they leave as one delta message.

    Batching leaves the records' timing unchanged (a record is emitted at its request's finish, and a finish
    flushes the batch first) and divides the per-message cost of producer, broker and consumer by the number
    of steps batched. Per step it keeps references only (the step's key list, which decode steps share, and its
    starts and counts as arrays): nothing per request is touched on the engine thread; the producer's thread
    flattens them (Producer.publish_steps)."""

    __slots__ = ("parts", "strict", "forwards", "keys", "starts", "counts", "rows", "stamps", "ringed", "by_ref",
                 "raw", "extra", "top_k", "row_nbytes")

    def __init__(self, top_k: int = 1, stamped: bool = False):
        # used on the producer's thread, one batch after the other
        self.stamps = StampCheck(top_k) if stamped else None
        self.top_k = top_k
        self.row_nbytes = top_k * ROW_DTYPE.itemsize       # one layer's row, as HostRows makes it
        self.parts: list = []
        self.strict: list = []
        self.forwards: list = []        # per step: the engine's forward count (StampCheck)
        self.keys: list = []            # per step: its list of record keys (never modified afterwards)
        self.starts: list = []          # per step: 1-D integer array or list
        self.counts: list = []
        self.rows = 0
        self.ringed = False             # a part reads the step ring: the hand-over takes a checkpoint
        self.by_ref = 0                 # step-ring steps added by reference (add_slot, add_raw)
        self.raw: list = []             # indices of the steps added raw (add_raw)
        self.extra = 0                  # bytes the parts hold beyond their rows (HostRows: the routers' tensors)

    def add(self, pending, keys: list, starts, counts, strict: bool = True, forward: int = 0) -> None:
        """strict=False: rows from the prefix store, where -1 means "not found" and travels as it is. `keys` must
        not be modified afterwards; `starts` and `counts` (lists or 1-D integer arrays) must not be either.
        `forward`: the engine's forward count at this step (checked against a stamped step's stamp)."""
        self.parts.append(pending)
        if getattr(pending, "slot", None) is not None:
            self.ringed = True
        self.strict.append(strict)
        self.forwards.append(forward)
        self.keys.append(keys)
        self.starts.append(starts)
        self.counts.append(counts)
        self.rows += pending.shape[0]
        extra = getattr(pending, "extra_nbytes", 0)
        if extra:
            self.extra += extra

    def add_slot(self, first: int, n: int, slot: int, keys: list, starts, counts, forward: int) -> None:
        """A step-ring step by reference: its rows [first, first + n) of slot `slot` get their host-ring rows on
        the producer's thread (AsyncCopier.take_slot), so the engine thread makes no object and takes no lock.
        Hand such a batch over with hand_over()."""
        self.parts.append(SlotRef(first, n, slot))
        self.ringed = True
        self.by_ref += 1
        self.strict.append(True)
        self.forwards.append(forward)
        self.keys.append(keys)
        self.starts.append(starts)
        self.counts.append(counts)
        self.rows += n

    def add_raw(self, first: int, n: int, slot: int, ids: list, computed, qsl, forward: int,
                dtypes: tuple | None = None) -> None:
        """A step-ring step by reference, as the runner laid it out: its engine ids, the positions computed
        before it and its query start locations (rows [first, first + n) of slot `slot`: the whole step). The
        producer's thread maps the ids to record keys and leaves out what is not captured (BatchedRows.resolve),
        so a step costs the engine thread no work per request. With `dtypes`, `computed` and `qsl` are the bytes
        of arrays of those dtypes, and the rows are those `qsl` spans (`first` and `n`: the scheduler's count).
        `ids`, `computed` and `qsl` must not be modified afterwards; hand the batch over with
        hand_over(table=...)."""
        self.raw.append(len(self.parts))
        self.parts.append(SlotRef(first, n, slot, dtypes))
        self.ringed = True
        self.by_ref += 1
        self.strict.append(True)
        self.forwards.append(forward)
        self.keys.append(ids)
        self.starts.append(computed)
        self.counts.append(qsl)
        self.rows += n

    def add_copied(self, pending, ids: list, computed: bytes, qsl: bytes, dtypes: tuple, forward: int) -> None:
        """A step copied whole (AsyncCopier.submit of rows [0, n), mark=False), as the runner laid it out (add_raw's
        counterpart for a step larger than a ring slot): its engine ids and the bytes of its computed positions and
        query start locations (`dtypes`: theirs). The producer's thread maps the ids to keys and leaves out the
        rows of what is not captured (BatchedRows.resolve). `ids` must not be modified afterwards; hand the batch
        over with hand_over(table=...)."""
        pending.tag = dtypes
        self.raw.append(len(self.parts))
        self.add(pending, ids, computed, qsl, forward=forward)

    def add_host(self, tensors: list, tensor_nbytes: int, n: int, ids: list, computed: bytes, qsl: bytes,
                 dtypes: tuple, forward: int) -> None:
        """An eager CPU step by reference, as the runner laid it out (add_raw's host counterpart): each MoE layer's
        top-k tensor as its router made it (`tensor_nbytes` bytes each; not checked yet), the step's `n` rows, its
        engine ids, and the bytes of its computed positions and query start locations (`dtypes`: theirs). The
        producer's thread turns them into arrays and the tensors into HostRows, which checks them
        (BatchedRows.resolve): the engine thread makes no array and no object but the part. `tensors` and `ids`
        must not be modified afterwards; hand the batch over with hand_over(table=...)."""
        self.raw.append(len(self.parts))
        self.parts.append(HostRef(tensors, tensor_nbytes, n, dtypes))
        self.strict.append(True)
        self.forwards.append(forward)
        self.keys.append(ids)
        self.starts.append(computed)
        self.counts.append(qsl)
        self.rows += n
        extra = len(tensors) * (tensor_nbytes - n * self.row_nbytes)     # (as HostRows.extra_nbytes)
        if extra > 0:
            self.extra += extra

    def hand_over(self, copier: AsyncCopier, forward: int, table: dict | None = None, gone: set | None = None):
        """On the engine thread: the batch's one event (and, with step-ring parts, the checkpoint), then the
        batch as Producer.publish_steps arguments; `forward`: the engine's forward count now; `table`: engine id
        -> (record key, first forward) for the steps added raw; `gone`: see take_parts."""
        ringed = self.ringed
        sb = copier.mark_batch(self.parts, checkpoint=ringed, slots=self.by_ref)
        return self.take_parts(forward if ringed else None, copier if sb is not None else None, sb, table, gone)

    def take_parts(self, ckpt_forward: int | None = None, copier: AsyncCopier | None = None, slots=None,
                   table: dict | None = None, gone: set | None = None):
        """The batched steps as Producer.publish_steps arguments (per-step references, flattened on the producer's
        thread); the batch is empty afterwards. `ckpt_forward`: the engine's forward count when the batch's
        checkpoint was taken (batches with step-ring parts); `copier` and `slots`: for parts added by reference;
        `table`: for the steps added raw (add_raw); `gone`: record keys whose open the producer refused at this
        hand-over, left out of a batch with raw steps on the producer's thread (resolve_raw_steps), before their
        finish takes the refusal back (a batch without raw steps is screened at publish_steps, on this thread)."""
        raw = self.raw or None
        if raw is not None and table is None:
            raise ValueError("a batch with steps added raw needs the table of their engine ids")
        out = (self.keys, self.starts, self.counts,
               BatchedRows(self.parts, self.strict, self.stamps, self.forwards, ckpt_forward, copier, slots,
                            self.rows, raw, table, self.extra, gone if raw is not None else None, self.top_k))
        self.raw = []
        self.extra = 0
        self.ringed = False
        self.by_ref = 0
        self.parts, self.strict, self.forwards = [], [], []
        self.keys, self.starts, self.counts, self.rows = [], [], [], 0
        return out

    def take(self):
        """The batched steps as publish_rows arguments (flat lists); the batch is empty afterwards."""
        keys, starts, counts, rows = self.take_parts()
        return flat_ids(keys), flat_ints(starts), flat_ints(counts), rows
