/*
 * kv-store.c -- see kv-store.h.
 *
 * Bookkeeping: one `struct blk` per (layer, head, block index) records the
 * slot it holds on each tier and which copies are current (`valid` bits).
 * Slots are fixed-size (one block payload) and come from a per-tier pool;
 * memory tiers carve slots out of slabs allocated in reserve steps.
 */
#include "kv-store.h"

#include "../cpu/threadpool.h"
#include "../io/io.h"
#include "crc32c.h"
#include "host-mem.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#define SLAB_SLOTS 64  /* slots per memory slab                       */
#define IO_BATCH   32  /* blocks per batch of NVMe reads or writes    */
#define SEL_AHEAD  16  /* begin_layer: records prefetched this many listed blocks ahead */
#define MAX_HOME_SEGS 32 /* home segments (below) a store makes at most          */
#define HOME_MIN_W 8     /* blocks a head a home segment covers at least         */
#define UP_PIECE_BYTES (128u << 20) /* default upload_piece_bytes: on the H200 (bench-tiers
                                      --piece-kib) 8 MiB pieces cost more in launches than they
                                      hid; with two prefetches in flight 128 MiB beat 32 MiB */
#define BIT(t) (1u << (t))

static const char *const tier_names[TKV_TIER_COUNT] = {"compute", "host", "nvme"};

struct blk {
    int32_t  slot[TKV_TIER_COUNT]; /* -1: none on that tier                  */
    uint8_t  valid;                /* BIT(tier): that copy is current         */
    uint8_t  pinned;               /* in use by the layer being processed     */
    uint8_t  inflight;             /* compute slot being filled by a prefetch */
    uint8_t  hpinned : 1;          /* read in place on the host tier by the layer
                                      being processed (begin_layer_split): its
                                      host copy must not move until end_layer */
    uint8_t  hchecked : 1;         /* its host copy passed a CRC check since it was
                                      written: host reads and CPU-checked recalls
                                      take it as intact (kv-layout.md, "Integrity").
                                      A host copy is only ever written into a slot
                                      just taken, so pool_take and pool_give of a
                                      host slot clear it; so does test_flip_bit */
    uint32_t crc;                  /* CRC-32C of the payload below compute   */
    uint32_t layer;                /* its layer (eviction order, no division) */
    uint64_t lru;
};

/* Fixed-size slots on one tier; memory tiers also own the slabs. */
struct pool {
    bool     present;
    uint32_t cap;            /* slots the capacity allows             */
    uint32_t n;              /* slots usable now (memory allocated)   */
    int32_t *free_list;      /* [cap]                                 */
    uint32_t n_free;
    int32_t *owner;          /* [cap] block index, -1 if free         */
    uint16_t *slot_layer;    /* [cap] the owner's layer, n_layer if free */
    uint32_t *layer_used;    /* [n_layer] slots held by each layer    */
    /* Memory tiers: which slots each layer holds, in slot order, so that an
     * eviction pass lists a layer's slots without reading anyone else's:
     * bit (slot % 64) of lmap[layer * words + slot / 64] is set while a block
     * of `layer` holds the slot, and bit (w % 64) of lsum[layer * sum_words +
     * w / 64] while lmap word w of that layer is not zero. NULL on NVMe
     * (never evicted). */
    uint64_t *lmap, *lsum;
    uint32_t words, sum_words;
    /* Memory tiers: [n_layer] a lower bound of the LRU stamps (blk_lru) of
     * each layer's blocks holding slots here, lowered as blocks take slots
     * and made exact by every scan of the layer (layer_candidates). Stamps
     * only grow, so while it is at or past stale_before the layer has no
     * stale block here and its stale bucket need not be read. */
    uint64_t *lmin;
    uint8_t **slab;          /* [cap / SLAB_SLOTS + 1] memory tiers    */
    bool    *slab_head;      /* [cap / SLAB_SLOTS + 1] slab k begins its allocation
                                (a home segment's slabs share one)      */
    struct tkv_host_mem *slab_host; /* host-memory slabs (at the heads)  */
    int32_t *free_at;        /* [cap] a free slot's index in free_list, else -1 */
    bool     host_memory;    /* slabs are host memory (else backend)  */
    uint64_t used, peak;     /* bytes                                 */
};

/* Host -> GPU uploads queued with up_send and settled by up_finish: a
 * demand recall's, a staged NVMe batch's, or one of the prefetches in
 * flight. Each has its own lists, so a prefetch of the next layer can be in
 * flight while the current one is settled. */
struct up_batch {
    uint32_t sent;      /* lists [0, sent) queued                        */
    bool     on_device; /* the backend verifies (else the CPU, after)    */
    uint64_t ticket;    /* the backend's number of the last queued piece */
    uint32_t layer;     /* a prefetch's layer                            */
    void   **dst;       /* [head*max_blocks] destinations                */
    const void **src;   /* [head*max_blocks] sources                     */
    uint32_t *idx;      /* [head*max_blocks] blocks                      */
    uint8_t *bad;       /* [head*max_blocks] checksum mismatches         */
    uint32_t *crc;      /* [head*max_blocks] expected checksums          */
};
#define MAX_PREFETCH 2  /* prefetches in flight: the next layer's while the
                           current one is settled, and one more */

/* The lists of a batch, for up to n blocks (a layer's). */
static bool up_batch_alloc(struct up_batch *ub, size_t n)
{
    ub->dst = malloc(n * sizeof *ub->dst);
    ub->src = malloc(n * sizeof *ub->src);
    ub->idx = malloc(n * sizeof *ub->idx);
    ub->bad = malloc(n * sizeof *ub->bad);
    ub->crc = malloc(n * sizeof *ub->crc);
    return ub->dst && ub->src && ub->idx && ub->bad && ub->crc;
}

static void up_batch_free(struct up_batch *ub)
{
    free(ub->dst);
    free(ub->src);
    free(ub->idx);
    free(ub->bad);
    free(ub->crc);
}

/* The parts of begin_layer's time (struct tkv_kvs_stall). */
enum { PART_NONE = -1, PART_OTHER, PART_SETTLE, PART_EVICT, PART_VERIFY, PART_ISSUE, PART_WAIT, PART_NVME, PART_COUNT };

/* A candidate of the bucket whose LRU order is needed (order_victims). */
struct vkey {
    uint64_t lru;
    uint32_t pos; /* its place before: ties go the way a stable sort leaves them */
    uint32_t blk;
};

struct io_op {
    uint32_t blk;
    bool     write;
    void    *buf;
};

struct tkv_kvs {
    struct tkv_kvs_params p;
    struct tkv_backend *be;
    uint32_t S;              /* payload bytes per block               */
    uint32_t max_blocks;     /* per head                              */
    uint32_t n_blocks;       /* per head, covered by the page table   */
    uint32_t length;
    uint64_t clock;
    /* Stale blocks (next_use_distance): begin_clock[] holds the clock of the
     * last 2L begin_layers (a ring, n_begins of them so far; stale_advance);
     * a block whose LRU stamp is below stale_before, the oldest of them, was
     * not read in those begins (two decode steps). */
    uint64_t *begin_clock;
    uint64_t n_begins;
    uint64_t stale_before;
    /* Read marks (tkv_kvs_mark_reads; with the page table only, else NULL):
     * per layer two generations of [head][mark_words] bits, each stamped
     * with the clock of the begin_layer it describes (mark_clock[2 layer +
     * g], 0: none); a block marked in a generation at or past stale_before
     * is not stale. layer_begun: each layer's last begin_layer clock. */
    uint32_t *marks;         /* [2][layer][head][mark_words]          */
    uint64_t *mark_clock;    /* [layer][2]                            */
    uint64_t *layer_begun;   /* [layer]                               */
    uint32_t mark_words;     /* ceil(max_blocks / 32)                 */
    uint64_t marked_layers;  /* tkv_kvs_mark_reads calls (stats)      */
    struct blk *blk;         /* [layer][head][max_blocks]             */
    struct pool pool[TKV_TIER_COUNT];
    /* Home slots (docs/kv-layout.md, "Home slots"): while the compute tier
     * can hold every block of the context, each reserve past the blocks the
     * homes cover adds a segment of compute slots allocated in one piece, w
     * blocks for every (layer, head), head after head: block b of (layer,
     * head), b0 <= b < b0 + w, has slot first + (layer * H + head) * w + b -
     * b0 as its home and takes it whenever it takes a compute slot while the
     * home is free. So a head's blocks lie at one stride within a segment,
     * whatever order they are written in: the decode attention reads them as
     * a few strided runs (gpu/attn.cuh) instead of a table. */
    struct home_seg {
        uint32_t b0, w, first;
    } homes[MAX_HOME_SEGS];
    uint32_t n_homes;        /* segments made (each b0 the last's b0 + w)       */
    bool     homes_off;      /* no more segments (params.no_homes, or the tier
                                cannot hold the context, or MAX_HOME_SEGS made)  */
    struct tkv_kv_block_ref *refs; /* [layer][head][max_blocks] views, each layer's as
                                      its last begin_layer left them            */
    struct tkv_kv_block_ref *host_refs; /* [head][max_blocks] the current layer's blocks read
                                           on the host tier (begin_layer_split)      */
    /* Whole-layer reads (begin_layer without a selection or host reads): the
     * layer is pinned and LRU-stamped as one instead of block by block, and
     * its views are kept: while no compute slot of the layer changes hands
     * (layer_gen) only the blocks from the last one its views cover on can
     * have changed (the last grows; new ones follow). */
    uint8_t  *layer_pin;     /* [layer] 1 between a whole-layer begin and its end */
    uint64_t *layer_lru;     /* [layer] the clock of its last whole-layer read: a
                                block's LRU stamp is the later of this and its own */
    uint64_t *layer_gen;     /* [layer] bumped when one of its compute slots is
                                taken or given                               */
    uint64_t *views_gen;     /* [layer] layer_gen when refs[layer] was last made
                                complete (every block present); VIEWS_STALE: not */
    uint32_t *views_nb;      /* [layer] blocks per head those complete views covered */
    /* Selective reads (a selection or host reads; not walk_ref): each layer
     * keeps the list of blocks its last one pinned, so that end_layer unpins
     * and the next one clears the views of only those, not every block. The
     * views of a layer read this way hold block pointers only at the listed
     * entries; every other entry below sparse_nb is block_ref(b, NULL), with
     * the right length for every block but maybe the last (full blocks stay
     * full). host_refs likewise, its pointers at hlist[0, n_hlist). */
    uint32_t *sel;           /* [layer][head*max_blocks] offsets head*max_blocks + b */
    uint32_t *sel_n;         /* [layer] entries of sel                            */
    uint32_t *sparse_nb;     /* [layer] blocks per head the views were cleared for;
                                SPARSE_NONE: pointers anywhere (a whole-layer read) */
    uint32_t host_nb;        /* the same for host_refs (0: never cleared)         */
    uint32_t n_hlist;        /* host_refs entries holding pointers: hlist[0, n_hlist) */
    uint32_t *hlist;         /* [head*max_blocks] blocks read on the host tier this layer */
    const void **hdata;      /* [head*max_blocks] their payloads                  */
    uint8_t *hbad;           /* [head*max_blocks] their checksum verdicts         */
    uint32_t *chk_idx, *chk_pos; /* [head*max_blocks] check_host_copies: the copies
                                    not yet checked, and their places in the caller's list */
    const void **chk_data;   /* [head*max_blocks] their payloads                  */
    uint8_t *chk_bad;        /* [head*max_blocks] their verdicts                  */
    uint64_t host_reads;     /* blocks read in place on the host tier             */
    uint32_t cur_layer;
    /* The device page table (params.page_table; docs/kv-layout.md, "Device
     * page table"): pt_dev in backend memory, laid out as blk, entry i the
     * address of block i's compute slot while its compute copy is current,
     * else 0; pt_host what pt_dev holds. A compute slot taken or given
     * queues its block on its layer's pending list (pt_touch, from pool_take
     * and pool_give); tkv_kvs_page_table_sync writes the entries that
     * changed. NULL when off. */
    uint64_t *pt_dev, *pt_host;   /* [layer][head][max_blocks]                    */
    uint32_t *pt_pend;            /* [layer][head*max_blocks] offsets in the layer */
    uint32_t *pt_pend_n;          /* [layer]                                       */
    uint8_t  *pt_queued;          /* [layer][head][max_blocks] on its pending list */
    uint32_t *pt_idx;             /* [head*max_blocks] one sync's writes ...       */
    uint64_t *pt_val;             /* ... and their values                         */

    struct tkv_io *io;
    struct tkv_io_file *file;
    uint64_t file_size;
    uint8_t *staging;        /* staging_cap payloads, aligned: NVMe <-> GPU and export */
    uint32_t staging_cap;    /* max(IO_BATCH, 2 * stage_n)                           */
    uint32_t stage_n;        /* blocks per half of the NVMe -> GPU pipeline             */

    /* scratch sized at init: eviction candidates and I/O batches */
    uint32_t *cand[2];       /* [layer*head*max_blocks] eviction candidates per
                                memory tier (evicting compute may evict host) */
    uint32_t *lists;         /* [2 * head*max_blocks] recall and new-block lists */
    uint32_t *order_tmp;     /* [layer*head*max_blocks] eviction ordering     */
    uint32_t *order_count;   /* [2 layer + 1]                                 */
    uint32_t *grp_end;       /* [2 layer] collect_candidates: where each bucket taken ends */
    uint32_t n_grp;
    struct vkey *vkeys;      /* [head*max_blocks] eviction: one layer's candidates by LRU */
    uint8_t *run_below;      /* [max_blocks] import_n: run block j goes below compute */
    struct io_op *ops;       /* [IO_BATCH] */
    int64_t *results;        /* [IO_BATCH] */

    struct tkv_tier_stats st[TKV_TIER_COUNT];
    double stall;
    /* the stall's split: inside begin_layer every moment is charged to the
     * part in `part` (PART_NONE outside: nothing is timed or counted) */
    int    part;
    double part_t;           /* when the current part started        */
    double part_s[PART_COUNT];
    struct tkv_kvs_stall sc; /* the counts (times are in part_s)      */
    uint64_t prefetched, corrupt;
    uint64_t bulk_blocks;    /* stored by import_n's one-pass path             */
    uint32_t n_inflight;     /* prefetch reads not yet completed */
    uint32_t *inflight_reads; /* [layer] of them, per layer        */
    bool     broken;         /* the I/O engine lost ops: refuse further work */

    /* Below a GPU whose backend queues block uploads (upload_blocks): a
     * layer's host-tier blocks go up in one asynchronous batch while their
     * checksums are verified on a few CPU threads. */
    bool     async_up;
    struct up_batch dm;      /* demand recalls and staged NVMe batches       */
    struct up_batch pf[MAX_PREFETCH]; /* prefetches in flight, oldest first  */
    uint32_t n_pf;
    uint32_t up_piece;       /* blocks per upload piece                      */
    struct tkv_pool *crc_pool; /* NULL: verify on the calling thread        */
    bool     staging_registered; /* page-locked by us (unregister at free)   */
    bool     staging_async;  /* NVMe recalls go up with upload_blocks         */
    bool     dev_crc_no;     /* the backend refused to check blocks of this size
                                (TKV_ERR_UNSUPPORTED, once): the CPU checks them,
                                the device is not asked again                  */
};

/* ---- small helpers ------------------------------------------------------------ */

#define VIEWS_STALE UINT64_MAX
#define SPARSE_NONE UINT32_MAX

/* A block's LRU stamp and its compute pin, the per-block state combined with
 * its layer's (whole-layer reads set only the layer's). */
static inline uint64_t blk_lru(const struct tkv_kvs *s, uint32_t i)
{
    const struct blk *k = &s->blk[i];
    return TKV_MAX(k->lru, s->layer_lru[k->layer]);
}

static inline bool blk_pinned(const struct tkv_kvs *s, const struct blk *k)
{
    return k->pinned || s->layer_pin[k->layer];
}

/* The view entry of block b whose payload (K then V) is at p, or an entry
 * without pointers (p NULL: the block is not read from there). */
static struct tkv_kv_block_ref block_ref(const struct tkv_kvs *s, uint32_t b, uint8_t *p)
{
    const uint32_t B = s->p.block_tokens;
    return (struct tkv_kv_block_ref){.k = (uint16_t *)p, .v = p ? (uint16_t *)p + (size_t)B * s->p.head_dim : NULL,
                                     .pos0 = (int32_t)(b * B), .n = TKV_MIN(B, s->length - b * B)};
}


static uint32_t blk_index(const struct tkv_kvs *s, uint32_t layer, uint32_t head, uint32_t b)
{
    return ((layer * s->p.n_head_kv) + head) * s->max_blocks + b;
}

static void blk_coords(const struct tkv_kvs *s, uint32_t i, uint32_t *layer, uint32_t *head, uint32_t *b)
{
    *b = i % s->max_blocks;
    *head = (i / s->max_blocks) % s->p.n_head_kv;
    *layer = i / s->max_blocks / s->p.n_head_kv;
}

static uint8_t *slot_ptr(const struct tkv_kvs *s, int t, int32_t slot)
{
    return s->pool[t].slab[slot / SLAB_SLOTS] + (size_t)(slot % SLAB_SLOTS) * s->S;
}

static tkv_status block_error(const struct tkv_kvs *s, tkv_status st, uint32_t i, const char *what)
{
    uint32_t l, h, b;
    blk_coords(s, i, &l, &h, &b);
    return tkv_err(st, "kv-store: block (layer %u, head %u, block %u): %s", l, h, b, what);
}

/* Charges the time since the last switch to the current part and makes
 * `to` current; returns the part that was current (to switch back to).
 * Outside begin_layer (PART_NONE) it does nothing. */
static int part_switch(struct tkv_kvs *s, int to)
{
    const int from = s->part;
    if (from == PART_NONE)
        return PART_NONE;
    const double now = tkv_now_seconds();
    s->part_s[from] += now - s->part_t;
    s->part_t = now;
    s->part = to;
    return from;
}

/* Counts stall work (only inside begin_layer). */
#define STALL_COUNT(s, field, n) ((s)->part != PART_NONE ? (void)((s)->sc.field += (n)) : (void)0)

/* ---- slot pools ---------------------------------------------------------------- */

