/*
 * test-quant.c -- the quant kernels (cpu/quant.h) on fresh random inputs:
 *   - f16 <-> f32: F16C rows against the scalar helpers of tkv-impl.h, all
 *     65536 halves and random floats (normal, subnormal, overflow, ties);
 *   - per weight type and row length: dequant fast == reference bit for bit,
 *     and == a literal formula written here (Q4_0, Q4_1, Q8_0);
 *     quantize -> dequantize error bounds; activation quantization fast ==
 *     reference byte for byte and within its own error bound; vec_dot fast
 *     vs reference (1e-5 of the sum of |terms|) and vs the f64 dot of the
 *     dequantized weights with the f32 activations (activation error bound);
 *   - unsupported type ids and partial blocks;
 *   - golden values from the real model (gguf-py's dequantize of
 *     SmolLM2-135M-Instruct.Q4_1.gguf), skipped when the model is absent.
 * TKV_SEED=N replays a run.
 */
#include "test.h"

#include "cpu/quant.h"

#include <fcntl.h>
#include <float.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

static uint64_t rng;

static uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static uint16_t rd16(const uint8_t *p) { return (uint16_t)(p[0] | p[1] << 8); }

/* Roughly normal, scaled by 10^[-3, 1] per call site. */
static float rand_normal(void)
{
    float s = 0;
    for (int i = 0; i < 4; i++)
        s += test_rand_f32(&rng, -1.0f, 1.0f);
    return s;
}

/* Returns true when it planted an outlier (x20) in the row. */
static bool fill_x(float *x, int64_t n)
{
    const float scale = powf(10.0f, test_rand_f32(&rng, -3.0f, 1.0f));
    const float shift = (test_rand_u64(&rng) & 3) == 0 ? test_rand_f32(&rng, -1.0f, 1.0f) * scale : 0.0f;
    for (int64_t i = 0; i < n; i++)
        x[i] = rand_normal() * scale + shift;
    /* an all-zero block now and then, and an outlier */
    if (n >= 64 && (test_rand_u64(&rng) & 1))
        memset(x + 32, 0, 32 * sizeof *x);
    if (test_rand_u64(&rng) & 1) {
        x[test_rand_u64(&rng) % n] *= 20.0f;
        return true;
    }
    return false;
}

static const uint32_t kTypes[] = {TKV_TYPE_F32, TKV_TYPE_F16, TKV_TYPE_BF16, TKV_TYPE_Q4_0,
                                  TKV_TYPE_Q4_1, TKV_TYPE_Q8_0, TKV_TYPE_Q4_K, TKV_TYPE_Q6_K};
static const char *tname(uint32_t t)
{
    switch (t) {
    case TKV_TYPE_F32: return "F32";   case TKV_TYPE_F16: return "F16";   case TKV_TYPE_BF16: return "BF16";
    case TKV_TYPE_Q4_0: return "Q4_0"; case TKV_TYPE_Q4_1: return "Q4_1"; case TKV_TYPE_Q8_0: return "Q8_0";
    case TKV_TYPE_Q4_K: return "Q4_K"; case TKV_TYPE_Q6_K: return "Q6_K"; default: return "?";
    }
}
static int qk_of(uint32_t t) { return t == TKV_TYPE_Q4_K || t == TKV_TYPE_Q6_K ? 256 : t <= TKV_TYPE_F16 || t == TKV_TYPE_BF16 ? 1 : 32; }
static size_t bb_of(uint32_t t)
{
    switch (t) {
    case TKV_TYPE_F32: return 4;    case TKV_TYPE_F16: case TKV_TYPE_BF16: return 2;
    case TKV_TYPE_Q4_0: return 18;  case TKV_TYPE_Q4_1: return 20; case TKV_TYPE_Q8_0: return 34;
    case TKV_TYPE_Q4_K: return 144; case TKV_TYPE_Q6_K: return 210; default: return 0;
    }
}
static size_t row_bytes(uint32_t t, int64_t n) { return (size_t)(n / qk_of(t)) * bb_of(t); }

/* A random finite f16 of magnitude in [lo, hi). */
static uint16_t rand_h(float lo, float hi, bool sign)
{
    float v = test_rand_f32(&rng, lo, hi);
    if (sign && (test_rand_u64(&rng) & 1))
        v = -v;
    return tkv_fp32_to_fp16(v);
}

/* Random K-quant blocks: random bytes, then small finite f16 scales. */
static void fill_kquant(uint32_t t, uint8_t *w, int64_t nb)
{
    for (size_t i = 0; i < (size_t)nb * bb_of(t); i++)
        w[i] = (uint8_t)test_rand_u64(&rng);
    for (int64_t b = 0; b < nb; b++) {
        if (t == TKV_TYPE_Q4_K) {
            tkv_block_q4_K *k = (tkv_block_q4_K *)w + b;
            k->d    = rand_h(1e-4f, 1e-2f, true);
            k->dmin = rand_h(1e-4f, 1e-2f, true);
        } else {
            tkv_block_q6_K *k = (tkv_block_q6_K *)w + b;
            k->d = rand_h(1e-5f, 1e-3f, true);
        }
    }
}

