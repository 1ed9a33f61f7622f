"""apps/r3.py: the R3 metrics on constructed inputs (exact values), and one small demo run whose replayed routing
agrees with the engine's records on every recorded row."""

from __future__ import annotations

import math
import re
import subprocess
import sys

import numpy as np
import pytest

from routing_replay.apps.r3 import LN2, Agreement, k3, logprob_drift, quantile, routing_agreement


def test_k3_values():
    assert k3([0.0, 0.0], [0.0, 0.0]) == 0.0
    # r = [0, ln 2, -ln 2]: exp(r) - 1 - r = [0, 1 - ln 2, -1/2 + ln 2]; mean = (1/2) / 3
    assert k3([0.0, LN2, -LN2], [0.0, 0.0, 0.0]) == pytest.approx(1 / 6, abs=1e-16)
    # r = logp_trainer - logp_engine, not the reverse: trainer -1, engine 0 gives exp(-1) - 1 + 1
    assert k3([-1.0], [0.0]) == pytest.approx(math.exp(-1), abs=1e-16)
    assert k3([0.0], [-1.0]) == pytest.approx(math.e - 2, abs=1e-15)
    with pytest.raises(ValueError):
        k3([], [])


def test_quantile_linear_interpolation():
    assert quantile(np.arange(101), 0.99) == 99.0
    assert quantile([0.0, 0.0, 1.0, 2.0], 0.99) == pytest.approx(1.97, abs=1e-15)   # position 2.97
    assert quantile([5.0], 0.99) == 5.0
    with pytest.raises(ValueError):
        quantile([], 0.5)


def test_logprob_drift():
    d = logprob_drift([0.0, -1.0, -2.0, -0.5], [0.0, 0.0, 0.0, -0.5])
    assert d.tokens == 4
    assert d.mean_abs == 0.75
    assert d.p99_abs == pytest.approx(1.97, abs=1e-15)
    assert d.over_ln2 == 0.5                       # |r| = 1 and 2 exceed ln 2; 0 and 0 do not
    assert d.k3 == pytest.approx((math.exp(-1) + math.exp(-2) + 1) / 4, abs=1e-16)
    assert logprob_drift([-LN2], [0.0]).over_ln2 == 0.0          # exactly ln 2 is not "more than"
    with pytest.raises(ValueError):
        logprob_drift([0.0], [0.0, 0.0])


def test_routing_agreement_sets_and_unrecorded_rows():
    engine = np.array([[[0, 1], [2, 3]],            # token 0, layers 0 and 1
                       [[4, 5], [-1, -1]],          # token 1: layer 1 never computed (not compared)
                       [[-1, -1], [-1, -1]]], np.int16)
    trainer = np.array([[[1, 0], [2, 4]],           # same set in another order; a flipped expert
                        [[4, 5], [6, 7]],
                        [[0, 1], [0, 1]]])
    a = routing_agreement(trainer, engine)
    assert a == Agreement(rows=3, same=2)
    assert a.share == 2 / 3
    assert a + Agreement(1, 1) == Agreement(4, 3)
    assert Agreement(0, 0).share == 1.0
    with pytest.raises(ValueError):
        routing_agreement(trainer[:2], engine)


@pytest.mark.parametrize("arch", ["granitemoe", "llama4"])
def test_measure_reads_the_ids_each_router_selected(tmp_path, arch):
    """Granite-MoE's router returns (ids, weights, logits), Llama-4's dense scores and logits: the trainer pass reads
    the selected ids by the router's family. Records holding the model's own choices (read here from each router's
    output, independently) agree on every recorded row with and without replay, at the same log-probabilities."""
    import torch

    from routing_replay.apps.models import make_tiny_model
    from routing_replay.apps.r3 import load_trainer, measure
    from routing_replay.protocol import wire

    model = load_trainer(make_tiny_model(tmp_path / "m", arch), "float32")
    K = model.config.num_experts_per_tok
    routers = [m for n, m in model.named_modules() if n.endswith(("block_sparse_moe.router", "feed_forward.router"))]
    assert len(routers) == 4
    rng = np.random.default_rng(3)
    recs, eng = [], {}
    for i in range(3):
        P, G = int(rng.integers(5, 12)), int(rng.integers(3, 7))
        toks = rng.integers(0, 256, P + G)
        got = []
        hs = [r.register_forward_hook(lambda _m, _a, out: got.append(
            out[0] if arch == "granitemoe" else out[0].ne(0).nonzero()[:, 1:].reshape(-1, K))) for r in routers]
        with torch.no_grad():
            model(input_ids=torch.from_numpy(toks)[None])
        for h in hs:
            h.remove()
        ids = torch.stack(got, dim=1).numpy().astype(np.int16)              # (P + G, L, K)
        ids[-1] = -1                                                         # the last token: never fed
        recs.append(wire.Record(f"r{i}", ids[:P], ids[P:], 0, np.arange(4, dtype=np.int32), True,
                                prompt_token_ids=toks[:P], output_token_ids=toks[P:]))
        eng[f"r{i}"] = np.full(G, -3.0)
    rows = sum(len(r.prompt_token_ids) + len(r.output_token_ids) - 1 for r in recs) * 4
    rep = measure(model, recs, eng, batch_size=3, pad_id=257)
    assert (rep.own, rep.replay) == (Agreement(rows, rows), Agreement(rows, rows))
    assert rep.own_drift == rep.replay_drift
    assert (rep.fallback.last_token_rows, rep.fallback.other_rows) == (3 * 4, 0)


@pytest.mark.vllm
@pytest.mark.slow
def test_demo_replay_agrees_on_every_recorded_row(tmp_path):
    pytest.importorskip("vllm")
    p = subprocess.run([sys.executable, "-m", "routing_replay.apps.demo", "--out", str(tmp_path / "out"),
                        "--requests", "8", "--group-size", "4", "--prefixes", "1", "--rounds", "1",
                        "--max-tokens", "16", "--inprocess"], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    out = p.stdout
    m = re.search(r"R3 replayed routing\s+100\.000% of ([\d,]+) rows agree", out)
    assert m, out[-3000:]
    from routing_replay.consumer import load_records
    recs = load_records(tmp_path / "out")
    recorded = sum(int((np.concatenate([r.prompt_routed_experts, r.routed_experts]) >= 0).all(-1).sum())
                   for r in recs.values())
    assert int(m.group(1).replace(",", "")) == recorded                 # every recorded row was compared
    cached = sum(r.num_cached_tokens for r in recs.values())
    assert cached > 0 and all(r.num_prefix_filled == r.num_cached_tokens for r in recs.values())
    L = next(iter(recs.values())).prompt_routed_experts.shape[1]
    # the demo runs with --prefix-rows fill: prefix-cache hits carry routing, only the last tokens fall back
    assert re.search(r"R3 fallback rows\s+0 prefix-cache rows \(0 tokens\), "
                     rf"{len(recs) * L:,} last-token rows, 0 other", out), out[-3000:]
    assert re.search(r"R3 trainer\s+HF transformers bfloat16, 8 samples, 128 generated tokens", out)
