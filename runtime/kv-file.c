/*
 * kv-file.c -- saving a session's context to a file and restoring it.
 *
 * File layout (little-endian), version 1:
 *
 *   header   magic "TKVKVSV1", u32 version, u32 header_bytes,
 *            u32 model_fingerprint, u32 n_layer, n_head_kv, head_dim,
 *            block_tokens, n_vocab, n_tokens, n_blocks (per head),
 *            block_bytes, u32 header_crc (CRC-32C of everything before it)
 *   tokens   i32[n_tokens], u32 crc
 *   logits   f32[n_vocab] (the logits after the last token), u32 crc
 *   crcs     u32[n_layer * n_head_kv * n_blocks], u32 crc of this table
 *   blocks   the payloads, layer-major then head then block, block_bytes each
 *
 * Loading reads the whole file twice: the first pass verifies everything
 * (structure, model, sizes, every checksum) and the second installs it, so a
 * bad file changes nothing in the session. The second pass hands the store a
 * run of a (layer, head)'s blocks at a time (tkv_kvs_import_n: one eviction
 * pass per run, not one per 32 blocks, under a capped compute tier).
 */
#include "session.h"

#include "../tiers/crc32c.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>

#define KV_MAGIC "TKVKVSV1"
#define KV_VERSION 1u

struct kv_header {
    char     magic[8];
    uint32_t version, header_bytes, fingerprint;
    uint32_t n_layer, n_head_kv, head_dim, block_tokens, n_vocab, n_tokens, n_blocks, block_bytes;
    uint32_t header_crc;
};

/* Identifies the model: tensor names, types, shapes and offsets, plus the
 * first and last 4 KiB of every tensor's data (tells apart fine-tunes that
 * share a layout). */
static uint32_t model_fingerprint(const tkv_model *m)
{
    uint32_t crc = 0;
    for (size_t i = 0; i < tkv_gguf_n_tensors(m->gguf); i++) {
        const struct tkv_gguf_tensor *t = tkv_gguf_tensor_at(m->gguf, i);
        crc = tkv_crc32c(crc, t->name, strlen(t->name));
        crc = tkv_crc32c(crc, &t->type, sizeof t->type);
        crc = tkv_crc32c(crc, t->ne, sizeof t->ne);
        crc = tkv_crc32c(crc, &t->file_offset, sizeof t->file_offset);
        size_t edge = TKV_MIN(t->nbytes, (uint64_t)4096);
        crc = tkv_crc32c(crc, t->data, edge);
        crc = tkv_crc32c(crc, (const uint8_t *)t->data + t->nbytes - edge, edge);
    }
    return crc;
}

static tkv_status write_all(FILE *f, const void *p, size_t n, const char *path)
{
    if (n && fwrite(p, 1, n, f) != n)
        return tkv_err(TKV_ERR_IO, "save-kv: writing '%s': %s", path, strerror(errno));
    return TKV_OK;
}

static tkv_status write_crc(FILE *f, const void *p, size_t n, const char *path)
{
    TKV_TRY(write_all(f, p, n, path));
    uint32_t crc = tkv_crc32c(0, p, n);
    return write_all(f, &crc, sizeof crc, path);
}

static uint32_t blocks_per_head(const tkv_session *s)
{
    return (s->n_past + s->kv_block - 1) / s->kv_block;
}

