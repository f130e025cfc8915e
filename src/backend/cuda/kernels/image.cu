// Image decode's second half (`data.decode = "gpu"`): the decoded RGB8 images of a batch become
// the model's normalized (B, 3, S, S) input: RandomResizedCrop's (or the evaluation's center
// crop's) resampling with PIL's antialiased filters, the horizontal flip and the normalization,
// as `data::resize` does on the CPU. Three kernels: `resample_taps` computes each image's
// filter taps once per output column and output row (first source index, count, normalized
// weights; the CPU's formulas, bilinear and bicubic in f32), then two separable passes read
// them: the horizontal pass filters the source rows the crop needs into f32 rows of S pixels
// (`tmp`), the vertical pass filters those into the output, flips and normalizes. The taps
// depend only on the column or the output row, so computing them in the passes would repeat
// the same work for every row and every column.

// One image of the batch (the host's `ImageJob`, same layout).
struct ImageJob {
    i64 src;        // byte offset of its (h, w, 3) RGB8 pixels in the decode buffer
    int w, h;       // source size
    float x0, y0;   // crop window in source pixels
    float cw, ch;
    int flip;
    int row0;       // first source row the vertical filter reads
    int rows;       // source rows the horizontal pass filters (row0 .. row0 + rows)
    int kx;         // taps per output column: room in the table, at least any column's count
    i64 tmp;        // float offset of its rows × S × 3 horizontal-pass values in `tmp`
    int ky;         // taps per output row
    int pad;
    i64 taps;       // word offset of its tap table in `taps` (layout: `tap_axis`)
};

// An image's tap table, S·(4 + kx + ky) words from job.taps: per axis (columns, then rows)
// S first indices, S counts, then the weights as K planes of S (weight k of output i at k·S + i,
// so neighbouring threads read neighbouring words). Row indices are relative to job.row0.
struct TapAxis {
    int* lo;
    int* cnt;
    float* w;
};

__device__ __forceinline__ TapAxis tap_axis(float* taps, const ImageJob& jb, int side, int axis) {
    float* t = taps + jb.taps + (axis ? (i64)side * (2 + jb.kx) : 0);
    TapAxis a;
    a.lo = (int*)t;
    a.cnt = (int*)(t + side);
    a.w = t + 2 * side;
    return a;
}

__device__ __forceinline__ float bicubic_w(float x) {
    const float a = -0.5f;
    x = fabsf(x);
    if (x < 1.f) return ((a + 2.f) * x - (a + 3.f)) * x * x + 1.f;
    if (x < 2.f) return (((x - 5.f) * x + 8.f) * x - 4.f) * a;
    return 0.f;
}

__device__ __forceinline__ float tap_w(int j, float center, float fscale, int bicubic) {
    float d = ((float)j + 0.5f - center) / fscale;
    return bicubic ? bicubic_w(d) : fmaxf(1.f - fabsf(d), 0.f);
}

// Taps: grid.y = image, threads over the 2·S outputs (columns, then rows). Output i along an
// axis of `len` source pixels, window r0 of rlen pixels resampled to S: the source range as
// `taps` in data/resize.rs finds it (before its trimming of zero weights, which changes no
// sum), at most K taps; rows are also kept within the rows the horizontal pass fills (the
// host found them with the same formulas; an ulp of difference in a center must not read a
// row it did not fill). Weights are normalized to sum 1; a window whose weights sum to 0
// takes its first source pixel.
extern "C" __global__ void resample_taps(float* __restrict__ taps, const ImageJob* __restrict__ jobs, int side, int bicubic) {
    const ImageJob jb = jobs[blockIdx.y];
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= 2 * side) return;
    const int axis = t >= side, i = t - axis * side;
    const int len = axis ? jb.h : jb.w, k = axis ? jb.ky : jb.kx;
    const float r0 = axis ? jb.y0 : jb.x0, rlen = axis ? jb.ch : jb.cw;
    const float scale = rlen / (float)side;
    const float fs = fmaxf(scale, 1.f);
    const float support = bicubic ? 2.f * fs : fs;
    const float c = r0 + ((float)i + 0.5f) * scale;
    int lo = (int)fmaxf(floorf(c - support), 0.f);
    lo = min(lo, len - 1);
    int hi = (int)fmaxf(ceilf(c + support), 0.f);
    hi = max(hi, lo + 1);
    hi = min(hi, len);
    hi = min(hi, lo + k);
    if (axis) {
        lo = max(lo, jb.row0);
        hi = max(min(hi, jb.row0 + jb.rows), lo + 1);
        hi = min(hi, lo + k);
    }
    TapAxis a = tap_axis(taps, jb, side, axis);
    float sum = 0.f;
    for (int j = lo; j < hi; j++) sum += tap_w(j, c, fs, bicubic);
    int n = hi - lo;
    if (sum <= 0.f) {
        n = 1;
        a.w[i] = 1.f;
    } else {
        const float inv = 1.f / sum;
        for (int j = lo; j < hi; j++) a.w[(j - lo) * side + i] = tap_w(j, c, fs, bicubic) * inv;
    }
    a.lo[i] = axis ? lo - jb.row0 : lo;
    a.cnt[i] = n;
}

