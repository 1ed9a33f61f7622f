"""The engine thread's per-step device launches as CUDA driver calls made with the GIL held.

Every torch call releases the GIL around its dispatch. Alone that costs nothing, but beside one busy Python thread
(vLLM's output and input threads, the producer's thread) the engine thread then waits for the GIL to come back,
up to the interpreter's switch interval per call. The same work through libcuda called with the GIL held
(ctypes.PyDLL) never gives the GIL away, and these launches are short: never worth giving the GIL away for
(bench/gil_probe.py measures both; the figures are in docs/PERFORMANCE.md, "Driver calls with the GIL held").

`driver()` returns the loaded library (or None: no libcuda, or ROUTING_REPLAY_CUDA_DRIVER=0); `check(device)`
runs each call once against torch on scratch memory of that device and says whether the results are bit-exact
(callers fall back to torch calls otherwise). The calls need the device's context current on the calling
thread, which any earlier torch CUDA work on that thread made so (the engine thread has run the forward).
"""

from __future__ import annotations

import ctypes
import logging
import os

log = logging.getLogger("routing_replay.capture")

_SZ, _P, _U64 = ctypes.c_size_t, ctypes.c_void_p, ctypes.c_uint64
_MEMORYTYPE_DEVICE = 2


class Memcpy2D(ctypes.Structure):
    """CUDA_MEMCPY2D (cuda.h)."""

    _fields_ = [("srcXInBytes", _SZ), ("srcY", _SZ), ("srcMemoryType", ctypes.c_int), ("srcHost", _P),
                ("srcDevice", _U64), ("srcArray", _P), ("srcPitch", _SZ),
                ("dstXInBytes", _SZ), ("dstY", _SZ), ("dstMemoryType", ctypes.c_int), ("dstHost", _P),
                ("dstDevice", _U64), ("dstArray", _P), ("dstPitch", _SZ),
                ("WidthInBytes", _SZ), ("Height", _SZ)]


class DriverError(RuntimeError):
    pass


class Driver:
    """libcuda.so.1 through ctypes.PyDLL (the GIL stays held during each call)."""

    def __init__(self, lib):
        self._lib = lib
        lib.cuMemsetD2D8Async.argtypes = [_U64, _SZ, ctypes.c_ubyte, _SZ, _SZ, _P]
        lib.cuMemcpy2DAsync_v2.argtypes = [ctypes.POINTER(Memcpy2D), _P]
        lib.cuEventRecord.argtypes = [_P, _P]
        lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        self._memset = lib.cuMemsetD2D8Async
        self._memcpy2d = lib.cuMemcpy2DAsync_v2
        self._record = lib.cuEventRecord

    def _fail(self, what: str, rc: int):
        name = ctypes.c_char_p()
        self._lib.cuGetErrorName(rc, ctypes.byref(name))
        raise DriverError(f"{what} failed: CUDA driver error {rc} ({(name.value or b'?').decode()})")

    def memset_2d(self, ptr: int, pitch: int, value: int, width: int, height: int, stream: int) -> None:
        """`height` rows of `width` bytes, `pitch` bytes apart, from device address `ptr`, set to byte `value`."""
        rc = self._memset(ptr, pitch, value, width, height, stream)
        if rc:
            self._fail("cuMemsetD2D8Async", rc)

    def copy_2d(self, m: Memcpy2D, stream: int) -> None:
        """Device-to-device 2-D copy described by `m` (set its device pointers, pitches, width and height)."""
        rc = self._memcpy2d(ctypes.byref(m), stream)
        if rc:
            self._fail("cuMemcpy2DAsync", rc)

    def event_record(self, event: int, stream: int) -> None:
        rc = self._record(event, stream)
        if rc:
            self._fail("cuEventRecord", rc)

    @staticmethod
    def copy_desc() -> Memcpy2D:
        return Memcpy2D(srcMemoryType=_MEMORYTYPE_DEVICE, dstMemoryType=_MEMORYTYPE_DEVICE)


_DRIVER: list = []


def driver() -> Driver | None:
    """The driver library, loaded once; None where there is none or ROUTING_REPLAY_CUDA_DRIVER=0."""
    if not _DRIVER:
        d = None
        if os.environ.get("ROUTING_REPLAY_CUDA_DRIVER", "1") != "0":
            try:
                d = Driver(ctypes.PyDLL("libcuda.so.1"))
            except (OSError, AttributeError) as e:
                log.info("routing-replay: CUDA driver calls unavailable (%s); using torch calls", e)
        _DRIVER.append(d)
    return _DRIVER[0]


_CHECKED: dict = {}


def check(device) -> Driver | None:
    """The driver if its memset, 2-D copy and event record give exactly what torch gives on `device` (checked once
    per device, with a synchronize: call at set-up, not per step); None otherwise."""
    import torch

    key = str(device)
    if key in _CHECKED:
        return _CHECKED[key]
    d = driver()
    ok = None
    if d is not None:
        try:
            with torch.cuda.device(device):
                stream = torch.cuda.current_stream(device)
                src = torch.arange(4 * 64 * 8, dtype=torch.int16, device=device).view(4, 64, 8)
                dst = torch.zeros(4 * 10 * 8, dtype=torch.int16, device=device)
                m = d.copy_desc()
                m.srcDevice, m.srcPitch = src.data_ptr() + 3 * 8 * 2, 64 * 8 * 2     # rows [3, 13) of each layer
                m.dstDevice, m.dstPitch = dst.data_ptr(), 10 * 8 * 2
                m.WidthInBytes, m.Height = 10 * 8 * 2, 4
                d.copy_2d(m, stream.cuda_stream)
                d.memset_2d(src.data_ptr() + 5 * 8 * 2, 64 * 8 * 2, 0xFF, 20 * 8 * 2, 4, stream.cuda_stream)
                ev = torch.cuda.Event()
                ev.record(stream)                      # created by torch; the driver records it again
                d.event_record(ev.cuda_event, stream.cuda_stream)
                ev.synchronize()
                torch.cuda.synchronize(device)
                want = torch.arange(4 * 64 * 8, dtype=torch.int16, device=device).view(4, 64, 8)
                copied = torch.equal(dst.view(4, 10, 8), want[:, 3:13])
                want[:, 5:25] = -1
                ok = d if copied and torch.equal(src, want) and ev.query() else None
                if ok is None:
                    log.warning("routing-replay: CUDA driver calls gave results torch does not; using torch calls")
        except Exception as e:  # noqa: BLE001 -- any failure: torch calls instead
            log.warning("routing-replay: CUDA driver calls failed their check (%s); using torch calls", e)
            ok = None
    _CHECKED[key] = ok
    return ok


def give_up(error: Exception) -> None:
    """A driver call was refused at launch (e.g. the calling thread's current device is not the cache's): log it
    once per caller and return None, so the caller uses torch calls from now on (nothing was launched)."""
    log.warning("routing-replay: CUDA driver call refused (%s); this capture uses torch calls from now on", error)
    return None


_STREAMS: dict = {}


def current_stream(device_index: int) -> int:
    """This thread's current stream on device `device_index` as a raw CUstream (0: the legacy default stream);
    `torch.cuda.current_stream()` resolves the device in Python every call, the raw C call and a kept
    handle per stream id do not."""
    import torch

    raw = torch._C._cuda_getCurrentStream(device_index)
    h = _STREAMS.get(raw)
    if h is None:
        h = _STREAMS[raw] = torch.cuda.Stream(stream_id=raw[0], device_index=raw[1], device_type=raw[2]).cuda_stream
    return h
