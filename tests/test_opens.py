"""`opens` and `finishes`: several requests' opens (finishes) in one message, producer -> broker -> consumer, and the
peers that do not take them.

The wire layout and its checks; the broker's split by owner on real sockets (an `opens` to a consumer that takes it,
`open`s to one that does not, the message as received when one owner has every entry, a new owner's `open` after a
consumer loss; each finish entry closing its request); the consumer applying entries one by one; losses found by the
producer's thread going into a `finishes` entry; and real processes end to end, records compared bit for bit with
the synthetic engine's reference, with a broker or a consumer that does not take them.
"""


import time

import msgpack
import numpy as np
import pytest
import zmq

from routing_replay.apps.synthetic import SyntheticEngine, expected_record, workload
from routing_replay.broker import Broker
from routing_replay.consumer import Consumer
from routing_replay.consumer.accumulator import Accumulator, EntriesRefused
from routing_replay.producer import Producer
from routing_replay.protocol import wire
from tests.procs import start_broker, start_consumer, wait_until
from tests.test_broker import _ack, broker_net, ids_for, recv

L, K, E = 4, 2, 16


# ---- wire ---------------------------------------------------------------------------------------------------------

def _opens(ids, P, C, tokens=None, filled=None, seq=1, layer_ids=None, frames=None):
    nt = None if tokens is None else [len(t) for t in tokens]
    head = wire.pack_header("opens", "p", 3, seq, ids, wire.opens_body(P, C, L, K, layer_ids, nt, filled))
    if frames is None:
        frames = [] if not nt or not sum(nt) else [np.concatenate([np.asarray(t, np.int32) for t in tokens]).tobytes()]
    return [head, *frames]


def test_an_opens_entry_reads_as_the_open_of_its_request():
    toks = [[5, 6, 7], [], [9]]
    head, *frames = _opens(["a", "b", "c"], [3, 10, 1], [0, 4, 1], toks, [False, True, False], layer_ids=[1, 3, 5, 7])
    o, tokens = wire.parse_opens(wire.decode_header(head), frames)
    assert [o.open_at(i) for i in range(3)] == [
        wire.Open("a", 3, 0, L, K, [1, 3, 5, 7], 3, False),
        wire.Open("b", 10, 4, L, K, [1, 3, 5, 7], 0, True),
        wire.Open("c", 1, 1, L, K, [1, 3, 5, 7], 1, False)]
    assert o.tokens_of(0, tokens).tolist() == [5, 6, 7] and o.tokens_of(1, tokens) is None
    assert o.tokens_of(2, tokens).tolist() == [9]
    # the same entry as an open: wire.open_body, read back by parse_open
    one = wire.decode_header(wire.pack_header("open", "p", 3, 1, "b", wire.open_body(o.open_at(1), True)))
    assert wire.parse_open(one) == o.open_at(1) and one.body["reassigned"] is True
    # a subset in another order (the broker's share for one owner)
    sub_head, *sub_frames = wire.subset_opens(wire.decode_header(head), o, tokens, [2, 0])
    s, st = wire.parse_opens(wire.decode_header(sub_head), sub_frames)
    assert s.request_ids == ["c", "a"] and st.tolist() == [9, 5, 6, 7]
    assert [s.open_at(i) for i in range(2)] == [o.open_at(2), o.open_at(0)]
    # no token ids at all: no frame, no n_prompt_tokens
    head, *frames = _opens(["x", "y"], [1, 2], [0, 0])
    o, tokens = wire.parse_opens(wire.decode_header(head), frames)
    assert frames == [] and tokens is None and o.open_at(1) == wire.Open("y", 2, 0, L, K, [0, 1, 2, 3], 0, False)


@pytest.mark.parametrize("case,reason", [
    ("repeated-id", "bad_field"),
    ("cached-over-prompt", "bad_field"),
    ("short-array", "bad_field"),
    ("token-frame-short", "size_mismatch"),
    ("token-frame-missing", "frame_count"),
    ("frame-without-tokens", "frame_count"),
    ("filled-not-0-1", "bad_field"),
    ("id-not-str", "bad_request_id"),
    ("no-entries", "bad_field"),
])
def test_a_malformed_opens_is_refused_with_a_reason(case, reason):
    ids, P, C, toks = ["a", "b"], [4, 4], [0, 2], [[1, 2], [3]]
    frames = None
    if case == "repeated-id":
        ids = ["a", "a"]
    elif case == "cached-over-prompt":
        C = [0, 5]
    elif case == "token-frame-short":
        frames = [np.array([1, 2], np.int32).tobytes()]
    elif case == "token-frame-missing":
        frames = []
    elif case == "frame-without-tokens":
        toks, frames = None, [b"\0\0\0\0"]
    head, *frames = _opens(ids, P, C, toks, frames=frames)
    h = wire.decode_header(head)
    if case == "short-array":
        h.body["prompt_len"] = h.body["prompt_len"][:4]
    elif case == "filled-not-0-1":
        h.body["prefix_filled"] = b"\x00\x02"
    elif case == "id-not-str":
        h.key = ["a", 7]
    elif case == "no-entries":
        h.key = []
        for k in ("prompt_len", "num_cached", "n_prompt_tokens"):
            h.body[k] = b""
        frames = []
    with pytest.raises(wire.ProtocolError) as e:
        wire.parse_opens(h, frames)
    assert e.value.reason == reason


