"""Stand-ins shared by several test files for what an engine hands the producer."""

from __future__ import annotations

import functools
from types import SimpleNamespace


class Slot:
    """Deferred rows in a ring slot: `result()` is the array, and the slot is overwritten (-7) once released, so a
    producer that keeps reading it after `release()` sends wrong rows."""

    def __init__(self, arr):
        self.arr, self.shape, self.dtype, self.released = arr, arr.shape, arr.dtype, 0

    def result(self):
        return self.arr

    def release(self):
        self.released += 1
        self.arr[...] = -7


def worker_capture(settings, *, layers: int = 3, top_k: int = 2, max_tokens: int = 16, eager: bool = True,
                   device_type: str = "cpu", runner=None, producer=None, binding=None):
    """A WorkerCapture built through its public constructor from a plan (engines/vllm_plugin/plan.py), on the CPU,
    with no vLLM: a Model Runner V1 worker, eager (hooks in Python every step) unless eager=False (a graph
    engine's plan). `binding`: the CaptureBinding or a stand-in (default: a stand-in that binds nothing)."""
    from types import SimpleNamespace

    from routing_replay.engines.vllm_plugin.plan import make_plan
    from routing_replay.engines.vllm_plugin.worker import WorkerCapture, make_cache

    plan = make_plan(settings, kind="v1", device_type=device_type, enforce_eager=eager,
                     layer_ids=list(range(layers)), top_k=top_k, max_num_batched_tokens=max_tokens)
    cache, copier = make_cache(plan, "cpu")
    if binding is None:
        binding = SimpleNamespace(gate=eager, active=False, calls=0, min_rows=0, layers=[None] * layers)
    return WorkerCapture(runner if runner is not None else SimpleNamespace(), settings, plan, cache=cache,
                         copier=copier, binding=binding, producer=producer, randomized=False)


class V1Runner:
    """What the worker reads of a Model Runner V1 after execute_model: the persistent batch (its block table's slot
    mapping too, for the prefix store) and query_start_loc."""

    def __init__(self, n: int, max_tokens: int, device="cpu"):
        import numpy as np
        import torch
        self.input_batch = SimpleNamespace(num_reqs=0, req_ids=[], num_computed_tokens_cpu=np.zeros(n, np.int32),
                                           block_table=[SimpleNamespace(slot_mapping=SimpleNamespace(
                                               gpu=torch.zeros(max_tokens, dtype=torch.int64, device=device)))])
        self.query_start_loc = SimpleNamespace(np=np.zeros(n + 1, np.int32))


class Router:
    """What the binding reads and sets of a vLLM router (FusedMoE's `router`): its capture function."""

    capture_fn = None

    def set_capture_fn(self, fn) -> None:
        self.capture_fn = fn


def sched_out(new, scheduled: dict, total: int):
    """A SchedulerOutput with the fields the worker reads."""
    return SimpleNamespace(scheduled_new_reqs=new, num_scheduled_tokens=scheduled, total_num_scheduled_tokens=total,
                           finished_req_ids=set(), preempted_req_ids=set(), scheduled_spec_decode_tokens={})


def engine_id(i: int) -> str:
    """The engine id of the i-th request a StandinEngine starts (vLLM's `cmpl-...` form)."""
    return f"cmpl-{i:08x}-0-{i:04d}"


