"""No poison message: a producer's data message that can never be valid is accepted and dropped by the broker (its
seq acked past, the producer told which seq and why), and the stream behind it flows on, bit-exact.

A real Broker and a real Consumer (threads, ipc), and a raw DEALER in the test playing the producer with
hand-built frames: good request A, the poison message, good request B.
"""

import time

import numpy as np
import pytest
import zmq

from routing_replay.broker import Broker
from routing_replay.consumer import Consumer
from routing_replay.protocol import wire
from tests.procs import wait_until

L, K = 4, 2
PID, EPOCH = "p-poison", 77
P, G = 3, 4                        # prompt tokens and output tokens of each good request


def _open(rid, seq):
    return [wire.pack_header("open", PID, EPOCH, seq, rid, {"prompt_len": P, "num_cached": 0, "num_layers": L,
                                                            "top_k": K})]


def _delta(ids, seq, starts, counts, payload: bytes):
    return [wire.pack_header("delta", PID, EPOCH, seq, ids, wire.delta_body(starts, counts, L, K)), payload]


def _finish(rid, seq):
    return [wire.pack_header("finish", PID, EPOCH, seq, rid, {"num_output": G, "reason": "stop", "prompt_len": P,
                                                              "num_cached": 0})]


def _request(rid, seq, rows):
    """open, one delta with every computed row (positions 0 .. P+G-2), finish: seqs seq, seq+1, seq+2."""
    return [_open(rid, seq), _delta([rid], seq + 1, [0], [len(rows)], rows.tobytes()), _finish(rid, seq + 2)]


def _bad_key_open(seq):
    rid = "€" * 400                # 400 characters, 1,200 UTF-8 bytes: the header does not decode
    assert len(rid) <= wire.MAX_REQUEST_ID_BYTES < len(rid.encode())
    return _open(rid, seq), "undecodable"


def _short_delta(seq):
    rows = np.zeros((2, L, K), np.int16)
    return _delta(["x-short"], seq, [0], [3], rows.tobytes()), "size_mismatch"   # header says 3 rows, payload 2


@pytest.fixture
def pipeline(tmp_path):
    ctx = zmq.Context()
    got = {}
    b = Broker(f"ipc://{tmp_path}/f", f"ipc://{tmp_path}/b", context=ctx, heartbeat_interval_ms=5000,
               ack_interval_ms=5, stats_interval_s=60).start()
    c = Consumer(b.backend, context=ctx, finish_grace_s=0.1, stats_interval_s=60,
                 on_record=lambda r: got.__setitem__(r.request_id, r)).start()
    prod = ctx.socket(zmq.DEALER)
    prod.setsockopt(zmq.LINGER, 0)
    prod.connect(b.frontend)
    try:
        wait_until(lambda: len(b.ownership.live_ids) == 1, 10, "consumer joined")
        yield b, c, prod, got
    finally:
        prod.close(0)
        c.close()
        b.close()
        ctx.term()


def _recv(sock, deadline_s=10.0):
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if sock.poll(100):
            return wire.decode_header(sock.recv_multipart()[0])
    raise AssertionError("no reply from the broker")


