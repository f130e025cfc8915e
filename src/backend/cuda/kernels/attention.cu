// Attention helpers around the cuBLASLt batched GEMMs: moving heads between the token layout
// (B, N, S, H, D) and the per-head layout [S][B][H][N][D], and row softmax forward/backward
// in fp32 over score rows padded to a multiple of 8. All bf16.

// src (B, N, S, H, D) → dst [S][B][H][N][D]
extern "C" __global__ void tokens_to_heads(bf16* dst, const bf16* src, int b, int n, int s, int h, int d) {
    i64 total = (i64)b * n * s * h * d;
    i64 bhnd = (i64)b * h * n * d;
    GRID_STRIDE(e, total) {
        int di = (int)(e % d);
        i64 r = e / d;
        int hi = (int)(r % h); r /= h;
        int si = (int)(r % s); r /= s;
        int ni = (int)(r % n);
        i64 bi = r / n;
        dst[si * bhnd + ((bi * h + hi) * n + ni) * d + di] = src[e];
    }
}

// src [S][B][H][N][D] → dst (B, N, S, H, D)
extern "C" __global__ void heads_to_tokens(bf16* dst, const bf16* src, int b, int n, int s, int h, int d) {
    i64 total = (i64)b * n * s * h * d;
    i64 bhnd = (i64)b * h * n * d;
    GRID_STRIDE(e, total) {
        int di = (int)(e % d);
        i64 r = e / d;
        int hi = (int)(r % h); r /= h;
        int si = (int)(r % s); r /= s;
        int ni = (int)(r % n);
        i64 bi = r / n;
        dst[e] = src[si * bhnd + ((bi * h + hi) * n + ni) * d + di];
    }
}

// The same two moves, 8 bf16 (16 bytes) per thread and 32-bit index math; needs D % 8 == 0,
// 16-byte aligned buffers and fewer than 2³² chunks (checked by the caller). d8 = D / 8.
extern "C" __global__ void tokens_to_heads_v8(uint4* dst, const uint4* src, int b, int n, int s, int h, int d8) {
    unsigned total = (unsigned)b * n * s * h * d8;
    i64 bhnd8 = (i64)b * h * n * d8;
    for (unsigned e = blockIdx.x * blockDim.x + threadIdx.x; e < total; e += gridDim.x * blockDim.x) {
        unsigned di = e % d8, r = e / d8;
        unsigned hi = r % h; r /= h;
        unsigned si = r % s; r /= s;
        unsigned ni = r % n, bi = r / n;
        dst[si * bhnd8 + ((i64)(bi * h + hi) * n + ni) * d8 + di] = src[e];
    }
}
extern "C" __global__ void heads_to_tokens_v8(uint4* dst, const uint4* src, int b, int n, int s, int h, int d8) {
    unsigned total = (unsigned)b * n * s * h * d8;
    i64 bhnd8 = (i64)b * h * n * d8;
    for (unsigned e = blockIdx.x * blockDim.x + threadIdx.x; e < total; e += gridDim.x * blockDim.x) {
        unsigned di = e % d8, r = e / d8;
        unsigned hi = r % h; r /= h;
        unsigned si = r % s; r /= s;
        unsigned ni = r % n, bi = r / n;
        dst[e] = src[si * bhnd8 + ((i64)(bi * h + hi) * n + ni) * d8 + di];
    }
}

// Padded-row variants: scores live in rows of stride `ld` (N rounded up to 8) so the GEMMs
// see 16-byte-aligned operands; `probs` (rows, n) is the compact copy the trait keeps.

// s (rows, ld): row ← softmax(row[0..n]) written to s (pad columns zeroed) and to probs.
extern "C" __global__ void softmax_fwd_pad(bf16* s, int ld, bf16* probs, i64 rows, int n) {
    int warps = blockDim.x >> 5, lane = threadIdx.x & 31;
    for (i64 r = (i64)blockIdx.x * warps + (threadIdx.x >> 5); r < rows; r += (i64)gridDim.x * warps) {
        bf16* row = s + r * ld;
        bf16* out = probs + r * n;
        float m = -INFINITY;
        for (int i = lane; i < n; i += 32) m = fmaxf(m, bf2f(row[i]));
        m = warp_max(m);
        float sum = 0.f;
        for (int i = lane; i < n; i += 32) sum += __expf(bf2f(row[i]) - m);
        float inv = 1.f / warp_sum(sum);
        for (int i = lane; i < ld; i += 32) {
            bf16 p = i < n ? f2bf(__expf(bf2f(row[i]) - m) * inv) : (bf16)0;
            row[i] = p;
            if (i < n) out[i] = p;
        }
    }
}

