"""Prompt rows of a shared prefix sent once (prefix_refs), end to end: a real producer -> `routing-replay broker`
process -> `routing-replay consume` process(es), a GRPO-shaped synthetic workload (bench/grpo_bytes.py's block
model of the engine's prefix cache); records fetched bit for bit against the same workload sent with every prompt
row (prefix_filled alone), affinity of referencing requests to their writer's consumer, and fail closed."""

import re
from pathlib import Path

import numpy as np
import pytest

from routing_replay.consumer import RecordUnknown, TrainerClient
from routing_replay.producer import Producer
from tests.procs import load_script, start_broker, start_consumer, stop_all, wait_until

bench = load_script(Path(__file__).resolve().parent.parent / "bench" / "grpo_bytes.py", "grpo_bytes")
W = bench.Workload(prompts=3, samples=4, system=8, user=6, gen=5, layers=4, top_k=2, experts=16, block=4)


def _stat(proc, name: str) -> int:
    vals = re.findall(rf"\b{name}=(\d+)", "".join(proc.lines))
    return int(vals[-1]) if vals else -1


def _run(tmp_path, tag, w, refs, consumers=1, pool_mb=256, extra=None):
    """Publish `w` (and `extra(producer)`) through real processes; every record fetched, with the index of the
    consumer that served it. Returns (records, where, broker, consumer procs) with the processes stopped."""
    b, fe, be = start_broker(f"ipc://{tmp_path}/{tag}-fe", f"ipc://{tmp_path}/{tag}-be")
    serves = [f"ipc://{tmp_path}/{tag}-s{i}" for i in range(consumers)]
    cs = [start_consumer(be, "--serve", s, "--prefix-pool-mb", str(pool_mb), "--finish-grace-ms", "50")
          for s in serves]
    try:
        wait_until(lambda: _stat(b, "consumers") == consumers, what="consumers known to the broker")
        ids = [r.rid for g in bench.plan(w) for r in g]
        with Producer(fe, num_layers=w.layers, top_k=w.top_k) as p:
            bench.publish(p, w, refs)
            if extra is not None:
                ids += extra(p)
            assert p.wait_acked(60)
        recs, where = {}, {}
        for i, s in enumerate(serves):
            with TrainerClient(s) as tc:
                try:
                    got = tc.fetch(ids, timeout_s=60, unknown="raise" if consumers > 1 else "grace")
                except RecordUnknown as e:
                    got = e.records
            for rid, rec in got.items():
                recs[rid], where[rid] = rec, i
        assert sorted(recs) == sorted(ids)
        wait_until(lambda: all(_stat(c, "records") >= 0 for c in cs), what="consumer stats")
    finally:
        stop_all(b, *cs)
    return recs, where, b, cs


def _expected(w, r):
    """The record's rows as the fill mode yields them (every prompt row the engine's; the last output row -1)."""
    gen = bench.rows_of(w, r, r.prompt_len, r.prompt_len + w.gen)
    gen[-1] = -1
    return bench.rows_of(w, r, 0, r.prompt_len), gen


def test_grpo_records_with_references_are_bit_identical_to_every_row_sent(tmp_path):
    fill, _, _, _ = _run(tmp_path, "fill", W, refs=False)
    refs, _, b, (c,) = _run(tmp_path, "refs", W, refs=True)
    plan = [r for g in bench.plan(W) for r in g]
    referencing = [r for r in plan if r.refs]
    assert [len(r.refs) for r in plan] == [0, 1, 1, 1, 1, 2, 2, 2, 1, 2, 2, 2]      # the block model's runs
    for r in plan:
        a, x = fill[r.rid], refs[r.rid]
        assert a.complete and a.equals(x), r.rid
        p, g = _expected(W, r)
        np.testing.assert_array_equal(x.prompt_routed_experts, p)
        np.testing.assert_array_equal(x.routed_experts, g)
        assert (x.num_cached_tokens, x.num_prefix_filled) == (r.cached, r.cached)
    # the consumer's own count: every cached row of a referencing request came by reference, none unresolved;
    # each of those records was held compact
    assert _stat(c, "prefix_ref_rows") == sum(r.cached for r in referencing) == 3 * 12 + 2 * (8 + 3 * 12)
    assert (_stat(c, "prefix_unresolved"), _stat(c, "compact_records")) == (0, len(referencing))


