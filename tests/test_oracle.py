"""The oracle's near-tie rule on constructed router logits (no model): exact agreement, a swap across the k-th
logit within the tolerance (a near tie, not a failure), and a real disagreement (a failure); then the same rule
inside Oracle.check on a tiny generated model whose record is edited."""

from __future__ import annotations

import numpy as np
import pytest

from routing_replay.apps.oracle import NEAR_TIE_ULPS, is_near_tie, logit_ulp, near_tie_gap_ulps
from routing_replay.protocol import wire

# 8 experts, top-2: the oracle picks experts 3 (2.5) and 5 (1.25); expert 6 is 1.9e-6 below the k-th logit
LOGITS = np.array([0.1, -0.4, 0.9, 2.5, -1.0, 1.25, 1.25 - 1.9e-6, 0.3], dtype=np.float32)


def test_ulps():
    assert logit_ulp(1.5, "float32") == 2.0 ** -23 and logit_ulp(1.5, "bfloat16") == 2.0 ** -7
    assert logit_ulp(0.01, "float32", floor=1.0) == 2.0 ** -23          # magnitudes below 1 count as 1
    assert logit_ulp(-6.0, "bfloat16") == 2.0 ** -5
    assert NEAR_TIE_ULPS == {"float32": 64, "bfloat16": 4, "float16": 4}


def test_exact_agreement_has_gap_zero():
    assert near_tie_gap_ulps(LOGITS, [3, 5], 2) == 0.0
    assert near_tie_gap_ulps(LOGITS, [5, 3], 2) == 0.0
    assert is_near_tie(LOGITS, [3, 5], 2)


def test_near_tie_swap_is_within_tolerance():
    lg = LOGITS.astype(np.float64)
    gap = (lg[5] - lg[6]) / 2.0 ** -23                               # 16 float32 ulps at magnitude 1..2
    assert near_tie_gap_ulps(LOGITS, [3, 6], 2) == pytest.approx(gap) and 15 < gap < 17
    assert is_near_tie(LOGITS, [3, 6], 2, "float32")
    assert not is_near_tie(LOGITS, [3, 6], 2, "float32", tol_ulps=8)  # the tolerance is what decides


def test_real_disagreement_is_not_a_near_tie():
    gap = near_tie_gap_ulps(LOGITS, [3, 2], 2)                       # expert 2: 0.35 below the k-th logit
    assert gap == pytest.approx((1.25 - 0.9) / 2.0 ** -23, rel=1e-6)
    assert not is_near_tie(LOGITS, [3, 2], 2, "float32")
    assert not is_near_tie(LOGITS, [3, 2], 2, "bfloat16")             # 0.35 = 44.8 bf16 ulps
    assert is_near_tie(np.array([1.0, 1.0078125, 0.5]), [0], 1, "bfloat16")   # 1 bf16 ulp apart


@pytest.fixture(scope="module")
def oracle():
    pytest.importorskip("transformers")
    from routing_replay.apps.oracle import Oracle
    from routing_replay.apps.vllm_harness import tiny_model

    return Oracle(str(tiny_model("qwen3_moe")))


def _record(o, tokens, P):
    ref = o.routing(tokens)
    G = len(tokens) - P
    rows_p, rows_g = ref[:P].copy(), ref[P:].copy()
    rows_g[-1] = -1                                                  # the last output token is never fed
    return wire.Record("r", rows_p, rows_g, 0, np.array(o.layer_ids, np.int32), True,
                       prompt_token_ids=np.array(tokens[:P], np.int32),
                       output_token_ids=np.array(tokens[P:P + G], np.int32))


def test_check_counts_near_ties_apart_and_fails_only_on_the_rest(oracle):
    tokens = np.random.default_rng(3).integers(0, 256, 24).tolist()
    rec = _record(oracle, tokens, 16)
    v = oracle.check(rec)
    assert v.ok and v.agree == v.rows == 23 * 4 and v.near_ties == [] and v.mismatches == []
    oracle.routing(tokens)
    logits = oracle.router_logits()                                  # (T, L, E) of the same sequence
    K = oracle.top_k
    # find the (position, layer) whose (k+1)-th expert is closest to the k-th, and the one farthest
    order = np.argsort(-logits, axis=2, kind="stable")
    srt = np.take_along_axis(logits, order, axis=2)
    gaps = (srt[:, :, K - 1] - srt[:, :, K])[:23]
    (tp, tl), (fp, fl) = np.unravel_index(np.argmin(gaps), gaps.shape), np.unravel_index(np.argmax(gaps), gaps.shape)

    def swap(rec, pos, layer):                                       # replace the k-th expert by the (k+1)-th
        rows = rec.prompt_routed_experts if pos < 16 else rec.routed_experts
        r = rows[pos if pos < 16 else pos - 16, layer]
        r[r == order[pos, layer, K - 1]] = order[pos, layer, K]

    swap(rec, fp, fl)                                                # far from a tie: a real disagreement
    v = oracle.check(rec)
    assert not v.ok and v.agree == v.rows - 1 and v.near_ties == [] and v.mismatches[0][:2] == (fp, fl)
    # the closest swap, with the tolerance set just above its gap: a near tie, counted apart, not a failure
    gap_ulps = float(gaps[tp, tl]) / float(logit_ulp(srt[tp, tl, K - 1], "float32", floor=1.0))
    rec = _record(oracle, tokens, 16)
    swap(rec, tp, tl)
    saved = oracle.near_tie_ulps
    try:
        oracle.near_tie_ulps = gap_ulps * 1.01
        v = oracle.check(rec)
        assert v.ok and v.agree == v.rows - 1 and v.mismatches == []
        assert [t[:2] for t in v.near_ties] == [(tp, tl)] and v.near_ties[0][4] == pytest.approx(gap_ulps, rel=1e-3)
        oracle.near_tie_ulps = gap_ulps * 0.99                       # just below it: a failure
        v = oracle.check(rec)
        assert not v.ok and v.near_ties == [] and v.mismatches[0][:2] == (tp, tl)
    finally:
        oracle.near_tie_ulps = saved
    from routing_replay.apps.oracle import Verdict
    verdict = Verdict([oracle.check(_record(oracle, tokens, 16)), v])
    assert not verdict.ok and verdict.near_ties == 0 and verdict.disagree == 1
    assert "0 near ties (within 64 ulps), 1 disagree" in verdict.summary()