static tkv_status pool_init(struct pool *pl, uint32_t cap, bool host_memory, uint32_t n_layer, bool layer_maps)
{
    pl->present = true;
    pl->cap = cap;
    pl->host_memory = host_memory;
    pl->free_list = malloc((size_t)cap * sizeof *pl->free_list);
    pl->owner = malloc((size_t)cap * sizeof *pl->owner);
    pl->slot_layer = malloc((size_t)cap * sizeof *pl->slot_layer);
    pl->layer_used = calloc(n_layer, sizeof *pl->layer_used);
    pl->slab = calloc(cap / SLAB_SLOTS + 1, sizeof *pl->slab);
    pl->slab_head = calloc(cap / SLAB_SLOTS + 1, sizeof *pl->slab_head);
    pl->slab_host = calloc(cap / SLAB_SLOTS + 1, sizeof *pl->slab_host);
    pl->free_at = malloc((size_t)cap * sizeof *pl->free_at);
    if (layer_maps) { /* n_layer * cap bits: 1 MiB for 32 layers of 262K slots */
        pl->words = (cap + 63) / 64;
        pl->sum_words = (pl->words + 63) / 64;
        pl->lmap = calloc((size_t)n_layer * pl->words, sizeof *pl->lmap);
        pl->lsum = calloc((size_t)n_layer * pl->sum_words, sizeof *pl->lsum);
        pl->lmin = calloc(n_layer, sizeof *pl->lmin);
    }
    if (!pl->free_list || !pl->owner || !pl->slot_layer || !pl->layer_used || !pl->slab || !pl->slab_head ||
        !pl->slab_host || !pl->free_at ||
        (layer_maps && (!pl->lmap || !pl->lsum || !pl->lmin)))
        return tkv_err(TKV_ERR_NOMEM, "kv-store: out of memory for a slot table");
    for (uint32_t i = 0; i < cap; i++) {
        pl->owner[i] = -1;
        pl->slot_layer[i] = (uint16_t)n_layer;
        pl->free_at[i] = -1;
    }
    return TKV_OK;
}

/* Makes slots [first, first + count) free: under the slots already free
 * (the list is a stack), lowest first, so a fresh slot is taken only when
 * every lower one is in use -- the NVMe tier's file then never needs more
 * than its peak use, and no hole of free slots below the growth tells the
 * disk to hold more. */
static void pool_add_free(struct pool *pl, uint32_t first, uint32_t count)
{
    memmove(pl->free_list + count, pl->free_list, pl->n_free * sizeof *pl->free_list);
    for (uint32_t j = count; j < count + pl->n_free; j++)
        pl->free_at[pl->free_list[j]] = (int32_t)j;
    for (uint32_t i = 0; i < count; i++) {
        pl->free_list[i] = (int32_t)(first + count - 1 - i);
        pl->free_at[first + count - 1 - i] = (int32_t)i;
    }
    pl->n_free += count;
    pl->n += count;
}

/* Allocates `bytes` of tier t's memory for the slabs from k on (one piece
 * at slab_host[k] or slab[k]); *base its address. */
static tkv_status slab_alloc(struct tkv_kvs *s, int t, uint32_t k, size_t bytes, uint8_t **base)
{
    struct pool *pl = &s->pool[t];
    if (pl->host_memory) {
        TKV_TRY(tkv_host_mem_alloc(bytes, s->p.pci_bus_id, &pl->slab_host[k]));
        /* below a GPU: page-lock it so copies to the device are asynchronous DMA */
        if (t == TKV_TIER_HOST && s->be->ops->host_register) {
            tkv_status st = s->be->ops->host_register(s->be, pl->slab_host[k].ptr, bytes);
            if (st != TKV_OK) {
                tkv_host_mem_free(&pl->slab_host[k]);
                return tkv_err_wrap(st, "kv-store: registering %zu bytes of host KV with %s", bytes,
                                    s->be->ops->name);
            }
        }
        *base = pl->slab_host[k].ptr;
        return TKV_OK;
    }
    void *p;
    tkv_status st = s->be->ops->alloc(s->be, bytes, &p);
    if (st != TKV_OK)
        return tkv_err_wrap(st, "kv-store: %s tier slab of %zu bytes", tier_names[t], bytes);
    *base = p;
    return TKV_OK;
}

/* Makes `want` slots usable: allocates slabs (memory tiers) or just
 * counts them (nvme). */
static tkv_status pool_grow(struct tkv_kvs *s, int t, uint32_t want)
{
    struct pool *pl = &s->pool[t];
    want = TKV_MIN(want, pl->cap);
    while (pl->n < want) {
        uint32_t first = pl->n, count = TKV_MIN(SLAB_SLOTS, pl->cap - first);
        if (t != TKV_TIER_NVME) {
            const uint32_t k = first / SLAB_SLOTS;
            TKV_TRY(slab_alloc(s, t, k, (size_t)count * s->S, &pl->slab[k]));
            pl->slab_head[k] = true;
        }
        pool_add_free(pl, first, count);
    }
    return TKV_OK;
}

/* The home slot of block i (-1: none; the struct's comment). */
static int32_t home_slot(const struct tkv_kvs *s, uint32_t i)
{
    uint32_t l, h, b;
    blk_coords(s, i, &l, &h, &b);
    for (uint32_t k = s->n_homes; k-- > 0;) {
        const struct home_seg *g = &s->homes[k];
        if (b >= g->b0)
            return b - g->b0 < g->w ? (int32_t)(g->first + ((uint64_t)l * s->p.n_head_kv + h) * g->w + (b - g->b0))
                                    : -1;
    }
    return -1;
}

/* Covers blocks [end, n_blocks) of every head with a home segment (end:
 * what the segments cover already), where the compute tier can hold every
 * block of the context: w blocks a head, at least what the reserve needs,
 * HOME_MIN_W and end / 2 (so a context grown token by token makes a few
 * segments, each head a few runs), within the tier's capacity; one
 * allocation, its slots free. A tier that cannot hold the context, or one
 * grown by plain slabs to a point off a slab boundary, gets no homes. */
static tkv_status homes_grow(struct tkv_kvs *s)
{
    struct pool *pl = &s->pool[TKV_TIER_COMPUTE];
    const uint64_t LH = (uint64_t)s->p.n_layer * s->p.n_head_kv;
    const struct home_seg *last = s->n_homes ? &s->homes[s->n_homes - 1] : NULL;
    const uint32_t end = last ? last->b0 + last->w : 0;
    if (s->homes_off || s->n_blocks <= end)
        return TKV_OK;
    const uint32_t need = s->n_blocks - end;
    if (pl->cap < LH * s->max_blocks || pl->n % SLAB_SLOTS || s->n_homes == MAX_HOME_SEGS ||
        (uint64_t)pl->n + LH * need > pl->cap) {
        s->homes_off = true;
        return TKV_OK;
    }
    uint64_t w = TKV_MAX(TKV_MAX(need, HOME_MIN_W), end / 2);
    w = TKV_MIN(w, s->max_blocks - end);
    w = TKV_MIN(w, (pl->cap - pl->n) / LH);
    const uint32_t first = pl->n, count = (uint32_t)TKV_MIN((LH * w + SLAB_SLOTS - 1) / SLAB_SLOTS * SLAB_SLOTS,
                                                            (uint64_t)pl->cap - first);
    const uint32_t k0 = first / SLAB_SLOTS;
    uint8_t *base = NULL;
    if (slab_alloc(s, TKV_TIER_COMPUTE, k0, (size_t)count * s->S, &base) != TKV_OK) {
        /* no piece that large: plain slabs from here on (pool_grow reports
         * what it cannot allocate) */
        TKV_LOG_W("%s; the KV blocks go to slabs of %u without home slots", tkv_last_error(), SLAB_SLOTS);
        s->homes_off = true;
        return TKV_OK;
    }
    pl->slab_head[k0] = true;
    for (uint32_t j = 0; (uint64_t)j * SLAB_SLOTS < count; j++)
        pl->slab[k0 + j] = base + (size_t)j * SLAB_SLOTS * s->S;
    pool_add_free(pl, first, count);
    s->homes[s->n_homes++] = (struct home_seg){.b0 = end, .w = (uint32_t)w, .first = first};
    return TKV_OK;
}

/* Takes free slot `slot` off the free list (its place goes to the list's top). */
static void pool_take_free(struct pool *pl, int32_t slot)
{
    const int32_t j = pl->free_at[slot], top = pl->free_list[pl->n_free - 1];
    pl->free_list[j] = top;
    pl->free_at[top] = j;
    pl->n_free--;
    pl->free_at[slot] = -1;
}

/* Queues block i for the next page-table sync of its layer (its compute
 * slot changed hands). */
static void pt_touch(struct tkv_kvs *s, uint32_t i)
{
    if (!s->pt_dev || s->pt_queued[i])
        return;
    const uint64_t layer_blocks = (uint64_t)s->p.n_head_kv * s->max_blocks;
    const uint32_t layer = s->blk[i].layer;
    s->pt_queued[i] = 1;
    s->pt_pend[layer * layer_blocks + s->pt_pend_n[layer]++] = (uint32_t)(i - layer * layer_blocks);
}

static int32_t pool_take(struct tkv_kvs *s, int t, uint32_t owner)
{
    struct pool *pl = &s->pool[t];
    if (pl->n_free == 0)
        return -1;
    const int32_t home = t == TKV_TIER_COMPUTE && s->n_homes ? home_slot(s, owner) : -1;
    int32_t slot;
    if (home >= 0 && pl->free_at[home] >= 0) {
        slot = home;
        pool_take_free(pl, slot);
    } else {
        slot = pl->free_list[--pl->n_free];
        pl->free_at[slot] = -1;
    }
    if (t == TKV_TIER_COMPUTE) {
        s->layer_gen[s->blk[owner].layer]++;
        pt_touch(s, owner);
    }
    if (t == TKV_TIER_HOST) /* a new host copy: not checked yet */
        s->blk[owner].hchecked = 0;
    pl->owner[slot] = (int32_t)owner;
    const uint32_t layer = s->blk[owner].layer;
    pl->slot_layer[slot] = (uint16_t)layer;
    pl->layer_used[layer]++;
    if (pl->lmap) {
        const uint32_t w = (uint32_t)slot / 64;
        pl->lmap[(size_t)layer * pl->words + w] |= 1ull << (slot % 64);
        pl->lsum[(size_t)layer * pl->sum_words + w / 64] |= 1ull << (w % 64);
        pl->lmin[layer] = TKV_MIN(pl->lmin[layer], blk_lru(s, owner));
    }
    pl->used += s->S;
    pl->peak = TKV_MAX(pl->peak, pl->used);
    return slot;
}

static void pool_give(struct tkv_kvs *s, int t, int32_t slot)
{
    struct pool *pl = &s->pool[t];
    if (t == TKV_TIER_COMPUTE) {
        s->layer_gen[pl->slot_layer[slot]]++;
        pt_touch(s, (uint32_t)pl->owner[slot]);
    }
    if (t == TKV_TIER_HOST)
        s->blk[pl->owner[slot]].hchecked = 0;
    const uint32_t layer = pl->slot_layer[slot];
    pl->layer_used[layer]--;
    if (pl->lmap) {
        const uint32_t w = (uint32_t)slot / 64;
        uint64_t *word = &pl->lmap[(size_t)layer * pl->words + w];
        *word &= ~(1ull << (slot % 64));
        if (!*word)
            pl->lsum[(size_t)layer * pl->sum_words + w / 64] &= ~(1ull << (w % 64));
    }
    pl->slot_layer[slot] = (uint16_t)s->p.n_layer;
    pl->owner[slot] = -1;
    pl->free_at[slot] = (int32_t)pl->n_free;
    pl->free_list[pl->n_free++] = slot;
    pl->used -= s->S;
}

static void pool_free(struct tkv_kvs *s, int t)
{
    struct pool *pl = &s->pool[t];
    if (pl->slab)
        for (uint32_t k = 0; k * SLAB_SLOTS < pl->n; k++) {
            if (!pl->slab_head[k])
                continue; /* inside a home segment's allocation */
            if (pl->host_memory && t == TKV_TIER_HOST && s->be->ops->host_unregister && pl->slab[k])
                s->be->ops->host_unregister(s->be, pl->slab[k]);
            if (pl->host_memory)
                tkv_host_mem_free(&pl->slab_host[k]);
            else if (pl->slab[k])
                s->be->ops->release(s->be, pl->slab[k]);
        }
    free(pl->free_list);
    free(pl->owner);
    free(pl->slot_layer);
    free(pl->layer_used);
    free(pl->lmap);
    free(pl->lsum);
    free(pl->lmin);
    free(pl->slab);
    free(pl->slab_head);
    free(pl->slab_host);
    free(pl->free_at);
}

/* Drops a block's copy on tier t (slot back to the pool). */
static void drop_copy(struct tkv_kvs *s, uint32_t i, int t)
{
    struct blk *k = &s->blk[i];
    if (k->slot[t] >= 0)
        pool_give(s, t, k->slot[t]);
    k->slot[t] = -1;
    k->valid &= (uint8_t)~BIT(t);
}

/* ---- moving payloads between memory tiers ---------------------------------- */

/* compute slot -> host buffer */
static tkv_status compute_to_host(struct tkv_kvs *s, int32_t cslot, void *dst)
{
    const uint8_t *src = slot_ptr(s, TKV_TIER_COMPUTE, cslot);
    if (s->p.compute_is_host) {
        memcpy(dst, src, s->S);
        return TKV_OK;
    }
    return s->be->ops->download(s->be, dst, src, s->S);
}

/* host buffer -> compute slot */
static tkv_status host_to_compute(struct tkv_kvs *s, const void *src, int32_t cslot)
{
    uint8_t *dst = slot_ptr(s, TKV_TIER_COMPUTE, cslot);
    if (s->p.compute_is_host) {
        const int prev = part_switch(s, PART_ISSUE);
        memcpy(dst, src, s->S);
        part_switch(s, prev);
        return TKV_OK;
    }
    const int prev = part_switch(s, PART_ISSUE);
    STALL_COUNT(s, upload_calls, 1);
    tkv_status st = s->be->ops->upload(s->be, dst, src, s->S);
    part_switch(s, prev);
    return st;
}

/* ---- NVMe batches ------------------------------------------------------------- */

/* Tags: batch ops are (index << 1), prefetches (block << 1) | 1. */
static void prefetch_complete(struct tkv_kvs *s, const struct tkv_io_cqe *c);

/* Runs n ops (n <= IO_BATCH) against the spill file; results[j] is op j's
 * result (S or -errno). Returns the first failure as a status naming the
 * block. */
static tkv_status nvme_run(struct tkv_kvs *s, struct io_op *ops, uint32_t n, int64_t *results)
{
    uint32_t queued = 0, done = 0;
    for (uint32_t j = 0; j < n; j++)
        results[j] = -EINPROGRESS;
    while (done < n) {
        while (queued < n) {
            const struct io_op *op = &ops[queued];
            uint64_t off = (uint64_t)s->blk[op->blk].slot[TKV_TIER_NVME] * s->S;
            int rc = op->write ? tkv_io_write(s->io, s->file, op->buf, s->S, off, (uint64_t)queued << 1)
                               : tkv_io_read(s->io, s->file, op->buf, s->S, off, (uint64_t)queued << 1);
            if (rc == -EAGAIN)
                break;
            if (rc < 0) {
                results[queued] = rc;
                done++;
            }
            queued++;
        }
        int rc = tkv_io_submit(s->io);
        struct tkv_io_cqe cqe[IO_BATCH];
        int got = rc < 0 ? rc : tkv_io_wait(s->io, 1, cqe, IO_BATCH);
        if (got < 0 || (got == 0 && queued == n)) { /* the engine failed, or lost ops */
            for (uint32_t j = 0; j < n; j++)
                if (results[j] == -EINPROGRESS)
                    results[j] = got < 0 ? got : -EIO;
            break;
        }
        for (int c = 0; c < got; c++) {
            if (cqe[c].user_tag & 1) {
                prefetch_complete(s, &cqe[c]);
                continue;
            }
            uint64_t j = cqe[c].user_tag >> 1;
            if (j < n && results[j] == -EINPROGRESS) {
                results[j] = cqe[c].result;
                done++;
            }
        }
    }
    for (uint32_t j = 0; j < n; j++) {
        if (results[j] == (int64_t)s->S)
            continue;
        tkv_status st = results[j] < 0 ? tkv_io_status((int)results[j], ops[j].write ? "spill write" : "recall read")
                                       : tkv_err(TKV_ERR_IO, "io: short transfer of %lld bytes", (long long)results[j]);
        uint32_t l, h, b;
        blk_coords(s, ops[j].blk, &l, &h, &b);
        return tkv_err_wrap(st, "kv-store: nvme tier, block (layer %u, head %u, block %u)", l, h, b);
    }
    return TKV_OK;
}

/* An NVMe slot for block i (assigned on first spill, kept while the block lives). */
static tkv_status nvme_slot(struct tkv_kvs *s, uint32_t i)
{
    struct blk *k = &s->blk[i];
    if (k->slot[TKV_TIER_NVME] >= 0)
        return TKV_OK;
    if (s->pool[TKV_TIER_NVME].n_free == 0) /* bookkeeping only: the file grows below */
        TKV_TRY(pool_grow(s, TKV_TIER_NVME, s->pool[TKV_TIER_NVME].n + 1));
    int32_t slot = pool_take(s, TKV_TIER_NVME, i);
    if (slot < 0)
        return block_error(s, TKV_ERR_NOMEM, i, "the NVMe tier is full (raise --nvme-kv-max)");
    k->slot[TKV_TIER_NVME] = slot;
    uint64_t end = ((uint64_t)slot + 1) * s->S;
    if (end > s->file_size) { /* grow in large steps: a reserve, not per block */
        uint64_t want = TKV_MIN((uint64_t)s->pool[TKV_TIER_NVME].cap * s->S, TKV_MAX(end, s->file_size * 2));
        int rc = tkv_io_file_resize(s->file, want);
        if (rc == -ENOSPC && want > end) /* the disk may hold the slot but not the doubled reserve */
            rc = tkv_io_file_resize(s->file, want = end);
        if (rc < 0) {
            drop_copy(s, i, TKV_TIER_NVME);
            return tkv_io_status(rc, "kv-store: growing the spill file");
        }
        s->file_size = want;
    }
    return TKV_OK;
}

/* ---- demotion: compute -> host -> nvme --------------------------------------------- */

static tkv_status make_room(struct tkv_kvs *s, int t, uint32_t need);

/* Writes blocks idx[0..n) (host-tier copies, or compute copies on a host
 * compute tier) to NVMe in one batch; blocks that fail keep their copy. */
static tkv_status spill_to_nvme(struct tkv_kvs *s, int from, const uint32_t *idx, uint32_t n)
{
    tkv_status first = TKV_OK;
    uint32_t m = 0;
    for (uint32_t j = 0; j < n; j++) {
        uint32_t i = idx[j];
        struct blk *k = &s->blk[i];
        tkv_status st = nvme_slot(s, i);
        if (st != TKV_OK) {
            first = first == TKV_OK ? st : first;
            continue;
        }
        void *buf;
        if (from == TKV_TIER_COMPUTE && !s->p.compute_is_host) { /* through the staging buffer */
            buf = s->staging + (size_t)m * s->S;
            st = compute_to_host(s, k->slot[TKV_TIER_COMPUTE], buf);
            if (st != TKV_OK) {
                first = first == TKV_OK ? st : first;
                continue;
            }
        } else {
            buf = slot_ptr(s, from, k->slot[from]);
        }
        if (!(k->valid & (BIT(TKV_TIER_HOST) | BIT(TKV_TIER_NVME))))
            k->crc = tkv_crc32c(0, buf, s->S); /* first copy below compute: checksum it */
        s->ops[m++] = (struct io_op){.blk = i, .write = true, .buf = buf};
    }
    if (m == 0)
        return first;
    tkv_status st = nvme_run(s, s->ops, m, s->results);
    for (uint32_t j = 0; j < m; j++) {
        if (s->results[j] == (int64_t)s->S) {
            s->blk[s->ops[j].blk].valid |= BIT(TKV_TIER_NVME);
            s->st[TKV_TIER_NVME].bytes_in += s->S;
        }
    }
    return first != TKV_OK ? first : st;
}

