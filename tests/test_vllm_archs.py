"""The architecture matrix on the real vLLM CPU build: for each MoE family, a generated tiny checkpoint
(apps/models.py) runs in vLLM with the plugin capturing (embedded pipeline, npz records), and every record is checked
against the HF oracle (apps/oracle.py: the ids each transformers router selected, read from its output; near ties
and earlier-layer flips counted apart). One engine start per architecture, a few short prompts: two share a
150-token prefix (one 128-token block is a prefix-cache hit, -1 rows), two do not.

RUNS: the dtype vLLM's CPU build runs the family in (float32 where it can; DeepSeek-V2/V3's MLA only in bfloat16).
REFUSED: the families it cannot run, with the error it stops on (checked in a child process: a failed engine start
may leave state behind in this one). docs/VLLM.md, "Architecture matrix", has the table these tests back.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
vllm = pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402

from routing_replay.apps.models import make_tiny_model, moe_layer_ids  # noqa: E402
from routing_replay.apps.oracle import Oracle  # noqa: E402
from routing_replay.apps.vllm_harness import inprocess_llm, shutdown, wait_records, worker_of  # noqa: E402
from routing_replay.engines.vllm_plugin import capture_of  # noqa: E402

ENV = ("ROUTING_REPLAY_BROKER", "ROUTING_REPLAY_NPZ_DIR", "ROUTING_REPLAY_SERVE", "ROUTING_REPLAY_REQUESTS")
MAX_TOKENS = 8

# family -> (dtype vLLM's CPU build runs it in, vLLM's model class that runs it)
RUNS = {
    "qwen2_moe": ("float32", "Qwen2MoeForCausalLM"),
    "olmoe": ("float32", "OlmoeForCausalLM"),
    "phimoe": ("float32", "PhiMoEForCausalLM"),
    "gpt_oss": ("float32", "GptOssForCausalLM"),
    "glm4_moe": ("float32", "Glm4MoeForCausalLM"),
    "dots1": ("float32", "TransformersMoEForCausalLM"),    # vLLM 0.23 removed its own Dots1
    "deepseek_v2": ("bfloat16", "DeepseekV2ForCausalLM"),
    "deepseek_v3": ("bfloat16", "DeepseekV3ForCausalLM"),
}
# family -> (dtype tried, the line vLLM's CPU build stops on)
REFUSED: dict = {}


def _model(arch: str, dtype: str) -> Path:
    import tempfile

    return make_tiny_model(Path(tempfile.gettempdir()) / "routing-replay-models" / f"{arch}-{dtype}", arch,
                           dtype=dtype)


@pytest.fixture
def embedded(tmp_path):
    saved = {k: os.environ.get(k) for k in ENV}
    os.environ.update(ROUTING_REPLAY_BROKER="embedded", ROUTING_REPLAY_NPZ_DIR=str(tmp_path),
                      ROUTING_REPLAY_REQUESTS="all")
    os.environ.pop("ROUTING_REPLAY_SERVE", None)
    yield tmp_path
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _prompts() -> list:
    rnd = random.Random(7)
    prefix = [rnd.randrange(256) for _ in range(150)]
    return [prefix + [rnd.randrange(256) for _ in range(9)], prefix + [rnd.randrange(256) for _ in range(23)],
            [rnd.randrange(256) for _ in range(41)], [rnd.randrange(256) for _ in range(5)]]


@pytest.mark.parametrize("arch", sorted(RUNS))
def test_records_equal_the_oracle(arch, embedded, record_property):
    dtype, vllm_class = RUNS[arch]
    model = _model(arch, dtype)
    cfg = json.loads((model / "config.json").read_text())
    llm = inprocess_llm(model, dtype=dtype, max_model_len=512, max_num_batched_tokens=256,
                        enable_prefix_caching=True)
    try:
        resolved = llm.llm_engine.vllm_config.model_config.architectures
        cap = capture_of(worker_of(llm))
        layer_ids = list(cap.layer_ids)
        prompts = _prompts()
        first = llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=MAX_TOKENS, temperature=0,
                                                                                ignore_eos=True), use_tqdm=False)
        outs = first + llm.generate([{"prompt_token_ids": p} for p in prompts[1:]],
                                    SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True),
                                    use_tqdm=False)
        recs = wait_records(embedded, [o.request_id for o in outs])
    finally:
        shutdown(llm)
    assert vllm_class in resolved, resolved
    oracle = Oracle(str(model), dtype=dtype)
    assert layer_ids == oracle.layer_ids == moe_layer_ids(oracle.model.config), (layer_ids, oracle.layer_ids)
    assert cfg["architectures"] == [RUNS[arch][1]] or vllm_class.startswith("Transformers")
    L = len(layer_ids)
    cached = 0
    verdicts = []
    for o in outs:
        r = recs[o.request_id]
        assert r.complete and r.reason == "" and r.missing == []
        assert r.prompt_token_ids.tolist() == list(o.prompt_token_ids)
        assert r.output_token_ids.tolist() == list(o.outputs[0].token_ids)
        assert r.moe_layer_ids.tolist() == layer_ids and r.num_cached_tokens == o.num_cached_tokens
        v = oracle.check(r)
        verdicts.append(v)
        assert v.ok, (arch, o.request_id, v.error, v.mismatches[:3], v.sentinel_errors[:3], v.forced_error)
        assert v.rows == (len(o.prompt_token_ids) + MAX_TOKENS - 1 - r.num_cached_tokens) * L
        cached += r.num_cached_tokens
    assert cached == 128, cached                    # the second prompt's first block came from the prefix cache
    rows = sum(v.rows for v in verdicts)
    ties = sum(len(v.near_ties) for v in verdicts)
    flips = sum(len(v.flips) for v in verdicts)
    record_property("rows", rows)
    record_property("near_ties", ties)
    record_property("flips", flips)
    print(f"\n{arch} ({dtype}, {vllm_class}): {rows} rows, {rows - ties - flips} equal, {ties} near ties, "
          f"{flips} earlier-layer flips")
    if dtype == "float32":
        assert ties == flips == 0, (ties, flips)   # float32: the engine's selection equals HF's in every cell


@pytest.mark.parametrize("arch", sorted(REFUSED))
def test_refused_architectures_stop_with_the_documented_error(arch, tmp_path):
    dtype, error = REFUSED[arch]
    model = _model(arch, dtype)
    code = ("import sys; from routing_replay.apps.vllm_harness import inprocess_llm; "
            f"inprocess_llm(sys.argv[1], dtype={dtype!r}, max_model_len=512, max_num_batched_tokens=256)")
    env = {**os.environ, "ROUTING_REPLAY_BROKER": "embedded", "ROUTING_REPLAY_NPZ_DIR": str(tmp_path)}
    r = subprocess.run([sys.executable, "-c", code, str(model)], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode != 0 and error in r.stdout + r.stderr, (r.stdout + r.stderr)[-3000:]
