"""vLLM CPU releases that refuse an MoE model's dtype on CPUs with AMX (engines/vllm_plugin/cpu_refusals.py),
checked against the installed vLLM itself with its AMX decision, `torch.cpu._is_amx_tile_supported()`, patched to
True (CI's CPU and this one have no AMX; float32 layers run no AMX instruction on any release, so the engine runs
here all the same): where the table says the release refuses float32, the plugin refuses before the model loads
with one message naming release, CPU feature and dtype, and so does vLLM's own code; where it says it does not, a
float32 engine starts and records exact rows."""

from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest
import torch

pytestmark = pytest.mark.vllm
vllm = pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402

from routing_replay.apps.oracle import Oracle  # noqa: E402
from routing_replay.apps.vllm_harness import inprocess_llm, shutdown, tiny_model, wait_records  # noqa: E402
from routing_replay.engines.vllm_plugin import record_key  # noqa: E402
from routing_replay.engines.vllm_plugin.cpu_refusals import check_engine, moe_dtype_refusal  # noqa: E402

ENV = ("ROUTING_REPLAY_BROKER", "ROUTING_REPLAY_NPZ_DIR", "ROUTING_REPLAY_SERVE", "ROUTING_REPLAY_REQUESTS",
       "ROUTING_REPLAY_PREFIX_ROWS")


def _is_cpu_build() -> bool:
    from vllm.platforms import current_platform
    return current_platform.is_cpu()


@pytest.fixture
def amx(monkeypatch):
    """vLLM's AMX decision patched on, for this test only."""
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)


def test_refusal_table():
    why = moe_dtype_refusal("0.27.0", torch.float32, amx=True)
    assert why.startswith("vLLM CPU 0.27.0 refuses unquantized MoE layers of dtype float32 on this CPU: it has AMX")
    assert "torch.cpu._is_amx_tile_supported()" in why and "takes bfloat16 only" in why
    assert "dtype float16" in moe_dtype_refusal("0.27.1", torch.float16, amx=True)
    assert moe_dtype_refusal("0.27.0", torch.bfloat16, amx=True) is None
    assert moe_dtype_refusal("0.27.0", torch.float32, amx=False) is None
    for v in ("0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.25.1"):
        assert moe_dtype_refusal(v, torch.float32, amx=True) is None, v


def test_harness_skips_engine_tests_where_the_release_refuses():
    """tests/conftest.py: the engine tests are skipped with this one reason on vLLM CPU 0.27 on an AMX CPU."""
    from tests.conftest import engine_test_refusal

    assert engine_test_refusal("0.27.0", amx=True) == moe_dtype_refusal("0.27.0", torch.float32, amx=True)
    assert engine_test_refusal("0.27.0", amx=False) is None and engine_test_refusal("0.30.0", amx=True) is None


def test_start_up_check_names_the_refusal_once(amx):
    def config(device="cpu", dtype=torch.float32, moe=True, quantization=None):
        return types.SimpleNamespace(device_config=types.SimpleNamespace(device_type=device),
                                     model_config=types.SimpleNamespace(dtype=dtype, is_moe=moe,
                                                                        quantization=quantization))
    with pytest.raises(RuntimeError, match=r"^routing-replay: vLLM CPU 0\.27\.0 refuses .* dtype float32 .* AMX"):
        check_engine(config(), "0.27.0")
    for cfg in (config(dtype=torch.bfloat16), config(moe=False), config(device="cuda"), config(quantization="fp8")):
        check_engine(cfg, "0.27.0")
    check_engine(config(), "0.28.0")


@pytest.mark.skipif(not vllm.__version__.startswith("0.27."), reason="vLLM CPU 0.27's fused-MoE kernel choice")
def test_vllm_027_itself_refuses_float32_on_amx(amx):
    """The installed release's own choice (CPUFusedMOE.check_grouped_gemm) with AMX patched on: the tiny models'
    expert shapes in float32 refused, in bfloat16 taken by the AMX kernel; what the table says."""
    from vllm.model_executor.layers.fused_moe.cpu_fused_moe import CPUFusedMOE

    moe = CPUFusedMOE.__new__(CPUFusedMOE)           # (its __init__ would prepack the weights)

    def layer(dtype):
        return types.SimpleNamespace(w13_weight=torch.zeros(8, 256, 128, dtype=dtype),
                                     w2_weight=torch.zeros(8, 128, 128, dtype=dtype))
    with pytest.raises(RuntimeError, match="AMX grouped-gemm kernel cannot be used"):
        moe.check_grouped_gemm(layer(torch.float32))
    assert moe.check_grouped_gemm(layer(torch.bfloat16)) == (True, "amx")
    assert moe_dtype_refusal(vllm.__version__, torch.float32, amx=True) is not None
    assert moe_dtype_refusal(vllm.__version__, torch.bfloat16, amx=True) is None


def test_float32_engine_on_an_amx_cpu(amx, tmp_path):
    """A float32 Mixtral engine as vLLM sees it on an AMX CPU: refused before the model loads, naming the release,
    the CPU feature and the dtype, where the table says so; else it runs and its record is exact."""
    if not _is_cpu_build():
        pytest.skip("vLLM's CPU build decides its MoE kernels by AMX; this is a GPU build")
    saved = {k: os.environ.get(k) for k in ENV}
    os.environ.update(ROUTING_REPLAY_BROKER="embedded", ROUTING_REPLAY_NPZ_DIR=str(tmp_path),
                      ROUTING_REPLAY_REQUESTS="all")
    for k in ("ROUTING_REPLAY_SERVE", "ROUTING_REPLAY_PREFIX_ROWS"):
        os.environ.pop(k, None)
    try:
        model = tiny_model("mixtral")
        why = moe_dtype_refusal(vllm.__version__, torch.float32)
        if why is not None:
            # in a process of its own (an engine that failed to start leaves vLLM's process state behind)
            script = (
                "import sys, torch\n"
                "torch.cpu._is_amx_tile_supported = lambda: True\n"
                "from routing_replay.apps.vllm_harness import inprocess_llm, tiny_model\n"
                "try:\n"
                "    inprocess_llm(tiny_model('mixtral'), max_model_len=256, kv_cache_memory_bytes=16 << 20)\n"
                "except Exception as e:\n"
                "    while e is not None:\n"
                "        print('RAISED:' + str(e))\n"
                "        e = e.__cause__ or e.__context__\n"
                "    sys.exit(3)\n")
            p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
            assert p.returncode == 3, p.stdout[-3000:] + p.stderr[-3000:]
            assert f"RAISED:routing-replay: {why}" in p.stdout.splitlines(), p.stdout[-3000:]
            return
        llm = inprocess_llm(model, max_model_len=256, kv_cache_memory_bytes=16 << 20)
        try:
            assert torch.cpu._is_amx_tile_supported()
            out, = llm.generate([{"prompt_token_ids": list(range(3, 40))}], SamplingParams(max_tokens=5, temperature=0),
                                use_tqdm=False)
            key = record_key(out.request_id, 0, 1)
            r = wait_records(tmp_path, [key])[key]
            assert r.complete and r.output_token_ids.tolist() == list(out.outputs[0].token_ids)
            v = Oracle(str(model)).check(r)
            assert v.ok and v.rows == (37 + 5 - 1) * r.routed_experts.shape[1], (v.mismatches[:3],)
        finally:
            shutdown(llm)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
