/*
 * io.h -- batched asynchronous file I/O for spill files (io_uring, with a
 * synchronous pread/pwrite fallback). Knows files and buffers, nothing
 * about KV.
 *
 *   struct tkv_io_params p = tkv_io_default_params();      // QD 64, O_DIRECT
 *   struct tkv_io *io;       tkv_io_init(&p, &io);
 *   struct tkv_io_file *f;   tkv_io_file_open_tmp(io, "/var/tmp", &f);
 *   tkv_io_file_resize(f, 64 << 20);                        // reserve blocks
 *   tkv_io_write(io, f, buf, 1 << 20, 0, tag);              // queue
 *   tkv_io_submit(io);                                      // issue the batch
 *   struct tkv_io_cqe c[8];
 *   int n = tkv_io_wait(io, 1, c, 8);                       // c[i].user_tag, c[i].result
 *   tkv_io_file_close(f);  tkv_io_free(io);
 *
 * Conventions (liburing's): every int-returning function returns >= 0 on
 * success and -errno on failure, and never sets errno. tkv_io_status()
 * converts a -errno to a tkv_status with a message at the module boundary.
 *
 * An engine and its files are used by one thread at a time (no locks).
 * docs/io.md describes the fallbacks (io_uring refused, O_DIRECT refused,
 * O_TMPFILE unsupported) and the fault-injection hook.
 */
#ifndef TKV_IO_H
#define TKV_IO_H

#include "../runtime/tierkv.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Alignment of buffer address, length and file offset for O_DIRECT files. */
#define TKV_IO_ALIGN 4096u

enum tkv_io_flags {
    TKV_IO_DIRECT     = 1u << 0, /* open spill files O_DIRECT (falls back, see tkv_io_direct) */
    TKV_IO_FORCE_SYNC = 1u << 1, /* use the pread/pwrite engine even if io_uring works        */
    TKV_IO_NO_TMPFILE = 1u << 2, /* skip O_TMPFILE: always mkstemp + unlink                   */
};

/* A memory region to register with the kernel (io_uring fixed buffers). The
 * memory stays owned by the caller and must outlive the engine (or the next
 * tkv_io_register_buffers call). */
struct tkv_io_region {
    void  *base;
    size_t len;
};

struct tkv_io_params {
    uint32_t queue_depth;                /* max ops queued + in flight + unreaped; 0 = 64 */
    uint32_t flags;                      /* enum tkv_io_flags                              */
    const struct tkv_io_region *regions; /* optional: registered at init                   */
    uint32_t n_regions;
};

/* A finished operation. result is the op's full length on success (never a
 * short count) or -errno:
 *   -ENODATA  a read reached end of file before len bytes (buffer contents
 *             are then unspecified)
 *   -ENOSPC   a write found the device full (part of it may have landed)
 *   -EIO etc. as the kernel reported them. */
struct tkv_io_cqe {
    uint64_t user_tag;
    int64_t  result;
};

struct tkv_io_info {
    const char *engine;         /* "io_uring" or "sync" (static string)         */
    uint32_t    queue_depth;
    bool        fixed_buffers;  /* regions are registered with the kernel       */
    bool        fixed_files;    /* spill files use io_uring's registered files  */
    uint64_t    n_ops;          /* ops completed (delivered or not)             */
    uint64_t    n_fixed_ops;    /* of which went through read_fixed/write_fixed */
    uint64_t    n_continued;    /* short transfers the engine continued         */
};

struct tkv_io;
struct tkv_io_file;

/* QD 64, TKV_IO_DIRECT, no regions. */
struct tkv_io_params tkv_io_default_params(void);

/* Creates an engine: io_uring when the kernel allows it, else (ENOSYS,
 * EPERM, e.g. seccomp; or TKV_IO_FORCE_SYNC; or env TKV_IO_FORCE_SYNC=1) the
 * synchronous engine, with one warning unless the flag asked for it. A region
 * that cannot be registered is a warning, not an error (ops then use plain
 * reads/writes). Returns 0, -EINVAL (bad params) or -ENOMEM. */
int  tkv_io_init(const struct tkv_io_params *params, struct tkv_io **out);

/* Waits for every op still in flight (the kernel must not write into freed
 * buffers), then frees the engine. Files must be closed first. NULL is a
 * no-op. */
void tkv_io_free(struct tkv_io *io);

/* Replaces the registered regions (n = 0 unregisters). Only with nothing in
 * flight or queued: -EBUSY otherwise. Returns 0 or -errno; the sync engine
 * records the regions and returns 0. */
int  tkv_io_register_buffers(struct tkv_io *io, const struct tkv_io_region *regions, uint32_t n);

void tkv_io_get_info(const struct tkv_io *io, struct tkv_io_info *out);

/* ---- spill files -------------------------------------------------------- */

/* Creates a private, nameless file in dir: O_TMPFILE (0600) where the file
 * system supports it, else mkstemp in a fresh 0700 subdirectory, unlinked
 * at once (subdirectory removed too). Nothing is left in dir after the
 * process exits, however it exits. With TKV_IO_DIRECT the file is O_DIRECT
 * when the file system allows; if not (EINVAL) it is buffered and the engine
 * logs one warning (see tkv_io_direct). Returns 0 or -errno (-ENOENT,
 * -EACCES, -ENOSPC, -EMFILE, ...). */
