/*
 * attn.cuh -- attention of query tokens over paged f16 KV blocks (the GPU
 * side of backend.h's attention op): grouped-query, causal by positions,
 * online softmax in f32, optional log-sum-exp output, split-K over blocks
 * with an exact log-sum-exp merge.
 *
 * Paged KV descriptor (device memory), FlashInfer style:
 *     blocks   [head_off[n_head_kv]]  one entry per block, the blocks of KV
 *                                     head g at [head_off[g], head_off[g+1]),
 *                                     in position order, none of 0 rows
 *     entry.k, entry.v               [B, head_dim] f16, rows 0..n-1 valid,
 *                                     row j at position pos0 + j
 *     kofs     [total + 1 + 64]       kofs[b] = rows of the entries before b
 *                                     (all heads: head g's keys are
 *                                     [kofs[head_off[g]], kofs[head_off[g+1]])),
 *                                     then 64 times UINT32_MAX; the prefill
 *                                     kernel's packed tiles index keys by it
 * Queries q [n_q, n_head*head_dim] f32, positions q_pos [n_q] (device,
 * non-decreasing); query head h reads KV head h / (n_head / n_head_kv).
 *
 * Two kernels:
 *   - the general one (attn.cu, also the reference): the query rows of one
 *     KV head (n_q tokens x G heads of the group, flattened token-major) are
 *     cut into tiles of R rows; one CTA per (row tile, KV head, key split)
 *     walks its share of the blocks in tiles of 64 keys held in shared memory
 *     (S = Q K^T, online softmax, O += P V, all f32 on CUDA cores);
 *   - the decode one (attn-decode.cu) for at most 8 query rows per KV head
 *     and 16-byte-aligned K/V: streams K/V with cp.async, all rows of a KV
 *     head from each load, split-K over the blocks with a fused merge;
 *   - the tensor-core one (attn-prefill.cu) for more rows, head_dim 64 or
 *     128 and 16-byte-aligned K/V: mma.sync over 64x64 tiles, each key tile
 *     packed from the rows of consecutive refs of any size (kofs).
 * With n_split > 1 each CTA writes an unnormalised partial (O, m, l) and the
 * partials are combined exactly by log-sum-exp.
 *
 * Limits: head_dim a multiple of 8, at most 256 (tkv_cuda_attn_supported).
 */
#ifndef TKV_GPU_ATTN_CUH
#define TKV_GPU_ATTN_CUH

#include "attn-runs.h"
#include "common.cuh"
#include "gemv-common.cuh"

struct tkv_cuda_kv_entry {
    const uint16_t *k; /* [B, head_dim] f16 */
    const uint16_t *v; /* [B, head_dim] f16 */
    int32_t pos0;
    uint32_t n;
};

