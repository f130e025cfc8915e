// Shared helpers, prepended to every kernel file before NVRTC compiles it (no CUDA headers are
// needed, so a driver plus libnvrtc is all a user must have).
//
// The 16-bit compute format is chosen when a module is compiled: bf16 by default, IEEE fp16
// when the host passes -DVITSCALE_HALF_F16 (fp16 compute, and GPUs before Ampere, which have no
// bf16 arithmetic). One source serves both: `bf16` below names the 16-bit storage word of
// whichever format the module was built for, and bf2f / f2bf2 / f2bf / lo16 / hi16 convert it,
// so the kernels never look at the bits themselves.
//
// dtype codes passed to kernels as `int dt`: 0 = f32, 1 = the module's 16-bit format, 2 = bf16
// whatever the module's format (the bf16 gradient wire of an fp16 run; only ldx / stx know it).

typedef unsigned short bf16;
typedef long long i64;
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

// bf16 proper, independent of the module's format (the dt = 2 buffers).
__device__ __forceinline__ float bf16_bits_to_f(unsigned short x) { return __uint_as_float(((unsigned)x) << 16); }

// Two f32 → bf16 (round to nearest even; NaN stays NaN, ±inf and overflow give ±inf), `lo` in
// the low half. From sm_80 one cvt instruction does both: the integer rounding it replaces
// cost ~7 instructions per value, and the GELU passes are bound by instruction issue, not memory.
__device__ __forceinline__ unsigned f2bf16x2(float lo, float hi) {
#if __CUDA_ARCH__ >= 800
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
#else
    unsigned w[2];
    const float f[2] = {lo, hi};
    #pragma unroll
    for (int k = 0; k < 2; k++) {
        unsigned u = __float_as_uint(f[k]);
        if ((u & 0x7fffffffu) > 0x7f800000u) w[k] = (u >> 16) | 0x40u;
        else w[k] = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    }
    return (w[0] & 0xffffu) | (w[1] << 16);
#endif
}

