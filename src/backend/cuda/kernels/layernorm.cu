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
LN_INSTANCE(12) LN_INSTANCE(16) LN_INSTANCE(24) LN_INSTANCE(32) LN_INSTANCE(40) LN_INSTANCE(44)

// ---- Vectorized path (even J, rows aligned to the vector width). The J=24 register-row
// backward above holds 166 registers (one 256-thread block per SM, 8 warps: too few loads in
// flight for HBM) and issues 2-byte loads. Here each lane owns NV chunks of VW consecutive
// columns, loads each chunk as one vector, keeps rows packed as bf16 pairs (J/2 registers per
// tensor instead of J), and the kernels are capped at 128 registers so that two 256-thread
// blocks share an SM. Lane l's chunk k covers columns (32k + l)·VW … +VW.

template <int WPV> __device__ __forceinline__ void ldw(const bf16* p, unsigned* w) {
    if constexpr (WPV == 4) { uint4 u = *(const uint4*)p; w[0] = u.x; w[1] = u.y; w[2] = u.z; w[3] = u.w; }
    else if constexpr (WPV == 2) { uint2 u = *(const uint2*)p; w[0] = u.x; w[1] = u.y; }
    else { w[0] = *(const unsigned*)p; }
}
template <int WPV> __device__ __forceinline__ void stw(bf16* p, const unsigned* w) {
    if constexpr (WPV == 4) { *(uint4*)p = make_uint4(w[0], w[1], w[2], w[3]); }
    else if constexpr (WPV == 2) { *(uint2*)p = make_uint2(w[0], w[1]); }
    else { *(unsigned*)p = w[0]; }
}
__device__ __forceinline__ float wlo(unsigned w) { return lo16(w); }
__device__ __forceinline__ float whi(unsigned w) { return hi16(w); }
__device__ __forceinline__ float wel(const unsigned* w, int e) { return (e & 1) ? whi(w[e >> 1]) : wlo(w[e >> 1]); }
__device__ __forceinline__ unsigned wpack(float a, float b) { return f2bf2(a, b); }

template <int J> struct LnV {
    static constexpr int VW = (J % 8 == 0) ? 8 : (J % 4 == 0) ? 4 : 2;  // bf16 per vector
    static constexpr int NV = J / VW;                                  // vectors per lane
    static constexpr int WPV = VW / 2;                                 // 32-bit words per vector
    static constexpr int NW = J / 2;
    __device__ static __forceinline__ int col(int e, int lane) { return ((e / VW) * 32 + lane) * VW + (e % VW); }
};

// Element e of this lane's LayerNorm parameter (packed bf16 pairs): from its registers, or
// from the block's shared copy, where word i of lane l sits at 32·i + l (conflict-free).
template <bool SMEM>
__device__ __forceinline__ float ln_param(const unsigned* regs, const unsigned* shared, int e, int lane) {
    if constexpr (SMEM) {
        const unsigned word = shared[(e >> 1) * 32 + lane];
        return (e & 1) ? whi(word) : wlo(word);
    } else {
        return wel(regs, e);
    }
}