def _swapped_routing(oracle, tokens, pos, layer, old, new):
    """The oracle's routing of `tokens` when the router of MoE layer `layer` picks expert `new` instead of `old` at
    `pos` (Qwen3-MoE's weights for the new pair: softmax over all experts, gathered, renormalised): what an engine
    whose near tie went the other way records, every later row being the router's own choice on that input."""
    import torch

    router, _ = oracle.routers[oracle.layer_ids[layer]]
    cls_forward = type(router).forward

    def forward(hidden_states):
        logits, _, ids = cls_forward(router, hidden_states)
        ids = ids.clone()
        ids[pos][ids[pos] == old] = new
        probs = torch.softmax(logits, dtype=torch.float, dim=-1).gather(1, ids)
        return logits, (probs / probs.sum(dim=-1, keepdim=True)).to(logits.dtype), ids

    router.forward = forward
    try:
        return oracle.routing(tokens)
    finally:
        del router.forward


def test_earlier_layer_flip_is_not_called_wrong(oracle):
    """Issue 67: a near tie at an earlier layer that the engine broke the other way gives later layers another input;
    their rows can differ by far more than a near tie with nothing wrong. The oracle judges them again with the
    engine's upstream choices forced (earlier-layer flips, counted apart); a real error after the flip still fails."""
    tokens = np.random.default_rng(5).integers(0, 256, 40).tolist()
    P, K = 30, oracle.top_k
    free = oracle.routing(tokens)
    logits = oracle.router_logits()
    order = np.argsort(-logits, axis=2, kind="stable")
    srt = np.take_along_axis(logits, order, axis=2)
    gaps = (srt[:, :, K - 1] - srt[:, :, K])[:len(tokens) - 1, :-1]     # an upstream layer, a fed token
    for flat in np.argsort(gaps, axis=None):
        pos, layer = (int(x) for x in np.unravel_index(flat, gaps.shape))
        rec_rows = _swapped_routing(oracle, tokens, pos, layer, order[pos, layer, K - 1], order[pos, layer, K])
        later = (np.sort(rec_rows, axis=2) != np.sort(free, axis=2)).any(axis=2)[:len(tokens) - 1]
        later[pos, layer] = False
        gap_ulps = float(gaps[pos, layer]) / float(logit_ulp(srt[pos, layer, K - 1], "float32", floor=1.0))
        far = [(int(p), int(j)) for p, j in zip(*np.nonzero(later))
               if near_tie_gap_ulps(logits[p, j], rec_rows[p, j], K) > gap_ulps * 1.01]
        if far:                     # a later row beyond the tolerance: the free pass calls it wrong
            break
    else:
        pytest.fail("no near-tie swap changed a later row beyond the tolerance")
    rec = wire.Record("r", rec_rows[:P].copy(), rec_rows[P:].copy(), 0, np.array(oracle.layer_ids, np.int32), True,
                      prompt_token_ids=np.array(tokens[:P], np.int32),
                      output_token_ids=np.array(tokens[P:], np.int32))
    rec.routed_experts[-1] = -1
    flipped = sorted((int(p), int(j)) for p, j in zip(*np.nonzero(later)))
    # the forced pass: the model's own ids change nothing; the engine's swap forced in gives every later router the
    # input the swap gives it (each router's own choice then equals the independently built record, the swapped row
    # apart: there the router's own choice is the oracle's)
    assert (oracle.routing_forced(tokens, free) == free).all()
    forced = oracle.routing_forced(tokens, rec_rows)
    expect = rec_rows.copy()
    expect[pos, layer] = free[pos, layer]
    assert (np.sort(forced, axis=2) == np.sort(expect, axis=2)).all()
    saved = oracle.near_tie_ulps
    try:
        oracle.near_tie_ulps = gap_ulps * 1.01                          # the swap itself is a near tie
        v = oracle.check(rec)
        assert v.mismatches == [] and v.forced_error == "", (v.mismatches, v.forced_error)
        assert sorted(t[:2] for t in v.flips) == far and v.ok
        assert sorted(t[:2] for t in v.near_ties) == sorted({(pos, layer), *flipped} - set(far))
        assert v.agree == v.rows - 1 - len(flipped) and v.rows == (len(tokens) - 1) * 4
        # a later row that is wrong on the engine's own upstream choices too: still a failure
        p2, j2 = far[-1]
        rows = rec.prompt_routed_experts if p2 < P else rec.routed_experts
        row = rows[p2 if p2 < P else p2 - P, j2]
        wrong = [e for e in np.argsort(logits[p2, j2])[:K]]           # the oracle's K least likely experts
        row[:] = wrong
        v = oracle.check(rec)
        assert not v.ok and [m[:2] for m in v.mismatches] == [(p2, j2)]
        assert sorted(t[:2] for t in v.flips) == far[:-1]
    finally:
        oracle.near_tie_ulps = saved


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "qwen2_moe", "olmoe", "phimoe", "gpt_oss", "deepseek_v2",
                                  "deepseek_v3", "glm4_moe", "dots1", "minimax_m2", "granitemoe", "llama4",
                                  "qwen3_next", "qwen3_5_moe"])
