// Elementwise ops over whole buffers: cast, fill, add, scale, strided row copies, stochastic
// depth's row factors, the EMA's lerp, GELU and its backward, and the sum of squares used for
// the global gradient norm.

extern "C" __global__ void cast_kernel(void* dst, int dtd, const void* src, int dts, i64 n) {
    GRID_STRIDE(i, n) stx(dst, dtd, i, ldx(src, dts, i));
}

extern "C" __global__ void fill_kernel(void* dst, int dt, i64 n, float v) {
    GRID_STRIDE(i, n) stx(dst, dt, i, v);
}

// Strided row copy (Backend::copy_strided): row (i0, i1, i2) of counts (., c1, c2) copies len
// values from src + so + i0·ss0 + i1·ss1 + i2·ss2 to dst + do + i0·ds0 + i1·ds1 + i2·ds2,
// converting between the buffers' types; total = rows · len.
extern "C" __global__ void copy_strided_kernel(void* dst, int dtd, const void* src, int dts, i64 len, i64 c1, i64 c2, i64 total,
                                               i64 so, i64 ss0, i64 ss1, i64 ss2, i64 dof, i64 ds0, i64 ds1, i64 ds2) {
    GRID_STRIDE(i, total) {
        i64 r = i / len, e = i - r * len;
        i64 i2 = r % c2, t = r / c2;
        i64 i1 = t % c1, i0 = t / c1;
        stx(dst, dtd, dof + i0 * ds0 + i1 * ds1 + i2 * ds2 + e, ldx(src, dts, so + i0 * ss0 + i1 * ss1 + i2 * ss2 + e));
    }
}

// copy_strided_kernel between buffers of one type, every offset, stride and length in 16-byte
// units (the launch checks they divide): one uint4 a thread.
extern "C" __global__ void copy_strided_u4(uint4* dst, const uint4* src, i64 len, i64 c1, i64 c2, i64 total,
                                           i64 so, i64 ss0, i64 ss1, i64 ss2, i64 dof, i64 ds0, i64 ds1, i64 ds2) {
    GRID_STRIDE(i, total) {
        i64 r = i / len, e = i - r * len;
        i64 i2 = r % c2, t = r / c2;
        i64 i1 = t % c1, i0 = t / c1;
        dst[dof + i0 * ds0 + i1 * ds1 + i2 * ds2 + e] = src[so + i0 * ss0 + i1 * ss1 + i2 * ss2 + e];
    }
}

// out = a + b
extern "C" __global__ void add_kernel(void* out, int dto, const void* a, int dta, const void* b, int dtb, i64 n) {
    GRID_STRIDE(i, n) stx(out, dto, i, ldx(a, dta, i) + ldx(b, dtb, i));
}

// Stochastic depth: out = (res ? res : 0) + s[row / rows_per_image] * y over rows of c values,
// the factor of each image's residual branch (0 dropped, 1/keep kept), read from f32 s.
extern "C" __global__ void scale_rows_kernel(void* out, int dto, const void* res, int dtr, const void* y, int dty,
                                             const float* s, i64 rows_per_image, i64 c, i64 n) {
    GRID_STRIDE(i, n) {
        float v = ldx(y, dty, i) * s[(i / c) / rows_per_image];
        if (res) v += ldx(res, dtr, i);
        stx(out, dto, i, v);
    }
}

// dst += w * (src - dst) over f32 values, as torch's lerp_ (from the nearer end): the weight EMA.
extern "C" __global__ void lerp_kernel(float* dst, const float* src, i64 n, float w) {
    GRID_STRIDE(i, n) {
        const float a = dst[i], b = src[i];
        dst[i] = fabsf(w) < 0.5f ? a + w * (b - a) : b - (b - a) * (1.f - w);
    }
}

// dst = src * s, converting between the buffers' types (may run in place)
extern "C" __global__ void scaled_cast_kernel(void* dst, int dtd, const void* src, int dts, i64 n, float s) {
    GRID_STRIDE(i, n) stx(dst, dtd, i, ldx(src, dts, i) * s);
}

