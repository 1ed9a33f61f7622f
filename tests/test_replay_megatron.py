"""replay.megatron: the set_replay_data list in Megatron's token order, fed to Megatron-Core's own RouterReplay
(skipped when megatron-core is not installed); -1 never reaches it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from routing_replay.replay import packed, padded
from routing_replay.replay.megatron import megatron_replay_data
from tests.test_replay_tensors import K, L, record


def test_sequence_major_order_and_filled_rows():
    a, b = record("a", 3, 2), record("b", 2, 2)           # lengths 5 and 4; last rows -1
    t = padded([a, b])                                    # (2, 5, L, K), b padded at position 4
    data = megatron_replay_data(t)
    assert len(data) == L and all(d.shape == (10, K) and d.dtype == torch.int64 for d in data)
    for m in range(L):
        for s in range(5):
            for bi in range(2):
                want = t.expert_ids[bi, s, m]
                if (bi, s) in ((0, 4), (1, 3), (1, 4)):  # last tokens and padding: distinct filler ids
                    want = torch.arange(K)
                assert torch.equal(data[m][s * 2 + bi], want), (m, s, bi)
    assert all((d >= 0).all() for d in data)
    left = megatron_replay_data(padded([a, b], padding_side="left"), padding_side="left")
    assert torch.equal(left[1][1::2][1:], data[1][1::2][:4])   # b's four tokens, shifted by its padding
    p = megatron_replay_data(packed([a, b]), layers=(1, 3))
    assert len(p) == 2 and torch.equal(p[0][:4], packed([a]).expert_ids[:4, 1])
    assert torch.equal(p[0][4], torch.arange(K)) and torch.equal(p[0][8], torch.arange(K))


def test_context_rows_without_routing_are_refused_or_taken_from_fallback():
    rec = record("c", 4, 2, cached=2)
    t = packed([rec])
    with pytest.raises(ValueError, match=r"2 context tokens have no routing \(prefix-cache hits or missing rows; "
                                         r"first at Megatron token 0; per layer \[2, 2, 2\]\)"):
        megatron_replay_data(t)
    fb = [torch.stack([torch.tensor([5, 6])] * 6) for _ in range(L)]
    data = megatron_replay_data(t, fallback=fb)
    assert torch.equal(data[0][:2], torch.tensor([[5, 6], [5, 6]]))
    assert torch.equal(data[0][2:5], t.expert_ids[2:5, 0]) and torch.equal(data[0][5], torch.arange(K))


def test_megatron_router_replay_takes_the_list():
    rr = pytest.importorskip("megatron.core.transformer.moe.router_replay")
    RouterReplay, Action = rr.RouterReplay, rr.RouterReplayAction
    RouterReplay.clear_global_router_replay_instances()
    try:
        routers = [RouterReplay() for _ in range(L)]
        t = padded([record("a", 3, 2), record("b", 2, 2)])
        data = megatron_replay_data(t)
        RouterReplay.set_replay_data(data)
        RouterReplay.set_global_router_replay_action(Action.REPLAY_FORWARD)
        scores = torch.rand(10, 1000, generator=torch.Generator().manual_seed(0))
        for m, r in enumerate(routers):
            probs, idx = r.get_replay_topk(scores, K)
            assert torch.equal(idx, data[m]) and torch.equal(probs, scores.gather(1, data[m]))
    finally:
        RouterReplay.clear_global_router_replay_instances()
