"""The hot loops' multipart send and receive (protocol.loop.send_frames / recv_frames) against pyzmq's own
send_multipart / recv_multipart on real sockets: the same frames arrive, bit for bit, both ways round, and the
same errors come back; bench/zmq_calls.py runs for real."""

from __future__ import annotations

import array
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import zmq

from routing_replay.protocol.loop import recv_frames, send_frames

BIG = np.arange(300 * 48 * 8, dtype=np.int16).reshape(300, 48, 8)      # 230 KB: sent zero-copy


@pytest.fixture
def pair():
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    a.bind("inproc://socket-io")
    b.connect("inproc://socket-io")
    yield a, b
    a.close(0)
    b.close(0)
    ctx.term()


MESSAGES = [
    [b"x"],
    [b"", b""],
    [b"h" * 80, BIG, b"", memoryview(b"abc")],
    [BIG[:3]],                                  # a small 3-D array (its len() is not its size in bytes)
    [zmq.Frame(b"frame"), np.zeros((0, 48, 8), np.int16)],
    [bytearray(b"ba"), array.array("i", [1, 2, 3])],   # other buffer types: through send_multipart
]


def _raw(f) -> bytes:
    if isinstance(f, zmq.Frame):
        return f.bytes
    if isinstance(f, np.ndarray):
        return f.tobytes()
    return bytes(memoryview(f).cast("B"))


@pytest.mark.parametrize("ours_send,ours_recv", [(True, True), (True, False), (False, True)])
def test_every_frame_arrives_as_sent_against_pyzmq_either_side(pair, ours_send, ours_recv):
    a, b = pair
    for msg in MESSAGES:
        if ours_send:
            send_frames(a, msg, zmq.NOBLOCK)
        else:
            a.send_multipart(msg, zmq.NOBLOCK, copy=False)
    for msg in MESSAGES:
        got = recv_frames(b, zmq.NOBLOCK) if ours_recv else b.recv_multipart(zmq.NOBLOCK, copy=False)
        assert [g.bytes for g in got] == [_raw(m) for m in msg]
        assert all(type(g) is zmq.Frame for g in got)
    with pytest.raises(zmq.Again):
        recv_frames(b, zmq.NOBLOCK)


def test_a_frame_that_cannot_be_sent_leaves_no_half_message(pair):
    a, b = pair
    with pytest.raises(TypeError):
        send_frames(a, [b"head", 12345], zmq.NOBLOCK)     # refused before the first frame goes
    send_frames(a, [b"next", b"one"], zmq.NOBLOCK)
    assert [f.bytes for f in recv_frames(b, zmq.NOBLOCK)] == [b"next", b"one"]
    with pytest.raises(zmq.Again):
        recv_frames(b, zmq.NOBLOCK)


def test_router_errors_come_back_as_from_send_multipart():
    ctx = zmq.Context()
    r = ctx.socket(zmq.ROUTER)
    r.setsockopt(zmq.ROUTER_MANDATORY, 1)
    r.setsockopt(zmq.SNDHWM, 1)
    r.bind("tcp://127.0.0.1:*")
    d = ctx.socket(zmq.DEALER)
    d.setsockopt(zmq.ROUTING_ID, b"d1")
    d.setsockopt(zmq.RCVHWM, 1)
    d.setsockopt(zmq.RCVTIMEO, 10_000)
    d.connect(r.getsockopt_string(zmq.LAST_ENDPOINT))
    try:
        with pytest.raises(zmq.ZMQError) as e:
            send_frames(r, [b"nobody", b"x"], zmq.NOBLOCK)
        assert e.value.errno == zmq.EHOSTUNREACH
        send_frames(d, [b"hello"], zmq.NOBLOCK)
        assert [f.bytes for f in recv_frames(r)] == [b"d1", b"hello"]
        sent = 0
        with pytest.raises(zmq.Again):                   # the peer's queue fills: EAGAIN, as send_multipart says
            for _ in range(1000):
                send_frames(r, [b"d1", b"m%d" % sent, BIG], zmq.NOBLOCK)
                sent += 1
        assert 1 <= sent < 1000
        got = [[f.bytes for f in recv_frames(d)] for _ in range(sent)]
        assert got == [[b"m%d" % i, BIG.tobytes()] for i in range(sent)]     # whole messages, in order
        with pytest.raises(zmq.Again):
            recv_frames(d, zmq.NOBLOCK)
    finally:
        r.close(0)
        d.close(0)
        ctx.term()


@pytest.mark.bench
def test_the_calls_bench_counts_every_message(tmp_path):
    script = Path(__file__).resolve().parents[1] / "bench" / "zmq_calls.py"
    out = tmp_path / "c.json"
    p = subprocess.run([sys.executable, str(script), "--messages", "300", "--frames", "1,3", "--repeat", "2",
                        "--json", str(out)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    got = json.loads(out.read_text())
    assert [(r["frames"], r["messages"]) for r in got] == [(1, 300), (3, 300)]
    assert all(r[k] > 0 for r in got for k in ("pyzmq_send_us", "ours_send_us", "pyzmq_recv_us", "ours_recv_us"))
    for args in (["--frames", "0"], ["--messages", "0"], ["--frames", "x"]):
        p = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=60)
        assert p.returncode == 2, (args, p.stderr)
