/*
 * test-io.c -- io/: batched round trips through both engines, on a real
 * disk (O_DIRECT) and on tmpfs; spill files leave nothing behind (close,
 * SIGKILL); alignment and end-of-file rules; injected faults (EIO, short
 * transfers, ENOSPC) and a real ENOSPC on a tiny tmpfs.
 *
 * Sub-cases that cannot run here (io_uring refused, no /dev/shm, no mount
 * namespace) print "SKIP: ..." and the rest still runs.
 * Env: TKV_TEST_DISK_DIR (default /var/tmp, else $TKV_BUILD_DIR).
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* unshare, CLONE_NEW* */
#endif
#include "io/io.h"
#include "test.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <string.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <sys/wait.h>
#include <unistd.h>

#ifndef TMPFS_MAGIC
#define TMPFS_MAGIC 0x01021994
#endif

#define MiB (1u << 20)
#define KiB 1024u

/* ---- helpers ---------------------------------------------------------- */

static int n_warn_direct, n_warn_sync, n_warn_other, n_errors;

static void capture_log(enum tkv_log_level level, const char *msg, void *user)
{
    fprintf(stderr, "  [log %s] %s\n", level == TKV_LOG_ERROR ? "error" : "warning", msg);
    if (level == TKV_LOG_ERROR)
        n_errors++;
    else if (strstr(msg, "O_DIRECT"))
        n_warn_direct++;
    else if (strstr(msg, "pread/pwrite"))
        n_warn_sync++;
    else
        n_warn_other++;
}

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static uint64_t rnd(void)
{
    rng_state ^= rng_state << 13, rng_state ^= rng_state >> 7, rng_state ^= rng_state << 17;
    return rng_state;
}

static void fill(void *p, size_t n, uint64_t seed)
{
    uint64_t s = seed * 0x2545f4914f6cdd1dull + 1;
    unsigned char *b = p;
    for (size_t i = 0; i < n; i++) {
        s ^= s << 13, s ^= s >> 7, s ^= s << 17;
        b[i] = (unsigned char)s;
    }
}

static int dir_entries(const char *dir)
{
    DIR *d = opendir(dir);
    if (!d)
        return -1;
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)))
        if (strcmp(e->d_name, ".") && strcmp(e->d_name, ".."))
            n++, fprintf(stderr, "  left in %s: %s\n", dir, e->d_name);
    closedir(d);
    return n;
}

static bool is_tmpfs(const char *dir)
{
    struct statfs s;
    return statfs(dir, &s) == 0 && s.f_type == TMPFS_MAGIC;
}

/* A fresh directory under base (removed by the caller with rmdir). */
static char *make_dir(const char *base, char *buf, size_t cap)
{
    snprintf(buf, cap, "%s/tkv-test-io-XXXXXX", base);
    return mkdtemp(buf);
}

/* Waits for n completions; returns how many arrived. */
static int wait_n(struct tkv_io *io, int n, struct tkv_io_cqe *c)
{
    int got = 0;
    while (got < n) {
        int r = tkv_io_wait(io, 1, c + got, (uint32_t)(n - got));
        if (r <= 0) {
            CHECK(r > 0, "tkv_io_wait returned %d after %d of %d", r, got, n);
            break;
        }
        got += r;
    }
    return got;
}

static bool uring_available(void)
{
    struct tkv_io_params p = tkv_io_default_params();
    struct tkv_io *io;
    if (tkv_io_init(&p, &io) != 0)
        return false;
    struct tkv_io_info info;
    tkv_io_get_info(io, &info);
    tkv_io_free(io);
    return strcmp(info.engine, "io_uring") == 0;
}

static bool have_uring;
static int n_skipped;

static void skip_case(const char *name, const char *why)
{
    fprintf(stderr, "SKIP: %s: %s\n", name, why);
    n_skipped++;
}

static struct tkv_io *make_io(bool sync, uint32_t qd, uint32_t extra_flags, const struct tkv_io_region *reg,
                              uint32_t n_reg)
{
    struct tkv_io_params p = tkv_io_default_params();
    p.queue_depth = qd;
    p.flags |= extra_flags | (sync ? TKV_IO_FORCE_SYNC : 0);
    p.regions = reg;
    p.n_regions = n_reg;
    struct tkv_io *io = NULL;
    int r = tkv_io_init(&p, &io);
    CHECK(r == 0, "tkv_io_init: %d", r);
    return io;
}

/* ---- round trip: 64 random aligned ops, write then read back ------------ */

#define NOPS 64
#define SLOT (1u * MiB)

