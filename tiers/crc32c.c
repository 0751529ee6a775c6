/* crc32c.c -- see crc32c.h. */
#include "crc32c.h"

#include <string.h>
#if defined(__SSE4_2__)
#include <nmmintrin.h>
#endif

#define CRC32C_POLY 0x82F63B78u /* reflected Castagnoli polynomial */

uint32_t tkv_crc32c_ref(uint32_t crc, const void *data, size_t len)
{
    const uint8_t *p = data;
    crc = ~crc;
    for (size_t i = 0; i < len; i++) {
        crc ^= p[i];
        for (int k = 0; k < 8; k++)
            crc = (crc >> 1) ^ (CRC32C_POLY & (0u - (crc & 1)));
    }
    return ~crc;
}

/* a * b mod P, polynomials over GF(2) in CRC-32C's reflected order (bit 31
 * is the coefficient of x^0). */
uint32_t tkv_crc32c_mulmod(uint32_t a, uint32_t b)
{
    uint32_t p = 0;
    for (int i = 0; i < 32; i++, a <<= 1) {
        if (a & 0x80000000u)
            p ^= b;
        b = (b >> 1) ^ (CRC32C_POLY & (0u - (b & 1))); /* b *= x */
    }
    return p;
}

/* x^(8n) mod P: what n zero bytes multiply the CRC register by. */
uint32_t tkv_crc32c_x8n(uint64_t n)
{
    uint32_t r = 0x80000000u, sq = 0x40000000u; /* x^0, x^1 */
    for (uint64_t e = 8 * n; e; e >>= 1) {
        if (e & 1)
            r = tkv_crc32c_mulmod(r, sq);
        sq = tkv_crc32c_mulmod(sq, sq);
    }
    return r;
}

#if defined(__SSE4_2__) && defined(__x86_64__)
static uint64_t crc_words(uint64_t c, const uint8_t *p, size_t n8)
{
    for (size_t i = 0; i < n8; i++) {
        uint64_t v;
        memcpy(&v, p + 8 * i, 8);
        c = _mm_crc32_u64(c, v);
    }
    return c;
}

/* The crc32 instruction has a latency of 3 cycles and a throughput of 1, so
 * three independent streams over thirds of the buffer run ~3x faster than
 * one; the register is linear, so reg(A||B) = reg(A) * x^(8|B|) ^ reg0(B)
 * joins them. (KV blocks are 16-64 KiB; the join costs ~100 ns.) */
uint32_t tkv_crc32c(uint32_t crc, const void *data, size_t len)
{
    const uint8_t *p = data;
    uint64_t c = ~crc & 0xffffffffu;
    if (len >= 3 * 1024) {
        const size_t n8 = len / 24; /* words per stream */
        uint64_t c1 = 0, c2 = 0;
        const uint8_t *p1 = p + 8 * n8, *p2 = p + 16 * n8;
        for (size_t i = 0; i < n8; i++) {
            uint64_t v0, v1, v2;
            memcpy(&v0, p + 8 * i, 8);
            memcpy(&v1, p1 + 8 * i, 8);
            memcpy(&v2, p2 + 8 * i, 8);
            c = _mm_crc32_u64(c, v0);
            c1 = _mm_crc32_u64(c1, v1);
            c2 = _mm_crc32_u64(c2, v2);
        }
        /* blocks come in one size: keep the constant of the last length */
        static _Thread_local size_t last_n8;
        static _Thread_local uint32_t last_shift;
        if (n8 != last_n8) {
            last_shift = tkv_crc32c_x8n(8 * n8);
            last_n8 = n8;
        }
        const uint32_t shift = last_shift;
        c = tkv_crc32c_mulmod((uint32_t)c, shift) ^ (uint32_t)c1;
        c = tkv_crc32c_mulmod((uint32_t)c, shift) ^ (uint32_t)c2;
        p += 24 * n8;
        len -= 24 * n8;
    }
    c = crc_words(c, p, len / 8);
    p += len / 8 * 8;
    len %= 8;
    uint32_t c32 = (uint32_t)c;
    for (; len > 0; len--, p++)
        c32 = _mm_crc32_u8(c32, *p);
    return ~c32;
}
#else
uint32_t tkv_crc32c(uint32_t crc, const void *data, size_t len)
{
    static uint32_t table[256];
    static int ready;
    if (!ready) { /* benign race: every thread computes the same table */
        for (uint32_t i = 0; i < 256; i++) {
            uint32_t c = i;
            for (int k = 0; k < 8; k++)
                c = (c >> 1) ^ (CRC32C_POLY & (0u - (c & 1)));
            table[i] = c;
        }
        ready = 1;
    }
    const uint8_t *p = data;
    crc = ~crc;
    for (size_t i = 0; i < len; i++)
        crc = (crc >> 8) ^ table[(crc ^ p[i]) & 0xff];
    return ~crc;
}
#endif
