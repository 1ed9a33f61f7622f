"""bench/worker_step_probe.py drives the worker's real pre_step/post_step without vLLM: a short CPU run of each mode
hands over exactly the rows of the steps it ran (or none, opted out) and the producer's thread takes every delta."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.procs import load_script

pytestmark = pytest.mark.bench     # runs a bench/ script: `-m "not bench"` selects the specification tests

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "worker_step_probe.py"


def _probe():
    return load_script(SCRIPT, "worker_step_probe")


@pytest.mark.parametrize("mode", ["on", "optout", "optout-fill"])
def test_probe_runs_the_worker_and_counts_exactly(mode):
    n, steps, prompt_len = 8, 40, 16
    r = _probe().run(mode, n, 4, 2, steps, 1, "cpu", eager=False, worker_timing=True, prompt_len=prompt_len)
    warm = steps // 4                                               # the probe's untimed warm-up steps
    assert r["steps"] == steps and r["producer_drained"]
    if mode == "on":
        assert (r["active_steps"], r["rows"]) == (steps + warm, n * prompt_len + n * (steps + warm - 1))
    else:
        assert (r["active_steps"], r["rows"]) == (0, 0)
    # timed sections: pre_step always; post_step only where it has work (publishing rows; with a store under
    # CUDA graphs and nothing to gather it only checks that the forward ended the step)
    assert r["sections_per_step"] == {"on": 2, "optout": 1, "optout-fill": 1}[mode]
    assert r["calls_us"] > 0 and r["calls_wall_us"] > 0 and 0 < r["clocks_us"] < r["pre_post_us"]

def test_eager_probe_runs_the_real_router_hooks_and_times_them_apart():
    """--eager (the CPU build, enforce_eager): the routers call the worker's real capture hooks every step, which
    count the layers that covered the step (a step short of one would raise LostHookError in post_step); their
    time is reported apart from pre_step/post_step's."""
    n, steps, prompt_len = 8, 40, 16
    r = _probe().run("on", n, 4, 2, steps, 1, "cpu", eager=True, prompt_len=prompt_len)
    warm = steps // 4
    assert not r["graph_mode"] and r["producer_drained"] and r["encode_errors"] == 0
    assert (r["active_steps"], r["rows"]) == (steps + warm, n * prompt_len + n * (steps + warm - 1))
    assert r["hooks_us"] > 0 and r["plugin_us"] == pytest.approx(r["calls_us"] + r["hooks_us"], abs=0.02)


def test_probe_with_step_stamps_checks_every_step_and_launches_no_fill():
    """Graph mode with step stamps (ROUTING_REPLAY_STEP_STAMP=on): no -1 fill, and the producer's thread checked the
    stamp of every step it published (a stale one would have stopped it)."""
    n, steps, prompt_len = 8, 40, 16
    r = _probe().run("on", n, 4, 2, steps, 1, "cpu", eager=False, prompt_len=prompt_len, pieces=True, stamp=True)
    warm = steps // 4
    assert r["step_stamp"] and r["producer_drained"]
    assert r["active_steps"] == steps + warm and r["stamps_checked"] == steps + warm
    assert r["pieces_wall_us"]["fill_step"] == 0 and r["pieces_wall_us"]["copier_submit"] > 0
    plain = _probe().run("on", n, 4, 2, steps, 1, "cpu", eager=False, prompt_len=prompt_len, pieces=True)
    assert not plain["step_stamp"] and plain["stamps_checked"] == 0 and plain["pieces_wall_us"]["fill_step"] > 0


@pytest.mark.parametrize("eager", [False, True])
def test_steps_where_nothing_is_captured_still_count_their_forwards_and_leave_the_hooks_as_the_mode_wants(eager):
    """An opted-out engine's steps take pre_step's short path (nothing tracked, none opening, no prefix store): each
    still counts its forward (step stamps and the step ring predict a step's stamp and slot from that count), the
    worker stays inactive, and the router hooks run only where they are replayed from graphs (not eager)."""
    n, steps = 8, 40
    seen = []
    r = _probe().run("optout", n, 4, 2, steps, 1, "cpu", eager=eager, prompt_len=16, stamp=True, ring=True,
                     on_step=lambda step, cap: seen.append((cap.forwards, cap.active, cap.storing,
                                                            cap.binding.active, cap.stats.steps,
                                                            sum(t is not None for t in getattr(cap.binding, "held", ())))))
    total = steps + steps // 4
    assert [s[0] for s in seen] == list(range(1, total + 1))          # one forward per step, none missed
    assert [s[4] for s in seen] == list(range(1, total + 1))
    # eager: every layer's hook but the last is C (it stores whether or not the step is captured); post_step lets
    # go of what it kept, so no router tensor outlives a step that is not captured
    assert {s[1:4] + s[5:] for s in seen} == {(False, False, not eager, 0)}
    assert (r["active_steps"], r["rows"], r["opened"]) == (0, 0, 0)


