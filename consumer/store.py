"""Keep finished records until a trainer fetches them, within a byte bound (spill to disk, or evict and report)."""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from pathlib import Path

from routing_replay.consumer import npz
from routing_replay.consumer.prefix_pool import PrefixPool
from routing_replay.protocol import wire

log = logging.getLogger("routing_replay.consumer")

EVICTED = "evicted"


class RecordStore:
    """Own finished, not-yet-fetched records: in memory up to max_bytes, then in spill_dir, oldest first.

    Without a spill_dir, the oldest record is evicted when the bound is hit; its id is remembered so that a
    later fetch gets an explicit "evicted" answer, and every eviction is counted and logged. Nothing leaves
    silently.
    """

    def __init__(self, max_bytes: int = 2 << 30, spill_dir: str | os.PathLike | None = None,
                 remember_evicted: int = 100_000, pool: PrefixPool | None = None):
        # pool: records held compact (CompactRecord) leave whole (peek, take, spill) and unpin when they go
        self.pool = pool if pool is not None else PrefixPool(0)
        self.max_bytes = max_bytes
        self.spill_dir = Path(spill_dir) if spill_dir else None
        if self.spill_dir:
            self.spill_dir.mkdir(parents=True, exist_ok=True)
        self._mem: OrderedDict[str, wire.Record] = OrderedDict()
        self._spilled: dict[str, Path] = {}
        self._evicted: OrderedDict[str, None] = OrderedDict()
        self._remember = remember_evicted
        self.bytes = 0
        self.spilled = 0
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._mem) + len(self._spilled)

    def put(self, rec: wire.Record) -> None:
        old = self._mem.pop(rec.request_id, None)
        if old is not None:
            self.bytes -= old.nbytes
            self.pool.release(old)
        self._mem[rec.request_id] = rec
        self.bytes += rec.nbytes
        while self.bytes > self.max_bytes and len(self._mem) > 1:
            rid, victim = self._mem.popitem(last=False)
            self.bytes -= victim.nbytes
            whole = self.pool.materialize(victim) if self.spill_dir is not None else victim
            self.pool.release(victim)
            if self.spill_dir is not None:
                try:
                    self._spilled[rid] = npz.write_record(self.spill_dir, whole)
                    self.spilled += 1
                    continue
                except OSError as e:
                    log.error("spill of %r failed (%s); evicting it", rid[:64], e)
            self.evicted += 1
            self._evicted[rid] = None
            if len(self._evicted) > self._remember:
                self._evicted.popitem(last=False)
            log.warning("record store full (%d bytes > %d): evicted %r, evicted_total=%d",
                        self.bytes + victim.nbytes, self.max_bytes, rid[:64], self.evicted)

    def __contains__(self, rid: str) -> bool:
        """True if take() would return something (a record, or EVICTED), without reading anything from disk."""
        return rid in self._mem or rid in self._spilled or rid in self._evicted

    def is_evicted(self, rid: str) -> bool:
        return rid in self._evicted and rid not in self._mem and rid not in self._spilled

    def peek(self, rid: str) -> wire.Record | str | None:
        """The record without removing it (read back from the spill dir if it is there); like take() otherwise."""
        rec = self._mem.get(rid)
        if rec is not None:
            return self.pool.materialize(rec)
        path = self._spilled.get(rid)
        if path is not None:
            return npz.read_record(path, "compact")
        if rid in self._evicted:
            return EVICTED
        return None

    def discard(self, rid: str) -> None:
        """Remove a record (after peek() and a successful send), without reading it back."""
        rec = self._mem.pop(rid, None)
        if rec is not None:
            self.bytes -= rec.nbytes
            self.pool.release(rec)
            return
        path = self._spilled.pop(rid, None)
        if path is not None:
            path.unlink(missing_ok=True)

    def take(self, rid: str) -> wire.Record | str | None:
        """Remove and return the record; EVICTED if it was evicted; None if it is not (yet) here."""
        rec = self._mem.pop(rid, None)
        if rec is not None:
            self.bytes -= rec.nbytes
            whole = self.pool.materialize(rec)
            self.pool.release(rec)
            return whole
        path = self._spilled.pop(rid, None)
        if path is not None:
            rec = npz.read_record(path, "compact")
            path.unlink(missing_ok=True)
            return rec
        if rid in self._evicted:
            return EVICTED
        return None
