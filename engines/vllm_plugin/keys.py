"""Map vLLM's internal request ids back to the ids users see, so records are keyed like RequestOutput.

vLLM (0.25 and 0.32 alike) renames every request on the way in (`InputProcessor.assign_request_id`):
the internal id is `f"{request_id}-{8 random hex chars}"` unless VLLM_DISABLE_REQUEST_ID_RANDOMIZATION is
set. With `n > 1` the sampling is split into child requests `f"{index}_{internal id of the parent}"`
(`ParentRequest.get_child_info`). Stripping the random suffix therefore gives:

    n == 1   record key = RequestOutput.request_id                      e.g. "7", "chatcmpl-abc"
    n > 1    record key = f"{CompletionOutput.index}_{request_id}"       e.g. "0_7", "1_7"

`record_key()` computes the same key on the trainer's side. The OpenAI server builds its engine request ids
from the response id: chat completions use the response id itself ("chatcmpl-..."), completions append the
prompt's position in the batch ("cmpl-...-0", "cmpl-...-1", ...). The response id is "chatcmpl-" / "cmpl-"
followed by the `X-Request-Id` header, else the body's `request_id` field, else a random id.

Duplicates: vLLM runs two requests with the same user id side by side (its random suffix tells them apart), and a
user may reuse an id later. A record key is unique per engine request all the same: the worker captures a
request whose key another live request holds as `protocol.ids.duplicate_key(key, n)` = f"{key}#{n}" (n = 1, 2,
... the smallest free; with n > 1 per sample: "0_cmpl-x-0#1"), and the consumer renames a record whose key is
already taken there the same way (consumer/keys.py). `protocol.ids.is_key_of(key, record_key(id))` finds them.

An id that cannot travel as it is (`wire.request_id_problem`: over MAX_REQUEST_ID_BYTES UTF-8 bytes, lone
surrogates) is captured under `protocol.ids.record_key_for(id)` = "rr-sha256-" + its SHA-256 in hex; both
functions here apply it last, to the whole key (child index included), so the trainer's `record_key()` agrees.
"""

from __future__ import annotations

import os
import re

from routing_replay.protocol.ids import record_key_for
from routing_replay.protocol.wire import MAX_REQUEST_ID_BYTES, request_id_problem

_SUFFIX = re.compile(r"-[0-9a-f]{8}")        # matched at the id's last 9 characters only (fullmatch from there)


def randomized_ids() -> bool:
    """Whether vLLM appends its random suffix (VLLM_DISABLE_REQUEST_ID_RANDOMIZATION unset or false)."""
    v = os.environ.get("VLLM_DISABLE_REQUEST_ID_RANDOMIZATION", "").strip().lower()
    return v not in ("1", "true", "yes", "on")


def external_key(internal_id: str, randomized: bool = True) -> str:
    """The record key of an engine-internal request id (suffix stripped, child index kept)."""
    if randomized:
        start = len(internal_id) - 9
        if start < 0 or _SUFFIX.fullmatch(internal_id, start) is None:
            raise ValueError(f"request id {internal_id!r} lacks vLLM's random '-xxxxxxxx' suffix; "
                             "is VLLM_DISABLE_REQUEST_ID_RANDOMIZATION set in the engine but not here?")
        return internal_id[:start]
    return internal_id


def capture_key(internal_id: str, randomized: bool = True) -> tuple[str, str | None]:
    """(record key, None) for an engine-internal request id whose external id can travel; (derived key, why it
    could not) otherwise. Raises ValueError like external_key."""
    # the common id (vLLM's suffix, an ASCII key within the limit) in this one frame: the worker calls this for
    # every request it opens, on the engine thread
    start = len(internal_id) - 9 if randomized else len(internal_id)
    if start > 0 and (not randomized or _SUFFIX.fullmatch(internal_id, start) is not None):
        ext = internal_id[:start]
        if start <= MAX_REQUEST_ID_BYTES and ext.isascii():
            return ext, None
    ext = external_key(internal_id, randomized)
    problem = request_id_problem(ext)
    return (ext, None) if problem is None else (record_key_for(ext), problem)


def record_key(request_id: str, index: int = 0, n: int = 1) -> str:
    """Key of the record for sample `index` of a request with `n` samples (RequestOutput.request_id,
    CompletionOutput.index, SamplingParams.n); derived (`record_key_for`) when the id cannot travel as it is."""
    if not 0 <= index < max(n, 1):
        raise ValueError(f"sample index {index} outside [0, n={n})")
    return record_key_for(request_id if n == 1 else f"{index}_{request_id}")