// buf *= s
extern "C" __global__ void scale_kernel(void* buf, int dt, i64 n, float s) {
    GRID_STRIDE(i, n) stx(buf, dt, i, ldx(buf, dt, i) * s);
}

// out = gelu(pre), both bf16, 2 elements per thread (n even).
extern "C" __global__ void gelu_fwd_bf16(unsigned* out, const unsigned* pre, i64 n2) {
    GRID_STRIDE(i, n2) {
        unsigned p = pre[i];
        float a = bf2f((bf16)(p & 0xffffu)), b = bf2f((bf16)(p >> 16));
        out[i] = (unsigned)f2bf(gelu_f(a)) | ((unsigned)f2bf(gelu_f(b)) << 16);
    }
}

// dx *= gelu'(pre), both bf16, 2 elements per thread.
extern "C" __global__ void gelu_bwd_bf16(unsigned* dx, const unsigned* pre, i64 n2) {
    GRID_STRIDE(i, n2) {
        unsigned p = pre[i], d = dx[i];
        float a = bf2f((bf16)(d & 0xffffu)) * dgelu_f(bf2f((bf16)(p & 0xffffu)));
        float b = bf2f((bf16)(d >> 16)) * dgelu_f(bf2f((bf16)(p >> 16)));
        dx[i] = (unsigned)f2bf(a) | ((unsigned)f2bf(b) << 16);
    }
}

// Generic-dtype versions for odd lengths.
extern "C" __global__ void gelu_fwd(void* out, int dto, const void* pre, int dtp, i64 n) {
    GRID_STRIDE(i, n) stx(out, dto, i, gelu_f(ldx(pre, dtp, i)));
}
extern "C" __global__ void gelu_bwd(void* dx, int dtx, const void* pre, int dtp, i64 n) {
    GRID_STRIDE(i, n) stx(dx, dtx, i, ldx(dx, dtx, i) * dgelu_f(ldx(pre, dtp, i)));
}

// x² in f64, or +inf for a value of magnitude ≥ inf_from (the fp16 overflow check; INFINITY for
// the plain sum); NaN stays NaN.
__device__ __forceinline__ double square_or_inf(float f, float inf_from) {
    const double v = fabsf(f) >= inf_from ? (double)INFINITY : (double)f;
    return v * v;
}

// *out += Σ x², f64 accumulation per block.
// f32 buffers (the gradients) go through 16-byte loads from the first 16-byte boundary, two
// vectors per thread and iteration in flight: the pass is bound by memory, and scalar loads
// reached about 40 % of its bandwidth. The elements before that boundary and after the last
// whole vector, and other dtypes, are read one at a time.
extern "C" __global__ void sum_squares_kernel(double* out, const void* x, int dt, i64 n, float inf_from) {
    __shared__ double part[32];
    double acc = 0.0;
    const i64 tid = (i64)blockIdx.x * blockDim.x + threadIdx.x, stride = (i64)gridDim.x * blockDim.x;
    if (dt == 0) {
        const float* xf = (const float*)x;
        const i64 head = min(n, (i64)(((16u - ((unsigned)(size_t)xf & 15u)) & 15u) >> 2));
        const i64 nv = (n - head) >> 2, tail = head + 4 * nv;
        const float4* xv = (const float4*)(xf + head);
        i64 i = tid;
        for (; i + stride < nv; i += 2 * stride) {
            const float4 a = xv[i], b = xv[i + stride];
            acc += square_or_inf(a.x, inf_from) + square_or_inf(a.y, inf_from) + square_or_inf(a.z, inf_from) + square_or_inf(a.w, inf_from);
            acc += square_or_inf(b.x, inf_from) + square_or_inf(b.y, inf_from) + square_or_inf(b.z, inf_from) + square_or_inf(b.w, inf_from);
        }
        if (i < nv) {
            const float4 a = xv[i];
            acc += square_or_inf(a.x, inf_from) + square_or_inf(a.y, inf_from) + square_or_inf(a.z, inf_from) + square_or_inf(a.w, inf_from);
        }
        if (tid < head) acc += square_or_inf(xf[tid], inf_from);
        if (tail + tid < n) acc += square_or_inf(xf[tail + tid], inf_from);
    } else {
        for (i64 i = tid; i < n; i += stride) acc += square_or_inf(ldx(x, dt, i), inf_from);
    }
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    int w = threadIdx.x >> 5, l = threadIdx.x & 31;
    if (l == 0) part[w] = acc;
    __syncthreads();
    if (w == 0) {
        acc = l < (int)(blockDim.x >> 5) ? part[l] : 0.0;
        #pragma unroll
        for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
        if (l == 0) atomicAdd(out, acc);
    }
}

