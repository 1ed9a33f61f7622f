"""Resolve the Accumulator's prefix references (an open's prefix_refs): find each one's source at the open, write
its rows into the record at the build, and hand the finished record to the pool (consumer/prefix_pool.py).

A source is the writer in flight here (its rows copied at the build), else the pool's entry of its finished record
(pinned until the referencing record is emitted), else none (the rows come out -1, unresolved).
"""

from __future__ import annotations

import numpy as np

from routing_replay.consumer.prefix_pool import PoolEntry, PrefixPool
from routing_replay.consumer.request_state import _in_ranges, _Request, _Rows, _runs, _subtract
from routing_replay.protocol import wire


class PrefixRefs:
    """Own in-flight requests' references to the rows of other requests: their sources, the pins those hold on pool
    entries, and the pool's entry of each finished record with prefix rows. `requests`: the Accumulator's
    in-flight requests (that same dict, only read here); `stats`: its AccumulatorStats (the prefix_* counts)."""

    def __init__(self, pool: PrefixPool, requests: dict, stats):
        self.pool = pool
        self.requests = requests
        self.stats = stats

    def set_refs(self, st: _Request, refs: tuple, producer: str) -> None:
        """The sources of an open's prefix_refs, found now: the writer in flight here, else its pool entry
        (pinned until the record is emitted), else none (its rows come out unresolved). Found at the open, not at
        the build: the writer's id may be opened again by a later request meanwhile. Only the same producer's
        requests are writers (one engine's KV cache; another engine's request of that id is another request)."""
        self.unpin(st)
        out = []
        for w, wp, pos, n in refs:
            src = self.requests.get(w)
            if src is None or not src.opened or src is st or src.key is None or src.key[0] != producer:
                src = self.pool.get((producer, w))
                if src is not None:
                    self.pool.pin(src)
            out.append((src, wp, pos, n))
        st.refs = out

    def unpin(self, st: _Request) -> None:
        """Let go of the pool entries `st`'s references pinned; it has none after."""
        for src, *_ in st.refs:
            if type(src) is PoolEntry:
                self.pool.unpin(src)
        st.refs = []

    def resolve(self, st: _Request, arr: np.ndarray, missing: list) -> tuple[list, list]:
        """Write each reference's rows into `arr` (P + G, L, K) from its source: (missing without the rows that
        resolved, the [lo, hi) runs that did not). Records which references a pool entry served whole
        (st.resolved: compaction leaves their rows out)."""
        st.resolved = []
        good = live = 0
        miss = wire.missing_id(arr.dtype)
        P = st.prompt_len
        shape = arr.shape[1:]
        bad = np.zeros(P, bool)
        for src, wp, pos, n in st.refs:
            if pos + n > P:
                continue                            # (checked against num_cached at the open)
            missing = _subtract(missing, pos, pos + n)
            if type(src) is _Request and src.entry is not None:
                src = src.entry                     # the writer finished since: its entry
            ok = np.zeros(n, bool)
            if type(src) is PoolEntry and src.shape == shape and src.rows.dtype == arr.dtype:
                idx, ok = src.take(wp, n)
                arr[pos:pos + n][ok] = src.rows[idx[ok]]
                if ok.all():
                    st.resolved.append((src, wp, pos, n))
            elif type(src) is _Request and self.requests.get(src.rid) is src and src.num_layers is not None:
                rows = src.ranges.get((0, src.num_layers))
                if ((src.num_layers, src.top_k) == shape[:2] and type(rows) is _Rows and rows.n > wp
                        and (src.id_dtype or wire.ROW_DTYPE) == arr.dtype):
                    tmp = np.full((min(rows.n, wp + n), *shape), miss, arr.dtype)
                    rows.copy_into(tmp, 0, src.num_layers, len(tmp))
                    got = tmp[wp:]
                    ok[:len(got)] = (got != miss).reshape(len(got), -1).all(axis=1)
                    ok[:len(got)] &= ~_in_ranges(wp + len(got), rows.holes)[wp:]
                    arr[pos:pos + n][ok] = got[ok[:len(got)]]
                    live += int(ok.sum())
            bad[pos:pos + n] |= ~ok
            good += int(ok.sum())
        st.ref_rows = (good, live, int(bad.sum()))
        unresolved = _runs(bad) if bad.any() else []
        for a, b in unresolved:
            arr[a:b] = miss
        return missing + unresolved, unresolved

    def compact(self, st: _Request, rec: wire.Record) -> wire.Record:
        """`st` is done and had references: its record, compact where pool entries serve some of its prompt rows
        (consumer/prefix_pool.py); its pins go and its referenced rows are counted."""
        rec = self.pool.compact(rec, st.resolved)
        self.unpin(st)
        good, live, bad = st.ref_rows
        self.stats.prefix_ref_rows += good
        self.stats.prefix_live_rows += live
        self.stats.prefix_unresolved_rows += bad
        self.stats.prefix_unresolved += bad > 0
        return rec

    def keep(self, st: _Request, rec: wire.Record) -> None:
        """`st` is done and sent prefix rows: its record's prompt rows become the pool's entry of its id (only the
        rows it holds itself, where it is compact)."""
        own = getattr(rec, "refs", None)
        keep = None
        if own:
            keep = np.ones(rec.prompt_len, bool)
            for _, _, pos, n in own:
                keep[pos:pos + n] = False
        st.entry = self.pool.put(rec, keep, view=not own and st.lease is not None,
                                 key=(st.key[0] if st.key is not None else "", st.rid))
