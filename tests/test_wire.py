"""Codec tests on bytes alone: round trips, and every kind of malformed header refused with its reason."""

import msgpack
import numpy as np
import pytest

from routing_replay.protocol import wire


def delta_header(ids=("a", "b"), starts=(0, 5), counts=(3, 1), L=4, K=2, **extra):
    body = wire.delta_body(starts, counts, L, K)
    body.update(extra)
    return wire.pack_header("delta", "p1", 7, 9, list(ids), body)


def test_delta_round_trip():
    h = wire.decode_header(delta_header())
    assert (h.version, h.kind, h.producer, h.epoch, h.seq) == (2, "delta", "p1", 7, 9)
    d = wire.parse_delta(h)
    assert d.request_ids == ["a", "b"]
    assert d.starts.tolist() == [0, 5] and d.counts.tolist() == [3, 1]
    assert (d.num_layers, d.top_k, d.layer_lo, d.layer_hi, d.row_bytes, d.total_rows) == (4, 2, 0, 4, 16, 4)
    wire.check_payload(d, [bytes(64)])
    wire.check_payload(d, [bytes(48), bytes(16)])   # split on the request boundary


def test_layer_range_round_trip():
    body = wire.delta_body([0], [2], 8, 2, layer_lo=4, layer_hi=8)
    d = wire.parse_delta(wire.decode_header(wire.pack_header("delta", "p", 0, 0, ["x"], body)))
    assert (d.layer_lo, d.layer_hi, d.row_bytes) == (4, 8, 16)


def test_open_finish_abort_round_trip():
    o = wire.parse_open(wire.decode_header(wire.pack_header(
        "open", "p", 0, 1, "r", {"prompt_len": 10, "num_cached": 4, "num_layers": 3, "top_k": 2,
                                 "layer_ids": [0, 2, 3], "n_prompt_tokens": 10})))
    assert (o.request_id, o.prompt_len, o.num_cached, o.num_layers, o.top_k, o.layer_ids, o.n_prompt_tokens) == \
        ("r", 10, 4, 3, 2, [0, 2, 3], 10)
    f = wire.parse_finish(wire.decode_header(wire.pack_header(
        "finish", "p", 0, 2, "r", {"num_output": 5, "reason": "length", "lost": [[3, 6]]})))
    assert (f.num_output, f.reason, f.lost, f.prompt_len, f.refused, f.broker_refused) == \
        (5, "length", [(3, 6)], None, [], [])
    f = wire.parse_finish(wire.decode_header(wire.pack_header(
        "finish", "p", 0, 2, "r", {"num_output": 5, "lost": [[1, 2], [3, 6], [7, 9]], "refused": [[3, 6]],
                                   "broker_refused": [[7, 9]]})))
    assert (f.lost, f.refused, f.broker_refused) == ([(1, 2), (3, 6), (7, 9)], [(3, 6)], [(7, 9)])
    for field in ("refused", "broker_refused"):
        for bad in ([[3]], [[4, 3]], "x", [[0, 1]] * 4097):
            with pytest.raises(wire.ProtocolError, match=f"^{field} "):
                wire.parse_finish(wire.decode_header(wire.pack_header(
                    "finish", "p", 0, 2, "r", {"num_output": 5, field: bad})))
    assert wire.parse_abort(wire.decode_header(wire.pack_header("abort", "p", 0, 3, "r", {}))) == ("r", "abort", None)
    assert wire.parse_refused(wire.decode_header(wire.pack_header(
        "refused", "p", 0, 4, ["r", "s"], {"reason": "out_of_range: x"}))) == (["r", "s"], "out_of_range: x")
    for key, body, match in (("r", {}, "list of at most"), (["r", ""], {}, "bad_request_id|empty"),
                             (["r"], {"reason": 7}, "reason must be a str")):
        with pytest.raises(wire.ProtocolError, match=match):
            wire.parse_refused(wire.decode_header(wire.pack_header("refused", "p", 0, 4, key, body)))


