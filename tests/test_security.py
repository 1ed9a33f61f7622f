"""CURVE on real processes: only allow-listed producers, consumers and trainers get in; unauthenticated peers are
rejected and their frames never reach a record. Keys come from `routing-replay keys`; a non-loopback tcp bind
without keys needs --insecure."""

import re
import stat
import subprocess
import sys

import numpy as np
import pytest
import zmq

from routing_replay.consumer import TrainerClient
from routing_replay.producer import Producer
from routing_replay.protocol import security
from routing_replay.apps.synthetic import SyntheticEngine, workload
from tests.procs import Proc, start_broker, start_consumer
from tests.test_pipeline import check_records, wait_records

L, K, E = 4, 2, 16
CLI = [sys.executable, "-m", "routing_replay.apps.cli"]

pytestmark = pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CURVE")


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    """broker, consumer, engine, trainer and an outsider; allow-lists as docker-compose.yml mounts them."""
    d = tmp_path_factory.mktemp("keys")
    for name in ("broker", "consumer", "engine", "trainer", "outsider"):
        out = subprocess.run(CLI + ["keys", str(d), "--name", name], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
    for allow, names in (("broker-allow", ("engine", "consumer")), ("consumer-allow", ("trainer",))):
        (d / allow).mkdir()
        for n in names:
            (d / allow / f"{n}.key").write_bytes((d / f"{n}.key").read_bytes())
    return d


def test_keys_subcommand_writes_a_pair_and_refuses_to_overwrite(keys):
    pub, sec = security.load_secret(keys / "engine.key_secret")
    assert security.load_public(keys / "engine.key") == pub and len(pub) == len(sec) == 40
    assert stat.S_IMODE((keys / "engine.key_secret").stat().st_mode) == 0o600
    again = subprocess.run(CLI + ["keys", str(keys), "--name", "engine"], capture_output=True, text=True, timeout=60)
    assert again.returncode == 2 and "exists" in again.stderr
    with pytest.raises(ValueError, match="holds no secret key"):
        security.load_secret(keys / "engine.key")


@pytest.mark.parametrize("endpoint,local", [
    ("tcp://127.0.0.1:5557", True), ("tcp://localhost:1", True), ("tcp://[::1]:5", True), ("ipc:///tmp/x", True),
    ("inproc://x", True), ("tcp://0.0.0.0:5557", False), ("tcp://*:5557", False), ("tcp://10.1.2.3:1", False),
    ("tcp://eth0:5557", False), ("tcp://127.0.0.1:1;10.0.0.1:2", False), ("tcp://host.example:1", False),
])
def test_loopback_detection(endpoint, local):
    assert security.is_loopback_or_local(endpoint) is local


def test_non_loopback_bind_needs_keys_or_insecure(tmp_path, keys):
    out = subprocess.run(CLI + ["broker", "--frontend", "tcp://0.0.0.0:*", "--backend", f"ipc://{tmp_path}/b"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--insecure" in out.stderr.splitlines()[-1]
    out = subprocess.run(CLI + ["consume", "--connect", f"ipc://{tmp_path}/b", "--serve", "tcp://*:0"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--insecure" in out.stderr.splitlines()[-1]
    b = Proc(["broker", "--frontend", "tcp://0.0.0.0:*", "--backend", f"ipc://{tmp_path}/b", "--insecure"])
    try:
        b.wait_for(r"broker frontend=tcp://0\.0\.0\.0:\d+ .*curve=off")
    finally:
        assert b.stop() == 0
    b = Proc(["broker", "--frontend", "tcp://0.0.0.0:*", "--backend", "tcp://0.0.0.0:*",
              "--curve-secret", str(keys / "broker.key_secret"), "--curve-allow", str(keys / "broker-allow")])
    try:
        b.wait_for(r"broker frontend=tcp://0\.0\.0\.0:\d+ .*curve=on")
    finally:
        assert b.stop() == 0
    half = subprocess.run(CLI + ["broker", "--curve-secret", str(keys / "broker.key_secret")], capture_output=True,
                          text=True, timeout=60)
    assert half.returncode == 2 and "curve_allow" in half.stderr.splitlines()[-1]


def test_only_allow_listed_peers_get_in_and_outsiders_never_reach_a_record(tmp_path, keys):
    k = {n: str(keys / f"{n}.key_secret") for n in ("broker", "consumer", "engine", "trainer", "outsider")}
    pub = {n: str(keys / f"{n}.key") for n in ("broker", "consumer")}
    broker, fe, be = start_broker("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", "--curve-secret", k["broker"],
                                  "--curve-allow", str(keys / "broker-allow"))
    out = tmp_path / "out"
    c = start_consumer(be, "--npz-dir", str(out), "--serve", "tcp://127.0.0.1:*", "--curve-secret", k["consumer"],
                       "--broker-key", pub["broker"], "--curve-allow", str(keys / "consumer-allow"))
    serve = c.wait_for(r"serve=(\S+)").group(1)
    broker.wait_for("consumers=1")
    # a consumer with a key the broker does not allow never joins (it would be routed requests otherwise)
    rogue = start_consumer(be, "--consumer-id", "rogue", "--curve-secret", k["outsider"], "--broker-key",
                           pub["broker"])
    try:
        evil_specs = workload(6, seed=72, prefix="evil")
        outsiders = [
            Producer(fe, num_layers=L, top_k=K, linger_ms=0),                                   # no CURVE at all
            Producer(fe, num_layers=L, top_k=K, linger_ms=0, curve_secret=k["outsider"],       # a key not allowed
                     server_key=pub["broker"]),
            Producer(fe, num_layers=L, top_k=K, linger_ms=0, curve_secret=k["engine"],         # pins a wrong server
                     server_key=pub["consumer"]),
        ]
        for p in outsiders:
            SyntheticEngine(num_layers=L, top_k=K, num_experts=E).run(p, evil_specs, seed=72)
        specs = workload(20, seed=71, prefix="good")
        with Producer(fe, num_layers=L, top_k=K, curve_secret=k["engine"], server_key=pub["broker"]) as p:
            SyntheticEngine(num_layers=L, top_k=K, num_experts=E).run(p, specs, seed=71)
            assert p.wait_acked(30)
        recs = wait_records([out], 20)
        check_records(specs, recs)
        for p in outsiders:                          # the handshake failed: nothing of theirs ever left the process
            assert (p.stats.sent_msgs, p.stats.acked_msgs, p.stats.broker_epochs) == (0, 0, 0) and p.unacked_msgs > 0
            p.close(0.2)
        assert sorted(x.name for x in out.iterdir()) == sorted(f"{s.request_id}.npz" for s in specs)
        m = broker.wait_for(r"msgs_in=(\d+) .*consumers=(1) producers=(\d+)")   # after the consumer joined
        assert (m.group(2), m.group(3)) in (("1", "1"), ("1", "0"))
        # trainers: the allowed key fetches; an outsider key and a plain socket get nothing
        with TrainerClient(serve, curve_secret=k["trainer"], server_key=pub["consumer"]) as t:
            got = t.fetch([s.request_id for s in specs[:2]], timeout_s=10)
        assert all(got[s.request_id].equals(recs[s.request_id]) for s in specs[:2])
        for kw in ({}, {"curve_secret": k["outsider"], "server_key": pub["consumer"]}):
            with TrainerClient(serve, **kw) as t, pytest.raises(TimeoutError):
                t.fetch([specs[2].request_id], timeout_s=1.5)
        # the subscribe CLI with the allowed key sees live records
        sub = Proc(["subscribe", "--connect", serve, "--prefix", "late-", "--count", "1", "--curve-secret",
                    k["trainer"], "--server-key", pub["consumer"]])
        c.wait_for(r"subscriber .* prefix='late-'")
        with Producer(fe, num_layers=L, top_k=K, curve_secret=k["engine"], server_key=pub["broker"]) as p:
            p.open("late-1", prompt_len=2)
            p.publish_rows(["late-1"], [0], [2], np.zeros((2, L, K), np.int16))
            p.finish("late-1", num_output_tokens=1)
        assert sub.p.wait(30) == 0
        assert any(re.match(r"late-1 prompt=2 output=1 .*complete=True", x) for x in sub.lines)
        assert not any("rogue" in x for x in broker.lines)
    finally:
        rogue.stop()
        assert c.stop() == 0
        assert broker.stop() == 0


def test_frames_near_the_size_limit_pass_under_curve_with_room_for_its_overhead(keys):
    """CURVE sends each frame with ~33 bytes more, and ZMQ_MAXMSGSIZE (1 GiB) counts them: a frame of exactly
    1 GiB was dropped with its connection, so the producer resent that delta forever and the record never came.
    At 64 layers x top-8 (1,024-byte rows) the producer cut a 1,048,676-row step after 1,048,576 rows (1 GiB), and a
    consumer would send such a record's prompt rows as one 1 GiB frame. Payload frames now stay 64 KiB under the
    limit (wire.MAX_PAYLOAD_FRAME_BYTES). Real broker and consumer processes, CURVE on every hop; the trainer
    fetches the record exact."""
    k = {n: str(keys / f"{n}.key_secret") for n in ("broker", "consumer", "engine", "trainer")}
    pub = {n: str(keys / f"{n}.key") for n in ("broker", "consumer")}
    Lb, Kb = 64, 8
    n = (1 << 30) // (Lb * Kb * 2) + 100
    rows = np.resize(np.arange(30011, dtype=np.int16), (n, Lb, Kb))
    broker, fe, be = start_broker("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", "--curve-secret", k["broker"],
                                  "--curve-allow", str(keys / "broker-allow"))
    c = start_consumer(be, "--serve", "tcp://127.0.0.1:*", "--curve-secret", k["consumer"], "--broker-key",
                       pub["broker"], "--curve-allow", str(keys / "consumer-allow"))
    serve = c.wait_for(r"serve=(\S+)").group(1)
    broker.wait_for("consumers=1")
    try:
        with Producer(fe, num_layers=Lb, top_k=Kb, curve_secret=k["engine"], server_key=pub["broker"],
                      max_queue_bytes=2 << 30) as p:
            p.open("long", prompt_len=n)
            assert p.publish_rows(["long"], [0], [n], rows)
            p.finish("long", num_output_tokens=1)
            assert p.wait_acked(120), "the 1 GiB delta never got through"
            assert p.stats.split_steps == 1 and p.stats.refused_by_broker == 0
        with TrainerClient(serve, curve_secret=k["trainer"], server_key=pub["consumer"]) as t:
            rec = t.fetch(["long"], timeout_s=120)["long"]
            assert t.bad_replies == 0
        assert (rec.complete, rec.missing, rec.prompt_routed_experts.shape) == (True, [], (n, Lb, Kb))
        assert np.array_equal(rec.prompt_routed_experts, rows)
    finally:
        assert c.stop() == 0
        assert broker.stop() == 0
