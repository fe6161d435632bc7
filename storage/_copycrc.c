/* storage._copycrc: copy a buffer into another and compute its CRC-32C in one pass.

   The produce path copies every payload into an aligned WAL block and later into an object
   buffer, and checksums it both times (the WAL record CRC, the object block CRC). Done apart
   (memmove, then the crc32c package) each byte is read twice and every destination line is
   fetched before it is overwritten; here each source word is loaded once, stored (32-byte
   stores with AVX2: non-temporal ones - no fetch, no cache pollution - for the object encode
   copy, ordinary ones for the WAL copy on the event loop, see copy_crc_cached) and fed to the
   CRC, with the interpreter lock released for large copies. CRC-32C (Castagnoli) with the SSE4.2 crc32
   instruction, three independent lanes combined with precomputed "shift by n zero bytes"
   tables (the usual way to hide the instruction's latency). Same value and chaining as
   crc32c.crc32c(data, value).

   Without SSE4.2 (or off x86-64) HARDWARE is False and storage/copycrc.py uses memmove + the
   crc32c package instead. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>
#include <fcntl.h>

#include "crc32c.h"          /* crc_hw, crc_soft, shift tables (shared with protocol/_produce.c) */

#define NOGIL_FROM (64 * 1024)    /* release the interpreter lock from this many bytes */
/* the stream copy prefetches its source this far ahead (three 12 KiB steps): each lane is one
   4 KiB page, where the hardware prefetcher stops, so a source not in cache (the object encode
   copies from LogCache frames received a while ago) missed at the start of every lane. 1 MiB,
   source and destination cold: 0.114-0.139 -> 0.085-0.100 ms; source hot: unchanged
   (bench/HISTORY.md, session 16; 12 KiB ahead 0.093-0.107, 72 KiB 0.088-0.102) */
#ifndef PF_AHEAD
#define PF_AHEAD (9 * LONG_LANE)
#endif

static int have_hw = 0;
/* the copies and crc_any fold the CRC with VPCLMULQDQ: 512 or 256 (the register width), 0 not */
static int fold_on = 0;


#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
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
        c0 = join_lanes(long_shift, c0, c1, c2);
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
__attribute__((target("sse4.2,avx2"))) __attribute__((always_inline))
static inline uint32_t copy_crc_avx2(unsigned char *dst, const unsigned char *p, size_t n,
                                     uint32_t crc, const int nt) {
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
            if (nt) {
                _mm256_stream_si256((__m256i *)dst, a);
                _mm256_stream_si256((__m256i *)(dst + LONG_LANE), b);
                _mm256_stream_si256((__m256i *)(dst + 2 * LONG_LANE), c);
            } else {
                _mm256_storeu_si256((__m256i *)dst, a);
                _mm256_storeu_si256((__m256i *)(dst + LONG_LANE), b);
                _mm256_storeu_si256((__m256i *)(dst + 2 * LONG_LANE), c);
            }
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
        c0 = join_lanes(long_shift, c0, c1, c2);
        p += 2 * LONG_LANE;
        dst += 2 * LONG_LANE;
        n -= 3 * LONG_LANE;
    }
    if (nt && streamed) _mm_sfence();   /* order the stream stores before anyone is told */
    memcpy(dst, p, n);
    return crc_hw((uint32_t)c0, dst, n);
}

__attribute__((target("sse4.2,avx2")))
static uint32_t copy_crc_stream(unsigned char *dst, const unsigned char *p, size_t n,
                                uint32_t crc) {
    return copy_crc_avx2(dst, p, n, crc, 1);
}

/* The same with ordinary 32-byte stores: the WAL copy on the event loop (copy_crc,
   copy_crc_split). In the broker under 1 MiB produce load the stream stores into the WAL's
   (huge-page) blocks took 0.21-0.24 ms per MiB with the source hot (a CRC-only pass over the
   same source 0.077), ordinary stores 0.08-0.12: the loop's CPU is interrupted often (socket
   softirqs, AIO completions), and each interruption can flush a partly filled write-combining
   buffer (a partial line written to memory as a read-modify-write); a quiet micro-benchmark
   does not show it. The object encode copy on the IO threads (encode_blocks) keeps the
   stream stores (bench/HISTORY.md, session 19 loopcpu). */
__attribute__((target("sse4.2,avx2")))
static uint32_t copy_crc_cached(unsigned char *dst, const unsigned char *p, size_t n,
                                uint32_t crc) {
    return copy_crc_avx2(dst, p, n, crc, 0);
}

static int cpu_has_avx2(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2");
}

/* The same copy with the CRC computed by carry-less multiplication (VPCLMULQDQ on 512-bit
   registers) instead of the crc32 instruction. crc32 takes 8 bytes per cycle at best, so a
   hot copy was bound by it (1 MiB: CRC alone 0.038 ms, memmove 0.026), and its three lanes
   4 KiB apart read a cold source as three streams (CRC alone 0.10 ms from a cold source,
   memmove 0.05). Here the source is read as one stream of 64-byte loads, each stored and
   folded into one of four 512-bit accumulators (each 128-bit part is a polynomial congruent,
   modulo the CRC's, to all the data folded into it so far, moved 256 bytes on per step:
   lo * x^(2048+64) + hi * x^2048, constants below as rev64(x^(e-1) mod P)). The 256 bytes of
   the accumulators are then a message with the same CRC as everything folded, which the
   crc32 instruction finishes (no reduction constants), followed by the tail. The register
   going in is XORed into the first four bytes (a CRC's register is the same as XORing it
   into the data that follows). */
#if defined(__clang__) || __GNUC__ >= 8   /* the vpclmulqdq target attribute */
#define FOLD_STEP 256
/* The stream copy (the object encode: its source, LogCache frames received tens of MiB ago, is
   not in the cache) prefetches its source this far ahead, a line per load: without it the
   folded copy of a cold source ran slower than memmove and the CRC pass apart (28 x 1023 KiB
   into an 8 MiB ring on the test VM's EPYC: 1.46-1.48 ms; memmove 0.97, CRC alone 0.84); with
   it 1.20-1.21 ms (1 KiB ahead 1.26, 2 KiB 1.26-1.28, 8 KiB 1.21-1.22, 16 KiB 1.22-1.26;
   bench/HISTORY.md, session 31 iothr). The cached copy (the WAL's, its source just received:
   hot) has none. */
#ifndef FOLD_PF
#define FOLD_PF 4096
#endif
#define FOLD_MIN 1024
#define FOLD_K_LO 0xe9a5d8be00000000ull    /* rev64(x^(2048+63) mod P) */
#define FOLD_K_HI 0x1426a81500000000ull    /* rev64(x^(2048-1) mod P) */
/* one step: accumulator x moved 256 bytes on (by k) with the next 64 bytes d XORed in */
#define FOLD(x, d) _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128((x), k, 0x00), \
                                             _mm512_clmulepi64_epi128((x), k, 0x11), (d), 0x96)

__attribute__((target("sse4.2,avx2,avx512f,vpclmulqdq"))) __attribute__((always_inline))
static inline __m512i fold_k(void) {
    return _mm512_set_epi64((long long)FOLD_K_HI, (long long)FOLD_K_LO,
                            (long long)FOLD_K_HI, (long long)FOLD_K_LO,
                            (long long)FOLD_K_HI, (long long)FOLD_K_LO,
                            (long long)FOLD_K_HI, (long long)FOLD_K_LO);
}

/* the accumulators' 256 bytes are a message with the CRC of everything folded into them */
__attribute__((target("sse4.2,avx2,avx512f,vpclmulqdq"))) __attribute__((always_inline))
static inline uint32_t fold_finish(__m512i x0, __m512i x1, __m512i x2, __m512i x3) {
    unsigned char acc[FOLD_STEP] __attribute__((aligned(64)));
    _mm512_store_si512((void *)acc, x0);
    _mm512_store_si512((void *)(acc + 64), x1);
    _mm512_store_si512((void *)(acc + 128), x2);
    _mm512_store_si512((void *)(acc + 192), x3);
    return crc_hw(0, acc, FOLD_STEP);
}

__attribute__((target("sse4.2,avx2,avx512f,vpclmulqdq"))) __attribute__((always_inline))
static inline uint32_t copy_crc_fold(unsigned char *dst, const unsigned char *p, size_t n,
                                     uint32_t crc, const int nt) {
    if (n < FOLD_MIN) return copy_crc_avx2(dst, p, n, crc, 0);
    size_t head = (64 - ((uintptr_t)dst & 63)) & 63;    /* align dst to a line */
    memcpy(dst, p, head);
    crc = crc_hw(crc, p, head);
    dst += head;
    p += head;
    n -= head;
    const __m512i k = fold_k();
    __m512i x0 = _mm512_loadu_si512((const void *)p);
    __m512i x1 = _mm512_loadu_si512((const void *)(p + 64));
    __m512i x2 = _mm512_loadu_si512((const void *)(p + 128));
    __m512i x3 = _mm512_loadu_si512((const void *)(p + 192));
#define FOLD_STORE(off, v) do { \
        if (nt) _mm512_stream_si512((void *)(dst + (off)), (v)); \
        else _mm512_store_si512((void *)(dst + (off)), (v)); } while (0)
    FOLD_STORE(0, x0); FOLD_STORE(64, x1); FOLD_STORE(128, x2); FOLD_STORE(192, x3);
    x0 = _mm512_xor_si512(x0, _mm512_zextsi128_si512(_mm_cvtsi32_si128((int)crc)));
    p += FOLD_STEP;
    dst += FOLD_STEP;
    n -= FOLD_STEP;
    while (n >= FOLD_STEP) {
        if (nt && n >= FOLD_STEP + FOLD_PF) {    /* see FOLD_PF */
            _mm_prefetch((const char *)(p + FOLD_PF), _MM_HINT_T0);
            _mm_prefetch((const char *)(p + FOLD_PF + 64), _MM_HINT_T0);
            _mm_prefetch((const char *)(p + FOLD_PF + 128), _MM_HINT_T0);
            _mm_prefetch((const char *)(p + FOLD_PF + 192), _MM_HINT_T0);
        }
        __m512i d0 = _mm512_loadu_si512((const void *)p);
        __m512i d1 = _mm512_loadu_si512((const void *)(p + 64));
        __m512i d2 = _mm512_loadu_si512((const void *)(p + 128));
        __m512i d3 = _mm512_loadu_si512((const void *)(p + 192));
        FOLD_STORE(0, d0); FOLD_STORE(64, d1); FOLD_STORE(128, d2); FOLD_STORE(192, d3);
        x0 = FOLD(x0, d0);
        x1 = FOLD(x1, d1);
        x2 = FOLD(x2, d2);
        x3 = FOLD(x3, d3);
        p += FOLD_STEP;
        dst += FOLD_STEP;
        n -= FOLD_STEP;
    }
#undef FOLD_STORE
    if (nt) _mm_sfence();             /* order the stream stores before anyone is told */
    crc = fold_finish(x0, x1, x2, x3);
    memcpy(dst, p, n);
    return crc_hw(crc, dst, n);
}

/* the CRC alone, folded the same way (no copy): cold reads check each object block's CRC */
__attribute__((target("sse4.2,avx2,avx512f,vpclmulqdq")))
static uint32_t crc_fold(uint32_t crc, const unsigned char *p, size_t n) {
    if (n < FOLD_MIN) return crc_hw(crc, p, n);
    const __m512i k = fold_k();
    __m512i x0 = _mm512_loadu_si512((const void *)p);
    __m512i x1 = _mm512_loadu_si512((const void *)(p + 64));
    __m512i x2 = _mm512_loadu_si512((const void *)(p + 128));
    __m512i x3 = _mm512_loadu_si512((const void *)(p + 192));
    x0 = _mm512_xor_si512(x0, _mm512_zextsi128_si512(_mm_cvtsi32_si128((int)crc)));
    p += FOLD_STEP;
    n -= FOLD_STEP;
    while (n >= FOLD_STEP) {
        x0 = FOLD(x0, _mm512_loadu_si512((const void *)p));
        x1 = FOLD(x1, _mm512_loadu_si512((const void *)(p + 64)));
        x2 = FOLD(x2, _mm512_loadu_si512((const void *)(p + 128)));
        x3 = FOLD(x3, _mm512_loadu_si512((const void *)(p + 192)));
        p += FOLD_STEP;
        n -= FOLD_STEP;
    }
    return crc_hw(fold_finish(x0, x1, x2, x3), p, n);
}

__attribute__((target("sse4.2,avx2,avx512f,vpclmulqdq")))
static uint32_t copy_crc_fold_stream(unsigned char *dst, const unsigned char *p, size_t n,
                                     uint32_t crc) {
    return copy_crc_fold(dst, p, n, crc, 1);
}

__attribute__((target("sse4.2,avx2,avx512f,vpclmulqdq")))
static uint32_t copy_crc_fold_cached(unsigned char *dst, const unsigned char *p, size_t n,
                                     uint32_t crc) {
    return copy_crc_fold(dst, p, n, crc, 0);
}

static int cpu_has_fold(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("vpclmulqdq");
}

/* The same fold on 256-bit registers, for CPUs with VPCLMULQDQ but no AVX-512 (AMD Zen 3, Intel
   Alder Lake and later client cores): eight 32-byte accumulators instead of four 64-byte ones,
   so each 128-bit part still moves 256 bytes on per step and the constants are the same; the
   three-way XOR is two XORs (vpternlogq is AVX-512). Without it such a CPU ran the crc32
   instruction: 8.8 % of the broker's samples under 1 MiB produce on the test VM's Zen 3, where
   the AVX-512 fold had been 4.8 % on an earlier host. Zen 3 issues a 256-bit VPCLMULQDQ only
   every other cycle, so the gain is smaller than AVX-512's; time against the crc32 instruction's
   copies, alternated (bench/HISTORY.md, session 41): the object encoder's stream copy of cold
   1 MiB payloads 0.71-0.74, the WAL's copy 0.81-0.82 hot, 0.92-0.93 cold; the CRC alone
   0.73-0.95 hot, 0.91-0.92 cold. Running the crc32 instruction's lanes beside the fold (each
   step half each) measured no faster than the fold alone: not kept. */
#define FOLD2(x, d) _mm256_xor_si256(_mm256_xor_si256(_mm256_clmulepi64_epi128((x), k, 0x00), \
                                                      _mm256_clmulepi64_epi128((x), k, 0x11)), (d))

__attribute__((target("sse4.2,avx2,vpclmulqdq"))) __attribute__((always_inline))
static inline uint32_t fold2_finish(__m256i x0, __m256i x1, __m256i x2, __m256i x3,
                                    __m256i x4, __m256i x5, __m256i x6, __m256i x7) {
    unsigned char acc[FOLD_STEP] __attribute__((aligned(32)));
    _mm256_store_si256((__m256i *)acc, x0);
    _mm256_store_si256((__m256i *)(acc + 32), x1);
    _mm256_store_si256((__m256i *)(acc + 64), x2);
    _mm256_store_si256((__m256i *)(acc + 96), x3);
    _mm256_store_si256((__m256i *)(acc + 128), x4);
    _mm256_store_si256((__m256i *)(acc + 160), x5);
    _mm256_store_si256((__m256i *)(acc + 192), x6);
    _mm256_store_si256((__m256i *)(acc + 224), x7);
    return crc_hw(0, acc, FOLD_STEP);
}

/* the eight accumulators (named registers: an array of them was kept on the stack) */
#define FOLD2_VARS __m256i x0, x1, x2, x3, x4, x5, x6, x7
#define FOLD2_LOAD(q) do { \
        x0 = _mm256_loadu_si256((const __m256i *)(q)); \
        x1 = _mm256_loadu_si256((const __m256i *)((q) + 32)); \
        x2 = _mm256_loadu_si256((const __m256i *)((q) + 64)); \
        x3 = _mm256_loadu_si256((const __m256i *)((q) + 96)); \
        x4 = _mm256_loadu_si256((const __m256i *)((q) + 128)); \
        x5 = _mm256_loadu_si256((const __m256i *)((q) + 160)); \
        x6 = _mm256_loadu_si256((const __m256i *)((q) + 192)); \
        x7 = _mm256_loadu_si256((const __m256i *)((q) + 224)); } while (0)
#define FOLD2_ONE(x, q, off) x = FOLD2(x, _mm256_loadu_si256((const __m256i *)((q) + (off))))
#define FOLD2_STEP(q) do { \
        FOLD2_ONE(x0, q, 0); FOLD2_ONE(x1, q, 32); FOLD2_ONE(x2, q, 64); \
        FOLD2_ONE(x3, q, 96); FOLD2_ONE(x4, q, 128); FOLD2_ONE(x5, q, 160); \
        FOLD2_ONE(x6, q, 192); FOLD2_ONE(x7, q, 224); } while (0)
#define FOLD2_FINISH() fold2_finish(x0, x1, x2, x3, x4, x5, x6, x7)

/* the stores of a copy: stream stores (nt) or ordinary ones */
#define FOLD2_STORE(d, nt) do { __m256i *o_ = (__m256i *)(d); if (nt) { \
        _mm256_stream_si256(o_, x0); _mm256_stream_si256(o_ + 1, x1); \
        _mm256_stream_si256(o_ + 2, x2); _mm256_stream_si256(o_ + 3, x3); \
        _mm256_stream_si256(o_ + 4, x4); _mm256_stream_si256(o_ + 5, x5); \
        _mm256_stream_si256(o_ + 6, x6); _mm256_stream_si256(o_ + 7, x7); } else { \
        _mm256_store_si256(o_, x0); _mm256_store_si256(o_ + 1, x1); \
        _mm256_store_si256(o_ + 2, x2); _mm256_store_si256(o_ + 3, x3); \
        _mm256_store_si256(o_ + 4, x4); _mm256_store_si256(o_ + 5, x5); \
        _mm256_store_si256(o_ + 6, x6); _mm256_store_si256(o_ + 7, x7); } } while (0)

__attribute__((target("sse4.2,avx2,vpclmulqdq"))) __attribute__((always_inline))
static inline uint32_t copy_crc_fold2(unsigned char *dst, const unsigned char *p, size_t n,
                                      uint32_t crc, const int nt) {
    if (n < FOLD_MIN) return copy_crc_avx2(dst, p, n, crc, 0);
    size_t head = (64 - ((uintptr_t)dst & 63)) & 63;    /* align dst to a line */
    memcpy(dst, p, head);
    crc = crc_hw(crc, p, head);
    dst += head;
    p += head;
    n -= head;
    const __m256i k = _mm256_set_epi64x((long long)FOLD_K_HI, (long long)FOLD_K_LO,
                                        (long long)FOLD_K_HI, (long long)FOLD_K_LO);
    FOLD2_VARS;
    FOLD2_LOAD(p);
    FOLD2_STORE(dst, nt);
    x0 = _mm256_xor_si256(x0, _mm256_set_epi32(0, 0, 0, 0, 0, 0, 0, (int)crc));
    p += FOLD_STEP;
    dst += FOLD_STEP;
    n -= FOLD_STEP;
    while (n >= FOLD_STEP) {
        if (nt && n >= FOLD_STEP + FOLD_PF) {    /* see FOLD_PF */
            _mm_prefetch((const char *)(p + FOLD_PF), _MM_HINT_T0);
            _mm_prefetch((const char *)(p + FOLD_PF + 64), _MM_HINT_T0);
            _mm_prefetch((const char *)(p + FOLD_PF + 128), _MM_HINT_T0);
            _mm_prefetch((const char *)(p + FOLD_PF + 192), _MM_HINT_T0);
        }
        __m256i *o = (__m256i *)dst;
        const __m256i *q = (const __m256i *)p;
#define FOLD2_COPY_ONE(x, i) do { __m256i d_ = _mm256_loadu_si256(q + (i)); \
        if (nt) _mm256_stream_si256(o + (i), d_); else _mm256_store_si256(o + (i), d_); \
        x = FOLD2(x, d_); } while (0)
        FOLD2_COPY_ONE(x0, 0); FOLD2_COPY_ONE(x1, 1); FOLD2_COPY_ONE(x2, 2);
        FOLD2_COPY_ONE(x3, 3); FOLD2_COPY_ONE(x4, 4); FOLD2_COPY_ONE(x5, 5);
        FOLD2_COPY_ONE(x6, 6); FOLD2_COPY_ONE(x7, 7);
#undef FOLD2_COPY_ONE
        p += FOLD_STEP;
        dst += FOLD_STEP;
        n -= FOLD_STEP;
    }
    if (nt) _mm_sfence();             /* order the stream stores before anyone is told */
    crc = FOLD2_FINISH();
    memcpy(dst, p, n);
    return crc_hw(crc, dst, n);
}

