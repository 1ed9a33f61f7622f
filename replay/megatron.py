"""Turn a micro-batch's ReplayTensors into Megatron-Core's `RouterReplay.set_replay_data` list.

Megatron-Core (megatron/core/transformer/moe/router_replay.py, checked on megatron-core 0.16.1) keeps one
`RouterReplay` per router in instantiation order (this pipeline stage's MoE layers, model order) and, in
REPLAY_FORWARD / REPLAY_BACKWARD, takes `target_topk_idx` (tokens, K) as the top-k and gathers the router's
scores there. It has no fallback: every row is used as is, so a -1 must never reach it. Its tokens are the
router's input flattened from Megatron's [s, b, h] hidden states: token t = s * B + b (sequence-major); packed
(THD) batches have b = 1 and keep the packed order.

Rows without routing are filled here: padding rows and each sample's last token (never fed to the engine:
it only shapes logits past the response, outside the loss) get the distinct ids 0 .. K-1. Other unrouted rows
(prefix-cache hits, missing rows) change the routing of real context tokens, so they are refused unless the
caller passes `fallback` (e.g. `RouterReplay.get_recorded_data()` of a RECORD pass over the same micro-batch,
the router's own top-k), from which those rows are taken. Nothing here imports Megatron.
Expert ids are logical expert ids; Megatron's token dispatcher maps them to expert-parallel ranks.
"""

from __future__ import annotations

from typing import Sequence

import torch

from routing_replay.replay.tensors import ReplayTensors


def megatron_replay_data(rt: ReplayTensors, *, padding_side: str = "right", layers: tuple[int, int] | None = None,
                         fallback: Sequence[torch.Tensor] | None = None, device=None) -> list[torch.Tensor]:
    """One (tokens, K) int64 tensor per MoE layer of axis L (or of [lo, hi)), tokens in Megatron's order.

    rt: from `replay.padded` (tokens = S * B, sequence-major) or `replay.packed` (tokens = T), "moe" layout.
    padding_side: the side `padded` was called with (to tell padding rows from last tokens).
    fallback: per layer (tokens, K) ids for unrouted context rows, in the same token order.
    """
    ids, mask = rt.expert_ids, rt.no_routing
    lengths = rt.lengths
    if len(rt.layer_ids) > 1 and bool((rt.layer_ids.diff() <= 0).any()):
        raise ValueError(f"layer_ids {rt.layer_ids.tolist()} are not increasing (use the 'moe' layout)")
    if ids.dim() == 4:                                    # (B, S, L, K)
        B, S = ids.shape[:2]
        pos = torch.arange(S)[None, :]
        start = torch.zeros(B, 1, dtype=torch.int64) if padding_side == "right" else (S - lengths)[:, None]
        rel = pos - start                                 # position inside the sample
        real = (rel >= 0) & (rel < lengths[:, None])
        last = rel == (lengths[:, None] - 1)
        ids, mask = ids.transpose(0, 1).reshape(S * B, *ids.shape[2:]), mask.transpose(0, 1).reshape(S * B, -1)
        real, last = real.t().reshape(-1), last.t().reshape(-1)
    elif ids.dim() == 3:                                  # (T, L, K) packed
        T = ids.shape[0]
        real = torch.ones(T, dtype=torch.bool)
        last = torch.zeros(T, dtype=torch.bool)
        last[rt.cu_seqlens[1:].to(torch.int64) - 1] = True
    else:
        raise ValueError(f"expert_ids have shape {tuple(ids.shape)}, expected (B, S, L, K) or (T, L, K)")
    if layers is not None:
        lo, hi = layers
        ids, mask = ids[:, lo:hi], mask[:, lo:hi]
    N, L, K = ids.shape
    filler = torch.arange(K, dtype=torch.int64).expand(N, K)
    harmless = (~real | last)[:, None] & mask             # padding and last tokens
    needs = mask & ~harmless                       # real context rows without routing
    if needs.any() and fallback is None:
        per_layer = needs.sum(0).tolist()
        tok = int(needs.any(1).nonzero()[0, 0])
        raise ValueError(f"{int(needs.any(1).sum())} context tokens have no routing (prefix-cache hits or missing "
                         f"rows; first at Megatron token {tok}; per layer {per_layer}); pass fallback= "
                         f"(the router's own top-k from a RECORD pass) to use them")
    if fallback is not None and len(fallback) != L:
        raise ValueError(f"fallback has {len(fallback)} layers, the replay data {L}")
    out = []
    for m in range(L):                                    # per layer, never per token
        x = torch.where(harmless[:, m, None], filler, ids[:, m].to(torch.int64))
        if fallback is not None:
            fb = torch.as_tensor(fallback[m]).to(torch.int64).cpu()
            if fb.shape != (N, K):
                raise ValueError(f"fallback[{m}] has shape {tuple(fb.shape)}, expected {(N, K)}")
            x = torch.where(needs[:, m, None], fb, x)
        out.append(x.to(device) if device is not None else x.contiguous())
    return out
