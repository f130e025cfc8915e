// ---- Attention forward on wgmma for long sequences (N > 256) at D = 64 and 80 ----
// FlashAttention-3's structure on the building blocks of hopper.cuh: a block owns 64·CW queries
// of one (b, h) and walks the keys in tiles of 128 with an online softmax (running row maximum,
// O rescaled when it grows), the key tiles streamed through shared memory by the tensor-memory
// accelerator. At D = 64 three consumer warpgroups (CW = 3, 192 queries) rather than two: each
// K and V tile copied into shared memory serves half as many queries again, which outweighs the
// padding of the last query block (BENCHMARKS.md has the measurements); D = 80 has two (below).
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
// warpgroup's products. Query rows ≥ N are zeros and are never stored.
//
// The ragged part of the keys comes first: with r = N mod 128, tile 0 holds keys 0…r − 1 and
// every later tile 128 whole keys from r on, so only tile 0 is masked (its keys ≥ r are −∞
// before the maximum; they are keys of tile 1, read again there). Where r ≤ 16 (ViT-H/14's
// 257 tokens, 4 097 at 1 024 px) tile 0 is multiplied as 16 keys (m64n16 products and one
// 16-deep step of P·V) instead of a tile of 128 that is almost all masked.
//
// D = 80 (ViT-H/14): each Q, K and V tile is two tiles, columns 0…63 with the 128-byte swizzle
// and 64…79 with the 32-byte one (`hg_desc32`; their own tensor maps, 16-column boxes): Q·Kᵀ
// takes a fifth 16-deep step over the second pair, and P·V a 64×16 product of its own, whose
// accumulator is stored straight from registers.
//
// Output and saved state as flash_fwd_wg_d64: out (B, N, H·D) through each consumer's own Q
// tile (stmatrix, then a TMA store), lse2 = m + log2(l) in base 2 with m the row maximum of
// s·scale·log2(e).
#define FL_BN 128                           // keys per tile
#define FL_ST 2                             // stages of the K, V ring
#define FL_KV (FL_BN * 128)                 // one K or V tile (128 rows of 128 bytes)
#define FL_KVT (FL_BN * 32)                 // its 16 columns past 64 at D = 80 (rows of 32 bytes)
// dynamic shared memory for CW consumer warpgroups at head dim D: CW Q tiles (64 rows), the
// ring's K and V tiles, at D = 80 the same again for the 16 columns past 64, 1 + 3·FL_ST
// mbarriers, 1 KiB of alignment slack (attention.rs mirrors it)
#define FL_SMEM(CW, D) ((CW) * 64 * 128 + 2 * FL_ST * FL_KV + ((D) > 64 ? (CW) * 64 * 32 + 2 * FL_ST * FL_KVT : 0) + 8 * (1 + 3 * FL_ST) + 1024)

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

// Shared-memory addresses of one consumer's operands: its Q tile, stage 0 of the K and V ring,
// and at D = 80 the 32-byte-swizzled tiles of columns 64…79 (0 at D = 64).
struct FlTiles {
    unsigned q, k, v, qt, kt, vt;
};

