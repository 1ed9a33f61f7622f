"""Hold a consumer's settings (ConsumerConfig): every field with its default and what it bounds, checked once."""

from __future__ import annotations

from dataclasses import dataclass

from routing_replay.consumer.accumulator import ADOPT_MIN_BYTES
from routing_replay.consumer.prefix_pool import PREFIX_POOL_BYTES
from routing_replay.protocol.checks import check_int, check_seconds


@dataclass(frozen=True)
class ConsumerConfig:
    """One consumer's settings (Consumer(config=...); Consumer's keyword arguments build one)."""

    connect: str                            # the broker's backend
    consumer_id: str | None = None          # 1..255 bytes of UTF-8 (None: host-pid-random)
    npz_dir: str | None = None              # write finished records as .npz here (None: no files)
    shard_size: int = 0                     # records per npz shard (0: one file per record)
    serve: str | None = None                # serve records to trainers on this address (None: no trainer endpoint)
    store_max_bytes: int = 2 << 30          # records held for trainers (and npz writes waiting), in memory
    spill_dir: str | None = None            # where held records beyond store_max_bytes go
    heartbeat_interval_ms: int = 1000       # heartbeats to the broker
    finish_grace_s: float = 0.5             # after a finish, how long rows still in flight may arrive
    request_timeout_s: float = 600.0        # a request open this long without a finish is emitted incomplete
    max_bytes: int = 16 << 30               # rows of open requests held at once; beyond it requests are dropped
    progress: bool = False                  # a progress line on stderr while writing npz
    stats_interval_s: float = 10.0          # one stats log line this often
    rcvhwm: int = 100_000                   # the DEALER socket's receive high-water mark (messages)
    ack_interval_ms: int = 20               # acks to the broker are sent at most this often
    curve_secret: str | None = None         # this consumer's secret cert (CURVE towards the broker, with broker_key)
    broker_key: str | None = None           # the broker's public cert (CURVE, with curve_secret)
    curve_allow: str | None = None          # the trainers' public certs (serving over CURVE)
    remember_finished: int = 100_000        # finished request ids remembered (late parts of them are dropped)
    fetched_retention_s: float = 600.0      # records fetched by a trainer are kept this long for a refetch
    fetched_retention_bytes: int = 256 << 20    # ... and up to this many bytes
    write_retry_max_s: float = 2.0          # an npz write that fails is retried with backoff up to this long
    keep_bytes: int | None = None           # record memory kept for reuse (None: the accumulator's default)
    adopt_min_bytes: int | None = ADOPT_MIN_BYTES   # received frames this large are kept as records' rows (None:
                                                    # rows always copied)
    prefix_pool_bytes: int = PREFIX_POOL_BYTES      # finished records' prompt rows kept for prefix references (0:
                                                    # none; a reference to a finished writer then fails closed)

    def __post_init__(self):
        if self.consumer_id is not None and not 0 < len(self.consumer_id.encode()) <= 255:
            raise ValueError(f"consumer id must be 1..255 bytes of UTF-8, got {self.consumer_id[:64]!r}")
        if (self.curve_secret is None) != (self.broker_key is None):
            raise ValueError("CURVE towards the broker needs both curve_secret and broker_key")
        if self.serve and self.curve_secret is not None and self.curve_allow is None:
            raise ValueError("serving trainers over CURVE needs curve_allow (the directory of trainers' public "
                             "certs); without it any client key would be accepted")
        for name in ("heartbeat_interval_ms", "ack_interval_ms"):
            check_int(name, getattr(self, name), 1)
        for name in ("shard_size", "store_max_bytes", "max_bytes", "rcvhwm", "remember_finished",
                     "fetched_retention_bytes", "prefix_pool_bytes"):
            check_int(name, getattr(self, name), 0)
        for name in ("keep_bytes", "adopt_min_bytes"):
            check_int(name, getattr(self, name), 0, none=True)
        for name in ("request_timeout_s", "stats_interval_s"):
            check_seconds(name, getattr(self, name))
        for name in ("finish_grace_s", "fetched_retention_s", "write_retry_max_s"):
            check_seconds(name, getattr(self, name), positive=False)