/* The checksums of n payloads data[j] of blocks idx[j]: recorded into the
 * blocks' crc fields (bad == NULL), or compared with them (bad[j] = 1 where
 * they differ); spread over the CRC threads when there are enough bytes. */
struct crc_job {
    struct tkv_kvs *s;
    const uint32_t *idx;
    const void *const *data;
    uint8_t *bad;
    uint32_t n;
};

static void crc_part(void *ctx, uint32_t ith, uint32_t nth)
{
    const struct crc_job *j = ctx;
    uint64_t b, e;
    tkv_split(j->n, ith, nth, &b, &e);
    for (uint64_t r = b; r < e; r++) {
        const uint32_t c = tkv_crc32c(0, j->data[r], j->s->S);
        if (j->bad)
            j->bad[r] = c != j->s->blk[j->idx[r]].crc;
        else
            j->s->blk[j->idx[r]].crc = c;
    }
}

static void crc_run(struct tkv_kvs *s, const uint32_t *idx, const void *const *data, uint32_t n, uint8_t *bad)
{
    struct crc_job job = {s, idx, data, bad, n};
    if (s->crc_pool && (uint64_t)n * s->S >= (1u << 20))
        tkv_pool_run(s->crc_pool, crc_part, &job);
    else
        crc_part(&job, 0, 1);
}

static void crc_batch(struct tkv_kvs *s, const uint32_t *idx, const void *const *data, uint32_t n)
{
    crc_run(s, idx, data, n, NULL);
}

/* Copies compute-tier blocks idx[0..n) (n <= IO_BATCH) to the host tier
 * (GPU compute only): one download_blocks for the batch where the backend
 * has it (else one download each), then the checksums of those without an
 * NVMe copy on the CRC threads. On failure none of them gets a host copy. */
static tkv_status spill_to_host(struct tkv_kvs *s, const uint32_t *idx, uint32_t n)
{
    TKV_TRY(make_room(s, TKV_TIER_HOST, n));
    void *dst[IO_BATCH];
    const void *src[IO_BATCH];
    uint32_t sum_idx[IO_BATCH], n_sum = 0;
    const void *sum_data[IO_BATCH];
    tkv_status st = TKV_OK;
    uint32_t taken = 0;
    for (; taken < n; taken++) {
        const uint32_t i = idx[taken];
        struct blk *k = &s->blk[i];
        int32_t hs = pool_take(s, TKV_TIER_HOST, i);
        if (hs < 0) {
            st = block_error(s, TKV_ERR_NOMEM, i, "no host-tier slot");
            break;
        }
        k->slot[TKV_TIER_HOST] = hs;
        dst[taken] = slot_ptr(s, TKV_TIER_HOST, hs);
        src[taken] = slot_ptr(s, TKV_TIER_COMPUTE, k->slot[TKV_TIER_COMPUTE]);
        if (!(k->valid & BIT(TKV_TIER_NVME))) {
            sum_idx[n_sum] = i;
            sum_data[n_sum++] = dst[taken];
        }
    }
    if (st == TKV_OK && s->be->ops->download_blocks)
        st = s->be->ops->download_blocks(s->be, dst, src, n, s->S);
    else
        for (uint32_t j = 0; st == TKV_OK && j < n; j++)
            st = s->be->ops->download(s->be, dst[j], src[j], s->S);
    if (st != TKV_OK) {
        for (uint32_t j = 0; j < taken; j++)
            drop_copy(s, idx[j], TKV_TIER_HOST);
        return st;
    }
    const int prev = part_switch(s, PART_VERIFY);
    STALL_COUNT(s, verify_bytes, (uint64_t)n_sum * s->S);
    crc_batch(s, sum_idx, sum_data, n_sum);
    part_switch(s, prev);
    for (uint32_t j = 0; j < n; j++)
        s->blk[idx[j]].valid |= BIT(TKV_TIER_HOST);
    s->st[TKV_TIER_HOST].bytes_in += (uint64_t)n * s->S;
    return TKV_OK;
}

/* Whether a read mark at or past stale_before names block i (the store's
 * rows are blk's index, [layer][head] rows of max_blocks bits). */
static bool read_marked(const struct tkv_kvs *s, uint32_t i)
{
    if (!s->marks)
        return false;
    const uint32_t row = i / s->max_blocks, b = i - row * s->max_blocks, layer = s->blk[i].layer;
    const size_t gen_words = (size_t)s->p.n_layer * s->p.n_head_kv * s->mark_words;
    for (uint32_t g = 0; g < 2; g++)
        if (s->mark_clock[2 * layer + g] >= s->stale_before &&
            (s->marks[g * gen_words + (size_t)row * s->mark_words + b / 32] >> (b % 32)) & 1u)
            return true;
    return false;
}

/* Block i with LRU stamp lru (blk_lru's) is stale: not read in the last two
 * steps by its stamp nor by its read marks. */
static inline bool blk_stale_at(const struct tkv_kvs *s, uint32_t i, uint64_t lru)
{
    return lru < s->stale_before && s->blk[i].layer != s->cur_layer && !read_marked(s, i);
}

static inline bool blk_stale(const struct tkv_kvs *s, uint32_t i)
{
    return blk_stale_at(s, i, blk_lru(s, i));
}

/* A begin_layer at s->clock: the ring of the last 2L begins' clocks, and
 * what is stale from here on (nothing with evict_cycle). */
static void stale_advance(struct tkv_kvs *s)
{
    const uint32_t R = 2 * s->p.n_layer;
    s->begin_clock[s->n_begins++ % R] = s->clock;
    s->stale_before = s->n_begins >= R && !s->p.evict_cycle ? s->begin_clock[s->n_begins % R] : 0;
}

/* Layers are used in a cycle (0, 1, ..., L-1, 0, ...), so the block needed
 * last is the one whose layer comes furthest after the current one: evicting
 * in that order is Belady's optimal choice for the forward pass when every
 * block is read at every step. A selection reads a few blocks per step, and
 * mostly the same ones from one step to the next: a block it has not read
 * for two steps (stale: its stamp below stale_before) is taken to be needed
 * a cycle later than its layer's turn (distance + L), so the victims are
 * first the stale blocks, farthest layer first, then the rest in layer
 * order -- not the blocks a farther layer read this step while nearer
 * layers hold blocks no step reads. A reader that reads blocks in place
 * without a begin_layer naming them (the device decode table selects on the
 * GPU; docs/kv-layout.md) tells the store afterwards (tkv_kvs_mark_reads),
 * so the current layer's blocks, whose reads may not be told yet, are never
 * stale: they go last, as in the cycle. Dense reads leave nothing stale
 * (the order is the cycle's).
 * Distances are < 2L; blocks of one distance tie and fall back to least
 * recently used. */
static inline uint32_t next_use_distance(const struct tkv_kvs *s, uint32_t i)
{
    const uint32_t layer = s->blk[i].layer; /* both < n_layer */
    const uint32_t d = layer >= s->cur_layer ? layer - s->cur_layer : layer + s->p.n_layer - s->cur_layer;
    return blk_stale(s, i) ? d + s->p.n_layer : d;
}

static bool vkey_less(const struct vkey *a, const struct vkey *b)
{
    return a->lru < b->lru || (a->lru == b->lru && a->pos < b->pos);
}

static int vkey_cmp(const void *a, const void *b)
{
    const struct vkey *x = a, *y = b;
    return vkey_less(x, y) ? -1 : vkey_less(y, x);
}

static void vkey_sift(struct vkey *a, uint32_t i, uint32_t n)
{
    for (;;) {
        uint32_t c = 2 * i + 1;
        if (c >= n)
            return;
        if (c + 1 < n && vkey_less(&a[c], &a[c + 1]))
            c++;
        if (!vkey_less(&a[i], &a[c]))
            return;
        const struct vkey x = a[i];
        a[i] = a[c], a[c] = x;
        i = c;
    }
}

/* Sorts a[0..n) by vkey_less in place (heapsort). glibc's qsort may malloc
 * a buffer, and eviction runs at every decode step; the keys are distinct
 * (pos), so any correct sort gives qsort's order (evict_ref keeps qsort: the
 * lockstep test compares the two). */
static void vkey_sort(struct vkey *a, uint32_t n)
{
    for (uint32_t i = n / 2; i-- > 0;)
        vkey_sift(a, i, n);
    for (uint32_t end = n; end > 1;) {
        end--;
        const struct vkey x = a[0];
        a[0] = a[end], a[end] = x;
        vkey_sift(a, 0, end);
    }
}

/* Rearranges a[0..n) so that a[0..r) hold its r least keys (in no
 * particular order); 0 < r < n. Quickselect (Hoare partition, median of
 * three); the keys are distinct (pos). */
static void vkey_select(struct vkey *a, uint32_t n, uint32_t r)
{
    int64_t lo = 0, hi = (int64_t)n - 1;
    const int64_t t = (int64_t)r - 1; /* the place of the r-th least */
    while (lo < hi) {
        const int64_t mid = lo + (hi - lo) / 2;
        struct vkey x;
#define VSWAP(i, j) (x = a[i], a[i] = a[j], a[j] = x)
        if (vkey_less(&a[mid], &a[lo]))
            VSWAP(mid, lo);
        if (vkey_less(&a[hi], &a[lo]))
            VSWAP(hi, lo);
        if (vkey_less(&a[hi], &a[mid]))
            VSWAP(hi, mid);
        const struct vkey pv = a[mid];
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (vkey_less(&a[i], &pv))
                i++;
            while (vkey_less(&pv, &a[j]))
                j--;
            if (i <= j) {
                VSWAP(i, j);
                i++, j--;
            }
        }
#undef VSWAP
        if (t <= j)
            hi = j;
        else if (t >= i)
            lo = i;
        else
            return;
    }
}

/* Orders by LRU the one bucket of cand that straddles the first `want`
 * places: buckets are [end[d-1], end[d]) (end[-1] = 0), farthest first.
 * Only the bucket's first places up to `exact` are put in order (ties in
 * LRU keep the order cand had, as a stable sort leaves them); its blocks
 * past that are the right ones in no particular order. Nothing moves when
 * all its blocks were last used together (a whole layer). */
static void order_cut(struct tkv_kvs *s, uint32_t *cand, const uint32_t *end, uint32_t n_buckets, uint32_t want,
                      uint32_t exact)
{
    uint32_t begin = 0;
    for (uint32_t d = 0; d < n_buckets; begin = end[d], d++) {
        if (end[d] <= want || end[d] == begin)
            continue;
        const uint32_t m = end[d] - begin;
        /* one bucket is one layer: at most head*max_blocks blocks */
        struct vkey *key = s->vkeys;
        uint64_t lo = UINT64_MAX, hi = 0;
        for (uint32_t j = 0; j < m; j++) {
            key[j] = (struct vkey){.lru = blk_lru(s, cand[begin + j]), .pos = j, .blk = cand[begin + j]};
            lo = TKV_MIN(lo, key[j].lru);
            hi = TKV_MAX(hi, key[j].lru);
        }
        if (lo == hi)
            break;
        const uint32_t r = exact > begin ? TKV_MIN(m, exact - begin) : 0;
        if (r < m && r > 0)
            vkey_select(key, m, r);
        if (s->p.evict_ref)
            qsort(key, r, sizeof *key, vkey_cmp);
        else
            vkey_sort(key, r);
        for (uint32_t j = 0; j < m; j++)
            cand[begin + j] = key[j].blk;
        break;
    }
}

/* Puts the victims first in cand[0..n): by next-use distance, farthest
 * first (a counting sort over the L distances, O(n)), and by LRU inside the
 * one distance bucket that straddles the first `want` (order_cut): only
 * cand[0..exact) (exact >= want) is in that order. Sorting all n with a
 * comparator cost several milliseconds per layer at 100K blocks, as much as
 * the recall itself; the bucket's first places are now selected (O(bucket))
 * and only they sorted. A list already in bucket order (collect_candidates'
 * scoped pass: a layer after another, farthest first) goes straight to
 * order_cut with its layers' ends (evict_for): the stable counting sort
 * would leave it as it is. */
static void order_victims(struct tkv_kvs *s, uint32_t *cand, uint32_t n, uint32_t want, uint32_t exact)
{
    const uint32_t D = 2 * s->p.n_layer; /* distances */
    uint32_t *count = s->order_count, *tmp = s->order_tmp;
    if (s->p.evict_ref)
        exact = n;
    memset(count, 0, (D + 1) * sizeof *count);
    for (uint32_t j = 0; j < n; j++)
        count[D - 1 - next_use_distance(s, cand[j]) + 1]++; /* bucket 0: farthest */
    for (uint32_t d = 1; d <= D; d++)
        count[d] += count[d - 1];
    for (uint32_t j = 0; j < n; j++)
        tmp[count[D - 1 - next_use_distance(s, cand[j])]++] = cand[j];
    memcpy(cand, tmp, (size_t)n * sizeof *cand);
    order_cut(s, cand, count, D, want, exact); /* count[d] is now the end of bucket d */
}

/* Whether block i, holding a slot on memory tier t, may be evicted now. */
static inline bool evictable(const struct tkv_kvs *s, int t, int32_t i, bool clean_only)
{
    const struct blk *k = &s->blk[i];
    /* pinning is about compute residency: a pinned block's host copy may go */
    return !(t == TKV_TIER_COMPUTE && blk_pinned(s, k)) && !(t == TKV_TIER_HOST && k->hpinned) && !k->inflight &&
           (!clean_only || (k->valid & ~BIT(t)));
}

/* Appends to cand the eviction candidates among the slots of memory tier t
 * held by `layer` that are stale (or not: blk_stale_at), in slot order (the
 * tier's layer map: only that layer's slots are read); returns how many.
 * Reading them makes the layer's pool.lmin exact. A stale list is known
 * empty without a read for the current layer (never stale) and where lmin
 * or the layer's whole-read stamp is at or past stale_before. */
static uint32_t layer_candidates(struct tkv_kvs *s, int t, uint32_t layer, bool clean_only, bool stale, uint32_t *cand)
{
    struct pool *pl = &s->pool[t];
    if (stale && (layer == s->cur_layer || TKV_MAX(pl->lmin[layer], s->layer_lru[layer]) >= s->stale_before))
        return 0; /* none is */
    uint64_t lo = UINT64_MAX;
    const uint64_t *map = pl->lmap + (size_t)layer * pl->words, *sum = pl->lsum + (size_t)layer * pl->sum_words;
    uint32_t n = 0;
    for (uint32_t sw = 0; sw < pl->sum_words; sw++)
        for (uint64_t x = sum[sw]; x; x &= x - 1) {
            const uint32_t w = sw * 64 + (uint32_t)__builtin_ctzll(x);
            for (uint64_t y = map[w]; y; y &= y - 1) {
                const int32_t i = pl->owner[w * 64 + (uint32_t)__builtin_ctzll(y)];
                const uint64_t lru = blk_lru(s, (uint32_t)i);
                lo = TKV_MIN(lo, lru);
                if (evictable(s, t, i, clean_only) && blk_stale_at(s, (uint32_t)i, lru) == stale)
                    cand[n++] = (uint32_t)i;
            }
        }
    pl->lmin[layer] = lo;
    STALL_COUNT(s, evict_scanned, pl->layer_used[layer]);
    return n;
}

/* Collects in s->cand[t] (returns their count) the eviction candidates of
 * memory tier t that the first k places of the victim order can come from:
 * all candidates of the buckets farthest from the current layer, as many
 * buckets as hold k of them -- a bucket is one layer's stale blocks
 * (distances L .. 2L-1) or its others (0 .. L-1; next_use_distance). The
 * victim order puts a farther bucket's blocks first, so ordering these
 * gives the full order's first k places. n_extra more blocks of extra_layer
 * (< n_layer; else none; blocks stamped now, so not stale) count as
 * candidates (the caller appends them when *extra_in). Per layer the tier
 * counts its slots (pool.layer_used) and maps them (pool.lmap), so only the
 * chosen layers' slots are read, and a stale bucket only where
 * layer_candidates cannot tell it is empty.
 *
 * Order: each bucket's candidates come in slot order, bucket after bucket
 * (s->grp_end[d]: the end of the d-th bucket taken, s->n_grp of them). The
 * victim order is a stable counting sort by next-use distance (one bucket
 * per distance), then by LRU with ties in list order, so only the order
 * inside a bucket matters: it is the one a scan of every slot gives
 * (evict_ref: that scan, every bucket taken, kept as the test's
 * reference). */
static uint32_t collect_candidates(struct tkv_kvs *s, int t, bool clean_only, uint64_t k, uint32_t extra_layer,
                                   uint32_t n_extra, bool *extra_in)
{
    const struct pool *pl = &s->pool[t];
    const uint32_t L = s->p.n_layer;
    uint32_t *cand = s->cand[t], n_cand = 0;
    if (s->p.evict_ref) {
        for (uint32_t slot = 0; slot < pl->n; slot++)
            if (pl->owner[slot] >= 0 && evictable(s, t, pl->owner[slot], clean_only))
                cand[n_cand++] = (uint32_t)pl->owner[slot];
        STALL_COUNT(s, evict_scanned, pl->n);
        *extra_in = extra_layer < L;
        return n_cand;
    }
    bool extra = false;
    uint64_t bound = 0, target = k;
    uint32_t d = 0;
    for (;;) {
        while (d < 2 * L && bound < target) { /* farthest first: distance 2L-1-d */
            const bool stale = d < L;
            const uint32_t layer = (s->cur_layer + L - 1 - d % L) % L;
            const uint32_t got = layer_candidates(s, t, layer, clean_only, stale, cand + n_cand);
            bound += (stale ? got : pl->layer_used[layer]) + (!stale && layer == extra_layer ? n_extra : 0);
            extra = extra || (!stale && layer == extra_layer);
            n_cand += got;
            s->grp_end[d++] = n_cand;
        }
        const uint64_t found = n_cand + (extra ? n_extra : 0);
        if (found >= k || d == 2 * L)
            break;
        target = bound + (k - found); /* pinned or in-flight blocks filled the bound: take more buckets */
    }
    *extra_in = extra;
    s->n_grp = d;
    return n_cand;
}

/* The error for memory tier t when its evictable blocks cannot make the
 * room asked for (the rest are pinned or in flight). */
static tkv_status tier_too_small(const struct tkv_kvs *s, int t)
{
    return tkv_err(TKV_ERR_NOMEM,
                   "kv-store: the %s tier (%u blocks of %u bytes) cannot hold the blocks in use; raise its capacity",
                   tier_names[t], s->pool[t].cap, s->S);
}

