/*
 * gguf.h -- reader and writer for GGUF files (llama.cpp's model format).
 *
 * The reader treats every file as hostile: tkv_gguf_open() maps the file and
 * validates all of its structure before returning (every count, string and
 * array length against the bytes that remain, tensor dims with overflow
 * checks, type ids, offsets, alignment, data ranges, duplicate keys and
 * tensor names). Any violation is TKV_ERR_FORMAT with a message naming the
 * field or tensor. Nothing here knows about llama: see model.h for that.
 *
 * Format reference: docs/gguf.md (version 2 and 3, little-endian only).
 */
#ifndef TKV_GGUF_H
#define TKV_GGUF_H

#include "tkv-impl.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* ---- tensor element types (ggml_type ids) -------------------------------- */

enum tkv_type {
    TKV_TYPE_F32  = 0,
    TKV_TYPE_F16  = 1,
    TKV_TYPE_Q4_0 = 2,
    TKV_TYPE_Q4_1 = 3,
    TKV_TYPE_Q8_0 = 8,
    TKV_TYPE_Q8_1 = 9,   /* activation format only (Q4_1 dot products) */
    TKV_TYPE_Q4_K = 12,
    TKV_TYPE_Q6_K = 14,
    TKV_TYPE_Q8_K = 15,  /* activation format only (K-quant dot products) */
    TKV_TYPE_BF16 = 30,
    TKV_TYPE_COUNT = 40, /* ids >= this are unknown */
};

struct tkv_type_traits {
    const char *name;       /* "Q4_1"                                        */
    uint32_t block_elems;   /* elements per block (1 for plain floats)       */
    uint32_t block_bytes;   /* bytes per block                               */
    bool     weights_ok;    /* tierkv runs weights of this type              */
};

/* Traits of a ggml type id, including ids tierkv cannot run (so the reader
 * can still size their data); NULL for ids that are not ggml types. */
const struct tkv_type_traits *tkv_type_traits(uint32_t type);

/* "Q4_1", or "unknown(99)" (static storage for known ids; the unknown form
 * uses a thread-local buffer). */
const char *tkv_type_name(uint32_t type);

/* ---- metadata values ------------------------------------------------------ */

enum tkv_gguf_vtype {
    TKV_GGUF_U8 = 0, TKV_GGUF_I8 = 1, TKV_GGUF_U16 = 2, TKV_GGUF_I16 = 3,
    TKV_GGUF_U32 = 4, TKV_GGUF_I32 = 5, TKV_GGUF_F32 = 6, TKV_GGUF_BOOL = 7,
    TKV_GGUF_STRING = 8, TKV_GGUF_ARRAY = 9, TKV_GGUF_U64 = 10, TKV_GGUF_I64 = 11,
    TKV_GGUF_F64 = 12, TKV_GGUF_VTYPE_COUNT = 13,
};

/* A string inside the mapped file: not NUL-terminated. */
struct tkv_gguf_str {
    const char *ptr;
    uint64_t    len;
};

struct tkv_gguf_kv {
    struct tkv_gguf_str key;
    uint32_t type;                 /* enum tkv_gguf_vtype                     */
    union {
        uint64_t u;                /* U8..U64, BOOL                           */
        int64_t  i;                /* I8..I64                                 */
        double   f;                /* F32, F64                                */
        struct tkv_gguf_str s;     /* STRING                                  */
        struct {
            uint32_t    type;      /* element type (never ARRAY)             */
            uint64_t    n;         /* element count                          */
            const void *data;      /* first element in the mapping; for
                                      strings use tkv_gguf_arr_str()          */
        } arr;
    } v;
};

/* ---- tensors -------------------------------------------------------------- */

#define TKV_GGUF_MAX_DIMS 4
#define TKV_GGUF_MAX_NAME 64

struct tkv_gguf_tensor {
    char        name[TKV_GGUF_MAX_NAME + 1];
    uint32_t    n_dims;
    int64_t     ne[TKV_GGUF_MAX_DIMS];   /* ne[0] is the row length; unused = 1 */
    uint32_t    type;                    /* enum tkv_type                       */
    uint64_t    n_elems;
    uint64_t    nbytes;
    uint64_t    file_offset;             /* absolute, aligned                   */
    const void *data;                    /* inside the mapping                  */
};

/* ---- reader ------------------------------------------------------------- */

typedef struct tkv_gguf tkv_gguf;

/* Maps and validates a file. */
tkv_status tkv_gguf_open(const char *path, tkv_gguf **out);
/* Validates a file image already in memory (not copied: keep it alive). */
tkv_status tkv_gguf_open_memory(const void *data, size_t size, tkv_gguf **out);
void       tkv_gguf_close(tkv_gguf *g);

uint32_t tkv_gguf_version(const tkv_gguf *g);
uint64_t tkv_gguf_file_size(const tkv_gguf *g);
uint32_t tkv_gguf_alignment(const tkv_gguf *g);

size_t                    tkv_gguf_n_kv(const tkv_gguf *g);
const struct tkv_gguf_kv *tkv_gguf_kv_at(const tkv_gguf *g, size_t i);
const struct tkv_gguf_kv *tkv_gguf_find_kv(const tkv_gguf *g, const char *key); /* NULL if absent */

/* Typed getters. Absent key: TKV_OK with *out untouched when !required,
 * TKV_ERR_FORMAT naming the key when required. Wrong type or out of range
 * for the output: TKV_ERR_FORMAT naming the key. Integers of any width
 * convert when the value fits. */
