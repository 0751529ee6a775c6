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

#endif
