/* routing_replay.producer._gather: the producer's request-major copy of merged decode steps, in C.
 *
 * gather_rows(out, arrays, order, row_bytes, stream=True) writes, for i = 0..n-1 and s = 0..k-1 in that order,
 *     out[(i * k + s) * row_bytes ...] = arrays[s][order[i] * row_bytes ...]      (row_bytes bytes each)
 * i.e. request order[i]'s row of every step in a row, then the next request's: producer/outpool.py's
 * request_major, whose numpy version (a scatter per step) is its reference and its fallback.
 *
 * Why C: the destination is megabytes written once and sent (not read again on this thread), and numpy's copies
 * store through the cache: every destination line is first read for ownership. Here the destination is written in
 * one sequential pass with non-temporal (streaming) stores where the rows allow it (x86-64, 16-byte-aligned rows,
 * at least NT_MIN_BYTES in all), memcpy per row elsewhere. bench/request_major_copy.py measures both against numpy.
 * The copy runs with the GIL released: the engine's thread keeps running beside the producer's.
 *
 * Every index is checked against the arrays' size before a byte is copied (ValueError); every buffer must be
 * C-contiguous, the arrays of one size, `out` writable and exactly n * k * row_bytes bytes.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

/* below this many bytes the destination fits in L2 and is better left in the cache for the send that follows */
#define NT_MIN_BYTES (2u << 20)
#define MAX_STEPS 65536

static void copy_rows(char *dst, char *const *src, const int64_t *order, Py_ssize_t n, Py_ssize_t k,
                      Py_ssize_t row, int streaming)
{
#if defined(__SSE2__)
    if (streaming) {
        for (Py_ssize_t i = 0; i < n; i++) {
            const Py_ssize_t at = (Py_ssize_t)order[i] * row;
            for (Py_ssize_t s = 0; s < k; s++) {
                const char *p = src[s] + at;
                for (Py_ssize_t b = 0; b < row; b += 16)
                    _mm_stream_si128((__m128i *)(dst + b), _mm_loadu_si128((const __m128i *)(p + b)));
                dst += row;
            }
        }
        _mm_sfence();
        return;
    }
#else
    (void)streaming;
#endif
    for (Py_ssize_t i = 0; i < n; i++) {
        const Py_ssize_t at = (Py_ssize_t)order[i] * row;
        for (Py_ssize_t s = 0; s < k; s++) {
            memcpy(dst, src[s] + at, (size_t)row);
            dst += row;
        }
    }
}

/* a native little-endian 8-byte signed integer buffer ("l" or "q", with "@", "=" or "<" before it) */
static int is_int64(const Py_buffer *b)
{
    const char *f = b->format;
    if (b->itemsize != 8 || f == NULL)
        return 0;
    if (*f == '@' || *f == '=' || *f == '<')
        f++;
    return (f[0] == 'l' || f[0] == 'q') && f[1] == '\0';
}

static PyObject *gather_rows(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *out_obj, *arrays_obj, *order_obj;
    Py_ssize_t row;
    int stream = 1;
    if (!PyArg_ParseTuple(args, "OOOn|p:gather_rows", &out_obj, &arrays_obj, &order_obj, &row, &stream))
        return NULL;
    if (row <= 0) {
        PyErr_Format(PyExc_ValueError, "row_bytes must be positive, got %zd", row);
        return NULL;
    }
    PyObject *seq = PySequence_Fast(arrays_obj, "arrays must be a sequence of buffers");
    if (seq == NULL)
        return NULL;
    const Py_ssize_t k = PySequence_Fast_GET_SIZE(seq);
    if (k < 1 || k > MAX_STEPS) {
        PyErr_Format(PyExc_ValueError, "arrays must hold 1 to %d buffers, got %zd", MAX_STEPS, k);
        Py_DECREF(seq);
        return NULL;
    }
    Py_buffer out = {0}, order = {0};
    Py_ssize_t got = 0;
    PyObject *result = NULL;
    Py_buffer *views = PyMem_Calloc((size_t)k, sizeof(Py_buffer));
    char **src = PyMem_Calloc((size_t)k, sizeof(char *));
    if (views == NULL || src == NULL) {
        PyErr_NoMemory();
        goto done;
    }

    if (PyObject_GetBuffer(out_obj, &out, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0)
        goto done;
    if (PyObject_GetBuffer(order_obj, &order, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        goto done;
    if (!is_int64(&order)) {
        PyErr_Format(PyExc_TypeError, "order must be int64, got format %s itemsize %zd",
                     order.format ? order.format : "?", order.itemsize);
        goto done;
    }
    const Py_ssize_t n = order.len / 8;
    Py_ssize_t src_len = -1;
    for (; got < k; got++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, got), &views[got], PyBUF_C_CONTIGUOUS) < 0)
            goto done;
        if (src_len < 0)
            src_len = views[got].len;
        if (views[got].len != src_len) {
            PyErr_Format(PyExc_ValueError, "arrays differ in size: %zd bytes, then %zd (array %zd)", src_len,
                         views[got].len, got);
            got++;
            goto done;
        }
        src[got] = (char *)views[got].buf;
    }
    if (src_len % row) {
        PyErr_Format(PyExc_ValueError, "an array's %zd bytes are not whole rows of %zd bytes", src_len, row);
        goto done;
    }
    const Py_ssize_t rows = src_len / row;
    if (n && (k > PY_SSIZE_T_MAX / n || n * k > PY_SSIZE_T_MAX / row)) {
        PyErr_SetString(PyExc_OverflowError, "n * k * row_bytes overflows");
        goto done;
    }
    if (out.len != n * k * row) {
        PyErr_Format(PyExc_ValueError, "out holds %zd bytes, not %zd (%zd requests x %zd steps x %zd bytes)",
                     out.len, n * k * row, n, k, row);
        goto done;
    }
    const int64_t *idx = (const int64_t *)order.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (idx[i] < 0 || idx[i] >= rows) {
            PyErr_Format(PyExc_ValueError, "order[%zd] = %lld is outside the arrays' %zd rows", i,
                         (long long)idx[i], rows);
            goto done;
        }
    }
    const int streaming = stream && (row % 16 == 0) && ((uintptr_t)out.buf % 16 == 0) && (size_t)out.len >= NT_MIN_BYTES;
    Py_BEGIN_ALLOW_THREADS
    copy_rows((char *)out.buf, src, idx, n, k, row, streaming);
    Py_END_ALLOW_THREADS
    result = PyBool_FromLong(streaming);
done:
    for (Py_ssize_t j = 0; j < got; j++)
        PyBuffer_Release(&views[j]);
    if (order.obj)
        PyBuffer_Release(&order);
    if (out.obj)
        PyBuffer_Release(&out);
    PyMem_Free(views);
    PyMem_Free(src);
    Py_DECREF(seq);
    return result;
}

static PyMethodDef methods[] = {
    {"gather_rows", gather_rows, METH_VARARGS,
     "gather_rows(out, arrays, order, row_bytes, stream=True) -> bool: out's row i*k+s = arrays[s]'s row "
     "order[i] (k = len(arrays)); True where it streamed (non-temporal stores; stream=False: never). Releases the "
     "GIL while it copies."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_gather",
    .m_doc = "The producer's request-major copy in C (producer/outpool.py request_major).",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__gather(void) { return PyModule_Create(&module); }
