"""One request's bad id never stops the engine or the stream (real vLLM CPU engine, HF oracle).

Ids that cannot travel as they are (`wire.request_id_problem`: a lone surrogate, over 1,024 UTF-8 bytes, be it
1,100 ASCII characters or 400 x '€' = 1,200 bytes) are captured under `protocol.ids.record_key_for(id)`; every
other request of the same batch keeps its own id. Two engines, one per fixture:

- offline: an in-process `LLM` (`LLMEngine.add_request(request_id=...)`) publishing over tcp to a real
  `routing-replay broker` and `routing-replay consume --npz-dir` process;
- the OpenAI server (`python -m vllm.entrypoints.openai.api_server`, embedded pipeline): an `X-Request-Id`
  header of 1,100 characters and a body `request_id` of 400 x '€' (the server names the engine request
  f"cmpl-{id}-0", see keys.py).
Every record is checked against the HF transformers oracle (float32, exact top-k sets).
"""

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

from vllm import SamplingParams  # noqa: E402

from routing_replay.apps.oracle import Oracle  # noqa: E402
from routing_replay.apps.vllm_harness import (inprocess_llm, shutdown, tiny_model, wait_records,  # noqa: E402
                                                worker_of)
from routing_replay.engines.vllm_plugin import capture_of, record_key  # noqa: E402
from routing_replay.protocol.ids import record_key_for  # noqa: E402
from routing_replay.protocol.wire import request_id_problem  # noqa: E402
from tests.procs import http_json, start_broker, start_consumer, stop_all, stop_popen  # noqa: E402

ENV = ("ROUTING_REPLAY_BROKER", "ROUTING_REPLAY_NPZ_DIR", "ROUTING_REPLAY_SERVE", "ROUTING_REPLAY_REQUESTS")
BAD_IDS = ["\udcff-x", "a" * 1100, "€" * 400]
STARTUP_S = 300


def _tokens(rnd, n):
    return [rnd.randrange(256) for _ in range(n)]


def _check_record(oracle, r, prompt, output, num_layers):
    assert r.complete and r.reason == "" and r.missing == [], (r.request_id[:80], r.reason, r.missing)
    assert r.prompt_token_ids.tolist() == list(prompt) and r.output_token_ids.tolist() == list(output)
    v = oracle.check(r)
    assert v.ok, (r.request_id[:80], v.error, v.mismatches[:3], v.sentinel_errors[:3])
    assert v.rows == (len(prompt) + len(output) - 1 - r.num_cached_tokens) * num_layers


def test_bad_ids_cannot_travel_and_derive_distinct_keys():
    problems = [request_id_problem(i) for i in BAD_IDS]
    assert all(problems), problems
    keys = [record_key_for(i) for i in BAD_IDS]
    assert len(set(keys)) == 3 and all(k.startswith("rr-sha256-") and len(k) == 74 for k in keys)
    assert all(request_id_problem(k) is None for k in keys)
    assert record_key_for("normal-0") == "normal-0" and record_key_for("€" * 341) == "€" * 341   # 1,023 bytes


# ---- offline API, external broker and consumer processes over tcp ------------------------------------------------

