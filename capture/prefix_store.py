"""Keep the routing rows of every computed token addressable by its KV-cache slot, for prefix-cache hits.

vLLM's prefix cache hands a new request the KV blocks an earlier request computed; that request's routing for
those tokens is what produced the cached KV. `PrefixStore` keeps one (L, K) row per KV slot (block id x block
size + offset, the engine's own `slot_mapping`), on the device that runs the model:

- write (graph-safe): `RoutingCache.attach_store(store, slot_mapping)` makes the cache's end-of-step flush (the
  last MoE layer's hook, inside the forward) also scatter the step's rows into the store at the step's slots, one
  `index_put_` on the compute stream. Under CUDA graphs it is captured with the rest of the hook, so a replayed
  step writes the store at no host cost at all. Where the hooks run in Python every step the worker attaches it
  with in_flush=False and writes it after the forward (`RoutingCache.store_step`): torch.compile traces the flush
  of a model it compiles whole (vLLM's CPU build) once, before the store exists, and keeps what it did then.
  Every KV write has a routing write beside it, so a slot's row always belongs to the KV the slot holds: an
  evicted block that is refilled gets the new rows, and no hit can ever read the rows of a block's previous
  occupant. Padded tokens (CUDA-graph padding, dummy runs) have slot -1 in vLLM's slot mapping; the table has
  one spare row at the end where they land.
- gather (for a request scheduled with prefix hits): `AsyncCopier.submit_gather(store.rows, slots)` snapshots
  the hit positions' rows into the host ring like any step's rows (one `index_select`, then the asynchronous
  D2H copy).
- invalidate: rows are -1 until written; `invalidate()` sets every row to -1 again (a weight reload or a
  wake-up: the KV cache's content came from other weights). A hit on an invalidated or never-written slot reads
  -1 rows, which the consumer reports as `prefix_not_found`: stale routing never reaches a record.

Memory: (slots + 1, L, K) int16 = L x K x 2 bytes per KV slot (Qwen3-30B-A3B: 768 B against ~96 KiB of KV per
token).
"""

from __future__ import annotations

import itertools

import numpy as np
import torch


class PrefixStore:
    """Own the (num_slots + 1, L, K) int16 device table of routing rows by KV slot; row num_slots (index -1) is
    the landing row of padded tokens, never read."""

    def __init__(self, num_slots: int, num_layers: int, top_k: int, device="cpu"):
        if num_slots < 1 or num_layers < 1 or top_k < 1:
            raise ValueError(f"num_slots={num_slots}, num_layers={num_layers}, top_k={top_k} must be >= 1")
        self.num_slots = int(num_slots)
        self.table = torch.full((num_slots + 1, num_layers, top_k), -1, dtype=torch.int16, device=device)
        self.rows = self.table[:num_slots]          # what gathers read: real slots only
        self._minus_one = torch.full((), -1, dtype=torch.int16, device=device)   # on the device: graph-safe
        self.invalidations = 0

    @property
    def nbytes(self) -> int:
        return self.table.numel() * self.table.element_size()

    def write(self, slots: torch.Tensor, step_rows: torch.Tensor) -> None:
        """Store a step's rows at their KV slots. slots: (n,) int64 on the store's device, each in
        [0, num_slots) or -1 (a padded token: lands in the spare row); step_rows: (n, L, K) int16 (any strides,
        e.g. the routing cache's layer-major rows transposed). Graph-safe: one kernel, no host sync."""
        self.table.index_put_((slots,), step_rows)

    def forget(self, slots: torch.Tensor) -> None:
        """Mark these slots as holding no known routing (a step whose routing was not fully recorded); -1
        (padding) is allowed, as in write(). Graph-safe."""
        self.table.index_put_((slots,), self._minus_one)

    def invalidate(self) -> None:
        """Every slot back to -1: nothing computed so far may be read as a hit's routing."""
        self.table.fill_(-1)
        self.invalidations += 1


def hit_slots(block_row, block_size: int, num_tokens: int):
    """The KV slots of positions [0, num_tokens) of a request whose block-table row is `block_row` (numpy, the
    engine's block ids in order), computed as vLLM's slot mapping does without context parallelism:
    block_row[pos // block_size] * block_size + pos % block_size. Returns an (num_tokens,) int64 numpy array."""
    return hit_slots_many([(block_row, 0, num_tokens)], block_size)


def hit_slots_many(spans, block_size: int) -> np.ndarray:
    """The KV slots of many requests' positions in one go, concatenated in order: `spans` holds (block_row, start,
    count) per request, for positions [start, start + count) (block_row: a sequence of the engine's block ids in
    order). Equal to concatenating hit_slots(row, block_size, start + count)[start:] over the spans, in a fixed
    number of numpy calls where every span is block-aligned (prefix-cache hits are whole blocks), one slice per
    span otherwise."""
    bs = block_size
    rows, cuts, aligned, total = [], [], True, 0
    for row, start, count in spans:
        b0 = start // bs
        b1 = (start + count + bs - 1) // bs
        rows.append(row[b0:b1])
        cuts.append((total * bs + start - b0 * bs, count))    # where the span's slots sit in the blocks' slots
        total += b1 - b0
        aligned = aligned and start % bs == 0 and count % bs == 0
    blocks = np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int64, count=total)
    slots = (blocks[:, None] * bs + np.arange(bs, dtype=np.int64)).reshape(-1)
    if aligned or not cuts:
        return slots
    return np.concatenate([slots[at:at + count] for at, count in cuts])
