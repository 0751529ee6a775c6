/*
 * kv-store.h -- the tiered KV block store of one session.
 *
 * KV is kept per (layer, KV head) in blocks of B tokens. A block's payload
 * is K then V, each [B, head_dim] f16 (S = 4*B*head_dim bytes). A page table
 * maps (layer, KV head, block) to the tiers holding a copy:
 *
 *   compute  memory the backend computes on: GPU memory for CUDA ("gpu" in
 *            stats), host memory bound with hwloc for the CPU ("host")
 *   host     pinned host memory below a GPU compute tier (hwloc, nearest
 *            NUMA node to the GPU, registered with the backend); absent when
 *            the compute tier is already host memory
 *   nvme     a private spill file in --nvme-dir, O_DIRECT, through io/
 *
 * Attention and writes only touch blocks in the compute tier. A layer is
 * processed between tkv_kvs_begin_layer (recalls the layer's blocks and pins
 * them; blocks about to be written are marked dirty) and tkv_kvs_end_layer.
 * When the compute tier is full, the least recently used unpinned blocks move
 * down (to host, else nvme). Full blocks never change again, so a block
 * recalled from below keeps its lower copy and can be dropped for free next
 * time. Every copy below the compute tier carries a CRC-32C, verified before
 * its data is used: a mismatch is TKV_ERR_CORRUPT naming the block, and the
 * data is never used. NVMe reads and copies a device checks as they land are
 * verified every time; a host-tier copy read or recalled through a CPU
 * check is summed once after it was written, not at every read (kv-layout.md,
 * "Integrity and failures"). On a failed spill the block stays where it was
 * (nothing lost) and the error is returned.
 *
 * Capacities are fixed at init; memory is allocated at init or in
 * tkv_kvs_reserve (prefill), never per token.
 */
#ifndef TKV_KV_STORE_H
#define TKV_KV_STORE_H

#include "../runtime/backend.h"

struct tkv_io;

struct tkv_kvs_params {
    uint32_t n_layer, n_head_kv, head_dim;
    uint32_t block_tokens;    /* B (the payload must be a multiple of 4 KiB for O_DIRECT: B*head_dim % 1024 == 0) */
    uint32_t max_tokens;      /* context capacity */
    bool     compute_is_host; /* the backend computes on host memory (CPU) */
    uint64_t compute_bytes;   /* KV capacity of the compute tier; 0 = the whole context */
    uint64_t host_bytes;      /* host tier below a GPU compute tier; 0 = none */
    const char *nvme_dir;     /* spill directory; NULL = no NVMe tier */
    uint64_t nvme_bytes;      /* NVMe tier capacity; 0 = the whole context */
    const char *pci_bus_id;   /* GPU's bus id for NUMA placement, or NULL */
    uint32_t upload_piece_bytes; /* host -> GPU recalls are queued in pieces this
                                    large while the rest is prepared; 0 = 128 MiB */
    uint32_t staging_blocks;  /* NVMe -> GPU recalls: blocks per half of the staging
                                 pipeline (read one half while the other uploads);
                                 0 = 32, at most 32 (tests take small ones) */
    bool     evict_ref;       /* test hook: every eviction scans every slot and orders the
                                 whole bucket it cuts (the full pass the scoped one
                                 replaced; it must pick the same victims in the same order) */
    bool     page_table;      /* keep the device page table (tkv_kvs_page_table): 8 bytes of
                                 backend memory and ~14 of host memory per block */
    bool     evict_cycle;     /* evict by the layer cycle alone: no stale blocks first
                                 (docs/kv-layout.md, "Eviction"; the order before
                                 session 30, for A/B runs) */
    bool     no_homes;        /* compute slots from the free list only, no home slots
                                 (docs/kv-layout.md, "Home slots"; the layout before
                                 session 44, for A/B runs: TKV_KV_HOMES=0) */
    bool     walk_ref;        /* test hook: begin_layer and end_layer walk every block of the
                                 layer, pinning and stamping each (the pass the whole-layer
                                 shortcut replaced; the views and every eviction must come
                                 out the same) */
};

