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

Traps, each handled here (read in megatron-core 0.16.1 and 0.19.2):
- Replay is skipped silently unless every router reaches `RouterReplay.get_replay_topk` with the ids it was given:
  with `moe_router_fusion` `moe_utils.topk_routing_with_score_function` returns TransformerEngine's fused top-k
  before it; `moe_router_load_balancing_type="sinkhorn"` never calls it; `"quantile_balancing"` (0.19) passes its
  own `precomputed_indices` and no `router_replay`; without `moe_enable_routing_replay` no router owns a
  RouterReplay; a `moe_expert_capacity_factor` drops replayed tokens after it; `moe_router_force_load_balancing`
  and `moe_router_force_biased` replace the router's logits (the replayed experts get weights the model never
  computed); and a training CUDA graph around the router (`cuda_graph_impl` with the whole layer, "moe" or
  "moe_router" captured, or "full_iteration") replays the ids it was captured with, not the ones set later.
  `check_megatron_config(config)` refuses each. `MicroBatchReplay` also checks, per router and micro-batch, that the
  router took the ids it was given (given the router modules, that its routing map is exactly those ids), so a
  path around RouterReplay that this list does not know is reported by `finish()` instead of training silently.
- Under replay the auxiliary load-balancing losses (and `moe_router_enable_expert_bias`'s token counts for
  the bias update) count what they count without replay: the aux losses take the router's own top-k
  (`compute_routing_scores_for_aux_loss`), the bias update the replayed routing map. Nothing here changes that.
- Multi-token prediction (`mtp_num_layers`): each MTP layer's router owns a RouterReplay too, created after the
  decoder's, so `RouterReplay.global_router_replay_instances` is longer than the record's MoE layers, and a
  repeated MTP layer (`mtp_use_repeated_layer`) calls its one router `mtp_num_layers` times per forward. The
  engine's records hold the decoder's layers only. `megatron_routers(model)` splits the routers explicitly: the
  decoder's, each with its record layer (`layer_number - 1`), are replayed; the MTP routers are handed to
  `MicroBatchReplay(mtp_routers=...)`, which keeps them routing on their own (no action, no entries) and refuses a
  step that set an action or ids on them.
- The dispatcher builds its routing map by scattering the ids (`zeros.scatter(1, top_indices, 1)`): a row with
  a repeated id routes the token to fewer than K experts while its probabilities still count K, so per-expert
  token counts and the all-to-all splits go wrong. Filled rows are the distinct `arange(K)`, and a record row
  with a repeated id is refused. A replay tensor with fewer rows than the router has tokens would leave the
  remaining tokens routed nowhere (`gather` takes the shorter index): `MicroBatchReplay` refuses it.
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
from typing import NamedTuple, Sequence

import torch

from routing_replay.replay.tensors import ReplayTensors


