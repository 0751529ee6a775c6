/*
 * crc32c.h -- CRC-32C (Castagnoli), the checksum on every KV block that
 * leaves the compute tier and on saved KV files.
 *
 * tkv_crc32c uses the SSE4.2 crc32 instruction where the build has it;
 * tkv_crc32c_ref is the bitwise reference the tests compare it with.
 * Both continue from `crc` (pass 0 to start): crc(a||b) = crc(b, crc(a)).
 */
#ifndef TKV_CRC32C_H
#define TKV_CRC32C_H

#include <stddef.h>
#include <stdint.h>

uint32_t tkv_crc32c(uint32_t crc, const void *data, size_t len);
uint32_t tkv_crc32c_ref(uint32_t crc, const void *data, size_t len);

/* The algebra that joins CRCs of pieces (and lets a GPU compute one in
 * parallel): the CRC register is linear, so for the raw register (no
 * pre/post inversion) reg(A||B) = mulmod(reg(A), x8n(|B|)) ^ reg(B), and
 * crc(M) = ~(reg0(M) ^ mulmod(0xFFFFFFFF, x8n(|M|))), reg0 starting at 0.
 * mulmod: a*b mod P in CRC-32C's reflected bit order; x8n: x^(8n) mod P. */
uint32_t tkv_crc32c_mulmod(uint32_t a, uint32_t b);
uint32_t tkv_crc32c_x8n(uint64_t n);

#endif
