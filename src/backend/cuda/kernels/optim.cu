// Fused optimizer steps over the flat f32 buffers. The grid's y index picks a segment of
// parameters sharing one weight-decay flag and learning-rate factor: segs[3·y] = start,
// [3·y+1] = end, [3·y+2] = code (bit 0: decays; bits 1..33: the factor's f32 bits).
// pc (may be null): the bf16 compute copy of the weights, written from the updated values in
// the same pass (what a separate cast would write, without reading the weights again).
// norm2 (may be null): the gradients' sum of squares (sum_squares_kernel, earlier on the same
// stream); every thread turns it into the clipping factor min(1, clip / (‖g·gscale‖ + 1e-6))
// on gscale, so clipping needs no trip through the host.
__device__ __forceinline__ float clipped_scale(float gscale, const double* norm2, float clip) {
    if (!norm2) return gscale;
    const double coef = (double)clip / (sqrt(*norm2) * fabs((double)gscale) + 1e-6);
    return (float)((double)gscale * fmin(coef, 1.0));
}

// The learning-rate factor of a segment (layer-wise learning-rate decay; 1 otherwise).
__device__ __forceinline__ float segment_lr_scale(i64 code) {
    return __uint_as_float((unsigned int)(code >> 1));
}

// AdamW (adamw = 1, decoupled decay) or Adam with L2 (adamw = 0), torch semantics.
// bc1 = 1 − β1^t, bc2 = 1 − β2^t (1 when bias correction is off). Every multiply-add is spelled
// out (fmaf, __fmul_rn): left to the compiler, the scalar and the vector loops below could fuse
// different products, and the same element must get the same bits whichever loop updates it
// (a ZeRO shard's pieces start at other alignments than the whole buffer).
__device__ __forceinline__ void adam_update(float& p, float g, float& m, float& v, float lr, float b1, float b2, float eps,
                                            float decay, int adamw, float bc1, float bc2) {
    if (!adamw) g = fmaf(decay, p, g);
    m = fmaf(b1, m, __fmul_rn(1.f - b1, g));
    v = fmaf(b2, v, __fmul_rn(__fmul_rn(1.f - b2, g), g));
    const float upd = __fdiv_rn(__fdiv_rn(m, bc1), __fadd_rn(__fsqrt_rn(__fdiv_rn(v, bc2)), eps));
    if (adamw) p = fmaf(-__fmul_rn(lr, decay), p, p);
    p = fmaf(-lr, upd, p);
}

// Elements [a, b) one at a time, four per thread and iteration (stride apart), all loaded
// before any is updated, so that each thread keeps four elements' loads in flight.
__device__ __forceinline__ void adam_scalar(float* p, const float* g, float* m, float* v, bf16* pc, i64 a, i64 b, i64 tid, i64 stride,
                                            float lr, float b1, float b2, float eps, float decay, int adamw, float bc1, float bc2, float gscale) {
    i64 i = a + tid;
    for (; i + 3 * stride < b; i += 4 * stride) {
        float pv[4], gv[4], mv[4], vv[4];
        #pragma unroll
        for (int k = 0; k < 4; k++) {
            const i64 j = i + k * stride;
            pv[k] = p[j]; gv[k] = g[j]; mv[k] = m[j]; vv[k] = v[j];
        }
        #pragma unroll
        for (int k = 0; k < 4; k++) {
            const i64 j = i + k * stride;
            adam_update(pv[k], __fmul_rn(gv[k], gscale), mv[k], vv[k], lr, b1, b2, eps, decay, adamw, bc1, bc2);
            p[j] = pv[k]; m[j] = mv[k]; v[j] = vv[k];
            if (pc) pc[j] = f2bf(pv[k]);
        }
    }
    for (; i < b; i += stride) {
        float pi = p[i], mi = m[i], vi = v[i];
        adam_update(pi, __fmul_rn(g[i], gscale), mi, vi, lr, b1, b2, eps, decay, adamw, bc1, bc2);
        p[i] = pi; m[i] = mi; v[i] = vi;
        if (pc) pc[i] = f2bf(pi);
    }
}

