//! The fused attention kernels of `src/backend/cuda/kernels/flash.cu`, emulated on the CPU lane
//! by lane: the same tiles, fragment loads, online softmax, packing, shuffles, shared-memory
//! indices and atomics, with `mma.sync.m16n8k16` and `ldmatrix` rebuilt from the PTX ISA's
//! fragment layouts (written here independently of the kernel's own comments). bf16 rounding
//! happens where the kernel rounds: this is the kernels' bf16 build (the fp16 build,
//! `-DVITSCALE_HALF_F16`, differs only in common.cuh's conversions and the mma operand type, and
//! is checked against the CPU on the device by `vitscale selftest`). It mirrors, as if the tiles were loaded synchronously, the
//! per-lane arithmetic of the tiled kernels `FA_PIPE(D)` for every head dim they are compiled for
//! (32, 64, 80, 96, 128: D/16 k-steps, D/8 n-tiles):
//! - the forward `flash_fwd_pipe<D, BR>`: blocks of BR = 64 or 128 queries on BR/16 warps, key
//!   tiles of 64 (`fa_scores`, `fa_scale_mask_max`, `fa_exp2_rows`, `fa_store_out`);
//! - the key-block backward `flash_bwd_pipe<D, BC>` with BC = `fa_bwd_keys<D>()` (128 keys on 8
//!   warps where half the head is whole 16-column tiles, else 64 on 4), 16 keys a warp, query
//!   steps of 64 (`fa_bwd_step`), then the dQ phase: warp w takes the step's queries
//!   16·(w mod 4) and, with 128 keys, half the head dim (w / 4), over all BC keys, adding dQ into
//!   the f32 accumulator as pairs (`red_add2`); with `flash_bwd_pre` and `flash_dq_store`.
//!
//! The backward's K and V fragments come from registers loaded once (`KeyRegs`) or, above
//! D = 64, from the shared K and V tiles at every use (`KeySmem`). Both are emulated as written;
//! they give the same values, since a block's K and V tiles do not change while it runs: they
//! differ in where the fragments live, not in the arithmetic. `red_add2` is one f32-pair vector
//! reduction on sm_90 and two scalar atomics before; the emulation adds the pair in program order.
//! Run with the small-head geometry (one block of 16·W queries and keys, W warps) the same code is
//! the arithmetic of `flash_fwd_small` / `flash_bwd_small`, except that those compute the
//! zero-padded tiles and mask them (identical results: the masked terms are zeros), sum delta =
//! dO·O themselves in two halves, walk the queries in steps of `FA_SMALL_QC` (the same sums in
//! the same order as one step), and store dQ from registers (the emulation adds it to a zeroed
//! accumulator first: the same value).
//!
//! What the tests here prove:
//! - `fused_attention_kernels_match_cpu`: at the listed shapes (B, N, H, D), with fresh random
//!   inputs each run (the seed is printed) — every head dim of `PIPE_HEAD_DIMS` at ragged N,
//!   last key blocks with idle warps and last query steps partly past N included — the tiled
//!   backward with the keys per block the host launches for D, the tiled forward with 64- and
//!   with 128-query blocks (the host's choice for N feeding the backward; 128-query blocks also
//!   below `LONG_QUERY_BLOCK_FROM` tokens, as a block's arithmetic does not depend on N), and the
//!   small-head geometry where the host picks it, give out, lse2 and dqkv equal to the CPU
//!   backend's attention (relative error < 1e-2 for out and dqkv, |lse2 − reference| < 1e-3). So
//!   the indexing and the algorithm *as transcribed here* are right. The tiled geometry runs at
//!   every shape, also where the host launches another kernel (small-head, `flash_bwd_short`).
//! - `ldb_rows2_matches_two_ldb_row_loads`: the one-ldmatrix B-fragment load of the score loops
//!   gives the registers of two `ldb_row` loads (the B fragment layout).
//! - `ldb_t2_matches_fragment_layout`: the transposing ldmatrix of `ldb_t2` gives, at every row
//!   stride the kernels use, the registers of the B fragment layout read element by element.
//! - `emulated_kernel_source_is_unchanged`: every flash.cu function the emulation transcribes
//!   (`KERNEL_FUNCTIONS`) is token for token, comments and layout aside, the text it was last
//!   checked against (a pinned fingerprint); the constants and expressions the emulation
//!   hard-codes appear in the source (the key tile and query step, the `FA_PIPE` head dims with
//!   their 64- and 128-query forwards and `fa_bwd_keys` backwards, the `KeyFrags` choice, the dQ
//!   phase's split of queries and head dim between warps and its `red_add2` pairs, the small-head
//!   instantiations, ldmatrix addresses, the dSᵀ register order, the lse2 and dK/dV/dQ scaling,
//!   the mma shape and types); and the host code (`src/backend/cuda/*.rs`) launches what the test
//!   runs: `PIPE_HEAD_DIMS`, `SHORT_HEAD_DIMS`, `LONG_QUERY_BLOCK_FROM` and `pipe_keys` as here,
//!   the tiled kernels' grids and threads per block from BR and BC, and the small-head W
//!   (`small_attention`). Editing any of them fails the test until the emulation has been
//!   re-checked and the fingerprint re-pinned.
//!
//! What they do not prove:
//! - That the transcription is faithful: the fingerprints only say the source is the one the
//!   emulation was compared with by reading; that comparison is a person's.
//! - Anything the CPU cannot see: that the kernels compile, their registers, shared-memory sizes
//!   (`fa_*_pipe_smem` and the host's sums), the hardware's actual fragment layouts (the
//!   emulation follows the PTX ISA as read here), and bit-exact agreement (`exp2f`, `log2f` and
//!   the order of the f32 atomics across key blocks differ on the GPU; the comparison is by
//!   tolerance).
//! - Synchronization and memory: the cp.async double buffering, `__syncthreads` placement (that
//!   every warp's dSᵀ rows are written before the dQ phase reads them, and read before the next
//!   step overwrites them), races between warps, bank conflicts, and the 8-byte alignment of the
//!   dQ accumulator's base that `red_add2` needs (the emulation checks the pairs' offsets are
//!   even); the emulation runs warps one after another.
//! - Kernels that are not emulated: `flash_bwd_short` (the default backward at D 32 and 64 for
//!   80 < N ≤ 256), `flash_bwd_small`'s qkv-bias sums and its W = 13 variant, the wgmma kernels
//!   of hopper.cu, and the gemm path of attention.cu.
//!
//! Those are checked against the CPU only on a GPU, by `vitscale selftest --device cuda` (every
//! attention path) and `cargo test --release --test cuda_parity -- --ignored`.
// Index loops mirror the kernel's lane and tile indices on purpose.
#![allow(clippy::needless_range_loop, clippy::manual_is_multiple_of)]

use half::bf16;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use vitscale::backend::cpu::Cpu;
use vitscale::backend::Backend;
use vitscale::selftest::rel_err;

mod common;

/// Geometry of an emulated forward (`flash_fwd_pipe<D, BR>`): BR queries per block, BR/16 warps
/// of 16 query rows each, walking the keys in tiles of BC. The tiled kernels take BR = 64 or 128
/// and BC = `FA_BC` = 64; the small-head forward (`flash_fwd_small`, N ≤ 16·W) is one block of
/// BR = BC = 16·W with W warps: the same arithmetic with a single key tile.
#[derive(Clone, Copy, Debug)]
struct FwdTiles {
    br: usize,
    bc: usize,
}

/// Geometry of an emulated backward (`flash_bwd_pipe<D, BC>`): BC keys per block, BC/16 warps of
/// 16 keys each, walking the queries in steps of BR (`FA_BR` = 64); in the dQ phase warp w takes
/// the step's queries 16·(w mod BR/16) and, with BC/BR warp groups, its group's share of the head
/// dim. `key_smem`: the warps read their K and V fragments from the shared tiles at every use
/// (`KeySmem`) instead of registers loaded once (`KeyRegs`). The small-head backward
/// (`flash_bwd_small`) is one block of BC = BR = 16·W with `KeyRegs`.
#[derive(Clone, Copy, Debug)]
struct BwdTiles {
    bc: usize,
    br: usize,
    key_smem: bool,
}

/// Head dims of the tiled kernels (`FA_PIPE` in flash.cu, `PIPE_HEAD_DIMS` in the host code);
/// the test runs each of them.
const PIPE_HEAD_DIMS: [usize; 5] = [32, 64, 80, 96, 128];
/// Head dims of the small-head kernels (`FA_SMALL`; `SHORT_HEAD_DIMS` in the host code).
const SHORT_HEAD_DIMS: [usize; 2] = [32, 64];
/// Above this many tokens the host launches the tiled forward with 128-query blocks.
const LONG_QUERY_BLOCK_FROM: usize = 1024;

