"""Soak: producer, broker, two consumers and a trainer at a fixed load for N minutes; every record checked.

Processes: `routing-replay broker`, two `routing-replay consume --serve` (no npz: the trainer takes every record),
a producer process running the synthetic engine (chunked prefill, decode, prefix hits, speculative overwrites,
preemption, aborts) paced to --rate tokens/s in rounds of --round-requests requests, and the trainer in this
process: for each finished round it fetches every record (the lossless path) and compares it with the reference
built from the request's spec alone. Every --sample-s the RSS of each process is sampled.

Prints (and with --json writes) throughput, RSS over time per process, and records checked / complete / flagged /
wrong. Wrong must be 0. Not run in CI:

    python bench/soak.py --minutes 10                       # defaults: 20k tokens/s, L=48, top-8
    python bench/soak.py --minutes 2 --json soak.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import re
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from routing_replay.apps.synthetic import expected_record, workload  # noqa: E402

CLI = [sys.executable, "-m", "routing_replay.apps.cli"]


def rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except FileNotFoundError:
        pass
    return float("nan")


class Child:
    """Own one CLI child process and a thread draining its log lines (kept: the last 200)."""

    def __init__(self, args: list[str]):
        self.p = subprocess.Popen(CLI + args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  env=dict(os.environ, PYTHONUNBUFFERED="1"))
        self.lines: list[str] = []
        self._q: queue.Queue = queue.Queue()
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        for line in self.p.stdout:
            self.lines.append(line)
            del self.lines[:-200]
            self._q.put(line)

    def wait_for(self, pattern: str, timeout_s: float = 30.0) -> re.Match:
        deadline = time.monotonic() + timeout_s
        rx = re.compile(pattern)
        while time.monotonic() < deadline:
            try:
                m = rx.search(self._q.get(timeout=max(0.01, deadline - time.monotonic())))
            except queue.Empty:
                break
            if m:
                return m
        raise TimeoutError(f"no {pattern!r}: {''.join(self.lines[-10:])}")

    def stop(self) -> int:
        self.p.terminate()
        try:
            return self.p.wait(30)
        except subprocess.TimeoutExpired:
            self.p.kill()
            return self.p.wait(5)


def producer_proc(frontend: str, a, rounds_q, stop) -> None:
    """Publish rounds of synthetic requests at a.rate tokens/s; put each finished round's number on rounds_q."""
    import logging
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    from routing_replay.producer import Producer
    from routing_replay.apps.synthetic import SyntheticEngine

    class Paced:
        def __init__(self, p):
            self.p, self.tokens, self.t0 = p, 0, time.monotonic()

        def __getattr__(self, name):
            return getattr(self.p, name)

        def publish_rows(self, ids, starts, counts, rows):
            self.tokens += int(sum(counts))
            delay = self.t0 + self.tokens / a.rate - time.monotonic()
            if delay > 0:
                stop.wait(delay)                 # the load's clock
            return self.p.publish_rows(ids, starts, counts, rows)

    with Producer(frontend, num_layers=a.num_layers, top_k=a.top_k) as p:
        paced = Paced(p)
        r = 0
        while not stop.is_set():
            specs = workload(a.round_requests, seed=r, prefix=f"soak{r}")
            eng = SyntheticEngine(num_layers=a.num_layers, top_k=a.top_k, num_experts=a.num_experts,
                                  token_budget=a.token_budget)
            eng.run(paced, specs, seed=r)
            rounds_q.put(("round", r, paced.tokens, eng.rows_published))
            r += 1
        p.wait_acked(60)
        st = p.stats
        rounds_q.put(("done", dict(sent=st.sent_msgs, acked=st.acked_msgs, resent=st.resent_msgs,
                                   rewinds=st.rewinds, dropped=st.dropped_msgs, replay_full=st.replay_full)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--rate", type=float, default=20_000, help="tokens per second offered")
    ap.add_argument("--num-layers", type=int, default=48)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--num-experts", type=int, default=128)
    ap.add_argument("--token-budget", type=int, default=512)
    ap.add_argument("--round-requests", type=int, default=64)
    ap.add_argument("--remember-finished", type=int, default=100_000,
                    help="consumers' window of finished request ids (their RSS grows until it is full)")
    ap.add_argument("--sample-s", type=float, default=10.0, help="seconds between RSS samples")
    ap.add_argument("--json", help="also write the report here")
    a = ap.parse_args(argv)

    broker = Child(["broker", "--frontend", "tcp://127.0.0.1:*", "--backend", "tcp://127.0.0.1:*",
                    "--stats-interval", "30"])
    m = broker.wait_for(r"broker frontend=(\S+) backend=(\S+)")
    fe, be = m.group(1), m.group(2)
    consumers = [Child(["consume", "--connect", be, "--serve", "tcp://127.0.0.1:*", "--consumer-id", f"soak-c{i}",
                        "--no-progress", "--stats-interval", "30", "--remember-finished",
                        str(a.remember_finished)]) for i in range(2)]
    serves = [c.wait_for(r"serve=(\S+)").group(1) for c in consumers]
    broker.wait_for("consumers=2")
    ctx = mp.get_context("spawn")
    rounds_q, stop = ctx.Queue(), ctx.Event()
    prod = ctx.Process(target=producer_proc, args=(fe, a, rounds_q, stop), daemon=True)
    t_start = time.monotonic()
    prod.start()
    pids = {"broker": broker.p.pid, "consumer0": consumers[0].p.pid, "consumer1": consumers[1].p.pid,
            "producer": prod.pid, "trainer": os.getpid()}
    samples: list[dict] = []
    sampling = threading.Event()

    def sample() -> None:
        while True:
            samples.append({"t_s": round(time.monotonic() - t_start, 1),
                            **{k: round(rss_mb(pid), 1) for k, pid in pids.items()}})
            if sampling.wait(a.sample_s):
                return
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()

    from routing_replay.consumer import TrainerClient
    counts = dict(rounds=0, records_checked=0, records_complete=0, records_flagged=0, records_wrong=0)
    wrong: list[str] = []
    tokens = rows = 0
    producer_stats: dict = {}
    deadline = t_start + a.minutes * 60
    with TrainerClient(serves) as trainer:
        while True:
            if time.monotonic() >= deadline and not stop.is_set():
                stop.set()
            msg = rounds_q.get(timeout=300)
            if msg[0] == "done":
                producer_stats = msg[1]
                break
            _, r, tokens, r_rows = msg
            rows += r_rows
            specs = workload(a.round_requests, seed=r, prefix=f"soak{r}")
            recs = trainer.fetch([s.request_id for s in specs], timeout_s=120)
            for s in specs:
                rec = recs[s.request_id]
                counts["records_checked"] += 1
                if s.abort_at is not None:
                    ok = not rec.complete and rec.reason == "abort"
                    counts["records_flagged"] += ok
                elif rec.complete:
                    ok = rec.equals(expected_record(s, a.num_layers, a.top_k, a.num_experts))
                    counts["records_complete"] += ok
                else:
                    ok = True                     # flagged incomplete with its reason: not wrong, counted
                    counts["records_flagged"] += 1
                if not ok:
                    counts["records_wrong"] += 1
                    wrong.append(s.request_id)
            counts["rounds"] += 1
    elapsed = time.monotonic() - t_start
    prod.join(60)
    sampling.set()
    sampler.join()
    codes = [c.stop() for c in consumers] + [broker.stop()]
    rss = {}
    for k in pids:
        series = [s[k] for s in samples if s[k] == s[k]]
        if series:
            warm = [s[k] for s in samples if s["t_s"] >= 30 and s[k] == s[k]] or series
            rss[k] = {"first": series[0], "after_30s": warm[0], "max": max(series), "last": series[-1],
                      "growth_after_30s": round(warm[-1] - warm[0], 1)}
    report = {"minutes": round(elapsed / 60, 2), "rate_offered_tokens_s": a.rate,
              "tokens": tokens, "tokens_per_s": round(tokens / elapsed), "rows_published": rows,
              "MB_per_s": round(tokens * a.num_layers * a.top_k * 2 / elapsed / 1e6, 1),
              "records_per_s": round(counts["records_checked"] / elapsed, 1), **counts,
              "wrong_ids": wrong[:20], "producer": producer_stats, "rss_mb": rss, "rss_samples": samples,
              "exit_codes": codes, "shape": f"L={a.num_layers} K={a.top_k} experts={a.num_experts}"}
    print(f"soak {report['minutes']} min at {a.rate:,.0f} tokens/s offered ({report['shape']}): "
          f"{report['tokens_per_s']:,} tokens/s delivered, {report['MB_per_s']} MB/s, "
          f"{report['records_per_s']} records/s")
    print(f"records checked={counts['records_checked']} complete={counts['records_complete']} "
          f"flagged={counts['records_flagged']} wrong={counts['records_wrong']}")
    print(f"producer {producer_stats}")
    for k, v in rss.items():
        print(f"rss {k:9s} first={v['first']:7.1f} MB  after_30s={v['after_30s']:7.1f}  max={v['max']:7.1f}  "
              f"last={v['last']:7.1f}  growth_after_30s={v['growth_after_30s']:+.1f}")
    print("rss samples (MB): t_s " + " ".join(pids))
    for s in samples:
        print(f"  {s['t_s']:7.1f} " + " ".join(f"{s[k]:7.1f}" for k in pids))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
    return 1 if counts["records_wrong"] or any(codes) else 0


if __name__ == "__main__":
    raise SystemExit(main())
