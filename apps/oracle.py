"""Check routing records against an independent recomputation with HF transformers on the same weights.

For each record, the token sequence prompt + output is run through the transformers implementation of the
model (one full forward, no KV cache); a forward hook on every MoE router collects the expert ids the router
selected, read from its output (not recomputed), whatever the architecture: a router is the `gate` or `router`
module of a decoder layer's MoE block (`ROUTER_NAME`), and its output holds the ids as its one integer tensor, or,
for a router that returns none (Llama-4), as the nonzero entries of a dense (T, E) score tensor. The
record agrees when, for every (token, MoE layer) row it carries, the SET of its top-k ids equals the oracle's
(order within a row is an implementation detail), and when -1 appears exactly where no routing was computed:
the prefix-cached prompt positions [0, num_cached_tokens) (unless the record's num_prefix_filled says they were
filled from the engine's prefix store: then they are compared like any row) and the last output token (never
fed to the model), plus, for an incomplete record, its declared `missing` ranges.

Near ties. Two implementations of the same model round differently (fused kernels vs eager transformers; a float32
router logit of the CPU engine was seen 1.9e-6 away from the oracle's), so where two experts' router scores are
closer than that, the top-k set may differ with nothing wrong. A disagreeing (token, layer) row is a *near tie*
(`near_tie_gap_ulps`) when raising the oracle's selection score of each expert the engine chose by at most
`NEAR_TIE_ULPS[dtype]` ulps makes the router select exactly the engine's set, the ulp taken at max(|k-th
score|, 1) in that dtype (float32: 64 ulps = 7.6e-6 below |score| 2; bfloat16: 4 ulps = 0.031). The selection
score is what the router ranks (`selection_keys`): the logit for softmax/top-k routers (for a swap of the k-th
expert, the gap is the k-th largest logit minus the engine's expert's), sigmoid(logit) + `e_score_correction_bias`
for DeepSeek-V3-style routers, whose group-limited choice (n_group, topk_group) is applied to the raised scores
too. Near ties are counted and listed apart (`RecordVerdict.near_ties`) and do not fail a record. The GPU bf16
analysis (tests/test_vllm_gpu.py, docs/PERFORMANCE.md) measures gaps in the same ulps (`logit_ulp`).

Earlier-layer flips. A near tie at an earlier layer that went the other way in the engine feeds the later layers
(of that token, and through attention of later tokens) another input, so a later row can differ by far more than
a near tie with nothing wrong. Before a row beyond the tolerance is called wrong, the oracle runs the sequence
again with the engine's recorded choices forced into every MoE block (`routing_forced`: the router's own top-k
call returns the recorded ids, so its weights come from its own arithmetic at them; rows the record leaves -1
keep the router's own choice) and reads each router's own choice on the input it then gets: a row with a
disagreement upstream of it (an earlier MoE layer, same or earlier position) that agrees there, or is a near tie
there, is an *earlier-layer flip* (`RecordVerdict.flips`), counted apart and not a failure. An upstream row that
is itself wrong stays wrong: the forced pass judges every row on the engine's own upstream choices.

`python -m routing_replay.apps.oracle MODEL_DIR NPZ_DIR [--dtype bfloat16]` prints a verdict and exits 1 on any
disagreement.
"""

from __future__ import annotations

import argparse
import re
import sys
import threading
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np

_LAYER = re.compile(r"layers\.(\d+)\.")
# routing_forced replaces torch.topk process-wide for one forward: one such window at a time, so two oracles on two
# threads never restore each other's patch
_TOPK_PATCH = threading.Lock()
# an MoE block's router: the `gate` / `router` child of a module of a decoder layer (mlp, block_sparse_moe,
# feed_forward); a shared expert's gate (`shared_expert_gate`) does not match
ROUTER_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.[^.]+\.(?:gate|router)$")

_MANTISSA_BITS = {"float32": 23, "bfloat16": 7, "float16": 10}
NEAR_TIE_ULPS = {"float32": 64, "bfloat16": 4, "float16": 4}


