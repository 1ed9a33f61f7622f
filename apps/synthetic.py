"""A synthetic engine that publishes routing like a real one, and the independent reference of what it must yield.

The routing of (request, position, layer, k) is a fixed hash (`true_rows`), so the expected record of every
request follows from its spec alone (`expected_record`), whatever the schedule was. The engine
(`SyntheticEngine.run`) schedules like vLLM: a token budget per step, chunked prefill starting after the
prefix-cached tokens, one decode token per step, optional speculative drafts whose rejected rows are garbage
(variant 1) until a later step overwrites them, preemption whose pre-preemption rows are stale (variant 2)
and are recomputed, and aborts. Pipeline parallelism: an engine publishes only its `layer_range`.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from routing_replay.protocol import wire

log = logging.getLogger("routing_replay.apps.synthetic")

_M = np.uint64(0xFFFFFFFF)


def true_rows(req_seed: int, positions: np.ndarray, num_layers: int, top_k: int, num_experts: int,
              variant: int = 0) -> np.ndarray:
    """(len(positions), L, K) int16 expert ids in [0, num_experts): a hash of (request, position, layer, k)."""
    p = np.asarray(positions, dtype=np.uint64)[:, None, None]
    lay = np.arange(num_layers, dtype=np.uint64)[None, :, None]
    k = np.arange(top_k, dtype=np.uint64)[None, None, :]
    x = (p * np.uint64(0x9E3779B1) + lay * np.uint64(0x85EBCA77) + k * np.uint64(0xC2B2AE3D)
         + np.uint64(req_seed * 0x27D4EB2F + variant * 0x165667B1)) & _M
    x ^= x >> np.uint64(15)
    x = (x * np.uint64(0x2C1B3C6D)) & _M
    x ^= x >> np.uint64(12)
    x = (x * np.uint64(0x297A2D39)) & _M
    x ^= x >> np.uint64(15)
    return (x % np.uint64(num_experts)).astype(np.int16)


@dataclass
class RequestSpec:
    request_id: str
    seed: int
    prompt_len: int
    num_output: int
    num_cached: int = 0
    spec_tokens: int = 0             # draft tokens per decode step (0: no speculative decoding)
    preempt_at: int | None = None    # preempt after this many computed positions ...
    resume_from: int = 0             # ... and recompute from here (>= num_cached)
    abort_at: int | None = None      # abort after this many computed positions
    arrive_step: int = 0

    def prompt_tokens(self) -> np.ndarray:
        return ((np.arange(self.prompt_len) * 31 + self.seed * 7) % 250).astype(np.int32)

    def output_tokens(self) -> np.ndarray:
        return ((np.arange(self.num_output) * 17 + self.seed * 3 + 1) % 250).astype(np.int32)


def expected_record(spec: RequestSpec, num_layers: int, top_k: int, num_experts: int,
                    layer_ids=None) -> wire.Record:
    """The record a correct pipeline must produce for a request that finished normally."""
    P, G, C = spec.prompt_len, spec.num_output, spec.num_cached
    total = P + G
    rows = true_rows(spec.seed, np.arange(total), num_layers, top_k, num_experts)
    rows[:C] = -1
    if G:
        rows[total - 1] = -1
    ids = np.arange(num_layers, dtype=np.int32) if layer_ids is None else np.asarray(layer_ids, np.int32)
    return wire.Record(spec.request_id, rows[:P].copy(), rows[P:].copy(), C, ids, True, [], "", "stop",
                       spec.prompt_tokens(), spec.output_tokens())


@dataclass
class _Live:
    spec: RequestSpec
    computed: int                    # next position to compute
    first_pass: bool = True


@dataclass
class SyntheticEngine:
    """Schedule RequestSpecs step by step and publish each step's routing through a Producer."""

    num_layers: int = 4
    top_k: int = 2
    num_experts: int = 16
    token_budget: int = 64
    max_running: int = 16
    layer_range: tuple[int, int] | None = None
    send_finish: bool = True
    steps: int = 0
    rows_published: int = 0
    log_every_s: float = 0.0
    open_many: bool = True           # a step's new requests in one Producer.open_many (as the vLLM plugin); False:
                                     # one Producer.open each (finishes are one call each: the producer's thread
                                     # puts those queued one behind the other in one message anyway)
    finished: list = field(default_factory=list)
    aborted: list = field(default_factory=list)

    def _end(self, producer, ends: list) -> None:
        """A step's finishes (with the prompt length and cache hits, so a consumer that missed the open can still
        build the record) and aborts."""
        for kind, rid, n, why, s in ends:
            if kind == "abort":
                producer.abort(rid)
            else:
                producer.finish(rid, num_output_tokens=n, finish_reason=why, prompt_len=s.prompt_len,
                                num_cached_tokens=s.num_cached, output_token_ids=s.output_tokens())

    def run(self, producer, specs: list[RequestSpec], seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        lo, hi = self.layer_range or (0, self.num_layers)
        waiting = sorted(specs, key=lambda s: s.arrive_step)
        running: list[_Live] = []
        step = 0
        t_log = time.monotonic()
        while waiting or running:
            opens = []
            while waiting and len(running) < self.max_running and waiting[0].arrive_step <= step:
                s = waiting.pop(0)
                opens.append((s.request_id, s.prompt_len, s.num_cached, s.prompt_tokens(), False))
                running.append(_Live(s, computed=s.num_cached))
            if self.open_many and opens:
                failed = producer.open_many(opens)
                if failed:
                    raise failed[0][1]
            else:
                for rid, P, C, tokens, _ in opens:
                    producer.open(rid, prompt_len=P, num_cached_tokens=C, prompt_token_ids=tokens)
            budget = self.token_budget
            ids, starts, counts, parts = [], [], [], []
            for r in running:
                s = r.spec
                end_pos = s.prompt_len + s.num_output - 1      # positions [.., end_pos) must be computed
                if r.computed < s.prompt_len:                   # prefill chunk
                    n = min(budget, s.prompt_len - r.computed)
                    if n <= 0:
                        continue
                    pos = np.arange(r.computed, r.computed + n)
                    extra = 0
                else:                                           # decode: 1 token (+ drafts)
                    if budget <= 0:
                        continue
                    extra = min(s.spec_tokens, budget - 1, max(0, end_pos + 3 - r.computed))
                    n = 1 + extra
                    pos = np.arange(r.computed, r.computed + n)
                budget -= n
                variant = 2 if (s.preempt_at is not None and r.first_pass) else 0
                rows = true_rows(s.seed, pos, self.num_layers, self.top_k, self.num_experts, variant)
                if extra:
                    accepted = int(rng.integers(0, extra + 1))
                    if accepted < extra:   # rows computed from rejected drafts are wrong
                        rows[1 + accepted:] = true_rows(s.seed, pos[1 + accepted:], self.num_layers, self.top_k,
                                                        self.num_experts, 1)
                    advance = 1 + accepted
                else:
                    advance = n
                ids.append(s.request_id)
                starts.append(int(pos[0]))
                counts.append(n)
                parts.append(rows[:, lo:hi])
                r.computed += advance
            if ids:
                payload = np.ascontiguousarray(np.concatenate(parts, axis=0))
                producer.publish_rows(ids, starts, counts, payload)
                self.rows_published += len(payload)
            self.steps += 1
            step += 1
            still = []
            ends = []
            for r in running:
                s = r.spec
                if s.abort_at is not None and r.computed >= s.abort_at:
                    ends.append(("abort", s.request_id, None, "abort", None))
                    self.aborted.append(s.request_id)
                    continue
                if s.preempt_at is not None and r.first_pass and r.computed >= s.preempt_at:
                    r.first_pass = False
                    r.computed = s.resume_from
                    still.append(r)
                    continue
                if r.computed >= s.prompt_len + s.num_output - 1:    # the last output token is never fed
                    if self.send_finish:
                        ends.append(("finish", s.request_id, s.num_output, "stop", s))
                    self.finished.append(s.request_id)
                    continue
                still.append(r)
            running = still
            self._end(producer, ends)
            if not ids and waiting and not running:
                step = max(step, waiting[0].arrive_step)
            if self.log_every_s and time.monotonic() - t_log >= self.log_every_s:
                t_log = time.monotonic()
                log.info("synthetic step=%d running=%d waiting=%d finished=%d rows=%d", self.steps, len(running),
                         len(waiting), len(self.finished), self.rows_published)


def workload(n: int = 32, seed: int = 0, prefix: str = "req", max_prompt: int = 300, max_output: int = 40,
             features: bool = True) -> list[RequestSpec]:
    """A mixed workload: shared prefixes (cache hits), long prompts, spec decode, preemption, aborts."""
    rng = np.random.default_rng(seed)
    specs = []
    for i in range(n):
        P = int(rng.integers(8, max_prompt))
        G = int(rng.integers(1, max_output))
        s = RequestSpec(f"{prefix}-{i}", seed=seed * 100_003 + i, prompt_len=P, num_output=G,
                        arrive_step=int(rng.integers(0, 20)))
        if features:
            kind = i % 6
            if kind == 1:
                s.num_cached = int(rng.integers(1, P))                  # prefix-cache hit
            elif kind == 2:
                s.spec_tokens = int(rng.integers(1, 4))                 # speculative decoding
            elif kind == 3:
                s.preempt_at = int(rng.integers(1, P + G))              # preempted, recomputed from 0 (or cache)
                s.num_cached = int(rng.integers(0, 2)) * min(P - 1, 4)
                s.resume_from = s.num_cached
            elif kind == 4 and i % 12 == 4:
                s.abort_at = int(rng.integers(1, P + G))                # aborted
        specs.append(s)
    return specs


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--connect", help="broker frontend endpoint; default: run an embedded broker and consumer")
    p.add_argument("--npz-dir", help="embedded mode: write records here")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--num-layers", type=int, default=48)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--num-experts", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prefix", default="synth", help="request id prefix")
    p.add_argument("--token-budget", type=int, default=512)


def main_from_args(a) -> int:
    """`routing-replay synth`: publish a workload; in embedded mode also check every record bit for bit."""
    from routing_replay.producer import Producer
    specs = workload(a.requests, seed=a.seed, prefix=a.prefix)
    eng = SyntheticEngine(num_layers=a.num_layers, top_k=a.top_k, num_experts=a.num_experts,
                          token_budget=a.token_budget, log_every_s=1.0)
    t0 = time.monotonic()
    if a.connect:
        with Producer(a.connect, num_layers=a.num_layers, top_k=a.top_k, num_experts=a.num_experts) as prod:
            eng.run(prod, specs, seed=a.seed)
            prod.flush(60)
            st = prod.stats
        dt = time.monotonic() - t0
        log.info("synthetic done requests=%d finished=%d aborted=%d steps=%d rows=%d sent_msgs=%d sent_MB=%.1f "
                 "dropped=%d seconds=%.2f", len(specs), len(eng.finished), len(eng.aborted), eng.steps,
                 eng.rows_published, st.sent_msgs, st.sent_bytes / 1e6, st.dropped_msgs, dt)
        return 0
    from routing_replay.apps.embedded import EmbeddedPipeline
    got: dict = {}
    with EmbeddedPipeline(npz_dir=a.npz_dir, on_record=lambda r: got.__setitem__(r.request_id, r)) as pipe:
        with pipe.producer(num_layers=a.num_layers, top_k=a.top_k, num_experts=a.num_experts) as prod:
            eng.run(prod, specs, seed=a.seed)
            prod.flush(60)
        pipe.wait_idle(60)
    dt = time.monotonic() - t0
    bad = 0
    by_id = {s.request_id: s for s in specs}
    for rid in eng.finished:
        exp = expected_record(by_id[rid], a.num_layers, a.top_k, a.num_experts)
        rec = got.get(rid)
        if rec is None or not rec.widened().equals(exp):       # (rows travel and are held compact)
            bad += 1
    aborted_ok = sum(1 for rid in eng.aborted if rid in got and not got[rid].complete)
    print(f"requests={len(specs)} finished={len(eng.finished)} aborted={len(eng.aborted)} records={len(got)} "
          f"exact={len(eng.finished) - bad} wrong_or_missing={bad} aborted_flagged={aborted_ok} "
          f"rows={eng.rows_published} seconds={dt:.2f} npz_dir={a.npz_dir or '-'}")
    return 1 if bad or aborted_ok != len(eng.aborted) else 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    raise SystemExit(main_from_args(ap.parse_args()))
