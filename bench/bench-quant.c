/*
 * bench-quant.c -- single-thread throughput of the quant kernels (cpu/quant.h),
 * fast vs reference, in GB/s of weight bytes read.
 *
 *   build/bench/bench-quant [budget_kib [type]]   (default 1024: L2-resident; all types)
 *
 * For each weight type and row length (576 and 1536: SmolLM2-135M shapes;
 * 4096), a matrix of about budget_kib KiB of random weights is swept row by
 * row: dequant into one f32 row buffer, and vec_dot against one activation
 * row quantized beforehand (as the decode path does). The best of several
 * sweeps is reported, as a Markdown table on stdout.
 */
#include "cpu/quant.h"

#include "bench.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static float rndf(void) { return (float)((rnd() >> 40) * (1.0 / 16777216.0)) * 2.0f - 1.0f; }

static volatile float sink;

enum { DEQ, DEQ_REF, DOT, DOT_REF };

/* Seconds for one sweep of all rows (best of reps). */
static double sweep(int what, uint32_t t, const uint8_t *w, size_t rb, int64_t rows, int64_t n, const void *act,
                    float *y)
{
    double best = 1e30;
    const double t_end = now() + 0.15;
    for (int rep = 0; rep < 200 && (rep < 3 || now() < t_end); rep++) {
        float acc = 0;
        const double t0 = now();
        for (int64_t r = 0; r < rows; r++) {
            const uint8_t *row = w + (size_t)r * rb;
            switch (what) {
            case DEQ:     tkv_dequant_row(t, row, y, n); acc += y[r % n]; break;
            case DEQ_REF: tkv_dequant_row_ref(t, row, y, n); acc += y[r % n]; break;
            case DOT:     acc += tkv_vec_dot(t, row, act, n); break;
            default:      acc += tkv_vec_dot_ref(t, row, act, n); break;
            }
        }
        const double dt = now() - t0;
        sink = acc;
        if (dt < best)
            best = dt;
    }
    return best;
}

int main(int argc, char **argv)
{
    const size_t budget = (size_t)(argc > 1 ? atoi(argv[1]) : 1024) * 1024;
    static const struct { uint32_t type; const char *name; int qk; size_t bb; } types[] = {
        {TKV_TYPE_Q4_0, "Q4_0", 32, 18},  {TKV_TYPE_Q4_1, "Q4_1", 32, 20},   {TKV_TYPE_Q8_0, "Q8_0", 32, 34},
        {TKV_TYPE_Q4_K, "Q4_K", 256, 144}, {TKV_TYPE_Q6_K, "Q6_K", 256, 210}, {TKV_TYPE_F16, "F16", 1, 2},
        {TKV_TYPE_BF16, "BF16", 1, 2},     {TKV_TYPE_F32, "F32", 1, 4},
    };
    static const int64_t lens[] = {576, 1536, 4096};
    printf("single thread, ~%zu KiB of weights per sweep; GB/s of weight bytes (best sweep)\n\n", budget / 1024);
    printf("| type | n | act | dequant fast | dequant ref | vec_dot fast | vec_dot ref | dot speedup | act quant (ns/row) |\n");
    printf("|---|---:|---|---:|---:|---:|---:|---:|---:|\n");
    for (size_t k = 0; k < sizeof types / sizeof *types; k++) {
        for (size_t l = 0; l < sizeof lens / sizeof *lens; l++) {
            const uint32_t t = types[k].type;
            const int64_t n = lens[l];
            if (argc > 2 && strcmp(argv[2], types[k].name) != 0)
                continue;
            if (n % types[k].qk)
                continue;
            const size_t rb = (size_t)(n / types[k].qk) * types[k].bb;
            const int64_t rows = (int64_t)(budget / rb) > 0 ? (int64_t)(budget / rb) : 1;
            uint8_t *w = aligned_alloc(64, (rb * (size_t)rows + 63) / 64 * 64);
            float *x = malloc((size_t)n * 4), *y = aligned_alloc(64, ((size_t)n * 4 + 63) / 64 * 64);
            const size_t ab = tkv_act_row_bytes(t, n);
            uint8_t *act = aligned_alloc(64, (ab + 63) / 64 * 64);
            for (int64_t i = 0; i < n; i++)
                x[i] = rndf();
            for (int64_t r = 0; r < rows; r++) {
                uint8_t *row = w + (size_t)r * rb;
                if (!tkv_quantize_row(t, x, row, n)) { /* K-quants: random bytes, small f16 scales */
                    for (size_t i = 0; i < rb; i++)
                        row[i] = (uint8_t)rnd();
                    for (int64_t b = 0; b < n / 256; b++) {
                        if (t == TKV_TYPE_Q4_K) {
                            ((tkv_block_q4_K *)row)[b].d = 0x1800;
                            ((tkv_block_q4_K *)row)[b].dmin = 0x1400;
                        } else {
                            ((tkv_block_q6_K *)row)[b].d = 0x1000;
                        }
                    }
                }
                for (int64_t i = 0; i < n; i++) /* next row's values */
                    x[i] = rndf();
            }
            double tq = 1e30;
            for (int rep = 0; rep < 200; rep++) {
                const double t0 = now();
                tkv_quantize_act(t, x, act, n);
                const double dt = now() - t0;
                if (dt < tq)
                    tq = dt;
            }
            const double bytes = (double)rb * (double)rows;
            const double g[4] = {
                bytes / sweep(DEQ, t, w, rb, rows, n, act, y) / 1e9,
                bytes / sweep(DEQ_REF, t, w, rb, rows, n, act, y) / 1e9,
                bytes / sweep(DOT, t, w, rb, rows, n, act, y) / 1e9,
                bytes / sweep(DOT_REF, t, w, rb, rows, n, act, y) / 1e9,
            };
            const char *an = t == TKV_TYPE_Q4_1 ? "Q8_1" : (t == TKV_TYPE_Q4_0 || t == TKV_TYPE_Q8_0) ? "Q8_0"
                             : types[k].qk == 256 ? "Q8_K" : "F32";
            printf("| %s | %lld | %s | %.1f | %.1f | %.1f | %.1f | %.1fx | %.0f |\n", types[k].name, (long long)n, an,
                   g[0], g[1], g[2], g[3], g[2] / g[3], tq * 1e9);
            fflush(stdout);
            free(w), free(x), free(y), free(act);
        }
    }
    return 0;
}
