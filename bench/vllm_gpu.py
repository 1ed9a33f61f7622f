"""Measure what routing capture costs vLLM on a GPU: output tokens/s with capture on vs off, per-step GPU and host
time added, pinned and device memory used.

Model: a random-weight Qwen3-MoE at real width (the Qwen3-30B-A3B layer shape: hidden 2048, 32 query / 4 KV heads
of 128, 128 experts, top-8, MoE intermediate 768), `--layers` layers, a 512-token vocabulary. Only config.json and
a tokenizer are written; vLLM builds the weights itself (`load_format="dummy"`), then every parameter is refilled
in place inside the engine (normal(0, 0.02), norms 1.0, seeded by name) so routing is spread over the experts the
way random routers spread it (vLLM's dummy values, U(-1e-3, 1e-3) with one seed for every tensor, give every layer
the same weights).

Two engines live in this process at once, both vLLM defaults (multiprocess engine core, torch.compile, CUDA graphs,
async scheduling, chunked prefill, prefix caching), same weights:
  off   vanilla vLLM: created first, with ROUTING_REPLAY_BROKER unset and the plugin never registered in this
        process, so its engine core (forked from here) holds no routing-replay code at all;
  on    the plugin publishing to an external broker and consumer (`routing-replay broker` / `consume --npz-dir`,
        processes on this machine), every request captured;
  fill  the same plugin engine gathering prefix-cache hits from the prefix store (switched per round through
        collective_rpc; use --shared-prefix to have hits). The plugin engine starts with
        ROUTING_REPLAY_PREFIX_ROWS=--prefix-rows (default fill): then every forward, `on` rounds included, writes
        its routing into the store by KV slot inside vLLM's CUDA graphs (the store write is captured with the
        hooks), and `fill` adds only the gathers. With --prefix-rows sentinel there is no store and no fill mode:
        run both to compare on/off with and without the store;
  optout  the same plugin engine with every request opted out (`return_routed_experts=False`): hooks bound and
        writing the device cache inside the graphs, nothing copied or sent.
Rounds rotate the order (off, on, optout / on, optout, off / ...), after one warm-up round per mode. Each round runs
the same workload on an emptied prefix cache: `--requests` requests at once, `--prompt-len` random tokens, exactly
`--output-len` output tokens (greedy, ignore_eos, detokenize=False: the front end's detokenization halved throughput
and made rounds noisy on the H100). After an `on` round the records are awaited (time reported
apart, not in the round) and checked: one per request, complete, prompt and output rows present.

Per-step costs, from the plugin engine (collective_rpc into its worker):
  host  WorkerStats.host_ns (pre_step + post_step on the engine thread) and CaptureBinding.hook_ns (router hooks
        that ran in Python: eager steps only; graph replays run none), and the engine-core process's CPU time
        per step (all its threads, so the producer's thread is in it) against the vanilla engine's; on a
        GPU-bound engine this includes spinning on CUDA syncs, so it bounds work from above, it does not measure it.
  GPU   the capture kernels, timed by replaying CUDA graphs of them on the engine's own RoutingCache and
        AsyncCopier: the -1 fill (pre_step), the fused per-step cache write (captured in vLLM's graphs), and the
        snapshot into the staging ring (post_step), at a decode step's and a full prefill step's token count;
        the side-stream D2H is timed apart (it overlaps compute).

    python bench/vllm_gpu.py --out DIR [--layers 16] [--rounds 6]      (results: docs/PERFORMANCE.md)
    python bench/vllm_gpu.py --out DIR --small          (CPU smoke run: tiny model, few requests)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODES = ("off", "on", "fill", "optout")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_model(out: Path, *, layers: int, hidden: int, experts: int, top_k: int, moe_intermediate: int, heads: int,
                kv_heads: int, head_dim: int, dtype: str) -> Path:
    """config.json (Qwen3-MoE) and a byte-level tokenizer; no weights (vLLM loads with load_format="dummy")."""
    from routing_replay.apps.models import _tokenizer, make_config

    out.mkdir(parents=True, exist_ok=True)
    vocab = _tokenizer(out)
    cfg = make_config("qwen3_moe", num_layers=layers, num_experts=experts, top_k=top_k, hidden_size=hidden,
                      vocab_size=max(512, vocab), dtype=dtype)
    cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim = heads, kv_heads, head_dim
    cfg.moe_intermediate_size = moe_intermediate
    cfg.intermediate_size = 3 * hidden
    cfg.max_position_embeddings = 4096
    cfg.save_pretrained(out)
    return out


# ---- run inside the engine-core process (LLM.collective_rpc: `worker` is vLLM's Worker) ------------------------

def _rpc_reinit_weights(worker, seed: int) -> int:
    """Refill every floating-point parameter in place: norms 1.0, the rest normal(0, 0.02), seeded by name."""
    import zlib

    import torch

    n = 0
    with torch.inference_mode():              # vLLM may have made some parameters inside inference mode
        for name, p in worker.model_runner.get_model().named_parameters():
            if not torch.is_floating_point(p):
                continue
            if "norm" in name:
                p.fill_(1.0)
            else:
                g = torch.Generator(device=p.device)
                g.manual_seed(seed + zlib.crc32(name.encode()))
                p.normal_(0.0, 0.02, generator=g)
            n += p.numel()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return n


def _rpc_set_timing(worker, on: bool) -> bool:
    from routing_replay.engines.vllm_plugin import capture_of

    cap = capture_of(worker)
    if cap is None:
        return False
    cap.timing = cap.binding.timing = on
    return True


def _rpc_profile(worker, on: bool):
    """--profile: cProfile around WorkerCapture.pre_step/post_step on the engine thread (on=True starts it; on=False
    stops it and returns the report: the functions by own time and by cumulative time)."""
    import cProfile
    import io
    import pstats

    from routing_replay.engines.vllm_plugin import capture_of

    cap = capture_of(worker)
    if cap is None:
        return False
    if on:
        prof = cProfile.Profile()
        pre, post = cap.pre_step, cap.post_step

        def wrap(fn):
            def run(so):
                prof.enable()
                try:
                    return fn(so)
                finally:
                    prof.disable()
            return run

        cap.pre_step, cap.post_step = wrap(pre), wrap(post)
        cap._bench_profile = prof
        return True
    prof = cap.__dict__.pop("_bench_profile")
    del cap.pre_step, cap.post_step                     # the class's methods again
    buf = io.StringIO()
    st = pstats.Stats(prof, stream=buf)
    st.sort_stats("tottime").print_stats(25)
    st.sort_stats("cumulative").print_stats(25)
    return buf.getvalue()


def _quiet_steps(s0: dict, s1: dict) -> dict:
    """A round's quiet steps (WorkerStats.quiet_*: steps that opened, finished and preempted nothing) and their
    engine-thread time per step, CPU and wall, with the timing clocks' own cost taken out."""
    n = s1["quiet_steps"] - s0["quiet_steps"]
    if not n:
        return {"quiet_steps": 0}
    d = {k: s1[k] - s0[k] for k in ("quiet_host_ns", "quiet_host_wall_ns", "quiet_clock_ns", "quiet_clock_wall_ns")}
    return {"quiet_steps": n,
            "quiet_net_us_per_step": (d["quiet_host_ns"] - d["quiet_clock_ns"]) / n / 1e3,
            "quiet_wall_net_us_per_step": (d["quiet_host_wall_ns"] - d["quiet_clock_wall_ns"]) / n / 1e3}


