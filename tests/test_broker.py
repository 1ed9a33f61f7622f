"""The broker's routing on real sockets (inproc): ownership, and every way of splitting a step's payload."""

import time

import numpy as np
import pytest
import zmq

from routing_replay.broker import Broker
from routing_replay.broker.ownership import rendezvous as _hrw
from routing_replay.protocol import wire


def broker_net(front: str, back: str, hellos: dict, **broker_kw):
    """A broker on inproc `front`/`back` (started; `broker_kw`: more Broker arguments), a consumer DEALER per
    {consumer id: hello body}, a producer DEALER that said hello as "p" epoch 3. Yields (broker, producer socket,
    {consumer id: socket}, dealer()), then closes everything."""
    ctx = zmq.Context()
    b = Broker(front, back, context=ctx, heartbeat_interval_ms=100_000, **broker_kw).start()
    socks = []

    def dealer(ep, ident=None):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        if ident:
            s.setsockopt(zmq.ROUTING_ID, ident)
        s.connect(ep)
        socks.append(s)
        return s

    consumers = {}
    for cid, body in hellos.items():
        s = dealer(back, cid)
        s.send(wire.pack_header("hello", cid.decode(), 0, 0, cid.decode(), body))
        consumers[cid] = s
    prod = dealer(front)
    prod.send(wire.pack_header("hello", "p", 3, 0, "p", {}))     # a producer announces its epoch first
    deadline = time.monotonic() + 2     # (slept, not polled: a consumer may have a message waiting already)
    while (len(b.ownership.live_ids) < len(hellos) or "p" not in b.producers) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(b.ownership.live_ids) == len(hellos)
    try:
        yield b, prod, consumers, dealer
    finally:
        for s in socks:
            s.close(0)
        b.close()
        ctx.term()


@pytest.fixture
def net():
    for b, prod, consumers, _ in broker_net("inproc://f", "inproc://b", {b"c1": {}, b"c2": {}}):
        yield b, prod, consumers


def recv(sock):
    assert sock.poll(5000), "nothing received"
    frames = sock.recv_multipart()
    return wire.decode_header(frames[0]), frames[1:]


def _settled(read, want, timeout_s=5.0):
    """read() once it equals `want` (a counter the broker's thread updates after sends the consumers already
    received), else its value at the deadline."""
    deadline = time.monotonic() + timeout_s
    while read() != want and time.monotonic() < deadline:
        time.sleep(0.005)
    return read()


def ids_for(owner: bytes, n: int, prefix: str) -> list[str]:
    out, i = [], 0
    while len(out) < n:
        rid = f"{prefix}{i}"
        if _hrw(rid.encode(), [b"c1", b"c2"]) == owner:
            out.append(rid)
        i += 1
    return out


@pytest.mark.parametrize("layout,rows_per_req,L", [
    ("interleaved-small", 1, 4),        # decode-like: many short runs -> one gathered frame per owner
    ("interleaved-large", 64, 512),     # runs >= 64 KiB -> zero-copy slices, one frame per run
    ("uneven", None, 4),                # different row counts -> joined frame
    ("blocks", 3, 4),                   # each owner's requests contiguous -> one zero-copy slice
])
def test_split_delivers_exact_rows_to_each_owner(net, layout, rows_per_req, L):
    b, prod, consumers = net
    K = 8
    a_ids, b_ids = ids_for(b"c1", 4, "a"), ids_for(b"c2", 4, "b")
    order = a_ids + b_ids if layout == "blocks" else [x for pair in zip(a_ids, b_ids) for x in pair]
    counts = [rows_per_req or (i % 3) + 1 for i in range(len(order))]
    starts = [10 * i for i in range(len(order))]
    rng = np.random.default_rng(1)
    rows = {rid: rng.integers(-1, 128, (c, L, K)).astype(np.int16) for rid, c in zip(order, counts)}
    payload = np.concatenate([rows[r] for r in order])
    prod.send_multipart([wire.pack_header("delta", "p", 3, 1, order, wire.delta_body(starts, counts, L, K)),
                         payload.tobytes()])
    for cid, mine in ((b"c1", a_ids), (b"c2", b_ids)):
        h, frames = recv(consumers[cid])
        d = wire.parse_delta(h)
        assert h.producer == "p"
        assert d.request_ids == [r for r in order if r in mine]
        assert d.starts.tolist() == [s for r, s in zip(order, starts) if r in mine]
        wire.check_payload(d, frames)
        got = np.frombuffer(b"".join(frames), np.int16).reshape(-1, L, K)
        assert np.array_equal(got, np.concatenate([rows[r] for r in d.request_ids]))
        if layout == "interleaved-large":
            assert len(frames) == 4               # four separate runs, each forwarded as its own slice
        else:
            assert len(frames) == 1
    assert b.stats.deltas_split == 1
    # every row went out once, to its owner: the bytes out are the bytes in (counted after the send, on the
    # broker's thread)
    want = sum(c * L * K * 2 for c in counts)
    assert _settled(lambda: b.stats.bytes_out, want) == payload.nbytes == want
    assert b.stats.bytes_in == payload.nbytes


