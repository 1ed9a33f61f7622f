"""Move each step's routing rows from the device cache to a pinned host ring without stalling the engine.

Per `submit(segments)` (engine thread, right after the forward), one launch on the engine thread:
  1. compute stream: one copy snapshots the step's rows out of the cache into a device staging ring. The
     snapshot is what lets the next step overwrite the cache at once: copying straight from the cache on a side
     stream would race with the next step's router writes unless the compute stream waited for the D2H (vLLM's
     aux-output connector snapshots on the main stream for the same reason). A step that is one contiguous run
     of the batch (the common case) is copied layer-major, (L, n, K): on CUDA with an int16 cache by one driver
     2-D copy made with the GIL held (capture/cudriver.py: a torch call gives the GIL away, and beside a busy
     Python thread getting it back costs the engine thread milliseconds), else by one `copy_` of kept views;
     result() transposes the view. Segments that are not one contiguous run are gathered in request order,
     (n, L, K), with `index_select` through an index uploaded from the pinned index ring.
  2. submit(mark=True): an event (from a pool) is recorded on the compute stream after the snapshot;
     submit(mark=False) + mark_batch(parts): one event for a batch of steps (a driver call too, once torch
     has created the event).
  3. returns a `PendingRows`. Everything else happens on the thread that consumes the rows (the producer's):
     `launch(parts)` makes a side stream wait on the newest of their snapshot events (the compute stream ran
     the older snapshots before it) and copies staging -> pinned host ring, one non_blocking copy per
     contiguous run of parts (consecutive steps are consecutive in the ring: usually one copy for a whole
     batch of steps), then records a per-copy event; the snapshot events go back to the pool (a stream wait
     binds to the record before it). `result()` launches if needed, waits on its copy event there, and returns
     the rows; `release()` frees the range. The compute stream never waits on any of it.
On CPU the snapshot goes straight into the host ring and result() does not wait; everything else is the same.
A stamped cache (RoutingCache(stamp=True)): the snapshot takes the stamp layer too, in the same copy (one more row
of the 2-D copy; gathered steps: one more index_select), into the ceil(n / L) ring rows after the step's rows;
`PendingRows.stamps()` reads them.
A cache with a step ring (RoutingCache(slots=...)): `submit_slot(first, n, slot)` takes ring rows and launches
nothing; the forward's own flush already put the rows into that slot. `mark_batch(parts, checkpoint=True)` also
copies the device step counter into a checkpoint ring (one small copy per batch). `launch()` then copies each
part's rows out of its slot, then that slot's stamps, then the checkpoint, all on the side stream;
`PendingRows.stamps()` and `.checkpoint()` read them (the check is the worker's: engines/vllm_plugin/worker.py).
The engine thread can also hand step-ring steps over by reference only: `mark_batch(parts, checkpoint=True,
slots=k)` returns a `SlotBatch` (checkpoint entry, the batch's event), and the consumer's thread takes their host
ring rows then (`take_slot`), so a ring step costs the engine thread no allocation and no object.
Measured costs (compute-stream kernel time, D2H bandwidth, engine-thread CPU per submit): docs/PERFORMANCE.md.
For many non-adjacent segments pass an (m, 2) int array: long lists are converted and merged with numpy.

Ring sizing and back-pressure: staging and host ring share one row allocator (`RowRing`) of
(num_slots + 1) * max_rows rows, so `num_slots` worst-case steps of max_rows rows can be in flight at once,
and small (decode) steps pack densely instead of taking a slot each. A range is reused only after release()
and after its copy event has passed. When the ring is full (the consumer fell behind), the step is DROPPED,
not waited for: nothing is copied, `stats.dropped_steps/dropped_rows` count it, and `submit` returns a
PendingRows with `dropped=True`. `Producer.publish_rows` treats such an object as a lost delta (its
positions go into the request's `finish` as `lost`, so the consumer marks the record incomplete).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, NamedTuple, Sequence

import numpy as np
import torch

from routing_replay.capture import cudriver
from routing_replay.capture.cache import RoutingCache
from routing_replay.capture.ring import RowRing

ROW_DTYPE = np.dtype("<i2")


@dataclass
class CopierStats:
    submitted_steps: int = 0
    submitted_rows: int = 0
    dropped_steps: int = 0         # steps refused because the ring was full
    dropped_rows: int = 0
    skipped_steps: int = 0         # submit() with no rows: nothing copied at all


class PendingRows:
    """Own one step's (n, L, K) int16 rows in the host ring until they are consumed: the copy event to wait
    on (in the consumer's thread) and the ring range to free."""

    __slots__ = ("shape", "dtype", "dropped", "_copier", "_lo", "_handle", "_event", "_waited", "_released",
                 "_staged", "_seq", "_shared", "_lm", "_m", "stamped", "slot", "_ckpt", "_pulled", "tag")

    def __init__(self, copier: "AsyncCopier", shape: tuple, lo: int, handle, event, dropped: bool = False,
                 staged=None, seq: int = 0, layer_major: bool = False, ring_rows: int | None = None,
                 stamped: bool = False):
        self.shape = shape
        self._m = shape[0] if ring_rows is None else ring_rows     # ring rows taken (the rows, then any stamp)
        self.stamped = stamped          # the step's stamps follow its rows in the ring (stamps())
        self.dtype = ROW_DTYPE
        self.dropped = dropped
        self._copier = copier
        self._lo = lo
        self._handle = handle
        self._event = event
        self._staged = staged           # CUDA: the snapshot's event while the D2H copy is not launched yet
        self._seq = seq                 # submission order (the newest snapshot of a batch is waited on)
        self._waited = event is None and staged is None
        self._released = dropped
        self._shared = None             # a _BatchEvent: _staged is one event for a whole batch (mark_batch)
        self._lm = layer_major          # the ring holds the rows as (L, n, K); result() transposes the view
        self.slot = None                # submit_slot: (slot, first row) of the cache's step ring to copy from
        self._ckpt = None               # mark_batch(checkpoint=True): this batch's entry in the checkpoint ring
        self._pulled = False            # CPU: the slot was copied into the host ring (in result())
        self.tag = None                 # the caller's (the vLLM worker: its step's layout dtypes until resolved)

    @property
    def nbytes(self) -> int:
        return self.shape[0] * self.shape[1] * self.shape[2] * ROW_DTYPE.itemsize

    def done(self) -> bool:
        """True when result() would not wait (never blocks, never syncs; False before the copy is launched)."""
        if self._waited:
            return True
        return self._event is not None and self._event.query()

    def result(self) -> np.ndarray:
        """Wait for the copy (in the calling thread) and return the (n, L, K) rows: a read-only view into the host
        ring, valid until release(). A step submitted as one run sits in the ring layer-major (one 2-D copy), so
        its view is transposed, not C-contiguous: np.ascontiguousarray / np.concatenate make the wire layout."""
        if self.dropped:
            raise RuntimeError(f"step of {self.shape[0]} rows was dropped: the host ring was full")
        if self._released:
            raise RuntimeError("rows were released; result() must come before release()")
        if not self._waited:
            if self._staged is not None:
                self._copier.launch([self])
            self._event.synchronize()
            self._waited = True
        elif self.slot is not None and not self._pulled:       # CPU: the slot is read now
            self._copier._pull_slot(self)
        if self._lm:
            view = self._copier._placed(self._copier._host_flat, self._lo, self.shape[0]).transpose(1, 0, 2)
        else:
            view = self._copier._host_np[self._lo:self._lo + self.shape[0]]
        view.flags.writeable = False
        return view

    def stamps(self) -> np.ndarray:
        """The (n, K) step stamps snapshotted with the rows (RoutingCache(stamp=True)); call after result(),
        before release()."""
        if not self.stamped:
            raise RuntimeError("these rows carry no step stamps")
        if not self._waited or self._released:
            raise RuntimeError("stamps() comes after result() and before release()")
        return self._copier._placed(self._copier._host_flat, self._lo, self.shape[0], stamps=True)

    def checkpoint(self) -> int | None:
        """The device step counter when this step's batch was handed over (mark_batch(checkpoint=True)), as read
        with the rows; call after result(). None when not taken."""
        if self._ckpt is None:
            return None
        if not self._waited or self._released:
            raise RuntimeError("checkpoint() comes after result() and before release()")
        return int(self._copier._ckpt_host_np[self._ckpt])

    def release(self) -> None:
        """Give the ring range back (idempotent). Released before the copy finished, the range stays taken
        until its event has passed; the caller never waits."""
        if self._released:
            return
        self._released = True
        if self._staged is not None:    # never launched: nothing is in flight into the host ring
            if self._staged is not _UNMARKED:
                self._copier._unstage(self)
            self._staged = None
        self._copier._release(self._handle, self._event, self._waited or self._event is None)


class HostRows:
    """One eager step's (n, L, K) rows by reference, where the routers' top-k tensors are host memory already (an
    engine on CPU): each MoE layer's (N, K) integer tensor as its router made it, and the step's captured rows as
    (first, count) runs of them. Nothing is copied on the engine thread; result() builds the int16 rows on the
    caller's thread (the producer's), one cast-copy per layer, and drops the tensors. Duck-types PendingRows for
    the batch that carries it (shape, dtype, dropped, stamped, slot, nbytes, result, release)."""

    __slots__ = ("shape", "dropped", "stamped", "slot", "_tensors", "_runs", "_out", "extra_nbytes", "_unchecked")
    dtype = ROW_DTYPE

    def __init__(self, tensors: list, runs: Sequence[tuple[int, int]], top_k: int, tensor_nbytes: int | None = None,
                 checked: bool = True):
        """`checked`: the caller made sure each tensor is a 2-D CPU tensor of integer ids with `top_k` columns and
        the rows the runs read. checked=False: result() checks that, on its own thread, and refuses the step
        (ValueError naming the layer) where a tensor is not so; nothing of the step is read then."""
        self._tensors = tensors         # never modified by the caller afterwards (its own list of the step)
        self._unchecked = not checked
        self._runs = runs
        n = runs[0][1] if len(runs) == 1 else sum(c for _, c in runs)
        self.shape = (n, len(tensors), top_k)
        self.dropped = self.stamped = False
        self.slot = None
        self._out = None
        # what the tensors hold beyond the int16 rows made of them (the whole step's tokens, int32 or int64 ids),
        # until result(): a queue that bounds its bytes counts it too (the tensors are of one shape and dtype;
        # `tensor_nbytes`: the bytes of one, where the caller knows them already)
        if tensor_nbytes is None:
            t = tensors[0]
            tensor_nbytes = t.numel() * t.element_size()
        self.extra_nbytes = max(0, len(tensors) * (tensor_nbytes - n * top_k * ROW_DTYPE.itemsize))

    @property
    def nbytes(self) -> int:
        return self.shape[0] * self.shape[1] * self.shape[2] * ROW_DTYPE.itemsize

    def result(self) -> np.ndarray:
        """The (n, L, K) int16 rows (a new array, read-only); the tensors are let go."""
        if self._out is None:
            if self._tensors is None:
                raise RuntimeError("rows were released; result() must come before release()")
            runs = self._runs
            # rows the step reads from each tensor, where result() checks them (checked=False)
            need = None
            if self._unchecked:
                need = runs[0][0] + runs[0][1] if len(runs) == 1 else max(first + n for first, n in runs)
            out = np.empty(self.shape, dtype=ROW_DTYPE)
            for layer, t in enumerate(self._tensors):
                a = t.numpy() if need is None else self._check(layer, t, need)
                if len(runs) == 1:
                    first, n = runs[0]
                    out[:, layer] = a[first:first + n]
                else:
                    out[:, layer] = np.concatenate([a[first:first + n] for first, n in runs])
            out.flags.writeable = False
            self._out, self._tensors = out, None
        return self._out

    def _check(self, layer: int, t, need: int) -> np.ndarray:
        """Layer `layer`'s tensor as an array, where it is what result() reads (checked=False: 2-D, top_k columns,
        `need` rows or more, integer ids), else ValueError."""
        try:
            a = t.numpy()
        except Exception as e:  # noqa: BLE001 -- named below (a device tensor, not a tensor, ...)
            raise ValueError(f"routing-replay: MoE layer {layer} (local index) handed over {type(t).__name__} "
                             f"that is no CPU tensor ({e}); this step's rows are refused") from None
        if a.ndim != 2 or a.shape[1] != self.shape[2] or a.shape[0] < need or a.dtype.kind not in "iu":
            raise ValueError(f"routing-replay: MoE layer {layer} (local index) handed over top-k ids of shape "
                             f"{a.shape} and dtype {a.dtype}; this step reads rows [0, {need}) of {self.shape[2]} "
                             "integer ids: its rows are refused (a router saw another batch, or a hook was lost)")
        return a

    def release(self) -> None:
        self._tensors = self._out = None


# torch.cuda.Event.record without its Python frame (which looks the current stream up again); None on CPU builds
_record = getattr(getattr(torch._C, "_CudaEventBase", None), "record", None)
# the snapshot of a step submitted with mark=False, until mark_batch() records the batch's one event
_UNMARKED = object()


class SlotBatch(NamedTuple):
    """What the engine thread hands over with a batch's step-ring steps taken by reference (mark_batch(slots=k)):
    its entry in the checkpoint ring, the batch's shared event (CUDA; None on CPU) and its sequence number."""

    ckpt: int | None
    box: Any
    seq: int


class _BatchEvent:
    """One snapshot event shared by the steps of a batch (mark_batch), back in the pool once every step's copy was
    launched or the step released."""

    __slots__ = ("event", "users")

    def __init__(self, event, users: int):
        self.event, self.users = event, users


def launch_rows(parts) -> None:
    """Launch the host copies of PendingRows `parts` (of one or several copiers) together: one copy per run of
    parts adjacent in a copier's ring. `result()` launches its own part alone otherwise."""
    by_copier: dict = {}
    for p in parts:
        if getattr(p, "_staged", None) is not None:
            by_copier.setdefault(id(p._copier), (p._copier, []))[1].append(p)
    for copier, ps in by_copier.values():
        copier.launch(ps)


class AsyncCopier:
    """Own the device staging ring, the pinned host ring, the index rings, the side stream and the events that
    carry each step's rows of one RoutingCache to the host."""

    def __init__(self, cache: RoutingCache, num_slots: int = 2, max_rows: int | None = None):
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        max_rows = cache.max_tokens if max_rows is None else int(max_rows)
        if not 1 <= max_rows <= cache.max_tokens:
            raise ValueError(f"max_rows={max_rows} outside [1, cache.max_tokens={cache.max_tokens}]")
        self.cache = cache
        self.num_slots = num_slots
        self.max_rows = max_rows
        self._stamped = cache.stamped
        # room for num_slots + 1 steps of max_rows rows; a stamped cache's steps also take ring rows for their
        # stamps, so its ring grows by that much (the stamps do not eat into the room for rows)
        self.capacity_rows = (num_slots + 1) * self._ring_rows(max_rows)
        self.stats = CopierStats()
        L, K, cap = cache.num_layers, cache.top_k, self.capacity_rows
        self._src = cache.buffer.transpose(0, 1)            # (max_tokens, L, K) view of the cache
        self._layers_out = L + 1 if cache.stamped else L     # layers one layer-major snapshot copies
        self._ring = RowRing(cap)
        self._cuda = cache.device.type == "cuda"
        if self._cuda:
            dev = cache.device
            self._stage = torch.empty((cap, L, K), dtype=torch.int16, device=dev)
            self._host = torch.empty((cap, L, K), dtype=torch.int16, pin_memory=True)
            self._idx_host = torch.empty(cap, dtype=torch.int64, pin_memory=True)
            self._idx_dev = torch.empty(cap, dtype=torch.int64, device=dev)
            self._stream = torch.cuda.Stream(device=dev)
            self._snap_pool: list = []          # snapshot events, recorded on the engine thread
            self._dev_index = dev.index if dev.index is not None else torch.cuda.current_device()
            self._streams: dict = {}            # torch's raw current-stream tuple -> Stream (see _current_stream)
            self._seq = 0
            self._events: list = []
            self._launch_lock = threading.Lock()
            self._batch_pool: list = []         # created events for mark_batch, recorded again by the driver
            # one-run snapshots as one driver 2-D copy with the GIL held (int16 caches; capture/cudriver.py)
            self._drv = cudriver.check(dev) if cache.dtype == torch.int16 else None
            if self._drv is not None:
                self._m = self._drv.copy_desc()
                self._m.srcPitch = cache.max_tokens * K * 2
                self._m.Height = self._layers_out
                self._src_ptr = cache.buffer.data_ptr()
                self._stage_ptr = self._stage.data_ptr()
        else:
            self._drv = None
            self._stage = None
            self._host = torch.empty((cap, L, K), dtype=torch.int16)
            self._idx_host = torch.empty(cap, dtype=torch.int64)
            self._idx_dev = self._idx_host
            self._stream = None
        self._host_np = self._host.numpy()
        self._host_flat = self._host_np.reshape(-1)
        # the cache's step ring (submit_slot): the device counter at each batch hand-over, one entry per batch in
        # flight (a batch holds ring rows until released, so never more than capacity_rows batches)
        self._ckpt_next = 0
        if cache.slots:         # (the counter's own dtype: a checkpoint is a plain copy of its bytes)
            cdt = cache._counter.dtype
            self._ckpt_dev = torch.zeros(cap, dtype=cdt, device=cache.device)
            self._ckpt_host = torch.zeros(cap, dtype=cdt, pin_memory=self._cuda)
            self._ckpt_host_np = self._ckpt_host.numpy()
            if self._drv is not None:       # the checkpoint as one driver copy with the GIL held, like the snapshot
                size = cache._counter.element_size()
                self._ckpt_m = self._drv.copy_desc()
                self._ckpt_m.srcDevice = cache._counter.data_ptr()
                self._ckpt_m.srcPitch = self._ckpt_m.dstPitch = self._ckpt_m.WidthInBytes = size
                self._ckpt_m.Height = 1
                self._ckpt_ptr = self._ckpt_dev.data_ptr()
        self._idx_np = self._idx_host.numpy()
        self._views: dict = {}          # (lo, a, b) -> ((L, n, K) view of ring rows [lo, lo + n), cache rows [a, b))

    @property
    def host_bytes(self) -> int:
        """Host ring bytes (pinned on CUDA), index ring included."""
        return self._host.nbytes + self._idx_host.nbytes

    @property
    def device_bytes(self) -> int:
        """Device bytes this copier allocated (staging and index rings; the cache is counted by the cache)."""
        return 0 if not self._cuda else self._stage.nbytes + self._idx_dev.nbytes

    @property
    def in_flight_rows(self) -> int:
        return self._ring.used_rows

    @property
    def free_rows(self) -> int:
        """Ring rows free now (finished copies that were released are reclaimed first)."""
        return self._ring.free_rows

    def _runs(self, segments) -> tuple[np.ndarray | list, int]:
        """Validate segments and merge adjacent ones: returns ([start, end) runs in output order, total rows)."""
        T = self.cache.max_tokens
        if isinstance(segments, np.ndarray) or len(segments) > 16:
            seg = np.asarray(segments, dtype=np.int64).reshape(-1, 2)
            off, cnt = seg[:, 0], seg[:, 1]
            bad = (off < 0) | (cnt < 0) | (off + cnt > T)
            if bad.any():
                i = int(np.argmax(bad))
                raise ValueError(f"segment (offset={off[i]}, rows={cnt[i]}) outside the cache's {T} token rows")
            keep = cnt > 0
            off, end = off[keep], off[keep] + cnt[keep]
            if len(off) == 0:
                return [], 0
            new_run = np.ones(len(off), dtype=bool)
            new_run[1:] = off[1:] != end[:-1]
            starts = off[new_run]
            ends = end[np.append(np.flatnonzero(new_run)[1:] - 1, len(end) - 1)]
            return np.stack([starts, ends], axis=1), int((end - off).sum())
        runs: list = []
        total = 0
        for a, n in segments:
            off, n = int(a), int(n)
            if off < 0 or n < 0 or off + n > T:
                raise ValueError(f"segment (offset={off}, rows={n}) outside the cache's {T} token rows")
            if n == 0:
                continue
            total += n
            if runs and runs[-1][1] == off:
                runs[-1][1] = off + n
            else:
                runs.append([off, off + n])
        return runs, total

    def _placed(self, flat, lo: int, n: int, stamps: bool = False):
        """Where an n-row step taken at ring row lo lies in a flat ring (numpy array or tensor): its rows
        layer-major, (L, n, K), or (stamps=True, stamped caches) its (n, K) stamps right after them."""
        L, K = self.cache.num_layers, self.cache.top_k
        a, b = lo * L * K, (lo + n) * L * K
        return flat[b:b + n * K].reshape(n, K) if stamps else flat[a:b].reshape(L, n, K)

    def _ring_rows(self, n: int) -> int:
        """Ring rows an n-row step takes: its rows, then on a stamped cache ceil(n / L) more for its (n, K) stamps."""
        return n + -(-n // self.cache.num_layers) if self._stamped else n

    def submit(self, segments: Sequence[tuple[int, int]] | np.ndarray, mark: bool = True) -> PendingRows | None:
        """Start copying this step's rows: segments are (token_offset_in_batch, n_rows) in request order
        (a list of pairs, or an (m, 2) integer array).

        Call on the engine thread right after the forward, on the stream that ran it. Returns None (and
        copies nothing) when the segments hold no rows, a PendingRows with dropped=True when the ring is full.
        mark=False (CUDA): no event for this step; the caller hands steps over in batches and calls
        mark_batch(parts) on this thread first (one event for the batch: one torch call less per step).
        """
        runs, n = self._runs(segments)
        L, K = self.cache.num_layers, self.cache.top_k
        m = self._ring_rows(n)
        got = self._take(n, rows=m)
        if not isinstance(got, tuple):
            return got
        lo, handle = got
        lm = len(runs) == 1
        if lm:                                  # one contiguous run (the common case): one call, layer-major
            a, b = int(runs[0][0]), int(runs[0][1])
            if self._drv is not None:           # the rows [a, b) of each layer, one after the other: a 2-D copy
                desc = self._m                  # (a stamped cache's stamp layer is the copy's last row)
                desc.srcDevice = self._src_ptr + a * K * 2
                desc.dstDevice = self._stage_ptr + lo * L * K * 2
                desc.dstPitch = desc.WidthInBytes = n * K * 2
                try:
                    self._drv.copy_2d(desc, cudriver.current_stream(self._dev_index))
                except cudriver.DriverError as e:   # refused at launch (nothing ran): torch calls from now on
                    self._drv = cudriver.give_up(e)
            if self._drv is None:
                views = self._views.get((lo, a, b))
                if views is None:
                    if len(self._views) >= 4096:
                        self._views.clear()
                    ring = self._host if not self._cuda else self._stage
                    Lo = self._layers_out
                    dst = ring.view(-1)[lo * L * K:lo * L * K + Lo * n * K].view(Lo, n, K)
                    views = self._views[(lo, a, b)] = (dst, self.cache._full[:Lo, a:b])
                views[0].copy_(views[1])
        else:
            dst = self._host[lo:lo + n] if not self._cuda else self._stage[lo:lo + n]
            self._snapshot(runs, dst, lo, n)
        if not mark and self._cuda:
            shape = (n, L, K)
            return PendingRows(self, shape, lo, handle, None, staged=_UNMARKED, layer_major=lm, ring_rows=m,
                               stamped=self._stamped)
        return self._send(lo, n, handle, lm, m)

    def submit_slot(self, first: int, n: int, slot: int) -> PendingRows | None:
        """Rows [first, first + n) of the step whose flush wrote slot `slot` of the cache's step ring
        (RoutingCache(slots=...)): nothing is launched here (the slot is read by launch() on the consumer's thread,
        after the batch's event), only ring rows are taken. Returns None for no rows, a dropped PendingRows when the
        ring is full. Hand the step over with mark_batch(parts, checkpoint=True)."""
        if not self.cache.slots:
            raise RuntimeError("the cache has no step ring (RoutingCache(slots=...))")
        return self._slot_part(first, n, slot, 0, _UNMARKED if self._cuda else None)

    def _slot_part(self, first: int, n: int, slot: int, min_rows: int, staged) -> PendingRows | None:
        """Host-ring rows for rows [first, first + n) of step-ring slot `slot` (at least min_rows of them): the
        PendingRows its copy out of the slot goes to, a dropped one when the ring is full, None for no rows."""
        c = self.cache
        if not (0 <= slot < c.slots and first >= 0 and n >= min_rows and first + n <= c.slot_rows):
            raise ValueError(f"slot {slot} rows [{first}, {first + n}) outside the step ring's {c.slots} slots x "
                             f"{c.slot_rows} rows")
        m = self._ring_rows(n)
        got = self._take(n, rows=m)
        if not isinstance(got, tuple):
            return got
        lo, handle = got
        p = PendingRows(self, (n, c.num_layers, c.top_k), lo, handle, None, staged=staged, layer_major=True,
                        ring_rows=m, stamped=True)
        p.slot = (slot, first)
        return p

    def _pull_slot(self, p: PendingRows) -> None:
        """CPU: copy p's rows out of its slot now, then the slot's stamps (the order launch() keeps on CUDA)."""
        (slot, a), n, L = p.slot, p.shape[0], self.cache.num_layers
        self._placed(self._host_flat, p._lo, n)[...] = self.cache.ring[slot, :L, a:a + n].numpy()
        self._placed(self._host_flat, p._lo, n, stamps=True)[...] = self.cache.ring[slot, L, a:a + n].numpy()
        p._pulled = True

    def mark_batch(self, parts, checkpoint: bool = False, slots: int = 0) -> SlotBatch | None:
        """Record one event on the current stream after the snapshots of `parts` submitted with mark=False (on
        the thread and stream that submitted them, before they are handed to the thread that launches the host
        copies); parts already marked are left alone. One torch call per batch instead of one per step.

        checkpoint=True (step ring): the device step counter is copied into the checkpoint ring first. `slots`:
        how many step-ring steps of the batch were handed over by reference (no PendingRows yet): the returned
        SlotBatch carries the checkpoint and the event their take_slot() on the consumer's thread uses."""
        j = None
        mixed = slots < len(parts)          # not every part went by reference: some are PendingRows
        if checkpoint and self.cache.slots:
            j = self._ckpt_next
            self._ckpt_next = (j + 1) % len(self._ckpt_host_np)
            if self._cuda:      # the counter as the compute stream leaves the batch, copied before its event
                self._checkpoint(j)
            else:
                self._ckpt_host_np[j] = self.cache._counter.numpy()[0]
            if mixed:
                for p in parts:
                    if getattr(p, "slot", None) is not None and not p._released:
                        p._ckpt = j
        todo = [p for p in parts if getattr(p, "_staged", None) is _UNMARKED and not p._released] if mixed else ()
        if not self._cuda or not (todo or slots):
            return SlotBatch(j, None, 0) if slots else None
        box = _BatchEvent(self._batch_pool.pop() if self._batch_pool else torch.cuda.Event(), len(todo) + slots)
        self._record_now(box.event)
        self._seq += 1
        for p in todo:
            p._staged, p._shared, p._seq = box.event, box, self._seq
        return SlotBatch(j, box, self._seq) if slots else None

    def _checkpoint(self, j: int) -> None:
        """Copy the device step counter into entry j of the checkpoint ring, on this thread's current stream."""
        if self._drv is not None:
            m = self._ckpt_m
            m.dstDevice = self._ckpt_ptr + j * m.WidthInBytes
            try:
                self._drv.copy_2d(m, cudriver.current_stream(self._dev_index))
                return
            except cudriver.DriverError as e:       # refused at launch (nothing ran): torch calls from now on
                self._drv = cudriver.give_up(e)
        self._ckpt_dev[j:j + 1].copy_(self.cache._counter)

    def take_slot(self, first: int, n: int, slot: int, batch: SlotBatch) -> PendingRows:
        """On the thread that consumes the rows: host-ring rows for a step-ring step the engine thread handed over
        by reference (its rows [first, first + n) in slot `slot`; `batch` from mark_batch(slots=...)), as
        submit_slot() would have made them on the engine thread. A dropped PendingRows when the host ring is full
        (its positions are then lost; its share of the batch's event is given back). Every step counted in `batch`
        must be taken or forgotten (forget_slot)."""
        box = batch.box
        p = self._slot_part(first, n, slot, 1, None if box is None else box.event)
        if p.dropped:
            self.forget_slot(batch)
            return p
        p._shared, p._seq, p._ckpt = box, batch.seq, batch.ckpt
        return p

    def forget_slot(self, batch: SlotBatch) -> None:
        """A step counted in `batch` that will never be taken: its share of the batch's event is given back."""
        box = batch.box
        if box is None:
            return
        with self._launch_lock:
            box.users -= 1
            if box.users == 0:
                self._batch_pool.append(box.event)

    def _record_now(self, event) -> None:
        """Record `event` on this thread's current stream: a driver call with the GIL held once torch created it."""
        if self._drv is not None and event.cuda_event:
            try:
                self._drv.event_record(event.cuda_event, cudriver.current_stream(self._dev_index))
                return
            except cudriver.DriverError as e:       # refused at launch (nothing ran): torch calls from now on
                self._drv = cudriver.give_up(e)
        _record(event, self._current_stream())

    def _unstage(self, p: PendingRows) -> None:
        """p's snapshot event is no longer needed by p (its copy was launched after a wait on it, or p was released
        unlaunched): back to its pool (a batch's shared event once no step of the batch needs it)."""
        box = p._shared
        if box is None:
            self._snap_pool.append(p._staged)
            return
        with self._launch_lock:
            box.users -= 1
            if box.users == 0:
                self._batch_pool.append(box.event)

    def submit_gather(self, source: torch.Tensor, index, *, may_drop: bool = True) -> PendingRows | None:
        """Start copying rows `index` ((n,) integers, in output order) of `source`, an (S, L, K) int16 tensor on
        the cache's device (the prefix store), exactly like submit() copies a step's rows: one index_select into
        the staging ring on the current stream, then the asynchronous copy to the host ring. Returns None for no
        rows, a PendingRows with dropped=True when the ring is full (may_drop=False: None then too, nothing
        counted, so the caller can try again later)."""
        L, K = self.cache.num_layers, self.cache.top_k
        if source.dim() != 3 or tuple(source.shape[1:]) != (L, K) or source.dtype != torch.int16 \
                or source.device != self.cache.device:
            raise ValueError(f"gather source {tuple(source.shape)} {source.dtype} on {source.device}; expected "
                             f"(S, {L}, {K}) int16 on {self.cache.device}")
        idx_np = np.asarray(index, dtype=np.int64).reshape(-1)
        n = len(idx_np)
        if n and (int(idx_np.min()) < 0 or int(idx_np.max()) >= source.shape[0]):
            raise ValueError(f"gather index outside [0, {source.shape[0]}): {int(idx_np.min())}..{int(idx_np.max())}")
        got = self._take(n, may_drop)
        if not isinstance(got, tuple):
            return got
        lo, handle = got
        self._idx_np[lo:lo + n] = idx_np
        index_t = self._idx_dev[lo:lo + n]
        if self._cuda:
            index_t.copy_(self._idx_host[lo:lo + n], non_blocking=True)
        dst = self._host[lo:lo + n] if not self._cuda else self._stage[lo:lo + n]
        torch.index_select(source, 0, index_t, out=dst)
        return self._send(lo, n, handle)

    def _take(self, n: int, may_drop: bool = True, rows: int | None = None):
        """Ring rows for n rows (`rows` ring rows, n by default): (lo, handle), or what submit returns instead
        (None, or a dropped PendingRows)."""
        if n == 0:
            self.stats.skipped_steps += 1
            return None
        if n > self.max_rows:
            raise ValueError(f"step has {n} rows, the copier was sized for max_rows={self.max_rows}")
        got = self._ring.alloc(n if rows is None else rows)
        if got is None and not may_drop:
            return None
        if got is None:
            self.stats.dropped_steps += 1
            self.stats.dropped_rows += n
            return PendingRows(self, (n, self.cache.num_layers, self.cache.top_k), 0, None, None, dropped=True)
        self.stats.submitted_steps += 1
        self.stats.submitted_rows += n
        return got

    def _send(self, lo: int, n: int, handle, layer_major: bool = False, ring_rows: int | None = None) -> PendingRows:
        """The rows [lo, lo + n) are in the staging ring (CUDA) or already in the host ring (CPU). CUDA: mark the
        snapshot's place on the compute stream (one reused event); the D2H copy is launched by `launch()` on the
        thread that consumes the rows."""
        shape = (n, self.cache.num_layers, self.cache.top_k)
        stamped = ring_rows is not None and self._stamped
        if not self._cuda:
            return PendingRows(self, shape, lo, handle, None, layer_major=layer_major, ring_rows=ring_rows,
                               stamped=stamped)
        snap = self._snap_pool.pop() if self._snap_pool else torch.cuda.Event()
        self._record_now(snap)                  # on the stream that ran the snapshot
        self._seq += 1
        return PendingRows(self, shape, lo, handle, None, staged=snap, seq=self._seq, layer_major=layer_major,
                           ring_rows=ring_rows, stamped=stamped)

    def _current_stream(self):
        """This thread's current stream on the cache's device. `torch.cuda.current_stream()` resolves the device in
        Python, a cost on the engine thread every call; the raw C call and a kept Stream object per stream id do
        not."""
        raw = torch._C._cuda_getCurrentStream(self._dev_index)
        stream = self._streams.get(raw)
        if stream is None:
            stream = self._streams[raw] = torch.cuda.Stream(stream_id=raw[0], device_index=raw[1],
                                                           device_type=raw[2])
        return stream

    def launch(self, parts) -> None:
        """Start the staging -> pinned host copies of `parts` (PendingRows of this copier, any order) whose copy
        is not launched yet: one non_blocking copy on the side stream per run of parts adjacent in the ring, after
        the compute stream's last snapshot. Call on the thread that consumes the rows (never the engine's): it
        costs a few torch calls per batch of steps, and nothing here waits."""
        if not self._cuda:
            return
        with self._launch_lock:
            todo = sorted((p for p in parts if p._staged is not None and not p._released), key=lambda p: p._lo)
            if not todo:
                return
            if any(p._staged is _UNMARKED for p in todo):
                raise RuntimeError("rows submitted with mark=False were handed over before mark_batch(): their "
                                   "snapshot has no event to wait on")
            side = self._stream
            newest = max(todo, key=lambda p: p._seq)
            side.wait_event(newest._staged)   # the compute stream ran every older snapshot of `todo` before it
            prev = self._current_stream()
            torch.cuda.set_stream(side)
            try:
                slotted = [p for p in todo if p.slot is not None]
                if slotted:
                    todo = [p for p in todo if p.slot is None]
                    self._launch_slots(slotted)
                i = 0
                while i < len(todo):
                    j, lo = i, todo[i]._lo
                    hi = lo + todo[i]._m
                    while j + 1 < len(todo) and todo[j + 1]._lo == hi:
                        j += 1
                        hi += todo[j]._m
                    self._host[lo:hi].copy_(self._stage[lo:hi], non_blocking=True)
                    event = self._events.pop() if self._events else torch.cuda.Event(blocking=True)
                    event.record(side)
                    for p in todo[i:j + 1]:
                        p._event = event
                    i = j + 1
                for p in todo + slotted:          # the wait above is enqueued: the events can be recorded again
                    box = p._shared
                    if box is None:
                        self._snap_pool.append(p._staged)
                    else:                         # a batch's one event: once no step of the batch needs it
                        box.users -= 1
                        if box.users == 0:
                            self._batch_pool.append(box.event)
                    p._staged = None
            finally:
                torch.cuda.set_stream(prev)

    def _launch_slots(self, parts: list) -> None:
        """On the side stream (after the batch's wait): per part, its rows out of its slot of the step ring into
        the host ring, then the slot's stamps of those rows (after the rows: see capture/cache.py), then each batch's
        checkpoint once; one event after all of them."""
        ring, L = self.cache.ring, self.cache.num_layers
        flat = self._host.view(-1)
        ckpts = set()
        for p in parts:
            (slot, a), n = p.slot, p.shape[0]
            self._placed(flat, p._lo, n).copy_(ring[slot, :L, a:a + n], non_blocking=True)
            self._placed(flat, p._lo, n, stamps=True).copy_(ring[slot, L, a:a + n], non_blocking=True)
            if p._ckpt is not None and p._ckpt not in ckpts:
                ckpts.add(p._ckpt)
                self._ckpt_host[p._ckpt:p._ckpt + 1].copy_(self._ckpt_dev[p._ckpt:p._ckpt + 1], non_blocking=True)
        event = self._events.pop() if self._events else torch.cuda.Event(blocking=True)
        event.record(self._stream)
        for p in parts:
            p._event = event

    def _snapshot(self, runs: list, dst: torch.Tensor, lo: int, n: int) -> None:
        """Copy the rows of `runs` into dst ((n, L, K) ring rows from lo), in order; a stamped cache's stamps of the
        same rows go right after them, (n, K) at ring row lo + n."""
        if self._stamped:
            stamp_dst = self._placed((self._host if not self._cuda else self._stage).view(-1), lo, n, stamps=True)
        if len(runs) == 1:
            a, b = int(runs[0][0]), int(runs[0][1])
            dst.copy_(self._src[a:b])
            if self._stamped:
                stamp_dst.copy_(self.cache.stamp_rows[a:b])
            return
        bounds = np.asarray(runs, dtype=np.int64)             # (runs, 2): [start, end) in the batch
        lens = bounds[:, 1] - bounds[:, 0]
        firsts = np.cumsum(lens) - lens                       # where each run starts in the output
        idx = self._idx_np[lo:lo + n]
        np.add(np.repeat(bounds[:, 0] - firsts, lens), np.arange(n), out=idx)
        index = self._idx_dev[lo:lo + n]
        if self._cuda:
            index.copy_(self._idx_host[lo:lo + n], non_blocking=True)
        if self.cache.dtype == torch.int16:
            torch.index_select(self._src, 0, index, out=dst)
            if self._stamped:
                torch.index_select(self.cache.stamp_rows, 0, index, out=stamp_dst)
        else:
            dst.copy_(torch.index_select(self._src, 0, index))

    def _release(self, handle, event, waited: bool) -> None:
        if waited:
            self._ring.free(handle)
            if event is not None and event not in self._events:
                self._events.append(event)          # its copy has landed: the event can be recorded again
        else:
            self._ring.free(handle, fence=event)    # the range stays taken until the event has passed
