"""CPU tests of capture/: the row ring, the routing cache (fused and per-layer) and the asynchronous copier."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from routing_replay.capture import (AsyncCopier, HostRows, PrefixStore, RoutingCache, RowRing, hit_slots,
                                     hit_slots_many)
from routing_replay.capture.cache import read_stamp, stamp_bits


def _ids(n: int, K: int, E: int, seed: int, dtype=torch.int64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, E, (n, K), generator=g).to(dtype)


def _step(cache: RoutingCache, n: int, seed: int, dtype=torch.int64) -> np.ndarray:
    """Record one step of n tokens into every layer; return the expected (n, L, K) int16 rows."""
    per_layer = [_ids(n, cache.top_k, 128, seed * 1000 + layer, dtype) for layer in range(cache.num_layers)]
    for layer, ids in enumerate(per_layer):
        cache.record(layer, ids)
    return torch.stack(per_layer, dim=1).to(torch.int16).numpy()


class _Fence:
    def __init__(self):
        self.passed = False

    def query(self) -> bool:
        return self.passed


# ---- RowRing -------------------------------------------------------------------------------------------------


def test_ring_alloc_wrap_and_in_order_reclaim():
    r = RowRing(10)
    a = r.alloc(4)
    b = r.alloc(4)
    assert (a[0], b[0]) == (0, 4)
    assert r.alloc(3) is None                   # 2 rows left before the end, and rows 0..3 are taken
    r.free(a[1])
    c = r.alloc(3)                              # wraps: rows 8, 9 are wasted until c is reclaimed
    assert c[0] == 0 and r.used_rows == 4 + 2 + 3
    assert r.alloc(2) is None                   # only row 3 is free
    r.free(c[1])                                # freed out of order: stays taken behind b
    assert r.used_rows == 9 and r.live_ranges == 2
    r.free(b[1])
    assert r.used_rows == 0 and r.live_ranges == 0
    assert r.alloc(10)[0] == 0                  # empty ring starts over at row 0


def test_ring_fence_keeps_rows_until_it_passes():
    r = RowRing(8)
    a = r.alloc(8)
    fence = _Fence()
    r.free(a[1], fence=fence)
    assert r.alloc(1) is None
    fence.passed = True
    assert r.alloc(8)[0] == 0


def test_ring_free_is_idempotent_and_sizes_are_checked():
    r = RowRing(4)
    a = r.alloc(2)
    r.free(a[1])
    r.free(a[1])
    assert r.used_rows == 0
    with pytest.raises(ValueError):
        r.alloc(5)
    with pytest.raises(ValueError):
        r.alloc(0)


@settings(max_examples=300, deadline=None)
@given(S=st.integers(1, 4), M=st.integers(1, 9),
       ops=st.lists(st.tuples(st.booleans(), st.integers(1, 9), st.integers(0, 8)), max_size=60))
def test_ring_fits_num_slots_worst_case_steps(S, M, ops):
    """With capacity (S+1)*M, an allocation of <= M rows always succeeds while fewer than S ranges are
    unreclaimed (live, or freed but behind an older live one), and unreclaimed ranges never overlap."""
    r = RowRing((S + 1) * M)
    fifo: list = []                      # [lo, n, handle, freed] in allocation order, as the ring reclaims them
    for do_alloc, n, pick in ops:
        if do_alloc:
            n = min(n, M)
            got = r.alloc(n)
            if len(fifo) < S:
                assert got is not None, (S, M, [(x[0], x[1], x[3]) for x in fifo], n)
            if got is not None:
                lo = got[0]
                for other in fifo:
                    assert lo + n <= other[0] or other[0] + other[1] <= lo
                fifo.append([lo, n, got[1], False])
        else:
            live = [x for x in fifo if not x[3]]
            if live:
                victim = live[pick % len(live)]
                r.free(victim[2])
                victim[3] = True
                while fifo and fifo[0][3]:
                    fifo.pop(0)
        assert r.live_ranges == len(fifo)


# ---- RoutingCache --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("in_dtype", [torch.int64, torch.int32, torch.int16])
def test_cache_record_writes_each_layer(fused, in_dtype):
    cache = RoutingCache(16, 3, 4, fused=fused)
    want = _step(cache, 5, seed=1, dtype=in_dtype)
    assert cache.buffer.shape == (3, 16, 4) and cache.buffer.dtype == torch.int16
    for layer in range(3):
        assert np.array_equal(cache.layer_view(layer)[:5].numpy(), want[:, layer])
        assert (cache.layer_view(layer)[5:] == -1).all()
    assert cache.nbytes == 3 * 16 * 4 * 2


def test_fused_cache_writes_nothing_before_the_last_layer():
    cache = RoutingCache(8, 3, 2, fused=True)
    cache.record(0, _ids(4, 2, 8, 0))
    cache.record(1, _ids(4, 2, 8, 1))
    assert (cache.buffer == -1).all()
    cache.record(2, _ids(4, 2, 8, 2))
    assert np.array_equal(cache.layer_view(1)[:4].numpy(), _ids(4, 2, 8, 1).numpy())


def test_fused_cache_flush_handles_a_partial_step_and_strided_input():
    cache = RoutingCache(8, 3, 2, fused=True)
    strided = _ids(6, 4, 8, 5)[:, ::2]          # (6, 2), not contiguous: copied at once
    cache.record(1, strided)
    assert np.array_equal(cache.layer_view(1)[:6].numpy(), strided.numpy())
    cache.record(0, _ids(3, 2, 8, 6))
    cache.flush()                               # a pipeline stage without the last layer ends its step
    assert np.array_equal(cache.layer_view(0)[:3].numpy(), _ids(3, 2, 8, 6).numpy())
    cache.flush()                               # nothing held: no-op
    assert (cache.layer_view(2) == -1).all()


def test_fused_flush_one_copy_path_and_mixed_steps_write_the_same_rows():
    """The fused copy's paths: every layer held with the same rows and dtype (one copy into views cached per row
    count), then steps that mix dtypes, row counts, a strided layer and a layer recorded twice (per-dtype copies),
    then the uniform path again at a size seen before: every step's rows exact, nothing stale left held."""
    L, T, K = 4, 32, 2
    cache = RoutingCache(T, L, K, fused=True)
    ref = torch.full((L, T, K), -1, dtype=torch.int16)
    plans = [                                   # per layer: (rows, dtype, strided)
        [(7, torch.int64, False)] * L,
        [(3, torch.int32, False)] * L,
        [(5, torch.int64, False), (5, torch.int32, False), (5, torch.int64, True), (5, torch.int16, False)],
        [(6, torch.int64, False), (2, torch.int64, False), (6, torch.int64, False), (6, torch.int64, False)],
        [(7, torch.int64, False)] * L,
    ]
    for step, plan in enumerate(plans):
        for layer, (n, dt, strided) in enumerate(plan):
            ids = _ids(n, 2 * K if strided else K, 8, 10 * step + layer).to(dt)
            if strided:
                ids = ids[:, ::2]
            if step == 3 and layer == 1:        # recorded twice in one step: the later ids count
                cache.record(layer, _ids(n, K, 8, 99))
            cache.record(layer, ids)
            ref[layer, :n] = ids.to(torch.int16)
        assert torch.equal(cache.buffer, ref), step
        assert cache._held_count == 0 and all(h is None for h in cache._held), step
    assert sorted(cache._flush_views) == [3, 7]     # the uniform steps' views, kept per row count


