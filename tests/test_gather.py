"""The producer's request-major copy in C (producer/_gather.c) against its numpy reference (producer/outpool.py
request_major with native=False): bit for bit, on the shapes the producer meets and odd ones, through both of the C
copy's paths (streaming stores for large 16-byte rows, memcpy per row otherwise); bad arguments get a clear error
before a byte of the destination is written. Where a C compiler and Python's headers exist (so `pip install -e .`
built it), the module must be there: a build that silently fell back to numpy fails here."""

from __future__ import annotations

import os
import sys
import threading
import time

import numpy as np
import pytest

from routing_replay.producer import outpool as messages
from routing_replay.producer.outpool import request_major
from tests.procs import c_toolchain

_gather = messages._gather
needs_c = pytest.mark.skipif(_gather is None, reason="producer/_gather.c is not built here (no C toolchain)")


def test_the_c_copy_is_built_where_it_can_be_and_the_producer_uses_it():
    if not c_toolchain():
        pytest.skip("no C compiler or Python.h here: the producer copies with numpy")
    assert _gather is not None, "a C toolchain is here but producer/_gather.c was not built (`pip install -e .`)"
    assert messages.NATIVE == (os.environ.get("ROUTING_REPLAY_NATIVE", "1") != "0")


def steps(rng, n: int, row: tuple, k: int, dtype=np.int16) -> list:
    return [rng.integers(-1, 128, (n, *row)).astype(dtype) for _ in range(k)]


