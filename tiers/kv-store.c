/* kv-store.c -- see kv-store.h. */
#include "kv-store.h"

#include <stdlib.h>

struct tkv_kvs {
    struct tkv_kvs_params p;
    struct tkv_backend *be;
    uint32_t max_blocks;          /* per head                                  */
    uint32_t n_blocks;            /* block indices with storage                */
    uint32_t length;              /* valid tokens                              */
    void **slabs;                 /* [max_blocks]: storage of block index b for
                                     all heads: [layer][head][K|V][B][hd] f16  */
    struct tkv_kv_block_ref *refs;/* [layer][head][max_blocks]                 */
};

static size_t kvs_half_block(const struct tkv_kvs *s) { return (size_t)s->p.block_tokens * s->p.head_dim; }

static struct tkv_kv_block_ref *kvs_refs(const struct tkv_kvs *s, uint32_t layer, uint32_t head)
{
    return s->refs + ((size_t)layer * s->p.n_head_kv + head) * s->max_blocks;
}

tkv_status tkv_kvs_init(const struct tkv_kvs_params *p, struct tkv_backend *backend, struct tkv_kvs **out)
{
    *out = NULL;
    if (p->n_layer == 0 || p->n_head_kv == 0 || p->head_dim == 0 || p->block_tokens == 0 || p->max_tokens == 0)
        return tkv_err(TKV_ERR_INVALID_ARG, "kv-store: zero dimension in parameters");
    if (p->block_tokens > 256)
        return tkv_err(TKV_ERR_INVALID_ARG, "kv-store: block of %u tokens is too large (max 256)", p->block_tokens);
    struct tkv_kvs *s = calloc(1, sizeof *s);
    if (!s)
        return tkv_err(TKV_ERR_NOMEM, "kv-store: out of memory");
    s->p = *p;
    s->be = backend;
    s->max_blocks = (p->max_tokens + p->block_tokens - 1) / p->block_tokens;
    s->slabs = calloc(s->max_blocks, sizeof *s->slabs);
    s->refs = calloc((size_t)p->n_layer * p->n_head_kv * s->max_blocks, sizeof *s->refs);
    if (!s->slabs || !s->refs) {
        tkv_kvs_free(s);
        return tkv_err(TKV_ERR_NOMEM, "kv-store: out of memory for the page table");
    }
    *out = s;
    return TKV_OK;
}

void tkv_kvs_free(struct tkv_kvs *s)
{
    if (!s)
        return;
    if (s->slabs)
        for (uint32_t b = 0; b < s->n_blocks; b++)
            s->be->ops->release(s->be, s->slabs[b]);
    free(s->slabs);
    free(s->refs);
    free(s);
}

tkv_status tkv_kvs_reserve(struct tkv_kvs *s, uint32_t n_tokens)
{
    if (n_tokens > s->p.max_tokens)
        return tkv_err(TKV_ERR_CONTEXT_FULL, "kv-store: %u tokens exceed the context of %u", n_tokens, s->p.max_tokens);
    const uint32_t need = (n_tokens + s->p.block_tokens - 1) / s->p.block_tokens;
    const size_t half = kvs_half_block(s);
    const size_t slab_bytes = (size_t)s->p.n_layer * s->p.n_head_kv * 2 * half * sizeof(uint16_t);
    while (s->n_blocks < need) {
        const uint32_t b = s->n_blocks;
        void *slab;
        tkv_status st = s->be->ops->alloc(s->be, slab_bytes, &slab);
        if (st != TKV_OK)
            return tkv_err_wrap(st, "kv-store: block %u of %u", b, need);
        s->slabs[b] = slab;
        for (uint32_t l = 0; l < s->p.n_layer; l++)
            for (uint32_t h = 0; h < s->p.n_head_kv; h++) {
                uint16_t *k = (uint16_t *)slab + ((size_t)l * s->p.n_head_kv + h) * 2 * half;
                kvs_refs(s, l, h)[b] = (struct tkv_kv_block_ref){
                    .k = k, .v = k + half, .pos0 = (int32_t)(b * s->p.block_tokens), .n = 0};
            }
        s->n_blocks++;
    }
    return TKV_OK;
}

void tkv_kvs_set_length(struct tkv_kvs *s, uint32_t n_tokens)
{
    const uint32_t B = s->p.block_tokens;
    const uint32_t lo = TKV_MIN(s->length, n_tokens) / B, hi = TKV_MIN((TKV_MAX(s->length, n_tokens) + B - 1) / B, s->n_blocks);
    for (uint32_t l = 0; l < s->p.n_layer; l++)
        for (uint32_t h = 0; h < s->p.n_head_kv; h++) {
            struct tkv_kv_block_ref *r = kvs_refs(s, l, h);
            for (uint32_t b = lo; b < hi; b++) {
                const uint32_t start = b * B;
                r[b].n = n_tokens <= start ? 0 : TKV_MIN(B, n_tokens - start);
            }
        }
    s->length = n_tokens;
}

uint32_t tkv_kvs_length(const struct tkv_kvs *s) { return s->length; }

struct tkv_kv_head_view tkv_kvs_view(const struct tkv_kvs *s, uint32_t layer, uint32_t head)
{
    const uint32_t B = s->p.block_tokens;
    return (struct tkv_kv_head_view){.blocks = kvs_refs(s, layer, head), .n_blocks = (s->length + B - 1) / B};
}

void tkv_kvs_locate(const struct tkv_kvs *s, uint32_t layer, uint32_t head, uint32_t pos, uint16_t **k, uint16_t **v)
{
    const uint32_t B = s->p.block_tokens;
    const struct tkv_kv_block_ref *r = &kvs_refs(s, layer, head)[pos / B];
    *k = r->k + (size_t)(pos % B) * s->p.head_dim;
    *v = r->v + (size_t)(pos % B) * s->p.head_dim;
}

uint32_t tkv_kvs_block_tokens(const struct tkv_kvs *s) { return s->p.block_tokens; }

uint64_t tkv_kvs_bytes_allocated(const struct tkv_kvs *s)
{
    return (uint64_t)s->n_blocks * s->p.n_layer * s->p.n_head_kv * 2 * kvs_half_block(s) * sizeof(uint16_t);
}
