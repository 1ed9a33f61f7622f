"""The prefix store's lifecycle in one worker (ROUTING_REPLAY_PREFIX_ROWS=fill): make and attach the store, keep it
trusted, queue the prefix rows of requests opened with prefix-cache hits and gather them into the batch.

Every forward, captured or not, writes its routing into a PrefixStore by KV slot (capture/prefix_store.py): under
CUDA graphs inside the forward (the cache's end-of-step flush scatters the step's rows to the runner's persistent
slot-mapping buffer, part of the replayed graph); where hooks run in Python every step, the worker's post_step
(RoutingCache.store_step). The store is made when vLLM starts its warm-up, after the KV cache is sized and before
graphs are captured. A request opened with hits gets rows [0, num_cached_tokens) gathered from the store (its
block-table row -> slots) into the same host ring and batch as computed rows, after the step's forward: with
other requests' rows, once the queue has waited MAX_BATCH_STEPS steps or holds half a step's rows, or at once when
the request's blocks are freed. A weight reload invalidates the store (the queue is gathered first); a store the
runner stopped feeding (a replaced slot-mapping buffer) is dropped, loudly, and prefix rows stay -1 from then on.
Rows read as -1 reach the consumer as such and make the record `prefix_not_found`. With
ROUTING_REPLAY_PREFIX_REFS, hit blocks that a captured request computed are named by reference in the open instead
of gathered (BlockWriters, prefix_refs.py); only the rest of the hits is queued.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable

from routing_replay.capture import PrefixStore, hit_slots_many
from routing_replay.engines.vllm_plugin.prefix_refs import BlockWriters

log = logging.getLogger("vllm.routing_replay")


def check_fill_supported(vc) -> None:
    """Refuse ROUTING_REPLAY_PREFIX_ROWS=fill where cached KV may come from outside this worker's forwards."""
    if getattr(vc, "kv_transfer_config", None) is not None:
        raise NotImplementedError(
            "routing-replay: ROUTING_REPLAY_PREFIX_ROWS=fill with a KV connector (kv_transfer_config): KV loaded "
            "from outside this engine has no routing rows here. Use ROUTING_REPLAY_PREFIX_ROWS=sentinel.")


class Fill:
    """One request's prefix rows on their way out of the store: positions [0, hits), whose KV slots follow from
    the request's first blocks (`blocks`, the engine's block ids), and how many were gathered so far. The slots
    are computed at the gather, for all its requests at once (hit_slots_many)."""

    __slots__ = ("rid", "key", "blocks", "hits", "done")

    def __init__(self, rid: str, key: str, blocks: list, hits: int):
        self.rid, self.key, self.blocks, self.hits, self.done = rid, key, blocks, hits, 0


