"""The consumer's socket-free state: LinkIn, FetchedRecords, TrainerService on bytes alone (no sockets)."""

import numpy as np

from routing_replay.consumer.service import LinkIn
from routing_replay.consumer.store import RecordStore
from routing_replay.consumer.trainer_service import FetchedRecords, Sent, TrainerService, Where
from routing_replay.protocol import wire

L, K = 2, 2


def _rec(rid, n=4):
    return wire.Record(rid, np.full((n, L, K), 3, np.int16), np.ones((1, L, K), np.int16), 0,
                       np.arange(L, dtype=np.int32), True)


def _fetch(ids, answer_unknown=False, timeout_ms=1000):
    body = {"timeout_ms": timeout_ms}
    if answer_unknown:
        body["answer_unknown"] = True
    return [wire.pack_header("fetch", "t", 0, 1, ids, body)]


class Wire:
    """Stands in for the ROUTER socket: records what was sent; `mode` says what the next sends do."""

    def __init__(self):
        self.sent = []
        self.mode = Sent.SENT

    def __call__(self, client, frames):
        if self.mode is Sent.SENT:
            h = wire.decode_header(frames[0])
            self.sent.append((client, h.kind, h.key, h.body["reason"] if h.kind == "error" else None))
        return self.mode


def test_link_in_acks_with_a_link_ack_and_reports_a_gap_once_per_retry():
    link = LinkIn()
    assert link.ack(0.0, 1.0) is None
    assert link.accept((5, 1, 1)) and link.accept((5, 1, 2))
    assert link.ack(0.0, 1.0) == wire.LinkAck(5, 1, 2, None)
    assert link.ack(0.0, 1.0) is None
    assert not link.accept((5, 1, 4)) and link.dropped == 1
    assert link.ack(0.5, 1.0) == wire.LinkAck(5, 1, 2, 3)
    assert link.ack(1.0, 1.0) is None
    assert link.ack(1.6, 1.0) == wire.LinkAck(5, 1, 2, 3)
    assert wire.link_ack_body(wire.LinkAck(5, 1, 2, 3)) == {"link": [5, 1, 2], "gap": 3}


def test_fetched_records_are_bounded_in_time_and_bytes():
    f = FetchedRecords(retention_s=10, max_bytes=2 * _rec("x").nbytes)
    for i, t in enumerate((0.0, 1.0, 2.0)):
        f.put(_rec(f"r{i}"), t)
    assert (len(f), "r0" in f, f.bytes) == (2, False, 2 * _rec("x").nbytes)
    f.expire(11.5)
    assert (len(f), f.get("r2").request_id) == (1, "r2")
    f.expire(12.5)
    assert len(f) == 0 and f.bytes == 0


def test_fetched_records_keep_the_last_one_even_above_the_byte_bound():
    small, big = _rec("s").nbytes, _rec("big", n=64).nbytes
    f = FetchedRecords(retention_s=10, max_bytes=2 * small)
    assert big > 2 * small
    f.put(_rec("s"), 0.0)
    f.put(_rec("big", n=64), 1.0)               # alone above the bound: kept, what was before it goes
    assert (list(f._recs), f.bytes, f.get("big").prompt_routed_experts.shape[0]) == (["big"], big, 64)
    f.put(_rec("t"), 2.0)                       # the next one fetched: the large one goes
    assert (list(f._recs), f.bytes) == (["t"], small)
    f.put(_rec("big2", n=64), 3.0)
    f.expire(13.5)                              # its time runs out as any other's
    assert (len(f), f.bytes) == (0, 0)
    none = FetchedRecords(retention_s=10, max_bytes=0)
    none.put(_rec("s"), 0.0)
    assert (len(none), none.bytes) == (0, 0)


def test_trainer_service_answers_each_kind_of_fetch():
    w = Wire()
    opened = {"p"}
    ts = TrainerService("c", RecordStore(1 << 20), w, is_open=opened.__contains__)
    ts.on_record(_rec("a"), 0.0)
    assert [ts.where(r) for r in ("a", "p", "u")] == [Where.HELD, Where.PENDING, Where.UNKNOWN]
    ts.on_message(b"T", _fetch(["a", "p", "u"], answer_unknown=True), 0.0)
    assert w.sent == [(b"T", "error", ["u"], "unknown"), (b"T", "record", "a", None)]
    assert set(ts.waiters) == {"p", "u"} and ts.where("a") is Where.RETAINED and len(ts.store) == 0
    # fetched again: the same record, from the retained copy
    ts.on_message(b"T2", _fetch(["a"]), 0.0)
    assert w.sent[-1] == (b"T2", "record", "a", None)
    # the pending one finishes: sent to its waiter at once, never stored
    opened.discard("p")
    ts.on_record(_rec("p"), 0.1)
    assert w.sent[-1] == (b"T", "record", "p", None) and len(ts.store) == 0 and "p" not in ts.waiters
    ts.tick(2.0)
    assert ts.waiters == {}                                    # "u" timed out


