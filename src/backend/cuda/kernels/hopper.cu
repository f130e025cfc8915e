// Hopper (sm_90a) GEMMs on the warpgroup tensor-core instructions (wgmma) with the MLP's erf
// GELU in the epilogue — the fusions cuBLASLt cannot express (its GELU epilogues are the tanh
// approximation; timm's nn.GELU is erf):
// - mode 0, fc1's forward: pre = A·Bᵀ and act = gelu(pre + bias) in one kernel instead of
//   cuBLASLt's product and a GELU pass; with GRAD (`gemm_gelu_fwd_grad_ws`) it saves
//   g = gelu'(pre + bias) instead of pre (GeluSaved::Grad);
// - mode 1, fc2's input gradient: dpre = (dact = dout·W2) ⊙ gelu'(pre + bias) — or ⊙ g, read as
//   saved, with GRAD (`gemm_dgelu_mul_ws`) — and the column partial sums of dpre (fc1's bias
//   gradient) instead of cuBLASLt's product and the GELU-backward pass (B = W2 as stored: an
//   MN-major operand, N contiguous). Evaluating the erf derivative here cost 0.53 ms of mode
//   1's 1.68 ms per CIFAR step (its epilogue set the pace: the multiplying warps waited for the
//   staging buffer); evaluated by mode 0 beside the GELU it costs ≈ 0.06 ms there;
// and ViT-B/16's attention (197 tokens: `flash_fwd_wg_d64`, `flash_bwd_wg_d64`, at the end;
// VITSCALE_WGMMA_ATTENTION=0 turns them off).
// Both are the default on sm_90 (VITSCALE_FUSED_GEMM=fwd keeps mode 0 only, =0 neither), with
// 128×256 tiles where N % 256 == 0 (the `_w` kernels, WIDE below; VITSCALE_WIDE_GEMM; launched
// in clusters of two under VITSCALE_GEMM_CLUSTER, see hw_gemm). With
// trivial epilogues the 128×128 main loop ran ≈ 30 % slower than cuBLASLt's product of the
// same shape. BENCHMARKS.md has the measurements.
//
// C(M×N) = A(M×K) · B(N×K)ᵀ, A row-major with K contiguous ("K-major"), B the same in mode 0
// and stored K × N with N contiguous ("MN-major", W2 as it is) in mode 1. Persistent:
// one block per SM walks the 128×128 output tiles (row-tile major, so neighbouring blocks share
// A rows in L2). Warps 0–7 (two warpgroups, 64 rows each, one m64n128k16 wgmma per 16-wide K
// step) only multiply: they hand the rounded tile to one of two shared-memory staging buffers
// and go on with the next tile. Warps 8–15 (two warpgroups; one, warps 8–11, in the wide mode-1
// kernels) run the epilogue — the erf arithmetic needs warps of its own to overlap the tensor
// cores — and the next warp's lane 0 produces: TMA copies of each 128×64 A and B tile (B
// 256×64 in the wide kernels) into a 4-stage ring (3 wide), with the 128-byte swizzle the wgmma descriptors name (16-byte chunk c of tile row r at chunk c ^ (r % 8),
// stages 1024-byte aligned). mbarriers: full[s] (the copies' byte count landed), empty[s] (the
// 8 multiplying warps are done with stage s), stg_full[b] (the 256 multiplying threads wrote
// staging buffer b), stg_empty[b] (the epilogue threads read it). Requires N % 128 == 0,
// K % 64 == 0, 16-byte aligned rows and bias; M is free (the tensor maps read rows past M as
// zeros; they are not stored).

#define HG_BN 128
#define HG_BK 64
#define HG_LDO (HG_BN + 8)                 // staging row stride (bf16)
#define HW_STAGES 4
#define HW_STAGE (2 * 128 * 64 * 2)        // an A and a B tile: 32 KiB
#define HW_STG (128 * HG_LDO * 2)          // one staged 128×128 bf16 tile
// dynamic shared memory: the ring, two staging tiles, two sets of 8 warps × 128 column sums (mode 1),
// 12 barriers, 1 KiB of alignment slack
#define HW_SMEM (HW_STAGES * HW_STAGE + 2 * HW_STG + 2 * 8 * 128 * 4 + 96 + 1024)
// The wide form (WIDE, the `_w` kernels, N % 256 == 0): 128×256 output tiles, each multiplying
// warpgroup a 64×256 accumulator (128 f32 a thread), a 3-stage ring of 48 KiB (A
// 128×64, B 256×64), and the tile handed to the epilogue in two 128×128 halves through the same
// two staging buffers. Per K step a block then streams 48 KiB into shared memory for twice the
// products of the 32 KiB of a 128×128 tile (a quarter fewer bytes per product), and a ring slot
// covers twice the tensor-core time. Nsight Compute on the 128×128 kernels (ViT-B/16 micro 256):
// the multiplying warps spent ≈ 40 % of their samples waiting for a ring slot to fill, with L2
// 60 % busy. The multiplying warps need 168 registers (128 accumulators; at 152 ptxas spilled
// and serialized the wgmma), so the block is whole warpgroups (setmaxnreg works per warpgroup):
// the producer's (24 registers), two multiplying ones (168) and two epilogue ones of 56 (mode 0:
// 640 threads, entering with 96) or one of 152 (mode 1: 512 threads, entering with 128).
// One m64n256k16 per K step cannot be compiled: ptxas sizes each instruction by the entry
// count, so the halves are two m64n128k16.
#define HX_STAGES 3
#define HX_STAGE ((128 + 256) * 64 * 2)    // an A (128 rows) and a B (256 rows) tile: 48 KiB
#define HX_SMEM (HX_STAGES * HX_STAGE + 2 * HW_STG + 2 * 8 * 128 * 4 + 96 + 1024)
// The deep-ring form of the wide kernels (RING4, the `_w4` kernels): a 4-stage ring,
// so that two K steps are in flight while the multiplying warps work on a third (with three
// stages one is: the slot behind the one being multiplied is released only when its wgmma
// completes), as cuBLASLt's kernel of the same tile shape has. Shared memory then leaves room
// for one staging half of 128×128 bf16, unpadded, its 16-byte chunks swizzled (chunk j of row r
// at j ^ (r % 8): the multiplying warps' 4-byte stores and the epilogue's 16-byte loads meet no
// bank conflicts). One epilogue warpgroup of 152 registers copies the staged half into its
// registers at once and frees it, then does the arithmetic; the multiplying warps wait only
// for that copy between the two halves of a tile. In mode 1 there is no room left for the
// column sums in shared memory: each epilogue warp writes its own row of partial sums (four
// per 128-row tile), and it reads the saved values in two groups of eight chunks per half (the
// first while it waits for the half) instead of a half ahead (the staged half already takes 64
// of its registers).
#define HX4_STAGES 4
#define HX4_STG (128 * 128 * 2)
#define HX4_SMEM (HX4_STAGES * HX_STAGE + HX4_STG + 96 + 1024)

template <int THREADS>
__device__ __forceinline__ void hw_epi_sync() { asm volatile("bar.sync 1, %0;\n" ::"n"(THREADS) : "memory"); }

