/*
 * quant.h -- block formats of quantized weights (llama.cpp's layouts) and the
 * row kernels the CPU backend is built on.
 *
 * Two families of kernels, each with a scalar reference beside the fast
 * (SIMD) version; tests compare them on fresh random inputs:
 *   - dequantization of a weight row to f32 (prefill: feed OpenBLAS sgemm);
 *   - dot products of a quantized weight row with an activation row that was
 *     quantized once per token into the format that pairs with the weight
 *     type (decode), as llama.cpp does:
 *         weight  Q4_0, Q8_0 -> activation Q8_0
 *         weight  Q4_1       -> activation Q8_1 (carries the block sums)
 *         weight  Q4_K, Q6_K -> activation Q8_K
 *         weight  F32, F16, BF16 -> activation F32 (no quantization)
 * Row lengths are multiples of the weight type's block size (the model
 * loader guarantees it).
 *
 * Numerics (tests/test-quant.c checks each of these on fresh random data):
 *   - dequantization: fast == reference bit for bit. Both compute in float32
 *     in the spec's order, never fused (Q4_1 is round(round(q*d) + m)), so
 *     they also match gguf-py's numpy dequantize;
 *   - activation quantization: fast == reference byte for byte (same
 *     rounding as llama.cpp's quantize_row_*_ref: roundf for Q8_0/Q8_1,
 *     nearest-even for Q8_K);
 *   - vec_dot: integer sums per block are exact in both; only the float
 *     summation order differs: |fast - ref| <= max(1e-5, 2*(blocks+8)*2^-24)
 *     * sum of |terms| (blocks: the row's block count, n/64 for the float
 *     types; the reference sums float types in f64). Typically ~1e-7.
 *
 * Defensive behaviour: an unsupported type id never crashes. tkv_dequant_row
 * fills zeros, tkv_act_row_bytes is 0 (tkv_quantize_act then writes
 * nothing), tkv_vec_dot returns 0, tkv_quantize_row returns false,
 * tkv_act_type returns TKV_TYPE_COUNT. A trailing partial block (n not a
 * multiple of the block) is ignored by vec_dot and zero-filled by dequant.
 *
 * Activation rows: the row starts with the llama.cpp blocks (block_q8_0,
 * block_q8_1 or block_q8_K, bytes identical to llama.cpp's reference
 * quantizers) and, for Q4_0, Q4_1 and Q8_0 weights, continues with a
 * repacked copy the AVX-512 kernels read (see quant.c); treat the row as
 * opaque and size it with tkv_act_row_bytes(). Rows placed at 64-byte
 * aligned addresses run fastest (tkv_act_row_bytes is a multiple of 64 for
 * those types).
 */
#ifndef TKV_QUANT_H
#define TKV_QUANT_H

#include "../runtime/gguf.h"

/* ---- block layouts (byte-compatible with ggml-common.h) ------------------ */

#define TKV_QK4_0 32
#define TKV_QK4_1 32
#define TKV_QK8_0 32
#define TKV_QK8_1 32
#define TKV_QK_K  256

typedef struct { uint16_t d;           uint8_t qs[16];  } tkv_block_q4_0; /* 18 B  */
typedef struct { uint16_t d, m;        uint8_t qs[16];  } tkv_block_q4_1; /* 20 B  */
typedef struct { uint16_t d;           int8_t  qs[32];  } tkv_block_q8_0; /* 34 B  */
typedef struct { uint16_t d, s;        int8_t  qs[32];  } tkv_block_q8_1; /* 36 B; s = d*sum(qs) */
typedef struct {
    uint16_t d, dmin;    /* super-block scales for the 6-bit scales and mins */
    uint8_t  scales[12]; /* 8 x (6-bit scale, 6-bit min), packed             */
    uint8_t  qs[128];    /* 4-bit quants                                     */
} tkv_block_q4_K;        /* 144 B */
typedef struct {
    uint8_t  ql[128];    /* low 4 bits                                       */
    uint8_t  qh[64];     /* high 2 bits                                      */
    int8_t   scales[16]; /* 8-bit scales of 16-element sub-blocks            */
    uint16_t d;
} tkv_block_q6_K;        /* 210 B */
typedef struct {
    float    d;          /* not f16                                          */
    int8_t   qs[256];
    int16_t  bsums[16];  /* sums of groups of 16 qs                          */
} tkv_block_q8_K;        /* 292 B */

