"""Write finished records as npz files (one per request, or shards with an index) and read them back.

One-file layout: DIR/<safe id>.npz with keys prompt_routed_experts, routed_experts, num_cached_tokens,
moe_layer_ids, complete, missing, reason, finish_reason, request_id, and prompt_token_ids / output_token_ids
when known, num_prefix_filled when not 0 (files without it read as 0), and, for rows that are not int16, `ids`
(the rows' dtype code, "u1" or "u2", wire.ID_DTYPES) and `missing_id` (255 or 65535: a row never computed).
Files without `ids` hold int16 rows with -1 (every file written before compact ids) and keep loading. Readers
hand out int16 rows (-1) by default, as before; ids="compact" gives the rows as stored.
Shard layout (--shard-size N): DIR/shard-000000.npz holds N records under keys "<i>/<name>" and
DIR/index.jsonl has one line per record {"request_id", "shard", "i"}. Every file is written to a temporary
name in DIR, fsynced, renamed, and the directory fsynced (durable=True, the default), so a reader never sees a
partial file and a renamed file survives a power cut.

A file that cannot be read (truncated, empty, not a zip, a flipped bit, a missing key) is never fatal: readers
raise UnreadableRecord naming the file, or skip it with one log line naming it (load_records' default). A torn last
line of index.jsonl (a crash while appending) is skipped by readers, who read the record it lost from its shard;
the writer rewrites the index at start from its good lines and the shard files, so the next append starts on a
line of its own.
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
INDEX = "index.jsonl"


class UnreadableRecord(ValueError):
    """A record file (or one record of a shard) that exists but cannot be read; `path` names the file."""

    def __init__(self, path: str | os.PathLike, err: BaseException, request_id: str | None = None):
        what = f"record {request_id[:64]!r} in " if request_id is not None else ""
        super().__init__(f"{what}{path} is unreadable: {type(err).__name__}: {str(err)[:200]}")
        self.path = Path(path)
        self.request_id = request_id


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
    dt = wire.as_id_dtype(rec.prompt_routed_experts.dtype)
    if rec.routed_experts.dtype != dt:
        raise ValueError(f"record {rec.request_id[:64]!r} has {dt.name} prompt rows and "
                         f"{rec.routed_experts.dtype.name} generation rows")
    if dt != wire.ROW_DTYPE:
        d["ids"] = np.array(wire.ids_code(dt))
        d["missing_id"] = np.int64(wire.missing_id(dt))
    if rec.prompt_token_ids is not None:
        d["prompt_token_ids"] = np.asarray(rec.prompt_token_ids, dtype=np.int32)
    if rec.output_token_ids is not None:
        d["output_token_ids"] = np.asarray(rec.output_token_ids, dtype=np.int32)
    return {prefix + k: v for k, v in d.items()}


def _record(z, prefix: str = "", ids: str = "compact") -> wire.Record:
    """The record under `prefix` of an open npz, its rows as stored (ids="compact") or as int16 (-1)."""
    def get(k, default=None):
        return z[prefix + k] if prefix + k in z else default

    pt, ot = get("prompt_token_ids"), get("output_token_ids")
    code = str(get("ids", "i2"))
    if code not in wire.ID_DTYPES:
        raise ValueError(f"ids {code[:32]!r}: expected one of {sorted(wire.ID_DTYPES)}")
    dt = wire.ID_DTYPES[code]
    pr, ge = get("prompt_routed_experts"), get("routed_experts")
    for name, a in (("prompt_routed_experts", pr), ("routed_experts", ge)):
        if a is None or a.dtype != dt or a.ndim != 3:
            raise ValueError(f"{name} is {None if a is None else (a.dtype.name, a.shape)}, the file states "
                             f"ids {code!r} ({dt.name}, 3-D)")
    miss = get("missing_id")
    if miss is not None and int(miss) != wire.missing_id(dt):
        raise ValueError(f"missing_id {int(miss)} for ids {code!r} (expected {wire.missing_id(dt)})")
    rec = wire.Record(
        request_id=str(get("request_id")), prompt_routed_experts=pr,
        routed_experts=ge, num_cached_tokens=int(get("num_cached_tokens")),
        moe_layer_ids=get("moe_layer_ids"), complete=bool(get("complete")),
        missing=[tuple(int(x) for x in m) for m in get("missing", np.zeros((0, 2), np.int64))],
        reason=str(get("reason", "")), finish_reason=str(get("finish_reason", "")),
        prompt_token_ids=pt, output_token_ids=ot, num_prefix_filled=int(get("num_prefix_filled", 0)))
    return rec.as_ids(ids)


def fsync_dir(directory: str | os.PathLike) -> None:
    """fsync a directory, so the names renamed or created in it survive a power cut (not only their contents)."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_savez(path: Path, arrays: dict, durable: bool = True) -> int:
    """Write to a temporary name beside `path`, then rename. durable: fsync the file before the rename (so the
    name never points at data still in the page cache) and the directory after it (so the rename itself lasts)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".npz")
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
            size = f.tell()
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
        if durable:
            fsync_dir(path.parent)
        return size
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def write_record(directory: str | os.PathLike, rec: wire.Record, durable: bool = True) -> Path:
    """Write one record as DIR/<safe id>.npz atomically (and durably: see _atomic_savez); returns the path."""
    d = Path(directory)
    path = d / (safe_filename(rec.request_id) + ".npz")
    if path.resolve().parent != d.resolve():
        raise ValueError(f"request id {rec.request_id[:64]!r} would leave {d}")
    _atomic_savez(path, _arrays(rec), durable)
    return path


class ShardEntry(NamedTuple):
    """Where a record lives in the shard layout: DIR/<shard>, keys "<i>/<name>"."""

    shard: str
    i: int


def _shard_ids(path: Path) -> list[tuple[int, str]]:
    """(i, request id) of every record in a shard file, in order; UnreadableRecord if it cannot be read."""
    try:
        with np.load(path, allow_pickle=False) as z:
            idx = sorted(int(k.split("/", 1)[0]) for k in z.files if k.endswith("/request_id"))
            return [(i, str(z[f"{i}/request_id"])) for i in idx]
    except Exception as e:  # noqa: BLE001 -- any content of a file on disk is input: never fatal
        raise UnreadableRecord(path, e) from e


class IndexScan(NamedTuple):
    """What DIR/index.jsonl says: id -> shard entry (later lines win), lines that did not parse, and whether the
    file ends inside a line (a crash while appending)."""

    entries: dict
    bad_lines: list
    torn: bool


def scan_index(directory: str | os.PathLike) -> IndexScan:
    """Read DIR/index.jsonl tolerantly (every line that parses counts; the others are listed by line number)."""
    index = Path(directory) / INDEX
    entries: dict[str, ShardEntry] = {}
    bad: list[int] = []
    try:
        text = index.read_bytes().decode("utf-8", "replace")
    except FileNotFoundError:
        return IndexScan(entries, bad, False)
    for no, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            e = json.loads(line)
            entries[str(e["request_id"])] = ShardEntry(str(e["shard"]), int(e["i"]))
        except (ValueError, KeyError, TypeError):
            bad.append(no)
    return IndexScan(entries, bad, bool(text) and not text.endswith("\n"))


def _unindexed(directory: Path, entries: dict) -> dict[str, ShardEntry]:
    """Records in shard files that the index does not list (the torn line's shard, or a crash between a shard's
    rename and its index lines): read from the shards themselves. Unreadable shards are logged and skipped."""
    per_shard: dict[str, int] = {}
    for e in entries.values():
        per_shard[e.shard] = per_shard.get(e.shard, 0) + 1
    found: dict[str, ShardEntry] = {}
    for path in sorted(directory.glob("shard-*.npz")):
        try:
            ids = _shard_ids(path)
        except UnreadableRecord as e:
            log.error("npz index: %s; its records are not indexed", e)
            continue
        if per_shard.get(path.name, 0) >= len(ids):
            continue
        for i, rid in ids:
            e = entries.get(rid)
            if e is None or (e.shard == path.name and e.i != i):
                found[rid] = ShardEntry(path.name, i)
    return found


class NpzIndex:
    """Own the lookup of records already on disk under DIR, read lazily (nothing is loaded until asked for).

    A per-request file is found by its name (safe_filename of the id), so that layout needs no index; the shard
    layout's DIR/index.jsonl is read once at start and extended by the writer as it writes shards. With
    repair=True (the writer's), a torn or unparsable index is rewritten at start from its good lines plus what the
    shard files hold that it lost, so the next append starts on a line of its own.
    """

    def __init__(self, directory: str | os.PathLike, repair: bool = False, durable: bool = True):
        self.dir = Path(directory)
        scan = scan_index(self.dir)
        self.shards: dict[str, ShardEntry] = scan.entries
        if scan.bad_lines or scan.torn:
            log.warning("npz index %s: %d unreadable lines %s%s", self.dir / INDEX, len(scan.bad_lines),
                        scan.bad_lines[:8], " (the last one torn)" if scan.torn else "")
        if scan.bad_lines or scan.torn or (self.dir.is_dir() and any(self.dir.glob("shard-*.npz"))
                                           and self._shards_unlisted()):
            found = _unindexed(self.dir, self.shards)
            self.shards.update(found)
            if repair and (scan.bad_lines or scan.torn or found):
                self._rewrite(durable)
                log.warning("npz index %s repaired: %d records re-indexed from shard files, %d lines dropped",
                            self.dir / INDEX, len(found), len(scan.bad_lines))

    def _shards_unlisted(self) -> bool:
        listed = {e.shard for e in self.shards.values()}
        return any(p.name not in listed for p in self.dir.glob("shard-*.npz"))

    def _rewrite(self, durable: bool) -> None:
        fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=".tmp-", suffix=".jsonl")
        try:
            with os.fdopen(fd, "w") as f:
                f.write("".join(json.dumps({"request_id": rid, "shard": e.shard, "i": e.i}) + "\n"
                                for rid, e in self.shards.items()))
                if durable:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, self.dir / INDEX)
            if durable:
                fsync_dir(self.dir)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def _file(self, rid: str) -> Path:
        return self.dir / (safe_filename(rid) + ".npz")

    def __contains__(self, rid: str) -> bool:
        return rid in self.shards or self._file(rid).is_file()

    def read(self, rid: str) -> wire.Record | None:
        """The record of `rid` from disk, or None if it is not there. UnreadableRecord (naming the file) if its
        file is there but cannot be read, whatever its content."""
        entry = self.shards.get(rid)
        path = self.dir / entry.shard if entry is not None else self._file(rid)
        try:
            if entry is not None:
                with np.load(path, allow_pickle=False) as z:
                    rec = _record(z, f"{entry.i}/")
            else:
                if not path.is_file():
                    return None
                rec = read_record(path, "compact")
        except FileNotFoundError:
            return None
        except UnreadableRecord:
            raise
        except Exception as e:  # noqa: BLE001 -- EOFError, BadZipFile, zlib.error, ...: file content is input
            raise UnreadableRecord(path, e, rid) from e
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
    Records still unwritten at close() are named in one log line (and stay in spill_dir/unwritten if they are);
    the next writer with the same spill_dir takes them up again at start and writes them.

    durable (the default): every file is fsynced before its rename and the directory after it (_atomic_savez).
    """

    def __init__(self, directory: str | os.PathLike, shard_size: int = 0, max_pending_bytes: int = 1 << 30,
                 hold_max_bytes: int = 2 << 30, spill_dir: str | os.PathLike | None = None,
                 retry_min_s: float = 0.05, retry_max_s: float = 2.0, durable: bool = True):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.durable = durable
        self.index = NpzIndex(self.dir, repair=True, durable=durable)
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
        self._queued: dict[str, int] = {}           # request id -> records of it put and not yet written or held
        self._retry_at = 0.0
        self._backoff_s = retry_min_s
        self._failure: BaseException | None = None
        self.reloaded = self._reload_unwritten()
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

    def _reload_unwritten(self) -> int:
        """Take up the records an earlier writer left unwritten in spill_dir/unwritten: written on the first retry."""
        if self.spill_dir is None or not self.spill_dir.is_dir():
            return 0
        for path in record_files(self.spill_dir):
            try:
                rid = str(_file_request_id(path))
            except UnreadableRecord as e:
                log.error("npz writer: unwritten record left by an earlier run cannot be read: %s", e)
                continue
            self._held_spilled[rid] = path
        if self._held_spilled:
            log.warning("npz writer: %d unwritten records left in %s by an earlier run, writing them to %s: %s",
                        len(self._held_spilled), self.spill_dir, self.dir,
                        [r[:64] for r in list(self._held_spilled)[:32]])
        return len(self._held_spilled)

    def pending(self, rid: str) -> bool:
        """True while a record of `rid` was put and is not on disk yet (queued, in the shard being filled, or held
        after a failed write). Read from other threads: a snapshot."""
        return (rid in self._queued or rid in self._held or rid in self._held_spilled
                or any(r.request_id == rid for r in list(self._shard)))

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
            self._queued[rec.request_id] = self._queued.get(rec.request_id, 0) + 1
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
                    left = self._queued.pop(rec.request_id, 1) - 1
                    if left > 0:
                        self._queued[rec.request_id] = left
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
                    write_record(self.dir, rec, self.durable)
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
                self._held_spilled[rid] = write_record(self.spill_dir, victim, self.durable)
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
                rec = read_record(path, "compact")
            except (OSError, UnreadableRecord) as e:
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
        _atomic_savez(self.dir / name, arrays, self.durable)
        with open(self.dir / INDEX, "a") as f:
            f.write("".join(json.dumps({"request_id": r.request_id, "shard": name, "i": i}) + "\n"
                            for i, r in enumerate(recs)))
            if self.durable:
                f.flush()
                os.fsync(f.fileno())
        for i, r in enumerate(recs):
            self.index.shards[r.request_id] = ShardEntry(name, i)

    def close(self, timeout_s: float = 60.0) -> None:
        """Write what is queued (and a last partial shard), try the held records once more, then stop. Idempotent."""
        if self._thread.is_alive():
            self._q.put(None)
            self._thread.join(timeout_s)


def _file_request_id(path: Path) -> str:
    """The request id a per-request file holds (read_record without the arrays)."""
    try:
        with np.load(path, allow_pickle=False) as z:
            return str(z["request_id"])
    except Exception as e:  # noqa: BLE001 -- file content is input
        raise UnreadableRecord(path, e) from e


def read_record(path: str | os.PathLike, ids: str = "int16") -> wire.Record:
    """Read one per-request npz file; UnreadableRecord naming it if it cannot be read (OSError if it is not there).
    ids="int16" (the default): int16 rows with -1, whatever the file holds; "compact": the rows as stored."""
    wire.check_ids_choice(ids)
    try:
        with np.load(path, allow_pickle=False) as z:
            return _record(z, "", ids)
    except (FileNotFoundError, IsADirectoryError, PermissionError):
        raise
    except Exception as e:  # noqa: BLE001 -- EOFError, BadZipFile, zlib.error, a missing key: file content is input
        raise UnreadableRecord(path, e) from e


def record_files(directory: str | os.PathLike) -> list[Path]:
    """The per-request record files under DIR, sorted: not shards, not the ".tmp-*.npz" files a writer is still
    filling (pathlib's glob("*.npz") matches those too: count or delete records through this)."""
    return [p for p in sorted(Path(directory).glob("*.npz"))
            if not p.name.startswith("shard-") and not p.name.startswith(".tmp-")]


def iter_records(directory: str | os.PathLike, errors: str = "skip",
                 unreadable: list | None = None, ids: str = "int16") -> Iterator[wire.Record]:
    """Yield every record under DIR, from per-request files and from shards (a torn index line skipped; records
    the index lost read from their shard files).

    errors="skip" (the default): an unreadable file (or shard record) is logged by name and skipped, and its
    UnreadableRecord appended to `unreadable` if given; errors="raise": UnreadableRecord naming the first one.
    ids="int16" (the default): int16 rows with -1 (as every file before compact ids held); "compact": the rows
    as stored (uint8/uint16 where the file says so: half the memory or less).
    """
    if errors not in ("skip", "raise"):
        raise ValueError(f"errors must be 'skip' or 'raise', got {errors!r}")
    wire.check_ids_choice(ids)

    def bad(e: UnreadableRecord) -> None:
        if errors == "raise":
            raise e
        log.error("load_records: skipping %s", e)
        if unreadable is not None:
            unreadable.append(e)

    d = Path(directory)
    for p in record_files(d):
        try:
            rec = read_record(p, ids)
        except UnreadableRecord as e:
            bad(e)
            continue
        except OSError as e:                       # removed meanwhile, or not a file: named like the others
            bad(UnreadableRecord(p, e))
            continue
        yield rec
    scan = scan_index(d)
    if scan.bad_lines or scan.torn:
        log.warning("load_records: %s has %d unreadable lines %s (records in their shards are still read)",
                    d / INDEX, len(scan.bad_lines), scan.bad_lines[:8])
    entries = dict(scan.entries)
    unlisted = {p.name for p in d.glob("shard-*.npz")} - {e.shard for e in entries.values()}
    if scan.bad_lines or scan.torn or unlisted:
        entries.update(_unindexed(d, entries))
    by_shard: dict[str, list] = {}
    for rid, e in entries.items():
        by_shard.setdefault(e.shard, []).append((e.i, rid))
    for shard, idxs in sorted(by_shard.items()):
        path = d / shard
        try:
            z = np.load(path, allow_pickle=False)
        except Exception as e:  # noqa: BLE001 -- file content is input
            bad(UnreadableRecord(path, e))
            continue
        with z:
            for i, rid in sorted(idxs):
                try:
                    rec = _record(z, f"{i}/", ids)
                except Exception as e:  # noqa: BLE001
                    bad(UnreadableRecord(path, e, rid))
                    continue
                yield rec


def load_records(directory: str | os.PathLike, errors: str = "skip",
                 unreadable: list | None = None, ids: str = "int16") -> dict[str, wire.Record]:
    """Read every record under DIR (both layouts) into {request_id: Record}. Unreadable files are logged by name
    and skipped (listed in `unreadable` if given), or errors="raise": UnreadableRecord naming the first.
    ids="int16" (the default): int16 rows, -1 never computed; "compact": as stored (Record.id_dtype says)."""
    return {r.request_id: r for r in iter_records(directory, errors, unreadable, ids)}


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
