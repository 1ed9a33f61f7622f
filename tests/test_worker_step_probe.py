"""bench/worker_step_probe.py, the benchmark script itself: it runs the worker's real pre_step/post_step in each
mode and reports its counts and timing fields, its CLI works, and bench/vllm_overhead.py's warm line goes through
it. What the worker does in those steps is specified in tests/test_worker_step_loop.py, test_worker_lifecycle.py
and test_worker_prefix_fill.py (through the worker's public constructor, not this script)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.procs import load_script

pytestmark = pytest.mark.bench     # runs a bench/ script: `-m "not bench"` selects the specification tests

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "worker_step_probe.py"


def _probe():
    return load_script(SCRIPT, "worker_step_probe")


@pytest.mark.parametrize("mode", ["on", "optout", "optout-fill"])
def test_probe_runs_each_mode_and_reports_its_counts_and_timing_fields(mode):
    n, steps, prompt_len = 8, 40, 16
    r = _probe().run(mode, n, 4, 2, steps, 1, "cpu", eager=False, worker_timing=True, prompt_len=prompt_len)
    warm = steps // 4                                               # the probe's untimed warm-up steps
    assert r["steps"] == steps and r["producer_drained"] and r["encode_errors"] == 0
    if mode == "on":
        assert (r["active_steps"], r["rows"]) == (steps + warm, n * prompt_len + n * (steps + warm - 1))
    else:
        assert (r["active_steps"], r["rows"]) == (0, 0)
    assert r["sections_per_step"] == {"on": 2, "optout": 1, "optout-fill": 1}[mode]
    assert r["calls_us"] > 0 and r["calls_wall_us"] > 0 and 0 < r["clocks_us"] < r["pre_post_us"]


def test_eager_probe_times_the_router_hooks_apart():
    r = _probe().run("on", 8, 4, 2, 40, 1, "cpu", eager=True, prompt_len=16)
    assert not r["graph_mode"] and r["producer_drained"] and r["encode_errors"] == 0
    assert r["hooks_us"] > 0 and r["plugin_us"] == pytest.approx(r["calls_us"] + r["hooks_us"], abs=0.02)


def test_probe_pieces_time_the_calls_the_steps_make():
    """--pieces: with step stamps no -1 fill is timed (none runs), the copier's submit is; without, the fill is."""
    stamped = _probe().run("on", 8, 4, 2, 40, 1, "cpu", eager=False, prompt_len=16, pieces=True, stamp=True)
    assert stamped["step_stamp"] and stamped["stamps_checked"] == 50
    assert stamped["pieces_wall_us"]["fill_step"] == 0 and stamped["pieces_wall_us"]["copier_submit"] > 0
    plain = _probe().run("on", 8, 4, 2, 40, 1, "cpu", eager=False, prompt_len=16, pieces=True)
    assert not plain["step_stamp"] and plain["stamps_checked"] == 0 and plain["pieces_wall_us"]["fill_step"] > 0


@pytest.mark.parametrize("churn", [0, 1])
def test_probe_reports_quiet_steps_only_with_worker_timing(churn):
    kw = dict(prompt_len=16, stamp=True, ring=True, churn=churn, churn_prompt=12, churn_output=5)
    r = _probe().run("on", 8, 4, 2, 40, 1, "cpu", eager=False, worker_timing=True, **kw)
    assert (r["quiet_steps"], r["quiet_sections"]) == ((49, 98) if churn == 0 else (0, 0))
    assert ("quiet_net_wall_us" in r) == (churn == 0)
    untimed = _probe().run("on", 8, 4, 2, 40, 1, "cpu", eager=False, worker_timing=False, **kw)
    assert "quiet_steps" not in untimed


def test_a_ring_run_of_steps_faster_than_the_producers_thread_waits_for_it_and_loses_no_rows():
    """The probe's steps take microseconds (an engine's take milliseconds): without waiting, the engine thread would
    run a whole step ring ahead of the producer's thread, whose reads of reused slots would then be lost. The
    probe waits, untimed, while more than one batch queues."""
    n, layers, steps = 256, 16, 400
    r = _probe().run("on", n, layers, 8, steps, 0, "cpu", eager=False, prompt_len=1, stamp=True, ring=True)
    warm = min(100, steps // 4)
    assert r["step_ring"] and r["producer_drained"] and r["encode_errors"] == 0
    assert r["ring_steps"] == r["active_steps"] == steps + warm and r["rows"] == n * (steps + warm)


def test_help():
    p = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "--evict-mib" in p.stdout and "--worker-timing" in p.stdout


def test_cli_runs_a_mode_and_writes_its_json(tmp_path):
    out = tmp_path / "probe.json"
    p = subprocess.run([sys.executable, str(SCRIPT), "--mode", "on", "--requests", "4", "--layers", "2", "--top-k",
                        "2", "--steps", "8", "--evict-mib", "0", "--json", str(out)], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr
    (r,) = json.loads(out.read_text())
    assert json.loads(p.stdout.splitlines()[-1]) == r
    assert (r["mode"], r["steps"], r["active_steps"], r["rows"]) == ("on", 8, 10, 4 * 16 + 4 * 9)


def test_vllm_overhead_warm_line_times_the_real_worker_host_path():
    """bench/vllm_overhead.py's warm-cache line runs the worker's own pre_step/post_step and hooks (the eager CPU
    host path, every step by reference), not a copy of them: the probe it calls must have taken every step that way,
    or it raises."""
    ov = load_script(ROOT / "bench" / "vllm_overhead.py", "vllm_overhead")
    # 48 layers: the hooks' CPU per step well above the clocks' noise
    m = ov.micro(num_layers=48, top_k=2, reqs=8, steps=40)
    assert sorted(m) == ["hooks x48", "pre_step + post_step"]
    assert all(v > 0 for v in m.values()), m
