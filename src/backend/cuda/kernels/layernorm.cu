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
