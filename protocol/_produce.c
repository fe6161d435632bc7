/* protocol._produce: the envelope of the common Produce request in one C call.

scan_produce(frame) reads a request frame (the bytes after the length prefix) that is a
Produce v3-v12 request for one topic and one partition, with acks -1 or 1, no transactional id,
no tagged fields, and records starting with a v2 batch header without a producer id (the
shape of every small linger-0 request of a plain producer), and returns

    (api_version, correlation_id, client_id or None, acks, timeout_ms, topic name,
     partition index, records start, records length)

For anything else - another API, another shape, a truncated or malformed frame, text that is
not UTF-8 - it returns None, and protocol.parse_request decodes the frame in Python as before
(raising the same typed errors). So it only ever answers for frames the Python parser reads
to exactly these values.
*/
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "crc32c.h"          /* crc_hw, crc_soft (shared with storage/_copycrc.c) */

typedef struct {
    const unsigned char *p;
    Py_ssize_t pos, end;
    int ok;
} rd;

static int32_t be32(const unsigned char *p) {
    return (int32_t)(((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8)
                     | (uint32_t)p[3]);
}

static int16_t be16(const unsigned char *p) {
    return (int16_t)(((uint16_t)p[0] << 8) | (uint16_t)p[1]);
}

static int32_t r_i16(rd *r) {
    if (r->end - r->pos < 2) { r->ok = 0; return 0; }
    int32_t v = be16(r->p + r->pos);
    r->pos += 2;
    return v;
}

static int32_t r_i32(rd *r) {
    if (r->end - r->pos < 4) { r->ok = 0; return 0; }
    int32_t v = be32(r->p + r->pos);
    r->pos += 4;
    return v;
}

/* an unsigned varint of at most 5 bytes (protocol.frames.read_uvarint's limit) */
static int64_t r_uvarint(rd *r) {
    int64_t value = 0;
    int shift = 0;
    for (;;) {
        if (r->pos >= r->end) { r->ok = 0; return 0; }
        unsigned char b = r->p[r->pos++];
        value |= (int64_t)(b & 0x7F) << shift;
        if (!(b & 0x80)) return value;
        shift += 7;
        if (shift > 28) { r->ok = 0; return 0; }
    }
}

/* a string/bytes/array length: compact (uvarint - 1) when flexible, else int16/int32 */
static int64_t r_len(rd *r, int flexible, int wide) {
    if (flexible) return r_uvarint(r) - 1;
    return wide ? r_i32(r) : r_i16(r);
}

static PyObject *scan_produce(PyObject *self, PyObject *arg) {
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) return NULL;
    PyObject *result = NULL, *client = NULL, *topic = NULL;
    rd r = {(const unsigned char *)view.buf, 0, view.len, 1};
    if (r.end < 10) goto none;
    if (be16(r.p) != 0) goto none;                          /* Produce only */
    int version = be16(r.p + 2);
    if (version < 3 || version > 12) goto none;
    int32_t corr = be32(r.p + 4);
    int flexible = version >= 9;
    r.pos = 8;
    int64_t n = r_i16(&r);                                  /* client id: always int16 */
    if (!r.ok) goto none;
    if (n >= 0) {
        if (r.end - r.pos < n) goto none;
        client = PyUnicode_DecodeUTF8((const char *)r.p + r.pos, n, NULL);
        if (client == NULL) { PyErr_Clear(); goto none; }
        r.pos += n;
    } else {
        client = Py_NewRef(Py_None);
    }
    if (flexible && (r_uvarint(&r) != 0 || !r.ok)) goto none;   /* header tagged fields */
    n = r_len(&r, flexible, 0);                             /* transactional id: null */
    if (!r.ok || n >= 0) goto none;
    int32_t acks = r_i16(&r);
    int32_t timeout = r_i32(&r);
    if (!r.ok || (acks != -1 && acks != 1)) goto none;
    if (r_len(&r, flexible, 1) != 1 || !r.ok) goto none;   /* one topic */
    n = r_len(&r, flexible, 0);
    if (!r.ok || n < 0 || r.end - r.pos < n) goto none;
    topic = PyUnicode_DecodeUTF8((const char *)r.p + r.pos, n, NULL);
    if (topic == NULL) { PyErr_Clear(); goto none; }
    r.pos += n;
    if (r_len(&r, flexible, 1) != 1 || !r.ok) goto none;   /* one partition */
    int32_t index = r_i32(&r);
    n = r_len(&r, flexible, 1);
    if (!r.ok || n < 61 || r.end - r.pos < n) goto none;
    Py_ssize_t start = r.pos;
    const unsigned char *b = r.p + start;
    if (b[16] != 2) goto none;                              /* a v2 batch first */
    for (int i = 43; i < 51; i++)                           /* without a producer id */
        if (b[i] != 0xff) goto none;
    r.pos += n;
    if (flexible) {                                         /* partition, topic, request tags */
        for (int i = 0; i < 3; i++)
            if (r_uvarint(&r) != 0 || !r.ok) goto none;
    }
    result = Py_BuildValue("iiNiiNinn", version, (int)corr, client, (int)acks, (int)timeout,
                           topic, (int)index, start, (Py_ssize_t)n);
    client = topic = NULL;                                  /* stolen by N */
    PyBuffer_Release(&view);
    return result;
none:
    Py_XDECREF(client);
    Py_XDECREF(topic);
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
}