@pytest.mark.parametrize("poison", [_bad_key_open, _short_delta], ids=["open-400-euro-id", "delta-short-payload"])
def test_a_message_that_can_never_be_valid_is_acked_past_and_named(pipeline, poison):
    b, c, prod, got = pipeline
    prod.send(wire.pack_header("hello", PID, EPOCH, 0, PID, {"unacked_from": 1}))
    h = _recv(prod)
    assert (h.kind, h.body) == ("heartbeat", {"consumers": 1, "takes": ["opens", "finishes"]})
    rng = np.random.default_rng(3)
    rows = {rid: rng.integers(-1, 16, (P + G - 1, L, K)).astype(np.int16) for rid in ("A", "B")}
    bad_frames, reason = poison(4)
    msgs = [*_request("A", 1, rows["A"]), bad_frames, *_request("B", 5, rows["B"])]
    for frames in msgs:
        prod.send_multipart(frames)
    last = len(msgs)                                   # seq 7
    errors, acks = [], []
    while not acks or acks[-1].body["upto"] < last:
        h = _recv(prod)
        assert h.epoch == b.epoch
        (errors if h.kind == "error" else acks).append(h)
        assert h.kind in ("error", "ack"), h
    assert len(errors) == 1
    body = errors[0].body
    assert set(body) == {"reason", "refused_seq", "epoch"}
    assert (body["refused_seq"], body["epoch"]) == (4, EPOCH)
    assert body["reason"].startswith(f"{reason}: ") and len(body["reason"]) <= 300
    assert wire.parse_refusal(errors[0]) == wire.Refusal(body["reason"], 4, EPOCH)
    assert all(not a.body.get("rewind") for a in acks), [a.body for a in acks]
    assert acks[-1].body == {"epoch": EPOCH, "upto": last}
    wait_until(lambda: "A" in got and "B" in got, 10, "records A and B")
    for rid in ("A", "B"):
        r = got[rid]
        assert (r.complete, r.missing, r.reason) == (True, [], ""), (rid, r.missing, r.reason)
        np.testing.assert_array_equal(r.prompt_routed_experts, rows[rid][:P])
        np.testing.assert_array_equal(r.routed_experts[:G - 1], rows[rid][P:])
        assert (r.routed_experts[G - 1] == -1).all()
    assert sorted(got) == ["A", "B"]
    s = b.stats
    assert (s.dropped_bad, s.refused_gap, s.rewinds_asked, s.refused_unknown, s.resent_in) == (1, 0, 0, 0, 0)
    assert b.bad[reason] == 1 and sum(b.bad.values()) == 1
    assert s.requests_opened == 2 and s.requests_closed == 2
    assert sum(c.bad.values()) == 0


def test_a_resent_poison_message_is_dropped_again_and_the_stream_goes_on(pipeline):
    """The producer goes back (a rewind of its own) and resends the poison message with what follows: the broker
    accepts the resend as the seq it expects, drops it again, names it again, and acks past all of it."""
    b, c, prod, got = pipeline
    prod.send(wire.pack_header("hello", PID, EPOCH, 0, PID, {"unacked_from": 1}))
    assert _recv(prod).kind == "heartbeat"
    bad_frames, reason = _bad_key_open(1)
    rows = np.arange((P + G - 1) * L * K, dtype=np.int16).reshape(P + G - 1, L, K)
    good = _request("C", 2, rows)
    for frames in (bad_frames, *good, bad_frames, *good):      # seqs 1..4, then 1..4 again
        prod.send_multipart(frames)
    errors, acks = [], []
    while len(errors) < 2 or not acks or acks[-1].body["upto"] < 4:
        h = _recv(prod)
        (errors if h.kind == "error" else acks).append(h)
    assert [(e.body["refused_seq"], e.body["epoch"]) for e in errors] == [(1, EPOCH), (1, EPOCH)]
    assert all(not a.body.get("rewind") for a in acks)
    wait_until(lambda: "C" in got, 10, "record C")
    r = got["C"]
    assert r.complete and r.missing == []
    np.testing.assert_array_equal(np.concatenate([r.prompt_routed_experts, r.routed_experts[:G - 1]]), rows)
    # only seq 1 is below the next expected when it comes again; 2..4 follow it as the next expected, one by one
    assert (b.stats.dropped_bad, b.stats.resent_in, b.stats.refused_gap) == (2, 1, 0)
    assert b.bad[reason] == 2


def test_an_unreadable_seq_is_refused_as_before(pipeline):
    """A header with no readable seq: nothing to answer for, so it is a bad message as before (counted, one error
    without refused_seq), and the next seq is still the one expected."""
    b, c, prod, got = pipeline
    prod.send(wire.pack_header("hello", PID, EPOCH, 0, PID, {"unacked_from": 1}))
    assert _recv(prod).kind == "heartbeat"
    prod.send(b"\xc1 not msgpack")
    h = _recv(prod)
    assert h.kind == "error" and set(h.body) == {"reason"} and h.body["reason"].startswith("undecodable: ")
    rows = np.full((P + G - 1, L, K), 5, np.int16)
    for frames in _request("D", 1, rows):
        prod.send_multipart(frames)
    h = _recv(prod)
    while h.body.get("upto", -1) < 3:
        assert h.kind == "ack" and not h.body.get("rewind"), h
        h = _recv(prod)
    wait_until(lambda: "D" in got, 10, "record D")
    assert got["D"].complete
    assert (b.stats.dropped_bad, b.bad["undecodable"]) == (0, 1)
