"""routing-replay: stream MoE routing decisions from inference engines to RL trainers.

One import name; the subpackages are the layers, each imports only the ones below it:

    routing_replay.apps       CLI, demo, embedded pipeline, synthetic engine, oracle, tiny models   (applications)
    routing_replay.engines    vLLM plugin, HF transformers adapter                                  (engines)
    routing_replay.capture → producer → broker → consumer → replay                                  (stages)
    routing_replay.protocol   wire format, ids, security, shared loop helpers                       (floor)

Importing this package imports nothing else.
"""

__version__ = "0.1.0"
