// Fused attention (flash-attention-2 style), forward and backward, on the tensor cores
// (mma.sync m16n8k16, 16-bit in — bf16, or fp16 in a module built with VITSCALE_HALF_F16 —
// fp32 accumulate). Reads q, k, v straight from the interleaved
// qkv layout (B, N, 3, H, D), writes out (B, N, H·D) and dqkv (B, N, 3, H, D): no head moves.
//
// Saved state: per (b, h, query row) the log-sum-exp of the scaled scores in base 2,
// lse2 = m + log2(l) with m the row maximum of s·scale·log2(e) and l = Σ 2^(s·scale·log2e − m)
// (f32, B·H·N values). The backward recomputes P = 2^(s·scale·log2e − lse2).
//
// Kernels: flash_fwd_pipe (the forward) and flash_bwd_pipe (backward by key blocks, dQ through
// f32 atomics, after the flash_bwd_pre pass and before flash_dq_store) double-buffer the tiles of
// their inner loop through cp.async; flash_bwd_short (N ≤ 256, the default backward) keeps a
// whole head in one block; flash_{fwd,bwd}_small (N ≤ 80, and the backward alone at W = 13 for
// 193 ≤ N ≤ 208) keep a whole head in one block with every key on its own warp row. The
// backwards share fa_bwd_step (one warp's 16 keys against a step of queries) and
// fa_store_dkdv. (On Hopper, 193 ≤ N ≤ 208 at D 64 runs `flash_{fwd,bwd}_wg_d64` in hopper.cu.)
//
// Tiles: each warp owns 16 rows of a tile. The tiled forward steps through keys 64 at a time
// with 64 query rows on 4 warps (`_pipe`) or 128 on 8 warps (`_pipe128`, which the host picks
// for long sequences); the tiled backward holds fa_bwd_keys<D>() keys a block (128 on 8 warps
// where D / 2 is a multiple of 16, else 64 on 4) and steps through queries 64 at a time.
// Shared-memory rows are padded by 8 bf16 (16 bytes) so fragment loads hit 32 distinct banks.
// Ragged N: rows ≥ N load as zeros; keys ≥ N get probability 0; rows ≥ N are never stored.
//
// Fragment layout of mma.m16n8k16 (PTX ISA), g = lane / 4, t = lane % 4:
//   A (16×16, row-major): a[0] = (g, 2t..2t+1), a[1] = (g+8, 2t..), a[2] = (g, 2t+8..), a[3] = (g+8, 2t+8..)
//   B (16×8, "col"):      b[0] = (k 2t..2t+1, n g), b[1] = (k 2t+8..2t+9, n g)
//   C (16×8 f32):         c[0..1] = (g, 2t..2t+1), c[2..3] = (g+8, 2t..2t+1)
// Lower column (lower k) in the low 16 bits of each register.

#define FA_BR 64
#define FA_BC 64
#define FA_THREADS 128

__device__ __forceinline__ void mma_bf16(float* c, const unsigned* a, const unsigned* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32." HALF_PTX "." HALF_PTX ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Two f32 → a packed 16-bit pair (round to nearest even), `lo` in the low half.
__device__ __forceinline__ unsigned pack_bf16(float lo, float hi) { return f2bf2(lo, hi); }

// Two consecutive bf16 at p (4-byte aligned) as one register.
__device__ __forceinline__ unsigned ld2(const bf16* p) { return *(const unsigned*)p; }

// The B fragment (k = 16 columns, n = one row per g) of a product with a row-major shared tile
// used transposed: `p` is row (n0 + g) at column k0; lane t takes columns 2t, 2t+1 and 2t+8, 2t+9.
__device__ __forceinline__ void ldb_row(unsigned* b, const bf16* p, int t) {
    b[0] = ld2(p + 2 * t);
    b[1] = ld2(p + 2 * t + 8);
}


// Four 8×8 b16 matrices by one ldmatrix: lanes 8i..8i+7 give the row addresses of matrix i.
// As stored, lane l receives (row l/4, cols 2(l%4), 2(l%4)+1) of each; transposed on the way
// (TRANS), (row 2(l%4), col l/4) and (row 2(l%4)+1, col l/4).
template <bool TRANS>
__device__ __forceinline__ void ldsm_x4(unsigned* r, const bf16* p) {
#define FA_LDSM(T) asm volatile("ldmatrix.sync.aligned.m8n8.x4" T ".shared.b16 {%0,%1,%2,%3}, [%4];\n" \
                                : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_u32(p)) : "memory")
    if constexpr (TRANS) FA_LDSM(".trans");
    else FA_LDSM("");
#undef FA_LDSM
}

// ldb_row for two n-tiles at once: rows n0..n0+7 into r[0..1] and n0+8..n0+15 into r[2..3]
// (columns k0..k0+15 of a row-major shared tile, rows 16-byte aligned) by one ldmatrix
// instead of four 32-bit loads — the products of the score loops issue fewer instructions.
__device__ __forceinline__ void ldb_rows2(unsigned* r, const bf16* s, int ld, int n0, int k0, int lane) {
    const int mi = lane >> 3;
    ldsm_x4<false>(r, s + (n0 + (mi >> 1) * 8 + (lane & 7)) * ld + k0 + (mi & 1) * 8);
}

// B fragments of two n-tiles from a row-major [k][n] shared tile (row stride ld, rows 16-byte
// aligned): k rows k0..k0+15, columns c0..c0+7 into r[0..1] and c0+8..c0+15 into r[2..3], by one
// ldmatrix .x4.trans.
__device__ __forceinline__ void ldb_t2(unsigned* r, const bf16* s, int ld, int k0, int c0, int lane) {
    const int mi = lane >> 3;
    ldsm_x4<true>(r, s + (k0 + (mi & 1) * 8 + (lane & 7)) * ld + c0 + (mi >> 1) * 8);
}

// The A fragment of keys (or queries) 16kk..16kk+15 made from two f32 accumulator n-tiles
// 2kk and 2kk + 1 (rows g, g + 8), rounded to bf16: a product's result feeding the next one.
template <int NT>
__device__ __forceinline__ void acc_to_a(unsigned* a, const float (&c)[NT][4], int kk) {
    a[0] = pack_bf16(c[2 * kk][0], c[2 * kk][1]);
    a[1] = pack_bf16(c[2 * kk][2], c[2 * kk][3]);
    a[2] = pack_bf16(c[2 * kk + 1][0], c[2 * kk + 1][1]);
    a[3] = pack_bf16(c[2 * kk + 1][2], c[2 * kk + 1][3]);
}

// Zeroes N accumulator fragments (f32, 4 per lane each).
template <int N>
__device__ __forceinline__ void fa_zero(float (&a)[N][4]) {
    #pragma unroll
    for (int j = 0; j < N; j++) a[j][0] = a[j][1] = a[j][2] = a[j][3] = 0.f;
}

// A fragments (16 rows × D, KT = D/16 k-steps) of rows r0 and r0 + 8 of a shared tile with
// rows of D + 8: a warp's queries in the forward, its keys (K, V) in the backward.
template <int D>
__device__ __forceinline__ void fa_row_fragment(unsigned (&a)[4], const bf16* s, int r0, int kt, int t) {
    constexpr int LD = D + 8;
    a[0] = ld2(s + r0 * LD + kt * 16 + 2 * t);
    a[1] = ld2(s + (r0 + 8) * LD + kt * 16 + 2 * t);
    a[2] = ld2(s + r0 * LD + kt * 16 + 2 * t + 8);
    a[3] = ld2(s + (r0 + 8) * LD + kt * 16 + 2 * t + 8);
}
template <int D>
__device__ __forceinline__ void fa_row_fragments(unsigned (&a)[D / 16][4], const bf16* s, int r0, int t) {
    #pragma unroll
    for (int kt = 0; kt < D / 16; kt++) fa_row_fragment<D>(a[kt], s, r0, kt, t);
}

// Where a backward warp's K and V A-fragments (its 16 keys, rows r0 and r0 + 8 of the shared K
// and V tiles) come from at each k-step kt: registers loaded once per key tile (KeyRegs), or
// the shared tiles at every use (KeySmem: heads over 64, whose dK and dV accumulators need
// the registers that holding K and V would take).
template <int D>
struct KeyRegs {
    unsigned k[D / 16][4], v[D / 16][4];
    __device__ __forceinline__ void load(const bf16* sk, const bf16* sv, int r0, int t) {
        fa_row_fragments<D>(k, sk, r0, t);
        fa_row_fragments<D>(v, sv, r0, t);
    }
    __device__ __forceinline__ void get(int kt, unsigned (&ak)[4], unsigned (&av)[4]) const {
        #pragma unroll
        for (int e = 0; e < 4; e++) {
            ak[e] = k[kt][e];
            av[e] = v[kt][e];
        }
    }
};
template <int D>
struct KeySmem {
    const bf16* sk;
    const bf16* sv;
    int r0, t;
    __device__ __forceinline__ void load(const bf16* sk_, const bf16* sv_, int r0_, int t_) {
        sk = sk_;
        sv = sv_;
        r0 = r0_;
        t = t_;
    }
    __device__ __forceinline__ void get(int kt, unsigned (&ak)[4], unsigned (&av)[4]) const {
        fa_row_fragment<D>(ak, sk, r0, kt, t);
        fa_row_fragment<D>(av, sv, r0, kt, t);
    }
};
template <bool C, class A, class B> struct PickT { using type = A; };
template <class A, class B> struct PickT<false, A, B> { using type = B; };
// The key-fragment source of the tiled backward for head dim D.
template <int D> using KeyFrags = typename PickT<(D > 64), KeySmem<D>, KeyRegs<D>>::type;