def test_cache_direct_topk_out_into_int64_view():
    cache = RoutingCache(8, 2, 3, dtype=torch.int64)
    logits = torch.randn(5, 16, generator=torch.Generator().manual_seed(0))
    values = torch.empty(5, 3)
    torch.topk(logits, 3, out=(values, cache.layer_view(0)[:5]))
    assert np.array_equal(cache.layer_view(0)[:5].numpy(), torch.topk(logits, 3).indices.numpy())


def test_cache_rejects_bad_input_with_the_values():
    cache = RoutingCache(4, 2, 3)
    with pytest.raises(IndexError, match="MoE layer 2"):
        cache.record(2, _ids(1, 3, 8, 0))
    with pytest.raises(ValueError, match=r"\(5, 3\)"):
        cache.record(0, _ids(5, 3, 8, 0))
    with pytest.raises(ValueError, match=r"\(2, 2\)"):
        cache.record(0, _ids(2, 2, 8, 0))
    with pytest.raises(ValueError, match="integer"):
        cache.record(0, torch.zeros(2, 3))
    with pytest.raises(ValueError):
        RoutingCache(0, 2, 3)
    with pytest.raises(ValueError):
        RoutingCache(4, 2, 3, dtype=torch.float32)


# ---- AsyncCopier on CPU ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_host_rows_are_the_runs_of_each_layers_tensor_as_int16_and_let_the_tensors_go(dtype):
    """HostRows (an eager CPU step by reference): result() is the (n, L, K) int16 rows of the given runs, layer l
    from tensor l, exactly; nothing is read before result(); after release() the tensors are gone."""
    L, N, K = 3, 12, 4
    tensors = [torch.arange(N * K, dtype=dtype).reshape(N, K) + 1000 * layer for layer in range(L)]
    one = HostRows(tensors, [(3, 5)], K)
    assert one.shape == (5, L, K) and one.nbytes == 5 * L * K * 2 and not (one.dropped or one.stamped)
    # the tensors' bytes beyond the rows (all N tokens, 4- or 8-byte ids): a bounded queue counts them too
    assert one.extra_nbytes == L * N * K * tensors[0].element_size() - 5 * L * K * 2 == {torch.int32: 456,
                                                                                        torch.int64: 1032}[dtype]
    assert one.slot is None and one.dtype == np.int16
    # the same from the caller's count of one tensor's bytes (the worker knows it from its shape check)
    assert HostRows(tensors, [(3, 5)], K, N * K * tensors[0].element_size()).extra_nbytes == one.extra_nbytes
    want = np.stack([t.numpy()[3:8] for t in tensors], axis=1).astype(np.int16)
    for t in tensors:
        t.add_(7)                   # the caller's tensors change before result(): it reads them then (by reference)
    got = one.result()
    assert got.dtype == np.int16 and not got.flags.writeable
    np.testing.assert_array_equal(got, want + 7)
    assert one.result() is got
    runs = [(9, 2), (0, 1), (4, 3)]
    many = HostRows(tensors, runs, K)
    want = np.concatenate([np.stack([t.numpy()[a:a + n] for t in tensors], axis=1) for a, n in runs]).astype(np.int16)
    np.testing.assert_array_equal(many.result(), want)
    assert many.shape == (6, L, K)
    # strided tensors (an eager hook keeps the router's tensor as it is): the same rows
    wide = [torch.stack([t, t], dim=2).reshape(N, 2 * K) for t in tensors]
    views = [w[:, ::2] for w in wide]
    assert not views[0].is_contiguous()
    np.testing.assert_array_equal(HostRows(views, runs, K).result(), want)
    gone = HostRows(tensors, runs, K)
    gone.release()
    with pytest.raises(RuntimeError, match="released"):
        gone.result()