/// The tiled forward the host launches for N tokens: `flash_fwd_d{D}_pipe128` above
/// `LONG_QUERY_BLOCK_FROM` tokens, else `flash_fwd_d{D}_pipe` (64 queries a block).
fn pipe_fwd(n: usize) -> FwdTiles {
    FwdTiles { br: if n > LONG_QUERY_BLOCK_FROM { 128 } else { 64 }, bc: 64 }
}

/// The tiled backward for head dim D: `flash_bwd_pipe<D, fa_bwd_keys<D>()>` (the host's
/// `pipe_keys`), 128 keys a block where half the head is whole 16-column tiles, else 64, with
/// the key fragments of `KeyFrags<D>` (`KeySmem` above D = 64).
fn pipe_bwd(d: usize) -> BwdTiles {
    BwdTiles { bc: if (d / 2) % 16 == 0 { 128 } else { 64 }, br: 64, key_smem: d > 64 }
}

/// Warps W of the small-head kernels the host launches for N tokens (`small_attention` in the
/// CUDA backend, checked against it by `emulated_kernel_source_is_unchanged`).
fn small_head_warps(n: usize) -> Option<usize> {
    if n > 80 {
        return None;
    }
    let w = if n <= 64 { 4 } else { 5 };
    Some(w)
}

/// One 32-bit register holding two bf16 (low half first).
type R = [f32; 2];

fn bf(x: f32) -> f32 {
    bf16::from_f32(x).to_f32()
}
fn ld2(s: &[f32], i: usize) -> R {
    assert!(i % 2 == 0, "unaligned 32-bit shared load at {i}");
    [s[i], s[i + 1]]
}
fn ld2t(s: &[f32], i0: usize, i1: usize) -> R {
    [s[i0], s[i1]]
}
fn pack(lo: f32, hi: f32) -> R {
    [bf(lo), bf(hi)]
}

/// D(16×8) += A(16×16)·B(16×8) for one warp, from per-lane fragments (PTX ISA layout for
/// .m16n8k16 with 16-bit A/B and f32 C/D; g = lane/4, t = lane%4).
fn mma(c: &mut [[f32; 4]; 32], a: &[[R; 4]; 32], b: &[[R; 2]; 32]) {
    let mut am = [[f32::NAN; 16]; 16];
    let mut bm = [[f32::NAN; 8]; 16];
    let mut cm = [[f32::NAN; 8]; 16];
    for lane in 0..32 {
        let (g, t) = (lane / 4, lane % 4);
        for e in 0..2 {
            am[g][2 * t + e] = a[lane][0][e];
            am[g + 8][2 * t + e] = a[lane][1][e];
            am[g][2 * t + 8 + e] = a[lane][2][e];
            am[g + 8][2 * t + 8 + e] = a[lane][3][e];
            bm[2 * t + e][g] = b[lane][0][e];
            bm[2 * t + 8 + e][g] = b[lane][1][e];
            cm[g][2 * t + e] = c[lane][e];
            cm[g + 8][2 * t + e] = c[lane][2 + e];
        }
    }
    for i in 0..16 {
        for j in 0..8 {
            let mut acc = cm[i][j];
            for k in 0..16 {
                acc += am[i][k] * bm[k][j];
            }
            cm[i][j] = acc;
        }
    }
    for lane in 0..32 {
        let (g, t) = (lane / 4, lane % 4);
        for e in 0..2 {
            c[lane][e] = cm[g][2 * t + e];
            c[lane][2 + e] = cm[g + 8][2 * t + e];
        }
    }
}

/// ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 as the PTX ISA defines it: lanes 8i..8i+7
/// give the row addresses (elements) of matrix i; lane l receives, for each matrix i, the
/// elements (row 2(l%4), col l/4) and (row 2(l%4)+1, col l/4).
fn ldsm_x4_t(s: &[f32], addrs: &[usize; 32]) -> [[R; 4]; 32] {
    let mut r = [[[f32::NAN; 2]; 4]; 32];
    for &a in addrs.iter() {
        assert!(a % 8 == 0, "ldmatrix row address {a} not 16-byte aligned");
    }
    for lane in 0..32 {
        let (row, col) = (2 * (lane % 4), lane / 4);
        for mi in 0..4 {
            r[lane][mi] = [s[addrs[mi * 8 + row] + col], s[addrs[mi * 8 + row + 1] + col]];
        }
    }
    r
}

/// ldmatrix.sync.aligned.m8n8.x4.shared.b16 (no transpose) as the PTX ISA defines it: lanes
/// 8i..8i+7 give the row addresses (elements) of matrix i; lane l receives, for each matrix i,
/// the elements (row l/4, cols 2(l%4) and 2(l%4)+1).
fn ldsm_x4(s: &[f32], addrs: &[usize; 32]) -> [[R; 4]; 32] {
    let mut r = [[[f32::NAN; 2]; 4]; 32];
    for &a in addrs.iter() {
        assert!(a % 8 == 0, "ldmatrix row address {a} not 16-byte aligned");
    }
    for lane in 0..32 {
        let (row, col) = (lane / 4, 2 * (lane % 4));
        for mi in 0..4 {
            r[lane][mi] = [s[addrs[mi * 8 + row] + col], s[addrs[mi * 8 + row] + col + 1]];
        }
    }
    r
}

/// The kernel's `ldb_rows2`: the B fragments of n-tiles n0.. and n0 + 8.. (rows of a
/// row-major [n][k] tile, columns k0..k0+15) by one non-transposed ldmatrix.
fn ldb_rows2(s: &[f32], ld: usize, n0: usize, k0: usize) -> [[R; 4]; 32] {
    let mut addrs = [0usize; 32];
    for (lane, a) in addrs.iter_mut().enumerate() {
        let mi = lane >> 3;
        *a = (n0 + (mi >> 1) * 8 + (lane & 7)) * ld + k0 + (mi & 1) * 8;
    }
    ldsm_x4(s, &addrs)
}

/// The kernels' score loops load B fragments of two n-tiles with one ldmatrix (`ldb_rows2`);
/// the registers must be exactly the two `ldb_row` loads of each tile they replace.
#[test]
fn ldb_rows2_matches_two_ldb_row_loads() {
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    for d in PIPE_HEAD_DIMS {
        let ld = d + 8;
        let rows = 80;
        let s: Vec<f32> = (0..rows * ld).map(|_| rng.gen::<f32>()).collect();
        for n0 in (0..rows - 8).step_by(16) {
            for k0 in (0..d).step_by(16) {
                let r = ldb_rows2(&s, ld, n0, k0);
                for lane in 0..32 {
                    let (g, t) = (lane / 4, lane % 4);
                    for (tile, regs) in [(0usize, [0usize, 1]), (1, [2, 3])] {
                        let row = n0 + tile * 8 + g;
                        // ldb_row: b[0] = cols k0 + 2t, 2t + 1; b[1] = cols k0 + 2t + 8, 2t + 9
                        let want0 = ld2(&s, row * ld + k0 + 2 * t);
                        let want1 = ld2(&s, row * ld + k0 + 2 * t + 8);
                        assert_eq!(r[lane][regs[0]], want0, "D{d} n0 {n0} k0 {k0} lane {lane} tile {tile} b[0]");
                        assert_eq!(r[lane][regs[1]], want1, "D{d} n0 {n0} k0 {k0} lane {lane} tile {tile} b[1]");
                    }
                }
            }
        }
    }
}

/// The kernel's `ldb_t2`: B fragments of two n-tiles from a row-major [k][n] tile (k rows
/// k0..k0+15, columns c0..c0+7 into r[0..1] and c0+8..c0+15 into r[2..3]) by one ldmatrix .trans.
fn ldb_t2(s: &[f32], ld: usize, k0: usize, c0: usize) -> [[R; 4]; 32] {
    let mut addrs = [0usize; 32];
    for (lane, a) in addrs.iter_mut().enumerate() {
        let mi = lane >> 3;
        *a = (k0 + (mi & 1) * 8 + (lane & 7)) * ld + c0 + (mi >> 1) * 8;
    }
    ldsm_x4_t(s, &addrs)
}

/// The registers `ldb_t2` must give, element by element from the B fragment layout (k 2t, 2t + 1
/// and 2t + 8, 2t + 9 at column g of each n-tile).
fn ldb_t2_by_elements(s: &[f32], ld: usize, k0: usize, c0: usize) -> [[R; 4]; 32] {
    let mut r = [[[0f32; 2]; 4]; 32];
    for (lane, rl) in r.iter_mut().enumerate() {
        let (g, t) = (lane >> 2, lane & 3);
        let p = (k0 + 2 * t) * ld + c0 + g;
        rl[0] = ld2t(s, p, p + ld);
        rl[1] = ld2t(s, p + 8 * ld, p + 9 * ld);
        rl[2] = ld2t(s, p + 8, p + ld + 8);
        rl[3] = ld2t(s, p + 8 * ld + 8, p + 9 * ld + 8);
    }
    r
}

