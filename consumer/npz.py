"""Write finished records as npz files (one per request, or shards with an index) and read them back.

One-file layout: DIR/<safe id>.npz with keys prompt_routed_experts, routed_experts, num_cached_tokens,
moe_layer_ids, complete, missing, reason, finish_reason, request_id, and prompt_token_ids / output_token_ids
when known. Shard layout (--shard-size N): DIR/shard-000000.npz holds N records under keys "<i>/<name>" and
DIR/index.jsonl has one line per record {"request_id", "shard", "i"}. Every file is written to a temporary
name in DIR and renamed, so a reader never sees a partial file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import tempfile
import threading
import time
from pathlib import Path
from typing import Iterator
from urllib.parse import quote

import numpy as np

from routing_replay.protocol import wire

log = logging.getLogger("routing_replay.consumer")

_MAX_NAME = 180


def safe_filename(request_id: str) -> str:
    """A file name for a request id that can never leave its directory ('/', '..', NUL, long ids).

    Percent-encoding (with '%' itself encoded) keeps distinct ids distinct; a leading '.' is encoded too;
    names longer than 180 characters are cut and suffixed with a SHA-256 digest of the whole id.
    """
    name = quote(request_id, safe="", errors="surrogatepass")
    if name.startswith("."):
        name = "%2E" + name[1:]
    if len(name) > _MAX_NAME:
        digest = hashlib.sha256(request_id.encode("utf-8", "surrogatepass")).hexdigest()[:16]
        name = name[:_MAX_NAME - 17] + "-" + digest
    return name


def _arrays(rec: wire.Record, prefix: str = "") -> dict:
    d = {
        "request_id": np.array(rec.request_id),
        "prompt_routed_experts": rec.prompt_routed_experts,
        "routed_experts": rec.routed_experts,
        "num_cached_tokens": np.int64(rec.num_cached_tokens),
        "moe_layer_ids": np.asarray(rec.moe_layer_ids, dtype=np.int32),
        "complete": np.bool_(rec.complete),
        "missing": np.asarray(rec.missing, dtype=np.int64).reshape(-1, 2),
        "reason": np.array(rec.reason),
        "finish_reason": np.array(rec.finish_reason),
    }
    if rec.prompt_token_ids is not None:
        d["prompt_token_ids"] = np.asarray(rec.prompt_token_ids, dtype=np.int32)
    if rec.output_token_ids is not None:
        d["output_token_ids"] = np.asarray(rec.output_token_ids, dtype=np.int32)
    return {prefix + k: v for k, v in d.items()}


def _record(z, prefix: str = "") -> wire.Record:
    def get(k, default=None):
        return z[prefix + k] if prefix + k in z else default

    pt, ot = get("prompt_token_ids"), get("output_token_ids")
    return wire.Record(
        request_id=str(get("request_id")), prompt_routed_experts=get("prompt_routed_experts"),
        routed_experts=get("routed_experts"), num_cached_tokens=int(get("num_cached_tokens")),
        moe_layer_ids=get("moe_layer_ids"), complete=bool(get("complete")),
        missing=[tuple(int(x) for x in m) for m in get("missing", np.zeros((0, 2), np.int64))],
        reason=str(get("reason", "")), finish_reason=str(get("finish_reason", "")),
        prompt_token_ids=pt, output_token_ids=ot)


def _atomic_savez(path: Path, arrays: dict) -> int:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".npz")
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
            size = f.tell()
        os.replace(tmp, path)
        return size
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def write_record(directory: str | os.PathLike, rec: wire.Record) -> Path:
    """Write one record as DIR/<safe id>.npz atomically; returns the path."""
    d = Path(directory)
    path = d / (safe_filename(rec.request_id) + ".npz")
    if path.resolve().parent != d.resolve():
        raise ValueError(f"request id {rec.request_id[:64]!r} would leave {d}")
    _atomic_savez(path, _arrays(rec))
    return path


class NpzWriter:
    """Own a writer thread that puts finished records on disk, so the consumer's socket loop never waits on I/O.

    The queue is bounded in bytes (max_pending_bytes); `put` blocks the caller only beyond that bound, which is
    the consumer's back-pressure to the broker (its pipe fills, the broker counts drops, records are marked).
    """

    def __init__(self, directory: str | os.PathLike, shard_size: int = 0, max_pending_bytes: int = 1 << 30):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.shard_size = shard_size
        self.max_pending_bytes = max_pending_bytes
        self.records = 0
        self.rows = 0
        self.bytes = 0
        self.errors = 0
        self._pending_bytes = 0
        self._cv = threading.Condition()
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._shard: list[wire.Record] = []
        self._shard_no = self._next_shard_no()
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="rr-npz-writer", daemon=True)
        self._thread.start()

    def _next_shard_no(self) -> int:
        nums = [int(p.stem.split("-")[1]) for p in self.dir.glob("shard-*.npz") if p.stem.split("-")[1].isdigit()]
        return max(nums, default=-1) + 1

    def put(self, rec: wire.Record) -> None:
        if self._failure is not None:
            raise RuntimeError(f"npz writer failed: {self._failure}") from self._failure
        n = rec.nbytes
        with self._cv:
            while self._pending_bytes > 0 and self._pending_bytes + n > self.max_pending_bytes:
                self._cv.wait(0.1)
            self._pending_bytes += n
        self._q.put(rec)

    def _run(self) -> None:
        while True:
            rec = self._q.get()
            if rec is None:
                if self._shard:
                    self._write_shard()
                return
            try:
                if self.shard_size > 0:
                    self._shard.append(rec)
                    if len(self._shard) >= self.shard_size:
                        self._write_shard()
                else:
                    write_record(self.dir, rec)
                self.records += 1
                self.rows += len(rec.prompt_routed_experts) + len(rec.routed_experts)
                self.bytes += rec.nbytes
            except Exception as e:  # a full disk must not kill the consumer; it is counted and logged
                self.errors += 1
                log.error("npz write failed for %r: %s", rec.request_id[:64], e)
            finally:
                with self._cv:
                    self._pending_bytes -= rec.nbytes
                    self._cv.notify_all()

    def _write_shard(self) -> None:
        recs, self._shard = self._shard, []
        name = f"shard-{self._shard_no:06d}.npz"
        self._shard_no += 1
        arrays = {}
        for i, r in enumerate(recs):
            arrays.update(_arrays(r, f"{i}/"))
        _atomic_savez(self.dir / name, arrays)
        with open(self.dir / "index.jsonl", "a") as f:
            for i, r in enumerate(recs):
                f.write(json.dumps({"request_id": r.request_id, "shard": name, "i": i}) + "\n")

    def close(self, timeout_s: float = 60.0) -> None:
        """Write what is queued (and a last partial shard), then stop. Idempotent."""
        if self._thread.is_alive():
            self._q.put(None)
            self._thread.join(timeout_s)


def read_record(path: str | os.PathLike) -> wire.Record:
    """Read one per-request npz file."""
    with np.load(path, allow_pickle=False) as z:
        return _record(z)


def iter_records(directory: str | os.PathLike) -> Iterator[wire.Record]:
    """Yield every record under DIR, from per-request files and from shards."""
    d = Path(directory)
    for p in sorted(d.glob("*.npz")):
        if p.name.startswith("shard-") or p.name.startswith(".tmp-"):
            continue
        yield read_record(p)
    index = d / "index.jsonl"
    if index.exists():
        by_shard: dict[str, list[int]] = {}
        for line in index.read_text().splitlines():
            if line.strip():
                e = json.loads(line)
                by_shard.setdefault(e["shard"], []).append(e["i"])
        for shard, idxs in sorted(by_shard.items()):
            with np.load(d / shard, allow_pickle=False) as z:
                for i in idxs:
                    yield _record(z, f"{i}/")


def load_records(directory: str | os.PathLike) -> dict[str, wire.Record]:
    """Read every record under DIR (both layouts) into {request_id: Record}."""
    return {r.request_id: r for r in iter_records(directory)}


class Progress:
    """Print one progress line at most every interval_s: records, tokens and MB/s since start."""

    def __init__(self, interval_s: float = 1.0, stream=None):
        import sys
        self.interval_s = interval_s
        self.stream = stream or sys.stderr
        self.t0 = self.last = time.monotonic()

    def maybe(self, records: int, rows: int, nbytes: int, in_flight: int, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self.last < self.interval_s:
            return
        self.last = now
        dt = max(now - self.t0, 1e-9)
        self.stream.write(f"records={records} tokens={rows} in_flight={in_flight} "
                          f"MB={nbytes / 1e6:.1f} MB/s={nbytes / 1e6 / dt:.1f}\n")
        self.stream.flush()