/* ---- CRC-32C (Castagnoli), for the batch check below: crc32c.h, shared with
   storage/_copycrc.c (three-lane SSE4.2 from 768 bytes, slicing-by-8 without SSE4.2) ---- */
static int have_sse42 = 0;

static uint32_t crc32c(const unsigned char *p, size_t n) {
    if (have_sse42) return ~crc_hw(0xFFFFFFFFu, p, n);
    return ~crc_soft(0xFFFFFFFFu, p, n);
}

static int64_t be64(const unsigned char *p) {
    uint64_t v = 0;
    for (int i = 0; i < 8; i++) v = (v << 8) | p[i];
    return (int64_t)v;
}

static void put64(unsigned char *p, int64_t x) {
    uint64_t v = (uint64_t)x;
    for (int i = 7; i >= 0; i--) { p[i] = (unsigned char)(v & 0xff); v >>= 8; }
}

static void put32(unsigned char *p, int32_t x) {
    uint32_t v = (uint32_t)x;
    p[0] = v >> 24; p[1] = v >> 16; p[2] = v >> 8; p[3] = v;
}

/* stamp_plain(buf, base, epoch, max_bytes, zstd_ok, earliest, latest, defer_from)
   broker.partition's checks of a payload of plain v2 batches and its stamping, in one call:
   every batch whole (iter_batches), magic 2, its CRC-32C right, records counted right
   (validate_batch), no producer id and neither transactional nor control, at most max_bytes,
   a known compression (zstd only if zstd_ok), a max timestamp set and the CreateTime bounds
   kept (_header_checks); then base offsets from ``base`` and the leader epoch written in
   place (_stamp, CreateTime). Returns (records, batches, max timestamp, deferred CRC), or None
   - having changed nothing - for anything the Python path must see: an error to answer,
   anything unusual. The deferred CRC is None, except for a lone batch of defer_from bytes or
   more: its CRC-32C is not computed here but returned, for the WAL's copy to check (a pass
   here read every byte of a 1 MiB batch a second time: 7 % of the broker's CPU under raw
   1 MiB produce); its other checks and its stamping are done here, which spares such a
   request the Python checks (_prepare, _header_checks, _stamp: ~25 Python calls). */
static PyObject *stamp_plain(PyObject *self, PyObject *args) {
    PyObject *obj;
    long long base, max_bytes, earliest, latest, defer_from;
    int epoch, zstd_ok;
    if (!PyArg_ParseTuple(args, "OLiLpLLL", &obj, &base, &epoch, &max_bytes, &zstd_ok,
                          &earliest, &latest, &defer_from))
        return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(obj, &view, PyBUF_WRITABLE) < 0) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    unsigned char *buf = (unsigned char *)view.buf;
    Py_ssize_t end = view.len, pos = 0;
    long long count = 0, batches = 0, max_ts_all = -1;
    if (end <= 0) goto none;
    /* a lone batch of defer_from bytes or more: its CRC is left to the WAL's copy */
    int defer = end >= defer_from && end >= 61 && (long long)be32(buf + 8) + 12 == end;
    while (pos < end) {                                  /* checks only: nothing written */
        if (end - pos < 61) goto none;
        unsigned char *b = buf + pos;
        int32_t length = be32(b + 8);
        if (b[16] != 2 || length < 49 || (long long)length + 12 > end - pos) goto none;
        int16_t attrs = be16(b + 21);
        int32_t lod = be32(b + 23);
        int64_t base_ts = be64(b + 27), max_ts = be64(b + 35), pid = be64(b + 43);
        int32_t nrec = be32(b + 57);
        if (nrec <= 0 || lod != nrec - 1) goto none;
        if (pid != -1 || (attrs & 0x30)) goto none;
        if ((long long)length + 12 > max_bytes) goto none;
        int comp = attrs & 7;
        if (comp > 4 || (comp == 4 && !zstd_ok)) goto none;
        if (max_ts < 0 || max_ts > latest || (base_ts >= 0 && base_ts < earliest)) goto none;
        if (!defer && crc32c(b + 21, (size_t)length - 9) != (uint32_t)be32(b + 17)) goto none;
        count += (long long)lod + 1;
        if (max_ts > max_ts_all) max_ts_all = max_ts;
        batches++;
        pos += length + 12;
    }
    long long next = base;
    for (pos = 0; pos < end;) {                          /* stamp */
        unsigned char *b = buf + pos;
        put64(b, next);
        put32(b + 12, epoch);
        next += (long long)be32(b + 23) + 1;
        pos += be32(b + 8) + 12;
    }
    unsigned long want = defer ? (unsigned long)(uint32_t)be32(buf + 17) : 0;
    PyBuffer_Release(&view);
    if (defer)
        return Py_BuildValue("LLLk", count, batches, max_ts_all, want);
    return Py_BuildValue("LLLO", count, batches, max_ts_all, Py_None);