// Scores of a warp's 16 query rows (fragments qa) against the NS·8 keys of a shared K tile
// (rows of D + 8): s = q·kᵀ. SKIP: key n-tiles at or past `valid` keys are left at zero (a
// ragged last tile; rows past it are zero-filled in shared memory, so loading them is safe).
template <int D, int NS, bool SKIP>
__device__ __forceinline__ void fa_scores(float (&s)[NS][4], const unsigned (&qa)[D / 16][4], const bf16* sk, int valid, int lane) {
    fa_zero(s);
    #pragma unroll
    for (int kt = 0; kt < D / 16; kt++) {
        #pragma unroll
        for (int j = 0; j < NS; j += 2) {
            if (SKIP && j * 8 >= valid) continue;
            unsigned b[4];
            ldb_rows2(b, sk, D + 8, j * 8, kt * 16, lane);
            mma_bf16(s[j], qa[kt], b);
            if (!SKIP || (j + 1) * 8 < valid) mma_bf16(s[j + 1], qa[kt], b + 2);
        }
    }
}

// s ← s·scale_log2 (keys ≥ `valid` → −∞ when CHECK), and this lane's row maxima (rows g, g + 8).
template <int NS, bool CHECK>
__device__ __forceinline__ void fa_scale_mask_max(float (&s)[NS][4], int valid, float scale_log2, int t, float& mx0, float& mx1) {
    #pragma unroll
    for (int j = 0; j < NS; j++) {
        #pragma unroll
        for (int e = 0; e < 4; e++) {
            const int key = j * 8 + 2 * t + (e & 1);
            s[j][e] = (!CHECK || key < valid) ? s[j][e] * scale_log2 : -INFINITY;
        }
        mx0 = fmaxf(mx0, fmaxf(s[j][0], s[j][1]));
        mx1 = fmaxf(mx1, fmaxf(s[j][2], s[j][3]));
    }
}


// s ← 2^(s − m) for a warp's score fragments (m0 for rows g, m1 for rows g + 8); adds this
// lane's part of each row's sum into sum0, sum1.
template <int NS>
__device__ __forceinline__ void fa_exp2_rows(float (&s)[NS][4], float m0, float m1, float& sum0, float& sum1) {
    #pragma unroll
    for (int j = 0; j < NS; j++) {
        s[j][0] = exp2f(s[j][0] - m0);
        s[j][1] = exp2f(s[j][1] - m0);
        s[j][2] = exp2f(s[j][2] - m1);
        s[j][3] = exp2f(s[j][3] - m1);
        sum0 += s[j][0] + s[j][1];
        sum1 += s[j][2] + s[j][3];
    }
}

// acc[j] += a · s[k0..k0+15][c0 + 8j ..] for the NO n-tiles of a row-major shared tile.
template <int NO>
__device__ __forceinline__ void mma_a_tile(float (&acc)[NO][4], const unsigned* a, const bf16* s, int ld, int k0, int c0, int lane) {
    #pragma unroll
    for (int j = 0; j < NO; j += 2) {
        unsigned b[4];
        ldb_t2(b, s, ld, k0, c0 + j * 8, lane);
        mma_bf16(acc[j], a, b);
        mma_bf16(acc[j + 1], a, b + 2);
    }
}

// The A fragment dS(queries q0..q0+15, keys k0..k0+15) read from the shared dSᵀ (rows = keys):
// the two-tile transposed load gives (keys lo, q lo), (keys hi, q lo), (keys lo, q hi), (keys
// hi, q hi), reordered into A's (row, k) register order.
__device__ __forceinline__ void ds_as_a(unsigned* a, const bf16* sds, int lds, int k0, int q0, int lane) {
    unsigned r[4];
    ldb_t2(r, sds, lds, k0, q0, lane);
    a[0] = r[0];
    a[1] = r[2];
    a[2] = r[1];
    a[3] = r[3];
}

// Σ a[i]·b[i] over D bf16 values (16-byte aligned rows), f32, in a fixed order: one
// attention row's delta = dO · O.
__device__ __forceinline__ float dot8_acc(float acc, uint4 x, uint4 y) {
    const unsigned xs[4] = {x.x, x.y, x.z, x.w};
    const unsigned ys[4] = {y.x, y.y, y.z, y.w};
    #pragma unroll
    for (int e = 0; e < 4; e++) {
        acc += lo16(xs[e]) * lo16(ys[e]);
        acc += hi16(xs[e]) * hi16(ys[e]);
    }
    return acc;
}
template <int D>
__device__ __forceinline__ float row_dot(const bf16* a, const bf16* b) {
    const uint4* x4 = (const uint4*)a;
    const uint4* y4 = (const uint4*)b;
    float acc = 0.f;
    #pragma unroll
    for (int c = 0; c < D / 8; c++) acc = dot8_acc(acc, x4[c], y4[c]);
    return acc;
}

// Backward pre-pass: delta (B·H, N) = rowsum(dO ∘ O) per head, f32; dout, out (B, N, H·D).
// Thread e of a step takes 16-byte chunk e of the step's rows, so a warp's loads are consecutive
// addresses (one thread per D-wide row strided its loads D·2 bytes apart, and the rows of the
// resident warps overflowed L1: each sector came from L2 about twice). A block of 32·D/8
// threads covers 32 whole (token, head) rows a step; the first 32 threads then sum their row's
// chunk products in order. The host launches 32·D/8 threads a block.
// The pass also zeroes the backward's f32 dQ sums dq_acc (B, N, H·D), which share dout's layout:
// each thread the 8 values of its chunk. As a memset of its own the zeroing sat between the
// weight gradient and this pass, the GPU doing nothing else.
template <int D>
__device__ __forceinline__ void flash_bwd_pre(float* __restrict__ delta, float* __restrict__ dq_acc, const bf16* __restrict__ dout, const bf16* __restrict__ out, int b, int n, int h) {
    constexpr int CPR = D / 8;  // chunks per row
    __shared__ float part[32 * CPR];
    const i64 rows = (i64)b * n * h;
    const uint4* d4 = (const uint4*)dout;
    const uint4* o4 = (const uint4*)out;
    float4* z4 = (float4*)dq_acc;
    for (i64 r0 = (i64)blockIdx.x * 32; r0 < rows; r0 += (i64)gridDim.x * 32) {
        const i64 e = r0 * CPR + threadIdx.x;
        float p = 0.f;
        if (e < rows * CPR) {
            p = dot8_acc(0.f, d4[e], o4[e]);
            z4[2 * e] = z4[2 * e + 1] = make_float4(0.f, 0.f, 0.f, 0.f);
        }
        part[threadIdx.x] = p;
        __syncthreads();
        const i64 r = r0 + threadIdx.x;
        if (threadIdx.x < 32 && r < rows) {
            float acc = 0.f;
            #pragma unroll
            for (int c = 0; c < CPR; c++) acc += part[threadIdx.x * CPR + c];
            const int hi = (int)(r % h);
            const i64 tok = r / h;  // b·n + token
            const int ni = (int)(tok % n);
            const i64 bi = tok / n;
            delta[(bi * h + hi) * n + ni] = acc;
        }
        __syncthreads();  // part is rewritten by the next step
    }
}


// dq_acc (B·N, H·D) f32 → the q slot of dqkv (B, N, 3, H, D) bf16, 8 values per thread.
// hd8 = H·D / 8; rows = B·N.
extern "C" __global__ void flash_dq_store(bf16* dqkv, const float* dq_acc, i64 rows, int hd8) {
    i64 total = rows * hd8;
    GRID_STRIDE(e, total) {
        i64 r = e / hd8;
        int c = (int)(e - r * hd8);
        const float4* src = (const float4*)(dq_acc + e * 8);
        float4 x = src[0], y = src[1];
        uint4 v;
        v.x = pack_bf16(x.x, x.y);
        v.y = pack_bf16(x.z, x.w);
        v.z = pack_bf16(y.x, y.y);
        v.w = pack_bf16(y.z, y.w);
        *(uint4*)(dqkv + r * 3 * (i64)hd8 * 8 + (i64)c * 8) = v;
    }
}

// flash_dq_store, plus the column sums of dQ (the q bias gradient) from the same pass: block
// (32, 8) covers 256 of the c = H·D columns (c % 8 == 0, dq_acc 16-byte aligned), grid
// (ceil(c / 256), splits); row y of `partial` (splits × c) gets block-row y's sums of the f32
// values, which are what the bf16 stores round.
extern "C" __global__ void flash_dq_store_sums(bf16* dqkv, const float* dq_acc, float* partial, i64 rows, int c) {
    const int c0 = (blockIdx.x * 32 + threadIdx.x) * 8;
    float acc[8];
    #pragma unroll
    for (int k = 0; k < 8; k++) acc[k] = 0.f;
    if (c0 < c) {
        #pragma unroll 2
        for (i64 r = (i64)blockIdx.y * 8 + threadIdx.y; r < rows; r += (i64)gridDim.y * 8) {
            const float4* src = (const float4*)(dq_acc + r * c + c0);
            const float4 x = src[0], y = src[1];
            acc[0] += x.x; acc[1] += x.y; acc[2] += x.z; acc[3] += x.w;
            acc[4] += y.x; acc[5] += y.y; acc[6] += y.z; acc[7] += y.w;
            *(uint4*)(dqkv + r * 3 * (i64)c + c0) = make_uint4(pack_bf16(x.x, x.y), pack_bf16(x.z, x.w), pack_bf16(y.x, y.y), pack_bf16(y.z, y.w));
        }
    }
    block_column_partials(acc, partial, c);
}

