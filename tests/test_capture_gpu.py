"""GPU tests of capture/: CUDA graph capture and replay with changing batch sizes, no host sync in the step,
the pinned ring under a slow consumer, and the HF adapter on CUDA. Skipped without CUDA."""

from __future__ import annotations

import importlib.util
import queue
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from routing_replay.capture import AsyncCopier, PrefixStore, RoutingCache

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

L, E, K, H = 6, 64, 8, 256
SIZES = (1, 7, 64, 200)          # captured batch sizes (a step of n tokens replays the smallest size >= n)


class ToyRouters:
    """L router layers (GEMM, softmax, top-k) feeding a RoutingCache; the routers' own top-k ids are also
    copied to `ref`, a plain int64 side output that does not go through the cache."""

    def __init__(self, cache: RoutingCache, max_tokens: int, seed: int = 0):
        g = torch.Generator(device="cuda").manual_seed(seed)
        self.w = [torch.randn(H, E, device="cuda", generator=g) for _ in range(L)]
        self.p = [torch.randn(E, H, device="cuda", generator=g) * 0.05 for _ in range(L)]
        self.cache = cache
        self.ref = torch.zeros(L, max_tokens, K, dtype=torch.int64, device="cuda")
        self.skip = None                # a layer whose hook is lost (never records)

    def step(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        for layer in range(L):
            logits = x @ self.w[layer]
            vals, ids = torch.topk(torch.softmax(logits, dim=-1), K, dim=-1)
            if layer != self.skip:
                self.cache.record(layer, ids)
            self.ref[layer, :n].copy_(ids)
            x = x + torch.tanh(logits @ self.p[layer]) * vals[:, :1]
        return x


def _capture(routers: ToyRouters, max_tokens: int):
    """One CUDA graph per size in SIZES, sharing one static input buffer."""
    x_static = torch.zeros(max_tokens, H, device="cuda")
    graphs = {}
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for n in SIZES:                     # warm-up outside capture (cuBLAS handles, workspaces)
            routers.step(x_static[:n])
    torch.cuda.current_stream().wait_stream(s)
    pool = torch.cuda.graph_pool_handle()
    for n in sorted(SIZES, reverse=True):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool):
            routers.step(x_static[:n])
        graphs[n] = g
    return x_static, graphs


def _segments(rng: np.random.Generator, n: int) -> list:
    """Requests of random lengths tiling [0, n), some left out (no routing wanted), in shuffled order."""
    cuts = np.sort(rng.choice(np.arange(1, n), size=min(n - 1, rng.integers(0, 6)), replace=False)) if n > 1 else []
    bounds = [0, *cuts.tolist(), n] if n > 1 else [0, 1]
    segs = [(a, b - a) for a, b in zip(bounds[:-1], bounds[1:])]
    keep = [s for s in segs if rng.random() < 0.8]
    rng.shuffle(keep)
    return keep


