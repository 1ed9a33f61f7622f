"""bench/r3_gpu.py at tiny scale on CPU (`--device cpu --tiny`): the run's exact invariants (replayed routing agrees
on every recorded row, every generated token compared, -1 rows accounted for), its JSON keys and table; and the
wrapper that lets apps/r3.py drive a trainer on an accelerator changes nothing about the measurement."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.procs import load_script

pytestmark = pytest.mark.bench     # runs a bench/ script: `-m "not bench"` selects the specification tests

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "r3_gpu.py"


def _bench():
    return load_script(SCRIPT, "r3_gpu_bench")


def test_help_and_tiny_defaults():
    p = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "--tiny" in p.stdout and "--layers" in p.stdout and "anchor" in p.stdout
    b = _bench()
    a = b.parse_args(["--out", "x"])                                  # the H100 defaults: Qwen3-30B-A3B's layer
    assert (a.layers, a.hidden, a.experts, a.top_k, a.moe_intermediate, a.heads, a.kv_heads, a.head_dim) == \
        (8, 2048, 128, 8, 768, 32, 4, 128)
    assert (a.engine_dtype, a.enforce_eager, a.temperature, a.prompts, a.samples) == ("bfloat16", False, 1.0, 16, 8)
    kw = b.model_kwargs(a)
    assert kw["fan_in_ref"] == 128 and kw["peaked"] and kw["dtype"] == "bfloat16" and kw["device"] == "cuda"
    t = b.parse_args(["--out", "x", "--tiny", "--max-tokens", "8", "--device=cpu"])
    assert (t.layers, t.hidden, t.engine_dtype, t.enforce_eager, t.max_tokens, t.device) == \
        (4, 128, "float32", True, 8, "cpu")                           # --tiny keeps what the command line set
    assert b.model_kwargs(t) == dict(arch="qwen3_moe", seed=0, num_layers=4, num_experts=8, top_k=2, hidden_size=128,
                                     dtype="float32", peaked=True)     # the demo's model, exactly


def _records(L: int, K: int, E: int, n: int, seed: int):
    """Records with random distinct expert ids (the last output row -1, as an engine leaves it) and tokens."""
    from routing_replay.protocol import wire

    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        P, G = int(rng.integers(5, 20)), int(rng.integers(3, 9))
        ids = np.stack([np.stack([rng.permutation(E)[:K] for _ in range(L)]) for _ in range(P + G)]).astype(np.int16)
        ids[-1] = -1
        out.append(wire.Record(f"r{i}", ids[:P], ids[P:], 0, np.arange(L, dtype=np.int32), True,
                               prompt_token_ids=rng.integers(0, 256, P), output_token_ids=rng.integers(0, 256, G)))
    return out


def test_device_wrapper_measures_the_same(tmp_path):
    """on_device() (inputs to the device, logits back to the CPU): on CPU it must give exactly the measurement of the
    bare model, replay exact, own routing partly different."""
    pytest.importorskip("transformers")
    from routing_replay.apps.models import make_tiny_model
    from routing_replay.apps.r3 import load_trainer, measure
    from routing_replay.replay.hf import find_moe_blocks

    b = _bench()
    model = load_trainer(make_tiny_model(tmp_path / "m", "qwen3_moe", peaked=True), "bfloat16")
    recs = _records(L=4, K=2, E=8, n=5, seed=1)
    eng = {r.request_id: np.full(len(r.output_token_ids), -3.0) for r in recs}
    bare = measure(model, recs, eng, batch_size=2, pad_id=257)
    wrapped = measure(b.on_device(model, "cpu"), recs, eng, batch_size=2, pad_id=257)
    assert bare.replay_exact and wrapped.replay_exact
    assert (wrapped.own, wrapped.replay, wrapped.own_drift, wrapped.replay_drift, wrapped.fallback) == \
        (bare.own, bare.replay, bare.own_drift, bare.replay_drift, bare.fallback)
    assert bare.own.same < bare.own.rows                               # random ids: the own router differs
    # nothing left behind on the routers: no replaced forward, no hook
    assert not any("forward" in vars(blk.gate) or blk.gate._forward_hooks for _, blk, _ in find_moe_blocks(model))


@pytest.mark.vllm
@pytest.mark.slow
def test_tiny_cpu_run(tmp_path):
    pytest.importorskip("vllm")
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), "--device", "cpu", "--tiny"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    r = json.loads((out / "r3_gpu.json").read_text())
    for k in ("ok", "problems", "timings_s", "gpu_memory_gib", "model", "engine", "workload", "tokens",
              "minus_one_rows", "r3", "anchor", "flip_probe", "self_check", "device"):
        assert k in r, k
    for k in ("agreement", "rows", "same", "tokens", "abs_dlogp_mean", "abs_dlogp_p99", "over_ln2", "k3"):
        assert k in r["r3"]["own"] and k in r["r3"]["replay"], k
    for k in ("model_generate", "model_save", "engine_start", "rollout", "trainer_load", "trainer_passes",
              "flip_probe", "self_check", "total"):
        assert k in r["timings_s"], k
    assert r["ok"] and r["problems"] == []
    r3, tk, mo, m = r["r3"], r["tokens"], r["minus_one_rows"], r["model"]
    L, n = m["moe_layers"], r["workload"]["requests"]
    assert (m["layers"], m["hidden"], m["experts"], m["top_k"]) == (4, 128, 8, 2)
    # replay: exact on every recorded row
    assert r3["replay_exact"] and r3["replay"]["agreement"] == 1.0 and r3["replay"]["same"] == r3["replay"]["rows"]
    # every generated token compared, in both passes: prompts x samples x max_tokens (ignore_eos)
    assert n == 4 * 4 and tk["records"] == n
    assert r3["own"]["tokens"] == r3["replay"]["tokens"] == tk["generated"] == tk["generated_in_records"] == n * 16
    assert tk["prompt_in_records"] == tk["prompt"]
    # rows: recorded + -1 = all; the -1 rows are exactly r3's fallback rows
    fb = r3["fallback"]
    assert r3["own"]["rows"] == r3["replay"]["rows"] == mo["total_rows"] - mo["minus_one"]
    assert fb["total_rows"] == mo["total_rows"] == (tk["prompt"] + tk["generated"]) * L
    assert fb["prefix_cache_rows"] + fb["last_token_rows"] + fb["other_rows"] == mo["minus_one"]
    assert fb["last_token_rows"] == mo["output_last_token"] == mo["output"] == n * L
    # prefix rows fill (the default): the GRPO groups hit the cache, every hit row carries routing
    assert r["engine"]["prefix_rows"] == "fill" and tk["prefix_cached"] > 0
    assert tk["prefix_filled"] == tk["prefix_cached"] and mo["prompt"] == mo["prompt_cached"] == 0
    assert fb["prefix_cache_rows"] == 0 and tk["prefix_not_found_records"] == 0
    # the flip probe: replaying the trainer's own sets is the identity on CPU; a flipped expert moves the output
    fp = r["flip_probe"]
    assert fp["replay_own_max_abs_diff"] == 0.0 and fp["one_layer"]["kl_mean"] > 0
    sc = r["self_check"]                                  # the routers' own ids replayed: exact in both dtypes
    assert [(d, c["dtype"], c["exact"], c["max_abs_dlogit"]) for d, c in sc.items()] == \
        [("bfloat16", "bfloat16", True, 0.0), ("float32", "float32", True, 0.0)]
    assert sc["bfloat16"]["positions"] == sc["float32"]["positions"] == fp["real_positions"]
    assert fp["all_layers"]["kl_mean"] > fp["one_layer"]["kl_mean"] * 0.5
    assert r3["k3_replay_over_own"] == pytest.approx(r3["replay"]["k3"] / r3["own"]["k3"])
    text = (out / "r3_gpu.txt").read_text()
    assert "routing agreement (recorded rows)" in text and "100.000%" in text and "Qwen3-30B-A3B" in text
    assert "\nOK\n" in p.stdout


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_self_check_replays_the_ids_the_routers_selected_exactly(tmp_path, dtype):
    """The self-check reads the expert ids from each router's output and replays those: exact (logits equal at
    every real position) in bf16 and float32, also where router logits tie exactly (two experts with one router
    row: a top-k recomputed apart from the router's may break those ties the other way)."""
    pytest.importorskip("transformers")
    import torch

    from routing_replay.apps.models import make_tiny_model
    from routing_replay.apps.r3 import load_trainer
    from routing_replay.replay.hf import find_moe_blocks

    b = _bench()
    model = load_trainer(make_tiny_model(tmp_path / "m", "qwen3_moe", peaked=True), dtype)
    for _, blk, spec in find_moe_blocks(model):           # experts 2 and 3 score the same for every token
        w = getattr(blk, spec.router_attr).weight
        with torch.no_grad():
            w[3] = w[2]
    recs = _records(L=4, K=2, E=8, n=5, seed=2)
    sc = b.self_check(model, recs, "cpu", pad_id=257)
    n_real = sum(len(r.prompt_token_ids) + len(r.output_token_ids) for r in recs)
    assert sc == {"dtype": dtype, "positions": n_real, "max_abs_dlogit": 0.0, "max_abs_dlogp": 0.0, "exact": True}
    ids, mask, real, _, _ = b._probe_batch(recs, "cpu", 257)
    _, router_logits, chosen = b._own_pass(model, ids, mask)
    tied = router_logits[..., 2] == router_logits[..., 3]                  # (B, S, L)
    assert bool(tied[real].all())                         # the ties are there, on every real position
    fp = b.flip_probe(model, recs, "cpu", 257)
    assert fp["replay_own_max_abs_diff"] == 0.0 and fp["selected_ids_from"] == "router output"
    assert fp["real_positions"] == n_real and fp["one_layer"]["kl_mean"] > 0
