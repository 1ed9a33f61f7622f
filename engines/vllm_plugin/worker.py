"""Capture routing in one vLLM worker and publish it per engine step: open, delta, finish/abort per request.

One row's path, from the router hook to the producer (engine thread unless said otherwise):
  1. build (below) reads the runner and settings once into a CapturePlan (plan.py) and wires the parts the plan
     asks for: a RoutingCache (capture/cache.py), an AsyncCopier, a CaptureBinding (binding.py), this
     WorkerCapture and the Sink whose Producer publishes (endpoint.py).
  2. pre_step, before the forward: the RequestTracker (requests.py) ends the step's finished requests and opens
     its new ones under their record keys; the binding is armed (eager: the hooks count themselves) or, under
     CUDA graphs without step stamps, the step's cache rows are set to -1.
  3. The forward: each MoE router's capture hook (binding.py) records its top-k ids into the RoutingCache (eager
     CPU: keeps the router's tensor); the cache's end-of-step flush stamps the rows (and writes the step ring and
     the prefix store, prefix_rows.py).
  4. post_step, after the forward: the step path the plan chose (step_paths.py: RingPath, HostPath or the general
     StepPath) reads the runner's layout through a BatchReader (runners.py) and adds the step to the StepBatch
     (step_batch.py): by reference (a ring slot, the routers' tensors) or as a snapshot of the cache rows.
  5. flush: up to MAX_BATCH_STEPS steps leave as one delta (earlier before a finish that needs them, or when
     the host ring is half used): one event for the batch, then Producer.publish_steps with a BatchedRows.
  6. On the producer's thread, BatchedRows resolves raw steps' engine ids to keys, copies the rows to the host,
     checks them (StampCheck, stamps.py: stale rows are refused or reported lost, never published) and releases
     them; the producer sends the delta.
Steps with no captured request do nothing beyond two dict/set checks: no copy, no message.

Which worker publishes: tensor-parallel rank 0 of every (data-parallel rank, pipeline stage); the other TP
ranks bind nothing and cost nothing. Each pipeline stage publishes the rows of its own MoE layers
(`Producer(layer_range=...)`); only the first stage sends open/finish/abort, so a request is announced and
closed once. In embedded mode there must be exactly one publishing worker.

Rows are found with the runner's own batch layout: request i of the batch owns batch tokens
query_start_loc[i]..query_start_loc[i+1], the first at absolute position num_computed_tokens[i] (read after
execute_model, i.e. after vLLM's deferred spec-decode corrections). Positions are absolute, so chunked prefill,
preemption + recompute (a re-sent position overwrites) and speculative decoding (rows of rejected drafts are
overwritten by the next step or lie beyond the final length) need no special case here.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass

import torch

from routing_replay.capture import AsyncCopier, PrefixStore, RoutingCache
from routing_replay.capture.cache import stamp_dtype
from routing_replay.engines.vllm_plugin import keys as _keys
from routing_replay.engines.vllm_plugin import scheduler_hooks
from routing_replay.engines.vllm_plugin.binding import HOLDS, CaptureBinding, find_moe_layers
from routing_replay.engines.vllm_plugin.endpoint import Sink
from routing_replay.engines.vllm_plugin.prefix_rows import PrefixRows, check_fill_supported
from routing_replay.engines.vllm_plugin.plan import CapturePlan, kernels_on, make_plan
from routing_replay.engines.vllm_plugin.requests import RequestTracker
from routing_replay.engines.vllm_plugin.runners import batch_reader, check_runner_supported, runner_kind
from routing_replay.engines.vllm_plugin.selfcheck import check_runner
from routing_replay.engines.vllm_plugin.settings import Settings
from routing_replay.engines.vllm_plugin.stamps import LostHookError
from routing_replay.engines.vllm_plugin.step_batch import StepBatch
from routing_replay.engines.vllm_plugin.step_paths import make_path

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
    prefix_rows: int = 0            # rows gathered from the prefix store (or sent by reference, below)
    prefix_ref_rows: int = 0        # of them, rows named by reference (prefix_refs) instead of gathered
    store_forgotten: int = 0        # slots set to -1 because a step's routing was not fully recorded
    derived_keys: int = 0           # requests captured under record_key_for(id): their id cannot travel as it is
    duplicate_keys: int = 0         # requests captured as f"{key}#{n}": another live request had their key
    skipped: int = 0                # requests not captured (or closed as aborted) after an error of their own


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
                     moe_layer_ids=list(plan.global_layer_ids), layer_range=plan.layer_range,
                     num_experts=max(m.num_experts for m in layers) or None))
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
                                       randomized=randomized, producer=producer, flush=self.flush)
        self.tracked = self.requests.tracked    # engine request id -> record key (the tracker's own dict)
        self._closing = self.requests.closing   # finishes waiting for the batch (the tracker's own dict)
        self.active = False
        self.storing = False                    # this step's routing goes into the prefix store (fill)
        # the prefix store's lifecycle (fill mode); `fill` and `store` mirror its own (read every step)
        self.prefix = PrefixRows(runner, plan.kind, cache, copier, self.batch, self.stats, fill=plan.fill,
                                 max_batch_steps=plan.max_batch_steps, max_batch_rows=plan.max_batch_rows,
                                 flush=self.flush, on_change=self._prefix_changed, refs=settings.prefix_refs)
        self.prefix.producer = producer
        self.fill = plan.fill
        self.store: PrefixStore | None = None   # made when warm-up starts (KV cache sized, graphs not captured)
        self.writers = None                     # fill + ROUTING_REPLAY_PREFIX_REFS: who computed each KV block
        self.graphs_captured = False            # compile_or_warm_up_model returned (graphs hold the store write)
        self.forwards = 0                       # steps with tokens launched through execute_model (StampCheck)
        # a graph engine's step of the running batch (RingPath.ring_step): the last step went to the step ring by
        # reference and left nothing for the next pre_step but counting its forward (pre_step's first branch)
        self.steady = False
        # an eager CPU step of the running batch went to the batch as its routers' tensors (HostPath): the plugin's
        # execute_model may leave pre_step out for the next step if it opens, ends and preempts nothing; post_step
        # then does pre_step's work itself (_late_pre_step)
        self.host_next = False
        self.sink = None
        self.producer = producer
        self.warming = False                    # Worker.compile_or_warm_up_model runs: V2 feeds it fake requests
        self.requests.on_refused = self.prefix.refused
        # how a captured step's rows reach the batch after its forward, chosen once (step_paths.py); its fast
        # paths, or None, are what post_step checks
        self.path = make_path(plan, self, batch_reader(runner, plan.kind))
        self._fast, self._host_raw = self.path.fast, self.path.host_raw
        if self._host_raw is not None and binding is not None and binding.gate:
            # the routers' top-k tensors are host memory: a captured step's go to the producer's thread as they
            # are (HostRows), no copy into the cache nor out of it on the engine thread
            binding.take_step = self.path.take_step

    def connect(self, sink: Sink) -> None:
        """Publish through `sink` (its producer; embedded mode: the helper process it started)."""
        self.sink = sink
        self.producer = self.requests.producer = self.prefix.producer = sink.producer
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
            self.prefix.invalidate()
        log.info("routing-replay: re-bound %d MoE layers after %s%s", len(layers), reason,
                 "; prefix store invalidated" if self.store is not None else "")

    # ---- prefix store (fill mode) ------------------------------------------------------------------------------

    def _prefix_changed(self) -> None:
        p = self.prefix
        self.fill, self.store, self.writers = p.fill, p.store, p.writers

    def set_prefix_rows(self, mode: str) -> None:
        """Switch fill mode between steps (benchmarks compare both on one engine); call only while no captured
        request is in flight. Under CUDA graphs the store write is part of the captured graphs: `sentinel` then
        stops the gathers but the store stays (and stays written), and `fill` needs an engine started with
        ROUTING_REPLAY_PREFIX_ROWS=fill. Eager (CPU, enforce_eager): `sentinel` frees the store, `fill` starts an
        empty one at the next step."""
        self.prefix.set_mode(mode, self.binding is not None and self.binding.gate, self.graphs_captured)

    def prepare_store(self) -> None:
        """Warm-up starts (the KV cache is sized, no CUDA graph is captured yet): make and attach the store, so
        every graph captured from now on writes it."""
        if self.fill and self.store is None and self.binding is not None:
            self.prefix.make(self.binding.gate)

    def check_captured_store(self) -> None:
        """Warm-up is over (CUDA graphs captured). The graphs hold the store write only if our hooks were in place
        while they were captured: otherwise drop the store (loudly) rather than let a replay skip a write."""
        self.prefix.check_captured(self.binding)

    def adopt_store(self, store: PrefixStore, block_size: int) -> None:
        """Serve prefix rows from `store`, which the forward writes already (attached to the cache by the caller,
        or written inside captured graphs), for KV blocks of `block_size` slots (bench/worker_step_probe.py)."""
        self.prefix.adopt(store, block_size)

    def stamp_baseline(self) -> None:
        """Warm-up is over (CUDA graphs captured, nothing in flight): with step stamps, read the device counter once
        (one synchronizing read, at start-up only) so that the first step's stamp is checked too."""
        if self.binding is None or self.batch.stamps is None:      # no capture, or no stamps
            return
        stamp = self.cache.stamp_value()
        self.batch.stamps.baseline(stamp, self.forwards)
        log.info("routing-replay: step stamps on: counter %d after warm-up and graph capture, %d forwards so far",
                 stamp, self.forwards)

    # ---- per step ----------------------------------------------------------------------------------------------

    def _late_pre_step(self, so) -> None:
        """pre_step's work, at post_step's start, for a step the plugin's execute_model left it out of: the last
        step was an eager CPU step of the running batch handed over as its routers' tensors (HostPath, which arms
        `host_next`) and this one opens, ends, preempts and speculates nothing (plugin.py). Then nothing pre_step
        does has to precede the forward: the C hooks keep every layer's tensor whatever the binding says, in the
        list the last post_step emptied. One entry into the plugin per step instead of two (right after a forward
        each entry pays its cold cache lines). Here: pre_step's short
        path where a captured request ran, else all of pre_step (which then lets go of nothing)."""
        self.host_next = False
        n = so.total_num_scheduled_tokens
        tracked = self.tracked
        if n and tracked and not tracked.keys().isdisjoint(so.num_scheduled_tokens):
            self.steady = False
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
        self.steady = False            # pre_step's general path (no captured request runs: it lets go of nothing)
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
        if self.steady and self.tracked and not (so.scheduled_new_reqs or so.finished_req_ids
                                                 or so.preempted_req_ids or so.scheduled_spec_decode_tokens
                                                 or self.writers is not None and self.writers.prefill) \
                and so.total_num_scheduled_tokens and not self.tracked.keys().isdisjoint(so.num_scheduled_tokens):
            # the running batch's step after one that went by reference: to the ring (RingPath, a graph engine)
            # or as the routers' tensors (HostPath, CPU eager): nothing opens, ends or waits for the store, a
            # captured request runs; of the path below only the forward's count is left and, eager, the hooks'
            # count and list (a forward since the last post_step, one that raised or ran outside a step, may have
            # left tensors there). Armed again by that post_step only
            self.steady = False
            self.forwards += 1
            self.active = True
            b = self.binding
            if b.gate:
                b.calls, b.min_rows = 0, so.total_num_scheduled_tokens
                b.clear()
            if t0:
                self._quiet = True
                st.quiet_steps += 1
                self.count_host(t0, w0)
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
                self.count_host(t0, w0)
            return
        if so.preempted_req_ids:
            st.preempted += len(so.preempted_req_ids)
        if so.scheduled_spec_decode_tokens:
            st.spec_steps += 1
        requests = self.requests
        if requests.reopen_due:     # (before this step's finishes: a request's open again goes before its finish)
            requests.reopen()
        tracked = self.tracked
        prefix = self.prefix
        if self.fill and prefix.rids and (so.finished_req_ids or so.preempted_req_ids):
            prefix.blocks_freed(so.finished_req_ids, so.preempted_req_ids)     # (before the forward reuses them)
        if tracked and so.finished_req_ids and not tracked.keys().isdisjoint(so.finished_req_ids):
            requests.end(so.finished_req_ids, getattr(so, scheduler_hooks.ATTR, None))
        n = so.total_num_scheduled_tokens
        store = self.store
        if store is None and self.fill and n and (self.binding.gate or not self.graphs_captured):
            prefix.make(self.binding.gate)
            store = self.store
        if store is not None and so.scheduled_new_reqs and not prefix.trusted():
            store = None                            # before a request opens with rows from it
        writers = self.writers
        if writers is not None and writers.prefill:     # blocks the captured prompts compute (prefix_refs.py)
            if so.finished_req_ids or so.preempted_req_ids:
                writers.ended(so.finished_req_ids)
                writers.ended(so.preempted_req_ids or ())
            writers.step(so.scheduled_cached_reqs, so.num_scheduled_tokens)
        if so.scheduled_new_reqs:
            self._open_requests(so.scheduled_new_reqs, so.num_scheduled_tokens)
        if self.fill and requests.opens:
            # with a prefix store, each step's opens go at once: waiting for the hand-over costs fill engines
            # engine-thread time every step (docs/VLLM.md, "Step ring")
            requests.send_opens()
        active = bool(tracked) and not tracked.keys().isdisjoint(so.num_scheduled_tokens)
        self.active = active
        if self._closing and not active:
            self.flush()           # no captured request runs: the batch and the finishes waiting for it go now
        if n:                       # (after every flush of this call: a batch's hand-over counts forwards run)
            self.forwards += 1      # this step runs the model: with stamps, its flush counts it too
        storing = store is not None and n > 0
        b = self.binding
        b.active = active or storing or not b.gate
        # post_step's store work: on eager steps, the hooks' count (incomplete steps' slots are forgotten); the
        # gathers of prefix rows. Under CUDA graphs with nothing to gather there is none (the forward wrote the
        # store) but the flush check (post_step).
        self.storing = storing and (b.gate or bool(prefix.fills) or bool(prefix.queue))
        if b.gate:
            if active or storing:               # hooks run in Python: count the ones that cover the step
                b.calls, b.min_rows = 0, so.total_num_scheduled_tokens
                b.clear()       # tensors a step left (one not captured, whose C hooks kept them; one whose
                self.path.host_step = None  # forward raised before post_step) must not count for this one
        elif active and not self.cache.stamped:     # replayed from graphs: rows no router writes stay -1 (the
            self.cache.fill_step(n)             # store needs no fill: its write checks the layers at capture)
        if t0:
            self.count_host(t0, w0)

    def _open_requests(self, scheduled_new_reqs, scheduled: dict) -> None:
        """Open the step's newly scheduled requests (RequestTracker.open); with a prefix store, their opens name
        the hit blocks a captured request computed, and the prefix rows of the other hits are queued for their
        gather after the forward (PrefixRows.opened). `scheduled`: the step's tokens per engine id."""
        requests, tracked = self.requests, self.tracked
        prefix_rows = self.fill and self.store is not None
        on_prefix = functools.partial(self.prefix.opened, scheduled=scheduled) if prefix_rows else None
        forward = self.forwards + 1             # (this step's forward, once pre_step counts it)
        for new in scheduled_new_reqs:
            if new.req_id in tracked:
                continue
            if new.req_id in requests.seen:     # (read each time: a flush may give it a new table)
                self.flush()           # the batch may hold raw steps where this id is a request that ended
            requests.open(new, forward, prefix_rows, on_prefix)

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
        fast = self._fast
        if fast is not None and not storing and fast(so, t0, w0):     # (RingPath: a graph engine, never gated)
            return
        self.steady = False
        # ends the step: an eager step's layers held are handed over (HostPath.take_step, while `active` still says the
        # step is captured; the C hooks of enforce_eager engines keep every layer's tensor until here, other
        # engines' last hook drained already), and the cache's flush resets its per-step count, so the next step
        # is judged on its own, and forgets this step's slots
        host = None
        if b.gate:
            held = b.held
            if active and self._host_raw is not None and not self.fill and all(map(HOLDS, held)):
                # CPU, enforce_eager: every layer's C hook kept its tensor (binding._make_hook); they go to the
                # producer's thread as they are, where HostRows checks them (2-D, top_k columns, the step's rows,
                # integer ids): no torch attribute is read here (cold after the forward, each read is costly)
                tensors = held[:]
                held[:] = [None] * len(held)
                b.calls = len(tensors)
                self.active = self.storing = False
                self._host_raw(so, tensors, b.min_rows, t0, w0)        # (HostPath)
                return
            try:
                b.drain()
            finally:
                self.active = self.storing = False
            path = self.path
            host, path.host_step = path.host_step, None
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
                self.prefix.forget_step(so.total_num_scheduled_tokens)
                log.warning("routing-replay: %d of %d MoE layers recorded this step's routing; its %d KV "
                            "slots hold no prefix rows (store_forgotten=%d)", b.calls, len(b.layers),
                            so.total_num_scheduled_tokens, self.stats.store_forgotten)
            prefix = self.prefix
            if prefix.fills or prefix.queue:
                prefix.after_forward()      # queue this step's opens with hits; gather when due
        if not active:
            if t0:
                self.count_host(t0, w0)
            return
        self.path.layout_step(so, host, t0, w0)

    def count_host(self, t0: int, w0: int) -> None:
        """While `timing`: add a pre_step / post_step section that started at (thread ns t0, wall ns w0) to stats."""
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

    def flush(self) -> None:
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
                self.flush()                               # every snapshot is done before the batch's event
            finally:
                self.sink.close()
                self.sink = None
