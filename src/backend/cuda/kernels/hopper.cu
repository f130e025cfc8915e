// Hopper (sm_90a) GEMM on the warpgroup tensor-core instructions (wgmma) with the MLP's erf
// GELU in its epilogue (timm's nn.GELU; cuBLASLt's GELU epilogue is the tanh approximation):
// fc1's pre-activation and GELU output from one kernel instead of cuBLASLt's product and a
// separate GELU pass. Opt-in (VITSCALE_FUSED_GEMM=1): its outputs equal cuBLASLt's bit for bit
// on an H200 (selftest), but it is slower than cuBLASLt plus the GELU pass — 1.69 vs 1.48 ms per
// CIFAR ViT-S step, 7.30 vs 5.96 ms per ViT-B/16 step — because the epilogue's GELU arithmetic
// does not overlap the tensor cores and the main loop trails cuBLASLt's (BENCHMARKS.md has the
// variants measured). It is the base for the kernel that would win: a persistent one whose
// epilogue overlaps the next tile's main loop at full tensor-core rate.
//
// C(M×N) = A(M×K) · B(N×K)ᵀ, both operands row-major with K contiguous ("K-major", as a linear
// layer's input and weight are). A block computes a 128×128 tile: warps 0–7 are two consumer
// warpgroups (64 rows each, one m64n128k16 wgmma per 16-wide K step), warp 8 the producer: its
// lane 0 issues the TMA copies of each 128×64 A and B tile into a 3-stage ring. The tensor maps
// apply the 128-byte swizzle: 16-byte chunk c of tile row r (64 bf16 = 128 bytes) lands at chunk
// c ^ (r % 8), the layout the wgmma descriptors name (stages 1024-byte aligned). full[s]
// completes when a stage's bytes have landed (the copies' transaction count), empty[s] when the
// 8 consumer warps are done with it. Two blocks per SM (97 KiB of shared memory, 96
// registers). Requires N % 128 == 0, K % 64 == 0, 16-byte aligned rows; M is free (the tensor
// map reads rows past M as zeros; they are not stored).

#define HG_BN 128
#define HG_BK 64
#define HG_LDO (HG_BN + 8)                        // epilogue staging row stride (bf16)