def _watch(events: list, entries: list | None = None):
    """on_producer for run(): the worker's calls into its real producer, in order (each call goes on to it); the
    delta entries (key, start, count) in `entries`. Steps added raw are resolved as the producer's thread will
    (their table only gains ids no step of theirs holds before that thread reads them)."""
    from routing_replay.engines.vllm_plugin.step_batch import host_layouts, resolve_raw_steps

    def attach(p):
        steps, ends, opens = p.publish_steps, p.end_many, p.open_many

        def publish_steps(ids, starts, counts, rows, **kw):
            keys, st, cn = ids, starts, counts
            if getattr(rows, "deferred", False):
                st, cn = host_layouts(rows._parts, rows._raw, starts, counts)
                keys, st, cn, _, _ = resolve_raw_steps(rows._raw, rows._table, rows._forwards, ids, st, cn,
                                                      rows._gone)
            events.append(("rows", {k for step in keys for k in step}))
            if entries is not None:
                for k, a, c in zip(keys, st, cn):
                    entries.extend(zip(k, np.asarray(a).tolist(), np.asarray(c).tolist()))
            return steps(ids, starts, counts, rows, **kw)

        def end_many(items, **kw):
            events.extend((kind, key) for kind, key, *_ in items)
            return ends(items, **kw)

        def open_many(items, **kw):
            events.extend(("open", item[0]) for item in items)
            return opens(items, **kw)
        p.publish_steps, p.end_many, p.open_many = publish_steps, end_many, open_many
    return attach


@pytest.mark.parametrize("churn", [0, 1])
def test_quiet_steps_are_the_timed_steps_that_open_finish_and_preempt_nothing(churn):
    """WorkerStats.quiet_*: the bench's figure for one step of a running batch. Without churn every step but the
    first (the opens) is quiet, both of its sections timed; with a request finishing and one starting every step
    none is; without timing nothing is counted."""
    n, steps = 8, 40
    kw = dict(prompt_len=16, stamp=True, ring=True, churn=churn, churn_prompt=12, churn_output=5)
    r = _probe().run("on", n, 4, 2, steps, 1, "cpu", eager=False, worker_timing=True, **kw)
    total = steps + steps // 4                                      # the probe's warm-up steps count here too
    assert (r["quiet_steps"], r["quiet_sections"]) == ((total - 1, 2 * (total - 1)) if churn == 0 else (0, 0))
    assert churn or r["quiet_net_wall_us"] > 0
    untimed = _probe().run("on", n, 4, 2, steps, 1, "cpu", eager=False, worker_timing=False, **kw)
    assert "quiet_steps" not in untimed