def test_trainer_service_keeps_records_in_the_store_while_a_trainer_is_full_or_gone():
    w = Wire()
    ts = TrainerService("c", RecordStore(1 << 20), w)
    for rid in ("a", "b"):
        ts.on_record(_rec(rid), 0.0)
    w.mode = Sent.FULL
    ts.on_message(b"T", _fetch(["a", "b"]), 0.0)
    assert len(ts.store) == 2 and list(ts.outbox[b"T"]) == ["a", "b"] and b"T" in ts.backoff
    w.mode = Sent.SENT
    ts.retry(ts.backoff[b"T"].at)
    assert [s[2] for s in w.sent] == ["a", "b"] and len(ts.store) == 0 and ts.outbox == {}
    ts.on_record(_rec("c"), 0.0)
    w.mode = Sent.GONE
    ts.on_message(b"G", _fetch(["c"]), 0.0)
    assert b"G" in ts.gone and ts.outbox == {} and len(ts.store) == 1   # still there for the next fetch
    bad = []
    ts.count_bad = lambda reason, e: bad.append(reason)
    w.mode = Sent.SENT
    ts.on_message(b"T", [wire.pack_header("fetch", "t", 0, 1, "not-a-list", {})], 0.0)
    assert bad == ["bad_field"] and w.sent[-1][1] == "error"


def test_live_records_that_find_a_subscriber_full_wait_in_order_and_are_not_lost():
    """A burst of finishes beyond the subscriber's send queue (TRAINER_SNDHWM): the ones that did not fit wait (as
    ids; the records stay in the store) and go out in order once it drains; later ones queue behind them. Only
    beyond MAX_LIVE_BACKLOG, or for a record gone meanwhile, is one dropped and counted."""
    from routing_replay.consumer import trainer_service as tsm
    w = Wire()
    ts = TrainerService("c", RecordStore(1 << 20), w)
    ts.on_message(b"S", [wire.pack_header("hello", "t", 0, 1, "t", {"subscribe": "r"})], 0.0)
    ts.on_record(_rec("r0"), 0.0)
    w.mode = Sent.FULL
    ts.on_record(_rec("r1"), 0.0)
    w.mode = Sent.SENT
    ts.on_record(_rec("r2"), 0.0)                   # room again, but r1 waits: r2 goes behind it
    assert [s[2] for s in w.sent] == ["r0"] and list(ts.live_backlog[b"S"]) == ["r1", "r2"]
    assert ts.retry(0.0) == 0.1 and [s[2] for s in w.sent] == ["r0", "r1", "r2"] and ts.live_backlog == {}
    assert ts.subscriber_drops == 0 and len(ts.store) == 3     # live copies never take a record out of the store
    # bounded: beyond the bound the oldest waiting one is dropped and counted; a record gone meanwhile too
    w.mode = Sent.FULL
    old, tsm.MAX_LIVE_BACKLOG = tsm.MAX_LIVE_BACKLOG, 2
    try:
        for rid in ("r3", "r4", "r5"):
            ts.on_record(_rec(rid), 0.0)
    finally:
        tsm.MAX_LIVE_BACKLOG = old
    assert list(ts.live_backlog[b"S"]) == ["r4", "r5"] and ts.subscriber_drops == 1
    ts.store.discard("r4")
    w.mode = Sent.SENT
    ts.retry(0.0)
    assert [s[2] for s in w.sent][-1] == "r5" and ts.subscriber_drops == 2 and ts.live_backlog == {}
    # a subscriber that says bye takes its backlog with it
    w.mode = Sent.FULL
    ts.on_record(_rec("r6"), 0.0)
    ts.on_message(b"S", [wire.pack_header("bye", "t", 0, 2, "t", {})], 0.0)
    assert ts.live_backlog == {} and ts.subscribers == {}
