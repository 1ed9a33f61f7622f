"""Accumulator tests on decoded messages alone (no sockets): every record checked bit for bit."""

import numpy as np
import pytest

from routing_replay.consumer import Accumulator
from routing_replay.protocol import wire
from routing_replay.apps.synthetic import true_rows

L, K, E = 3, 2, 16


def pytest_generate_tests(metafunc):
    """Every test twice: rows copied into the arena, and rows kept as received wherever a message allows it
    (Accumulator._adopt); the records must not differ. Tests of the arena's own regions and pages (marked
    `copied_only`) run with copied rows only: adopted rows never reach the arena; so do the tests that choose the
    mode themselves."""
    modes = ["copied"] if metafunc.definition.get_closest_marker("copied_only") else ["copied", "adopted"]
    metafunc.parametrize("adoption", modes, indirect=True)


@pytest.fixture(autouse=True)
def adoption(request, monkeypatch):
    monkeypatch.setattr(Feed, "adopt", request.param == "adopted")
    return request.param


def rows(seed, lo, hi, variant=0, layers=(0, L)):
    return true_rows(seed, np.arange(lo, hi), L, K, E, variant)[:, layers[0]:layers[1]]


class Feed:
    """Build wire messages and apply them to an accumulator, collecting emitted records.

    adopt (the class default is set per test by the `adoption` fixture): payload frames are writable, as a
    socket's are, and every message that can be is kept as received (adopt_min_bytes=0); else frames are bytes,
    which the accumulator always copies."""

    adopt = False

    def __init__(self, **kw):
        if self.adopt:
            kw.setdefault("adopt_min_bytes", 0)
        self.acc = Accumulator(**kw)
        self.now = 0.0
        self.out = {}
        self.seq = 0

    def _apply(self, kind, key, body, frames=()):
        if self.adopt and kind == "delta":
            frames = [bytearray(f) for f in frames]
        self.seq += 1
        h = wire.decode_header(wire.pack_header(kind, "p", 0, self.seq, key, body))
        for r in self.acc.apply(h, list(frames), self.now):
            self.out[r.request_id] = r

    def open(self, rid, P, C=0, layer_ids=None, tokens=None, filled=False):
        body = {"prompt_len": P, "num_cached": C, "num_layers": L, "top_k": K,
                "layer_ids": layer_ids or list(range(L))}
        if filled:
            body["prefix_filled"] = True
        frames = []
        if tokens is not None:
            body["n_prompt_tokens"] = len(tokens)
            frames = [np.asarray(tokens, np.int32).tobytes()]
        self._apply("open", rid, body, frames)

    def delta(self, items, layers=(0, L), cuts=None):
        """cuts: split the payload into frames before these request indices (a broker split's frame layout)."""
        ids = [i[0] for i in items]
        body = wire.delta_body([i[1] for i in items], [len(i[2]) for i in items], L, K, *layers)
        parts = [np.ascontiguousarray(i[2], np.int16).tobytes() for i in items]
        if cuts is None:
            frames = [b"".join(parts)]
        else:
            edges = [0, *cuts, len(parts)]
            frames = [b"".join(parts[a:b]) for a, b in zip(edges, edges[1:])]
        self._apply("delta", ids, body, frames)

    def finish(self, rid, G, **kw):
        self._apply("finish", rid, {"num_output": G, "reason": "stop", **kw})

    def abort(self, rid):
        self._apply("abort", rid, {"reason": "abort"})

    def tick(self, dt):
        self.now += dt
        for r in self.acc.poll(self.now):
            self.out[r.request_id] = r


def expected(seed, P, G, C):
    full = rows(seed, 0, P + G)
    full[:C] = -1
    full[P + G - 1] = -1
    return full[:P], full[P:]


def check(rec, seed, P, G, C):
    ep, eg = expected(seed, P, G, C)
    assert rec.complete, (rec.reason, rec.missing)
    assert rec.missing == [] and rec.reason == ""
    assert rec.prompt_routed_experts.dtype == np.int16 and rec.prompt_routed_experts.shape == (P, L, K)
    assert rec.routed_experts.shape == (G, L, K)
    np.testing.assert_array_equal(rec.prompt_routed_experts, ep)
    np.testing.assert_array_equal(rec.routed_experts, eg)
    assert rec.num_cached_tokens == C


def test_chunked_prefill_then_decode_interleaved():
    f = Feed()
    f.open("a", 10)
    f.open("b", 6, C=4)
    f.delta([("a", 0, rows(1, 0, 4)), ("b", 4, rows(2, 4, 6))])
    f.delta([("a", 4, rows(1, 4, 10)), ("b", 6, rows(2, 6, 7))])
    for p in range(10, 12):
        f.delta([("a", p, rows(1, p, p + 1)), ("b", p - 3, rows(2, p - 3, p - 2))])
    f.finish("a", 3)     # positions 0..11 computed; output tokens at 10, 11, 12 -> row 12 is -1
    f.finish("b", 4)     # positions 4..8 computed; outputs at 6..9 -> row 9 is -1
    check(f.out["a"], 1, 10, 3, 0)
    check(f.out["b"], 2, 6, 4, 4)
    assert f.acc.in_flight == 0 and f.acc.bytes_held == 0
    assert (f.acc.stats.finished, f.acc.stats.complete) == (2, 2)


def test_overwrites_win_spec_decode_and_recompute():
    f = Feed()
    f.open("a", 4)
    f.delta([("a", 0, rows(5, 0, 4, variant=2))])          # stale pass (preempted) ...
    f.delta([("a", 4, rows(5, 4, 7, variant=1))])          # ... with garbage drafts beyond
    f.delta([("a", 0, rows(5, 0, 5))])                      # recompute overwrites [0, 5)
    f.delta([("a", 5, rows(5, 5, 6))])                      # overwrites 5, leaves 6 (garbage) past the end
    f.finish("a", 3)                                        # needs [0, 6), row 6 is the last token's: -1
    check(f.out["a"], 5, 4, 3, 0)


def test_hole_is_missing_then_filled_within_grace():
    f = Feed(finish_grace_s=1.0)
    f.open("a", 4)
    f.delta([("a", 0, rows(3, 0, 2))])
    f.delta([("a", 4, rows(3, 4, 6))])        # positions 2, 3 not yet delivered
    f.finish("a", 3)
    assert "a" not in f.out                   # waits for late rows
    f.delta([("a", 2, rows(3, 2, 4))])        # e.g. from another producer
    check(f.out["a"], 3, 4, 3, 0)


