"""Benchmark routing capture on a GPU: in-graph capture cost, the D2H pipeline and its memory, at the Qwen3-30B-A3B shape.

    PYTHONPATH=$PWD python bench/capture_gpu.py --out results.json        # CUDA: graphs, full measurement
    PYTHONPATH=$PWD python bench/capture_gpu.py --smoke                   # CPU: tiny shapes, eager, checks the code

The synthetic step (bf16), per layer: RMSNorm, attention stand-in (QKV and O projections of the real shape, no
attention kernel), RMSNorm, router GEMM (hidden -> experts) + softmax + top-k, then experts: the tokens are
dispatched by the real top-k ids (argsort, gather), run through a batched GEMM over A = min(E, n*K) experts with
capacity n*K/A (gate_up and down, the real FLOPs and the real expert weight bytes of a balanced grouped MoE),
weighted by the top-k scores and scattered back (index_add_). Four distinct weight sets are cycled over the 48
layers, so nothing stays in L2. A "routers-only" skeleton (RMSNorm + router + top-k per layer, no attention or
experts) isolates what capture costs per step, which the full step's noise would hide.

Capture variants (each its own CUDA graph, replayed at 1, 64, 256 tokens and at 8192 tokens for prefill):
    off        no capture
    per_layer  RoutingCache(fused=False): one copy kernel per layer inside the graph
    fused      RoutingCache(fused=True): references kept, one _foreach_copy_ after the last layer
    direct     RoutingCache(dtype=int64): torch.topk(..., out=(values, cache.layer_view(l)[:n])), nothing copied
    +copy      after each replay, AsyncCopier.submit() (snapshot on the compute stream, D2H on the side stream),
               a consumer thread doing what the Producer's thread does (result(), bytes(), release())
"""

from __future__ import annotations

import argparse
import json
import platform
import queue
import statistics
import threading
import time

import numpy as np
import torch
import torch.nn.functional as F

from routing_replay.capture import AsyncCopier, RoutingCache

QWEN3_30B_A3B = dict(L=48, E=128, K=8, H=2048, I=768, Q=4096, KV=512)
SMOKE = dict(L=4, E=16, K=4, H=64, I=32, Q=64, KV=16)
MODES = ("off", "off2", "per_layer", "fused", "direct")     # off2: "off" captured again, a control


class SyntheticMoE:
    """Own the weights, the three routing caches and the static buffers of the synthetic MoE step."""

    def __init__(self, shape: dict, max_tokens: int, device, dtype=torch.bfloat16, nsets: int = 4):
        self.s = s = shape
        self.device = device
        self.dtype = dtype
        g = torch.Generator(device=device).manual_seed(0)

        def w(*size, std=0.02):
            return (torch.randn(*size, device=device, generator=g) * std).to(dtype)

        self.sets = []
        for _ in range(nsets):
            self.sets.append(dict(qkv=w(s["H"], s["Q"] + 2 * s["KV"]), o=w(s["Q"], s["H"]),
                                  gate_up=w(s["E"], s["H"], 2 * s["I"]), down=w(s["E"], s["I"], s["H"])))
        self.router = [w(s["H"], s["E"], std=1.0) for _ in range(s["L"])]
        self.caches = {
            "per_layer": RoutingCache(max_tokens, s["L"], s["K"], device=device, fused=False),
            "fused": RoutingCache(max_tokens, s["L"], s["K"], device=device, fused=True),
            "direct": RoutingCache(max_tokens, s["L"], s["K"], device=device, dtype=torch.int64),
        }
        self.vals = torch.empty(max_tokens, s["K"], device=device)
        self.x = torch.randn(max_tokens, s["H"], device=device, generator=g).to(dtype)

    def _moe(self, x, vals, ids, ws):
        n, K, E, H = x.shape[0], self.s["K"], self.s["E"], self.s["H"]
        nk = n * K
        A = min(E, nk)
        C = nk // A
        order = torch.argsort(ids.reshape(-1))
        tok = order // K
        xs = x.index_select(0, tok).view(A, C, H)
        gu = torch.bmm(xs, ws["gate_up"][:A])
        gate, up = gu.chunk(2, dim=-1)
        y = torch.bmm(F.silu(gate) * up, ws["down"][:A]).view(nk, H)
        y = y * vals.reshape(-1)[order].unsqueeze(1).to(y.dtype)
        return torch.zeros_like(x).index_add_(0, tok, y)

    def step(self, n: int, mode: str, full: bool) -> torch.Tensor:
        s = self.s
        x = self.x[:n]
        for layer in range(s["L"]):
            ws = self.sets[layer % len(self.sets)]
            if full:
                h = F.rms_norm(x, (s["H"],)) @ ws["qkv"]
                x = x + h[:, :s["Q"]] @ ws["o"]
            xn = F.rms_norm(x, (s["H"],))
            probs = torch.softmax(xn @ self.router[layer], dim=-1, dtype=torch.float32)
            if mode == "direct":
                vals, ids = self.vals[:n], self.caches["direct"].layer_view(layer)[:n]
                torch.topk(probs, s["K"], dim=-1, out=(vals, ids))
            else:
                vals, ids = torch.topk(probs, s["K"], dim=-1)
                if mode not in ("off", "off2"):
                    self.caches[mode].record(layer, ids)
            if full:
                x = x + self._moe(xn, vals, ids, ws)
        return x