def test_record_round_trip():
    rng = np.random.default_rng(0)
    rec = wire.Record("r/1", rng.integers(-1, 8, (5, 3, 2)).astype(np.int16),
                      rng.integers(-1, 8, (4, 3, 2)).astype(np.int16), 2, np.array([0, 2, 3], np.int32), False,
                      [(6, 8)], "rows_not_delivered", "stop", np.arange(5, dtype=np.int32), None)
    frames = [bytes(memoryview(f)) if not isinstance(f, bytes) else f for f in wire.encode_record(rec, "c", 1)]
    back = wire.decode_record(wire.decode_header(frames[0]), frames[1:])
    assert back.equals(rec)
    assert back.missing == [(6, 8)] and back.output_token_ids is None


def _split_record(rec, cuts_p, cuts_g):
    """rec's frames with its prompt rows cut at rows `cuts_p` and its generation rows at `cuts_g` (row_frames
    set): what encode_record sends for a part over MAX_PAYLOAD_FRAME_BYTES, at small sizes."""
    head, p, g, *rest = wire.encode_record(rec, "c", 1)
    h = msgpack.unpackb(head)
    parts_p, parts_g = np.split(np.asarray(p), cuts_p), np.split(np.asarray(g), cuts_g)
    h[6]["row_frames"] = [len(parts_p), len(parts_g)]
    return h, [bytes(memoryview(np.ascontiguousarray(x))) for x in [*parts_p, *parts_g, *rest]]


def test_record_rows_in_several_frames_decode_to_the_same_record():
    rng = np.random.default_rng(1)
    rec = wire.Record("r/2", rng.integers(-1, 8, (7, 3, 2)).astype(np.int16),
                      rng.integers(-1, 8, (5, 3, 2)).astype(np.int16), 0, np.array([0, 1, 2], np.int32), True,
                      [], "", "length", np.arange(7, dtype=np.int32), np.arange(5, dtype=np.int32))
    h, frames = _split_record(rec, [2, 6], [1])
    back = wire.decode_record(wire.decode_header(msgpack.packb(h)), frames)
    assert back.equals(rec) and back.prompt_routed_experts.flags.owndata
    # frames that do not hold whole rows, a count that does not match, an empty middle frame, a bad field
    bad = [([2, 6], [1], lambda h, f: (h, [f[0][:-2], f[1] + f[0][-2:], *f[2:]]), "size_mismatch"),
           ([2, 6], [1], lambda h, f: (h, f[:-1]), "frame_count"),
           ([2, 2], [1], lambda h, f: (h, f), "size_mismatch"),
           ([2, 6], [1], lambda h, f: ({**h, 6: {**h[6], "row_frames": [3]}}, f), "bad_field"),
           ([2, 6], [1], lambda h, f: ({**h, 6: {**h[6], "row_frames": [0, 5]}}, f), "bad_field"),
           ([2, 6], [1], lambda h, f: ({**h, 6: {**h[6], "row_frames": [3, 2.0]}}, f), "bad_field")]
    for cp, cg, mutate, reason in bad:
        h, frames = _split_record(rec, cp, cg)
        h, frames = mutate(dict(enumerate(h)), frames)
        with pytest.raises(wire.ProtocolError) as e:
            wire.decode_record(wire.decode_header(msgpack.packb([h[i] for i in range(7)])), frames)
        assert e.value.reason == reason, (cp, reason, str(e.value))


def test_a_record_part_over_the_frame_limit_is_encoded_in_frames_under_it():
    """Frames of at most MAX_PAYLOAD_FRAME_BYTES (each receiving socket's ZMQ_MAXMSGSIZE, less room for CURVE),
    views of the record's rows; a record that fits is one frame per part, with no row_frames field, as before."""
    L, K = 48, 8
    per = wire.MAX_PAYLOAD_FRAME_BYTES // (L * K * 2)           # 1,398,016 rows
    prompt = np.resize(np.arange(30011, dtype=np.int16), (per + 5, L, K))
    rec = wire.Record("big", prompt, prompt[:3], 0, np.arange(L, dtype=np.int32), True)
    head, *frames = wire.encode_record(rec, "c", 0)
    assert msgpack.unpackb(head)[6]["row_frames"] == [2, 1]
    assert [len(f) for f in frames] == [per, 5, 3]
    assert all(f.nbytes <= wire.MAX_PAYLOAD_FRAME_BYTES for f in frames) and np.shares_memory(frames[1], prompt)
    back = wire.decode_record(wire.decode_header(head), [memoryview(f).cast("B") for f in frames])
    assert back.equals(rec)
    small = wire.Record("s", prompt[:per], prompt[:1], 0, np.arange(L, dtype=np.int32), True)
    head, *frames = wire.encode_record(small, "c", 0)
    assert "row_frames" not in msgpack.unpackb(head)[6] and [len(f) for f in frames] == [per, 1]