// ---- The ragged keys folded into the delta pass ----
// The key-block backward (hopper_flash_bwd.cu) gives each block 128 keys. Where N = 128·m + r
// with r = 1 or 2 (a class token, or a class and a distillation token, over a patch grid that
// tiles by 128: ViT-H/14 at 224 px, every /16 model at 512 and 1 024 px), a last block of r
// keys would take about a whole block's time for them. Instead this pass takes keys 0…r − 1
// (the ragged part first, as the long forward orders its key tiles) and the key blocks start
// at key r. For every query row i of a head, with its lse2 and delta = dO_i·O_i:
//   p_ij = exp2(q_i·k_j·scale·log2 e − lse2_i),  ds_ij = p_ij·(dO_i·v_j − delta_i),
//   dQ_i = scale·Σ_j ds_ij·k_j   (the f32 sums' starting value, where the plain pass writes 0),
// the same products the key blocks form for their keys. dK_j = scale·Σ_i ds_ij·q_i and
// dV_j = Σ_i p_ij·dO_i are summed over the block's rows into `part` (B·H, splits, R, 2, D) f32,
// in a fixed order, and flash_fold_keys_store adds the splits.
// Grid (splits, B·H), 256 threads. A row is G lanes (D/8 rounded up to a power of two: 8 at
// D = 64, 16 at D = 80, the lanes past D/8 holding zeros), each lane 8 columns (16-byte
// loads); a step takes 2·256/G rows of one head (two a lane, both loaded before either is summed),
// and row sums go through G-lane shuffles.
template <int D, int R>
__device__ __forceinline__ void flash_bwd_pre_fold(float* __restrict__ delta, float* __restrict__ dq_acc, float* __restrict__ part, const bf16* __restrict__ dout, const bf16* __restrict__ out,
                                                   const bf16* __restrict__ qkv, const float* __restrict__ lse2, int n, int h, int rows_per_split, float scale, float scale_log2) {
    constexpr int CPR = D / 8;
    constexpr int G = CPR <= 8 ? 8 : 16;
    constexpr int RPS = 256 / G;
    static_assert(CPR <= G && D % 8 == 0, "head dims up to 128, a multiple of 8");
    __shared__ float red[8][R][2][D];
    const int bh = blockIdx.y, bi = bh / h, hi = bh - bi * h;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int c = threadIdx.x % G, rho = threadIdx.x / G;
    const bool on = c < CPR;
    const i64 hd = (i64)h * D, qkv_row = 3 * hd;
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
    auto unpack = [](uint4 u, float (&f)[8]) {
        const unsigned w[4] = {u.x, u.y, u.z, u.w};
        #pragma unroll
        for (int e = 0; e < 4; e++) { f[2 * e] = lo16(w[e]); f[2 * e + 1] = hi16(w[e]); }
    };
    auto row_sum = [](float v) {
        #pragma unroll
        for (int o = G / 2; o >= 1; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        return v;
    };
    // this lane's 8 columns of the folded keys and values
    uint4 kj[R], vj[R];
    float kf[R][8], dk[R][8], dv[R][8];
    #pragma unroll
    for (int j = 0; j < R; j++) {
        const bf16* row = qkv + ((i64)bi * n + j) * qkv_row + hi * D + c * 8;
        kj[j] = on ? *(const uint4*)(row + hd) : zero;
        vj[j] = on ? *(const uint4*)(row + 2 * hd) : zero;
        unpack(kj[j], kf[j]);
        #pragma unroll
        for (int e = 0; e < 8; e++) dk[j][e] = dv[j][e] = 0.f;
    }
    const float* lse = lse2 + (i64)bh * n;
    const int i0 = blockIdx.x * rows_per_split, i1 = min(n, i0 + rows_per_split);
    // U rows a lane per step, all their loads issued before the first row's sums
    constexpr int U = 2;
    for (int base = i0; base < i1; base += U * RPS) {  // the same trip count in every lane: the shuffles
        uint4 d4[U], o4[U], q4[U];
        float l2[U];
        #pragma unroll
        for (int u = 0; u < U; u++) {
            const int i = base + u * RPS + rho;
            const bool ld = i < i1 && on;
            const i64 tok = (i64)bi * n + i;
            d4[u] = ld ? *(const uint4*)(dout + tok * hd + hi * D + c * 8) : zero;
            o4[u] = ld ? *(const uint4*)(out + tok * hd + hi * D + c * 8) : zero;
            q4[u] = ld ? *(const uint4*)(qkv + tok * qkv_row + hi * D + c * 8) : zero;
            l2[u] = i < i1 ? lse[i] : 0.f;
        }
        #pragma unroll
        for (int u = 0; u < U; u++) {
            const int i = base + u * RPS + rho;
            const bool in = i < i1, ld = in && on;
            const i64 tok = (i64)bi * n + i;
            const float dl = row_sum(dot8_acc(0.f, d4[u], o4[u]));
            float qf[8], df[8], dq[8];
            unpack(q4[u], qf);
            unpack(d4[u], df);
            #pragma unroll
            for (int e = 0; e < 8; e++) dq[e] = 0.f;
            #pragma unroll
            for (int j = 0; j < R; j++) {
                const float s = row_sum(dot8_acc(0.f, q4[u], kj[j]));
                const float dp = row_sum(dot8_acc(0.f, d4[u], vj[j]));
                const float p = in ? exp2f(s * scale_log2 - l2[u]) : 0.f;
                const float ds = p * (dp - dl);
                #pragma unroll
                for (int e = 0; e < 8; e++) {
                    dq[e] += scale * ds * kf[j][e];
                    dk[j][e] += scale * ds * qf[e];
                    dv[j][e] += p * df[e];
                }
            }
            if (ld) {
                float4* z = (float4*)(dq_acc + tok * hd + hi * D + c * 8);
                z[0] = make_float4(dq[0], dq[1], dq[2], dq[3]);
                z[1] = make_float4(dq[4], dq[5], dq[6], dq[7]);
            }
            if (in && c == 0) delta[(i64)bh * n + i] = dl;
        }
    }
    // the warp's rows, then the block's warps in order
    #pragma unroll
    for (int j = 0; j < R; j++) {
        #pragma unroll
        for (int e = 0; e < 8; e++) {
            #pragma unroll
            for (int o = G; o < 32; o <<= 1) {
                dk[j][e] += __shfl_xor_sync(0xffffffffu, dk[j][e], o);
                dv[j][e] += __shfl_xor_sync(0xffffffffu, dv[j][e], o);
            }
            if (lane < G && on) {
                red[warp][j][0][c * 8 + e] = dk[j][e];
                red[warp][j][1][c * 8 + e] = dv[j][e];
            }
        }
    }
    __syncthreads();
    float* dst = part + ((i64)bh * gridDim.x + blockIdx.x) * R * 2 * D;
    for (int t = threadIdx.x; t < R * 2 * D; t += blockDim.x) {
        const int j = t / (2 * D), kv = (t / D) & 1, col = t % D;
        float sum = 0.f;
        #pragma unroll
        for (int w = 0; w < 8; w++) sum += red[w][j][kv][col];
        dst[t] = sum;
    }
}

extern "C" __global__ void __launch_bounds__(256) flash_bwd_pre_fold_d64_r1(float* delta, float* dq_acc, float* part, const bf16* dout, const bf16* out, const bf16* qkv, const float* lse2, int n, int h, int rows_per_split, float scale, float scale_log2) {
    flash_bwd_pre_fold<64, 1>(delta, dq_acc, part, dout, out, qkv, lse2, n, h, rows_per_split, scale, scale_log2);
}
extern "C" __global__ void __launch_bounds__(256) flash_bwd_pre_fold_d64_r2(float* delta, float* dq_acc, float* part, const bf16* dout, const bf16* out, const bf16* qkv, const float* lse2, int n, int h, int rows_per_split, float scale, float scale_log2) {
    flash_bwd_pre_fold<64, 2>(delta, dq_acc, part, dout, out, qkv, lse2, n, h, rows_per_split, scale, scale_log2);
}
extern "C" __global__ void __launch_bounds__(256) flash_bwd_pre_fold_d80_r1(float* delta, float* dq_acc, float* part, const bf16* dout, const bf16* out, const bf16* qkv, const float* lse2, int n, int h, int rows_per_split, float scale, float scale_log2) {
    flash_bwd_pre_fold<80, 1>(delta, dq_acc, part, dout, out, qkv, lse2, n, h, rows_per_split, scale, scale_log2);
}
extern "C" __global__ void __launch_bounds__(256) flash_bwd_pre_fold_d80_r2(float* delta, float* dq_acc, float* part, const bf16* dout, const bf16* out, const bf16* qkv, const float* lse2, int n, int h, int rows_per_split, float scale, float scale_log2) {
    flash_bwd_pre_fold<80, 2>(delta, dq_acc, part, dout, out, qkv, lse2, n, h, rows_per_split, scale, scale_log2);
}

// The folded keys' dK and dV from flash_bwd_pre_fold's partial sums: block bh (B·H of them)
// adds its head's `splits` rows in order for each of the r keys and stores them into dqkv's k
// and v slots; with `vsum` given, also row bi of the v bias gradient's partial rows, (B, H·D)
// f32, at the head's columns: Σ_j dV_j.
extern "C" __global__ void flash_fold_keys_store(bf16* dqkv, float* vsum, const float* part, int n, int h, int d, int r, int splits) {
    const int bh = blockIdx.x, bi = bh / h, hi = bh - bi * h;
    const i64 hd = (i64)h * d;
    for (int t = threadIdx.x; t < 2 * d; t += blockDim.x) {
        const int kv = t / d, col = t - kv * d;
        float vs = 0.f;
        for (int j = 0; j < r; j++) {
            float s = 0.f;
            for (int sp = 0; sp < splits; sp++) s += part[(((i64)bh * splits + sp) * r + j) * 2 * d + t];
            dqkv[((i64)bi * n + j) * 3 * hd + (1 + kv) * hd + hi * d + col] = f2bf(s);
            vs += s;
        }
        if (vsum && kv == 1) vsum[(i64)bi * hd + hi * d + col] = vs;
    }
}

// ---- Pipelined kernels: the tiles the loop walks over (K, V in the forward; Q, dO, lse2, delta
// in the key-block backward) are double-buffered in dynamic shared memory and fetched with
// cp.async one step ahead, so a block computes on tile i while tile i + 1 is in flight. Rows
// ≥ n are zero-filled by the copy engine (src-size 0); the backward masks those queries' P
// explicitly instead of relying on an infinite lse2.


// A compile-time bool as a value, to instantiate a generic lambda for full and ragged tiles.
template <bool B> struct BoolC { static constexpr bool value = B; };
template <int V> struct IntC { static constexpr int value = V; };

// fa_load_tile through cp.async (not waited for here).
template <int D, int ROWS, int NT = FA_THREADS>
__device__ __forceinline__ void fa_load_tile_async(bf16* s, const bf16* g, i64 stride, int row0, int n) {
    constexpr int CH = D / 8;
    for (int i = threadIdx.x; i < ROWS * CH; i += NT) {
        int r = i / CH, c = i - r * CH;
        bool ok = row0 + r < n;
        cp_async16(s + r * (D + 8) + c * 8, ok ? g + (i64)(row0 + r) * stride + c * 8 : g, ok);
    }
}

// Dynamic shared memory of the pipelined kernels, in bytes (the host passes the same sums).
// forward (BR queries a block): Q tile + 2 stages × (K, V); backward (BC keys a block): K, V, dSᵀ + 2 stages ×
// (Q, dO) + 2 × 2 × 64 f32.
template <int D, int BR> constexpr int fa_fwd_pipe_smem() { return (BR + 4 * FA_BC) * (D + 8) * 2; }
template <int D, int BC> constexpr int fa_bwd_pipe_smem() { return (2 * BC + 4 * FA_BR) * (D + 8) * 2 + BC * (FA_BR + 8) * 2 + 4 * FA_BR * 4; }

// Keys per block of the tiled backward for head dim D: 128 (8 warps) where half the head is a
// whole number of 16-column tiles, so that the dQ phase splits the head dim between two warp
// groups and each block adds dQ over 128 keys at once (half the f32 atomics of 64-key blocks,
// and each query tile fetched once per 128 keys); else 64 (4 warps). The host mirrors this
// (pipe_keys in attention.rs).
template <int D> constexpr int fa_bwd_keys() { return (D / 2) % 16 == 0 ? 128 : 64; }

// p[0] += a, p[1] += b in global memory (8-byte aligned): one vector reduction on sm_90.
__device__ __forceinline__ void red_add2(float* p, float a, float b) {
#if __CUDA_ARCH__ >= 900
    atomicAdd((float2*)p, make_float2(a, b));
#else
    atomicAdd(p, a);
    atomicAdd(p + 1, b);
#endif
}

// The forward's end for one warp's query rows row0 and row0 + 8: the quads' partial sums
// l0, l1 joined, O normalized into out (B, N, H·D) and lse2 = m + log2(l) stored (rows < n).
template <int D>
__device__ __forceinline__ void fa_store_out(bf16* out, float* lse2, const float (&o)[D / 8][4], float m0, float m1, float l0, float l1,
                                             int bi, int bh, int hi, int n, int h, int row0, int t) {
    constexpr int NO = D / 8;
    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    const float inv0 = 1.f / l0, inv1 = 1.f / l1;
    const int row1 = row0 + 8;
    const i64 ostride = (i64)h * D;
    bf16* og = out + (i64)bi * n * ostride + hi * D + 2 * t;
    if (row0 < n) {
        #pragma unroll
        for (int j = 0; j < NO; j++) *(unsigned*)(og + row0 * ostride + j * 8) = pack_bf16(o[j][0] * inv0, o[j][1] * inv0);
        if (t == 0) lse2[(i64)bh * n + row0] = m0 + log2f(l0);
    }
    if (row1 < n) {
        #pragma unroll
        for (int j = 0; j < NO; j++) *(unsigned*)(og + row1 * ostride + j * 8) = pack_bf16(o[j][2] * inv1, o[j][3] * inv1);
        if (t == 0) lse2[(i64)bh * n + row1] = m1 + log2f(l1);
    }
}

// The tiled forward: a block of BR/16 warps owns BR queries (16 per warp) and walks the keys in
// tiles of 64, double-buffered. 128-query blocks fetch each K and V tile once for twice the
// queries (long sequences); 64-query blocks waste less of a short sequence's last tile.
template <int D, int BR>
__device__ __forceinline__ void flash_fwd_pipe(bf16* __restrict__ out, float* __restrict__ lse2, const bf16* __restrict__ qkv, int n, int h, float scale_log2) {
    constexpr int LD = D + 8;
    constexpr int KT = D / 16;
    constexpr int NS = FA_BC / 8;
    constexpr int NO = D / 8;
    extern __shared__ __align__(16) unsigned char fa_smem[];
    bf16* sq = (bf16*)fa_smem;
    constexpr int NT = 2 * BR;
    bf16* stages = sq + BR * LD;  // stage s: K at stages + 2s·FA_BC·LD, V right after
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int bh = blockIdx.y, bi = bh / h, hi = bh - bi * h;
    const int q0 = blockIdx.x * BR;
    const i64 stride = (i64)3 * h * D;
    const bf16* qg = qkv + (i64)bi * n * stride + hi * D;
    const bf16* kg = qg + h * D;
    const bf16* vg = qg + 2 * h * D;
    const int nk = (n + FA_BC - 1) / FA_BC;

    fa_load_tile_async<D, BR, NT>(sq, qg, stride, q0, n);
    fa_load_tile_async<D, FA_BC, NT>(stages, kg, stride, 0, n);
    fa_load_tile_async<D, FA_BC, NT>(stages + FA_BC * LD, vg, stride, 0, n);
    cp_async_commit();

    unsigned qa[KT][4];
    const int r0 = warp * 16 + g;
    float o[NO][4];
    fa_zero(o);
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;

    for (int kb = 0; kb < nk; kb++) {
        const int k0 = kb * FA_BC;
        __syncthreads();  // every warp is done with the stage refilled next
        if (kb + 1 < nk) {
            bf16* nxt = stages + ((kb + 1) & 1) * 2 * FA_BC * LD;
            fa_load_tile_async<D, FA_BC, NT>(nxt, kg, stride, k0 + FA_BC, n);
            fa_load_tile_async<D, FA_BC, NT>(nxt + FA_BC * LD, vg, stride, k0 + FA_BC, n);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();  // this stage (and, at kb = 0, the Q tile) is in shared memory
        const bf16* sk = stages + (kb & 1) * 2 * FA_BC * LD;
        const bf16* sv = sk + FA_BC * LD;
        if (q0 + warp * 16 >= n) continue;  // all 16 rows past the end (warp-uniform)
        if (kb == 0) fa_row_fragments<D>(qa, sq, r0, t);
        // A key block entirely < n compiles without any key test, so the tensor-core work of
        // the block is one branch-free stretch the scheduler can interleave; only the last,
        // ragged block takes the checked variant.
        auto block = [&](auto full_tag) {
            constexpr bool FULL = decltype(full_tag)::value;
            float s[NS][4];
            fa_scores<D, NS, !FULL>(s, qa, sk, n - k0, lane);
            float mx0 = -INFINITY, mx1 = -INFINITY;
            fa_scale_mask_max<NS, !FULL>(s, n - k0, scale_log2, t, mx0, mx1);
            const float mn0 = fmaxf(m0, quad_max(mx0)), mn1 = fmaxf(m1, quad_max(mx1));
            const float al0 = exp2f(m0 - mn0), al1 = exp2f(m1 - mn1);
            m0 = mn0;
            m1 = mn1;
            float ps0 = 0.f, ps1 = 0.f;
            fa_exp2_rows(s, mn0, mn1, ps0, ps1);
            l0 = l0 * al0 + ps0;
            l1 = l1 * al1 + ps1;
            #pragma unroll
            for (int j = 0; j < NO; j++) {
                o[j][0] *= al0; o[j][1] *= al0;
                o[j][2] *= al1; o[j][3] *= al1;
            }
            #pragma unroll
            for (int kk = 0; kk < FA_BC / 16; kk++) {
                if (!FULL && k0 + kk * 16 >= n) continue;
                unsigned pa[4];
                acc_to_a(pa, s, kk);
                mma_a_tile(o, pa, sv, LD, kk * 16, 0, lane);
            }
        };
        if (k0 + FA_BC <= n) block(BoolC<true>{});
        else block(BoolC<false>{});
    }
    if (q0 + warp * 16 >= n) return;
    fa_store_out<D>(out, lse2, o, m0, m1, l0, l1, bi, bh, hi, n, h, q0 + r0, t);
}


// One query step of the backward for one warp's 16 keys (key rows r0 and r0 + 8 of its block,
// fragments ka / va): Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ over the step's QN queries, Pᵀ from lse2,
// dSᵀ = Pᵀ ∘ (dPᵀ − delta) into the block's shared dSᵀ rows (for its dQ), then dV += Pᵀ·dO and
// dK += dSᵀ·Q. `sq`, `sdo`, `slse`, `sdelta` point at the step's first query, whose index is q0:
// queries ≥ n and keys not ok get P = 0. FQ: all QN queries are < n, so the step compiles
// without row tests (one branch-free stretch of tensor-core work the scheduler can interleave).
// SKIP (with !FQ): query tiles entirely ≥ n are skipped; without it they are computed on the
// zero-filled rows and masked, still branch-free (flash_bwd_small, where at most 15 are padding).
// QN is 64 in the tiled backwards and FA_SMALL_QC (then the rest of the padded head) in
// flash_bwd_small; LDS is the row stride of sds (the whole head's queries there).
template <int D, bool FQ, int QN = FA_BR, bool SKIP = !FQ, int LDS = QN + 8, class KF>
__device__ __forceinline__ void fa_bwd_step(const bf16* sq, const bf16* sdo, const float* slse, const float* sdelta, bf16* sds, int q0, int n,
                                            const KF& keys, bool key0_ok, bool key1_ok,
                                            float (&dk)[D / 8][4], float (&dv)[D / 8][4], int r0, int lane, float scale_log2) {
    constexpr int LD = D + 8;
    constexpr int KT = D / 16;
    constexpr int NS = QN / 8;
    const int t = lane & 3;
    float p[NS][4], dp[NS][4];
    fa_zero(p);
    fa_zero(dp);
    #pragma unroll
    for (int kt = 0; kt < KT; kt++) {
        unsigned ka[4], va[4];
        keys.get(kt, ka, va);
        #pragma unroll
        for (int j = 0; j < NS; j += 2) {
            if (SKIP && q0 + j * 8 >= n) continue;
            // (query rows past n within the step are zero-filled in shared memory)
            const bool second = !SKIP || q0 + (j + 1) * 8 < n;
            unsigned b[4];
            ldb_rows2(b, sq, LD, j * 8, kt * 16, lane);
            mma_bf16(p[j], ka, b);
            if (second) mma_bf16(p[j + 1], ka, b + 2);
            ldb_rows2(b, sdo, LD, j * 8, kt * 16, lane);
            mma_bf16(dp[j], va, b);
            if (second) mma_bf16(dp[j + 1], va, b + 2);
        }
    }
    #pragma unroll
    for (int j = 0; j < NS; j++) {
        const int qc = j * 8 + 2 * t;
        const bool qa_ok = FQ || q0 + qc < n, qb_ok = FQ || q0 + qc + 1 < n;
        const float la = slse[qc], lb = slse[qc + 1];
        const float da = sdelta[qc], db = sdelta[qc + 1];
        p[j][0] = key0_ok && qa_ok ? exp2f(p[j][0] * scale_log2 - la) : 0.f;
        p[j][1] = key0_ok && qb_ok ? exp2f(p[j][1] * scale_log2 - lb) : 0.f;
        p[j][2] = key1_ok && qa_ok ? exp2f(p[j][2] * scale_log2 - la) : 0.f;
        p[j][3] = key1_ok && qb_ok ? exp2f(p[j][3] * scale_log2 - lb) : 0.f;
        dp[j][0] = p[j][0] * (dp[j][0] - da);
        dp[j][1] = p[j][1] * (dp[j][1] - db);
        dp[j][2] = p[j][2] * (dp[j][2] - da);
        dp[j][3] = p[j][3] * (dp[j][3] - db);
    }
    #pragma unroll
    for (int kk = 0; kk < QN / 16; kk++) {
        if (SKIP && q0 + kk * 16 >= n) continue;
        unsigned pa[4], sa[4];
        acc_to_a(pa, p, kk);
        acc_to_a(sa, dp, kk);
        *(unsigned*)(sds + r0 * LDS + kk * 16 + 2 * t) = sa[0];
        *(unsigned*)(sds + (r0 + 8) * LDS + kk * 16 + 2 * t) = sa[1];
        *(unsigned*)(sds + r0 * LDS + kk * 16 + 8 + 2 * t) = sa[2];
        *(unsigned*)(sds + (r0 + 8) * LDS + kk * 16 + 8 + 2 * t) = sa[3];
        mma_a_tile(dv, pa, sdo, LD, kk * 16, 0, lane);
        mma_a_tile(dk, sa, sq, LD, kk * 16, 0, lane);
    }
}

// dK (times the softmax scale) and dV of keys key0 and key0 + 8 into dqkv (B, N, 3, H, D).
template <int D>
__device__ __forceinline__ void fa_store_dkdv(bf16* dqkv, int bi, int hi, int n, int h, i64 key0, bool key0_ok, bool key1_ok,
                                              const float (&dk)[D / 8][4], const float (&dv)[D / 8][4], float scale, int t) {
    constexpr int NO = D / 8;
    const i64 stride = (i64)3 * h * D;
    bf16* dkg = dqkv + (i64)bi * n * stride + h * D + hi * D + 2 * t;
    bf16* dvg = dkg + h * D;
    const i64 key1 = key0 + 8;
    if (key0_ok) {
        #pragma unroll
        for (int j = 0; j < NO; j++) {
            *(unsigned*)(dkg + key0 * stride + j * 8) = pack_bf16(dk[j][0] * scale, dk[j][1] * scale);
            *(unsigned*)(dvg + key0 * stride + j * 8) = pack_bf16(dv[j][0], dv[j][1]);
        }
    }
    if (key1_ok) {
        #pragma unroll
        for (int j = 0; j < NO; j++) {
            *(unsigned*)(dkg + key1 * stride + j * 8) = pack_bf16(dk[j][2] * scale, dk[j][3] * scale);
            *(unsigned*)(dvg + key1 * stride + j * 8) = pack_bf16(dv[j][2], dv[j][3]);
        }
    }
}

// The key-block backward: a block of BC/16 warps owns BC keys (16 per warp: their dK, dV in
// registers) and walks every query tile of 64 (double-buffered); per tile each warp computes
// its keys' P and dS (fa_bwd_step, dSᵀ into shared memory), then the block adds dQ = dS·K of
// the tile through f32 atomics: warp w takes queries 16·(w mod 4) and, with 8 warps, half of
// the head dim (w / 4), over all BC keys.
template <int D, int BC>
__device__ __forceinline__ void flash_bwd_pipe(bf16* __restrict__ dqkv, float* __restrict__ dq_acc, const bf16* __restrict__ dout, const bf16* __restrict__ qkv, const float* __restrict__ lse2, const float* __restrict__ delta, int n, int h, float scale, float scale_log2) {
    constexpr int LD = D + 8;
    constexpr int LDS = FA_BR + 8;
    constexpr int NO = D / 8;
    constexpr int NT = 2 * BC;                  // threads: BC / 16 warps
    constexpr int DSPLIT = BC / FA_BR;          // warp groups sharing the dQ tile's head dim
    constexpr int NQ = NO / DSPLIT;             // dQ n-tiles per warp
    extern __shared__ __align__(16) unsigned char fa_smem[];
    bf16* sk = (bf16*)fa_smem;                // BC × LD
    bf16* sv = sk + BC * LD;                  // BC × LD
    bf16* sds = sv + BC * LD;                 // dSᵀ: BC × LDS
    bf16* stages = sds + BC * LDS;            // stage s: Q at stages + 2s·FA_BR·LD, dO right after
    float* sstat = (float*)(stages + 4 * FA_BR * LD);  // stage s: lse2 at 2s·FA_BR, delta after
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int bh = blockIdx.y, bi = bh / h, hi = bh - bi * h;
    const int k0 = blockIdx.x * BC;
    const i64 stride = (i64)3 * h * D;
    const i64 ostride = (i64)h * D;
    const bf16* qg = qkv + (i64)bi * n * stride + hi * D;
    const bf16* kg = qg + h * D;
    const bf16* vg = qg + 2 * h * D;
    const bf16* dog = dout + (i64)bi * n * ostride + hi * D;
    const float* lg = lse2 + (i64)bh * n;
    const float* dg = delta + (i64)bh * n;
    const int nq = (n + FA_BR - 1) / FA_BR;

    auto prefetch = [&](int qi) {
        const int q0 = qi * FA_BR;
        bf16* st = stages + (qi & 1) * 2 * FA_BR * LD;
        float* ss = sstat + (qi & 1) * 2 * FA_BR;
        fa_load_tile_async<D, FA_BR, NT>(st, qg, stride, q0, n);
        fa_load_tile_async<D, FA_BR, NT>(st + FA_BR * LD, dog, ostride, q0, n);
        for (int i = threadIdx.x; i < FA_BR; i += NT) {
            const bool ok = q0 + i < n;
            cp_async4(ss + i, ok ? lg + q0 + i : lg, ok);
            cp_async4(ss + FA_BR + i, ok ? dg + q0 + i : dg, ok);
        }
        cp_async_commit();
    };
    fa_load_tile_async<D, BC, NT>(sk, kg, stride, k0, n);
    fa_load_tile_async<D, BC, NT>(sv, vg, stride, k0, n);
    prefetch(0);  // one group: K, V and query tile 0

    const int r0 = warp * 16 + g;
    KeyFrags<D> keys;
    const bool key0_ok = k0 + r0 < n, key1_ok = k0 + r0 + 8 < n;
    float dk[NO][4], dv[NO][4];
    fa_zero(dk);
    fa_zero(dv);
    const int qw = (warp % (FA_BR / 16)) * 16;  // dQ phase: this warp's 16 queries of the tile
    const int dh = (warp / (FA_BR / 16)) * (D / DSPLIT);  // … and the first of its head-dim columns

    for (int qi = 0; qi < nq; qi++) {
        const int q0 = qi * FA_BR;
        __syncthreads();  // every warp is done with the previous dSᵀ and the stage refilled next
        if (qi + 1 < nq) {
            prefetch(qi + 1);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();  // query tile qi (and, at qi = 0, K and V) is in shared memory
        const bf16* sq = stages + (qi & 1) * 2 * FA_BR * LD;
        const bf16* sdo = sq + FA_BR * LD;
        const float* slse = sstat + (qi & 1) * 2 * FA_BR;
        const float* sdelta = slse + FA_BR;
        if (qi == 0) keys.load(sk, sv, r0, t);
        if (k0 + warp * 16 < n) {  // some of this warp's keys exist (warp-uniform)
            if (q0 + FA_BR <= n) fa_bwd_step<D, true>(sq, sdo, slse, sdelta, sds, q0, n, keys, key0_ok, key1_ok, dk, dv, r0, lane, scale_log2);
            else fa_bwd_step<D, false>(sq, sdo, slse, sdelta, sds, q0, n, keys, key0_ok, key1_ok, dk, dv, r0, lane, scale_log2);
        }
        __syncthreads();  // dSᵀ complete (the rows of warps past n are skipped below)
        if (q0 + qw >= n) continue;
        float dq[NQ][4];
        fa_zero(dq);
        #pragma unroll
        for (int kk = 0; kk < BC / 16; kk++) {
            if (k0 + kk * 16 >= n) continue;
            unsigned a[4];
            ds_as_a(a, sds, LDS, kk * 16, qw, lane);
            mma_a_tile(dq, a, sk, LD, kk * 16, dh, lane);
        }
        const int qa0 = q0 + qw + g, qa1 = qa0 + 8;
        float* dqg = dq_acc + (i64)bi * n * ostride + hi * D + dh + 2 * t;
        if (qa0 < n) {
            #pragma unroll
            for (int j = 0; j < NQ; j++) red_add2(dqg + qa0 * ostride + j * 8, dq[j][0] * scale, dq[j][1] * scale);
        }
        if (qa1 < n) {
            #pragma unroll
            for (int j = 0; j < NQ; j++) red_add2(dqg + qa1 * ostride + j * 8, dq[j][2] * scale, dq[j][3] * scale);
        }
    }
    fa_store_dkdv<D>(dqkv, bi, hi, n, h, k0 + r0, key0_ok, key1_ok, dk, dv, scale, t);
}

// The tiled kernels for every head dim the fused path serves (a multiple of 16 up to 128:
// ViT-S/B/L's 64, ViT-H/14's 80, 32, 96 and 128); their host side is PIPE_HEAD_DIMS in
// attention.rs.
#define FA_PIPE(D) \
    extern "C" __global__ void flash_bwd_pre_d##D(float* delta, float* dq_acc, const bf16* dout, const bf16* out, int b, int n, int h) { \
        flash_bwd_pre<D>(delta, dq_acc, dout, out, b, n, h); \
    } \
    extern "C" __global__ void flash_fwd_d##D##_pipe(bf16* out, float* lse2, const bf16* qkv, int n, int h, float scale_log2) { \
        flash_fwd_pipe<D, 64>(out, lse2, qkv, n, h, scale_log2); \
    } \
    extern "C" __global__ void flash_fwd_d##D##_pipe128(bf16* out, float* lse2, const bf16* qkv, int n, int h, float scale_log2) { \
        flash_fwd_pipe<D, 128>(out, lse2, qkv, n, h, scale_log2); \
    } \
    extern "C" __global__ void flash_bwd_d##D##_pipe(bf16* dqkv, float* dq_acc, const bf16* dout, const bf16* qkv, const float* lse2, const float* delta, int n, int h, float scale, float scale_log2) { \
        flash_bwd_pipe<D, fa_bwd_keys<D>()>(dqkv, dq_acc, dout, qkv, lse2, delta, n, h, scale, scale_log2); \
    }