class StandinEngine:
    """An engine's steps around one WorkerCapture built through its public constructor from a plan (no vLLM, no
    GPU needed): n requests (step 0 their prefill of prompt_len tokens, then one decode token each), over the real
    RoutingCache, AsyncCopier and a real Producer (publishing to an endpoint nobody binds: its thread still takes,
    copies and encodes every delta). The caller runs each step as an engine does:

        so = eng.schedule(step); eng.cap.pre_step(so); rows = eng.lay_out(step, so)
        the forward: each of eng.hooks (eager) or eng.records (graph mode) called with eng.topk[:rows]
        eng.cap.post_step(so)

    mode: `on` (every request captured), `optout` (every request opted out), `optout-fill` (opted out, in an engine
    whose prefix store exists: prefix_rows=fill), `fill` (captured, with that store). Graph mode (hooks replayed
    from CUDA graphs; the forward writes each layer's RoutingCache.record as the replay does) unless eager (the
    real CaptureBinding's C hooks on stand-in routers, called in layer order). stamp: step stamps (graph mode);
    ring: the step ring too. churn N: per step after the first, N requests finish (the scheduler's notes:
    churn_output output ids) and N new ones take their places with a prefill of churn_prompt tokens; each new
    request starts with churn_hits prefix-cache hit tokens (blocks shared by all; `fill` gathers their rows);
    every churn_optout-th new one is not captured; churn_same_ids: a new request takes the id of the one it
    replaces. layout(step, ids), without churn: the steps after the first schedule the (engine id, tokens) pairs
    it returns, in that batch order; optout_first: indices of the first step's requests not captured.
    on_producer(producer) once the worker's producer exists, before the prefix store and the first step."""

    def __init__(self, mode: str, n: int, layers: int, top_k: int, *, device="cpu", eager: bool = False,
                 prompt_len: int = 16, stamp: bool = False, ring: bool = False, churn: int = 0,
                 churn_prompt: int = 512, churn_output: int = 256, churn_same_ids: bool = False,
                 churn_optout: int = 0, churn_hits: int = 0, layout=None, optout_first: frozenset = frozenset(),
                 on_producer=None):
        import tempfile

        import numpy as np
        import torch

        from routing_replay.engines.vllm_plugin.binding import CaptureBinding, MoELayer
        from routing_replay.engines.vllm_plugin.plan import make_plan
        from routing_replay.engines.vllm_plugin.settings import Settings
        from routing_replay.engines.vllm_plugin.worker import WorkerCapture, make_cache
        from routing_replay.producer import Producer

        dev = torch.device(device)
        max_tokens = max(8192, n * prompt_len, n + churn * churn_prompt)
        self.stamp = stamp = stamp and not eager        # as the worker decides with ROUTING_REPLAY_STEP_STAMP=on
        self.ring = ring and stamp                      # ROUTING_REPLAY_STEP_STAMP=ring: stamps and the step ring
        settings = Settings(broker="ipc://standin", step_stamp=stamp, step_ring=self.ring, ring_needs_kernels=False,
                            prefix_rows="fill" if mode in ("optout-fill", "fill") else "sentinel")
        self.runner = V1Runner(n, max_tokens, dev)
        # a graph engine's plan (the step ring's slots hold vLLM's default largest CUDA graph: 512 rows), or an
        # eager one on this device
        plan = make_plan(settings, kind="v1", device_type=dev.type if eager else "cuda", enforce_eager=eager,
                         layer_ids=list(range(layers)), top_k=top_k, max_num_batched_tokens=max_tokens)
        cache, copier = make_cache(plan, dev)
        if eager:       # the real hooks on stand-in routers, as the worker's under enforce_eager
            binding = CaptureBinding([MoELayer(i, f"model.layers.{i}.mlp", SimpleNamespace(router=Router()), top_k,
                                               128) for i in range(layers)], cache.record, gate=True, c_hooks=True)
        else:           # graph mode: the forward's replay writes the cache without Python
            binding = SimpleNamespace(gate=False, active=False, calls=0, min_rows=0, layers=[None] * layers)
        producer = Producer(f"ipc://{tempfile.mkdtemp(prefix='rr-standin-')}/nobody", num_layers=layers,
                            top_k=top_k, max_queue_bytes=1 << 30, replay_max_bytes=1 << 30)
        self.cap = cap = WorkerCapture(self.runner, settings, plan, cache=cache, copier=copier, binding=binding,
                                       producer=producer, randomized=False)
        if eager:
            binding.bind()
        if on_producer is not None:
            on_producer(cap.producer)
        if cap.fill:                                # a store as a fill engine has one (graph mode: written inside
            from routing_replay.capture.prefix_store import PrefixStore      # the forward, nothing on the host)
            cap.adopt_store(PrefixStore(4 * max_tokens, layers, top_k, device=dev), block_size=16)
        cap.stamp_baseline()                        # as after vLLM's warm-up (stamps only)
        captured = mode in ("on", "fill")
        self._sp = SimpleNamespace(extra_args={"return_routed_experts": captured})
        self._sp_out = SimpleNamespace(extra_args={"return_routed_experts": False})
        self.n, self.prompt_len, self.layout = n, prompt_len, layout
        self.churn, self.churn_prompt, self.churn_hits = churn, churn_prompt, churn_hits
        self.churn_same_ids, self.churn_optout = churn_same_ids, churn_optout
        self.ids = ids = [engine_id(i) for i in range(n)]
        self._new = [SimpleNamespace(req_id=r, sampling_params=self._sp_out if i in optout_first else self._sp,
                                     prompt_token_ids=list(range(prompt_len)), prompt_embeds=None,
                                     num_computed_tokens=0, block_ids=([i],)) for i, r in enumerate(ids)]
        self._qs = np.full(n, prompt_len, dtype=np.int64)
        self._done = np.zeros(n, dtype=np.int64)        # tokens computed before the step, per place
        self._serial = n
        self._out_ids = list(range(churn_output))
        self._hit_blocks = list(range(n, n - (-churn_hits // 16)))  # shared by every new request (16-token blocks)
        self._pos: dict = {}                            # layout: tokens computed per request
        self._sched: list = []
        self.topk = torch.randint(0, 128, (max_tokens, top_k), device=dev, dtype=torch.int32)
        self.hooks = binding.hooks if eager else None
        self.records = [functools.partial(cache.record, layer) for layer in range(layers)]

    def schedule(self, step: int):
        """The scheduler's output for `step` (new, running, finished requests)."""
        from routing_replay.engines.vllm_plugin import scheduler_hooks

        n, first = self.n, step == 0
        if self.layout is not None and not first and not self.churn:
            self._sched = sched = self.layout(step, self.ids)       # [(engine id, tokens)] in batch order
            if not self._pos:
                self._pos.update((r, self.prompt_len) for r in self.ids)
            return sched_out([], dict(sched), sum(t for _, t in sched))
        if first or not self.churn:
            q = self.prompt_len if first else 1
            return sched_out(self._new if first else [], {r: q for r in self.ids}, n * q)
        qs = self._qs
        qs[:] = 1
        fresh, gone = [], set()
        for t in range(self.churn):
            j = (step * self.churn + t) % n
            ids = self.ids
            gone.add(ids[j])
            self.ids = ids[:j] + [ids[j] if self.churn_same_ids else engine_id(self._serial)] + ids[j + 1:]
            self._serial += 1
            out = self.churn_optout and self._serial % self.churn_optout == 0
            hits = self.churn_hits
            fresh.append(SimpleNamespace(req_id=self.ids[j], sampling_params=self._sp_out if out else self._sp,
                                         prompt_token_ids=list(range(hits + self.churn_prompt)), prompt_embeds=None,
                                         num_computed_tokens=hits,
                                         block_ids=(self._hit_blocks + [j + len(self._hit_blocks)],) if hits
                                         else ([j],)))
            qs[j], self._done[j] = self.churn_prompt, hits
        so = sched_out(fresh, dict(zip(self.ids, qs.tolist())), int(qs.sum()))
        so.finished_req_ids = gone
        setattr(so, scheduler_hooks.ATTR, {r: scheduler_hooks.Finished(len(self._out_ids), "stop", self._out_ids)
                                           for r in gone})
        return so

    def lay_out(self, step: int, so) -> int:
        """The runner's persistent batch for `step` as its forward sees it; returns the step's rows."""
        import numpy as np

        n, first = self.n, step == 0
        ib, qsl = self.runner.input_batch, self.runner.query_start_loc.np
        ib.num_reqs, ib.req_ids = n, self.ids
        if self.layout is not None and not first and not self.churn:
            sched, pos = self._sched, self._pos
            ib.num_reqs, ib.req_ids = len(sched), [r for r, _ in sched]
            ib.num_computed_tokens_cpu[:len(sched)] = [pos[r] for r, _ in sched]
            qsl[0] = 0
            np.cumsum([t for _, t in sched], out=qsl[1:len(sched) + 1])
            for r, t in sched:
                pos[r] += t
            return so.total_num_scheduled_tokens
        if self.churn:
            ib.num_computed_tokens_cpu[:n] = self._done
            qsl[0] = 0
            np.cumsum(self._qs, out=qsl[1:n + 1])
            self._done += self._qs
            return int(self._qs.sum())
        q = self.prompt_len if first else 1
        ib.num_computed_tokens_cpu[:n] = 0 if first else self.prompt_len + step - 1
        qsl[:n + 1] = np.arange(n + 1, dtype=np.int32) * q
        return n * q


def run_engine(mode: str, n: int, layers: int, top_k: int, steps: int, *, eager: bool = False,
               prompt_len: int = 16, stamp: bool = False, ring: bool = False, churn: int = 0,
               churn_prompt: int = 512, churn_output: int = 256, churn_same_ids: bool = False,
               churn_optout: int = 0, churn_hits: int = 0, timing: bool = False, on_worker=None, on_producer=None,
               on_step=None, forward=None, layout=None, optout_first: frozenset = frozenset(),
               pace: bool | None = None) -> dict:
    """`steps` steps of a StandinEngine (its arguments: see there): pre_step / the forward / post_step. Returns the
    counts. forward(step, hooks_or_records, topk_ids) replaces the forward. on_worker(cap) once the worker exists
    (before the first step), on_step(step, cap) after each post_step. pace (default: with the ring): wait, after
    a step, while more than one batch queues (an engine's forward gives the producer's thread that time; this
    loop's does not)."""
    eng = StandinEngine(mode, n, layers, top_k, eager=eager, prompt_len=prompt_len, stamp=stamp, ring=ring,
                        churn=churn, churn_prompt=churn_prompt, churn_output=churn_output,
                        churn_same_ids=churn_same_ids, churn_optout=churn_optout, churn_hits=churn_hits,
                        layout=layout, optout_first=optout_first, on_producer=on_producer)
    cap = eng.cap
    cap.timing = timing
    if on_worker is not None:
        on_worker(cap)
    try:
        pace = eng.ring if pace is None else pace
        for step in range(steps):
            so = eng.schedule(step)
            cap.pre_step(so)
            topk = eng.topk[:eng.lay_out(step, so)]
            if forward is not None:
                forward(step, eng.hooks if eng.hooks is not None else eng.records, topk)
            else:
                for layer in eng.hooks if eng.hooks is not None else eng.records:
                    layer(topk)
            cap.post_step(so)
            if on_step is not None:
                on_step(step, cap)
            if pace:
                wait_for(lambda: cap.producer.queued_msgs <= 1 or not cap.producer.healthy)
                assert cap.producer.healthy, "the producer's thread failed"
        cap.flush()
        wait_for(lambda: not cap.producer.queued_msgs or not cap.producer.healthy)
        assert cap.producer.healthy, "the producer's thread failed"
        drained = cap.producer.queued_msgs == 0
        st = cap.stats
        res = {"steps": st.steps, "producer_drained": drained, "active_steps": st.active_steps, "rows": st.rows,
               "prefix_rows": st.prefix_rows, "opened": st.opened, "finished": st.finished,
               "ring_steps": st.ring_steps, "copied_steps": st.copied_steps, "host_steps": st.host_steps,
               "encode_errors": cap.producer.stats.encode_errors, "step_stamp": eng.stamp, "step_ring": eng.ring,
               "stamps_checked": cap.batch.stamps.steps if eng.stamp else 0, "stats": st, "worker": cap}
    finally:
        cap.producer.close(0.1)                     # nobody listens: what it holds goes with it
    return res


def wait_for(cond, timeout: float = 60.0) -> None:
    """Poll cond() until it holds; AssertionError after `timeout` seconds."""
    import time
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.0002)


def watch_producer(events: list, entries: list | None = None):
    """on_producer for run_engine: the worker's calls into its real producer, in order (each call goes on to it):
    ("open", key), ("finish"/"abort", key) and ("rows", {keys}) per batch; the delta entries (key, start, count)
    in `entries`. Steps added raw are resolved as the producer's thread will (their table only gains ids no step
    of theirs holds before that thread reads them)."""
    import numpy as np

    from routing_replay.engines.vllm_plugin.step_batch import host_layouts, resolve_raw_steps

    def attach(p):
        steps, ends, opens = p.publish_steps, p.end_many, p.open_many

        def publish_steps(ids, starts, counts, rows, **kw):
            keys, st, cn = ids, starts, counts
            if getattr(rows, "deferred", False):
                st, cn = host_layouts(rows._parts, rows._raw, starts, counts)
                keys, st, cn, _, _ = resolve_raw_steps(rows._raw, rows._table, rows._forwards, ids, st, cn,
                                                      rows._gone)
            events.append(("rows", {k for step in keys for k in step}))
            if entries is not None:
                for k, a, c in zip(keys, st, cn):
                    entries.extend(zip(k, np.asarray(a).tolist(), np.asarray(c).tolist()))
            return steps(ids, starts, counts, rows, **kw)

        def end_many(items, **kw):
            events.extend((kind, key) for kind, key, *_ in items)
            return ends(items, **kw)

        def open_many(items, **kw):
            events.extend(("open", item[0]) for item in items)
            return opens(items, **kw)
        p.publish_steps, p.end_many, p.open_many = publish_steps, end_many, open_many
    return attach


def watch_batches(monkeypatch):
    """The producer's thread, per batch it reads: each step's rows (by the engine's forward) as published, and the
    forwards of the batches refused (LostHookError) or lost (RingReadLost)."""
    from routing_replay.engines.vllm_plugin import stamps
    from routing_replay.engines.vllm_plugin import step_batch as wmod

    published, refused, behind = {}, [], []
    checked = wmod.BatchedRows._checked

    def watched(self):
        forwards = list(self._forwards)
        try:
            arrays = checked(self)
        except stamps.LostHookError:
            refused.append(forwards)
            raise
        except stamps.RingReadLost:
            behind.append(forwards)
            raise
        for f, a in zip(forwards, arrays):
            published[f] = a.copy()
        return arrays
    monkeypatch.setattr(wmod.BatchedRows, "_checked", watched)
    return published, refused, behind


def step_ids(step: int, t, layers: int):
    """The (rows, layers, top_k) int16 ids a forward of run_engine writes at `step` from its top-k tensor t: they
    differ per step and per layer."""
    import torch
    return torch.stack([((t + 3 * step + 5 * layer) % 128).to(torch.int16) for layer in range(layers)], dim=1).numpy()