/* ---- f16 conversions -------------------------------------------------------- */

static void test_fp16(void)
{
    static uint16_t h[65536];
    static float f[65536];
    for (uint32_t i = 0; i < 65536; i++)
        h[i] = (uint16_t)i;
    tkv_fp16_to_fp32_row(h, f, 65536);
    int bad = 0, snan = 0;
    for (uint32_t i = 0; i < 65536; i++) {
        const uint32_t hw = f2u(f[i]), ref = f2u(tkv_fp16_to_fp32((uint16_t)i));
        const bool is_snan = (i & 0x7c00) == 0x7c00 && (i & 0x3ff) && !(i & 0x200);
        if (hw == ref)
            continue;
        if (is_snan && hw == (ref | 0x400000u)) { /* F16C quiets signalling NaNs */
            snan++;
            continue;
        }
        if (bad++ < 5)
            fprintf(stderr, "f16 %04x: row %08x scalar %08x\n", i, hw, ref);
    }
    CHECK(bad == 0, "%d halves convert differently", bad);
    if (snan)
        fprintf(stderr, "note: %d signalling-NaN halves: F16C sets the quiet bit, tkv_fp16_to_fp32 does not\n", snan);

    /* f32 -> f16 -> f32 round trip of every finite half is the identity */
    static uint16_t back[65536];
    tkv_fp32_to_fp16_row(f, back, 65536);
    bad = 0;
    for (uint32_t i = 0; i < 65536; i++)
        if ((i & 0x7c00) != 0x7c00 && back[i] != i)
            bad++;
    CHECK(bad == 0, "%d finite halves do not round-trip", bad);

    /* random floats: any non-NaN bits, the subnormal-half range, overflow
     * boundary, exact ties; odd lengths for the row tails */
    enum { N = 1 << 16 };
    static float x[N];
    static uint16_t a[N];
    int64_t total = 0;
    bad = 0;
    for (int round = 0; round < 40; round++) {
        const int kind = round % 5;
        for (int i = 0; i < N; i++) {
            uint32_t u = (uint32_t)test_rand_u64(&rng);
            switch (kind) {
            case 0: if ((u & 0x7f800000u) == 0x7f800000u) u &= 0xff7fffffu; break;    /* no NaN/Inf */
            case 1: u = (u & 0x80000000u) | (0x32800000u + u % (0x38800000u - 0x32800000u)); break; /* 2^-26..2^-14 */
            case 2: u = (u & 0x80000000u) | (0x477fe000u + u % 0x4000u); break;      /* ~65504..65536 */
            case 3: u = (u & 0x80000000u) | (0x33000000u + (u % 0x14800000u & ~0x1fffu)) | 0x1000u; break; /* ties */
            case 4: u = f2u(u2f((u & 0x807fffffu) | 0x3f800000u) * powf(2.0f, (float)(int)(u % 40) - 20)); break;
            }
            x[i] = u2f(u);
        }
        const int64_t n = N - (round * 7) % 31;
        tkv_fp32_to_fp16_row(x, a, n);
        for (int64_t i = 0; i < n; i++) {
            if (a[i] != tkv_fp32_to_fp16(x[i]) && bad++ < 5)
                fprintf(stderr, "f32 %08x: row %04x scalar %04x\n", f2u(x[i]), a[i], tkv_fp32_to_fp16(x[i]));
        }
        total += n;
    }
    CHECK(bad == 0, "%d of %lld floats convert differently", bad, (long long)total);
    /* short rows (tails only) */
    for (int n = 0; n < 40; n++) {
        float y[40], z[40];
        uint16_t hh[40];
        for (int i = 0; i < n; i++)
            y[i] = rand_normal();
        tkv_fp32_to_fp16_row(y, hh, n);
        tkv_fp16_to_fp32_row(hh, z, n);
        for (int i = 0; i < n; i++)
            CHECK(hh[i] == tkv_fp32_to_fp16(y[i]) && f2u(z[i]) == f2u(tkv_fp16_to_fp32(hh[i])), "short row %d at %d", n, i);
    }
}

/* ---- literal formulas (independent of quant-ref.c) --------------------------- */

static float mul_r(float a, float b) { volatile float p = a * b; return p; }

