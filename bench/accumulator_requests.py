"""What the consumer's Accumulator spends per request, in one process (no sockets, no other process): prefill-like
steps of 8192 tokens over N requests, each request opened, its rows in the step's one delta, then finished.

Per message: wire.decode_header + Accumulator.apply, thread CPU, the second of two passes (new request ids, the
arena's pages already in use). Compare with the consumer's Python CPU per request in `bench/pipeline.py
--workloads prefill:N --profile DIR` (BENCH_PROFILE=threads): the difference is what a message costs around the
accumulator in a running consumer (the service loop, ZeroMQ, caches that other processes evicted).

    python bench/accumulator_requests.py [--steps 200] [--requests 1,4,16] [--json FILE]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from routing_replay.consumer.accumulator import Accumulator  # noqa: E402
from routing_replay.protocol import wire  # noqa: E402

L, K = 48, 8            # Qwen3-30B-A3B: 768 B per token
STEP_TOKENS = 8192


def messages(steps: int, nr: int, tag: str) -> list:
    """(kind, header, frames) of `steps` steps of `nr` requests of STEP_TOKENS // nr prompt tokens each."""
    per = STEP_TOKENS // nr
    rows = memoryview(np.random.default_rng(0).integers(0, 128, (nr * per, L, K)).astype(np.int16)
                      .reshape(-1).view(np.uint8))
    out, seq = [], 0
    for s in range(steps):
        ids = [f"cmpl-{tag}-{s:06d}-{j}" for j in range(nr)]
        for rid in ids:
            seq += 1
            out.append(("open", wire.pack_header("open", "bench", 1, seq, rid, {
                "prompt_len": per, "num_cached": 0, "num_layers": L, "top_k": K, "layer_ids": list(range(L))}), []))
        seq += 1
        out.append(("delta", wire.pack_header("delta", "bench", 1, seq, ids, wire.delta_body([0] * nr, [per] * nr, L,
                                                                                              K)), [rows]))
        for rid in ids:
            seq += 1
            out.append(("finish", wire.pack_header("finish", "bench", 1, seq, rid, {
                "num_output": 1, "reason": "stop", "prompt_len": per}), []))
    return out


def run(steps: int, nr: int) -> dict:
    acc = Accumulator(finish_grace_s=0.0)
    for tag in ("warm", "timed"):           # the second pass is measured: the arena's pages are in use
        ms = messages(steps, nr, tag)
        spent = {"open": 0, "delta": 0, "finish": 0}
        records = complete = 0
        gc.disable()
        try:
            for kind, head, frames in ms:
                t0 = time.thread_time_ns()
                recs = acc.apply(wire.decode_header(head), frames, 0.0)
                spent[kind] += time.thread_time_ns() - t0
                records += len(recs)
                complete += sum(r.complete for r in recs)
                del recs
        finally:
            gc.enable()
    n = steps * nr
    return {"requests_per_step": nr, "steps": steps, "records": records, "complete": complete,
            "open_us": round(spent["open"] / n / 1e3, 1), "finish_us": round(spent["finish"] / n / 1e3, 1),
            "delta_us_per_request": round(spent["delta"] / n / 1e3, 1),
            "delta_us_per_message": round(spent["delta"] / steps / 1e3, 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--requests", default="1,4,16", help="requests per step, comma-separated (each divides 8192)")
    ap.add_argument("--json", help="also write the results here")
    a = ap.parse_args(argv)
    try:
        nrs = [int(x) for x in a.requests.split(",") if x]
    except ValueError:
        ap.error(f"--requests takes integers, got {a.requests!r}")
    if a.steps < 1 or not nrs or any(n < 1 or STEP_TOKENS % n for n in nrs):
        ap.error("--steps must be >= 1 and each --requests value a divisor of 8192")
    out, bad = [], 0
    for nr in nrs:
        r = run(a.steps, nr)
        bad += r["records"] != a.steps * nr or r["complete"] != r["records"]
        out.append(r)
        print(json.dumps(r), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
