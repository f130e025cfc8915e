// Patch embedding input (patchify), token sequence assembly (class token + position
// embedding) and pooling, with their backwards.

// img (B, CH, S, S) → out (B·NP, CH·P·P), each patch in (channel, row, col) order.
extern "C" __global__ void patchify_kernel(void* out, int dto, const void* img, int dti,
                                           int b, int ch, int s, int p) {
    int g = s / p;
    i64 np = (i64)g * g, pd = (i64)ch * p * p;
    i64 n = (i64)b * np * pd;
    GRID_STRIDE(e, n) {
        i64 row = e / pd, col = e % pd;
        i64 bi = row / np, pi = row % np;
        int gy = (int)(pi / g), gx = (int)(pi % g);
        int c = (int)(col / (p * p)), r = (int)((col / p) % p), q = (int)(col % p);
        i64 src = ((bi * ch + c) * s + (i64)gy * p + r) * s + (i64)gx * p + q;
        stx(out, dto, e, ldx(img, dti, src));
    }
}

// out[b, t] = (t < prefix ? cls : patches[b, t - prefix]) + pos[t].  pos/cls are element
// offsets into `params` (cls < 0: no class token).
extern "C" __global__ void embed_fwd_kernel(void* out, int dto, const void* patches, int dtp,
                                            const void* params, int dtw, i64 pos, i64 cls,
                                            int b, int np, int c) {
    int prefix = cls >= 0 ? 1 : 0;
    int n_tok = np + prefix;
    i64 n = (i64)b * n_tok * c;
    GRID_STRIDE(e, n) {
        int ci = (int)(e % c);
        i64 row = e / c;
        int t = (int)(row % n_tok);
        i64 bi = row / n_tok;
        float v = t < prefix ? ldx(params, dtw, cls + ci)
                             : ldx(patches, dtp, (bi * np + (t - prefix)) * c + ci);
        stx(out, dto, e, v + ldx(params, dtw, pos + (i64)t * c + ci));
    }
}

// dpatches[b, p] = dout[b, prefix + p]
extern "C" __global__ void embed_bwd_patches(void* dpatches, int dtp, const void* dout, int dto,
                                             int b, int np, int prefix, int c) {
    int n_tok = np + prefix;
    i64 n = (i64)b * np * c;
    GRID_STRIDE(e, n) {
        int ci = (int)(e % c);
        i64 row = e / c;
        int p = (int)(row % np);
        i64 bi = row / np;
        stx(dpatches, dtp, e, ldx(dout, dto, (bi * n_tok + prefix + p) * c + ci));
    }
}

// dpos[t] += Σ_b dout[b, t]; dcls += Σ_b dout[b, 0] (cls < 0: none). dparams f32.
extern "C" __global__ void embed_bwd_params(float* dparams, const void* dout, int dto, i64 pos,
                                            i64 cls, int b, int n_tok, int c) {
    i64 n = (i64)n_tok * c;
    GRID_STRIDE(e, n) {
        int t = (int)(e / c), ci = (int)(e % c);
        float s = 0.f;
        for (int bi = 0; bi < b; bi++) s += ldx(dout, dto, ((i64)bi * n_tok + t) * c + ci);
        dparams[pos + e] += s;
        if (cls >= 0 && t == 0) dparams[cls + ci] += s;
    }
}

// out (B, C) = inp[b, 0] (avg = 0) or mean over tokens prefix..N (avg = 1).
extern "C" __global__ void pool_fwd_kernel(void* out, int dto, const void* inp, int dti,
                                           int b, int n_tok, int c, int prefix, int avg) {
    i64 n = (i64)b * c;
    GRID_STRIDE(e, n) {
        i64 bi = e / c;
        int ci = (int)(e % c);
        float v;
        if (avg) {
            float s = 0.f;
            for (int t = prefix; t < n_tok; t++) s += ldx(inp, dti, (bi * n_tok + t) * c + ci);
            v = s / (float)(n_tok - prefix);
        } else {
            v = ldx(inp, dti, bi * n_tok * c + ci);
        }
        stx(out, dto, e, v);
    }
}

// dinp (B, N, C) = pooled gradient spread back (zero where the pool did not read).
extern "C" __global__ void pool_bwd_kernel(void* dinp, int dti, const void* dout, int dto,
                                           int b, int n_tok, int c, int prefix, int avg) {
    i64 n = (i64)b * n_tok * c;
    GRID_STRIDE(e, n) {
        int ci = (int)(e % c);
        i64 row = e / c;
        int t = (int)(row % n_tok);
        i64 bi = row / n_tok;
        float g = ldx(dout, dto, bi * c + ci);
        float v = avg ? (t >= prefix ? g / (float)(n_tok - prefix) : 0.f) : (t == 0 ? g : 0.f);
        stx(dinp, dti, e, v);
    }
}

// ---- 16-byte versions (8 bf16 per access) for bf16 activations and weights with C % 8 == 0
// and 16-byte aligned rows; the launch sites check and otherwise use the kernels above. Indices
// are 32-bit (the host checks the counts fit) and each element costs one division per 8
// channels: the general kernels spent their time on 64-bit index arithmetic. Same values and
// rounding as the general kernels, except embed_bwd_params_part's summation order.