/* The error for dirty blocks of memory tier t with nowhere to go. */
static tkv_status no_lower_tier(const struct tkv_kvs *s, int t)
{
    return tkv_err(TKV_ERR_NOMEM,
                   "kv-store: the %s tier is full and there is no NVMe tier to spill to "
                   "(give --nvme-dir or raise the capacity)",
                   t == TKV_TIER_COMPUTE && s->p.compute_is_host ? "host" : tier_names[t]);
}

/* Writes dirty[0..nd) (nd <= IO_BATCH; only a copy on memory tier t is
 * current) to the tier below t -- host below a GPU compute tier, else NVMe
 * -- and drops their copies on t; *freed counts them. */
static tkv_status spill_down(struct tkv_kvs *s, int t, const uint32_t *dirty, uint32_t nd, uint32_t *freed)
{
    if (t == TKV_TIER_HOST || !s->pool[TKV_TIER_HOST].present) {
        if (!s->pool[TKV_TIER_NVME].present)
            return no_lower_tier(s, t);
        TKV_TRY(spill_to_nvme(s, t, dirty, nd));
    } else {
        TKV_TRY(spill_to_host(s, dirty, nd));
    }
    for (uint32_t j = 0; j < nd; j++)
        if (s->blk[dirty[j]].valid & ~BIT(t)) {
            drop_copy(s, dirty[j], t);
            (*freed)++;
            STALL_COUNT(s, spilled_blocks, 1);
        }
    return TKV_OK;
}

static tkv_status make_room_ex(struct tkv_kvs *s, int t, uint32_t need, bool clean_only);

/* Frees at least `need` slots on memory tier t by moving unpinned blocks
 * down, the one needed last first. Clean blocks (another current copy
 * exists) are dropped for free; others are written down first. */
static tkv_status make_room(struct tkv_kvs *s, int t, uint32_t need) { return make_room_ex(s, t, need, false); }

static tkv_status evict_for(struct tkv_kvs *s, int t, uint32_t need, bool clean_only);

/* clean_only: free only what costs no I/O (prefetch); may free fewer. The
 * time goes to the stall's evict part. */
static tkv_status make_room_ex(struct tkv_kvs *s, int t, uint32_t need, bool clean_only)
{
    if (s->pool[t].n_free >= need)
        return TKV_OK;
    const int prev = part_switch(s, PART_EVICT);
    tkv_status st = evict_for(s, t, need, clean_only);
    part_switch(s, prev);
    return st;
}

/* make_room_ex's work, with fewer than `need` slots free. */
static tkv_status evict_for(struct tkv_kvs *s, int t, uint32_t need, bool clean_only)
{
    struct pool *pl = &s->pool[t];
    TKV_TRY(pool_grow(s, t, pl->n + (need - pl->n_free))); /* within capacity: just grow */
    if (pl->n_free >= need)
        return TKV_OK;
    /* the loop below consumes at most want + IO_BATCH - 1 candidates (a
     * batch of dirty victims is completed before `freed` is counted) */
    uint32_t want = need - pl->n_free;
    const uint64_t exact = (uint64_t)want + IO_BATCH;
    bool unused;
    uint32_t *cand = s->cand[t];
    uint32_t n_cand = collect_candidates(s, t, clean_only, exact, UINT32_MAX, 0, &unused);
    if (clean_only)
        want = TKV_MIN(want, n_cand);
    else if (n_cand < want)
        return tier_too_small(s, t);
    STALL_COUNT(s, evict_passes, 1);
    if (s->p.evict_ref)
        order_victims(s, cand, n_cand, want, (uint32_t)TKV_MIN(exact, n_cand));
    else /* already in bucket order, a layer per bucket */
        order_cut(s, cand, s->grp_end, s->n_grp, want, (uint32_t)TKV_MIN(exact, n_cand));
    uint32_t freed = 0;
    for (uint32_t c = 0; c < n_cand && freed < want;) {
        /* a batch of victims. Clean ones (another current copy exists) are
         * dropped first: spilling the dirty ones may evict host copies,
         * which would make a clean victim dirty if it were still waiting. */
        uint32_t nd = 0, dirty[IO_BATCH];
        for (; c < n_cand && nd < IO_BATCH && freed < want; c++) {
            uint32_t i = cand[c];
            if (s->blk[i].valid & ~BIT(t)) {
                drop_copy(s, i, t);
                freed++;
            } else {
                dirty[nd++] = i;
            }
        }
        if (nd > 0)
            TKV_TRY(spill_down(s, t, dirty, nd, &freed));
    }
    STALL_COUNT(s, evicted_blocks, freed);
    return clean_only || pl->n_free >= need
               ? TKV_OK
               : tkv_err(TKV_ERR_INTERNAL, "kv-store: eviction freed too few slots (%s tier: need %u, free %u, %u candidates, freed %u)",
                         tier_names[t], need, pl->n_free, n_cand, freed);
}

/* ---- recall --------------------------------------------------------------------- */

/* Verifies a recalled payload against the block's checksum. */
static tkv_status corrupt_error(struct tkv_kvs *s, uint32_t i, int from);

static tkv_status verify(struct tkv_kvs *s, uint32_t i, const void *data, int from)
{
    const int prev = part_switch(s, PART_VERIFY);
    STALL_COUNT(s, verify_bytes, s->S);
    const bool ok = tkv_crc32c(0, data, s->S) == s->blk[i].crc;
    part_switch(s, prev);
    return ok ? TKV_OK : corrupt_error(s, i, from);
}

/* Checksums of n payloads data[j] of blocks idx[j]; bad[j] = 1 where one does
 * not match. Spread over the CRC threads when there are enough bytes. */
static void verify_batch(struct tkv_kvs *s, const uint32_t *idx, const void *const *data, uint32_t n, uint8_t *bad)
{
    const int prev = part_switch(s, PART_VERIFY);
    STALL_COUNT(s, verify_bytes, (uint64_t)n * s->S);
    crc_run(s, idx, data, n, bad);
    part_switch(s, prev);
}

/* Verdicts bad[0..n) on the host-tier copies data[j] of blocks idx[j]
 * (n <= a layer's blocks). A copy that passed a check since it was written
 * (hchecked) is taken as intact without being read: the check guards the
 * copy at rest, once after it lands, not at every read. The others are
 * checksummed (verify_batch) and marked checked when they pass. */
static void check_host_copies(struct tkv_kvs *s, const uint32_t *idx, const void *const *data, uint32_t n,
                              uint8_t *bad)
{
    uint32_t m = 0;
    for (uint32_t j = 0; j < n; j++) {
        bad[j] = 0;
        if (s->blk[idx[j]].hchecked)
            continue;
        s->chk_idx[m] = idx[j];
        s->chk_data[m] = data[j];
        s->chk_pos[m++] = j;
    }
    if (m == 0)
        return;
    verify_batch(s, s->chk_idx, s->chk_data, m, s->chk_bad);
    for (uint32_t r = 0; r < m; r++) {
        bad[s->chk_pos[r]] = s->chk_bad[r];
        s->blk[s->chk_idx[r]].hchecked = !s->chk_bad[r];
    }
}

/* The error for a block whose recalled copy failed its checksum. */
static tkv_status corrupt_error(struct tkv_kvs *s, uint32_t i, int from)
{
    s->corrupt++;
    char what[96];
    snprintf(what, sizeof what, "checksum mismatch on recall from the %s tier; the data was not used",
             tier_names[from]);
    return block_error(s, TKV_ERR_CORRUPT, i, what);
}

static tkv_status up_finish(struct tkv_kvs *s, struct up_batch *ub, bool report);

/* Settles the oldest n prefetches: waits for them, takes their verdicts and
 * makes the intact blocks current (the others give their slots back; the
 * next begin_layer recalls them and reports the error); the younger ones
 * stay in flight. Returns the first error. */
static tkv_status prefetch_settle_n(struct tkv_kvs *s, uint32_t n)
{
    tkv_status st = TKV_OK;
    n = TKV_MIN(n, s->n_pf);
    for (uint32_t j = 0; j < n; j++) {
        tkv_status e = up_finish(s, &s->pf[j], false);
        st = st != TKV_OK ? st : e;
    }
    for (uint32_t j = n; j < s->n_pf; j++) { /* the rest move up, lists and all */
        struct up_batch t = s->pf[j - n];
        s->pf[j - n] = s->pf[j];
        s->pf[j] = t;
    }
    s->n_pf -= n;
    return st;
}

/* Settles every prefetch. Every public call that moves blocks other than
 * begin_layer's own settles first. */
static tkv_status prefetch_settle(struct tkv_kvs *s) { return prefetch_settle_n(s, s->n_pf); }

/* Settles the prefetches up to the youngest one of `layer` (uploads land in
 * order, so the older ones are done by then anyway). */
static tkv_status prefetch_settle_layer(struct tkv_kvs *s, uint32_t layer)
{
    uint32_t n = 0;
    for (uint32_t j = 0; j < s->n_pf; j++)
        if (s->pf[j].layer == layer)
            n = j + 1;
    return prefetch_settle_n(s, n);
}

/* Block i's copy read from NVMe landed intact in its compute slot: current
 * there, and counted on both tiers. */
static void nvme_landed(struct tkv_kvs *s, uint32_t i)
{
    s->blk[i].valid |= BIT(TKV_TIER_COMPUTE);
    s->st[TKV_TIER_NVME].bytes_out += s->S;
    s->st[TKV_TIER_COMPUTE].bytes_in += s->S;
}

/* A prefetch read finished: keep the block if it arrived intact; otherwise
 * drop the slot (begin_layer recalls it again and reports the error). */
static void prefetch_complete(struct tkv_kvs *s, const struct tkv_io_cqe *c)
{
    uint32_t i = (uint32_t)(c->user_tag >> 1);
    struct blk *k = &s->blk[i];
    if (!k->inflight)
        return;
    k->inflight = 0;
    s->n_inflight--;
    s->inflight_reads[k->layer]--;
    const void *data = slot_ptr(s, TKV_TIER_COMPUTE, k->slot[TKV_TIER_COMPUTE]);
    const int prev = part_switch(s, PART_VERIFY);
    const bool ok = c->result == (int64_t)s->S && tkv_crc32c(0, data, s->S) == k->crc;
    STALL_COUNT(s, verify_bytes, c->result == (int64_t)s->S ? s->S : 0);
    part_switch(s, prev);
    if (ok) {
        nvme_landed(s, i);
    } else {
        drop_copy(s, i, TKV_TIER_COMPUTE);
    }
}

/* Finishes the prefetch reads still in flight of `layer`, or of every
 * layer (ALL_LAYERS); reads of other layers that complete meanwhile are
 * taken too. */
#define ALL_LAYERS UINT32_MAX
static void prefetch_drain_layer(struct tkv_kvs *s, uint32_t layer)
{
    while (s->io && s->n_inflight > 0 && (layer == ALL_LAYERS || s->inflight_reads[layer] > 0)) {
        struct tkv_io_cqe cqe[IO_BATCH];
        int got = tkv_io_wait(s->io, 1, cqe, IO_BATCH);
        if (got <= 0) { /* cannot complete: give the slots back, recall normally later */
            for (uint32_t slot = 0; slot < s->pool[TKV_TIER_COMPUTE].n; slot++) {
                int32_t i = s->pool[TKV_TIER_COMPUTE].owner[slot];
                if (i >= 0 && s->blk[i].inflight) {
                    s->blk[i].inflight = 0;
                    drop_copy(s, (uint32_t)i, TKV_TIER_COMPUTE);
                }
            }
            s->n_inflight = 0;
            memset(s->inflight_reads, 0, s->p.n_layer * sizeof *s->inflight_reads);
            return;
        }
        for (int c = 0; c < got; c++)
            if (cqe[c].user_tag & 1)
                prefetch_complete(s, &cqe[c]);
    }
}

/* Finishes every prefetch read still in flight. */
static void prefetch_drain(struct tkv_kvs *s) { prefetch_drain_layer(s, ALL_LAYERS); }

/* Reads blocks list[0..n) from NVMe straight into their compute slots (host
 * compute tier), keeping the queue full and verifying each block as it
 * lands. Blocks that fail keep no compute copy; returns the first error. */
static tkv_status nvme_stream_reads(struct tkv_kvs *s, const uint32_t *list, uint32_t n)
{
    uint32_t next = 0, inflight = 0;
    tkv_status first = TKV_OK;
    struct tkv_io_cqe cqe[IO_BATCH];
    while (next < n || inflight > 0) {
        while (next < n) {
            const struct blk *k = &s->blk[list[next]];
            int rc = tkv_io_read(s->io, s->file, slot_ptr(s, TKV_TIER_COMPUTE, k->slot[TKV_TIER_COMPUTE]), s->S,
                                 (uint64_t)k->slot[TKV_TIER_NVME] * s->S, (uint64_t)next << 1);
            if (rc == -EAGAIN)
                break;
            if (rc < 0 && first == TKV_OK)
                first = tkv_io_status(rc, "recall read");
            inflight += rc >= 0;
            next++;
        }
        int rc = tkv_io_submit(s->io);
        int got = rc < 0 ? rc : tkv_io_wait(s->io, 1, cqe, IO_BATCH);
        if (got < 0 || (got == 0 && inflight > 0)) {
            /* the engine cannot complete what it holds: never reuse those slots */
            s->broken = true;
            return tkv_io_status(got < 0 ? got : -EIO, "kv-store: the I/O engine failed; the NVMe tier is unusable");
        }
        for (int c = 0; c < got; c++) {
            if (cqe[c].user_tag & 1) {
                prefetch_complete(s, &cqe[c]);
                continue;
            }
            uint32_t i = list[cqe[c].user_tag >> 1];
            inflight--;
            const void *data = slot_ptr(s, TKV_TIER_COMPUTE, s->blk[i].slot[TKV_TIER_COMPUTE]);
            tkv_status st;
            if (cqe[c].result != (int64_t)s->S)
                st = cqe[c].result < 0 ? tkv_io_status((int)cqe[c].result, "recall read")
                                       : tkv_err(TKV_ERR_IO, "io: short read");
            else
                st = verify(s, i, data, TKV_TIER_NVME);
            if (st == TKV_OK) {
                nvme_landed(s, i);
            } else if (first == TKV_OK) {
                uint32_t l, h, b;
                blk_coords(s, i, &l, &h, &b);
                first = st == TKV_ERR_CORRUPT ? st
                                              : tkv_err_wrap(st, "kv-store: nvme tier, block (layer %u, head %u, block %u)",
                                                             l, h, b);
            }
        }
    }
    return first;
}

/* Host-tier blocks go up to the GPU in pieces while recall() is still
 * taking slots for the rest, so the link starts after the first piece's
 * bookkeeping instead of the whole layer's: up_send queues up_*[first,
 * first + n); up_finish waits for every piece sent and marks the blocks.
 *
 * The device checks each copy that landed against the block's CRC where the
 * backend can (the host then only waits: no CPU reads the payloads, which
 * kept a PCIe 5 link to ~75% when 8 CPU threads summed them); otherwise the
 * copies are queued first, so the link works while the CPU checks the sums
 * in up_finish. Blocks whose sum fails are not marked current (recall drops
 * their slots). */
static tkv_status up_send(struct tkv_kvs *s, struct up_batch *ub, uint32_t n)
{
    const uint32_t first = ub->sent;
    if (n == first)
        return TKV_OK;
    for (uint32_t j = first; j < n; j++)
        ub->crc[j] = s->blk[ub->idx[j]].crc;
    const int prev = part_switch(s, PART_ISSUE);
    STALL_COUNT(s, upload_calls, 1);
    tkv_status st = TKV_ERR_UNSUPPORTED;
    uint64_t ticket = 0;
    if (!s->dev_crc_no && (first == 0 || ub->on_device))
        st = s->be->ops->upload_blocks(s->be, ub->dst + first, ub->src + first, n - first, s->S, ub->crc + first,
                                       ub->bad + first, &ticket);
    s->dev_crc_no |= st == TKV_ERR_UNSUPPORTED && first == 0;
    if (first == 0)
        ub->on_device = st == TKV_OK;
    if (st == TKV_ERR_UNSUPPORTED) /* this size: the CPU checks them in up_finish */
        st = s->be->ops->upload_blocks(s->be, ub->dst + first, ub->src + first, n - first, s->S, NULL, NULL,
                                       &ticket);
    if (st == TKV_OK) {
        ub->sent = n;
        ub->ticket = ticket;
    }
    part_switch(s, prev);
    return st;
}

/* Waits for the pieces of ub, takes their verdicts (the CPU checks the sums
 * here when the device could not) and makes the blocks that arrived intact
 * current on the compute tier; the others give their slots back. report:
 * a corrupt block is an error naming it (a demand recall), else silent (a
 * prefetch: the block is recalled again when needed). */
static tkv_status up_finish(struct tkv_kvs *s, struct up_batch *ub, bool report)
{
    const uint32_t n = ub->sent;
    const bool on_device = ub->on_device;
    const uint64_t ticket = ub->ticket;
    if (n == 0)
        return TKV_OK;
    ub->sent = 0;
    ub->on_device = false;
    ub->ticket = 0;
    tkv_status st = TKV_OK;
    if (on_device) {
        const int prev = part_switch(s, PART_WAIT);
        STALL_COUNT(s, upload_waits, 1);
        st = s->be->ops->upload_wait(s->be, ticket, true, NULL); /* the verdicts */
        part_switch(s, prev);
    } else { /* the CPU checks the sources, the host copies: as a host read would */
        check_host_copies(s, ub->idx, ub->src, n, ub->bad);
    }
    uint32_t good = 0;
    tkv_status bad = TKV_OK; /* the first corrupt block; the others stay usable */
    for (uint32_t j = 0; j < n; j++) {
        uint32_t i = ub->idx[j];
        s->blk[i].inflight = 0;
        if (st != TKV_OK || ub->bad[j]) { /* a failed wait gives no verdicts */
            if (st == TKV_OK && report) {
                tkv_status e = corrupt_error(s, i, TKV_TIER_HOST);
                bad = bad == TKV_OK ? e : bad;
            }
            if (st == TKV_OK) /* the host copy may be what is corrupt: check it at its next read */
                s->blk[i].hchecked = 0;
            drop_copy(s, i, TKV_TIER_COMPUTE);
            continue;
        }
        /* intact on arrival, so read intact from the host copy: the device
         * summed the bytes it read there */
        s->blk[i].hchecked = (s->blk[i].valid & BIT(TKV_TIER_HOST)) != 0;
        s->blk[i].valid |= BIT(TKV_TIER_COMPUTE);
        good++;
    }
    st = st != TKV_OK ? st : bad;
    s->st[TKV_TIER_HOST].bytes_out += (uint64_t)good * s->S;
    s->st[TKV_TIER_COMPUTE].bytes_in += (uint64_t)good * s->S;
    /* always: a dropped slot's late copy must land before its next user */
    const int prev = part_switch(s, PART_WAIT);
    tkv_status f = s->be->ops->upload_fence(s->be, ticket);
    part_switch(s, prev);
    return st != TKV_OK ? st : f;
}

/* make_room on the compute tier for the layer begin_layer brings in. The
 * blocks of prefetches still in flight (GPU uploads, NVMe reads) cannot be
 * evicted; when they are in the way, they are finished and the room is
 * sought again. */
