// Does nvJPEG's batched decode on the hardware JPEG engines wait for work queued on another
// stream? Queues ~60 ms of kernels on stream A (plain launches, or one CUDA graph), then decodes
// a batch of JPEGs on stream B, and prints how long the call held the host and whether A was
// still busy when it returned. Run it under several CUDA_DEVICE_MAX_CONNECTIONS values
// (docs/data.md, "Overlap with the step", has what it showed):
//   nvcc -O2 -arch=sm_90 scripts/nvjpeg_queues.cu -o nvjpeg_queues -lnvjpeg
//   for q in 4 8 16 32; do CUDA_DEVICE_MAX_CONNECTIONS=$q ./nvjpeg_queues JPEG_DIR 256; done
#include <cuda_runtime.h>
#include <nvjpeg.h>
#include "jpeg_files.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <string>
#include <vector>
#include <algorithm>
#include <chrono>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("CUDA %s at %d: %s\n", #x, __LINE__, cudaGetErrorString(e)); exit(1);} } while (0)
#define NJ(x) do { nvjpegStatus_t s = (x); if (s != NVJPEG_STATUS_SUCCESS) { printf("nvjpeg %s at %d: %d\n", #x, __LINE__, (int)s); exit(1);} } while (0)

static double now_ms() { return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

__global__ void busy(float *x, int iters) {
  float a = x[blockIdx.x * blockDim.x + threadIdx.x];
  for (int i = 0; i < iters; i++) a = a * 0.999f + 0.001f;
  x[blockIdx.x * blockDim.x + threadIdx.x] = a;
}

static int leak_malloc(void **p, size_t n) { return cudaMalloc(p, n) == cudaSuccess ? 0 : 1; }
static int leak_free(void *) { return 0; }
static int leak_hmalloc(void **p, size_t n, unsigned f) { return cudaHostAlloc(p, n, f) == cudaSuccess ? 0 : 1; }
static int leak_hfree(void *) { return 0; }

int main(int argc, char **argv) {
  if (argc < 3) { printf("usage: %s JPEG_DIR BATCH\n", argv[0]); return 2; }
  const char *dir = argv[1];
  int B = atoi(argv[2]);
  std::vector<unsigned char *> data;
  std::vector<size_t> lens;
  if (!read_jpegs(dir, B, data, lens)) return 1;
  cudaStream_t A, B_lo, B_hi;
  int lo, hi;
  CK(cudaDeviceGetStreamPriorityRange(&lo, &hi));
  CK(cudaStreamCreateWithFlags(&A, cudaStreamNonBlocking));
  CK(cudaStreamCreateWithPriority(&B_lo, cudaStreamNonBlocking, 0));
  CK(cudaStreamCreateWithPriority(&B_hi, cudaStreamNonBlocking, hi));
  float *x; int nblk = 132 * 8, nthr = 256;
  CK(cudaMalloc(&x, sizeof(float) * nblk * nthr));
  CK(cudaMemset(x, 0, sizeof(float) * nblk * nthr));
  // calibrate: one kernel ~0.2 ms
  int iters = 20000;
  cudaEvent_t e0, e1; CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
  for (int k = 0; k < 3; k++) {
    CK(cudaEventRecord(e0, A)); busy<<<nblk, nthr, 0, A>>>(x, iters); CK(cudaEventRecord(e1, A)); CK(cudaEventSynchronize(e1));
    float ms; CK(cudaEventElapsedTime(&ms, e0, e1));
    iters = (int)(iters * 0.2 / ms);
  }
  int K = 300; // ~60 ms queued
  printf("busy kernel iters %d, %d launches ≈ %.0f ms\n", iters, K, K * 0.2);
  cudaGraph_t g; cudaGraphExec_t ge;
  CK(cudaStreamBeginCapture(A, cudaStreamCaptureModeThreadLocal));
  for (int k = 0; k < K; k++) busy<<<nblk, nthr, 0, A>>>(x, iters);
  CK(cudaStreamEndCapture(A, &g));
  CK(cudaGraphInstantiate(&ge, g, 0));

  // allocators of the caller's (here: never freeing), a pre-allocated pool and interleaved RGB,
  // as vitscale decodes; nvJPEG's own allocators, no pool and planar RGB behaved the same
  {
    const int alloc = 1, pre = 1, fmt = 0;
    nvjpegHandle_t h; nvjpegJpegState_t st;
    nvjpegDevAllocator_t da = {leak_malloc, leak_free};
    nvjpegPinnedAllocator_t pa = {leak_hmalloc, leak_hfree};
    if (nvjpegCreateEx(NVJPEG_BACKEND_HARDWARE, alloc ? &da : NULL, alloc ? &pa : NULL, 0, &h) != NVJPEG_STATUS_SUCCESS) { printf("no hardware backend\n"); return 0; }
    NJ(nvjpegJpegStateCreate(h, &st));
    nvjpegOutputFormat_t of = fmt ? NVJPEG_OUTPUT_RGB : NVJPEG_OUTPUT_RGBI;
    std::vector<nvjpegImage_t> out(B);
    int maxw = 0, maxh = 0;
    for (int i = 0; i < B; i++) {
      int nc; nvjpegChromaSubsampling_t ss; int w[4], hh[4];
      NJ(nvjpegGetImageInfo(h, data[i], lens[i], &nc, &ss, w, hh));
      maxw = std::max(maxw, w[0]); maxh = std::max(maxh, hh[0]);
      memset(&out[i], 0, sizeof(nvjpegImage_t));
      if (fmt) { for (int c = 0; c < 3; c++) { CK(cudaMalloc(&out[i].channel[c], w[0] * hh[0])); out[i].pitch[c] = w[0]; } }
      else { CK(cudaMalloc(&out[i].channel[0], w[0] * hh[0] * 3)); out[i].pitch[0] = w[0] * 3; }
    }
    if (pre) { nvjpegStatus_t s = nvjpegDecodeBatchedPreAllocate(h, st, B, maxw, maxh, NVJPEG_CSS_420, of); if (s) printf("preallocate status %d\n", (int)s); }
    NJ(nvjpegDecodeBatchedInitialize(h, st, B, 1, of));
    // scenarios: 0 alone, 1 plain launches on A + decode on B_lo, 2 same on B_hi, 3 graph on A + B_hi
    for (int sc = 0; sc < 4; sc++) {
      cudaStream_t S = sc == 1 ? B_lo : B_hi;
      double call[5], total[5], adone[5]; int busy_after = 0;
      for (int r = 0; r < 6; r++) {
        CK(cudaDeviceSynchronize());
        double t0 = now_ms();
        if (sc == 1 || sc == 2) for (int k = 0; k < K; k++) busy<<<nblk, nthr, 0, A>>>(x, iters);
        if (sc == 3) CK(cudaGraphLaunch(ge, A));
        double t1 = now_ms();
        NJ(nvjpegDecodeBatched(h, st, (const unsigned char *const *)data.data(), lens.data(), out.data(), S));
        double t2 = now_ms();
        bool abusy = cudaStreamQuery(A) == cudaErrorNotReady;
        CK(cudaStreamSynchronize(S));
        double t3 = now_ms();
        CK(cudaStreamSynchronize(A));
        double t4 = now_ms();
        if (r == 0) continue; // warm-up
        call[r - 1] = t2 - t1; total[r - 1] = t3 - t1; adone[r - 1] = t4 - t0; busy_after += abusy;
      }
      std::sort(call, call + 5); std::sort(total, total + 5); std::sort(adone, adone + 5);
      const char *names[] = {"alone", "queued plain, B normal prio", "queued plain, B high prio", "queued graph, B high prio"};
      printf("alloc=%s pre=%d fmt=%s | %-28s | call %.2f ms, call+sync %.2f ms, A busy after call %d/5, A done at %.1f ms\n",
             alloc ? "custom" : "default", pre, fmt ? "RGB" : "RGBI", names[sc], call[2], total[2], busy_after, adone[2]);
    }
    for (int i = 0; i < B; i++) for (int c = 0; c < 3; c++) if (out[i].channel[c]) cudaFree(out[i].channel[c]);
    nvjpegJpegStateDestroy(st); nvjpegDestroy(h);
  }
  return 0;
}
