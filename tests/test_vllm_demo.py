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
