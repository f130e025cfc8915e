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