/* the CRC alone, folded the same way */
__attribute__((target("sse4.2,avx2,vpclmulqdq")))
static uint32_t crc_fold2(uint32_t crc, const unsigned char *p, size_t n) {
    if (n < FOLD_MIN) return crc_hw(crc, p, n);
    const __m256i k = _mm256_set_epi64x((long long)FOLD_K_HI, (long long)FOLD_K_LO,
                                        (long long)FOLD_K_HI, (long long)FOLD_K_LO);
    FOLD2_VARS;
    FOLD2_LOAD(p);
    x0 = _mm256_xor_si256(x0, _mm256_set_epi32(0, 0, 0, 0, 0, 0, 0, (int)crc));
    p += FOLD_STEP;
    n -= FOLD_STEP;
    while (n >= FOLD_STEP) {
        FOLD2_STEP(p);
        p += FOLD_STEP;
        n -= FOLD_STEP;
    }
    return crc_hw(FOLD2_FINISH(), p, n);
}

__attribute__((target("sse4.2,avx2,vpclmulqdq")))
static uint32_t copy_crc_fold2_stream(unsigned char *dst, const unsigned char *p, size_t n,
                                      uint32_t crc) {
    return copy_crc_fold2(dst, p, n, crc, 1);
}

__attribute__((target("sse4.2,avx2,vpclmulqdq")))
static uint32_t copy_crc_fold2_cached(unsigned char *dst, const unsigned char *p, size_t n,
                                      uint32_t crc) {
    return copy_crc_fold2(dst, p, n, crc, 0);
}

static int cpu_has_fold2(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("vpclmulqdq");
}
#else
#define copy_crc_fold_stream copy_crc_stream
#define copy_crc_fold_cached copy_crc_cached
#define crc_fold crc_hw
static int cpu_has_fold(void) { return 0; }
#define copy_crc_fold2_stream copy_crc_stream
#define copy_crc_fold2_cached copy_crc_cached
#define crc_fold2 crc_hw
static int cpu_has_fold2(void) { return 0; }
#endif
#else
static uint32_t copy_crc_scalar(unsigned char *dst, const unsigned char *p, size_t n,
                                uint32_t crc) {
    memcpy(dst, p, n);
    return crc_hw(crc, dst, n);
}
#define copy_crc_stream copy_crc_scalar
#define copy_crc_cached copy_crc_scalar
static int cpu_has_avx2(void) { return 0; }
#define copy_crc_fold_stream copy_crc_scalar
#define copy_crc_fold_cached copy_crc_scalar
#define crc_fold crc_hw
static int cpu_has_fold(void) { return 0; }
#define copy_crc_fold2_stream copy_crc_scalar
#define copy_crc_fold2_cached copy_crc_scalar
#define crc_fold2 crc_hw
static int cpu_has_fold2(void) { return 0; }
#endif

typedef uint32_t (*copy_fn)(unsigned char *, const unsigned char *, size_t, uint32_t);
static copy_fn copy_crc_raw = copy_crc_scalar;        /* encode_blocks (IO threads) */
static copy_fn copy_crc_loop_raw = copy_crc_scalar;   /* copy_crc, copy_crc_split (the WAL) */
typedef uint32_t (*crc_fn)(uint32_t, const unsigned char *, size_t);
static crc_fn crc_fold_fn = crc_fold;                 /* crc_any's, while fold_on */

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

/* The interpreter lock let go for `n` bytes of work from NOGIL_FROM on (below that the hand-off
   costs more than it frees): gil_back(nogil_for(n)) around the work. */
static PyThreadState *nogil_for(size_t n) {
    return n >= NOGIL_FROM ? PyEval_SaveThread() : NULL;
}

static void gil_back(PyThreadState *ts) {
    if (ts != NULL)
        PyEval_RestoreThread(ts);
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
    PyThreadState *ts = nogil_for(n);
    crc = copy_crc_loop_raw(d, s, n, crc);
    gil_back(ts);
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
    PyThreadState *ts = nogil_for(n);
    head = ~copy_crc_loop_raw(d, s, k, ~(uint32_t)value);
    tail = ~copy_crc_loop_raw(d + k, s + k, n - k, ~0u);
    gil_back(ts);
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    return Py_BuildValue("kk", (unsigned long)crc_combine(head, tail, n - k),
                         (unsigned long)tail);
}

/* ---- the object encoder's data blocks (storage/objects/format.py, ObjectEncoder) ----------
   A block is a 14-byte header (magic 0x5A, flags 0, record count, body length, CRC-32C of the
   body) and its records, each a 33-byte header (magic 0x22, stream id, epoch 0, base offset,
   count - 1, payload length; big-endian) and the payload. A block closes once its body reaches
   block_size. The Python encoder did this at ~2-4 us of interpreter work per record, on the
   event loop (a 64 MiB upload of 1.4 KB produce requests is ~46,000 records); here a record
   costs its four attribute reads, a buffer export and the copy. */

#define BLOCK_HDR 14
#define RECORD_HDR 33

typedef struct {
    int64_t sid, base, count;
    Py_buffer buf;
} rec_t;

typedef struct {
    int64_t sid, start, end, count;
} run_t;

static PyObject *s_stream_id, *s_base_offset, *s_count, *s_payload;

static inline void put_be64(unsigned char *p, uint64_t v) {
    for (int i = 7; i >= 0; i--) { p[i] = (unsigned char)v; v >>= 8; }
}
static inline void put_be32(unsigned char *p, uint32_t v) {
    p[0] = (unsigned char)(v >> 24); p[1] = (unsigned char)(v >> 16);
    p[2] = (unsigned char)(v >> 8); p[3] = (unsigned char)v;
}

static int get_i64(PyObject *obj, PyObject *name, int64_t *out) {
    PyObject *v = PyObject_GetAttr(obj, name);
    if (v == NULL) return -1;
    long long x = PyLong_AsLongLong(v);
    Py_DECREF(v);
    if (x == -1 && PyErr_Occurred()) return -1;
    *out = (int64_t)x;
    return 0;
}

/* stream id and base offset of records[i]: the sort check's key */
static int record_key(PyObject *rec, int64_t *sid, int64_t *base) {
    if (get_i64(rec, s_stream_id, sid) < 0) return -1;
    return get_i64(rec, s_base_offset, base);
}

static void release_recs(rec_t *recs, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) PyBuffer_Release(&recs[i].buf);
}

/* write the gathered records of one block at out + pos (header first) and return the CRC of
   the body (records `stride` bytes apart); touches no Python object (runs with the GIL released when asked) */
/* a record's 33-byte header at p (magic 0x22, stream id, epoch 0, base offset, count - 1,
   payload length): write_block's and the gather put's (g_head) */
static inline void put_record_header(unsigned char *p, const rec_t *r) {
    p[0] = 0x22;
    put_be64(p + 1, (uint64_t)r->sid);
    put_be64(p + 9, 0);
    put_be64(p + 17, (uint64_t)r->base);
    put_be32(p + 25, (uint32_t)(int32_t)(r->count - 1));
    put_be32(p + 29, (uint32_t)r->buf.len);
}

/* a block's 14-byte header at h (magic 0x5A, flags 0, record count, body length, body CRC) */
static inline void put_block_header(unsigned char *h, Py_ssize_t n, Py_ssize_t body,
                                    uint32_t crc) {
    h[0] = 0x5A;
    h[1] = 0;
    put_be32(h + 2, (uint32_t)n);
    put_be32(h + 6, (uint32_t)body);
    put_be32(h + 10, crc);
}

static uint32_t write_block(unsigned char *out, Py_ssize_t pos, rec_t *recs, size_t stride,
                            Py_ssize_t n, Py_ssize_t body) {
    unsigned char *p = out + pos + BLOCK_HDR;
    uint32_t crc = ~0u;
    for (Py_ssize_t i = 0; i < n; i++) {
        rec_t *r = (rec_t *)((char *)recs + i * stride);    /* stride: sizeof(rec_t) or more */
        put_record_header(p, r);
        crc = crc_hw(crc, p, RECORD_HDR);
        p += RECORD_HDR;
        crc = copy_crc_raw(p, (const unsigned char *)r->buf.buf, (size_t)r->buf.len, crc);
        p += r->buf.len;
    }
    crc = ~crc;
    put_block_header(out + pos, n, body, crc);
    return crc;
}

/* With `nogil`, the records of several blocks are gathered (interpreter lock held) before one
   release writes them all: up to NOGIL_BATCH_RECORDS records, at least one whole block. An
   object of 1 MiB records (one per 512 KiB block) re-took the lock after each block, ~28 times
   per 28 MiB object, each a hand-off with the event loop (bench/HISTORY.md, session 25). A
   batch of small records stays about one block (~0.1 ms of gathering with the lock held). */
#define NOGIL_BATCH_RECORDS 256

typedef struct {
    Py_ssize_t pos, first, n, body;
} blk_t;

/* Write p[0:n] to `fd` at its position, `chunk` bytes per write(), without the interpreter
   lock (the caller released it): write_pieces and encode_write's windows. Returns the bytes
   written; stops early at EINVAL (O_DIRECT refused: `*err` stays 0) and after a write whose
   length is not a multiple of `align` (the rest would be unaligned); another error sets
   `*err` to its errno. EINTR is retried. */
static Py_ssize_t write_loop(int fd, const char *p, Py_ssize_t n, Py_ssize_t chunk,
                             Py_ssize_t align, int *err) {
    Py_ssize_t done = 0;
    *err = 0;
    while (done < n) {
        Py_ssize_t want = n - done < chunk ? n - done : chunk;
        ssize_t w = write(fd, p + done, (size_t)want);
        if (w < 0) {
            if (errno == EINTR) continue;
            if (errno != EINVAL) *err = errno;
            break;
        }
        done += w;
        if (w == 0 || w % align) break;
    }
    return done;
}

/* `arr` (`*cap` elements of `size` bytes) reallocated to twice as many, `*cap` doubled; when
   out of memory: `arr` itself (still valid, freed by the caller), MemoryError set and
   `*failed` 1. encode_blocks' three growing arrays. */
static void *grow(void *arr, Py_ssize_t *cap, size_t size, int *failed) {
    void *more = PyMem_Realloc(arr, 2 * (size_t)*cap * size);
    *failed = more == NULL;
    if (*failed) {
        PyErr_NoMemory();
        return arr;
    }
    *cap *= 2;
    return more;
}

PyDoc_STRVAR(encode_blocks_doc,
"encode_blocks(out, at, records, start, block_size, min_records, nogil, fit=False, base=0)\n"
"    -> (next, at, index)\n\n"
"Encode records[start:] as whole data blocks into the writable buffer `out` from `at` on (the\n"
"byte layout of storage.objects.format.ObjectEncoder: a block closes once its body reaches\n"
"block_size, and after the last record), stopping after the block in which `min_records`\n"
"records were reached (0: every record). Records are any objects with integer stream_id,\n"
"base_offset, count and a bytes-like payload, sorted by (stream_id, base_offset) (ValueError\n"
"if not). `nogil`: copy and checksum with the interpreter lock released (for a worker\n"
"thread), once per batch of blocks gathered (up to 256 records, at least one block).\n"
"`fit`: stop before the first block that does not fit in `out` (return without it; none\n"
"written: `next` is `start`) instead of raising ValueError: a streamed put encodes an object\n"
"a window at a time (storage.objects.format.StreamEncoder). `base`: the object position of\n"
"out[0], added to the index entries' block positions (the window's place in the object).\n"
"Returns the next record's index, the next write position and the blocks' index entries as\n"
"tuples (stream id, start, end, record count, block position, block size).");

/* encode_blocks, and with `fd` >= 0 encode_write (see their docs): `written` counts the bytes
   encode_write wrote to `fd`; its windows' writes run in the same release of the interpreter
   lock as their last blocks' copies. */