@pytest.mark.parametrize("fused", [True, False])
def test_graph_replay_rows_match_router_topk_across_batch_sizes(fused):
    max_tokens = max(SIZES)
    cache = RoutingCache(max_tokens, L, K, device="cuda", fused=fused)
    copier = AsyncCopier(cache, num_slots=3)            # 3 steps in flight while the consumer lags by 2
    routers = ToyRouters(cache, max_tokens)
    x_static, graphs = _capture(routers, max_tokens)
    rng = np.random.default_rng(1)
    gen = torch.Generator(device="cuda").manual_seed(2)
    in_flight: list = []
    checked = 0
    for step in range(80):
        n = int(rng.integers(1, max_tokens + 1))
        size = min(s for s in SIZES if s >= n)
        x_static[:size].normal_(generator=gen)
        segs = _segments(rng, n)
        torch.cuda.set_sync_debug_mode("error")
        try:
            graphs[size].replay()
            pending = copier.submit(segs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        ref = routers.ref.transpose(0, 1).cpu().numpy()          # (max_tokens, L, K), this step's router output
        want = np.concatenate([ref[a:a + c] for a, c in segs]).astype(np.int16) if segs else None
        if pending is None:
            assert not segs or sum(c for _, c in segs) == 0
            continue
        assert not pending.dropped
        in_flight.append((pending, want))
        while len(in_flight) > 2:                  # consume with a lag: rows stay valid while later steps run
            p, w = in_flight.pop(0)
            assert np.array_equal(p.result(), w)
            p.release()
            checked += 1
    for p, w in in_flight:
        assert np.array_equal(p.result(), w)
        p.release()
        checked += 1
    assert checked == copier.stats.submitted_steps and copier.stats.dropped_steps == 0 and checked > 50
    assert copier.in_flight_rows == 0


@pytest.mark.parametrize("fused,skip", [(True, None), (False, None), (True, 2)])
def test_prefix_store_write_is_replayed_from_graphs_at_each_steps_slots(fused, skip):
    """The store attached before capture: each replay writes the step's rows at the slots the persistent slot
    buffer holds for that step (padding -1 -> the spare row), with no host work and no sync; after 60 steps of
    random slots (overwrites included) every slot holds the rows of the last step that wrote it, exactly.
    skip: a layer's hook was lost when the graphs were captured: every replay writes -1 at its slots."""
    max_tokens, num_slots = max(SIZES), 1024
    cache = RoutingCache(max_tokens, L, K, device="cuda", fused=fused)
    store = PrefixStore(num_slots, L, K, device="cuda")
    slot_buf = torch.full((max_tokens,), -1, dtype=torch.int64, device="cuda")   # vLLM's persistent slot_mapping
    cache.attach_store(store, slot_buf)
    routers = ToyRouters(cache, max_tokens)
    routers.skip = skip
    x_static, graphs = _capture(routers, max_tokens)
    writes_at_capture = cache.store_writes
    assert cache.incomplete_flushes == (0 if skip is None else 2 * len(SIZES))    # warm-up + capture
    store.invalidate()                                  # capture wrote rows at slot -1 / garbage: start clean
    store.table[:num_slots] = 5                         # not -1: a replay that forgets must overwrite it
    rng = np.random.default_rng(7)
    gen = torch.Generator(device="cuda").manual_seed(8)
    want = np.full((num_slots + 1, L, K), 5, dtype=np.int16)
    for step in range(60):
        n = int(rng.integers(1, max_tokens + 1))
        size = min(s for s in SIZES if s >= n)
        slots = rng.choice(num_slots, size=n, replace=False)          # a step never writes one slot twice
        host = np.full(max_tokens, -1, dtype=np.int64)
        host[:n] = slots
        slot_buf.copy_(torch.from_numpy(host))                        # what vLLM's slot-mapping kernel does
        x_static[:size].normal_(generator=gen)
        torch.cuda.set_sync_debug_mode("error")
        try:
            graphs[size].replay()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        ref = routers.ref.transpose(0, 1).cpu().numpy().astype(np.int16)   # (max_tokens, L, K)
        want[slots] = ref[:n] if skip is None else -1
    assert cache.store_writes == writes_at_capture                   # replays ran no Python
    got = store.table.cpu().numpy()
    np.testing.assert_array_equal(got[:num_slots], want[:num_slots])
    assert int((got[:num_slots] == -1).all(axis=(1, 2)).sum()) == int((want[:num_slots] == -1).all(axis=(1, 2)).sum())


def test_eager_record_and_submit_do_not_sync_the_host():
    cache = RoutingCache(256, L, K, device="cuda", fused=True)
    copier = AsyncCopier(cache, num_slots=2)
    routers = ToyRouters(cache, 256)
    x = torch.randn(100, H, device="cuda")
    routers.step(x)                               # warm-up (cuBLAS init may sync)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        routers.step(x)
        p1 = copier.submit([(0, 100)])
        p2 = copier.submit([(50, 10), (0, 20), (90, 10)])            # gather path: index upload from pinned
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ref = routers.ref.transpose(0, 1).cpu().numpy().astype(np.int16)
    assert np.array_equal(p1.result(), ref[:100])
    assert np.array_equal(p2.result(), np.concatenate([ref[50:60], ref[0:20], ref[90:100]]))
    p1.release()
    p2.release()


def test_direct_topk_into_int64_cache_view_under_graph():
    """The router writes its top-k straight into the cache view (no copy in the step at all)."""
    n = 64
    cache = RoutingCache(n, 2, K, device="cuda", dtype=torch.int64)
    copier = AsyncCopier(cache)
    x = torch.zeros(n, H, device="cuda")
    w = torch.randn(H, E, device="cuda")
    vals = torch.empty(n, K, device="cuda")

    def step():
        for layer in range(2):
            torch.topk(torch.softmax(x @ w * (layer + 1), -1), K, -1, out=(vals, cache.layer_view(layer)[:n]))

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    for seed in range(5):
        x.copy_(torch.randn(n, H, generator=torch.Generator().manual_seed(seed)))
        g.replay()
        p = copier.submit([(0, n)])
        want = np.stack([torch.topk(torch.softmax(x @ w * (layer + 1), -1), K, -1).indices.cpu().numpy()
                         for layer in range(2)], axis=1).astype(np.int16)
        assert np.array_equal(p.result(), want)
        p.release()


def test_ring_under_a_slow_consumer_drops_counted_and_keeps_held_rows_exact():
    """The consumer thread is held back: the engine thread never waits, the ring fills, later steps are
    dropped and counted; once the consumer runs, every delivered step is exact, and the ring is reusable."""
    n, max_tokens = 48, 64
    cache = RoutingCache(max_tokens, L, K, device="cuda")
    copier = AsyncCopier(cache, num_slots=2, max_rows=max_tokens)      # 192 rows: 4 steps of 48
    routers = ToyRouters(cache, max_tokens)
    gate = threading.Event()
    work: queue.Queue = queue.Queue()
    results: list = []

    def consumer():
        gate.wait(30)
        while True:
            item = work.get(timeout=30)
            if item is None:
                return
            p, want = item
            results.append(np.array_equal(p.result(), want))
            p.release()

    t = threading.Thread(target=consumer)
    t.start()
    x = torch.randn(n, H, device="cuda")
    outcomes = []
    for step in range(10):
        x = x.roll(1, 0)
        routers.step(x)
        p = copier.submit([(0, n)])
        outcomes.append(p.dropped)
        if not p.dropped:
            want = routers.ref[:, :n].transpose(0, 1).cpu().numpy().astype(np.int16)
            work.put((p, want))
    assert outcomes == [False] * 4 + [True] * 6
    assert (copier.stats.submitted_steps, copier.stats.dropped_steps, copier.stats.dropped_rows) == (4, 6, 6 * n)
    gate.set()
    work.put(None)
    t.join(30)
    assert not t.is_alive() and results == [True] * 4
    assert copier.in_flight_rows == 0
    routers.step(x)
    p = copier.submit([(0, n)])
    assert not p.dropped
    p.release()                         # released before anyone waited: the range is fenced by its event
    assert copier.in_flight_rows in (0, n)
    torch.cuda.synchronize()
    assert not copier.submit([(0, 1)]).dropped and copier._ring.live_ranges == 1


def test_hf_adapter_on_cuda_matches_router_topk(tmp_path):
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    from routing_replay.engines.hf_adapter import HFRoutingAdapter
    from routing_replay.apps.models import make_tiny_model
    spec = importlib.util.spec_from_file_location("_hf_helpers", Path(__file__).with_name("test_hf_adapter.py"))
    helpers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(helpers)
    PROMPTS, CollectSink, _check_rows, reference = (helpers.PROMPTS, helpers.CollectSink, helpers._check_rows,
                                                    helpers.reference)

    for arch in ("qwen3_moe_mixed", "mixtral"):
        model = AutoModelForCausalLM.from_pretrained(make_tiny_model(tmp_path / arch, arch)).cuda().eval()
        sink = CollectSink()
        rids = ["a", "b", "c"]
        with HFRoutingAdapter(model, sink, max_tokens=64) as ad:
            outputs = ad.generate(PROMPTS, request_ids=rids, max_new_tokens=6)
        ref_out, ref_rows = reference(model, PROMPTS, 6)
        assert outputs == ref_out
        _check_rows(sink.rows_by_request(), rids, ref_rows, len(PROMPTS[0]), outputs)


def test_batched_launch_on_the_consumer_thread_is_exact_and_one_copy_per_run():
    """The engine thread only snapshots and records an event (no host sync); a consumer thread launches the host
    copies of 4 consecutive steps at once (launch_rows): one copy for the adjacent ones, every row exact, even
    while the engine keeps replaying steps that overwrite the cache."""
    from routing_replay.capture.copier import launch_rows

    max_tokens = max(SIZES)
    cache = RoutingCache(max_tokens, L, K, device="cuda")
    copier = AsyncCopier(cache, num_slots=8)
    routers = ToyRouters(cache, max_tokens)
    x_static, graphs = _capture(routers, max_tokens)
    rng = np.random.default_rng(3)
    gen = torch.Generator(device="cuda").manual_seed(4)
    work: queue.Queue = queue.Queue()
    results: list = []

    def consumer():
        while True:
            batch = work.get(timeout=60)
            if batch is None:
                return
            launch_rows([p for p, _ in batch])
            results.append((len({id(p._event) for p, _ in batch}),
                            all(np.array_equal(p.result(), w) for p, w in batch)))
            for p, _ in batch:
                p.release()

    t = threading.Thread(target=consumer)
    t.start()
    batch: list = []
    try:
        for step in range(64):
            n = int(rng.integers(1, max_tokens + 1))
            size = min(s for s in SIZES if s >= n)
            x_static[:size].normal_(generator=gen)
            torch.cuda.set_sync_debug_mode("error")
            try:
                graphs[size].replay()
                p = copier.submit([(0, n)])
            finally:
                torch.cuda.set_sync_debug_mode("default")
            want = routers.ref[:, :n].transpose(0, 1).cpu().numpy().astype(np.int16)
            assert not p.dropped and p._event is None          # nothing launched on the engine thread
            batch.append((p, want))
            if len(batch) == 4:
                work.put(batch)
                batch = []
                while copier.free_rows < 4 * max_tokens and t.is_alive():
                    time.sleep(0.001)
    finally:
        work.put(None)
        t.join(60)
    assert len(results) == 16 and all(ok for _, ok in results), results
    assert sum(copies for copies, _ in results) < 16 * 4 / 2, results      # adjacent steps share one copy
    assert copier.in_flight_rows == 0 and copier.stats.dropped_steps == 0


def test_steps_submitted_unmarked_share_one_event_per_batch_and_stay_exact():
    """submit(mark=False) records no event (one torch call less per step on the engine thread); mark_batch()
    records one for the whole batch after its last snapshot. The consumer thread's host copies wait on it: every
    row of 8 batches x 16 steps is exact while the engine goes on replaying, never waiting for the host; handing
    over an unmarked step is refused with a clear error instead of copying rows whose snapshot may not have run;
    submit(mark=False) and mark_batch() never sync the host."""
    from routing_replay.capture.copier import _UNMARKED, launch_rows

    max_tokens = max(SIZES)
    cache = RoutingCache(max_tokens, L, K, device="cuda")
    copier = AsyncCopier(cache, num_slots=64)      # 16 steps of up to max_tokens rows each, twice, and wrap-around
    routers = ToyRouters(cache, max_tokens, seed=5)
    x_static, graphs = _capture(routers, max_tokens)
    rng = np.random.default_rng(6)
    gen = torch.Generator(device="cuda").manual_seed(7)
    work: queue.Queue = queue.Queue()
    results: list = []
    errors: list = []

    def consumer():
        while True:
            batch = work.get(timeout=120)
            if batch is None:
                return
            try:
                launch_rows([p for p, _ in batch])
                results.append(all(np.array_equal(p.result(), w.cpu().numpy()) for p, w in batch))
                for p, _ in batch:
                    p.release()
            except Exception as e:      # noqa: BLE001 -- reported by the test thread
                errors.append(repr(e))
                return

    def step(batch):
        n = int(rng.integers(1, max_tokens + 1))
        size = min(s for s in SIZES if s >= n)
        x_static[:size].normal_(generator=gen)
        graphs[size].replay()
        p = copier.submit([(0, n)], mark=False)
        want = routers.ref[:, :n].transpose(0, 1).to(torch.int16)     # a device copy: no host sync
        assert not p.dropped and p._staged is _UNMARKED and p._event is None
        batch.append((p, want))

    t = threading.Thread(target=consumer)
    t.start()
    refused = None
    try:
        for b in range(8):
            batch: list = []
            for _ in range(16):
                step(batch)
            if b == 0:
                try:
                    copier.launch([batch[0][0]])
                except RuntimeError as e:
                    refused = str(e)
            copier.mark_batch([p for p, _ in batch])
            assert len({id(p._staged) for p, _ in batch}) == 1 and batch[0][0]._staged is not _UNMARKED
            work.put(batch)                 # the next batch's replays queue up while these copies run
            while copier.free_rows < 32 * max_tokens and t.is_alive():
                time.sleep(0.001)
        while len(results) < 8 and t.is_alive():
            time.sleep(0.01)
        last: list = []                     # the consumer is idle now: the sync check cannot catch its syncs
        torch.cuda.set_sync_debug_mode("error")
        try:
            step(last)
            copier.mark_batch([p for p, _ in last])
        finally:
            torch.cuda.set_sync_debug_mode("default")
        work.put(last)
    finally:
        work.put(None)
        t.join(120)
    assert not errors, errors
    assert refused is not None and "mark_batch" in refused
    assert len(results) == 9 and all(results), results
    assert copier.in_flight_rows == 0 and copier.stats.dropped_steps == 0
    # the snapshots were driver copies and the batch events went back to their pool and were recorded again:
    # fewer events than the 9 batches (how many were in flight at once depends on the consumer thread's pace)
    assert copier._drv is not None and 1 <= len(copier._batch_pool) < 9


def test_driver_fill_and_layer_major_snapshot_equal_torch_and_fall_back_when_refused():
    """The engine thread's per-step launches made as CUDA driver calls with the GIL held (capture/cudriver.py):
    fill_step sets exactly rows [0, n) of every layer to -1; a one-run snapshot lands layer-major and reads back
    as the step's (n, L, K) rows; both equal what the torch calls give (the fallback, forced on a second cache),
    for several sizes and offsets; a call the driver refuses falls back to torch. (What the held GIL saves is measured by bench/engine_thread_probe.py, not here.)"""
    from routing_replay.capture import cudriver

    T = 512
    cache = RoutingCache(T, L, K, device="cuda")
    ref_cache = RoutingCache(T, L, K, device="cuda")
    ref_cache._driver = None                       # the torch path
    cp, ref_cp = AsyncCopier(cache, num_slots=4, max_rows=T), AsyncCopier(ref_cache, num_slots=4, max_rows=T)
    ref_cp._drv = None
    assert cache._driver is not None and cp._drv is not None and cudriver.check(cache.device) is cache._driver
    gen = torch.Generator(device="cuda").manual_seed(11)
    for n, a in ((1, 0), (7, 3), (200, 0), (300, 212), (512, 0)):
        ids = [torch.randint(0, E, (T, K), device="cuda", generator=gen) for _ in range(L)]
        for c in (cache, ref_cache):
            for layer in range(L):
                c.record(layer, ids[layer])
        assert torch.equal(cache.buffer, ref_cache.buffer)
        want = cache.buffer[:, a:a + n].transpose(0, 1).cpu().numpy()
        p, q = cp.submit([(a, n)]), ref_cp.submit([(a, n)])
        assert p._lm and q._lm
        got, ref = p.result(), q.result()
        assert got.shape == (n, L, K) and np.array_equal(got, want) and np.array_equal(ref, want)
        p.release(), q.release()
        before = cache.buffer.clone()
        cache.fill_step(n)
        ref_cache.fill_step(n)
        torch.cuda.synchronize()
        before[:, :n] = -1
        assert torch.equal(cache.buffer, before) and torch.equal(ref_cache.buffer, before)
    # a driver call the driver refuses at launch (here a 2-D copy whose source pitch is below its width: a real
    # CUDA_ERROR_INVALID_VALUE) launches nothing: the copier logs it, uses torch calls from then on, rows exact
    cp._m.srcPitch = 2
    ids = [torch.randint(0, E, (T, K), device="cuda", generator=gen) for _ in range(L)]
    for layer in range(L):
        cache.record(layer, ids[layer])
    p = cp.submit([(5, 40)])
    assert cp._drv is None and np.array_equal(p.result(), cache.buffer[:, 5:45].transpose(0, 1).cpu().numpy())
    p.release()


def test_step_stamps_under_graph_replay_prove_each_step_and_catch_a_graph_without_hooks():
    """A stamped cache under CUDA graphs: the graphs' flush counts each replay on the device (one in-place add over
    the stamp layer), the one-launch snapshot carries the count with the rows, and the producer-side check of the
    count against the forwards launched passes every step of 6 batches x 16 (rows exact, no -1 fill launched, no
    host sync). Then a "forward" with no replay at all, and a graph captured while one layer's hook was lost (its
    flush adds nothing), each after an unchecked replay that did stamp: both refused as stale."""
    from routing_replay.engines.vllm_plugin.stamps import LostHookError
    from routing_replay.engines.vllm_plugin.step_batch import StepBatch

    max_tokens = max(SIZES)
    cache = RoutingCache(max_tokens, L, K, device="cuda", stamp=True)
    copier = AsyncCopier(cache, num_slots=64)
    routers = ToyRouters(cache, max_tokens, seed=11)
    x_static, graphs = _capture(routers, max_tokens)
    # warm-up ran len(SIZES) eager steps (-1 -> 3); capturing the graphs ran nothing
    assert cache.stamp_value() == len(SIZES) - 1
    rng = np.random.default_rng(12)
    gen = torch.Generator(device="cuda").manual_seed(13)
    batch = StepBatch(K, stamped=True)
    batch.stamps.baseline(cache.stamp_value(), 0)        # as the worker does after vLLM's warm-up
    forwards = 0

    def step(graph, n, checked=True):
        nonlocal forwards
        forwards += 1
        x_static[:n].normal_(generator=gen)
        torch.cuda.set_sync_debug_mode("error")
        try:
            if graph is not None:
                graph.replay()
            p = copier.submit([(0, n)], mark=False) if checked else None
        finally:
            torch.cuda.set_sync_debug_mode("default")
        if checked:
            batch.add(p, ["x"], [0], [n], forward=forwards)
        return routers.ref[:, :n].transpose(0, 1).to(torch.int16)

    def hand_over():
        copier.mark_batch(batch.parts)
        _, _, _, rows = batch.take_parts()
        try:
            return rows.result().copy()
        finally:
            rows.release()

    def graph_for(n):
        return graphs[min(s for s in SIZES if s >= n)]

    for _ in range(6):
        wants = []
        for i in range(16):
            n = int(rng.integers(1, max_tokens + 1))
            wants.append(step(graph_for(n), n))
            if i % 5 == 0:                               # forwards no captured request ran in: not checked
                step(graph_for(3), 3, checked=False)
        assert np.array_equal(hand_over(), torch.cat(wants).cpu().numpy())
    assert batch.stamps.steps == 96 and forwards == 96 + 6 * 4
    assert cache.stamp_value() == len(SIZES) - 1 + forwards
    assert copier._drv is not None and copier._m.Height == L + 1       # the stamp layer rides the one 2-D copy
    # a forward with no replay, after one that stamped and was not checked: the stamp moved, but one flush short
    step(graph_for(64), 64, checked=False)
    step(None, 64)
    with pytest.raises(LostHookError, match="1 complete flush"):
        hand_over()
    routers.skip = 2                                # a hook lost before (re)capture: that graph never stamps
    lost = torch.cuda.CUDAGraph()
    with torch.cuda.graph(lost, pool=torch.cuda.graph_pool_handle()):
        routers.step(x_static[:64])
    assert cache.incomplete_flushes >= 1
    # the refusal took the device's count: no baseline needed for the next check
    assert batch.stamps.resyncs == 1
    assert batch.stamps.offset == (cache.stamp_value() - forwards) & batch.stamps.mask
    step(graph_for(64), 64, checked=False)
    step(lost, 64)
    with pytest.raises(LostHookError, match="1 complete flush"):
        hand_over()
    # the graphs with every hook again: checked against the device's count, rows exact
    wants = [step(graph_for(n), n) for n in (5, 64, 17)]
    assert np.array_equal(hand_over(), torch.cat(wants).cpu().numpy())
    assert batch.stamps.resyncs == 2
    assert copier.in_flight_rows == 0


@pytest.mark.parametrize("kernels", [True, False], ids=["triton", "torch"])
@pytest.mark.parametrize("by_ref", [False, True])
def test_step_ring_under_graph_replay_reads_every_step_without_a_launch_on_the_engine_thread(by_ref, kernels,
                                                                                           monkeypatch):
    """ROUTING_REPLAY_STEP_STAMP=ring under CUDA graphs: each replay's flush copies its rows into its slot of the
    step ring inside the graph; the "engine thread" replays and hands over only (no snapshot launch: the copier
    launches nothing per step, one checkpoint copy and one event per batch), and another thread reads every step
    out of its slot, later, with the stamps and checkpoint checked: rows exact over 8 batches x 16 steps of random
    sizes with unchecked replays between. Steps larger than a slot go through submit() as before, in the same
    batches. Reads that fall behind by the ring's size lose their batch, never hand out wrong rows. A graph captured
    while a hook was lost (its replay flushes nothing): the batch that holds it is refused and the check takes the
    device's count, so later batches are exact again (one handed over before the refusal was read too, by
    reference; added with its slot fixed on the engine thread, it is lost, never wrong). by_ref: ring steps go by
    reference, as the worker adds them (host-ring rows taken on the reading thread: take_slot). kernels: the
    flush's slot write as the two Triton kernels (capture/ring_kernels.py) or the torch ones."""
    import threading
    from routing_replay.engines.vllm_plugin.stamps import LostHookError, RingReadLost
    from routing_replay.engines.vllm_plugin.step_batch import StepBatch

    max_tokens = max(SIZES)
    S = 32                          # more slots than a batch's forwards (16 checked + 4 unchecked) before its read
    if kernels:
        pytest.importorskip("triton")
    monkeypatch.setenv("ROUTING_REPLAY_RING_KERNELS", "1" if kernels else "0")
    cache = RoutingCache(max_tokens, L, K, device="cuda", stamp=True, slots=S, slot_rows=64)
    assert (cache._kernels is not None) == kernels
    copier = AsyncCopier(cache, num_slots=64)
    routers = ToyRouters(cache, max_tokens, seed=21)
    x_static, graphs = _capture(routers, max_tokens)
    batch = StepBatch(K, stamped=True)
    batch.stamps.baseline(cache.stamp_value(), 0)
    rng = np.random.default_rng(22)
    gen = torch.Generator(device="cuda").manual_seed(23)
    forwards = 0
    launched = {"submit": 0}
    real_submit = copier.submit

    def counted_submit(*a, **k):
        launched["submit"] += 1
        return real_submit(*a, **k)
    copier.submit = counted_submit

    def slot_of(f):
        return ((f + batch.stamps.offset) & batch.stamps.mask) % S

    big = [0]                                           # checked steps larger than a slot

    def step(n, checked=True, graph=None):
        nonlocal forwards
        forwards += 1
        big[0] += checked and n > cache.slot_rows
        x_static[:n].normal_(generator=gen)
        a = int(rng.integers(0, n))
        m = n - a
        torch.cuda.set_sync_debug_mode("error")
        try:
            (graph or graphs[min(s for s in SIZES if s >= n)]).replay()
            if checked and by_ref and n <= cache.slot_rows:
                batch.add_slot(a, m, slot_of(forwards), ["x"], [0], [m], forwards)
            elif checked:
                p = (copier.submit_slot(a, m, slot_of(forwards)) if n <= cache.slot_rows
                     else copier.submit([(a, m)], mark=False))
                batch.add(p, ["x"], [0], [m], forward=forwards)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        return routers.ref[:, a:n].transpose(0, 1).to(torch.int16).clone()

    def hand_over():
        if by_ref:
            return batch.hand_over(copier, forwards)[3]
        copier.mark_batch(batch.parts, checkpoint=batch.ringed)
        return batch.take_parts(forwards if batch.ringed else None)[3]

    out: dict = {}

    def read(rows, key):                     # the producer's thread
        try:
            out[key] = rows.result().copy()
        except Exception as e:  # noqa: BLE001
            out[key] = e
        finally:
            rows.release()

    for b in range(8):
        wants = []
        for i in range(16):
            wants.append(step(int(rng.integers(1, max_tokens + 1)) if i % 4 == 3 else int(rng.integers(1, 65))))
            if i % 5 == 0:
                step(3, checked=False)
        rows = hand_over()
        t = threading.Thread(target=read, args=(rows, b))
        t.start()
        t.join(30)
        assert np.array_equal(out[b], torch.cat(wants).cpu().numpy()), b
    assert launched["submit"] == big[0] > 0             # only the steps larger than a slot were snapshotted
    assert batch.stamps.steps == 8 * 16
    # the reader falls behind by the ring's size: the batch is lost, not wrong
    step(40)
    rows = hand_over()
    for _ in range(S):
        step(30, checked=False)
    torch.cuda.synchronize()
    read(rows, "late")
    assert isinstance(out["late"], RingReadLost)
    # a graph captured while layer 2's hook was lost: its replays flush nothing (no stamp, no slot write)
    routers.skip = 2
    lost = torch.cuda.CUDAGraph()
    with torch.cuda.graph(lost, pool=torch.cuda.graph_pool_handle()):
        routers.step(x_static[:64])
    routers.skip = None
    assert cache.incomplete_flushes >= 1 and batch.stamps.resyncs == 0
    step(20)
    step(64, graph=lost)
    step(10)
    held = hand_over()                                  # refused: its checkpoint is one flush short
    wants = [step(int(rng.integers(1, 65))) for _ in range(5)]
    early = hand_over()                                 # handed over before the refusal is read
    read(held, "lost")
    read(early, "early")
    assert isinstance(out["lost"], LostHookError) and batch.stamps.resyncs == 1
    if by_ref:          # its slots are taken by the device's count: exact
        assert np.array_equal(out["early"], torch.cat(wants).cpu().numpy())
    else:               # its slots were fixed by the engine's old count: lost, never wrong
        assert isinstance(out["early"], (LostHookError, RingReadLost))
    for b in range(2):  # later batches: exact
        wants = [step(int(rng.integers(1, 65))) for _ in range(6)]
        read(hand_over(), ("after", b))
        assert np.array_equal(out[("after", b)], torch.cat(wants).cpu().numpy()), b
    assert copier.in_flight_rows == 0
    assert len(copier._batch_pool) == 2     # each batch's one event came back once read: two in all (two were out)
