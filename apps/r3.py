"""Measure R3: how far a trainer's routing and log-probabilities are from the engine's, with and without replay.

The trainer here is the same checkpoint in HF transformers, in bfloat16 (what an RL trainer runs), fed each
sample's prompt + response as one sequence, as a trainer computes its policy log-probabilities. It runs twice:
once with its own routers, once inside `replay.hf.replay_routing` with the engine's recorded expert ids
(`replay.tensors.padded`). Each pass is compared with the engine:

- routing agreement: the share of (token, layer) rows the engine recorded (ids >= 0) where the trainer's
  expert *set* equals the engine's (order within the top-k ignored). Rows the engine never computed (-1:
  prefix-cache hits, the last output token) are not compared; the trainer's own router chooses there, with
  and without replay, and they are counted apart (`Fallback`).
- log-probability drift per generated token, r = logp_trainer - logp_engine of the sampled token: mean and
  p99 of |r|, the share of tokens with |r| > ln 2 (the trainer's probability is off by more than a factor of
  2), and the k3 estimate of KL(engine || trainer), mean(exp(r) - 1 - r) (tokens are samples of the engine).

Engine log-probabilities are vLLM's `SamplingParams(logprobs=0)` values, which are the raw model
distribution (vLLM's default logprobs_mode "raw_logprobs": before temperature), so the trainer's are
log_softmax of its raw logits too.

With replay the routing agreement must be exact on every recorded row: `R3Report.replay_exact`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

LN2 = math.log(2.0)
P99 = 0.99


def k3(logp_trainer, logp_engine) -> float:
    """k3 estimate of KL(engine || trainer) from tokens sampled by the engine: mean(exp(r) - 1 - r),
    r = logp_trainer - logp_engine (float64)."""
    r = np.asarray(logp_trainer, np.float64) - np.asarray(logp_engine, np.float64)
    if r.size == 0:
        raise ValueError("k3 of no tokens")
    return float(np.mean(np.expm1(r) - r))


def quantile(x, q: float) -> float:
    """The q-quantile of x, numpy's default linear interpolation between order statistics (x sorted,
    position q * (n - 1))."""
    x = np.asarray(x, np.float64).reshape(-1)
    if x.size == 0:
        raise ValueError("quantile of no values")
    return float(np.quantile(x, q))


@dataclass(frozen=True)
class Drift:
    """Own the log-probability drift of one comparison over its generated tokens."""

    tokens: int
    mean_abs: float          # mean |r|, nats
    p99_abs: float           # quantile(|r|, 0.99), nats
    over_ln2: float          # share of tokens with |r| > ln 2
    k3: float                # KL(engine || trainer), nats per token


def logprob_drift(logp_trainer, logp_engine) -> Drift:
    """Drift of r = logp_trainer - logp_engine, per sampled token (1-D arrays of equal length)."""
    t = np.asarray(logp_trainer, np.float64).reshape(-1)
    e = np.asarray(logp_engine, np.float64).reshape(-1)
    if t.shape != e.shape:
        raise ValueError(f"{t.size} trainer log-probabilities, {e.size} engine log-probabilities")
    a = np.abs(t - e)
    return Drift(tokens=int(t.size), mean_abs=float(a.mean()), p99_abs=quantile(a, P99),
                 over_ln2=float(np.mean(a > LN2)), k3=k3(t, e))


@dataclass(frozen=True)
class Agreement:
    """Own the routing agreement count of one comparison: rows compared, rows with the same expert set."""

    rows: int
    same: int

    @property
    def share(self) -> float:
        return self.same / self.rows if self.rows else 1.0

    def __add__(self, other: "Agreement") -> "Agreement":
        return Agreement(self.rows + other.rows, self.same + other.same)


def routing_agreement(trainer_ids, engine_ids) -> Agreement:
    """Compare (..., L, K) expert ids row by row: rows where the engine recorded routing (every id >= 0)
    count; a row agrees when both hold the same set of K experts."""
    t = np.sort(np.asarray(trainer_ids, np.int64), axis=-1)
    e = np.sort(np.asarray(engine_ids, np.int64), axis=-1)
    if t.shape != e.shape:
        raise ValueError(f"trainer ids {t.shape}, engine ids {e.shape}")
    recorded = (e >= 0).all(-1)
    same = (t == e).all(-1) & recorded
    return Agreement(rows=int(recorded.sum()), same=int(same.sum()))


@dataclass(frozen=True)
class Fallback:
    """Own the count of (token, layer) rows without recorded routing, where the trainer's router chooses."""

    prefix_cache_rows: int   # prompt rows below num_cached_tokens left -1 (sentinel mode; 0 when they were filled)
    prefix_cache_tokens: int
    last_token_rows: int     # the last output token, never fed to the engine
    other_rows: int          # anything else flagged (missing rows of incomplete records)
    total_rows: int          # all (token, layer) rows of the batch's real tokens


