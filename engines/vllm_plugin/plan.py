"""The capture plan: everything about one worker's capture that is decided once, from the runner and the settings.

`make_plan` is a pure function of plain values (no vLLM, no device): which rank publishes, the MoE layers and
their place among all stages' layers, the cache's size, whether the hooks run in Python every step (eager) or are
replayed from CUDA graphs, which per-step check guards against stale rows (the hook counter, the -1 fill, step
stamps, the step ring), how a captured step reaches the producer (the hand-over path) and whether prefix-cached
prompt rows come from a prefix store. `build` (worker.py) reads these values off vLLM's runner and config, and
WorkerCapture and its collaborators are built from the plan; nothing re-decides them per step.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

from routing_replay.engines.vllm_plugin.settings import Settings
from routing_replay.engines.vllm_plugin.step_batch import MAX_BATCH_STEPS

log = logging.getLogger("vllm.routing_replay")

STEP_RING_SLOTS = 64                # steps the producer's thread may fall behind before step-ring rows are lost
LARGEST_GRAPH_DEFAULT = 512         # vLLM's largest CUDA graph when the config names none

# how a captured step's rows reach the producer (CapturePlan.handover)
HANDOVER_RING = "ring"              # V1 under CUDA graphs with the step ring: the step's slot by reference
HANDOVER_HOST = "host"              # CPU, enforce_eager: the routers' own top-k tensors by reference (HostRows)
HANDOVER_GENERAL = "general"        # any other: per step, its layout; rows from its ring slot, else a snapshot


@dataclass(frozen=True)
class CapturePlan:
    """What one worker captures and how, decided once at start-up (see the module docstring)."""

    kind: str                       # "v1" or "v2": the model runner (runners.py)
    device_type: str                # "cpu" or "cuda"
    layer_ids: tuple                # this stage's MoE layers (model layer ids), in order
    global_layer_ids: tuple         # every pipeline stage's MoE layers: the record's layer axis
    layer_range: tuple | None       # this stage's [lo, hi) of them (pipeline parallel), else None
    top_k: int
    max_tokens: int                 # rows of the routing cache: the most tokens one step (or one graph) carries
    eager: bool                     # hooks run in Python every step (CPU, enforce_eager): they count themselves
    c_hooks: bool                   # enforce_eager: the hooks are C calls (nothing traces the model's Python)
    stamp: bool                     # graphs: each step's rows carry its flush's step stamp (else a -1 fill per step)
    ring_slots: int                 # the step ring's slots (0: no ring)
    ring_rows: int                  # rows of a ring slot (the largest CUDA graph)
    handover: str                   # HANDOVER_RING / HANDOVER_HOST / HANDOVER_GENERAL
    fill: bool                      # ROUTING_REPLAY_PREFIX_ROWS=fill: a prefix store feeds prefix-cached rows
    copier_slots: int               # the host ring's worst-case steps (fill: prefix rows share it)
    max_batch_steps: int            # steps per delta message at most
    max_batch_rows: int             # rows per delta message before it goes (room in the host ring)
    dp_rank: int
    dp_size: int
    single_publisher: bool          # one publishing worker in the whole engine (embedded mode needs it)

    @property
    def num_layers(self) -> int:
        return len(self.layer_ids)


def ring_slots(settings: Settings, device_type: str, data_parallel_size: int,
               kernels_run: Callable[[], bool] | None = None) -> int:
    """The step ring's slots for a stamped engine whose settings ask for the ring (`ring`, or `auto`), or 0 with the
    reason logged: the ring needs one data-parallel rank (its slots follow the engine's own count of forwards, and
    dummy batches are forwards it does not count), and `auto` needs the ring's Triton kernels on the device
    (`kernels_run()`; the torch slot write costs the compute stream more per step than stamps and a snapshot;
    docs/PERFORMANCE.md)."""
    if not settings.step_ring:
        return 0
    if data_parallel_size > 1:
        log.info("routing-replay: the step ring needs one data-parallel rank (data_parallel_size=%d): step stamps "
                 "without it", data_parallel_size)
        return 0
    if settings.ring_needs_kernels and not (kernels_run is not None and kernels_run()):
        from routing_replay.capture import ring_kernels
        log.info("routing-replay: ROUTING_REPLAY_STEP_STAMP=auto: the step ring's Triton kernels do not run on %s "
                 "(%s=%s): step stamps without the ring", device_type, ring_kernels.ENV,
                 os.environ.get(ring_kernels.ENV, "1"))
        return 0
    return STEP_RING_SLOTS


def kernels_on(device) -> Callable[[], bool]:
    """kernels_run for make_plan / ring_slots: whether the step ring's Triton kernels run on `device` and pass their
    bit-for-bit check there (asked only where the plan needs to know)."""
    def run() -> bool:
        from routing_replay.capture import ring_kernels
        return ring_kernels.available(device) and ring_kernels.check(device)
    return run


def layer_placement(local_ids: list, all_stage_ids: list | None) -> tuple[tuple, tuple | None]:
    """(every stage's MoE layer ids, sorted; this stage's [lo, hi) of them or None) from this stage's ids and, with
    pipeline parallelism, each stage's list (None: one stage)."""
    if all_stage_ids is None:
        return tuple(local_ids), None
    global_ids = sorted(i for part in all_stage_ids for i in part)
    lo = global_ids.index(local_ids[0])
    return tuple(global_ids), (lo, lo + len(local_ids))