def _rpc_line_profile(worker, on: bool):
    """--line-profile: line_profiler (if installed) over WorkerCapture.pre_step/post_step on the engine thread, the
    same way as _rpc_profile; the report is the time of each line (its own profiling overhead included: compare
    lines with each other, not with the unprofiled figures)."""
    import io

    from line_profiler import LineProfiler

    from routing_replay.engines.vllm_plugin import capture_of

    cap = capture_of(worker)
    if cap is None:
        return False
    cls = type(cap)
    if on:
        lp = LineProfiler()
        # what pre_step and post_step call, line by line too (profiled only while inside one of them)
        import inspect as _inspect

        from routing_replay.engines.vllm_plugin import runners as _runners
        from routing_replay.engines.vllm_plugin import step_batch as _step_batch
        for name, fn in _inspect.getmembers(cls, _inspect.isfunction):
            if name.startswith("_") and not name.startswith("__"):
                lp.add_function(fn)
        for part in (cap.path, cap.path.reader, cap.requests, cap.prefix):     # its collaborators, whole
            for name, fn in _inspect.getmembers(type(part), _inspect.isfunction):
                if not name.startswith("__"):
                    lp.add_function(fn)
        for fn in (_runners.step_layout, *(f for n, f in _inspect.getmembers(_step_batch.StepBatch, _inspect.isfunction)
                                           if not n.startswith("__"))):
            lp.add_function(fn)
        for obj, names in ((cap.producer, ("open_many", "end_many", "publish_steps", "_publish_parts")),
                           (cap.copier, ("submit",))):
            for n in names:
                fn = getattr(type(obj), n, None) if obj is not None else None
                if fn is not None:
                    lp.add_function(fn)
        cap.pre_step = lp(cls.pre_step).__get__(cap)
        cap.post_step = lp(cls.post_step).__get__(cap)
        cap._bench_lines = lp
        return True
    lp = cap.__dict__.pop("_bench_lines")
    del cap.pre_step, cap.post_step
    buf = io.StringIO()
    lp.print_stats(stream=buf, output_unit=1e-6, stripzeros=True)
    return buf.getvalue()


def _rpc_step_trace(worker, on: bool):
    """--step-trace: each step's engine-thread time, wall, without the clocks' own cost (WorkerStats.host_wall_ns
    minus clock_wall_ns, read around pre_step and post_step), with what the step did: requests opened, finished,
    tokens, whether it went raw (RingPath.ring_step: the step ring, or copied whole). on=True starts it; on=False stops it
    and returns the rows."""
    from routing_replay.engines.vllm_plugin import capture_of

    cap = capture_of(worker)
    if cap is None:
        return False
    if on:
        rows: list = []
        st = cap.stats
        pre, post = cap.pre_step, cap.post_step

        def net():
            return st.host_wall_ns - st.clock_wall_ns

        def run_pre(so):
            a = net()
            pre(so)
            rows.append([len(so.scheduled_new_reqs), len(so.finished_req_ids), int(so.total_num_scheduled_tokens),
                         net() - a, 0, 0])

        def run_post(so):
            a, r = net(), st.ring_steps + getattr(st, "copied_steps", 0)
            post(so)
            rows[-1][4] = net() - a
            rows[-1][5] = st.ring_steps + getattr(st, "copied_steps", 0) - r

        cap.pre_step, cap.post_step = run_pre, run_post
        cap._bench_trace = rows
        return True
    rows = cap.__dict__.pop("_bench_trace")
    del cap.pre_step, cap.post_step
    return rows


def _trace_summary(rows: list) -> dict:
    """--step-trace rows grouped by what the step did: steps, their total and mean engine-thread wall time."""
    groups: dict = {}
    for new, fin, n, pre, post, ring in rows:
        kind = ("opens" if new else "") + ("+finishes" if fin else "") or "quiet"
        kind = kind.lstrip("+") + ("" if ring else ", general path")
        g = groups.setdefault(kind, {"steps": 0, "opened": 0, "finished": 0, "tokens": 0, "pre_us": 0.0,
                                     "post_us": 0.0})
        g["steps"] += 1
        g["opened"] += new
        g["finished"] += fin
        g["tokens"] += n
        g["pre_us"] += pre / 1e3
        g["post_us"] += post / 1e3
    total = sum(g["pre_us"] + g["post_us"] for g in groups.values())
    for g in groups.values():
        g["total_us"] = g["pre_us"] + g["post_us"]
        g["us_per_step"] = g["total_us"] / g["steps"]
        g["us_per_round_step"] = g["total_us"] / max(len(rows), 1)      # its share of the every-step figure
    return {"steps": len(rows), "us_per_step": total / max(len(rows), 1), "kinds": groups}


def _rpc_prefix_rows(worker, mode: str) -> bool:
    from routing_replay.engines.vllm_plugin import capture_of

    cap = capture_of(worker)
    if cap is None:
        return False
    cap.set_prefix_rows(mode)
    return True


def _rpc_stats(worker) -> dict:
    """Counters of this engine-core process and, if it captures, of its WorkerCapture."""
    from routing_replay.engines.vllm_plugin import capture_of

    cpu = os.times()
    d = {"pid": os.getpid(), "cpu_s": cpu.user + cpu.system, "capture": False}
    cap = capture_of(worker)
    if cap is None:
        return d
    st, cop, prod = cap.stats, cap.copier.stats, cap.producer.stats
    cfg = worker.vllm_config
    d.update(capture=True, steps=st.steps, active_steps=st.active_steps, ring_steps=st.ring_steps,
             copied_steps=getattr(st, "copied_steps", 0), rows=st.rows,       # (0 from trees without the counter)
             host_ns=st.host_ns, host_wall_ns=st.host_wall_ns, clock_ns=st.clock_ns, clock_wall_ns=st.clock_wall_ns,
             timed_sections=st.timed_sections, quiet_steps=st.quiet_steps, quiet_sections=st.quiet_sections,
             quiet_host_ns=st.quiet_host_ns, quiet_host_wall_ns=st.quiet_host_wall_ns,
             quiet_clock_ns=st.quiet_clock_ns, quiet_clock_wall_ns=st.quiet_clock_wall_ns,
             prefix_rows=st.prefix_rows, prefix_requests=st.prefix_requests,
             store_device_bytes=cap.store.nbytes if cap.store is not None else 0,
             store_slots=cap.store.num_slots if cap.store is not None else 0,
             hook_ns=cap.binding.hook_ns, opened=st.opened, finished=st.finished,
             copier_dropped_steps=cop.dropped_steps, producer_dropped_msgs=prod.dropped_msgs,
             sent_msgs=prod.sent_msgs, sent_bytes=prod.sent_bytes,
             cache_device_bytes=cap.cache.nbytes, copier_device_bytes=cap.copier.device_bytes,
             pinned_host_bytes=cap.copier.host_bytes, cache_tokens=cap.cache.max_tokens,
             moe_layers=cap.cache.num_layers, top_k=cap.cache.top_k, graph_safe_hooks=not cap.binding.gate,
             cudagraph_mode=str(cfg.compilation_config.cudagraph_mode),
             compile_mode=str(getattr(cfg.compilation_config, "mode", getattr(cfg.compilation_config, "level", ""))),
             enforce_eager=bool(cfg.model_config.enforce_eager),
             async_scheduling=bool(cfg.scheduler_config.async_scheduling),
             max_num_batched_tokens=int(cfg.scheduler_config.max_num_batched_tokens),
             max_cudagraph_capture_size=getattr(cfg.compilation_config, "max_cudagraph_capture_size", None),
             block_size=int(cfg.cache_config.block_size),
             enable_prefix_caching=bool(cfg.cache_config.enable_prefix_caching))
    return d


