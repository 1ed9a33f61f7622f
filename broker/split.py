"""Split one delta (one engine step, many requests) into one delta per owner: a re-encoded header with that owner's
requests and the matching byte ranges of the payload, zero-copy where it pays (socket-free).

The rows of the requests follow each other in key order, so each owner's rows are a few contiguous runs of the
payload. One run is forwarded as one slice of the received frame; several runs that are large on average (at least
wire.COPY_THRESHOLD bytes each) go as one slice each (frame boundaries fall on request boundaries, which
wire.check_payload allows); many small runs (decode steps: a row or two per request) are gathered into one frame
(also when the payload came in several frames: a producer's coalesced steps, read in place).

The split of a key list is a `Plan` (per owner: its entries, its key list packed once, its byte ranges or rows),
computed once and reused by the broker for every delta of the same producer with the same key list and counts
while the ownership table's version is unchanged: a decode step then costs a constant number of numpy calls.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import msgpack
import numpy as np

from routing_replay.protocol import wire


class Part(NamedTuple):
    """One owner's share of a split delta: its header frame and payload frames."""

    owner: Any
    head: bytes
    frames: list


class PlanPart(NamedTuple):
    """How one owner's share of a delta is cut out: its entries, its key list packed once, and its payload as
    byte ranges of the received payload (`slices`, zero-copy) or as rows to gather (`rows`, `per` bytes each)."""

    owner: Any
    idx: np.ndarray | None        # the owner's entries (None: all of them, in order: the message goes as it is)
    key: bytes                    # msgpack of the owner's request ids
    slices: list | None           # [(a, b)] byte ranges, one frame each
    rows: np.ndarray | None       # or: indexes of `per`-byte units to gather into one frame
    per: int


class Plan(NamedTuple):
    """The split of one delta key list with one count list, under one ownership table version: decode steps
    repeat both, so the broker computes it once per change, not per message (Broker._route_delta)."""

    ids: list
    counts: bytes
    version: int
    parts: list
    gathered: int = 0             # parts whose rows are gathered (copied) rather than sliced
    row_bytes: int = 0            # the delta's row size (its `ids` dtype's itemsize): a plan holds for that only


def plan_split(d: wire.Delta, counts_raw: bytes, owners: list, distinct: set, version: int) -> Plan:
    """The Plan for delta `d` (whose `count` field is `counts_raw`); `owners[i]` owns request `d.request_ids[i]`."""
    ids = d.request_ids
    if len(distinct) == 1:
        (o,) = distinct
        return Plan(ids, counts_raw, version, [PlanPart(o, None, b"", None, None, 0)], 0, d.row_bytes)
    rb = d.row_bytes
    index = {o: i for i, o in enumerate(distinct)}
    codes = np.fromiter(map(index.__getitem__, owners), dtype=np.int16, count=len(owners))
    counts = d.counts
    uniform = d.total_rows == len(counts) * int(counts[0]) and int(counts.min()) == int(counts[0])
    per = int(counts[0]) * rb
    if not uniform:
        offs = np.zeros(len(counts) + 1, dtype=np.int64)
        np.cumsum(counts, out=offs[1:])
        offs *= rb
    parts = []
    for o, c in index.items():
        idx = np.flatnonzero(codes == c)
        key = _PACKER.pack([ids[i] for i in idx.tolist()])
        # contiguous runs of this owner's requests: [run_lo, run_hi) in request index space
        brk = np.flatnonzero(np.diff(idx) != 1)
        run_lo = np.concatenate(([idx[0]], idx[brk + 1]))
        run_hi = np.concatenate((idx[brk] + 1, [idx[-1] + 1]))
        if uniform:
            a_bytes, b_bytes = run_lo * per, run_hi * per
        else:
            a_bytes, b_bytes = offs[run_lo], offs[run_hi]
        total = int((b_bytes - a_bytes).sum())
        if len(run_lo) == 1 or total >= wire.COPY_THRESHOLD * len(run_lo):
            parts.append(PlanPart(o, idx, key, list(zip(a_bytes.tolist(), b_bytes.tolist())), None, 0))
        elif uniform:
            parts.append(PlanPart(o, idx, key, None, idx, per))
        else:                       # many short uneven runs: gather the rows of every run
            lens = (b_bytes - a_bytes) // rb
            first = np.cumsum(lens) - lens
            rows = np.repeat(a_bytes // rb - first, lens) + np.arange(int(lens.sum()))
            parts.append(PlanPart(o, idx, key, None, rows, rb))
    return Plan(ids, counts_raw, version, parts, sum(p.rows is not None for p in parts), rb)


def apply_plan(h: wire.Header, d: wire.Delta, plan: Plan, payload: Sequence) -> list[Part]:
    """One Part per owner of `plan`; `payload` passed check_payload (its frames end on request boundaries)."""
    parts = []
    views = None
    for p in plan.parts:
        if p.idx is None:
            return [Part(p.owner, None, list(payload))]
        body = wire.delta_body(d.starts[p.idx], d.counts[p.idx], d.num_layers, d.top_k, d.layer_lo, d.layer_hi,
                               d.dtype)
        head = wire.pack_header_packed_key("delta", h.producer, h.epoch, h.seq, p.key, body)
        if views is None:
            views = [memoryview(f.buffer if hasattr(f, "buffer") else f).cast("B") for f in payload]
            ends = np.cumsum([len(v) for v in views]).tolist()
        if p.slices is not None:
            frames = _slices(views, ends, p.slices)
        elif p.per and len(p.rows):
            frames = _gather(views, ends, p.rows, p.per)
        else:
            frames = [b""]
        parts.append(Part(p.owner, head, frames))
    return parts


def _slices(views: list, ends: list, slices: list) -> list:
    """Byte ranges [a, b) of the payload (its frames end at `ends`) as views of the frames, zero-copy: one frame per
    range, or per piece of a range that crosses frames (frame ends fall on request boundaries)."""
    if len(views) == 1:
        mv = views[0]
        return [mv[a:b] for a, b in slices]
    out = []
    fi = 0
    for a, b in slices:
        while a < b:
            while ends[fi] <= a:
                fi += 1
            base = ends[fi] - len(views[fi])
            e = min(b, ends[fi])
            out.append(views[fi][a - base:e - base])
            a = e
    return out


def _gather(views: list, ends: list, units: np.ndarray, per: int) -> list:
    """The `per`-byte units `units` (ascending) of the payload gathered into one frame, from however many payload
    frames they come (frame ends fall on request boundaries, so on unit boundaries)."""
    dt = np.dtype((np.void, per))
    if len(views) == 1:
        return [np.frombuffer(views[0], dtype=dt).take(units)]
    out = np.empty(len(units), dtype=dt)
    cuts = np.searchsorted(units, np.asarray(ends, dtype=np.int64) // per).tolist()
    lo = 0
    u0 = 0
    for v, hi in zip(views, cuts):
        if hi > lo:
            np.frombuffer(v, dtype=dt).take(units[lo:hi] - u0, out=out[lo:hi], mode="clip")
        lo = hi
        u0 += len(v) // per
    return [out]


_PACKER = msgpack.Packer(use_bin_type=True)


def split_delta(h: wire.Header, d: wire.Delta, owners: list, distinct: set, payload: Sequence) -> list[Part]:
    """One Part per distinct owner; `owners[i]` owns request `d.request_ids[i]`; `payload` passed check_payload."""
    return apply_plan(h, d, plan_split(d, b"", owners, distinct, 0), payload)