def test_host_rows_taken_unchecked_check_every_tensor_on_the_reading_thread():
    """HostRows(checked=False) (the CPU engine's C hooks hand a step's tensors over without reading their shapes):
    sound tensors give exactly the rows a checked step gives, int16 to uint8 ids alike; a tensor of the wrong shape
    or dtype, or one that is no CPU tensor, makes result() raise ValueError naming its layer and what the step
    needed, and nothing is read or returned; a second call raises again."""
    L, N, K = 3, 12, 4
    runs = [(9, 2), (0, 1), (4, 3)]                         # the step reads rows [0, 11)
    for dtype in (torch.int16, torch.int32, torch.int64, torch.uint8):
        tensors = [(torch.arange(N * K).reshape(N, K) % 100 + 10 * layer).to(dtype) for layer in range(L)]
        np.testing.assert_array_equal(HostRows(tensors, runs, K, checked=False).result(),
                                      HostRows(tensors, runs, K).result())
    good = [torch.arange(N * K, dtype=torch.int32).reshape(N, K) for _ in range(L)]
    bad = {
        "rows": (good[0][:10], r"shape \(10, 4\) and dtype int32; this step reads rows \[0, 11\) of 4"),
        "columns": (good[0][:, :3], r"shape \(12, 3\)"),
        "1-D": (good[0].reshape(-1), r"shape \(48,\)"),
        "float": (good[0].float(), "dtype float32"),
        "bool": (good[0] > 3, "dtype bool"),
        "not a tensor": (None, "NoneType that is no CPU tensor"),
    }
    for name, (t, msg) in bad.items():
        rows = HostRows([good[0], t, good[2]], runs, K, N * K * 4, checked=False)
        for _ in range(2):
            with pytest.raises(ValueError, match=r"MoE layer 1 \(local index\) handed over ") as e:
                rows.result()
            assert re.search(msg, str(e.value)), (name, str(e.value))
        assert rows._out is None, name