def test_hole_reported_after_grace():
    f = Feed(finish_grace_s=0.5)
    f.open("a", 6, C=1)
    f.delta([("a", 1, rows(3, 1, 2))])
    f.delta([("a", 4, rows(3, 4, 8))])
    f.finish("a", 3)
    assert "a" not in f.out
    f.tick(0.6)
    r = f.out["a"]
    assert not r.complete and r.missing == [(2, 4)] and r.reason == "rows_not_delivered"
    ep, eg = expected(3, 6, 3, 1)
    ep[2:4] = -1
    np.testing.assert_array_equal(r.prompt_routed_experts, ep)
    np.testing.assert_array_equal(r.routed_experts, eg)


def test_producer_loss_named_in_reason():
    f = Feed(finish_grace_s=0.0)
    f.open("a", 4)
    f.delta([("a", 0, rows(3, 0, 2))])
    f.finish("a", 2, lost=[[2, 4]])
    r = f.out["a"]
    assert (r.complete, r.missing, r.reason) == (False, [(2, 5)], "producer_queue_full")


def test_rows_the_producer_refused_are_named_apart_from_its_queue():
    """`refused` (a subset of `lost`): rows the producer would not send because they failed its checks (a lost
    capture hook); the record names that reason, not the queue. Rows are handled as for any loss: -1, missing."""
    f = Feed(finish_grace_s=0.0)
    for rid, lost, refused in (("a", [[2, 4]], [[2, 4]]), ("b", [[1, 2], [3, 4]], [[3, 4]]),
                               ("c", [[2, 4]], [[9, 9]])):
        f.open(rid, 4)
        f.delta([(rid, 0, rows(3, 0, 2))])
        f.finish(rid, 2, lost=lost, refused=refused)
    a, b, c = f.out["a"], f.out["b"], f.out["c"]
    assert (a.complete, a.missing, a.reason) == (False, [(2, 5)], "producer_refused")
    assert (b.complete, b.missing, b.reason) == (False, [(1, 5)], "producer_refused")
    assert (c.complete, c.missing, c.reason) == (False, [(2, 5)], "producer_queue_full")   # refused elsewhere
    assert (a.prompt_routed_experts[2:] == -1).all() and (b.prompt_routed_experts[1:] == -1).all()
    np.testing.assert_array_equal(a.prompt_routed_experts[:2], expected(3, 4, 2, 0)[0][:2])


def test_a_refused_message_names_the_loss_of_the_requests_it_lists_that_are_held_here():
    """The broker's `refused` (a delta with rows of these requests was dropped there) comes before their finishes:
    a held request whose record comes out incomplete says `broker_refused`; one that ends complete is unaffected,
    and an id not held here makes no request."""
    f = Feed(finish_grace_s=0.0)
    for rid in ("a", "b"):
        f.open(rid, 4)
        f.delta([(rid, 0, rows(3, 0, 2))])
    f._apply("refused", ["a", "b", "nobody"], {"reason": "out_of_range: test"})
    f.delta([("b", 2, rows(3, 0, 5)[2:])])
    for rid in ("a", "b"):
        f.finish(rid, 2)
    a, b = f.out["a"], f.out["b"]
    assert (a.complete, a.missing, a.reason) == (False, [(2, 5)], "broker_refused")
    assert (b.complete, b.missing, b.reason) == (True, [], "")
    assert "nobody" not in f.acc.requests and set(f.out) == {"a", "b"}


def test_rows_the_broker_refused_are_named_apart_from_the_producers_queue():
    """`broker_refused` (a subset of `lost`): rows of a delta the broker accepted and dropped (it could not take the
    message). The producer's own refusal names the record first when both overlap the missing rows."""
    f = Feed(finish_grace_s=0.0)
    for rid, kw in (("a", {"lost": [[2, 4]], "broker_refused": [[2, 4]]}),
                    ("b", {"lost": [[1, 2], [3, 4]], "refused": [[1, 2]], "broker_refused": [[3, 4]]}),
                    ("c", {"lost": [[2, 4]], "broker_refused": [[9, 9]]})):
        f.open(rid, 4)
        f.delta([(rid, 0, rows(3, 0, 2))])
        f.finish(rid, 2, **kw)
    a, b, c = f.out["a"], f.out["b"], f.out["c"]
    assert (a.complete, a.missing, a.reason) == (False, [(2, 5)], "broker_refused")
    assert (b.complete, b.missing, b.reason) == (False, [(1, 5)], "producer_refused")
    assert (c.complete, c.missing, c.reason) == (False, [(2, 5)], "producer_queue_full")   # refused elsewhere
    assert (a.prompt_routed_experts[2:] == -1).all()
    np.testing.assert_array_equal(a.prompt_routed_experts[:2], expected(3, 4, 2, 0)[0][:2])


def test_pipeline_parallel_layer_ranges_merge():
    f = Feed(finish_grace_s=1.0)
    f.open("a", 5)
    f.delta([("a", 0, rows(9, 0, 5, layers=(0, 1)))], layers=(0, 1))
    f.delta([("a", 5, rows(9, 5, 6, layers=(0, 1)))], layers=(0, 1))
    f.finish("a", 2)                                         # stage 0 finished first: layers 1..2 missing
    assert "a" not in f.out
    f.delta([("a", 0, rows(9, 0, 6, layers=(1, 3)))], layers=(1, 3))
    check(f.out["a"], 9, 5, 2, 0)


def test_pipeline_parallel_missing_stage_reported():
    f = Feed(finish_grace_s=0.0)
    f.open("a", 3)
    f.delta([("a", 0, rows(9, 0, 4, layers=(0, 1)))], layers=(0, 1))
    f.finish("a", 2)
    r = f.out["a"]
    assert (r.complete, r.missing, r.reason) == (False, [(0, 4)], "layers_missing")


def test_abort_emits_incomplete_with_rows_so_far():
    f = Feed()
    f.open("a", 8)
    f.delta([("a", 0, rows(4, 0, 5))])
    f.abort("a")
    r = f.out["a"]
    assert (r.complete, r.reason, r.finish_reason) == (False, "abort", "abort")
    assert r.prompt_routed_experts.shape == (8, L, K) and r.routed_experts.shape == (0, L, K)
    np.testing.assert_array_equal(r.prompt_routed_experts[:5], rows(4, 0, 5))
    assert (r.prompt_routed_experts[5:] == -1).all()
    assert r.missing == [(5, 8)]


def test_timeout_emits_incomplete_and_frees_memory():
    f = Feed(request_timeout_s=10)
    f.open("a", 8)
    f.delta([("a", 0, rows(4, 0, 3))])
    f.tick(5)
    assert "a" not in f.out
    f.tick(6)
    r = f.out["a"]
    assert (r.complete, r.reason) == (False, "timeout")
    assert f.acc.bytes_held == 0 and f.acc.in_flight == 0


