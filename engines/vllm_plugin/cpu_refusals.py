"""vLLM CPU releases that refuse an unquantized MoE model's dtype on some CPUs, named before the model loads.

vLLM CPU 0.27.x (vllm/model_executor/layers/fused_moe/cpu_fused_moe.py, `CPUFusedMOE.check_grouped_gemm`): where
`torch.cpu._is_amx_tile_supported()` is True (x86 CPUs with AMX: Sapphire Rapids and later Xeons), its AMX branch
takes bfloat16 weights only (with every expert dimension a multiple of 32 after its own padding) and raises for
any other dtype, with a message about the layer's shape and alignment. Every MoE layer of a float32 or float16
model then fails to load. From 0.28.0 on, the AMX experts are one choice among others: a layer they do not take
runs on the generic CPU kernel (docs/VLLM.md has the table).

`moe_dtype_refusal` names the refusal (release, CPU feature, dtype); the plugin raises it before the model loads
(`check_engine`) and the test harness skips the engine tests with it (tests/conftest.py).
"""

from __future__ import annotations

import torch

# release prefix -> the dtypes its CPU MoE takes on AMX CPUs (any other unquantized dtype is refused there)
AMX_ONLY_DTYPES = {"0.27.": (torch.bfloat16,)}


def amx_supported() -> bool:
    """What vLLM's CPU build decides its AMX kernels by: torch.cpu._is_amx_tile_supported() (False where torch
    has no such check)."""
    check = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(check()) if check is not None else False


def moe_dtype_refusal(version: str, dtype: torch.dtype, amx: bool | None = None) -> str | None:
    """The reason vLLM CPU `version` refuses unquantized MoE layers of `dtype` on this CPU (`amx`: whether it has
    AMX as vLLM decides it; None: ask torch), or None where it takes them."""
    for prefix, taken in AMX_ONLY_DTYPES.items():
        if version.startswith(prefix) and dtype not in taken:
            if amx is None:
                amx = amx_supported()
            if not amx:
                return None
            names = ", ".join(str(d).replace("torch.", "") for d in taken)
            return (f"vLLM CPU {version} refuses unquantized MoE layers of dtype {str(dtype).replace('torch.', '')} "
                    f"on this CPU: it has AMX (torch.cpu._is_amx_tile_supported() is True), and that release's "
                    f"fused-MoE AMX kernel takes {names} only (cpu_fused_moe.py, CPUFusedMOE.check_grouped_gemm). "
                    f"Use dtype=bfloat16, or vLLM CPU 0.28.0 or later, which runs such layers on its generic CPU "
                    f"kernel")
    return None


def check_engine(vllm_config, version: str) -> None:
    """Before the model loads: RuntimeError naming the refusal if this vLLM release will refuse the model's MoE
    layers on this CPU (an unquantized MoE model on a CPU device), instead of one shape error per layer later."""
    mc = vllm_config.model_config
    if vllm_config.device_config.device_type != "cpu" or getattr(mc, "quantization", None) is not None:
        return
    try:
        moe = bool(mc.is_moe)
    except Exception:           # noqa: BLE001 -- a config without the field: vLLM's own check speaks later
        return
    reason = moe_dtype_refusal(version, mc.dtype) if moe else None
    if reason is not None:
        raise RuntimeError(f"routing-replay: {reason}")


ROTARY_SETTING = 'compilation_config={"custom_ops": ["all", "-rotary_embedding"]}'


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
