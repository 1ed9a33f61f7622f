"""Turn Records into per-token expert-id tensors laid out like the trainer's own batch (padded or packed).

Token alignment. A trainer feeds each sample's prompt followed by its response, P + G tokens. A record holds one
(L, K) row per *input position*: the row of absolute position p is the routing computed when token p was fed
to the model (docs/PROTOCOL.md, "delta"). Prompt token i sits at position i, output token j at position P + j,
so the trainer's input position i takes row i of `concat(prompt_routed_experts, routed_experts)`, with no shift:

    prompt  [p0 p1 p2], output [o0 o1]      trainer input    p0   p1   p2   o0   o1
    prompt_routed_experts (3, L, K)          row          prompt[0] [1]  [2]  gen[0] gen[1]
    routed_experts (2, L, K)                 gen[0] was computed when o0 was fed (decode step 1);
                                             gen[1] is -1: o1 was never fed to the engine.

Records of either id dtype are taken (int16 with -1, or compact uint8/uint16 with `Record.missing_id`: fetched or
loaded with ids="compact"); the tensors are the same for both.
Rows the engine never computed are -1: prefix-cache hits (prompt rows below `num_cached_tokens`), the last
output token's row, and (records with `complete=False`) the positions in `missing`. They, padding, and dense
layers in the "all" layout are flagged in `no_routing`; a trainer lets its own router choose there. The last
output position only affects the logits that follow the response, so its fallback never changes the loss.

Expert ids are *logical* expert ids (0 .. num_experts-1, before any EPLB replica mapping): an expert-parallel
trainer maps them to its ranks itself.

Layouts. "moe": axis L is the MoE layers in model order (the record's own columns, `moe_layer_ids` gives their
model layer index). "all": axis L is every decoder layer (`num_layers` rows), MoE layer `moe_layer_ids[m]`
gets column m of the record and the dense layers stay -1. `layers=(lo, hi)` keeps a slice of that axis, for a
pipeline stage: MoE layer indices [lo, hi) in "moe", model layer indices [lo, hi) in "all".

Sliced records (`TrainerClient.fetch(..., layers=, tokens=)`, wire.slice_record) lay out as they are: a layer
slice's `moe_layer_ids` are its columns (every record of a batch the same slice); a token slice (`token_range`
(lo, hi, n)) is a context-parallel rank's chunk, its rows the chunk's positions lo .. hi - 1 from its first row
on, and `sample_end` says whether the sample's last position (never fed, -1) is among them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np
import torch

from routing_replay.protocol import wire

LAYOUTS = ("moe", "all")
_DTYPES = {"int64": np.int64, "int32": np.int32}


@dataclass
class ReplayTensors:
    """Own one batch's expert ids in the trainer's token layout and the mask of entries that carry no routing.

    expert_ids: (B, S, L, K) padded or (T, L, K) packed, logical expert ids, -1 where `no_routing`.
    no_routing: (B, S, L) or (T, L) bool: padding, prefix-cache hits, never-fed or missing rows, dense layers.
    lengths: (B,) int64 tokens of each sample (P + G, or the trainer's own length).
    cu_seqlens: (B + 1,) int32 packed only (flash-attention convention), None when padded.
    layer_ids: (L,) int32 the model layer index of each column of axis L.
    sample_end: (B,) bool whether each sample's last position is in it (False for a context-parallel chunk that
    stops before its sample's end); None: every sample is whole.
    """

    expert_ids: torch.Tensor
    no_routing: torch.Tensor
    lengths: torch.Tensor
    layer_ids: torch.Tensor
    cu_seqlens: torch.Tensor | None = None
    sample_end: torch.Tensor | None = None


@dataclass
class _Plan:
    records: list
    lengths: np.ndarray           # (B,) int64 tokens the trainer feeds per sample
    columns: np.ndarray           # (L_out,) int64 record column feeding each output column, -1 = dense
    layer_ids: np.ndarray         # (L_out,) int32 model layer of each output column
    top_k: int
    dtype: type


def padded(records, *, padding_side: str = "right", seq_len: int | None = None, layout: str = "moe",
           layers: tuple[int, int] | None = None, num_layers: int | None = None, dtype: str = "int64",
           token_ids: Sequence | None = None, allow_incomplete: bool = False,
           allow_prefix: bool = False) -> ReplayTensors:
    """(B, S, L, K) expert ids for a padded batch: sample b's tokens at [0, n_b) (right padding) or
    [S - n_b, S) (left padding); S = seq_len or the longest sample.

    records: a sequence of wire.Record (or a {key: Record} mapping, in its order), one per sample.
    token_ids: optional, per sample, the token ids the trainer feeds (prompt + response); checked against the
    record's own token ids when it has them, and their count against P + G. allow_prefix: a sample may be a
    prefix (at least the prompt) of the record's tokens, e.g. a response cut at a stop string.
    allow_incomplete: accept records with complete=False; their missing rows are -1 and flagged.
    dtype: "int64" (ready for gather/index) or "int32".
    """
    if padding_side not in ("left", "right"):
        raise ValueError(f"padding_side={padding_side!r}, expected 'left' or 'right'")
    plan = _plan(records, layout, layers, num_layers, dtype, token_ids, allow_incomplete, allow_prefix)
    B = len(plan.records)
    longest = int(plan.lengths.max()) if B else 0
    S = longest if seq_len is None else int(seq_len)
    if S < longest:
        b = int(np.argmax(plan.lengths))
        raise ValueError(f"seq_len={S} is shorter than sample {b} ({plan.records[b].request_id!r}, {longest} tokens)")
    out = np.empty((B, S, len(plan.columns), plan.top_k), plan.dtype)
    mask = np.empty((B, S, len(plan.columns)), bool)
    for b, rec in enumerate(plan.records):                    # per record, never per token
        n = int(plan.lengths[b])
        start = 0 if padding_side == "right" else S - n
        pad = slice(n, S) if padding_side == "right" else slice(0, start)
        out[b, pad] = -1
        mask[b, pad] = True
        _fill(out[b, start:start + n], mask[b, start:start + n], rec, n, plan.columns)
    return _finish(out, mask, plan, None)


def packed(records, *, layout: str = "moe", layers: tuple[int, int] | None = None, num_layers: int | None = None,
           dtype: str = "int64", token_ids: Sequence | None = None, allow_incomplete: bool = False,
           allow_prefix: bool = False) -> ReplayTensors:
    """(T, L, K) expert ids for packed sequences (no padding): sample b's tokens at
    [cu_seqlens[b], cu_seqlens[b+1]), T = the sum of the lengths. Arguments as in `padded`."""
    plan = _plan(records, layout, layers, num_layers, dtype, token_ids, allow_incomplete, allow_prefix)
    cu = np.zeros(len(plan.records) + 1, np.int64)
    np.cumsum(plan.lengths, out=cu[1:])
    out = np.empty((int(cu[-1]), len(plan.columns), plan.top_k), plan.dtype)
    mask = np.empty(out.shape[:2], bool)
    for b, rec in enumerate(plan.records):
        _fill(out[cu[b]:cu[b + 1]], mask[cu[b]:cu[b + 1]], rec, int(plan.lengths[b]), plan.columns)
    return _finish(out, mask, plan, torch.from_numpy(cu.astype(np.int32)))


def _fill(dst: np.ndarray, dmask: np.ndarray, rec: wire.Record, n: int, columns: np.ndarray) -> None:
    """Write the first n rows of prompt + generation into dst (n, L_out, K) and their no-routing flags into
    dmask (n, L_out), column by column of `columns` (-1: a dense layer, all -1 and flagged). Works in runs of
    consecutive columns (one run in the "moe" layout, one per gap between dense layers in "all")."""
    P = rec.prompt_routed_experts.shape[0]
    parts = ((slice(0, min(n, P)), rec.prompt_routed_experts[:n]), (slice(P, n), rec.routed_experts[:max(n - P, 0)]))
    # compact rows (uint8/uint16, Record.id_dtype) mark "never computed" with missing_id: it becomes -1 here, so
    # both kinds of record give the same tensors
    miss = None if rec.prompt_routed_experts.dtype == wire.ROW_DTYPE else rec.missing_id
    for out_lo, out_hi, src_lo in _runs(columns):
        cols = slice(out_lo, out_hi)
        if src_lo < 0:
            dst[:, cols] = -1
            dmask[:, cols] = True
            continue
        for rows, src in parts:
            src = src[:, src_lo:src_lo + out_hi - out_lo]
            dst[rows, cols] = src
            if miss is None:
                _negative_rows(src, dmask[rows, cols])
            else:
                never = src == miss
                never.any(-1, out=dmask[rows, cols])
                dst[rows, cols][never] = -1


def _runs(columns: np.ndarray) -> list[tuple[int, int, int]]:
    """(out_lo, out_hi, src_lo) for each run of output columns fed by consecutive record columns (src_lo -1 for
    a run of dense columns)."""
    runs = []
    for j, c in enumerate(columns.tolist()):          # one step per layer, at most a few hundred
        if runs:
            lo, hi, s = runs[-1]
            if (c < 0 and s < 0) or (c >= 0 and s >= 0 and c == s + hi - lo):
                runs[-1] = (lo, hi + 1, s)
                continue
        runs.append((j, j + 1, c if c >= 0 else -1))
    return runs


_SIGN_BITS = np.uint64(0x8000_8000_8000_8000)


def _negative_rows(src: np.ndarray, out: np.ndarray) -> None:
    """out[...] = any id < 0 in src[..., :] (int16), reading sign bits four ids at a time (a min over the short
    K axis is several times slower)."""
    K = src.shape[-1]
    if src.dtype != np.int16 or K % 4 or src.strides[-1] != 2 or len(src) == 0:
        np.less(src.min(-1, initial=0) if len(src) == 0 else src.min(-1), 0, out=out)
        return
    words = src.view(np.uint64)                       # (..., K // 4), four int16 ids per word
    acc = words[..., 0].copy()
    for i in range(1, K // 4):                        # K // 4 whole-array ops, not per token
        acc |= words[..., i]
    acc &= _SIGN_BITS
    np.not_equal(acc, 0, out=out)


def _finish(out: np.ndarray, mask: np.ndarray, plan: _Plan, cu: torch.Tensor | None) -> ReplayTensors:
    ends = [rec.token_range is None or rec.token_range[1] == rec.token_range[2] for rec in plan.records]
    return ReplayTensors(expert_ids=torch.from_numpy(out), no_routing=torch.from_numpy(mask),
                         lengths=torch.from_numpy(plan.lengths),
                         layer_ids=torch.from_numpy(plan.layer_ids), cu_seqlens=cu,
                         sample_end=None if all(ends) else torch.tensor(ends, dtype=torch.bool))


def _plan(records, layout, layers, num_layers, dtype, token_ids, allow_incomplete, allow_prefix) -> _Plan:
    if isinstance(records, Mapping):
        records = list(records.values())
    records = list(records)
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}, expected one of {LAYOUTS}")
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r}, expected one of {sorted(_DTYPES)}")
    if token_ids is not None and len(token_ids) != len(records):
        raise ValueError(f"{len(token_ids)} token id sequences for {len(records)} records")
    if not records:
        raise ValueError("no records")
    first = records[0]
    L, K = first.prompt_routed_experts.shape[1:]
    layer_ids = np.asarray(first.moe_layer_ids, np.int64)
    lengths = np.zeros(len(records), np.int64)
    for b, rec in enumerate(records):
        _check_record(rec, b, L, K, layer_ids, allow_incomplete)
        P, G = rec.prompt_routed_experts.shape[0], rec.routed_experts.shape[0]
        lengths[b] = P + G
        if token_ids is not None:
            lengths[b] = _check_tokens(rec, b, token_ids[b], allow_prefix)

    if layout == "moe":
        columns = np.arange(L, dtype=np.int64)
        out_layer_ids = layer_ids
    else:
        total = num_layers if num_layers is not None else int(layer_ids.max()) + 1
        if total <= int(layer_ids.max()):
            raise ValueError(f"num_layers={total} but moe_layer_ids reach {int(layer_ids.max())}")
        columns = np.full(total, -1, np.int64)
        columns[layer_ids] = np.arange(L)
        out_layer_ids = np.arange(total, dtype=np.int64)
    if layers is not None:
        lo, hi = (int(x) for x in layers)
        if not 0 <= lo < hi <= len(columns):
            raise ValueError(f"layers=({lo}, {hi}) outside [0, {len(columns)}) of the {layout!r} layout")
        columns, out_layer_ids = columns[lo:hi], out_layer_ids[lo:hi]
    return _Plan(records, lengths, columns, out_layer_ids.astype(np.int32), int(K), _DTYPES[dtype])


def _check_record(rec: wire.Record, b: int, L: int, K: int, layer_ids: np.ndarray, allow_incomplete: bool) -> None:
    pr, ge = rec.prompt_routed_experts, rec.routed_experts
    if pr.ndim != 3 or ge.ndim != 3 or pr.shape[1:] != (L, K) or ge.shape[1:] != (L, K):
        raise ValueError(f"record {b} ({rec.request_id!r}) has rows {pr.shape} and {ge.shape}, "
                         f"record 0 has (L, K) = ({L}, {K})")
    if not np.array_equal(np.asarray(rec.moe_layer_ids, np.int64), layer_ids):
        raise ValueError(f"record {b} ({rec.request_id!r}) has moe_layer_ids {np.asarray(rec.moe_layer_ids).tolist()}, "
                         f"record 0 has {layer_ids.tolist()}")
    for name, toks, rows in (("prompt", rec.prompt_token_ids, pr), ("output", rec.output_token_ids, ge)):
        if toks is not None and len(toks) != rows.shape[0]:      # every later position would take a shifted row
            raise ValueError(f"record {b} ({rec.request_id!r}) has {len(toks)} {name} token ids but {rows.shape[0]} "
                             f"{name} rows: its rows do not line up with its tokens")
    if not rec.complete and not allow_incomplete:
        raise ValueError(f"record {b} ({rec.request_id!r}) is incomplete ({rec.reason!r}, missing "
                         f"{[tuple(m) for m in rec.missing]}); pass allow_incomplete=True to mask those rows")


def _check_tokens(rec: wire.Record, b: int, tokens, allow_prefix: bool) -> int:
    """The trainer's token count for record b, after checking it against the record."""
    tokens = np.asarray(tokens).reshape(-1)
    n = len(tokens)
    P, G = rec.prompt_routed_experts.shape[0], rec.routed_experts.shape[0]
    if n != P + G and not (allow_prefix and P <= n < P + G):
        raise ValueError(f"record {b} ({rec.request_id!r}) has {P} prompt + {G} output rows = {P + G}, "
                         f"the trainer feeds {n} tokens" + ("" if allow_prefix else " (allow_prefix=False)"))
    if rec.prompt_token_ids is not None:                 # the engine's tokens, as far as the record has them
        known = rec.prompt_token_ids
        if rec.output_token_ids is not None:
            known = np.concatenate([known, rec.output_token_ids])
        m = min(n, len(known))
        diff = np.nonzero(known[:m].astype(np.int64) != tokens[:m].astype(np.int64))[0]
        if len(diff):
            i = int(diff[0])
            raise ValueError(f"record {b} ({rec.request_id!r}): trainer token {i} is {int(tokens[i])}, the engine "
                             f"fed {int(known[i])} ({len(diff)} positions differ; re-tokenised?)")
    return n
