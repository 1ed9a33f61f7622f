"""Make peer ids (producer, consumer, broker, client) unique across hosts and restarts, and record keys for
request ids that cannot travel as they are."""

from __future__ import annotations

import hashlib
import os
import socket
import uuid

from routing_replay.protocol.wire import request_id_problem

DERIVED_KEY_PREFIX = "rr-sha256-"


def default_peer_id(role: str) -> str:
    return f"{role}:{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def record_key_for(request_id: str) -> str:
    """The key a request's record travels and is stored under: the id itself when it can travel
    (`wire.request_id_problem(id) is None`), else `"rr-sha256-" + sha256(id as UTF-8, lone surrogates kept by
    'surrogatepass')` in hex (74 ASCII characters). Engines call it to publish; a trainer calls it with the id it
    gave the engine to find the record. An id that can travel never starts with the prefix by accident unless the
    user chose such an id."""
    if request_id_problem(request_id) is None:
        return request_id
    return DERIVED_KEY_PREFIX + hashlib.sha256(request_id.encode("utf-8", "surrogatepass")).hexdigest()


# A record key stays unique per engine request: a request whose key is already taken (another request with the
# same id is still being captured in the engine, or a record with that key is already stored) is stored as
# f"{key}#{n}", n = 1, 2, ... the smallest free. The user's id stays the key's prefix; `is_key_of` finds them all.
DUPLICATE_SEP = "#"


def duplicate_key(key: str, n: int) -> str:
    """The key of the n-th (n >= 1) request stored under `key` while `key` was taken; derived (`record_key_for`)
    when the suffix makes it too long to travel."""
    if n < 1:
        raise ValueError(f"duplicate number {n} must be >= 1")
    return record_key_for(f"{key}{DUPLICATE_SEP}{n}")


def is_key_of(key: str, user_key: str) -> bool:
    """True if a record stored under `key` belongs to requests the user named `user_key` (a record key, e.g.
    `record_key(id)`): `key` is `user_key` itself or `user_key` followed by one or more "#<n>" (a duplicate, or
    a duplicate of a duplicate's key). A user id that itself ends in "#<digits>" matches its own base id too."""
    if not key.startswith(user_key):
        return False
    rest = key[len(user_key):]
    if not rest:
        return True
    parts = rest.split(DUPLICATE_SEP)
    return parts[0] == "" and len(parts) > 1 and all(p.isdigit() and p.isascii() and p[0] != "0"
                                                     for p in parts[1:])
