"""Bytes on the wire and consumer memory per generated token for a GRPO workload: every prompt row sent as int16
(`today`: ROUTING_REPLAY_PREFIX_ROWS=fill before compact ids and prefix references) against compact ids alone
(`compact`), prefix references alone (`refs`), and both (`both`: what the plugin sends now).

Drives the real Producer -> Broker -> Consumer (the consumer a `routing-replay consume` process, so its RSS is its
own) with synthetic rows, no engine. The engine's prefix cache is modelled by KV blocks: a block of `--block`
tokens is cached once a request computed it (the system prompt's blocks by the first request, a group's prompt's
full blocks by its first sample); a later request's leading full blocks that are cached are hits (at most up to
its last prompt token, which vLLM always computes). In `fill` mode the hits' rows are sent again (as
ROUTING_REPLAY_PREFIX_ROWS=fill does); in `refs` mode the open names the request that computed each run of blocks
and those rows are not sent. `compact` and `both` send uint8/uint16 ids (wire.id_dtype(--experts)), the others
int16. Rows are a hash of (prefix owner, position), so a prompt row is the same in every request that shares it, as
routing is. Then every record is fetched (as int16, the default) and every mode compared with `today` bit for bit.

    python bench/grpo_bytes.py                      # the issue's workload: 16 prompts x 8 samples, 512 + 64
                                                    # prompt tokens, 256 generated, 48 layers, top-8 of 128
"""


import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

import numpy as np

from routing_replay.apps.synthetic import true_rows
from routing_replay.broker import Broker
from routing_replay.consumer import RecordUnknown, TrainerClient
from routing_replay.producer import Producer
from routing_replay.protocol import wire


@dataclass(frozen=True)
class Workload:
    prompts: int = 16
    samples: int = 8
    system: int = 512
    user: int = 64
    gen: int = 256
    layers: int = 48
    top_k: int = 8
    experts: int = 128
    block: int = 128
    prefix: str = "grpo"


@dataclass
class Req:
    rid: str
    group: int
    sample: int
    prompt_len: int
    cached: int
    refs: tuple          # (writer, writer_pos, pos, count)


