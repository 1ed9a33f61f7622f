"""bench/vllm_gpu.py's --step-trace summary: each traced step (opened, finished, tokens, pre_step ns, post_step ns,
raw steps) falls in exactly one group by what it did, and the groups add up to the round's every-step figure."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.procs import load_script

pytestmark = pytest.mark.bench     # runs a bench/ script: `-m "not bench"` selects the specification tests

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "vllm_gpu.py"


def test_step_trace_groups_steps_by_what_they_did_and_adds_up_to_every_step():
    summary = load_script(SCRIPT, "vllm_gpu")._trace_summary
    rows = [[32, 0, 16384, 300_000, 100_000, 0],     # a prefill chunk larger than a slot, opening 32
            [0, 0, 256, 10_000, 26_000, 1],          # quiet raw steps
            [0, 0, 256, 12_000, 24_000, 1],
            [0, 32, 224, 90_000, 40_000, 1],         # 32 finish
            [4, 2, 300, 50_000, 30_000, 1]]          # both
    s = summary(rows)
    assert s["steps"] == 5 and s["us_per_step"] == pytest.approx(682.0 / 5)
    assert set(s["kinds"]) == {"opens, general path", "quiet", "finishes", "opens+finishes"}
    q = s["kinds"]["quiet"]
    assert (q["steps"], q["opened"], q["finished"], q["tokens"]) == (2, 0, 0, 512)
    assert (q["pre_us"], q["post_us"], q["total_us"], q["us_per_step"]) == (22.0, 50.0, 72.0, 36.0)
    assert q["us_per_round_step"] == pytest.approx(72.0 / 5)
    o = s["kinds"]["opens, general path"]
    assert (o["steps"], o["opened"], o["tokens"], o["us_per_step"]) == (1, 32, 16384, 400.0)
    assert s["kinds"]["finishes"]["finished"] == 32 and s["kinds"]["opens+finishes"]["total_us"] == 80.0
    assert sum(g["us_per_round_step"] for g in s["kinds"].values()) == pytest.approx(s["us_per_step"])
    assert summary([]) == {"steps": 0, "us_per_step": 0.0, "kinds": {}}