static tkv_status make_room_for_layer(struct tkv_kvs *s, uint32_t need)
{
    tkv_status st = make_room(s, TKV_TIER_COMPUTE, need);
    if (st != TKV_ERR_NOMEM || (s->n_pf == 0 && s->n_inflight == 0))
        return st;
    prefetch_drain(s);
    TKV_TRY(prefetch_settle(s));
    return make_room(s, TKV_TIER_COMPUTE, need);
}

/* Waits for the upload of staging half h (its m blocks' lists at s->dm +
 * h * s->stage_n, queued as `ticket`) and marks the blocks whose copies
 * arrived intact current on the compute tier; the first corrupt one is the
 * error (the others stay unmarked: recall drops their slots). */
static tkv_status staged_settle(struct tkv_kvs *s, uint32_t h, uint32_t m, uint64_t ticket)
{
    struct up_batch *ub = &s->dm;
    const uint32_t o = h * s->stage_n;
    const int prev = part_switch(s, PART_WAIT);
    STALL_COUNT(s, upload_waits, 1);
    tkv_status st = s->be->ops->upload_wait(s->be, ticket, true, NULL);
    part_switch(s, prev);
    for (uint32_t j = 0; j < m && st == TKV_OK; j++) {
        const uint32_t bi = ub->idx[o + j];
        if (ub->bad[o + j]) {
            st = corrupt_error(s, bi, TKV_TIER_NVME);
            break;
        }
        nvme_landed(s, bi);
    }
    return st;
}

/* NVMe -> GPU through the registered staging buffer, a pipeline of its two
 * halves of stage_n blocks: a half's NVMe reads, then its upload queued (the
 * device checks each copy against its CRC where the backend can; else the
 * CPU checks the half first), and while that upload is in flight the other
 * half's reads. A half is read into again, and its blocks marked current,
 * only once its upload is done. */
static tkv_status recall_nvme_pipelined(struct tkv_kvs *s, const uint32_t *nv, uint32_t n)
{
    struct up_batch *ub = &s->dm;
    const uint32_t B = s->stage_n;
    uint32_t queued[2] = {0, 0}; /* blocks of each half in flight */
    uint64_t ticket[2] = {0, 0};
    tkv_status st = TKV_OK;
    uint32_t h = 0;
    for (uint32_t j0 = 0; j0 < n && st == TKV_OK; j0 += B, h ^= 1) {
        if (queued[h]) {
            st = staged_settle(s, h, queued[h], ticket[h]);
            queued[h] = 0;
            if (st != TKV_OK)
                break;
        }
        const uint32_t m = TKV_MIN(B, n - j0), o = h * B;
        for (uint32_t r = 0; r < m; r++)
            s->ops[r] = (struct io_op){.blk = nv[j0 + r], .write = false, .buf = s->staging + (size_t)(o + r) * s->S};
        int prev = part_switch(s, PART_NVME);
        st = nvme_run(s, s->ops, m, s->results);
        part_switch(s, prev);
        if (st != TKV_OK)
            break;
        for (uint32_t r = 0; r < m; r++) {
            const uint32_t bi = nv[j0 + r];
            ub->idx[o + r] = bi;
            ub->src[o + r] = s->ops[r].buf;
            ub->dst[o + r] = slot_ptr(s, TKV_TIER_COMPUTE, s->blk[bi].slot[TKV_TIER_COMPUTE]);
            ub->crc[o + r] = s->blk[bi].crc;
        }
        prev = part_switch(s, PART_ISSUE);
        STALL_COUNT(s, upload_calls, 1);
        st = s->dev_crc_no ? TKV_ERR_UNSUPPORTED
                           : s->be->ops->upload_blocks(s->be, ub->dst + o, ub->src + o, m, s->S, ub->crc + o,
                                                       ub->bad + o, &ticket[h]);
        s->dev_crc_no |= st == TKV_ERR_UNSUPPORTED;
        part_switch(s, prev);
        if (st == TKV_ERR_UNSUPPORTED) { /* the device cannot check this size: the CPU does, first */
            verify_batch(s, ub->idx + o, ub->src + o, m, ub->bad + o);
            prev = part_switch(s, PART_ISSUE);
            st = s->be->ops->upload_blocks(s->be, ub->dst + o, ub->src + o, m, s->S, NULL, NULL, &ticket[h]);
            part_switch(s, prev);
        }
        if (st == TKV_OK)
            queued[h] = m;
    }
    for (uint32_t k = 0; k < 2; k++) { /* also after an error: what was queued lands before the buffer is reused */
        const uint32_t hh = h ^ k;
        if (queued[hh]) {
            tkv_status f = staged_settle(s, hh, queued[hh], ticket[hh]);
            st = st != TKV_OK ? st : f;
        }
    }
    return st;
}

/* NVMe -> GPU: blocks nv[0..n) through the staging buffer: pipelined where
 * the backend queues uploads from it (recall_nvme_pipelined), else IO_BATCH
 * at a time, each block read, verified and uploaded in turn. */
static tkv_status recall_nvme_staged(struct tkv_kvs *s, const uint32_t *nv, uint32_t n)
{
    if (s->staging_async)
        return recall_nvme_pipelined(s, nv, n);
    tkv_status st = TKV_OK;
    for (uint32_t j0 = 0; j0 < n && st == TKV_OK; j0 += IO_BATCH) {
        uint32_t m = TKV_MIN(IO_BATCH, n - j0);
        for (uint32_t r = 0; r < m; r++)
            s->ops[r] = (struct io_op){.blk = nv[j0 + r], .write = false, .buf = s->staging + (size_t)r * s->S};
        const int prev = part_switch(s, PART_NVME);
        st = nvme_run(s, s->ops, m, s->results);
        part_switch(s, prev);
        for (uint32_t r = 0; r < m && st == TKV_OK; r++) {
            uint32_t bi = s->ops[r].blk;
            if ((st = verify(s, bi, s->ops[r].buf, TKV_TIER_NVME)) == TKV_OK)
                st = host_to_compute(s, s->ops[r].buf, s->blk[bi].slot[TKV_TIER_COMPUTE]);
            if (st == TKV_OK) {
                nvme_landed(s, bi);
            }
        }
    }
    return st;
}

/* Brings blocks idx[0..n) (not in compute) into compute slots: host-tier
 * copies are copied up (in pieces, see up_send), NVMe copies read (streamed
 * straight into the slots on a host compute tier, through the staging
 * buffer below a GPU). On failure no block keeps a compute slot without a
 * current copy in it. */
static tkv_status recall(struct tkv_kvs *s, const uint32_t *idx, uint32_t n, uint32_t host_pins)
{
    /* The blocks recalled from the host tier stay there while the compute
     * tier's victims spill into it: else a spill could evict a source to
     * NVMe only to read it back at once (and a corrupt host copy would be
     * reported from NVMe). Pins leave IO_BATCH host slots for the spills,
     * as begin_layer_split's do (host_pins of them are its, none of idx:
     * those are not read in place); past that, a source may move. */
    const uint32_t cap = s->pool[TKV_TIER_HOST].cap;
    uint32_t room = cap > IO_BATCH + host_pins ? cap - IO_BATCH - host_pins : 0;
    for (uint32_t j = 0; j < n && room > 0; j++)
        if (s->blk[idx[j]].valid & BIT(TKV_TIER_HOST)) {
            s->blk[idx[j]].hpinned = 1;
            room--;
        }
    tkv_status made = make_room_for_layer(s, n);
    for (uint32_t j = 0; j < n; j++)
        s->blk[idx[j]].hpinned = 0;
    TKV_TRY(made);
    uint32_t *nv = s->cand[TKV_TIER_COMPUTE], n_nv = 0; /* free again after make_room */
    uint32_t n_up = 0;                                   /* host-tier blocks in ub */
    struct up_batch *ub = &s->dm;
    tkv_status st = TKV_OK;
    for (uint32_t j = 0; j < n && st == TKV_OK; j++) {
        uint32_t i = idx[j];
        struct blk *k = &s->blk[i];
        int32_t cs = pool_take(s, TKV_TIER_COMPUTE, i);
        if (cs < 0) {
            st = tkv_err(TKV_ERR_INTERNAL, "kv-store: no compute slot after making room");
            break;
        }
        k->slot[TKV_TIER_COMPUTE] = cs;
        if ((k->valid & BIT(TKV_TIER_HOST)) && s->async_up) {
            ub->idx[n_up] = i;
            ub->src[n_up] = slot_ptr(s, TKV_TIER_HOST, k->slot[TKV_TIER_HOST]);
            ub->dst[n_up++] = slot_ptr(s, TKV_TIER_COMPUTE, cs);
            s->st[TKV_TIER_HOST].hits++;
            if (n_up - ub->sent >= s->up_piece)
                st = up_send(s, ub, n_up);
        } else if (k->valid & BIT(TKV_TIER_HOST)) {
            const uint8_t *src = slot_ptr(s, TKV_TIER_HOST, k->slot[TKV_TIER_HOST]);
            if (!k->hchecked && (st = verify(s, i, src, TKV_TIER_HOST)) == TKV_OK)
                k->hchecked = 1; /* checks the host copy before the copy, as a host read would */
            if (st == TKV_OK)
                st = host_to_compute(s, src, cs);
            if (st != TKV_OK)
                break;
            k->valid |= BIT(TKV_TIER_COMPUTE);
            s->st[TKV_TIER_HOST].hits++;
            s->st[TKV_TIER_HOST].bytes_out += s->S;
            s->st[TKV_TIER_COMPUTE].bytes_in += s->S;
        } else if (k->valid & BIT(TKV_TIER_NVME)) {
            if (s->pool[TKV_TIER_HOST].present)
                s->st[TKV_TIER_HOST].misses++;
            s->st[TKV_TIER_NVME].hits++;
            nv[n_nv++] = i;
        } else {
            st = block_error(s, TKV_ERR_INTERNAL, i, "has no current copy on any tier");
        }
    }
    if (n_up > 0) {
        tkv_status u = st == TKV_OK ? up_send(s, ub, n_up) : TKV_OK;
        tkv_status f = up_finish(s, ub, true); /* also after an error: what was sent lands first */
        st = st != TKV_OK ? st : u != TKV_OK ? u : f;
    }
    if (st == TKV_OK && n_nv > 0 && s->p.compute_is_host) {
        const int prev = part_switch(s, PART_NVME);
        st = nvme_stream_reads(s, nv, n_nv);
        part_switch(s, prev);
    } else if (st == TKV_OK && n_nv > 0) {
        st = recall_nvme_staged(s, nv, n_nv);
    }
    STALL_COUNT(s, recalled_blocks, n);
    if (st != TKV_OK && !s->broken) /* give back the slots that hold nothing current */
        for (uint32_t j = 0; j < n; j++)
            if (!(s->blk[idx[j]].valid & BIT(TKV_TIER_COMPUTE)) && s->blk[idx[j]].slot[TKV_TIER_COMPUTE] >= 0)
                drop_copy(s, idx[j], TKV_TIER_COMPUTE);
    return st;
}

/* ---- public functions -------------------------------------------------------- */

tkv_status tkv_kvs_init(const struct tkv_kvs_params *p, struct tkv_backend *backend, struct tkv_kvs **out)
{
    *out = NULL;
    if (p->n_layer == 0 || p->n_head_kv == 0 || p->head_dim == 0 || p->block_tokens == 0 || p->max_tokens == 0)
        return tkv_err(TKV_ERR_INVALID_ARG, "kv-store: zero dimension in parameters");
    if (p->block_tokens > 256)
        return tkv_err(TKV_ERR_INVALID_ARG, "kv-store: block of %u tokens is too large (max 256)", p->block_tokens);
    if (p->n_layer >= UINT16_MAX)
        return tkv_err(TKV_ERR_INVALID_ARG, "kv-store: %u layers are too many (max %u)", p->n_layer, UINT16_MAX - 1);
    struct tkv_kvs *s = calloc(1, sizeof *s);
    if (!s)
        return tkv_err(TKV_ERR_NOMEM, "kv-store: out of memory");
    s->p = *p;
    s->homes_off = p->no_homes;
    s->p.nvme_dir = NULL; /* not kept: only used here (pci_bus_id is the backend's, it outlives us) */
    s->be = backend;
    s->part = PART_NONE;
    s->S = 4u * p->block_tokens * p->head_dim;
    s->stage_n = p->staging_blocks ? TKV_MIN(p->staging_blocks, (uint32_t)IO_BATCH) : IO_BATCH;
    s->staging_cap = TKV_MAX((uint32_t)IO_BATCH, 2 * s->stage_n);
    s->max_blocks = (p->max_tokens + p->block_tokens - 1) / p->block_tokens;
    const uint64_t total = (uint64_t)p->n_layer * p->n_head_kv * s->max_blocks;
    const uint64_t layer_blocks = (uint64_t)p->n_head_kv * s->max_blocks;
    tkv_status st = TKV_OK;
    if (total > INT32_MAX) {
        st = tkv_err(TKV_ERR_INVALID_ARG, "kv-store: %llu blocks are too many", (unsigned long long)total);
        goto fail;
    }
    s->blk = malloc(total * sizeof *s->blk);
    s->refs = calloc(total, sizeof *s->refs); /* untouched pages of unused layers stay unmapped */
    s->host_refs = calloc(layer_blocks, sizeof *s->host_refs);
    s->hlist = malloc(layer_blocks * sizeof *s->hlist);
    s->sel = malloc(total * sizeof *s->sel); /* untouched pages of unused layers stay unmapped */
    s->sel_n = calloc(p->n_layer, sizeof *s->sel_n);
    s->sparse_nb = malloc(p->n_layer * sizeof *s->sparse_nb);
    s->hdata = malloc(layer_blocks * sizeof *s->hdata);
    s->hbad = malloc(layer_blocks * sizeof *s->hbad);
    s->chk_idx = malloc(layer_blocks * sizeof *s->chk_idx);
    s->chk_pos = malloc(layer_blocks * sizeof *s->chk_pos);
    s->chk_data = malloc(layer_blocks * sizeof *s->chk_data);
    s->chk_bad = malloc(layer_blocks * sizeof *s->chk_bad);
    s->cand[0] = malloc(total * sizeof *s->cand[0]);
    s->cand[1] = malloc(total * sizeof *s->cand[1]);
    s->lists = malloc(2 * layer_blocks * sizeof *s->lists);
    s->order_tmp = malloc(total * sizeof *s->order_tmp);
    s->order_count = malloc((2 * p->n_layer + 1) * sizeof *s->order_count);
    s->grp_end = malloc(2 * p->n_layer * sizeof *s->grp_end);
    s->begin_clock = calloc(2 * p->n_layer, sizeof *s->begin_clock);
    s->layer_begun = calloc(p->n_layer, sizeof *s->layer_begun);
    s->vkeys = malloc(layer_blocks * sizeof *s->vkeys);
    s->run_below = malloc(s->max_blocks);
    s->inflight_reads = calloc(p->n_layer, sizeof *s->inflight_reads);
    s->layer_pin = calloc(p->n_layer, sizeof *s->layer_pin);
    s->layer_lru = calloc(p->n_layer, sizeof *s->layer_lru);
    s->layer_gen = calloc(p->n_layer, sizeof *s->layer_gen);
    s->views_gen = malloc(p->n_layer * sizeof *s->views_gen);
    s->views_nb = calloc(p->n_layer, sizeof *s->views_nb);
    s->ops = calloc(IO_BATCH, sizeof *s->ops);
    s->results = calloc(IO_BATCH, sizeof *s->results);
    if (!s->blk || !s->refs || !s->host_refs || !s->hlist || !s->sel || !s->sel_n || !s->sparse_nb || !s->hdata || !s->hbad || !s->chk_idx || !s->chk_pos || !s->chk_data || !s->chk_bad || !s->cand[0] || !s->cand[1] || !s->lists || !s->order_tmp || !s->order_count || !s->grp_end || !s->begin_clock || !s->layer_begun || !s->vkeys || !s->run_below || !s->inflight_reads || !s->layer_pin || !s->layer_lru || !s->layer_gen || !s->views_gen ||
        !s->views_nb || !s->ops || !s->results) {
        st = tkv_err(TKV_ERR_NOMEM, "kv-store: out of memory for the page table");
        goto fail;
    }
    for (uint64_t i = 0; i < total; i++)
        s->blk[i] = (struct blk){.slot = {-1, -1, -1}, .layer = (uint32_t)(i / layer_blocks)};
    for (uint32_t l = 0; l < p->n_layer; l++) {
        s->views_gen[l] = VIEWS_STALE;
        s->sparse_nb[l] = SPARSE_NONE;
    }

    /* compute tier: must hold at least one layer's blocks for the whole context */
    uint64_t cap = p->compute_bytes ? p->compute_bytes / s->S : total;
    if (cap < layer_blocks) {
        st = tkv_err(TKV_ERR_INVALID_ARG,
                     "kv-store: the %s KV capacity of %llu bytes holds %llu blocks, but one layer of a %u-token "
                     "context needs %llu (%llu bytes)",
                     p->compute_is_host ? "host" : "gpu", (unsigned long long)p->compute_bytes,
                     (unsigned long long)cap, p->max_tokens, (unsigned long long)layer_blocks,
                     (unsigned long long)(layer_blocks * s->S));
        goto fail;
    }
    if ((st = pool_init(&s->pool[TKV_TIER_COMPUTE], (uint32_t)TKV_MIN(cap, total), p->compute_is_host, p->n_layer, true)) != TKV_OK)
        goto fail;
    if (!p->compute_is_host && p->host_bytes) {
        uint64_t hcap = TKV_MIN(p->host_bytes / s->S, total);
        if (hcap < IO_BATCH) {
            st = tkv_err(TKV_ERR_INVALID_ARG, "kv-store: host KV capacity of %llu bytes is below %u blocks",
                         (unsigned long long)p->host_bytes, IO_BATCH);
            goto fail;
        }
        if ((st = pool_init(&s->pool[TKV_TIER_HOST], (uint32_t)hcap, true, p->n_layer, true)) != TKV_OK ||
            (st = pool_grow(s, TKV_TIER_HOST, (uint32_t)hcap)) != TKV_OK)
            goto fail;
    }
    if (p->nvme_dir) {
        if (s->S % TKV_IO_ALIGN) {
            st = tkv_err(TKV_ERR_INVALID_ARG, "kv-store: a block of %u bytes is not a multiple of 4 KiB (NVMe tier)",
                         s->S);
            goto fail;
        }
        uint64_t ncap = p->nvme_bytes ? TKV_MIN(p->nvme_bytes / s->S, total) : total;
        if ((st = pool_init(&s->pool[TKV_TIER_NVME], (uint32_t)ncap, false, p->n_layer, false)) != TKV_OK)
            goto fail;
        struct tkv_io_params iop = tkv_io_default_params();
        iop.queue_depth = 256; /* a whole layer's recall streams at this depth */
        int rc = tkv_io_init(&iop, &s->io);
        if (rc == 0)
            rc = tkv_io_file_open_tmp(s->io, p->nvme_dir, &s->file);
        if (rc < 0) {
            st = tkv_io_status(rc, "kv-store: opening a spill file");
            tkv_err_wrap(st, "--nvme-dir %s", p->nvme_dir);
            goto fail;
        }
        s->staging = tkv_io_alloc_aligned((size_t)s->staging_cap * s->S);
        if (!s->staging) {
            st = tkv_err(TKV_ERR_NOMEM, "kv-store: out of memory for the staging buffer");
            goto fail;
        }
    } else if (!p->compute_is_host) {
        s->staging = tkv_io_alloc_aligned((size_t)s->staging_cap * s->S);
        if (!s->staging) {
            st = tkv_err(TKV_ERR_NOMEM, "kv-store: out of memory for the staging buffer");
            goto fail;
        }
    }
    const struct tkv_backend_ops *bo = backend->ops;
    s->async_up = !p->compute_is_host && bo->upload_blocks && bo->upload_fence && bo->upload_wait;
    s->up_piece = TKV_MAX((p->upload_piece_bytes ? p->upload_piece_bytes : UP_PIECE_BYTES) / s->S, 1u);
    if (s->async_up) {
        bool ok = up_batch_alloc(&s->dm, TKV_MAX(layer_blocks, 2 * s->stage_n));
        for (uint32_t j = 0; j < MAX_PREFETCH; j++)
            ok = up_batch_alloc(&s->pf[j], layer_blocks) && ok;
        if (!ok) {
            st = tkv_err(TKV_ERR_NOMEM, "kv-store: out of memory for the upload lists");
            goto fail;
        }
        /* checksums at the link's rate: one CRC-32C thread does ~10-20 GB/s,
         * PCIe 5 carries ~50 */
        long cpus = sysconf(_SC_NPROCESSORS_ONLN);
        uint32_t n_crc = (uint32_t)TKV_MIN(8, cpus > 1 ? cpus / 2 : 1);
        if (n_crc > 1 && (st = tkv_pool_init(n_crc, &s->crc_pool)) != TKV_OK)
            goto fail;
        if (s->staging && bo->host_register) {
            s->staging_registered =
                bo->host_register(backend, s->staging, (size_t)s->staging_cap * s->S) == TKV_OK;
            if (!s->staging_registered)
                TKV_LOG_W("kv-store: could not page-lock the staging buffer (%s); NVMe recalls copy block by block",
                          tkv_last_error());
        }
        s->staging_async = s->staging && (s->staging_registered || !bo->host_register);
    }
    if (p->page_table) { /* all zero: nothing is resident yet */
        s->pt_host = calloc(total, sizeof *s->pt_host);
        s->pt_pend = malloc(total * sizeof *s->pt_pend);
        s->pt_pend_n = calloc(p->n_layer, sizeof *s->pt_pend_n);
        s->pt_queued = calloc(total, 1);
        s->pt_idx = malloc(layer_blocks * sizeof *s->pt_idx);
        s->pt_val = malloc(layer_blocks * sizeof *s->pt_val);
        s->mark_words = (s->max_blocks + 31) / 32;
        s->marks = calloc(2 * (size_t)p->n_layer * p->n_head_kv * s->mark_words, sizeof *s->marks);
        s->mark_clock = calloc(2 * (size_t)p->n_layer, sizeof *s->mark_clock);
        if (!s->pt_host || !s->pt_pend || !s->pt_pend_n || !s->pt_queued || !s->pt_idx || !s->pt_val || !s->marks ||
            !s->mark_clock) {
            st = tkv_err(TKV_ERR_NOMEM, "kv-store: out of memory for the device page table");
            goto fail;
        }
        void *dev = NULL;
        if ((st = bo->alloc(backend, total * sizeof *s->pt_host, &dev)) != TKV_OK) {
            tkv_err_wrap(st, "kv-store: the device page table (%llu bytes)",
                         (unsigned long long)(total * sizeof *s->pt_host));
            goto fail;
        }
        s->pt_dev = dev;
        if ((st = bo->upload(backend, s->pt_dev, s->pt_host, total * sizeof *s->pt_host)) != TKV_OK ||
            (st = bo->synchronize(backend)) != TKV_OK) /* pt_host may change once we return */
            goto fail;
    }
    const char *compute_name = p->compute_is_host ? "host" : "gpu";
    s->st[TKV_TIER_COMPUTE].name = compute_name;
    s->st[TKV_TIER_COMPUTE].capacity_bytes = (uint64_t)s->pool[TKV_TIER_COMPUTE].cap * s->S;
    if (s->pool[TKV_TIER_HOST].present) {
        s->st[TKV_TIER_HOST].name = "host";
        s->st[TKV_TIER_HOST].capacity_bytes = (uint64_t)s->pool[TKV_TIER_HOST].cap * s->S;
    }
    if (s->pool[TKV_TIER_NVME].present) {
        s->st[TKV_TIER_NVME].name = "nvme";
        s->st[TKV_TIER_NVME].capacity_bytes = (uint64_t)s->pool[TKV_TIER_NVME].cap * s->S;
    }
    *out = s;
    return TKV_OK;
fail:
    tkv_kvs_free(s);
    return st;
}