@pytest.mark.parametrize("churn", [1, 3])
@pytest.mark.parametrize("same_ids", [False, True])
def test_churn_finishes_wait_for_the_batch_that_holds_their_last_rows(same_ids, churn):
    """--churn: requests finishing every step no longer cut the 16-step batch short. A finish goes right after
    the batch that holds its request's last rows, so a finish still follows every row of its request; with ids
    reused at once (same_ids) the new request's open follows the old one's finish (with 3 per step, the first
    reused id of a step hands the batch over, the step's other opens and finishes come after it)."""
    n, steps, prompt_len, churn_prompt = 8, 40, 16, 12
    events: list = []
    r = _probe().run("on", n, 4, 2, steps, 1, "cpu", eager=False, prompt_len=prompt_len, stamp=True, ring=True,
                     churn=churn, churn_prompt=churn_prompt, churn_output=5, churn_same_ids=same_ids,
                     on_producer=_watch(events))
    warm = steps // 4
    churned = (steps + warm - 1) * churn                            # every step after the first
    assert r["producer_drained"] and r["encode_errors"] == 0
    assert (r["opened"], r["finished"]) == (n + churned, churned)
    assert r["rows"] == n * prompt_len + (steps + warm - 1) * (n - churn + churn * churn_prompt)
    batches = [e for e in events if e[0] == "rows"]
    # full 16-step batches (the last one at the end); an id opened again while its finish waits for the batch
    # sends batch and finish first (same_ids: every step, once)
    assert len(batches) == (steps + warm if same_ids else -(-(steps + warm) // 16))
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
    assert sum(v is not None for v in open_keys.values()) == n      # the last n are still running at the end


def test_a_steps_finishes_go_in_one_call_when_no_batch_holds_rows():
    """A step's finishes that wait for no batch (the batch was just handed over) go to the producer together, in one
    end_many after the step's finish loop, not one call each (the old code flushed before each of them, which sent
    the one before: 4 calls of one finish in such a step here); finishes that wait for the batch go with it."""
    n, steps, churn = 8, 40, 4
    sizes: list = []

    def watch(p):
        ends = p.end_many

        def end_many(items, **kw):
            sizes.append(len(items))
            return ends(items, **kw)
        p.end_many = end_many

    r = _probe().run("on", n, 4, 2, steps, 1, "cpu", eager=False, prompt_len=16, stamp=True, ring=True,
                     churn=churn, churn_prompt=3, churn_output=5, on_producer=watch)
    churned = (steps + steps // 4 - 1) * churn
    assert r["producer_drained"] and r["encode_errors"] == 0 and r["finished"] == churned
    assert sum(sizes) == churned
    # each call: one step's 4 finishes (the step after a hand-over), or those of the steps the batch held
    assert sizes and all(k % churn == 0 for k in sizes), sizes
    assert sizes.count(churn) >= (steps + steps // 4) // 16 - 1, sizes


@pytest.mark.parametrize("same_ids,prompt", [(False, 12), (True, 12), (False, 600), (True, 600)])
def test_churn_with_requests_not_captured_publishes_what_the_engine_thread_mapping_publishes(same_ids, prompt):
    """Under churn every step's batch changes, and with the step ring it goes to the producer raw: the producer's
    thread maps the engine ids to keys and leaves out the requests not captured (every 3rd new one here; with
    same_ids a captured and an uncaptured request take turns on one id). Exactly the same delta entries, in the
    same order, as the engine thread's own mapping (stamps without the ring), and no request's rows outside its
    open .. finish. With 600-token prefills every step after the first is larger than a ring slot: copied whole
    and handed over raw the same way (StepBatch.add_copied)."""
    n, steps, prompt_len = 8, 40, 16
    runs = {}
    for ring in (True, False):
        events, entries = [], []
        r = _probe().run("on", n, 4, 2, steps, 1, "cpu", eager=False, prompt_len=prompt_len, stamp=True, ring=ring,
                         churn=1, churn_prompt=prompt, churn_output=5, churn_same_ids=same_ids, churn_optout=3,
                         on_producer=_watch(events, entries))
        assert r["producer_drained"] and r["encode_errors"] == 0
        runs[ring] = (r, events, entries)
    (r, events, entries), (r0, _, entries0) = runs[True], runs[False]
    warm = steps // 4
    big = prompt > 512
    assert r["active_steps"] == steps + warm and r0["ring_steps"] == r0["copied_steps"] == 0
    assert (r["ring_steps"], r["copied_steps"]) == ((1, steps + warm - 1) if big else (steps + warm, 0))
    assert entries == entries0 and (r["opened"], r["finished"]) == (r0["opened"], r0["finished"])
    churned = steps + warm - 1
    optout = sum(1 for serial in range(n + 1, n + churned + 1) if serial % 3 == 0)     # as the probe picks them
    assert r["opened"] == n + churned - optout and (same_ids or len(entries) == len(set(entries)))
    live: set = set()
    for kind, what in events:
        if kind == "open":
            assert what not in live
            live.add(what)
        elif kind == "finish":
            live.remove(what)
        else:
            assert what <= live, what - live


@pytest.mark.parametrize("n", [32, 8])
def test_prefix_rows_of_requests_opened_with_hits_are_gathered_once_per_batch_and_before_their_finish(n):
    """Fill mode (ROUTING_REPLAY_PREFIX_ROWS=fill) under churn: each new request starts with 32 prefix-cache hits,
    whose rows the worker gathers from the prefix store. The gathers are one per 16 steps, not one per request
    (each is torch calls on the engine thread), and each request's rows arrive before its finish, exactly once.
    With 8 requests each lives 8 steps: its blocks are freed before its turn, so its finish gathers them."""
    steps, hits = 60, 32
    events, entries = [], []
    fills: list = []

    def attach(p):
        _watch(events, entries)(p)
        steps_ = p.publish_steps

        def publish_steps(ids, starts, counts, rows, **kw):
            for i, strict in enumerate(rows._strict):
                if not strict:                      # a gather of prefix rows
                    fills.append(list(zip(ids[i], np.asarray(starts[i]).tolist(), np.asarray(counts[i]).tolist())))
                    events.append(("fill", {k for k in ids[i]}))
            return steps_(ids, starts, counts, rows, **kw)
        p.publish_steps = publish_steps

    r = _probe().run("fill", n, 4, 2, steps, 1, "cpu", eager=False, prompt_len=16, stamp=True, ring=True, churn=1,
                     churn_prompt=12, churn_output=5, churn_hits=hits, on_producer=attach)
    warm = steps // 4
    churned = steps + warm - 1
    assert r["producer_drained"] and r["encode_errors"] == 0 and r["opened"] == n + churned
    assert r["prefix_rows"] == churned * hits
    got: dict = {}
    for part in fills:
        for key, start, count in part:
            got.setdefault(key, []).append((start, count))
    gathered = sum(c for parts in got.values() for _, c in parts)
    queued_at_end = churned * hits - gathered                  # opened in the last steps, still waiting
    assert all(sorted(v) == [(0, hits)] for v in got.values()) and 0 <= queued_at_end < 16 * hits
    if n == 32:                                                  # one gather per 16 steps at most (no finish
        assert len(fills) <= -(-(steps + warm) // 16)            # forced: each request lives 32 steps)
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

    r = _probe().run("fill", 32, 4, 2, 40, 1, "cpu", eager=False, prompt_len=16, stamp=True, ring=True, churn=1,
                     churn_prompt=12, churn_output=5, churn_hits=32, on_step=on_step)
    assert r["producer_drained"] and r["encode_errors"] == 0
    assert seen["queued"] and seen["left"] == 0 and seen["queued"] <= seen["gathered"]


def test_a_preempted_requests_queued_prefix_rows_are_gathered_before_its_blocks_go():
    """A request preempted while its prefix rows wait in the fill queue gives its KV blocks back in that step: its
    rows are gathered in pre_step, before the step's forward can overwrite the blocks, and it leaves the queue;
    the other queued requests keep waiting for their turn."""
    seen = {}
    probe = _probe()

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
        so = probe._so([], {}, 0)
        so.preempted_req_ids = {victim, "cmpl-not-captured"}
        cap.pre_step(so)
        del cap.prefix.gather
        seen.update(queued=len(queued), victim=victim, key=key, gathered=gathered,
                    left=[f.rid for f in cap.prefix.queue], rids=set(cap.prefix.rids))

    r = probe.run("fill", 32, 4, 2, 40, 1, "cpu", eager=False, prompt_len=16, stamp=True, ring=True, churn=1,
                  churn_prompt=12, churn_output=5, churn_hits=32, on_step=on_step)
    assert r["producer_drained"] and r["encode_errors"] == 0
    assert seen["queued"] >= 2
    assert seen["gathered"] == [[seen["key"]]]                  # one gather, of the preempted request alone
    assert seen["victim"] not in seen["left"] and len(seen["left"]) == seen["queued"] - 1
    assert seen["rids"] == set(seen["left"])


def test_help():
    p = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "--evict-mib" in p.stdout and "--worker-timing" in p.stdout


def test_a_ring_run_of_steps_faster_than_the_producers_thread_waits_for_it_and_loses_no_rows():
    """The probe's steps take microseconds (an engine's take milliseconds): without waiting, the engine thread ran a
    whole step ring ahead of the producer's thread, whose reads of reused slots were then lost (encode errors), and
    the run exited 1. The probe now waits, untimed, while more than one batch queues."""
    n, layers, steps = 256, 16, 400
    r = _probe().run("on", n, layers, 8, steps, 0, "cpu", eager=False, prompt_len=1, stamp=True, ring=True)
    warm = min(100, steps // 4)
    assert r["step_ring"] and r["producer_drained"] and r["encode_errors"] == 0
    assert r["ring_steps"] == r["active_steps"] == steps + warm and r["rows"] == n * (steps + warm)


@pytest.mark.parametrize("mode", ["on", "fill"])
def test_opens_go_to_the_producer_with_each_hand_over_not_every_step(mode):
    """Under churn a request opens every step. Its open waits for the next hand-over to the producer (the batch
    that holds its first rows, or a finish): one open_many per hand-over instead of one per step (each call cost
    15-30 us of engine-thread CPU in the probe), every open still ahead of the batch that holds its rows. With a
    prefix store (fill) a step's opens still go in its pre_step, one call per step (measured slower otherwise)."""
    n, steps = 8, 40
    events: list = []
    calls: list = []

    def attach(p):
        _watch(events)(p)
        inner = p.open_many

        def open_many(items, **kw):
            calls.append(len(events))           # where in the event stream the call came
            return inner(items, **kw)
        p.open_many = open_many

    r = _probe().run(mode, n, 4, 2, steps, 1, "cpu", eager=False, prompt_len=16, stamp=True, ring=True, churn=1,
                     churn_prompt=12, churn_output=5, churn_hits=16 if mode == "fill" else 0, on_producer=attach)
    warm = steps // 4
    churned = steps + warm - 1
    assert r["producer_drained"] and r["encode_errors"] == 0 and r["opened"] == n + churned
    kinds = [k for k, _ in events]
    hand_overs = kinds.count("rows")
    assert kinds.count("open") == n + churned
    if mode == "fill":                                       # every step opens: one call each
        assert len(calls) == steps + warm
        return
    assert hand_overs == -(-(steps + warm) // 16)           # full 16-step batches, the last one at the end
    assert len(calls) == hand_overs
    for at in calls:                                         # each call's opens, then the batch with their rows
        opened = {what for kind, what in events[at:] if kind == "open"}
        nxt = next(i for i in range(at, len(events)) if events[i][0] != "open")
        assert events[nxt][0] == "rows" and {w for k, w in events[at:nxt]} <= events[nxt][1]
        assert opened


@pytest.mark.parametrize("ring", [True, False])
def test_an_open_refused_at_the_hand_over_loses_that_request_alone(ring):
    """An open now reaches the producer after steps of its request went into the batch. When the producer refuses
    it, the request is not captured from then on (skipped=1): its rows already batched are left out (raw ring
    steps) or dropped by the producer as a refused id's parts, and every other request's delta entries are exactly
    those of the same run without the refusal."""
    n, steps = 8, 40
    runs = {}
    for refuse in (False, True):
        events, entries, failed, caps = [], [], [], []

        def attach(p, refuse=refuse, events=events, entries=entries, failed=failed):
            _watch(events, entries)(p)
            inner = p.open_many
            calls = [0]

            def open_many(items, **kw):
                calls[0] += 1
                if refuse and calls[0] == 3:         # the third hand-over's first open (a request 8 steps old)
                    failed.append(items[0][0])
                    p._book.refuse(items[0][0])
                    return [(0, ValueError("refused"))] + [(i + 1, e) for i, e in inner(items[1:], **kw)]
                return inner(items, **kw)
            p.open_many = open_many

        r = _probe().run("on", n, 4, 2, steps, 1, "cpu", eager=False, prompt_len=16, stamp=True, ring=ring, churn=1,
                         churn_prompt=12, churn_output=5, on_producer=attach,
                         on_step=lambda step, cap, caps=caps: caps.append(cap) if not caps else None)
        assert r["producer_drained"] and r["encode_errors"] == 0
        runs[refuse] = (r, entries, failed, caps[0])
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


def test_keys_refused_at_a_hand_over_leave_the_steps_not_added_raw_too():
    """resolve_raw_steps(gone=...): a batch with raw steps is resolved on the producer's thread, after the finish
    of a request whose open was refused may have taken the refusal back; so the steps added with their keys (an
    unchanged batch, prefix rows) leave that key's entries and rows out there, exactly, like a raw step whose
    table no longer holds the id."""
    from routing_replay.engines.vllm_plugin.step_batch import resolve_raw_steps
    table = {"e1": ("a", 0), "e2": ("b", 0), "e3": ("c", 0)}          # "b" is gone: no longer in the table
    del table["e2"]
    ids = [["e1", "e2", "e3"], ["a", "b", "c"], ["b"], ["a", "c"]]
    starts = [np.array([5, 9, 2]), np.array([6, 10, 3]), [0], np.array([7, 4])]
    counts = [np.array([0, 1, 3, 4]), np.array([1, 2, 1]), [4], np.array([1, 1])]      # step 0: query start locs
    keys, st, cn, select, cut = resolve_raw_steps([0], table, [0, 0, 0, 0], ids, starts, counts, {"b"})
    assert keys == [["a", "c"], ["a", "c"], [], ["a", "c"]]
    assert [np.asarray(x).tolist() for x in st] == [[5, 2], [6, 3], [], [7, 4]]
    assert [np.asarray(x).tolist() for x in cn] == [[1, 1], [1, 1], [], [1, 1]]
    assert [None if k is None else k.tolist() for k in select] == [[0, 3], [0, 3], [], None]
    assert cut == 2 + 2 + 4
    same = resolve_raw_steps([0], table, [0, 0, 0, 0], ids, starts, counts)   # without gone: only the raw step
    assert same[0][1:] == [["a", "b", "c"], ["b"], ["a", "c"]] and same[3][1:] == [None, None, None]


def test_a_request_that_ends_before_any_hand_over_is_opened_first():
    """An open waits for the next hand-over; a finish or abort of its request that goes out before one (an ended
    request with no rows batched; a finish whose note could not be read, sent as an abort) sends the waiting
    opens first, so the consumer never sees an end before its open."""
    from types import SimpleNamespace
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
        _watch(events)(p)
        abort = p.abort

        def watched_abort(rid, *a, **kw):
            events.append(("abort", rid))
            return abort(rid, *a, **kw)
        p.abort = watched_abort

    r = _probe().run("on", 8, 4, 2, 40, 1, "cpu", eager=False, prompt_len=16, stamp=True, ring=True,
                     on_producer=attach, on_step=on_step)
    assert r["producer_drained"] and r["encode_errors"] == 0
    mine = [e for e in events if e[1] in ("late-a", "late-b")]
    assert mine == [("open", "late-a"), ("finish", "late-a"), ("open", "late-b"), ("abort", "late-b")]


def test_a_step_of_the_running_batch_lets_go_of_tensors_a_failed_forward_left():
    """Eager: a forward that raised before post_step leaves tensors in the hooks' list; the next captured step's
    pre_step lets go of them, so a layer whose hook then does not run is refused (LostHookError) instead of
    publishing the earlier forward's routing (a step of the running batch: the left tensor has its shape)."""
    import torch

    from routing_replay.engines.vllm_plugin.stamps import LostHookError

    stale = torch.zeros(8, 2, dtype=torch.int32)
    bad = 12

    def leave_stale(step, cap):
        if step == bad - 1:             # the forward after this post_step raised midway: its tensor stays
            cap.binding.held[0] = stale

    def forward(step, hooks, topk_ids):
        for i, hook in enumerate(hooks):
            if not (step == bad and i == 0):       # step `bad`: layer 0's hook is lost
                hook(topk_ids)

    with pytest.raises(LostHookError, match="3 of 4 MoE layers"):
        _probe().run("on", 8, 4, 2, 40, 1, "cpu", eager=True, prompt_len=16, on_step=leave_stale, forward=forward)
    seen = []                           # the same run without the lost hook publishes every step
    r = _probe().run("on", 8, 4, 2, 40, 1, "cpu", eager=True, prompt_len=16,
                     on_step=lambda step, cap: seen.append(cap.binding.held.count(None)),
                     forward=lambda step, hooks, t: [h(t) for h in hooks])
    assert r["active_steps"] == 50 and seen == [4] * 50


@pytest.mark.parametrize("bad_kind", ["short", "float"])
def test_an_eager_step_whose_layer_handed_over_another_shape_or_dtype_is_refused_by_the_producer(bad_kind):
    """Eager CPU (C hooks for every layer): post_step hands a step's tensors over without reading their shapes; a
    layer whose tensor has one row too few, or float ids, is refused on the producer's thread (HostRows' check): the
    delta that holds the step is not sent (encode_errors 1, the records list its positions as lost) and every other
    delta goes out; the engine thread raises nothing. A layer whose hook did not run is still refused on the engine
    thread (test_a_step_of_the_running_batch_lets_go_of_tensors_a_failed_forward_left)."""
    bad = 12
    deltas: list = []

    def forward(step, hooks, t):
        for i, hook in enumerate(hooks):
            if step == bad and i == 2:
                hook(t[:-1] if bad_kind == "short" else t.float())
            else:
                hook(t)

    def watch(p):
        publish = p.publish_steps

        def publish_steps(ids, *a, **kw):
            deltas.append(len(ids))
            return publish(ids, *a, **kw)
        p.publish_steps = publish_steps

    r = _probe().run("on", 8, 4, 2, 40, 1, "cpu", eager=True, prompt_len=16, forward=forward, on_producer=watch)
    assert r["encode_errors"] == 1 and r["active_steps"] == 50 and r["rows"] == 8 * 16 + 49 * 8
    ok = _probe().run("on", 8, 4, 2, 40, 1, "cpu", eager=True, prompt_len=16, forward=lambda s, hooks, t: [
        h(t) for h in hooks])
    assert ok["encode_errors"] == 0 and ok["rows"] == r["rows"]
    assert sum(deltas) == 50 and len(deltas) == 4          # 16 steps per delta: the bad step's delta is one of them


def test_finishes_that_wait_for_a_batch_go_out_with_their_notes_and_a_bad_note_aborts_only_its_request():
    """Finishes that pre_step keeps for the next hand-over (a batch holds rows) become end items in one pass at
    flush: each as its note says (a finish; an abort before any output stays an abort). A note without its
    fields aborts its own request (capture_error), and every other finish of that hand-over still goes out."""
    from types import SimpleNamespace

    from routing_replay.engines.vllm_plugin import scheduler_hooks

    events: list = []
    items: list = []

    def attach(p):
        _watch(events)(p)
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
        assert not cap.requests.closing and not cap.requests.ends and not cap.batch.parts and not set(ids) & set(cap.tracked)
        assert len(items) - sent == (3 if step == 5 else 2)

    r = _probe().run("on", 8, 4, 2, 40, 1, "cpu", eager=False, prompt_len=16, stamp=True, ring=True,
                     on_producer=attach, on_step=on_step)
    assert r["producer_drained"] and r["encode_errors"] == 0
    a, b, c = picked[5]
    first = [it for it in items if it[1] in (a, b, c)]
    assert sorted(first, key=lambda it: it[1]) == sorted([("finish", a, 2, "stop", [7, 8]), ("abort", b, 0, "abort", None),
                                                          ("finish", c, 1, "length", [9])], key=lambda it: it[1])
    a, b, c = picked[9]
    second = [it for it in items if it[1] in (a, b, c)]
    assert sorted(second, key=lambda it: it[1]) == sorted([("finish", a, 2, "stop", [7, 8]),
                                                           ("finish", c, 1, "length", [9])], key=lambda it: it[1])
    assert ("capture-abort", b) in events and ("finish", b) not in events


def test_steps_of_the_running_batch_on_the_ring_publish_what_the_engine_thread_mapping_publishes():
    """A graph engine's step of the running batch after a ring step takes pre_step's first branch and post_step's
    ring path in one frame (RingPath.ring_step). Steps that change the batch without opening or finishing anything take
    it too: the runner reorders its batch, leaves requests out of a step, schedules only requests that are not
    captured (no captured request runs: the general path), or a chunk larger than a ring slot (the copier). Each
    gives exactly the delta entries of the engine thread's own mapping (stamps without the ring), in order, and
    every ring read's stamp checks."""
    n, steps, prompt_len, out = 8, 60, 16, frozenset({1, 5})

    def layout(step, ids):
        if step % 11 == 6:
            return [(ids[i], 1) for i in sorted(out)]                # nothing captured runs
        if step == 20:
            return [(r, 600 if i == 2 else 1) for i, r in enumerate(ids)]    # larger than a 512-row slot
        if step % 7 == 3:
            return [(r, 1) for r in ids[1::-1] + ids[2:]]           # the first two swapped
        if step % 7 == 5:
            return [(r, 1) for r in ids[::2]]                       # half the batch left out
        return [(r, 1) for r in ids]

    runs = {}
    for ring in (True, False):
        entries, steady = [], []
        r = _probe().run("on", n, 4, 2, steps, 1, "cpu", eager=False, prompt_len=prompt_len, stamp=True, ring=ring,
                         layout=layout, optout_first=out, on_producer=_watch([], entries),
                         on_step=lambda step, cap: steady.append(cap.steady))
        assert r["producer_drained"] and r["encode_errors"] == 0
        runs[ring] = (r, entries, steady)
    (r, entries, steady), (r0, entries0, steady0) = runs[True], runs[False]
    total = steps + steps // 4
    idle = sum(1 for s in range(1, total) if s % 11 == 6)
    assert r["active_steps"] == r0["active_steps"] == total - idle
    assert r["ring_steps"] == total - idle - 1 and r0["ring_steps"] == 0 and r["stamps_checked"] == total - idle
    assert (r["copied_steps"], r0["copied_steps"]) == (1, 0)        # the chunk larger than a slot: copied whole
    ids = [f"cmpl-{i:08x}-0-{i:04d}" for i in range(n)]                 # (the probe's)
    captured = [r for i, r in enumerate(ids) if i not in out]
    want = len(captured) + sum(len([r for r, _ in layout(s, ids) if r in captured]) for s in range(1, total))
    assert entries == entries0 and len(entries) == want
    # every request's rows, in order, with nothing of the two not captured
    keys = {k for k, _, _ in entries}
    assert len(keys) == n - len(out)
    for k in keys:
        mine = [(a, c) for key, a, c in entries if key == k]
        assert [a for a, _ in mine] == list(np.cumsum([0] + [c for _, c in mine[:-1]]))
    # the fast path ran: every step after a ring step left the worker steady, the one larger than a slot too (it
    # goes raw, copied whole; a step where nothing captured runs leaves it as it was); without the ring never
    assert sum(steady) == total and steady[20] and not any(steady0)


def test_a_step_copied_whole_into_a_full_host_ring_is_published_lost_and_no_other_step_is():
    """A step larger than a ring slot whose whole-step copy finds the host ring full (held by other rows here) goes
    as the general path sends such a step: the batch first, then the step's captured requests' rows published as
    lost (the producer reports their positions downstream); the uncaptured ones are left out. Every other step's
    delta entries are exactly those of a run where the ring had room."""
    n, steps, prompt_len, out = 8, 40, 16, frozenset({1, 5})

    def layout(step, ids):
        return [(r, 600 if step == 20 and i == 2 else 1) for i, r in enumerate(ids)]

    held: list = []
    caps: list = []

    def on_step(step, cap, full=True):
        caps.append(cap)
        if not full:
            return
        if step == 19:                      # the batch goes, the producer's thread takes it, then the ring fills
            cap.flush()
            while cap.producer.queued_msgs:
                time.sleep(0.001)
            for rows in (cap.copier.max_rows, 1):
                while not (p := cap.copier.submit([(0, rows)])).dropped:
                    held.append(p)
        elif step == 20:
            for p in held:
                p.release()
            held.clear()

    runs = {}
    for full in (True, False):
        entries: list = []
        r = _probe().run("on", n, 4, 2, steps, 1, "cpu", eager=False, prompt_len=prompt_len, stamp=True, ring=True,
                         layout=layout, optout_first=out, on_producer=_watch([], entries),
                         on_step=lambda step, cap, full=full: on_step(step, cap, full))
        assert r["producer_drained"] and r["encode_errors"] == 0
        ps = caps[-1].producer.stats
        runs[full] = (dict(r, dropped=(ps.dropped_msgs, ps.dropped_rows)), entries)
    (r, entries), (r0, entries0) = runs[True], runs[False]
    captured = n - len(out)
    assert (r["copied_steps"], r0["copied_steps"]) == (0, 1) and r["ring_steps"] == r0["ring_steps"]
    assert r["active_steps"] == r0["active_steps"] and r["rows"] == r0["rows"]
    k = captured * 20                       # the entries of steps 0..19, then step 20's
    assert entries == entries0[:k] + entries0[k + captured:]
    assert (r["dropped"], r0["dropped"]) == ((1, 600 + captured - 1), (0, 0))



def _watch_batches(monkeypatch):
    """The producer's thread, per batch it reads: each step's rows (by the engine's forward) as published, and the
    forwards of the batches refused (LostHookError) or lost (RingReadLost)."""
    from routing_replay.engines.vllm_plugin import stamps
    from routing_replay.engines.vllm_plugin import step_batch as wmod

    published, refused, behind = {}, [], []
    checked = wmod.BatchedRows._checked

    def watched(self):
        forwards = list(self._forwards)
        try:
            arrays = checked(self)
        except stamps.LostHookError:
            refused.append(forwards)
            raise
        except stamps.RingReadLost:
            behind.append(forwards)
            raise
        for f, a in zip(forwards, arrays):
            published[f] = a.copy()
        return arrays
    monkeypatch.setattr(wmod.BatchedRows, "_checked", watched)
    return published, refused, behind


def _step_ids(step: int, t, layers: int) -> np.ndarray:
    """The (rows, layers, top_k) int16 ids a probe forward writes at `step`: they differ per step and per layer."""
    import torch
    return torch.stack([((t + 3 * step + 5 * layer) % 128).to(torch.int16) for layer in range(layers)], dim=1).numpy()


@pytest.mark.parametrize("ring", [False, True], ids=["stamps", "ring"])
@pytest.mark.parametrize("lasting", [False, True], ids=["one-step", "lasting"])
def test_a_lost_flush_under_graphs_loses_its_batch_and_later_steps_are_published_exact(ring, lasting, monkeypatch):
    """Graph mode with step stamps (and the step ring): step `bad`'s forward misses layer 0's write, so its flush
    is incomplete and the device counts one flush fewer than the engine's forwards. The delta that holds the step
    is refused (LostHookError: one encode error), never published with stale rows; the check then takes the
    device's count, so every later step is published, each step's rows exactly the ids its forward wrote (they
    differ per step and per layer). A hook lost for good (every step from `bad` on) is refused at every later
    delta and publishes nothing stale."""
    from routing_replay.engines.vllm_plugin import step_batch as wmod

    n, layers, steps, bad = 8, 4, 40, 20
    published, refused, behind = _watch_batches(monkeypatch)
    wrote, caps = {}, []

    def forward(step, records, t):  # forward step + 1 (every step runs tokens)
        wrote[step + 1] = _step_ids(step, t, layers)
        for layer, record in enumerate(records):
            if not (layer == 0 and (step == bad or (lasting and step > bad))):
                record(torch.from_numpy(wrote[step + 1][:, layer]))

    import torch
    r = _probe().run("on", n, layers, 2, steps, 1, "cpu", eager=False, prompt_len=16, stamp=True, ring=ring,
                     forward=forward, on_step=lambda step, cap: caps.append(cap))
    total = steps + steps // 4
    check = caps[-1].batch.stamps
    assert r["producer_drained"] and r["active_steps"] == total and len(wrote) == total
    first = refused[0]
    assert bad + 1 in first and len(first) <= wmod.MAX_BATCH_STEPS and first == list(range(first[0], first[-1] + 1))
    lost = {f for fs in refused for f in fs}
    if lasting:                     # every delta from the bad step's on is refused: nothing of them goes out
        assert lost == set(range(first[0], total + 1)) and r["encode_errors"] == len(refused) > 1
        assert check.resyncs == len(refused)
    else:                           # that delta alone; the device's count is taken once
        assert lost == set(first) and r["encode_errors"] == 1 and check.resyncs == 1
    assert sorted(published) == sorted(set(range(1, total + 1)) - lost)
    for f, rows in published.items():
        assert np.array_equal(rows, wrote[f]), f
    assert not behind               # (the batch handed over before the refusal reads the slots the device wrote)
    if not ring:                    # (ring: the refused batch's reads after the bad step find the next forward's
        assert check.steps == len(published) + bad + 1 - first[0]     # stamp; its checkpoint refuses it)


@pytest.mark.parametrize("eager", [False, True], ids=["ring", "eager-cpu"])
def test_a_batch_whose_raw_steps_do_not_resolve_is_dropped_and_the_producer_goes_on(eager, monkeypatch):
    """The producer's thread maps a batch's raw steps (engine ids, the runner's layout: step-ring steps under
    graphs, an eager CPU engine's host steps) to record keys before it encodes them (BatchedRows.resolve). One
    batch whose mapping fails (here: resolve_raw_steps raises for the batch that holds forward `bad`) is dropped:
    its rows released, its bytes out of the queue's count, one encode error, and the thread goes on: every other
    step is published, exactly as its forward wrote it. (Before, the failure ended the producer's thread, and with
    it the engine at its next step.)"""
    from routing_replay.engines.vllm_plugin import step_batch as wmod

    n, layers, steps, bad = 8, 4, 40, 21
    published, refused, behind = _watch_batches(monkeypatch)
    resolve, failed, wrote, caps = wmod.resolve_raw_steps, [], {}, []

    def resolve_or_fail(raw, table, forwards, *a, **kw):
        if bad in forwards:
            failed.append(list(forwards))
            raise ValueError("a layout that does not resolve")
        return resolve(raw, table, forwards, *a, **kw)
    monkeypatch.setattr(wmod, "resolve_raw_steps", resolve_or_fail)

    def forward(step, records, t):
        wrote[step + 1] = _step_ids(step, t, layers)
        for layer, record in enumerate(records):
            record(torch.from_numpy(wrote[step + 1][:, layer]))

    import torch
    # the runner reorders its batch every step (the rows of a step follow its layout)
    r = _probe().run("on", n, layers, 2, steps, 1, "cpu", eager=eager, prompt_len=16, stamp=True, ring=True,
                     forward=forward, on_step=lambda step, cap: caps.append(cap),
                     layout=lambda step, ids: [(ids[(i + step) % n], 1) for i in range(n)])
    total = steps + steps // 4
    cap = caps[-1]
    assert r["producer_drained"] and r["encode_errors"] == 1          # (the probe raises a failed thread's error)
    assert len(failed) == 1 and bad in failed[0] and not refused and not behind
    assert sorted(published) == sorted(set(range(1, total + 1)) - set(failed[0]))
    for f, rows in published.items():       # (rows in batch order: the layout's order is the forward's)
        assert np.array_equal(rows, wrote[f]), f
    assert (r["ring_steps"], r["host_steps"]) == ((0, total) if eager else (total, 0))
    assert cap.producer.queued_bytes == 0 and cap.copier.in_flight_rows == 0


def test_vllm_overhead_warm_line_times_the_real_worker_host_path():
    """bench/vllm_overhead.py's warm-cache line runs the worker's own pre_step/post_step and hooks (the eager CPU
    host path, every step by reference), not a copy of them: the probe it calls must have taken every step that way,
    or it raises."""
    ov = load_script(Path(__file__).resolve().parents[1] / "bench" / "vllm_overhead.py", "vllm_overhead")
    # 48 layers: the hooks' CPU per step well above the clocks' noise (3 C hooks cost ~0.1 us a step, and one CI
    # run read -0.15 for them: two thread-clock reads taken out of a cost that small)
    m = ov.micro(num_layers=48, top_k=2, reqs=8, steps=40)
    assert sorted(m) == ["hooks x48", "pre_step + post_step"]
    assert all(v > 0 for v in m.values()), m
