"""Force the routing of Hugging Face transformers MoE models to replayed expert ids, keeping router gradients.

`with replay_routing(model, expert_ids, no_routing) as stats: loss = model(...).loss; loss.backward()`.
Inside, every MoE block's router picks the replayed experts instead of its own top-k; the routing weights are
still computed from the router's own logits at those ids (softmax over all experts, gathered at the ids,
renormalised exactly as the model's router does), so gradients reach the router weights as usual. Entries
flagged in `no_routing` (and any -1 id) fall back to the router's own top-k, counted in `stats`.

Where it patches (transformers 5.x): each MoE block (`Qwen3MoeSparseMoeBlock`, `MixtralSparseMoeBlock`, ...)
owns a router module `.gate` whose forward returns `(router_logits, routing_weights, selected_experts)` and
the block hands the last two to its experts. `replay_routing` replaces that router's `forward` on the
instance (nothing at class level, nothing else in the model) and restores it on exit. Blocks are found by
class name in `MOE_BLOCKS`; `register_moe_block` adds an architecture.

The ids are data, not state: the router of model layer i always reads column i of the replay tensor, whatever
the call order, so gradient checkpointing's recompute selects the same experts as the first forward.

Expert ids are logical expert ids (0 .. num_experts-1), the ones the model's router indexes its experts with.
The replay tensor's token order is the model's flattened `(batch, seq)` order: (B, S, L, K) for a padded batch
fed as input_ids (B, S), (T, L, K) for packed sequences fed as (1, T). `replay.tensors` builds both.
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class MoEBlockSpec:
    """How one MoE block class routes: its router attribute, the router class it must be, and the router's
    own arithmetic split in two (logits and probabilities; routing weights from the selected probabilities)."""

    router_attr: str
    router_class: str
    probs: Callable            # (router, hidden (n, H)) -> (router_logits, probs (n, E) float32)
    weights: Callable          # (router, selected probs (n, K), router_logits) -> routing weights (n, K)


def _qwen3_probs(router, hidden):
    hidden = hidden.reshape(-1, router.hidden_dim)
    logits = F.linear(hidden, router.weight)
    return logits, torch.nn.functional.softmax(logits, dtype=torch.float, dim=-1)


def _qwen3_weights(router, top, logits):
    if router.norm_topk_prob:
        top /= top.sum(dim=-1, keepdim=True)
    return top.to(logits.dtype)


def _mixtral_probs(router, hidden):
    hidden = hidden.reshape(-1, router.hidden_dim)
    logits = F.linear(hidden, router.weight)
    return logits, torch.nn.functional.softmax(logits.float(), dim=-1)


def _mixtral_weights(router, top, logits):
    top /= top.sum(dim=-1, keepdim=True)           # = softmax over the selected logits
    return top


MOE_BLOCKS: dict[str, MoEBlockSpec] = {
    "Qwen3MoeSparseMoeBlock": MoEBlockSpec("gate", "Qwen3MoeTopKRouter", _qwen3_probs, _qwen3_weights),
    "MixtralSparseMoeBlock": MoEBlockSpec("gate", "MixtralTopKRouter", _mixtral_probs, _mixtral_weights),
}


def register_moe_block(block_class_name: str, spec: MoEBlockSpec) -> None:
    """Teach replay_routing another MoE block class (keyed by class name, so no model module is imported)."""
    MOE_BLOCKS[block_class_name] = spec


def find_moe_blocks(model: torch.nn.Module) -> list[tuple[int, torch.nn.Module, MoEBlockSpec]]:
    """(model layer index, block, spec) of every registered MoE block under `layers.<i>.`, in layer order."""
    found = []
    for name, mod in model.named_modules():
        spec = MOE_BLOCKS.get(type(mod).__name__)
        if spec is None:
            continue
        m = None
        for m in _LAYER_RE.finditer(name):
            pass
        if m is None:
            raise ValueError(f"MoE block {name!r} ({type(mod).__name__}) is not under a 'layers.<i>.' module")
        router = getattr(mod, spec.router_attr, None)
        if type(router).__name__ != spec.router_class:
            raise ValueError(f"{name}.{spec.router_attr} is {type(router).__name__}, replay_routing knows "
                             f"{spec.router_class} for {type(mod).__name__} (another transformers version?)")
        found.append((int(m.group(1)), mod, spec))
    found.sort(key=lambda t: t[0])
    return found


@dataclass
class ReplayStats:
    """Counters of one replay_routing context, one entry per MoE layer (model order), summed over router calls
    (a gradient-checkpointing recompute is a call too)."""

    layer_ids: list
    calls: list = field(default_factory=list)
    replayed_rows: list = field(default_factory=list)     # tokens routed to the replayed ids
    fallback_rows: list = field(default_factory=list)     # tokens routed by the router's own top-k

    def __post_init__(self):
        n = len(self.layer_ids)
        self.calls, self.replayed_rows, self.fallback_rows = [0] * n, [0] * n, [0] * n


@dataclass
class _LayerReplay:
    ids: torch.Tensor          # (N, K) int64 on the router's device; fallback rows hold 0
    fallback: torch.Tensor     # (N, 1) bool
    num_fallback: int


@contextmanager
def replay_routing(model: torch.nn.Module, expert_ids: torch.Tensor, no_routing: torch.Tensor | None = None, *,
                   layer_ids=None):
    """Replay `expert_ids` in every MoE block of `model` inside the with-block; yields a ReplayStats.

    expert_ids: (B, S, L, K) or (T, L, K) integer logical expert ids, token order as the model flattens its
    input. no_routing: None, (B, S) / (T,) or (B, S, L) / (T, L) bool; True entries (and any row holding a
    negative id) use the router's own top-k. layer_ids: (L,) the model layer index of each column of axis L
    (`ReplayTensors.layer_ids`, either layout); None means axis L is exactly the model's MoE layers in order.
    """
    blocks = find_moe_blocks(model)
    if not blocks:
        raise ValueError(f"{type(model).__name__} has no MoE block of a registered class {sorted(MOE_BLOCKS)}")
    ids = torch.as_tensor(expert_ids)
    if ids.dim() not in (3, 4) or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ValueError(f"expert_ids must be integer (B, S, L, K) or (T, L, K), got {tuple(ids.shape)} {ids.dtype}")
    tokens_shape = ids.shape[:-2]
    L, K = ids.shape[-2:]
    ids = ids.reshape(-1, L, K)
    N = ids.shape[0]
    fallback = (ids < 0).any(-1)                                       # (N, L)
    if no_routing is not None:
        mask = torch.as_tensor(no_routing, dtype=torch.bool)
        if mask.shape == tokens_shape:
            mask = mask.reshape(N, 1)
        elif mask.shape == tokens_shape + (L,):
            mask = mask.reshape(N, L)
        else:
            raise ValueError(f"no_routing has shape {tuple(mask.shape)}, expected {tuple(tokens_shape)} or "
                             f"{tuple(tokens_shape) + (L,)} for expert_ids {tuple(expert_ids.shape)}")
        fallback = fallback | mask.to(fallback.device)
    column_of = _columns(blocks, layer_ids, L)

    plans, routers = [], []
    for (layer, block, spec), col in zip(blocks, column_of):
        router = getattr(block, spec.router_attr)
        if "forward" in vars(router):
            raise RuntimeError(f"router of layer {layer} already has its forward replaced (nested replay_routing?)")
        if int(router.top_k) != K:
            raise ValueError(f"expert_ids have K={K}, the router of layer {layer} picks top_k={int(router.top_k)}")
        plans.append(_layer_plan(ids[:, col], fallback[:, col], layer, int(router.num_experts),
                                 router.weight.device))
        routers.append((router, spec))
    stats = ReplayStats(layer_ids=[layer for layer, _, _ in blocks])
    try:
        for m, ((router, spec), plan) in enumerate(zip(routers, plans)):
            router.forward = _replaying_forward(router, spec, plan, stats, m, N)
        yield stats
    finally:
        for router, _ in routers:
            vars(router).pop("forward", None)


def _columns(blocks, layer_ids, L: int) -> list[int]:
    """Column of axis L read by each block: by position (layer_ids None) or by model layer index."""
    if layer_ids is None:
        if L != len(blocks):
            raise ValueError(f"expert_ids have L={L} columns, the model has {len(blocks)} MoE layers "
                             f"{[b[0] for b in blocks]}; pass layer_ids for another layout")
        return list(range(L))
    lids = [int(x) for x in torch.as_tensor(layer_ids).reshape(-1).tolist()]
    if len(lids) != L:
        raise ValueError(f"layer_ids has {len(lids)} entries, expert_ids have L={L}")
    where = {lid: c for c, lid in enumerate(lids)}
    absent = [layer for layer, _, _ in blocks if layer not in where]
    if absent:
        raise ValueError(f"MoE layers {absent} of the model are not in layer_ids {lids}")
    return [where[layer] for layer, _, _ in blocks]


def _layer_plan(ids: torch.Tensor, fallback: torch.Tensor, layer: int, num_experts: int, device) -> _LayerReplay:
    """Check one layer's replayed ids (range, distinct within a row) and move them to the router's device."""
    ids = ids.to(torch.int64)
    use = ~fallback
    bad = use[:, None] & (ids >= num_experts)
    if bad.any():
        t, k = (int(x) for x in bad.nonzero()[0])
        raise ValueError(f"layer {layer}: expert id {int(ids[t, k])} at token {t} slot {k} is outside "
                         f"[0, {num_experts}) ({int(bad.sum())} such ids)")
    srt = ids.sort(-1).values
    dup = use & (srt[:, 1:] == srt[:, :-1]).any(-1)
    if dup.any():
        t = int(dup.nonzero()[0, 0])
        raise ValueError(f"layer {layer}: token {t} replays the same expert twice: {ids[t].tolist()} "
                         f"({int(dup.sum())} such tokens)")
    ids = torch.where(fallback[:, None], torch.zeros_like(ids), ids)
    return _LayerReplay(ids.to(device).contiguous(), fallback[:, None].to(device), int(fallback.sum()))


def _replaying_forward(router, spec: MoEBlockSpec, plan: _LayerReplay, stats: ReplayStats, m: int, N: int):
    K = plan.ids.shape[1]

    def forward(hidden_states):
        logits, probs = spec.probs(router, hidden_states)
        if probs.shape[0] != N:
            raise ValueError(f"the router of layer {stats.layer_ids[m]} sees {probs.shape[0]} tokens, the replay "
                             f"tensor has {N} (another batch shape, or generation with a KV cache?)")
        idx = plan.ids
        if plan.num_fallback:
            own = torch.topk(probs.detach(), K, dim=-1).indices
            idx = torch.where(plan.fallback, own, idx)
        weights = spec.weights(router, probs.gather(1, idx), logits)
        stats.calls[m] += 1
        stats.fallback_rows[m] += plan.num_fallback
        stats.replayed_rows[m] += N - plan.num_fallback
        return logits, weights, idx

    return forward