void tkv_kvs_free(struct tkv_kvs *s)
{
    if (!s)
        return;
    if (s->async_up && s->be->ops->upload_wait(s->be, TKV_UPLOADS_ALL, true, NULL) != TKV_OK)
        TKV_LOG_W("%s", tkv_last_error()); /* nothing may still read our memory */
    if (s->staging_registered && s->be->ops->host_unregister)
        s->be->ops->host_unregister(s->be, s->staging);
    if (s->crc_pool)
        tkv_pool_free(s->crc_pool);
    up_batch_free(&s->dm);
    for (uint32_t j = 0; j < MAX_PREFETCH; j++)
        up_batch_free(&s->pf[j]);
    if (s->io) {
        prefetch_drain(s);
        tkv_io_file_close(s->file);
        tkv_io_free(s->io);
    }
    tkv_io_free_aligned(s->staging);
    for (int t = 0; t < TKV_TIER_COUNT; t++)
        if (s->pool[t].present)
            pool_free(s, t);
    free(s->blk);
    free(s->refs);
    free(s->host_refs);
    free(s->hlist);
    free(s->sel);
    free(s->sel_n);
    free(s->sparse_nb);
    free(s->hdata);
    free(s->hbad);
    free(s->chk_idx);
    free(s->chk_pos);
    free(s->chk_data);
    free(s->chk_bad);
    free(s->cand[0]);
    free(s->cand[1]);
    free(s->lists);
    free(s->order_tmp);
    free(s->order_count);
    free(s->grp_end);
    free(s->vkeys);
    free(s->run_below);
    free(s->inflight_reads);
    free(s->layer_pin);
    free(s->layer_lru);
    free(s->begin_clock);
    free(s->layer_begun);
    free(s->marks);
    free(s->mark_clock);
    free(s->layer_gen);
    free(s->views_gen);
    free(s->views_nb);
    free(s->ops);
    free(s->results);
    if (s->pt_dev)
        s->be->ops->release(s->be, s->pt_dev);
    free(s->pt_host);
    free(s->pt_pend);
    free(s->pt_pend_n);
    free(s->pt_queued);
    free(s->pt_idx);
    free(s->pt_val);
    free(s);
}

tkv_status tkv_kvs_reserve(struct tkv_kvs *s, uint32_t n_tokens)
{
    if (n_tokens > s->p.max_tokens)
        return tkv_err(TKV_ERR_CONTEXT_FULL, "kv-store: %u tokens exceed the context of %u", n_tokens, s->p.max_tokens);
    uint32_t need = (n_tokens + s->p.block_tokens - 1) / s->p.block_tokens;
    s->n_blocks = TKV_MAX(s->n_blocks, need);
    TKV_TRY(homes_grow(s));
    uint64_t blocks = (uint64_t)s->p.n_layer * s->p.n_head_kv * s->n_blocks;
    TKV_TRY(pool_grow(s, TKV_TIER_COMPUTE, (uint32_t)TKV_MIN(blocks, s->pool[TKV_TIER_COMPUTE].cap)));
    if (s->pool[TKV_TIER_NVME].present && blocks > s->pool[TKV_TIER_COMPUTE].cap)
        TKV_TRY(pool_grow(s, TKV_TIER_NVME, (uint32_t)blocks));
    return TKV_OK;
}

void tkv_kvs_set_length(struct tkv_kvs *s, uint32_t n_tokens)
{
    const uint32_t B = s->p.block_tokens, keep = (n_tokens + B - 1) / B, had = (s->length + B - 1) / B;
    if (keep < had) {
        prefetch_drain(s);
        if (prefetch_settle(s) != TKV_OK)
            TKV_LOG_W("%s", tkv_last_error());
        for (uint32_t l = 0; l < s->p.n_layer; l++)
            for (uint32_t h = 0; h < s->p.n_head_kv; h++)
                for (uint32_t b = keep; b < had; b++) {
                    uint32_t i = blk_index(s, l, h, b);
                    for (int t = 0; t < TKV_TIER_COUNT; t++)
                        if (s->pool[t].present)
                            drop_copy(s, i, t);
                }
    }
    s->length = n_tokens;
}


/* Entries [from, nb) of each head of a view array (refs of a layer, or
 * host_refs) without pointers; from is where the last clearing's last block
 * was (its length may have changed), 0 if none. */
static void views_clear_tail(const struct tkv_kvs *s, struct tkv_kv_block_ref *refs, uint32_t last_nb, uint32_t nb)
{
    const uint32_t m = TKV_MIN(last_nb, nb), from = m ? m - 1 : 0;
    for (uint32_t h = 0; h < s->p.n_head_kv; h++)
        for (uint32_t b = from; b < nb; b++)
            refs[(size_t)h * s->max_blocks + b] = block_ref(s, b, NULL);
}

/* host_refs without pointers (nb blocks per head): only the entries the
 * last read on the host tier set, and the last blocks, are written. */
static void host_views_clear(struct tkv_kvs *s, uint32_t nb)
{
    const uint32_t MB = s->max_blocks, LB = s->p.n_head_kv * MB;
    for (uint32_t j = 0; j < s->n_hlist; j++) {
        const uint32_t r = s->hlist[j] % LB;
        if (r % MB < nb)
            s->host_refs[r] = block_ref(s, r % MB, NULL);
    }
    views_clear_tail(s, s->host_refs, s->host_nb, nb);
    s->host_nb = nb;
    s->n_hlist = 0;
}

/* Before a selective read of `layer` (nb blocks per head): its views and
 * host_refs hold no pointers, each entry block_ref(b, NULL). Only the
 * entries the last selective read set, and the last blocks, are written;
 * after a whole-layer read (pointers anywhere), every entry. */
static void views_clear(struct tkv_kvs *s, uint32_t layer, uint32_t nb)
{
    const uint32_t MB = s->max_blocks, LB = s->p.n_head_kv * MB;
    struct tkv_kv_block_ref *refs = s->refs + (size_t)layer * LB;
    uint32_t last = 0; /* SPARSE_NONE: every entry below nb */
    if (s->sparse_nb[layer] != SPARSE_NONE) {
        const uint32_t *sel = s->sel + (size_t)layer * LB;
        for (uint32_t j = 0; j < s->sel_n[layer]; j++)
            if (sel[j] % MB < nb) /* (past nb: cleared when the tail reaches it) */
                refs[sel[j]] = block_ref(s, sel[j] % MB, NULL);
        last = s->sparse_nb[layer];
    }
    views_clear_tail(s, refs, last, nb);
    s->sparse_nb[layer] = nb;
    s->sel_n[layer] = 0;
    host_views_clear(s, nb);
}

tkv_status tkv_kvs_begin_layer(struct tkv_kvs *s, uint32_t layer, uint32_t write_pos, uint32_t n_write)
{
    return tkv_kvs_begin_layer_sel(s, layer, write_pos, n_write, NULL);
}

uint32_t tkv_kvs_max_blocks(const struct tkv_kvs *s) { return s->max_blocks; }

tkv_status tkv_kvs_begin_layer_sel(struct tkv_kvs *s, uint32_t layer, uint32_t write_pos, uint32_t n_write,
                                   const uint8_t *need)
{
    return tkv_kvs_begin_layer_split(s, layer, write_pos, n_write, need, NULL, NULL);
}

tkv_status tkv_kvs_begin_layer_split(struct tkv_kvs *s, uint32_t layer, uint32_t write_pos, uint32_t n_write,
                                     const uint8_t *need, const uint8_t *host_ok, uint32_t *n_host_out)
{
    if (n_host_out)
        *n_host_out = 0;
    const uint32_t B = s->p.block_tokens, nb = (s->length + B - 1) / B, H = s->p.n_head_kv;
    if (layer >= s->p.n_layer || nb > s->n_blocks)
        return tkv_err(TKV_ERR_INVALID_ARG, "kv-store: begin_layer(%u) outside the reserved page table", layer);
    if (s->broken)
        return tkv_err(TKV_ERR_IO, "kv-store: the NVMe tier failed earlier; the session cannot continue");
    const double t0 = tkv_now_seconds();
    s->part = PART_SETTLE;
    s->part_t = t0;
    s->sc.layers++;
    s->cur_layer = layer; /* eviction distances are measured from here */
    prefetch_drain_layer(s, layer);
    /* a prefetch of a later layer stays in flight (its blocks are not
     * evicted: in flight) and keeps the link busy meanwhile */
    tkv_status st = prefetch_settle_layer(s, layer);
    part_switch(s, PART_OTHER);
    if (st != TKV_OK)
        goto out;
    uint32_t n_missing = 0, n_host = 0;
    s->clock++;
    stale_advance(s);
    s->layer_begun[layer] = s->clock;
    const uint32_t w0 = n_write ? write_pos / B : UINT32_MAX, w1 = n_write ? (write_pos + n_write - 1) / B : 0;
    /* left on the host tier: allowed, not about to be written, and its
     * current copy is there and not in the compute tier */
    const bool split = host_ok && s->pool[TKV_TIER_HOST].present;
    /* A whole-layer read pins and stamps the layer as one. Its blocks below
     * b0 are known to be in the compute tier with the views refs[layer]
     * holds: the last whole-layer read made those views complete, and no
     * compute slot of the layer changed hands since (any move of a block in
     * or out of the compute tier takes or gives one). From b0 on a block may
     * have grown (the last one then), be new, or be anywhere. */
    const bool whole = !need && !split && !s->p.walk_ref;
    /* a selective read (not walk_ref): pins, views and their clearing go by
     * the layer's list of the blocks read */
    const bool listed = !whole && !s->p.walk_ref;
    const size_t base = (size_t)layer * H * s->max_blocks; /* blk_index(s, layer, 0, 0) */
    uint32_t *sel = s->sel + base, n_sel = 0;
    struct tkv_kv_block_ref *refs = s->refs + base;
    if (listed) {
        views_clear(s, layer, nb);
    } else if (whole) {
        s->sparse_nb[layer] = SPARSE_NONE;
        host_views_clear(s, nb); /* nothing is read on the host tier */
    }
    uint32_t b0 = 0;
    if (whole) {
        if (s->views_gen[layer] == s->layer_gen[layer] && s->views_nb[layer] > 0)
            b0 = TKV_MIN(TKV_MIN(s->views_nb[layer] - 1, nb), w0);
        s->layer_pin[layer] = 1;
        s->layer_lru[layer] = s->clock;
        s->st[TKV_TIER_COMPUTE].hits += (uint64_t)H * b0;
    }
    s->views_gen[layer] = VIEWS_STALE; /* until this begin has completed them */
#define NEEDED(h, b) (!need || need[(size_t)(h) * s->max_blocks + (b)] || ((b) >= w0 && (b) <= w1))
    /* host blocks pinned in place must leave the host tier room for a batch
     * of spills (make_room spills IO_BATCH at a time), so that no recall of
     * this begin finds the host tier full of pins; beyond that, recalled */
    const uint32_t max_host = split && s->pool[TKV_TIER_HOST].cap > IO_BATCH ? s->pool[TKV_TIER_HOST].cap - IO_BATCH : 0;
#define HOST_READ(h, b, k)                                                                                        \
    (split && n_host < max_host && host_ok[(size_t)(h) * s->max_blocks + (b)] && !((b) >= w0 && (b) <= w1) &&     \
     !((k)->valid & BIT(TKV_TIER_COMPUTE)) && ((k)->valid & BIT(TKV_TIER_HOST)))
    /* A selective read lists its blocks first (sel, in (head, block)
     * order): a selection's records are scattered, each a cache miss, and
     * the list lets the loop below ask for the record SEL_AHEAD blocks on,
     * whatever lies between them. Other reads walk every block in order. */
    if (listed)
        for (uint32_t h = 0; h < H; h++)
            for (uint32_t b = b0; b < nb; b++)
                if (NEEDED(h, b))
                    sel[n_sel++] = h * s->max_blocks + b; /* blk_index(s, layer, h, b) - base */
    const uint32_t n_visit = listed ? n_sel : H * (nb - b0);
    for (uint32_t j = 0, h = 0, b = b0; j < n_visit; j++) {
        if (listed) {
            if (j + SEL_AHEAD < n_sel)
                __builtin_prefetch(&s->blk[base + sel[j + SEL_AHEAD]], 1);
            h = sel[j] / s->max_blocks, b = sel[j] % s->max_blocks;
        } else {
            if (j > 0 && ++b == nb) /* the next (head, block) */
                b = b0, h++;
            if (!NEEDED(h, b))
                continue;
        }
        uint32_t i = blk_index(s, layer, h, b);
        struct blk *k = &s->blk[i];
        if (!whole) {
            k->lru = s->clock;
            if (HOST_READ(h, b, k)) { /* pinned on the host tier before anything can spill into it */
                k->hpinned = 1;
                s->hlist[n_host] = i;
                s->hdata[n_host] = slot_ptr(s, TKV_TIER_HOST, k->slot[TKV_TIER_HOST]);
                if (listed) /* its host slot stays (pinned there) */
                    s->host_refs[i - base] = block_ref(s, b, (uint8_t *)s->hdata[n_host]);
                n_host++;
                continue;
            }
            k->pinned = 1;
        }
        if (k->valid & BIT(TKV_TIER_COMPUTE)) {
            s->st[TKV_TIER_COMPUTE].hits++;
            if (listed) /* its compute slot stays (pinned); the missing ones' views come below */
                refs[i - base] = block_ref(s, b, slot_ptr(s, TKV_TIER_COMPUTE, k->slot[TKV_TIER_COMPUTE]));
        } else {
            s->st[TKV_TIER_COMPUTE].misses++;
            s->lists[n_missing++] = i;
        }
    }
    if (listed) { /* before anything can fail: views_clear's lists of what holds pointers */
        s->sel_n[layer] = n_sel;
        s->n_hlist = n_host;
    }
    /* the blocks read where they are are checked like any recall, before
     * anything is moved for the others */
    if (n_host > 0) {
        check_host_copies(s, s->hlist, s->hdata, n_host, s->hbad);
        for (uint32_t j = 0; j < n_host; j++)
            if (s->hbad[j]) {
                st = corrupt_error(s, s->hlist[j], TKV_TIER_HOST);
                goto out;
            }
        s->host_reads += n_host;
        s->st[TKV_TIER_HOST].hits += n_host;
    }
    /* new blocks (never stored) need just a slot; the others a recall.
     * lists[0, n_missing) holds the missing blocks; partition it in place:
     * recalls first, new blocks after. */
    uint32_t n_recall = 0, n_new = 0;
    uint32_t *lists = s->lists;
    for (uint32_t j = 0; j < n_missing; j++) {
        uint32_t i = lists[j];
        if (s->blk[i].valid)
            lists[n_recall++] = i;
        else
            lists[n_missing + n_new++] = i;
    }
    if (n_recall && (st = recall(s, lists, n_recall, n_host)) != TKV_OK)
        goto out;
    if (n_new) {
        if ((st = make_room_for_layer(s, n_new)) != TKV_OK)
            goto out;
        for (uint32_t j = 0; j < n_new; j++) {
            uint32_t i = lists[n_missing + j];
            s->blk[i].slot[TKV_TIER_COMPUTE] = pool_take(s, TKV_TIER_COMPUTE, i);
            s->blk[i].valid = BIT(TKV_TIER_COMPUTE);
        }
    }
    /* blocks about to be written: only the compute copy stays current */
    if (n_write > 0)
        for (uint32_t h = 0; h < H; h++)
            for (uint32_t b = write_pos / B; b <= (write_pos + n_write - 1) / B && b < nb; b++) {
                uint32_t i = blk_index(s, layer, h, b);
                if (s->blk[i].valid & BIT(TKV_TIER_HOST))
                    drop_copy(s, i, TKV_TIER_HOST);
                s->blk[i].valid = BIT(TKV_TIER_COMPUTE); /* the NVMe slot is kept for the next spill */
            }
    /* the views of this layer from b0 on (blocks left out: no pointers),
     * and those of the blocks read on the host tier; after a selective read
     * only those of the blocks that were missing (views_clear left the
     * others without pointers; the loop above set those of the rest) */
    for (uint32_t j = 0; listed && j < n_missing; j++) {
        const uint32_t i = lists[j < n_recall ? j : n_missing + (j - n_recall)]; /* recalls, then new blocks */
        refs[i - base] = block_ref(s, (i - (uint32_t)base) % s->max_blocks,
                                   slot_ptr(s, TKV_TIER_COMPUTE, s->blk[i].slot[TKV_TIER_COMPUTE]));
    }
    for (uint32_t h = 0; h < H && !listed; h++)
        for (uint32_t b = b0; b < nb; b++) {
            const struct blk *k = &s->blk[blk_index(s, layer, h, b)];
            const bool on_host = NEEDED(h, b) && k->hpinned;
            uint8_t *p = NEEDED(h, b) && !on_host ? slot_ptr(s, TKV_TIER_COMPUTE, k->slot[TKV_TIER_COMPUTE]) : NULL;
            const size_t r = (size_t)h * s->max_blocks + b;
            refs[r] = block_ref(s, b, p);
            if (!whole)
                s->host_refs[r] = block_ref(s, b, on_host ? slot_ptr(s, TKV_TIER_HOST, k->slot[TKV_TIER_HOST]) : NULL);
        }
    if (!need && n_host == 0) { /* complete: the next whole-layer read may start from the last block */
        s->views_gen[layer] = s->layer_gen[layer];
        s->views_nb[layer] = nb;
    }
    if (n_host_out)
        *n_host_out = n_host;
#undef HOST_READ
#undef NEEDED
    s->cur_layer = layer;
out:;
    const double t1 = tkv_now_seconds();
    s->part_s[s->part] += t1 - s->part_t;
    s->part = PART_NONE;
    s->stall += t1 - t0;
    if (st != TKV_OK)
        tkv_kvs_end_layer(s, layer);
    return st;
}