@needs_c
@pytest.mark.parametrize("n,row,k", [
    (256, (48, 8), 64),     # Qwen3-30B-A3B decode merge: 12.6 MB, streamed
    (256, (16, 8), 16),     # 16 layers: 256 B rows, 1 MiB: below the streaming size, memcpy per row
    (300, (48, 8), 12),     # 5.5 MB streamed, n not a power of two
    (7, (3, 5), 9),         # 30 B rows: never streamed
    (1, (1, 1), 1),
    (5, (2, 2), 3),
    (4096, (4, 2), 70),     # 16 B rows, 4.6 MB: streamed
    (2048, (3, 3), 128),    # 18 B rows, 4.7 MB: too odd to stream
])
@pytest.mark.parametrize("grouped", [False, True])
def test_the_c_copy_equals_numpys_bit_for_bit(n, row, k, grouped):
    rng = np.random.default_rng(n * 31 + k)
    arrs = steps(rng, n, row, k)
    inverse = rng.permutation(n) if grouped else None
    want = request_major(arrs, inverse, native=False)
    got = request_major(arrs, inverse, native=True)
    assert got.shape == want.shape == (n * k, *row) and got.dtype == want.dtype
    assert np.array_equal(got, want)
    # and what request_major means, checked directly: place p holds request order[p]'s row of every step in a row
    order = np.arange(n) if inverse is None else np.argsort(inverse)
    g = got.reshape(n, k, *row)
    for p in {0, n // 2, n - 1}:
        for s in {0, k - 1}:
            assert np.array_equal(g[p, s], arrs[s][order[p]])


@needs_c
def test_the_c_copy_streams_only_large_aligned_rows_and_both_paths_agree():
    rng = np.random.default_rng(3)
    n, k = 256, 64
    arrs = steps(rng, n, (48, 8), k)
    order = rng.permutation(n).astype(np.int64)
    a = np.empty((n * k, 48, 8), np.int16)
    b = np.empty_like(a)
    assert _gather.gather_rows(a, arrs, order, 768) is True          # 12.6 MB of 768 B rows: streamed
    assert _gather.gather_rows(b, arrs, order, 768, False) is False   # asked not to
    assert np.array_equal(a, b)
    small = steps(rng, 4, (48, 8), 2)
    out = np.empty((8, 48, 8), np.int16)
    assert _gather.gather_rows(out, small, np.arange(4, dtype=np.int64), 768) is False    # 6 KB: left in the cache
    odd = steps(rng, n, (3, 5), k)                                   # 30 B rows
    out = np.empty((n * k, 3, 5), np.int16)
    assert _gather.gather_rows(out, odd, order, 30) is False
    assert np.array_equal(out, request_major(odd, np.argsort(order), native=False))


@needs_c
def test_bad_arguments_get_a_clear_error_and_leave_the_destination_untouched():
    rng = np.random.default_rng(5)
    arrs = steps(rng, 4, (2, 2), 3)
    out = np.full((12, 2, 2), 7, np.int16)
    ok = np.arange(4, dtype=np.int64)
    cases = [
        ((out, arrs, np.array([0, 1, 2, 4], np.int64), 8), ValueError, "order[3] = 4 is outside the arrays' 4 rows"),
        ((out, arrs, np.array([0, -1, 2, 3], np.int64), 8), ValueError, "order[1] = -1"),
        ((out, arrs, ok.astype(np.int32), 8), TypeError, "order must be int64"),
        ((out, arrs, ok.astype(np.float64), 8), TypeError, "order must be int64"),
        ((out, [arrs[0], arrs[1][:3]], ok, 8), ValueError, "arrays differ in size"),
        ((out, arrs, ok, 6), ValueError, "not whole rows of 6 bytes"),
        ((out, arrs, ok, 0), ValueError, "row_bytes must be positive"),
        ((out[:11], arrs, ok, 8), ValueError, "out holds 88 bytes, not 96"),
        ((out, [], ok, 8), ValueError, "arrays must hold 1 to"),
        ((out, 5, ok, 8), TypeError, "arrays must be a sequence"),
        ((out, [arrs[0][:, :, ::-1]] * 3, ok, 8), (BufferError, ValueError), ""),      # not C-contiguous
        ((out[::-1], arrs, ok, 8), (BufferError, ValueError), ""),
        ((memoryview(out.tobytes()), arrs, ok, 8), (BufferError, TypeError), ""),      # read-only destination
        ((out, [b"x" * 16, "not a buffer"], ok, 8), TypeError, ""),
    ]
    for args, exc, text in cases:
        with pytest.raises(exc) as e:
            _gather.gather_rows(*args)
        assert text in str(e.value), (text, str(e.value))
        assert (out == 7).all(), f"{text}: the destination was written"
    _gather.gather_rows(out, arrs, ok, 8)          # and the same call with good arguments works
    assert np.array_equal(out, request_major(arrs, None, native=False))


def test_request_major_copies_with_numpy_where_the_c_copy_does_not_apply():
    """Steps that are not C-contiguous arrays of one shape and dtype go through numpy, with the same result."""
    rng = np.random.default_rng(9)
    base = steps(rng, 6, (4, 4), 3)
    strided = [a[:, :, ::2] for a in base]              # views, not C-contiguous
    mixed = [base[0][:, :, :2].copy(), base[1][:, :, 1::2], base[2][:, :, :2].copy()]      # one of three
    for arrs in (strided, mixed):
        got = request_major(arrs, np.array([5, 4, 3, 2, 1, 0]))
        want = np.stack([np.stack(arrs)[:, i] for i in [5, 4, 3, 2, 1, 0]])
        assert np.array_equal(got.reshape(6, 3, 4, 2), want)


def copies_other_threads_ran_in(gather_rows) -> list:
    """For each of 40 large copies (about 1 ms each) by `gather_rows`: how often a Python thread beside it counted
    while it ran. The switch interval is set far beyond the run and the counting thread gives the GIL back after every
    count, so the main thread is never made to drop the GIL: the counter can run during a copy only when the copy
    releases the GIL itself. A copy that holds it reads 0 every time, on any machine, however loaded."""
    rng = np.random.default_rng(11)
    n, k = 256, 64
    arrs = steps(rng, n, (48, 8), k)
    order = np.arange(n, dtype=np.int64)
    outs = [np.empty((n * k, 48, 8), np.int16) for _ in range(4)]
    during = []
    stop = threading.Event()
    ticks = [0]

    def count():
        while not stop.is_set():
            ticks[0] += 1
            time.sleep(0.0001)          # gives the GIL back: the main thread takes it without waiting out an interval

    interval = sys.getswitchinterval()
    t = threading.Thread(target=count)
    sys.setswitchinterval(30.0)
    try:
        t.start()
        time.sleep(0.01)
        for i in range(40):
            before = ticks[0]
            gather_rows(outs[i % 4], arrs, order, 768)
            during.append(ticks[0] - before)
    finally:
        sys.setswitchinterval(interval)
        stop.set()
        t.join()
    return during


@needs_c
def test_the_c_copy_lets_other_threads_run_while_it_copies():
    """The copy releases the GIL: a Python thread counts during it. Held through the copy, the GIL would leave every
    count at 0 (copies_other_threads_ran_in); one copy in which the counter moved is the proof, and a loaded machine
    that leaves the counting thread unscheduled through most of the copies still shows it in some."""
    during = copies_other_threads_ran_in(_gather.gather_rows)
    assert any(d > 0 for d in during), during


def test_a_build_of_the_copy_that_holds_the_gil_lets_no_thread_run_in_any_copy(tmp_path):
    """The probe above tells the two builds apart: _gather.c compiled without its GIL release reads 0 in all 40."""
    import importlib.util
    import subprocess
    import sysconfig
    if not c_toolchain():
        pytest.skip("no C compiler or Python.h here")
    src = open(os.path.join(os.path.dirname(messages.__file__), "_gather.c")).read()
    assert src.count("Py_BEGIN_ALLOW_THREADS") == 1 and src.count("Py_END_ALLOW_THREADS") == 1
    (tmp_path / "_gather.c").write_text(src.replace("Py_BEGIN_ALLOW_THREADS", "").replace("Py_END_ALLOW_THREADS", ""))
    so = tmp_path / ("_gather" + sysconfig.get_config_var("EXT_SUFFIX"))
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    subprocess.run([cc, "-O2", "-shared", "-fPIC", "-I" + sysconfig.get_paths()["include"], "-I" + np.get_include(),
                    str(tmp_path / "_gather.c"), "-o", str(so)], check=True)
    spec = importlib.util.spec_from_file_location("_gather", so)
    held = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(held)
    assert copies_other_threads_ran_in(held.gather_rows) == [0] * 40
