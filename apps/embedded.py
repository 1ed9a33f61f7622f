"""The embedded pipeline (broker and consumer threads in the calling process): see routing_replay.engines.embedded."""

from routing_replay.engines.embedded import REMEDY, EmbeddedPipeline

__all__ = ["EmbeddedPipeline", "REMEDY"]
