// Weight gradients on wgmma (sm_90a; hopper.cuh in front): `gemm_wgrad_tt`, dW(OC × IC, f32,
// row-major) += doutᵀ·inp over the R rows of dout (R × OC) and inp (R × IC), both bf16 as
// stored. Neither operand is K-major here (K is R, the rows), so both are read MN-major: the
// 128 dW rows of a tile are dout's columns o0…, its 256 dW columns inp's columns i0….
//
// Why a kernel of our own: with K the token count (16 448 in ViT-H/14 at micro 64) and few
// output tiles (fc1's 5120 × 1280 is 200 tiles of 128 × 256 on 132 SMs), a product that gives
// each tile to one block runs its last wave half empty. Here the K range of every tile is cut
// into S chunks, and the S·T (chunk, tile) units are dealt to persistent blocks in
// chunk-major order, so blocks running at once read the same rows of dout and inp (L2), and
// S is chosen on the host to even out the blocks' work (`wgrad_splits`). Each unit adds its
// partial tile into dW with f32 reductions (red.global.add.v2): no workspace, and dW
// accumulates as the backward's weight gradients do (beta = 1). The order of the additions
// is not fixed, as with the attention backward's dQ.
//
// 288 threads: warpgroups 0 and 1 multiply (64 dW rows each, one m64n256k16 per 16-deep K step
// into a 128-value accumulator), warp 8's lane 0 produces (TMA copies of dout's 128 × 64 and
// inp's 256 × 64 boxes per K step of 64 rows, in 64-column boxes with the 128-byte swizzle,
// into a 4-stage ring of 48 KiB). With a producer warp rather than a warpgroup, the launch
// bound leaves 224 registers a thread without setmaxnreg. The multiplying warps reduce their
// partial tile into dW themselves: the reduction is short beside a unit's K range, and the
// producer fills the ring for the next unit meanwhile. mbarriers: full[s] (stage s's copies
// landed), empty[s] (the 8 multiplying warps are done with it).
//
// With a bias (dbias not null), the units of the first column tile also add dbias[o] += Σ_r
// dout[r][o]: one more m64n8k16 per 16-deep K step, A the same dout tile and B eight columns of
// ones (a 1 KiB tile of ones in shared memory, the same for every step), so the column sums
// ride along on operands already in shared memory instead of a pass that reads dout again.
//
// Requires OC and IC multiples of 64 and 16-byte aligned operands and dW; R is free (the
// tensor maps read rows ≥ R as zeros), and dW rows ≥ OC and columns ≥ IC of an edge tile are
// not added.

#define WGR_STAGES 4
#define WGR_A (128 * 64 * 2)              // dout's 128 columns × 64 rows: 16 KiB
#define WGR_STAGE (WGR_A + 256 * 64 * 2)  // and inp's 256 columns: 48 KiB
#define WGR_ONES 1024                     // a 1 KiB tile of bf16 ones (the bias sums' B)
// dynamic shared memory: the ring, the ones, 8 barriers, 1 KiB of alignment slack
#define WGR_SMEM (WGR_STAGES * WGR_STAGE + WGR_ONES + 64 + 1024)

// d (this thread's 128 of the warpgroup's 64×256 f32 tile) += A(64×16)·B(16×256), both
// MN-major in shared memory (A's 64 rows contiguous in one 128-byte swizzle atom, B's 256
// columns in four atoms `hg_desc_mn128` spaces 8 KiB apart).
__device__ __forceinline__ void wgmma_m64n256k16_tt(float (&d)[128], unsigned long long da, unsigned long long db) {
    asm volatile(
        "{\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "
        "%128, %129, 1, 1, 1, 1, 1;\n"
        "}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
        : "l"(da), "l"(db));
}