FA_PIPE(32)
FA_PIPE(64)
FA_PIPE(80)
FA_PIPE(96)
FA_PIPE(128)
#undef FA_PIPE

// ---- Backward for short sequences (N ≤ 256, every ViT at 224/16 or 32/4): one block of 8 warps
// per (b, h) owns every key and every query of the head, so nothing leaves the block until the
// end. All of Q, dO and lse2 stay in shared memory for the whole kernel; delta = rowsum(dO ∘ O)
// is computed here (no pre-pass); dQ accumulates in shared f32 rows that each warp owns
// exclusively during its phase (no atomics, no global accumulator, no store pass). Keys go in
// passes of 128 (warp w owns keys 16w..16w+15 of the pass, dK and dV in registers as in
// flash_bwd); queries in steps of 64 as in flash_bwd. In the dQ phase warp w takes the 16
// queries 16·(w mod 4)… of the step and half (w / 4) of the head dim.
#define FS_KB 128
#define FS_THREADS 256

// Shared-memory bytes of flash_bwd_short for `nqp` padded query rows (the host mirrors this).
template <int D> constexpr int fa_short_smem(int nqp) {
    return 2 * nqp * (D + 8) * 2 + 2 * nqp * 4 + nqp * (D + 8) * 4 + 2 * FS_KB * (D + 8) * 2 + FS_KB * (FA_BR + 8) * 2;
}

