"""Process-level tuning for the long-running pipeline processes (broker, consumer service).

glibc's malloc serves blocks above a dynamic threshold (128 KiB at start) with fresh mmaps and returns freed
heap tops to the kernel. A process that allocates and frees 100 KiB - 10 MiB buffers for every message (the
broker's gathered split payloads, the consumer's row blocks and records) then pays a page fault for every 4 KiB
it writes, again and again: on the 2-core benchmark machine those faults were 75 us of every 98 KiB gather.
`tune_malloc()` keeps such buffers on the heap and keeps freed heap memory for reuse. It changes the whole
process, so the CLIs call it for the processes they own; a library user (a trainer embedding Consumer, an
engine) decides for their own process. A no-op where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger("routing_replay")

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD = 32 << 20     # glibc's largest accepted value on 64-bit (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD = 256 << 20    # free memory at the heap top kept for reuse before it goes back to the kernel

_done = False


def tune_malloc(mmap_threshold: int = MMAP_THRESHOLD, trim_threshold: int = TRIM_THRESHOLD) -> bool:
    """Set glibc malloc's mmap and trim thresholds for this process. True if applied (once per process)."""
    global _done
    if _done:
        return True
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
        if not hasattr(libc, "gnu_get_libc_version"):
            return False
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = mallopt(M_MMAP_THRESHOLD, mmap_threshold) == 1 and mallopt(M_TRIM_THRESHOLD, trim_threshold) == 1
    if ok:
        _done = True
        log.debug("malloc tuned: mmap_threshold=%d trim_threshold=%d", mmap_threshold, trim_threshold)
    return ok