def test_late_delta_after_finish_is_counted_not_resurrected():
    f = Feed()
    f.open("a", 2)
    f.delta([("a", 0, rows(1, 0, 3))])
    f.finish("a", 2)
    f.delta([("a", 3, rows(1, 3, 4))])
    assert f.acc.in_flight == 0 and f.acc.stats.late_msgs == 1


def test_delta_before_open_and_finish_carrying_prompt_len():
    f = Feed()
    f.delta([("a", 2, rows(6, 2, 5))])
    f.finish("a", 2, prompt_len=4, num_cached=2)
    check(f.out["a"], 6, 4, 2, 2)
    assert list(f.out["a"].moe_layer_ids) == [0, 1, 2]


def test_finish_without_any_open_or_prompt_len_is_flagged():
    f = Feed()
    f.delta([("a", 0, rows(6, 0, 3))])
    f.finish("a", 1)
    assert (f.out["a"].complete, f.out["a"].reason) == (False, "no_open")


def test_position_bound_refused_and_other_requests_intact():
    f = Feed(max_positions=100, finish_grace_s=0)
    f.open("a", 2)
    f.open("b", 2)
    f.delta([("b", 0, rows(2, 0, 2)), ("a", 99, rows(1, 99, 101))])
    f.delta([("b", 2, rows(2, 2, 3))])
    f.finish("b", 2)
    f.finish("a", 2)
    check(f.out["b"], 2, 2, 2, 0)
    assert (f.out["a"].complete, f.out["a"].reason) == (False, "consumer_refused")
    assert f.acc.stats.refused_rows == 2


def test_shape_change_for_request_refused():
    f = Feed()
    f.open("a", 2)
    with pytest.raises(wire.ProtocolError) as e:
        f._apply("open", "a", {"prompt_len": 2, "num_cached": 0, "num_layers": L + 1, "top_k": K})
    assert e.value.reason == "shape_mismatch"


def test_tokens_ride_along():
    g = Feed()
    g.open("a", 3, tokens=[5, 6, 7])
    g.delta([("a", 0, rows(1, 0, 4))])
    g.seq += 1
    h = wire.decode_header(wire.pack_header("finish", "p", 0, g.seq, "a", {"num_output": 2, "n_output_tokens": 2}))
    (r,) = g.acc.apply(h, [np.array([8, 9], np.int32).tobytes()], 0.0)
    assert r.prompt_token_ids.tolist() == [5, 6, 7] and r.output_token_ids.tolist() == [8, 9]
    check(r, 1, 3, 2, 0)


def test_memory_close_to_record_bytes():
    f = Feed()
    n_req, P = 50, 2000
    for i in range(n_req):
        f.open(f"r{i}", P)
    for start in range(0, P, 100):
        f.delta([(f"r{i}", start, rows(i, start, start + 100)) for i in range(n_req)])
    arenas = {id(r.arena): r.arena for st in f.acc.requests.values() for r in st.ranges.values()}
    held = sum(a.live_blocks * a.block_bytes for a in arenas.values())
    assert f.acc.bytes_held == held == sum(r.allocated for st in f.acc.requests.values() for r in st.ranges.values())
    record_bytes = n_req * P * L * K * 2
    assert record_bytes <= held <= 1.2 * record_bytes


def test_rows_on_the_append_fast_path_keep_a_request_alive():
    f = Feed(request_timeout_s=10)
    f.open("a", 8)
    f.delta([("a", 0, rows(4, 0, 1))])       # first rows: the checked path
    f.now = 8.0
    f.delta([("a", 1, rows(4, 1, 2))])       # append fast path: no timestamp written
    f.tick(4.0)                              # now 12: older than the timeout by its timestamp, but progressed
    assert "a" not in f.out and f.acc.in_flight == 1
    f.tick(11.0)                             # now 23: silent since 12
    assert (f.out["a"].complete, f.out["a"].reason) == (False, "timeout")


def test_payload_in_several_frames_read_in_place():
    """A split delta arrives as one frame per run of requests (empty frames and zero-row requests included):
    every request's rows land where they belong, bit for bit, on the fast and the slow path."""
    f = Feed()
    specs = {"a": (1, 6, 3), "b": (2, 4, 2), "c": (3, 9, 4), "d": (4, 5, 2)}     # seed, P, G
    for rid, (seed, P, G) in specs.items():
        f.open(rid, P)
    # prefill: a, b | (empty frame) | c, d
    f.delta([(rid, 0, rows(seed, 0, P)) for rid, (seed, P, G) in specs.items()], cuts=[2, 2])
    # decode steps: a zero-row entry for b in the middle, frames cut around it
    for step in range(4):
        items = []
        for rid, (seed, P, G) in specs.items():
            pos = P + step
            if pos < P + G - 1:
                items.append((rid, pos, rows(seed, pos, pos + 1)))
            else:
                items.append((rid, pos, rows(seed, pos, pos)))       # nothing this step
        f.delta(items, cuts=[1, 2, 4])
    for rid, (seed, P, G) in specs.items():
        f.finish(rid, G)
    assert sorted(f.out) == sorted(specs)
    for rid, (seed, P, G) in specs.items():
        check(f.out[rid], seed, P, G, 0)


def test_frame_boundary_inside_a_request_is_refused_and_nothing_applied():
    f = Feed()
    f.open("a", 4)
    f.open("b", 4)
    payload = np.ascontiguousarray(np.concatenate([rows(1, 0, 4), rows(2, 0, 4)]), np.int16).tobytes()
    body = wire.delta_body([0, 0], [4, 4], L, K)
    h = wire.decode_header(wire.pack_header("delta", "p", 0, 99, ["a", "b"], body))
    cut = 3 * L * K * 2                                  # inside a's rows
    with pytest.raises(wire.ProtocolError) as e:
        f.acc.apply(h, [payload[:cut], payload[cut:]], 0.0)
    assert e.value.reason == "split_mid_request"
    assert f.acc.bytes_held == 0 and all(not st.ranges for st in f.acc.requests.values())


def test_zero_row_entry_for_a_new_request_is_harmless():
    """A delta entry with count 0 for a request with no rows yet (atheris found it raising IndexError)."""
    f = Feed()
    f.open("a", 3)
    f.delta([("a", 0, rows(5, 0, 0))])
    f.delta([("a", 2, rows(5, 2, 2))])              # zero rows past the end: no hole recorded
    f.delta([("a", 0, rows(5, 0, 4))])
    f.finish("a", 2)
    check(f.out["a"], 5, 3, 2, 0)


