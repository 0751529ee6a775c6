/*
 * bench-io.c -- spill-file I/O speed: io_uring vs the synchronous fallback,
 * O_DIRECT, sequential and random reads and writes at several block sizes
 * and queue depths, on one preallocated, pre-written file.
 *
 *   bench-io [-d DIR] [-s MiB] [-b 4k,64k,1m] [-q 1,8,32] [-t SEC] [-r REPS]
 *            [-e io_uring,sync] [-p seq-read,rand-read,seq-write,rand-write]
 *            [--buffered] [--no-fixed] [-o md|jsonl]
 *
 * Defaults: DIR /var/tmp, 256 MiB, 0.5 s per repetition, 3 repetitions
 * after one short warm-up. Each case keeps QD ops in flight for t seconds
 * (the sync engine runs a batch's ops one after another inside submit, so
 * its QD only sets the batch size). Buffers are one registered region
 * (io_uring fixed buffers) unless --no-fixed. Prints mean +- stddev GB/s
 * (1e9 bytes/s) and IOPS as a Markdown table, or one JSON object per case.
 */
#include "io/io.h"

#include "bench.h"
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/utsname.h>
#include <sys/vfs.h>
#include <time.h>
#include <unistd.h>

#define MAXL 16
#define FILL_QD 8

static int parse_size(const char *s, uint64_t *out)
{
    char *end;
    double v = strtod(s, &end);
    uint64_t m = 1;
    if (*end == 'k' || *end == 'K')
        m = 1024, end++;
    else if (*end == 'm' || *end == 'M')
        m = 1024 * 1024, end++;
    else if (*end == 'g' || *end == 'G')
        m = 1024ull * 1024 * 1024, end++;
    if (end == s || *end || v <= 0)
        return -1;
    *out = (uint64_t)(v * (double)m);
    return 0;
}

static int parse_list(const char *arg, uint64_t *out, int *n, bool sizes)
{
    char buf[256];
    snprintf(buf, sizeof buf, "%s", arg);
    *n = 0;
    for (char *tok = strtok(buf, ","); tok && *n < MAXL; tok = strtok(NULL, ",")) {
        uint64_t v;
        if (sizes ? parse_size(tok, &v) : (v = strtoull(tok, NULL, 10)) == 0)
            return -1;
        out[(*n)++] = v;
    }
    return *n ? 0 : -1;
}

enum pattern { SEQ_READ, RAND_READ, SEQ_WRITE, RAND_WRITE, N_PATTERN };
static const char *pattern_name[] = {"seq-read", "rand-read", "seq-write", "rand-write"};

struct bench {
    struct tkv_io *io;
    struct tkv_io_file *f;
    char *region;     /* [max qd][max bs] */
    uint64_t max_bs, size;
};

static int queue_one(struct bench *b, enum pattern p, uint64_t bs, uint32_t slot, uint64_t *seq)
{
    uint64_t off;
    if (p == SEQ_READ || p == SEQ_WRITE) {
        off = *seq;
        *seq = off + bs >= b->size ? 0 : off + bs;
    } else {
        off = rnd() % (b->size / bs) * bs;
    }
    char *buf = b->region + (uint64_t)slot * b->max_bs;
    bool wr = p == SEQ_WRITE || p == RAND_WRITE;
    return wr ? tkv_io_write(b->io, b->f, buf, bs, off, slot) : tkv_io_read(b->io, b->f, buf, bs, off, slot);
}

/* Keeps qd ops of bs bytes in flight for secs; returns ops/s, or < 0. */
static double run_case(struct bench *b, enum pattern p, uint64_t bs, uint32_t qd, double secs)
{
    struct tkv_io_cqe c[256];
    uint64_t seq = 0, ops = 0;
    uint32_t inflight = 0;
    for (uint32_t s = 0; s < qd; s++) {
        if (queue_one(b, p, bs, s, &seq) < 0)
            return -1;
        inflight++;
    }
    double t0 = now(), deadline = t0 + secs, t = t0;
    if (tkv_io_submit(b->io) < 0)
        return -1;
    while (inflight) {
        int n = tkv_io_wait(b->io, 1, c, 256);
        if (n < 0)
            return tkv_io_status(n, "wait"), -1;
        t = now();
        inflight -= (uint32_t)n;
        for (int k = 0; k < n; k++) {
            if (c[k].result != (int64_t)bs) {
                tkv_io_status(c[k].result < 0 ? (int)c[k].result : -EIO, "transfer");
                return -1;
            }
            ops++;
            if (t < deadline) {
                if (queue_one(b, p, bs, (uint32_t)c[k].user_tag, &seq) < 0)
                    return -1;
                inflight++;
            }
        }
        if (t < deadline && tkv_io_submit(b->io) < 0)
            return -1;
    }
    return (double)ops / (t - t0);
}