// MODE 0: out = act, aux = pre (written; gelu'(pre + bias) with GRAD). MODE 1: out = dpre,
// aux = pre (read; the saved derivative with GRAD), partial: the (ceil(M / 128) × N) f32
// column sums of dpre per row tile. bias: N bf16 values or null (not read in mode 1 with GRAD).
// RING4: the deep-ring form above (requires WIDE and EW 1); partial then has four rows per row
// tile.
template <int MODE, bool GRAD, bool WIDE = false, int EW = 2, bool RING4 = false>
__device__ __forceinline__ void hw_gemm(bf16* __restrict__ out, bf16* __restrict__ aux, float* __restrict__ partial, const HgTmap* tmA, const HgTmap* tmB, const bf16* __restrict__ bias, int M, int N, int K, unsigned char* raw_p) {
    static_assert(!RING4 || (WIDE && EW == 1), "the deep ring is the wide kernels', with one epilogue warpgroup");
    constexpr int STAGES = RING4 ? HX4_STAGES : WIDE ? HX_STAGES : HW_STAGES, STAGE = WIDE ? HX_STAGE : HW_STAGE;
    // staging buffers and (mode 1) column sums between the ring and the barriers
    constexpr int STG_AREA = RING4 ? HX4_STG : 2 * HW_STG + 2 * 8 * 128 * 4;
    constexpr int BN = WIDE ? 256 : HG_BN, HALVES = BN / 128, A_BYTES = 128 * HG_BK * 2;
    // EW epilogue warpgroups (warps 8 … 8 + 4·EW − 1), then the producer's warp(group)
    constexpr int EPI = 128 * EW, PRODUCER = 8 + 4 * EW, CH = 128 * 16 / EPI, RSTEP = EPI / 16;
    const unsigned raw = smem_u32(raw_p);
    const unsigned ring = (raw + 1023u) & ~1023u;
    unsigned char* base = raw_p + (ring - raw);
    bf16* stg_p = (bf16*)(base + STAGES * STAGE);
    float* colsum = (float*)(base + STAGES * STAGE + 2 * HW_STG);
    const unsigned bars = ring + STAGES * STAGE + STG_AREA;
    const unsigned full0 = bars, empty0 = bars + 8 * STAGES, sfull0 = bars + 16 * STAGES, sempty0 = sfull0 + 16;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    // Launched in clusters of two (the wide kernels; `hopper_gemm_shape`), the blocks of a
    // cluster take vertically neighbouring output tiles, which read the same B tile: each block
    // copies half of it and multicasts that half to both, so a block streams 32 KiB per K step
    // out of L2 instead of 48. Both producers then write every ring slot, so a slot is free
    // only once the multiplying warps of both blocks are done with it: each of them arrives on
    // the slot's empty barrier in every block of the cluster.
    const unsigned ncta = WIDE ? ht_cluster_size() : 1, crank = WIDE ? ht_cluster_rank() : 0;
    if (tid == 0) {
        #pragma unroll
        for (int s = 0; s < STAGES; s++) {
            ht_mbar_init(full0 + 8 * s, 1);
            ht_mbar_init(empty0 + 8 * s, 8 * ncta);
        }
        #pragma unroll
        for (int b = 0; b < 2; b++) {
            ht_mbar_init(sfull0 + 8 * b, 256);
            ht_mbar_init(sempty0 + 8 * b, EPI);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    // the barriers' initialization before anyone (in the cluster) uses them
    if (ncta > 1) ht_cluster_sync();
    else __syncthreads();
    // Work units (a group of ncta row tiles, a column tile), row-group major; block rank r
    // takes row tile ncta·group + r of its unit (past M in the last group when the row tiles do
    // not divide: it reads zeros, stores nothing, and still multicasts its half of B).
    const int n_tiles = N / BN, m_tiles = (M + 127) / 128, kt_n = K / HG_BK;
    const int units = ((m_tiles + (int)ncta - 1) / (int)ncta) * n_tiles, unit0 = blockIdx.x / ncta, ustep = gridDim.x / ncta;
    const int mine = units > unit0 ? (units - 1 - unit0) / ustep + 1 : 0;
    auto tile_m = [&](int i) { return ((unit0 + i * ustep) / n_tiles) * (int)ncta + (int)crank; };
    auto tile_n = [&](int i) { return (unit0 + i * ustep) % n_tiles; };
    if (warp >= PRODUCER) {
        if (WIDE) asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n" ::: "memory");
        if (warp == PRODUCER && lane == 0) {
            for (int i = 0; i < mine; i++) {
                const int m0 = tile_m(i) * 128, n0 = tile_n(i) * BN;
                for (int kt = 0; kt < kt_n; kt++) {
                    const int g = i * kt_n + kt, s = g % STAGES;
                    const unsigned full = full0 + 8 * s, st = ring + s * STAGE;
                    if (g >= STAGES) ht_mbar_wait(empty0 + 8 * s, ((g / STAGES) + 1) & 1);
                    ht_mbar_expect_tx(full, STAGE);
                    ht_tma_load(st, tmA, kt * HG_BK, m0, full);
                    if (ncta > 1) {
                        // this block's share of B (columns or rows BN / ncta · rank …), into every
                        // block of the cluster
                        const unsigned short all = (unsigned short)((1u << ncta) - 1);
                        if (MODE == 1) {
                            const int per = BN / 64 / (int)ncta;
                            for (int a = (int)crank * per; a < ((int)crank + 1) * per; a++) ht_tma_load_mc(st + A_BYTES + 8192 * a, tmB, n0 + 64 * a, kt * HG_BK, full, all);
                        } else {
                            const int rows = BN / (int)ncta;
                            ht_tma_load_mc(st + A_BYTES + (int)crank * rows * 128, tmB, kt * HG_BK, n0 + (int)crank * rows, full, all);
                        }
                    } else if (MODE == 1) {
                        // B = W2 as stored (K rows, N contiguous): 64-column boxes
                        #pragma unroll
                        for (int a = 0; a < BN / 64; a++) ht_tma_load(st + A_BYTES + 8192 * a, tmB, n0 + 64 * a, kt * HG_BK, full);
                    } else {
                        ht_tma_load(st + A_BYTES, tmB, kt * HG_BK, n0, full);
                    }
                }
            }
        }
        return;
    }
    if (warp < 8) {
        if (WIDE) asm volatile("setmaxnreg.inc.sync.aligned.u32 168;\n" ::: "memory");  // (either layout)
        // multiplying warpgroups. The warpgroup index goes through a shuffle so that the compiler
        // knows it is warp-uniform: the descriptors then live in uniform registers, and the
        // loop between two wgmma batches is a handful of instructions instead of ≈ 70 of
        // per-thread descriptor arithmetic and R2UR moves competing with the epilogue warps for
        // issue slots (Nsight Compute's source view of the previous form).
        const int wg = __shfl_sync(0xffffffffu, warp >> 2, 0);
        const int r0 = wg * 64 + (warp & 3) * 16 + (lane >> 2), cq = 2 * (lane & 3);
        // B's 16-deep K steps: 32 bytes apart K-major, two 1024-byte row groups apart MN-major
        const unsigned long long da0 = hg_desc(ring + wg * 64 * 128), db0 = MODE == 1 ? hg_desc_mn128(ring + A_BYTES) : hg_desc(ring + A_BYTES);
        constexpr unsigned DBK = MODE == 1 ? 2048 >> 4 : 2;
        // B's columns 128…255 (wide tiles): 128 K-major rows of 128 bytes further, or the third
        // 64-column atom (2 × 8 KiB) MN-major; in 16-byte units
        constexpr unsigned BHALF = (MODE == 1 ? 2 * 8192 : 128 * 128) >> 4;
        unsigned s = 0, ph = 0, prev = 0;  // ring slot of the next K tile, its full-barrier parity, the last slot
        // ring slot `slot` may be written again, as far as this warp is concerned
        auto release = [&](unsigned slot) {
            if (lane != 0) return;
            if (ncta > 1) {
                for (unsigned r = 0; r < ncta; r++) ht_mbar_arrive_remote(empty0 + 8 * slot, r);
            } else {
                ht_mbar_arrive(empty0 + 8 * slot);
            }
        };
        for (int i = 0; i < mine; i++) {
            float acc[HALVES][64];  // by 128-column half
            #pragma unroll
            for (int h = 0; h < HALVES; h++) {
                #pragma unroll
                for (int k = 0; k < 64; k++) acc[h][k] = 0.f;
            }
            for (int kt = 0; kt < kt_n; kt++) {
                ht_mbar_wait(full0 + 8 * s, ph);
                // descriptor start addresses are in 16-byte units: slot s is s · STAGE / 16 on
                const unsigned long long off = (unsigned long long)(s * (STAGE >> 4));
                asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
                #pragma unroll
                for (int kk = 0; kk < HG_BK / 16; kk++) {
                    // wide tiles: two m64n128k16 over B's column halves (see HX_STAGES)
                    #pragma unroll
                    for (int h = 0; h < HALVES; h++) wgmma_m64n128k16<MODE == 1>(acc[h], da0 + off + 2 * kk, db0 + off + DBK * kk + h * BHALF);
                }
                asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
                asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
                // this warpgroup's wgmma on the previous slot are complete: release it
                if (kt > 0) release(prev);
                prev = s;
                if (++s == STAGES) { s = 0; ph ^= 1; }
            }
            asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
            release(prev);
            // accumulator (warp w of warpgroup wg, lane l): value 4j + {0,1} is row
            // 64wg + 16w + l/4, columns 8j + 2(l % 4) + {0,1}; 4j + {2,3} the row 8 below.
            // Staged in 128-column halves q = HALVES·i + h, alternating between the buffers.
            #pragma unroll
            for (int h = 0; h < HALVES; h++) {
                const int q = HALVES * i + h;
                if (RING4) {
                    // the one staging half: free once the epilogue has copied half q − 1
                    if (q >= 1) ht_mbar_wait(sempty0, (q + 1) & 1);
                    unsigned char* sp = (unsigned char*)stg_p;
                    // rows r0 and r0 + 8 have the same r % 8 = lane / 4
                    const int sw = lane >> 2;
                    #pragma unroll
                    for (int j = 0; j < 16; j++) {
                        const int at = ((j ^ sw) << 4) + 2 * cq;
                        *(unsigned*)(sp + r0 * 256 + at) = f2bf2(acc[h][4 * j], acc[h][4 * j + 1]);
                        *(unsigned*)(sp + (r0 + 8) * 256 + at) = f2bf2(acc[h][4 * j + 2], acc[h][4 * j + 3]);
                    }
                    ht_mbar_arrive(sfull0);
                    continue;
                }
                const int b = q & 1;
                if (q >= 2) ht_mbar_wait(sempty0 + 8 * b, ((q >> 1) + 1) & 1);
                bf16* sp = stg_p + b * (HW_STG / 2);
                #pragma unroll
                for (int j = 0; j < 16; j++) {
                    const int col = 8 * j + cq;
                    *(unsigned*)(sp + r0 * HG_LDO + col) = f2bf2(acc[h][4 * j], acc[h][4 * j + 1]);
                    *(unsigned*)(sp + (r0 + 8) * HG_LDO + col) = f2bf2(acc[h][4 * j + 2], acc[h][4 * j + 3]);
                }
                ht_mbar_arrive(sfull0 + 8 * b);
            }
        }
        return;
    }
    // 640 threads (two epilogue warpgroups) enter with 96 registers, 512 (one) with 128
    if (WIDE && EW == 2) asm volatile("setmaxnreg.dec.sync.aligned.u32 56;\n" ::: "memory");
    if (WIDE && EW == 1) asm volatile("setmaxnreg.inc.sync.aligned.u32 152;\n" ::: "memory");
    // epilogue warpgroups: thread e handles 16-byte chunks e, e + EPI, … of the 128 × 16 chunk
    // tile: always columns c = (e % 16)·8 … + 7, rows e / 16 + RSTEP·k, k < CH
    const int e = tid - 256, c = (e & 15) * 8;
    // Mode 1 reads pre (or the saved derivative) one staged half tile ahead: chunk k of half
    // q + 1 is loaded into pv[k] as soon as half q's chunk k has been used, so every load has the
    // rest of the half's arithmetic to arrive (with the loads issued where they are used, two in
    // flight per thread, the epilogue waited on memory most of the time). q counts 128-column
    // halves of tiles: q / HALVES is the tile, q % HALVES the half. (With two 56-register
    // epilogue warpgroups a whole half of reads spilled, and half of one was slower than the
    // 128×128 kernel: so the wide mode-1 kernels have one epilogue warpgroup of 152.)
    const int halves = HALVES * mine;
    uint4 pv[RING4 ? 8 : CH];
    auto pre_chunk = [&](int q, int k) {
        const int gm = tile_m(q / HALVES) * 128 + (e >> 4) + RSTEP * k, n0 = tile_n(q / HALVES) * BN + (q % HALVES) * 128;
        return q < halves && gm < M ? __ldcs((const uint4*)(aux + (i64)gm * N + n0 + c)) : make_uint4(0u, 0u, 0u, 0u);
    };
    if (MODE == 1 && !RING4) {
        #pragma unroll
        for (int k = 0; k < CH; k++) pv[k] = pre_chunk(0, k);
    }
    // The bias chunk of the next tile is loaded a tile ahead as well: loaded after the wait for
    // the staged tile, its latency stood between every tile and its arithmetic (Nsight Compute:
    // the epilogue's largest stall, and in mode 1 the multiplying warps then waited for the
    // staging buffer).
    auto load_bias = [&](int q) {
        const int n0 = tile_n(q / HALVES) * BN + (q % HALVES) * 128;
        return bias && q < halves ? *(const uint4*)(bias + n0 + c) : make_uint4(0u, 0u, 0u, 0u);
    };
    uint4 bw = load_bias(0);
    for (int q = 0; q < halves; q++) {
        const int mt = tile_m(q / HALVES), m0 = mt * 128, n0 = tile_n(q / HALVES) * BN + (q % HALVES) * 128;
        const int b = RING4 ? 0 : q & 1;
        const uint4 bn = load_bias(q + 1);
        if (MODE == 1 && RING4) {
            // the first eight chunks of saved values, in flight while the half is staged
            #pragma unroll
            for (int j = 0; j < 8; j++) pv[j] = pre_chunk(q, j);
        }
        ht_mbar_wait(sfull0 + 8 * b, RING4 ? q & 1 : (q >> 1) & 1);
        const bf16* sp = stg_p + b * (HW_STG / 2);
        // RING4: the staged half into registers, and the buffer back to the multiplying warps
        uint4 held[RING4 ? CH : 1];
        if (RING4) {
            #pragma unroll
            for (int k = 0; k < CH; k++) {
                const int r = (e >> 4) + RSTEP * k;
                held[k] = *(const uint4*)((const unsigned char*)stg_p + r * 256 + (((e & 15) ^ (r & 7)) << 4));
            }
            ht_mbar_arrive(sempty0);
        }
        float cs[8];
        #pragma unroll
        for (int k = 0; k < 8; k++) cs[k] = 0.f;
        #pragma unroll
        for (int k = 0; k < CH; k++) {
            const int r = (e >> 4) + RSTEP * k;
            const uint4 v = RING4 ? held[k] : *(const uint4*)(sp + r * HG_LDO + c);
            uint4 p = make_uint4(0u, 0u, 0u, 0u);
            if (MODE == 1 && RING4) {
                if (k == 8) {
                    #pragma unroll
                    for (int j = 0; j < 8; j++) pv[j] = pre_chunk(q, 8 + j);
                }
                p = pv[k & 7];
            } else if (MODE == 1) {
                p = pv[k];
                pv[k] = pre_chunk(q + 1, k);
            }
            const int gm = m0 + r;
            if (gm < M) {
                const i64 g = (i64)gm * N + n0 + c;
                if (MODE == 0 && GRAD) {
                    uint4 gr;
                    *(uint4*)(out + g) = make_uint4(gelu_and_grad_w(v.x, bw.x, &gr.x), gelu_and_grad_w(v.y, bw.y, &gr.y), gelu_and_grad_w(v.z, bw.z, &gr.z), gelu_and_grad_w(v.w, bw.w, &gr.w));
                    *(uint4*)(aux + g) = gr;
                } else if (MODE == 0) {
                    *(uint4*)(aux + g) = v;
                    *(uint4*)(out + g) = make_uint4(gelu_bias_w(v.x, bw.x), gelu_bias_w(v.y, bw.y), gelu_bias_w(v.z, bw.z), gelu_bias_w(v.w, bw.w));
                } else {
                    const uint4 d = GRAD ? make_uint4(mul_w(v.x, p.x), mul_w(v.y, p.y), mul_w(v.z, p.z), mul_w(v.w, p.w))
                                         : make_uint4(dgelu_bias_w(v.x, p.x, bw.x), dgelu_bias_w(v.y, p.y, bw.y), dgelu_bias_w(v.z, p.z, bw.z), dgelu_bias_w(v.w, p.w, bw.w));
                    *(uint4*)(out + g) = d;
                    const unsigned dw[4] = {d.x, d.y, d.z, d.w};
                    #pragma unroll
                    for (int q = 0; q < 4; q++) {
                        cs[2 * q] += lo16(dw[q]);
                        cs[2 * q + 1] += hi16(dw[q]);
                    }
                }
            }
        }
        if (!RING4) ht_mbar_arrive(sempty0 + 8 * b);  // the staged tile has been read
        bw = bn;
        if (MODE == 1 && RING4) {
            // column sums: lanes l and l ^ 16 share columns; each warp's 128 go to its own row
            // of partial
            #pragma unroll
            for (int k = 0; k < 8; k++) cs[k] += __shfl_xor_sync(0xffffffffu, cs[k], 16);
            if ((lane & 16) == 0 && mt < m_tiles) {
                float* row = partial + ((i64)mt * 4 + (e >> 5)) * N + n0 + c;
                *(float4*)row = make_float4(cs[0], cs[1], cs[2], cs[3]);
                *(float4*)(row + 4) = make_float4(cs[4], cs[5], cs[6], cs[7]);
            }
        } else if (MODE == 1) {
            // column sums: lanes l and l ^ 16 share columns, then the 8 warps through shared
            // memory, in a fixed order (deterministic). The two sets alternate by tile, so one
            // barrier per tile suffices: a set is rewritten two tiles later, after every thread
            // has passed the next tile's barrier and so finished reading it.
            #pragma unroll
            for (int k = 0; k < 8; k++) cs[k] += __shfl_xor_sync(0xffffffffu, cs[k], 16);
            float* set = colsum + b * 8 * 128;
            const int ew = e >> 5;
            if ((lane & 16) == 0) {
                #pragma unroll
                for (int k = 0; k < 8; k++) set[ew * 128 + c + k] = cs[k];
            }
            hw_epi_sync<EPI>();
            if (e < 128 && mt < m_tiles) {
                float s = 0.f;
                #pragma unroll
                for (int w = 0; w < EPI / 32; w++) s += set[w * 128 + e];
                partial[(i64)mt * N + n0 + e] = s;
            }
        }
    }
}

// A block of a cluster may not exit while the other's multiplying warps can still arrive on
// its barriers.
__device__ __forceinline__ void hw_cluster_exit() {
    if (ht_cluster_size() > 1) ht_cluster_sync();
}

// Grid ≤ the SM count, 544 threads, HW_SMEM bytes of dynamic shared memory; tmA: 64-column ×
// 128-row boxes of A, tmB: the same of B (mode 0) or 64 × 64 boxes of W2 as stored (mode 1)
// (`tensor_map_2d`).
extern "C" __global__ void __launch_bounds__(544, 1) gemm_gelu_fwd_ws(bf16* __restrict__ act, bf16* __restrict__ pre, const __grid_constant__ HgTmap tmA, const __grid_constant__ HgTmap tmB, const bf16* __restrict__ bias, int M, int N, int K) {
    extern __shared__ unsigned char hw_raw0[];
    hw_gemm<0, false>(act, pre, nullptr, &tmA, &tmB, bias, M, N, K, hw_raw0);
}
extern "C" __global__ void __launch_bounds__(544, 1) gemm_dgelu_bwd_ws(bf16* __restrict__ dpre, const bf16* __restrict__ pre, float* __restrict__ partial, const __grid_constant__ HgTmap tmA, const __grid_constant__ HgTmap tmB, const bf16* __restrict__ bias, int M, int N, int K) {
    extern __shared__ unsigned char hw_raw1[];
    hw_gemm<1, false>(dpre, (bf16*)pre, partial, &tmA, &tmB, bias, M, N, K, hw_raw1);
}
// The same two with the derivative saved (GeluSaved::Grad): the forward writes g = gelu'(pre +
// bias) where the first writes pre; the backward multiplies by g (no bias). Separate kernels
// rather than a flag, so that neither epilogue carries the other's code.
extern "C" __global__ void __launch_bounds__(544, 1) gemm_gelu_fwd_grad_ws(bf16* __restrict__ act, bf16* __restrict__ grad, const __grid_constant__ HgTmap tmA, const __grid_constant__ HgTmap tmB, const bf16* __restrict__ bias, int M, int N, int K) {
    extern __shared__ unsigned char hw_raw2[];
    hw_gemm<0, true>(act, grad, nullptr, &tmA, &tmB, bias, M, N, K, hw_raw2);
}
extern "C" __global__ void __launch_bounds__(544, 1) gemm_dgelu_mul_ws(bf16* __restrict__ dpre, const bf16* __restrict__ grad, float* __restrict__ partial, const __grid_constant__ HgTmap tmA, const __grid_constant__ HgTmap tmB, int M, int N, int K) {
    extern __shared__ unsigned char hw_raw3[];
    hw_gemm<1, true>(dpre, (bf16*)grad, partial, &tmA, &tmB, nullptr, M, N, K, hw_raw3);
}
// The four with 128×256 tiles (N % 256 == 0): HX_SMEM bytes; tmB (mode 0) in boxes of 64
// columns × 256 rows. Mode 0: 640 threads (two epilogue warpgroups of 56 registers: its erf
// arithmetic wants warps); mode 1: 512 (one epilogue warpgroup of 152 registers, which reads
// the saved values a whole half tile ahead: with 56 it could read half of that, and the kernel
// was slower than the 128×128 one).
extern "C" __global__ void __launch_bounds__(640, 1) gemm_gelu_fwd_ws_w(bf16* __restrict__ act, bf16* __restrict__ pre, const __grid_constant__ HgTmap tmA, const __grid_constant__ HgTmap tmB, const bf16* __restrict__ bias, int M, int N, int K) {
    extern __shared__ unsigned char hx_raw0[];
    hw_gemm<0, false, true>(act, pre, nullptr, &tmA, &tmB, bias, M, N, K, hx_raw0);
    hw_cluster_exit();
}
extern "C" __global__ void __launch_bounds__(512, 1) gemm_dgelu_bwd_ws_w(bf16* __restrict__ dpre, const bf16* __restrict__ pre, float* __restrict__ partial, const __grid_constant__ HgTmap tmA, const __grid_constant__ HgTmap tmB, const bf16* __restrict__ bias, int M, int N, int K) {
    extern __shared__ unsigned char hx_raw1[];
    hw_gemm<1, false, true, 1>(dpre, (bf16*)pre, partial, &tmA, &tmB, bias, M, N, K, hx_raw1);
    hw_cluster_exit();
}
extern "C" __global__ void __launch_bounds__(640, 1) gemm_gelu_fwd_grad_ws_w(bf16* __restrict__ act, bf16* __restrict__ grad, const __grid_constant__ HgTmap tmA, const __grid_constant__ HgTmap tmB, const bf16* __restrict__ bias, int M, int N, int K) {
    extern __shared__ unsigned char hx_raw2[];
    hw_gemm<0, true, true>(act, grad, nullptr, &tmA, &tmB, bias, M, N, K, hx_raw2);
    hw_cluster_exit();
}
extern "C" __global__ void __launch_bounds__(512, 1) gemm_dgelu_mul_ws_w(bf16* __restrict__ dpre, const bf16* __restrict__ grad, float* __restrict__ partial, const __grid_constant__ HgTmap tmA, const __grid_constant__ HgTmap tmB, int M, int N, int K) {
    extern __shared__ unsigned char hx_raw3[];
    hw_gemm<1, true, true, 1>(dpre, (bf16*)grad, partial, &tmA, &tmB, nullptr, M, N, K, hx_raw3);
    hw_cluster_exit();
}
// The wide forward with the 4-stage ring (RING4): HX4_SMEM bytes, 512 threads (one epilogue
// warpgroup of 152 registers, which holds a whole staged half).
extern "C" __global__ void __launch_bounds__(512, 1) gemm_gelu_fwd_ws_w4(bf16* __restrict__ act, bf16* __restrict__ pre, const __grid_constant__ HgTmap tmA, const __grid_constant__ HgTmap tmB, const bf16* __restrict__ bias, int M, int N, int K) {
    extern __shared__ unsigned char hx_raw4[];
    hw_gemm<0, false, true, 1, true>(act, pre, nullptr, &tmA, &tmB, bias, M, N, K, hx_raw4);
    hw_cluster_exit();
}
extern "C" __global__ void __launch_bounds__(512, 1) gemm_gelu_fwd_grad_ws_w4(bf16* __restrict__ act, bf16* __restrict__ grad, const __grid_constant__ HgTmap tmA, const __grid_constant__ HgTmap tmB, const bf16* __restrict__ bias, int M, int N, int K) {
    extern __shared__ unsigned char hx_raw5[];
    hw_gemm<0, true, true, 1, true>(act, grad, nullptr, &tmA, &tmB, bias, M, N, K, hx_raw5);
    hw_cluster_exit();
}
// fc2's input gradient with the deep ring: partial has 4 · ceil(M / 128) rows.
extern "C" __global__ void __launch_bounds__(512, 1) gemm_dgelu_bwd_ws_w4(bf16* __restrict__ dpre, const bf16* __restrict__ pre, float* __restrict__ partial, const __grid_constant__ HgTmap tmA, const __grid_constant__ HgTmap tmB, const bf16* __restrict__ bias, int M, int N, int K) {
    extern __shared__ unsigned char hx_raw6[];
    hw_gemm<1, false, true, 1, true>(dpre, (bf16*)pre, partial, &tmA, &tmB, bias, M, N, K, hx_raw6);
    hw_cluster_exit();
}
extern "C" __global__ void __launch_bounds__(512, 1) gemm_dgelu_mul_ws_w4(bf16* __restrict__ dpre, const bf16* __restrict__ grad, float* __restrict__ partial, const __grid_constant__ HgTmap tmA, const __grid_constant__ HgTmap tmB, int M, int N, int K) {
    extern __shared__ unsigned char hx_raw7[];
    hw_gemm<1, true, true, 1, true>(dpre, (bf16*)grad, partial, &tmA, &tmB, nullptr, M, N, K, hx_raw7);
    hw_cluster_exit();
}

// ---- Attention forward on wgmma for 193 ≤ N ≤ 208 at D = 64 (224 px / 16: 197 tokens) ----
// One warpgroup per (b, h) block walks the head's 64-query tiles; K and V are staged once and
// every key is seen at once: S = Q·Kᵀ is one m64n208 accumulator (104 f32 per thread), so the
// softmax is exact — no running maximum, no rescaling — and O = P·V takes P straight from
// registers (the A operand) against V read in its stored layout (MN-major B: key rows of 64
// dims). Copies go through the tensor-memory accelerator (3-D maps over (B, N, columns): rows
// ≥ N load as zeros and are never stored) into 128-byte-swizzled rows (16-byte chunk c of row r
// at c ^ (r % 8), the layout hg_desc names): K, V and the first two Q tiles at the start, each
// later Q tile into the buffer the tile before last used, as soon as that tile's output has
// left it — the output tile goes out through its own Q buffer (stmatrix, then a TMA store).
// Scores of keys ≥ N are −∞ before the softmax. Output and saved state as flash_fwd_*: out
// (B, N, H·D), lse2 = m + log2(l) in base 2 with m the row maximum of s·scale·log2(e).
#define FW_NK 208
// dynamic shared memory: two Q tiles (64 rows), K and V (208 rows), two mbarriers, 1 KiB of
// alignment slack
#define FW_SMEM (2 * 64 * 128 + 2 * FW_NK * 128 + 16 + 1024)

// Three blocks per SM (168 registers; ptxas spills one 4-byte value): 1.67 against 1.98 ms per
// ViT-B/16 micro 256 step for the twelve layers at two (H200). With per-thread cp.async copies
// three spilled 132 bytes and ran no faster (2.47 vs 2.52 ms). Tensor maps
// (`tensor_map_3d`, 64-column boxes, 128-byte swizzle): tm_kv over qkv (B, N, 3·H·D) with
// 208-row boxes, tm_q the same with 64-row boxes, tm_out over out (B, N, H·D) with 64-row boxes.
extern "C" __global__ void __launch_bounds__(128, 3) flash_fwd_wg_d64(const __grid_constant__ HgTmap tm_kv, const __grid_constant__ HgTmap tm_q, const __grid_constant__ HgTmap tm_out, float* __restrict__ lse2, int n, int h, float scale_log2) {
    constexpr int D = 64;
    extern __shared__ unsigned char fw_raw[];
    const unsigned raw = smem_u32(fw_raw);
    const unsigned sbase = (raw + 1023u) & ~1023u;  // swizzled tiles start 1024-byte aligned
    const unsigned sq = sbase, sk = sq + 2 * 64 * 128, sv = sk + FW_NK * 128, full0 = sv + FW_NK * 128;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int bh = blockIdx.x, bi = bh / h, hi = bh - bi * h;
    const int nq = (n + 63) / 64;
    if (tid == 0) {
        ht_mbar_init(full0, 1);
        ht_mbar_init(full0 + 8, 1);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
        ht_mbar_expect_tx(full0, 2 * FW_NK * 128 + 64 * 128);
        ht_tma_load3(sk, &tm_kv, (h + hi) * D, 0, bi, full0);
        ht_tma_load3(sv, &tm_kv, (2 * h + hi) * D, 0, bi, full0);
        ht_tma_load3(sq, &tm_q, hi * D, 0, bi, full0);
        if (nq > 1) {
            ht_mbar_expect_tx(full0 + 8, 64 * 128);
            ht_tma_load3(sq + 64 * 128, &tm_q, hi * D, 64, bi, full0 + 8);
        }
    }
    __syncthreads();  // the mbarriers' initialization before anyone waits on them
    const unsigned long long dk = hg_desc(sk), dv = hg_desc(sv);
    for (int qt = 0; qt < nq; qt++) {
        const int q0 = qt * 64, buf = qt & 1;
        const unsigned sqt = sq + buf * 64 * 128;
        ht_mbar_wait(full0 + 8 * buf, (qt >> 1) & 1);

        float s[104];
        #pragma unroll
        for (int k = 0; k < 104; k++) s[k] = 0.f;
        const unsigned long long dq = hg_desc(sqt);
        asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
        #pragma unroll
        for (int kk = 0; kk < D / 16; kk++) wgmma_m64n208k16(s, dq + 2 * kk, dk + 2 * kk);
        asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
        if (tid == 0 && qt >= 1 && qt + 1 < nq) {
            // tile qt + 1 into the other buffer once tile qt − 1's output has left it
            asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
            ht_mbar_expect_tx(full0 + 8 * (buf ^ 1), 64 * 128);
            ht_tma_load3(sq + (buf ^ 1) * 64 * 128, &tm_q, hi * D, q0 + 64, bi, full0 + 8 * (buf ^ 1));
        }
        asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");

        // value 4j + {0,1}: row 16·warp + g, keys 8j + 2t + {0,1}; 4j + {2,3}: the row 8 below
        float m0 = -INFINITY, m1 = -INFINITY;
        #pragma unroll
        for (int j = 0; j < FW_NK / 8; j++) {
            #pragma unroll
            for (int e = 0; e < 4; e++)
                if (8 * j + 2 * t + (e & 1) >= n) s[4 * j + e] = -INFINITY;
            m0 = fmaxf(m0, fmaxf(s[4 * j], s[4 * j + 1]));
            m1 = fmaxf(m1, fmaxf(s[4 * j + 2], s[4 * j + 3]));
        }
        const float mb0 = quad_max(m0) * scale_log2, mb1 = quad_max(m1) * scale_log2;
        float l0 = 0.f, l1 = 0.f;
        unsigned pa[FW_NK / 16][4];
        #pragma unroll
        for (int j = 0; j < FW_NK / 8; j++) {
            const float p0 = exp2f(fmaf(s[4 * j], scale_log2, -mb0)), p1 = exp2f(fmaf(s[4 * j + 1], scale_log2, -mb0));
            const float p2 = exp2f(fmaf(s[4 * j + 2], scale_log2, -mb1)), p3 = exp2f(fmaf(s[4 * j + 3], scale_log2, -mb1));
            l0 += p0 + p1;
            l1 += p2 + p3;
            // keys 16kk… as the A fragment of P·V: n8 block 2kk → a[0], a[1]; 2kk + 1 → a[2], a[3]
            pa[j >> 1][(j & 1) * 2] = f2bf2(p0, p1);
            pa[j >> 1][(j & 1) * 2 + 1] = f2bf2(p2, p3);
        }
        l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
        l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
        l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
        l1 += __shfl_xor_sync(0xffffffffu, l1, 2);

        float o[32];
        #pragma unroll
        for (int k = 0; k < 32; k++) o[k] = 0.f;
        asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
        // keys 16kk… are V rows 16kk…: 2048 bytes (two 8-row groups) per step
        #pragma unroll
        for (int kk = 0; kk < FW_NK / 16; kk++) wgmma_m64n64k16_rs(o, pa[kk], dv + 128 * kk);
        asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
        asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");

        const int r0 = q0 + warp * 16 + g, r1 = r0 + 8;
        if (t == 0) {
            if (r0 < n) lse2[(i64)bh * n + r0] = mb0 + __log2f(l0);
            if (r1 < n) lse2[(i64)bh * n + r1] = mb1 + __log2f(l1);
        }
        __syncthreads();  // every warp's Q·Kᵀ has read this Q buffer
        wg_stage_tile(sqt, o, 1.f / l0, 1.f / l1, warp, lane);
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        __syncthreads();
        if (tid == 0) {
            ht_tma_store3(&tm_out, hi * D, q0, bi, sqt);
            asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
        }
    }
    // the block's shared memory must outlive the last copies' reads
    if (tid == 0) asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
}

// ---- Attention backward on wgmma for 193 ≤ N ≤ 208 at D = 64 ----
// One block of four warpgroups per (b, h) holds the whole head (the structure of
// flash_bwd_small_d64_w13 on warpgroup MMAs): warpgroup w owns keys 64w…64w + 63 and walks the
// queries in steps of 32 — Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ (m64n32, both operands K-major), Pᵀ and
// dSᵀ = Pᵀ ∘ (dPᵀ − delta) in registers, dV += Pᵀ·dO and dK += dSᵀ·Q with Pᵀ, dSᵀ as register
// A operands against dO, Q read MN-major — and stages dSᵀ in shared memory. After one barrier,
// warpgroup w computes dQ = dS·K for queries 64w… over every key (both operands MN-major).
// Keys 197…255 of the last warpgroup: rows ≥ N of K, V are zero, rows past 208 read whatever
// follows in shared memory (finite data); every score of a key or query ≥ N is replaced (not
// multiplied) by zero, so nothing of those rows reaches a stored value. Queries pad to 224
// (7 steps); dSᵀ columns 224…254 are never written, which only touches dQ rows ≥ N (not stored).
//
// Copies go through the tensor-memory accelerator (3-D maps over (B, N, columns), so rows ≥ N
// load as zeros and are never stored): one thread issues the head's K, V, Q, dO and O loads,
// and each warpgroup hands its 64-row dK, dV and dQ tiles to TMA stores from swizzled shared
// tiles (stmatrix). Nsight Compute on the per-thread form (cp.async loops in, 32-bit stores
// out) had 8 % of the samples issuing the loads and 20 % storing dK, dV and waiting at the
// barrier behind those stores. The dK, dV stores now overlap the dQ products.
//
// Where it stands (Nsight Compute, 2026-12-01): ≈ 30 % of the kernel waits for the head's own
// loads and for its stores' reads before the block may exit (one 220 KiB block per SM: nothing
// overlaps them), the steps take 55 %. Reordering the steps' product groups (step i − 1's dV, dK
// with step i's Sᵀ, dPᵀ), ping-pong between warpgroup pairs on named barriers, and dK after the
// loop from the staged dSᵀ all ran slower; with dK in the loop, any reordering that keeps more
// fragments live makes ptxas serialize the wgmmas (C7512) at this 128-register budget.
//
// The qkv bias gradient costs no pass of its own: key row 255 (≥ N, never stored) gets P = 1
// for every query < N and dS = 0, so its dV row is Σ dO (the v bias: each query's probabilities
// sum to 1, so Σ dV = Σ dO); query column 255 of dSᵀ holds each key's Σ_q dS (summed in f32,
// rounded once), so dQ row 255 is Σ dQ (the q bias; the k bias's gradient is exactly zero).
#define FB_NK 208               // key rows staged (13 k-steps of dQ)
#define FB_NQ 224               // query rows staged (7 steps of 32)
#define FB_DS (FB_NK * 128)     // one 64-query column tile of dSᵀ (208 key rows)
// dynamic shared memory: K, V (208 rows), Q, dO (224 rows), dSᵀ (4 tiles; O's rows before the
// steps), lse2 and delta (224 pairs of f32), one mbarrier, 1 KiB of alignment slack
#define FB_SMEM (2 * FB_NK * 128 + 2 * FB_NQ * 128 + 4 * FB_DS + 2 * FB_NQ * 4 + 16 + 1024)

// Tensor maps (`tensor_map_3d`, 64-column boxes, 128-byte swizzle): tm_kv and tm_q over qkv
// (B, N, 3·H·D) with 208- and 224-row boxes, tm_do and tm_o over dout and out (B, N, H·D) with
// 224-row boxes, tm_dqkv over dqkv (B, N, 3·H·D) with 64-row boxes. bias_part (optional, may
// be 0): the qkv bias gradient's per-image partial sums as in flash_bwd_small (row b of
// 2·H·D f32 = [Σ dQ | Σ dO] over the image's tokens).
extern "C" __global__ void __launch_bounds__(512, 1) flash_bwd_wg_d64(const __grid_constant__ HgTmap tm_kv, const __grid_constant__ HgTmap tm_q, const __grid_constant__ HgTmap tm_do, const __grid_constant__ HgTmap tm_o, const __grid_constant__ HgTmap tm_dqkv, const float* __restrict__ lse2, int n, int h, float scale, float scale_log2, float* __restrict__ bias_part) {
    constexpr int D = 64;
    extern __shared__ unsigned char fb_raw[];
    const unsigned raw = smem_u32(fb_raw);
    const unsigned sbase = (raw + 1023u) & ~1023u;
    unsigned char* kp = fb_raw + (sbase - raw);
    unsigned char* vp = kp + FB_NK * 128;
    unsigned char* qp = vp + FB_NK * 128;
    unsigned char* dop = qp + FB_NQ * 128;
    unsigned char* dsp = dop + FB_NQ * 128;
    float* sld = (float*)(dsp + 4 * FB_DS);  // per query: lse2, delta (one 16-byte load per query pair)
    const unsigned sk = sbase, sv = sk + FB_NK * 128, sq = sv + FB_NK * 128, sdo = sq + FB_NQ * 128, sds = sdo + FB_NQ * 128;
    const unsigned bar = smem_u32(sld + 2 * FB_NQ);
    // wg through a shuffle: known warp-uniform, so the wgmma descriptors stay in uniform registers
    const int tid = threadIdx.x, wg = __shfl_sync(0xffffffffu, tid >> 7, 0), wi = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int bh = blockIdx.x, bi = bh / h, hi = bh - bi * h;
    if (tid == 0) {
        ht_mbar_init(bar, 1);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
        ht_mbar_expect_tx(bar, 2 * FB_NK * 128 + 3 * FB_NQ * 128);
        ht_tma_load3(sk, &tm_kv, (h + hi) * D, 0, bi, bar);
        ht_tma_load3(sv, &tm_kv, (2 * h + hi) * D, 0, bi, bar);
        ht_tma_load3(sq, &tm_q, hi * D, 0, bi, bar);
        ht_tma_load3(sdo, &tm_do, hi * D, 0, bi, bar);
        ht_tma_load3(sds, &tm_o, hi * D, 0, bi, bar);  // O's rows where dSᵀ goes later
    }
    for (int i = tid; i < FB_NQ; i += 512) cp_async4(sld + 2 * i, i < n ? lse2 + (i64)bh * n + i : lse2, i < n);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();  // the mbarrier's initialization before anyone waits on it; lse2 staged
    ht_mbar_wait(bar, 0);
    // delta = rowsum(dO ∘ O): two threads per query row
    const int dr = tid >> 1, dhalf = tid & 1;
    if (dr < FB_NQ) {
        float part = 0.f;
        #pragma unroll
        for (int c = 0; c < 4; c++) {
            const uint4 x = *(const uint4*)(dop + sw128(dr, dhalf * 4 + c)), y = *(const uint4*)(dsp + sw128(dr, dhalf * 4 + c));
            const unsigned xs[4] = {x.x, x.y, x.z, x.w}, ys[4] = {y.x, y.y, y.z, y.w};
            #pragma unroll
            for (int e = 0; e < 4; e++) {
                part += lo16(xs[e]) * lo16(ys[e]);
                part += hi16(xs[e]) * hi16(ys[e]);
            }
        }
        const float sum = part + __shfl_xor_sync(0xffffffffu, part, 1);
        if (dhalf == 0) sld[2 * dr + 1] = sum;
    }
    __syncthreads();  // delta complete; O's rows read (dSᵀ may overwrite them)

    // this thread's key rows (accumulator rows g and g + 8 of warp wi in warpgroup wg)
    const int kr0 = wg * 64 + wi * 16 + g, kr1 = kr0 + 8;
    const bool ones = kr1 == 255;  // the v-bias row: P = 1 for every query < N
    float dk[32], dv[32];
    #pragma unroll
    for (int k = 0; k < 32; k++) dk[k] = dv[k] = 0.f;
    float cs0 = 0.f, cs1 = 0.f;  // Σ_q dS of keys kr0, kr1 (this lane's queries)
    const unsigned long long dka = hg_desc(sk + wg * 64 * 128), dva = hg_desc(sv + wg * 64 * 128);
    // unrolled: the step's tile offsets and swizzle chunks fold into constants (5.26 → 5.05 ms
    // per ViT-B/16 micro 256 step on an H200, 124 registers, no spills)
    #pragma unroll
    for (int q0 = 0; q0 < FB_NQ; q0 += 32) {
        float st[16], dpt[16];
        #pragma unroll
        for (int k = 0; k < 16; k++) st[k] = dpt[k] = 0.f;
        const unsigned long long dqb = hg_desc(sq + q0 * 128), dob = hg_desc(sdo + q0 * 128);
        asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
        #pragma unroll
        for (int kk = 0; kk < D / 16; kk++) wgmma_m64n32k16(st, dka + 2 * kk, dqb + 2 * kk);
        #pragma unroll
        for (int kk = 0; kk < D / 16; kk++) wgmma_m64n32k16(dpt, dva + 2 * kk, dob + 2 * kk);
        asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
        asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
        // value 4j + e: key kr0 (e < 2) or kr1, query q0 + 8j + 2t + (e & 1)
        unsigned pa[2][4], sa[2][4];
        unsigned char* dst0 = dsp + (q0 >> 6) * FB_DS + kr0 * 128 + 4 * t;
        // every key and query of the step < N (warp-uniform): no masks
        const bool inside = q0 + 32 <= n && wg * 64 + 64 <= n;
        #pragma unroll
        for (int j = 0; j < 4; j++) {
            float p[4], ds[4];
            const float4 ld = *(const float4*)(sld + 2 * (q0 + 8 * j + 2 * t));  // queries q, q + 1
            if (inside) {
                #pragma unroll
                for (int e = 0; e < 4; e++) {
                    p[e] = exp2f(fmaf(st[4 * j + e], scale_log2, -(e & 1 ? ld.z : ld.x)));
                    ds[e] = p[e] * (dpt[4 * j + e] - (e & 1 ? ld.w : ld.y));
                }
            } else {
                #pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int q = q0 + 8 * j + 2 * t + (e & 1);
                    const bool ok = (e < 2 ? kr0 : kr1) < n && q < n;
                    p[e] = ok ? exp2f(fmaf(st[4 * j + e], scale_log2, -(e & 1 ? ld.z : ld.x))) : (e >= 2 && ones && q < n ? 1.f : 0.f);
                    ds[e] = ok ? p[e] * (dpt[4 * j + e] - (e & 1 ? ld.w : ld.y)) : 0.f;
                }
            }
            cs0 += ds[0] + ds[1];
            cs1 += ds[2] + ds[3];
            // queries 16kk… as the A fragment: n8 block 2kk → a[0], a[1]; 2kk + 1 → a[2], a[3]
            pa[j >> 1][(j & 1) * 2] = f2bf2(p[0], p[1]);
            pa[j >> 1][(j & 1) * 2 + 1] = f2bf2(p[2], p[3]);
            sa[j >> 1][(j & 1) * 2] = f2bf2(ds[0], ds[1]);
            sa[j >> 1][(j & 1) * 2 + 1] = f2bf2(ds[2], ds[3]);
            // dSᵀ (key row, query column) into the 64-query column tile of its query: chunk
            // (q0 % 64) / 8 + j of rows kr0, kr1 (kr1 = kr0 + 8: the same swizzle)
            const unsigned co = (((q0 & 32) >> 3) + j ^ (kr0 & 7)) << 4;
            if (kr0 < FB_NK) *(unsigned*)(dst0 + co) = sa[j >> 1][(j & 1) * 2];
            if (kr1 < FB_NK) *(unsigned*)(dst0 + 8 * 128 + co) = sa[j >> 1][(j & 1) * 2 + 1];
        }
        asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
        #pragma unroll
        for (int kk = 0; kk < 2; kk++) wgmma_m64n64k16_rs(dv, pa[kk], hg_desc(sdo + (q0 + 16 * kk) * 128));
        #pragma unroll
        for (int kk = 0; kk < 2; kk++) wgmma_m64n64k16_rs(dk, sa[kk], hg_desc(sq + (q0 + 16 * kk) * 128));
        asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
        asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    }
    // Σ_q dS per key into query column 255 (dSᵀ tile 3, column 63), which no query < N uses
    cs0 += __shfl_xor_sync(0xffffffffu, cs0, 1);
    cs0 += __shfl_xor_sync(0xffffffffu, cs0, 2);
    cs1 += __shfl_xor_sync(0xffffffffu, cs1, 1);
    cs1 += __shfl_xor_sync(0xffffffffu, cs1, 2);
    if (t == 0) {
        unsigned char* tile = dsp + 3 * FB_DS;
        if (kr0 < FB_NK) *(bf16*)(tile + sw128(kr0, 7) + 7 * 2) = f2bf(cs0);
        if (kr1 < FB_NK) *(bf16*)(tile + sw128(kr1, 7) + 7 * 2) = f2bf(cs1);
    }
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncthreads();  // dSᵀ complete; K, V, Q, dO no longer read by the steps
    // dQ of queries 64·wg… over every key: A = dS (dSᵀ tile wg, MN-major), B = K (MN-major)
    float dq[32];
    #pragma unroll
    for (int k = 0; k < 32; k++) dq[k] = 0.f;
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
    #pragma unroll
    for (int kk = 0; kk < FB_NK / 16; kk++) wgmma_m64n64k16_tt(dq, hg_desc(sds + wg * FB_DS + kk * 2048), hg_desc(sk + kk * 2048));
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
    // meanwhile dK (times the softmax scale) and dV of keys 64·wg… out through shared tiles in
    // V's, Q's and dO's place (8 KiB each, from V's start)
    const unsigned tk = sv + wg * 2 * 8192, tv = tk + 8192;
    wg_stage_tile(tk, dk, scale, scale, wi, lane);
    wg_stage_tile(tv, dv, 1.f, 1.f, wi, lane);
    if (bias_part && ones) {  // (warp-uniform condition false for all but one warp: g == 7 lanes only)
        float* row = bias_part + (i64)bi * 2 * h * D + h * D + hi * D + 2 * t;
        #pragma unroll
        for (int j = 0; j < D / 8; j++) {
            row[8 * j] = dv[4 * j + 2];
            row[8 * j + 1] = dv[4 * j + 3];
        }
    }
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    asm volatile("bar.sync %0, 128;\n" ::"r"(1 + wg) : "memory");
    const bool issuer = (tid & 127) == 0;
    if (issuer) {
        ht_tma_store3(&tm_dqkv, (h + hi) * D, wg * 64, bi, tk);
        ht_tma_store3(&tm_dqkv, (2 * h + hi) * D, wg * 64, bi, tv);
        asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
    }
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    // dQ through this warpgroup's dSᵀ tile, which only its own (finished) products read
    const unsigned tq = sds + wg * FB_DS;
    wg_stage_tile(tq, dq, scale, scale, wi, lane);
    if (bias_part && wg == 3 && wi == 3 && g == 7) {  // dQ row 255: Σ_q dQ
        float* row = bias_part + (i64)bi * 2 * h * D + hi * D + 2 * t;
        #pragma unroll
        for (int j = 0; j < D / 8; j++) {
            row[8 * j] = dq[4 * j + 2] * scale;
            row[8 * j + 1] = dq[4 * j + 3] * scale;
        }
    }
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    asm volatile("bar.sync %0, 128;\n" ::"r"(1 + wg) : "memory");
    if (issuer) {
        ht_tma_store3(&tm_dqkv, hi * D, wg * 64, bi, tq);
        asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
        // the block's shared memory must outlive the copies' reads
        asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
    }
}
