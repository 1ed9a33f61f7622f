"""bench/worker_step_probe.py drives the worker's real pre_step/post_step without vLLM: a short CPU run of each mode
hands over exactly the rows of the steps it ran (or none, opted out) and the producer's thread takes every delta."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.procs import load_script

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "worker_step_probe.py"


def _probe():
    return load_script(SCRIPT, "worker_step_probe")


@pytest.mark.parametrize("mode", ["on", "optout", "optout-fill"])
def test_probe_runs_the_worker_and_counts_exactly(mode):
    n, steps, prompt_len = 8, 40, 16
    r = _probe().run(mode, n, 4, 2, steps, 1, "cpu", eager=False, worker_timing=True, prompt_len=prompt_len)
    warm = steps // 4                                               # the probe's untimed warm-up steps
    assert r["steps"] == steps and r["producer_drained"]
    if mode == "on":
        assert (r["active_steps"], r["rows"]) == (steps + warm, n * prompt_len + n * (steps + warm - 1))
    else:
        assert (r["active_steps"], r["rows"]) == (0, 0)
    # timed sections: pre_step always; post_step only where it has work (publishing rows; with a store under
    # CUDA graphs and nothing to gather it only checks that the forward ended the step)
    assert r["sections_per_step"] == {"on": 2, "optout": 1, "optout-fill": 1}[mode]
    assert r["calls_us"] > 0 and r["calls_wall_us"] > 0 and 0 < r["clocks_us"] < r["pre_post_us"]

def test_probe_with_step_stamps_checks_every_step_and_launches_no_fill():
    """Graph mode with step stamps (ROUTING_REPLAY_STEP_STAMP=on): no -1 fill, and the producer's thread checked the
    stamp of every step it published (a stale one would have stopped it)."""
    n, steps, prompt_len = 8, 40, 16
    r = _probe().run("on", n, 4, 2, steps, 1, "cpu", eager=False, prompt_len=prompt_len, pieces=True, stamp=True)
    warm = steps // 4
    assert r["step_stamp"] and r["producer_drained"]
    assert r["active_steps"] == steps + warm and r["stamps_checked"] == steps + warm
    assert r["pieces_wall_us"]["fill_step"] == 0 and r["pieces_wall_us"]["copier_submit"] > 0
    plain = _probe().run("on", n, 4, 2, steps, 1, "cpu", eager=False, prompt_len=prompt_len, pieces=True)
    assert not plain["step_stamp"] and plain["stamps_checked"] == 0 and plain["pieces_wall_us"]["fill_step"] > 0


def test_help():
    p = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "--evict-mib" in p.stdout and "--worker-timing" in p.stdout
