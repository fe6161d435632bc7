/* CRC-32C (Castagnoli) for the C extensions storage._copycrc (the WAL and object copies) and
   protocol._produce (the batch check of small Produce requests): one implementation, included
   by both (setup.py: include_dirs ["."], depends ["crc32c.h"]); header-only and static, so
   each extension has its own tables. Call crc32c_init() once (module init) before any CRC.

   crc_hw: the SSE4.2 crc32 instruction, three independent lanes combined with precomputed
   "shift by n zero bytes" tables (the usual way to hide the instruction's latency) for runs
   of 768 bytes or more; callers check cpu_has_sse42() first. crc_soft: slicing-by-8 tables,
   for CPUs without it. Both take and return the raw register (the standard CRC-32C of data
   continuing `value` is ~crc_hw(~value, ...), the same as crc32c.crc32c(data, value)). */
#ifndef S3KAFKA_CRC32C_H
#define S3KAFKA_CRC32C_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define POLY 0x82f63b78u          /* CRC-32C, reflected */
#define LONG_LANE 4096            /* bytes per lane in a long step (3 lanes: 12 KiB) */
#define SHORT_LANE 256            /* bytes per lane in a short step (3 lanes: 768 B) */

static uint32_t long_shift[4][256];
static uint32_t short_shift[4][256];
static uint32_t crc_table[8][256];      /* slicing-by-8; crc_table[0] is the byte table */
static uint32_t crc_soft(uint32_t c, const unsigned char *p, size_t n);

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

/* the register of three consecutive lanes checksummed side by side: c0 continues the CRC so
   far, c1 and c2 started at 0; `table` appends one lane's length of zero bytes */
static inline uint64_t join_lanes(uint32_t table[4][256], uint64_t c0, uint64_t c1,
                                  uint64_t c2) {
    c0 = shift(table, (uint32_t)c0) ^ (uint32_t)c1;
    return shift(table, (uint32_t)c0) ^ (uint32_t)c2;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <nmmintrin.h>
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
        c0 = join_lanes(table, c0, c1, c2);
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
    return crc_soft(crc, p, n);
}
static int cpu_has_sse42(void) { return 0; }
#endif

/* slicing-by-8 CRC of the n bytes at p (raw register in, raw register out) */
static uint32_t crc_soft(uint32_t c, const unsigned char *p, size_t n) {
    while (n && ((uintptr_t)p & 7)) { c = crc_table[0][(c ^ *p++) & 0xff] ^ (c >> 8); n--; }
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        w ^= c;
        c = crc_table[7][w & 0xff] ^ crc_table[6][(w >> 8) & 0xff]
            ^ crc_table[5][(w >> 16) & 0xff] ^ crc_table[4][(w >> 24) & 0xff]
            ^ crc_table[3][(w >> 32) & 0xff] ^ crc_table[2][(w >> 40) & 0xff]
            ^ crc_table[1][(w >> 48) & 0xff] ^ crc_table[0][w >> 56];
        p += 8;
        n -= 8;
    }
    while (n--) c = crc_table[0][(c ^ *p++) & 0xff] ^ (c >> 8);
    return c;
}

/* the tables of crc_soft and of crc_hw's lane combination */
static void crc32c_init(void) {
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++) c = c & 1 ? (c >> 1) ^ POLY : c >> 1;
        crc_table[0][n] = c;
    }
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = crc_table[0][n];
        for (int k = 1; k < 8; k++) {
            c = crc_table[0][c & 0xff] ^ (c >> 8);
            crc_table[k][n] = c;
        }
    }
    zeros_tables(long_shift, LONG_LANE);
    zeros_tables(short_shift, SHORT_LANE);
}

#endif