static void literal_dequant(uint32_t t, const uint8_t *w, float *y, int64_t n)
{
    for (int64_t b = 0; b < n / 32; b++, y += 32) {
        if (t == TKV_TYPE_Q4_0) {
            const uint8_t *p = w + 18 * b;
            const float d = tkv_fp16_to_fp32(rd16(p));
            for (int j = 0; j < 32; j++) {
                const int q = j < 16 ? (p[2 + j] & 15) : (p[2 + j - 16] >> 4);
                y[j] = mul_r((float)(q - 8), d);
            }
        } else if (t == TKV_TYPE_Q4_1) {
            const uint8_t *p = w + 20 * b;
            const float d = tkv_fp16_to_fp32(rd16(p)), m = tkv_fp16_to_fp32(rd16(p + 2));
            for (int j = 0; j < 32; j++) {
                const int q = j < 16 ? (p[4 + j] & 15) : (p[4 + j - 16] >> 4);
                y[j] = mul_r((float)q, d) + m;
            }
        } else {
            const uint8_t *p = w + 34 * b;
            const float d = tkv_fp16_to_fp32(rd16(p));
            for (int j = 0; j < 32; j++)
                y[j] = mul_r((float)(int8_t)p[2 + j], d);
        }
    }
}

/* Dequantized activation row (what vec_dot multiplies by), as f64. */
static void act_dequant(uint32_t wt, const uint8_t *act, double *a, int64_t n)
{
    const uint32_t at = tkv_act_type(wt);
    for (int64_t i = 0; i < n; i++) {
        if (at == TKV_TYPE_F32) {
            a[i] = ((const float *)act)[i];
        } else if (at == TKV_TYPE_Q8_0) {
            const tkv_block_q8_0 *y = (const tkv_block_q8_0 *)act + i / 32;
            a[i] = (double)y->qs[i % 32] * tkv_fp16_to_fp32(y->d);
        } else if (at == TKV_TYPE_Q8_1) {
            const tkv_block_q8_1 *y = (const tkv_block_q8_1 *)act + i / 32;
            a[i] = (double)y->qs[i % 32] * tkv_fp16_to_fp32(y->d);
        } else {
            const tkv_block_q8_K *y = (const tkv_block_q8_K *)act + i / 256;
            a[i] = (double)y->qs[i % 256] * y->d;
        }
    }
}

/* Checks the activation blocks against llama.cpp's quantizer rules: scale
 * from the block's max magnitude, |x - q*d| <= d/2 (+ the f16 rounding of d),
 * Q8_1's s and Q8_K's bsums consistent. Returns the largest error ratio. */
static void check_act(uint32_t wt, const float *x, const uint8_t *act, int64_t n)
{
    const uint32_t at = tkv_act_type(wt);
    if (at == TKV_TYPE_F32) {
        CHECK(memcmp(x, act, (size_t)n * 4) == 0, "F32 act is a copy");
        return;
    }
    const int qk = at == TKV_TYPE_Q8_K ? 256 : 32;
    int bad = 0;
    for (int64_t b = 0; b < n / qk; b++) {
        const float *xb = x + b * qk;
        float amax = 0;
        for (int j = 0; j < qk; j++)
            amax = fmaxf(amax, fabsf(xb[j]));
        const int8_t *qs;
        double d, dstore, bound;
        if (at == TKV_TYPE_Q8_K) {
            const tkv_block_q8_K *y = (const tkv_block_q8_K *)act + b;
            qs = y->qs;
            d = dstore = y->d;
            CHECK(fabs(fabs(d) - amax / 127.0) <= 1e-6 * amax, "Q8_K d %g amax %g", d, amax);
            for (int j = 0; j < 16; j++) {
                int s = 0;
                for (int i = 0; i < 16; i++)
                    s += qs[16 * j + i];
                bad += s != y->bsums[j];
            }
            /* d = 1/iscale and iscale*x are rounded: up to 127 |q| ulps */
            bound = fabs(d) * (0.5 + 1e-4);
        } else {
            const uint8_t *p = act + b * (at == TKV_TYPE_Q8_1 ? 36 : 34);
            qs = (const int8_t *)(p + (at == TKV_TYPE_Q8_1 ? 4 : 2));
            d = amax / 127.0f;
            dstore = tkv_fp16_to_fp32(rd16(p));
            CHECK(rd16(p) == tkv_fp32_to_fp16(amax / 127.0f), "block %lld: d", (long long)b);
            if (at == TKV_TYPE_Q8_1) {
                int s = 0;
                for (int j = 0; j < 32; j++)
                    s += qs[j];
                CHECK(rd16(p + 2) == tkv_fp32_to_fp16((float)s * (float)d), "block %lld: s", (long long)b);
            }
            bound = d * 0.5 * (1 + 1e-5) + 127 * fabs(d - dstore);
        }
        for (int j = 0; j < qk; j++) {
            if (at != TKV_TYPE_Q8_K) /* roundf of x/d, exactly */
                bad += qs[j] != (int8_t)roundf(xb[j] * (d != 0 ? 1.0f / (float)d : 0.0f));
            const bool out = fabs(xb[j] - qs[j] * dstore) > bound + 0x1p-22 * fabsf(xb[j]) + 1e-30;
            if (out && bad < 3)
                fprintf(stderr, "%s act block %lld [%d]: x %a q %d d %a\n", tname(wt), (long long)b, j, xb[j], qs[j], dstore);
            bad += out;
        }
    }
    CHECK(bad == 0, "%s act: %d bad values", tname(wt), bad);
}

