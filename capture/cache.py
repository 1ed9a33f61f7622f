"""Keep one step's top-k expert ids of every MoE layer in one device buffer allocated at start-up, graph-safely.

Layout: `buffer` is (num_layers, max_tokens, top_k), layer-major, `dtype` (int16 by default; logical expert ids
must be below 2**15). Layer l's rows for a step of n tokens are `buffer[l, :n]`, a contiguous (n, K) block:
- so the end-of-step fused copy takes the multi-tensor fast path (`torch._foreach_copy_` needs source and
  destination of equal strides: one kernel for all layers, casting int64/int32 to int16 on the way);
- so a router that owns its top-k call can write straight into `layer_view(l)[:n]` (with dtype=torch.int64 the
  view is a valid `torch.topk(..., out=(values, view))` target and nothing at all is copied during the step).
`AsyncCopier` turns the rows of a step into (n, L, K) when it snapshots them.

Two ways `record` writes (chosen at construction, `fused=`):
- fused (default): `record(l, ids)` only keeps a reference to `ids`; when the last layer records (or on an
  explicit `flush()`) one `_foreach_copy_` writes every layer. Each layer's top-k tensor stays alive until then,
  which under CUDA graph capture means it is not reused by the graph pool: the addresses stay valid on replay.
- per-layer: `record(l, ids)` copies at once, one small kernel per layer (L launches per step instead of one;
  docs/PERFORMANCE.md has the measured cost of each).

Prefix store (`attach_store`): the flush also scatters the step's rows into a PrefixStore at the step's KV slots
(vLLM's persistent slot-mapping buffer, read on the device), so under CUDA graphs that write is replayed with the
rest of the hook and costs the engine thread nothing.

Step stamps (`stamp=True`, int16 caches, even top_k): the buffer gets one more layer, `stamp_rows`
(max_tokens, top_k). Viewed as 64-bit lanes (top_k a multiple of 4; else 32-bit), every lane of every row holds
the same device step counter. A flush in which every layer recorded adds 1 to all of them: one in-place kernel
over the whole layer, whatever the step's size (under CUDA graphs it is part of the graph). The copier
snapshots the stamp layer with the rows, in the same launch, so whoever reads a step's rows can tell that the
forward that produced them wrote every layer (its stamp advanced) without a -1 fill launched before every step:
a replay without the hooks, or a flush that missed a layer, leaves the stamp where it was (`read_stamp`; the
check against the engine's own count of forwards is StampCheck in engines/vllm_plugin/worker.py).

Step ring (`slots=S`, a power of two, stamped caches): a complete flush of n <=
`slot_rows` rows also copies the step's rows and stamps into slot (counter mod S) of a device ring (S, L + 1,
slot_rows, K), stamps first (every slot row's stamp lanes), then the step's rows. On CUDA with Triton that is two
kernels (capture/ring_kernels.py: the stamp add that also writes the slot's stamps and index, then the rows); else
the stamp add, `torch.remainder` of the counter and two `index_copy_`. Either way part of the graph under CUDA
graphs, and bit-identical. The engine thread then launches nothing per step: a reader (AsyncCopier.take_slot,
on the producer's thread) copies the rows out of the slot the engine's forward count predicts, then the slot's
stamps, and keeps the rows only if those stamps are the step's own. A later step that reuses the slot writes its
stamp before its rows, so a read that raced with it sees a stamp that is not the step's (the rows are then lost,
never wrong).

Graph safety: `record`, `flush` and `layer_view` allocate nothing, never read device values on the host and
branch only on Python-side facts fixed at capture time (shapes, dtypes, the layer number). The same code runs
eagerly, under `torch.cuda.graph` capture and on CPU.
"""

from __future__ import annotations

import numpy as np
import torch

from routing_replay.capture import cudriver, ring_kernels

ID_DTYPES = (torch.int16, torch.int32, torch.int64, torch.uint8)     # top-k id dtypes a router may hand record()
_compiling = torch.compiler.is_compiling


def stamp_dtype(top_k: int):
    """The lane type of the step counter in a stamp row of `top_k` int16 lanes: int64 when top_k is a multiple of
    4, int32 when it is even; None for odd top_k (no stamps: the -1 fill does that job)."""
    return torch.int64 if top_k % 4 == 0 else torch.int32 if top_k % 2 == 0 else None


