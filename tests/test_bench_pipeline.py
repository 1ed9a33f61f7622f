"""bench/pipeline.py --repeat: each repeat measures the chains side by side, their order alternated, and the summary
is each repeat's ratio with their median (the chains are stand-ins here: the arithmetic and the order are checked)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.procs import load_script

pytestmark = pytest.mark.bench     # runs a bench/ script: `-m "not bench"` selects the specification tests

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
    assert summary == [{"summary": True, "workload": "prefill", "chain": "ours", "vs": "proxy", "ratios": [0.8, 1.5, 0.7],
                        "median": 0.8, "min": 0.7, "max": 1.5}]
    with pytest.raises(SystemExit):
        bench.main(["--repeat", "0"])


def test_the_copy_chains_consumer_copies_every_payload_byte_once_and_wraps_at_the_end():
    import numpy as np
    bench = load_script(SCRIPT, "bench_pipeline")
    buf = np.zeros(10, dtype=np.uint8)
    at = bench.copy_in(buf, 0, [b"\x01\x02\x03", bytearray(b"\x04\x05\x06\x07")])
    assert at == 7 and buf.tolist() == [1, 2, 3, 4, 5, 6, 7, 0, 0, 0]
    at = bench.copy_in(buf, at, [memoryview(b"\x08\x09\x0a\x0b")])     # does not fit before the end: at 0
    assert at == 4 and buf.tolist() == [8, 9, 10, 11, 5, 6, 7, 0, 0, 0]


def test_the_copy_chain_is_compared_with_ours_and_with_the_proxy(monkeypatch, capsys):
    bench = load_script(SCRIPT, "bench_pipeline")
    speed = {"ours": 60.0, "proxy": 100.0, "copy": 75.0}

    def measure_chain(chain, workload, n_steps, **kw):
        return {"chain": chain, "workload": workload, "tokens_per_s": speed[chain], "MB_per_s": 1.0,
                "seconds": 1.0, "consumer_rss_mb": [], "cpu_s": {}, "records": 4, "messages": 9,
                "held_peak_mb": [], "record_mb": [], "rss_over_records": []}

    monkeypatch.setattr(bench, "measure_chain", measure_chain)
    assert bench.main(["--workloads", "prefill", "--chains", "proxy,copy,ours", "--no-latency"]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("prefill:")]
    assert lines == ["prefill: ours/proxy=0.60", "prefill: ours/copy=0.80", "prefill: copy/proxy=0.75"]


def test_prefill_n_splits_the_steps_tokens_over_n_requests_each_opened_and_finished(monkeypatch, capsys):
    """prefill:N: the same 8192 tokens per step as `prefill` (4 x 2048), over N requests, each with its own open,
    delta entry and finish; main() takes the form and refuses what it cannot run."""
    bench = load_script(SCRIPT, "bench_pipeline")
    for workload, nr in (("prefill", 4), ("prefill:1", 1), ("prefill:2", 2), ("prefill:256", 256)):
        steps, tok = bench._steps(workload, 3)
        per = 8192 // nr
        assert tok == 8192 and len(steps) == 3
        for s, st in enumerate(steps):
            assert st.ids == [f"cmpl-{s:06d}-{j}-prefill-request" for j in range(nr)]
            assert (st.starts, st.counts) == ([0] * nr, [per] * nr)
            assert st.opens == [(r, per) for r in st.ids] and st.finishes == [(r, 1, per) for r in st.ids]
        assert len({r for st in steps for r in st.ids}) == 3 * nr          # every request its own id
    seen = []

    def measure_chain(chain, workload, n_steps, **kw):
        seen.append((chain, workload, n_steps))
        return {"chain": chain, "workload": workload, "tokens_per_s": 1.0, "MB_per_s": 1.0, "seconds": 1.0,
                "consumer_rss_mb": [], "cpu_s": {}, "records": 4, "messages": 9, "held_peak_mb": [], "record_mb": [],
                "rss_over_records": []}

    monkeypatch.setattr(bench, "measure_chain", measure_chain)
    assert bench.main(["--workloads", "prefill:1,prefill", "--chains", "ours", "--no-latency"]) == 0
    assert seen == [("ours", "prefill:1", 200), ("ours", "prefill", 200)]
    for bad in ("prefill:3", "prefill:0", "prefill:512", "prefill:x", "decode:2", "nope"):
        with pytest.raises(SystemExit) as e:
            bench.main(["--workloads", bad, "--no-latency"])
        assert e.value.code == 2
    assert "prefill:N takes N = 1, 2, 4, ... 256" in capsys.readouterr().err


def test_a_real_prefill_n_run_delivers_a_record_per_request(tmp_path):
    """bench/pipeline.py --workloads prefill:2 --quick, really run (producer, broker and consumers as processes):
    20 steps of 2 requests of 4096 tokens, every request's record assembled, exactly."""
    import json
    import subprocess
    import sys
    out = tmp_path / "r.json"
    p = subprocess.run([sys.executable, str(SCRIPT), "--workloads", "prefill:2", "--chains", "ours", "--quick",
                        "--no-latency", "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    (r,) = json.loads(out.read_text())
    assert (r["workload"], r["chain"], r["records"]) == ("prefill:2", "ours", 40)
    assert len(r["record_mb"]) == 2 and sum(r["record_mb"]) == pytest.approx(40 * 4096 * 768 / 1e6, abs=0.1)
    # the first-touch cost as the batch started, and each process's first touches during it (thousands)
    assert r["page_us"] > 0 and sorted(r["faults_k"]) == ["broker", "consumer", "sender"]
    sender = r["faults_k"].pop("sender")            # the producer's process: one figure
    assert isinstance(sender, float) and sender >= 0
    assert len(r["faults_k"]["broker"]) == 1 and len(r["faults_k"]["consumer"]) == 2
    assert all(isinstance(x, float) and x >= 0 for xs in r["faults_k"].values() for x in xs), r["faults_k"]
    # the measured batch's seconds with the producer's replay window full (it waited for acks)
    assert isinstance(r["replay_full_s"], float) and 0 <= r["replay_full_s"] <= r["seconds"]
    assert f"replay_full_s={r['replay_full_s']}" in p.stdout


def _exit_with(code):
    raise SystemExit(code)


def test_a_wait_ends_as_soon_as_a_bench_process_has_died():
    """A role that dies (a traceback in its own process) ends the run's wait at once, naming it, instead of the
    run hanging for the wait's timeout (up to 900 s) on a message that will never come."""
    import multiprocessing as mp
    import time
    bench = load_script(SCRIPT, "bench_pipeline")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ok = ctx.Process(target=_exit_with, args=(0,), name="consumer")
    bad = ctx.Process(target=_exit_with, args=(3,), name="producer")
    ok.start()
    ok.join()
    bench._live[:] = [ok]
    with pytest.raises(__import__("queue").Empty):
        bench._get(q, 1.5)                      # a clean exit is not a death: the wait runs to its timeout
    bad.start()
    bad.join()
    bench._live.append(bad)
    t = time.monotonic()
    with pytest.raises(RuntimeError, match=rf"bench process died: producer \(pid {bad.pid}\) exit code 3"):
        bench._wait(q, "done", 2, 900)
    assert time.monotonic() - t < 5
    q.put(("done", 1))
    assert bench._get(q, 900) == ("done", 1)    # what did come is still read first
    bench._live.clear()


def test_proc_stat_fields_name_cpu_and_minor_faults(tmp_path):
    import os
    bench = load_script(SCRIPT, "bench_pipeline")
    tick = os.sysconf("SC_CLK_TCK")
    # /proc/PID/stat: pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime
    line = f"4242 (zmq (io) 1) S 1 2 3 0 -1 4194560 123457 9 5 0 {3 * tick} {tick} 0 0 20 0 4 0\n"
    (tmp_path / "stat").write_text(line)
    assert bench._stat(str(tmp_path / "stat")) == ("zmq (io) 1", 4.0, 123457)
    assert bench._faults(-1) == -1 and bench.fresh_page_us(1) > 0


def test_bench_profile_all_writes_each_threads_python_profile(tmp_path):
    """BENCH_PROFILE=all --profile DIR, really run: besides each role's main-thread stats and per-thread CPU, every
    Python thread a role starts has its own cProfile stats, named after the thread (the producer's sender thread is
    where the request-major copy runs; the consumer's thread is where rows are applied)."""
    import os
    import pstats
    import subprocess
    import sys
    prof = tmp_path / "prof"
    env = dict(os.environ, BENCH_PROFILE="all")
    p = subprocess.run([sys.executable, str(SCRIPT), "--workloads", "decode", "--chains", "ours", "--quick",
                        "--no-latency", "--profile", str(prof)], capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    names = sorted(f.name for f in prof.iterdir())
    sender = [n for n in names if n.startswith("producer-") and "-rr-producer-" in n and n.endswith(".prof")]
    consumers = [n for n in names if n.startswith("consumer-") and "-rr-consumer-" in n and n.endswith(".prof")]
    assert len(sender) == 1 and len(consumers) == 2, names
    assert len([n for n in names if n.endswith(".cpu")]) == 4, names

    def calls(name: str, func: str) -> int:
        st = pstats.Stats(str(prof / name)).stats
        return sum(v[1] for (path, _, fn), v in st.items() if fn == func and path.endswith(".py"))

    assert calls(sender[0], "_run") == 1                     # the sender thread's own body, once
    assert calls(sender[0], "publish_rows") == 0             # the caller's calls are the main thread's
    (main,) = [n for n in names if n.startswith("producer-") and n.count("-") == 1 and n.endswith(".prof")]
    assert calls(main, "publish_rows") == 400                # --quick: 400 decode steps, one publish call each
    for c in consumers:
        assert calls(c, "_on_broker_message") > 0


def test_page_touch_prints_one_line_per_wait_and_refuses_bad_arguments(capsys):
    touch = load_script(SCRIPT.parent / "page_touch.py", "bench_page_touch")
    assert touch.main(["--mib", "2", "--waits", "0,0"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and all(ln.startswith("idle   0.0 s before: 2 MiB first touch") for ln in lines)
    assert all(float(ln.split()[-2]) > 0 for ln in lines)           # µs per page
    for bad in (["--waits", "x"], ["--mib", "0"], ["--waits", "-1"]):
        with pytest.raises(SystemExit) as e:
            touch.main(bad)
        assert e.value.code == 2


def test_request_major_copy_ways_agree_with_the_producers_copy(capsys):
    """bench/request_major_copy.py: every way it times gives the producer's request_major result (it exits 1 when
    one differs), for a repeated payload and for distinct steps."""
    rmc = load_script(SCRIPT.parent / "request_major_copy.py", "bench_request_major_copy")
    assert rmc.main(["--requests", "6", "--steps", "3", "--destinations", "2", "--repeat", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    import numpy as np
    order = np.array([1, 0, 2])
    inverse = np.empty_like(order)
    inverse[order] = np.arange(3)
    arrs = [np.arange(3 * 48 * 8, dtype=np.int16).reshape(3, 48, 8) + 1000 * s for s in range(2)]
    ways = rmc.ways(order, inverse, {id(arrs): np.concatenate([a.reshape(-1) for a in arrs])})
    names = ["producer numpy (grouped by owner)", "np.stack, no grouping", "gather into a temporary, then copy",
             "take, then copy", "memcpy of the same bytes"]
    if rmc._gather is not None:
        names = ["producer C, streaming (grouped by owner)", "producer C, memcpy per row", *names]
    assert list(ways) == names
    built = rmc._gather is not None
    assert lines[0].startswith("3 steps x 6 requests x 768 B") and len(lines) == 1 + (not built) + 2 * len(names)
    for name in names[:-1]:
        if name == "np.stack, no grouping":
            continue
        out = np.zeros((3, 2, 48, 8), np.int16)
        ways[name](arrs, out)
        assert np.array_equal(out[0, 1], arrs[1][1]) and np.array_equal(out[1, 0], arrs[0][0]), name
        assert np.array_equal(out[2, 1], arrs[1][2]) and np.array_equal(out[0, 0], arrs[0][1]), name


def test_latency_takes_each_steps_first_arrival_after_the_measured_batch_sent_it():
    """_latency with --batches 2: a consumer sees every position once per batch; a step's latency is the slowest
    consumer's first arrival at or after its send time in the measured batch, never an earlier batch's arrival."""
    bench = load_script(SCRIPT, "bench_pipeline")
    send = {0: 10.0, 1: 10.5, 2: 11.0}
    # consumer A: batch 1 at 1.x, batch 2 at 10.001, 10.502 (and again 10.9: a later message), 11.004
    a = {0: [1.0, 10.001], 1: [1.5, 10.502, 10.9], 2: [2.0, 11.004]}
    # consumer B: step 2 never arrived in the measured batch (only batch 1's)
    b = {0: [1.1, 10.003], 1: [1.6, 10.501], 2: [2.1]}
    lat = bench._latency(send, [a, b], 3)
    assert lat["n"] == 2
    assert lat["per_step_ms"] == [3.0, 2.0, -1.0]
    assert lat["slowest"] == [(0, 3.0), (1, 2.0)]
    assert (lat["p50_ms"], lat["max_ms"]) == (2.5, 3.0)


def test_a_real_latency_run_measures_the_second_batch(tmp_path):
    """bench/pipeline.py --workloads "" --quick --batches 2, really run: the latency run alone, its second batch
    measured (200 decode steps of 256 requests, each batch's records delivered), every step timed."""
    import json
    import subprocess
    import sys
    out = tmp_path / "r.json"
    p = subprocess.run([sys.executable, str(SCRIPT), "--workloads", "", "--quick", "--batches", "2",
                        "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    r, px, s_ours, s_proxy = json.loads(out.read_text())
    assert (r["workload"], r["chain"], r["batches"], r["records"]) == ("decode", "ours", 2, 512)
    # beside it by default, the proxy chain at the same offered load: every step's one arrival timed
    assert (px["workload"], px["chain"], px["batches"]) == ("decode", "proxy", 2)
    for x in (r, px):
        lat = x["latency"]
        assert lat["n"] == 200 and len(lat["per_step_ms"]) == 200
        assert all(0 < v < 60_000 for v in lat["per_step_ms"]), lat["per_step_ms"]
        assert x["steal_ms"] is None or x["steal_ms"] >= 0
    assert s_ours == {"summary": "latency", "chain": "ours", "p99_ms": [r["latency"]["p99_ms"]],
                      "median_ms": r["latency"]["p99_ms"], "at_most_5ms": int(r["latency"]["p99_ms"] <= 5)}
    assert s_proxy["chain"] == "proxy" and s_proxy["p99_ms"] == [px["latency"]["p99_ms"]]
    assert "latency at 100k tokens/s offered (decode steps of 256, batch 2/2) ours:" in p.stdout
    assert "latency at 100k tokens/s offered (decode steps of 256, batch 2/2) proxy:" in p.stdout
    assert f"latency p99 at 100k tokens/s: proxy median {px['latency']['p99_ms']:.2f} ms" in p.stdout


def test_latency_summary_gives_each_chains_p99s_their_median_and_how_many_met_5ms():
    bench = load_script(SCRIPT, "bench_pipeline")
    runs = [{"chain": c, "latency": {"p99_ms": v}} for c, v in
            (("ours", 7.5), ("proxy", 0.9), ("proxy", 1.1), ("ours", 3.0), ("ours", 5.0), ("proxy", 6.0))]
    assert bench.latency_summary(runs, ["ours", "proxy", "raw"]) == [
        {"summary": "latency", "chain": "ours", "p99_ms": [7.5, 3.0, 5.0], "median_ms": 5.0, "at_most_5ms": 2},
        {"summary": "latency", "chain": "proxy", "p99_ms": [0.9, 1.1, 6.0], "median_ms": 1.1, "at_most_5ms": 2}]


def test_bad_latency_chains_are_refused(capsys):
    bench = load_script(SCRIPT, "bench_pipeline")
    with pytest.raises(SystemExit) as e:
        bench.main(["--workloads", "", "--latency-chains", "ours,copy"])
    assert e.value.code == 2
    assert "--latency-chains: of ours, proxy, raw, not 'ours,copy'" in capsys.readouterr().err


def test_steal_ms_reads_the_steal_column_of_proc_stat_in_ms():
    import os
    bench = load_script(SCRIPT, "bench_pipeline")

    def read():
        with open("/proc/stat") as f:
            return int(f.readline().split()[8]) * 1000 / os.sysconf("SC_CLK_TCK")
    a = read()
    got = bench.steal_ms()
    assert a <= got <= read()
