"""Prompt rows of a shared prefix sent and stored once (prefix_refs): the wire checks, the consumer's resolution and
compact records (socket-free), fail closed; every record checked bit for bit against the record the same requests
give when every prompt row is sent (prefix_filled alone)."""

import numpy as np
import pytest

from routing_replay.apps.synthetic import true_rows
from routing_replay.consumer import Accumulator
from routing_replay.consumer.prefix_pool import CompactRecord, PrefixPool
from routing_replay.consumer.store import RecordStore
from routing_replay.protocol import wire

L, K, E = 3, 2, 16


def rows(seed, lo, hi):
    return true_rows(seed, np.arange(lo, hi), L, K, E)


class Feed:
    def __init__(self, **kw):
        self.acc = Accumulator(finish_grace_s=0.0, **kw)
        self.out = {}
        self.seq = 0

    producer = "p"

    def apply(self, kind, key, body, frames=()):
        self.seq += 1
        h = wire.decode_header(wire.pack_header(kind, self.producer, 0, self.seq, key, body))
        for r in self.acc.apply(h, list(frames), 0.0):
            self.out[r.request_id] = r

    def open(self, rid, P, C=0, refs=None):
        body = {"prompt_len": P, "num_cached": C, "num_layers": L, "top_k": K, "prefix_filled": True}
        if refs:
            body["prefix_refs"] = [list(r) for r in refs]
        self.apply("open", rid, body)

    def delta(self, rid, lo, hi, data):
        self.apply("delta", [rid], wire.delta_body([lo], [hi - lo], L, K), [data.tobytes()])

    def finish(self, rid, G):
        self.apply("finish", rid, {"num_output": G})


def expected(prompt, gen):
    """A record's rows as the fill mode without references yields them: the last output row -1."""
    g = gen.copy()
    g[-1] = -1
    return prompt, g


P, G = 8, 5


def writer(f, rid="w", seed=1, finish=True):
    f.open(rid, P)
    f.delta(rid, 0, P + G - 1, rows(seed, 0, P + G - 1))
    if finish:
        f.finish(rid, G)


def referrer(f, rid="b", seed=2, refs=(("w", 0, 0, 4),), C=4, finish=True):
    f.open(rid, P, C, refs)
    f.delta(rid, C, P + G - 1, rows(seed, C, P + G - 1))     # rows [C, P) the same prompt's: own seed here
    if finish:
        f.finish(rid, G)


def ref_expected(wseed=1, seed=2, C=4):
    prompt = rows(seed, 0, P)
    prompt[:C] = rows(wseed, 0, C)
    return expected(prompt, rows(seed, P, P + G))


def check(rec, want, complete=True, missing=()):
    assert rec.complete is complete and rec.missing == list(missing)
    np.testing.assert_array_equal(rec.prompt_routed_experts, want[0])
    np.testing.assert_array_equal(rec.routed_experts, want[1])


# ---- wire ---------------------------------------------------------------------------------------------------------

def _open_h(refs, C=4, filled=True, rid="b"):
    body = {"prompt_len": P, "num_cached": C, "num_layers": L, "top_k": K, "prefix_filled": filled,
            "prefix_refs": refs}
    return wire.decode_header(wire.pack_header("open", "p", 0, 1, rid, body))