# ---- prefix rows filled from the engine's prefix store (ROUTING_REPLAY_PREFIX_ROWS=fill) ---------------------------


def test_prefix_filled_rows_are_kept_and_counted():
    f = Feed()
    f.open("a", 10, C=4, filled=True)
    f.delta([("a", 0, rows(1, 0, 4)), ("a", 4, rows(1, 4, 10))])       # prefix part, then the computed part
    f.delta([("a", 10, rows(1, 10, 12))])
    f.finish("a", 3)
    rec = f.out["a"]
    full = rows(1, 0, 13)
    full[12] = -1
    assert rec.complete and rec.missing == [] and rec.reason == ""
    assert (rec.num_cached_tokens, rec.num_prefix_filled) == (4, 4)
    np.testing.assert_array_equal(rec.prompt_routed_experts, full[:10])
    np.testing.assert_array_equal(rec.routed_experts, full[10:])
    # through the trainer wire and npz, the count survives
    frames = [f if isinstance(f, bytes) else f.tobytes() for f in wire.encode_record(rec, "c", 1)]
    assert wire.decode_record(wire.decode_header(frames[0]), frames[1:]).equals(rec)


def test_prefix_filled_rows_missing_make_the_record_incomplete():
    f = Feed(finish_grace_s=0.0)
    f.open("a", 10, C=4, filled=True)
    f.delta([("a", 4, rows(1, 4, 10)), ("a", 10, rows(1, 10, 12))])      # the prefix part never came
    f.finish("a", 3)
    rec = f.out["a"]
    assert not rec.complete and rec.missing == [(0, 4)] and rec.reason == "rows_not_delivered"
    assert (rec.prompt_routed_experts[:4] == -1).all()


def test_prefix_rows_not_found_in_the_store_are_flagged():
    f = Feed(finish_grace_s=0.0)
    f.open("a", 10, C=6, filled=True)
    pre = rows(1, 0, 6)
    pre[2:5] = -1                          # the producer's store had nothing for positions 2..4
    pre[1, 0] = -1                         # one layer of position 1 too
    f.delta([("a", 0, pre), ("a", 6, rows(1, 6, 12))])
    f.finish("a", 3)
    rec = f.out["a"]
    assert not rec.complete and rec.reason == "prefix_not_found"
    assert rec.missing == [(1, 5)]
    assert (rec.prompt_routed_experts[1:5] == -1).all()
    np.testing.assert_array_equal(rec.prompt_routed_experts[[0, 5]], rows(1, 0, 6)[[0, 5]])
    np.testing.assert_array_equal(rec.prompt_routed_experts[6:], rows(1, 6, 10))


def test_sentinel_mode_ignores_rows_sent_below_num_cached():
    f = Feed()
    f.open("a", 10, C=4)
    f.delta([("a", 0, rows(1, 0, 12))])
    f.finish("a", 3)
    check(f.out["a"], 1, 10, 3, 4)
    assert f.out["a"].num_prefix_filled == 0


def test_prefix_filled_with_pipeline_stages():
    f = Feed()
    f.open("a", 8, C=4, filled=True)
    f.delta([("a", 0, rows(1, 0, 11, layers=(0, 1)))], layers=(0, 1))
    f.delta([("a", 0, rows(1, 0, 4, layers=(1, 3))), ("a", 4, rows(1, 4, 11, layers=(1, 3)))], layers=(1, 3))
    f.finish("a", 4)
    rec = f.out["a"]
    full = rows(1, 0, 12)
    full[11] = -1
    assert rec.complete and rec.num_prefix_filled == 4
    np.testing.assert_array_equal(np.concatenate([rec.prompt_routed_experts, rec.routed_experts]), full)


def _plugin_steps(f, specs, steps, start_of, cuts_every=None):
    """`steps` decode steps batched into one delta as the vLLM plugin does: every request id once per step, one row
    each (ids repeat within the message)."""
    items = []
    for k in range(steps):
        for rid, seed in specs.items():
            pos = start_of[rid] + k
            items.append((rid, pos, rows(seed, pos, pos + 1)))
    cuts = None if cuts_every is None else list(range(cuts_every, len(items), cuts_every))
    f.delta(items, cuts=cuts)
    for rid in specs:
        start_of[rid] += steps


@pytest.mark.parametrize("cuts_every", [None, 3, 8])
def test_batched_steps_with_repeated_ids_land_bit_exact(cuts_every):
    """Deltas of 16 steps x n requests (ids repeated, one row each), in one frame or several: the whole-message
    append puts every row where it belongs."""
    f = Feed()
    specs = {f"r{i}": 10 + i for i in range(9)}
    P, G = 5, 40
    for rid, seed in specs.items():
        f.open(rid, P)
        f.delta([(rid, 0, rows(seed, 0, P))])                  # prefill (the request's first rows: entry by entry)
    start_of = dict.fromkeys(specs, P)
    for _ in range(2):
        _plugin_steps(f, specs, 16, start_of, cuts_every)
    _plugin_steps(f, specs, G - 1 - 32, start_of, cuts_every)   # the last row (position P + G - 1) is never fed
    for rid in specs:
        f.finish(rid, G)
    assert sorted(f.out) == sorted(specs)
    for rid, seed in specs.items():
        check(f.out[rid], seed, P, G, 0)
    assert f.acc.bytes_held == 0


def test_one_message_mixing_appends_new_requests_overwrites_and_holes():
    """One delta whose entries take both paths: appends of known requests (numpy, whole message), a new request,
    an overwrite (newest write wins), a hole (-1 and reported missing) and a zero-row entry; then plain appends
    again. Every record is exact."""
    f = Feed()
    for rid in ("a", "b", "c", "d"):
        f.open(rid, 4)
    f.delta([("a", 0, rows(1, 0, 4)), ("b", 0, rows(2, 0, 4)), ("c", 0, rows(3, 0, 4))])
    f.open("e", 4)
    f.delta([
        ("a", 4, rows(1, 4, 5)),                   # append
        ("b", 2, rows(2, 2, 4, variant=1)),        # overwrite of positions 2, 3 with other rows...
        ("c", 6, rows(3, 6, 7)),                   # hole at 4, 5
        ("e", 0, rows(5, 0, 4)),                   # a new request
        ("d", 0, rows(4, 0, 0)),                   # zero rows: says nothing
        ("a", 5, rows(1, 5, 6)),                   # a's second entry in the same message: still an append
        ("b", 2, rows(2, 2, 4)),                   # ...overwritten again with the true rows (later entry wins)
    ], cuts=[2, 4])
    f.delta([("a", 6, rows(1, 6, 7)), ("b", 4, rows(2, 4, 6)), ("c", 7, rows(3, 7, 8)), ("e", 4, rows(5, 4, 6)),
             ("d", 0, rows(4, 0, 6))])
    for rid in ("a", "b", "e", "d"):
        f.finish(rid, 3)
    f.finish("c", 5)
    f.tick(1.0)
    for rid, seed in (("a", 1), ("b", 2), ("e", 5), ("d", 4)):
        check(f.out[rid], seed, 4, 3, 0)
    r = f.out["c"]
    assert (r.complete, r.reason, r.missing) == (False, "rows_not_delivered", [(4, 6)])
    want_p, want_g = expected(3, 4, 5, 0)
    want_g[0:2] = -1
    np.testing.assert_array_equal(r.prompt_routed_experts, want_p)
    np.testing.assert_array_equal(r.routed_experts, want_g)
    assert f.acc.bytes_held == 0