class Consumer:
    """Own a thread that consumes PendingRows the way the Producer's thread does: result(), copy, release()."""

    def __init__(self):
        self.q: queue.Queue = queue.Queue()
        self.bytes = 0
        self.items = 0
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()

    def _run(self):
        while True:
            p = self.q.get()
            if p is None:
                self.q.task_done()
                return
            if not p.dropped:
                rows = p.result()
                self.bytes += len(bytes(memoryview(np.ascontiguousarray(rows)).cast("B")))
            p.release()
            self.items += 1
            self.q.task_done()

    def put(self, p):
        if p is not None:
            self.q.put(p)

    def drain(self):
        self.q.join()

    def close(self):
        self.q.put(None)
        self.t.join(30)


class Runner:
    """Own one CUDA graph per (size, mode, full) (or the eager step on CPU) and time replays of them."""

    def __init__(self, model: SyntheticMoE, cuda: bool):
        self.m = model
        self.cuda = cuda
        self.graphs: dict = {}
        self.failed: dict = {}
        self.pool = torch.cuda.graph_pool_handle() if cuda else None

    def prepare(self, sizes, full: bool):
        if not self.cuda:
            return
        m = self.m
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for n in sizes:
                for mode in MODES:
                    m.step(n, mode, full)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        for n in sorted(sizes, reverse=True):
            for mode in MODES:
                g = torch.cuda.CUDAGraph()
                try:
                    with torch.cuda.graph(g, pool=self.pool):
                        m.step(n, mode, full)
                except Exception as e:          # report and go on with the other variants
                    self.failed[(n, mode, full)] = f"{type(e).__name__}: {e}"
                    print(f"capture failed n={n} mode={mode} full={full}: {e}", flush=True)
                    continue
                self.graphs[(n, mode, full)] = g
        torch.cuda.synchronize()

    def fn(self, n, mode, full):
        if self.cuda:
            return self.graphs[(n, mode, full)].replay
        return lambda: self.m.step(n, mode, full)

    def time_ms(self, n, mode, full, reps, copier=None, consumer=None, segments=None) -> float:
        f = self.fn(n, mode, full)
        if self.cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            a.record()
            for _ in range(reps):
                f()
                if copier is not None:
                    consumer.put(copier.submit(segments))
            b.record()
            b.synchronize()
            ms = a.elapsed_time(b) / reps
        else:
            t0 = time.perf_counter()
            for _ in range(reps):
                f()
                if copier is not None:
                    consumer.put(copier.submit(segments))
            ms = (time.perf_counter() - t0) * 1e3 / reps
        if consumer is not None:
            consumer.drain()
        return ms


def measure_steps(runner, copiers, consumer, sizes, full, rounds, reps_for) -> dict:
    """Per size: median and spread over `rounds` rounds of each configuration, configurations interleaved."""
    configs = [(mode, False) for mode in MODES] + [("fused", True), ("direct", True)]
    out = {}
    for n in sizes:
        reps = reps_for(n)
        ok = [c for c in configs if runner.cuda is False or (n, c[0], full) in runner.graphs]
        for mode in {c[0] for c in ok}:                      # warm each graph once
            runner.time_ms(n, mode, full, 1)
        samples = {c: [] for c in ok}
        for r in range(rounds):
            order = ok[r % len(ok):] + ok[:r % len(ok)]
            for mode, copy in order:
                cp = copiers[mode] if copy else None
                dropped = cp.stats.dropped_steps if cp is not None else 0
                samples[(mode, copy)].append(runner.time_ms(n, mode, full, reps, cp, consumer if copy else None,
                                                            [(0, n)]))
                if cp is not None and cp.stats.dropped_steps != dropped:
                    raise RuntimeError(f"n={n} {mode}+copy dropped {cp.stats.dropped_steps - dropped} steps")
        res = {}
        for (mode, copy), xs in samples.items():
            med = statistics.median(xs)
            res[mode + ("+copy" if copy else "")] = dict(median_ms=med, min_ms=min(xs), max_ms=max(xs),
                                                         samples_ms=xs)
        out[n] = dict(reps=reps, results=res)
    return out