tkv_status tkv_session_save(tkv_session *s, const char *path)
{
    if (!s || !path)
        return tkv_err(TKV_ERR_INVALID_ARG, "tkv_session_save: NULL argument");
    if (!s->have_logits)
        return tkv_err(TKV_ERR_INVALID_ARG, "save-kv: the session has no context to save (prefill first)");
    const uint32_t L = s->hp.n_layer, H = s->hp.n_head_kv, nb = blocks_per_head(s), S = tkv_kvs_block_bytes(s->kv);
    struct kv_header h = {.version = KV_VERSION, .header_bytes = sizeof h, .fingerprint = model_fingerprint(s->model),
                          .n_layer = L, .n_head_kv = H, .head_dim = s->hp.head_dim, .block_tokens = s->kv_block,
                          .n_vocab = s->hp.n_vocab, .n_tokens = s->n_past, .n_blocks = nb, .block_bytes = S};
    memcpy(h.magic, KV_MAGIC, 8);
    h.header_crc = tkv_crc32c(0, &h, offsetof(struct kv_header, header_crc));

    const size_t n_blk = (size_t)L * H * nb;
    uint32_t *crcs = malloc((n_blk + 1) * sizeof *crcs);
    uint8_t *payload = malloc(S);
    char tmp_path[4096];
    snprintf(tmp_path, sizeof tmp_path, "%s.tmp", path);
    FILE *f = NULL;
    tkv_status st = TKV_OK;
    if (!crcs || !payload) {
        st = tkv_err(TKV_ERR_NOMEM, "save-kv: out of memory");
        goto out;
    }
    /* written to PATH.tmp and renamed: a failed save never leaves a torn file */
    if (!(f = fopen(tmp_path, "wb"))) {
        st = tkv_err(TKV_ERR_IO, "save-kv: cannot create '%s': %s", tmp_path, strerror(errno));
        goto out;
    }
    if ((st = write_all(f, &h, sizeof h, path)) != TKV_OK ||
        (st = write_crc(f, s->tokens, (size_t)s->n_past * sizeof(tkv_token), path)) != TKV_OK ||
        (st = write_crc(f, s->logits, (size_t)s->hp.n_vocab * sizeof(float), path)) != TKV_OK)
        goto out;
    /* the checksum table precedes the payloads: leave room for it, write
     * each block once (checksumming it on the way), then fill the table in */
    const long table_at = ftell(f);
    memset(crcs, 0, (n_blk + 1) * sizeof *crcs);
    if (table_at < 0 || (st = write_all(f, crcs, (n_blk + 1) * sizeof *crcs, path)) != TKV_OK) {
        st = st != TKV_OK ? st : tkv_err(TKV_ERR_IO, "save-kv: '%s': %s", path, strerror(errno));
        goto out;
    }
    for (uint32_t l = 0, j = 0; l < L; l++)
        for (uint32_t hh = 0; hh < H; hh++)
            for (uint32_t b = 0; b < nb; b++, j++) {
                if ((st = tkv_kvs_export(s->kv, l, hh, b, payload)) != TKV_OK ||
                    (st = write_all(f, payload, S, path)) != TKV_OK)
                    goto out;
                crcs[j] = tkv_crc32c(0, payload, S);
            }
    if (fseek(f, table_at, SEEK_SET) != 0 || (st = write_crc(f, crcs, n_blk * sizeof *crcs, path)) != TKV_OK) {
        st = st != TKV_OK ? st : tkv_err(TKV_ERR_IO, "save-kv: seeking in '%s': %s", path, strerror(errno));
        goto out;
    }
    if (fflush(f) != 0 || ferror(f)) {
        st = tkv_err(TKV_ERR_IO, "save-kv: writing '%s': %s", path, strerror(errno));
        goto out;
    }
    int rc = fclose(f);
    f = NULL;
    if (rc != 0 || rename(tmp_path, path) != 0)
        st = tkv_err(TKV_ERR_IO, "save-kv: finishing '%s': %s", path, strerror(errno));
out:
    if (f)
        fclose(f);
    if (st != TKV_OK)
        remove(tmp_path);
    free(crcs);
    free(payload);
    return st;
}

/* ---- load ------------------------------------------------------------------- */

static tkv_status read_exact(FILE *f, void *p, size_t n, const char *path, const char *what)
{
    if (n && fread(p, 1, n, f) != n)
        return tkv_err(ferror(f) ? TKV_ERR_IO : TKV_ERR_FORMAT, "load-kv: '%s' is truncated in the %s", path, what);
    return TKV_OK;
}