def make_plan(settings: Settings, *, kind: str, device_type: str, enforce_eager: bool, layer_ids: list, top_k: int,
              max_num_batched_tokens: int, max_cudagraph_capture_size: int | None = None,
              cudagraph_capture_sizes: list | None = None, all_stage_layer_ids: list | None = None,
              dp_rank: int = 0, dp_size: int = 1, stamp_supported: bool = True,
              kernels_run: Callable[[], bool] | None = None) -> CapturePlan:
    """The plan for a worker whose runner is `kind` on a `device_type` device, from plain values read off vLLM's
    config (worker.build does that). `stamp_supported`: the cache can stamp rows of this top_k (an even top_k:
    capture.cache.stamp_dtype); `kernels_run()`: the step ring's Triton kernels run on the device."""
    if not layer_ids:
        raise ValueError("routing-replay: the model has no MoE layers (no MoERunner modules)")
    max_tokens = max(int(max_num_batched_tokens), int(max_cudagraph_capture_size or 0))
    eager = device_type == "cpu" or bool(enforce_eager)
    # hooks replayed from CUDA graphs: each step's rows carry the step stamp its flush wrote (no -1 fill launched
    # before every step); hooks run in Python every step: the hook counter does that job. Stamps need an even
    # top_k (a 32/64-bit counter per row); odd top_k keeps the fill.
    stamp = not eager and settings.step_stamp
    if stamp and not stamp_supported:
        log.info("routing-replay: step stamps need an even top_k (top_k=%d): the -1 fill before each step "
                 "checks the rows instead", top_k)
        stamp = False
    # the step ring: graph-sized steps need no launch on the engine thread. It predicts a step's slot from the
    # engine's own forward count, so forwards the engine does not launch (data-parallel dummy batches) must not
    # happen.
    slots, ring_rows = 0, 0
    if stamp and settings.step_ring:
        largest = max_cudagraph_capture_size or max(cudagraph_capture_sizes or [LARGEST_GRAPH_DEFAULT])
        ring_rows = min(int(largest), max_tokens)
        slots = ring_slots(settings, device_type, int(dp_size), kernels_run)
        if not slots:
            ring_rows = 0
    fill = settings.prefix_rows == "fill"
    # the routers' top-k tensors are host memory on CPU: with enforce_eager a captured step's go to the producer's
    # thread as they are (HostRows). Not under torch.compile (it may trace the hooks).
    if device_type == "cpu" and enforce_eager:
        handover = HANDOVER_HOST
    elif slots and kind == "v1":
        handover = HANDOVER_RING
    else:
        handover = HANDOVER_GENERAL
    global_ids, layer_range = layer_placement(list(layer_ids), all_stage_layer_ids)
    return CapturePlan(kind=kind, device_type=device_type, layer_ids=tuple(layer_ids), global_layer_ids=global_ids,
                       layer_range=layer_range, top_k=int(top_k), max_tokens=max_tokens, eager=eager,
                       c_hooks=bool(enforce_eager), stamp=stamp, ring_slots=slots, ring_rows=ring_rows,
                       handover=handover, fill=fill,
                       # fill mode: prefix rows share the host ring with computed rows (a GRPO group's shared
                       # prompt arrives n times in one step), so it gets room for more steps in flight
                       copier_slots=4 if fill else 2, max_batch_steps=MAX_BATCH_STEPS,
                       # leaves the copier's ring room for the next steps
                       max_batch_rows=max(1, max_tokens // 2), dp_rank=int(dp_rank), dp_size=int(dp_size),
                       single_publisher=int(dp_size) == 1 and all_stage_layer_ids is None)