static int fill_file(struct bench *b)
{
    uint64_t bs = b->max_bs, seq = 0;
    uint32_t qd = FILL_QD, done = 0, n_ops = (uint32_t)(b->size / bs);
    struct tkv_io_cqe c[FILL_QD];
    memset(b->region, 0x5a, (size_t)(qd * bs));
    for (uint32_t i = 0; i < n_ops || done < n_ops;) {
        while (i < n_ops && i - done < qd)
            if (queue_one(b, SEQ_WRITE, bs, i++ % qd, &seq) < 0)
                return -1;
        if (tkv_io_submit(b->io) < 0)
            return -1;
        int n = tkv_io_wait(b->io, 1, c, FILL_QD);
        if (n < 0)
            return -1;
        for (int k = 0; k < n; k++)
            if (c[k].result != (int64_t)bs)
                return tkv_io_status(c[k].result < 0 ? (int)c[k].result : -EIO, "fill"), -1;
        done += (uint32_t)n;
    }
    return 0;
}

static void usage(void)
{
    fprintf(stderr, "usage: bench-io [-d DIR] [-s MiB] [-b 4k,64k,1m] [-q 1,8,32] [-t SEC] [-r REPS]\n"
                    "                [-e io_uring,sync] [-p seq-read,rand-read,seq-write,rand-write]\n"
                    "                [--buffered] [--no-fixed] [-o md|jsonl]\n");
    exit(2);
}

