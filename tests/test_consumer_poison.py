"""A data message the consumer cannot read takes its link number: no gap, no resync, the record it names is flagged."""

import time

import numpy as np
import zmq

from routing_replay.consumer import Consumer
from routing_replay.protocol import wire
from routing_replay.apps.synthetic import true_rows
from tests.procs import wait_until

L, K, E = 3, 2, 16


def _data(kind, key, seq, body, link):
    return wire.pack_header(kind, "p", 7, seq, key, body, link)


def _open(P):
    return {"prompt_len": P, "num_cached": 0, "num_layers": L, "top_k": K}


def test_undecodable_link_message_is_taken_and_flags_only_the_request_it_names(tmp_path):
    ctx = zmq.Context.instance()
    fake = ctx.socket(zmq.ROUTER)
    fake.setsockopt(zmq.LINGER, 0)
    ep = f"ipc://{tmp_path}/b"
    fake.bind(ep)
    got = {}
    c = Consumer(ep, consumer_id="cp", heartbeat_interval_ms=100, ack_interval_ms=10, finish_grace_s=0,
                 on_record=lambda r: got.__setitem__(r.request_id, r), context=ctx).start()
    acks = []

    def recv(kind, deadline_s=5.0):
        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline:
            if fake.poll(100):
                _, head = fake.recv_multipart()
                h = wire.decode_header(head)
                if h.kind == "ack":
                    acks.append(h.body)
                if h.kind == kind:
                    return h
        raise AssertionError(f"no {kind} from the consumer")

    def send(head, *payload):
        fake.send_multipart([b"cp", head, *payload])

    try:
        recv("hello")
        rows_a = true_rows(1, np.arange(4), L, K, E)
        rows_b = true_rows(2, np.arange(3), L, K, E)
        rows_c = true_rows(3, np.arange(2), L, K, E)
        link = [0]

        def nxt():
            link[0] += 1
            return (99, 1, link[0])

        # request A, good
        send(_data("open", "A", 1, _open(3), nxt()))
        send(_data("delta", ["A"], 2, wire.delta_body([0], [3], L, K), nxt()), rows_a[:3].tobytes())
        send(_data("finish", "A", 3, {"num_output": 1, "reason": "stop"}, nxt()))
        # C is open and has a row when a message for it arrives that cannot be decoded (protocol version 9)
        send(_data("open", "C", 4, _open(2), nxt()))
        send(_data("delta", ["C"], 5, wire.delta_body([0], [1], L, K), nxt()), rows_c[:1].tobytes())
        bad = wire.with_link(wire.pack_header("delta", "p", 7, 6, ["C"], wire.delta_body([1], [1], L, K)), nxt())
        bad = b"\x98\x09" + bad[2:]                       # version 1 -> 9: decode_header refuses the whole header
        assert wire.peek_envelope(bad).link == (99, 1, 6)
        send(bad, rows_c[1:].tobytes())
        # an open whose request id is beyond the byte limit: refused, its link number still taken
        send(wire.with_link(wire.pack_header("open", "p", 7, 7, "x" * (wire.MAX_REQUEST_ID_BYTES + 1), _open(2)),
                            nxt()))
        # request B, good, after the two bad ones
        send(_data("open", "B", 8, _open(2), nxt()))
        send(_data("delta", ["B"], 9, wire.delta_body([0], [3], L, K), nxt()), rows_b.tobytes())
        send(_data("finish", "B", 10, {"num_output": 2, "reason": "length"}, nxt()))
        send(_data("finish", "C", 11, {"num_output": 1, "reason": "stop"}, nxt()))
        assert link[0] == 11
        ack = recv("ack")
        while ack.body["link"] != [99, 1, 11]:
            ack = recv("ack")
        wait_until(lambda: {"A", "B", "C"} <= set(got), 5, "records A, B, C")
        assert all("gap" not in a for a in acks), acks
        assert c.link.dropped == 0 and c.skipped_undecodable == 2
        assert dict(c.bad) == {"bad_version": 1, "undecodable": 1}

        a, b, cc = got["A"], got["B"], got["C"]
        assert (a.complete, a.missing, a.reason) == (True, [], "")
        assert np.array_equal(a.prompt_routed_experts, rows_a[:3])
        assert np.array_equal(a.routed_experts, np.full((1, L, K), -1, np.int16))
        assert (b.complete, b.missing, b.reason, b.finish_reason) == (True, [], "", "length")
        assert np.array_equal(b.prompt_routed_experts, rows_b[:2])
        assert np.array_equal(b.routed_experts, np.concatenate([rows_b[2:], np.full((1, L, K), -1, np.int16)]))
        # C: the row the unreadable message carried is missing, and the record says why
        assert (cc.complete, cc.missing, cc.reason) == (False, [(1, 2)], "undecodable")
        assert np.array_equal(cc.prompt_routed_experts[:1], rows_c[:1])
        assert (cc.prompt_routed_experts[1:] == -1).all()
    finally:
        c.close()
        fake.close(0)


def test_unreadable_body_of_a_decoded_message_flags_its_request():
    """The header decodes but the body does not parse: the link number was already taken; the request is flagged."""
    from routing_replay.consumer.accumulator import Accumulator
    acc = Accumulator(finish_grace_s=0)
    acc.apply(wire.decode_header(_data("open", "D", 1, _open(2), None)), [], 0.0)
    assert acc.mark_damaged("D", "undecodable") and not acc.mark_damaged("never-opened", "undecodable")
    assert "never-opened" not in acc.requests
    acc.apply(wire.decode_header(_data("delta", ["D"], 2, wire.delta_body([0], [2], L, K), None)),
              [true_rows(4, np.arange(2), L, K, E).tobytes()], 0.0)
    (r,) = acc.apply(wire.decode_header(_data("finish", "D", 3, {"num_output": 1, "reason": "stop"}, None)), [], 0.0)
    assert (r.complete, r.missing, r.reason) == (False, [], "undecodable")