class _PlainPending:
    """A plain pinned copy_ dressed as PendingRows, so the baseline goes through the same consumer thread."""

    def __init__(self, view, event, free: list, slot: int):
        self.dropped = False
        self.view, self.event, self.free, self.slot = view, event, free, slot

    def result(self):
        self.event.synchronize()
        return self.view

    def release(self):
        self.free.append(self.slot)


def _memcpy_us(fn, cuda_sync=True) -> list:
    """GPU durations (us) of the device-to-host memcpys that fn() issues, from the profiler."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [getattr(e, "device_time", None) or getattr(e, "cuda_time", 0)
            for e in prof.events() if e.device_type.name == "CUDA" and "DtoH" in e.name]


def d2h_throughput(copier, consumer, rows: int, reps: int, cuda: bool, runner=None) -> dict:
    """Prefill-sized D2H: the copier's copy vs a plain pinned copy_ of the same bytes.

    copy_us: GPU duration of each memcpy (profiler), idle GPU; loaded_copy_us: the copier's memcpy while prefill
    graphs run on the compute stream; e2e: wall clock per step from submit to the consumer thread having copied
    the bytes out and released them, both through the same consumer thread.
    """
    cache = copier.cache
    L, K = cache.num_layers, cache.top_k
    nbytes = rows * L * K * 2
    out = dict(rows=rows, bytes=nbytes)
    if not cuda:
        return out
    src = torch.randint(0, 128, (rows, L, K), dtype=torch.int16, device=cache.device)
    slots = [torch.empty((rows, L, K), dtype=torch.int16, pin_memory=True) for _ in range(3)]
    s = torch.cuda.Stream()
    main = torch.cuda.current_stream()

    def plain_copies():
        with torch.cuda.stream(s):
            for i in range(reps):
                slots[i % 3].copy_(src, non_blocking=True)

    def copier_copies():
        for _ in range(reps):
            consumer.put(copier.submit([(0, rows)]))
            consumer.drain()

    plain_copies()
    copier_copies()
    plain_us = _memcpy_us(plain_copies)
    ours_us = _memcpy_us(copier_copies)
    out.update(plain_copy_us=statistics.median(plain_us), copier_copy_us=statistics.median(ours_us),
               n_plain=len(plain_us), n_copier=len(ours_us))
    out["plain_GBps"] = nbytes / out["plain_copy_us"] / 1e3
    out["copier_GBps"] = nbytes / out["copier_copy_us"] / 1e3
    out["ratio"] = out["plain_copy_us"] / out["copier_copy_us"]
    if runner is not None and (rows, "fused", True) in runner.graphs:
        g = runner.graphs[(rows, "fused", True)]

        def loaded():
            for _ in range(3):
                g.replay()
                consumer.put(copier.submit([(0, rows)]))
            consumer.drain()
        loaded_us = _memcpy_us(loaded)
        out["loaded_copier_copy_us"] = statistics.median(loaded_us)
        out["loaded_copier_GBps"] = nbytes / out["loaded_copier_copy_us"] / 1e3
    # end to end, both through the consumer thread (which copies the bytes out, as the Producer does)
    # both pipelines keep at most 3 steps in flight: the engine loop waits for the consumer beyond that
    torch.cuda.synchronize()
    dropped = copier.stats.dropped_steps
    done0 = consumer.items
    t0 = time.perf_counter()
    for i in range(reps):
        while i - (consumer.items - done0) >= 3:
            time.sleep(0)
        consumer.put(copier.submit([(0, rows)]))
    consumer.drain()
    out["copier_e2e_us"] = (time.perf_counter() - t0) * 1e6 / reps
    out["copier_e2e_dropped"] = copier.stats.dropped_steps - dropped
    free = [0, 1, 2]
    evs = [torch.cuda.Event(blocking=True) for _ in range(3)]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        while not free:                       # the plain baseline has no drop policy: it waits for a slot
            time.sleep(0)
        j = free.pop()
        s.wait_stream(main)
        with torch.cuda.stream(s):
            slots[j].copy_(src, non_blocking=True)
            evs[j].record(s)
        consumer.put(_PlainPending(slots[j].numpy(), evs[j], free, j))
    consumer.drain()
    out["plain_e2e_us"] = (time.perf_counter() - t0) * 1e6 / reps
    out["e2e_ratio"] = out["plain_e2e_us"] / out["copier_e2e_us"]
    return out


def launch_reference_us(device, reps=200) -> dict:
    """CPU cost of launching trivial work on this host, to put submit()'s CPU time in proportion."""
    a = torch.zeros(16, device=device)
    b = torch.zeros(16, device=device)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        a.copy_(b)
        ts.append((time.perf_counter() - t0) * 1e6)
    out = dict(copy_launch_us=statistics.median(ts))
    if device.type == "cuda":
        side = torch.cuda.Stream()
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            with torch.cuda.stream(side):
                pass
            ts.append((time.perf_counter() - t0) * 1e6)
        out["stream_context_us"] = statistics.median(ts)
        torch.cuda.synchronize()
    return out


