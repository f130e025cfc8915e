// LayerNorm over the last dim with fp32 statistics. One warp per row.

// inp (R, C) → out (R, C), mean (R), rstd (R). w/b are element offsets into params.
extern "C" __global__ void layernorm_fwd_kernel(void* out, int dto, void* mean, void* rstd, int dts,
                                                const void* inp, int dti, const void* params, int dtw,
                                                i64 w, i64 bo, i64 rows, int c, float eps) {
    int warps = blockDim.x >> 5, lane = threadIdx.x & 31;
    for (i64 r = (i64)blockIdx.x * warps + (threadIdx.x >> 5); r < rows; r += (i64)gridDim.x * warps) {
        i64 base = r * c;
        float s = 0.f;
        for (int i = lane; i < c; i += 32) s += ldx(inp, dti, base + i);
        float mu = warp_sum(s) / c;
        float v = 0.f;
        for (int i = lane; i < c; i += 32) { float d = ldx(inp, dti, base + i) - mu; v += d * d; }
        float rs = rsqrtf(warp_sum(v) / c + eps);
        for (int i = lane; i < c; i += 32) {
            float xh = (ldx(inp, dti, base + i) - mu) * rs;
            stx(out, dto, base + i, xh * ldx(params, dtw, w + i) + ldx(params, dtw, bo + i));
        }
        if (lane == 0) { stx(mean, dts, r, mu); stx(rstd, dts, r, rs); }
    }
}

