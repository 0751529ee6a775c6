/* kv-table.c -- the argument check every backend's kv_table op shares and
 * the op's reference on host memory (the contract is in backend.h). */
#include "backend.h"

#include <string.h>

tkv_status tkv_kv_table_check(const struct tkv_kv_table_args *a)
{
    if (!a)
        return tkv_err(TKV_ERR_INVALID_ARG, "kv_table: NULL argument");
    if (a->n_heads == 0)
        return TKV_OK;
    if (!a->sel_n || !a->ptab || !a->counts || (a->cap && (!a->refs || !a->miss)))
        return tkv_err(TKV_ERR_INVALID_ARG, "kv_table: NULL sel_n, ptab, counts, refs or miss");
    if (a->block_tokens == 0 || a->head_dim == 0 || a->head_dim > 1024)
        return tkv_err(TKV_ERR_INVALID_ARG, "kv_table: block of %u tokens, head_dim %u", a->block_tokens,
                       a->head_dim);
    if (a->n_past > INT32_MAX)
        return tkv_err(TKV_ERR_INVALID_ARG, "kv_table: n_past %u out of range", a->n_past);
    const uint32_t nb = (uint32_t)(((uint64_t)a->n_past + a->block_tokens - 1) / a->block_tokens);
    if (a->ptab_stride < nb)
        return tkv_err(TKV_ERR_INVALID_ARG, "kv_table: ptab_stride %u below the %u blocks of %u tokens",
                       a->ptab_stride, nb, a->n_past);
    if (a->marks && a->mark_words < (nb + 31) / 32)
        return tkv_err(TKV_ERR_INVALID_ARG, "kv_table: mark_words %u below the %u words of %u blocks", a->mark_words,
                       (nb + 31) / 32, nb);
    for (uint32_t h = 0; h < a->n_heads; h++) {
        const uint32_t n = a->sel_n[h];
        if (n > a->n_past || (n > 0 && (!a->bitmap || (n + 31) / 32 > a->words)))
            return tkv_err(TKV_ERR_INVALID_ARG, "kv_table: head %u: sel_n %u past n_past %u or a bitmap row of %u words",
                           h, n, a->n_past, a->bitmap ? a->words : 0);
    }
    return TKV_OK;
}

/* Whether head h reads position p (p < n_past). */
static bool reads(const struct tkv_kv_table_args *a, uint32_t h, uint32_t p)
{
    if (p >= a->sel_n[h])
        return true; /* the tail */
    return (a->bitmap[(size_t)h * a->words + p / 32] >> (p % 32)) & 1u;
}

tkv_status tkv_kv_table_ref(const struct tkv_kv_table_args *a)
{
    TKV_TRY(tkv_kv_table_check(a));
    const uint32_t B = a->block_tokens, hd = a->head_dim;
    const uint32_t nb = (uint32_t)(((uint64_t)a->n_past + B - 1) / B);
    for (uint32_t h = 0; h < a->n_heads; h++) {
        struct tkv_kv_block_ref *refs = a->refs ? a->refs + (size_t)h * a->cap : NULL;
        struct tkv_kv_block_ref *miss = a->miss ? a->miss + (size_t)h * a->cap : NULL;
        uint32_t *marks = a->marks ? a->marks + (size_t)h * a->mark_words : NULL;
        if (marks)
            memset(marks, 0, (nb + 31) / 32 * sizeof *marks);
        uint32_t nr = 0, nm = 0, np = 0, nt = 0;
        for (uint32_t b = 0; b < nb; b++) {
            const uint32_t slices = nr + nm;
            const uint32_t lo = b * B, hi = TKV_MIN(lo + B, a->n_past);
            /* the entry is an address in backend memory: offset as an
             * integer, never read through */
            const uint64_t e = a->ptab[(size_t)h * a->ptab_stride + b];
            for (uint32_t p = lo; p < hi;) {
                if (!reads(a, h, p)) {
                    p++;
                    continue;
                }
                const uint32_t start = p;
                while (p < hi && reads(a, h, p))
                    p++;
                struct tkv_kv_block_ref r = {.pos0 = (int32_t)start, .n = p - start};
                np += r.n;
                if (e) {
                    const uint64_t k = e + (uint64_t)(start - lo) * hd * sizeof(uint16_t);
                    r.k = (uint16_t *)(uintptr_t)k;
                    r.v = (uint16_t *)(uintptr_t)(k + (uint64_t)B * hd * sizeof(uint16_t));
                    if (nr < a->cap)
                        refs[nr] = r;
                    nr++;
                } else {
                    if (nm < a->cap)
                        miss[nm] = r;
                    nm++;
                }
            }
            if (nr + nm > slices) { /* the block is touched */
                nt++;
                if (marks)
                    marks[b / 32] |= 1u << (b % 32);
            }
        }
        a->counts[4 * h] = nr;
        a->counts[4 * h + 1] = nm;
        a->counts[4 * h + 2] = np;
        a->counts[4 * h + 3] = nt;
    }
    return TKV_OK;
}
