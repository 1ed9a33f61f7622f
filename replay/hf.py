"""Force the routing of Hugging Face transformers MoE models to replayed expert ids, keeping router gradients.

`with replay_routing(model, expert_ids, no_routing) as stats: loss = model(...).loss; loss.backward()`.
Inside, every MoE router takes the replayed experts instead of its own top-k, and its routing weights are its
own arithmetic at those ids (softmax or sigmoid, normalisation, scaling factor, casts), computed from its own
logits, so gradients reach the router weights as usual. Rows flagged in `no_routing` (and any row holding a -1
id) fall back: they select exactly what the model itself selects (bias-corrected, group-masked, sampled, as its
router does), counted in `stats.fallback_rows`. The contract a router must fit, and the families of router
arithmetic that fit it, are in `replay.routers`; docs/REPLAY_HF.md.

Needs transformers 5.x, whose MoE blocks own a router module (`.gate`, `.router`) returning its selected ids
and weights, which the block hands to its experts. `replay_routing` replaces that router's `forward` on the
instance (nothing at class level, nothing else in the model) and restores it on exit. Routers are found by
their code (`routers.family_of`): every architecture whose router is one the families reproduce works, whatever
its class names; a model with any MoE router that is not is refused by name, before anything is patched.
`register_moe_block` adds an architecture through a family of one's own, checked at registration and, on its
first call, against the router's own forward.

Under replay the model's auxiliary load-balancing loss (`output_router_logits=True`) is computed from the
router logits, which are unchanged: it counts the router's own top-k, not the replayed experts (as Megatron-Core
does under its router replay).

The ids are data, not state: the router of model layer i always reads column i of the replay tensor, whatever
the call order, so gradient checkpointing's recompute selects the same experts as the first forward.

Expert ids are logical expert ids (0 .. num_experts-1), the ones the model's router indexes its experts with.
The replay tensor's token order is the model's flattened `(batch, seq)` order: (B, S, L, K) for a padded batch
fed as input_ids (B, S), (T, L, K) for packed sequences fed as (1, T). `replay.tensors` builds both.
"""

from __future__ import annotations

import re
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from routing_replay.replay.routers import FAMILIES, Forced, RouterFamily, family_of, fingerprint

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")
# A module that routes tokens to experts: a router-like class name, or a `top_k` / `num_experts_per_tok` int.
_ROUTERISH_RE = re.compile(r"(Router|TopKGating|Gating|Gate)$")


@dataclass(frozen=True)
class MoEBlockSpec:
    """How one MoE block routes: the attribute holding its router module, the router's class name, and the
    family (`routers.RouterFamily`) whose arithmetic that router runs."""

    router_attr: str
    router_class: str
    family: RouterFamily


# Blocks registered by hand (register_moe_block), by block class name; every other block is found by its
# router's code (routers.family_of).
MOE_BLOCKS: dict[str, MoEBlockSpec] = {}
_CONFORMING: set = set()          # (router class, family name) checked against the router's own forward


def _loaded_class(name: str):
    """The transformers class of that name among the modeling modules already imported, or None."""
    for modname, mod in list(sys.modules.items()):
        if modname.startswith("transformers.models.") and ".modeling_" in modname \
                and isinstance(vars(mod).get(name), type):
            return vars(mod)[name]
    return None


def register_moe_block(block_class, spec: MoEBlockSpec) -> None:
    """Teach replay_routing an MoE block class (a class or its name) whose router runs `spec.family`.

    Checked here: the spec's fields, and, when the router class is already imported and the family names
    fingerprints (the built-in ones do), that the router's code is one the family reproduces. A family of one's
    own (no fingerprints) is checked on the router's first call under replay: with no row replayed its output
    must equal the router's own forward bit for bit, or replay_routing raises naming both."""
    name = block_class if isinstance(block_class, str) else getattr(block_class, "__name__", None)
    if not isinstance(name, str) or not name.isidentifier():
        raise TypeError(f"register_moe_block takes a block class or its name, got {block_class!r}")
    if not isinstance(spec, MoEBlockSpec):
        raise TypeError(f"register_moe_block({name!r}, spec): spec must be a MoEBlockSpec, got {type(spec).__name__}")
    if not (isinstance(spec.router_attr, str) and spec.router_attr.isidentifier()):
        raise ValueError(f"{name}: router_attr {spec.router_attr!r} is not an attribute name")
    fam = spec.family
    if not isinstance(fam, RouterFamily) or not callable(fam.route) or not callable(fam.ids_of):
        raise TypeError(f"{name}: spec.family must be a routers.RouterFamily with callable route and ids_of, "
                        f"got {fam!r}")
    router_cls = _loaded_class(spec.router_class)
    if router_cls is not None:
        _check_code(name, router_cls, fam)
    MOE_BLOCKS[name] = spec


