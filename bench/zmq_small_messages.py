"""What small messages cost a ZeroMQ chain next to large ones, in C: PUSH -> zmq.proxy(PULL, PUSH) -> PULL.

Each step sends one 6.3 MB frame (a prefill-like step of 8192 tokens x 768 B) and `--small` 80-byte messages
(stand-ins for per-request announcements: opens, finishes), either as separate messages or bundled as extra
frames of the step's message. Every role is its own process; the sink counts messages and frames exactly. The
question it answers: would bundling a step's announcements into fewer ZeroMQ messages make the pipeline cheaper,
or is the per-request cost Python above ZeroMQ? (docs/PERFORMANCE.md.)

    python bench/zmq_small_messages.py [--steps 400] [--small 0,8,32] [--repeat 2]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import time

import zmq

BIG = 8192 * 768                 # 6.3 MB: 8192 tokens x 48 layers x top-8, int16
HEAD = b"h" * 80


def _cpu_of(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        f = fh.read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def _proxy(fe: str, be: str) -> None:
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    a.bind(fe)
    b.bind(be)
    try:
        zmq.proxy(a, b)
    except zmq.ContextTerminated:
        pass


def _sink(be: str, q) -> None:
    ctx = zmq.Context()
    s = ctx.socket(zmq.PULL)
    s.connect(be)
    msgs = frames = 0
    while True:
        f = s.recv_multipart(copy=False)
        if len(f) == 1 and f[0].bytes == b"end":
            break
        msgs += 1
        frames += len(f)
    ru = resource.getrusage(resource.RUSAGE_SELF)
    q.put((msgs, frames, ru.ru_utime + ru.ru_stime))


def run(steps: int, small: int, bundle: bool, port: int) -> dict:
    """One chain: `steps` steps, each the big frame and `small` small messages (bundled: as frames of one)."""
    fe, be = f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port + 1}"
    ctx_mp = mp.get_context("spawn")
    q = ctx_mp.Queue()
    px = ctx_mp.Process(target=_proxy, args=(fe, be), daemon=True)
    px.start()
    sk = ctx_mp.Process(target=_sink, args=(be, q))
    sk.start()
    ctx = zmq.Context()
    s = ctx.socket(zmq.PUSH)
    s.connect(fe)
    time.sleep(0.5)                              # every connection up before the clock starts
    big = os.urandom(BIG)
    t0, r0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    for _ in range(steps):
        if bundle and small:
            s.send_multipart([HEAD] * (small + 1) + [big], copy=False)
        else:
            for _ in range(small // 2):
                s.send(HEAD)
            s.send_multipart([HEAD, big], copy=False)
            for _ in range(small - small // 2):
                s.send(HEAD)
    s.send(b"end")
    msgs, frames, sink_cpu = q.get(timeout=600)
    wall = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    proxy_cpu = _cpu_of(px.pid)
    px.terminate()
    sk.join()
    px.join()
    s.close(0)
    ctx.term()
    return {"small": small, "bundle": bundle, "steps": steps, "seconds": round(wall, 3),
            "MB_per_s": round(steps * BIG / 1e6 / wall), "messages": msgs, "frames": frames,
            "cpu_s": {"sender": round(r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime, 2),
                      "proxy": round(proxy_cpu, 2), "sink": round(sink_cpu, 2)}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--small", default="0,8,32", help="small messages per step, comma-separated")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--json", help="also write the results here")
    a = ap.parse_args(argv)
    try:
        smalls = [int(x) for x in a.small.split(",") if x]
    except ValueError:
        ap.error(f"--small takes integers, got {a.small!r}")
    if a.steps < 1 or a.repeat < 1 or any(x < 0 for x in smalls):
        ap.error("--steps and --repeat must be >= 1, --small >= 0")
    port = int(os.environ.get("BENCH_PORT_BASE", 48100))
    out, bad = [], 0
    for _ in range(a.repeat):
        for small in smalls:
            for bundle in ((False, True) if small else (False,)):
                port += 2
                r = run(a.steps, small, bundle, port)
                want = (a.steps if bundle or not small else a.steps * (small + 1), a.steps * (small + 2))
                bad += (r["messages"], r["frames"]) != want
                out.append(r)
                print(json.dumps(r), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
