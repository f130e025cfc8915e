//! Sequence parallelism for the ViT, DeepSpeed-Ulysses' scheme: the tokens of each image are
//! split over the `size` ranks of a group (consecutive ranks, `Comm::split_groups`), and
//! everything but the attention runs on a rank's own tokens. Around each attention an
//! all-to-all trades tokens for heads and back:
//!
//! ```text
//! qkv   (B, n_r, 3, H, D)     all tokens' queries/keys/values → (B, N, 3, H/SP, D)
//! attention over all N tokens for this rank's H/SP heads
//! att   (B, N, H/SP, D)       → (B, n_r, H, D) this rank's tokens, every head
//! ```
//!
//! and the backward runs the same exchanges the other way (dqkv heads → tokens, datt tokens →
//! heads). Rank r of the group holds tokens `tokens(N, r)`: N split into `size` runs whose
//! lengths differ by at most one (no padding tokens, so no attention mask); the all-to-all
//! blocks are padded to the longest run and the padding is dropped on arrival. Token 0, the
//! class token, is rank 0's. The pool gathers what the head reads: the class token from rank 0
//! (the others add zeros), or the mean over every patch token as the group's sum of partial
//! sums. The pooled features are then the same on every rank of the group, so every rank runs
//! the final norm, the head and the loss on them; only rank 0 keeps their parameter
//! gradients, so the gradient summed over the group counts each image once (see `Vit`).
//!
//! The exchanges pack and unpack with `Backend::copy_strided` (a kernel on a GPU, so the
//! activations never leave the device) around one `Comm::all_to_all` of a staging buffer in
//! the compute dtype (bf16 on a GPU: the values are bf16 already, so nothing is rounded on the
//! way), while the pool's partial sums are added over the group in f32 and rounded once, as
//! the backend's own pool rounds its f32 sum.

use std::ops::Range;

use crate::backend::{BResult, Backend, BackendError, StridedCopy};
use crate::comm::{Comm, ReduceOp, Span};

/// This rank's place in its sequence-parallel group and the group's communicator.
pub struct SeqParallel<B: Backend> {
    comm: Box<dyn Comm<B::Buf>>,
    /// Rank within the group (0 holds the class token).
    pub rank: usize,
    /// Ranks in the group (`sequence_parallel_size`).
    pub size: usize,
    /// Staging buffer of the all-to-alls, grown on demand: in the compute dtype, so what the
    /// activations hold travels exactly, in the fewest bytes.
    xfer: Option<B::Buf>,
    /// The pool's f32 partial sums, reduced over the group (grown on demand).
    pool_sum: Option<B::Buf>,
}

/// Run `r` of `n` tokens split over `size` ranks: lengths differ by at most one, longer first.
pub fn tokens(n: usize, size: usize, r: usize) -> Range<usize> {
    let (base, rem) = (n / size, n % size);
    let start = r * base + r.min(rem);
    start..start + base + usize::from(r < rem)
}

fn comm_err(e: crate::comm::CommError) -> BackendError {
    BackendError::Device(format!("sequence-parallel group: {e}"))
}

/// `slot`'s buffer, allocated (f32 when `f32`, else in the compute dtype) or grown to at least
/// `len` values.
fn grown<'a, B: Backend>(be: &B, slot: &'a mut Option<B::Buf>, len: usize, f32: bool) -> BResult<&'a mut B::Buf> {
    if slot.as_ref().is_none_or(|x| be.len(x) < len) {
        *slot = Some(if f32 { be.alloc_f32(len)? } else { be.alloc(len)? });
    }
    slot.as_mut().ok_or_else(|| BackendError::Device("sequence-parallel buffer missing".into()))
}

impl<B: Backend> SeqParallel<B> {
    /// The group of `comm` (`Comm::split_groups`' communicator).
    pub fn new(comm: Box<dyn Comm<B::Buf>>) -> Self {
        let (rank, size) = (comm.rank(), comm.world_size());
        SeqParallel { comm, rank, size, xfer: None, pool_sum: None }
    }

    /// This rank's tokens of an image of `n`.
    pub fn local(&self, n: usize) -> Range<usize> {
        tokens(n, self.size, self.rank)
    }

    /// The longest run of tokens a rank of the group holds (the all-to-alls' block length).
    pub fn max_tokens(&self, n: usize) -> usize {
        n.div_ceil(self.size)
    }