/* |zero point| per element, for the float-rounding scale of vec_dot. */
static double zp_of(uint32_t t, const uint8_t *w, int64_t i)
{
    switch (t) {
    case TKV_TYPE_Q4_0: return 8 * fabsf(tkv_fp16_to_fp32(rd16(w + 18 * (i / 32))));
    case TKV_TYPE_Q4_1: return 2 * fabsf(tkv_fp16_to_fp32(rd16(w + 20 * (i / 32) + 2)));
    case TKV_TYPE_Q8_0: return 0;
    case TKV_TYPE_Q4_K: return 64 * 2 * fabsf(tkv_fp16_to_fp32(((const tkv_block_q4_K *)w)[i / 256].dmin));
    case TKV_TYPE_Q6_K: return 32 * 128 * fabsf(tkv_fp16_to_fp32(((const tkv_block_q6_K *)w)[i / 256].d));
    default:            return 0;
    }
}

static double worst_fast, worst_model;

static void test_type(uint32_t t, int64_t n)
{
    const size_t wb = row_bytes(t, n), ab = tkv_act_row_bytes(t, n);
    uint8_t *w = malloc(wb + 64), *a1 = malloc(ab + 64), *a2 = malloc(ab + 64);
    float *x = malloc((size_t)n * 4), *wf = malloc((size_t)n * 4), *y1 = malloc((size_t)n * 4),
          *y2 = malloc((size_t)n * 4), *y3 = malloc((size_t)n * 4);
    double *ad = malloc((size_t)n * 8);
    /* odd offsets: the kernels must not assume alignment */
    uint8_t *wp = w + (test_rand_u64(&rng) & 1) * 2, *ap1 = a1 + (test_rand_u64(&rng) & 3) * 16, *ap2 = a2;

    /* weights */
    fill_x(wf, n);
    if (t == TKV_TYPE_Q4_K || t == TKV_TYPE_Q6_K)
        fill_kquant(t, wp, n / 256);
    else if (!tkv_quantize_row(t, wf, wp, n))
        CHECK(false, "quantize_row %s", tname(t));

    /* dequant: fast == reference, bit for bit */
    memset(y1, 0xAB, (size_t)n * 4);
    memset(y2, 0xCD, (size_t)n * 4);
    tkv_dequant_row(t, wp, y1, n);
    tkv_dequant_row_ref(t, wp, y2, n);
    int64_t diff = 0;
    for (int64_t i = 0; i < n; i++)
        diff += f2u(y1[i]) != f2u(y2[i]);
    CHECK(diff == 0, "%s n=%lld: dequant fast != ref at %lld elements", tname(t), (long long)n, (long long)diff);

    /* literal formula, and the quantize -> dequantize error bound */
    if (t == TKV_TYPE_Q4_0 || t == TKV_TYPE_Q4_1 || t == TKV_TYPE_Q8_0) {
        literal_dequant(t, wp, y3, n);
        diff = 0;
        for (int64_t i = 0; i < n; i++)
            diff += f2u(y3[i]) != f2u(y2[i]);
        CHECK(diff == 0, "%s n=%lld: dequant != literal formula at %lld", tname(t), (long long)n, (long long)diff);
    }
    if (t != TKV_TYPE_Q4_K && t != TKV_TYPE_Q6_K) {
        int64_t bad = 0;
        for (int64_t b = 0; b < n / 32; b++) {
            const float *xb = wf + 32 * b;
            float amax = 0, mx = 0, mn = FLT_MAX, mxs = -FLT_MAX;
            for (int j = 0; j < 32; j++) {
                if (fabsf(xb[j]) > amax) { amax = fabsf(xb[j]); mx = xb[j]; }
                mn = fminf(mn, xb[j]);
                mxs = fmaxf(mxs, xb[j]);
            }
            for (int j = 0; j < 32; j++) {
                const double xv = xb[j], e = fabs(xv - y2[32 * b + j]);
                double bound;
                switch (t) {
                case TKV_TYPE_F32:  bound = 0; break;
                case TKV_TYPE_F16:  bound = fabs(xv) * 0x1p-11 + 0x1p-25; break;
                case TKV_TYPE_BF16: bound = fabs(xv) * 0x1p-8; break;
                case TKV_TYPE_Q8_0: { /* d/2 plus the f16 rounding of d */
                    const double d = amax / 127.0f, d16 = tkv_fp16_to_fp32(tkv_fp32_to_fp16((float)d));
                    bound = d / 2 + 127 * fabs(d - d16) + 1e-6 * amax;
                    break;
                }
                case TKV_TYPE_Q4_0: {
                    const double d = fabs(mx / -8.0f), d16 = fabs(tkv_fp16_to_fp32(tkv_fp32_to_fp16(mx / -8.0f)));
                    bound = d + 8 * fabs(d - d16) + 1e-6 * amax;
                    break;
                }
                default: { /* Q4_1 */
                    const double d = (mxs - mn) / 15.0f, d16 = tkv_fp16_to_fp32(tkv_fp32_to_fp16((float)d));
                    bound = d + 15 * fabs(d - d16) + fabs(mn - tkv_fp16_to_fp32(tkv_fp32_to_fp16(mn))) +
                            1e-6 * (fabs(mn) + fabs(mxs));
                    break;
                }
                }
                bad += e > bound;
            }
        }
        CHECK(bad == 0, "%s n=%lld: %lld elements outside the quantization bound", tname(t), (long long)n, (long long)bad);
    }

    /* activations: fast == reference byte for byte, and llama.cpp's rules */
    const bool outlier = fill_x(x, n);
    memset(ap1, 0x5A, ab);
    memset(ap2, 0xA5, ab);
    tkv_quantize_act(t, x, ap1, n);
    tkv_quantize_act_ref(t, x, ap2, n);
    size_t adiff = 0;
    for (size_t i = 0; i < ab; i++)
        adiff += ap1[i] != ap2[i];
    CHECK(adiff == 0, "%s n=%lld: quantize_act fast != ref in %zu of %zu bytes", tname(t), (long long)n, adiff, ab);
    check_act(t, x, ap2, n);

    /* vec_dot: fast vs reference, and vs the dot of the dequantized rows */
    const float f = tkv_vec_dot(t, wp, ap1, n), r = tkv_vec_dot_ref(t, wp, ap2, n);
    act_dequant(t, ap2, ad, n);
    double terms = 0, exact_q = 0, exact = 0, wx = 0, qerr = 0, serr = 0;
    for (int64_t i = 0; i < n; i++) {
        terms += (fabs(y2[i]) + zp_of(t, wp, i)) * fabs(ad[i]);
        exact_q += (double)y2[i] * ad[i];
        exact += (double)y2[i] * x[i];
        wx += fabs((double)y2[i] * x[i]);
        qerr += fabs(y2[i]) * fabs(x[i] - ad[i]);
    }
    if (t == TKV_TYPE_Q4_1) { /* vec_dot uses the stored s = f16(d*sum(q)) */
        for (int64_t b = 0; b < n / 32; b++) {
            const tkv_block_q8_1 *y = (const tkv_block_q8_1 *)ap2 + b;
            double s = 0;
            for (int j = 0; j < 32; j++)
                s += ad[32 * b + j];
            serr += fabsf(tkv_fp16_to_fp32(rd16(wp + 20 * b + 2))) * fabs(tkv_fp16_to_fp32(y->s) - s);
        }
    }
    qerr += serr;
    /* float summation order only: the reference adds one term per block (per
     * element, in f64, for the float types), the fast kernels fewer */
    const int64_t steps = t == TKV_TYPE_F32 || t == TKV_TYPE_F16 || t == TKV_TYPE_BF16 ? n / 64 : n / qk_of(t);
    const double tol = fmax(1e-5, 2.0 * (double)(steps + 8) * 0x1p-24) * terms + 1e-30;
    CHECK(fabs((double)f - r) <= tol, "%s n=%lld: vec_dot fast %.9g ref %.9g (tol %.3g)", tname(t), (long long)n, f, r, tol);
    CHECK(fabs((double)r - exact_q) <= tol + serr, "%s n=%lld: vec_dot ref %.9g vs f64 dot of the quantized rows %.9g",
          tname(t), (long long)n, r, exact_q);
    CHECK(fabs((double)f - exact) <= qerr + tol, "%s n=%lld: vec_dot %.9g vs exact %.9g: outside the act bound %.3g",
          tname(t), (long long)n, f, exact, qerr + tol);
    /* the bound above is the real check; on long rows without a planted
     * outlier the act error also stays far inside 2% of sum|w*x| */
    CHECK(outlier || n < 512 || fabs((double)f - exact) <= 0.02 * wx + 1e-30, "%s n=%lld: vec_dot %.9g vs exact %.9g (2%% of %.3g)",
          tname(t), (long long)n, f, exact, wx);
    if (terms > 0)
        worst_fast = fmax(worst_fast, fabs((double)f - r) / terms);
    if (wx > 0 && !outlier && n >= 512)
        worst_model = fmax(worst_model, fabs((double)f - exact) / wx);

    free(w), free(a1), free(a2), free(x), free(wf), free(y1), free(y2), free(y3), free(ad);
}