def megatron_replay_data(rt: ReplayTensors, *, padding_side: str = "right", layers: tuple[int, int] | None = None,
                         model_layers: Sequence[int] | None = None, fallback: Sequence[torch.Tensor] | None = None,
                         device=None) -> list[torch.Tensor]:
    """One (tokens, K) int64 tensor per MoE layer of axis L (or of [lo, hi), or per entry of `model_layers`), tokens
    in Megatron's order.

    rt: from `replay.padded` (tokens = S * B, sequence-major) or `replay.packed` (tokens = T), "moe" layout.
    padding_side: the side `padded` was called with (to tell padding rows from last tokens).
    model_layers: the 0-based model layer of each router to feed (`megatron_routers(model).layers`): the column of
    `rt.layer_ids` naming that layer, refused when the record has none.
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
        if rt.sample_end is not None:                     # a context-parallel chunk's last row is not its sample's
            last &= rt.sample_end[:, None]
        ids, mask = ids.transpose(0, 1).reshape(S * B, *ids.shape[2:]), mask.transpose(0, 1).reshape(S * B, -1)
        real, last = real.t().reshape(-1), last.t().reshape(-1)
    elif ids.dim() == 3:                                  # (T, L, K) packed
        T = ids.shape[0]
        real = torch.ones(T, dtype=torch.bool)
        last = torch.zeros(T, dtype=torch.bool)
        ends = rt.cu_seqlens[1:].to(torch.int64) - 1
        last[ends if rt.sample_end is None else ends[rt.sample_end]] = True
    else:
        raise ValueError(f"expert_ids have shape {tuple(ids.shape)}, expected (B, S, L, K) or (T, L, K)")
    column_layers = rt.layer_ids.tolist()
    if layers is not None and model_layers is not None:
        raise ValueError("pass layers=(lo, hi) or model_layers=, not both")
    if layers is not None:
        lo, hi = layers
        ids, mask, column_layers = ids[:, lo:hi], mask[:, lo:hi], column_layers[lo:hi]
    if model_layers is not None:
        absent = [int(x) for x in model_layers if int(x) not in column_layers]
        if absent:
            raise ValueError(f"routers of model layers {absent} have no column in the replay data (its layer_ids are "
                             f"{column_layers}): a dense layer in the record, or another model")
        cols = [column_layers.index(int(x)) for x in model_layers]
        ids, mask, column_layers = ids[:, cols], mask[:, cols], [column_layers[c] for c in cols]
    N, L, K = ids.shape
    never = mask.all(0)                                   # a column without routing in any token
    if bool(never.any()) and not bool(never.all()):
        cols = never.nonzero()[:, 0].tolist()
        raise ValueError(f"columns {cols} (model layers {[column_layers[c] for c in cols]}) have no routing in "
                         f"any token: dense layers of an 'all'-layout tensor? megatron_replay_data takes the 'moe' "
                         f"layout (one column per MoE layer, in the routers' order)")
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
    balancing = getattr(config, "moe_router_load_balancing_type", None)
    if balancing == "sinkhorn":
        problems.append("moe_router_load_balancing_type='sinkhorn': sinkhorn routing never calls RouterReplay")
    if balancing == "quantile_balancing":
        problems.append("moe_router_load_balancing_type='quantile_balancing': its own top-k is passed as "
                        "precomputed_indices without RouterReplay (replay silently skipped)")
    cap = getattr(config, "moe_expert_capacity_factor", None)
    if cap is not None:
        problems.append(f"moe_expert_capacity_factor={cap}: token dropping discards replayed routes")
    if getattr(config, "moe_router_force_load_balancing", False):
        problems.append("moe_router_force_load_balancing=True: random logits replace the router's (benchmark only)")
    biased = getattr(config, "moe_router_force_biased", None)
    if biased is not None:
        problems.append(f"moe_router_force_biased={biased}: random biases change the router's logits")
    graphed = _router_in_cuda_graph(config)
    if graphed:
        problems.append(f"{graphed}: the captured router replays the ids it was captured with")
    if problems:
        raise ValueError("routing replay cannot run on this TransformerConfig: " + "; ".join(problems))


def _router_in_cuda_graph(config) -> str:
    """The CUDA-graph setting that captures the router in training ('' if none does)."""
    impl = getattr(config, "cuda_graph_impl", "none") or "none"
    if impl == "none":
        return ""
    if impl == "full_iteration":
        return "cuda_graph_impl='full_iteration'"
    field = "cuda_graph_modules" if hasattr(config, "cuda_graph_modules") else "cuda_graph_scope"
    scope = getattr(config, field, None)
    scope = [] if scope is None else [scope] if isinstance(scope, str) or not isinstance(scope, (list, tuple)) \
        else list(scope)
    names = sorted({getattr(x, "name", x) for x in scope})
    if not names or {"full", "full_iteration", "moe", "moe_router"} & set(names):   # empty: the whole layer
        return f"cuda_graph_impl={impl!r} with {field}={names}"
    return ""


class MegatronRouters(NamedTuple):
    """A model's RouterReplay instances split by what replays them: the decoder's, in model order, with the record
    layer (0-based decoder layer) each routes, and the multi-token-prediction layers' (no record holds them)."""
    decoder: list
    layers: list[int]
    mtp: list


def megatron_routers(model_chunks) -> MegatronRouters:
    """The routers of one rank's model chunks (a module or a list, in virtual-pipeline order), split into the
    decoder's and the MTP layers'. A router is an MTP router when it says so (`is_mtp_layer`, 0.19) or sits under a
    module named `mtp` (GPTModel.mtp). `layers` are `router.layer_number - 1`, the global 0-based decoder layer
    under pipeline parallelism too: `megatron_replay_data(t, model_layers=routers.layers)` gives this rank's
    routers their columns of the record, in their order.

        routers = megatron_routers(model_chunks)
        data = [megatron_replay_data(t, model_layers=routers.layers) for t in micro_batches]
        replay = MicroBatchReplay(routers.decoder, RouterReplayAction, data, mtp_routers=routers.mtp)"""
    chunks = model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    decoder, layers, mtp = [], [], []
    for chunk in chunks:
        for name, module in chunk.named_modules():
            rr = getattr(module, "router_replay", None)
            if rr is None or not hasattr(rr, "replay_backward_list"):
                continue
            if getattr(module, "is_mtp_layer", False) or "mtp" in name.split("."):
                mtp.append(rr)
                continue
            number = getattr(module, "layer_number", None)
            if number is None:
                raise ValueError(f"router {name!r} has no layer_number (set by its TransformerLayer)")
            decoder.append(rr)
            layers.append(int(number) - 1)
    return MegatronRouters(decoder, layers, mtp)


