"""routing-replay: stream MoE routing decisions from inference engines to RL trainers."""

__version__ = "0.1.0"
