// Attention backward on wgmma for long sequences (N > 256) at D = 64 and 80 (sm_90a; hopper.cuh
// in front): `flash_bwd_wg_long_d64`, the long-sequence form of hopper.cu's whole-head
// `flash_bwd_wg_d64`, in the place of flash.cu's `flash_bwd_d64_pipe` (mma.sync), and
// `flash_bwd_wg_long_d80` in the place of `flash_bwd_d80_pipe`. Around it the host runs the same
// passes as for the tiled kernel: `flash_bwd_pre_d{D}` (delta = rowsum(dO ∘ O), (B·H, N) f32)
// before, and `flash_dq_store` (the f32 dQ sums rounded into dqkv) after. Where N mod 128 is
// 1 or 2, `flash_bwd_pre_fold_d{D}_r{R}` takes those first keys in the delta pass and the key
// blocks start after them (`koff`), so that no block holds a key or two alone.
//
// A block owns 128 keys of one (b, h) and walks every query tile of 64. Four warpgroups:
// 0 and 1 consume, warpgroup w owning keys k0 + 64w…; 2 computes dQ; warp 12 (of warpgroup 3)
// produces. Per query tile:
// - Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ (m64n64k16, both operands K-major in shared memory),
// - Pᵀ = exp2(Sᵀ·scale·log2(e) − lse2) in registers, and dV += Pᵀ·dO issued at once (Pᵀ as the
//   register A operand, dO read MN-major: its query rows as stored),
// - dSᵀ = Pᵀ ∘ (dPᵀ − delta) in registers while that product runs, staged (bf16, 128-byte
//   swizzle, stmatrix) into one of FL_DSB buffers and handed to the dQ warpgroup through an
//   mbarrier, then dK += dSᵀ·Q likewise; dK and dV stay in registers for the whole walk;
// and the dQ warpgroup, once both consumers staged their halves of a tile's dSᵀ, computes
// dQ = dS·K over all 128 keys (m64n64k16, A = dS read MN-major from the staged dSᵀ, B = K read
// MN-major) and adds it, times the softmax scale, into the f32 dQ sums (B, N, H·D) with 16-byte
// vector reductions: one reduction per value and block, where a split by keys would double them.
// The consumers never wait for each other (no barrier between them within a tile), so one
// consumer's softmax runs while the other's products do.
// Every wgmma group is waited for within the tile that issued it: with a group still in flight
// across the loop's back edge ptxas serializes the wgmmas (C7514/C7517).
// mbarriers: kv (K, V landed), full[s] (stage s's copies landed and the producer warp's 32 lanes
// stored its statistics), empty[s] (the 8 consumer warps are done with stage s: signalled once
// the dV, dK products that read its Q and dO have completed), ds_full[b] (the 256 consumer
// threads staged their rows of dSᵀ buffer b), ds_empty[b] (the dQ warpgroup's 4 warps are done
// reading it).
//
// The producer warp copies K and V (128-row boxes) once, then each query tile's Q and dO
// (64-row boxes) through the tensor-memory accelerator into a FL_STAGES-deep ring, and the tile's
// lse2 and delta (64 f32 pairs, ordinary loads: the rows of a head start at arbitrary
// alignment) into the stage beside them. The key blocks of a head start their query walk at
// different tiles so that they do not reduce into the same dQ rows at the same time.
//
// Ragged N: the tensor maps read rows ≥ N as zeros (K, V, Q and dO) and the producer gives
// queries ≥ N lse2 = delta = 0, so every score is finite; in tiles that reach past N (the last
// key block, the last query tile) the probability of a key or query ≥ N is replaced by zero,
// which zeroes its dS. dQ rows ≥ N are not reduced, dK and dV rows ≥ N not stored (TMA store).
// With `dv_part` given, the block also sums its keys' dV over the keys (the v bias gradient; the
// q bias's comes from flash_dq_store_sums, the k bias's is zero): each consumer warp puts the
// column sums of its 16 keys into a slot of shared memory, and once both consumers have, the
// slots are added in a fixed order into row b·nkb + key block of dv_part, at the head's D
// columns. The host reduces the rows.
//
// A key block whose second 64 keys are all ≥ N (the last one, where N mod 128 is 1…64) runs
// one consumer warpgroup: the barriers count its arrivals alone and the dQ warpgroup multiplies
// over its 64 keys. A last query tile with no query < N past its first 16 (N mod 64 is 1…16)
// is multiplied as 16 queries: m64n16 products for Sᵀ and dPᵀ, one 16-deep step of dV and dK.
//
// D = 80 (ViT-H/14): each K, V, Q and dO tile is two tiles, columns 0…63 with the 128-byte
// swizzle and 64…79 with the 32-byte one (`hg_desc32`, their own tensor maps of 16-column
// boxes). Sᵀ and dPᵀ take a fifth 16-deep step over the second pair; dV, dK and dQ each a
// 64×16 product of their own, whose accumulators go out straight from registers (dK, dV stores;
// dQ reductions).
//
// Registers: 512 threads, one block per SM (≈ 147 KiB of shared memory at D = 64, ≈ 167 at
// 80), 128 registers a thread at launch. D = 64: the producer warpgroup gives back to 32 and the
// dQ warpgroup to 96, which lets the consumers hold 192 (setmaxnreg): their Sᵀ, dPᵀ, dK and dV
// accumulators alone are 128. D = 80: 24, 80 and 200 (16 more accumulators a consumer).

