/*
 * gguf.c -- GGUF reader (mmap + full structural validation) and writer.
 *
 * The reader never trusts a count, length or offset before checking it
 * against the bytes that remain, and allocates only after such a check, so
 * memory use is bounded by a small multiple of the file size.
 */
#include "gguf.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "gguf.c reads little-endian GGUF with plain loads: port it before using a big-endian host"
#endif

#define GGUF_MAGIC         0x46554747u /* "GGUF" read as a little-endian u32 */
#define GGUF_DEFAULT_ALIGN 32u
#define GGUF_KEY_ALIGNMENT "general.alignment"

/* Smallest encodings, used to bound counts before allocating:
 * a KV is key length + type + a 1-byte value, a tensor info is name length +
 * n_dims + one ne + type + offset (names are never empty). */
#define GGUF_MIN_KV_BYTES     (8 + 4 + 1)
#define GGUF_MIN_TENSOR_BYTES (8 + 1 + 4 + 8 + 4 + 8)

/* How much of a hostile key or name goes into an error message. */
#define GGUF_MSG_NAME 80

// ---- type traits -----------------------------------------------------------

/* ref: ggml/src/ggml.c type_traits; ids 4, 5, 31-33 and 36-38 were removed. */
static const struct tkv_type_traits tkv_types[TKV_TYPE_COUNT] = {
    [0]  = {"F32",     1,   4,   true},
    [1]  = {"F16",     1,   2,   true},
    [2]  = {"Q4_0",    32,  18,  true},
    [3]  = {"Q4_1",    32,  20,  true},
    [6]  = {"Q5_0",    32,  22,  false},
    [7]  = {"Q5_1",    32,  24,  false},
    [8]  = {"Q8_0",    32,  34,  true},
    [9]  = {"Q8_1",    32,  36,  false},
    [10] = {"Q2_K",    256, 84,  false},
    [11] = {"Q3_K",    256, 110, false},
    [12] = {"Q4_K",    256, 144, true},
    [13] = {"Q5_K",    256, 176, false},
    [14] = {"Q6_K",    256, 210, true},
    [15] = {"Q8_K",    256, 292, false},
    [16] = {"IQ2_XXS", 256, 66,  false},
    [17] = {"IQ2_XS",  256, 74,  false},
    [18] = {"IQ3_XXS", 256, 98,  false},
    [19] = {"IQ1_S",   256, 50,  false},
    [20] = {"IQ4_NL",  32,  18,  false},
    [21] = {"IQ3_S",   256, 110, false},
    [22] = {"IQ2_S",   256, 82,  false},
    [23] = {"IQ4_XS",  256, 136, false},
    [24] = {"I8",      1,   1,   false},
    [25] = {"I16",     1,   2,   false},
    [26] = {"I32",     1,   4,   false},
    [27] = {"I64",     1,   8,   false},
    [28] = {"F64",     1,   8,   false},
    [29] = {"IQ1_M",   256, 56,  false},
    [30] = {"BF16",    1,   2,   true},
    [34] = {"TQ1_0",   256, 54,  false},
    [35] = {"TQ2_0",   256, 66,  false},
    [39] = {"MXFP4",   32,  17,  false},
};

const struct tkv_type_traits *tkv_type_traits(uint32_t type)
{
    if (type >= TKV_TYPE_COUNT || !tkv_types[type].name)
        return NULL;
    return &tkv_types[type];
}

const char *tkv_type_name(uint32_t type)
{
    static _Thread_local char buf[24];
    const struct tkv_type_traits *t = tkv_type_traits(type);
    if (t)
        return t->name;
    snprintf(buf, sizeof buf, "unknown(%u)", type);
    return buf;
}

/* Elements and bytes of a tensor; fails with `status` (FORMAT for the reader,
 * INVALID_ARG for the writer) naming the tensor, the message prefixed by who. */
static tkv_status tensor_size(const char *who, const char *name, uint32_t type, uint32_t n_dims, const int64_t *ne,
                              tkv_status status, uint64_t *n_elems, uint64_t *nbytes)
{
    const struct tkv_type_traits *t = tkv_type_traits(type);
    if (!t)
        return tkv_err(status, "%s: unknown type id %u in tensor %s", who, type, name);
    if (n_dims < 1 || n_dims > TKV_GGUF_MAX_DIMS)
        return tkv_err(status, "%s: tensor '%s': n_dims %u (must be 1..%d)", who, name, n_dims, TKV_GGUF_MAX_DIMS);
    uint64_t n = 1;
    for (uint32_t j = 0; j < n_dims; j++) {
        if (ne[j] < 1)
            return tkv_err(status, "%s: tensor '%s': ne[%u] = %lld (must be >= 1)", who, name, j, (long long)ne[j]);
        if (!tkv_mul_ok(n, (uint64_t)ne[j], &n) || n > INT64_MAX)
            return tkv_err(status, "%s: tensor '%s': element count overflows at ne[%u] = %lld", who, name, j,
                           (long long)ne[j]);
    }
    if (ne[0] % t->block_elems != 0)
        return tkv_err(status, "%s: tensor '%s': ne[0] = %lld is not a multiple of the %s block size %u", who, name,
                       (long long)ne[0], t->name, t->block_elems);
    /* (blocks per row * block bytes) * rows */
    uint64_t bytes;
    if (!tkv_mul_ok((uint64_t)ne[0] / t->block_elems, t->block_bytes, &bytes) ||
        !tkv_mul_ok(bytes, n / (uint64_t)ne[0], &bytes))
        return tkv_err(status, "%s: tensor '%s': byte size overflows", who, name);
    *n_elems = n;
    *nbytes = bytes;
    return TKV_OK;
}

// ---- reader: state -----------------------------------------------------------

struct tkv_gguf {
    const uint8_t *base;    /* the file image                               */
    uint64_t size;          /* bytes                                        */
    void    *map;           /* mmap'ed region to unmap, or NULL             */
    uint32_t version, alignment;
    uint64_t data_start;    /* absolute offset of the data section          */

    size_t n_kv;
    struct tkv_gguf_kv *kvs;            /* [n_kv] in file order              */
    uint64_t **str_offs;                /* [n_kv]: for string arrays, the file
                                           offset of each element's bytes;
                                           NULL for other kvs                 */
    const struct tkv_gguf_kv **kv_sorted; /* [n_kv] by key, for lookups      */

    size_t n_tensors;
    struct tkv_gguf_tensor *tensors;            /* [n_tensors] in file order */
    const struct tkv_gguf_tensor **t_sorted;    /* [n_tensors] by name       */
};

static const uint32_t vtype_size[TKV_GGUF_VTYPE_COUNT] = {
    [TKV_GGUF_U8] = 1, [TKV_GGUF_I8] = 1, [TKV_GGUF_U16] = 2, [TKV_GGUF_I16] = 2,
    [TKV_GGUF_U32] = 4, [TKV_GGUF_I32] = 4, [TKV_GGUF_F32] = 4, [TKV_GGUF_BOOL] = 1,
    [TKV_GGUF_STRING] = 0, [TKV_GGUF_ARRAY] = 0, [TKV_GGUF_U64] = 8, [TKV_GGUF_I64] = 8,
    [TKV_GGUF_F64] = 8,
};

static const char *vtype_name(uint32_t t)
{
    static const char *names[TKV_GGUF_VTYPE_COUNT] = {
        "UINT8", "INT8", "UINT16", "INT16", "UINT32", "INT32", "FLOAT32",
        "BOOL", "STRING", "ARRAY", "UINT64", "INT64", "FLOAT64",
    };
    return t < TKV_GGUF_VTYPE_COUNT ? names[t] : "unknown";
}