static void test_roundtrip(bool sync, const char *dir, bool regions, bool expect_direct)
{
    fprintf(stderr, "roundtrip: engine=%s dir=%s regions=%d\n", sync ? "sync" : "io_uring", dir, regions);
    size_t total = (size_t)NOPS * SLOT;
    char *wbuf = tkv_io_alloc_aligned(total), *rbuf = tkv_io_alloc_aligned(total);
    REQUIRE_VOID(wbuf && rbuf);
    struct tkv_io_region reg = {wbuf, total}; /* only writes are fixed: reads prove the plain path */
    struct tkv_io *io = make_io(sync, 64, 0, &reg, regions ? 1 : 0);
    REQUIRE_VOID(io);
    struct tkv_io_info info;
    tkv_io_get_info(io, &info);
    CHECK(strcmp(info.engine, sync ? "sync" : "io_uring") == 0, "engine %s", info.engine);

    struct tkv_io_file *f;
    int r = tkv_io_file_open_tmp(io, dir, &f);
    REQUIRE_VOID(r == 0);
    CHECK(dir_entries(dir) == 0, "spill file visible in %s while open", dir);
    CHECK(!expect_direct || tkv_io_direct(f), "%s: expected an O_DIRECT file", dir);
    CHECK(tkv_io_file_resize(f, total) == 0, "resize");
    CHECK(tkv_io_file_size(f) == total, "size");

    /* op i: len in [4 KiB, 1 MiB], at a random aligned offset inside slot perm[i] */
    uint32_t perm[NOPS], len[NOPS], off[NOPS];
    for (int i = 0; i < NOPS; i++)
        perm[i] = (uint32_t)i;
    for (int i = NOPS - 1; i > 0; i--) {
        int j = (int)(rnd() % (uint64_t)(i + 1));
        uint32_t t = perm[i];
        perm[i] = perm[j], perm[j] = t;
    }
    for (int i = 0; i < NOPS; i++) {
        len[i] = (uint32_t)(1 + rnd() % (SLOT / 4096)) * 4096;
        off[i] = (uint32_t)(rnd() % ((SLOT - len[i]) / 4096 + 1)) * 4096;
        fill(wbuf + (size_t)i * SLOT, len[i], rnd());
    }
    for (int i = 0; i < NOPS; i++) {
        r = tkv_io_write(io, f, wbuf + (size_t)i * SLOT, len[i], (uint64_t)perm[i] * SLOT + off[i], 1000 + i);
        CHECK(r == 0, "write %d queue: %d", i, r);
    }
    CHECK(tkv_io_submit(io) == NOPS, "submit writes");
    struct tkv_io_cqe c[NOPS];
    int got = wait_n(io, NOPS, c);
    bool seen[NOPS] = {0};
    for (int k = 0; k < got; k++) {
        int i = (int)c[k].user_tag - 1000;
        REQUIRE_VOID(i >= 0 && i < NOPS && !seen[i]);
        seen[i] = true;
        CHECK(c[k].result == len[i], "write %d: result %lld, want %u", i, (long long)c[k].result, len[i]);
    }
    CHECK(tkv_io_poll(io, c, NOPS) == 0, "no extra completions");

    memset(rbuf, 0xAA, total);
    for (int i = NOPS - 1; i >= 0; i--)
        CHECK(tkv_io_read(io, f, rbuf + (size_t)i * SLOT, len[i], (uint64_t)perm[i] * SLOT + off[i], 2000 + i) == 0,
              "read %d queue", i);
    CHECK(tkv_io_submit(io) == NOPS, "submit reads");
    got = wait_n(io, NOPS, c);
    int bad = 0;
    for (int k = 0; k < got; k++) {
        int i = (int)c[k].user_tag - 2000;
        REQUIRE_VOID(i >= 0 && i < NOPS);
        CHECK(c[k].result == len[i], "read %d: result %lld, want %u", i, (long long)c[k].result, len[i]);
        bad += memcmp(rbuf + (size_t)i * SLOT, wbuf + (size_t)i * SLOT, len[i]) != 0;
    }
    CHECK(bad == 0, "%d of %d ops read back different bytes", bad, NOPS);

    tkv_io_get_info(io, &info);
    CHECK(info.n_ops == 2 * NOPS, "n_ops %llu", (unsigned long long)info.n_ops);
    if (regions && !sync) {
        CHECK(info.fixed_buffers, "region registered");
        CHECK(info.n_fixed_ops == NOPS, "fixed ops %llu, want %d", (unsigned long long)info.n_fixed_ops, NOPS);
    } else {
        CHECK(info.n_fixed_ops == 0, "fixed ops %llu", (unsigned long long)info.n_fixed_ops);
    }
    fprintf(stderr, "  direct=%d fixed_files=%d fixed_ops=%llu\n", tkv_io_direct(f), info.fixed_files,
            (unsigned long long)info.n_fixed_ops);
    tkv_io_file_close(f);
    CHECK(dir_entries(dir) == 0, "dir not empty after close");
    tkv_io_free(io);
    tkv_io_free_aligned(wbuf);
    tkv_io_free_aligned(rbuf);
}

