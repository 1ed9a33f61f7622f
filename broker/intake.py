"""The broker's go-back-N bookkeeping: which seq of each producer it accepts next, which parts sent on each consumer
link are still unacked, and the ack frontier that joins the two (socket-free).

A producer's data message is accepted only in seq order (an earlier seq is a resend and accepted too; a later one
is a gap, dropped and answered with a rewind request). An accepted message becomes one `InFlight`; each part of it
sent on a consumer link is one entry of that link's `sent` queue, numbered by lseq. When a consumer acks lseq `upto`,
every part up to it is done; when the last part of a message is done, its seq is complete, and a producer's ack
frontier is the highest seq below which every seq is complete (a contiguous prefix, acked as `upto`). A message
refused for good (it can never be valid) completes with no part at all: the frontier passes it once everything
before it is acked.
"""

from __future__ import annotations

import enum
from collections import deque
from typing import Iterator

from routing_replay.protocol import wire

MAX_PRODUCERS = 4096
UNKNOWN_ASK_INTERVAL_S = 0.5          # at most one "say hello" rewind ask per unknown peer in this interval
MAX_UNKNOWN_PEERS = 10_000            # peers remembered for that rate limit before the memory is cleared
_NO_SEQ = 1 << 63


class Admission(enum.Enum):
    """What the intake does with a data message of a known producer, by its seq."""

    ACCEPT = "accept"     # the seq expected next: route it
    RESEND = "resend"     # an earlier seq (the producer went back): route it again
    HELD = "held"         # an earlier seq that already waits in the pending queue: drop this copy
    GAP = "gap"           # a later seq: one before it is missing; drop it and ask for a rewind


class InFlight:
    """Own one accepted data message until every part of it that went to a consumer was acked, or it was refused.

    `producer` is None once the message was refused (a part could not be sent, or its link was lost): acks of the
    parts already sent then complete nothing, and the producer resends the message.
    """

    __slots__ = ("parts", "producer", "seq")

    def __init__(self, producer: "ProducerIntake", seq: int):
        self.parts = 0                   # parts sent on consumer links and not acked yet
        self.producer: ProducerIntake | None = producer
        self.seq = seq

    @property
    def refused(self) -> bool:
        return self.producer is None

    def refuse(self) -> None:
        self.producer = None

    def __repr__(self) -> str:
        who = "refused" if self.producer is None else self.producer.pid[:64]
        return f"InFlight(seq={self.seq}, parts={self.parts}, producer={who})"


class ProducerIntake:
    """Own what the broker knows of one producer incarnation: the seq it accepts next, the ack frontier over the
    seqs completed so far, what was acked to the producer, and when it last asked the producer to rewind."""

    __slots__ = ("pid", "epoch", "ident", "next", "frontier", "done", "acked_sent", "last_seen", "nacked_at",
                 "nacked_for", "held", "plan", "hint_of", "hints_due")

    def __init__(self, pid: str, epoch: int, ident: bytes, unacked_from: int, now: float):
        self.pid = pid
        self.epoch = epoch
        self.ident = ident                  # its routing id on the frontend socket
        self.next = unacked_from            # the seq accepted next (anything lower is a resend)
        self.frontier = unacked_from - 1    # every seq <= frontier is done (applied everywhere it went)
        self.done: set = set()              # done seqs above frontier + 1
        self.acked_sent = self.frontier     # the highest upto acked to the producer
        self.last_seen = now
        self.nacked_at = -1e9
        self.nacked_for = -1                # `next` when the last rewind was asked (one ask per gap episode)
        self.held: set = set()              # seqs waiting in the pending queue
        self.plan = None                    # the split plan of its last delta (broker.split.Plan), reused while
                                            # its key list, counts and the ownership table stay the same
        self.hint_of: dict = {}             # request id -> the owner group told (or due to be told) to it
        self.hints_due: dict = {}           # request id -> owner group not sent yet (the next ack carries them)

    def admit(self, seq: int) -> Admission:
        """Decide on a data message by its seq; every decision but GAP makes `seq + 1` the next one expected."""
        nxt = self.next
        if seq == nxt:
            self.next = seq + 1
            return Admission.ACCEPT
        if seq > nxt:
            return Admission.GAP
        self.next = seq + 1
        return Admission.HELD if seq in self.held else Admission.RESEND

    def complete(self, seq: int) -> bool:
        """Mark `seq` done (every part applied, or refused for good); True if the frontier moved."""
        f = self.frontier
        if seq == f + 1:
            f = seq
            done = self.done
            if done:
                while f + 1 in done:
                    f += 1
                    done.discard(f)
            self.frontier = f
            return True
        if seq > f:
            self.done.add(seq)
        return False

    def go_back(self, seq: int) -> None:
        """Accept nothing after `seq` until `seq` itself comes again (a part of it, or of a later one, was lost)."""
        if seq < self.next:
            self.next = seq

    def unacked_from(self, u: int) -> bool:
        """The producer says (hello) that every seq below `u` was acked to it. True if that let seqs above it,
        completed before, join the frontier (an ack is then due)."""
        if u > self.next:                    # nothing is missing below u
            self.next = u
        if u - 1 <= self.frontier:
            return False
        self.frontier = u - 1
        self.done = {s for s in self.done if s >= u}
        if u in self.done:
            self.done.discard(u)
            return self.complete(u)
        return False

    def rewind_ask(self, now: float, min_interval_s: float, force: bool = False) -> wire.ProducerAck | None:
        """The ack that asks this producer to resend from its first unacked seq, or None if one was asked for the
        same gap less than `min_interval_s` ago (one ask per gap episode, again after a while)."""
        if not force and self.nacked_for == self.next and now - self.nacked_at < min_interval_s:
            return None
        self.nacked_for, self.nacked_at = self.next, now
        return wire.ProducerAck(self.epoch, self.frontier, rewind=True, expect=self.next)

    def ack_due(self) -> wire.ProducerAck | None:
        """The ack to send now (the frontier moved past what was acked), or None."""
        if self.frontier > self.acked_sent:
            return wire.ProducerAck(self.epoch, self.frontier)
        return None


