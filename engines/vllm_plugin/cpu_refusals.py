"""vLLM CPU releases that refuse an unquantized MoE model's dtype on some CPUs, named before the model loads.

vLLM CPU 0.27.x (vllm/model_executor/layers/fused_moe/cpu_fused_moe.py, `CPUFusedMOE.check_grouped_gemm`): where
`torch.cpu._is_amx_tile_supported()` is True (x86 CPUs with AMX: Sapphire Rapids and later Xeons), its AMX branch
takes bfloat16 weights only (with every expert dimension a multiple of 32 after its own padding) and raises for
any other dtype, with a message about the layer's shape and alignment. Every MoE layer of a float32 or float16
model then fails to load. From 0.28.0 on, the AMX experts are one choice among others: a layer they do not take
runs on the generic CPU kernel (docs/VLLM.md has the table).

vLLM CPU 0.29 and later (vllm/platforms/cpu.py, `get_attn_backend_cls`): on such a CPU an MLA model (DeepSeek-V2/V3,
Kimi-K2, GLM-4.7-Flash) gets the AMX_MLA attention unless CPU_MLA is asked for, and AMX_MLA takes bfloat16 or
float16 weights only: a float32 MLA model fails while its weights are processed ("expect weight to be bfloat16,
float16, int8, fp8_e4m3 or uint8"). `attention_config={"backend": "CPU_MLA"}` runs it on the reference CPU MLA.

`moe_dtype_refusal` and `amx_mla_refusal` name the refusal (release, CPU feature, dtype, the setting that avoids
it); the plugin raises it before the model loads (`check_engine`), the test harness skips the engine tests with the
first (tests/conftest.py), and `mla_settings` gives the demo and the tests the engine setting for the second.
"""

from __future__ import annotations

import json

import torch

# release prefix -> the dtypes its CPU MoE takes on AMX CPUs (any other unquantized dtype is refused there)
AMX_ONLY_DTYPES = {"0.27.": (torch.bfloat16,)}


def amx_supported() -> bool:
    """What vLLM's CPU build decides its AMX kernels by: torch.cpu._is_amx_tile_supported() (False where torch
    has no such check)."""
    check = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(check()) if check is not None else False


def _names(*dtypes: torch.dtype) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def moe_dtype_refusal(version: str, dtype: torch.dtype, amx: bool | None = None) -> str | None:
    """The reason vLLM CPU `version` refuses unquantized MoE layers of `dtype` on this CPU (`amx`: whether it has
    AMX as vLLM decides it; None: ask torch), or None where it takes them."""
    for prefix, taken in AMX_ONLY_DTYPES.items():
        if version.startswith(prefix) and dtype not in taken:
            if not (amx_supported() if amx is None else amx):
                return None
            return (f"vLLM CPU {version} refuses unquantized MoE layers of dtype {_names(dtype)} on this CPU: it has "
                    f"AMX (torch.cpu._is_amx_tile_supported() is True), and that release's fused-MoE AMX kernel "
                    f"takes {_names(*taken)} only (cpu_fused_moe.py, CPUFusedMOE.check_grouped_gemm). "
                    f"Use dtype=bfloat16, or vLLM CPU 0.28.0 or later, which runs such layers on its generic CPU "
                    f"kernel")
    return None


def _setting(kw: dict) -> str:
    """Engine keyword arguments as a user writes them: name={json}."""
    return ", ".join(f"{k}={json.dumps(v)}" for k, v in kw.items())


def cpu_mla_attention() -> dict:
    """The engine keyword arguments that run MLA attention on vLLM CPU's reference CPU_MLA backend."""
    return {"attention_config": {"backend": "CPU_MLA"}}


MLA_BACKEND_SETTING = _setting(cpu_mla_attention())
# the weight dtypes vLLM CPU's AMX_MLA attention takes unquantized (amx_mla.py, process_weights_after_loading)
AMX_MLA_DTYPES = (torch.bfloat16, torch.float16)


def has_amx_mla() -> bool:
    """Whether the installed vLLM has the AMX_MLA attention backend (vLLM CPU 0.29 and later)."""
    try:
        from vllm.v1.attention.backends.registry import AttentionBackendEnum
    except ImportError:
        return False
    return hasattr(AttentionBackendEnum, "AMX_MLA")