@pytest.mark.parametrize("frame,reason", [
    (b"", "undecodable"),
    (b"\xc1\xff\x00garbage", "undecodable"),
    (msgpack.packb({"a": 1}), "bad_header"),
    (msgpack.packb([1, "delta", "p", 0, 0]), "bad_header"),
    (msgpack.packb([3, "delta", "p", 0, 0, [], {}]), "bad_version"),
    (msgpack.packb(["1", "delta", "p", 0, 0, [], {}]), "bad_version"),
    (msgpack.packb([1, "teleport", "p", 0, 0, [], {}]), "unknown_kind"),
    (msgpack.packb([1, "delta", "p", -1, 0, [], {}]), "bad_header"),
    (msgpack.packb([1, "delta", "p", 0, 0, [], []]), "bad_header"),
    (msgpack.packb([1, "delta", 5, 0, 0, [], {}]), "bad_header"),
    (b"\x00" * (wire.MAX_HEADER_BYTES + 1), "header_too_large"),
])
def test_bad_headers_refused(frame, reason):
    with pytest.raises(wire.ProtocolError) as e:
        wire.decode_header(frame)
    assert e.value.reason == reason


def i32(*v):
    return np.array(v, dtype="<i4").tobytes()


@pytest.mark.parametrize("key,body,reason", [
    (["a"], {"start": i32(0), "count": i32(1), "num_layers": 4}, "missing_field"),
    (["a"], {"start": i32(0), "count": i32(1, 2), "num_layers": 4, "top_k": 2}, "bad_field"),
    (["a"], {"start": [0], "count": i32(1), "num_layers": 4, "top_k": 2}, "bad_field"),
    (["a"], {"start": b"\x00\x00\x00", "count": i32(1), "num_layers": 4, "top_k": 2}, "bad_field"),
    (["a"], {"start": i32(-1), "count": i32(1), "num_layers": 4, "top_k": 2}, "out_of_range"),
    (["a"], {"start": i32(0), "count": i32(wire.MAX_ROWS_PER_DELTA + 1), "num_layers": 4, "top_k": 2},
     "out_of_range"),
    (["a", "b"], {"start": i32(0, 0), "count": i32(wire.MAX_ROWS_PER_DELTA, 1), "num_layers": 4, "top_k": 2},
     "too_large"),
    (["a"], {"start": i32(0), "count": i32(1), "num_layers": 1 << 20, "top_k": 2}, "bad_field"),
    (["a"], {"start": i32(0), "count": i32(1), "num_layers": 4, "top_k": 0}, "bad_field"),
    (["a"], {"start": i32(0), "count": i32(1), "num_layers": 4, "top_k": 2, "layer_lo": 3, "layer_hi": 2},
     "bad_field"),
    ([7], {"start": i32(0), "count": i32(1), "num_layers": 4, "top_k": 2}, "bad_request_id"),
    ([""], {"start": i32(0), "count": i32(1), "num_layers": 4, "top_k": 2}, "bad_request_id"),
    ("a", {"start": i32(0), "count": i32(1), "num_layers": 4, "top_k": 2}, "bad_field"),
])
def test_bad_delta_bodies_refused(key, body, reason):
    with pytest.raises(wire.ProtocolError) as e:
        wire.parse_delta(wire.decode_header(wire.pack_header("delta", "p", 0, 0, key, body)))
    assert e.value.reason == reason


