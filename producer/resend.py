"""Keep a producer's unacknowledged data messages (its resend buffer), in seq order, in memory and a spill file.

Socket-free: the producer's thread adds encoded messages, takes the next one to send, rewinds the send cursor to
the first unacknowledged message and releases a prefix on each ack; everything here works on frames (bytes).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import uuid
from collections import deque
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple, Sequence


class SpillRef(NamedTuple):
    """Where one message's frames lie in the spill: segment number, byte offset, and each frame's length."""

    segment: int
    offset: int
    lengths: tuple


class Spill:
    """Own the replay buffer's overflow: append-only segment files in a private directory, deleted once acked."""

    SEGMENT_BYTES = 64 << 20

    def __init__(self, directory: str | os.PathLike, producer_id: str):
        tag = hashlib.blake2b(producer_id.encode("utf-8", "backslashreplace"), digest_size=6).hexdigest()
        self.dir = Path(directory) / f"rr-replay-{tag}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.dir.mkdir(parents=True, mode=0o700)
        self.bytes = 0
        self._seg = -1
        self._fds: dict[int, int] = {}
        self._off: dict[int, int] = {}
        self._live: dict[int, int] = {}

    @property
    def segments(self) -> int:
        """Segment files on disk now."""
        return len(self._fds)

    def _open_segment(self) -> None:
        self._seg += 1
        fd = os.open(self.dir / f"{self._seg:08d}.seg", os.O_CREAT | os.O_RDWR | os.O_TRUNC, 0o600)
        self._fds[self._seg], self._off[self._seg], self._live[self._seg] = fd, 0, 0

    def write(self, frames: Sequence) -> SpillRef:
        if self._seg < 0 or self._off[self._seg] >= self.SEGMENT_BYTES:
            old = self._seg
            self._open_segment()
            if old >= 0 and self._live[old] == 0:
                self._drop(old)
        seg = self._seg
        fd, off = self._fds[seg], self._off[seg]
        lens = []
        pos = off
        for f in frames:
            mv = memoryview(f).cast("B")
            done = 0
            while done < len(mv):
                done += os.pwrite(fd, mv[done:], pos + done)
            lens.append(done)
            pos += done
        self._off[seg] = pos
        self._live[seg] += 1
        self.bytes += sum(lens)
        return SpillRef(seg, off, tuple(lens))

    def read(self, ref: SpillRef) -> list:
        off = ref.offset
        out = []
        for n in ref.lengths:
            b = os.pread(self._fds[ref.segment], n, off)
            if len(b) != n:
                raise OSError(f"spill segment {ref.segment} is short: wanted {n} bytes at {off}, got {len(b)}")
            out.append(b)
            off += n
        return out

    def release(self, ref: SpillRef) -> None:
        seg = ref.segment
        self.bytes -= sum(ref.lengths)
        self._live[seg] -= 1
        if self._live[seg] == 0 and seg != self._seg:
            self._drop(seg)

    def _drop(self, seg: int) -> None:
        os.close(self._fds.pop(seg))
        del self._off[seg], self._live[seg]
        (self.dir / f"{seg:08d}.seg").unlink(missing_ok=True)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        shutil.rmtree(self.dir, ignore_errors=True)


class Parts(NamedTuple):
    """What one data message carries, kept beside its frames so a refusal of it can be answered for."""

    kind: str                 # open, delta, finish, abort
    request_ids: Sequence     # one per request part (one for open/finish/abort)
    starts: Sequence = ()     # delta: first position of each request's rows
    counts: Sequence = ()     # delta: rows of each request


class Entry:
    """One data message kept until the broker acks it: its frames in memory, or where they are in the spill."""

    __slots__ = ("seq", "parts", "frames", "nbytes", "payload", "spill", "sent_at")

    def __init__(self, seq: int, parts: Parts, frames: list, payload: int):
        self.seq = seq
        self.parts = parts
        self.frames: list | None = frames
        self.nbytes = sum(len(memoryview(f).cast("B")) for f in frames)
        self.payload = payload            # bytes of routing rows (the stats count these)
        self.spill: SpillRef | None = None
        self.sent_at = 0.0                # monotonic time of the last send; 0.0: never sent

    def __repr__(self) -> str:
        where = "spill" if self.spill is not None else "memory"
        return f"Entry(seq={self.seq}, {self.parts.kind}, {self.nbytes} bytes in {where}, sent_at={self.sent_at})"


class Released(NamedTuple):
    """What one ack released: how many entries, and how many of them had never been sent."""

    msgs: int
    never_sent: int


