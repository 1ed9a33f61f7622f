"""The trainer side of routing replay: records to token-aligned expert-id tensors, and forcing them in a model."""

from routing_replay.replay.hf import (MOE_BLOCKS, MoEBlockSpec, ReplayStats, find_moe_blocks, register_moe_block,
                                      replay_routing)
from routing_replay.replay.megatron import megatron_replay_data
from routing_replay.replay.tensors import LAYOUTS, ReplayTensors, packed, padded

__all__ = ["LAYOUTS", "MOE_BLOCKS", "MoEBlockSpec", "ReplayStats", "ReplayTensors", "find_moe_blocks",
           "megatron_replay_data", "packed", "padded", "register_moe_block", "replay_routing"]
