"""Export Records in the routing formats RL frameworks already consume: verl, NeMo-RL (array and string codec), slime.

Each exporter starts from the same per-sample rows as `replay.tensors` (trainer input position i takes row i of
prompt + generation, no shift) in one of the two layouts: "moe" (axis L is the MoE layers, the record's columns)
or "all" (axis L is every decoder layer, `num_layers` of them, MoE layer `moe_layer_ids[m]` fed by column m, the
dense layers filled as the framework expects). Read from their own code:

verl (PyPI wheels 0.9.0 and 0.9.1) takes `routed_experts` in two forms. Padded: `verl/experimental/agent_loop/
agent_loop.py` builds the batch key as [B, prompt_length + response_length, L, K] int16, the prompt left-padded
to `prompt_length`, the response right-padded to `response_length` (the layout of `input_ids`), zeros in padding
rows and in rows the engine never fed (0.9.0's `verl/workers/utils/padding.py` narrowed it to uint8 when the ids
are <= 255). Jagged (0.9.1): `verl/workers/utils/padding.py::left_right_2_no_padding` turns that key into a
`torch.nested` jagged tensor, one (tokens, L, K) component per sample holding only its real tokens, and passes
through one that already is nested; the Megatron engine records and replays that form
(`verl/utils/megatron/router_replay_utils.py`: `align_r3_router_replay_data` accepts `tokens` or `tokens - 1` rows
per sample, `build_r3_replay_mask` replays every row but each sample's last). `set_router_replay_data` indexes axis
L by absolute layer when it has `tf_config.num_layers` entries (all layers) and by MoE ordinal otherwise, so the
"all" layout must have exactly the model's decoder layer count: the record's `moe_layer_ids` cannot say whether
dense layers follow the last MoE layer, so "all" needs `num_layers`.

NeMo-RL (NVIDIA-NeMo/RL `nemo_rl/utils/routed_experts_codec.py`, read through the code search; the PyPI
`nemo-rl` package is an empty placeholder): the string envelope `"nrlre1:<dtype>:<S>x<L>x<K>:<base64 of the
C-contiguous array bytes>"`, dtype one of int8/int16/int32, payload [tokens, num_moe_layers, topk]. The aligned
[S, L, K] array itself (padding rows `arange(K)`, all -1 rows fall back to the trainer's own router) follows the
issue's description: its producer code was not found.

slime (THUDM/slime `slime/rollout/sglang_rollout.py`, read through the code search): `rollout_routed_experts`
is int32 `np.frombuffer(...).reshape(len(sample.tokens) - 1, args.num_layers, args.moe_router_topk)`, one row per
fed token (the last token is never fed), every decoder layer; its own placeholders fill with 0.

verl and slime have no per-row fallback: a context row without routing (prefix-cache hit, missing row) would be
replayed as whatever fills it, so those are refused with the rows named; the last output row (never fed, outside
the loss) is filled. NeMo-RL keeps them as -1 rows, its fallback.
"""

from __future__ import annotations

import base64
import re
from typing import Sequence

import numpy as np

from routing_replay.protocol import wire

LAYOUTS = ("moe", "all")
NEMO_RL_MAGIC = "nrlre1"
NEMO_RL_DTYPES = {"int8": np.dtype("<i1"), "int16": np.dtype("<i2"), "int32": np.dtype("<i4")}
_NEMO_RL_RE = re.compile(r"^nrlre1:(int8|int16|int32):(\d+)x(\d+)x(\d+):([A-Za-z0-9+/=]*)$")


