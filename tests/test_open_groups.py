"""Requests opened together, owned together: a small `opens` message's requests all go to one consumer (the hash of
its first request's id), so a step's new requests (a GRPO group) and their rows, finishes and records travel whole,
unsplit; and after a broker restart each consumer claims back the requests it holds (`claim` -> `holds`), so no
request depends on its own hash to stay where it is.

The ownership table's rules (socket-free); the broker on real sockets with stand-in consumers (what goes where, what
a consumer of an earlier version gets); and a real broker restarted under real consumers and a real producer,
records compared bit for bit.
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import pytest
import zmq

from routing_replay.broker import Broker
from routing_replay.broker.ownership import Ownership, rendezvous
from routing_replay.consumer import Consumer
from routing_replay.producer import Producer
from routing_replay.protocol import wire
from tests.procs import wait_until
from tests.test_broker import broker_net, recv
from tests.test_opens import _opens

L, K = 4, 2
CIDS = [b"c1", b"c2"]


def _hash(rid: str) -> bytes:
    return rendezvous(rid.encode(), CIDS)


def ids_hashed(owner: bytes, n: int, prefix: str) -> list[str]:
    return [r for r in (f"{prefix}{i}" for i in range(1000)) if _hash(r) == owner][:n]


class _Link:
    def __init__(self, cid):
        self.cid, self.alive = cid, True


def _table():
    links = {c: _Link(c) for c in CIDS}
    own = Ownership(1 << 20)
    own.set_live(links)
    return own, links


# ---- the table ----------------------------------------------------------------------------------------------------

def test_a_new_request_goes_to_the_preferred_link_and_an_owned_or_closing_one_stays_put():
    own, links = _table()
    c1, c2 = links[b"c1"], links[b"c2"]
    a, b = ids_hashed(b"c1", 1, "a")[0], ids_hashed(b"c2", 2, "b")
    assert own.hashed(a) is c1 and own.hashed(b[0]) is c2 and len(own) == 0       # hashed() assigns nothing
    assert own.owner_of(b[0], c1).link is c1                   # new: the group's owner, not its own hash
    assert own.owner_of(b[0], c2).link is c1                   # owned: stays
    assert own.owner_of(b[1]).link is c2                       # no preference: its hash
    own.close(b[1], "p", 5)                                    # closing until seq 5 is acked ...
    assert own.owner_of(b[1], c1).link is c2                   # ... a resend reopens it where it was
    assert own.owned_by(c1) == 1 and own.owned_by(c2) == 1


def test_a_claim_takes_what_no_live_link_owns_and_refuses_the_rest():
    own, links = _table()
    c1, c2 = links[b"c1"], links[b"c2"]
    own.owner_of("mine", c1)
    own.owner_of("theirs", c2)
    own.owner_of("orphan", c2)
    own.owner_of("closing", c2)
    own.close("closing", "p", 9)
    c2.alive = False                                          # c2 lost: "orphan" and "theirs" have no live owner
    c3 = _Link(b"c3")
    own.set_live({b"c1": c1, b"c3": c3})
    own.owner_of("taken", c3)
    assert own.claim(["mine", "orphan", "fresh", "taken", "closing"], c1) == (2, 2)
    assert [own.owner[r] for r in ("mine", "orphan", "fresh", "taken")] == [c1, c1, c1, c3]
    assert own.owned_by(c1) == 3 and own.owned_by(c2) == 1    # "theirs" stays on the lost link until it moves
    assert own.claim(["mine"], c1) == (0, 0)                  # its own: nothing to do


# ---- the broker on real sockets -----------------------------------------------------------------------------------

HOLDS = {"takes": wire.CONSUMER_TAKES}
OLD = {"takes": [wire.FEATURE_OPENS, wire.FEATURE_FINISHES]}     # a consumer that does not answer `claim`


@contextmanager
def _net(hellos: dict, **kw):
    gen = broker_net("inproc://gf", "inproc://gb", hellos, **kw)
    b, prod, cons, _ = next(gen)
    try:
        yield b, prod, cons
    finally:
        gen.close()


@pytest.mark.parametrize("group_max,hellos,grouped", [
    (16, {b"c1": HOLDS, b"c2": HOLDS}, True),
    (0, {b"c1": HOLDS, b"c2": HOLDS}, False),     # --open-group-max 0: each request by its own hash
    (16, {b"c1": HOLDS, b"c2": OLD}, False),      # a consumer of an earlier version is live: no grouping
])
def test_a_small_opens_goes_whole_to_the_owner_of_its_first_request(group_max, hellos, grouped):
    with _net(hellos, open_group_max=group_max) as (b, prod, cons):
        first = ids_hashed(b"c1", 1, "g")[0]
        rest = ids_hashed(b"c2", 3, "h")                         # their own hashes: the other consumer
        ids = [first, *rest]
        prod.send_multipart(_opens(ids, [8] * 4, [0] * 4, seq=1))
        h, _ = recv(cons[b"c1"])
        if grouped:
            assert (h.kind, h.key) == ("opens", ids)             # the message as received, one owner
            assert not cons[b"c2"].poll(100)
            assert [b.ownership.owner[r].cid for r in ids] == [b"c1"] * 4
            assert b.stats.opens_grouped == 1
        else:
            assert (h.kind, h.key) == ("opens", [first])
            got = []
            while cons[b"c2"].poll(500):
                hh, _ = recv(cons[b"c2"])
                got += hh.key if hh.kind == "opens" else [hh.key]
            assert got == rest and b.stats.opens_grouped == 0
        # an opens larger than the group bound is spread request by request, whatever the setting
        big = [f"big{i}" for i in range(17)]
        prod.send_multipart(_opens(big, [8] * 17, [0] * 17, seq=2))
        wait_until(lambda: all(r in b.ownership.owner for r in big), 5, "big opens routed")
        assert [b.ownership.owner[r].cid for r in big] == [_hash(r) for r in big]
        # the rows of the grouped requests then go to their owner unsplit
        rows = np.arange(4 * L * K, dtype=np.int16).reshape(4, L, K)
        head = wire.pack_header("delta", "p", 3, 3, ids, wire.delta_body([0] * 4, [1] * 4, L, K))
        split0, out0 = b.stats.deltas_split, b.stats.msgs_out
        prod.send_multipart([head, rows.tobytes()])
        wait_until(lambda: b.stats.msgs_out >= out0 + (1 if grouped else 2), 5, "delta routed")
        assert (b.stats.deltas_split - split0) == (0 if grouped else 1)


def test_a_consumer_that_knew_an_earlier_broker_is_asked_what_it_holds_and_keeps_it():
    # c1 got data from broker epoch 12345 (not this one): a restart; it answers `claim` with `holds`
    with _net({b"c1": {**HOLDS, "broker": 12345}, b"c2": {**HOLDS, "broker": 12345},
               b"old": {**OLD, "broker": 12345}}, restart_grace_ms=400) as (b, prod, cons):
        for cid in (b"c1", b"c2"):
            h, frames = recv(cons[cid])
            assert (h.kind, h.epoch, frames) == ("claim", b.epoch, [])
        assert not cons[b"old"].poll(100) and b.stats.claims_out == 2      # an earlier consumer is not asked
        held = [f"held{i}" for i in range(5)]                    # whatever their hashes: c1 holds them
        cons[b"c1"].send(wire.pack_header("holds", "c1", 0, 1, held, {}))
        cons[b"c2"].send(wire.pack_header("holds", "c2", 0, 1, [held[0]], {}))     # claimed by c1 first
        cons[b"c2"].send(wire.pack_header("holds", "c2", 99, 2, ["stale"], {}))    # not its link's epoch
        cons[b"c2"].send(wire.pack_header("holds", "c2", 0, 3, "not-a-list", {}))  # malformed: refused
        wait_until(lambda: b.stats.claims_refused == 1 and b.bad["bad_field"] == 1, 5, "holds read")
        assert b.stats.claimed == 5 and b.bad["stale_holds"] == 1 and "stale" not in b.ownership.owner
        assert all(b.ownership.owner[r].cid == b"c1" for r in held)
        # after the grace, their rows go to c1 (a delta in key order, as one message)
        rows = np.arange(5 * L * K, dtype=np.int16).reshape(5, L, K)
        prod.send_multipart([wire.pack_header("delta", "p", 3, 1, held, wire.delta_body([4] * 5, [1] * 5, L, K)),
                             rows.tobytes()])
        h, frames = recv(cons[b"c1"])
        assert (h.kind, h.key) == ("delta", held) and bytes(frames[0]) == rows.tobytes()
        others = []
        for cid in (b"c2", b"old"):
            while cons[cid].poll(100):
                others.append(wire.decode_header(cons[cid].recv_multipart()[0]).kind)
        assert others == ["error"]                               # c2's malformed holds, answered; no data



# ---- a real restart -----------------------------------------------------------------------------------------------

def test_a_group_whose_hashes_differ_stays_on_its_consumer_across_a_broker_restart(tmp_path):
    """Four requests opened in one `opens` (the first hashed to c1, the other three to c2) all go to c1; the broker
    is closed and a new one starts on the same endpoints; c1 claims them, so their later rows and finishes reach c1
    and every record is complete and bit-exact (without the claim, c2 would get the rest: two incomplete halves)."""
    fe, be = f"ipc://{tmp_path}/f", f"ipc://{tmp_path}/b"
    ctx = zmq.Context()
    got: dict = {}
    broker = Broker(fe, be, context=ctx, heartbeat_interval_ms=100).start()
    cons = [Consumer(be, consumer_id=c, context=ctx, heartbeat_interval_ms=100, finish_grace_s=0.0,
                     on_record=lambda r, c=c: got.__setitem__(r.request_id, (c, r))) for c in ("c1", "c2")]
    for c in cons:
        c.start()
    p = None
    try:
        wait_until(lambda: len(broker.ownership.live) == 2, 10, "consumers joined")
        p = Producer(fe, num_layers=L, top_k=K, context=ctx, linger_ms=0, heartbeat_interval_ms=100,
                     resend_timeout_ms=1000)
        p.open(ids_hashed(b"c2", 1, "warm")[0], prompt_len=1)    # c2 gets data from this broker too
        assert p.wait_acked(10)                  # (the producer has heard that the broker takes `opens`)
        ids = ids_hashed(b"c1", 1, "grp") + ids_hashed(b"c2", 3, "mem")
        assert p.open_many([(r, 4, 0, None, False) for r in ids]) == []
        rng = np.random.default_rng(3)
        routing = rng.integers(0, 64, (4, 6, L, K)).astype(np.int16)
        assert p.publish_rows(ids, [0] * 4, [3] * 4, routing[:, :3].reshape(-1, L, K).copy())
        assert p.wait_acked(10)
        assert [broker.ownership.owner[r].name for r in ids] == ["c1"] * 4
        broker.close()
        broker = Broker(fe, be, context=ctx, heartbeat_interval_ms=100, restart_grace_ms=1000).start()
        wait_until(lambda: broker.stats.claimed == 5 and broker.stats.claims_out == 2, 10, "c1 claimed its four")
        assert [broker.ownership.owner[r].name for r in ids] == ["c1"] * 4       # not their hashes: c2, c2, c2
        assert broker.stats.claims_refused == 0
        assert p.publish_rows(ids, [3] * 4, [3] * 4, routing[:, 3:].reshape(-1, L, K).copy())
        for r in ids:
            p.finish(r, num_output_tokens=3)     # 4 prompt rows and 2 generated: 6 positions
        wait_until(lambda: len(got) == 4, 20, "records")
        for i, r in enumerate(ids):
            c, rec = got[r]
            assert c == "c1" and rec.complete, (r, c, rec.reason, rec.missing)
            np.testing.assert_array_equal(rec.prompt_routed_experts, routing[i, :4])
            np.testing.assert_array_equal(rec.routed_experts[:2], routing[i, 4:])
            assert rec.routed_experts.shape == (3, L, K) and (rec.routed_experts[2] == -1).all()  # never computed
    finally:
        if p is not None:
            p.close()
        for c in cons:
            c.close()
        broker.close()
        ctx.term()