/* Reads n bytes plus their CRC and checks it. */
static tkv_status read_checked(FILE *f, void *p, size_t n, const char *path, const char *what)
{
    uint32_t crc;
    TKV_TRY(read_exact(f, p, n, path, what));
    TKV_TRY(read_exact(f, &crc, sizeof crc, path, what));
    if (crc != tkv_crc32c(0, p, n))
        return tkv_err(TKV_ERR_CORRUPT, "load-kv: '%s': checksum mismatch in the %s", path, what);
    return TKV_OK;
}

tkv_status tkv_session_load(tkv_session *s, const char *path)
{
    if (!s || !path)
        return tkv_err(TKV_ERR_INVALID_ARG, "tkv_session_load: NULL argument");
    FILE *f = fopen(path, "rb");
    if (!f)
        return tkv_err(TKV_ERR_IO, "load-kv: cannot open '%s': %s", path, strerror(errno));
    struct kv_header h;
    uint32_t *crcs = NULL;
    tkv_token *toks = NULL;
    float *logits = NULL;
    uint8_t *payload = NULL; /* [run][S]: pass 1 checks one block at a time, pass 2 installs runs */
    const void **srcs = NULL; /* [run] */
    tkv_status st = read_exact(f, &h, sizeof h, path, "header");
    if (st != TKV_OK)
        goto out;
    if (memcmp(h.magic, KV_MAGIC, 8) != 0) {
        st = tkv_err(TKV_ERR_FORMAT, "load-kv: '%s' is not a tierkv KV file (bad magic)", path);
        goto out;
    }
    if (h.header_crc != tkv_crc32c(0, &h, offsetof(struct kv_header, header_crc))) {
        st = tkv_err(TKV_ERR_CORRUPT, "load-kv: '%s': header checksum mismatch", path);
        goto out;
    }
    if (h.version != KV_VERSION || h.header_bytes != sizeof h) {
        st = tkv_err(TKV_ERR_UNSUPPORTED, "load-kv: '%s' is version %u; this build reads version %u", path, h.version,
                     KV_VERSION);
        goto out;
    }
    const uint32_t S = tkv_kvs_block_bytes(s->kv);
    if (h.fingerprint != model_fingerprint(s->model) || h.n_layer != s->hp.n_layer || h.n_head_kv != s->hp.n_head_kv ||
        h.head_dim != s->hp.head_dim || h.n_vocab != s->hp.n_vocab) {
        st = tkv_err(TKV_ERR_UNSUPPORTED, "load-kv: '%s' was saved from a different model", path);
        goto out;
    }
    if (h.block_tokens != s->kv_block || h.block_bytes != S) {
        st = tkv_err(TKV_ERR_UNSUPPORTED, "load-kv: '%s' uses KV blocks of %u tokens; this session uses %u", path,
                     h.block_tokens, s->kv_block);
        goto out;
    }
    if (h.n_tokens == 0 || h.n_tokens > s->n_ctx || h.n_blocks != (h.n_tokens + h.block_tokens - 1) / h.block_tokens) {
        st = tkv_err(h.n_tokens > s->n_ctx ? TKV_ERR_CONTEXT_FULL : TKV_ERR_FORMAT,
                     "load-kv: '%s' holds %u tokens in %u blocks; the session's context is %u", path, h.n_tokens,
                     h.n_blocks, s->n_ctx);
        goto out;
    }
    const size_t n_blk = (size_t)h.n_layer * h.n_head_kv * h.n_blocks;
    /* blocks per import_n call (the store's run size) */
    const uint32_t run = tkv_kvs_import_run(s->kv, h.n_blocks);
    toks = malloc((size_t)h.n_tokens * sizeof *toks);
    logits = malloc((size_t)h.n_vocab * sizeof *logits);
    crcs = malloc(n_blk * sizeof *crcs);
    payload = malloc((size_t)run * S);
    srcs = malloc((size_t)run * sizeof *srcs);
    if (!toks || !logits || !crcs || !payload || !srcs) {
        st = tkv_err(TKV_ERR_NOMEM, "load-kv: out of memory");
        goto out;
    }
    if ((st = read_checked(f, toks, (size_t)h.n_tokens * sizeof *toks, path, "token ids")) != TKV_OK ||
        (st = read_checked(f, logits, (size_t)h.n_vocab * sizeof *logits, path, "logits")) != TKV_OK ||
        (st = read_checked(f, crcs, n_blk * sizeof *crcs, path, "block checksum table")) != TKV_OK)
        goto out;
    for (uint32_t i = 0; i < h.n_tokens; i++)
        if (toks[i] < 0 || (uint32_t)toks[i] >= h.n_vocab) {
            st = tkv_err(TKV_ERR_FORMAT, "load-kv: '%s': token %u (%d) is outside the vocabulary", path, i, toks[i]);
            goto out;
        }
    const long data_start = ftell(f);
    /* pass 1: every block's checksum, and nothing after the last block */
    for (size_t j = 0; j < n_blk; j++) {
        if ((st = read_exact(f, payload, S, path, "KV blocks")) != TKV_OK)
            goto out;
        if (tkv_crc32c(0, payload, S) != crcs[j]) {
            size_t b = j % h.n_blocks, hh = j / h.n_blocks % h.n_head_kv, l = j / h.n_blocks / h.n_head_kv;
            st = tkv_err(TKV_ERR_CORRUPT, "load-kv: '%s': block (layer %zu, head %zu, block %zu) failed its checksum",
                         path, l, hh, b);
            goto out;
        }
    }
    if (fgetc(f) != EOF) {
        st = tkv_err(TKV_ERR_FORMAT, "load-kv: '%s' has trailing bytes after the last block", path);
        goto out;
    }
    /* pass 2: install. From here on a failure leaves the session empty. */
    if (fseek(f, data_start, SEEK_SET) != 0) {
        st = tkv_err(TKV_ERR_IO, "load-kv: seeking in '%s': %s", path, strerror(errno));
        goto out;
    }
    tkv_session_reset(s);
    if ((st = tkv_kvs_reserve(s->kv, h.n_tokens)) != TKV_OK)
        goto out;
    tkv_kvs_set_length(s->kv, h.n_tokens);
    /* the reset left every block empty: import_n's one-pass path */
    for (uint32_t l = 0, j = 0; l < h.n_layer; l++)
        for (uint32_t hh = 0; hh < h.n_head_kv; hh++)
            for (uint32_t b0 = 0; b0 < h.n_blocks; b0 += run) {
                const uint32_t n = TKV_MIN(run, h.n_blocks - b0);
                if ((st = read_exact(f, payload, (size_t)n * S, path, "KV blocks")) != TKV_OK)
                    goto fail_installed;
                for (uint32_t r = 0; r < n; r++, j++) {
                    srcs[r] = payload + (size_t)r * S;
                    if (tkv_crc32c(0, srcs[r], S) != crcs[j]) { /* changed since pass 1 */
                        st = tkv_err(TKV_ERR_CORRUPT, "load-kv: '%s' changed while being read", path);
                        goto fail_installed;
                    }
                }
                if ((st = tkv_kvs_import_n(s->kv, l, hh, b0, n, srcs)) != TKV_OK)
                    goto fail_installed;
            }
    memcpy(s->tokens, toks, (size_t)h.n_tokens * sizeof *toks);
    memcpy(s->logits, logits, (size_t)h.n_vocab * sizeof *logits);
    s->n_past = h.n_tokens;
    s->have_logits = true;
    goto out;
fail_installed:
    tkv_session_reset(s);
out:
    fclose(f);
    free(toks);
    free(logits);
    free(crcs);
    free(payload);
    free(srcs);
    return st;
}

