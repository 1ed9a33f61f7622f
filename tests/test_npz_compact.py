"""npz files with compact ids: written in the record's dtype stating `ids` and `missing_id`, read back as int16
(the default) or as stored; files written before compact ids (int16, -1, no `ids`) keep loading; a file whose
rows contradict what it states is unreadable, named. Also: the producer refuses a step whose ids do not fit."""

import numpy as np
import pytest

from routing_replay.apps.embedded import EmbeddedPipeline
from routing_replay.consumer import NpzWriter, UnreadableRecord, load_records, read_record
from routing_replay.consumer.npz import safe_filename, write_record
from routing_replay.protocol import wire

L, K = 3, 2


def int16_record(rid="r1"):
    pr = np.arange(4 * L * K, dtype=np.int16).reshape(4, L, K) % 50
    pr[:1] = -1
    ge = np.arange(3 * L * K, dtype=np.int16).reshape(3, L, K) % 40
    ge[-1] = -1
    return wire.Record(rid, pr, ge, 1, np.array([0, 2, 3], np.int32), True, [], "", "stop",
                       np.arange(4, dtype=np.int32), np.arange(3, dtype=np.int32))


def narrowed(rec, dtype):
    return wire.Record(rec.request_id, wire.narrow_rows(rec.prompt_routed_experts, dtype),
                       wire.narrow_rows(rec.routed_experts, dtype), rec.num_cached_tokens, rec.moe_layer_ids,
                       rec.complete, list(rec.missing), rec.reason, rec.finish_reason, rec.prompt_token_ids,
                       rec.output_token_ids)


def write_old_layout(path, rec):
    """A record file exactly as the writer before compact ids made it: int16 rows, -1, no `ids` key."""
    np.savez(path, request_id=np.array(rec.request_id), prompt_routed_experts=rec.prompt_routed_experts,
             routed_experts=rec.routed_experts, num_cached_tokens=np.int64(rec.num_cached_tokens),
             moe_layer_ids=np.asarray(rec.moe_layer_ids, np.int32), complete=np.bool_(rec.complete),
             missing=np.zeros((0, 2), np.int64), reason=np.array(rec.reason),
             finish_reason=np.array(rec.finish_reason), prompt_token_ids=rec.prompt_token_ids,
             output_token_ids=rec.output_token_ids)


def test_old_int16_files_keep_loading(tmp_path):
    rec = int16_record()
    write_old_layout(tmp_path / (safe_filename(rec.request_id) + ".npz"), rec)
    for ids in ("int16", "compact"):
        got = load_records(tmp_path, errors="raise", ids=ids)["r1"]
        assert got.equals(rec) and got.id_dtype == np.int16
    assert read_record(tmp_path / "r1.npz").equals(rec)


@pytest.mark.parametrize("dtype", ["u1", "<u2"])
def test_compact_files_state_their_dtype(tmp_path, dtype):
    wide = int16_record()
    rec = narrowed(wide, dtype)
    path = write_record(tmp_path, rec)
    with np.load(path) as z:
        assert z["prompt_routed_experts"].dtype == np.dtype(dtype) and str(z["ids"]) == wire.ids_code(dtype)
        assert int(z["missing_id"]) == wire.missing_id(dtype)
        assert z["prompt_routed_experts"][0].tolist() == np.full((L, K), wire.missing_id(dtype)).tolist()
    assert read_record(path).equals(wide)
    assert read_record(path, ids="compact").equals(rec)
    assert load_records(tmp_path, ids="compact")["r1"].equals(rec)
    with pytest.raises(ValueError, match="ids='u1'"):
        load_records(tmp_path, ids="u1")
    # shards too
    sd = tmp_path / "shards"
    w = NpzWriter(sd, shard_size=2)
    for i in range(3):
        w.put(narrowed(int16_record(f"s{i}"), dtype))
    w.close()
    got = load_records(sd, errors="raise")
    assert sorted(got) == ["s0", "s1", "s2"] and all(got[f"s{i}"].equals(int16_record(f"s{i}")) for i in range(3))
    assert all(r.id_dtype == np.dtype(dtype) for r in load_records(sd, ids="compact").values())


def test_a_file_that_contradicts_its_ids_is_unreadable(tmp_path):
    rec = int16_record()
    bad = tmp_path / "r1.npz"
    write_old_layout(bad, narrowed(rec, "u1"))        # uint8 rows without `ids`: the file says int16
    with pytest.raises(UnreadableRecord, match="prompt_routed_experts is .*uint8.* states ids 'i2'"):
        read_record(bad)
    (tmp_path / "x").mkdir()
    with np.load(write_record(tmp_path / "x", narrowed(rec, "u1"))) as z:
        arrays = dict(z)
    np.savez(tmp_path / "r2.npz", **{**arrays, "request_id": np.array("r2"), "missing_id": np.int64(7)})
    with pytest.raises(UnreadableRecord, match="missing_id 7 for ids 'u1'"):
        read_record(tmp_path / "r2.npz")
    unreadable = []
    assert load_records(tmp_path, unreadable=unreadable) == {} and len(unreadable) == 2


def test_producer_refuses_a_step_whose_ids_do_not_fit():
    """Expert id 300 in a 255-expert producer's rows (uint8): that step's positions are reported lost and refused; the
    record says producer_refused; the other request is untouched."""
    rows = np.full((4, L, K), 5, np.int16)
    bad = rows.copy()
    bad[2, 1, 0] = 300
    got = {}
    with EmbeddedPipeline(on_record=lambda r: got.__setitem__(r.request_id, r), finish_grace_s=0) as pipe:
        with pipe.producer(num_layers=L, top_k=K, num_experts=255, coalesce_max_bytes=0) as p:
            p.open("a", prompt_len=4)
            p.open("b", prompt_len=4)
            p.publish([("a", 0, bad)])
            p.publish([("b", 0, rows)])
            p.finish("a", num_output_tokens=1)
            p.finish("b", num_output_tokens=1)
            assert p.flush(10)
            assert p.stats.encode_errors == 1
        assert pipe.wait_idle(30)
    a, b = got["a"].widened(), got["b"]
    assert not a.complete and a.reason == "producer_refused" and a.missing == [(0, 4)]
    assert b.complete and b.id_dtype == np.uint8 and b.prompt_routed_experts.tolist() == rows.tolist()