#define FL_STAGES 3
#define FL_KEYS 128
#define FL_DSB 2                                    // dSᵀ buffers between the consumers and the dQ warpgroup
// Shared-memory layout for head dim D from the 1024-byte aligned base (every tile 1024-byte
// aligned; 128-byte rows, 32-byte rows in the D = 80 tiles of columns 64…79):
template <int D>
struct FlBwdSmem {
    static constexpr int COLS16 = D > 64;                        // tiles of columns 64…79
    static constexpr int K = 0;                                  // K, 128 key rows
    static constexpr int V = K + FL_KEYS * 128;                  // V, 128 key rows
    static constexpr int STAGE = 16384 + COLS16 * 4096;          // Q (64 rows), dO 8192 after; at D = 80 their columns 64…79 at 16384, 18432
    static constexpr int RING = V + FL_KEYS * 128;               // FL_STAGES stages
    static constexpr int DS = RING + FL_STAGES * STAGE;          // FL_DSB dSᵀ buffers of 128 key rows × 64 queries
    static constexpr int OUT = DS + FL_DSB * FL_KEYS * 128;      // dK, dV staging: warpgroup w's dK at OUT + 16384·w, dV 8192 after
    static constexpr int KT = OUT + 2 * 16384;                   // D = 80: K's columns 64…79 (128 rows of 32 bytes), V's 4096 after
    static constexpr int STAT = KT + COLS16 * 2 * FL_KEYS * 32;  // stage s: 64 (lse2, delta) pairs at STAT + 512·s
    static constexpr int BAR = STAT + FL_STAGES * 512;           // kv, full[FL_STAGES], empty[FL_STAGES], ds_full[FL_DSB], ds_empty[FL_DSB]
    static constexpr int SUMS = BAR + 8 * (1 + 2 * FL_STAGES + 2 * FL_DSB);  // 8 consumer warps' Σ dV rows (D f32 each)
    // dynamic shared memory, with 1 KiB of alignment slack (attention.rs mirrors it)
    static constexpr int BYTES = SUMS + 8 * D * 4 + 1024;
};