def plan(w: Workload) -> list[list[Req]]:
    """Per group, its samples in submission order (sample 0 first), with the cache hits and references the
    block model gives."""
    P = w.system + w.user
    B = w.block
    writers: dict = {}        # block content key -> (writer rid, its block index)
    groups = []
    for g in range(w.prompts):
        reqs = []
        for j in range(w.samples):
            rid = f"{w.prefix}-{g}-{j}"
            nb = (P - 1) // B                   # full blocks below the last prompt token (always computed)
            keys = [("s", b) if (b + 1) * B <= w.system else ("g", g, b) for b in range(P // B)]
            hits = 0
            while hits < nb and keys[hits] in writers:
                hits += 1
            refs = []
            for b in range(hits):
                wr, wb = writers[keys[b]]
                if refs and refs[-1][0] == wr and refs[-1][1] + refs[-1][3] == wb * B \
                        and refs[-1][2] + refs[-1][3] == b * B:
                    refs[-1][3] += B
                else:
                    refs.append([wr, wb * B, b * B, B])
            for b in range(hits, len(keys)):    # blocks this request computes: it is their writer
                writers.setdefault(keys[b], (rid, b))
            reqs.append(Req(rid, g, j, P, hits * B, tuple(tuple(r) for r in refs)))
        groups.append(reqs)
    return groups


def rows_of(w: Workload, r: Req, lo: int, hi: int) -> np.ndarray:
    """The request's rows [lo, hi): system prompt positions hash with the system's seed, the group's prompt with
    the group's, generated positions with the sample's."""
    pos = np.arange(lo, hi)
    out = np.empty((hi - lo, w.layers, w.top_k), np.int16)
    parts = ((pos < w.system), (pos >= w.system) & (pos < r.prompt_len), pos >= r.prompt_len)
    seeds = (1, 1000 + r.group, 100_000 + r.group * w.samples + r.sample)
    for m, seed in zip(parts, seeds):
        if m.any():
            out[m] = true_rows(seed, pos[m], w.layers, w.top_k, w.experts)
    return out


def publish(p: Producer, w: Workload, refs: bool) -> int:
    """One mode's whole workload: per group, sample 0's prefill, then the others' opens and prefills, then the
    group's decode steps (all samples in one delta per step), then its finishes. Returns the requests sent."""
    n = 0
    for group in plan(w):
        first, rest = group[0], group[1:]
        for r in (first, *rest):
            lo = r.cached if refs else 0
            p.open(r.rid, prompt_len=r.prompt_len, num_cached_tokens=r.cached, prefix_filled=True,
                   prefix_refs=r.refs if refs else ())
            if refs and r.cached and sum(c for _, _, _, c in r.refs) != r.cached:
                raise AssertionError(f"{r.rid}: references cover {r.refs}, cached {r.cached}")
            p.publish_rows([r.rid], [lo], [r.prompt_len - lo], rows_of(w, r, lo, r.prompt_len))
            n += 1
        ids = [r.rid for r in group]
        P = first.prompt_len
        for t in range(w.gen - 1):                  # the last output token is never fed
            step = np.concatenate([rows_of(w, r, P + t, P + t + 1) for r in group])
            p.publish_rows(ids, [P + t] * len(ids), [1] * len(ids), step)
        for r in group:
            p.finish(r.rid, num_output_tokens=w.gen)
    return n


def _rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


class ConsumerProc:
    """A `routing-replay consume` process serving trainers; its stats lines read as they come."""

    def __init__(self, backend: str, serve: str, *extra: str):
        self.p = subprocess.Popen([sys.executable, "-m", "routing_replay.apps.cli", "consume", "--connect", backend,
                                   "--serve", serve, "--stats-interval", "0.2", "--no-progress", *extra],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  env=dict(os.environ, PYTHONUNBUFFERED="1"))
        self.lines: list[str] = []
        self._t = threading.Thread(target=self._read, daemon=True)
        self._t.start()

    def _read(self) -> None:
        for line in self.p.stdout:
            self.lines.append(line)

    def wait(self, pattern: str, timeout_s: float = 120.0) -> re.Match:
        deadline = time.monotonic() + timeout_s
        seen = 0
        while time.monotonic() < deadline:
            lines = self.lines[seen:]
            for line in reversed(lines):
                m = re.search(pattern, line)
                if m:
                    return m
            seen += len(lines)
            if self.p.poll() is not None:
                break
            time.sleep(0.05)
        raise TimeoutError(f"consumer: no line matching {pattern!r}; last lines:\n{''.join(self.lines[-5:])}")

    def stats(self, records: int, timeout_s: float = 120.0) -> dict:
        """The first stats line that counts `records` records, as a dict of its numbers."""
        m = self.wait(rf"consumer \S+ records={records} .*", timeout_s)
        return {k: float(v) for k, v in re.findall(r"(\w+)=(-?[\d.]+)\b", m.group(0))}

    def stop(self) -> int:
        if self.p.poll() is None:
            self.p.terminate()
            try:
                self.p.wait(30)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait(10)
        self._t.join(5)
        return self.p.returncode


MODES = {"today": (False, False), "compact": (False, True), "refs": (True, False), "both": (True, True)}


def run_mode(w: Workload, refs: bool, tmp: str, consumers: int = 1, pool_mb: int = 256, compact: bool = False,
             tag: str | None = None) -> dict:
    """One mode end to end: bytes in and out of the broker, each consumer's accounting and RSS once every
    record is held, then every record fetched. Returns the figures and the records."""
    tag = tag or ("refs" if refs else "fill")
    b = Broker(f"ipc://{tmp}/{tag}-fe", f"ipc://{tmp}/{tag}-be", stats_interval_s=3600).start()
    serves = [f"ipc://{tmp}/{tag}-serve{i}" for i in range(consumers)]
    cs = [ConsumerProc(b.backend, s, "--prefix-pool-mb", str(pool_mb)) for s in serves]
    try:
        for c in cs:
            c.wait(r"consumer \S+ connected")
        deadline = time.monotonic() + 30
        while len(b.ownership.live_ids) < consumers and time.monotonic() < deadline:
            time.sleep(0.02)
        rss0 = [_rss_kb(c.p.pid) for c in cs]
        t0 = time.perf_counter()
        with Producer(b.frontend, num_layers=w.layers, top_k=w.top_k,
                      num_experts=w.experts if compact else None) as p:
            n = publish(p, w, refs)
            p.flush(120)
            p.wait_acked(120)
        elapsed = time.perf_counter() - t0
        deadline = time.monotonic() + 120
        while True:
            counts = [int(([0] + re.findall(r"consumer \S+ records=(\d+) ", "".join(c.lines)))[-1]) for c in cs]
            if sum(counts) == n or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        stats = [c.stats(k) for c, k in zip(cs, counts)]
        rss = [_rss_kb(c.p.pid) for c in cs]
        total = sum(counts)
        ids = [r.rid for g in plan(w) for r in g]
        recs, where = {}, {}
        for i, s in enumerate(serves):
            with TrainerClient(s) as tc:
                try:
                    got = tc.fetch(ids, timeout_s=60, unknown="raise")
                except RecordUnknown as e:          # (several consumers: each holds its part)
                    got = e.records
            for rid, rec in got.items():
                recs[rid] = rec
                where[rid] = i
        bs = b.stats
        out = dict(mode=tag, requests=n, records=total, gen_tokens=n * w.gen, bytes_in=bs.bytes_in,
                   bytes_out=bs.bytes_out, prefix_affine=bs.prefix_affine, seconds=elapsed,
                   store_mb=sum(s.get("store_MB", 0) for s in stats), pool_mb=sum(s.get("pool_MB", 0) for s in stats),
                   compact=sum(s.get("compact_records", 0) for s in stats),
                   prefix_ref_rows=sum(s.get("prefix_ref_rows", 0) for s in stats),
                   unresolved=sum(s.get("prefix_unresolved", 0) for s in stats),
                   rss_mb=sum(r - r0 for r, r0 in zip(rss, rss0)) / 1024, counts=counts)
        return dict(out, records_by_id=recs, where=where)
    finally:
        for c in cs:
            c.stop()
        b.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = Workload()
    ap.add_argument("--prompts", type=int, default=d.prompts, help="GRPO groups (default %(default)s)")
    ap.add_argument("--samples", type=int, default=d.samples, help="samples per group (default %(default)s)")
    ap.add_argument("--system", type=int, default=d.system, help="shared system prompt tokens (default %(default)s)")
    ap.add_argument("--user", type=int, default=d.user, help="per-prompt user tokens (default %(default)s)")
    ap.add_argument("--gen", type=int, default=d.gen, help="generated tokens per sample (default %(default)s)")
    ap.add_argument("--layers", type=int, default=d.layers, help="MoE layers (default %(default)s)")
    ap.add_argument("--top-k", type=int, default=d.top_k, help="experts per token (default %(default)s)")
    ap.add_argument("--experts", type=int, default=d.experts, help="experts per layer (default %(default)s)")
    ap.add_argument("--block", type=int, default=d.block, help="KV block tokens (default %(default)s)")
    ap.add_argument("--modes", default="today,compact,refs,both",
                    help="comma-separated, from today, compact, refs, both (default %(default)s); the first is the "
                         "baseline of the ratios")
    ap.add_argument("--json", action="store_true", help="print the figures as one JSON line too")
    a = ap.parse_args(argv)
    modes = [m for m in a.modes.split(",") if m]
    if not modes or any(m not in MODES for m in modes):
        ap.error(f"--modes {a.modes!r}: choose from {', '.join(MODES)}")
    if min(a.prompts, a.samples, a.gen, a.layers, a.top_k, a.experts, a.block) < 1 or min(a.system, a.user) < 0:
        ap.error("counts must be positive (system, user: >= 0)")
    w = Workload(a.prompts, a.samples, a.system, a.user, a.gen, a.layers, a.top_k, a.experts, a.block)
    with tempfile.TemporaryDirectory(prefix="grpo-bytes-") as tmp:
        runs = [run_mode(w, MODES[m][0], tmp, compact=MODES[m][1], tag=m) for m in modes]
    recs = [r.pop("records_by_id") for r in runs]
    for r in runs:
        r.pop("where")
    base = recs[0]
    same = {r["mode"]: sorted(x) == sorted(base) and all(x[k].equals(base[k]) for k in x)
            for r, x in zip(runs, recs)}
    print(f"workload: {w.prompts} prompts x {w.samples} samples, system {w.system} + user {w.user} prompt tokens, "
          f"{w.gen} generated, {w.layers} layers, top-{w.top_k} of {w.experts} experts, {w.block}-token blocks; "
          f"compact ids {wire.id_dtype(w.experts).name}")
    print(f"{'mode':8} {'B/gen token in':>15} {'B/gen token out':>16} {'store B/record':>15} {'pool MB':>8} "
          f"{'RSS MB':>8} {'records':>8} {'in/base':>8} {'mem/base':>9} {'identical':>10}")
    b0 = runs[0]
    for m in runs:
        r_in = m["bytes_in"] / b0["bytes_in"]
        r_mem = m["store_mb"] / b0["store_mb"] if b0["store_mb"] else float("nan")
        print(f"{m['mode']:8} {m['bytes_in'] / m['gen_tokens']:15.0f} {m['bytes_out'] / m['gen_tokens']:16.0f} "
              f"{m['store_mb'] * 1e6 / m['records']:15.0f} {m['pool_mb']:8.1f} {m['rss_mb']:8.1f} {m['records']:8d} "
              f"{r_in:8.3f} {r_mem:9.3f} {str(same[m['mode']]):>10}")
    for m in runs:
        if m["prefix_ref_rows"]:
            print(f"{m['mode']}: rows by reference {m['prefix_ref_rows']:.0f}, compact records {m['compact']:.0f}, "
                  f"unresolved {m['unresolved']:.0f}")
    if a.json:
        print(json.dumps(dict(runs=runs, identical=same)))
    return 0 if all(same.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