def _rpc_gpu_cost(worker, sizes: list, reps: int = 200) -> dict:
    """GPU time of the capture kernels per step, on the engine's own cache and copier (engine idle).

    Each measured sequence is captured `reps` times into one CUDA graph; replay time / reps is its kernel time
    with graph-launch gaps (what a step pays). Token counts above the cache are skipped."""
    import numpy as np
    import torch

    from routing_replay.engines.vllm_plugin import capture_of

    from routing_replay.capture import PrefixStore

    cap = capture_of(worker)
    if cap is None or cap.device.type != "cuda":
        return {}
    cache, copier = cap.cache, cap.copier
    L, K, dev = cache.num_layers, cache.top_k, cache.device
    experts = cap.binding.layers[0].num_experts or 128
    side = torch.cuda.Stream(device=dev)
    res: dict = {}

    def timed(body, n_warm: int = 3, n_time: int = 10) -> float:
        g = torch.cuda.CUDAGraph()
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            body()                                   # warm (allocations outside the graph)
            torch.cuda.synchronize(dev)
            with torch.cuda.graph(g, stream=side):
                for _ in range(reps):
                    body()
        torch.cuda.synchronize(dev)
        for _ in range(n_warm):
            g.replay()
        torch.cuda.synchronize(dev)
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(n_time):
            t0.record()
            g.replay()
            t1.record()
            t1.synchronize()
            times.append(t0.elapsed_time(t1) * 1e3 / reps)
        del g
        return statistics.median(times)

    for n in sizes:
        n = int(n)
        if n > cache.max_tokens:
            continue
        ids = [torch.randint(0, experts, (n, K), dtype=torch.int32, device=dev) for _ in range(L)]

        def fill():
            cache.buffer[:, :n].fill_(-1)

        def record(ids=ids):
            for i, t in enumerate(ids):
                cache.record(i, t)

        stage = copier._stage[:n]

        def snapshot():
            stage.copy_(copier._src[0:n])

        # the prefix store's per-step write (fill mode), into a store of the engine's size if it has one
        store = cap.store if cap.store is not None else PrefixStore(1 << 16, L, K, device=dev)
        slots = torch.randperm(store.num_slots, device=dev)[:n]
        step_rows = cache.buffer[:, :n].transpose(0, 1)

        def store_write():
            store.write(slots, step_rows)

        attached = cache._store                  # time the cache write alone (the store write is timed apart)
        cache.detach_store()
        try:
            record_us = timed(record)
        finally:
            if attached is not None:
                cache.attach_store(*attached)
        # with step stamps (ROUTING_REPLAY_STEP_STAMP=on) the cache write includes the stamp add and no fill runs
        row = {"fill_minus_one_us": 0.0 if cache.stamped else timed(fill), "fused_cache_write_us": record_us,
               "stamp_us": timed(cache._stamp) if cache.stamped else 0.0,
               "snapshot_us": timed(snapshot), "store_write_us": timed(store_write)}
        row["compute_stream_us"] = row["fill_minus_one_us"] + row["fused_cache_write_us"] + row["snapshot_us"]
        if cache.slots and n <= cache.slot_rows:
            # the step ring's stamp add + slot write alone, as the engine runs it and with the other path
            kern = cache._kernels
            row["ring_kernels"] = "triton" if kern is not None else "torch"
            row["stamp_slot_write_us"] = timed(lambda: cache._stamp_and_slot(n))
            cache._kernels = None if kern is not None else _ring_kernels(cache)
            try:
                if cache._kernels is not None or kern is not None:
                    row["stamp_slot_write_other_us"] = timed(lambda: cache._stamp_and_slot(n))
            finally:
                cache._kernels = kern
        # the D2H into the pinned ring, as submit() issues it (side stream; overlaps compute)
        host = copier._host[:n]
        torch.cuda.synchronize(dev)
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        d2h = []
        for _ in range(20):
            with torch.cuda.stream(side):
                t0.record()
                host.copy_(stage, non_blocking=True)
                t1.record()
            t1.synchronize()
            d2h.append(t0.elapsed_time(t1) * 1e3)
        row["d2h_side_stream_us"] = statistics.median(d2h[5:])
        row["bytes_per_step"] = int(n * L * K * 2)
        res[str(n)] = row
        del ids
    cache.buffer.fill_(-1)
    torch.cuda.synchronize(dev)
    # the engine-thread CPU time of one submit (post_step's copy call) at a decode step's size
    n = min(int(sizes[0]), cache.max_tokens)
    t = []
    for _ in range(50):
        t0 = time.thread_time_ns()
        p = copier.submit([(0, n)])
        t.append(time.thread_time_ns() - t0)
        p.result()
        p.release()
    res["submit_host_us"] = float(np.median(t) / 1e3)
    return res


def _ring_kernels(cache):
    """The Triton slot write for `cache` where it runs here, else None."""
    from routing_replay.capture import ring_kernels
    if ring_kernels._triton() is None or not ring_kernels.check(cache.device):
        return None
    return ring_kernels.RingKernels(cache._full, cache.ring, cache._slot)


# ---- this process --------------------------------------------------------------------------------------------

