"""Publish per-step routing deltas as wire-v1 messages from a background thread; the caller never blocks."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import numpy as np
import zmq

from routing_replay.protocol import checks, security, wire
from routing_replay.protocol.ids import default_peer_id
from routing_replay.producer.books import RequestBook, escaped_id
from routing_replay.producer.coalesce import StepParts
from routing_replay.producer.config import ProducerConfig
from routing_replay.producer.encode import Geometry
from routing_replay.producer.handover import deferred_rows, release
from routing_replay.producer.inbox import STOP, Inbox, QueueLedger
from routing_replay.producer.intake import SenderSettings
from routing_replay.producer.items import Announce, Announces, Step, flat_ids, flat_ints
from routing_replay.producer.resend import ReplayBuffer, Spill
from routing_replay.producer.sender import Sender

log = logging.getLogger("routing_replay.producer")


@dataclass
class ProducerStats:
    sent_msgs: int = 0          # data messages sent (first time)
    sent_bytes: int = 0         # their payload bytes
    queued_msgs: int = 0
    queued_bytes: int = 0
    dropped_msgs: int = 0       # steps refused by the queue bound (their positions are reported lost)
    dropped_rows: int = 0
    errors_from_broker: int = 0
    acked_msgs: int = 0         # data messages the broker acknowledged (applied by every consumer they went to)
    resent_msgs: int = 0        # sends of a message that had been sent before (after a rewind)
    rewinds: int = 0            # times the producer went back to its first unacknowledged message
    spilled_msgs: int = 0       # messages whose replay copy went to the spill file
    spilled_bytes: int = 0
    replay_full: int = 0        # episodes where the replay buffer (memory and spill) was full
    replay_full_s: float = 0.0  # seconds those episodes lasted (ended ones): the time the window held steps back
    broker_epochs: int = 0      # broker incarnations seen
    bad_replies: int = 0
    dropped_parts: int = 0      # request parts (delta part, finish, abort) of an id that cannot travel or was refused
    encode_errors: int = 0      # messages the thread could not encode (dropped; a delta's positions reported lost)
    token_ids_dropped: int = 0  # opens/finishes sent without their token ids: a list that was not int32 integers
    refused_by_broker: int = 0  # data messages the broker accepted-and-dropped as undecodable (error refused_seq)
    owner_hints: int = 0        # request -> owner group hints received (the broker's acks; messages.OwnerHints)
    merged_steps: int = 0       # publish_rows steps that queued up and went out merged (messages.merge_coalesced_steps)
    split_steps: int = 0        # steps too large for one delta, sent as several (messages.split_step)
    opens_msgs: int = 0         # `opens` messages: several requests' opens in one (open_many, or open() calls
                                # queued one behind the other), when the broker takes them
    finishes_msgs: int = 0      # `finishes` messages: the same for finishes (end_many, or finish() calls)
    unbatched_msgs: int = 0     # held `opens`/`finishes` sent again as one `open`/`finish` each: the broker was
                                # replaced by one that does not take them (a downgrade; Intake._unbatch)


def _positions(values: Any, name: str) -> Any:
    """publish_rows' starts/counts: a 1-D numpy integer array becomes a list of ints; anything else is kept."""
    if isinstance(values, np.ndarray):
        _check_array(values, name)
        return values.tolist()
    return values


def _tokens(ids: Any, frozen: bool = False) -> Any:
    """Token ids on the caller's thread: a list or tuple is only copied (a tuple, at C speed: far cheaper than
    converting them), the producer's thread converts it (messages.token_frames); anything else becomes an int32
    array here. `frozen`: the caller never modifies its lists afterwards, so a list goes by reference (no copy: the
    copy writes every id's reference count, one cache line per cold id, a cost that grows with the prompt)."""
    if type(ids) is list:
        return ids if frozen else tuple(ids)
    if type(ids) is tuple:
        return ids
    return np.ascontiguousarray(ids, dtype=wire.TOKEN_DTYPE)


def _token_frames(body: dict, count_key: str, ids: Any, frozen: bool = False) -> list:
    """An announce's token-id frame (_tokens), its count put in body[count_key]; none for ids None. `frozen`: as
    _tokens' (on the producer's thread: ids that already went through _tokens on the caller's)."""
    if ids is None:
        return []
    toks = _tokens(ids, frozen)
    body[count_key] = len(toks)
    return [toks]


def _id_error(request_id: Any) -> wire.ProtocolError | None:
    """open's error for an id that cannot travel (None if it can)."""
    problem = wire.request_id_problem(request_id)
    return None if problem is None else wire.ProtocolError("bad_request_id", f"{problem}: {escaped_id(request_id)}")