class _Watch:
    """Own one router's check that it routes on the ids it was given: its RouterReplay's `get_replay_topk` is
    wrapped (per instance) to note each call and refuse a row-count mismatch, and its module, when given, gets a
    forward hook that compares its routing map with those ids. Undone by `close`."""

    def __init__(self, owner: "MicroBatchReplay", m: int, rr, module):
        self.owner, self.m, self.rr = owner, m, rr
        self.taken = None                                 # ids the last get_replay_topk call returned
        self.calls = 0                                    # get_replay_topk calls in the current forward
        self.fired = 0                                    # module forwards in the current forward
        original = rr.get_replay_topk

        def get_replay_topk(scores, topk, *args, **kwargs):
            probs, idx = original(scores, topk, *args, **kwargs)
            if idx.shape[0] != scores.shape[0]:
                raise ValueError(f"router {m} routes {scores.shape[0]} tokens, its replay ids have {idx.shape[0]} "
                                 f"rows (the rest would reach no expert)")
            self.calls += 1
            self.taken = idx
            return probs, idx
        rr.get_replay_topk = get_replay_topk
        self.hook = module.register_forward_hook(self._check) if module is not None else None

    def _check(self, module, args, output):
        self.fired += 1
        routing = output[1] if isinstance(output, tuple) and len(output) == 2 else None
        if not isinstance(routing, torch.Tensor) or routing.dim() != 2:
            return
        phase = self.owner.phase
        taken, self.taken = self.taken, None
        n = routing.shape[0]
        if taken is None:                                 # RouterReplay never consulted
            self.owner.note(self.m, phase, n, n)
            return
        taken = taken.to(routing.device)
        if routing.dtype == torch.bool:                   # (tokens, experts) routing map
            want = torch.zeros_like(routing).scatter(1, taken, True)
            bad = int((routing != want).any(1).sum())
        else:                                             # (tokens, K) ids (dense output)
            bad = int((routing.sort(1).values != taken.sort(1).values).any(1).sum())
        self.owner.note(self.m, phase, bad, n)

    def close(self):
        self.rr.__dict__.pop("get_replay_topk", None)
        if self.hook is not None:
            self.hook.remove()