// d (32 of the warpgroup's 64×64 f32 tile) += A(64×16)·B(64×16)ᵀ, both K-major in shared memory:
// Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ for 64 keys against a tile of 64 queries.
__device__ __forceinline__ void fl_wgmma_m64n64k16_ss(float (&d)[32], unsigned long long da, unsigned long long db) {
    asm volatile(
        "{\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
        "%32, %33, 1, 1, 1, 0, 0;\n"
        "}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(da), "l"(db));
}

// Ties the registers to this point of the program: the compiler may not move their reads before
// a preceding wgmma wait (they are written asynchronously) or their writes after a following
// wgmma issue.
template <int N>
__device__ __forceinline__ void fl_pin(float (&r)[N]) {
    #pragma unroll
    for (int k = 0; k < N; k++) asm volatile("" : "+f"(r[k])::"memory");
}

// This thread's 32 dQ values of a tile (m64n64 accumulator: value 4j + e is query row
// 16·wi + g + 8(e / 2), column 8j + 2t + e % 2) times `scale` into the f32 sums. Lanes t and
// t ^ 1 swap halves so that each adds four consecutive columns of one row: even t row g,
// columns 8j + 2t…; odd t row g + 8, columns 8j + 2t − 2…. `base`: column 0 in query row 0 of
// the (b, h); rows `rstride` floats apart.
// J = 2: the 64×16 accumulator of columns 64…79 at D = 80 (`base` then at column 64).
template <int J = 8>
__device__ __forceinline__ void fl_dq_reduce(float* base, const float (&dq)[4 * J], int q0, int n, int wi, int g, int t, i64 rstride, float scale) {
    const bool odd = t & 1;
    const int r = q0 + wi * 16 + g + (odd ? 8 : 0);
    float* p = base + (i64)r * rstride + 2 * (t & ~1);
    #pragma unroll
    for (int j = 0; j < J; j++) {
        const float s0 = odd ? dq[4 * j] : dq[4 * j + 2], s1 = odd ? dq[4 * j + 1] : dq[4 * j + 3];
        const float r0 = __shfl_xor_sync(0xffffffffu, s0, 1), r1 = __shfl_xor_sync(0xffffffffu, s1, 1);
        const float4 v = odd ? make_float4(r0 * scale, r1 * scale, dq[4 * j + 2] * scale, dq[4 * j + 3] * scale)
                             : make_float4(dq[4 * j] * scale, dq[4 * j + 1] * scale, r0 * scale, r1 * scale);
        if (r < n) asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(p + 8 * j), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w) : "memory");
    }
}

// The sums over this warp's 16 key rows of a 64 × 8J accumulator's columns (value 4j + e in
// column 8j + 2t + e % 2) into `row` at its column 0: the lanes of one t add their 8 rows g
// through shuffles, and the lanes with g = 0 write. `row` 8-byte aligned (shared memory here).
template <int J>
__device__ __forceinline__ void fl_colsum_store(float* row, const float (&acc)[4 * J], int g, int t) {
    #pragma unroll
    for (int j = 0; j < J; j++) {
        float s0 = acc[4 * j] + acc[4 * j + 2], s1 = acc[4 * j + 1] + acc[4 * j + 3];
        #pragma unroll
        for (int o = 4; o < 32; o <<= 1) {
            s0 += __shfl_xor_sync(0xffffffffu, s0, o);
            s1 += __shfl_xor_sync(0xffffffffu, s1, o);
        }
        if (g == 0) *(float2*)(row + 8 * j + 2 * t) = make_float2(s0, s1);
    }
}