// dinp = dres + rstd·(dn − mean(dn) − x̂·mean(dn·x̂)), dn = dout·w; dw += Σ dout·x̂; db += Σ dout.
// Each warp accumulates dw/db for its rows in its own shared-memory row (no atomics); the
// block sums its warps' rows and adds them to dparams with one atomic per column.
// Dynamic shared memory: warps · 2 · C floats.
extern "C" __global__ void layernorm_bwd_kernel(void* dinp, int dtd, float* dparams, const void* dout, int dto,
                                                const void* dres, int dtr, const void* inp, int dti,
                                                const void* mean, const void* rstd, int dts,
                                                const void* params, int dtw, i64 w, i64 bo,
                                                i64 rows, int c) {
    extern __shared__ float sh[];
    int warps = blockDim.x >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    float* sdw = sh + (i64)warp * 2 * c;
    float* sdb = sdw + c;
    for (int i = lane; i < 2 * c; i += 32) sdw[i] = 0.f;
    for (i64 r = (i64)blockIdx.x * warps + warp; r < rows; r += (i64)gridDim.x * warps) {
        i64 base = r * c;
        float mu = ldx(mean, dts, r), rs = ldx(rstd, dts, r);
        float a = 0.f, bsum = 0.f;
        for (int i = lane; i < c; i += 32) {
            float g = ldx(dout, dto, base + i);
            float xh = (ldx(inp, dti, base + i) - mu) * rs;
            float dn = g * ldx(params, dtw, w + i);
            a += dn;
            bsum += dn * xh;
            sdw[i] += g * xh;
            sdb[i] += g;
        }
        a = warp_sum(a) / c;
        bsum = warp_sum(bsum) / c;
        for (int i = lane; i < c; i += 32) {
            float g = ldx(dout, dto, base + i);
            float xh = (ldx(inp, dti, base + i) - mu) * rs;
            float dn = g * ldx(params, dtw, w + i);
            float d = rs * (dn - a - xh * bsum);
            if (dres) d += ldx(dres, dtr, base + i);
            stx(dinp, dtd, base + i, d);
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < 2 * c; i += blockDim.x) {
        float s = 0.f;
        for (int k = 0; k < warps; k++) s += sh[(i64)k * 2 * c + i];
        atomicAdd(dparams + (i < c ? w + i : bo + (i - c)), s);
    }
}

// ---- Fast path: bf16 activations and weights, f32 statistics, C = 32·J. Each lane keeps its
// J columns of a row in registers, so all of a row's loads are in flight at once (the generic
// kernels above are latency-bound at one dependent load per iteration).

template <int J>
__device__ __forceinline__ void ln_fwd_t(bf16* out, float* mean, float* rstd, const bf16* inp,
                                         const bf16* params, i64 w, i64 bo, i64 rows, float eps) {
    const int c = 32 * J;
    int warps = blockDim.x >> 5, lane = threadIdx.x & 31;
    float wv[J], bv[J];
    #pragma unroll
    for (int j = 0; j < J; j++) { wv[j] = bf2f(params[w + lane + 32 * j]); bv[j] = bf2f(params[bo + lane + 32 * j]); }
    for (i64 r = (i64)blockIdx.x * warps + (threadIdx.x >> 5); r < rows; r += (i64)gridDim.x * warps) {
        const bf16* x = inp + r * c;
        float v[J];
        float s = 0.f;
        #pragma unroll
        for (int j = 0; j < J; j++) { v[j] = bf2f(x[lane + 32 * j]); s += v[j]; }
        float mu = warp_sum(s) / c;
        float q = 0.f;
        #pragma unroll
        for (int j = 0; j < J; j++) { float d = v[j] - mu; q += d * d; }
        float rs = rsqrtf(warp_sum(q) / c + eps);
        bf16* o = out + r * c;
        #pragma unroll
        for (int j = 0; j < J; j++) o[lane + 32 * j] = f2bf((v[j] - mu) * rs * wv[j] + bv[j]);
        if (lane == 0) { mean[r] = mu; rstd[r] = rs; }
    }
}

template <int J>
__device__ __forceinline__ void ln_bwd_t(bf16* dinp, float* partial, const bf16* dout, const bf16* dres,
                                         const bf16* inp, const float* mean, const float* rstd,
                                         const bf16* params, i64 w, i64 bo, i64 rows) {
    const int c = 32 * J;
    __shared__ float sh[2 * 32 * 32];
    int warps = blockDim.x >> 5, lane = threadIdx.x & 31;
    for (int i = threadIdx.x; i < 2 * c; i += blockDim.x) sh[i] = 0.f;
    __syncthreads();
    float wv[J], aw[J], ab[J];
    #pragma unroll
    for (int j = 0; j < J; j++) { wv[j] = bf2f(params[w + lane + 32 * j]); aw[j] = 0.f; ab[j] = 0.f; }
    for (i64 r = (i64)blockIdx.x * warps + (threadIdx.x >> 5); r < rows; r += (i64)gridDim.x * warps) {
        const bf16* g = dout + r * c;
        const bf16* x = inp + r * c;
        float mu = mean[r], rs = rstd[r];
        float gv[J], xh[J];
        float a = 0.f, bs = 0.f;
        #pragma unroll
        for (int j = 0; j < J; j++) {
            gv[j] = bf2f(g[lane + 32 * j]);
            xh[j] = (bf2f(x[lane + 32 * j]) - mu) * rs;
            float dn = gv[j] * wv[j];
            a += dn;
            bs += dn * xh[j];
            aw[j] += gv[j] * xh[j];
            ab[j] += gv[j];
        }
        a = warp_sum(a) / c;
        bs = warp_sum(bs) / c;
        bf16* dx = dinp + r * c;
        const bf16* dr = dres ? dres + r * c : 0;
        #pragma unroll
        for (int j = 0; j < J; j++) {
            float d = rs * (gv[j] * wv[j] - a - xh[j] * bs);
            if (dr) d += bf2f(dr[lane + 32 * j]);
            dx[lane + 32 * j] = f2bf(d);
        }
    }
    #pragma unroll
    for (int j = 0; j < J; j++) { atomicAdd(sh + lane + 32 * j, aw[j]); atomicAdd(sh + c + lane + 32 * j, ab[j]); }
    __syncthreads();
    // One row of partial sums per block (reduce_partials adds them up): thousands of
    // atomics on the same 2·C addresses would serialize in one L2 slice.
    for (int i = threadIdx.x; i < 2 * c; i += blockDim.x) partial[(i64)blockIdx.x * 2 * c + i] = sh[i];
}

#define LN_INSTANCE(J) \
extern "C" __global__ void layernorm_fwd_c##J(bf16* out, float* mean, float* rstd, const bf16* inp, \
        const bf16* params, i64 w, i64 bo, i64 rows, float eps) { ln_fwd_t<J>(out, mean, rstd, inp, params, w, bo, rows, eps); } \
extern "C" __global__ void layernorm_bwd_c##J(bf16* dinp, float* partial, const bf16* dout, const bf16* dres, \
        const bf16* inp, const float* mean, const float* rstd, const bf16* params, i64 w, i64 bo, i64 rows) { \
    ln_bwd_t<J>(dinp, partial, dout, dres, inp, mean, rstd, params, w, bo, rows); }
LN_INSTANCE(1) LN_INSTANCE(2) LN_INSTANCE(3) LN_INSTANCE(4) LN_INSTANCE(6) LN_INSTANCE(8)
LN_INSTANCE(12) LN_INSTANCE(16) LN_INSTANCE(24) LN_INSTANCE(32)
