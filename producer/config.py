"""Hold a producer's settings (ProducerConfig): every field with its default and what it bounds, checked once."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence

from routing_replay.protocol import wire
from routing_replay.protocol.checks import check_int
from routing_replay.producer.books import escaped_id
from routing_replay.producer.intake import COALESCE_MAX_BYTES

# Unacked bytes a producer keeps in memory (beyond them, with spill_dir, a spill file). Acks come back only after
# the consumers applied a message, so this is also how far a producer runs ahead of them: what can sit in their
# receive queues, and so the consumers' memory beyond their records. It must still cover the bytes sent in one ack
# round trip, or throughput falls (bench/pipeline.py --replay-mib; docs/PERFORMANCE.md, "A 128 MiB replay window").
REPLAY_MAX_BYTES = 128 << 20


@dataclass(frozen=True)
class ProducerConfig:
    """One producer's settings (Producer(config=...); Producer's keyword arguments build one)."""

    endpoint: str                               # the broker's frontend (tcp://host:port, ipc://path, inproc://name)
    num_layers: int                             # MoE layers of the model, 1..wire.MAX_LAYERS
    top_k: int                                  # experts per token and layer, 1..wire.MAX_TOP_K
    moe_layer_ids: Sequence[int] | None = None  # the model's layer index of each MoE layer (None: 0..num_layers-1)
    layer_range: tuple[int, int] | None = None  # the MoE layers [lo, hi) this producer sends (None: all of them)
    producer_id: str | None = None              # at most wire.MAX_PEER_ID_LEN characters (None: host-pid-random)
    max_queue_bytes: int = 256 << 20            # rows waiting for the producer's thread; steps beyond are dropped
    heartbeat_interval_ms: int = 1000           # heartbeats to the broker; also the reconnect hold for data
    linger_ms: int = 2000                       # close(): how long queued messages may take to reach the wire
    sndhwm: int = 10000                         # the DEALER socket's send high-water mark (messages)
    replay_max_bytes: int = REPLAY_MAX_BYTES    # unacknowledged bytes kept in memory (how far it runs ahead)
    spill_dir: str | os.PathLike | None = None  # where unacknowledged messages beyond replay_max_bytes go
    spill_max_bytes: int = 4 << 30              # the spill's bound (used only with spill_dir)
    resend_timeout_ms: int = 5000               # no ack for this long: resend from the first unacknowledged
    curve_secret: str | os.PathLike | None = None   # this producer's secret cert (CURVE, with server_key)
    server_key: str | os.PathLike | None = None     # the broker's public cert (CURVE, with curve_secret)
    silence_warn_after_ms: int = 3000           # a hello/heartbeat unanswered this long logs a WARNING
    silence_warn_every_ms: int = 10_000         # ... repeated this often while the silence lasts
    coalesce_max_bytes: int = COALESCE_MAX_BYTES    # rows of steps queued together sent as one delta (0: never)
    num_experts: int | None = None              # routed experts of the model: the rows' wire dtype (wire.id_dtype)
    id_dtype: object = None                     # or the wire dtype itself (uint8/uint16/int16); neither: int16

    def __post_init__(self):
        if not 1 <= self.num_layers <= wire.MAX_LAYERS or not 1 <= self.top_k <= wire.MAX_TOP_K:
            raise ValueError(f"num_layers={self.num_layers} top_k={self.top_k} outside protocol limits "
                             f"(1..{wire.MAX_LAYERS}, 1..{wire.MAX_TOP_K})")
        if self.moe_layer_ids is not None and len(self.moe_layer_ids) != self.num_layers:
            raise ValueError(f"moe_layer_ids has {len(self.moe_layer_ids)} entries for num_layers={self.num_layers}")
        lo, hi = self.layer_range if self.layer_range is not None else (0, self.num_layers)
        if not 0 <= lo < hi <= self.num_layers:
            raise ValueError(f"layer_range {self.layer_range} not inside [0, {self.num_layers}]")
        if self.producer_id is not None:
            if len(self.producer_id) > wire.MAX_PEER_ID_LEN:
                raise ValueError(f"producer id longer than {wire.MAX_PEER_ID_LEN} characters: "
                                 f"{escaped_id(self.producer_id)}")
            try:
                self.producer_id.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError(f"producer id {escaped_id(self.producer_id)} is not encodable as UTF-8") from None
        for name in ("max_queue_bytes", "linger_ms", "sndhwm", "replay_max_bytes", "spill_max_bytes"):
            check_int(name, getattr(self, name), 0)
        for name in ("heartbeat_interval_ms", "resend_timeout_ms", "silence_warn_after_ms", "silence_warn_every_ms"):
            check_int(name, getattr(self, name), 1)
        if (self.curve_secret is None) != (self.server_key is None):
            raise ValueError("CURVE needs both curve_secret (this producer's secret cert) and server_key "
                             "(the broker's public cert)")
        if not 0 <= self.coalesce_max_bytes <= wire.MAX_PAYLOAD_FRAME_BYTES:     # the broker's whole-message bound
            raise ValueError(f"coalesce_max_bytes={self.coalesce_max_bytes} outside "
                             f"0..{wire.MAX_PAYLOAD_FRAME_BYTES} (a coalesced delta must stay under "
                             "wire.MAX_DATA_MESSAGE_BYTES)")
        if self.num_experts is not None:
            check_int("num_experts", self.num_experts, 1)
        if self.id_dtype is not None:
            wire.as_id_dtype(self.id_dtype)                 # ValueError naming a dtype that is not an id dtype
            if self.num_experts is not None and wire.as_id_dtype(self.id_dtype) != wire.id_dtype(self.num_experts):
                raise ValueError(f"id_dtype={self.id_dtype} disagrees with num_experts={self.num_experts} "
                                 f"({wire.id_dtype(self.num_experts).name}): pass one of them")
