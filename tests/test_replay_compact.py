"""replay/ takes compact records (uint8/uint16 rows, Record.missing_id) and int16 ones alike: every tensor and
export comes out bit-identical, in the dtype the target API wants."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from routing_replay.protocol import wire
from routing_replay.replay import packed, padded
from routing_replay.replay.export import sample_rows, to_nemo_rl, to_slime, to_verl, to_verl_jagged
from routing_replay.replay.megatron import megatron_replay_data

LAYER_IDS = np.array([0, 2, 3, 5], np.int32)         # decoder layers 1 and 4 are dense
L, K = len(LAYER_IDS), 4


def int16_record(rid, P, G, seed, cached=0, missing=(), complete=True):
    rng = np.random.default_rng(seed)
    allr = np.argsort(rng.random((P + G, L, 200)), -1)[..., :K].astype(np.int16)     # K distinct ids a row
    allr[:cached] = -1
    if G:
        allr[P + G - 1] = -1
    for lo, hi in missing:
        allr[lo:hi] = -1
    return wire.Record(rid, allr[:P].copy(), allr[P:].copy(), cached, LAYER_IDS.copy(), complete,
                       [tuple(m) for m in missing], "" if complete else "rows_not_delivered", "stop",
                       np.arange(P, dtype=np.int32), np.arange(G, dtype=np.int32))


def compact(rec, dtype):
    return wire.Record(rec.request_id, wire.narrow_rows(rec.prompt_routed_experts, dtype),
                       wire.narrow_rows(rec.routed_experts, dtype), rec.num_cached_tokens, rec.moe_layer_ids,
                       rec.complete, list(rec.missing), rec.reason, rec.finish_reason, rec.prompt_token_ids,
                       rec.output_token_ids)


def batch():
    return [int16_record("a", 5, 3, 1), int16_record("b", 4, 6, 2, cached=2),
            int16_record("c", 6, 2, 3, missing=[(3, 5)], complete=False)]


def same(a, b):
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
    return a == b


@pytest.mark.parametrize("dtype", ["u1", "<u2"])
def test_tensors_are_bit_identical_for_compact_and_int16_records(dtype):
    wide = batch()
    small = [compact(r, dtype) for r in wide]
    assert small[1].routed_experts.dtype == np.dtype(dtype) and small[1].prompt_routed_experts[0, 0, 0] == \
        wire.missing_id(dtype)
    for kw in (dict(), dict(padding_side="left", seq_len=12), dict(layout="all", num_layers=6),
               dict(layout="all", num_layers=6, layers=(1, 4), dtype="int32")):
        a = padded(wide, allow_incomplete=True, **kw)
        b = padded(small, allow_incomplete=True, **kw)
        for f in ("expert_ids", "no_routing", "lengths", "layer_ids"):
            assert same(getattr(a, f), getattr(b, f)), (kw, f)
        assert int(a.no_routing.sum()) > 0
    kw = dict(allow_incomplete=True)
    a, b = packed(wide, **kw), packed(small, **kw)
    for f in ("expert_ids", "no_routing", "lengths", "layer_ids", "cu_seqlens"):
        assert same(getattr(a, f), getattr(b, f)), f
    routed = [wide[0], int16_record("d", 3, 4, 5)]             # Megatron takes no unrouted context rows
    ma = megatron_replay_data(packed(routed))
    mb = megatron_replay_data(packed([compact(r, dtype) for r in routed]))
    assert len(ma) == L and all(same(x, y) for x, y in zip(ma, mb))


@pytest.mark.parametrize("dtype", ["u1", "<u2"])
def test_exports_are_bit_identical_for_compact_and_int16_records(dtype):
    wide = [int16_record("a", 5, 3, 1), int16_record("b", 4, 6, 2)]
    small = [compact(r, dtype) for r in wide]
    assert same(to_verl(wide, prompt_length=6, response_length=6, layout="all", num_layers=6),
                to_verl(small, prompt_length=6, response_length=6, layout="all", num_layers=6))
    ja, jb = to_verl_jagged(wide, layout="moe"), to_verl_jagged(small, layout="moe")
    assert all(same(x, y) for x, y in zip(ja.unbind(), jb.unbind()))
    cached = int16_record("c", 5, 3, 4, cached=2)
    for w, s in zip(wide + [cached], small + [compact(cached, dtype)]):
        assert same(sample_rows(w), sample_rows(s)) and int((sample_rows(s) == -1).sum()) > 0
        assert same(to_nemo_rl(w, seq_len=10), to_nemo_rl(s, seq_len=10))
    for w, s in zip(wide, small):
        assert same(to_slime(w, num_layers=6), to_slime(s, num_layers=6))


def test_widened_record_is_todays_record():
    for r in batch():
        for dtype in ("u1", "<u2"):
            c = compact(r, dtype)
            assert c.id_dtype == np.dtype(dtype) and c.widened().equals(r) and r.widened() is r
            assert c.as_ids("compact") is c and c.as_ids("int16").equals(r)
    with pytest.raises(ValueError, match="ids='int8'"):
        r.as_ids("int8")
