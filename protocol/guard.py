"""One message handler call that a bug cannot turn into a dead loop: the broker's and the consumer's socket loops."""

from __future__ import annotations

import logging
from typing import Callable, MutableMapping


def guarded(handler: Callable, args: tuple, bad: MutableMapping[str, int], log: logging.Logger, who: str) -> None:
    """Call handler(*args); an exception it raises on some input is counted in bad["internal_error"] and logged
    with its traceback (the first time and every 1000th), and the loop goes on. The message is then dropped like a
    malformed one: the rows it carried are missing from their records, which say so."""
    try:
        handler(*args)
    except Exception as e:  # noqa: BLE001 (the loop must survive any input; the traceback is logged)
        bad["internal_error"] += 1
        n = bad["internal_error"]
        if n == 1 or n % 1000 == 0:
            log.exception("%s internal error on a message (%d so far): %s", who, n, e)
