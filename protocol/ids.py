"""Make peer ids (producer, consumer, broker, client) that are unique across hosts and restarts."""

from __future__ import annotations

import os
import socket
import uuid


def default_peer_id(role: str) -> str:
    return f"{role}:{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
