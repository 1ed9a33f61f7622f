"""Time RoutingCache.record for every MoE layer plus the fused flush, per step, on CPU (the CPU build's router
hooks run this in Python on every step); with --old REF, the cache.py of git revision REF is loaded beside this
checkout's and both are timed alternately in one process.

Usage: python bench/cache_record.py [--layers 4] [--top-k 2] [--tokens 64] [--steps 5000] [--reps 5] [--old REF]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from routing_replay.capture import cache as new_cache  # noqa: E402


def _load_old(ref: str):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    src = subprocess.run(["git", "-C", root, "show", f"{ref}:capture/cache.py"], capture_output=True, text=True,
                         check=True).stdout
    path = os.path.join(tempfile.mkdtemp(prefix="rr-cache-"), "old_cache.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location("old_cache", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def time_steps(mod, layers: int, top_k: int, tokens: int, steps: int) -> float:
    c = mod.RoutingCache(8192, layers, top_k, stamp=top_k % 2 == 0)
    ids = [torch.randint(0, 8, (tokens, top_k), dtype=torch.int64) for _ in range(layers)]
    rec = c.record
    for _ in range(min(500, steps)):
        for i in range(layers):
            rec(i, ids[i])
    t0 = time.perf_counter()
    for _ in range(steps):
        for i in range(layers):
            rec(i, ids[i])
    return (time.perf_counter() - t0) / steps * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--steps", type=int, default=5000)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--old", metavar="REF", help="also time capture/cache.py of this git revision, alternately")
    a = ap.parse_args(argv)
    mods = [("new", new_cache)] + ([("old " + a.old, _load_old(a.old))] if a.old else [])
    res: dict = {name: [] for name, _ in mods}
    for _ in range(a.reps):
        for name, mod in mods:
            res[name].append(time_steps(mod, a.layers, a.top_k, a.tokens, a.steps))
    for name, xs in res.items():
        print(f"{name}: record x {a.layers} layers + flush, {a.tokens} tokens, top-{a.top_k}: min {min(xs):.1f} "
              f"median {statistics.median(xs):.1f} us per step ({a.reps} x {a.steps} steps)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