static bool vtype_is_int(uint32_t t)
{
    return t <= TKV_GGUF_I32 || t == TKV_GGUF_U64 || t == TKV_GGUF_I64;
}

static bool vtype_is_signed(uint32_t t)
{
    return t == TKV_GGUF_I8 || t == TKV_GGUF_I16 || t == TKV_GGUF_I32 || t == TKV_GGUF_I64;
}

/* Scalar of type t at p (unaligned) into kv->v. */
static void load_scalar(uint32_t t, const uint8_t *p, struct tkv_gguf_kv *kv)
{
    uint16_t u16; uint32_t u32; uint64_t u64; float f32; double f64;
    switch (t) {
    case TKV_GGUF_U8: case TKV_GGUF_BOOL: kv->v.u = *p; break;
    case TKV_GGUF_I8:  kv->v.i = (int8_t)*p; break;
    case TKV_GGUF_U16: memcpy(&u16, p, 2); kv->v.u = u16; break;
    case TKV_GGUF_I16: memcpy(&u16, p, 2); kv->v.i = (int16_t)u16; break;
    case TKV_GGUF_U32: memcpy(&u32, p, 4); kv->v.u = u32; break;
    case TKV_GGUF_I32: memcpy(&u32, p, 4); kv->v.i = (int32_t)u32; break;
    case TKV_GGUF_U64: memcpy(&u64, p, 8); kv->v.u = u64; break;
    case TKV_GGUF_I64: memcpy(&u64, p, 8); kv->v.i = (int64_t)u64; break;
    case TKV_GGUF_F32: memcpy(&f32, p, 4); kv->v.f = f32; break;
    case TKV_GGUF_F64: memcpy(&f64, p, 8); kv->v.f = f64; break;
    default: break;
    }
}

// ---- reader: parsing ---------------------------------------------------------

struct cursor {
    const uint8_t *base;
    uint64_t size, off;
};

static uint64_t cur_left(const struct cursor *c) { return c->size - c->off; }

/* The next n bytes, or NULL (cursor unchanged) when fewer remain. */
static const uint8_t *cur_take(struct cursor *c, uint64_t n)
{
    if (n > cur_left(c))
        return NULL;
    const uint8_t *p = c->base + c->off;
    c->off += n;
    return p;
}

static tkv_status truncated(const struct cursor *c, uint64_t need, const char *what, const char *where)
{
    return tkv_err(TKV_ERR_FORMAT, "gguf: truncated file: %s of %s needs %llu bytes at offset %llu, %llu left",
                   what, where, (unsigned long long)need, (unsigned long long)c->off,
                   (unsigned long long)cur_left(c));
}

static tkv_status read_u32(struct cursor *c, uint32_t *v, const char *what, const char *where)
{
    const uint8_t *p = cur_take(c, 4);
    if (!p)
        return truncated(c, 4, what, where);
    memcpy(v, p, 4);
    return TKV_OK;
}

static tkv_status read_u64(struct cursor *c, uint64_t *v, const char *what, const char *where)
{
    const uint8_t *p = cur_take(c, 8);
    if (!p)
        return truncated(c, 8, what, where);
    memcpy(v, p, 8);
    return TKV_OK;
}

/* A gguf string (u64 length + bytes) pointing into the image. */
static tkv_status read_str(struct cursor *c, struct tkv_gguf_str *s, const char *what, const char *where)
{
    uint64_t at = c->off, len = 0;
    TKV_TRY(read_u64(c, &len, what, where));
    if (len > cur_left(c))
        return tkv_err(TKV_ERR_FORMAT, "gguf: %s of %s at offset %llu has length %llu, past the end of the file "
                       "(%llu bytes left)", what, where, (unsigned long long)at, (unsigned long long)len,
                       (unsigned long long)cur_left(c));
    s->ptr = (const char *)cur_take(c, len);
    s->len = len;
    return TKV_OK;
}

/* Parses the value of kv (whose key and type are set) at the cursor. */
static tkv_status read_value(struct cursor *c, struct tkv_gguf *g, size_t idx, const char *where)
{
    struct tkv_gguf_kv *kv = &g->kvs[idx];
    uint64_t at = c->off;
    if (kv->type >= TKV_GGUF_VTYPE_COUNT)
        return tkv_err(TKV_ERR_FORMAT, "gguf: %s: unknown value type %u at offset %llu", where, kv->type,
                       (unsigned long long)(at - 4));
    if (kv->type == TKV_GGUF_STRING)
        return read_str(c, &kv->v.s, "string value", where);
    if (kv->type != TKV_GGUF_ARRAY) {
        const uint8_t *p = cur_take(c, vtype_size[kv->type]);
        if (!p)
            return truncated(c, vtype_size[kv->type], "value", where);
        if (kv->type == TKV_GGUF_BOOL && *p > 1)
            return tkv_err(TKV_ERR_FORMAT, "gguf: %s: BOOL value %u at offset %llu (must be 0 or 1)", where, *p,
                           (unsigned long long)at);
        load_scalar(kv->type, p, kv);
        return TKV_OK;
    }

    uint32_t et = 0;
    uint64_t n = 0;
    TKV_TRY(read_u32(c, &et, "array element type", where));
    if (et == TKV_GGUF_ARRAY)
        return tkv_err(TKV_ERR_FORMAT, "gguf: %s: nested arrays are not supported (offset %llu)", where,
                       (unsigned long long)at);
    if (et >= TKV_GGUF_VTYPE_COUNT)
        return tkv_err(TKV_ERR_FORMAT, "gguf: %s: unknown array element type %u at offset %llu", where, et,
                       (unsigned long long)at);
    TKV_TRY(read_u64(c, &n, "array length", where));
    uint64_t min_bytes;
    uint64_t esize = et == TKV_GGUF_STRING ? 8 : vtype_size[et];
    if (!tkv_mul_ok(n, esize, &min_bytes) || min_bytes > cur_left(c))
        return tkv_err(TKV_ERR_FORMAT, "gguf: %s: array of %llu %s elements at offset %llu does not fit in the "
                       "%llu bytes left", where, (unsigned long long)n, vtype_name(et),
                       (unsigned long long)at, (unsigned long long)cur_left(c));
    kv->v.arr.type = et;
    kv->v.arr.n = n;
    kv->v.arr.data = c->base + c->off;
    if (et == TKV_GGUF_STRING) {
        /* n <= bytes left / 8, so this allocation is bounded by the file size */
        uint64_t *offs = malloc(n ? n * sizeof *offs : 1);
        if (!offs)
            return tkv_err(TKV_ERR_NOMEM, "gguf: %s: no memory for %llu string offsets", where,
                           (unsigned long long)n);
        g->str_offs[idx] = offs;
        for (uint64_t i = 0; i < n; i++) {
            struct tkv_gguf_str s;
            char what[48];
            snprintf(what, sizeof what, "element %llu", (unsigned long long)i);
            TKV_TRY(read_str(c, &s, what, where));
            offs[i] = (uint64_t)((const uint8_t *)s.ptr - c->base);
        }
        return TKV_OK;
    }
    const uint8_t *p = cur_take(c, min_bytes);
    if (et == TKV_GGUF_BOOL)
        for (uint64_t i = 0; i < n; i++)
            if (p[i] > 1)
                return tkv_err(TKV_ERR_FORMAT, "gguf: %s: BOOL element %llu = %u at offset %llu (must be 0 or 1)",
                               where, (unsigned long long)i, p[i], (unsigned long long)(p - c->base + i));
    return TKV_OK;
}

