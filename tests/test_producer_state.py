"""The producer's socket-free parts on bytes alone: replay buffer and spill, connection state machine, silence
watch, message encoding and the per-request books."""

from __future__ import annotations

import math
import queue
import threading

import numpy as np
import pytest

from routing_replay.producer.connection import Answer, Link, LinkEvent, LinkState, Silence, SilenceWatch
from routing_replay.producer.books import RequestBook, Screen, escaped_id, with_lost
from routing_replay.producer.encode import Geometry, encode_announce, encode_step, kept_rows
from routing_replay.producer.handover import deferred_rows
from routing_replay.producer.inbox import Inbox
from routing_replay.producer.items import Announce, Step
from routing_replay.producer.resend import Parts, ReplayBuffer, Spill, SpillRef
from routing_replay.protocol import wire

OPEN = Parts("open", ("a",))


def frames(n: int, tag: int) -> list:
    return [bytes([tag]) * 10, bytes([tag + 1]) * (n - 10)]


# ---- replay buffer --------------------------------------------------------------------------------------------

def test_replay_holds_contiguous_seqs_and_releases_a_prefix_on_ack():
    r = ReplayBuffer(mem_bound=1000)
    es = [r.add(OPEN, frames(100, i), payload=90) for i in range(5)]
    assert [e.seq for e in es] == [1, 2, 3, 4, 5] and r.next_seq == 6
    assert (len(r), r.mem_bytes, r.never_sent, r.first_unacked, r.pending()) == (5, 500, 5, 1, 5)
    assert r.get(3) is es[2] and r.get(0) is None and r.get(6) is None
    assert [e.seq for e in r.after(3)] == [4, 5]
    assert r.ack(2) == (2, 2)                         # acked before sent: counted, never_sent follows
    assert (len(r), r.mem_bytes, r.never_sent, r.first_unacked) == (3, 300, 3, 3)
    assert r.get(2) is None and r.get(3) is es[2] and es[0].frames is None
    assert r.ack(1) == (0, 0)
    assert r.ack(10) == (3, 3) and (len(r), r.mem_bytes, r.first_unacked, r.pending()) == (0, 0, 6, 0)


def test_replay_send_cursor_rewinds_to_the_first_unacked():
    r = ReplayBuffer(mem_bound=1 << 20)
    for i in range(4):
        r.add(OPEN, frames(20, i), 0)
    sent = []
    while (e := r.next_to_send()) is not None:
        assert r.mark_sent(e, now=1.0) is True
        sent.append(e.seq)
    assert sent == [1, 2, 3, 4] and r.never_sent == 0 and r.pending() == 0
    r.ack(2)
    r.rewind()
    assert r.pending() == 2
    e = r.next_to_send()
    assert e.seq == 3 and r.mark_sent(e, now=2.0) is False and e.sent_at == 2.0
    r.add(OPEN, frames(20, 9), 0)                      # new entries join behind the cursor
    assert [r.next_to_send().seq, r.pending()] == [4, 2]
    r.ack(4)                                           # acked entries are skipped by the cursor
    assert r.next_to_send().seq == 5


def test_replay_spills_past_the_memory_bound_and_reads_back_exact_bytes(tmp_path):
    spill = Spill(tmp_path, "prod-\udc80")             # an id with no UTF-8 encoding still names a directory
    r = ReplayBuffer(mem_bound=250, spill=spill, spill_bound=250)
    es = [r.add(OPEN, frames(100, 2 * i), 0) for i in range(5)]
    assert [e.spill is not None for e in es] == [False, False, True, True, True]
    assert (r.mem_bytes, r.spilled_bytes, r.has_room()) == (200, 300, True)   # memory below its bound
    assert es[3].spill == SpillRef(0, 100, (10, 90))
    assert [bytes(f) for f in r.frames(es[3])] == frames(100, 6)
    r.ack(3)
    assert (r.mem_bytes, r.spilled_bytes, r.has_room()) == (0, 200, True)
    r.close()
    assert not spill.dir.exists()


def test_spill_rolls_segments_and_deletes_acked_ones(tmp_path):
    s = Spill(tmp_path, "p")
    s.SEGMENT_BYTES = 100
    refs = [s.write([b"x" * 60]) for _ in range(4)]
    assert [r.segment for r in refs] == [0, 0, 1, 1] and s.segments == 2
    s.release(refs[0])
    s.release(refs[1])
    assert s.segments == 1 and not (s.dir / "00000000.seg").exists() and s.bytes == 120
    assert s.read(refs[3]) == [b"x" * 60]
    s.close()