/* ---- defensive behaviour ---------------------------------------------------- */

static void test_defensive(void)
{
    float y[64], x[64];
    uint8_t buf[4096];
    memset(buf, 0x77, sizeof buf);
    for (int i = 0; i < 64; i++)
        x[i] = (float)i;
    const uint32_t bad_types[] = {4, 5, 6, 7, 9, 10, 11, 13, 15, 24, 28, 31, 39, 99, 0xFFFFFFFFu};
    for (size_t k = 0; k < sizeof bad_types / sizeof *bad_types; k++) {
        const uint32_t t = bad_types[k];
        memset(y, 0x7f, sizeof y);
        tkv_dequant_row(t, buf, y, 64);
        bool zero = true;
        for (int i = 0; i < 64; i++)
            zero &= y[i] == 0.0f;
        CHECK(zero, "type %u: dequant fills zeros", t);
        memset(y, 0x7f, sizeof y);
        tkv_dequant_row_ref(t, buf, y, 64);
        zero = true;
        for (int i = 0; i < 64; i++)
            zero &= y[i] == 0.0f;
        CHECK(zero, "type %u: dequant_ref fills zeros", t);
        CHECK(tkv_act_row_bytes(t, 256) == 0, "type %u: act bytes 0", t);
        CHECK(tkv_act_type(t) == TKV_TYPE_COUNT, "type %u: act type", t);
        uint8_t before[sizeof buf];
        memcpy(before, buf, sizeof buf);
        tkv_quantize_act(t, x, buf, 64);
        tkv_quantize_act_ref(t, x, buf, 64);
        CHECK(memcmp(before, buf, sizeof buf) == 0, "type %u: quantize_act writes nothing", t);
        CHECK(tkv_vec_dot(t, buf, buf, 64) == 0.0f && tkv_vec_dot_ref(t, buf, buf, 64) == 0.0f, "type %u: vec_dot 0", t);
        CHECK(!tkv_quantize_row(t, x, buf, 64), "type %u: quantize_row false", t);
    }
    CHECK(!tkv_quantize_row(TKV_TYPE_Q4_K, x, buf, 64) && !tkv_quantize_row(TKV_TYPE_Q6_K, x, buf, 64),
          "no K-quant quantizer");
    /* a partial trailing block: dequant zero-fills it, vec_dot ignores it */
    uint8_t q[2 * 20];
    CHECK(tkv_quantize_row(TKV_TYPE_Q4_1, x, q, 64), "q4_1");
    memset(y, 0x7f, sizeof y);
    tkv_dequant_row(TKV_TYPE_Q4_1, q, y, 50);
    bool ok = true;
    for (int i = 32; i < 50; i++)
        ok &= y[i] == 0.0f;
    CHECK(ok, "partial block zero-filled");
    CHECK(f2u(y[50]) == 0x7f7f7f7fu, "dequant writes only n elements");
    tkv_dequant_row(TKV_TYPE_Q4_1, q, y, 0);
    CHECK(tkv_vec_dot(TKV_TYPE_Q4_1, q, buf, 0) == 0.0f, "n = 0");
}