def sample_rows(rec: wire.Record, *, layout: str = "moe", num_layers: int | None = None,
                dense_fill: int = -1) -> np.ndarray:
    """(P + G, L_out, K) int32: row p is the routing of trainer input position p, -1 where the engine computed
    none (prefix-cache hits, missing rows, the last output row); in the "all" layout the dense layers hold
    `dense_fill` (-1, 0, or -2 for `arange(K)`)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}, expected one of {LAYOUTS}")
    moe = np.concatenate([rec.prompt_routed_experts, rec.routed_experts]).astype(np.int32)
    if rec.prompt_routed_experts.dtype != wire.ROW_DTYPE:    # compact rows: their missing value becomes -1
        moe[moe == rec.missing_id] = -1
    if moe.ndim != 3:
        raise ValueError(f"record {rec.request_id!r} rows have shape {moe.shape}, expected (n, L, K)")
    if layout == "moe":
        return moe
    ids = np.asarray(rec.moe_layer_ids, np.int64)
    if num_layers is None:
        raise ValueError(f"record {rec.request_id!r}: layout='all' needs num_layers (the model's decoder layer "
                         f"count, e.g. config.num_hidden_layers): moe_layer_ids {ids.tolist()} end at layer "
                         f"{int(ids.max())} and cannot say whether dense layers follow; or use layout='moe'")
    total = int(num_layers)
    if len(ids) != moe.shape[1] or total <= int(ids.max()) or len(np.unique(ids)) != len(ids):
        raise ValueError(f"record {rec.request_id!r}: moe_layer_ids {ids.tolist()} do not fit num_layers={total} "
                         f"with {moe.shape[1]} MoE columns")
    out = np.empty((moe.shape[0], total, moe.shape[2]), np.int32)
    out[:] = np.arange(moe.shape[2], dtype=np.int32) if dense_fill == -2 else dense_fill
    out[:, ids] = moe
    return out


def _moe_columns(rec: wire.Record, layout: str, num_layers: int | None) -> np.ndarray:
    """Indices of axis L that are MoE layers in the exported layout."""
    if layout == "moe":
        return np.arange(rec.prompt_routed_experts.shape[1])
    return np.asarray(rec.moe_layer_ids, np.int64)


def _refuse_unrouted_context(rec: wire.Record, rows: np.ndarray, cols: np.ndarray, target: str) -> None:
    """Raise when a row other than the last has no routing in a MoE layer (the target has no fallback)."""
    bad = (rows[:-1][:, cols] < 0).any(axis=(1, 2))
    if bad.any():
        where = np.flatnonzero(bad)
        raise ValueError(f"record {rec.request_id!r}: {len(where)} context tokens have no routing (prefix-cache "
                         f"hits or missing rows, first at position {int(where[0])}, num_cached_tokens="
                         f"{rec.num_cached_tokens}, missing={[tuple(m) for m in rec.missing]}); {target} has no "
                         f"per-row fallback: re-run those prompts without prefix caching or drop the sample")


def narrowest_dtype(num_experts: int, *, signed: bool = True) -> np.dtype:
    """The narrowest integer dtype holding ids 0 .. num_experts-1 (and -1 when signed)."""
    if num_experts <= 0:
        raise ValueError(f"num_experts={num_experts}, expected > 0")
    for dt in ((np.int8, np.int16, np.int32) if signed else (np.uint8, np.int16, np.int32)):
        if num_experts - 1 <= np.iinfo(dt).max:
            return np.dtype(dt)
    raise ValueError(f"num_experts={num_experts} does not fit int32")


def _num_experts(arrays: Sequence[np.ndarray], num_experts: int | None) -> int:
    top = max((int(a.max()) for a in arrays if a.size), default=0)
    if num_experts is None:
        return top + 1
    if top >= num_experts:
        raise ValueError(f"expert id {top} >= num_experts={num_experts}")
    return int(num_experts)


# ---- verl ---------------------------------------------------------------------------------------------------

def to_verl(records, *, prompt_length: int, response_length: int, layout: str = "all",
            num_layers: int | None = None, num_experts: int | None = None) -> np.ndarray:
    """verl's `routed_experts` batch key, (B, prompt_length + response_length, L, K): sample b's prompt ends at
    column prompt_length (left padding), its response starts there (right padding), like verl's `input_ids`.
    Padding rows, dense layers ("all" layout, the one verl indexes by `num_layers`) and each last row hold 0.
    dtype uint8 when num_experts <= 256 (verl's own narrowing), else int16 / int32."""
    records = list(records.values()) if isinstance(records, dict) else list(records)
    per = [sample_rows(r, layout=layout, num_layers=num_layers, dense_fill=0) for r in records]
    if not per:
        raise ValueError("no records")
    shapes = {p.shape[1:] for p in per}
    if len(shapes) != 1:
        raise ValueError(f"records have different (L, K): {sorted(shapes)}")
    E = _num_experts(per, num_experts)
    out = np.zeros((len(per), prompt_length + response_length, *per[0].shape[1:]), narrowest_dtype(E, signed=False))
    for b, (rec, rows) in enumerate(zip(records, per)):
        P, G = rec.prompt_routed_experts.shape[0], rec.routed_experts.shape[0]
        if P > prompt_length or G > response_length:
            raise ValueError(f"record {b} ({rec.request_id!r}) has {P} prompt + {G} response tokens, the batch "
                             f"holds {prompt_length} + {response_length}")
        _refuse_unrouted_context(rec, rows, _moe_columns(rec, layout, num_layers), "verl")
        rows = rows.copy()
        rows[-1] = np.maximum(rows[-1], 0)                # the last row is never fed: verl's zeros
        out[b, prompt_length - P:prompt_length + G] = rows
    return out


def to_verl_jagged(records, *, layout: str = "all", num_layers: int | None = None):
    """verl's jagged `routed_experts` (0.9.1): a `torch.nested` jagged int16 tensor, component b = (P_b + G_b, L, K),
    row p the routing of sample b's input position p (its real tokens only, no padding), as
    `left_right_2_no_padding` makes of the padded key and the Megatron engine records. Dense layers ("all") and each
    sample's last row (never fed; verl's R3 mask leaves it to the model) hold 0. Unrouted context rows refused."""
    import torch

    records = list(records.values()) if isinstance(records, dict) else list(records)
    if not records:
        raise ValueError("no records")
    parts = []
    for rec in records:
        rows = sample_rows(rec, layout=layout, num_layers=num_layers, dense_fill=0)
        if parts and rows.shape[1:] != parts[0].shape[1:]:
            raise ValueError(f"record {rec.request_id!r} has (L, K) {rows.shape[1:]}, the first {parts[0].shape[1:]}")
        if rows.shape[0] == 0:
            raise ValueError(f"record {rec.request_id!r} has no tokens")
        if int(rows.max(initial=0)) > np.iinfo(np.int16).max:
            raise ValueError(f"record {rec.request_id!r}: expert id {int(rows.max())} does not fit int16")
        _refuse_unrouted_context(rec, rows, _moe_columns(rec, layout, num_layers), "verl")
        rows = rows.copy()
        rows[-1] = np.maximum(rows[-1], 0)
        parts.append(torch.from_numpy(rows.astype(np.int16)))
    return torch.nested.as_nested_tensor(parts, layout=torch.jagged)


# ---- NeMo-RL ------------------------------------------------------------------------------------------------

def to_nemo_rl(rec: wire.Record, *, seq_len: int | None = None, layout: str = "moe", num_layers: int | None = None,
               num_experts: int | None = None) -> np.ndarray:
    """NeMo-RL's aligned (S, L, K) routed experts for one sample: row p = input position p, all -1 where the engine
    computed none (the trainer's own router decides there), rows past P + G up to seq_len (padding) `arange(K)`.
    Axis L is the MoE layers: the `nrlre1` payload is [tokens, num_moe_layers, topk], so layout="all" is refused.
    dtype the narrowest of int8 / int16 / int32 (the codec's dtypes)."""
    if layout != "moe":
        raise ValueError(f"layout={layout!r}: NeMo-RL's nrlre1 payload is [tokens, num_moe_layers, topk], "
                         f"only layout='moe' fits it")
    rows = sample_rows(rec, layout=layout, num_layers=num_layers, dense_fill=-1)
    n = rows.shape[0]
    S = n if seq_len is None else int(seq_len)
    if S < n:
        raise ValueError(f"seq_len={S} is shorter than record {rec.request_id!r} ({n} tokens)")
    out = np.empty((S, *rows.shape[1:]), narrowest_dtype(_num_experts([rows], num_experts)))
    out[:n] = rows
    out[n:] = np.arange(rows.shape[2])
    return out


def encode_nemo_rl(routed_experts: np.ndarray) -> str:
    """The `nrlre1:<dtype>:<S>x<L>x<K>:<base64>` envelope of an (S, L, K) int8/int16/int32 array (little-endian
    C-order bytes, as NeMo-RL's `encode_routed_experts` writes from a CPU tensor)."""
    a = np.asarray(routed_experts)
    name = {np.dtype(v).name: k for k, v in NEMO_RL_DTYPES.items()}.get(a.dtype.name)
    if a.ndim != 3 or name is None:
        raise ValueError(f"routed experts {a.shape} {a.dtype}: expected (S, L, K) of {sorted(NEMO_RL_DTYPES)}")
    data = np.ascontiguousarray(a, NEMO_RL_DTYPES[name])
    return f"{NEMO_RL_MAGIC}:{name}:{a.shape[0]}x{a.shape[1]}x{a.shape[2]}:{base64.b64encode(data).decode('ascii')}"


def decode_nemo_rl(payload: str) -> np.ndarray:
    """The (S, L, K) array of an `nrlre1:` envelope, in its wire dtype; malformed envelopes raise ValueError."""
    m = _NEMO_RL_RE.match(payload) if isinstance(payload, str) else None
    if m is None:
        head = payload[:40] if isinstance(payload, str) else type(payload).__name__
        raise ValueError(f"not an nrlre1:<int8|int16|int32>:<S>x<L>x<K>:<base64> envelope: {head!r}")
    name, shape, data = m.group(1), tuple(int(m.group(i)) for i in (2, 3, 4)), m.group(5)
    try:
        raw = base64.b64decode(data, validate=True)
    except ValueError as e:
        raise ValueError(f"nrlre1 envelope {name}:{shape}: bad base64 ({e})") from None
    dt = NEMO_RL_DTYPES[name]
    if len(raw) != int(np.prod(shape)) * dt.itemsize:
        raise ValueError(f"nrlre1 envelope has {len(raw)} bytes, shape {shape} of {name} needs "
                         f"{int(np.prod(shape)) * dt.itemsize}")
    return np.frombuffer(raw, dt).reshape(shape).copy()


# ---- slime --------------------------------------------------------------------------------------------------

def to_slime(rec: wire.Record, *, layout: str = "all", num_layers: int | None = None) -> np.ndarray:
    """slime's `rollout_routed_experts`: int32 (len(tokens) - 1, L, K), one row per fed token (the last token is
    not fed), every decoder layer ("all", dense layers 0, slime's own fill) or the MoE layers ("moe")."""
    rows = sample_rows(rec, layout=layout, num_layers=num_layers, dense_fill=0)
    if rows.shape[0] == 0:
        raise ValueError(f"record {rec.request_id!r} has no tokens")
    _refuse_unrouted_context(rec, rows, _moe_columns(rec, layout, num_layers), "slime")
    return np.ascontiguousarray(rows[:-1], np.int32)
