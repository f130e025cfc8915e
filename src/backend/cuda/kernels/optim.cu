// Fused optimizer steps over the flat f32 buffers. The grid's y index picks a segment of
// parameters sharing one weight-decay flag: segs[3·y] = start, [3·y+1] = end, [3·y+2] = decays.
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

// AdamW (adamw = 1, decoupled decay) or Adam with L2 (adamw = 0), torch semantics.
// bc1 = 1 − β1^t, bc2 = 1 − β2^t (1 when bias correction is off).
__device__ __forceinline__ void adam_update(float& p, float g, float& m, float& v, float lr, float b1, float b2, float eps,
                                            float decay, int adamw, float bc1, float bc2) {
    if (!adamw) g += decay * p;
    m = b1 * m + (1.f - b1) * g;
    v = b2 * v + (1.f - b2) * g * g;
    const float upd = (m / bc1) / (sqrtf(v / bc2) + eps);
    if (adamw) p -= lr * decay * p;
    p -= lr * upd;
}

// Four elements per thread and iteration (stride apart), all loaded before any is updated:
// one at a time kept 16 bytes per thread in flight and ran at ~2.4 TB/s on an H200. The form
// for any P; adam_kernel_v2 below is the one used when the buffers allow pairs.
extern "C" __global__ void adam_kernel(float* p, const float* g, float* m, float* v, const i64* segs,
                                       float lr, float b1, float b2, float eps, float wd, int adamw,
                                       float bc1, float bc2, float gscale, bf16* pc, const double* norm2, float clip) {
    gscale = clipped_scale(gscale, norm2, clip);
    const i64 start = segs[3 * blockIdx.y], end = segs[3 * blockIdx.y + 1];
    const float decay = segs[3 * blockIdx.y + 2] ? wd : 0.f;
    const i64 stride = (i64)gridDim.x * blockDim.x;
    i64 i = start + (i64)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + 3 * stride < end; i += 4 * stride) {
        float pv[4], gv[4], mv[4], vv[4];
        #pragma unroll
        for (int k = 0; k < 4; k++) {
            const i64 j = i + k * stride;
            pv[k] = p[j]; gv[k] = g[j]; mv[k] = m[j]; vv[k] = v[j];
        }
        #pragma unroll
        for (int k = 0; k < 4; k++) {
            const i64 j = i + k * stride;
            adam_update(pv[k], gv[k] * gscale, mv[k], vv[k], lr, b1, b2, eps, decay, adamw, bc1, bc2);
            p[j] = pv[k]; m[j] = mv[k]; v[j] = vv[k];
            if (pc) pc[j] = f2bf(pv[k]);
        }
    }
    for (; i < end; i += stride) {
        float pi = p[i], mi = m[i], vi = v[i];
        adam_update(pi, g[i] * gscale, mi, vi, lr, b1, b2, eps, decay, adamw, bc1, bc2);
        p[i] = pi; m[i] = mi; v[i] = vi;
        if (pc) pc[i] = f2bf(pi);
    }
}

// adam_kernel on pairs: float2 loads and stores, two pairs per thread in flight — 3.95 against
// 3.27 TB/s for the scalar form over ViT-B/16's 85.8 M parameters (H200, a standalone timing of
// both). Needs every buffer 8-byte aligned at even indices: bases from the allocator and v at an
// even offset P (the host checks both). A segment's odd first element and odd last one go
// through thread 0 one at a time.
extern "C" __global__ void adam_kernel_v2(float* p, const float* g, float* m, float* v, const i64* segs,
                                          float lr, float b1, float b2, float eps, float wd, int adamw,
                                          float bc1, float bc2, float gscale, bf16* pc, const double* norm2, float clip) {
    gscale = clipped_scale(gscale, norm2, clip);
    const i64 start = segs[3 * blockIdx.y], end = segs[3 * blockIdx.y + 1];
    const float decay = segs[3 * blockIdx.y + 2] ? wd : 0.f;
    const i64 a = (start + 1) & ~(i64)1;             // first even index
    const i64 pairs = end > a ? (end - a) / 2 : 0;
    if (threadIdx.x == 0) {
        i64 edge[2] = {start < a && start < end ? start : -1, a + 2 * pairs < end ? end - 1 : -1};
        #pragma unroll
        for (int k = 0; k < 2; k++) {
            const i64 i = edge[k];
            if (i < 0) continue;
            float pi = p[i], mi = m[i], vi = v[i];
            adam_update(pi, g[i] * gscale, mi, vi, lr, b1, b2, eps, decay, adamw, bc1, bc2);
            p[i] = pi; m[i] = mi; v[i] = vi;
            if (pc) pc[i] = f2bf(pi);
        }
    }
    float2* p2 = (float2*)(p + a); const float2* g2 = (const float2*)(g + a);
    float2* m2 = (float2*)(m + a); float2* v2 = (float2*)(v + a);
    unsigned* pc2 = pc ? (unsigned*)(pc + a) : nullptr;
    const i64 stride = blockDim.x;
    i64 i = threadIdx.x;
    for (; i < pairs; i += 2 * stride) {
        const bool two = i + stride < pairs;
        float2 pv[2], gv[2], mv[2], vv[2];
        #pragma unroll
        for (int k = 0; k < 2; k++) {
            if (k == 1 && !two) break;
            const i64 j = i + k * stride;
            pv[k] = p2[j]; gv[k] = g2[j]; mv[k] = m2[j]; vv[k] = v2[j];
        }
        #pragma unroll
        for (int k = 0; k < 2; k++) {
            if (k == 1 && !two) break;
            const i64 j = i + k * stride;
            adam_update(pv[k].x, gv[k].x * gscale, mv[k].x, vv[k].x, lr, b1, b2, eps, decay, adamw, bc1, bc2);
            adam_update(pv[k].y, gv[k].y * gscale, mv[k].y, vv[k].y, lr, b1, b2, eps, decay, adamw, bc1, bc2);
            p2[j] = pv[k]; m2[j] = mv[k]; v2[j] = vv[k];
            if (pc2) pc2[j] = f2bf2(pv[k].x, pv[k].y);
        }
    }
}

// SGD with momentum/dampening/nesterov (torch.optim.SGD); first = 1 on the first step
// (the momentum buffer is set to the gradient).
extern "C" __global__ void sgd_kernel(float* p, const float* g, float* buf, const i64* segs,
                                      float lr, float momentum, float dampening, float wd,
                                      int nesterov, int first, float gscale, bf16* pc, const double* norm2, float clip) {
    gscale = clipped_scale(gscale, norm2, clip);
    i64 start = segs[3 * blockIdx.y], end = segs[3 * blockIdx.y + 1];
    float decay = segs[3 * blockIdx.y + 2] ? wd : 0.f;
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
