"""The plugin's start-up self-check (engines/vllm_plugin/selfcheck.py): it passes on the installed vLLM, names
exactly the hook that is missing or changed, warns outside the tested versions, and refuses to start."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import types

import pytest

vllm = pytest.importorskip("vllm")

from routing_replay.engines.vllm_plugin import selfcheck  # noqa: E402
from routing_replay.engines.vllm_plugin.selfcheck import Need  # noqa: E402

pytestmark = pytest.mark.vllm
LOGGER = "vllm.routing_replay"


def _ours(caplog) -> list:
    """The plugin's own log records (importing vLLM modules for the first time may log warnings of theirs)."""
    return [(r.levelname, r.getMessage()) for r in caplog.records if r.name == LOGGER]


def test_installed_vllm_passes_the_class_check():
    assert selfcheck.class_problems() == []
    selfcheck.startup_check(vllm.__version__)


def test_tested_versions():
    assert selfcheck.TESTED_VLLM == ("0.25.1", "0.27.0", "0.27.1", "0.28.0", "0.29.0", "0.30.0", "0.31.0",
                                     "0.32.0")
    for v in ("0.25.1", "0.25.1+cu129", "0.27.0", "0.29.0+cpu", "0.32.0", "0.32.0.post1"):
        assert selfcheck.tested(v), v
    for v in ("0.25.0", "0.26.0", "0.32.1", "0.33.0", "0.30.0rc1", "0.31.0.dev3+gabc", "1.0.0", "bogus", ""):
        assert not selfcheck.tested(v), v
    assert selfcheck.tested_range() == "0.25.1 and 0.27.0 to 0.32.0"


def test_untested_version_warns_and_passes(caplog):
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        selfcheck.startup_check("0.26.0")
    assert _ours(caplog) == [
        ("WARNING", "routing-replay: vLLM 0.26.0 is outside the tested versions (0.25.1 and 0.27.0 to 0.32.0); "
                    f"running because the start-up self-check found every hook ({len(selfcheck.startup_needs())})")]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        selfcheck.startup_check("0.27.0")
    assert _ours(caplog) == []


def test_missing_method_raises_naming_it(monkeypatch, caplog):
    from vllm.v1.core.sched.scheduler import Scheduler

    monkeypatch.delattr(Scheduler, "_free_request")
    with caplog.at_level(logging.WARNING, logger=LOGGER), pytest.raises(RuntimeError) as e:
        selfcheck.startup_check("0.99.0")
    assert str(e.value) == (
        "routing-replay cannot hook vLLM 0.99.0: vllm.v1.core.sched.scheduler.Scheduler._free_request is missing. "
        "Routing capture refuses to start (tested with vLLM 0.25.1 and 0.27.0 to 0.32.0). Unset "
        "ROUTING_REPLAY_BROKER to run vLLM with routing capture off.")
    assert _ours(caplog) == []                      # a refusal, not a warning


def test_changed_signature_raises_naming_it(monkeypatch):
    from vllm.v1.worker.gpu_worker import Worker

    def execute_model(self, sched_out):
        pass

    monkeypatch.setattr(Worker, "execute_model", execute_model)
    assert selfcheck.class_problems() == [
        "vllm.v1.worker.gpu_worker.Worker.execute_model(sched_out): parameter 1 is 'sched_out', expected "
        "'scheduler_output'"]


def test_missing_dataclass_field_raises_naming_it(monkeypatch):
    import dataclasses

    from vllm.v1.core.sched import output

    fields = [f for f in dataclasses.fields(output.NewRequestData) if f.name != "prompt_embeds"]
    Renamed = dataclasses.make_dataclass("NewRequestData", [(f.name, f.type, f) for f in fields])
    monkeypatch.setattr(output, "NewRequestData", Renamed)
    with pytest.raises(RuntimeError, match=r"^routing-replay cannot hook vLLM 0\.32\.0: "
                                           r"vllm\.v1\.core\.sched\.output\.NewRequestData\.prompt_embeds is "
                                           r"missing\. Routing capture refuses to start"):
        selfcheck.startup_check("0.32.0")


@pytest.fixture
def fake_module(monkeypatch):
    mod = types.ModuleType("rr_fake_vllm")

    class Base:
        def __init__(self):
            self.from_base = 1

    class Thing(Base):
        attr = 0

        def __init__(self):
            super().__init__()
            self.in_init = 1

        def later(self):
            self.set_later = 2

        def call(self, request, *, model_executed=False):
            return self.missing_read         # read, never assigned: not an attribute of Thing

        def wrapped(self, request_ids, timeout):
            pass

        @property
        def prop(self):
            return 1

    mod.Thing = Thing
    mod.function = lambda: None
    monkeypatch.setitem(sys.modules, "rr_fake_vllm", mod)
    return mod