/// The products with a [k][n] shared tile (P·V, dS·K, Pᵀ·dO, dSᵀ·Q, and dSᵀ read as A) load B
/// through `ldb_t2`'s transposing ldmatrix: at every row stride the kernels use (D + 8 for the
/// head dims, 16·W + 8 and 64 + 8 for dSᵀ) and every 16-row, 8-column aligned offset it gives
/// the registers of the fragment layout.
#[test]
fn ldb_t2_matches_fragment_layout() {
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    for ld in [40usize, 72, 88, 104, 136] {
        let rows = 144;
        let s: Vec<f32> = (0..rows * ld).map(|_| rng.gen::<f32>()).collect();
        for k0 in (0..=rows - 16).step_by(16) {
            for c0 in (0..=ld - 8 - 16).step_by(8) {
                assert_eq!(ldb_t2(&s, ld, k0, c0), ldb_t2_by_elements(&s, ld, k0, c0), "ld {ld} k0 {k0} c0 {c0}");
            }
        }
    }
}

/// Splits two-tile fragments into the B operands of tile j (regs 0, 1) and j + 1 (regs 2, 3).
fn split_b(r: &[[R; 4]; 32]) -> ([[R; 2]; 32], [[R; 2]; 32]) {
    let mut lo = [[[0f32; 2]; 2]; 32];
    let mut hi = [[[0f32; 2]; 2]; 32];
    for lane in 0..32 {
        lo[lane] = [r[lane][0], r[lane][1]];
        hi[lane] = [r[lane][2], r[lane][3]];
    }
    (lo, hi)
}

/// Butterfly over the 4 lanes of a quad (xor 1 then xor 2), as the kernel's shuffles.
fn quad_reduce(v: &mut [f32; 32], f: impl Fn(f32, f32) -> f32) {
    for m in [1usize, 2] {
        let old = *v;
        for lane in 0..32 {
            v[lane] = f(old[lane], old[lane ^ m]);
        }
    }
}

/// fa_load_tile: rows × D from global rows (stride elements) into rows of D + 8; zero past n.
fn load_tile(gl: &[f32], base: usize, stride: usize, row0: usize, n: usize, d: usize, rows: usize) -> Vec<f32> {
    let mut s = vec![f32::NAN; rows * (d + 8)];
    for r in 0..rows {
        for c in 0..d {
            s[r * (d + 8) + c] = if row0 + r < n { gl[base + (row0 + r) * stride + c] } else { 0.0 };
        }
    }
    s
}

/// A warp's registers, lane by lane: an f32 accumulator fragment (C/D of the mma) and an A
/// fragment (4 registers of two bf16).
type Acc = [[f32; 4]; 32];
type AFrag = [[R; 4]; 32];

const ACC0: Acc = [[0f32; 4]; 32];

/// The kernel's `fa_row_fragment<D>`: the A fragment at k-step kt of a warp's rows r0 = 16·warp + g
/// and r0 + 8 of a shared tile with rows of `ld` (its queries in the forward, its keys' K or V
/// in the backward). `fa_row_fragments<D>` is this for kt = 0..D/16.
fn row_fragment(s: &[f32], ld: usize, warp: usize, kt: usize) -> AFrag {
    let mut a = [[[0f32; 2]; 4]; 32];
    for lane in 0..32 {
        let (g, t) = (lane / 4, lane % 4);
        let r0 = warp * 16 + g;
        a[lane][0] = ld2(s, r0 * ld + kt * 16 + 2 * t);
        a[lane][1] = ld2(s, (r0 + 8) * ld + kt * 16 + 2 * t);
        a[lane][2] = ld2(s, r0 * ld + kt * 16 + 2 * t + 8);
        a[lane][3] = ld2(s, (r0 + 8) * ld + kt * 16 + 2 * t + 8);
    }
    a
}

/// Where a backward warp's K and V A-fragments come from at k-step kt (`KeyFrags<D>` in
/// flash.cu): `KeyRegs` loads every k-step's fragments once per key block, `KeySmem` keeps the
/// shared tiles' addresses and loads the step's fragments at each `get`.
enum KeyFrags<'a> {
    Regs { k: Vec<AFrag>, v: Vec<AFrag> },
    Smem { sk: &'a [f32], sv: &'a [f32], ld: usize, warp: usize },
}

impl<'a> KeyFrags<'a> {
    /// `keys.load(sk, sv, r0, t)` for warp `warp` (r0 = 16·warp + g).
    fn load(smem: bool, sk: &'a [f32], sv: &'a [f32], ld: usize, warp: usize, kt_n: usize) -> Self {
        if smem {
            KeyFrags::Smem { sk, sv, ld, warp }
        } else {
            KeyFrags::Regs { k: (0..kt_n).map(|kt| row_fragment(sk, ld, warp, kt)).collect(), v: (0..kt_n).map(|kt| row_fragment(sv, ld, warp, kt)).collect() }
        }
    }

    /// `keys.get(kt, ka, va)`.
    fn get(&self, kt: usize) -> (AFrag, AFrag) {
        match self {
            KeyFrags::Regs { k, v } => (k[kt], v[kt]),
            KeyFrags::Smem { sk, sv, ld, warp } => (row_fragment(sk, *ld, *warp, kt), row_fragment(sv, *ld, *warp, kt)),
        }
    }
}

/// The kernel's `acc_to_a`: the A fragment of columns 16kk..16kk+15 from the accumulator n-tiles
/// 2kk and 2kk + 1, rounded to bf16.
fn acc_to_a(c: &[Acc], kk: usize) -> AFrag {
    let mut a = [[[0f32; 2]; 4]; 32];
    for lane in 0..32 {
        a[lane][0] = pack(c[2 * kk][lane][0], c[2 * kk][lane][1]);
        a[lane][1] = pack(c[2 * kk][lane][2], c[2 * kk][lane][3]);
        a[lane][2] = pack(c[2 * kk + 1][lane][0], c[2 * kk + 1][lane][1]);
        a[lane][3] = pack(c[2 * kk + 1][lane][2], c[2 * kk + 1][lane][3]);
    }
    a
}

/// The kernel's `mma_a_tile`: acc[j] += a · s[k0..k0+15][c0 + 8j ..] for the n-tiles of `acc`,
/// in pairs through `ldb_t2`.
fn mma_a_tile(acc: &mut [Acc], a: &AFrag, s: &[f32], ld: usize, k0: usize, c0: usize) {
    assert!(acc.len() % 2 == 0, "mma_a_tile takes n-tiles in pairs: {} tiles", acc.len());
    for j in (0..acc.len()).step_by(2) {
        let (b0, b1) = split_b(&ldb_t2(s, ld, k0, c0 + j * 8));
        mma(&mut acc[j], a, &b0);
        mma(&mut acc[j + 1], a, &b1);
    }
}

/// The kernel's `ds_as_a`: the A fragment dS(queries q0.., keys k0..) from the shared dSᵀ.
fn ds_as_a(sds: &[f32], lds: usize, k0: usize, q0: usize) -> AFrag {
    let r = ldb_t2(sds, lds, k0, q0);
    let mut a = [[[0f32; 2]; 4]; 32];
    for lane in 0..32 {
        a[lane] = [r[lane][0], r[lane][2], r[lane][1], r[lane][3]];
    }
    a
}

/// The kernel's `red_add2`: p[0] += a, p[1] += b at an 8-byte aligned f32 pair (one vector
/// reduction on sm_90, two scalar atomics before; the emulation adds in program order).
fn red_add2(acc: &mut [f32], i: usize, a: f32, b: f32) {
    assert!(i % 2 == 0, "red_add2 at f32 index {i}: not 8-byte aligned");
    acc[i] += a;
    acc[i + 1] += b;
}