// dst (rows, ld) ← src (rows, n), pad columns zeroed.
extern "C" __global__ void pad_rows(bf16* dst, int ld, const bf16* src, i64 rows, int n) {
    i64 total = rows * ld;
    GRID_STRIDE(e, total) {
        i64 r = e / ld;
        int c = (int)(e - r * ld);
        dst[e] = c < n ? src[r * n + c] : (bf16)0;
    }
}

// In place on dp (rows, ld): dp ← p ⊙ (dp − Σ_j dp·p) over the first n columns; p (rows, ld).
extern "C" __global__ void softmax_bwd_pad(bf16* dp, const bf16* p, int ld, i64 rows, int n) {
    int warps = blockDim.x >> 5, lane = threadIdx.x & 31;
    for (i64 r = (i64)blockIdx.x * warps + (threadIdx.x >> 5); r < rows; r += (i64)gridDim.x * warps) {
        bf16* g = dp + r * ld;
        const bf16* pr = p + r * ld;
        float s = 0.f;
        for (int i = lane; i < n; i += 32) s += bf2f(g[i]) * bf2f(pr[i]);
        s = warp_sum(s);
        for (int i = lane; i < ld; i += 32) g[i] = i < n ? f2bf(bf2f(pr[i]) * (bf2f(g[i]) - s)) : (bf16)0;
    }
}

// ---- class-token attention: query 0 of each image only (the last block under token pooling).
// q (B, H·D) holds the class tokens' queries, kv (B, N, 2, H, D) every token's keys and values.
// One block per (image, head) = blockIdx.x, 128 threads (the 16-byte kernels below may take
// more); the work is N·D per head.
// Generic kernels (any D, 2-byte accesses): a key row's D bf16 are read by one warp.
// Shared memory: p (n) | qs (d) | acc (4·d) | red (32), the backward adds g (d) | ds (n).

__device__ __forceinline__ float block_reduce(float v, float* red, bool is_max) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = is_max ? warp_max(v) : warp_sum(v);
    __syncthreads();  // red may still be read from a previous reduction
    if (lane == 0) red[warp] = v;
    __syncthreads();
    float r = red[0];
    for (int w = 1; w < warps; w++) r = is_max ? fmaxf(r, red[w]) : r + red[w];
    return r;
}
// dS_j = P_j (dP_j − Σ_i P_i dP_i) · scale in place over ds (holding dP), from each thread's
// partial Σ P dP; ends with a barrier.
__device__ __forceinline__ void class_dscores(float* ds, const float* p, float* red, float dot_part, int n, float scale) {
    float dot = block_reduce(dot_part, red, false);
    for (int j = threadIdx.x; j < n; j += blockDim.x) ds[j] = p[j] * (ds[j] - dot) * scale;
    __syncthreads();
}

// p[0..n) holds scores, `mx` each thread's partial maximum of them: p ← softmax(p); ends with
// a barrier.
__device__ __forceinline__ void class_softmax(float* p, float* red, float mx, int n) {
    mx = block_reduce(mx, red, true);
    float sum = 0.f;
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        float e = __expf(p[j] - mx);
        p[j] = e;
        sum += e;
    }
    float inv = 1.f / block_reduce(sum, red, false);
    for (int j = threadIdx.x; j < n; j += blockDim.x) p[j] *= inv;
    __syncthreads();
}

