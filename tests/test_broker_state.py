"""The broker's socket-free parts on values alone: go-back-N intake, the ownership table, the delta splitter."""

import numpy as np
import pytest

from routing_replay.broker.intake import (Admission, ConsumerLink, Hello, InFlight, Intake, ProducerIntake,
                                          MAX_PRODUCERS)
from routing_replay.broker.ownership import OpenMsg, Ownership, rendezvous
from routing_replay.broker.split import apply_plan, plan_split, split_delta
from routing_replay.protocol import wire


# ---- intake -------------------------------------------------------------------------------------------------------

def test_admission_accepts_in_seq_order_resends_and_refuses_gaps():
    ps = ProducerIntake("p", 1, b"id", unacked_from=1, now=0.0)
    assert ps.admit(1) is Admission.ACCEPT and ps.next == 2
    assert ps.admit(3) is Admission.GAP and ps.next == 2
    assert ps.admit(2) is Admission.ACCEPT and ps.next == 3
    assert ps.admit(3) is Admission.ACCEPT and ps.next == 4
    assert ps.admit(1) is Admission.RESEND and ps.next == 2
    ps.held.add(2)
    assert ps.admit(2) is Admission.ACCEPT and ps.next == 3     # the one expected: routed, held or not
    assert ps.admit(2) is Admission.HELD and ps.next == 3       # a copy of one that waits in the pending queue
    ps.go_back(1)
    assert ps.next == 1
    ps.go_back(5)                       # never forward
    assert ps.next == 1


def test_frontier_is_a_contiguous_prefix_of_completed_seqs():
    intake = Intake(rewind_interval_s=0.5)
    ps, outcome = intake.hello("p", 1, b"id", 1, 0.0)
    assert outcome is Hello.JOINED and (ps.frontier, ps.next) == (0, 1)
    intake.complete(ps, 3)
    intake.complete(ps, 2)
    assert ps.frontier == 0 and ps.done == {2, 3}
    assert list(intake.acks_due()) == []
    intake.complete(ps, 1)
    assert ps.frontier == 3 and ps.done == set()
    due = list(intake.acks_due())
    assert due == [(ps, wire.ProducerAck(1, 3))]
    intake.ack_sent(ps, due[0][1], ok=False)      # not sent: still due
    assert list(intake.acks_due()) == [(ps, wire.ProducerAck(1, 3))]
    intake.ack_sent(ps, wire.ProducerAck(1, 3), ok=True)
    assert ps.acked_sent == 3 and list(intake.acks_due()) == []


def test_parts_acked_completes_a_seq_when_its_last_part_is_acked():
    intake = Intake(rewind_interval_s=0.5)
    ps, _ = intake.hello("p", 1, b"id", 1, 0.0)
    a, b = ConsumerLink(b"a", 0, 1, 0.0), ConsumerLink(b"b", 0, 2, 0.0)
    tok = InFlight(ps, 1)                 # a split delta: one part on each link
    for link in (a, b):
        link.lseq += 1
        link.sent.append((link.lseq, tok))
        tok.parts += 1
    a.sent.append((2, None))              # an abort the broker made itself: no seq behind it
    intake.parts_acked(a.sent, 2)
    assert tok.parts == 1 and ps.frontier == 0 and len(a.sent) == 0
    intake.parts_acked(b.sent, 0)         # below the part: nothing
    assert tok.parts == 1
    intake.parts_acked(b.sent, 1)
    assert tok.parts == 0 and ps.frontier == 1
    assert [ack for _, ack in intake.acks_due()] == [wire.ProducerAck(1, 1)]