def test_two_consumers_referencing_requests_go_to_their_writers_consumer(tmp_path):
    w = bench.Workload(prompts=8, samples=3, system=0, user=12, gen=4, layers=4, top_k=2, experts=16, block=4,
                       prefix="aff")
    fill, hashed, _, _ = _run(tmp_path, "fill", w, refs=False, consumers=2)
    refs, where, b, cs = _run(tmp_path, "refs", w, refs=True, consumers=2)
    groups = bench.plan(w)
    # placed by the hash alone (fill), some samples land on another consumer than their group's first sample
    assert sum(hashed[r.rid] != hashed[g[0].rid] for g in groups for r in g) > 0
    for g in groups:
        owner = where[g[0].rid]
        assert [where[r.rid] for r in g] == [owner] * len(g)        # the group's samples on its writer's consumer
        assert all(fill[r.rid].equals(refs[r.rid]) and refs[r.rid].complete for r in g)
    assert _stat(b, "prefix_affine") == len(groups) * (w.samples - 1)
    assert sum(_stat(c, "prefix_ref_rows") for c in cs) == len(groups) * (w.samples - 1) * 8


def _lost_and_unknown(p):
    """A writer whose rows [2, 5) never leave the producer, a request referencing its rows [0, 8), and one that
    references a request no consumer ever saw."""
    w = W
    wr = bench.Req("lost-w", 50, 0, 12, 0, ())
    p.open("lost-w", prompt_len=12, prefix_filled=True)
    rows = bench.rows_of(w, wr, 0, 12 + w.gen - 1)
    p.publish_rows(["lost-w", "lost-w"], [0, 5], [2, 12 + w.gen - 1 - 5], np.concatenate([rows[:2], rows[5:]]))
    p.finish("lost-w", num_output_tokens=w.gen)
    for rid, writer in (("lost-b", "lost-w"), ("ghost-b", "ghost")):
        r = bench.Req(rid, 50, 1, 12, 8, ())
        p.open(rid, prompt_len=12, num_cached_tokens=8, prefix_filled=True, prefix_refs=[(writer, 0, 0, 8)])
        p.publish_rows([rid], [8], [4 + w.gen - 1], bench.rows_of(w, r, 8, 12 + w.gen - 1))
        p.finish(rid, num_output_tokens=w.gen)
    return ["lost-w", "lost-b", "ghost-b"]


@pytest.mark.parametrize("pool_mb", [256, 0])
def test_unresolvable_references_fail_closed_with_exact_missing_ranges(tmp_path, pool_mb):
    """pool 0: a writer's rows are gone as soon as its record is (as if evicted at once): every reference to a
    finished writer fails closed; an unknown writer, and a writer whose own rows were lost, with either pool."""
    fill, _, _, _ = _run(tmp_path, "fill", W, refs=False)
    refs, _, _, (c,) = _run(tmp_path, "refs", W, refs=True, pool_mb=pool_mb, extra=_lost_and_unknown)
    for g in bench.plan(W):
        for r in g:
            x = refs[r.rid]
            if pool_mb or not r.refs:
                assert fill[r.rid].equals(x) and x.complete, r.rid
                continue
            want = [(0, r.cached)]
            assert (x.complete, x.reason, x.missing) == (False, "prefix_unresolved", want), r.rid
            p, gen = _expected(W, r)
            p[:r.cached] = -1
            np.testing.assert_array_equal(x.prompt_routed_experts, p)
            np.testing.assert_array_equal(x.routed_experts, gen)
    assert refs["lost-w"].missing == [(2, 5)]
    lost = refs["lost-b"]
    assert (lost.complete, lost.reason, lost.missing) == (False, "prefix_unresolved",
                                                          [(0, 8)] if pool_mb == 0 else [(2, 5)])
    ghost = refs["ghost-b"]
    assert (ghost.complete, ghost.reason, ghost.missing) == (False, "prefix_unresolved", [(0, 8)])
    assert (ghost.prompt_routed_experts[:8] == -1).all()
    unresolved = 2 + (0 if pool_mb else W.prompts * W.samples - 1)
    assert _stat(c, "prefix_unresolved") == unresolved