void tkv_kvs_end_layer(struct tkv_kvs *s, uint32_t layer)
{
    if (s->layer_pin[layer]) { /* a whole-layer read: nothing was pinned block by block */
        s->layer_pin[layer] = 0;
        return;
    }
    if (!s->p.walk_ref) { /* a selective read: the blocks it listed */
        const size_t base = (size_t)layer * s->p.n_head_kv * s->max_blocks;
        const uint32_t *sel = s->sel + base;
        for (uint32_t j = 0; j < s->sel_n[layer]; j++) {
            struct blk *k = &s->blk[base + sel[j]];
            k->pinned = 0;
            k->hpinned = 0;
        }
        return;
    }
    const uint32_t nb = TKV_MIN((s->length + s->p.block_tokens - 1) / s->p.block_tokens, s->n_blocks);
    for (uint32_t h = 0; h < s->p.n_head_kv; h++)
        for (uint32_t b = 0; b < nb; b++) {
            struct blk *k = &s->blk[blk_index(s, layer, h, b)];
            k->pinned = 0;
            k->hpinned = 0;
        }
}

/* tkv_kvs_prefetch's work over the blocks off[0, n) of `layer`, each given
 * as head * max_blocks + block (as sel holds them). */
static void prefetch_blocks(struct tkv_kvs *s, uint32_t layer, const uint32_t *off, uint32_t n)
{
    /* NVMe -> a host compute tier by io_uring; pinned host -> GPU by the
     * backend's asynchronous uploads */
    const bool from_nvme = s->io && s->p.compute_is_host;
    const bool from_host = s->async_up && s->pool[TKV_TIER_HOST].present;
    if (!from_nvme && !from_host)
        return;
    const int from = from_nvme ? TKV_TIER_NVME : TKV_TIER_HOST;
    struct blk *const base = s->blk + (size_t)layer * s->p.n_head_kv * s->max_blocks;
#define WANTED(k) (!((k)->valid & BIT(TKV_TIER_COMPUTE)) && !(k)->inflight && ((k)->valid & BIT(from)))
    uint32_t wanted = 0;
    for (uint32_t j = 0; j < n; j++)
        wanted += WANTED(&base[off[j]]);
    if (wanted == 0)
        return;
    /* a free set of lists: the oldest prefetch settles when all are busy */
    if (from_host && s->n_pf == MAX_PREFETCH && prefetch_settle_n(s, 1) != TKV_OK)
        return; /* the error comes back from the next begin_layer */
    struct up_batch *ub = from_host ? &s->pf[s->n_pf] : NULL;
    /* room from clean blocks needed after `layer` (never the pinned current
     * layer, nor the listed blocks already in place) */
    for (uint32_t j = 0; j < n; j++)
        base[off[j]].pinned++;
    const uint32_t saved = s->cur_layer;
    /* distances as seen from the layer before the prefetched one: it runs
     * first (it is the current layer, or about to be when the caller
     * prefetches ahead of begin_layer), so it is evicted last */
    s->cur_layer = (layer + s->p.n_layer - 1) % s->p.n_layer;
    make_room_ex(s, TKV_TIER_COMPUTE, wanted, true);
    s->cur_layer = saved;
    for (uint32_t j = 0; j < n; j++)
        base[off[j]].pinned--;
    uint32_t n_up = 0;
    for (uint32_t j = 0; j < n; j++) {
        struct blk *k = &base[off[j]];
        const uint32_t i = (uint32_t)(k - s->blk);
        if (!WANTED(k))
            continue;
        if (s->pool[TKV_TIER_COMPUTE].n_free == 0)
            goto issue; /* only free slots: a prefetch never evicts */
        int32_t cs = pool_take(s, TKV_TIER_COMPUTE, i);
        if (from_host) { /* in flight until it is settled */
            k->slot[TKV_TIER_COMPUTE] = cs;
            k->inflight = 1;
            ub->idx[n_up] = i;
            ub->src[n_up] = slot_ptr(s, TKV_TIER_HOST, k->slot[TKV_TIER_HOST]);
            ub->dst[n_up++] = slot_ptr(s, TKV_TIER_COMPUTE, cs);
            if (n_up - ub->sent >= s->up_piece && up_send(s, ub, n_up) != TKV_OK)
                goto issue;
            continue;
        }
        int rc = tkv_io_read(s->io, s->file, slot_ptr(s, TKV_TIER_COMPUTE, cs), s->S,
                             (uint64_t)k->slot[TKV_TIER_NVME] * s->S, ((uint64_t)i << 1) | 1);
        if (rc < 0) {
            pool_give(s, TKV_TIER_COMPUTE, cs);
            goto issue;
        }
        k->slot[TKV_TIER_COMPUTE] = cs;
        k->inflight = 1;
        s->n_inflight++;
        s->inflight_reads[layer]++;
        s->prefetched++;
    }
#undef WANTED
issue:
    if (!from_host) {
        tkv_io_submit(s->io);
        return;
    }
    (void)up_send(s, ub, n_up); /* on failure the rest is given back below */
    s->prefetched += ub->sent;
    for (uint32_t j = ub->sent; j < n_up; j++) { /* not queued */
        s->blk[ub->idx[j]].inflight = 0;
        drop_copy(s, ub->idx[j], TKV_TIER_COMPUTE);
    }
    if (ub->sent > 0) {
        ub->layer = layer;
        s->n_pf++;
    }
}

void tkv_kvs_prefetch(struct tkv_kvs *s, uint32_t layer)
{
    layer %= s->p.n_layer; /* after the last layer comes the first (next step) */
    const uint32_t nb = TKV_MIN((s->length + s->p.block_tokens - 1) / s->p.block_tokens, s->n_blocks);
    uint32_t *off = s->lists, n = 0; /* (free outside begin_layer) */
    for (uint32_t h = 0; h < s->p.n_head_kv; h++)
        for (uint32_t b = 0; b < nb; b++)
            off[n++] = h * s->max_blocks + b;
    prefetch_blocks(s, layer, off, n);
}

void tkv_kvs_prefetch_last(struct tkv_kvs *s, uint32_t layer)
{
    layer %= s->p.n_layer;
    if (s->p.walk_ref || s->sparse_nb[layer] == SPARSE_NONE) {
        tkv_kvs_prefetch(s, layer);
        return;
    }
    prefetch_blocks(s, layer, s->sel + (size_t)layer * s->p.n_head_kv * s->max_blocks, s->sel_n[layer]);
}

bool tkv_kvs_prefetch_done(struct tkv_kvs *s)
{
    if (s->io && s->n_inflight > 0) {
        struct tkv_io_cqe cqe[IO_BATCH];
        int got;
        while ((got = tkv_io_poll(s->io, cqe, IO_BATCH)) > 0)
            for (int c = 0; c < got; c++)
                if (cqe[c].user_tag & 1)
                    prefetch_complete(s, &cqe[c]);
        if (s->n_inflight > 0)
            return false;
    }
    bool done = true;
    if (s->n_pf > 0 && s->be->ops->upload_wait(s->be, s->pf[s->n_pf - 1].ticket, false, &done) != TKV_OK)
        return true; /* the error comes back from the next begin_layer */
    return done;
}

tkv_status tkv_kvs_prefetch_wait(struct tkv_kvs *s)
{
    prefetch_drain(s);
    return prefetch_settle(s);
}

struct tkv_kv_head_view tkv_kvs_view(const struct tkv_kvs *s, uint32_t layer, uint32_t head)
{
    return (struct tkv_kv_head_view){.blocks = s->refs + ((size_t)layer * s->p.n_head_kv + head) * s->max_blocks,
                                     .n_blocks = (s->length + s->p.block_tokens - 1) / s->p.block_tokens};
}

struct tkv_kv_head_view tkv_kvs_host_view(const struct tkv_kvs *s, uint32_t layer, uint32_t head)
{
    (void)layer;
    return (struct tkv_kv_head_view){.blocks = s->host_refs + (size_t)head * s->max_blocks,
                                     .n_blocks = (s->length + s->p.block_tokens - 1) / s->p.block_tokens};
}

void tkv_kvs_locate(const struct tkv_kvs *s, uint32_t layer, uint32_t head, uint32_t pos, uint16_t **k, uint16_t **v)
{
    const uint32_t B = s->p.block_tokens;
    const struct tkv_kv_block_ref *r = &s->refs[((size_t)layer * s->p.n_head_kv + head) * s->max_blocks + pos / B];
    *k = r->k + (size_t)(pos % B) * s->p.head_dim;
    *v = r->v + (size_t)(pos % B) * s->p.head_dim;
}

/* ---- the device page table ---------------------------------------------------- */

/* What block i's page-table entry must say now: the address of its compute
 * slot while its compute copy is current, else 0; *settled false while it
 * has a slot whose copy is still arriving (a prefetch or a recall in
 * flight), whose entry is 0 until a later sync finds it current. */
static uint64_t pt_entry(const struct tkv_kvs *s, uint32_t i, bool *settled)
{
    const struct blk *k = &s->blk[i];
    const int32_t cs = k->slot[TKV_TIER_COMPUTE];
    *settled = cs < 0 || (!k->inflight && (k->valid & BIT(TKV_TIER_COMPUTE)));
    if (cs < 0 || !*settled)
        return 0;
    return (uint64_t)(uintptr_t)slot_ptr(s, TKV_TIER_COMPUTE, cs);
}

const uint64_t *tkv_kvs_page_table(const struct tkv_kvs *s, uint32_t layer)
{
    if (!s->pt_dev || layer >= s->p.n_layer)
        return NULL;
    return s->pt_dev + (size_t)layer * s->p.n_head_kv * s->max_blocks;
}

bool tkv_kvs_layer_mapped(const struct tkv_kvs *s, uint32_t layer)
{
    if (!s->pt_dev || layer >= s->p.n_layer)
        return false;
    /* blocks at or past the length hold no slot (set_length drops them), a
     * block at most one compute slot: the count is the blocks resident, and
     * with nothing pending each one's entry is its slot */
    const uint32_t B = s->p.block_tokens, nb = (s->length + B - 1) / B;
    return s->pool[TKV_TIER_COMPUTE].layer_used[layer] == (uint64_t)s->p.n_head_kv * nb && s->pt_pend_n[layer] == 0;
}

uint32_t tkv_kvs_mark_words(const struct tkv_kvs *s) { return s->mark_words; }

tkv_status tkv_kvs_mark_reads(struct tkv_kvs *s, uint32_t layer, const uint32_t *rows)
{
    if (!s->marks)
        return tkv_err(TKV_ERR_INVALID_ARG, "kv-store: mark_reads: the store keeps no read marks (no page table)");
    if (layer >= s->p.n_layer || !rows)
        return tkv_err(TKV_ERR_INVALID_ARG, "kv-store: mark_reads: layer %u of %u, rows %p", layer, s->p.n_layer,
                       (const void *)rows);
    /* over the older generation */
    const uint32_t g = s->mark_clock[2 * layer] <= s->mark_clock[2 * layer + 1] ? 0 : 1;
    const size_t layer_words = (size_t)s->p.n_head_kv * s->mark_words;
    memcpy(s->marks + (g * (size_t)s->p.n_layer + layer) * layer_words, rows, layer_words * sizeof *rows);
    s->mark_clock[2 * layer + g] = s->layer_begun[layer];
    s->marked_layers++;
    return TKV_OK;
}

tkv_status tkv_kvs_page_table_sync(struct tkv_kvs *s, uint32_t layer, uint32_t *n_written)
{
    if (n_written)
        *n_written = 0;
    if (!s->pt_dev)
        return tkv_err(TKV_ERR_INVALID_ARG, "kv-store: page_table_sync: the store keeps no device page table");
    if (layer >= s->p.n_layer)
        return tkv_err(TKV_ERR_INVALID_ARG, "kv-store: page_table_sync: layer %u of %u", layer, s->p.n_layer);
    const uint64_t layer_blocks = (uint64_t)s->p.n_head_kv * s->max_blocks, base = layer * layer_blocks;
    uint32_t *pend = s->pt_pend + base;
    uint32_t n = 0, keep = 0;
    for (uint32_t j = 0; j < s->pt_pend_n[layer]; j++) {
        const uint32_t i = (uint32_t)(base + pend[j]);
        bool settled;
        const uint64_t e = pt_entry(s, i, &settled);
        if (settled)
            s->pt_queued[i] = 0;
        else
            pend[keep++] = pend[j];
        if (e != s->pt_host[i]) {
            s->pt_idx[n] = i;
            s->pt_val[n++] = e;
        }
    }
    s->pt_pend_n[layer] = keep;
    if (n == 0)
        return TKV_OK;
    const struct tkv_backend_ops *bo = s->be->ops;
    tkv_status st = TKV_OK;
    if (bo->table_write)
        st = bo->table_write(s->be, s->pt_dev, s->pt_idx, s->pt_val, n);
    else /* (pt_val's entries are not rewritten before this sync's uploads have read them: each is its own) */
        for (uint32_t j = 0; j < n && st == TKV_OK; j++)
            st = bo->upload(s->be, s->pt_dev + s->pt_idx[j], &s->pt_val[j], sizeof *s->pt_val);
    if (st != TKV_OK) { /* requeue everything this sync took off: the next one writes it again */
        for (uint32_t j = 0; j < n; j++)
            if (!s->pt_queued[s->pt_idx[j]]) {
                s->pt_queued[s->pt_idx[j]] = 1;
                pend[s->pt_pend_n[layer]++] = (uint32_t)(s->pt_idx[j] - base);
            }
        return tkv_err_wrap(st, "kv-store: writing %u entries of layer %u's device page table", n, layer);
    }
    for (uint32_t j = 0; j < n; j++)
        s->pt_host[s->pt_idx[j]] = s->pt_val[j];
    if (n_written)
        *n_written = n;
    return TKV_OK;
}

uint64_t tkv_kvs_test_compute_addr(const struct tkv_kvs *s, uint32_t layer, uint32_t head, uint32_t b)
{
    const int32_t cs = s->blk[blk_index(s, layer, head, b)].slot[TKV_TIER_COMPUTE];
    return cs < 0 ? 0 : (uint64_t)(uintptr_t)slot_ptr(s, TKV_TIER_COMPUTE, cs);
}

uint32_t tkv_kvs_block_bytes(const struct tkv_kvs *s) { return s->S; }

uint32_t tkv_kvs_verify_threads(const struct tkv_kvs *s) { return s->crc_pool ? tkv_pool_size(s->crc_pool) : 1; }

int tkv_kvs_block_tier(const struct tkv_kvs *s, uint32_t layer, uint32_t head, uint32_t b)
{
    if (layer >= s->p.n_layer || head >= s->p.n_head_kv || b >= s->max_blocks)
        return -1;
    uint8_t v = s->blk[blk_index(s, layer, head, b)].valid;
    for (int t = 0; t < TKV_TIER_COUNT; t++)
        if (v & BIT(t))
            return t;
    return -1;
}

static tkv_status check_block(const struct tkv_kvs *s, uint32_t layer, uint32_t head, uint32_t b)
{
    if (layer >= s->p.n_layer || head >= s->p.n_head_kv || b >= s->n_blocks)
        return tkv_err(TKV_ERR_INVALID_ARG, "kv-store: block (layer %u, head %u, block %u) is outside the store",
                       layer, head, b);
    return TKV_OK;
}

