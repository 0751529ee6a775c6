/*
 * backend-reg.c -- the one place that knows which backends were compiled in
 * (the only #ifdef TKV_USE_CUDA in the tree).
 */
#include "backend.h"

#include <stdlib.h>
#include <string.h>
#include "../cpu/cpu.h"
#ifdef TKV_USE_CUDA
#include "../gpu/tkv-cuda.h"
#endif

int tkv_backend_cuda_devices(void)
{
#ifdef TKV_USE_CUDA
    return tkv_cuda_device_count();
#else
    return 0;
#endif
}

tkv_status tkv_backend_cuda_set_prefill_variant(struct tkv_backend *b, int variant)
{
#ifdef TKV_USE_CUDA
    return tkv_cuda_backend_set_prefill_variant(b, variant);
#else
    (void)b;
    return tkv_err(TKV_ERR_UNSUPPORTED, "prefill variant %d: this build has no CUDA backend", variant);
#endif
}

tkv_status tkv_backend_cuda_quantize_act(struct tkv_backend *b, uint32_t weight_type, const float *x, uint32_t n,
                                         uint32_t n_in, void *dst)
{
#ifdef TKV_USE_CUDA
    return tkv_cuda_backend_quantize_act(b, weight_type, x, n, n_in, dst);
#else
    (void)b, (void)x, (void)n, (void)n_in, (void)dst;
    return tkv_err(TKV_ERR_UNSUPPORTED, "quantize_act (type %u): this build has no CUDA backend", weight_type);
#endif
}

uint64_t tkv_backend_cuda_q8_reads(struct tkv_backend *b)
{
#ifdef TKV_USE_CUDA
    return tkv_cuda_backend_q8_reads(b);
#else
    (void)b;
    return 0;
#endif
}

const char *tkv_backend_cuda_prefill_variant_desc(int variant)
{
#ifdef TKV_USE_CUDA
    return tkv_cuda_prefill_variant_desc(variant);
#else
    (void)variant;
    return NULL;
#endif
}

static tkv_backend_factory test_factory;

void tkv_backend_set_test_factory(tkv_backend_factory make) { test_factory = make; }

/* "cuda" is device 0, "cuda:N" device N; -1 for any other name, -2 for a
 * "cuda:" suffix that is not a device number. */
static int cuda_index(const char *device)
{
    if (!strcmp(device, "cuda"))
        return 0;
    if (strncmp(device, "cuda:", 5))
        return -1;
    const char *p = device + 5;
    char *end = NULL;
    long n = *p >= '0' && *p <= '9' ? strtol(p, &end, 10) : -1;
    return n >= 0 && n < 1024 && end && !*end ? (int)n : -2;
}

tkv_status tkv_backend_create(const char *device, uint32_t n_threads, struct tkv_backend **out)
{
    *out = NULL;
    if (test_factory && device && test_factory(device, n_threads, out) == TKV_OK && *out)
        return TKV_OK;
    *out = NULL;
    if (!device || !strcmp(device, "cpu"))
        return tkv_cpu_backend_create(n_threads, out);
    const int cuda = cuda_index(device);
    if (cuda == -2)
        return tkv_err(TKV_ERR_INVALID_ARG, "device '%s': expected cuda:N with N a device number", device);
    if (cuda >= 0 || !strcmp(device, "auto")) {
#ifdef TKV_USE_CUDA
        tkv_status st = tkv_cuda_backend_create(cuda >= 0 ? cuda : 0, n_threads, out);
        if (st == TKV_OK || cuda >= 0)
            return st;
        TKV_LOG_I("device auto: %s; using the CPU", tkv_last_error());
#else
        if (cuda >= 0)
            return tkv_err(TKV_ERR_UNSUPPORTED, "device '%s': this build has no CUDA backend (configure with -DTKV_CUDA=ON)",
                           device);
#endif
        return tkv_cpu_backend_create(n_threads, out);
    }
    return tkv_err(TKV_ERR_INVALID_ARG, "unknown device '%s' (expected cpu, cuda, cuda:N or auto)", device);
}
