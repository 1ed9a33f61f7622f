"""Example trainer: roll out completions on a vLLM OpenAI server, then fetch and check their routing records.

This is the `trainer` service of docker-compose.yml, standing in for an RL trainer's rollout loop:

  1. wait for the engine's /health, read the served model name from /v1/models;
  2. subscribe to live records on every consumer (best effort, like `routing-replay subscribe`);
  3. per round, send --batch completions at once, all sharing one long prefix (a system prompt, so later
     requests hit vLLM's prefix cache), with `return_token_ids` so the tokens are known exactly;
  4. fetch the records of exactly those requests from the sharded consumers (lossless; TrainerClient asks every
     consumer and the owner answers). A completion's record key is its OpenAI response id followed by the
     prompt's position in the request ("cmpl-...-0"), see routing_replay/vllm_plugin/keys.py;
  5. check each record against its completion: complete, same prompt and output token ids, one routing row per
     token; live copies must equal the fetched ones bit for bit.

With --out DIR it writes the fetched records there (`<request id>.npz`, readable by consumer.load_records) and
one JSON line per rollout to DIR/rollouts.jsonl. Exits 0 when every record checked out, 1 otherwise.

CURVE: `--curve-secret FILE --server-key FILE...`, as for `routing-replay subscribe`.
"""

from __future__ import annotations

import argparse
import http.client
import json
import logging
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from routing_replay.consumer import TrainerClient, write_record

log = logging.getLogger("routing_replay.trainer")

SYSTEM_PROMPT = ("You are a careful assistant. Answer the question below in one short sentence, then stop. "
                 "Think about units, edge cases and what the question really asks before answering. ")
QUESTIONS = ("What is two plus two?", "Name a prime number above ten.", "Which is heavier, a kilo of lead or "
             "a kilo of feathers?", "How many minutes are in a day?", "What colour is the sky at noon?",
             "Spell the word 'routing' backwards.", "What is the square root of eighty-one?",
             "Which month has the fewest days?")


def _http_json(url: str, body: dict | None = None, timeout_s: float = 120.0) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return json.loads(r.read())


def wait_for_engine(base: str, timeout_s: float) -> str:
    """Poll BASE/health until it answers 200; return the first served model name. Raises TimeoutError."""
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=5) as r:
                if r.status == 200:
                    return _http_json(f"{base}/v1/models")["data"][0]["id"]
        except (OSError, http.client.HTTPException, ValueError, KeyError, IndexError) as e:
            last = e
        time.sleep(1.0)
    raise TimeoutError(f"engine {base} not healthy after {timeout_s}s (last error: {last})")


def client(a) -> TrainerClient:
    """A TrainerClient for every consumer endpoint; a CURVE client when --curve-secret and --server-key are given."""
    return TrainerClient(a.consumers, curve_secret=a.curve_secret, server_key=a.server_key)


def check(rec, choice: dict) -> list[str]:
    """What is wrong with a record, measured against the completion choice it belongs to ([] if nothing)."""
    errs = []
    prompt, output = choice["prompt_token_ids"], choice["token_ids"]
    if not rec.complete:
        errs.append(f"incomplete: reason={rec.reason} missing={rec.missing[:4]}")
    got_prompt = None if rec.prompt_token_ids is None else rec.prompt_token_ids.tolist()
    got_output = None if rec.output_token_ids is None else rec.output_token_ids.tolist()
    if got_prompt != prompt:
        errs.append(f"prompt tokens differ: record {got_prompt and got_prompt[:8]}..., completion {prompt[:8]}...")
    if got_output != output:
        errs.append(f"output tokens differ: record {got_output}, completion {output}")
    if rec.prompt_routed_experts.shape[0] != len(prompt) or rec.routed_experts.shape[0] != len(output):
        errs.append(f"rows {rec.prompt_routed_experts.shape[0]}+{rec.routed_experts.shape[0]} for "
                    f"{len(prompt)}+{len(output)} tokens")
    return errs