class ConsumerLink:
    """Own the broker's side of one consumer incarnation: its link generation, its lseq numbering and the parts
    sent on it that it has not acked."""

    __slots__ = ("cid", "epoch", "gen", "lseq", "sent", "notices", "alive", "last_seen", "name", "num", "takes_opens",
                 "takes_finishes", "takes_holds")

    def __init__(self, cid: bytes, epoch: int, gen: int, now: float, num: int = 0):
        self.cid = cid                      # its routing id on the backend socket
        self.num = num                      # the owner group producers are told (a number per link object)
        self.epoch = epoch
        self.gen = gen
        self.lseq = 0                       # the last lseq sent in this generation
        self.sent: deque = deque()          # (lseq, InFlight or None), lseq increasing
        # the broker's own messages on this link not yet acked (`refused`, `abort`, a reassigned `open`), as
        # (lseq, header without its link number, payload frames): no producer resends them, so a resync does
        self.notices: deque = deque()
        self.alive = True
        self.last_seen = now
        self.name = cid.decode(errors="replace")
        self.takes_opens = False            # it said it takes `opens` (else it gets their entries as `open`s)
        self.takes_finishes = False         # and `finishes` (else `finish`es)
        self.takes_holds = False            # and answers a `claim` with `holds` (the requests it holds)

    def __repr__(self) -> str:
        return f"ConsumerLink({self.name!r}, epoch={self.epoch}, gen={self.gen}, lseq={self.lseq}, " \
               f"unacked={len(self.sent)}, alive={self.alive})"


class Hello(enum.Enum):
    """What a producer's hello did to the intake table."""

    JOINED = "joined"             # a producer (or producer incarnation) not known before
    KNOWN = "known"               # the current incarnation, same routing id
    RECONNECTED = "reconnected"   # the current incarnation, from a new routing id