/* ---- O_DIRECT refused: one warning, buffered, unaligned I/O allowed ------ */

static void test_direct_refused(bool sync, const char *dir)
{
    fprintf(stderr, "direct refused: engine=%s dir=%s\n", sync ? "sync" : "io_uring", dir);
    struct tkv_io *io = make_io(sync, 8, 0, NULL, 0);
    REQUIRE_VOID(io);
    tkv_io_set_fault(io, &(struct tkv_io_fault){.open_direct_err = EINVAL}); /* as tmpfs before 6.6 */
    int w0 = n_warn_direct;
    struct tkv_io_file *f1, *f2;
    REQUIRE_VOID(tkv_io_file_open_tmp(io, dir, &f1) == 0);
    REQUIRE_VOID(tkv_io_file_open_tmp(io, dir, &f2) == 0);
    CHECK(!tkv_io_direct(f1) && !tkv_io_direct(f2), "files must be buffered");
    CHECK(n_warn_direct - w0 == 1, "%d O_DIRECT warnings for one engine, want 1", n_warn_direct - w0);

    char w[1000], rb[1001];
    fill(w, sizeof w, 7);
    CHECK(tkv_io_write(io, f2, w, sizeof w, 7, 1) == 0, "unaligned write on a buffered file");
    CHECK(tkv_io_submit(io) == 1, "submit");
    struct tkv_io_cqe c[2];
    CHECK(wait_n(io, 1, c) == 1 && c[0].result == (int64_t)sizeof w, "write result %lld", (long long)c[0].result);
    CHECK(tkv_io_read(io, f2, rb + 1, sizeof w, 7, 2) == 0, "unaligned read");
    CHECK(tkv_io_submit(io) == 1, "submit");
    CHECK(wait_n(io, 1, c) == 1 && c[0].result == (int64_t)sizeof w, "read result %lld", (long long)c[0].result);
    CHECK(memcmp(rb + 1, w, sizeof w) == 0, "unaligned round trip");
    tkv_io_file_close(f1);
    tkv_io_file_close(f2);
    CHECK(dir_entries(dir) == 0, "dir not empty");
    tkv_io_free(io);

    /* What this file system really does with O_DIRECT (tmpfs: since Linux 6.6). */
    io = make_io(sync, 8, 0, NULL, 0);
    w0 = n_warn_direct;
    if (tkv_io_file_open_tmp(io, dir, &f1) == 0) {
        fprintf(stderr, "  (no fault injected: %s %s O_DIRECT, %d warning)\n", dir,
                tkv_io_direct(f1) ? "accepts" : "refuses", n_warn_direct - w0);
        CHECK(n_warn_direct - w0 == (tkv_io_direct(f1) ? 0 : 1), "warning iff refused");
        tkv_io_file_close(f1);
    }
    tkv_io_free(io);
}

/* ---- no O_TMPFILE: mkstemp in a private subdirectory, unlinked ---------- */

static void test_mkstemp_path(bool sync, const char *dir)
{
    fprintf(stderr, "mkstemp path: engine=%s dir=%s\n", sync ? "sync" : "io_uring", dir);
    for (int variant = 0; variant < 2; variant++) {
        struct tkv_io *io = make_io(sync, 8, variant == 0 ? TKV_IO_NO_TMPFILE : 0, NULL, 0);
        REQUIRE_VOID(io);
        if (variant == 1)
            tkv_io_set_fault(io, &(struct tkv_io_fault){.open_tmpfile_err = EOPNOTSUPP});
        struct tkv_io_file *f;
        REQUIRE_VOID(tkv_io_file_open_tmp(io, dir, &f) == 0);
        CHECK(dir_entries(dir) == 0, "mkstemp file or its subdirectory left visible");
        char *b = tkv_io_alloc_aligned(64 * KiB), *rb = tkv_io_alloc_aligned(64 * KiB);
        fill(b, 64 * KiB, 99);
        CHECK(tkv_io_write(io, f, b, 64 * KiB, 128 * KiB, 1) == 0, "write");
        CHECK(tkv_io_submit(io) == 1, "submit");
        struct tkv_io_cqe c;
        CHECK(wait_n(io, 1, &c) == 1 && c.result == 64 * KiB, "write result");
        CHECK(tkv_io_file_size(f) == 192 * KiB, "size grows with writes: %llu",
              (unsigned long long)tkv_io_file_size(f));
        CHECK(tkv_io_read(io, f, rb, 64 * KiB, 128 * KiB, 2) == 0, "read");
        CHECK(tkv_io_submit(io) == 1, "submit");
        CHECK(wait_n(io, 1, &c) == 1 && c.result == 64 * KiB, "read result");
        CHECK(memcmp(b, rb, 64 * KiB) == 0, "round trip");
        tkv_io_file_close(f);
        tkv_io_free(io);
        tkv_io_free_aligned(b);
        tkv_io_free_aligned(rb);
    }
    CHECK(dir_entries(dir) == 0, "dir not empty");
}

