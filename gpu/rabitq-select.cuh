/*
 * rabitq-select.cuh -- one layer's RaBitQ top-p selection on the GPU (the
 * device side of backend.h's rabitq_select): per (KV head, query head) pair
 * every key estimated as rabitq.cu's estimate kernel does (bit for bit),
 * top-p found by a histogram of the keys' log-values and an exact radix
 * refinement of the boundary bin, the G query heads' kept sets ORed into a
 * bitmap per KV head. docs/rabitq.md ("Device top-p") states what it
 * guarantees and where it can differ from tkv_rabitq_select_topp.
 *
 * Masses are summed in 64-bit fixed point within a bin of the histogram,
 * in units of the bin's own (2^-40 of the largest term the bin can hold, for
 * l and for u apart), and in doubles added in a fixed order across bins; a
 * kept key's term rounded down, a dropped key's up: the result is the same
 * on every run and the rule checked implies the rule on the exponentials.
 */
#ifndef TKV_GPU_RABITQ_SELECT_CUH
#define TKV_GPU_RABITQ_SELECT_CUH

#include "rabitq.cuh"

#define TKV_CUDA_RQS_MAX_G      8
#define TKV_CUDA_RQS_MAX_FORCED 4
#define TKV_CUDA_RQS_NBINS      TKV_RABITQ_TOPP_BINS /* the host's bins (backend.h) */

/* One KV head of the call. */
struct tkv_cuda_rqs_head {
    struct tkv_cuda_rq_index ix;
    const struct tkv_rabitq_dev_query *q;       /* [G] the head's queries (device memory) */
    uint32_t n, n_forced;                       /* keys 0 .. n-1; forced ranges        */
    uint32_t row;                               /* the head's row of the bitmap         */
    uint32_t fb[TKV_CUDA_RQS_MAX_FORCED], fe[TKV_CUDA_RQS_MAX_FORCED]; /* [fb, fe)     */
};

/* The heads one launch of the kernels takes: their table travels as a
 * kernel parameter (TKV_CUDA_RQS_GROUP x 128 bytes), so nothing is staged
 * between a layer's kernels; the caller runs the kernels once per group of
 * heads (tkv_cuda_rqs_run). */
#define TKV_CUDA_RQS_GROUP 8
struct tkv_cuda_rqs_heads {
    struct tkv_cuda_rqs_head h[TKV_CUDA_RQS_GROUP];
};

struct tkv_cuda_rqs_params {
    uint32_t n_heads, G, n_max, words, whole; /* n_max: tkv_cuda_rqs_row_len(the largest n);
                                                 words: bitmap row                    */
    float p, scale, extra_lse;
    int safe;
    int coarse;                               /* the boundary bin whole: kernels 4 and 5
                                                 not run (tkv_rabitq_topp_params)     */
    uint32_t code_words;                      /* every head's ix.words (the estimate
                                                 kernel's template), 0: they differ  */
    uint32_t n_sm;                            /* the device's multiprocessors (grid sizes) */
    uint32_t mma;                             /* 128-bit codes' popcounts on the tensor
                                                 cores (tkv_cuda_rqs_init's *mma, unless
                                                 TKV_CUDA_RQS_MMA=0)                 */
};

/* The length of each pair's rows of scratch and list for a call whose
 * largest head has n keys (tkv_cuda_rqs_params.n_max): n rounded up to a
 * multiple of 4, so every row starts 16-byte aligned (the hist and output
 * kernels load 4 keys at once); within a bitmap row's words * 32. */
static inline uint32_t tkv_cuda_rqs_row_len(uint32_t n) { return (n + 3) & ~3u; }

/* Device memory one call uses, all sized by tkv_cuda_rqs_bytes. */
struct tkv_cuda_rqs_work {
    void *state;        /* [P] per-pair state (histogram, boundary), zeroed by clear */
    float *scratch;     /* [3][P][n_max] log-values g, scaled estimates s, bounds d
                           (a group of heads' three [Pg][n_max] arrays together) */
    uint32_t *list;     /* [P][n_max] members of the boundary bin                   */
    double *mass;       /* [P] out                                                  */
    uint32_t *n_chosen; /* [P] out                                                  */
    uint32_t *bitmap;   /* [n_heads][words] out                                     */
};

/* Once per process and device, before tkv_cuda_rqs_run: the kernels'
 * shared-memory limits; *mma: whether this build's tensor-core estimate
 * can run (compiled for sm_80 or later; tkv_cuda_rqs_params.mma). */
cudaError_t tkv_cuda_rqs_init(bool *mma);

/* Bytes of the per-pair state (P pairs). */
size_t tkv_cuda_rqs_state_bytes(uint32_t P);

/* A call's selection, queued on s: first tkv_cuda_rqs_clear (the state of
 * its P pairs zeroed), then tkv_cuda_rqs_run once per group of heads, heads
 * h0 .. h0 + n - 1 of the call (n <= TKV_CUDA_RQS_GROUP, head h0 + i at
 * hs->h[i]; query j of a head at its q[j], device memory: staged by the
 * caller, or prepared there by tkv_cuda_rq_prepare earlier in the stream).
 * pp describes the whole call (n_heads: all of its heads). pdl: the kernels
 * as programmatic dependent launches (common.cuh). */
cudaError_t tkv_cuda_rqs_clear(const struct tkv_cuda_rqs_work *w, uint32_t P, bool pdl, cudaStream_t s);
cudaError_t tkv_cuda_rqs_run(const struct tkv_cuda_rqs_params *pp, const struct tkv_cuda_rqs_heads *hs, uint32_t h0,
                             uint32_t n, const struct tkv_cuda_rqs_work *w, bool pdl, cudaStream_t s);

#endif /* TKV_GPU_RABITQ_SELECT_CUH */
