/*
 * packed-probe.cu -- an experiment, not part of the build: would the Q4_0
 * decode GEMVs stream closer to the copy rate with their weights repacked
 * at load and read straight into registers?
 *
 * Before session 45, gemv-quant.cu read Q4_0 in the GGUF layout: 18-byte
 * blocks (an f16 scale, 16 bytes of nibbles), which a lane cannot load as
 * aligned 16-byte vectors, so each warp staged its rows through shared
 * memory with cp.async and a CTA held its slot until its stage landed, its
 * sums were combined and written (persist-probe.cu measures that design's
 * chain at 1.42-1.56x the copy rate's time; it still serves Q4_1 and Q8_0).
 * This probe measured the design gemv-quant.cu's packed kernel then took,
 * with variants it did not (R rows a warp). Here a matrix is two arrays: the 16-byte nibble
 * blocks of each row, contiguous, and their f16 scales. Lane j of a warp
 * reads blocks j, j + 32, ... of its R rows with 16-byte loads (512
 * contiguous bytes a warp instruction) and their scales (64 bytes), U
 * blocks a row at a time, the next U already loading (registers, double
 * buffered) while it multiplies these: no shared memory, no barrier, and
 * the first U issued before griddepcontrol.wait.
 *
 * The four Q4_0 GEMVs of a Llama-3-8B layer (q/k/v 6144 x 4096, wo 4096 x
 * 4096, gate/up 28672 x 4096, down 4096 x 14336) over 32 layers (3.93 GB,
 * nothing stays in L2) as a chain of launches with programmatic dependent
 * launch; each op's activations are the previous op's int8 outputs (the
 * dependency and bytes of the backend's Q8 planes). Each row's sum is the
 * arithmetic of tkv_vec_dot_ref's Q4_0 term, d_w d_a (sum q a - 8 sum a).
 * Reported against the weights' bytes at the copy rate of the same run
 * (cudaMemcpy device to device, both directions counted).
 *
 * Build: nvcc -O3 -arch=sm_90 -o packed-probe gpu/probe/packed-probe.cu (from the
 *        project root)
 * Run:   ./packed-probe [-l layers] [-r reps] [-x 0..3] (-x: every op of that
 *        shape: q/k/v, wo, gate/up, down)
 */
#include "probe.cuh"

const char *const probe_name = "packed-probe";

constexpr uint32_t K_MAX = 14336, ROWS_MAX = 28672;

struct op {
    const uint4 *q;     /* rows x nb nibble blocks */
    const __half *d;    /* rows x nb scales */
    const int8_t *act;  /* K: the previous op's output (or the input) */
    int8_t *out;        /* rows */
    uint32_t rows, K;
};

