"""Fill mode (ROUTING_REPLAY_PREFIX_ROWS=fill) over many engine steps, through WorkerCapture's public constructor
(tests/standins.py run_engine, with the prefix store a fill engine has): requests opened with prefix-cache hits
get their prefix rows from the store, gathered once per batch, before their finish, before a weight reload
invalidates the store, and before a preempted request's blocks go."""

from __future__ import annotations

import numpy as np
import pytest

from tests.standins import run_engine, sched_out, watch_producer

LAYERS, TOP_K, PROMPT, HITS = 4, 2, 16, 32
FILL = dict(stamp=True, ring=True, churn=1, churn_prompt=12, churn_output=5, churn_hits=HITS)


@pytest.mark.parametrize("n", [32, 8])
def test_prefix_rows_of_requests_opened_with_hits_are_gathered_once_per_batch_and_before_their_finish(n):
    """Under churn each new request starts with 32 prefix-cache hits, whose rows the worker gathers from the prefix
    store. The gathers are one per 16 steps, not one per request (each is torch calls on the engine thread), and
    each request's rows arrive before its finish, exactly once. With 8 requests each lives 8 steps: its blocks
    are freed before its turn, so its finish gathers them."""
    steps = 75
    events, entries = [], []
    fills: list = []

    def attach(p):
        watch_producer(events, entries)(p)
        steps_ = p.publish_steps

        def publish_steps(ids, starts, counts, rows, **kw):
            for i, strict in enumerate(rows.strict):
                if not strict:                      # a gather of prefix rows
                    fills.append(list(zip(ids[i], np.asarray(starts[i]).tolist(), np.asarray(counts[i]).tolist())))
                    events.append(("fill", {k for k in ids[i]}))
            return steps_(ids, starts, counts, rows, **kw)
        p.publish_steps = publish_steps

    r = run_engine("fill", n, LAYERS, TOP_K, steps, prompt_len=PROMPT, on_producer=attach, **FILL)
    churned = steps - 1
    assert r["producer_drained"] and r["encode_errors"] == 0 and r["opened"] == n + churned
    assert r["prefix_rows"] == churned * HITS
    got: dict = {}
    for part in fills:
        for key, start, count in part:
            got.setdefault(key, []).append((start, count))
    gathered = sum(c for parts in got.values() for _, c in parts)
    queued_at_end = churned * HITS - gathered                  # opened in the last steps, still waiting
    assert all(sorted(v) == [(0, HITS)] for v in got.values()) and 0 <= queued_at_end < 16 * HITS
    if n == 32:                                                  # one gather per 16 steps at most (no finish
        assert len(fills) <= -(-steps // 16)                     # forced: each request lives 32 steps)
    seen_fill: set = set()
    for kind, what in events:
        if kind == "fill":
            seen_fill |= what
        elif kind == "finish" and what.startswith("cmpl-") and int(what.split("-")[1], 16) >= n:
            assert what in seen_fill, what                       # its prefix rows went before its finish


def test_a_weight_reload_gathers_the_queued_prefix_rows_before_the_store_is_invalidated():
    """Prefix rows wait up to 16 steps for their gather; a weight reload (rebind) invalidates the store. The rows
    of requests still queued then are gathered first, on the same stream, so a request in flight keeps the rows
    its KV came with: at the invalidation the queue is empty and the batch holds their gathers."""
    seen = {}

    def on_step(step, cap):
        if step != 20:
            return
        queued = {f.key for f in cap.prefix.queue}
        invalidate = cap.store.invalidate

        def watched():
            gathered = {k for part, strict, keys in zip(cap.batch.parts, cap.batch.strict, cap.batch.keys)
                        if not strict for k in keys}
            seen.update(queued=queued, left=len(cap.prefix.queue), gathered=gathered)
            invalidate()
        cap.store.invalidate = watched
        cap.prefix.invalidate()
        cap.store.invalidate = invalidate

    r = run_engine("fill", 32, LAYERS, TOP_K, 50, prompt_len=PROMPT, on_step=on_step, **FILL)
    assert r["producer_drained"] and r["encode_errors"] == 0
    assert seen["queued"] and seen["left"] == 0 and seen["queued"] <= seen["gathered"]


def test_a_preempted_requests_queued_prefix_rows_are_gathered_before_its_blocks_go():
    """A request preempted while its prefix rows wait in the fill queue gives its KV blocks back in that step: its
    rows are gathered in pre_step, before the step's forward can overwrite the blocks, and it leaves the queue;
    the other queued requests keep waiting for their turn."""
    seen = {}

    def on_step(step, cap):
        if step != 20:
            return
        queued = [f.rid for f in cap.prefix.queue]
        victim, key = queued[0], cap.prefix.queue[0].key
        gathered = []
        gather = cap.prefix.gather

        def watched(q, chunk, may_drop):
            gathered.append([f.key for f in q])
            return gather(q, chunk, may_drop)
        cap.prefix.gather = watched
        so = sched_out([], {}, 0)
        so.preempted_req_ids = {victim, "cmpl-not-captured"}
        cap.pre_step(so)
        del cap.prefix.gather
        seen.update(queued=len(queued), victim=victim, key=key, gathered=gathered,
                    left=[f.rid for f in cap.prefix.queue], rids=set(cap.prefix.rids))

    r = run_engine("fill", 32, LAYERS, TOP_K, 50, prompt_len=PROMPT, on_step=on_step, **FILL)
    assert r["producer_drained"] and r["encode_errors"] == 0
    assert seen["queued"] >= 2
    assert seen["gathered"] == [[seen["key"]]]                  # one gather, of the preempted request alone
    assert seen["victim"] not in seen["left"] and len(seen["left"]) == seen["queued"] - 1
    assert seen["rids"] == set(seen["left"])