int  tkv_io_file_open_tmp(struct tkv_io *io, const char *dir, struct tkv_io_file **out);

/* Closes the file. Ops still in flight on it are waited for first; their
 * completions stay queued for poll/wait (closing with ops in flight is
 * allowed but a sign of a bug: it logs an error). NULL is a no-op. */
void tkv_io_file_close(struct tkv_io_file *file);

/* Sets the size. Growing reserves blocks (fallocate, so -ENOSPC is reported
 * now, not at write time; ftruncate where fallocate is unsupported). On
 * failure the size is left as it was. Returns 0 or -errno. */
int  tkv_io_file_resize(struct tkv_io_file *file, uint64_t size);

uint64_t tkv_io_file_size(const struct tkv_io_file *file); /* bytes, as last resized or written */

/* True when the file is O_DIRECT (4 KiB alignment required on every op). */
bool tkv_io_direct(const struct tkv_io_file *file);

/* ---- batched I/O --------------------------------------------------------- */

/* Queue a read / write of len bytes at offset; nothing is issued until
 * tkv_io_submit. buf must stay valid (and untouched, for reads) until the
 * op's completion is reaped. Returns 0, or:
 *   -EINVAL  len == 0, or the file is O_DIRECT and buf, len or offset is not
 *            a multiple of TKV_IO_ALIGN
 *   -EAGAIN  queue_depth ops are already queued, in flight or unreaped:
 *            submit and reap first. */
int tkv_io_read(struct tkv_io *io, struct tkv_io_file *file, void *buf, size_t len, uint64_t offset,
                uint64_t user_tag);
int tkv_io_write(struct tkv_io *io, struct tkv_io_file *file, const void *buf, size_t len, uint64_t offset,
                 uint64_t user_tag);

/* Issues every queued op. io_uring: returns at once; sync engine: executes
 * them all before returning. Returns the number of ops issued, or -errno
 * (queued ops then stay queued and a later call retries). */
int tkv_io_submit(struct tkv_io *io);

/* Copies up to max finished ops into out without blocking. Short transfers
 * are continued internally, so each op completes exactly once with its full
 * length or -errno. Returns the count (>= 0) or -errno. */
int tkv_io_poll(struct tkv_io *io, struct tkv_io_cqe *out, uint32_t max);

/* Like tkv_io_poll, but first blocks until min_complete (clamped to max) ops
 * have finished, or until nothing is left in flight (so it never waits for
 * ops that were queued but not submitted). */
int tkv_io_wait(struct tkv_io *io, uint32_t min_complete, struct tkv_io_cqe *out, uint32_t max);

/* ---- helpers ------------------------------------------------------------- */

/* Converts a -errno from this module to a tkv_status with a message
 * "io: <what>: <reason>" for tkv_last_error(). 0 and positive values are
 * TKV_OK. -ENOMEM -> TKV_ERR_NOMEM, -EINVAL -> TKV_ERR_INVALID_ARG, all else
 * (-ENOSPC: "no space left on device", -ENODATA: "read past end of file")
 * -> TKV_ERR_IO. */
tkv_status tkv_io_status(int neg_errno, const char *what);

/* size bytes (rounded up to TKV_IO_ALIGN) aligned for O_DIRECT (2 MiB for
 * sizes of 2 MiB and up, so transparent huge pages can back them); NULL on
 * failure. Free with tkv_io_free_aligned (NULL is a no-op). */
void *tkv_io_alloc_aligned(size_t size);
void  tkv_io_free_aligned(void *p);

/* ---- fault injection (tests only) ------------------------------------------ */

/* Faults the engine applies from now on. Ops are counted from the call:
 * ops_skip ops pass, then ops_count ops are faulted: each transfer of a
 * faulted op is cut to short_bytes (if non-zero; a multiple of TKV_IO_ALIGN
 * for O_DIRECT files), and with op_err != 0 the op fails with -op_err once
 * short_bytes have been transferred (before any transfer if short_bytes is
 * 0): short + ENOSPC models a disk filling up mid-write. The open_* and
 * resize_err errnos make the next file opens / resizes fail at that step;
 * resize_max > 0 makes every resize past that many bytes fail with ENOSPC
 * (a disk with that much room for the file). */
struct tkv_io_fault {
    uint32_t ops_skip, ops_count;
    int      op_err;           /* positive errno, or 0          */
    uint32_t short_bytes;
    int      open_tmpfile_err; /* O_TMPFILE open fails (EOPNOTSUPP: take the mkstemp path) */
    int      open_direct_err;  /* O_DIRECT refused (EINVAL: like a file system without it)   */
    int      resize_err;       /* fallocate/ftruncate fail (ENOSPC)                          */
    uint64_t resize_max;       /* resizes past this size fail with ENOSPC; 0: no limit       */
};

/* NULL clears every fault. */
void tkv_io_set_fault(struct tkv_io *io, const struct tkv_io_fault *fault);

#endif /* TKV_IO_H */
