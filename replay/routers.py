"""The router contract of replay_routing, and the families of HF transformers routers that fit it.

The contract. A router fits when its forward, per token row (the block's tokens flattened to N rows):

1. computes, from its logits (and buffers: `e_score_correction_bias`, expert statistics, softcapping), a
   SELECT score (N, E), the one it ranks experts on, and a WEIGHT score (N, E), the one its routing weights are
   made of. They differ in many routers: DeepSeek-V3 selects on sigmoid + `e_score_correction_bias` with groups
   masked to -inf and weighs with the plain sigmoid; Ernie-4.5 selects on softmax + statistics, weighs with the
   softmax; GPT-OSS and Granite select on the logits and weigh with a softmax over the selected logits.
2. selects its top-k ids on the select score (group masks, `sorted=False`, sampling included);
3. makes the routing weights from the weight score gathered at those ids alone: normalisation, scaling factor,
   softmax or sigmoid, casts (Phi-MoE's sparsemixer is the one family whose weight depends on a mask made from
   the scores around the selection; its arithmetic is replayed as written, see `_phimoe`);
4. returns ids and weights in fixed places of its output, and its block hands them to the experts unchanged.

Under replay a family's `route(router, forced, *args)` runs that arithmetic with one change: rows with replayed
ids take those ids instead of step 2, rows that fall back (no recorded ids: sentinel prefix rows, missing rows,
padding, last tokens) run step 2 exactly as the model does (same tensors, same ops, so the same ids), and every
row gets step 3 at its ids. With `forced=None` it is the model's own forward, bit for bit.

A router's arithmetic is identified by its code: `fingerprint(cls)` hashes the token stream of the class's
`forward` (comments, docstrings and layout dropped) and of the functions of its module that forward calls
(Phi-MoE's `sparsemixer`). Each family lists the fingerprints of the transformers 5.x code it reproduces, so
an architecture whose router code is one of them works whatever its class names, and a router whose code
changed (another transformers version) is refused by name instead of replayed with stale arithmetic.
"""

from __future__ import annotations

import hashlib
import inspect
import io
import sys
import textwrap
import tokenize
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F


class Forced(NamedTuple):
    """One MoE layer's replayed ids for one call: (N, K) int64 ids (fallback rows hold 0), (N, 1) bool fallback
    mask, and how many rows fall back (0 lets a router skip its own selection)."""

    ids: torch.Tensor
    fallback: torch.Tensor
    num_fallback: int


@dataclass(frozen=True)
class RouterFamily:
    """One router arithmetic under the contract: `route(router, forced, *args, **kwargs)` returns what the
    router's forward returns (forced None: the model's own routing); `ids_of(router, output)` reads the selected
    ids (N, K) from that output; `fingerprints` are the router codes (see `fingerprint`) it reproduces."""

    name: str
    route: Callable
    ids_of: Callable
    fingerprints: frozenset = frozenset()
    select: str = ""           # what it selects on, for docs and error messages
    weights: str = ""          # what its weights are made of


def _pick(select: torch.Tensor, k: int, forced: Forced | None, *, sorted: bool = True) -> torch.Tensor:
    """The router's own top-k of `select` on rows that fall back, the replayed ids on the others."""
    if forced is not None and forced.num_fallback == 0:
        return forced.ids
    own = torch.topk(select, k, dim=-1, sorted=sorted).indices
    if forced is None:
        return own
    return torch.where(forced.fallback, own, forced.ids)


def _needs_own(forced: Forced | None) -> bool:
    return forced is None or forced.num_fallback > 0


def _third(router, out):
    return out[2]


def _first(router, out):
    return out[0]


# ---- softmax over all experts, top-k of the probabilities, weights = those probabilities ----------------------

def _softmax_topk(router, forced, hidden_states):
    """Qwen3-MoE, Qwen2-MoE, Qwen3-Next, OLMoE, FlexOlmo, Mellum (norm_topk_prob from the config); Qwen3.5-MoE,
    Qwen3-VL-MoE (always normalised)."""
    hidden_states = hidden_states.reshape(-1, router.hidden_dim)
    router_logits = F.linear(hidden_states, router.weight)
    router_probs = torch.nn.functional.softmax(router_logits, dtype=torch.float, dim=-1)
    router_indices = _pick(router_probs, router.top_k, forced)
    router_top_value = router_probs.gather(1, router_indices)
    if getattr(router, "norm_topk_prob", True):
        router_top_value /= router_top_value.sum(dim=-1, keepdim=True)
    router_top_value = router_top_value.to(router_logits.dtype)
    return router_logits, router_top_value, router_indices