// Partial column sums of dout (R, OC) in dtype dt: row y of `dbias` (f32, splits × OC) gets the
// sum over the rows block-row y visited.
// Block (32, 8): x picks a column, y strides rows; grid (ceil(OC/32), splits).
extern "C" __global__ void bias_grad_kernel(float* dbias, const void* dout, int dt, i64 rows, int oc) {
    __shared__ float part[8][33];
    int c = blockIdx.x * 32 + threadIdx.x;
    float acc = 0.f;
    if (c < oc) {
        for (i64 r = (i64)blockIdx.y * 8 + threadIdx.y; r < rows; r += (i64)gridDim.y * 8)
            acc += ldx(dout, dt, r * oc + c);
    }
    part[threadIdx.y][threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.y == 0 && c < oc) {
        float s = 0.f;
        #pragma unroll
        for (int k = 0; k < 8; k++) s += part[k][threadIdx.x];
        dbias[(i64)blockIdx.y * oc + c] = s;  // partial row blockIdx.y (see reduce_partials)
    }
}

// Deterministic pseudo-random values in [-scale, scale) from (seed, index): synthetic data and
// non-zero benchmark operands without a host upload.
extern "C" __global__ void fill_random_kernel(void* dst, int dt, i64 n, unsigned seed, float scale) {
    GRID_STRIDE(i, n) {
        unsigned x = (unsigned)i * 0x9E3779B1u ^ seed;
        x ^= x >> 16; x *= 0x7feb352dU; x ^= x >> 15; x *= 0x846ca68bU; x ^= x >> 16;
        stx(dst, dt, i, scale * ((float)(x >> 8) * (2.0f / 16777216.0f) - 1.0f));
    }
}

// ---- Column sums of f32 partial rows (bias and LayerNorm-parameter gradients): the kernels
// that see the gradient's rows write one partial row per block (or per image), and these add
// the rows up. Each 32-column tile is one block of (32, 32) threads: x picks a column, y strides
// the parts, and the 32 sums combine in a fixed order (deterministic). Columns [0, split) go to
// d1, [split, 2·split) to d2, the rest to d3 (a LayerNorm's weight, bias and its input's sums).
// One launch serves many such reductions (the host queues a backward's ≈ 4 per block and
// sends them per ≈ 16 MiB of partial rows, see partials.rs): each is a few microseconds of
// latency on a few dozen blocks, so apart they cost more in kernel boundaries than in reading.
#define RED_MAX_SEGS 64
struct RedSeg {
    float* d1;
    float* d2;
    float* d3;
    const float* partial;  // nparts rows of width
    int split, nparts, width;
    int block0;  // this reduction's first block; its tiles are blocks block0 .. block0 + ⌈width/32⌉ − 1
};
struct RedBatch {
    RedSeg seg[RED_MAX_SEGS];
    int count;
};

extern "C" __global__ void reduce_partials_batch(const __grid_constant__ RedBatch batch) {
    __shared__ float part[32][33];
    int si = 0;  // (block-uniform; a scan of ≤ 64 constant-bank words)
    while (si + 1 < batch.count && batch.seg[si + 1].block0 <= (int)blockIdx.x) si++;
    const RedSeg& g = batch.seg[si];
    const int width = g.width, nparts = g.nparts, split = g.split;
    const float* partial = g.partial;
    const int i = ((int)blockIdx.x - g.block0) * 32 + threadIdx.x;
    float s = 0.f;
    if (i < width) {
        #pragma unroll 4
        for (int p = threadIdx.y; p < nparts; p += 32) s += partial[(i64)p * width + i];
    }
    part[threadIdx.y][threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.y == 0 && i < width) {
        float t = 0.f;
        #pragma unroll
        for (int k = 0; k < 32; k++) t += part[k][threadIdx.x];
        if (i < split) g.d1[i] += t; else if (i < 2 * split) g.d2[i - split] += t; else g.d3[i - 2 * split] += t;
    }
}

