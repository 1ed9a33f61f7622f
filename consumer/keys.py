"""Keep every record a consumer lets out under a key of its own: a reused request id never replaces a record.

A user may reuse a request id after its record was written (an engine restart, a client that retries with the
same `X-Request-Id`). The engine keeps keys unique only among its live requests, so the consumer names a record
whose key is already taken `protocol.ids.duplicate_key(key, n)` (f"{key}#{n}", the smallest n free), logs it, and
counts it. Taken: a record this consumer let out under that key (the last `remember` of them), a request it holds
under it, or a record file for it in the npz directory (from this run or an earlier one). A file whose record
has the same prompt and output tokens is the same request sent again (a producer resending to a restarted
consumer): that keeps its key, and its file is written again as before.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Callable

import numpy as np

from routing_replay.protocol import wire
from routing_replay.protocol.ids import duplicate_key

log = logging.getLogger("routing_replay.consumer")


def _same_tokens(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return np.array_equal(np.asarray(a), np.asarray(b))


class RecordKeys:
    """Own the keys of the records this consumer let out (the last `remember`), and rename a record whose key is
    taken. `held(key)`: a request in flight under that key; `on_disk(key)`: the record stored under it, or None."""

    def __init__(self, held: Callable[[str], bool], on_disk: Callable[[str], wire.Record | None] | None = None,
                 remember: int = 100_000):
        self._out: OrderedDict[str, None] = OrderedDict()
        self._held, self._on_disk, self._remember = held, on_disk, remember
        self.renamed = 0

    def _taken(self, key: str, rec: wire.Record | None = None) -> bool:
        if key in self._out or self._held(key):
            return True
        if self._on_disk is None:
            return False
        old = self._on_disk(key)
        if old is None:
            return False
        # the same request again (a resend after a restart): same tokens in, same tokens out
        return rec is None or not (_same_tokens(old.prompt_token_ids, rec.prompt_token_ids)
                                   and _same_tokens(old.output_token_ids, rec.output_token_ids))

    def name(self, rec: wire.Record, consumer_id: str = "") -> wire.Record:
        """`rec`, renamed (in place) if its key is taken; its key is then remembered as let out."""
        key = rec.request_id
        if self._taken(key, rec):
            n = 1
            while self._taken(new := duplicate_key(key, n)):
                n += 1
            rec.request_id = new
            self.renamed += 1
            log.warning("consumer %s: record key %r is taken by an earlier record (a reused request id); this "
                        "record is stored as %r (renamed=%d)", consumer_id, key[:64], new[:80], self.renamed)
        self._out[rec.request_id] = None
        if len(self._out) > self._remember:
            self._out.popitem(last=False)
        return rec
