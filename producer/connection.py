"""Decide when a producer says hello and when its data may flow (LinkState), and when broker silence is reported.

Socket-free: the producer's thread feeds events (connection events from the socket monitor, a hello handed to
the socket, any message heard from the broker, a rewind) and asks what to do; tests drive it with plain numbers.
"""

from __future__ import annotations

import enum
import math
from typing import NamedTuple


class LinkState(enum.Enum):
    """Where a producer stands with its broker connection."""

    GREETING = "greeting"              # a hello goes first; data may follow it at once (start, after a rewind)
    OFFLINE = "offline"                # a hello goes first; data waits for an answer or `hold_until`
    AWAITING_REPLY = "awaiting_reply"  # hello sent; data waits for an answer or `hold_until`
    STREAMING = "streaming"            # data flows


class LinkEvent(enum.Enum):
    DISCONNECTED = "disconnected"      # the connection dropped: the next one may be a new broker
    RECONNECTED = "reconnected"        # a later connection's handshake succeeded
    HELLO_SENT = "hello_sent"          # the hello was handed to the socket
    HEARD = "heard"                    # any message came from the broker
    REWIND = "rewind"                  # resend from the first unacknowledged message: a hello goes first
    TICK = "tick"                      # time passed (ends a hold at `hold_until`)


class Link:
    """Own the hello/hold state of one producer connection: one `move` changes it.

    After a disconnect no data may leave before the broker has answered a hello: a new broker incarnation must
    first say (by its epoch) that it needs everything unacknowledged again. The hold ends when the broker
    answers, or `hold_s` after the reconnect handshake (a broker that does not answer hellos still gets data).
    """

    def __init__(self, hold_s: float):
        self.hold_s = hold_s
        self.state = LinkState.GREETING
        self.hold_until = 0.0

    def __repr__(self) -> str:
        return f"Link({self.state.name}, hold_until={self.hold_until})"

    @property
    def hello_due(self) -> bool:
        return self.state in (LinkState.GREETING, LinkState.OFFLINE)

    def data_held(self, now: float) -> bool:
        return self.state in (LinkState.OFFLINE, LinkState.AWAITING_REPLY) and now < self.hold_until

    def move(self, event: LinkEvent, now: float) -> LinkState:
        s = self.state
        S, E = LinkState, LinkEvent
        if event is E.DISCONNECTED:
            s, self.hold_until = S.OFFLINE, math.inf
        elif event is E.RECONNECTED:
            s, self.hold_until = S.OFFLINE, now + self.hold_s
        elif event is E.HELLO_SENT:
            s = {S.GREETING: S.STREAMING, S.OFFLINE: S.AWAITING_REPLY}.get(s, s)
        elif event is E.HEARD:
            s = {S.OFFLINE: S.GREETING, S.AWAITING_REPLY: S.STREAMING}.get(s, s)
        elif event is E.REWIND:
            s = {S.STREAMING: S.GREETING, S.AWAITING_REPLY: S.OFFLINE}.get(s, s)
        elif event is E.TICK:
            if now >= self.hold_until:
                s = {S.OFFLINE: S.GREETING, S.AWAITING_REPLY: S.STREAMING}.get(s, s)
        else:
            raise ValueError(f"unknown link event {event!r}")
        if s in (S.GREETING, S.STREAMING):
            self.hold_until = 0.0
        self.state = s
        return s


class Silence(NamedTuple):
    """A report due on broker silence: how long nothing came back to what the producer asked, and how often
    this silence was reported (1 the first time)."""

    silent_s: float
    reports: int


class Answer(NamedTuple):
    """The broker answered: `first` on its first answer ever (`after_s` since the producer started), otherwise
    after a reported silence (`after_s` of silence)."""

    first: bool
    after_s: float


class SilenceWatch:
    """Own the 'is the broker answering?' question: hellos and heartbeats are always answered by a live broker,
    so one asked for and not answered within `warn_after_s` is reported, then every `warn_every_s` while the
    silence lasts; the first answer and the end of a reported silence are reported once each."""

    def __init__(self, warn_after_s: float, warn_every_s: float, started: float):
        self.warn_after_s = warn_after_s
        self.warn_every_s = warn_every_s
        self.started = started
        self.answered = False
        self.asking_since: float | None = None    # first hello/heartbeat since the last answer
        self.reports = 0                          # reports of the current silence
        self._next_report = math.inf

    def asked(self, now: float) -> None:
        """A hello or heartbeat was sent, or tried (no connection)."""
        if self.asking_since is None:
            self.asking_since = now
            self._next_report = now + self.warn_after_s

    def heard(self, now: float) -> Answer | None:
        """Any message from the broker: the Answer to report, if one is due."""
        out = None
        if not self.answered:
            self.answered = True
            out = Answer(True, now - self.started)
        elif self.reports:
            out = Answer(False, now - self.asking_since)
        self.asking_since = None
        self.reports = 0
        self._next_report = math.inf
        return out

    def due(self, now: float) -> Silence | None:
        """The Silence to report now, if one is due."""
        if now < self._next_report:
            return None
        self.reports += 1
        self._next_report = now + self.warn_every_s
        return Silence(now - self.asking_since, self.reports)