def test_copier_one_run_gives_rows_in_request_layout():
    cache = RoutingCache(32, 4, 2)
    cp = AsyncCopier(cache, num_slots=2, max_rows=16)
    want = _step(cache, 12, seed=3)
    p = cp.submit([(0, 5), (5, 7)])
    assert p.shape == (12, 4, 2) and p.dtype == np.dtype("<i2") and not p.dropped and p.done()
    rows = p.result()
    # one run: the ring holds it layer-major (one 2-D copy on CUDA); the view is (n, L, K), read-only
    assert rows.shape == (12, 4, 2) and not rows.flags.c_contiguous and not rows.flags.writeable
    assert np.array_equal(rows, want) and np.ascontiguousarray(rows).tobytes() == want.tobytes()
    p.release()
    p.release()
    assert cp.in_flight_rows == 0
    assert (cp.stats.submitted_steps, cp.stats.submitted_rows) == (1, 12)
    assert cp.capacity_rows == 48 and cp.host_bytes == 48 * 4 * 2 * 2 + 48 * 8 and cp.device_bytes == 0


@pytest.mark.parametrize("cache_dtype", [torch.int16, torch.int64])
def test_copier_gathers_segments_out_of_batch_order(cache_dtype):
    cache = RoutingCache(32, 3, 2, dtype=cache_dtype)
    cp = AsyncCopier(cache)
    want = _step(cache, 10, seed=4)
    # request order differs from batch order, one request (rows 3..4) does not want routing, one has 0 rows
    p = cp.submit([(7, 3), (0, 3), (6, 0), (5, 1)])
    assert np.array_equal(p.result(), np.concatenate([want[7:10], want[0:3], want[5:6]]))
    p.release()


def _stamp_value(rows: np.ndarray) -> int:
    """The step counter an (n, K) stamp block holds: every 64-bit (K % 4 == 0) or 32-bit lane of every row alike,
    read independently of capture.cache.read_stamp."""
    lanes = rows.view(np.int64 if rows.shape[1] % 4 == 0 else np.int32)
    assert (lanes == lanes.flat[0]).all(), lanes
    return int(lanes.flat[0])


@pytest.mark.parametrize("K,lanes", [(2, 1), (6, 3), (8, 2)])
def test_stamped_cache_counts_complete_flushes_in_every_lane_of_the_stamp_layer(K, lanes):
    cache = RoutingCache(16, 3, K, stamp=True)
    assert cache.buffer.shape == (3, 16, K) and cache.stamp_rows.shape == (16, K) and cache.stamped
    assert cache.buffer.is_contiguous() and cache.nbytes == 4 * 16 * K * 2
    assert cache._stamp_lanes.shape == (16, lanes)
    assert (cache.stamp_rows == -1).all() and _stamp_value(cache.stamp_rows.numpy()) == -1
    _step(cache, 5, seed=1)                       # one kernel over the whole layer: every row, not only 5
    assert _stamp_value(cache.stamp_rows.numpy()) == 0 and cache.stamp_value() == 0
    _step(cache, 9, seed=2)
    assert _stamp_value(cache.stamp_rows.numpy()) == 1
    cache.record(0, _ids(12, K, 8, 3))            # a layer missed: the flush writes rows, no stamp
    cache.flush()
    assert cache.incomplete_flushes == 1 and _stamp_value(cache.stamp_rows.numpy()) == 1
    assert cache.stamp_value() == 1 and read_stamp(cache.stamp_rows[:7].numpy()) == 1
    cache.stamp_rows[3, 0] = 5                    # one lane differs: no stamp
    assert read_stamp(cache.stamp_rows[:7].numpy()) is None
    with pytest.raises(ValueError, match="int16"):
        RoutingCache(4, 2, 2, dtype=torch.int32, stamp=True)
    with pytest.raises(ValueError, match="even top_k"):
        RoutingCache(4, 2, 1, stamp=True)
    with pytest.raises(RuntimeError, match="no step stamps"):
        RoutingCache(4, 2, 2).stamp_value()


def test_stamp_width_and_unsigned_read():
    assert [stamp_bits(k) for k in (2, 4, 6, 8)] == [32, 64, 32, 64]
    with pytest.raises(ValueError, match="even top_k"):
        stamp_bits(1)
    assert read_stamp(np.full((3, 2), -1, dtype=np.int16)) == 0xFFFFFFFF
    assert read_stamp(np.full((3, 8), -1, dtype=np.int16)) == (1 << 64) - 1
    assert read_stamp(np.array([[7, 0, 7, 0]], dtype=np.int16)) == 7 + (7 << 32)    # one 64-bit lane (little end.)
    assert read_stamp(np.array([[7, 0, 0, 0], [8, 0, 0, 0]], dtype=np.int16)) is None