def _mixtral(router, forced, hidden_states):
    """Mixtral, MiniMax: softmax in float32, always normalised, weights left in float32."""
    hidden_states = hidden_states.reshape(-1, router.hidden_dim)
    router_logits = F.linear(hidden_states, router.weight)
    router_probs = torch.nn.functional.softmax(router_logits.float(), dim=-1)
    router_indices = _pick(router_probs, router.top_k, forced)
    router_top_value = router_probs.gather(1, router_indices)
    router_top_value /= router_top_value.sum(dim=-1, keepdim=True)
    return router_logits, router_top_value, router_indices


# ---- top-k of the logits, weights = softmax over the selected logits ------------------------------------------

def _gpt_oss(router, forced, hidden_states):
    router_logits = F.linear(hidden_states, router.weight, router.bias)
    router_indices = _pick(router_logits, router.top_k, forced)
    router_top_value = router_logits.gather(1, router_indices)
    router_scores = torch.nn.functional.softmax(router_top_value, dim=1, dtype=router_top_value.dtype)
    return router_logits, router_scores, router_indices


def _granite(router, forced, hidden_states):
    """Granite-MoE, Granite-MoE-Shared, Granite-MoE-Hybrid: returns (ids, weights, logits)."""
    router_logits = F.linear(hidden_states, router.weight).float()
    top_k_index = _pick(router_logits, router.top_k, forced)
    top_k_logits = router_logits.gather(1, top_k_index)
    top_k_weights = torch.softmax(top_k_logits, dim=-1).type_as(hidden_states)
    return top_k_index, top_k_weights, router_logits


def _llama4(router, forced, hidden_states):
    """Llama-4: top-k of the logits; the block gets dense (N, E) scores, sigmoid of the selected logits and 0
    (sigmoid of -inf) elsewhere, and multiplies every expert's input by them."""
    router_logits = F.linear(hidden_states, router.weight, router.bias)
    router_indices = _pick(router_logits, router.top_k, forced)
    router_top_value = router_logits.gather(1, router_indices)
    router_scores = torch.full_like(router_logits, float("-inf")).scatter_(1, router_indices, router_top_value)
    router_scores = torch.nn.functional.sigmoid(router_scores.float()).to(router_scores.dtype)
    return router_scores, router_logits


def _llama4_ids(router, out):
    # The dense scores are sigmoid(logit) > 0 at the selected experts and exactly 0 elsewhere: their top-k is the
    # selected set (in descending score order; the block's arithmetic does not depend on the order). Exact for
    # top_k=1 (every Llama-4 checkpoint) unless a selected logit is below float's sigmoid underflow (about -88).
    return torch.topk(out[0], router.top_k, dim=1).indices


# ---- sigmoid (or softmax) scores, bias-corrected and group-masked selection, weights from the plain scores --------