// Horizontal pass: grid.y = image, threads over (row r < rows, output column x < S).
extern "C" __global__ void resample_rows_rgb8(float* __restrict__ tmp, const unsigned char* __restrict__ src, const ImageJob* __restrict__ jobs,
                                              float* __restrict__ taps, int side, int bicubic) {
    const ImageJob jb = jobs[blockIdx.y];
    const TapAxis a = tap_axis(taps, jb, side, 0);
    const int n = jb.rows * side;
    for (int t = blockIdx.x * blockDim.x + threadIdx.x; t < n; t += gridDim.x * blockDim.x) {
        const int r = t / side, x = t - r * side;
        const int lo = a.lo[x], cnt = a.cnt[x];
        const unsigned char* p = src + jb.src + ((i64)(jb.row0 + r) * jb.w + lo) * 3;
        float a0 = 0.f, a1 = 0.f, a2 = 0.f;
        for (int k = 0; k < cnt; k++) {
            const float wk = a.w[k * side + x];
            a0 += wk * p[3 * k]; a1 += wk * p[3 * k + 1]; a2 += wk * p[3 * k + 2];
        }
        if (bicubic) {
            a0 = fminf(fmaxf(a0, 0.f), 255.f); a1 = fminf(fmaxf(a1, 0.f), 255.f); a2 = fminf(fmaxf(a2, 0.f), 255.f);
        }
        float* o = tmp + jb.tmp + (i64)t * 3;
        o[0] = a0; o[1] = a1; o[2] = a2;
    }
}

// Vertical pass, flip and normalization: grid.y = image, threads over the S × S outputs; out
// is (B, 3, S, S) of dtype dt, image b at blockIdx.y.
extern "C" __global__ void resample_cols_norm(void* __restrict__ out, int dt, const float* __restrict__ tmp, const ImageJob* __restrict__ jobs,
                                              float* __restrict__ taps, int side, int bicubic,
                                              float k0, float k1, float k2, float o0, float o1, float o2) {
    const ImageJob jb = jobs[blockIdx.y];
    const TapAxis a = tap_axis(taps, jb, side, 1);
    const int n = side * side;
    const i64 plane = n;
    const i64 base = (i64)blockIdx.y * 3 * plane;
    for (int t = blockIdx.x * blockDim.x + threadIdx.x; t < n; t += gridDim.x * blockDim.x) {
        const int y = t / side, x = t - y * side;
        const int sx = jb.flip ? side - 1 - x : x;
        const int lo = a.lo[y], cnt = a.cnt[y];
        const float* v = tmp + jb.tmp + ((i64)lo * side + sx) * 3;
        float a0 = 0.f, a1 = 0.f, a2 = 0.f;
        for (int k = 0; k < cnt; k++) {
            const float wk = a.w[k * side + y];
            a0 += wk * v[0]; a1 += wk * v[1]; a2 += wk * v[2];
            v += (i64)side * 3;
        }
        if (bicubic) {
            a0 = fminf(fmaxf(a0, 0.f), 255.f); a1 = fminf(fmaxf(a1, 0.f), 255.f); a2 = fminf(fmaxf(a2, 0.f), 255.f);
        }
        stx(out, dt, base + t, a0 * k0 - o0);
        stx(out, dt, base + plane + t, a1 * k1 - o1);
        stx(out, dt, base + 2 * plane + t, a2 * k2 - o2);
    }
}
