"""Name what the producer's caller hands its thread: opens, finishes and aborts (Announce, Announces) and steps
(Step) of ids, positions and rows (an ndarray or deferred rows: producer/handover.py)."""

from __future__ import annotations

from itertools import chain
from typing import Any, NamedTuple, Sequence

import numpy as np


class Announce(NamedTuple):
    """open / finish / abort of one request, as the caller built it."""

    kind: str
    request_id: str
    body: dict
    frames: list              # token-id arrays (open: prompt, finish: output), possibly empty


class Announces(NamedTuple):
    """Several opens or finishes/aborts put in one call (Producer.open_many / end_many): `build(items)`, called on
    the producer's thread, returns their Announce items, in order."""

    build: Any
    items: list


class Step(NamedTuple):
    """One engine step (or a batch of them): request_ids[i] gets counts[i] rows at starts[i]...

    `rows` is an ndarray or deferred rows (producer/handover.py: DeferredRows); `keep`, when not None, says which
    request parts travel (the others were refused on the caller's thread and are cut out after result()).
    """

    request_ids: list
    starts: list
    counts: list
    rows: Any
    keep: list | None = None


def flat_ids(parts: Sequence[Sequence]) -> list:
    """Per-step id lists as one new list."""
    return list(parts[0]) if len(parts) == 1 else list(chain.from_iterable(parts))


def flat_ints(parts: Sequence) -> list:
    """Per-step integer lists or 1-D arrays as one list of ints (arrays: one C loop)."""
    if len(parts) == 1:
        p = parts[0]
        return p.tolist() if isinstance(p, np.ndarray) else [int(x) for x in p]
    return np.concatenate([np.asarray(p, dtype=np.int64).reshape(-1) for p in parts]).tolist()