@dataclass(frozen=True)
class R3Report:
    """Own one R3 measurement: the trainer without and with replay against the engine."""

    samples: int
    trainer_dtype: str
    own: Agreement
    replay: Agreement
    own_drift: Drift
    replay_drift: Drift
    fallback: Fallback
    seconds: float

    @property
    def replay_exact(self) -> bool:
        return self.replay.same == self.replay.rows

    def rows(self) -> list[tuple[str, str]]:
        """(label, text) lines for the demo's summary."""
        def drift(d: Drift) -> str:
            return (f"|dlogp| mean {d.mean_abs:.4f} p99 {d.p99_abs:.4f}, {100 * d.over_ln2:.2f}% > ln 2, "
                    f"k3 KL {d.k3:.5f}")
        f = self.fallback
        return [
            ("R3 trainer", f"HF transformers {self.trainer_dtype}, {self.samples} samples, "
                           f"{self.own_drift.tokens:,} generated tokens ({self.seconds:.0f} s for both passes)"),
            ("R3 own routing", f"{100 * self.own.share:.3f}% of {self.own.rows:,} rows agree with the engine; "
                               + drift(self.own_drift)),
            ("R3 replayed routing", f"{100 * self.replay.share:.3f}% of {self.replay.rows:,} rows agree with the "
                                    f"engine; " + drift(self.replay_drift)),
            ("R3 fallback rows", f"{f.prefix_cache_rows:,} prefix-cache rows ({f.prefix_cache_tokens:,} tokens), "
                                 f"{f.last_token_rows:,} last-token rows, {f.other_rows:,} other, of "
                                 f"{f.total_rows:,} (token, layer) rows: trainer's own router"),
        ]


def engine_logprobs(output) -> np.ndarray:
    """The sampled tokens' log-probabilities from a vLLM RequestOutput run with SamplingParams(logprobs=0)."""
    c = output.outputs[0]
    if c.logprobs is None:
        raise ValueError(f"request {output.request_id!r} has no logprobs (SamplingParams(logprobs=0) not set?)")
    return np.array([lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)], np.float64)


