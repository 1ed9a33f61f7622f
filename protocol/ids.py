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
