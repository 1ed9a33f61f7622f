"""Take a producer's queued items into its resend buffer and keep its side of the protocol, without a socket.

`Intake` is everything the producer's thread decides: which queued items go out as which messages (announces
batched, steps coalesced, merged or split, refused parts cut out), what a broker's reply means (acks, rewinds,
refusals, a new broker, one that stopped taking batches), when to resend (ack timeout), when the broker is silent,
and when closing is done. The socket loop (producer/sender.py) only moves frames: it sends what `next_to_send()`
and `control()` give, hands each reply's header to `on_reply()` and each connection event to `on_connected()` /
`on_disconnected()` / `on_handshake_failed()`. Tested on bytes alone (tests/test_producer_intake.py).
"""

from __future__ import annotations

import logging
import math
import queue
from typing import Any, NamedTuple

import numpy as np

from routing_replay.protocol import wire
from routing_replay.protocol.loop import MessageTooLarge
from routing_replay.producer.books import RequestBook, escaped_id, lost_body, with_lost
from routing_replay.producer.coalesce import OwnerHints, StepParts, merge_coalesced_steps
from routing_replay.producer.connection import Link, LinkEvent, SilenceWatch
from routing_replay.producer.encode import (SAFE_ENTRIES, Geometry, delta_rows_limit, encode_announce,
                                            encode_finishes, encode_opens, encode_step, encode_steps,
                                            header_too_long, oversized, split_step, step_rows, token_frames)
from routing_replay.producer.handover import RowsLost, release
from routing_replay.producer.inbox import STOP, Inbox, QueueLedger
from routing_replay.producer.items import Announce, Announces, Step
from routing_replay.producer.outpool import NATIVE
from routing_replay.producer.resend import Entry, Parts, ReplayBuffer

log = logging.getLogger("routing_replay.producer")

_MAX_LATE_LOST = 1 << 12        # requests whose losses found in the thread wait for their finish
BATCH_RANGES = 1 << 15          # position ranges (a finish's lost, refused, broker_refused) in one `finishes`: its
                                # header stays far below wire.MAX_HEADER_BYTES
# Steps that wait in the queue together are sent as one delta (never waiting for more: a step that finds the
# queue empty goes alone), up to this many steps and SenderSettings.coalesce_max_bytes: the per-message costs of
# producer, broker and consumers are paid once per batch when the thread falls behind, as in the vLLM plugin's
# 16-step batches.
COALESCE_MAX_STEPS = 64
# a replay buffer full again and again (consumers slower than the engine: every ack frees room for one more
# message) writes one WARNING at its first episode, then at most one per this many seconds, with the count since
FULL_LOG_EVERY_S = 10.0
# ... and up to this many bytes of rows (Producer's coalesce_max_bytes default): large enough that a decode
# message carries the whole COALESCE_MAX_STEPS at Qwen3-30B-A3B's row size, so the chain pays its per-message costs
# once per 64 steps (bench/pipeline.py --coalesce-bytes; docs/PERFORMANCE.md, "Pipeline").
COALESCE_MAX_BYTES = 16 << 20


class SenderSettings(NamedTuple):
    """What the producer's thread needs of its Producer's settings (ProducerConfig, resolved)."""

    endpoint: str
    producer_id: str
    epoch: int
    geometry: Geometry
    row_bytes: int
    heartbeat_interval_s: float
    resend_timeout_s: float
    silence_warn_after_s: float
    silence_warn_every_s: float
    linger_ms: int
    sndhwm: int
    curve_secret: Any
    server_key: Any
    replay_max_bytes: int
    spill_max_bytes: int
    max_queue_bytes: int
    coalesce_max_bytes: int = COALESCE_MAX_BYTES


