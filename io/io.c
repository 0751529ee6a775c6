/*
 * io.c -- the engine-independent half of io/: params, op slots and FIFOs,
 * spill files, the continuation and fault rules, -errno -> tkv_status.
 * The engines (io-uring.c, io-sync.c) only issue transfers and report their
 * results through tkv_io_op_advance.
 */
#include "io-impl.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

struct tkv_io_params tkv_io_default_params(void)
{
    return (struct tkv_io_params){.queue_depth = 64, .flags = TKV_IO_DIRECT};
}

/* ---- op slots and FIFOs ------------------------------------------------- */

static uint32_t op_index(const struct tkv_io *io, const struct tkv_io_op *op) { return (uint32_t)(op - io->ops); }

static void fifo_push(uint32_t *fifo, uint32_t qd, uint32_t head, uint32_t *len, uint32_t v)
{
    fifo[(head + *len) % qd] = v;
    (*len)++;
}

static uint32_t fifo_pop(const uint32_t *fifo, uint32_t qd, uint32_t *head, uint32_t *len)
{
    uint32_t v = fifo[*head];
    *head = (*head + 1) % qd;
    (*len)--;
    return v;
}

void tkv_io_op_finish(struct tkv_io *io, struct tkv_io_op *op, int64_t result)
{
    op->result = result;
    op->state = TKV_IO_OP_READY;
    if (op->file) {
        op->file->inflight--;
        if (op->write && result > 0 && op->offset + op->len > op->file->size)
            op->file->size = op->offset + op->len;
        op->file = NULL;
    }
    io->n_inflight--;
    io->n_ops++;
    fifo_push(io->ready, io->qd, io->r_head, &io->r_len, op_index(io, op));
}

int64_t tkv_io_op_next(struct tkv_io *io, struct tkv_io_op *op)
{
    uint64_t n = op->len - op->done;
    if (op->fault_err && op->done >= op->fault_short)
        return -op->fault_err;
    if (n > TKV_IO_MAX_XFER)
        n = TKV_IO_MAX_XFER;
    /* xfer is what a healthy transfer would move: an injected cut then
     * reads exactly like a kernel's short count. */
    op->xfer = (uint32_t)n;
    if (op->fault_short && n > op->fault_short)
        n = op->fault_short;
    return (int64_t)n;
}

bool tkv_io_op_advance(struct tkv_io *io, struct tkv_io_op *op, int64_t res)
{
    if (res < 0) {
        if ((res == -EINTR || res == -EAGAIN) && ++op->retries <= TKV_IO_MAX_RETRIES)
            return false;
        tkv_io_op_finish(io, op, res);
        return true;
    }
    if (res == 0) { /* end of file for a read; a write that cannot progress */
        tkv_io_op_finish(io, op, op->write ? -EIO : -ENODATA);
        return true;
    }
    op->done += (uint64_t)res;
    if (op->done >= op->len) {
        tkv_io_op_finish(io, op, (int64_t)op->len);
        return true;
    }
    if ((uint64_t)res < op->xfer) {
        io->n_continued++;
        /* O_DIRECT transfers stop short only at end of file (or on a broken
         * device); the rest could not be issued aligned anyway. */
        if (op->file->direct && op->done % TKV_IO_ALIGN) {
            tkv_io_op_finish(io, op, op->write ? -EIO : -ENODATA);
            return true;
        }
    }
    return false;
}

/* ---- engine ------------------------------------------------------------- */

static void split_regions(struct tkv_io *io, const struct tkv_io_region *regions, uint32_t n)
{
    io->n_chunks = 0;
    for (uint32_t i = 0; i < n; i++) {
        char *p = regions[i].base;
        size_t left = regions[i].len;
        while (left && io->n_chunks < TKV_IO_MAX_CHUNKS) {
            size_t c = left < TKV_IO_MAX_FIXED ? left : TKV_IO_MAX_FIXED;
            io->chunks[io->n_chunks++] = (struct iovec){.iov_base = p, .iov_len = c};
            p += c, left -= c;
        }
    }
}