def stamp_bits(top_k: int) -> int:
    """How many bits of the step counter a stamp row holds (its lane width)."""
    dt = stamp_dtype(top_k)
    if dt is None:
        raise ValueError(f"step stamps need an even top_k, got {top_k}")
    return 64 if dt == torch.int64 else 32


def stamp_lanes(stamps) -> np.ndarray:
    """An (n, K) int16 numpy block of stamp rows as its counter lanes (n, K / 4) int64 or (n, K / 2) int32, as
    stamp_dtype lays them out."""
    return stamps.view(np.int64 if stamps.shape[1] % 4 == 0 else np.int32)


def read_stamp(stamps) -> int | None:
    """The step counter (unsigned, stamp_bits wide) an (n, K) int16 numpy block of stamp rows holds
    (RoutingCache.stamp_rows as snapshotted), or None when its lanes do not all hold the same one."""
    lanes = stamp_lanes(stamps)
    if not (lanes == lanes.flat[0]).all():
        return None
    return int(lanes.flat[0]) & ((1 << (8 * lanes.itemsize)) - 1)


class RoutingCache:
    """Own the worst-case (num_layers, max_tokens, top_k) routing buffer, its per-layer views, and the
    references to this step's top-k tensors until the fused copy has consumed them."""

    def __init__(self, max_tokens: int, num_layers: int, top_k: int, device="cpu", dtype=torch.int16,
                 *, fused: bool = True, stamp: bool = False, slots: int = 0, slot_rows: int | None = None):
        if max_tokens < 1 or num_layers < 1 or top_k < 1:
            raise ValueError(f"max_tokens={max_tokens}, num_layers={num_layers}, top_k={top_k} must be >= 1")
        if dtype not in (torch.int16, torch.int32, torch.int64):
            raise ValueError(f"cache dtype must be int16, int32 or int64, got {dtype}")
        self.max_tokens = int(max_tokens)
        self.num_layers = int(num_layers)
        self.top_k = int(top_k)
        self.dtype = dtype
        self.fused = fused
        if stamp and dtype != torch.int16:
            raise ValueError(f"step stamps need an int16 cache, got {dtype}")
        if stamp and stamp_dtype(top_k) is None:
            raise ValueError(f"step stamps need an even top_k (a 32- or 64-bit counter per row), got {top_k}")
        # -1 marks rows no router has written: a bug shows up as an impossible expert id, not as stale data.
        # With stamps, one more layer after the routing layers holds each step's stamp (layer-major, contiguous:
        # `buffer` is a prefix view of it, and one copy of layers [0, L] takes the rows and their stamp).
        self._full = torch.full((num_layers + bool(stamp), max_tokens, top_k), -1, dtype=dtype, device=device)
        self.buffer = self._full[:num_layers]
        self.device = self.buffer.device          # "cuda" resolved to "cuda:<index>", as tensors report it
        self.stamped = bool(stamp)
        if stamp:
            self.stamp_rows = self._full[num_layers]                       # (max_tokens, top_k)
            # the counter in every lane of every row: starts at -1 (the fill), the first complete flush makes it 0
            self._stamp_lanes = self.stamp_rows.view(stamp_dtype(top_k))
        self.slots = int(slots)
        self.slot_rows = 0
        if self.slots:
            if not stamp:
                raise ValueError("a step ring needs step stamps (stamp=True)")
            R = self.slot_rows = min(self.max_tokens, int(slot_rows or self.max_tokens))
            if R < 1 or self.slots < 2 or self.slots & (self.slots - 1):
                # a power of two divides 2**32 and 2**64: the slot of a counter that wrapped is still counter mod S
                raise ValueError(f"step ring of {self.slots} slots x {R} rows: need a power of two >= 2 slots of "
                                 ">= 1 row")
            # stamps -1 everywhere: no slot holds a step's stamp until a flush wrote it
            self.ring = torch.full((self.slots, num_layers + 1, R, top_k), -1, dtype=dtype, device=self.buffer.device)
            self._slot = torch.zeros(1, dtype=torch.int64, device=self.buffer.device)
            self._counter = self._stamp_lanes[0, :1]
            self._slot_views: dict = {}
        # the stamp add and slot write as two Triton kernels where they run and match the torch path bit for bit
        self._kernels = None
        if self.slots and ring_kernels.available(self.device) and ring_kernels.check(self.device):
            self._kernels = ring_kernels.RingKernels(self._full, self.ring, self._slot)
        self.slot_writes = 0                     # slot writes issued from Python (eager steps, graph captures)
        self._views = [self.buffer[i] for i in range(num_layers)]
        self._held: list[torch.Tensor | None] = [None] * num_layers
        self._held_count = 0                     # layers held for the fused copy since the last flush
        self._held_sig = None                    # (rows, dtype) of the first of them
        self._held_mixed = False                 # a later one differs in rows or dtype
        self._flush_views: dict = {}             # n -> [layer view [:n] for every layer] (the fused copy's targets)
        self._step_views: dict = {}
        self._step_n: int | None = None          # rows of the step being recorded; None once flushed
        self._recorded = 0                       # layers recorded since the last flush
        self.incomplete_flushes = 0              # flushes (eager, or at graph capture) missing a layer
        self._store = None                       # (PrefixStore, slot mapping (>= max_tokens,) int64) or None
        self._store_in_flush = True              # the flush writes the store (else store_step, after the forward)
        # set while torch.compile traces the flush (its Python then runs once, at trace time, never again): whether
        # a store was attached to be written by it then. A traced flush without one never writes the store.
        self.traced = False
        self.traced_store = False
        self._store_views: dict = {}             # n -> (slots view, int16 rows view) for the store write
        self.store_writes = 0                    # store writes issued from Python (eager steps, graph captures)
        # fill_step on CUDA: one driver memset with the GIL held (capture/cudriver.py), checked once per device
        self._driver = cudriver.check(self.device) if self.device.type == "cuda" else None
        self._dev_index = self.device.index if self.device.type == "cuda" else None
        self._row_bytes = top_k * self.buffer.element_size()

    @property
    def uses_ring_kernels(self) -> bool:
        """The step ring's slot write runs as its two Triton kernels (capture/ring_kernels.py), else as torch ops."""
        return self._kernels is not None

    @property
    def nbytes(self) -> int:
        """Device bytes: the cache, and the step ring if any."""
        ring = self.ring.numel() * self.ring.element_size() if self.slots else 0
        return self._full.numel() * self._full.element_size() + ring

    def _write_slot(self, n: int) -> None:
        """Copy the slot rows' stamps (all slot_rows of them), then the step's n rows, into slot (counter mod slots)
        of the ring: stamps first (see the module docstring). Graph-safe: three kernels, no host read. (The
        Triton path does the same in the stamp add and one more kernel: _stamp_and_slot.)"""
        views = self._slot_views.get(n)
        if views is None:
            if len(self._slot_views) >= 4096:
                self._slot_views.clear()
            L = self.num_layers
            views = self._slot_views[n] = (self.ring[:, L], self.stamp_rows[:self.slot_rows].unsqueeze(0),
                                           self.ring[:, :L, :n], self.buffer[:, :n].unsqueeze(0))
        torch.remainder(self._counter, self.slots, out=self._slot)
        views[0].index_copy_(0, self._slot, views[1])
        views[2].index_copy_(0, self._slot, views[3])
        self.slot_writes += 1

    def _stamp_and_slot(self, n: int) -> None:
        """The stamp add, then (steps of up to slot_rows rows) the slot write: two Triton kernels where they run,
        else the torch kernels."""
        into_slot = n <= self.slot_rows
        k = self._kernels
        if k is None:
            self._stamp()
            if into_slot:
                self._write_slot(n)
            return
        k.stamp_slot(into_slot)
        if into_slot:
            k.rows_to_slot(n)
            self.slot_writes += 1

    def step_rows(self, n: int) -> torch.Tensor:
        """buffer[:, :n], every layer's rows of an n-token step (the view is kept per n: one torch call less
        on the engine thread when the caller then writes it)."""
        view = self._step_views.get(n)
        if view is None:
            if len(self._step_views) >= 4096:
                self._step_views.clear()
            view = self._step_views[n] = self.buffer[:, :n]
        return view

    def fill_step(self, n: int) -> None:
        """Set rows [0, n) of every layer to -1 (rows no router writes in the coming step then read -1), with one
        launch on the current stream: on CUDA a driver memset made with the GIL held, else `fill_`. Not for use
        under graph capture."""
        if not 0 <= n <= self.max_tokens:
            raise ValueError(f"fill_step({n}) outside [0, {self.max_tokens}]")
        if self._driver is not None:
            try:
                if n:
                    self._driver.memset_2d(self.buffer.data_ptr(), self.max_tokens * self._row_bytes, 0xFF,
                                           n * self._row_bytes, self.num_layers,
                                           cudriver.current_stream(self._dev_index))
                return
            except cudriver.DriverError as e:       # refused at launch (nothing ran): torch calls from now on
                self._driver = cudriver.give_up(e)
        self.step_rows(n).fill_(-1)

    def _stamp(self) -> None:
        """Count this step on the device: +1 in every lane of the stamp layer (one in-place kernel, graph-safe)."""
        self._stamp_lanes.add_(1)

    def stamp_value(self) -> int:
        """The device step counter now, read back (synchronizes: for start-up, tests and diagnostics only)."""
        if not self.stamped:
            raise RuntimeError("this cache has no step stamps")
        return read_stamp(self.stamp_rows[:1].cpu().numpy())

    def attach_store(self, store, slot_mapping: torch.Tensor, *, in_flush: bool = True) -> None:
        """From now on every step's n rows go into `store` (a PrefixStore) at `slot_mapping[:n]` (the engine's
        persistent per-step slot buffer: token i of the step went to KV slot slot_mapping[i], -1 for padding).
        in_flush=True: the flush writes it (inside the forward); attach before CUDA graphs are captured, as a graph
        replays what the flush did at capture time. in_flush=False: whoever ends the step calls `store_step` after
        the forward (hooks that run in Python every step, where torch.compile may have traced the flush into the
        compiled model before the store existed: a traced flush keeps the branches it took then)."""
        if slot_mapping.dim() != 1 or slot_mapping.device != self.device \
                or slot_mapping.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"slot mapping {tuple(slot_mapping.shape)} {slot_mapping.dtype} on "
                             f"{slot_mapping.device}; expected a 1-d int64 tensor on {self.device}")
        if tuple(store.rows.shape[1:]) != (self.num_layers, self.top_k) or store.table.device != self.device:
            raise ValueError(f"prefix store rows {tuple(store.rows.shape)} on {store.table.device}; expected "
                             f"(S, {self.num_layers}, {self.top_k}) on {self.device}")
        self._store = (store, slot_mapping)
        self._store_in_flush = bool(in_flush)
        self._store_views = {}

    def detach_store(self) -> None:
        self._store = None
        self._store_views = {}

    def layer_view(self, layer: int) -> torch.Tensor:
        """Layer `layer`'s (max_tokens, top_k) block; its first n rows are the current step's."""
        return self._views[layer]

    def _check(self, layer: int, topk_ids: torch.Tensor) -> None:
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"MoE layer {layer} outside the cache's [0, {self.num_layers})")
        if topk_ids.dim() != 2 or topk_ids.shape[1] != self.top_k or topk_ids.shape[0] > self.max_tokens:
            raise ValueError(f"layer {layer}: top-k ids of shape {tuple(topk_ids.shape)}, the cache takes "
                             f"(n <= {self.max_tokens}, {self.top_k})")
        if topk_ids.dtype not in ID_DTYPES:
            raise ValueError(f"layer {layer}: top-k ids must be an integer tensor, got {topk_ids.dtype}")
        if topk_ids.device != self.device:
            raise ValueError(f"layer {layer}: top-k ids on {topk_ids.device}, the cache is on {self.device}")

    def record(self, layer: int, topk_ids: torch.Tensor) -> None:
        """Router hook: store this step's (n, K) top-k expert ids of MoE layer `layer` (0-based among MoE
        layers). Graph-safe; with fused=True the write happens when the last layer records (or at flush())."""
        shape = topk_ids.shape
        if not (0 <= layer < self.num_layers and len(shape) == 2 and shape[1] == self.top_k
                and shape[0] <= self.max_tokens and topk_ids.dtype in ID_DTYPES and topk_ids.device == self.device):
            self._check(layer, topk_ids)            # raises, naming what is wrong
        n = shape[0]
        self._step_n = n
        self._recorded += 1
        held = self._held
        if not self.fused or not topk_ids.is_contiguous():
            # A strided source would push the whole fused list off the multi-tensor fast path.
            self._views[layer][:n].copy_(topk_ids)
            if held[layer] is not None:
                self._held_count -= 1
                held[layer] = None
        else:
            if held[layer] is None:
                self._held_count += 1
            held[layer] = topk_ids
            sig = (n, topk_ids.dtype)
            if self._held_sig is None:
                self._held_sig = sig
            elif sig != self._held_sig:
                self._held_mixed = True
        if layer == self.num_layers - 1:
            self.flush()

    def flush(self) -> None:
        """Write every held top-k tensor into its layer view with one fused copy per source dtype, then drop
        the references. record() calls it on the last layer; call it yourself when a step ends elsewhere
        (a pipeline stage that does not own the last layer). Graph-safe; a no-op when no layer recorded since
        the last flush. With a prefix store attached, the step's rows then go into it at their KV slots; if not
        every layer recorded since the last flush, the step's slots get -1 instead (`incomplete_flushes`)."""
        n = self._step_n
        if n is None:
            return
        complete = self._recorded == self.num_layers
        self._step_n, self._recorded = None, 0
        held = self._held
        if self._held_count == self.num_layers and not self._held_mixed and not _compiling():
            # every layer held, same rows and dtype (every step of a model whose routers all recorded): one copy
            # into the cached views of n rows, no per-layer slicing. Not while torch.compile traces the hooks (the
            # CPU build compiles the MoE block): a dict keyed by the row count would specialize a dynamic size.
            m = self._held_sig[0]
            dsts = self._flush_views.get(m)
            if dsts is None:
                if len(self._flush_views) >= 4096:
                    self._flush_views.clear()
                dsts = self._flush_views[m] = [v[:m] for v in self._views]
            torch._foreach_copy_(dsts, held)
            self._held = [None] * self.num_layers
        elif self._held_count:
            by_dtype: dict = {}
            for layer, src in enumerate(held):
                if src is not None:
                    dsts, srcs = by_dtype.setdefault(src.dtype, ([], []))
                    dsts.append(self._views[layer][:src.shape[0]])
                    srcs.append(src)
                    held[layer] = None
            for dsts, srcs in by_dtype.values():
                torch._foreach_copy_(dsts, srcs)
        self._held_count, self._held_sig, self._held_mixed = 0, None, False
        if not complete:
            self.incomplete_flushes += 1
        elif self.slots:
            self._stamp_and_slot(n)
        elif self.stamped:
            self._stamp()
        if _compiling():
            self.traced = True
            self.traced_store = self._store is not None and self._store_in_flush
        if self._store is None or not self._store_in_flush:
            return
        self.store_step(n, complete)

    def store_step(self, n: int, complete: bool = True) -> None:
        """Write the step's n rows (in the cache now) into the attached store at slot_mapping[:n]; complete=False
        (a layer's hook did not run: its rows here are stale): -1 at those slots instead. Graph-safe."""
        store, slot_mapping = self._store
        if not complete:
            # under capture the graph records that, so every replay forgets its slots rather than store stale
            # routing
            store.forget(slot_mapping[:n])
        elif self.dtype != torch.int16:             # int32/int64 caches: one cast per step (allocates)
            store.write(slot_mapping[:n], self.step_rows(n).transpose(0, 1).to(torch.int16))
        else:
            views = self._store_views.get(n)
            if views is None:
                if len(self._store_views) >= 4096:
                    self._store_views.clear()
                views = self._store_views[n] = (slot_mapping[:n], self.step_rows(n).transpose(0, 1))
            store.write(*views)
        self.store_writes += 1
