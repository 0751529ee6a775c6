/*
 * test-kv-synth.c -- the synthetic fill (runtime/kv-synth.h) under tier caps
 * and with a selecting policy, and the decode step counters bench-recall
 * reads. On the tiny model, CPU backend, a compute tier of 72 blocks (of 132)
 * with NVMe below (so most of the synthetic blocks spill through the store):
 *   - plain copies (gains 1) are the real blocks byte for byte;
 *   - moved copies match a double-precision reference of m + gain (k - m)
 *     (m: the mean real key of the head; gain: the hot or cold spread over
 *     the sd of the head's real logits, recomputed here in two passes),
 *     the last recent_blocks with the hot one, about 1 in hot_every hot, the
 *     values untouched;
 *   - blocks really land below the compute tier;
 *   - rabitq:p=1.0 (capped, recalling from NVMe) decodes the tokens of full
 *     (uncapped) on the same fill, and rabitq:p=0.1 reads less of it;
 *   - the counters: steps, phase times within the decode time, read shares.
 */
#include "runtime/kv-synth.h"
#include "runtime/session.h"
#include "tiny-model.h"

#include <math.h>

/* the compute tier holds one layer's blocks and a few more: CAP of the
 * 2 x 2 x 33 blocks */
enum { NCTX = 2048, BLK = 64, NREAL = 128, STEPS = 6, CAP = 72 };

static tkv_session *open_session(const tkv_model *m, const char *policy, bool capped)
{
    struct tkv_session_params sp = tkv_session_default_params();
    sp.n_ctx = NCTX + STEPS + 1;
    sp.n_threads = 1;
    sp.policy = policy;
    sp.kv_block = BLK;
    if (capped) {
        sp.host_kv_mem = (uint64_t)CAP * 4 * BLK * HD; /* blocks of 4 KiB */
        sp.nvme_dir = "/tmp";
    }
    tkv_session *s = NULL;
    tkv_status st = tkv_session_init(m, &sp, &s);
    CHECK(st == TKV_OK, "session '%s': %s", policy, tkv_last_error());
    return s;
}

static void make_prompt(tkv_token *toks)
{
    uint64_t r = 0x5eed;
    for (int i = 0; i < NCTX; i++)
        toks[i] = (tkv_token)(1 + test_rand_u64(&r) % (V - 2));
}

