"""bench/open_storm.py run for real: a batch of requests opened, stepped and finished through a broker and two
consumer processes, with `opens` and with one `open` per request (a broker that does not take `opens`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.bench     # runs a bench/ script: `-m "not bench"` selects the specification tests

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "open_storm.py"


def test_every_request_of_both_modes_comes_out_complete(tmp_path):
    out = tmp_path / "r.json"
    p = subprocess.run([sys.executable, str(SCRIPT), "--requests", "32", "--repeat", "1", "--modes", "opens,singles",
                        "--json", str(out)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    rs = json.loads(out.read_text())
    assert sorted(r["mode"] for r in rs) == ["opens", "opens", "singles", "singles"]     # each mode run twice
    for r in rs:
        # the warm-up request, then two rounds of 32 (the first not reported), each finished after its one row
        assert (r["records"], r["complete"], r["requests_opened"]) == (65, 64, 65), r
        if r["mode"] == "opens":
            assert r["opens_msgs"] >= 2 and r["broker_opens_in"] == r["opens_msgs"]
        else:
            assert (r["opens_msgs"], r["broker_opens_in"]) == (0, 0)
        assert all(r[ph]["cpu_us"] > 0 and r[ph]["wall_us"] > 0 for ph in ("open", "delta", "finish"))
    assert "median CPU us per request" in p.stdout


def test_bad_arguments_exit_2():
    for args in (["--requests", "x"], ["--requests", "0"], ["--modes", "both"], ["--repeat", "0"]):
        p = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60)
        assert p.returncode == 2, (args, p.stderr)