struct tkv_cuda_attn_params {
    const float *q;                         /* [n_q, n_head*head_dim]           */
    const int32_t *q_pos;                   /* [n_q]                            */
    float *out;                             /* [n_q, n_head*head_dim]           */
    float *lse;                             /* [n_q, n_head] or NULL            */
    const struct tkv_cuda_kv_entry *blocks; /* [head_off[n_head_kv]]            */
    const uint32_t *head_off;               /* [n_head_kv + 1]                  */
    const uint32_t *head_end;               /* [n_head_kv] or NULL: head g's
                                               entries end at head_end[g], not
                                               head_off[g + 1] (device views:
                                               not back to back)                 */
    const uint32_t *head_cnt;               /* with head_end, or NULL: head g's
                                               entries end at head_off[g] +
                                               head_cnt[g head_cnt_stride] if
                                               that is sooner (counts the device
                                               wrote; the host's bound in
                                               head_end)                         */
    uint32_t head_cnt_stride;
    const uint32_t *head_keys;              /* with head_cnt, or NULL: head g's
                                               keys at head_keys[g
                                               head_cnt_stride], a hint: the
                                               decode kernel over device views
                                               then runs as a pool of n_split
                                               CTAs shared among the heads by
                                               their keys (attn-decode.cu)      */
    const uint32_t *kofs;                   /* [head_off[n_head_kv] + 65]: key
                                               offsets (below), or NULL          */
    float *part;                            /* [n_split][n_q*n_head][hd + 2]    */
    uint32_t n_q, n_head, n_head_kv, head_dim;
    uint32_t n_split;                       /* set by tkv_cuda_attn_plan        */
    float scale_log2;                       /* scale * log2(e)                  */
    int vec16;                              /* all K/V rows 16-byte aligned     */
    int decode_mode;                        /* enum tkv_cuda_attn_decode_mode   */
    int decode_mma;                         /* the decode kernel's scores and P.V on
                                               the tensor cores where it has them
                                               (head_dim class 128, sm_80+); 0 with
                                               TKV_CUDA_ATTN_DECODE_MMA=0        */
    int prefill_mode;                       /* enum tkv_cuda_attn_prefill_mode  */
    int prefill_pack;                       /* prefill kernel: packed tiles when
                                               kofs is set (else per ref)       */
    int prefill_variant;                    /* tensor-core prefill kernel: -1 (by
                                               precision, attn-prefill.cuh), 0 ..
                                               TKV_ATTN_PREFILL_VARIANTS - 1
                                               (attn-prefill.cuh)               */
    uint32_t *counters;                     /* [n_head_kv], zero between calls:
                                               finished splits (fused merge)    */
    int pdl;                                /* the decode kernel as a programmatic
                                               dependent launch (common.cuh)    */
    int ws_pingpong;                        /* prefill v3's consumer warpgroups
                                               take turns (attn-prefill-ws.cu)  */
    uint32_t prefetch;                      /* the decode kernel over inline runs:
                                               each warp asks L2 for the K/V of
                                               its first `prefetch` chunks before
                                               its dependency wait (sm_90; 0:
                                               none; TKV_CUDA_ATTN_PREFETCH)    */
    struct tkv_cuda_q8_act q8;              /* q8.q != NULL (decode kernels only,
                                               head_dim % 32 == 0): out is also
                                               quantized into these planes of
                                               n_q rows of n_head*head_dim, as
                                               the quantized GEMV that reads out
                                               next would (gemv-common.cuh)     */
};

/* The end of KV head g's entries in p.blocks. */
__device__ __forceinline__ uint32_t tkv_cuda_head_end(const tkv_cuda_attn_params &p, uint32_t g)
{
    const uint32_t e = p.head_end ? p.head_end[g] : p.head_off[g + 1];
    return p.head_cnt ? min(e, p.head_off[g] + p.head_cnt[(size_t)g * p.head_cnt_stride]) : e;
}

/* Which kernels serve calls of at most 8 query rows per KV head. */
enum tkv_cuda_attn_decode_mode {
    TKV_ATTN_DECODE_OFF = 0,   /* the general kernel (the reference)                */
    TKV_ATTN_DECODE_MERGE = 1, /* the decode kernel, then a merge kernel            */
    TKV_ATTN_DECODE_FUSED = 2, /* the decode kernel over the packed block table;
                                  the last CTA of a head merges                */
    TKV_ATTN_DECODE_RUNS = 3,  /* FUSED, the block table as strided runs in the
                                  kernel's parameters (no table copy) where the
                                  view fits (tkv_cuda_attn_runs), else FUSED;
                                  under PDL the kernel reads only its
                                  parameters and asks L2 for its first K/V
                                  (prefetch) before its dependency wait: the
                                  default                                      */
};

/* The decode kernel's inline block table (TKV_ATTN_RUNS_MAX runs in its
 * launch parameters): attn-runs.h. */

/* A decode call over device views (the entries in device memory, head g's
 * [head_off[g], head_end[g]), bounded by p.head_cnt when set): the query
 * positions and the head ranges as a kernel parameter, so the call stages
 * nothing (attn-decode.cuh, tkv_cuda_attn_decode_views). */
struct tkv_cuda_attn_views {
    int32_t q_pos[8];                      /* [n_q]         */
    uint32_t head_off[TKV_ATTN_RUNS_HEADS]; /* [n_head_kv]   */
    uint32_t head_end[TKV_ATTN_RUNS_HEADS]; /* [n_head_kv]   */
};

/* Which kernel serves calls of more query rows (attn-prefill.cuh). */
enum tkv_cuda_attn_prefill_mode {
    TKV_ATTN_PREFILL_GENERAL = 0, /* the general kernel (f32 CUDA cores)           */
    TKV_ATTN_PREFILL_SPLIT = 1,   /* tensor cores, Q and P as f16 hi + lo          */
    TKV_ATTN_PREFILL_F16 = 2,     /* tensor cores, Q and P in f16                  */
};

