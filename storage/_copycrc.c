/* storage._copycrc: copy a buffer into another and compute its CRC-32C in one pass.

   The produce path copies every payload into an aligned WAL block and later into an object
   buffer, and checksums it both times (the WAL record CRC, the object block CRC). Done apart
   (memmove, then the crc32c package) each byte is read twice and every destination line is
   fetched before it is overwritten; here each source word is loaded once, stored (32-byte
   non-temporal stores with AVX2: no fetch, no cache pollution) and fed to the CRC, with the
   interpreter lock released for large copies. CRC-32C (Castagnoli) with the SSE4.2 crc32
   instruction, three independent lanes combined with precomputed "shift by n zero bytes"
   tables (the usual way to hide the instruction's latency). Same value and chaining as
   crc32c.crc32c(data, value).

   Without SSE4.2 (or off x86-64) HARDWARE is False and storage/copycrc.py uses memmove + the
   crc32c package instead. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#define POLY 0x82f63b78u          /* CRC-32C, reflected */
#define LONG_LANE 4096            /* bytes per lane in a long step (3 lanes: 12 KiB) */
#define SHORT_LANE 256            /* bytes per lane in a short step (3 lanes: 768 B) */
#define NOGIL_FROM (64 * 1024)    /* release the interpreter lock from this many bytes */
/* the stream copy prefetches its source this far ahead (three 12 KiB steps): each lane is one
   4 KiB page, where the hardware prefetcher stops, so a source not in cache (the object encode
   copies from LogCache frames received a while ago) missed at the start of every lane. 1 MiB,
   source and destination cold: 0.114-0.139 -> 0.085-0.100 ms; source hot: unchanged
   (bench/HISTORY.md, session 16; 12 KiB ahead 0.093-0.107, 72 KiB 0.088-0.102) */
#ifndef PF_AHEAD
#define PF_AHEAD (9 * LONG_LANE)
#endif

static uint32_t long_shift[4][256];
static uint32_t short_shift[4][256];
static uint32_t byte_table[256];
static int have_hw = 0;

/* multiply the 32x32 GF(2) matrix `mat` by `vec` */
static uint32_t gf2_times(const uint32_t *mat, uint32_t vec) {
    uint32_t sum = 0;
    while (vec) {
        if (vec & 1) sum ^= *mat;
        vec >>= 1;
        mat++;
    }
    return sum;
}

static void gf2_square(uint32_t *square, const uint32_t *mat) {
    for (int n = 0; n < 32; n++) square[n] = gf2_times(mat, mat[n]);
}

/* the operator that appends `len` zero bytes to a raw (not inverted) CRC register */
static void zeros_op(uint32_t *even, size_t len) {
    uint32_t odd[32];
    uint32_t row = 1;
    odd[0] = POLY;                 /* one zero bit */
    for (int n = 1; n < 32; n++) { odd[n] = row; row <<= 1; }
    gf2_square(even, odd);         /* two zero bits */
    gf2_square(odd, even);         /* four zero bits */
    /* first square gives one zero byte; each further square doubles it */
    do {
        gf2_square(even, odd);
        len >>= 1;
        if (len == 0) return;
        gf2_square(odd, even);
        len >>= 1;
    } while (len);
    memcpy(even, odd, sizeof(odd));
}

static void zeros_tables(uint32_t table[4][256], size_t len) {
    uint32_t op[32];
    zeros_op(op, len);
    for (uint32_t n = 0; n < 256; n++) {
        table[0][n] = gf2_times(op, n);
        table[1][n] = gf2_times(op, n << 8);
        table[2][n] = gf2_times(op, n << 16);
        table[3][n] = gf2_times(op, n << 24);
    }
}

static inline uint32_t shift(uint32_t table[4][256], uint32_t crc) {
    return table[0][crc & 0xff] ^ table[1][(crc >> 8) & 0xff] ^
           table[2][(crc >> 16) & 0xff] ^ table[3][crc >> 24];
}

