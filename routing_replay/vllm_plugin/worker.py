"""Capture routing in one vLLM worker and publish it per engine step: open, delta, finish/abort per request.

Which worker publishes: tensor-parallel rank 0 of every (data-parallel rank, pipeline stage); the other TP
ranks bind nothing and cost nothing. Each pipeline stage publishes the rows of its own MoE layers
(`Producer(layer_range=...)`); only the first stage sends open/finish/abort, so a request is announced and
closed once. In embedded mode there must be exactly one publishing worker.

Per step (`Worker.execute_model`, engine thread):
  before the forward  finished_req_ids -> finish/abort (lengths from the scheduler, see scheduler_hooks.py);
                      scheduled_new_reqs that are captured -> open(prompt_len, num_cached_tokens = the prefix-
                      cache hits vLLM reported when it first scheduled the request, prompt token ids);
                      if a captured request runs in this step: mark its cache rows -1 (the sentinel).
  forward             each MoE router's capture hook records its top-k ids (binding.py).
  after the forward   rows of captured requests are found with the runner's own batch layout: request i of
                      `input_batch.req_ids` owns batch tokens query_start_loc[i]..query_start_loc[i+1], the
                      first at absolute position `input_batch.num_computed_tokens_cpu[i]` (read after
                      execute_model, i.e. after vLLM's deferred spec-decode corrections); one
                      `AsyncCopier.submit(segments)` and one `Producer.publish_rows(...)`, both non-blocking.
                      The producer's thread waits for the copy, checks for -1 rows, sends, releases.
Steps with no captured request do nothing beyond two dict/set checks: no copy, no message.

Positions are absolute, so chunked prefill, preemption + recompute (a re-sent position overwrites) and
speculative decoding (rows of rejected drafts are overwritten by the next step or lie beyond the final
length) need no special case here.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from capture import AsyncCopier, RoutingCache
from routing_replay.vllm_plugin import keys as _keys
from routing_replay.vllm_plugin import scheduler_hooks
from routing_replay.vllm_plugin.binding import CaptureBinding, find_moe_layers
from routing_replay.vllm_plugin.endpoint import Sink
from routing_replay.vllm_plugin.settings import Settings

log = logging.getLogger("routing_replay.vllm")


class LostHookError(RuntimeError):
    """A MoE layer did not record its routing in a step that captured a request: never publish stale rows."""


@dataclass
class WorkerStats:
    steps: int = 0                  # execute_model calls seen
    active_steps: int = 0           # steps that published rows
    rows: int = 0
    opened: int = 0
    finished: int = 0
    aborted: int = 0
    host_ns: int = 0                # time spent in pre_step + post_step (engine thread)
    rebinds: int = 0


class _CheckedRows:
    """Own one step's PendingRows on its way through the producer: refuse rows that no router wrote."""

    __slots__ = ("_pending", "shape", "dtype", "dropped", "_what")

    def __init__(self, pending, what: str):
        self._pending = pending
        self.shape = pending.shape
        self.dtype = pending.dtype
        self.dropped = pending.dropped
        self._what = what

    def result(self) -> np.ndarray:
        rows = self._pending.result()
        if rows.size and int(rows.min()) < 0:
            bad = np.argwhere((rows < 0).any(axis=2))
            raise LostHookError(f"routing-replay: {len(bad)} (row, layer) cells of {self._what} were never written "
                                f"by a router (first: row {bad[0][0]}, local MoE layer {bad[0][1]}); a capture "
                                "hook was lost (e.g. a layer rebuilt after binding). Refusing to publish stale "
                                "routing.")
        return rows

    def release(self) -> None:
        self._pending.release()


def _v1_runner_cls():
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    return GPUModelRunner