def test_open_carries_refs_and_opens_per_entry_refs_survive_a_split():
    o = wire.parse_open(_open_h([["w", 0, 0, 2], ["v", 5, 2, 2]]))
    assert o.prefix_refs == (("w", 0, 0, 2), ("v", 5, 2, 2))
    body = wire.opens_body([P, P, P], [4, 0, 4], L, K, None, None, [True, False, True],
                           [(("w", 0, 0, 4),), (), (("x", 8, 0, 2), ("w", 2, 2, 2))])
    h = wire.decode_header(wire.pack_header("opens", "p", 0, 1, ["a", "b", "c"], body))
    os_, _ = wire.parse_opens(h)
    assert [os_.open_at(i).prefix_refs for i in range(3)] == [(("w", 0, 0, 4),), (), (("x", 8, 0, 2), ("w", 2, 2, 2))]
    head, = wire.subset_opens(h, os_, None, [2, 1])
    sub, _ = wire.parse_opens(wire.decode_header(head))
    assert sub.request_ids == ["c", "b"] and sub.prefix_refs == [(("x", 8, 0, 2), ("w", 2, 2, 2)), ()]
    single = wire.decode_header(os_.single(h, None, 0)[0])
    assert wire.parse_open(single).prefix_refs == (("w", 0, 0, 4),)


@pytest.mark.parametrize("refs, filled, reason, text", [
    ([["w", 0, 0, 5]], True, "out_of_range", "rows [0, 5) not ascending and disjoint inside [0, num_cached=4)"),
    ([["w", 0, 2, 2], ["v", 0, 1, 1]], True, "out_of_range", "rows [1, 2) not ascending"),
    ([["w", -1, 0, 2]], True, "bad_field", "['w', -1, 0, 2]"),
    ([["w", 0, 0, 0]], True, "bad_field", "['w', 0, 0, 0]"),
    ([["", 0, 0, 2]], True, "bad_request_id", "prefix_refs writer of 'b'"),
    ([["b", 0, 0, 2]], True, "bad_field", "names the request itself"),
    ([["w", 0, 0]], True, "bad_field", "is not [writer, writer_pos, pos, count]"),
    ("w", True, "bad_field", "must be a list, got str"),
    ([["w", 0, 0, 2]], False, "bad_field", "prefix_refs of 'b' without prefix_filled"),
    ([["w", 0, i, 1] for i in range(4)] * 1025, True, "bad_field", "4100 entries, limit 4096"),
])
def test_bad_refs_are_refused_naming_the_value(refs, filled, reason, text):
    with pytest.raises(wire.ProtocolError) as e:
        wire.parse_open(_open_h(refs, filled=filled))
    assert e.value.reason == reason and text in str(e.value)


# ---- consumer -----------------------------------------------------------------------------------------------------

def test_rows_referenced_from_a_finished_writer_are_stored_once_and_materialised_exact():
    f = Feed()
    writer(f)
    referrer(f)
    rec = f.out["b"]
    assert type(rec) is CompactRecord and rec.prompt_routed_experts.shape[0] == P - 4
    pool = f.acc.pool
    whole = pool.materialize(rec)
    check(whole, ref_expected())
    assert (whole.num_cached_tokens, whole.num_prefix_filled) == (4, 4)
    check(f.out["w"], expected(rows(1, 0, P), rows(1, P, P + G)))
    assert (f.acc.stats.prefix_ref_rows, f.acc.stats.prefix_live_rows, f.acc.stats.prefix_unresolved) == (4, 0, 0)
    # the store keeps it compact (its entry pinned) and gives it back whole
    store = RecordStore(1 << 20, pool=pool)
    store.put(rec)
    entry = pool.get(("p", "w"))
    assert entry.pins == 1 and store.bytes == rec.nbytes < whole.nbytes
    check(store.peek("b"), ref_expected())
    check(store.take("b"), ref_expected())
    assert entry.pins == 0


def test_a_writer_still_in_flight_serves_its_rows_and_one_that_finishes_first_its_entry():
    f = Feed()
    writer(f, finish=False)
    referrer(f)                                 # the writer is in flight: its rows are copied into the record
    rec = f.out["b"]
    assert type(rec) is not CompactRecord
    check(rec, ref_expected())
    assert (f.acc.stats.prefix_ref_rows, f.acc.stats.prefix_live_rows) == (4, 4)
    referrer(f, "c", seed=3, finish=False)      # opened while the writer is in flight, finished after it
    f.finish("w", G)
    f.finish("c", G)
    assert type(f.out["c"]) is CompactRecord
    check(f.acc.pool.materialize(f.out["c"]), ref_expected(seed=3))


