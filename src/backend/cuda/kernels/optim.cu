// Fused optimizer steps over the flat f32 buffers. The grid's y index picks a segment of
// parameters sharing one weight-decay flag: segs[3·y] = start, [3·y+1] = end, [3·y+2] = decays.

// AdamW (adamw = 1, decoupled decay) or Adam with L2 (adamw = 0), torch semantics.
// bc1 = 1 − β1^t, bc2 = 1 − β2^t (1 when bias correction is off).
extern "C" __global__ void adam_kernel(float* p, const float* g, float* m, float* v, const i64* segs,
                                       float lr, float b1, float b2, float eps, float wd, int adamw,
                                       float bc1, float bc2, float gscale) {
    i64 start = segs[3 * blockIdx.y], end = segs[3 * blockIdx.y + 1];
    float decay = segs[3 * blockIdx.y + 2] ? wd : 0.f;
    for (i64 i = start + (i64)blockIdx.x * blockDim.x + threadIdx.x; i < end; i += (i64)gridDim.x * blockDim.x) {
        float pi = p[i];
        float gi = g[i] * gscale;
        if (!adamw) gi += decay * pi;
        float mi = b1 * m[i] + (1.f - b1) * gi;
        float vi = b2 * v[i] + (1.f - b2) * gi * gi;
        m[i] = mi;
        v[i] = vi;
        float upd = (mi / bc1) / (sqrtf(vi / bc2) + eps);
        if (adamw) pi -= lr * decay * pi;
        p[i] = pi - lr * upd;
    }
}

// SGD with momentum/dampening/nesterov (torch.optim.SGD); first = 1 on the first step
// (the momentum buffer is set to the gradient).
extern "C" __global__ void sgd_kernel(float* p, const float* g, float* buf, const i64* segs,
                                      float lr, float momentum, float dampening, float wd,
                                      int nesterov, int first, float gscale) {
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
        p[i] = pi - lr * gi;
    }
}
