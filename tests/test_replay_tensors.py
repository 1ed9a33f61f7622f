"""replay.tensors on hand-made Records: alignment of rows to the trainer's tokens, padding, packing, layouts,
layer ranges, masks and the refusals, all checked value for value."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from routing_replay.protocol import wire
from routing_replay.replay import packed, padded

L, K = 3, 2
LAYER_IDS = np.array([0, 2, 3], np.int32)          # model layer 1 is dense; 4 decoder layers


def rows(positions, layers=L, k=K):
    """(n, L, K) int16 where entry (p, l, k) = 100*p + 10*l + k: every value names its position."""
    p = np.asarray(positions, np.int16)[:, None, None]
    return (100 * p + 10 * np.arange(layers, dtype=np.int16)[None, :, None]
            + np.arange(k, dtype=np.int16)[None, None, :]).astype(np.int16)


def record(rid, P, G, *, cached=0, complete=True, missing=(), tokens=True, layer_ids=LAYER_IDS, k=K):
    """A record as the consumer builds it: prefix hits and the last output row are -1."""
    nl = len(layer_ids)
    allr = rows(np.arange(P + G), nl, k)
    allr[:cached] = -1
    if G:
        allr[P + G - 1] = -1
    for lo, hi in missing:
        allr[lo:hi] = -1
    return wire.Record(request_id=rid, prompt_routed_experts=allr[:P].copy(), routed_experts=allr[P:].copy(),
                       num_cached_tokens=cached, moe_layer_ids=np.asarray(layer_ids, np.int32), complete=complete,
                       missing=[list(m) for m in missing], reason="" if complete else "rows_not_delivered",
                       prompt_token_ids=np.arange(1000, 1000 + P, dtype=np.int32) if tokens else None,
                       output_token_ids=np.arange(2000, 2000 + G, dtype=np.int32) if tokens else None)


def expected_row(p):
    """What the trainer's input position p must carry: row p of prompt + generation (no shift)."""
    return rows([p])[0]


def test_padded_right_and_left_align_rows_to_positions():
    a, b = record("a", 3, 2), record("b", 2, 4, cached=1)
    for side in ("right", "left"):
        t = padded([a, b], padding_side=side, seq_len=7)
        assert t.expert_ids.shape == (2, 7, L, K) and t.expert_ids.dtype == torch.int64
        want = np.full((2, 7, L, K), -1, np.int64)
        for i, (rec, n) in enumerate(((a, 5), (b, 6))):
            start = 0 if side == "right" else 7 - n
            for p in range(n):
                want[i, start + p] = expected_row(p)
            want[i, start:start + rec.num_cached_tokens] = -1         # prefix hits
            want[i, start + n - 1] = -1                               # last output token never fed
        assert torch.equal(t.expert_ids, torch.from_numpy(want)), side
        mask = np.ones((2, 7, L), bool)
        if side == "right":
            mask[0, 0:4] = False                                      # a: positions 0..3 routed, 4 is the last
            mask[1, 1:5] = False                                      # b: 0 cached, 1..4 routed, 5 last
        else:
            mask[0, 2:6] = False
            mask[1, 2:6] = False
        assert torch.equal(t.no_routing, torch.from_numpy(mask)), side
        assert t.lengths.tolist() == [5, 6] and t.cu_seqlens is None
        assert t.layer_ids.tolist() == [0, 2, 3]


def test_packed_concatenates_with_cu_seqlens():
    recs = {"x": record("x", 4, 1), "y": record("y", 1, 3), "z": record("z", 2, 0)}
    t = packed(recs, dtype="int32")
    assert t.cu_seqlens.dtype == torch.int32 and t.cu_seqlens.tolist() == [0, 5, 9, 11]
    assert t.expert_ids.dtype == torch.int32 and t.expert_ids.shape == (11, L, K)
    want = np.concatenate([rows(range(5)), rows(range(4)), rows(range(2))]).astype(np.int32)
    want[4] = -1            # x: its only output token is its last
    want[8] = -1            # y: last output token
    assert torch.equal(t.expert_ids, torch.from_numpy(want))          # z: prompt only, every row routed
    assert t.no_routing[:, 0].tolist() == [False] * 4 + [True] + [False] * 3 + [True] + [False] * 2


def test_all_layout_puts_moe_columns_at_their_layers_and_masks_dense_ones():
    rec = record("a", 2, 2)
    t = padded([rec], layout="all", num_layers=5)
    assert t.expert_ids.shape == (1, 4, 5, K) and t.layer_ids.tolist() == [0, 1, 2, 3, 4]
    moe = padded([rec]).expert_ids
    assert torch.equal(t.expert_ids[:, :, [0, 2, 3]], moe)
    assert (t.expert_ids[:, :, [1, 4]] == -1).all()
    assert t.no_routing[0].tolist() == [[False, True, False, False, True]] * 3 + [[True] * 5]
    # pipeline stage holding model layers [1, 3): the dense layer 1 and MoE layer 2 (record column 1)
    s = packed([rec], layout="all", layers=(1, 3))
    assert s.layer_ids.tolist() == [1, 2]
    assert torch.equal(s.expert_ids[:, 1], moe[0, :, 1]) and (s.expert_ids[:, 0] == -1).all()


