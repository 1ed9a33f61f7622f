"""The plugin's real per-step engine-thread work (WorkerCapture.pre_step/post_step), without vLLM and without a GPU.

Drives the worker's own pre_step/post_step with scheduler outputs and a Model Runner V1 batch shaped like vLLM's
(the fields the worker reads: tests/standins.StandinEngine, the stand-in the worker's tests run too), over the real
RoutingCache, AsyncCopier and Producer (publishing to an endpoint nobody binds: its thread still takes, copies and
encodes every delta; nothing leaves). Between steps the "routers" write every layer's top-k (the forward; not timed)
and, with --evict-mib, the probe walks a buffer that size and a few thousand Python objects, so that each step
starts with the caches as a forward left them: inside vLLM the same Python runs several times slower than in a warm
loop (docs/PERFORMANCE.md), and a warm loop would hide what a change saves there. Timing: the pre_step/post_step
calls as a whole, timed from outside (`calls_us`, CPU; `calls_wall_us`: early exits and call overhead included, the
clocks' own cost measured in place and subtracted); compare changes on these, which nothing can move out of view.
--worker-timing adds the worker's own figures (WorkerStats.host_ns, what bench/vllm_gpu.py reads inside vLLM;
`net_us` without its clocks), whose clocks then also count in `calls_us`.

Modes: `on` (every request captured), `optout` (every request opted out), `optout-fill` (opted out, in an engine
whose prefix store exists: ROUTING_REPLAY_PREFIX_ROWS=fill), `fill` (captured, with that store: with --churn-hits
the new requests' prefix-cache hits are gathered from it). Graph mode (hooks replayed from CUDA graphs: the -1
fill in pre_step) unless --eager.

    python bench/worker_step_probe.py [--mode on] [--requests 256] [--layers 16] [--steps 1000] [--evict-mib 64]
                                      [--device cpu|cuda] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.standins import StandinEngine  # noqa: E402

MODES = ("on", "optout", "optout-fill", "fill")


def _timed(pieces: dict, name: str, fn):
    """fn, with its wall time added to pieces[name] (the clock read pair's own cost taken out, measured in place)."""
    pc = time.perf_counter_ns
    pieces[name] = 0

    def wrapper(*args, **kwargs):
        w0 = pc()
        try:
            return fn(*args, **kwargs)
        finally:
            w1 = pc()
            pieces[name] += (w1 - w0) - (pc() - w1)
    wrapper.__wrapped__ = fn
    return wrapper


_READ_PAIR: list = []       # (thread CPU ns, wall ns) one read pair costs: the least of many, measured once


def _read_pair() -> tuple:
    if not _READ_PAIR:
        tt, pc = time.thread_time_ns, time.perf_counter_ns
        best = [1 << 62, 1 << 62]
        for _ in range(2000):
            t1, w1 = tt(), pc()
            t2, w2 = tt(), pc()
            best = [min(best[0], t2 - t1), min(best[1], w2 - w1)]
        _READ_PAIR.extend(best)
    return _READ_PAIR


def _outside(fn, so, acc: list) -> None:
    """fn(so) timed from outside: thread CPU and wall ns added to acc, one read pair's cost taken out (its least,
    measured once: a second pair read per call was preempted now and then on a loaded machine, and taking that
    out could leave less than nothing)."""
    tt, pc = time.thread_time_ns, time.perf_counter_ns
    pair = _read_pair()
    t0, w0 = tt(), pc()
    fn(so)
    t1, w1 = tt(), pc()
    acc[0] += (t1 - t0) - pair[0]
    acc[1] += (w1 - w0) - pair[1]


def _forward(args) -> None:
    """--eager: every MoE layer's router hands its top-k to its hook, in layer order, as in an eager forward."""
    hooks, topk_ids = args
    for hook in hooks:
        hook(topk_ids)


def run(mode: str, n: int, layers: int, top_k: int, steps: int, evict_mib: int, device: str, eager: bool,
        worker_timing: bool = False, prompt_len: int = 16, pieces: bool = False, stamp: bool = False,
        ring: bool = False, churn: int = 0, churn_prompt: int = 512, churn_output: int = 256,
        churn_same_ids: bool = False, on_producer=None, churn_optout: int = 0, churn_hits: int = 0,
        on_step=None, forward=None, layout=None, optout_first: frozenset = frozenset()) -> dict:
    """One probe run; the result as a dict. churn_hits H: each new request of --churn starts with H prefix-cache
    hit tokens (its blocks shared with the others; mode `fill` gathers their rows from the store). churn_optout K:
    every K-th new request of --churn is not captured (its sampling params opt out), so captured and uncaptured
    requests share steps. churn_same_ids: a new request takes the id of the one it replaces (ids that callers
    reuse). on_producer(producer) is called once the worker's producer exists (tests watch its calls);
    on_step(step, worker) after each step's post_step. forward(step, hooks, topk_ids): instead of every hook
    in layer order (--eager) or every layer's RoutingCache.record (graph mode) (tests: a forward that misses a
    layer, ids that differ per step). layout(step, ids), without churn: the steps after
    the first schedule the (engine id, tokens) pairs it returns, in that batch order (tests: a batch the runner
    reorders, requests left out of a step, a chunk larger than a ring slot); optout_first: the indices of the first
    step's requests that are not captured."""
    dev = torch.device(device)
    if dev.type == "cpu":     # the snapshot is a CPU copy here: one thread, as vLLM's engine thread makes it (with
        torch.set_num_threads(1)    # step stamps, 17 layers of rows pass torch's parallel grain and go to OpenMP)
    eng = StandinEngine(mode, n, layers, top_k, device=dev, eager=eager, prompt_len=prompt_len, stamp=stamp,
                        ring=ring, churn=churn, churn_prompt=churn_prompt, churn_output=churn_output,
                        churn_same_ids=churn_same_ids, churn_optout=churn_optout, churn_hits=churn_hits,
                        layout=layout, optout_first=optout_first, on_producer=on_producer)
    cap, stamp, ring = eng.cap, eng.stamp, eng.ring
    parts: dict = {}
    if pieces:                                      # the calls pre_step/post_step make, timed one by one (wall)
        import routing_replay.engines.vllm_plugin.runners as wmod       # (the step paths read the layout here)
        cap.cache.fill_step = _timed(parts, "fill_step", cap.cache.fill_step)
        cap.cache.flush = _timed(parts, "cache_flush", cap.cache.flush)
        cap.copier.submit = _timed(parts, "copier_submit", cap.copier.submit)
        cap.copier.mark_batch = _timed(parts, "mark_batch", cap.copier.mark_batch)
        cap.producer.publish_rows = _timed(parts, "publish_rows", cap.producer.publish_rows)
        cap.flush = cap.path.flush = cap.requests.flush = cap.prefix.flush = _timed(parts, "flush_total",
                                                                               cap.flush)
        cap.producer.open_many = _timed(parts, "producer_open", cap.producer.open_many)
        cap.producer.end_many = _timed(parts, "producer_finish", cap.producer.end_many)
        wmod.step_layout = _timed(parts, "step_layout", wmod.step_layout)
    big = np.ones(max(1, evict_mib) * 2**20 // 8) if evict_mib else None
    junk = [{"a": i} for i in range(20000)] if evict_mib else []
    cap.timing = worker_timing
    warm = min(100, steps // 4)
    t_run = time.perf_counter()
    s0 = None
    outer = [0, 0]                                  # the calls as the engine sees them (early exits included)
    paced = 0                                       # --step-ring: waits for the producer's thread (see below)
    hooked = [0, 0]                                 # --eager: the router hooks, timed the same way
    for step in range(steps + warm):
        if step == warm:
            st = cap.stats
            s0 = (st.steps, st.host_ns, st.clock_ns, st.host_wall_ns, st.clock_wall_ns, st.timed_sections)
            outer = [0, 0]
            hooked = [0, 0]
            for name in parts:
                parts[name] = 0
        so = eng.schedule(step)
        _outside(cap.pre_step, so, outer)
        topk = eng.topk[:eng.lay_out(step, so)]       # the runner's batch for this step, then the forward
        if forward is not None:
            forward(step, eng.hooks if eng.hooks is not None else eng.records, topk)
        elif eng.hooks is not None:
            _outside(_forward, (eng.hooks, topk), hooked)
        else:                               # graph mode: the cache's record per layer, as the replay writes it
            for record in eng.records:
                record(topk)
        _outside(cap.post_step, so, outer)
        if on_step is not None:
            on_step(step, cap)
        if ring:        # an engine's forward gives the producer's thread time; this loop's does not: wait (untimed)
            while cap.producer.queued_msgs > 1:         # rather than run a ring's worth of steps ahead of it
                if not cap.producer.healthy:            # (a ring read lost, never wrong: an encode error here)
                    cap.producer._check()               # its thread failed: raises with the reason
                time.sleep(0.0002)
                paced += 1
        if big is not None:
            big += 1.0
            for d in junk[::3]:
                d.get("a")
    cap.flush()
    deadline = time.monotonic() + 60               # the producer's thread took (copied, encoded) every delta
    while cap.producer.queued_msgs and time.monotonic() < deadline and cap.producer.healthy:
        time.sleep(0.01)
    cap.producer._check()
    ok = cap.producer.queued_msgs == 0
    wall_s = time.perf_counter() - t_run
    st = cap.stats
    d = [b - a for a, b in zip(s0, (st.steps, st.host_ns, st.clock_ns, st.host_wall_ns, st.clock_wall_ns,
                                     st.timed_sections))]
    k = d[0]
    res = {"mode": mode, "requests": n, "layers": layers, "top_k": top_k, "steps": k, "evict_mib": evict_mib,
           "device": device, "graph_mode": not eager, "step_stamp": stamp, "step_ring": ring,
           "ring_steps": cap.stats.ring_steps, "copied_steps": cap.stats.copied_steps, "host_steps": cap.stats.host_steps,
           "encode_errors": cap.producer.stats.encode_errors, "paced_waits": paced,
           "stamps_checked": cap.batch.stamps.steps if stamp else 0,
           "calls_us": round(outer[0] / k / 1e3, 2), "calls_wall_us": round(outer[1] / k / 1e3, 2),
           **({"hooks_us": round(hooked[0] / k / 1e3, 2), "hooks_wall_us": round(hooked[1] / k / 1e3, 2),
               "plugin_us": round((outer[0] + hooked[0]) / k / 1e3, 2)} if eager else {}),
           "churn": churn, "opened": st.opened, "finished": st.finished,
           "rows": st.rows, "prefix_rows": st.prefix_rows, "active_steps": st.active_steps,
           "producer_queued_msgs": cap.producer.stats.queued_msgs,
           "producer_drained": ok, "run_s": round(wall_s, 1)}
    if pieces:
        res["pieces_wall_us"] = {name: round(v / k / 1e3, 2) for name, v in parts.items()}
        wmod.step_layout = wmod.step_layout.__wrapped__
    if worker_timing:
        res.update(pre_post_us=round(d[1] / k / 1e3, 2), clocks_us=round(d[2] / k / 1e3, 2),
                   net_us=round((d[1] - d[2]) / k / 1e3, 2), wall_us=round(d[3] / k / 1e3, 2),
                   net_wall_us=round((d[3] - d[4]) / k / 1e3, 2), sections_per_step=round(d[5] / k, 3),
                   quiet_steps=st.quiet_steps, quiet_sections=st.quiet_sections)      # (whole run, warm-up too)
        if st.quiet_steps:
            res["quiet_net_wall_us"] = round((st.quiet_host_wall_ns - st.quiet_clock_wall_ns) / st.quiet_steps / 1e3, 2)
    cap.producer.close(0.1)                         # nobody listens: what it holds goes with it
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=MODES + ("all",), default="all")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--evict-mib", type=int, default=64, help="buffer walked between steps (0: warm caches)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--eager", action="store_true", help="hooks run in Python every step (CPU / enforce_eager)")
    ap.add_argument("--step-stamp", action="store_true",
                    help="graph mode with step stamps (the plugin's default, ROUTING_REPLAY_STEP_STAMP=on); "
                         "without it the probe measures the -1 fill before every step (=off)")
    ap.add_argument("--step-ring", action="store_true",
                    help="with --step-stamp: the step ring too (ROUTING_REPLAY_STEP_STAMP=ring): decode steps read "
                         "from the ring, nothing launched on the engine thread")
    ap.add_argument("--worker-timing", action="store_true",
                    help="also the worker's own timing (WorkerStats.host_ns, as bench/vllm_gpu.py reads it in vLLM); "
                         "its clocks then add to calls_us")
    ap.add_argument("--pieces", action="store_true",
                    help="also time each call pre_step/post_step make (wall; adds their wrappers' cost to calls_us)")
    ap.add_argument("--churn", type=int, default=0, metavar="N",
                    help="per step, N requests finish and N new ones start with a prefill (bench/vllm_gpu.py's "
                         "rounds: 256 requests opened and finished in about 262 steps is about 1)")
    ap.add_argument("--churn-prompt", type=int, default=512, help="--churn: the new requests' prompt tokens")
    ap.add_argument("--churn-output", type=int, default=256, help="--churn: the finished requests' output ids")
    ap.add_argument("--churn-hits", type=int, default=0, metavar="H",
                    help="--churn: the new requests' prefix-cache hit tokens (mode fill gathers their rows)")
    ap.add_argument("--churn-optout", type=int, default=0, metavar="K",
                    help="--churn: every K-th new request is not captured (0: all are)")
    ap.add_argument("--json", help="write the results here too")
    a = ap.parse_args(argv)
    logging.disable(logging.WARNING)                # the producer reports, every few seconds, that nobody listens
    out = []
    for m in (MODES if a.mode == "all" else (a.mode,)):
        r = run(m, a.requests, a.layers, a.top_k, a.steps, a.evict_mib, a.device, a.eager, a.worker_timing, pieces=a.pieces,
                stamp=a.step_stamp, ring=a.step_ring, churn=a.churn, churn_prompt=a.churn_prompt,
                churn_output=a.churn_output, churn_optout=a.churn_optout, churn_hits=a.churn_hits)
        out.append(r)
        print(json.dumps(r), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    warm = min(100, a.steps // 4)
    bad = [r for r in out if not r["producer_drained"] or r["encode_errors"]
           or (r["mode"] in ("on", "fill") and r["active_steps"] != r["steps"] + warm)]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
