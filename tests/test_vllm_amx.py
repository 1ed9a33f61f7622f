"""vLLM CPU releases that refuse an MoE model's dtype, or an MLA model's attention weights, on CPUs with AMX
(engines/vllm_plugin/cpu_refusals.py), checked against the installed vLLM itself with its AMX decision,
`torch.cpu._is_amx_tile_supported()`, patched to True (so that a CPU without AMX checks the AMX branches too;
float32 layers run no AMX instruction on any release, so the engine runs all the same): where the table says the
release refuses float32, the plugin refuses before the model loads with one message naming release, CPU feature
and dtype, and so does vLLM's own code; where it says it does not, or with the setting the refusal names, a float32
engine starts and records exact rows."""

from __future__ import annotations

import json
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
from routing_replay.engines.vllm_plugin.cpu_refusals import (  # noqa: E402
    MLA_BACKEND_SETTING, amx_mla_refusal, check_engine, has_amx_mla, mla_settings, moe_dtype_refusal, native_rope)



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


def _config(device="cpu", dtype=torch.float32, moe=True, quantization=None, mla=False, backend=None):
    """The parts of a VllmConfig that check_engine reads."""
    return types.SimpleNamespace(device_config=types.SimpleNamespace(device_type=device),
                                 model_config=types.SimpleNamespace(dtype=dtype, is_moe=moe, use_mla=mla,
                                                                    quantization=quantization),
                                 attention_config=types.SimpleNamespace(backend=backend))


def test_mla_refusal_table():
    """vLLM CPU 0.29 and later choose AMX_MLA for MLA models on AMX CPUs (unless CPU_MLA is asked for), which takes
    bfloat16 and float16 weights only; releases without AMX_MLA run every MLA model on CPU_MLA."""
    why = amx_mla_refusal(torch.float32, amx=True)
    if not has_amx_mla():
        assert why is None and mla_settings("float32", amx=True) == {}
        return
    assert why.startswith("vLLM's CPU build runs MLA attention on its AMX_MLA backend on this CPU (it has AMX"), why
    assert "takes bfloat16, float16 weights only, and this model is float32" in why
    assert why.endswith(f"Start vLLM with {MLA_BACKEND_SETTING} (--attention-backend CPU_MLA), or with dtype=bfloat16")
    assert MLA_BACKEND_SETTING == 'attention_config={"backend": "CPU_MLA"}'
    assert amx_mla_refusal(torch.float32, "AMX_MLA", amx=True) == why
    for dtype in (torch.bfloat16, torch.float16):
        assert amx_mla_refusal(dtype, amx=True) is None
    assert amx_mla_refusal(torch.float32, "CPU_MLA", amx=True) is None
    assert amx_mla_refusal(torch.float32, amx=False) is None
    assert mla_settings("float32", amx=True) == {"attention_config": {"backend": "CPU_MLA"}}
    assert mla_settings(torch.float32, amx=False) == {} and mla_settings("bfloat16", amx=True) == {}


def test_start_up_check_names_the_mla_refusal(amx):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    refused = _config(mla=True)
    if not has_amx_mla():
        check_engine(_config(mla=True, moe=False), vllm.__version__)
        return
    with pytest.raises(RuntimeError, match=r"^routing-replay: vLLM's CPU build runs MLA attention on its AMX_MLA .*"
                                           r"this model is float32\. Start vLLM with attention_config="):
        check_engine(refused, "0.32.0")
    for cfg in (_config(mla=True, dtype=torch.bfloat16), _config(mla=True, backend=AttentionBackendEnum.CPU_MLA),
                _config(mla=False), _config(mla=True, device="cuda"), _config(mla=True, quantization="fp8")):
        check_engine(cfg, "0.32.0")


def test_start_up_check_names_the_refusal_once(amx):
    config = _config
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


@pytest.fixture
def embedded(monkeypatch, tmp_path):
    """The plugin's settings for an embedded pipeline writing npz files into tmp_path (restored after the test)."""
    monkeypatch.setenv("ROUTING_REPLAY_BROKER", "embedded")
    monkeypatch.setenv("ROUTING_REPLAY_NPZ_DIR", str(tmp_path))
    monkeypatch.setenv("ROUTING_REPLAY_REQUESTS", "all")
    for k in ("ROUTING_REPLAY_SERVE", "ROUTING_REPLAY_PREFIX_ROWS"):
        monkeypatch.delenv(k, raising=False)
    return tmp_path


