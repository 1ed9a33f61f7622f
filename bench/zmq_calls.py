"""What one multipart send and one receive cost in Python: pyzmq's send_multipart / recv_multipart against the
hot loops' send_frames / recv_frames (routing_replay.protocol.loop), on an inproc PAIR, one process.

Each pass sends `--messages` messages of `--frames` small frames (an announcement's shape: routing id or
header, a few dozen bytes each), then receives them all; the passes alternate the two APIs and every received
message is counted and compared. Prints microseconds per message for each API and the median over `--repeat`.

    python bench/zmq_calls.py [--messages 20000] [--frames 2,3] [--repeat 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import zmq

from routing_replay.protocol.loop import recv_frames, send_frames


def _pass(a: zmq.Socket, b: zmq.Socket, msg: list, n: int, ours: bool) -> tuple[float, float]:
    t0 = time.perf_counter()
    if ours:
        for _ in range(n):
            send_frames(a, msg, zmq.NOBLOCK)
    else:
        for _ in range(n):
            a.send_multipart(msg, zmq.NOBLOCK, copy=False)
    t1 = time.perf_counter()
    got = 0
    want = [bytes(f) for f in msg]
    for _ in range(n):
        parts = recv_frames(b, zmq.NOBLOCK) if ours else b.recv_multipart(zmq.NOBLOCK, copy=False)
        if [p.bytes for p in parts] != want:
            raise SystemExit(f"message {got} arrived as {len(parts)} frames, not the {len(msg)} sent")
        got += 1
    t2 = time.perf_counter()
    try:
        b.recv(zmq.NOBLOCK)
        raise SystemExit("more messages arrived than were sent")
    except zmq.Again:
        pass
    return (t1 - t0) / n * 1e6, (t2 - t1) / n * 1e6


def run(messages: int, frames: int, repeat: int) -> dict:
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    for s in (a, b):
        s.setsockopt(zmq.SNDHWM, 0)
        s.setsockopt(zmq.RCVHWM, 0)
    a.bind("inproc://zmq-calls")
    b.connect("inproc://zmq-calls")
    msg = [b"h" * 80] + [b"x" * 40] * (frames - 1)
    res = {"pyzmq": [], "ours": []}
    try:
        for r in range(repeat):
            for ours in ((False, True) if r % 2 == 0 else (True, False)):
                res["ours" if ours else "pyzmq"].append(_pass(a, b, msg, messages, ours))
    finally:
        a.close(0)
        b.close(0)
        ctx.term()
    out = {"frames": frames, "messages": messages}
    for k, v in res.items():
        out[f"{k}_send_us"] = round(statistics.median(x[0] for x in v), 2)
        out[f"{k}_recv_us"] = round(statistics.median(x[1] for x in v), 2)
    return out


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--messages", type=int, default=20000)
    ap.add_argument("--frames", type=_ints, default=[2, 3], help="frames per message, comma-separated (>= 1)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", help="also write the results here")
    a = ap.parse_args(argv)
    if a.messages < 1 or a.repeat < 1 or not a.frames or min(a.frames) < 1:
        ap.error("--messages, --repeat and every --frames value must be >= 1")
    results = []
    for f in a.frames:
        r = run(a.messages, f, a.repeat)
        results.append(r)
        print(f"frames={f} send_multipart={r['pyzmq_send_us']:.2f}us send_frames={r['ours_send_us']:.2f}us "
              f"recv_multipart={r['pyzmq_recv_us']:.2f}us recv_frames={r['ours_recv_us']:.2f}us "
              f"(median of {a.repeat}, {a.messages} messages each)", flush=True)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(results, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
