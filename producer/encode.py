"""Encode queue items into wire frames: announces (one or batched), steps as deltas (one, several coalesced, or
one too large split into several), each into an Encoded message for the resend buffer. Socket-free: tested on
bytes alone."""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np

from routing_replay.protocol import wire
from routing_replay.producer.books import escaped_id
from routing_replay.producer.items import Announce, Step
from routing_replay.producer.resend import Parts


class Geometry(NamedTuple):
    num_layers: int
    top_k: int
    layer_lo: int
    layer_hi: int
    id_dtype: np.dtype = wire.ROW_DTYPE     # the rows' dtype on the wire: int16 rows are narrowed to it once, here


class Encoded(NamedTuple):
    """One data message ready for the replay buffer."""

    parts: Parts
    frames: list
    payload: int              # routing-row bytes


_TOKEN_KEYS = {"open": "n_prompt_tokens", "finish": "n_output_tokens"}


def token_frames(item: Announce) -> tuple[Announce, str | None]:
    """The announce with its token ids as int32 arrays: the caller's thread handed a list as a tuple, or as the
    list itself when it never modifies it (producer._tokens). Ids that are not int32 integers are left out, with
    the body's count of them: the announce still travels (the record has no token ids then), and the error is
    returned to be reported."""
    if not any(type(x) is tuple or type(x) is list for x in item.frames):
        return item, None
    try:
        frames = []
        for x in item.frames:
            a = np.asarray(x, dtype=wire.TOKEN_DTYPE) if type(x) is tuple or type(x) is list else x
            if a.ndim != 1:
                raise ValueError(f"token ids must be a flat sequence, got shape {a.shape}")
            frames.append(a)
    except (TypeError, ValueError, OverflowError) as e:
        body = dict(item.body)
        body.pop(_TOKEN_KEYS.get(item.kind, ""), None)
        return item._replace(body=body, frames=[]), f"{type(e).__name__}: {str(e)[:200]}"
    return item._replace(frames=frames), None


def encode_announce(item: Announce, producer_id: str, epoch: int, seq: int) -> Encoded:
    head = wire.pack_header(item.kind, producer_id, epoch, seq, item.request_id, item.body)
    extra = [memoryview(np.ascontiguousarray(x)).cast("B") for x in item.frames]
    return Encoded(Parts(item.kind, (item.request_id,)), [head, *extra], 0)


def encode_opens(items: list, producer_id: str, epoch: int, seq: int) -> Encoded:
    """Several requests' open Announces (distinct ids, token ids already int32 arrays, one producer's geometry) as
    one `opens` message."""
    first = items[0].body
    L, K, layer_ids, id_code = first["num_layers"], first["top_k"], first["layer_ids"], first.get("ids", "i2")
    ids, P, C, NT, filled, toks, refs = [], [], [], [], [], [], []
    for it in items:
        b = it.body
        if (b["num_layers"] != L or b["top_k"] != K or b["layer_ids"] != layer_ids
                or b.get("ids", "i2") != id_code):
            raise ValueError(f"opens of one message must share num_layers, top_k, layer_ids and ids; "
                             f"{escaped_id(it.request_id)} differs")
        ids.append(it.request_id)
        P.append(b["prompt_len"])
        C.append(b["num_cached"])
        filled.append(b.get("prefix_filled", False))
        refs.append(b.get("prefix_refs", ()))
        t = it.frames[0] if it.frames else None
        NT.append(0 if t is None else len(t))
        if t is not None and len(t):
            toks.append(t)
    body = wire.opens_body(P, C, L, K, layer_ids, NT if any(NT) else None, filled, refs, ids=id_code)
    head = wire.pack_header("opens", producer_id, epoch, seq, ids, body)
    extra = [memoryview(np.concatenate(toks).astype(wire.TOKEN_DTYPE, copy=False)).cast("B")] if toks else []
    return Encoded(Parts("opens", ids), [head, *extra], 0)


def encode_finishes(items: list, producer_id: str, epoch: int, seq: int) -> Encoded:
    """Several requests' finish Announces (distinct ids, token ids already int32 arrays) as one `finishes`
    message: each entry's body as its `finish` would carry it."""
    ids = [it.request_id for it in items]
    toks = [it.frames[0] for it in items if it.frames and len(it.frames[0])]
    head = wire.pack_header("finishes", producer_id, epoch, seq, ids, {"entries": [it.body for it in items]})
    extra = [memoryview(np.concatenate(toks).astype(wire.TOKEN_DTYPE, copy=False)).cast("B")] if toks else []
    return Encoded(Parts("finishes", ids), [head, *extra], 0)