def test_a_lost_link_sends_each_producer_back_to_its_lowest_lost_seq():
    intake = Intake(rewind_interval_s=0.5)
    p, _ = intake.hello("p", 1, b"p", 1, 0.0)
    q, _ = intake.hello("q", 1, b"q", 1, 0.0)
    link = ConsumerLink(b"c", 0, 1, 0.0)
    toks = []
    for i, (ps, seq) in enumerate([(p, 4), (q, 7), (p, 5), (q, 6)], start=1):
        ps.next = max(ps.next, seq + 1)
        t = InFlight(ps, seq)
        t.parts = 1
        link.sent.append((i, t))
        toks.append(t)
    affected = intake.forget_parts(link.sent)
    assert set(affected) == {p, q} and len(affected) == 2
    assert (p.next, q.next) == (4, 6)
    assert all(t.refused for t in toks) and len(link.sent) == 0
    intake.parts_acked(link.sent, 10)     # nothing left to complete
    assert (p.frontier, q.frontier) == (0, 0)


def test_refuse_goes_back_only_for_the_current_incarnation():
    intake = Intake(rewind_interval_s=0.5)
    ps, _ = intake.hello("p", 1, b"id", 1, 0.0)
    ps.next = 9
    tok = InFlight(ps, 5)
    assert intake.refuse(tok) is ps and ps.next == 5 and tok.refused
    old = InFlight(ps, 3)
    intake.remove(ps)
    assert intake.refuse(old) is None and ps.next == 5


def test_rewind_asks_once_per_gap_episode_unless_forced():
    ps = ProducerIntake("p", 2, b"id", unacked_from=4, now=0.0)
    assert ps.rewind_ask(10.0, 0.5) == wire.ProducerAck(2, 3, rewind=True, expect=4)
    assert ps.rewind_ask(10.1, 0.5) is None
    assert ps.rewind_ask(10.2, 0.5, force=True) == wire.ProducerAck(2, 3, rewind=True, expect=4)
    assert ps.rewind_ask(10.8, 0.5) == wire.ProducerAck(2, 3, rewind=True, expect=4)
    ps.next = 6                            # a new gap episode: asked at once
    assert ps.rewind_ask(10.9, 0.5) == wire.ProducerAck(2, 3, rewind=True, expect=6)
    assert wire.producer_ack_body(ps.rewind_ask(20.0, 0.5)) == {"epoch": 2, "upto": 3, "rewind": True, "expect": 6}


def test_hello_moves_the_frontier_and_names_what_happened():
    intake = Intake(rewind_interval_s=0.5)
    ps, _ = intake.hello("p", 1, b"id", 1, 0.0)
    intake.complete(ps, 5)
    intake.complete(ps, 6)
    ps2, outcome = intake.hello("p", 1, b"id2", 5, 1.0)     # the producer had 1..4 acked (by an earlier broker)
    assert ps2 is ps and outcome is Hello.RECONNECTED and ps.ident == b"id2"
    assert (ps.frontier, ps.next, ps.done) == (6, 5, set())
    assert [ack for _, ack in intake.acks_due()] == [wire.ProducerAck(1, 6)]
    assert intake.hello("p", 1, b"id2", 2, 2.0)[1] is Hello.KNOWN and ps.frontier == 6
    assert intake.current("p", 1, b"id2") is ps
    assert intake.current("p", 1, b"other") is None and intake.current("p", 2, b"id2") is None
    with pytest.raises(wire.ProtocolError) as e:
        intake.replaced_by("p", 0)
    assert e.value.reason == "stale_epoch" and "epoch 0 is older than its current epoch 1" in str(e.value)
    assert intake.replaced_by("p", 1) is None and intake.replaced_by("p", 2) is ps


def test_producer_table_is_bounded():
    intake = Intake(rewind_interval_s=0.5)
    for i in range(MAX_PRODUCERS):
        intake.hello(f"p{i}", 1, b"x", 1, 0.0)
    with pytest.raises(wire.ProtocolError) as e:
        intake.hello("one-more", 1, b"x", 1, 0.0)
    assert e.value.reason == "too_many_producers" and f"{MAX_PRODUCERS} producers" in str(e.value)


