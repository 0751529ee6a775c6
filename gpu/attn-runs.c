/*
 * attn-runs.c -- a decode call's view as strided runs (attn-runs.h): plain
 * C on the host, so that tests compare the stretches with the per-block
 * walk without a GPU.
 */
#include "attn-runs.h"

#include <string.h>

/* The run being built for one KV head. */
struct run_builder {
    struct tkv_cuda_attn_runs *r;
    struct tkv_cuda_kv_run *cur; /* NULL: none open */
    uint32_t nblk;               /* blocks in cur   */
    uint32_t nr, chunk, chunks;  /* runs used; keys per chunk; the head's chunks so far */
};

static void run_close(struct run_builder *b)
{
    if (b->cur) {
        b->cur->c0 = b->chunks;
        b->chunks += (b->cur->n + b->chunk - 1) / b->chunk;
    }
    b->cur = NULL;
}

/* Appends block (k, v, pos0, n) (16-byte aligned, n > 0) to the open run if
 * it continues it (next position, same stride as the run's blocks so far,
 * every block before it full, blocks a multiple of the chunk), else opens a
 * run; false when the runs are used up. */
static bool run_add(struct run_builder *b, const uint16_t *k, const uint16_t *v, int32_t pos0, uint32_t n)
{
    struct tkv_cuda_kv_run *c = b->cur;
    if (c && c->n == b->nblk * c->bsz && (int64_t)pos0 == (int64_t)c->pos0 + c->n && n <= c->bsz &&
        c->bsz % b->chunk == 0 && (uint64_t)c->n + n <= UINT32_MAX) {
        /* element distances (the addresses are 16-byte aligned, so even) */
        const int64_t dk = ((int64_t)(intptr_t)k - (int64_t)(intptr_t)c->k) / 2;
        const int64_t dv = ((int64_t)(intptr_t)v - (int64_t)(intptr_t)c->v) / 2;
        if (b->nblk == 1 || (dk == (int64_t)b->nblk * c->kstride && dv == (int64_t)b->nblk * c->vstride)) {
            if (b->nblk == 1) {
                c->kstride = dk;
                c->vstride = dv;
            }
            b->nblk++;
            c->n += n;
            return true;
        }
    }
    run_close(b);
    if (b->nr == TKV_ATTN_RUNS_MAX)
        return false;
    c = b->cur = &b->r->runs[b->nr++];
    c->k = k;
    c->v = v;
    c->kstride = c->vstride = 0;
    c->pos0 = pos0;
    c->n = c->bsz = n;
    b->nblk = 1;
    return true;
}

/* Adds `count` blocks of bsz rows, block j at k + j dk, v + j dv (elements)
 * and position pos0 + j bsz: what `count` calls of run_add would leave,
 * in one step where the run open after the first takes the rest at that
 * stride. */
static bool run_add_blocks(struct run_builder *b, const uint16_t *k, const uint16_t *v, int32_t pos0, uint32_t bsz,
                           uint32_t count, int64_t dk, int64_t dv)
{
    if (!run_add(b, k, v, pos0, bsz))
        return false;
    struct tkv_cuda_kv_run *c = b->cur;
    if (c->bsz == bsz && bsz % b->chunk == 0 && (b->nblk == 1 || (c->kstride == dk && c->vstride == dv)) &&
        (uint64_t)c->n + (uint64_t)(count - 1) * bsz <= UINT32_MAX) {
        if (b->nblk == 1) {
            c->kstride = dk;
            c->vstride = dv;
        }
        b->nblk += count - 1;
        c->n += (count - 1) * bsz;
        return true;
    }
    for (uint32_t j = 1; j < count; j++)
        if (!run_add(b, k + j * dk, v + j * dv, pos0 + (int32_t)(j * bsz), bsz))
            return false;
    return true;
}

/* Whether ref y continues the n rows at k, v, pos0 in memory (K and V
 * rows, positions): the two are joined into one block. */
static bool ref_continues(const uint16_t *k, const uint16_t *v, int32_t pos0, uint32_t n,
                          const struct tkv_kv_block_ref *y, size_t hd)
{
    return y->k == k + (size_t)n * hd && y->v == v + (size_t)n * hd && (int64_t)y->pos0 == (int64_t)pos0 + n;
}

/* The end of the stretch of refs from i on (refs[i] whole and visible):
 * whole visible blocks of refs[i]'s rows at one K and one V stride,
 * positions following on, none continuing another in memory, and the ref
 * after the stretch not continuing its last -- so that run_add_blocks
 * leaves what the per-block walk would. i + 1 where there is none of 2.
 * The KV store's home slots lay a resident head out so (docs/kv-layout.md):
 * one pass of four compares a block. */
