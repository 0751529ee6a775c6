/*
 * test-fuse.c -- Description: the engine's use of the backend's optional
 * fused decode ops (matmul_group, matmul_swiglu, add_rmsnorm, rope_qk,
 * matmul_add, matmul_qkv_rope; runtime/backend.h) on the CPU. A test
 * backend is the CPU backend with the first four members added ("fused";
 * "fused-add" has the last two too: the residual adds move into the wo and
 * down products, and q/k/v and their rotation are one call), each running
 * the plain op sequence it stands for (so the fused
 * path must give the plain path's logits bit for bit, and any wrong buffer,
 * weight or skipped norm in the engine's fused wiring shows): sessions on
 * the tiny model (prefill in chunks, then decode) on "cpu", on both fused
 * backends, and on "fused" with TKV_FUSE=0, compared, and the fused ops'
 * calls counted per step. The kernels themselves are checked
 * against the plain sequence by tests/test-gpu-backend.c on a GPU.
 */
#include "runtime/backend.h"
#include "runtime/tierkv.h"
#include "test.h"
#include "tiny-model.h"

#include <stdlib.h>
#include <string.h>

static const struct tkv_backend_ops *cpu_ops; /* the CPU backend's own table */
static struct tkv_backend_ops fused_ops;
static uint64_t n_group, n_swiglu, n_add_norm, n_rope, n_matmul_add;

static tkv_status f_matmul_group(struct tkv_backend *b, const struct tkv_bweight *const *w, uint32_t nw,
                                 const float *x, float *const *y, uint32_t n)
{
    n_group++;
    CHECK(nw >= 1 && nw <= TKV_MATMUL_GROUP_MAX, "matmul_group of %u weights", nw);
    for (uint32_t i = 0; i < nw; i++)
        TKV_TRY(cpu_ops->matmul(b, w[i], x, y[i], n));
    return TKV_OK;
}

/* The gate product in out, the up product in a scratch buffer of its own
 * (the engine's s->up is not handed to the fused op). */
static tkv_status f_matmul_swiglu(struct tkv_backend *b, const struct tkv_bweight *wg, const struct tkv_bweight *wu,
                                  const float *x, float *out, uint32_t n)
{
    n_swiglu++;
    const size_t count = (size_t)n * F; /* the tiny model's n_ff: the weights are opaque here */
    float *up = malloc(count * sizeof *up);
    if (!up)
        return tkv_err(TKV_ERR_NOMEM, "test: out of memory");
    tkv_status st = cpu_ops->matmul(b, wg, x, out, n);
    if (st == TKV_OK)
        st = cpu_ops->matmul(b, wu, x, up, n);
    if (st == TKV_OK)
        st = cpu_ops->swiglu(b, out, up, out, count);
    free(up);
    return st;
}

static tkv_status f_add_rmsnorm(struct tkv_backend *b, float *y, const float *x, const struct tkv_bweight *w, float *h,
                                uint32_t n, uint32_t dim, float eps)
{
    n_add_norm++;
    TKV_TRY(cpu_ops->add(b, y, x, (size_t)n * dim));
    return cpu_ops->rmsnorm(b, y, w, h, n, dim, eps);
}

/* The product in a scratch buffer, then the add. */
static tkv_status f_matmul_add(struct tkv_backend *b, const struct tkv_bweight *w, const float *x, float *y, uint32_t n)
{
    n_matmul_add++;
    const size_t count = (size_t)n * E; /* wo and down: n_out = n_embd (the weights are opaque here) */
    float *p = malloc(count * sizeof *p);
    if (!p)
        return tkv_err(TKV_ERR_NOMEM, "test: out of memory");
    tkv_status st = cpu_ops->matmul(b, w, x, p, n);
    if (st == TKV_OK)
        st = cpu_ops->add(b, y, p, count);
    free(p);
    return st;
}

static tkv_status f_rope_qk(struct tkv_backend *b, float *q, float *k, uint32_t n, uint32_t n_head, uint32_t n_head_kv,
                            uint32_t head_dim, uint32_t rot_dim, const int32_t *pos, float base, float freq_scale)
{
    n_rope++;
    TKV_TRY(cpu_ops->rope(b, q, n, n_head, head_dim, rot_dim, pos, base, freq_scale));
    return cpu_ops->rope(b, k, n, n_head_kv, head_dim, rot_dim, pos, base, freq_scale);
}

/* The group, then rope_qk (counted as one call of each). */
static tkv_status f_matmul_qkv_rope(struct tkv_backend *b, const struct tkv_bweight *const *w, const float *x,
                                    float *q, float *k, float *v, uint32_t n, uint32_t head_dim, uint32_t rot_dim,
                                    const int32_t *pos, float base, float freq_scale)
{
    float *y[3] = {q, k, v};
    TKV_TRY(f_matmul_group(b, w, 3, x, y, n));
    return f_rope_qk(b, q, k, n, H, HKV, head_dim, rot_dim, pos, base, freq_scale);
}

/* "fused": a CPU backend whose table has the fused members (its own
 * functions still receive the CPU backend itself). */
static tkv_status fused_create(const char *device, uint32_t n_threads, struct tkv_backend **out)
{
    *out = NULL;
    const bool add = !strcmp(device, "fused-add");
    if (strcmp(device, "fused") && !add)
        return TKV_ERR_UNSUPPORTED;
    struct tkv_backend *be;
    TKV_TRY(tkv_backend_create("cpu", n_threads, &be));
    cpu_ops = be->ops;
    fused_ops = *be->ops;
    fused_ops.name = add ? "fused-add" : "fused";
    fused_ops.matmul_group = f_matmul_group;
    fused_ops.matmul_swiglu = f_matmul_swiglu;
    fused_ops.add_rmsnorm = f_add_rmsnorm;
    fused_ops.rope_qk = f_rope_qk;
    fused_ops.matmul_add = add ? f_matmul_add : NULL;
    fused_ops.matmul_qkv_rope = add ? f_matmul_qkv_rope : NULL;
    be->ops = &fused_ops;
    *out = be;
    return TKV_OK;
}

