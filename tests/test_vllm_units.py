"""Unit tests of the vLLM plugin's parts that need no engine: settings, request keys, version check, scheduler
notes, binding hooks, step batching, and the HF oracle on a generated model."""

from __future__ import annotations

import contextlib
import functools
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from routing_replay.protocol import wire
from routing_replay.engines.vllm_plugin import keys, plugin, scheduler_hooks, settings
from routing_replay.engines.vllm_plugin.binding import CaptureBinding
from routing_replay.engines.vllm_plugin.stamps import LostHookError
from routing_replay.engines.vllm_plugin.step_batch import StepBatch


@pytest.fixture
def env(monkeypatch):
    for k in (settings.ENV_BROKER, settings.ENV_NPZ_DIR, settings.ENV_SERVE, settings.ENV_REQUESTS,
              settings.ENV_CURVE_SECRET, settings.ENV_BROKER_KEY, settings.ENV_STEP_STAMP):
        monkeypatch.delenv(k, raising=False)
    return monkeypatch


class SP:
    def __init__(self, extra=None):
        self.extra_args = extra


# ---- settings --------------------------------------------------------------------------------------------------


def test_settings_inert_without_broker(env):
    s = settings.current()
    assert not s.enabled
    assert not s.captures(SP())
    # register() without ROUTING_REPLAY_BROKER imports nothing (not even vllm) and wraps nothing
    code = ("import sys, routing_replay.engines.vllm_plugin as p; p.register(); "
            "print(sorted(m for m in ('vllm', 'torch', 'capture', 'producer', 'zmq') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={k: v for k, v in os.environ.items() if not k.startswith("ROUTING_REPLAY_")})
    assert out.stdout.strip() == "[]"


def test_settings_all_and_opt_in(env):
    env.setenv(settings.ENV_BROKER, "tcp://127.0.0.1:5557")
    s = settings.current()
    assert s.enabled and not s.embedded and s.requests == "all"
    assert s.captures(SP()) is True
    assert s.captures(SP({})) is True
    assert s.captures(SP({"return_routed_experts": False})) is False
    assert s.captures(SP({"return_routed_experts": "false"})) is False
    assert s.captures(None) is False                      # pooling requests
    env.setenv(settings.ENV_REQUESTS, "opt-in")
    s = settings.current()
    assert s.requests == "opt-in"
    assert s.captures(SP()) is False
    assert s.captures(SP({"return_routed_experts": True})) is True
    assert s.captures(SP({"return_routed_experts": 1})) is True
    with pytest.raises(ValueError, match="must be a boolean"):
        s.captures(SP({"return_routed_experts": "maybe"}))


@pytest.mark.parametrize("var,value,match", [
    (settings.ENV_REQUESTS, "some", "choose one of all, opt-in"),
    (settings.ENV_BROKER, "localhost:5557", "expected a ZeroMQ endpoint"),
    (settings.ENV_NPZ_DIR, "/tmp/x", "apply to ROUTING_REPLAY_BROKER=embedded only"),
    (settings.ENV_CURVE_SECRET, "/k/engine.key_secret", "got only ROUTING_REPLAY_CURVE_SECRET"),
    (settings.ENV_BROKER_KEY, "/k/broker.key", "got only ROUTING_REPLAY_BROKER_KEY"),
])
def test_settings_refuse_bad_values(env, var, value, match):
    env.setenv(settings.ENV_BROKER, "tcp://127.0.0.1:5557")
    env.setenv(var, value)
    with pytest.raises(ValueError, match=match):
        settings.current()


def test_settings_curve_keys(env):
    env.setenv(settings.ENV_BROKER, "tcp://10.0.0.1:5557")
    env.setenv(settings.ENV_CURVE_SECRET, "/k/engine.key_secret")
    env.setenv(settings.ENV_BROKER_KEY, "/k/broker.key")
    s = settings.current()
    assert (s.curve_secret, s.broker_key) == ("/k/engine.key_secret", "/k/broker.key")
    env.setenv(settings.ENV_BROKER, "embedded")
    with pytest.raises(ValueError, match="apply to an external broker"):
        settings.current()


def test_settings_embedded(env):
    env.setenv(settings.ENV_BROKER, "embedded")
    env.setenv(settings.ENV_NPZ_DIR, "/tmp/out")
    env.setenv(settings.ENV_SERVE, "tcp://127.0.0.1:5559")
    s = settings.current()
    assert s.embedded and s.npz_dir == "/tmp/out" and s.serve == "tcp://127.0.0.1:5559"


def test_settings_step_stamp(env):
    env.setenv(settings.ENV_BROKER, "tcp://10.0.0.1:5557")
    s = settings.current()
    assert (s.step_stamp, s.step_ring, s.ring_needs_kernels) == (True, True, True)   # auto unless set
    for raw, want in (("on", (True, False, False)), ("1", (True, False, False)), ("OFF", (False, False, False)),
                      ("0", (False, False, False)), ("", (True, True, True)), ("Ring", (True, True, False)),
                      (" AUTO ", (True, True, True))):
        env.setenv(settings.ENV_STEP_STAMP, raw)
        s = settings.current()
        assert (s.step_stamp, s.step_ring, s.ring_needs_kernels) == want, raw
    env.setenv(settings.ENV_STEP_STAMP, "maybe")
    with pytest.raises(ValueError, match="ROUTING_REPLAY_STEP_STAMP='maybe': choose auto, on, off or ring"):
        settings.current()


_RING_SLOTS_SCRIPT = r'''
import os, torch
from routing_replay.engines.vllm_plugin import settings
from routing_replay.engines.vllm_plugin.plan import kernels_on, ring_slots
run = kernels_on(torch.device("cpu"))
out = []
os.environ[settings.ENV_BROKER] = "tcp://127.0.0.1:1"
for kernels in ("1", "0"):
    os.environ["ROUTING_REPLAY_RING_KERNELS"] = kernels
    for mode in ("auto", "ring", "on"):
        os.environ[settings.ENV_STEP_STAMP] = mode
        s = settings.current()
        out.append(f"{kernels}:{mode}:{ring_slots(s, 'cpu', 1, run)}:{ring_slots(s, 'cpu', 2, run)}")
print(" ".join(out))
'''


def test_ring_slots_auto_takes_the_ring_only_where_its_triton_kernels_run(env):
    """ROUTING_REPLAY_STEP_STAMP=auto (the default) gives the step ring only where its Triton kernels run and pass
    their bit-for-bit check on the device (here: the CPU under Triton's interpreter, in a fresh process), `ring`
    gives it with either kernels, and neither with more than one data-parallel rank; on a plain CPU (no
    interpreter) `auto` means stamps alone."""
    from routing_replay.engines.vllm_plugin.plan import STEP_RING_SLOTS, kernels_on, ring_slots
    run = kernels_on(torch.device("cpu"))
    env.setenv(settings.ENV_BROKER, "tcp://127.0.0.1:1")

    def read(mode):
        env.setenv(settings.ENV_STEP_STAMP, mode)
        return settings.current()
    auto = read("auto")
    assert (auto.step_stamp, auto.step_ring, auto.ring_needs_kernels) == (True, True, True)
    ring, on = read("ring"), read("on")
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        assert ring_slots(auto, "cpu", 1, run) == 0            # no CUDA, no interpreter: no kernels, no ring
    assert (ring_slots(ring, "cpu", 1, run), ring_slots(ring, "cpu", 2, run), ring_slots(on, "cpu", 1, run)) == \
        (STEP_RING_SLOTS, 0, 0)
    pytest.importorskip("triton")
    e = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", _RING_SLOTS_SCRIPT], env=e, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    S = STEP_RING_SLOTS
    assert r.stdout.split() == [f"1:auto:{S}:0", f"1:ring:{S}:0", "1:on:0:0",
                                "0:auto:0:0", f"0:ring:{S}:0", "0:on:0:0"], r.stdout


# ---- request keys ----------------------------------------------------------------------------------------------


def test_external_key_strips_vllm_suffix_only():
    assert keys.external_key("7-0123abcd") == "7"
    assert keys.external_key("my-id-with-dashes-deadbeef") == "my-id-with-dashes"
    assert keys.external_key("2_chatcmpl-xyz-89abcdef") == "2_chatcmpl-xyz"      # n > 1 child
    assert keys.external_key("cmpl-1-0-0000ffff") == "cmpl-1-0"
    assert keys.external_key("plain", randomized=False) == "plain"
    with pytest.raises(ValueError, match="lacks vLLM's random"):
        keys.external_key("no-suffix")
    with pytest.raises(ValueError):
        keys.external_key("x-0123ABCD")                  # vLLM's suffix is lowercase hex
    assert keys.external_key("-0123abcd") == ""
    for bad in ("0123abcd", "x-0123abcd-y", "x-0123abcd\n", "x-0123abc", ""):    # only the id's last 9 characters
        with pytest.raises(ValueError, match="lacks vLLM's random"):
            keys.external_key(bad)


def test_capture_key_is_the_external_key_or_its_derived_key_on_every_path():
    """capture_key's one-frame path (vLLM's suffix, an ASCII key within the limit) and the full one give what the
    definition says: external_key, then record_key_for where request_id_problem refuses the key; and raise as
    external_key does."""
    from routing_replay.protocol.ids import record_key_for
    from routing_replay.protocol.wire import MAX_REQUEST_ID_BYTES, request_id_problem

    ids = ["7-0123abcd", "2_chatcmpl-xyz-89abcdef", "-0123abcd", "a" * MAX_REQUEST_ID_BYTES + "-0123abcd",
           "a" * (MAX_REQUEST_ID_BYTES + 1) + "-0123abcd", "é" * 10 + "-0123abcd", "é" * 600 + "-0123abcd",
           "x\ud800y-0123abcd", "plain-0123abcd",
           # one character off vLLM's suffix: every path must refuse it as external_key does
           "x-0123ABCD", "x-0123abcg", "x_0123abcd", "x-+123abcd", "x- 123abcd", "x-0123abc ", "x-0123 bcd",
           "x-0123abc\n", "x-\u0661123abcd", "x--0123abcd", "x-0123abcd-", "x-0x23abcd", "x-ffffffff"]
    for randomized in (True, False):
        for rid in ids + ["plain", "a" * MAX_REQUEST_ID_BYTES, "a" * (MAX_REQUEST_ID_BYTES + 1), ""]:
            try:
                ext = keys.external_key(rid, randomized)
            except ValueError:
                with pytest.raises(ValueError, match="lacks vLLM's random"):
                    keys.capture_key(rid, randomized)
                continue
            problem = request_id_problem(ext)
            want = (ext, None) if problem is None else (record_key_for(ext), problem)
            assert keys.capture_key(rid, randomized) == want, (rid[:20], randomized)
    assert keys.capture_key("7-0123abcd") == ("7", None)
    assert keys.capture_key("-0123abcd")[0].startswith("rr-sha256-")      # the empty key is derived
    assert keys.capture_key("é" * 600 + "-0123abcd")[1] is not None           # 1,200 UTF-8 bytes: derived


def test_record_key_matches_vllm_child_naming():
    assert keys.record_key("7") == "7"
    assert keys.record_key("7", 0, 1) == "7"
    assert [keys.record_key("7", i, 3) for i in range(3)] == ["0_7", "1_7", "2_7"]
    with pytest.raises(ValueError):
        keys.record_key("7", 3, 3)


def test_vllm_suffix_format_is_what_we_strip():
    """Pin the vLLM behaviour the key mapping relies on."""
    from types import SimpleNamespace

    from vllm.v1.engine.input_processor import InputProcessor

    req = SimpleNamespace(request_id="abc-1", external_req_id=None)
    InputProcessor.assign_request_id(req)
    assert req.external_req_id == "abc-1"
    assert req.request_id.startswith("abc-1-") and len(req.request_id) == len("abc-1") + 9
    assert keys.external_key(req.request_id) == "abc-1"


def test_check_version(caplog):
    """The version gate is the start-up self-check: tested versions pass quietly, others pass with a WARNING
    naming the tested range as long as every hook is there (tests/test_vllm_selfcheck.py has the failures)."""
    pytest.importorskip("vllm")

    def ours():                 # the first check imports vLLM modules, which may log warnings of their own
        return [r.getMessage() for r in caplog.records if r.name == "vllm.routing_replay"]

    for ok in ("0.32.0", "0.25.1", "0.25.1+cu129", "0.32.0+cpu", "0.27.0", "0.30.0"):
        with caplog.at_level("WARNING", logger="vllm.routing_replay"):
            caplog.clear()
            plugin.check_version(ok)
        assert ours() == [], ok
    for untested in ("0.25.0", "0.31.2", "0.33.0", "1.0.0"):
        with caplog.at_level("WARNING", logger="vllm.routing_replay"):
            caplog.clear()
            plugin.check_version(untested)
        assert ours() == [
            f"routing-replay: vLLM {untested} is outside the tested versions (0.25.1 and 0.27.0 to 0.32.0); "
            f"running because the start-up self-check found every hook ({len(plugin.selfcheck.startup_needs())})"]


# ---- scheduler notes -------------------------------------------------------------------------------------------


def test_scheduler_notes_travel_with_the_next_schedule(env):
    env.setenv(settings.ENV_BROKER, "embedded")
    from vllm.v1.engine import FinishReason
    from vllm.v1.request import RequestStatus

    class Out:
        pass

    class FakeScheduler:
        def __init__(self):
            self.freed = []

        def _free_request(self, request, delay_free_blocks=False):
            self.freed.append(request.request_id)

        def schedule(self, throttle=False):
            return Out()

    class Req:
        def __init__(self, rid, status, out, extra=None):
            self.request_id, self.status, self.output_token_ids = rid, status, out
            self.sampling_params = SP(extra)

        def get_finished_reason(self):
            return {RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
                    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT}.get(self.status)

    scheduler_hooks.install(FakeScheduler)
    scheduler_hooks.install(FakeScheduler)             # idempotent
    s = FakeScheduler()
    assert getattr(s.schedule(), scheduler_hooks.ATTR) == {}
    s._free_request(Req("a-00000000", RequestStatus.FINISHED_STOPPED, [5, 6, 7]))
    s._free_request(Req("b-00000000", RequestStatus.FINISHED_ABORTED, []))
    s._free_request(Req("c-00000000", RequestStatus.FINISHED_STOPPED, [1], {"return_routed_experts": False}))
    assert s.freed == ["a-00000000", "b-00000000", "c-00000000"]
    notes = getattr(s.schedule(), scheduler_hooks.ATTR)
    assert notes == {"a-00000000": scheduler_hooks.Finished(3, "stop", [5, 6, 7]),
                     "b-00000000": scheduler_hooks.Finished(0, "abort", [])}
    assert getattr(s.schedule(), scheduler_hooks.ATTR) == {}


# ---- binding ---------------------------------------------------------------------------------------------------


class FakeRouter:
    def __init__(self):
        self.capture_fn = None

    def set_capture_fn(self, fn):
        self.capture_fn = fn


class FakeLayer:
    def __init__(self, lid):
        self.layer_id, self.router = lid, FakeRouter()
        self.module = self


def _taking(taken: list, sigs: list | None = None):
    """A binding's take_step as the worker's: takes the list's tensors (into `taken`; the (shape, dtype) the binding
    passed into `sigs`), empties it."""
    def take_step(held, sig):
        taken.append(held[:])
        if sigs is not None:
            sigs.append(sig)
        held[:] = [None] * len(held)
    return take_step


def test_binding_records_gates_counts_and_chains():
    got = []
    foreign = []
    layers = [FakeLayer(0), FakeLayer(2), FakeLayer(3)]
    layers[1].router.capture_fn = foreign.append          # another capturer was there first
    b = CaptureBinding(layers, lambda i, ids: got.append((i, ids.tolist())), gate=True)
    b.bind()
    assert b.bound()
    ids = torch.tensor([[1, 2]])
    for layer in layers:
        layer.router.capture_fn(ids)
    assert got == [(0, [[1, 2]]), (1, [[1, 2]]), (2, [[1, 2]])] and b.calls == 3
    assert len(foreign) == 1                               # chained, still called
    b.active, b.calls = False, 0
    layers[0].router.capture_fn(ids)
    assert b.calls == 0 and len(got) == 3                  # gated off: nothing recorded
    b.bind()                                               # re-bind keeps the foreign hook, not ours twice
    b.active = True
    layers[1].router.capture_fn(ids)
    assert len(foreign) == 2 and b.calls == 0 and len(got) == 3     # held until the last layer's hook...
    b.drain()                                              # ...or until the step ends without it
    assert b.calls == 1 and got[3:] == [(1, [[1, 2]])] and b.held == [None] * 3
    taken = []
    b.take_step = _taking(taken)
    b.drain()                                              # nothing held (the step's last hook drained): no-op
    assert b.calls == 1 and taken == [] and len(got) == 4
    layers[2].router.capture_fn(ids)                       # the last layer's hook hands the step over
    assert b.calls == 2 and taken == [[None, None, ids]] and b.held == [None] * 3
    b.take_step = None
    layers[2].router.set_capture_fn(None)                  # lost hook
    assert not b.bound()
    b.unbind()
    assert layers[0].router.capture_fn is None and layers[1].router.capture_fn == foreign.append


def test_eager_hooks_of_every_layer_keep_their_tensor_without_python_until_the_step_is_drained():
    """gate=True: a layer's hook is C (list.__setitem__ on the held list) unless it chains a foreign hook or slices
    a data-parallel batch; the last layer's too. A C hook keeps its tensor as the router made it (strided too),
    also on a step that is not captured; clear() lets go of it; a captured step's list waits for drain() (the
    worker's post_step), where a Python last hook (no c_hooks) drains it at once."""
    import types

    layers = [FakeLayer(0), FakeLayer(1), FakeLayer(2), FakeLayer(3)]
    foreign = []
    layers[1].router.capture_fn = foreign.append
    taken = []
    b = CaptureBinding(layers, lambda i, ids: None, gate=True, take_step=_taking(taken))
    b.bind()                                                # (not asked for: torch.compile may trace the hooks)
    assert {type(layer.router.capture_fn) for layer in layers if layer.layer_id != 1} == {types.FunctionType}
    base = torch.arange(24).reshape(3, 8)
    strided = base[:, ::2]                                  # (3, 4), not contiguous: kept as it is
    b.active, b.min_rows = True, 3                          # Python hooks: the last one drains in the forward
    for layer in layers:
        layer.router.capture_fn(strided)
    assert len(taken) == 1 and b.calls == 4 and b.held == [None] * 4
    b.c_hooks = True
    b.bind()
    kinds = [type(layer.router.capture_fn) for layer in layers]
    assert kinds == [functools.partial, types.FunctionType, functools.partial, functools.partial]   # foreign: 1
    assert b.bound()
    b.active, b.calls = False, 0                            # a step not captured
    for layer in layers:
        layer.router.capture_fn(strided)
    assert b.held[0] is strided and b.held[2] is strided and b.held[3] is strided and b.held[1] is None
    assert len(taken) == 1 and len(foreign) == 2
    b.clear()
    assert b.held == [None] * 4
    b.active = True                                         # a captured step: every layer held until drain()
    for layer in layers:
        layer.router.capture_fn(strided)
    assert len(taken) == 1 and all(t is strided for t in b.held)
    b.drain()
    assert len(taken) == 2 and all(t is strided for t in taken[1]) and b.calls == 4 and b.held == [None] * 4
    b.unbind()
    assert layers[0].router.capture_fn is None and layers[1].router.capture_fn == foreign.append
    dp = CaptureBinding(layers[:2], lambda i, ids: None, gate=True, dp_size=2, c_hooks=True)
    dp.bind()                                               # data parallel: every hook in Python (local_rows)
    assert {type(layer.router.capture_fn) for layer in layers[:2]} == {types.FunctionType}


def test_the_last_hook_passes_the_shape_and_dtype_its_layers_share_or_none():
    """gate=True, the drain (the last layer's Python hook's, or post_step's after C hooks): where every layer holds
    a 2-D tensor of one shape and dtype that
    covers the step, take_step gets that (shape, dtype) (checked at C speed, no loop over the layers) and every
    layer counts; otherwise (a layer missing, shapes or dtypes that differ, too few rows, not 2-D) None, and
    `calls` counts the layers whose tensor covers the step, as before."""
    layers = [FakeLayer(i) for i in range(4)]
    taken, sigs = [], []
    b = CaptureBinding(layers, lambda i, ids: None, gate=True, take_step=_taking(taken, sigs), c_hooks=True)
    b.bind()
    b.active = True
    full, short = torch.zeros(3, 2, dtype=torch.int64), torch.zeros(2, 2, dtype=torch.int64)
    cases = [
        ("uniform", [full] * 4, (torch.Size([3, 2]), torch.int64), 4),
        ("dtypes differ", [full, full.to(torch.int32), full, full], None, 4),
        ("one layer short", [full, short, full, full], None, 3),
        ("all short", [short] * 4, None, 0),
        ("not 2-D", [torch.zeros(3, dtype=torch.int64)] * 4, None, 4),
        ("a layer missing", [full, None, full, full], None, 3),
    ]
    for name, tensors, sig, calls in cases:
        b.calls, b.min_rows = 0, 3
        for layer, t in zip(layers, tensors):
            if t is not None:
                layer.router.capture_fn(t)
        assert len(taken) == len(sigs) == cases.index((name, tensors, sig, calls)), name    # C hooks: held
        b.drain()
        assert sigs[-1] == sig and b.calls == calls, name
        assert all(x is y for x, y in zip(taken[-1], tensors)) and b.held == [None] * 4, name
    assert len(taken) == len(cases)
    b.drain()                                               # nothing held: take_step is not called
    assert len(taken) == len(cases)
    b.active = False
    layers[0].router.capture_fn(full)                       # a C hook keeps it; the step's end drains it
    b.active, b.calls = True, 0
    b.drain()
    assert sigs[-1] is None and b.calls == 1 and taken[-1] == [full, None, None, None]


@pytest.mark.bench
def test_the_eager_drain_bench_runs_the_real_hooks_and_counts_every_layer(tmp_path):
    """bench/eager_drain.py (docs/PERFORMANCE.md): the real binding and worker, every step checked (all
    layers counted, the step taken by reference); its JSON is what it printed."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "drain.json"
    script = Path(__file__).resolve().parents[1] / "bench" / "eager_drain.py"
    p = subprocess.run([sys.executable, str(script), "--layers", "48", "--steps", "50", "--reps", "2", "--json",
                        str(out)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    r = json.loads(out.read_text())
    assert json.loads(p.stdout) == r
    assert (r["layers"], r["tokens"], r["top_k"], r["steps"], len(r["reps_us"])) == (48, 64, 8, 50, 2)
    assert r["us_per_step"] > 0


def test_the_runners_batch_is_read_directly_only_where_its_properties_hand_out_those_attributes():
    """batch_refs: vLLM's own InputBatch hands out `_req_ids` through `req_ids` and counts `req_id_to_index` in
    `num_reqs`, so the engine thread may read those two; a batch whose `req_ids` makes a new list, or that counts
    otherwise, or lacks them, is read through its properties."""
    import inspect

    import torch
    from vllm.v1.worker.gpu_input_batch import InputBatch

    from routing_replay.engines.vllm_plugin.runners import batch_refs

    kw = dict(max_num_reqs=4, max_model_len=64, max_num_batched_tokens=64, device=torch.device("cpu"),
              vocab_size=100, block_sizes=[16], max_num_blocks_per_req=[4])
    if "kernel_block_sizes" in inspect.signature(InputBatch.__init__).parameters:     # (vLLM 0.27 to 0.31)
        kw["kernel_block_sizes"] = [16]

    class Copying(InputBatch):
        @property
        def req_ids(self):
            return list(self._req_ids)

    class Counting(InputBatch):
        @property
        def num_reqs(self):
            return len(self.req_id_to_index) + 1

    class Other:
        req_ids, num_reqs = ["a"], 1

    ib = InputBatch(**kw)
    assert batch_refs(ib) == (ib, True)
    for b in (Copying(**kw), Counting(**kw), Other()):
        assert batch_refs(b) == (b, False)


def test_an_eager_cpu_step_goes_by_reference_only_when_uniform_and_captured():
    """HostPath.take_step (step_paths.py; binding.drain's target on an eager CPU engine): a captured step whose layers all
    hold tensors of one shape and integer dtype is kept as it is (HostRows later), nothing written to the cache;
    with a prefix store (fill) such a step is kept as it is and also written to the cache (the store's rows come
    from there); mixed dtypes, a step that only writes the prefix store or one not captured go into the cache layer
    by layer, and a tensor of the wrong shape is refused there, named."""
    from routing_replay.capture import RoutingCache
    from tests.standins import worker_capture

    cap = worker_capture(settings.Settings(broker="ipc://unused"))
    cap.active = True
    uniform = [torch.full((4, 2), layer, dtype=torch.int64) for layer in range(3)]
    held = list(uniform)
    cap.path.take_step(held)
    assert held == [None] * 3 and all(a is b for a, b in zip(cap.path.host_step[0], uniform))
    assert cap.path.host_step[1] == 4 * 2 * 8                       # the bytes of one layer's tensor
    assert (cap.path.cache.step_rows(4) == -1).all()                # nothing copied
    for case in ("mixed", "fill", "store only", "not captured"):
        cap.path.host_step, cap.path.cache = None, RoutingCache(16, 3, 2)
        cap.fill, cap.active = case in ("fill", "store only"), case in ("mixed", "fill")
        held = [uniform[0], uniform[1].to(torch.int32), uniform[2]] if case == "mixed" else list(uniform)
        cap.path.take_step(held)
        assert held == [None] * 3, case
        if case == "fill":
            host = cap.path.host_step
            assert all(a is b for a, b in zip(host[0], uniform)) and host[1] == 4 * 2 * 8
        else:
            assert cap.path.host_step is None, case
        assert cap.path.cache.step_rows(4).tolist() == [[[layer] * 2] * 4 for layer in range(3)], case
    cap.fill, cap.active, cap.path.cache = False, True, RoutingCache(16, 3, 2)
    cap.path.host_step = None
    held = list(uniform)
    cap.path.take_step(held, (torch.Size([4, 2]), torch.int64))        # the binding checked the shapes already
    assert held == [None] * 3 and all(a is b for a, b in zip(cap.path.host_step[0], uniform))
    assert cap.path.host_step[1] == 4 * 2 * 8 and (cap.path.cache.step_rows(4) == -1).all()
    cap.path.host_step = None
    with pytest.raises(ValueError, match=r"layer 0: top-k ids of shape \(4, 3\)"):
        cap.path.take_step([torch.zeros(4, 3, dtype=torch.int64)] * 3)


def test_a_queue_bound_counts_the_router_tensors_an_eager_cpu_batch_holds(tmp_path):
    """A batch of HostRows parts (an eager CPU engine's steps by reference) holds the routers' whole-step int32
    tensors until the producer's thread takes it: the queue bound counts those bytes too (a bound that the int16
    rows alone fit refuses the batch, its positions reported lost), and the thread gives them back when it takes
    the batch (queued_bytes returns to 0)."""
    import zmq

    from routing_replay.capture import AsyncCopier, HostRows, RoutingCache
    from routing_replay.producer import Producer
    from tests.test_producer_faults import FakeBroker, wait_for
    L, K, N = 3, 2, 10                      # each step: 10 tokens routed, requests k0 (rows 0..3) and k1 (rows 6..8)
    copier = AsyncCopier(RoutingCache(64, L, K), num_slots=2, max_rows=32)

    def batch_of(steps: int) -> tuple:
        b = StepBatch(K)
        want = []
        for s in range(steps):
            tensors = [torch.arange(N * K, dtype=torch.int32).reshape(N, K) + 100 * layer + 1000 * s
                       for layer in range(L)]
            runs = [(0, 4), (6, 3)]
            want.append(np.concatenate([np.stack([t.numpy()[a:a + n] for t in tensors], axis=1) for a, n in runs]))
            b.add(HostRows(tensors, runs, K), ["k0", "k1"], np.array([4 * s, 3 * s]), np.array([4, 3]), forward=s + 1)
        assert b.rows == 7 * steps and b.extra == steps * (L * N * K * 4 - 7 * L * K * 2)
        return b.hand_over(copier, steps), np.concatenate(want).astype(np.int16)

    rows_bytes, extra = 2 * 7 * L * K * 2, 2 * (L * N * K * 4 - 7 * L * K * 2)     # two steps: 168 and 312 bytes
    ctx = zmq.Context()
    fake = FakeBroker(ctx, f"ipc://{tmp_path}/f")
    # the int16 rows fit the bound, the tensors held with them do not
    p = Producer(f"ipc://{tmp_path}/f", num_layers=L, top_k=K, context=ctx, linger_ms=0,
                 max_queue_bytes=rows_bytes + extra - 1)
    try:
        p.open_many([("k0", 16, 0, None, False), ("k1", 16, 0, None, False)], ids_checked=True)
        (ids, starts, counts, rows), _ = batch_of(2)
        assert rows.extra_nbytes == extra and rows.shape == (14, L, K)
        assert p.publish_steps(ids, starts, counts, rows, checked=True) is False
        assert (p.stats.dropped_msgs, p.stats.dropped_rows) == (1, 14)
        p.close(timeout_s=1)
        p = Producer(f"ipc://{tmp_path}/f", num_layers=L, top_k=K, context=ctx, linger_ms=0,
                     max_queue_bytes=rows_bytes + extra)
        got = [fake.recv() for _ in range(2)]           # the first producer's opens (its rows were dropped)
        assert [(h.kind, h.key) for h, _ in got] == [("open", "k0"), ("open", "k1")]
        p.open_many([("k0", 16, 0, None, False), ("k1", 16, 0, None, False)], ids_checked=True)
        (ids, starts, counts, rows), want = batch_of(2)
        assert p.publish_steps(ids, starts, counts, rows, checked=True) is True
        got = [fake.recv() for _ in range(3)]
        assert [(h.kind, h.key) for h, _ in got] == [("open", "k0"), ("open", "k1"),
                                                     ("delta", ["k0", "k1", "k0", "k1"])]
        d = wire.parse_delta(got[2][0])
        assert d.starts.tolist() == [0, 0, 4, 3] and d.counts.tolist() == [4, 3, 4, 3]
        payload = np.frombuffer(b"".join(bytes(f) for f in got[2][1]), np.int16).reshape(14, L, K)
        np.testing.assert_array_equal(payload, want)
        wait_for(lambda: p.queued_msgs == 0)
        assert p.queued_bytes == 0 and p.stats.dropped_msgs == 0 and p.stats.encode_errors == 0
    finally:
        p.close(timeout_s=1)
        fake.close()
        ctx.term()


_CPU_MOE_SRC = """
import torch

def select_experts(hidden_states, router_logits, top_k, use_grouped_topk=False, renormalize=True, **kw):
    vals, ids = torch.topk(router_logits, k=top_k, dim=-1, sorted=False)
    return torch.softmax(vals, dim=-1), ids.to(torch.int32)

class CPUFusedMOE:                      # vLLM 0.27's shape: __call__ routes with the module's select_experts
    def __init__(self, layer):
        self.isa = "vec"

    def __call__(self, layer, x, use_grouped_topk, top_k, router_logits, renormalize, *args, **kwargs):
        topk_weights, topk_ids = select_experts(hidden_states=x, router_logits=router_logits, top_k=top_k,
                                                use_grouped_topk=use_grouped_topk, renormalize=renormalize)
        return x * topk_weights.sum(-1, keepdim=True)

class SGLFusedMOE(CPUFusedMOE):
    pass
"""


def test_vllm_027_cpu_monolithic_moe_is_hooked(monkeypatch):
    """vLLM 0.27 on CPU routes inside quant_method.cpu_fused_moe (monolithic): the binding shim hands the ids
    of cpu_fused_moe.select_experts to the layer's router.capture_fn, and only while that layer runs."""
    import types

    from routing_replay.engines.vllm_plugin import binding

    fake = types.ModuleType("vllm.model_executor.layers.fused_moe.cpu_fused_moe")
    exec(_CPU_MOE_SRC, fake.__dict__)
    monkeypatch.setitem(sys.modules, fake.__name__, fake)

    class Runner(torch.nn.Module):
        def __init__(self, lid, qm):
            super().__init__()
            self.layer_id, self.router, self.is_monolithic = lid, FakeRouter(), True
            self.router.top_k, self.router.global_num_experts = 2, 8
            self.routed_experts = types.SimpleNamespace(quant_method=qm)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = Runner(0, types.SimpleNamespace(cpu_fused_moe=fake.CPUFusedMOE(None)))
            self.b = Runner(1, types.SimpleNamespace(cpu_fused_moe=fake.SGLFusedMOE(None)))

    monkeypatch.setattr(binding, "_moe_runner_cls", lambda: Runner)
    model = Model()
    layers = binding.find_moe_layers(model)
    assert [m.layer_id for m in layers] == [0, 1] and [m.top_k for m in layers] == [2, 2]
    got = []
    b = CaptureBinding(layers, lambda i, ids: got.append((i, sorted(ids[0].tolist()))))
    b.bind()
    x = torch.ones(1, 4)
    logits = torch.tensor([[0.0, 5.0, 0.0, 0.0, 0.0, 0.0, 4.0, 0.0]])
    qm_a, qm_b = model.a.routed_experts.quant_method, model.b.routed_experts.quant_method
    assert qm_a.cpu_fused_moe.isa == "vec"                 # the stand-in forwards attributes
    assert torch.equal(qm_b.cpu_fused_moe(model.b, x, False, 2, logits, True), x)
    qm_a.cpu_fused_moe(model.a, x, False, 2, logits, True)
    assert got == [(1, [1, 6]), (0, [1, 6])] and b.calls == 2
    fake.select_experts(hidden_states=x, router_logits=logits, top_k=2)
    assert len(got) == 2                                   # outside a layer's scope: nobody's routing
    wrapped = qm_a.cpu_fused_moe
    assert binding.find_moe_layers(model)[0].module is model.a and qm_a.cpu_fused_moe is wrapped   # idempotent
    model.a.routed_experts.quant_method = types.SimpleNamespace(cpu_fused_moe=object())          # another kernel
    with pytest.raises(NotImplementedError, match="layer a uses the monolithic kernel SimpleNamespace"):
        binding.find_moe_layers(model)


def test_vllm_028_cpu_monolithic_experts_are_hooked(monkeypatch):
    """vLLM 0.28/0.29 on CPU route inside CPUUnquantizedExperts._select_experts (monolithic): each layer's experts
    object gets an instance-level wrapper that hands the ids to that layer's router.capture_fn."""
    import types

    from routing_replay.engines.vllm_plugin import binding

    fake = types.ModuleType("vllm.model_executor.layers.fused_moe.experts.cpu_moe")

    class CPUUnquantizedExperts:
        def _select_experts(self, hidden_states, router_logits, num_expert_group, topk_group, bias, scale):
            vals, ids = torch.topk(router_logits, k=2, dim=-1, sorted=False)
            return vals, ids.to(torch.int32)

        def apply(self, hidden_states, router_logits):
            w, ids = self._select_experts(hidden_states, router_logits, None, None, None, None)
            return hidden_states

    fake.CPUUnquantizedExperts = CPUUnquantizedExperts
    monkeypatch.setitem(sys.modules, fake.__name__, fake)

    class Runner(torch.nn.Module):
        def __init__(self, lid):
            super().__init__()
            self.layer_id, self.router, self.is_monolithic = lid, FakeRouter(), True
            self.router.top_k, self.router.global_num_experts = 2, 8
            kernel = types.SimpleNamespace(fused_experts=CPUUnquantizedExperts())
            self.routed_experts = types.SimpleNamespace(quant_method=types.SimpleNamespace(moe_kernel=kernel))

    model = torch.nn.Module()
    model.a, model.b = Runner(0), Runner(1)
    monkeypatch.setattr(binding, "_moe_runner_cls", lambda: Runner)
    got = []
    layers = binding.find_moe_layers(model)
    assert [m.name for m in layers] == ["a", "b"]
    b = CaptureBinding(layers, lambda i, ids: got.append((i, sorted(ids[0].tolist()))))
    b.bind()
    x = torch.ones(1, 4)
    logits = torch.tensor([[0.0, 0.0, 3.0, 0.0, 0.0, 2.0, 0.0, 0.0]])
    ea = model.a.routed_experts.quant_method.moe_kernel.fused_experts
    eb = model.b.routed_experts.quant_method.moe_kernel.fused_experts
    eb.apply(x, logits)
    ea.apply(x, logits)
    assert got == [(1, [2, 5]), (0, [2, 5])] and b.calls == 2
    wrapped = ea._select_experts
    binding.find_moe_layers(model)
    assert ea._select_experts is wrapped                   # idempotent
    ea.apply(x, logits)
    assert len(got) == 3                                   # hooked once, not twice


# ---- step batching ---------------------------------------------------------------------------------------------


class FakePending:
    def __init__(self, rows, dropped=False):
        self.rows = rows
        self.shape, self.dtype, self.dropped = rows.shape, rows.dtype, dropped
        self.stamped = False
        self.released = 0

    def result(self):
        return self.rows

    def release(self):
        self.released += 1


def test_step_batch_concatenates_in_order_and_releases_all():
    a = FakePending(np.arange(2 * 3 * 2, dtype=np.int16).reshape(2, 3, 2))
    b = FakePending(np.arange(100, 100 + 3 * 3 * 2, dtype=np.int16).reshape(3, 3, 2))
    batch = StepBatch()
    batch.add(a, ["x", "y"], [10, 20], [1, 1])
    batch.add(b, ["x", "y"], [11, 21], [1, 2])
    ks, starts, counts, rows = batch.take()
    assert (ks, starts, counts) == (["x", "y", "x", "y"], [10, 20, 11, 21], [1, 1, 1, 2])
    assert rows.shape == (5, 3, 2) and not rows.dropped
    assert np.array_equal(rows.result(), np.concatenate([a.rows, b.rows]))
    rows.release()
    assert a.released == b.released == 1
    assert batch.parts == [] and batch.rows == 0


def test_step_batch_keeps_references_per_step_and_flattens_arrays_once():
    """Decode steps hand the same key list and their positions as arrays; take() gives flat lists of ints."""
    keys = ["x", "y", "z"]
    parts = [FakePending(np.full((3, 3, 2), i, dtype=np.int16)) for i in range(3)]
    batch = StepBatch()
    batch.add(parts[0], keys, np.array([5, 9, 0], np.int32), np.array([1, 1, 1], np.int32))
    batch.add(parts[1], keys, np.array([6, 10, 1], np.int32), np.array([1, 1, 1], np.int32))
    batch.add(parts[2], ["w"], [0], [3], strict=False)            # a prefix gather: lists
    assert batch.keys[0] is batch.keys[1] is keys and batch.rows == 9
    ks, starts, counts, rows = batch.take()
    assert (ks, starts, counts) == (["x", "y", "z", "x", "y", "z", "w"], [5, 9, 0, 6, 10, 1, 0], [1] * 6 + [3])
    assert all(type(v) is int for v in starts + counts)
    assert np.array_equal(rows.result(), np.concatenate([p.rows for p in parts]))
    one = StepBatch()
    one.add(parts[0], keys, np.array([5, 9, 0], np.int32), np.array([1, 1, 1], np.int32))
    ks, starts, counts, _ = one.take()
    assert ks == keys and ks is not keys and (starts, counts) == ([5, 9, 0], [1, 1, 1])
    assert all(type(v) is int for v in starts + counts)


def test_step_batch_refuses_unwritten_rows():
    r = np.zeros((2, 3, 2), np.int16)
    r[1, 2] = -1
    batch = StepBatch()
    batch.add(FakePending(r), ["x"], [0], [2])
    _, _, _, rows = batch.take()
    with pytest.raises(LostHookError, match="never written by a router .*row 1 of 2, local MoE layer 2"):
        rows.result()


def _stamped_step(cache, copier, n: int, seed: int, layers=None):
    """One step of n tokens through a stamped cache (every layer, or only `layers`) and the copier: its rows."""
    g = torch.Generator().manual_seed(seed)
    for layer in (range(cache.num_layers) if layers is None else layers):
        cache.record(layer, torch.randint(0, 8, (n, cache.top_k), generator=g))
    cache.flush()
    return copier.submit([(0, n)])


@pytest.mark.parametrize("K", [2, 8])
def test_step_stamps_pass_steps_written_by_their_forward_and_refuse_stale_ones(K):
    """The producer-side check of step stamps (the graph-mode replacement of the -1 fill): steps whose forward
    wrote every layer pass, in any number of batches and with unchecked forwards between them; a step whose
    forward missed a layer, or did not run the hooks at all, is refused, also after forwards that were not
    checked (steps no captured request ran in)."""
    from routing_replay.capture import AsyncCopier, RoutingCache
    cache = RoutingCache(64, 3, K, stamp=True)
    copier = AsyncCopier(cache, num_slots=4, max_rows=32)
    batch = StepBatch(K, stamped=True)
    assert StepBatch(K).stamps is None
    batch.stamps.baseline(cache.stamp_value(), 0)          # after warm-up: counter -1, no forward yet
    forward = 0
    for b in range(3):
        for i in range(4):
            forward += 1
            batch.add(_stamped_step(cache, copier, 8 + i, seed=10 * b + i), ["x"], [0], [8 + i], forward=forward)
        forward += 1                                       # a forward no captured request ran in: not checked
        _stamped_step(cache, copier, 5, seed=100 + b).release()
        _, _, _, rows = batch.take_parts()
        assert rows.result().shape == (sum(8 + i for i in range(4)), 3, K)
        rows.release()
    assert batch.stamps.steps == 12 and batch.stamps.offset == (-1) & batch.stamps.mask
    # a forward whose hooks did not run at all (a graph replayed without them), right after an unchecked forward
    # whose hooks did: the stamp moved on, but one flush fewer than forwards
    forward += 2
    _stamped_step(cache, copier, 8, seed=7).release()
    batch.add(copier.submit([(0, 8)]), ["x"], [0], [8], forward=forward)
    _, _, _, rows = batch.take_parts()
    with pytest.raises(LostHookError, match=f"forward {forward} carry step stamp 15: 1 complete flush"):
        rows.result()
    rows.release()
    # the refusal took the device's count: the next forward is checked against it (no baseline needed)
    mask = batch.stamps.mask
    assert batch.stamps.resyncs == 1 and batch.stamps.offset == (cache.stamp_value() - forward) & mask
    # a forward that missed one layer: its flush adds nothing (the rows of the missed layer would be stale)
    forward += 1
    batch.add(_stamped_step(cache, copier, 8, seed=99, layers=[0, 2]), ["x"], [0], [8], forward=forward)
    _, _, _, rows = batch.take_parts()
    with pytest.raises(LostHookError, match="1 complete flush"):
        rows.result()
    rows.release()
    assert batch.stamps.resyncs == 2 and batch.stamps.offset == (cache.stamp_value() - forward) & mask
    # a forward the engine did not launch (a data-parallel dummy batch) adds a flush and no forward: tolerated
    forward += 1
    _stamped_step(cache, copier, 3, seed=8).release()
    batch.add(_stamped_step(cache, copier, 8, seed=9), ["x"], [0], [8], forward=forward)
    _, _, _, rows = batch.take_parts()
    rows.result()
    rows.release()
    assert batch.stamps.steps == 13
    # lanes of one step that differ (rows written by something else than the flush): refused
    p = _stamped_step(cache, copier, 4, seed=5)
    p.result()
    p.stamps()[2, 0] += 1
    batch.add(p, ["x"], [0], [4], forward=forward + 1)
    _, _, _, rows = batch.take_parts()
    with pytest.raises(LostHookError, match="different step stamps .*row 2 of 4"):
        rows.result()
    rows.release()
    assert copier.in_flight_rows == 0


@pytest.mark.parametrize("K,bits", [(2, 32), (8, 64)])
def test_step_stamps_wrap_around_their_width(K, bits):
    check = StepBatch(K, stamped=True).stamps
    lane = np.uint32 if bits == 32 else np.uint64
    top = (1 << bits) - 1

    def stamps(v):
        return np.full((3, K * 16 // bits), v & top, dtype=lane).view(np.int16).reshape(3, K)

    check.baseline(top - 1, 10)              # the counter wraps while the forward count does not
    for i, v in enumerate((top, 0, 1, 3)):   # the last one after an unchecked dummy forward: offset + 1
        check(stamps(v), 11 + i)
    assert check.steps == 4 and check.offset == (3 - 14) & top
    with pytest.raises(LostHookError, match="1 complete flush"):
        check(stamps(3), 15)                 # no flush for forward 15
    check.baseline(5, 0)
    with pytest.raises(LostHookError, match="2 complete flush"):
        check(stamps(4), 1)
    check.baseline(5, 0)                     # far ahead (half the range): a dummy-run gap, not a lost hook
    check(stamps(5 + (1 << (bits - 1)) - 1), 0)


# ---- oracle ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mixed_model():
    from routing_replay.apps.vllm_harness import tiny_model
    return tiny_model("qwen3_moe_mixed")


def _record_from(oracle, prompt, output, cached):
    ref = oracle.routing(np.array(prompt + output))
    ref[:cached] = -1
    ref[-1] = -1
    P = len(prompt)
    return wire.Record("r", ref[:P].copy(), ref[P:].copy(), cached, np.array(oracle.layer_ids, np.int32), True,
                       prompt_token_ids=np.array(prompt, np.int32), output_token_ids=np.array(output, np.int32))


def test_oracle_accepts_its_own_routing_and_catches_errors(mixed_model):
    from routing_replay.apps.oracle import Oracle, verify

    o = Oracle(str(mixed_model))
    assert o.layer_ids == [0, 2, 3] and o.top_k == 2           # qwen3_moe_mixed: layer 1 is dense
    rng = np.random.default_rng(0)
    prompt, output = rng.integers(0, 256, 40).tolist(), rng.integers(0, 256, 9).tolist()
    rec = _record_from(o, prompt, output, 16)
    v = o.check(rec)
    assert v.ok and v.rows == (40 + 9 - 16 - 1) * 3 and v.agree == v.rows
    rec.routed_experts[2, 1] = rec.routed_experts[2, 1, ::-1]    # order within a row does not matter
    assert o.check(rec).ok
    e = rec.routed_experts[3, 0]
    rec.routed_experts[3, 0] = [e[0], (e[1] + 1) % 8 if (e[1] + 1) % 8 != e[0] else (e[1] + 2) % 8]
    v = o.check(rec)
    assert not v.ok and v.agree == v.rows - 1 and v.mismatches[0][:2] == (40 + 3, 0)
    rec = _record_from(o, prompt, output, 16)
    rec.prompt_routed_experts[20] = -1                           # a hole where routing was computed
    rec.routed_experts[-1] = 0                                   # routing where the last token has none
    v = o.check(rec)
    assert [p for p, _ in v.sentinel_errors] == [48, 20]
    verdict = verify([_record_from(o, prompt, output, 0)], str(mixed_model), oracle=o)
    assert verdict.ok and verdict.agreement == 1.0 and "100.000%" in verdict.summary()


# ---- embedded pipeline process ---------------------------------------------------------------------------------


def test_pipeline_process_writes_records_and_stops_cleanly(tmp_path):
    from routing_replay.consumer import load_records
    from routing_replay.producer import Producer
    from routing_replay.engines.vllm_plugin.pipeline import PipelineProcess

    pipe = PipelineProcess(npz_dir=str(tmp_path))
    try:
        assert pipe.alive and pipe.frontend.startswith("ipc://")
        prod = Producer(pipe.frontend, num_layers=2, top_k=2)
        rows = np.arange(5 * 2 * 2, dtype=np.int16).reshape(5, 2, 2)
        prod.open("req", prompt_len=4, num_cached_tokens=0, prompt_token_ids=[1, 2, 3, 4])
        prod.publish_rows(["req"], [0], [5], rows)
        prod.finish("req", num_output_tokens=2, finish_reason="stop", output_token_ids=[7, 8])
        prod.close()
    finally:
        pipe.close()                                   # SIGTERM: the child drains, writes, exits 0
    assert pipe.proc.returncode == 0 and not os.path.exists(pipe.dir)
    r = load_records(tmp_path)["req"]
    assert r.complete and r.prompt_routed_experts.tolist() == rows[:4].tolist()
    assert r.routed_experts[0].tolist() == rows[4].tolist() and (r.routed_experts[1] == -1).all()
    pipe.close()                                       # idempotent


def test_pipeline_process_that_cannot_start_raises(tmp_path):
    from routing_replay.engines.vllm_plugin.pipeline import PipelineProcess

    with pytest.raises(RuntimeError, match="exited with"):
        PipelineProcess(serve="tcp://256.1.1.1:1")     # the consumer cannot bind this endpoint


def test_batched_steps_hand_out_request_major_rows_in_one_copy():
    """BatchedRows of consecutive decode steps: result_request_major(steps) is result() reordered request-major
    (request i's rows of every step together), still stamp-checked; a batch of several steps owns its result (a
    new array: the producer need not copy it out of the host ring), a batch of one does not; steps of different
    sizes are refused."""
    from routing_replay.capture import AsyncCopier, RoutingCache
    from routing_replay.producer.coalesce import RequestMajor, StepParts
    cache = RoutingCache(64, 3, 8, stamp=True)
    copier = AsyncCopier(cache, num_slots=4, max_rows=32)
    batch = StepBatch(8, stamped=True)
    batch.stamps.baseline(cache.stamp_value(), 0)
    keys_ = ["a", "b", "c", "d"]
    for s in range(3):
        batch.add(_stamped_step(cache, copier, 4, seed=s), keys_, np.arange(4) + s, np.ones(4, int), forward=s + 1)
    ids, starts, counts, rows = batch.take_parts()
    assert rows.owns_result
    flat = rows.result().copy()
    step = StepParts(ids, starts, counts, rows).step()
    assert (step.request_ids, step.starts, step.counts) == (keys_, [0, 1, 2, 3], [3, 3, 3, 3])
    assert isinstance(step.rows, RequestMajor) and step.rows.owns_result and step.rows.shape == (12, 3, 8)
    got = step.rows.result()
    assert np.array_equal(got, flat.reshape(3, 4, 3, 8).swapaxes(0, 1).reshape(12, 3, 8))
    assert got.flags.c_contiguous and batch.stamps.steps == 6       # both reads checked every step's stamp
    step.rows.release()
    batch.add(_stamped_step(cache, copier, 4, seed=9), keys_, np.arange(4), np.ones(4, int), forward=4)
    batch.add(_stamped_step(cache, copier, 2, seed=10), keys_[:2], np.arange(2), np.ones(2, int), forward=5)
    _, _, _, rows = batch.take_parts()
    with pytest.raises(ValueError, match="not 2 steps of equal size"):
        rows.result_request_major(2)
    rows.release()
    batch.add(_stamped_step(cache, copier, 4, seed=11), keys_, np.arange(4), np.ones(4, int), forward=6)
    _, _, _, rows = batch.take_parts()
    assert not rows.owns_result
    rows.release()
    # with owner hints (b and d on one consumer, a and c on another): the same copy puts each owner's requests
    # together, ids, starts and rows alike
    from routing_replay.producer.coalesce import OwnerHints
    hints = OwnerHints()
    hints.update(["a", "b", "c", "d"], [7, 3, 7, 3])
    for s in range(3):
        batch.add(_stamped_step(cache, copier, 4, seed=20 + s), keys_, np.arange(4) + 10 + s, np.ones(4, int),
                  forward=7 + s)
    ids, starts, counts, rows = batch.take_parts()
    flat = rows.result().copy()
    step = StepParts(ids, starts, counts, rows).step(hints)
    assert (step.request_ids, step.starts, step.counts) == (["b", "d", "a", "c"], [11, 13, 10, 12], [3] * 4)
    want = flat.reshape(3, 4, 3, 8).swapaxes(0, 1)[[1, 3, 0, 2]].reshape(12, 3, 8)
    assert np.array_equal(step.rows.result(), want)
    step.rows.release()


def _ring_step(cache, seed: int, n: int, layers=None) -> np.ndarray:
    """One forward of n tokens through a cache with a step ring: its rows as the routers recorded them."""
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, 100, (n, cache.top_k), generator=g) for _ in range(cache.num_layers)]
    for layer in (range(cache.num_layers) if layers is None else layers):
        cache.record(layer, ids[layer])
    cache.flush()
    return torch.stack(ids, dim=1).numpy().astype(np.int16)


@pytest.mark.parametrize("K,by_ref", [(2, False), (8, False), (8, True)])    # 32- and 64-bit counters
def test_step_ring_reads_each_step_from_its_slot_and_never_publishes_another_steps_rows(K, by_ref):
    """ROUTING_REPLAY_STEP_STAMP=ring on the CPU: each complete flush copies its rows into slot (counter mod S);
    the producer's side reads the slot the engine's forward count predicts, later. Rows exact over batches with
    unchecked forwards between; a slot reused before it was read, and a forward the engine did not count (the
    batch's checkpoint), lose the batch (RingReadLost) and never hand out another step's rows; a forward whose
    hooks did not run is a LostHookError; a step larger than a slot is not written to the ring."""
    from routing_replay.capture import AsyncCopier, RoutingCache
    from routing_replay.engines.vllm_plugin.stamps import RingReadLost
    S = 4
    cache = RoutingCache(64, 3, K, stamp=True, slots=S, slot_rows=16)
    copier = AsyncCopier(cache, num_slots=8, max_rows=32)
    batch = StepBatch(K, stamped=True)
    batch.stamps.baseline(cache.stamp_value(), 0)
    state = {"forward": 0}

    def slot_of(forward):
        return ((forward + batch.stamps.offset) & batch.stamps.mask) % S

    def step(seed, n=8, a=1, m=5, layers=None, count=True):
        if count:
            state["forward"] += 1
        want = _ring_step(cache, seed, n, layers)
        f = state["forward"]
        if by_ref:          # as the worker adds them: by reference, host-ring rows taken on the reading thread
            batch.add_slot(a, m, slot_of(f), ["x"], [0], [m], f)
        else:
            batch.add(copier.submit_slot(a, m, slot_of(f)), ["x"], [0], [m], forward=f)
        return want[a:a + m]

    def hand_over():
        if by_ref:
            return batch.hand_over(copier, state["forward"])[3]
        copier.mark_batch(batch.parts, checkpoint=True)
        return batch.take_parts(state["forward"])[3]

    for b in range(3):
        wants = [step(10 * b + i, n=8 + i) for i in range(3)]
        state["forward"] += 1
        _ring_step(cache, 99 + b, 6)                   # a forward no captured request ran in
        rows = hand_over()
        assert np.array_equal(rows.result(), np.concatenate(wants))
        rows.release()
    assert cache.slot_writes == 12 and batch.stamps.steps == 9
    # the slot is reused before the producer reads it: S more forwards before result()
    step(40)
    rows = hand_over()
    for i in range(S):
        state["forward"] += 1
        _ring_step(cache, 41 + i, 8)
    with pytest.raises(RingReadLost, match="reused by a later step"):
        rows.result()
    rows.release()
    # a forward whose hooks did not all run: no stamp, no slot write; its slot holds an older step
    step(50, layers=[0, 1])
    rows = hand_over()
    with pytest.raises(LostHookError, match="did not run the capture hooks"):
        rows.result()
    rows.release()
    # the refusal took the device's count from the batch's checkpoint: later batches read the slots it writes
    assert batch.stamps.resyncs == 1
    assert batch.stamps.offset == (cache.stamp_value() - state["forward"]) & batch.stamps.mask
    want = step(51)
    rows = hand_over()
    assert np.array_equal(rows.result(), want)
    rows.release()
    # a flush the engine did not count (a forward outside execute_model): the read slot holds that flush's rows
    # with the stamp the step would have had; the checkpoint sees the counter ahead, loses the batch, and the next
    # batch reads the right slots again
    _ring_step(cache, 60, 8)
    step(61)
    rows = hand_over()
    with pytest.raises(RingReadLost, match="1 complete flush\\(es\\) more than the engine's forwards"):
        rows.result()
    rows.release()
    want = step(62)
    rows = hand_over()
    assert np.array_equal(rows.result(), want)
    rows.release()
    if by_ref:          # the host ring is full when the reading thread takes the rows: lost, and nothing leaks
        held = [copier.submit([(0, copier.max_rows)]), copier.submit([(0, copier.max_rows)])]
        assert [h.dropped for h in held] == [False, False]
        while not copier.submit([(0, copier.max_rows)]).dropped:
            pass
        free = copier.free_rows
        step(80)
        rows = hand_over()
        with pytest.raises(RingReadLost, match="host ring was full"):
            rows.result()
        rows.release()
        assert copier.free_rows == free and batch.stamps.steps == 12
        assert copier.stats.dropped_steps >= 2
        step(81)                                    # a batch released unread (dropped by the producer's queue bound)
        hand_over().release()
        assert copier.free_rows == free
    # a step larger than a slot is not written there (the worker copies it with submit() instead)
    before = cache.slot_writes
    state["forward"] += 1
    _ring_step(cache, 70, 20)
    assert cache.slot_writes == before
    with pytest.raises(ValueError, match="outside the step ring"):
        copier.submit_slot(0, 20, 0)


@contextlib.contextmanager
def _producer_to_fake(tmp_path, layers: int, top_k: int, **kw):
    """A real Producer connected to a FakeBroker the test plays (tests/test_producer_faults.py), closed after."""
    import zmq

    from routing_replay.producer import Producer
    from tests.test_producer_faults import FakeBroker
    ctx = zmq.Context()
    fake = FakeBroker(ctx, f"ipc://{tmp_path}/f")
    p = Producer(f"ipc://{tmp_path}/f", num_layers=layers, top_k=top_k, context=ctx, linger_ms=0, **kw)
    try:
        yield p, fake
    finally:
        p.close(timeout_s=1)
        fake.close()
        ctx.term()


@pytest.mark.parametrize("as_bytes", [False, True])
def test_raw_ring_steps_are_resolved_on_the_producers_thread_and_what_is_not_captured_stays_out(tmp_path, as_bytes):
    """A step-ring step goes to the producer as the runner laid it out (StepBatch.add_raw): engine ids,
    computed positions, query start locations (arrays, or their bytes as the worker hands them over, whose rows are
    those the locations span). The producer's thread maps the ids to record keys through the worker's table and
    leaves out a request that is not captured, one captured only from a later forward on, and one with no rows in
    the step, with their rows. Through a real Producer to a socket: the delta's ids, starts, counts and rows are
    exactly those of the captured requests, steps added by reference keep theirs, and the queue's byte count comes
    back to 0 (the rows left out leave it too)."""
    from routing_replay.capture import AsyncCopier, RoutingCache
    from routing_replay.producer.coalesce import StepParts
    from tests.test_producer_faults import wait_for
    S, Lr, Kr = 4, 3, 8
    cache = RoutingCache(64, Lr, Kr, stamp=True, slots=S, slot_rows=16)
    copier = AsyncCopier(cache, num_slots=8, max_rows=32)
    batch = StepBatch(Kr, stamped=True)
    batch.stamps.baseline(cache.stamp_value(), 0)

    def slot_of(forward):
        return ((forward + batch.stamps.offset) & batch.stamps.mask) % S

    def add_raw(first, n, slot, ids, computed, qsl, forward):
        if not as_bytes:
            return batch.add_raw(first, n, slot, ids, computed, qsl, forward)
        # as the worker hands a step over: first 0 and the scheduler's rows; resolve() reads the locations
        batch.add_raw(0, n, slot, ids, np.asarray(computed, np.int32).tobytes(), np.asarray(qsl, np.int32).tobytes(),
                      forward, (np.dtype(np.int32), np.dtype(np.int32)))

    table = {"r0": ("k0", 1), "r2": ("k2", 1), "r3": ("k3", 2), "r4": ("k4", 1)}     # r1: not captured
    # forward 1: r0 3 rows, r1 1 (not captured), r2 none, r3 2 (captured from forward 2 on), r4 1
    w1 = _ring_step(cache, 1, 7)
    qsl1 = np.array([0, 3, 4, 4, 6, 7], dtype=np.int32)
    add_raw(0, 7, slot_of(1), ["r0", "r1", "r2", "r3", "r4"], np.array([0, 10, 20, 5, 7], np.int32), qsl1, 1)
    # forward 2: every request captured, one row each
    w2 = _ring_step(cache, 2, 3)
    add_raw(0, 3, slot_of(2), ["r0", "r3", "r4"], np.array([3, 5, 8], np.int32),
                  np.array([0, 1, 2, 3], np.int32), 2)
    # forward 3: a step added with its keys (rows 1..2 of the slot)
    w3 = _ring_step(cache, 3, 4)
    batch.add_slot(1, 2, slot_of(3), ["k0", "k4"], np.array([4, 9]), np.array([1, 1]), 3)
    with pytest.raises(ValueError, match="needs the table"):
        batch.take_parts()
    ids, starts, counts, rows = batch.hand_over(copier, 3, table)
    assert rows.deferred and rows.shape[0] == 7 + 3 + 2
    want_ids = ["k0", "k4", "k0", "k3", "k4", "k0", "k4"]
    want = np.concatenate([w1[[0, 1, 2, 6]], w2, w3[1:3]])

    with _producer_to_fake(tmp_path, Lr, Kr) as (p, fake):
        assert p.open_many([(k, 16, 0, None, False) for k in ("k0", "k3", "k4")], ids_checked=True) == []
        assert p.publish_steps(ids, starts, counts, rows, checked=True) is True
        got = [fake.recv() for _ in range(4)]
        assert [(h.kind, h.key) for h, _ in got] == [("open", "k0"), ("open", "k3"), ("open", "k4"),
                                                     ("delta", want_ids)]
        d = wire.parse_delta(got[3][0])
        assert d.starts.tolist() == [0, 7, 3, 5, 8, 4, 9] and d.counts.tolist() == [3, 1, 1, 1, 1, 1, 1]
        payload = b"".join(bytes(f) for f in got[3][1])
        assert payload == want.tobytes()
        wait_for(lambda: p.queued_msgs == 0)
        assert p.queued_bytes == 0 and p.stats.encode_errors == 0 and p.healthy
        assert rows.shape[0] == 4 + 3 + 2 and batch.stamps.steps == 3
        # a batch of which nothing is captured: no message at all, its host-ring rows given back
        _ring_step(cache, 4, 3)
        add_raw(0, 3, slot_of(4), ["r1", "r5", "r6"], np.zeros(3, np.int32), np.array([0, 1, 2, 3], np.int32), 4)
        free = copier.free_rows
        assert p.publish_steps(*batch.hand_over(copier, 4, table), checked=True) is True
        wait_for(lambda: p.queued_msgs == 0)
        assert p.queued_bytes == 0 and copier.free_rows == free and p.stats.encode_errors == 0
        p.publish_rows(["k0"], [8], [1], want[:1])
        h, frames = fake.recv()
        assert (h.kind, h.key, h.seq) == ("delta", ["k0"], got[3][0].seq + 1)
    # resolved on the thread that reads them, once: the same steps again, read directly
    add_raw(0, 7, slot_of(1), ["r0", "r1", "r2", "r3", "r4"], np.array([0, 10, 20, 5, 7], np.int32), qsl1, 1)
    step = StepParts(*batch.hand_over(copier, 4, {"r1": ("k1", 1)})).step()
    assert (step.request_ids, step.starts, step.counts) == (["k1"], [10], [1])
    assert np.array_equal(step.rows.result(), w1[3:4]) and step.rows.owns_result
    step.rows.release()


def test_eager_host_steps_added_raw_are_keyed_laid_out_and_checked_on_the_producers_thread(tmp_path):
    """An eager CPU step goes to the producer as the runner laid it out (StepBatch.add_host): the routers' tensors
    unchecked, the engine ids, and the bytes of the computed positions and query start locations. On the
    producer's thread the ids become keys through the worker's table; a request not captured, one captured only
    from a later forward on, and one with no rows in the step stay out with their rows. Decode steps of one id list
    share one key list and go out merged, one entry per request. Through a real Producer to a socket: the deltas'
    ids, starts, counts and rows are exact, and the queue's byte count comes back to 0. The rows are those the
    query start locations span, whatever the worker counted; a step whose tensors hold fewer is refused there
    (encode_errors) and the next delta still goes out; a batch released unread lets its tensors go."""
    from routing_replay.capture import AsyncCopier, RoutingCache
    from routing_replay.engines.vllm_plugin.step_batch import host_layouts, resolve_raw_steps
    from tests.test_producer_faults import wait_for
    Lr, Kr = 3, 2
    copier = AsyncCopier(RoutingCache(64, Lr, Kr), num_slots=4, max_rows=32)
    rng = np.random.default_rng(7)

    def tensors(n, dtype):
        return [torch.from_numpy(rng.integers(0, 64, size=(n, Kr)).astype(dtype)) for _ in range(Lr)]

    def rows_of(ts, sel):
        return np.stack([t.numpy()[sel] for t in ts], axis=1).astype(np.int16)

    def add(batch, ts, n, ids, computed, qsl, forward):     # (tensor bytes as the worker counts them: n rows)
        batch.add_host(ts, n * Kr * ts[0].element_size(), n, ids, np.asarray(computed, np.int32).tobytes(),
                       np.asarray(qsl, np.int32).tobytes(), (np.dtype(np.int32), np.dtype(np.int32)), forward)

    table = {"r0": ("k0", 1), "r2": ("k2", 1), "r3": ("k3", 2), "r4": ("k4", 1)}     # r1: not captured
    batch = StepBatch(Kr)
    # forward 1: r0 3 rows, r1 1 (not captured), r2 none, r3 2 (captured from forward 2 on), r4 1; int32 ids with
    # 9 rows (the tensors may hold more than the step reads)
    t1 = tensors(9, np.int32)
    add(batch, t1, 7, ["r0", "r1", "r2", "r3", "r4"], [0, 10, 20, 5, 7], [0, 3, 4, 4, 6, 7], 1)
    t2 = tensors(3, np.int64)                       # forward 2: every request captured, one row each, int64 ids
    add(batch, t2, 3, ["r0", "r3", "r4"], [3, 5, 8], [0, 1, 2, 3], 2)
    assert batch.rows == 10 and batch.extra == Lr * (7 * Kr * 4 - 7 * Kr * 2) + Lr * (3 * Kr * 8 - 3 * Kr * 2)
    with pytest.raises(ValueError, match="needs the table"):
        batch.take_parts()
    ids, starts, counts, rows = batch.hand_over(copier, 2, table)
    assert rows.deferred and rows.shape == (10, Lr, Kr) and rows.extra_nbytes > 0
    want_a = np.concatenate([rows_of(t1, [0, 1, 2, 6]), rows_of(t2, [0, 1, 2])])

    # decode steps of one id list (the worker's copy, shared): one key list, merged into one entry per request
    decode = ["r0", "r3", "r4"]
    t3, t4 = tensors(3, np.int32), tensors(3, np.int32)
    add(batch, t3, 3, decode, [4, 6, 9], [0, 1, 2, 3], 3)
    add(batch, t4, 3, decode, [5, 7, 10], [0, 1, 2, 3], 4)
    b_ids, b_starts, b_counts, b_rows = batch.hand_over(copier, 4, table)
    st, cn = host_layouts(b_rows._parts, b_rows._raw, b_starts, b_counts)
    assert cn[0] is cn[1] and st[0].tolist() == [4, 6, 9] and st[1].tolist() == [5, 7, 10]
    keys, _, _, select, cut = resolve_raw_steps(b_rows._raw, table, b_rows._forwards, b_ids, st, cn)
    assert keys[0] == ["k0", "k3", "k4"] and keys[0] is keys[1] and select == [None, None] and cut == 0
    want_b = np.stack([rows_of(t3, [0, 1, 2]), rows_of(t4, [0, 1, 2])], axis=1).reshape(6, Lr, Kr)  # by request

    # query start locations that span 4 rows where the worker counted 3: the step is the 4 rows; then one whose
    # layout spans 4 rows of tensors that hold 3: refused on the producer's thread
    t5 = tensors(4, np.int32)
    add(batch, t5, 3, ["r0", "r3"], [5, 7], [0, 3, 4], 5)
    c_args = batch.hand_over(copier, 5, table)
    add(batch, tensors(3, np.int32), 3, ["r0", "r3"], [8, 8], [0, 3, 4], 6)
    d_args = batch.hand_over(copier, 6, table)

    with _producer_to_fake(tmp_path, Lr, Kr) as (p, fake):
        assert p.open_many([(k, 16, 0, None, False) for k in ("k0", "k3", "k4")], ids_checked=True) == []
        assert p.publish_steps(ids, starts, counts, rows, checked=True) is True
        got = [fake.recv() for _ in range(4)]
        assert [(h.kind, h.key) for h, _ in got] == [("open", "k0"), ("open", "k3"), ("open", "k4"),
                                                     ("delta", ["k0", "k4", "k0", "k3", "k4"])]
        d = wire.parse_delta(got[3][0])
        assert d.starts.tolist() == [0, 7, 3, 5, 8] and d.counts.tolist() == [3, 1, 1, 1, 1]
        assert b"".join(bytes(f) for f in got[3][1]) == want_a.tobytes()
        wait_for(lambda: p.queued_msgs == 0)
        assert p.queued_bytes == 0 and p.stats.encode_errors == 0 and rows.shape[0] == 4 + 3
        assert p.publish_steps(b_ids, b_starts, b_counts, b_rows, checked=True) is True
        h, frames = fake.recv()
        d = wire.parse_delta(h)
        assert h.key == ["k0", "k3", "k4"] and d.starts.tolist() == [4, 6, 9] and d.counts.tolist() == [2, 2, 2]
        assert b"".join(bytes(f) for f in frames) == want_b.tobytes()
        assert p.publish_steps(*c_args, checked=True) is True
        h, frames = fake.recv()
        d = wire.parse_delta(h)
        assert h.key == ["k0", "k3"] and d.starts.tolist() == [5, 7] and d.counts.tolist() == [3, 1]
        assert b"".join(bytes(f) for f in frames) == rows_of(t5, [0, 1, 2, 3]).tobytes()
        assert p.stats.encode_errors == 0
        assert p.publish_steps(*d_args, checked=True) is True
        wait_for(lambda: p.stats.encode_errors == 1)
        p.end_many([("finish", "k3", 1, "stop", None)])     # its refused position goes out as lost
        h, _ = fake.recv()
        assert (h.kind, h.key, h.body["lost"]) == ("finish", "k3", [[8, 9]])
        p.publish_rows(["k0"], [8], [1], want_a[:1])
        h, _ = fake.recv()
        assert (h.kind, h.key) == ("delta", ["k0"])
        wait_for(lambda: p.queued_msgs == 0)
        assert p.queued_bytes == 0 and p.healthy and p.stats.encode_errors == 1
    # a batch released before the producer's thread read it (a producer closing): nothing to give back, no error
    add(batch, tensors(3, np.int32), 3, decode, [6, 8, 11], [0, 1, 2, 3], 5)
    batch.hand_over(copier, 5, table)[3].release()


@pytest.mark.parametrize("as_bytes", [False, True])
def test_raw_ring_steps_refused_by_the_queue_bound_report_the_captured_positions_lost(tmp_path, as_bytes):
    """A batch with raw steps that the producer's queue bound refuses is resolved on the caller's thread instead:
    the positions reported lost are the captured requests' own, under their keys; nothing of the request not
    captured is counted. The same with the layout as bytes (as the worker hands it over)."""
    from routing_replay.capture import AsyncCopier, RoutingCache
    S, Lr, Kr = 4, 3, 8
    cache = RoutingCache(64, Lr, Kr, stamp=True, slots=S, slot_rows=16)
    copier = AsyncCopier(cache, num_slots=8, max_rows=32)
    batch = StepBatch(Kr, stamped=True)
    batch.stamps.baseline(cache.stamp_value(), 0)
    slot = ((1 + batch.stamps.offset) & batch.stamps.mask) % S
    _ring_step(cache, 1, 5)
    computed, qsl = np.array([0, 10, 6], np.int32), np.array([0, 3, 4, 5], np.int32)
    if as_bytes:
        batch.add_raw(0, 5, slot, ["r0", "r1", "r2"], computed.tobytes(), qsl.tobytes(), 1, (qsl.dtype, qsl.dtype))
    else:
        batch.add_raw(0, 5, slot, ["r0", "r1", "r2"], computed, qsl, 1)
    free = copier.free_rows
    ids, starts, counts, rows = batch.hand_over(copier, 1, {"r0": ("k0", 1), "r2": ("k2", 1)})
    with _producer_to_fake(tmp_path, Lr, Kr, max_queue_bytes=8) as (p, fake):
        p.open_many([("k0", 4, 0, None, False), ("k2", 7, 0, None, False)], ids_checked=True)
        assert p.publish_steps(ids, starts, counts, rows, checked=True) is False
        assert (p.stats.dropped_msgs, p.stats.dropped_rows) == (1, 4)
        p.end_many([("finish", "k0", 1, "stop", None), ("finish", "k2", 1, "stop", None)])
        got = [fake.recv() for _ in range(4)]
        assert [(h.kind, h.key) for h, _ in got] == [("open", "k0"), ("open", "k2"), ("finish", "k0"),
                                                     ("finish", "k2")]
        assert got[2][0].body["lost"] == [[0, 3]] and got[3][0].body["lost"] == [[6, 7]]
        assert copier.free_rows == free and p.queued_bytes == 0 and p.queued_msgs == 0


def test_pipeline_process_killed_is_started_again_and_names_the_requests_in_flight(tmp_path, caplog):
    """kill -9 of the helper: the watch names the requests in flight in one WARNING line and starts the helper
    again on the same endpoint; the producer resends what the dead broker had not acknowledged, so the request
    in flight gets an incomplete record missing exactly the rows the dead consumer had acknowledged, and a
    request opened after the death is complete (a real Producer, real processes)."""
    import logging
    import signal
    import time

    from routing_replay.consumer import load_records
    from routing_replay.engines.vllm_plugin.pipeline import PipelineProcess
    from routing_replay.producer import Producer

    live = ["victim"]
    caplog.set_level(logging.WARNING, logger="vllm.routing_replay")
    restarted = []
    pipe = PipelineProcess(npz_dir=str(tmp_path), in_flight=lambda: list(live), watch_interval_s=0.05,
                           on_restart=lambda: restarted.append(pipe.proc.pid))
    prod = None
    try:
        prod = Producer(pipe.frontend, num_layers=2, top_k=2)
        rows = np.arange(10 * 2 * 2, dtype=np.int16).reshape(10, 2, 2)
        prod.open("victim", prompt_len=4, num_cached_tokens=0, prompt_token_ids=[1, 2, 3, 4])
        prod.publish_rows(["victim"], [0], [6], rows[:6])
        assert prod.wait_acked(30)                  # applied by the consumer that is about to die
        old = pipe.proc
        os.kill(old.pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while pipe.restarts < 1 or not pipe.alive:
            assert time.monotonic() < deadline, "helper not started again"
            time.sleep(0.02)
        assert pipe.proc.pid != old.pid and pipe.lost_in_flight == 1 and restarted == [pipe.proc.pid]
        # what the worker does then (RequestTracker.reopen): the open of each request in flight again
        prod.open("victim", prompt_len=4, num_cached_tokens=0, prompt_token_ids=[1, 2, 3, 4])
        prod.publish_rows(["victim"], [6], [3], rows[6:9])
        prod.finish("victim", num_output_tokens=6, finish_reason="length", output_token_ids=[5, 6, 7, 8, 9, 10])
        prod.open("after", prompt_len=3, num_cached_tokens=0, prompt_token_ids=[1, 2, 3])
        prod.publish_rows(["after"], [0], [4], rows[:4])
        prod.finish("after", num_output_tokens=2, finish_reason="stop", output_token_ids=[7, 8])
        assert prod.wait_acked(30)
    finally:
        if prod is not None:
            prod.close()
        pipe.close()
    assert pipe.proc.returncode == 0
    recs = load_records(tmp_path)
    v, a = recs["victim"], recs["after"]
    assert not v.complete and v.missing == [(0, 6)] and v.reason == "rows_not_delivered", (v.reason, v.missing)
    assert v.prompt_token_ids.tolist() == [1, 2, 3, 4] and v.output_token_ids.tolist() == [5, 6, 7, 8, 9, 10]
    assert (v.prompt_routed_experts == -1).all() and (v.routed_experts[:2] == -1).all()
    assert v.routed_experts[2:5].tolist() == rows[6:9].tolist() and (v.routed_experts[5] == -1).all()
    assert a.complete and a.prompt_routed_experts.tolist() == rows[:3].tolist()
    assert a.routed_experts[0].tolist() == rows[3].tolist()
    died = [r.getMessage() for r in caplog.records if "died" in r.getMessage()]
    assert len(died) == 1 and f"embedded helper process {old.pid} died (exit status -9)" in died[0]
    assert "1 requests in flight" in died[0] and "['victim']" in died[0] and "restarts=1" in died[0], died
    assert len([r for r in caplog.records if "started again: pid" in r.getMessage()]) == 1