// The consumer's S = Q·K_jᵀ from stage `st` (issued and committed, not waited for): 128 keys
// (J = 16 blocks of 8), or the first 16 rows of the stage (J = 2, the short first tile).
template <int D, int J>
__device__ __forceinline__ void fl_issue_qk(float (&s)[4 * J], const FlTiles& t, unsigned st) {
    const unsigned long long dq = hg_desc(t.q), dk = hg_desc(t.k + st * FL_KV);
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
    if constexpr (J == 16) {
        fl_wgmma_qk<0>(s, dq, dk);
        #pragma unroll
        for (int kk = 1; kk < 4; kk++) fl_wgmma_qk<1>(s, dq + 2 * kk, dk + 2 * kk);
        if constexpr (D == 80) fl_wgmma_qk<1>(s, hg_desc32(t.qt), hg_desc32(t.kt + st * FL_KVT));
    } else {
        static_assert(J == 2, "a key tile is 128 keys or the short first tile's 16");
        wgmma_m64n16k16_ss<0>(s, dq, dk);
        #pragma unroll
        for (int kk = 1; kk < 4; kk++) wgmma_m64n16k16_ss<1>(s, dq + 2 * kk, dk + 2 * kk);
        if constexpr (D == 80) wgmma_m64n16k16_ss<1>(s, hg_desc32(t.qt), hg_desc32(t.kt + st * FL_KVT));
    }
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

// The consumer's O += P·V from stage `st` (issued and committed) over the first 16·KS keys:
// keys 16kk… are V rows 16kk…, 2048 bytes (two 8-row groups of 128 bytes) per step, 512 in the
// 32-byte-swizzled tile of columns 64…79 (accumulated in ot at D = 80).
template <int D, int KS>
__device__ __forceinline__ void fl_issue_pv(float (&o)[32], float (&ot)[8], const unsigned (&pa)[8][4], const FlTiles& t, unsigned st) {
    const unsigned long long dv = hg_desc(t.v + st * FL_KV);
    // the accumulators' rescaling before the fence (written after it, ptxas adds a fence of its own)
    fl_fence(o);
    if constexpr (D == 80) fl_fence(ot);
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
    #pragma unroll
    for (int kk = 0; kk < KS; kk++) wgmma_m64n64k16_rs(o, pa[kk], dv + 128 * kk);
    if constexpr (D == 80) {
        const unsigned long long dvt = hg_desc32(t.vt + st * FL_KVT);
        #pragma unroll
        for (int kk = 0; kk < KS; kk++) wgmma_m64n16k16_rs(ot, pa[kk], dvt + 32 * kk);
    }
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

// One tile's online softmax for the thread's two rows (value 4j + {0,1}: row g, keys
// 8j + 2t + {0,1}; 4j + {2,3}: row g + 8) over J blocks of 8 keys: scores of keys ≥ n (counted
// from the tile's first) to −∞ when `mask`, the running maxima mb0, mb1 (scaled, base 2)
// raised, the factors alpha0, alpha1 that take what was summed before to the new maxima, the
// row sums l0, l1 (this thread's columns) rescaled and extended, and p = 2^(s·scale_log2 − mb)
// in place of s.
template <int J>
__device__ __forceinline__ void fl_softmax(float (&s)[4 * J], bool mask, int n, int t, float scale_log2,
                                           float& mb0, float& mb1, float& l0, float& l1, float& alpha0, float& alpha1) {
    float m0 = -INFINITY, m1 = -INFINITY;
    #pragma unroll
    for (int j = 0; j < J; j++) {
        if (mask) {
            #pragma unroll
            for (int e = 0; e < 4; e++)
                if (8 * j + 2 * t + (e & 1) >= n) s[4 * j + e] = -INFINITY;
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
    for (int j = 0; j < J; j++) {
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

// p (the softmax's output, J blocks of 8 keys) as the A fragments of P·V: keys 16kk…, n8 block
// 2kk → a[0], a[1]; 2kk + 1 → a[2], a[3].
template <int J>
__device__ __forceinline__ void fl_pack_p(unsigned (&pa)[8][4], const float (&p)[4 * J]) {
    #pragma unroll
    for (int j = 0; j < J; j++) {
        pa[j >> 1][(j & 1) * 2] = f2bf2(p[4 * j], p[4 * j + 1]);
        pa[j >> 1][(j & 1) * 2 + 1] = f2bf2(p[4 * j + 2], p[4 * j + 3]);
    }
}

// An accumulator (rows g, g + 8 alternating in pairs) to a new row maximum: row g's values
// times alpha0, row g + 8's times alpha1.
template <int N>
__device__ __forceinline__ void fl_rescale(float (&o)[N], float alpha0, float alpha1) {
    #pragma unroll
    for (int k = 0; k < N; k += 4) {
        o[k] *= alpha0;
        o[k + 1] *= alpha0;
        o[k + 2] *= alpha1;
        o[k + 3] *= alpha1;
    }
}

// Tile 0 of a consumer's walk, its first J blocks of 8 keys (J = 2: the short first tile):
// S_0 multiplied and waited for, its softmax masked at `first` unless whole, P_0 packed.
template <int D, int J>
__device__ __forceinline__ void fl_tile0(float (&s)[4 * J], unsigned (&pa)[8][4], const FlTiles& tl, int first, int t, float scale_log2,
                                         float& mb0, float& mb1, float& l0, float& l1, float& alpha0, float& alpha1) {
    fl_issue_qk<D, J>(s, tl, 0);
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    fl_fence(s);
    fl_softmax<J>(s, first < FL_BN, first, t, scale_log2, mb0, mb1, l0, l1, alpha0, alpha1);
    fl_pack_p<J>(pa, s);
}

// Step j ≥ 1 of a consumer's walk (see the file's comment): S_j = Q·K_jᵀ issued, O rescaled and
// O += P_{j−1}·V_{j−1} issued over KS 16-key steps (1 after a short first tile), tile j's
// softmax while that runs, then P_j packed.
template <int D, int KS>
__device__ __forceinline__ void fl_step(int j, float (&s)[64], float (&o)[32], float (&ot)[8], unsigned (&pa)[8][4], const FlTiles& tl,
                                        unsigned kfull0, unsigned vfull0, unsigned empty0, int lane, int t, float scale_log2,
                                        float& mb0, float& mb1, float& l0, float& l1, float& alpha0, float& alpha1) {
    const int st = j % FL_ST, ps = (j - 1) % FL_ST;
    ht_mbar_wait(kfull0 + 8 * st, (j / FL_ST) & 1);
    ht_mbar_wait(vfull0 + 8 * ps, ((j - 1) / FL_ST) & 1);
    fl_issue_qk<D, 16>(s, tl, st);
    // O to the maximum P_{j−1} was taken against, while S_j multiplies
    fl_rescale(o, alpha0, alpha1);
    if constexpr (D == 80) fl_rescale(ot, alpha0, alpha1);
    fl_issue_pv<D, KS>(o, ot, pa, tl, ps);
    asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");  // S_j (the older group)
    fl_fence(s);
    fl_softmax<16>(s, false, FL_BN, t, scale_log2, mb0, mb1, l0, l1, alpha0, alpha1);
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");  // P_{j−1}·V_{j−1}
    fl_fence(o);
    if constexpr (D == 80) fl_fence(ot);
    if (lane == 0) ht_mbar_arrive(empty0 + 8 * ps);
    fl_pack_p<16>(pa, s);
}

// Grid (⌈N / 64·CW⌉, B·H), 128·(CW + 1) threads, FL_SMEM(CW, D) bytes of dynamic shared memory:
// CW = 3 at D = 64, 2 at D = 80 (whose consumers hold 8 more accumulators and the fifth step's
// descriptors: 160 registers, all that three consumers can have, made ptxas serialize the
// wgmmas; two get 240). Tensor maps
// (`tensor_map_3d`, 64-column boxes, 128-byte swizzle): tm_kv over qkv (B, N, 3·H·D) with
// 128-row boxes, tm_q the same with 64-row boxes, tm_out over out (B, N, H·D) with 64-row boxes;
// at D = 80 tm_kvt and tm_qt as tm_kv and tm_q with 16-column boxes and the 32-byte swizzle
// (`tensor_map_3d_cols16`; not read at D = 64).
// The kernel body for CW consumer warpgroups (64·CW queries per block; the producer's
// registers go to the consumers: 24 against 160 at CW = 3, 240 at CW = 2).
template <int CW, int D>
__device__ __forceinline__ void fl_fwd_long(const HgTmap& tm_kv, const HgTmap& tm_q, const HgTmap& tm_out, const HgTmap& tm_kvt, const HgTmap& tm_qt,
                                            bf16* __restrict__ out, float* __restrict__ lse2, int n, int h, float scale_log2) {
    static_assert(D == 64 || D == 80, "head dims 64 and 80");
    extern __shared__ unsigned char fl_raw[];
    const unsigned sbase = (smem_u32(fl_raw) + 1023u) & ~1023u;  // swizzled tiles start 1024-byte aligned
    const unsigned sq = sbase, sk = sq + CW * 64 * 128, sv = sk + FL_ST * FL_KV;
    // the 32-byte-swizzled tiles of columns 64…79 (D = 80), then the mbarriers
    const unsigned sqt = sv + FL_ST * FL_KV, skt = sqt + (D > 64 ? CW * 64 * 32 : 0), svt = skt + (D > 64 ? FL_ST * FL_KVT : 0);
    const unsigned qfull = svt + (D > 64 ? FL_ST * FL_KVT : 0);
    const unsigned kfull0 = qfull + 8, vfull0 = kfull0 + 8 * FL_ST, empty0 = vfull0 + 8 * FL_ST;
    const int tid = threadIdx.x, wg = tid >> 7;
    const int bh = blockIdx.y, bi = bh / h, hi = bh - bi * h;
    const int q0 = blockIdx.x * 64 * CW;
    const int nwg = min(CW, (n - q0 + 63) / 64);  // consumer warpgroups with queries < n
    // tile 0: keys 0…first − 1 (the ragged part, or 128); tile j ≥ 1: 128 keys from
    // first + 128(j − 1)
    const int first = n % FL_BN ? n % FL_BN : FL_BN, nkt = 1 + (n - first) / FL_BN;
    const bool short_first = first <= 16;
    constexpr unsigned QB = 64 * 128 + (D > 64 ? 64 * 32 : 0), KB = FL_KV + (D > 64 ? FL_KVT : 0);
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
            ht_mbar_expect_tx(qfull, nwg * QB);
            for (int w = 0; w < nwg; w++) {
                ht_tma_load3(sq + w * 64 * 128, &tm_q, hi * D, q0 + 64 * w, bi, qfull);
                if (D > 64) ht_tma_load3(sqt + w * 64 * 32, &tm_qt, hi * D + 64, q0 + 64 * w, bi, qfull);
            }
            for (int j = 0; j < nkt; j++) {
                const int s = j % FL_ST, u = j / FL_ST, key0 = j ? first + FL_BN * (j - 1) : 0;
                // stage s is free once every consumer warp's P·V of tile j − FL_ST has completed
                if (u > 0) ht_mbar_wait(empty0 + 8 * s, (u - 1) & 1);
                ht_mbar_expect_tx(kfull0 + 8 * s, KB);
                ht_tma_load3(sk + s * FL_KV, &tm_kv, (h + hi) * D, key0, bi, kfull0 + 8 * s);
                if (D > 64) ht_tma_load3(skt + s * FL_KVT, &tm_kvt, (h + hi) * D + 64, key0, bi, kfull0 + 8 * s);
                ht_mbar_expect_tx(vfull0 + 8 * s, KB);
                ht_tma_load3(sv + s * FL_KV, &tm_kv, (2 * h + hi) * D, key0, bi, vfull0 + 8 * s);
                if (D > 64) ht_tma_load3(svt + s * FL_KVT, &tm_kvt, (2 * h + hi) * D + 64, key0, bi, vfull0 + 8 * s);
            }
        }
        return;
    }
    static_assert(CW == 2 || CW == 3, "register splits for two and three consumer warpgroups");
    if constexpr (CW == 3) asm volatile("setmaxnreg.inc.sync.aligned.u32 160;\n" ::: "memory");
    else asm volatile("setmaxnreg.inc.sync.aligned.u32 240;\n" ::: "memory");
    const int cw = wg - 1;  // consumer cw: queries q0 + 64·cw…
    if (cw >= nwg) return;  // in the last block, 64 queries that are all ≥ n
    const int ltid = tid & 127, wi = ltid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const FlTiles tl = {sq + cw * 64 * 128, sk, sv, sqt + cw * 64 * 32, skt, svt};

    float o[32], ot[8];
    #pragma unroll
    for (int k = 0; k < 32; k++) o[k] = 0.f;
    #pragma unroll
    for (int k = 0; k < 8; k++) ot[k] = 0.f;
    float mb0 = -INFINITY, mb1 = -INFINITY, l0 = 0.f, l1 = 0.f, alpha0 = 1.f, alpha1 = 1.f;
    unsigned pa[8][4];
    float s[64];

    // tile 0, masked at `first` unless whole (against sums that are 0: its factors are unused)
    ht_mbar_wait(qfull, 0);
    ht_mbar_wait(kfull0, 0);
    if (short_first) {
        float s16[8];
        fl_tile0<D, 2>(s16, pa, tl, first, t, scale_log2, mb0, mb1, l0, l1, alpha0, alpha1);
    } else {
        fl_tile0<D, 16>(s, pa, tl, first, t, scale_log2, mb0, mb1, l0, l1, alpha0, alpha1);
    }

    // (N > 256: tile 0 is followed by at least two whole tiles)
    int j = 1;
    if (short_first) {
        fl_step<D, 1>(1, s, o, ot, pa, tl, kfull0, vfull0, empty0, lane, t, scale_log2, mb0, mb1, l0, l1, alpha0, alpha1);
        j = 2;
    }
    for (; j < nkt; j++) fl_step<D, 8>(j, s, o, ot, pa, tl, kfull0, vfull0, empty0, lane, t, scale_log2, mb0, mb1, l0, l1, alpha0, alpha1);
    fl_rescale(o, alpha0, alpha1);
    if constexpr (D == 80) fl_rescale(ot, alpha0, alpha1);
    const int ls = (nkt - 1) % FL_ST;
    ht_mbar_wait(vfull0 + 8 * ls, ((nkt - 1) / FL_ST) & 1);
    fl_issue_pv<D, 8>(o, ot, pa, tl, ls);
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    fl_fence(o);
    if constexpr (D == 80) fl_fence(ot);

    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    const int r0 = q0 + cw * 64 + wi * 16 + g, r1 = r0 + 8;
    const float il0 = 1.f / l0, il1 = 1.f / l1;
    if (t == 0) {
        if (r0 < n) lse2[(i64)bh * n + r0] = mb0 + __log2f(l0);
        if (r1 < n) lse2[(i64)bh * n + r1] = mb1 + __log2f(l1);
    }
    if constexpr (D == 80) {
        // columns 64…79 straight from the accumulator
        const i64 hd = (i64)h * D;
        wg_store_cols16(out + (i64)bi * n * hd + hi * D + 64, ot, r0, n, t, hd, il0, il1);
    }
    // the warpgroup's last Q·Kᵀ has read its Q tile before the output overwrites it
    asm volatile("bar.sync %0, 128;\n" ::"r"(1 + cw) : "memory");
    wg_stage_tile(tl.q, o, il0, il1, wi, lane);
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    asm volatile("bar.sync %0, 128;\n" ::"r"(1 + cw) : "memory");
    if (ltid == 0) {
        ht_tma_store3(&tm_out, hi * D, q0 + cw * 64, bi, tl.q);
        asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
        // the block's shared memory must outlive the store's reads
        asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
    }
}

extern "C" __global__ void __launch_bounds__(512, 1) flash_fwd_wg_long_d64(const __grid_constant__ HgTmap tm_kv, const __grid_constant__ HgTmap tm_q, const __grid_constant__ HgTmap tm_out, float* __restrict__ lse2, int n, int h, float scale_log2) {
    fl_fwd_long<3, 64>(tm_kv, tm_q, tm_out, tm_kv, tm_q, nullptr, lse2, n, h, scale_log2);
}

extern "C" __global__ void __launch_bounds__(384, 1) flash_fwd_wg_long_d80(const __grid_constant__ HgTmap tm_kv, const __grid_constant__ HgTmap tm_q, const __grid_constant__ HgTmap tm_out, const __grid_constant__ HgTmap tm_kvt, const __grid_constant__ HgTmap tm_qt, bf16* __restrict__ out, float* __restrict__ lse2, int n, int h, float scale_log2) {
    fl_fwd_long<2, 80>(tm_kv, tm_q, tm_out, tm_kvt, tm_qt, out, lse2, n, h, scale_log2);
}