enum tkv_tier { TKV_TIER_COMPUTE = 0, TKV_TIER_HOST = 1, TKV_TIER_NVME = 2, TKV_TIER_COUNT = 3 };

struct tkv_tier_stats {
    const char *name;      /* "gpu", "host" or "nvme"; NULL when the tier is absent */
    uint64_t capacity_bytes;
    uint64_t bytes_in;     /* written into this tier                       */
    uint64_t bytes_out;    /* read back from it                            */
    uint64_t used_bytes, peak_bytes;
    uint64_t hits, misses; /* block wanted from this tier: present / absent */
};

/* Where the time inside begin_layer goes (stall_seconds, split). Each
 * moment of a begin_layer call is counted in exactly one part, so the parts
 * sum to stall_seconds; the counts are of work done inside begin_layer only
 * (imports, prefetches and exports are not in them). */
struct tkv_kvs_stall {
    double settle_s;       /* this layer's prefetches drained, waited for and settled  */
    double evict_s;        /* make_room: slot scans, victim ordering, drops, spills down */
    double verify_s;       /* CRC-32C on the CPU: host-tier copies not yet checked that
                              are read in place (split) or uploaded by a device that
                              cannot check them, NVMe reads; and the checksums of
                              dirty blocks spilled to the host tier                   */
    double upload_issue_s; /* host -> compute copies queued (upload_blocks), or done one
                              by one (upload, memcpy on a host compute tier)          */
    double upload_wait_s;  /* upload_wait (the copies and the device's checks), fences  */
    double nvme_s;         /* NVMe reads issued and waited for                          */
    double other_s;        /* the rest: page-table passes (needed blocks, pins, write
                              marks, views), slots taken, recall lists                */
    uint64_t layers;          /* begin_layer calls                                     */
    uint64_t recalled_blocks; /* brought into the compute tier from host or NVMe       */
    uint64_t evict_passes;    /* make_room calls that had to evict                     */
    uint64_t evict_scanned;   /* slots those passes looked at                          */
    uint64_t evicted_blocks;  /* blocks they dropped or moved down                     */
    uint64_t spilled_blocks;  /* of those, dirty ones written down first (the rest: dropped) */
    uint64_t upload_calls;    /* upload_blocks (or upload) calls                       */
    uint64_t upload_waits;    /* upload_wait calls                                     */
    uint64_t verify_bytes;    /* bytes CRC-checked (or checksummed, spills) on the CPU  */
};

struct tkv_kvs_stats {
    struct tkv_tier_stats tier[TKV_TIER_COUNT];
    double   stall_seconds;       /* waiting for recalls inside begin_layer   */
    struct tkv_kvs_stall stall;   /* ... and where that time went             */
    uint64_t prefetched_blocks;   /* recalls started ahead of need             */
    uint64_t corrupt_blocks;      /* checksum mismatches detected              */
    uint64_t host_read_blocks;    /* blocks read in place on the host tier
                                     (begin_layer_split), each host copy
                                     verified once after it was written       */
    uint64_t bulk_blocks;         /* blocks stored by tkv_kvs_import_n's one-pass
                                     path (not one import each)               */
    uint64_t marked_layers;       /* read marks taken (tkv_kvs_mark_reads)      */
    uint64_t nvme_file_bytes;     /* the spill file's size (reserved on disk)   */
    const char *io_engine;        /* "io_uring", "sync" or NULL without NVMe   */
    bool     nvme_direct;
};

struct tkv_kvs;

tkv_status tkv_kvs_init(const struct tkv_kvs_params *p, struct tkv_backend *backend, struct tkv_kvs **out);
void       tkv_kvs_free(struct tkv_kvs *s);

/* Extends the page table to positions [0, n_tokens) and allocates the
 * compute-tier storage those blocks can use (up to its capacity).
 * TKV_ERR_CONTEXT_FULL past max_tokens. */
tkv_status tkv_kvs_reserve(struct tkv_kvs *s, uint32_t n_tokens);