def run(a) -> int:
    base = a.engine.rstrip("/")
    model = wait_for_engine(base, a.engine_wait_s)
    log.info("trainer engine=%s model=%s consumers=%s", base, model, " ".join(a.consumers))
    out = Path(a.out) if a.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    failures = 0
    live_seen: dict = {}
    with client(a) as live, client(a) as fetcher, ThreadPoolExecutor(a.batch) as pool:
        live.subscribe(a.prefix)
        rnd = 0
        while a.rounds == 0 or rnd < a.rounds:
            rnd += 1
            prompts = [f"{SYSTEM_PROMPT}Round {rnd}, question {i}: {QUESTIONS[i % len(QUESTIONS)]}"
                       for i in range(a.batch)]
            body = {"model": model, "max_tokens": a.max_tokens, "temperature": 1.0, "return_token_ids": True}
            t0 = time.monotonic()
            resps = list(pool.map(lambda p: _http_json(f"{base}/v1/completions", dict(body, prompt=p)), prompts))
            rollouts = {f"{r['id']}-0": r["choices"][0] for r in resps}    # one prompt per request
            t1 = time.monotonic()
            recs = fetcher.fetch(rollouts, timeout_s=a.fetch_timeout_s)
            t2 = time.monotonic()
            deadline = t2 + a.live_wait_s
            while not rollouts.keys() <= live_seen.keys() and time.monotonic() < deadline:
                for r in live.records(timeout_s=max(0.05, deadline - time.monotonic())):
                    live_seen[r.request_id] = r
                    if rollouts.keys() <= live_seen.keys() or time.monotonic() >= deadline:
                        break
            bad = 0
            for key, choice in rollouts.items():
                rec = recs[key]
                errs = check(rec, choice)
                if key in live_seen and not live_seen[key].equals(rec):
                    errs.append("live record differs from the fetched one")
                if errs:
                    bad += 1
                    log.error("trainer record %s: %s", key, "; ".join(errs))
                if out:
                    write_record(out, rec)
                    with open(out / "rollouts.jsonl", "a") as f:
                        f.write(json.dumps({"round": rnd, "response_id": key.rsplit("-", 1)[0], "record": key,
                                            "prompt_token_ids": choice["prompt_token_ids"],
                                            "token_ids": choice["token_ids"], "live": key in live_seen}) + "\n")
            failures += bad
            log.info("trainer round=%d rollouts=%d fetched=%d ok=%d live=%d prompt_tokens=%d cached_tokens=%d "
                     "output_tokens=%d rollout_s=%.2f fetch_s=%.2f", rnd, len(rollouts), len(recs),
                     len(rollouts) - bad, sum(k in live_seen for k in rollouts),
                     sum(r.prompt_routed_experts.shape[0] for r in recs.values()),
                     sum(r.num_cached_tokens for r in recs.values()),
                     sum(r.routed_experts.shape[0] for r in recs.values()), t1 - t0, t2 - t1)
            live_seen.clear()           # this round is checked; anything else seen live is not ours
    log.info("trainer done failures=%d", failures)
    return 1 if failures else 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="trainer.py", description=__doc__.split("\n", 1)[0])
    ap.add_argument("--engine", default="http://127.0.0.1:8000", help="vLLM OpenAI server base URL")
    ap.add_argument("--consumers", nargs="+", required=True, help="consumer --serve endpoints (all shards)")
    ap.add_argument("--curve-secret", help="this trainer's secret key file (NAME.key_secret)")
    ap.add_argument("--server-key", nargs="+", help="the consumers' public key file (NAME.key): one for all, or one "
                    "per --consumers endpoint")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of rollouts (0: until stopped)")
    ap.add_argument("--batch", type=int, default=8, help="completions sent at once per round")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--prefix", default="cmpl-", help="live-subscribe to request ids starting with this")
    ap.add_argument("--out", help="write fetched records and rollouts.jsonl here")
    ap.add_argument("--engine-wait-s", type=float, default=900.0, help="how long to wait for the engine")
    ap.add_argument("--fetch-timeout-s", type=float, default=120.0)
    ap.add_argument("--live-wait-s", type=float, default=2.0, help="after a fetch, wait this long for live copies")
    ap.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return ap


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    logging.basicConfig(level=getattr(logging, a.log_level.upper()), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        return run(a)
    except (TimeoutError, ValueError, urllib.error.URLError) as e:
        log.error("trainer failed: %s", e)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
