"""engines/vllm_plugin/prefix_rows.py: the prefix store's lifecycle in one worker, without vLLM (a Model Runner V1
stand-in's slot-mapping buffer; the real PrefixStore, RoutingCache, AsyncCopier and StepBatch)."""

from types import SimpleNamespace

import pytest
import torch

from routing_replay.capture import AsyncCopier, PrefixStore, RoutingCache
from routing_replay.engines.vllm_plugin.prefix_rows import PrefixRows, check_fill_supported
from routing_replay.engines.vllm_plugin.step_batch import StepBatch
from routing_replay.engines.vllm_plugin.worker import WorkerStats

L, K, SLOTS, BS = 2, 2, 64, 4


def _prefix(max_tokens=32):
    cache = RoutingCache(max_tokens, L, K)
    copier = AsyncCopier(cache, num_slots=4)
    runner = SimpleNamespace(input_batch=SimpleNamespace(block_table=[SimpleNamespace(slot_mapping=SimpleNamespace(
        gpu=torch.zeros(max_tokens, dtype=torch.int64)))]), vllm_config=SimpleNamespace())
    flushes, changes = [], []
    batch = StepBatch(K)
    p = PrefixRows(runner, "v1", cache, copier, batch, WorkerStats(), fill=True, max_batch_steps=16,
                   max_batch_rows=1000, flush=lambda: flushes.append(1))
    p.on_change = lambda: changes.append((p.fill, p.store))
    store = PrefixStore(SLOTS, L, K)
    # slot s holds ids 10 * s + layer (distinct per slot and layer)
    store.rows.copy_(torch.tensor([[[10 * s + layer] * K for layer in range(L)] for s in range(SLOTS)],
                                  dtype=torch.int16))
    p.adopt(store, BS)
    return p, batch, copier, flushes, changes


def _rows_of(slots):
    return [[[10 * s + layer] * K for layer in range(L)] for s in slots]


def test_queued_prefix_rows_are_gathered_from_their_blocks_slots_into_the_batch():
    p, batch, copier, flushes, changes = _prefix()
    assert changes == [(True, p.store)]
    p.fills += [("r1", "k1", 6, [2, 5, 9], 0), ("r2", "k2", 3, [7], 0)]    # (id, key, hits, blocks, by reference)
    p.after_forward()                               # queued; not due yet (one step, 9 rows of a 32-row ring)
    assert [(f.key, f.blocks, f.hits) for f in p.queue] == [("k1", [2, 5], 6), ("k2", [7], 3)]
    assert (p.rids, p.rows, p.wait, p.fills) == ({"r1", "r2"}, 9, 1, []) and batch.parts == []
    assert (p.stats.prefix_requests, p.stats.prefix_rows) == (2, 9)
    p.pump()
    assert (list(p.queue), p.rids, p.rows, p.wait) == ([], set(), 0, 0)
    assert (batch.keys, batch.starts, batch.counts, batch.strict) == ([["k1", "k2"]], [[0, 0]], [[6, 3]], [False])
    keys, starts, counts, rows = batch.hand_over(copier, 0)
    assert rows.result().tolist() == _rows_of([8, 9, 10, 11, 20, 21, 28, 29, 30])
    rows.release()
    assert flushes == []


def test_freed_blocks_are_gathered_at_once_and_the_others_wait():
    p, batch, copier, _, _ = _prefix()
    p.fills += [("r1", "k1", 4, [1], 0), ("r2", "k2", 2, [3], 0)]
    p.after_forward()
    p.blocks_freed({"r2", "x"}, set())
    assert [f.key for f in p.queue] == ["k1"] and p.rids == {"r1"} and batch.keys == [["k2"]]
    rows = batch.hand_over(copier, 0)[3]
    assert rows.result().tolist() == _rows_of([12, 13])
    rows.release()


def test_a_refused_open_drops_its_prefix_rows_and_a_lost_store_clears_everything():
    p, batch, _, _, changes = _prefix()
    p.fills += [("r1", "k1", 4, [1], 0), ("r2", "k2", 2, [3], 0)]
    p.refused("r1", "k1")
    assert p.fills == [("r2", "k2", 2, [3], 0)]
    p.after_forward()
    store = p.store
    p.runner.input_batch.block_table[0].slot_mapping.gpu = torch.zeros(32, dtype=torch.int64)     # replaced
    assert not p.trusted()
    assert (p.fill, p.store, list(p.queue), p.rids, store.invalidations) == (False, None, [], set(), 1)
    assert changes[-1] == (False, None) and batch.parts == []


def test_switching_modes_and_kv_connectors():
    p, _, _, _, changes = _prefix()
    with pytest.raises(ValueError, match="prefix rows mode 'maybe': choose fill or sentinel"):
        p.set_mode("maybe", gate=True, graphs_captured=False)
    p.set_mode("sentinel", gate=False, graphs_captured=True)     # under graphs the store stays (and is written)
    assert (p.fill, p.store is not None) == (False, True)
    p.set_mode("sentinel", gate=True, graphs_captured=False)     # eager: the store goes
    assert (p.fill, p.store) == (False, None) and changes[-1] == (False, None)
    with pytest.raises(ValueError, match="needs the store in the captured graphs"):
        p.set_mode("fill", gate=False, graphs_captured=True)
    with pytest.raises(NotImplementedError, match="with a KV connector"):
        check_fill_supported(SimpleNamespace(kv_transfer_config=object()))
    check_fill_supported(SimpleNamespace(kv_transfer_config=None))


def test_hits_named_by_reference_are_not_gathered():
    """ROUTING_REPLAY_PREFIX_REFS: rows [0, covered) of a request's hits go by reference in its open (prefix_refs.py);
    only the rest is queued and gathered, and a request whose every hit is covered gathers nothing."""
    p, batch, copier, _, _ = _prefix()
    p.fills += [("r1", "k1", 8, [2, 5], 4), ("r2", "k2", 4, [7], 4)]
    p.after_forward()
    assert [(f.key, f.done, f.hits) for f in p.queue] == [("k1", 4, 8)] and p.rows == 4 and p.rids == {"r1"}
    assert (p.stats.prefix_ref_rows, p.stats.prefix_rows) == (8, 12)
    p.pump()
    assert (batch.keys, batch.starts, batch.counts) == ([["k1"]], [[4]], [[4]])
    rows = batch.hand_over(copier, 0)[3]
    assert rows.result().tolist() == _rows_of([20, 21, 22, 23])
    rows.release()
