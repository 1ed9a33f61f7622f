"""The broker's ownership table: which consumer link owns each open request id (sticky rendezvous hashing), with
per-link and per-producer indexes so that losing one touches only its own entries (socket-free).

A request id is assigned when first seen, by rendezvous hashing over the live consumers, and keeps its owner until its
finish or abort (sticky), so adding a consumer never moves an in-flight request. Requests opened together in one small
`opens` message go together (`owner_of(rid, prefer)`: the owner the hash gives the message's first request), so a step's
new requests and their rows, finishes and records stay on one consumer; after a broker restart each consumer claims the
requests it holds (`claim`), so they stay where they are whatever the hash says. A request whose open references an
earlier request's rows (prefix_refs: a GRPO group's shared prompt) goes to the consumer that owns or recently owned that
writer, when it is alive (`affine`: a bounded map of the last RECENT_OWNERS request ids assigned), where the writer's
rows are; else as above. A request whose owner was lost is assigned again on its next message; the new owner must then
get the request's open again, marked `reassigned: true` (the table keeps each open message for that). Links and
producers are any hashable objects; a link has `alive` (False once lost) and the table never looks further into them.

A finish or abort does not forget a request at once: until the producer's ack frontier passes that message's seq
the request is kept as closing (its owner, its open message). A producer that rewinds resends from before the
finish, and a resent message for a closing request opens it again: on its owner if that link is alive, else on a
new owner that gets the open again. Without this, a consumer that applied the open, then died with the finish
unacked, would leave its successor rows and a finish with no open.
"""

from __future__ import annotations

import zlib
from collections import OrderedDict, deque
from typing import Any, Hashable, NamedTuple

from routing_replay.protocol import wire

RECENT_OWNERS = 1 << 16        # request ids whose last owner is remembered after they close (prefix affinity)


def _mix32(h: int) -> int:
    """MurmurHash3's 32-bit finaliser: a bijection whose every output bit depends on every input bit."""
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    return h ^ (h >> 16)


def rendezvous(rid: bytes, consumers: list[bytes]) -> bytes:
    """The consumer id with the highest hash of (consumer, request id): highest random weight. The score is
    mixed, not CRC alone: CRC is linear, so crc32(rid, seed) of one id across consumers differs only by an XOR,
    and the highest of those is decided by a bit or two of the id's CRC, which splits 3 consumers 1/2, 1/4, 1/4."""
    h = zlib.crc32(rid)
    best, best_score = consumers[0], -1
    for c in consumers:
        s = _mix32(h ^ zlib.crc32(c))
        if s > best_score:
            best, best_score = c, s
    return best


class OpenMsg(NamedTuple):
    """A request's open message as the producer sent it, kept to send again to a new owner."""

    head: bytes               # the msgpack header frame
    frames: list              # its payload frames (prompt token ids, if any)

    def reassigned_head(self) -> bytes:
        """The header with `reassigned: true` added to its body (the new owner flags what it missed)."""
        h = wire.decode_header(self.head)
        return wire.pack_header(h.kind, h.producer, h.epoch, h.seq, h.key, dict(h.body, reassigned=True))


class OpensEntry(NamedTuple):
    """One request's entry of an `opens` message (the message shared by its entries), kept to send a new owner
    that request's open alone."""

    header: wire.Header
    opens: wire.Opens
    tokens: Any               # the message's token ids (int32 array) or None
    index: int

    def reassigned_head(self) -> bytes:
        return self.opens.single(self.header, self.tokens, self.index, True)[0]

    @property
    def frames(self) -> list:
        return self.opens.token_frames(self.index, self.tokens)


class Owner(NamedTuple):
    """The link that owns a request; when its earlier owner was lost, `reassigned` and the open message to send the
    new owner first (None if the request's open was never seen)."""

    link: Any
    reassigned: bool = False
    reopen: OpenMsg | OpensEntry | None = None


class Owners(NamedTuple):
    """The owner link of each request id of a delta, in key order, and the distinct ones among them."""

    links: list
    distinct: set