enum { NP = 21, NG = 6, CHUNK = 8 };

struct run {
    float logits[(NG + 1) * V];
    uint64_t group, swiglu, add_norm, rope, matmul_add; /* fused calls during the decode steps */
};

static void run_session(tkv_model *m, const char *device, const tkv_token *prompt, struct run *out)
{
    struct tkv_session_params sp = tkv_session_default_params();
    sp.n_threads = 1;
    sp.n_ctx = CTX;
    sp.kv_block = 8;
    sp.prefill_chunk = CHUNK; /* 21 tokens: chunks of 8, 8, 5 */
    sp.device = device;
    tkv_session *s = NULL;
    memset(out, 0, sizeof *out);
    REQUIRE_VOID(tkv_session_init(m, &sp, &s) == TKV_OK);
    CHECK(tkv_prefill(s, prompt, NP) == TKV_OK, "%s: prefill: %s", device, tkv_last_error());
    n_group = n_swiglu = n_add_norm = n_rope = n_matmul_add = 0;
    for (uint32_t i = 0; i <= NG; i++) {
        const float *lg = tkv_logits(s);
        CHECK(lg != NULL, "%s: no logits at step %u", device, i);
        if (!lg)
            break;
        memcpy(out->logits + (size_t)i * V, lg, V * sizeof(float));
        if (i == NG)
            break;
        tkv_token t = tkv_argmax(lg, V);
        CHECK(tkv_decode(s, t ? t : 1) == TKV_OK, "%s: decode: %s", device, tkv_last_error());
    }
    out->group = n_group, out->swiglu = n_swiglu, out->add_norm = n_add_norm, out->rope = n_rope;
    out->matmul_add = n_matmul_add;
    tkv_session_free(s);
}

int main(void)
{
    rng = test_seed();
    tkv_model *m = tiny_model_load(TKV_TYPE_F32);
    REQUIRE(m != NULL, "model: %s", tkv_last_error());
    tkv_backend_set_test_factory(fused_create);
    tkv_token prompt[NP];
    for (int i = 0; i < NP; i++)
        prompt[i] = (tkv_token)(1 + test_rand_u64(&rng) % (V - 2));
    static struct run plain, fused, fused_add, off;
    unsetenv("TKV_FUSE");
    run_session(m, "cpu", prompt, &plain);
    run_session(m, "fused", prompt, &fused);
    run_session(m, "fused-add", prompt, &fused_add);
    setenv("TKV_FUSE", "0", 1);
    run_session(m, "fused", prompt, &off);
    unsetenv("TKV_FUSE");
    tkv_backend_set_test_factory(NULL);

    CHECK(!memcmp(fused.logits, plain.logits, sizeof plain.logits),
          "fused ops (each the plain sequence): logits differ from the CPU backend's");
    CHECK(!memcmp(fused_add.logits, plain.logits, sizeof plain.logits),
          "fused ops with matmul_add (each the plain sequence): logits differ from the CPU backend's");
    CHECK(!memcmp(off.logits, plain.logits, sizeof plain.logits), "TKV_FUSE=0: logits differ from the CPU backend's");
    /* a decode step per layer: one group (q, k, v), one rope_qk, one
     * matmul_swiglu, and two add+norms (ffn_norm; the next layer's
     * attn_norm, or the output norm after the last layer) */
    CHECK(fused.group == (uint64_t)NG * L && fused.rope == (uint64_t)NG * L && fused.swiglu == (uint64_t)NG * L,
          "fused calls in %d steps: group %llu rope_qk %llu swiglu %llu (want %d each)", NG,
          (unsigned long long)fused.group, (unsigned long long)fused.rope, (unsigned long long)fused.swiglu, NG * L);
    CHECK(fused.add_norm == (uint64_t)NG * 2 * L, "add_rmsnorm calls in %d steps: %llu (want %d)", NG,
          (unsigned long long)fused.add_norm, NG * 2 * L);
    CHECK(fused.matmul_add == 0, "matmul_add called where the backend has none");
    /* with matmul_add: wo and down add into the residual, and the norms
     * after them are plain rmsnorm calls */
    CHECK(fused_add.matmul_add == (uint64_t)NG * 2 * L && fused_add.add_norm == 0 &&
              fused_add.group == (uint64_t)NG * L && fused_add.swiglu == (uint64_t)NG * L,
          "fused-add calls in %d steps: matmul_add %llu (want %d), add_rmsnorm %llu (want 0), group %llu, swiglu %llu",
          NG, (unsigned long long)fused_add.matmul_add, NG * 2 * L, (unsigned long long)fused_add.add_norm,
          (unsigned long long)fused_add.group, (unsigned long long)fused_add.swiglu);
    CHECK(off.group + off.rope + off.swiglu + off.add_norm + off.matmul_add == 0, "TKV_FUSE=0 still called fused ops");
    fprintf(stderr, "fused vs plain: %d logits (prefill, %d decode steps) bit-identical: %s; per step %llu "
                    "group, %llu rope_qk, %llu swiglu, %llu add_rmsnorm calls\n",
            (NG + 1) * V, NG, memcmp(fused.logits, plain.logits, sizeof plain.logits) ? "NO" : "yes",
            (unsigned long long)fused.group / NG, (unsigned long long)fused.rope / NG,
            (unsigned long long)fused.swiglu / NG, (unsigned long long)fused.add_norm / NG);
    tkv_model_free(m);
    return test_done();
}