static void test_fill_values(const tkv_model *m, const tkv_token *toks)
{
    const uint32_t S = 4 * BLK * HD, nb = NCTX / BLK, nb_real = NREAL / BLK;
    uint16_t *blk = malloc(S), *real = malloc((size_t)nb_real * S);
    /* plain copies: the real blocks, byte for byte */
    tkv_session *s = open_session(m, "full", true);
    REQUIRE_VOID(s != NULL);
    uint32_t got_real = 0;
    CHECK(tkv_session_fill_synthetic(s, toks, NCTX, NREAL, &got_real) == TKV_OK, "%s", tkv_last_error());
    CHECK(got_real == NREAL, "%u real tokens", got_real);
    CHECK(tkv_session_n_past(s) == NCTX, "n_past %zu", tkv_session_n_past(s));
    uint32_t below = 0;
    for (uint32_t l = 0; l < L; l++)
        for (uint32_t h = 0; h < HKV; h++) {
            for (uint32_t b = 0; b < nb_real; b++)
                CHECK(tkv_kvs_export(s->kv, l, h, b, (uint8_t *)real + (size_t)b * S) == TKV_OK, "export");
            for (uint32_t b = nb_real; b < nb; b++) {
                below += tkv_kvs_block_tier(s->kv, l, h, b) != TKV_TIER_COMPUTE;
                CHECK(tkv_kvs_export(s->kv, l, h, b, blk) == TKV_OK, "export");
                CHECK(!memcmp(blk, (uint8_t *)real + (size_t)((b - nb_real) % nb_real) * S, S),
                      "plain copy (%u,%u,%u) differs from its real block", l, h, b);
            }
        }
    CHECK(below >= L * HKV * (nb - nb_real) - CAP, "only %u of the copies are below the %u-block compute tier", below, CAP);
    tkv_session_free(s);

    /* moved copies against the reference */
    struct tkv_synth_params p = tkv_synth_default_params();
    p.n_real = NREAL, p.hot_spread = 3.0f, p.cold_spread = 0.125f, p.hot_every = 3, p.recent_blocks = 2, p.seed = 7;
    s = open_session(m, "full", true);
    REQUIRE_VOID(s != NULL);
    struct tkv_synth_report rep;
    CHECK(tkv_session_fill_synthetic_ex(s, toks, NCTX, &p, &rep) == TKV_OK, "%s", tkv_last_error());
    CHECK(rep.n_real == NREAL && rep.copied_blocks == (uint64_t)L * HKV * (nb - nb_real), "report: %u real, %llu copies",
          rep.n_real, (unsigned long long)rep.copied_blocks);
    CHECK(s->obs_n > 0, "no observation window");
    double sd_sum = 0;
    uint32_t hot = 0, copies = 0, bad = 0;
    for (uint32_t l = 0; l < L; l++)
        for (uint32_t h = 0; h < HKV; h++) {
            double mean[HD] = {0};
            for (uint32_t b = 0; b < nb_real; b++) {
                CHECK(tkv_kvs_export(s->kv, l, h, b, (uint8_t *)real + (size_t)b * S) == TKV_OK, "export");
                for (uint32_t t = 0; t < BLK; t++)
                    for (uint32_t d = 0; d < HD; d++)
                        mean[d] += tkv_fp16_to_fp32(real[(size_t)b * S / 2 + t * HD + d]) / NREAL;
            }
            /* the reference sd: scale * q.(k - mean) over every real key and
             * window query of the head's group, two passes */
            const uint32_t G = H / HKV;
            double xs = 0, xn = 0, var = 0;
            for (int pass = 0; pass < 2; pass++)
                for (uint32_t i = 0; i < s->obs_n; i++)
                    for (uint32_t g = 0; g < G; g++)
                        for (uint32_t t = 0; t < NREAL; t++) {
                            const float *q = s->obs_q + ((size_t)l * OBS_QUERIES + i) * H * HD + (h * G + g) * HD;
                            const uint16_t *k = real + (size_t)(t / BLK) * S / 2 + (t % BLK) * HD;
                            double x = 0;
                            for (uint32_t d = 0; d < HD; d++)
                                x += q[d] * (tkv_fp16_to_fp32(k[d]) - mean[d]);
                            x /= sqrt((double)HD);
                            if (pass == 0)
                                xs += x, xn++;
                            else
                                var += (x - xs / xn) * (x - xs / xn) / xn;
                        }
            const double sd = sqrt(var), g_hot = 3.0 / sd, g_cold = 0.125 / sd;
            sd_sum += sd;
            CHECK(sd > 0, "layer %u head %u: sd %g", l, h, sd);
            for (uint32_t b = nb_real; b < nb; b++) {
                CHECK(tkv_kvs_export(s->kv, l, h, b, blk) == TKV_OK, "export");
                const uint16_t *src = real + (size_t)((b - nb_real) % nb_real) * S / 2;
                bool is_hot = true, is_cold = true;
                for (uint32_t i = 0; i < BLK * HD; i++) {
                    const double k = tkv_fp16_to_fp32(src[i]), mu = mean[i % HD], got = tkv_fp16_to_fp32(blk[i]);
                    const double want_hot = mu + g_hot * (k - mu), want_cold = mu + g_cold * (k - mu);
                    is_hot &= fabs(got - want_hot) <= 2e-3 * (1 + fabs(want_hot));
                    is_cold &= fabs(got - want_cold) <= 2e-3 * (1 + fabs(want_cold));
                }
                bad += !(is_hot || is_cold);
                CHECK(is_hot || is_cold, "moved copy (%u,%u,%u) is neither hot nor cold", l, h, b);
                CHECK(!memcmp(blk + BLK * HD, src + BLK * HD, (size_t)BLK * HD * 2), "values of (%u,%u,%u) changed",
                      l, h, b);
                if (b + p.recent_blocks >= nb)
                    CHECK(is_hot, "recent block (%u,%u,%u) is not hot", l, h, b);
                hot += is_hot && b + p.recent_blocks < nb;
                copies += b + p.recent_blocks < nb;
            }
        }
    /* about one in three: 116 candidates, binomial sd ~5 */
    CHECK(hot + 20 >= copies / 3 && hot <= copies / 3 + 20, "%u of %u copies hot (1 in 3 expected)", hot, copies);
    CHECK(bad == 0, "%u blocks off the reference", bad);
    CHECK(fabs(rep.natural_sd - sd_sum / (L * HKV)) <= 1e-6 * (1 + sd_sum), "reported sd %g, reference %g",
          rep.natural_sd, sd_sum / (L * HKV));
    CHECK(rep.hot_blocks == (uint64_t)hot + (uint64_t)L * HKV * p.recent_blocks, "reported %llu hot blocks, found %u",
          (unsigned long long)rep.hot_blocks, hot);
    tkv_session_free(s);
    free(blk), free(real);
}