static int cmp_kv_key(const void *a, const void *b)
{
    const struct tkv_gguf_kv *x = *(const struct tkv_gguf_kv *const *)a, *y = *(const struct tkv_gguf_kv *const *)b;
    int r = memcmp(x->key.ptr, y->key.ptr, TKV_MIN(x->key.len, y->key.len));
    if (r)
        return r;
    return (x->key.len > y->key.len) - (x->key.len < y->key.len);
}

static int cmp_tensor_name(const void *a, const void *b)
{
    return strcmp((*(const struct tkv_gguf_tensor *const *)a)->name, (*(const struct tkv_gguf_tensor *const *)b)->name);
}

static int cmp_tensor_offset(const void *a, const void *b)
{
    uint64_t x = (*(const struct tkv_gguf_tensor *const *)a)->file_offset;
    uint64_t y = (*(const struct tkv_gguf_tensor *const *)b)->file_offset;
    return (x > y) - (x < y);
}

static tkv_status parse_kvs(struct cursor *c, struct tkv_gguf *g)
{
    for (size_t i = 0; i < g->n_kv; i++) {
        struct tkv_gguf_kv *kv = &g->kvs[i];
        char where[GGUF_MSG_NAME + 32];
        snprintf(where, sizeof where, "kv #%zu", i);
        uint64_t at = c->off;
        TKV_TRY(read_str(c, &kv->key, "key", where));
        if (kv->key.len == 0)
            return tkv_err(TKV_ERR_FORMAT, "gguf: empty key (kv #%zu at offset %llu)", i, (unsigned long long)at);
        snprintf(where, sizeof where, "key '%.*s'", (int)TKV_MIN(kv->key.len, GGUF_MSG_NAME), kv->key.ptr);
        TKV_TRY(read_u32(c, &kv->type, "value type", where));
        TKV_TRY(read_value(c, g, i, where));
    }
    if (g->n_kv) {
        g->kv_sorted = malloc(g->n_kv * sizeof *g->kv_sorted);
        if (!g->kv_sorted)
            return tkv_err(TKV_ERR_NOMEM, "gguf: no memory for the key index");
        for (size_t i = 0; i < g->n_kv; i++)
            g->kv_sorted[i] = &g->kvs[i];
        qsort(g->kv_sorted, g->n_kv, sizeof *g->kv_sorted, cmp_kv_key);
        for (size_t i = 1; i < g->n_kv; i++)
            if (cmp_kv_key(&g->kv_sorted[i - 1], &g->kv_sorted[i]) == 0)
                return tkv_err(TKV_ERR_FORMAT, "gguf: duplicate key '%.*s'",
                               (int)TKV_MIN(g->kv_sorted[i]->key.len, GGUF_MSG_NAME), g->kv_sorted[i]->key.ptr);
    }

    const struct tkv_gguf_kv *a = tkv_gguf_find_kv(g, GGUF_KEY_ALIGNMENT);
    g->alignment = GGUF_DEFAULT_ALIGN;
    if (a) {
        if (a->type != TKV_GGUF_U32)
            return tkv_err(TKV_ERR_FORMAT, "gguf: key '%s' must be UINT32, not %s", GGUF_KEY_ALIGNMENT,
                           vtype_name(a->type));
        uint64_t v = a->v.u;
        if (v == 0 || (v & (v - 1)) || v % 8)
            return tkv_err(TKV_ERR_FORMAT, "gguf: key '%s' = %llu must be a power of two and a multiple of 8",
                           GGUF_KEY_ALIGNMENT, (unsigned long long)v);
        g->alignment = (uint32_t)v;
    }
    return TKV_OK;
}

static tkv_status parse_tensor_info(struct cursor *c, struct tkv_gguf_tensor *t, size_t i)
{
    char where[GGUF_MSG_NAME + 32];
    snprintf(where, sizeof where, "tensor info #%zu", i);
    uint64_t at = c->off;
    struct tkv_gguf_str name;
    TKV_TRY(read_str(c, &name, "name", where));
    if (name.len == 0)
        return tkv_err(TKV_ERR_FORMAT, "gguf: empty tensor name (tensor info #%zu at offset %llu)", i,
                       (unsigned long long)at);
    if (name.len > TKV_GGUF_MAX_NAME)
        return tkv_err(TKV_ERR_FORMAT, "gguf: tensor name '%.*s' at offset %llu is %llu bytes (at most %d)",
                       (int)TKV_MIN(name.len, GGUF_MSG_NAME), name.ptr, (unsigned long long)at,
                       (unsigned long long)name.len, TKV_GGUF_MAX_NAME);
    if (memchr(name.ptr, 0, name.len))
        return tkv_err(TKV_ERR_FORMAT, "gguf: tensor name '%s' at offset %llu contains a NUL byte", name.ptr,
                       (unsigned long long)at);
    memcpy(t->name, name.ptr, name.len);
    t->name[name.len] = '\0';
    snprintf(where, sizeof where, "tensor '%s'", t->name);

    TKV_TRY(read_u32(c, &t->n_dims, "n_dims", where));
    if (t->n_dims < 1 || t->n_dims > TKV_GGUF_MAX_DIMS)
        return tkv_err(TKV_ERR_FORMAT, "gguf: tensor '%s': n_dims %u at offset %llu (must be 1..%d)", t->name,
                       t->n_dims, (unsigned long long)(c->off - 4), TKV_GGUF_MAX_DIMS);
    for (uint32_t j = 0; j < TKV_GGUF_MAX_DIMS; j++) {
        uint64_t v = 1;
        if (j < t->n_dims)
            TKV_TRY(read_u64(c, &v, "ne", where));
        t->ne[j] = (int64_t)v;
    }
    TKV_TRY(read_u32(c, &t->type, "type", where));
    TKV_TRY(read_u64(c, &t->file_offset, "offset", where)); /* relative until the data start is known */
    return tensor_size("gguf", t->name, t->type, t->n_dims, t->ne, TKV_ERR_FORMAT, &t->n_elems, &t->nbytes);
}

/* Places tensors in the data section and checks names, alignment, bounds
 * and overlaps. */