class Helpers:
    """Own the broker and consumer processes of the `on` engine."""

    def __init__(self, work: Path, log_dir: Path):
        self.fe, be = f"tcp://127.0.0.1:{_free_port()}", f"tcp://127.0.0.1:{_free_port()}"
        self.npz = work / "npz"
        cli = [sys.executable, "-m", "routing_replay.apps.cli"]
        self.logs = [open(log_dir / "broker.log", "w"), open(log_dir / "consumer.log", "w")]
        self.procs = [
            subprocess.Popen(cli + ["broker", "--frontend", self.fe, "--backend", be, "--stats-interval", "30"],
                             stdout=self.logs[0], stderr=subprocess.STDOUT),
            subprocess.Popen(cli + ["consume", "--connect", be, "--npz-dir", str(self.npz), "--no-progress",
                                    "--stats-interval", "30", "--finish-grace-ms", "100"],
                             stdout=self.logs[1], stderr=subprocess.STDOUT),
        ]

    def cpu_s(self) -> float:
        total = 0.0
        tick = os.sysconf("SC_CLK_TCK")
        for p in self.procs:
            try:
                f = Path(f"/proc/{p.pid}/stat").read_text().rsplit(")", 1)[1].split()
                total += (int(f[11]) + int(f[12])) / tick
            except (OSError, IndexError):
                pass
        return total

    def wait_records(self, n: int, timeout_s: float) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if self.npz.exists() and len(self.records()) >= n:
                return time.monotonic() - t0
            if any(p.poll() is not None for p in self.procs):
                raise RuntimeError("broker or consumer exited; see broker.log / consumer.log")
            time.sleep(0.02)
        have = len(self.records()) if self.npz.exists() else 0
        raise TimeoutError(f"{have} of {n} records after {timeout_s}s")

    def records(self) -> list:
        """The records written so far, not the consumer's files still being written (counting one let a round's
        check run before its last record was in place; deleting one made the consumer's rename fail)."""
        from routing_replay.consumer import record_files
        return record_files(self.npz)

    def clear(self) -> None:
        """Delete the records written so far (the consumer keeps writing into the directory)."""
        for f in self.records():
            f.unlink()

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        for f in self.logs:
            f.close()


def _proc_cpu_s(pid: int) -> float:
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def output_lens(requests: int, output_len: int, spread: float) -> list:
    """Each request's output length (--output-spread): output_len for all with spread 0; else spread evenly over
    [output_len x (1 - spread), output_len] in an order that mixes long and short requests."""
    if not 0 <= spread < 1:
        raise SystemExit(f"--output-spread {spread}: must be in [0, 1)")
    return [output_len - round(spread * output_len * ((i * 7919) % requests) / requests) for i in range(requests)]


def _check_records(npz: Path, outs, prompt_len: int, lens: list, layers: int, top_k: int) -> dict:
    """One complete record per request with every computed row present; expert load over all rows. lens: each
    request's output length, in the order of outs."""
    import numpy as np

    from routing_replay.consumer import load_records

    recs = load_records(npz)
    counts = None
    bad = []
    for o, output_len in zip(outs, lens):
        r = recs.get(o.request_id)
        if r is None:
            bad.append((o.request_id, "missing"))
            continue
        p, g = r.prompt_routed_experts, r.routed_experts
        if not r.complete or p.shape != (prompt_len, layers, top_k) or g.shape != (output_len, layers, top_k):
            bad.append((o.request_id, f"complete={r.complete} {r.reason} {p.shape} {g.shape}"))
            continue
        if r.num_prefix_filled not in (0, r.num_cached_tokens):
            bad.append((o.request_id, f"num_prefix_filled {r.num_prefix_filled} of {r.num_cached_tokens}"))
            continue
        rows = np.concatenate([p[r.num_cached_tokens - r.num_prefix_filled:], g[:-1]])
        if (rows < 0).any() or (g[-1] != -1).any():
            bad.append((o.request_id, "-1 misplaced"))
            continue
        if r.output_token_ids.tolist() != list(o.outputs[0].token_ids):
            bad.append((o.request_id, "output tokens differ"))
            continue
        if r.prompt_token_ids.tolist() != list(o.prompt_token_ids):
            bad.append((o.request_id, "prompt tokens differ"))
            continue
        c = np.bincount(rows.reshape(-1).astype(np.int64))
        counts = c if counts is None else np.pad(counts, (0, max(0, len(c) - len(counts)))) + \
            np.pad(c, (0, max(0, len(counts) - len(c))))
    load = {}
    if counts is not None and counts.sum():
        load = {"experts_used": int((counts > 0).sum()), "max_over_mean": float(counts.max() / counts.mean()),
                "min_over_mean": float(counts.min() / counts.mean())}
    return {"records": len(recs), "bad": bad[:10], "n_bad": len(bad), "expert_load": load}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="results (bench_vllm_gpu.json), logs")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--moe-intermediate", type=int, default=768)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--requests", type=int, default=None, help="requests per round (default 256; --small: 16)")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3, help="rounds of each mode after the warm-up round")
    ap.add_argument("--max-num-seqs", type=int, default=0,
                    help="the engines' max_num_seqs (0: max(256, --requests)); below --requests, the others wait "
                         "and start as running ones finish (continuous batching)")
    ap.add_argument("--output-spread", type=float, default=0.0,
                    help="request i generates output_len - round(spread x output_len x ((i x 7919) mod R) / R) "
                         "tokens (R = --requests): with --max-num-seqs below --requests, requests finish and "
                         "start in most steps, as in a rollout engine (0: all alike, they start and end together)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.42, help="per engine (two run at once)")
    ap.add_argument("--kv-cache-gib", type=float, default=8.0, help="per engine")
    ap.add_argument("--prefix-rows", choices=("fill", "sentinel"), default="fill",
                    help="ROUTING_REPLAY_PREFIX_ROWS of the plugin engine (sentinel: no store, no fill rounds)")
    ap.add_argument("--shared-prefix", type=int, default=0,
                    help="leading prompt tokens shared by all requests (prefix-cache hits; the fill mode's gathers)")
    ap.add_argument("--line-profile", action="store_true",
                    help="after the rounds, one more round of on (and fill) under line_profiler (must be installed): "
                         "time per line of pre_step and post_step and what they call, in lines_on.txt / lines_fill.txt")
    ap.add_argument("--step-trace", action="store_true",
                    help="after the rounds, one more round of on with each step's engine-thread time recorded, "
                         "grouped by what the step did (opens, finishes, the general path) in trace_on.json")
    ap.add_argument("--profile", action="store_true",
                    help="after the rounds: one `on` and one `fill` round under cProfile (engine thread, pre_step + "
                         "post_step), reports in profile_on.txt / profile_fill.txt")
    ap.add_argument("--own", action="store_true",
                    help="also run vLLM's own capture (enable_return_routed_experts) as mode `own`, a third engine "
                         "without our plugin, and compare it with ours (results: `own` in the JSON)")
    ap.add_argument("--small", action="store_true", help="CPU smoke run: tiny model, 16 requests, 1 round")
    a = ap.parse_args(argv)
    if a.small:
        a.layers, a.hidden, a.experts, a.top_k, a.moe_intermediate = 2, 128, 8, 2, 128
        a.heads, a.kv_heads, a.head_dim, a.dtype = 2, 1, 64, "float32"
        a.prompt_len, a.output_len, a.rounds, a.kv_cache_gib = 64, 16, 1, 0.25
    a.requests = a.requests or (16 if a.small else 256)
    a.max_num_seqs = a.max_num_seqs or max(256, a.requests)

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="rr-vllm-gpu-"))
    for k in ("ROUTING_REPLAY_BROKER", "ROUTING_REPLAY_NPZ_DIR", "ROUTING_REPLAY_SERVE"):
        os.environ.pop(k, None)
    os.environ["ROUTING_REPLAY_REQUESTS"] = "all"
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"       # collective_rpc with our functions
    helpers = Helpers(work, out)
    try:
        return _run(a, out, work, helpers)
    finally:
        helpers.close()
        shutil.rmtree(work, ignore_errors=True)