// p[0..n) ← softmax_j(qs·k_j) with qs = q·scale (loaded here); ends with a barrier.
__device__ void class_probs(float* p, float* qs, float* red, const bf16* q, const bf16* k, int n, int kv_stride, int d, float scale) {
    int t = threadIdx.x, lane = t & 31, warp = t >> 5, warps = blockDim.x >> 5;
    for (int e = t; e < d; e += blockDim.x) qs[e] = bf2f(q[e]) * scale;
    __syncthreads();
    float mx = -INFINITY;
    for (int j = warp; j < n; j += warps) {
        const bf16* kj = k + (i64)j * kv_stride;
        float s = 0.f;
        for (int e = lane; e < d; e += 32) s += qs[e] * bf2f(kj[e]);
        s = warp_sum(s);
        if (lane == 0) p[j] = s;
        mx = fmaxf(mx, s);
    }
    class_softmax(p, red, mx, n);
}

// acc[warp][e] = Σ over this warp's keys j of w[j]·rows_j[e], then dst[e] = Σ_warps (bf16).
__device__ void class_weighted_rows(bf16* dst, float* acc, const float* w, const bf16* rows, i64 row_stride, int n, int d) {
    int t = threadIdx.x, lane = t & 31, warp = t >> 5, warps = blockDim.x >> 5;
    float* mine = acc + warp * d;
    for (int e = lane; e < d; e += 32) mine[e] = 0.f;
    for (int j = warp; j < n; j += warps) {
        const bf16* r = rows + j * row_stride;
        float wj = w[j];
        for (int e = lane; e < d; e += 32) mine[e] += wj * bf2f(r[e]);
    }
    __syncthreads();
    for (int e = t; e < d; e += blockDim.x) {
        float s = 0.f;
        for (int w2 = 0; w2 < warps; w2++) s += acc[w2 * d + e];
        dst[e] = f2bf(s);
    }
}

// out (B, H·D) ← softmax(q·kᵀ·scale)·v per (image, head).
extern "C" __global__ void class_attention_fwd(bf16* out, const bf16* q, const bf16* kv, int n, int h, int d, float scale) {
    extern __shared__ float sm[];
    int bi = blockIdx.x / h, hi = blockIdx.x % h, c = h * d;
    float *p = sm, *qs = p + n, *acc = qs + d, *red = acc + 4 * d;
    const bf16* k = kv + (i64)bi * n * 2 * c + hi * d;
    class_probs(p, qs, red, q + (i64)bi * c + hi * d, k, n, 2 * c, d, scale);
    class_weighted_rows(out + (i64)bi * c + hi * d, acc, p, k + c, 2 * c, n, d);
}

// Gradient of class_attention_fwd from dout (B, H·D): dq (B, H·D) = Σ_j dS_j k_j (dS with the
// scale folded in), dkv (B, N, 2, H, D): dk_j = dS_j q, dv_j = P_j dout.
extern "C" __global__ void class_attention_bwd(bf16* dq, bf16* dkv, const bf16* dout, const bf16* q, const bf16* kv, int n, int h, int d, float scale) {
    extern __shared__ float sm[];
    int bi = blockIdx.x / h, hi = blockIdx.x % h, c = h * d;
    int t = threadIdx.x, lane = t & 31, warp = t >> 5, warps = blockDim.x >> 5;
    float *p = sm, *qs = p + n, *acc = qs + d, *red = acc + 4 * d, *g = red + 32, *ds = g + d;
    for (int e = t; e < d; e += blockDim.x) g[e] = bf2f(dout[(i64)bi * c + hi * d + e]);
    const bf16* k = kv + (i64)bi * n * 2 * c + hi * d;
    class_probs(p, qs, red, q + (i64)bi * c + hi * d, k, n, 2 * c, d, scale);
    // dP_j = dout·v_j, then Σ_j P_j dP_j
    float dot = 0.f;
    for (int j = warp; j < n; j += warps) {
        const bf16* v = k + (i64)j * 2 * c + c;
        float s = 0.f;
        for (int e = lane; e < d; e += 32) s += g[e] * bf2f(v[e]);
        s = warp_sum(s);
        if (lane == 0) {
            ds[j] = s;
            dot += p[j] * s;  // (every lane holds s; lane 0 counts it)
        }
    }
    class_dscores(ds, p, red, dot, n, scale);
    // dk_j = dS_j q (qs holds q·scale, ds_j = dS_j·scale), dv_j = P_j g
    bf16* dst = dkv + (i64)bi * n * 2 * c + hi * d;
    for (int i = t; i < n * d; i += blockDim.x) {
        int j = i / d, e = i - j * d;
        bf16* r = dst + (i64)j * 2 * c;
        r[e] = f2bf(ds[j] / scale * qs[e]);
        r[c + e] = f2bf(p[j] * g[e]);
    }
    class_weighted_rows(dq + (i64)bi * c + hi * d, acc, ds, k, 2 * c, n, d);
}

