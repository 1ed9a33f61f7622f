"""How a captured step's rows go into the worker's batch after its forward (post_step): one class per hand-over
path, chosen once from the capture plan (make_path).

  StepPath   any engine: the runner's layout -> the captured requests' record keys, starts and counts -> their rows,
             from the step's ring slot (by reference), the routers' own tensors (eager CPU, by reference) or a
             snapshot of the cache (AsyncCopier.submit, mark=False: one event per batch).
  RingPath   Model Runner V1 under CUDA graphs with the step ring: a step of the running batch goes by reference
             as the runner laid it out (its ring slot, engine ids, the layout's bytes): no key, no numpy call on the
             engine thread; the producer's thread maps ids to keys (BatchedRows.resolve). A step larger than a
             slot is copied whole and goes the same way.
  HostPath   CPU with enforce_eager: the routers' top-k tensors are host memory; a captured step's go to the
             producer's thread as they are (HostRows), with the runner's layout as bytes.
The general path (StepPath.layout_step) stays the fallback of the other two: a step that writes the prefix store,
one before the stamp baseline, one whose layers do not all hold a tensor of one shape.
"""

from __future__ import annotations

import numpy as np

from routing_replay.capture import HostRows
from routing_replay.capture.cache import ID_DTYPES
from routing_replay.engines.vllm_plugin import runners
from routing_replay.engines.vllm_plugin.binding import record_held
from routing_replay.engines.vllm_plugin.plan import HANDOVER_HOST, HANDOVER_RING
from routing_replay.engines.vllm_plugin.step_batch import StepBatch, resolve_raw_steps


class StepPath:
    """Hand a captured step's rows to the worker's StepBatch (the general path, any engine). Holds the worker's
    long-lived parts; reads what changes per step (forwards, fill, producer) from the worker itself."""

    def __init__(self, worker, reader):
        self.fast = None        # RingPath: a step of the running batch by reference (post_step's first choice)
        self.host_raw = None    # HostPath: an eager CPU step's routers' tensors as they are
        self.worker = worker
        self.reader = reader                # runners.BatchReader: the runner's layout after the forward
        self.batch: StepBatch = worker.batch
        self.stats, self.cache, self.copier = worker.stats, worker.cache, worker.copier
        self.requests, self.tracked = worker.requests, worker.tracked
        self.max_batch_steps, self.max_batch_rows = worker.max_batch_steps, worker.max_batch_rows
        self.flush, self.count_host = worker.flush, worker.count_host
        # the runner's layout read as runners.step_layout reads it, in this frame (no BatchReader frame a step)
        self._layout_args = (reader.runner, reader.kind, getattr(reader, "_views", None))
        self.host_step = None           # CPU, eager: (the step's top-k tensors by layer, bytes of one, checked)
        self._last_keys = (None, -1, None, True)    # (request ids, requests.gen, their keys, any None): last step
        self._last_layout = (None, None, None, None, None, None)    # layout_step's per-layout results (see there)

    def layout_step(self, so, host, t0: int, w0: int) -> None:
        """The general path: the step's captured requests from the runner's layout (request i of the batch owns
        rows query_start_loc[i]..[i+1], the first at position num_computed_tokens[i]), their rows to the batch.
        `host`: the routers' tensors of an eager CPU step (host_step), else None."""
        w = self.worker
        layout = runners.step_layout(*self._layout_args)
        if layout is None:
            if t0:
                self.count_host(t0, w0)
            return
        req_ids, qsl, computed = layout
        cache = self.cache
        if cache.slots:
            n = so.total_num_scheduled_tokens
            slot = self.ring_slot(None, n)
            if slot is not None:
                # the whole step is in its ring slot: it goes to the producer's thread as the runner laid it out,
                # which maps the ids to keys and leaves out what is not captured (BatchedRows.resolve)
                ids, cb, qb, dtypes = self.reader.raw_layout(req_ids, qsl, computed)
                batch = self.batch
                batch.add_raw(0, n, slot, ids, cb, qb, w.forwards, dtypes)
                self.stats.ring_steps += 1
                self.stepped(batch, n, t0, w0)
                return
        last_ids, last_gen, keys, uncaptured = self._last_keys
        # decode steps repeat the batch: compared item by item by identity (C speed, no id touched); the list
        # is copied and mapped to keys only when it changed
        gen = self.requests.gen
        changed = last_gen != gen or last_ids != req_ids
        if changed or keys is None:
            req_ids = list(req_ids)
            keys = list(map(self.tracked.get, req_ids))     # C speed: churn steps change the list every step
            uncaptured = None in keys
            self._last_keys = (req_ids, gen, keys, uncaptured)
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
                self.count_host(t0, w0)
            return
        # the runner's array changes with the next step: this step's copy
        computed = computed.copy() if sel is None else computed[sel]
        batch = self.batch
        slot = self.ring_slot(segments, so.total_num_scheduled_tokens) if cache.slots else None
        if slot is not None:                    # the forward's flush put the rows in its slot: nothing to launch,
            first, n = segments[0]              # and the producer's thread takes their host-ring rows
            batch.add_slot(first, n, slot, keys, computed, count, w.forwards)
            self.stats.ring_steps += 1
        elif host is not None:                  # CPU, eager: the routers' tensors themselves, by reference
            pending = HostRows(host[0], segments, cache.top_k, host[1], checked=host[2])
            n = pending.shape[0]
            batch.add(pending, keys, computed, count, forward=w.forwards)
            self.stats.host_steps += 1
        else:
            pending = self.copier.submit(segments, mark=False)     # one event per batch, recorded in the flush
            n = pending.shape[0]
            if pending.dropped:                                  # host ring full: publish as lost, keep order
                self.flush()
                w.producer.publish_rows(keys, computed, count, pending)
            else:
                batch.add(pending, keys, computed, count, forward=w.forwards)
        self.stepped(batch, n, t0, w0)

    def stepped(self, batch: StepBatch, n: int, t0: int, w0: int) -> None:
        """The end of post_step for a step whose `n` rows went into the batch."""
        if len(batch.parts) >= self.max_batch_steps or batch.rows >= self.max_batch_rows:
            self.flush()
        self.stats.active_steps += 1
        self.stats.rows += n
        if t0:
            self.count_host(t0, w0)

    def ring_slot(self, segments, n: int) -> int | None:
        """The step-ring slot this step's flush wrote (stamp = forwards + offset, mod the slots), or None where the
        rows are not in the ring (a step larger than a slot, several runs, no baseline yet). segments None: the
        whole step."""
        stamps = self.batch.stamps
        off = stamps.offset
        if off is None or (segments is not None and len(segments) != 1) or n > self.cache.slot_rows:
            return None
        # the device computes (signed counter) mod S; S, a power of two, divides 2**bits: the same slot
        return ((self.worker.forwards + off) & stamps.mask) % self.cache.slots


