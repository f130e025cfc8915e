// What does nvJPEG's batched decode on the hardware JPEG engines cost work running beside it,
// for each output format? For RGBI, RGB, YUV and Y: the call's time alone, then how much longer
// a run of bf16 matrix products on one stream takes while a batch decodes on another
// (high-priority) stream, against the same products alone, alternating. Run it under
// `ncu --print-summary per-kernel` (with ONLY_ALONE=1) to list the kernels each format launches.
//   nvcc -O2 -arch=sm_90 scripts/nvjpeg_formats.cu -o nvjpeg_formats -lnvjpeg -lcublas
//   CUDA_DEVICE_MAX_CONNECTIONS=32 ./nvjpeg_formats JPEG_DIR 256
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cublas_v2.h>
#include <nvjpeg.h>
#include "jpeg_files.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <vector>
#include <algorithm>
#include <chrono>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("CUDA %s at %d: %s\n", #x, __LINE__, cudaGetErrorString(e)); exit(1);} } while (0)
#define NJ(x) do { nvjpegStatus_t s = (x); if (s != NVJPEG_STATUS_SUCCESS) { printf("nvjpeg %s at %d: %d\n", #x, __LINE__, (int)s); exit(1);} } while (0)
#define CB(x) do { cublasStatus_t s = (x); if (s != CUBLAS_STATUS_SUCCESS) { printf("cublas %s at %d: %d\n", #x, __LINE__, (int)s); exit(1);} } while (0)

