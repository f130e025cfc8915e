// Hopper (sm_90a) building blocks shared by the wgmma kernel modules (hopper.cu and the
// long-sequence attention modules): shared-memory matrix descriptors, the wgmma shapes the
// kernels use, mbarriers, TMA copies and the 128-byte-swizzled staging of accumulators.
// compile.rs puts it after common.cuh in front of each Hopper module.

// Shared-memory matrix descriptor of a K-major tile with the 128-byte swizzle: start address,
// leading byte offset (unused by this mode: 16), stride byte offset 1024 (8 rows × 128 bytes
// between core-matrix groups), swizzle mode 1 (128 B) in bits 62–63.
__device__ __forceinline__ unsigned long long hg_desc(unsigned saddr) {
    return (unsigned long long)((saddr & 0x3FFFF) >> 4) | (1ull << 16) | ((unsigned long long)(1024 >> 4) << 32) | (1ull << 62);
}
// The same for an MN-major tile of 128 columns with the 128-byte swizzle, as two TMA boxes of
// 64 columns × 64 K rows put it: K rows of 128 bytes, 8-row groups 1024 bytes apart (stride
// byte offset), the second 64-column atom 8 KiB after the first (leading byte offset).
__device__ __forceinline__ unsigned long long hg_desc_mn128(unsigned saddr) {
    return (unsigned long long)((saddr & 0x3FFFF) >> 4) | ((unsigned long long)(8192 >> 4) << 16) | ((unsigned long long)(1024 >> 4) << 32) | (1ull << 62);
}

// The same with the 32-byte swizzle, for the 16 columns past 64 of a head of 80 (tiles of
// 32-byte rows: 16-byte chunk c of row r at c ^ ((r / 4) % 2), 256-byte aligned), in either
// layout: 8-row groups 256 bytes apart (stride byte offset), swizzle mode 3 (32 B). K-major,
// one 16-deep K step spans the row; MN-major, the 16 columns are one swizzle atom, so the
// leading byte offset (the next atom) is never used.
__device__ __forceinline__ unsigned long long hg_desc32(unsigned saddr) {
    return (unsigned long long)((saddr & 0x3FFFF) >> 4) | (1ull << 16) | ((unsigned long long)(256 >> 4) << 32) | (3ull << 62);
}

// d (8 of the warpgroup's 64×16 f32 tile) += A(64×16)·B(16×16)ᵀ, both K-major in shared memory
// (ACC = 0: d is overwritten).
template <int ACC = 1>
__device__ __forceinline__ void wgmma_m64n16k16_ss(float (&d)[8], unsigned long long da, unsigned long long db) {
    asm volatile(
        "{\n"
        "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, %10, 1, 1, 0, 0;\n"
        "}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
        : "l"(da), "l"(db), "n"(ACC));
}

