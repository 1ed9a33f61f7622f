"""Write finished records as npz files (one per request, or shards with an index) and read them back.

One-file layout: DIR/<safe id>.npz with keys prompt_routed_experts, routed_experts, num_cached_tokens,
moe_layer_ids, complete, missing, reason, finish_reason, request_id, and prompt_token_ids / output_token_ids
when known, num_prefix_filled when not 0 (files without it read as 0). Shard layout (--shard-size N): DIR/shard-000000.npz holds N records under keys "<i>/<name>" and
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
from collections import OrderedDict
from pathlib import Path
from typing import Iterator, NamedTuple
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
    if rec.num_prefix_filled:
        d["num_prefix_filled"] = np.int64(rec.num_prefix_filled)
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
        prompt_token_ids=pt, output_token_ids=ot, num_prefix_filled=int(get("num_prefix_filled", 0)))


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


class ShardEntry(NamedTuple):
    """Where a record lives in the shard layout: DIR/<shard>, keys "<i>/<name>"."""

    shard: str
    i: int


class NpzIndex:
    """Own the lookup of records already on disk under DIR, read lazily (nothing is loaded until asked for).

    A per-request file is found by its name (safe_filename of the id), so that layout needs no index; the shard
    layout's DIR/index.jsonl is read once at start and extended by the writer as it writes shards.
    """

    def __init__(self, directory: str | os.PathLike):
        self.dir = Path(directory)
        self.shards: dict[str, ShardEntry] = {}
        index = self.dir / "index.jsonl"
        if index.exists():
            for line in index.read_text().splitlines():
                try:
                    e = json.loads(line)
                    self.shards[e["request_id"]] = ShardEntry(e["shard"], int(e["i"]))
                except (ValueError, KeyError, TypeError):
                    continue          # a torn last line (a crash while appending): its shard is unreadable anyway

    def _file(self, rid: str) -> Path:
        return self.dir / (safe_filename(rid) + ".npz")

    def __contains__(self, rid: str) -> bool:
        return rid in self.shards or self._file(rid).is_file()

    def read(self, rid: str) -> wire.Record | None:
        """The record of `rid` from disk, or None if it is not there (or unreadable: logged)."""
        try:
            entry = self.shards.get(rid)
            if entry is not None:
                with np.load(self.dir / entry.shard, allow_pickle=False) as z:
                    rec = _record(z, f"{entry.i}/")
            else:
                path = self._file(rid)
                if not path.is_file():
                    return None
                rec = read_record(path)
        except (OSError, ValueError, KeyError) as e:
            log.error("npz read of %r under %s failed: %s", rid[:64], self.dir, e)
            return None
        return rec if rec.request_id == rid else None


class NpzWriter:
    """Own a writer thread that puts finished records on disk, so the consumer's socket loop never waits on I/O.

    The queue is bounded in bytes (max_pending_bytes); `put` blocks the caller only beyond that bound, which is
    the consumer's back-pressure to the broker (its pipe fills, the broker counts drops, records are marked).

    A record whose write fails (a full disk, a directory that went away) is kept, not dropped: in memory up to
    hold_max_bytes, beyond that in spill_dir/unwritten, and written again with a growing backoff (retry_min_s
    doubling up to retry_max_s) until the directory takes it. Every failed attempt is counted (write_failed);
    `retry_pending` says how many records wait. While more than hold_max_bytes is held in memory, `backlogged`
    is True: the consumer stops taking messages from the broker (nothing more is acknowledged) until it clears.
    Records still unwritten at close() are named in one log line (and stay in spill_dir/unwritten if they are).
    """

    def __init__(self, directory: str | os.PathLike, shard_size: int = 0, max_pending_bytes: int = 1 << 30,
                 hold_max_bytes: int = 2 << 30, spill_dir: str | os.PathLike | None = None,
                 retry_min_s: float = 0.05, retry_max_s: float = 2.0):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.index = NpzIndex(self.dir)
        self.shard_size = shard_size
        self.max_pending_bytes = max_pending_bytes
        self.hold_max_bytes = hold_max_bytes
        self.spill_dir = Path(spill_dir) / "unwritten" if spill_dir else None
        self.retry_min_s, self.retry_max_s = retry_min_s, retry_max_s
        self.records = 0
        self.rows = 0
        self.bytes = 0
        self.errors = 0            # failed write attempts (also `write_failed`)
        self.lost = 0              # records given up at close()
        self._pending_bytes = 0
        self._cv = threading.Condition()
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._shard: list[wire.Record] = []
        self._shard_no = self._next_shard_no()
        self._held: OrderedDict[str, wire.Record] = OrderedDict()   # failed, waiting for a retry, in memory
        self._held_spilled: OrderedDict[str, Path] = OrderedDict()  # failed, waiting for a retry, in spill_dir
        self._held_bytes = 0
        self._retry_at = 0.0
        self._backoff_s = retry_min_s
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="rr-npz-writer", daemon=True)
        self._thread.start()

    @property
    def write_failed(self) -> int:
        return self.errors

    @property
    def retry_pending(self) -> int:
        return len(self._held) + len(self._held_spilled)

    @property
    def backlogged(self) -> bool:
        """True while failed records held in memory exceed hold_max_bytes (the consumer pauses its intake)."""
        return self._held_bytes > self.hold_max_bytes

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
            timeout = None
            if self._held or self._held_spilled:
                timeout = max(0.0, self._retry_at - time.monotonic())
            try:
                rec = self._q.get(timeout=timeout)
            except queue.Empty:
                self._retry()
                continue
            if rec is None:
                if self._shard:
                    self._write(self._take_shard())
                self._retry()
                self._give_up()
                return
            try:
                if self.shard_size > 0:
                    self._shard.append(rec)
                    if len(self._shard) >= self.shard_size:
                        self._write(self._take_shard())
                else:
                    self._write([rec])
            finally:
                with self._cv:
                    self._pending_bytes -= rec.nbytes
                    self._cv.notify_all()

    def _take_shard(self) -> list[wire.Record]:
        recs, self._shard = self._shard, []
        return recs

    def _write(self, recs: list[wire.Record]) -> bool:
        """Write records (one file each, or one shard); on failure hold them for a retry. True if written."""
        try:
            if self.shard_size > 0:
                self._write_shard(recs)
            else:
                for i, rec in enumerate(recs):
                    write_record(self.dir, rec)
                    self._written(rec)
                return True
        except Exception as e:  # a full disk must not kill the consumer; it is counted, logged and retried
            self.errors += 1
            done = 0 if self.shard_size > 0 else i
            for rec in recs[done:]:
                self._hold(rec)
            if self.errors == 1 or self.errors % 100 == 0 or len(recs) > 1:
                log.error("npz write failed for %r (%d records): %s; write_failed=%d write_retry_pending=%d, "
                          "next retry in %.2fs", recs[done].request_id[:64], len(recs) - done, e, self.errors,
                          self.retry_pending, self._backoff_s)
            self._retry_at = time.monotonic() + self._backoff_s
            self._backoff_s = min(self.retry_max_s, 2 * self._backoff_s)
            return False
        for rec in recs:
            self._written(rec)
        return True

    def _written(self, rec: wire.Record) -> None:
        self.records += 1
        self.rows += len(rec.prompt_routed_experts) + len(rec.routed_experts)
        self.bytes += rec.nbytes

    def _hold(self, rec: wire.Record) -> None:
        self._held[rec.request_id] = rec
        self._held_bytes += rec.nbytes
        while self._held_bytes > self.hold_max_bytes and self.spill_dir is not None and self._held:
            rid, victim = next(iter(self._held.items()))
            try:
                self.spill_dir.mkdir(parents=True, exist_ok=True)
                self._held_spilled[rid] = write_record(self.spill_dir, victim)
            except OSError as e:
                log.error("npz writer: spill of unwritten %r to %s failed (%s): holding it in memory", rid[:64],
                          self.spill_dir, e)
                return
            del self._held[rid]
            self._held_bytes -= victim.nbytes

    def _retry(self) -> None:
        """Write what failed before, oldest first; stop at the first failure (the backoff grows)."""
        try:
            self.dir.mkdir(parents=True, exist_ok=True)        # a directory that was removed is made again
        except OSError:
            pass                                              # (a file in its place: the write below says so)
        while self._held_spilled:
            rid, path = next(iter(self._held_spilled.items()))
            try:
                rec = read_record(path)
            except (OSError, ValueError, KeyError) as e:
                log.error("npz writer: unwritten %r cannot be read back from %s (%s): lost", rid[:64], path, e)
                del self._held_spilled[rid]
                self.lost += 1
                continue
            del self._held_spilled[rid]
            if not self._write([rec]):
                return
            path.unlink(missing_ok=True)
        while self._held:
            batch = list(self._held.values())[:max(1, self.shard_size)]
            for rec in batch:
                del self._held[rec.request_id]
                self._held_bytes -= rec.nbytes
            if not self._write(batch):
                return
            log.info("npz writer: %d held records written on retry, write_retry_pending=%d", len(batch),
                     self.retry_pending)
        self._backoff_s = self.retry_min_s

    def _give_up(self) -> None:
        ids = list(self._held) + list(self._held_spilled)
        if ids:
            self.lost += len(self._held)
            log.error("npz writer closing with %d unwritten records (%d lost from memory, %d kept in %s): %s",
                      len(ids), len(self._held), len(self._held_spilled), self.spill_dir,
                      [r[:64] for r in ids[:32]])

    def _write_shard(self, recs: list[wire.Record]) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        name = f"shard-{self._shard_no:06d}.npz"
        self._shard_no += 1
        arrays = {}
        for i, r in enumerate(recs):
            arrays.update(_arrays(r, f"{i}/"))
        _atomic_savez(self.dir / name, arrays)
        with open(self.dir / "index.jsonl", "a") as f:
            f.write("".join(json.dumps({"request_id": r.request_id, "shard": name, "i": i}) + "\n"
                            for i, r in enumerate(recs)))
        for i, r in enumerate(recs):
            self.index.shards[r.request_id] = ShardEntry(name, i)

    def close(self, timeout_s: float = 60.0) -> None:
        """Write what is queued (and a last partial shard), try the held records once more, then stop. Idempotent."""
        if self._thread.is_alive():
            self._q.put(None)
            self._thread.join(timeout_s)


def read_record(path: str | os.PathLike) -> wire.Record:
    """Read one per-request npz file."""
    with np.load(path, allow_pickle=False) as z:
        return _record(z)


def record_files(directory: str | os.PathLike) -> list[Path]:
    """The per-request record files under DIR, sorted: not shards, not the ".tmp-*.npz" files a writer is still
    filling (pathlib's glob("*.npz") matches those too: count or delete records through this)."""
    return [p for p in sorted(Path(directory).glob("*.npz"))
            if not p.name.startswith("shard-") and not p.name.startswith(".tmp-")]


def iter_records(directory: str | os.PathLike) -> Iterator[wire.Record]:
    """Yield every record under DIR, from per-request files and from shards."""
    d = Path(directory)
    for p in record_files(d):
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
