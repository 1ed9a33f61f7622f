"""Benchmark producer -> broker -> 2 consumers against raw ZeroMQ and a zmq.proxy chain, in one run.

Shape: Qwen3-30B-A3B (L=48 MoE layers, top-8, int16: 768 bytes per token; --num-experts 128, its own count: uint8
ids on the wire and in the consumers, 384 bytes per token, in every chain). Workloads (one publish_rows call each):
  decode  : steps of 256 requests x 1 token (one message per step, split across the two consumers)
  prefill : steps of 4 requests x 2048 tokens (prefill:N: the step's 8192 tokens over N requests, N = 1 ... 256)
  batched : the vLLM plugin's message: 16 engine steps of 256 requests x 1 token, published as the plugin does
            (Producer.publish_steps with per-step references; the raw/proxy chains send one header of 256 entries)
  mixed   : 16 engine steps of (240 decode requests x 1 token + a new request's 512-token prefill), the 16 prefill
            requests finishing after each message (new requests every message)
Chains (each role a separate process, loopback tcp):
  raw     : PUSH -> PULL, the same frames, the consumer only counts bytes (the wire's limit)
  proxy   : PUSH -> zmq.proxy(PULL, PUSH) -> 2 x PULL counting bytes (libzmq's C forwarder: one hop's limit)
  copy    : the proxy chain whose 2 consumers also copy every payload byte once into memory they keep (a 256 MiB
            buffer, faulted in before the clock starts, written round-robin): what a consumer that copies the
            rows it holds does, with no Python per request (ours keeps a prefill message's rows as received,
            so ours/copy can pass 1 there)
  ours    : Producer -> Broker -> 2 x Consumer (full accumulation and records, no sink)
Then latency at an offered load of 100k tokens/s (decode steps), p50/p99: ours from publish() to applied in both
consumers, and beside it (--latency-chains, default ours,proxy; --repeat times each, alternated) the proxy chain
from send to receipt: the floor that this machine's scheduling of the processes and ZeroMQ's threads puts under
any chain, measured in the same run. The p99 of each run, their median and how many were <= 5 ms are printed last.
Peak RSS of broker and consumers is reported, and the CPU seconds (user + system, all threads) each process
spent from the start signal to the end of the run (`cpu_s`: the sender's own count, the others' from
/proc/PID/stat). The producer coalesces steps that queue up behind its thread (Producer coalesce_max_bytes;
--coalesce-bytes 0: one message per publish call, as before issue #16). --profile DIR: each process's CPU per
thread, and cProfile stats of its main thread, in DIR (BENCH_PROFILE=threads: the thread CPU only; =all: every
thread's Python).
--batches N: each workload N times back to back as rollout batches (new request ids; each batch after the last
one's records are out), the last one measured: N=2 is a long-running consumer's steady state, its record memory
already faulted in (`--keep-mib`: the consumers' keep_bytes). Throughput, CPU, memory and latency are the last
batch's (`--workloads "" --batches 2`: the latency run alone, in a long-running consumer).
--repeat N: each workload's chains N times, their order alternated, each repeat's ratios and their median printed.
Usage: python bench/pipeline.py [--quick] [--json FILE] [--workloads decode,prefill,batched,mixed]
       [--coalesce-bytes N] [--replay-mib N] [--open-group-max N] [--batches N] [--keep-mib N] [--repeat N] [--profile DIR]
       [--num-experts N] [--no-latency | --latency-chains ours,proxy]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import resource
import statistics
import sys
import time
from typing import NamedTuple

import numpy as np

L, K = 48, 8
# the rows' dtype on the wire (--num-experts; the spawned processes read it from the environment): every chain sends
# the same frames, ours narrowing the engine's int16 rows in its producer as the plugin's producer does
ENV_IDS = "ROUTING_REPLAY_BENCH_IDS"
IDS = np.dtype(os.environ.get(ENV_IDS, "int16"))
ROW = L * K * IDS.itemsize
IDLE_S = 1.0


def _self_cpu() -> float:
    t = os.times()
    return t.user + t.system


def _stat(path: str) -> tuple:
    """(name, CPU seconds: user + system, minor page faults) from a /proc .../stat file."""
    with open(path) as f:
        head, rest = f.read().rsplit(")", 1)
    fields = rest.split()
    return head.split("(", 1)[1], (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), int(fields[7])


def _cpu(pid: int) -> float:
    """CPU seconds (user + system, all threads) of a child process, alive or exited but not yet reaped."""
    try:
        return _stat(f"/proc/{pid}/stat")[1]
    except (OSError, IndexError, ValueError):
        return float("nan")


def _faults(pid: int) -> int:
    """Minor page faults of a child process so far (first touches of its memory), -1 when unreadable."""
    try:
        return _stat(f"/proc/{pid}/stat")[2]
    except (OSError, IndexError, ValueError):
        return -1


def fresh_page_us(mib: int = 32) -> float:
    """What a first touch of fresh memory costs this machine now: µs per 4 KiB page (wall), over `mib` MiB mapped
    and written once here. On a VM whose guest reports freed memory back to its host (virtio-balloon free page
    reporting: this project's CPU machine) it moves 4-5x with how long ago the memory was freed (1.5 µs a page right
    after, 5-7 after 5-20 s idle); every record byte a consumer holds is such a touch, the proxy chain's are not
    (docs/PERFORMANCE.md). bench/page_touch.py's touch()."""
    import mmap
    here = os.path.dirname(os.path.abspath(__file__))
    if here not in sys.path:
        sys.path.append(here)
    from page_touch import touch
    return touch(mib)[0] * 1e6 / ((mib << 20) // mmap.PAGESIZE)


def steal_ms() -> float:
    """CPU time the hypervisor took from this VM's vCPUs so far (the `steal` column of /proc/stat's cpu line, all
    vCPUs, ms); -1 where it cannot be read. A process whose vCPU is stolen stalls for as long, whatever it runs."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        return int(fields[8]) * 1000 / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return -1.0


def rss_mb() -> float:
    """This process's peak resident memory (MiB): VmHWM, its own memory's high-water mark. getrusage's ru_maxrss is
    not that: a process started by a larger one (pytest, a bench parent holding workloads) inherits the parent's
    peak across exec, and its growth then reads too small."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class Step(NamedTuple):
    ids: list
    starts: list
    counts: list
    opens: list               # (request id, prompt_len) to open before this step
    finishes: list            # (request id, num_output, prompt_len) to finish after it
    per_step: tuple | None = None   # (id lists, starts, counts) per engine step: ours publishes with publish_steps


PREFILL_TOKENS = 8192


def prefill_requests(workload: str) -> int:
    """Requests per step of a prefill workload: "prefill" is 4 (x 2048 tokens); "prefill:N" splits the step's
    8192 tokens over N requests (N a power of two, 1 to 256): the same bytes in fewer or more requests, each its
    own open, delta entry and finish, so what the chain spends per request shows apart from what it spends per
    byte."""
    if workload == "prefill":
        return 4
    n = workload.partition(":")[2]
    if not n.isdigit() or int(n) not in {1 << i for i in range(9)}:
        raise ValueError(f"workload {workload!r}: prefill:N takes N = 1, 2, 4, ... 256")
    return int(n)


def _steps(workload: str, n_steps: int):
    """The workload as a list of Steps (one publish_rows call each) and the tokens per step."""
    if workload == "decode":
        ids = [f"cmpl-{i:08x}-decode-request" for i in range(256)]
        steps = [Step(ids, [s] * 256, [1] * 256, [], []) for s in range(n_steps)]
        steps[0].opens.extend((r, 1) for r in ids)
        steps[-1].finishes.extend((r, n_steps, 1) for r in ids)
        return steps, 256
    if workload.partition(":")[0] == "prefill":
        nr = prefill_requests(workload)
        per = PREFILL_TOKENS // nr
        steps = []
        for s in range(n_steps):
            ids = [f"cmpl-{s:06d}-{j}-prefill-request" for j in range(nr)]
            steps.append(Step(ids, [0] * nr, [per] * nr, [(r, per) for r in ids], [(r, 1, per) for r in ids]))
        return steps, nr * per
    if workload == "batched":
        ids = [f"cmpl-{i:08x}-decode-request" for i in range(256)]
        # ours: Producer.publish_steps, as the plugin calls it (16 references to one id list; per step its starts
        # and counts as arrays). raw/proxy: the same information in one header, one entry of 16 rows per request
        # (what ours sends since the producer merges such steps; before, ours sent 4096 entries of one row).
        ones = np.ones(256, dtype=np.int64)
        steps = [Step(ids, [16 * m] * 256, [16] * 256, [], [],
                      ([ids] * 16, [np.full(256, 16 * m + k, dtype=np.int64) for k in range(16)], [ones] * 16))
                 for m in range(n_steps)]
        steps[0].opens.extend((r, 1) for r in ids)
        steps[-1].finishes.extend((r, 16 * n_steps, 1) for r in ids)
        return steps, 4096
    if workload == "mixed":
        dec = [f"cmpl-{i:08x}-decode-request" for i in range(240)]
        steps = []
        for m in range(n_steps):
            ids, starts, counts, opens, fins = [], [], [], [], []
            for k in range(16):
                new = f"cmpl-{m:06d}-{k:02d}-prefill-request"
                ids += dec + [new]
                starts += [16 * m + k] * 240 + [0]
                counts += [1] * 240 + [512]
                opens.append((new, 512))
                fins.append((new, 1, 512))
            steps.append(Step(ids, starts, counts, opens, fins))
        steps[0].opens.extend((r, 1) for r in dec)
        steps[-1].finishes.extend((r, 16 * n_steps, 1) for r in dec)
        return steps, 16 * (240 + 512)
    raise ValueError(f"unknown workload {workload!r}")


def _batch(steps: list, b: int) -> list:
    """The workload's steps as rollout batch b: the same steps under new request ids (batch 0: as they are). Id
    lists shared between steps stay shared, as the plugin's are."""
    if not b:
        return steps
    lists: dict = {}

    def ren(ids):
        new = lists.get(id(ids))
        if new is None:             # (the original kept beside its copy, so its id() is not reused meanwhile)
            new = lists[id(ids)] = (ids, [f"b{b}-{r}" for r in ids])
        return new[1]

    out = []
    for st in steps:
        per = st.per_step and ([ren(x) for x in st.per_step[0]], *st.per_step[1:])
        out.append(Step(ren(st.ids), st.starts, st.counts, [(f"b{b}-{r}", n) for r, n in st.opens],
                        [(f"b{b}-{r}", *rest) for r, *rest in st.finishes], per))
    return out


def _next_batch(q, go, b: int, batches: int) -> None:
    """Before batch b (senders): the last batch is the measured one; the parent samples every process's CPU
    there ("measure"), then says go."""
    if b == batches - 1 and batches > 1:
        q.put(("measure",))
        go.get()


# ---- processes ------------------------------------------------------------------------------------------------

def raw_sender(ep, workload, n_steps, q, batches, report, got=None, rate_tokens_s=0):
    import zmq
    from routing_replay.protocol import wire
    steps, tok = _steps(workload, n_steps)
    payload = np.random.default_rng(0).integers(0, 128, (tok, L, K)).astype(IDS)
    ctx = zmq.Context()
    s = ctx.socket(zmq.PUSH)
    s.setsockopt(zmq.SNDHWM, 1000)
    s.connect(ep)
    runs = [_batch(steps, b) for b in range(batches)]      # new ids made before any clock starts
    q.get()  # go
    seq = 0
    sent = 0
    step_s = tok / rate_tokens_s if rate_tokens_s else 0
    for b, run in enumerate(runs):
        if b:                       # the last batch's bytes are all received (as ours waits for its acks)
            while got.value < sent:
                time.sleep(0.001)
        _next_batch(report, q, b, batches)
        c0 = _self_cpu()
        send_times = {}
        t0 = time.monotonic()
        for i, st in enumerate(run):
            seq += 1
            if step_s:              # the latency run: the same pacing as ours' producer_proc
                target = t0 + i * step_s
                while time.monotonic() < target:
                    time.sleep(max(0, target - time.monotonic() - 0.0002))
            t = time.monotonic()
            head = wire.pack_header("delta", "raw", 0, seq, st.ids,
                                    wire.delta_body(st.starts, st.counts, L, K, ids=IDS))
            s.send_multipart([head, payload], copy=False)
            send_times[i] = t
            sent += len(head) + payload.nbytes
    s.close(linger=-1)
    ctx.term()
    report.put(("sent", t0, send_times, _self_cpu() - c0))


COPY_BUF = 256 << 20


def copy_in(buf: np.ndarray, at: int, frames) -> int:
    """The 'copy' chain's consumer work: each frame's bytes copied once into `buf` at offset `at` (back to 0 where
    one does not fit before the end); returns the next offset."""
    for f in frames:
        src = np.frombuffer(f.buffer if hasattr(f, "buffer") else f, dtype=np.uint8)
        if at + len(src) > len(buf):
            at = 0
        buf[at:at + len(src)] = src
        at += len(src)
    return at


def _note_positions(recv_times: dict, header: bytes, t: float) -> None:
    """The latency runs (decode steps: step i writes position i of every request): arrival time t of every
    position a delta header's entries carry, kept per position (with --batches the same positions come once per
    batch; _latency takes each step's first arrival after the measured batch sent it)."""
    import msgpack
    h = msgpack.unpackb(header)
    if h[1] != "delta":
        return
    # dict.fromkeys, not np.unique: numpy 2's unique imports numpy.ma on its first call (80 ms on a host without
    # that module's .pyc), which stalled the first steps of this measurement
    starts = np.frombuffer(h[6]["start"], "<i4")
    counts = np.frombuffer(h[6]["count"], "<i4")
    for a, c in dict.fromkeys(zip(starts.tolist(), counts.tolist())):
        for pos in range(a, a + c):     # (a merged decode entry carries several steps)
            recv_times.setdefault(pos, []).append(t)


def raw_receiver(ep, bind, q, got=None, copy=False, latency=False):
    import zmq
    recv_times = {}
    buf = None
    if copy:                        # the 'copy' chain: every payload byte copied once into kept, warm memory
        buf = np.ones(COPY_BUF, dtype=np.uint8)
        at = 0
    ctx = zmq.Context()
    s = ctx.socket(zmq.PULL)
    s.setsockopt(zmq.RCVHWM, 1000)
    (s.bind if bind else s.connect)(ep)
    q.put(("ready", os.getpid()))
    n = 0
    last = None
    while True:
        if not s.poll(int(IDLE_S * 1000)):
            if last is not None:
                break
            continue
        m = 0
        frames = s.recv_multipart(copy=False)
        if latency:
            _note_positions(recv_times, frames[0].buffer, time.monotonic())
        for f in frames:
            m += len(f.buffer)
        if buf is not None:
            at = copy_in(buf, at, frames[1:])
        n += m
        last = time.monotonic()
        if got is not None:         # --batches: the sender waits for each batch to be received
            with got.get_lock():
                got.value += m
    q.put(("done", n, last, rss_mb(), recv_times))


def proxy_proc(front, back, q):
    import zmq
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    a.bind(front)
    b.bind(back)
    q.put(("ready", os.getpid()))
    try:
        zmq.proxy(a, b)
    except zmq.ContextTerminated:
        pass


def broker_proc(front, back, q, stop, open_group_max=None):
    import logging
    logging.basicConfig(level=logging.INFO)
    from routing_replay.broker import Broker
    b = Broker(front, back, stats_interval_s=2,
               **({} if open_group_max is None else {"open_group_max": open_group_max}))
    b.bind()
    q.put(("ready", os.getpid()))
    import threading
    threading.Thread(target=lambda: (stop.get(), b.stop()), daemon=True).start()
    b.serve()


def consumer_proc(back, q, latency, stop, keep_bytes=None):
    import logging
    logging.basicConfig(level=logging.WARNING)
    from routing_replay.consumer import Consumer
    recv_times = {}
    state = {"records": 0, "last": None, "held_peak": 0}

    class C(Consumer):
        def _on_broker_message(self, frames, now):
            super()._on_broker_message(frames, now)
            if latency:              # decode steps: step i writes position i of every request
                _note_positions(recv_times, frames[0].buffer, time.monotonic())
            state["held_peak"] = max(state["held_peak"], self.acc.bytes_held)

    def on_record(rec):
        state["records"] += 1
        state["record_bytes"] += rec.prompt_routed_experts.nbytes + rec.routed_experts.nbytes
        state["last"] = time.monotonic()

    state["record_bytes"] = 0
    c = C(back, on_record=on_record, stats_interval_s=3600, finish_grace_s=0.5, keep_bytes=keep_bytes)
    c.start()
    base_rss = rss_mb()
    q.put(("ready", os.getpid()))
    stopping = False
    while True:                 # until the parent says the producer is done (every message acked: applied here)
        time.sleep(0.1)
        if not stopping and not stop.empty():
            stopping = bool(stop.get())
        idle = time.monotonic() - state["last"] if state["last"] is not None else 0.0
        if (stopping and idle > 0.3) or idle > 600:
            break
    c.close()
    q.put(("done", state["records"], state["last"], rss_mb(), state["held_peak"], recv_times,
           state["record_bytes"], base_rss))


def producer_proc(ep, workload, n_steps, q, rate_tokens_s, coalesce_bytes, replay_bytes, batches, report):
    import logging
    logging.basicConfig(level=logging.WARNING)
    from routing_replay.producer import Producer
    steps, tok = _steps(workload, n_steps)
    payload = np.random.default_rng(0).integers(0, 128, (tok, L, K)).astype(np.int16)
    kw = {} if coalesce_bytes is None else {"coalesce_max_bytes": coalesce_bytes}
    if replay_bytes is not None:
        kw["replay_max_bytes"] = replay_bytes
    p = Producer(ep, num_layers=L, top_k=K, max_queue_bytes=4 << 30, id_dtype=IDS, **kw)
    # warm-up, as an engine that connected at start-up: the first step's requests are opened and acked
    # (connection, hello round trip, the consumers' first allocations) before the clock starts
    for rid, prompt_len in steps[0].opens:
        p.open(rid, prompt_len=prompt_len)
    p.wait_acked(60)
    runs = [_batch(steps, b) for b in range(batches)]      # new ids made before any clock starts
    q.get()  # go
    step_s = tok / rate_tokens_s if rate_tokens_s else 0
    for b, run in enumerate(runs):
        if b:                   # the last batch's records are out (acked: applied), its memory back in the arenas
            p.flush(600)
        _next_batch(report, q, b, batches)
        c0 = _self_cpu()
        full0 = p.stats.replay_full_s
        send_times = {}
        t0 = time.monotonic()
        for i, st in enumerate(run):
            if i or b:
                for rid, prompt_len in st.opens:
                    p.open(rid, prompt_len=prompt_len)
            if step_s:
                target = t0 + i * step_s
                while time.monotonic() < target:
                    time.sleep(max(0, target - time.monotonic() - 0.0002))
            t = time.monotonic()
            if st.per_step is not None:
                p.publish_steps(*st.per_step, payload)
            else:
                p.publish_rows(st.ids, st.starts, st.counts, payload)
            send_times[i] = t
            for rid, n_out, prompt_len in st.finishes:
                p.finish(rid, num_output_tokens=n_out, prompt_len=prompt_len)
    p.flush(600)
    stats = p.stats
    p.close()
    report.put(("sent", t0, stats.sent_msgs, stats.dropped_msgs, send_times, stats.replay_full_s - full0,
                _self_cpu() - c0))


_live: list = []      # this run's processes: a wait gives up as soon as one of them has died (_get)


def _get(q, timeout):
    """q.get(timeout=...), but a process of this run that exited with an error ends the wait at once (its
    traceback is above), instead of after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return q.get(timeout=max(0.01, min(1.0, deadline - time.monotonic())))
        except queue.Empty:
            dead = [f"{p.name} (pid {p.pid}) exit code {p.exitcode}" for p in _live if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError("bench process died: " + ", ".join(dead)) from None
            if time.monotonic() >= deadline:
                raise


def _wait(q, kind, n, timeout=300):
    out = []
    deadline = time.monotonic() + timeout
    while len(out) < n:
        m = _get(q, max(1, deadline - time.monotonic()))
        if m[0] != kind:
            raise RuntimeError(f"expected {kind}, got {m[0]}")
        out.append(m)
    return out


_next_port = [int(os.environ.get("BENCH_PORT_BASE", 47100))]


def _port() -> str:
    """A fresh loopback port per socket, so a chain never waits for the last chain's sockets to go."""
    _next_port[0] += 1
    return f"tcp://127.0.0.1:{_next_port[0]}"


def _thread_cpu() -> dict:
    """{thread id: (name, CPU seconds)} of this process's live threads."""
    out = {}
    for task in os.listdir("/proc/self/task"):
        try:
            out[task] = _stat(f"/proc/self/task/{task}/stat")[:2]
        except OSError:
            continue
    return out


def _profiled(target, name, profile_dir, *args):
    """Run one role with its CPU seconds per thread (sampled every 0.1 s, so threads that end are counted) in
    profile_dir/<name>-<pid>.cpu, and under cProfile with each thread's own CPU clock: the main thread unless
    BENCH_PROFILE=threads, every thread the role starts too with BENCH_PROFILE=all (<name>-<pid>-<thread>.prof)."""
    import threading
    seen = {}
    done = threading.Event()

    def sample():
        while True:
            seen.update(_thread_cpu())
            if done.wait(0.1):
                return

    threading.Thread(target=sample, daemon=True, name="bench-sampler").start()
    prof = None
    mode = os.environ.get("BENCH_PROFILE", "")
    if mode != "threads":
        import cProfile
        prof = cProfile.Profile(time.thread_time)
    if mode == "all":               # every thread the role starts under cProfile too, each in its own stats file
        run = threading.Thread.run

        def profiled_run(self):
            p = cProfile.Profile(time.thread_time)
            try:
                p.runcall(run, self)
            finally:
                p.dump_stats(os.path.join(profile_dir, f"{name}-{os.getpid()}-{self.name}.prof"))
        threading.Thread.run = profiled_run
    try:
        prof.runcall(target, *args) if prof else target(*args)
    finally:
        seen.update(_thread_cpu())
        done.set()
        base = os.path.join(profile_dir, f"{name}-{os.getpid()}")
        if prof:
            prof.dump_stats(base + ".prof")
        by_name: dict = {}
        for tname, cpu in seen.values():
            by_name[tname] = by_name.get(tname, 0.0) + cpu
        with open(base + ".cpu", "w") as f:
            f.write(" ".join(f"{k}={v:.2f}" for k, v in sorted(by_name.items(), key=lambda kv: -kv[1])) + "\n")


PROFILE_DIR = [None]


def _proc(ctx, target, args, name):
    if PROFILE_DIR[0]:
        return ctx.Process(target=_profiled, args=(target, name, PROFILE_DIR[0]) + tuple(args))
    return ctx.Process(target=target, args=args)


def measure_chain(chain, workload, n_steps, rate=0, coalesce_bytes=None, replay_bytes=None, batches=1,
                  keep_bytes=None, open_group_max=None):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()          # from workers
    go = ctx.Queue()         # to the sender
    stop = ctx.Queue()
    told = ctx.Queue()       # from the sender: the measured batch starts
    cstop = ctx.Queue()      # to our consumers: the producer is done
    got = ctx.Value("q", 0) if batches > 1 else None     # raw/proxy: bytes received, all receivers
    procs = []
    fe, be = _port(), _port()
    if chain == "raw":
        procs.append(ctx.Process(target=raw_receiver, args=(fe, True, q, got, False, bool(rate))))
        n_cons = 1
    elif chain in ("proxy", "copy"):
        procs.append(ctx.Process(target=proxy_proc, args=(fe, be, q)))
        n_cons = 2
    else:
        procs.append(_proc(ctx, broker_proc, (fe, be, q, stop, open_group_max), "broker"))
        n_cons = 2
    procs[0].start()
    _live[:] = procs
    _wait(q, "ready", 1)
    if chain != "raw":
        for _ in range(n_cons):
            if chain in ("proxy", "copy"):
                p = ctx.Process(target=raw_receiver, args=(be, False, q, got, chain == "copy", bool(rate)))
            else:
                p = _proc(ctx, consumer_proc, (be, q, bool(rate), cstop, keep_bytes), "consumer")
            p.start()
            procs.append(p)
            _live.append(p)
        _wait(q, "ready", n_cons)
        time.sleep(0.5)       # let the consumers' hello reach the broker (bench only)
    if chain == "ours":
        sender = _proc(ctx, producer_proc, (fe, workload, n_steps, go, rate, coalesce_bytes, replay_bytes,
                                            batches, told), "producer")
    else:
        sender = ctx.Process(target=raw_sender, args=(fe, workload, n_steps, go, batches, told, got, rate))
    sender.start()
    _live.append(sender)
    if batches > 1:
        go.put("go")
        _wait(told, "measure", 1, 900)
    page_us = fresh_page_us()               # (this machine's first-touch cost as the measured batch starts)
    go.put("go")
    steal0 = steal_ms()
    cpu0 = [_cpu(p.pid) for p in procs]
    flt0 = [_faults(p.pid) for p in procs]
    sflt0 = _faults(sender.pid)
    if chain == "ours":
        sent = _get(told, 900)
        for _ in range(n_cons):
            cstop.put(True)
        done = _wait(q, "done", n_cons, 900)
    else:
        done = _wait(q, "done", n_cons, 900)
        sent = _get(told, 60)
    cpu1 = [_cpu(p.pid) for p in procs]
    steal1 = steal_ms()
    flt1 = [_faults(p.pid) for p in procs]
    sflt1 = _faults(sender.pid)             # (a sender waits for its stop signal or has not been reaped yet)
    sender.join()
    if chain == "ours":
        stop.put("stop")
    for p in procs:
        p.join(10)
        if p.is_alive():
            p.terminate()
    t0 = sent[1]
    t_end = max(d[2] for d in done)
    _, tok = _steps(workload, 1)
    tokens = tok * n_steps
    dt = t_end - t0
    res = {"chain": chain, "workload": workload, "steps": n_steps, "batches": batches, "tokens": tokens,
           "seconds": dt,
           "tokens_per_s": tokens / dt, "MB_per_s": tokens * ROW / dt / 1e6,
           "consumer_rss_mb": [round(d[3], 1) for d in done]}
    # CPU seconds each process spent from the start signal to the end of the run (the sender: its own count)
    roles = (["receiver"] if chain == "raw" else ["broker" if chain == "ours" else "proxy"] + ["consumer"] * n_cons)
    res["cpu_s"] = {"sender": round(sent[-1], 2)}
    for role, a, b in zip(roles, cpu0, cpu1):
        res["cpu_s"].setdefault(role, []).append(round(b - a, 2))
    # first touches in the measured batch (thousands of pages) and what one cost as it started: a consumer that
    # holds records pays faults x page_us that a consumer which only counts bytes does not
    res["page_us"] = round(page_us, 2)
    # CPU the hypervisor took from the VM while the measured batch ran (ms, all vCPUs; None: not readable)
    res["steal_ms"] = round(steal1 - steal0) if min(steal0, steal1) >= 0 else None
    res["faults_k"] = {"sender": round((sflt1 - sflt0) / 1e3, 1) if min(sflt0, sflt1) >= 0 else None}
    for role, a, b in zip(roles, flt0, flt1):
        res["faults_k"].setdefault(role, []).append(round((b - a) / 1e3, 1) if min(a, b) >= 0 else None)
    if chain == "ours":
        res["records"] = sum(d[1] for d in done)
        res["held_peak_mb"] = [round(d[4] / 1e6, 1) for d in done]
        res["record_mb"] = [round(d[6] / 1e6 / batches, 1) for d in done]        # one batch's
        # peak RSS above the consumer's RSS at start, over the bytes of the records it assembled (of one batch: the
        # batches are alike and follow each other)
        res["rss_over_records"] = [round((d[3] - d[7]) * 1.048576 / max(d[6] / 1e6 / batches, 1e-9), 2)
                                   for d in done]
        res["dropped"] = sent[3]
        res["messages"] = sent[2]
        res["replay_full_s"] = round(sent[5], 3)    # the measured batch's time with the replay window full
        if rate:
            res["latency"] = _latency(sent[4], [d[5] for d in done], n_steps)
    elif rate:
        # raw/proxy: each message reaches one receiver (PUSH round-robin), so a step's arrival is its one receiver's
        merged: dict = {}
        for d in done:
            for pos, ts in d[4].items():
                merged.setdefault(pos, []).extend(ts)
        for ts in merged.values():
            ts.sort()
        res["latency"] = _latency(sent[2], [merged], n_steps)
    return res


def _latency(send_times, recv_maps, n_steps):
    # decode workload: step i writes position i of every request; a delta may carry several steps (coalesced)
    # each consumer's first arrival of step i at or after the measured batch sent it (an earlier batch's arrivals of
    # the same position all precede it: a batch starts after the last one's records are out)
    per_step = {}
    for i in range(n_steps):
        sent = send_times[i]
        recv = [next((t for t in m[i] if t >= sent), None) for m in recv_maps if i in m]
        if len(recv) == len(recv_maps) and None not in recv:
            per_step[i] = (max(recv) - sent) * 1e3
    lat = sorted(per_step.values())
    slowest = sorted(per_step, key=per_step.get, reverse=True)[:10]
    return {"n": len(lat), "p50_ms": round(statistics.median(lat), 3),
            "p99_ms": round(lat[int(0.99 * (len(lat) - 1))], 3), "max_ms": round(lat[-1], 3),
            "slowest": [(i, round(per_step[i], 1)) for i in slowest],      # (step, ms): where the tail sits
            "per_step_ms": [round(per_step.get(i, -1.0), 3) for i in range(n_steps)]}


def ratios(results: list, workloads: list, repeats: int) -> list:
    """Per workload, ours' tokens/s over each other chain's (raw, proxy, copy), and the copy chain's over the
    proxy's (what copying the rows once costs by itself: the floor under ours/proxy), one ratio per repeat (each
    repeat measured both side by side), their median, min and max, as summary entries."""
    out = []
    by = {(r["workload"], r["chain"], r.get("repeat", 0)): r for r in results if "latency" not in r}
    pairs = (("ours", "raw"), ("ours", "proxy"), ("ours", "copy"), ("copy", "proxy"))
    for w in workloads:
        for a, c in pairs:
            rs = [by[(w, a, i)]["tokens_per_s"] / by[(w, c, i)]["tokens_per_s"] for i in range(repeats)
                  if (w, a, i) in by and (w, c, i) in by]
            if rs:
                out.append({"summary": True, "workload": w, "chain": a, "vs": c, "ratios": [round(x, 4) for x in rs],
                            "median": statistics.median(rs), "min": min(rs), "max": max(rs)})
    return out


def latency_summary(runs: list, chains: list) -> list:
    """Per chain, the p99 of each latency run, their median and how many were at most 5 ms (issue #16's target),
    as summary entries: ours beside the proxy chain measured in the same run, alternated."""
    out = []
    for c in chains:
        p99 = [r["latency"]["p99_ms"] for r in runs if r["chain"] == c]
        if p99:
            out.append({"summary": "latency", "chain": c, "p99_ms": p99, "median_ms": statistics.median(p99),
                        "at_most_5ms": sum(x <= 5.0 for x in p99)})
    return out


STEPS = {"decode": 4000, "prefill": 200, "batched": 250, "mixed": 100}     # about 1M tokens each (mixed: 1.2M)


def wire_id_dtype(num_experts: int) -> np.dtype:
    from routing_replay.protocol import wire
    return wire.id_dtype(num_experts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps (a smoke run)")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--workloads", default="decode,prefill,batched,mixed")
    ap.add_argument("--chains", default="raw,proxy,ours", help="of raw, proxy, copy, ours (see above)")
    ap.add_argument("--coalesce-bytes", type=int, default=None,
                    help="Producer coalesce_max_bytes (default: the Producer's; 0: one message per publish call)")
    ap.add_argument("--replay-mib", type=int, default=None,
                    help="the producers' replay_max_bytes in MiB (default: Producer's own): how much unacked data a "
                         "producer keeps in flight to the consumers")
    ap.add_argument("--open-group-max", type=int, default=None, metavar="N",
                    help="the broker's open_group_max (default: the Broker's own, 16): an `opens` of at most N "
                         "requests goes to one consumer; 0: each request to its own hash's consumer (before)")
    ap.add_argument("--batches", type=int, default=1, metavar="N",
                    help="run each workload N times back to back as rollout batches (new request ids each time, "
                         "the next one after the last one's records are out) and measure the last: N=2 is the "
                         "steady state of a long-running consumer, whose memory is already faulted in")
    ap.add_argument("--keep-mib", type=int, default=None, metavar="N",
                    help="the consumers' keep_bytes in MiB: memory of finished requests' rows kept for the next "
                         "requests (default: the Consumer's own, the most held at once)")
    ap.add_argument("--repeat", type=int, default=1, metavar="N",
                    help="measure each workload's chains N times, alternating their order (as given, then "
                         "reversed, ...), and print each repeat's ratios with their median: one run's ratio on a "
                         "shared machine moves with its load, the median of alternated repeats much less")
    ap.add_argument("--num-experts", type=int, default=None, metavar="N",
                    help="the model's routed experts: rows travel as wire.id_dtype(N) in every chain (128, "
                         "Qwen3-30B-A3B's: uint8, half the bytes); default: int16 rows")
    ap.add_argument("--no-latency", action="store_true")
    ap.add_argument("--latency-chains", default="ours,proxy",
                    help="the chains whose latency at 100k tokens/s is measured, --repeat times each, their order "
                         "alternated (of ours, proxy, raw: proxy/raw time a step from its send to its receipt, "
                         "the floor this machine's scheduling puts under ours' publish-to-applied)")
    ap.add_argument("--profile", metavar="DIR",
                    help="run the producer, broker and consumers of 'ours' under cProfile; stats and CPU seconds "
                         "per process go to DIR (slows them; not for the ratios)")
    a = ap.parse_args(argv)
    if a.num_experts is not None:
        if not 128 <= a.num_experts <= 65535:
            ap.error(f"--num-experts {a.num_experts}: the bench's ids go up to 127, so 128 ... 65535")
        global IDS, ROW
        IDS = wire_id_dtype(a.num_experts)
        ROW = L * K * IDS.itemsize
        os.environ[ENV_IDS] = IDS.str          # the spawned processes' rows
    if a.profile:
        os.makedirs(a.profile, exist_ok=True)
        PROFILE_DIR[0] = os.path.abspath(a.profile)
    results = []
    replay = a.replay_mib << 20 if a.replay_mib is not None else None
    workloads = [w for w in a.workloads.split(",") if w]       # --workloads "": the latency run alone
    for w in workloads:
        base, colon, _ = w.partition(":")
        if base not in STEPS or (colon and base != "prefill"):
            ap.error(f"unknown workload {w!r}: of {', '.join(STEPS)} and prefill:N")
        if colon:
            try:
                prefill_requests(w)
            except ValueError as e:
                ap.error(str(e))
    if a.repeat < 1:
        ap.error("--repeat must be >= 1")
    chains = [c for c in a.chains.split(",") if c]
    lat_chains = [c for c in a.latency_chains.split(",") if c]
    if any(c not in ("ours", "proxy", "raw") for c in lat_chains):
        ap.error(f"--latency-chains: of ours, proxy, raw, not {a.latency_chains!r}")
    for workload in workloads:
        steps = STEPS[workload.partition(":")[0]]
        steps = steps // 10 if a.quick else steps
        for rep in range(a.repeat):
            for chain in (chains if rep % 2 == 0 else chains[::-1]):
                r = measure_chain(chain, workload, steps, coalesce_bytes=a.coalesce_bytes, replay_bytes=replay,
                                  batches=a.batches, keep_bytes=None if a.keep_mib is None else a.keep_mib << 20,
                                  open_group_max=a.open_group_max)
                r["repeat"] = rep
                results.append(r)
                print(f"{workload:8s} {chain:6s}" + (f" repeat {rep + 1}/{a.repeat}" if a.repeat > 1 else "")
                      + (f" batch {a.batches}/{a.batches}" if a.batches > 1 else "")
                      + f" tokens/s={r['tokens_per_s']:>12,.0f} MB/s={r['MB_per_s']:>8,.0f} "
                      f"seconds={r['seconds']:.2f} consumer_rss_mb={r['consumer_rss_mb']} cpu_s={r['cpu_s']} "
                      f"page_us={r.get('page_us')} steal_ms={r.get('steal_ms')} faults_k={r.get('faults_k')}"
                      + (f" records={r['records']} messages={r['messages']} held_peak_mb={r['held_peak_mb']} "
                         f"record_mb={r['record_mb']} rss_over_records={r['rss_over_records']} "
                         f"replay_full_s={r.get('replay_full_s')}"
                         if chain == "ours" else ""),
                      flush=True)
    lat_runs = []
    for rep in range(a.repeat if not a.no_latency else 0):
        for chain in (lat_chains if rep % 2 == 0 else lat_chains[::-1]):
            lat = measure_chain(chain, "decode", 200 if a.quick else 800, rate=100_000,
                                coalesce_bytes=a.coalesce_bytes, replay_bytes=replay, batches=a.batches,
                                open_group_max=a.open_group_max)
            lat["repeat"] = rep
            results.append(lat)
            lat_runs.append(lat)
            shown = {k: v for k, v in lat["latency"].items() if k != "per_step_ms"}
            print(f"latency at 100k tokens/s offered (decode steps of 256"
                  + (f", batch {a.batches}/{a.batches}" if a.batches > 1 else "") + f") {chain}"
                  + (f" repeat {rep + 1}/{a.repeat}" if a.repeat > 1 else "") + f": {shown} "
                  + (f"messages={lat['messages']} records={lat['records']} " if chain == "ours" else "")
                  + f"page_us={lat['page_us']} steal_ms={lat['steal_ms']} faults_k={lat['faults_k']}", flush=True)
    results.extend(ratios(results, workloads, a.repeat))
    results.extend(latency_summary(lat_runs, lat_chains))
    for r in results:
        if r.get("summary") == "latency":
            print(f"latency p99 at 100k tokens/s: {r['chain']} median {r['median_ms']:.2f} ms "
                  f"({' '.join(f'{x:.2f}' for x in r['p99_ms'])}; {r['at_most_5ms']} of {len(r['p99_ms'])} "
                  f"<= 5 ms)", flush=True)
        elif r.get("summary"):
            each = " ".join(f"{x:.2f}" for x in r["ratios"])
            print(f"{r['workload']}: {r['chain']}/{r['vs']}={r['median']:.2f}" +
                  (f" (median of {len(r['ratios'])} alternated repeats: {each}; min {r['min']:.2f}, max "
                   f"{r['max']:.2f})" if len(r["ratios"]) > 1 else ""), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    raise SystemExit(main())