// `rows` rows of D values into shared rows of D + 8 (rows ≥ n zero-filled), by all THREADS
// threads of the block.
template <int D, int THREADS>
__device__ __forceinline__ void fa_load_rows_async(bf16* s, const bf16* g, i64 stride, int rows, int n) {
    constexpr int CH = D / 8;
    for (int i = threadIdx.x; i < rows * CH; i += THREADS) {
        int r = i / CH, c = i - r * CH;
        bool ok = r < n;
        cp_async16(s + r * (D + 8) + c * 8, ok ? g + (i64)r * stride + c * 8 : g, ok);
    }
}
template <int D>
__device__ __forceinline__ void fs_load_rows_async(bf16* s, const bf16* g, i64 stride, int rows, int n) {
    fa_load_rows_async<D, FS_THREADS>(s, g, stride, rows, n);
}

template <int D>
__device__ __forceinline__ void flash_bwd_short(bf16* __restrict__ dqkv, const bf16* __restrict__ out, const bf16* __restrict__ dout, const bf16* __restrict__ qkv, const float* __restrict__ lse2, int n, int h, float scale, float scale_log2) {
    constexpr int LD = D + 8;
    constexpr int LDQ = D + 8;  // f32 dQ rows: float2 accesses of a half-warp hit distinct banks
    constexpr int LDS = FA_BR + 8;
    constexpr int NO = D / 8;
    constexpr int NH = NO / 2;  // n-tiles of one half of the head dim
    extern __shared__ __align__(16) unsigned char fa_smem[];
    const int nq = (n + FA_BR - 1) / FA_BR, nqp = nq * FA_BR;
    bf16* sQ = (bf16*)fa_smem;               // nqp × LD
    bf16* sdO = sQ + nqp * LD;                // nqp × LD
    bf16* sK = sdO + nqp * LD;                // FS_KB × LD
    bf16* sV = sK + FS_KB * LD;               // FS_KB × LD
    bf16* sds = sV + FS_KB * LD;              // dSᵀ: FS_KB × LDS
    float* slse = (float*)(sds + FS_KB * LDS);  // nqp
    float* sdelta = slse + nqp;                 // nqp
    float* sdQ = sdelta + nqp;                  // nqp × LDQ

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int bh = blockIdx.x, bi = bh / h, hi = bh - bi * h;
    const i64 stride = (i64)3 * h * D;
    const i64 ostride = (i64)h * D;
    const bf16* qg = qkv + (i64)bi * n * stride + hi * D;
    const bf16* kg = qg + h * D;
    const bf16* vg = qg + 2 * h * D;
    const bf16* dog = dout + (i64)bi * n * ostride + hi * D;
    const bf16* og = out + (i64)bi * n * ostride + hi * D;

    fs_load_rows_async<D>(sQ, qg, stride, nqp, n);
    fs_load_rows_async<D>(sdO, dog, ostride, nqp, n);
    for (int i = threadIdx.x; i < nqp; i += FS_THREADS) {
        const bool ok = i < n;
        cp_async4(slse + i, ok ? lse2 + (i64)bh * n + i : lse2, ok);
    }
    cp_async_commit();
    // delta and the zeroed dQ accumulator while the copies fly; dO·O in f32 from global rows
    for (int r = threadIdx.x; r < nqp; r += FS_THREADS) {
        sdelta[r] = r < n ? row_dot<D>(dog + (i64)r * ostride, og + (i64)r * ostride) : 0.f;
    }
    for (int i = threadIdx.x; i < nqp * LDQ; i += FS_THREADS) sdQ[i] = 0.f;

    const int r0 = warp * 16 + g;    // this thread's key rows r0, r0 + 8 within a pass
    const int qw = (warp & 3) * 16;  // dQ phase: this warp's 16 queries within a step
    const int dh = (warp >> 2) * (D / 2);  // … and its half of the head dim
    for (int k0 = 0; k0 < n; k0 += FS_KB) {
        __syncthreads();  // the previous pass is done with sK, sV, sds
        fs_load_rows_async<D>(sK, kg + (i64)k0 * stride, stride, FS_KB, n - k0);
        fs_load_rows_async<D>(sV, vg + (i64)k0 * stride, stride, FS_KB, n - k0);
        cp_async_commit();
        cp_async_wait<0>();
        __syncthreads();
        const bool active = k0 + warp * 16 < n;  // some of this warp's keys exist (warp-uniform)
        const bool key0_ok = k0 + r0 < n, key1_ok = k0 + r0 + 8 < n;
        KeyRegs<D> keys;
        keys.load(sK, sV, r0, t);
        float dk[NO][4], dv[NO][4];
        fa_zero(dk);
        fa_zero(dv);
        // Key passes entirely < n compile the dQ phase without key tests (see fa_bwd_step).
        auto phase2 = [&](auto full_tag, int q0) {
            constexpr bool FK = decltype(full_tag)::value;
            // Two accumulator sets (even / odd key chunks) halve the dependent chain of
            // tensor-core ops that every warp waits on before the step's closing barrier.
            float dq2[2][NH][4];
            #pragma unroll
            for (int u = 0; u < 2; u++)
                #pragma unroll
                for (int j = 0; j < NH; j++) dq2[u][j][0] = dq2[u][j][1] = dq2[u][j][2] = dq2[u][j][3] = 0.f;
            #pragma unroll
            for (int kk = 0; kk < FS_KB / 16; kk++) {
                if (!FK && k0 + kk * 16 >= n) continue;
                unsigned a[4];
                ds_as_a(a, sds, LDS, kk * 16, qw, lane);
                mma_a_tile(dq2[kk & 1], a, sK, LD, kk * 16, dh, lane);
            }
            float dq[NH][4];
            #pragma unroll
            for (int j = 0; j < NH; j++)
                #pragma unroll
                for (int e = 0; e < 4; e++) dq[j][e] = dq2[0][j][e] + dq2[1][j][e];
            // rows q0 + qw + g (+ 8) belong to this warp alone in this phase
            float* d0 = sdQ + (q0 + qw + g) * LDQ + dh + 2 * t;
            float* d1 = d0 + 8 * LDQ;
            #pragma unroll
            for (int j = 0; j < NH; j++) {
                float2 x = *(float2*)(d0 + j * 8), y = *(float2*)(d1 + j * 8);
                x.x += dq[j][0]; x.y += dq[j][1];
                y.x += dq[j][2]; y.y += dq[j][3];
                *(float2*)(d0 + j * 8) = x;
                *(float2*)(d1 + j * 8) = y;
            }
        };
        const bool full_pass = k0 + FS_KB <= n;
        for (int q0 = 0; q0 < n; q0 += FA_BR) {
            if (active) {
                if (q0 + FA_BR <= n) fa_bwd_step<D, true>(sQ + q0 * LD, sdO + q0 * LD, slse + q0, sdelta + q0, sds, q0, n, keys, key0_ok, key1_ok, dk, dv, r0, lane, scale_log2);
                else fa_bwd_step<D, false>(sQ + q0 * LD, sdO + q0 * LD, slse + q0, sdelta + q0, sds, q0, n, keys, key0_ok, key1_ok, dk, dv, r0, lane, scale_log2);
            }
            __syncthreads();  // dSᵀ of this step complete
            if (q0 + qw < n) {
                if (full_pass) phase2(BoolC<true>{}, q0);
                else phase2(BoolC<false>{}, q0);
            }
            __syncthreads();  // dSᵀ consumed before the next step overwrites it
        }
        fa_store_dkdv<D>(dqkv, bi, hi, n, h, k0 + r0, key0_ok, key1_ok, dk, dv, scale, t);
    }
    __syncthreads();  // every dQ contribution is in sdQ
    bf16* dqg = dqkv + (i64)bi * n * stride + hi * D;
    constexpr int CH = D / 8;
    for (int i = threadIdx.x; i < n * CH; i += FS_THREADS) {
        const int r = i / CH, c = i - r * CH;
        const float* s = sdQ + r * LDQ + c * 8;
        uint4 v;
        v.x = pack_bf16(s[0] * scale, s[1] * scale);
        v.y = pack_bf16(s[2] * scale, s[3] * scale);
        v.z = pack_bf16(s[4] * scale, s[5] * scale);
        v.w = pack_bf16(s[6] * scale, s[7] * scale);
        *(uint4*)(dqg + (i64)r * stride + c * 8) = v;
    }
}

