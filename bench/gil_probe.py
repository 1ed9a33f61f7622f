"""Engine-thread CPU and wall time of one torch launch vs the same work through the CUDA driver API called with the
GIL held (ctypes.PyDLL), alone and beside busy Python threads; checks the driver calls' results bit-exact.
Bare CUDA host, torch only. Figures: docs/PERFORMANCE.md, "Engine thread: driver calls with the GIL held".

    python bench/gil_probe.py [BUSY_THREADS]      (default 0)
"""
import argparse
import ctypes
import threading
import time

import torch

_ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
_ap.add_argument("busy_threads", nargs="?", type=int, default=0, help="busy pure-Python threads beside this one")
contend = _ap.parse_args().busy_threads
stop = threading.Event()
def busy():
    x = {}
    while not stop.is_set():
        for i in range(1000):
            x[i] = str(i) * 3
        x.clear()
for _ in range(contend):
    threading.Thread(target=busy, daemon=True).start()

cu = ctypes.PyDLL("libcuda.so.1")
c_sz, c_p = ctypes.c_size_t, ctypes.c_void_p
cu.cuMemsetD2D16Async.argtypes = [ctypes.c_uint64, c_sz, ctypes.c_ushort, c_sz, c_sz, c_p]
class M2D(ctypes.Structure):
    _fields_ = [("srcXInBytes", c_sz), ("srcY", c_sz), ("srcMemoryType", ctypes.c_int), ("srcHost", c_p),
                ("srcDevice", ctypes.c_uint64), ("srcArray", c_p), ("srcPitch", c_sz),
                ("dstXInBytes", c_sz), ("dstY", c_sz), ("dstMemoryType", ctypes.c_int), ("dstHost", c_p),
                ("dstDevice", ctypes.c_uint64), ("dstArray", c_p), ("dstPitch", c_sz),
                ("WidthInBytes", c_sz), ("Height", c_sz)]
cu.cuMemcpy2DAsync_v2.argtypes = [ctypes.POINTER(M2D), c_p]
cu.cuEventRecord.argtypes = [c_p, c_p]

dev = torch.device("cuda")
T, L, K, n = 8192, 16, 8, 256
buf = torch.randint(0, 128, (L, T, K), dtype=torch.int16, device=dev)
stage = torch.empty((4 * T, L, K), dtype=torch.int16, device=dev)
stage_lm = torch.empty((L, T, K), dtype=torch.int16, device=dev)
s = torch.cuda.current_stream()
sp = s.cuda_stream
ev = torch.cuda.Event()
ev_h = ev.cuda_event if hasattr(ev, "cuda_event") else None
ev.record(s)
ev_h = ev.cuda_event

m = M2D(srcMemoryType=2, srcDevice=buf.data_ptr(), srcPitch=T * K * 2, dstMemoryType=2,
        dstDevice=stage_lm.data_ptr(), dstPitch=n * K * 2, WidthInBytes=n * K * 2, Height=L)
mp = ctypes.byref(m)
view_fill = buf[:, :n]
src_t = buf.transpose(0, 1)[:n]
dst = stage[:n]

def t_(f, reps=2000):
    for _ in range(50): f()
    torch.cuda.synchronize()
    c0 = time.thread_time_ns(); w0 = time.perf_counter_ns()
    for _ in range(reps): f()
    c1 = time.thread_time_ns(); w1 = time.perf_counter_ns()
    torch.cuda.synchronize()
    return (c1 - c0) / reps / 1e3, (w1 - w0) / reps / 1e3

res = {}
res["torch fill_"] = t_(lambda: view_fill.fill_(-1))
res["driver memset2D"] = t_(lambda: cu.cuMemsetD2D16Async(buf.data_ptr(), T * K * 2, 0xFFFF, n * K, L, sp))
res["torch copy_ transpose"] = t_(lambda: dst.copy_(src_t))
res["driver memcpy2D layer-major"] = t_(lambda: cu.cuMemcpy2DAsync_v2(mp, sp))
res["torch event.record"] = t_(lambda: ev.record(s))
res["driver cuEventRecord"] = t_(lambda: cu.cuEventRecord(ev_h, sp))
res["python no-op call"] = t_(lambda: None)
for k, (c, w) in res.items():
    print(f"contend={contend} {k:32s} cpu {c:8.1f} us  wall {w:8.1f} us")
# exactness
buf.copy_(torch.randint(0, 128, (L, T, K), dtype=torch.int16, device=dev))
ref = buf[:, :n].clone()
assert cu.cuMemcpy2DAsync_v2(mp, sp) == 0
assert cu.cuMemsetD2D16Async(buf.data_ptr(), T * K * 2, 0xFFFF, n * K, L, sp) == 0
torch.cuda.synchronize()
assert torch.equal(stage_lm[:, :0].flatten(), stage_lm[:, :0].flatten())
got = stage_lm.flatten()[: L * n * K].view(L, n, K)
print("memcpy2D exact:", torch.equal(got, ref), " memset exact:", bool((buf[:, :n] == -1).all()), " untouched beyond n:", bool((buf[:, n:] != -1).any()))
stop.set()
