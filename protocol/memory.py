"""Make a pipeline process reuse the memory it frees instead of asking the kernel for fresh pages each time.

The broker and consumer handle messages of up to megabytes (libzmq allocates each received message, the broker
gathers each owner's rows, the consumer builds records). With glibc's defaults a block above the dynamic mmap
threshold is mapped fresh and unmapped when freed, and the top of the heap is trimmed, so every such message costs
page faults (4 KiB each: a large share of the broker's CPU time, docs/PERFORMANCE.md). `keep_freed_memory()` fixes the mmap threshold at its maximum (32 MiB: smaller blocks
come from the heap and are reused) and keeps up to `trim_bytes` of freed heap before returning it to the system.
It is process-wide; Broker.serve and Consumer.run call it (they own their process in every deployment: the CLI, the
vLLM plugin's helper process); the producer does not (it lives in the engine's process).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

log = logging.getLogger("routing_replay.memory")

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20          # glibc's largest allowed value on 64-bit (HEAP_MAX_SIZE / 2)
_done = False


def keep_freed_memory(trim_bytes: int = 256 << 20) -> bool:
    """Set glibc's malloc thresholds for this process (once); False where that is not glibc (nothing changed)."""
    global _done
    if _done:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    ok = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(_M_TRIM_THRESHOLD, trim_bytes) == 1
    _done = ok
    log.info("malloc mmap_threshold=%d trim_threshold=%d set=%s", MMAP_THRESHOLD, trim_bytes, ok)
    return ok