def _group_mask(scores_for_choice, router, group_score, fill):
    """DeepSeek's group-limited selection: keep the experts of the `topk_group` best of `num_group` groups."""
    E, G = router.num_experts, router.num_group
    if group_score == "top2":
        group_scores = scores_for_choice.view(-1, G, E // G).topk(2, dim=-1)[0].sum(dim=-1)
    else:
        group_scores = scores_for_choice.view(-1, G, E // G).max(dim=-1).values
    group_idx = torch.topk(group_scores, k=router.topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores)
    group_mask.scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(-1, G, E // G).reshape(-1, E)
    return scores_for_choice.masked_fill(~score_mask.bool(), fill)


def _deepseek_v3(router, forced, hidden_states):
    """DeepSeek-V3 (Kimi K2), GLM-4-MoE, GLM-4.5V, GLM-4-MoE-Lite, Dots1, Kimi-Linear, Exaone-MoE, Solar-Open,
    Nemotron-H, MiMo-V2-Flash, ...: sigmoid; select on sigmoid + e_score_correction_bias with the groups outside
    the top `topk_group` masked to -inf; weights = plain sigmoid at the ids, normalised (+1e-20), scaled."""
    hidden_states = hidden_states.view(-1, router.hidden_dim)
    router_logits = F.linear(hidden_states.type(torch.float32), router.weight.type(torch.float32))
    scores = router_logits.sigmoid()
    scores_for_choice = scores + router.e_score_correction_bias
    if _needs_own(forced):
        scores_for_choice = _group_mask(scores_for_choice, router, "top2", float("-inf"))
    topk_indices = _pick(scores_for_choice, router.top_k, forced, sorted=False)
    topk_weights = scores.gather(1, topk_indices)
    if router.norm_topk_prob:
        denominator = topk_weights.sum(dim=-1, keepdim=True) + 1e-20
        topk_weights /= denominator
    topk_weights = topk_weights * router.routed_scaling_factor
    return router_logits, topk_weights, topk_indices


def _deepseek_v2(router, forced, hidden_states):
    """DeepSeek-V2: softmax; `greedy` selects on it; `group_limited_greedy` on it with the groups outside the top
    `topk_group` (by their best expert) zeroed. Weights = softmax at the ids times routed_scaling_factor; the
    model gathers them from the masked scores, which equal the unmasked ones at its own ids: fallback rows read
    the masked scores as the model does, replayed rows the unmasked ones (a replayed expert outside the groups
    the trainer's router would pick keeps its probability instead of 0)."""
    hidden_states = hidden_states.view(-1, router.hidden_dim)
    router_logits = F.linear(hidden_states.type(torch.float32), router.weight.type(torch.float32))
    scores = router_logits.softmax(dim=-1, dtype=torch.float32)
    if router.topk_method == "greedy" or not _needs_own(forced):
        topk_indices = _pick(scores, router.top_k, forced, sorted=False)
    elif router.topk_method == "group_limited_greedy":
        masked = _group_mask(scores, router, "max", 0.0)
        topk_indices = _pick(masked, router.top_k, forced, sorted=False)
        scores = masked if forced is None else torch.where(forced.fallback, masked, scores)
    else:
        raise ValueError(f"DeepSeek-V2 topk_method {router.topk_method!r} is not greedy or group_limited_greedy")
    topk_weights = scores.gather(1, topk_indices)
    topk_weights = topk_weights * router.routed_scaling_factor
    return router_logits, topk_weights, topk_indices


def _minimax_m2(router, forced, hidden_states, e_score_correction_bias):
    """MiniMax-M2: sigmoid; select on sigmoid + the block's e_score_correction_bias; weights = plain sigmoid at
    the ids, normalised."""
    hidden_states = hidden_states.reshape(-1, router.hidden_dim)
    router_logits = F.linear(hidden_states.to(router.weight.dtype), router.weight)
    routing_weights = torch.nn.functional.sigmoid(router_logits.float())
    scores_for_choice = routing_weights + e_score_correction_bias
    top_k_index = _pick(scores_for_choice, router.top_k, forced, sorted=False)
    top_k_weights = routing_weights.gather(1, top_k_index)
    top_k_weights /= top_k_weights.sum(dim=-1, keepdim=True)
    return router_logits, top_k_weights, top_k_index


def _hy_v3(router, forced, hidden_states, e_score_correction_bias):
    """HY-V3: sigmoid; select on sigmoid + the block's bias; weights = sigmoid at the ids, normalised (+1e-20),
    times router_scaling_factor."""
    hidden_states = hidden_states.reshape(-1, router.hidden_dim)
    router_logits = F.linear(hidden_states.float(), router.weight.float())
    routing_weights = torch.sigmoid(router_logits)
    scores_for_choice = routing_weights + e_score_correction_bias
    top_k_index = _pick(scores_for_choice, router.top_k, forced, sorted=False)
    top_k_weights = routing_weights.gather(1, top_k_index)
    top_k_weights = top_k_weights / (top_k_weights.sum(dim=-1, keepdim=True) + 1e-20)
    top_k_weights = top_k_weights * router.router_scaling_factor
    return router_logits, top_k_weights, top_k_index


def _afmoe(router, forced, hidden_states, expert_bias):
    """AFMoE: sigmoid of `gate`; select on sigmoid + the block's expert_bias; weights = sigmoid at the ids,
    normalised (+1e-20), times route_scale."""
    _, _, hidden_dim = hidden_states.shape
    hidden_states = hidden_states.view(-1, hidden_dim)
    router_logits = router.gate(hidden_states).to(torch.float32)
    scores = torch.sigmoid(router_logits)
    selected_experts = _pick(scores + expert_bias, router.top_k, forced)
    top_scores = scores.gather(dim=1, index=selected_experts)
    denominator = top_scores.sum(dim=-1, keepdim=True) + 1e-20
    top_scores = top_scores / denominator
    top_scores = top_scores * router.route_scale
    return router_logits, top_scores, selected_experts


def _laguna(router, forced, hidden_states):
    """Laguna: optionally soft-capped logits; sigmoid; select on sigmoid + e_score_correction_bias; weights =
    sigmoid at the ids, normalised."""
    hidden_states = hidden_states.reshape(-1, router.hidden_dim)
    router_logits = F.linear(hidden_states, router.weight).float()
    if router.router_logit_softcapping > 0.0:
        router_logits = torch.tanh(router_logits / router.router_logit_softcapping) * router.router_logit_softcapping
    routing_scores = torch.sigmoid(router_logits)
    scores_for_selection = routing_scores + router.e_score_correction_bias.to(routing_scores.dtype)
    selected_experts = _pick(scores_for_selection, router.top_k, forced)
    routing_weights = routing_scores.gather(-1, selected_experts)
    routing_weights = routing_weights / routing_weights.sum(dim=-1, keepdim=True)
    routing_weights = routing_weights.to(hidden_states.dtype)
    return router_logits, routing_weights, selected_experts


def _lfm2_moe(router, forced, hidden_states, expert_bias=None):
    """LFM2-MoE: sigmoid; select on it (+ the block's expert_bias when use_expert_bias); weights = sigmoid at
    the ids, normalised (+1e-6) when norm_topk_prob, times routed_scaling_factor."""
    router_logits = F.linear(hidden_states, router.weight)
    routing_weights = router_logits.sigmoid()
    if router.use_expert_bias:
        scores_for_routing = routing_weights + expert_bias
        selected_experts = _pick(scores_for_routing, router.top_k, forced)
        routing_weights = torch.gather(routing_weights, dim=1, index=selected_experts).type_as(router_logits)
    else:
        selected_experts = _pick(routing_weights, router.top_k, forced)
        routing_weights = routing_weights.gather(1, selected_experts)
    if router.norm_topk_prob:
        routing_weights = routing_weights / (routing_weights.sum(dim=-1, keepdim=True) + 1e-6)
    routing_weights = routing_weights * router.routed_scaling_factor
    return router_logits, routing_weights, selected_experts


def _mistral4(router, forced, hidden_states):
    """Mistral-4: softmax; select on it with the groups outside the top `topk_group` (by their two best experts)
    zeroed; weights = the unmasked softmax at the ids, normalised (+1e-20) when norm_topk_prob, scaled."""
    hidden_states = hidden_states.view(-1, router.hidden_dim)
    router_logits = F.linear(hidden_states, router.weight)
    scores = router_logits.softmax(-1)
    scores_for_choice = _group_mask(scores, router, "top2", 0.0) if _needs_own(forced) else scores
    topk_indices = _pick(scores_for_choice, router.top_k, forced, sorted=False)
    topk_weights = scores.gather(1, topk_indices)
    if router.norm_topk_prob:
        denominator = topk_weights.sum(dim=-1, keepdim=True) + 1e-20
        topk_weights /= denominator
    topk_weights = topk_weights * router.routed_scaling_factor
    return router_logits, topk_weights, topk_indices


def _hunyuan(router, forced, hidden_states):
    """HunYuan-MoE-V1: softmax (float32) of `wg`; weights = the softmax at the ids, normalised."""
    hidden_states = hidden_states.reshape(-1, hidden_states.shape[-1])
    if router.wg.weight.dtype == torch.float32:
        hidden_states = hidden_states.float()
    router_logits = router.wg(hidden_states)
    routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
    selected_experts = _pick(routing_weights, router.top_k, forced)
    routing_weights = routing_weights.gather(1, selected_experts)
    routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
    return router_logits, routing_weights.to(router_logits.dtype), selected_experts


def _ernie(router, forced, hidden_states):
    """Ernie-4.5-MoE: softmax (float32, autocast off); select on softmax + the expert statistics' bias
    (`moe_statics`); weights = the plain softmax at the ids, normalised (sum clamped at norm_min)."""
    maybe_autocast = sys.modules[type(router).__module__].maybe_autocast
    device_type = hidden_states.device.type if isinstance(hidden_states.device.type, str) else "cpu"
    with maybe_autocast(device_type=device_type, enabled=False):
        router_logits = F.linear(hidden_states.float(), router.weight.float())
        routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
        selected_experts = _pick(router.moe_statics(routing_weights), router.top_k, forced)
        routing_weights = torch.gather(routing_weights, dim=-1, index=selected_experts)
        routing_weights = routing_weights / torch.clamp(routing_weights.sum(dim=-1, keepdim=True), min=router.norm_min)
    routing_weights = routing_weights.to(hidden_states.dtype)
    return router_logits, routing_weights, selected_experts


def _granite_swa(router, forced, hidden_states):
    """Granite-MoE-SWA: Granite's arithmetic, returning (logits, weights, ids)."""
    top_k_index, top_k_weights, router_logits = _granite(router, forced, hidden_states)
    return router_logits, top_k_weights, top_k_index


def _aria(router, forced, hidden_states):
    """Aria: top-k of the logits; weights = softmax over the logits at the ids; returns (ids, weights, logits)."""
    router_logits = torch.nn.functional.linear(hidden_states, router.weight)
    top_k_index = _pick(router_logits, router.top_k, forced)
    top_k_logits = router_logits.gather(-1, top_k_index)
    top_k_weights = torch.nn.functional.softmax(top_k_logits, dim=-1)
    return top_k_index, top_k_weights, router_logits


def _cohere2(router, forced, hidden_states):
    """Cohere2-MoE: top-k of the logits; weights = softmax over the logits at the ids, or their sigmoid
    (normalised when norm_topk_prob), cast to the input dtype."""
    router_logits = F.linear(hidden_states, router.weight)
    selected_experts = _pick(router_logits, router.top_k, forced)
    router_scores = router_logits.gather(-1, selected_experts)
    if router.expert_selection_fn == "softmax":
        router_scores = F.softmax(router_scores, dim=1, dtype=torch.float)
    elif router.expert_selection_fn == "sigmoid":
        router_scores = F.sigmoid(router_scores)
        if router.norm_topk_prob:
            router_scores = router_scores / torch.sum(router_scores, dim=-1, keepdims=True)
    else:
        raise ValueError("`expert_selection_fn` can only be `softmax` or `sigmoid`")
    router_scores = router_scores.to(hidden_states.dtype)
    return router_logits, router_scores, selected_experts


# ---- Phi-MoE: sparsemixer ---------------------------------------------------------------------------------------

def _phimoe(router, forced, hidden_states):
    """Phi-MoE's sparsemixer, top-2 in two rounds. Round r selects (eval: argmax; training: Gumbel sample) among
    the experts whose logit lies within 2 * router_jitter_noise (relative) of the best remaining one, and weighs
    the selected expert by its softmax over those experts (training: through PhimoeMultiplier, with a random
    1 or 1/3 factor). Replayed rows take their ids in each round; the window is the model's, so a replayed expert
    outside it gets weight 0. The random draws (input jitter, Gumbel noise, factors) are taken exactly as the
    model takes them, so with the same RNG state its own ids replay to the same numbers."""
    if router.training and router.input_jitter_noise > 0:
        hidden_states *= torch.empty_like(hidden_states).uniform_(
            1.0 - router.input_jitter_noise, 1.0 + router.input_jitter_noise
        )
    router_logits = F.linear(hidden_states, router.weight, router.bias)
    multiplier_cls = sys.modules[type(router).__module__].PhimoeMultiplier
    scores, jitter_eps, training = router_logits, router.router_jitter_noise, router.training
    picked, weights = [], []
    masked_scores = scores
    for r in range(2):
        with torch.no_grad():
            mask_logits_threshold, max_ind = masked_scores.max(dim=-1, keepdim=True)
            factor = scores.abs().clamp(min=mask_logits_threshold)
            mask_logits_threshold = ((mask_logits_threshold - scores) / factor) > (2 * jitter_eps)
        masked_gates = masked_scores.masked_fill(mask_logits_threshold, float("-inf"))
        if training:
            own = (masked_gates - torch.empty_like(masked_gates, memory_format=torch.legacy_contiguous_format)
                   .exponential_().log()).max(dim=-1)[1].unsqueeze(-1)
        else:
            own = max_ind
        if forced is None:
            selected = own
        elif forced.num_fallback == 0:
            selected = forced.ids[:, r:r + 1]
        else:
            selected = torch.where(forced.fallback, own, forced.ids[:, r:r + 1])
        masked_gates = torch.softmax(masked_gates, dim=-1)
        multiplier_o = masked_gates.gather(dim=-1, index=selected)
        if training:
            max_scores, max_ind = masked_gates.max(dim=-1, keepdim=True)
            noise = torch.rand_like(max_scores)
            if r == 1:
                noise = noise.uniform_()
            mask_for_one = torch.logical_or(selected == max_ind, noise > 0.75)
            mask_for_one = torch.add(0.3333, mask_for_one, alpha=0.6667).type_as(masked_gates)
            multiplier = multiplier_cls.apply(scores, multiplier_o, selected, masked_gates, mask_for_one)
        else:
            multiplier = multiplier_o
        picked.append(selected)
        weights.append(multiplier)
        if r == 0:
            masked_scores = torch.scatter(scores, -1, selected, float("-inf"))
    return router_logits, torch.concat(weights, dim=-1), torch.concat(picked, dim=-1)


# ---- the families, with the transformers 5.x router code each reproduces ---------------------------------------
# A fingerprint is refreshed with `python -m routing_replay.replay.router_codes`, which prints every MoE router class
# of the installed transformers with its fingerprint and family; add one here only after the architecture's
# replay tests (tests/test_replay_hf_archs.py) pass with it.

FAMILIES: tuple[RouterFamily, ...] = (
    RouterFamily("softmax_topk", _softmax_topk, _third, frozenset({"8d80347ee44bdbbb", "88fca256b31df555"}),
                 select="softmax of the logits", weights="the softmax at the ids, normalised if norm_topk_prob"),
    RouterFamily("mixtral", _mixtral, _third, frozenset({"fe3cdde2cc6a78a5"}),
                 select="softmax of the logits (float32)", weights="the softmax at the ids, normalised"),
    RouterFamily("gpt_oss", _gpt_oss, _third, frozenset({"5ee265ca42d03fa8"}),
                 select="the logits (with bias)", weights="softmax over the logits at the ids"),
    RouterFamily("granite", _granite, _first, frozenset({"a663e18820322190"}),
                 select="the logits", weights="softmax over the logits at the ids"),
    RouterFamily("llama4", _llama4, _llama4_ids, frozenset({"8fec3c0e211e53de"}),
                 select="the logits", weights="sigmoid of the logits at the ids, 0 elsewhere"),
    RouterFamily("deepseek_v3", _deepseek_v3, _third, frozenset({"86cffccbaa807e66"}),
                 select="sigmoid + e_score_correction_bias, groups outside the top topk_group masked",
                 weights="the sigmoid at the ids, normalised if norm_topk_prob, times routed_scaling_factor"),
    RouterFamily("deepseek_v2", _deepseek_v2, _third, frozenset({"e6896ffabdedaf63"}),
                 select="softmax of the logits, groups outside the top topk_group zeroed (group_limited_greedy)",
                 weights="the softmax at the ids times routed_scaling_factor"),
    RouterFamily("minimax_m2", _minimax_m2, _third, frozenset({"98e8aaafd74dc944"}),
                 select="sigmoid + the block's e_score_correction_bias", weights="the sigmoid at the ids, normalised"),
    RouterFamily("hy_v3", _hy_v3, _third, frozenset({"2ec67ab2451b5169"}),
                 select="sigmoid + the block's e_score_correction_bias",
                 weights="the sigmoid at the ids, normalised, times router_scaling_factor"),
    RouterFamily("afmoe", _afmoe, _third, frozenset({"6553a5269c5cf30d"}),
                 select="sigmoid + the block's expert_bias",
                 weights="the sigmoid at the ids, normalised, times route_scale"),
    RouterFamily("laguna", _laguna, _third, frozenset({"03ca1636a052a589"}),
                 select="sigmoid of the (soft-capped) logits + e_score_correction_bias",
                 weights="the sigmoid at the ids, normalised"),
    RouterFamily("lfm2_moe", _lfm2_moe, _third, frozenset({"7e3106b8384c5ab7"}),
                 select="sigmoid (+ the block's expert_bias)",
                 weights="the sigmoid at the ids, normalised if norm_topk_prob, times routed_scaling_factor"),
    RouterFamily("mistral4", _mistral4, _third, frozenset({"15cc625dc3e3d406"}),
                 select="softmax, groups outside the top topk_group zeroed",
                 weights="the unmasked softmax at the ids, normalised if norm_topk_prob, times routed_scaling_factor"),
    RouterFamily("hunyuan", _hunyuan, _third, frozenset({"e0fce8fa63fe3244"}),
                 select="softmax of the logits (float32)", weights="the softmax at the ids, normalised"),
    RouterFamily("ernie", _ernie, _third, frozenset({"3da38052c028a61d"}),
                 select="softmax + the expert statistics' bias (moe_statics)",
                 weights="the plain softmax at the ids, normalised"),
    RouterFamily("granite_swa", _granite_swa, _third, frozenset({"d68d3cf08c8660cc"}),
                 select="the logits", weights="softmax over the logits at the ids"),
    RouterFamily("aria", _aria, _first, frozenset({"ebf4163ba015a9a4"}),
                 select="the logits", weights="softmax over the logits at the ids"),
    RouterFamily("cohere2", _cohere2, _third, frozenset({"ac107562cd91d089"}),
                 select="the logits",
                 weights="softmax, or sigmoid (normalised if norm_topk_prob), of the logits at the ids"),
    RouterFamily("phimoe", _phimoe, _third, frozenset({"40466301289c4356"}),
                 select="sparsemixer: argmax (eval) or Gumbel sample (training) within the jitter window, twice",
                 weights="softmax over the window at the selected expert, per round"),
)


# ---- fingerprints ---------------------------------------------------------------------------------------------

def _tokens(src: str) -> list[str]:
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(textwrap.dedent(src)).readline):
        if tok.type in (tokenize.COMMENT, tokenize.NL, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER):
            continue
        if tok.type == tokenize.STRING and tok.string.lstrip("rbuRBU").startswith(('"""', "'''")):
            continue
        out.append("\n" if tok.type == tokenize.NEWLINE else tok.string)
    return out


def fingerprint(cls: type) -> str | None:
    """16 hex digits naming the code of `cls.forward` and of the functions and autograd Functions of its module
    that it calls (transitively); None when the source cannot be read."""
    fwd = getattr(cls, "forward", None)
    module = sys.modules.get(getattr(cls, "__module__", ""), None)
    try:
        parts, seen, todo = [], set(), [fwd]
        while todo:
            obj = todo.pop(0)
            toks = _tokens(inspect.getsource(obj))
            parts.append(" ".join(toks))
            for name in toks:
                if name in seen or module is None:
                    continue
                ref = getattr(module, name, None)
                if getattr(ref, "__module__", None) != module.__name__:
                    continue
                if inspect.isfunction(ref) or (inspect.isclass(ref) and issubclass(ref, torch.autograd.Function)):
                    seen.add(name)
                    todo.append(ref)
    except (OSError, TypeError):
        return None
    return hashlib.sha256("\n\n".join(parts).encode()).hexdigest()[:16]


_BY_FINGERPRINT: dict[str, RouterFamily] = {fp: fam for fam in FAMILIES for fp in fam.fingerprints}
_FP_CACHE: dict[type, str | None] = {}


def family_of(cls: type) -> RouterFamily | None:
    """The built-in family whose code `cls.forward` is, or None."""
    if cls not in _FP_CACHE:
        _FP_CACHE[cls] = fingerprint(cls) if isinstance(cls, type) and issubclass(cls, torch.nn.Module) else None
    fp = _FP_CACHE[cls]
    return None if fp is None else _BY_FINGERPRINT.get(fp)