__device__ __forceinline__ uint4 add_bf16x8(uint4 a, uint4 b) {
    return make_uint4(add_w(a.x, b.x), add_w(a.y, b.y), add_w(a.z, b.z), add_w(a.w, b.w));
}

// embed_fwd_kernel: c8 = C / 8 groups per row, rows = B·n_tok; pos, cls (may be null when
// prefix = 0) point at the weights' spans.
extern "C" __global__ void embed_fwd_v8(uint4* out, const uint4* patches, const uint4* pos, const uint4* cls, int rows, int n_tok, int prefix, int c8) {
    const int n = rows * c8, np = n_tok - prefix;
    for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < n; e += gridDim.x * blockDim.x) {
        const int row = e / c8, ci = e - row * c8;
        const int bi = row / n_tok, t = row - bi * n_tok;
        const uint4 x = t < prefix ? cls[ci] : patches[(bi * np + t - prefix) * c8 + ci];
        out[e] = add_bf16x8(x, pos[t * c8 + ci]);
    }
}

// embed_bwd_patches: each image's patch rows are one contiguous run in both buffers.
extern "C" __global__ void embed_bwd_patches_v8(uint4* dpatches, const uint4* dout, int b, int np, int prefix, int c8) {
    const int per = np * c8, n = b * per;
    for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < n; e += gridDim.x * blockDim.x) {
        const int bi = e / per;
        dpatches[e] = dout[e + (bi + 1) * prefix * c8];  // (bi·n_tok + prefix)·c8 + (e − bi·per)
    }
}

// embed_bwd_params as partial sums: block row y sums images y·per … y·per + per − 1 of each
// 8-channel group of the (n_tok, C) position gradient into partial row y (f32), whose `width`
// is n_tok·C, plus C more holding row 0 again when there is a class token (cls_copy), so that
// one reduction adds the rows into both spans.
extern "C" __global__ void embed_bwd_params_part(float* partial, const uint4* dout, int b, int per, int n_tok, int c8, int cls_copy) {
    const int w8 = n_tok * c8;
    const int g = blockIdx.x * blockDim.x + threadIdx.x;
    if (g >= w8) return;
    const int b0 = blockIdx.y * per, b1 = min(b, b0 + per);
    float s[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int bi = b0; bi < b1; bi++) {
        const uint4 v = dout[(i64)bi * w8 + g];
        const unsigned w[4] = {v.x, v.y, v.z, v.w};
        #pragma unroll
        for (int k = 0; k < 4; k++) {
            s[2 * k] += lo16(w[k]);
            s[2 * k + 1] += hi16(w[k]);
        }
    }
    const i64 width = (i64)(w8 + (cls_copy ? c8 : 0)) * 8;
    float* row = partial + blockIdx.y * width + g * 8;
    #pragma unroll
    for (int k = 0; k < 8; k++) row[k] = s[k];
    if (cls_copy && g < c8) {
        #pragma unroll
        for (int k = 0; k < 8; k++) row[(i64)w8 * 8 + k] = s[k];
    }
}

// pool_bwd_kernel: dout (B, C) spread over (B, n_tok, C).
extern "C" __global__ void pool_bwd_v8(uint4* dinp, const uint4* dout, int rows, int n_tok, int prefix, int c8, int avg) {
    const int n = rows * c8;
    for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < n; e += gridDim.x * blockDim.x) {
        const int row = e / c8, ci = e - row * c8;
        const int bi = row / n_tok, t = row - bi * n_tok;
        uint4 v = make_uint4(0u, 0u, 0u, 0u);
        if (avg ? t >= prefix : t == 0) {
            v = dout[bi * c8 + ci];
            if (avg) {
                const float d = (float)(n_tok - prefix);
                v = make_uint4(pk16(lo16(v.x) / d, hi16(v.x) / d), pk16(lo16(v.y) / d, hi16(v.y) / d),
                               pk16(lo16(v.z) / d, hi16(v.z) / d), pk16(lo16(v.w) / d, hi16(v.w) / d));
            }
        }
        dinp[e] = v;
    }
}

// patchify_kernel for bf16 image and patches with P·P % 8 == 0: 8 outputs per thread (one
// channel's consecutive (row, col) positions), stored as one 16-byte write.
extern "C" __global__ void patchify_v8(uint4* out, const bf16* img, int b, int ch, int s, int p) {
    const int g = s / p, np = g * g, pp = p * p, pd8 = ch * pp / 8;
    const int n = b * np * pd8;
    for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < n; e += gridDim.x * blockDim.x) {
        const int row = e / pd8, col = (e - row * pd8) * 8;
        const int bi = row / np, pi = row - bi * np;
        const int gy = pi / g, gx = pi - gy * g;
        const int c = col / pp, rem = col - c * pp;
        const bf16* base = img + ((i64)(bi * ch + c) * s + (i64)gy * p) * s + (i64)gx * p;
        unsigned w[4];
        #pragma unroll
        for (int k = 0; k < 4; k++) {
            const int i0 = rem + 2 * k, r0 = i0 / p, i1 = i0 + 1, r1 = i1 / p;
            w[k] = (unsigned)base[(i64)r0 * s + (i0 - r0 * p)] | ((unsigned)base[(i64)r1 * s + (i1 - r1 * p)] << 16);
        }
        out[e] = make_uint4(w[0], w[1], w[2], w[3]);
    }
}
