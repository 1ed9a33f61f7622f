"""Compact expert ids on bytes alone: the dtype rule, narrowing and widening, protocol v2's `ids` field on every
message that carries or announces rows, v1 headers still read, and the broker's split by the row size of the
message."""

import msgpack
import numpy as np
import pytest

from routing_replay.broker.split import split_delta
from routing_replay.protocol import wire

U1, U2, I2 = np.dtype("u1"), np.dtype("<u2"), np.dtype("<i2")


def test_id_dtype_rule():
    assert [wire.id_dtype(n) for n in (1, 8, 128, 255, 256, 300, 65535, None)] == [U1, U1, U1, U1, U2, U2, U2, I2]
    assert [wire.missing_id(d) for d in (U1, U2, I2)] == [255, 65535, -1]
    assert [wire.ids_code(d) for d in ("uint8", "uint16", "int16")] == ["u1", "u2", "i2"]
    with pytest.raises(ValueError, match="num_experts=65536"):
        wire.id_dtype(65536)
    with pytest.raises(ValueError, match="num_experts=0"):
        wire.id_dtype(0)
    with pytest.raises(ValueError, match="'int32'"):
        wire.as_id_dtype("int32")


def test_narrow_and_widen_exact():
    rows = np.array([[[0, 7], [-1, 254]], [[-1, -1], [3, 1]]], dtype=I2)
    u1 = wire.narrow_rows(rows, U1)
    assert u1.dtype == U1 and u1.tolist() == [[[0, 7], [255, 254]], [[255, 255], [3, 1]]]
    u2 = wire.narrow_rows(rows, U2)
    assert u2.dtype == U2 and u2.tolist() == [[[0, 7], [65535, 254]], [[65535, 65535], [3, 1]]]
    for a in (u1, u2):
        w = wire.widen_rows(a)
        assert w.dtype == I2 and np.array_equal(w, rows)
    assert wire.widen_rows(rows) is rows
    with pytest.raises(ValueError, match="expert id 255 does not fit uint8"):
        wire.narrow_rows(np.array([[[255]]], I2), U1)
    with pytest.raises(ValueError, match="expert id -2 does not fit uint16"):
        wire.narrow_rows(np.array([[[-2]]], I2), U2)
    with pytest.raises(ValueError, match="expert id 40000 does not fit int16"):
        wire.widen_rows(np.array([[[40000]]], U2))
    # the missing value is all one-bits in every dtype: holes are 0xff bytes whatever the dtype
    assert all(np.frombuffer(b"\xff\xff", d)[0] == wire.missing_id(d) for d in (U1, U2, I2))


def delta(dtype, starts=(0, 5), counts=(3, 1), L=4, K=2, version=None, ids=("a", "b")):
    body = wire.delta_body(starts, counts, L, K, ids=dtype)
    if version is None:
        return wire.pack_header("delta", "p1", 7, 9, list(ids), body)
    return msgpack.packb([version, "delta", "p1", 7, 9, list(ids), body], use_bin_type=True)


@pytest.mark.parametrize("dtype,code,row_bytes", [(U1, "u1", 8), (U2, "u2", 16), (I2, None, 16)])
def test_delta_states_its_dtype(dtype, code, row_bytes):
    h = wire.decode_header(delta(dtype))
    assert h.body.get("ids") == code and h.version == 2
    d = wire.parse_delta(h)
    assert (d.dtype, d.row_bytes, d.total_rows) == (dtype, row_bytes, 4)
    wire.check_payload(d, [bytes(4 * row_bytes)])
    wire.check_payload(d, [bytes(3 * row_bytes), bytes(row_bytes)])
    with pytest.raises(wire.ProtocolError) as e:
        wire.check_payload(d, [bytes(4 * row_bytes + (8 if dtype == U1 else -16))])
    assert e.value.reason == "size_mismatch" and dtype.name in str(e.value)


def test_v1_int16_frame_still_decodes():
    h = wire.decode_header(delta(I2, version=1))
    d = wire.parse_delta(h)
    assert (h.version, d.dtype, d.row_bytes) == (1, I2, 16)
    o = wire.parse_open(wire.decode_header(msgpack.packb(
        [1, "open", "p", 0, 1, "r", {"prompt_len": 4, "num_cached": 0, "num_layers": 4, "top_k": 2}])))
    assert o.id_dtype == I2
    # a v1 peer never states ids: a v1 header that does is refused, never read as compact
    with pytest.raises(wire.ProtocolError) as e:
        wire.parse_delta(wire.decode_header(delta(U1, version=1)))
    assert e.value.reason == "bad_field" and "'u1' in a protocol v1 header" in str(e.value)