    /// `dst` (B, N, parts, H/SP, D) ← `src` (B, n_r, parts, H, D): every token of the image for
    /// this rank's heads (qkv before the attention, datt before its backward).
    #[allow(clippy::too_many_arguments)]
    pub fn tokens_to_heads(&mut self, be: &B, dst: &mut B::Buf, src: &B::Buf, b: usize, n: usize, parts: usize, h: usize, d: usize) -> BResult<()> {
        let (sp, hd, m) = (self.size, h / self.size * d, self.max_tokens(n));
        let mine = self.local(n);
        let block = b * m * parts * hd;
        let x = grown(be, &mut self.xfer, sp * block, false)?;
        // block j of the staging buffer: this rank's tokens (padded to m; the padding rows hold
        // whatever an earlier exchange left and are dropped on arrival), heads of rank j
        be.copy_strided(x, src, &StridedCopy {
            count: [sp, b, mine.len() * parts],
            len: hd,
            src_off: 0,
            src_stride: [hd, mine.len() * parts * h * d, h * d],
            dst_off: 0,
            dst_stride: [block, m * parts * hd, hd],
        })?;
        self.comm.all_to_all(x, Span { off: 0, len: sp * block }).map_err(comm_err)?;
        // block j arrived from rank j: its tokens, this rank's heads
        for j in 0..sp {
            let theirs = tokens(n, sp, j);
            be.copy_strided(dst, x, &StridedCopy {
                count: [1, b, theirs.len()],
                len: parts * hd,
                src_off: j * block,
                src_stride: [0, m * parts * hd, parts * hd],
                dst_off: theirs.start * parts * hd,
                dst_stride: [0, n * parts * hd, parts * hd],
            })?;
        }
        Ok(())
    }

    /// `dst` (B, n_r, parts, H, D) ← `src` (B, N, parts, H/SP, D): this rank's tokens for every
    /// head (the attention's output, the qkv gradient).
    #[allow(clippy::too_many_arguments)]
    pub fn heads_to_tokens(&mut self, be: &B, dst: &mut B::Buf, src: &B::Buf, b: usize, n: usize, parts: usize, h: usize, d: usize) -> BResult<()> {
        let (sp, hd, m) = (self.size, h / self.size * d, self.max_tokens(n));
        let mine = self.local(n);
        let block = b * m * parts * hd;
        let x = grown(be, &mut self.xfer, sp * block, false)?;
        // block j: rank j's tokens (padded to m), this rank's heads
        for j in 0..sp {
            let theirs = tokens(n, sp, j);
            be.copy_strided(x, src, &StridedCopy {
                count: [1, b, theirs.len()],
                len: parts * hd,
                src_off: theirs.start * parts * hd,
                src_stride: [0, n * parts * hd, parts * hd],
                dst_off: j * block,
                dst_stride: [0, m * parts * hd, parts * hd],
            })?;
        }
        self.comm.all_to_all(x, Span { off: 0, len: sp * block }).map_err(comm_err)?;
        // block j arrived from rank j: this rank's tokens, rank j's heads
        be.copy_strided(dst, x, &StridedCopy {
            count: [sp, b, mine.len() * parts],
            len: hd,
            src_off: 0,
            src_stride: [block, m * parts * hd, hd],
            dst_off: 0,
            dst_stride: [hd, mine.len() * parts * h * d, h * d],
        })
    }

    /// `dst` (B, n_r, C) ← this rank's rows of `src` (B, N, C).
    pub fn take_tokens(&self, be: &B, dst: &mut B::Buf, src: &B::Buf, b: usize, n: usize, c: usize) -> BResult<()> {
        let mine = self.local(n);
        let rows = mine.len() * c;
        be.copy_strided(dst, src, &StridedCopy { count: [1, 1, b], len: rows, src_off: mine.start * c, src_stride: [0, 0, n * c], dst_off: 0, dst_stride: [0, 0, rows] })
    }

    /// `dst` (B, N, C) ← `src` (B, n_r, C) in this rank's rows, zeros in every other rank's:
    /// the embedding's output gradient, whose parameter gradients then cover this rank's tokens.
    pub fn put_tokens(&self, be: &B, dst: &mut B::Buf, src: &B::Buf, b: usize, n: usize, c: usize) -> BResult<()> {
        let mine = self.local(n);
        let rows = mine.len() * c;
        be.fill(dst, 0.0)?;
        be.copy_strided(dst, src, &StridedCopy { count: [1, 1, b], len: rows, src_off: 0, src_stride: [0, 0, rows], dst_off: mine.start * c, dst_stride: [0, 0, n * c] })
    }

    /// The pooled tokens among this rank's (a run at its end), as `(local prefix, count)`:
    /// the backend's pool over the local rows with that prefix reads exactly them.
    fn pooled_here(&self, n: usize, prefix: usize, avg: bool) -> (usize, usize) {
        let mine = self.local(n);
        if avg {
            let lp = prefix.saturating_sub(mine.start).min(mine.len());
            (lp, mine.len() - lp)
        } else {
            (0, usize::from(mine.start == 0 && !mine.is_empty()))
        }
    }