extern "C" __global__ void __launch_bounds__(FS_THREADS, 1) flash_bwd_short_d64(bf16* dqkv, const bf16* out, const bf16* dout, const bf16* qkv, const float* lse2, int n, int h, float scale, float scale_log2) {
    flash_bwd_short<64>(dqkv, out, dout, qkv, lse2, n, h, scale, scale_log2);
}
extern "C" __global__ void __launch_bounds__(FS_THREADS, 1) flash_bwd_short_d32(bf16* dqkv, const bf16* out, const bf16* dout, const bf16* qkv, const float* lse2, int n, int h, float scale, float scale_log2) {
    flash_bwd_short<32>(dqkv, out, dout, qkv, lse2, n, h, scale, scale_log2);
}

// ---- Small heads (N ≤ 16·W; CIFAR's 32 px / 4 → 65 tokens at W = 5): one block of W warps per
// (b, h) keeps the whole head in shared memory, padded to NP = 16·W rows (rows ≥ n zero-filled),
// and each product covers all NP rows at once: no online softmax in the forward, one query step
// in the backward, so dQ comes straight from registers (no f32 accumulator) and nothing is
// skipped or branched on inside the tensor-core work (padding keys get P = 0, padding queries
// are masked and never stored). The blocks are small (≈ 35 KB forward, ≈ 72 KB backward at
// W = 5, D = 64) so several share an SM and one block's loads overlap another's products —
// the 256-key blocks of flash_bwd_short left a single 8-warp block per SM, 3 warps idle, for
// these heads.