class PrefixRows:
    """Own the prefix store of one worker and the prefix rows waiting for their gather.

    `fill` and `store` change only through this object; the worker mirrors both (it reads them every step) through
    `on_change`. The gathers go into the worker's `batch` and hand-overs (`flush`) as computed rows do."""

    def __init__(self, runner, kind: str, cache, copier, batch, stats, *, fill: bool, max_batch_steps: int,
                 max_batch_rows: int, flush: Callable[[], None], on_change: Callable[[], None] | None = None,
                 refs: bool = False):
        self.runner, self.kind = runner, kind
        self.cache, self.copier, self.batch, self.stats = cache, copier, batch, stats
        self.device = cache.device
        self.max_batch_steps, self.max_batch_rows = max_batch_steps, max_batch_rows
        self.flush = flush
        self.on_change = on_change if on_change is not None else (lambda: None)
        self.producer = None                    # publish_rows of a gather the host ring had no room for
        self.fill = fill
        self.store: PrefixStore | None = None   # made when warm-up starts (KV cache sized, graphs not captured)
        self.refs = refs                        # ROUTING_REPLAY_PREFIX_REFS: name computed blocks by reference
        self.writers: BlockWriters | None = None    # with refs, once the store exists: who computed each KV block
        self.block_size = 0
        self.slot_mapping = None                # the runner's persistent slot buffer the store write reads
        self._owner = None                      # slot_owner() when the store was attached
        self._keepalive: list = []              # dropped stores that captured graphs may still write
        self.fills: list = []                   # (engine id, key, hits, blocks, rows by reference) this step
        self.queue: deque[Fill] = deque()       # prefix rows waiting for their gather (room in the host ring)
        self.rids: set = set()                  # the engine ids in the queue
        self.wait = 0                           # steps since the queue was last emptied
        self.rows = 0                           # rows in the queue (a gather is due at half a step's rows)

    def _set(self, fill: bool, store: PrefixStore | None) -> None:
        self.fill, self.store = fill, store
        self.on_change()

    def set_writers(self, writers: BlockWriters | None) -> None:
        """Name hit blocks by reference through `writers` (None: gather every hit)."""
        self.writers = writers
        self.on_change()

    # ---- the store -------------------------------------------------------------------------------------------

    def make(self, gate: bool) -> None:
        """Allocate the PrefixStore for every KV slot of this worker's cache (its size is known only after vLLM
        sized the KV cache) and attach it to the cache. On a cache layout it cannot serve, log an ERROR and fall
        back to -1 prefix rows (records then say num_prefix_filled = 0): never a silently wrong row. `gate`: hooks
        run in Python every step (the worker writes the store after the forward, never the flush)."""
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
            self.cache.attach_store(store, slot_mapping, in_flush=not gate)
            kv_bytes = sum(int(t.size) for t in getattr(kcc, "kv_cache_tensors", []) or [])
        except Exception as e:          # noqa: BLE001 -- degrade to the sentinel, loudly
            self._set(False, self.store)
            log.error("routing-replay: ROUTING_REPLAY_PREFIX_ROWS=fill cannot run here (%s: %s); prefix-cached "
                      "prompt rows stay -1 (num_prefix_filled=0)", type(e).__name__, e)
            return
        self.slot_mapping, self.block_size = slot_mapping, block_size
        if self.refs:
            self.writers = BlockWriters(block_size)
        self._set(self.fill, store)
        self._owner = self.slot_owner()
        cpu = self.device.type == "cpu"
        log.info("routing-replay: prefix store %d slots (%d blocks x %d), %.1f MiB on %s (%.2f%% of the KV cache's "
                 "%.1f MiB; %d B per slot); capture total: device %.1f MiB, host %.1f MiB", num_slots,
                 int(kcc.num_blocks), block_size, store.nbytes / 2**20, self.device,
                 100.0 * store.nbytes / kv_bytes if kv_bytes else float("nan"), kv_bytes / 2**20,
                 store.nbytes // num_slots, (self.cache.nbytes + self.copier.device_bytes + store.nbytes) / 2**20
                 if not cpu else 0.0, (self.copier.host_bytes + (store.nbytes if cpu else 0)) / 2**20)

    def adopt(self, store: PrefixStore, block_size: int) -> None:
        """Serve prefix rows from `store`, which the forward writes already (attached to the cache by the caller,
        or written inside captured graphs), for KV blocks of `block_size` slots."""
        self.block_size = block_size
        self.slot_mapping = self.slot_owner() if self.kind == "v1" else self.runner.block_tables.slot_mappings[0]
        self._owner = self.slot_owner()
        self._set(self.fill, store)

    def set_mode(self, mode: str, gate: bool, graphs_captured: bool) -> None:
        """Switch between `fill` and `sentinel` between steps (see WorkerCapture.set_prefix_rows)."""
        if mode not in ("fill", "sentinel"):
            raise ValueError(f"prefix rows mode {mode!r}: choose fill or sentinel")
        if mode == "fill":
            check_fill_supported(self.runner.vllm_config)
            if self.store is None and graphs_captured and not gate:
                raise ValueError("routing-replay: prefix rows `fill` under CUDA graphs needs the store in the "
                                 "captured graphs: start the engine with ROUTING_REPLAY_PREFIX_ROWS=fill")
        fill = mode == "fill"
        self.clear()
        if self.writers is not None:
            self.writers.clear()
        store = self.store
        if not fill and gate and store is not None:
            self.cache.detach_store()
            store = None
        self._set(fill, store)

    def check_captured(self, binding) -> None:
        """Warm-up is over (CUDA graphs captured). The graphs hold the store write only if our hooks were in place
        while they were captured: otherwise drop the store (loudly) rather than let a replay skip a write."""
        if self.store is None or binding is None or binding.gate:
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
        if not binding.bound():
            self.lost("capture hooks were not in place after CUDA graph capture")
            return
        log.info("routing-replay: prefix store write issued %d times during warm-up and graph capture "
                 "(incomplete: %d)", self.cache.store_writes, self.cache.incomplete_flushes)

    def slot_owner(self):
        """The runner's persistent slot-mapping tensor (V1: group 0's buffer; V2: all groups' buffer), by
        identity: a runner that replaced it no longer writes the buffer the store write reads."""
        if self.kind == "v1":
            return self.runner.input_batch.block_table[0].slot_mapping.gpu
        return self.runner.block_tables.slot_mappings

    def trusted(self) -> bool:
        """Checked before rows leave the store (not on every step): the runner still writes the slot-mapping
        buffer the store write reads. If it replaced it, rows written since sit at slots nobody has read yet; the
        whole store goes (lost) before any of them could be."""
        if self.slot_owner() is self._owner:
            return True
        self.lost("the runner replaced its slot-mapping buffer after the store was attached")
        return False

    def lost(self, why: str) -> None:
        """The store can no longer be trusted to follow the KV cache: drop it, loudly; prefix rows stay -1."""
        self.store.invalidate()
        self.cache.detach_store()
        self._keepalive.append(self.store)      # captured graphs may still write it: never free it
        self.clear()
        self.writers = None
        self._set(False, None)
        log.error("routing-replay: prefix store dropped (%s); prefix-cached prompt rows stay -1 from now on "
                  "(num_prefix_filled=0)", why)

    def invalidate(self) -> None:
        """Set every stored row to -1 (new weights), after gathering the rows still queued for requests in flight:
        their KV, and so their routing, came from the old weights, and the queue waits up to 16 steps."""
        if self.queue and self.trusted():
            self.pump(force=set(self.rids))
        if self.store is not None:
            self.store.invalidate()
        if self.writers is not None:            # rows of the old weights: no later hit names them
            self.writers.clear()

    def forget_step(self, n: int) -> None:
        """Eager step whose hooks did not all record: its n KV slots hold no prefix rows (the forward's store
        write, if the last layer ran, stored stale rows for the missing layers)."""
        self.store.forget(self.slot_mapping[:n])
        self.stats.store_forgotten += n

    # ---- the queue -------------------------------------------------------------------------------------------

    def clear(self) -> None:
        """No prefix rows waiting: neither this step's opens nor the queue."""
        self.fills, self.queue = [], deque()
        self.rids = set()
        self.wait = self.rows = 0

    def opened(self, new, key: str, prompt, prompt_len: int, scheduled: dict) -> tuple:
        """A captured request opens (fill mode, with a store): the references to hit blocks a captured request
        computed, for its open (prefix_refs.py; () without them), and, if it has prefix-cache hits, its prefix
        rows queued for the gather after this step's forward (those not named by reference). `scheduled`: the
        step's tokens per engine id."""
        refs, covered = (), 0
        if self.writers is not None:
            # which of its hit blocks a captured request computed; records what this one computes
            refs, covered = self.writers.open(new.req_id, key, prompt, new.block_ids[0],
                                              int(new.num_computed_tokens), prompt_len,
                                              scheduled.get(new.req_id, 0))
        if new.num_computed_tokens:
            # the request's KV blocks of group 0 as the scheduler allocated them, hits first (what both runners
            # append to their block tables); slot = block x block size + offset
            self.fills.append((new.req_id, key, int(new.num_computed_tokens), new.block_ids[0], covered))
        return refs

    def refused(self, rid: str, key: str) -> None:
        """The producer refused the open of `rid` under `key` (sent in the step it opened, before its rows were
        queued): its rows are not gathered, and it is never named as a writer (no consumer holds its rows)."""
        if self.fills:
            self.fills = [f for f in self.fills if f[0] != rid]
        if self.writers is not None:
            self.writers.forget_key(key)
            self.writers.ended((rid,))

    def blocks_freed(self, finished, preempted) -> None:
        """Before the forward (pre_step): the queued requests among `finished` and `preempted` have their rows
        gathered now, before this step's forward may reuse their blocks."""
        rids = self.rids
        freed = rids.intersection(finished)
        if preempted:
            freed |= rids.intersection(preempted)
        if freed and self.trusted():
            self.pump(force=freed)

    def after_forward(self) -> None:
        """After a forward that wrote the store (post_step): this step's opens with hits join the queue, and the
        queue is gathered once it has waited a batch's worth of steps or holds half a step's rows (one gather per
        batch, not one per request opened: each gather is torch calls on this thread); a request whose blocks are
        freed before its turn is gathered then (blocks_freed)."""
        if self.fills and self.trusted():       # (else the store went, and both queues with it)
            self._queue_fills()
        if self.queue:
            self.wait += 1
            if (self.wait >= self.max_batch_steps or self.rows >= self.copier.max_rows // 2) and self.trusted():
                self.pump()

    def _queue_fills(self) -> None:
        """After the forward of their first step (which wrote the store): the KV slots of rows [0, hits) of each
        request opened this step with prefix hits, queued for the gather (the request holds those blocks until it
        finishes or is preempted, so the slots keep their rows until then)."""
        fills, self.fills = self.fills, []
        bs = self.block_size
        queue, rids = self.queue, self.rids
        for rid, key, hits, blocks, covered in fills:
            self.stats.prefix_ref_rows += covered
            if covered >= hits:                 # every hit named by reference: nothing to gather
                continue
            f = Fill(rid, key, blocks[:(hits + bs - 1) // bs], hits)     # (a copy: C speed)
            f.done = covered                    # rows [0, covered) go by reference (prefix_refs)
            queue.append(f)
            rids.add(rid)
            self.rows += hits - covered
        self.stats.prefix_requests += len(fills)
        self.stats.prefix_rows += sum(f[2] for f in fills)

    def pump(self, force: set | None = None) -> None:
        """Gather queued prefix rows into the host ring, oldest first, up to half a step's rows per gather (many
        requests' rows in one index_select), while the ring keeps room for two worst-case steps (the steps' own
        rows are never pushed out by prefix rows). `force`: only the requests with these engine ids, whose
        blocks are freed in this step (finished, preempted): their rows go now, dropped (published as lost, the
        record says so) if the ring is full."""
        q = self.queue
        chunk = max(1, self.copier.max_rows // 2)
        if force:
            forced = deque(f for f in q if f.rid in force)
            self.queue = q = deque(f for f in q if f.rid not in force)
            self.rids -= force
            while forced:
                self.gather(forced, chunk, may_drop=True)
            return                              # the others wait for their turn (after_forward)
        reserve = 2 * self.copier.max_rows
        while q:
            want = min(chunk, self.rows)        # (the rows still queued: no walk over the queue)
            if self.copier.free_rows < want + reserve or not self.gather(q, chunk, may_drop=False):
                return
        self.wait = 0

    def gather(self, q: deque, chunk: int, may_drop: bool) -> bool:
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
        slots = hit_slots_many(spans, self.block_size)     # every request's slots in a few numpy calls
        pending = self.copier.submit_gather(self.store.rows, slots, may_drop=may_drop)
        if pending is None:
            return False
        for n in counts:
            f = q[0]
            f.done += n
            if f.done == f.hits:
                q.popleft()
                self.rids.discard(f.rid)
        self.rows -= sum(counts)
        if pending.dropped:                     # host ring full: published as lost, the record says so
            self.flush()
            self.producer.publish_rows(keys, starts, counts, pending)
            return True
        self.batch.add(pending, keys, starts, counts, strict=False)
        if self.batch.rows >= self.max_batch_rows:
            self.flush()
        return True