def logit_ulp(x, dtype: str = "float32", floor: float = 0.0):
    """One ulp of `dtype` at the magnitude of `x` (array or scalar), the magnitude taken at least `floor`
    (and 1e-30)."""
    m = np.maximum(np.maximum(np.abs(np.asarray(x, dtype=np.float64)), floor), 1e-30)
    return 2.0 ** (np.floor(np.log2(m)) - _MANTISSA_BITS[dtype])


@dataclass(frozen=True)
class Groups:
    """Group-limited top-k (DeepSeek-V2/V3 style): the experts split into n_group equal groups, each scored by
    `score` over its members' selection scores ("top2sum": the sum of its 2 largest, DeepSeek-V3; "max":
    DeepSeek-V2's group_limited_greedy); only the topk_group best groups' experts can be selected."""

    n_group: int
    topk_group: int
    score: str = "top2sum"


def select_topk(keys, top_k: int, groups: Groups | None = None) -> np.ndarray:
    """(n, E) bool: the experts a router selects from its selection scores `keys` (n, E) (largest first; exact
    ties broken towards the lower id), group-limited when `groups` is given."""
    keys = np.array(keys, dtype=np.float64, ndmin=2)
    n, E = keys.shape
    if groups is not None and groups.n_group > 1:
        g = keys.reshape(n, groups.n_group, E // groups.n_group)
        gs = np.sort(g, axis=2)[:, :, -2:].sum(axis=2) if groups.score == "top2sum" else g.max(axis=2)
        keep = np.argsort(-gs, axis=1, kind="stable")[:, :groups.topk_group]
        allowed = np.zeros((n, groups.n_group), dtype=bool)
        np.put_along_axis(allowed, keep, True, axis=1)
        keys = np.where(np.repeat(allowed, E // groups.n_group, axis=1), keys, -np.inf)
    top = np.argsort(-keys, axis=1, kind="stable")[:, :top_k]
    sel = np.zeros((n, E), dtype=bool)
    np.put_along_axis(sel, top, True, axis=1)
    return sel


def near_tie_gap_ulps(keys, engine_ids, top_k: int, dtype: str = "float32", groups: Groups | None = None) -> float:
    """How far (in ulps of `dtype` at max(|k-th key|, 1)) the engine's choice is from the oracle's: the least t
    such that raising the oracle's selection score (`keys`, one row (E,)) of every expert the engine chose by t
    ulps makes the router (`select_topk`) select exactly the engine's set; 0.0 if it already does. Without groups
    that is the largest score of an expert the engine left out minus the smallest of one it chose (for a swap of
    the k-th expert: the k-th largest score minus the engine's expert's). A row is a near tie when this is <=
    NEAR_TIE_ULPS[dtype] (`is_near_tie`); inf when no raise does (more ids than top_k, or ids out of range)."""
    k = np.asarray(keys, dtype=np.float64).reshape(-1)
    e = np.unique(np.asarray(engine_ids, dtype=np.int64))
    if e.size != top_k or e.min() < 0 or e.max() >= k.size:
        return float("inf")
    kth = np.partition(k, k.size - top_k)[k.size - top_k]             # the k-th largest
    unit = float(logit_ulp(kth, dtype, floor=1.0))
    mine = np.zeros(k.size, dtype=bool)
    mine[e] = True
    if groups is None or groups.n_group <= 1:
        rest = k[~mine]
        gap = float(rest.max() - k[mine].min()) if rest.size else 0.0
        return max(gap, 0.0) / unit

    def reached(t: float) -> bool:
        return bool((select_topk(k + t * unit * mine, top_k, groups)[0] == mine).all())

    if reached(0.0):
        return 0.0
    hi = 1.0
    while not reached(hi):
        hi *= 2.0
        if hi > 2.0 ** 60:
            return float("inf")
    lo = 0.0
    for _ in range(60):                 # reached() is monotone in t: every raised score and group score grows
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if reached(mid) else (mid, hi)
    return hi


def is_near_tie(keys, engine_ids, top_k: int, dtype: str = "float32", tol_ulps: float | None = None,
                groups: Groups | None = None) -> bool:
    """True when the engine's top-k set for this row is within `tol_ulps` (default NEAR_TIE_ULPS[dtype]) of the
    oracle's: see near_tie_gap_ulps. Rows that agree exactly are near ties of gap 0 too."""
    tol = NEAR_TIE_ULPS[dtype] if tol_ulps is None else tol_ulps
    return near_tie_gap_ulps(keys, engine_ids, top_k, dtype, groups) <= tol


@dataclass
class RecordVerdict:
    """The comparison of one record with the oracle."""

    request_id: str
    rows: int = 0                    # (token, layer) rows compared
    agree: int = 0                   # identical top-k sets
    mismatches: list = field(default_factory=list)      # (position, moe layer index, record set, oracle set)
    near_ties: list = field(default_factory=list)       # (position, moe layer index, record set, oracle set,
                                                        #  gap in ulps): disagreements within the tolerance
    flips: list = field(default_factory=list)           # (position, moe layer index, record set, oracle set,
                                                        #  gap in ulps with the engine's upstream choices forced):
                                                        #  earlier-layer flips
    sentinel_errors: list = field(default_factory=list)  # (position, what): -1 where routing exists or v.v.
    error: str = ""
    forced_error: str = ""           # why the forced pass could not run (its rows then stay mismatches)

    @property
    def ok(self) -> bool:
        return (not self.error and not self.sentinel_errors
                and self.agree + len(self.near_ties) + len(self.flips) == self.rows)


@dataclass
class Verdict:
    """The comparison of a set of records with the oracle."""

    records: list = field(default_factory=list)
    dtype: str = "float32"

    @property
    def rows(self) -> int:
        return sum(r.rows for r in self.records)

    @property
    def agree(self) -> int:
        return sum(r.agree for r in self.records)

    @property
    def agreement(self) -> float:
        return self.agree / self.rows if self.rows else 1.0

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.records)

    @property
    def sentinel_errors(self) -> int:
        return sum(len(r.sentinel_errors) for r in self.records)

    @property
    def near_ties(self) -> int:
        return sum(len(r.near_ties) for r in self.records)

    @property
    def flips(self) -> int:
        return sum(len(r.flips) for r in self.records)

    @property
    def disagree(self) -> int:
        """Rows that disagree beyond the near-tie tolerance and are no earlier-layer flip (these fail it)."""
        return self.rows - self.agree - self.near_ties - self.flips

    def summary(self) -> str:
        bad = [r for r in self.records if not r.ok]
        s = (f"oracle ({self.dtype}): {len(self.records)} records, {self.rows} (token, layer) rows compared, "
             f"{self.agree} agree ({100 * self.agreement:.3f}%), {self.near_ties} near ties (within "
             f"{NEAR_TIE_ULPS[self.dtype]} ulps), {self.disagree} disagree, {self.flips} earlier-layer flips, "
             f"{self.sentinel_errors} -1 misplacements")
        ties = [(r.request_id, t) for r in self.records for t in r.near_ties]
        for rid, t in ties[:3]:
            s += f"\n  near tie {rid!r}: position {t[0]}, layer {t[1]}: {t[2]} vs {t[3]}, gap {t[4]:.1f} ulps"
        flips = [(r.request_id, t) for r in self.records for t in r.flips]
        for rid, t in flips[:3]:
            s += (f"\n  earlier-layer flip {rid!r}: position {t[0]}, layer {t[1]}: {t[2]} vs {t[3]}, "
                  f"{t[4]:.1f} ulps with the engine's upstream choices")
        for r in bad[:5]:
            detail = r.error or (f"first mismatch {r.mismatches[0]}" if r.mismatches else
                                 f"first -1 error {r.sentinel_errors[0]}")
            if r.forced_error:
                detail += f" (no forced pass: {r.forced_error})"
            s += f"\n  {r.request_id!r}: {r.agree}/{r.rows} agree; {detail}"
        if len(bad) > 5:
            s += f"\n  ... and {len(bad) - 5} more records disagree"
        return s


def _tensors(out) -> list:
    import torch

    parts = out if isinstance(out, (tuple, list)) else (out,)
    return [t for t in parts if isinstance(t, torch.Tensor)]


class Oracle:
    """Own a transformers copy of the model and the forward hooks that read every MoE router's selected ids."""

    def __init__(self, model_dir: str, dtype: str = "float32", device: str = "cpu",
                 near_tie_ulps: float | None = None):
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device)
        self.model.eval()
        self.device = device
        self.dtype = dtype
        self.near_tie_ulps = NEAR_TIE_ULPS[dtype] if near_tie_ulps is None else near_tie_ulps
        self._out: dict[int, object] = {}
        self._forced: dict | None = None        # routing_forced: model layer index -> (T, K) forced ids
        self._active = None                     # the forced ids of the router running now
        self._unforced: list = []               # routing_forced: layers whose router did not take the forced ids
        self.layer_ids: list[int] = []
        self.routers: dict[int, tuple] = {}       # model layer index -> (router module, its MoE block)
        modules = dict(self.model.named_modules())
        for name, module in modules.items():
            m = ROUTER_NAME.search(name)
            if m is None:
                continue
            lid = int(m.group(1))
            if lid in self.routers:
                raise ValueError(f"two MoE routers in layer {lid} of {type(self.model).__name__}")
            self.layer_ids.append(lid)
            self.routers[lid] = (module, modules.get(name.rsplit(".", 1)[0]))
            module.register_forward_pre_hook(self._pre_hook(lid), with_kwargs=True)
            module.register_forward_hook(self._hook(lid), with_kwargs=True)
        self.layer_ids.sort()
        cfg = self.model.config
        self.top_k = int(getattr(cfg, "num_experts_per_tok"))
        if not self.layer_ids:
            raise ValueError(f"no MoE routers found in {type(self.model).__name__}")

    def _pre_hook(self, lid: int):
        def hook(module, args, kwargs):
            if self._forced is not None:        # the router's own choice on this input, then the forced call
                self._out[lid] = module.forward(*args, **kwargs)
                self._active = (self._forced[lid], int(module.weight.shape[0]))
        return hook

    def _hook(self, lid: int):
        def hook(module, args, kwargs, out):
            if self._forced is None:
                self._out[lid] = out
            else:                               # the forced call must have selected the forced ids
                f = self._forced[lid]
                rows = ~(f < 0).any(-1)
                got = self._topk(out)
                if got.shape != f.shape or not bool((got.sort(-1).values == f.sort(-1).values)[rows].all()):
                    self._unforced.append(lid)
            self._active = None
        return hook

    def _forcing_topk(self, orig):
        """torch.topk as the running router calls it, returning the forced ids (and its input's values at them)
        for its selection: the call whose input is E wide with k = top_k and one row per token. Every other call,
        and rows forced to -1, get the real top-k."""
        torch = self.torch

        def topk(input, k, dim=-1, largest=True, sorted=True, **kw):
            res = orig(input, k, dim, largest, sorted, **kw)
            active = self._active
            if active is None or kw:
                return res
            forced, E = active
            if (k != forced.shape[-1] or input.shape[-1] != E or dim not in (-1, input.dim() - 1)
                    or input.numel() != forced.shape[0] * E):
                return res
            own = res.indices.reshape(-1, k)
            idx = torch.where((forced < 0).any(-1, keepdim=True), own, forced.clamp(min=0))
            vals = input.reshape(-1, E).gather(-1, idx)
            return torch.return_types.topk((vals.reshape(res.values.shape), idx.reshape(res.indices.shape)))

        return topk

    def _logits(self, out, lid: int):
        """(T, E) float32 router logits from layer `lid`'s router output: its float tensor E wide (the first, or the
        last where the router returns no ids: Llama-4's (dense selection scores, logits))."""
        ts = _tensors(out)
        E = int(self.routers[lid][0].weight.shape[0])
        wide = [t for t in ts if t.is_floating_point() and t.shape[-1] == E]
        if not wide:
            raise ValueError(f"router of layer {lid} returns no {E}-wide logits: {[tuple(t.shape) for t in ts]}")
        lg = wide[-1] if all(t.is_floating_point() for t in ts) else wide[0]
        return lg.detach().reshape(-1, E).float().cpu().numpy()

    def _topk(self, out):
        """(T, K) ids the router selected, read from its output: its one integer tensor (transformers >= 5:
        (logits, weights, ids), Granite (ids, weights, logits)), else (Llama-4) the K nonzero entries of the dense
        (T, E) score tensor it returns first, else (a gate that is a plain Linear) the top-k of its logits."""
        torch = self.torch
        ts = _tensors(out)
        ints = [t for t in ts if not t.is_floating_point()]
        if len(ints) == 1:
            return ints[0].reshape(-1, ints[0].shape[-1])
        if len(ints) > 1:
            raise ValueError(f"router output has {len(ints)} integer tensors; cannot tell which are the ids")
        dense = ts[0].reshape(-1, ts[0].shape[-1])
        if len(ts) > 1:
            nz = (dense != 0).sum(dim=-1)
            if not bool((nz == self.top_k).all()):
                raise ValueError(f"router output {[tuple(t.shape) for t in ts]} holds no ids and its first tensor "
                                 f"is not a dense selection of {self.top_k} experts a row")
            return torch.topk((dense != 0).to(torch.int8), self.top_k, dim=-1).indices
        probs = torch.softmax(dense.float(), dim=-1)
        return torch.topk(probs, self.top_k, dim=-1).indices

    def routing(self, token_ids: Sequence[int]) -> np.ndarray:
        """(T, L, K) int16 top-k ids of every token of one sequence, MoE layers in `layer_ids` order."""
        torch = self.torch
        ids = torch.as_tensor(np.asarray(token_ids, dtype=np.int64), device=self.device)[None]
        self._out.clear()
        with torch.no_grad():
            self.model(input_ids=ids, use_cache=False)
        return np.stack([self._topk(self._out[lid]).cpu().numpy().astype(np.int16) for lid in self.layer_ids],
                        axis=1)

    def routing_forced(self, token_ids: Sequence[int], forced) -> np.ndarray:
        """Like `routing`, with the experts of `forced` ((T, L, K) ids; a row holding -1 keeps the router's own
        choice) put into every MoE block: each router's own choice on the input the forced upstream choices give
        it. The router itself runs forced: its top-k call (torch.topk / Tensor.topk on its E-wide selection
        scores) returns the forced ids and the scores at them, so the routing weights come from the router's own
        arithmetic at those ids. Raises ValueError where a router selects without top-k (PhiMoE's sparsemixer)."""
        torch = self.torch
        ids = torch.as_tensor(np.asarray(token_ids, dtype=np.int64), device=self.device)[None]
        f = torch.as_tensor(np.asarray(forced, dtype=np.int64), device=self.device)
        self._out.clear()
        with _TOPK_PATCH:
            orig_fn, orig_method = torch.topk, torch.Tensor.topk
            self._forced = {lid: f[:, j] for j, lid in enumerate(self.layer_ids)}
            self._unforced: list = []
            torch.topk = self._forcing_topk(orig_fn)
            torch.Tensor.topk = self._forcing_topk(orig_method)
            try:
                with torch.no_grad():
                    self.model(input_ids=ids, use_cache=False)
                own = self._out
            finally:
                torch.topk, torch.Tensor.topk = orig_fn, orig_method
                self._forced = None
                self._active = None
        missing = [lid for lid in self.layer_ids if lid not in own]
        if missing:
            raise ValueError(f"routers of layers {missing} were not called")
        if self._unforced:
            cls = type(self.routers[self._unforced[0]][0]).__name__
            raise ValueError(f"the routers of layers {sorted(set(self._unforced))} ({cls}) select without top-k: "
                             "they cannot be forced")
        return np.stack([self._topk(own[lid]).cpu().numpy().astype(np.int16) for lid in self.layer_ids], axis=1)

    def router_logits(self) -> np.ndarray:
        """(T, L, E) float32 router logits of the last `routing()` call, MoE layers in `layer_ids` order."""
        return np.stack([self._logits(self._out[lid], lid) for lid in self.layer_ids], axis=1)

    def groups(self, lid: int) -> Groups | None:
        """The group-limited top-k of layer `lid`'s router, or None."""
        router, _ = self.routers[lid]
        n = int(getattr(router, "num_group", None) or getattr(router, "n_group", None) or 1)
        if n <= 1:
            return None
        method = getattr(router, "topk_method", None)
        if method == "greedy":
            return None
        return Groups(n, int(getattr(router, "topk_group")), "max" if method == "group_limited_greedy" else "top2sum")

    def selection_keys(self) -> np.ndarray:
        """(T, L, E) float64: the scores each router ranks to select (before group limits), of the last `routing()`
        call: sigmoid(logit) + e_score_correction_bias for routers that have the bias (on the router or, MiniMax-M2,
        on its block), else the logit (softmax and top-k routers rank by it)."""
        return np.stack([self.selection_keys_of(lid) for lid in self.layer_ids], axis=1)

    def selection_keys_of(self, lid: int) -> np.ndarray:
        """(T, E) float64: `selection_keys` of layer `lid`'s router output held now."""
        torch = self.torch
        lg = torch.as_tensor(self._logits(self._out[lid], lid))
        router, block = self.routers[lid]
        bias = getattr(router, "e_score_correction_bias", None)
        if bias is None:
            bias = getattr(block, "e_score_correction_bias", None)
        if bias is not None:
            lg = lg.sigmoid() + bias.detach().float().cpu()
        return lg.double().numpy()

    def _gaps(self, keys, rows, sel, want) -> list:
        """Gap in ulps of each (i, layer index) of `sel`: keys (n, L, E), rows (n, L, K) engine ids."""
        out = []
        for i, j in sel:
            g = self.groups(self.layer_ids[j])
            own = select_topk(keys[i, j], self.top_k, g)[0]
            if sorted(np.flatnonzero(own).tolist()) != sorted(int(x) for x in want[i, j]):
                # the key model does not reproduce the router's own choice: no tolerance can be measured
                out.append(float("inf"))
                continue
            out.append(near_tie_gap_ulps(keys[i, j], rows[i, j], self.top_k, self.dtype, g))
        return out

    def check(self, rec, prompt_token_ids=None, output_token_ids=None) -> RecordVerdict:
        """Compare one wire.Record with the oracle. Token ids default to the ones the record carries."""
        v = RecordVerdict(rec.request_id)
        rec = rec.widened()                 # int16 rows, -1 never computed, whichever dtype the record holds
        pt = rec.prompt_token_ids if prompt_token_ids is None else np.asarray(prompt_token_ids)
        ot = rec.output_token_ids if output_token_ids is None else np.asarray(output_token_ids)
        P, L, K = rec.prompt_routed_experts.shape
        G = rec.routed_experts.shape[0]
        if pt is None or ot is None:
            v.error = "record carries no token ids and none were given"
            return v
        if len(pt) != P or len(ot) != G:
            v.error = f"token ids ({len(pt)} prompt, {len(ot)} output) do not match rows ({P}, {G})"
            return v
        if [int(x) for x in rec.moe_layer_ids] != self.layer_ids or K != self.top_k:
            v.error = (f"record layers {list(rec.moe_layer_ids)} top_k {K}, oracle layers {self.layer_ids} "
                       f"top_k {self.top_k}")
            return v
        rows = np.concatenate([rec.prompt_routed_experts, rec.routed_experts], axis=0)
        expect_none = np.zeros(P + G, dtype=bool)
        if not getattr(rec, "num_prefix_filled", 0):      # fill mode: prefix-cached rows carry routing too
            expect_none[:rec.num_cached_tokens] = True
        if G:
            expect_none[P + G - 1] = True
        allowed_none = expect_none.copy()
        for lo, hi in rec.missing or []:
            allowed_none[lo:hi] = True
        is_none = (rows < 0).all(axis=(1, 2))
        partly = (rows < 0).any(axis=(1, 2)) & ~is_none
        for pos in np.flatnonzero(partly):
            v.sentinel_errors.append((int(pos), "row partly -1"))
        for pos in np.flatnonzero(expect_none & ~is_none):
            v.sentinel_errors.append((int(pos), "routing where -1 was expected"))
        for pos in np.flatnonzero(is_none & ~allowed_none):
            v.sentinel_errors.append((int(pos), "-1 where routing was expected"))
        have = ~is_none & ~partly
        if not have.any():
            return v
        tokens = np.concatenate([pt, ot]).astype(np.int64)
        ref = self.routing(tokens)
        a = np.sort(rows[have], axis=2)
        b = np.sort(ref[have], axis=2)
        same = (a == b).all(axis=2)                      # (n_have, L)
        v.rows = int(same.size)
        v.agree = int(same.sum())
        if v.agree == v.rows:
            return v
        positions = np.flatnonzero(have)
        keys = self.selection_keys()[have]               # (n_have, L, E)
        diff = list(zip(*(x.tolist() for x in np.nonzero(~same))))
        wrong = []
        for (i, j), gap in zip(diff, self._gaps(keys, a, diff, b)):
            row = (int(positions[i]), int(j), a[i, j].tolist(), b[i, j].tolist())
            if gap <= self.near_tie_ulps:
                v.near_ties.append((*row, gap))
            else:
                wrong.append((i, j, row))
        if wrong:
            wrong = self._recheck_flips(v, tokens, rows, have, ~same, a, wrong)
        v.mismatches = [row for _, _, row in wrong[:20]]
        return v

    def _recheck_flips(self, v: RecordVerdict, tokens, rows, have, differs, a, wrong) -> list:
        """Judge the rows in `wrong` again on the engine's own upstream choices (the forced pass); those with a
        disagreement upstream that agree there or are near ties there go to v.flips. Returns the rest."""
        # a row (i, j) has a disagreement upstream when some row at position <= i differs at a layer < j
        first_layer = np.where(differs.any(axis=1), differs.argmax(axis=1), differs.shape[1])   # per position
        upstream_from = np.minimum.accumulate(first_layer)          # least differing layer at positions <= i
        candidates = [(i, j, row) for i, j, row in wrong if upstream_from[i] < j]
        if not candidates:
            return wrong
        forced = np.where(have[:, None, None], rows, -1)
        try:
            ref = self.routing_forced(tokens, forced)
        except ValueError as e:
            v.forced_error = str(e).splitlines()[0][:200]
            return wrong
        b = np.sort(ref[have], axis=2)
        keys = self.selection_keys()[have]
        sel = [(i, j) for i, j, _ in candidates]
        gaps = self._gaps(keys, a, sel, b)
        excused = set()
        for (i, j, row), gap in zip(candidates, gaps):
            if (a[i, j] == b[i, j]).all() or gap <= self.near_tie_ulps:
                v.flips.append((*row, 0.0 if (a[i, j] == b[i, j]).all() else gap))
                excused.add((i, j))
        return [(i, j, row) for i, j, row in wrong if (i, j) not in excused]


def verify(records: Iterable, model_dir: str, dtype: str = "float32", oracle: Oracle | None = None,
           tokens: dict | None = None) -> Verdict:
    """Check records (wire.Record objects) against the oracle; `tokens` maps request id to (prompt, output)
    token ids for records that do not carry them."""
    oracle = oracle or Oracle(model_dir, dtype)
    verdict = Verdict(dtype=dtype)
    for rec in records:
        pt, ot = (tokens or {}).get(rec.request_id, (None, None))
        verdict.records.append(oracle.check(rec, pt, ot))
    return verdict


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m routing_replay.apps.oracle", description=__doc__.splitlines()[0])
    ap.add_argument("model_dir")
    ap.add_argument("npz_dir")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    a = ap.parse_args(argv)
    from routing_replay.consumer import load_records

    recs = load_records(a.npz_dir)
    v = verify(recs.values(), a.model_dir, a.dtype)
    print(v.summary())
    return 0 if v.ok else 1


if __name__ == "__main__":
    sys.exit(main())
