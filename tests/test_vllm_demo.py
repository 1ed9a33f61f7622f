"""The main job end to end: `python -m routing_replay.apps.demo` (vLLM's default multi-process layout, embedded
pipeline, npz, oracle) exits 0 and leaves one complete record per captured request."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
pytest.importorskip("vllm")


def test_demo_passes_and_writes_records(tmp_path):
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, "-m", "routing_replay.apps.demo", "--out", str(out), "--requests", "24",
                        "--rounds", "1", "--max-tokens", "24"], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "oracle (HF transformers)  PASS" in p.stdout and "\nOK\n" in p.stdout
    assert "24 written, 24 complete" in p.stdout
    from routing_replay.consumer import load_records
    recs = load_records(out)
    assert len(recs) == 24 and all(r.complete for r in recs.values())
    cached = sum(r.num_cached_tokens for r in recs.values())
    assert cached > 0                                                    # the shared prefixes hit the cache
    # --prefix-rows fill is the demo's default: every hit row carries routing, and the summary says so
    assert all(r.num_prefix_filled == r.num_cached_tokens for r in recs.values())
    assert all((r.prompt_routed_experts >= 0).all() for r in recs.values())
    assert f"{cached:,} filled from the prefix store, 0 not found" in p.stdout


@pytest.mark.archs
def test_demo_on_deepseek_v3(tmp_path):
    """`--arch deepseek_v3`: MLA attention, sigmoid scores with `e_score_correction_bias`, 4 expert groups of which
    2 are kept, a dense first layer. vLLM's CPU build turns prefix caching off for MLA; with its torch rotary
    embedding (the demo's NATIVE_ROPE) vLLM computes what transformers does: the oracle passes in float32, and the
    R3 measurement replays the records through the trainer's DeepSeek-V3 routers exactly."""
    import re

    import numpy as np

    out = tmp_path / "out"
    p = subprocess.run([sys.executable, "-m", "routing_replay.apps.demo", "--out", str(out), "--arch", "deepseek_v3",
                        "--requests", "8", "--group-size", "4", "--prefixes", "1", "--rounds", "1",
                        "--max-tokens", "16"], capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    s = p.stdout
    assert "\nOK\n" in s and "8 written, 8 complete" in s
    assert re.search(r"vLLM\s+[\d.]+, multi-process engine, deepseek_v3 float32 \(3 MoE layers, top-2\)", s), s
    from routing_replay.consumer import load_records
    recs = load_records(out)
    assert len(recs) == 8 and all(r.complete for r in recs.values())
    assert all(r.moe_layer_ids.tolist() == [1, 2, 3] for r in recs.values())          # layer 0 is dense
    assert all(r.num_cached_tokens == 0 for r in recs.values())
    prompt_rows = sum(len(r.prompt_token_ids) for r in recs.values())
    assert f"none: vLLM turned prefix caching off for this model ({prompt_rows:,} prompt rows computed)" in s
    recorded = sum(int((np.concatenate([r.prompt_routed_experts, r.routed_experts]) >= 0).all(-1).sum())
                   for r in recs.values())
    assert recorded == sum(len(r.prompt_token_ids) + 16 - 1 for r in recs.values()) * 3     # all but last tokens
    assert re.search(rf"oracle \(HF transformers\)\s+PASS: {recorded:,} \(token, layer\) rows, 100\.000% identical "
                     r"top-k sets, 0 near ties", s), s[-3000:]
    assert re.search(rf"R3 replayed routing\s+100\.000% of {recorded:,} rows agree with the engine", s), s[-3000:]
    assert re.search(rf"R3 fallback rows\s+0 prefix-cache rows \(0 tokens\), {8 * 3} last-token rows, 0 other, of "
                     rf"{recorded + 8 * 3:,} \(token, layer\) rows", s), s[-3000:]
    assert re.search(r"R3 trainer\s+HF transformers bfloat16, 8 samples, 128 generated tokens", s), s[-3000:]


@pytest.mark.archs
def test_demo_on_glm4_moe(tmp_path):
    """`--arch glm4_moe`: the DeepSeek-V3 router (sigmoid, correction bias, groups) with grouped-query attention, which
    vLLM computes as transformers does: the oracle is counted and passes, prefix-cache hits carry filled routing,
    and replay agrees with the engine on every recorded row."""
    import re

    import numpy as np

    out = tmp_path / "out"
    p = subprocess.run([sys.executable, "-m", "routing_replay.apps.demo", "--out", str(out), "--arch", "glm4_moe",
                        "--requests", "8", "--group-size", "4", "--prefixes", "1", "--rounds", "1",
                        "--max-tokens", "16"], capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    s = p.stdout
    from routing_replay.consumer import load_records
    recs = load_records(out)
    assert len(recs) == 8 and all(r.complete for r in recs.values())
    assert all(r.moe_layer_ids.tolist() == [1, 2, 3] for r in recs.values())
    cached = sum(r.num_cached_tokens for r in recs.values())
    assert cached > 0 and f"{cached:,} filled from the prefix store, 0 not found" in s
    recorded = sum(int((np.concatenate([r.prompt_routed_experts, r.routed_experts]) >= 0).all(-1).sum())
                   for r in recs.values())
    assert re.search(rf"oracle \(HF transformers\)\s+PASS: {recorded:,} \(token, layer\) rows", s), s[-3000:]
    assert re.search(rf"R3 replayed routing\s+100\.000% of {recorded:,} rows agree with the engine", s), s[-3000:]
    assert "\nOK\n" in s


def test_vllm_cpu_rotary_kernel_and_a_3d_query():
    """Why the demo runs DeepSeek-V3 with vLLM's torch rotary embedding on CPU (apps/demo.py NATIVE_ROPE): vLLM's MLA
    rotates `q[..., qk_nope_head_dim:]`, a (tokens, heads, 64) view, and the CPU kernel rotates such a query wrongly
    with two heads (right with one, and right for the same numbers as a 2-D (tokens, heads * 64) tensor). When this
    fails, vLLM fixed the kernel and NATIVE_ROPE can go."""
    import torch
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("the CPU kernel")
    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(64, max_position=1024, is_neox_style=False,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, dtype=torch.float32)
    torch.manual_seed(0)
    q = torch.randn(5, 2, 192)                                    # 5 tokens, 2 heads, nope 128 + rope 64
    k = torch.randn(5, 1, 64)
    pos = torch.arange(5)
    want_q, want_k = rope.forward_native(pos, q[..., 128:].reshape(5, -1).clone(), k.reshape(5, -1).clone())
    flat_q, flat_k = q[..., 128:].reshape(5, -1).clone(), k.reshape(5, -1).clone()
    rope.forward_cpu(pos, flat_q, flat_k)
    assert torch.allclose(flat_q, want_q, atol=1e-5) and torch.allclose(flat_k, want_k, atol=1e-5)
    view_q, view_k = q.clone(), k.clone()
    rope.forward_cpu(pos, view_q[..., 128:], view_k)               # as vLLM's MLA calls it
    assert torch.allclose(view_k.reshape(5, -1), want_k, atol=1e-5)
    assert not torch.allclose(view_q[..., 128:].reshape(5, -1), want_q, atol=1e-2)
    one_q = q[:, :1, 128:].clone()                                 # one head: right
    rope.forward_cpu(pos, one_q, k.clone())
    assert torch.allclose(one_q.reshape(5, -1), want_q[:, :64], atol=1e-5)


@pytest.mark.archs
@pytest.mark.parametrize("arch", ["qwen2_moe", "olmoe", "gpt_oss", "granitemoe", "llama4"])
def test_demo_on_other_families(tmp_path, arch):
    """The other families vLLM's CPU build runs and the trainer replays: oracle passes, replay agrees on every
    recorded row. GPT-OSS and Llama-4 have several KV cache groups: their prefix-cache hits stay -1 (the plugin
    cannot fill them) and fall back to the trainer's router."""
    import re

    import numpy as np

    out = tmp_path / "out"
    p = subprocess.run([sys.executable, "-m", "routing_replay.apps.demo", "--out", str(out), "--arch", arch,
                        "--requests", "4", "--group-size", "2", "--prefixes", "1", "--rounds", "1",
                        "--max-tokens", "8"], capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    s = p.stdout
    from routing_replay.consumer import load_records
    recs = load_records(out)
    assert len(recs) == 4 and all(r.complete for r in recs.values())
    L = next(iter(recs.values())).prompt_routed_experts.shape[1]
    cached = sum(r.num_cached_tokens for r in recs.values())
    filled = sum(r.num_prefix_filled for r in recs.values())
    assert cached > 0 and filled == (0 if arch in ("gpt_oss", "llama4") else cached)
    recorded = sum(int((np.concatenate([r.prompt_routed_experts, r.routed_experts]) >= 0).all(-1).sum())
                   for r in recs.values())
    assert re.search(rf"oracle \(HF transformers\)\s+PASS: {recorded:,} \(token, layer\) rows", s), s[-3000:]
    assert re.search(rf"R3 replayed routing\s+100\.000% of {recorded:,} rows agree with the engine", s), s[-3000:]
    assert re.search(rf"R3 fallback rows\s+{(cached - filled) * L:,} prefix-cache rows \({cached - filled:,} tokens\), "
                     rf"{4 * L:,} last-token rows, 0 other", s), s[-3000:]
    if filled < cached:
        assert f"{cached - filled:,} are -1 (the plugin cannot fill them for this model" in s
    assert "\nOK\n" in s