def _check_code(block_name: str, router_cls: type, fam: RouterFamily) -> None:
    """A family with fingerprints runs only the router code it was verified on."""
    if not fam.fingerprints:
        return
    fp = fingerprint(router_cls)
    if fp not in fam.fingerprints:
        own = family_of(router_cls)
        hint = (f"family {own.name!r} reproduces it (selects on {own.select}; weights: {own.weights})"
                if own is not None else "no built-in family reproduces it")
        raise ValueError(f"{block_name}: {router_cls.__name__}.forward (code {fp}) is not a router family "
                         f"{fam.name!r} reproduces (it selects on {fam.select}; weights: {fam.weights}); {hint}")


def _layer_of(name: str) -> int | None:
    m = None
    for m in _LAYER_RE.finditer(name + "."):
        pass
    return None if m is None else int(m.group(1))


def find_moe_blocks(model: torch.nn.Module) -> list[tuple[int, torch.nn.Module, MoEBlockSpec]]:
    """(model layer index, block, spec) of every MoE block under `layers.<i>.`, in layer order.

    Raises ValueError naming every module that routes tokens to experts with arithmetic replay_routing does not
    reproduce (a model is replayed whole or not at all), and MoE blocks outside `layers.<i>.` or sharing one."""
    mods = dict(model.named_modules())
    found: dict[str, tuple[torch.nn.Module, MoEBlockSpec]] = {}
    routers: set[str] = set()
    for name, mod in mods.items():
        spec = MOE_BLOCKS.get(type(mod).__name__)
        if spec is not None:
            router = getattr(mod, spec.router_attr, None)
            if type(router).__name__ != spec.router_class:
                raise ValueError(f"{name}.{spec.router_attr} is {type(router).__name__}, replay_routing was told "
                                 f"{spec.router_class} for {type(mod).__name__} (another transformers version?)")
            _check_code(type(mod).__name__, type(router), spec.family)
            found[name] = (mod, spec)
            routers.add(f"{name}.{spec.router_attr}" if name else spec.router_attr)
    for name, mod in mods.items():
        fam = family_of(type(mod))
        if fam is None or name in routers:
            continue
        parent, _, attr = name.rpartition(".")
        if parent in found:
            continue
        found[parent] = (mods[parent], MoEBlockSpec(attr, type(mod).__name__, fam))
        routers.add(name)
    unknown: dict[str, list[str]] = {}                  # class name -> module names
    for name, mod in mods.items():
        if not name or name in routers or name in found or type(mod) is torch.nn.Linear \
                or any(name.startswith(r + ".") for r in routers):
            continue
        cname = type(mod).__name__
        routerish = _ROUTERISH_RE.search(cname) and "Forget" not in cname and "Shared" not in cname
        if routerish or isinstance(getattr(mod, "top_k", None), int) \
                or isinstance(getattr(mod, "num_experts_per_tok", None), int):
            if not any(r.startswith(name + ".") for r in routers):
                unknown.setdefault(cname, []).append(name)
    if unknown:
        what = ", ".join(f"{c} ({n[0]}{f' and {len(n) - 1} more' if len(n) > 1 else ''})" for c, n in unknown.items())
        raise ValueError(f"replay_routing does not support {type(model).__name__}: its {what} route tokens to "
                         f"experts with code no router family reproduces (families: "
                         f"{', '.join(f.name for f in FAMILIES)}; docs/REPLAY_HF.md). register_moe_block adds "
                         f"one that fits the contract of routing_replay.replay.routers")
    out, layers = [], {}
    for name, (block, spec) in found.items():
        layer = _layer_of(name)
        if layer is None:
            raise ValueError(f"MoE block {name!r} ({type(block).__name__}) is not under a 'layers.<i>.' module")
        if layer in layers:
            raise ValueError(f"MoE blocks {layers[layer]!r} and {name!r} are both layer {layer} (a model with two "
                             f"decoder stacks); replay_routing replays one stack of layers")
        layers[layer] = name
        out.append((layer, block, spec))
    out.sort(key=lambda t: t[0])
    return out


def _ids_hook(spec: MoEBlockSpec, router, sink: list):
    def hook(_mod, _args, output):
        sink.append(spec.family.ids_of(router, output).detach().clone())
    return hook


