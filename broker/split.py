"""Split one delta (one engine step, many requests) into one delta per owner: a re-encoded header with that owner's
requests and the matching byte ranges of the payload, zero-copy where it pays (socket-free).

The rows of the requests follow each other in key order, so each owner's rows are a few contiguous runs of the
payload. One run is forwarded as one slice of the received frame; several runs that are large on average (at least
wire.COPY_THRESHOLD bytes each) go as one slice each (frame boundaries fall on request boundaries, which
wire.check_payload allows); many small runs (decode steps: a row or two per request) are gathered into one frame.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import numpy as np

from routing_replay.protocol import wire


class Part(NamedTuple):
    """One owner's share of a split delta: its header frame and payload frames."""

    owner: Any
    head: bytes
    frames: list


def _payload_view(payload: Sequence) -> memoryview:
    if len(payload) == 1:
        f = payload[0]
        return memoryview(f.buffer if hasattr(f, "buffer") else f)
    return memoryview(b"".join(bytes(f.buffer if hasattr(f, "buffer") else f) for f in payload))


def split_delta(h: wire.Header, d: wire.Delta, owners: list, distinct: set, payload: Sequence) -> list[Part]:
    """One Part per distinct owner; `owners[i]` owns request `d.request_ids[i]`; `payload` passed check_payload."""
    rb = d.row_bytes
    ids = d.request_ids
    index = {o: i for i, o in enumerate(distinct)}
    codes = np.fromiter(map(index.__getitem__, owners), dtype=np.int16, count=len(owners))
    mv = _payload_view(payload)
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
        body = wire.delta_body(d.starts[idx], counts[idx], d.num_layers, d.top_k, d.layer_lo, d.layer_hi)
        head = wire.pack_header("delta", h.producer, h.epoch, h.seq, [ids[i] for i in idx.tolist()], body)
        # contiguous runs of this owner's requests: [run_lo, run_hi) in request index space
        brk = np.flatnonzero(np.diff(idx) != 1)
        run_lo = np.concatenate(([idx[0]], idx[brk + 1]))
        run_hi = np.concatenate((idx[brk] + 1, [idx[-1] + 1]))
        if uniform:
            a_bytes, b_bytes = run_lo * per, run_hi * per
        else:
            a_bytes, b_bytes = offs[run_lo], offs[run_hi]
        total = int((b_bytes - a_bytes).sum())
        if len(run_lo) == 1:
            frames = [mv[int(a_bytes[0]):int(b_bytes[0])]]
        elif total >= wire.COPY_THRESHOLD * len(run_lo):
            frames = [mv[a:b] for a, b in zip(a_bytes.tolist(), b_bytes.tolist())]
        elif uniform and per:
            frames = [np.frombuffer(mv, dtype=np.dtype((np.void, per))).take(idx)]
        else:
            frames = [b"".join(mv[a:b] for a, b in zip(a_bytes.tolist(), b_bytes.tolist()))]
        parts.append(Part(o, head, frames))
    return parts
