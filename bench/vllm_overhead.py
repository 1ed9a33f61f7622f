"""Measure what routing capture costs a real vLLM engine: generate throughput with capture on vs off, same
engine, same workload, rounds interleaved; and the host time the plugin adds to each engine step.

Default workload: 64 concurrent requests, 256-token prompts (random byte tokens, no shared prefix), 128 output
tokens each (ignore_eos), greedy, on the tiny random-weight Qwen3-MoE model (routing_replay.apps.models).
"Off" rounds opt every request out (`extra_args={"return_routed_experts": False}`): the plugin is loaded and
its hooks are installed, but no row is copied and no message is sent. "On" rounds capture every request.

The engine runs in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so the worker's counters can be read: host time
per step = pre_step + post_step (engine thread, around `Worker.execute_model`) + the router hooks (inside the
forward). With --broker external the broker and consumer run as `routing-replay` CLI processes; with
--broker embedded they run inside the engine (see docs/VLLM.md).

    python bench/vllm_overhead.py [--rounds 3] [--broker embedded|external] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", default=None,
                    help="the generated model's directory (default: routing-replay-models/qwen3_moe[_<N>l] in the "
                         "temp dir)")
    ap.add_argument("--num-layers", type=int, default=4,
                    help="MoE layers of the generated Qwen3-MoE (the issue's bench: 4; Qwen3-30B-A3B has 48)")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5, help="on/off pairs (interleaved), after one warm-up pair")
    ap.add_argument("--broker", choices=["embedded", "external", "embedded-threads"], default="embedded",
                    help="embedded-threads: the embedded broker + consumer as threads of the engine process "
                         "(the plugin's first design), for comparison")
    ap.add_argument("--pin", action="store_true",
                    help="engine on CPU 0 only (VLLM_CPU_OMP_THREADS_BIND=0); external broker and consumer on CPU 1")
    ap.add_argument("--json", default=None, help="also write the results here")
    a = ap.parse_args(argv)
    if a.num_layers < 1:
        ap.error("--num-layers must be at least 1")
    if a.model_dir is None:
        a.model_dir = os.path.join(tempfile.gettempdir(), "routing-replay-models",
                                   "qwen3_moe" if a.num_layers == 4 else f"qwen3_moe_{a.num_layers}l")

    work = Path(tempfile.mkdtemp(prefix="rr-bench-"))
    procs = []
    pin = []
    if a.pin:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0"
        pin = ["taskset", "-c", "1"]
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["ROUTING_REPLAY_REQUESTS"] = "all"
    npz_dir = work / "npz"
    if a.broker in ("embedded", "embedded-threads"):
        os.environ["ROUTING_REPLAY_BROKER"] = "embedded"
        os.environ["ROUTING_REPLAY_NPZ_DIR"] = str(npz_dir)
        if a.broker == "embedded-threads":
            import routing_replay.engines.vllm_plugin.pipeline as pipeline
            pipeline.PipelineProcess = _ThreadPipeline
    else:
        fe, be = f"tcp://127.0.0.1:{_free_port()}", f"tcp://127.0.0.1:{_free_port()}"
        cli = pin + [sys.executable, "-m", "routing_replay.apps.cli"]
        procs.append(subprocess.Popen(cli + ["broker", "--frontend", fe, "--backend", be, "--log-level", "warning"]))
        procs.append(subprocess.Popen(cli + ["consume", "--connect", be, "--npz-dir", str(npz_dir),
                                             "--log-level", "warning", "--no-progress"]))
        os.environ["ROUTING_REPLAY_BROKER"] = fe
        os.environ.pop("ROUTING_REPLAY_NPZ_DIR", None)
    try:
        return _run(a, npz_dir, procs)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(10)
        shutil.rmtree(work, ignore_errors=True)


class _ThreadPipeline:
    """Stand-in for PipelineProcess: the same broker + consumer, as threads of this (the engine's) process."""

    def __init__(self, npz_dir=None, serve=None, in_flight=None, on_restart=None):
        import uuid

        import zmq

        from routing_replay.broker import Broker
        from routing_replay.consumer import Consumer

        self.dir = tempfile.mkdtemp(prefix="rr-threads-")
        self.frontend = f"ipc://{self.dir}/frontend"
        self._ctx = zmq.Context()
        backend = f"inproc://rr-{uuid.uuid4().hex[:8]}"
        self._broker = Broker(self.frontend, backend, context=self._ctx, stats_interval_s=60.0).start()
        self._consumer = Consumer(backend, npz_dir=npz_dir, serve=serve, context=self._ctx,
                                  stats_interval_s=60.0).start()
        self.alive = True

    def close(self, timeout_s: float = 30.0) -> None:
        from routing_replay.engines.vllm_plugin.pipeline import _wait_idle

        if self.alive:
            self.alive = False
            _wait_idle(self._consumer, timeout_s)
            self._consumer.close()
            self._broker.close()
            shutil.rmtree(self.dir, ignore_errors=True)


def micro(num_layers: int = 4, top_k: int = 2, reqs: int = 64, steps: int = 2000) -> dict:
    """Warm-cache cost of the plugin's own engine-thread work for one decode step of `reqs` captured requests, outside
    vLLM: the real WorkerCapture.pre_step/post_step and router hooks of an eager CPU engine, as
    bench/worker_step_probe.py drives them (--eager --evict-mib 0; its producer publishes to an endpoint nobody
    binds). Returns µs per step: pre_step + post_step as called from outside (CPU), and the hooks."""
    import logging

    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:
        sys.path.append(here)
    from worker_step_probe import run

    was = logging.root.manager.disable
    logging.disable(logging.WARNING)            # (the producer reports that nobody listens)
    try:
        r = run("on", reqs, num_layers, top_k, steps, 0, "cpu", True)
    finally:
        logging.disable(was)
    if not r["producer_drained"] or r["encode_errors"] or r["host_steps"] != r["active_steps"]:
        raise RuntimeError(f"the warm-cache probe did not run the eager host path: {r}")
    return {"pre_step + post_step": r["calls_us"], f"hooks x{num_layers}": r["hooks_us"]}


def _run(a, npz_dir: Path, procs: list) -> int:
    from routing_replay.apps.models import make_tiny_model

    model = make_tiny_model(a.model_dir, "qwen3_moe", num_layers=a.num_layers)
    import vllm
    from vllm import LLM, SamplingParams

    import routing_replay.engines.vllm_plugin as plugin

    plugin.register()          # no-op if vLLM already loaded it
    llm = LLM(model=str(model), dtype="float32", enforce_eager=True, max_model_len=a.prompt_len + a.output_len + 16,
              kv_cache_memory_bytes=512 << 20, distributed_executor_backend="uni", seed=0)
    worker = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker
    cap = plugin.capture_of(worker)
    cap.timing = cap.binding.timing = True
    rnd = random.Random(0)
    prompts = [{"prompt_token_ids": [rnd.randrange(256) for _ in range(a.prompt_len)]} for _ in range(a.requests)]

    def one_round(capture: bool) -> dict:
        sp = SamplingParams(max_tokens=a.output_len, temperature=0.0, ignore_eos=True,
                            extra_args={"return_routed_experts": capture})
        st, b = cap.stats, cap.binding
        s0, h0, k0, c0 = st.steps, st.host_ns, b.hook_ns, st.clock_ns
        e0 = time.thread_time()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        dt = time.perf_counter() - t0
        engine_cpu = time.thread_time() - e0
        steps = st.steps - s0
        out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        return {"capture": capture, "seconds": dt, "steps": steps, "output_tok_s": out_tokens / dt,
                "total_tok_s": (out_tokens + a.requests * a.prompt_len) / dt,
                "host_us_per_step": (st.host_ns - h0) / steps / 1e3, "hook_us_per_step": (b.hook_ns - k0) / steps / 1e3,
                "clock_us_per_step": (st.clock_ns - c0) / steps / 1e3,
                "engine_thread_cpu_us_per_step": engine_cpu / steps * 1e6}

    loadavg_start = os.getloadavg()[0]
    one_round(False), one_round(True)                      # warm-up
    rounds = []
    for i in range(a.rounds):
        order = (False, True) if i % 2 == 0 else (True, False)
        for c in order:
            rounds.append(one_round(c))
            print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in rounds[-1].items()}),
                  flush=True)
    llm.llm_engine.engine_core.shutdown()

    off = [r for r in rounds if not r["capture"]]
    on = [r for r in rounds if r["capture"]]
    med = lambda rs, k: statistics.median(r[k] for r in rs)          # noqa: E731
    res = {
        "vllm": vllm.__version__, "broker": a.broker, "pin": a.pin, "num_layers": a.num_layers,
        "loadavg_start": loadavg_start,
        "requests": a.requests,
        "prompt_len": a.prompt_len,
        "output_len": a.output_len, "rounds": a.rounds,
        "off_output_tok_s": med(off, "output_tok_s"), "on_output_tok_s": med(on, "output_tok_s"),
        "off_total_tok_s": med(off, "total_tok_s"), "on_total_tok_s": med(on, "total_tok_s"),
        "steps_per_round": med(on, "steps"),
        "plugin_host_us_per_step_on": med(on, "host_us_per_step") + med(on, "hook_us_per_step"),
        "pre_post_us_per_step_on": med(on, "host_us_per_step"), "hooks_us_per_step_on": med(on, "hook_us_per_step"),
        "plugin_host_us_per_step_off": med(off, "host_us_per_step") + med(off, "hook_us_per_step"),
        "clock_us_per_step_on": med(on, "clock_us_per_step"), "clock_us_per_step_off": med(off, "clock_us_per_step"),
        "engine_thread_cpu_us_per_step_off": med(off, "engine_thread_cpu_us_per_step"),
        "engine_thread_cpu_us_per_step_on": med(on, "engine_thread_cpu_us_per_step"),
        "off_output_tok_s_range": [min(r["output_tok_s"] for r in off), max(r["output_tok_s"] for r in off)],
        "on_output_tok_s_range": [min(r["output_tok_s"] for r in on), max(r["output_tok_s"] for r in on)],
    }
    res["throughput_loss_pct"] = 100 * (1 - res["on_output_tok_s"] / res["off_output_tok_s"])
    # each on/off pair ran back to back: the ratio within a pair is robust to load that drifts between pairs
    ratios = [rounds[2 * i + (0 if rounds[2 * i]["capture"] else 1)]["output_tok_s"]
              / rounds[2 * i + (1 if rounds[2 * i]["capture"] else 0)]["output_tok_s"] for i in range(a.rounds)]
    res["paired_loss_pct"] = [100 * (1 - r) for r in ratios]
    res["paired_loss_pct_median"] = 100 * (1 - statistics.median(ratios))
    res["loadavg_end"] = os.getloadavg()[0]
    from routing_replay.consumer import record_files
    records = len(record_files(npz_dir)) if npz_dir.exists() else 0
    res["records_written"] = records
    where = " (engine on CPU 0, broker + consumer on CPU 1)" if a.pin else ""
    print(f"\nvLLM {res['vllm']}, broker {a.broker}{where}, {a.num_layers} MoE layers, {a.requests} requests x "
          f"({a.prompt_len} prompt + {a.output_len} output) tokens, {a.rounds} on/off pairs (medians)")
    lo, hi = res["off_output_tok_s_range"]
    print(f"  capture off : {res['off_output_tok_s']:8.0f} output tok/s  ({res['off_total_tok_s']:.0f} total tok/s; "
          f"rounds {lo:.0f}..{hi:.0f})")
    lo, hi = res["on_output_tok_s_range"]
    print(f"  capture on  : {res['on_output_tok_s']:8.0f} output tok/s  ({res['on_total_tok_s']:.0f} total tok/s; "
          f"rounds {lo:.0f}..{hi:.0f})")
    print(f"  throughput lost: {res['paired_loss_pct_median']:.2f} % (median over back-to-back on/off pairs; pairs: "
          + ", ".join(f"{x:+.1f}" for x in res["paired_loss_pct"]) + f"); ratio of medians {res['throughput_loss_pct']:.2f} %")
    print(f"  load average at start {res['loadavg_start']:.2f}, at end {res['loadavg_end']:.2f} (2 CPUs)")
    d = res["engine_thread_cpu_us_per_step_on"] - res["engine_thread_cpu_us_per_step_off"]
    print(f"  engine-thread CPU time per step (front end + engine + worker, in-process): "
          f"off {res['engine_thread_cpu_us_per_step_off']:.0f} us, on {res['engine_thread_cpu_us_per_step_on']:.0f} us "
          f"({d:+.0f} us)")
    print(f"  plugin engine-thread CPU time per step, capture on : {res['plugin_host_us_per_step_on']:.1f} us "
          f"(pre/post {res['pre_post_us_per_step_on']:.1f} + hooks {res['hooks_us_per_step_on']:.1f}); "
          f"capture off: {res['plugin_host_us_per_step_off']:.1f} us; of which the timing clocks' own reads "
          f"(measured in place): on {res['clock_us_per_step_on']:.1f} us, off {res['clock_us_per_step_off']:.1f} us")
    print(f"  records written: {records}")
    m = micro(a.num_layers)
    res["micro_us"] = m
    print(f"  warm-cache probe of the same engine-thread work (the real worker, bench/worker_step_probe.py --eager "
          f"--evict-mib 0), 64 captured requests, {a.num_layers} MoE layers: "
          + ", ".join(f"{k} {v:.1f} us" for k, v in m.items()) + f"; total {sum(m.values()):.1f} us")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