@contextmanager
def record_selection(model: torch.nn.Module):
    """Yield {MoE index: [ids (N, K) per call]}: the experts each MoE router selected inside the with-block,
    read from its output (under replay_routing too: then they are the replayed and fallback ids)."""
    got: dict[int, list] = {}
    handles = []
    try:
        for m, (_, block, spec) in enumerate(find_moe_blocks(model)):
            router = getattr(block, spec.router_attr)
            handles.append(router.register_forward_hook(_ids_hook(spec, router, got.setdefault(m, []))))
        yield got
    finally:
        for h in handles:
            h.remove()


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
        raise ValueError(f"{type(model).__name__} has no MoE router (replay_routing finds routers by their code, "
                         f"see routing_replay.replay.routers)")
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
        device = next(iter(router.parameters()), torch.empty(0)).device
        plans.append(_layer_plan(ids[:, col], fallback[:, col], layer, _num_experts(router), device))
        routers.append((router, spec))
    stats = ReplayStats(layer_ids=[layer for layer, _, _ in blocks])
    try:
        for m, ((router, spec), plan) in enumerate(zip(routers, plans)):
            router.forward = _replaying_forward(router, spec, plan, stats, m, N)
        yield stats
    finally:
        for router, _ in routers:
            vars(router).pop("forward", None)


def _num_experts(router) -> int:
    """The router's expert count: its `num_experts`, else the rows of its (or its first linear layer's) weight."""
    n = getattr(router, "num_experts", None)
    if isinstance(n, int):
        return n
    w = getattr(router, "weight", None)
    if not torch.is_tensor(w):
        w = next((m.weight for m in router.modules() if isinstance(m, torch.nn.Linear)), None)
    if w is None:
        raise ValueError(f"cannot tell how many experts {type(router).__name__} routes to (no num_experts, no weight)")
    return int(w.shape[0])


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


def _layer_plan(ids: torch.Tensor, fallback: torch.Tensor, layer: int, num_experts: int, device) -> Forced:
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
    return Forced(ids.to(device).contiguous(), fallback[:, None].to(device), int(fallback.sum()))


def _replaying_forward(router, spec: MoEBlockSpec, plan: Forced, stats: ReplayStats, m: int, N: int):
    family = spec.family
    check = family.fingerprints == frozenset() and (type(router), family.name) not in _CONFORMING

    def forward(hidden_states, *args, **kwargs):
        n = hidden_states.numel() // hidden_states.shape[-1]
        if n != N:
            raise ValueError(f"the router of layer {stats.layer_ids[m]} sees {n} tokens, the replay "
                             f"tensor has {N} (another batch shape, or generation with a KV cache?)")
        if check:
            _check_conformance(router, family, (hidden_states, *args), kwargs)
        out = family.route(router, plan, hidden_states, *args, **kwargs)
        stats.calls[m] += 1
        stats.fallback_rows[m] += plan.num_fallback
        stats.replayed_rows[m] += N - plan.num_fallback
        return out

    return forward


def _check_conformance(router, family: RouterFamily, args: tuple, kwargs: dict) -> None:
    """A family without fingerprints must be the router's own forward when nothing is replayed: run both on
    copies of this call's inputs, from the same RNG state (jitter, sampling), and compare bit for bit."""
    def copies():
        return ([a.detach().clone() if torch.is_tensor(a) else a for a in args],
                {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in kwargs.items()})

    cls = type(router)
    devices = [t.device.index or 0 for t in args if torch.is_tensor(t) and t.device.type == "cuda"][:1]
    with torch.no_grad():
        a, k = copies()
        with torch.random.fork_rng(devices=devices):
            want = cls.forward(router, *a, **k)
        a, k = copies()
        with torch.random.fork_rng(devices=devices):
            try:
                got = family.route(router, None, *a, **k)
            except Exception as e:
                raise ValueError(f"router family {family.name!r} cannot run {cls.__name__}'s routing: "
                                 f"{type(e).__name__}: {e}") from e
    want = want if isinstance(want, tuple) else (want,)
    got = got if isinstance(got, tuple) else (got,)
    same = len(want) == len(got) and all(
        (torch.is_tensor(w) and torch.is_tensor(g) and w.shape == g.shape and w.dtype == g.dtype and torch.equal(w, g))
        or (not torch.is_tensor(w) and w is g) for w, g in zip(want, got))
    if not same:
        raise ValueError(f"router family {family.name!r} does not reproduce {cls.__name__}.forward: with no row "
                         f"replayed its output differs from the router's own ({len(got)} vs {len(want)} outputs, "
                         f"shapes {[tuple(t.shape) for t in got if torch.is_tensor(t)]} vs "
                         f"{[tuple(t.shape) for t in want if torch.is_tensor(t)]})")
    _CONFORMING.add((cls, family.name))