def test_unknown_peers_are_asked_for_a_hello_at_most_every_half_second():
    intake = Intake(rewind_interval_s=0.5)
    assert intake.unknown_ask(b"x", 9, 1.0) == wire.ProducerAck(9, -1, rewind=True, hello=True)
    assert intake.unknown_ask(b"x", 9, 1.4) is None
    assert intake.unknown_ask(b"y", 9, 1.4) is not None
    assert wire.producer_ack_body(intake.unknown_ask(b"x", 9, 1.6)) == {"epoch": 9, "upto": -1, "rewind": True,
                                                                       "hello": True}


# ---- ownership ----------------------------------------------------------------------------------------------------

class _Link:
    def __init__(self, cid: bytes):
        self.cid = cid
        self.alive = True

    def __repr__(self):
        return f"_Link({self.cid!r})"


def _table(cids=(b"c1", b"c2"), max_open=1 << 20):
    links = {c: _Link(c) for c in cids}
    own = Ownership(max_open)
    own.set_live(links)
    return own, links


def test_assignment_is_rendezvous_hashing_and_sticky():
    own, links = _table()
    ids = [f"r{i}" for i in range(40)]
    for rid in ids:
        o = own.owner_of(rid)
        assert o.link is links[rendezvous(rid.encode(), [b"c1", b"c2"])] and not o.reassigned
    assert {own.owned_by(links[b"c1"]), own.owned_by(links[b"c2"])} != {0} and len(own) == 40
    links[b"c3"] = _Link(b"c3")
    own.set_live(links)                       # a consumer joins: nothing in flight moves
    assert all(own.owner_of(rid).link is links[rendezvous(rid.encode(), [b"c1", b"c2"])] for rid in ids)
    assert own.owned_by(links[b"c3"]) == 0
    assert own.lookup(ids) is not None and own.lookup(ids + ["new"]) is None