static tkv_status check_tensors(struct tkv_gguf *g)
{
    size_t n = g->n_tensors;
    if (!n)
        return TKV_OK;
    g->t_sorted = malloc(n * sizeof *g->t_sorted);
    if (!g->t_sorted)
        return tkv_err(TKV_ERR_NOMEM, "gguf: no memory for the tensor index");
    for (size_t i = 0; i < n; i++)
        g->t_sorted[i] = &g->tensors[i];
    qsort(g->t_sorted, n, sizeof *g->t_sorted, cmp_tensor_name);
    for (size_t i = 1; i < n; i++)
        if (strcmp(g->t_sorted[i - 1]->name, g->t_sorted[i]->name) == 0)
            return tkv_err(TKV_ERR_FORMAT, "gguf: duplicate tensor name '%s'", g->t_sorted[i]->name);

    for (size_t i = 0; i < n; i++) {
        struct tkv_gguf_tensor *t = &g->tensors[i];
        uint64_t rel = t->file_offset, start, end;
        if (rel % g->alignment)
            return tkv_err(TKV_ERR_FORMAT, "gguf: tensor '%s': offset %llu is not a multiple of the alignment %u",
                           t->name, (unsigned long long)rel, g->alignment);
        if (!tkv_add_ok(g->data_start, rel, &start) || !tkv_add_ok(start, t->nbytes, &end) || end > g->size)
            return tkv_err(TKV_ERR_FORMAT, "gguf: tensor '%s': %llu bytes at offset %llu of the data section "
                           "(which starts at %llu) run past the end of the file (%llu bytes)", t->name,
                           (unsigned long long)t->nbytes, (unsigned long long)rel,
                           (unsigned long long)g->data_start, (unsigned long long)g->size);
        t->file_offset = start;
        t->data = g->base + start;
    }

    /* Overlaps, found by sorting a scratch copy of the index by offset. */
    const struct tkv_gguf_tensor **by_off = malloc(n * sizeof *by_off);
    if (!by_off)
        return tkv_err(TKV_ERR_NOMEM, "gguf: no memory for the overlap check");
    memcpy(by_off, g->t_sorted, n * sizeof *by_off);
    qsort(by_off, n, sizeof *by_off, cmp_tensor_offset);
    tkv_status st = TKV_OK;
    for (size_t i = 1; i < n && st == TKV_OK; i++) {
        const struct tkv_gguf_tensor *p = by_off[i - 1], *q = by_off[i];
        if (p->file_offset + p->nbytes > q->file_offset)
            st = tkv_err(TKV_ERR_FORMAT, "gguf: tensors '%s' [%llu, %llu) and '%s' [%llu, %llu) overlap", p->name,
                         (unsigned long long)p->file_offset, (unsigned long long)(p->file_offset + p->nbytes),
                         q->name, (unsigned long long)q->file_offset,
                         (unsigned long long)(q->file_offset + q->nbytes));
    }
    free(by_off);
    return st;
}

static tkv_status parse(struct tkv_gguf *g)
{
    struct cursor c = {g->base, g->size, 0};
    uint32_t magic = 0;
    uint64_t n_tensors = 0, n_kv = 0;
    TKV_TRY(read_u32(&c, &magic, "magic", "header"));
    if (magic != GGUF_MAGIC)
        return tkv_err(TKV_ERR_FORMAT, "gguf: bad magic 0x%08x at offset 0 (not a GGUF file)", magic);
    TKV_TRY(read_u32(&c, &g->version, "version", "header"));
    if (g->version == 0x02000000u || g->version == 0x03000000u)
        return tkv_err(TKV_ERR_UNSUPPORTED, "gguf: big-endian GGUF files are not supported");
    if (g->version != 2 && g->version != 3)
        return tkv_err(TKV_ERR_FORMAT, "gguf: unsupported version %u at offset 4 (need 2 or 3)", g->version);
    TKV_TRY(read_u64(&c, &n_tensors, "tensor_count", "header"));
    TKV_TRY(read_u64(&c, &n_kv, "kv_count", "header"));

    uint64_t min_t, min_kv, min_all;
    if (!tkv_mul_ok(n_tensors, GGUF_MIN_TENSOR_BYTES, &min_t) || !tkv_mul_ok(n_kv, GGUF_MIN_KV_BYTES, &min_kv) ||
        !tkv_add_ok(min_t, min_kv, &min_all) || min_all > cur_left(&c))
        return tkv_err(TKV_ERR_FORMAT, "gguf: header: tensor_count %llu and kv_count %llu cannot fit in the %llu "
                       "bytes after the header", (unsigned long long)n_tensors, (unsigned long long)n_kv,
                       (unsigned long long)cur_left(&c));

    g->n_kv = (size_t)n_kv;
    g->n_tensors = (size_t)n_tensors;
    if (n_kv) {
        g->kvs = calloc(n_kv, sizeof *g->kvs);
        g->str_offs = calloc(n_kv, sizeof *g->str_offs);
        if (!g->kvs || !g->str_offs)
            return tkv_err(TKV_ERR_NOMEM, "gguf: no memory for %llu kvs", (unsigned long long)n_kv);
    }
    if (n_tensors) {
        g->tensors = calloc(n_tensors, sizeof *g->tensors);
        if (!g->tensors)
            return tkv_err(TKV_ERR_NOMEM, "gguf: no memory for %llu tensors", (unsigned long long)n_tensors);
    }

    TKV_TRY(parse_kvs(&c, g));
    for (size_t i = 0; i < g->n_tensors; i++)
        TKV_TRY(parse_tensor_info(&c, &g->tensors[i], i));
    g->data_start = tkv_align_up(c.off, g->alignment); /* c.off <= size and alignment < 2^32: no overflow */
    return check_tensors(g);
}

// ---- reader: public ----------------------------------------------------------

void tkv_gguf_close(tkv_gguf *g)
{
    if (!g)
        return;
    if (g->str_offs)
        for (size_t i = 0; i < g->n_kv; i++)
            free(g->str_offs[i]);
    free(g->str_offs);
    free(g->kvs);
    free(g->kv_sorted);
    free(g->tensors);
    free(g->t_sorted);
    if (g->map)
        munmap(g->map, g->size);
    free(g);
}

/* Takes ownership of map (when non-NULL) even on failure. */
static tkv_status open_image(const void *data, size_t size, void *map, tkv_gguf **out)
{
    tkv_gguf *g = calloc(1, sizeof *g);
    if (!g) {
        if (map)
            munmap(map, size);
        return tkv_err(TKV_ERR_NOMEM, "gguf: no memory");
    }
    g->base = data;
    g->size = size;
    g->map = map;
    tkv_status st = parse(g);
    if (st != TKV_OK) {
        tkv_gguf_close(g);
        return st;
    }
    *out = g;
    return TKV_OK;
}

tkv_status tkv_gguf_open_memory(const void *data, size_t size, tkv_gguf **out)
{
    if (!out || (!data && size))
        return tkv_err(TKV_ERR_INVALID_ARG, "gguf: open_memory: NULL argument");
    *out = NULL;
    return open_image(data, size, NULL, out);
}

tkv_status tkv_gguf_open(const char *path, tkv_gguf **out)
{
    if (!path || !out)
        return tkv_err(TKV_ERR_INVALID_ARG, "gguf: open: NULL argument");
    *out = NULL;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return tkv_err(TKV_ERR_IO, "gguf: cannot open '%s': %s", path, strerror(errno));
    struct stat sb;
    if (fstat(fd, &sb) != 0) {
        int e = errno;
        close(fd);
        return tkv_err(TKV_ERR_IO, "gguf: cannot stat '%s': %s", path, strerror(e));
    }
    if (!S_ISREG(sb.st_mode)) {
        close(fd);
        return tkv_err(TKV_ERR_IO, "gguf: '%s' is not a regular file", path);
    }
    if (sb.st_size == 0) {
        close(fd);
        return tkv_err(TKV_ERR_FORMAT, "gguf: '%s' is empty", path);
    }
    size_t size = (size_t)sb.st_size;
    void *map = mmap(NULL, size, PROT_READ, MAP_PRIVATE, fd, 0);
    int e = errno;
    close(fd); /* the mapping keeps the file alive */
    if (map == MAP_FAILED)
        return tkv_err(TKV_ERR_IO, "gguf: cannot mmap '%s' (%zu bytes): %s", path, size, strerror(e));
    tkv_status st = open_image(map, size, map, out);
    if (st != TKV_OK)
        return tkv_err_wrap(st, "%s", path);
    return TKV_OK;
}

uint32_t tkv_gguf_version(const tkv_gguf *g) { return g->version; }
uint64_t tkv_gguf_file_size(const tkv_gguf *g) { return g->size; }
uint32_t tkv_gguf_alignment(const tkv_gguf *g) { return g->alignment; }

size_t tkv_gguf_n_kv(const tkv_gguf *g) { return g->n_kv; }