class WorkerCapture:
    """Own one worker's routing capture: the hooks bound to the model's routers, the RoutingCache they write,
    the AsyncCopier that snapshots each step's rows, the Sink (producer) that publishes them, and the map from
    engine request ids to the record keys of the requests being captured."""

    def __init__(self, worker, settings: Settings):
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        runner = worker.model_runner
        if not isinstance(runner, _v1_runner_cls()):
            raise NotImplementedError(
                f"routing-replay hooks vLLM's V1 model runner; this worker runs {type(runner).__module__}."
                f"{type(runner).__name__}. Set VLLM_USE_V2_MODEL_RUNNER=0.")
        self.runner = runner
        self.settings = settings
        self.stats = WorkerStats()
        vc = worker.vllm_config
        pc = vc.parallel_config
        tp, pp = get_tp_group(), get_pp_group()
        self.publisher = tp.rank_in_group == 0
        self.announces = pp.rank_in_group == 0
        self.tracked: dict[str, str] = {}       # engine request id -> record key
        self.active = False
        self.binding = None
        self.sink = None
        self._warned_no_notes = False
        if not self.publisher:
            return

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
        self.cache = RoutingCache(max_tokens, len(layers), top_k, device=self.device)
        self.copier = AsyncCopier(self.cache, num_slots=4)
        eager = self.device.type == "cpu" or bool(vc.model_config.enforce_eager)
        self.binding = CaptureBinding(layers, self.cache.record,
                                      dp_rank=int(pc.data_parallel_rank), dp_size=int(pc.data_parallel_size),
                                      gate=eager)
        self.binding.bind()
        self.layer_ids = local_ids
        self.randomized = _keys.randomized_ids()
        self.sink = Sink(settings, single_publisher=pc.data_parallel_size == 1 and pp.world_size == 1,
                         num_layers=len(global_ids), top_k=top_k, moe_layer_ids=global_ids,
                         layer_range=layer_range)
        self.producer = self.sink.producer
        log.info("routing-replay: bound %d MoE layers %s (of %s), top_k=%d, cache %d tokens (%.1f MiB on %s), "
                 "requests=%s", len(layers), local_ids, global_ids, top_k, max_tokens,
                 self.cache.nbytes / 2**20, self.device, settings.requests)

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
        self.binding.layers = layers
        self.binding.bind()
        self.stats.rebinds += 1
        log.info("routing-replay: re-bound %d MoE layers after %s", len(layers), reason)

    # ---- per step ----------------------------------------------------------------------------------------------

    def pre_step(self, so) -> None:
        t0 = time.perf_counter_ns()
        self.stats.steps += 1
        tracked = self.tracked
        if tracked and so.finished_req_ids:
            notes = getattr(so, scheduler_hooks.ATTR, None)
            for rid in so.finished_req_ids:
                key = tracked.pop(rid, None)
                if key is not None:
                    self._close_request(rid, key, notes)
        for new in so.scheduled_new_reqs:
            if new.req_id in tracked or not self.settings.captures(new.sampling_params):
                continue
            key = _keys.external_key(new.req_id, self.randomized)
            tracked[new.req_id] = key
            if self.announces:
                prompt = new.prompt_token_ids
                self.producer.open(key, prompt_len=len(prompt), num_cached_tokens=int(new.num_computed_tokens),
                                   prompt_token_ids=prompt)
                self.stats.opened += 1
        active = bool(tracked) and not tracked.keys().isdisjoint(so.num_scheduled_tokens)
        self.active = active
        b = self.binding
        b.active = active or not b.gate
        if active:
            b.calls = 0
            self.cache.buffer[:, :so.total_num_scheduled_tokens].fill_(-1)
        self.stats.host_ns += time.perf_counter_ns() - t0

    def _close_request(self, rid: str, key: str, notes) -> None:
        info = notes.get(rid) if notes is not None else None
        if info is None:
            # The scheduler hook did not see this request finish (a scheduler class that does not derive from
            # vLLM's Scheduler, or settings that differ between processes): use the worker's own view.
            if not self._warned_no_notes:
                log.warning("routing-replay: no finish notes from the scheduler for %r; using the worker's "
                            "output count (may be one token long under async scheduling)", key)
                self._warned_no_notes = True
            st = self.runner.requests.get(rid)
            out = list(st.output_token_ids) if st is not None else []
            info = scheduler_hooks.Finished(len(out), "unknown", out)
        if not self.announces:
            return
        if info.num_output_tokens == 0 and info.reason == "abort":
            self.producer.abort(key, "abort", 0)
            self.stats.aborted += 1
        else:
            self.producer.finish(key, num_output_tokens=info.num_output_tokens, finish_reason=info.reason,
                                 output_token_ids=info.output_token_ids)
            self.stats.finished += 1

    def post_step(self, so) -> None:
        if not self.active:
            return
        t0 = time.perf_counter_ns()
        self.active = False
        b = self.binding
        self.cache.flush()
        if b.gate and b.calls != len(b.layers):
            raise LostHookError(f"routing-replay: {b.calls} of {len(b.layers)} MoE layers recorded routing in "
                                f"this step; hooks bound: {b.bound()}. Refusing to publish stale routing.")
        runner = self.runner
        ib = runner.input_batch
        n = ib.num_reqs
        req_ids = ib.req_ids
        qsl = runner.query_start_loc.np
        computed = ib.num_computed_tokens_cpu
        tracked = self.tracked
        segments, keys, starts, counts = [], [], [], []
        for i in range(n):
            key = tracked.get(req_ids[i])
            if key is None:
                continue
            a = int(qsl[i])
            c = int(qsl[i + 1]) - a
            if c <= 0:
                continue
            segments.append((a, c))
            keys.append(key)
            starts.append(int(computed[i]))
            counts.append(c)
        pending = self.copier.submit(segments)
        if pending is not None:
            self.producer.publish_rows(keys, starts, counts, _CheckedRows(pending, f"{len(keys)} requests"))
            self.stats.active_steps += 1
            self.stats.rows += pending.shape[0]
        self.stats.host_ns += time.perf_counter_ns() - t0

    # ---- lifecycle ---------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Send what is queued and stop the producer (and the embedded pipeline). Idempotent."""
        if self.binding is not None:
            self.binding.unbind()
        if self.sink is not None:
            self.sink.close()
            self.sink = None