/// `flash_fwd_pipe<D, BR>` (with `fa_scores`, `fa_scale_mask_max`, `fa_exp2_rows`, `fa_store_out`),
/// per block of BR queries, per warp, per lane.
#[allow(clippy::too_many_arguments)]
fn flash_fwd(tl: FwdTiles, out: &mut [f32], lse2: &mut [f32], qkv: &[f32], b: usize, n: usize, h: usize, d: usize, scale_log2: f32) {
    let FwdTiles { br, bc } = tl;
    assert!(br % 16 == 0 && bc % 16 == 0, "{tl:?}");
    let warps = br / 16; // NT = 2·BR threads
    let ld = d + 8;
    let (kt_n, ns, no) = (d / 16, bc / 8, d / 8);
    let stride = 3 * h * d;
    let ostride = h * d;
    for bh in 0..b * h {
        let (bi, hi) = (bh / h, bh % h);
        let qg = bi * n * stride + hi * d;
        let (kg, vg) = (qg + h * d, qg + 2 * h * d);
        // the K, V tiles each query block walks, kb = 0, 1, …
        let kv: Vec<(Vec<f32>, Vec<f32>)> = (0..n).step_by(bc).map(|k0| (load_tile(qkv, kg, stride, k0, n, d, bc), load_tile(qkv, vg, stride, k0, n, d, bc))).collect();
        for q0 in (0..n).step_by(br) {
            let sq = load_tile(qkv, qg, stride, q0, n, d, br);
            for warp in 0..warps {
                if q0 + warp * 16 >= n {
                    continue; // all 16 rows past the end
                }
                let qa: Vec<AFrag> = (0..kt_n).map(|kt| row_fragment(&sq, ld, warp, kt)).collect();
                let mut o = vec![ACC0; no];
                let (mut m0, mut m1, mut l0, mut l1) = ([f32::NEG_INFINITY; 32], [f32::NEG_INFINITY; 32], [0f32; 32], [0f32; 32]);
                for (kb, (sk, sv)) in kv.iter().enumerate() {
                    let k0 = kb * bc;
                    let full = k0 + bc <= n; // block(BoolC<true>) without any key test
                    let valid = n - k0;
                    // fa_scores<D, NS, !FULL>
                    let mut s = vec![ACC0; ns];
                    for kt in 0..kt_n {
                        for j in (0..ns).step_by(2) {
                            if !full && j * 8 >= valid {
                                continue;
                            }
                            let (b0, b1) = split_b(&ldb_rows2(sk, ld, j * 8, kt * 16));
                            mma(&mut s[j], &qa[kt], &b0);
                            if full || (j + 1) * 8 < valid {
                                mma(&mut s[j + 1], &qa[kt], &b1);
                            }
                        }
                    }
                    // fa_scale_mask_max<NS, !FULL>
                    let (mut mx0, mut mx1) = ([f32::NEG_INFINITY; 32], [f32::NEG_INFINITY; 32]);
                    for lane in 0..32 {
                        let t = lane % 4;
                        for j in 0..ns {
                            for e in 0..4 {
                                let key = j * 8 + 2 * t + (e & 1);
                                s[j][lane][e] = if full || key < valid { s[j][lane][e] * scale_log2 } else { f32::NEG_INFINITY };
                            }
                            mx0[lane] = mx0[lane].max(s[j][lane][0].max(s[j][lane][1]));
                            mx1[lane] = mx1[lane].max(s[j][lane][2].max(s[j][lane][3]));
                        }
                    }
                    quad_reduce(&mut mx0, f32::max);
                    quad_reduce(&mut mx1, f32::max);
                    for lane in 0..32 {
                        let (mn0, mn1) = (m0[lane].max(mx0[lane]), m1[lane].max(mx1[lane]));
                        assert!(mn0.is_finite() && mn1.is_finite());
                        let (al0, al1) = ((m0[lane] - mn0).exp2(), (m1[lane] - mn1).exp2());
                        m0[lane] = mn0;
                        m1[lane] = mn1;
                        // fa_exp2_rows
                        let (mut ps0, mut ps1) = (0f32, 0f32);
                        for j in 0..ns {
                            s[j][lane][0] = (s[j][lane][0] - mn0).exp2();
                            s[j][lane][1] = (s[j][lane][1] - mn0).exp2();
                            s[j][lane][2] = (s[j][lane][2] - mn1).exp2();
                            s[j][lane][3] = (s[j][lane][3] - mn1).exp2();
                            ps0 += s[j][lane][0] + s[j][lane][1];
                            ps1 += s[j][lane][2] + s[j][lane][3];
                        }
                        l0[lane] = l0[lane] * al0 + ps0;
                        l1[lane] = l1[lane] * al1 + ps1;
                        for oj in o.iter_mut() {
                            oj[lane][0] *= al0;
                            oj[lane][1] *= al0;
                            oj[lane][2] *= al1;
                            oj[lane][3] *= al1;
                        }
                    }
                    for kk in 0..bc / 16 {
                        if !full && k0 + kk * 16 >= n {
                            continue;
                        }
                        let pa = acc_to_a(&s, kk);
                        mma_a_tile(&mut o, &pa, sv, ld, kk * 16, 0);
                    }
                }
                // fa_store_out
                quad_reduce(&mut l0, |a, b| a + b);
                quad_reduce(&mut l1, |a, b| a + b);
                for lane in 0..32 {
                    let (g, t) = (lane / 4, lane % 4);
                    let (inv0, inv1) = (1.0 / l0[lane], 1.0 / l1[lane]);
                    let row0 = q0 + warp * 16 + g;
                    let row1 = row0 + 8;
                    let og = bi * n * ostride + hi * d + 2 * t;
                    if row0 < n {
                        for j in 0..no {
                            let p = pack(o[j][lane][0] * inv0, o[j][lane][1] * inv0);
                            out[og + row0 * ostride + j * 8] = p[0];
                            out[og + row0 * ostride + j * 8 + 1] = p[1];
                        }
                        if t == 0 {
                            lse2[bh * n + row0] = m0[lane] + l0[lane].log2();
                        }
                    }
                    if row1 < n {
                        for j in 0..no {
                            let p = pack(o[j][lane][2] * inv1, o[j][lane][3] * inv1);
                            out[og + row1 * ostride + j * 8] = p[0];
                            out[og + row1 * ostride + j * 8 + 1] = p[1];
                        }
                        if t == 0 {
                            lse2[bh * n + row1] = m1[lane] + l1[lane].log2();
                        }
                    }
                }
            }
        }
    }
}

/// `flash_bwd_pre<D>`: a thread's 8-value chunk summed from zero (`dot8_acc`), then the row's
/// D/8 chunk sums added in order; and the chunk's 8 values of the dQ sums zeroed.
fn flash_bwd_pre(delta: &mut [f32], dq_acc: &mut [f32], dout: &[f32], out: &[f32], b: usize, n: usize, h: usize, d: usize) {
    // (the chunks together cover the rows' B·N·H·D values exactly)
    dq_acc[..b * n * h * d].fill(0.0);
    for r in 0..b * n * h {
        let mut acc = 0f32;
        for c in 0..d / 8 {
            let mut part = 0f32;
            for k in r * d + 8 * c..r * d + 8 * c + 8 {
                part += dout[k] * out[k];
            }
            acc += part;
        }
        let hi = r % h;
        let tok = r / h;
        let (ni, bi) = (tok % n, tok / n);
        delta[(bi * h + hi) * n + ni] = acc;
    }
}

/// `fa_bwd_step<D, FQ, QN>` with SKIP = !FQ for one warp's 16 keys (rows 16·warp + g and + 8 of
/// key block k0): Sᵀ and dPᵀ against the step's QN queries (tiles starting at query q0), P from
/// lse2, dSᵀ into `sds` (row stride `lds`), dV += Pᵀ·dO and dK += dSᵀ·Q.
#[allow(clippy::too_many_arguments)]
fn fa_bwd_step(fq: bool, qn: usize, lds: usize, sq: &[f32], sdo: &[f32], slse: &[f32], sdelta: &[f32], sds: &mut [f32], q0: usize, n: usize, keys: &KeyFrags, k0: usize, warp: usize, dk: &mut [Acc], dv: &mut [Acc], d: usize, scale_log2: f32) {
    let skip = !fq;
    let ld = d + 8;
    let (kt_n, ns) = (d / 16, qn / 8);
    let mut p = vec![ACC0; ns];
    let mut dp = vec![ACC0; ns];
    for kt in 0..kt_n {
        let (ka, va) = keys.get(kt);
        for j in (0..ns).step_by(2) {
            if skip && q0 + j * 8 >= n {
                continue;
            }
            let second = !skip || q0 + (j + 1) * 8 < n;
            let (b0, b1) = split_b(&ldb_rows2(sq, ld, j * 8, kt * 16));
            mma(&mut p[j], &ka, &b0);
            if second {
                mma(&mut p[j + 1], &ka, &b1);
            }
            let (b0, b1) = split_b(&ldb_rows2(sdo, ld, j * 8, kt * 16));
            mma(&mut dp[j], &va, &b0);
            if second {
                mma(&mut dp[j + 1], &va, &b1);
            }
        }
    }
    for lane in 0..32 {
        let (g, t) = (lane / 4, lane % 4);
        let r0 = warp * 16 + g;
        let (key0_ok, key1_ok) = (k0 + r0 < n, k0 + r0 + 8 < n);
        for j in 0..ns {
            let qc = j * 8 + 2 * t;
            let (qa_ok, qb_ok) = (fq || q0 + qc < n, fq || q0 + qc + 1 < n);
            let (la, lb, da, db) = (slse[qc], slse[qc + 1], sdelta[qc], sdelta[qc + 1]);
            let pj = &mut p[j][lane];
            pj[0] = if key0_ok && qa_ok { (pj[0] * scale_log2 - la).exp2() } else { 0.0 };
            pj[1] = if key0_ok && qb_ok { (pj[1] * scale_log2 - lb).exp2() } else { 0.0 };
            pj[2] = if key1_ok && qa_ok { (pj[2] * scale_log2 - la).exp2() } else { 0.0 };
            pj[3] = if key1_ok && qb_ok { (pj[3] * scale_log2 - lb).exp2() } else { 0.0 };
            let dj = &mut dp[j][lane];
            dj[0] = pj[0] * (dj[0] - da);
            dj[1] = pj[1] * (dj[1] - db);
            dj[2] = pj[2] * (dj[2] - da);
            dj[3] = pj[3] * (dj[3] - db);
        }
    }
    for kk in 0..qn / 16 {
        if skip && q0 + kk * 16 >= n {
            continue;
        }
        let pa = acc_to_a(&p, kk);
        let sa = acc_to_a(&dp, kk);
        for lane in 0..32 {
            let (g, t) = (lane / 4, lane % 4);
            let r0 = warp * 16 + g;
            for (i, idx) in [r0 * lds + kk * 16 + 2 * t, (r0 + 8) * lds + kk * 16 + 2 * t, r0 * lds + kk * 16 + 8 + 2 * t, (r0 + 8) * lds + kk * 16 + 8 + 2 * t].into_iter().enumerate() {
                assert!(idx % 2 == 0, "unaligned 32-bit dSᵀ store at {idx}");
                sds[idx] = sa[lane][i][0];
                sds[idx + 1] = sa[lane][i][1];
            }
        }
        mma_a_tile(dv, &pa, sdo, ld, kk * 16, 0);
        mma_a_tile(dk, &sa, sq, ld, kk * 16, 0);
    }
}

