"""The trainer side of routing replay: records to token-aligned expert-id tensors, and forcing them in a model."""

from routing_replay.replay.export import (decode_nemo_rl, encode_nemo_rl, to_nemo_rl, to_slime, to_verl,
                                          to_verl_jagged)
from routing_replay.replay.hf import (MOE_BLOCKS, MoEBlockSpec, ReplayStats, find_moe_blocks, record_selection,
                                      register_moe_block, replay_routing)
from routing_replay.replay.megatron import (MicroBatchReplay, check_megatron_config, megatron_replay_data,
                                            megatron_routers)
from routing_replay.replay.routers import FAMILIES, RouterFamily
from routing_replay.replay.tensors import LAYOUTS, ReplayTensors, packed, padded

__all__ = ["FAMILIES", "LAYOUTS", "MOE_BLOCKS", "MicroBatchReplay", "MoEBlockSpec", "ReplayStats", "ReplayTensors",
           "RouterFamily", "check_megatron_config", "decode_nemo_rl", "encode_nemo_rl", "find_moe_blocks",
           "megatron_replay_data", "megatron_routers", "packed", "padded", "record_selection", "register_moe_block",
           "replay_routing", "to_nemo_rl", "to_slime", "to_verl", "to_verl_jagged"]