int main(int argc, char **argv)
{
    const char *dir = "/var/tmp", *fmt = "md", *engines = "io_uring,sync", *patterns = NULL;
    uint64_t size = 256ull << 20, bss[MAXL] = {4096, 65536, 1 << 20}, qds[MAXL] = {1, 8, 32};
    int n_bs = 3, n_qd = 3, reps = 3;
    double secs = 0.5;
    bool buffered = false, fixed = true;
    static struct option lo[] = {{"buffered", no_argument, 0, 'B'}, {"no-fixed", no_argument, 0, 'F'}, {0}};
    for (int o; (o = getopt_long(argc, argv, "d:s:b:q:t:r:e:p:o:h", lo, NULL)) != -1;) {
        switch (o) {
        case 'd': dir = optarg; break;
        case 's': size = strtoull(optarg, NULL, 10) << 20; break;
        case 'b': if (parse_list(optarg, bss, &n_bs, true)) usage(); break;
        case 'q': if (parse_list(optarg, qds, &n_qd, false)) usage(); break;
        case 't': secs = atof(optarg); break;
        case 'r': reps = atoi(optarg); break;
        case 'e': engines = optarg; break;
        case 'p': patterns = optarg; break;
        case 'o': fmt = optarg; break;
        case 'B': buffered = true; break;
        case 'F': fixed = false; break;
        default: usage();
        }
    }
    bool jsonl = strcmp(fmt, "jsonl") == 0;
    if ((!jsonl && strcmp(fmt, "md")) || reps < 1 || secs <= 0 || !size)
        usage();
    uint64_t max_bs = 0, max_qd = 0;
    for (int i = 0; i < n_bs; i++) {
        if (bss[i] % TKV_IO_ALIGN || bss[i] > size)
            return fprintf(stderr, "bench-io: block size %llu: not a multiple of 4 KiB or larger than the file\n",
                           (unsigned long long)bss[i]), 2;
        max_bs = bss[i] > max_bs ? bss[i] : max_bs;
    }
    for (int i = 0; i < n_qd; i++) {
        if (qds[i] > 256)
            usage();
        max_qd = qds[i] > max_qd ? qds[i] : max_qd;
    }
    size = size / max_bs * max_bs;

    char commit[64], fs[32];
    build_commit(commit, sizeof commit);
    struct statfs sfs;
    snprintf(fs, sizeof fs, statfs(dir, &sfs) == 0 ? "0x%lx" : "?", (unsigned long)sfs.f_type);
    if (statfs(dir, &sfs) == 0 && sfs.f_type == 0xEF53)
        snprintf(fs, sizeof fs, "ext4");
    else if (statfs(dir, &sfs) == 0 && sfs.f_type == 0x01021994)
        snprintf(fs, sizeof fs, "tmpfs");
    else if (statfs(dir, &sfs) == 0 && sfs.f_type == 0x58465342)
        snprintf(fs, sizeof fs, "xfs");
    struct utsname un;
    uname(&un);

    if (!jsonl) {
        printf("bench-io: %s (%s), file %llu MiB, %.2f s x %d reps (+ warm-up), %s, %s buffers, commit %s, "
               "Linux %s\n\n",
               dir, fs, (unsigned long long)(size >> 20), secs, reps, buffered ? "buffered" : "O_DIRECT",
               fixed ? "registered" : "plain", commit, un.release);
        printf("| engine | pattern | block | QD | GB/s | ± sd | IOPS | direct | fixed bufs |\n");
        printf("| --- | --- | ---: | ---: | ---: | ---: | ---: | --- | --- |\n");
    }

    bool want_pattern[N_PATTERN] = {true, true, true, true};
    if (patterns)
        for (int p = 0; p < N_PATTERN; p++)
            want_pattern[p] = strstr(patterns, pattern_name[p]) != NULL;

    char eng_buf[64];
    snprintf(eng_buf, sizeof eng_buf, "%s", engines);
    for (char *eng = strtok(eng_buf, ","); eng; eng = strtok(NULL, ",")) {
        bool sync = strcmp(eng, "sync") == 0;
        if (!sync && strcmp(eng, "io_uring"))
            usage();
        struct bench b = {.max_bs = max_bs, .size = size};
        uint64_t slots = max_qd > FILL_QD ? max_qd : FILL_QD; /* fill_file uses FILL_QD slots */
        size_t region_len = (size_t)(slots * max_bs);
        b.region = tkv_io_alloc_aligned(region_len);
        struct tkv_io_region reg = {b.region, region_len};
        struct tkv_io_params p = tkv_io_default_params();
        p.queue_depth = (uint32_t)slots;
        p.flags = (buffered ? 0 : TKV_IO_DIRECT) | (sync ? TKV_IO_FORCE_SYNC : 0);
        p.regions = fixed ? &reg : NULL;
        p.n_regions = fixed ? 1 : 0;
        int r;
        if (!b.region || (r = tkv_io_init(&p, &b.io)) < 0) {
            fprintf(stderr, "bench-io: engine init failed\n");
            return 1;
        }
        struct tkv_io_info info;
        tkv_io_get_info(b.io, &info);
        if (strcmp(info.engine, eng)) {
            fprintf(stderr, "bench-io: %s unavailable here (got %s): skipped\n", eng, info.engine);
            tkv_io_free(b.io);
            tkv_io_free_aligned(b.region);
            continue;
        }
        if ((r = tkv_io_file_open_tmp(b.io, dir, &b.f)) < 0 || (r = tkv_io_file_resize(b.f, size)) < 0) {
            tkv_io_status(r, dir);
            fprintf(stderr, "bench-io: %s\n", tkv_last_error());
            return 1;
        }
        if (fill_file(&b) < 0) {
            fprintf(stderr, "bench-io: filling the file: %s\n", tkv_last_error());
            return 1;
        }
        for (int pi = 0; pi < N_PATTERN; pi++) {
            if (!want_pattern[pi])
                continue;
            for (int bi = 0; bi < n_bs; bi++) {
                for (int qi = 0; qi < n_qd; qi++) {
                    uint64_t bs = bss[bi];
                    uint32_t qd = (uint32_t)qds[qi];
                    double v[64], sum = 0, sq = 0;
                    int n = reps < 64 ? reps : 64;
                    if (run_case(&b, (enum pattern)pi, bs, qd, secs / 4) < 0) /* warm-up */
                        return fprintf(stderr, "bench-io: %s\n", tkv_last_error()), 1;
                    for (int k = 0; k < n; k++) {
                        v[k] = run_case(&b, (enum pattern)pi, bs, qd, secs);
                        if (v[k] < 0)
                            return fprintf(stderr, "bench-io: %s\n", tkv_last_error()), 1;
                        sum += v[k];
                    }
                    double iops = sum / n;
                    for (int k = 0; k < n; k++)
                        sq += (v[k] - iops) * (v[k] - iops);
                    double sd = n > 1 ? sqrt(sq / (n - 1)) : 0, gbs = iops * (double)bs / 1e9,
                           gbs_sd = sd * (double)bs / 1e9;
                    tkv_io_get_info(b.io, &info);
                    bool is_fixed = info.fixed_buffers;
                    char bsz[32];
                    if (bs >= (1u << 20))
                        snprintf(bsz, sizeof bsz, "%llu MiB", (unsigned long long)(bs >> 20));
                    else
                        snprintf(bsz, sizeof bsz, "%llu KiB", (unsigned long long)(bs >> 10));
                    if (jsonl)
                        printf("{\"engine\":\"%s\",\"pattern\":\"%s\",\"block\":%llu,\"qd\":%u,\"gbps\":%.4f,"
                               "\"gbps_sd\":%.4f,\"iops\":%.0f,\"iops_sd\":%.0f,\"reps\":%d,\"seconds\":%.3f,"
                               "\"direct\":%s,\"fixed\":%s,\"dir\":\"%s\",\"fs\":\"%s\",\"file_mib\":%llu,"
                               "\"commit\":\"%s\"}\n",
                               info.engine, pattern_name[pi], (unsigned long long)bs, qd, gbs, gbs_sd, iops, sd, n,
                               secs, tkv_io_direct(b.f) ? "true" : "false", is_fixed ? "true" : "false", dir, fs,
                               (unsigned long long)(size >> 20), commit);
                    else
                        printf("| %s | %s | %s | %u | %.3f | %.3f | %.0f | %s | %s |\n", info.engine,
                               pattern_name[pi], bsz, qd, gbs, gbs_sd, iops, tkv_io_direct(b.f) ? "yes" : "no",
                               is_fixed ? "yes" : "no");
                    fflush(stdout);
                }
            }
        }
        tkv_io_file_close(b.f);
        tkv_io_free(b.io);
        tkv_io_free_aligned(b.region);
    }
    return 0;
}