def test_stamped_copier_carries_each_steps_stamp_after_its_rows_one_run_and_gathered():
    cache = RoutingCache(32, 4, 2, stamp=True)
    cp = AsyncCopier(cache, num_slots=2, max_rows=16)
    # 3 steps of 16 rows, each with its 4 stamp rows: the stamps take no room from the rows
    assert cp.capacity_rows == 3 * (16 + 4) and AsyncCopier(RoutingCache(32, 4, 2), 2, 16).capacity_rows == 48
    want = _step(cache, 12, seed=3)
    p = cp.submit([(0, 5), (5, 7)])                  # one run: layer-major, the stamp layer in the same copy
    assert p.stamped and p._m == 12 + 3 and cp.in_flight_rows == 15
    assert np.array_equal(p.result(), want) and p.stamps().shape == (12, 2) and _stamp_value(p.stamps()) == 0
    p.release()
    with pytest.raises(RuntimeError, match="after result"):
        p.stamps()
    want = _step(cache, 10, seed=4)
    q = cp.submit([(7, 3), (0, 3), (5, 1)])          # gathered: the stamps of the same rows, in the same order
    assert np.array_equal(q.result(), np.concatenate([want[7:10], want[0:3], want[5:6]]))
    assert q._m == 7 + 2 and _stamp_value(q.stamps()) == 1
    r = cp.submit_gather(torch.zeros((4, 4, 2), dtype=torch.int16), [0, 1])     # prefix rows: no stamp
    assert not r.stamped and r._m == 2
    q.release()
    r.release()
    assert cp.in_flight_rows == 0
    plain = AsyncCopier(RoutingCache(8, 2, 2), max_rows=4)
    _step(plain.cache, 4, seed=5)
    u = plain.submit([(0, 4)])
    u.result()
    assert not u.stamped and u._m == 4
    with pytest.raises(RuntimeError, match="no step stamps"):
        u.stamps()


def test_copier_skips_steps_without_rows():
    cache = RoutingCache(8, 2, 2)
    cp = AsyncCopier(cache)
    assert cp.submit([]) is None
    assert cp.submit([(3, 0)]) is None
    assert cp.stats.skipped_steps == 2 and cp.stats.submitted_steps == 0 and cp.in_flight_rows == 0


def test_copier_rejects_bad_segments():
    cache = RoutingCache(8, 2, 2)
    cp = AsyncCopier(cache, max_rows=4)
    with pytest.raises(ValueError, match="offset=6, rows=3"):
        cp.submit([(6, 3)])
    with pytest.raises(ValueError, match="offset=-1"):
        cp.submit([(-1, 1)])
    with pytest.raises(ValueError, match="5 rows.*max_rows=4"):
        cp.submit([(0, 5)])
    with pytest.raises(ValueError):
        AsyncCopier(cache, max_rows=9)
    with pytest.raises(ValueError):
        AsyncCopier(cache, num_slots=0)


def test_held_rows_survive_later_steps_and_full_ring_drops_counted():
    """A slow consumer holds rows: later steps never overwrite them; once the ring is full, steps are dropped
    (counted, nothing copied) and the held rows are still exact. Releasing makes room again."""
    cache = RoutingCache(8, 2, 3)
    cp = AsyncCopier(cache, num_slots=2, max_rows=8)      # 24 rows
    held, wants = [], []
    for step in range(6):                                 # 6 steps x 4 rows = 24 rows: all fit
        wants.append(_step(cache, 4, seed=10 + step))
        held.append(cp.submit([(0, 4)]))
    assert all(not p.dropped for p in held) and cp.in_flight_rows == 24
    _step(cache, 4, seed=99)
    dropped = cp.submit([(0, 2), (2, 2)])
    assert dropped.dropped and dropped.shape == (4, 2, 3)
    assert (cp.stats.dropped_steps, cp.stats.dropped_rows, cp.stats.submitted_steps) == (1, 4, 6)
    with pytest.raises(RuntimeError, match="dropped"):
        dropped.result()
    dropped.release()
    for p, want in zip(held, wants):
        assert np.array_equal(p.result(), want)
    held[1].release()                       # out of order: nothing reclaimed yet
    assert cp.submit([(0, 4)]).dropped
    held[0].release()                       # ranges 0 and 1 come back together
    want = _step(cache, 8, seed=7)
    p = cp.submit([(0, 8)])
    assert not p.dropped and np.array_equal(p.result(), want)
    with pytest.raises(RuntimeError, match="released"):
        p.release() or p.result()