@pytest.mark.parametrize("pattern", ["cmpl-{i:08x}-0", "step3-g{g}-s{s}", "uuid"])
@pytest.mark.parametrize("n", [2, 3, 5, 8])
def test_rendezvous_spreads_ids_evenly_over_any_number_of_consumers(pattern, n):
    """Each of n consumers owns within 12 % of 1/n of 6,000 ids, for sequential, structured and random ids (a CRC
    score alone gave 3 consumers 1/2, 1/4 and 1/4); and a consumer that leaves moves only its own ids."""
    import uuid

    rng = np.random.default_rng(n)
    ids = [(uuid.UUID(bytes=rng.bytes(16)).hex if pattern == "uuid"
            else pattern.format(i=i, g=i // 8, s=i % 8)).encode() for i in range(6000)]
    cs = [f"consumer-{j}".encode() for j in range(n)]
    owner = [rendezvous(r, cs) for r in ids]
    per = [owner.count(c) for c in cs]
    assert sum(per) == 6000
    assert max(per) <= 1.12 * 6000 / n and min(per) >= 0.88 * 6000 / n, per
    rest = cs[1:] or cs
    assert all(rendezvous(r, rest) == o for r, o in zip(ids, owner) if o != cs[0])


def test_a_lost_owner_is_replaced_on_the_next_message_with_the_open_sent_again():
    own, links = _table()
    rid = next(f"r{i}" for i in range(100) if rendezvous(f"r{i}".encode(), [b"c1", b"c2"]) == b"c1")
    own.owner_of(rid)
    head = wire.pack_header("open", "p", 1, 1, rid, {"prompt_len": 2, "num_cached": 0, "num_layers": 4, "top_k": 2})
    own.opened(rid, "p", OpenMsg(head, [b"tokens"]))
    lost = links.pop(b"c1")
    lost.alive = False
    own.set_live(links)
    assert own.owned_by(lost) == 1            # counted from its own index, moved lazily
    assert own.lookup([rid]) is None
    o = own.owner_of(rid)
    assert o.link is links[b"c2"] and o.reassigned and o.reopen.frames == [b"tokens"]
    h = wire.decode_header(o.reopen.reassigned_head())
    assert (h.kind, h.key, h.body) == ("open", rid, {"prompt_len": 2, "num_cached": 0, "num_layers": 4, "top_k": 2,
                                                     "reassigned": True})
    assert own.owned_by(lost) == 0 and own.owned_by(links[b"c2"]) == 1
    assert own.owner_of(rid) == (links[b"c2"], False, None)


def test_dropping_a_producer_touches_only_its_own_requests():
    own, links = _table()
    for i in range(6):
        rid = f"r{i}"
        own.owner_of(rid)
        own.opened(rid, "p" if i % 2 else "q", OpenMsg(b"", []))
    own.owner_of("no-open")                   # first seen in a delta: no producer
    own.opened("r1", "q", OpenMsg(b"", []))   # opened again by another producer: it is q's now
    dropped = own.drop_producer("p")
    assert sorted(rid for rid, _ in dropped) == ["r3", "r5"]
    assert all(link is own.owner.get(rid, link) for rid, link in dropped)
    assert sorted(own.owner) == ["no-open", "r0", "r1", "r2", "r4"]
    assert own.drop_producer("p") == []
    assert sorted(rid for rid, _ in own.drop_producer("q")) == ["r0", "r1", "r2", "r4"]
    assert sorted(own.owner) == ["no-open"]
    assert own.owned_by(links[b"c1"]) + own.owned_by(links[b"c2"]) == 1


def test_close_forgets_a_request_everywhere():
    own, links = _table()
    o = own.owner_of("a").link
    own.opened("a", "p", OpenMsg(b"", []))
    own.close("a")
    assert len(own) == 0 and own.owned_by(o) == 0 and own.drop_producer("p") == []
    own.close("a")                            # twice: nothing


def test_a_closed_request_is_kept_until_its_finish_is_acked_and_a_resend_reopens_it():
    """A finish not yet acked keeps the request as closing; a message that comes again for it (the producer rewound
    past the finish) opens it again: on the same owner if alive, else on a new one with the open sent again."""
    own, links = _table()
    rid = next(f"r{i}" for i in range(100) if rendezvous(f"r{i}".encode(), [b"c1", b"c2"]) == b"c1")
    o = own.owner_of(rid).link
    open_msg = OpenMsg(wire.pack_header("open", "p", 1, 1, rid, {"prompt_len": 2, "num_cached": 0,
                                                                 "num_layers": 4, "top_k": 2}), [])
    own.opened(rid, "p", open_msg)
    own.close(rid, "p", 5)
    assert len(own) == 0 and own.closing == 1 and own.owned_by(o) == 0
    assert own.lookup([rid]) is None                     # the delta path goes through owner_of
    assert own.owner_of(rid) == (o, False, None)          # owner alive: the same link, nothing sent again
    assert len(own) == 1 and own.closing == 0 and own.owned_by(o) == 1
    own.close(rid, "p", 5)                               # the resent finish closes it again
    own.close(rid, "p", 5)
    lost = links.pop(b"c1")
    lost.alive = False
    own.set_live(links)
    again = own.owner_of(rid)                            # owner lost before it acked the finish
    assert again.link is links[b"c2"] and again.reassigned and again.reopen is open_msg
    own.close(rid, "p", 5)
    assert own.release("p", 4) == 0 and own.closing == 1
    assert own.release("q", 9) == 0 and own.closing == 1   # another producer's acks release nothing of p's
    assert own.release("p", 5) == 1 and own.closing == 0
    assert own.owner_of(rid) == (links[b"c2"], False, None) and len(own) == 1   # acked: a new request from here


def test_closing_requests_go_with_their_producer_and_a_plain_close_forgets_at_once():
    own, links = _table()
    for rid, p in (("a", "p"), ("b", "q"), ("c", "p")):
        own.owner_of(rid)
        own.opened(rid, p, OpenMsg(b"", []))
        own.close(rid, p, 1)
    own.owner_of("d")
    own.close("d")                                       # no producer: forgotten at once
    assert own.closing == 3
    assert own.drop_producer("p") == [] and own.closing == 1
    assert own.release("q", 1) == 1 and own.closing == 0


def test_the_oldest_request_is_forgotten_at_the_limit():
    own, links = _table(max_open=3)
    for rid in "abc":
        own.owner_of(rid)
        own.opened(rid, "p", OpenMsg(b"", []))
    own.owner_of("d")
    assert sorted(own.owner) == ["b", "c", "d"] and own.evicted == 1
    assert sorted(rid for rid, _ in own.drop_producer("p")) == ["b", "c"]
    assert sum(own.owned_by(k) for k in links.values()) == 1


# ---- split --------------------------------------------------------------------------------------------------------

def _delta(ids, counts, L, K, seed=0):
    rng = np.random.default_rng(seed)
    rows = {rid: rng.integers(-1, 128, (c, L, K)).astype(np.int16) for rid, c in zip(ids, counts)}
    starts = [7 * i for i in range(len(ids))]
    head = wire.decode_header(wire.pack_header("delta", "p", 3, 11, ids, wire.delta_body(starts, counts, L, K)))
    payload = np.concatenate([rows[r] for r in ids]).tobytes()
    return head, wire.parse_delta(head), rows, starts, payload


@pytest.mark.parametrize("counts,L,frames_per_owner", [
    ([1] * 8, 4, [1, 1]),              # decode-like: many short runs, gathered into one frame per owner
    ([64] * 8, 512, [4, 4]),           # runs of 64 KiB and more: one zero-copy slice per run
    ([1, 2, 3, 1, 2, 3, 1, 2], 4, [1, 1]),   # uneven counts: joined
])
def test_split_gives_each_owner_its_rows_exactly(counts, L, frames_per_owner):
    K = 8
    ids = [f"r{i}" for i in range(8)]
    owners = ["A" if i % 2 == 0 else "B" for i in range(8)]
    h, d, rows, starts, payload = _delta(ids, counts, L, K)
    parts = split_delta(h, d, owners, set(owners), [payload])
    assert sorted(p.owner for p in parts) == ["A", "B"]
    for p in parts:
        mine = [r for r, o in zip(ids, owners) if o == p.owner]
        sh = wire.decode_header(p.head)
        sd = wire.parse_delta(sh)
        assert (sh.kind, sh.producer, sh.epoch, sh.seq) == ("delta", "p", 3, 11)
        assert sd.request_ids == mine
        assert sd.starts.tolist() == [s for s, o in zip(starts, owners) if o == p.owner]
        assert sd.counts.tolist() == [c for c, o in zip(counts, owners) if o == p.owner]
        sent = [bytes(f) for f in p.frames]     # what zmq sends: each frame's buffer
        wire.check_payload(sd, sent)
        got = np.frombuffer(b"".join(sent), np.int16).reshape(-1, L, K)
        np.testing.assert_array_equal(got, np.concatenate([rows[r] for r in mine]))
        assert len(p.frames) == frames_per_owner[0]


def test_split_forwards_contiguous_runs_zero_copy():
    L, K = 4, 2
    ids = [f"r{i}" for i in range(6)]
    owners = ["A", "A", "A", "B", "B", "B"]
    h, d, rows, _, payload = _delta(ids, [2] * 6, L, K, seed=4)
    buf = bytearray(payload)
    parts = {p.owner: p for p in split_delta(h, d, owners, {"A", "B"}, [buf])}
    half = len(buf) // 2
    for owner, lo in (("A", 0), ("B", half)):
        (f,) = parts[owner].frames
        assert isinstance(f, memoryview) and f.obj is buf          # a view of the received frame, not a copy
        assert bytes(f) == payload[lo:lo + half]


@pytest.mark.parametrize("counts,L,owners", [
    ([1] * 12, 4, "ABBABAABBBAA"),             # decode-like: gathered, one frame per payload frame it comes from
    ([64] * 6, 512, "AABBBA"),                 # 64 KiB runs: zero-copy slices, cut where the payload frames end
    ([1, 2, 3, 1, 2, 3], 4, "ABABAB"),         # uneven counts: rows gathered
    ([2, 0, 1, 0, 2, 1], 4, "AABBAB"),         # zero-row entries
])
def test_split_of_a_payload_in_several_frames_gives_each_owner_its_rows_exactly(counts, L, owners):
    """A producer's coalesced steps arrive as one payload frame per step: the split reads them in place."""
    K = 8
    ids = [f"r{i}" for i in range(len(counts))]
    owners = list(owners)
    h, d, rows, starts, payload = _delta(ids, counts, L, K, seed=7)
    rb = L * K * 2
    edges = np.cumsum([0, *counts]) * rb
    cuts = [0, int(edges[2]), int(edges[3]), int(edges[5]), len(payload)]      # frames of 2, 1, 2, rest entries
    frames = [bytearray(payload[a:b]) for a, b in zip(cuts, cuts[1:])]
    wire.check_payload(d, frames)
    plan = plan_split(d, b"", owners, set(owners), 0)
    for p in apply_plan(h, d, plan, frames):
        mine = [r for r, o in zip(ids, owners) if o == p.owner]
        sd = wire.parse_delta(wire.decode_header(p.head))
        assert sd.request_ids == mine
        assert sd.starts.tolist() == [s for s, o in zip(starts, owners) if o == p.owner]
        sent = [bytes(f) for f in p.frames]
        wire.check_payload(sd, sent)
        got = np.frombuffer(b"".join(sent), np.int16).reshape(-1, L, K)
        np.testing.assert_array_equal(got, np.concatenate([rows[r] for r in mine]))


def test_a_split_plan_is_the_same_split_and_is_tied_to_the_ownership_version():
    """The plan cached for a key list gives the owners the same headers and rows as a fresh split, for a later
    delta with other starts and rows; any change of the ownership table moves its version (the broker then plans
    again)."""
    L, K = 4, 8
    ids = [f"r{i}" for i in range(10)]
    own = Ownership(100)
    links = {b"A": _Link(b"A"), b"B": _Link(b"B")}
    own.set_live(links)
    owners = [own.owner_of(r).link for r in ids]
    assert set(owners) == set(links.values())
    v = own.version
    h1, d1, _, _, p1 = _delta(ids, [1] * 10, L, K, seed=1)
    plan = plan_split(d1, h1.body["count"], owners, set(owners), v)
    body = wire.delta_body([5 + i for i in range(10)], [1] * 10, L, K)
    h2 = wire.decode_header(wire.pack_header("delta", "p", 3, 12, ids, body))
    d2 = wire.parse_delta(h2)
    p2 = np.random.default_rng(2).integers(0, 99, (10, L, K)).astype(np.int16).tobytes()
    cached = {p.owner: p for p in apply_plan(h2, d2, plan, [p2])}
    fresh = {p.owner: p for p in split_delta(h2, d2, owners, set(owners), [p2])}
    assert cached.keys() == fresh.keys()
    for o in cached:
        assert cached[o].head == fresh[o].head
        assert [bytes(f) for f in cached[o].frames] == [bytes(f) for f in fresh[o].frames]
        sh = wire.decode_header(cached[o].head)
        assert (sh.seq, wire.parse_delta(sh).starts.tolist()) == (
            12, [5 + i for i, x in enumerate(owners) if x is o])
    own.owner_of("r0")                              # no change: same version
    assert own.version == v
    own.owner_of("new")
    assert own.version == v + 1
    own.close("new")
    assert own.version == v + 2
    own.close("never-seen")                         # nothing to forget: no change
    assert own.version == v + 2
    own.set_live({b"A": links[b"A"]})
    assert own.version == v + 3
    own.drop_producer("p")
    assert own.version == v + 4