def test_moe_layer_range_takes_moe_columns():
    rec = record("a", 3, 2)
    t = packed([rec], layers=(1, 3))
    assert t.layer_ids.tolist() == [2, 3]
    assert torch.equal(t.expert_ids, packed([rec]).expert_ids[:, 1:3])
    with pytest.raises(ValueError, match=r"layers=\(2, 4\) outside \[0, 3\) of the 'moe' layout"):
        packed([rec], layers=(2, 4))


def test_incomplete_records_are_refused_or_masked():
    rec = record("inc", 4, 3, complete=False, missing=[(2, 4)])
    with pytest.raises(ValueError, match=r"record 0 \('inc'\) is incomplete \('rows_not_delivered', missing "
                                         r"\[\(2, 4\)\]\)"):
        packed([rec])
    t = packed([rec], allow_incomplete=True)
    assert t.no_routing[:, 0].tolist() == [False, False, True, True, False, False, True]


def test_mismatched_records_are_refused_with_their_shapes():
    with pytest.raises(ValueError, match=r"record 1 \('b'\) has rows \(2, 3, 4\) and \(1, 3, 4\), record 0 has "
                                         r"\(L, K\) = \(3, 2\)"):
        packed([record("a", 2, 1), record("b", 2, 1, k=4)])
    with pytest.raises(ValueError, match=r"record 1 \('b'\) has moe_layer_ids \[0, 1, 3\], record 0 has \[0, 2, 3\]"):
        packed([record("a", 2, 1), record("b", 2, 1, layer_ids=[0, 1, 3])])


def test_trainer_tokens_are_checked_against_the_record():
    rec = record("a", 3, 3)
    same = np.r_[rec.prompt_token_ids, rec.output_token_ids]
    assert torch.equal(packed([rec], token_ids=[same]).expert_ids, packed([rec]).expert_ids)
    other = same.copy()
    other[4] = 7
    with pytest.raises(ValueError, match=r"record 0 \('a'\): trainer token 4 is 7, the engine fed 2001 "
                                         r"\(1 positions differ; re-tokenised\?\)"):
        padded([rec], token_ids=[other])
    with pytest.raises(ValueError, match=r"record 0 \('a'\) has 3 prompt \+ 3 output rows = 6, the trainer feeds 5 "
                                         r"tokens \(allow_prefix=False\)"):
        padded([rec], token_ids=[same[:5]])
    cut = padded([rec], token_ids=[same[:5]], allow_prefix=True)          # response cut at a stop string
    assert cut.expert_ids.shape == (1, 5, L, K)
    assert torch.equal(cut.expert_ids[0], padded([rec]).expert_ids[0, :5])
    assert cut.no_routing[0, :, 0].tolist() == [False] * 5              # position 4 was fed: it has routing
    no_ids = record("n", 3, 3, tokens=False)                             # lengths still checked
    with pytest.raises(ValueError, match=r"= 6, the trainer feeds 7 tokens"):
        packed([no_ids], token_ids=[np.zeros(7)])


def test_bad_arguments():
    rec = record("a", 3, 2)
    with pytest.raises(ValueError, match=r"seq_len=4 is shorter than sample 0 \('a', 5 tokens\)"):
        padded([rec], seq_len=4)
    with pytest.raises(ValueError, match=r"padding_side='middle'"):
        padded([rec], padding_side="middle")
    with pytest.raises(ValueError, match=r"dtype='int16'"):
        packed([rec], dtype="int16")
    with pytest.raises(ValueError, match=r"num_layers=3 but moe_layer_ids reach 3"):
        packed([rec], layout="all", num_layers=3)
    with pytest.raises(ValueError, match=r"2 token id sequences for 1 records"):
        packed([rec], token_ids=[[1], [2]])


@pytest.mark.parametrize("k", [4, 8, 3])
def test_no_routing_flags_a_negative_id_in_any_slot(k):
    """The flags are read four int16 ids at a time when K allows it: a -1 in any slot of any layer counts."""
    rec = record("a", 6, 4, k=k)
    rec.prompt_routed_experts[2, 1, k - 1] = -1
    rec.prompt_routed_experts[3, 0, 0] = -1
    rec.routed_experts[1, 2, k // 2] = -1
    t = packed([rec])
    want = (torch.from_numpy(np.r_[rec.prompt_routed_experts, rec.routed_experts]) < 0).any(-1)
    assert int(want.sum()) == 3 + L                           # three single slots and the last output row
    assert torch.equal(t.no_routing, want)
    a = packed([rec], layout="all", layers=(1, 4))            # dense layer 1, then MoE layers 2, 3
    assert torch.equal(a.no_routing, torch.cat([torch.ones(10, 1, dtype=torch.bool), want[:, 1:]], 1))


def test_rows_that_do_not_line_up_with_the_records_own_tokens_are_refused():
    short = record("s", 3, 2)                             # 3 prompt rows, but 4 prompt token ids
    short.prompt_token_ids = np.arange(1000, 1004, dtype=np.int32)
    for call in (padded, packed):
        with pytest.raises(ValueError, match=r"^record 1 \('s'\) has 4 prompt token ids but 3 prompt rows: its rows "
                                             r"do not line up with its tokens$"):
            call([record("a", 3, 2), short])
    long = record("g", 3, 2)
    long.output_token_ids = np.arange(2000, 2001, dtype=np.int32)
    with pytest.raises(ValueError, match=r"^record 0 \('g'\) has 1 output token ids but 2 output rows"):
        padded([long])
