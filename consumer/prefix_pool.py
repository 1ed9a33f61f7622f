"""Keep finished records' prompt rows for the requests that reference them (prefix_refs), and store those once.

An open with `prefix_refs` says that some of its prompt rows are an earlier request's rows (the engine's KV blocks
that request computed; wire.parse_prefix_refs). The rows are not sent: the consumer resolves each reference
against the writer's rows it holds, the request in flight (Accumulator) or the entry this pool keeps of its
finished record. A record whose references all resolved to pool entries is stored compact (`CompactRecord`: its
own prompt rows only, the references, its entries pinned) and materialised, bit for bit the record it stands
for, when it leaves the consumer (fetch, npz, subscribers, on_record). Nothing is guessed: a reference the pool
cannot serve leaves its rows -1, listed missing (the Accumulator names the reason `prefix_unresolved`).

The pool is bounded by bytes (LRU): entries pinned by a held compact record are never evicted; the others go
oldest-used first. An entry of a record that is a view of the consumer's arena keeps that record's region (prompt
and generation rows) alive: it counts both.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from routing_replay.protocol import wire

log = logging.getLogger("routing_replay.consumer")

PREFIX_POOL_BYTES = 256 << 20


class PoolEntry:
    """Own one finished request's prompt rows as the pool keeps them: `rows` (n, L, K) and, per prompt position,
    the row of `rows` holding it (`index`, -1: not held: never computed, missing, or itself a reference)."""

    __slots__ = ("key", "rows", "index", "nbytes", "pins", "shape")

    def __init__(self, key: str, rows: np.ndarray, index: np.ndarray, nbytes: int):
        self.key, self.rows, self.index, self.nbytes = key, rows, index, nbytes
        self.pins = 0
        self.shape = rows.shape[1:]

    def take(self, wpos: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Rows [wpos, wpos + n) of the writer: (their row indices into `rows`, -1 where not held; whether each is
        held)."""
        idx = np.full(n, -1, np.int64)
        hi = min(wpos + n, len(self.index))
        if hi > wpos:
            idx[:hi - wpos] = self.index[wpos:hi]
        return idx, idx >= 0


@dataclass
class CompactRecord(wire.Record):
    """A record held without the prompt rows its references cover: `prompt_routed_experts` holds the others, in
    position order; `refs` are (entry, writer_pos, pos, count) with every row held by the entry (pinned)."""

    refs: tuple = ()
    prompt_len: int = 0
    pinned: bool = True

    @property
    def nbytes(self) -> int:
        return super().nbytes + sum(8 * 4 for _ in self.refs)


def _positions_kept(P: int, refs) -> np.ndarray:
    keep = np.ones(P, bool)
    for _, _, pos, n in refs:
        keep[pos:pos + n] = False
    return keep


