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