const struct tkv_gguf_kv *tkv_gguf_kv_at(const tkv_gguf *g, size_t i)
{
    return i < g->n_kv ? &g->kvs[i] : NULL;
}

const struct tkv_gguf_kv *tkv_gguf_find_kv(const tkv_gguf *g, const char *key)
{
    struct tkv_gguf_kv probe = {.key = {key, strlen(key)}};
    const struct tkv_gguf_kv *pp = &probe, **hit;
    if (!g->n_kv)
        return NULL;
    hit = bsearch(&pp, g->kv_sorted, g->n_kv, sizeof *g->kv_sorted, cmp_kv_key);
    return hit ? *hit : NULL;
}

size_t tkv_gguf_n_tensors(const tkv_gguf *g) { return g->n_tensors; }

const struct tkv_gguf_tensor *tkv_gguf_tensor_at(const tkv_gguf *g, size_t i)
{
    return i < g->n_tensors ? &g->tensors[i] : NULL;
}

const struct tkv_gguf_tensor *tkv_gguf_find_tensor(const tkv_gguf *g, const char *name)
{
    if (!g->n_tensors || strlen(name) > TKV_GGUF_MAX_NAME)
        return NULL;
    struct tkv_gguf_tensor probe;
    strcpy(probe.name, name);
    const struct tkv_gguf_tensor *pp = &probe, **hit;
    hit = bsearch(&pp, g->t_sorted, g->n_tensors, sizeof *g->t_sorted, cmp_tensor_name);
    return hit ? *hit : NULL;
}

// ---- reader: typed getters ---------------------------------------------------

/* The kv for key, or NULL with *st set (OK when absent and optional). */
static const struct tkv_gguf_kv *get_kv(const tkv_gguf *g, const char *key, bool required, tkv_status *st)
{
    const struct tkv_gguf_kv *kv = tkv_gguf_find_kv(g, key);
    *st = TKV_OK;
    if (!kv && required)
        *st = tkv_err(TKV_ERR_FORMAT, "gguf: missing required key '%s'", key);
    return kv;
}

static tkv_status wrong_type(const struct tkv_gguf_kv *kv, const char *key, const char *want)
{
    return tkv_err(TKV_ERR_FORMAT, "gguf: key '%s' has type %s, expected %s", key, vtype_name(kv->type), want);
}

/* An integer kv within [lo, hi]. */
static tkv_status get_int(const tkv_gguf *g, const char *key, bool required, int64_t lo, int64_t hi, int64_t *out,
                          bool *found)
{
    tkv_status st;
    const struct tkv_gguf_kv *kv = get_kv(g, key, required, &st);
    *found = false;
    if (!kv)
        return st;
    if (!vtype_is_int(kv->type))
        return wrong_type(kv, key, "an integer");
    bool neg = vtype_is_signed(kv->type) && kv->v.i < 0;
    if (neg ? kv->v.i < lo : kv->v.u > (uint64_t)hi) {
        if (neg)
            return tkv_err(TKV_ERR_FORMAT, "gguf: key '%s' = %lld is out of range [%lld, %lld]", key,
                           (long long)kv->v.i, (long long)lo, (long long)hi);
        return tkv_err(TKV_ERR_FORMAT, "gguf: key '%s' = %llu is out of range [%lld, %lld]", key,
                       (unsigned long long)kv->v.u, (long long)lo, (long long)hi);
    }
    *out = neg ? kv->v.i : (int64_t)kv->v.u;
    *found = true;
    return TKV_OK;
}

tkv_status tkv_gguf_get_u32(const tkv_gguf *g, const char *key, bool required, uint32_t *out)
{
    int64_t v;
    bool found;
    TKV_TRY(get_int(g, key, required, 0, UINT32_MAX, &v, &found));
    if (found)
        *out = (uint32_t)v;
    return TKV_OK;
}

tkv_status tkv_gguf_get_i32(const tkv_gguf *g, const char *key, bool required, int32_t *out)
{
    int64_t v;
    bool found;
    TKV_TRY(get_int(g, key, required, INT32_MIN, INT32_MAX, &v, &found));
    if (found)
        *out = (int32_t)v;
    return TKV_OK;
}

tkv_status tkv_gguf_get_f32(const tkv_gguf *g, const char *key, bool required, float *out)
{
    tkv_status st;
    const struct tkv_gguf_kv *kv = get_kv(g, key, required, &st);
    if (!kv)
        return st;
    if (kv->type != TKV_GGUF_F32 && kv->type != TKV_GGUF_F64)
        return wrong_type(kv, key, "FLOAT32");
    *out = (float)kv->v.f;
    return TKV_OK;
}

tkv_status tkv_gguf_get_bool(const tkv_gguf *g, const char *key, bool required, bool *out)
{
    tkv_status st;
    const struct tkv_gguf_kv *kv = get_kv(g, key, required, &st);
    if (!kv)
        return st;
    if (kv->type != TKV_GGUF_BOOL)
        return wrong_type(kv, key, "BOOL");
    *out = kv->v.u != 0;
    return TKV_OK;
}

tkv_status tkv_gguf_get_str(const tkv_gguf *g, const char *key, bool required, struct tkv_gguf_str *out)
{
    tkv_status st;
    const struct tkv_gguf_kv *kv = get_kv(g, key, required, &st);
    if (!kv)
        return st;
    if (kv->type != TKV_GGUF_STRING)
        return wrong_type(kv, key, "STRING");
    *out = kv->v.s;
    return TKV_OK;
}

tkv_status tkv_gguf_get_arr(const tkv_gguf *g, const char *key, bool required, uint32_t elem_type,
                            const struct tkv_gguf_kv **out)
{
    tkv_status st;
    const struct tkv_gguf_kv *kv = get_kv(g, key, required, &st);
    *out = NULL;
    if (!kv)
        return st;
    if (kv->type != TKV_GGUF_ARRAY)
        return tkv_err(TKV_ERR_FORMAT, "gguf: key '%s' has type %s, expected an array of %s", key,
                       vtype_name(kv->type), vtype_name(elem_type));
    uint32_t et = kv->v.arr.type;
    if (elem_type == TKV_GGUF_I32 ? !vtype_is_int(et) : et != elem_type)
        return tkv_err(TKV_ERR_FORMAT, "gguf: key '%s' is an array of %s, expected %s", key, vtype_name(et),
                       elem_type == TKV_GGUF_I32 ? "integers" : vtype_name(elem_type));
    *out = kv;
    return TKV_OK;
}

struct tkv_gguf_str tkv_gguf_arr_str(const tkv_gguf *g, const struct tkv_gguf_kv *arr, uint64_t i)
{
    struct tkv_gguf_str s = {"", 0};
    uintptr_t d = (uintptr_t)arr - (uintptr_t)g->kvs;
    size_t idx = (size_t)(d / sizeof *arr);
    if (d % sizeof *arr || idx >= g->n_kv || !g->str_offs[idx] || i >= arr->v.arr.n)
        return s;
    uint64_t off = g->str_offs[idx][i];
    s.ptr = (const char *)g->base + off;
    memcpy(&s.len, g->base + off - 8, 8);
    return s;
}

int64_t tkv_gguf_arr_i64(const struct tkv_gguf_kv *arr, uint64_t i)
{
    struct tkv_gguf_kv tmp = {0};
    uint32_t t = arr->v.arr.type;
    if (!vtype_is_int(t) && t != TKV_GGUF_BOOL)
        return 0;
    load_scalar(t, (const uint8_t *)arr->v.arr.data + i * vtype_size[t], &tmp);
    return vtype_is_signed(t) ? tmp.v.i : (int64_t)tmp.v.u;
}