def test_unknown_writer_evicted_writer_and_writer_missing_rows_fail_closed_exactly():
    f = Feed()
    writer(f)
    referrer(f, "b", refs=(("nobody", 0, 0, 4),))
    rec = f.out["b"]
    want = ref_expected()
    want[0][:4] = -1
    check(rec, want, complete=False, missing=[(0, 4)])
    assert rec.reason == "prefix_unresolved"
    referrer(f, "c", seed=3)                    # the other records are untouched
    check(f.acc.pool.materialize(f.out["c"]), ref_expected(seed=3))
    assert (f.acc.stats.prefix_unresolved, f.acc.stats.prefix_unresolved_rows) == (1, 4)

    f = Feed(prefix_pool_bytes=1)               # the writer's entry is evicted as soon as it is made
    writer(f)
    assert len(f.acc.pool) == 0 and f.acc.pool.evicted == 1
    referrer(f)
    check(f.out["b"], want, complete=False, missing=[(0, 4)])

    f = Feed()                                  # the writer's own row 2 never arrived: only that row is lost
    f.open("w", P)
    f.delta("w", 0, 2, rows(1, 0, 2))
    f.delta("w", 3, P + G - 1, rows(1, 3, P + G - 1))
    f.finish("w", G)
    assert f.out["w"].missing == [(2, 3)]
    referrer(f)
    want = ref_expected()
    want[0][2] = -1
    check(f.out["b"], want, complete=False, missing=[(2, 3)])
    assert f.out["b"].reason == "prefix_unresolved"


def test_a_writer_of_that_id_from_another_producer_is_not_the_writer():
    """Another engine's request of the same id (its own KV cache): never resolved against, in flight or finished."""
    f = Feed()
    f.producer = "q"
    writer(f, finish=False)
    f.producer = "p"
    referrer(f, "b")
    want = ref_expected()
    want[0][:4] = -1
    check(f.out["b"], want, complete=False, missing=[(0, 4)])
    f.producer = "q"
    f.finish("w", G)
    f.producer = "p"
    referrer(f, "c", seed=3)
    want = ref_expected(seed=3)
    want[0][:4] = -1
    check(f.out["c"], want, complete=False, missing=[(0, 4)])


def test_a_reference_to_rows_that_were_references_themselves_is_unresolved():
    """The engine names the request whose computed rows filled a block; a consumer never serves a row the writer
    itself only referenced (the pool holds each record's own rows)."""
    f = Feed()
    writer(f)
    referrer(f)                                 # b's rows [0, 4) are w's
    referrer(f, "c", seed=3, refs=(("b", 0, 0, 4),))
    want = ref_expected(seed=3)
    want[0][:4] = -1
    check(f.out["c"], want, complete=False, missing=[(0, 4)])


def test_pinned_entries_stay_past_the_pool_bound_and_go_once_released():
    pool = PrefixPool(1)
    f = Feed(prefix_pool_bytes=10 << 20)
    f.acc.pool = pool
    pool.max_bytes = 10 << 20
    writer(f)
    referrer(f)
    rec = f.out["b"]
    pool.max_bytes = 1                          # over the bound: w's entry is pinned by the held record
    writer(f, "w2", seed=5)
    assert pool.get(("p", "w")) is not None and pool.get(("p", "w2")) is None
    pool.release(rec)
    assert pool.get(("p", "w")) is None and pool.bytes == 0
    check(pool.materialize(rec), ref_expected())    # the record still holds its entry: still exact


# ---- engine side: who wrote each KV block (engines/vllm_plugin/prefix_refs.py, host data only) --------------------

def _cached(ids, new_blocks, computed, resumed=()):
    from types import SimpleNamespace
    return SimpleNamespace(req_ids=ids, new_block_ids=new_blocks, num_computed_tokens=computed,
                           resumed_req_ids=set(resumed))