/// `flash_bwd_pipe<D, BC>` (with `fa_bwd_step`, the dQ phase through `red_add2`, and
/// `fa_store_dkdv`) per block of BC keys, per warp, per lane, the query steps in order.
#[allow(clippy::too_many_arguments)]
fn flash_bwd(tl: BwdTiles, dqkv: &mut [f32], dq_acc: &mut [f32], dout: &[f32], qkv: &[f32], lse2: &[f32], delta: &[f32], b: usize, n: usize, h: usize, d: usize, scale: f32, scale_log2: f32) {
    let BwdTiles { bc, br, key_smem } = tl;
    let warps = bc / 16; // NT = 2·BC threads
    let dsplit = bc / br; // DSPLIT: warp groups sharing the dQ tile's head dim
    let (ld, lds, kt_n, no) = (d + 8, br + 8, d / 16, d / 8);
    let nq = no / dsplit; // NQ: dQ n-tiles per warp
    assert!(br % 16 == 0 && bc % br == 0 && no % dsplit == 0, "{tl:?} at D{d}");
    let stride = 3 * h * d;
    let ostride = h * d;
    for bh in 0..b * h {
        let (bi, hi) = (bh / h, bh % h);
        let qg = bi * n * stride + hi * d;
        let (kg, vg) = (qg + h * d, qg + 2 * h * d);
        let dog = bi * n * ostride + hi * d;
        for k0 in (0..n).step_by(bc) {
            let sk = load_tile(qkv, kg, stride, k0, n, d, bc);
            let sv = load_tile(qkv, vg, stride, k0, n, d, bc);
            // keys.load at the first query step, once K and V are in shared memory
            let keys: Vec<KeyFrags> = (0..warps).map(|warp| KeyFrags::load(key_smem, &sk, &sv, ld, warp, kt_n)).collect();
            let mut dk = vec![vec![ACC0; no]; warps];
            let mut dv = vec![vec![ACC0; no]; warps];
            for q0 in (0..n).step_by(br) {
                let sq = load_tile(qkv, qg, stride, q0, n, d, br);
                let sdo = load_tile(dout, dog, ostride, q0, n, d, br);
                // lse2 and delta through cp.async: zero-filled past n
                let slse: Vec<f32> = (0..br).map(|i| if q0 + i < n { lse2[bh * n + q0 + i] } else { 0.0 }).collect();
                let sdelta: Vec<f32> = (0..br).map(|i| if q0 + i < n { delta[bh * n + q0 + i] } else { 0.0 }).collect();
                let mut sds = vec![f32::NAN; bc * lds];
                let fq = q0 + br <= n;
                for warp in 0..warps {
                    if k0 + warp * 16 >= n {
                        continue; // none of this warp's keys exist
                    }
                    fa_bwd_step(fq, br, lds, &sq, &sdo, &slse, &sdelta, &mut sds, q0, n, &keys[warp], k0, warp, &mut dk[warp], &mut dv[warp], d, scale_log2);
                }
                // __syncthreads(): dSᵀ complete. dQ phase: every warp, its 16 queries and its
                // share of the head dim, over all the block's keys.
                for warp in 0..warps {
                    let qw = (warp % (br / 16)) * 16;
                    let dh = (warp / (br / 16)) * (d / dsplit);
                    if q0 + qw >= n {
                        continue;
                    }
                    let mut dq = vec![ACC0; nq];
                    for kk in 0..bc / 16 {
                        if k0 + kk * 16 >= n {
                            continue;
                        }
                        let a = ds_as_a(&sds, lds, kk * 16, qw);
                        mma_a_tile(&mut dq, &a, &sk, ld, kk * 16, dh);
                    }
                    for lane in 0..32 {
                        let (g, t) = (lane / 4, lane % 4);
                        let qa0 = q0 + qw + g;
                        let qa1 = qa0 + 8;
                        let dqg = bi * n * ostride + hi * d + dh + 2 * t;
                        if qa0 < n {
                            for j in 0..nq {
                                red_add2(dq_acc, dqg + qa0 * ostride + j * 8, dq[j][lane][0] * scale, dq[j][lane][1] * scale);
                            }
                        }
                        if qa1 < n {
                            for j in 0..nq {
                                red_add2(dq_acc, dqg + qa1 * ostride + j * 8, dq[j][lane][2] * scale, dq[j][lane][3] * scale);
                            }
                        }
                    }
                }
            }
            // fa_store_dkdv
            for warp in 0..warps {
                for lane in 0..32 {
                    let (g, t) = (lane / 4, lane % 4);
                    let r0 = warp * 16 + g;
                    let dkg = bi * n * stride + h * d + hi * d + 2 * t;
                    let dvg = dkg + h * d;
                    let (key0, key1) = (k0 + r0, k0 + r0 + 8);
                    for (key, e0) in [(key0, 0usize), (key1, 2)] {
                        if key < n {
                            for j in 0..no {
                                let pk = pack(dk[warp][j][lane][e0] * scale, dk[warp][j][lane][e0 + 1] * scale);
                                let pv = pack(dv[warp][j][lane][e0], dv[warp][j][lane][e0 + 1]);
                                dqkv[dkg + key * stride + j * 8] = pk[0];
                                dqkv[dkg + key * stride + j * 8 + 1] = pk[1];
                                dqkv[dvg + key * stride + j * 8] = pv[0];
                                dqkv[dvg + key * stride + j * 8 + 1] = pv[1];
                            }
                        }
                    }
                }
            }
        }
    }
}

fn flash_dq_store(dqkv: &mut [f32], dq_acc: &[f32], rows: usize, hd8: usize) {
    for e in 0..rows * hd8 {
        let (r, c) = (e / hd8, e % hd8);
        for i in 0..8 {
            dqkv[r * 3 * hd8 * 8 + c * 8 + i] = bf(dq_acc[e * 8 + i]);
        }
    }
}

