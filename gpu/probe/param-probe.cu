/*
 * param-probe.cu -- an experiment, not part of the build: does the size of
 * a kernel's parameters lengthen a chain of dependent launches?
 *
 * Why (docs/gpu.md, "What is left", session 49): a branch whose kernels
 * each carried 104 more bytes of parameters, and otherwise did the same
 * work, made the Llama-3-8B Q4_0 decode step 5.5% slower at 4K. The step
 * is ~290 dependent launches (programmatic dependent launch, PDL), and its
 * decode attention carries 3.5 KiB of parameters, its GEMVs 236 bytes.
 *
 * The probe times chains of N launches of one kernel whose parameters are
 * S bytes (a __grid_constant__ struct, as the attention's runs table is),
 * for several S, with and without PDL, and with two amounts of work a
 * launch: none (each CTA adds one value the previous launch wrote) and a
 * stream (each launch first reads its own `work` KiB a CTA, fresh from
 * DRAM, before griddepcontrol.wait, as the GEMVs read their weights). It
 * prints microseconds a launch; if S matters, the rows grow with it.
 * Measured in session 50 (docs/benchmarks.md, "Session 50"): flat in S,
 * ~3.4 us a launch with PDL, but that is the host's launch rate, so the
 * probe only bounds the effect; the step's own A/B found none.
 *
 * Build: nvcc -O3 -arch=sm_90 -o param-probe gpu/probe/param-probe.cu (from
 *        the project root)
 * Run:   ./param-probe [-n launches] [-r reps] [-w work KiB a CTA] [-c CTAs]
 */
#include "probe.cuh"

const char *const probe_name = "param-probe";

template <int S> struct pad_bytes {
    uint8_t b[S];
};

/* One link of the chain: stream `per_cta` floats of `in` (a slice no other
 * launch of the chain reads) before the wait, then add the value the
 * previous launch left in out[blockIdx.x]. */
template <int S>
__global__ void __launch_bounds__(256)
    link_kernel(const float *__restrict__ in, float *out, uint32_t per_cta, const __grid_constant__ pad_bytes<S> pad)
{
    tkv_pdl_trigger();
    float acc = 0.0f;
    const uint4 *src = (const uint4 *)(in + (size_t)blockIdx.x * per_cta);
    for (uint32_t i = threadIdx.x; i < per_cta / 4; i += blockDim.x) {
        const uint4 v = tkv_ld_stream16(src + i); /* 16 bytes, not kept in L1 */
        acc += __uint_as_float(v.x) + __uint_as_float(v.y) + __uint_as_float(v.z) + __uint_as_float(v.w);
    }
    acc = tkv_warp_sum(acc);
    tkv_pdl_wait();
    if (threadIdx.x == 0)
        out[blockIdx.x] = out[blockIdx.x] * 0.5f + acc + pad.b[blockIdx.x % S];
}

struct chain {
    const float *in;
    float *out;
    size_t in_floats; /* of in */
    uint32_t ctas, per_cta, n;
    cudaStream_t s;
};

/* n launches of link_kernel<S>, each reading the next slice of in (wrapping). */
template <int S> static void run_chain(const chain &c, bool pdl)
{
    pad_bytes<S> pad;
    for (int i = 0; i < S; i++)
        pad.b[i] = (uint8_t)(i & 1);
    const size_t slice = (size_t)c.ctas * c.per_cta;               /* floats a launch reads */
    const size_t slices = slice ? c.in_floats / slice : 1;          /* >= 1: main checks */
    for (uint32_t k = 0; k < c.n; k++) {
        const float *in = c.in + k % slices * slice;
        CK(tkv_cuda_launch(pdl, dim3(c.ctas), dim3(256), 0, c.s, link_kernel<S>, in, c.out, c.per_cta, pad));
    }
}

template <int S> static float us_per_launch(const chain &c, bool pdl, uint32_t reps)
{
    return probe_time(c.s, reps, [&] { run_chain<S>(c, pdl); }) * 1e3f / (float)c.n;
}

int main(int argc, char **argv)
{
    uint32_t n = 256, reps = 10, work_kib = 16, ctas = 0;
    const probe_opt opts[] = {{'n', &n}, {'r', &reps}, {'w', &work_kib}, {'c', &ctas}};
    if (!probe_options(argc, argv, opts, sizeof opts / sizeof *opts, "[-n launches] [-r reps] [-w work KiB a CTA] [-c CTAs]"))
        return 2;
    if (n < 1 || reps < 1 || work_kib > 1024) {
        fprintf(stderr, "param-probe: bad arguments\n");
        return 2;
    }
    const cudaDeviceProp prop = probe_device();
    const int n_sm = prop.multiProcessorCount;
    if (!ctas)
        ctas = 2 * (uint32_t)n_sm;
    const size_t in_bytes = (size_t)1 << 30; /* 1 GiB: the slices of a chain come from DRAM, not L2 */
    if ((size_t)ctas * work_kib * 1024 > in_bytes) {
        fprintf(stderr, "param-probe: %u CTAs x %u KiB is more than the 1 GiB buffer\n", ctas, work_kib);
        return 2;
    }

    float *in, *out;
    CK(cudaMalloc(&in, in_bytes));
    CK(cudaMemset(in, 0, in_bytes));
    CK(cudaMalloc(&out, ctas * sizeof(float)));
    CK(cudaMemset(out, 0, ctas * sizeof(float)));
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    const double gbs = probe_copy_gbs(s, (uint8_t *)in, in_bytes / 2, reps);

    printf("%s on %s (%d SMs), copy rate %.0f GB/s; %u launches a chain of %u CTAs x 256 threads, median of %u\n",
           probe_name, prop.name, n_sm, gbs, n, ctas, reps);
    printf("| parameter bytes | work a CTA | us a launch, PDL | us a launch, no PDL | stream's bytes at the copy rate, us |\n");
    printf("|---:|---:|---:|---:|---:|\n");
    const uint32_t works[2] = {0, work_kib * 256}; /* floats a CTA */
    for (int wi = 0; wi < 2; wi++) {
        chain c = {in, out, in_bytes / sizeof(float), ctas, works[wi], n, s};
        const double t_bytes = (double)ctas * c.per_cta * 4 / (gbs * 1e3);
        auto row = [&](int S, float pdl, float plain) {
            printf("| %d | %u KiB | %.2f | %.2f | %.2f |\n", S + 20, c.per_cta / 256, pdl, plain, t_bytes);
        };
#define PROBE_ROW(S) row(S, us_per_launch<S>(c, true, reps), us_per_launch<S>(c, false, reps))
        PROBE_ROW(16);   /* 36 bytes: a norm's */
        PROBE_ROW(216);  /* 236: a Q4_0 GEMV's */
        PROBE_ROW(320);  /* 340: the GEMV's with session 49's ranges */
        PROBE_ROW(600);  /* ~0.6 KiB: the compact runs table */
        PROBE_ROW(1024);
        PROBE_ROW(2048);
        PROBE_ROW(3476); /* ~3.5 KiB: the decode attention's, inline runs */
#undef PROBE_ROW
    }
    CK(cudaStreamDestroy(s));
    CK(cudaFree(in));
    CK(cudaFree(out));
    return 0;
}
