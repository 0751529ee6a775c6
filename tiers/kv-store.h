/*
 * kv-store.h -- the KV block store of one session.
 *
 * KV is kept per (layer, KV head) in blocks of B tokens; a block holds K and
 * V, each [B, head_dim] f16, in the backend's memory. A page table maps
 * (layer, KV head, block index) -> block; blocks of a head are in position
 * order. Storage is reserved in explicit steps (tkv_kvs_reserve), never on
 * the per-token path.
 *
 * This is the single-tier store (the compute backend's memory); the tiered
 * placement (GPU / pinned host / NVMe) grows behind this same interface.
 */
#ifndef TKV_KV_STORE_H
#define TKV_KV_STORE_H

#include "../runtime/backend.h"

struct tkv_kvs_params {
    uint32_t n_layer, n_head_kv, head_dim;
    uint32_t block_tokens;  /* B */
    uint32_t max_tokens;    /* context capacity */
};

struct tkv_kvs;

tkv_status tkv_kvs_init(const struct tkv_kvs_params *p, struct tkv_backend *backend, struct tkv_kvs **out);
void       tkv_kvs_free(struct tkv_kvs *s);

/* Makes sure blocks exist for positions [0, n_tokens) of every head.
 * TKV_ERR_CONTEXT_FULL past max_tokens; TKV_ERR_NOMEM leaves the store as it
 * was. */
tkv_status tkv_kvs_reserve(struct tkv_kvs *s, uint32_t n_tokens);

/* Marks positions [0, n_tokens) as valid (after their K/V were written). */
void tkv_kvs_set_length(struct tkv_kvs *s, uint32_t n_tokens);
uint32_t tkv_kvs_length(const struct tkv_kvs *s);

/* The valid blocks of one (layer, KV head), in position order; the last one
 * may be partial. The array stays valid until the next reserve/set_length. */
struct tkv_kv_head_view tkv_kvs_view(const struct tkv_kvs *s, uint32_t layer, uint32_t head);

/* Where position pos of (layer, head) is stored: K and V row pointers. */
void tkv_kvs_locate(const struct tkv_kvs *s, uint32_t layer, uint32_t head, uint32_t pos, uint16_t **k, uint16_t **v);

uint32_t tkv_kvs_block_tokens(const struct tkv_kvs *s);
/* Bytes of KV storage allocated (all blocks, K and V). */
uint64_t tkv_kvs_bytes_allocated(const struct tkv_kvs *s);

#endif
