"""Build a finished request's Record from its state (consumer/request_state.py): the Accumulator's record builders.

`build_adopted`: a request whose rows all still are the received frame (`_Adopted`) and that ended the usual way
(its prompt rows a view of the frame). `build_whole`: one that ended the usual way with its rows in the arena (a
view of its region). `build_record`: the general path, the reference the two shortcuts must equal (missing ranges,
-1 rows, reasons). None of them copies rows it can leave in place; the Accumulator owns the state they read and
counts what they return.
"""

from __future__ import annotations

import numpy as np

from routing_replay.consumer.request_state import _Adopted, _in_ranges, _merge, _Request, _Rows, _runs
from routing_replay.protocol import wire


def _overlap(ranges, missing: list) -> bool:
    """Whether any [lo, hi) of `ranges` overlaps any of `missing`."""
    return any(a < m[1] and m[0] < b for a, b in ranges for m in missing)


_last_layer_id_array: tuple = (None, None)    # (list, int32 array of it): the opens of one model share one list


def _layer_id_array(ids: list) -> np.ndarray:
    """A record's own int32 copy of its layer ids (wire.parse_open hands the opens of one model the same list)."""
    global _last_layer_id_array
    last, arr = _last_layer_id_array
    if ids is not last:
        arr = np.asarray(ids, dtype=np.int32)
        _last_layer_id_array = (ids, arr)
    return arr.copy()


def build_record(st: _Request, prefix) -> wire.Record:
    """`st`'s record by the general path, from its rows in the arena whatever happened to it: -1 where no row
    came, every such range listed missing, and the reason it is incomplete. `prefix`: the Accumulator's PrefixRefs
    (its references' rows are written in from their sources)."""
    end = st.finish
    G, finish_reason, lost, aborted = end.num_output, end.reason, end.lost, end.aborted
    P, C = st.prompt_len, min(st.num_cached, st.prompt_len)
    # rows below `floor` carry no routing by design (prefix-cache hits, sentinel mode); with prefix_filled the
    # producer sent them too, and every row below need_hi must be there
    F = C if st.prefix_filled else 0
    floor = 0 if st.prefix_filled else C
    L = st.num_layers or 0
    K = st.top_k or 0
    dt = st.id_dtype or wire.ROW_DTYPE
    miss = wire.missing_id(dt)
    total = P + G
    need_hi = P + G - 1 if G > 0 else P        # the last output token is never fed to the model
    keys = sorted(st.ranges)
    disjoint = all(a[1] <= b[0] for a, b in zip(keys, keys[1:]))
    st.lease = None
    in_place = L and total and keys == [(0, L)]
    # one range of every layer (the normal case): the record is a view of the request's rows, -1 written
    # where nothing was; disjoint ranges write each byte once: copy what is held, -1 only for the rest
    if in_place:
        rows = st.ranges[(0, L)]
        lease = rows.arena.lease(rows.h, total, (total, L, K), dt)
        st.lease = ((0, L), lease)
        arr = np.asarray(lease)
    elif disjoint:
        arr = np.empty((total, L, K), dtype=dt)
    else:
        arr = np.full((total, L, K), miss, dtype=dt)
    missing: list[list[int]] = []
    covered = np.zeros(L, dtype=bool)
    for (lo, hi), rows in st.ranges.items():
        if not in_place:
            rows.copy_into(arr, lo, hi, total)
        if disjoint and rows.n < total:
            arr[rows.n:, lo:hi] = miss          # never written (holes below n are -1 in the region already)
        covered[lo:hi] = True
        missing += rows.missing(floor, need_hi)
    if disjoint and L and not covered.all():
        arr[:, ~covered] = miss
    arr[:floor] = miss
    if G > 0:
        arr[total - 1] = miss
    if L and not covered.all():
        missing.append([floor, need_hi])
    not_found: list[list[int]] = []
    if F and L:
        # prefix rows the producer sent as -1: their source was gone from its store (evicted, invalidated)
        sent = np.zeros(F, dtype=bool)
        for rows in st.ranges.values():
            sent[:min(rows.n, F)] = True
        sent_missing = (arr[:F] < 0) if miss < 0 else (arr[:F] == miss)
        bad = sent & sent_missing.reshape(F, -1).any(axis=1)
        bad &= ~_in_ranges(F, missing)
        if bad.any():
            not_found = _runs(bad)
            missing += not_found
            arr[:F][bad] = miss
    unresolved: list = []
    if st.refs and L:
        missing, unresolved = prefix.resolve(st, arr, missing)
    for a, b in lost:                           # the producer dropped rows here: whatever the positions hold
        if b > floor and a < need_hi:           # now may be older rows that those would have overwritten
            missing.append([max(a, floor), min(b, need_hi)])
            arr[max(a, floor):min(b, need_hi)] = miss
    missing = _merge(missing)
    notes = list(st.notes)
    if L == 0 and need_hi > floor:
        missing = [[floor, need_hi]]
    reason = ""
    complete = not missing and not aborted and "no_open" not in notes and not st.damaged
    if not complete:
        if aborted:
            reason = finish_reason if finish_reason else "abort"
        elif _overlap(end.refused, missing):
            reason = "producer_refused"
        elif _overlap(end.broker_refused, missing):
            reason = "broker_refused"
        elif _overlap(lost, missing):
            reason = "producer_queue_full"
        elif notes:
            reason = notes[0]
        elif unresolved:
            reason = "prefix_unresolved"
        elif L and not covered.all():
            reason = "layers_missing"
        elif not_found:
            reason = "prefix_not_found"
        else:
            reason = "rows_not_delivered"
        if aborted:
            finish_reason = "abort" if finish_reason in ("", "timeout") and not notes else finish_reason
    layer_ids = np.asarray(st.layer_ids if st.layer_ids is not None else range(L), dtype=np.int32)
    return wire.Record(st.rid, arr[:P], arr[P:], C, layer_ids, complete, [tuple(m) for m in missing],
                       reason, finish_reason, st.prompt_tokens, end.output_tokens, F)


