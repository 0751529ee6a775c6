/*
 * attn-prefill.cuh -- the tensor-core attention kernel for many query rows
 * per KV head (prefill): FlashAttention-2 style, mma.sync m16n8k16 with f16
 * operands and f32 accumulation, ldmatrix fragments, K/V tiles gathered from
 * the block table with cp.async (double-buffered), causal block skipping.
 * Internal to gpu/attn*.cu; the backend reaches it through tkv_cuda_attention;
 * the default for head_dim 64 and 128 (TKV_CUDA_ATTN_PREFILL, attn.cuh).
 *
 * Work split: as the general kernel (attn.cu): the query rows of a KV head
 * (n_q tokens x G heads, token-major) in tiles of 64 rows, one CTA of 4 warps
 * (16 rows each) per (row tile, KV head, key split), 64 keys per step; split
 * partials in the general kernel's layout, merged by its merge kernel.
 *
 * Key tiles (default, TKV_CUDA_ATTN_PACK unset or not 0): tile t of a KV head
 * holds keys [64t, 64t + 64) of the concatenation of the head's refs in list
 * order, whatever the refs' sizes (8-row key blocks of EntropyInfer, token
 * ranges of RaBitQ top-p, whole 64-row blocks), so every step multiplies
 * full 64-key tiles; a split is a range of whole tiles. Each row's K/V
 * address and position come from the block table's key offsets (p->kofs,
 * prefix sums of the refs' lengths packed by tkv_cuda_attn_run): one load
 * per lane per tile, kept in flight a tile ahead, finds the refs ending
 * inside the tile; then one load of each row's entry, as the per-ref walk
 * pays per ref (details at fill_packed in attn-prefill.cu). With
 * TKV_CUDA_ATTN_PACK=0 the kernel walks the refs one after the other (one
 * dependent entry load per ref, splits over refs), kept to measure the
 * difference.
 *
 * Variants (p->prefill_variant; TKV_CUDA_ATTN_PREFILL_VARIANT): v0 is the
 * kernel described here (attn-prefill.cu); v1 (attn-prefill-var.cu) has
 * 128 query rows per CTA (4 warps of 32) and another schedule (one barrier
 * per tile, lazy rescale), with the same walks, precisions and outputs; v2
 * (attn-prefill-wg.cu) is v1's schedule on Hopper's warpgroup MMA (two
 * warpgroups of 64 rows, K/V in the 128-byte swizzled layout); v3
 * (attn-prefill-ws.cu) is v2 with specialized warps (a producer
 * warpgroup, mbarriers per stage, the two consumer warpgroups taking
 * turns). v2 and v3 run on devices of compute capability 9.0 only (v1
 * serves them elsewhere). Defaults: v3 on compute capability 9.0; else v1
 * in f16, v0 in split precision. A call with scale <= 0 runs v0 whatever
 * the variant (v1-v3 take the row max before scaling).
 *
 * Precision: TKV_ATTN_PREFILL_SPLIT writes Q and P each as the sum of two f16
 * numbers (hi + lo) and multiplies both parts (twice the matrix work), which
 * keeps the result within ~1e-6 of f32 arithmetic; TKV_ATTN_PREFILL_F16 uses
 * one f16 each (as FlashAttention does), ~1e-3.
 */
#ifndef TKV_GPU_ATTN_PREFILL_CUH
#define TKV_GPU_ATTN_PREFILL_CUH

#include "attn.cuh"

#include <type_traits>

/* Rows of one CTA's tile of v0 and of v1. */
#define TKV_ATTN_PREFILL_ROWS 64u
#define TKV_ATTN_PREFILL_VAR_ROWS 128u

/* Each variant compiles one kernel instance per (head_dim 64 or 128,
 * precision f16 or split); these two run code for those four as template
 * arguments: f(hd, split) gets std::integral_constant values, so
 * decltype(hd)::value and decltype(split)::value are constants.
 * tkv_pf_each calls f for every instance, stopping at the first error;
 * tkv_pf_one for the call's. */
template <class F> cudaError_t tkv_pf_one(uint32_t head_dim, bool split, F &&f)
{
    using H64 = std::integral_constant<int, 64>;
    using H128 = std::integral_constant<int, 128>;
    if (head_dim == 64)
        return split ? f(H64{}, std::true_type{}) : f(H64{}, std::false_type{});
    return split ? f(H128{}, std::true_type{}) : f(H128{}, std::false_type{});
}
template <class F> cudaError_t tkv_pf_each(F &&f)
{
    for (uint32_t hd : {64u, 128u})
        for (bool split : {false, true})
            TKV_CUDA_TRY(tkv_pf_one(hd, split, f));
    return cudaSuccess;
}

/* CTAs per SM of one variant's instances, by (head_dim, precision) */
struct tkv_pf_ctas {
    int c[2][2];
    int &at(uint32_t head_dim, bool split) { return c[head_dim == 64 ? 0 : 1][split ? 1 : 0]; }
    int get(uint32_t head_dim, int mode)
    {
        const int n = at(head_dim, mode == TKV_ATTN_PREFILL_SPLIT);
        return n > 0 ? n : 1;
    }
};