def test_single_owner_step_is_forwarded_untouched(net):
    b, prod, consumers = net
    ids = ids_for(b"c2", 3, "x")
    head = wire.pack_header("delta", "p", 3, 1, ids, wire.delta_body([0, 0, 0], [2, 2, 2], 4, 2))
    payload = np.arange(6 * 8, dtype=np.int16).tobytes()
    prod.send_multipart([head, payload])
    h, frames = recv(consumers[b"c2"])
    assert (h.key, h.body["start"], h.body["count"]) == (ids, wire.delta_body([0, 0, 0], [2, 2, 2], 4, 2)["start"],
                                                          wire.delta_body([0, 0, 0], [2, 2, 2], 4, 2)["count"])
    assert frames == [payload]
    assert not consumers[b"c1"].poll(100)
    assert b.stats.deltas_split == 0
    assert _settled(lambda: b.stats.bytes_out, 96) == len(payload) == 6 * 4 * 2 * 2
    prod.send_multipart([wire.pack_header("delta", "p", 3, 2, ids[:1], wire.delta_body([2], [1], 4, 2)),
                         payload[:16]])
    recv(consumers[b"c2"])
    assert _settled(lambda: b.stats.bytes_out, 96 + 16) == 96 + 16


def test_ownership_is_sticky_when_a_consumer_joins(net):
    b, prod, consumers = net
    rid = ids_for(b"c1", 1, "s")[0]
    prod.send(wire.pack_header("open", "p", 3, 1, rid, {"prompt_len": 2, "num_cached": 0, "num_layers": 4,
                                                        "top_k": 2}))
    recv(consumers[b"c1"])
    ctx = b._ctx
    c3 = ctx.socket(zmq.DEALER)
    c3.setsockopt(zmq.ROUTING_ID, b"c3")
    c3.setsockopt(zmq.LINGER, 0)
    c3.connect("inproc://b")
    try:
        c3.send(wire.pack_header("hello", "c3", 0, 0, "c3", {}))
        for _ in range(200):
            if len(b.ownership.live_ids) == 3:
                break
            c3.poll(10)
        assert len(b.ownership.live_ids) == 3
        prod.send_multipart([wire.pack_header("delta", "p", 3, 2, [rid], wire.delta_body([0], [1], 4, 2)),
                             bytes(16)])
        h, _ = recv(consumers[b"c1"])              # still c1, whatever the hash over three says
        assert h.key == [rid]
        assert not c3.poll(100)
    finally:
        c3.close(0)


