// Softmax cross-entropy against soft targets, one warp per row, fp32 throughout.
// losses[b] = logsumexp(logits[b]) · Σ t − Σ t·logits[b];  dlogits = (softmax − t) · scale.
extern "C" __global__ void cross_entropy_kernel(void* losses, int dtl, void* dlogits, int dtd,
                                                const void* logits, int dtx, const void* targets, int dtt,
                                                int b, int k, float scale) {
    int warps = blockDim.x >> 5, lane = threadIdx.x & 31;
    for (int r = blockIdx.x * warps + (threadIdx.x >> 5); r < b; r += gridDim.x * warps) {
        i64 base = (i64)r * k;
        float m = -INFINITY;
        for (int i = lane; i < k; i += 32) m = fmaxf(m, ldx(logits, dtx, base + i));
        m = warp_max(m);
        float s = 0.f, tsum = 0.f, tx = 0.f;
        for (int i = lane; i < k; i += 32) {
            float x = ldx(logits, dtx, base + i), t = ldx(targets, dtt, base + i);
            s += expf(x - m);
            tsum += t;
            tx += t * x;
        }
        s = warp_sum(s); tsum = warp_sum(tsum); tx = warp_sum(tx);
        float lse = m + logf(s);
        if (lane == 0) stx(losses, dtl, r, lse * tsum - tx);
        if (dlogits) {
            for (int i = lane; i < k; i += 32) {
                float x = ldx(logits, dtx, base + i), t = ldx(targets, dtt, base + i);
                stx(dlogits, dtd, base + i, (expf(x - lse) - t) * scale);
            }
        }
    }
}