def kept_rows(rows: np.ndarray, counts: Sequence[int], keep: Sequence[bool]) -> np.ndarray:
    """The rows of the kept request parts, in order (one copy)."""
    pieces, at = [], 0
    for c, k in zip(counts, keep):
        if k:
            pieces.append(rows[at:at + c])
        at += c
    return np.concatenate(pieces, axis=0) if pieces else rows[:0]


def resolved_step(item: Step) -> Step:
    """The step with its rows as an ndarray of its own to keep: deferred rows waited for and their slot released
    here, whatever happens (copied out of it first, unless result() hands out an array of its own or cutting out
    refused parts copied them already); refused parts cut out (keep None)."""
    rows = item.rows
    if isinstance(rows, np.ndarray) and item.keep is None:
        return item
    deferred = not isinstance(rows, np.ndarray)
    try:
        if deferred:
            rows = rows.result()
        rows = np.asarray(rows)
        ids, starts, counts = item.request_ids, item.starts, item.counts
        if item.keep is not None:
            rows = kept_rows(rows, counts, item.keep)
            ids, starts, counts = ([x for x, k in zip(v, item.keep) if k] for v in (ids, starts, counts))
        elif deferred and not item.rows.owns_result:
            rows = rows.copy()          # out of the ring slot before it is released
    finally:
        if deferred:
            item.rows.release()
    return Step(ids, starts, counts, rows)


def encode_step(item: Step, producer_id: str, epoch: int, seq: int, g: Geometry) -> Encoded:
    """Wait for deferred rows, cut out refused parts, and encode the delta (the deferred slot is released here,
    whatever happens: resolved_step)."""
    item = resolved_step(item)
    ids, starts, counts = item.request_ids, item.starts, item.counts
    rows = item.rows
    if g.id_dtype != wire.ROW_DTYPE and rows.dtype == wire.ROW_DTYPE:
        rows = wire.narrow_rows(rows, g.id_dtype)       # ValueError naming an id that does not fit: refused
    body = wire.delta_body(starts, counts, g.num_layers, g.top_k, g.layer_lo, g.layer_hi, rows.dtype)
    head = wire.pack_header("delta", producer_id, epoch, seq, ids, body)
    payload = memoryview(np.ascontiguousarray(rows)).cast("B")
    parts = Parts("delta", ids, starts, counts)        # references: read only when the broker refuses the message
    return Encoded(parts, [head, payload], len(payload))


# or entries, a longer header, and its socket drops a larger frame). A step beyond them goes as several deltas.
DELTA_HEADER_BUDGET = wire.MAX_HEADER_BYTES - (64 << 10)    # for the key list and the start/count arrays
ENTRY_HEADER_BOUND = 13         # an entry's header bytes beyond 4 per id character: str head, start and count
SAFE_ENTRIES = DELTA_HEADER_BUDGET // (wire.MAX_REQUEST_ID_BYTES + ENTRY_HEADER_BOUND)   # never over the budget