def test_rows_spread_over_many_spaces_and_grown_regions(monkeypatch):
    """Regions of 16 rows in spaces of 64: requests outgrow their regions (rows copied to larger ones, several
    times each) and land in several spaces; a message's rows go to several spaces; every record is exact."""
    from routing_replay.consumer import accumulator, arena
    monkeypatch.setattr(accumulator, "Arena",
                        lambda rb, **kw: arena.Arena(rb, min_region_bytes=16 * rb, space_bytes=(64 * rb,), **kw))
    f = Feed()
    specs = {f"r{i}": 30 + i for i in range(7)}
    P, G = 45, 60                   # prefill rows go a region at a time, decode rows one by one
    for rid, seed in specs.items():
        f.open(rid, P)
        f.delta([(rid, 0, rows(seed, 0, P))])
    start_of = dict.fromkeys(specs, P)
    for _ in range(G - 1):
        f.delta([(rid, start_of[rid], rows(seed, start_of[rid], start_of[rid] + 1)) for rid, seed in specs.items()])
        for rid in specs:
            start_of[rid] += 1
    (a,) = {id(st.ranges[(0, L)].arena): st.ranges[(0, L)].arena for st in f.acc.requests.values()}.values()
    assert len(a.spaces) >= 4 and a.regions_grown >= 7
    for rid in specs:
        f.finish(rid, G)
    for rid, seed in specs.items():
        check(f.out[rid], seed, P, G, 0)
    assert f.acc.bytes_held == 0 and a.live_blocks == 0


@pytest.mark.copied_only
def test_records_are_views_and_their_regions_are_reused_only_once_dropped():
    """A record's arrays are views of the request's rows; while any view of it lives its region is not handed
    to another request (the record stays bit-exact through later traffic); once all are gone it is reused."""
    f = Feed()
    f.open("a", 40)
    f.delta([("a", 0, rows(1, 0, 40))])
    f.finish("a", 1)
    keep = f.out.pop("a").prompt_routed_experts[5:9]          # a view of a view: keeps the region
    (sh,) = f.acc._shapes.values()
    a = sh.arena
    region = a.min_region_rows
    for i in range(3):
        rid = f"b{i}"
        f.open(rid, 40)
        f.delta([(rid, 0, rows(7 + i, 0, 40))])
        f.finish(rid, 1)
        check(f.out.pop(rid), 7 + i, 40, 1, 0)
        np.testing.assert_array_equal(keep, rows(1, 5, 9))
    assert a.spaces[0].top == 2 * region           # "a" still leased; the b's reused one region
    del keep
    for i in range(3):
        f.open(f"c{i}", 40)
        f.delta([(f"c{i}", 0, rows(9, 0, 4))])
    assert a.spaces[0].top == 3 * region           # a's region came back: two free ones, one new
    assert f.acc.bytes_held == 3 * 4 * L * K * 2


def test_arena_falls_back_to_a_smaller_reservation_and_smaller_regions():
    """An address-space reservation the OS refuses (here: larger than any address space) falls back to the next
    size, and regions shrink so that the space holds a few hundred of them; rows and records stay exact."""
    from routing_replay.consumer import arena
    rb = L * K * 2
    a = arena.Arena(rb, min_region_bytes=1 << 16, space_bytes=(1 << 62, 1 << 20))
    first = a.min_region_rows
    (h,) = a.new_handles(1)
    assert len(a.spaces) == 1 and a.spaces[0].size == (1 << 20) // rb
    assert a.min_region_rows < first and a.min_region_rows == 256 and a.cap[h] == first
    (h2,) = a.new_handles(1)
    assert a.cap[h2] == 256
    src = arena.void_rows(rows(3, 0, 300).tobytes(), rb)
    a.write(h2, 0, src)                           # outgrows its 256-row region: moved to a 512-row one
    assert a.cap[h2] == 512 and a.regions_grown == 1
    np.testing.assert_array_equal(a.gather(h2, 300).view(np.int16).reshape(300, L, K), rows(3, 0, 300))


@pytest.mark.copied_only
def test_regions_of_finished_requests_are_reused():
    f = Feed()
    for round_ in range(3):
        for i in range(4):
            rid = f"q{round_}-{i}"
            f.open(rid, 40)
            f.delta([(rid, 0, rows(i, 0, 40))])
            f.finish(rid, 1)
            check(f.out.pop(rid), i, 40, 1, 0)
    (sh,) = f.acc._shapes.values()
    assert len(sh.arena.spaces) == 1 and sh.arena.spaces[0].top == sh.arena.min_region_rows
    assert sh.arena.live_blocks == 0 and f.acc.bytes_held == 0


@pytest.mark.copied_only
def test_freed_pages_beyond_keep_bytes_go_back_to_the_os(monkeypatch):
    """Freed regions keep their pages up to keep_bytes; beyond it, the pages of a freed region are returned
    (MADV_DONTNEED) and the region reads as zeros; records written there afterwards are still exact."""
    from routing_replay.consumer import accumulator, arena
    rb = L * K * 2
    monkeypatch.setattr(accumulator, "Arena", lambda rb, keep_bytes=None: arena.Arena(
        rb, min_region_bytes=1 << 16, keep_bytes=3 << 14))
    f = Feed()
    P = (1 << 16) // rb - 1                       # each request fills its 64 KiB region
    for i in range(4):
        f.open(f"r{i}", P)
        f.delta([(f"r{i}", 0, rows(i, 0, P))])
    for i in range(4):
        f.finish(f"r{i}", 1)
        check(f.out.pop(f"r{i}"), i, P, 1, 0)
    f.tick(0.0)                                   # the consumer's poll takes the freed regions back
    (sh,) = f.acc._shapes.values()
    a = sh.arena
    assert a.regions_returned == 4 and a.kept_bytes == 0          # each region's rows (64 KiB) > keep_bytes
    monkeypatch.setattr(a, "keep_bytes", 1 << 20)
    for i in range(4):
        f.open(f"s{i}", 100)
        f.delta([(f"s{i}", 0, rows(20 + i, 0, 100))])
        f.finish(f"s{i}", 1)
        check(f.out.pop(f"s{i}"), 20 + i, 100, 1, 0)
    f.tick(0.0)
    assert a.regions_returned == 4 and a.kept_bytes == 101 * rb and a.spaces[0].top == 4 * a.min_region_rows