template <int J>
__device__ __forceinline__ void ln_fwd_v(bf16* out, float* mean, float* rstd, const bf16* inp,
                                         const bf16* params, i64 w, i64 bo, i64 rows, float eps) {
    typedef LnV<J> L;
    const int c = 32 * J;
    int warps = blockDim.x >> 5, lane = threadIdx.x & 31;
    // The weight and bias as packed pairs, each lane's words in the order it reads them: in
    // registers up to C = 768; past it in shared memory (word i of lane l at 32·i + l, so a
    // warp's reads are conflict-free), which lets more warps share an SM.
    constexpr bool SMEM_PARAMS = J > 24;
    constexpr int PW = SMEM_PARAMS ? 1 : L::NW;
    __shared__ unsigned sp[SMEM_PARAMS ? 2 * L::NW * 32 : 1];
    unsigned wp[PW], bp[PW];
    auto pair = [&](int e, i64 off) {
        const int k = L::col(e, lane);
        return (unsigned)params[off + k] | ((unsigned)params[off + k + 1] << 16);
    };
    if constexpr (SMEM_PARAMS) {
        if (threadIdx.x < 32) {
            #pragma unroll
            for (int e = 0; e < J; e += 2) {
                sp[(e >> 1) * 32 + lane] = pair(e, w);
                sp[(L::NW + (e >> 1)) * 32 + lane] = pair(e, bo);
            }
        }
        __syncthreads();
    } else {
        #pragma unroll
        for (int e = 0; e < J; e += 2) {
            wp[e >> 1] = pair(e, w);
            bp[e >> 1] = pair(e, bo);
        }
    }
    auto wgt = [&](int e) { return ln_param<SMEM_PARAMS>(wp, sp, e, lane); };
    auto bia = [&](int e) { return ln_param<SMEM_PARAMS>(bp, sp + L::NW * 32, e, lane); };
    // Two rows per warp per iteration, both loaded before either is reduced: a row is one
    // 16·J-byte load per lane followed by dependent reductions, so one row at a time left the
    // warp waiting on memory latency (DRAM ~30 % busy at C = 384).
    auto row = [&](i64 r, const unsigned (&xw)[L::NW]) {
        float s = 0.f;
        #pragma unroll
        for (int e = 0; e < J; e++) s += wel(xw, e);
        float mu = warp_sum(s) / c;
        float q = 0.f;
        #pragma unroll
        for (int e = 0; e < J; e++) { float d = wel(xw, e) - mu; q += d * d; }
        float rs = rsqrtf(warp_sum(q) / c + eps);
        unsigned ow[L::NW];
        #pragma unroll
        for (int e = 0; e < J; e += 2)
            ow[e >> 1] = wpack((wel(xw, e) - mu) * rs * wgt(e) + bia(e),
                               (wel(xw, e + 1) - mu) * rs * wgt(e + 1) + bia(e + 1));
        bf16* o = out + r * c;
        #pragma unroll
        for (int k = 0; k < L::NV; k++) stw<L::WPV>(o + (k * 32 + lane) * L::VW, ow + k * L::WPV);
        if (lane == 0) { mean[r] = mu; rstd[r] = rs; }
    };
    // (up to C = 768: beyond, the second row's words no longer fit in 128 registers; there the
    // parameters' registers go to more warps on each SM instead)
    constexpr int PER = J <= 24 ? 2 : 1;
    const i64 stride = (i64)gridDim.x * warps;
    for (i64 r = (i64)blockIdx.x * warps + (threadIdx.x >> 5); r < rows; r += PER * stride) {
        const i64 r2 = r + stride;
        const bool two = PER == 2 && r2 < rows;  // warp-uniform
        unsigned xa[L::NW], xb[L::NW];
        #pragma unroll
        for (int k = 0; k < L::NV; k++) ldw<L::WPV>(inp + r * c + (k * 32 + lane) * L::VW, xa + k * L::WPV);
        if (two) {
            #pragma unroll
            for (int k = 0; k < L::NV; k++) ldw<L::WPV>(inp + r2 * c + (k * 32 + lane) * L::VW, xb + k * L::WPV);
        }
        row(r, xa);
        if (two) row(r2, xb);
    }
}