static PyObject *encode_impl(PyObject *out_obj, Py_ssize_t at, PyObject *list, Py_ssize_t start,
                             Py_ssize_t block_size, Py_ssize_t min_records, int nogil, int fit,
                             Py_ssize_t base, int fd, Py_ssize_t chunk, Py_ssize_t align) {
    int full = 0;                         /* full: (fit) the next block does not fit */
    Py_ssize_t written = 0;
    if (start < 0 || start > PyList_GET_SIZE(list) || at < 0) {
        PyErr_SetString(PyExc_ValueError, "encode_blocks: start or at out of range");
        return NULL;
    }
    Py_buffer out;
    if (PyObject_GetBuffer(out_obj, &out, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    if (at > out.len) {              /* encode_write would write and move out[:at] */
        PyBuffer_Release(&out);
        PyErr_SetString(PyExc_ValueError, "encode_blocks: at is past the end of out");
        return NULL;
    }
    PyObject *index = PyList_New(0);
    Py_ssize_t cap = 64, nrec = 0, rcap = 8, nrun = 0, bcap = 8, nblk = 0;
    int failed = 0;
    rec_t *recs = PyMem_Malloc(cap * sizeof(rec_t));
    run_t *runs = PyMem_Malloc(rcap * sizeof(run_t));
    blk_t *blks = PyMem_Malloc(bcap * sizeof(blk_t));
    Py_ssize_t i = start, done = 0;
    int64_t last_sid = 0, last_base = 0;
    int have_last = 0;
    if (index == NULL || recs == NULL || runs == NULL || blks == NULL) {
        if (index != NULL) PyErr_NoMemory();
        goto fail;
    }
    if (start > 0) {
        if (record_key(PyList_GET_ITEM(list, start - 1), &last_sid, &last_base) < 0) goto fail;
        have_last = 1;
    }
    unsigned char *obuf = (unsigned char *)out.buf;
    /* the list's size is read each time: an attribute read may run Python code */
    while (!full && i < PyList_GET_SIZE(list) && (min_records <= 0 || done < min_records)) {
        nrec = nblk = 0;
        do {                              /* gather one block (more while nogil: a batch) */
            Py_ssize_t pos = at, body = 0, first = nrec, first_i = i, first_done = done;
            int64_t first_sid = last_sid, first_base = last_base;   /* (the sort check's) */
            int first_have = have_last;
            if (pos > out.len - BLOCK_HDR) {
                if (!fit) goto too_small;
                full = 1;
                break;
            }
            nrun = 0;
            while (i < PyList_GET_SIZE(list) && (body < block_size || nrec == first)) {
                PyObject *item = PyList_GET_ITEM(list, i);
                if (nrec == cap) {
                    recs = grow(recs, &cap, sizeof *recs, &failed);
                    if (failed) goto fail;
                }
                rec_t *r = &recs[nrec];
                Py_INCREF(item);
                PyObject *payload = NULL;
                if (record_key(item, &r->sid, &r->base) < 0
                        || get_i64(item, s_count, &r->count) < 0
                        || (payload = PyObject_GetAttr(item, s_payload)) == NULL) {
                    Py_DECREF(item);
                    goto fail;
                }
                Py_DECREF(item);
                if (have_last && (r->sid < last_sid
                                  || (r->sid == last_sid && r->base < last_base))) {
                    PyErr_SetString(PyExc_ValueError,
                                    "records must be sorted by stream and offset");
                    Py_DECREF(payload);
                    goto fail;
                }
                if (r->count - 1 < INT32_MIN || r->count - 1 > INT32_MAX) {
                    PyErr_SetString(PyExc_ValueError, "encode_blocks: record count out of range");
                    Py_DECREF(payload);
                    goto fail;
                }
                last_sid = r->sid;
                last_base = r->base;
                have_last = 1;
                int got = PyObject_GetBuffer(payload, &r->buf, PyBUF_C_CONTIGUOUS);
                Py_DECREF(payload);           /* the export keeps its memory alive */
                if (got < 0) goto fail;
                nrec++;
                if ((uint64_t)r->buf.len > UINT32_MAX ||
                        r->buf.len > out.len - pos - BLOCK_HDR - body - RECORD_HDR) {
                    if ((uint64_t)r->buf.len > UINT32_MAX) {
                        PyErr_SetString(PyExc_ValueError, "encode_blocks: payload over 4 GiB");
                        goto fail;
                    }
                    if (!fit) goto too_small;
                    /* this block does not fit: left for the next window, its records
                       gathered so far let go (no index entry was made for it yet) */
                    release_recs(recs + first, nrec - first);
                    nrec = first;
                    i = first_i;
                    done = first_done;
                    last_sid = first_sid;      /* encode_write gathers them again */
                    last_base = first_base;
                    have_last = first_have;
                    full = 1;
                    break;
                }
                body += RECORD_HDR + r->buf.len;
                if (nrun && runs[nrun - 1].sid == r->sid) {
                    runs[nrun - 1].end = r->base + r->count;
                    runs[nrun - 1].count++;
                } else {
                    if (nrun == rcap) {
                        runs = grow(runs, &rcap, sizeof *runs, &failed);
                        if (failed) goto fail;
                    }
                    runs[nrun++] = (run_t){r->sid, r->base, r->base + r->count, 1};
                }
                i++;
                done++;
            }
            if (full) break;
            if (body > INT32_MAX) {
                PyErr_SetString(PyExc_ValueError, "encode_blocks: block over 2 GiB");
                goto fail;
            }
            if (nblk == bcap) {
                blks = grow(blks, &bcap, sizeof *blks, &failed);
                if (failed) goto fail;
            }
            blks[nblk++] = (blk_t){pos, first, nrec - first, body};
            at = pos + BLOCK_HDR + body;
            for (Py_ssize_t k = 0; k < nrun; k++) {
                PyObject *e = Py_BuildValue("(LLLLnn)", (long long)runs[k].sid,
                                            (long long)runs[k].start, (long long)runs[k].end,
                                            (long long)runs[k].count, base + pos,
                                            BLOCK_HDR + body);
                if (e == NULL || PyList_Append(index, e) < 0) {
                    Py_XDECREF(e);
                    goto fail;
                }
                Py_DECREF(e);
            }
        } while (!full && nogil && nrec < NOGIL_BATCH_RECORDS && i < PyList_GET_SIZE(list)
                 && (min_records <= 0 || done < min_records));
        /* encode_write: the window is full, its whole `align` units go to `fd` (none: the
           next block is larger than the window, the caller grows it) */
        Py_ssize_t flush = full && fd >= 0 ? at - at % align : 0, wrote = 0;
        int err = 0;
        PyThreadState *ts = nogil || flush ? PyEval_SaveThread() : NULL;
        for (Py_ssize_t b = 0; b < nblk; b++)
            write_block(obuf, blks[b].pos, recs + blks[b].first, sizeof(rec_t), blks[b].n,
                        blks[b].body);
        if (flush) {
            wrote = write_loop(fd, (const char *)obuf, flush, chunk, align, &err);
            memmove(obuf, obuf + wrote, (size_t)(at - wrote));   /* the rest to the start */
        }
        gil_back(ts);
        release_recs(recs, nrec);
        nrec = 0;
        at -= wrote;
        base += wrote;
        written += wrote;
        if (err) {
            errno = err;
            PyErr_SetFromErrno(PyExc_OSError);
            goto fail;
        }
        if (flush && wrote == flush)
            full = 0;                     /* room again: the next window */
    }
    PyMem_Free(recs);
    PyMem_Free(runs);
    PyMem_Free(blks);
    PyBuffer_Release(&out);
    if (fd >= 0)
        return Py_BuildValue("(nnNn)", i, at, index, written);
    return Py_BuildValue("(nnN)", i, at, index);

too_small:
    PyErr_SetString(PyExc_ValueError, "encode_blocks: the output buffer is too small");
fail:
    if (recs != NULL) release_recs(recs, nrec);
    PyMem_Free(recs);
    PyMem_Free(runs);
    PyMem_Free(blks);
    Py_XDECREF(index);
    PyBuffer_Release(&out);
    return NULL;
}

static PyObject *encode_blocks(PyObject *self, PyObject *args) {
    PyObject *out_obj, *list;
    Py_ssize_t at, start, block_size, min_records, base = 0;
    int nogil, fit = 0;
    if (!PyArg_ParseTuple(args, "OnO!nnnp|pn:encode_blocks", &out_obj, &at, &PyList_Type, &list,
                          &start, &block_size, &min_records, &nogil, &fit, &base))
        return NULL;
    return encode_impl(out_obj, at, list, start, block_size, min_records, nogil, fit, base,
                       -1, 0, 1);
}

PyDoc_STRVAR(encode_write_doc,
"encode_write(out, at, records, start, block_size, base, fd, chunk, align)\n"
"    -> (next, at, index, written)\n\n"
"encode_blocks(out, at, records, start, block_size, 0, True, fit=True, base=base) that also\n"
"writes its windows: each time the next block does not fit in `out`, the whole `align`\n"
"units of out[:at] are written to `fd` at its position (an O_DIRECT file: `out` aligned),\n"
"`chunk` bytes per write, the rest (< align) moved to out[0] and `base` advanced, and the\n"
"encoding goes on - the writes in the same release of the interpreter lock as the window's\n"
"last copies. Returns once every record is encoded (the last window's blocks left in\n"
"out[:at], not written) or when the next block is larger than the window (nothing to\n"
"write: the caller grows `out`), or early after a short write (EINVAL: O_DIRECT refused,\n"
"or a length not a multiple of `align`: the caller writes out[:at] itself); other write\n"
"errors raise OSError. `written`: the bytes written to `fd`.\n"
"Why: a streamed put (storage/objects/store.py) encoded a window, took the interpreter lock\n"
"back, ran Python, released it to write the window and took it back again: two hand-offs\n"
"with the event loop and the Python of a window each time, now one per window.");

static PyObject *encode_write(PyObject *self, PyObject *args) {
    PyObject *out_obj, *list;
    Py_ssize_t at, start, block_size, base, chunk, align;
    int fd;
    if (!PyArg_ParseTuple(args, "OnO!nnninn:encode_write", &out_obj, &at, &PyList_Type, &list,
                          &start, &block_size, &base, &fd, &chunk, &align))
        return NULL;
    if (fd < 0 || chunk <= 0 || align <= 0 || chunk % align) {
        PyErr_SetString(PyExc_ValueError, "encode_write: fd, chunk and align must be positive "
                        "and chunk whole align units");
        return NULL;
    }
    return encode_impl(out_obj, at, list, start, block_size, 0, 1, 1, base, fd, chunk, align);
}

PyDoc_STRVAR(object_size_steps_doc,
"object_size_steps(records, block_size, start, stop, state) -> state\n\n"
"storage.objects.format.object_size_steps over records[start:stop], continuing from `state`\n"
"= (total, index entries, bytes in the open block or -1, the open run's stream id or None);\n"
"payload sizes are len(payload).");

static PyObject *object_size_steps(PyObject *self, PyObject *args) {
    PyObject *list, *last_obj;
    Py_ssize_t block_size, start, stop;
    long long total, entries, block;
    if (!PyArg_ParseTuple(args, "O!nnn(LLLO):object_size_steps", &PyList_Type, &list,
                          &block_size, &start, &stop, &total, &entries, &block, &last_obj))
        return NULL;
    int64_t last = 0;
    int have_last = last_obj != Py_None;
    if (have_last) {
        last = PyLong_AsLongLong(last_obj);
        if (last == -1 && PyErr_Occurred()) return NULL;
    }
    for (Py_ssize_t i = start < 0 ? 0 : start; i < stop && i < PyList_GET_SIZE(list); i++) {
        PyObject *item = PyList_GET_ITEM(list, i);
        int64_t sid;
        Py_INCREF(item);
        PyObject *payload = get_i64(item, s_stream_id, &sid) < 0 ? NULL :
            PyObject_GetAttr(item, s_payload);
        Py_DECREF(item);
        if (payload == NULL) return NULL;
        Py_ssize_t n = PyObject_Length(payload);
        Py_DECREF(payload);
        if (n < 0) return NULL;
        if (block < 0) {
            block = 0;
            have_last = 0;
        }
        block += RECORD_HDR + n;
        if (!have_last || sid != last) {
            entries++;
            last = sid;
            have_last = 1;
        }
        if (block >= block_size) {
            total += BLOCK_HDR + block;
            block = -1;
        }
    }
    if (have_last)
        return Py_BuildValue("(LLLL)", total, entries, block, (long long)last);
    return Py_BuildValue("(LLLO)", total, entries, block, Py_None);
}

/* CRC-32C of p[0:n) continued from the raw register `c`: folded where the CPU has it, else the
   crc32 instruction, else the table (crc, crc_split, read_span_crcs) */
static inline uint32_t crc_any(uint32_t c, const unsigned char *p, size_t n) {
    return fold_on ? crc_fold_fn(c, p, n) : have_hw ? crc_hw(c, p, n) : crc_soft(c, p, n);
}

PyDoc_STRVAR(copy_record_doc,
"copy_record(dst, at, pos, head, body) -> None\n\n"
"One WAL record (storage/wal/format.py) written into the writable buffer `dst` at `at`:\n"
"its body `head` + `body` copied to `at` + 24 with their CRC-32C taken in the same pass, then\n"
"the record header before it - pack_record_header(dst, at, len(head) + len(body), pos, crc)\n"
"(magic, body length, `pos`, body CRC, the CRC of those 20 bytes). What DeltaWAL._reserve\n"
"did with two copy_crc calls and pack_record_header; ValueError if it does not fit.");

static PyObject *copy_record(PyObject *self, PyObject *args) {
    PyObject *dst_obj, *head_obj, *body_obj;
    Py_ssize_t at;
    unsigned long long pos;
    Py_buffer dst, head, body;
    if (!PyArg_ParseTuple(args, "OnKOO:copy_record", &dst_obj, &at, &pos, &head_obj, &body_obj))
        return NULL;
    if (PyObject_GetBuffer(dst_obj, &dst, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    if (PyObject_GetBuffer(head_obj, &head, PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&dst);
        return NULL;
    }
    if (PyObject_GetBuffer(body_obj, &body, PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&head);
        PyBuffer_Release(&dst);
        return NULL;
    }
    PyObject *ret = NULL;
    Py_ssize_t n = head.len + body.len;
    if (at < 0 || at > dst.len || dst.len - at < 24 || n > dst.len - at - 24) {
        PyErr_SetString(PyExc_ValueError, "copy_record: record does not fit at that offset");
    } else if (n > 0xFFFFFFFFLL) {
        PyErr_SetString(PyExc_ValueError, "copy_record: body longer than 4 GiB");
    } else {
        unsigned char *d = (unsigned char *)dst.buf + at;
        size_t hn = (size_t)head.len, bn = (size_t)body.len;
        uint32_t crc = ~(uint32_t)0;
        PyThreadState *ts = nogil_for(bn);
        crc = copy_crc_loop_raw(d + 24, (const unsigned char *)head.buf, hn, crc);
        crc = copy_crc_loop_raw(d + 24 + hn, (const unsigned char *)body.buf, bn, crc);
        gil_back(ts);
        put_be32(d, 0x52454331u);                     /* format.RECORD_MAGIC, "REC1" */
        put_be32(d + 4, (uint32_t)n);
        put_be32(d + 8, (uint32_t)(pos >> 32));
        put_be32(d + 12, (uint32_t)pos);
        put_be32(d + 16, ~crc);
        put_be32(d + 20, ~crc_any(~(uint32_t)0, d, 20));
        ret = Py_None;
        Py_INCREF(ret);
    }
    PyBuffer_Release(&body);
    PyBuffer_Release(&head);
    PyBuffer_Release(&dst);
    return ret;
}

PyDoc_STRVAR(crc_doc,
"crc(data, value=0) -> int\n\nCRC-32C of `data` continued from `value` (crc32c.crc32c(data, value));\n"
"folded with VPCLMULQDQ where the copies are (FOLD), ~2x the crc32c package on 1 MiB; the\n"
"interpreter lock released from 64 KiB.");

static PyObject *crc(PyObject *self, PyObject *args) {
    Py_buffer buf;
    unsigned long value = 0;
    if (!PyArg_ParseTuple(args, "y*|k:crc", &buf, &value))
        return NULL;
    uint32_t c = ~(uint32_t)value;
    const unsigned char *p = (const unsigned char *)buf.buf;
    size_t n = (size_t)buf.len;
    PyThreadState *ts = nogil_for(n);
    c = crc_any(c, p, n);
    gil_back(ts);
    PyBuffer_Release(&buf);
    return PyLong_FromUnsignedLong(~c);
}

PyDoc_STRVAR(crc_split_doc,
"crc_split(src, value, split) -> (crc, tail_crc)\n\n"
"copy_crc_split without the copy: crc32c(src, value) and crc32c(src[split:]) from one pass\n"
"over `src` (the WAL's records received in place: the batch check and the record CRC).");

static PyObject *crc_split(PyObject *self, PyObject *args) {
    Py_buffer buf;
    unsigned long value = 0;
    Py_ssize_t split;
    if (!PyArg_ParseTuple(args, "y*kn:crc_split", &buf, &value, &split))
        return NULL;
    if (split < 0 || split > buf.len) {
        PyBuffer_Release(&buf);
        PyErr_SetString(PyExc_ValueError, "crc_split: split outside the source");
        return NULL;
    }
    const unsigned char *p = (const unsigned char *)buf.buf;
    size_t n = (size_t)buf.len, k = (size_t)split;
    uint32_t head, tail;
    PyThreadState *ts = nogil_for(n);
    head = ~crc_any(~(uint32_t)value, p, k);
    tail = ~crc_any(~0u, p + k, n - k);
    gil_back(ts);
    PyBuffer_Release(&buf);
    return Py_BuildValue("kk", (unsigned long)crc_combine(head, tail, n - k),
                         (unsigned long)tail);
}

/* The end of read_pieces and write_pieces: the buffer released, then OSError for `err` (an
   errno) or the byte count. */
static PyObject *io_result(Py_buffer *buf, int err, Py_ssize_t n) {
    PyBuffer_Release(buf);
    if (err) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromSsize_t(n);
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
    return io_result(&buf, err, (Py_ssize_t)got);
}

PyDoc_STRVAR(write_pieces_doc,
"write_pieces(fd, data, chunk, align) -> int\n\n"
"os.write `data` to `fd` in pieces of at most `chunk` bytes, one after the other, with the\n"
"interpreter lock released once for all of them; returns the bytes written. Stops early\n"
"(returning the count so far) at EINVAL (O_DIRECT refused) and after a write whose length\n"
"is not a multiple of `align` (the rest would be unaligned); other errors raise OSError.\n"
"Why: an upload's O_DIRECT object writes (storage/objects/store.py) re-took the lock after\n"
"every 1 MiB piece, a hand-off the event loop paid each time.");

static PyObject *write_pieces(PyObject *self, PyObject *args) {
    int fd;
    Py_buffer buf;
    Py_ssize_t chunk, align;
    if (!PyArg_ParseTuple(args, "iy*nn:write_pieces", &fd, &buf, &chunk, &align))
        return NULL;
    if (chunk <= 0 || align <= 0) {
        PyBuffer_Release(&buf);
        PyErr_SetString(PyExc_ValueError, "write_pieces: chunk and align must be positive");
        return NULL;
    }
    Py_ssize_t done;
    int err;
    Py_BEGIN_ALLOW_THREADS
    done = write_loop(fd, (const char *)buf.buf, buf.len, chunk, align, &err);
    Py_END_ALLOW_THREADS
    return io_result(&buf, err, done);
}


/* -- the WAL's native AIO: io_submit and io_getevents without ctypes (storage/wal/aio.py) -- */
#if defined(__linux__)
#include <linux/aio_abi.h>
#include <sys/uio.h>
#include <time.h>
#include <sys/syscall.h>
#define HAVE_AIO 1
#ifndef RWF_DSYNC
#define RWF_DSYNC 0x00000002
#endif
#define AIO_STACK_IOV 64          /* a WAL write merges at most 64 blocks (wal.py _take_group) */

/* `seconds` (>= 0 after clamping) as a timespec: io_getevents' wait and timerfd_settime's
   absolute deadline */
static void set_timespec(struct timespec *ts, double seconds) {
    if (seconds < 0) seconds = 0;
    ts->tv_sec = (time_t)seconds;
    ts->tv_nsec = (long)((seconds - (double)ts->tv_sec) * 1e9);
    if (ts->tv_nsec < 0) ts->tv_nsec = 0;
    if (ts->tv_nsec > 999999999) ts->tv_nsec = 999999999;
}

/* `pieces`, a non-empty sequence of (address, length) pairs, as iovecs: into `stack` when
   they fit (AIO_STACK_IOV), else into *iov = PyMem_Malloc'd memory the caller frees when
   *iov != stack. Returns their count, or -1 with an exception set. aio_submit's and
   uring_submit's parse. */
static Py_ssize_t aio_pieces(PyObject *pieces, struct iovec *stack, struct iovec **iov) {
    PyObject *seq = PySequence_Fast(pieces, "pieces must be a sequence");
    if (seq == NULL) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n < 1) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "no pieces");
        return -1;
    }
    struct iovec *v = n <= AIO_STACK_IOV ? stack : PyMem_Malloc(n * sizeof(*v));
    if (v == NULL) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return -1;
    }
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *pair = items[i];
        unsigned long long addr, len;
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
            PyErr_SetString(PyExc_TypeError, "pieces are (address, length) pairs");
            goto fail;
        }
        addr = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(pair, 0));
        if (addr == (unsigned long long)-1 && PyErr_Occurred()) goto fail;
        len = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(pair, 1));
        if (len == (unsigned long long)-1 && PyErr_Occurred()) goto fail;
        v[i].iov_base = (void *)(uintptr_t)addr;
        v[i].iov_len = (size_t)len;
    }
    Py_DECREF(seq);
    *iov = v;
    return n;
fail:
    if (v != stack) PyMem_Free(v);
    Py_DECREF(seq);
    return -1;
}

PyDoc_STRVAR(aio_submit_doc,
"aio_submit(ctx, resfd, fd, pieces, offset, token, dsync) -> None\n\n"
"One io_submit of a write of `pieces`, a sequence of (address, length) pairs, at `offset` of\n"
"`fd` (IOCB_CMD_PWRITE for one piece, IOCB_CMD_PWRITEV for more), its completion signalled on\n"
"the eventfd `resfd` and reported with `token`; RWF_DSYNC when `dsync` is true. The kernel\n"
"copies the iocb and the iovec during the call, so only the buffers must stay valid until the\n"
"completion is reaped (the caller keeps them). Keeps the interpreter lock (io_submit does not\n"
"wait: storage/wal/aio.py). Raises OSError(errno) as io_submit fails, e.g. EBADF, EAGAIN.\n"
"Same iocb as aio.py's ctypes path, built in C: ~3 us less Python per WAL write.");

