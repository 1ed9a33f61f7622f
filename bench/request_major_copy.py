"""What the producer's request-major copy of merged decode steps costs, against the same copy without its grouping by
owner and other ways to make it: each into one of N destinations in turn, as the producer's pooled memory cycles
through its replay window (so the destination is cold, as in a running chain). The producer's own copy is C
(producer/_gather.c, where it is built: streaming stores, one sequential pass) with numpy's scatter per step as its
fallback; both are measured, and a plain memcpy of the same bytes (np.copyto of one contiguous array) beside them.

    python bench/request_major_copy.py [--requests 256] [--steps 64] [--destinations 10] [--repeat 40]

Prints the median and minimum ms per copy of each way, for one payload array repeated (as bench/pipeline.py's
producer sends) and for distinct steps. Every way's result is checked equal to the producer's.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from routing_replay.producer.outpool import _gather, request_major  # noqa: E402

L, K = 48, 8        # Qwen3-30B-A3B: 768 B a row


def ways(order: np.ndarray, inverse: np.ndarray, flat: dict) -> dict:
    def producer(arrs, out):                     # the producer's numpy fallback: grouped by owner (OutPool aside)
        for s, a in enumerate(arrs):
            out[inverse, s] = a

    def native(arrs, out):                       # the producer's C copy (producer/_gather.c), grouped by owner
        _gather.gather_rows(out, arrs, order, arrs[0].nbytes // len(order))

    def native_plain(arrs, out):                 # the same, each row copied with memcpy (no streaming stores)
        _gather.gather_rows(out, arrs, order, arrs[0].nbytes // len(order), False)

    def memcpy(arrs, out):                       # the same bytes, one contiguous copy (not request-major)
        np.copyto(out.reshape(-1), flat[id(arrs)])

    def stack(arrs, out):                        # request-major, no grouping
        np.stack(arrs, axis=1, out=out)

    def gather_then_copy(arrs, out):             # gather into a small (L2-warm) temporary, then a strided copy
        tmp = np.empty_like(arrs[0])
        for s, a in enumerate(arrs):
            np.take(a, order, axis=0, out=tmp)
            out[:, s] = tmp

    def take_then_copy(arrs, out):
        for s, a in enumerate(arrs):
            out[:, s] = a.take(order, axis=0)

    found = {"producer C, streaming (grouped by owner)": native, "producer C, memcpy per row": native_plain} \
        if _gather is not None else {}
    return {**found, "producer numpy (grouped by owner)": producer, "np.stack, no grouping": stack,
            "gather into a temporary, then copy": gather_then_copy, "take, then copy": take_then_copy,
            "memcpy of the same bytes": memcpy}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--steps", type=int, default=64, help="decode steps merged into one message")
    ap.add_argument("--destinations", type=int, default=10, help="destination arrays used in turn")
    ap.add_argument("--repeat", type=int, default=40)
    a = ap.parse_args(argv)
    n, k = a.requests, a.steps
    rng = np.random.default_rng(0)
    one = rng.integers(0, 128, (n, L, K)).astype(np.int16)
    inputs = {"one payload": [one] * k,
              "distinct steps": [rng.integers(0, 128, (n, L, K)).astype(np.int16) for _ in range(k)]}
    order = np.argsort(rng.integers(0, 2, n), kind="stable")       # two owners, requests interleaved
    inverse = np.empty_like(order)
    inverse[order] = np.arange(n)
    outs = [np.ones((n, k, L, K), np.int16) for _ in range(a.destinations)]
    mb = n * k * L * K * 2 / 1e6
    print(f"{k} steps x {n} requests x {L * K * 2} B = {mb:.1f} MB a copy, {a.destinations} destinations in turn")
    flat = {id(arrs): np.concatenate([x.reshape(-1) for x in arrs]) for arrs in inputs.values()}
    if _gather is None:
        print("producer/_gather.c is not built here: the producer copies with numpy (pip install -e . builds it)")
    for label, arrs in inputs.items():
        want = request_major(arrs, inverse, native=False).reshape(n, k, L, K)
        for name, f in ways(order, inverse, flat).items():
            ts = []
            for r in range(a.repeat):
                out = outs[r % a.destinations]
                t = time.perf_counter()
                f(arrs, out)
                ts.append(time.perf_counter() - t)
            if name not in ("np.stack, no grouping", "memcpy of the same bytes") and not np.array_equal(out, want):
                print(f"{name}: result differs from the producer's request_major", file=sys.stderr)
                return 1
            print(f"{label:15s} {name:42s} median {np.median(ts) * 1e3:6.2f} ms  min {min(ts) * 1e3:6.2f} ms  "
                  f"({mb / np.median(ts) / 1e3:.1f} GB/s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