__device__ __forceinline__ unsigned hg_smem_u32(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

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

#define HT_STAGES 3
#define HT_STAGE (2 * 128 * 64 * 2)   // an A and a B tile: 32 KiB

// A CUtensorMap (128 bytes), passed by value.
struct __align__(64) HgTmap { unsigned long long v[16]; };

__device__ __forceinline__ void ht_mbar_init(unsigned bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void ht_mbar_wait(unsigned bar, unsigned phase) {
    asm volatile(
        "{\n"
        ".reg .pred P1;\n"
        "HT_WAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1;\n"
        "@P1 bra HT_DONE;\n"
        "bra HT_WAIT;\n"
        "HT_DONE:\n"
        "}\n" ::"r"(bar), "r"(phase) : "memory");
}
__device__ __forceinline__ void ht_mbar_arrive(unsigned bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void ht_mbar_expect_tx(unsigned bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// The (c0, c1) box of `map` (c0 the contiguous coordinate) into shared `dst`, completing on `bar`.
__device__ __forceinline__ void ht_tma_load(unsigned dst, const HgTmap* map, int c0, int c1, unsigned bar) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n"
                 ::"r"(dst), "l"((unsigned long long)map), "r"(c0), "r"(c1), "r"(bar) : "memory");
}
__device__ __forceinline__ void ht_consumer_sync() { asm volatile("bar.sync 1, 256;\n" ::: "memory"); }

// pre = bf16(A·Bᵀ) (no bias: the MLP keeps its pre-activation without it) and
// act = bf16(gelu(pre + bias)) from the rounded pre, as matmul_forward's GEMM followed by
// gelu_fwd_bias_v8 computes them. tmA: A (M×K, box 64×128), tmB: B (N×K, box 64×128), both bf16
// with the 128-byte swizzle (`tensor_map_k_major`); bias: N bf16 values or null. Grid
// (N / 128, ceil(M / 128)), 288 threads, HT_STAGES·32 KiB + 1 KiB alignment slack + 64 bytes of
// barriers of dynamic shared memory.
extern "C" __global__ void __launch_bounds__(288, 2) gemm_gelu_fwd_tma(bf16* __restrict__ act, bf16* __restrict__ pre, const __grid_constant__ HgTmap tmA, const __grid_constant__ HgTmap tmB, const bf16* __restrict__ bias, int M, int N, int K) {
    extern __shared__ unsigned char ht_raw[];
    const unsigned raw = hg_smem_u32(ht_raw);
    const unsigned ring = (raw + 1023u) & ~1023u;
    unsigned char* base = ht_raw + (ring - raw);
    const unsigned bars = ring + HT_STAGES * HT_STAGE;  // full[s] at bars + 8s, empty[s] after
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    if (tid == 0) {
        #pragma unroll
        for (int s = 0; s < HT_STAGES; s++) {
            ht_mbar_init(bars + 8 * s, 1);
            ht_mbar_init(bars + 8 * (HT_STAGES + s), 8);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    const int m0 = blockIdx.y * 128, n0 = blockIdx.x * HG_BN, kt_n = K / HG_BK;
    if (warp == 8) {
        if (lane == 0) {
            for (int kt = 0; kt < kt_n; kt++) {
                const int s = kt % HT_STAGES;
                if (kt >= HT_STAGES) ht_mbar_wait(bars + 8 * (HT_STAGES + s), ((kt / HT_STAGES) + 1) & 1);
                const unsigned full = bars + 8 * s, st = ring + s * HT_STAGE;
                ht_mbar_expect_tx(full, HT_STAGE);
                ht_tma_load(st, &tmA, kt * HG_BK, m0, full);
                ht_tma_load(st + HT_STAGE / 2, &tmB, kt * HG_BK, n0, full);
            }
        }
        return;
    }
    const int wg = warp >> 2;
    float acc[64];
    #pragma unroll
    for (int i = 0; i < 64; i++) acc[i] = 0.f;
    for (int kt = 0; kt < kt_n; kt++) {
        const int s = kt % HT_STAGES;
        ht_mbar_wait(bars + 8 * s, (kt / HT_STAGES) & 1);
        const unsigned sa = ring + s * HT_STAGE;
        const unsigned long long da = hg_desc(sa + wg * 64 * 128), db = hg_desc(sa + HT_STAGE / 2);
        asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
        #pragma unroll
        for (int kk = 0; kk < HG_BK / 16; kk++) wgmma_m64n128k16(acc, da + 2 * kk, db + 2 * kk);
        asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
        asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
        // this warpgroup's wgmma on tile kt − 1 are complete: release that stage
        if (kt > 0 && lane == 0) ht_mbar_arrive(bars + 8 * (HT_STAGES + (kt - 1) % HT_STAGES));
    }
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    ht_consumer_sync();  // both warpgroups are done with the ring: reuse it for staging

    const int r0 = wg * 64 + (warp & 3) * 16 + (lane >> 2), cq = 2 * (lane & 3);
    bf16* spre = (bf16*)base;
    bf16* sact = spre + 128 * HG_LDO;
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
            *(unsigned*)(sact + r * HG_LDO + col) = f2bf2(gelu_f(p0), gelu_f(p1));
        }
    }
    ht_consumer_sync();
    #pragma unroll
    for (int i = 0; i < 8; i++) {
        const int idx = tid + i * 256;  // 128 rows × 16 chunks
        const int r = idx >> 4, c = (idx & 15) * 8;
        const int gm = m0 + r;
        if (gm < M) {
            const i64 g = (i64)gm * N + n0 + c;
            *(uint4*)(pre + g) = *(const uint4*)(spre + r * HG_LDO + c);
            *(uint4*)(act + g) = *(const uint4*)(sact + r * HG_LDO + c);
        }
    }
}