int tkv_io_register_buffers(struct tkv_io *io, const struct tkv_io_region *regions, uint32_t n)
{
    if (!io || (n && !regions))
        return -EINVAL;
    for (uint32_t i = 0; i < n; i++)
        if (!regions[i].base || !regions[i].len)
            return -EINVAL;
    if (io->n_inflight || io->q_len || io->r_len)
        return -EBUSY;
    if (io->fixed_buffers)
        io->engine->unregister_buffers(io);
    io->fixed_buffers = false;
    split_regions(io, regions, n);
    if (!io->n_chunks || io->engine == &tkv_io_engine_sync)
        return 0;
    int r = io->engine->register_buffers(io);
    if (r < 0) {
        TKV_LOG_W("io: cannot register %u buffer region(s) with io_uring (%s): using plain reads/writes", n,
                  strerror(-r));
        io->n_chunks = 0;
        return r;
    }
    io->fixed_buffers = true;
    return 0;
}

int tkv_io_init(const struct tkv_io_params *params, struct tkv_io **out)
{
    if (!out)
        return -EINVAL;
    *out = NULL;
    struct tkv_io_params p = params ? *params : tkv_io_default_params();
    if (!p.queue_depth)
        p.queue_depth = 64;
    if (p.queue_depth > 4096 || (p.n_regions && !p.regions))
        return -EINVAL;

    struct tkv_io *io = calloc(1, sizeof *io);
    if (!io)
        return -ENOMEM;
    io->qd = p.queue_depth;
    io->flags = p.flags;
    io->ops = calloc(io->qd, sizeof *io->ops);
    io->free_stack = calloc(io->qd, sizeof *io->free_stack);
    io->queued = calloc(io->qd, sizeof *io->queued);
    io->ready = calloc(io->qd, sizeof *io->ready);
    io->chunks = calloc(TKV_IO_MAX_CHUNKS, sizeof *io->chunks);
    if (!io->ops || !io->free_stack || !io->queued || !io->ready || !io->chunks) {
        tkv_io_free(io);
        return -ENOMEM;
    }
    for (uint32_t i = 0; i < io->qd; i++)
        io->free_stack[i] = io->qd - 1 - i;
    io->n_free = io->qd;

    const char *env = getenv("TKV_IO_FORCE_SYNC");
    bool env_sync = env && *env && strcmp(env, "0") != 0;
    io->engine = &tkv_io_engine_uring;
    if ((io->flags & TKV_IO_FORCE_SYNC) || env_sync) {
        io->engine = &tkv_io_engine_sync;
        if (env_sync && !(io->flags & TKV_IO_FORCE_SYNC))
            TKV_LOG_W("io: TKV_IO_FORCE_SYNC is set: using synchronous pread/pwrite instead of io_uring");
    } else {
        int r = io->engine->init(io);
        if (r < 0) {
            TKV_LOG_W("io: io_uring unavailable (%s): using synchronous pread/pwrite", strerror(-r));
            io->engine = &tkv_io_engine_sync;
        }
    }
    if (io->engine == &tkv_io_engine_sync)
        io->engine->init(io);

    if (p.n_regions) {
        int r = tkv_io_register_buffers(io, p.regions, p.n_regions);
        if (r == -EINVAL) {
            tkv_io_free(io);
            return r;
        }
    }
    *out = io;
    return 0;
}

/* Hands the ready FIFO to the caller. */
static uint32_t deliver(struct tkv_io *io, struct tkv_io_cqe *out, uint32_t max)
{
    uint32_t n = 0;
    while (n < max && io->r_len) {
        uint32_t i = fifo_pop(io->ready, io->qd, &io->r_head, &io->r_len);
        struct tkv_io_op *op = &io->ops[i];
        out[n++] = (struct tkv_io_cqe){.user_tag = op->user_tag, .result = op->result};
        op->state = TKV_IO_OP_FREE;
        io->free_stack[io->n_free++] = i;
    }
    return n;
}