tkv_status tkv_gguf_get_u32(const tkv_gguf *g, const char *key, bool required, uint32_t *out);
tkv_status tkv_gguf_get_i32(const tkv_gguf *g, const char *key, bool required, int32_t *out);
tkv_status tkv_gguf_get_f32(const tkv_gguf *g, const char *key, bool required, float *out);
tkv_status tkv_gguf_get_bool(const tkv_gguf *g, const char *key, bool required, bool *out);
tkv_status tkv_gguf_get_str(const tkv_gguf *g, const char *key, bool required, struct tkv_gguf_str *out);
/* An array of elem_type (any integer type when elem_type is I32, converted by
 * tkv_gguf_arr_i64). *out = NULL when absent and !required. */
tkv_status tkv_gguf_get_arr(const tkv_gguf *g, const char *key, bool required, uint32_t elem_type,
                            const struct tkv_gguf_kv **out);

/* Element i of a string array (i < n, checked by the caller). O(1). */
struct tkv_gguf_str tkv_gguf_arr_str(const tkv_gguf *g, const struct tkv_gguf_kv *arr, uint64_t i);
/* Element i of an integer array as int64. */
int64_t tkv_gguf_arr_i64(const struct tkv_gguf_kv *arr, uint64_t i);
/* Element i of a F32 array. */
float tkv_gguf_arr_f32(const struct tkv_gguf_kv *arr, uint64_t i);

size_t                        tkv_gguf_n_tensors(const tkv_gguf *g);
const struct tkv_gguf_tensor *tkv_gguf_tensor_at(const tkv_gguf *g, size_t i);
const struct tkv_gguf_tensor *tkv_gguf_find_tensor(const tkv_gguf *g, const char *name);

/* ---- writer (tests, tierkv gen-model) ------------------------------------ */

typedef struct tkv_gguf_writer tkv_gguf_writer;

tkv_status tkv_gguf_writer_init(tkv_gguf_writer **out);
void       tkv_gguf_writer_free(tkv_gguf_writer *w);

/* Metadata, written in the order added. Strings are copied. An empty or
 * duplicate key is TKV_ERR_INVALID_ARG. */
tkv_status tkv_gguf_add_u32(tkv_gguf_writer *w, const char *key, uint32_t v);
tkv_status tkv_gguf_add_i32(tkv_gguf_writer *w, const char *key, int32_t v);
tkv_status tkv_gguf_add_f32(tkv_gguf_writer *w, const char *key, float v);
tkv_status tkv_gguf_add_bool(tkv_gguf_writer *w, const char *key, bool v);
tkv_status tkv_gguf_add_str(tkv_gguf_writer *w, const char *key, const char *v);
tkv_status tkv_gguf_add_arr_str(tkv_gguf_writer *w, const char *key, const char *const *v, uint64_t n);
/* Numeric array: elem_type is a scalar vtype; data holds n packed elements. */
tkv_status tkv_gguf_add_arr(tkv_gguf_writer *w, const char *key, uint32_t elem_type, const void *data, uint64_t n);

/* A tensor of the given type and shape; data (nbytes of the type and shape)
 * is referenced, not copied, and must stay valid until the file is written.
 * data == NULL writes zeros. A name that is empty, longer than
 * TKV_GGUF_MAX_NAME or already used, an unknown type, n_dims outside 1..4,
 * ne < 1 or ne[0] not a multiple of the block: TKV_ERR_INVALID_ARG. */
tkv_status tkv_gguf_add_tensor(tkv_gguf_writer *w, const char *name, uint32_t type, uint32_t n_dims,
                               const int64_t *ne, const void *data);

/* Writes GGUF v3 with 32-byte alignment: header, kvs, tensor infos, then
 * each tensor's data padded to 32 bytes. TKV_ERR_IO names the path; a failed
 * write may leave a partial file. */
tkv_status tkv_gguf_write_file(const tkv_gguf_writer *w, const char *path);
/* Same, into a malloc'd buffer the caller frees. */
tkv_status tkv_gguf_write_mem(const tkv_gguf_writer *w, void **out, size_t *size);

/* ---- streaming writer (tierkv gen-model: files larger than memory) ------ */

/* Fills rows [row0, row0 + n_rows) of tensor `index` (0-based, in the order
 * the tensors were added) into buf, packed: a row is ne[0] elements of the
 * tensor's type, and a tensor has ne[1]*ne[2]*ne[3] rows. Returns TKV_OK, or
 * a failure (reported with tkv_err) that abandons the file. */
typedef tkv_status (*tkv_gguf_rows_fn)(void *user, size_t index, uint64_t row0, uint64_t n_rows, void *buf);

/* Writes the same bytes as tkv_gguf_write_file, but takes tensor data from
 * fn instead of the pointers given to add_tensor (ignored here). The header
 * goes first (offsets follow from the shapes), then each tensor in order:
 * fn fills up to chunk_bytes of whole rows (at least one row per call) and
 * the chunk is written with pwrite before the next call. Memory: the header
 * plus one chunk.
 * The file appears at path only once complete: it is written as
 * "<path>.tmp.<pid>" (space reserved up front with fallocate where the file
 * system allows, so a full disk fails before any data is made) and renamed
 * over path at the end. On any failure the temporary file is removed and
 * path is left as it was. TKV_ERR_IO names the path; fn's failures pass
 * through unchanged. */
tkv_status tkv_gguf_write_file_stream(const tkv_gguf_writer *w, const char *path, size_t chunk_bytes,
                                      tkv_gguf_rows_fn fn, void *user);

#endif /* TKV_GGUF_H */