@settings(max_examples=150, deadline=None)
@given(data=st.data(), n=st.integers(1, 40), as_array=st.booleans())
def test_copier_any_segment_list_gives_the_rows_in_request_order(data, n, as_array):
    """Short lists (Python path) and long lists or arrays (vectorized path) give the same exact rows."""
    cache = RoutingCache(40, 2, 2)
    cp = AsyncCopier(cache, num_slots=1, max_rows=40)
    want = _step(cache, n, seed=n)
    m = data.draw(st.integers(0, 30))
    segs = []
    for _ in range(m):
        off = data.draw(st.integers(0, n - 1))
        segs.append((off, data.draw(st.integers(0, n - off))))
    total = sum(c for _, c in segs)
    if total > 40:
        with pytest.raises(ValueError, match="max_rows=40"):
            cp.submit(np.array(segs, dtype=np.int64) if as_array else segs)
        return
    p = cp.submit(np.array(segs, dtype=np.int64).reshape(-1, 2) if as_array else segs)
    if total == 0:
        assert p is None
        return
    assert np.array_equal(p.result(), np.concatenate([want[a:a + c] for a, c in segs]))
    p.release()
    assert cp.in_flight_rows == 0


def test_copier_rejects_bad_segments_in_long_lists():
    cache = RoutingCache(64, 2, 2)
    cp = AsyncCopier(cache)
    with pytest.raises(ValueError, match="offset=60, rows=5"):
        cp.submit([(i, 1) for i in range(20)] + [(60, 5)])


# ---- PrefixStore ---------------------------------------------------------------------------------------------


def test_prefix_store_keeps_rows_by_slot_and_the_copier_gathers_them():
    cache = RoutingCache(16, 3, 2)
    store = PrefixStore(64, 3, 2)
    assert store.nbytes == 65 * 3 * 2 * 2 and bool((store.table == -1).all()) and store.rows.shape == (64, 3, 2)
    cp = AsyncCopier(cache, num_slots=2, max_rows=16)
    # step 1: 10 tokens written to slots 20..29 (block 5 and block 6 of size 4, then 2 of block 7)
    want1 = _step(cache, 10, seed=1)
    store.write(torch.arange(20, 30), cache.buffer[:, :10].transpose(0, 1))
    # step 2: 6 tokens overwrite slots 24..27 (block 6 evicted and refilled) and take 40, 41
    want2 = _step(cache, 6, seed=2)
    store.write(torch.tensor([24, 25, 26, 27, 40, 41]), cache.buffer[:, :6].transpose(0, 1))
    p = cp.submit_gather(store.rows, [20, 21, 24, 27, 41, 29, 0])
    got = p.result()
    np.testing.assert_array_equal(got[:6], np.stack([want1[0], want1[1], want2[0], want2[3], want2[5], want1[9]]))
    assert (got[6] == -1).all()                                    # never written
    p.release()
    store.forget(torch.tensor([20]))
    p = cp.submit_gather(store.rows, [20, 21])
    assert (p.result()[0] == -1).all() and np.array_equal(p.result()[1], want1[1])
    p.release()
    store.invalidate()
    assert bool((store.table == -1).all()) and store.invalidations == 1
    assert cp.submit_gather(store.rows, []) is None
    with pytest.raises(ValueError, match=r"gather index outside \[0, 64\): 3..64"):
        cp.submit_gather(store.rows, [3, 64])
    with pytest.raises(ValueError, match=r"gather source \(64, 2, 2\)"):
        cp.submit_gather(torch.zeros((64, 2, 2), dtype=torch.int16), [1])
    assert cp.in_flight_rows == 0


def test_padded_tokens_land_in_the_spare_row_only():
    """Slot -1 (CUDA-graph padding, dummy runs) writes the spare row past the real slots and nothing else."""
    cache = RoutingCache(8, 2, 2)
    store = PrefixStore(16, 2, 2)
    want = _step(cache, 5, seed=3)
    store.write(torch.tensor([3, 9, -1, -1, 4]), cache.buffer[:, :5].transpose(0, 1))
    t = store.table.numpy()
    np.testing.assert_array_equal(t[[3, 9, 4]], want[[0, 1, 4]])
    assert int((t[:16] != -1).any(axis=(1, 2)).sum()) == 3          # exactly the three real slots
    assert t[16].tolist() in (want[2].tolist(), want[3].tolist())   # the spare row took a padded token's rows