// acc (64 keys × 8·QJ queries) = A·Bᵀ over the head dim, issued and committed: Sᵀ = K·Qᵀ or
// dPᵀ = V·dOᵀ. A: the warpgroup's 64 key rows (descriptor da; dat: their columns 64…79 at D
// = 80), B: the query tile (db; its 32-byte-swizzled tile at sbt), both K-major; four 16-deep
// steps over the 128-byte-swizzled tiles, and at D = 80 a fifth over the columns past 64.
template <int QJ, bool C16>
__device__ __forceinline__ void fl_issue_over_head(float (&acc)[4 * QJ], unsigned long long da, unsigned long long dat, unsigned long long db, unsigned sbt) {
    static_assert(QJ == 8 || QJ == 2, "query tiles of 64 or 16");
    #pragma unroll
    for (int kk = 0; kk < 5; kk++) {
        if (kk == 4 && !C16) break;
        const unsigned long long a = kk < 4 ? da + 2 * kk : dat, b = kk < 4 ? db + 2 * kk : hg_desc32(sbt);
        if constexpr (QJ == 8) fl_wgmma_m64n64k16_ss(acc, a, b);
        else wgmma_m64n16k16_ss(acc, a, b);
    }
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

// A compile-time count for the generic lambdas' template arguments.
template <int V>
struct FlTag {
    static constexpr int value = V;
};

// d (8 of the warpgroup's 64×16 f32 tile) += A(64×16)·B(16×16), both MN-major in shared memory:
// dQ's columns 64…79 at D = 80 from the staged dSᵀ and K's 32-byte-swizzled tile.
__device__ __forceinline__ void wgmma_m64n16k16_tt(float (&d)[8], unsigned long long da, unsigned long long db) {
    asm volatile(
        "{\n"
        "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, 1, 1, 1, 1, 1;\n"
        "}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
        : "l"(da), "l"(db));
}

// Grid (ceil((N − koff) / 128), B·H), 512 threads, FlBwdSmem<D>::BYTES of dynamic shared
// memory; block x owns keys koff + 128·x… (koff > 0: keys 0…koff − 1 were taken by the delta
// pass, flash_bwd_pre_fold in flash.cu, and N − koff is a multiple of 128). Tensor maps (`tensor_map_3d`, 64-column boxes, 128-byte swizzle): tm_kv over qkv (B, N, 3·H·D) with
// 128-row boxes, tm_q the same with 64-row boxes, tm_do over dout (B, N, H·D) with 64-row boxes,
// tm_dqkv over dqkv with 64-row boxes (dK, dV stores); at D = 80 tm_kvt, tm_qt, tm_dot as tm_kv,
// tm_q, tm_do with 16-column boxes and the 32-byte swizzle (`tensor_map_3d_cols16`; not read at
// D = 64). lse2, delta: (B·H, N) f32; dq_acc: (B, N, H·D) f32, zeroed (or started with the folded
// keys' share) by the delta pass, 16-byte aligned; dqkv: the dK, dV columns 64…79 at D = 80;
// dv_part: null, or (B · gridDim.x, H·D) f32 (the v bias gradient's partial rows, above).
template <int D>
__device__ __forceinline__ void fl_bwd_long(const HgTmap& tm_kv, const HgTmap& tm_q, const HgTmap& tm_do, const HgTmap& tm_dqkv, const HgTmap& tm_kvt, const HgTmap& tm_qt, const HgTmap& tm_dot,
                                            bf16* __restrict__ dqkv, const float* __restrict__ lse2, const float* __restrict__ delta, float* __restrict__ dq_acc, float* __restrict__ dv_part, int n, int h, float scale, float scale_log2, int koff) {
    static_assert(D == 64 || D == 80, "head dims 64 and 80");
    using L = FlBwdSmem<D>;
    constexpr bool C16 = D > 64;
    extern __shared__ unsigned char fl_raw[];
    const unsigned raw = smem_u32(fl_raw);
    const unsigned base = (raw + 1023u) & ~1023u;
    float* stat = (float*)(fl_raw + (base - raw) + L::STAT);
    const unsigned sk = base + L::K, sv = base + L::V, ring = base + L::RING, sds = base + L::DS;
    const unsigned skt = base + L::KT, svt = skt + FL_KEYS * 32;  // D = 80
    const unsigned kvbar = base + L::BAR, full0 = kvbar + 8, empty0 = full0 + 8 * FL_STAGES;
    const unsigned dsfull0 = empty0 + 8 * FL_STAGES, dsempty0 = dsfull0 + 8 * FL_DSB;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int bh = blockIdx.y, bi = bh / h, hi = bh - bi * h;
    const int k0 = koff + blockIdx.x * FL_KEYS;
    const int nq = (n + 63) / 64;
    const int qoff = blockIdx.x % nq;  // the first query tile of this key block's walk
    const int nwk = n - k0 > 64 ? 2 : 1;  // consumer warpgroups with keys < n
    if (tid == 0) {
        ht_mbar_init(kvbar, 1);
        #pragma unroll
        for (int s = 0; s < FL_STAGES; s++) {
            ht_mbar_init(full0 + 8 * s, 32);
            ht_mbar_init(empty0 + 8 * s, 4 * nwk);
        }
        #pragma unroll
        for (int b = 0; b < FL_DSB; b++) {
            ht_mbar_init(dsfull0 + 8 * b, 128 * nwk);
            ht_mbar_init(dsempty0 + 8 * b, 4);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();  // the mbarriers' initialization before anyone uses them
    // the warpgroup through a shuffle: known warp-uniform, so the descriptors stay in uniform registers
    const int wg = __shfl_sync(0xffffffffu, warp >> 2, 0), wi = warp & 3, g = lane >> 2, t = lane & 3;

    if (wg == 3) {
        if constexpr (C16) asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n" ::: "memory");
        else asm volatile("setmaxnreg.dec.sync.aligned.u32 32;\n" ::: "memory");
        if (warp != 12) return;
        // producer
        const float* lg = lse2 + (i64)bh * n;
        const float* dg = delta + (i64)bh * n;
        if (lane == 0) {
            ht_mbar_expect_tx(kvbar, 2 * FL_KEYS * (128 + C16 * 32));
            ht_tma_load3(sk, &tm_kv, (h + hi) * D, k0, bi, kvbar);
            ht_tma_load3(sv, &tm_kv, (2 * h + hi) * D, k0, bi, kvbar);
            if constexpr (C16) {
                ht_tma_load3(skt, &tm_kvt, (h + hi) * D + 64, k0, bi, kvbar);
                ht_tma_load3(svt, &tm_kvt, (2 * h + hi) * D + 64, k0, bi, kvbar);
            }
        }
        int s = 0;
        unsigned round = 0;
        for (int i = 0; i < nq; i++) {
            int qt = i + qoff;
            if (qt >= nq) qt -= nq;
            const int q0 = qt * 64, qa = q0 + lane, qb = qa + 32;
            // this lane's queries' statistics, loaded before waiting for the slot
            const float la = qa < n ? lg[qa] : 0.f, da = qa < n ? dg[qa] : 0.f;
            const float lb = qb < n ? lg[qb] : 0.f, db = qb < n ? dg[qb] : 0.f;
            if (i >= FL_STAGES) ht_mbar_wait(empty0 + 8 * s, (round & 1) ^ 1);
            float* st = stat + s * 128;
            *(float2*)(st + 2 * lane) = make_float2(la, da);
            *(float2*)(st + 2 * lane + 64) = make_float2(lb, db);
            const unsigned full = full0 + 8 * s, sq = ring + s * L::STAGE;
            if (lane == 0) {
                ht_mbar_expect_tx(full, L::STAGE);
                ht_tma_load3(sq, &tm_q, hi * D, q0, bi, full);
                ht_tma_load3(sq + 8192, &tm_do, hi * D, q0, bi, full);
                if constexpr (C16) {
                    ht_tma_load3(sq + 16384, &tm_qt, hi * D + 64, q0, bi, full);
                    ht_tma_load3(sq + 18432, &tm_dot, hi * D + 64, q0, bi, full);
                }
            } else {
                ht_mbar_arrive(full);
            }
            if (++s == FL_STAGES) {
                s = 0;
                round++;
            }
        }
        return;
    }

    if (wg == 2) {
        // dQ = dS·K of each tile over the block's 128 keys (64 with one consumer), into the f32 sums
        if constexpr (C16) asm volatile("setmaxnreg.dec.sync.aligned.u32 80;\n" ::: "memory");
        else asm volatile("setmaxnreg.dec.sync.aligned.u32 96;\n" ::: "memory");
        float* dq_base = dq_acc + ((i64)bi * n * h + hi) * D;
        const i64 rstride = (i64)h * D;
        ht_mbar_wait(kvbar, 0);
        for (int i = 0; i < nq; i++) {
            int qt = i + qoff;
            if (qt >= nq) qt -= nq;
            const int b = i % FL_DSB;
            const unsigned dsb = sds + b * (FL_KEYS * 128);
            ht_mbar_wait(dsfull0 + 8 * b, (i / FL_DSB) & 1);
            float dq[32], dqt[8];
            #pragma unroll
            for (int k = 0; k < 32; k++) dq[k] = 0.f;
            #pragma unroll
            for (int k = 0; k < 8; k++) dqt[k] = 0.f;
            // the zeros written before the fence (after it, ptxas adds a fence of its own)
            fl_pin(dq);
            if constexpr (C16) fl_pin(dqt);
            asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
            // keys 16kk…: dSᵀ rows and K rows 16kk…, 2048 bytes per step (512 in K's 32-byte rows)
            if (nwk == 2) {
                #pragma unroll
                for (int kk = 0; kk < FL_KEYS / 16; kk++) wgmma_m64n64k16_tt(dq, hg_desc(dsb + kk * 2048), hg_desc(sk + kk * 2048));
                if constexpr (C16) {
                    #pragma unroll
                    for (int kk = 0; kk < FL_KEYS / 16; kk++) wgmma_m64n16k16_tt(dqt, hg_desc(dsb + kk * 2048), hg_desc32(skt + kk * 512));
                }
            } else {
                #pragma unroll
                for (int kk = 0; kk < FL_KEYS / 32; kk++) wgmma_m64n64k16_tt(dq, hg_desc(dsb + kk * 2048), hg_desc(sk + kk * 2048));
                if constexpr (C16) {
                    #pragma unroll
                    for (int kk = 0; kk < FL_KEYS / 32; kk++) wgmma_m64n16k16_tt(dqt, hg_desc(dsb + kk * 2048), hg_desc32(skt + kk * 512));
                }
            }
            asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
            asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
            fl_pin(dq);
            if constexpr (C16) fl_pin(dqt);
            if (lane == 0) ht_mbar_arrive(dsempty0 + 8 * b);  // buffer b may be written again
            fl_dq_reduce(dq_base, dq, qt * 64, n, wi, g, t, rstride, scale);
            if constexpr (C16) fl_dq_reduce<2>(dq_base + 64, dqt, qt * 64, n, wi, g, t, rstride, scale);
        }
        return;
    }

    // consumers
    if constexpr (C16) asm volatile("setmaxnreg.inc.sync.aligned.u32 200;\n" ::: "memory");
    else asm volatile("setmaxnreg.inc.sync.aligned.u32 192;\n" ::: "memory");
    if (wg >= nwk) return;  // 64 keys that are all ≥ n
    // this thread's key rows: accumulator rows g (values e < 2) and g + 8 of warp wi
    const int kr0 = k0 + wg * 64 + wi * 16 + g, kr1 = kr0 + 8;
    const bool keys_in = k0 + FL_KEYS <= n;  // every key of the block < N (block-uniform)
    const unsigned long long dka = hg_desc(sk + wg * 64 * 128), dva = hg_desc(sv + wg * 64 * 128);
    const unsigned long long dkat = hg_desc32(skt + wg * 64 * 32), dvat = hg_desc32(svt + wg * 64 * 32);  // D = 80
    // stmatrix addresses of the dSᵀ stores: lanes 8m… give the rows of 8×8 matrix m (rows
    // 16wi + 8(m % 2)…, 16-byte chunk 2kk + m / 2)
    const int mi = lane >> 3, srow = wi * 16 + (mi & 1) * 8 + (lane & 7);

    float dk[32], dv[32], dkt[8], dvt[8];  // dkt, dvt: columns 64…79 at D = 80
    #pragma unroll
    for (int k = 0; k < 32; k++) dk[k] = dv[k] = 0.f;
    #pragma unroll
    for (int k = 0; k < 8; k++) dkt[k] = dvt[k] = 0.f;
    // One query tile of QJ blocks of 8 queries: all 64 (QJ = 8), or the first 16 of the last
    // tile where no query past them is < n (QJ = 2; its dSᵀ columns 16… are left as they were,
    // and the dQ rows they feed are ≥ n, never reduced).
    auto tile = [&](auto qj_tag, int i, int q0, int s) {
        constexpr int QJ = decltype(qj_tag)::value, QK = QJ / 2;  // QK 16-query steps
        const unsigned sq = ring + s * L::STAGE, sdo = sq + 8192;
        [[maybe_unused]] const unsigned sqt = sq + 16384, sdot = sq + 18432;  // D = 80
        const float* sst = stat + s * 128;
        float st[4 * QJ], dpt[4 * QJ];
        #pragma unroll
        for (int k = 0; k < 4 * QJ; k++) st[k] = dpt[k] = 0.f;
        fl_pin(st);
        fl_pin(dpt);
        const unsigned long long dqd = hg_desc(sq), dod = hg_desc(sdo);
        asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
        fl_issue_over_head<QJ, C16>(st, dka, dkat, dqd, sqt);
        fl_issue_over_head<QJ, C16>(dpt, dva, dvat, dod, sdot);
        asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
        fl_pin(st);

        // value 4j + e: key kr0 (e < 2) or kr1, query q0 + 8j + 2t + (e & 1). P in place of Sᵀ.
        const bool inside = keys_in && q0 + 64 <= n;
        unsigned pa[QK][4], sa[QK][4];
        #pragma unroll
        for (int j = 0; j < QJ; j++) {
            const float4 ld = *(const float4*)(sst + 2 * (8 * j + 2 * t));  // (lse2, delta) of queries q, q + 1
            #pragma unroll
            for (int e = 0; e < 4; e++) {
                float p = exp2f(fmaf(st[4 * j + e], scale_log2, -(e & 1 ? ld.z : ld.x)));
                if (!inside) {
                    const int q = q0 + 8 * j + 2 * t + (e & 1);
                    if ((e < 2 ? kr0 : kr1) >= n || q >= n) p = 0.f;
                }
                st[4 * j + e] = p;
            }
            // queries 16kk… as the A fragment: n8 block 2kk → a[0], a[1]; 2kk + 1 → a[2], a[3]
            pa[j >> 1][(j & 1) * 2] = f2bf2(st[4 * j], st[4 * j + 1]);
            pa[j >> 1][(j & 1) * 2 + 1] = f2bf2(st[4 * j + 2], st[4 * j + 3]);
        }
        // dV += Pᵀ·dO (query rows 16kk… of dO, 2048 bytes per step) runs while dSᵀ is formed
        asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
        #pragma unroll
        for (int kk = 0; kk < QK; kk++) wgmma_m64n64k16_rs(dv, pa[kk], hg_desc(sdo + kk * 2048));
        if constexpr (C16) {
            #pragma unroll
            for (int kk = 0; kk < QK; kk++) wgmma_m64n16k16_rs(dvt, pa[kk], hg_desc32(sdot + kk * 512));
        }
        asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
        asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");  // dPᵀ (dV may still run)
        fl_pin(dpt);
        #pragma unroll
        for (int j = 0; j < QJ; j++) {
            const float4 ld = *(const float4*)(sst + 2 * (8 * j + 2 * t));
            float ds[4];
            #pragma unroll
            for (int e = 0; e < 4; e++) ds[e] = st[4 * j + e] * (dpt[4 * j + e] - (e & 1 ? ld.w : ld.y));
            sa[j >> 1][(j & 1) * 2] = f2bf2(ds[0], ds[1]);
            sa[j >> 1][(j & 1) * 2 + 1] = f2bf2(ds[2], ds[3]);
        }
        // dSᵀ (key row, query column) into buffer i % FL_DSB, this warpgroup's 64 key rows, once
        // the dQ warpgroup has read what tile i − FL_DSB left there
        const int b = i % FL_DSB;
        const unsigned dsb = sds + b * (FL_KEYS * 128);
        if (i >= FL_DSB) ht_mbar_wait(dsempty0 + 8 * b, ((i / FL_DSB) - 1) & 1);
        #pragma unroll
        for (int kk = 0; kk < QK; kk++) stsm_x4(dsb + wg * 64 * 128 + sw128(srow, 2 * kk + (mi >> 1)), sa[kk][0], sa[kk][1], sa[kk][2], sa[kk][3]);
        // the staged rows visible to the dQ warpgroup's wgmma (the async proxy) before the arrival
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        ht_mbar_arrive(dsfull0 + 8 * b);

        asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
        // dK += dSᵀ·Q: query rows 16kk… of Q
        #pragma unroll
        for (int kk = 0; kk < QK; kk++) wgmma_m64n64k16_rs(dk, sa[kk], hg_desc(sq + kk * 2048));
        if constexpr (C16) {
            #pragma unroll
            for (int kk = 0; kk < QK; kk++) wgmma_m64n16k16_rs(dkt, sa[kk], hg_desc32(sqt + kk * 512));
        }
        asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
        asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
        fl_pin(dk);
        fl_pin(dv);
        if constexpr (C16) {
            fl_pin(dkt);
            fl_pin(dvt);
        }
        if (lane == 0) ht_mbar_arrive(empty0 + 8 * s);  // this tile's Q, dO are no longer read
    };
    const bool short_last = n - 64 * (nq - 1) <= 16;
    ht_mbar_wait(kvbar, 0);
    int s = 0;
    unsigned round = 0;
    for (int i = 0; i < nq; i++) {
        int qt = i + qoff;
        if (qt >= nq) qt -= nq;
        ht_mbar_wait(full0 + 8 * s, round & 1);
        if (short_last && qt == nq - 1) tile(FlTag<2>{}, i, qt * 64, s);
        else tile(FlTag<8>{}, i, qt * 64, s);
        if (++s == FL_STAGES) {
            s = 0;
            round++;
        }
    }
    fl_pin(dk);
    fl_pin(dv);
    if (dv_part) {
        float* sums = (float*)(fl_raw + (base - raw) + L::SUMS);
        float* slot = sums + (wg * 4 + wi) * D;
        fl_colsum_store<8>(slot, dv, g, t);
        if constexpr (C16) fl_colsum_store<2>(slot + 64, dvt, g, t);
        asm volatile("bar.sync 1, %0;\n" ::"r"(128 * nwk) : "memory");  // every consumer warp's slot written
        if (tid < D) {
            float sum = 0.f;
            for (int k = 0; k < 4 * nwk; k++) sum += sums[k * D + tid];
            dv_part[((i64)bi * gridDim.x + blockIdx.x) * h * D + hi * D + tid] = sum;
        }
    }

    if constexpr (C16) {
        // columns 64…79 of dK (times the softmax scale) and dV straight from the accumulators
        const i64 rstride = (i64)3 * h * D;
        bf16* rows0 = dqkv + (i64)bi * n * rstride;
        wg_store_cols16(rows0 + (h + hi) * D + 64, dkt, kr0, n, t, rstride, scale, scale);
        wg_store_cols16(rows0 + (2 * h + hi) * D + 64, dvt, kr0, n, t, rstride, 1.f, 1.f);
    }
    // dK (times the softmax scale) and dV of this warpgroup's 64 keys out through shared tiles
    const unsigned tk = base + L::OUT + wg * 16384, tv = tk + 8192;
    wg_stage_tile(tk, dk, scale, scale, wi, lane);
    wg_stage_tile(tv, dv, 1.f, 1.f, wi, lane);
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    asm volatile("bar.sync %0, 128;\n" ::"r"(2 + wg) : "memory");
    if ((tid & 127) == 0 && k0 + wg * 64 < n) {
        ht_tma_store3(&tm_dqkv, (h + hi) * D, k0 + wg * 64, bi, tk);
        ht_tma_store3(&tm_dqkv, (2 * h + hi) * D, k0 + wg * 64, bi, tv);
        asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
        // the block's shared memory must outlive the copies' reads
        asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
    }
}

extern "C" __global__ void __launch_bounds__(512, 1) flash_bwd_wg_long_d64(const __grid_constant__ HgTmap tm_kv, const __grid_constant__ HgTmap tm_q, const __grid_constant__ HgTmap tm_do, const __grid_constant__ HgTmap tm_dqkv, const float* __restrict__ lse2, const float* __restrict__ delta, float* __restrict__ dq_acc, float* __restrict__ dv_part, int n, int h, float scale, float scale_log2, int koff) {
    fl_bwd_long<64>(tm_kv, tm_q, tm_do, tm_dqkv, tm_kv, tm_q, tm_do, nullptr, lse2, delta, dq_acc, dv_part, n, h, scale, scale_log2, koff);
}

extern "C" __global__ void __launch_bounds__(512, 1) flash_bwd_wg_long_d80(const __grid_constant__ HgTmap tm_kv, const __grid_constant__ HgTmap tm_q, const __grid_constant__ HgTmap tm_do, const __grid_constant__ HgTmap tm_dqkv, const __grid_constant__ HgTmap tm_kvt, const __grid_constant__ HgTmap tm_qt, const __grid_constant__ HgTmap tm_dot, bf16* __restrict__ dqkv, const float* __restrict__ lse2, const float* __restrict__ delta, float* __restrict__ dq_acc, float* __restrict__ dv_part, int n, int h, float scale, float scale_log2, int koff) {
    fl_bwd_long<80>(tm_kv, tm_q, tm_do, tm_dqkv, tm_kvt, tm_qt, tm_dot, dqkv, lse2, delta, dq_acc, dv_part, n, h, scale, scale_log2, koff);
}
