"""Capture routing in one vLLM worker and publish it per engine step: open, delta, finish/abort per request.

Which worker publishes: tensor-parallel rank 0 of every (data-parallel rank, pipeline stage); the other TP
ranks bind nothing and cost nothing. Each pipeline stage publishes the rows of its own MoE layers
(`Producer(layer_range=...)`); only the first stage sends open/finish/abort, so a request is announced and
closed once. In embedded mode there must be exactly one publishing worker.

Per step (`Worker.execute_model`, engine thread):
  before the forward  finished_req_ids -> finish/abort (lengths from the scheduler, see scheduler_hooks.py);
                      scheduled_new_reqs that are captured -> open(prompt_len, num_cached_tokens = the prefix-
                      cache hits vLLM reported when it first scheduled the request, prompt token ids);
                      if a captured request runs in this step: reset the hook counter (hooks run in Python
                      every step: CPU, enforce_eager) or write -1 over the step's cache rows (the sentinel,
                      for hooks replayed from CUDA graphs).
  forward             each MoE router's capture hook records its top-k ids (binding.py).
                      After it, every MoE layer must have recorded all tokens of the step (counter), and
                      the producer's thread refuses -1 rows (sentinel): stale routing is never published.
  after the forward   rows of captured requests are found with the runner's own batch layout: request i of
                      `input_batch.req_ids` owns batch tokens query_start_loc[i]..query_start_loc[i+1], the
                      first at absolute position `input_batch.num_computed_tokens_cpu[i]` (read after
                      execute_model, i.e. after vLLM's deferred spec-decode corrections); one non-blocking
                      `AsyncCopier.submit(segments, mark=False)` snapshots them (no event per step). Up to
                      MAX_BATCH_STEPS consecutive steps are then handed to `Producer.publish_rows` as one delta
                      (flushed earlier before any finish/abort, and when half the copier's ring is used), after
                      one event recorded for the whole batch (`mark_batch`): the producer's thread launches
                      the copies after it, waits for them, checks for -1 rows, sends, and releases them.
                      On CPU with enforce_eager the routers' top-k tensors are host memory already: the hooks
                      keep them (binding.py) and the step goes into the batch as they are (HostRows), nothing
                      copied on the engine thread; the producer's thread builds the rows from them.
Steps with no captured request do nothing beyond two dict/set checks: no copy, no message.

Prefix rows (ROUTING_REPLAY_PREFIX_ROWS=fill; capture/prefix_store.py): every forward, captured or not, also
writes its routing into a PrefixStore by KV slot: under CUDA graphs and torch.compile on GPU inside the forward,
where the cache's end-of-step flush (the last MoE layer's hook) scatters the step's rows to the runner's persistent
slot-mapping buffer, so under CUDA graphs the write is part of the replayed graph and costs the engine thread
nothing; where hooks run in Python every step (CPU eager or compiled, GPU enforce_eager) post_step does, right
after the forward (torch.compile on CPU traces the flush before the store exists). The store is allocated and
attached when vLLM starts its warm-up, after the KV cache is sized and before graphs are captured (on CPU the hooks
then record every step). A request opened with prefix hits gets rows [0, num_cached_tokens) gathered from the store
(its block-table row -> slots) into the same host ring and delta as computed rows, after the step's forward (a
hit may point at blocks another request computed in this very step): with other requests' rows, once the queue
has waited 16 steps or holds half a step's rows, or at once when the request's blocks are freed. A weight
reload or wake-up invalidates the store (the queue is gathered first); a step whose hooks did not all run writes
-1 to its slots. Rows read as -1 reach the consumer as such and
make the record `prefix_not_found`.

Positions are absolute, so chunked prefill, preemption + recompute (a re-sent position overwrites) and
speculative decoding (rows of rejected drafts are overwritten by the next step or lie beyond the final
length) need no special case here.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from routing_replay.capture import AsyncCopier, HostRows, PrefixStore, RoutingCache, hit_slots_many, ring_kernels
from routing_replay.capture.cache import _ID_DTYPES, read_stamp, stamp_bits, stamp_dtype, stamp_lanes
from routing_replay.capture.copier import ROW_DTYPE, launch_rows
from routing_replay.engines.vllm_plugin import keys as _keys
from routing_replay.engines.vllm_plugin import scheduler_hooks
from routing_replay.engines.vllm_plugin.binding import _HOLDS, CaptureBinding, find_moe_layers, record_held
from routing_replay.engines.vllm_plugin.endpoint import Sink
from routing_replay.engines.vllm_plugin.prefix_refs import BlockWriters
from routing_replay.engines.vllm_plugin.selfcheck import check_runner
from routing_replay.engines.vllm_plugin.settings import Settings
from routing_replay.protocol import ids as _ids
from routing_replay.producer.handover import RowsBase, RowsLost
from routing_replay.producer.items import flat_ids, flat_ints
from routing_replay.producer.outpool import request_major

log = logging.getLogger("vllm.routing_replay")


MAX_BATCH_STEPS = 16          # steps per delta message at most


class LostHookError(RuntimeError):
    """A MoE layer did not record its routing in a step that captured a request: never publish stale rows."""


class RingReadLost(RowsLost):
    """Rows read from the step ring cannot be shown to be their step's (a later step reused the slot before it was
    read, or the device counted a forward the engine did not), or the host ring had no room for them: the batch's
    positions are reported lost (not refused: nothing was wrong with what the forward wrote)."""


STEP_RING_SLOTS = 64                # steps the producer's thread may fall behind before step-ring rows are lost


@dataclass
class WorkerStats:
    steps: int = 0                  # execute_model calls seen
    active_steps: int = 0           # steps that published rows
    ring_steps: int = 0             # of them: read from the step ring (nothing launched on the engine thread)
    host_steps: int = 0             # of them: the routers' host tensors by reference (CPU, eager: HostRows)
    copied_steps: int = 0           # of them: larger than a step-ring slot, copied whole and handed over raw
    rows: int = 0                   # rows handed over (a raw step's all: the producer's thread leaves some out)
    opened: int = 0
    finished: int = 0
    aborted: int = 0
    preempted: int = 0              # preemptions vLLM reported (any request)
    spec_steps: int = 0             # steps that verified speculative draft tokens
    host_ns: int = 0                # engine-thread CPU time in pre_step + post_step (only while `timing`)
    host_wall_ns: int = 0           # their wall time (GIL waits included; only while `timing`)
    clock_ns: int = 0               # of host_ns: the timing clocks' own cost, one read pair per timed section,
    clock_wall_ns: int = 0          # measured in place (a second pair read right after the first); same for wall
    timed_sections: int = 0         # pre_step / post_step runs that were timed
    # of them (only while `timing`): quiet steps, where nothing opened, finished or was preempted (a steady decode
    # step: what one step of the batch costs, without the requests' opens and finishes)
    quiet_steps: int = 0
    pre_skipped: int = 0            # steps whose pre_step work ran in post_step (WorkerCapture._late_pre_step)
    quiet_sections: int = 0
    quiet_host_ns: int = 0
    quiet_host_wall_ns: int = 0
    quiet_clock_ns: int = 0
    quiet_clock_wall_ns: int = 0
    rebinds: int = 0
    prefix_requests: int = 0        # requests opened with prefix hits whose rows came from the prefix store
    prefix_rows: int = 0            # rows gathered from the prefix store (or sent by reference, below)
    prefix_ref_rows: int = 0        # of them, rows named by reference (prefix_refs) instead of gathered
    store_forgotten: int = 0        # slots set to -1 because a step's routing was not fully recorded
    derived_keys: int = 0           # requests captured under record_key_for(id): their id cannot travel as it is
    duplicate_keys: int = 0         # requests captured as f"{key}#{n}": another live request had their key
    skipped: int = 0                # requests not captured (or closed as aborted) after an error of their own


class StampCheck:
    """Check, on the producer's thread, that each step's rows were written by the forward of that step. The stamped
    cache (RoutingCache(stamp=True)) counts complete flushes on the device; the engine thread counts the forwards
    it launched (WorkerCapture.forwards, steps with tokens). Their difference, the offset, can only grow (a forward
    the engine did not launch through execute_model, e.g. a data-parallel dummy batch, adds a flush and no
    forward). A step whose stamp leaves the offset below the last one's had a forward without a complete flush:
    its hooks did not run (a graph replayed without them) or missed a layer, so its rows are stale:
    LostHookError. So are rows of one step that carry different stamps.

    A refusal moves the offset to what the device counted (the stale step's stamp, or the batch's checkpoint), so
    one lost flush loses the batch that holds it and the steps after it are checked, and published, against the
    new count: a graph that never stamps is still refused at every step (each falls one more flush behind)."""

    __slots__ = ("_mask", "offset", "steps", "resyncs")

    def __init__(self, top_k: int):
        self._mask = (1 << stamp_bits(top_k)) - 1
        self.offset: int | None = None      # flushes - forwards (mod 2**bits): from baseline() or the first step
        self.steps = 0
        self.resyncs = 0                    # refusals after which the offset moved to the device's count

    def baseline(self, stamp: int, forwards: int) -> None:
        """The device counter and the engine's forward count at a quiet point (after warm-up), so that the very
        first step is checked too."""
        self.offset = (stamp - forwards) & self._mask

    def __call__(self, stamps: np.ndarray, forward: int) -> None:
        v = read_stamp(stamps)
        if v is None:
            lanes = stamp_lanes(stamps)
            bad = int(np.argmax((lanes != lanes.flat[0]).any(axis=1)))
            raise LostHookError(f"routing-replay: rows of one step carry different step stamps (row 0 and row "
                                f"{bad} of {len(stamps)}): a capture hook was lost for some of the step's tokens. "
                                "Refusing to publish stale routing.")
        off = (v - forward) & self._mask
        last = self.offset
        if last is not None:
            behind = (last - off) & self._mask
            if 0 < behind <= self._mask >> 1:
                self.offset = off           # later steps are checked against what the device counted
                self.resyncs += 1
                raise LostHookError(f"routing-replay: the rows of forward {forward} carry step stamp {v}: {behind} "
                                    "complete flush(es) fewer than forwards since the last checked step. The "
                                    "forward did not run the capture hooks of every MoE layer (e.g. a CUDA graph "
                                    "replayed without them). Refusing to publish stale routing; later steps are "
                                    "checked against the device's count")
        self.offset = off
        self.steps += 1

    def exact(self, stamps: np.ndarray, forward: int, where: str) -> None:
        """Step-ring rows (read from the slot the offset predicts for `forward`): their stamps must be the ones
        that forward's flush wrote. Older: the forward did not write the slot (LostHookError); newer, or lanes
        that differ: a later step reused the slot before it was read (RingReadLost)."""
        mask = self._mask
        want = (forward + self.offset) & mask
        v = read_stamp(stamps)
        if v == want:
            self.steps += 1
            return
        if v is not None and 0 < ((want - v) & mask) <= mask >> 1:
            raise LostHookError(f"routing-replay: {where} of forward {forward} holds step stamp {v}, its flush "
                                f"would have written {want}: the forward did not run the capture hooks of every "
                                "MoE layer (e.g. a CUDA graph replayed without them). Refusing to publish stale "
                                "routing.")
        raise RingReadLost(f"routing-replay: {where} of forward {forward} was reused by a later step (stamp "
                           f"{'mixed' if v is None else v}, expected {want}) before the producer's thread read it "
                           "(it fell behind by the ring's size): the batch's rows are lost, never wrong")

    def checkpoint(self, value: int, forward: int) -> None:
        """The device counter at the batch's hand-over, when the engine had launched `forward` forwards: equal to
        forward + offset, or some step-ring read of the batch may have taken another forward's slot."""
        mask = self._mask
        want = (forward + self.offset) & mask
        v = value & mask
        if v == want:
            return
        ahead = (v - want) & mask
        if 0 < ahead <= mask >> 1:
            self.offset = (v - forward) & mask
            raise RingReadLost(f"routing-replay: the device counted {ahead} complete flush(es) more than the "
                               f"engine's forwards by forward {forward} (a forward the engine did not launch through "
                               "execute_model): this batch's step-ring reads may hold another forward's rows, so its "
                               "rows are reported lost; later steps use the new offset")
        self.resync(v, forward)             # later batches read the slots the device writes now
        raise LostHookError(f"routing-replay: the device counted {(want - v) & mask} complete flush(es) fewer than "
                            f"the engine's {forward} forwards at the hand-over: a forward did not run the capture "
                            "hooks of every MoE layer. Refusing to publish stale routing; later batches use the "
                            "device's count")

    def resync(self, value: int | None, forward: int) -> None:
        """After a step-ring read of a batch was refused: the offset from the batch's checkpoint (the device
        counter at the hand-over, when the engine had launched `forward` forwards), so that a lost flush does not
        make every later batch read the slot before its own. None (no checkpoint taken): nothing."""
        if value is None:
            return
        off = (value - forward) & self._mask
        if off != self.offset:
            self.offset = off
            self.resyncs += 1


