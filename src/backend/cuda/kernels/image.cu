// Image decode's second half (`data.decode = "gpu"`): the decoded RGB8 images of a batch become
// the model's normalized (B, 3, S, S) input: RandomResizedCrop's (or the evaluation's center
// crop's) resampling with PIL's antialiased filters, the horizontal flip and the normalization,
// as `data::resize` does on the CPU. Two separable passes, as there: the horizontal pass
// filters the source rows the crop needs into f32 rows of S pixels (`tmp`), the vertical pass
// filters those into the output, flips and normalizes. The filter taps are computed per
// thread with the CPU's formulas (bilinear in f32 as there; bicubic in f32 here, f64 there).

// One image of the batch (the host's `ImageJob`, same layout).
struct ImageJob {
    i64 src;        // byte offset of its (h, w, 3) RGB8 pixels in the decode buffer
    int w, h;       // source size
    float x0, y0;   // crop window in source pixels
    float cw, ch;
    int flip;
    int row0;       // first source row the vertical filter reads
    int rows;       // source rows the horizontal pass filters (row0 .. row0 + rows)
    int pad;
    i64 tmp;        // float offset of its rows × S × 3 horizontal-pass values in `tmp`
};

__device__ __forceinline__ float bicubic_w(float x) {
    const float a = -0.5f;
    x = fabsf(x);
    if (x < 1.f) return ((a + 2.f) * x - (a + 3.f)) * x * x + 1.f;
    if (x < 2.f) return (((x - 5.f) * x + 8.f) * x - 4.f) * a;
    return 0.f;
}

// The taps of output index i along an axis of `len` source pixels, for a window starting at
// r0 of rlen pixels resampled to `out` pixels: first source index and count, as `taps` in
// data/resize.rs (before its trimming of zero weights, which changes no sum).
__device__ __forceinline__ void axis_taps(int i, int len, float r0, float rlen, int out, int bicubic, float* center, float* fscale, int* lo, int* hi) {
    float scale = rlen / (float)out;
    float fs = fmaxf(scale, 1.f);
    float support = bicubic ? 2.f * fs : fs;
    int n = (int)ceilf(support) * 2 + 1;
    float c = r0 + ((float)i + 0.5f) * scale;
    int l = (int)fmaxf(floorf(c - support), 0.f);
    l = min(l, len - 1);
    int h = (int)fmaxf(ceilf(c + support), 0.f);
    h = max(h, l + 1);
    h = min(h, len);
    h = min(h, l + n);
    *center = c; *fscale = fs; *lo = l; *hi = h;
}

__device__ __forceinline__ float tap_w(int j, float center, float fscale, int bicubic) {
    float d = ((float)j + 0.5f - center) / fscale;
    return bicubic ? bicubic_w(d) : fmaxf(1.f - fabsf(d), 0.f);
}

// Horizontal pass: grid.y = image, threads over (row r < rows, output column x < S).
extern "C" __global__ void resample_rows_rgb8(float* __restrict__ tmp, const unsigned char* __restrict__ src, const ImageJob* __restrict__ jobs, int side, int bicubic) {
    const ImageJob jb = jobs[blockIdx.y];
    i64 n = (i64)jb.rows * side;
    for (i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x; t < n; t += (i64)gridDim.x * blockDim.x) {
        int r = (int)(t / side), x = (int)(t % side);
        float c, fs; int lo, hi;
        axis_taps(x, jb.w, jb.x0, jb.cw, side, bicubic, &c, &fs, &lo, &hi);
        float sum = 0.f;
        for (int j = lo; j < hi; j++) sum += tap_w(j, c, fs, bicubic);
        const unsigned char* row = src + jb.src + (i64)(jb.row0 + r) * jb.w * 3;
        float a0 = 0.f, a1 = 0.f, a2 = 0.f;
        if (sum <= 0.f) {
            a0 = row[lo * 3]; a1 = row[lo * 3 + 1]; a2 = row[lo * 3 + 2];
        } else {
            float inv = 1.f / sum;
            for (int j = lo; j < hi; j++) {
                float wj = tap_w(j, c, fs, bicubic) * inv;
                a0 += wj * row[j * 3]; a1 += wj * row[j * 3 + 1]; a2 += wj * row[j * 3 + 2];
            }
        }
        if (bicubic) {
            a0 = fminf(fmaxf(a0, 0.f), 255.f); a1 = fminf(fmaxf(a1, 0.f), 255.f); a2 = fminf(fmaxf(a2, 0.f), 255.f);
        }
        float* o = tmp + jb.tmp + t * 3;
        o[0] = a0; o[1] = a1; o[2] = a2;
    }
}

// Vertical pass, flip and normalization: grid.y = image, threads over the S × S outputs; out
// is (B, 3, S, S) of dtype dt, image b at blockIdx.y + first.
extern "C" __global__ void resample_cols_norm(void* __restrict__ out, int dt, const float* __restrict__ tmp, const ImageJob* __restrict__ jobs, int side, int bicubic,
                                              float k0, float k1, float k2, float o0, float o1, float o2) {
    const ImageJob jb = jobs[blockIdx.y];
    i64 n = (i64)side * side;
    i64 plane = n;
    i64 base = (i64)blockIdx.y * 3 * plane;
    for (i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x; t < n; t += (i64)gridDim.x * blockDim.x) {
        int y = (int)(t / side), x = (int)(t % side);
        int sx = jb.flip ? side - 1 - x : x;
        float c, fs; int lo, hi;
        axis_taps(y, jb.h, jb.y0, jb.ch, side, bicubic, &c, &fs, &lo, &hi);
        // the host's row range was computed with the same formulas; an ulp of difference in
        // the center must not read a row the horizontal pass did not fill
        lo = max(lo, jb.row0);
        hi = max(min(hi, jb.row0 + jb.rows), lo + 1);
        float sum = 0.f;
        for (int j = lo; j < hi; j++) sum += tap_w(j, c, fs, bicubic);
        float a0 = 0.f, a1 = 0.f, a2 = 0.f;
        if (sum <= 0.f) {
            const float* v = tmp + jb.tmp + ((i64)(lo - jb.row0) * side + sx) * 3;
            a0 = v[0]; a1 = v[1]; a2 = v[2];
        } else {
            float inv = 1.f / sum;
            for (int j = lo; j < hi; j++) {
                float wj = tap_w(j, c, fs, bicubic) * inv;
                const float* v = tmp + jb.tmp + ((i64)(j - jb.row0) * side + sx) * 3;
                a0 += wj * v[0]; a1 += wj * v[1]; a2 += wj * v[2];
            }
        }
        if (bicubic) {
            a0 = fminf(fmaxf(a0, 0.f), 255.f); a1 = fminf(fmaxf(a1, 0.f), 255.f); a2 = fminf(fmaxf(a2, 0.f), 255.f);
        }
        stx(out, dt, base + t, a0 * k0 - o0);
        stx(out, dt, base + plane + t, a1 * k1 - o1);
        stx(out, dt, base + 2 * plane + t, a2 * k2 - o2);
    }
}
