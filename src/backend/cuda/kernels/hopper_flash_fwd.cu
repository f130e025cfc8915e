// ---- Attention forward on wgmma for long sequences (N > 256) at D = 64 ----
// FlashAttention-3's structure on the building blocks of hopper.cuh: a block owns 64·CW = 192
// queries of one (b, h) and walks the keys in tiles of 128 with an online softmax (running row
// maximum, O rescaled when it grows), the key tiles streamed through shared memory by the
// tensor-memory accelerator. Three consumer warpgroups rather than two: each K and V tile
// copied into shared memory serves half as many queries again, which outweighs the padding of
// the last query block (BENCHMARKS.md has the measurements).
//
// Warpgroup 0 produces: one thread issues the TMA copies (3-D maps over (B, N, columns), so
// rows ≥ N load as zeros) of the block's 64-query Q tiles and of each key tile's K and V into a
// ring of FL_ST stages, with mbarriers kfull[s], vfull[s] (the copy's bytes landed) and
// empty[s] (every consumer warp is done with stage s: its P·V has completed). Warpgroups
// 1…CW consume, 64 queries each: S = Q·Kᵀ is one m64n128 accumulator (Q and K K-major from the
// 128-byte-swizzled tiles, as flash_fwd_wg_d64), and O += P·V takes P from registers (the A
// operand) against V in its stored layout (MN-major B). The producer gives its registers to the
// consumers (setmaxnreg).
//
// Within a consumer the tensor cores and the softmax overlap (FA3's intra-warpgroup pipelining):
// in step j it issues S_j = Q·K_jᵀ, rescales O by the factor tile j − 1's softmax found, issues
// O += P_{j−1}·V_{j−1}, and computes tile j's softmax while that product runs; only the bf16
// rounding of P_j waits for it (P_{j−1}'s registers are still being read). Per 128×128 tile the
// exponentials (one MUFU op per score) cost about what the two products do at D = 64, so they
// have to run beside the tensor cores: here beside the own warpgroup's P·V and the other
// warpgroup's products. Keys ≥ N (the last tile only) are
// −∞ before the maximum; query rows ≥ N are zeros and are never stored.
//
// Output and saved state as flash_fwd_wg_d64: out (B, N, H·D) through each consumer's own Q
// tile (stmatrix, then a TMA store), lse2 = m + log2(l) in base 2 with m the row maximum of
// s·scale·log2(e).
#define FL_BN 128                           // keys per tile
#define FL_ST 2                             // stages of the K, V ring
#define FL_KV (FL_BN * 128)                 // one K or V tile (128 rows of 128 bytes)
// dynamic shared memory for CW consumer warpgroups: CW Q tiles (64 rows), the ring's K and V
// tiles, 1 + 3·FL_ST mbarriers, 1 KiB of alignment slack
#define FL_SMEM(CW) ((CW) * 64 * 128 + 2 * FL_ST * FL_KV + 8 * (1 + 3 * FL_ST) + 1024)