class _BatchedRows(RowsBase):       # implements producer.handover.DeferredRows
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
        self._top_k = top_k             # host steps added raw (_StepBatch.add_host): their HostRows' top-k
        self._gone = gone               # keys whose open the producer refused at this hand-over: left out too
        self.extra_nbytes = extra_nbytes    # bytes the parts hold beyond their int16 rows (HostRows' tensors)
        self._raw = raw                 # indices of the parts added raw (_StepBatch.add_raw) until resolve(); or None
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
        elif _is_host_raw(parts[0]):        # (the step's tensors, one per MoE layer)
            self.shape = (rows, len(parts[0][0]), top_k)
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
    def deferred(self) -> bool:
        """Some steps were added raw: their id lists are engine ids until resolve() runs (producer's thread)."""
        return self._raw is not None

    def resolve(self, request_ids: list, starts: list, counts: list) -> tuple[list, list, list]:
        """On the producer's thread, before anything else reads the batch: the steps added raw (_StepBatch.add_raw:
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
                if type(p) is not tuple:    # a step copied whole (_StepBatch.add_copied): its rows are fixed
                    if lo != 0 or n != p.shape[0]:
                        raise LostHookError(f"routing-replay: a step's layout spans rows [{lo}, {lo + n}) but its "
                                            f"copy holds rows [0, {p.shape[0]}); refusing to publish them")
                elif _is_host_raw(p):       # (tensors, bytes of one, rows, dtypes)
                    parts[i] = HostRows(p[0], [(lo, n)], self._top_k, p[1], checked=False)
                    grown += n - p[2]       # (the rows the worker counted: the scheduler's, V1's too)
                else:                       # (first, rows, slot, dtypes)
                    parts[i] = (lo, n, p[2])
                    grown += n - p[1]
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
        off, mask, ring = check.offset, check._mask, copier.cache.slots
        for i, p in enumerate(parts):           # (a part taken is no tuple: a second call takes the rest only)
            if type(p) is tuple:
                # the slot the device wrote for this forward, by the offset now: the one the engine thread used,
                # unless a refused batch before this one moved the offset to the device's count since
                slot = ((forwards[i] + off) & mask) % ring if off is not None else p[2]
                parts[i] = copier.take_slot(p[0], p[1], slot, sb)
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
            if type(p) is tuple:
                if not _is_host_raw(p):     # never taken: its share of the batch's event goes back
                    self._copier.forget_slot(self._slots)
            else:
                p.release()


def _is_host_raw(part) -> bool:
    """A host step added raw (_StepBatch.add_host): (its tensors, bytes of one, rows, dtypes), until resolve()."""
    return type(part) is tuple and type(part[0]) is list


def _in_bytes(part) -> bool:
    """A step added raw with its layout as bytes (_StepBatch.add_host, add_raw with dtypes, add_copied)."""
    return _layout_dtypes(part) is not None


def _layout_dtypes(part):
    """The dtypes of the computed positions and query start locations of a step added raw with its layout as bytes:
    a tuple part's last entry (add_host, add_raw), a copied step's tag (add_copied); None for any other part."""
    if type(part) is tuple:
        return part[3] if len(part) == 4 else None
    return getattr(part, "tag", None)


def host_layouts(parts: list, raw: list, starts: list, counts: list) -> tuple[list, list]:
    """`starts` and `counts` of a batch's steps (per step) with those of the steps added raw as bytes (the runner's
    computed positions and query start locations: _StepBatch.add_host, add_raw with dtypes) as arrays; the lists
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
    """_BatchedRows.resolve's work, without changing the batch: for the steps at indices `raw`, per step (keys,
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


class _Fill:
    """One request's prefix rows on their way out of the store: positions [0, hits), whose KV slots follow from
    the request's first blocks (`blocks`, the engine's block ids), and how many were gathered so far. The slots
    are computed at the gather, for all its requests at once (hit_slots_many)."""

    __slots__ = ("rid", "key", "blocks", "hits", "done")

    def __init__(self, rid: str, key: str, blocks: list, hits: int):
        self.rid, self.key, self.blocks, self.hits, self.done = rid, key, blocks, hits, 0


class _StepBatch:
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
        self.parts.append((first, n, slot))
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
        producer's thread maps the ids to record keys and leaves out what is not captured (_BatchedRows.resolve),
        so a step costs the engine thread no work per request. With `dtypes`, `computed` and `qsl` are the bytes
        of arrays of those dtypes, and the rows are those `qsl` spans (`first` and `n`: the scheduler's count).
        `ids`, `computed` and `qsl` must not be modified afterwards; hand the batch over with
        hand_over(table=...)."""
        self.raw.append(len(self.parts))
        self.add_slot(first, n, slot, ids, computed, qsl, forward)
        if dtypes is not None:
            self.parts[-1] = (first, n, slot, dtypes)

    def add_copied(self, pending, ids: list, computed: bytes, qsl: bytes, dtypes: tuple, forward: int) -> None:
        """A step copied whole (AsyncCopier.submit of rows [0, n), mark=False), as the runner laid it out (add_raw's
        counterpart for a step larger than a ring slot): its engine ids and the bytes of its computed positions and
        query start locations (`dtypes`: theirs). The producer's thread maps the ids to keys and leaves out the
        rows of what is not captured (_BatchedRows.resolve). `ids` must not be modified afterwards; hand the batch
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
        (_BatchedRows.resolve): the engine thread makes no array and no object but the part. `tensors` and `ids`
        must not be modified afterwards; hand the batch over with hand_over(table=...)."""
        self.raw.append(len(self.parts))
        self.parts.append((tensors, tensor_nbytes, n, dtypes))
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
               _BatchedRows(self.parts, self.strict, self.stamps, self.forwards, ckpt_forward, copier, slots,
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


def show_id(request_id: str, limit: int = 64) -> str:
    """A request id for a log line: ASCII-escaped (lone surrogates and non-ASCII too), cut to `limit` characters
    of escaped text, with the id's length when cut."""
    text = ascii(request_id)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(request_id)} chars)"


def _check_fill_supported(vc) -> None:
    """Refuse ROUTING_REPLAY_PREFIX_ROWS=fill where cached KV may come from outside this worker's forwards."""
    if getattr(vc, "kv_transfer_config", None) is not None:
        raise NotImplementedError(
            "routing-replay: ROUTING_REPLAY_PREFIX_ROWS=fill with a KV connector (kv_transfer_config): KV loaded "
            "from outside this engine has no routing rows here. Use ROUTING_REPLAY_PREFIX_ROWS=sentinel.")


V1_RUNNER = "vllm.v1.worker.gpu_model_runner"      # GPUModelRunner of Model Runner V1 (persistent batch)
V2_RUNNER = "vllm.v1.worker.gpu.model_runner"      # GPUModelRunner of Model Runner V2 (CPUModelRunner subclasses it)


def runner_kind(runner) -> str:
    """"v1" or "v2": which of vLLM's model runners `runner` is (by the module of a class in its MRO, so nothing
    is imported: V2's module needs Triton). NotImplementedError for any other runner."""
    modules = {c.__module__ for c in type(runner).__mro__ if c.__name__ == "GPUModelRunner"}
    if V2_RUNNER in modules:
        return "v2"
    if V1_RUNNER in modules:
        return "v1"
    raise NotImplementedError(f"routing-replay hooks vLLM's GPUModelRunner (Model Runner V1 or V2); this worker "
                              f"runs {type(runner).__module__}.{type(runner).__name__}")


def step_layout(runner, kind: str, views: list | None = None):
    """After `Worker.execute_model` (before `sample_tokens`): (request ids in batch order, query_start_loc of
    n + 1 entries, absolute position of each request's first token in the step), or None if the step ran no
    forward. V1 keeps a persistent batch on the runner; V2 builds one per step and keeps it in
    `execute_model_state` until `sample_tokens`. `views` (V1, the caller's list of five): the views of the last
    step whose batch had as many requests are reused while the runner keeps its arrays (two numpy slices per step
    fewer, each cold after the forward)."""
    if kind == "v1":
        ib = runner.input_batch
        n = ib.num_reqs
        ids = ib.req_ids                            # the runner's own list: read, never kept or modified
        ids = ids if len(ids) == n else ids[:n]
        q, c = runner.query_start_loc.np, ib.num_computed_tokens_cpu
        if views is None:
            return ids, q[:n + 1], c[:n]
        if views[0] != n or views[1] is not q or views[2] is not c:
            views[:] = (n, q, c, q[:n + 1], c[:n])
        return ids, views[3], views[4]
    st = runner.execute_model_state
    if st is None:
        return None
    ib = st.input_batch
    n = ib.num_reqs
    ids = ib.req_ids
    return (ids if len(ids) == n else ids[:n]), ib.query_start_loc_np[:n + 1], ib.num_computed_tokens_np[:n]