/* Marks positions [0, n_tokens) as valid. Shrinking forgets blocks past the
 * new end (their storage is released on every tier). */
void     tkv_kvs_set_length(struct tkv_kvs *s, uint32_t n_tokens);

/* Brings every valid block of `layer` into the compute tier and pins it; the
 * blocks holding positions [write_pos, write_pos + n_write) are marked
 * dirty (they are about to change). Between begin and end, tkv_kvs_view and
 * tkv_kvs_locate are valid for this layer.
 * Cost: a whole-layer read pins and stamps the layer as one; when none of
 * the layer's compute slots changed hands since its last whole-layer read,
 * only the blocks from the last one read then are looked at (a decode step
 * of a resident context costs O(heads), not O(context)). A selective read
 * (tkv_kvs_begin_layer_sel, _split) touches the blocks it reads, those the
 * layer's last selective read set in the views, and the last block of each
 * head, besides one pass over need[]; its end_layer unpins only what it
 * pinned. */
tkv_status tkv_kvs_begin_layer(struct tkv_kvs *s, uint32_t layer, uint32_t write_pos, uint32_t n_write);
/* The same for a selection: only blocks with need[head * blocks_per_head + b]
 * set (and those being written) are recalled and pinned; the others stay
 * wherever they are and their view entries have k = v = NULL. need = NULL
 * means every block. blocks_per_head: tkv_kvs_max_blocks(). */
tkv_status tkv_kvs_begin_layer_sel(struct tkv_kvs *s, uint32_t layer, uint32_t write_pos, uint32_t n_write,
                                   const uint8_t *need);
/* Heterogeneous decode (docs/rabitq.md): begin_layer_sel, except that a
 * needed block with host_ok[head * blocks_per_head + b] set whose current
 * copy is in the pinned host tier and not in the compute tier stays where it
 * is, to be read there by the CPU. Such a block
 *   - is verified against its checksum first unless its host copy passed a
 *     check since it was written (a read in place or a recall): a mismatch
 *     is TKV_ERR_CORRUPT naming the block, and the layer is not begun;
 *   - is pinned on the host tier until end_layer (no spill evicts or moves
 *     it), not in the compute tier;
 *   - appears in tkv_kvs_host_view; its tkv_kvs_view entry has k = v = NULL.
 * A block being written never stays below; a block whose only copy is on
 * NVMe is recalled into the compute tier as usual, and so are host blocks
 * beyond the host tier's capacity less one batch of spills (32 blocks: the
 * pins must leave the recalls room to spill through the host tier). host_ok = NULL, or no host
 * tier (the compute tier is host memory: the CPU backend): begin_layer_sel.
 * *n_host (may be NULL) receives the number of blocks left on the host. */
tkv_status tkv_kvs_begin_layer_split(struct tkv_kvs *s, uint32_t layer, uint32_t write_pos, uint32_t n_write,
                                     const uint8_t *need, const uint8_t *host_ok, uint32_t *n_host);
uint32_t tkv_kvs_max_blocks(const struct tkv_kvs *s);
/* Whether the compute tier has a slot for every block of the context, so
 * that nothing is ever paged out of it (no cap, or a cap above the KV). */
bool tkv_kvs_compute_holds_all(const struct tkv_kvs *s);
void       tkv_kvs_end_layer(struct tkv_kvs *s, uint32_t layer);

/* Starts recalling blocks of `layer` into free compute slots without
 * evicting anything (other than clean copies needed later than `layer` and
 * the layer before it); returns at once. From NVMe to a host compute tier
 * the reads go through io_uring; from pinned host memory to a GPU, the
 * backend's asynchronous uploads (a copy stream) carry them while compute
 * continues, each copy checked against its checksum on the device as it
 * lands (on the CPU where the device cannot). Up to two GPU prefetches are
 * in flight: called for layer l+1 before begin_layer(l), the link carries
 * l+1 while l is settled, so it never waits for the host's bookkeeping.
 * begin_layer of a prefetched layer takes its verdicts (later layers stay
 * in flight); every other call of the store settles them all. A block that
 * failed is recalled again and reported by begin_layer. */