def test_zero_copy_release_thread_starts_with_the_service_not_inside_the_first_send():
    """pyzmq's zero-copy release thread (started inside the first zero-copy send otherwise: milliseconds on the
    first step's message) is running once a broker serves, in a fresh process."""
    import subprocess
    import sys
    code = ("import threading, time\n"
            "from zmq.utils.garbage import gc\n"
            "from routing_replay.broker import Broker\n"
            "assert not gc.is_alive()\n"
            "b = Broker('tcp://127.0.0.1:0', 'tcp://127.0.0.1:0')\n"
            "b.bind()\n"
            "t = threading.Thread(target=b.serve, daemon=True); t.start()\n"
            "deadline = time.monotonic() + 10\n"
            "while not gc.is_alive() and time.monotonic() < deadline:\n"
            "    time.sleep(0.01)\n"
            "print('alive' if gc.is_alive() else 'not started')\n"
            "b.stop(); t.join(10)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["alive"]


def _ack(prod) -> tuple[int, bool]:
    """The next ack the producer socket gets (heartbeat replies skipped): (upto, rewind)."""
    while True:
        h, _ = recv(prod)
        if h.kind == "ack":
            return h.body["upto"], bool(h.body.get("rewind"))


def test_a_consumer_that_restarts_before_acking_a_finish_gets_the_open_again(net):
    """The consumer applied and acked a request's open, got its finish and restarted (same id, new epoch) before
    acking it: the producer's resend of the finish reaches the new incarnation after the open, marked reassigned,
    never alone (a finish with no open would end the record as `no_open`)."""
    b, prod, consumers = net
    rid = ids_for(b"c2", 1, "f")[0]
    open_body = {"prompt_len": 2, "num_cached": 0, "num_layers": 4, "top_k": 2}
    prod.send(wire.pack_header("open", "p", 3, 1, rid, open_body))
    h, _ = recv(consumers[b"c2"])
    assert (h.kind, h.key) == ("open", rid)
    consumers[b"c2"].send(wire.pack_header("ack", "c2", 0, 0, "", wire.link_ack_body(
        wire.LinkAck(h.link[0], h.link[1], h.link[2]))))
    assert _ack(prod) == (1, False)
    finish = wire.pack_header("finish", "p", 3, 2, rid, {"num_output": 0})
    prod.send(finish)
    h, _ = recv(consumers[b"c2"])
    assert (h.kind, h.key) == ("finish", rid)
    assert b.ownership.closing == 1 and len(b.ownership) == 0
    consumers[b"c2"].close(0)                            # dies with the finish unacked
    c2b = b._ctx.socket(zmq.DEALER)
    c2b.setsockopt(zmq.ROUTING_ID, b"c2")
    c2b.setsockopt(zmq.LINGER, 0)
    c2b.connect("inproc://b")
    try:
        c2b.send(wire.pack_header("hello", "c2", 1, 0, "c2", {}))
        assert _ack(prod) == (1, True)                   # the broker asks the producer to resend from seq 2
        prod.send(finish)
        h1, _ = recv(c2b)
        h2, _ = recv(c2b)
        assert (h1.kind, h1.key, h1.body) == ("open", rid, dict(open_body, reassigned=True))
        assert (h2.kind, h2.key) == ("finish", rid)
        assert h2.link[2] == h1.link[2] + 1
        c2b.send(wire.pack_header("ack", "c2", 1, 0, "", wire.link_ack_body(
            wire.LinkAck(h2.link[0], h2.link[1], h2.link[2]))))
        assert _ack(prod) == (2, False)
        assert b.ownership.closing == 0 and len(b.ownership) == 0 and b.stats.reassigned == 1
    finally:
        c2b.close(0)


def test_deltas_held_for_a_consumer_are_counted_once():
    """Deltas that arrive before any consumer is live wait in the broker and are routed when one says hello: each
    one's bytes count once in bytes_in, and bytes_in equals bytes_out."""
    for b, prod, _, dealer in broker_net("inproc://fh", "inproc://bh", {}):
        L, K = 4, 8
        sent = []
        for step in range(3):
            ids = [f"h{step}-{i}" for i in range(2)]
            rows = np.full((2 * (step + 1), L, K), step, dtype=np.int16)
            prod.send_multipart([wire.pack_header("delta", "p", 3, step + 1, ids,
                                                  wire.delta_body([0, 0], [step + 1, step + 1], L, K)),
                                 rows.tobytes()])
            sent.append(rows.nbytes)
        assert _settled(lambda: len(b._pending), 3) == 3
        assert b.stats.bytes_in == 0
        c = dealer("inproc://bh", b"c1")
        c.send(wire.pack_header("hello", "c1", 0, 0, "c1", {}))
        got = 0
        for _ in range(3):
            h, frames = recv(c)
            assert h.kind == "delta"
            got += sum(len(f) for f in frames)
        assert got == sum(sent)
        assert _settled(lambda: b.stats.bytes_out, sum(sent)) == sum(sent)
        assert b.stats.bytes_in == sum(sent)


def test_healthy_is_true_while_the_loop_runs_and_false_with_the_failure_kept_when_it_cannot_bind():
    ctx = zmq.Context()
    try:
        b = Broker("inproc://h-front", "inproc://h-back", context=ctx, heartbeat_interval_ms=100_000)
        assert not b.healthy and b.failure is None                         # not started
        b.start()
        assert b.healthy and b.failure is None
        twin = Broker("inproc://h-front", "inproc://h-back2", context=ctx, heartbeat_interval_ms=100_000)
        with pytest.raises(RuntimeError, match="failed to start") as raised:
            twin.start()                                                   # the front address is taken
        assert isinstance(twin.failure, zmq.ZMQError) and raised.value.__cause__ is twin.failure
        assert not twin.healthy and b.healthy                              # the first broker is untouched
        b.close()
        assert not b.healthy and b.failure is None                         # stopped, not failed
    finally:
        ctx.term()