def _batch_refs(ib) -> tuple:
    """(V1's InputBatch, direct): direct when its `req_ids` property hands out its `_req_ids` list (changed in place,
    never replaced) and its `num_reqs` counts its `req_id_to_index` (vLLM 0.25 to 0.33). The engine thread then reads
    those two attributes itself each step: the properties are three Python frames of vLLM's module (`cast`
    included), cold after every forward, like the frames _read_batch saves. Checked again for each new
    InputBatch."""
    try:
        direct = ib.req_ids is ib._req_ids and type(ib._req_ids) is list and ib.num_reqs == len(ib.req_id_to_index)
    except (AttributeError, TypeError):
        direct = False
    return ib, direct


def _check_runner_supported(runner, kind: str, vc) -> None:
    """Refuse engine features whose batch layout the capture does not follow (never a wrong row)."""
    pc = vc.parallel_config
    if getattr(pc, "enable_dbo", False) or int(getattr(pc, "ubatch_size", 1) or 1) > 1:
        raise NotImplementedError("routing-replay: micro-batching (enable_dbo / ubatch_size > 1) runs the routers "
                                  "once per micro-batch, each from row 0 of the step; not supported")
    if kind == "v2" and getattr(vc, "speculative_config", None) is not None:
        raise NotImplementedError(
            "routing-replay: speculative decoding on Model Runner V2: the host's num_computed_tokens is only an "
            "upper bound there (rejected drafts), so row positions would be wrong. Use Model Runner V1 "
            "(VLLM_USE_V2_MODEL_RUNNER=0) for speculative decoding.")


def ring_slots(settings: Settings, device: torch.device, data_parallel_size: int) -> int:
    """The step ring's slots for a stamped engine whose settings ask for the ring (`ring`, or `auto`), or 0 with the
    reason logged: the ring needs one data-parallel rank (its slots follow the engine's own count of forwards, and
    dummy batches are forwards it does not count), and `auto` needs the ring's Triton kernels on `device` (the torch
    slot write costs the compute stream more per step than stamps and a snapshot; docs/PERFORMANCE.md)."""
    if not settings.step_ring:
        return 0
    if data_parallel_size > 1:
        log.info("routing-replay: the step ring needs one data-parallel rank (data_parallel_size=%d): step stamps "
                 "without it", data_parallel_size)
        return 0
    if settings.ring_needs_kernels and not (ring_kernels.available(device) and ring_kernels.check(device)):
        log.info("routing-replay: ROUTING_REPLAY_STEP_STAMP=auto: the step ring's Triton kernels do not run on %s "
                 "(%s=%s): step stamps without the ring", device, ring_kernels.ENV,
                 os.environ.get(ring_kernels.ENV, "1"))
        return 0
    return STEP_RING_SLOTS