    /// The pool over the whole group: `out` (B, C) ← the class token (rank 0's token 0), or
    /// the mean of the image's N − prefix patch tokens (`avg`), from `x` (B, n_r, C). The
    /// same values on every rank of the group.
    #[allow(clippy::too_many_arguments)]
    pub fn pool_forward(&mut self, be: &B, out: &mut B::Buf, x: &B::Buf, b: usize, n: usize, c: usize, prefix: usize, avg: bool) -> BResult<()> {
        let ml = self.local(n).len();
        let (lp, count) = self.pooled_here(n, prefix, avg);
        let len = b * c;
        let sum = grown(be, &mut self.pool_sum, len, true)?;
        // each rank's share (its mean × its count / (N − prefix), i.e. its partial sum over the
        // image's count), in f32: a bf16 `out` would round every partial sum
        if count == 0 {
            be.fill(sum, 0.0)?;
        } else {
            be.pool_forward(sum, x, b, ml, c, lp, avg)?;
            if avg && count != n - prefix {
                be.scale(sum, count as f32 / (n - prefix) as f32)?;
            }
        }
        self.comm.all_reduce(sum, Span { off: 0, len }, ReduceOp::Sum).map_err(comm_err)?;
        // rounded once into `out`
        be.copy_span(out, 0, sum, 0, len)
    }

    /// Backward of `pool_forward`: `dx` (B, n_r, C) ← `dout` (B, C) on the rows this rank's
    /// pool read (zeros elsewhere). `dout` is the same on every rank of the group, so this
    /// needs no communication.
    #[allow(clippy::too_many_arguments)]
    pub fn pool_backward(&mut self, be: &B, dx: &mut B::Buf, dout: &B::Buf, b: usize, n: usize, c: usize, prefix: usize, avg: bool) -> BResult<()> {
        let ml = self.local(n).len();
        let (lp, count) = self.pooled_here(n, prefix, avg);
        if count == 0 {
            return be.fill(dx, 0.0);
        }
        if !avg || count == n - prefix {
            return be.pool_backward(dx, dout, b, ml, c, lp, avg);
        }
        // the backend's pool divides by this rank's count: scale dout by count / (N − prefix)
        // first, in f32, so that dx is rounded once
        let len = b * c;
        let scaled = grown(be, &mut self.pool_sum, len, true)?;
        be.copy_span(scaled, 0, dout, 0, len)?;
        be.scale(scaled, count as f32 / (n - prefix) as f32)?;
        be.pool_backward(dx, scaled, b, ml, c, lp, avg)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::Cpu;
    use crate::comm::SingleComm;

    #[test]
    fn token_runs_tile_the_image_and_differ_by_at_most_one() {
        for n in [4, 5, 17, 65] {
            for size in 1..=4 {
                let runs: Vec<_> = (0..size).map(|r| tokens(n, size, r)).collect();
                assert_eq!(runs[0].start, 0);
                assert_eq!(runs[size - 1].end, n);
                for w in runs.windows(2) {
                    assert_eq!(w[0].end, w[1].start);
                    assert!(w[0].len() == w[1].len() || w[0].len() == w[1].len() + 1);
                }
            }
        }
    }

    /// With one rank the exchanges are pure permutations that must give back their input,
    /// and the pool must be the backend's own.
    #[test]
    fn a_group_of_one_exchanges_nothing_and_pools_as_the_backend() {
        let be = Cpu::new();
        let mut sp = SeqParallel::<Cpu>::new(Box::new(SingleComm::new()));
        let (b, n, h, d) = (2, 5, 4, 3);
        let x: Vec<f32> = (0..b * n * 3 * h * d).map(|i| i as f32 * 0.5 - 7.0).collect();
        let mut mid = vec![0.0; x.len()];
        let mut back = vec![0.0; x.len()];
        sp.tokens_to_heads(&be, &mut mid, &x, b, n, 3, h, d).unwrap();
        assert_eq!(mid, x);
        sp.heads_to_tokens(&be, &mut back, &mid, b, n, 3, h, d).unwrap();
        assert_eq!(back, x);
        let c = h * d;
        let tok: Vec<f32> = x[..b * n * c].to_vec();
        for avg in [false, true] {
            let (mut ours, mut theirs) = (vec![0.0; b * c], vec![0.0; b * c]);
            sp.pool_forward(&be, &mut ours, &tok, b, n, c, 1, avg).unwrap();
            be.pool_forward(&mut theirs, &tok, b, n, c, 1, avg).unwrap();
            assert_eq!(ours, theirs, "avg {avg}");
            let (mut dours, mut dtheirs) = (vec![1.0; b * n * c], vec![1.0; b * n * c]);
            sp.pool_backward(&be, &mut dours, &ours, b, n, c, 1, avg).unwrap();
            be.pool_backward(&mut dtheirs, &theirs, b, n, c, 1, avg).unwrap();
            assert_eq!(dours, dtheirs, "avg {avg}");
        }
    }
}
