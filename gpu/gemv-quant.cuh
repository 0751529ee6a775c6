/*
 * gemv-quant.cuh -- the quantized decode GEMV ("MMVQ"): weights kept as their
 * GGUF blocks (Q4_1, Q8_0) or repacked (Q4_0: tkv_cuda_q4_0_pack),
 * activations quantized to 8 bits once per call, integer dot products per
 * 32-element block (__dp4a), as the CPU backend's decode matmul does
 * (cpu/quant.h):
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
/* The block order the GEMVs of weight `type` with rows of n_in read: the
 * staged kernel's group (8 blocks for Q8_0, 4 for Q4_1) where it takes
 * n_in, else 1 (and always 1 for Q4_0: the packed kernel's order). */
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

/* Whether a fast kernel takes rows of n_in for type (n_in a multiple of the
 * staged kernel's group of blocks: 256 for Q8_0, 128 for Q4_1; any whole
 * blocks for Q4_0) and 16-byte aligned weights; else tkv_cuda_qgemv_ref
 * serves them. */
bool tkv_cuda_qgemv_fast_ok(uint32_t type, const void *w, uint32_t n_in);

/* Q4_0 blocks (GGUF, 18 bytes: an f16 scale, 16 bytes of nibbles) ->
 * the packed layout the Q4_0 kernels read, at dst (16-byte aligned,
 * 18 * blocks bytes): every block's 16 nibble bytes in the blocks' order,
 * then every block's scale in the same order. Device memory both. */
cudaError_t tkv_cuda_q4_0_pack(const void *gguf, void *dst, size_t blocks, cudaStream_t s);

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
 * apart; every roped weight's rows a multiple of head_dim). Q4_0 weights
 * are packed (tkv_cuda_q4_0_pack), the others GGUF blocks. Travels as a
 * kernel parameter. */
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
    /* the Q4_0 kernel's blocks a lane and row in flight (2, 4 or 8) and
     * warps a CTA (1 to 8); 0: its rule (A/B measuring: TKV_CUDA_Q4P) */
    uint32_t q4p_u, q4p_warps;
};

/* The fast kernels, 1 <= n <= 8 tokens, activations in the type's block
 * order (tkv_cuda_q8_order). Q4_0, the packed kernel: a warp a unit (a row,
 * a row pair, a gate and an up row), each lane reading 16-byte nibble
 * blocks 32 apart straight into registers, the first ones before
 * griddepcontrol.wait under pdl. Q4_1 and Q8_0, the staged kernel: each
 * lane streams groups of 4 or 8 blocks (80 or 272 bytes) through a
 * warp-private shared-memory stage with cp.async (coalesced 16-byte
 * copies; the first round issued before griddepcontrol.wait under pdl),
 * then reads its own group from there; a row is shared by 8 .. 256
 * threads (plan() in gemv-quant.cu), the CTA's warp count shrinks while the
 * grid would not fill the n_sm SMs; smem_sm (the device's shared memory
 * per SM, 0: unknown) lets the plan trade the second stage for a grid that
 * fits in one wave. */
cudaError_t tkv_cuda_qgemv(uint32_t type, const struct tkv_cuda_qgemv *g, struct tkv_cuda_q8_act a, uint32_t n_in,
                           uint32_t n, uint32_t n_sm, uint32_t smem_sm, bool pdl, cudaStream_t s);

/* The reference: one warp per row, a lane per block, byte loads and plain
 * integer products; any n_in % 32 == 0, any alignment, one weight (Q4_0
 * packed; TKV_CUDA_GEMV_QUANT=ref). */
cudaError_t tkv_cuda_qgemv_ref(uint32_t type, const void *w, struct tkv_cuda_q8_act a, float *y, uint32_t n_in,
                               uint32_t n_out, uint32_t n, cudaStream_t s);

#endif
