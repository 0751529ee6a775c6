/*
 * io-uring.c -- the io_uring engine: one SQE per transfer, user_data = the
 * op slot; registered files (a sparse table) and fixed buffers where set up.
 * Short transfers are re-issued from reap for the remaining bytes.
 */
#include "io-impl.h"

#include <errno.h>
#include <string.h>

static int uring_init(struct tkv_io *io)
{
    struct io_uring_params p;
    memset(&p, 0, sizeof p);
    /* SUBMIT_ALL (5.18): a bad SQE does not stop the rest of the batch. */
    p.flags = IORING_SETUP_SUBMIT_ALL;
    int r = io_uring_queue_init_params(io->qd, &io->ring, &p);
    if (r == -EINVAL) {
        memset(&p, 0, sizeof p);
        r = io_uring_queue_init_params(io->qd, &io->ring, &p);
    }
    if (r < 0)
        return r;
    io->ring_ok = true;
    /* Registered files save an fget/fput per op; 5.19+, optional. */
    io->fixed_files = io_uring_register_files_sparse(&io->ring, TKV_IO_FILE_SLOTS) == 0;
    return 0;
}

static void uring_exit(struct tkv_io *io)
{
    if (io->ring_ok)
        io_uring_queue_exit(&io->ring);
    io->ring_ok = false;
}

static int uring_submit(struct tkv_io *io, struct tkv_io_op *op)
{
    int64_t n = tkv_io_op_next(io, op);
    if (n < 0) {
        tkv_io_op_finish(io, op, n);
        return 0;
    }
    struct io_uring_sqe *sqe = io_uring_get_sqe(&io->ring);
    if (!sqe) { /* cannot happen: SQ entries >= op slots; be safe anyway */
        io_uring_submit(&io->ring);
        sqe = io_uring_get_sqe(&io->ring);
        if (!sqe) {
            tkv_io_op_finish(io, op, -EBUSY);
            return 0;
        }
    }
    struct tkv_io_file *f = op->file;
    int fd = f->slot >= 0 ? f->slot : f->fd;
    char *buf = op->buf + op->done;
    uint64_t off = op->offset + op->done;
    unsigned len = (unsigned)n;
    if (op->buf_index >= 0) {
        if (op->write)
            io_uring_prep_write_fixed(sqe, fd, buf, len, off, op->buf_index);
        else
            io_uring_prep_read_fixed(sqe, fd, buf, len, off, op->buf_index);
    } else if (op->write) {
        io_uring_prep_write(sqe, fd, buf, len, off);
    } else {
        io_uring_prep_read(sqe, fd, buf, len, off);
    }
    if (f->slot >= 0)
        sqe->flags |= IOSQE_FIXED_FILE;
    io_uring_sqe_set_data(sqe, op);
    return 0;
}

static int uring_flush(struct tkv_io *io)
{
    for (int tries = 0; io_uring_sq_ready(&io->ring) > 0; tries++) {
        int r = io_uring_submit(&io->ring);
        if (r == -EINTR || (r == 0 && tries < 16))
            continue;
        if (r < 0)
            return r;
        if (r == 0)
            return -EBUSY;
    }
    return 0;
}

static int uring_reap(struct tkv_io *io, bool wait)
{
    int r = uring_flush(io);
    if (r < 0 && r != -EAGAIN && r != -EBUSY)
        return r;
    for (;;) {
        struct io_uring_cqe *cqe;
        unsigned head, count = 0;
        bool resubmit = false;
        io_uring_for_each_cqe(&io->ring, head, cqe) {
            struct tkv_io_op *op = io_uring_cqe_get_data(cqe);
            count++;
            if (!tkv_io_op_advance(io, op, cqe->res)) {
                uring_submit(io, op); /* the rest of a short transfer, or a retry */
                resubmit = true;
            }
        }
        io_uring_cq_advance(&io->ring, count);
        if (resubmit && (r = uring_flush(io)) < 0)
            return r;
        if (count || !wait || !io->n_inflight)
            return 0;
        /* SQEs a failed flush left behind must go in with the wait, or no
         * completion could ever arrive for them. */
        r = io_uring_sq_ready(&io->ring) ? io_uring_submit_and_wait(&io->ring, 1) : io_uring_wait_cqe(&io->ring, &cqe);
        if (r < 0 && r != -EINTR && r != -EAGAIN)
            return r;
    }
}

static int uring_file_add(struct tkv_io *io, struct tkv_io_file *f)
{
    if (!io->fixed_files || io->slot_map == ~(uint64_t)0)
        return 0;
    int slot = __builtin_ctzll(~io->slot_map);
    if (io_uring_register_files_update(&io->ring, (unsigned)slot, &f->fd, 1) == 1) {
        io->slot_map |= (uint64_t)1 << slot;
        f->slot = slot;
    }
    return 0;
}

static void uring_file_remove(struct tkv_io *io, struct tkv_io_file *f)
{
    if (f->slot < 0)
        return;
    int none = -1;
    io_uring_register_files_update(&io->ring, (unsigned)f->slot, &none, 1);
    io->slot_map &= ~((uint64_t)1 << f->slot);
    f->slot = -1;
}

static int uring_register_buffers(struct tkv_io *io)
{
    return io_uring_register_buffers(&io->ring, io->chunks, io->n_chunks);
}

static void uring_unregister_buffers(struct tkv_io *io) { io_uring_unregister_buffers(&io->ring); }

const struct tkv_io_engine tkv_io_engine_uring = {
    .name = "io_uring",
    .init = uring_init,
    .exit = uring_exit,
    .submit = uring_submit,
    .flush = uring_flush,
    .reap = uring_reap,
    .file_add = uring_file_add,
    .file_remove = uring_file_remove,
    .register_buffers = uring_register_buffers,
    .unregister_buffers = uring_unregister_buffers,
};