class ReplayBuffer:
    """Own the unacknowledged messages of one producer epoch: contiguous seqs, memory up to `mem_bound` bytes,
    then the spill (if any) up to `spill_bound`, and the send cursor (the next seq to send, rewound on demand)."""

    def __init__(self, mem_bound: int, spill: Spill | None = None, spill_bound: int = 0):
        self.mem_bound = mem_bound
        self.spill = spill
        self.spill_bound = spill_bound if spill is not None else 0
        self.mem_bytes = 0
        self.never_sent = 0
        self._entries: deque[Entry] = deque()
        self._next_seq = 1                # seq the next added entry gets
        self._send_seq = 1                # seq of the next entry to send

    # ---- size ---------------------------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[Entry]:
        return iter(self._entries)

    @property
    def spilled_bytes(self) -> int:
        return self.spill.bytes if self.spill is not None else 0

    @property
    def next_seq(self) -> int:
        return self._next_seq

    @property
    def first_unacked(self) -> int:
        """The first seq not acknowledged (the next seq to be assigned when everything is)."""
        return self._entries[0].seq if self._entries else self._next_seq

    def has_room(self) -> bool:
        if self.mem_bytes < self.mem_bound:
            return True
        return self.spill is not None and self.spill.bytes < self.spill_bound

    # ---- entries ------------------------------------------------------------------------------------------------

    def add(self, parts: Parts, frames: list, payload: int) -> Entry:
        """Keep one encoded message under the next seq (frames[0] must already carry that seq)."""
        e = Entry(self._next_seq, parts, frames, payload)
        if self.mem_bytes + e.nbytes > self.mem_bound and self.spill is not None:
            e.spill = self.spill.write(frames)         # read back from the file when it is sent
            e.frames = None
        else:
            self.mem_bytes += e.nbytes
        self._entries.append(e)
        self._next_seq += 1
        self.never_sent += 1
        return e

    def get(self, seq: int) -> Entry | None:
        """The entry of `seq` while it is held (seqs in the buffer are contiguous)."""
        if not self._entries:
            return None
        i = seq - self._entries[0].seq
        return self._entries[i] if 0 <= i < len(self._entries) else None

    def after(self, seq: int) -> Iterator[Entry]:
        """Held entries with a seq above `seq`, in seq order."""
        if not self._entries:
            return iter(())
        i = max(0, seq + 1 - self._entries[0].seq)
        return (self._entries[j] for j in range(i, len(self._entries)))

    def replace_frames(self, e: Entry, frames: list) -> None:
        """Give a held, never-sent entry new frames (same seq): the byte accounting follows."""
        if e.sent_at != 0.0:
            raise ValueError(f"seq {e.seq} was sent already; its frames cannot change")
        if e.spill is not None:
            self.spill.release(e.spill)
            e.spill = None
        else:
            self.mem_bytes -= e.nbytes
        e.frames = frames
        e.nbytes = sum(len(memoryview(f).cast("B")) for f in frames)
        self.mem_bytes += e.nbytes

    def renumber(self, expand: Callable[[Entry, list], list | None], reseq: Callable[[Any, int], Any]) -> int:
        """Replace every held entry by what `expand(entry, frames)` returns: None keeps it, else a list of
        (parts, frames, payload), each a message of its own. All held entries are numbered again from the first
        unacknowledged seq (`reseq(header frame, seq)` rewrites a header whose seq moved), and the send cursor goes
        back there. An entry kept as it was keeps its last send time (its next send is a resend). Every expansion
        is made before anything changes: if `expand` raises, the buffer is as it was. Returns how many entries
        were added. For a broker that does not take a kind that messages held here have (a downgrade)."""
        old = list(self._entries)
        if not old:
            return 0
        plan = []
        for e in old:
            frames = self.frames(e)
            plan.append((e, frames, expand(e, frames)))
        first = old[0].seq
        for e in old:
            if e.spill is not None:
                self.spill.release(e.spill)
                e.spill = None
        self._entries.clear()
        self.mem_bytes = 0
        self.never_sent = 0
        self._next_seq = first
        added = 0
        for e, frames, outs in plan:
            kept = outs is None
            if kept:
                outs = [(e.parts, frames, e.payload)]
            else:
                added += len(outs) - 1
            for parts, fr, payload in outs:
                if not kept or e.seq != self._next_seq:
                    fr = [reseq(fr[0], self._next_seq), *fr[1:]]
                ne = self.add(parts, fr, payload)
                if kept and e.sent_at != 0.0:
                    ne.sent_at = e.sent_at
                    self.never_sent -= 1
            e.frames = None
        self._send_seq = first
        return added

    def frames(self, e: Entry) -> list:
        return e.frames if e.frames is not None else self.spill.read(e.spill)

    # ---- sending ------------------------------------------------------------------------------------------------

    def next_to_send(self) -> Entry | None:
        return self.get(max(self._send_seq, self.first_unacked))

    def pending(self) -> int:
        """Entries at or after the send cursor."""
        return self._next_seq - max(self._send_seq, self.first_unacked)

    def mark_sent(self, e: Entry, now: float) -> bool:
        """Move the cursor past `e`. True if it was its first send."""
        first = e.sent_at == 0.0
        if first:
            self.never_sent -= 1
        e.sent_at = now
        self._send_seq = e.seq + 1
        return first

    def rewind(self) -> None:
        """Send again from the first unacknowledged entry."""
        self._send_seq = self.first_unacked

    # ---- acks ---------------------------------------------------------------------------------------------------

    def ack(self, upto: int) -> Released:
        """Release every entry with seq <= upto."""
        n = never = 0
        entries = self._entries
        while entries and entries[0].seq <= upto:
            e = entries.popleft()
            if e.spill is not None:
                self.spill.release(e.spill)
            else:
                self.mem_bytes -= e.nbytes
            if e.sent_at == 0.0:                  # acked before this producer sent it (a broker bug)
                never += 1
            e.frames = None
            n += 1
        self.never_sent -= never
        return Released(n, never)

    def close(self) -> None:
        self._entries.clear()
        if self.spill is not None:
            self.spill.close()