def _run(a, out: Path, work: Path, helpers: Helpers) -> int:
    import vllm
    from vllm import LLM, SamplingParams

    model = write_model(work / "model", layers=a.layers, hidden=a.hidden, experts=a.experts, top_k=a.top_k,
                        moe_intermediate=a.moe_intermediate, heads=a.heads, kv_heads=a.kv_heads,
                        head_dim=a.head_dim, dtype=a.dtype)
    kw = dict(model=str(model), dtype=a.dtype, load_format="dummy", seed=0, max_num_seqs=a.max_num_seqs,
              max_model_len=a.prompt_len + a.output_len + 64, kv_cache_memory_bytes=int(a.kv_cache_gib * 2**30))
    if not a.small:
        kw["gpu_memory_utilization"] = a.gpu_memory_utilization
    t = time.monotonic()
    engines = {}
    engines["off"] = LLM(**kw)                          # before the plugin is registered in this process
    start_off = time.monotonic() - t
    own_error = None
    if a.own:                                           # vLLM's own capture, also without any of our code
        try:
            engines["own"] = LLM(**kw, enable_return_routed_experts=True)
        except Exception as e:                          # the reason goes to the results
            own_error = f"{type(e).__name__}: {e}"[:2000]
            print(f"vLLM's own capture did not start: {own_error}", flush=True)
    os.environ["ROUTING_REPLAY_BROKER"] = helpers.fe
    os.environ["ROUTING_REPLAY_PREFIX_ROWS"] = a.prefix_rows
    import routing_replay.engines.vllm_plugin as plugin
    plugin.register()
    t = time.monotonic()
    engines["on"] = LLM(**kw)
    start_on = time.monotonic() - t
    engines["optout"] = engines["fill"] = engines["on"]
    print(f"engines started: off {start_off:.0f} s, on {start_on:.0f} s", flush=True)
    for name in ("off", "own", "on"):
        if name not in engines:
            continue
        n = engines[name].collective_rpc(_rpc_reinit_weights, args=(1234,))
        print(f"{name}: refilled {n[0] / 1e9:.2f} B parameters", flush=True)
    assert engines["on"].collective_rpc(_rpc_set_timing, args=(True,)) == [True], "plugin not active"
    info = engines["on"].collective_rpc(_rpc_stats)[0]
    pid = {"off": engines["off"].collective_rpc(_rpc_stats)[0]["pid"], "on": info["pid"]}
    pid["optout"] = pid["fill"] = pid["on"]
    if "own" in engines:
        pid["own"] = engines["own"].collective_rpc(_rpc_stats)[0]["pid"]
    print("plugin engine:", json.dumps(info), flush=True)

    rnd = random.Random(0)
    head = [rnd.randrange(256) for _ in range(min(a.shared_prefix, a.prompt_len))]
    prompts = [{"prompt_token_ids": head + [rnd.randrange(256) for _ in range(a.prompt_len - len(head))]}
               for _ in range(a.requests)]
    lens = output_lens(a.requests, a.output_len, a.output_spread)
    extra = {"off": None, "own": None, "on": {"return_routed_experts": True}, "fill": {"return_routed_experts": True},
             "optout": {"return_routed_experts": False}}
    sps = {m: [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False,
                              **({"extra_args": x} if x is not None else {})) for n in lens]
           for m, x in extra.items()}
    outputs: dict = {}
    rounds: list = []
    checks: list = []
    last_rows: dict = {}                                  # mode -> per request (rows, num_cached) of its last round

    def one_round(mode: str, idx: int) -> dict:
        llm = engines[mode]
        if mode != "off":
            llm.collective_rpc(_rpc_prefix_rows, args=("fill" if mode == "fill" else "sentinel",))
        llm.reset_prefix_cache()
        gc.collect()                                      # no collection of the last round's outputs in this one
        s0 = llm.collective_rpc(_rpc_stats)[0]
        h0 = helpers.cpu_s()
        c0 = _proc_cpu_s(pid[mode])
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sps[mode], use_tqdm=False)
        dt = time.perf_counter() - t0
        c1 = _proc_cpu_s(pid[mode])
        s1 = llm.collective_rpc(_rpc_stats)[0]
        ntok = sum(len(o.outputs[0].token_ids) for o in outs)
        assert ntok == sum(lens), (ntok, sum(lens))
        r = {"mode": mode, "round": idx, "seconds": dt, "output_tokens": ntok, "output_tok_s": ntok / dt,
             "total_tok_s": (ntok + a.requests * a.prompt_len) / dt, "engine_cpu_s": c1 - c0}
        if s1["capture"]:
            steps = s1["steps"] - s0["steps"]
            r.update(steps=steps, active_steps=s1["active_steps"] - s0["active_steps"],
                     ring_steps=s1["ring_steps"] - s0["ring_steps"],
                     copied_steps=s1.get("copied_steps", 0) - s0.get("copied_steps", 0),
                     host_us_per_step=(s1["host_ns"] - s0["host_ns"]) / steps / 1e3,
                     host_wall_us_per_step=(s1["host_wall_ns"] - s0["host_wall_ns"]) / steps / 1e3,
                     clock_us_per_step=(s1["clock_ns"] - s0["clock_ns"]) / steps / 1e3,
                     clock_wall_us_per_step=(s1["clock_wall_ns"] - s0["clock_wall_ns"]) / steps / 1e3,
                     **_quiet_steps(s0, s1),
                     timed_sections_per_step=(s1["timed_sections"] - s0["timed_sections"]) / steps,
                     hook_us_per_step=(s1["hook_ns"] - s0["hook_ns"]) / steps / 1e3,
                     engine_cpu_us_per_step=(c1 - c0) / steps * 1e6,
                     sent_msgs=s1["sent_msgs"] - s0["sent_msgs"], sent_bytes=s1["sent_bytes"] - s0["sent_bytes"],
                     opened=s1["opened"] - s0["opened"], finished=s1["finished"] - s0["finished"])
        if s1["capture"]:
            r.update(prefix_rows=s1["prefix_rows"] - s0["prefix_rows"], store_device_bytes=s1["store_device_bytes"])
        if mode in ("on", "fill"):
            r["records_wait_s"] = helpers.wait_records(a.requests, timeout_s=120)
            r["helpers_cpu_s"] = helpers.cpu_s() - h0
            chk = _check_records(helpers.npz, outs, a.prompt_len, lens, info["moe_layers"], info["top_k"])
            checks.append(chk)
            r["bytes_out_per_token"] = r["sent_bytes"] / (ntok + a.requests * a.prompt_len)
            if a.own:
                last_rows[mode] = _record_rows(helpers.npz, outs)
            helpers.clear()
        if mode == "own":
            arrs = [o.outputs[0].routed_experts for o in outs]
            got = [x for x in arrs if x is not None]
            nbytes = sum(x.nbytes for x in got)
            r.update(own_returned=len(got), own_dtype=str(got[0].dtype) if got else None,
                     own_rows=sum(len(x) for x in got), own_bytes=nbytes,
                     bytes_out_per_token=nbytes / (ntok + a.requests * a.prompt_len),
                     own_num_cached=[o.num_cached_tokens or 0 for o in outs][:4],
                     own_cached_tokens=sum(o.num_cached_tokens or 0 for o in outs))
            last_rows["own"] = [(x, o.num_cached_tokens or 0) for x, o in zip(arrs, outs)]
        outputs.setdefault(mode, []).append([list(o.outputs[0].token_ids) for o in outs])   # warm-up first
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}), flush=True)
        partial = {"plugin_engine": info, "engine_start_s": [start_off, start_on], "rounds_so_far": rounds + [r],
                   "record_checks": checks}
        (out / "bench_vllm_gpu.json").write_text(json.dumps(partial, indent=2))      # survives a timeout
        return r

    modes = MODES if a.prefix_rows == "fill" else tuple(m for m in MODES if m != "fill")
    if "own" in engines:
        modes = modes + ("own",)
    for m in modes:                                       # warm-up, not counted
        one_round(m, -1)
    order = list(modes)
    for i in range(a.rounds):
        for m in order:
            rounds.append(one_round(m, i))
        order = order[1:] + order[:1]
    # one more round of on (and fill) under each profiler asked for: cProfile by function, line_profiler by line
    for wanted, rpc, idx, name, what in ((a.profile, _rpc_profile, -2, "profile", "cProfile"),
                                         (a.line_profile, _rpc_line_profile, -3, "lines", "line_profiler")):
        for m in (("on", "fill") if "fill" in modes else ("on",)) if wanted else ():
            engines[m].collective_rpc(rpc, args=(True,))
            one_round(m, idx)
            report = engines[m].collective_rpc(rpc, args=(False,))[0]
            (out / f"{name}_{m}.txt").write_text(report)
            print(f"== {what}, engine thread, {m} round (pre_step + post_step): {name}_{m}.txt\n" + report[:6000],
                  flush=True)

    if a.step_trace:
        engines["on"].collective_rpc(_rpc_step_trace, args=(True,))
        one_round("on", -4)
        trace = engines["on"].collective_rpc(_rpc_step_trace, args=(False,))[0]
        summary = _trace_summary(trace)
        (out / "trace_on.json").write_text(json.dumps({"summary": summary, "steps": trace}))
        print(f"== step trace, on round: {summary['steps']} steps, {summary['us_per_step']:.1f} us per step wall "
              "(pre + post, without the clocks)", flush=True)
        for kind, g in sorted(summary["kinds"].items(), key=lambda kv: -kv[1]["total_us"]):
            print(f"  {kind:32s} {g['steps']:4d} steps  {g['us_per_step']:8.1f} us each (pre {g['pre_us'] / g['steps']:.1f}"
                  f", post {g['post_us'] / g['steps']:.1f})  {g['us_per_round_step']:5.1f} us of every step; "
                  f"opened {g['opened']}, finished {g['finished']}, tokens {g['tokens']}", flush=True)
    gpu = engines["on"].collective_rpc(_rpc_gpu_cost, args=([a.requests, int(info["max_num_batched_tokens"])],))[0]
    final = engines["on"].collective_rpc(_rpc_stats)[0]
    for llm in {id(e): e for e in engines.values()}.values():
        llm.llm_engine.engine_core.shutdown()

    med = lambda mode, k: statistics.median(r[k] for r in rounds if r["mode"] == mode)      # noqa: E731
    res = {
        "vllm": vllm.__version__, "device": _device_name(), "layers": a.layers, "hidden": a.hidden,
        "experts": a.experts, "top_k": a.top_k, "moe_intermediate": a.moe_intermediate, "dtype": a.dtype,
        "requests": a.requests, "prompt_len": a.prompt_len, "output_len": a.output_len, "rounds": a.rounds,
        "max_num_seqs": a.max_num_seqs, "output_spread": a.output_spread,
        "engine_start_s": {"off": start_off, "on": start_on}, "plugin_engine": info,
        "prefix_rows": a.prefix_rows, "modes": list(modes), "rounds_detail": rounds, "record_checks": checks, "gpu_cost": gpu,
        "dropped": {"copier_steps": final["copier_dropped_steps"], "producer_msgs": final["producer_dropped_msgs"]},
        "same_outputs_on_vs_off": _last(outputs, "on") == _last(outputs, "off"),
        "outputs_on_vs_off_differ": _differ(_last(outputs, "on"), _last(outputs, "off")),
        # where a difference comes from: each engine against itself (its first and last rounds: same engine,
        # same requests, other batches' timing), and the plugin's engine with capture off (optout) against both
        "outputs_differ": {"off_first_vs_last": _differ(outputs.get("off", [None])[0], _last(outputs, "off")),
                           "on_first_vs_last": _differ(outputs.get("on", [None])[0], _last(outputs, "on")),
                           "optout_vs_off": _differ(_last(outputs, "optout"), _last(outputs, "off")),
                           "on_vs_optout": _differ(_last(outputs, "on"), _last(outputs, "optout")),
                           "fill_vs_on": _differ(_last(outputs, "fill"), _last(outputs, "on"))},
    }
    for m in modes:
        res[f"{m}_output_tok_s"] = med(m, "output_tok_s")
        res[f"{m}_output_tok_s_all"] = [r["output_tok_s"] for r in rounds if r["mode"] == m]
        res[f"{m}_engine_cpu_s"] = med(m, "engine_cpu_s")
    res["loss_on_vs_off_pct"] = 100 * (1 - res["on_output_tok_s"] / res["off_output_tok_s"])
    res["loss_on_vs_optout_pct"] = 100 * (1 - res["on_output_tok_s"] / res["optout_output_tok_s"])
    res["loss_optout_vs_off_pct"] = 100 * (1 - res["optout_output_tok_s"] / res["off_output_tok_s"])
    # paired: each round's on vs the off of the same round (drift cancels)
    pairs = [(r_on["output_tok_s"], r_off["output_tok_s"]) for r_on in rounds for r_off in rounds
             if r_on["mode"] == "on" and r_off["mode"] == "off" and r_on["round"] == r_off["round"]]
    res["loss_on_vs_off_pct_per_round"] = [100 * (1 - x / y) for x, y in pairs]
    on_rounds = [r for r in rounds if r["mode"] == "on"]
    fill_rounds = [r for r in rounds if r["mode"] == "fill"]
    if fill_rounds:
        res["loss_fill_vs_off_pct"] = 100 * (1 - res["fill_output_tok_s"] / res["off_output_tok_s"])
        res["loss_fill_vs_on_pct"] = 100 * (1 - res["fill_output_tok_s"] / res["on_output_tok_s"])
        res["host_us_per_step_fill"] = statistics.median(r["host_us_per_step"] for r in fill_rounds)
        res["host_us_per_step_fill_all"] = [r["host_us_per_step"] for r in fill_rounds]
        res["host_wall_us_per_step_fill"] = statistics.median(r["host_wall_us_per_step"] for r in fill_rounds)
        res["prefix_rows_per_fill_round"] = statistics.median(r["prefix_rows"] for r in fill_rounds)
    res["steps_per_round"] = statistics.median(r["steps"] for r in on_rounds)
    res["opens_finishes_per_step_on"] = statistics.median((r["opened"] + r["finished"]) / r["steps"] for r in on_rounds)
    res["host_us_per_step_on"] = statistics.median(r["host_us_per_step"] for r in on_rounds)
    res["host_us_per_step_on_all"] = [r["host_us_per_step"] for r in on_rounds]
    res["host_wall_us_per_step_on"] = statistics.median(r["host_wall_us_per_step"] for r in on_rounds)
    res["host_wall_us_per_step_optout"] = med("optout", "host_wall_us_per_step")
    res["store_device_bytes"] = max(r["store_device_bytes"] for r in rounds if "store_device_bytes" in r)
    res["hook_us_per_step_on"] = statistics.median(r["hook_us_per_step"] for r in on_rounds)
    res["host_us_per_step_optout"] = med("optout", "host_us_per_step")
    # the timing clocks' own cost (one read pair per timed section, measured in place): the plugin without them
    for m in modes:
        if m in ("off", "own"):                           # engines without the plugin
            continue
        res[f"clock_us_per_step_{m}"] = med(m, "clock_us_per_step")
        res[f"clock_wall_us_per_step_{m}"] = med(m, "clock_wall_us_per_step")
        res[f"timed_sections_per_step_{m}"] = med(m, "timed_sections_per_step")
        res[f"host_net_us_per_step_{m}"] = med(m, "host_us_per_step") - res[f"clock_us_per_step_{m}"]
        res[f"host_wall_net_us_per_step_{m}"] = med(m, "host_wall_us_per_step") - res[f"clock_wall_us_per_step_{m}"]
        qs = [r for r in rounds if r["mode"] == m and r["round"] >= 0 and r.get("quiet_steps")]
        if qs:
            res[f"quiet_steps_per_round_{m}"] = statistics.median(r["quiet_steps"] for r in qs)
            res[f"quiet_net_us_per_step_{m}"] = statistics.median(r["quiet_net_us_per_step"] for r in qs)
            res[f"quiet_wall_net_us_per_step_{m}"] = statistics.median(r["quiet_wall_net_us_per_step"] for r in qs)
    res["engine_cpu_us_per_step"] = {m: 1e6 * res[f"{m}_engine_cpu_s"] / res["steps_per_round"] for m in modes}
    res["records_wait_s"] = statistics.median(r["records_wait_s"] for r in on_rounds)
    res["helpers_cpu_s_per_round"] = statistics.median(r["helpers_cpu_s"] for r in on_rounds)
    res["memory"] = {"device_cache_bytes": final["cache_device_bytes"],
                     "device_copier_bytes": final["copier_device_bytes"],
                     "pinned_host_bytes": final["pinned_host_bytes"]}
    if a.own:
        res["own"] = _own_summary(rounds, last_rows, own_error, a.prompt_len)
    (out / "bench_vllm_gpu.json").write_text(json.dumps(res, indent=2))
    _print_summary(res)
    ok = all(c["n_bad"] == 0 and c["records"] == a.requests for c in checks) and not any(res["dropped"].values())
    if not ok:
        print("FAILED: records incomplete or dropped", json.dumps(checks)[:2000], flush=True)
    return 0 if ok else 1


