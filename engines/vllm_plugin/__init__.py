"""vLLM plugin: capture MoE routing inside vLLM's workers and publish it per engine step (see docs/VLLM.md)."""

from routing_replay.engines.vllm_plugin.keys import record_key
from routing_replay.engines.vllm_plugin.plugin import SUPPORTED_VLLM, capture_of, check_version, register
from routing_replay.engines.vllm_plugin.settings import Settings

__all__ = ["SUPPORTED_VLLM", "Settings", "capture_of", "check_version", "record_key", "register"]