/* ---- golden values from the real model ------------------------------------- */

/* gguf-py 0.19 gguf.quants.dequantize() of rows of SmolLM2-135M-Instruct.Q4_1.gguf. */
static const struct {
    const char *name;
    int64_t row;
    float first[8], last;
    double sum;
} kGolden[] = {
    {"token_embd.weight", 0,
     {-0x1.b468p-4f, 0x1.0e28p-5f, 0x1.8ad8p-5f, -0x1.761p-6f, -0x1.188cp-4f, -0x1.761p-5f, 0x1.4c8p-6f, -0x1.f2cp-4f},
     0x1.e78p-6f, -2.25410938},
    {"token_embd.weight", 49151,
     {0x1.79p-7f, 0x1.79p-8f, 0x1.909p-4f, -0x1.909p-4f, 0x1.617p-4f, -0x1.79p-5f, 0x1.617p-3f, 0x1.a82p-5f},
     -0x1.55ap-5f, -0.466220856},
    {"blk.0.attn_q.weight", 0,
     {-0x1.8a8p-4f, 0x1.424p-3f, -0x1.8a8p-4f, -0x1.76p-1f, 0x1.2c08p+0f, -0x1.8a8p-4f, 0x1.f4p-6f, 0x1.545p-1f},
     0x1.fap-4f, 1.00726318},
    {"blk.0.attn_q.weight", 575,
     {-0x1.412p-3f, 0x1.3c1p-3f, 0x1.5d3p-2f, 0x1.e98p-6f, 0x1.bb8p-3f, -0x1.2p-2f, 0x1.794p-4f, -0x1.09p-5f},
     -0x1.06p-2f, -4.73495483},
    {"blk.29.ffn_down.weight", 0,
     {-0x1.17ep-2f, 0x1.7d8p-3f, 0x1.7d8p-3f, 0x1.8c8p-5f, 0x1.7d8p-3f, 0x1.7d8p-3f, -0x1.46fp-2f, -0x1.738p-3f},
     -0x1.bdcp-5f, -10.8383179},
    {"blk.29.ffn_down.weight", 575,
     {-0x1.d56p-3f, -0x1.408p-5f, -0x1.1b58p-2f, 0x1.f7cp-3f, 0x1.13p-7f, -0x1.408p-5f, 0x1.cap-5f, 0x1.352p-3f},
     0x1.dp-5f, -5.22994995},
};