def _record_rows(npz: Path, outs) -> list:
    """Per request (in the order of outs): (prompt + generation rows as one array, num_cached) of its record."""
    import numpy as np

    from routing_replay.consumer import load_records

    recs = load_records(npz)
    rows = []
    for o in outs:
        r = recs.get(o.request_id)
        rows.append(None if r is None else
                    (np.concatenate([r.prompt_routed_experts, r.routed_experts]), r.num_cached_tokens))
    return rows


def _own_summary(rounds: list, last_rows: dict, error: str | None, prompt_len: int) -> dict:
    """vLLM's own capture against ours: throughput, engine CPU, bytes out per token, and its rows (prefix-cached
    ones apart) against the rows of our `fill` records of the same requests (another engine with the same weights
    and the same workload: rows can differ at near-ties of the router logits, in either part)."""
    import numpy as np

    if error is not None:
        return {"ran": False, "error": error}
    out: dict = {"ran": True}
    for m in ("off", "own", "on", "fill", "optout"):
        rs = [r for r in rounds if r["mode"] == m and r["round"] >= 0]
        if not rs:
            continue
        out[m] = {"output_tok_s": statistics.median(r["output_tok_s"] for r in rs),
                  "engine_cpu_s": statistics.median(r["engine_cpu_s"] for r in rs)}
        if "bytes_out_per_token" in rs[0]:
            out[m]["bytes_out_per_token"] = statistics.median(r["bytes_out_per_token"] for r in rs)
    own = [r for r in rounds if r["mode"] == "own"]
    if own:
        out["own_dtype"], out["own_returned"] = own[-1]["own_dtype"], own[-1]["own_returned"]
        out["own_rows"], out["own_cached_tokens"] = own[-1]["own_rows"], own[-1]["own_cached_tokens"]
    for ref in ("fill", "on"):
        if "own" not in last_rows or ref not in last_rows:
            continue
        agree = {"cached": [0, 0], "computed": [0, 0]}
        cached_zero_rows = 0
        for mine, theirs in zip(last_rows["own"], last_rows[ref]):
            x, own_cached = mine
            if x is None or theirs is None:
                continue
            y, cached = theirs
            n = min(len(x), len(y))
            xs, ys = np.sort(x[:n].astype(np.int64), axis=-1), np.sort(y[:n].astype(np.int64), axis=-1)
            same = (xs == ys).all(axis=(1, 2))
            c = min(own_cached, n)
            agree["cached"][0] += int(same[:c].sum())
            agree["cached"][1] += c
            agree["computed"][0] += int(same[c:].sum())
            agree["computed"][1] += n - c
            cached_zero_rows += int((x[:c] == 0).all(axis=(1, 2)).sum())
        out[f"rows_own_vs_{ref}"] = {k: {"same": v[0], "of": v[1]} for k, v in agree.items()}
        out[f"own_cached_rows_all_zero"] = cached_zero_rows
    return out


