/*
 * gemv-quant.cuh -- the quantized decode GEMV ("MMVQ"): Q4_0, Q4_1 and Q8_0
 * matrices repacked at load (tkv_cuda_qgemv_pack: each block's quants and
 * scales apart, the same bytes), activations quantized to 8 bits once per
 * call, integer dot products per 32-element block (__dp4a), as the CPU
 * backend's decode matmul does (cpu/quant.h):
 *     weight Q4_0, Q8_0 -> activation Q8_0;  weight Q4_1 -> activation Q8_1.
 *
 * Activations live in two device planes (struct tkv_cuda_q8_act), the bytes
 * of the llama.cpp blocks split so the GEMV can load them 16 bytes at a
 * time; tkv_cuda_q8_pack turns them into tkv_block_q8_0 / tkv_block_q8_1
 * rows (the test compares those byte for byte with the CPU reference).
 *
 * Per block the float arithmetic is the CPU reference's (cpu/quant-ref.c,
 * tkv_vec_dot_ref), products and sums rounded one at a time (__fmul_rn,
 * __fadd_rn: nvcc cannot contract them):
 *     Q4_0 x Q8_0:  (d_w * d_a) * isum,  isum = sum((q_w - 8) * q_a)
 *     Q4_1 x Q8_1:  (d_w * d_a) * isum + m_w * s_a,  isum = sum(q_w * q_a)
 *     Q8_0 x Q8_0:  (d_w * d_a) * isum
 * The integer sums are exact, so a row differs from the CPU's only by the
 * order in which the block terms are added (f32 reassociation).
 */
#ifndef TKV_GPU_GEMV_QUANT_CUH
#define TKV_GPU_GEMV_QUANT_CUH

#include "gemv-common.cuh"

/* The weight types the quantized GEMV reads: Q4_0, Q4_1, Q8_0. */
bool tkv_cuda_qgemv_supported(uint32_t type);

/* The activation planes (struct tkv_cuda_q8_act) are described in
 * gemv-common.cuh. Bytes of the planes for n rows of n_in (q first, meta
 * 16-byte aligned after). */
size_t tkv_cuda_q8_act_bytes(uint32_t n, uint32_t n_in);
/* The block order the GEMVs of weight `type` with rows of n_in read: 1, the
 * plain order, for every type since the kernel's lanes read consecutive
 * blocks (the planes keep the order parameter, which producers and the
 * reference kernel honor). */
uint32_t tkv_cuda_q8_order(uint32_t type, uint32_t n_in);
/* The planes inside a buffer of tkv_cuda_q8_act_bytes(n, n_in) bytes, in
 * block order gb. */
struct tkv_cuda_q8_act tkv_cuda_q8_act_at(void *buf, uint32_t n, uint32_t n_in, uint32_t gb);

/* x [n][n_in] f32 -> the planes, byte for byte what cpu/quant-ref.c's
 * q8_block_ref computes: amax, d = amax / 127, id = d ? 1 / d : 0,
 * q = roundf(x * id) (half away from zero), d and s rounded to f16
 * (tkv_q8_block_of, gemv-common.cuh). A
 * programmatic dependent launch when pdl (common.cuh's contract). */
cudaError_t tkv_cuda_q8_quantize(const float *x, uint32_t n, uint32_t n_in, struct tkv_cuda_q8_act a, bool pdl,
                                 cudaStream_t s);

/* The planes -> n rows of nb llama.cpp blocks at dst: tkv_block_q8_1 when
 * q8_1, else tkv_block_q8_0 (for tests: what the GEMV reads, in the CPU's
 * format). */
cudaError_t tkv_cuda_q8_pack(struct tkv_cuda_q8_act a, uint32_t n, uint32_t n_in, bool q8_1, void *dst,
                             cudaStream_t s);

/* Whether the fast kernel takes rows of n_in for type: whole blocks
 * (n_in % 32 == 0) and 16-byte aligned weights. */
bool tkv_cuda_qgemv_fast_ok(uint32_t type, const void *w, uint32_t n_in);