/* Blocks until nothing this engine issued is in flight (completions are
 * kept in the ready FIFO). */
static int drain(struct tkv_io *io, const struct tkv_io_file *only)
{
    while (only ? only->inflight > 0 : io->n_inflight > 0) {
        int r = io->engine->reap(io, true);
        if (r < 0)
            return r;
    }
    return 0;
}

void tkv_io_free(struct tkv_io *io)
{
    if (!io)
        return;
    if (io->engine) {
        if (io->n_files)
            TKV_LOG_E("io: engine freed with %u spill file(s) still open", io->n_files);
        int r = drain(io, NULL);
        if (r < 0)
            TKV_LOG_E("io: waiting for %u op(s) in flight failed (%s)", io->n_inflight, strerror(-r));
        io->engine->exit(io);
    }
    free(io->ops);
    free(io->free_stack);
    free(io->queued);
    free(io->ready);
    free(io->chunks);
    free(io);
}

void tkv_io_get_info(const struct tkv_io *io, struct tkv_io_info *out)
{
    *out = (struct tkv_io_info){
        .engine = io->engine->name,
        .queue_depth = io->qd,
        .fixed_buffers = io->fixed_buffers,
        .fixed_files = io->fixed_files,
        .n_ops = io->n_ops,
        .n_fixed_ops = io->n_fixed_ops,
        .n_continued = io->n_continued,
    };
}

void tkv_io_set_fault(struct tkv_io *io, const struct tkv_io_fault *fault)
{
    io->fault = fault ? *fault : (struct tkv_io_fault){0};
    io->fault_seen = 0;
}

/* ---- spill files -------------------------------------------------------- */

/* mkstemp in a fresh 0700 subdirectory of dir; both unlinked at once. */
static int open_mkstemp(const char *dir)
{
    char sub[4096], path[4096 + 16];
    if (snprintf(sub, sizeof sub, "%s/.tkv-spill-XXXXXX", dir) >= (int)sizeof sub)
        return -ENAMETOOLONG;
    if (!mkdtemp(sub))
        return -errno;
    snprintf(path, sizeof path, "%s/f-XXXXXX", sub);
    int fd = mkostemp(path, O_CLOEXEC), err = errno;
    if (fd >= 0)
        unlink(path);
    rmdir(sub);
    return fd >= 0 ? fd : -err;
}