def _last(outputs: dict, mode: str):
    """A mode's outputs of its last round (None if it ran none)."""
    runs = outputs.get(mode)
    return runs[-1] if runs else None


def _differ(a, b) -> dict:
    """How two modes' outputs differ: requests whose tokens differ, and where the first difference comes."""
    if a is None or b is None:
        return {}
    firsts = [next((j for j, (x, y) in enumerate(zip(s, t)) if x != y), min(len(s), len(t)))
              for s, t in zip(a, b) if s != t]
    return {"requests": len(firsts), "of": len(a), "first_token_min": min(firsts, default=None),
            "first_token_median": statistics.median(firsts) if firsts else None}


def _device_name() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20)
        return out.stdout.strip() or "cpu"
    except (OSError, subprocess.SubprocessError):
        return "cpu"


def _print_summary(r: dict) -> None:
    print(f"\nvLLM {r['vllm']} on {r['device']}: {r['layers']} x Qwen3-MoE layer (hidden {r['hidden']}, "
          f"{r['experts']} experts, top-{r['top_k']}, MoE intermediate {r['moe_intermediate']}), {r['dtype']}; "
          f"{r['requests']} requests x ({r['prompt_len']} prompt + {r['output_len']} output) tokens; "
          f"{r['rounds']} rounds per mode (medians)")
    if r["output_spread"] or r["max_num_seqs"] < r["requests"]:
        print(f"  continuous batching: max_num_seqs {r['max_num_seqs']}, output lengths spread "
              f"{r['output_spread']:.2f} (down to {round(r['output_len'] * (1 - r['output_spread']))}); "
              f"opens + finishes per step, on: {r['opens_finishes_per_step_on']:.2f}")
    if "own" in r:
        print("  vLLM's own capture against ours: " + json.dumps(r["own"]))
    for m in r["modes"]:
        xs = r[f"{m}_output_tok_s_all"]
        print(f"  {m:7s}: {r[f'{m}_output_tok_s']:9.0f} output tok/s  (rounds {min(xs):.0f}..{max(xs):.0f})")
    print(f"  lost, on vs off: {r['loss_on_vs_off_pct']:.2f} %  (per round: "
          f"{', '.join(f'{x:.2f}' for x in r['loss_on_vs_off_pct_per_round'])}); on vs optout: "
          f"{r['loss_on_vs_optout_pct']:.2f} %; optout vs off: {r['loss_optout_vs_off_pct']:.2f} %")
    if "fill" in r["modes"]:
        print(f"  fill (prefix store on): lost vs off {r['loss_fill_vs_off_pct']:.2f} %, vs on {r['loss_fill_vs_on_pct']:.2f} %;"
              f" host per step {r['host_us_per_step_fill']:.1f} us; {r['prefix_rows_per_fill_round']:.0f} prefix "
              f"rows filled per round")
    print(f"  engine started with ROUTING_REPLAY_PREFIX_ROWS={r['prefix_rows']}: store "
          f"{r['store_device_bytes'] / 2**20:.1f} MiB on the device, written inside the graphs in every mode but off")
    print(f"  host per step (engine thread, capture on): pre/post {r['host_us_per_step_on']:.1f} us + hooks "
          f"{r['hook_us_per_step_on']:.1f} us (wall: pre/post {r['host_wall_us_per_step_on']:.1f} us, opt-out "
          f"{r['host_wall_us_per_step_optout']:.1f} us); opt-out {r['host_us_per_step_optout']:.1f} us; "
          f"{r['steps_per_round']:.0f} steps per round")
    print("  the same without the timing clocks' own cost (one thread-clock + wall-clock read pair per timed "
          "section, measured in place), CPU / wall: " + ", ".join(
              f"{m} {r[f'host_net_us_per_step_{m}']:.1f} / {r[f'host_wall_net_us_per_step_{m}']:.1f} us (clocks "
              f"{r[f'clock_us_per_step_{m}']:.1f} / {r[f'clock_wall_us_per_step_{m}']:.1f} us, "
              f"{r[f'timed_sections_per_step_{m}']:.2f} sections per step)" for m in r["modes"]
              if m not in ("off", "own")))
    quiet = [m for m in r["modes"] if f"quiet_net_us_per_step_{m}" in r]
    if quiet:
        print("  quiet steps only (nothing opened, finished or preempted: one step of the running batch), the same "
              "without the clocks, CPU / wall: " + ", ".join(
                  f"{m} {r[f'quiet_net_us_per_step_{m}']:.1f} / {r[f'quiet_wall_net_us_per_step_{m}']:.1f} us "
                  f"({r[f'quiet_steps_per_round_{m}']:.0f} of {r['steps_per_round']:.0f} steps)" for m in quiet))
    print("  engine-core CPU per step: " + ", ".join(f"{m} {v:.0f} us" for m, v in r["engine_cpu_us_per_step"].items()))
    for n, g in r["gpu_cost"].items():
        if isinstance(g, dict):
            fill = (f"cache write {g['fused_cache_write_us']:.2f} (step stamp {g['stamp_us']:.2f} of it)"
                    if g.get("stamp_us") else f"fill {g['fill_minus_one_us']:.2f} + cache write "
                    f"{g['fused_cache_write_us']:.2f}")
            print(f"  GPU per step at {n} tokens: {fill} + snapshot {g['snapshot_us']:.2f} = "
                  f"{g['compute_stream_us']:.2f} us compute stream (+ prefix store write {g['store_write_us']:.2f} us "
                  f"in fill mode); D2H {g['d2h_side_stream_us']:.1f} us on the side stream ({g['bytes_per_step']} B)")
            if "stamp_slot_write_us" in g:
                other = {"triton": "torch", "torch": "triton"}[g["ring_kernels"]]
                print(f"    step ring: stamp add + slot write {g['stamp_slot_write_us']:.2f} us ({g['ring_kernels']}"
                      f" kernels, the engine's)" + (f", {g['stamp_slot_write_other_us']:.2f} us with the {other} "
                      "ones" if "stamp_slot_write_other_us" in g else "")
                      + f"; a ring step's compute stream is the cache write alone, {g['fused_cache_write_us']:.2f} us "
                      "(no snapshot runs for it)")
    m = r["memory"]
    dev, cache = m["device_cache_bytes"] + m["device_copier_bytes"], m["device_cache_bytes"]
    print(f"  memory: device {dev / 2**20:.1f} MiB (cache {cache / 2**20:.1f} + staging "
          f"{m['device_copier_bytes'] / 2**20:.1f}), pinned host {m['pinned_host_bytes'] / 2**20:.1f} MiB")
    checks = r["record_checks"]
    load = checks[0]["expert_load"] if checks else {}
    print(f"  records: {[c['records'] for c in checks]} per on-round, bad {sum(c['n_bad'] for c in checks)}, "
          f"awaited {r['records_wait_s']:.2f} s after generate(); expert load {load}; "
          f"outputs on == off: {r['same_outputs_on_vs_off']} {r['outputs_on_vs_off_differ']}")
    print("  outputs differ: " + "; ".join(f"{k} {v.get('requests')}/{v.get('of')} first at {v.get('first_token_min')}"
                                           for k, v in r["outputs_differ"].items() if v))

if __name__ == "__main__":
    sys.exit(main())