#[test]
fn fused_attention_kernels_match_cpu() {
    let (mut rng, seed) = common::fresh_rng();
    let cpu = Cpu::new();
    type Shape = (usize, usize, usize, usize); // (B, N, H, D)
    let shapes: [Shape; 20] = [
        (2, 65, 2, 64),
        (1, 197, 2, 64),
        (2, 50, 2, 64),
        (2, 17, 3, 32),
        (1, 130, 1, 32),
        (1, 64, 1, 64),
        (1, 80, 1, 64),
        (1, 100, 2, 32),
        (1, 257, 1, 64),
        (1, 257, 1, 80),
        (2, 41, 1, 80),
        (1, 145, 1, 96),
        (1, 77, 2, 96),
        (1, 133, 1, 128),
        (2, 29, 1, 128),
        (1, 192, 1, 128),
        (2, 256, 1, 96),
        (1, 1030, 1, 32),
        (1, 1100, 1, 80),
        (1, 1027, 1, 128),
    ];
    for d in PIPE_HEAD_DIMS {
        assert!(shapes.iter().any(|s| s.3 == d), "no shape at head dim {d}");
    }
    // Every shape in the tiled geometry: the backward the host launches for D, the forward with
    // the query block the host takes for N (its out and lse2 feed the backward) and with the
    // other one — per block the forward's arithmetic does not depend on N, so 128-query blocks
    // are tested below LONG_QUERY_BLOCK_FROM tokens too. Then the small-head geometry wherever
    // the host picks it (N ≤ 80 at D 32 and 64: W = 4 up to 64 tokens, else 5).
    let mut runs: Vec<(Vec<FwdTiles>, BwdTiles, Shape)> = Vec::new();
    for &(b, n, h, d) in &shapes {
        let host = pipe_fwd(n);
        runs.push((vec![host, FwdTiles { br: if host.br == 64 { 128 } else { 64 }, ..host }], pipe_bwd(d), (b, n, h, d)));
    }
    for &(b, n, h, d) in &shapes {
        if let (Some(w), true) = (small_head_warps(n), SHORT_HEAD_DIMS.contains(&d)) {
            runs.push((vec![FwdTiles { br: 16 * w, bc: 16 * w }], BwdTiles { bc: 16 * w, br: 16 * w, key_smem: false }, (b, n, h, d)));
        }
    }
    for (fwds, bwd, (b, n, h, d)) in runs {
        let c = h * d;
        let mut randn = |len: usize| -> Vec<f32> {
            (0..len)
                .map(|_| {
                    let u1: f32 = rng.gen_range(1e-7f32..1.0);
                    let u2: f32 = rng.gen();
                    bf((-2.0 * u1.ln()).sqrt() * (std::f32::consts::TAU * u2).cos())
                })
                .collect()
        };
        let qkv = randn(b * n * 3 * c);
        let dout = randn(b * n * c);
        // reference
        let mut out_c = vec![0f32; b * n * c];
        let mut probs = vec![0f32; b * h * n * n];
        cpu.attention_forward(&mut out_c, &mut probs, &qkv, b, n, h, d).unwrap();
        let mut dqkv_c = vec![0f32; b * n * 3 * c];
        cpu.attention_backward(&mut dqkv_c, &dout, &qkv, &out_c, &probs, b, n, h, d).unwrap();
        // lse2 against the reference: log2 Σ_j 2^(s_ij·scale·log2e)
        let scale = 1.0 / (d as f32).sqrt();
        let scale_log2 = std::f32::consts::LOG2_E * scale;
        let mut lse_ref = vec![0f32; b * h * n];
        for bi in 0..b {
            for hi in 0..h {
                for i in 0..n {
                    let mut row: Vec<f64> = Vec::with_capacity(n);
                    for j in 0..n {
                        let mut s = 0f64;
                        for k in 0..d {
                            s += qkv[((bi * n + i) * 3) * c + hi * d + k] as f64 * qkv[((bi * n + j) * 3 + 1) * c + hi * d + k] as f64;
                        }
                        row.push(s * scale_log2 as f64);
                    }
                    let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    lse_ref[(bi * h + hi) * n + i] = (m + row.iter().map(|v| (v - m).exp2()).sum::<f64>().log2()) as f32;
                }
            }
        }
        // emulated kernels, outputs poisoned; the first forward feeds the backward
        let mut fwd_outs = Vec::new();
        for &fwd in &fwds {
            let mut out = vec![f32::NAN; b * n * c];
            let mut lse2 = vec![f32::NAN; b * h * n];
            flash_fwd(fwd, &mut out, &mut lse2, &qkv, b, n, h, d, scale_log2);
            let e_out = rel_err(&out, &out_c);
            let max_lse = lse2.iter().zip(&lse_ref).map(|(a, b)| if a.is_nan() { f32::NAN } else { (a - b).abs() }).fold(0f32, |m, e| if e.is_nan() || m.is_nan() { f32::NAN } else { m.max(e) });
            println!("{fwd:?} seed {seed} B{b} N{n} H{h} D{d}: out {e_out:.2e}, max |lse2 − ref| {max_lse:.2e}");
            assert!(e_out.is_finite() && e_out < 1e-2, "{fwd:?} seed {seed} B{b} N{n} H{h} D{d}: out rel err {e_out}");
            assert!(max_lse.is_finite() && max_lse < 1e-3, "{fwd:?} seed {seed} B{b} N{n} H{h} D{d}: lse2 error {max_lse}");
            fwd_outs.push((out, lse2));
        }
        let (out, lse2) = &fwd_outs[0];
        let mut delta = vec![f32::NAN; b * h * n];
        // (NaN: every value the backward reduces into must have been zeroed by the pre-pass)
        let mut dq_acc = vec![f32::NAN; b * n * c];
        flash_bwd_pre(&mut delta, &mut dq_acc, &dout, out, b, n, h, d);
        let mut dqkv = vec![f32::NAN; b * n * 3 * c];
        flash_bwd(bwd, &mut dqkv, &mut dq_acc, &dout, &qkv, lse2, &delta, b, n, h, d, scale, scale_log2);
        flash_dq_store(&mut dqkv, &dq_acc, b * n, c / 8);
        let e_dqkv = rel_err(&dqkv, &dqkv_c);
        // per slot (q, k, v) errors, to point at the failing part
        let slot = |v: &[f32], s: usize| -> Vec<f32> { v.chunks(c).skip(s).step_by(3).flatten().copied().collect() };
        let errs: Vec<f64> = (0..3).map(|s| rel_err(&slot(&dqkv, s), &slot(&dqkv_c, s))).collect();
        println!("{bwd:?} seed {seed} B{b} N{n} H{h} D{d}: dqkv {e_dqkv:.2e} (dq {:.2e} dk {:.2e} dv {:.2e})", errs[0], errs[1], errs[2]);
        assert!(e_dqkv.is_finite() && e_dqkv < 1e-2, "{bwd:?} seed {seed} B{b} N{n} H{h} D{d}: dqkv rel err {e_dqkv} (dq, dk, dv {errs:?})");
    }
}

// ---- The emulation against the kernel source it transcribes.

const FLASH_CU: &str = include_str!("../src/backend/cuda/kernels/flash.cu");
/// The conversions flash.cu calls (`f2bf2`, `lo16`, `hi16`) and its mma operand type
/// (`HALF_PTX`) are common.cuh's, per 16-bit format; the emulation is of the bf16 build.
const COMMON_CUH: &str = include_str!("../src/backend/cuda/kernels/common.cuh");

/// The one host source file of the CUDA backend (`src/backend/cuda/*.rs`) that contains `needle`,
/// as (file name, text).
fn host_source_with(needle: &str) -> (String, String) {
    let dir = common::repo_path("src/backend/cuda");
    let mut found = Vec::new();
    for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = entry.expect("directory entry").path();
        if path.extension().is_some_and(|e| e == "rs") {
            let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            if text.contains(needle) {
                found.push((path.file_name().unwrap().to_string_lossy().into_owned(), text));
            }
        }
    }
    assert_eq!(found.len(), 1, "`{needle}` is in {} of the CUDA backend's host files: {:?}", found.len(), found.iter().map(|f| &f.0).collect::<Vec<_>>());
    found.pop().unwrap()
}

/// The flash.cu functions this file transcribes: (how the definition starts, which part of the
/// emulation mirrors it, fingerprint of the definition the emulation was last checked against).
/// After an edit of one of them: re-check the emulation against the new text, change it where
/// needed, run this test, and pin the fingerprint it prints.
const KERNEL_FUNCTIONS: &[(&str, &str, u64)] = &[
    ("void mma_bf16(", "mma", 0x1088_a553_0d35_b67d),
    ("unsigned pack_bf16(", "pack", 0x4e42_1eb1_667b_4314),
    ("unsigned ld2(", "ld2", 0x1ced_7b9b_f383_ebaf),
    ("void ldb_row(", "the B fragment layout ldb_rows2 is checked against", 0x3f38_6ffb_bb25_d1e1),
    ("void ldsm_x4(", "ldsm_x4, ldsm_x4_t", 0x7f2f_d431_be7a_cc8a),
    ("void ldb_rows2(", "ldb_rows2", 0xba4a_5089_9a65_5a64),
    ("void ldb_t2(", "ldb_t2", 0xe862_9471_692f_0678),
    ("void acc_to_a(", "the pa / sa packing", 0xbb9b_da65_a26e_ce00),
    ("void fa_zero(", "zeroed accumulators", 0xe224_ce5c_4de5_fff3),
    ("void fa_row_fragment(", "row_fragment", 0x2952_0155_57c1_4460),
    ("void fa_row_fragments(", "row_fragment over k-steps: qa, KeyFrags::Regs", 0xb0ea_b23b_58c6_a6ee),
    ("struct KeyRegs {", "KeyFrags::Regs", 0xe58f_a601_a7ae_64d5),
    ("struct KeySmem {", "KeyFrags::Smem", 0xa72b_c37f_c745_ec20),
    ("void fa_scores(", "flash_fwd: scores", 0x645b_d18d_2c47_f9dd),
    ("void fa_scale_mask_max(", "flash_fwd: scale, mask, row maxima", 0x091c_6efd_167c_264f),
    ("void fa_exp2_rows(", "flash_fwd: exp2 and row sums", 0x55db_3d35_bed1_c483),
    ("void mma_a_tile(", "mma_a_tile", 0x7631_a603_2c2e_8dc5),
    ("void ds_as_a(", "ds_as_a", 0xcccb_a64f_21e1_9379),
    ("float dot8_acc(", "flash_bwd_pre", 0xeb52_2398_783a_83a2),
    ("void flash_bwd_pre(", "flash_bwd_pre", 0x2084_afde_85cd_2ead),
    ("void flash_dq_store(", "flash_dq_store", 0x83b5_4c2f_be1a_9c0d),
    ("void fa_load_tile_async(", "load_tile", 0xc911_a432_f1d8_b686),
    ("constexpr int fa_bwd_keys(", "pipe_bwd: keys a block", 0x1b5c_0100_323b_4701),
    ("void red_add2(", "red_add2", 0x3811_8ce0_7b83_308c),
    ("void fa_store_out(", "flash_fwd: normalization and stores", 0x9e4b_334e_b81f_6d75),
    ("void flash_fwd_pipe(", "flash_fwd", 0x3bee_41bd_e98d_26d9),
    ("void fa_bwd_step(", "fa_bwd_step", 0x40e7_cfe6_f4b0_6edb),
    ("void fa_store_dkdv(", "flash_bwd: dK / dV stores", 0xf086_dca7_73fc_2009),
    ("void flash_bwd_pipe(", "flash_bwd: key blocks, the dQ phase", 0x1e69_6c35_f443_b5c3),
    ("void fa_load_rows_async(", "load_tile (small-head geometry)", 0x62cd_034b_5b0c_69db),
    ("void flash_fwd_small(", "flash_fwd at the small-head geometry", 0xba94_2025_af9a_6ab7),
    ("void flash_bwd_small(", "flash_bwd at the small-head geometry", 0x98a9_7fa7_0429_f641),
];

