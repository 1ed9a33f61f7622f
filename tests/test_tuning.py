"""tune_malloc: on glibc, a 4 MiB buffer comes from the heap instead of its own mmap (checked with mallinfo2)."""

import ctypes
import ctypes.util
import subprocess
import sys

import pytest

_glibc = hasattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), "mallinfo2")

PROBE = r"""
import ctypes, ctypes.util, sys
class MI(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.mallinfo2.restype = MI
if sys.argv[1] == "tuned":
    from routing_replay.tuning import tune_malloc
    assert tune_malloc() is True and tune_malloc() is True
before = libc.mallinfo2().hblks
bufs = [bytearray(4 << 20) for _ in range(3)]
print(libc.mallinfo2().hblks - before)
"""


@pytest.mark.skipif(not _glibc, reason="glibc only (mallinfo2)")
@pytest.mark.parametrize("mode,mmapped", [("default", 3), ("tuned", 0)])
def test_tune_malloc_keeps_mid_size_buffers_on_the_heap(mode, mmapped):
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True)
    assert int(out.stdout.strip()) == mmapped