/* ---- SIGKILL with files open and writes in flight: nothing left --------- */

static void test_killed(const char *dir)
{
    fprintf(stderr, "killed child: dir=%s\n", dir);
    pid_t pid = fork();
    REQUIRE_VOID(pid >= 0);
    if (pid == 0) {
        struct tkv_io *io = make_io(false, 64, 0, NULL, 0);
        struct tkv_io *io2 = make_io(false, 64, TKV_IO_NO_TMPFILE, NULL, 0);
        struct tkv_io_file *f[4];
        if (!io || !io2 || tkv_io_file_open_tmp(io, dir, &f[0]) || tkv_io_file_open_tmp(io, dir, &f[1]) ||
            tkv_io_file_open_tmp(io2, dir, &f[2]) || tkv_io_file_open_tmp(io2, dir, &f[3]))
            _exit(3);
        char *b = tkv_io_alloc_aligned(4 * MiB);
        memset(b, 1, 4 * MiB);
        for (int i = 0; i < 4; i++) {
            tkv_io_file_resize(f[i], 64 * MiB);
            for (int k = 0; k < 16; k++)
                tkv_io_write(i < 2 ? io : io2, f[i], b, 4 * MiB, (uint64_t)k * 4 * MiB, (uint64_t)k);
        }
        tkv_io_submit(io);
        tkv_io_submit(io2);
        raise(SIGKILL);
        _exit(4);
    }
    int st;
    CHECK(waitpid(pid, &st, 0) == pid, "waitpid");
    CHECK(WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL, "child status %#x (exit %d)", st,
          WIFEXITED(st) ? WEXITSTATUS(st) : -1);
    CHECK(dir_entries(dir) == 0, "spill dir not empty after SIGKILL");
}

/* ---- alignment, EOF, queue full, close with ops pending ------------------ */

static void test_rules(bool sync, const char *dir)
{
    fprintf(stderr, "rules: engine=%s dir=%s\n", sync ? "sync" : "io_uring", dir);
    struct tkv_io *io = make_io(sync, 4, 0, NULL, 0);
    REQUIRE_VOID(io);
    struct tkv_io_file *f;
    REQUIRE_VOID(tkv_io_file_open_tmp(io, dir, &f) == 0);
    char *b = tkv_io_alloc_aligned(64 * KiB);
    REQUIRE_VOID(b);
    memset(b, 0x5a, 64 * KiB);
    CHECK(tkv_io_file_resize(f, MiB) == 0, "resize");

    if (tkv_io_direct(f)) {
        CHECK(tkv_io_write(io, f, b + 512, 4096, 0, 0) == -EINVAL, "misaligned buffer");
        CHECK(tkv_io_write(io, f, b, 4097, 0, 0) == -EINVAL, "misaligned length");
        CHECK(tkv_io_read(io, f, b, 4096, 512, 0) == -EINVAL, "misaligned offset");
        CHECK(tkv_io_read(io, f, b, 8192 - 512, 4096, 0) == -EINVAL, "misaligned length (read)");
    } else {
        skip_case("misaligned -> -EINVAL", "the file is not O_DIRECT here");
    }
    CHECK(tkv_io_read(io, f, b, 0, 0, 0) == -EINVAL, "zero length");
    CHECK(tkv_io_read(io, f, NULL, 4096, 0, 0) == -EINVAL, "NULL buffer");
    CHECK(tkv_io_status(-EINVAL, "read") == TKV_ERR_INVALID_ARG, "EINVAL status");
    CHECK(strstr(tkv_last_error(), "4 KiB-aligned") != NULL, "message: %s", tkv_last_error());

    /* End of file (size 1 MiB): wholly past -> -ENODATA; straddling -> -ENODATA; up to it -> full. */
    struct tkv_io_cqe c[4];
    CHECK(tkv_io_read(io, f, b, 4096, MiB, 1) == 0, "queue");
    CHECK(tkv_io_read(io, f, b + 8192, 8192, MiB - 4096, 2) == 0, "queue");
    CHECK(tkv_io_read(io, f, b + 32768, 4096, MiB - 4096, 3) == 0, "queue");
    CHECK(tkv_io_submit(io) == 3, "submit");
    CHECK(wait_n(io, 3, c) == 3, "3 completions");
    for (int k = 0; k < 3; k++) {
        int64_t want = c[k].user_tag == 3 ? 4096 : -ENODATA;
        CHECK(c[k].result == want, "EOF read %llu: %lld, want %lld", (unsigned long long)c[k].user_tag,
              (long long)c[k].result, (long long)want);
    }
    CHECK(tkv_io_status(-ENODATA, "read block 7") == TKV_ERR_IO, "ENODATA status");
    CHECK(strstr(tkv_last_error(), "read past end of file") && strstr(tkv_last_error(), "read block 7"), "msg: %s",
          tkv_last_error());

    /* Queue depth 4: the 5th op is -EAGAIN until completions are reaped. */
    for (int i = 0; i < 4; i++)
        CHECK(tkv_io_write(io, f, b, 4096, (uint64_t)i * 4096, 10 + i) == 0, "queue %d", i);
    CHECK(tkv_io_write(io, f, b, 4096, 0, 14) == -EAGAIN, "queue full");
    CHECK(tkv_io_submit(io) == 4, "submit");
    CHECK(tkv_io_write(io, f, b, 4096, 0, 14) == -EAGAIN, "still full before reaping");
    CHECK(wait_n(io, 4, c) == 4, "reap");
    CHECK(tkv_io_write(io, f, b, 4096, 0, 14) == 0, "room again");
    CHECK(tkv_io_submit(io) == 1 && wait_n(io, 1, c) == 1 && c[0].result == 4096, "5th op");
    CHECK(tkv_io_wait(io, 1, c, 4) == 0, "wait with nothing in flight returns 0");

    /* Close with 2 in flight and 1 queued: the queued one is cancelled. */
    int e0 = n_errors;
    CHECK(tkv_io_write(io, f, b, 64 * KiB, 0, 21) == 0 && tkv_io_write(io, f, b, 64 * KiB, 64 * KiB, 22) == 0, "q");
    CHECK(tkv_io_submit(io) == 2, "submit");
    CHECK(tkv_io_write(io, f, b, 4096, 0, 23) == 0, "queued, not submitted");
    tkv_io_file_close(f);
    CHECK(wait_n(io, 3, c) == 3, "3 completions after close");
    for (int k = 0; k < 3; k++)
        CHECK(c[k].result == (c[k].user_tag == 23 ? -ECANCELED : (int64_t)(64 * KiB)), "tag %llu result %lld",
              (unsigned long long)c[k].user_tag, (long long)c[k].result);
    CHECK(n_errors - e0 == (sync ? 0 : 1), "close with ops in flight logs an error (%d)", n_errors - e0);

    tkv_io_free(io);
    tkv_io_free_aligned(b);
    CHECK(dir_entries(dir) == 0, "dir not empty");
}