/* Runs STEPS greedy steps after the fill; tokens into out, counters of the steps into c. */
static void decode_run(const tkv_model *m, const char *policy, bool capped, const tkv_token *toks, tkv_token *out,
                       struct tkv_step_counters *c)
{
    *c = (struct tkv_step_counters){0};
    tkv_session *s = open_session(m, policy, capped);
    REQUIRE_VOID(s != NULL);
    struct tkv_synth_params p = tkv_synth_default_params();
    p.n_real = NREAL, p.hot_spread = 4.0f, p.cold_spread = 0.25f, p.hot_every = 8, p.recent_blocks = 1;
    CHECK(tkv_session_fill_synthetic_ex(s, toks, NCTX, &p, NULL) == TKV_OK, "%s", tkv_last_error());
    tkv_token tok = tkv_argmax(tkv_logits(s), V);
    struct tkv_step_counters c0;
    tkv_session_step_counters(s, &c0);
    tkv_session_set_phase_sync(s, true);
    for (int i = 0; i < STEPS; i++) {
        CHECK(tkv_decode(s, tok) == TKV_OK, "decode '%s': %s", policy, tkv_last_error());
        out[i] = tok = tkv_argmax(tkv_logits(s), V);
    }
    struct tkv_step_counters c1;
    tkv_session_step_counters(s, &c1);
    tkv_step_counters_since(&c1, &c0, c);
    tkv_session_free(s);
}

static void test_decode(const tkv_model *m, const tkv_token *toks)
{
    tkv_token t_full[STEPS], t_p1[STEPS], t_p01[STEPS];
    struct tkv_step_counters c_full, c_p1, c_p01;
    decode_run(m, "full", false, toks, t_full, &c_full);
    decode_run(m, "rabitq:p=1.0,dense=0,sink=16,recent=16", true, toks, t_p1, &c_p1);
    decode_run(m, "rabitq:p=0.1,dense=0,sink=16,recent=16,safe=0", true, toks, t_p01, &c_p01);
    CHECK(!memcmp(t_full, t_p1, sizeof t_full), "rabitq:p=1.0 under the cap decodes other tokens than full");
    const struct tkv_step_counters *cs[] = {&c_full, &c_p1, &c_p01};
    for (int i = 0; i < 3; i++) {
        const struct tkv_step_counters *c = cs[i];
        CHECK(c->decode_steps == STEPS, "%llu steps", (unsigned long long)c->decode_steps);
        const double phases = c->select_s + c->attn_s + c->cpu_attn_s + c->store_s;
        CHECK(c->attn_s > 0 && phases <= c->decode_s * 1.0001 + 1e-6, "phases %.6f s of a decode time of %.6f s",
              phases, c->decode_s);
    }
    CHECK(c_full.select_s == 0 && c_full.read_count == 0, "full selected (%.6f s, %llu reads)", c_full.select_s,
          (unsigned long long)c_full.read_count);
    CHECK(c_p1.select_s > 0 && c_p1.read_count == (uint64_t)STEPS * L * HKV, "rabitq: select %.6f s, %llu reads",
          c_p1.select_s, (unsigned long long)c_p1.read_count);
    const double share1 = c_p1.read_tokens / c_p1.read_count, share01 = c_p01.read_tokens / c_p01.read_count;
    CHECK(share1 > 0.99 && share1 <= 1.0, "p=1.0 read %.4f of the tokens", share1);
    CHECK(share01 > 0 && share01 < share1, "p=0.1 read %.4f of the tokens (p=1.0: %.4f)", share01, share1);
    /* a layer's largest head share: one per (step, layer), between the
     * mean share and 1 */
    const struct tkv_step_counters *sel[] = {&c_p1, &c_p01};
    for (int i = 0; i < 2; i++) {
        const struct tkv_step_counters *c = sel[i];
        const double mean = c->read_tokens / c->read_count, hmax = c->read_tokens_max / c->read_layers;
        CHECK(c->read_layers == (uint64_t)STEPS * L && hmax >= mean - 1e-12 && hmax <= 1.0 + 1e-12,
              "head max %.4f over %llu layers, mean share %.4f", hmax, (unsigned long long)c->read_layers, mean);
    }
    CHECK(c_full.read_layers == 0, "full: %llu layers read", (unsigned long long)c_full.read_layers);
    CHECK(c_p1.recall_bytes > 0, "nothing was recalled under the cap");
}

int main(void)
{
    rng = test_seed();
    tkv_model *m = tiny_model_load(TKV_TYPE_F32);
    REQUIRE(m != NULL, "model: %s", tkv_last_error());
    tkv_token toks[NCTX];
    make_prompt(toks);
    test_fill_values(m, toks);
    test_decode(m, toks);
    tkv_model_free(m);
    return test_done();
}