// Dynamic shared memory (bytes) of flash_{fwd,bwd}_small for W warps (the host mirrors this):
// forward Q, K, V; backward Q, dO, K, V, O + dSᵀ (NP × (NP + 8)) + lse2 + delta — without O
// when that would pass a block's limit (227 KiB): the 13-warp backward of N ≤ 208 at D = 64
// (235 KiB with O, 206 without) reads O from global memory once, for delta.
template <int D, int W> constexpr bool fa_small_o_smem() { return 5 * 16 * W * (D + 8) * 2 + 16 * W * (16 * W + 8) * 2 + 2 * 16 * W * 4 <= 227 * 1024; }
template <int D, int W> constexpr int fa_small_fwd_smem() { return 3 * 16 * W * (D + 8) * 2; }
template <int D, int W> constexpr int fa_small_bwd_smem() { return (fa_small_o_smem<D, W>() ? 5 : 4) * 16 * W * (D + 8) * 2 + 16 * W * (16 * W + 8) * 2 + 2 * 16 * W * 4; }

// NP = 16·W rows of D values into shared rows of D + 8 (rows ≥ n zero-filled), by all W warps.
template <int D, int W>
__device__ __forceinline__ void fsm_load_rows_async(bf16* s, const bf16* g, i64 stride, int n) {
    fa_load_rows_async<D, 32 * W>(s, g, stride, 16 * W, n);
}

template <int D, int W>
__device__ __forceinline__ void flash_fwd_small(bf16* __restrict__ out, float* __restrict__ lse2, const bf16* __restrict__ qkv, int n, int h, float scale_log2) {
    constexpr int LD = D + 8;
    constexpr int KT = D / 16;
    constexpr int NP = 16 * W;
    constexpr int NS = NP / 8;
    constexpr int NO = D / 8;
    extern __shared__ __align__(16) unsigned char fa_smem[];
    bf16* sq = (bf16*)fa_smem;
    bf16* sk = sq + NP * LD;
    bf16* sv = sk + NP * LD;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int bh = blockIdx.x, bi = bh / h, hi = bh - bi * h;
    const i64 stride = (i64)3 * h * D;
    const bf16* qg = qkv + (i64)bi * n * stride + hi * D;
    fsm_load_rows_async<D, W>(sq, qg, stride, n);
    fsm_load_rows_async<D, W>(sk, qg + h * D, stride, n);
    fsm_load_rows_async<D, W>(sv, qg + 2 * h * D, stride, n);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    if (warp * 16 >= n) return;  // all 16 rows past the end (warp-uniform; no barrier follows)
    const int r0 = warp * 16 + g;
    unsigned qa[KT][4];
    fa_row_fragments<D>(qa, sq, r0, t);
    float s[NS][4];
    fa_scores<D, NS, false>(s, qa, sk, n, lane);
    // the whole row is here: its exact maximum, no rescaling
    float m0 = -INFINITY, m1 = -INFINITY;
    fa_scale_mask_max<NS, true>(s, n, scale_log2, t, m0, m1);
    m0 = quad_max(m0);
    m1 = quad_max(m1);
    float l0 = 0.f, l1 = 0.f;
    fa_exp2_rows(s, m0, m1, l0, l1);
    float o[NO][4];
    fa_zero(o);
    #pragma unroll
    for (int kk = 0; kk < NP / 16; kk++) {
        unsigned pa[4];
        acc_to_a(pa, s, kk);
        mma_a_tile(o, pa, sv, LD, kk * 16, 0, lane);
    }
    fa_store_out<D>(out, lse2, o, m0, m1, l0, l1, bi, bh, hi, n, h, r0, t);
}

// The backward's query step and its blocks per SM: with 32 queries a step and K, V fragments
// reloaded per step it needs 128 registers, so 3 blocks of 5 warps share an SM (2 when it held
// the whole head's P and dP: 168 registers); measured on an H200 at CIFAR ViT-S/4 micro 512,
// 1.32 → 1.20 ms per step for the twelve layers (steps of 16: 1.24 ms).
#define FA_SMALL_QC 32
#define FA_SMALL_BWD_BLOCKS 3