def _record_step(cache, n, seed):
    """Every layer's hook records an (n, K) int64 top-k, as a router does; returns the rows as (n, L, K)."""
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, 100, (n, cache.top_k), generator=g) for _ in range(cache.num_layers)]
    for layer, t in enumerate(ids):
        cache.record(layer, t)
    return torch.stack(ids, dim=1).to(torch.int16).numpy()


@pytest.mark.parametrize("fused", [True, False])
def test_flush_writes_the_attached_store_at_the_step_slots(fused):
    """The last layer's hook writes the step into the store at slot_mapping[:n] (the in-forward write that CUDA
    graphs replay); an explicit flush afterwards writes nothing again; detached, the store is left alone."""
    cache = RoutingCache(8, 3, 2, fused=fused)
    store = PrefixStore(32, 3, 2)
    slot_mapping = torch.full((8,), -1, dtype=torch.int64)
    cache.attach_store(store, slot_mapping)
    slot_mapping[:4] = torch.tensor([7, 8, 30, 2])
    want = _record_step(cache, 4, seed=1)
    assert cache.store_writes == 1
    np.testing.assert_array_equal(store.rows.numpy()[[7, 8, 30, 2]], want)
    cache.flush()                                                  # post_step's flush: nothing recorded since
    assert cache.store_writes == 1
    slot_mapping[:6] = torch.tensor([8, 9, -1, -1, -1, -1])       # next step: 2 tokens, 4 padded
    want2 = _record_step(cache, 6, seed=2)
    np.testing.assert_array_equal(store.rows.numpy()[[7, 8, 9, 30, 2]],
                                  np.stack([want[0], want2[0], want2[1], want[2], want[3]]))
    assert int((store.rows.numpy() != -1).any(axis=(1, 2)).sum()) == 5
    cache.detach_store()
    _record_step(cache, 2, seed=3)
    assert cache.store_writes == 2
    np.testing.assert_array_equal(store.rows.numpy()[[8, 9]], want2[:2])
    with pytest.raises(ValueError, match="slot mapping"):
        cache.attach_store(store, torch.zeros((2, 8), dtype=torch.int64))
    with pytest.raises(ValueError, match="prefix store rows"):
        cache.attach_store(PrefixStore(32, 2, 2), slot_mapping)


def test_a_step_missing_a_layer_forgets_its_slots_instead_of_storing_stale_rows():
    """A step whose last layer's hook did not run: the explicit flush writes -1 at the step's slots (the
    missing layer's rows in the cache are a previous step's); a middle layer missing does the same inside the
    last layer's flush. Complete steps are stored as usual; incomplete_flushes counts the others."""
    cache = RoutingCache(8, 3, 2)
    store = PrefixStore(16, 3, 2)
    slot_mapping = torch.tensor([5, 6, -1, -1, -1, -1, -1, -1])
    cache.attach_store(store, slot_mapping)
    want = _record_step(cache, 2, seed=1)                           # complete: stored at 5, 6
    np.testing.assert_array_equal(store.rows.numpy()[[5, 6]], want)
    slot_mapping[:2] = torch.tensor([6, 7])
    cache.record(0, torch.tensor([[1, 2], [3, 4]]))
    cache.record(1, torch.tensor([[1, 2], [3, 4]]))               # layer 2's hook is lost
    assert cache.store_writes == 1
    cache.flush()
    assert cache.store_writes == 2 and cache.incomplete_flushes == 1
    got = store.rows.numpy()
    assert (got[[6, 7]] == -1).all() and np.array_equal(got[5], want[0])
    slot_mapping[:2] = torch.tensor([5, 9])
    cache.record(0, torch.tensor([[1, 2], [3, 4]]))
    cache.record(2, torch.tensor([[5, 6], [7, 8]]))               # layer 1 lost, the last layer flushes
    assert cache.incomplete_flushes == 2
    assert (store.rows.numpy()[[5, 9]] == -1).all() and int((store.rows.numpy() != -1).any(axis=(1, 2)).sum()) == 0


def test_hit_slots_follow_the_block_table():
    row = np.array([7, 3, 9, 0, 0], dtype=np.int32)
    np.testing.assert_array_equal(hit_slots(row, 4, 10), [28, 29, 30, 31, 12, 13, 14, 15, 36, 37])
    assert hit_slots(row, 4, 0).shape == (0,)