class Intake:
    """Own the table of producer incarnations, the set whose ack frontier moved, and the rate limit of the rewind
    asks sent to peers that sent data without a hello."""

    def __init__(self, rewind_interval_s: float):
        self.producers: dict[str, ProducerIntake] = {}
        self.rewind_interval_s = rewind_interval_s
        self._dirty: set = set()
        self._asked_unknown: dict[bytes, float] = {}

    def __len__(self) -> int:
        return len(self.producers)

    def current(self, pid: str, epoch: int, ident: bytes) -> ProducerIntake | None:
        """The producer incarnation a data message claims to come from, if it said hello from that routing id."""
        ps = self.producers.get(pid)
        if ps is None or ps.epoch != epoch or ps.ident != ident:
            return None
        return ps

    def is_current(self, ps: ProducerIntake) -> bool:
        return self.producers.get(ps.pid) is ps

    def replaced_by(self, pid: str, epoch: int) -> ProducerIntake | None:
        """The incarnation that a hello with `epoch` replaces (None if none); ProtocolError if `epoch` is older."""
        ps = self.producers.get(pid)
        if ps is None or ps.epoch == epoch:
            return None
        if epoch < ps.epoch:
            raise wire.ProtocolError("stale_epoch", f"producer {pid[:64]!r} epoch {epoch} is older than its "
                                     f"current epoch {ps.epoch}")
        return ps

    def hello(self, pid: str, epoch: int, ident: bytes, unacked_from: int, now: float) -> tuple[ProducerIntake, Hello]:
        """Record a hello/heartbeat of the current incarnation (`replaced_by` was dealt with first)."""
        ps = self.producers.get(pid)
        if ps is None or ps.epoch != epoch:
            if len(self.producers) >= MAX_PRODUCERS:
                raise wire.ProtocolError("too_many_producers", f"{len(self.producers)} producers, limit "
                                         f"{MAX_PRODUCERS}")
            ps = self.producers[pid] = ProducerIntake(pid, epoch, ident, unacked_from, now)
            return ps, Hello.JOINED
        outcome = Hello.KNOWN
        if ps.ident != ident:
            ps.ident = ident
            outcome = Hello.RECONNECTED
        if ps.unacked_from(unacked_from):
            self._dirty.add(ps)
        ps.last_seen = now
        return ps, outcome

    def remove(self, ps: ProducerIntake) -> None:
        if self.producers.get(ps.pid) is ps:
            del self.producers[ps.pid]

    def silent_since(self, cutoff: float) -> list[ProducerIntake]:
        return [p for p in self.producers.values() if p.last_seen < cutoff]

    def complete(self, ps: ProducerIntake, seq: int) -> None:
        if ps.complete(seq):
            self._dirty.add(ps)

    def parts_acked(self, sent: deque, upto: int) -> None:
        """A consumer acked every part on its link up to lseq `upto`: pop them, completing the seqs whose last
        part this was."""
        while sent and sent[0][0] <= upto:
            tok = sent.popleft()[1]
            if tok is not None:
                tok.parts -= 1
                if tok.parts == 0 and tok.producer is not None:
                    if tok.producer.complete(tok.seq):
                        self._dirty.add(tok.producer)

    def refuse(self, tok: InFlight) -> ProducerIntake | None:
        """A message could not go everywhere it must: refuse it and what follows it, until its producer resends.
        Returns the producer to ask for a rewind (None if that incarnation is gone)."""
        ps = tok.producer
        tok.refuse()
        if ps is None or not self.is_current(ps):
            return None
        ps.go_back(tok.seq)
        return ps

    def forget_parts(self, sent: deque) -> list[ProducerIntake]:
        """A link lost the parts it had not acked: they will never be acked through it. Go back N: each affected
        producer's next accepted seq becomes its lowest seq lost there, so nothing that follows reaches any
        consumer before the producer resent it, in seq order. Returns the producers to ask for a rewind."""
        low: dict = {}
        for _, tok in sent:
            if tok is not None and tok.producer is not None:
                ps = tok.producer
                if tok.seq < low.get(ps, _NO_SEQ):
                    low[ps] = tok.seq
                tok.producer = None
        sent.clear()
        for ps, seq in low.items():
            if self.is_current(ps):
                ps.go_back(seq)
        return list(low)

    def rewind_ask(self, ps: ProducerIntake, now: float, force: bool = False) -> wire.ProducerAck | None:
        return ps.rewind_ask(now, self.rewind_interval_s, force)

    def unknown_ask(self, ident: bytes, epoch: int, now: float) -> wire.ProducerAck | None:
        """The ack asking a peer that sent data without a hello to say hello and rewind (rate-limited per peer)."""
        if now - self._asked_unknown.get(ident, -1e9) < UNKNOWN_ASK_INTERVAL_S:
            return None
        if len(self._asked_unknown) >= MAX_UNKNOWN_PEERS:
            self._asked_unknown.clear()
        self._asked_unknown[ident] = now
        return wire.ProducerAck(epoch, -1, rewind=True, hello=True)

    def acks_due(self) -> Iterator[tuple[ProducerIntake, wire.ProducerAck]]:
        """The current producers whose frontier moved past what was acked to them, with the ack to send; call
        `ack_sent` for each one that went out (the others stay due)."""
        if not self._dirty:
            return
        dirty, self._dirty = self._dirty, set()
        for ps in dirty:
            ack = ps.ack_due()
            if ack is not None and self.is_current(ps):
                yield ps, ack

    def ack_sent(self, ps: ProducerIntake, ack: wire.ProducerAck, ok: bool) -> None:
        if ok:
            ps.acked_sent = ack.upto
        else:
            self._dirty.add(ps)