@pytest.fixture
def offline(tmp_path_factory):
    """Function-scoped (one test uses it): tests/conftest.py reaps every Proc after each test."""
    saved = {k: os.environ.get(k) for k in ENV}
    npz = tmp_path_factory.mktemp("npz")
    broker, fe, be = start_broker("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
    consumer = start_consumer(be, "--npz-dir", str(npz), "--finish-grace-ms", "100")
    for k in ENV:
        os.environ.pop(k, None)
    os.environ.update(ROUTING_REPLAY_BROKER=fe, ROUTING_REPLAY_REQUESTS="all")
    model = tiny_model("qwen3_moe")
    llm = None
    try:
        llm = inprocess_llm(model, max_num_batched_tokens=256, enable_prefix_caching=True, max_num_seqs=16)
        yield llm, npz, Oracle(str(model)), capture_of(worker_of(llm))
    finally:
        if llm is not None:
            shutdown(llm)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        stop_all(consumer, broker)


def test_offline_bad_ids_in_one_batch_with_normal_ones(offline):
    llm, npz, oracle, cap = offline
    eng = llm.llm_engine
    rnd = random.Random(11)
    ids = ["normal-0", BAD_IDS[0], "normal-1", BAD_IDS[1], BAD_IDS[2], "normal-2"]
    prompts = {rid: _tokens(rnd, 20 + 9 * i) for i, rid in enumerate(ids)}
    sp = SamplingParams(max_tokens=7, temperature=0, ignore_eos=True)
    derived0, skipped0 = cap.stats.derived_keys, cap.stats.skipped
    for rid in ids:
        eng.add_request(rid, {"prompt_token_ids": prompts[rid]}, sp)
    # a per-request error of another kind in the same batch: a malformed opt-in flag makes its capture fail
    bad_flag = SamplingParams(max_tokens=7, temperature=0, ignore_eos=True,
                              extra_args={"return_routed_experts": "maybe"})
    eng.add_request("bad-flag", {"prompt_token_ids": prompts["normal-0"][:12]}, bad_flag)
    done = {}
    for _ in range(200):                        # engine.step() must never raise for these ids
        if not eng.has_unfinished_requests():
            break
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    assert sorted(done) == sorted(ids + ["bad-flag"]) and len(done["bad-flag"].outputs[0].token_ids) == 7
    assert cap.stats.derived_keys - derived0 == 3 and cap.stats.skipped - skipped0 == 1
    keys = {record_key(rid): rid for rid in ids}
    assert [k for k in keys if k != keys[k]] == [record_key_for(i) for i in BAD_IDS]
    recs = wait_records(npz, keys, timeout_s=60)
    L = len(oracle.layer_ids)
    for key, rid in keys.items():
        out = done[rid]
        assert recs[key].request_id == key and recs[key].finish_reason == "length"
        _check_record(oracle, recs[key], prompts[rid], out.outputs[0].token_ids, L)
    # the stream goes on: a later request is captured as usual
    eng.add_request("after", {"prompt_token_ids": prompts["normal-0"][:15]}, sp)
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    recs = wait_records(npz, ["after"], timeout_s=60)
    _check_record(oracle, recs["after"], prompts["normal-0"][:15], done["after"].outputs[0].token_ids, L)
    # the skipped request has no record: one producer sends in order, so it would precede "after"'s
    assert "bad-flag" not in recs and len(recs) == len(keys) + 1


# ---- the OpenAI server, embedded pipeline ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("serve")
    model = tiny_model("qwen3_moe")
    uds, npz, logf = str(d / "http.sock"), d / "npz", d / "log.txt"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROUTING_REPLAY_")}
    env.update(ROUTING_REPLAY_BROKER="embedded", ROUTING_REPLAY_NPZ_DIR=str(npz), ROUTING_REPLAY_REQUESTS="all")
    log = open(logf, "w")
    srv = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                            "--uds", uds, "--dtype", "float32", "--enforce-eager",
                            "--max-model-len", "512", "--kv-cache-memory-bytes", str(128 << 20),
                            "--served-model-name", "tiny"], env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + STARTUP_S
        while True:
            if srv.poll() is not None:
                raise RuntimeError(f"the OpenAI server exited with {srv.returncode}; see {logf}")
            try:
                if http_json(uds, "GET", "/health")[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"the OpenAI server is not up after {STARTUP_S}s; see {logf}")
            time.sleep(0.5)
        yield uds, npz, model, srv, logf
    finally:
        stop_popen(srv, 60)
        log.close()


def _complete(uds, prompt, headers=None, **kw):
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 9, "temperature": 0, "return_token_ids": True,
            "ignore_eos": True, **kw}
    status, data = http_json(uds, "POST", "/v1/completions", body, headers)
    assert status == 200, data[:500]
    return json.loads(data)


def test_server_long_header_id_and_long_utf8_body_id(server):
    uds, npz, model, srv, logf = server
    header_id, body_id = "h" * 1100, "€" * 400
    p1, p2, p3 = list(range(10, 40)), list(range(50, 95)), list(range(100, 125))
    one = _complete(uds, p1, headers={"X-Request-Id": header_id})
    assert one["id"] == f"cmpl-{header_id}"
    assert http_json(uds, "GET", "/health")[0] == 200
    two = _complete(uds, p2, request_id=body_id)
    assert two["id"] == f"cmpl-{body_id}"
    assert http_json(uds, "GET", "/health")[0] == 200
    three = _complete(uds, p3)
    assert http_json(uds, "GET", "/health")[0] == 200 and srv.poll() is None
    # completions name their engine request f"{response id}-{prompt index}" (keys.py)
    want = {record_key(f"{r['id']}-0"): (p, r["choices"][0]["token_ids"])
            for r, p in ((one, p1), (two, p2), (three, p3))}
    derived = [k for k in want if k.startswith("rr-sha256-")]
    assert derived == [record_key_for(f"cmpl-{header_id}-0"), record_key_for(f"cmpl-{body_id}-0")]
    recs = wait_records(npz, want, timeout_s=60)
    oracle = Oracle(str(model))
    for key, (prompt, output) in want.items():
        assert recs[key].finish_reason == "length"
        _check_record(oracle, recs[key], prompt, output, len(oracle.layer_ids))
    # one WARNING line per derived key, naming the reason and the key
    lines = [x for x in open(logf, encoding="utf-8", errors="replace") if "cannot be a record key" in x]
    assert len(lines) == 2 and all(k in line for k, line in zip(derived, lines)), lines
    assert "request id of 1107 characters exceeds 1024 UTF-8 bytes" in lines[0]
    assert "request id of 407 characters is 1207 UTF-8 bytes, limit 1024" in lines[1]
