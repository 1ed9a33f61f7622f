"""Time replay.tensors on a 32K-token sample of the Qwen3-30B-A3B shape (48 MoE layers, top-8, int16 records).

Cases: one record of 32768 tokens (30720 prompt + 2048 output), and the same 32768 tokens as 16 records of
2048; each laid out padded (right) and packed, int64 and int32; layout "all" (48 of 52 rows, made up: 4 dense
layers) once. Reports the median of --repeat runs in ms and the output MB/s.
Usage: python bench/replay_convert.py [--repeat 7] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from routing_replay.protocol import wire
from routing_replay.replay import packed, padded

L, K, E, TOKENS = 48, 8, 128, 32768


def make_records(n: int, rng) -> list:
    per = TOKENS // n
    P, G = per - per // 16, per // 16
    out = []
    for i in range(n):
        rows = rng.integers(0, E, size=(P + G, L, K), dtype=np.int16)
        rows[:128] = -1                       # a prefix-cache hit
        rows[-1] = -1                         # the last output token
        out.append(wire.Record(request_id=f"r{i}", prompt_routed_experts=rows[:P], routed_experts=rows[P:],
                               num_cached_tokens=128, moe_layer_ids=np.arange(L, dtype=np.int32), complete=True))
    return out


def timed(fn, repeat: int) -> tuple[float, int]:
    times, nbytes = [], 0
    for _ in range(repeat):
        t0 = time.perf_counter()
        r = fn()
        times.append(time.perf_counter() - t0)
        nbytes = r.expert_ids.numel() * r.expert_ids.element_size()
        del r
    return statistics.median(times) * 1e3, nbytes


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    results = []
    for n in (1, 16):
        recs = make_records(n, rng)
        cases = [("padded", "int64", lambda: padded(recs)), ("padded", "int32", lambda: padded(recs, dtype="int32")),
                 ("packed", "int64", lambda: packed(recs)), ("packed", "int32", lambda: packed(recs, dtype="int32"))]
        if n == 1:
            recs_all = [wire.Record(**{**r.__dict__, "moe_layer_ids": np.arange(L, dtype=np.int32)
                                       + (np.arange(L) >= 12) + (np.arange(L) >= 24) + (np.arange(L) >= 36)
                                       + (np.arange(L) >= 47)}) for r in recs]
            cases.append(("packed all", "int64", lambda: packed(recs_all, layout="all")))
        for kind, dtype, fn in cases:
            ms, nbytes = timed(fn, a.repeat)
            results.append(dict(records=n, tokens=TOKENS, kind=kind, dtype=dtype, ms=round(ms, 2),
                                out_mb=round(nbytes / 1e6, 1), mb_per_s=round(nbytes / 1e6 / (ms / 1e3))))
            print(f"{n:>2} record(s) x {TOKENS // n} tokens  {kind:<10} {dtype}  {ms:8.2f} ms  "
                  f"{nbytes / 1e6:6.1f} MB out  {nbytes / 1e6 / (ms / 1e3):7.0f} MB/s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
