"""Keep the caller-side per-request state (RequestBook: lost ranges, refused ids, ids known to travel) and the
finish bodies that report lost positions."""

from __future__ import annotations

import threading
from typing import Any, Iterable, NamedTuple, Sequence

from routing_replay.protocol import wire
from routing_replay.producer.items import Announce


def lost_body(body: dict, lost: Sequence, refused: Sequence = (), broker_refused: Sequence = ()) -> dict:
    """A finish's body (a new dict) that also reports `lost` position ranges (after those it already carries), and
    of them the `refused` ones (rows the producer would not send: they failed its checks) and the `broker_refused`
    ones (rows of a delta the broker accepted and dropped: it could not take the message)."""
    body = dict(body)
    body["lost"] = list(body.get("lost", ())) + [list(r) for r in lost]
    for key, ranges in (("refused", refused), ("broker_refused", broker_refused)):
        if ranges:
            body[key] = list(body.get(key, ())) + [list(r) for r in ranges]
    return body


def with_lost(item: Announce, lost: list, refused: list = (), broker_refused: list = ()) -> Announce:
    """A finish item that also reports `lost` (and `refused`, `broker_refused`) position ranges: lost_body."""
    return item._replace(body=lost_body(item.body, lost, refused, broker_refused))


def escaped_id(request_id: Any, limit: int = 80) -> str:
    """A request id as printable ASCII (escapes for anything else, lone surrogates included), at most `limit`
    characters of it."""
    text = ascii(request_id) if type(request_id) is str else f"<{type(request_id).__name__}> {ascii(request_id)}"
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters escaped)"


class Screen(NamedTuple):
    """Which request parts of one call may travel: `keep` None means all of them."""

    keep: list | None
    dropped: int


class RequestBook:
    """Own the caller-side per-request state, under one lock: position ranges lost to drops (reported in the
    request's finish), ids refused (by a failed open, or by the broker), and a bounded set of ids known to
    travel (validated once; a cache, cleared when it reaches `known_limit`)."""

    def __init__(self, known_limit: int = 1 << 16):
        self.lock = threading.Lock()
        self.known_limit = known_limit
        self._lost: dict[str, list] = {}
        self._refused: set[str] = set()
        self._known: set[str] = set()
        self.refusals = 0               # moves on every refuse(): a screen that passed before may not pass now

    def problem(self, request_id: Any) -> str | None:
        """Why this id's parts may not travel (None if they may). Caller holds no lock."""
        if type(request_id) is not str:
            return wire.request_id_problem(request_id)
        with self.lock:
            if request_id in self._known and request_id not in self._refused:
                return None
            if request_id in self._refused:
                return "refused"
        p = wire.request_id_problem(request_id)
        if p is None:
            with self.lock:
                if len(self._known) >= self.known_limit:
                    self._known.clear()
                self._known.add(request_id)
        return p

    def screen(self, request_ids: Iterable) -> Screen:
        with self.lock:
            try:
                if not self._refused and self._known.issuperset(request_ids):
                    return Screen(None, 0)
            except TypeError:             # an unhashable "id": checked one by one below
                pass
        keep = [self.problem(r) is None for r in request_ids]
        n = keep.count(False)
        return Screen(None if n == 0 else keep, n)

    def opened(self, request_id: str) -> None:
        with self.lock:
            self._refused.discard(request_id)
            if len(self._known) >= self.known_limit:
                self._known.clear()
            self._known.add(request_id)

    def opened_many(self, request_ids: list) -> None:
        with self.lock:
            self._refused.difference_update(request_ids)
            if len(self._known) + len(request_ids) > self.known_limit:
                self._known.clear()
            self._known.update(request_ids)

    def refuse(self, request_id: Any) -> None:
        if type(request_id) is not str:
            return
        with self.lock:
            self._refused.add(request_id)
            self._lost.pop(request_id, None)
            self.refusals += 1

    def is_refused(self, request_id: Any) -> bool:
        with self.lock:
            return type(request_id) is str and request_id in self._refused

    @property
    def any_refused(self) -> bool:
        return bool(self._refused)

    def ended(self, request_id: Any) -> tuple[bool, list | None]:
        """A finish/abort: (was it refused, the lost ranges to report); the request's state is forgotten."""
        with self.lock:
            lost = self._lost.pop(request_id, None) if type(request_id) is str else None
            if type(request_id) is str and request_id in self._refused:
                self._refused.discard(request_id)
                return True, None
            return False, lost

    def ended_many(self, request_ids: list) -> list[tuple[bool, list | None, bool]]:
        """ended() for several ids under one lock: per id (was it refused, its lost ranges, is it known to travel
        (False: not known, check it with problem()))."""
        out = []
        with self.lock:
            lost, refused, known = self._lost, self._refused, self._known
            for rid in request_ids:
                if type(rid) is not str:
                    out.append((False, None, False))
                    continue
                ranges = lost.pop(rid, None) if lost else None
                if rid in refused:
                    refused.discard(rid)
                    out.append((True, None, False))
                else:
                    out.append((False, ranges, rid in known))
        return out

    def add_lost(self, request_ids: Sequence, starts: Sequence[int], counts: Sequence[int]) -> None:
        with self.lock:
            for rid, s, c in zip(request_ids, starts, counts):
                if type(rid) is str and rid not in self._refused:
                    self._lost.setdefault(rid, []).append([int(s), int(s) + int(c)])