void tkv_kvs_prefetch(struct tkv_kvs *s, uint32_t layer);
/* tkv_kvs_prefetch over the blocks the last selective read of `layer` read
 * (begin_layer_sel/_split with a need map) that are not in the compute tier:
 * at decode a layer's selection overlaps much of the step before's, so
 * called for l+1 while l runs (the engine: right after begin_layer(l)) it
 * brings much of what l+1 will read. After a whole-layer read (or none
 * yet): tkv_kvs_prefetch. */
void tkv_kvs_prefetch_last(struct tkv_kvs *s, uint32_t layer);
/* Whether every prefetch has landed (polls, never blocks). */
bool tkv_kvs_prefetch_done(struct tkv_kvs *s);
/* Blocks until every prefetch has landed. */
tkv_status tkv_kvs_prefetch_wait(struct tkv_kvs *s);

/* The valid blocks of (layer, head) in position order (inside begin/end). */
struct tkv_kv_head_view tkv_kvs_view(const struct tkv_kvs *s, uint32_t layer, uint32_t head);

/* The blocks of (layer, head) that begin_layer_split left on the host tier,
 * indexed as tkv_kvs_view (entry b is block b; k = v = NULL where block b is
 * not read on the host): host pointers, valid until end_layer. */
struct tkv_kv_head_view tkv_kvs_host_view(const struct tkv_kvs *s, uint32_t layer, uint32_t head);

/* K and V row pointers of position pos (inside begin/end). */
void tkv_kvs_locate(const struct tkv_kvs *s, uint32_t layer, uint32_t head, uint32_t pos, uint16_t **k, uint16_t **v);

/* The device page table of `layer` (params.page_table; NULL without it):
 * backend memory, [n_head_kv][tkv_kvs_max_blocks()] 64-bit entries, entry
 * (head, b) the address of block b's K in the compute tier (its V follows
 * block_tokens * head_dim f16 later) while that copy is resident and
 * current, else 0 -- as of the layer's last tkv_kvs_page_table_sync, in
 * stream order: the backend's ops queued after the sync read what it wrote
 * (backend.h's kv_table takes it as ptab). A block whose copy is still
 * arriving (a prefetch in flight) reads 0 until a sync after it landed.
 * Valid until tkv_kvs_free. */
const uint64_t *tkv_kvs_page_table(const struct tkv_kvs *s, uint32_t layer);
/* Brings layer's device page table up to date: the entries of the blocks
 * whose compute slot was taken or given since the last sync (and those still
 * arriving then) are recomputed, and those that changed are written with the
 * backend's table_write (one queued batch; upload per entry where it has
 * none). O(blocks that moved), not O(context). *n_written (may be NULL):
 * entries written. Any time, inside or outside begin/end. */
tkv_status tkv_kvs_page_table_sync(struct tkv_kvs *s, uint32_t layer, uint32_t *n_written);
/* Read marks (with params.page_table; docs/kv-layout.md, "Eviction"): a
 * reader that reads blocks in place through the device page table, with no
 * begin_layer naming them (backend.h's kv_table), tells the store which it
 * read, so that eviction takes them for blocks in use, not stale ones.
 * rows: [n_head_kv][tkv_kvs_mark_words()] words, bit b % 32 of word b / 32
 * of head h's row set when block b was read at layer's latest begin_layer
 * (kv_table's marks; words past those of the layer's blocks are ignored).
 * Copied; call it after that begin and before the layer's next one. A block
 * marked at one of the layer's last two begins is not stale. Without a
 * page table: TKV_ERR_INVALID_ARG. */
uint32_t tkv_kvs_mark_words(const struct tkv_kvs *s);
tkv_status tkv_kvs_mark_reads(struct tkv_kvs *s, uint32_t layer, const uint32_t *rows);
/* Whether layer's device page table, as of its last sync, maps every block
 * below the store's length (every head) -- a decode table built from it
 * misses nothing: each of those blocks holds a compute slot and no entry
 * waits for a later sync. False without a page table. O(1). */
