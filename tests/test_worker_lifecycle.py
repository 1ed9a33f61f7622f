"""Requests' opens and ends over many engine steps, through WorkerCapture's public constructor (tests/standins.py
run_engine, a real Producer whose calls are watched in order): under churn every finish follows its request's last
rows and every open comes before its first, finishes and opens ride with the batch's hand-over, a refused open
loses its request alone, and a bad scheduler note aborts only its request."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from routing_replay.engines.vllm_plugin import scheduler_hooks
from tests.standins import run_engine, watch_producer

N, LAYERS, TOP_K, STEPS, PROMPT = 8, 4, 2, 50, 16
CHURNED = STEPS - 1                                 # churn 1: a request finishes and one opens every step but the first


@pytest.mark.parametrize("churn", [1, 3])
@pytest.mark.parametrize("same_ids", [False, True])
def test_churn_finishes_wait_for_the_batch_that_holds_their_last_rows(same_ids, churn):
    """Requests finishing every step do not cut the 16-step batch short. A finish goes right after the batch that
    holds its request's last rows, so a finish still follows every row of its request; with ids reused at once
    (same_ids) the new request's open follows the old one's finish (with 3 per step, the first reused id of a
    step hands the batch over, the step's other opens and finishes come after it)."""
    churn_prompt = 12
    events: list = []
    r = run_engine("on", N, LAYERS, TOP_K, STEPS, stamp=True, ring=True, churn=churn, churn_prompt=churn_prompt,
                   churn_output=5, churn_same_ids=same_ids, on_producer=watch_producer(events))
    churned = CHURNED * churn
    assert r["producer_drained"] and r["encode_errors"] == 0
    assert (r["opened"], r["finished"]) == (N + churned, churned)
    assert r["rows"] == N * PROMPT + CHURNED * (N - churn + churn * churn_prompt)
    batches = [e for e in events if e[0] == "rows"]
    # full 16-step batches (the last one at the end); an id opened again while its finish waits for the batch
    # sends batch and finish first (same_ids: every step, once)
    assert len(batches) == (STEPS if same_ids else -(-STEPS // 16))
    assert [e[0] for e in events].count("finish") == churned
    open_keys = {}
    for i, (kind, what) in enumerate(events):
        if kind == "finish":
            # no later batch holds rows of the finished request (until its id opens again)
            later = events[i + 1:]
            reopen = next((j for j, e in enumerate(later) if e == ("open", what)), len(later))
            assert not any(k == "rows" and what in keys for k, keys in later[:reopen]), what
            assert open_keys.get(what) is not None                  # it was opened before
            open_keys[what] = None
        elif kind == "open":
            assert open_keys.get(what) is None                      # never opened twice without a finish between
            open_keys[what] = i
    assert sum(v is not None for v in open_keys.values()) == N      # the last N are still running at the end


def test_a_steps_finishes_go_in_one_call_when_no_batch_holds_rows():
    """A step's finishes that wait for no batch (the batch was just handed over) go to the producer together, in one
    end_many after the step's finish loop, not one call each; finishes that wait for the batch go with it."""
    churn = 4
    sizes: list = []

    def watch(p):
        ends = p.end_many

        def end_many(items, **kw):
            sizes.append(len(items))
            return ends(items, **kw)
        p.end_many = end_many

    r = run_engine("on", N, LAYERS, TOP_K, STEPS, stamp=True, ring=True, churn=churn, churn_prompt=3,
                   churn_output=5, on_producer=watch)
    churned = CHURNED * churn
    assert r["producer_drained"] and r["encode_errors"] == 0 and r["finished"] == churned
    assert sum(sizes) == churned
    # each call: one step's 4 finishes (the step after a hand-over), or those of the steps the batch held
    assert sizes and all(k % churn == 0 for k in sizes), sizes
    assert sizes.count(churn) >= STEPS // 16 - 1, sizes


@pytest.mark.parametrize("same_ids,prompt", [(False, 12), (True, 12), (False, 600), (True, 600)])
def test_churn_with_requests_not_captured_publishes_what_the_engine_thread_mapping_publishes(same_ids, prompt):
    """Under churn every step's batch changes, and with the step ring it goes to the producer raw: the producer's
    thread maps the engine ids to keys and leaves out the requests not captured (every 3rd new one here; with
    same_ids a captured and an uncaptured request take turns on one id). Exactly the same delta entries, in the
    same order, as the engine thread's own mapping (stamps without the ring), and no request's rows outside its
    open .. finish. With 600-token prefills every step after the first is larger than a ring slot: copied whole
    and handed over raw the same way (StepBatch.add_copied)."""
    runs = {}
    for ring in (True, False):
        events, entries = [], []
        r = run_engine("on", N, LAYERS, TOP_K, STEPS, stamp=True, ring=ring, churn=1, churn_prompt=prompt,
                       churn_output=5, churn_same_ids=same_ids, churn_optout=3,
                       on_producer=watch_producer(events, entries))
        assert r["producer_drained"] and r["encode_errors"] == 0
        runs[ring] = (r, events, entries)
    (r, events, entries), (r0, _, entries0) = runs[True], runs[False]
    big = prompt > 512
    assert r["active_steps"] == STEPS and r0["ring_steps"] == r0["copied_steps"] == 0
    assert (r["ring_steps"], r["copied_steps"]) == ((1, STEPS - 1) if big else (STEPS, 0))
    assert entries == entries0 and (r["opened"], r["finished"]) == (r0["opened"], r0["finished"])
    optout = sum(1 for serial in range(N + 1, N + CHURNED + 1) if serial % 3 == 0)     # as run_engine picks them
    assert r["opened"] == N + CHURNED - optout and (same_ids or len(entries) == len(set(entries)))
    live: set = set()
    for kind, what in events:
        if kind == "open":
            assert what not in live
            live.add(what)
        elif kind == "finish":
            live.remove(what)
        else:
            assert what <= live, what - live


@pytest.mark.parametrize("mode", ["on", "fill"])
def test_opens_go_to_the_producer_with_each_hand_over_not_every_step(mode):
    """Under churn a request opens every step. Its open waits for the next hand-over to the producer (the batch
    that holds its first rows, or a finish): one open_many per hand-over instead of one per step, every open still
    ahead of the batch that holds its rows. With a prefix store (fill) a step's opens still go in its pre_step,
    one call per step."""
    events: list = []
    calls: list = []

    def attach(p):
        watch_producer(events)(p)
        inner = p.open_many

        def open_many(items, **kw):
            calls.append(len(events))           # where in the event stream the call came
            return inner(items, **kw)
        p.open_many = open_many

    r = run_engine(mode, N, LAYERS, TOP_K, STEPS, stamp=True, ring=True, churn=1, churn_prompt=12, churn_output=5,
                   churn_hits=16 if mode == "fill" else 0, on_producer=attach)
    assert r["producer_drained"] and r["encode_errors"] == 0 and r["opened"] == N + CHURNED
    kinds = [k for k, _ in events]
    hand_overs = kinds.count("rows")
    assert kinds.count("open") == N + CHURNED
    if mode == "fill":                                       # every step opens: one call each
        assert len(calls) == STEPS
        return
    assert hand_overs == -(-STEPS // 16)                     # full 16-step batches, the last one at the end
    assert len(calls) == hand_overs
    for at in calls:                                         # each call's opens, then the batch with their rows
        opened = {what for kind, what in events[at:] if kind == "open"}
        nxt = next(i for i in range(at, len(events)) if events[i][0] != "open")
        assert events[nxt][0] == "rows" and {w for k, w in events[at:nxt]} <= events[nxt][1]
        assert opened


@pytest.mark.parametrize("ring", [True, False])
def test_an_open_refused_at_the_hand_over_loses_that_request_alone(ring):
    """An open reaches the producer after steps of its request went into the batch. When the producer refuses it,
    the request is not captured from then on (skipped=1): its rows already batched are left out (raw ring steps)
    or dropped by the producer as a refused id's parts, and every other request's delta entries are exactly those
    of the same run without the refusal."""
    runs = {}
    for refuse in (False, True):
        events, entries, failed = [], [], []

        def attach(p, refuse=refuse, events=events, entries=entries, failed=failed):
            watch_producer(events, entries)(p)
            inner = p.open_many
            calls = [0]

            def open_many(items, **kw):
                calls[0] += 1
                if refuse and calls[0] == 3:         # the third hand-over's first open (a request 8 steps old):
                    rid, prompt_len, _, *rest = items[0]        # more cached tokens than its prompt, which the
                    failed.append(rid)                          # producer refuses
                    items = [(rid, prompt_len, prompt_len + 1, *rest)] + list(items[1:])
                    refused = inner(items, **kw)
                    assert [i for i, _ in refused] == [0]
                    return refused
                return inner(items, **kw)
            p.open_many = open_many

        r = run_engine("on", N, LAYERS, TOP_K, STEPS, stamp=True, ring=ring, churn=1, churn_prompt=12,
                       churn_output=5, on_producer=attach)
        assert r["producer_drained"] and r["encode_errors"] == 0
        runs[refuse] = (r, entries, failed, r["worker"])
    (r0, entries0, _, cap0), (r, entries, failed, cap) = runs[False], runs[True]
    (key,) = failed
    assert (cap0.stats.skipped, cap.stats.skipped) == (0, 1) and r["opened"] == r0["opened"] - 1
    mine = [e for e in entries if e[0] == key]
    assert [e for e in entries if e[0] != key] == [e for e in entries0 if e[0] != key]
    assert any(e[0] == key for e in entries0)                # it had rows in the run without the refusal
    # what the batches still held of it is dropped by the producer (and its finish: the scheduler's note came
    # before the refusal); nothing of it is left in the worker's tables
    assert cap.producer.stats.dropped_parts == len(mine) + 1 and cap0.producer.stats.dropped_parts == 0
    assert key not in cap.tracked.values() and all(v[0] != key for v in cap.requests.seen.values())


def test_a_request_that_ends_before_any_hand_over_is_opened_first():
    """An open waits for the next hand-over; a finish or abort of its request that goes out before one (an ended
    request with no rows batched; a finish whose note could not be read, sent as an abort) sends the waiting
    opens first, so the consumer never sees an end before its open."""
    events: list = []
    sp = SimpleNamespace(extra_args={"return_routed_experts": True})

    def new(rid):
        return SimpleNamespace(req_id=rid, sampling_params=sp, prompt_token_ids=[1, 2, 3], prompt_embeds=None,
                               num_computed_tokens=0, block_ids=([0],))

    def on_step(step, cap):
        if step != 5:
            return
        for rid, info in (("late-a", SimpleNamespace(num_output_tokens=2, reason="stop", output_token_ids=[7, 8])),
                          ("late-b", object())):    # a note without its fields: end_of raises, the end is an abort
            requests = cap.requests
            requests.open(new(rid), cap.forwards + 1, False)
            key = cap.tracked.pop(rid)
            requests.close_request(rid, key, info)
            requests.send_ends()

    def attach(p):
        watch_producer(events)(p)
        abort = p.abort

        def watched_abort(rid, *a, **kw):
            events.append(("abort", rid))
            return abort(rid, *a, **kw)
        p.abort = watched_abort

    r = run_engine("on", N, LAYERS, TOP_K, STEPS, stamp=True, ring=True, on_producer=attach, on_step=on_step)
    assert r["producer_drained"] and r["encode_errors"] == 0
    mine = [e for e in events if e[1] in ("late-a", "late-b")]
    assert mine == [("open", "late-a"), ("finish", "late-a"), ("open", "late-b"), ("abort", "late-b")]


def test_finishes_that_wait_for_a_batch_go_out_with_their_notes_and_a_bad_note_aborts_only_its_request():
    """Finishes that pre_step keeps for the next hand-over (a batch holds rows) become end items in one pass at
    flush: each as its note says (a finish; an abort before any output stays an abort). A note without its
    fields aborts its own request (capture_error), and every other finish of that hand-over still goes out."""
    events: list = []
    items: list = []

    def attach(p):
        watch_producer(events)(p)
        ends, abort = p.end_many, p.abort

        def end_many(its, **kw):
            items.extend(its)
            return ends(its, **kw)

        def watched_abort(rid, *a, **kw):
            events.append(("capture-abort", rid))
            return abort(rid, *a, **kw)
        p.end_many, p.abort = end_many, watched_abort

    picked: dict = {}

    def on_step(step, cap):
        if step not in (5, 9):
            return
        ids = sorted(cap.tracked)[:3]
        notes = {ids[0]: scheduler_hooks.Finished(2, "stop", [7, 8]), ids[1]: scheduler_hooks.Finished(0, "abort", []),
                 ids[2]: scheduler_hooks.Finished(1, "length", [9])}
        if step == 9:
            notes[ids[1]] = object()                # a note without its fields
        picked[step] = [cap.tracked[r] for r in ids]
        assert cap.batch.parts                      # the finishes wait for the batch's hand-over
        # a step that runs no forward (nothing scheduled): its finishes wait for the batch, which pre_step hands
        # over since no captured request runs, then they go
        so = SimpleNamespace(scheduled_new_reqs=[], num_scheduled_tokens={}, total_num_scheduled_tokens=0,
                             finished_req_ids=set(ids), preempted_req_ids=set(), scheduled_spec_decode_tokens={})
        setattr(so, scheduler_hooks.ATTR, notes)
        sent = len(items)
        cap.pre_step(so)
        cap.post_step(so)
        assert not cap.requests.closing and not cap.requests.ends and not cap.batch.parts
        assert not set(ids) & set(cap.tracked)
        assert len(items) - sent == (3 if step == 5 else 2)

    r = run_engine("on", N, LAYERS, TOP_K, STEPS, stamp=True, ring=True, on_producer=attach, on_step=on_step)
    assert r["producer_drained"] and r["encode_errors"] == 0
    a, b, c = picked[5]
    first = [it for it in items if it[1] in (a, b, c)]
    assert sorted(first, key=lambda it: it[1]) == sorted([("finish", a, 2, "stop", [7, 8]),
                                                          ("abort", b, 0, "abort", None),
                                                          ("finish", c, 1, "length", [9])], key=lambda it: it[1])
    a, b, c = picked[9]
    second = [it for it in items if it[1] in (a, b, c)]
    assert sorted(second, key=lambda it: it[1]) == sorted([("finish", a, 2, "stop", [7, 8]),
                                                           ("finish", c, 1, "length", [9])], key=lambda it: it[1])
    assert ("capture-abort", b) in events and ("finish", b) not in events