class Intake:
    """Own what the producer's thread decides, socket-free: the resend buffer's contents (items taken from the
    queue, encoded), the link's state, acks, rewinds, refusals and their bookkeeping (losses to report in finishes),
    and the broker's silence.

    Shared with the caller's side: the queue (items in), the ledger (what was taken), the request book (refused
    ids), the resend buffer (read for sizes) and the stats.
    """

    def __init__(self, cfg: SenderSettings, q: Inbox, ledger: QueueLedger, book: RequestBook,
                 replay: ReplayBuffer, stats, now: float):
        self.cfg = cfg
        self._q = q
        self._ledger = ledger
        self._book = book
        self._replay = replay
        self.stats = stats
        self.hints = OwnerHints()            # owner groups from the broker's acks
        self._max_rows = delta_rows_limit(cfg.row_bytes)     # the most rows one delta may carry
        self.broker_takes_opens = False      # the broker's replies say it takes `opens` (else opens go one by one)
        self.broker_takes_finishes = False   # and `finishes`
        self.link = Link(cfg.heartbeat_interval_s)
        self._watch = SilenceWatch(cfg.silence_warn_after_s, cfg.silence_warn_every_s, now)
        self._broker_epoch: int | None = None       # None: no broker has answered yet
        self._broker_consumers: int | None = None
        self._last_progress = now
        self._timeout_s = cfg.resend_timeout_s
        self._full_since: float | None = None
        self._full_logged: float | None = None     # when the last "replay buffer full" line went out
        self._full_quiet = 0                        # episodes since that line, not logged
        self._full_quiet_s = 0.0                    # and the seconds they lasted
        self._full_loud = False                     # the current episode was logged (its end is logged too)
        self.stopping = False                       # the caller's close() sentinel was taken
        self._connections = 0
        self._auth_failures = 0
        self._sent_all_at = 0.0
        self._late_lost: dict[str, list] = {}       # losses found in the thread, for finishes not yet encoded

    # ---- queue -> resend buffer ----------------------------------------------------------------------------------

    def take(self, stash: Any, now: float) -> Any:
        """Move queued items into the replay buffer while it has room; returns the item left waiting, if any."""
        for _ in range(512):
            if self.stopping:
                break
            if not self._replay.has_room():
                if self._full_since is None:
                    self._full_since = now
                    self.stats.replay_full += 1
                    self._full_loud = self._full_logged is None or now - self._full_logged >= FULL_LOG_EVERY_S
                    if self._full_loud:
                        self._log_full(now)
                break
            if stash is None:
                try:
                    stash = self._q.get_nowait()
                except queue.Empty:
                    break
            item, stash = stash, None
            if type(item) is StepParts:             # the caller's per-step references, flattened here
                item = self._step_of(item)
                if item is None:                    # (it could not be resolved: dropped, counted, logged)
                    continue
            if item is STOP:
                self.stopping = True
            elif type(item) is Announces:           # Producer.open_many / end_many: built here, in order
                built = item.build(item.items)      # (an item it cannot build is logged, counted, left out)
                self._intake_built(built)
                for _ in range(len(item.items) - len(built)):
                    self._ledger.taken(0)
            elif type(item) is Announce and self._batches(item.kind):
                batch, stash = self._more_announces(item)
                if len(batch) == 1:
                    self._intake(item)
                else:
                    self._intake_batch(batch)
            elif isinstance(item, Step):
                batch, stash = self._more_steps(item)
                if len(batch) == 1:
                    self._intake(item)
                else:
                    self._intake_steps(batch)
            else:
                self._intake(item)
        return stash

    def _step_of(self, parts: StepParts) -> Step | None:
        """The caller's per-step references as one Step; rows that resolving the ids left out (deferred rows'
        resolve()) leave the queue's count, and so do the bytes the rows held beyond their int16 rows (extra_nbytes).
        None when they cannot be made one (deferred rows whose layout or ids do not resolve): the delta
        is dropped, its rows released, and the stream goes on (encode_errors, one WARNING); its requests' records
        then miss those rows (the consumer reports them as not delivered)."""
        rows = parts.rows
        deferred = False                            # ids that resolve() turns into the records' (until it ran)
        if not isinstance(rows, np.ndarray):
            if rows.extra_nbytes:
                self._ledger.shrunk(rows.extra_nbytes)
            deferred = rows.deferred
        before = rows.shape[0]
        try:
            step = parts.step(self.hints)
        except Exception as e:  # noqa: BLE001 (one delta's failure; the stream goes on)
            release(rows)
            self._ledger.taken(before * self.cfg.row_bytes)     # what the caller counted for its rows
            self._encode_failed("delta", sum(map(len, parts.request_ids)), e)
            return None
        if not deferred:
            return step
        cut = before - step_rows(step)
        if cut:
            self._ledger.shrunk(cut * self.cfg.row_bytes)
        return step

    def _batches(self, kind: str) -> bool:
        """Whether announces of `kind` go several in one message (the broker takes `opens` / `finishes`)."""
        return (kind == "open" and self.broker_takes_opens) or (kind == "finish" and self.broker_takes_finishes)

    def _intake_built(self, built: list) -> None:
        """open_many's or end_many's announces, in order: each run of two or more of one kind that goes batched as
        one batch, the others one by one."""
        i = 0
        while i < len(built):
            kind = built[i].kind
            j = i + 1
            while j < len(built) and built[j].kind == kind:
                j += 1
            if j - i > 1 and self._batches(kind):
                self._intake_batch(built[i:j])
            else:
                for a in built[i:j]:
                    self._intake(a)
            i = j

    def _more_announces(self, first: Announce) -> tuple[list, Any]:
        """`first` (an open or a finish) and the announces of its kind queued right behind it (Producer.open or
        finish called in a loop), up to one message's worth; the first other item taken is returned to be handled
        next."""
        batch = [first]
        kind = first.kind
        while len(batch) < wire.MAX_BATCH_ENTRIES:
            try:
                nxt = self._q.get_nowait()
            except queue.Empty:
                return batch, None
            if type(nxt) is not Announce or nxt.kind != kind:
                return batch, nxt
            batch.append(nxt)
        return batch, None

    def _intake_batch(self, items: list) -> None:
        """Opens or finishes (all of one kind) into the replay buffer as `opens` or `finishes` messages (each item
        ends its queue item's count): at most MAX_BATCH_ENTRIES entries, BATCH_ID_CHARS characters of ids and
        BATCH_RANGES position ranges (finishes' lost ranges) each, a request id at most once in one (a second
        announce of an id starts the next message)."""
        chunk: list = []
        ids: set = set()
        chars = ranges = 0
        try:
            for item in items:
                item = self._ready_announce(item)
                if item is None:
                    continue
                n = len(item.request_id)
                r = self._ranges_in(item)
                if chunk and (item.request_id in ids or len(chunk) >= wire.MAX_BATCH_ENTRIES
                              or chars + n > wire.BATCH_ID_CHARS or ranges + r > BATCH_RANGES):
                    self._keep_batch(chunk)
                    chunk, ids, chars, ranges = [], set(), 0, 0
                chunk.append(item)
                ids.add(item.request_id)
                chars += n
                ranges += r
            if chunk:
                self._keep_batch(chunk)
        finally:
            for _ in items:
                self._ledger.taken(0)

    @staticmethod
    def _ranges_in(item: Announce) -> int:
        """How many position ranges a finish announce reports (0 for anything else)."""
        b = item.body
        return len(b.get("lost", ())) + len(b.get("refused", ())) + len(b.get("broker_refused", ()))

    def _keep_batch(self, chunk: list) -> None:
        kind = chunk[0].kind
        if len(chunk) == 1:
            self._keep_announce(chunk[0])
            return
        try:
            enc = (encode_opens if kind == "open" else encode_finishes)(chunk, self.cfg.producer_id, self.cfg.epoch,
                                                                        self._replay.next_seq)
        except Exception as e:  # noqa: BLE001 (one message's failure; the stream goes on)
            if kind == "open":
                for item in chunk:
                    self._book.refuse(item.request_id)
            self._encode_failed(kind + "s", len(chunk), e)
            return
        if kind == "open":
            self.stats.opens_msgs += 1
        else:
            self.stats.finishes_msgs += 1
        self._keep(enc)

    def _more_steps(self, first: Step) -> tuple[list, Any]:
        """`first` and the steps queued right behind it that fit one message (COALESCE_*); the first item taken
        that does not fit is returned to be handled next."""
        rb = self.cfg.row_bytes
        batch = [first]
        nbytes = step_rows(first) * rb
        entries = len(first.request_ids)
        chars = -1                      # characters of the batch's ids, counted once it could pass the header budget
        limit = self.cfg.coalesce_max_bytes
        if nbytes >= limit:
            return batch, None
        while len(batch) < COALESCE_MAX_STEPS:
            try:
                nxt = self._q.get_nowait()
            except queue.Empty:
                return batch, None
            if type(nxt) is StepParts:
                nxt = self._step_of(nxt)
                if nxt is None:
                    continue
            if not isinstance(nxt, Step):
                return batch, nxt
            b = step_rows(nxt) * rb
            n = len(nxt.request_ids)
            if (nbytes + b > limit or entries + n > wire.MAX_REQUESTS_PER_DELTA
                    or (nbytes + b) // rb > self._max_rows):
                return batch, nxt
            if entries + n > SAFE_ENTRIES:      # (long request ids: the key list may outgrow the header's bound)
                if chars < 0:
                    chars = sum(sum(map(len, item.request_ids)) for item in batch)
                more = sum(map(len, nxt.request_ids))
                if header_too_long(chars + more, entries + n):
                    return batch, nxt
                chars += more
            batch.append(nxt)
            nbytes += b
            entries += n
        return batch, None

    def _intake_steps(self, batch: list) -> None:
        """Several queued steps into the replay buffer as one delta message."""
        expect = [self._step_bytes(item) for item in batch]
        try:
            items = []
            for item in batch:
                item = self._screen_step(item)
                if item is not None:
                    items.append(item)
            if not items:
                return
            row_shape = (self.cfg.geometry.layer_hi - self.cfg.geometry.layer_lo, self.cfg.geometry.top_k)
            merged = merge_coalesced_steps(items, row_shape, self.hints)
            if merged is not None:
                items = [merged]
                self.stats.merged_steps += len(batch)
            seq = self._replay.next_seq
            try:
                enc, failed = encode_steps(items, self.cfg.producer_id, self.cfg.epoch, seq, self.cfg.geometry,
                                           row_shape)
            except Exception as e:  # noqa: BLE001 (one message's failure; the stream goes on)
                enc, failed = None, [(item, e) for item in items]
            for item, e in failed:
                self._delta_failed(item, seq, e)
            if enc is not None:
                self._keep(enc)
        finally:
            for nbytes in expect:
                self._ledger.taken(nbytes)

    # ---- intake (encode into the replay buffer) ----------------------------------------------------------------------

    def _step_bytes(self, item: Step) -> int:
        """The bytes the caller counted into the queue for this step (its kept rows)."""
        if item.keep is None:
            return sum(item.counts) * self.cfg.row_bytes
        return sum(c for c, k in zip(item.counts, item.keep) if k) * self.cfg.row_bytes

    def _intake(self, item: Announce | Step) -> None:
        expect = 0
        try:
            if isinstance(item, Step):
                expect = self._step_bytes(item)
                self._intake_step(item)
            else:
                self._intake_announce(item)
        finally:
            self._ledger.taken(expect)

    def _screen_step(self, item: Step) -> Step | None:
        """The step without the parts of ids refused after the caller enqueued it; None (its rows released) if
        nothing of it is left."""
        if self._book.any_refused:                  # refused after the caller enqueued this step
            screen = self._book.screen(item.request_ids)
            if screen.keep is not None:
                before = item.keep or [True] * len(item.request_ids)
                keep = [a and b for a, b in zip(screen.keep, before)]
                self.stats.dropped_parts += before.count(True) - keep.count(True)
                item = item._replace(keep=keep)
        if not item.request_ids or (item.keep is not None and not any(item.keep)):    # (empty: all left out)
            release(item.rows)
            return None
        return item

    @staticmethod
    def _kept_entries(item: Step) -> list:
        return [(r, s, c) for i, (r, s, c) in enumerate(zip(item.request_ids, item.starts, item.counts))
                if item.keep is None or item.keep[i]]

    def _intake_step(self, item: Step) -> None:
        item = self._screen_step(item)
        if item is None:
            return
        if oversized(step_rows(item), item.request_ids, self._max_rows):
            self._intake_split(item)
            return
        seq = self._replay.next_seq
        try:
            enc = encode_step(item, self.cfg.producer_id, self.cfg.epoch, seq, self.cfg.geometry)
        except Exception as e:  # noqa: BLE001 (one message's failure; the stream goes on)
            self._delta_failed(item, seq, e)
            return
        self._keep(enc)

    def _intake_split(self, item: Step) -> None:
        """A step too large for one delta (more rows or entries, or a longer key list, than a receiver takes: the
        broker would refuse it) as several deltas, one after the other (messages.split_step)."""
        seq = self._replay.next_seq
        try:
            parts = split_step(item, self._max_rows)
        except Exception as e:  # noqa: BLE001 (one message's failure; the stream goes on)
            self._delta_failed(item, seq, e)
            return
        self.stats.split_steps += 1
        n = self.stats.split_steps
        if n == 1 or n % 1000 == 0:
            log.info("producer %s sent a step of %d rows and %d entries as %d deltas (split_steps=%d)",
                     self.cfg.producer_id, sum(len(p.rows) for p in parts), sum(len(p.request_ids) for p in parts),
                     len(parts), n)
        for part in parts:
            seq = self._replay.next_seq
            try:
                enc = encode_step(part, self.cfg.producer_id, self.cfg.epoch, seq, self.cfg.geometry)
            except Exception as e:  # noqa: BLE001
                self._delta_failed(part, seq, e)
                continue
            self._keep(enc)

    def _delta_failed(self, item: Step, seq: int, e: Exception) -> None:
        """A step that could not be encoded as the delta `seq` would have been: its kept requests' positions go in
        their finishes as lost, and as refused unless its rows were lost for lack of room (RowsLost)."""
        kept = self._kept_entries(item)
        why = None if isinstance(e, RowsLost) else "refused"
        for rid, s, c in kept:
            self._note_lost(rid, [int(s), int(s) + int(c)], seq - 1, why)
        self._encode_failed("delta", len(kept), e)

    def _intake_announce(self, item: Announce) -> None:
        item = self._ready_announce(item)
        if item is not None:
            self._keep_announce(item)

    def _keep_announce(self, item: Announce) -> None:
        """One announce, made ready, into the replay buffer as its own message."""
        try:
            enc = encode_announce(item, self.cfg.producer_id, self.cfg.epoch, self._replay.next_seq)
        except Exception as e:  # noqa: BLE001 (one message's failure; the stream goes on)
            if item.kind == "open":
                self._book.refuse(item.request_id)
            self._encode_failed(item.kind, 1, e)
            return
        self._keep(enc)

    def _ready_announce(self, item: Announce) -> Announce | None:
        """The announce as it goes out: None for the finish or abort of a request refused after the caller enqueued
        it (dropped, counted); a finish with the losses found meanwhile; token ids as int32 arrays."""
        rid = item.request_id
        if item.kind != "open" and self._book.is_refused(rid):  # refused after the caller enqueued this
            self._book.ended(rid)
            self._late_lost.pop(rid, None)
            self.stats.dropped_parts += 1
            return None
        if item.kind != "open":
            self.hints.forget(rid)
        if item.kind == "finish":
            late = self._late_lost.pop(rid, None)
            if late:
                item = with_lost(item, [r for r, _ in late], [r for r, why in late if why == "refused"],
                                 [r for r, why in late if why == "broker_refused"])
        elif item.kind == "abort":
            self._late_lost.pop(rid, None)
        item, bad = token_frames(item)
        if bad is not None:
            self.stats.token_ids_dropped += 1
            log.warning("producer %s sends the %s of request %s without its token ids (%s); token_ids_dropped=%d",
                        self.cfg.producer_id, item.kind, escaped_id(rid), bad, self.stats.token_ids_dropped)
        return item

    def _keep(self, enc) -> None:
        e = self._replay.add(enc.parts, enc.frames, enc.payload)
        if e.spill is not None:
            self.stats.spilled_msgs += 1
            self.stats.spilled_bytes += e.nbytes

    def _encode_failed(self, kind: str, requests: int, e: Exception) -> None:
        """Count a message the thread could not build; log it, the first 100 and every 1000th (a capture hook lost for
        good under CUDA graphs fails every delta, one every 16 engine steps)."""
        self.stats.encode_errors += 1
        n = self.stats.encode_errors
        if n <= 100 or n % 1000 == 0:
            log.warning("producer %s dropped a %s message of %d request(s) it could not encode (%d so far%s): %s: %s",
                        self.cfg.producer_id, kind, requests, n, "; logged: the first 100, then every 1000th"
                        if n == 100 else "", type(e).__name__, str(e)[:200])

    def _note_lost(self, rid: Any, rng: list, seq: int, why: str | None = None) -> str:
        """Report positions `rng` of request `rid` lost in its finish, and `why` when it was not for lack of room
        ("refused": their rows failed a check and were never sent; "broker_refused": the broker dropped the delta
        that carried them): the finish held after `seq` if it was not sent yet (re-encoded), else the finish still
        to come. Returns what was done, for the log line."""
        if type(rid) is not str:
            return "not a request id"
        for f in self._replay.after(seq):
            kind = f.parts.kind
            if (kind in ("finish", "abort") and f.parts.request_ids[0] == rid) or (
                    kind == "finishes" and rid in f.parts.request_ids):
                if kind == "abort":
                    return "aborted"
                if f.sent_at != 0.0:
                    return "finish already sent"
                frames = list(self._replay.frames(f))
                h = wire.decode_header(frames[0])
                add = ([rng], [rng] if why == "refused" else (), [rng] if why == "broker_refused" else ())
                if kind == "finish":
                    body = lost_body(h.body, *add)
                else:                               # its entry in a `finishes`
                    i = h.key.index(rid)
                    entries = list(h.body["entries"])
                    entries[i] = lost_body(entries[i], *add)
                    body = dict(h.body, entries=entries)
                frames[0] = wire.pack_header(kind, self.cfg.producer_id, self.cfg.epoch, f.seq, h.key, body)
                self._replay.replace_frames(f, frames)
                return "finish re-encoded"
        if rid not in self._late_lost and len(self._late_lost) >= _MAX_LATE_LOST:
            self._late_lost.pop(next(iter(self._late_lost)))
        self._late_lost.setdefault(rid, []).append((rng, why))
        return "reported in its finish"

    # ---- sending ---------------------------------------------------------------------------------------------------

    def control(self, kind: str, now: float) -> list:
        """The frames of a control message (hello, heartbeat, bye); a hello or heartbeat asks for an answer."""
        if kind != "bye":
            self._watch.asked(now)
        body = {"unacked_from": self._replay.first_unacked} if kind != "bye" else {}
        pid = self.cfg.producer_id
        return [wire.pack_header(kind, pid, self.cfg.epoch, 0, pid, body)]

    def tick(self, now: float) -> None:
        """Time passed: the link may let data go again; anything still to send means all was sent at `now` at the
        earliest (a close right after a flush that sent it all must still wait for the broker's first answer, then
        its acks, then say bye)."""
        self.link.move(LinkEvent.TICK, now)
        if self._replay.pending() or self.link.hello_due:
            self._sent_all_at = now

    def hello_sent(self, now: float) -> None:
        self.link.move(LinkEvent.HELLO_SENT, now)

    def next_to_send(self, now: float) -> Entry | None:
        """The next data message to send in seq order, None if none (or the link holds data)."""
        if self.link.data_held(now):
            return None
        return self._replay.next_to_send()

    def frames(self, e: Entry) -> list:
        return self._replay.frames(e)

    def sent(self, e: Entry, now: float) -> None:
        """The socket took message `e`."""
        st = self.stats
        if self._replay.mark_sent(e, now):
            st.sent_msgs += 1
            st.sent_bytes += e.payload
        else:
            st.resent_msgs += 1

    def check(self, now: float) -> None:
        """Resend after an ack timeout; say when the broker is silent."""
        self._check_timeout(now)
        self._check_silence(now)

    # ---- connection events ---------------------------------------------------------------------------------------

    def on_connected(self, now: float) -> None:
        """A handshake succeeded: after a reconnect, say hello and send nothing else until the broker answered
        (its epoch says whether it is the same broker or a new one that needs everything unacknowledged again)."""
        self._connections += 1
        if self._connections > 1:
            self.link.move(LinkEvent.RECONNECTED, now)
            log.info("producer %s reconnected to %s: unacked=%d", self.cfg.producer_id, self.cfg.endpoint,
                     len(self._replay))

    def on_disconnected(self, now: float) -> None:
        # hold data from now on: the next connection may be a new broker, which must hear hello first
        # (set here, long before a reconnect, so no data slips out ahead of the hello)
        self.link.move(LinkEvent.DISCONNECTED, now)
        log.info("producer %s disconnected from %s: unacked=%d", self.cfg.producer_id, self.cfg.endpoint,
                 len(self._replay))

    def on_handshake_failed(self, auth: bool) -> None:
        self._auth_failures += 1
        if self._auth_failures == 1 or self._auth_failures % 100 == 0:
            log.error("producer %s: handshake with %s failed (%s, %d times): wrong broker key, or this "
                      "producer's key is not allowed", self.cfg.producer_id, self.cfg.endpoint,
                      "auth" if auth else "protocol", self._auth_failures)

    def _check_silence(self, now: float) -> None:
        s = self._watch.due(now)
        if s is None:
            return
        r = self._replay
        log.warning("producer %s: no answer from broker %s for %.1fs (report %d; connections=%d "
                    "handshake_failures=%d): unacked=%d msgs unacked_bytes=%d (memory %d + spill %d) bound=%d+%d "
                    "bytes; steps wait in the replay buffer", self.cfg.producer_id, self.cfg.endpoint, s.silent_s,
                    s.reports, self._connections, self._auth_failures, len(r), r.mem_bytes + r.spilled_bytes,
                    r.mem_bytes, r.spilled_bytes, self.cfg.replay_max_bytes, self.cfg.spill_max_bytes)

    def _heard(self, now: float) -> None:
        self.link.move(LinkEvent.HEARD, now)
        a = self._watch.heard(now)
        if a is None:
            return
        if a.first:
            log.info("producer %s: broker answered at %s in %d ms copy=%s", self.cfg.producer_id, self.cfg.endpoint,
                     round(a.after_s * 1000), "native" if NATIVE else "numpy")
        else:
            log.info("producer %s: broker at %s answered again after %.1fs of silence: unacked=%d",
                     self.cfg.producer_id, self.cfg.endpoint, a.after_s, len(self._replay))
    def _acked(self, upto: int, now: float) -> None:
        n = self._replay.ack(upto).msgs
        if n:
            self.stats.acked_msgs += n
            self._last_progress = now
            self._timeout_s = self.cfg.resend_timeout_s
            if self._full_since is not None and self._replay.has_room():
                self.stats.replay_full_s += now - self._full_since
                if self._full_loud:
                    log.info("producer %s replay buffer has room again after %.3fs: unacked=%d",
                             self.cfg.producer_id, now - self._full_since, len(self._replay))
                else:
                    self._full_quiet += 1
                    self._full_quiet_s += now - self._full_since
                self._full_since = None

    def _log_full(self, now: float) -> None:
        r = self._replay
        log.warning("producer %s replay buffer full: unacked=%d replay_bytes=%d spilled_bytes=%d bounds=%d+%d "
                    "episodes=%d (%d not logged since the last line, %.3fs full in them); new steps wait in the "
                    "queue (bound %d bytes) and are dropped beyond it, reported lost", self.cfg.producer_id, len(r),
                    r.mem_bytes, r.spilled_bytes, self.cfg.replay_max_bytes, self.cfg.spill_max_bytes,
                    self.stats.replay_full, self._full_quiet, self._full_quiet_s, self.cfg.max_queue_bytes)
        self._full_logged = now
        self._full_quiet, self._full_quiet_s = 0, 0.0

    def _unbatch(self, kinds: set) -> None:
        """The broker stopped taking `kinds` (`opens`, `finishes`): a broker of an earlier version took the place
        of one that took them. It would refuse such a message as an unknown kind, and refuse it again on every
        rewind, so every held message of those kinds becomes one `open`/`finish` per entry (the same bodies and
        token ids), and every held message is numbered again from the first unacknowledged seq (ReplayBuffer.
        renumber), before anything is sent to that broker (its reply is read before the next send)."""
        def expand(e, frames: list) -> list | None:
            if e.parts.kind not in kinds:
                return None
            h = wire.decode_header(frames[0])
            if e.parts.kind == "opens":
                batch, tokens = wire.parse_opens(h, frames[1:])
                kind = "open"
            else:
                batch, tokens = wire.parse_finishes(h, frames[1:])
                kind = "finish"
            out = []
            for i, rid in enumerate(batch.request_ids):
                head, rest = batch.single(h, tokens, i)
                out.append((Parts(kind, (rid,)), [head, *rest], 0))
            return out

        r = self._replay
        held = len(r)
        n = sum(e.parts.kind in kinds for e in r)
        try:
            added = r.renumber(expand, wire.with_seq)
        except Exception as e:  # noqa: BLE001 -- its own messages: not expected; the buffer is left as it was
            log.error("producer %s: the broker no longer takes %s, and the %d held messages of them could not be "
                      "made single (%s: %s); that broker will refuse them", self.cfg.producer_id,
                      "/".join(sorted(kinds)), n, type(e).__name__, e)
            return
        self.stats.unbatched_msgs += n
        log.warning("producer %s: the broker no longer takes %s (an earlier version took its place): %d held "
                    "messages of them sent as %d single ones; %d held messages numbered again from seq %d",
                    self.cfg.producer_id, "/".join(sorted(kinds)), n, n + added, held + added, r.first_unacked)

    def _rewind(self, why: str, now: float) -> None:
        r = self._replay
        r.rewind()
        self.link.move(LinkEvent.REWIND, now)
        self.stats.rewinds += 1
        self._last_progress = now
        log.info("producer %s rewind why=%s unacked=%d from_seq=%s replay_MB=%.1f spilled_MB=%.1f",
                 self.cfg.producer_id, why, len(r), r.first_unacked if len(r) else "-", r.mem_bytes / 1e6,
                 r.spilled_bytes / 1e6)

    def _on_rewind_request(self, ack: wire.ProducerAck, now: float) -> None:
        if ack.hello:
            self.link.move(LinkEvent.REWIND, now)
        nxt = self._replay.next_to_send()
        if ack.expect is not None and nxt is not None and nxt.seq <= ack.expect and not ack.hello:
            return                  # what goes out next already starts at or before what the broker expects
        self._rewind("broker_asked", now)

    def _on_refusal(self, r: wire.Refusal) -> None:
        """The broker accepted-and-dropped seq r.seq: flag what it carried (lost positions, a refused request)."""
        self.stats.refused_by_broker += 1
        e = self._replay.get(r.seq)
        if e is None:
            log.warning("producer %s: broker refused seq=%d (no longer held here): %s", self.cfg.producer_id, r.seq,
                        r.reason)
            return
        p = e.parts
        if p.kind == "delta":
            done = [self._note_lost(rid, [int(s), int(s) + int(c)], e.seq, "broker_refused")
                    for rid, s, c in zip(p.request_ids, p.starts, p.counts)]
            log.warning("producer %s: broker refused seq=%d kind=delta requests=%d rows=%d (%s): %s",
                        self.cfg.producer_id, r.seq, len(p.request_ids), int(sum(p.counts)),
                        ", ".join(sorted(set(done))) or "nothing to report", r.reason)
        elif p.kind == "open":
            self._book.refuse(p.request_ids[0])
            log.warning("producer %s: broker refused seq=%d kind=open request=%s; its later parts are dropped: %s",
                        self.cfg.producer_id, r.seq, escaped_id(p.request_ids[0]), r.reason)
        elif p.kind == "finishes":
            log.warning("producer %s: broker refused seq=%d kind=finishes requests=%d (the first %s): %s",
                        self.cfg.producer_id, r.seq, len(p.request_ids), escaped_id(p.request_ids[0]), r.reason)
        elif p.kind == "opens":
            for rid in p.request_ids:
                self._book.refuse(rid)
            log.warning("producer %s: broker refused seq=%d kind=opens requests=%d (the first %s); their later parts "
                        "are dropped: %s", self.cfg.producer_id, r.seq, len(p.request_ids),
                        escaped_id(p.request_ids[0]), r.reason)
        else:
            log.warning("producer %s: broker refused seq=%d kind=%s request=%s: %s", self.cfg.producer_id, r.seq,
                        p.kind, escaped_id(p.request_ids[0]), r.reason)

    # ---- replies -------------------------------------------------------------------------------------------------

    def on_reply(self, head: Any, now: float) -> None:
        """One reply from the broker: its header frame (bytes-like), or the MessageTooLarge its receipt raised."""
        self._heard(now)
        try:
            if isinstance(head, MessageTooLarge):
                raise wire.ProtocolError(MessageTooLarge.reason, str(head))
            h = wire.decode_header(head)
            if h.epoch != self._broker_epoch:
                if self._broker_epoch is not None:
                    log.info("producer %s: new broker epoch=%d (was %d)", self.cfg.producer_id, h.epoch,
                             self._broker_epoch)
                    self._broker_epoch = h.epoch
                    self._rewind("new_broker", now)
                self._broker_epoch = h.epoch
                self.stats.broker_epochs += 1
            if h.kind == "heartbeat":
                self._broker_consumers = wire.parse_broker_hello(h) if "consumers" in h.body else None
                takes = wire.parse_takes(h)
                gone = set()                    # kinds the broker took until now and no longer does
                if self.broker_takes_opens and wire.FEATURE_OPENS not in takes:
                    gone.add(wire.FEATURE_OPENS)
                if self.broker_takes_finishes and wire.FEATURE_FINISHES not in takes:
                    gone.add(wire.FEATURE_FINISHES)
                self.broker_takes_opens = wire.FEATURE_OPENS in takes
                self.broker_takes_finishes = wire.FEATURE_FINISHES in takes
                if gone:
                    self._unbatch(gone)
            elif h.kind == "ack":
                if h.body.get("epoch") != self.cfg.epoch:
                    return
                ack = wire.parse_producer_ack(h)
                if ack.owners is not None:
                    self.hints.update(*ack.owners)
                    self.stats.owner_hints += len(ack.owners[0])
                self._acked(ack.upto, now)
                if ack.rewind:
                    self._on_rewind_request(ack, now)
            elif h.kind == "error":
                self.stats.errors_from_broker += 1
                refusal = wire.parse_refusal(h)
                if refusal is None:
                    log.error("producer %s: broker refused a message: %s", self.cfg.producer_id,
                              wire.parse_error(h))
                elif refusal.epoch == self.cfg.epoch:
                    self._on_refusal(refusal)
                else:
                    log.warning("producer %s: broker refused seq=%d of another epoch %d (this one %d): %s",
                                self.cfg.producer_id, refusal.seq, refusal.epoch, self.cfg.epoch, refusal.reason)
        except wire.ProtocolError as e:
            self.stats.bad_replies += 1
            if self.stats.bad_replies == 1 or self.stats.bad_replies % 1000 == 0:
                log.warning("producer %s: bad reply from broker (%d so far): %s", self.cfg.producer_id,
                            self.stats.bad_replies, e)

    def _check_timeout(self, now: float) -> None:
        r = self._replay
        first = r.get(r.first_unacked)
        if first is None or self._broker_epoch is None or self._broker_consumers == 0 or first.sent_at == 0.0:
            return
        if now - max(first.sent_at, self._last_progress) > self._timeout_s:
            self._timeout_s = min(self._timeout_s * 2, 8 * self.cfg.resend_timeout_s)
            self._rewind("ack_timeout", now)

    def closing_done(self, now: float, deadline: float = math.inf) -> bool:
        """Whether the thread may stop: the caller's close() was taken and everything is acked (or needs no ack),
        or `deadline` passed."""
        r = self._replay
        if now >= deadline:
            if len(r) or self._ledger.msgs:
                log.warning("producer %s closing with unacked=%d (never sent %d) queued=%d after the timeout",
                            self.cfg.producer_id, len(r), r.never_sent, self._ledger.msgs)
            return True
        if not self.stopping or r.pending() or self.link.hello_due:
            return False
        if not len(r) or self._broker_consumers == 0:
            return True
        # a peer that has not answered half a second after everything was sent does not speak acks
        return self._broker_epoch is None and now - self._sent_all_at >= 0.5

    def bye_due(self) -> bool:
        """Whether a closing producer says bye: a broker answered and everything was acked."""
        return self._broker_epoch is not None and not len(self._replay)