float tkv_gguf_arr_f32(const struct tkv_gguf_kv *arr, uint64_t i)
{
    struct tkv_gguf_kv tmp = {0};
    uint32_t t = arr->v.arr.type;
    if (t != TKV_GGUF_F32 && t != TKV_GGUF_F64)
        return 0.0f;
    load_scalar(t, (const uint8_t *)arr->v.arr.data + i * vtype_size[t], &tmp);
    return (float)tmp.v.f;
}

// ---- writer ----------------------------------------------------------------

struct wtensor {
    char        name[TKV_GGUF_MAX_NAME + 1];
    uint32_t    type, n_dims;
    int64_t     ne[TKV_GGUF_MAX_DIMS];
    uint64_t    nbytes, offset;          /* offset relative to the data section */
    const void *data;                    /* borrowed; NULL = zeros              */
};

struct tkv_gguf_writer {
    uint8_t *meta;                       /* serialized kvs, in order added      */
    size_t   meta_len, meta_cap;
    size_t   n_kv;
    char   **keys;                       /* [n_kv] copies, for duplicate checks */
    struct wtensor *tensors;
    size_t   n_tensors, cap_tensors;
    uint64_t data_size;                  /* bytes of the data section, padded  */
};

tkv_status tkv_gguf_writer_init(tkv_gguf_writer **out)
{
    if (!out)
        return tkv_err(TKV_ERR_INVALID_ARG, "gguf writer: NULL argument");
    *out = calloc(1, sizeof **out);
    return *out ? TKV_OK : tkv_err(TKV_ERR_NOMEM, "gguf writer: no memory");
}

void tkv_gguf_writer_free(tkv_gguf_writer *w)
{
    if (!w)
        return;
    for (size_t i = 0; i < w->n_kv; i++)
        free(w->keys[i]);
    free(w->keys);
    free(w->meta);
    free(w->tensors);
    free(w);
}

static tkv_status meta_put(tkv_gguf_writer *w, const void *p, size_t n)
{
    if (n > SIZE_MAX - w->meta_len)
        return tkv_err(TKV_ERR_NOMEM, "gguf writer: metadata too large");
    if (w->meta_len + n > w->meta_cap) {
        size_t cap = w->meta_cap ? w->meta_cap : 256;
        while (cap < w->meta_len + n)
            cap = cap > SIZE_MAX / 2 ? w->meta_len + n : cap * 2;
        uint8_t *m = realloc(w->meta, cap);
        if (!m)
            return tkv_err(TKV_ERR_NOMEM, "gguf writer: no memory for %zu bytes of metadata", cap);
        w->meta = m;
        w->meta_cap = cap;
    }
    memcpy(w->meta + w->meta_len, p, n);
    w->meta_len += n;
    return TKV_OK;
}

static tkv_status meta_u32(tkv_gguf_writer *w, uint32_t v) { return meta_put(w, &v, 4); }
static tkv_status meta_u64(tkv_gguf_writer *w, uint64_t v) { return meta_put(w, &v, 8); }

static tkv_status meta_str(tkv_gguf_writer *w, const char *s)
{
    size_t n = strlen(s);
    TKV_TRY(meta_u64(w, n));
    return meta_put(w, s, n);
}

/* Starts a kv: checks and records the key, writes it and the value type.
 * Arguments are checked before this; after a NOMEM here or later in the same
 * add_*, the writer holds a partial kv and must only be freed. */
static tkv_status kv_begin(tkv_gguf_writer *w, const char *key, uint32_t type)
{
    if (!key || !*key)
        return tkv_err(TKV_ERR_INVALID_ARG, "gguf writer: empty key");
    for (size_t i = 0; i < w->n_kv; i++)
        if (strcmp(w->keys[i], key) == 0)
            return tkv_err(TKV_ERR_INVALID_ARG, "gguf writer: duplicate key '%s'", key);
    char **keys = realloc(w->keys, (w->n_kv + 1) * sizeof *keys);
    if (!keys)
        return tkv_err(TKV_ERR_NOMEM, "gguf writer: no memory");
    w->keys = keys;
    if (!(keys[w->n_kv] = strdup(key)))
        return tkv_err(TKV_ERR_NOMEM, "gguf writer: no memory");
    w->n_kv++;
    TKV_TRY(meta_str(w, key));
    return meta_u32(w, type);
}

tkv_status tkv_gguf_add_u32(tkv_gguf_writer *w, const char *key, uint32_t v)
{
    TKV_TRY(kv_begin(w, key, TKV_GGUF_U32));
    return meta_u32(w, v);
}

tkv_status tkv_gguf_add_i32(tkv_gguf_writer *w, const char *key, int32_t v)
{
    TKV_TRY(kv_begin(w, key, TKV_GGUF_I32));
    return meta_put(w, &v, 4);
}

tkv_status tkv_gguf_add_f32(tkv_gguf_writer *w, const char *key, float v)
{
    TKV_TRY(kv_begin(w, key, TKV_GGUF_F32));
    return meta_put(w, &v, 4);
}

tkv_status tkv_gguf_add_bool(tkv_gguf_writer *w, const char *key, bool v)
{
    uint8_t b = v;
    TKV_TRY(kv_begin(w, key, TKV_GGUF_BOOL));
    return meta_put(w, &b, 1);
}

tkv_status tkv_gguf_add_str(tkv_gguf_writer *w, const char *key, const char *v)
{
    if (!v)
        return tkv_err(TKV_ERR_INVALID_ARG, "gguf writer: key '%s': NULL string", key ? key : "");
    TKV_TRY(kv_begin(w, key, TKV_GGUF_STRING));
    return meta_str(w, v);
}

tkv_status tkv_gguf_add_arr_str(tkv_gguf_writer *w, const char *key, const char *const *v, uint64_t n)
{
    for (uint64_t i = 0; i < n; i++)
        if (!v[i])
            return tkv_err(TKV_ERR_INVALID_ARG, "gguf writer: key '%s': element %llu is NULL", key ? key : "",
                           (unsigned long long)i);
    TKV_TRY(kv_begin(w, key, TKV_GGUF_ARRAY));
    TKV_TRY(meta_u32(w, TKV_GGUF_STRING));
    TKV_TRY(meta_u64(w, n));
    for (uint64_t i = 0; i < n; i++)
        TKV_TRY(meta_str(w, v[i]));
    return TKV_OK;
}

tkv_status tkv_gguf_add_arr(tkv_gguf_writer *w, const char *key, uint32_t elem_type, const void *data, uint64_t n)
{
    uint64_t bytes;
    if (elem_type >= TKV_GGUF_VTYPE_COUNT || elem_type == TKV_GGUF_STRING || elem_type == TKV_GGUF_ARRAY)
        return tkv_err(TKV_ERR_INVALID_ARG, "gguf writer: key '%s': element type %u is not a scalar",
                       key ? key : "", elem_type);
    if (!tkv_mul_ok(n, vtype_size[elem_type], &bytes) || bytes > SIZE_MAX || (n && !data))
        return tkv_err(TKV_ERR_INVALID_ARG, "gguf writer: key '%s': bad array of %llu elements", key ? key : "",
                       (unsigned long long)n);
    if (elem_type == TKV_GGUF_BOOL)
        for (uint64_t i = 0; i < n; i++)
            if (((const uint8_t *)data)[i] > 1)
                return tkv_err(TKV_ERR_INVALID_ARG, "gguf writer: key '%s': BOOL element %llu is not 0 or 1", key,
                               (unsigned long long)i);
    TKV_TRY(kv_begin(w, key, TKV_GGUF_ARRAY));
    TKV_TRY(meta_u32(w, elem_type));
    TKV_TRY(meta_u64(w, n));
    return meta_put(w, data, (size_t)bytes);
}