# ---- broker, on real sockets --------------------------------------------------------------------------------------

@pytest.fixture
def net():
    """A broker, c1 that takes `opens` and `finishes`, c2 that does not (a consumer of an earlier version), a producer
    socket."""
    for b, prod, consumers, dealer in broker_net("inproc://of", "inproc://ob", {
            b"c1": {"takes": ["opens", "finishes"]}, b"c2": {}}):
        h, _ = recv(prod)
        assert h.kind == "heartbeat" and wire.parse_takes(h) == {"opens", "finishes"}     # the broker takes them
        yield b, prod, consumers, dealer


def _link_ack(sock, cid, h):
    sock.send(wire.pack_header("ack", cid, 0, 0, "", wire.link_ack_body(wire.LinkAck(*h.link))))


def test_the_broker_sends_each_owner_its_entries_as_opens_or_as_open_messages(net):
    b, prod, consumers, _ = net
    a_ids, b_ids = ids_for(b"c1", 3, "a"), ids_for(b"c2", 3, "b")
    ids = [x for pair in zip(a_ids, b_ids) for x in pair]
    P = [10 + i for i in range(6)]
    C = [0, 3, 0, 0, 5, 1]
    toks = [list(range(100 * i, 100 * i + i)) for i in range(6)]         # entry 0 has none
    filled = [False, False, False, True, False, False]
    prod.send_multipart(_opens(ids, P, C, toks, filled))
    want = {rid: (wire.Open(rid, P[i], C[i], L, K, [0, 1, 2, 3], len(toks[i]), filled[i]), toks[i])
            for i, rid in enumerate(ids)}
    h, frames = recv(consumers[b"c1"])                        # one opens with c1's three entries, in key order
    assert h.kind == "opens" and h.key == a_ids and h.seq == 1
    o, t = wire.parse_opens(h, frames)
    assert [(o.open_at(i), (o.tokens_of(i, t) if o.tokens_of(i, t) is not None else np.zeros(0)).tolist())
            for i in range(3)] == [want[r] for r in a_ids]
    for rid in b_ids:                                         # c2: one open per entry
        h, frames = recv(consumers[b"c2"])
        assert (h.kind, h.key, h.seq) == ("open", rid, 1)
        assert wire.parse_open(h) == want[rid][0] and "reassigned" not in h.body
        assert [np.frombuffer(f, np.int32).tolist() for f in frames] == ([want[rid][1]] if want[rid][1] else [])
    assert not consumers[b"c2"].poll(50)
    assert (b.stats.opens_in, b.stats.opens_unbatched, b.stats.requests_opened) == (1, 3, 6)
    assert {r: b.ownership.owner[r].cid for r in ids} == {**{r: b"c1" for r in a_ids}, **{r: b"c2" for r in b_ids}}
    # the producer's seq is acked once both owners acked their parts (c2: the last of its three opens)
    _link_ack(consumers[b"c1"], "c1", wire.decode_header(b"\x98" + wire.pack_header(
        "opens", "p", 3, 1, [], {})[1:] + wire._LINK_PACKER.pack([b.epoch, b.links[b"c1"].gen, 1])))
    _link_ack(consumers[b"c2"], "c2", h)
    assert _ack(prod) == (1, False)


def test_opens_all_for_one_owner_that_takes_them_goes_as_received(net):
    b, prod, consumers, _ = net
    ids = ids_for(b"c1", 4, "s")
    msg = _opens(ids, [3, 3, 3, 3], [0, 0, 1, 0], [[1], [2, 3], [], [4]])
    prod.send_multipart(msg)
    h, frames = recv(consumers[b"c1"])
    assert h.kind == "opens" and h.key == ids and frames == msg[1:]
    assert wire.pack_header(h.kind, h.producer, h.epoch, h.seq, h.key, h.body) == msg[0]
    assert b.stats.opens_unbatched == 0 and not consumers[b"c2"].poll(50)