#ifdef VITSCALE_HALF_F16
// IEEE fp16: 10 mantissa bits (relative step 2^-11), largest finite 65504. Conversions by cvt,
// which every architecture has: round to nearest even, values past the range become ±inf and
// NaN stays NaN, so an overflowing gradient reaches the loss scaler's overflow check.
#define HALF_PTX "f16"
__device__ __forceinline__ float bf2f(bf16 x) {
    float f;
    asm("cvt.f32.f16 %0, %1;\n" : "=f"(f) : "h"(x));
    return f;
}
__device__ __forceinline__ unsigned f2bf2(float lo, float hi) {
#if __CUDA_ARCH__ >= 800
    unsigned r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
#else
    unsigned short a, b;
    asm("cvt.rn.f16.f32 %0, %1;\n" : "=h"(a) : "f"(lo));
    asm("cvt.rn.f16.f32 %0, %1;\n" : "=h"(b) : "f"(hi));
    return (unsigned)a | ((unsigned)b << 16);
#endif
}
// Packed pairs (low half first) as f32.
__device__ __forceinline__ float lo16(unsigned w) { return bf2f((bf16)(w & 0xffffu)); }
__device__ __forceinline__ float hi16(unsigned w) { return bf2f((bf16)(w >> 16)); }
#else
#define HALF_PTX "bf16"
__device__ __forceinline__ float bf2f(bf16 x) { return bf16_bits_to_f(x); }
__device__ __forceinline__ unsigned f2bf2(float lo, float hi) { return f2bf16x2(lo, hi); }
// Packed pairs (low half first) as f32: a shift or a mask, no conversion instruction.
__device__ __forceinline__ float lo16(unsigned w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float hi16(unsigned w) { return __uint_as_float(w & 0xffff0000u); }
#endif

// One f32 → the module's 16-bit format, as f2bf2.
__device__ __forceinline__ bf16 f2bf(float f) { return (bf16)(f2bf2(f, 0.f) & 0xffffu); }

// Element i of a buffer of any dtype code, as f32.
__device__ __forceinline__ float ldx(const void* p, int dt, i64 i) {
    if (dt == 1) return bf2f(((const bf16*)p)[i]);
    if (dt == 2) return bf16_bits_to_f(((const unsigned short*)p)[i]);
    return ((const float*)p)[i];
}
__device__ __forceinline__ void stx(void* p, int dt, i64 i, float v) {
    if (dt == 1) ((bf16*)p)[i] = f2bf(v);
    else if (dt == 2) ((unsigned short*)p)[i] = (unsigned short)(f2bf16x2(v, 0.f) & 0xffffu);
    else ((float*)p)[i] = v;
}

__device__ __forceinline__ float warp_sum(float v) {
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// erf GELU (timm's nn.GELU default) and its derivative, x·Φ(x) and Φ(x) + x·φ(x). Φ by
// Abramowitz & Stegun 26.2.17: for x ≥ 0, 1 − Φ(x) = φ(x)·(b1·t + … + b5·t⁵), t = 1/(1 + p·x),
// absolute error < 7.5e-8 (≤ 4e-7 for gelu over [−8, 8] in f32 against f64 erf); φ(x) =
// e^(−x²/2)/√(2π) as one exponential whose argument carries the 1/√(2π), so the derivative reuses
// it: one exponential and one reciprocal per value — these kernels were bound by arithmetic, not
// bandwidth. (This is the erfc form A&S 7.1.26 with its constants rescaled, which saves two
// multiplies.) The outputs are bf16 (relative step 2^-8), far coarser than the approximation.
// NaN in, NaN out.
__device__ __forceinline__ float gelu_cdf(float x, float* density) {
    const float t = __fdividef(1.0f, fmaf(0.2316419f, fabsf(x), 1.0f));
    const float poly = t * fmaf(t, fmaf(t, fmaf(t, fmaf(t, 1.330274429f, -1.821255978f), 1.781477937f), -0.356563782f), 0.319381530f);
    const float phi = exp2f(fmaf(x, -0.72134752044448170f * x, -1.3257480647361592f));  // φ(x)
    const float q = poly * phi;                                                          // 1 − Φ(|x|)
    *density = phi;
    return x >= 0.0f ? 1.0f - q : q;
}
__device__ __forceinline__ float gelu_f(float x) {
    float phi;
    return x * gelu_cdf(x, &phi);
}
__device__ __forceinline__ float dgelu_f(float x) {
    float phi;
    const float cdf = gelu_cdf(x, &phi);
    return fmaf(x, phi, cdf);
}

// Two f32 as a packed pair (16-byte kernels, GEMM epilogues); lo16 / hi16 above read them.
__device__ __forceinline__ unsigned pk16(float a, float b) { return f2bf2(a, b); }
// a + b for packed bf16 pairs, in f32 and rounded once (residual adds, position embedding)
__device__ __forceinline__ unsigned add_w(unsigned a, unsigned b) { return pk16(lo16(a) + lo16(b), hi16(a) + hi16(b)); }

// gelu(p + b) and d·gelu'(p + b) for packed bf16 pairs. The MLP's pre-activation is the fc1
// product without its bias (pre) plus the bias (one bf16 per column), added here in f32: the
// GEMM runs without a bias epilogue. Shared by the GELU passes and the Hopper GEMM epilogues,
// so the fused and separate paths round alike.
__device__ __forceinline__ unsigned gelu_bias_w(unsigned p, unsigned b) {
    return pk16(gelu_f(lo16(p) + lo16(b)), gelu_f(hi16(p) + hi16(b)));
}
__device__ __forceinline__ unsigned dgelu_bias_w(unsigned d, unsigned p, unsigned b) {
    return pk16(lo16(d) * dgelu_f(lo16(p) + lo16(b)), hi16(d) * dgelu_f(hi16(p) + hi16(b)));
}

// gelu(p + b) and gelu'(p + b) together for a packed bf16 pair: the forward can save the
// derivative instead of the pre-activation, so that the backward multiplies instead of
// re-evaluating the erf.
__device__ __forceinline__ unsigned gelu_and_grad_w(unsigned p, unsigned b, unsigned* grad) {
    float phi0, phi1;
    const float x0 = lo16(p) + lo16(b), x1 = hi16(p) + hi16(b);
    const float c0 = gelu_cdf(x0, &phi0), c1 = gelu_cdf(x1, &phi1);
    *grad = pk16(fmaf(x0, phi0, c0), fmaf(x1, phi1, c1));
    return pk16(x0 * c0, x1 * c1);
}
// d·g for packed bf16 pairs (g a saved GELU derivative), in f32, rounded once.
__device__ __forceinline__ unsigned mul_w(unsigned d, unsigned g) { return pk16(lo16(d) * lo16(g), hi16(d) * hi16(g)); }

// Shared-memory address of a generic pointer into shared memory.
__device__ __forceinline__ unsigned smem_u32(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

// Asynchronous global → shared copies of 16 or 4 bytes (cp.async, sm_80 on); `valid` false
// zero-fills the destination instead (rows past a sequence's end).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(smem)), "l"(gmem), "r"(valid ? 16 : 0) : "memory");
}
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_u32(smem)), "l"(gmem), "r"(valid ? 4 : 0) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

// Maximum over the 4 lanes of a quad (the lanes that hold one row's columns).
__device__ __forceinline__ float quad_max(float v) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
    return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}

// The end of the (32, 8)-block column sums (bias_grad_v8, gelu_bwd_bias_v8 in elementwise.cu,
// flash_dq_store_sums in flash.cu): each thread holds 8 adjacent columns' sums over its rows;
// the 8 block-rows are combined in a fixed order and row blockIdx.y of `dbias` (splits × oc)
// receives the block's 256 columns.
__device__ __forceinline__ void block_column_partials(const float (&acc)[8], float* dbias, int oc) {
    __shared__ float part[8][256 + 4];
    #pragma unroll
    for (int k = 0; k < 8; k++) part[threadIdx.y][threadIdx.x * 8 + k] = acc[k];
    __syncthreads();
    int t = threadIdx.y * 32 + threadIdx.x;
    int c = blockIdx.x * 256 + t;
    if (c < oc) {
        float s = 0.f;
        #pragma unroll
        for (int k = 0; k < 8; k++) s += part[k][t];
        dbias[(i64)blockIdx.y * oc + c] = s;
    }
}

#define GRID_STRIDE(i, n) for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (i64)gridDim.x * blockDim.x)