// ---- 16-byte versions (8 bf16 per access) of the bf16 elementwise passes; the launch site
// checks n % 8 == 0 and 16-byte alignment. Same arithmetic and rounding as the scalar kernels.

extern "C" __global__ void gelu_fwd_v8(uint4* out, const uint4* pre, i64 n8) {
    GRID_STRIDE(i, n8) {
        uint4 p = pre[i];
        out[i] = make_uint4(pk16(gelu_f(lo16(p.x)), gelu_f(hi16(p.x))), pk16(gelu_f(lo16(p.y)), gelu_f(hi16(p.y))),
                            pk16(gelu_f(lo16(p.z)), gelu_f(hi16(p.z))), pk16(gelu_f(lo16(p.w)), gelu_f(hi16(p.w))));
    }
}

__device__ __forceinline__ unsigned dgelu_w(unsigned d, unsigned p) {
    return pk16(lo16(d) * dgelu_f(lo16(p)), hi16(d) * dgelu_f(hi16(p)));
}
extern "C" __global__ void gelu_bwd_v8(uint4* dx, const uint4* pre, i64 n8) {
    GRID_STRIDE(i, n8) {
        uint4 p = pre[i], d = dx[i];
        dx[i] = make_uint4(dgelu_w(d.x, p.x), dgelu_w(d.y, p.y), dgelu_w(d.z, p.z), dgelu_w(d.w, p.w));
    }
}

// out = gelu(pre + pb) over n8 16-byte vectors (row-major, oc8 = oc / 8 vectors per row,
// 16-byte aligned). A flat grid-stride sweep like gelu_fwd_v8 (a (32, 8) block per 256 columns
// striding over rows ran 17 % slower: 8 warps on 8 distant rows); each thread steps its column
// along with its index instead of dividing.
// With `save_grad` != 0 (GeluSaved::Grad) pre is also overwritten in place by gelu'(pre + pb);
// pb may then be null (no bias).
extern "C" __global__ void gelu_fwd_bias_v8(uint4* out, uint4* pre, const uint4* pb, i64 n8, int oc8, int save_grad) {
    const i64 stride = (i64)blockDim.x * gridDim.x;
    const int step = (int)(stride % oc8);
    i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    int col = (int)(i % oc8);
    for (; i < n8; i += stride) {
        const uint4 p = pre[i], b = pb ? pb[col] : make_uint4(0u, 0u, 0u, 0u);
        if (save_grad) {
            uint4 g;
            out[i] = make_uint4(gelu_and_grad_w(p.x, b.x, &g.x), gelu_and_grad_w(p.y, b.y, &g.y), gelu_and_grad_w(p.z, b.z, &g.z), gelu_and_grad_w(p.w, b.w, &g.w));
            pre[i] = g;
        } else {
            out[i] = make_uint4(gelu_bias_w(p.x, b.x), gelu_bias_w(p.y, b.y), gelu_bias_w(p.z, b.z), gelu_bias_w(p.w, b.w));
        }
        col += step;
        if (col >= oc8) col -= oc8;
    }
}

// gelu_fwd_bias_v8 for any width and alignment.
extern "C" __global__ void gelu_fwd_bias(bf16* out, bf16* pre, const bf16* pb, i64 n, int oc, int save_grad) {
    GRID_STRIDE(i, n) {
        const float x = bf2f(pre[i]) + (pb ? bf2f(pb[i % oc]) : 0.f);
        float phi;
        const float cdf = gelu_cdf(x, &phi);
        out[i] = f2bf(x * cdf);
        if (save_grad) pre[i] = f2bf(fmaf(x, phi, cdf));  // as gelu_and_grad_w
    }
}