/// Source text without comments, with whitespace dropped except one blank between two word
/// characters: layout and comment edits keep a fingerprint, any change of tokens does not.
fn normalized(src: &str) -> String {
    let word = |c: char| c.is_ascii_alphanumeric() || c == '_';
    let mut out = String::with_capacity(src.len());
    let mut chars = src.chars().peekable();
    let (mut in_str, mut pending_space) = (false, false);
    while let Some(c) = chars.next() {
        if in_str {
            out.push(c);
            if c == '\\' {
                out.extend(chars.next());
            } else if c == '"' {
                in_str = false;
            }
            continue;
        }
        if c == '/' && chars.peek() == Some(&'/') {
            while chars.peek().is_some_and(|&n| n != '\n') {
                chars.next();
            }
            pending_space = true;
            continue;
        }
        if c == '/' && chars.peek() == Some(&'*') {
            chars.next();
            let mut prev = ' ';
            for n in chars.by_ref() {
                if prev == '*' && n == '/' {
                    break;
                }
                prev = n;
            }
            pending_space = true;
            continue;
        }
        if c.is_whitespace() {
            pending_space = true;
            continue;
        }
        if pending_space && word(c) && out.chars().last().is_some_and(word) {
            out.push(' ');
        }
        pending_space = false;
        out.push(c);
        in_str = c == '"';
    }
    out
}

/// The definition that starts with `start` (exactly one in `src`): its `template <…>` line if one
/// precedes it, through the closing brace of its body.
fn definition<'a>(src: &'a str, start: &str) -> &'a str {
    let hits: Vec<usize> = src.match_indices(start).map(|(i, _)| i).collect();
    assert_eq!(hits.len(), 1, "`{start}` occurs {} times in the source", hits.len());
    let at = hits[0];
    let line = src[..at].rfind('\n').map_or(0, |i| i + 1);
    let from = match src[..line.saturating_sub(1)].rfind('\n').map(|i| i + 1) {
        Some(prev) if src[prev..line].trim_start().starts_with("template") => prev,
        _ => line,
    };
    let open = at + src[at..].find('{').unwrap_or_else(|| panic!("`{start}`: no body"));
    let (mut depth, mut in_str, mut esc) = (0usize, false, false);
    for (i, c) in src[open..].char_indices() {
        if in_str {
            match (esc, c) {
                (true, _) => esc = false,
                (false, '\\') => esc = true,
                (false, '"') => in_str = false,
                _ => {}
            }
            continue;
        }
        match c {
            '"' => in_str = true,
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return &src[from..open + i + 1];
                }
            }
            _ => {}
        }
    }
    panic!("`{start}`: unbalanced braces")
}

/// FNV-1a, 64 bit.
fn fingerprint(text: &str) -> u64 {
    text.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3))
}

/// Whether `expr` (normalized) occurs in the normalized definition starting with `start`.
fn defines(src: &str, start: &str, expr: &str) -> bool {
    normalized(definition(src, start)).contains(&normalized(expr))
}

/// Text with the preprocessor's line splices (backslash, newline) joined: a macro's body as one line.
fn spliced(src: &str) -> String {
    src.replace("\\\n", " ")
}