/* Variants of the tensor-core prefill kernel (attn-prefill.cuh): v0 .. v3
 * (the default by device and precision: tkv_cuda_attn_prefill_variant). */
#define TKV_ATTN_PREFILL_VARIANTS 4

/* head_dim the kernels handle. */
bool tkv_cuda_attn_supported(uint32_t head_dim);

/* Once per process and device: raises the kernels' shared-memory limit. */
cudaError_t tkv_cuda_attn_init(void);

/* Chooses p->n_split for a view of at most max_blocks blocks (max_tiles
 * 64-key tiles of their rows) per KV head on a device of n_sm
 * multiprocessors: the prefill kernel's packed walk splits tiles, the other
 * kernels blocks; returns the floats of p->part needed (0 when the keys are
 * not split). */
size_t tkv_cuda_attn_plan(struct tkv_cuda_attn_params *p, uint32_t max_blocks, uint32_t max_tiles, int n_sm);

/* Runs the attention (and the merge when split). */
cudaError_t tkv_cuda_attention(const struct tkv_cuda_attn_params *p, cudaStream_t s);

/* ---- the attention op's host side ------------------------------------------
 * One per backend: a ring of block-table buffers (pinned host + device), each
 * call's table copied on a stream of its own so that the copy overlaps the
 * kernels queued before it; the split-K partials; the merge counters. */
struct tkv_cuda_attn_state;

/* Read from the environment here (the decode mode comes from the caller,
 * cuda-backend.c: TKV_CUDA_ATTN_DECODE): the prefill kernel,
 * TKV_CUDA_ATTN_PREFILL=mma (default: tensor cores, split precision), mma16
 * (tensor cores, f16) or general (the reference kernel); the tensor-core
 * kernel's variant, TKV_CUDA_ATTN_PREFILL_VARIANT=v0 or v1 (also
 * set later by tkv_cuda_attn_state_set_prefill_variant); its key walk,
 * TKV_CUDA_ATTN_PACK=0 (per ref instead of packed tiles); and a knob that
 * measured the table's copy stream, TKV_CUDA_ATTN_TABLE=main (copy the
 * block table on the compute stream instead). */
/* pdl: launch the decode kernel (packed table or inline runs) as a
 * programmatic dependent launch (the backend's TKV_CUDA_PDL, cuda-backend.cu). */
cudaError_t tkv_cuda_attn_state_create(int decode_mode, bool pdl, struct tkv_cuda_attn_state **out);
void tkv_cuda_attn_state_free(struct tkv_cuda_attn_state *st); /* NULL is a no-op */

/* The tensor-core prefill kernel's variant for the calls queued from now on
 * (0 .. TKV_ATTN_PREFILL_VARIANTS - 1; false, nothing changed, otherwise).
 * Kernels queued before keep theirs. */
bool tkv_cuda_attn_state_set_prefill_variant(struct tkv_cuda_attn_state *st, int variant);

/* "vN: ..." describing variant v (static), NULL past the last one. */
const char *tkv_cuda_attn_prefill_variant_desc(int variant);

/* Packs a's block table (a->kv: host memory holding device pointers) as
 *     q_pos [n_q] i32 | head_off [n_head_kv + 1] u32 | entries [total]
 *     | kofs [total + 1 + 64] u32
 * (refs of 0 rows left out; kofs NULL in the params when the rows of all
 * heads together pass 2^31: the prefill kernel then walks per ref),
 * copies it, plans the split and queues the kernels on s. The caller has
 * validated a (head counts, supported head_dim, fewer than 2^31 blocks).
 * With a->kv_dev the entries are not packed: they stay in device memory,
 * kv[g].blocks being head g's (head_off / head_end point into them), and
 * the table holds q_pos and those offsets only.
 * TKV_CUDA_ATTN_PACK=0 when the state is created: the prefill kernel walks
 * the refs one by one instead of packed 64-key tiles (attn-prefill.cuh). */
/* q8: NULL, or planes for n_q rows of n_head*head_dim that the decode
 * kernels also quantize out into (tkv_cuda_attn_params.q8; head_dim % 32
 * == 0, else ignored); *q8_done says whether the call's kernels did (a
 * call the decode kernels do not serve leaves them untouched). */
cudaError_t tkv_cuda_attn_run(struct tkv_cuda_attn_state *st, const struct tkv_attn_args *a,
                              const struct tkv_cuda_q8_act *q8, int n_sm, cudaStream_t s, bool *q8_done);

#endif
