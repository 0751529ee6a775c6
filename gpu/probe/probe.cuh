/*
 * probe.cuh -- what the standalone probes of this folder share (not part of
 * the build; each probe's header says how to build and run it): the error
 * check, the "-f N" options, the device's properties, the Llama-3-8B decode
 * GEMV shapes, a median timer and the copy rate every probe reports its
 * times against.
 */
#ifndef TKV_GPU_PROBE_CUH
#define TKV_GPU_PROBE_CUH

#include "../common.cuh" /* the CUDA headers, cp.async, PDL and load wrappers */

#include <algorithm>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <vector>

/* The probe's name, for its messages (each probe defines it). */
extern const char *const probe_name;

#define CK(x)                                                                                             \
    do {                                                                                                  \
        cudaError_t e_ = (x);                                                                             \
        if (e_ != cudaSuccess) {                                                                          \
            fprintf(stderr, "%s: %s:%d: %s: %s\n", probe_name, __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
            exit(1);                                                                                      \
        }                                                                                                 \
    } while (0)

/* One "-f N" option of a probe: its letter and where its value goes. */
struct probe_opt {
    char flag;
    uint32_t *val;
};

/* Reads argv as "-f N" pairs into opts[0 .. n) (a trailing lone argument is
 * ignored); false, with "usage: <probe_name> <usage>" printed, at an option
 * none of them names. */
static bool probe_options(int argc, char **argv, const probe_opt *opts, int n, const char *usage)
{
    for (int i = 1; i + 1 < argc; i += 2) {
        int k = 0;
        while (k < n && !(argv[i][0] == '-' && argv[i][1] == opts[k].flag && argv[i][2] == 0))
            k++;
        if (k == n) {
            fprintf(stderr, "usage: %s %s\n", probe_name, usage);
            return false;
        }
        *opts[k].val = (uint32_t)atoi(argv[i + 1]);
    }
    return true;
}

/* The current device's properties (its SM count: multiProcessorCount). */
static cudaDeviceProp probe_device(void)
{
    int dev = 0;
    cudaDeviceProp prop;
    CK(cudaGetDevice(&dev));
    CK(cudaGetDeviceProperties(&prop, dev));
    return prop;
}

/* The four GEMVs of a Llama-3-8B layer, rows x K: q/k/v, wo, gate/up, down. */
static const uint32_t PROBE_SHAPES[4][2] = {{6144, 4096}, {4096, 4096}, {28672, 4096}, {4096, 14336}};

/* The median of reps timings of f() on stream s (after one warm-up), ms. */
template <class F> static float probe_time(cudaStream_t s, uint32_t reps, F f)
{
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    std::vector<float> ms;
    for (uint32_t r = 0; r < reps + 1; r++) {
        CK(cudaEventRecord(e0, s));
        f();
        CK(cudaEventRecord(e1, s));
        CK(cudaEventSynchronize(e1));
        float t;
        CK(cudaEventElapsedTime(&t, e0, e1));
        if (r) /* the first is a warm-up */
            ms.push_back(t);
    }
    CK(cudaEventDestroy(e0));
    CK(cudaEventDestroy(e1));
    std::sort(ms.begin(), ms.end());
    return ms[ms.size() / 2];
}

/* The copy rate in GB/s: `bytes` copied device to device within buf (2 *
 * bytes long), bytes read + written. */
static double probe_copy_gbs(cudaStream_t s, uint8_t *buf, size_t bytes, uint32_t reps)
{
    const float ms = probe_time(s, reps, [&] { CK(cudaMemcpyAsync(buf + bytes, buf, bytes, cudaMemcpyDeviceToDevice, s)); });
    return 2.0 * bytes / (ms * 1e-3) / 1e9;
}

#endif /* TKV_GPU_PROBE_CUH */