// d (4 of the warpgroup's 64×8 f32 tile: value e is row g + 8(e / 2), column 2t + e % 2) +=
// A(64×16, MN-major as above)·B(8×16)ᵀ with B K-major: the bias sums against a tile of ones.
__device__ __forceinline__ void wgmma_m64n8k16_tn(float (&d)[4], unsigned long long da, unsigned long long db) {
    asm volatile(
        "{\n"
        "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3}, %4, %5, 1, 1, 1, 1, 0;\n"
        "}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "l"(da), "l"(db));
}

// The multiplying warpgroup's K steps [kb, ke) of one unit into acc, with BIAS also dout's
// column sums into bsum; s, ph: the next ring slot and its full-barrier parity.
template <bool BIAS>
__device__ __forceinline__ void wgr_steps(float (&acc)[128], float (&bsum)[4], int kb, int ke, unsigned& s, unsigned& ph, unsigned long long da0, unsigned long long db0, unsigned long long dones, unsigned full0, unsigned empty0, int lane) {
    unsigned prev = 0;
    for (int kt = kb; kt < ke; kt++) {
        ht_mbar_wait(full0 + 8 * s, ph);
        const unsigned long long off = (unsigned long long)(s * (WGR_STAGE >> 4));
        asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
        #pragma unroll
        for (int kk = 0; kk < 4; kk++) {
            wgmma_m64n256k16_tt(acc, da0 + off + (2048 >> 4) * kk, db0 + off + (2048 >> 4) * kk);
            if (BIAS) wgmma_m64n8k16_tn(bsum, da0 + off + (2048 >> 4) * kk, dones);
        }
        asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
        asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
        // this warpgroup's products of the previous slot are complete: release it
        if (kt > kb && lane == 0) ht_mbar_arrive(empty0 + 8 * prev);
        prev = s;
        if (++s == WGR_STAGES) { s = 0; ph ^= 1; }
    }
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    if (lane == 0) ht_mbar_arrive(empty0 + 8 * prev);
}

// Grid ≤ the SM count (each block walks units blockIdx.x, + gridDim.x, …), 288 threads,
// WGR_SMEM bytes of dynamic shared memory. tm_dout: dout as (R rows × OC columns), tm_inp:
// inp as (R × IC), both in boxes of 64 columns × 64 rows (`tensor_map_2d`). kt_n = ceil(R /
// 64) K steps, split into `splits` chunks (1 ≤ splits ≤ kt_n). dbias: OC f32 values or null.
extern "C" __global__ void __launch_bounds__(288, 1) gemm_wgrad_tt(float* __restrict__ dw, float* __restrict__ dbias, const __grid_constant__ HgTmap tm_dout, const __grid_constant__ HgTmap tm_inp, int oc, int ic, int kt_n, int splits) {
    extern __shared__ unsigned char wgr_raw[];
    const unsigned raw = smem_u32(wgr_raw);
    const unsigned ring = (raw + 1023u) & ~1023u;
    const unsigned ones = ring + WGR_STAGES * WGR_STAGE, full0 = ones + WGR_ONES, empty0 = full0 + 8 * WGR_STAGES;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    if (dbias) {
        for (int i = tid; i < WGR_ONES / 4; i += blockDim.x) asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(ones + 4 * i), "r"(f2bf2(1.f, 1.f)) : "memory");
        // (generic-proxy stores that wgmma reads through the async proxy)
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    }
    if (tid == 0) {
        #pragma unroll
        for (int s = 0; s < WGR_STAGES; s++) {
            ht_mbar_init(full0 + 8 * s, 1);
            ht_mbar_init(empty0 + 8 * s, 8);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    const int tn = (ic + 255) / 256, tiles = ((oc + 127) / 128) * tn, units = tiles * splits;
    // unit u: chunk u / tiles of tile u % tiles (row-tile major); chunk c covers K steps
    // [c·kt_n / S, (c + 1)·kt_n / S)
    auto unit = [&](int u, int& m0, int& n0, int& kb, int& ke) {
        const int c = u / tiles, t = u % tiles;
        m0 = (t / tn) * 128;
        n0 = (t % tn) * 256;
        kb = (int)((i64)c * kt_n / splits);
        ke = (int)((i64)(c + 1) * kt_n / splits);
    };
    if (warp == 8) {
        if (lane == 0) {
            int g = 0;  // K steps produced so far
            for (int u = blockIdx.x; u < units; u += gridDim.x) {
                int m0, n0, kb, ke;
                unit(u, m0, n0, kb, ke);
                for (int kt = kb; kt < ke; kt++, g++) {
                    const int s = g % WGR_STAGES;
                    const unsigned full = full0 + 8 * s, st = ring + s * WGR_STAGE;
                    if (g >= WGR_STAGES) ht_mbar_wait(empty0 + 8 * s, ((g / WGR_STAGES) + 1) & 1);
                    ht_mbar_expect_tx(full, WGR_STAGE);
                    #pragma unroll
                    for (int a = 0; a < 2; a++) ht_tma_load(st + 8192 * a, &tm_dout, m0 + 64 * a, kt * 64, full);
                    #pragma unroll
                    for (int a = 0; a < 4; a++) ht_tma_load(st + WGR_A + 8192 * a, &tm_inp, n0 + 64 * a, kt * 64, full);
                }
            }
        }
        return;
    }
    // (through a shuffle, so that the compiler knows it is warp-uniform: see hopper.cu)
    const int wg = __shfl_sync(0xffffffffu, warp >> 2, 0);
    // warpgroup wg's A: the 64-column box wg of dout's tile; 16-deep K steps are two 1024-byte
    // 8-row groups apart in both operands
    const unsigned long long da0 = hg_desc(ring + 8192 * wg), db0 = hg_desc_mn128(ring + WGR_A);
    const unsigned long long dones = hg_desc(ones);
    unsigned s = 0, ph = 0;
    for (int u = blockIdx.x; u < units; u += gridDim.x) {
        int m0, n0, kb, ke;
        unit(u, m0, n0, kb, ke);
        float acc[128], bsum[4] = {0.f, 0.f, 0.f, 0.f};
        #pragma unroll
        for (int k = 0; k < 128; k++) acc[k] = 0.f;
        const bool with_bias = dbias && n0 == 0;  // (warp-uniform)
        if (with_bias) wgr_steps<true>(acc, bsum, kb, ke, s, ph, da0, db0, dones, full0, empty0, lane);
        else wgr_steps<false>(acc, bsum, kb, ke, s, ph, da0, db0, dones, full0, empty0, lane);
        // (pairs as the accumulator holds them: gathering four columns a thread through
        // shuffles made ptxas serialize the wgmmas)
        const int jn = min(32, (ic - n0) / 8);
        const int r = m0 + 64 * wg + 16 * (warp & 3) + (lane >> 2);
        float* p = dw + (i64)r * ic + n0 + 2 * (lane & 3);
        #pragma unroll
        for (int j = 0; j < 32; j++) {
            if (j < jn && r < oc) asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(p + 8 * j), "f"(acc[4 * j]), "f"(acc[4 * j + 1]) : "memory");
            if (j < jn && r + 8 < oc) asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(p + 8 * ic + 8 * j), "f"(acc[4 * j + 2]), "f"(acc[4 * j + 3]) : "memory");
        }
        // every column of bsum holds the sums: column 0 (t = 0) goes out
        if (with_bias && (lane & 3) == 0) {
            if (r < oc) atomicAdd(dbias + r, bsum[0]);
            if (r + 8 < oc) atomicAdd(dbias + r + 8, bsum[2]);
        }
    }
}
