"""Run broker and consumer inside the calling process (threads over inproc://), for one-machine use.

The one place the embedded wiring lives: `routing_replay.apps.embedded` (the Python API) re-exports it, and the vLLM
plugin's helper process (engines/vllm_plugin/pipeline.py) runs it with an ipc:// frontend."""

from __future__ import annotations

import time
import uuid

import zmq

from routing_replay.broker import Broker, BrokerConfig
from routing_replay.consumer import Consumer, ConsumerConfig
from routing_replay.producer import Producer
from routing_replay.protocol import security

REMEDY = ("the embedded pipeline has no CURVE: serve on loopback or ipc://, or run `routing-replay broker` and "
          "`routing-replay consume --serve ... --curve-secret ... --curve-allow ...`, or pass insecure=True to "
          "accept that")


class EmbeddedPipeline:
    """Own an in-process broker thread and consumer thread joined by inproc:// sockets on one zmq.Context.

    Producers in the same process connect to `frontend` with `context=pipe.context` (see `producer()`).
    Records go where a multi-process consumer would send them: `npz_dir`, the trainer endpoint `serve`,
    and/or the `on_record` callback (called in the consumer thread). `serve` has no CURVE: a tcp:// address
    other than loopback raises ValueError unless `insecure=True`. `frontend`: the address the broker binds for
    producers (default: an inproc:// one of this pipeline, for producers in this process only).
    """

    def __init__(self, npz_dir: str | None = None, serve: str | None = None, *, shard_size: int = 0,
                 context: zmq.Context | None = None, name: str | None = None, on_record=None,
                 insecure: bool = False, frontend: str | None = None, **consumer_kw):
        if serve:       # no CURVE here: refused off loopback as `routing-replay consume --serve` refuses it
            security.check_bind(serve, curve=False, insecure=insecure, what="serve", remedy=REMEDY)
        self.context = context or zmq.Context.instance()
        name = name or uuid.uuid4().hex[:12]
        self.frontend = frontend or f"inproc://routing-replay-{name}-frontend"
        backend = f"inproc://routing-replay-{name}-backend"
        consumer_kw.setdefault("stats_interval_s", 60.0)
        # both configs first: a bad argument raises before any thread runs
        broker_cfg = BrokerConfig(self.frontend, backend, stats_interval_s=60.0)
        consumer_cfg = ConsumerConfig(backend, npz_dir=npz_dir, shard_size=shard_size, serve=serve, **consumer_kw)
        self.broker = Broker(config=broker_cfg, context=self.context)
        self.broker.start()
        try:
            self.consumer = Consumer(config=consumer_cfg, context=self.context, on_record=on_record)
            self.consumer.start()
        except BaseException:
            self.broker.close()
            raise
        self.serve = self.consumer.serve
        self._closed = False

    def producer(self, **kw) -> Producer:
        """A Producer connected to this pipeline (same context, as inproc requires)."""
        return Producer(self.frontend, context=self.context, **kw)

    def wait_idle(self, timeout_s: float = 30.0, quiet_s: float = 0.2) -> bool:
        """Wait until no request is in flight and no message arrived for quiet_s. True if reached in time."""
        deadline = time.monotonic() + timeout_s
        last, since = -1, time.monotonic()
        while time.monotonic() < deadline:
            n = self.consumer.msgs_in
            if n != last:
                last, since = n, time.monotonic()
            elif (self.consumer.acc.in_flight == 0 and not self.consumer.acc.pending_finish
                  and time.monotonic() - since >= quiet_s):
                return True
            time.sleep(0.01)
        return False

    def close(self) -> None:
        """Stop consumer then broker; records already finished are written. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.consumer.close()
        self.broker.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