def test_a_malformed_opens_is_refused_whole_and_the_stream_goes_on(net):
    b, prod, consumers, _ = net
    ids = ids_for(b"c1", 2, "m") + ids_for(b"c2", 2, "n")
    prod.send_multipart(_opens(ids, [4] * 4, [0, 0, 9, 0]))           # num_cached > prompt_len in one entry
    while True:
        h, _ = recv(prod)
        if h.kind == "error":
            break
    r = wire.parse_refusal(h)
    assert (r.seq, r.epoch) == (1, 3) and r.reason.startswith("bad_field")
    assert not consumers[b"c1"].poll(50) and not consumers[b"c2"].poll(10) and len(b.ownership) == 0
    prod.send_multipart(_opens(ids, [4] * 4, [0, 0, 1, 0], seq=2))    # the next seq is taken
    h, _ = recv(consumers[b"c1"])
    assert (h.kind, h.key, h.seq) == ("opens", ids[:2], 2)
    assert b.stats.dropped_bad == 1 and b.stats.opens_in == 1


def test_a_new_owner_gets_a_batch_opened_requests_entry_as_an_open_marked_reassigned(net):
    b, prod, consumers, dealer = net
    rid = ids_for(b"c1", 1, "r")[0]
    other = ids_for(b"c2", 1, "o")[0]
    prod.send_multipart(_opens([rid, other], [6, 2], [2, 0], [[7, 8, 9, 10, 11, 12], [1, 2]]))
    h, _ = recv(consumers[b"c1"])
    assert (h.kind, h.key) == ("opens", [rid])
    _link_ack(consumers[b"c1"], "c1", h)
    h, _ = recv(consumers[b"c2"])
    _link_ack(consumers[b"c2"], "c2", h)
    assert _ack(prod) == (1, False)                           # both applied: nothing to resend
    consumers[b"c1"].send(wire.pack_header("bye", "c1", 0, 0, "c1", {}))
    wait_until(lambda: len(b.ownership.live_ids) == 1, 5, "c1 lost")
    rows = np.arange(4 * L * K, dtype=np.int16).reshape(4, L, K)
    prod.send_multipart([wire.pack_header("delta", "p", 3, 2, [rid], wire.delta_body([2], [4], L, K)), rows.tobytes()])
    h1, f1 = recv(consumers[b"c2"])
    h2, f2 = recv(consumers[b"c2"])
    assert (h1.kind, h1.key) == ("open", rid)
    assert h1.body == {"prompt_len": 6, "num_cached": 2, "num_layers": L, "top_k": K, "layer_ids": [0, 1, 2, 3],
                       "n_prompt_tokens": 6, "reassigned": True}
    assert np.frombuffer(f1[0], np.int32).tolist() == [7, 8, 9, 10, 11, 12]
    assert (h2.kind, h2.key) == ("delta", [rid]) and f2[0] == rows.tobytes()
    assert b.stats.reassigned == 1


# ---- consumer -------------------------------------------------------------------------------------------------------

def test_the_consumer_applies_each_entry_and_refuses_only_the_one_over_its_limits():
    acc = Accumulator(finish_grace_s=0.0)
    acc.max_positions = 100
    toks = [[1, 2, 3], [4], [5, 6]]
    head, *frames = _opens(["a", "big", "c"], [3, 500, 2], [0, 0, 1], toks)
    with pytest.raises(EntriesRefused) as e:
        acc.apply(wire.decode_header(head), frames, 0.0)
    assert e.value.request_ids == ["big"] and e.value.reason == "too_large"
    assert set(acc.requests) == {"a", "c"} and acc.stats.opened == 2
    rows = np.arange(5 * L * K, dtype=np.int16).reshape(5, L, K)
    delta = wire.pack_header("delta", "p", 3, 2, ["a", "c"], wire.delta_body([0, 1], [3, 2], L, K))
    acc.apply(wire.decode_header(delta), [rows.tobytes()], 0.0)
    recs = []
    for i, (rid, g) in enumerate((("a", 1), ("c", 2))):          # (the last output token is never fed: -1)
        h = wire.decode_header(wire.pack_header("finish", "p", 3, 3 + i, rid, {"num_output": g}))
        recs += acc.apply(h, [], 1.0)
    got = {r.request_id: r for r in recs}
    assert set(got) == {"a", "c"}
    assert got["a"].complete and got["a"].prompt_routed_experts.tolist() == rows[:3].tolist()
    assert got["a"].prompt_token_ids.tolist() == [1, 2, 3]
    assert got["c"].complete and got["c"].prompt_routed_experts[1:].tolist() == rows[3:4].tolist()
    assert (got["c"].prompt_routed_experts[0] == -1).all() and got["c"].prompt_token_ids.tolist() == [5, 6]
    assert got["c"].routed_experts[:1].tolist() == rows[4:5].tolist() and (got["c"].routed_experts[1] == -1).all()
    assert got["a"].routed_experts.shape == (1, L, K) and (got["a"].routed_experts == -1).all()


