// Hopper (sm_90a) GEMM on the warpgroup tensor-core instructions (wgmma) with the MLP's erf
// GELU in its epilogue (timm's nn.GELU; cuBLASLt's GELU epilogue is the tanh approximation).
// Opt-in (VITSCALE_FUSED_GEMM=1): it is correct (selftest) but slower than cuBLASLt plus the
// separate GELU pass — its main loop reaches ≈ 60–70 % of cuBLASLt's rate and the epilogue's
// GELU arithmetic does not overlap the tensor cores (BENCHMARKS.md). It is the base for the
// warp-specialized (TMA producer, consumer warpgroups, overlapped epilogue) kernel that would.
//
// Layout: C(M×N) = A(M×K) · B(N×K)ᵀ, both operands row-major with K contiguous ("K-major", as
// a linear layer's input and weight are). A block computes a (64·WG)×128 tile, each warpgroup
// 64 rows with one m64n128k16 wgmma per 16-wide K step. K advances in 64-wide tiles through a
// cp.async ring of STAGES stages in shared memory; each tile row (64 bf16 = 128 bytes) is
// stored with the 128-byte swizzle the wgmma descriptors name: 16-byte chunk c of row r sits at
// chunk c ^ (r % 8) (stages 1024-byte aligned, so this matches the hardware's address-bit XOR).
// Requires N % 128 == 0, K % 64 == 0, 16-byte aligned rows; M is free (rows past M load as
// zeros and are not stored).

#define HG_BN 128
#define HG_BK 64
#define HG_B_TILE (HG_BN * HG_BK * 2)             // bytes of one B tile: 16 KiB
#define HG_LDO (HG_BN + 8)                        // epilogue staging row stride (bf16)

__device__ __forceinline__ unsigned hg_smem_u32(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void hg_cp_async16(unsigned dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0) : "memory");
}

// Shared-memory matrix descriptor of a K-major tile with the 128-byte swizzle: start address,
// leading byte offset (unused by this mode: 16), stride byte offset 1024 (8 rows × 128 bytes
// between core-matrix groups), swizzle mode 1 (128 B) in bits 62–63.
__device__ __forceinline__ unsigned long long hg_desc(unsigned saddr) {
    return (unsigned long long)((saddr & 0x3FFFF) >> 4) | (1ull << 16) | ((unsigned long long)(1024 >> 4) << 32) | (1ull << 62);
}