// The same two kernels with 16-byte loads and stores: D % 8 == 0, D ≤ 1024, 16-byte aligned
// buffers (checked by the caller), a block of T ≥ 128 threads (a multiple of 32; the host
// takes more for long sequences on few heads, where the blocks alone would leave most SMs
// idle). Scores and dP take one thread per key; the weighted row sums split the D/8 chunks of
// a row over threads and the keys over G = T / (D/8) groups.

__device__ __forceinline__ void unpack8(uint4 u, float* f) {
    f[0] = lo16(u.x); f[1] = hi16(u.x); f[2] = lo16(u.y); f[3] = hi16(u.y);
    f[4] = lo16(u.z); f[5] = hi16(u.z); f[6] = lo16(u.w); f[7] = hi16(u.w);
}
__device__ __forceinline__ uint4 pack8(const float* f) {
    return make_uint4(pk16(f[0], f[1]), pk16(f[2], f[3]), pk16(f[4], f[5]), pk16(f[6], f[7]));
}
// Σ_e a[e]·row[e] over a row of d8 chunks; a in shared memory (f32).
__device__ __forceinline__ float dot_row8(const float* a, const uint4* row, int d8) {
    float s = 0.f, f[8];
    for (int ch = 0; ch < d8; ch++) {
        unpack8(row[ch], f);
#pragma unroll
        for (int i = 0; i < 8; i++) s += a[ch * 8 + i] * f[i];
    }
    return s;
}
// p[0..n) ← softmax_j(qs·k_j) with qs = q·scale (loaded here); ends with a barrier.
__device__ void class_probs8(float* p, float* qs, float* red, const bf16* q, const bf16* k, int n, int kv_stride, int d, float scale) {
    int t = threadIdx.x, d8 = d >> 3;
    for (int e = t; e < d; e += blockDim.x) qs[e] = bf2f(q[e]) * scale;
    __syncthreads();
    float mx = -INFINITY;
    for (int j = t; j < n; j += blockDim.x) {
        float s = dot_row8(qs, (const uint4*)(k + (i64)j * kv_stride), d8);
        p[j] = s;
        mx = fmaxf(mx, s);
    }
    class_softmax(p, red, mx, n);
}
// res[e] = Σ_j w[j]·rows_j[e] (f32 into shared `res`, d values); acc holds G·d ≤ 8·T floats.
__device__ void weighted_rows8(float* res, float* acc, const float* w, const bf16* rows, i64 row_stride, int n, int d) {
    int t = threadIdx.x, d8 = d >> 3, groups = blockDim.x / d8;
    int grp = t / d8, ch = t - grp * d8;
    if (grp < groups) {
        float a[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f}, f[8];
        for (int j = grp; j < n; j += groups) {
            unpack8(((const uint4*)(rows + j * row_stride))[ch], f);
            float wj = w[j];
#pragma unroll
            for (int i = 0; i < 8; i++) a[i] += wj * f[i];
        }
#pragma unroll
        for (int i = 0; i < 8; i++) acc[grp * d + ch * 8 + i] = a[i];
    }
    __syncthreads();
    for (int e = t; e < d; e += blockDim.x) {
        float s = 0.f;
        for (int g2 = 0; g2 < groups; g2++) s += acc[g2 * d + e];
        res[e] = s;
    }
    __syncthreads();
}

// shared: p (n) | qs (d) | res (d) | acc (8·T) | red (32)
extern "C" __global__ void class_attention_fwd_v8(bf16* out, const bf16* q, const bf16* kv, int n, int h, int d, float scale) {
    extern __shared__ float sm[];
    int bi = blockIdx.x / h, hi = blockIdx.x % h, c = h * d;
    float *p = sm, *qs = p + n, *res = qs + d, *acc = res + d, *red = acc + 8 * blockDim.x;
    const bf16* k = kv + (i64)bi * n * 2 * c + hi * d;
    class_probs8(p, qs, red, q + (i64)bi * c + hi * d, k, n, 2 * c, d, scale);
    weighted_rows8(res, acc, p, k + c, 2 * c, n, d);
    bf16* o = out + (i64)bi * c + hi * d;
    for (int ch = threadIdx.x; ch < (d >> 3); ch += blockDim.x) ((uint4*)o)[ch] = pack8(res + ch * 8);
}

