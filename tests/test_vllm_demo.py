"""The main job end to end: `python -m routing_replay.apps.demo` (vLLM's default multi-process layout, embedded
pipeline, npz, oracle) exits 0 and leaves one complete record per captured request."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
pytest.importorskip("vllm")


def test_demo_passes_and_writes_records(tmp_path):
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, "-m", "routing_replay.apps.demo", "--out", str(out), "--requests", "24",
                        "--rounds", "1", "--max-tokens", "24"], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "oracle (HF transformers)  PASS" in p.stdout and "\nOK\n" in p.stdout
    assert "24 written, 24 complete" in p.stdout
    from routing_replay.consumer import load_records
    recs = load_records(out)
    assert len(recs) == 24 and all(r.complete for r in recs.values())
    cached = sum(r.num_cached_tokens for r in recs.values())
    assert cached > 0                                                    # the shared prefixes hit the cache
    # --prefix-rows fill is the demo's default: every hit row carries routing, and the summary says so
    assert all(r.num_prefix_filled == r.num_cached_tokens for r in recs.values())
    assert all((r.prompt_routed_experts >= 0).all() for r in recs.values())
    assert f"{cached:,} filled from the prefix store, 0 not found" in p.stdout


def test_demo_on_deepseek_v3(tmp_path):
    """`--arch deepseek_v3`: MLA attention, sigmoid scores with `e_score_correction_bias`, 4 expert groups of which
    2 are kept, a dense first layer. vLLM's CPU build turns prefix caching off for MLA, and its MLA attention
    computes other hidden states than transformers' (docs/VLLM.md): the whole-sequence oracle is reported, not
    counted. The R3 measurement replays the records through the trainer's DeepSeek-V3 routers exactly."""
    import re

    import numpy as np

    out = tmp_path / "out"
    p = subprocess.run([sys.executable, "-m", "routing_replay.apps.demo", "--out", str(out), "--arch", "deepseek_v3",
                        "--requests", "8", "--group-size", "4", "--prefixes", "1", "--rounds", "1",
                        "--max-tokens", "16"], capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    s = p.stdout
    assert "\nOK\n" in s and "8 written, 8 complete" in s
    assert re.search(r"vLLM\s+[\d.]+, multi-process engine, deepseek_v3 float32 \(3 MoE layers, top-2\)", s), s
    from routing_replay.consumer import load_records
    recs = load_records(out)
    assert len(recs) == 8 and all(r.complete for r in recs.values())
    assert all(r.moe_layer_ids.tolist() == [1, 2, 3] for r in recs.values())          # layer 0 is dense
    assert all(r.num_cached_tokens == 0 for r in recs.values())
    prompt_rows = sum(len(r.prompt_token_ids) for r in recs.values())
    assert f"none: vLLM turned prefix caching off for this model ({prompt_rows:,} prompt rows computed)" in s
    recorded = sum(int((np.concatenate([r.prompt_routed_experts, r.routed_experts]) >= 0).all(-1).sum())
                   for r in recs.values())
    assert recorded == sum(len(r.prompt_token_ids) + 16 - 1 for r in recs.values()) * 3     # all but last tokens
    m = re.search(r"oracle \(HF transformers\)\s+(PASS|N/A): ([\d,]+) \(token, layer\) rows", s)
    assert m and int(m.group(2).replace(",", "")) == recorded, s[-3000:]
    if m.group(1) == "N/A":
        assert "MLA attention computes other hidden states" in s
    assert re.search(rf"R3 replayed routing\s+100\.000% of {recorded:,} rows agree with the engine", s), s[-3000:]
    assert re.search(rf"R3 fallback rows\s+0 prefix-cache rows \(0 tokens\), {8 * 3} last-token rows, 0 other, of "
                     rf"{recorded + 8 * 3:,} \(token, layer\) rows", s), s[-3000:]
    assert re.search(r"R3 trainer\s+HF transformers bfloat16, 8 samples, 128 generated tokens", s), s[-3000:]


def test_demo_on_glm4_moe(tmp_path):
    """`--arch glm4_moe`: the DeepSeek-V3 router (sigmoid, correction bias, groups) with grouped-query attention, which
    vLLM computes as transformers does: the oracle is counted and passes, prefix-cache hits carry filled routing,
    and replay agrees with the engine on every recorded row."""
    import re

    import numpy as np

    out = tmp_path / "out"
    p = subprocess.run([sys.executable, "-m", "routing_replay.apps.demo", "--out", str(out), "--arch", "glm4_moe",
                        "--requests", "8", "--group-size", "4", "--prefixes", "1", "--rounds", "1",
                        "--max-tokens", "16"], capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    s = p.stdout
    from routing_replay.consumer import load_records
    recs = load_records(out)
    assert len(recs) == 8 and all(r.complete for r in recs.values())
    assert all(r.moe_layer_ids.tolist() == [1, 2, 3] for r in recs.values())
    cached = sum(r.num_cached_tokens for r in recs.values())
    assert cached > 0 and f"{cached:,} filled from the prefix store, 0 not found" in s
    recorded = sum(int((np.concatenate([r.prompt_routed_experts, r.routed_experts]) >= 0).all(-1).sum())
                   for r in recs.values())
    assert re.search(rf"oracle \(HF transformers\)\s+PASS: {recorded:,} \(token, layer\) rows", s), s[-3000:]
    assert re.search(rf"R3 replayed routing\s+100\.000% of {recorded:,} rows agree with the engine", s), s[-3000:]
    assert "\nOK\n" in s
