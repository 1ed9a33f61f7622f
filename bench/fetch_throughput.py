"""Trainer fetch throughput from a consumer's memory and from its npz dir, and the cost of durable npz writes.

Processes: `routing-replay broker` and `routing-replay consume --serve --npz-dir` (real sockets); the producer and
the trainer (TrainerClient) run in this process. For each record size it publishes N records, waits until the
consumer has finished them, and times one fetch of all of them from memory (the store); then it restarts the
consumer on the same npz dir (nothing in memory) and times the same fetch from disk. Every record fetched is
checked bit for bit against the rows published. Then it times npz writes of the same records with fsync (file
and directory, the default) and without, into a fresh directory.

    python bench/fetch_throughput.py                       # small: 1000 x 128 tokens; large: 8 x 80,000 tokens
    python bench/fetch_throughput.py --small 200 --large 2 --json out.json

Rows are 48 layers x top-8 int16 (768 bytes a token): a small record is 98 KB, a large one 61 MB.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from routing_replay.consumer import TrainerClient, write_record  # noqa: E402
from routing_replay.producer import Producer  # noqa: E402

CLI = [sys.executable, "-m", "routing_replay.apps.cli"]
L, K = 48, 8


class Proc:
    """A CLI child process whose output lines are read on a thread (so its pipe never fills)."""

    def __init__(self, args: list[str]):
        self.p = subprocess.Popen(CLI + args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  env=dict(os.environ, PYTHONUNBUFFERED="1"))
        self.q: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [self.q.put(ln) for ln in self.p.stdout], daemon=True).start()

    def wait_for(self, pattern: str, timeout_s: float = 120.0) -> re.Match:
        rx, deadline = re.compile(pattern), time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                m = rx.search(self.q.get(timeout=max(0.01, deadline - time.monotonic())))
            except queue.Empty:
                break
            if m:
                return m
        raise TimeoutError(f"no {pattern!r} in {timeout_s}s (rc={self.p.poll()})")

    def stop(self) -> None:
        self.p.terminate()
        try:
            self.p.wait(60)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait(10)


def rows_of(i: int, n: int) -> np.ndarray:
    return np.resize(np.arange(i, i + 30011, dtype=np.int16), (n, L, K))


def consumer(be: str, serve: str, npz: str) -> Proc:
    c = Proc(["consume", "--connect", be, "--serve", serve, "--npz-dir", npz, "--no-progress", "--stats-interval",
              "0.5", "--store-mb", "4096", "--log-level", "info"])
    c.wait_for(r"consumer \S+ connected")
    return c


def fetch_all(serve: str, want: dict) -> float:
    with TrainerClient(serve) as t:
        t0 = time.perf_counter()
        got = t.fetch(list(want), timeout_s=600, unknown="raise")
        dt = time.perf_counter() - t0
    for rid, n in want.items():
        r = got[rid]
        assert r.complete and np.array_equal(r.prompt_routed_experts, rows_of(int(rid.split("-")[1]), n)), rid
    return dt


def run_size(name: str, count: int, tokens: int, work: str) -> dict:
    npz = os.path.join(work, name)
    serve = f"ipc://{work}/{name}.sock"
    broker = Proc(["broker", "--frontend", "tcp://127.0.0.1:*", "--backend", "tcp://127.0.0.1:*"])
    fe, be = broker.wait_for(r"broker frontend=(\S+) backend=(\S+)").groups()
    c = consumer(be, serve, npz)
    broker.wait_for(r"consumers=1", 30)
    want = {f"{name}-{i}": tokens for i in range(count)}
    with Producer(fe, num_layers=L, top_k=K, max_queue_bytes=4 << 30) as p:
        for i, rid in enumerate(want):
            p.open(rid, prompt_len=tokens)
            p.publish_rows([rid], [0], [tokens + 1], rows_of(i, tokens + 1))
            p.finish(rid, num_output_tokens=1)
        assert p.wait_acked(600)
    c.wait_for(rf"records={count} .* written={count} ", 600)
    time.sleep(2)       # the writer has just fsynced every record: its writeback is not what the fetch measures
    mb = count * (tokens + 1) * L * K * 2 / 1e6
    mem_s = fetch_all(serve, want)
    c.stop()
    c = consumer(be, serve, npz)
    disk_s = fetch_all(serve, want)
    c.stop()
    broker.stop()
    out = {"records": count, "tokens": tokens + 1, "MB": round(mb, 1),
           "memory": {"records_per_s": round(count / mem_s, 1), "MB_per_s": round(mb / mem_s, 1), "s": round(mem_s, 3)},
           "disk": {"records_per_s": round(count / disk_s, 1), "MB_per_s": round(mb / disk_s, 1), "s": round(disk_s, 3)}}
    # durable writes: the same records written with fsync (file, then directory) and without
    from routing_replay.protocol import wire
    recs = [wire.Record(rid, rows_of(i, tokens), rows_of(i, 1), 0, np.arange(L, dtype=np.int32), True)
            for i, rid in enumerate(want)]
    for durable in (True, False):
        d = os.path.join(work, f"{name}-w{int(durable)}")
        os.makedirs(d)
        t0 = time.perf_counter()
        for r in recs:
            write_record(d, r, durable=durable)
        dt = time.perf_counter() - t0
        out["write_fsync" if durable else "write_no_fsync"] = {"records_per_s": round(count / dt, 1),
                                                               "MB_per_s": round(mb / dt, 1)}
        shutil.rmtree(d)
    shutil.rmtree(npz)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", type=int, default=1000, help="small records (128 prompt tokens + 1)")
    ap.add_argument("--large", type=int, default=8, help="large records (80,000 prompt tokens + 1: 61 MB)")
    ap.add_argument("--json", help="write the figures here too")
    a = ap.parse_args()
    work = tempfile.mkdtemp(prefix="rr-fetch-bench-", dir=os.environ.get("TMPDIR"))
    try:
        res = {}
        for name, count, tokens in (("small", a.small, 128), ("large", a.large, 80_000)):
            if count > 0:
                res[name] = run_size(name[0], count, tokens, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for k, v in res.items():
        print(f"{k}: {v['records']} records x {v['tokens']} tokens ({v['MB']} MB): "
              f"memory {v['memory']['records_per_s']} records/s {v['memory']['MB_per_s']} MB/s; "
              f"disk {v['disk']['records_per_s']} records/s {v['disk']['MB_per_s']} MB/s; "
              f"write fsync {v['write_fsync']['records_per_s']} records/s {v['write_fsync']['MB_per_s']} MB/s, "
              f"no fsync {v['write_no_fsync']['records_per_s']} records/s {v['write_no_fsync']['MB_per_s']} MB/s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