class WorkerCapture:
    """Own one worker's routing capture: the hooks bound to the model's routers, the RoutingCache they write,
    the AsyncCopier that snapshots each step's rows, the Sink (producer) that publishes them, and the map from
    engine request ids to the record keys of the requests being captured."""

    def __init__(self, worker, settings: Settings):
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        runner = worker.model_runner
        self._init_state(runner, runner_kind(runner), settings)
        vc = worker.vllm_config
        pc = vc.parallel_config
        tp, pp = get_tp_group(), get_pp_group()
        self.publisher = tp.rank_in_group == 0
        self.announces = pp.rank_in_group == 0
        if not self.publisher:
            return
        _check_runner_supported(runner, self.kind, vc)
        check_runner(runner, self.kind)

        layers = find_moe_layers(runner.get_model())
        if not layers:
            raise ValueError("routing-replay: the model has no MoE layers (no MoERunner modules)")
        local_ids = [m.layer_id for m in layers]
        global_ids = local_ids
        if pp.world_size > 1:
            gathered: list = [None] * pp.world_size
            torch.distributed.all_gather_object(gathered, local_ids, group=pp.cpu_group)
            global_ids = sorted(i for part in gathered for i in part)
        lo = global_ids.index(local_ids[0])
        layer_range = (lo, lo + len(local_ids)) if pp.world_size > 1 else None
        top_k = layers[0].top_k

        sc = vc.scheduler_config
        max_tokens = max(int(sc.max_num_batched_tokens),
                         int(getattr(vc.compilation_config, "max_cudagraph_capture_size", 0) or 0))
        self.device = runner.device
        if self.fill:
            _check_fill_supported(vc)
        eager = self.device.type == "cpu" or bool(vc.model_config.enforce_eager)
        # hooks replayed from CUDA graphs: each step's rows carry the step stamp its flush wrote (no -1 fill
        # launched before every step); hooks run in Python every step: the hook counter does that job.
        # Stamps need an even top_k (a 32/64-bit counter per row); odd top_k keeps the fill.
        stamp = not eager and self.settings.step_stamp
        if stamp and stamp_dtype(top_k) is None:
            log.info("routing-replay: step stamps need an even top_k (top_k=%d): the -1 fill before each step "
                     "checks the rows instead", top_k)
            stamp = False
        # the step ring (ROUTING_REPLAY_STEP_STAMP=ring): graph-sized steps need no launch on the engine thread.
        # It predicts a step's slot from the engine's own forward count, so forwards the engine does not launch
        # (data-parallel dummy batches) must not happen.
        slots, ring_rows = 0, 0
        if stamp and self.settings.step_ring:
            cc = vc.compilation_config
            largest = getattr(cc, "max_cudagraph_capture_size", None) or \
                max(getattr(cc, "cudagraph_capture_sizes", None) or [512])
            ring_rows = min(int(largest), max_tokens)
            slots = ring_slots(self.settings, self.device, int(pc.data_parallel_size))
        self.cache = RoutingCache(max_tokens, len(layers), top_k, device=self.device, stamp=stamp, slots=slots,
                                  slot_rows=ring_rows or None)
        if slots:
            log.info("routing-replay: step ring %d slots x %d rows (%.1f MiB on %s): steps of up to %d tokens "
                     "launch nothing on the engine thread; slot write: %s", slots, self.cache.slot_rows,
                     self.cache.ring.numel() * 2 / 2**20, self.device, self.cache.slot_rows,
                     "2 Triton kernels" if self.cache._kernels is not None else "4 torch kernels")
        # fill mode: prefix rows share the host ring with computed rows (a GRPO group's shared prompt arrives
        # n times in one step), so it gets room for more steps in flight
        self.copier = AsyncCopier(self.cache, num_slots=4 if self.fill else 2)
        self.batch = _StepBatch(self.cache.top_k, stamped=self.cache.stamped)
        self.max_batch_steps = MAX_BATCH_STEPS
        self.max_batch_rows = max(1, max_tokens // 2)        # leaves the copier's ring room for the next steps
        self.binding = CaptureBinding(layers, self.cache.record,
                                      dp_rank=int(pc.data_parallel_rank), dp_size=int(pc.data_parallel_size),
                                      gate=eager, c_hooks=bool(vc.model_config.enforce_eager))
        if self.device.type == "cpu" and vc.model_config.enforce_eager:
            # the routers' top-k tensors are host memory: a captured step's go to the producer's thread as they
            # are (HostRows), no copy into the cache nor out of it on the engine thread. Not under torch.compile
            # (it may trace the hooks) and not for a prefix store (it takes its rows from the cache).
            self.binding.take_step = self._take_step
        self.binding.bind()
        self.layer_ids = local_ids
        self.randomized = _keys.randomized_ids()
        # in_flight: read by the embedded helper's watch thread when the helper dies (a copy of the values, taken
        # in one C call under the GIL)
        self.sink = Sink(settings, single_publisher=pc.data_parallel_size == 1 and pp.world_size == 1,
                         in_flight=lambda: list(self.tracked.values()), on_restart=self.helper_restarted,
                         num_layers=len(global_ids), top_k=top_k, moe_layer_ids=global_ids,
                         layer_range=layer_range, num_experts=max(m.num_experts for m in layers) or None)
        self.producer = self.sink.producer
        log.info("routing-replay: bound %d MoE layers %s (of %s), top_k=%d, cache %d tokens (%.1f MiB on %s), "
                 "host ring %.1f MiB, requests=%s, prefix_rows=%s, model runner %s", len(layers), local_ids,
                 global_ids, top_k, max_tokens, (self.cache.nbytes + self.copier.device_bytes) / 2**20, self.device,
                 self.copier.host_bytes / 2**20, settings.requests, settings.prefix_rows, self.kind.upper())

    def _init_state(self, runner, kind: str, settings: Settings) -> None:
        """The per-worker state every rank starts with (no hooks, no cache, no producer yet); bench/
        worker_step_probe.py starts from it too."""
        self.kind = kind
        self.runner = runner
        self.settings = settings
        self.publisher = self.announces = True
        self.stats = WorkerStats()
        self.timing = False             # benchmarks: count engine-thread CPU time (stats.host_ns, binding.hook_ns)
        self._quiet = False             # while timing: this step opened, finished and preempted nothing
        self.tracked: dict[str, str] = {}       # engine request id -> record key
        self._tracked_gen = 0                   # bumped on every change of `tracked`
        self._live_keys: set = set()            # the keys of `tracked`, and some of ended requests (_unique_key)
        # engine id -> (record key, first forward it is captured in): `tracked` and the requests that ended since
        # the last hand-over, for the producer's thread to resolve steps added raw (_StepBatch.add_raw); only
        # added to between hand-overs (never a key taken from under the thread)
        self._seen: dict[str, tuple] = {}
        self._seen_shared = False               # _seen went out with a batch: a request that ended needs a new one
        self._ended: list = []                  # engine ids that ended since _seen was last cut down
        self._last_keys = (None, -1, None, True)  # (request ids, _tracked_gen, their keys, any None) of the last step
        self._last_layout = (None, None, None, None, None, None)  # post_step's per-layout results (see there)
        self.active = False
        self.storing = False                    # this step's routing goes into the prefix store (fill)
        self.fill = settings.prefix_rows == "fill"
        self.store: PrefixStore | None = None   # made when warm-up starts (KV cache sized, graphs not captured)
        self._slot_mapping = None               # the runner's persistent slot buffer the store write reads
        self._owner = None                      # _slot_owner() when the store was attached
        self._keepalive: list = []              # dropped stores that captured graphs may still write
        self.graphs_captured = False            # compile_or_warm_up_model returned (graphs hold the store write)
        self.forwards = 0                       # steps with tokens launched through execute_model (StampCheck)
        self._host_step = None                  # CPU, eager: (the step's top-k tensors by layer, bytes of one,
        #                                         whether they were checked)
        self._views = [-1, None, None, None, None]  # V1: num_reqs, the runner's two arrays, their views
        # a graph engine's step of the running batch (_ring_step): the last step went to the step ring by
        # reference and left nothing for the next pre_step but counting its forward (pre_step's first branch)
        self._steady = False
        # an eager CPU step of the running batch went to the batch as its routers' tensors (_host_raw): the plugin's
        # execute_model may leave pre_step out for the next step if it opens, ends and preempts nothing; post_step
        # then does pre_step's work itself (_late_pre_step)
        self._host_next = False
        self._ring_views = (-1, None, None, None, None, None)   # _read_batch: num_reqs, the runner's two arrays,
        #                                                         memoryviews of their step parts, dtypes
        self._raw_views = (None, None, None, None, None)    # _raw_layout: the layout arrays, memoryviews, dtypes
        self._raw_ids = None            # _raw_layout: the engine ids of the last step (a copy its steps share)
        self._ib_refs = (None, False)   # _batch_refs of the runner's InputBatch (_read_batch)
        self._closing: dict = {}                # record key -> (engine id, scheduler note): finishes sent by _flush
        self._opens: list = []                  # (engine id, Producer.open_many item): sent with the next hand-over
        self._open_items: dict = {}             # embedded: engine id -> its open item, sent again by _reopen
        self._reopen_due = False                # the embedded helper was restarted (helper_restarted)
        self._reopen_rids: set = set()          # the engine ids captured when it was
        self._ends: list = []                   # (engine id, Producer.end_many item): one call per flush / step
        self._fills: list = []                  # (engine id, key, hits, blocks, rows by reference) opened this step
        self._fill_queue: deque[_Fill] = deque()  # prefix rows waiting for their gather (room in the host ring)
        self.writers: BlockWriters | None = None   # fill + ROUTING_REPLAY_PREFIX_REFS: who computed each KV block
        self._fill_rids: set = set()            # the engine ids in the fill queue
        self._fill_wait = 0                     # steps since the fill queue was last emptied
        self._fill_rows = 0                     # rows in the fill queue (a gather is due at half a step's rows)
        self.binding = None
        self.sink = None
        self._warned_no_notes = False
        self.producer = None
        self.warming = False                    # Worker.compile_or_warm_up_model runs: V2 feeds it fake requests

    # ---- binding -----------------------------------------------------------------------------------------------

    def rebind(self, reason: str) -> None:
        """Find the MoE layers again (a reload may have rebuilt them) and re-install the hooks."""
        if self.binding is None:
            return
        layers = find_moe_layers(self.runner.get_model())
        ids = [m.layer_id for m in layers]
        if ids != self.layer_ids or (layers and layers[0].top_k != self.cache.top_k):
            raise RuntimeError(f"routing-replay: after {reason} the MoE layers are {ids} "
                               f"(top_k {layers[0].top_k if layers else None}); bound were {self.layer_ids} "
                               f"(top_k {self.cache.top_k})")
        self._host_next = False                 # the next step's pre_step runs (it empties the new hooks' list)
        self.binding.layers = layers
        self.binding.bind()
        self.stats.rebinds += 1
        if self.store is not None:              # cached KV came from the old weights: its routing is not valid
            self._invalidate_store()
        log.info("routing-replay: re-bound %d MoE layers after %s%s", len(layers), reason,
                 "; prefix store invalidated" if self.store is not None else "")

    # ---- prefix store (fill mode) ------------------------------------------------------------------------------

    def _clear_fills(self) -> None:
        """No prefix rows waiting: neither this step's opens nor the queue."""
        self._fills, self._fill_queue = [], deque()
        self._fill_rids = set()
        self._fill_wait = self._fill_rows = 0

    def _invalidate_store(self) -> None:
        """Set every stored row to -1 (new weights), after gathering the rows still queued for requests in flight:
        their KV, and so their routing, came from the old weights, and the queue waits up to 16 steps."""
        if self._fill_queue and self._store_trusted():
            self._pump_fills(force=set(self._fill_rids))
        if self.store is not None:
            self.store.invalidate()
        if self.writers is not None:            # rows of the old weights: no later hit names them
            self.writers.clear()

    def set_prefix_rows(self, mode: str) -> None:
        """Switch fill mode between steps (benchmarks compare both on one engine); call only while no captured
        request is in flight. Under CUDA graphs the store write is part of the captured graphs: `sentinel` then
        stops the gathers but the store stays (and stays written), and `fill` needs an engine started with
        ROUTING_REPLAY_PREFIX_ROWS=fill. Eager (CPU, enforce_eager): `sentinel` frees the store, `fill` starts an
        empty one at the next step."""
        if mode not in ("fill", "sentinel"):
            raise ValueError(f"prefix rows mode {mode!r}: choose fill or sentinel")
        gate = self.binding is not None and self.binding.gate
        if mode == "fill":
            _check_fill_supported(self.runner.vllm_config)
            if self.store is None and self.graphs_captured and not gate:
                raise ValueError("routing-replay: prefix rows `fill` under CUDA graphs needs the store in the "
                                 "captured graphs: start the engine with ROUTING_REPLAY_PREFIX_ROWS=fill")
        self.fill = mode == "fill"
        self._clear_fills()
        if self.writers is not None:
            self.writers.clear()
        if not self.fill and gate and self.store is not None:
            self.cache.detach_store()
            self.store = None

    def prepare_store(self) -> None:
        """Warm-up starts (the KV cache is sized, no CUDA graph is captured yet): make and attach the store, so
        every graph captured from now on writes it."""
        if self.fill and self.store is None and self.binding is not None:
            self._make_store()

    def stamp_baseline(self) -> None:
        """Warm-up is over (CUDA graphs captured, nothing in flight): with step stamps, read the device counter once
        (one synchronizing read, at start-up only) so that the first step's stamp is checked too."""
        if self.binding is None or self.batch.stamps is None:      # no capture, or no stamps
            return
        stamp = self.cache.stamp_value()
        self.batch.stamps.baseline(stamp, self.forwards)
        log.info("routing-replay: step stamps on: counter %d after warm-up and graph capture, %d forwards so far",
                 stamp, self.forwards)

    def check_captured_store(self) -> None:
        """Warm-up is over (CUDA graphs captured). The graphs hold the store write only if our hooks were in place
        while they were captured: otherwise drop the store (loudly) rather than let a replay skip a write."""
        if self.store is None or self.binding is None or self.binding.gate:
            return
        if self.cache.traced and not self.cache.traced_store:
            # torch.compile traced the hooks into the model (vLLM calls the MoE directly instead of as its opaque
            # op) before the store existed: neither the compiled code nor a graph captured from it writes the store
            cc = self.runner.vllm_config.compilation_config
            raise NotImplementedError(
                f"routing-replay: ROUTING_REPLAY_PREFIX_ROWS=fill cannot run under this execution mode "
                f"(compilation mode {getattr(cc, 'mode', None)}, cudagraph_mode {getattr(cc, 'cudagraph_mode', None)}"
                f"): torch.compile traced the MoE routers' capture hooks into the compiled model before the prefix "
                f"store existed, so no step would write it. Start the engine with enforce_eager=True, or use "
                f"ROUTING_REPLAY_PREFIX_ROWS=sentinel.")
        if not self.binding.bound():
            self._store_lost("capture hooks were not in place after CUDA graph capture")
            return
        log.info("routing-replay: prefix store write issued %d times during warm-up and graph capture "
                 "(incomplete: %d)", self.cache.store_writes, self.cache.incomplete_flushes)

    def _make_store(self) -> None:
        """Allocate the PrefixStore for every KV slot of this worker's cache (first step: its size is known only
        after vLLM sized the KV cache). On a cache layout it cannot serve, log an ERROR and fall back to -1
        prefix rows (records then say num_prefix_filled = 0): never a silently wrong row."""
        runner = self.runner
        try:
            kcc = runner.kv_cache_config
            groups = kcc.kv_cache_groups
            if len(groups) != 1:
                raise NotImplementedError(f"{len(groups)} KV cache groups (hybrid attention); the prefix store "
                                          "keys rows by the slots of one group")
            block_size = int(groups[0].kv_cache_spec.block_size)
            if self.kind == "v1":
                bt = runner.input_batch.block_table[0]
                cp = {name: int(getattr(bt, name, 1)) for name in ("dcp_world_size", "pcp_world_size")}
                slot_mapping = bt.slot_mapping.gpu          # (max tokens,) int64: this step's slots first
            else:
                bts = runner.block_tables
                cp = {"block_tables.cp_size": int(getattr(bts, "cp_size", 1)),
                      "pcp": 2 if getattr(runner, "pcp_manager", None) is not None else 1}
                slot_mapping = bts.slot_mappings[0]         # (max tokens,) int64, group 0 (written in prepare_attn)
            for name, size in cp.items():
                if size > 1:
                    raise NotImplementedError(f"context parallelism ({name}={size}) interleaves slots across "
                                              "ranks")
            num_slots = int(kcc.num_blocks) * block_size
            store = PrefixStore(num_slots, self.cache.num_layers, self.cache.top_k, device=self.device)
            # hooks that run in Python every step (CPU eager or compiled, GPU enforce_eager): post_step writes the
            # store after the forward (store_step), never the flush, which torch.compile traces into the model on
            # CPU (vLLM calls the MoE there directly, not as its opaque op) before the store exists, keeping the
            # branch taken then
            self.cache.attach_store(store, slot_mapping, in_flush=not self.binding.gate)
            kv_bytes = sum(int(t.size) for t in getattr(kcc, "kv_cache_tensors", []) or [])
        except Exception as e:          # noqa: BLE001 -- degrade to the sentinel, loudly
            self.fill = False
            log.error("routing-replay: ROUTING_REPLAY_PREFIX_ROWS=fill cannot run here (%s: %s); prefix-cached "
                      "prompt rows stay -1 (num_prefix_filled=0)", type(e).__name__, e)
            return
        self.store, self._slot_mapping, self._block_size = store, slot_mapping, block_size
        self._owner = self._slot_owner()
        if self.settings.prefix_refs:
            self.writers = BlockWriters(block_size)
        log.info("routing-replay: prefix store %d slots (%d blocks x %d), %.1f MiB on %s (%.2f%% of the KV cache's "
                 "%.1f MiB; %d B per slot); capture total: device %.1f MiB, host %.1f MiB", num_slots,
                 int(kcc.num_blocks), block_size, store.nbytes / 2**20, self.device,
                 100.0 * store.nbytes / kv_bytes if kv_bytes else float("nan"), kv_bytes / 2**20,
                 store.nbytes // num_slots, (self.cache.nbytes + self.copier.device_bytes + store.nbytes) / 2**20
                 if self.device.type != "cpu" else 0.0,
                 (self.copier.host_bytes + (store.nbytes if self.device.type == "cpu" else 0)) / 2**20)

    def _slot_owner(self):
        """The runner's persistent slot-mapping tensor (V1: group 0's buffer; V2: all groups' buffer), by
        identity: a runner that replaced it no longer writes the buffer the store write reads."""
        if self.kind == "v1":
            return self.runner.input_batch.block_table[0].slot_mapping.gpu
        return self.runner.block_tables.slot_mappings

    def _store_trusted(self) -> bool:
        """Checked before rows leave the store (not on every step): the runner still writes the slot-mapping
        buffer the store write reads. If it replaced it, rows written since sit at slots nobody has read yet; the
        whole store goes (_store_lost) before any of them could be."""
        if self._slot_owner() is self._owner:
            return True
        self._store_lost("the runner replaced its slot-mapping buffer after the store was attached")
        return False

    def _store_lost(self, why: str) -> None:
        """The store can no longer be trusted to follow the KV cache: drop it, loudly; prefix rows stay -1."""
        self.store.invalidate()
        self.cache.detach_store()
        self._keepalive.append(self.store)      # captured graphs may still write it: never free it
        self.store, self.fill = None, False
        self.writers = None
        self._clear_fills()
        log.error("routing-replay: prefix store dropped (%s); prefix-cached prompt rows stay -1 from now on "
                  "(num_prefix_filled=0)", why)

    def _forget_step(self, n: int) -> None:
        """Eager step whose hooks did not all record: its n KV slots hold no prefix rows (the forward's store
        write, if the last layer ran, stored stale rows for the missing layers)."""
        self.store.forget(self._slot_mapping[:n])
        self.stats.store_forgotten += n

    def _queue_fills(self) -> None:
        """After the forward of their first step (which wrote the store): the KV slots of rows [0, hits) of each
        request opened this step with prefix hits, queued for the gather (the request holds those blocks until it
        finishes or is preempted, so the slots keep their rows until then)."""
        fills, self._fills = self._fills, []
        bs = self._block_size
        queue, rids = self._fill_queue, self._fill_rids
        for rid, key, hits, blocks, covered in fills:
            self.stats.prefix_ref_rows += covered
            if covered >= hits:                 # every hit named by reference: nothing to gather
                continue
            f = _Fill(rid, key, blocks[:(hits + bs - 1) // bs], hits)     # (a copy: C speed)
            f.done = covered                    # rows [0, covered) go by reference (prefix_refs)
            queue.append(f)
            rids.add(rid)
            self._fill_rows += hits - covered
        self.stats.prefix_requests += len(fills)
        self.stats.prefix_rows += sum(f[2] for f in fills)

    def _pump_fills(self, force: set | None = None) -> None:
        """Gather queued prefix rows into the host ring, oldest first, up to half a step's rows per gather (many
        requests' rows in one index_select), while the ring keeps room for two worst-case steps (the steps' own
        rows are never pushed out by prefix rows). `force`: only the requests with these engine ids, whose
        blocks are freed in this step (finished, preempted): their rows go now, dropped (published as lost, the
        record says so) if the ring is full."""
        q = self._fill_queue
        chunk = max(1, self.copier.max_rows // 2)
        if force:
            forced = deque(f for f in q if f.rid in force)
            self._fill_queue = q = deque(f for f in q if f.rid not in force)
            self._fill_rids -= force
            while forced:
                self._gather(forced, chunk, may_drop=True)
            return                              # the others wait for their turn (post_step)
        reserve = 2 * self.copier.max_rows
        while q:
            want = min(chunk, self._fill_rows)      # (the rows still queued: no walk over the queue)
            if self.copier.free_rows < want + reserve or not self._gather(q, chunk, may_drop=False):
                return
        self._fill_wait = 0

    def _gather(self, q: deque, chunk: int, may_drop: bool) -> bool:
        """One gather of up to `chunk` rows taken from the front of `q` (whole requests while they fit, then part
        of the next); finished requests leave the queue. False if the ring had no room (nothing taken)."""
        keys, starts, counts, spans = [], [], [], []
        room = chunk
        for f in q:
            if room == 0:
                break
            n = min(room, f.hits - f.done)
            keys.append(f.key)
            starts.append(f.done)
            counts.append(n)
            spans.append((f.blocks, f.done, n))
            room -= n
        slots = hit_slots_many(spans, self._block_size)     # every request's slots in a few numpy calls
        pending = self.copier.submit_gather(self.store.rows, slots, may_drop=may_drop)
        if pending is None:
            return False
        for n in counts:
            f = q[0]
            f.done += n
            if f.done == f.hits:
                q.popleft()
                self._fill_rids.discard(f.rid)
        self._fill_rows -= sum(counts)
        if pending.dropped:                     # host ring full: published as lost, the record says so
            self._flush()
            self.producer.publish_rows(keys, starts, counts, pending)
            return True
        self.batch.add(pending, keys, starts, counts, strict=False)
        if self.batch.rows >= self.max_batch_rows:
            self._flush()
        return True

    # ---- per step ----------------------------------------------------------------------------------------------

    def _late_pre_step(self, so) -> None:
        """pre_step's work, at post_step's start, for a step the plugin's execute_model left it out of: the last
        step was an eager CPU step of the running batch handed over as its routers' tensors (_host_raw, which arms
        `_host_next`) and this one opens, ends, preempts and speculates nothing (plugin.py). Then nothing pre_step
        does has to precede the forward: the C hooks keep every layer's tensor whatever the binding says, in the
        list the last post_step emptied. One entry into the plugin per step instead of two (right after a forward
        each entry pays its cold cache lines). Here: pre_step's short
        path where a captured request ran, else all of pre_step (which then lets go of nothing)."""
        self._host_next = False
        n = so.total_num_scheduled_tokens
        tracked = self.tracked
        if n and tracked and not tracked.keys().isdisjoint(so.num_scheduled_tokens):
            self._steady = False
            self.forwards += 1
            self.active = True
            st = self.stats
            st.steps += 1
            st.pre_skipped += 1
            b = self.binding
            b.calls, b.min_rows = 0, n
            if self.timing:
                self._quiet = True
                st.quiet_steps += 1
            return
        self._steady = False            # pre_step's general path (no captured request runs: it lets go of nothing)
        self.stats.pre_skipped += 1
        self.pre_step(so)

    def pre_step(self, so) -> None:
        self._host_next = False
        if self.warming:                # V2 start-up warm-up: fake requests, fake blocks; nothing to capture
            self.active = self.storing = False
            return
        t0 = time.thread_time_ns() if self.timing else 0
        w0 = time.perf_counter_ns() if t0 else 0
        st = self.stats
        st.steps += 1
        # (isdisjoint walks the step's dict until a tracked id: with nothing tracked, all of it; so it goes last)
        if self._steady and self.tracked and not (so.scheduled_new_reqs or so.finished_req_ids
                                                  or so.preempted_req_ids or so.scheduled_spec_decode_tokens
                                                  or self.writers is not None and self.writers.prefill) \
                and so.total_num_scheduled_tokens and not self.tracked.keys().isdisjoint(so.num_scheduled_tokens):
            # the running batch's step after one that went by reference: to the ring (_ring_step, a graph engine)
            # or as the routers' tensors (_host_raw, CPU eager): nothing opens, ends or waits for the store, a
            # captured request runs; of the path below only the forward's count is left and, eager, the hooks'
            # count and list (a forward since the last post_step, one that raised or ran outside a step, may have
            # left tensors there). Armed again by that post_step only
            self._steady = False
            self.forwards += 1
            self.active = True
            b = self.binding
            if b.gate:
                b.calls, b.min_rows = 0, so.total_num_scheduled_tokens
                b.clear()
            if t0:
                self._quiet = True
                st.quiet_steps += 1
                self._count_host(t0, w0)
            return
        if t0:
            self._quiet = not (so.scheduled_new_reqs or so.finished_req_ids or so.preempted_req_ids)
            st.quiet_steps += self._quiet
        if not (self.tracked or so.scheduled_new_reqs or self.fill or self._closing):
            # nothing captured runs, none starts, no prefix store: the step's counts and the forward, no more
            # (an opt-out engine's every step: its cost on the engine thread is a target, docs/PERFORMANCE.md)
            if so.preempted_req_ids:
                st.preempted += len(so.preempted_req_ids)
            if so.scheduled_spec_decode_tokens:
                st.spec_steps += 1
            if so.total_num_scheduled_tokens:
                self.forwards += 1
            self.active = self.storing = False
            b = self.binding
            b.active = not b.gate
            if t0:
                self._count_host(t0, w0)
            return
        if so.preempted_req_ids:
            st.preempted += len(so.preempted_req_ids)
        if so.scheduled_spec_decode_tokens:
            st.spec_steps += 1
        if self._reopen_due:        # (before this step's finishes: a request's open again goes before its finish)
            self._reopen()
        tracked = self.tracked
        if self._fill_rids and (so.finished_req_ids or so.preempted_req_ids):
            freed = self._fill_rids.intersection(so.finished_req_ids)
            if so.preempted_req_ids:
                freed |= self._fill_rids.intersection(so.preempted_req_ids)
            if freed and self._store_trusted():     # their blocks may be reused by this step's forward
                self._pump_fills(force=freed)
        if tracked and so.finished_req_ids and not tracked.keys().isdisjoint(so.finished_req_ids):
            notes = getattr(so, scheduler_hooks.ATTR, None)
            if notes is not None and self.batch.parts:
                # the common step: every captured request that finishes has its note and its last rows in the
                # batch; their finishes wait for it together (C-speed maps, no Python line per request)
                ended = [rid for rid in so.finished_req_ids if rid in tracked]
                infos = list(map(notes.get, ended))
                if None not in infos:
                    keys = list(map(tracked.pop, ended))
                    self._tracked_gen += 1
                    self._ended += ended
                    self._closing.update(zip(keys, zip(ended, infos)))
                    ended = ()
            else:
                ended = so.finished_req_ids
            for rid in ended:
                key = tracked.pop(rid, None)
                self._tracked_gen += 1
                if key is None:
                    continue
                self._ended.append(rid)
                info = notes.get(rid) if notes is not None else None
                if info is not None and self.batch.parts:
                    # a request's rows go out before its finish: this one goes right after the batch that holds
                    # its last rows (_flush), not with a batch cut short here (a publish, and the batch's event,
                    # per finish would cost the engine thread several times a step's work)
                    self._closing[key] = (rid, info)
                else:
                    if self.batch.parts:        # (no note: the finish is the runner's view now, after the rows)
                        self._flush()
                    # an empty batch holds none of its rows: the finish goes with the step's others (one
                    # end_many below, not one per finish; the ids leave _seen at the next hand-over)
                    self._close_request(rid, key, info)
            if self._ends:
                self._send_ends()
        n = so.total_num_scheduled_tokens
        store = self.store
        if store is None and self.fill and n and (self.binding.gate or not self.graphs_captured):
            self._make_store()
            store = self.store
        if store is not None and so.scheduled_new_reqs and not self._store_trusted():
            store = None                            # before a request opens with rows from it
        writers = self.writers
        if writers is not None and writers.prefill:     # blocks the captured prompts compute (prefix_refs.py)
            if so.finished_req_ids or so.preempted_req_ids:
                writers.ended(so.finished_req_ids)
                writers.ended(so.preempted_req_ids or ())
            writers.step(so.scheduled_cached_reqs, so.num_scheduled_tokens)
        for new in so.scheduled_new_reqs:
            if new.req_id not in tracked:
                self._open_request(new, so.num_scheduled_tokens)
        if self._opens and self.fill:
            # with a prefix store, each step's opens go at once: waiting for the hand-over costs fill engines
            # engine-thread time every step (docs/VLLM.md, "Step ring")
            self._send_opens()
        active = bool(tracked) and not tracked.keys().isdisjoint(so.num_scheduled_tokens)
        self.active = active
        if self._closing and not active:
            self._flush()           # no captured request runs: the batch and the finishes waiting for it go now
        if n:                       # (after every _flush of this call: a batch's hand-over counts forwards run)
            self.forwards += 1      # this step runs the model: with stamps, its flush counts it too
        storing = store is not None and n > 0
        b = self.binding
        b.active = active or storing or not b.gate
        # post_step's store work: on eager steps, the hooks' count (incomplete steps' slots are forgotten); the
        # gathers of prefix rows. Under CUDA graphs with nothing to gather there is none (the forward wrote the
        # store) but the flush check (post_step).
        self.storing = storing and (b.gate or bool(self._fills) or bool(self._fill_queue))
        if b.gate:
            if active or storing:               # hooks run in Python: count the ones that cover the step
                b.calls, b.min_rows = 0, so.total_num_scheduled_tokens
                b.clear()       # tensors a step left (one not captured, whose C hooks kept them; one whose
                self._host_step = None      # forward raised before post_step) must not count for this one
        elif active and not self.cache.stamped:     # replayed from graphs: rows no router writes stay -1 (the
            self.cache.fill_step(n)             # store needs no fill: its write checks the layers at capture)
        if t0:
            self._count_host(t0, w0)

    # ---- per request: nothing here raises into vLLM's step for one request's sake ------------------------------

    def _open_request(self, new, scheduled: dict | None = None) -> None:
        """Start capturing a newly scheduled request, under its record key; a request whose id cannot travel is
        captured under the derived key, one whose capture fails otherwise is skipped (WARNING, stats.skipped).
        Its open waits in self._opens for the next hand-over to the producer (_send_opens; with a prefix store,
        for the end of pre_step)."""
        if new.req_id in self._seen:
            self._flush()           # the batch may hold raw steps where this id is a request that ended
        try:
            if not self.settings.captures(new.sampling_params):
                return
            key, problem = _keys.capture_key(new.req_id, self.randomized)
            key, dup = self._unique_key(key)
            if key in self._closing:
                self._flush()       # the key's last request finishes first: its finish waits for no batch now
            prompt = new.prompt_token_ids              # None for prompt embeddings: no token ids to carry
            prompt_len = len(prompt) if prompt is not None else int(new.prompt_embeds.shape[0])
            refs, covered = (), 0
            if self.writers is not None and self.store is not None and self.fill:
                # which of its hit blocks a captured request computed (prefix_refs.py); records what it computes
                refs, covered = self.writers.open(new.req_id, key, prompt, new.block_ids[0],
                                                  int(new.num_computed_tokens), prompt_len,
                                                  (scheduled or {}).get(new.req_id, 0))
            if self.announces:
                item = (key, prompt_len, int(new.num_computed_tokens), prompt, self.fill and self.store is not None)
                if refs:
                    item += (refs,)
                self._opens.append((new.req_id, item))
                if self.sink is not None and self.sink.pipeline is not None:
                    self._keep_open(new.req_id, item)
            if self.fill and self.store is not None and new.num_computed_tokens:
                # the request's KV blocks of group 0 as the scheduler allocated them, hits first (what both
                # runners append to their block tables); slot = block x block size + offset
                self._fills.append((new.req_id, key, int(new.num_computed_tokens), new.block_ids[0], covered))
        except Exception as e:          # noqa: BLE001 -- one request's problem; engine-wide ones re-raise
            self._skip(new.req_id, "open", e)
            return
        self.tracked[new.req_id] = key
        self._seen[new.req_id] = (key, self.forwards + 1)     # (this step's forward, once pre_step counts it)
        self._tracked_gen += 1
        live = self._live_keys
        live.add(key)
        if len(live) > 2 * len(self.tracked) + 64:
            self._live_keys = set(self.tracked.values())
        if dup is not None:
            self.stats.duplicate_keys += 1
            log.warning("routing-replay: request %s has the record key %s of a request still being captured; "
                        "captured as %s (duplicate_keys=%d)", show_id(new.req_id), show_id(dup), show_id(key),
                        self.stats.duplicate_keys)
        if problem is not None:
            self.stats.derived_keys += 1
            log.warning("routing-replay: request %s cannot be a record key (%s); captured as %s "
                        "(derived_keys=%d)", show_id(_keys.external_key(new.req_id, self.randomized)), problem,
                        key, self.stats.derived_keys)

    def _keep_open(self, rid: str, item: tuple) -> None:
        """Keep a request's open (embedded mode) to send again if the helper process dies (_reopen). Entries of
        requests that ended are pruned when the table holds twice the tracked requests (amortised O(1))."""
        kept = self._open_items
        kept[rid] = item
        if len(kept) > 2 * len(self.tracked) + 64:
            tracked = self.tracked
            self._open_items = {r: it for r, it in kept.items() if r in tracked or r == rid}

    def helper_restarted(self) -> None:
        """The embedded helper was started again (its watch thread calls this): the opens of the requests captured
        now go again with the next hand-over, those that are still captured then (_reopen, on the engine thread;
        the ids copied here in one C call under the GIL)."""
        self._reopen_rids = set(self.tracked)
        self._reopen_due = True

    def _reopen(self) -> None:
        """Send the opens of the requests being captured again: the new helper's consumer knew none of them, so
        their records get their prompt length and tokens (and come out incomplete: the rows the dead helper held
        are listed missing). A request whose open is still queued is left to that one."""
        self._reopen_due = False
        queued = {rid for rid, _ in self._opens}
        then, self._reopen_rids = self._reopen_rids, set()
        items = [(rid, it) for rid, it in self._open_items.items()
                 if rid in then and rid not in queued and self.tracked.get(rid) == it[0]]
        self._opens += items
        log.warning("routing-replay: opens of %d requests in flight sent again to the restarted helper",
                    len(items))

    def _unique_key(self, key: str) -> tuple[str, str | None]:
        """(key, None) if no live request has `key`; else (the first free f"{key}#{n}", key). Live: opened here
        and its finish not yet handed to the producer (`tracked`, `_closing`), so two requests in flight never
        share a record key (their rows would mix in one record) and a key's finish always precedes its reuse.
        `_live_keys` holds every tracked key and keys of requests that ended since it was last rebuilt: a key
        found there is checked against `tracked` itself (a scan, for a suspected duplicate only), so an open
        costs two set lookups; the set is rebuilt once it holds twice the tracked requests (amortised O(1))."""
        if not self._is_live(key):
            return key, None
        n = 1
        while self._is_live(cand := _ids.duplicate_key(key, n)):
            n += 1
        return cand, key

    def _is_live(self, key: str) -> bool:
        return key in self._closing or (key in self._live_keys and key in self.tracked.values())

    def _send_opens(self) -> set | None:
        """The opens since the last hand-over in one producer call, ahead of anything that carries their rows or
        finishes (_flush, _send_ends, _failed_end): not one call per step. A request whose open fails is not
        captured from then on (as _open_request); the rows of it that the batch already holds do not go out
        (the producer screens the id, or the batch leaves it out: take_parts). Returns the keys that failed."""
        opens, self._opens = self._opens, []
        try:
            # (prompt lists by reference: vLLM never modifies a request's prompt_token_ids)
            failed = self.producer.open_many([item for _, item in opens], ids_checked=True, tokens_frozen=True)
        except Exception as e:          # noqa: BLE001 -- engine-wide (the producer failed) re-raises in _skip
            failed = [(i, e) for i in range(len(opens))]
        self.stats.opened += len(opens) - len(failed)
        for i, e in failed:
            rid = opens[i][0]
            if self.tracked.pop(rid, None) is not None:
                self._tracked_gen += 1
            if rid in self._seen:       # raw steps of the batch then leave its rows out (no key for the id)
                if self._seen_shared:   # (a handed-over batch's table: copied first, as _cut_seen does)
                    self._seen = self._seen.copy()
                    self._seen_shared = False
                del self._seen[rid]
            if self._fills:             # (fill: sent in the step it opened, before its prefix rows are queued)
                self._fills = [f for f in self._fills if f[0] != rid]
            if self.writers is not None:    # never named as a writer: no consumer holds its rows
                self.writers.forget_key(opens[i][1][0])
                self.writers.ended((rid,))
            self._skip(rid, "open", e)
        return {opens[i][1][0] for i, _ in failed} or None

    def _skip(self, rid: str, what: str, error: Exception) -> None:
        """Log and count a per-request failure; re-raise it if the producer itself failed (engine-wide)."""
        p = self.producer
        # The producer's own failure (its thread died: a bug there; a delta it cannot resolve or encode is dropped,
        # and it goes on) or a closed producer fails every request alike: that stops the engine as before.
        if p is not None and not p.healthy:
            raise error
        self.stats.skipped += 1
        log.warning("routing-replay: %s of request %s failed, its routing is not captured: %s: %s (skipped=%d)",
                    what, show_id(rid), type(error).__name__, str(error)[:200], self.stats.skipped)

    def _close_request(self, rid: str, key: str, info) -> None:
        """The request's finish (or abort) into self._ends, sent with the others of this flush or step
        (_send_ends); `info` is the scheduler's note of it, None when none came."""
        try:
            end = self._end_of(rid, key, info)
        except Exception as e:          # noqa: BLE001 -- one request's problem; engine-wide ones re-raise
            self._failed_end(rid, key, e)
            return
        if end is not None and self.announces:
            self._ends.append((rid, end))

    def _failed_end(self, rid: str, key: str, e: Exception) -> None:
        self._skip(rid, "finish", e)
        if self.announces:
            if self._opens:     # (the request may have opened since the last hand-over: its open goes first)
                self._send_opens()
            try:                    # the consumer would otherwise wait request_timeout_s for the finish
                self.producer.abort(key, "capture_error")
            except Exception as e2:  # noqa: BLE001
                log.warning("routing-replay: abort of %s after a failed finish failed too: %s", show_id(key), e2)

    def _end_of(self, rid: str, key: str, info) -> tuple | None:
        """(kind, key, num_output, reason, output ids) for Producer.end_many."""
        if info is None:
            # The scheduler hook did not see this request finish (a scheduler class that does not derive from
            # vLLM's Scheduler, or settings that differ between processes): use the worker's own view.
            if not self._warned_no_notes:
                log.warning("routing-replay: no finish notes from the scheduler for %r; using the worker's "
                            "output count (may be one token long under async scheduling)", key)
                self._warned_no_notes = True
            requests = getattr(self.runner, "requests", None)      # V1 only: V2 keeps output tokens on the device
            st = requests.get(rid) if requests is not None else None
            if st is None:
                log.warning("routing-replay: request %s finished without finish notes from the scheduler and the "
                            "runner keeps no output tokens for it; its record is aborted (capture_error)",
                            show_id(rid))
                return ("abort", key, None, "capture_error", None)
            out = list(st.output_token_ids)
            info = scheduler_hooks.Finished(len(out), "unknown", out)
        if info.num_output_tokens == 0 and info.reason == "abort":
            return ("abort", key, 0, "abort", None)
        return ("finish", key, info.num_output_tokens, info.reason, info.output_token_ids)

    def _send_ends(self) -> None:
        """The finishes and aborts collected since the last call, in one producer call."""
        if self._opens:                     # (a request that opened since the last hand-over ends: open first)
            self._send_opens()
        ends, self._ends = self._ends, []
        try:
            # (output ids by reference: the scheduler hook's own list, or _end_of's)
            self.producer.end_many([end for _, end in ends], tokens_frozen=True)
        except Exception as e:          # noqa: BLE001 -- engine-wide (the producer failed) re-raises in _skip
            for rid, end in ends:
                self._failed_end(rid, end[1], e)
            return
        finished = [end[0] for _, end in ends].count("finish")
        self.stats.finished += finished
        self.stats.aborted += len(ends) - finished

    def post_step(self, so) -> None:
        if self._host_next:
            self._late_pre_step(so)
        active, storing = self.active, self.storing
        if not active and not storing:
            if self.store is not None:  # a step run outside the graphs whose last hook was lost ended without its
                self.cache.flush()      # flush: end it now (its slots get -1 in the store); else a no-op
            b = self.binding
            if b.gate and b.c_hooks:
                b.clear()               # eager: what the C hooks kept of a step not captured (binding._make_hook)
            return
        t0 = time.thread_time_ns() if self.timing else 0
        w0 = time.perf_counter_ns() if t0 else 0
        b = self.binding
        if not b.gate and not storing and self.cache.slots and self.kind == "v1" and self._ring_step(so, t0, w0):
            return
        self._steady = False
        # ends the step: an eager step's layers held are handed over (_take_step, while `active` still says the
        # step is captured; the C hooks of enforce_eager engines keep every layer's tensor until here, other
        # engines' last hook drained already), and the cache's flush resets its per-step count, so the next step
        # is judged on its own, and forgets this step's slots
        host = None
        if b.gate:
            held = b.held
            if active and b.take_step is not None and not self.fill and all(map(_HOLDS, held)):
                # CPU, enforce_eager: every layer's C hook kept its tensor (binding._make_hook); they go to the
                # producer's thread as they are, where HostRows checks them (2-D, top_k columns, the step's rows,
                # integer ids): no torch attribute is read here (cold after the forward, each read is costly)
                tensors = held[:]
                held[:] = [None] * len(held)
                b.calls = len(tensors)
                self.active = self.storing = False
                self._host_raw(so, tensors, b.min_rows, t0, w0)
                return
            try:
                b.drain()
            finally:
                self.active = self.storing = False
            host, self._host_step = self._host_step, None
        else:
            self.active = self.storing = False
        self.cache.flush()
        complete = True
        if b.gate:
            complete = b.calls == len(b.layers)
            if not complete and active:
                raise LostHookError(f"routing-replay: {b.calls} of {len(b.layers)} MoE layers recorded the "
                                    f"routing of all {b.min_rows} tokens of this step; hooks bound: "
                                    f"{b.bound()}. Refusing to publish stale routing.")
        if storing:
            if complete and b.gate:
                self.cache.store_step(so.total_num_scheduled_tokens)
            elif not complete:
                self._forget_step(so.total_num_scheduled_tokens)
                log.warning("routing-replay: %d of %d MoE layers recorded this step's routing; its %d KV "
                            "slots hold no prefix rows (store_forgotten=%d)", b.calls, len(b.layers),
                            so.total_num_scheduled_tokens, self.stats.store_forgotten)
            if self._fills and self._store_trusted():     # (else the store went, and both queues with it)
                self._queue_fills()
            if self._fill_queue:
                # one gather per batch's worth of steps, not one per request opened (each gather is torch
                # calls on this thread); a request whose blocks are freed before its turn is gathered then
                # (pre_step)
                self._fill_wait += 1
                if (self._fill_wait >= self.max_batch_steps or self._fill_rows >= self.copier.max_rows // 2) \
                        and self._store_trusted():
                    self._pump_fills()
        if not active:
            if t0:
                self._count_host(t0, w0)
            return
        layout = step_layout(self.runner, self.kind, self._views)
        if layout is None:
            if t0:
                self._count_host(t0, w0)
            return
        req_ids, qsl, computed = layout
        if self.cache.slots:
            n = so.total_num_scheduled_tokens
            slot = self._ring_slot(None, n)
            if slot is not None:
                # the whole step is in its ring slot: it goes to the producer's thread as the runner laid it out,
                # which maps the ids to keys and leaves out what is not captured (_BatchedRows.resolve)
                ids, cb, qb, dtypes = self._raw_layout(req_ids, qsl, computed)
                batch = self.batch
                batch.add_raw(0, n, slot, ids, cb, qb, self.forwards, dtypes)
                self.stats.ring_steps += 1
                self._stepped(batch, n, t0, w0)
                return
        last_ids, last_gen, keys, uncaptured = self._last_keys
        # decode steps repeat the batch: compared item by item by identity (C speed, no id touched); the list
        # is copied and mapped to keys only when it changed
        changed = last_gen != self._tracked_gen or last_ids != req_ids
        if changed or keys is None:
            req_ids = list(req_ids)
            tracked = self.tracked
            keys = list(map(tracked.get, req_ids))     # C speed: churn steps change the list every step
            uncaptured = None in keys
            self._last_keys = (req_ids, self._tracked_gen, keys, uncaptured)
        qb = qsl.tobytes()                          # decode steps repeat the layout too: one compare, C speed
        last = self._last_layout
        if last[0] == qb and last[1] is keys:
            keys, sel, count, segments = last[2:]
        else:
            full = keys
            first = qsl[:-1]
            count = qsl[1:] - first
            sel = None
            # (count_nonzero, not count.all(): .all() and .sum() go through numpy's Python reduce wrappers, Python
            # frames on the engine thread every changed step)
            if uncaptured or np.count_nonzero(count) != len(count):
                sel = np.array([k is not None for k in keys], dtype=bool) & (count > 0)
                keys = [k for k, on in zip(keys, sel.tolist()) if on]
                first, count = first[sel], count[sel]
            if not keys:
                segments = None
            elif sel is None:                   # the whole batch, in order: one contiguous run (the common case)
                lo = int(qsl[0])
                segments = [(lo, int(qsl[-1]) - lo)]
            else:
                total = int(count.sum())
                if int(first[-1]) + int(count[-1]) - int(first[0]) == total:
                    segments = [(int(first[0]), total)]
                else:
                    segments = list(zip(first.tolist(), count.tolist()))
            # (layout bytes, the key list it was mapped with, then what this step hands over): never modified
            self._last_layout = (qb, full, keys, sel, count, segments)
        if not keys:
            if t0:
                self._count_host(t0, w0)
            return
        # the runner's array changes with the next step: this step's copy
        computed = computed.copy() if sel is None else computed[sel]
        batch = self.batch
        slot = self._ring_slot(segments, so.total_num_scheduled_tokens) if self.cache.slots else None
        if slot is not None:                    # the forward's flush put the rows in its slot: nothing to launch,
            first, n = segments[0]              # and the producer's thread takes their host-ring rows
            batch.add_slot(first, n, slot, keys, computed, count, self.forwards)
            self.stats.ring_steps += 1
        elif host is not None:                  # CPU, eager: the routers' tensors themselves, by reference
            pending = HostRows(host[0], segments, self.cache.top_k, host[1], checked=host[2])
            n = pending.shape[0]
            batch.add(pending, keys, computed, count, forward=self.forwards)
            self.stats.host_steps += 1
        else:
            pending = self.copier.submit(segments, mark=False)     # one event per batch, recorded in _flush
            n = pending.shape[0]
            if pending.dropped:                                  # host ring full: publish as lost, keep order
                self._flush()
                self.producer.publish_rows(keys, computed, count, pending)
            else:
                batch.add(pending, keys, computed, count, forward=self.forwards)
        self._stepped(batch, n, t0, w0)

    def _ring_step(self, so, t0: int, w0: int) -> bool:
        """post_step of a V1 graph engine's captured step that writes nothing to the prefix store: the path below
        (flush, layout, slot, raw layout, the batch) in one frame, for the running batch's every step; a step
        larger than a ring slot is copied whole and goes raw the same way. False, having done nothing but the
        flush, before the stamp baseline: the general path takes the step then."""
        self.active = False
        cache = self.cache
        cache.flush()           # (a no-op for a graph-replayed step; ends an eager step whose last hook was lost)
        nt = so.total_num_scheduled_tokens
        stamps = self.batch.stamps
        off = stamps.offset
        if off is None:
            return False
        big = nt > cache.slot_rows      # (a prefill chunk beyond the largest CUDA graph: copied whole, below)
        last, rv = self._read_batch()
        batch = self.batch
        st = self.stats
        if big:
            # rows [0, nt) copied whole (one launch; the rows of requests not captured are left out on the
            # producer's thread, which maps the ids to keys as for a ring step): no numpy call, no key, nothing
            # per request here (a large chunk's layout, keys and counts would cost the engine thread per token)
            pending = self.copier.submit([(0, nt)], mark=False)
            if pending.dropped:
                self._copy_dropped(pending, last, rv)
            else:
                batch.add_copied(pending, last, bytes(rv[4]), bytes(rv[3]), rv[5], self.forwards)
                st.copied_steps += 1
        else:
            # the slot this step's flush wrote (as _ring_slot); the step as the runner laid it out (as
            # _raw_layout, _StepBatch.add_raw): the producer's thread maps the ids to keys (_BatchedRows.resolve)
            batch.add_raw(0, nt, ((self.forwards + off) & stamps._mask) % cache.slots, last, bytes(rv[4]),
                          bytes(rv[3]), self.forwards, rv[5])
            st.ring_steps += 1
        st.active_steps += 1
        st.rows += nt
        if len(batch.parts) >= self.max_batch_steps or batch.rows >= self.max_batch_rows:
            self._flush()
        self._steady = not (self._opens and self.fill)
        if t0:
            self._count_host(t0, w0)
        return True

    def _copy_dropped(self, pending, ids: list, rv: tuple) -> None:
        """_ring_step's whole-step copy found the host ring full (rare): as the general path does, the batch goes
        first and the step's captured requests get their rows published as lost (Producer.publish_rows), mapped
        as the producer's thread maps a raw step (resolve_raw_steps)."""
        self._flush()
        qsl = np.frombuffer(rv[3], dtype=rv[5][0])
        computed = np.frombuffer(rv[4], dtype=rv[5][1]).copy()      # (the runner's array changes next step)
        keys, starts, counts, _, _ = resolve_raw_steps([0], self._seen, [self.forwards], [ids], [computed], [qsl])
        # (a dropped copy holds no rows: it stands for those of the requests kept, as the general path's does)
        pending.shape = (int(np.sum(counts[0])), *pending.shape[1:])
        self.producer.publish_rows(keys[0], starts[0], counts[0], pending)

    def _host_raw(self, so, tensors: list, n: int, t0: int, w0: int) -> None:
        """post_step of an eager CPU step whose every MoE layer's C hook kept its tensor: the step goes to the
        producer's thread as the runner laid it out (_StepBatch.add_host), which maps its ids to record keys,
        leaves out what is not captured and checks the tensors (_BatchedRows.resolve, HostRows). Here: the
        tensors, the engine ids and the bytes of the runner's two layout arrays (V1: _read_batch, as _ring_step;
        else step_layout, _raw_layout). No array, no per-request work, no torch call but one dtype read."""
        if self.kind == "v1":
            ids, rv = self._read_batch()
            cb, qb, dtypes = bytes(rv[4]), bytes(rv[3]), rv[5]
        else:
            layout = step_layout(self.runner, self.kind, self._views)
            if layout is None:
                if t0:
                    self._count_host(t0, w0)
                return
            ids, cb, qb, dtypes = self._raw_layout(*layout)
        batch = self.batch
        batch.add_host(tensors, n * self.cache.top_k * tensors[0].dtype.itemsize, n, ids, cb, qb, dtypes,
                       self.forwards)
        self.stats.host_steps += 1
        self._steady = True         # (post_step emptied the held list: the next pre_step may take its short path)
        self._host_next = True      # (or the next step may leave pre_step out: _late_pre_step)
        self._stepped(batch, n, t0, w0)

    def _read_batch(self) -> tuple:
        """V1: the runner's batch as _ring_step and _host_raw hand it over: (its engine ids, the last step's copy while
        the batch repeats them; (num_reqs, the runner's two layout arrays, memoryviews of their step parts, their
        dtypes), kept while the runner keeps its arrays). `_req_ids` and `req_id_to_index` are read directly where
        `_batch_refs` allows it (vLLM's properties are three cold frames a step). The runner's own list is read,
        never kept or modified."""
        runner = self.runner
        ib = runner.input_batch
        refs = self._ib_refs
        if refs[0] is not ib:
            refs = self._ib_refs = _batch_refs(ib)
        if refs[1]:
            ids, n = ib._req_ids, len(ib.req_id_to_index)
        else:
            ids, n = ib.req_ids, ib.num_reqs
        if len(ids) != n:
            ids = ids[:n]
        q, c = runner.query_start_loc.np, ib.num_computed_tokens_cpu
        rv = self._ring_views
        if rv[0] != n or rv[1] is not q or rv[2] is not c:
            rv = self._ring_views = (n, q, c, memoryview(q[:n + 1]), memoryview(c[:n]), (q.dtype, c.dtype))
        last = self._raw_ids
        if last != ids:                             # (C speed: decode steps repeat the batch)
            last = self._raw_ids = list(ids)
        return last, rv

    def _raw_layout(self, req_ids, qsl, computed) -> tuple:
        """A step's layout as it goes raw to the producer's thread: (engine ids, bytes of the computed positions,
        bytes of the query start locations, their dtypes). The ids are the last step's copy while the batch
        repeats them (one compare, C speed); the bytes are copied through memoryviews kept while the runner keeps
        its arrays (a numpy call right after the forward runs cold; `bytes` of a memoryview is a single C
        call)."""
        mv = self._raw_views
        if mv[0] is not qsl or mv[1] is not computed:
            mv = self._raw_views = (qsl, computed, memoryview(qsl), memoryview(computed), (qsl.dtype, computed.dtype))
        ids = self._raw_ids
        if ids != req_ids:
            ids = self._raw_ids = list(req_ids)
        return ids, bytes(mv[3]), bytes(mv[2]), mv[4]

    def _take_step(self, held: list, sig: tuple | None = None) -> None:
        """binding.drain's target on an eager CPU engine, with the step's top-k tensor of each MoE layer (the list
        is emptied) and, where the binding checked it, the (shape, dtype) they all share (every layer holds a 2-D
        tensor covering the step). A captured step's tensors are kept as they are for post_step (HostRows: nothing
        copied here) when every layer holds one of the same shape and integer dtype; otherwise, and for steps that
        only write the prefix store, each layer goes into the cache as before (RoutingCache.record, which also
        refuses a tensor of the wrong shape, naming it). With a prefix store (fill) a captured step's layers go into
        the cache for the store's write and are kept for post_step as well."""
        if self.active:
            if sig is None:
                sigs = {(t.shape, t.dtype) if t is not None else None for t in held}
                sig = sigs.pop() if len(sigs) == 1 else None
            if sig is not None and len(sig[0]) == 2 and sig[0][1] == self.cache.top_k and sig[1] in _ID_DTYPES:
                # (tensors, bytes of one, checked)
                self._host_step = (held[:], sig[0][0] * sig[0][1] * sig[1].itemsize, True)
                if not self.fill:
                    held[:] = [None] * len(held)
                    return
                # the prefix store takes the step's rows from the cache (its flush): recorded there too; the capture
                # still goes by reference, not through a snapshot of the cache (copier.submit would be the largest
                # part of the step's work; bench/worker_step_probe.py --eager --mode fill)
        record_held(held, self.cache.record)

    def _cut_seen(self) -> None:
        """Take the requests that ended out of _seen (after a hand-over: the batch is empty); a table a batch took
        with it is copied first (C speed), so the producer's thread still finds every id of that batch."""
        ended, self._ended = self._ended, []
        seen, tracked = self._seen, self.tracked
        if self._seen_shared:
            seen = self._seen = seen.copy()
            self._seen_shared = False
        for rid in ended:
            if rid not in tracked:          # (not an id opened again since)
                seen.pop(rid, None)

    def _stepped(self, batch: _StepBatch, n: int, t0: int, w0: int) -> None:
        """post_step's end for a step whose `n` rows went into the batch."""
        if len(batch.parts) >= self.max_batch_steps or batch.rows >= self.max_batch_rows:
            self._flush()
        self.stats.active_steps += 1
        self.stats.rows += n
        if t0:
            self._count_host(t0, w0)

    def _ring_slot(self, segments, n: int) -> int | None:
        """The step-ring slot this step's flush wrote (stamp = forwards + offset, mod the slots), or None where the
        rows are not in the ring (a step larger than a slot, several runs, no baseline yet). segments None: the
        whole step."""
        off = self.batch.stamps.offset
        if off is None or (segments is not None and len(segments) != 1) or n > self.cache.slot_rows:
            return None
        # the device computes (signed counter) mod S; S, a power of two, divides 2**bits: the same slot
        return ((self.forwards + off) & self.batch.stamps._mask) % self.cache.slots

    def _count_host(self, t0: int, w0: int) -> None:
        t1 = time.thread_time_ns()
        w1 = time.perf_counter_ns()
        t2 = time.thread_time_ns()          # the clocks measured by themselves, here and now: what one read pair
        w2 = time.perf_counter_ns()         # added to this section (the thread clock is a system call, dearer
        st = self.stats                     # inside a busy engine process than on a quiet machine)
        st.host_ns += t1 - t0
        st.host_wall_ns += w1 - w0
        st.clock_ns += t2 - t1
        st.clock_wall_ns += w2 - w1
        st.timed_sections += 1
        if self._quiet:
            st.quiet_host_ns += t1 - t0
            st.quiet_host_wall_ns += w1 - w0
            st.quiet_clock_ns += t2 - t1
            st.quiet_clock_wall_ns += w2 - w1
            st.quiet_sections += 1

    def _flush(self) -> None:
        """Hand the batched steps to the producer as one delta (no-op when nothing is batched). On the engine
        thread: the batch's one snapshot event is recorded here, on the compute stream, after all its steps."""
        batch = self.batch
        # the opens that waited for a hand-over go before their rows
        gone = self._send_opens() if self._opens else None
        if batch.parts:                     # (step ring: the device counter now proves which slots it reads)
            if batch.raw:
                self._seen_shared = True    # the producer's thread reads it: nothing is taken out of it now
            self.producer.publish_steps(*batch.hand_over(self.copier, self.forwards, self._seen, gone), checked=True)
        if self._ended:                     # requests ended since: out of the table (no step holds them now)
            self._cut_seen()
        if self._closing:                   # finishes that waited for this batch (pre_step)
            closing, self._closing = self._closing, {}
            if self.announces:              # (each with its scheduler note: their items in one comprehension)
                try:
                    self._ends += [(rid, self._end_of(rid, key, info)) for key, (rid, info) in closing.items()]
                    closing = {}
                except Exception:       # noqa: BLE001 -- a note not as the hook makes it: one by one, as before
                    pass
            for key, (rid, info) in closing.items():
                self._close_request(rid, key, info)
        if self._ends:
            self._send_ends()

    # ---- lifecycle ---------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Send what is queued and stop the producer (and the embedded pipeline). Idempotent."""
        if self.binding is not None:
            self.binding.unbind()
        if self.sink is not None:
            st = self.stats
            log.info("routing-replay: worker capture closing: steps=%d active_steps=%d ring_steps=%d host_steps=%d "
                     "rows=%d opened=%d finished=%d aborted=%d derived_keys=%d duplicate_keys=%d skipped=%d rebinds=%d "
                     "prefix_requests=%d prefix_rows=%d store_forgotten=%d copied_steps=%d stamp_resyncs=%d",
                     st.steps, st.active_steps, st.ring_steps, st.host_steps, st.rows,
                     st.opened, st.finished, st.aborted, st.derived_keys, st.duplicate_keys, st.skipped, st.rebinds,
                     st.prefix_requests, st.prefix_rows, st.store_forgotten, st.copied_steps,
                     self.batch.stamps.resyncs if self.batch.stamps is not None else 0)
            try:
                if self.batch.parts and self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)     # close may run off the engine thread and its stream:
                self._flush()                               # every snapshot is done before the batch's event
            finally:
                self.sink.close()
                self.sink = None
