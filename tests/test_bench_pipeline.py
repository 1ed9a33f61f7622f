"""bench/pipeline.py --repeat: each repeat measures the chains side by side, their order alternated, and the summary
is each repeat's ratio with their median (the chains are stand-ins here: the arithmetic and the order are checked)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.procs import load_script

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "pipeline.py"


def test_repeats_alternate_the_chains_and_report_each_ratio_with_the_median(monkeypatch, capsys, tmp_path):
    bench = load_script(SCRIPT, "bench_pipeline")
    calls = []
    speed = {("ours", 0): 80.0, ("proxy", 0): 100.0, ("ours", 1): 90.0, ("proxy", 1): 60.0,
             ("ours", 2): 70.0, ("proxy", 2): 100.0}

    def measure_chain(chain, workload, n_steps, **kw):
        rep = sum(1 for c, w in calls if c == chain and w == workload)
        calls.append((chain, workload))
        return {"chain": chain, "workload": workload, "tokens_per_s": speed[(chain, rep)], "MB_per_s": 1.0,
                "seconds": 1.0, "consumer_rss_mb": [], "cpu_s": {}, "records": 4, "messages": 9,
                "held_peak_mb": [], "record_mb": [], "rss_over_records": []}

    monkeypatch.setattr(bench, "measure_chain", measure_chain)
    out = tmp_path / "r.json"
    assert bench.main(["--workloads", "prefill", "--chains", "ours,proxy", "--no-latency", "--repeat", "3",
                       "--json", str(out)]) == 0
    assert calls == [("ours", "prefill"), ("proxy", "prefill"), ("proxy", "prefill"), ("ours", "prefill"),
                     ("ours", "prefill"), ("proxy", "prefill")]
    text = capsys.readouterr().out
    assert "prefill: ours/proxy=0.80 (median of 3 alternated repeats: 0.80 1.50 0.70; min 0.70, max 1.50)" in text
    import json
    summary = [r for r in json.loads(out.read_text()) if r.get("summary")]
    assert summary == [{"summary": True, "workload": "prefill", "vs": "proxy", "ratios": [0.8, 1.5, 0.7],
                        "median": 0.8, "min": 0.7, "max": 1.5}]
    with pytest.raises(SystemExit):
        bench.main(["--repeat", "0"])