def _check_array(values: np.ndarray, name: str) -> None:
    if values.ndim != 1 or values.dtype.kind not in "iu":
        raise ValueError(f"{name} must be a 1-D integer array, got shape {values.shape} dtype {values.dtype}")


def default_producer_id() -> str:
    return default_peer_id("producer")


class Producer:
    """Own one DEALER socket (in a background thread) that carries this engine rank's routing to a broker.

    Thread model: `open`, `publish`, `publish_rows`, `finish`, `abort` only enqueue (no network, no encoding,
    no waiting); the background thread encodes, waits for deferred rows (`result()`), numbers the messages
    (seq 1, 2, 3, ...), keeps each one in the replay buffer, sends, and drops it once the broker acks it.
    Steps wake the thread; opens, finishes and aborts keep their place in the queue without waking it and go with
    the next step, `flush()`, `wait_acked()` or `close()`, or within 50 ms (`Inbox`).

    Delivery (wire.py "Delivery", docs/RELIABILITY.md): at least once. Unacknowledged messages are resent, in
    seq order from the first unacknowledged one, when the broker asks (`rewind`), when a new broker incarnation
    answers, or when no ack came for `resend_timeout_ms` (doubling while nothing is acked, up to 8x). While the
    broker is unreachable nothing is queued in ZeroMQ (ZMQ_IMMEDIATE): messages wait in the replay buffer.

    Bounds: the caller's queue holds at most `max_queue_bytes` of rows not yet taken by the thread; the replay
    buffer holds at most `replay_max_bytes` in memory and, with `spill_dir`, `spill_max_bytes` more in a local
    file. When both are full the thread stops taking steps from the queue (logged once per episode, counted in
    `stats.replay_full`), so the queue fills and further steps are dropped at once (the engine never stalls),
    counted in `stats.dropped_msgs/dropped_rows`; the positions they carried are reported as lost in that
    request's `finish`, so the consumer marks the record incomplete (reason "producer_queue_full") instead of
    emitting a wrong one. open/finish/abort are never dropped.

    Rows are handed over: after `publish_rows(..., rows)` the caller must not modify `rows` (it is kept until
    acked). `rows` may also be a deferred object with `result() -> np.ndarray` (called in the background thread)
    and optionally `release()` (called once its bytes were copied, or when it is dropped). A deferred object with
    `dropped=True` (capture's host ring was full) is counted and reported lost the same way, never waited on.

    Expert ids: the caller hands int16 rows (-1: never computed); they travel as `id_dtype` (uint8 for at most
    255 experts, uint16 above: pass `num_experts` or `id_dtype`; neither: int16), narrowed once on the background
    thread when the delta is encoded. A step with an id that does not fit is refused (its positions reported lost
    and refused in the finish), as rows that fail the other checks are.

    Coalescing: steps that wait in the queue together when the thread takes them (it fell behind the caller)
    leave as one delta message of up to `coalesce_max_bytes` (16 MiB) of rows and 64 steps; the thread never
    waits for more, so a step that finds the queue empty goes alone (no added latency). The broker and consumers
    then pay their per-message costs once per batch. `coalesce_max_bytes=0`: one message per publish call.

    Security: with `curve_secret` (this producer's NAME.key_secret) and `server_key` (the broker's NAME.key) the
    connection is CURVE-encrypted and the broker is authenticated (protocol/security.py).

    Bad input never stops the thread: `open` of an id that cannot travel raises wire.ProtocolError
    ("bad_request_id") to the caller; parts (deltas, finish, abort) of such an id, or of a request whose open
    failed or that the broker refused, are dropped and counted (`stats.dropped_parts`); a message that fails to
    encode in the thread is dropped, counted (`stats.encode_errors`) and logged, and the thread goes on. When the
    broker accepts-and-drops an undecodable message (`error` with `refused_seq`), a refused delta's positions are
    reported lost in each request's finish and a refused open makes its request refused.

    Broker silence is said: a hello or heartbeat not answered within `silence_warn_after_ms` logs a WARNING with
    the unacknowledged count and bytes and the bound, repeated every `silence_warn_every_ms` while it lasts; the
    first answer logs one INFO line with the time it took.
    """

    def __init__(self, endpoint: str | None = None, *, config: ProducerConfig | None = None,
                 context: zmq.Context | None = None, **settings):
        """`config`, or the endpoint and keyword arguments that build one (ProducerConfig's fields: num_layers and
        top_k at least); with both, the arguments replace the config's fields. `context`: a ZeroMQ context to
        share (default: one of its own, terminated by close())."""
        if endpoint is not None:
            settings["endpoint"] = endpoint
        self.config = cfg = checks.resolved_config(ProducerConfig, config, settings)
        num_layers, top_k = cfg.num_layers, cfg.top_k
        self.endpoint = endpoint = cfg.endpoint
        self.num_layers = num_layers
        self.top_k = top_k
        self.moe_layer_ids = list(range(num_layers)) if cfg.moe_layer_ids is None else [int(x) for x in
                                                                                         cfg.moe_layer_ids]
        lo, hi = cfg.layer_range if cfg.layer_range is not None else (0, num_layers)
        self.layer_lo, self.layer_hi = lo, hi
        # rows travel as id_dtype (given, or wire.id_dtype(num_experts); neither: int16): the caller hands int16
        # rows (-1 never computed), narrowed once on the producer's thread when a delta is encoded
        self.id_dtype = (wire.as_id_dtype(cfg.id_dtype) if cfg.id_dtype is not None
                         else wire.id_dtype(cfg.num_experts))
        self._geometry = Geometry(num_layers, top_k, lo, hi, self.id_dtype)
        self.row_shape = (hi - lo, top_k)
        self.row_bytes = (hi - lo) * top_k * 2          # the queue counts the caller's int16 rows
        self.producer_id = cfg.producer_id or default_producer_id()
        self.epoch = time.time_ns() // 1_000_000
        self.max_queue_bytes = cfg.max_queue_bytes
        self.replay_max_bytes = cfg.replay_max_bytes
        self.spill_max_bytes = cfg.spill_max_bytes if cfg.spill_dir is not None else 0
        self.resend_timeout_s = cfg.resend_timeout_ms / 1000
        self.heartbeat_interval_s = cfg.heartbeat_interval_ms / 1000
        self.silence_warn_after_s = cfg.silence_warn_after_ms / 1000
        self.silence_warn_every_s = cfg.silence_warn_every_ms / 1000
        self.linger_ms = cfg.linger_ms
        self.curve_secret, self.server_key = cfg.curve_secret, cfg.server_key
        if cfg.curve_secret is not None:
            security.load_secret(cfg.curve_secret)            # fail here, in the caller, on a bad key file
            security.load_public(cfg.server_key)
        self.stats = ProducerStats()
        self._q = Inbox()
        self._book = RequestBook()
        self._screened: tuple = (None, -1)      # publish_steps: the last id list that passed, book.refusals then
        self._lock = self._book.lock
        self._ledger = QueueLedger(self._lock)
        self._closed = False
        self._replay = ReplayBuffer(cfg.replay_max_bytes, Spill(cfg.spill_dir, self.producer_id)
                                    if cfg.spill_dir is not None else None, self.spill_max_bytes)
        # An own context by default: its term() in close() is what makes linger wait for queued messages to
        # reach the wire (socket.close() alone returns at once, and a process that exits then loses them).
        self._own_ctx = context is None
        self._ctx = context or zmq.Context(io_threads=1)
        self._sender = Sender(SenderSettings(
            endpoint, self.producer_id, self.epoch, self._geometry, self.row_bytes, self.heartbeat_interval_s,
            self.resend_timeout_s, self.silence_warn_after_s, self.silence_warn_every_s, cfg.linger_ms, cfg.sndhwm,
            cfg.curve_secret, cfg.server_key, cfg.replay_max_bytes, self.spill_max_bytes, cfg.max_queue_bytes,
            cfg.coalesce_max_bytes), self._ctx, self._q, self._ledger, self._book, self._replay, self.stats)
        self._thread = self._sender.thread
        self._sender.start()
        self._check()

    @property
    def failure(self) -> BaseException | None:
        """What ended the producer's thread, or None while it has not failed."""
        return self._sender.failure

    @property
    def healthy(self) -> bool:
        """False once the producer cannot take anything more: its thread failed, or it was closed. A per-request
        problem (a bad id, a refused message) never makes it unhealthy."""
        return self._sender.failure is None and not self._closed

    # ---- caller side -----------------------------------------------------------------------------------------

    def _check(self) -> None:
        if self.failure is not None:
            raise RuntimeError(f"routing-replay producer thread failed: {self.failure}") from self.failure
        if self._closed:
            raise RuntimeError("producer is closed")

    def _put(self, item: Announce | Step, nbytes: int, droppable: bool) -> bool:
        # steps wake the thread; opens, finishes and aborts (never droppable) ride with the next one (Inbox)
        if not self._ledger.put(nbytes, self.max_queue_bytes if droppable else None):
            return False
        self._q.put(item, droppable)
        return True

    def _put_many(self, item: Announces) -> None:
        # opens / finishes / aborts of one call: one queue item, counted as len(items) messages
        self._ledger.put(0, None, len(item.items))
        self._q.put(item, False)

    def _drop_parts(self, what: str, request_id: Any, n: int = 1) -> None:
        with self._lock:
            self.stats.dropped_parts += n
            total = self.stats.dropped_parts
        if total == n or total // 1000 != (total - n) // 1000:
            log.warning("producer %s dropped %s of request %s (%s); dropped_parts=%d", self.producer_id, what,
                        escaped_id(request_id), self._book.problem(request_id) or "refused", total)

    def open(self, request_id: str, *, prompt_len: int, num_cached_tokens: int = 0,
             prompt_token_ids: Sequence[int] | np.ndarray | None = None, prefix_filled: bool = False,
             prefix_refs: Sequence[tuple] = ()) -> None:
        """Announce a request: its prompt length and how many leading prompt tokens were prefix-cache hits.
        prefix_filled: rows [0, num_cached_tokens) will be published too (from the engine's prefix store), so
        the consumer expects them instead of writing -1 there. prefix_refs (with prefix_filled): (writer,
        writer_pos, pos, count) runs of those rows that are an earlier request's rows and are not published
        (wire.parse_prefix_refs; checked here, a bad one raises ProtocolError).

        Raises wire.ProtocolError("bad_request_id") for an id that cannot travel; that id's later parts are
        dropped and counted, as are those of a request whose open raised anything else.
        """
        self._check()
        try:
            item = self._open_item(request_id, prompt_len, num_cached_tokens, prompt_token_ids, prefix_filled,
                                   prefix_refs=prefix_refs)
        except wire.ProtocolError:
            raise
        except BaseException:
            self._book.refuse(request_id)
            raise
        self._book.opened(request_id)
        self._put(item, 0, False)

    def open_many(self, opens: Sequence[tuple], ids_checked: bool = False,
                  tokens_frozen: bool = False) -> list[tuple[int, Exception]]:
        """`open` for several requests in one call: one lock and one queue item for all of them, their messages
        built on the producer's thread (an engine hands over a step's new requests so), as one `opens` message
        when the broker takes it (opens queued one behind the other by `open` go so too).

        Each item is (request_id, prompt_len, num_cached_tokens, prompt_token_ids or None, prefix_filled) with int
        lengths (a sixth element, when present: its prefix_refs, as open() takes them). `ids_checked`: the caller has
        already checked each id with wire.request_id_problem (the thread checks it again: an id that cannot travel is
        then refused, logged and counted in stats.encode_errors). `tokens_frozen`: the caller never modifies the token
        id lists it passes (an engine's prompt lists): they go to the producer's thread by reference, not copied.
        Returns (index, exception) for each item open() would have raised for; nothing is announced for those (their ids
        are refused as open() refuses them). The others are announced, in order."""
        self._check()
        if ids_checked and tokens_frozen and opens:
            # an engine's own items (the vLLM worker's): checked in one pass, taken as they are when all are sound
            if not any(type(p) is not int or type(c) is not int or not 0 <= c <= p
                       or (t is not None and type(t) is not list) for _, p, c, t, *_ in opens):
                ok = list(opens)
                self._book.opened_many([item[0] for item in ok])
                self._put_many(Announces(self._open_items, ok))
                return []
        ok, ids, failed = [], [], []
        for i, item in enumerate(opens):
            rid, prompt_len, num_cached, tokens, filled, *refs = item
            bad = None if ids_checked else _id_error(rid)
            if bad is not None:
                failed.append((i, bad))
            elif type(prompt_len) is not int or type(num_cached) is not int or not 0 <= num_cached <= prompt_len:
                self._book.refuse(rid)
                failed.append((i, ValueError(f"num_cached_tokens={num_cached!r} outside [0, prompt_len="
                                             f"{prompt_len!r}] (ints)")))
            else:
                if tokens is not None:                  # as open(): a list copied (unless frozen), an array int32
                    try:
                        tokens = _tokens(tokens, tokens_frozen)
                    except Exception as e:  # noqa: BLE001 -- this item's problem, returned
                        self._book.refuse(rid)
                        failed.append((i, e))
                        continue
                ok.append((rid, prompt_len, num_cached, tokens, filled, *refs))
                ids.append(rid)
        if ok:
            self._book.opened_many(ids)
            self._put_many(Announces(self._open_items, ok))
        return failed

    def _open_items(self, items: list) -> list:
        """open_many's items as Announce (the producer's thread)."""
        out = []
        for rid, prompt_len, num_cached, tokens, filled, *refs in items:
            try:
                out.append(self._open_item(rid, prompt_len, num_cached, tokens, filled, frozen=True,
                                           prefix_refs=refs[0] if refs else ()))
            except Exception as e:  # noqa: BLE001 -- an id passed as checked that cannot travel: it alone
                self._book.refuse(rid)
                self._build_failed("open", rid, e)
        return out

    def _open_item(self, request_id: str, prompt_len: int, num_cached_tokens: int, prompt_token_ids: Any,
                   prefix_filled: bool, frozen: bool = False, prefix_refs: Sequence[tuple] = ()) -> Announce:
        bad = _id_error(request_id)
        if bad is not None:
            raise bad
        if not 0 <= num_cached_tokens <= prompt_len:
            raise ValueError(f"num_cached_tokens={num_cached_tokens} outside [0, prompt_len={prompt_len}]")
        body = {"prompt_len": int(prompt_len), "num_cached": int(num_cached_tokens),
                "num_layers": self.num_layers, "top_k": self.top_k, "layer_ids": self.moe_layer_ids}
        if prefix_filled:
            body["prefix_filled"] = True
        if prefix_refs:
            refs = [[w, int(wp), int(pos), int(n)] for w, wp, pos, n in prefix_refs]
            if not prefix_filled:
                raise ValueError(f"prefix_refs of {request_id[:64]!r} without prefix_filled")
            wire.parse_prefix_refs(refs, num_cached_tokens, request_id)
            body["prefix_refs"] = refs
        if self.id_dtype != wire.ROW_DTYPE:
            body["ids"] = wire.ids_code(self.id_dtype)
        return Announce("open", request_id, body, _token_frames(body, "n_prompt_tokens", prompt_token_ids, frozen))

    def publish(self, step: Iterable[tuple[str, int, np.ndarray]]) -> bool:
        """Publish one engine step given as (request_id, start_position, rows (n, L, K) int16) tuples.

        Concatenates the rows (one copy); engine adapters holding one contiguous buffer use publish_rows.
        """
        ids, starts, counts, parts = [], [], [], []
        for rid, start, rows in step:
            rows = np.asarray(rows)
            ids.append(rid)
            starts.append(int(start))
            counts.append(rows.shape[0] if rows.ndim == 3 else -1)
            parts.append(rows)
        if not ids:
            return True
        for p in parts:
            self._check_rows_shape(p.shape, p.dtype)
        payload = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)
        return self.publish_rows(ids, starts, counts, np.ascontiguousarray(payload))

    def _check_rows_shape(self, shape, dtype) -> None:
        if len(shape) != 3 or tuple(shape[1:]) != self.row_shape or np.dtype(dtype) != wire.ROW_DTYPE:
            raise ValueError(f"rows must be (n, {self.row_shape[0]}, {self.row_shape[1]}) int16, "
                             f"got {tuple(shape)} {np.dtype(dtype)}")

    def publish_rows(self, request_ids: Sequence[str], starts: Sequence[int], counts: Sequence[int],
                     rows: Any) -> bool:
        """Publish one engine step: request_ids[i] gets counts[i] rows at positions starts[i]...

        `rows` is (sum(counts), L, K) int16 in request order, an ndarray or a deferred object (see class doc).
        `starts` and `counts` are sequences of ints or 1-D numpy integer arrays.
        Returns False when the step was dropped by the queue bound (the loss is reported downstream). The parts
        of ids that cannot travel or were refused are dropped and counted (stats.dropped_parts).
        """
        self._check()
        starts, counts = _positions(starts, "starts"), _positions(counts, "counts")
        if not (len(request_ids) == len(starts) == len(counts)):
            raise ValueError(f"{len(request_ids)} request ids, {len(starts)} starts, {len(counts)} counts")
        total = sum(counts)
        if not isinstance(rows, np.ndarray):
            rows = deferred_rows(rows)          # TypeError naming what a caller's object lacks
        self._check_rows_shape(rows.shape, rows.dtype)
        if rows.shape[0] != total:
            raise ValueError(f"rows has {rows.shape[0]} rows, counts add up to {total}")
        screen = self._book.screen(request_ids)
        keep = screen.keep
        if keep is not None:
            bad = next(rid for rid, k in zip(request_ids, keep) if not k)
            self._drop_parts(f"{screen.dropped} delta part(s)", bad, screen.dropped)
            if not any(keep):
                release(rows)
                return True
            total = sum(c for c, k in zip(counts, keep) if k)
        nbytes = total * self.row_bytes
        item = Step(list(request_ids), list(starts), list(counts), rows, keep)
        if (isinstance(rows, np.ndarray) or not rows.dropped) and self._put(item, nbytes, True):
            return True
        self._step_dropped(request_ids, starts, counts, rows, keep, total)
        return False

    def publish_steps(self, request_ids: Sequence[Sequence[str]], starts: Sequence, counts: Sequence,
                      rows: Any, *, checked: bool = False) -> bool:
        """Publish consecutive steps as one: per step, its request ids, starts and counts as publish_rows takes
        them (starts/counts: lists or 1-D integer arrays), `rows` all their rows in order (ndarray or deferred).
        Only references go to the producer's thread, which flattens them; ids are screened once per distinct id
        list (decode steps that share one list cost one screen; the same list as the last call's, with no id
        refused since, none). The lists and arrays must not be modified afterwards. Same result as publish_rows
        of the flattened lists (which it falls back to when an id cannot travel or was refused).

        checked=True: the caller built the per-step lists and arrays itself and vouches for their lengths and
        types (an engine's own batches): the per-step checks are skipped. The ids are still screened.

        With checked=True, `rows` may be `deferred` (DeferredRows, producer/handover.py: the ids are the engine's
        own): its `resolve(request_ids, starts, counts)` gives the steps' record ids, starts and counts on the
        producer's thread, and may leave rows out (`rows.shape` shrinks). Those ids are not screened here; the
        thread drops the parts of refused ids."""
        self._check()
        if not isinstance(rows, np.ndarray):
            rows = deferred_rows(rows)          # TypeError naming what a caller's object lacks
        if not (len(request_ids) == len(starts) == len(counts)) or not request_ids:
            raise ValueError(f"{len(request_ids)} id lists, {len(starts)} starts, {len(counts)} counts (one per "
                             "step, at least one step)")
        if checked:
            return self._publish_parts(request_ids, starts, counts, rows, rows.shape[0])
        total = 0
        sums: dict = {}             # decode steps of one layout share their counts array: checked and summed once
        for ids, st, cn in zip(request_ids, starts, counts):
            n = sums.get(id(cn))
            if n is None:
                if isinstance(cn, np.ndarray):
                    _check_array(cn, "counts")
                    n = int(cn.sum())
                else:
                    n = sum(cn)
                sums[id(cn)] = n
            if isinstance(st, np.ndarray):
                _check_array(st, "starts")
            if not (len(ids) == len(st) == len(cn)):
                raise ValueError(f"a step of {len(ids)} request ids, {len(st)} starts, {len(cn)} counts")
            total += n
        self._check_rows_shape(rows.shape, rows.dtype)
        if rows.shape[0] != total:
            raise ValueError(f"rows has {rows.shape[0]} rows, counts add up to {total}")
        return self._publish_parts(request_ids, starts, counts, rows, total)

    def _publish_parts(self, request_ids: Sequence, starts: Sequence, counts: Sequence, rows: Any,
                       total: int) -> bool:
        if not isinstance(rows, np.ndarray) and rows.deferred:
            return self._publish_deferred(request_ids, starts, counts, rows, total)
        book = self._book
        last, refusals = self._screened
        for ids in {id(x): x for x in request_ids}.values():
            if ids is last and refusals == book.refusals:
                continue
            seen = book.refusals            # read before the screen: a refusal during it is not missed
            if book.screen(ids).keep is not None:     # some id cannot travel: the per-entry path says which
                return self.publish_rows(flat_ids(request_ids), flat_ints(starts), flat_ints(counts), rows)
            self._screened = (ids, seen)
        item = StepParts(list(request_ids), list(starts), list(counts), rows)
        if (isinstance(rows, np.ndarray) or not rows.dropped) and self._put(item, self._queued_bytes(rows, total),
                                                                              True):
            return True
        self._step_dropped(flat_ids(request_ids), flat_ints(starts), flat_ints(counts), rows, None, total)
        return False

    def _publish_deferred(self, request_ids: Sequence, starts: Sequence, counts: Sequence, rows: Any,
                          total: int) -> bool:
        """publish_steps of rows whose ids the producer's thread resolves (see there)."""
        item = StepParts(list(request_ids), list(starts), list(counts), rows)
        if (isinstance(rows, np.ndarray) or not rows.dropped) and self._put(item, self._queued_bytes(rows, total),
                                                                              True):
            return True
        ids, starts, counts = rows.resolve(item.request_ids, item.starts, item.counts)     # dropped: which keys
        self._step_dropped(flat_ids(ids), flat_ints(starts), flat_ints(counts), rows, None, rows.shape[0])
        return False

    def _queued_bytes(self, rows: Any, total: int) -> int:
        """What a step of `total` rows counts against the queue bound: its int16 rows, plus what the rows object
        holds beyond them until the thread takes it (extra_nbytes: an eager CPU engine's router tensors; the
        thread gives it back then, Intake._step_of)."""
        return total * self.row_bytes + (0 if isinstance(rows, np.ndarray) else rows.extra_nbytes)

    def _step_dropped(self, request_ids, starts, counts, rows, keep, total: int) -> None:
        """A step refused by the queue bound (or dropped by capture): release its rows, report its positions lost."""
        self.stats.dropped_msgs += 1
        self.stats.dropped_rows += total
        release(rows)
        if keep is None:
            self._book.add_lost(request_ids, starts, counts)
        else:
            self._book.add_lost(*zip(*[(r, s, c) for r, s, c, k in zip(request_ids, starts, counts, keep) if k]))
        if self.stats.dropped_msgs == 1 or self.stats.dropped_msgs % 1000 == 0:
            log.warning("producer %s queue full: dropped=%d msgs rows=%d queued_bytes=%d bound=%d "
                        "replay_unacked=%d", self.producer_id, self.stats.dropped_msgs, self.stats.dropped_rows,
                        self.queued_bytes, self.max_queue_bytes, len(self._replay))

    def finish(self, request_id: str, *, num_output_tokens: int, finish_reason: str = "stop",
               prompt_len: int | None = None, num_cached_tokens: int | None = None,
               output_token_ids: Sequence[int] | np.ndarray | None = None) -> None:
        """Close a request: it produced `num_output_tokens` tokens (the last one's row is never computed)."""
        self._check()
        refused, lost = self._book.ended(request_id)
        if refused or self._book.problem(request_id) is not None:
            self._drop_parts("finish", request_id)
            return
        self._put(self._finish_item(request_id, num_output_tokens, finish_reason, output_token_ids, lost,
                                    prompt_len, num_cached_tokens), 0, False)

    def abort(self, request_id: str, reason: str = "abort", num_output_tokens: int | None = None) -> None:
        self._check()
        refused, _ = self._book.ended(request_id)
        if refused or self._book.problem(request_id) is not None:
            self._drop_parts("abort", request_id)
            return
        self._put(self._abort_item(request_id, reason, num_output_tokens), 0, False)

    def end_many(self, ends: Sequence[tuple], tokens_frozen: bool = False) -> int:
        """`finish` and `abort` for several requests in one call: one lock and one queue item for all of them,
        their messages built on the producer's thread (the finishes as `finishes` messages when the broker takes
        them; finish() calls queued one behind the other go so too).

        Each item is ("finish", request_id, num_output_tokens, finish_reason, output_token_ids or None) or
        ("abort", request_id, num_output_tokens or None, reason, None), num_output_tokens an int. Parts of refused
        ids are dropped and counted as finish() drops them. Raises ValueError for a malformed item (token ids
        included) before anything of this call is taken; returns how many were sent. `tokens_frozen`: as
        open_many's (output token id lists the caller made for this call and never modifies)."""
        self._check()
        if tokens_frozen and ends and not any(
                (k != "finish" and k != "abort") or (type(n) is not int and not (k == "abort" and n is None))
                or (t is not None and type(t) is not list) for k, _, n, _, t in ends):
            tokens = [end[4] for end in ends]   # an engine's own items (the vLLM worker's): checked in one pass
        else:
            tokens = self._end_tokens(ends, tokens_frozen)
        verdicts = self._book.ended_many([end[1] for end in ends])
        items = []
        for end, toks, (refused, lost, known) in zip(ends, tokens, verdicts):
            kind, rid, n, reason, _ = end
            if refused or (not known and self._book.problem(rid) is not None):
                self._drop_parts(kind, rid)
                continue
            items.append((kind, rid, n, reason, toks, lost))
        if items:
            self._put_many(Announces(self._end_items, items))
        return len(items)

    @staticmethod
    def _end_tokens(ends: Sequence[tuple], tokens_frozen: bool) -> list:
        """end_many's items checked one by one (ValueError for the first malformed one), their token ids taken."""
        tokens = []
        for end in ends:
            kind, _, n, _, toks = end
            if kind != "finish" and kind != "abort":
                raise ValueError(f"end kind must be 'finish' or 'abort', got {kind!r}")
            if type(n) is not int and not (kind == "abort" and n is None):
                raise ValueError(f"num_output_tokens of a {kind} must be an int, got {n!r}")
            try:                                        # as finish(): a list copied (unless frozen), an array int32
                tokens.append(None if toks is None else _tokens(toks, tokens_frozen))
            except Exception as e:  # noqa: BLE001
                raise ValueError(f"output token ids of a {kind}: {type(e).__name__}: {e}") from e
        return tokens

    def _end_items(self, items: list) -> list:
        """end_many's items as Announce (the producer's thread)."""
        out = []
        for kind, rid, n, reason, tokens, lost in items:
            try:
                out.append(self._finish_item(rid, n, reason, tokens, lost, frozen=True) if kind == "finish"
                           else self._abort_item(rid, reason, n))
            except Exception as e:  # noqa: BLE001 -- defensive: the caller checked the values
                self._build_failed(kind, rid, e)
        return out

    def _build_failed(self, kind: str, rid: str, e: Exception) -> None:
        self.stats.encode_errors += 1
        log.warning("producer %s dropped the %s of request %s it could not build (%d so far): %s: %s",
                    self.producer_id, kind, escaped_id(rid), self.stats.encode_errors, type(e).__name__,
                    str(e)[:200])

    @staticmethod
    def _finish_item(request_id: str, num_output_tokens: int, finish_reason: str, output_token_ids: Any,
                     lost: list | None, prompt_len: int | None = None,
                     num_cached_tokens: int | None = None, frozen: bool = False) -> Announce:
        body: dict = {"num_output": int(num_output_tokens), "reason": finish_reason}
        if prompt_len is not None:
            body["prompt_len"] = int(prompt_len)
        if num_cached_tokens is not None:
            body["num_cached"] = int(num_cached_tokens)
        if lost:
            body["lost"] = lost
        return Announce("finish", request_id, body, _token_frames(body, "n_output_tokens", output_token_ids, frozen))

    @staticmethod
    def _abort_item(request_id: str, reason: str, num_output_tokens: int | None) -> Announce:
        body: dict = {"reason": reason}
        if num_output_tokens is not None:
            body["num_output"] = int(num_output_tokens)
        return Announce("abort", request_id, body, [])

    @property
    def queued_bytes(self) -> int:
        return self._ledger.bytes

    @property
    def queued_msgs(self) -> int:
        return self._ledger.msgs

    @property
    def unacked_msgs(self) -> int:
        """Messages in the replay buffer: taken from the queue, not yet acknowledged by the broker."""
        return len(self._replay)

    @property
    def replay_bytes(self) -> int:
        """Replay buffer bytes in memory (the spill file holds `spilled_bytes` more)."""
        return self._replay.mem_bytes

    @property
    def spilled_bytes(self) -> int:
        return self._replay.spilled_bytes

    def _wait(self, done, timeout_s: float) -> bool:
        self._q.wake()                  # opens, finishes, aborts queued without waking the thread go now
        deadline = time.monotonic() + timeout_s
        while not done():
            if self.failure is not None:
                self._check()
            if time.monotonic() > deadline:
                return False
            time.sleep(0.001)
        return True

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every enqueued message was handed to the socket. True if it was within the timeout."""
        return self._wait(lambda: self.queued_msgs == 0 and self._replay.never_sent == 0, timeout_s)

    def wait_acked(self, timeout_s: float = 10.0) -> bool:
        """Wait until every enqueued message was acknowledged (applied by its consumers). True if in time."""
        return self._wait(lambda: self.queued_msgs == 0 and len(self._replay) == 0, timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        """Send what is queued and wait for its acks (up to timeout_s), then stop. Idempotent.

        Acks are not waited for when the broker never answered (an endpoint that does not speak acks) or says it
        has no live consumer (it holds the messages until one comes; docs/RELIABILITY.md).
        """
        if self._closed:
            return
        self._sender.close_deadline = time.monotonic() + timeout_s
        self._sender.closing = True
        self._closed = True
        self._q.put(STOP)
        self._thread.join(timeout_s + 5)
        if self._thread.is_alive():
            log.warning("producer %s: thread still sending after %.1fs, %d msgs queued", self.producer_id,
                        timeout_s, self.queued_msgs)
        elif self._own_ctx:
            self._ctx.term()     # returns when queued messages are on the wire or linger_ms has passed

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