/* bitwise-table CRC: the reference the self-test compares against */
static uint32_t crc_sw(uint32_t crc, const unsigned char *p, size_t n) {
    crc = ~crc;
    while (n--) crc = byte_table[(crc ^ *p++) & 0xff] ^ (crc >> 8);
    return ~crc;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <nmmintrin.h>
#include <immintrin.h>
#define HW_TARGET __attribute__((target("sse4.2")))

/* whole steps of three `lane`-byte lanes checksummed side by side, then combined (`table`
   appends `lane` zero bytes to a register); moves *pp and *np past them */
HW_TARGET static inline uint64_t crc_lanes(uint64_t c0, const unsigned char **pp, size_t *np,
                                           size_t lane, uint32_t table[4][256]) {
    const unsigned char *p = *pp;
    size_t n = *np;
    while (n >= 3 * lane) {
        uint64_t c1 = 0, c2 = 0;
        const unsigned char *end = p + lane;
        do {
            uint64_t a, b, c;
            memcpy(&a, p, 8); memcpy(&b, p + lane, 8); memcpy(&c, p + 2 * lane, 8);
            c0 = _mm_crc32_u64(c0, a);
            c1 = _mm_crc32_u64(c1, b);
            c2 = _mm_crc32_u64(c2, c);
            p += 8;
        } while (p < end);
        c0 = shift(table, (uint32_t)c0) ^ (uint32_t)c1;
        c0 = shift(table, (uint32_t)c0) ^ (uint32_t)c2;
        p += 2 * lane;
        n -= 3 * lane;
    }
    *pp = p;
    *np = n;
    return c0;
}

/* CRC of the n bytes at p (raw register in, raw register out) */
HW_TARGET static uint32_t crc_hw(uint32_t crc, const unsigned char *p, size_t n) {
    uint64_t c0 = crc;
    while (n && ((uintptr_t)p & 7)) { c0 = _mm_crc32_u8((uint32_t)c0, *p++); n--; }
    c0 = crc_lanes(c0, &p, &n, LONG_LANE, long_shift);
    c0 = crc_lanes(c0, &p, &n, SHORT_LANE, short_shift);
    while (n >= 8) {
        uint64_t a;
        memcpy(&a, p, 8);
        c0 = _mm_crc32_u64(c0, a);
        p += 8;
        n -= 8;
    }
    while (n--) c0 = _mm_crc32_u8((uint32_t)c0, *p++);
    return (uint32_t)c0;
}

static int cpu_has_sse42(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("sse4.2");
}
#else
static uint32_t crc_hw(uint32_t crc, const unsigned char *p, size_t n) {
    return ~crc_sw(~crc, p, n);
}
static int cpu_has_sse42(void) { return 0; }
#endif

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
/* copy n bytes from p to dst and return their CRC (raw register in and out), reading p once:
   each word loaded is stored and fed to the CRC of its lane (three lanes of LONG_LANE bytes
   per step); the tail (< 12 KiB) is copied and then checksummed from dst, still in L1. */
HW_TARGET static uint32_t copy_crc_scalar(unsigned char *dst, const unsigned char *p, size_t n,
                                          uint32_t crc) {
    uint64_t c0 = crc;
    while (n >= 3 * LONG_LANE) {
        uint64_t c1 = 0, c2 = 0;
        const unsigned char *end = p + LONG_LANE;
        do {
            uint64_t a, b, c;
            memcpy(&a, p, 8); memcpy(&b, p + LONG_LANE, 8); memcpy(&c, p + 2 * LONG_LANE, 8);
            memcpy(dst, &a, 8); memcpy(dst + LONG_LANE, &b, 8); memcpy(dst + 2 * LONG_LANE, &c, 8);
            c0 = _mm_crc32_u64(c0, a);
            c1 = _mm_crc32_u64(c1, b);
            c2 = _mm_crc32_u64(c2, c);
            p += 8;
            dst += 8;
        } while (p < end);
        c0 = shift(long_shift, (uint32_t)c0) ^ (uint32_t)c1;
        c0 = shift(long_shift, (uint32_t)c0) ^ (uint32_t)c2;
        p += 2 * LONG_LANE;
        dst += 2 * LONG_LANE;
        n -= 3 * LONG_LANE;
    }
    memcpy(dst, p, n);
    return crc_hw((uint32_t)c0, dst, n);
}

/* The same with 32-byte loads and non-temporal stores (AVX2): the destination (a WAL block
   the device reads by DMA, an object buffer written out later) is not read back by this CPU
   soon, so its lines are neither fetched before being overwritten nor kept in the cache.
   Measured on 1 MiB payloads (HISTORY.md, session 15): 0.06-0.08 ms vs 0.12-0.14 ms for
   memmove + crc32c with the source in cache, 0.11-0.12 vs 0.16 with neither in cache. */
__attribute__((target("sse4.2,avx2")))
static uint32_t copy_crc_stream(unsigned char *dst, const unsigned char *p, size_t n,
                                uint32_t crc) {
    uint64_t c0 = crc;
    size_t head = (32 - ((uintptr_t)dst & 31)) & 31;    /* align dst for the stream stores */
    if (head > n) head = n;
    memcpy(dst, p, head);
    c0 = crc_hw((uint32_t)c0, p, head);
    dst += head;
    p += head;
    n -= head;
    int streamed = 0;
    while (n >= 3 * LONG_LANE) {
        uint64_t c1 = 0, c2 = 0;
        const unsigned char *end = p + LONG_LANE;
        streamed = 1;
        do {
            if (!((uintptr_t)p & 63) && n >= 3 * LONG_LANE + PF_AHEAD) {   /* once a line */
                _mm_prefetch((const char *)(p + PF_AHEAD), _MM_HINT_T0);
                _mm_prefetch((const char *)(p + LONG_LANE + PF_AHEAD), _MM_HINT_T0);
                _mm_prefetch((const char *)(p + 2 * LONG_LANE + PF_AHEAD), _MM_HINT_T0);
            }
            __m256i a = _mm256_loadu_si256((const __m256i *)p);
            __m256i b = _mm256_loadu_si256((const __m256i *)(p + LONG_LANE));
            __m256i c = _mm256_loadu_si256((const __m256i *)(p + 2 * LONG_LANE));
            _mm256_stream_si256((__m256i *)dst, a);
            _mm256_stream_si256((__m256i *)(dst + LONG_LANE), b);
            _mm256_stream_si256((__m256i *)(dst + 2 * LONG_LANE), c);
            for (int k = 0; k < 32; k += 8) {      /* the words just loaded: L1 hits */
                uint64_t x, y, z;
                memcpy(&x, p + k, 8);
                memcpy(&y, p + LONG_LANE + k, 8);
                memcpy(&z, p + 2 * LONG_LANE + k, 8);
                c0 = _mm_crc32_u64(c0, x);
                c1 = _mm_crc32_u64(c1, y);
                c2 = _mm_crc32_u64(c2, z);
            }
            p += 32;
            dst += 32;
        } while (p < end);
        c0 = shift(long_shift, (uint32_t)c0) ^ (uint32_t)c1;
        c0 = shift(long_shift, (uint32_t)c0) ^ (uint32_t)c2;
        p += 2 * LONG_LANE;
        dst += 2 * LONG_LANE;
        n -= 3 * LONG_LANE;
    }
    if (streamed) _mm_sfence();     /* order the stream stores before anyone is told */
    memcpy(dst, p, n);
    return crc_hw((uint32_t)c0, dst, n);
}

static int cpu_has_avx2(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2");
}
#else
static uint32_t copy_crc_scalar(unsigned char *dst, const unsigned char *p, size_t n,
                                uint32_t crc) {
    memcpy(dst, p, n);
    return crc_hw(crc, dst, n);
}
#define copy_crc_stream copy_crc_scalar
static int cpu_has_avx2(void) { return 0; }
#endif

typedef uint32_t (*copy_fn)(unsigned char *, const unsigned char *, size_t, uint32_t);
static copy_fn copy_crc_raw = copy_crc_scalar;

/* The writable destination and the source of a copy, with the source fitting at `offset` and
   `split` (copy_crc_split; 0 otherwise) inside the source; -1 with an exception set if not. */
static int take_buffers(PyObject *dst_obj, Py_ssize_t offset, PyObject *src_obj,
                        Py_buffer *dst, Py_buffer *src, Py_ssize_t split, const char *name) {
    if (PyObject_GetBuffer(dst_obj, dst, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    if (PyObject_GetBuffer(src_obj, src, PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(dst);
        return -1;
    }
    if (offset < 0 || offset > dst->len || src->len > dst->len - offset) {
        PyErr_Format(PyExc_ValueError, "%s: source does not fit at that offset", name);
    } else if (split < 0 || split > src->len) {
        PyErr_Format(PyExc_ValueError, "%s: split outside the source", name);
    } else {
        return 0;
    }
    PyBuffer_Release(src);
    PyBuffer_Release(dst);
    return -1;
}

PyDoc_STRVAR(copy_crc_doc,
"copy_crc(dst, offset, src, value=0) -> int\n\n"
"Copy the bytes of `src` into the writable buffer `dst` at `offset` and return their\n"
"CRC-32C continued from `value` (crc32c.crc32c(src, value)), reading `src` once.");

static PyObject *copy_crc(PyObject *self, PyObject *args) {
    PyObject *dst_obj, *src_obj;
    Py_ssize_t offset;
    unsigned long value = 0;
    Py_buffer dst, src;
    if (!PyArg_ParseTuple(args, "OnO|k:copy_crc", &dst_obj, &offset, &src_obj, &value))
        return NULL;
    if (take_buffers(dst_obj, offset, src_obj, &dst, &src, 0, "copy_crc") < 0)
        return NULL;
    uint32_t crc = ~(uint32_t)value;
    unsigned char *d = (unsigned char *)dst.buf + offset;
    const unsigned char *s = (const unsigned char *)src.buf;
    size_t n = (size_t)src.len;
    if (n >= NOGIL_FROM) {
        Py_BEGIN_ALLOW_THREADS
        crc = copy_crc_raw(d, s, n, crc);
        Py_END_ALLOW_THREADS
    } else {
        crc = copy_crc_raw(d, s, n, crc);
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    return PyLong_FromUnsignedLong(~crc);
}

/* CRC combination (as zlib's crc32_combine, for CRC-32C): the CRC of A || B from crc(A),
   crc(B) and len(B), by multiplying crc(A) with x^(8 len(B)) modulo the polynomial.
   x2n_table[k] is x^(2^k); a combination costs ~ log2(len) multiplications of 32 steps. */
static uint32_t x2n_table[32];

static uint32_t multmodp(uint32_t a, uint32_t b) {     /* a * b mod P (reflected); a != 0 */
    uint32_t m = 1u << 31, p = 0;
    for (;;) {
        if (a & m) {
            p ^= b;
            if ((a & (m - 1)) == 0) break;
        }
        m >>= 1;
        b = b & 1 ? (b >> 1) ^ POLY : b >> 1;
    }
    return p;
}

static uint32_t x2nmodp(size_t n, unsigned k) {        /* x^(n * 2^k) mod P */
    uint32_t p = 1u << 31;                             /* x^0 */
    while (n) {
        if (n & 1) p = multmodp(x2n_table[k & 31], p);
        n >>= 1;
        k++;
    }
    return p;
}

static uint32_t crc_combine(uint32_t crc1, uint32_t crc2, size_t len2) {
    return multmodp(x2nmodp(len2, 3), crc1) ^ crc2;
}

PyDoc_STRVAR(copy_crc_split_doc,
"copy_crc_split(dst, offset, src, value, split) -> (crc, tail_crc)\n\n"
"copy_crc(dst, offset, src, value) that also returns the CRC-32C of src[split:] alone\n"
"(crc32c.crc32c(src[split:])), from the same single pass: the WAL copies a produce batch\n"
"and checks the client's batch CRC (which covers the batch from its 21st byte) at once.");

static PyObject *copy_crc_split(PyObject *self, PyObject *args) {
    PyObject *dst_obj, *src_obj;
    Py_ssize_t offset, split;
    unsigned long value = 0;
    Py_buffer dst, src;
    if (!PyArg_ParseTuple(args, "OnOkn:copy_crc_split", &dst_obj, &offset, &src_obj, &value,
                          &split))
        return NULL;
    if (take_buffers(dst_obj, offset, src_obj, &dst, &src, split, "copy_crc_split") < 0)
        return NULL;
    unsigned char *d = (unsigned char *)dst.buf + offset;
    const unsigned char *s = (const unsigned char *)src.buf;
    size_t n = (size_t)src.len, k = (size_t)split;
    uint32_t head, tail;
    if (n >= NOGIL_FROM) {
        Py_BEGIN_ALLOW_THREADS
        head = ~copy_crc_raw(d, s, k, ~(uint32_t)value);
        tail = ~copy_crc_raw(d + k, s + k, n - k, ~0u);
        Py_END_ALLOW_THREADS
    } else {
        head = ~copy_crc_raw(d, s, k, ~(uint32_t)value);
        tail = ~copy_crc_raw(d + k, s + k, n - k, ~0u);
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    return Py_BuildValue("kk", (unsigned long)crc_combine(head, tail, n - k),
                         (unsigned long)tail);
}

PyDoc_STRVAR(crc_doc,
"crc(data, value=0) -> int\n\nCRC-32C of `data` continued from `value` (for tests).");

static PyObject *crc(PyObject *self, PyObject *args) {
    Py_buffer buf;
    unsigned long value = 0;
    if (!PyArg_ParseTuple(args, "y*|k:crc", &buf, &value))
        return NULL;
    uint32_t c;
    Py_BEGIN_ALLOW_THREADS
    c = ~crc_hw(~(uint32_t)value, (const unsigned char *)buf.buf, (size_t)buf.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&buf);
    return PyLong_FromUnsignedLong(c);
}

/* One device read at a time across the threads of the process (see read_pieces). */
static pthread_mutex_t device_lock = PTHREAD_MUTEX_INITIALIZER;

PyDoc_STRVAR(read_pieces_doc,
"read_pieces(fd, buf, offset, piece) -> int\n\n"
"Fill the writable buffer `buf` from file `fd` at `offset`, `piece` bytes per pread, each\n"
"pread alone on the device among the callers of this function (one process-wide lock),\n"
"with the interpreter lock released for the whole loop. Returns the bytes read: fewer than\n"
"len(buf) only at the end of the file (a pread answering short). Raises OSError on an\n"
"error (EINTR is retried).\n"
"storage/objects/store.py reads cold spans so while producers append: a WAL write then\n"
"waits behind one small piece, and the reading thread takes the interpreter lock once per\n"
"span, not once per piece.");

static PyObject *read_pieces(PyObject *self, PyObject *args) {
    int fd;
    PyObject *obj;
    long long offset;
    Py_ssize_t piece;
    Py_buffer buf;
    if (!PyArg_ParseTuple(args, "iOLn:read_pieces", &fd, &obj, &offset, &piece))
        return NULL;
    if (piece <= 0 || offset < 0) {
        PyErr_SetString(PyExc_ValueError, "read_pieces: piece must be > 0 and offset >= 0");
        return NULL;
    }
    if (PyObject_GetBuffer(obj, &buf, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    unsigned char *p = (unsigned char *)buf.buf;
    size_t len = (size_t)buf.len, got = 0;
    int err = 0;
    Py_BEGIN_ALLOW_THREADS
    while (got < len) {
        size_t n = len - got < (size_t)piece ? len - got : (size_t)piece;
        pthread_mutex_lock(&device_lock);
        ssize_t r = pread(fd, p + got, n, (off_t)(offset + (long long)got));
        int e = errno;
        pthread_mutex_unlock(&device_lock);
        if (r < 0) {
            if (e == EINTR) continue;
            err = e;
            break;
        }
        if (r == 0) break;
        got += (size_t)r;
        if ((size_t)r < n) break;         /* a regular file answers short only at its end */
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&buf);
    if (err) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromSize_t(got);
}

static PyMethodDef methods[] = {
    {"copy_crc", copy_crc, METH_VARARGS, copy_crc_doc},
    {"copy_crc_split", copy_crc_split, METH_VARARGS, copy_crc_split_doc},
    {"crc", crc, METH_VARARGS, crc_doc},
    {"read_pieces", read_pieces, METH_VARARGS, read_pieces_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_copycrc",
    "Fused copy + CRC-32C for the produce path (see storage/copycrc.py).", -1, methods,
};

/* the hardware paths must agree with the bitwise reference, across every step size */
static int self_test(copy_fn fn) {
    static unsigned char buf[3 * LONG_LANE * 2 + 777];
    static unsigned char out[sizeof(buf) + 64];
    uint32_t x = 12345;
    for (size_t i = 0; i < sizeof(buf); i++) {
        x = x * 1103515245u + 12345u;
        buf[i] = (unsigned char)(x >> 16);
    }
    static const size_t lens[] = {0, 1, 7, 8, 9, 31, 33, 767, 768, 769, 3 * LONG_LANE - 1,
                                  3 * LONG_LANE, 3 * LONG_LANE + 5, 3 * LONG_LANE + 40,
                                  sizeof(buf) - 3};
    for (size_t i = 0; i < sizeof(lens) / sizeof(lens[0]); i++) {
        const unsigned char *p = buf + (i & 3);
        unsigned char *o = out + (i * 5) % 37;
        uint32_t want = crc_sw(0x1234u, p, lens[i]);
        uint32_t got = ~fn(o, p, lens[i], ~0x1234u);
        if (want != got || memcmp(o, p, lens[i]) != 0) return 0;
    }
    return 1;
}

PyMODINIT_FUNC PyInit__copycrc(void) {
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++) c = c & 1 ? (c >> 1) ^ POLY : c >> 1;
        byte_table[n] = c;
    }
    uint32_t x = 1u << 30;                                 /* x^1 */
    x2n_table[0] = x;
    for (int k = 1; k < 32; k++) x2n_table[k] = x = multmodp(x, x);
    zeros_tables(long_shift, LONG_LANE);
    zeros_tables(short_shift, SHORT_LANE);
    have_hw = cpu_has_sse42() && self_test(copy_crc_scalar);
    if (have_hw && cpu_has_avx2() && self_test(copy_crc_stream))
        copy_crc_raw = copy_crc_stream;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddIntConstant(m, "HARDWARE", have_hw) < 0 ||
            PyModule_AddIntConstant(m, "STREAM_STORES", copy_crc_raw == copy_crc_stream) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