none:
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
}

/* frame_ok(pre, suf, tag, fields, correlation_id, index, base_offset, append_time, log_start)
   protocol.produce_fast.frame_produce_ok's packing in one call: the whole response frame of a
   successful one-partition Produce - length prefix, correlation id, ``tag`` (the flexible
   header's tag byte or nothing), ``pre`` (topic and partition counts and the topic), the
   partition's fields, ``suf`` (record errors, message, tags, throttle time) - as one bytes
   object written once. ``fields``: 0 = index, error 0, base offset (v0-v1); 1 = and the log
   append time (v2-v4); 2 = and the log start offset (v5+). The template pieces come from
   produce_fast's cache; what the Python path spent was its struct packs and four
   concatenations, once per answered small request. */
static PyObject *frame_ok(PyObject *self, PyObject *args) {
    Py_buffer pre, suf, tag;
    int fields, corr, index;
    long long base, append_time, log_start;
    if (!PyArg_ParseTuple(args, "y*y*y*iiiLLL", &pre, &suf, &tag, &fields, &corr, &index,
                          &base, &append_time, &log_start))
        return NULL;
    PyObject *out = NULL;
    if (fields < 0 || fields > 2) {
        PyErr_SetString(PyExc_ValueError, "fields must be 0, 1 or 2");
        goto done;
    }
    Py_ssize_t nfields = 14 + 8 * fields;            /* int32 + int16 + int64 (+ int64 ...) */
    Py_ssize_t size = 4 + tag.len + pre.len + nfields + suf.len;    /* after the prefix */
    if (size > INT32_MAX) {
        PyErr_SetString(PyExc_OverflowError, "response too large");
        goto done;
    }
    out = PyBytes_FromStringAndSize(NULL, 4 + size);
    if (out == NULL) goto done;
    unsigned char *p = (unsigned char *)PyBytes_AS_STRING(out);
    put32(p, (int32_t)size);
    put32(p + 4, corr);
    p += 8;
    memcpy(p, tag.buf, tag.len); p += tag.len;
    memcpy(p, pre.buf, pre.len); p += pre.len;
    put32(p, index);
    p[4] = 0; p[5] = 0;                              /* error code: none */
    put64(p + 6, base);
    p += 14;
    if (fields >= 1) { put64(p, append_time); p += 8; }
    if (fields >= 2) { put64(p, log_start); p += 8; }
    memcpy(p, suf.buf, suf.len);
done:
    PyBuffer_Release(&pre);
    PyBuffer_Release(&suf);
    PyBuffer_Release(&tag);
    return out;
}

/* records_at(buf, pos, end)
   broker.frames.produce_records_at in one call (the Python version stays as its fallback and
   its reference): where the records of a Produce v3-v12 request for one topic and one
   partition begin in its frame and their length, (offset from the frame's start, length), read
   from the frame's first bytes buf[pos:end]; None for anything else; the module's NEED_MORE
   (the same object every time) when those bytes end before the records do. Every step is the
   Python version's, in its order: a read past ``end`` (or a varint longer than 5 bytes) is
   NEED_MORE, the shape checks None. The server calls it once per large frame on its first
   bytes; in Python it was ~10 calls (struct reads, varints, max). */
static PyObject *need_more = NULL;

typedef struct {
    const unsigned char *p;
    Py_ssize_t lim;
    int ok;
} rat;

static int64_t ra_i16(rat *r, Py_ssize_t at) {
    if (at < 0 || at + 2 > r->lim) { r->ok = 0; return 0; }
    return be16(r->p + at);
}

static int64_t ra_i32(rat *r, Py_ssize_t at) {
    if (at < 0 || at + 4 > r->lim) { r->ok = 0; return 0; }
    return be32(r->p + at);
}

static int64_t ra_uvarint(rat *r, Py_ssize_t *at) {
    int64_t value = 0;
    int shift = 0;
    for (;;) {
        if (*at < 0 || *at >= r->lim) { r->ok = 0; return 0; }
        unsigned char b = r->p[(*at)++];
        value |= (int64_t)(b & 0x7F) << shift;
        if (!(b & 0x80)) return value;
        shift += 7;
        if (shift > 28) { r->ok = 0; return 0; }
    }
}