def test_every_architecture_routers_are_read_and_their_scores_reproduce_their_choice(arch, tmp_path_factory):
    """The oracle finds one router per MoE layer of each generated family, reads the ids it selected from its
    output, and the selection scores it measures near ties on (logits; sigmoid + correction bias, group-limited)
    select exactly those ids in every row. Where the router is DeepSeek-V3 style, the bias and the groups change
    the choice in some rows (the top-k of the logits alone differs): the checkpoint exercises them."""
    pytest.importorskip("transformers")
    from routing_replay.apps.models import ARCHS, make_tiny_model, moe_layer_ids
    from routing_replay.apps.oracle import Oracle, select_topk

    assert arch in ARCHS
    o = Oracle(str(make_tiny_model(tmp_path_factory.getbasetemp() / "models" / arch, arch)))
    assert o.layer_ids == moe_layer_ids(o.model.config) and o.layer_ids
    tokens = np.random.default_rng(11).integers(0, 256, 64).tolist()
    ids = o.routing(tokens)
    keys = o.selection_keys()
    E = int(o.routers[o.layer_ids[0]][0].weight.shape[0])
    assert ids.shape == (64, len(o.layer_ids), o.top_k) and keys.shape == (64, len(o.layer_ids), E)
    assert o.router_logits().shape == keys.shape
    differs = 0
    for j, lid in enumerate(o.layer_ids):
        sel = select_topk(keys[:, j], o.top_k, o.groups(lid))
        got = np.zeros_like(sel)
        np.put_along_axis(got, ids[:, j].astype(np.int64), True, axis=1)
        assert (sel == got).all(), (arch, lid, np.flatnonzero((sel != got).any(axis=1))[:5])
        plain = select_topk(o.router_logits()[:, j], o.top_k)
        differs += int((plain != got).any(axis=1).sum())
    if arch in ("deepseek_v3", "glm4_moe", "dots1", "minimax_m2", "deepseek_v2"):
        assert differs > 0, "bias / groups never changed a choice: the checkpoint does not exercise them"
    else:
        assert differs == 0


def test_forced_passes_on_two_threads_leave_torch_topk_as_it_was(oracle):
    """routing_forced replaces torch.topk for one forward: two oracles forcing on two threads at once each get
    their own forced answer, and torch.topk / Tensor.topk are torch's own afterwards (the windows never
    interleave, so neither restores the other's replacement)."""
    import threading

    import torch

    from routing_replay.apps.oracle import Oracle
    from routing_replay.apps.vllm_harness import tiny_model

    other = Oracle(str(tiny_model("qwen3_moe")))
    tokens = np.random.default_rng(7).integers(0, 256, 24).tolist()
    free = oracle.routing(tokens)
    experts = int(oracle.routers[oracle.layer_ids[0]][0].weight.shape[0])
    rolled = (free + 1) % experts                       # another valid choice for every row
    want = {id(oracle): oracle.routing_forced(tokens, free), id(other): other.routing_forced(tokens, rolled)}
    orig_fn, orig_method = torch.topk, torch.Tensor.topk
    errors: list = []

    def run(o, forced):
        try:
            for _ in range(15):
                got = o.routing_forced(tokens, forced)
                if not np.array_equal(got, want[id(o)]):
                    errors.append("forced answer differs")
        except Exception as e:      # noqa: BLE001 -- reported below
            errors.append(repr(e))

    ts = [threading.Thread(target=run, args=(oracle, free)), threading.Thread(target=run, args=(other, rolled))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    assert errors == []
    assert torch.topk is orig_fn and torch.Tensor.topk is orig_method