// shared: p (n) | ds (n) | qs (d) | g (d) | res (d) | acc (8·T) | red (32).
// part (optional, f32 rows of C per image): dout at this head's columns — the image's term of
// the v bias gradient (Σ_j dv_j = dout since Σ_j P_j = 1; the k bias's, Σ_j dS_j q, is 0).
extern "C" __global__ void class_attention_bwd_v8(bf16* dq, bf16* dkv, const bf16* dout, const bf16* q, const bf16* kv, int n, int h, int d, float scale, float* part) {
    extern __shared__ float sm[];
    int bi = blockIdx.x / h, hi = blockIdx.x % h, c = h * d, t = threadIdx.x, d8 = d >> 3;
    float *p = sm, *ds = p + n, *qs = ds + n, *g = qs + d, *res = g + d, *acc = res + d, *red = acc + 8 * blockDim.x;
    const bf16* k = kv + (i64)bi * n * 2 * c + hi * d;
    for (int e = t; e < d; e += blockDim.x) g[e] = bf2f(dout[(i64)bi * c + hi * d + e]);
    class_probs8(p, qs, red, q + (i64)bi * c + hi * d, k, n, 2 * c, d, scale);
    float dot = 0.f;
    for (int j = t; j < n; j += blockDim.x) {
        float dp = dot_row8(g, (const uint4*)(k + (i64)j * 2 * c + c), d8);
        ds[j] = dp;
        dot += p[j] * dp;
    }
    class_dscores(ds, p, red, dot, n, scale);
    // dk_j = dS_j q (= ds_j/scale · qs), dv_j = P_j g
    bf16* dst = dkv + (i64)bi * n * 2 * c + hi * d;
    for (int i = t; i < n * d8; i += blockDim.x) {
        int j = i / d8, ch = i - j * d8;
        bf16* r = dst + (i64)j * 2 * c;
        float fk[8], fv[8], wk = ds[j] / scale, wv = p[j];
#pragma unroll
        for (int e = 0; e < 8; e++) {
            fk[e] = wk * qs[ch * 8 + e];
            fv[e] = wv * g[ch * 8 + e];
        }
        ((uint4*)r)[ch] = pack8(fk);
        ((uint4*)(r + c))[ch] = pack8(fv);
    }
    // dq = Σ_j ds_j k_j
    weighted_rows8(res, acc, ds, k, 2 * c, n, d);
    bf16* dqo = dq + (i64)bi * c + hi * d;
    for (int ch = t; ch < d8; ch += blockDim.x) ((uint4*)dqo)[ch] = pack8(res + ch * 8);
    if (part) {
        for (int e = t; e < d; e += blockDim.x) part[(i64)bi * c + hi * d + e] = g[e];
    }
}

// dst (B·N, C) rows of token 0 of each image += src (B, C): 8 bf16 per thread, c8 = C / 8.
extern "C" __global__ void add_class_rows_v8(uint4* dst, const uint4* src, int b, int n, int c8) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < b * c8; i += gridDim.x * blockDim.x) {
        int bi = i / c8, ch = i - bi * c8;
        uint4* d = dst + (i64)bi * n * c8 + ch;
        uint4 a = *d, s = src[i];
        *d = make_uint4(add_w(a.x, s.x), add_w(a.y, s.y), add_w(a.z, s.z), add_w(a.w, s.w));
    }
}
extern "C" __global__ void add_class_rows(bf16* dst, const bf16* src, int b, int n, int c) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < b * c; i += gridDim.x * blockDim.x) {
        int bi = i / c, e = i - bi * c;
        bf16* d = dst + (i64)bi * n * c + e;
        *d = f2bf(bf2f(*d) + bf2f(src[i]));
    }
}
