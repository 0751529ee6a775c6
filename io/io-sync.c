/*
 * io-sync.c -- the synchronous engine: pread/pwrite at submit time, for
 * kernels or sandboxes where io_uring is refused (and for comparison). Ops
 * finish inside tkv_io_submit; poll/wait only hand out their completions.
 */
#include "io-impl.h"

#include <errno.h>
#include <unistd.h>

static int sync_init(struct tkv_io *io) { return 0; }
static void sync_exit(struct tkv_io *io) {}

static int sync_submit(struct tkv_io *io, struct tkv_io_op *op)
{
    for (;;) {
        int64_t n = tkv_io_op_next(io, op);
        if (n < 0) {
            tkv_io_op_finish(io, op, n);
            return 0;
        }
        int fd = op->file->fd;
        off_t off = (off_t)(op->offset + op->done);
        ssize_t r = op->write ? pwrite(fd, op->buf + op->done, (size_t)n, off)
                              : pread(fd, op->buf + op->done, (size_t)n, off);
        if (tkv_io_op_advance(io, op, r < 0 ? -errno : r))
            return 0;
    }
}

static int sync_flush(struct tkv_io *io) { return 0; }
static int sync_reap(struct tkv_io *io, bool wait) { return 0; } /* nothing is ever left in flight */
static int sync_file_add(struct tkv_io *io, struct tkv_io_file *f) { return 0; }
static void sync_file_remove(struct tkv_io *io, struct tkv_io_file *f) {}
static int sync_register_buffers(struct tkv_io *io) { return 0; }
static void sync_unregister_buffers(struct tkv_io *io) {}

const struct tkv_io_engine tkv_io_engine_sync = {
    .name = "sync",
    .init = sync_init,
    .exit = sync_exit,
    .submit = sync_submit,
    .flush = sync_flush,
    .reap = sync_reap,
    .file_add = sync_file_add,
    .file_remove = sync_file_remove,
    .register_buffers = sync_register_buffers,
    .unregister_buffers = sync_unregister_buffers,
};