/* Raises the shared-memory limits of both variants' instances (once per
 * device); records their CTAs per SM. */
cudaError_t tkv_cuda_attn_prefill_init(void);

/* Whether the kernel takes this call (head_dim 64 or 128, 16-byte-aligned K/V and q). */
bool tkv_cuda_attn_prefill_ok(const struct tkv_cuda_attn_params *p);

/* Whether the kernel walks packed tiles (p->prefill_pack and p->kofs): the
 * split-K then cuts each head's keys at 64-key tile boundaries, else its refs. */
bool tkv_cuda_attn_prefill_packed(const struct tkv_cuda_attn_params *p);

/* The variant that serves p: p->prefill_variant (-1, the default: v3 on
 * compute capability 9.0, else v1 for f16 and v0 for split precision), or 0
 * (v0) when p->scale <= 0. */
int tkv_cuda_attn_prefill_variant(const struct tkv_cuda_attn_params *p);

/* Query rows of one CTA, and CTAs per SM, of the instance that serves p. */
uint32_t tkv_cuda_attn_prefill_rows(const struct tkv_cuda_attn_params *p);
int tkv_cuda_attn_prefill_ctas_per_sm(const struct tkv_cuda_attn_params *p);

/* Runs the kernel (the caller launches the merge when n_split > 1). */
cudaError_t tkv_cuda_attn_prefill(const struct tkv_cuda_attn_params *p, cudaStream_t s);

/* attn-prefill-var.cu: v1 (the dispatch above runs it for variant 1). */
cudaError_t tkv_cuda_attn_prefill_var_init(void);
cudaError_t tkv_cuda_attn_prefill_var(const struct tkv_cuda_attn_params *p, cudaStream_t s);
int tkv_cuda_attn_prefill_var_ctas_per_sm(uint32_t head_dim, int mode);

/* attn-prefill-wg.cu: v2, wgmma (sm_90a; the dispatch runs it for variant 2
 * where tkv_cuda_attn_prefill_wg_ok, v1 elsewhere). init records whether the
 * current device is of compute capability 9.0 and, if so, sets up the
 * kernels. */
cudaError_t tkv_cuda_attn_prefill_wg_init(void);
bool tkv_cuda_attn_prefill_wg_ok(void);
cudaError_t tkv_cuda_attn_prefill_wg(const struct tkv_cuda_attn_params *p, cudaStream_t s);
int tkv_cuda_attn_prefill_wg_ctas_per_sm(uint32_t head_dim, int mode);

/* attn-prefill-ws.cu: v3, v2 with the warps specialized (a producer warp,
 * mbarriers per stage, ping-pong); runs where v2 runs (init after v2's). */
cudaError_t tkv_cuda_attn_prefill_ws_init(void);
cudaError_t tkv_cuda_attn_prefill_ws(const struct tkv_cuda_attn_params *p, cudaStream_t s);
int tkv_cuda_attn_prefill_ws_ctas_per_sm(uint32_t head_dim, int mode);

/* One instance's two kernels, walking packed tiles (packed) or the refs
 * one by one (per_ref), of variants whose grid is (row tiles of `rows`
 * rows x KV heads, heaviest tile first; splits): v1, v2, v3. */
typedef void (*tkv_pf_kernel)(const struct tkv_cuda_attn_params);

/* Launches the one p's walk takes. */
static inline cudaError_t tkv_pf_launch(const struct tkv_cuda_attn_params *p, cudaStream_t s, uint32_t rows,
                                        int threads, size_t smem, tkv_pf_kernel packed, tkv_pf_kernel per_ref)
{
    const uint32_t n = p->n_q * (p->n_head / p->n_head_kv), tiles = (n + rows - 1) / rows;
    const dim3 grid(tiles * p->n_head_kv, p->n_split);
    (tkv_cuda_attn_prefill_packed(p) ? packed : per_ref)<<<grid, threads, smem, s>>>(*p);
    TKV_CUDA_LAUNCHED();
    return cudaSuccess;
}

/* Raises both kernels' shared-memory limit to smem; *ctas = the CTAs per
 * SM of the smaller (at least 1). */
static inline cudaError_t tkv_pf_setup(int *ctas, int threads, size_t smem, tkv_pf_kernel packed,
                                       tkv_pf_kernel per_ref)
{
    int c[2];
    TKV_CUDA_TRY(cudaFuncSetAttribute(packed, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    TKV_CUDA_TRY(cudaFuncSetAttribute(per_ref, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    TKV_CUDA_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&c[0], packed, threads, smem));
    TKV_CUDA_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&c[1], per_ref, threads, smem));
    *ctas = c[0] < c[1] ? c[0] : c[1];
    if (*ctas < 1)
        *ctas = 1;
    return cudaSuccess;
}

#endif