// d (8 of the warpgroup's 64×16 f32 tile) += A(64×16, registers as wgmma_m64n64k16_rs)·B(16×16)
// from an MN-major shared-memory descriptor: P·V for the 16 columns past 64 of a head of 80.
__device__ __forceinline__ void wgmma_m64n16k16_rs(float (&d)[8], const unsigned (&a)[4], unsigned long long db) {
    asm volatile(
        "{\n"
        "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, %12, 1, 1, 1, 1;\n"
        "}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}

// d (this thread's 64 of the warpgroup's 64×128 f32 tile) += A(64×16)·B(128×16)ᵀ from the
// shared-memory descriptors (accumulate, no negation; A K-major, B K-major or, with TB = 1,
// MN-major: B's 128 columns contiguous in two 64-column swizzle atoms).
template <int TB = 0>
__device__ __forceinline__ void wgmma_m64n128k16(float (&d)[64], unsigned long long da, unsigned long long db) {
    asm volatile(
        "{\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
        "%64, %65, 1, 1, 1, 0, %66;\n"
        "}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(da), "l"(db), "n"(TB));
}

// d (this thread's 104 of the warpgroup's 64×208 f32 tile) += A(64×16)·B(208×16)ᵀ, both from
// shared-memory descriptors (K-major): the attention scores of 64 queries against 208 keys.
__device__ __forceinline__ void wgmma_m64n208k16(float (&d)[104], unsigned long long da, unsigned long long db) {
    asm volatile(
        "{\n"
        "wgmma.mma_async.sync.aligned.m64n208k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103}, "
        "%104, %105, 1, 1, 1, 0, 0;\n"
        "}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103])
        : "l"(da), "l"(db));
}

// d (32 of the warpgroup's 64×64 f32 tile) += A(64×16, registers: a[0..3] in mma.m16n8k16's A
// layout per warp)·B(16×64) from an MN-major shared-memory descriptor (B's rows of 64 values
// contiguous, the transposed mode): P·V with V's key rows as they are stored.
__device__ __forceinline__ void wgmma_m64n64k16_rs(float (&d)[32], const unsigned (&a)[4], unsigned long long db) {
    asm volatile(
        "{\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
        "{%32, %33, %34, %35}, %36, 1, 1, 1, 1;\n"
        "}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}

// d (16 of the warpgroup's 64×32 f32 tile) += A(64×16)·B(32×16)ᵀ, both K-major in shared memory:
// the backward's Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ for 64 keys against a step of 32 queries.
__device__ __forceinline__ void wgmma_m64n32k16(float (&d)[16], unsigned long long da, unsigned long long db) {
    asm volatile(
        "{\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
        "%16, %17, 1, 1, 1, 0, 0;\n"
        "}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "l"(da), "l"(db));
}

// d (32 of the warpgroup's 64×64 f32 tile) += A(64×16)·B(16×64), both MN-major in shared memory
// (the transposed modes: A's 64 rows and B's 64 columns contiguous): the backward's dQ = dS·K
// from the staged dSᵀ and K as stored.
__device__ __forceinline__ void wgmma_m64n64k16_tt(float (&d)[32], unsigned long long da, unsigned long long db) {
    asm volatile(
        "{\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
        "%32, %33, 1, 1, 1, 1, 1;\n"
        "}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(da), "l"(db));
}

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

// The same copy into shared `dst` of every block of the cluster in `mask` (bit i: block rank
// i), each completing on its own mbarrier at offset `bar`.
__device__ __forceinline__ void ht_tma_load_mc(unsigned dst, const HgTmap* map, int c0, int c1, unsigned bar, unsigned short mask) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1, {%2, %3}], [%4], %5;\n"
                 ::"r"(dst), "l"((unsigned long long)map), "r"(c0), "r"(c1), "r"(bar), "h"(mask) : "memory");
}

// Cluster geometry: the number of blocks in this block's cluster (1 when launched without one)
// and this block's rank in it.
__device__ __forceinline__ unsigned ht_cluster_size() {
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_nctarank;\n" : "=r"(r));
    return r;
}
__device__ __forceinline__ unsigned ht_cluster_rank() {
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
    return r;
}

// An arrival on the mbarrier at offset `bar` in the shared memory of cluster block `rank`, with
// the default (CTA-scope release) semantics: it only tells a producer that this warp's reads of
// a ring slot are complete, and the multiplying warps issue one per K step.
__device__ __forceinline__ void ht_mbar_arrive_remote(unsigned bar, unsigned rank) {
    asm volatile(
        "{\n"
        ".reg .b32 ra;\n"
        "mapa.shared::cluster.u32 ra, %0, %1;\n"
        "mbarrier.arrive.shared::cluster.b64 _, [ra];\n"
        "}\n" ::"r"(bar), "r"(rank) : "memory");
}

// Every thread of every block in the cluster meets here (all threads must reach it; the warps
// need not be converged).
__device__ __forceinline__ void ht_cluster_sync() {
    asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;\n" ::: "memory");
}

// A warpgroup's 64×16 f32 accumulator of a head's columns 64…79 (value 4j + e: row r0 for
// e < 2, r0 + 8 below, column 64 + 8j + 2t + e % 2) as bf16 at `row0` (column 64 of row 0),
// rows `rstride` elements apart, row r0 times s0 and row r0 + 8 times s1; rows ≥ n are not
// stored.
__device__ __forceinline__ void wg_store_cols16(bf16* row0, const float (&acc)[8], int r0, int n, int t, i64 rstride, float s0, float s1) {
    #pragma unroll
    for (int j = 0; j < 2; j++) {
        if (r0 < n) *(unsigned*)(row0 + (i64)r0 * rstride + 8 * j + 2 * t) = f2bf2(acc[4 * j] * s0, acc[4 * j + 1] * s0);
        if (r0 + 8 < n) *(unsigned*)(row0 + (i64)(r0 + 8) * rstride + 8 * j + 2 * t) = f2bf2(acc[4 * j + 2] * s1, acc[4 * j + 3] * s1);
    }
}

// Byte offset of 16-byte chunk c of row r in a tile of 128-byte rows with the 128-byte swizzle.
__device__ __forceinline__ unsigned sw128(int r, int c) { return r * 128 + ((c ^ (r & 7)) << 4); }

// The box at (c0, c1, c2) of a 3-D `map` into shared `dst`, completing on `bar`.
__device__ __forceinline__ void ht_tma_load3(unsigned dst, const HgTmap* map, int c0, int c1, int c2, unsigned bar) {
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n"
                 ::"r"(dst), "l"((unsigned long long)map), "r"(c0), "r"(c1), "r"(c2), "r"(bar) : "memory");
}
// Shared `src` to the box at (c0, c1, c2) of a 3-D `map` (elements outside the tensor are not
// written), in the thread's current bulk group.
__device__ __forceinline__ void ht_tma_store3(const HgTmap* map, int c0, int c1, int c2, unsigned src) {
    asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%1, %2, %3}], [%4];\n"
                 ::"l"((unsigned long long)map), "r"(c0), "r"(c1), "r"(c2), "r"(src) : "memory");
}
// Four 8×8 b16 matrices from mma fragments (lane l: row l / 4, columns 2(l % 4)…) into shared
// memory; lanes 8i…8i + 7 give the row addresses of matrix i.
__device__ __forceinline__ void stsm_x4(unsigned addr, unsigned r0, unsigned r1, unsigned r2, unsigned r3) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r0), "r"(r1), "r"(r2), "r"(r3) : "memory");
}
// A warpgroup's 64×64 f32 accumulator as bf16 into a 128-byte-swizzled tile of 64 rows at
// `tile` (1024-byte aligned), by stmatrix: warp wi's rows 16wi + g times m0, rows 16wi + g + 8
// times m1.
__device__ __forceinline__ void wg_stage_tile(unsigned tile, const float (&acc)[32], float m0, float m1, int wi, int lane) {
    const int mi = lane >> 3, row = wi * 16 + (mi & 1) * 8 + (lane & 7);
    #pragma unroll
    for (int j = 0; j < 8; j += 2)
        stsm_x4(tile + sw128(row, j + (mi >> 1)),
                f2bf2(acc[4 * j] * m0, acc[4 * j + 1] * m0), f2bf2(acc[4 * j + 2] * m1, acc[4 * j + 3] * m1),
                f2bf2(acc[4 * j + 4] * m0, acc[4 * j + 5] * m0), f2bf2(acc[4 * j + 6] * m1, acc[4 * j + 7] * m1));
}