/* ---- injected faults: errors are clear and earlier data survives -------- */

#define FSLOTS 64
#define FLEN (64 * KiB)

static void check_slots(struct tkv_io *io, struct tkv_io_file *f, char *ref, char *rb, const char *when)
{
    struct tkv_io_cqe c[FSLOTS];
    for (int i = 0; i < FSLOTS; i++)
        CHECK(tkv_io_read(io, f, rb + (size_t)i * FLEN, FLEN, (uint64_t)i * FLEN, (uint64_t)i) == 0, "q");
    CHECK(tkv_io_submit(io) == FSLOTS, "submit");
    int got = wait_n(io, FSLOTS, c), bad = 0;
    for (int k = 0; k < got; k++) {
        CHECK(c[k].result == FLEN, "%s: read %llu: %lld", when, (unsigned long long)c[k].user_tag,
              (long long)c[k].result);
        bad += memcmp(rb + c[k].user_tag * FLEN, ref + c[k].user_tag * FLEN, FLEN) != 0;
    }
    CHECK(bad == 0, "%s: %d slots differ", when, bad);
}

static void test_faults(bool sync, const char *dir)
{
    fprintf(stderr, "faults: engine=%s dir=%s\n", sync ? "sync" : "io_uring", dir);
    size_t total = (size_t)FSLOTS * FLEN;
    char *ref = tkv_io_alloc_aligned(total), *nb = tkv_io_alloc_aligned(total), *rb = tkv_io_alloc_aligned(total);
    REQUIRE_VOID(ref && nb && rb);
    struct tkv_io *io = make_io(sync, 64, 0, NULL, 0);
    REQUIRE_VOID(io);
    struct tkv_io_file *f;
    REQUIRE_VOID(tkv_io_file_open_tmp(io, dir, &f) == 0);
    CHECK(tkv_io_file_resize(f, total) == 0, "resize");
    struct tkv_io_cqe c[FSLOTS];

    /* Batch A: slots 0..31. */
    fill(ref, total, 1234);
    for (int i = 0; i < 32; i++)
        CHECK(tkv_io_write(io, f, ref + (size_t)i * FLEN, FLEN, (uint64_t)i * FLEN, (uint64_t)i) == 0, "q");
    CHECK(tkv_io_submit(io) == 32 && wait_n(io, 32, c) == 32, "batch A");

    /* Batch B: slots 32..63, the 6th op (slot 37) fails with EIO. */
    tkv_io_set_fault(io, &(struct tkv_io_fault){.ops_skip = 5, .ops_count = 1, .op_err = EIO});
    memcpy(nb, ref, total);
    fill(nb + 32 * (size_t)FLEN, 32 * (size_t)FLEN, 777);
    for (int i = 32; i < 64; i++)
        CHECK(tkv_io_write(io, f, nb + (size_t)i * FLEN, FLEN, (uint64_t)i * FLEN, (uint64_t)i) == 0, "q");
    CHECK(tkv_io_submit(io) == 32, "submit B");
    int got = wait_n(io, 32, c), n_eio = 0;
    for (int k = 0; k < got; k++) {
        if (c[k].user_tag == 37) {
            n_eio++;
            CHECK(c[k].result == -EIO, "slot 37: %lld", (long long)c[k].result);
            tkv_status s = tkv_io_status((int)c[k].result, "write spill block 37");
            fprintf(stderr, "  injected EIO -> %s: %s\n", tkv_status_str(s), tkv_last_error());
            CHECK(s == TKV_ERR_IO, "status");
            CHECK(strstr(tkv_last_error(), "io: write spill block 37: ") &&
                      strstr(tkv_last_error(), "nput/output error"), "message: %s", tkv_last_error());
        } else {
            CHECK(c[k].result == FLEN, "slot %llu: %lld", (unsigned long long)c[k].user_tag, (long long)c[k].result);
        }
    }
    CHECK(n_eio == 1, "one EIO");
    /* slot 37 still holds batch A's... nothing: it was never written; expect zeros there */
    memcpy(ref + 32 * (size_t)FLEN, nb + 32 * (size_t)FLEN, 32 * (size_t)FLEN);
    memset(ref + 37 * (size_t)FLEN, 0, FLEN);

    /* Short transfers on reads: every transfer of the first 16 reads is cut
     * to 4 KiB; the engine continues them, results stay exact. */
    struct tkv_io_info i0, i1;
    tkv_io_get_info(io, &i0);
    tkv_io_set_fault(io, &(struct tkv_io_fault){.ops_count = 16, .short_bytes = 4096});
    check_slots(io, f, ref, rb, "after EIO, short reads");
    tkv_io_get_info(io, &i1);
    CHECK(i1.n_continued - i0.n_continued == 16 * (FLEN / 4096 - 1), "continued %llu",
          (unsigned long long)(i1.n_continued - i0.n_continued));

    /* Short writes: slots 40..43 rewritten in 8 KiB pieces. */
    tkv_io_set_fault(io, &(struct tkv_io_fault){.ops_count = 4, .short_bytes = 8192});
    fill(ref + 40 * (size_t)FLEN, 4 * (size_t)FLEN, 4040);
    for (int i = 40; i < 44; i++)
        CHECK(tkv_io_write(io, f, ref + (size_t)i * FLEN, FLEN, (uint64_t)i * FLEN, (uint64_t)i) == 0, "q");
    CHECK(tkv_io_submit(io) == 4, "submit");
    got = wait_n(io, 4, c);
    for (int k = 0; k < got; k++)
        CHECK(c[k].result == FLEN, "short write %llu: %lld", (unsigned long long)c[k].user_tag, (long long)c[k].result);
    tkv_io_set_fault(io, NULL);
    check_slots(io, f, ref, rb, "after short writes");

    /* The disk fills mid-write: slot 10 gets 8 KiB of new data, then ENOSPC. */
    tkv_io_set_fault(io, &(struct tkv_io_fault){.ops_count = 1, .op_err = ENOSPC, .short_bytes = 8192});
    fill(nb, FLEN, 1010);
    CHECK(tkv_io_write(io, f, nb, FLEN, 10 * (uint64_t)FLEN, 10) == 0, "q");
    CHECK(tkv_io_submit(io) == 1 && wait_n(io, 1, c) == 1, "submit");
    CHECK(c[0].result == -ENOSPC, "ENOSPC write: %lld", (long long)c[0].result);
    tkv_status s = tkv_io_status((int)c[0].result, "write spill block 10");
    fprintf(stderr, "  injected ENOSPC -> %s: %s\n", tkv_status_str(s), tkv_last_error());
    CHECK(s == TKV_ERR_IO && strstr(tkv_last_error(), "no space left on device"), "msg: %s", tkv_last_error());
    memcpy(ref + 10 * (size_t)FLEN, nb, 8192); /* documented: part of a failed write may land */

    /* Resize hits ENOSPC: reported, size unchanged. */
    tkv_io_set_fault(io, &(struct tkv_io_fault){.resize_err = ENOSPC});
    CHECK(tkv_io_file_resize(f, 2 * total) == -ENOSPC, "resize ENOSPC");
    CHECK(tkv_io_file_size(f) == total, "size unchanged");
    tkv_io_set_fault(io, NULL);
    check_slots(io, f, ref, rb, "after ENOSPC");

    tkv_io_file_close(f);
    tkv_io_free(io);
    tkv_io_free_aligned(ref);
    tkv_io_free_aligned(nb);
    tkv_io_free_aligned(rb);
}