def test_hit_slots_many_is_the_requests_slots_concatenated():
    """One gather's slots for many requests (the worker's fill queue): whole block-aligned requests, then parts
    that start or end inside a block (a gather that splits a request), equal to the slot mapping's formula
    (block id x block size + offset) per request."""
    got = hit_slots_many([([7, 3], 0, 8), ([5], 0, 4), ([2, 6, 1], 0, 12)], 4)
    np.testing.assert_array_equal(got, [28, 29, 30, 31, 12, 13, 14, 15, 20, 21, 22, 23, 8, 9, 10, 11, 24, 25, 26,
                                        27, 4, 5, 6, 7])
    assert got.dtype == np.int64
    np.testing.assert_array_equal(hit_slots_many([([7, 3, 9], 2, 7), ([5], 1, 0), ([2, 6], 5, 2)], 4),
                                  [30, 31, 12, 13, 14, 15, 36, 25, 26])
    assert hit_slots_many([], 16).shape == (0,)
    rnd = np.random.default_rng(0)
    for _ in range(300):
        bs = int(rnd.choice([1, 4, 16, 128]))
        spans, want = [], []
        for _ in range(int(rnd.integers(1, 6))):
            row = rnd.integers(0, 1000, int(rnd.integers(1, 6))).tolist()
            end = int(rnd.integers(0, len(row) * bs + 1))
            start = int(rnd.integers(0, end + 1))
            spans.append((row, start, end - start))
            pos = np.arange(start, end)                 # vLLM's slot mapping, computed here on its own
            want.append(np.array(row, dtype=np.int64)[pos // bs] * bs + pos % bs)
        np.testing.assert_array_equal(hit_slots_many(spans, bs), np.concatenate(want))


_RING_KERNELS_SCRIPT = r'''
import os, sys
import numpy as np, torch
from routing_replay.capture import RoutingCache
from routing_replay.capture import ring_kernels

L, T, S, R = 3, 40, 8, 16
out = []
for K in (8, 6):                                   # 64-bit and 32-bit stamp lanes
    caches = {}
    for mode in ("0", "1"):
        os.environ["ROUTING_REPLAY_RING_KERNELS"] = mode
        caches[mode] = RoutingCache(T, L, K, stamp=True, slots=S, slot_rows=R)
    torch_c, fused_c = caches["0"], caches["1"]
    assert torch_c._kernels is None and fused_c._kernels is not None, (torch_c._kernels, fused_c._kernels)
    lane = torch.int64 if K % 4 == 0 else torch.int32
    for c in (torch_c, fused_c):                   # the counter wraps after the third step
        c.stamp_rows.view(lane).fill_(torch.iinfo(lane).max - 2)
    rng = np.random.default_rng(K)
    slotted = 0
    for step in range(30):
        n = int(rng.integers(1, T + 1)) if step % 5 == 4 else int(rng.integers(1, R + 1))
        skip = step % 7 == 6                        # a step missing a layer: no stamp, no slot write
        ids = torch.from_numpy(rng.integers(0, 64, (L, n, K))).to(torch.int32)
        for c in (torch_c, fused_c):
            for layer in range(L):
                if not (skip and layer == 1):
                    c.record(layer, ids[layer])
            c.flush()
        assert torch.equal(torch_c._full, fused_c._full), step
        assert torch.equal(torch_c.ring, fused_c.ring), step
        assert torch.equal(torch_c._slot, fused_c._slot), step
        if not skip and n <= R:                     # independently: the slot the counter names holds the step
            slotted += 1
            v = int(fused_c.stamp_rows.view(lane)[0, 0])
            s = v % S
            assert s == int(fused_c._slot[0]), (v, s)
            assert torch.equal(fused_c.ring[s, :L, :n], ids.to(torch.int16)), step
            assert bool((fused_c.ring[s, L].view(lane) == v).all()), step
    assert torch_c.slot_writes == fused_c.slot_writes == slotted
    out.append(f"K={K}:{slotted}")
print("OK", *out)
'''


def test_step_ring_triton_kernels_equal_the_torch_path_in_the_interpreter(tmp_path):
    """capture/ring_kernels.py, run by Triton's CPU interpreter (TRITON_INTERPRET=1, in a fresh process: the flag is
    read when the kernels are defined): over 30 steps of random sizes (some larger than a slot, some missing a
    layer, the counter wrapping), the cache, the step ring and the slot index are bit-equal to the torch path's
    after every step, and the slot the counter names holds the step's rows and stamps."""
    import os
    import subprocess
    import sys
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", _RING_KERNELS_SCRIPT], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["OK", "K=8:22", "K=6:23"], r.stdout