def test_replace_frames_of_a_never_sent_entry_keeps_the_accounting(tmp_path):
    r = ReplayBuffer(mem_bound=150, spill=Spill(tmp_path, "p"), spill_bound=1000)
    a = r.add(OPEN, frames(100, 0), 0)
    b = r.add(OPEN, frames(100, 2), 0)                 # spilled
    r.replace_frames(b, frames(30, 4))
    assert (b.spill, b.nbytes, r.mem_bytes, r.spilled_bytes) == (None, 30, 130, 0)
    r.mark_sent(a, 1.0)
    with pytest.raises(ValueError, match="seq 1 was sent already"):
        r.replace_frames(a, frames(30, 4))
    r.close()


# ---- connection ------------------------------------------------------------------------------------------------

def test_link_starts_greeting_and_streams_after_the_hello():
    k = Link(hold_s=1.0)
    assert (k.state, k.hello_due, k.data_held(0.0)) == (LinkState.GREETING, True, False)
    assert k.move(LinkEvent.HELLO_SENT, 0.0) is LinkState.STREAMING and not k.hello_due


def test_link_holds_data_after_a_disconnect_until_the_broker_answers():
    k = Link(hold_s=1.0)
    k.move(LinkEvent.HELLO_SENT, 0.0)
    assert k.move(LinkEvent.DISCONNECTED, 5.0) is LinkState.OFFLINE and k.hold_until == math.inf
    assert k.hello_due and k.data_held(1e9)
    assert k.move(LinkEvent.TICK, 1e9) is LinkState.OFFLINE          # no deadline while disconnected
    assert k.move(LinkEvent.RECONNECTED, 10.0) is LinkState.OFFLINE and k.hold_until == 11.0
    assert k.move(LinkEvent.HELLO_SENT, 10.1) is LinkState.AWAITING_REPLY
    assert not k.hello_due and k.data_held(10.5) and not k.data_held(11.0)
    assert k.move(LinkEvent.HEARD, 10.2) is LinkState.STREAMING and k.hold_until == 0.0


def test_link_hold_ends_at_its_deadline_without_an_answer():
    k = Link(hold_s=1.0)
    k.move(LinkEvent.RECONNECTED, 10.0)
    assert k.move(LinkEvent.TICK, 10.5) is LinkState.OFFLINE
    assert k.move(LinkEvent.TICK, 11.0) is LinkState.GREETING          # hello still first, data may follow
    k.move(LinkEvent.RECONNECTED, 20.0)
    k.move(LinkEvent.HELLO_SENT, 20.0)
    assert k.move(LinkEvent.TICK, 21.0) is LinkState.STREAMING


def test_link_heard_while_offline_and_rewinds():
    k = Link(hold_s=1.0)
    k.move(LinkEvent.DISCONNECTED, 0.0)
    assert k.move(LinkEvent.HEARD, 0.1) is LinkState.GREETING            # a reply still queued: hello still due
    k.move(LinkEvent.HELLO_SENT, 0.2)
    assert k.move(LinkEvent.REWIND, 0.3) is LinkState.GREETING and not k.data_held(0.3)
    k.move(LinkEvent.RECONNECTED, 1.0)
    k.move(LinkEvent.HELLO_SENT, 1.0)
    assert k.move(LinkEvent.REWIND, 1.1) is LinkState.OFFLINE and k.hold_until == 2.0


def test_silence_watch_reports_after_the_delay_then_periodically_then_the_answer():
    w = SilenceWatch(warn_after_s=3.0, warn_every_s=10.0, started=100.0)
    assert w.due(200.0) is None                      # nothing asked: nothing to report
    w.asked(100.0)
    w.asked(101.0)                                   # the silence counts from the first question
    assert w.due(102.9) is None
    assert w.due(103.0) == Silence(3.0, 1)
    assert w.due(112.9) is None and w.due(113.0) == Silence(13.0, 2)
    assert w.heard(114.0) == Answer(True, 14.0)      # the first answer ever
    w.asked(120.0)
    assert w.heard(121.0) is None                    # answered in time: nothing to say
    w.asked(130.0)
    assert w.due(133.5) == Silence(3.5, 1)
    assert w.heard(134.0) == Answer(False, 4.0)      # the end of a reported silence


# ---- messages --------------------------------------------------------------------------------------------------

G = Geometry(num_layers=2, top_k=2, layer_lo=0, layer_hi=2)


def test_encode_step_cuts_refused_parts_after_the_deferred_result():
    data = np.arange(6 * 2 * 2, dtype=np.int16).reshape(6, 2, 2)

    class Deferred:
        released = 0
        shape, dtype = data.shape, data.dtype

        def result(self):
            return data

        def release(self):
            Deferred.released += 1

    enc = encode_step(Step(["a", "bad", "c"], [0, 5, 9], [2, 3, 1], deferred_rows(Deferred()), [True, False, True]), "p", 7, 4, G)
    h = wire.decode_header(enc.frames[0])
    d = wire.parse_delta(h)
    assert (h.kind, h.producer, h.epoch, h.seq, h.key) == ("delta", "p", 7, 4, ["a", "c"])
    assert d.starts.tolist() == [0, 9] and d.counts.tolist() == [2, 1]
    assert bytes(enc.frames[1]) == np.concatenate([data[0:2], data[5:6]]).tobytes() and enc.payload == 24
    assert enc.parts == Parts("delta", ["a", "c"], [0, 9], [2, 1]) and Deferred.released == 1