class MicroBatchReplay:
    """Own one step's replay data for a list of Megatron-Core routers (`megatron_routers(model).decoder`, or
    RouterReplay instances, or the router modules that own them): sets each micro-batch's ids once before its
    forward, switches to REPLAY_BACKWARD after it so a recompute pops that micro-batch's entry, and checks and
    clears at the end.

        routers = megatron_routers(model)
        data = [megatron_replay_data(t, model_layers=routers.layers) for t in mbs]
        replay = MicroBatchReplay(routers.decoder, RouterReplayAction, data, mtp_routers=routers.mtp)
        def forward_step(data_iterator, model):       # Megatron calls it once per micro-batch, in order
            with replay.forward():
                output = model(...)
            return output, loss_func
        forward_backward_func(forward_step_func=forward_step, ...)
        replay.finish()

    Megatron runs each chunk's backwards in forward order, so the FIFO `replay_backward_list` of every recomputed
    router meets micro-batch i's ids at i's backward; routers that are not recomputed keep their entries until
    `finish`, which accepts per router either all entries consumed or none. `finish` also raises when a router
    did not take its ids: never consulted RouterReplay in a forward (quantile balancing, the fused router, ...),
    or, given router modules, produced a routing map other than the ids (rows counted). MTP routers route on
    their own: they must hold no action and no ids.
    """

    def __init__(self, routers: Sequence, actions, micro_batches: Sequence[Sequence[torch.Tensor]], *,
                 mtp_routers: Sequence = ()):
        self.modules = [r if hasattr(r, "router_replay") else None for r in routers]
        self.routers = [r.router_replay if hasattr(r, "router_replay") else r for r in routers]
        for m, r in enumerate(self.routers):
            if r is None:
                raise ValueError(f"router {m} owns no RouterReplay (moe_enable_routing_replay=False)")
        self.mtp = [r.router_replay if hasattr(r, "router_replay") else r for r in mtp_routers]
        shared = {id(r) for r in self.routers} & {id(r) for r in self.mtp}
        if shared:
            raise ValueError(f"{len(shared)} routers are given both as decoder and as MTP routers")
        self.actions = actions
        self.data = [list(mb) for mb in micro_batches]
        for i, mb in enumerate(self.data):
            if len(mb) != len(self.routers):
                raise ValueError(f"micro-batch {i} has {len(mb)} layers of replay data, {len(self.routers)} routers")
        self._check_mtp("before the step")
        stale = [len(r.replay_backward_list) for r in self.routers]
        if any(stale):
            raise ValueError(f"routers hold {stale} replay_backward_list entries from an earlier pass (a forward-only "
                             f"pass leaves one per micro-batch; call RouterReplay.clear_global_indices() after it): "
                             f"backward would replay them instead of this step's")
        self.next = 0
        self.phase = "recompute"
        self.unfollowed: dict[tuple[int, str], list[int]] = {}   # (router, phase) -> [rows not following, rows]
        self.watches = [_Watch(self, m, r, mod) for m, (r, mod) in enumerate(zip(self.routers, self.modules))]

    def note(self, m: int, phase: str, bad: int, rows: int) -> None:
        """Count a router call's rows that did not follow the ids (called by the router's watch)."""
        seen = self.unfollowed.setdefault((m, phase), [0, 0])
        seen[0] += bad
        seen[1] += rows

    def _check_mtp(self, when: str) -> None:
        held = [(m, len(r.replay_backward_list), r.router_replay_action) for m, r in enumerate(self.mtp)
                if r.replay_backward_list or r.target_topk_idx is not None or r.router_replay_action is not None]
        if held:
            raise ValueError(f"MTP routers {[h[0] for h in held]} hold replay ids or an action {when} "
                             f"(entries {[h[1] for h in held]}, actions {[str(h[2]) for h in held]}): no record "
                             f"routes the MTP layers, they route on their own; set ids on the decoder's routers only "
                             f"(RouterReplay.set_replay_data sets every router's, MTP included)")

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
        for w in self.watches:
            w.calls, w.fired, w.taken = 0, 0, None
        self.next = i + 1
        self.phase = f"forward {i}"
        try:
            yield
        finally:
            self.phase = "recompute"
            for r in self.routers:
                r.set_router_replay_action(self.actions.REPLAY_BACKWARD)
            for m, w in enumerate(self.watches):
                if (w.calls == 0 and w.hook is None) or (w.hook is not None and w.fired == 0):   # never routed
                    rows = int(self.data[i][m].shape[0])
                    self.note(m, f"forward {i}", rows, rows)

    def finish(self) -> list[int]:
        """After the step: check every router took its ids and its list was consumed entirely (recomputed) or not
        at all, clear the routers' ids and actions; returns the entries each router had left."""
        for w in self.watches:
            w.close()
        self.watches = []
        n = len(self.data)
        if self.next != n:
            raise ValueError(f"{self.next} of {n} micro-batches went through forward")
        left = [len(r.replay_backward_list) for r in self.routers]
        for r in self.routers:
            r.clear_indices()
            r.clear_router_replay_action()
        missed = {k: v for k, v in self.unfollowed.items() if v[0]}
        if missed:
            first = ", ".join(f"router {m} {phase}: {rows - bad} of {rows} rows follow"
                              for (m, phase), (bad, rows) in sorted(missed.items())[:4])
            raise ValueError(f"{sum(v[0] for v in missed.values())} router rows did not follow the replayed ids "
                             f"({first}): the router chose its experts around RouterReplay (quantile balancing, "
                             f"the fused router, sinkhorn, token dropping; check_megatron_config names them)")
        bad = [m for m, k in enumerate(left) if k not in (0, n)]
        if bad:
            raise ValueError(f"routers {bad} have {[left[m] for m in bad]} of {n} backward entries left: their "
                             f"recompute ran for some micro-batches only, so it replayed misaligned ids")
        self._check_mtp("after the step")
        return left
