"""Bounds on real processes: a multipart message is refused by its total size (each frame under the per-frame cap),
counted, and the process goes on; a refused CURVE handshake is counted and logged once per peer at WARNING, and the
refused trainer says so too."""

import logging
import re
import subprocess
import sys

import pytest
import zmq

from routing_replay.consumer import TrainerClient
from routing_replay.protocol import wire
from routing_replay.protocol.loop import MessageTooLarge, recv_frames
from tests.procs import start_broker, start_consumer, stop_all

CLI = [sys.executable, "-m", "routing_replay.apps.cli"]


def _many_frames(sock, total_frames: int, frame_bytes: int, head: bytes | None = None) -> None:
    """One multipart message: frames each under the receiver's per-frame cap, together far over its total bound."""
    body = b"\0" * frame_bytes
    frames = ([head] if head is not None else []) + [body] * total_frames
    sock.send_multipart(frames, copy=False)


def test_recv_frames_refuses_by_total_size_and_stays_on_message_boundaries():
    ctx = zmq.Context.instance()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    for s in (a, b):
        s.setsockopt(zmq.LINGER, 0)
    a.bind("inproc://i67b-bounds")
    b.connect("inproc://i67b-bounds")
    try:
        _many_frames(a, 5, 1000, b"first")
        a.send_multipart([b"next", b"x" * 10])
        assert b.poll(5000)
        with pytest.raises(MessageTooLarge) as e:
            recv_frames(b, 0, 3000)
        assert (e.value.total, e.value.frames, e.value.first) == (5005, 6, b"first")
        assert [f.bytes for f in recv_frames(b, 0, 3000)] == [b"next", b"x" * 10]     # the next one is whole
        a.send(b"y" * 3001)
        with pytest.raises(MessageTooLarge):                                          # one frame over it, too
            recv_frames(b, 0, 3000)
    finally:
        a.close(0)
        b.close(0)


def test_a_message_of_many_small_frames_is_refused_by_its_total_by_consumer_and_broker(tmp_path):
    """Each frame is 1 MiB, under the trainer endpoint's and broker backend's per-frame cap (4 MiB); the message is
    6 MiB, over their whole-message bound (wire.MAX_CONTROL_MESSAGE_BYTES). Before, the consumer took it whole and
    refused it for its frame count, the broker for whatever its first frame said."""
    assert 1 << 20 < wire.MAX_CONTROL_MESSAGE_BYTES < 6 << 20
    broker, fe, be = start_broker()
    c = start_consumer(be, "--serve", f"ipc://{tmp_path}/serve")
    ctx = zmq.Context.instance()
    t, rogue = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    try:
        for s, ep in ((t, f"ipc://{tmp_path}/serve"), (rogue, be)):
            s.setsockopt(zmq.LINGER, 0)
            s.connect(ep)
            _many_frames(s, 6, 1 << 20, wire.pack_header("heartbeat", "rogue", 0, 1, "rogue", {}))
        c.wait_for(r"dropped a bad message \(message_too_large, 1 so far\): message of 8 frames and 629\d+ bytes "
                   r"exceeds 4198400 bytes", 20)
        broker.wait_for(r"broker dropped a bad message from .*\(message_too_large, 1 so far\): message of 8 frames",
                        20)
        # both still serve: a trainer gets its answer, and a well-formed message to the broker is taken
        with TrainerClient(f"ipc://{tmp_path}/serve") as tc:
            with pytest.raises(TimeoutError):
                tc.fetch(["x"], timeout_s=0.3)
        assert c.alive() and broker.alive()
    finally:
        t.close(0)
        rogue.close(0)
        stop_all(c, broker)


@pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CURVE")
def test_a_refused_curve_handshake_is_counted_and_logged_once_per_peer(tmp_path, caplog):
    for name in ("broker", "consumer", "trainer", "outsider"):
        out = subprocess.run(CLI + ["keys", str(tmp_path), "--name", name], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
    (tmp_path / "allow").mkdir()
    (tmp_path / "allow" / "trainer.key").write_bytes((tmp_path / "trainer.key").read_bytes())
    (tmp_path / "broker-allow").mkdir()
    (tmp_path / "broker-allow" / "consumer.key").write_bytes((tmp_path / "consumer.key").read_bytes())
    broker, fe, be = start_broker("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", "--curve-secret",
                                  str(tmp_path / "broker.key_secret"), "--curve-allow", str(tmp_path / "broker-allow"))
    c = start_consumer(be, "--serve", "tcp://127.0.0.1:*", "--curve-secret", str(tmp_path / "consumer.key_secret"),
                       "--broker-key", str(tmp_path / "broker.key"), "--curve-allow", str(tmp_path / "allow"))
    serve = c.wait_for(r"serve=(\S+)").group(1)
    outsider_pub = (tmp_path / "outsider.key").read_text()
    outsider_z85 = re.search(r'public-key = "(.+)"', outsider_pub).group(1)
    try:
        with caplog.at_level(logging.WARNING, logger="routing_replay.consumer.client"):
            for _ in range(2):            # two trainers with the same refused key: one warning, both counted
                with TrainerClient(serve, curve_secret=str(tmp_path / "outsider.key_secret"),
                                   server_key=str(tmp_path / "consumer.key")) as t, pytest.raises(TimeoutError):
                    t.fetch(["x"], timeout_s=1.0)
                assert t.handshake_failures >= 1
        refused = [r.getMessage() for r in caplog.records if "refused the handshake" in r.getMessage()]
        assert len(refused) == 2 and all(serve in m for m in refused)
        m = c.wait_for(r"curve_refused=([2-9]|\d\d+)\b", 20)
        assert m
        lines = [ln for ln in c.lines if "curve handshake refused" in ln]
        assert len(lines) == 1 and "WARNING" in lines[0]
        assert f"peer address=127.0.0.1 public_key={outsider_z85}" in lines[0]
        # the allowed trainer still gets in
        with TrainerClient(serve, curve_secret=str(tmp_path / "trainer.key_secret"),
                           server_key=str(tmp_path / "consumer.key")) as t, pytest.raises(TimeoutError):
            t.fetch(["x"], timeout_s=1.0)
        assert t.handshake_failures == 0
    finally:
        stop_all(c, broker)


def test_a_producer_never_coalesces_beyond_the_brokers_message_bound():
    from routing_replay.producer import Producer
    with pytest.raises(ValueError, match="coalesce_max_bytes=2147483648 outside"):
        Producer("ipc:///nonexistent-i67b", num_layers=4, top_k=2, coalesce_max_bytes=2 << 30)
    assert wire.MAX_PAYLOAD_FRAME_BYTES + wire.MAX_HEADER_BYTES <= wire.MAX_DATA_MESSAGE_BYTES


@pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CURVE")
def test_a_handshake_that_fails_before_the_allow_list_is_counted_and_logged_once(tmp_path):
    """A client pinned to another server key fails the handshake before the allow-list is asked: the server counts
    it and says so once at WARNING (libzmq's monitor names the bound endpoint, not the peer)."""
    for name in ("broker", "consumer", "trainer"):
        out = subprocess.run(CLI + ["keys", str(tmp_path), "--name", name], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
    (tmp_path / "allow").mkdir()
    (tmp_path / "allow" / "trainer.key").write_bytes((tmp_path / "trainer.key").read_bytes())
    broker, fe, be = start_broker("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", "--curve-secret",
                                  str(tmp_path / "broker.key_secret"), "--curve-allow", str(tmp_path / "allow"))
    c = start_consumer(be, "--serve", "tcp://127.0.0.1:*", "--curve-secret", str(tmp_path / "consumer.key_secret"),
                       "--broker-key", str(tmp_path / "broker.key"), "--curve-allow", str(tmp_path / "allow"))
    serve = c.wait_for(r"serve=(\S+)").group(1)
    try:
        # pinned to the broker's key instead of the consumer's: the consumer cannot decrypt its hello
        with TrainerClient(serve, curve_secret=str(tmp_path / "trainer.key_secret"),
                           server_key=str(tmp_path / "broker.key")) as t, pytest.raises(TimeoutError):
            t.fetch(["x"], timeout_s=1.0)
        assert t.handshake_failures >= 1
        c.wait_for(r"curve_refused=[1-9]", 20)
        lines = [ln for ln in c.lines if "curve handshake failed on trainer endpoint" in ln]
        assert len(lines) == 1 and "WARNING" in lines[0] and "HANDSHAKE_FAILED_PROTOCOL" in lines[0]
        # the broker's frontend the same way: a producer pinned to the consumer's key
        from routing_replay.producer import Producer
        p = Producer(fe, num_layers=4, top_k=2, linger_ms=0, curve_secret=str(tmp_path / "trainer.key_secret"),
                     server_key=str(tmp_path / "consumer.key"))
        try:
            broker.wait_for(r"curve handshake failed on frontend .*handshake_failed=1\b", 20)
            broker.wait_for(r"curve_refused=[1-9]", 20)
        finally:
            p.close(0.2)
    finally:
        stop_all(c, broker)