/* ---- a real ENOSPC: a 1 MiB tmpfs in a private mount namespace ---------- */

static void test_real_enospc(const char *base)
{
    fprintf(stderr, "real ENOSPC (1 MiB tmpfs)\n");
    char dir[512];
    if (!make_dir(base, dir, sizeof dir)) {
        skip_case("real ENOSPC", "cannot create a directory");
        return;
    }
    pid_t pid = fork();
    REQUIRE_VOID(pid >= 0);
    if (pid == 0) {
        if (unshare(CLONE_NEWNS) != 0 && unshare(CLONE_NEWUSER | CLONE_NEWNS) != 0)
            _exit(77);
        if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) != 0 ||
            mount("tmpfs", dir, "tmpfs", 0, "size=1m,mode=0700") != 0)
            _exit(77);
        test_failures_ = 0;
        for (int sync = 0; sync < 2; sync++) {
            if (!sync && !have_uring)
                continue;
            struct tkv_io *io = make_io(sync, 8, 0, NULL, 0);
            struct tkv_io_file *f;
            if (!io || tkv_io_file_open_tmp(io, dir, &f) != 0)
                _exit(1);
            CHECK(tkv_io_file_resize(f, 4 * MiB) == -ENOSPC, "resize past the disk");
            CHECK(tkv_io_file_size(f) == 0, "size unchanged");
            char *b = tkv_io_alloc_aligned(2 * MiB);
            memset(b, 3, 2 * MiB);
            CHECK(tkv_io_write(io, f, b, 2 * MiB, 0, 1) == 0, "q");
            struct tkv_io_cqe c;
            CHECK(tkv_io_submit(io) == 1 && wait_n(io, 1, &c) == 1, "submit");
            CHECK(c.result == -ENOSPC, "%s: 2 MiB write on a 1 MiB disk: %lld", sync ? "sync" : "io_uring",
                  (long long)c.result);
            tkv_io_free_aligned(b);
            tkv_io_file_close(f);
            tkv_io_free(io);
        }
        _exit(test_failures_ ? 1 : 0);
    }
    int st;
    CHECK(waitpid(pid, &st, 0) == pid, "waitpid");
    if (WIFEXITED(st) && WEXITSTATUS(st) == 77)
        skip_case("real ENOSPC", "cannot mount a tmpfs in a private mount namespace");
    else
        CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0, "ENOSPC child failed (status %#x)", st);
    rmdir(dir);
}

