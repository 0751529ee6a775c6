/*
 * cuda-backend.cu -- the CUDA backend.
 *
 * So far: device discovery. The forward-pass ops (GEMMs through cuBLAS,
 * attention kernels) are not written yet; tkv_cuda_backend_create says so
 * with TKV_ERR_UNSUPPORTED rather than pretending.
 */
extern "C" {
#include "tkv-cuda.h"
}

#include <cuda_runtime.h>

extern "C" int tkv_cuda_device_count(void)
{
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        cudaGetLastError(); /* clear the sticky "no driver" error */
        return 0;
    }
    return n;
}

extern "C" tkv_status tkv_cuda_backend_create(uint32_t n_threads, struct tkv_backend **out)
{
    (void)n_threads;
    *out = NULL;
    int n = tkv_cuda_device_count();
    if (n == 0)
        return tkv_err(TKV_ERR_DEVICE, "cuda: no usable CUDA device (driver missing or no GPU)");
    return tkv_err(TKV_ERR_UNSUPPORTED,
                   "cuda: found %d device(s), but this build's CUDA forward pass is not implemented yet; use --device cpu", n);
}
