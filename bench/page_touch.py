"""What a first touch of fresh memory costs this machine, and how that depends on how long ago memory was freed.

Maps `--mib` MiB, writes one byte per 4 KiB page, unmaps it, then waits and does it again, for each wait in
`--waits`. On a VM whose guest reports freed pages back to its host (virtio-balloon free page reporting, as on
this project's Firecracker CPU machine) a page freed seconds ago must be faulted in by the host again, and one
touch costs several times what it costs right after a free. Every byte of a record a consumer assembles is such a
touch; bench/pipeline.py prints the cost (`page_us`) as each measured batch starts, and each process's first
touches (`faults_k`). Figures: docs/PERFORMANCE.md.

    python bench/page_touch.py [--mib 1024] [--waits 0,0,0,2,5,10,20,0,0]
"""

from __future__ import annotations

import argparse
import mmap
import sys
import time

import numpy as np


def touch(mib: int) -> tuple[float, float]:
    """(wall, CPU) seconds to write one byte into every page of `mib` fresh MiB (then unmapped)."""
    m = mmap.mmap(-1, mib << 20, flags=mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", 0x20))
    try:
        a = np.frombuffer(m, dtype=np.uint8)
        t0, c0 = time.perf_counter(), time.process_time()
        a[::mmap.PAGESIZE] = 1
        t, c = time.perf_counter() - t0, time.process_time() - c0
        del a
    finally:
        m.close()
    return t, c


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=1024, help="memory touched per measurement (MiB)")
    ap.add_argument("--waits", default="0,0,0,2,5,10,20,0,0",
                    help="seconds idle before each measurement, comma-separated")
    a = ap.parse_args(argv)
    try:
        waits = [float(w) for w in a.waits.split(",") if w.strip()]
    except ValueError:
        ap.error(f"--waits: numbers separated by commas, got {a.waits!r}")
    if a.mib < 1 or not waits or min(waits) < 0:
        ap.error("--mib must be >= 1 and --waits non-empty and >= 0")
    pages = (a.mib << 20) // mmap.PAGESIZE
    for w in waits:
        time.sleep(w)
        t, c = touch(a.mib)
        print(f"idle {w:5.1f} s before: {a.mib} MiB first touch {t * 1e3:8.1f} ms wall {c * 1e3:8.1f} ms CPU "
              f"{t * 1e6 / pages:6.2f} us/page", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