# ---- end to end ---------------------------------------------------------------------------------------------------

def _synth(endpoint, specs, open_many, context=None):
    """The synthetic engine's requests through a real Producer: a step's new requests in one open_many (the vLLM
    plugin's call) or open() each; returns the producer's stats."""
    eng = SyntheticEngine(num_layers=L, top_k=K, num_experts=E, open_many=open_many)
    with Producer(endpoint, num_layers=L, top_k=K, context=context) as p:
        p.open("warm-up", prompt_len=1)             # the broker's first reply (and what it takes) comes first
        p.abort("warm-up")
        assert p.wait_acked(30)
        eng.run(p, specs, seed=0)
        assert p.flush(30) and p.stats.dropped_msgs == 0
        return p.stats


def _exact(specs, recs):
    """Every finished request's record equals the reference bit for bit (rows and token ids); aborted: flagged."""
    for s in specs:
        r = recs[s.request_id]
        if s.abort_at is not None:
            assert not r.complete and r.reason == "abort", s.request_id
        else:
            assert r.equals(expected_record(s, L, K, E)), s.request_id
            assert r.prompt_token_ids.tolist() == s.prompt_tokens().tolist()


def _specs(prefix):
    return [s for s in workload(48, seed=9, prefix=prefix)]


@pytest.mark.parametrize("open_many", [True, False], ids=["open_many", "open-in-a-loop"])
def test_processes_end_to_end_with_opens_give_exact_records(tmp_path, open_many):
    from routing_replay.consumer import load_records
    broker, fe, be = start_broker()
    d1, d2 = tmp_path / "c1", tmp_path / "c2"
    cs = [start_consumer(be, "--npz-dir", str(d), "--consumer-id", d.name) for d in (d1, d2)]
    broker.wait_for(r"consumers=2")
    try:
        specs = _specs("e2e")
        st = _synth(fe, specs, open_many)
        assert st.opens_msgs > 0 and st.finishes_msgs > 0       # several opens (finishes) went as one message
        wait_until(lambda: sum(1 for d in (d1, d2) for f in d.glob("*.npz") if not f.name.startswith("."))
                   >= len(specs) + 1, 30, "records")
        recs = {**load_records(d1), **load_records(d2)}
        _exact(specs, recs)
        assert len(list(d1.glob("e2e*.npz"))) > 5 and len(list(d2.glob("e2e*.npz"))) > 5
    finally:
        for p in cs + [broker]:
            assert p.stop() == 0
    assert any(m and int(m.group(1)) > 0 for m in
               (__import__("re").search(r" opens_in=(\d+)", x) for x in broker.lines))


class _OldConsumer(Consumer):
    takes: list = []                                # a consumer of an earlier version: says nothing of opens
    kinds: set = set()

    def _on_broker_message(self, frames, now):
        self.kinds.add(wire.decode_header(frames[0].buffer).kind)     # what it was sent
        super()._on_broker_message(frames, now)


class _OldBroker(Broker):
    def _reply(self, ident, kind, key, body):       # a broker of an earlier version: replies without `takes`
        body = {k: v for k, v in body.items() if k != "takes"}
        return super()._reply(ident, kind, key, body)