@pytest.mark.copied_only
def test_freed_pages_are_kept_up_to_the_peak_held_so_the_next_batch_reuses_them(monkeypatch):
    """keep_bytes=None (the default): freed regions keep their pages up to the most the arena held at once, so a
    second batch of requests as large as the first writes into pages it already has (no region returned to the
    OS, no new region carved) and its records are exact; a fixed keep_bytes below that returns the rest."""
    from routing_replay.consumer import accumulator, arena
    rb = L * K * 2
    monkeypatch.setattr(arena, "KEEP_BYTES", 0)             # the limit is the peak alone
    made = []

    def make(rb, keep_bytes=None):
        made.append(arena.Arena(rb, min_region_bytes=1 << 16, keep_bytes=keep_bytes))
        return made[-1]

    monkeypatch.setattr(accumulator, "Arena", make)
    P = (1 << 16) // rb - 1                       # each request fills its 64 KiB region

    def batch(f, tag, seed0):
        for i in range(4):
            f.open(f"{tag}{i}", P)
            f.delta([(f"{tag}{i}", 0, rows(seed0 + i, 0, P))])
        for i in range(4):
            f.finish(f"{tag}{i}", 1)
            check(f.out.pop(f"{tag}{i}"), seed0 + i, P, 1, 0)
        f.tick(0.0)                               # the consumer's poll takes the freed regions back

    f = Feed()
    batch(f, "a", 0)
    a = made[-1]
    R = P + 1                                     # a record's rows: its -1 tail (the output token) is written too
    assert a.peak_bytes == 4 * R * rb and a.keep_limit == 4 * R * rb and a.leased_blocks == 0
    assert a.regions_returned == 0 and a.kept_bytes == 4 * R * rb and a.spaces[0].top == 4 * a.min_region_rows
    batch(f, "b", 10)
    assert a.regions_returned == 0 and a.kept_bytes == 4 * R * rb and a.spaces[0].top == 4 * a.min_region_rows
    assert a.peak_bytes == 4 * R * rb

    g = Feed(keep_bytes=2 * R * rb)
    batch(g, "c", 20)
    b = made[-1]
    assert b.keep_limit == 2 * R * rb and b.regions_returned == 2 and b.kept_bytes == 2 * R * rb
    with pytest.raises(ValueError, match="keep_bytes"):
        Accumulator(keep_bytes=-1)


@pytest.mark.parametrize("seed", range(6))
def test_whole_message_append_equals_entry_by_entry_on_random_traffic(seed):
    """Differential: random deltas (batched steps with repeated ids, new requests, overwrites, holes, zero-row
    entries, payloads cut into frames on request boundaries) applied to two accumulators, one with the whole-message
    append and one entry by entry only: every record is identical, bit for bit, and so is the memory held."""
    rng = np.random.default_rng(seed)
    fast, slow = Feed(), Feed()
    slow.acc._append = lambda d, bufs, sh, now: None          # every entry through the entry-by-entry path
    n_req = 12
    nxt = {}
    for i in range(n_req):
        P = int(rng.integers(1, 6))
        for f in (fast, slow):
            f.open(f"q{i}", P)
        nxt[f"q{i}"] = 0
    live = list(nxt)
    for step in range(40):
        items = []
        for _ in range(int(rng.integers(1, 4))):                # batched steps: ids repeat within a message
            for rid in rng.permutation(live).tolist():
                r = rng.random()
                c = int(rng.integers(0, 4))
                if r < 0.75:
                    s = nxt[rid]                                # an append
                elif r < 0.85:
                    s = max(0, nxt[rid] - int(rng.integers(1, 4)))   # an overwrite
                else:
                    s = nxt[rid] + int(rng.integers(1, 3))      # a hole
                items.append((rid, s, rows(sum(map(ord, rid)) % 97, s, s + c, variant=step % 3)))
                nxt[rid] = max(nxt[rid], s + c)
        cut = sorted(set(rng.integers(1, len(items), 2).tolist())) if len(items) > 2 and rng.random() < 0.5 else None
        for f in (fast, slow):
            f.delta(items, cuts=cut)
        if step % 10 == 9:                                      # some requests end, new ones come
            for rid in live[:3]:
                for f in (fast, slow):
                    f.finish(rid, 2)
            live = live[3:] + [f"n{step}-{j}" for j in range(3)]
            for rid in live[-3:]:
                for f in (fast, slow):
                    f.open(rid, 2)
                nxt[rid] = 0
        assert fast.acc.bytes_held == slow.acc.bytes_held
    for rid in live:
        for f in (fast, slow):
            f.finish(rid, 2)
    for f in (fast, slow):
        f.tick(10.0)
    assert sorted(fast.out) == sorted(slow.out) and len(fast.out) == n_req + 12
    for rid in fast.out:
        assert fast.out[rid].equals(slow.out[rid]), rid
    assert fast.acc.bytes_held == slow.acc.bytes_held == 0
    assert fast.acc.stats == slow.acc.stats


def test_records_dropped_on_another_thread_free_their_regions_safely():
    """A trainer thread checks and drops records while the accumulator keeps writing new requests: every record
    is exact when checked (no region was reused under it), and the regions come back (a bounded number made)."""
    import queue
    import threading
    f = Feed()
    q: queue.Queue = queue.Queue()
    bad = []

    def trainer():
        while True:
            item = q.get()
            if item is None:
                return
            seed, r = item
            try:
                check(r, seed, 30, 5, 0)
            except Exception as e:  # noqa: BLE001 (reported by the main thread, which must not wait forever)
                bad.append(e)
            finally:
                del r, item
                q.task_done()

    # a daemon that the main thread always stops: a failure on either side fails the test instead of hanging it
    t = threading.Thread(target=trainer, daemon=True)
    t.start()
    try:
        for i in range(300):
            rid = f"t{i}"
            f.open(rid, 30)
            f.delta([(rid, 0, rows(i, 0, 30))])
            for p in range(30, 34):
                f.delta([(rid, p, rows(i, p, p + 1))])
            f.finish(rid, 5)
            q.put((i, f.out.pop(rid)))
            if i % 10 == 9:
                q.join()            # the trainer dropped them (while this thread went on writing the next ten)
    finally:
        q.put(None)
        t.join(60)
    assert not t.is_alive()
    f.tick(0.0)
    (sh,) = f.acc._shapes.values()
    assert not bad and f.acc.bytes_held == 0
    assert sh.arena.spaces[0].top <= 11 * sh.arena.min_region_rows
    assert sum(len(v) for v in sh.arena.free.values()) * sh.arena.min_region_rows == sh.arena.spaces[0].top