def submit_host_cost(copier, consumer, sizes, reps) -> dict:
    """Engine-thread (CPU) time of one submit() call, including the snapshot and copy launches."""
    out = {}
    for n in sizes:
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            p = copier.submit([(0, n)])
            ts.append((time.perf_counter() - t0) * 1e6)
            consumer.put(p)
            consumer.drain()
        seg = [(i, 1) for i in range(0, n, 2)]              # every other request wants routing: gather path
        tg = []
        for _ in range(reps):
            t0 = time.perf_counter()
            p = copier.submit(seg)
            tg.append((time.perf_counter() - t0) * 1e6)
            consumer.put(p)
            consumer.drain()
        arr = np.asarray(seg, dtype=np.int64)
        ta = []
        for _ in range(reps):
            t0 = time.perf_counter()
            p = copier.submit(arr)
            ta.append((time.perf_counter() - t0) * 1e6)
            consumer.put(p)
            consumer.drain()
        out[n] = dict(contiguous_us=statistics.median(ts), gather_us=statistics.median(tg),
                      gather_array_us=statistics.median(ta), gather_segments=len(seg))
    return out


def kernel_profile(model, copier, n, cuda) -> dict:
    """Kernels launched by one eager fused flush of all layers and by one submit (names, GPU us)."""
    if not cuda:
        return {}
    from torch.profiler import ProfilerActivity, profile
    L, K = model.s["L"], model.s["K"]
    ids = [torch.randint(0, model.s["E"], (n, K), device=model.device) for _ in range(L)]
    cache = model.caches["fused"]
    out = {}
    for label, fn in (("fused_record_all_layers", lambda: [cache.record(i, t) for i, t in enumerate(ids)]),
                      ("per_layer_record_all_layers",
                       lambda: [model.caches["per_layer"].record(i, t) for i, t in enumerate(ids)]),
                      ("submit", lambda: copier.submit([(0, n)]).release())):
        try:
            fn()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                fn()
                torch.cuda.synchronize()
            evs = [e for e in prof.events() if e.device_type.name == "CUDA"]
            out[label] = [(e.name[:90], round(getattr(e, "device_time", None) or getattr(e, "cuda_time", 0), 2))
                          for e in evs]
        except Exception as e:                  # the profiler is a nicety; never lose the run to it
            out[label] = f"profiler failed: {type(e).__name__}: {e}"
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, eager: checks the code paths")
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and not a.smoke
    device = torch.device("cuda" if cuda else "cpu")
    shape = QWEN3_30B_A3B if cuda else SMOKE
    decode_sizes, prefill = ((1, 64, 256), 8192) if cuda else ((1, 4, 16), 64)
    t_start = time.perf_counter()
    info = dict(device=torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
                torch=torch.__version__, cuda=torch.version.cuda, shape=shape, python=platform.python_version())
    print(json.dumps(info), flush=True)

    mem0 = torch.cuda.memory_allocated() if cuda else 0
    model = SyntheticMoE(shape, prefill, device)
    mem_model = (torch.cuda.memory_allocated() - mem0) if cuda else 0
    default = AsyncCopier(model.caches["fused"])            # num_slots=2: what an engine gets by default
    memory = dict(weights_and_caches_bytes=mem_model,
                  cache_int16_bytes=model.caches["fused"].nbytes,
                  cache_int64_bytes=model.caches["direct"].nbytes,
                  copier_device_bytes=default.device_bytes,
                  copier_pinned_host_bytes=default.host_bytes,
                  copier_capacity_rows=default.capacity_rows)
    del default
    # The timing loops launch up to 10 steps ahead of the GPU (no per-step sync, unlike an engine that reads
    # its sampled tokens): the bench copiers hold that many prefill steps so that no step is dropped.
    copiers = {"fused": AsyncCopier(model.caches["fused"], num_slots=12),
               "direct": AsyncCopier(model.caches["direct"], num_slots=12)}
    print(json.dumps(dict(memory=memory)), flush=True)
    consumer = Consumer()
    runner = Runner(model, cuda)
    results = dict(info=info, memory=memory)

    for full, label in ((False, "routers_only"), (True, "full_step")):
        t0 = time.perf_counter()
        sizes = (*decode_sizes, prefill)
        runner.prepare(sizes, full)
        if cuda:
            reps_for = (lambda n: 50 if n <= 256 else 10) if not full else (lambda n: 50 if n == 1 else
                                                                            (10 if n <= 256 else 3))
        else:
            reps_for = lambda n: 2
        res = measure_steps(runner, copiers, consumer, sizes, full, a.rounds if cuda else 2, reps_for)
        results[label] = res
        print(f"== {label} ({time.perf_counter() - t0:.1f}s)", flush=True)
        for n, r in res.items():
            med = {k: round(v["median_ms"] * 1e3, 1) for k, v in r["results"].items()}
            print(f"  n={n}: median us per step {med}", flush=True)

    results["d2h_prefill"] = d2h_throughput(copiers["fused"], consumer, prefill, 20 if cuda else 2, cuda, runner)
    print(json.dumps(dict(d2h_prefill=results["d2h_prefill"])), flush=True)
    results["submit_host_us"] = submit_host_cost(copiers["fused"], consumer, (*decode_sizes, prefill),
                                                 20 if cuda else 2)
    print(json.dumps(dict(submit_host_us=results["submit_host_us"])), flush=True)
    results["launch_reference"] = launch_reference_us(device)
    print(json.dumps(dict(launch_reference=results["launch_reference"])), flush=True)
    results["kernels_256"] = kernel_profile(model, copiers["fused"], 256, cuda)
    print(json.dumps(dict(kernels_256=results["kernels_256"])), flush=True)
    results["copier_stats"] = {k: vars(c.stats) for k, c in copiers.items()}
    results["capture_failures"] = {str(k): v for k, v in runner.failed.items()}
    results["wall_s"] = time.perf_counter() - t_start
    consumer.close()
    print(report(results), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1, default=str)
    return 0