class RingPath(StepPath):
    """Model Runner V1 under CUDA graphs with the step ring (see the module docstring)."""

    def __init__(self, worker, reader):
        super().__init__(worker, reader)
        self.fast = self.ring_step
        self.read_batch = reader.read_batch     # (V1 only: the plan chooses the ring for Model Runner V1)

    def ring_step(self, so, t0: int, w0: int) -> bool:
        """post_step of a captured step that writes nothing to the prefix store: the general path's work (flush,
        layout, slot, raw layout, the batch) in one frame, for the running batch's every step; a step larger than
        a ring slot is copied whole and goes raw the same way. False, having done nothing but the flush, before
        the stamp baseline: the general path takes the step then."""
        w = self.worker
        w.active = False
        cache = self.cache
        cache.flush()           # (a no-op for a graph-replayed step; ends an eager step whose last hook was lost)
        nt = so.total_num_scheduled_tokens
        batch = self.batch
        stamps = batch.stamps
        off = stamps.offset
        if off is None:
            return False
        big = nt > cache.slot_rows      # (a prefill chunk beyond the largest CUDA graph: copied whole, below)
        last, rv = self.read_batch()
        st = self.stats
        forwards = w.forwards
        if big:
            # rows [0, nt) copied whole (one launch; the rows of requests not captured are left out on the
            # producer's thread, which maps the ids to keys as for a ring step): no numpy call, no key, nothing
            # per request here (a large chunk's layout, keys and counts would cost the engine thread per token)
            pending = self.copier.submit([(0, nt)], mark=False)
            if pending.dropped:
                self._copy_dropped(pending, last, rv)
            else:
                batch.add_copied(pending, last, bytes(rv[4]), bytes(rv[3]), rv[5], forwards)
                st.copied_steps += 1
        else:
            # the slot this step's flush wrote (as ring_slot); the step as the runner laid it out (as
            # raw_layout, StepBatch.add_raw): the producer's thread maps the ids to keys (BatchedRows.resolve)
            batch.add_raw(0, nt, ((forwards + off) & stamps.mask) % cache.slots, last, bytes(rv[4]),
                          bytes(rv[3]), forwards, rv[5])
            st.ring_steps += 1
        st.active_steps += 1
        st.rows += nt
        if len(batch.parts) >= self.max_batch_steps or batch.rows >= self.max_batch_rows:
            self.flush()
        w.steady = not (w.fill and self.requests.opens)
        if t0:
            self.count_host(t0, w0)
        return True

    def _copy_dropped(self, pending, ids: list, rv: tuple) -> None:
        """ring_step's whole-step copy found the host ring full (rare): as the general path does, the batch goes
        first and the step's captured requests get their rows published as lost (Producer.publish_rows), mapped
        as the producer's thread maps a raw step (resolve_raw_steps)."""
        self.flush()
        w = self.worker
        qsl = np.frombuffer(rv[3], dtype=rv[5][0])
        computed = np.frombuffer(rv[4], dtype=rv[5][1]).copy()      # (the runner's array changes next step)
        keys, starts, counts, _, _ = resolve_raw_steps([0], self.requests.seen, [w.forwards], [ids], [computed],
                                                       [qsl])
        # (a dropped copy holds no rows: it stands for those of the requests kept, as the general path's does)
        pending.shape = (int(np.sum(counts[0])), *pending.shape[1:])
        w.producer.publish_rows(keys[0], starts[0], counts[0], pending)