// d (this thread's 64 of the warpgroup's 64×128 f32 tile) = (ACC ? d : 0) + A(64×16)·B(128×16)ᵀ,
// both K-major in shared memory: the first k-step of S = Q·Kᵀ overwrites the accumulator
// instead of reading one that was zeroed.
template <int ACC>
__device__ __forceinline__ void fl_wgmma_qk(float (&d)[64], unsigned long long da, unsigned long long db) {
    asm volatile(
        "{\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
        "%64, %65, %66, 1, 1, 0, 0;\n"
        "}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(da), "l"(db), "n"(ACC));
}

// Keeps the compiler from moving register reads or writes of `r` across this point (the
// asynchronous wgmma reads and writes them behind its back until the wait).
template <int N>
__device__ __forceinline__ void fl_fence(float (&r)[N]) {
    #pragma unroll
    for (int i = 0; i < N; i++) asm volatile("" : "+f"(r[i])::"memory");
}

// The consumer's S = Q·K_jᵀ from stage `sk` (issued and committed, not waited for).
__device__ __forceinline__ void fl_issue_qk(float (&s)[64], unsigned long long dq, unsigned sk) {
    const unsigned long long dk = hg_desc(sk);
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
    fl_wgmma_qk<0>(s, dq, dk);
    #pragma unroll
    for (int kk = 1; kk < 4; kk++) fl_wgmma_qk<1>(s, dq + 2 * kk, dk + 2 * kk);
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

// The consumer's O += P·V from stage `sv` (issued and committed): keys 16kk… are V rows 16kk…,
// 2048 bytes (two 8-row groups) per step.
__device__ __forceinline__ void fl_issue_pv(float (&o)[32], const unsigned (&pa)[8][4], unsigned sv) {
    const unsigned long long dv = hg_desc(sv);
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
    #pragma unroll
    for (int kk = 0; kk < 8; kk++) wgmma_m64n64k16_rs(o, pa[kk], dv + 128 * kk);
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

// One tile's online softmax for the thread's two rows (value 4j + {0,1}: row g, keys
// 8j + 2t + {0,1}; 4j + {2,3}: row g + 8): scores of keys ≥ n (kbase + column) to −∞ when
// `mask`, the running maxima mb0, mb1 (scaled, base 2) raised, the factors alpha0, alpha1 that
// take what was summed before to the new maxima, the row sums l0, l1 (this thread's columns)
// rescaled and extended, and p = 2^(s·scale_log2 − mb) in place of s.
__device__ __forceinline__ void fl_softmax(float (&s)[64], bool mask, int kbase, int n, int t, float scale_log2,
                                           float& mb0, float& mb1, float& l0, float& l1, float& alpha0, float& alpha1) {
    float m0 = -INFINITY, m1 = -INFINITY;
    #pragma unroll
    for (int j = 0; j < 16; j++) {
        if (mask) {
            #pragma unroll
            for (int e = 0; e < 4; e++)
                if (kbase + 8 * j + 2 * t + (e & 1) >= n) s[4 * j + e] = -INFINITY;
        }
        m0 = fmaxf(m0, fmaxf(s[4 * j], s[4 * j + 1]));
        m1 = fmaxf(m1, fmaxf(s[4 * j + 2], s[4 * j + 3]));
    }
    // every tile holds a key < n, so the new maxima are finite; the first tile's factors are
    // 2^(−∞) = 0 against sums that are still 0
    const float mn0 = fmaxf(mb0, quad_max(m0) * scale_log2), mn1 = fmaxf(mb1, quad_max(m1) * scale_log2);
    alpha0 = exp2f(mb0 - mn0);
    alpha1 = exp2f(mb1 - mn1);
    mb0 = mn0;
    mb1 = mn1;
    float r0 = 0.f, r1 = 0.f;
    #pragma unroll
    for (int j = 0; j < 16; j++) {
        s[4 * j] = exp2f(fmaf(s[4 * j], scale_log2, -mn0));
        s[4 * j + 1] = exp2f(fmaf(s[4 * j + 1], scale_log2, -mn0));
        s[4 * j + 2] = exp2f(fmaf(s[4 * j + 2], scale_log2, -mn1));
        s[4 * j + 3] = exp2f(fmaf(s[4 * j + 3], scale_log2, -mn1));
        r0 += s[4 * j] + s[4 * j + 1];
        r1 += s[4 * j + 2] + s[4 * j + 3];
    }
    l0 = fmaf(l0, alpha0, r0);
    l1 = fmaf(l1, alpha1, r1);
}

// p (the softmax's output) as the A fragments of P·V: keys 16kk…, n8 block 2kk → a[0], a[1];
// 2kk + 1 → a[2], a[3].
__device__ __forceinline__ void fl_pack_p(unsigned (&pa)[8][4], const float (&p)[64]) {
    #pragma unroll
    for (int j = 0; j < 16; j++) {
        pa[j >> 1][(j & 1) * 2] = f2bf2(p[4 * j], p[4 * j + 1]);
        pa[j >> 1][(j & 1) * 2 + 1] = f2bf2(p[4 * j + 2], p[4 * j + 3]);
    }
}

// The O accumulator (this thread's 32 values: rows g, g + 8 alternating in pairs) to a new
// row maximum: row g's values times alpha0, row g + 8's times alpha1.
__device__ __forceinline__ void fl_rescale(float (&o)[32], float alpha0, float alpha1) {
    #pragma unroll
    for (int k = 0; k < 32; k += 4) {
        o[k] *= alpha0;
        o[k + 1] *= alpha0;
        o[k + 2] *= alpha1;
        o[k + 3] *= alpha1;
    }
}

// Grid (⌈N / 192⌉, B·H), 512 threads, FL_SMEM(3) bytes of dynamic shared memory. Tensor maps
// (`tensor_map_3d`, 64-column boxes, 128-byte swizzle): tm_kv over qkv (B, N, 3·H·D) with
// 128-row boxes, tm_q the same with 64-row boxes, tm_out over out (B, N, H·D) with 64-row boxes.
// The kernel body for CW consumer warpgroups (64·CW queries per block, 128·(CW + 1) threads;
// the producer's registers go to the consumers: 24 against 160 at CW = 3).
template <int CW>
__device__ __forceinline__ void fl_fwd_long(const HgTmap& tm_kv, const HgTmap& tm_q, const HgTmap& tm_out, float* __restrict__ lse2, int n, int h, float scale_log2) {
    constexpr int D = 64;
    extern __shared__ unsigned char fl_raw[];
    const unsigned sbase = (smem_u32(fl_raw) + 1023u) & ~1023u;  // swizzled tiles start 1024-byte aligned
    const unsigned sq = sbase, sk = sq + CW * 64 * 128, sv = sk + FL_ST * FL_KV, qfull = sv + FL_ST * FL_KV;
    const unsigned kfull0 = qfull + 8, vfull0 = kfull0 + 8 * FL_ST, empty0 = vfull0 + 8 * FL_ST;
    const int tid = threadIdx.x, wg = tid >> 7;
    const int bh = blockIdx.y, bi = bh / h, hi = bh - bi * h;
    const int q0 = blockIdx.x * 64 * CW;
    const int nwg = min(CW, (n - q0 + 63) / 64);  // consumer warpgroups with queries < n
    const int nkt = (n + FL_BN - 1) / FL_BN;
    if (tid == 0) {
        ht_mbar_init(qfull, 1);
        for (int s = 0; s < FL_ST; s++) {
            ht_mbar_init(kfull0 + 8 * s, 1);
            ht_mbar_init(vfull0 + 8 * s, 1);
            ht_mbar_init(empty0 + 8 * s, 4 * nwg);  // one arrival per consumer warp
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();  // the mbarriers' initialization before anyone waits on them

    if (wg == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n" ::: "memory");
        if (tid == 0) {
            ht_mbar_expect_tx(qfull, nwg * 64 * 128);
            for (int w = 0; w < nwg; w++) ht_tma_load3(sq + w * 64 * 128, &tm_q, hi * D, q0 + 64 * w, bi, qfull);
            for (int j = 0; j < nkt; j++) {
                const int s = j % FL_ST, u = j / FL_ST;
                // stage s is free once every consumer warp's P·V of tile j − FL_ST has completed
                if (u > 0) ht_mbar_wait(empty0 + 8 * s, (u - 1) & 1);
                ht_mbar_expect_tx(kfull0 + 8 * s, FL_KV);
                ht_tma_load3(sk + s * FL_KV, &tm_kv, (h + hi) * D, j * FL_BN, bi, kfull0 + 8 * s);
                ht_mbar_expect_tx(vfull0 + 8 * s, FL_KV);
                ht_tma_load3(sv + s * FL_KV, &tm_kv, (2 * h + hi) * D, j * FL_BN, bi, vfull0 + 8 * s);
            }
        }
        return;
    }
    static_assert(CW == 3, "the register split is the one for three consumer warpgroups");
    asm volatile("setmaxnreg.inc.sync.aligned.u32 160;\n" ::: "memory");
    const int cw = wg - 1;  // consumer cw: queries q0 + 64·cw…
    if (cw >= nwg) return;  // in the last block, 64 queries that are all ≥ n
    const int ltid = tid & 127, wi = ltid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const unsigned sqt = sq + cw * 64 * 128;
    const unsigned long long dq = hg_desc(sqt);

    float o[32];
    #pragma unroll
    for (int k = 0; k < 32; k++) o[k] = 0.f;
    float mb0 = -INFINITY, mb1 = -INFINITY, l0 = 0.f, l1 = 0.f, alpha0 = 1.f, alpha1 = 1.f;
    unsigned pa[8][4];
    float s[64];

    ht_mbar_wait(qfull, 0);
    ht_mbar_wait(kfull0, 0);
    fl_issue_qk(s, dq, sk);
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    fl_fence(s);
    {
        float a0, a1;  // (against sums that are 0)
        fl_softmax(s, nkt == 1, 0, n, t, scale_log2, mb0, mb1, l0, l1, a0, a1);
    }
    fl_pack_p(pa, s);

    for (int j = 1; j < nkt; j++) {
        const int st = j % FL_ST, ps = (j - 1) % FL_ST;
        ht_mbar_wait(kfull0 + 8 * st, (j / FL_ST) & 1);
        ht_mbar_wait(vfull0 + 8 * ps, ((j - 1) / FL_ST) & 1);
        fl_issue_qk(s, dq, sk + st * FL_KV);
        // O to the maximum P_{j−1} was taken against, while S_j multiplies
        fl_rescale(o, alpha0, alpha1);
        fl_issue_pv(o, pa, sv + ps * FL_KV);
        asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");  // S_j (the older group)
        fl_fence(s);
        fl_softmax(s, j == nkt - 1, j * FL_BN, n, t, scale_log2, mb0, mb1, l0, l1, alpha0, alpha1);
        asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");  // P_{j−1}·V_{j−1}
        fl_fence(o);
        if (lane == 0) ht_mbar_arrive(empty0 + 8 * ps);
        fl_pack_p(pa, s);
    }
    fl_rescale(o, alpha0, alpha1);
    const int ls = (nkt - 1) % FL_ST;
    ht_mbar_wait(vfull0 + 8 * ls, ((nkt - 1) / FL_ST) & 1);
    fl_issue_pv(o, pa, sv + ls * FL_KV);
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    fl_fence(o);

    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    const int r0 = q0 + cw * 64 + wi * 16 + g, r1 = r0 + 8;
    if (t == 0) {
        if (r0 < n) lse2[(i64)bh * n + r0] = mb0 + __log2f(l0);
        if (r1 < n) lse2[(i64)bh * n + r1] = mb1 + __log2f(l1);
    }
    // the warpgroup's last Q·Kᵀ has read its Q tile before the output overwrites it
    asm volatile("bar.sync %0, 128;\n" ::"r"(1 + cw) : "memory");
    wg_stage_tile(sqt, o, 1.f / l0, 1.f / l1, wi, lane);
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    asm volatile("bar.sync %0, 128;\n" ::"r"(1 + cw) : "memory");
    if (ltid == 0) {
        ht_tma_store3(&tm_out, hi * D, q0 + cw * 64, bi, sqt);
        asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
        // the block's shared memory must outlive the store's reads
        asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
    }
}

extern "C" __global__ void __launch_bounds__(512, 1) flash_fwd_wg_long_d64(const __grid_constant__ HgTmap tm_kv, const __grid_constant__ HgTmap tm_q, const __grid_constant__ HgTmap tm_out, float* __restrict__ lse2, int n, int h, float scale_log2) {
    fl_fwd_long<3>(tm_kv, tm_q, tm_out, lse2, n, h, scale_log2);
}