def test_overlong_request_id_refused_by_the_unpack_limit():
    with pytest.raises(wire.ProtocolError) as e:
        wire.decode_header(wire.pack_header("delta", "p", 0, 0, ["x" * (wire.MAX_REQUEST_ID_BYTES + 1)],
                                            wire.delta_body([0], [1], 4, 2)))
    assert e.value.reason == "undecodable"


def test_request_id_problem_counts_utf8_bytes():
    """The one rule for ids (every sender): a non-empty str of at most MAX_REQUEST_ID_BYTES UTF-8 bytes; ASCII ids
    are judged by their length, others by their encoding (lone surrogates have none)."""
    M = wire.MAX_REQUEST_ID_BYTES
    assert wire.request_id_problem("cmpl-7") is None and wire.request_id_problem("a" * M) is None
    assert wire.request_id_problem("é" * (M // 2)) is None                   # 2 bytes each: exactly M
    assert wire.request_id_problem("a" * (M + 1)) == f"request id of {M + 1} characters exceeds {M} UTF-8 bytes"
    assert wire.request_id_problem("é" * (M // 2 + 1)) == (f"request id of {M // 2 + 1} characters is {M + 2} "
                                                           f"UTF-8 bytes, limit {M}")
    assert wire.request_id_problem("id-\udc80").startswith("request id is not encodable as UTF-8")
    assert wire.request_id_problem("").startswith("request id must be a non-empty str")
    assert wire.request_id_problem(b"x").startswith("request id must be a non-empty str, got bytes")


def test_payload_size_and_split_checked():
    d = wire.parse_delta(wire.decode_header(delta_header()))
    with pytest.raises(wire.ProtocolError) as e:
        wire.check_payload(d, [bytes(63)])
    assert e.value.reason == "size_mismatch"
    with pytest.raises(wire.ProtocolError) as e:
        wire.check_payload(d, [bytes(40), bytes(24)])
    assert e.value.reason == "split_mid_request"


def test_open_with_cached_beyond_prompt_refused():
    with pytest.raises(wire.ProtocolError) as e:
        wire.parse_open(wire.decode_header(wire.pack_header(
            "open", "p", 0, 1, "r", {"prompt_len": 4, "num_cached": 5, "num_layers": 3, "top_k": 2})))
    assert e.value.reason == "bad_field"


def test_an_opens_layer_ids_are_checked_the_same_after_an_equal_list_was_accepted():
    """parse_open keeps the last accepted layer_ids list and hands it to the next open with an equal one: a list
    equal in value but not of ints, or of another length, is still refused exactly as without that shortcut."""
    def open_with(ids, L=3):
        body = {"prompt_len": 4, "num_cached": 0, "num_layers": L, "top_k": 2}
        if ids is not None:
            body["layer_ids"] = ids
        return wire.parse_open(wire.decode_header(wire.pack_header("open", "p", 0, 1, "r", body)))

    first = open_with([0, 2, 5]).layer_ids
    assert first == [0, 2, 5] and open_with([0, 2, 5]).layer_ids is first
    for bad in ([0.0, 2.0, 5.0], [0, 2, 5.0], [0, 2], [0, 2, 5, 6], [0, 2, -5], "025", [0, 2, None]):
        with pytest.raises(wire.ProtocolError) as e:
            open_with(bad)
        assert e.value.reason in ("bad_field", "out_of_range"), bad
    assert open_with([True, 2, 5]).layer_ids == [1, 2, 5]            # bools are ints (as before the shortcut)
    assert open_with([0, 2, 5]).layer_ids == [0, 2, 5]
    assert open_with(None).layer_ids == [0, 1, 2] and open_with(None, L=2).layer_ids == [0, 1]
    with pytest.raises(wire.ProtocolError):
        open_with([0, 1, 2], L=2)
    body = {"prompt_len": 4, "num_cached": 0, "num_layers": 3, "top_k": 2, "layer_ids": None}   # null: not absent
    with pytest.raises(wire.ProtocolError) as e:
        wire.parse_open(wire.decode_header(wire.pack_header("open", "p", 0, 1, "r", body)))
    assert e.value.reason == "bad_field"