def test_encode_step_releases_the_slot_when_the_result_fails():
    class Broken:
        released = 0
        shape, dtype = (1, 2, 2), np.dtype(np.int16)

        def result(self):
            raise RuntimeError("copy failed")

        def release(self):
            Broken.released += 1

    with pytest.raises(RuntimeError, match="copy failed"):
        encode_step(Step(["a"], [0], [1], deferred_rows(Broken())), "p", 7, 1, G)
    assert Broken.released == 1


def test_encode_announce_and_with_lost():
    toks = np.array([5, 6, 7], dtype=np.int32)
    item = Announce("finish", "a", {"num_output": 3, "reason": "stop", "lost": [[0, 2]]}, [toks])
    enc = encode_announce(with_lost(item, [[4, 6]]), "p", 9, 12)
    h = wire.decode_header(enc.frames[0])
    assert (h.kind, h.seq, h.key, h.body["lost"]) == ("finish", 12, "a", [[0, 2], [4, 6]])
    assert bytes(enc.frames[1]) == toks.tobytes() and enc.parts == Parts("finish", ("a",))
    assert item.body["lost"] == [[0, 2]]                                  # the original is untouched
    assert kept_rows(np.arange(4), [1, 2, 1], [False, False, False]).tolist() == []


def test_escaped_id_is_printable_and_bounded():
    assert escaped_id("req-\udc80") == "'req-\\udc80'"
    assert escaped_id(7) == "<int> 7"
    long = escaped_id("é" * 500, limit=20)
    assert long.startswith("'\\xe9\\xe9") and long.endswith("... (2002 characters escaped)")


def test_request_book_screens_refuses_and_reports_lost():
    b = RequestBook(known_limit=3)
    assert b.screen(["a", "b"]) == Screen(None, 0)
    assert b.screen(["a", "\udc80", 5, ["x"]]) == Screen([True, False, False, False], 3)
    b.add_lost(["a", "b"], [0, 4], [2, 2])
    b.refuse("b")
    assert b.is_refused("b") and b.any_refused and b.problem("b") == "refused"
    assert b.screen(["a", "b"]) == Screen([True, False], 1)
    assert b.ended("b") == (True, None) and not b.is_refused("b")
    assert b.ended("a") == (False, [[0, 2]]) and b.ended("a") == (False, None)
    b.refuse("c")
    b.opened("c")                                    # a new open of the same id starts over
    assert not b.is_refused("c")
    for rid in ("d", "e", "f", "g"):                 # the known-id cache stays bounded
        b.opened(rid)
    assert len(b._known) <= 3


def test_replay_is_full_when_memory_and_spill_reach_their_bounds(tmp_path):
    r = ReplayBuffer(mem_bound=200, spill=Spill(tmp_path, "p"), spill_bound=200)
    for i in range(4):
        r.add(OPEN, frames(100, 2 * i), 0)
    assert (r.mem_bytes, r.spilled_bytes, r.has_room()) == (200, 200, False)
    r.ack(3)
    assert (r.mem_bytes, r.spilled_bytes, r.has_room()) == (0, 100, True)
    r.close()
    assert not ReplayBuffer(mem_bound=100).add(OPEN, frames(100, 0), 0).spill and not ReplayBuffer(0).has_room()


def test_inbox_wakes_the_thread_only_for_items_put_with_wake_and_keeps_their_order():
    """Opens, finishes and aborts (wake=False) wait in the FIFO without waking the producer's thread; the next step
    (wake=True) wakes it and it takes them in the order they were put."""
    inbox = Inbox()
    got: list = []
    waiter = threading.Thread(target=lambda: got.append(inbox.get(timeout=30)))
    waiter.start()
    inbox.put("open a", wake=False)
    inbox.put("finish b", wake=False)
    waiter.join(0.5)
    assert waiter.is_alive() and got == []              # not woken by either
    inbox.put("step 1")
    waiter.join(10)
    assert not waiter.is_alive() and got == ["open a"]
    assert [inbox.get_nowait(), inbox.get_nowait()] == ["finish b", "step 1"]
    with pytest.raises(queue.Empty):
        inbox.get_nowait()
    # wake-ups for items already taken are dropped on the next wait: it returns what is there, or nothing
    for i in range(3):
        inbox.put(f"step {i + 2}")
    assert [inbox.get(timeout=0), inbox.get(timeout=0), inbox.get(timeout=0)] == ["step 2", "step 3", "step 4"]
    with pytest.raises(queue.Empty):
        inbox.get(timeout=0.01)
    inbox.put("abort c", wake=False)
    assert len(inbox) == 1 and inbox.get(timeout=0) == "abort c"   # a waiting item is taken without a wake-up
    inbox.put("open d", wake=False)
    inbox.wake()                                        # flush/close: what waits goes now
    assert inbox.get(timeout=30) == "open d"


