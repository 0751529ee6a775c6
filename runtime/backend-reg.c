/*
 * backend-reg.c -- the one place that knows which backends were compiled in
 * (the only #ifdef TKV_USE_CUDA in the tree).
 */
#include "backend.h"
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

static tkv_backend_factory test_factory;

void tkv_backend_set_test_factory(tkv_backend_factory make) { test_factory = make; }

tkv_status tkv_backend_create(const char *device, uint32_t n_threads, struct tkv_backend **out)
{
    *out = NULL;
    if (test_factory && device && test_factory(device, n_threads, out) == TKV_OK && *out)
        return TKV_OK;
    *out = NULL;
    if (!device || !strcmp(device, "cpu"))
        return tkv_cpu_backend_create(n_threads, out);
    if (!strcmp(device, "cuda") || !strcmp(device, "auto")) {
#ifdef TKV_USE_CUDA
        tkv_status st = tkv_cuda_backend_create(n_threads, out);
        if (st == TKV_OK || !strcmp(device, "cuda"))
            return st;
        TKV_LOG_I("device auto: %s; using the CPU", tkv_last_error());
#else
        if (!strcmp(device, "cuda"))
            return tkv_err(TKV_ERR_UNSUPPORTED, "device 'cuda': this build has no CUDA backend (configure with -DTKV_CUDA=ON)");
#endif
        return tkv_cpu_backend_create(n_threads, out);
    }
    return tkv_err(TKV_ERR_INVALID_ARG, "unknown device '%s' (expected cpu, cuda or auto)", device);
}
