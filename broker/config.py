"""Hold a broker's settings (BrokerConfig): every field with its default and what it bounds, checked once."""

from __future__ import annotations

from dataclasses import dataclass

from routing_replay.protocol import wire
from routing_replay.protocol.checks import check_int, check_seconds


@dataclass(frozen=True)
class BrokerConfig:
    """One broker's settings (Broker(config=...); Broker's keyword arguments build one)."""

    frontend: str                       # where producers connect (bind address)
    backend: str                        # where consumers connect (bind address)
    heartbeat_interval_ms: int = 1000   # heartbeats to consumers; a consumer silent for `liveness` of them is lost
    liveness: int = 3                   # heartbeat intervals a consumer may stay silent before it is lost
    stats_interval_s: float = 10.0      # one stats log line this often
    max_pending_bytes: int = 512 << 20  # data held while no consumer is live; beyond it messages are dropped
    max_open_requests: int = 1 << 20    # requests the ownership table holds at once; beyond it opens are refused
    hwm: int = 100_000                  # both sockets' send and receive high-water marks (messages)
    producer_timeout_ms: int = 10_000   # a producer silent this long is forgotten (its open requests aborted)
    ack_interval_ms: int = 20           # acks to producers are sent at most this often
    restart_grace_ms: int | None = None     # after a start, data is held this long for consumers to come back
                                            # (None: two heartbeat intervals)
    curve_secret: str | None = None     # the broker's own secret cert (CURVE, with curve_allow)
    curve_allow: str | None = None      # the directory of allowed clients' public certs (CURVE, with curve_secret)
    open_group_max: int = 16            # an `opens` of at most this many requests goes to one consumer (0: none)

    def __post_init__(self):
        if (self.curve_secret is None) != (self.curve_allow is None):
            raise ValueError("CURVE needs both curve_secret (the broker's own secret cert) and curve_allow "
                             "(the directory of allowed clients' public certs)")
        for name in ("heartbeat_interval_ms", "liveness", "producer_timeout_ms", "ack_interval_ms"):
            check_int(name, getattr(self, name), 1)
        for name in ("max_pending_bytes", "max_open_requests", "hwm"):
            check_int(name, getattr(self, name), 0)
        check_int("restart_grace_ms", self.restart_grace_ms, 0, none=True)
        check_seconds("stats_interval_s", self.stats_interval_s)
        if not 0 <= self.open_group_max <= wire.MAX_BATCH_ENTRIES:
            raise ValueError(f"open_group_max must be in [0, {wire.MAX_BATCH_ENTRIES}], got {self.open_group_max}")