def usual_end(st: _Request):
    """The one range of all layers of a request that ended the usual way (finished, not aborted, nothing lost,
    noted or damaged, no prefix rows sent, rows up to its last fed token), or None: what build_adopted and
    build_whole start from."""
    end = st.finish
    if (end.aborted or end.lost or st.notes or st.damaged or st.prefix_filled or len(st.ranges) != 1
            or st.layer_ids is None):
        return None
    rows = st.ranges.get((0, st.num_layers))
    P, G = st.prompt_len, end.num_output
    if rows is None or not P + G or rows.n < (P + G - 1 if G > 0 else P):
        return None
    return rows


def build_adopted(st: _Request) -> wire.Record | None:
    """build_whole's record for a request whose rows are all still as received (_Adopted), or None: its prompt
    rows are a view of the received frame, its generation rows (at most the few that came with the prompt,
    then -1) a small array of their own. Only where no row needs -1 in the prompt (no prefix-cache hits)."""
    ad = usual_end(st)
    end = st.finish
    P, G = st.prompt_len, end.num_output
    total = P + G
    n = ad.n if type(ad) is _Adopted else 0
    if not n or n > total or min(st.num_cached, P):
        return None
    L, K = st.num_layers, st.top_k
    dt = ad.shape[4]
    rows = ad.buf.view(dt).reshape(n, L, K)
    gen = np.empty((G, L, K), dtype=dt)
    g = min(n, total - 1 if G > 0 else total) - P      # generation rows that came (the last one never does)
    gen[:g] = rows[P:P + g]
    gen[g:] = wire.missing_id(dt)
    return wire.Record(st.rid, rows[:P], gen, 0, _layer_id_array(st.layer_ids), True, [], "", end.reason,
                       st.prompt_tokens, end.output_tokens, 0)


def build_whole(st: _Request) -> wire.Record | None:
    """The record of a request that ended the usual way, or None: finished (not aborted), every row below the
    last fed token delivered in one range of all layers (holes only below its cached prefix), nothing lost, noted
    or damaged, no prefix rows sent. Then the record is complete by construction and this is build_record's result without its
    general bookkeeping (covered layers, missing ranges, reasons): a view of the rows, -1 where no routing
    exists (prefix-cache hits, the last output token). The general path stays the reference (tests compare
    the two on the same requests)."""
    rows = usual_end(st)
    if type(rows) is not _Rows:
        return None
    end, L = st.finish, st.num_layers
    P, G = st.prompt_len, end.num_output
    total = P + G
    n = rows.n
    C = min(st.num_cached, P)
    if rows.holes and rows.holes[-1][1] > C:
        return None                             # (a hole below C: the prefix-cache hits never sent)
    dt = st.id_dtype or wire.ROW_DTYPE
    miss = wire.missing_id(dt)
    lease = rows.arena.lease(rows.h, total, (total, L, st.top_k), dt)
    st.lease = ((0, L), lease)
    arr = np.asarray(lease)
    if n < total:
        arr[n:] = miss
    if C:
        arr[:C] = miss
    if G > 0:
        arr[total - 1] = miss
    return wire.Record(st.rid, arr[:P], arr[P:], C, _layer_id_array(st.layer_ids), True, [], "", end.reason,
                       st.prompt_tokens, end.output_tokens, 0)