template <int V> struct FloatVec;
template <> struct FloatVec<4> { typedef float4 T; typedef uint2 H; };
template <> struct FloatVec<2> { typedef float2 T; typedef unsigned H; };

// Elements [a, b), b − a a multiple of V, with every array at a V-element boundary at a: loads
// and stores of V floats (16 or 8 bytes), two vectors per thread in flight: the same bytes in
// a quarter (a half) of the memory instructions. SPLIT (V = 4): v is only at a 2-element
// boundary and goes as two 8-byte halves, the other arrays still 16 bytes at a time.
template <int V, bool SPLIT = false>
__device__ __forceinline__ void adam_vector(float* p, const float* g, float* m, float* v, bf16* pc, i64 a, i64 b, i64 tid, i64 stride,
                                            float lr, float b1, float b2, float eps, float decay, int adamw, float bc1, float bc2, float gscale) {
    typedef typename FloatVec<V>::T T;
    typedef typename FloatVec<V>::H H;
    T* pv = (T*)(p + a);
    const T* gv = (const T*)(g + a);
    T* mv = (T*)(m + a);
    static_assert(!SPLIT || V == 4, "the split second moments are for 16-byte vectors");
    float* vb = v + a;
    // v's V values at vector q, whole or as two 8-byte halves
    auto load_v = [&](i64 q) -> T {
        if constexpr (SPLIT) {
            const float2 lo = ((const float2*)vb)[2 * q], hi = ((const float2*)vb)[2 * q + 1];
            return make_float4(lo.x, lo.y, hi.x, hi.y);
        } else {
            return ((const T*)vb)[q];
        }
    };
    auto store_v = [&](i64 q, const T& val) {
        if constexpr (SPLIT) {
            ((float2*)vb)[2 * q] = make_float2(val.x, val.y);
            ((float2*)vb)[2 * q + 1] = make_float2(val.z, val.w);
        } else {
            ((T*)vb)[q] = val;
        }
    };
    H* hv = pc ? (H*)(pc + a) : nullptr;
    const i64 n = (b - a) / V;
    for (i64 q = tid; q < n; q += 2 * stride) {
        const bool two = q + stride < n;
        T pr[2], gr[2], mr[2], vr[2];
        pr[0] = pv[q]; gr[0] = gv[q]; mr[0] = mv[q]; vr[0] = load_v(q);
        if (two) { pr[1] = pv[q + stride]; gr[1] = gv[q + stride]; mr[1] = mv[q + stride]; vr[1] = load_v(q + stride); }
        #pragma unroll
        for (int u = 0; u < 2; u++) {
            if (u == 1 && !two) break;
            float* pe = (float*)&pr[u];
            const float* ge = (const float*)&gr[u];
            float* me = (float*)&mr[u];
            float* ve = (float*)&vr[u];
            #pragma unroll
            for (int k = 0; k < V; k++) adam_update(pe[k], __fmul_rn(ge[k], gscale), me[k], ve[k], lr, b1, b2, eps, decay, adamw, bc1, bc2);
            const i64 at = q + u * stride;
            pv[at] = pr[u]; mv[at] = mr[u]; store_v(at, vr[u]);
            if (hv) {
                H h;
                unsigned* hw = (unsigned*)&h;
                #pragma unroll
                for (int k = 0; k < V / 2; k++) hw[k] = f2bf2(pe[2 * k], pe[2 * k + 1]);
                hv[at] = h;
            }
        }
    }
}

// Whether elements from j on can go V at a time: every array at a V-element boundary at j
// (v at a VV-element one).
__device__ __forceinline__ bool vector_aligned(const float* p, const float* g, const float* m, const float* v, const bf16* pc, i64 j, int V, int VV) {
    const unsigned long long f = 4ull * V, h = 2ull * V;
    return (unsigned long long)(p + j) % f == 0 && (unsigned long long)(g + j) % f == 0 && (unsigned long long)(m + j) % f == 0
        && (unsigned long long)(v + j) % (4ull * VV) == 0 && (!pc || (unsigned long long)(pc + j) % h == 0);
}