# ---- a step too large for one delta -----------------------------------------------------------------------------

def _joined(parts: list) -> dict:
    """{request id: {position: row}} of split parts, checking that no position comes twice."""
    got: dict = {}
    for part in parts:
        at = 0
        for rid, s, c in zip(part.request_ids, part.starts, part.counts):
            for j in range(c):
                assert s + j not in got.setdefault(rid, {}), (rid, s + j)
                got[rid][s + j] = part.rows[at + j]
            at += c
        assert at == len(part.rows)
    return got


def test_a_step_too_large_for_one_delta_is_cut_into_parts_that_each_fit_and_together_are_the_step():
    from routing_replay.producer.encode import ENTRY_HEADER_BOUND, oversized, split_step

    ids = ["a", "bb" * 30, "c", "d" * 200, "e"]
    starts, counts = [0, 5, 0, 7, 3], [7, 3, 0, 11, 9]
    rows = np.arange(30 * 2 * 2, dtype=np.int16).reshape(30, 2, 2)
    want = _joined([Step(ids, starts, counts, rows)])
    for max_rows, max_entries, budget in ((4, 100, 10 ** 6), (100, 2, 10 ** 6), (100, 100, 3 * ENTRY_HEADER_BOUND + 250),
                                          (5, 3, 900), (30, 5, 10 ** 6)):     # rows, entries, header, all, none
        parts = split_step(Step(ids, starts, counts, rows), max_rows, max_entries, budget)
        got = _joined(parts)
        assert got.keys() == want.keys() and all(
            got[k].keys() == want[k].keys() and all(np.array_equal(got[k][p], want[k][p]) for p in want[k])
            for k in want), (max_rows, max_entries, budget)
        for part in parts:
            assert len(part.rows) <= max_rows and len(part.request_ids) <= max_entries
            assert sum(4 * len(r) + ENTRY_HEADER_BOUND for r in part.request_ids) <= budget or \
                len(part.request_ids) == 1
            assert np.shares_memory(part.rows, rows) or len(part.rows) == 0
        # the entries in order, a request cut only where a part is full
        assert [r for p in parts for r in p.request_ids if r == "c"] == ["c"]
    assert len(split_step(Step(ids, starts, counts, rows), 30, 5, 10 ** 6)) == 1
    assert [len(p.rows) for p in split_step(Step(ids, starts, counts, rows), 4, 100, 10 ** 6)] == [4] * 7 + [2]
    assert oversized(31, ids, 30) and not oversized(30, ids, 30)
    assert oversized(1, ["x" * 1024] * 5000, 10) and not oversized(1, ["x" * 40] * 5000, 10)
    assert oversized(1, ["x"] * (wire.MAX_REQUESTS_PER_DELTA + 1), 10 ** 9)


def test_a_split_step_waits_for_deferred_rows_copies_them_out_before_releasing_and_cuts_refused_parts():
    from routing_replay.producer.encode import split_step
    from tests.standins import Slot

    rows = np.arange(12 * 2 * 2, dtype=np.int16).reshape(12, 2, 2)
    slot = Slot(rows.copy())
    parts = split_step(Step(["a", "b", "c"], [0, 0, 4], [5, 3, 4], deferred_rows(slot), keep=[True, False, True]), 4)
    assert slot.released == 1
    assert [(p.request_ids, p.starts, p.counts) for p in parts] == [(["a"], [0], [4]), (["a", "c"], [4, 4], [1, 3]),
                                                                   (["c"], [7], [1])]
    np.testing.assert_array_equal(np.concatenate([p.rows for p in parts]), np.concatenate([rows[:5], rows[8:]]))
    slot = Slot(rows.copy())
    parts = split_step(Step(["a", "b"], [0, 0], [5, 7], deferred_rows(slot)), 8)
    np.testing.assert_array_equal(np.concatenate([p.rows for p in parts]), rows)   # copied before the release
    assert slot.released == 1

    class Broken(Slot):
        def result(self):
            raise RuntimeError("device copy failed")

    broken = Broken(rows.copy())
    with pytest.raises(RuntimeError, match="device copy failed"):
        split_step(Step(["a"], [0], [12], deferred_rows(broken)), 4)
    assert broken.released == 1
    with pytest.raises(ValueError, match="counts add up to 13 rows"):
        split_step(Step(["a"], [0], [13], rows), 4)