@pytest.mark.parametrize("old", ["consumer", "broker"])
def test_a_peer_that_does_not_take_opens_gets_open_messages_and_the_records_are_exact(old):
    ctx = zmq.Context()
    b = (_OldBroker if old == "broker" else Broker)("inproc://e2f", "inproc://e2b", context=ctx).start()
    got = {}
    cons = [(_OldConsumer if old == "consumer" and i == 0 else Consumer)(
        "inproc://e2b", context=ctx, consumer_id=f"k{i}", on_record=lambda r: got.__setitem__(r.request_id, r))
        for i in range(2)]
    for c in cons:
        c.start()
    try:
        wait_until(lambda: len(b.ownership.live_ids) == 2, 10, "two consumers")
        specs = _specs(f"old-{old}")
        st = _synth("inproc://e2f", specs, True, ctx)
        wait_until(lambda: len(got) >= len(specs) + 1, 30, "records")
        _exact(specs, got)
        if old == "broker":
            assert (st.opens_msgs, st.finishes_msgs, b.stats.opens_in, b.stats.finishes_in) == (0, 0, 0, 0)
        else:
            assert st.opens_msgs > 0 and b.stats.opens_in > 0 and b.stats.opens_unbatched > 0
            assert st.finishes_msgs > 0 and b.stats.finishes_in > 0 and b.stats.finishes_unbatched > 0
            mine = sum(1 for rid in [s.request_id for s in specs] + ["warm-up"] if _owner_name(rid) == "k0")
            assert 0 < b.stats.opens_unbatched <= mine and cons[0].acc.stats.opened == mine
            assert {"open", "finish"} <= _OldConsumer.kinds and not {"opens", "finishes"} & _OldConsumer.kinds
        assert not any(sum(c.bad.values()) for c in cons)          # nobody got a message it could not read
    finally:
        for c in cons:
            c.close()
        b.close()
        ctx.term()


def _owner_name(rid):
    from routing_replay.broker.ownership import rendezvous
    return rendezvous(rid.encode(), [b"k0", b"k1"]).decode()


# ---- finishes -----------------------------------------------------------------------------------------------------

def _finishes(ids, bodies, tokens=None, seq=2):
    head = wire.pack_header("finishes", "p", 3, seq, ids, {"entries": bodies})
    toks = [t for t in (tokens or []) if t]
    return [head, *([np.concatenate([np.asarray(t, np.int32) for t in toks]).tobytes()] if toks else [])]


FIN_BODIES = [{"num_output": 3, "reason": "stop", "n_output_tokens": 2},
              {"num_output": 1, "reason": "length", "lost": [[0, 2]], "broker_refused": [[0, 2]]},
              {"num_output": 2, "reason": "stop", "prompt_len": 4, "num_cached": 1, "n_output_tokens": 1}]


def test_a_finishes_entry_reads_as_the_finish_of_its_request():
    head, *frames = _finishes(["a", "b", "c"], FIN_BODIES, [[7, 8], [], [9]])
    f, tokens = wire.parse_finishes(wire.decode_header(head), frames)
    for i, rid in enumerate(["a", "b", "c"]):
        one = wire.decode_header(wire.pack_header("finish", "p", 3, 2, rid, FIN_BODIES[i]))
        assert f.finishes[i] == wire.parse_finish(one)
    assert [None if t is None else t.tolist() for t in (f.tokens_of(i, tokens) for i in range(3))] == [[7, 8], None, [9]]
    sub_head, *sub_frames = wire.subset_finishes(wire.decode_header(head), f, tokens, [2, 1])
    s, st = wire.parse_finishes(wire.decode_header(sub_head), sub_frames)
    assert s.request_ids == ["c", "b"] and s.finishes == [f.finishes[2], f.finishes[1]] and st.tolist() == [9]


@pytest.mark.parametrize("case,reason", [
    ("repeated-id", "bad_field"), ("entries-short", "bad_field"), ("entry-not-a-map", "bad_field"),
    ("bad-range", "bad_field"), ("token-frame-short", "size_mismatch"), ("no-entries", "bad_field"),
    ("empty", "bad_field"),
])
def test_a_malformed_finishes_is_refused_with_a_reason(case, reason):
    ids, bodies, frames = ["a", "b"], [dict(b) for b in FIN_BODIES[:2]], [np.array([7, 8], np.int32).tobytes()]
    if case == "repeated-id":
        ids = ["a", "a"]
    elif case == "entries-short":
        bodies = bodies[:1]
    elif case == "entry-not-a-map":
        bodies[1] = [1, 2]
    elif case == "bad-range":
        bodies[1]["lost"] = [[3, 1]]
    elif case == "token-frame-short":
        frames = [np.array([7], np.int32).tobytes()]
    h = wire.decode_header(wire.pack_header("finishes", "p", 3, 2, ids, {"entries": bodies}))
    if case == "no-entries":
        h.body = {}
    elif case == "empty":
        h.key, h.body, frames = [], {"entries": []}, []
    with pytest.raises(wire.ProtocolError) as e:
        wire.parse_finishes(h, frames)
    assert e.value.reason == reason