// One block per segment chunk (grid.y). The chunk's start is moved to the first element at
// which every array is 16-byte aligned (v 8-byte where 16 cannot be had: Adam's v follows m at
// an offset of P floats, any even count; all 8-byte where p, g, m are only that), the elements
// before it and after the last whole vector go one at a time.
extern "C" __global__ void adam_kernel(float* p, const float* g, float* m, float* v, const i64* segs,
                                       float lr, float b1, float b2, float eps, float wd, int adamw,
                                       float bc1, float bc2, float gscale, bf16* pc, const double* norm2, float clip) {
    gscale = clipped_scale(gscale, norm2, clip);
    const i64 start = segs[3 * blockIdx.y], end = segs[3 * blockIdx.y + 1], code = segs[3 * blockIdx.y + 2];
    const float decay = (code & 1) ? wd : 0.f;
    lr *= segment_lr_scale(code);
    const i64 stride = (i64)gridDim.x * blockDim.x;
    const i64 tid = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    // the first element at which p is 16-byte aligned (then 8-byte), and whether the others are too
    const i64 head4 = start + (i64)((16 - (unsigned long long)(p + start) % 16) % 16) / 4;
    const i64 head2 = start + (i64)((8 - (unsigned long long)(p + start) % 8) % 8) / 4;
    int V = 1;
    bool split = false;
    i64 a = end;
    if (head4 + 4 <= end && vector_aligned(p, g, m, v, pc, head4, 4, 4)) { V = 4; a = head4; }
    else if (head4 + 4 <= end && vector_aligned(p, g, m, v, pc, head4, 4, 2)) { V = 4; a = head4; split = true; }
    else if (head2 + 2 <= end && vector_aligned(p, g, m, v, pc, head2, 2, 2)) { V = 2; a = head2; }
    if (V == 1) {
        adam_scalar(p, g, m, v, pc, start, end, tid, stride, lr, b1, b2, eps, decay, adamw, bc1, bc2, gscale);
        return;
    }
    const i64 b = a + (end - a) / V * V;
    adam_scalar(p, g, m, v, pc, start, a, tid, stride, lr, b1, b2, eps, decay, adamw, bc1, bc2, gscale);
    if (V == 4 && split) adam_vector<4, true>(p, g, m, v, pc, a, b, tid, stride, lr, b1, b2, eps, decay, adamw, bc1, bc2, gscale);
    else if (V == 4) adam_vector<4>(p, g, m, v, pc, a, b, tid, stride, lr, b1, b2, eps, decay, adamw, bc1, bc2, gscale);
    else adam_vector<2>(p, g, m, v, pc, a, b, tid, stride, lr, b1, b2, eps, decay, adamw, bc1, bc2, gscale);
    adam_scalar(p, g, m, v, pc, b, end, tid, stride, lr, b1, b2, eps, decay, adamw, bc1, bc2, gscale);
}

// SGD with momentum/dampening/nesterov (torch.optim.SGD); first = 1 on the first step
// (the momentum buffer is set to the gradient).
extern "C" __global__ void sgd_kernel(float* p, const float* g, float* buf, const i64* segs,
                                      float lr, float momentum, float dampening, float wd,
                                      int nesterov, int first, float gscale, bf16* pc, const double* norm2, float clip) {
    gscale = clipped_scale(gscale, norm2, clip);
    const i64 start = segs[3 * blockIdx.y], end = segs[3 * blockIdx.y + 1], code = segs[3 * blockIdx.y + 2];
    const float decay = (code & 1) ? wd : 0.f;
    lr *= segment_lr_scale(code);
    for (i64 i = start + (i64)blockIdx.x * blockDim.x + threadIdx.x; i < end; i += (i64)gridDim.x * blockDim.x) {
        float pi = p[i];
        float gi = g[i] * gscale + decay * pi;
        if (momentum != 0.f) {
            float b = first ? gi : momentum * buf[i] + (1.f - dampening) * gi;
            buf[i] = b;
            gi = nesterov ? gi + momentum * b : b;
        }
        pi -= lr * gi;
        p[i] = pi;
        if (pc) pc[i] = f2bf(pi);
    }
}