# an engine that fails to start, each in a process of its own (a failed start leaves vLLM's process state behind),
# with AMX patched on: argv arch, "plugin" (inprocess_llm: the plugin loaded) or "vllm" (vLLM alone), engine keywords
_REFUSED_SCRIPT = """
import json, os, sys, torch
torch.cpu._is_amx_tile_supported = lambda: True
from routing_replay.apps.vllm_harness import inprocess_llm, tiny_model
model, kw = tiny_model(sys.argv[1]), dict(max_model_len=256, kv_cache_memory_bytes=16 << 20, **json.loads(sys.argv[3]))
try:
    if sys.argv[2] == "plugin":
        inprocess_llm(model, **kw)
    else:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import LLM
        LLM(model=str(model), dtype="float32", enforce_eager=True, distributed_executor_backend="uni", **kw)
except Exception as e:
    while e is not None:
        print("RAISED:" + str(e))
        e = e.__cause__ or e.__context__
    # AMX_MLA's weight packing is in vLLM's kernel library for CPUs with AVX512-BF16 (every AMX CPU); on other CPUs
    # (AMX patched on) vLLM loads a library without it
    print("PACKING_OP:", hasattr(torch.ops._C, "convert_weight_packed"))
    sys.exit(3)
"""


def _refused(arch: str, how: str, **kw) -> list[str]:
    """The lines _REFUSED_SCRIPT printed, after checking that the engine did not start."""
    env = {**os.environ, **({"VLLM_PLUGINS": "none-such"} if how == "vllm" else {})}    # vLLM alone: no plugin
    p = subprocess.run([sys.executable, "-c", _REFUSED_SCRIPT, arch, how, json.dumps(kw)], capture_output=True,
                       text=True, timeout=600, env=env)
    assert p.returncode == 3, p.stdout[-3000:] + p.stderr[-3000:]
    return p.stdout.splitlines()


def _exact_record(llm, model, records) -> None:
    """One greedy request through `llm`: its record is complete, and exact against HF transformers' routers."""
    assert torch.cpu._is_amx_tile_supported()
    out, = llm.generate([{"prompt_token_ids": list(range(3, 40))}], SamplingParams(max_tokens=5, temperature=0),
                        use_tqdm=False)
    key = record_key(out.request_id, 0, 1)
    r = wait_records(records, [key])[key]
    assert r.complete and r.output_token_ids.tolist() == list(out.outputs[0].token_ids)
    v = Oracle(str(model)).check(r)
    assert v.ok and v.rows == (37 + 5 - 1) * r.routed_experts.shape[1], (v.mismatches[:3],)


def test_float32_engine_on_an_amx_cpu(amx, embedded):
    """A float32 Mixtral engine as vLLM sees it on an AMX CPU: refused before the model loads, naming the release,
    the CPU feature and the dtype, where the table says so; else it runs and its record is exact."""
    if not _is_cpu_build():
        pytest.skip("vLLM's CPU build decides its MoE kernels by AMX; this is a GPU build")
    why = moe_dtype_refusal(vllm.__version__, torch.float32)
    if why is not None:
        lines = _refused("mixtral", "plugin")
        assert f"RAISED:routing-replay: {why}" in lines, lines[-30:]
        return
    model = tiny_model("mixtral")
    llm = inprocess_llm(model, max_model_len=256, kv_cache_memory_bytes=16 << 20)
    try:
        _exact_record(llm, model, embedded)
    finally:
        shutdown(llm)


@pytest.mark.archs
def test_float32_mla_engine_on_an_amx_cpu(amx, embedded):
    """DeepSeek-V3 (MLA) in float32 as vLLM 0.29+ sees it on an AMX CPU: vLLM alone fails inside its AMX_MLA weight
    processing; with the plugin the engine is refused before the model loads, naming the setting; with that setting
    (mla_settings: CPU_MLA) it runs and its record is exact."""
    if not _is_cpu_build():
        pytest.skip("vLLM's CPU build decides its MLA attention by AMX; this is a GPU build")
    if not has_amx_mla():
        pytest.skip(f"vLLM {vllm.__version__} has no AMX_MLA attention: every MLA model runs on CPU_MLA")
    rope = native_rope()                            # (MLA on CPU: the demo's NATIVE_ROPE)
    alone = _refused("deepseek_v3", "vllm", **rope)
    if "PACKING_OP: True" in alone:
        assert "RAISED:expect weight to be bfloat16, float16, int8, fp8_e4m3 or uint8(mxfp4 or int4)." in alone, \
            alone[-30:]
    else:                           # (a CPU without AVX512-BF16: AMX_MLA cannot run at all)
        assert "PACKING_OP: False" in alone, alone[-30:]
    lines = _refused("deepseek_v3", "plugin", **rope)
    assert f"RAISED:routing-replay: {amx_mla_refusal(torch.float32)}" in lines, lines[-30:]
    model = tiny_model("deepseek_v3")
    llm = inprocess_llm(model, max_model_len=256, kv_cache_memory_bytes=16 << 20, **rope, **mla_settings("float32"))
    try:
        assert llm.llm_engine.vllm_config.attention_config.backend.name == "CPU_MLA"
        _exact_record(llm, model, embedded)
    finally:
        shutdown(llm)
