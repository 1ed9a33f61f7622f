"""The accumulator on compact rows (no sockets): one scenario of every path (appends, adopted prefills, holes,
overwrites, layer ranges, prefix rows filled and not found, lost rows, aborts) fed as int16 and as uint8/uint16;
every record is the int16 one once widened, held in its own dtype at its itemsize."""

import numpy as np
import pytest

from routing_replay.protocol import wire
from tests.test_accumulator import K, L, Feed, rows


class CompactFeed(Feed):
    """Feed whose producer narrows rows to `dtype` (opens state `ids`, deltas carry the narrowed rows)."""

    dtype = wire.ROW_DTYPE

    def _apply(self, kind, key, body, frames=()):
        if kind in ("open", "delta") and self.dtype != wire.ROW_DTYPE:
            body = dict(body, ids=wire.ids_code(self.dtype))
            if kind == "delta":
                frames = [wire.narrow_rows(np.frombuffer(f, np.int16), self.dtype).tobytes() for f in frames]
        super()._apply(kind, key, body, frames)


def scenario(f):
    f.open("a", 10)
    f.open("b", 6, C=4)
    f.delta([("a", 0, rows(1, 0, 4)), ("b", 4, rows(2, 4, 6))])
    f.delta([("a", 4, rows(1, 4, 10)), ("b", 6, rows(2, 6, 7))])
    for p in range(10, 12):
        f.delta([("a", p, rows(1, p, p + 1)), ("b", p - 3, rows(2, p - 3, p - 2))])
    f.open("c", 8)                                               # a hole at 3..5, never filled
    f.delta([("c", 0, rows(3, 0, 3))])
    f.delta([("c", 5, rows(3, 5, 9))])
    f.open("d", 5)                                               # two layer ranges (pipeline stages)
    f.delta([("d", 0, rows(4, 0, 6, layers=(0, 1)))], layers=(0, 1))
    f.delta([("d", 0, rows(4, 0, 6, layers=(1, L)))], layers=(1, L))
    filled = rows(5, 0, 7)
    filled[1] = -1                                               # a prefix row whose source was gone
    f.open("e", 5, C=3, filled=True)
    f.delta([("e", 0, filled)])
    f.open("g", 4)                                               # overwritten rows: the newest wins
    f.delta([("g", 0, rows(6, 0, 4, variant=2))])
    f.delta([("g", 0, rows(6, 0, 5, variant=1))])
    f.open("h", 64)                                              # a prefill step on its own: adoptable
    f.delta([("h", 0, rows(7, 0, 64))])
    f.open("i", 6)
    f.delta([("i", 0, rows(8, 0, 4))])
    for rid, G, kw in (("a", 3, {}), ("b", 4, {}), ("c", 2, {}), ("d", 2, {}), ("e", 3, {}), ("g", 2, {}),
                       ("h", 1, {}), ("i", 2, {"lost": [[4, 7]]})):
        f.finish(rid, G, **kw)
    f.open("j", 5)
    f.delta([("j", 0, rows(9, 0, 3))])
    f.abort("j")
    f.tick(10.0)
    return f.out


@pytest.mark.parametrize("adopt", [False, True])
@pytest.mark.parametrize("dtype", [np.dtype("u1"), np.dtype("<u2")])
def test_compact_records_are_the_int16_records_widened(dtype, adopt, monkeypatch):
    monkeypatch.setattr(Feed, "adopt", adopt)       # rows kept as received wherever a message allows it
    fw = CompactFeed()
    wide = scenario(fw)
    monkeypatch.setattr(CompactFeed, "dtype", dtype)
    f = CompactFeed()
    small = scenario(f)
    assert sorted(small) == sorted(wide) == list("abcdeghij")
    reasons = {rid: (r.complete, r.reason) for rid, r in wide.items()}
    assert reasons == {"a": (True, ""), "b": (True, ""), "c": (False, "rows_not_delivered"), "d": (True, ""),
                       "e": (False, "prefix_not_found"), "g": (True, ""), "h": (True, ""),
                       "i": (False, "producer_queue_full"), "j": (False, "abort")}
    for rid in wide:
        s, w = small[rid], wide[rid]
        assert s.id_dtype == dtype and w.id_dtype == np.int16, rid
        assert s.widened().equals(w), rid
        assert s.prompt_routed_experts.nbytes * 2 == w.prompt_routed_experts.nbytes * dtype.itemsize
    miss = wire.missing_id(dtype)
    assert (small["c"].prompt_routed_experts[3:5] == miss).all()
    assert (small["b"].prompt_routed_experts[:4] == miss).all()
    assert f.acc.stats.bytes * 2 == fw.acc.stats.bytes * dtype.itemsize and f.acc.stats.rows == fw.acc.stats.rows
    assert f.acc.stats.adopted == fw.acc.stats.adopted == (8 if adopt else 0)
    assert f.acc.stats.adopted_records == fw.acc.stats.adopted_records == (1 if adopt else 0)
    assert f.acc.in_flight == 0 and f.acc.bytes_held == 0


def test_a_delta_of_another_dtype_is_refused_for_that_request_only(monkeypatch):
    f = CompactFeed()
    monkeypatch.setattr(CompactFeed, "dtype", np.dtype("u1"))
    f.open("x", 3)
    f.open("y", 3)
    monkeypatch.setattr(CompactFeed, "dtype", wire.ROW_DTYPE)
    f.delta([("x", 0, rows(1, 0, 3)), ("y", 0, rows(2, 0, 1))])          # int16 rows: refused for both ...
    monkeypatch.setattr(CompactFeed, "dtype", np.dtype("u1"))
    f.delta([("y", 0, rows(2, 0, 3))])                                   # ... y's come again as uint8
    f.finish("x", 1)
    f.finish("y", 1)
    f.tick(10.0)
    f.open("z", 2)
    f.delta([("z", 0, rows(3, 0, 2))])
    monkeypatch.setattr(CompactFeed, "dtype", wire.ROW_DTYPE)
    # an open of another dtype than the rows held: refused, naming both
    with pytest.raises(wire.ProtocolError) as e:
        f.open("z", 2)
    assert e.value.reason == "shape_mismatch" and "says ids i2, its rows so far are u1" in str(e.value)
    x, y = f.out["x"], f.out["y"]
    assert not x.complete and x.reason == "consumer_refused" and x.missing == [(0, 3)] and x.id_dtype == np.uint8
    assert (x.prompt_routed_experts == 255).all()
    assert y.complete and np.array_equal(y.widened().prompt_routed_experts, rows(2, 0, 3))
    assert f.acc.stats.refused_msgs == 2 and f.acc.stats.refused_rows == 4