def _scenarios(f):
    """Requests that end in every way _build tells apart; returns the ids whose record is complete."""
    f.open("plain", 6)                                           # complete, nothing cached
    f.open("cached", 6, C=3)                                     # prefix-cache hits: rows [0, 3) are -1
    f.open("tokens", 4, tokens=[5, 6, 7, 8])
    f.open("no_output", 5)                                       # G = 0: every prompt row is computed
    f.open("last_fed", 4)                                        # a row for the last output token came too
    f.open("hole", 6)                                            # a hole below n: incomplete
    f.open("short", 6)                                           # rows end early: incomplete, waits for grace
    f.open("layers", 6)                                          # two layer ranges
    f.open("filled", 6, C=2, filled=True)                        # prefix rows sent by the producer
    f.open("lost", 6)
    f.open("aborted", 6)
    f.delta([("plain", 0, rows(1, 0, 8)), ("cached", 3, rows(2, 3, 8)), ("tokens", 0, rows(3, 0, 5)),
             ("no_output", 0, rows(4, 0, 5)), ("last_fed", 0, rows(5, 0, 7)), ("hole", 0, rows(6, 0, 2)),
             ("hole", 4, rows(6, 4, 8)), ("short", 0, rows(7, 0, 5)), ("filled", 0, rows(8, 0, 8)),
             ("lost", 0, rows(9, 0, 8)), ("aborted", 0, rows(10, 0, 4))])
    f.delta([("layers", 0, rows(11, 0, 8, layers=(0, 1)))], layers=(0, 1))
    f.delta([("layers", 0, rows(11, 0, 8, layers=(1, L)))], layers=(1, L))
    for rid in ("plain", "cached", "hole", "short", "layers", "filled"):
        f.finish(rid, 3)
    f._apply("finish", "tokens", {"num_output": 2, "n_output_tokens": 2}, [np.asarray([9, 10], np.int32).tobytes()])
    f.finish("no_output", 0)
    f.finish("last_fed", 3)
    f.finish("lost", 3, lost=[[2, 4]])
    f.abort("aborted")
    f.tick(10.0)
    return {"plain", "cached", "tokens", "no_output", "last_fed", "layers", "filled"}


def test_the_whole_request_shortcut_builds_the_same_records_as_the_general_path(monkeypatch):
    """records.build_whole (a request that ended the usual way) against the general path (build_record) on the
    same messages: every record equal, the shortcut taken exactly for the single-range complete ones."""
    from routing_replay.consumer import accumulator
    taken = []
    fast = Feed()
    whole = accumulator.build_whole

    def spy(st):
        rec = whole(st)
        if rec is not None:
            taken.append(st.rid)
        return rec

    monkeypatch.setattr(accumulator, "build_whole", spy)
    complete = _scenarios(fast)
    monkeypatch.setattr(accumulator, "build_whole", lambda st: None)
    general = Feed()
    assert _scenarios(general) == complete
    assert sorted(fast.out) == sorted(general.out) and len(fast.out) == 11
    for rid, rec in general.out.items():
        assert fast.out[rid].equals(rec), rid
        assert rec.complete == (rid in complete), (rid, rec.reason, rec.missing)
    assert sorted(taken) == ["cached", "last_fed", "no_output", "plain", "tokens"]
    check(fast.out["plain"], 1, 6, 3, 0)
    check(fast.out["cached"], 2, 6, 3, 3)
    # records of one model share no layer-id array (each record owns its copy)
    a, b = fast.out["plain"].moe_layer_ids, fast.out["cached"].moe_layer_ids
    assert a.tolist() == b.tolist() == list(range(L)) and not np.shares_memory(a, b)


def _adoption_scenarios(f):
    """Requests whose first rows come in a message the accumulator can keep as received (each from position 0,
    once, alone with other such requests), ending in every way that matters to that path."""
    for rid, P in (("prefill", 6), ("last_fed", 4), ("no_output", 5), ("decoded", 4), ("resent", 4),
                   ("aborted", 4), ("lost", 6), ("filled", 6), ("beyond", 4), ("stage", 4), ("silent", 4)):
        f.open(rid, P, C=2 if rid == "filled" else 0, filled=rid == "filled")
    f.delta([("prefill", 0, rows(1, 0, 8)), ("last_fed", 0, rows(2, 0, 7)), ("no_output", 0, rows(3, 0, 5))],
            cuts=[1])                                    # two frames: an entry never straddles them
    f.delta([("decoded", 0, rows(4, 0, 4)), ("resent", 0, rows(5, 0, 4)), ("aborted", 0, rows(6, 0, 2)),
             ("lost", 0, rows(7, 0, 8)), ("filled", 0, rows(8, 0, 8)), ("beyond", 0, rows(9, 0, 9)),
             ("silent", 0, rows(11, 0, 2))])
    f.delta([("stage", 0, rows(10, 0, 6, layers=(0, 1)))], layers=(0, 1))     # a pipeline stage's layers
    f.delta([("stage", 0, rows(10, 0, 6, layers=(1, L)))], layers=(1, L))
    for p in range(4, 6):                                # decode rows after the prompt: the fast append path
        f.delta([("decoded", p, rows(4, p, p + 1))])
    f.delta([("resent", 0, rows(5, 0, 4))])              # a resend after a rewind: the checked overwrite path
    f.delta([("resent", 4, rows(5, 4, 5))])
    for rid in ("prefill", "decoded", "resent", "filled", "stage"):
        f.finish(rid, 3)
    f.finish("last_fed", 4)
    f.finish("no_output", 0)
    f.finish("lost", 3, lost=[[2, 4]])
    f.finish("beyond", 2)                                # rows past the record's end (drafts): left out
    f.abort("aborted")
    f.tick(1.0)
    f.tick(700.0)                                        # "silent" never ends: timed out
    return f


