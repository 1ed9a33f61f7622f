"""Check routing records against an independent recomputation with HF transformers on the same weights.

For each record, the token sequence prompt + output is run through the transformers implementation of the
model (one full forward, no KV cache); a forward hook on every MoE router collects its top-k expert ids. The
record agrees when, for every (token, MoE layer) row it carries, the SET of its top-k ids equals the oracle's
(order within a row is an implementation detail), and when -1 appears exactly where no routing was computed:
the prefix-cached prompt positions [0, num_cached_tokens) (unless the record's num_prefix_filled says they were
filled from the engine's prefix store: then they are compared like any row) and the last output token (never
fed to the model), plus, for an incomplete record, its declared `missing` ranges.

Near ties. Two implementations of the same model round differently (fused kernels vs eager transformers; a float32
router logit of the CPU engine was seen 1.9e-6 away from the oracle's), so where two experts' router logits are
closer than that, the top-k set may differ with nothing wrong. A disagreeing (token, layer) row is a *near tie*
(`near_tie_gap_ulps`) when every expert the engine chose outside the oracle's top-k has an oracle logit within
`NEAR_TIE_ULPS[dtype]` ulps of the oracle's k-th largest logit, the ulp taken at max(|k-th logit|, 1) in that
dtype (float32: 64 ulps = 7.6e-6 below |logit| 2; bfloat16: 4 ulps = 0.031). Near ties are counted and listed
apart (`RecordVerdict.near_ties`) and do not fail a record; every other disagreement does. The GPU bf16 analysis
(tests/test_vllm_gpu.py, docs/PERFORMANCE.md) measures gaps in the same ulps (`logit_ulp`).

`python -m routing_replay.apps.oracle MODEL_DIR NPZ_DIR [--dtype bfloat16]` prints a verdict and exits 1 on any
disagreement.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np

_LAYER = re.compile(r"layers\.(\d+)\.")

_MANTISSA_BITS = {"float32": 23, "bfloat16": 7, "float16": 10}
NEAR_TIE_ULPS = {"float32": 64, "bfloat16": 4, "float16": 4}


def logit_ulp(x, dtype: str = "float32", floor: float = 0.0):
    """One ulp of `dtype` at the magnitude of `x` (array or scalar), the magnitude taken at least `floor`
    (and 1e-30)."""
    m = np.maximum(np.maximum(np.abs(np.asarray(x, dtype=np.float64)), floor), 1e-30)
    return 2.0 ** (np.floor(np.log2(m)) - _MANTISSA_BITS[dtype])


def near_tie_gap_ulps(logits, engine_ids, top_k: int, dtype: str = "float32") -> float:
    """How far (in ulps of `dtype` at max(|k-th logit|, 1)) the engine's choice is from the oracle's: the largest
    gap, k-th largest oracle logit minus the oracle logit of an engine-chosen expert that the oracle ranks below
    k-th; 0.0 if the engine's experts are all among the oracle's k largest. `logits`: one row's router logits (E,)
    of the oracle. A row is a near tie when this is <= NEAR_TIE_ULPS[dtype] (`is_near_tie`)."""
    lg = np.asarray(logits, dtype=np.float64)
    kth = np.partition(lg, lg.size - top_k)[lg.size - top_k]          # the k-th largest
    chosen = lg[np.asarray(engine_ids, dtype=np.int64)]
    gap = float(np.max(kth - chosen)) if chosen.size else 0.0
    return max(gap, 0.0) / float(logit_ulp(kth, dtype, floor=1.0))


def is_near_tie(logits, engine_ids, top_k: int, dtype: str = "float32", tol_ulps: float | None = None) -> bool:
    """True when the engine's top-k set for this row is within `tol_ulps` (default NEAR_TIE_ULPS[dtype]) of the
    oracle's: see near_tie_gap_ulps. Rows that agree exactly are near ties of gap 0 too."""
    tol = NEAR_TIE_ULPS[dtype] if tol_ulps is None else tol_ulps
    return near_tie_gap_ulps(logits, engine_ids, top_k, dtype) <= tol


