"""What a request costs apart from its bytes, measured by two benches run for real: bench/zmq_small_messages.py (a C
zmq.proxy chain carries each step's large frame and its small messages, separately or bundled, and the sink counts
every message and frame exactly) and bench/accumulator_requests.py (the consumer's Accumulator in one process)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.bench     # runs a bench/ script: `-m "not bench"` selects the specification tests

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "zmq_small_messages.py"


def test_every_message_and_frame_arrives_separately_or_bundled(tmp_path):
    out = tmp_path / "r.json"
    p = subprocess.run([sys.executable, str(SCRIPT), "--steps", "5", "--small", "0,2", "--repeat", "1",
                        "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    got = [(r["small"], r["bundle"], r["messages"], r["frames"]) for r in json.loads(out.read_text())]
    assert got == [(0, False, 5, 10), (2, False, 15, 20), (2, True, 5, 20)]


def test_bad_arguments_exit_2():
    for args in (["--small", "x"], ["--steps", "0"], ["--small", "-1"]):
        p = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60)
        assert p.returncode == 2, (args, p.stderr)


def test_the_accumulator_bench_assembles_every_request_exactly(tmp_path):
    """bench/accumulator_requests.py: every request of both passes opened, filled by its step's delta and finished
    into a complete record, counted exactly; per-request times reported for each shape."""
    script = SCRIPT.parent / "accumulator_requests.py"
    out = tmp_path / "a.json"
    p = subprocess.run([sys.executable, str(script), "--steps", "3", "--requests", "1,16", "--json", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    got = json.loads(out.read_text())
    assert [(r["requests_per_step"], r["records"], r["complete"]) for r in got] == [(1, 3, 3), (16, 48, 48)]
    assert all(r["open_us"] > 0 and r["finish_us"] > 0 and r["delta_us_per_message"] > 0 for r in got)
    p = subprocess.run([sys.executable, str(script), "--requests", "3"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