static PyObject *aio_submit(PyObject *self, PyObject *args) {
    unsigned long long ctx, token;
    int resfd, fd, dsync;
    long long offset;
    PyObject *pieces;
    if (!PyArg_ParseTuple(args, "KiiOLKp:aio_submit", &ctx, &resfd, &fd, &pieces, &offset,
                          &token, &dsync))
        return NULL;
    struct iovec stack_iov[AIO_STACK_IOV], *iov = stack_iov;
    Py_ssize_t n = aio_pieces(pieces, stack_iov, &iov);
    if (n < 0) return NULL;
    struct iocb cb;
    memset(&cb, 0, sizeof(cb));
    cb.aio_data = token;
    cb.aio_fildes = (uint32_t)fd;
    cb.aio_offset = offset;
    cb.aio_flags = IOCB_FLAG_RESFD;
    cb.aio_resfd = (uint32_t)resfd;
    cb.aio_rw_flags = dsync ? RWF_DSYNC : 0;
    if (n == 1) {
        cb.aio_lio_opcode = IOCB_CMD_PWRITE;
        cb.aio_buf = (uint64_t)(uintptr_t)iov[0].iov_base;
        cb.aio_nbytes = iov[0].iov_len;
    } else {
        cb.aio_lio_opcode = IOCB_CMD_PWRITEV;
        cb.aio_buf = (uint64_t)(uintptr_t)iov;
        cb.aio_nbytes = (uint64_t)n;
    }
    struct iocb *cbs[1] = {&cb};
    long r = syscall(SYS_io_submit, (aio_context_t)ctx, 1L, cbs);
    int err = errno;
    if (iov != stack_iov) PyMem_Free(iov);
    if (r < 0) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    if (r != 1) {                /* not for one iocb (the kernel answers 1 or an error) */
        errno = EAGAIN;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_RETURN_NONE;
}

PyDoc_STRVAR(aio_reap_doc,
"aio_reap(ctx, nr, wait_s=None) -> list of (token, result)\n\n"
"io_getevents of up to `nr` completions: wait_s None returns at once and keeps the\n"
"interpreter lock (the event loop's reap); a number waits up to wait_s seconds for at least\n"
"one with the lock released (a closing thread's drain). result is the byte count written or\n"
"a negative errno. Raises OSError(errno) as io_getevents fails.");

static PyObject *aio_reap(PyObject *self, PyObject *args) {
    unsigned long long ctx;
    int nr;
    PyObject *wait = Py_None;
    if (!PyArg_ParseTuple(args, "Ki|O:aio_reap", &ctx, &nr, &wait))
        return NULL;
    if (nr < 1 || nr > 4096) {
        PyErr_SetString(PyExc_ValueError, "aio_reap: nr must be 1..4096");
        return NULL;
    }
    struct io_event stack_ev[64];
    struct io_event *ev = nr <= 64 ? stack_ev : PyMem_Malloc(nr * sizeof(*ev));
    if (ev == NULL) return PyErr_NoMemory();
    struct timespec ts = {0, 0};
    long r;
    int err;
    if (wait == Py_None) {
        r = syscall(SYS_io_getevents, (aio_context_t)ctx, 0L, (long)nr, ev, &ts);
        err = errno;
    } else {
        double w = PyFloat_AsDouble(wait);
        if (w == -1.0 && PyErr_Occurred()) {
            if (ev != stack_ev) PyMem_Free(ev);
            return NULL;
        }
        set_timespec(&ts, w);
        Py_BEGIN_ALLOW_THREADS
        r = syscall(SYS_io_getevents, (aio_context_t)ctx, 1L, (long)nr, ev, &ts);
        err = errno;
        Py_END_ALLOW_THREADS
    }
    if (r < 0) {
        if (ev != stack_ev) PyMem_Free(ev);
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    PyObject *out = PyList_New(r);
    for (long i = 0; out != NULL && i < r; i++) {
        PyObject *t = Py_BuildValue("(KL)", (unsigned long long)ev[i].data, (long long)ev[i].res);
        if (t == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, i, t);
    }
    if (ev != stack_ev) PyMem_Free(ev);
    return out;
}

PyDoc_STRVAR(eventfd_reset_doc,
"eventfd_reset(fd) -> None\n\n"
"Read an eventfd's (or a timerfd's) counter once without waiting (EAGAIN when it was not signalled is not an\n"
"error), keeping the interpreter lock: os.read would release it, and the event loop would\n"
"then wait to get it back from an upload thread.");

PyDoc_STRVAR(timerfd_arm_doc,
"timerfd_arm(fd, deadline) -> None\n\n"
"timerfd_settime(fd, TFD_TIMER_ABSTIME) to fire once at CLOCK_MONOTONIC `deadline` seconds\n"
"(time.monotonic()), keeping the interpreter lock (it does not wait). Raises OSError(errno).\n"
"The WAL's loop driver arms it per small write (the seal interval): through ctypes ~2.9 us\n"
"and a release of the interpreter lock each time.");

static PyObject *timerfd_arm(PyObject *self, PyObject *args) {
    int fd;
    double deadline;
    if (!PyArg_ParseTuple(args, "id:timerfd_arm", &fd, &deadline))
        return NULL;
    struct itimerspec spec;
    memset(&spec, 0, sizeof(spec));
    set_timespec(&spec.it_value, deadline);
    if (syscall(SYS_timerfd_settime, fd, 1 /* TFD_TIMER_ABSTIME */, &spec, NULL) < 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    Py_RETURN_NONE;
}

static PyObject *eventfd_reset(PyObject *self, PyObject *arg) {
    int fd = _PyLong_AsInt(arg);
    if (fd == -1 && PyErr_Occurred()) return NULL;
    uint64_t count;
    ssize_t r = read(fd, &count, sizeof(count));
    (void)r;
    Py_RETURN_NONE;
}
#endif

/* ==== io_uring WAL writes (storage/wal/aio.py UringContext; session 33 uring helper) ======
   One ring per WAL loop driver. A write whose single piece lies inside a registered range is
   submitted as IORING_OP_WRITE_FIXED: the range's pages were pinned once when it was
   registered, so the kernel does not pin each 4 KiB page of the source per write (libaio's
   io_submit does: gup_fast_fallback, 5-6.5 % of the broker's CPU under raw 1 MiB produce).
   Micro-benchmark (bench/HISTORY.md session 33): 1 MiB O_DIRECT|RWF_DSYNC writes from 4 KiB
   pages, QD 8: libaio 0.036-0.052 ms CPU/MiB, plain IORING_OP_WRITE 0.038-0.055,
   WRITE_FIXED 0.018-0.028. Completions: the ring's registered eventfd (in the loop's epoll),
   then the CQ read from shared memory, no system call. IORING_FEAT_SUBMIT_STABLE: the iovec
   of a WRITEV is copied at submission. Every call keeps the interpreter lock (none waits). */
#if defined(__linux__) && __has_include(<linux/io_uring.h>)
#include <linux/io_uring.h>
#include <sys/mman.h>
#define HAVE_URING 1
#define FIXED_MAX 256   /* registered slabs (64 MiB each, frames.py REGISTERED_SLAB: 16 GiB) */
#define URING_OP_WRITEV_FIXED 61            /* Linux 6.15; older headers lack it */

typedef struct {
    int fd;
    unsigned *sq_head, *sq_tail, *sq_mask, *sq_array, *cq_head, *cq_tail, *cq_mask;
    struct io_uring_sqe *sqes;
    struct io_uring_cqe *cqes;
    void *sq_map, *sqe_map;
    size_t sq_len, sqe_len;
    unsigned gen;                           /* fixed_gen when `slots` was last synced */
    int fixed_ok;                           /* 0: the kernel refused a registration */
    int writev_fixed;                       /* IORING_OP_WRITEV_FIXED supported (6.15+) */
    int syncing;                            /* a uring_sync is registering */
    struct { uintptr_t start, end; unsigned serial; } slots[FIXED_MAX];  /* registered here */
} uring_t;

/* Memory that may be registered with every ring: slabs that stay mapped, faulted in, until
   fixed_remove (the frame arena's 4 KiB-page slabs, below). A slot's index is its buffer
   index in every ring. A ring catches up with the table (fixed_gen) before each submit, so
   a slab unmapped and mapped again at the same address is never written from its old pages:
   removal happens before the munmap, under the interpreter lock, as every submit. */
static struct { uintptr_t start, end; unsigned serial; } fixed_tab[FIXED_MAX];  /* end 0: empty */
static unsigned fixed_gen = 1;         /* also each slab's serial: a slab mapped again at the
                                          same address is another slab (its own pages) */

static void fixed_add(const void *p, size_t len) {
    for (int i = 0; i < FIXED_MAX; i++)
        if (fixed_tab[i].end == 0) {
            fixed_tab[i].start = (uintptr_t)p;
            fixed_tab[i].end = (uintptr_t)p + len;
            fixed_tab[i].serial = ++fixed_gen;
            return;
        }                                   /* table full: that slab's writes stay plain */
}

static void fixed_remove(const void *p) {
    for (int i = 0; i < FIXED_MAX; i++)
        if (fixed_tab[i].start == (uintptr_t)p && fixed_tab[i].end) {
            fixed_tab[i].start = fixed_tab[i].end = 0;
            fixed_tab[i].serial = ++fixed_gen;
        }
}

/* Bring the ring's registered buffers in line with fixed_tab, slot by slot
   (IORING_REGISTER_BUFFERS_UPDATE; an empty iovec empties a slot). A refusal (RLIMIT_MEMLOCK
   without CAP_IPC_LOCK) turns fixed writes off for this ring: they go plain, as before.
   The interpreter lock is released around the io_uring_register calls; called
   under the lock by the ring's own thread (a submit) or by another (uring_refresh: the frame
   arena's filler, so the event loop's ring is brought up to date off the loop). Pinning a
   64 MiB slab takes ~2-3 ms and a new ring's first sync registers every slab (1 GiB: ~35 ms):
   under the lock, an upload thread's first gather put stalled the event loop 31-65 ms
   (bench/HISTORY.md, session 46). Under the lock first: the table is copied and every slot
   that will change is emptied, so the ring's own lookups (uring_find, under the lock) write
   those pages plainly meanwhile. Under the lock again after: a slot is filled only if the
   table still holds the slab it registered (fixed_remove runs under the lock, before the
   munmap; a slab mapped again at the same address has another serial); one that changed
   stays empty and the ring's gen stale, so a later sync registers it again. A second caller
   while one registers (`syncing`) returns at once; uring_close waits for it. */
static void uring_sync(uring_t *r) {
    if (r->syncing) return;
    unsigned gen = fixed_gen;
    if (!r->fixed_ok) {
        r->gen = gen;
        return;
    }
    struct { uintptr_t start, end; unsigned serial; } want[FIXED_MAX];
    unsigned char todo[FIXED_MAX], done[FIXED_MAX];
    memcpy(want, fixed_tab, sizeof(want));
    int any = 0;
    for (unsigned i = 0; i < FIXED_MAX; i++) {
        todo[i] = r->slots[i].serial != want[i].serial;
        done[i] = 0;
        if (todo[i]) {
            r->slots[i].start = r->slots[i].end = 0;     /* empty unless the update succeeds */
            r->slots[i].serial = 0;
            any = 1;
        }
    }
    if (!any) {
        r->gen = gen;
        return;
    }
    int refused = -1;                        /* the slot whose registration failed */
    int fd = r->fd;
    __atomic_store_n(&r->syncing, 1, __ATOMIC_SEQ_CST);
    PyThreadState *ts = PyEval_SaveThread();
    for (unsigned i = 0; i < FIXED_MAX; i++) {
        if (!todo[i]) continue;
        struct iovec iov = {(void *)want[i].start, want[i].end - want[i].start};
        struct io_uring_rsrc_update2 up;
        memset(&up, 0, sizeof(up));
        up.offset = i;
        up.data = (uint64_t)(uintptr_t)&iov;
        up.nr = 1;
        if (syscall(__NR_io_uring_register, fd, IORING_REGISTER_BUFFERS_UPDATE, &up,
                    sizeof(up)) < 0) {
            if (want[i].end == 0) {
                done[i] = 1;                 /* an empty slot stays empty */
                continue;
            }
            refused = (int)i;
            break;
        }
        done[i] = 1;
    }
    PyEval_RestoreThread(ts);
    __atomic_store_n(&r->syncing, 0, __ATOMIC_SEQ_CST);
    if (refused >= 0 && fixed_tab[refused].serial == want[refused].serial) {
        /* refused for a slab still in place (RLIMIT_MEMLOCK): fixed writes off, as before */
        r->fixed_ok = 0;
        syscall(__NR_io_uring_register, fd, IORING_UNREGISTER_BUFFERS, NULL, 0);
        memset(r->slots, 0, sizeof(r->slots));
        r->gen = fixed_gen;
        return;
    }
    for (unsigned i = 0; i < FIXED_MAX; i++) {
        if (!done[i] || fixed_tab[i].serial != want[i].serial)
            continue;                        /* not registered, or changed meanwhile */
        r->slots[i].start = want[i].start;
        r->slots[i].end = want[i].end;
        r->slots[i].serial = want[i].serial;
    }
    r->gen = gen;                            /* stale if the table changed meanwhile */
}

static void uring_free(PyObject *cap) {
    uring_t *r = PyCapsule_GetPointer(cap, "s3kafka.uring");
    if (r == NULL) return;
    if (r->sqe_map) munmap(r->sqe_map, r->sqe_len);
    if (r->sq_map) munmap(r->sq_map, r->sq_len);
    if (r->fd >= 0) close(r->fd);            /* waits for nothing: requests finish in the kernel */
    PyMem_Free(r);
}

static uring_t *uring_get(PyObject *cap) {
    uring_t *r = PyCapsule_GetPointer(cap, "s3kafka.uring");
    if (r != NULL && r->fd < 0) {
        PyErr_SetString(PyExc_ValueError, "io_uring ring closed");
        return NULL;
    }
    return r;
}

/* whether the kernel knows opcode `op` (IORING_REGISTER_PROBE) */
static int uring_supports(int fd, unsigned op) {
    size_t len = sizeof(struct io_uring_probe) + 256 * sizeof(struct io_uring_probe_op);
    struct io_uring_probe *pr = PyMem_Calloc(1, len);
    if (pr == NULL) return 0;
    int ok = syscall(__NR_io_uring_register, fd, IORING_REGISTER_PROBE, pr, 256) == 0 &&
             op <= pr->last_op && (pr->ops[op].flags & IO_URING_OP_SUPPORTED);
    PyMem_Free(pr);
    return ok;
}

/* the ring's registered buffer holding [a, a + n), or -1 */
static int uring_find(const uring_t *r, uintptr_t a, size_t n) {
    for (int i = 0; i < FIXED_MAX; i++)
        if (r->slots[i].start <= a && a + n <= r->slots[i].end)
            return i;
    return -1;
}

PyDoc_STRVAR(uring_setup_doc,
"uring_setup(entries, eventfd) -> ring\n\n"
"A new io_uring of `entries` submission slots (a power of two is used) whose completions\n"
"signal `eventfd` (IORING_REGISTER_EVENTFD; none when < 0: gather_write waits on the ring). Raises OSError(errno) when the kernel refuses\n"
"(ENOSYS, EPERM: io_uring disabled; ENOMEM); the caller falls back to libaio.");

static PyObject *uring_setup_(PyObject *self, PyObject *args) {
    unsigned entries;
    int efd;
    if (!PyArg_ParseTuple(args, "Ii:uring_setup", &entries, &efd)) return NULL;
    struct io_uring_params p;
    memset(&p, 0, sizeof(p));
    int fd = (int)syscall(__NR_io_uring_setup, entries, &p);
    if (fd < 0) return PyErr_SetFromErrno(PyExc_OSError);
    uring_t *r = PyMem_Calloc(1, sizeof(*r));
    if (r == NULL) { close(fd); return PyErr_NoMemory(); }
    r->fd = fd;
    PyObject *cap = PyCapsule_New(r, "s3kafka.uring", uring_free);
    if (cap == NULL) { close(fd); PyMem_Free(r); return NULL; }
    size_t sq_len = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    size_t cq_len = p.cq_off.cqes + p.cq_entries * sizeof(struct io_uring_cqe);
    if (!(p.features & IORING_FEAT_SINGLE_MMAP) || !(p.features & IORING_FEAT_SUBMIT_STABLE)) {
        errno = EOPNOTSUPP;                   /* kernels older than 5.5 */
        goto fail;
    }
    r->sq_len = sq_len > cq_len ? sq_len : cq_len;
    char *sq = mmap(NULL, r->sq_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd,
                    IORING_OFF_SQ_RING);
    if (sq == MAP_FAILED) goto fail;
    r->sq_map = sq;
    r->sqe_len = p.sq_entries * sizeof(struct io_uring_sqe);
    r->sqe_map = mmap(NULL, r->sqe_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd,
                      IORING_OFF_SQES);
    if (r->sqe_map == MAP_FAILED) { r->sqe_map = NULL; goto fail; }
    r->sqes = r->sqe_map;
    r->sq_head = (unsigned *)(sq + p.sq_off.head);
    r->sq_tail = (unsigned *)(sq + p.sq_off.tail);
    r->sq_mask = (unsigned *)(sq + p.sq_off.ring_mask);
    r->sq_array = (unsigned *)(sq + p.sq_off.array);
    r->cq_head = (unsigned *)(sq + p.cq_off.head);
    r->cq_tail = (unsigned *)(sq + p.cq_off.tail);
    r->cq_mask = (unsigned *)(sq + p.cq_off.ring_mask);
    r->cqes = (struct io_uring_cqe *)(sq + p.cq_off.cqes);
    if (efd >= 0 && syscall(__NR_io_uring_register, fd, IORING_REGISTER_EVENTFD, &efd, 1) < 0)
        goto fail;
    struct io_uring_rsrc_register reg;       /* FIXED_MAX empty slots, filled by uring_sync */
    memset(&reg, 0, sizeof(reg));
    reg.nr = FIXED_MAX;
    reg.flags = IORING_RSRC_REGISTER_SPARSE;
    r->fixed_ok = syscall(__NR_io_uring_register, fd, IORING_REGISTER_BUFFERS2, &reg,
                          sizeof(reg)) == 0;
    r->writev_fixed = uring_supports(fd, URING_OP_WRITEV_FIXED);
    return cap;
fail:
    PyErr_SetFromErrno(PyExc_OSError);
    Py_DECREF(cap);                           /* uring_free unmaps and closes */
    return NULL;
}

/* the ring's registered buffer holding every piece, or -1 */
static int uring_find_all(const uring_t *r, const struct iovec *iov, Py_ssize_t n) {
    int slot = uring_find(r, (uintptr_t)iov[0].iov_base, iov[0].iov_len);
    for (Py_ssize_t i = 1; i < n && slot >= 0; i++) {
        uintptr_t a = (uintptr_t)iov[i].iov_base;
        if (a < r->slots[slot].start || a + iov[i].iov_len > r->slots[slot].end) slot = -1;
    }
    return slot;
}

PyDoc_STRVAR(uring_submit_doc,
"uring_submit(ring, fd, pieces, offset, token, dsync) -> bool\n\n"
"Queue one write of `pieces`, (address, length) pairs, at `offset` of `fd`, reported with\n"
"`token` (aio_submit's contract: the buffers stay valid until the completion is reaped),\n"
"RWF_DSYNC when `dsync`. Pieces all inside one registered slab (fixed_tab: the frame arena's\n"
"4 KiB-page slabs) go as WRITE_FIXED (one piece) or WRITEV_FIXED (several; Linux 6.15+) and\n"
"True is returned; others as WRITE / WRITEV (False).\n"
"Raises OSError(errno) as io_uring_enter fails\n"
"(EAGAIN, EBUSY: the caller retries as for io_submit).");

static PyObject *uring_submit_(PyObject *self, PyObject *args) {
    PyObject *cap, *pieces;
    int fd, dsync;
    long long offset;
    unsigned long long token;
    if (!PyArg_ParseTuple(args, "OiOLKp:uring_submit", &cap, &fd, &pieces, &offset, &token,
                          &dsync))
        return NULL;
    uring_t *r = uring_get(cap);
    if (r == NULL) return NULL;
    struct iovec stack_iov[AIO_STACK_IOV], *iov = stack_iov;
    Py_ssize_t n = aio_pieces(pieces, stack_iov, &iov);
    if (n < 0) return NULL;
    unsigned tail = *r->sq_tail, idx = tail & *r->sq_mask;
    struct io_uring_sqe *e = &r->sqes[idx];
    memset(e, 0, sizeof(*e));
    if (r->gen != fixed_gen) uring_sync(r);
    int fixed = n == 1 || r->writev_fixed ? uring_find_all(r, iov, n) : -1;
    e->fd = fd;
    e->off = (uint64_t)offset;
    e->rw_flags = dsync ? RWF_DSYNC : 0;
    e->user_data = token;
    if (n == 1) {
        e->opcode = fixed >= 0 ? IORING_OP_WRITE_FIXED : IORING_OP_WRITE;
        e->addr = (uint64_t)(uintptr_t)iov[0].iov_base;
        e->len = (uint32_t)iov[0].iov_len;
        if (fixed >= 0) e->buf_index = (uint16_t)fixed;
    } else {
        e->opcode = fixed >= 0 ? URING_OP_WRITEV_FIXED : IORING_OP_WRITEV;
        e->addr = (uint64_t)(uintptr_t)iov;
        e->len = (uint32_t)n;
        if (fixed >= 0) e->buf_index = (uint16_t)fixed;
    }
    r->sq_array[idx] = idx;
    __atomic_store_n(r->sq_tail, tail + 1, __ATOMIC_RELEASE);
    long got;
    do {
        got = syscall(__NR_io_uring_enter, r->fd, 1, 0, 0, NULL, 0);
    } while (got < 0 && errno == EINTR);
    int err = errno;
    if (iov != stack_iov) PyMem_Free(iov);
    if (got != 1) {                            /* not consumed: take the entry back */
        __atomic_store_n(r->sq_tail, tail, __ATOMIC_RELEASE);
        errno = got < 0 ? err : EAGAIN;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyBool_FromLong(fixed >= 0);
}

PyDoc_STRVAR(uring_reap_doc,
"uring_reap(ring) -> list of (token, result)\n\n"
"Every completion in the ring's CQ (shared memory: no system call); result is the byte\n"
"count written or a negative errno, as aio_reap's.");

static PyObject *uring_reap_(PyObject *self, PyObject *cap) {
    uring_t *r = uring_get(cap);
    if (r == NULL) return NULL;
    PyObject *out = PyList_New(0);
    if (out == NULL) return NULL;
    unsigned head = *r->cq_head, tail = __atomic_load_n(r->cq_tail, __ATOMIC_ACQUIRE);
    for (; head != tail; head++) {
        struct io_uring_cqe *c = &r->cqes[head & *r->cq_mask];
        PyObject *t = Py_BuildValue("(Ki)", (unsigned long long)c->user_data, c->res);
        if (t == NULL || PyList_Append(out, t) < 0) {
            Py_XDECREF(t);
            Py_DECREF(out);
            __atomic_store_n(r->cq_head, head, __ATOMIC_RELEASE);
            return NULL;
        }
        Py_DECREF(t);
    }
    __atomic_store_n(r->cq_head, head, __ATOMIC_RELEASE);
    return out;
}

PyDoc_STRVAR(uring_writev_fixed_doc,
"uring_writev_fixed(ring) -> bool\n\n"
"Whether the ring's kernel has IORING_OP_WRITEV_FIXED (several pieces in one registered\n"
"slab written without pinning; Linux 6.15+). Without it such writes go as WRITEV.");

static PyObject *uring_writev_fixed_(PyObject *self, PyObject *cap) {
    uring_t *r = uring_get(cap);
    if (r == NULL) return NULL;
    return PyBool_FromLong(r->writev_fixed);
}

PyDoc_STRVAR(uring_close_doc,
"uring_close(ring) -> None\n\n"
"Close the ring now (the capsule's destructor would later); further calls raise ValueError.\n"
"Writes in flight complete in the kernel; their completions are lost, so drain first.");

PyDoc_STRVAR(uring_refresh_doc,
"uring_refresh(ring) -> None\n\n"
"Register with `ring` the frame arena slabs it does not hold yet (and drop the ones gone),\n"
"with the interpreter lock released while the kernel pins them: what its next submit would\n"
"do, from any thread. The frame arena's filler calls it for the event loop's WAL ring after\n"
"growing, so the loop does not pin 64 MiB slabs (~2-3 ms each) in a produce request.");

PyDoc_STRVAR(uring_registered_doc,
"uring_registered(ring) -> int\n\n"
"Bytes of frame arena slabs registered with `ring` as fixed buffers now (/metrics, tests).");

static PyObject *uring_registered_(PyObject *self, PyObject *cap) {
    uring_t *r = uring_get(cap);
    if (r == NULL) return NULL;
    unsigned long long n = 0;
    for (unsigned i = 0; i < FIXED_MAX; i++)
        n += r->slots[i].end - r->slots[i].start;
    return PyLong_FromUnsignedLongLong(n);
}

static PyObject *uring_refresh_(PyObject *self, PyObject *cap) {
    uring_t *r = uring_get(cap);
    if (r == NULL) return NULL;
    if (r->gen != fixed_gen) uring_sync(r);
    Py_RETURN_NONE;
}

static PyObject *uring_close_(PyObject *self, PyObject *cap) {
    uring_t *r = PyCapsule_GetPointer(cap, "s3kafka.uring");
    if (r == NULL) return NULL;
    if (__atomic_load_n(&r->syncing, __ATOMIC_SEQ_CST)) {
        Py_BEGIN_ALLOW_THREADS            /* another thread registers slabs with this ring */
        while (__atomic_load_n(&r->syncing, __ATOMIC_SEQ_CST))
            usleep(200);
        Py_END_ALLOW_THREADS
    }
    if (r->fd >= 0) {
        close(r->fd);
        r->fd = -1;
    }
    Py_RETURN_NONE;
}
#endif
/* ==== end of the io_uring section ======================================================== */

static PyObject *read_span_crcs(PyObject *self, PyObject *args);
PyDoc_STRVAR(read_span_crcs_doc,
"read_span_crcs(fd, buf, offset, ranges, skip) -> (int, list)\n\n"
"Fill the writable buffer `buf` from file `fd` at `offset` (preads until it is full or the\n"
"file ends), then the CRC-32C of each (start, size) range of `ranges` (positions in `buf`)\n"
"from its byte `skip` on, all with the interpreter lock released once. Returns the bytes\n"
"read and per range its CRC, or None where the range was not read whole (the file ended)\n"
"or is shorter than `skip`. Raises OSError on an error (EINTR is retried; EINVAL: O_DIRECT\n"
"refused, the caller reads without it).\n"
"storage/objects/store.py reads a cold span of object blocks so: one hand-off with the event\n"
"loop per span instead of one per block CRC and one for the read.");

static PyObject *map_buffer(PyObject *self, PyObject *args);
PyDoc_STRVAR(map_buffer_doc,
"map_buffer(size, huge) -> MappedBuffer\n\n"
"A fresh anonymous private mapping of `size` bytes (page aligned, zero pages until written)\n"
"as a writable buffer (len() = size; unmapped when the object goes), with MADV_HUGEPAGE\n"
"when `huge` (best effort; from 2 MiB on the mapping then starts on a 2 MiB boundary, so\n"
"O_DIRECT reads into it go to the device in large requests). mmap and madvise run with the\n"
"interpreter lock released: both take the process's mmap lock for writing, which waits\n"
"behind every other thread's page faults in progress (the cold read threads' O_DIRECT\n"
"reads into fresh memory), and through Python's mmap module a cold thread waited so holding\n"
"the interpreter lock, stalling the event loop (storage/objects/buffers.py).");

static PyObject *fault_in(PyObject *self, PyObject *arg);
PyDoc_STRVAR(fault_in_doc,
"fault_in(buf) -> None\n\n"
"Fault in every page of the writable buffer `buf` now by writing a zero byte into each (its\n"
"contents become undefined), with the interpreter lock released: a fault per page takes\n"
"only the mapping's own lock, where one madvise(MADV_POPULATE_WRITE) over the buffer holds\n"
"the process's mmap_lock from the first page to the last and stops any other thread's\n"
"mmap/munmap meanwhile (the event loop's allocator; frame_arena's grow, bench/HISTORY.md\n"
"session 35 stall). broker/frames.py's prefill thread, for its bytearray frames; the file\n"
"store's fresh cold read buffers (storage/objects/buffers.py), before the O_DIRECT read.");

static PyObject *frame_arena(PyObject *self, PyObject *args);
PyDoc_STRVAR(frame_arena_doc,
"frame_arena(slab, max_bytes, huge=True) -> FrameArena\n\n"
"(huge false: 4 KiB pages, MADV_NOHUGEPAGE; slabs grown populated are registered with the\n"
"WAL's io_uring rings as fixed buffers, see the io_uring section.)\n"
"Large request frames carved from 2 MiB-aligned MADV_HUGEPAGE slabs of `slab` bytes, at\n"
"most `max_bytes` of slabs, each frame's pages back in the arena when the frame goes; slabs\n"
"are unmapped only with the arena (broker/frames.py; the code's comment says why).");

static PyObject *take_grouped(PyObject *self, PyObject *args);
PyDoc_STRVAR(take_grouped_doc,
"take_grouped(pending, max_bytes, max_entries, at_least_one, out, groups, cums) -> int\n\n"
"storage.cache.log_cache.LogCache.take_grouped in one pass (see there).");

/* ---- cwal (session 33): WAL records received in place (storage/wal/placed.py, wal.py) ----
   The per-request bookkeeping of a large Produce record written from its own buffer, which
   took a dozen Python calls and two ctypes objects per request. */

PyDoc_STRVAR(buffer_address_doc,
"buffer_address(buf) -> int\n\n"
"The address of a writable, contiguous buffer's first byte (placed.address: what\n"
"ctypes.addressof(ctypes.c_char.from_buffer(buf)) gives, without building two objects).");

static PyObject *buffer_address(PyObject *self, PyObject *arg) {
    Py_buffer b;
    if (PyObject_GetBuffer(arg, &b, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    PyObject *ret = PyLong_FromVoidPtr(b.buf);
    PyBuffer_Release(&b);
    return ret;
}

PyDoc_STRVAR(place_record_doc,
"place_record(region, head, payload, pos, split, want, summed_from=-1, summed=0) -> None | int\n\n"
"A WAL record whose payload lies in `region` itself (received in place): `region` holds\n"
"24 + len(head) bytes, then `payload` (exactly there: ValueError otherwise), then the rest of\n"
"its last page (len(region) must be the record's size rounded up to 4 KiB). One pass over the\n"
"payload gives the record's CRC-32C (head + payload) and, when `split` >= 0, the CRC of\n"
"payload[split:]; if that is not `want`, it is returned and nothing is written. Else `head`\n"
"is written after the 24 header bytes, the record header (format.pack_record_header with\n"
"`pos`) before it, the tail after the payload zeroed, and None returned.\n"
"`summed`: the CRC of payload[summed_from:] taken as it was received (while in the cache).\n"
"When summed_from == split and summed == want it stands for that pass: only payload[:split]\n"
"is read. Any other sum (bytes stamped since, a corrupt batch) is ignored: the pass decides.");

static PyObject *place_record(PyObject *self, PyObject *args) {
    PyObject *region_obj, *head_obj, *payload_obj;
    unsigned long long pos;
    Py_ssize_t split;
    unsigned long want, summed = 0;
    Py_ssize_t summed_from = -1;
    Py_buffer region, head, pay;
    if (!PyArg_ParseTuple(args, "OOOKnk|nk:place_record", &region_obj, &head_obj, &payload_obj,
                          &pos, &split, &want, &summed_from, &summed))
        return NULL;
    if (PyObject_GetBuffer(region_obj, &region, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    if (PyObject_GetBuffer(head_obj, &head, PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&region);
        return NULL;
    }
    if (PyObject_GetBuffer(payload_obj, &pay, PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&head);
        PyBuffer_Release(&region);
        return NULL;
    }
    PyObject *ret = NULL;
    unsigned char *r = (unsigned char *)region.buf;
    size_t hn = (size_t)head.len, pn = (size_t)pay.len, n = hn + pn;
    size_t size = 24 + n, aligned = (size + 4095) & ~(size_t)4095;
    if ((size_t)region.len != aligned || (unsigned char *)pay.buf != r + 24 + hn) {
        PyErr_SetString(PyExc_ValueError, "place_record: payload not in place in the region");
    } else if (n > 0xFFFFFFFFULL) {
        PyErr_SetString(PyExc_ValueError, "place_record: body longer than 4 GiB");
    } else if (split > (Py_ssize_t)pn) {
        PyErr_SetString(PyExc_ValueError, "place_record: split outside the payload");
    } else {
        const unsigned char *p = (const unsigned char *)pay.buf;
        uint32_t value = ~crc_any(~0u, (const unsigned char *)head.buf, hn), crc, tail = 0;
        PyThreadState *ts = nogil_for(pn);
        if (split >= 0) {
            size_t k = (size_t)split;
            uint32_t first = ~crc_any(~value, p, k);
            /* the bytes' CRC from their receipt: equal to `want`, it is theirs now (they are
               unchanged, or stamped with a new CRC that this sum matches) */
            if (summed_from == split && (uint32_t)summed == (uint32_t)want)
                tail = (uint32_t)summed;
            else
                tail = ~crc_any(~0u, p + k, pn - k);
            crc = crc_combine(first, tail, pn - k);
        } else {
            crc = ~crc_any(~value, p, pn);
        }
        gil_back(ts);
        if (split >= 0 && tail != (uint32_t)want) {
            ret = PyLong_FromUnsignedLong(tail);
        } else {
            memmove(r + 24, head.buf, hn);
            put_be32(r, 0x52454331u);                     /* format.RECORD_MAGIC, "REC1" */
            put_be32(r + 4, (uint32_t)n);
            put_be32(r + 8, (uint32_t)(pos >> 32));
            put_be32(r + 12, (uint32_t)pos);
            put_be32(r + 16, crc);
            put_be32(r + 20, ~crc_any(~(uint32_t)0, r, 20));
            memset(r + size, 0, aligned - size);
            ret = Py_None;
            Py_INCREF(ret);
        }
    }
    PyBuffer_Release(&pay);
    PyBuffer_Release(&head);
    PyBuffer_Release(&region);
    return ret;
}

PyDoc_STRVAR(take_offered_doc,
"take_offered(offered, payload, head) -> (memoryview, summed_from, summed) | None\n\n"
"storage/wal/placed.py take() in one call: `offered` is its registry (id(buf) -> (buf,\n"
"offset, length, summed_from, summed)); the region (`head` bytes before `payload`, the\n"
"payload, the rest of its last page) and the offer's sum when `payload` is a writable\n"
"contiguous memoryview that is exactly an offered payload whose headers begin on a 4 KiB\n"
"page; the offer is then used up (also when the place does not suit). None when it is not\n"
"offered (nothing changes).");

static PyObject *take_offered(PyObject *self, PyObject *args) {
    PyObject *offered, *payload;
    Py_ssize_t head;
    if (!PyArg_ParseTuple(args, "O!On:take_offered", &PyDict_Type, &offered, &payload, &head))
        return NULL;
    if (!Py_IS_TYPE(payload, &PyMemoryView_Type))     /* type(payload) is memoryview */
        Py_RETURN_NONE;
    PyObject *buf = PyMemoryView_GET_BUFFER(payload)->obj;     /* memoryview.obj */
    if (buf == NULL)
        Py_RETURN_NONE;
    PyObject *key = PyLong_FromVoidPtr(buf);                   /* id(buf) */
    if (key == NULL)
        return NULL;
    PyObject *ent = PyDict_GetItemWithError(offered, key);
    if (ent == NULL || !PyTuple_Check(ent) || PyTuple_GET_SIZE(ent) != 5
            || PyTuple_GET_ITEM(ent, 0) != buf) {
        Py_DECREF(key);
        if (PyErr_Occurred())
            return NULL;
        Py_RETURN_NONE;
    }
    Py_ssize_t offset = PyLong_AsSsize_t(PyTuple_GET_ITEM(ent, 1));
    Py_ssize_t length = PyLong_AsSsize_t(PyTuple_GET_ITEM(ent, 2));
    PyObject *summed_from = PyTuple_GET_ITEM(ent, 3), *summed = PyTuple_GET_ITEM(ent, 4);
    Py_INCREF(summed_from);              /* the entry goes with the offer */
    Py_INCREF(summed);
    int bad = PyDict_DelItem(offered, key);
    Py_DECREF(key);
    PyObject *ret = NULL;
    if (bad < 0 || PyErr_Occurred())
        goto done;
    Py_buffer *v = PyMemoryView_GET_BUFFER(payload);
    if (v->len != length || v->itemsize != 1 || v->readonly || !PyBuffer_IsContiguous(v, 'C'))
        goto none;
    Py_buffer b;
    if (PyObject_GetBuffer(buf, &b, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        PyErr_Clear();
        goto none;
    }
    char *base = (char *)b.buf;
    Py_ssize_t blen = b.len;
    PyBuffer_Release(&b);
    Py_ssize_t start = offset - head;
    Py_ssize_t end = start + ((head + length + 4095) & ~(Py_ssize_t)4095);
    if ((char *)v->buf - base != offset || start < 0 || ((uintptr_t)(base + start) & 4095)
            || end > blen)
        goto none;
    PyObject *whole = PyMemoryView_FromObject(buf);
    if (whole == NULL)
        goto done;
    PyObject *region = PySequence_GetSlice(whole, start, end);
    Py_DECREF(whole);
    if (region == NULL)
        goto done;
    ret = PyTuple_Pack(3, region, summed_from, summed);
    Py_DECREF(region);
    goto done;
none:
    ret = Py_None;
    Py_INCREF(ret);
done:
    Py_DECREF(summed_from);
    Py_DECREF(summed);
    return ret;
}
/* ---- end of cwal's section ---- */

PyDoc_STRVAR(gc_untrack_doc,
"gc_untrack(obj) -> None\n\n"
"Take an instance of a Python class off the cyclic collector's lists (PyObject_GC_UnTrack):\n"
"it is never scanned again and is freed by its reference count alone. For objects that\n"
"provably cannot be part of a reference cycle (LogCache entries: numbers and a byte payload);\n"
"the collector could not free a cycle through one. TypeError for anything but an instance of a\n"
"class statement's type (heap type with the collector's support), whose dealloc tolerates an\n"
"untracked object; builtins such as memoryview do not.");

static PyObject *gc_untrack(PyObject *self, PyObject *obj) {
    (void)self;
    if (!PyType_HasFeature(Py_TYPE(obj), Py_TPFLAGS_HEAPTYPE) || !PyObject_IS_GC(obj)) {
        PyErr_SetString(PyExc_TypeError, "gc_untrack: not an instance of a Python class");
        return NULL;
    }
    PyObject_GC_UnTrack(obj);          /* a no-op when already untracked */
    Py_RETURN_NONE;
}

/* ---- the gather upload: objects written straight from the payloads' frames ----------------
   A large record whose payload[split:] CRC-32C was checked at its append (the entry's `check`,
   the client's batch CRC that the WAL verified in its pass over the record) is written to its
   object without being copied: it gets a data block of its own, placed (a gap of < 4 KiB
   before it, which readers skip: they find blocks by the index alone) so that its payload sits
   at the same offset within a 4 KiB page in the file as in memory. The payload's whole pages
   then go to the O_DIRECT file straight from its frame (io_uring WRITE_FIXED when the frame's
   slab is registered: no page pinned per write), and only the block's headers, the payload's
   two partial pages, the other (staged) records' blocks, the gaps and the index go through a
   small staging buffer. The block CRC is carried, not computed: crc(record header +
   payload[:split]) combined with the checked CRC of payload[split:] (crc_combine). The
   encoder's fused copy + CRC from cold frames was ~0.07-0.1 ms of upload CPU per MiB
   (bench/HISTORY.md, session 39/40). */

#define GATHER_ALIGN 4096

static PyObject *s_check;

typedef struct {
    rec_t rec;                  /* first: a staged block's records go to write_block */
    int gather;                 /* its own block, written from its frame */
    Py_ssize_t split;           /* crc(payload[split:]) == want, checked at its append */
    uint32_t want;
    Py_ssize_t pos;             /* gathered: its block's position in the object */
    int slot;                   /* gathered: the ring's registered buffer of its frame, or -1 */
} grec_t;

typedef struct {
    Py_ssize_t first, n, pos, body;
    int gathered;
} gblk_t;

typedef struct {
    grec_t *recs;
    Py_ssize_t nrec;
    gblk_t *blks;
    Py_ssize_t nblk;
    Py_ssize_t data_end;        /* where the last block ends (the index's position) */
    Py_ssize_t entries;         /* index entries */
    Py_ssize_t size;            /* the whole object: data, index, footer */
    Py_ssize_t max_region;      /* the largest staged region (bytes between two middles) */
    Py_ssize_t gathered;        /* records written from their frames */
} glayout_t;

static void glayout_free(glayout_t *g) {
    if (g->recs != NULL)
        for (Py_ssize_t i = 0; i < g->nrec; i++)
            if (g->recs[i].rec.buf.obj != NULL) PyBuffer_Release(&g->recs[i].rec.buf);
    PyMem_Free(g->recs);
    PyMem_Free(g->blks);
    memset(g, 0, sizeof(*g));
}

static inline Py_ssize_t g_up(Py_ssize_t x) { return (x + GATHER_ALIGN - 1) & ~(Py_ssize_t)(GATHER_ALIGN - 1); }
static inline Py_ssize_t g_down(Py_ssize_t x) { return x & ~(Py_ssize_t)(GATHER_ALIGN - 1); }

/* the payload's whole pages in the file: [*ms, *me) */
static inline void g_middle(const grec_t *r, Py_ssize_t *ms, Py_ssize_t *me) {
    Py_ssize_t q = r->pos + BLOCK_HDR + RECORD_HDR;
    *ms = g_up(q);
    *me = g_down(q + r->rec.buf.len);
}

/* read the records (their buffers exported: held until glayout_free) and lay the object out:
   the same block-closing rule as encode_blocks for the staged records; a gathered record
   closes the open block and gets one of its own. Returns -1 with an exception set. */
static int glayout_build(glayout_t *g, PyObject *list, Py_ssize_t block_size,
                         Py_ssize_t min_gather) {
    memset(g, 0, sizeof(*g));
    Py_ssize_t n = PyList_GET_SIZE(list);
    g->recs = PyMem_Calloc(n ? n : 1, sizeof(grec_t));
    g->blks = PyMem_Calloc(n ? n : 1, sizeof(gblk_t));
    if (g->recs == NULL || g->blks == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i >= PyList_GET_SIZE(list)) {
            PyErr_SetString(PyExc_RuntimeError, "gather: the records list changed");
            return -1;
        }
        PyObject *item = PyList_GET_ITEM(list, i);
        Py_INCREF(item);
        grec_t *r = &g->recs[i];
        PyObject *payload = NULL, *check = NULL;
        int bad = record_key(item, &r->rec.sid, &r->rec.base) < 0 || get_i64(item, s_count, &r->rec.count) < 0
                  || (payload = PyObject_GetAttr(item, s_payload)) == NULL;
        if (!bad) {
            check = PyObject_GetAttr(item, s_check);
            if (check == NULL) {
                if (PyErr_ExceptionMatches(PyExc_AttributeError)) PyErr_Clear();
                else bad = 1;
            }
        }
        Py_DECREF(item);
        if (!bad && PyObject_GetBuffer(payload, &r->rec.buf, PyBUF_C_CONTIGUOUS) < 0) bad = 1;
        Py_XDECREF(payload);
        if (!bad && check != NULL && check != Py_None) {
            long long split;
            unsigned long want;
            if (!PyArg_ParseTuple(check, "Lk", &split, &want)) bad = 1;
            else if (split >= 0 && split <= r->rec.buf.len) {
                r->split = (Py_ssize_t)split;
                r->want = (uint32_t)want;
                r->gather = r->rec.buf.len >= min_gather;
            }
        }
        Py_XDECREF(check);
        g->nrec = i + 1;
        if (bad) return -1;
        if (i && (r->rec.sid < r[-1].rec.sid || (r->rec.sid == r[-1].rec.sid && r->rec.base < r[-1].rec.base))) {
            PyErr_SetString(PyExc_ValueError, "records must be sorted by stream and offset");
            return -1;
        }
        if ((uint64_t)r->rec.buf.len > INT32_MAX - BLOCK_HDR - RECORD_HDR
                || r->rec.count - 1 < INT32_MIN || r->rec.count - 1 > INT32_MAX) {
            PyErr_SetString(PyExc_ValueError, "gather: record count or payload out of range");
            return -1;
        }
    }
    Py_ssize_t pos = 0, open = -1, bpos = 0, body = 0, region_from = 0;
    for (Py_ssize_t i = 0; i <= n; i++) {
        grec_t *r = i < n ? &g->recs[i] : NULL;
        Py_ssize_t q = 0;
        if (r != NULL && r->gather) {
            /* its payload, in a block of its own after the open one (closed for it), lands at
               its address's offset in a page */
            Py_ssize_t qmin = (open >= 0 ? bpos + BLOCK_HDR + body : pos) + BLOCK_HDR + RECORD_HDR;
            q = qmin + (Py_ssize_t)(((uintptr_t)r->rec.buf.buf - (uintptr_t)qmin)
                                    & (GATHER_ALIGN - 1));
            if (g_down(q + r->rec.buf.len) - g_up(q) < GATHER_ALIGN)
                r->gather = 0;                /* no whole page to gather: staged */
        }
        int close = open >= 0 && (r == NULL || r->gather || body >= block_size);
        if (close) {
            g->blks[g->nblk++] = (gblk_t){open, i - open, bpos, body, 0};
            pos = bpos + BLOCK_HDR + body;
            int64_t last = -1;
            for (Py_ssize_t k = open; k < i; k++)
                if (k == open || g->recs[k].rec.sid != last) { g->entries++; last = g->recs[k].rec.sid; }
            open = -1;
        }
        if (r == NULL) break;
        if (r->gather) {
            r->pos = q - BLOCK_HDR - RECORD_HDR;
            g->blks[g->nblk++] = (gblk_t){i, 1, r->pos, RECORD_HDR + r->rec.buf.len, 1};
            g->entries++;
            g->gathered++;
            Py_ssize_t ms, me;
            g_middle(r, &ms, &me);
            if (ms - region_from > g->max_region) g->max_region = ms - region_from;
            region_from = me;
            pos = q + r->rec.buf.len;
            continue;
        }
        if (open < 0) {
            open = i;
            bpos = pos;
            body = 0;
        }
        body += RECORD_HDR + r->rec.buf.len;
    }
    g->data_end = pos;
    g->size = pos + g->entries * 36 + 48;
    if (g_up(g->size) - region_from > g->max_region) g->max_region = g_up(g->size) - region_from;
    return 0;
}

/* the index entries (as encode_blocks returns them) of the layout */
static PyObject *glayout_index(const glayout_t *g) {
    PyObject *index = PyList_New(0);
    if (index == NULL) return NULL;
    for (Py_ssize_t b = 0; b < g->nblk; b++) {
        const gblk_t *k = &g->blks[b];
        Py_ssize_t i = k->first, end = k->first + k->n;
        while (i < end) {
            Py_ssize_t j = i;
            int64_t cnt = 0;
            while (j < end && g->recs[j].rec.sid == g->recs[i].rec.sid) { cnt++; j++; }
            PyObject *e = Py_BuildValue("(LLLLnn)", (long long)g->recs[i].rec.sid,
                                        (long long)g->recs[i].rec.base,
                                        (long long)(g->recs[j - 1].rec.base + g->recs[j - 1].rec.count),
                                        (long long)cnt, k->pos, BLOCK_HDR + k->body);
            if (e == NULL || PyList_Append(index, e) < 0) {
                Py_XDECREF(e);
                Py_DECREF(index);
                return NULL;
            }
            Py_DECREF(e);
            i = j;
        }
    }
    return index;
}

PyDoc_STRVAR(gather_layout_doc,
"gather_layout(records, block_size, min_gather) -> (size, index, gathered, max_region, data_end)\n\n"
"The layout of a gather put of `records` (sorted by stream and offset; objects with\n"
"stream_id, base_offset, count, payload and optionally check = None or (split, crc): the\n"
"payload's CRC-32C from `split` on, checked at its append): the object's size, its index\n"
"entries as encode_blocks returns them, how many records are written from their own\n"
"memory (payload at least `min_gather` bytes with a check), the largest staged region (the\n"
"staging buffer gather_write needs) and where the data blocks end (the index's position).\n"
"Deterministic for the same records at the same addresses: gather_write lays them out again.");

static PyObject *gather_layout(PyObject *self, PyObject *args) {
    PyObject *list;
    Py_ssize_t block_size, min_gather;
    if (!PyArg_ParseTuple(args, "O!nn:gather_layout", &PyList_Type, &list, &block_size,
                          &min_gather))
        return NULL;
    glayout_t g;
    if (glayout_build(&g, list, block_size, min_gather) < 0) {
        glayout_free(&g);
        return NULL;
    }
    PyObject *index = glayout_index(&g), *ret = NULL;
    if (index != NULL)
        ret = Py_BuildValue("(nNnnn)", g.size, index, g.gathered, g.max_region, g.data_end);
    glayout_free(&g);
    return ret;
}

/* A gather put's writes, a batch at a time: a staged region's piece and the next payload's
   pages (about `chunk` bytes in all, as one piece of a streamed put: no more of this put
   queued in front of a WAL write) submitted together and waited for together, one device
   round trip per batch. One at a time, the small region writes added a round trip each and
   the puts fell behind the WAL (request p99 +50 ms under raw 1 MiB produce). No interpreter
   lock (the caller released it). */
#define GB_MAX 8

typedef struct {
#ifdef HAVE_URING
    uring_t *r;                 /* NULL: pwrite */
#else
    void *r;
#endif
    int fd;
    Py_ssize_t bytes, chunk;
    int n;
    Py_ssize_t fixed;           /* pieces written as WRITE_FIXED */
    struct { const unsigned char *p; size_t len; uint64_t off; int slot; } e[GB_MAX];
} gbatch_t;

/* p[0:n) at `off` with pwrite, short writes continued; 0 or an errno */
static int gb_pwrite(int fd, const unsigned char *p, size_t n, uint64_t off) {
    while (n > 0) {
        ssize_t w = pwrite(fd, p, n, (off_t)off);
        if (w < 0 && errno == EINTR) continue;
        if (w < 0) return errno;
        if (w == 0) return EIO;
        p += w;
        n -= (size_t)w;
        off += (uint64_t)w;
    }
    return 0;
}

#ifdef HAVE_URING
static uint64_t gb_seq;         /* batches so far (all threads): tags each batch's completions */

/* the batch through the ring: every entry queued, one io_uring_enter submits them and waits
   for all; a short write's rest then goes by pwrite. Entries the kernel refused to take are
   taken back (the SQ head says which); those it took are waited for (their memory is the
   caller's until they complete) unless the ring itself fails. Each entry's user_data is the
   batch's sequence number and its index: a completion left over from a batch that gave up is
   never counted as this one's. */
static int gb_ring(gbatch_t *b, int n) {
    uring_t *r = b->r;
    long res[GB_MAX];
    uint64_t seq = __atomic_add_fetch(&gb_seq, 1, __ATOMIC_RELAXED) << 8;
    unsigned tail = *r->sq_tail;
    for (int i = 0; i < n; i++) {
        unsigned idx = (tail + (unsigned)i) & *r->sq_mask;
        struct io_uring_sqe *e = &r->sqes[idx];
        memset(e, 0, sizeof(*e));
        e->opcode = b->e[i].slot >= 0 ? IORING_OP_WRITE_FIXED : IORING_OP_WRITE;
        e->fd = b->fd;
        e->off = b->e[i].off;
        e->addr = (uint64_t)(uintptr_t)b->e[i].p;
        e->len = (uint32_t)b->e[i].len;
        if (b->e[i].slot >= 0) e->buf_index = (uint16_t)b->e[i].slot;
        e->user_data = seq | (uint64_t)i;
        r->sq_array[idx] = idx;
        res[i] = LONG_MIN;
    }
    __atomic_store_n(r->sq_tail, tail + (unsigned)n, __ATOMIC_RELEASE);
    int err = 0, taken = n, done = 0;
    while (done < taken) {
        unsigned head = __atomic_load_n(r->sq_head, __ATOMIC_ACQUIRE);
        unsigned left = *r->sq_tail - head;      /* queued, not yet taken by the kernel */
        long got = syscall(__NR_io_uring_enter, r->fd, left, 1, IORING_ENTER_GETEVENTS,
                           NULL, 0);
        if (got < 0 && errno != EINTR) {
            if (!err) err = errno;
            head = __atomic_load_n(r->sq_head, __ATOMIC_ACQUIRE);
            taken -= (int)(*r->sq_tail - head);      /* the rest never written: taken back */
            __atomic_store_n(r->sq_tail, head, __ATOMIC_RELEASE);
            if (done >= taken) break;
            if (err != EAGAIN && err != EBUSY && err != ENOMEM)
                break;                                  /* cannot wait: give up (rare) */
        }
        unsigned ch = *r->cq_head, ct = __atomic_load_n(r->cq_tail, __ATOMIC_ACQUIRE);
        for (; ch != ct; ch++) {
            struct io_uring_cqe *c = &r->cqes[ch & *r->cq_mask];
            uint64_t k = c->user_data ^ seq;
            if (k < (uint64_t)n) {                      /* this batch's (else a stale one) */
                res[k] = c->res;
                done++;
            }
        }
        __atomic_store_n(r->cq_head, ch, __ATOMIC_RELEASE);
    }
    if (err) return err;
    for (int i = 0; i < n; i++) {
        if (res[i] < 0) return (int)-res[i];
        b->fixed += b->e[i].slot >= 0;
        if ((size_t)res[i] < b->e[i].len) {           /* short (rare): the rest by pwrite */
            int e2 = gb_pwrite(b->fd, b->e[i].p + res[i], b->e[i].len - (size_t)res[i],
                               b->e[i].off + (uint64_t)res[i]);
            if (e2) return e2;
        }
    }
    return 0;
}
#endif

/* write the batch's entries (through the ring, else pwrite one by one); 0 or an errno */
static int gb_flush(gbatch_t *b) {
    int n = b->n;
    b->n = 0;
    b->bytes = 0;
#ifdef HAVE_URING
    if (b->r != NULL && n > 0) return gb_ring(b, n);
#endif
    for (int i = 0; i < n; i++) {
        int err = gb_pwrite(b->fd, b->e[i].p, b->e[i].len, b->e[i].off);
        if (err) return err;
    }
    return 0;
}

/* queue p[0:n) for `off` (from registered buffer `slot` when >= 0), in pieces of at most
   `chunk`; a batch goes out once it holds `chunk` bytes. 0 or an errno. */
static int gb_add(gbatch_t *b, const unsigned char *p, Py_ssize_t n, Py_ssize_t off, int slot) {
    while (n > 0) {
        Py_ssize_t len = n < b->chunk ? n : b->chunk;
        b->e[b->n].p = p;
        b->e[b->n].len = (size_t)len;
        b->e[b->n].off = (uint64_t)off;
        b->e[b->n].slot = slot;
        b->n++;
        b->bytes += len;
        p += len;
        off += len;
        n -= len;
        if (b->bytes >= b->chunk || b->n == GB_MAX) {
            int err = gb_flush(b);
            if (err) return err;
        }
    }
    return 0;
}

/* the staged bytes of gathered record r's block that fall before its middle: the block and
   record headers (the CRC carried) and the payload's head, written at dst (= object position
   r->pos in the staging buffer) */
static void g_head(unsigned char *dst, const grec_t *r, Py_ssize_t ms) {
    unsigned char *p = dst + BLOCK_HDR;
    const unsigned char *src = (const unsigned char *)r->rec.buf.buf;
    size_t n = (size_t)r->rec.buf.len, k = (size_t)r->split;
    put_record_header(p, &r->rec);
    uint32_t c = ~crc_any(~0u, p, RECORD_HDR);
    c = ~crc_any(~c, src, k);
    c = crc_combine(c, r->want, n - k);
    put_block_header(dst, 1, RECORD_HDR + (Py_ssize_t)n, c);
    Py_ssize_t q = r->pos + BLOCK_HDR + RECORD_HDR;
    memcpy(dst + BLOCK_HDR + RECORD_HDR, src, (size_t)(ms - q));
}

PyDoc_STRVAR(gather_write_doc,
"gather_write(ring, fd, records, block_size, min_gather, staging, chunk, alloc, tail)\n"
"    -> (written, fixed)\n\n"
"Write the object gather_layout(records, block_size, min_gather) describes to `fd` (from\n"
"offset 0; O_DIRECT when its flags say so): each gathered payload's whole pages straight\n"
"from its memory, everything else (headers, the payloads' partial pages, the staged\n"
"records' blocks encoded as encode_blocks does, zeroed gaps, then `tail`: the index and\n"
"footer, at the data's end) through `staging` (page-aligned, at least max_region bytes),\n"
"in pieces of at most `chunk` bytes, a batch of about `chunk` bytes (a staged region and the\n"
"next payload's pages) submitted and waited for together. `ring`: an io_uring from\n"
"uring_setup (the gathered pages of a registered slab go as WRITE_FIXED), or None for\n"
"pwrite. `alloc` > 0: fallocate the file's first `alloc` bytes first (io_uring's writes\n"
"into a file that must allocate blocks go to a worker thread: 3-6x the CPU). The last page\n"
"is written whole: the caller truncates the file to the object's size. Returns the bytes\n"
"written (the size rounded up to 4 KiB) and how many pieces went as WRITE_FIXED; OSError as\n"
"a write fails. The interpreter lock is released for the writes and copies.");

static PyObject *gather_write(PyObject *self, PyObject *args) {
    PyObject *ring_obj, *list, *staging_obj, *tail_obj;
    int fd;
    Py_ssize_t block_size, min_gather, chunk;
    long long alloc;
    if (!PyArg_ParseTuple(args, "OiO!nnOnLO:gather_write", &ring_obj, &fd, &PyList_Type, &list,
                          &block_size, &min_gather, &staging_obj, &chunk, &alloc, &tail_obj))
        return NULL;
    if (chunk < GATHER_ALIGN || chunk % GATHER_ALIGN) {
        PyErr_SetString(PyExc_ValueError, "gather_write: chunk must be whole 4 KiB pages");
        return NULL;
    }
#ifdef HAVE_URING
    uring_t *ring = NULL;
    if (ring_obj != Py_None && (ring = uring_get(ring_obj)) == NULL) return NULL;
#else
    void *ring = NULL;
    if (ring_obj != Py_None) {
        PyErr_SetString(PyExc_ValueError, "gather_write: no io_uring in this build");
        return NULL;
    }
#endif
    Py_buffer stg, tail;
    if (PyObject_GetBuffer(staging_obj, &stg, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    if (PyObject_GetBuffer(tail_obj, &tail, PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&stg);
        return NULL;
    }
    glayout_t g;
    PyObject *ret = NULL;
    Py_ssize_t *ends = NULL;
    if (glayout_build(&g, list, block_size, min_gather) < 0) goto done;
    if (g.data_end + tail.len != g.size) {
        PyErr_SetString(PyExc_ValueError, "gather_write: tail does not end the object");
        goto done;
    }
    if (g.max_region > stg.len || ((uintptr_t)stg.buf & (GATHER_ALIGN - 1))) {
        PyErr_SetString(PyExc_ValueError, "gather_write: staging buffer too small or unaligned");
        goto done;
    }
#ifdef HAVE_URING
    if (ring != NULL) {
        /* the registered slabs as of now (registered with the interpreter lock released,
           checked against fixed_tab under it): every gathered payload is exported, so its
           slab stays mapped and registered meanwhile */
        if (ring->gen != fixed_gen) uring_sync(ring);
        for (Py_ssize_t i = 0; i < g.nrec; i++) {
            grec_t *r = &g.recs[i];
            r->slot = -1;
            if (r->gather && ring->fixed_ok) {
                Py_ssize_t ms, me;
                g_middle(r, &ms, &me);
                uintptr_t a = (uintptr_t)r->rec.buf.buf + (uintptr_t)(ms - r->pos - BLOCK_HDR - RECORD_HDR);
                r->slot = uring_find(ring, a, (size_t)(me - ms));
            }
        }
    } else
#endif
        for (Py_ssize_t i = 0; i < g.nrec; i++) g.recs[i].slot = -1;
    int err = 0;
    unsigned char *s = (unsigned char *)stg.buf;
    Py_ssize_t total = g_up(g.size), rs = 0;       /* rs: the staged region's start */
    /* each block's region end: the next gathered block's middle start, else the end */
    ends = PyMem_Malloc((size_t)(g.nblk + 1) * sizeof(Py_ssize_t));
    if (ends == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    ends[g.nblk] = total;
    for (Py_ssize_t b = g.nblk - 1; b >= 0; b--) {
        ends[b] = ends[b + 1];
        if (g.blks[b].gathered) {
            Py_ssize_t me;
            g_middle(&g.recs[g.blks[b].first], &ends[b], &me);
        }
    }
    gbatch_t gb;
    memset(&gb, 0, sizeof(gb));
    gb.r = ring;
    gb.fd = fd;
    gb.chunk = chunk;
    PyThreadState *ts = PyEval_SaveThread();
    if (alloc > 0 && fallocate(fd, 0, 0, (off_t)alloc) < 0 && errno != EOPNOTSUPP)
        err = errno;
    if (!err) memset(s, 0, (size_t)(ends[0] - rs));
    for (Py_ssize_t b = 0; b < g.nblk && !err; b++) {
        gblk_t *k = &g.blks[b];
        if (!k->gathered) {
            write_block(s, k->pos - rs, &g.recs[k->first].rec, sizeof(grec_t), k->n, k->body);
            continue;
        }
        grec_t *r = &g.recs[k->first];
        Py_ssize_t ms, me, q = r->pos + BLOCK_HDR + RECORD_HDR;
        g_middle(r, &ms, &me);
        g_head(s + (r->pos - rs), r, ms);
        err = gb_add(&gb, s, ms - rs, rs, -1);                          /* the region */
        if (!err) {
            err = gb_add(&gb, (const unsigned char *)r->rec.buf.buf + (ms - q), me - ms, ms,
                         r->slot);                                      /* the middle */
            /* the staging buffer is filled again next: its writes must be out first */
            if (!err && gb.n) err = gb_flush(&gb);
        }
        if (err) break;
        rs = me;                                 /* the next region: the payload's tail */
        memset(s, 0, (size_t)(ends[b + 1] - rs));
        memcpy(s, (const unsigned char *)r->rec.buf.buf + (me - q),
               (size_t)(q + r->rec.buf.len - me));
    }
    if (!err) {
        memcpy(s + (g.data_end - rs), tail.buf, (size_t)tail.len);
        err = gb_add(&gb, s, total - rs, rs, -1);
        if (!err) err = gb_flush(&gb);
    }
    PyEval_RestoreThread(ts);
    if (err) {
        errno = err;
        PyErr_SetFromErrno(PyExc_OSError);
    } else {
        ret = Py_BuildValue("(nn)", total, gb.fixed);
    }
done:
    PyMem_Free(ends);
    glayout_free(&g);
    PyBuffer_Release(&tail);
    PyBuffer_Release(&stg);
    return ret;
}
/* ---- end of the gather upload's section ---- */

static PyObject *set_fold(PyObject *self, PyObject *arg);
PyDoc_STRVAR(set_fold_doc,
"_set_fold(bits) -> int\n\n"
"For tests: the copies and crc() fold the CRC with `bits`-wide registers from now on (512,\n"
"256, or 0 for the crc32 instruction); returns the width before. ValueError where this CPU\n"
"has no such fold. The module's constants keep the width chosen at import.");

static PyMethodDef methods[] = {
    {"_set_fold", set_fold, METH_O, set_fold_doc},
    {"gc_untrack", gc_untrack, METH_O, gc_untrack_doc},
    {"buffer_address", buffer_address, METH_O, buffer_address_doc},
    {"place_record", place_record, METH_VARARGS, place_record_doc},
    {"take_offered", take_offered, METH_VARARGS, take_offered_doc},
    {"take_grouped", take_grouped, METH_VARARGS, take_grouped_doc},
    {"copy_crc", copy_crc, METH_VARARGS, copy_crc_doc},
    {"copy_crc_split", copy_crc_split, METH_VARARGS, copy_crc_split_doc},
    {"copy_record", copy_record, METH_VARARGS, copy_record_doc},
    {"crc", crc, METH_VARARGS, crc_doc},
    {"crc_split", crc_split, METH_VARARGS, crc_split_doc},
    {"write_pieces", write_pieces, METH_VARARGS, write_pieces_doc},
    {"read_pieces", read_pieces, METH_VARARGS, read_pieces_doc},
    {"read_span_crcs", read_span_crcs, METH_VARARGS, read_span_crcs_doc},
    {"map_buffer", map_buffer, METH_VARARGS, map_buffer_doc},
    {"frame_arena", frame_arena, METH_VARARGS, frame_arena_doc},
    {"fault_in", fault_in, METH_O, fault_in_doc},
    {"encode_blocks", encode_blocks, METH_VARARGS, encode_blocks_doc},
    {"encode_write", encode_write, METH_VARARGS, encode_write_doc},
    {"object_size_steps", object_size_steps, METH_VARARGS, object_size_steps_doc},
    {"gather_layout", gather_layout, METH_VARARGS, gather_layout_doc},
    {"gather_write", gather_write, METH_VARARGS, gather_write_doc},
#ifdef HAVE_AIO
    {"aio_submit", aio_submit, METH_VARARGS, aio_submit_doc},
    {"aio_reap", aio_reap, METH_VARARGS, aio_reap_doc},
    {"eventfd_reset", eventfd_reset, METH_O, eventfd_reset_doc},
    {"timerfd_arm", timerfd_arm, METH_VARARGS, timerfd_arm_doc},
#endif
#ifdef HAVE_URING
    {"uring_setup", uring_setup_, METH_VARARGS, uring_setup_doc},
    {"uring_submit", uring_submit_, METH_VARARGS, uring_submit_doc},
    {"uring_reap", uring_reap_, METH_O, uring_reap_doc},
    {"uring_writev_fixed", uring_writev_fixed_, METH_O, uring_writev_fixed_doc},
    {"uring_close", uring_close_, METH_O, uring_close_doc},
    {"uring_refresh", uring_refresh_, METH_O, uring_refresh_doc},
    {"uring_registered", uring_registered_, METH_O, uring_registered_doc},
#endif
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_copycrc",
    "Fused copy + CRC-32C for the produce path (see storage/copycrc.py).", -1, methods,
};

/* the hardware paths must agree with the software CRC (crc_soft), across every step size */
static int self_test(copy_fn fn, crc_fn crc_f) {
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
        uint32_t want = ~crc_soft(~0x1234u, p, lens[i]);
        uint32_t got = fn != NULL ? ~fn(o, p, lens[i], ~0x1234u) : ~crc_f(~0x1234u, p, lens[i]);
        if (want != got || (fn != NULL && memcmp(o, p, lens[i]) != 0)) return 0;
    }
    return 1;
}

static int fold_ok[2];      /* the 256- and 512-bit folds passed their self-tests (at import) */

/* The copies and crc_any set to fold with `bits`-wide registers (0: the crc32 instruction);
   0 if this CPU cannot, or that fold failed its self-test at import. */
static int use_fold(int bits) {
    if (bits == 512 && fold_ok[1]) {
        copy_crc_raw = copy_crc_fold_stream;
        copy_crc_loop_raw = copy_crc_fold_cached;
        crc_fold_fn = crc_fold;
    } else if (bits == 256 && fold_ok[0]) {
        copy_crc_raw = copy_crc_fold2_stream;
        copy_crc_loop_raw = copy_crc_fold2_cached;
        crc_fold_fn = crc_fold2;
    } else if (bits == 0 && copy_crc_raw != copy_crc_scalar) {
        copy_crc_raw = copy_crc_stream;
        copy_crc_loop_raw = copy_crc_cached;
    } else {
        return 0;
    }
    fold_on = bits;
    return 1;
}

static PyObject *set_fold(PyObject *self, PyObject *arg) {
    long bits = PyLong_AsLong(arg);
    if (bits == -1 && PyErr_Occurred()) return NULL;
    int was = fold_on;
    if (!use_fold((int)bits)) {
        PyErr_Format(PyExc_ValueError, "this CPU has no %ld-bit CRC fold", bits);
        return NULL;
    }
    return PyLong_FromLong(was);
}

PyMODINIT_FUNC PyInit__copycrc(void) {
    crc32c_init();
    uint32_t x = 1u << 30;                                 /* x^1 */
    x2n_table[0] = x;
    for (int k = 1; k < 32; k++) x2n_table[k] = x = multmodp(x, x);
    s_stream_id = PyUnicode_InternFromString("stream_id");
    s_base_offset = PyUnicode_InternFromString("base_offset");
    s_count = PyUnicode_InternFromString("count");
    s_payload = PyUnicode_InternFromString("payload");
    s_check = PyUnicode_InternFromString("check");
    if (!s_stream_id || !s_base_offset || !s_count || !s_payload || !s_check) return NULL;
    have_hw = cpu_has_sse42() && self_test(copy_crc_scalar, NULL);
    if (have_hw && cpu_has_avx2() && self_test(copy_crc_stream, NULL)
            && self_test(copy_crc_cached, NULL)) {
        copy_crc_raw = copy_crc_stream;
        copy_crc_loop_raw = copy_crc_cached;
        fold_ok[0] = cpu_has_fold2() && self_test(copy_crc_fold2_stream, NULL)
            && self_test(copy_crc_fold2_cached, NULL) && self_test(NULL, crc_fold2);
        fold_ok[1] = cpu_has_fold() && self_test(copy_crc_fold_stream, NULL)
            && self_test(copy_crc_fold_cached, NULL) && self_test(NULL, crc_fold);
        use_fold(fold_ok[1] ? 512 : fold_ok[0] ? 256 : 0);
    }
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddIntConstant(m, "HARDWARE", have_hw) < 0 ||
            PyModule_AddIntConstant(m, "STREAM_STORES", copy_crc_raw == copy_crc_stream ||
                                    copy_crc_raw == copy_crc_fold_stream ||
                                    copy_crc_raw == copy_crc_fold2_stream) < 0 ||
            PyModule_AddIntConstant(m, "LOOP_STREAM_STORES",
                                    copy_crc_loop_raw == copy_crc_stream ||
                                    copy_crc_loop_raw == copy_crc_fold_stream ||
                                    copy_crc_loop_raw == copy_crc_fold2_stream) < 0 ||
            PyModule_AddIntConstant(m, "FOLD", fold_on != 0) < 0 ||
            PyModule_AddIntConstant(m, "FOLD_BITS", fold_on) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}


/* -- the upload's take: pending entries taken, grouped by stream and summed in one pass --- */

static PyObject *s_durable, *s_size, *s_popleft;

/* where a __slots__ class (LogCache's CacheEntry) keeps the four attributes the take reads:
   read straight from the instance (a generic getattr per attribute was most of the pass) */
enum { SL_DURABLE, SL_SIZE, SL_STREAM_ID, SL_PAYLOAD, SL_N };
typedef struct {
    PyTypeObject *type;                  /* NULL: no direct reads (generic getattr) */
    Py_ssize_t off[SL_N];
} slots_t;

static void find_slots(PyTypeObject *t, slots_t *sl) {
    PyObject *names[SL_N] = {s_durable, s_size, s_stream_id, s_payload};
    sl->type = NULL;
    for (int i = 0; i < SL_N; i++) {
        PyObject *d = _PyType_Lookup(t, names[i]);           /* borrowed, via the MRO */
        if (d == NULL || !Py_IS_TYPE(d, &PyMemberDescr_Type)) return;
        PyMemberDef *m = ((PyMemberDescrObject *)d)->d_member;
        if (m->type != T_OBJECT_EX || (m->flags & READONLY)) return;
        sl->off[i] = m->offset;
    }
    sl->type = t;
}

/* a new reference to attribute i of `e` (the generic getattr for other types, unset slots) */
static PyObject *slot_get(PyObject *e, const slots_t *sl, int i, PyObject *name) {
    if (Py_TYPE(e) == sl->type) {
        PyObject *v = *(PyObject **)((char *)e + sl->off[i]);
        if (v != NULL) {
            Py_INCREF(v);
            return v;
        }
    }
    return PyObject_GetAttr(e, name);
}

/* LogCache.take_grouped (storage/cache/log_cache.py, the reference): pops a durable prefix of
   the deque `pending` (at most `max_entries` entries, -1: any; at most `max_bytes` of their
   `size`, but the first one even if larger when `at_least_one`), appends each entry to the
   list `out` and to the list groups[stream_id], and its stream's running payload sum
   (len(payload)) to the list cums[stream_id] (both created when missing); returns the
   sizes' sum. On an error the entries popped so far are in `out`. */
static PyObject *take_grouped(PyObject *self, PyObject *args) {
    PyObject *pending, *out, *groups, *cums;
    long long max_bytes, max_entries;
    int at_least_one;
    if (!PyArg_ParseTuple(args, "OLLpO!O!O!:take_grouped", &pending, &max_bytes, &max_entries,
                          &at_least_one, &PyList_Type, &out, &PyDict_Type, &groups,
                          &PyDict_Type, &cums))
        return NULL;
    if (s_durable == NULL) {
        s_durable = PyUnicode_InternFromString("durable");
        s_size = PyUnicode_InternFromString("size");
        s_popleft = PyUnicode_InternFromString("popleft");
        if (!s_durable || !s_size || !s_popleft) return NULL;
    }
    long long taken = 0, n = 0;
    /* one stream's list and sums, looked up again only when the stream changes */
    PyObject *last_sid = NULL, *last_list = NULL, *last_cum = NULL;
    PyObject *popleft = PyObject_GetAttr(pending, s_popleft);
    if (popleft == NULL) return NULL;
    slots_t sl = {NULL, {0}};
    PyTypeObject *looked_up = NULL;
    while (max_entries < 0 || n < max_entries) {
        Py_ssize_t left = PyObject_Length(pending);
        if (left < 0) goto fail;
        if (left == 0) break;
        PyObject *e = PySequence_GetItem(pending, 0);
        if (e == NULL) goto fail;
        if (Py_TYPE(e) != looked_up) {
            looked_up = Py_TYPE(e);
            find_slots(looked_up, &sl);
        }
        PyObject *v = slot_get(e, &sl, SL_DURABLE, s_durable);
        int durable = v == NULL ? -1 : PyObject_IsTrue(v);
        Py_XDECREF(v);
        int64_t size = 0;
        if (durable > 0) {
            v = slot_get(e, &sl, SL_SIZE, s_size);
            long long x = v == NULL ? -1 : PyLong_AsLongLong(v);
            Py_XDECREF(v);
            if (x == -1 && (v == NULL || PyErr_Occurred()))
                durable = -1;
            size = x;
        }
        if (durable < 0) {
            Py_DECREF(e);
            goto fail;
        }
        if (!durable || (taken + size > max_bytes && !(n == 0 && at_least_one))) {
            Py_DECREF(e);
            break;
        }
        PyObject *sid = slot_get(e, &sl, SL_STREAM_ID, s_stream_id);
        PyObject *payload = sid == NULL ? NULL : slot_get(e, &sl, SL_PAYLOAD, s_payload);
        Py_ssize_t plen = payload == NULL ? -1 : PyObject_Length(payload);
        Py_XDECREF(payload);
        if (plen < 0) {
            Py_XDECREF(sid);
            Py_DECREF(e);
            goto fail;
        }
        PyObject *popped = PyObject_CallNoArgs(popleft);
        if (popped != e) {                       /* `e` itself: it was pending[0] */
            if (popped != NULL) {            /* kept in `out`: the caller returns it */
                PyErr_SetString(PyExc_RuntimeError, "take_grouped: pending changed");
                if (PyList_Append(out, popped) < 0)
                    PyErr_SetString(PyExc_RuntimeError, "take_grouped: pending changed");
                Py_DECREF(popped);
            }
            Py_DECREF(sid);
            Py_DECREF(e);
            goto fail;
        }
        Py_DECREF(popped);
        int bad = PyList_Append(out, e);
        if (!bad && (last_sid == NULL || PyObject_RichCompareBool(sid, last_sid, Py_EQ) != 1)) {
            last_list = PyDict_GetItemWithError(groups, sid);
            if (last_list == NULL && !PyErr_Occurred()) {
                last_list = PyList_New(0);
                bad = last_list == NULL || PyDict_SetItem(groups, sid, last_list) < 0;
                Py_XDECREF(last_list);           /* the dict holds it */
            } else if (last_list == NULL || !PyList_Check(last_list)) {
                if (last_list != NULL)
                    PyErr_SetString(PyExc_TypeError, "take_grouped: groups holds a non-list");
                bad = 1;
            }
            if (!bad) {
                last_cum = PyDict_GetItemWithError(cums, sid);
                if (last_cum == NULL && !PyErr_Occurred()) {
                    last_cum = PyList_New(0);
                    bad = last_cum == NULL || PyDict_SetItem(cums, sid, last_cum) < 0;
                    Py_XDECREF(last_cum);
                } else if (last_cum == NULL || !PyList_Check(last_cum)) {
                    if (last_cum != NULL)
                        PyErr_SetString(PyExc_TypeError, "take_grouped: cums holds a non-list");
                    bad = 1;
                }
            }
            Py_XDECREF(last_sid);
            last_sid = sid;
            sid = NULL;
        }
        Py_XDECREF(sid);
        if (!bad)
            bad = PyList_Append(last_list, e) < 0;
        Py_DECREF(e);
        if (!bad) {
            Py_ssize_t at = PyList_GET_SIZE(last_cum);
            long long sum = at ? PyLong_AsLongLong(PyList_GET_ITEM(last_cum, at - 1)) : 0;
            PyObject *cum = sum == -1 && PyErr_Occurred() ? NULL : PyLong_FromLongLong(sum + plen);
            bad = cum == NULL || PyList_Append(last_cum, cum) < 0;
            Py_XDECREF(cum);
        }
        taken += size;
        n++;
        if (bad) goto fail;
    }
    Py_XDECREF(last_sid);
    Py_DECREF(popleft);
    return PyLong_FromLongLong(taken);
fail:
    Py_XDECREF(last_sid);
    Py_DECREF(popleft);
    return NULL;
}

/* read_span_crcs (doc above): the cold read threads' span read and block CRCs in one call */
#define SPAN_RANGES_MAX 4096

/* range (a, n) of a span of which `got` bytes were read: whole and at least `skip` long */
static inline int span_range_read(long long a, long long n, Py_ssize_t skip, size_t got) {
    return a >= 0 && n >= skip && (unsigned long long)(a + n) <= got;
}
static PyObject *read_span_crcs(PyObject *self, PyObject *args) {
    int fd;
    PyObject *obj, *ranges;
    long long offset;
    Py_ssize_t skip;
    if (!PyArg_ParseTuple(args, "iOLOn:read_span_crcs", &fd, &obj, &offset, &ranges, &skip))
        return NULL;
    if (offset < 0 || skip < 0) {
        PyErr_SetString(PyExc_ValueError, "read_span_crcs: offset and skip must be >= 0");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(ranges, "read_span_crcs: ranges must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t nr = PySequence_Fast_GET_SIZE(seq);
    if (nr > SPAN_RANGES_MAX) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "read_span_crcs: too many ranges");
        return NULL;
    }
    Py_buffer buf;
    if (PyObject_GetBuffer(obj, &buf, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        Py_DECREF(seq);
        return NULL;
    }
    long long *st = PyMem_Malloc(sizeof(long long) * 2 * (size_t)(nr ? nr : 1));
    uint32_t *crcs = PyMem_Malloc(sizeof(uint32_t) * (size_t)(nr ? nr : 1));
    if (st == NULL || crcs == NULL) {
        PyMem_Free(st);
        PyMem_Free(crcs);
        PyBuffer_Release(&buf);
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < nr; i++) {
        long long a, b;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "LL:read_span_crcs range",
                              &a, &b)) {
            PyMem_Free(st);
            PyMem_Free(crcs);
            PyBuffer_Release(&buf);
            Py_DECREF(seq);
            return NULL;
        }
        st[2 * i] = a;
        st[2 * i + 1] = b;
    }
    Py_DECREF(seq);
    unsigned char *p = (unsigned char *)buf.buf;
    size_t len = (size_t)buf.len, got = 0;
    int err = 0;
    Py_BEGIN_ALLOW_THREADS
    while (got < len) {
        ssize_t r = pread(fd, p + got, len - got, (off_t)(offset + (long long)got));
        if (r < 0) {
            if (errno == EINTR) continue;
            err = errno;
            break;
        }
        if (r == 0) break;
        got += (size_t)r;
        if (r % 4096) break;              /* the end of the file (O_DIRECT reads whole pages) */
    }
    if (!err) {
        for (Py_ssize_t i = 0; i < nr; i++) {
            long long a = st[2 * i], n = st[2 * i + 1];
            if (!span_range_read(a, n, skip, got)) continue;
            crcs[i] = ~crc_any(~0u, p + a + skip, (size_t)(n - skip));
        }
    }
    Py_END_ALLOW_THREADS
    PyObject *out = NULL;
    if (err) {
        errno = err;
        PyErr_SetFromErrno(PyExc_OSError);
    } else if ((out = PyList_New(nr)) != NULL) {
        for (Py_ssize_t i = 0; i < nr; i++) {
            long long a = st[2 * i], n = st[2 * i + 1];
            PyObject *v;
            if (!span_range_read(a, n, skip, got)) {
                v = Py_None;
                Py_INCREF(v);
            } else if ((v = PyLong_FromUnsignedLong(crcs[i])) == NULL) {
                Py_CLEAR(out);
                break;
            }
            PyList_SET_ITEM(out, i, v);
        }
    }
    PyMem_Free(st);
    PyMem_Free(crcs);
    PyBuffer_Release(&buf);
    if (out == NULL)
        return NULL;
    PyObject *res = Py_BuildValue("(nN)", (Py_ssize_t)got, out);
    return res;
}

/* map_buffer (doc above): the cold read buffer pool's fresh buffers */
#include <sys/mman.h>

typedef struct {
    PyObject_HEAD
    unsigned char *data;
    size_t maplen;          /* the mapping's length (size rounded up to whole pages) */
    Py_ssize_t len;
} MappedBuffer;

static int mapped_getbuffer(PyObject *o, Py_buffer *view, int flags) {
    MappedBuffer *m = (MappedBuffer *)o;
    return PyBuffer_FillInfo(view, o, m->data, m->len, 0, flags);
}

static Py_ssize_t mapped_length(PyObject *o) {
    return ((MappedBuffer *)o)->len;
}

static void mapped_dealloc(PyObject *o) {
    MappedBuffer *m = (MappedBuffer *)o;
    if (m->data != NULL) {
        unsigned char *p = m->data;
        size_t n = m->maplen;
        m->data = NULL;
        Py_BEGIN_ALLOW_THREADS          /* munmap takes the mmap lock too */
        munmap(p, n);
        Py_END_ALLOW_THREADS
    }
    Py_TYPE(o)->tp_free(o);
}

static PyBufferProcs mapped_as_buffer = {mapped_getbuffer, NULL};
static PySequenceMethods mapped_as_sequence = {.sq_length = mapped_length};

static PyTypeObject MappedBuffer_Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "storage._copycrc.MappedBuffer",
    .tp_basicsize = sizeof(MappedBuffer),
    .tp_dealloc = mapped_dealloc,
    .tp_as_sequence = &mapped_as_sequence,
    .tp_as_buffer = &mapped_as_buffer,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "An anonymous mapping made by map_buffer (a writable buffer; unmapped when freed).",
};
static int mapped_ready = 0;

/* Huge-page buffers start on a 2 MiB boundary: an O_DIRECT read is one device request per
   physically contiguous run of its buffer, at most max_segments (254 on the test VM's virtio
   disk) runs per request, and mmap placed a buffer whose length is not a multiple of 2 MiB
   (a cold span: 8 MiB and a granule) anywhere, with 4 KiB pages before its first 2 MiB
   boundary. Only the start is aligned: the length stays the page-rounded size asked for
   (rounding it up to whole huge pages cost ~30 % more fresh memory per cold pass, each huge
   page first-touched at ~2 s of CPU per GiB on the test VM; bench/HISTORY.md, session 29). */
#define HUGE_ALIGN ((size_t)2 << 20)

static void *map_huge_aligned(size_t maplen) {
    size_t over = maplen + HUGE_ALIGN;
    unsigned char *raw = mmap(NULL, over, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                              -1, 0);
    if (raw == MAP_FAILED)
        return MAP_FAILED;
    size_t head = (HUGE_ALIGN - (uintptr_t)raw % HUGE_ALIGN) % HUGE_ALIGN;
    if (head)
        munmap(raw, head);
    if (over - head - maplen)
        munmap(raw + head + maplen, over - head - maplen);
    return raw + head;
}

static PyObject *map_buffer(PyObject *self, PyObject *args) {
    Py_ssize_t size;
    int huge;
    if (!PyArg_ParseTuple(args, "np:map_buffer", &size, &huge))
        return NULL;
    if (size <= 0) {
        PyErr_SetString(PyExc_ValueError, "map_buffer: size must be > 0");
        return NULL;
    }
    if (!mapped_ready) {
        if (PyType_Ready(&MappedBuffer_Type) < 0)
            return NULL;
        mapped_ready = 1;
    }
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    size_t maplen = ((size_t)size + page - 1) / page * page;
    void *p;
    int err = 0;
    Py_BEGIN_ALLOW_THREADS
#ifdef MADV_HUGEPAGE
    if (huge && maplen >= HUGE_ALIGN)
        p = map_huge_aligned(maplen);
    else
#endif
        p = mmap(NULL, maplen, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
        err = errno;
#ifdef MADV_HUGEPAGE
    else if (huge)
        (void)madvise(p, maplen, MADV_HUGEPAGE);    /* no huge pages here: 4 KiB ones */
#endif
    Py_END_ALLOW_THREADS
    if (err) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    MappedBuffer *m = PyObject_New(MappedBuffer, &MappedBuffer_Type);
    if (m == NULL) {
        munmap(p, maplen);
        return NULL;
    }
    m->data = (unsigned char *)p;
    m->maplen = maplen;
    m->len = size;
    return (PyObject *)m;
}


/* -- frame_arena: large request frames in huge-page slabs (broker/frames.py) -------------- */

/* A large Produce frame is written by the WAL with O_DIRECT straight from its memory (placed
   records, storage/wal/placed.py): from 4 KiB pages the kernel pins each page of the source
   (gup_fast_fallback, ~5 % of the broker's CPU under raw 1 MiB produce) and hands the device
   256 segments per MiB; from 2 MiB pages the same writes took 0.037-0.044 ms of CPU per MiB
   instead of 0.083-0.096 and ran at 3.5-3.9 GB/s instead of 2.0-2.3 (bench/HISTORY.md,
   session 27). A frame is a run of pages carved from 2 MiB-aligned MADV_HUGEPAGE slabs; the
   slabs are never unmapped while the arena lives, so their pages are faulted in once. A frame
   exports its bytes as a buffer (a memoryview of it keeps it alive, as of a bytearray) and
   gives its run back to the arena when its last reference goes: it can never be written
   again while anything still sees it. Free runs are kept sorted by address and merged with
   their neighbours; a take is first fit (lowest address). The interpreter lock guards it all
   (take and dealloc hold it; grow maps with it released and links the slab after). */

#define ARENA_HUGE ((size_t)2 << 20)
#define ARENA_PAGE ((size_t)4096)

typedef struct { uintptr_t start; size_t len; } extent_t;

typedef struct {
    PyObject_HEAD
    extent_t *free;             /* free runs, sorted by start, none adjacent */
    Py_ssize_t nfree, capfree;
    unsigned char **slabs;      /* every slab, unmapped with the arena */
    Py_ssize_t nslabs, capslabs;
    size_t slab, max_bytes, mapped, free_bytes;
    int huge;                   /* MADV_HUGEPAGE, else 4 KiB pages (MADV_NOHUGEPAGE) */
    Py_ssize_t faulted;         /* bytes of slabs grow faulted in (tests) */
} FrameArena;

typedef struct {
    PyObject_HEAD
    FrameArena *arena;
    unsigned char *data;
    size_t run;                 /* the run's length (len rounded up to pages) */
    Py_ssize_t len;
    Py_ssize_t exports;         /* buffers exported and not yet released */
} ArenaFrame;

static int arena_give(FrameArena *a, uintptr_t start, size_t len) {
    Py_ssize_t lo = 0, hi = a->nfree;
    while (lo < hi) {                                   /* the first run after `start` */
        Py_ssize_t mid = (lo + hi) / 2;
        if (a->free[mid].start < start) lo = mid + 1; else hi = mid;
    }
    a->free_bytes += len;
    int left = lo > 0 && a->free[lo - 1].start + a->free[lo - 1].len == start;
    int right = lo < a->nfree && start + len == a->free[lo].start;
    if (left && right) {
        a->free[lo - 1].len += len + a->free[lo].len;
        memmove(&a->free[lo], &a->free[lo + 1], (a->nfree - lo - 1) * sizeof(extent_t));
        a->nfree--;
    } else if (left) {
        a->free[lo - 1].len += len;
    } else if (right) {
        a->free[lo].start = start;
        a->free[lo].len += len;
    } else {
        if (a->nfree == a->capfree) {
            Py_ssize_t cap = a->capfree ? 2 * a->capfree : 64;
            extent_t *n = PyMem_Realloc(a->free, cap * sizeof(extent_t));
            if (n == NULL) {                            /* lost to the arena, not unsafe */
                a->free_bytes -= len;
                return -1;
            }
            a->free = n;
            a->capfree = cap;
        }
        memmove(&a->free[lo + 1], &a->free[lo], (a->nfree - lo) * sizeof(extent_t));
        a->free[lo].start = start;
        a->free[lo].len = len;
        a->nfree++;
    }
    return 0;
}

static int frame_getbuffer(PyObject *o, Py_buffer *view, int flags) {
    ArenaFrame *f = (ArenaFrame *)o;
    if (PyBuffer_FillInfo(view, o, f->data, f->len, 0, flags) < 0)
        return -1;
    f->exports++;
    return 0;
}

static void frame_releasebuffer(PyObject *o, Py_buffer *view) {
    (void)view;
    ((ArenaFrame *)o)->exports--;
}

static Py_ssize_t frame_length(PyObject *o) {
    return ((ArenaFrame *)o)->len;
}

static void frame_dealloc(PyObject *o) {
    ArenaFrame *f = (ArenaFrame *)o;
    if (f->arena != NULL) {
        (void)arena_give(f->arena, (uintptr_t)f->data, f->run);
        Py_CLEAR(f->arena);
    }
    Py_TYPE(o)->tp_free(o);
}

static PyObject *frame_exports(PyObject *o, void *closure) {
    (void)closure;
    return PyLong_FromSsize_t(((ArenaFrame *)o)->exports);
}

static PyGetSetDef frame_getset[] = {
    {"exports", frame_exports, NULL, "buffers of it alive (memoryviews, ctypes views)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyBufferProcs frame_as_buffer = {frame_getbuffer, frame_releasebuffer};
static PySequenceMethods frame_as_sequence = {.sq_length = frame_length};

static PyTypeObject ArenaFrame_Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "storage._copycrc.ArenaFrame",
    .tp_basicsize = sizeof(ArenaFrame),
    .tp_dealloc = frame_dealloc,
    .tp_as_sequence = &frame_as_sequence,
    .tp_as_buffer = &frame_as_buffer,
    .tp_getset = frame_getset,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A frame of a FrameArena (a writable buffer; its pages go back to the arena "
              "when the last reference goes).",
};

static PyObject *arena_take(PyObject *o, PyObject *arg) {
    FrameArena *a = (FrameArena *)o;
    Py_ssize_t size = PyLong_AsSsize_t(arg);
    if (size == -1 && PyErr_Occurred())
        return NULL;
    if (size <= 0) {
        PyErr_SetString(PyExc_ValueError, "FrameArena.take: size must be > 0");
        return NULL;
    }
    size_t run = ((size_t)size + ARENA_PAGE - 1) & ~(ARENA_PAGE - 1);
    Py_ssize_t i = 0;
    while (i < a->nfree && a->free[i].len < run)
        i++;
    if (i == a->nfree)
        Py_RETURN_NONE;
    ArenaFrame *f = PyObject_New(ArenaFrame, &ArenaFrame_Type);
    if (f == NULL)
        return NULL;
    f->data = (unsigned char *)a->free[i].start;
    f->run = run;
    f->len = size;
    f->exports = 0;
    Py_INCREF(a);
    f->arena = a;
    a->free_bytes -= run;
    if (a->free[i].len == run) {
        memmove(&a->free[i], &a->free[i + 1], (a->nfree - i - 1) * sizeof(extent_t));
        a->nfree--;
    } else {
        a->free[i].start += run;
        a->free[i].len -= run;
    }
    return (PyObject *)f;
}

/* Fault in the `len` bytes at `p` by writing a byte into each page, not with one
   madvise(MADV_POPULATE_WRITE): that call holds the process's mmap_lock (read) from the first
   page to the last, and any other thread's mmap, munmap, mprotect or brk meanwhile waits for
   the write lock behind it - the event loop's allocator does ~100 a second. A 64 MiB slab held
   it 22-60 ms (200 ms as the cache's last slab went in), and in make bench's latency row the
   loop stood still for as long (a 29 ms wait on the lock, the row's p99 29 ms: bench/HISTORY.md
   session 35 stall). A page fault takes only the slab's own VMA lock (Linux >= 6.4; before,
   mmap_lock per fault, released between faults), and costs the same here: 64 MiB in 19.5-20.4
   ms of CPU against 18.9-22.6 for the madvise call; an mmap + munmap in another thread
   meanwhile waited at most 0.02 ms instead of 18.7-20.1 (2 MiB madvise calls: 0.2-5.1 ms, a
   waiting writer loses the lock to the next call until the rwsem hands it over). */
static void arena_fault_in(unsigned char *p, size_t len) {
    volatile unsigned char *v = p;
    for (size_t off = 0; off < len; off += ARENA_PAGE)
        v[off] = 0;                     /* contents undefined: a fresh page is zeros anyway */
}

static PyObject *fault_in(PyObject *self, PyObject *arg) {
    (void)self;
    Py_buffer b;
    if (PyObject_GetBuffer(arg, &b, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    if (b.len > 0) {
        uintptr_t start = (uintptr_t)b.buf, end = start + (size_t)b.len;
        uintptr_t first = (start + ARENA_PAGE - 1) & ~(uintptr_t)(ARENA_PAGE - 1);
        Py_BEGIN_ALLOW_THREADS
        ((volatile unsigned char *)b.buf)[0] = 0;          /* the first, partial page */
        if (first < end)
            arena_fault_in((unsigned char *)first, end - first);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&b);
    Py_RETURN_NONE;
}

/* one slab of `len` bytes at a 2 MiB boundary, advised (and its pages faulted in when
   `populate`); NULL when the mapping fails. Runs without the interpreter lock. */
static unsigned char *arena_map(size_t len, int populate, int huge) {
    unsigned char *p = mmap(NULL, len + ARENA_HUGE, PROT_READ | PROT_WRITE,
                            MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
        return NULL;
    size_t head = (ARENA_HUGE - ((uintptr_t)p & (ARENA_HUGE - 1))) & (ARENA_HUGE - 1);
    if (head)
        munmap(p, head);
    if (ARENA_HUGE - head)
        munmap(p + head + len, ARENA_HUGE - head);
    p += head;
#ifdef MADV_HUGEPAGE
    (void)madvise(p, len, huge ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
#endif
#ifdef MADV_DONTFORK
    (void)madvise(p, len, MADV_DONTFORK);      /* no copy-on-write under a write in flight */
#endif
    if (populate)
        arena_fault_in(p, len);
    return p;
}

static PyObject *arena_grow(PyObject *o, PyObject *arg) {
    FrameArena *a = (FrameArena *)o;
    int populate = PyObject_IsTrue(arg);
    if (populate < 0)
        return NULL;
    if (a->mapped + a->slab > a->max_bytes)
        Py_RETURN_FALSE;
    if (a->nslabs == a->capslabs) {
        Py_ssize_t cap = a->capslabs ? 2 * a->capslabs : 16;
        unsigned char **n = PyMem_Realloc(a->slabs, cap * sizeof(unsigned char *));
        if (n == NULL)
            return PyErr_NoMemory();
        a->slabs = n;
        a->capslabs = cap;
    }
    size_t len = a->slab;
    a->mapped += len;                   /* reserved: another grow meanwhile sees it */
    unsigned char *p;
    Py_BEGIN_ALLOW_THREADS
    p = arena_map(len, populate, a->huge);
    Py_END_ALLOW_THREADS
    if (p == NULL) {
        a->mapped -= len;
        Py_RETURN_FALSE;
    }
    if (populate)
        a->faulted += (Py_ssize_t)len;
    if (a->nslabs == a->capslabs) {     /* grown meanwhile by another thread: room again */
        Py_ssize_t cap = 2 * a->capslabs;
        unsigned char **n = PyMem_Realloc(a->slabs, cap * sizeof(unsigned char *));
        if (n == NULL) {
            munmap(p, len);
            a->mapped -= len;
            return PyErr_NoMemory();
        }
        a->slabs = n;
        a->capslabs = cap;
    }
    a->slabs[a->nslabs++] = p;
#ifdef HAVE_URING
    if (populate)            /* faulted in: the WAL's rings may register it (io_uring section) */
        fixed_add(p, len);
#endif
    if (arena_give(a, (uintptr_t)p, len) < 0)
        return PyErr_NoMemory();
    Py_RETURN_TRUE;
}

static void arena_dealloc(PyObject *o) {
    FrameArena *a = (FrameArena *)o;     /* no frame is alive: each holds a reference */
    for (Py_ssize_t i = 0; i < a->nslabs; i++) {
#ifdef HAVE_URING
        fixed_remove(a->slabs[i]);       /* before the munmap: no ring writes its old pages */
#endif
        munmap(a->slabs[i], a->slab);
    }
    PyMem_Free(a->slabs);
    PyMem_Free(a->free);
    Py_TYPE(o)->tp_free(o);
}

static PyMemberDef arena_members[] = {
    {"slab", T_PYSSIZET, offsetof(FrameArena, slab), READONLY, "bytes per slab"},
    {"max_bytes", T_PYSSIZET, offsetof(FrameArena, max_bytes), 0, "slabs mapped at most"},
    {"mapped", T_PYSSIZET, offsetof(FrameArena, mapped), READONLY, "bytes of slabs mapped"},
    {"free", T_PYSSIZET, offsetof(FrameArena, free_bytes), READONLY, "bytes in free runs"},
    {"faulted", T_PYSSIZET, offsetof(FrameArena, faulted), READONLY,
     "bytes of slabs grow(True) faulted in, a page at a time (no mmap_lock held across them)"},
    {"runs", T_PYSSIZET, offsetof(FrameArena, nfree), READONLY, "free runs"},
    {NULL, 0, 0, 0, NULL},
};

static PyMethodDef arena_methods[] = {
    {"take", arena_take, METH_O,
     "take(size) -> ArenaFrame | None: a frame of `size` bytes (contents undefined) from the\n"
     "lowest free run that fits, or None (no free run fits: grow, or use another buffer)."},
    {"grow", arena_grow, METH_O,
     "grow(populate) -> bool: map one more slab (its pages faulted in when `populate`), with\n"
     "the interpreter lock released; False at max_bytes or when the mapping fails."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject FrameArena_Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "storage._copycrc.FrameArena",
    .tp_basicsize = sizeof(FrameArena),
    .tp_dealloc = arena_dealloc,
    .tp_members = arena_members,
    .tp_methods = arena_methods,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Huge-page slabs that large request frames are carved from (see frame_arena).",
};

static PyObject *frame_arena(PyObject *self, PyObject *args) {
    Py_ssize_t slab, max_bytes;
    int huge = 1;
    if (!PyArg_ParseTuple(args, "nn|p:frame_arena", &slab, &max_bytes, &huge))
        return NULL;
    if (slab <= 0 || slab % (Py_ssize_t)ARENA_HUGE || max_bytes < 0) {
        PyErr_SetString(PyExc_ValueError, "frame_arena: slab must be a multiple of 2 MiB");
        return NULL;
    }
    static int ready = 0;
    if (!ready) {
        if (PyType_Ready(&ArenaFrame_Type) < 0 || PyType_Ready(&FrameArena_Type) < 0)
            return NULL;
        ready = 1;
    }
    FrameArena *a = PyObject_New(FrameArena, &FrameArena_Type);
    if (a == NULL)
        return NULL;
    a->free = NULL;
    a->nfree = a->capfree = 0;
    a->slabs = NULL;
    a->nslabs = a->capslabs = 0;
    a->slab = (size_t)slab;
    a->max_bytes = (size_t)max_bytes;
    a->mapped = a->free_bytes = 0;
    a->huge = huge;
    a->faulted = 0;
    return (PyObject *)a;
}
