"""Engine-thread cost of the plugin's per-step capture work, piece by piece, on a bare CUDA machine (no vLLM).

Replays what WorkerCapture.pre_step/post_step do for a decode step of N captured requests, with the real
RoutingCache and AsyncCopier on the GPU and a consumer thread that launches the D2H copies, waits and releases
(the producer thread's part), and times each piece with the thread's CPU clock (time.thread_time_ns), 2,000 steps.
--contend N adds N Python threads that keep busy (pure-Python work, as vLLM's output and input threads and the
producer's thread do between steps): the same pieces then also pay for sharing the GIL and the cores.
Usage: python bench/engine_thread_probe.py [--requests 256] [--layers 16] [--steps 2000] [--contend N]
       [--event-per-step] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import sys
import threading
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from routing_replay.capture import AsyncCopier, RoutingCache  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--contend", type=int, default=0, help="busy pure-Python threads beside the engine thread")
    ap.add_argument("--event-per-step", action="store_true",
                    help="submit() records an event every step (the older scheme) instead of one per 16-step batch")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    stop = threading.Event()

    def busy():
        x = {}
        while not stop.is_set():
            for i in range(1000):
                x[i] = str(i) * 3
            x.clear()

    for _ in range(a.contend):
        threading.Thread(target=busy, daemon=True).start()
    dev = torch.device("cuda")
    n, L, K = a.requests, a.layers, a.top_k
    cache = RoutingCache(8192, L, K, device=dev)
    copier = AsyncCopier(cache, num_slots=12)
    q: queue.Queue = queue.Queue()

    def consumer():
        while True:
            batch = q.get()
            if batch is None:
                return
            copier.launch(batch)
            for p in batch:
                p.result()
                p.release()

    t = threading.Thread(target=consumer, daemon=True)
    t.start()
    ids = [f"req-{i}" for i in range(n)]
    keys = {r: f"key-{r}" for r in ids}
    qsl = np.arange(n + 1, dtype=np.int32)
    computed = np.full(n, 600, dtype=np.int32)
    topk = torch.randint(0, 128, (n, K), device=dev, dtype=torch.int64)
    pieces = {k: 0 for k in ("fill", "python_layout", "submit", "batch")}
    other = {"launch_copy_only": 0, "event_record_only": 0, "empty_python_call": 0}
    batch = []
    wall = 0
    for step in range(a.steps + 200):
        for layer in range(L):                       # the routers (not timed: inside the forward)
            cache.record(layer, topk)
        w0 = time.perf_counter_ns()
        t0 = time.thread_time_ns()
        cache.fill_step(n)
        t1 = time.thread_time_ns()
        req_ids = ids
        kk = [keys.get(r) for r in req_ids]
        first = qsl[:-1]
        count = qsl[1:] - first
        counts = count.tolist()
        segments = [(int(first[0]), sum(counts))]
        starts = computed.tolist()
        t2 = time.thread_time_ns()
        pending = copier.submit(segments, mark=a.event_per_step)
        t3 = time.thread_time_ns()
        batch.append(pending)
        if len(batch) == 16:
            copier.mark_batch(batch)          # the worker's flush: one event for the batch
            q.put(batch)
            batch = []
        t4 = time.thread_time_ns()
        w4 = time.perf_counter_ns()
        if step >= 200:
            wall += w4 - w0
            pieces["fill"] += t1 - t0
            pieces["python_layout"] += t2 - t1
            pieces["submit"] += t3 - t2
            pieces["batch"] += t4 - t3
        del kk, starts
    copier.mark_batch(batch)
    q.put(batch)
    # single calls for reference
    src = cache.step_rows(n)
    dst = torch.empty_like(src)
    ev = torch.cuda.Event()
    stream = torch.cuda.current_stream()
    for _ in range(200):
        dst.copy_(src)
        ev.record(stream)
    for _ in range(a.steps):
        t0 = time.thread_time_ns()
        dst.copy_(src)
        t1 = time.thread_time_ns()
        ev.record(stream)
        t2 = time.thread_time_ns()
        (lambda: None)()
        t3 = time.thread_time_ns()
        other["launch_copy_only"] += t1 - t0
        other["event_record_only"] += t2 - t1
        other["empty_python_call"] += t3 - t2
    q.put(None)
    t.join(60)
    stop.set()
    torch.cuda.synchronize()
    res = {k: round(v / a.steps / 1e3, 2) for k, v in {**pieces, **other}.items()}
    res["total_per_step_us"] = round(sum(pieces.values()) / a.steps / 1e3, 2)
    res["wall_per_step_us"] = round(wall / a.steps / 1e3, 2)
    res["driver_calls"] = cache._driver is not None and copier._drv is not None
    res.update(requests=n, layers=L, steps=a.steps, contend=a.contend, event_per_step=a.event_per_step, device=torch.cuda.get_device_name(), torch=torch.__version__)
    print(json.dumps(res, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