def test_version_3_and_unknown_ids_refused_naming_them():
    with pytest.raises(wire.ProtocolError) as e:
        wire.decode_header(delta(U1, version=3))
    assert e.value.reason == "bad_version" and "protocol version 3, this peer speaks 1, 2" in str(e.value)
    for kind, body in (("delta", dict(wire.delta_body([0], [1], 2, 2), ids="u3")),
                       ("open", {"prompt_len": 1, "num_cached": 0, "num_layers": 2, "top_k": 2, "ids": "u3"}),
                       ("opens", dict(wire.opens_body([1], [0], 2, 2), ids="i4"))):
        h = wire.decode_header(wire.pack_header(kind, "p", 0, 1, ["r"] if kind != "open" else "r", body))
        with pytest.raises(wire.ProtocolError) as e:
            {"delta": wire.parse_delta, "open": wire.parse_open, "opens": wire.parse_opens}[kind](h)
        assert e.value.reason == "bad_field" and f"ids {body['ids']!r}" in str(e.value), kind


def test_open_and_opens_carry_ids():
    o = wire.parse_open(wire.decode_header(wire.pack_header(
        "open", "p", 0, 1, "r", {"prompt_len": 3, "num_cached": 1, "num_layers": 2, "top_k": 2, "ids": "u2"})))
    assert o.id_dtype == U2 and wire.open_body(o)["ids"] == "u2"
    h = wire.decode_header(wire.pack_header("opens", "p", 0, 2, ["a", "b"], wire.opens_body([3, 4], [0, 0], 2, 2,
                                                                                            ids=U1)))
    os_, _ = wire.parse_opens(h)
    assert os_.id_dtype == U1 and os_.open_at(1).id_dtype == U1
    single = wire.decode_header(os_.single(h, None, 1, True)[0])
    assert single.body["ids"] == "u1" and wire.parse_open(single).id_dtype == U1
    sub = wire.decode_header(wire.subset_opens(h, os_, None, [1])[0])
    assert wire.parse_opens(sub)[0].id_dtype == U1


def record(dtype):
    rng = np.random.default_rng(5)
    pr = rng.integers(0, 200, (5, 3, 2)).astype(dtype)
    pr[:2] = wire.missing_id(dtype)
    ge = rng.integers(0, 200, (4, 3, 2)).astype(dtype)
    ge[-1] = wire.missing_id(dtype)
    return wire.Record("r", pr, ge, 2, np.array([1, 3, 5], np.int32), True, [], "", "stop",
                       np.arange(5, dtype=np.int32), np.arange(4, dtype=np.int32))


@pytest.mark.parametrize("dtype", [U1, U2, I2])
def test_record_round_trip_states_its_dtype(dtype):
    rec = record(dtype)
    frames = [bytes(memoryview(f).cast("B")) for f in wire.encode_record(rec, "c", 3)]
    h = wire.decode_header(frames[0])
    assert h.body.get("ids") == (None if dtype == I2 else wire.ids_code(dtype))
    assert [len(f) for f in frames[1:3]] == [5 * 6 * dtype.itemsize, 4 * 6 * dtype.itemsize]
    back = wire.decode_record(h, frames[1:])
    assert back.equals(rec) and back.id_dtype == dtype and back.missing_id == wire.missing_id(dtype)
    wide = back.widened()
    assert wide.id_dtype == I2 and wide.equals(record(I2))
    assert wide.prompt_routed_experts[:2].tolist() == np.full((2, 3, 2), -1).tolist()
    assert np.array_equal(wide.routed_experts[:-1], rec.routed_experts[:-1].astype(I2))
    with pytest.raises(wire.ProtocolError) as e:
        wire.decode_record(h, [bytes(len(frames[1]) + 1), *frames[2:]])
    assert e.value.reason == "size_mismatch" and dtype.name in str(e.value)


def test_broker_split_uses_the_row_size_of_the_message():
    rows = np.arange(4 * 4 * 2, dtype=np.uint8).reshape(4, 4, 2)      # a: 3 rows, b: 1 row, 8 bytes each
    h = wire.decode_header(delta(U1))
    d = wire.parse_delta(h)
    parts = split_delta(h, d, ["x", "y"], {"x", "y"}, [rows.tobytes()])
    got = {}
    for p in parts:
        ph = wire.decode_header(p.head)
        pd = wire.parse_delta(ph)
        wire.check_payload(pd, p.frames)
        assert ph.body["ids"] == "u1" and pd.dtype == U1
        got[p.owner] = (ph.key, b"".join(bytes(memoryview(f).cast("B")) for f in p.frames))
    assert got == {"x": (["a"], rows[:3].tobytes()), "y": (["b"], rows[3:].tobytes())}