static double now_ms() { return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
static double median(std::vector<double> v) { std::sort(v.begin(), v.end()); return v[v.size() / 2]; }

int main(int argc, char **argv) {
  if (argc < 3) { printf("usage: %s JPEG_DIR BATCH\n", argv[0]); return 2; }
  const char *dir = argv[1];
  int B = atoi(argv[2]);
  bool only_alone = getenv("ONLY_ALONE") != nullptr;
  std::vector<unsigned char *> data;
  std::vector<size_t> lens;
  if (!read_jpegs(dir, B, data, lens)) return 1;
  int lo, hi;
  CK(cudaDeviceGetStreamPriorityRange(&lo, &hi));
  cudaStream_t A, S;
  CK(cudaStreamCreateWithFlags(&A, cudaStreamNonBlocking));
  CK(cudaStreamCreateWithPriority(&S, cudaStreamNonBlocking, hi));

  // the work beside the decode: bf16 products of 4096 × 4096 × 2048, about 7 ms of them on an H100
  const int M = 4096, N = 4096, K = 2048, REPS = 80;
  cublasHandle_t cb; CB(cublasCreate(&cb)); CB(cublasSetStream(cb, A));
  __nv_bfloat16 *ga, *gb, *gc;
  CK(cudaMalloc(&ga, sizeof(__nv_bfloat16) * M * K)); CK(cudaMalloc(&gb, sizeof(__nv_bfloat16) * K * N)); CK(cudaMalloc(&gc, sizeof(__nv_bfloat16) * M * N));
  CK(cudaMemset(ga, 0x3c, sizeof(__nv_bfloat16) * M * K)); CK(cudaMemset(gb, 0x3c, sizeof(__nv_bfloat16) * K * N));
  float one = 1.f, zero = 0.f;
  auto products = [&]() {
    for (int r = 0; r < REPS; r++)
      CB(cublasGemmEx(cb, CUBLAS_OP_N, CUBLAS_OP_N, M, N, K, &one, ga, CUDA_R_16BF, M, gb, CUDA_R_16BF, K, &zero, gc, CUDA_R_16BF, M, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  };
  cudaEvent_t e0, e1; CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));

  nvjpegDevAllocator_t da = {[](void **p, size_t n) { return cudaMalloc(p, n) == cudaSuccess ? 0 : 1; }, [](void *) { return 0; }};
  nvjpegPinnedAllocator_t pa = {[](void **p, size_t n, unsigned f) { return cudaHostAlloc(p, n, f) == cudaSuccess ? 0 : 1; }, [](void *) { return 0; }};
  nvjpegHandle_t h;
  if (nvjpegCreateEx(NVJPEG_BACKEND_HARDWARE, &da, &pa, 0, &h) != NVJPEG_STATUS_SUCCESS) { printf("no hardware backend\n"); return 0; }
  struct Fmt { nvjpegOutputFormat_t f; const char *name; };
  const Fmt fmts[] = {{NVJPEG_OUTPUT_RGBI, "RGBI"}, {NVJPEG_OUTPUT_RGB, "RGB"}, {NVJPEG_OUTPUT_YUV, "YUV"}, {NVJPEG_OUTPUT_Y, "Y"}};
  const char *only = getenv("ONLY_FORMAT");
  for (const Fmt &fm : fmts) {
    if (only && strcmp(only, fm.name)) continue;
    nvjpegJpegState_t st;
    NJ(nvjpegJpegStateCreate(h, &st));
    std::vector<nvjpegImage_t> out(B);
    int maxw = 0, maxh = 0, css420 = 0;
    for (int i = 0; i < B; i++) {
      int nc; nvjpegChromaSubsampling_t ss; int w[4], hh[4];
      NJ(nvjpegGetImageInfo(h, data[i], lens[i], &nc, &ss, w, hh));
      css420 += ss == NVJPEG_CSS_420;
      maxw = std::max(maxw, w[0]); maxh = std::max(maxh, hh[0]);
      memset(&out[i], 0, sizeof(nvjpegImage_t));
      switch (fm.f) {
        case NVJPEG_OUTPUT_RGBI: CK(cudaMalloc(&out[i].channel[0], (size_t)w[0] * hh[0] * 3)); out[i].pitch[0] = w[0] * 3; break;
        case NVJPEG_OUTPUT_RGB: for (int c = 0; c < 3; c++) { CK(cudaMalloc(&out[i].channel[c], (size_t)w[0] * hh[0])); out[i].pitch[c] = w[0]; } break;
        case NVJPEG_OUTPUT_YUV: for (int c = 0; c < nc; c++) { CK(cudaMalloc(&out[i].channel[c], (size_t)w[c] * hh[c])); out[i].pitch[c] = w[c]; } break;
        default: CK(cudaMalloc(&out[i].channel[0], (size_t)w[0] * hh[0])); out[i].pitch[0] = w[0]; break;
      }
    }
    nvjpegStatus_t s = nvjpegDecodeBatchedPreAllocate(h, st, B, maxw, maxh, NVJPEG_CSS_420, fm.f);
    if (s) printf("%s: preallocate status %d\n", fm.name, (int)s);
    s = nvjpegDecodeBatchedInitialize(h, st, B, 1, fm.f);
    if (s) { printf("%s: batched initialize status %d, skipped\n", fm.name, (int)s); continue; }
    auto decode = [&]() { return nvjpegDecodeBatched(h, st, (const unsigned char *const *)data.data(), lens.data(), out.data(), S); };
    std::vector<double> alone;
    for (int r = 0; r < (only_alone ? 2 : 6); r++) {
      CK(cudaDeviceSynchronize());
      double t0 = now_ms();
      s = decode();
      if (s) { printf("%s: decode status %d\n", fm.name, (int)s); break; }
      CK(cudaStreamSynchronize(S));
      if (r) alone.push_back(now_ms() - t0);
    }
    if (s) continue;
    printf("%s: %d images (%d 4:2:0), call + sync alone %.2f ms\n", fm.name, B, css420, median(alone));
    if (only_alone) continue;
    // products alone and with one batch decoding beside them, alternating
    std::vector<double> plain, beside;
    for (int r = 0; r < 16; r++) {
      bool with = r % 2;
      CK(cudaDeviceSynchronize());
      CK(cudaEventRecord(e0, A)); products(); CK(cudaEventRecord(e1, A));
      if (with) NJ(decode());
      CK(cudaDeviceSynchronize());
      float ms; CK(cudaEventElapsedTime(&ms, e0, e1));
      if (r >= 2) (with ? beside : plain).push_back(ms);
    }
    double p = median(plain), b = median(beside);
    printf("%s: %d products alone %.3f ms, with a batch decoding beside them %.3f ms: +%.3f ms (%.1f %%)\n", fm.name, REPS, p, b, b - p, 100 * (b - p) / p);
    for (int i = 0; i < B; i++) for (int c = 0; c < 4; c++) if (out[i].channel[c]) cudaFree(out[i].channel[c]);
    nvjpegJpegStateDestroy(st);
  }
  nvjpegDestroy(h);
  return 0;
}