/* ---- fork ---------------------------------------------------------------------- */

tkv_status tkv_session_fork(const tkv_session *src, const struct tkv_session_params *params, tkv_session **out)
{
    if (!out)
        return tkv_err(TKV_ERR_INVALID_ARG, "tkv_session_fork: out is NULL");
    *out = NULL;
    if (!src || !params)
        return tkv_err(TKV_ERR_INVALID_ARG, "tkv_session_fork: NULL argument");
    if (!src->have_logits)
        return tkv_err(TKV_ERR_INVALID_ARG, "fork: the source session has no context (prefill first)");
    if (strcmp(src->policy->ops->name, "full") != 0)
        return tkv_err(TKV_ERR_INVALID_ARG, "fork: the source session must use the 'full' policy, not '%s'",
                       src->policy->ops->name);
    struct tkv_session_params p = *params;
    if (p.n_ctx == 0)
        p.n_ctx = src->n_ctx;
    if (p.kv_block == 0)
        p.kv_block = src->kv_block;
    if (p.kv_block != src->kv_block || p.n_ctx < src->n_past)
        return tkv_err(TKV_ERR_INVALID_ARG, "fork: the copy needs blocks of %u tokens and room for %u tokens",
                       src->kv_block, src->n_past);
    tkv_session *s;
    TKV_TRY(tkv_session_init(src->model, &p, &s));
    if (s->policy->ops->changes_prefill &&
        !(s->policy->ops->prefill_dense && s->policy->ops->prefill_dense(s->policy->state, src->n_past))) {
        tkv_status e = tkv_err(TKV_ERR_UNSUPPORTED,
                               "fork: policy '%s' changes the prefill itself; prefill with it instead",
                               s->policy->ops->name);
        tkv_session_free(s);
        return e;
    }
    tkv_session *mut = (tkv_session *)src; /* export only drains I/O; the context is unchanged */
    const uint32_t L = s->hp.n_layer, H = s->hp.n_head_kv, nb = blocks_per_head(src);
    const uint32_t S = tkv_kvs_block_bytes(s->kv);
    /* blocks per import_n call (the store's run size); the new session's
     * blocks are empty, so each run takes the store's one-pass path */
    const uint32_t run = tkv_kvs_import_run(s->kv, nb);
    uint8_t *payload = malloc((size_t)run * S);
    const void **srcs = malloc((size_t)run * sizeof *srcs);
    tkv_status st =
        payload && srcs ? tkv_kvs_reserve(s->kv, src->n_past) : tkv_err(TKV_ERR_NOMEM, "fork: out of memory");
    if (st == TKV_OK) {
        tkv_kvs_set_length(s->kv, src->n_past);
        for (uint32_t l = 0; l < L && st == TKV_OK; l++)
            for (uint32_t h = 0; h < H && st == TKV_OK; h++)
                for (uint32_t b0 = 0; b0 < nb && st == TKV_OK; b0 += run) {
                    const uint32_t n = TKV_MIN(run, nb - b0);
                    for (uint32_t r = 0; r < n && st == TKV_OK; r++) {
                        srcs[r] = payload + (size_t)r * S;
                        st = tkv_kvs_export(mut->kv, l, h, b0 + r, payload + (size_t)r * S);
                    }
                    if (st == TKV_OK)
                        st = tkv_kvs_import_n(s->kv, l, h, b0, n, srcs);
                }
    }
    free(payload);
    free(srcs);
    if (st == TKV_OK) {
        memcpy(s->tokens, src->tokens, (size_t)src->n_past * sizeof *s->tokens);
        memcpy(s->logits, src->logits, (size_t)s->hp.n_vocab * sizeof *s->logits);
        s->n_past = src->n_past;
        s->have_logits = true;
        st = tkv_session_after_prefill(s, src);
    }
    if (st != TKV_OK) {
        tkv_session_free(s);
        return st;
    }
    *out = s;
    return TKV_OK;
}
