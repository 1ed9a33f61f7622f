"""Connect a worker's Producer to where ROUTING_REPLAY_BROKER says, starting the embedded pipeline if asked."""

from __future__ import annotations

import logging

from routing_replay.producer import Producer
from routing_replay.engines.vllm_plugin.settings import ENV_BROKER, Settings

log = logging.getLogger("vllm.routing_replay")


class Sink:
    """Own a worker's Producer and, in embedded mode, the helper process (broker + consumer) it publishes to."""

    def __init__(self, settings: Settings, *, single_publisher: bool, in_flight=None, on_restart=None,
                 **producer_kw):
        """in_flight (embedded): returns the record keys of the requests being captured, named when the helper
        process dies; on_restart: called (on the helper's watch thread) once a dead helper was started again."""
        self.pipeline = None
        if settings.embedded:
            if not single_publisher:
                raise NotImplementedError(
                    f"{ENV_BROKER}=embedded runs broker and consumer inside the one worker that publishes; "
                    "with data or pipeline parallelism several workers publish. Run `routing-replay broker` "
                    f"and `routing-replay consume` and set {ENV_BROKER}=tcp://HOST:PORT instead.")
            from routing_replay.engines.vllm_plugin.pipeline import PipelineProcess
            self.pipeline = PipelineProcess(npz_dir=settings.npz_dir, serve=settings.serve, in_flight=in_flight,
                                           on_restart=on_restart)
            self.endpoint = self.pipeline.frontend
            self.producer = Producer(self.endpoint, **producer_kw)
        else:
            if settings.curve_secret:
                producer_kw = dict(producer_kw, curve_secret=settings.curve_secret, server_key=settings.broker_key)
            self.producer = Producer(settings.broker, **producer_kw)
            self.endpoint = settings.broker
        log.info("routing-replay: producer %s publishing to %s%s%s", self.producer.producer_id, self.endpoint,
                 f" (embedded; npz_dir={settings.npz_dir}, serve={settings.serve})" if self.pipeline else "",
                 " (CURVE)" if settings.curve_secret else "")

    def close(self, timeout_s: float = 10.0) -> None:
        """Send what is queued, then (embedded) let the helper's consumer write what finished, then stop it.
        Idempotent."""
        try:
            self.producer.close(timeout_s)
        finally:
            if self.pipeline is not None:
                self.pipeline.close(timeout_s=3 * timeout_s)