def _problems(*needs):
    return selfcheck.class_problems(needs)


def test_attribute_kinds(fake_module):
    M = "rr_fake_vllm"
    ok = [Need(M, "Thing", "class"), Need(M, "Thing.attr"), Need(M, "Thing.prop"), Need(M, "Thing.in_init"),
          Need(M, "Thing.from_base"), Need(M, "Thing.set_later"), Need(M, "function", "callable"),
          Need(M, "Thing.call", "callable", args=("request",), kwargs=("model_executed",)),
          Need(M, "Thing.wrapped", "callable", wrapped=True), Need(M, "Thing.wrapped", "callable", wrapped=True,
                                                                   args=("request_ids",))]
    assert _problems(*ok) == []
    assert _problems(Need(M, "Thing.missing_read"), Need(M, "Nothing.x"), Need("rr_no_such_module", "X"),
                     Need(M, "function", "class"), Need(M, "Thing.prop", "callable"),
                     Need(M, "Thing.in_init", "callable")) == [
        "rr_fake_vllm.Thing.missing_read is missing",
        "rr_fake_vllm.Nothing is missing",
        "module rr_no_such_module cannot be imported (ModuleNotFoundError: No module named 'rr_no_such_module')",
        "rr_fake_vllm.function is not a class",
        "rr_fake_vllm.Thing.prop is not callable",
        "rr_fake_vllm.Thing.in_init is an instance attribute, expected a method"]


def test_signatures(fake_module):
    M = "rr_fake_vllm"
    assert _problems(Need(M, "Thing.call", "callable", args=("request", "more")),
                     Need(M, "Thing.call", "callable", args=("request",), kwargs=("model_executed", "other")),
                     Need(M, "Thing.call", "callable"),                          # called without its argument
                     Need(M, "Thing.wrapped", "callable", wrapped=True, args=("ids",))) == [
        "rr_fake_vllm.Thing.call(request, *, model_executed=False) takes no positional parameter 'more'",
        "rr_fake_vllm.Thing.call(request, *, model_executed=False) cannot be called as the plugin calls it "
        "(got an unexpected keyword argument 'other')",
        "rr_fake_vllm.Thing.call(request, *, model_executed=False) cannot be called as the plugin calls it "
        "(missing a required argument: 'request')",
        "rr_fake_vllm.Thing.wrapped(request_ids, timeout): parameter 1 is 'request_ids', expected 'ids'"]


class _Buf:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def _fake_runner():
    bt = _Buf(slot_mapping=_Buf(gpu=0), block_table=_Buf(np=0), block_size=128)
    ib = _Buf(req_ids=[], num_reqs=0, num_computed_tokens_cpu=0, req_id_to_index={}, block_table=[bt])
    return _Buf(get_model=lambda: None, device="cpu", vllm_config=None, requests={}, query_start_loc=_Buf(np=0),
                input_batch=ib)


def test_runner_check_names_the_missing_attribute():
    runner = _fake_runner()
    selfcheck.check_runner(runner)
    del runner.query_start_loc.np
    del runner.input_batch.num_computed_tokens_cpu
    with pytest.raises(RuntimeError) as e:
        selfcheck.check_runner(runner)
    assert str(e.value) == (
        f"routing-replay cannot hook vLLM {vllm.__version__}: _Buf.query_start_loc.np is missing (each request's "
        "token span in the step); _Buf.input_batch.num_computed_tokens_cpu is missing (absolute position of each "
        "span). Routing capture refuses to start (tested with vLLM 0.25.1 and 0.27.0 to 0.32.0). Unset "
        "ROUTING_REPLAY_BROKER to run vLLM with routing capture off.")
    runner = _fake_runner()
    del runner.input_batch.block_table[0].slot_mapping
    assert selfcheck.runner_problems(runner) == [
        "_Buf.input_batch.block_table[0].slot_mapping.gpu is missing (fill mode: KV slots)"]