struct mini_tensor {
    const uint8_t *data;
    uint32_t type;
    int64_t ne0, ne1;
};

/* Just enough GGUF (v3, little-endian) to find a tensor by name. */
static bool gguf_find(const uint8_t *f, size_t size, const char *name, struct mini_tensor *out)
{
    size_t o = 8;
    uint64_t nt, nkv, u;
#define RD(dst, nbytes) do { if (o + (nbytes) > size) return false; memcpy(&(dst), f + o, nbytes); o += (nbytes); } while (0)
    RD(nt, 8);
    RD(nkv, 8);
    static const uint8_t vsz[13] = {1, 1, 2, 2, 4, 4, 4, 1, 0, 0, 8, 8, 8};
    for (uint64_t i = 0; i < nkv; i++) {
        uint32_t vt;
        RD(u, 8);
        o += u;
        RD(vt, 4);
        if (vt == 8) {
            RD(u, 8);
            o += u;
        } else if (vt == 9) {
            uint32_t et;
            uint64_t cnt;
            RD(et, 4);
            RD(cnt, 8);
            if (et == 8) {
                for (uint64_t k = 0; k < cnt; k++) {
                    RD(u, 8);
                    o += u;
                }
            } else if (et < 13) {
                o += cnt * vsz[et];
            } else {
                return false;
            }
        } else if (vt < 13) {
            o += vsz[vt];
        } else {
            return false;
        }
    }
    bool found = false;
    uint64_t off = 0;
    for (uint64_t i = 0; i < nt; i++) {
        uint32_t nd, type;
        uint64_t len, ne[4] = {1, 1, 1, 1}, toff;
        RD(len, 8);
        if (o + len > size)
            return false;
        const bool match = len == strlen(name) && memcmp(f + o, name, len) == 0;
        o += len;
        RD(nd, 4);
        if (nd > 4)
            return false;
        for (uint32_t d = 0; d < nd; d++)
            RD(ne[d], 8);
        RD(type, 4);
        RD(toff, 8);
        if (match) {
            found = true;
            off = toff;
            out->type = type;
            out->ne0 = (int64_t)ne[0];
            out->ne1 = (int64_t)ne[1];
        }
    }
#undef RD
    const size_t data = (size_t)tkv_align_up(o, 32); /* general.alignment is 32 in this file */
    if (!found || data + off > size)
        return false;
    out->data = f + data + off;
    return true;
}

