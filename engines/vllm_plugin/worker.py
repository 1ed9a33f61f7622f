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
import time
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from routing_replay.capture import AsyncCopier, HostRows, PrefixStore, RoutingCache, hit_slots_many
from routing_replay.capture.cache import ID_DTYPES, stamp_dtype
from routing_replay.engines.vllm_plugin import keys as _keys
from routing_replay.engines.vllm_plugin import scheduler_hooks
from routing_replay.engines.vllm_plugin.binding import HOLDS, CaptureBinding, find_moe_layers, record_held
from routing_replay.engines.vllm_plugin.endpoint import Sink
from routing_replay.engines.vllm_plugin.plan import HANDOVER_HOST, CapturePlan, kernels_on, make_plan
from routing_replay.engines.vllm_plugin.requests import RequestTracker
from routing_replay.engines.vllm_plugin.runners import check_runner_supported, runner_kind, step_layout, batch_refs
from routing_replay.engines.vllm_plugin.selfcheck import check_runner
from routing_replay.engines.vllm_plugin.settings import Settings
from routing_replay.engines.vllm_plugin.stamps import LostHookError
from routing_replay.engines.vllm_plugin.step_batch import StepBatch, resolve_raw_steps

log = logging.getLogger("vllm.routing_replay")


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
    prefix_rows: int = 0            # rows gathered from the prefix store
    store_forgotten: int = 0        # slots set to -1 because a step's routing was not fully recorded
    derived_keys: int = 0           # requests captured under record_key_for(id): their id cannot travel as it is
    duplicate_keys: int = 0         # requests captured as f"{key}#{n}": another live request had their key
    skipped: int = 0                # requests not captured (or closed as aborted) after an error of their own


class _Fill:
    """One request's prefix rows on their way out of the store: positions [0, hits), whose KV slots follow from
    the request's first blocks (`blocks`, the engine's block ids), and how many were gathered so far. The slots
    are computed at the gather, for all its requests at once (hit_slots_many)."""

    __slots__ = ("rid", "key", "blocks", "hits", "done")

    def __init__(self, rid: str, key: str, blocks: list, hits: int):
        self.rid, self.key, self.blocks, self.hits, self.done = rid, key, blocks, hits, 0


def check_fill_supported(vc) -> None:
    """Refuse ROUTING_REPLAY_PREFIX_ROWS=fill where cached KV may come from outside this worker's forwards."""
    if getattr(vc, "kv_transfer_config", None) is not None:
        raise NotImplementedError(
            "routing-replay: ROUTING_REPLAY_PREFIX_ROWS=fill with a KV connector (kv_transfer_config): KV loaded "
            "from outside this engine has no routing rows here. Use ROUTING_REPLAY_PREFIX_ROWS=sentinel.")