static PyObject *records_at(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "records_at(buf, pos, end)");
        return NULL;
    }
    Py_ssize_t pos = PyLong_AsSsize_t(args[1]);
    if (pos == -1 && PyErr_Occurred()) return NULL;
    Py_ssize_t end = PyLong_AsSsize_t(args[2]);
    if (end == -1 && PyErr_Occurred()) return NULL;
    if (pos < 0 || end < 0) {
        PyErr_SetString(PyExc_ValueError, "records_at: negative position");
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0) return NULL;
    rat r = {(const unsigned char *)view.buf, view.len < end ? view.len : end, 1};
    PyObject *out = NULL;
    int64_t n, p;
    if (end - pos < 10) goto more;
    if (pos + 2 > r.lim) goto more;
    if (r.p[pos] || r.p[pos + 1]) goto none;                 /* api key 0: Produce */
    int64_t version = ra_i16(&r, pos + 2);
    if (!r.ok) goto more;
    if (version < 3 || version > 12) goto none;
    int flexible = version >= 9;
    p = pos + 8;
    n = ra_i16(&r, p);                                       /* client id */
    if (!r.ok) goto more;
    p += 2 + (n > 0 ? n : 0);
    if (flexible) {
        Py_ssize_t q = p;
        int64_t tags = ra_uvarint(&r, &q);                   /* header tagged fields */
        if (!r.ok) goto more;
        if (tags) goto none;
        n = ra_uvarint(&r, &q);                              /* transactional id */
        if (!r.ok) goto more;
        p = q + (n - 1 > 0 ? n - 1 : 0);
    } else {
        n = ra_i16(&r, p);
        if (!r.ok) goto more;
        p += 2 + (n > 0 ? n : 0);
    }
    p += 6;                                                  /* acks, timeout */
    if (flexible) {
        Py_ssize_t q = p;
        int64_t topics = ra_uvarint(&r, &q);
        if (!r.ok) goto more;
        n = ra_uvarint(&r, &q);                              /* topic name */
        if (!r.ok) goto more;
        q += n - 1;
        int64_t parts = ra_uvarint(&r, &q);
        if (!r.ok) goto more;
        if (topics != 2 || parts != 2 || n < 1) goto none;
        q += 4;                                              /* partition index */
        n = ra_uvarint(&r, &q);
        if (!r.ok) goto more;
        n -= 1;
        p = q;
    } else {
        int64_t topics = ra_i32(&r, p);
        if (!r.ok) goto more;
        if (topics != 1) goto none;                          /* one topic */
        n = ra_i16(&r, p + 4);
        if (!r.ok) goto more;
        p += 6 + n;
        if (n < 0) goto none;
        int64_t parts = ra_i32(&r, p);
        if (!r.ok) goto more;
        if (parts != 1) goto none;                           /* one partition */
        n = ra_i32(&r, p + 8);
        if (!r.ok) goto more;
        p += 12;
    }
    if (n <= 0) goto none;
    if (p > end) goto more;
    out = Py_BuildValue("(LL)", (long long)(p - pos), (long long)n);
    PyBuffer_Release(&view);
    return out;
more:
    PyBuffer_Release(&view);
    return Py_NewRef(need_more);
none:
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"scan_produce", scan_produce, METH_O,
     "The envelope of a plain one-partition Produce v3-v12 request frame, or None."},
    {"stamp_plain", stamp_plain, METH_VARARGS,
     "Check and stamp a payload of plain v2 batches (broker.partition), or None."},
    {"frame_ok", frame_ok, METH_VARARGS,
     "The whole frame of a successful one-partition Produce answer (produce_fast)."},
    {"records_at", (PyCFunction)(void (*)(void))records_at, METH_FASTCALL,
     "Where a one-partition Produce frame's records begin, from its first bytes."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "protocol._produce", NULL, -1,
                                    methods};

PyMODINIT_FUNC PyInit__produce(void) {
    crc32c_init();
    have_sse42 = cpu_has_sse42();
    PyObject *m = PyModule_Create(&module);
    /* stamp_plain answers 4-tuples, a lone large batch's CRC deferred: a stale in-place build
       (3-tuples) lacks it, and broker.partition then keeps to its Python path */
    if (m != NULL && PyModule_AddIntConstant(m, "STAMP_PLAIN_DEFERS_CRC", 1) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    /* records_at's answer when the frame's first bytes end before its records begin
       (broker.frames.NEED_MORE is this object when the extension is there) */
    if (m != NULL && need_more == NULL) {
        need_more = Py_BuildValue("(ii)", -1, -1);
        if (need_more == NULL) {
            Py_DECREF(m);
            return NULL;
        }
    }
    if (m != NULL && PyModule_AddObjectRef(m, "NEED_MORE", need_more) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