// dw/db accumulate in per-warp shared-memory rows (each lane owns its slots, laid out so that
// a warp's vector accesses are conflict-free) rather than 2·J registers: with them in registers
// J = 24 needs > 128 registers and spills. Fixed 4 warps per block. NA = 3 adds a third row:
// the column sums of the bf16 dinp written (residual included) — the bias gradient of the
// layer whose output gradient dinp is (a block's proj, the previous block's fc2), taken here
// instead of a second pass over dinp; its partials follow dw's and db's (3·c per block).
// DYN: the rows in dynamic shared memory (4·NA·c floats, launched with that many bytes), for
// widths whose three rows pass the 48 KiB of static shared memory.
template <int J, int NA, bool DYN = false>
__device__ __forceinline__ void ln_bwd_v(bf16* dinp, float* partial, const bf16* dout, const bf16* dres,
                                         const bf16* inp, const float* mean, const float* rstd,
                                         const bf16* params, i64 w, i64 bo, i64 rows) {
    typedef LnV<J> L;
    const int c = 32 * J;
    constexpr int SW = (J % 4 == 0) ? 4 : 2;  // floats per accumulator access
    float* acc;
    if constexpr (DYN) {
        extern __shared__ __align__(16) float ln_acc_dyn[];
        acc = ln_acc_dyn;
    } else {
        __shared__ __align__(16) float ln_acc[4 * NA * 32 * J];
        acc = ln_acc;
    }
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int i = threadIdx.x; i < 4 * NA * c; i += blockDim.x) acc[i] = 0.f;
    __syncthreads();
    float* aw = acc + warp * NA * c;
    float* ab = aw + c;
    float* ad = ab + c;  // NA = 3 only
    // The weight as packed pairs: in registers up to C = 768, past it in shared memory (word i
    // of lane l at 32·i + l, conflict-free), which leaves room for more warps on each SM.
    constexpr bool SMEM_PARAMS = J > 24;
    __shared__ unsigned sp[SMEM_PARAMS ? L::NW * 32 : 1];
    unsigned wp[SMEM_PARAMS ? 1 : L::NW];
    #pragma unroll
    for (int e = 0; e < J; e += 2) {
        int k = L::col(e, lane);
        const unsigned pr = (unsigned)params[w + k] | ((unsigned)params[w + k + 1] << 16);
        if constexpr (SMEM_PARAMS) {
            if (warp == 0) sp[(e >> 1) * 32 + lane] = pr;
        } else {
            wp[e >> 1] = pr;
        }
    }
    if constexpr (SMEM_PARAMS) __syncthreads();
    auto wgt = [&](int e) { return ln_param<SMEM_PARAMS>(wp, sp, e, lane); };
    for (i64 r = (i64)blockIdx.x * 4 + warp; r < rows; r += (i64)gridDim.x * 4) {
        const bf16* g = dout + r * c;
        const bf16* x = inp + r * c;
        unsigned gw[L::NW], xw[L::NW], rw[L::NW];
        #pragma unroll
        for (int k = 0; k < L::NV; k++) {
            ldw<L::WPV>(g + (k * 32 + lane) * L::VW, gw + k * L::WPV);
            ldw<L::WPV>(x + (k * 32 + lane) * L::VW, xw + k * L::WPV);
        }
        if (dres) {
            const bf16* dr = dres + r * c;
            #pragma unroll
            for (int k = 0; k < L::NV; k++) ldw<L::WPV>(dr + (k * 32 + lane) * L::VW, rw + k * L::WPV);
        } else {
            #pragma unroll
            for (int i = 0; i < L::NW; i++) rw[i] = 0u;
        }
        float mu = mean[r], rs = rstd[r];
        float a = 0.f, bs = 0.f;
        #pragma unroll
        for (int q = 0; q < J / SW; q++) {
            float tw[SW], tb[SW];
            float* pw = aw + (q * 32 + lane) * SW;
            float* pb = ab + (q * 32 + lane) * SW;
            if constexpr (SW == 4) {
                float4 u = *(float4*)pw, v = *(float4*)pb;
                tw[0] = u.x; tw[1] = u.y; tw[2] = u.z; tw[3] = u.w;
                tb[0] = v.x; tb[1] = v.y; tb[2] = v.z; tb[3] = v.w;
            } else {
                float2 u = *(float2*)pw, v = *(float2*)pb;
                tw[0] = u.x; tw[1] = u.y; tb[0] = v.x; tb[1] = v.y;
            }
            #pragma unroll
            for (int i = 0; i < SW; i++) {
                int e = q * SW + i;
                float gv = wel(gw, e), xh = (wel(xw, e) - mu) * rs;
                float dn = gv * wgt(e);
                a += dn;
                bs += dn * xh;
                tw[i] += gv * xh;
                tb[i] += gv;
            }
            if constexpr (SW == 4) {
                *(float4*)pw = make_float4(tw[0], tw[1], tw[2], tw[3]);
                *(float4*)pb = make_float4(tb[0], tb[1], tb[2], tb[3]);
            } else {
                *(float2*)pw = make_float2(tw[0], tw[1]);
                *(float2*)pb = make_float2(tb[0], tb[1]);
            }
        }
        a = warp_sum(a) / c;
        bs = warp_sum(bs) / c;
        unsigned ow[L::NW];
        #pragma unroll
        for (int e = 0; e < J; e += 2) {
            float d0 = rs * (wel(gw, e) * wgt(e) - a - (wel(xw, e) - mu) * rs * bs) + wel(rw, e);
            float d1 = rs * (wel(gw, e + 1) * wgt(e + 1) - a - (wel(xw, e + 1) - mu) * rs * bs) + wel(rw, e + 1);
            ow[e >> 1] = wpack(d0, d1);
        }
        if constexpr (NA == 3) {
            #pragma unroll
            for (int q = 0; q < J / SW; q++) {
                float* pd = ad + (q * 32 + lane) * SW;
                if constexpr (SW == 4) {
                    float4 u = *(float4*)pd;
                    u.x += wel(ow, q * SW); u.y += wel(ow, q * SW + 1); u.z += wel(ow, q * SW + 2); u.w += wel(ow, q * SW + 3);
                    *(float4*)pd = u;
                } else {
                    float2 u = *(float2*)pd;
                    u.x += wel(ow, q * SW); u.y += wel(ow, q * SW + 1);
                    *(float2*)pd = u;
                }
            }
        }
        bf16* dx = dinp + r * c;
        #pragma unroll
        for (int k = 0; k < L::NV; k++) stw<L::WPV>(dx + (k * 32 + lane) * L::VW, ow + k * L::WPV);
    }
    __syncthreads();
    // Column i of the block's partial row: the warps' slots for it, summed in warp order.
    for (int i = threadIdx.x; i < c; i += blockDim.x) {
        int k = i / (32 * L::VW), ln = (i / L::VW) % 32, e = k * L::VW + i % L::VW;
        int slot = ((e / SW) * 32 + ln) * SW + e % SW;
        float sw = 0.f, sb = 0.f, sd = 0.f;
        #pragma unroll
        for (int wi = 0; wi < 4; wi++) {
            sw += acc[wi * NA * c + slot];
            sb += acc[wi * NA * c + c + slot];
            if constexpr (NA == 3) sd += acc[wi * NA * c + 2 * c + slot];
        }
        partial[(i64)blockIdx.x * NA * c + i] = sw;
        partial[(i64)blockIdx.x * NA * c + c + i] = sb;
        if constexpr (NA == 3) partial[(i64)blockIdx.x * NA * c + 2 * c + i] = sd;
    }
}