/* R rows a warp, U blocks a lane and row in flight (and U more loading). */
template <int R, int U>
__global__ void __launch_bounds__(256) gemv_packed(const op o, const float *__restrict__ ascale,
                                                   const int *__restrict__ asum)
{
    tkv_pdl_trigger();
    const uint32_t lane = threadIdx.x % 32, nb = o.K / 32;
    const uint32_t row0 = (blockIdx.x * blockDim.x + threadIdx.x) / 32 * R;
    uint4 wq[R][U], nq[R][U];
    float wd[R][U], nd[R][U];
    auto load = [&](uint32_t b0, uint4 (&q)[R][U], float (&d)[R][U]) {
#pragma unroll
        for (int r = 0; r < R; r++)
#pragma unroll
            for (int u = 0; u < U; u++) {
                const uint32_t b = b0 + u * 32 + lane, row = row0 + r;
                const bool ok = row < o.rows && b < nb;
                q[r][u] = ok ? tkv_ld_stream16(o.q + (size_t)row * nb + b) : make_uint4(0, 0, 0, 0);
                d[r][u] = ok ? __half2float(o.d[(size_t)row * nb + b]) : 0.0f;
            }
    };
    load(0, wq, wd); /* weights only: written by no kernel */
    tkv_pdl_wait();
    float acc[R];
#pragma unroll
    for (int r = 0; r < R; r++)
        acc[r] = 0.0f;
    for (uint32_t b0 = 0; b0 < nb; b0 += 32 * U) {
        if (b0 + 32 * U < nb)
            load(b0 + 32 * U, nq, nd);
#pragma unroll
        for (int u = 0; u < U; u++) {
            const uint32_t b = b0 + u * 32 + lane;
            if (b >= nb)
                break;
            const uint4 a0 = __ldg((const uint4 *)(o.act + (size_t)b * 32));
            const uint4 a1 = __ldg((const uint4 *)(o.act + (size_t)b * 32 + 16));
            const float da = __ldg(ascale + b);
            const int sa = __ldg(asum + b);
#pragma unroll
            for (int r = 0; r < R; r++) {
                int s = 0;
#pragma unroll
                for (int k = 0; k < 4; k++) {
                    s = __dp4a((int)(tkv_u4_word(wq[r][u], k) & 0x0F0F0F0Fu), (int)tkv_u4_word(a0, k), s);
                    s = __dp4a((int)((tkv_u4_word(wq[r][u], k) >> 4) & 0x0F0F0F0Fu), (int)tkv_u4_word(a1, k), s);
                }
                acc[r] = __fadd_rn(acc[r], __fmul_rn(__fmul_rn(wd[r][u], da), (float)(s - 8 * sa)));
            }
        }
#pragma unroll
        for (int r = 0; r < R; r++)
#pragma unroll
            for (int u = 0; u < U; u++)
                wq[r][u] = nq[r][u], wd[r][u] = nd[r][u];
    }
#pragma unroll
    for (int r = 0; r < R; r++) {
        const float v = tkv_warp_sum(acc[r]);
        if (lane == 0 && row0 + r < o.rows)
            o.out[row0 + r] = (int8_t)fmaxf(-127.0f, fminf(127.0f, v * 64.0f));
    }
}

__global__ void fill_kernel(uint32_t *w, size_t n_words, uint32_t seed)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n_words; i += (size_t)gridDim.x * blockDim.x) {
        uint32_t h = (uint32_t)i * 2654435761u ^ seed;
        h = h * 1664525u + 1013904223u;
        w[i] = h;
    }
}

__global__ void scales_kernel(__half *d, size_t n)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        d[i] = __float2half(0.001f + (i % 1000) * 1e-5f);
}

typedef void (*kern_t)(const op, const float *, const int *);

struct variant {
    const char *name;
    kern_t k;
    uint32_t R;
};