static void test_golden(void)
{
    const char *path = getenv("TKV_MODEL");
    const int fd = path ? open(path, O_RDONLY) : -1;
    if (fd < 0) {
        fprintf(stderr, "note: model not found (TKV_MODEL=%s): golden check skipped\n", path ? path : "unset");
        return;
    }
    struct stat st;
    const uint8_t *f = fstat(fd, &st) == 0 ? mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_PRIVATE, fd, 0) : MAP_FAILED;
    close(fd);
    if (f == MAP_FAILED) {
        CHECK(false, "cannot map %s", path);
        return;
    }
    for (size_t g = 0; g < sizeof kGolden / sizeof *kGolden; g++) {
        struct mini_tensor t;
        if (!gguf_find(f, (size_t)st.st_size, kGolden[g].name, &t)) {
            CHECK(false, "tensor %s not found", kGolden[g].name);
            continue;
        }
        const size_t rb = row_bytes(t.type, t.ne0);
        float *y = malloc((size_t)t.ne0 * 4), *yr = malloc((size_t)t.ne0 * 4);
        tkv_dequant_row(t.type, t.data + rb * (size_t)kGolden[g].row, y, t.ne0);
        tkv_dequant_row_ref(t.type, t.data + rb * (size_t)kGolden[g].row, yr, t.ne0);
        double s = 0;
        bool same = true;
        for (int64_t i = 0; i < t.ne0; i++) {
            s += y[i];
            same &= f2u(y[i]) == f2u(yr[i]);
        }
        CHECK(same, "%s row %lld: fast != ref", kGolden[g].name, (long long)kGolden[g].row);
        for (int i = 0; i < 8; i++)
            CHECK(y[i] == kGolden[g].first[i], "%s row %lld [%d]: %a, gguf-py %a", kGolden[g].name,
                  (long long)kGolden[g].row, i, y[i], kGolden[g].first[i]);
        CHECK(y[t.ne0 - 1] == kGolden[g].last, "%s: last %a vs %a", kGolden[g].name, y[t.ne0 - 1], kGolden[g].last);
        CHECK(fabs(s - kGolden[g].sum) <= 1e-7 * (1 + fabs(s)) * t.ne0, "%s: row sum %.9g vs %.9g", kGolden[g].name, s,
              kGolden[g].sum);
        free(y), free(yr);
    }
    /* every row of one real Q4_1 and one Q8_0 tensor: fast == ref; vec_dot */
    const char *names[] = {"blk.0.ffn_down.weight", "token_embd.weight"};
    for (int k = 0; k < 2; k++) {
        struct mini_tensor t;
        if (!gguf_find(f, (size_t)st.st_size, names[k], &t)) {
            CHECK(false, "tensor %s not found", names[k]);
            continue;
        }
        const int64_t rows = TKV_MIN(t.ne1, 2048);
        const size_t rb = row_bytes(t.type, t.ne0), ab = tkv_act_row_bytes(t.type, t.ne0);
        float *y = malloc((size_t)t.ne0 * 4), *yr = malloc((size_t)t.ne0 * 4), *x = malloc((size_t)t.ne0 * 4);
        uint8_t *act = malloc(ab);
        fill_x(x, t.ne0);
        tkv_quantize_act(t.type, x, act, t.ne0);
        int64_t bad = 0, bad_dot = 0;
        for (int64_t r = 0; r < rows; r++) {
            const uint8_t *w = t.data + rb * (size_t)r;
            tkv_dequant_row(t.type, w, y, t.ne0);
            tkv_dequant_row_ref(t.type, w, yr, t.ne0);
            bad += memcmp(y, yr, (size_t)t.ne0 * 4) != 0;
            double terms = 0;
            for (int64_t i = 0; i < t.ne0; i++)
                terms += (fabs(yr[i]) + zp_of(t.type, w, i)) * fabs(x[i]) * 1.01;
            bad_dot += fabs((double)tkv_vec_dot(t.type, w, act, t.ne0) - tkv_vec_dot_ref(t.type, w, act, t.ne0)) >
                       fmax(1e-5, 2.0 * (double)(t.ne0 / 32 + 8) * 0x1p-24) * terms;
        }
        CHECK(bad == 0 && bad_dot == 0, "%s: %lld rows dequant differently, %lld vec_dots out of tolerance", names[k],
              (long long)bad, (long long)bad_dot);
        free(y), free(yr), free(x), free(act);
    }
    munmap((void *)f, (size_t)st.st_size);
    fprintf(stderr, "golden: %zu rows against gguf-py, 2 real tensors fast vs ref\n", sizeof kGolden / sizeof *kGolden);
}

int main(void)
{
    rng = test_seed();
    test_fp16();
    test_defensive();
    static const int64_t n32[] = {32, 64, 96, 160, 352, 512, 544, 576, 608, 1024, 1536, 2080, 4096};
    static const int64_t n256[] = {256, 512, 768, 1536, 2304, 4096};
    for (size_t k = 0; k < sizeof kTypes / sizeof *kTypes; k++) {
        const uint32_t t = kTypes[k];
        const bool kq = qk_of(t) == 256;
        const size_t cnt = kq ? sizeof n256 / sizeof *n256 : sizeof n32 / sizeof *n32;
        for (int rep = 0; rep < 6; rep++) {
            for (size_t i = 0; i < cnt; i++)
                test_type(t, kq ? n256[i] : n32[i]);
            if (t == TKV_TYPE_F32 || t == TKV_TYPE_F16 || t == TKV_TYPE_BF16) /* any length */
                test_type(t, 1 + (int64_t)(test_rand_u64(&rng) % 700));
        }
    }
    fprintf(stderr, "vec_dot: worst |fast - ref| / sum|terms| = %.3g (tolerance max(1e-5, 2*(blocks+8)*2^-24)); "
                    "worst |vec_dot - exact| / sum|w*x| = %.3g\n", worst_fast, worst_model);
    test_golden();
    return test_done();
}