// The forward and backward for J; FB and BB are the blocks per SM their launch bounds ask for.
#define LNV_KERNELS(J, FB, BB) \
extern "C" __global__ void __launch_bounds__(256, FB) layernorm_fwd_v##J(bf16* out, float* mean, float* rstd, const bf16* inp, \
        const bf16* params, i64 w, i64 bo, i64 rows, float eps) { ln_fwd_v<J>(out, mean, rstd, inp, params, w, bo, rows, eps); } \
extern "C" __global__ void __launch_bounds__(128, BB) layernorm_bwd_v##J(bf16* dinp, float* partial, const bf16* dout, const bf16* dres, \
        const bf16* inp, const float* mean, const float* rstd, const bf16* params, i64 w, i64 bo, i64 rows) { \
    ln_bwd_v<J, 2>(dinp, partial, dout, dres, inp, mean, rstd, params, w, bo, rows); }
#define LNV_INSTANCE(J) LNV_KERNELS(J, 2, 4)
LNV_INSTANCE(2) LNV_INSTANCE(4) LNV_INSTANCE(6) LNV_INSTANCE(8) LNV_INSTANCE(12) LNV_INSTANCE(16)
LNV_INSTANCE(24)
// Past C = 768 both keep the LayerNorm weight in shared memory, and the forward holds one row a
// warp, so four of its blocks share an SM; at widths over 1024 (ViT-H's 1280, ViT-g's 1408) the
// backward's rows no longer fit 128 registers: three of its blocks share an SM (170 registers a
// thread) rather than four.
LNV_KERNELS(32, 4, 4) LNV_KERNELS(40, 4, 3) LNV_KERNELS(44, 4, 3)

// layernorm_bwd_v with dinp's column sums (NA = 3): up to C = 768 three accumulator rows of 4
// warps stay within 48 KiB of static shared memory; C = 1024, 1280 and 1408 keep them in
// dynamic shared memory (48, 60 and 66 KiB a block), with the blocks per SM of their `_v` forms.
#define LNS_KERNEL(J, BB, DYN) \
extern "C" __global__ void __launch_bounds__(128, BB) layernorm_bwd_s##J(bf16* dinp, float* partial, const bf16* dout, const bf16* dres, \
        const bf16* inp, const float* mean, const float* rstd, const bf16* params, i64 w, i64 bo, i64 rows) { \
    ln_bwd_v<J, 3, DYN>(dinp, partial, dout, dres, inp, mean, rstd, params, w, bo, rows); }
#define LNS_INSTANCE(J) LNS_KERNEL(J, 4, false)
LNS_INSTANCE(2) LNS_INSTANCE(4) LNS_INSTANCE(6) LNS_INSTANCE(8) LNS_INSTANCE(12) LNS_INSTANCE(16)
LNS_INSTANCE(24)
LNS_KERNEL(32, 4, true) LNS_KERNEL(40, 3, true) LNS_KERNEL(44, 3, true)