_Static_assert(sizeof(tkv_block_q4_0) == 18, "q4_0");
_Static_assert(sizeof(tkv_block_q4_1) == 20, "q4_1");
_Static_assert(sizeof(tkv_block_q8_0) == 34, "q8_0");
_Static_assert(sizeof(tkv_block_q8_1) == 36, "q8_1");
_Static_assert(sizeof(tkv_block_q4_K) == 144, "q4_K");
_Static_assert(sizeof(tkv_block_q6_K) == 210, "q6_K");
_Static_assert(sizeof(tkv_block_q8_K) == 292, "q8_K");

/* Weight row of n elements -> f32. */
void tkv_dequant_row(uint32_t type, const void *src, float *dst, int64_t n);
void tkv_dequant_row_ref(uint32_t type, const void *src, float *dst, int64_t n);

/* The activation type paired with a weight type (table above). */
uint32_t tkv_act_type(uint32_t weight_type);
/* Bytes of one activation row of n elements for a weight type. */
size_t   tkv_act_row_bytes(uint32_t weight_type, int64_t n);

/* f32 activation row -> the paired activation format (fast and reference). */
void tkv_quantize_act(uint32_t weight_type, const float *x, void *dst, int64_t n);
void tkv_quantize_act_ref(uint32_t weight_type, const float *x, void *dst, int64_t n);

/* Dot product of a weight row with a prepared activation row. */
float tkv_vec_dot(uint32_t weight_type, const void *w, const void *act, int64_t n);
float tkv_vec_dot_ref(uint32_t weight_type, const void *w, const void *act, int64_t n);

/* f32 -> weight type (for tests and the model generator; types Q4_0, Q4_1,
 * Q8_0, F16, BF16, F32). Round-to-nearest like llama.cpp's reference
 * quantizers. Returns false for types it cannot produce. */
bool tkv_quantize_row(uint32_t type, const float *x, void *dst, int64_t n);

/* Bulk f16 <-> f32 conversions (F16C where available). */
void tkv_fp16_to_fp32_row(const uint16_t *src, float *dst, int64_t n);
void tkv_fp32_to_fp16_row(const float *src, uint16_t *dst, int64_t n);

/* ---- internals shared by quant.c and quant-ref.c ------------------------- */

/* The repacked copy is a sequence of groups of 16 blocks (the last group is
 * padded with zero blocks), each laid out for the AVX-512 kernels:
 *   Q4_1 weights (act Q8_1): float d[16]; float s[16];
 *                            int8 a[4][2][64]  (a[j][0] = qs[0..15] of blocks
 *                            4j..4j+3 side by side, a[j][1] = their qs[16..31])
 *   Q4_0 weights (act Q8_0): float d[16]; int32 init[4][16] (init[j][4i] =
 *                            -8*sum(qs) of block 4j+i, else 0); a as for Q4_1
 *   Q8_0 weights (act Q8_0): float d[16]; int32 init[8][16] (init[p][8h] =
 *                            -128*sum(qs) of block 2p+h, else 0);
 *                            int8 a[8][64] (qs of blocks 2p, 2p+1)
 * d and s are the blocks' f16 values widened to f32; for the 4-bit weights
 * d[e] and s[e] belong to block k = 4*(e%4) + e/4 (the order in which the
 * kernels' 4x4 transpose leaves the block sums). */
enum {
    TKV_ACT_GROUP      = 16,   /* blocks per group */
    TKV_ACT_GROUP_Q4_1 = 640,  /* bytes per group  */
    TKV_ACT_GROUP_Q4_0 = 832,
    TKV_ACT_GROUP_Q8_0 = 1088,
};

/* Keeps the compiler from fusing a product into a following add (GCC
 * contracts across statements under -ffp-contract=fast, its GNU default):
 * dequantization must round the product, as the spec and gguf-py do. */
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
static inline float tkv_nofuse_(float x) { __asm__("" : "+x"(x)); return x; }
#else
static inline float tkv_nofuse_(float x) { volatile float v = x; return v; }
#endif

/* Byte offset of the repacked copy in an activation row (0: none). */
size_t tkv_act_pack_offset_(uint32_t weight_type, int64_t n);
/* Builds the repacked copy from the llama.cpp blocks at the row's start. */
void   tkv_act_pack_(uint32_t weight_type, void *act, int64_t n);

#endif /* TKV_QUANT_H */