def test_the_broker_closes_each_entry_and_sends_each_owner_its_finishes(net):
    b, prod, consumers, _ = net
    a_ids, b_ids = ids_for(b"c1", 2, "fa"), ids_for(b"c2", 2, "fb")
    ids = [a_ids[0], b_ids[0], a_ids[1], b_ids[1]]
    prod.send_multipart(_opens(ids, [4] * 4, [0] * 4))
    for cid, n in ((b"c1", 1), (b"c2", 2)):           # c1: one opens; c2: an open per entry
        for _ in range(n):
            recv(consumers[cid])
    bodies = [FIN_BODIES[0], FIN_BODIES[1], FIN_BODIES[2], {"num_output": 5}]
    toks = [[7, 8], [], [9], []]
    prod.send_multipart(_finishes(ids, bodies, toks, seq=2))
    h, frames = recv(consumers[b"c1"])
    assert (h.kind, h.key, h.seq) == ("finishes", a_ids, 2)
    f, t = wire.parse_finishes(h, frames)
    assert f.bodies == [bodies[0], bodies[2]] and t.tolist() == [7, 8, 9]
    for i in (1, 3):
        h, frames = recv(consumers[b"c2"])
        assert (h.kind, h.key, h.seq, h.body) == ("finish", ids[i], 2, bodies[i]) and frames == []
    assert not consumers[b"c2"].poll(50)
    assert (b.stats.finishes_in, b.stats.finishes_unbatched, b.stats.requests_closed) == (1, 2, 4)
    assert len(b.ownership) == 0 and b.ownership.closing == 4        # kept until the producer's seq 2 is acked


def test_the_consumer_emits_each_finished_entry_and_refuses_only_the_one_over_its_limits():
    acc = Accumulator(finish_grace_s=0.0)
    acc.max_positions = 100
    head, *frames = _opens(["a", "big", "c"], [3, 5, 2], [0, 0, 0])
    acc.apply(wire.decode_header(head), frames, 0.0)
    rows = np.arange(5 * L * K, dtype=np.int16).reshape(5, L, K)
    delta = wire.pack_header("delta", "p", 3, 2, ["a", "c"], wire.delta_body([0, 0], [3, 2], L, K))
    acc.apply(wire.decode_header(delta), [rows.tobytes()], 0.0)
    head, *frames = _finishes(["a", "big", "c"], [{"num_output": 1, "n_output_tokens": 1},
                                                  {"num_output": 500}, {"num_output": 1}], [[42], [], []], seq=3)
    with pytest.raises(EntriesRefused) as e:
        acc.apply(wire.decode_header(head), frames, 1.0)
    assert e.value.request_ids == ["big"] and e.value.reason == "too_large"
    got = {r.request_id: r for r in e.value.records}
    assert set(got) == {"a", "c"} and all(r.complete for r in got.values())
    assert got["a"].prompt_routed_experts.tolist() == rows[:3].tolist() and got["a"].output_token_ids.tolist() == [42]
    assert got["c"].prompt_routed_experts.tolist() == rows[3:].tolist() and got["c"].output_token_ids is None
    assert "big" in acc.requests and acc.requests["big"].finish is None        # still open: it ends on its own


@pytest.fixture
def fake_broker_taking_batches(tmp_path):
    """A producer and a hand-played broker that says it takes `opens` and `finishes`, answering only when told."""
    from tests.test_producer_faults import FakeBroker
    ctx = zmq.Context()
    fake = FakeBroker(ctx, f"ipc://{tmp_path}/f")
    p = Producer(f"ipc://{tmp_path}/f", num_layers=L, top_k=K, context=ctx, linger_ms=0)

    def answer():                                   # the broker's first reply: its epoch and what it takes
        deadline = time.monotonic() + 10
        while fake.ident is None or not p._sender.intake.broker_takes_finishes:
            assert time.monotonic() < deadline, "no hello from the producer"
            if fake.sock.poll(50):
                fake.ident, *frames = fake.sock.recv_multipart()
                if wire.decode_header(frames[0]).kind in ("hello", "heartbeat"):
                    fake.reply("heartbeat", {"consumers": 1, "takes": ["opens", "finishes"]})
    yield fake, p, answer
    p.close(timeout_s=1)
    fake.close()
    ctx.term()