__device__ __forceinline__ void wgmma_m64n128k16(float (&d)[64], unsigned long long da, unsigned long long db) {
    asm volatile(
        "{\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
        "%64, %65, 1, 1, 1, 0, 0;\n"
        "}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(da), "l"(db));
}

// Loads the BM×64 tile of A (rows m0…) and the 128×64 tile of B (rows n0…) at K offset k0
// into the stage at shared address `st` (A first, then B).
template <int WG>
__device__ __forceinline__ void hg_load_stage(unsigned st, const bf16* __restrict__ A, const bf16* __restrict__ B, int M, int K, int m0, int n0, int k0, int tid) {
    #pragma unroll
    for (int i = 0; i < 64 * WG * 8 / (128 * WG); i++) {
        const int idx = tid + i * 128 * WG;  // chunk index: row idx / 8, chunk idx % 8
        const int r = idx >> 3, c = idx & 7;
        const int gm = m0 + r;
        const bool ok = gm < M;
        hg_cp_async16(st + r * 128 + ((c ^ (r & 7)) << 4), A + (i64)(ok ? gm : 0) * K + k0 + c * 8, ok);
    }
    #pragma unroll
    for (int i = 0; i < HG_BN * 8 / (128 * WG); i++) {
        const int idx = tid + i * 128 * WG;
        const int r = idx >> 3, c = idx & 7;
        hg_cp_async16(st + 64 * WG * 128 + r * 128 + ((c ^ (r & 7)) << 4), B + (i64)(n0 + r) * K + k0 + c * 8, true);
    }
}

// The main loop: acc (this thread's 64 values of its warpgroup's 64×128 slice) = A·Bᵀ over the
// block's tile. Tile kt + 2 is loaded while the wgmma of tile kt runs and that of kt − 1
// finishes (one wgmma group kept in flight): at iteration kt every thread has waited for its
// group kt − 2 before the barrier, so that stage is free for tile kt + 2. Returns with every
// wgmma complete and the ring free for reuse.
template <int WG, int STAGES>
__device__ __forceinline__ void hg_mainloop(float (&acc)[64], unsigned ring, const bf16* __restrict__ A, const bf16* __restrict__ B, int M, int K, int m0, int n0) {
    const int tid = threadIdx.x, wg = tid >> 7;
    #pragma unroll
    for (int i = 0; i < 64; i++) acc[i] = 0.f;
    const int kt_n = K / HG_BK;
    #pragma unroll
    constexpr int A_TILE = 64 * WG * 128, STAGE = A_TILE + HG_B_TILE;
    for (int s = 0; s < STAGES - 2; s++) {
        if (s < kt_n) hg_load_stage<WG>(ring + s * STAGE, A, B, M, K, m0, n0, s * HG_BK, tid);
        asm volatile("cp.async.commit_group;\n" ::: "memory");
    }
    for (int kt = 0; kt < kt_n; kt++) {
        // tile kt has landed (this thread's copies; later groups may be in flight), is made
        // visible to the async proxy the wgmma reads through, then every thread's copies are
        asm volatile("cp.async.wait_group %0;\n" ::"n"(STAGES - 3) : "memory");
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        __syncthreads();
        const int next = kt + STAGES - 2;
        if (next < kt_n) hg_load_stage<WG>(ring + (next % STAGES) * STAGE, A, B, M, K, m0, n0, next * HG_BK, tid);
        asm volatile("cp.async.commit_group;\n" ::: "memory");
        const unsigned sa = ring + (kt % STAGES) * STAGE, sb = sa + A_TILE;
        const unsigned long long da = hg_desc(sa + wg * 64 * 128), db = hg_desc(sb);
        asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
        #pragma unroll
        for (int kk = 0; kk < HG_BK / 16; kk++) wgmma_m64n128k16(acc, da + 2 * kk, db + 2 * kk);  // +32 bytes per step
        asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
        asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
    }
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    asm volatile("cp.async.wait_group 0;\n" ::: "memory");
    __syncthreads();
}

template <int WG, int STAGES, bool GELU>
__device__ __forceinline__ void hg_gemm_gelu(bf16* __restrict__ act, bf16* __restrict__ pre, const bf16* __restrict__ A, const bf16* __restrict__ B, const bf16* __restrict__ bias, int M, int N, int K) {
    extern __shared__ unsigned char hg_raw[];
    const unsigned raw = hg_smem_u32(hg_raw);
    const unsigned ring = (raw + 1023u) & ~1023u;
    unsigned char* base = hg_raw + (ring - raw);
    const int m0 = blockIdx.y * 64 * WG, n0 = blockIdx.x * HG_BN;
    float acc[64];
    hg_mainloop<WG, STAGES>(acc, ring, A, B, M, K, m0, n0);

    // accumulator (warpgroup wg, warp w, lane l): value 4j + {0,1} is row 64wg + 16w + l/4,
    // columns 8j + 2(l % 4) + {0,1}; 4j + {2,3} the row 8 below. Stage both outputs in shared
    // memory, then store whole 16-byte row chunks.
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int r0 = (warp >> 2) * 64 + (warp & 3) * 16 + (lane >> 2), cq = 2 * (lane & 3);
    bf16* spre = (bf16*)base;
    bf16* sact = spre + 64 * WG * HG_LDO;
    #pragma unroll
    for (int j = 0; j < 16; j++) {
        const int col = 8 * j + cq;
        float b0 = 0.f, b1 = 0.f;
        if (bias) {
            const unsigned bw = *(const unsigned*)(bias + n0 + col);
            b0 = bf2f((bf16)(bw & 0xffffu));
            b1 = bf2f((bf16)(bw >> 16));
        }
        #pragma unroll
        for (int h = 0; h < 2; h++) {
            const unsigned p = f2bf2(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
            const float p0 = bf2f((bf16)(p & 0xffffu)) + b0, p1 = bf2f((bf16)(p >> 16)) + b1;
            const int r = r0 + 8 * h;
            *(unsigned*)(spre + r * HG_LDO + col) = p;
            if (GELU) *(unsigned*)(sact + r * HG_LDO + col) = f2bf2(gelu_f(p0), gelu_f(p1));
        }
    }
    __syncthreads();
    #pragma unroll
    for (int i = 0; i < 64 * WG * 16 / (128 * WG); i++) {
        const int idx = tid + i * 128 * WG;  // BM rows × 16 chunks
        const int r = idx >> 4, c = (idx & 15) * 8;
        const int gm = m0 + r;
        if (gm < M) {
            const i64 g = (i64)gm * N + n0 + c;
            *(uint4*)(pre + g) = *(const uint4*)(spre + r * HG_LDO + c);
            if (GELU) *(uint4*)(act + g) = *(const uint4*)(sact + r * HG_LDO + c);
        }
    }
}

// The instance in use: 2 warpgroups (128-row tiles), 3 stages (97 KiB), two blocks per SM.
// Measured against 4 warpgroups / 4 stages / one block per SM (256-row tiles) on an H200: 1.83
// vs 1.93 ms per CIFAR ViT-S step, 7.59 vs 7.64 ms per ViT-B/16 step (BENCHMARKS.md).
extern "C" __global__ void __launch_bounds__(256, 2) gemm_gelu_fwd_sm90(bf16* __restrict__ act, bf16* __restrict__ pre, const bf16* __restrict__ A, const bf16* __restrict__ B, const bf16* __restrict__ bias, int M, int N, int K) {
    hg_gemm_gelu<2, 3, true>(act, pre, A, B, bias, M, N, K);
}
