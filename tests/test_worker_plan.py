"""engines/vllm_plugin/plan.py: the capture plan a worker decides once, from plain values (no vLLM, no device)."""

import dataclasses

import pytest

from routing_replay.engines.vllm_plugin.plan import (HANDOVER_GENERAL, HANDOVER_HOST, HANDOVER_RING, STEP_RING_SLOTS,
                                                     CapturePlan, layer_placement, make_plan, ring_slots)
from routing_replay.engines.vllm_plugin.settings import Settings


def _settings(**kw) -> Settings:
    return Settings(broker="ipc://unused", **kw)


def _plan(settings=None, **kw) -> CapturePlan:
    args = dict(kind="v1", device_type="cuda", enforce_eager=False, layer_ids=[1, 3, 5], top_k=8,
                max_num_batched_tokens=8192, max_cudagraph_capture_size=512, kernels_run=lambda: True)
    args.update(kw)
    return make_plan(settings or _settings(), **args)


def test_a_graph_engine_with_the_ring_kernels_gets_stamps_and_the_step_ring():
    p = _plan()
    assert dataclasses.astuple(p) == dataclasses.astuple(CapturePlan(
        kind="v1", device_type="cuda", layer_ids=(1, 3, 5), global_layer_ids=(1, 3, 5), layer_range=None, top_k=8,
        max_tokens=8192, eager=False, c_hooks=False, stamp=True, ring_slots=STEP_RING_SLOTS, ring_rows=512,
        handover=HANDOVER_RING, fill=False, copier_slots=2, max_batch_steps=16, max_batch_rows=4096, dp_rank=0,
        dp_size=1, single_publisher=True))
    assert p.num_layers == 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.stamp = False


def test_the_ring_needs_its_kernels_under_auto_one_dp_rank_and_model_runner_v1_for_its_handover():
    no_kernels = _plan(kernels_run=lambda: False)
    assert (no_kernels.stamp, no_kernels.ring_slots, no_kernels.ring_rows, no_kernels.handover) == \
        (True, 0, 0, HANDOVER_GENERAL)
    forced = _plan(_settings(ring_needs_kernels=False), kernels_run=lambda: False)     # STEP_STAMP=ring
    assert (forced.ring_slots, forced.handover) == (STEP_RING_SLOTS, HANDOVER_RING)
    dp = _plan(dp_rank=1, dp_size=2)
    assert (dp.ring_slots, dp.handover, dp.dp_rank, dp.single_publisher) == (0, HANDOVER_GENERAL, 1, False)
    v2 = _plan(kind="v2")           # V2: its ring rows go through the general path (a batch built per step)
    assert (v2.ring_slots, v2.handover) == (STEP_RING_SLOTS, HANDOVER_GENERAL)
    stamps_only = _plan(_settings(step_ring=False))
    assert (stamps_only.stamp, stamps_only.ring_slots, stamps_only.handover) == (True, 0, HANDOVER_GENERAL)
    off = _plan(_settings(step_stamp=False))
    assert (off.stamp, off.ring_slots, off.handover) == (False, 0, HANDOVER_GENERAL)


def test_an_odd_top_k_falls_back_to_the_fill_and_ring_rows_never_exceed_the_cache():
    odd = _plan(top_k=3, stamp_supported=False)
    assert (odd.stamp, odd.ring_slots, odd.handover) == (False, 0, HANDOVER_GENERAL)
    small = _plan(max_num_batched_tokens=256, max_cudagraph_capture_size=None, cudagraph_capture_sizes=[1, 2, 128])
    assert (small.max_tokens, small.ring_rows, small.max_batch_rows) == (256, 128, 128)
    default = _plan(max_num_batched_tokens=2048, max_cudagraph_capture_size=None)     # vLLM's default: 512
    assert (default.max_tokens, default.ring_rows) == (2048, 512)
    big_graph = _plan(max_num_batched_tokens=256, max_cudagraph_capture_size=1024)    # the cache holds a graph
    assert (big_graph.max_tokens, big_graph.ring_rows, big_graph.max_batch_rows) == (1024, 1024, 512)


def test_eager_engines_count_hooks_and_cpu_enforce_eager_hands_the_routers_tensors_over():
    cpu = _plan(device_type="cpu", enforce_eager=True)
    assert (cpu.eager, cpu.c_hooks, cpu.stamp, cpu.ring_slots, cpu.handover) == (True, True, False, 0, HANDOVER_HOST)
    compiled = _plan(device_type="cpu", enforce_eager=False)       # CPU under torch.compile: Python hooks, copied
    assert (compiled.eager, compiled.c_hooks, compiled.handover) == (True, False, HANDOVER_GENERAL)
    gpu_eager = _plan(enforce_eager=True)
    assert (gpu_eager.eager, gpu_eager.c_hooks, gpu_eager.stamp, gpu_eager.handover) == \
        (True, True, False, HANDOVER_GENERAL)


def test_fill_mode_gets_a_larger_host_ring():
    fill = _plan(_settings(prefix_rows="fill"))
    assert (fill.fill, fill.copier_slots) == (True, 4)
    assert (_plan().fill, _plan().copier_slots) == (False, 2)


def test_pipeline_stages_place_their_layers_among_all_stages():
    assert layer_placement([1, 3], None) == ((1, 3), None)
    assert layer_placement([5, 7], [[1, 3], [5, 7], [9]]) == ((1, 3, 5, 7, 9), (2, 4))
    p = _plan(layer_ids=[5, 7], all_stage_layer_ids=[[5, 7], [1, 3]])
    assert (p.layer_ids, p.global_layer_ids, p.layer_range, p.single_publisher) == ((5, 7), (1, 3, 5, 7), (2, 4),
                                                                                    False)


def test_a_model_without_moe_layers_is_refused():
    with pytest.raises(ValueError, match=r"the model has no MoE layers"):
        _plan(layer_ids=[])


def test_ring_slots_asks_for_the_kernels_only_under_auto():
    asked = []

    def run():
        asked.append(1)
        return False
    assert ring_slots(_settings(step_ring=False), "cuda", 1, run) == 0 and asked == []
    assert ring_slots(_settings(), "cuda", 2, run) == 0 and asked == []            # dp > 1: no ring, not asked
    assert ring_slots(_settings(ring_needs_kernels=False), "cuda", 1, run) == STEP_RING_SLOTS and asked == []
    assert ring_slots(_settings(), "cuda", 1, run) == 0 and asked == [1]
    assert ring_slots(_settings(), "cuda", 1, None) == 0
