"""WorkerCapture's steps over many engine steps, through its public constructor (tests/standins.py run_engine: an
engine's step loop with a Model Runner V1 stand-in, the real RoutingCache, AsyncCopier, CaptureBinding and a real
Producer whose thread takes, copies and encodes every delta): the rows each mode and step path hands over, step
stamps, the step ring's fast path, a full host ring, lost hooks and bad tensors. Exact counts and rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from routing_replay.engines.vllm_plugin import step_batch as wmod
from routing_replay.engines.vllm_plugin.stamps import LostHookError
from routing_replay.engines.vllm_plugin.step_batch import resolve_raw_steps
from tests.standins import engine_id, run_engine, step_ids, wait_for, watch_batches, watch_producer

N, LAYERS, TOP_K, STEPS, PROMPT = 8, 4, 2, 50, 16
ALL_ROWS = N * PROMPT + N * (STEPS - 1)             # a prefill of PROMPT tokens, then one decode token per step


@pytest.mark.parametrize("mode", ["on", "optout", "optout-fill"])
def test_each_mode_hands_over_exactly_the_rows_of_the_steps_it_ran_and_times_only_sections_with_work(mode):
    """Graph mode without stamps: captured, every step's rows; opted out (with or without a prefix store), none.
    With timing, pre_step is timed every step, post_step only where it has work (publishing rows; with a store
    under CUDA graphs and nothing to gather it only checks that the forward ended the step)."""
    r = run_engine(mode, N, LAYERS, TOP_K, STEPS, timing=True)
    assert r["steps"] == STEPS and r["producer_drained"] and r["encode_errors"] == 0
    if mode == "on":
        assert (r["active_steps"], r["rows"], r["opened"]) == (STEPS, ALL_ROWS, N)
    else:
        assert (r["active_steps"], r["rows"], r["opened"]) == (0, 0, 0)
    assert r["stats"].timed_sections == {"on": 2, "optout": 1, "optout-fill": 1}[mode] * STEPS


def test_eager_steps_run_the_real_router_hooks_and_every_layer_covers_every_step():
    """Eager (the CPU build, enforce_eager): the routers call the worker's real capture hooks every step (a step
    short of one layer would raise LostHookError in post_step); every step goes by reference (HostPath)."""
    r = run_engine("on", N, LAYERS, TOP_K, STEPS, eager=True)
    assert r["producer_drained"] and r["encode_errors"] == 0 and not r["step_stamp"]
    assert (r["active_steps"], r["rows"], r["host_steps"]) == (STEPS, ALL_ROWS, STEPS)


@pytest.mark.parametrize("stamp", [True, False])
def test_step_stamps_check_every_step_and_launch_no_fill(stamp):
    """Graph mode with step stamps (ROUTING_REPLAY_STEP_STAMP=on): no -1 fill, and the producer's thread checked
    the stamp of every step it published (a stale one would have stopped it). Without stamps: a fill every step."""
    fills = []

    def count_fills(cap):
        fill = cap.cache.fill_step

        def counted(*a, **kw):
            fills.append(1)
            return fill(*a, **kw)
        cap.cache.fill_step = counted

    r = run_engine("on", N, LAYERS, TOP_K, STEPS, stamp=stamp, on_worker=count_fills)
    assert r["step_stamp"] == stamp and r["producer_drained"] and r["encode_errors"] == 0
    assert r["active_steps"] == STEPS and r["rows"] == ALL_ROWS
    assert (r["stamps_checked"], len(fills)) == ((STEPS, 0) if stamp else (0, STEPS))


@pytest.mark.parametrize("eager", [False, True])
def test_steps_where_nothing_is_captured_still_count_their_forwards_and_leave_the_hooks_as_the_mode_wants(eager):
    """An opted-out engine's steps take pre_step's short path (nothing tracked, none opening, no prefix store): each
    still counts its forward (step stamps and the step ring predict a step's stamp and slot from that count), the
    worker stays inactive, and the router hooks run only where they are replayed from graphs (not eager)."""
    seen = []

    def on_step(step, cap):
        held = sum(t is not None for t in getattr(cap.binding, "held", ()))
        seen.append((cap.forwards, cap.active, cap.storing, cap.binding.active, cap.stats.steps, held))

    r = run_engine("optout", N, LAYERS, TOP_K, STEPS, eager=eager, stamp=True, ring=True, on_step=on_step)
    assert [s[0] for s in seen] == list(range(1, STEPS + 1))          # one forward per step, none missed
    assert [s[4] for s in seen] == list(range(1, STEPS + 1))
    # eager: every layer's hook but the last is C (it stores whether or not the step is captured); post_step lets
    # go of what it kept, so no router tensor outlives a step that is not captured
    assert {s[1:4] + s[5:] for s in seen} == {(False, False, not eager, 0)}
    assert (r["active_steps"], r["rows"], r["opened"]) == (0, 0, 0)


@pytest.mark.parametrize("churn", [0, 1])
def test_quiet_steps_are_the_timed_steps_that_open_finish_and_preempt_nothing(churn):
    """WorkerStats.quiet_*: one step of a running batch. Without churn every step but the first (the opens) is
    quiet, both of its sections timed; with a request finishing and one starting every step none is; without
    timing nothing is counted."""
    kw = dict(stamp=True, ring=True, churn=churn, churn_prompt=12, churn_output=5)
    st = run_engine("on", N, LAYERS, TOP_K, STEPS, timing=True, **kw)["stats"]
    assert (st.quiet_steps, st.quiet_sections) == ((STEPS - 1, 2 * (STEPS - 1)) if churn == 0 else (0, 0))
    assert st.timed_sections == 2 * STEPS
    assert churn or st.quiet_host_wall_ns > st.quiet_clock_wall_ns > 0
    st = run_engine("on", N, LAYERS, TOP_K, STEPS, timing=False, **kw)["stats"]
    assert (st.quiet_steps, st.quiet_sections, st.timed_sections, st.host_ns) == (0, 0, 0, 0)


def test_steps_of_the_running_batch_on_the_ring_publish_what_the_engine_thread_mapping_publishes():
    """A graph engine's step of the running batch after a ring step takes pre_step's first branch and post_step's
    ring path in one frame (RingPath.ring_step). Steps that change the batch without opening or finishing anything
    take it too: the runner reorders its batch, leaves requests out of a step, schedules only requests that are
    not captured (no captured request runs: the general path), or a chunk larger than a ring slot (the copier).
    Each gives exactly the delta entries of the engine thread's own mapping (stamps without the ring), in order,
    and every ring read's stamp checks."""
    steps, out = 75, frozenset({1, 5})

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
        r = run_engine("on", N, LAYERS, TOP_K, steps, stamp=True, ring=ring, layout=layout, optout_first=out,
                       on_producer=watch_producer([], entries), on_step=lambda step, cap: steady.append(cap.steady))
        assert r["producer_drained"] and r["encode_errors"] == 0
        runs[ring] = (r, entries, steady)
    (r, entries, steady), (r0, entries0, steady0) = runs[True], runs[False]
    idle = sum(1 for s in range(1, steps) if s % 11 == 6)
    assert r["active_steps"] == r0["active_steps"] == steps - idle
    assert r["ring_steps"] == steps - idle - 1 and r0["ring_steps"] == 0 and r["stamps_checked"] == steps - idle
    assert (r["copied_steps"], r0["copied_steps"]) == (1, 0)        # the chunk larger than a slot: copied whole
    ids = [engine_id(i) for i in range(N)]
    captured = [r for i, r in enumerate(ids) if i not in out]
    want = len(captured) + sum(len([r for r, _ in layout(s, ids) if r in captured]) for s in range(1, steps))
    assert entries == entries0 and len(entries) == want
    # every request's rows, in order, with nothing of the two not captured
    keys = {k for k, _, _ in entries}
    assert len(keys) == N - len(out)
    for k in keys:
        mine = [(a, c) for key, a, c in entries if key == k]
        assert [a for a, _ in mine] == list(np.cumsum([0] + [c for _, c in mine[:-1]]))
    # the fast path ran: every step after a ring step left the worker steady, the one larger than a slot too (it
    # goes raw, copied whole; a step where nothing captured runs leaves it as it was); without the ring never
    assert sum(steady) == steps and steady[20] and not any(steady0)


def test_a_step_copied_whole_into_a_full_host_ring_is_published_lost_and_no_other_step_is():
    """A step larger than a ring slot whose whole-step copy finds the host ring full (held by other rows here) goes
    as the general path sends such a step: the batch first, then the step's captured requests' rows published as
    lost (the producer reports their positions downstream); the uncaptured ones are left out. Every other step's
    delta entries are exactly those of a run where the ring had room."""
    out = frozenset({1, 5})

    def layout(step, ids):
        return [(r, 600 if step == 20 and i == 2 else 1) for i, r in enumerate(ids)]

    held: list = []

    def on_step(step, cap, full=True):
        if not full:
            return
        if step == 19:                      # the batch goes, the producer's thread takes it, then the ring fills
            cap.flush()
            wait_for(lambda: not cap.producer.queued_msgs)
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
        r = run_engine("on", N, LAYERS, TOP_K, STEPS, stamp=True, ring=True, layout=layout, optout_first=out,
                       on_producer=watch_producer([], entries),
                       on_step=lambda step, cap, full=full: on_step(step, cap, full))
        assert r["producer_drained"] and r["encode_errors"] == 0
        ps = r["worker"].producer.stats
        runs[full] = (dict(r, dropped=(ps.dropped_msgs, ps.dropped_rows)), entries)
    (r, entries), (r0, entries0) = runs[True], runs[False]
    captured = N - len(out)
    assert (r["copied_steps"], r0["copied_steps"]) == (0, 1) and r["ring_steps"] == r0["ring_steps"]
    assert r["active_steps"] == r0["active_steps"] and r["rows"] == r0["rows"]
    k = captured * 20                       # the entries of steps 0..19, then step 20's
    assert entries == entries0[:k] + entries0[k + captured:]
    assert (r["dropped"], r0["dropped"]) == ((1, 600 + captured - 1), (0, 0))


def test_a_ring_run_of_many_steps_loses_no_rows_when_the_producer_keeps_up():
    """256 requests of one-token steps on the step ring: every step read from the ring, every row handed over and
    no ring read lost (the loop lets the producer's thread take each batch as an engine's forward would)."""
    n, steps = 256, 120
    r = run_engine("on", n, 16, 8, steps, prompt_len=1, stamp=True, ring=True)
    assert r["step_ring"] and r["producer_drained"] and r["encode_errors"] == 0
    assert r["ring_steps"] == r["active_steps"] == steps and r["rows"] == n * steps


@pytest.mark.parametrize("ring", [False, True], ids=["stamps", "ring"])
@pytest.mark.parametrize("lasting", [False, True], ids=["one-step", "lasting"])
def test_a_lost_flush_under_graphs_loses_its_batch_and_later_steps_are_published_exact(ring, lasting, monkeypatch):
    """Graph mode with step stamps (and the step ring): step `bad`'s forward misses layer 0's write, so its flush
    is incomplete and the device counts one flush fewer than the engine's forwards. The delta that holds the step
    is refused (LostHookError: one encode error), never published with stale rows; the check then takes the
    device's count, so every later step is published, each step's rows exactly the ids its forward wrote (they
    differ per step and per layer). A hook lost for good (every step from `bad` on) is refused at every later
    delta and publishes nothing stale."""
    bad = 20
    published, refused, behind = watch_batches(monkeypatch)
    wrote = {}

    def forward(step, records, t):  # forward step + 1 (every step runs tokens)
        wrote[step + 1] = step_ids(step, t, LAYERS)
        for layer, record in enumerate(records):
            if not (layer == 0 and (step == bad or (lasting and step > bad))):
                record(torch.from_numpy(wrote[step + 1][:, layer]))

    r = run_engine("on", N, LAYERS, TOP_K, STEPS, stamp=True, ring=ring, forward=forward)
    check = r["worker"].batch.stamps
    assert r["producer_drained"] and r["active_steps"] == STEPS and len(wrote) == STEPS
    first = refused[0]
    assert bad + 1 in first and len(first) <= wmod.MAX_BATCH_STEPS and first == list(range(first[0], first[-1] + 1))
    lost = {f for fs in refused for f in fs}
    if lasting:                     # every delta from the bad step's on is refused: nothing of them goes out
        assert lost == set(range(first[0], STEPS + 1)) and r["encode_errors"] == len(refused) > 1
        assert check.resyncs == len(refused)
    else:                           # that delta alone; the device's count is taken once
        assert lost == set(first) and r["encode_errors"] == 1 and check.resyncs == 1
    assert sorted(published) == sorted(set(range(1, STEPS + 1)) - lost)
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
    step is published, exactly as its forward wrote it."""
    bad = 21
    published, refused, behind = watch_batches(monkeypatch)
    resolve, failed, wrote = wmod.resolve_raw_steps, [], {}

    def resolve_or_fail(raw, table, forwards, *a, **kw):
        if bad in forwards:
            failed.append(list(forwards))
            raise ValueError("a layout that does not resolve")
        return resolve(raw, table, forwards, *a, **kw)
    monkeypatch.setattr(wmod, "resolve_raw_steps", resolve_or_fail)

    def forward(step, records, t):
        wrote[step + 1] = step_ids(step, t, LAYERS)
        for layer, record in enumerate(records):
            record(torch.from_numpy(wrote[step + 1][:, layer]))

    # the runner reorders its batch every step (the rows of a step follow its layout)
    r = run_engine("on", N, LAYERS, TOP_K, STEPS, eager=eager, stamp=True, ring=True, forward=forward,
                   layout=lambda step, ids: [(ids[(i + step) % N], 1) for i in range(N)])
    cap = r["worker"]
    assert r["producer_drained"] and r["encode_errors"] == 1
    assert len(failed) == 1 and bad in failed[0] and not refused and not behind
    assert sorted(published) == sorted(set(range(1, STEPS + 1)) - set(failed[0]))
    for f, rows in published.items():       # (rows in batch order: the layout's order is the forward's)
        assert np.array_equal(rows, wrote[f]), f
    assert (r["ring_steps"], r["host_steps"]) == ((0, STEPS) if eager else (STEPS, 0))
    assert cap.producer.queued_bytes == 0 and cap.copier.in_flight_rows == 0


def test_keys_refused_at_a_hand_over_leave_the_steps_not_added_raw_too():
    """resolve_raw_steps(gone=...): a batch with raw steps is resolved on the producer's thread, after the finish
    of a request whose open was refused may have taken the refusal back; so the steps added with their keys (an
    unchanged batch, prefix rows) leave that key's entries and rows out there, exactly, like a raw step whose
    table no longer holds the id."""
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


def test_a_step_of_the_running_batch_lets_go_of_tensors_a_failed_forward_left():
    """Eager: a forward that raised before post_step leaves tensors in the hooks' list; the next captured step's
    pre_step lets go of them, so a layer whose hook then does not run is refused (LostHookError) instead of
    publishing the earlier forward's routing (a step of the running batch: the left tensor has its shape)."""
    stale = torch.zeros(N, TOP_K, dtype=torch.int32)
    bad = 12

    def leave_stale(step, cap):
        if step == bad - 1:             # the forward after this post_step raised midway: its tensor stays
            cap.binding.held[0] = stale

    def forward(step, hooks, topk_ids):
        for i, hook in enumerate(hooks):
            if not (step == bad and i == 0):       # step `bad`: layer 0's hook is lost
                hook(topk_ids)

    with pytest.raises(LostHookError, match="3 of 4 MoE layers"):
        run_engine("on", N, LAYERS, TOP_K, STEPS, eager=True, on_step=leave_stale, forward=forward)
    seen = []                           # the same run without the lost hook publishes every step
    r = run_engine("on", N, LAYERS, TOP_K, STEPS, eager=True,
                   on_step=lambda step, cap: seen.append(cap.binding.held.count(None)),
                   forward=lambda step, hooks, t: [h(t) for h in hooks])
    assert r["active_steps"] == STEPS and seen == [LAYERS] * STEPS


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

    r = run_engine("on", N, LAYERS, TOP_K, STEPS, eager=True, forward=forward, on_producer=watch)
    assert r["encode_errors"] == 1 and r["active_steps"] == STEPS and r["rows"] == ALL_ROWS
    ok = run_engine("on", N, LAYERS, TOP_K, STEPS, eager=True, forward=lambda s, hooks, t: [h(t) for h in hooks])
    assert ok["encode_errors"] == 0 and ok["rows"] == r["rows"]
    assert sum(deltas) == STEPS and len(deltas) == 4        # 16 steps per delta: the bad step's delta is one of them