tkv_status tkv_kvs_export(struct tkv_kvs *s, uint32_t layer, uint32_t head, uint32_t b, void *dst)
{
    TKV_TRY(check_block(s, layer, head, b));
    prefetch_drain(s);
    TKV_TRY(prefetch_settle(s));
    uint32_t i = blk_index(s, layer, head, b);
    struct blk *k = &s->blk[i];
    if (k->valid & BIT(TKV_TIER_COMPUTE))
        return compute_to_host(s, k->slot[TKV_TIER_COMPUTE], dst);
    if (k->valid & BIT(TKV_TIER_HOST)) {
        const void *src = slot_ptr(s, TKV_TIER_HOST, k->slot[TKV_TIER_HOST]);
        TKV_TRY(verify(s, i, src, TKV_TIER_HOST));
        memcpy(dst, src, s->S);
        return TKV_OK;
    }
    if (k->valid & BIT(TKV_TIER_NVME)) {
        s->ops[0] = (struct io_op){.blk = i, .write = false, .buf = s->staging};
        TKV_TRY(nvme_run(s, s->ops, 1, s->results));
        TKV_TRY(verify(s, i, s->staging, TKV_TIER_NVME));
        s->st[TKV_TIER_NVME].bytes_out += s->S;
        memcpy(dst, s->staging, s->S);
        return TKV_OK;
    }
    return block_error(s, TKV_ERR_INVALID_ARG, i, "holds no data");
}

tkv_status tkv_kvs_import(struct tkv_kvs *s, uint32_t layer, uint32_t head, uint32_t b, const void *src)
{
    TKV_TRY(check_block(s, layer, head, b));
    prefetch_drain(s); /* an in-flight read must not land on top of the import */
    TKV_TRY(prefetch_settle(s));
    uint32_t i = blk_index(s, layer, head, b);
    struct blk *k = &s->blk[i];
    if (!(k->valid & BIT(TKV_TIER_COMPUTE))) {
        k->pinned = 1; /* not its own eviction victim */
        tkv_status st = make_room(s, TKV_TIER_COMPUTE, 1);
        k->pinned = 0;
        TKV_TRY(st);
        if (k->slot[TKV_TIER_COMPUTE] < 0)
            k->slot[TKV_TIER_COMPUTE] = pool_take(s, TKV_TIER_COMPUTE, i);
    }
    if (k->valid & BIT(TKV_TIER_HOST))
        drop_copy(s, i, TKV_TIER_HOST);
    TKV_TRY(host_to_compute(s, src, k->slot[TKV_TIER_COMPUTE]));
    k->valid = BIT(TKV_TIER_COMPUTE);
    k->lru = ++s->clock;
    s->st[TKV_TIER_COMPUTE].bytes_in += s->S;
    return TKV_OK;
}

/* ---- bulk import ---------------------------------------------------------------- */

/* Evicts list[0..n) from memory tier t, exactly those: clean ones dropped
 * first (see make_room_ex), dirty ones written down IO_BATCH at a time. */
static tkv_status evict_list(struct tkv_kvs *s, int t, uint32_t *list, uint32_t n)
{
    uint32_t nd = 0, freed = 0;
    for (uint32_t j = 0; j < n; j++) {
        if (s->blk[list[j]].valid & ~BIT(t))
            drop_copy(s, list[j], t);
        else
            list[nd++] = list[j];
    }
    for (uint32_t j0 = 0; j0 < nd; j0 += IO_BATCH)
        TKV_TRY(spill_down(s, t, list + j0, TKV_MIN(IO_BATCH, nd - j0), &freed));
    return TKV_OK;
}

/* Writes the run blocks base + j with s->run_below[j] set (no copy anywhere
 * yet), payloads src[j], straight to the tier below compute with their
 * checksums: host-tier slots below a GPU, else NVMe through the staging
 * buffer (O_DIRECT wants it aligned; src need not be). A block whose write
 * fails holds nothing; the first error is returned. */
static tkv_status import_below(struct tkv_kvs *s, uint32_t base, const void *const *src, uint32_t n)
{
    const bool host = s->pool[TKV_TIER_HOST].present;
    uint32_t j = 0;
    while (j < n) {
        uint32_t run[IO_BATCH], m = 0;
        const void *from[IO_BATCH];
        for (; j < n && m < IO_BATCH; j++)
            if (s->run_below[j]) {
                run[m] = base + j;
                from[m++] = src[j];
            }
        if (m == 0)
            break;
        const void *copy[IO_BATCH]; /* where the payloads are now: checksummed on the CRC threads */
        if (host) {
            TKV_TRY(make_room(s, TKV_TIER_HOST, m));
            for (uint32_t r = 0; r < m; r++) {
                struct blk *k = &s->blk[run[r]];
                int32_t hs = pool_take(s, TKV_TIER_HOST, run[r]);
                if (hs < 0)
                    return block_error(s, TKV_ERR_INTERNAL, run[r], "no host-tier slot after making room");
                k->slot[TKV_TIER_HOST] = hs;
                uint8_t *dst = slot_ptr(s, TKV_TIER_HOST, hs);
                memcpy(dst, from[r], s->S);
                copy[r] = dst;
                k->valid = BIT(TKV_TIER_HOST);
            }
            crc_batch(s, run, copy, m);
            s->st[TKV_TIER_HOST].bytes_in += (uint64_t)m * s->S;
            continue;
        }
        if (!s->pool[TKV_TIER_NVME].present)
            return no_lower_tier(s, TKV_TIER_COMPUTE);
        for (uint32_t r = 0; r < m; r++) {
            TKV_TRY(nvme_slot(s, run[r]));
            uint8_t *buf = s->staging + (size_t)r * s->S;
            memcpy(buf, from[r], s->S);
            copy[r] = buf;
            s->ops[r] = (struct io_op){.blk = run[r], .write = true, .buf = buf};
        }
        crc_batch(s, run, copy, m);
        tkv_status st = nvme_run(s, s->ops, m, s->results);
        for (uint32_t r = 0; r < m; r++)
            if (s->results[r] == (int64_t)s->S) {
                s->blk[run[r]].valid = BIT(TKV_TIER_NVME);
                s->st[TKV_TIER_NVME].bytes_in += s->S;
            }
        TKV_TRY(st);
    }
    return TKV_OK;
}

/* Copies the payloads src[j] of the run blocks base + j that stay
 * (s->run_below[j] clear) into compute slots. Below a GPU whose backend
 * queues block uploads they go up IO_BATCH at a time through the registered
 * staging buffer, one wait per batch (src is the caller's memory, neither
 * registered nor ours after the call); else one upload (a memcpy on the
 * CPU) each. On failure no block keeps a slot without its payload. */
static tkv_status import_up(struct tkv_kvs *s, uint32_t base, const void *const *src, uint32_t n)
{
    const bool batched = !s->p.compute_is_host && s->staging_async;
    tkv_status st = TKV_OK;
    uint32_t j = 0;
    while (j < n && st == TKV_OK) {
        uint32_t run[IO_BATCH], m = 0;
        void *dst[IO_BATCH];
        const void *from[IO_BATCH];
        for (; j < n && m < (batched ? IO_BATCH : 1); j++) {
            if (s->run_below[j])
                continue;
            struct blk *k = &s->blk[base + j];
            int32_t cs = pool_take(s, TKV_TIER_COMPUTE, base + j);
            if (cs < 0) {
                st = block_error(s, TKV_ERR_INTERNAL, base + j, "no compute slot after making room");
                break;
            }
            k->slot[TKV_TIER_COMPUTE] = cs;
            run[m] = base + j;
            dst[m] = slot_ptr(s, TKV_TIER_COMPUTE, cs);
            from[m++] = src[j];
        }
        if (m == 0)
            break;
        if (st == TKV_OK && !batched) {
            st = host_to_compute(s, from[0], s->blk[run[0]].slot[TKV_TIER_COMPUTE]);
        } else if (st == TKV_OK) {
            for (uint32_t r = 0; r < m; r++) {
                memcpy(s->staging + (size_t)r * s->S, from[r], s->S);
                from[r] = s->staging + (size_t)r * s->S;
            }
            uint64_t ticket = 0;
            st = s->be->ops->upload_blocks(s->be, dst, from, m, s->S, NULL, NULL, &ticket);
            if (st == TKV_OK && (st = s->be->ops->upload_wait(s->be, ticket, true, NULL)) != TKV_OK)
                (void)s->be->ops->upload_fence(s->be, ticket); /* a late copy lands before the slot's next user */
        }
        if (st != TKV_OK) {
            uint32_t l, h, b;
            blk_coords(s, run[0], &l, &h, &b);
            st = tkv_err_wrap(st, "kv-store: importing %u block(s) from (layer %u, head %u, block %u)", m, l, h, b);
            break;
        }
        for (uint32_t r = 0; r < m; r++)
            s->blk[run[r]].valid = BIT(TKV_TIER_COMPUTE);
        s->st[TKV_TIER_COMPUTE].bytes_in += (uint64_t)m * s->S;
    }
    if (st != TKV_OK)
        for (uint32_t r = 0; r < n; r++)
            if (!s->run_below[r] && !(s->blk[base + r].valid & BIT(TKV_TIER_COMPUTE)))
                drop_copy(s, base + r, TKV_TIER_COMPUTE);
    return st;
}

uint32_t tkv_kvs_import_run(const struct tkv_kvs *s, uint32_t n_blocks)
{
    return TKV_MAX(1u, TKV_MIN(n_blocks, (64u << 20) / s->S));
}

tkv_status tkv_kvs_import_n(struct tkv_kvs *s, uint32_t layer, uint32_t head, uint32_t b0, uint32_t n,
                            const void *const *src)
{
    if (n == 0)
        return TKV_OK;
    TKV_TRY(check_block(s, layer, head, b0));
    if (!src || n > s->n_blocks - b0)
        return tkv_err(TKV_ERR_INVALID_ARG, "kv-store: import of %u blocks from (layer %u, head %u, block %u): %s", n,
                       layer, head, b0, src ? "past the reserved blocks" : "no payloads");
    prefetch_drain(s); /* an in-flight read must not land on top of the import */
    TKV_TRY(prefetch_settle(s));
    const uint32_t base = blk_index(s, layer, head, b0);
    for (uint32_t j = 0; j < n; j++) {
        const struct blk *k = &s->blk[base + j];
        if (k->valid || k->slot[TKV_TIER_COMPUTE] >= 0 || k->slot[TKV_TIER_HOST] >= 0) {
            for (uint32_t r = 0; r < n; r++) /* holds data: the general path */
                TKV_TRY(tkv_kvs_import(s, layer, head, b0 + r, src[r]));
            return TKV_OK;
        }
    }
    struct pool *pc = &s->pool[TKV_TIER_COMPUTE];
    if (pc->n_free < n)
        TKV_TRY(pool_grow(s, TKV_TIER_COMPUTE, pc->n + (n - pc->n_free))); /* within capacity */
    for (uint32_t j = 0; j < n; j++) /* as n imports would stamp them */
        s->blk[base + j].lru = s->clock + 1 + j;
    s->clock += n;
    memset(s->run_below, 0, n);
    const uint32_t over = n > pc->n_free ? n - pc->n_free : 0; /* blocks that must leave the compute tier */
    if (over > 0) {
        if (!s->pool[TKV_TIER_HOST].present && !s->pool[TKV_TIER_NVME].present)
            return no_lower_tier(s, TKV_TIER_COMPUTE);
        /* one victim order over what import would consider, one block at a
         * time: the evictable compute blocks, and the run's earlier blocks
         * (the last one is, like import's block, never its own victim) */
        uint32_t *cand = s->cand[TKV_TIER_COMPUTE];
        bool run_in;
        uint32_t n_cand = collect_candidates(s, TKV_TIER_COMPUTE, false, over, layer, n - 1, &run_in);
        for (uint32_t j = 0; run_in && j + 1 < n; j++)
            cand[n_cand++] = base + j;
        if (n_cand < over)
            return tier_too_small(s, TKV_TIER_COMPUTE);
        order_victims(s, cand, n_cand, over, over);
        uint32_t n_old = 0; /* victims already in the tier: evicted now */
        for (uint32_t c = 0; c < over; c++) {
            if (cand[c] >= base && cand[c] < base + n)
                s->run_below[cand[c] - base] = 1;
            else
                cand[n_old++] = cand[c];
        }
        TKV_TRY(evict_list(s, TKV_TIER_COMPUTE, cand, n_old));
        if (pc->n_free < n - (over - n_old))
            return tkv_err(TKV_ERR_INTERNAL, "kv-store: bulk import freed too few compute slots (%u free, %u needed)",
                           pc->n_free, n - (over - n_old));
        TKV_TRY(import_below(s, base, src, n));
    }
    TKV_TRY(import_up(s, base, src, n));
    s->bulk_blocks += n;
    return TKV_OK;
}

tkv_status tkv_kvs_demote(struct tkv_kvs *s, uint32_t layer, uint32_t head, uint32_t b)
{
    TKV_TRY(check_block(s, layer, head, b));
    prefetch_drain(s);
    TKV_TRY(prefetch_settle(s));
    uint32_t i = blk_index(s, layer, head, b);
    struct blk *k = &s->blk[i];
    if (!(k->valid & BIT(TKV_TIER_COMPUTE)) || blk_pinned(s, k))
        return TKV_OK;
    if (!(k->valid & (BIT(TKV_TIER_HOST) | BIT(TKV_TIER_NVME)))) {
        if (s->pool[TKV_TIER_HOST].present)
            TKV_TRY(spill_to_host(s, &i, 1));
        else if (s->pool[TKV_TIER_NVME].present)
            TKV_TRY(spill_to_nvme(s, TKV_TIER_COMPUTE, &i, 1));
        else
            return block_error(s, TKV_ERR_UNSUPPORTED, i, "cannot be demoted: no lower tier");
    }
    drop_copy(s, i, TKV_TIER_COMPUTE);
    return TKV_OK;
}

/* tkv_kvs_write_back's copies of batch[nb] to the host tier, grown within
 * its capacity first; *full: it had no room for them (nothing copied). */
static tkv_status write_back_batch(struct tkv_kvs *s, const uint32_t *batch, uint32_t nb, uint32_t *n_done, bool *full)
{
    struct pool *hp = &s->pool[TKV_TIER_HOST];
    if (hp->n_free < nb) /* within capacity: grow by what is missing */
        TKV_TRY(pool_grow(s, TKV_TIER_HOST, hp->n + (nb - hp->n_free)));
    *full = hp->n_free < nb; /* then nothing of it is evicted for this */
    if (*full)
        return TKV_OK;
    TKV_TRY(spill_to_host(s, batch, nb));
    if (n_done)
        *n_done += nb;
    return TKV_OK;
}

bool tkv_kvs_compute_holds_all(const struct tkv_kvs *s)
{
    return s->pool[TKV_TIER_COMPUTE].cap >= (uint64_t)s->p.n_layer * s->p.n_head_kv * s->max_blocks;
}

tkv_status tkv_kvs_write_back(struct tkv_kvs *s, uint32_t *n_done)
{
    if (n_done)
        *n_done = 0;
    const struct pool *cp = &s->pool[TKV_TIER_COMPUTE];
    if (!s->pool[TKV_TIER_HOST].present || s->p.compute_is_host || tkv_kvs_compute_holds_all(s) ||
        cp->n < cp->cap || cp->n_free > 0)
        return TKV_OK; /* (a compute tier that holds the context, or has room, evicts nothing soon) */
    prefetch_drain(s);
    TKV_TRY(prefetch_settle(s));
    uint32_t batch[IO_BATCH], nb = 0;
    bool full = false;
    for (uint32_t slot = 0; slot < cp->n && !full; slot++) {
        const int32_t i = cp->owner[slot];
        if (i < 0)
            continue;
        const struct blk *k = &s->blk[i];
        if (!(k->valid & (BIT(TKV_TIER_HOST) | BIT(TKV_TIER_NVME))) && !blk_pinned(s, k) && !k->inflight)
            batch[nb++] = (uint32_t)i;
        if (nb == IO_BATCH) {
            TKV_TRY(write_back_batch(s, batch, nb, n_done, &full));
            nb = 0;
        }
    }
    if (nb && !full)
        TKV_TRY(write_back_batch(s, batch, nb, n_done, &full));
    return TKV_OK;
}

void tkv_kvs_get_stats(const struct tkv_kvs *s, struct tkv_kvs_stats *out)
{
    memset(out, 0, sizeof *out);
    for (int t = 0; t < TKV_TIER_COUNT; t++) {
        out->tier[t] = s->st[t];
        out->tier[t].used_bytes = s->pool[t].used;
        out->tier[t].peak_bytes = s->pool[t].peak;
    }
    out->stall_seconds = s->stall;
    out->nvme_file_bytes = s->file_size;
    out->stall = s->sc;
    out->stall.settle_s = s->part_s[PART_SETTLE];
    out->stall.evict_s = s->part_s[PART_EVICT];
    out->stall.verify_s = s->part_s[PART_VERIFY];
    out->stall.upload_issue_s = s->part_s[PART_ISSUE];
    out->stall.upload_wait_s = s->part_s[PART_WAIT];
    out->stall.nvme_s = s->part_s[PART_NVME];
    out->stall.other_s = s->part_s[PART_OTHER];
    out->prefetched_blocks = s->prefetched;
    out->corrupt_blocks = s->corrupt;
    out->host_read_blocks = s->host_reads;
    out->bulk_blocks = s->bulk_blocks;
    out->marked_layers = s->marked_layers;
    if (s->io) {
        struct tkv_io_info info;
        tkv_io_get_info(s->io, &info);
        out->io_engine = info.engine;
        out->nvme_direct = tkv_io_direct(s->file);
    }
}

struct tkv_io *tkv_kvs_io(struct tkv_kvs *s) { return s->io; }

tkv_status tkv_kvs_test_flip_bit(struct tkv_kvs *s, uint32_t layer, uint32_t head, uint32_t b, int t)
{
    TKV_TRY(check_block(s, layer, head, b));
    uint32_t i = blk_index(s, layer, head, b);
    struct blk *k = &s->blk[i];
    if ((t != TKV_TIER_HOST && t != TKV_TIER_NVME) || !(k->valid & BIT(t)))
        return block_error(s, TKV_ERR_INVALID_ARG, i, "has no copy on that tier to corrupt");
    if (t == TKV_TIER_HOST) {
        if (s->async_up) /* a queued upload may still read it */
            TKV_TRY(s->be->ops->upload_wait(s->be, TKV_UPLOADS_ALL, true, NULL));
        slot_ptr(s, TKV_TIER_HOST, k->slot[TKV_TIER_HOST])[s->S / 3] ^= 0x10;
        k->hchecked = 0; /* corruption at rest: the next read must check the copy */
        return TKV_OK;
    }
    prefetch_drain(s);
    s->ops[0] = (struct io_op){.blk = i, .write = false, .buf = s->staging};
    TKV_TRY(nvme_run(s, s->ops, 1, s->results));
    s->staging[s->S / 3] ^= 0x10;
    s->ops[0].write = true;
    return nvme_run(s, s->ops, 1, s->results);
}
