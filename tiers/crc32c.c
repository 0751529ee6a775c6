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

uint32_t tkv_crc32c(uint32_t crc, const void *data, size_t len)
{
#if defined(__SSE4_2__) && defined(__x86_64__)
    const uint8_t *p = data;
    uint64_t c = ~crc & 0xffffffffu;
    for (; len >= 8; len -= 8, p += 8) {
        uint64_t v;
        memcpy(&v, p, 8);
        c = _mm_crc32_u64(c, v);
    }
    uint32_t c32 = (uint32_t)c;
    for (; len > 0; len--, p++)
        c32 = _mm_crc32_u8(c32, *p);
    return ~c32;
#else
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
#endif
}