def amx_mla_refusal(dtype: torch.dtype, backend=None, amx: bool | None = None) -> str | None:
    """The reason vLLM's CPU build refuses an unquantized MLA model of `dtype` on this CPU when its attention
    backend is `backend` (None: vLLM's own choice; an AttentionBackendEnum or its name), or None where it takes it.
    `amx`: whether the CPU has AMX as vLLM decides it (None: ask torch)."""
    if dtype in AMX_MLA_DTYPES:
        return None
    name = getattr(backend, "name", backend)
    if name not in (None, "AMX_MLA") or not has_amx_mla() or not (amx_supported() if amx is None else amx):
        return None
    return (f"vLLM's CPU build runs MLA attention on its AMX_MLA backend on this CPU (it has AMX: "
            f"torch.cpu._is_amx_tile_supported() is True), which takes {_names(*AMX_MLA_DTYPES)} weights only, and "
            f"this model is {_names(dtype)}. Start vLLM with {MLA_BACKEND_SETTING} (--attention-backend "
            f"CPU_MLA), or with dtype=bfloat16")


def mla_settings(dtype: torch.dtype | str, amx: bool | None = None) -> dict:
    """Engine keyword arguments for an MLA model of `dtype` on vLLM's CPU build: the CPU_MLA attention where vLLM
    would choose AMX_MLA and AMX_MLA refuses the dtype (amx_mla_refusal), else none."""
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    return cpu_mla_attention() if amx_mla_refusal(dtype, amx=amx) else {}


def check_engine(vllm_config, version: str) -> None:
    """Before the model loads: RuntimeError naming the refusal if this vLLM release will refuse the model's MoE
    layers (an unquantized MoE model on a CPU device) or its MLA attention's weights on this CPU, instead of one
    shape error per layer, or a dtype error from inside vLLM, later."""
    mc = vllm_config.model_config
    if vllm_config.device_config.device_type != "cpu" or getattr(mc, "quantization", None) is not None:
        return
    try:
        moe = bool(mc.is_moe)
    except Exception:           # noqa: BLE001 -- a config without the field: vLLM's own check speaks later
        return
    reason = moe_dtype_refusal(version, mc.dtype) if moe else None
    if reason is None and getattr(mc, "use_mla", False):
        attention = getattr(vllm_config, "attention_config", None)
        reason = amx_mla_refusal(mc.dtype, getattr(attention, "backend", None))
    if reason is not None:
        raise RuntimeError(f"routing-replay: {reason}")


def native_rope() -> dict:
    """The engine keyword arguments that run vLLM's torch rotary embedding instead of its CPU kernel (every other
    custom op stays on): what an MLA model needs on vLLM's CPU build (mla_rotary_kernel_warning)."""
    return {"compilation_config": {"custom_ops": ["all", "-rotary_embedding"]}}


ROTARY_SETTING = _setting(native_rope())


def mla_rotary_kernel_warning(model, use_mla: bool, device_type: str) -> str | None:
    """The WARNING for an MLA model on vLLM's CPU build whose rotary embedding runs the CPU kernel
    `_C.rotary_embedding` (`RotaryEmbedding.forward_cpu`: the `rotary_embedding` custom op enabled), or None.
    MLA rotates `q[..., qk_nope_head_dim:]`, a 3-D (tokens, heads, dims) view, and that kernel rotates such a query
    wrongly when it has more than one head (tests/test_vllm_demo.py::test_vllm_cpu_rotary_kernel_and_a_3d_query):
    the model computes other hidden states, and so other routing, than the checkpoint's own. Rotary classes with
    no CPU kernel of their own (DeepSeek's YaRN scaling) run the torch path and are not named."""
    if device_type != "cpu" or not use_mla:
        return None
    try:
        from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
    except ImportError:         # another layout: nothing to say about it
        return None
    for name, mod in model.named_modules():
        # what the module runs: CustomOp binds its forward at construction (forward_native where the op is
        # disabled); a subclass with its own forward_cpu does not call the kernel
        run = getattr(getattr(mod, "_forward_method", None), "__func__", None)
        if isinstance(mod, RotaryEmbedding) and run is RotaryEmbedding.forward_cpu:
            return (f"routing-replay: MLA model on vLLM's CPU build with the rotary_embedding custom op enabled "
                    f"({name or 'model'}: {type(mod).__name__}): its CPU kernel rotates MLA's 3-D multi-head query "
                    f"wrongly, so hidden states and routing differ from the checkpoint's; start vLLM with "
                    f"{ROTARY_SETTING}")
    return None