class PrefixPool:
    """Own the entries of finished records' prompt rows by request id (LRU, `max_bytes`), and their pins."""

    def __init__(self, max_bytes: int = PREFIX_POOL_BYTES):
        if max_bytes < 0:
            raise ValueError(f"prefix pool max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple, PoolEntry] = OrderedDict()
        self.bytes = 0
        self.evicted = 0            # entries dropped for room
        self.compacted = 0          # records stored compact
        self.ref_rows = 0           # prompt rows of records stored by reference (not held twice)
        self.materialized = 0       # compact records made whole again

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: tuple) -> PoolEntry | None:
        """The entry of (producer id, request id), marked used."""
        e = self._entries.get(key)
        if e is not None:
            self._entries.move_to_end(key)
        return e

    def pin(self, e: PoolEntry) -> None:
        e.pins += 1

    def unpin(self, e: PoolEntry) -> None:
        e.pins -= 1
        if e.pins == 0 and self.bytes > self.max_bytes:
            self._evict()

    def put(self, rec: wire.Record, own: np.ndarray | None = None, view: bool = True,
            key: tuple | None = None) -> PoolEntry | None:
        """Keep `rec`'s prompt rows as the entry of `key` ((producer id, request id): one engine's request; default
        ("", its request id)) (replacing an older one of that id, which stays
        valid for the records that pinned it). `own`: the positions whose rows `rec` holds (bool per prompt
        position; None: all). Rows listed missing, and rows below num_cached of a record without prefix rows, are
        not held. `view`: the record's arrays are a view of a larger region (counted whole)."""
        P = rec.prompt_routed_experts.shape[0] if own is None else len(own)
        if not P or self.max_bytes == 0:
            return None
        rows = rec.prompt_routed_experts
        # a row holding the missing value (-1, or 255/65535 in compact rows) is no routing: never served
        neg = (rows == wire.missing_id(rows.dtype)).reshape(len(rows), -1).any(axis=1)
        held = np.ones(P, bool) if own is None else own.copy()
        if own is None:
            held &= ~neg
        else:
            held[own] &= ~neg
        held[:min(rec.num_cached_tokens, P)] &= rec.num_prefix_filled > 0
        for lo, hi in rec.missing:
            held[max(lo, 0):min(hi, P)] = False
        index = np.full(P, -1, np.int32)
        if own is None:
            index[held] = np.flatnonzero(held)
        else:
            rank = np.cumsum(own) - 1                   # own rows are stored in position order
            index[held] = rank[held]
        nbytes = rec.prompt_routed_experts.nbytes + index.nbytes + (rec.routed_experts.nbytes if view else 0)
        key = ("", rec.request_id) if key is None else key
        e = PoolEntry(key, rec.prompt_routed_experts, index, nbytes)
        old = self._entries.pop(key, None)
        if old is not None:
            self.bytes -= old.nbytes
        self._entries[key] = e
        self.bytes += nbytes
        if self.bytes > self.max_bytes:
            self._evict()
        return e

    def _evict(self) -> None:
        for key in [k for k, e in self._entries.items() if e.pins == 0]:
            if self.bytes <= self.max_bytes:
                break
            e = self._entries.pop(key)
            self.bytes -= e.nbytes
            self.evicted += 1

    # ---- compact records ------------------------------------------------------------------------------------------

    def compact(self, rec: wire.Record, refs: list) -> wire.Record:
        """`rec` (whole, its referenced rows resolved) held as a CompactRecord without the rows of `refs` ((entry,
        writer_pos, pos, count), each row held by its entry), pinning their entries; `rec` itself when none."""
        if not refs:
            return rec
        P = rec.prompt_routed_experts.shape[0]
        keep = _positions_kept(P, refs)
        own = rec.prompt_routed_experts[keep]           # (copies: the record's arena region goes back)
        gen = rec.routed_experts.copy()
        for e, *_ in refs:
            self.pin(e)
        self.compacted += 1
        self.ref_rows += P - len(own)
        return CompactRecord(rec.request_id, own, gen, rec.num_cached_tokens, rec.moe_layer_ids, rec.complete,
                             rec.missing, rec.reason, rec.finish_reason, rec.prompt_token_ids, rec.output_token_ids,
                             rec.num_prefix_filled, rec.layer_range, rec.token_range, tuple(refs), P)

    def materialize(self, rec: wire.Record) -> wire.Record:
        """The whole record a CompactRecord stands for (new arrays; `rec` and its pins unchanged); any other record
        as it is."""
        if type(rec) is not CompactRecord:
            return rec
        P = rec.prompt_len
        own = rec.prompt_routed_experts
        prompt = np.empty((P, *own.shape[1:]), own.dtype)
        prompt[_positions_kept(P, rec.refs)] = own
        for e, wpos, pos, n in rec.refs:
            idx, _ = e.take(wpos, n)
            prompt[pos:pos + n] = e.rows[idx]
        self.materialized += 1
        return wire.Record(rec.request_id, prompt, rec.routed_experts, rec.num_cached_tokens, rec.moe_layer_ids,
                           rec.complete, rec.missing, rec.reason, rec.finish_reason, rec.prompt_token_ids,
                           rec.output_token_ids, rec.num_prefix_filled, rec.layer_range, rec.token_range)

    def release(self, rec: wire.Record) -> None:
        """A CompactRecord is no longer held: its entries' pins go (no-op for any other record)."""
        if type(rec) is CompactRecord and rec.pinned:
            rec.pinned = False              # (it still holds its entries: a later materialize stays exact)
            for e, *_ in rec.refs:
                self.unpin(e)