def build(worker, settings: Settings) -> "WorkerCapture | None":
    """The capture of one vLLM worker, wired from its runner and config: the plan (plan.py), then the RoutingCache,
    AsyncCopier and CaptureBinding it asks for, the WorkerCapture that owns them and the Sink (producer) it
    publishes to. None on a rank that does not publish (tensor-parallel ranks but 0): it binds nothing."""
    from vllm.distributed.parallel_state import get_pp_group, get_tp_group

    runner = worker.model_runner
    kind = runner_kind(runner)
    vc = worker.vllm_config
    pc = vc.parallel_config
    tp, pp = get_tp_group(), get_pp_group()
    if tp.rank_in_group != 0:
        return None
    check_runner_supported(runner, kind, vc)
    check_runner(runner, kind)
    layers = find_moe_layers(runner.get_model())
    if not layers:
        raise ValueError("routing-replay: the model has no MoE layers (no MoERunner modules)")
    local_ids = [m.layer_id for m in layers]
    stages = None
    if pp.world_size > 1:
        stages = [None] * pp.world_size
        torch.distributed.all_gather_object(stages, local_ids, group=pp.cpu_group)
    top_k = layers[0].top_k
    device = runner.device
    cc = vc.compilation_config
    plan = make_plan(settings, kind=kind, device_type=device.type, enforce_eager=bool(vc.model_config.enforce_eager),
                     layer_ids=local_ids, top_k=top_k,
                     max_num_batched_tokens=int(vc.scheduler_config.max_num_batched_tokens),
                     max_cudagraph_capture_size=getattr(cc, "max_cudagraph_capture_size", None),
                     cudagraph_capture_sizes=getattr(cc, "cudagraph_capture_sizes", None),
                     all_stage_layer_ids=stages, dp_rank=int(pc.data_parallel_rank),
                     dp_size=int(pc.data_parallel_size), stamp_supported=stamp_dtype(top_k) is not None,
                     kernels_run=kernels_on(device))
    if plan.fill:
        check_fill_supported(vc)
    cache, copier = make_cache(plan, device)
    binding = CaptureBinding(layers, cache.record, dp_rank=plan.dp_rank, dp_size=plan.dp_size, gate=plan.eager,
                             c_hooks=plan.c_hooks)
    cap = WorkerCapture(runner, settings, plan, cache=cache, copier=copier, binding=binding,
                        announces=pp.rank_in_group == 0, randomized=_keys.randomized_ids())
    binding.bind()
    cap.connect(Sink(settings, single_publisher=plan.single_publisher, in_flight=cap.in_flight,
                     on_restart=cap.requests.helper_restarted, num_layers=len(plan.global_layer_ids), top_k=top_k,
                     moe_layer_ids=list(plan.global_layer_ids), layer_range=plan.layer_range))
    log.info("routing-replay: bound %d MoE layers %s (of %s), top_k=%d, cache %d tokens (%.1f MiB on %s), "
             "host ring %.1f MiB, requests=%s, prefix_rows=%s, model runner %s", len(layers), local_ids,
             list(plan.global_layer_ids), top_k, plan.max_tokens, (cache.nbytes + copier.device_bytes) / 2**20,
             device, copier.host_bytes / 2**20, settings.requests, settings.prefix_rows, kind.upper())
    return cap


def make_cache(plan: CapturePlan, device) -> tuple[RoutingCache, AsyncCopier]:
    """The RoutingCache the plan's hooks write (with its step stamps and step ring) and the AsyncCopier that takes
    rows out of it."""
    cache = RoutingCache(plan.max_tokens, plan.num_layers, plan.top_k, device=device, stamp=plan.stamp,
                         slots=plan.ring_slots, slot_rows=plan.ring_rows or None)
    if plan.ring_slots:
        log.info("routing-replay: step ring %d slots x %d rows (%.1f MiB on %s): steps of up to %d tokens "
                 "launch nothing on the engine thread; slot write: %s", plan.ring_slots, cache.slot_rows,
                 cache.ring.numel() * 2 / 2**20, cache.device, cache.slot_rows,
                 "2 Triton kernels" if cache.uses_ring_kernels else "4 torch kernels")
    return cache, AsyncCopier(cache, num_slots=plan.copier_slots)


