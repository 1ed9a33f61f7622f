"""Keep the routing rows of every computed token addressable by its KV-cache slot, for prefix-cache hits.

vLLM's prefix cache hands a new request the KV blocks an earlier request computed; that request's routing for
those tokens is what produced the cached KV. `PrefixStore` keeps one (L, K) row per KV slot (block id x block
size + offset, the engine's own `slot_mapping`), on the device that runs the model:

- write (engine thread, right after each forward, every step with tokens, captured or not): one
  `index_copy_` from the step's routing cache into the slots the step wrote KV to. Same stream as the forward;
  nothing waits. Every KV write has a routing write beside it, so a slot's row always belongs to the KV the
  slot holds: an evicted block that is refilled gets the new rows, and no hit can ever read the rows of a
  block's previous occupant.
- gather (for a request scheduled with prefix hits): `AsyncCopier.submit_gather(store.rows, slots)` snapshots
  the hit positions' rows into the host ring like any step's rows (one `index_select`, then the asynchronous
  D2H copy).
- invalidate: rows are -1 until written; `invalidate()` sets every row to -1 again (a weight reload or a
  wake-up: the KV cache's content came from other weights). A hit on an invalidated or never-written slot reads
  -1 rows, which the consumer reports as `prefix_not_found`: stale routing never reaches a record.

Memory: (slots, L, K) int16 = L x K x 2 bytes per KV slot (Qwen3-30B-A3B: 768 B against ~96 KiB of KV per token,
0.78%). Graph safety is not needed: write and gather run eagerly on the engine thread, outside any graph.
"""

from __future__ import annotations

import numpy as np
import torch


class PrefixStore:
    """Own the (num_slots, L, K) int16 device tensor of routing rows by KV slot."""

    def __init__(self, num_slots: int, num_layers: int, top_k: int, device="cpu"):
        if num_slots < 1 or num_layers < 1 or top_k < 1:
            raise ValueError(f"num_slots={num_slots}, num_layers={num_layers}, top_k={top_k} must be >= 1")
        self.num_slots = int(num_slots)
        self.rows = torch.full((num_slots, num_layers, top_k), -1, dtype=torch.int16, device=device)
        self.writes = 0                # write() calls
        self.invalidations = 0

    @property
    def nbytes(self) -> int:
        return self.rows.numel() * self.rows.element_size()

    def write(self, slots: torch.Tensor, step_rows: torch.Tensor) -> None:
        """Store the step's rows at their KV slots. slots: (n,) int64 on the store's device, every value in
        [0, num_slots) (vLLM's slot_mapping for the step's n scheduled tokens); step_rows: (n, L, K) (a view of
        the routing cache, any integer dtype)."""
        if step_rows.dtype != torch.int16:
            step_rows = step_rows.to(torch.int16)
        self.rows.index_copy_(0, slots, step_rows)
        self.writes += 1

    def forget(self, slots: torch.Tensor) -> None:
        """Mark these slots as holding no known routing (a step whose routing was not captured)."""
        self.rows.index_fill_(0, slots, -1)

    def invalidate(self) -> None:
        """Every slot back to -1: nothing computed so far may be read as a hit's routing."""
        self.rows.fill_(-1)
        self.invalidations += 1


def hit_slots(block_row, block_size: int, num_tokens: int):
    """The KV slots of positions [0, num_tokens) of a request whose block-table row is `block_row` (numpy, the
    engine's block ids in order), computed as vLLM's slot mapping does without context parallelism:
    block_row[pos // block_size] * block_size + pos % block_size. Returns an (num_tokens,) int64 numpy array."""
    pos = np.arange(num_tokens, dtype=np.int64)
    blocks = np.asarray(block_row[:(num_tokens + block_size - 1) // block_size], dtype=np.int64)
    return blocks[pos // block_size] * block_size + pos % block_size