#[test]
fn emulated_kernel_source_is_unchanged() {
    let mut problems = Vec::new();
    // Constants the emulation's geometry is built from: the forward's key tile and the
    // backward's query step.
    for (line, what) in [("#define FA_BC 64", "FwdTiles.bc of the tiled forward"), ("#define FA_BR 64", "BwdTiles.br of the tiled backward")] {
        if !FLASH_CU.lines().any(|l| l.trim() == line) {
            problems.push(format!("flash.cu lacks `{line}` ({what})"));
        }
    }
    // The tiled kernels the test runs: FA_PIPE(D) for exactly the head dims of PIPE_HEAD_DIMS,
    // each a forward with 64- and with 128-query blocks and a backward with fa_bwd_keys<D>() keys
    // a block (pipe_fwd, pipe_bwd), key fragments by KeyFrags<D> (pipe_bwd's key_smem).
    let pipes: Vec<&str> = FLASH_CU.lines().map(str::trim).filter(|l| l.starts_with("FA_PIPE(")).collect();
    let want: Vec<String> = PIPE_HEAD_DIMS.iter().map(|d| format!("FA_PIPE({d})")).collect();
    if pipes != want {
        problems.push(format!("flash.cu instantiates {pipes:?}, the test runs {want:?} (PIPE_HEAD_DIMS)"));
    }
    let cu = normalized(&spliced(FLASH_CU));
    for (expr, emulated) in [
        ("void flash_fwd_d##D##_pipe(bf16* out, float* lse2, const bf16* qkv, int n, int h, float scale_log2) { flash_fwd_pipe<D, 64>(", "pipe_fwd: 64 queries a block"),
        ("void flash_fwd_d##D##_pipe128(bf16* out, float* lse2, const bf16* qkv, int n, int h, float scale_log2) { flash_fwd_pipe<D, 128>(", "pipe_fwd: 128 queries a block"),
        ("flash_bwd_pipe<D, fa_bwd_keys<D>()>(", "pipe_bwd: its keys a block"),
        ("template <int D> constexpr int fa_bwd_keys() { return (D / 2) % 16 == 0 ? 128 : 64; }", "pipe_bwd's bc"),
        ("template <bool C, class A, class B> struct PickT { using type = A; };", "pipe_bwd's key_smem"),
        ("template <class A, class B> struct PickT<false, A, B> { using type = B; };", "pipe_bwd's key_smem"),
        ("template <int D> using KeyFrags = typename PickT<(D > 64), KeySmem<D>, KeyRegs<D>>::type;", "pipe_bwd's key_smem: KeySmem above D 64"),
    ] {
        if !cu.contains(&normalized(expr)) {
            problems.push(format!("flash.cu no longer has `{expr}` ({emulated})"));
        }
    }
    // The small-head kernels the test runs exist for both head dims and both W.
    for w in [4, 5] {
        for d in SHORT_HEAD_DIMS {
            let inst = format!("FA_SMALL({d}, {w})");
            if !FLASH_CU.lines().any(|l| l.trim() == inst) {
                problems.push(format!("flash.cu lacks `{inst}`, which the small-head geometry emulates"));
            }
        }
    }
    // The host's head-dim lists and query-block threshold are the test's.
    for (decl, what) in [
        (format!("const PIPE_HEAD_DIMS: [usize; {}] = {PIPE_HEAD_DIMS:?};", PIPE_HEAD_DIMS.len()), "the tiled kernels' head dims, each run here"),
        (format!("const SHORT_HEAD_DIMS: [usize; {}] = {SHORT_HEAD_DIMS:?};", SHORT_HEAD_DIMS.len()), "the small-head geometry's head dims"),
        (format!("const LONG_QUERY_BLOCK_FROM: usize = {LONG_QUERY_BLOCK_FROM};"), "pipe_fwd's threshold"),
    ] {
        let name = decl.split(':').next().unwrap();
        let (file, host) = host_source_with(name);
        if !normalized(&host).contains(&normalized(&decl)) {
            problems.push(format!("backend/cuda/{file} no longer has `{decl}` ({what})"));
        }
    }
    // The host launches what pipe_fwd, pipe_bwd and small_head_warps say.
    for (func, expr, emulated) in [
        ("fn pipe_keys(", "if (d / 2) % 16 == 0 { 128 } else { 64 }", "pipe_bwd's bc"),
        ("fn fused_attention(", "if !PIPE_HEAD_DIMS.contains(&d) { return None; }", "PIPE_HEAD_DIMS: the tiled kernels"),
        ("fn fused_attention(", r#"format!("d{d}_pipe")"#, "the tiled kernels' names"),
        ("fn attention_forward_impl(", r#"if n > LONG_QUERY_BLOCK_FROM { (128, format!("flash_fwd_{sfx}128")"#, "pipe_fwd: 128 queries a block"),
        ("fn attention_forward_impl(", r#"} else { (64, format!("flash_fwd_{sfx}"), smem) };"#, "pipe_fwd: 64 queries a block"),
        ("fn attention_forward_impl(", "let grid = (n.div_ceil(br) as u32, (b * h) as u32, 1);", "pipe_fwd: BR queries a block"),
        ("fn attention_forward_impl(", "(2 * br as u32, 1, 1)", "pipe_fwd: BR/16 warps"),
        ("fn attention_backward_kernels(", "let bc = pipe_keys(d);", "pipe_bwd's bc"),
        ("fn attention_backward_kernels(", "let g = (n.div_ceil(bc) as u32, (b * h) as u32, 1);", "pipe_bwd: BC keys a block"),
        ("fn attention_backward_kernels(", "(2 * bc as u32, 1, 1)", "pipe_bwd: BC/16 warps"),
        ("fn small_attention(", "n > 80", "small_head_warps"),
        ("fn small_attention(", "let w = if n <= 64 { 4 } else { 5 };", "small_head_warps"),
        ("fn small_attention(", "!SHORT_HEAD_DIMS.contains(&d)", "the small-head geometry's head dims"),
    ] {
        let (file, host) = host_source_with(func);
        if !defines(&host, func, expr) {
            problems.push(format!("`{func}…` in backend/cuda/{file} no longer has `{expr}` ({emulated})"));
        }
    }
    // The bf16 build (no VITSCALE_HALF_F16) of what flash.cu takes from common.cuh: bf16 mma
    // operands, round-to-nearest-even packing with lo in the low half, and bf16 words widened
    // by a shift (low half) or a mask (high half).
    let bf16_build = COMMON_CUH.split("\n#define HALF_PTX \"bf16\"\n").nth(1).map(|t| t.split("\n#endif").next().unwrap_or(""));
    for line in [
        "__device__ __forceinline__ unsigned f2bf2(float lo, float hi) { return f2bf16x2(lo, hi); }",
        "__device__ __forceinline__ float lo16(unsigned w) { return __uint_as_float(w << 16); }",
        "__device__ __forceinline__ float hi16(unsigned w) { return __uint_as_float(w & 0xffff0000u); }",
    ] {
        if !bf16_build.is_some_and(|t| t.lines().any(|l| l.trim() == line)) {
            problems.push(format!("common.cuh's bf16 build no longer has `{line}`"));
        }
    }
    if !defines(COMMON_CUH, "unsigned f2bf16x2(", r#"asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));"#) {
        problems.push("common.cuh's f2bf16x2 no longer packs by cvt.rn.bf16x2.f32 with lo in the low half".into());
    }
    // Expressions the emulation copies: (definition, text that must be in it, emulated where).
    for (start, expr, emulated) in [
        ("void mma_bf16(", r#""mma.sync.aligned.m16n8k16.row.col.f32." HALF_PTX "." HALF_PTX ".f32"#, "mma"),
        ("unsigned pack_bf16(", "return f2bf2(lo, hi);", "pack: lo in the low half, round to nearest even"),
        ("void ldb_rows2(", "s + (n0 + (mi >> 1) * 8 + (lane & 7)) * ld + k0 + (mi & 1) * 8", "ldb_rows2"),
        ("void ldb_t2(", "ldsm_x4<true>(r, s + (k0 + (mi & 1) * 8 + (lane & 7)) * ld + c0 + (mi >> 1) * 8)", "ldb_t2"),
        ("void ds_as_a(", "a[0] = r[0]; a[1] = r[2]; a[2] = r[1]; a[3] = r[3];", "ds_as_a"),
        ("void fa_scale_mask_max(", "const int key = j * 8 + 2 * t + (e & 1);", "flash_fwd's key mask"),
        ("void fa_store_out(", "lse2[(i64)bh * n + row0] = m0 + log2f(l0);", "flash_fwd's lse2"),
        ("void flash_fwd_pipe(", "constexpr int NT = 2 * BR;", "flash_fwd: BR/16 warps"),
        ("void flash_fwd_pipe(", "const int q0 = blockIdx.x * BR;", "flash_fwd: BR queries a block"),
        ("void fa_bwd_step(", "keys.get(kt, ka, va);", "fa_bwd_step: KeyFrags::get"),
        ("void fa_bwd_step(", "p[j][0] = key0_ok && qa_ok ? exp2f(p[j][0] * scale_log2 - la) : 0.f;", "fa_bwd_step's P"),
        ("void fa_bwd_step(", "dp[j][0] = p[j][0] * (dp[j][0] - da);", "fa_bwd_step's dS"),
        ("void fa_store_dkdv(", "pack_bf16(dk[j][0] * scale, dk[j][1] * scale)", "flash_bwd's dK scaling"),
        ("void fa_store_dkdv(", "pack_bf16(dv[j][0], dv[j][1])", "flash_bwd's dV (unscaled)"),
        ("void flash_bwd_pipe(", "constexpr int NT = 2 * BC;", "flash_bwd: BC/16 warps"),
        ("void flash_bwd_pipe(", "constexpr int DSPLIT = BC / FA_BR;", "flash_bwd's dQ phase: dsplit"),
        ("void flash_bwd_pipe(", "constexpr int NQ = NO / DSPLIT;", "flash_bwd's dQ phase: nq"),
        ("void flash_bwd_pipe(", "const int qw = (warp % (FA_BR / 16)) * 16;", "flash_bwd's dQ phase: qw"),
        ("void flash_bwd_pipe(", "const int dh = (warp / (FA_BR / 16)) * (D / DSPLIT);", "flash_bwd's dQ phase: dh"),
        ("void flash_bwd_pipe(", "mma_a_tile(dq, a, sk, LD, kk * 16, dh, lane);", "flash_bwd's dQ phase"),
        ("void flash_bwd_pipe(", "float* dqg = dq_acc + (i64)bi * n * ostride + hi * D + dh + 2 * t;", "flash_bwd's dQ accumulation"),
        ("void flash_bwd_pipe(", "red_add2(dqg + qa0 * ostride + j * 8, dq[j][0] * scale, dq[j][1] * scale);", "flash_bwd's dQ accumulation"),
        ("void red_add2(", "atomicAdd((float2*)p, make_float2(a, b));", "red_add2"),
        ("void fa_load_tile_async(", "cp_async16(s + r * (D + 8) + c * 8, ok ? g + (i64)(row0 + r) * stride + c * 8 : g, ok);", "load_tile: rows of D + 8, zeros past n"),
    ] {
        if !defines(FLASH_CU, start, expr) {
            problems.push(format!("`{start}…` in flash.cu no longer has `{expr}` ({emulated})"));
        }
    }
    // Every transcribed definition is the text the emulation was checked against.
    for &(start, emulated, pinned) in KERNEL_FUNCTIONS {
        let got = fingerprint(&normalized(definition(FLASH_CU, start)));
        if got != pinned {
            problems.push(format!("`{start}…` changed (emulated by {emulated}): fingerprint {got:#018x}, pinned {pinned:#018x}"));
        }
    }
    assert!(
        problems.is_empty(),
        "flash.cu is not the source this emulation was checked against:\n  {}\nRe-check the emulation against the kernel source and update it, then pin the new fingerprints in KERNEL_FUNCTIONS.",
        problems.join("\n  ")
    );
}

#[test]
fn normalization_keeps_tokens_and_drops_comments_and_layout() {
    assert_eq!(normalized("a  +\n  b // note\n/* x */ int  c;"), "a+b int c;");
    assert_eq!(normalized(r#"asm("x // y"); // z"#), r#"asm("x // y");"#);
    assert_ne!(fingerprint(&normalized("x = a * b;")), fingerprint(&normalized("x = a * c;")));
    let src = "// lead\ntemplate <int D>\n__device__ void f(int x) {\n  if (x) { g(\"}\"); }\n}\nvoid h() {}\n";
    assert_eq!(definition(src, "void f("), "template <int D>\n__device__ void f(int x) {\n  if (x) { g(\"}\"); }\n}");
}