/* ---- io_uring refused by seccomp (EPERM): the sync engine takes over ---- */

static void test_seccomp_fallback(const char *dir)
{
    fprintf(stderr, "io_uring_setup blocked by seccomp\n");
    pid_t pid = fork();
    REQUIRE_VOID(pid >= 0);
    if (pid == 0) {
        struct sock_filter filt[] = {
            BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
            BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_io_uring_setup, 0, 1),
            BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | EPERM),
            BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
        };
        struct sock_fprog prog = {.len = sizeof filt / sizeof filt[0], .filter = filt};
        if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) || prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog))
            _exit(77);
        test_failures_ = 0;
        int w0 = n_warn_sync;
        struct tkv_io *io = make_io(false, 8, 0, NULL, 0);
        if (!io)
            _exit(1);
        struct tkv_io_info info;
        tkv_io_get_info(io, &info);
        CHECK(strcmp(info.engine, "sync") == 0, "engine %s", info.engine);
        CHECK(n_warn_sync - w0 == 1, "%d warnings", n_warn_sync - w0);
        struct tkv_io_file *f;
        CHECK(tkv_io_file_open_tmp(io, dir, &f) == 0, "open");
        char *b = tkv_io_alloc_aligned(8192);
        memset(b, 9, 8192);
        struct tkv_io_cqe c;
        CHECK(tkv_io_write(io, f, b, 8192, 0, 1) == 0 && tkv_io_submit(io) == 1, "write");
        CHECK(tkv_io_wait(io, 1, &c, 1) == 1 && c.result == 8192, "result %lld", (long long)c.result);
        tkv_io_file_close(f);
        tkv_io_free(io);
        tkv_io_free_aligned(b);
        _exit(test_failures_ ? 1 : 0);
    }
    int st;
    CHECK(waitpid(pid, &st, 0) == pid, "waitpid");
    if (WIFEXITED(st) && WEXITSTATUS(st) == 77)
        skip_case("seccomp fallback", "cannot install a seccomp filter");
    else
        CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0, "seccomp child failed (status %#x)", st);
}

