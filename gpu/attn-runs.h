/*
 * attn-runs.h -- a decode call's view as strided runs: the decode kernel's
 * inline block table (attn-decode.cu), built on the host by attn-runs.c
 * (plain C, so that tests check it without a GPU).
 *
 * A view whose blocks are laid out regularly is described by a few runs
 * instead of one entry per block: run r of KV head g holds n keys, key i at
 * position pos0 + i, in row i % bsz of block i / bsz, whose K rows start at
 * k + (i / bsz) * kstride (elements; V likewise). Every block of a run but
 * the last holds bsz rows, and bsz is a multiple of the kernel's chunk
 * (tkv_cuda_attn_decode_chunk_keys) unless the run is one block, so a chunk
 * never straddles two blocks. The table travels in the launch's parameters
 * (a few KiB: no host-to-device copy, no event between streams). Runs of
 * head g are runs[run_off[g] .. run_off[g+1]); c0 numbers the run's first
 * chunk among the head's, n_chunks[g] counts them.
 */
#ifndef TKV_GPU_ATTN_RUNS_H
#define TKV_GPU_ATTN_RUNS_H

#include <stdbool.h>
#include <stdint.h>

#ifdef __cplusplus /* the .cu files */
extern "C" {
#endif
#include "../runtime/backend.h"

#define TKV_ATTN_RUNS_MAX 64u   /* runs of all heads together */
#define TKV_ATTN_RUNS_HEADS 32u /* KV heads                   */

struct tkv_cuda_kv_run {
    const uint16_t *k, *v;   /* row 0 of the run's first block            */
    int64_t kstride, vstride;/* elements from one block's row 0 to the next's */
    int32_t pos0;            /* position of key 0                          */
    uint32_t n;              /* keys                                       */
    uint32_t bsz;            /* rows per block (every block but the last)  */
    uint32_t c0;             /* chunks of the head before this run         */
};

struct tkv_cuda_attn_runs {
    int32_t q_pos[8];                        /* [n_q] (n_q <= 8 in decode)  */
    uint32_t n_chunks[TKV_ATTN_RUNS_HEADS];  /* [n_head_kv]                 */
    uint16_t run_off[TKV_ATTN_RUNS_HEADS + 2];/* [n_head_kv + 1]            */
    struct tkv_cuda_kv_run runs[TKV_ATTN_RUNS_MAX];
};

/* Describes a's view as runs into *r: refs of no rows and rows past the
 * last query's position left out, refs that continue each other in memory
 * (K and V rows and positions) joined into one block, each run cut in
 * chunks of `chunk` keys. A stretch of whole blocks at one stride (the KV
 * store's home slots lay a resident head out so: docs/kv-layout.md) is
 * taken in one pass; per_block walks every block instead (the reference:
 * the same runs). False: the view does not fit (too many runs or heads,
 * rows not 16-byte aligned, head_dim not a multiple of 8); *max_chunks:
 * the most chunks of one head. */
bool tkv_attn_runs_build(struct tkv_cuda_attn_runs *r, const struct tkv_attn_args *a, uint32_t chunk, bool per_block,
                         uint32_t *max_chunks);

#ifdef __cplusplus
}
#endif
#endif