tkv_status tkv_gguf_add_tensor(tkv_gguf_writer *w, const char *name, uint32_t type, uint32_t n_dims,
                               const int64_t *ne, const void *data)
{
    if (!w || !name || !ne)
        return tkv_err(TKV_ERR_INVALID_ARG, "gguf writer: add_tensor: NULL argument");
    size_t len = strlen(name);
    if (len == 0 || len > TKV_GGUF_MAX_NAME)
        return tkv_err(TKV_ERR_INVALID_ARG, "gguf writer: tensor name '%s' must be 1..%d bytes", name,
                       TKV_GGUF_MAX_NAME);
    for (size_t i = 0; i < w->n_tensors; i++)
        if (strcmp(w->tensors[i].name, name) == 0)
            return tkv_err(TKV_ERR_INVALID_ARG, "gguf writer: duplicate tensor name '%s'", name);
    struct wtensor t = {.type = type, .n_dims = n_dims, .data = data, .offset = w->data_size};
    uint64_t n_elems, end;
    if (n_dims < 1 || n_dims > TKV_GGUF_MAX_DIMS)
        return tkv_err(TKV_ERR_INVALID_ARG, "gguf writer: tensor '%s': n_dims %u (must be 1..%d)", name, n_dims,
                       TKV_GGUF_MAX_DIMS);
    for (uint32_t j = 0; j < TKV_GGUF_MAX_DIMS; j++)
        t.ne[j] = j < n_dims ? ne[j] : 1;
    TKV_TRY(tensor_size("gguf writer", name, type, n_dims, t.ne, TKV_ERR_INVALID_ARG, &n_elems, &t.nbytes));
    if (!tkv_add_ok(t.offset, t.nbytes, &end) || end > UINT64_MAX - GGUF_DEFAULT_ALIGN)
        return tkv_err(TKV_ERR_INVALID_ARG, "gguf writer: tensor '%s': data section too large", name);
    memcpy(t.name, name, len + 1);
    if (w->n_tensors == w->cap_tensors) {
        size_t cap = w->cap_tensors ? w->cap_tensors * 2 : 16;
        struct wtensor *p = realloc(w->tensors, cap * sizeof *p);
        if (!p)
            return tkv_err(TKV_ERR_NOMEM, "gguf writer: no memory");
        w->tensors = p;
        w->cap_tensors = cap;
    }
    w->tensors[w->n_tensors++] = t;
    w->data_size = tkv_align_up(end, GGUF_DEFAULT_ALIGN);
    return TKV_OK;
}

/* Where serialized bytes go: a FILE or a memory buffer of the exact size. */
struct sink {
    FILE       *f;
    const char *path;
    uint8_t    *buf;
    uint64_t    pos;
};

/* Writes n bytes of p, or n zeros when p is NULL. */
static tkv_status sink_put(struct sink *s, const void *p, uint64_t n)
{
    static const uint8_t zeros[4096];
    if (s->buf) {
        if (p)
            memcpy(s->buf + s->pos, p, n);
        else
            memset(s->buf + s->pos, 0, n);
        s->pos += n;
        return TKV_OK;
    }
    while (n) {
        size_t k = p ? (size_t)TKV_MIN(n, (uint64_t)1 << 30) : (size_t)TKV_MIN(n, sizeof zeros);
        if (fwrite(p ? p : zeros, 1, k, s->f) != k)
            return tkv_err(TKV_ERR_IO, "gguf writer: cannot write '%s' at offset %llu: %s", s->path,
                           (unsigned long long)s->pos, strerror(errno));
        s->pos += k;
        n -= k;
        if (p)
            p = (const uint8_t *)p + k;
    }
    return TKV_OK;
}

static tkv_status sink_u32(struct sink *s, uint32_t v) { return sink_put(s, &v, 4); }
static tkv_status sink_u64(struct sink *s, uint64_t v) { return sink_put(s, &v, 8); }

/* Bytes before the data section, unpadded. */
static uint64_t header_size(const tkv_gguf_writer *w)
{
    uint64_t n = 4 + 4 + 8 + 8 + w->meta_len;
    for (size_t i = 0; i < w->n_tensors; i++)
        n += 8 + strlen(w->tensors[i].name) + 4 + 8 * (uint64_t)w->tensors[i].n_dims + 4 + 8;
    return n;
}

/* Everything before the data section: header, kvs, tensor infos, padding. */
static tkv_status emit_header(const tkv_gguf_writer *w, struct sink *s)
{
    TKV_TRY(sink_u32(s, GGUF_MAGIC));
    TKV_TRY(sink_u32(s, 3));
    TKV_TRY(sink_u64(s, w->n_tensors));
    TKV_TRY(sink_u64(s, w->n_kv));
    TKV_TRY(sink_put(s, w->meta, w->meta_len));
    for (size_t i = 0; i < w->n_tensors; i++) {
        const struct wtensor *t = &w->tensors[i];
        uint64_t len = strlen(t->name);
        TKV_TRY(sink_u64(s, len));
        TKV_TRY(sink_put(s, t->name, len));
        TKV_TRY(sink_u32(s, t->n_dims));
        for (uint32_t j = 0; j < t->n_dims; j++)
            TKV_TRY(sink_u64(s, (uint64_t)t->ne[j]));
        TKV_TRY(sink_u32(s, t->type));
        TKV_TRY(sink_u64(s, t->offset));
    }
    uint64_t data_start = tkv_align_up(s->pos, GGUF_DEFAULT_ALIGN);
    return sink_put(s, NULL, data_start - s->pos);
}

static tkv_status emit(const tkv_gguf_writer *w, struct sink *s)
{
    TKV_TRY(emit_header(w, s));
    /* every tensor is padded to the alignment, the last one too (as ggml does) */
    for (size_t i = 0; i < w->n_tensors; i++) {
        const struct wtensor *t = &w->tensors[i];
        TKV_TRY(sink_put(s, t->data, t->nbytes));
        TKV_TRY(sink_put(s, NULL, tkv_align_up(t->nbytes, GGUF_DEFAULT_ALIGN) - t->nbytes));
    }
    return TKV_OK;
}

tkv_status tkv_gguf_write_file(const tkv_gguf_writer *w, const char *path)
{
    if (!w || !path)
        return tkv_err(TKV_ERR_INVALID_ARG, "gguf writer: write_file: NULL argument");
    FILE *f = fopen(path, "wb");
    if (!f)
        return tkv_err(TKV_ERR_IO, "gguf writer: cannot create '%s': %s", path, strerror(errno));
    struct sink s = {.f = f, .path = path};
    tkv_status st = emit(w, &s);
    /* fclose flushes: a full disk often shows up only here */
    if (fclose(f) != 0 && st == TKV_OK)
        st = tkv_err(TKV_ERR_IO, "gguf writer: cannot write '%s': %s", path, strerror(errno));
    return st; /* a failed write may leave a partial file behind */
}