def test_losses_found_after_a_finishes_was_built_go_in_its_entry(fake_broker_taking_batches):
    """A step whose rows could not be read is reported lost in its request's finish: in the `finishes` entry when
    the finish is built after the loss (late lost), and re-encoded into the entry when the message was built but
    not yet sent."""
    fake, p, answer = fake_broker_taking_batches
    answer()

    class Broken:
        shape = (2, L, K)
        dtype = np.int16

        def result(self):
            raise RuntimeError("device copy failed")

        def release(self):
            pass

    assert p.open_many([("a", 3, 0, None, False), ("b", 3, 0, None, False)]) == []
    p.publish_rows(["a"], [0], [2], Broken())
    wait_until(lambda: p.stats.encode_errors == 1, 10, "the failed step")
    assert p.end_many([("finish", "a", 2, "stop", [5, 6]), ("finish", "b", 1, "length", None)]) == 2
    got = [fake.recv() for _ in range(2)]
    assert [(h.kind, h.key) for h, _ in got] == [("opens", ["a", "b"]), ("finishes", ["a", "b"])]
    assert got[1][0].body["entries"] == [     # (a result() that raises: rows refused, not lost for lack of room)
        {"num_output": 2, "reason": "stop", "n_output_tokens": 2, "lost": [[0, 2]], "refused": [[0, 2]]},
        {"num_output": 1, "reason": "length"}]
    assert bytes(got[1][1][0]) == np.array([5, 6], "<i4").tobytes()
    assert p.stats.opens_msgs == 1 and p.stats.finishes_msgs == 1


def test_a_loss_reported_before_a_built_finishes_is_sent_is_re_encoded_into_its_entry(tmp_path):
    from tests.test_producer_faults import FakeBroker
    ctx = zmq.Context()
    p = Producer(f"ipc://{tmp_path}/g", num_layers=L, top_k=K, context=ctx, linger_ms=0)   # nothing bound there yet
    fake = None
    try:
        s = p._sender
        s.intake.broker_takes_opens = s.intake.broker_takes_finishes = True     # as a broker's reply would set them
        assert p.open_many([("a", 3, 0, None, False), ("b", 3, 0, None, False)]) == []
        p.end_many([("finish", "a", 1, "stop", None), ("finish", "b", 1, "stop", None)])
        p.flush(0.05)                                          # no broker: both wait in the replay buffer
        wait_until(lambda: len(s._replay) == 2, 10, "both messages built")
        fin = s._replay.get(2)
        assert fin.parts.kind == "finishes" and fin.sent_at == 0.0
        assert s.intake._note_lost("b", [0, 2], 1, "refused") == "finish re-encoded"
        fake = FakeBroker(ctx, f"ipc://{tmp_path}/g")          # the broker comes up: they go
        got = []
        while len(got) < 2:
            got.append(fake.recv())
        assert [(h.kind, h.seq) for h, _ in got] == [("opens", 1), ("finishes", 2)]
        assert got[1][0].body["entries"] == [{"num_output": 1, "reason": "stop"},
                                             {"num_output": 1, "reason": "stop", "lost": [[0, 2]], "refused": [[0, 2]]}]
    finally:
        p.close(timeout_s=1)
        if fake is not None:
            fake.close()
        ctx.term()


# ---- a broker downgraded under held opens / finishes ---------------------------------------------------------------

def test_renumber_splits_the_chosen_entries_and_numbers_every_held_entry_again(tmp_path):
    """ReplayBuffer.renumber: an `opens` of 3 entries becomes 3 messages, the entries after it move up by 2 (their
    headers rewritten, spilled ones too), an entry kept as it was keeps its send time, the cursor goes back to the
    first unacknowledged seq, and the byte accounting matches the new frames."""
    from routing_replay.producer.resend import Parts, ReplayBuffer, Spill
    r = ReplayBuffer(mem_bound=300, spill=Spill(tmp_path, "p"), spill_bound=1 << 20)

    def msg(kind, seq, key, pad=0):
        return [wire.pack_header(kind, "p", 3, seq, key, {}), b"x" * pad]
    r.add(Parts("delta", ["z"]), msg("delta", 1, ["z"]), 0)
    r.ack(1)                                            # first unacknowledged: 2
    r.add(Parts("delta", ["a"]), msg("delta", 2, ["a"], 100), 100)
    r.add(Parts("opens", ["a", "b", "c"]), msg("opens", 3, ["a", "b", "c"]), 0)
    r.add(Parts("finish", ["a"]), msg("finish", 4, "a", 400), 0)      # beyond mem_bound: spilled
    assert r.spilled_bytes > 0
    r.mark_sent(r.get(2), 5.0)
    r.mark_sent(r.get(3), 6.0)

    def expand(e, frames):
        if e.parts.kind != "opens":
            return None
        return [(Parts("open", (rid,)), [wire.pack_header("open", "p", 3, 0, rid, {})], 0)
                for rid in e.parts.request_ids]
    before = [(e.seq, e.parts.kind, e.sent_at, list(r.frames(e))) for e in r]

    def broken(e, frames):
        if e.seq == 4:
            raise RuntimeError("cannot re-encode")
        return expand(e, frames)
    with pytest.raises(RuntimeError):                   # every expansion first: a failure changes nothing
        r.renumber(broken, wire.with_seq)
    assert [(e.seq, e.parts.kind, e.sent_at, list(r.frames(e))) for e in r] == before and r.get(4).spill is not None
    assert r.renumber(expand, wire.with_seq) == 2
    got = [(e.seq, e.parts.kind, list(e.parts.request_ids), e.sent_at) for e in r]
    assert got == [(2, "delta", ["a"], 5.0), (3, "open", ["a"], 0.0), (4, "open", ["b"], 0.0),
                   (5, "open", ["c"], 0.0), (6, "finish", ["a"], 0.0)]
    heads = [wire.decode_header(r.frames(e)[0]) for e in r]
    assert [(h.seq, h.kind, h.key) for h in heads] == [(2, "delta", ["a"]), (3, "open", "a"), (4, "open", "b"),
                                                       (5, "open", "c"), (6, "finish", "a")]
    assert r.frames(r.get(6))[1] == b"x" * 400 and r.frames(r.get(2))[1] == b"x" * 100
    assert (r.first_unacked, r.next_seq, r.pending(), r.never_sent) == (2, 7, 5, 4)
    assert r.mem_bytes + r.spilled_bytes == sum(e.nbytes for e in r)
    assert r.get(6).spill is not None and r.get(2).spill is None        # the large one went back to the spill
    assert r.ack(6) == (5, 4) and len(r) == 0 and r.mem_bytes == 0 and r.spilled_bytes == 0