@pytest.mark.copied_only
def test_a_prefill_message_kept_as_received_gives_the_records_the_copied_rows_give():
    """Rows kept as received (Accumulator._adopt) against rows copied into the arena, on the same messages: every
    record bit for bit the same, the prompt rows a view of the received frame where nothing else came, and the
    kept rows moved to the arena (one copy) for every other way a request goes on or ends."""
    Feed.adopt = True
    kept = _adoption_scenarios(Feed())
    Feed.adopt = False
    copied = _adoption_scenarios(Feed())
    assert sorted(kept.out) == sorted(copied.out) and len(kept.out) == 11
    for rid, rec in copied.out.items():
        assert kept.out[rid].equals(rec), rid
    s = kept.acc.stats
    # every request but "stage" was kept from its first message; "stage" twice (one per layer range)
    assert (s.adopted, s.adopted_records, s.materialized) == (12, 3, 9)
    assert (copied.acc.stats.adopted, copied.acc.stats.adopted_records) == (0, 0)
    check(kept.out["prefill"], 1, 6, 3, 0)
    check(kept.out["decoded"], 4, 4, 3, 0)
    assert not kept.out["silent"].complete and kept.out["silent"].reason == "timeout"
    for acc in (kept.acc, copied.acc):
        assert acc.in_flight == 0 and acc.bytes_held == 0


@pytest.mark.copied_only
def test_kept_rows_are_a_writable_view_of_the_frame_and_small_or_mixed_messages_are_copied():
    f = Feed(adopt_min_bytes=4 * L * K * 2)
    frames = []
    real = f.acc.apply

    def spy(h, fr, now):
        frames.extend(fr)
        return real(h, fr, now)

    f.acc.apply = spy
    Feed.adopt = True
    f.open("a", 6)
    f.open("b", 4)
    f.open("small", 3)
    f.open("old", 4)
    f.delta([("a", 0, rows(1, 0, 6)), ("b", 0, rows(2, 0, 4))])
    assert f.acc.stats.adopted == 2 and f.acc.bytes_held == 10 * L * K * 2
    f.delta([("small", 0, rows(3, 0, 3))])                       # under adopt_min_bytes: copied
    f.delta([("old", 0, rows(4, 0, 2))])
    f.delta([("old", 2, rows(4, 2, 4)), ("c", 0, rows(5, 0, 8))])  # one entry continues a request: all copied
    assert f.acc.stats.adopted == 2
    f.finish("a", 1)
    f.finish("b", 1)
    a = f.out["a"].prompt_routed_experts
    frame = np.frombuffer(next(x for x in frames if len(x) == 10 * L * K * 2), dtype=np.int16)
    assert np.shares_memory(a, frame) and a.flags.writeable
    check(f.out["a"], 1, 6, 1, 0)
    check(f.out["b"], 2, 4, 1, 0)
    a[0, 0, 0] = 99                                              # the record's own: nothing else refers to it
    assert f.acc.stats.adopted_records == 2 and f.acc.in_flight == 3


@pytest.mark.copied_only
def test_frames_that_are_not_writable_are_always_copied():
    Feed.adopt = False                                           # bytes frames, as the other tests' copied mode
    f = Feed(adopt_min_bytes=0)
    f.open("a", 4)
    f.delta([("a", 0, rows(1, 0, 4))])
    f.finish("a", 1)
    check(f.out["a"], 1, 4, 1, 0)
    assert (f.acc.stats.adopted, f.acc.stats.adopted_records) == (0, 0)


def test_a_newer_open_of_an_id_whose_record_waits_out_its_grace_lets_that_record_out_first():
    """An id reused right after its finish (the engine sends the finish, then the next request's open) while the
    finished record waits for late rows: that record comes out as it is (incomplete, its hole named), it is not
    dropped, and the new request starts empty under the id."""
    f = Feed(finish_grace_s=10.0)
    got = []
    f.open("dup", 4)
    f.delta([("dup", 0, rows(3, 0, 2))])
    f.delta([("dup", 4, rows(3, 4, 6))])      # positions 2, 3 not delivered
    f.finish("dup", 3)
    assert "dup" not in f.out                 # waits for late rows
    f.seq += 1
    h = wire.decode_header(wire.pack_header("open", "p", 0, f.seq, "dup", {
        "prompt_len": 5, "num_cached": 0, "num_layers": L, "top_k": K, "layer_ids": list(range(L))}))
    got += f.acc.apply(h, [], f.now)
    assert [r.request_id for r in got] == ["dup"]
    first = got[0]
    assert not first.complete and first.missing == [(2, 4)] and first.reason == "rows_not_delivered"
    ep, eg = expected(3, 4, 3, 0)
    ep[2:4] = -1
    np.testing.assert_array_equal(first.prompt_routed_experts, ep)
    np.testing.assert_array_equal(first.routed_experts, eg)
    f.delta([("dup", 0, rows(4, 0, 7))])
    f.finish("dup", 3)
    check(f.out["dup"], 4, 5, 3, 0)
    assert (f.acc.stats.finished, f.acc.in_flight, f.acc.pending_finish) == (2, 0, {})


def test_an_id_opened_by_another_producer_while_in_flight_marks_the_record_not_mixes_it_silently():
    """Two engines (producers p and q) each run a request with the same user id at once: their rows land on one
    key here and cannot be told apart, so the record says so (key_collision); the same id from the same producer
    (a resend) and a request of another id stay as they were."""
    f = Feed()

    def send(producer, kind, key, body, frames=()):
        f.seq += 1
        h = wire.decode_header(wire.pack_header(kind, producer, 0, f.seq, key, body))
        for r in f.acc.apply(h, list(frames), f.now):
            f.out[r.request_id] = r

    body = {"prompt_len": 4, "num_cached": 0, "num_layers": L, "top_k": K, "layer_ids": list(range(L))}
    send("p", "open", "dup", body)
    send("p", "open", "other", body)
    f.delta([("dup", 0, rows(1, 0, 4)), ("other", 0, rows(2, 0, 4))])
    send("p", "open", "dup", body)                  # a resend of p's own open: nothing changes
    assert f.acc.stats.key_collisions == 0
    send("q", "open", "dup", body)
    assert f.acc.stats.key_collisions == 1
    f.delta([("dup", 4, rows(1, 4, 6)), ("other", 4, rows(2, 4, 6))])
    send("p", "finish", "dup", {"num_output": 3, "reason": "stop"})
    f.finish("other", 3)
    f.tick(1.0)                                     # (marked: it waits out its grace like any incomplete one)
    r = f.out["dup"]
    assert not r.complete and r.reason == "key_collision" and r.missing == []
    check(f.out["other"], 2, 4, 3, 0)