def test_block_writers_name_the_request_that_computed_each_block_and_check_its_tokens():
    from routing_replay.engines.vllm_plugin.prefix_refs import BlockWriters
    bw = BlockWriters(4)
    sys_p, a, b = list(range(100, 108)), [1, 2, 3, 4, 5], [7, 7, 7, 7, 7]
    # A computes 13 prompt tokens in two chunks (8 then 5): blocks 10, 11 (system), 12 its own; 13 partial
    assert bw.open("ra", "A", sys_p + a, [10, 11], 0, 13, 8) == ((), 0)
    assert sorted(bw.writer) == [10, 11] and "ra" in bw.prefill
    bw.step(_cached(["ra"], [([12, 13],)], [8]), {"ra": 5})
    assert {k: v[:2] for k, v in bw.writer.items()} == {10: ("A", 0), 11: ("A", 4), 12: ("A", 8)}
    assert "ra" not in bw.prefill                           # all its full blocks recorded
    # a sibling of A hits its 3 blocks: one run; a request of another prompt hits the system blocks only
    assert bw.open("ra2", "A2", sys_p + a, [10, 11, 12, 20], 12, 13, 1) == ((("A", 0, 0, 12),), 12)
    assert bw.open("rb", "B", sys_p + b, [10, 11, 21], 8, 13, 5) == ((("A", 0, 0, 8),), 8)
    assert bw.writer[21][:2] == ("B", 8)                    # B computed its third block itself
    # a block id reallocated to other content (hash differs) is never named: the run stops there
    other = list(range(200, 208)) + b
    assert bw.open("rc", "C", other, [10, 11, 22], 8, 13, 5) == ((), 0)
    # a writer key opened again forgets the blocks of the earlier request of that key
    bw.open("ra3", "A", [9] * 13, [30, 31, 32, 33], 0, 13, 13)
    assert bw.open("rd", "D", sys_p + a, [10, 11, 12], 12, 13, 1) == ((), 0)
    assert bw.ref_rows == 20 and bw.ref_requests == 2
    bw.clear()
    assert not bw.writer and not bw.prefill


def test_block_writers_drop_requests_preempted_or_resumed_and_never_self_reference():
    from routing_replay.engines.vllm_plugin.prefix_refs import BlockWriters
    bw = BlockWriters(4)
    toks = list(range(12))
    bw.open("r", "R", toks, [1], 0, 12, 4)                  # block 1 done, 2 more to come
    bw.step(_cached(["r"], [([2, 3],)], [4], resumed=["r"]), {"r": 8})
    assert sorted(bw.writer) == [1] and "r" not in bw.prefill
    bw.open("s", "S", toks, [5], 0, 12, 4)
    bw.ended(["s"])
    assert "s" not in bw.prefill
    assert bw.open("r2", "R", toks, [1, 6], 4, 12, 8) == ((), 0)     # (R's own key: forgotten on its reopen)


def test_prefix_refs_setting_defaults_on_and_names_a_bad_value(monkeypatch):
    from routing_replay.engines.vllm_plugin import settings
    monkeypatch.setenv("ROUTING_REPLAY_BROKER", "ipc:///tmp/unused")
    monkeypatch.setenv("ROUTING_REPLAY_PREFIX_ROWS", "fill")
    monkeypatch.delenv("ROUTING_REPLAY_PREFIX_REFS", raising=False)
    assert settings.current().prefix_refs is True
    monkeypatch.setenv("ROUTING_REPLAY_PREFIX_REFS", "0")
    assert settings.current().prefix_refs is False
    monkeypatch.setenv("ROUTING_REPLAY_PREFIX_REFS", "maybe")
    with pytest.raises(ValueError, match="ROUTING_REPLAY_PREFIX_REFS='maybe': choose 1 or 0"):
        settings.current()