class WorkerCapture:
    """Own one worker's routing capture: the hooks bound to the model's routers (`binding`), the RoutingCache they
    write, the AsyncCopier that snapshots each step's rows, the StepBatch that carries them to the producer, the
    producer that publishes them, and the map from engine request ids to the record keys of the requests being
    captured. Built by `build` (vLLM) or directly from a plan and its parts (bench/worker_step_probe.py)."""

    def __init__(self, runner, settings: Settings, plan: CapturePlan, *, cache: RoutingCache, copier: AsyncCopier,
                 binding, producer=None, announces: bool = True, randomized: bool = False):
        """`binding`: a CaptureBinding over `cache.record` (not bound yet: the caller binds it); `producer`: the
        Producer to publish to, or None until connect(sink)."""
        self.plan = plan
        self.cache, self.copier, self.binding = cache, copier, binding
        self.device = cache.device
        self.batch = StepBatch(plan.top_k, stamped=cache.stamped)
        self.max_batch_steps = plan.max_batch_steps
        self.max_batch_rows = plan.max_batch_rows
        self.layer_ids = list(plan.layer_ids)
        self.kind = plan.kind
        self.runner = runner
        self.settings = settings
        self.stats = WorkerStats()
        self.timing = False             # benchmarks: count engine-thread CPU time (stats.host_ns, binding.hook_ns)
        self._quiet = False             # while timing: this step opened, finished and preempted nothing
        self.requests = RequestTracker(settings, self.stats, runner, batch=self.batch, announces=announces,
                                       randomized=randomized, producer=producer, flush=self._flush)
        self.tracked = self.requests.tracked    # engine request id -> record key (the tracker's own dict)
        self._closing = self.requests.closing   # finishes waiting for the batch (the tracker's own dict)
        self._last_keys = (None, -1, None, True)  # (request ids, requests.gen, their keys, any None) of the last step
        self._last_layout = (None, None, None, None, None, None)  # post_step's per-layout results (see there)
        self.active = False
        self.storing = False                    # this step's routing goes into the prefix store (fill)
        self.fill = plan.fill
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
        self.host_next = False
        self._ring_views = (-1, None, None, None, None, None)   # _read_batch: num_reqs, the runner's two arrays,
        #                                                         memoryviews of their step parts, dtypes
        self._raw_views = (None, None, None, None, None)    # _raw_layout: the layout arrays, memoryviews, dtypes
        self._raw_ids = None            # _raw_layout: the engine ids of the last step (a copy its steps share)
        self._ib_refs = (None, False)   # _batch_refs of the runner's InputBatch (_read_batch)
        self._fills: list = []                  # (engine id, record key, hits) opened this step, fill mode
        self._fill_queue: deque[_Fill] = deque()  # prefix rows waiting for their gather (room in the host ring)
        self._fill_rids: set = set()            # the engine ids in the fill queue
        self._fill_wait = 0                     # steps since the fill queue was last emptied
        self._fill_rows = 0                     # rows in the fill queue (a gather is due at half a step's rows)
        self.sink = None
        self.producer = producer
        self.warming = False                    # Worker.compile_or_warm_up_model runs: V2 feeds it fake requests
        self.requests.on_refused = self._refused
        if plan.handover == HANDOVER_HOST and binding is not None and binding.gate:
            # the routers' top-k tensors are host memory: a captured step's go to the producer's thread as they
            # are (HostRows), no copy into the cache nor out of it on the engine thread
            binding.take_step = self._take_step

    def connect(self, sink: Sink) -> None:
        """Publish through `sink` (its producer; embedded mode: the helper process it started)."""
        self.sink = sink
        self.producer = self.requests.producer = sink.producer
        self.requests.keep_opens = sink.pipeline is not None

    def in_flight(self) -> list:
        """The record keys being captured (read by the embedded helper's watch thread when the helper dies: a copy
        of the values, taken in one C call under the GIL)."""
        return list(self.tracked.values())

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
        self.host_next = False                 # the next step's pre_step runs (it empties the new hooks' list)
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
            check_fill_supported(self.runner.vllm_config)
            if self.store is None and self.graphs_captured and not gate:
                raise ValueError("routing-replay: prefix rows `fill` under CUDA graphs needs the store in the "
                                 "captured graphs: start the engine with ROUTING_REPLAY_PREFIX_ROWS=fill")
        self.fill = mode == "fill"
        self._clear_fills()
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
        log.info("routing-replay: prefix store %d slots (%d blocks x %d), %.1f MiB on %s (%.2f%% of the KV cache's "
                 "%.1f MiB; %d B per slot); capture total: device %.1f MiB, host %.1f MiB", num_slots,
                 int(kcc.num_blocks), block_size, store.nbytes / 2**20, self.device,
                 100.0 * store.nbytes / kv_bytes if kv_bytes else float("nan"), kv_bytes / 2**20,
                 store.nbytes // num_slots, (self.cache.nbytes + self.copier.device_bytes + store.nbytes) / 2**20
                 if self.device.type != "cpu" else 0.0,
                 (self.copier.host_bytes + (store.nbytes if self.device.type == "cpu" else 0)) / 2**20)

    def adopt_store(self, store: PrefixStore, block_size: int) -> None:
        """Serve prefix rows from `store`, which the forward writes already (attached to the cache by the caller,
        or written inside captured graphs), for KV blocks of `block_size` slots (bench/worker_step_probe.py)."""
        self.store, self._block_size = store, block_size
        self._slot_mapping = self._slot_owner() if self.kind == "v1" else self.runner.block_tables.slot_mappings[0]
        self._owner = self._slot_owner()

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
        for rid, key, hits, blocks in fills:
            queue.append(_Fill(rid, key, blocks[:(hits + bs - 1) // bs], hits))     # (a copy: C speed)
            rids.add(rid)
            self._fill_rows += hits
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
        `host_next`) and this one opens, ends, preempts and speculates nothing (plugin.py). Then nothing pre_step
        does has to precede the forward: the C hooks keep every layer's tensor whatever the binding says, in the
        list the last post_step emptied. One entry into the plugin per step instead of two (right after a forward
        each entry pays its cold cache lines). Here: pre_step's short
        path where a captured request ran, else all of pre_step (which then lets go of nothing)."""
        self.host_next = False
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
        self.host_next = False
        if self.warming:                # V2 start-up warm-up: fake requests, fake blocks; nothing to capture
            self.active = self.storing = False
            return
        t0 = time.thread_time_ns() if self.timing else 0
        w0 = time.perf_counter_ns() if t0 else 0
        st = self.stats
        st.steps += 1
        # (isdisjoint walks the step's dict until a tracked id: with nothing tracked, all of it; so it goes last)
        if self._steady and self.tracked and not (so.scheduled_new_reqs or so.finished_req_ids
                                                  or so.preempted_req_ids or so.scheduled_spec_decode_tokens) \
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
        requests = self.requests
        if requests.reopen_due:     # (before this step's finishes: a request's open again goes before its finish)
            requests.reopen()
        tracked = self.tracked
        if self._fill_rids and (so.finished_req_ids or so.preempted_req_ids):
            freed = self._fill_rids.intersection(so.finished_req_ids)
            if so.preempted_req_ids:
                freed |= self._fill_rids.intersection(so.preempted_req_ids)
            if freed and self._store_trusted():     # their blocks may be reused by this step's forward
                self._pump_fills(force=freed)
        if tracked and so.finished_req_ids and not tracked.keys().isdisjoint(so.finished_req_ids):
            requests.end(so.finished_req_ids, getattr(so, scheduler_hooks.ATTR, None))
        n = so.total_num_scheduled_tokens
        store = self.store
        if store is None and self.fill and n and (self.binding.gate or not self.graphs_captured):
            self._make_store()
            store = self.store
        if store is not None and so.scheduled_new_reqs and not self._store_trusted():
            store = None                            # before a request opens with rows from it
        if so.scheduled_new_reqs:
            self._open_requests(so.scheduled_new_reqs)
        if self.fill and requests.opens:
            # with a prefix store, each step's opens go at once: waiting for the hand-over costs fill engines
            # engine-thread time every step (docs/VLLM.md, "Step ring")
            requests.send_opens()
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

    def _open_requests(self, scheduled_new_reqs) -> None:
        """Open the step's newly scheduled requests (RequestTracker.open); with a prefix store, queue the prefix
        rows of those opened with prefix-cache hits for their gather after the forward."""
        requests, tracked, seen = self.requests, self.tracked, self.requests.seen
        prefix_rows = self.fill and self.store is not None
        forward = self.forwards + 1             # (this step's forward, once pre_step counts it)
        for new in scheduled_new_reqs:
            if new.req_id in tracked:
                continue
            if new.req_id in seen:
                self._flush()           # the batch may hold raw steps where this id is a request that ended
            key = requests.open(new, forward, prefix_rows)
            if key is not None and prefix_rows and new.num_computed_tokens:
                # the request's KV blocks of group 0 as the scheduler allocated them, hits first (what both
                # runners append to their block tables); slot = block x block size + offset
                self._fills.append((new.req_id, key, int(new.num_computed_tokens), new.block_ids[0]))

    def _refused(self, rid: str) -> None:
        """The producer refused the open of `rid`: its prefix rows are not gathered (fill: its open went in the
        step it opened, before its rows were queued)."""
        if self._fills:
            self._fills = [f for f in self._fills if f[0] != rid]

    def post_step(self, so) -> None:
        if self.host_next:
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
            if active and b.take_step is not None and not self.fill and all(map(HOLDS, held)):
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
                # which maps the ids to keys and leaves out what is not captured (BatchedRows.resolve)
                ids, cb, qb, dtypes = self._raw_layout(req_ids, qsl, computed)
                batch = self.batch
                batch.add_raw(0, n, slot, ids, cb, qb, self.forwards, dtypes)
                self.stats.ring_steps += 1
                self._stepped(batch, n, t0, w0)
                return
        last_ids, last_gen, keys, uncaptured = self._last_keys
        # decode steps repeat the batch: compared item by item by identity (C speed, no id touched); the list
        # is copied and mapped to keys only when it changed
        gen = self.requests.gen
        changed = last_gen != gen or last_ids != req_ids
        if changed or keys is None:
            req_ids = list(req_ids)
            tracked = self.tracked
            keys = list(map(tracked.get, req_ids))     # C speed: churn steps change the list every step
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
            # _raw_layout, StepBatch.add_raw): the producer's thread maps the ids to keys (BatchedRows.resolve)
            batch.add_raw(0, nt, ((self.forwards + off) & stamps.mask) % cache.slots, last, bytes(rv[4]),
                          bytes(rv[3]), self.forwards, rv[5])
            st.ring_steps += 1
        st.active_steps += 1
        st.rows += nt
        if len(batch.parts) >= self.max_batch_steps or batch.rows >= self.max_batch_rows:
            self._flush()
        self._steady = not (self.fill and self.requests.opens)
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
        keys, starts, counts, _, _ = resolve_raw_steps([0], self.requests.seen, [self.forwards], [ids], [computed], [qsl])
        # (a dropped copy holds no rows: it stands for those of the requests kept, as the general path's does)
        pending.shape = (int(np.sum(counts[0])), *pending.shape[1:])
        self.producer.publish_rows(keys[0], starts[0], counts[0], pending)

    def _host_raw(self, so, tensors: list, n: int, t0: int, w0: int) -> None:
        """post_step of an eager CPU step whose every MoE layer's C hook kept its tensor: the step goes to the
        producer's thread as the runner laid it out (StepBatch.add_host), which maps its ids to record keys,
        leaves out what is not captured and checks the tensors (BatchedRows.resolve, HostRows). Here: the
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
        self.host_next = True      # (or the next step may leave pre_step out: _late_pre_step)
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
            refs = self._ib_refs = batch_refs(ib)
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
            if sig is not None and len(sig[0]) == 2 and sig[0][1] == self.cache.top_k and sig[1] in ID_DTYPES:
                # (tensors, bytes of one, checked)
                self._host_step = (held[:], sig[0][0] * sig[0][1] * sig[1].itemsize, True)
                if not self.fill:
                    held[:] = [None] * len(held)
                    return
                # the prefix store takes the step's rows from the cache (its flush): recorded there too; the capture
                # still goes by reference, not through a snapshot of the cache (copier.submit would be the largest
                # part of the step's work; bench/worker_step_probe.py --eager --mode fill)
        record_held(held, self.cache.record)

    def _stepped(self, batch: StepBatch, n: int, t0: int, w0: int) -> None:
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
        return ((self.forwards + off) & self.batch.stamps.mask) % self.cache.slots

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
        batch, requests = self.batch, self.requests
        # the opens that waited for a hand-over go before their rows
        gone = requests.send_opens() if requests.opens else None
        if batch.parts:                     # (step ring: the device counter now proves which slots it reads)
            if batch.raw:
                requests.seen_shared = True     # the producer's thread reads it: nothing is taken out of it now
            self.producer.publish_steps(*batch.hand_over(self.copier, self.forwards, requests.seen, gone),
                                        checked=True)
        if requests.ended or requests.closing or requests.ends:
            requests.handed_over()          # ended ids leave `seen`; the finishes that waited for this batch go

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