class HostPath(StepPath):
    """CPU with enforce_eager: the routers' own top-k tensors, by reference (see the module docstring). Its
    take_step is the binding's drain target."""

    def __init__(self, worker, reader):
        super().__init__(worker, reader)
        self.host_raw = self.host_step_raw
        # V1: the persistent batch read directly, in this frame (no raw_step frame a step); V2: raw_step
        self._read_batch = getattr(reader, "read_batch", None)

    def host_step_raw(self, so, tensors: list, n: int, t0: int, w0: int) -> None:
        """post_step of an eager CPU step whose every MoE layer's C hook kept its tensor: the step goes to the
        producer's thread as the runner laid it out (StepBatch.add_host), which maps its ids to record keys,
        leaves out what is not captured and checks the tensors (BatchedRows.resolve, HostRows). Here: the
        tensors, the engine ids and the bytes of the runner's two layout arrays (V1BatchReader.read_batch, else
        BatchReader.raw_step). No array, no per-request work, no torch call but one dtype read."""
        read = self._read_batch
        if read is not None:
            ids, rv = read()
            cb, qb, dtypes = bytes(rv[4]), bytes(rv[3]), rv[5]
        else:
            raw = self.reader.raw_step()
            if raw is None:
                if t0:
                    self.count_host(t0, w0)
                return
            ids, cb, qb, dtypes = raw
        w = self.worker
        batch = self.batch
        batch.add_host(tensors, n * self.cache.top_k * tensors[0].dtype.itemsize, n, ids, cb, qb, dtypes,
                       w.forwards)
        self.stats.host_steps += 1
        w.steady = True        # (post_step emptied the held list: the next pre_step may take its short path)
        w.host_next = True      # (or the next step may leave pre_step out: WorkerCapture._late_pre_step)
        self.stepped(batch, n, t0, w0)

    def take_step(self, held: list, sig: tuple | None = None) -> None:
        """binding.drain's target on an eager CPU engine, with the step's top-k tensor of each MoE layer (the list
        is emptied) and, where the binding checked it, the (shape, dtype) they all share (every layer holds a 2-D
        tensor covering the step). A captured step's tensors are kept as they are for post_step (HostRows: nothing
        copied here) when every layer holds one of the same shape and integer dtype; otherwise, and for steps that
        only write the prefix store, each layer goes into the cache as before (RoutingCache.record, which also
        refuses a tensor of the wrong shape, naming it). With a prefix store (fill) a captured step's layers go into
        the cache for the store's write and are kept for post_step as well."""
        w = self.worker
        if w.active:
            if sig is None:
                sigs = {(t.shape, t.dtype) if t is not None else None for t in held}
                sig = sigs.pop() if len(sigs) == 1 else None
            if sig is not None and len(sig[0]) == 2 and sig[0][1] == self.cache.top_k and sig[1] in ID_DTYPES:
                # (tensors, bytes of one, checked)
                self.host_step = (held[:], sig[0][0] * sig[0][1] * sig[1].itemsize, True)
                if not w.fill:
                    held[:] = [None] * len(held)
                    return
                # the prefix store takes the step's rows from the cache (its flush): recorded there too; the capture
                # still goes by reference, not through a snapshot of the cache (copier.submit would be the largest
                # part of the step's work; bench/worker_step_probe.py --eager --mode fill)
        record_held(held, self.cache.record)


def make_path(plan, worker, reader) -> StepPath:
    """The step path the plan chose (CapturePlan.handover)."""
    if plan.handover == HANDOVER_RING:
        return RingPath(worker, reader)
    if plan.handover == HANDOVER_HOST:
        return HostPath(worker, reader)
    return StepPath(worker, reader)