@dataclass
class RecordVerdict:
    """The comparison of one record with the oracle."""

    request_id: str
    rows: int = 0                    # (token, layer) rows compared
    agree: int = 0                   # identical top-k sets
    mismatches: list = field(default_factory=list)      # (position, moe layer index, record set, oracle set)
    near_ties: list = field(default_factory=list)       # (position, moe layer index, record set, oracle set,
                                                        #  gap in ulps): disagreements within the tolerance
    sentinel_errors: list = field(default_factory=list)  # (position, what): -1 where routing exists or v.v.
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and not self.sentinel_errors and self.agree + len(self.near_ties) == self.rows


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
    def disagree(self) -> int:
        """Rows that disagree beyond the near-tie tolerance (these fail the verdict)."""
        return self.rows - self.agree - self.near_ties

    def summary(self) -> str:
        bad = [r for r in self.records if not r.ok]
        s = (f"oracle ({self.dtype}): {len(self.records)} records, {self.rows} (token, layer) rows compared, "
             f"{self.agree} agree ({100 * self.agreement:.3f}%), {self.near_ties} near ties (within "
             f"{NEAR_TIE_ULPS[self.dtype]} ulps), {self.disagree} disagree, {self.sentinel_errors} -1 misplacements")
        ties = [(r.request_id, t) for r in self.records for t in r.near_ties]
        for rid, t in ties[:3]:
            s += f"\n  near tie {rid!r}: position {t[0]}, layer {t[1]}: {t[2]} vs {t[3]}, gap {t[4]:.1f} ulps"
        for r in bad[:5]:
            detail = r.error or (f"first mismatch {r.mismatches[0]}" if r.mismatches else
                                 f"first -1 error {r.sentinel_errors[0]}")
            s += f"\n  {r.request_id!r}: {r.agree}/{r.rows} agree; {detail}"
        if len(bad) > 5:
            s += f"\n  ... and {len(bad) - 5} more records disagree"
        return s


class Oracle:
    """Own a transformers copy of the model and the forward hooks that read every MoE router's top-k."""

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
        self.layer_ids: list[int] = []
        for name, module in self.model.named_modules():
            if not (name.endswith("mlp.gate") or name.endswith("block_sparse_moe.gate")):
                continue
            m = _LAYER.search(name)
            if m is None:
                continue
            lid = int(m.group(1))
            self.layer_ids.append(lid)
            module.register_forward_hook(self._hook(lid))
        self.layer_ids.sort()
        cfg = self.model.config
        self.top_k = int(getattr(cfg, "num_experts_per_tok"))
        if not self.layer_ids:
            raise ValueError(f"no MoE routers found in {type(self.model).__name__}")

    def _hook(self, lid: int):
        def hook(module, args, out):
            self._out[lid] = out
        return hook

    def _logits(self, out):
        """(T, E) float32 router logits from a router's output (transformers >= 5: (logits, scores, indices))."""
        lg = out[0] if isinstance(out, tuple) else out
        return lg.reshape(-1, lg.shape[-1]).float().cpu().numpy()

    def _topk(self, out):
        torch = self.torch
        if isinstance(out, tuple) and len(out) >= 3:          # transformers >= 5: (logits, scores, indices)
            return out[2].reshape(-1, out[2].shape[-1])
        logits = out[0] if isinstance(out, tuple) else out      # older: the gate is a Linear returning logits
        probs = torch.softmax(logits.reshape(-1, logits.shape[-1]).float(), dim=-1)
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

    def router_logits(self) -> np.ndarray:
        """(T, L, E) float32 router logits of the last `routing()` call, MoE layers in `layer_ids` order."""
        return np.stack([self._logits(self._out[lid]) for lid in self.layer_ids], axis=1)

    def check(self, rec, prompt_token_ids=None, output_token_ids=None) -> RecordVerdict:
        """Compare one wire.Record with the oracle. Token ids default to the ones the record carries."""
        v = RecordVerdict(rec.request_id)
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
        ref = self.routing(np.concatenate([pt, ot]).astype(np.int64))
        a = np.sort(rows[have], axis=2)
        b = np.sort(ref[have], axis=2)
        same = (a == b).all(axis=2)                      # (n_have, L)
        v.rows = int(same.size)
        v.agree = int(same.sum())
        if v.agree != v.rows:
            positions = np.flatnonzero(have)
            logits = self.router_logits()[have]           # (n_have, L, E)
            tol = self.near_tie_ulps
            for i, layer in zip(*np.nonzero(~same)):
                gap = near_tie_gap_ulps(logits[i, layer], a[i, layer], K, self.dtype)
                row = (int(positions[i]), int(layer), a[i, layer].tolist(), b[i, layer].tolist())
                if gap <= tol:
                    v.near_ties.append((*row, gap))
                elif len(v.mismatches) < 20:
                    v.mismatches.append(row)
        return v


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
