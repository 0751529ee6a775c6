/*
 * io-impl.h -- private to io/: the engine struct, op slots, and the two
 * engines' entry points (io-uring.c, io-sync.c). io.c owns the queues and
 * the rules every engine shares (alignment, continuation, faults).
 *
 * Op lifecycle: FREE -> QUEUED (tkv_io_read/write) -> INFLIGHT (submit) ->
 * READY (finished, in the ready FIFO) -> FREE (delivered by poll/wait). A slot
 * is only freed once its completion is delivered, so queued + in flight +
 * ready <= queue_depth and the FIFOs never overflow; io_uring's SQ has
 * queue_depth entries and its CQ twice that, so neither does the kernel's.
 */
#ifndef TKV_IO_IMPL_H
#define TKV_IO_IMPL_H

#include "io.h"

#include "../runtime/tkv-impl.h"

#include <liburing.h>

enum { TKV_IO_OP_FREE, TKV_IO_OP_QUEUED, TKV_IO_OP_INFLIGHT, TKV_IO_OP_READY };

/* Transfer cap per syscall / SQE (the kernel's MAX_RW_COUNT, 4 KiB aligned). */
#define TKV_IO_MAX_XFER 0x7ffff000u
/* io_uring refuses fixed buffers over 1 GiB: regions are split in chunks. */
#define TKV_IO_MAX_FIXED ((size_t)1 << 30)
#define TKV_IO_MAX_CHUNKS 1024
/* Retries of -EINTR / -EAGAIN results before the op fails with them. */
#define TKV_IO_MAX_RETRIES 16
/* Slots in io_uring's registered file table. */
#define TKV_IO_FILE_SLOTS 64

struct tkv_io_op {
    struct tkv_io_file *file;
    char    *buf;
    uint64_t len, done, offset;
    uint64_t user_tag;
    int64_t  result;
    int      state;
    bool     write;
    int      buf_index;   /* fixed buffer chunk, or -1                    */
    uint32_t retries;
    uint32_t xfer;        /* bytes asked for in the transfer in flight    */
    uint32_t fault_short; /* from struct tkv_io_fault, 0 = none           */
    int      fault_err;
};

struct tkv_io_file {
    struct tkv_io *io;
    int      fd;
    int      slot;        /* registered file index, or -1 */
    bool     direct;
    uint32_t inflight;    /* ops issued and not yet finished */
    uint64_t size;
};

struct tkv_io_engine {
    const char *name;
    int  (*init)(struct tkv_io *io);               /* -ENOSYS/-EPERM: caller falls back */
    void (*exit)(struct tkv_io *io);
    int  (*submit)(struct tkv_io *io, struct tkv_io_op *op); /* issue one op           */
    int  (*flush)(struct tkv_io *io);                        /* after a batch of submit */
    /* Processes finished transfers into the ready FIFO; blocks until at least
     * one is processed when wait is set and something is in flight. */
    int  (*reap)(struct tkv_io *io, bool wait);
    int  (*file_add)(struct tkv_io *io, struct tkv_io_file *f);
    void (*file_remove)(struct tkv_io *io, struct tkv_io_file *f);
    int  (*register_buffers)(struct tkv_io *io);
    void (*unregister_buffers)(struct tkv_io *io);
};

struct tkv_io {
    const struct tkv_io_engine *engine;
    uint32_t qd, flags;

    struct tkv_io_op *ops;   /* [qd] */
    uint32_t *free_stack;    /* [qd] indices of FREE slots */
    uint32_t  n_free;
    uint32_t *queued;        /* [qd] FIFO of QUEUED slots  */
    uint32_t  q_head, q_len;
    uint32_t *ready;         /* [qd] FIFO of READY slots   */
    uint32_t  r_head, r_len;
    uint32_t  n_inflight;

    struct iovec *chunks;    /* registered regions, split in <= 1 GiB chunks */
    uint32_t      n_chunks;
    bool          fixed_buffers;

    bool warned_direct;
    uint32_t n_files;        /* open spill files */
    struct tkv_io_fault fault;
    uint64_t fault_seen;     /* ops counted since tkv_io_set_fault */

    uint64_t n_ops, n_fixed_ops, n_continued;

    /* io_uring engine */
    struct io_uring ring;
    bool ring_ok, fixed_files;
    uint64_t slot_map;        /* registered file slots in use (TKV_IO_FILE_SLOTS <= 64) */
};

extern const struct tkv_io_engine tkv_io_engine_uring;
extern const struct tkv_io_engine tkv_io_engine_sync;

/* Shared op rules (io.c), used by both engines. */

/* Bytes the op's next transfer asks for (> 0), or -errno when an injected
 * fault fails the op at this point. */
int64_t tkv_io_op_next(struct tkv_io *io, struct tkv_io_op *op);

/* Accounts a transfer's result (bytes or -errno). Returns true when the op
 * is finished (op->result set, op moved to the ready FIFO), false when it
 * must be issued again for the rest. */
bool tkv_io_op_advance(struct tkv_io *io, struct tkv_io_op *op, int64_t res);

/* Fails / finishes an op without a transfer. */
void tkv_io_op_finish(struct tkv_io *io, struct tkv_io_op *op, int64_t result);

#endif /* TKV_IO_IMPL_H */