@pytest.mark.slow
def test_runner_check_passes_on_the_real_runner(monkeypatch):
    """The model runner of a real (CPU) engine, after load_model, has everything check_runner wants."""
    from routing_replay.apps.vllm_harness import inprocess_llm, shutdown, tiny_model, worker_of

    monkeypatch.delenv("ROUTING_REPLAY_BROKER", raising=False)     # vLLM only: the check reads the runner
    llm = inprocess_llm(tiny_model("qwen3_moe"), max_num_seqs=4)
    try:
        runner = worker_of(llm).model_runner
        assert selfcheck.runner_problems(runner) == []
        selfcheck.check_runner(runner)
    finally:
        shutdown(llm)


@pytest.mark.slow
def test_register_refuses_to_start_without_the_hook():
    """register() in a fresh process: a removed Scheduler.schedule stops it before anything is wrapped."""
    code = ("import vllm.v1.core.sched.scheduler as s, vllm.v1.core.sched.interface as i\n"
            "del s.Scheduler.schedule, i.SchedulerInterface.schedule\n"
            "import routing_replay.engines.vllm_plugin as p\n"
            "from vllm.v1.worker.gpu_worker import Worker\n"
            "try:\n    p.register()\nexcept RuntimeError as e:\n"
            "    print('REFUSED', e, getattr(Worker, '_routing_replay_hooked', False))\n")
    env = dict(os.environ, ROUTING_REPLAY_BROKER="tcp://127.0.0.1:5557")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("REFUSED")]
    assert line == [f"REFUSED routing-replay cannot hook vLLM {vllm.__version__}: "
                    "vllm.v1.core.sched.scheduler.Scheduler.schedule is missing. Routing capture refuses to start "
                    "(tested with vLLM 0.25.1 and 0.27.0 to 0.32.0). Unset ROUTING_REPLAY_BROKER to run vLLM with "
                    "routing capture off. False"]


def _runner_class(module: str):
    return type("GPUModelRunner", (), {"__module__": module})


def test_runner_kind_from_the_class_module():
    """V1 and V2 runners share the class name GPUModelRunner; the kind comes from the module of a class in the MRO
    (a subclass such as V2's CPUModelRunner counts as V2), anything else is refused by name."""
    from routing_replay.engines.vllm_plugin.runners import runner_kind

    v1, v2 = _runner_class("vllm.v1.worker.gpu_model_runner"), _runner_class("vllm.v1.worker.gpu.model_runner")
    assert runner_kind(v1()) == "v1"
    assert runner_kind(v2()) == "v2"
    assert runner_kind(type("CPUModelRunner", (v2,), {"__module__": "vllm.v1.worker.cpu.model_runner"})()) == "v2"
    with pytest.raises(NotImplementedError, match=r"this worker runs x\.y\.TPUModelRunner"):
        runner_kind(type("TPUModelRunner", (), {"__module__": "x.y"})())


def test_v2_runner_check_reads_execute_model_state_and_v2_classes():
    """For Model Runner V2 the instance check wants execute_model_state (not V1's persistent batch), and the V2
    classes' fields the per-step capture reads exist in the installed vLLM (its V2 modules import without Triton)."""
    assert selfcheck.class_problems(selfcheck.NEEDS_V2) == []
    runner = _Buf(get_model=lambda: None, device="cpu", vllm_config=None, execute_model_state=None)
    assert selfcheck.runner_problems(runner, "v2") == []
    del runner.execute_model_state
    assert selfcheck.runner_problems(runner, "v2") == [
        "_Buf.execute_model_state is missing (the step's batch after the forward)"]
    assert selfcheck.need_problem(selfcheck.Need("vllm.v1.worker.gpu.input_batch", "InputBatch.no_such_field")) \
        == "vllm.v1.worker.gpu.input_batch.InputBatch.no_such_field is missing"


def test_v2_step_layout_reads_the_steps_input_batch():
    """V2 keeps no persistent batch: the layout comes from execute_model_state.input_batch (None: no forward)."""
    import numpy as np

    from routing_replay.engines.vllm_plugin.runners import step_layout

    runner = _Buf(execute_model_state=None)
    assert step_layout(runner, "v2") is None
    ib = _Buf(req_ids=["b", "a"], num_reqs=2, query_start_loc_np=np.array([0, 1, 9, 9, 9], dtype=np.int32),
              num_computed_tokens_np=np.array([40, 0], dtype=np.int32))
    runner.execute_model_state = _Buf(input_batch=ib)
    ids, qsl, computed = step_layout(runner, "v2")
    assert ids == ["b", "a"] and qsl.tolist() == [0, 1, 9] and computed.tolist() == [40, 0]