/* GGUF blocks of type (18, 20 or 34 bytes: the scales first, then the
 * quants) -> the packed layout the kernels read, at dst (16-byte aligned,
 * tkv_cuda_qgemv_packed_bytes): every block's quants (16 or 32 bytes) in
 * the blocks' order, then every block's scales (d; d and m for Q4_1) in
 * the same order. A matrix's blocks are in row order, so block k of row r
 * is r * (n_in / 32) + k. Device memory both. */
size_t tkv_cuda_qgemv_packed_bytes(uint32_t type, size_t blocks);
cudaError_t tkv_cuda_qgemv_pack(uint32_t type, const void *gguf, void *dst, size_t blocks, cudaStream_t s);

/* One grid over the rows of up to TKV_CUDA_QGEMV_MAX weights of one type
 * sharing the activations (matmul: nw = 1; matmul_group: q, k, v):
 * y[i][n, n_out_i] = x . w[i]^T, end[i] = rows of w[0..i]. With swiglu set
 * (nw = 1), w[0] is the gate and wu the up matrix of the same shape, and
 * y[0] = silu(x . w[0]^T) * (x . wu^T) with swiglu's formula. With pair set
 * (and not swiglu), the lanes of a row take two adjacent rows, each
 * activation load serving both (as swiglu's gate and up rows share them);
 * ignored unless every end[i] is even. Same results either way. With acc
 * set (not with swiglu), y[i] += the product: y + x rounded once, as
 * tkv_cuda_add_rmsnorm adds a residual. With rope set, the roped outputs
 * are those of the product followed by tkv_cuda_rope, bit for bit (rows in
 * pairs where one row a unit would put a pair's rows more than a warp
 * apart; every roped weight's rows a multiple of head_dim; RoPE takes rows
 * in pairs). Weights packed (tkv_cuda_qgemv_pack). Travels as a kernel
 * parameter. */
#define TKV_CUDA_QGEMV_MAX 8
struct tkv_cuda_qgemv {
    const void *w[TKV_CUDA_QGEMV_MAX];
    float *y[TKV_CUDA_QGEMV_MAX];
    uint32_t end[TKV_CUDA_QGEMV_MAX];
    uint32_t nw;
    const void *wu;
    bool swiglu;
    bool pair;
    bool acc; /* y[i] += the product instead of = (not with swiglu) */
    /* RoPE in the epilogue (not with swiglu or acc; NULL: none): the first
     * rope_segs weights' outputs, heads of head_dim, rotated as
     * tkv_cuda_rope rotates them, pairs p < n_pairs of token i at the
     * angles rope[i][p] (tkv_cuda_rope_table) */
    const float2 *rope;
    uint32_t rope_segs, head_dim, n_pairs;
    /* the kernel's shape, 0 for its rule (A/B measuring: TKV_CUDA_QGEMV_SHAPE):
     * 16-byte chunks of weight blocks a lane and row in flight (2 or 4) and
     * warps a CTA (1 to 8) */
    uint32_t chunks, warps;
};

/* The fast kernel, 1 <= n <= 8 tokens, activations in the plain block order
 * (tkv_cuda_q8_order): a warp a unit (a row, a row pair, or a gate and an up
 * row), lane j reading blocks j, j + 32, ... of the unit's rows straight
 * into registers, 2 or 4 chunks of 16 bytes a row in flight while it
 * multiplies the ones before (the first issued before griddepcontrol.wait
 * under pdl). A lane adds its blocks' terms in order and the warp sums its
 * lanes by an xor butterfly, so every mode gives tkv_cuda_qgemv_ref's bits. */
cudaError_t tkv_cuda_qgemv(uint32_t type, const struct tkv_cuda_qgemv *g, struct tkv_cuda_q8_act a, uint32_t n_in,
                           uint32_t n, bool pdl, cudaStream_t s);

/* The reference: one warp per row, a lane per block, byte loads and plain
 * integer products; any n_in % 32 == 0, any block order, one packed
 * weight (TKV_CUDA_GEMV_QUANT=ref). */
cudaError_t tkv_cuda_qgemv_ref(uint32_t type, const void *w, struct tkv_cuda_q8_act a, float *y, uint32_t n_in,
                               uint32_t n_out, uint32_t n, cudaStream_t s);

#endif