def load_trainer(model_dir, dtype: str = "bfloat16"):
    """The checkpoint in HF transformers, eval mode, in `dtype`."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype)).eval()


def _pass(model, records: Sequence, replay: bool, pad_id: int):
    """One trainer forward over a right-padded batch. Returns, per record, the (n, L, K) expert ids the
    trainer's routers used and the log-probabilities of the record's output tokens."""
    import torch

    from routing_replay.replay.hf import record_selection, replay_routing
    from routing_replay.replay.tensors import padded

    tokens = [np.concatenate([r.prompt_token_ids, r.output_token_ids]).astype(np.int64) for r in records]
    rt = padded(records, padding_side="right", token_ids=tokens)
    B, S = rt.expert_ids.shape[:2]
    input_ids = torch.full((B, S), pad_id, dtype=torch.long)
    mask = torch.zeros((B, S), dtype=torch.long)
    for b, t in enumerate(tokens):
        input_ids[b, :len(t)] = torch.from_numpy(t)
        mask[b, :len(t)] = 1
    # the ids each router selected, read from its output by its router family (`record_selection`: position 2 of
    # Qwen3-MoE's and DeepSeek-V3's output, 0 of Granite's, Llama-4's dense scores), under replay the replayed ones
    with torch.no_grad(), record_selection(model) as selected:
        if replay:
            with replay_routing(model, rt.expert_ids, rt.no_routing, layer_ids=rt.layer_ids):
                logits = model(input_ids=input_ids, attention_mask=mask).logits
        else:
            logits = model(input_ids=input_ids, attention_mask=mask).logits
    logp = torch.log_softmax(logits.float(), dim=-1)
    assert all(len(calls) == 1 for calls in selected.values()), {m: len(c) for m, c in selected.items()}
    ids = torch.stack([selected[m][0].reshape(B, S, -1).cpu() for m in sorted(selected)], dim=2).numpy()
    # ids: (B, S, L, K)
    out = []
    for b, r in enumerate(records):
        P, G = len(r.prompt_token_ids), len(r.output_token_ids)
        pos = torch.arange(P - 1, P + G - 1)
        lp = logp[b, pos, torch.from_numpy(tokens[b][P:])].numpy().astype(np.float64)
        out.append((ids[b, :P + G], lp))
    return out, rt


def measure(model, records: Sequence, engine_lp: Mapping[str, np.ndarray], *, batch_size: int = 16,
            pad_id: int = 0) -> R3Report:
    """Run the trainer (an HF model from `load_trainer`) over `records` (wire.Record with token ids) with its
    own and with replayed routing and compare both with the engine (`engine_lp`: request id -> sampled
    tokens' log-probabilities). Samples are batched by length (right padding) `batch_size` at a time."""
    import time

    t0 = time.monotonic()
    records = sorted((r.widened() for r in records),      # int16 rows (-1), whichever dtype a record holds
                     key=lambda r: (len(r.prompt_token_ids) + len(r.output_token_ids), r.request_id))
    own = rep = Agreement(0, 0)
    lp_own, lp_rep, lp_eng = [], [], []
    pre_rows = pre_tok = last_rows = other_rows = total_rows = 0
    for i in range(0, len(records), batch_size):
        batch = records[i:i + batch_size]
        res_own, rt = _pass(model, batch, False, pad_id)
        res_rep, _ = _pass(model, batch, True, pad_id)
        for b, r in enumerate(batch):
            engine = np.concatenate([r.prompt_routed_experts, r.routed_experts])
            own = own + routing_agreement(res_own[b][0], engine)
            rep = rep + routing_agreement(res_rep[b][0], engine)
            e = engine_lp[r.request_id]
            if len(e) != len(r.output_token_ids):
                raise ValueError(f"{r.request_id!r}: {len(e)} engine log-probabilities, "
                                 f"{len(r.output_token_ids)} output tokens")
            lp_own.append(res_own[b][1])
            lp_rep.append(res_rep[b][1])
            lp_eng.append(e)
            n = len(engine)
            flags = rt.no_routing[b, :n].numpy()                     # (n, L)
            c = int(r.num_cached_tokens)                            # filled rows have routing: flags are 0
            pre_rows += int(flags[:c].sum())
            pre_tok += int(flags[:c].any(-1).sum())
            last_rows += int(flags[n - 1].sum())
            other_rows += int(flags[c:n - 1].sum())
            total_rows += flags.size
    eng = np.concatenate(lp_eng)
    return R3Report(samples=len(records), trainer_dtype=str(next(model.parameters()).dtype).replace("torch.", ""),
                    own=own, replay=rep, own_drift=logprob_drift(np.concatenate(lp_own), eng),
                    replay_drift=logprob_drift(np.concatenate(lp_rep), eng),
                    fallback=Fallback(pre_rows, pre_tok, last_rows, other_rows, total_rows),
                    seconds=time.monotonic() - t0)