tkv_status tkv_gguf_write_mem(const tkv_gguf_writer *w, void **out, size_t *size)
{
    if (!w || !out || !size)
        return tkv_err(TKV_ERR_INVALID_ARG, "gguf writer: write_mem: NULL argument");
    uint64_t total = tkv_align_up(header_size(w), GGUF_DEFAULT_ALIGN);
    if (!tkv_add_ok(total, w->data_size, &total) || total > SIZE_MAX)
        return tkv_err(TKV_ERR_NOMEM, "gguf writer: file of %llu bytes does not fit in memory",
                       (unsigned long long)total);
    struct sink s = {.buf = malloc(total ? total : 1)};
    if (!s.buf)
        return tkv_err(TKV_ERR_NOMEM, "gguf writer: no memory for %llu bytes", (unsigned long long)total);
    tkv_status st = emit(w, &s);
    if (st != TKV_OK || s.pos != total) {
        free(s.buf);
        return st != TKV_OK ? st : tkv_err(TKV_ERR_INTERNAL, "gguf writer: wrote %llu bytes, planned %llu",
                                           (unsigned long long)s.pos, (unsigned long long)total);
    }
    *out = s.buf;
    *size = (size_t)total;
    return TKV_OK;
}

// ---- streaming writer ------------------------------------------------------

/* Writes all n bytes of p at off (pwrite may write less than asked). */
static tkv_status pwrite_all(int fd, const char *path, const uint8_t *p, uint64_t n, uint64_t off)
{
    while (n) {
        ssize_t k = pwrite(fd, p, (size_t)TKV_MIN(n, (uint64_t)1 << 30), (off_t)off);
        if (k < 0 && errno == EINTR)
            continue;
        if (k <= 0)
            return tkv_err(TKV_ERR_IO, "gguf writer: cannot write '%s' at offset %llu: %s", path,
                           (unsigned long long)off, k < 0 ? strerror(errno) : "no progress");
        p += k;
        n -= (uint64_t)k;
        off += (uint64_t)k;
    }
    return TKV_OK;
}

/* Rows of a tensor (elements / ne[0]) and bytes per row. */
static void tensor_rows(const struct wtensor *t, uint64_t *n_rows, uint64_t *row_bytes)
{
    *n_rows = (uint64_t)t->ne[1] * (uint64_t)t->ne[2] * (uint64_t)t->ne[3];
    *row_bytes = t->nbytes / *n_rows;
}

/* The header, then every tensor's data chunk by chunk, into fd. */
static tkv_status stream_to(const tkv_gguf_writer *w, int fd, const char *path, uint64_t data_start,
                            size_t chunk_bytes, tkv_gguf_rows_fn fn, void *user)
{
    struct sink hs = {.buf = malloc(data_start ? data_start : 1)};
    if (!hs.buf)
        return tkv_err(TKV_ERR_NOMEM, "gguf writer: no memory for a header of %llu bytes",
                       (unsigned long long)data_start);
    tkv_status st = emit_header(w, &hs);
    if (st == TKV_OK && hs.pos != data_start)
        st = tkv_err(TKV_ERR_INTERNAL, "gguf writer: header of %llu bytes, planned %llu",
                     (unsigned long long)hs.pos, (unsigned long long)data_start);
    if (st == TKV_OK)
        st = pwrite_all(fd, path, hs.buf, data_start, 0);
    free(hs.buf);
    TKV_TRY(st);

    /* one buffer for the largest chunk: whole rows, at least one */
    uint64_t buf_bytes = 1;
    for (size_t i = 0; i < w->n_tensors; i++) {
        uint64_t n_rows, row_bytes;
        tensor_rows(&w->tensors[i], &n_rows, &row_bytes);
        uint64_t per = TKV_MAX(chunk_bytes / row_bytes, (uint64_t)1);
        buf_bytes = TKV_MAX(buf_bytes, TKV_MIN(per, n_rows) * row_bytes);
    }
    uint8_t *buf = buf_bytes <= SIZE_MAX ? malloc((size_t)buf_bytes) : NULL;
    if (!buf)
        return tkv_err(TKV_ERR_NOMEM, "gguf writer: no memory for a chunk of %llu bytes",
                       (unsigned long long)buf_bytes);
    for (size_t i = 0; i < w->n_tensors && st == TKV_OK; i++) {
        const struct wtensor *t = &w->tensors[i];
        uint64_t n_rows, row_bytes;
        tensor_rows(t, &n_rows, &row_bytes);
        uint64_t per = TKV_MAX(chunk_bytes / row_bytes, (uint64_t)1);
        for (uint64_t r = 0; r < n_rows && st == TKV_OK; r += per) {
            uint64_t k = TKV_MIN(per, n_rows - r);
            st = fn(user, i, r, k, buf);
            if (st == TKV_OK)
                st = pwrite_all(fd, path, buf, k * row_bytes, data_start + t->offset + r * row_bytes);
        }
    }
    free(buf);
    return st;
}

tkv_status tkv_gguf_write_file_stream(const tkv_gguf_writer *w, const char *path, size_t chunk_bytes,
                                      tkv_gguf_rows_fn fn, void *user)
{
    if (!w || !path || !fn)
        return tkv_err(TKV_ERR_INVALID_ARG, "gguf writer: write_file_stream: NULL argument");
    uint64_t data_start = tkv_align_up(header_size(w), GGUF_DEFAULT_ALIGN), total;
    if (!tkv_add_ok(data_start, w->data_size, &total) || total > INT64_MAX)
        return tkv_err(TKV_ERR_INVALID_ARG, "gguf writer: file of %llu + %llu bytes is too large",
                       (unsigned long long)data_start, (unsigned long long)w->data_size);

    struct stat sb;
    if (stat(path, &sb) == 0 && S_ISDIR(sb.st_mode))
        return tkv_err(TKV_ERR_IO, "gguf writer: cannot write '%s': it is a directory", path);

    /* the file appears at path only when complete */
    size_t tmp_len = strlen(path) + 32;
    char *tmp = malloc(tmp_len);
    if (!tmp)
        return tkv_err(TKV_ERR_NOMEM, "gguf writer: no memory");
    snprintf(tmp, tmp_len, "%s.tmp.%ld", path, (long)getpid());
    int fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (fd < 0) {
        tkv_status e = tkv_err(TKV_ERR_IO, "gguf writer: cannot create '%s' (via '%s'): %s", path, tmp,
                               strerror(errno));
        free(tmp);
        return e;
    }

    tkv_status st = TKV_OK;
    /* reserve the space now so that a full disk fails before any work; file
     * systems without fallocate just skip this */
    if (total > 0 && fallocate(fd, 0, 0, (off_t)total) != 0 && errno != EOPNOTSUPP && errno != ENOSYS &&
        errno != EINVAL)
        st = tkv_err(TKV_ERR_IO, "gguf writer: cannot reserve %llu bytes for '%s': %s", (unsigned long long)total,
                     path, strerror(errno));
    if (st == TKV_OK)
        st = stream_to(w, fd, path, data_start, chunk_bytes, fn, user);
    if (st == TKV_OK && ftruncate(fd, (off_t)total) != 0) /* the padding after the last tensor */
        st = tkv_err(TKV_ERR_IO, "gguf writer: cannot size '%s' to %llu bytes: %s", path,
                     (unsigned long long)total, strerror(errno));
    if (close(fd) != 0 && st == TKV_OK)
        st = tkv_err(TKV_ERR_IO, "gguf writer: cannot write '%s': %s", path, strerror(errno));
    if (st == TKV_OK && rename(tmp, path) != 0)
        st = tkv_err(TKV_ERR_IO, "gguf writer: cannot rename '%s' to '%s': %s", tmp, path, strerror(errno));
    if (st != TKV_OK)
        unlink(tmp);
    free(tmp);
    return st;
}