class Ownership:
    """Own the request id -> owner link table, the open message and producer of each opened request, and the
    indexes by link and by producer.

    `owner` is the plain dict the delta path reads (one `dict.get` per request id); the other maps move with it.
    """

    def __init__(self, max_open_requests: int):
        self.max_open_requests = max_open_requests
        self.owner: dict[str, Any] = {}                  # request id -> its owner link
        self._open: dict[str, OpenMsg] = {}              # request id -> its open message
        self._producer: dict[str, Hashable] = {}         # request id -> the producer that opened it
        self._by_link: dict[Any, set] = {}               # link -> request ids it owns
        self._by_producer: dict[Hashable, set] = {}      # producer -> request ids it opened
        self.live_ids: list[bytes] = []                  # sorted ids of the live links (the hash's candidates)
        self.live: frozenset = frozenset()               # the live links
        self._link_of: dict[bytes, Any] = {}
        self._closing: dict[str, tuple] = {}             # request id -> (owner link, open message, producer, seq)
                                                         # of a finish or abort not yet acked to its producer
        self._closing_seqs: dict[Hashable, deque] = {}   # producer -> (seq, request id) of its closings, in order
        self.evicted = 0                                 # requests forgotten at max_open_requests
        self._recent: OrderedDict[str, Any] = OrderedDict()  # request id -> its last owner (RECENT_OWNERS newest)
        self.version = 0                                 # moves on every change of an owner or of the live set

    def __len__(self) -> int:
        return len(self.owner)

    def set_live(self, links: dict[bytes, Any]) -> None:
        """The live links, by consumer id (each new assignment hashes over them)."""
        self.version += 1
        self._link_of = dict(links)
        self.live_ids = sorted(links)
        self.live = frozenset(links.values())

    def owned_by(self, link: Any) -> int:
        """How many open requests `link` owns (those of a lost link move on their next message)."""
        return len(self._by_link.get(link, ()))

    def lookup(self, ids: list) -> Owners | None:
        """The live owner of every id, or None if one is unassigned or owned by a lost link (then use owner_of)."""
        links = list(map(self.owner.get, ids))
        distinct = set(links)
        if None in distinct or not distinct <= self.live:
            return None
        return Owners(links, distinct)

    def hashed(self, rid: str) -> Any:
        """The live link rendezvous hashing gives `rid` (needs a live link); nothing is assigned."""
        return self._link_of[rendezvous(rid.encode("utf-8", "surrogatepass"), self.live_ids)]

    def affine(self, writer: str) -> Any:
        """The live link that owns or last owned request `writer` (None: none remembered, or it was lost)."""
        link = self.owner.get(writer)
        if link is None:
            link = self._recent.get(writer)
        return link if link is not None and link.alive else None

    def owner_of(self, rid: str, prefer: Any = None) -> Owner:
        """The live owner of `rid`, assigned now if it has none or its owner was lost (needs a live link). A request
        seen for the first time goes to `prefer` when given (a live link: its group's owner), else to its hash."""
        link = self.owner.get(rid)
        if link is None:
            c = self._closing.pop(rid, None)
            if c is None:
                return Owner(self._assign(rid) if prefer is None else self._set_owner(rid, prefer))
            return self._reopen(rid, *c)
        if link.alive:
            return Owner(link)
        self._by_link_discard(link, rid)
        return Owner(self._assign(rid), True, self._open.get(rid))     # (_assign moved the version)

    def opened(self, rid: str, producer: Hashable, msg: OpenMsg) -> None:
        """`rid` was opened by `producer` with `msg` (call after owner_of)."""
        self._open[rid] = msg
        old = self._producer.get(rid)
        if old is not producer:
            if old is not None:
                self._by_producer_discard(old, rid)
            self._producer[rid] = producer
            self._by_producer.setdefault(producer, set()).add(rid)

    def _reopen(self, rid: str, link: Any, msg: OpenMsg | None, producer: Hashable, seq: int) -> Owner:
        """A message for closing `rid` came again (its producer rewound past the finish): open it again, on the
        same owner if it is alive, else on a new one that must get the open again."""
        if msg is not None:
            self.opened(rid, producer, msg)
        if link.alive:
            return Owner(self._set_owner(rid, link))
        return Owner(self._assign(rid), True, msg)

    def close(self, rid: str, producer: Hashable | None = None, seq: int | None = None) -> None:
        """`rid` finished or was aborted. With the producer and seq of that message, the request is kept as closing
        until `release(producer, upto)` passes `seq`; without them it is forgotten at once."""
        link = self.owner.pop(rid, None)
        if link is not None:
            self.version += 1
            self._by_link_discard(link, rid)
        msg = self._open.pop(rid, None)
        p = self._producer.pop(rid, None)
        if p is not None:
            self._by_producer_discard(p, rid)
        if producer is not None and link is not None:
            self._closing[rid] = (link, msg, producer, seq)
            self._closing_seqs.setdefault(producer, deque()).append((seq, rid))

    def claim(self, rids: list, link: Any) -> tuple[int, int]:
        """A consumer (`link`, live) says it holds `rids` (after a broker restart): each one without a live owner
        and not closing is its from now on. Returns (claimed, refused: owned by another live link or closing)."""
        claimed = refused = 0
        for rid in rids:
            cur = self.owner.get(rid)
            if cur is link:
                continue
            if (cur is not None and cur.alive) or rid in self._closing:
                refused += 1
                continue
            if cur is not None:
                self._by_link_discard(cur, rid)
            self._set_owner(rid, link)
            claimed += 1
        return claimed, refused

    def release(self, producer: Hashable, upto: int) -> int:
        """The producer's messages up to seq `upto` were applied: forget the requests they closed. Returns how many."""
        q = self._closing_seqs.get(producer)
        n = 0
        while q and q[0][0] <= upto:
            seq, rid = q.popleft()
            c = self._closing.get(rid)
            if c is not None and c[2] is producer and c[3] == seq:
                del self._closing[rid]
                n += 1
        if q is not None and not q:
            del self._closing_seqs[producer]
        return n

    @property
    def closing(self) -> int:
        """Requests finished or aborted whose closing message is not acked yet."""
        return len(self._closing)

    def drop_producer(self, producer: Hashable) -> list[tuple[str, Any]]:
        """Forget every request `producer` opened; returns each (request id, owner link or None)."""
        rids = self._by_producer.pop(producer, ())
        self.version += 1
        for _, rid in self._closing_seqs.pop(producer, ()):
            c = self._closing.get(rid)
            if c is not None and c[2] is producer:
                del self._closing[rid]
        out = []
        for rid in rids:
            del self._producer[rid]
            self._open.pop(rid, None)
            link = self.owner.pop(rid, None)
            if link is not None:
                self._by_link_discard(link, rid)
            out.append((rid, link))
        return out

    def _assign(self, rid: str) -> Any:
        return self._set_owner(rid, self.hashed(rid))

    def _set_owner(self, rid: str, link: Any) -> Any:
        """`link` owns `rid` from now on (the oldest request is forgotten at max_open_requests)."""
        self.version += 1
        if rid not in self.owner and len(self.owner) >= self.max_open_requests:
            self.close(next(iter(self.owner)))
            self.evicted += 1
        self.owner[rid] = link
        self._by_link.setdefault(link, set()).add(rid)
        recent = self._recent
        recent[rid] = link
        recent.move_to_end(rid)
        if len(recent) > RECENT_OWNERS:
            recent.popitem(last=False)
        return link

    def _by_link_discard(self, link: Any, rid: str) -> None:
        s = self._by_link.get(link)
        if s is not None:
            s.discard(rid)
            if not s:
                del self._by_link[link]

    def _by_producer_discard(self, producer: Hashable, rid: str) -> None:
        s = self._by_producer.get(producer)
        if s is not None:
            s.discard(rid)
            if not s:
                del self._by_producer[producer]
