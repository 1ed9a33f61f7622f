"""Track the requests one worker captures: open, finish and abort, each request's record key, and the opens and
ends on their way to the producer.

A newly scheduled request is captured unless its sampling params opt out (Settings.captures); its record key is
its engine id without vLLM's suffix (keys.py), a derived key where that cannot travel, and f"{key}#{n}" while
another live request holds the key (two requests in flight never share a record). Opens wait for the next
hand-over of rows (the worker's flush), so they go before the rows that need them, in one producer call;
finishes wait for the batch that holds their request's last rows (`closing`). Nothing here raises into vLLM's
step for one request's sake: a request whose open or finish fails is skipped (stats.skipped); a failure of the
producer itself re-raises.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from routing_replay.engines.vllm_plugin import keys as _keys
from routing_replay.engines.vllm_plugin import scheduler_hooks
from routing_replay.protocol import ids as _ids

log = logging.getLogger("vllm.routing_replay")


def show_id(request_id: str, limit: int = 64) -> str:
    """A request id for a log line: ASCII-escaped (lone surrogates and non-ASCII too), cut to `limit` characters
    of escaped text, with the id's length when cut."""
    text = ascii(request_id)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(request_id)} chars)"


class RequestTracker:
    """Own the map from engine request ids to the record keys of the requests being captured (`tracked`), the
    table the producer's thread resolves raw steps with (`seen`), and the opens and ends not yet sent.

    `flush` (the worker's hand-over of its batch) is called where a request's rows must go before something
    else: an id reused while a batch may still hold its old request, a key reused before its finish went, a
    finish without a scheduler note."""

    def __init__(self, settings, stats, runner=None, *, batch=None, announces: bool = True, randomized: bool = False,
                 producer=None, flush: Callable[[], None] | None = None):
        self.settings = settings
        self.stats = stats                  # the worker's WorkerStats: opened, finished, aborted, skipped, *_keys
        self.runner = runner                # finishes without a scheduler note: V1's own output tokens
        self.batch = batch                  # the worker's StepBatch: do rows wait for a hand-over (batch.parts)
        self.announces = announces          # this stage sends opens and ends (the first pipeline stage)
        self.randomized = randomized        # engine ids carry a random suffix (keys.capture_key)
        self.producer = producer
        self.flush = flush if flush is not None else (lambda: None)
        self.on_refused: Callable[[str, str], None] | None = None   # an open the producer refused: (id, key)
        self.keep_opens = False             # embedded: keep each open to send again if the helper restarts
        self.tracked: dict[str, str] = {}   # engine request id -> record key (the dict is never replaced)
        self.gen = 0                        # bumped on every change of `tracked`
        self._live_keys: set = set()        # the keys of `tracked`, and some of ended requests (unique_key)
        # engine id -> (record key, first forward it is captured in): `tracked` and the requests that ended since
        # the last hand-over, for the producer's thread to resolve steps added raw (StepBatch.add_raw); only
        # added to between hand-overs (never a key taken from under the thread)
        self.seen: dict[str, tuple] = {}
        self.seen_shared = False            # `seen` went out with a batch: a request that ended needs a new one
        self.ended: list = []               # engine ids that ended since `seen` was last cut down
        self.closing: dict = {}             # record key -> (engine id, scheduler note): finishes sent after the
        #                                     batch's hand-over (handed_over); the dict is never replaced
        self.opens: list = []               # (engine id, Producer.open_many item): sent with the next hand-over
        self.ends: list = []                # (engine id, Producer.end_many item): one call per flush / step
        self._open_items: dict = {}         # embedded: engine id -> its open item, sent again by reopen
        self.reopen_due = False             # the embedded helper was restarted (helper_restarted)
        self._reopen_rids: set = set()      # the engine ids captured when it was
        self._warned_no_notes = False

    def end(self, finished_ids, notes) -> None:
        """The requests in `finished_ids` (the step's finished_req_ids) that are captured finish (or abort, as
        `notes`, the scheduler's note per engine id, says; None: no notes came): each finish goes after the batch
        that holds its request's last rows, with the step's others in one producer call."""
        tracked = self.tracked
        batch = self.batch
        if notes is not None and batch.parts:
            # the common step: every captured request that finishes has its note and its last rows in the
            # batch; their finishes wait for it together (C-speed maps, no Python line per request)
            ended = [rid for rid in finished_ids if rid in tracked]
            infos = list(map(notes.get, ended))
            if None not in infos:
                keys = list(map(tracked.pop, ended))
                self.gen += 1
                self.ended += ended
                self.closing.update(zip(keys, zip(ended, infos)))
                ended = ()
        else:
            ended = finished_ids
        for rid in ended:
            key = tracked.pop(rid, None)
            self.gen += 1
            if key is None:
                continue
            self.ended.append(rid)
            info = notes.get(rid) if notes is not None else None
            if info is not None and batch.parts:
                # a request's rows go out before its finish: this one goes right after the batch that holds
                # its last rows (flush), not with a batch cut short here (a publish, and the batch's event,
                # per finish would cost the engine thread several times a step's work)
                self.closing[key] = (rid, info)
            else:
                if batch.parts:         # (no note: the finish is the runner's view now, after the rows)
                    self.flush()
                # an empty batch holds none of its rows: the finish goes with the step's others (one
                # end_many below, not one per finish; the ids leave `seen` at the next hand-over)
                self.close_request(rid, key, info)
        if self.ends:
            self.send_ends()

    def open(self, new, forward: int, prefix_rows: bool, on_prefix: Callable | None = None) -> str | None:
        """Start capturing a newly scheduled request (vLLM's NewRequestData), under its record key, from the
        engine's forward `forward` on; returns the key, or None if it is not captured (opted out, or skipped). A
        request whose id cannot travel is captured under the derived key, one whose capture fails otherwise is
        skipped (WARNING, stats.skipped). Its open waits in self.opens for the next hand-over to the producer
        (send_opens; with a prefix store, for the end of pre_step). `prefix_rows`: its prefix-cached rows will
        come from the prefix store (the open says so); `on_prefix(new, key, prompt, prompt_len)` (with it) queues
        them and returns the references its open names (PrefixRows.opened)."""
        if new.req_id in self.seen:
            self.flush()           # the batch may hold raw steps where this id is a request that ended
        try:
            if not self.settings.captures(new.sampling_params):
                return None
            key, problem = _keys.capture_key(new.req_id, self.randomized)
            key, dup = self.unique_key(key)     # (never a key in `closing`: is_live counts those)
            prompt = new.prompt_token_ids              # None for prompt embeddings: no token ids to carry
            prompt_len = len(prompt) if prompt is not None else int(new.prompt_embeds.shape[0])
            refs = on_prefix(new, key, prompt, prompt_len) if on_prefix is not None else ()
            if self.announces:
                item = (key, prompt_len, int(new.num_computed_tokens), prompt, prefix_rows)
                if refs:
                    item += (refs,)
                self.opens.append((new.req_id, item))
                if self.keep_opens:
                    self._keep_open(new.req_id, item)
        except Exception as e:          # noqa: BLE001 -- one request's problem; engine-wide ones re-raise
            self.skip(new.req_id, "open", e)
            return None
        self.tracked[new.req_id] = key
        self.seen[new.req_id] = (key, forward)
        self.gen += 1
        live = self._live_keys
        live.add(key)
        if len(live) > 2 * len(self.tracked) + 64:
            self._live_keys = set(self.tracked.values())
        if dup is not None:
            self.stats.duplicate_keys += 1
            log.warning("routing-replay: request %s has the record key %s of a request still being captured; "
                        "captured as %s (duplicate_keys=%d)", show_id(new.req_id), show_id(dup), show_id(key),
                        self.stats.duplicate_keys)
        if problem is not None:
            self.stats.derived_keys += 1
            log.warning("routing-replay: request %s cannot be a record key (%s); captured as %s "
                        "(derived_keys=%d)", show_id(_keys.external_key(new.req_id, self.randomized)), problem,
                        key, self.stats.derived_keys)
        return key

    def _keep_open(self, rid: str, item: tuple) -> None:
        """Keep a request's open (embedded mode) to send again if the helper process dies (_reopen). Entries of
        requests that ended are pruned when the table holds twice the tracked requests (amortised O(1))."""
        kept = self._open_items
        kept[rid] = item
        if len(kept) > 2 * len(self.tracked) + 64:
            tracked = self.tracked
            self._open_items = {r: it for r, it in kept.items() if r in tracked or r == rid}

    def helper_restarted(self) -> None:
        """The embedded helper was started again (its watch thread calls this): the opens of the requests captured
        now go again with the next hand-over, those that are still captured then (_reopen, on the engine thread;
        the ids copied here in one C call under the GIL)."""
        self._reopen_rids = set(self.tracked)
        self.reopen_due = True

    def reopen(self) -> None:
        """Send the opens of the requests being captured again: the new helper's consumer knew none of them, so
        their records get their prompt length and tokens (and come out incomplete: the rows the dead helper held
        are listed missing). A request whose open is still queued is left to that one."""
        self.reopen_due = False
        queued = {rid for rid, _ in self.opens}
        then, self._reopen_rids = self._reopen_rids, set()
        items = [(rid, it) for rid, it in self._open_items.items()
                 if rid in then and rid not in queued and self.tracked.get(rid) == it[0]]
        self.opens += items
        log.warning("routing-replay: opens of %d requests in flight sent again to the restarted helper",
                    len(items))

    def unique_key(self, key: str) -> tuple[str, str | None]:
        """(key, None) if no live request has `key`; else (the first free f"{key}#{n}", key). Live: opened here
        and its finish not yet handed to the producer (`tracked`, `_closing`), so two requests in flight never
        share a record key (their rows would mix in one record) and a key's finish always precedes its reuse.
        `_live_keys` holds every tracked key and keys of requests that ended since it was last rebuilt: a key
        found there is checked against `tracked` itself (a scan, for a suspected duplicate only), so an open
        costs two set lookups; the set is rebuilt once it holds twice the tracked requests (amortised O(1))."""
        if not self.is_live(key):
            return key, None
        n = 1
        while self.is_live(cand := _ids.duplicate_key(key, n)):
            n += 1
        return cand, key

    def is_live(self, key: str) -> bool:
        return key in self.closing or (key in self._live_keys and key in self.tracked.values())

    def send_opens(self) -> set | None:
        """The opens since the last hand-over in one producer call, ahead of anything that carries their rows or
        finishes (the worker's flush, send_ends, _failed_end): not one call per step. A request whose open fails is not
        captured from then on (as open); the rows of it that the batch already holds do not go out
        (the producer screens the id, or the batch leaves it out: take_parts). Returns the keys that failed."""
        opens, self.opens = self.opens, []
        try:
            # (prompt lists by reference: vLLM never modifies a request's prompt_token_ids)
            failed = self.producer.open_many([item for _, item in opens], ids_checked=True, tokens_frozen=True)
        except Exception as e:          # noqa: BLE001 -- engine-wide (the producer failed) re-raises in _skip
            failed = [(i, e) for i in range(len(opens))]
        self.stats.opened += len(opens) - len(failed)
        for i, e in failed:
            rid = opens[i][0]
            if self.tracked.pop(rid, None) is not None:
                self.gen += 1
            if rid in self.seen:       # raw steps of the batch then leave its rows out (no key for the id)
                if self.seen_shared:   # (a handed-over batch's table: copied first, as cut_seen does)
                    self.seen = self.seen.copy()
                    self.seen_shared = False
                del self.seen[rid]
            if self.on_refused is not None:     # (fill: sent in the step it opened, before its prefix rows
                self.on_refused(rid, opens[i][1][0])    # are queued)
            self.skip(rid, "open", e)
        return {opens[i][1][0] for i, _ in failed} or None

    def skip(self, rid: str, what: str, error: Exception) -> None:
        """Log and count a per-request failure; re-raise it if the producer itself failed (engine-wide)."""
        p = self.producer
        # The producer's own failure (its thread died: a bug there; a delta it cannot resolve or encode is dropped,
        # and it goes on) or a closed producer fails every request alike: that stops the engine as before.
        if p is not None and not p.healthy:
            raise error
        self.stats.skipped += 1
        log.warning("routing-replay: %s of request %s failed, its routing is not captured: %s: %s (skipped=%d)",
                    what, show_id(rid), type(error).__name__, str(error)[:200], self.stats.skipped)

    def close_request(self, rid: str, key: str, info) -> None:
        """The request's finish (or abort) into self.ends, sent with the others of this flush or step
        (send_ends); `info` is the scheduler's note of it, None when none came."""
        try:
            end = self.end_of(rid, key, info)
        except Exception as e:          # noqa: BLE001 -- one request's problem; engine-wide ones re-raise
            self._failed_end(rid, key, e)
            return
        if end is not None and self.announces:
            self.ends.append((rid, end))

    def _failed_end(self, rid: str, key: str, e: Exception) -> None:
        self.skip(rid, "finish", e)
        if self.announces:
            if self.opens:     # (the request may have opened since the last hand-over: its open goes first)
                self.send_opens()
            try:                    # the consumer would otherwise wait request_timeout_s for the finish
                self.producer.abort(key, "capture_error")
            except Exception as e2:  # noqa: BLE001
                log.warning("routing-replay: abort of %s after a failed finish failed too: %s", show_id(key), e2)

    def end_of(self, rid: str, key: str, info) -> tuple | None:
        """(kind, key, num_output, reason, output ids) for Producer.end_many."""
        if info is None:
            # The scheduler hook did not see this request finish (a scheduler class that does not derive from
            # vLLM's Scheduler, or settings that differ between processes): use the worker's own view.
            if not self._warned_no_notes:
                log.warning("routing-replay: no finish notes from the scheduler for %r; using the worker's "
                            "output count (may be one token long under async scheduling)", key)
                self._warned_no_notes = True
            requests = getattr(self.runner, "requests", None)      # V1 only: V2 keeps output tokens on the device
            st = requests.get(rid) if requests is not None else None
            if st is None:
                log.warning("routing-replay: request %s finished without finish notes from the scheduler and the "
                            "runner keeps no output tokens for it; its record is aborted (capture_error)",
                            show_id(rid))
                return ("abort", key, None, "capture_error", None)
            out = list(st.output_token_ids)
            info = scheduler_hooks.Finished(len(out), "unknown", out)
        if info.num_output_tokens == 0 and info.reason == "abort":
            return ("abort", key, 0, "abort", None)
        return ("finish", key, info.num_output_tokens, info.reason, info.output_token_ids)

    def send_ends(self) -> None:
        """The finishes and aborts collected since the last call, in one producer call."""
        if self.opens:                     # (a request that opened since the last hand-over ends: open first)
            self.send_opens()
        ends, self.ends = self.ends, []
        try:
            # (output ids by reference: the scheduler hook's own list, or _end_of's)
            self.producer.end_many([end for _, end in ends], tokens_frozen=True)
        except Exception as e:          # noqa: BLE001 -- engine-wide (the producer failed) re-raises in _skip
            for rid, end in ends:
                self._failed_end(rid, end[1], e)
            return
        finished = [end[0] for _, end in ends].count("finish")
        self.stats.finished += finished
        self.stats.aborted += len(ends) - finished


    def handed_over(self) -> None:
        """After a batch went to the producer (the batch is empty): the ended requests leave `seen`, and the
        finishes that waited for the batch (`closing`) go, with the others collected, in one producer call."""
        if self.ended:                      # requests ended since: out of the table (no step holds them now)
            self.cut_seen()
        if self.closing:                    # finishes that waited for this batch (end)
            closing = dict(self.closing)    # (the dict itself stays: the worker checks it every step)
            self.closing.clear()
            if self.announces:              # (each with its scheduler note: their items in one comprehension)
                try:
                    self.ends += [(rid, self.end_of(rid, key, info)) for key, (rid, info) in closing.items()]
                    closing = {}
                except Exception:       # noqa: BLE001 -- a note not as the hook makes it: one by one, as before
                    pass
            for key, (rid, info) in closing.items():
                self.close_request(rid, key, info)
        if self.ends:
            self.send_ends()

    def cut_seen(self) -> None:
        """Take the requests that ended out of _seen (after a hand-over: the batch is empty); a table a batch took
        with it is copied first (C speed), so the producer's thread still finds every id of that batch."""
        ended, self.ended = self.ended, []
        seen, tracked = self.seen, self.tracked
        if self.seen_shared:
            seen = self.seen = seen.copy()
            self.seen_shared = False
        for rid in ended:
            if rid not in tracked:          # (not an id opened again since)
                seen.pop(rid, None)
