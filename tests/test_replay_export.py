"""replay.export on small hand-made Records: verl's padded batch key and its jagged form, NeMo-RL's aligned array
and its nrlre1 codec, slime's int32 rows, in both layouts, against arrays written out by hand."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from routing_replay.protocol import wire
from routing_replay.replay.export import (decode_nemo_rl, encode_nemo_rl, narrowest_dtype, to_nemo_rl, to_slime,
                                          to_verl, to_verl_jagged)

# model: 3 decoder layers, layer 0 dense, layers 1 and 2 MoE; top-2 of 8 experts
PROMPT = np.array([[[1, 2], [3, 4]], [[5, 6], [7, 0]]], np.int16)          # (P=2, L=2, K=2)
GEN = np.array([[[2, 3], [4, 5]], [[-1, -1], [-1, -1]]], np.int16)         # last output row never fed


def rec(rid="r", prompt=PROMPT, gen=GEN, cached=0):
    return wire.Record(request_id=rid, prompt_routed_experts=prompt.copy(), routed_experts=gen.copy(),
                       num_cached_tokens=cached, moe_layer_ids=np.array([1, 2], np.int32), complete=True)


def test_verl_left_padded_prompt_right_padded_response_both_layouts():
    short = rec("s", PROMPT[1:], GEN[:1] * 0 - 1)                          # P=1, G=1 (its only row is the last)
    got = to_verl([rec(), short], prompt_length=3, response_length=3, layout="moe")
    want = np.zeros((2, 6, 2, 2), np.uint8)
    want[0, 1] = [[1, 2], [3, 4]]
    want[0, 2] = [[5, 6], [7, 0]]
    want[0, 3] = [[2, 3], [4, 5]]                                          # [0, 4]: last row, zeros
    want[1, 2] = [[5, 6], [7, 0]]
    assert got.dtype == np.uint8 and np.array_equal(got, want)
    got = to_verl([rec()], prompt_length=2, response_length=2, layout="all", num_layers=3)
    want = np.zeros((1, 4, 3, 2), np.uint8)                                # layer 0 dense: zeros
    want[0, :3, 1:] = [[[1, 2], [3, 4]], [[5, 6], [7, 0]], [[2, 3], [4, 5]]]
    assert np.array_equal(got, want)
    assert to_verl([rec()], prompt_length=2, response_length=2, layout="moe", num_experts=300).dtype == np.int16


def test_verl_and_slime_refuse_unrouted_context_rows_and_overlong_samples():
    cached = rec("c", np.concatenate([np.full((1, 2, 2), -1, np.int16), PROMPT[1:]]), GEN, cached=1)
    msg = (r"record 'c': 1 context tokens have no routing \(prefix-cache hits or missing rows, first at position 0, "
           r"num_cached_tokens=1, missing=\[\]\); {} has no per-row fallback")
    with pytest.raises(ValueError, match=msg.format("verl")):
        to_verl([cached], prompt_length=2, response_length=2, num_layers=3)
    with pytest.raises(ValueError, match=msg.format("verl")):
        to_verl_jagged([cached], layout="moe")
    with pytest.raises(ValueError, match=msg.format("slime")):
        to_slime(cached, num_layers=3)
    with pytest.raises(ValueError, match=r"record 0 \('r'\) has 2 prompt \+ 2 response tokens, the batch holds 1 \+ 4"):
        to_verl([rec()], prompt_length=1, response_length=4, layout="moe")
    with pytest.raises(ValueError, match=r"expert id 7 >= num_experts=7"):
        to_verl([rec()], prompt_length=2, response_length=2, layout="moe", num_experts=7)


def test_nemo_rl_aligned_rows_fallback_and_padding():
    got = to_nemo_rl(rec(), seq_len=5, num_experts=8)
    want = np.array([[[1, 2], [3, 4]], [[5, 6], [7, 0]], [[2, 3], [4, 5]],
                     [[-1, -1], [-1, -1]],                                 # never fed: fall back
                     [[0, 1], [0, 1]]], np.int8)                           # padding: arange(K)
    assert got.dtype == np.int8 and np.array_equal(got, want)
    with pytest.raises(ValueError, match=r"^layout='all': NeMo-RL's nrlre1 payload is \[tokens, num_moe_layers, "
                                         r"topk\], only layout='moe' fits it$"):
        to_nemo_rl(rec(), layout="all", num_layers=3)
    assert to_nemo_rl(rec(), num_experts=129).dtype == np.int16
    assert to_nemo_rl(rec(), num_experts=40000).dtype == np.int32
    with pytest.raises(ValueError, match=r"seq_len=3 is shorter than record 'r' \(4 tokens\)"):
        to_nemo_rl(rec(), seq_len=3)


def test_nemo_rl_codec_bytes_and_round_trip():
    a = np.array([[[0, 1]], [[2, 3]]], np.int16)
    s = encode_nemo_rl(a)
    assert s == "nrlre1:int16:2x1x2:AAABAAIAAwA="                          # NeMo-Gym's own test envelope
    back = decode_nemo_rl(s)
    assert back.dtype == np.int16 and np.array_equal(back, a)
    x = to_nemo_rl(rec(), seq_len=5)
    assert encode_nemo_rl(x) == "nrlre1:int8:5x2x2:" + base64.b64encode(x.tobytes()).decode()
    assert np.array_equal(decode_nemo_rl(encode_nemo_rl(x)), x)
    with pytest.raises(ValueError, match=r"has 6 bytes, shape \(2, 1, 2\) of int16 needs 8"):
        decode_nemo_rl("nrlre1:int16:2x1x2:" + base64.b64encode(bytes(6)).decode())
    with pytest.raises(ValueError, match=r"not an nrlre1:.* envelope: 'nrlre1:uint16:2x1x1:AAAA'"):
        decode_nemo_rl("nrlre1:uint16:2x1x1:AAAA")
    with pytest.raises(ValueError, match=r"expected \(S, L, K\) of \['int16', 'int32', 'int8'\]"):
        encode_nemo_rl(np.zeros((2, 2, 2), np.int64))


def test_slime_int32_rows_of_fed_tokens():
    got = to_slime(rec(), num_layers=3)
    want = np.zeros((3, 3, 2), np.int32)                                  # len(tokens) - 1 = 3 rows
    want[:, 1:] = [[[1, 2], [3, 4]], [[5, 6], [7, 0]], [[2, 3], [4, 5]]]
    assert got.dtype == np.int32 and np.array_equal(got, want)
    assert np.array_equal(to_slime(rec(), layout="moe"), want[:, 1:])


def test_narrowest_dtype():
    assert [narrowest_dtype(n) for n in (1, 128, 129, 32768, 32769)] == [np.int8, np.int8, np.int16, np.int16,
                                                                         np.int32]
    assert [narrowest_dtype(n, signed=False) for n in (256, 257)] == [np.uint8, np.int16]


def _verl_replayed(routed, num_layers, moe_layers):
    """verl 0.9.1 `set_router_replay_data`'s choice of axis-L column per MoE layer (absolute layer when axis L has
    num_layers entries, MoE ordinal otherwise): {model layer: (tokens, K) ids that router replays}."""
    by_layer = routed.shape[-2] == num_layers
    return {layer: routed[..., layer if by_layer else m, :] for m, layer in enumerate(moe_layers)}


def test_all_layout_needs_the_model_layer_count_with_a_trailing_dense_layer():
    # model: 4 decoder layers, 0 and 3 dense, 1 and 2 MoE: the record cannot tell that layer 3 exists
    with pytest.raises(ValueError, match=r"^record 'r': layout='all' needs num_layers \(the model's decoder layer "
                                         r"count, e.g. config.num_hidden_layers\): moe_layer_ids \[1, 2\] end at layer "
                                         r"2 and cannot say whether dense layers follow; or use layout='moe'$"):
        to_verl([rec()], prompt_length=2, response_length=2)
    for call in (lambda: to_slime(rec()), lambda: to_verl_jagged([rec()])):
        with pytest.raises(ValueError, match=r"layout='all' needs num_layers"):
            call()
    rows = np.concatenate([PROMPT, GEN]).astype(np.int64)
    rows[-1] = 0
    for layout, num_layers in (("all", 4), ("moe", None)):
        got = to_verl([rec()], prompt_length=2, response_length=2, layout=layout, num_layers=num_layers)
        replayed = _verl_replayed(got[0].astype(np.int64), 4, [1, 2])
        assert all(np.array_equal(replayed[layer], rows[:, m]) for m, layer in enumerate([1, 2])), layout
        assert to_slime(rec(), layout=layout, num_layers=num_layers).shape == (3, 4 if num_layers else 2, 2)


def test_verl_jagged_equals_what_verl_makes_of_the_padded_key():
    torch = pytest.importorskip("torch")
    short = rec("s", PROMPT[1:], GEN)                                      # P=1, G=2
    records = [rec(), short]
    for layout, num_layers in (("moe", None), ("all", 3)):
        nested = to_verl_jagged(records, layout=layout, num_layers=num_layers)
        assert nested.is_nested and nested.layout == torch.jagged and nested.dtype == torch.int16
        padded_key = torch.from_numpy(to_verl(records, prompt_length=3, response_length=3, layout=layout,
                                              num_layers=num_layers).astype(np.int16))
        attention = torch.zeros(2, 6, dtype=torch.bool)                    # prompt left-, response right-padded
        attention[0, 1:5] = True
        attention[1, 2:5] = True
        flat = padded_key.flatten(0, 1)[attention.flatten()]               # left_right_2_no_padding's rows
        assert torch.equal(nested.values(), flat) and nested.offsets().tolist() == [0, 4, 7]
        parts = nested.unbind()
        assert parts[1].shape == (3, 2 if layout == "moe" else 3, 2)
        assert torch.equal(parts[1][:, -2:], torch.tensor([[[5, 6], [7, 0]], [[2, 3], [4, 5]], [[0, 0], [0, 0]]],
                                                          dtype=torch.int16))