bool tkv_kvs_layer_mapped(const struct tkv_kvs *s, uint32_t layer);
/* Test hook: the address of the compute slot block b of (layer, head) holds,
 * whatever its state, or 0 without one. After a sync its page-table entry
 * must be this where tkv_kvs_block_tier says TKV_TIER_COMPUTE, else 0. */
uint64_t tkv_kvs_test_compute_addr(const struct tkv_kvs *s, uint32_t layer, uint32_t head, uint32_t b);

uint32_t tkv_kvs_block_bytes(const struct tkv_kvs *s);
/* Threads that verify a batch of blocks read from below (1: the caller's). */
uint32_t tkv_kvs_verify_threads(const struct tkv_kvs *s);

/* Copies the payload of block b of (layer, head) into dst (host, S bytes),
 * from whichever tier holds it (verified when it comes from below). */
tkv_status tkv_kvs_export(struct tkv_kvs *s, uint32_t layer, uint32_t head, uint32_t b, void *dst);
/* Stores a payload as block b of (layer, head) (positions must be reserved). */
tkv_status tkv_kvs_import(struct tkv_kvs *s, uint32_t layer, uint32_t head, uint32_t b, const void *src);
/* Stores n payloads, src[j] as block b0 + j of (layer, head) (positions must
 * be reserved; src[j] is read only during the call). Where the blocks hold
 * nothing yet (a fill after set_length), the compute tier ends as n
 * tkv_kvs_import calls in order would leave it if each evicted one block:
 * one victim order (the eviction order, kv-layout.md) is computed once for
 * the call over the tier's evictable blocks and the run's own blocks but the
 * last (which, like an import's block, is never its own victim); run blocks
 * that lose go straight to the tier below (host, else NVMe) with their
 * checksum, never through the compute tier, and those that stay go up in
 * batches (one backend wait per batch) instead of one synchronous upload
 * each. Blocks that already hold data are imported one by one. On an error
 * some of the run may be stored and the rest not (each block either holds
 * its payload or nothing); the error names the block. */
tkv_status tkv_kvs_import_n(struct tkv_kvs *s, uint32_t layer, uint32_t head, uint32_t b0, uint32_t n,
                            const void *const *src);
/* How many blocks a caller of tkv_kvs_import_n stages per call for a head
 * of n_blocks: all of them, or as many as 64 MiB of payloads hold (a
 * 128K-token head of llama3-8b's shape); at least 1. */
uint32_t tkv_kvs_import_run(const struct tkv_kvs *s, uint32_t n_blocks);

/* Copies every compute-tier block that has no copy below it (written on the
 * GPU: a prefill's KV, a synthetic fill's) to the host tier, as long as the
 * host tier has free room (it evicts nothing for this), keeping the GPU
 * copy; an eviction of such a block then drops it at no cost instead of
 * writing it down first. *n_done (unless NULL): the blocks copied. Nothing
 * to do without a host tier below a GPU compute tier, or while the compute
 * tier has room or can hold every block of the context (it evicts nothing
 * then). */
tkv_status tkv_kvs_write_back(struct tkv_kvs *s, uint32_t *n_done);

/* Moves block b of (layer, head) to a lower tier now (a policy's page-out). */
tkv_status tkv_kvs_demote(struct tkv_kvs *s, uint32_t layer, uint32_t head, uint32_t b);

/* Which tier holds the freshest copy of a block (-1 if none). */
int tkv_kvs_block_tier(const struct tkv_kvs *s, uint32_t layer, uint32_t head, uint32_t b);

void tkv_kvs_get_stats(const struct tkv_kvs *s, struct tkv_kvs_stats *out);
/* The NVMe tier's I/O engine (tests inject faults through it); NULL if none. */
struct tkv_io *tkv_kvs_io(struct tkv_kvs *s);

/* Test hook: flips one bit of the copy of a block on tier t (host or nvme),
 * as a failing disk or memory would. Not for production use. */
tkv_status tkv_kvs_test_flip_bit(struct tkv_kvs *s, uint32_t layer, uint32_t head, uint32_t b, int t);

#endif