// dx *= gelu'(pre + pb) for any width and alignment (the fallback of gelu_bwd_bias_v8); with
// `saved` != 0, `pre` holds the derivative itself (GeluSaved::Grad) and pb is not read.
extern "C" __global__ void gelu_bwd_bias(bf16* dx, const bf16* pre, const bf16* pb, i64 n, int oc, int saved) {
    GRID_STRIDE(i, n) dx[i] = f2bf(bf2f(dx[i]) * (saved ? bf2f(pre[i]) : dgelu_f(bf2f(pre[i]) + bf2f(pb[i % oc]))));
}

// dx *= gelu'(pre + pb) (bf16, row-major rows × oc, oc % 8 == 0; pb may be null: no bias; with
// `saved` != 0, pre holds the derivative itself and pb is not read) and,
// from the same pass, the column partial sums of the rounded result — the bias gradient of
// the layer that produced pre, summed exactly as bias_grad_v8 would sum dx afterwards. Block
// (32, 8) covers 256 columns; grid (ceil(oc / 256), splits); row y of `dbias` (splits × oc)
// gets block-row y's sums.
extern "C" __global__ void gelu_bwd_bias_v8(bf16* dx, const bf16* pre, const bf16* pb, float* dbias, i64 rows, int oc, int saved) {
    int c0 = (blockIdx.x * 32 + threadIdx.x) * 8;
    float acc[8];
    #pragma unroll
    for (int k = 0; k < 8; k++) acc[k] = 0.f;
    if (c0 < oc) {
        // adding a zero bias is exact, so the bias-free case needs no second loop
        const uint4 b = pb ? *(const uint4*)(pb + c0) : make_uint4(0u, 0u, 0u, 0u);
        #pragma unroll 2
        for (i64 r = (i64)blockIdx.y * 8 + threadIdx.y; r < rows; r += (i64)gridDim.y * 8) {
            uint4* dp = (uint4*)(dx + r * oc + c0);
            uint4 d = *dp, p = *(const uint4*)(pre + r * oc + c0);
            uint4 o = saved ? make_uint4(mul_w(d.x, p.x), mul_w(d.y, p.y), mul_w(d.z, p.z), mul_w(d.w, p.w))
                            : make_uint4(dgelu_bias_w(d.x, p.x, b.x), dgelu_bias_w(d.y, p.y, b.y), dgelu_bias_w(d.z, p.z, b.z), dgelu_bias_w(d.w, p.w, b.w));
            *dp = o;
            acc[0] += lo16(o.x); acc[1] += hi16(o.x); acc[2] += lo16(o.y); acc[3] += hi16(o.y);
            acc[4] += lo16(o.z); acc[5] += hi16(o.z); acc[6] += lo16(o.w); acc[7] += hi16(o.w);
        }
    }
    block_column_partials(acc, dbias, oc);
}

extern "C" __global__ void add_v8(uint4* out, const uint4* a, const uint4* b, i64 n8) {
    GRID_STRIDE(i, n8) {
        uint4 x = a[i], y = b[i];
        out[i] = make_uint4(add_w(x.x, y.x), add_w(x.y, y.y), add_w(x.z, y.z), add_w(x.w, y.w));
    }
}

// bias_grad_kernel for bf16 dout with OC % 8 == 0: each thread sums 8 adjacent columns with
// 16-byte loads. Block (32, 8) covers 256 columns; grid (ceil(OC/256), splits); row y of
// `dbias` (splits × OC) gets block-row y's partial sums.
extern "C" __global__ void bias_grad_v8(float* dbias, const bf16* dout, i64 rows, int oc) {
    int c0 = (blockIdx.x * 32 + threadIdx.x) * 8;
    float acc[8];
    #pragma unroll
    for (int k = 0; k < 8; k++) acc[k] = 0.f;
    if (c0 < oc) {
        #pragma unroll 4
        for (i64 r = (i64)blockIdx.y * 8 + threadIdx.y; r < rows; r += (i64)gridDim.y * 8) {
            uint4 u = *(const uint4*)(dout + r * oc + c0);
            acc[0] += lo16(u.x); acc[1] += hi16(u.x); acc[2] += lo16(u.y); acc[3] += hi16(u.y);
            acc[4] += lo16(u.z); acc[5] += hi16(u.z); acc[6] += lo16(u.w); acc[7] += hi16(u.w);
        }
    }
    block_column_partials(acc, dbias, oc);
}