/* ---- engine selection, NULLs, status mapping ---------------------------- */

static void test_misc(void)
{
    fprintf(stderr, "misc\n");
    tkv_io_free(NULL);
    tkv_io_file_close(NULL);
    tkv_io_free_aligned(NULL);
    CHECK(tkv_io_status(0, "x") == TKV_OK && tkv_io_status(4096, "x") == TKV_OK, "ok");
    CHECK(tkv_io_status(-ENOMEM, "x") == TKV_ERR_NOMEM, "nomem");
    CHECK(tkv_io_status(-EAGAIN, "queue") == TKV_ERR_IO && strstr(tkv_last_error(), "queue full"), "eagain");
    CHECK(tkv_io_status(-EIO, "read") == TKV_ERR_IO, "eio");
    void *p = tkv_io_alloc_aligned(1);
    CHECK(p && ((uintptr_t)p % TKV_IO_ALIGN) == 0, "aligned");
    tkv_io_free_aligned(p);
    p = tkv_io_alloc_aligned(3 * MiB);
    CHECK(p && ((uintptr_t)p % (2 * MiB)) == 0, "2 MiB aligned");
    tkv_io_free_aligned(p);
    CHECK(tkv_io_init(NULL, NULL) == -EINVAL, "NULL out");
    struct tkv_io_params bad = tkv_io_default_params();
    bad.queue_depth = 100000;
    struct tkv_io *io;
    CHECK(tkv_io_init(&bad, &io) == -EINVAL && io == NULL, "huge queue depth");

    /* TKV_IO_FORCE_SYNC=1 selects the sync engine, with one warning. */
    const char *old = getenv("TKV_IO_FORCE_SYNC");
    setenv("TKV_IO_FORCE_SYNC", "1", 1);
    int w0 = n_warn_sync;
    io = make_io(false, 8, 0, NULL, 0);
    struct tkv_io_info info;
    tkv_io_get_info(io, &info);
    CHECK(strcmp(info.engine, "sync") == 0, "engine %s", info.engine);
    CHECK(n_warn_sync - w0 == 1, "%d warnings", n_warn_sync - w0);
    tkv_io_free(io);
    if (old)
        setenv("TKV_IO_FORCE_SYNC", old, 1);
    else
        unsetenv("TKV_IO_FORCE_SYNC");
}

int main(void)
{
    tkv_set_log(capture_log, NULL, TKV_LOG_WARN);
    const char *seed = getenv("TKV_TEST_SEED");
    rng_state = seed ? strtoull(seed, NULL, 0) : (uint64_t)time(NULL);
    fprintf(stderr, "seed %llu (TKV_TEST_SEED)\n", (unsigned long long)rng_state);
    rng_state = rng_state * 0x9e3779b97f4a7c15ull + 1;

    const char *disk_base = getenv("TKV_TEST_DISK_DIR");
    if (!disk_base)
        disk_base = is_tmpfs("/var/tmp") && getenv("TKV_BUILD_DIR") ? getenv("TKV_BUILD_DIR") : "/var/tmp";
    char disk[512], shm[512];
    if (!make_dir(disk_base, disk, sizeof disk))
        SKIP("cannot create a directory in %s: %s", disk_base, strerror(errno));
    bool disk_is_tmpfs = is_tmpfs(disk);
    bool have_shm = is_tmpfs("/dev/shm") && make_dir("/dev/shm", shm, sizeof shm);
    if (!have_shm)
        skip_case("tmpfs sub-cases", "/dev/shm is not a writable tmpfs");

    have_uring = uring_available();
    if (!have_uring)
        skip_case("io_uring sub-cases", "io_uring is refused here (or TKV_IO_FORCE_SYNC is set): sync engine only");

    for (int sync = have_uring ? 0 : 1; sync < 2; sync++) {
        test_roundtrip(sync, disk, false, !disk_is_tmpfs);
        if (!sync)
            test_roundtrip(sync, disk, true, !disk_is_tmpfs);
        if (have_shm)
            test_roundtrip(sync, shm, false, false);
        test_direct_refused(sync, have_shm ? shm : disk);
        test_mkstemp_path(sync, disk);
        test_rules(sync, disk);
        test_faults(sync, disk);
        if (have_shm)
            test_faults(sync, shm);
    }
    test_killed(disk);
    test_real_enospc(disk_base);
    test_seccomp_fallback(disk);
    test_misc();

    CHECK(n_warn_other == 0, "%d unexpected warnings", n_warn_other);
    rmdir(disk);
    if (have_shm)
        rmdir(shm);
    fprintf(stderr, "%d sub-case(s) skipped\n", n_skipped);
    return test_done();
}