def report(r: dict) -> str:
    """Markdown tables of the results."""
    lines = []
    for label in ("routers_only", "full_step"):
        lines.append(f"\n### {label} (median us per step over rounds; [min..max])\n")
        cols = ["off", "off2", "per_layer", "fused", "direct", "fused+copy", "direct+copy"]
        lines.append("| tokens | " + " | ".join(cols) + " |")
        lines.append("|---" * (len(cols) + 1) + "|")
        for n, x in r[label].items():
            cells = []
            for c in cols:
                v = x["results"].get(c)
                if v is None:
                    cells.append("failed")
                    continue
                cells.append(f"{v['median_ms'] * 1e3:.1f} [{v['min_ms'] * 1e3:.1f}..{v['max_ms'] * 1e3:.1f}]")
            lines.append(f"| {n} | " + " | ".join(cells) + " |")
        lines.append("\nCapture cost vs off (median difference, us per step; % of the off step):\n")
        lines.append("| tokens | " + " | ".join(cols[1:]) + " |")
        lines.append("|---" * len(cols) + "|")
        for n, x in r[label].items():
            off = x["results"]["off"]["median_ms"]
            cells = [f"{(x['results'][c]['median_ms'] - off) * 1e3:+.1f} "
                     f"({(x['results'][c]['median_ms'] - off) / off * 100:+.2f}%)" if c in x["results"] else "failed"
                     for c in cols[1:]]
            lines.append(f"| {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
