"""The producer's intake (producer/intake.py) on bytes alone, no socket: queued items in, the exact frames it
would send out, and what each broker reply (bytes built as the broker builds them) does to the resend buffer,
the link and the counts."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from routing_replay.producer.books import RequestBook
from routing_replay.producer.connection import LinkState
from routing_replay.producer.encode import Geometry
from routing_replay.producer.inbox import STOP, Inbox, QueueLedger
from routing_replay.producer.intake import Intake, SenderSettings
from routing_replay.producer.items import Announce, Step
from routing_replay.producer.producer import ProducerStats
from routing_replay.producer.resend import ReplayBuffer
from routing_replay.protocol import wire

L, K = 2, 2
ROW = L * K * 2
EPOCH = 7
BROKER_EPOCH = 100


def settings(**kw) -> SenderSettings:
    base = dict(endpoint="inproc://none", producer_id="p", epoch=EPOCH, geometry=Geometry(L, K, 0, L),
                row_bytes=ROW, heartbeat_interval_s=1.0, resend_timeout_s=5.0, silence_warn_after_s=3.0,
                silence_warn_every_s=10.0, linger_ms=0, sndhwm=1000, curve_secret=None, server_key=None,
                replay_max_bytes=1 << 20, spill_max_bytes=0, max_queue_bytes=1 << 20)
    base.update(kw)
    return SenderSettings(**base)


class Rig:
    """An Intake with its queue, ledger, book, resend buffer and stats, driven as the socket loop drives it."""

    def __init__(self, **kw):
        self.q = Inbox()
        self.ledger = QueueLedger(threading.Lock())
        self.book = RequestBook()
        self.replay = ReplayBuffer(kw.pop("replay_max_bytes", 1 << 20))
        self.stats = ProducerStats()
        self.it = Intake(settings(**kw), self.q, self.ledger, self.book, self.replay, self.stats, 0.0)

    def put(self, item, nbytes: int = 0):
        self.ledger.put(nbytes, None)
        self.q.put(item)

    def take(self, now: float = 0.0):
        assert self.it.take(None, now) is None

    def send_all(self, now: float = 0.0) -> list:
        """Every message the loop would send now, as decoded headers and their other frames (as bytes)."""
        out = []
        self.it.tick(now)
        if self.it.link.hello_due:
            out.append((wire.decode_header(self.it.control("hello", now)[0]), []))
            self.it.hello_sent(now)
        while (e := self.it.next_to_send(now)) is not None:
            frames = self.it.frames(e)
            out.append((wire.decode_header(frames[0]), [bytes(f) for f in frames[1:]]))
            self.it.sent(e, now)
        return out

    def reply(self, kind: str, body: dict, now: float = 0.0, epoch: int = BROKER_EPOCH):
        self.it.on_reply(wire.pack_header(kind, "broker", epoch, 0, "p", body), now)


def rows(n: int, base: int = 0) -> np.ndarray:
    return (np.arange(n * L * K, dtype=np.int16) + base).reshape(n, L, K)


def open_item(rid: str, prompt_len: int = 4) -> Announce:
    return Announce("open", rid, {"prompt_len": prompt_len, "num_cached": 0, "num_layers": L, "top_k": K,
                                  "layer_ids": list(range(L))}, [])


def test_items_queued_together_leave_as_announces_and_one_coalesced_delta_with_exact_frames():
    r = Rig()
    r.put(open_item("a"))
    a1, a2 = rows(2), rows(1, 100)
    r.put(Step(["a"], [0], [2], a1, None), 2 * ROW)
    r.put(Step(["a"], [2], [1], a2, None), ROW)
    r.take()
    assert len(r.replay) == 2 and r.ledger.msgs == 0 and r.ledger.bytes == 0
    sent = r.send_all()
    assert [(h.kind, h.seq, h.key) for h, _ in sent] == [("hello", 0, "p"), ("open", 1, "a"), ("delta", 2, ["a", "a"])]
    h, payload = sent[2]
    d = wire.parse_delta(h)
    assert d.starts.tolist() == [0, 2] and d.counts.tolist() == [2, 1]
    assert payload == [a1.tobytes(), a2.tobytes()]                  # one frame per step, as handed over
    assert sent[0][0].body == {"unacked_from": 1}
    assert (r.stats.sent_msgs, r.stats.sent_bytes, r.stats.resent_msgs) == (2, 3 * ROW, 0)


def test_an_ack_releases_the_acked_messages_and_a_new_broker_epoch_resends_the_rest():
    r = Rig()
    r.put(open_item("a"))
    r.put(Step(["a"], [0], [1], rows(1), None), ROW)
    r.put(Step(["a"], [1], [1], rows(1, 50), None), ROW)
    r.take()
    assert [h.seq for h, _ in r.send_all(10.0)] == [0, 1, 2]        # hello, then open and the merged delta
    assert r.stats.merged_steps == 2
    r.reply("heartbeat", {"consumers": 1, "takes": wire.TAKES})
    r.reply("ack", wire.producer_ack_body(wire.ProducerAck(EPOCH, 1)))
    assert len(r.replay) == 1 and r.stats.acked_msgs == 1 and r.stats.broker_epochs == 1
    r.reply("ack", wire.producer_ack_body(wire.ProducerAck(EPOCH + 1, 2)))      # another producer epoch's: ignored
    assert len(r.replay) == 1
    r.reply("heartbeat", {"consumers": 1, "takes": wire.TAKES}, epoch=BROKER_EPOCH + 1)    # a new broker
    assert r.stats.rewinds == 1 and r.stats.broker_epochs == 2
    again = r.send_all(11.0)                                        # a hello, then everything unacknowledged
    assert [(h.kind, h.seq) for h, _ in again] == [("hello", 0), ("delta", 2)] and r.stats.resent_msgs == 1
    assert again[0][0].body == {"unacked_from": 2}


def test_a_refused_delta_reports_its_positions_in_the_finish_held_behind_it():
    r = Rig()
    r.put(open_item("a"))
    r.put(Step(["a"], [0], [3], rows(3), None), 3 * ROW)
    r.take()
    r.put(Announce("finish", "a", {"num_output": 1, "reason": "stop"}, []))
    r.take()
    assert len(r.replay) == 3                                       # nothing sent yet: no broker answered
    r.reply("error", wire.refusal_body(wire.Refusal("bad rows", 2, EPOCH)))
    assert (r.stats.refused_by_broker, r.stats.errors_from_broker) == (1, 1)
    fin = r.replay.get(3)
    assert wire.decode_header(r.replay.frames(fin)[0]).body == {
        "num_output": 1, "reason": "stop", "lost": [[0, 3]], "broker_refused": [[0, 3]]}
    r.reply("error", wire.refusal_body(wire.Refusal("bad open", 1, EPOCH)))
    assert r.book.is_refused("a")                                   # later parts of a are dropped
    r.put(Step(["a"], [3], [1], rows(1), None), ROW)
    r.take()
    assert len(r.replay) == 3 and r.stats.dropped_parts == 1


def test_a_broker_that_stops_taking_opens_gets_each_held_opens_entry_as_its_own_open():
    r = Rig()
    r.reply("heartbeat", {"consumers": 1, "takes": [wire.FEATURE_OPENS]})
    assert r.it.broker_takes_opens and not r.it.broker_takes_finishes
    for rid in ("a", "b", "c"):
        r.put(open_item(rid))
    r.take()
    assert [e.parts.kind for e in r.replay] == ["opens"] and r.stats.opens_msgs == 1
    r.reply("heartbeat", {"consumers": 1})                          # the same epoch, no `takes` any more
    assert not r.it.broker_takes_opens
    assert [(e.seq, e.parts.kind, tuple(e.parts.request_ids)) for e in r.replay] == [
        (1, "open", ("a",)), (2, "open", ("b",)), (3, "open", ("c",))]
    assert r.stats.unbatched_msgs == 1
    sent = r.send_all()
    assert [(h.kind, h.seq, h.key) for h, _ in sent] == [("hello", 0, "p"), ("open", 1, "a"), ("open", 2, "b"),
                                                         ("open", 3, "c")]
    assert sent[2][0].body == open_item("b").body


def test_connection_events_hold_data_until_the_hello_after_a_reconnect():
    r = Rig()
    r.it.on_connected(0.0)
    r.put(open_item("a"))
    r.take()
    assert [h.kind for h, _ in r.send_all()] == ["hello", "open"]
    r.it.on_disconnected(1.0)                                       # the next broker may be a new one
    r.put(open_item("b"))
    r.take(1.0)
    assert [h.kind for h, _ in r.send_all(1.0)] == ["hello"]        # (a socket with no connection refuses it)
    assert r.it.link.data_held(5000.0)                              # no data until a broker answered
    r.it.on_connected(2.0)                                          # reconnected: hello first, then data
    assert r.it.link.hello_due
    assert [h.kind for h, _ in r.send_all(2.0)] == ["hello"] and r.it.link.state is LinkState.AWAITING_REPLY
    r.reply("ack", wire.producer_ack_body(wire.ProducerAck(EPOCH, 1)), now=2.1)
    assert r.it.link.state is LinkState.STREAMING and len(r.replay) == 1
    assert [(h.kind, h.key) for h, _ in r.send_all(2.1)] == [("open", "b")]


def test_a_bad_reply_is_counted_and_changes_nothing():
    r = Rig()
    r.put(open_item("a"))
    r.take()
    r.it.on_reply(b"\x00garbage", 0.0)
    r.reply("ack", {"epoch": EPOCH, "upto": "x"})
    assert r.stats.bad_replies == 2 and len(r.replay) == 1 and r.stats.acked_msgs == 0


def test_closing_waits_for_the_acks_then_says_bye():
    r = Rig()
    r.put(open_item("a"))
    r.put(STOP)
    r.take()
    assert r.it.stopping
    r.send_all()
    assert not r.it.closing_done(0.1)                               # sent, not acked, nobody answered yet
    assert r.it.closing_done(0.6)                                   # a peer silent for 0.5 s speaks no acks
    r.reply("heartbeat", {"consumers": 1}, now=0.7)
    assert not r.it.closing_done(0.7) and not r.it.bye_due()
    r.reply("ack", wire.producer_ack_body(wire.ProducerAck(EPOCH, 1)), now=0.8)
    assert r.it.closing_done(0.8) and r.it.bye_due()
    assert wire.decode_header(r.it.control("bye", 0.8)[0]).body == {}
    assert Rig().it.closing_done(5.0, deadline=5.0)                 # the deadline ends it whatever is held


def test_an_unanswered_resend_timeout_rewinds_and_doubles():
    r = Rig(resend_timeout_s=1.0)
    r.reply("heartbeat", {"consumers": 1}, now=10.0)
    r.put(open_item("a"))
    r.take(10.0)
    assert [h.kind for h, _ in r.send_all(10.0)] == ["hello", "open"]
    r.it.check(10.5)
    assert r.stats.rewinds == 0
    r.it.check(11.1)                                                # no ack for longer than 1 s: everything again
    assert r.stats.rewinds == 1
    assert [(h.kind, h.seq) for h, _ in r.send_all(11.1)] == [("hello", 0), ("open", 1)]
    assert r.stats.resent_msgs == 1
    r.it.check(12.5)                                                # the timeout doubled: 2 s from 11.1
    assert r.stats.rewinds == 1
    r.it.check(13.2)
    assert r.stats.rewinds == 2


@pytest.mark.parametrize("why", ["queue", "refused"])
def test_a_step_whose_rows_fail_is_left_out_and_its_positions_go_in_the_finish(why):
    class Broken:
        shape, dtype = (2, L, K), np.dtype(np.int16)
        released = 0

        def result(self):
            from routing_replay.producer.handover import RowsLost
            raise RowsLost("ring full") if why == "queue" else RuntimeError("stale rows")

        def release(self):
            Broken.released += 1

    from routing_replay.producer.handover import deferred_rows
    r = Rig()
    r.put(open_item("a"))
    r.take()
    r.put(Step(["a"], [0], [2], deferred_rows(Broken()), None), 2 * ROW)
    r.take()
    r.put(Announce("finish", "a", {"num_output": 1, "reason": "stop"}, []))
    r.take()
    assert [e.parts.kind for e in r.replay] == ["open", "finish"] and Broken.released == 1
    assert r.stats.encode_errors == 1 and r.ledger.bytes == 0
    body = wire.decode_header(r.replay.frames(r.replay.get(2))[0]).body
    want = {"num_output": 1, "reason": "stop", "lost": [[0, 2]]}
    if why == "refused":
        want["refused"] = [[0, 2]]
    assert body == want
