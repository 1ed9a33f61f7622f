"""The embedded trainer endpoint has no CURVE: a non-loopback tcp address is refused at start-up, with the check
`routing-replay consume --serve` uses (protocol.security.check_bind), unless the operator accepts it."""

import subprocess
import sys

import pytest
import zmq

from routing_replay.apps.embedded import EmbeddedPipeline
from routing_replay.engines.vllm_plugin import plugin, settings
from routing_replay.protocol.security import CLI_REMEDY

CLEAR = "is reachable from other hosts and would run without authentication or encryption"


@pytest.fixture
def env(monkeypatch):
    for k in ("ROUTING_REPLAY_BROKER", "ROUTING_REPLAY_NPZ_DIR", "ROUTING_REPLAY_SERVE", "ROUTING_REPLAY_REQUESTS",
              "ROUTING_REPLAY_SERVE_INSECURE", "ROUTING_REPLAY_CURVE_SECRET", "ROUTING_REPLAY_BROKER_KEY"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("ROUTING_REPLAY_BROKER", "embedded")
    return monkeypatch


@pytest.mark.parametrize("endpoint", ["tcp://0.0.0.0:5560", "tcp://*:5560", "tcp://10.1.2.3:5560"])
def test_the_engine_refuses_a_non_loopback_embedded_trainer_endpoint(env, endpoint):
    env.setenv("ROUTING_REPLAY_SERVE", endpoint)
    with pytest.raises(ValueError) as e:
        settings.current()
    msg = str(e.value)
    assert msg.startswith(f"ROUTING_REPLAY_SERVE {endpoint} {CLEAR}: ") and "ROUTING_REPLAY_SERVE_INSECURE=1" in msg
    with pytest.raises(ValueError, match=CLEAR):      # the plugin's entry point: the engine does not start
        plugin.register()
    env.setenv("ROUTING_REPLAY_SERVE_INSECURE", "1")
    assert settings.current().serve == endpoint
    env.setenv("ROUTING_REPLAY_SERVE_INSECURE", "maybe")
    with pytest.raises(ValueError, match="ROUTING_REPLAY_SERVE_INSECURE must be a boolean, got 'maybe'"):
        settings.current()


@pytest.mark.parametrize("endpoint", ["tcp://127.0.0.1:5560", "tcp://localhost:5560", "ipc:///tmp/rr-serve"])
def test_loopback_and_ipc_embedded_trainer_endpoints_start(env, endpoint):
    env.setenv("ROUTING_REPLAY_SERVE", endpoint)
    assert settings.current().serve == endpoint


def test_the_in_process_pipeline_refuses_it_too_and_the_cli_says_the_same(tmp_path):
    with pytest.raises(ValueError, match=f"serve tcp://0.0.0.0:0 {CLEAR}: .*insecure=True"):
        EmbeddedPipeline(serve="tcp://0.0.0.0:0", context=zmq.Context.instance())
    pipe = EmbeddedPipeline(serve="tcp://0.0.0.0:*", insecure=True, name="guard-test")
    pipe.close()
    out = subprocess.run([sys.executable, "-m", "routing_replay.apps.cli", "consume", "--connect",
                          f"ipc://{tmp_path}/b", "--serve", "tcp://0.0.0.0:0"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2
    assert out.stderr.splitlines()[-1].endswith(f"--serve tcp://0.0.0.0:0 {CLEAR}: {CLI_REMEDY}")