static uint32_t stretch_end(const struct tkv_kv_block_ref *refs, uint32_t i, uint32_t nb, int32_t pos_max, size_t hd)
{
    const struct tkv_kv_block_ref *x = &refs[i];
    const uint32_t bsz = x->n;
    if (i + 1 >= nb)
        return i + 1;
    const int64_t dk = refs[i + 1].k - x->k, dv = refs[i + 1].v - x->v;
    if ((dk * 2) % 16 || (dv * 2) % 16 || (dk == (int64_t)bsz * (int64_t)hd && dv == (int64_t)bsz * (int64_t)hd))
        return i + 1;
    uint32_t j = i + 1;
    const uint16_t *k = x->k + dk, *v = x->v + dv;
    int64_t p = (int64_t)x->pos0 + bsz;
    while (j < nb && refs[j].k == k && refs[j].v == v && refs[j].pos0 == p && refs[j].n == bsz &&
           p + bsz - 1 <= pos_max)
        j++, k += dk, v += dv, p += bsz;
    /* the per-block walk would join the next ref with rows to the last */
    uint32_t nx = j;
    while (nx < nb && refs[nx].n == 0)
        nx++;
    const struct tkv_kv_block_ref *last = &refs[j - 1];
    if (nx < nb && refs[nx].pos0 <= pos_max && ref_continues(last->k, last->v, last->pos0, bsz, &refs[nx], hd))
        j--;
    return j;
}

/* attn-runs.h */
bool tkv_attn_runs_build(struct tkv_cuda_attn_runs *r, const struct tkv_attn_args *a, uint32_t chunk, bool per_block,
                         uint32_t *max_chunks)
{
    if (a->n_head_kv > TKV_ATTN_RUNS_HEADS || a->n_q > sizeof r->q_pos / sizeof r->q_pos[0] || a->head_dim % 8)
        return false;
    const int32_t pos_max = a->q_pos[a->n_q - 1]; /* non-decreasing */
    const size_t hd = a->head_dim;
    memcpy(r->q_pos, a->q_pos, (size_t)a->n_q * sizeof(int32_t));
    struct run_builder b = {r, NULL, 0, 0, chunk, 0};
    *max_chunks = 0;
    for (uint32_t g = 0; g < a->n_head_kv; g++) {
        r->run_off[g] = (uint16_t)b.nr;
        b.cur = NULL;
        b.chunks = 0;
        const struct tkv_kv_block_ref *refs = a->kv[g].blocks;
        const uint16_t *bk = NULL, *bv = NULL; /* the block being joined */
        int32_t bpos = 0;
        uint32_t bn = 0;
        const uint32_t nb = a->kv[g].n_blocks;
        for (uint32_t i = 0; i < nb; i++) {
            const struct tkv_kv_block_ref *x = &refs[i];
            if (x->n == 0)
                continue;
            if (x->pos0 > pos_max) /* in position order: none later is visible */
                break;
            if (((uintptr_t)x->k | (uintptr_t)x->v) % 16)
                return false;
            const uint32_t n = (int64_t)x->pos0 + x->n - 1 > pos_max ? (uint32_t)(pos_max - x->pos0 + 1) : x->n;
            if (bn && ref_continues(bk, bv, bpos, bn, x, hd) && (uint64_t)bn + n <= UINT32_MAX) {
                bn += n;
                continue;
            }
            if (bn && !run_add(&b, bk, bv, bpos, bn))
                return false;
            bn = 0;
            const uint32_t e = n == x->n && !per_block ? stretch_end(refs, i, nb, pos_max, hd) : i + 1;
            if (e > i + 1) { /* whole blocks at one stride (refs e - 1 and e - 2 are not n == 0) */
                if (!run_add_blocks(&b, x->k, x->v, x->pos0, n, e - i, refs[i + 1].k - x->k, refs[i + 1].v - x->v))
                    return false;
                i = e - 1;
                continue;
            }
            bk = x->k, bv = x->v, bpos = x->pos0, bn = n;
        }
        if (bn && !run_add(&b, bk, bv, bpos, bn))
            return false;
        run_close(&b);
        r->n_chunks[g] = b.chunks;
        *max_chunks = b.chunks > *max_chunks ? b.chunks : *max_chunks;
    }
    r->run_off[a->n_head_kv] = (uint16_t)b.nr;
    return true;
}