int tkv_io_file_open_tmp(struct tkv_io *io, const char *dir, struct tkv_io_file **out)
{
    if (!io || !dir || !out)
        return -EINVAL;
    *out = NULL;
    int fd = -1;
    if (!(io->flags & TKV_IO_NO_TMPFILE)) {
        fd = io->fault.open_tmpfile_err ? -io->fault.open_tmpfile_err
                                        : open(dir, O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
        if (fd < 0 && !io->fault.open_tmpfile_err)
            fd = -errno;
        /* EOPNOTSUPP: the file system has no O_TMPFILE; EISDIR: the kernel
         * predates it (it reads as O_DIRECTORY); EINVAL: either. */
        if (fd < 0 && fd != -EOPNOTSUPP && fd != -EISDIR && fd != -EINVAL)
            return fd;
        if (fd < 0)
            TKV_LOG_D("io: %s: no O_TMPFILE (%s), using mkstemp + unlink", dir, strerror(-fd));
    }
    if (fd < 0)
        fd = open_mkstemp(dir);
    if (fd < 0)
        return fd;

    struct tkv_io_file *f = calloc(1, sizeof *f);
    if (!f) {
        close(fd);
        return -ENOMEM;
    }
    *f = (struct tkv_io_file){.io = io, .fd = fd, .slot = -1};
    if (io->flags & TKV_IO_DIRECT) {
        /* Same as opening with O_DIRECT: the kernel checks support here too
         * (tmpfs before Linux 6.6, some FUSE / network file systems refuse). */
        int r = io->fault.open_direct_err ? -io->fault.open_direct_err : 0;
        if (!r) {
            int fl = fcntl(fd, F_GETFL);
            if (fl < 0 || fcntl(fd, F_SETFL, fl | O_DIRECT) < 0)
                r = -errno;
        }
        f->direct = r == 0;
        if (r < 0 && !io->warned_direct) {
            io->warned_direct = true;
            TKV_LOG_W("io: %s does not support O_DIRECT (%s): spill files there go through the page cache", dir,
                      strerror(-r));
        }
    }
    int r = io->engine->file_add(io, f);
    if (r < 0) {
        close(fd);
        free(f);
        return r;
    }
    io->n_files++;
    *out = f;
    return 0;
}

void tkv_io_file_close(struct tkv_io_file *f)
{
    if (!f)
        return;
    struct tkv_io *io = f->io;
    /* Queued ops were never issued: they complete as cancelled. */
    uint32_t n = io->q_len, head = io->q_head;
    io->q_head = io->q_len = 0;
    for (uint32_t k = 0; k < n; k++) {
        uint32_t i = io->queued[(head + k) % io->qd];
        struct tkv_io_op *op = &io->ops[i];
        if (op->file == f) {
            io->n_inflight++, f->inflight++; /* finish() accounts as if issued */
            tkv_io_op_finish(io, op, -ECANCELED);
        } else {
            io->queued[(io->q_head + io->q_len) % io->qd] = i;
            io->q_len++;
        }
    }
    if (f->inflight) {
        TKV_LOG_E("io: spill file closed with %u op(s) in flight: waiting for them", f->inflight);
        int r = drain(io, f);
        if (r < 0)
            TKV_LOG_E("io: waiting for ops in flight failed (%s)", strerror(-r));
    }
    io->engine->file_remove(io, f);
    close(f->fd);
    io->n_files--;
    free(f);
}

int tkv_io_file_resize(struct tkv_io_file *f, uint64_t size)
{
    if (!f || size > (uint64_t)INT64_MAX)
        return -EINVAL;
    if (f->io->fault.resize_err)
        return -f->io->fault.resize_err;
    if (f->io->fault.resize_max && size > f->io->fault.resize_max)
        return -ENOSPC;
    if (size > f->size) {
        if (fallocate(f->fd, 0, (off_t)f->size, (off_t)(size - f->size)) < 0) {
            int err = errno;
            if (err != EOPNOTSUPP) {
                (void)!ftruncate(f->fd, (off_t)f->size); /* undo a partial extension */
                return -err;
            }
            if (ftruncate(f->fd, (off_t)size) < 0)
                return -errno;
        }
    } else if (ftruncate(f->fd, (off_t)size) < 0) {
        return -errno;
    }
    f->size = size;
    return 0;
}

uint64_t tkv_io_file_size(const struct tkv_io_file *f) { return f->size; }

bool tkv_io_direct(const struct tkv_io_file *f) { return f && f->direct; }

/* ---- batched I/O --------------------------------------------------------- */

static int queue_op(struct tkv_io *io, struct tkv_io_file *f, const void *buf, size_t len, uint64_t offset,
                    uint64_t tag, bool write)
{
    uint64_t end;
    if (!io || !f || !buf || f->io != io || !len || !tkv_add_ok(offset, len, &end) || end > (uint64_t)INT64_MAX)
        return -EINVAL;
    if (f->direct && (((uintptr_t)buf | len | offset) & (TKV_IO_ALIGN - 1)))
        return -EINVAL;
    if (!io->n_free)
        return -EAGAIN;

    uint32_t i = io->free_stack[--io->n_free];
    struct tkv_io_op *op = &io->ops[i];
    *op = (struct tkv_io_op){
        .file = f, .buf = (char *)buf, .len = len, .offset = offset, .user_tag = tag,
        .state = TKV_IO_OP_QUEUED, .write = write, .buf_index = -1,
    };
    for (uint32_t c = 0; io->fixed_buffers && c < io->n_chunks; c++) {
        const char *b = io->chunks[c].iov_base;
        if ((const char *)buf >= b && (uintptr_t)((const char *)buf - b) + len <= io->chunks[c].iov_len) {
            op->buf_index = (int)c;
            break;
        }
    }
    uint64_t k = io->fault_seen++;
    if (io->fault.ops_count && k >= io->fault.ops_skip && k - io->fault.ops_skip < io->fault.ops_count) {
        op->fault_short = io->fault.short_bytes;
        op->fault_err = io->fault.op_err;
    }
    fifo_push(io->queued, io->qd, io->q_head, &io->q_len, i);
    return 0;
}

int tkv_io_read(struct tkv_io *io, struct tkv_io_file *f, void *buf, size_t len, uint64_t offset, uint64_t tag)
{
    return queue_op(io, f, buf, len, offset, tag, false);
}

int tkv_io_write(struct tkv_io *io, struct tkv_io_file *f, const void *buf, size_t len, uint64_t offset,
                 uint64_t tag)
{
    return queue_op(io, f, buf, len, offset, tag, true);
}

int tkv_io_submit(struct tkv_io *io)
{
    if (!io)
        return -EINVAL;
    int n = 0;
    while (io->q_len) {
        struct tkv_io_op *op = &io->ops[fifo_pop(io->queued, io->qd, &io->q_head, &io->q_len)];
        op->state = TKV_IO_OP_INFLIGHT;
        op->file->inflight++;
        io->n_inflight++;
        if (op->buf_index >= 0)
            io->n_fixed_ops++;
        io->engine->submit(io, op);
        n++;
    }
    int r = io->engine->flush(io);
    return r < 0 ? r : n;
}

int tkv_io_poll(struct tkv_io *io, struct tkv_io_cqe *out, uint32_t max)
{
    if (!io || (max && !out))
        return -EINVAL;
    if (io->r_len < max && io->n_inflight) {
        int r = io->engine->reap(io, false);
        if (r < 0)
            return r;
    }
    return (int)deliver(io, out, max);
}

int tkv_io_wait(struct tkv_io *io, uint32_t min_complete, struct tkv_io_cqe *out, uint32_t max)
{
    if (!io || (max && !out))
        return -EINVAL;
    if (min_complete > max)
        min_complete = max;
    int r = io->n_inflight ? io->engine->reap(io, false) : 0;
    while (r >= 0 && io->r_len < min_complete && io->n_inflight)
        r = io->engine->reap(io, true);
    if (r < 0)
        return r;
    return (int)deliver(io, out, max);
}

/* ---- helpers ------------------------------------------------------------- */

tkv_status tkv_io_status(int neg_errno, const char *what)
{
    if (neg_errno >= 0)
        return TKV_OK;
    int e = -neg_errno;
    const char *why;
    char buf[128];
    switch (e) {
    case ENOSPC: why = "no space left on device"; break;
    case ENODATA: why = "read past end of file"; break;
    case EAGAIN: why = "queue full (submit and reap completions first)"; break;
    case ECANCELED: why = "cancelled (the file was closed before the op was submitted)"; break;
    case EINVAL: why = "invalid argument (O_DIRECT files need 4 KiB-aligned buffer, length and offset)"; break;
    default: why = strerror_r(e, buf, sizeof buf); break;
    }
    tkv_status s = e == ENOMEM ? TKV_ERR_NOMEM : e == EINVAL ? TKV_ERR_INVALID_ARG : TKV_ERR_IO;
    return tkv_err(s, "io: %s: %s", what ? what : "I/O", why);
}

void *tkv_io_alloc_aligned(size_t size)
{
    const size_t huge = (size_t)2 << 20;
    size_t align = size >= huge ? huge : TKV_IO_ALIGN;
    if (!size || size > SIZE_MAX - align)
        return NULL;
    void *p = NULL;
    if (posix_memalign(&p, align, tkv_align_up(size, TKV_IO_ALIGN)) != 0)
        return NULL;
    return p;
}

void tkv_io_free_aligned(void *p) { free(p); }