int main(int argc, char **argv)
{
    uint32_t layers = 32, reps = 10, shape = 4;
    const probe_opt opts[] = {{'l', &layers}, {'r', &reps}, {'x', &shape}};
    if (!probe_options(argc, argv, opts, sizeof opts / sizeof *opts, "[-l layers] [-r reps] [-x 0..3]"))
        return 2;
    if (layers < 1 || shape > 4 || reps < 1) {
        fprintf(stderr, "packed-probe: bad arguments\n");
        return 2;
    }
    const cudaDeviceProp prop = probe_device();
    const int n_sm = prop.multiProcessorCount;

    auto shape_of = [&](uint32_t i) { return PROBE_SHAPES[shape < 4 ? shape : i % 4]; };
    const uint32_t n_ops = 4 * layers;
    size_t n_blocks = 0;
    for (uint32_t i = 0; i < n_ops; i++)
        n_blocks += (size_t)shape_of(i)[0] * (shape_of(i)[1] / 32);
    const double w_bytes = (double)n_blocks * 18; /* as GGUF counts them: 16 + 2 bytes a block */
    uint4 *q;
    __half *d;
    CK(cudaMalloc(&q, n_blocks * 16));
    CK(cudaMalloc(&d, n_blocks * 2));
    fill_kernel<<<4 * n_sm, 256>>>((uint32_t *)q, n_blocks * 4, 12345u);
    scales_kernel<<<4 * n_sm, 256>>>(d, n_blocks);
    CK(cudaGetLastError());

    int8_t *outs, *input;
    float *ascale;
    int *asum;
    CK(cudaMalloc(&outs, (size_t)n_ops * ROWS_MAX));
    CK(cudaMalloc(&input, K_MAX));
    CK(cudaMalloc(&ascale, K_MAX / 32 * sizeof(float)));
    CK(cudaMalloc(&asum, K_MAX / 32 * sizeof(int)));
    std::vector<int8_t> hin(K_MAX);
    for (uint32_t i = 0; i < K_MAX; i++)
        hin[i] = (int8_t)((i * 37) % 201 - 100);
    std::vector<float> hs(K_MAX / 32, 1.0f / 64);
    std::vector<int> hsum(K_MAX / 32, 3);
    CK(cudaMemcpy(input, hin.data(), K_MAX, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(ascale, hs.data(), hs.size() * sizeof(float), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(asum, hsum.data(), hsum.size() * sizeof(int), cudaMemcpyHostToDevice));

    std::vector<op> ops(n_ops);
    size_t off = 0;
    for (uint32_t i = 0; i < n_ops; i++) {
        op &o = ops[i];
        o.rows = shape_of(i)[0];
        o.K = shape_of(i)[1];
        o.q = q + off;
        o.d = d + off;
        off += (size_t)o.rows * (o.K / 32);
        o.act = i ? outs + (size_t)(i - 1) * ROWS_MAX : input;
        o.out = outs + (size_t)i * ROWS_MAX;
    }

    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    /* the copy rate: 1 GiB within the nibble blocks (the 1.9 GB or more of them) */
    const double copy_gbs = probe_copy_gbs(s, (uint8_t *)q, (size_t)1 << 30, reps);
    const double roof_ms = w_bytes / (copy_gbs * 1e9) * 1e3;

    const variant vars[] = {
        {"R1 U4", gemv_packed<1, 4>, 1}, {"R2 U2", gemv_packed<2, 2>, 2}, {"R2 U4", gemv_packed<2, 4>, 2},
        {"R4 U2", gemv_packed<4, 2>, 4}, {"R1 U8", gemv_packed<1, 8>, 1}, {"R4 U1", gemv_packed<4, 1>, 4},
    };
    printf("| %s, %d SMs | weights %.3f GB (GGUF bytes), %u layers%s | copy %.0f GB/s |\n", prop.name, n_sm,
           w_bytes / 1e9, layers, shape < 4 ? ", one shape" : "", copy_gbs);
    printf("| variant | step ms | us a layer | GB/s | x roofline |\n|---|---:|---:|---:|---:|\n");
    printf("| roofline | %.3f | %.2f | %.0f | 1.00 |\n", roof_ms, roof_ms * 1e3 / layers, copy_gbs);
    for (const variant &v : vars) {
        for (int pdl = 1; pdl >= 0; pdl--) {
            auto step = [&]() {
                for (uint32_t i = 0; i < n_ops; i++) {
                    const uint32_t warps = (ops[i].rows + v.R - 1) / v.R;
                    cudaLaunchConfig_t cfg = {};
                    cfg.gridDim = dim3((warps + 7) / 8);
                    cfg.blockDim = dim3(256);
                    cfg.stream = s;
                    cudaLaunchAttribute at[1];
                    at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
                    at[0].val.programmaticStreamSerializationAllowed = pdl;
                    cfg.attrs = at;
                    cfg.numAttrs = 1;
                    CK(cudaLaunchKernelEx(&cfg, v.k, ops[i], (const float *)ascale, (const int *)asum));
                }
            };
            const float ms = probe_time(s, reps, step);
            printf("| %s%s | %.3f | %.2f | %.0f | %.2f |\n", v.name, pdl ? ", PDL" : "", ms, ms * 1e3 / layers,
                   w_bytes / (ms * 1e-3) / 1e9, ms / roof_ms);
        }
    }
    return 0;
}