class _OlderBroker(_OldBroker):
    """A broker of the version before `opens`/`finishes`, as it was: no `takes` in its replies, and both kinds
    unknown to its wire module, so a message of either is undecodable there (an error that names no seq; nothing
    admitted): a producer that kept sending it would be asked to rewind to it forever."""
    unknown = 0

    def _on_frontend(self, frames):
        try:
            kind = msgpack.unpackb(frames[1].bytes)[1]
        except Exception:  # noqa: BLE001
            kind = None
        if kind in ("opens", "finishes"):
            self.stats.msgs_in += 1
            type(self).unknown += 1
            self._bad(wire.ProtocolError("unknown_kind", f"unknown message kind {kind!r}"), frames[0].bytes,
                      self._front)
            return
        super()._on_frontend(frames)


def test_a_broker_downgraded_under_held_opens_and_finishes_gets_them_one_by_one_and_the_records_are_exact(tmp_path):
    """A broker that takes `opens`/`finishes` holds a producer's whole workload unacked (no consumer yet), then a
    broker of the earlier version takes its place. The producer sends every held `opens`/`finishes` again as one
    `open`/`finish` per entry, every held message numbered again, and every record is exact."""
    ctx = zmq.Context()
    fe, be = f"ipc://{tmp_path}/f", f"ipc://{tmp_path}/b"
    b1 = Broker(fe, be, context=ctx).start()           # no consumer: it holds every message and acks none
    b2, cons, got = None, [], {}
    p = Producer(fe, num_layers=L, top_k=K, context=ctx, linger_ms=0)
    try:
        s = p._sender
        wait_until(lambda: s.intake.broker_takes_opens and s.intake.broker_takes_finishes, 10,
                   "the first broker's reply")
        specs = _specs("down")
        SyntheticEngine(num_layers=L, top_k=K, num_experts=E, open_many=True).run(p, specs, seed=0)
        assert p.flush(30)                              # all sent to the first broker, which acks nothing
        batched = p.stats.opens_msgs + p.stats.finishes_msgs
        assert p.stats.opens_msgs > 0 and p.stats.finishes_msgs > 0 and p.stats.acked_msgs == 0
        b1.close()
        _OlderBroker.unknown = 0
        b2 = _OlderBroker(fe, be, context=ctx).start()
        cons = [Consumer(be, context=ctx, consumer_id=f"k{i}", on_record=lambda r: got.__setitem__(r.request_id, r))
                for i in range(2)]
        for c in cons:
            c.start()
        assert p.wait_acked(60), "the producer's messages were not all acked by the older broker"
        wait_until(lambda: len(got) >= len(specs), 30, "records")
        _exact(specs, got)
        assert p.stats.unbatched_msgs == batched and not s.intake.broker_takes_opens \
            and not s.intake.broker_takes_finishes
        assert b2.stats.opens_in == 0 and b2.stats.finishes_in == 0
        assert b2.stats.requests_opened == len(specs)
        assert not any(sum(c.bad.values()) for c in cons)
    finally:
        p.close(timeout_s=1)
        for c in cons:
            c.close()
        for b in (b1, b2):
            if b is not None:
                b.close()
        ctx.term()
