"""What opening, stepping and finishing N requests at once costs in the chain (a rollout batch starting), with
`opens` and with one `open` per request side by side in one run.

Real processes: a broker and two consumers (spawned), the Producer in this process. Per round and mode, N new
requests are opened (Producer.open in a loop, or one Producer.open_many), then one delta gives each its first row,
then each is finished; after each phase the producer waits for the broker's acks (every consumer applied it).
Reported per phase and request: the caller's time, the chain's wall time to the last ack, and each process's CPU
(every thread, from /proc/<pid>/task/*/schedstat). Mode `singles` runs the same chain with a broker that does not say
it takes `opens` (a broker of an earlier version): the producer then sends one `open` per request.

    python bench/open_storm.py [--requests 256,4096] [--modes opens,singles] [--open loop|many] [--repeat 3]
                               [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

L, K = 48, 8            # Qwen3-30B-A3B: 768 B per token
PHASES = ("open", "delta", "finish")


def cpu_s(pid: int) -> float:
    """CPU seconds of every live thread of `pid` (ns resolution)."""
    t = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                t += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            pass
    return t / 1e9


def broker_proc(fe: str, be: str, stop, q, singles: bool) -> None:
    import logging
    logging.basicConfig(level=logging.WARNING)
    from routing_replay.broker import Broker

    class OldBroker(Broker):
        def _reply(self, ident, kind, key, body):       # replies without `takes`: producers send `open`s
            return super()._reply(ident, kind, key, {k: v for k, v in body.items() if k != "takes"})

    b = (OldBroker if singles else Broker)(fe, be, stats_interval_s=3600)
    b.bind()
    import threading
    threading.Thread(target=lambda: (stop.get(), q.put(("broker", b.stats.opens_in, b.stats.requests_opened)),
                                     b.stop()), daemon=True).start()
    b.serve()


def consumer_proc(be: str, q, stop) -> None:
    import logging
    logging.basicConfig(level=logging.ERROR)
    from routing_replay.consumer import Consumer
    got = {"records": 0, "complete": 0}

    def on_record(r):
        got["records"] += 1
        got["complete"] += bool(r.complete)

    c = Consumer(be, on_record=on_record, stats_interval_s=3600, finish_grace_s=0.0)
    c.start()
    q.put(("ready",))
    stop.get()
    c.close()
    q.put(("done", got["records"], got["complete"]))


def run_mode(mode: str, sizes: list, repeat: int, open_how: str, port: int) -> list:
    from routing_replay.producer import Producer
    ctx = mp.get_context("spawn")
    fe, be = f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port + 1}"
    bstop, bq, q, cstop = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Queue()
    b = ctx.Process(target=broker_proc, args=(fe, be, bstop, bq, mode == "singles"))
    b.start()
    cons = [ctx.Process(target=consumer_proc, args=(be, q, cstop)) for _ in range(2)]
    for c in cons:
        c.start()
    for _ in cons:
        q.get(timeout=120)
    out = []
    p = Producer(fe, num_layers=L, top_k=K, max_queue_bytes=4 << 30)
    try:
        p.open("warm-up", prompt_len=1)
        p.finish("warm-up", num_output_tokens=1, prompt_len=1)
        if not p.wait_acked(60):
            raise RuntimeError("the broker never acked the warm-up")
        pids = {"producer": os.getpid(), "broker": b.pid, "consumer0": cons[0].pid, "consumer1": cons[1].pid}
        for n in sizes:
            rows = np.random.default_rng(n).integers(0, 128, (n, L, K)).astype(np.int16)
            for r in range(repeat + 1):                 # round 0 warms this size up (not reported)
                ids = [f"{mode}-{n}-{r}-{i}" for i in range(n)]
                res = {"mode": mode, "requests": n, "round": r, "open": open_how}
                for phase in PHASES:
                    c0 = {k: cpu_s(v) for k, v in pids.items()}
                    t0 = time.monotonic()
                    if phase == "open":
                        if open_how == "many":
                            p.open_many([(rid, 1, 0, None, False) for rid in ids])
                        else:
                            for rid in ids:
                                p.open(rid, prompt_len=1)
                    elif phase == "delta":
                        p.publish_rows(ids, np.zeros(n, np.int32), np.ones(n, np.int32), rows)
                    else:
                        for rid in ids:
                            p.finish(rid, num_output_tokens=1, prompt_len=1)
                    t1 = time.monotonic()
                    if not p.wait_acked(120):
                        raise RuntimeError(f"{phase} of {n} requests not acked in 120 s")
                    t2 = time.monotonic()
                    c1 = {k: cpu_s(v) for k, v in pids.items()}
                    res[phase] = {"caller_us": 1e6 * (t1 - t0) / n, "wall_us": 1e6 * (t2 - t0) / n,
                                  **{f"{k}_us": 1e6 * (c1[k] - c0[k]) / n for k in pids}}
                    res[phase]["cpu_us"] = sum(res[phase][f"{k}_us"] for k in pids)
                if r:
                    out.append(res)
                    print(f"{mode:7s} N={n:5d} round {r}: " + "  ".join(
                        f"{ph} cpu {res[ph]['cpu_us']:5.1f} wall {res[ph]['wall_us']:5.1f}" for ph in PHASES)
                        + " us/request", flush=True)
        opens_msgs = p.stats.opens_msgs
    finally:
        p.close(10)
    for _ in cons:
        cstop.put(True)
    done = [q.get(timeout=120) for _ in cons]
    bstop.put(True)
    _, opens_in, opened = bq.get(timeout=60)
    b.join(10)
    for c in cons:
        c.join(10)
    records = sum(d[1] for d in done)
    complete = sum(d[2] for d in done)
    for res in out:
        res.update(opens_msgs=opens_msgs, broker_opens_in=opens_in, records=records, complete=complete,
                   requests_opened=opened)
    print(f"{mode:7s} records={records} complete={complete} producer opens_msgs={opens_msgs} broker opens_in="
          f"{opens_in} requests_opened={opened}", flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", default="256,4096", help="requests per batch, comma-separated (default 256,4096)")
    ap.add_argument("--modes", default="opens,singles", help="of opens, singles; run in this order, then reversed")
    ap.add_argument("--open", dest="open_how", choices=("loop", "many"), default="loop",
                    help="Producer.open in a loop (default) or one Producer.open_many per batch")
    ap.add_argument("--repeat", type=int, default=3, help="rounds per size and mode (after one warm-up round)")
    ap.add_argument("--json", help="also write every round's figures here")
    a = ap.parse_args(argv)
    try:
        sizes = [int(x) for x in a.requests.split(",")]
        modes = a.modes.split(",")
    except ValueError:
        ap.error(f"--requests must be comma-separated integers, got {a.requests!r}")
    if not sizes or min(sizes) < 1 or a.repeat < 1 or not set(modes) <= {"opens", "singles"} or not modes:
        ap.error("--requests >= 1 each, --repeat >= 1, --modes of opens,singles")
    results = []
    port = int(os.environ.get("BENCH_PORT_BASE", 47400))
    for i, mode in enumerate(modes + modes[::-1] if len(modes) > 1 else modes):
        results += run_mode(mode, sizes, a.repeat, a.open_how, port + 2 * i)
    print("median CPU us per request over every round (all processes), open / delta / finish; chain wall us:")
    for n in sizes:
        for mode in modes:
            rs = [r for r in results if r["requests"] == n and r["mode"] == mode]
            med = {ph: statistics.median(r[ph]["cpu_us"] for r in rs) for ph in PHASES}
            wall = {ph: statistics.median(r[ph]["wall_us"] for r in rs) for ph in PHASES}
            per = {k: statistics.median(r["open"][f"{k}_us"] for r in rs)
                   for k in ("producer", "broker", "consumer0", "consumer1")}
            print(f"  N={n:5d} {mode:7s} cpu {med['open']:5.1f} / {med['delta']:5.1f} / {med['finish']:5.1f}   wall "
                  f"{wall['open']:6.1f} / {wall['delta']:6.1f} / {wall['finish']:6.1f}   open cpu by process "
                  + " ".join(f"{k}={v:.1f}" for k, v in per.items()))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