// bias_part (optional, may be 0): the qkv bias gradient's per-image partial sums, row b of
// 2·H·D f32 = [Σ dQ | Σ dV] over the image's tokens, head hi at columns hi·D… of each half
// (the host reduces the B rows into the q and v bias spans). Σ_keys dV = Σ_queries dO, since
// every query's probabilities sum to 1, so the v half is dO's column sums; the k part is zero
// exactly (adding a constant to every key shifts a score row by a constant, which softmax
// ignores), so there is none to add.
template <int D, int W>
__device__ __forceinline__ void flash_bwd_small(bf16* __restrict__ dqkv, const bf16* __restrict__ out, const bf16* __restrict__ dout, const bf16* __restrict__ qkv, const float* __restrict__ lse2, int n, int h, float scale, float scale_log2, float* __restrict__ bias_part) {
    constexpr int LD = D + 8;
    constexpr int NP = 16 * W;
    constexpr int LDS = NP + 8;
    constexpr int NO = D / 8;
    constexpr bool OS = fa_small_o_smem<D, W>();  // O staged in shared memory (see fa_small_bwd_smem)
    extern __shared__ __align__(16) unsigned char fa_smem[];
    bf16* sQ = (bf16*)fa_smem;
    bf16* sdO = sQ + NP * LD;
    bf16* sK = sdO + NP * LD;
    bf16* sV = sK + NP * LD;
    bf16* sO = sV + NP * LD;                   // (OS only)
    bf16* sds = OS ? sO + NP * LD : sO;        // dSᵀ: NP keys × LDS
    float* slse = (float*)(sds + NP * LDS);     // NP
    float* sdelta = slse + NP;                  // NP

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int bh = blockIdx.x, bi = bh / h, hi = bh - bi * h;
    const i64 stride = (i64)3 * h * D;
    const i64 ostride = (i64)h * D;
    const bf16* qg = qkv + (i64)bi * n * stride + hi * D;
    const i64 obase = (i64)bi * n * ostride + hi * D;
    fsm_load_rows_async<D, W>(sQ, qg, stride, n);
    fsm_load_rows_async<D, W>(sdO, dout + obase, ostride, n);
    fsm_load_rows_async<D, W>(sK, qg + h * D, stride, n);
    fsm_load_rows_async<D, W>(sV, qg + 2 * h * D, stride, n);
    if constexpr (OS) fsm_load_rows_async<D, W>(sO, out + obase, ostride, n);
    for (int i = threadIdx.x; i < NP; i += 32 * W) {
        const bool ok = i < n;
        cp_async4(slse + i, ok ? lse2 + (i64)bh * n + i : lse2, ok);
    }
    cp_async_commit();
    // delta = rowsum(dO ∘ O): two threads per row (NP rows, 32·W threads), each half the head
    // dim, joined through a shuffle — the same f32 products as row_dot, summed in two halves.
    const int dr = threadIdx.x >> 1, dhalf = threadIdx.x & 1;
    uint4 orow[D / 16];  // !OS: this thread's half row of O, loaded while the copies fly
    if constexpr (!OS) {
        const uint4* src = (const uint4*)(out + obase + (i64)(dr < n ? dr : 0) * ostride + dhalf * (D / 2));
        #pragma unroll
        for (int c = 0; c < D / 16; c++) orow[c] = dr < n ? src[c] : make_uint4(0u, 0u, 0u, 0u);
    }
    cp_async_wait<0>();
    __syncthreads();
    {
        float part = 0.f;
        if constexpr (OS) {
            part = row_dot<D / 2>(sdO + dr * LD + dhalf * (D / 2), sO + dr * LD + dhalf * (D / 2));
        } else {
            const uint4* x4 = (const uint4*)(sdO + dr * LD + dhalf * (D / 2));
            #pragma unroll
            for (int c = 0; c < D / 16; c++) part = dot8_acc(part, x4[c], orow[c]);
        }
        const float sum = part + __shfl_xor_sync(0xffffffffu, part, 1);
        if (dhalf == 0) sdelta[dr] = sum;  // 0 for the zero-filled rows ≥ n
    }
    // dO's column sums for the v bias: thread (group gr, column pair cp) sums NP / GR rows
    constexpr int CP = D / 2, GR = 32 * W / CP, GROWS = NP / GR;
    const int cp = threadIdx.x % CP, gr = threadIdx.x / CP;
    float bv0 = 0.f, bv1 = 0.f;
    if (bias_part) {
        #pragma unroll 4
        for (int r = gr * GROWS; r < (gr + 1) * GROWS; r++) {
            const unsigned u = ld2(sdO + r * LD + 2 * cp);
            bv0 += lo16(u);
            bv1 += hi16(u);
        }
    }
    __syncthreads();
    // GR + W rows of D f32 for the bias sums: in O's place once delta is in shared memory, or
    // without OS in Q's once every warp is past its query steps (written after that barrier)
    float* sbias = OS ? (float*)sO : (float*)sQ;
    if (OS && bias_part) {
        sbias[gr * D + 2 * cp] = bv0;
        sbias[gr * D + 2 * cp + 1] = bv1;
    }
    // Keys: warp w owns keys 16w.. (rows r0, r0 + 8), every warp, so every dSᵀ row is written.
    const int r0 = warp * 16 + g;
    const bool key0_ok = r0 < n, key1_ok = r0 + 8 < n;
    {
        float dk[NO][4], dv[NO][4];
        fa_zero(dk);
        fa_zero(dv);
        // Queries in steps of FA_SMALL_QC (the last one NP mod QC). A step's P and dP live in
        // registers (QC/2 floats each per lane) and the K, V fragments are reloaded from shared
        // memory per step rather than held across steps: registers set how
        // many blocks share an SM, and this kernel is latency-bound.
        auto step = [&](auto qn, int q0) {
            constexpr int QN = decltype(qn)::value;
            KeyRegs<D> keys;
            keys.load(sK, sV, r0, t);
            fa_bwd_step<D, false, QN, false, LDS>(sQ + q0 * LD, sdO + q0 * LD, slse + q0, sdelta + q0, sds + q0, q0, n, keys, key0_ok, key1_ok, dk, dv, r0, lane, scale_log2);
        };
        #pragma unroll 1
        for (int q0 = 0; q0 + FA_SMALL_QC <= NP; q0 += FA_SMALL_QC) step(IntC<FA_SMALL_QC>{}, q0);
        if constexpr (NP % FA_SMALL_QC != 0) step(IntC<NP % FA_SMALL_QC>{}, NP - NP % FA_SMALL_QC);
        fa_store_dkdv<D>(dqkv, bi, hi, n, h, r0, key0_ok, key1_ok, dk, dv, scale, t);
    }
    __syncthreads();  // dSᵀ complete (and Q no longer read)
    if (!OS && bias_part) {
        sbias[gr * D + 2 * cp] = bv0;
        sbias[gr * D + 2 * cp + 1] = bv1;
    }
    // Queries: warp w owns queries 16w..; dQ = dS·K over every key, from registers to global.
    float dq[NO][4];
    fa_zero(dq);
    if (warp * 16 < n) {  // (warp-uniform; a warp past the end keeps dq = 0 for the bias sums)
        #pragma unroll
        for (int kk = 0; kk < NP / 16; kk++) {
            unsigned a[4];
            ds_as_a(a, sds, LDS, kk * 16, warp * 16, lane);
            mma_a_tile(dq, a, sK, LD, kk * 16, 0, lane);
        }
        bf16* dqg = dqkv + (i64)bi * n * stride + hi * D + 2 * t;
        if (r0 < n) {
            #pragma unroll
            for (int j = 0; j < NO; j++) *(unsigned*)(dqg + r0 * stride + j * 8) = pack_bf16(dq[j][0] * scale, dq[j][1] * scale);
        }
        if (r0 + 8 < n) {
            #pragma unroll
            for (int j = 0; j < NO; j++) *(unsigned*)(dqg + (r0 + 8) * stride + j * 8) = pack_bf16(dq[j][2] * scale, dq[j][3] * scale);
        }
    }
    if (!bias_part) return;  // (block-uniform)
    // dQ's column sums: the warp's 16 rows (zero past n) through the 8 lanes of each column pair
    float* sq = sbias + GR * D;
    #pragma unroll
    for (int j = 0; j < NO; j++) {
        float c0 = dq[j][0] + dq[j][2], c1 = dq[j][1] + dq[j][3];
        #pragma unroll
        for (int o = 4; o < 32; o <<= 1) {
            c0 += __shfl_xor_sync(0xffffffffu, c0, o);
            c1 += __shfl_xor_sync(0xffffffffu, c1, o);
        }
        if (g == 0) {
            sq[warp * D + j * 8 + 2 * t] = c0 * scale;
            sq[warp * D + j * 8 + 2 * t + 1] = c1 * scale;
        }
    }
    __syncthreads();
    if (threadIdx.x < D) {  // fixed summation order: deterministic
        float bq = 0.f, bv = 0.f;
        #pragma unroll
        for (int w = 0; w < W; w++) bq += sq[w * D + threadIdx.x];
        #pragma unroll
        for (int q = 0; q < GR; q++) bv += sbias[q * D + threadIdx.x];
        float* row = bias_part + (i64)bi * 2 * h * D + hi * D + threadIdx.x;
        row[0] = bq;
        row[(i64)h * D] = bv;
    }
}

// W = 4 (N ≤ 64) and W = 5 (N ≤ 80).
#define FA_SMALL(D, W)                                                                                                                  \
    extern "C" __global__ void __launch_bounds__(32 * W) flash_fwd_small_d##D##_w##W(bf16* out, float* lse2, const bf16* qkv, int n, int h, float scale_log2) { \
        flash_fwd_small<D, W>(out, lse2, qkv, n, h, scale_log2);                                                                         \
    }                                                                                                                                     \
    extern "C" __global__ void __launch_bounds__(32 * W, FA_SMALL_BWD_BLOCKS) flash_bwd_small_d##D##_w##W(bf16* dqkv, const bf16* out, const bf16* dout, const bf16* qkv, const float* lse2, int n, int h, float scale, float scale_log2, float* bias_part) { \
        flash_bwd_small<D, W>(dqkv, out, dout, qkv, lse2, n, h, scale, scale_log2, bias_part);                                                       \
    }
FA_SMALL(64, 4)
FA_SMALL(64, 5)
FA_SMALL(32, 4)
FA_SMALL(32, 5)

// The backward alone at W = 13 (192 < N ≤ 208: 224 px / 16 = 197 tokens), one block per SM
// (206 KiB of shared memory, O read from global memory). Against flash_bwd_short: 13 warps
// instead of 8, no barriers between query steps, dQ straight from registers, the qkv bias sums
// inside. Its forward stays the tiled one (the whole head's scores per warp would not fit).
// On sm_90 the wgmma kernels of hopper.cu take this range (VITSCALE_WGMMA_ATTENTION=0: these).
extern "C" __global__ void __launch_bounds__(32 * 13, 1) flash_bwd_small_d64_w13(bf16* dqkv, const bf16* out, const bf16* dout, const bf16* qkv, const float* lse2, int n, int h, float scale, float scale_log2, float* bias_part) {
    flash_bwd_small<64, 13>(dqkv, out, dout, qkv, lse2, n, h, scale, scale_log2, bias_part);
}
