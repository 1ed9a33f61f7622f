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

Traps, each handled here (read in megatron-core 0.16.1):
- Replay is skipped silently unless every router reaches `RouterReplay.get_replay_topk`: with
  `moe_router_fusion` `moe_utils.topk_routing_with_score_function` returns TransformerEngine's fused top-k before
  it; `moe_router_load_balancing_type="sinkhorn"` never calls it; without `moe_enable_routing_replay` no router
  owns a RouterReplay; and a `moe_expert_capacity_factor` drops replayed tokens after it.
  `check_megatron_config(config)` refuses all four.
- The dispatcher builds its routing map by scattering the ids (`zeros.scatter(1, top_indices, 1)`): a row with
  a repeated id routes the token to fewer than K experts while its probabilities still count K, so per-expert
  token counts and the all-to-all splits go wrong. Filled rows are the distinct `arange(K)`, and a record row
  with a repeated id is refused.
- `set_target_indices` also appends to the router's `replay_backward_list`, which REPLAY_BACKWARD pops from the
  front on every router call, i.e. once per recomputed micro-batch in backward. The list is FIFO per router, so
  it stays aligned only if (1) it is empty when the step starts (a forward-only pass, e.g. old log-probs, leaves
  one entry per micro-batch), (2) each micro-batch appends exactly once, and (3) the action is REPLAY_FORWARD
  during each forward and REPLAY_BACKWARD after it: under 1F1B the forward of micro-batch i+1 runs before the
  backward of i, so a router left in REPLAY_FORWARD recomputes micro-batch i with i+1's ids, and one left in
  REPLAY_BACKWARD pops in a forward. `MicroBatchReplay` does the three and checks the lists at the end.
"""

from __future__ import annotations

from contextlib import contextmanager
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
    _refuse_repeated_ids(ids, mask)
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


def _refuse_repeated_ids(ids: torch.Tensor, mask: torch.Tensor) -> None:
    """Raise when a routed (token, layer) row names one expert twice (the dispatcher would miscount it)."""
    if ids.shape[-1] < 2:
        return
    s = ids.sort(-1).values
    dup = (s[..., 1:] == s[..., :-1]).any(-1) & ~mask
    if dup.any():
        tok, layer = (int(x) for x in dup.nonzero()[0])
        raise ValueError(f"{int(dup.sum())} (token, layer) rows repeat an expert id, first Megatron token {tok} "
                         f"layer {layer}: {ids[tok, layer].tolist()}")


def check_megatron_config(config) -> None:
    """Refuse a Megatron-Core TransformerConfig on which RouterReplay would not replay every router, naming each
    setting (see the module docstring)."""
    problems = []
    if not getattr(config, "moe_enable_routing_replay", False):
        problems.append("moe_enable_routing_replay=False: the routers own no RouterReplay")
    if getattr(config, "moe_router_fusion", False):
        problems.append("moe_router_fusion=True: the fused top-k never calls RouterReplay (replay silently skipped)")
    if getattr(config, "moe_router_load_balancing_type", None) == "sinkhorn":
        problems.append("moe_router_load_balancing_type='sinkhorn': sinkhorn routing never calls RouterReplay")
    cap = getattr(config, "moe_expert_capacity_factor", None)
    if cap is not None:
        problems.append(f"moe_expert_capacity_factor={cap}: token dropping discards replayed routes")
    if problems:
        raise ValueError("routing replay cannot run on this TransformerConfig: " + "; ".join(problems))


class MicroBatchReplay:
    """Own one step's replay data for a list of Megatron-Core RouterReplay instances (a model chunk's, or
    `RouterReplay.global_router_replay_instances`): sets each micro-batch's ids once before its forward, switches
    to REPLAY_BACKWARD after it so a recompute pops that micro-batch's entry, and checks and clears at the end.

        replay = MicroBatchReplay(routers, RouterReplayAction, [megatron_replay_data(t) for t in micro_batches])
        def forward_step(data_iterator, model):       # Megatron calls it once per micro-batch, in order
            with replay.forward():
                output = model(...)
            return output, loss_func
        forward_backward_func(forward_step_func=forward_step, ...)
        replay.finish()

    Megatron runs each chunk's backwards in forward order, so the FIFO `replay_backward_list` of every recomputed
    router meets micro-batch i's ids at i's backward; routers that are not recomputed keep their entries until
    `finish`, which accepts per router either all entries consumed or none.
    """

    def __init__(self, routers: Sequence, actions, micro_batches: Sequence[Sequence[torch.Tensor]]):
        self.routers, self.actions = list(routers), actions
        self.data = [list(mb) for mb in micro_batches]
        for i, mb in enumerate(self.data):
            if len(mb) != len(self.routers):
                raise ValueError(f"micro-batch {i} has {len(mb)} layers of replay data, {len(self.routers)} routers")
        stale = [len(r.replay_backward_list) for r in self.routers]
        if any(stale):
            raise ValueError(f"routers hold {stale} replay_backward_list entries from an earlier pass (a forward-only "
                             f"pass leaves one per micro-batch; call RouterReplay.clear_global_indices() after it): "
                             f"backward would replay them instead of this step's")
        self.next = 0

    @contextmanager
    def forward(self, index: int | None = None):
        """Around micro-batch `index`'s forward (default: the next one): its ids appended once, REPLAY_FORWARD
        inside, REPLAY_BACKWARD after."""
        i = self.next if index is None else int(index)
        if i != self.next or i >= len(self.data):
            raise ValueError(f"forward of micro-batch {i}, expected {self.next} of {len(self.data)} "
                             f"(each micro-batch once, in order)")
        for r, ids in zip(self.routers, self.data[i]):
            r.set_target_indices(ids)
            r.set_router_replay_action(self.actions.REPLAY_FORWARD)
        self.next = i + 1
        try:
            yield
        finally:
            for r in self.routers:
                r.set_router_replay_action(self.actions.REPLAY_BACKWARD)

    def finish(self) -> list[int]:
        """After the step: check every router's list was consumed entirely (recomputed) or not at all, clear the
        routers' ids and actions; returns the entries each router had left."""
        n = len(self.data)
        if self.next != n:
            raise ValueError(f"{self.next} of {n} micro-batches went through forward")
        left = [len(r.replay_backward_list) for r in self.routers]
        for r in self.routers:
            r.clear_indices()
            r.clear_router_replay_action()
        bad = [m for m, k in enumerate(left) if k not in (0, n)]
        if bad:
            raise ValueError(f"routers {bad} have {[left[m] for m in bad]} of {n} backward entries left: their "
                             f"recompute ran for some micro-batches only, so it replayed misaligned ids")
        return left