def delta_rows_limit(row_bytes: int) -> int:
    """The most rows one delta may carry: the wire's bound, and one frame's (a step's rows are one frame)."""
    return min(wire.MAX_ROWS_PER_DELTA, wire.MAX_PAYLOAD_FRAME_BYTES // row_bytes)


def header_too_long(chars: int, entries: int) -> bool:
    """Whether a delta's key list of `entries` ids of `chars` characters in all, with its start/count arrays, could
    pass the header budget (UTF-8: at most 4 bytes a character)."""
    return 4 * chars + ENTRY_HEADER_BOUND * entries > DELTA_HEADER_BUDGET


def oversized(rows: int, ids: Sequence[str], max_rows: int) -> bool:
    """Whether a step of `rows` rows and these entries is too large for one delta (split_step). Constant time
    unless it has more than SAFE_ENTRIES entries."""
    n = len(ids)
    return rows > max_rows or (n > SAFE_ENTRIES and (n > wire.MAX_REQUESTS_PER_DELTA
                                                     or header_too_long(sum(map(len, ids)), n)))


def split_step(item: Step, max_rows: int, max_entries: int = wire.MAX_REQUESTS_PER_DELTA,
               header_budget: int = DELTA_HEADER_BUDGET) -> list[Step]:
    """A step too large for one delta (oversized) as consecutive steps that each fit, with ndarray rows (views of
    one array). Deferred rows are waited for and their slot released here, whatever happens (copied out of it
    first); refused parts are cut out. The entries are cut in order, a request's rows between two steps where
    they must be (positions are absolute: each part is a delta of its own). ValueError if the rows are not
    (sum(counts), ...)."""
    item = resolved_step(item)
    ids, starts, counts, rows = item.request_ids, item.starts, item.counts, item.rows
    total = int(sum(counts))
    if rows.ndim != 3 or rows.shape[0] != total:
        raise ValueError(f"rows are {rows.shape}, the step's counts add up to {total} rows")
    out: list = []
    part: tuple = ([], [], [])
    lo = at = cost = 0                  # the part's first row, the next row, its header bound
    for rid, s, c in zip(ids, starts, counts):
        s, c = int(s), int(c)
        e = 4 * len(rid) + ENTRY_HEADER_BOUND
        while True:
            if part[0] and (len(part[0]) >= max_entries or cost + e > header_budget or at - lo >= max_rows):
                out.append(Step(*part, rows[lo:at]))
                part, lo, cost = ([], [], []), at, 0
            take = min(c, max_rows - (at - lo))
            part[0].append(rid)
            part[1].append(s)
            part[2].append(take)
            cost += e
            at += take
            s += take
            c -= take
            if c == 0:
                break
    if part[0]:
        out.append(Step(*part, rows[lo:at]))
    return out


def step_rows(item: Step) -> int:
    """Rows a queued step carries (all of them, kept or not)."""
    return int(item.rows.shape[0])


def encode_steps(items: Sequence[Step], producer_id: str, epoch: int, seq: int, g: Geometry,
                 row_shape: tuple) -> tuple[Encoded | None, list]:
    """Several queued steps as one delta: their entries in order, each step's rows one payload frame (frame
    boundaries fall on request boundaries, as wire.check_payload wants; ndarray rows are not copied, deferred rows
    are copied out of their slot once). Every deferred slot is released here, whatever happens. A step whose rows
    cannot be had (result() raises, or the rows are not (sum(counts), L, K) int16) is left out and returned with
    its error, so its positions can be reported lost; the others still travel. Returns (the message or None if no
    step is left, [(step, error)])."""
    ids: list = []
    starts: list = []
    counts: list = []
    frames: list = []
    failed: list = []
    for item in items:
        rows = item.rows
        deferred = not isinstance(rows, np.ndarray)
        owned = deferred and rows.owns_result
        try:
            try:
                if deferred:
                    rows = rows.result()
                rows = np.asarray(rows)
                if rows.dtype != wire.ROW_DTYPE or rows.shape != (sum(item.counts), *row_shape):
                    raise ValueError(f"rows are {rows.shape} {rows.dtype}, expected ({sum(item.counts)}, "
                                     f"{row_shape[0]}, {row_shape[1]}) int16")
                narrowed = g.id_dtype != wire.ROW_DTYPE
                if narrowed:        # the one copy (out of a deferred slot too, before its release)
                    rows = wire.narrow_rows(rows, g.id_dtype)
            except Exception as e:  # noqa: BLE001 (this step's failure; the others go on)
                failed.append((item, e))
                continue
            if item.keep is None:
                ids += item.request_ids
                starts += item.starts
                counts += item.counts
                copied = narrowed
            else:
                rows = kept_rows(rows, item.counts, item.keep)
                copied = True
                for r, st, c, k in zip(item.request_ids, item.starts, item.counts, item.keep):
                    if k:
                        ids.append(r)
                        starts.append(st)
                        counts.append(c)
            if len(rows):
                payload = memoryview(np.ascontiguousarray(rows)).cast("B")
                frames.append(bytes(payload) if deferred and not copied and not owned else payload)
        finally:
            if deferred:
                item.rows.release()
    if not ids:
        return None, failed
    body = wire.delta_body(starts, counts, g.num_layers, g.top_k, g.layer_lo, g.layer_hi, g.id_dtype)
    head = wire.pack_header("delta", producer_id, epoch, seq, ids, body)
    return Encoded(Parts("delta", ids, starts, counts), [head, *frames], sum(len(f) for f in frames)), failed
