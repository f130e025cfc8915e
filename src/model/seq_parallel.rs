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
//! The exchanges pack and unpack on the host: in place in the CPU backend's own buffers
//! (`Backend::host_view`), through `Backend::download`/`upload` on a GPU, where that is a round
//! trip per exchange (a permutation kernel around the same `Comm::all_to_all` would avoid it). The all-to-all itself moves the compute
//! dtype (bf16 on a GPU: the values are bf16 already, so nothing is rounded on the way), while
//! the pool's partial sums are added over the group in f32 and rounded once, as the
//! backend's own pool rounds its f32 sum.

use std::borrow::Cow;
use std::ops::Range;

use crate::backend::{BResult, Backend, BackendError};
use crate::comm::{Comm, ReduceOp, Span};

/// This rank's place in its sequence-parallel group and the group's communicator.
pub struct SeqParallel<B: Backend> {
    comm: Box<dyn Comm<B::Buf>>,
    /// Rank within the group (0 holds the class token).
    pub rank: usize,
    /// Ranks in the group (`sequence_parallel_size`).
    pub size: usize,
    /// Staging buffer of the all-to-alls (compute dtype), grown on demand.
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

/// Whether token `tok` of an image enters the pool: every patch token for the mean, the class
/// token otherwise.
fn pooled_token(tok: usize, prefix: usize, avg: bool) -> bool {
    if avg { tok >= prefix } else { tok == 0 }
}

fn comm_err(e: crate::comm::CommError) -> BackendError {
    BackendError::Device(format!("sequence-parallel group: {e}"))
}

/// `buf`'s values: in place where the backend keeps them on the host, else downloaded.
fn values<'a, B: Backend>(be: &B, buf: &'a B::Buf) -> BResult<Cow<'a, [f32]>> {
    Ok(match be.host_view(buf) {
        Some(v) => Cow::Borrowed(v),
        None => Cow::Owned(be.download(buf)?),
    })
}

/// The first `len` values of `dst` written by `fill`: in place where the backend keeps `dst` on
/// the host (set to zeros first when `zeroed`), else into a host vector of zeros that is then
/// uploaded.
fn write_values<B: Backend>(be: &B, dst: &mut B::Buf, len: usize, zeroed: bool, fill: impl FnOnce(&mut [f32])) -> BResult<()> {
    if let Some(v) = be.host_view_mut(dst) {
        let have = v.len();
        let v = v.get_mut(..len).ok_or_else(|| BackendError::Device(format!("sequence parallelism: a buffer of {have} values where {len} are written")))?;
        if zeroed {
            v.fill(0.0);
        }
        fill(v);
        return Ok(());
    }
    let mut out = vec![0.0f32; len];
    fill(&mut out);
    be.upload(dst, 0, &out)
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

    /// Packs `len` values (`size` equal blocks, block j for rank j) into the staging buffer with
    /// `pack`, exchanges the blocks, and hands what arrived (block j from rank j) to `unpack`.
    /// Where the backend keeps buffers on the host, `pack` writes the staging buffer in place
    /// and `unpack` reads it there; a block's padding rows are not written (they hold whatever
    /// an earlier exchange left) and are dropped on arrival.
    fn exchange(&mut self, be: &B, len: usize, pack: impl FnOnce(&mut [f32]), unpack: impl FnOnce(&[f32]) -> BResult<()>) -> BResult<()> {
        if self.xfer.as_ref().is_none_or(|x| be.len(x) < len) {
            // (the activations' own dtype: what they hold travels exactly, in the fewest bytes)
            self.xfer = Some(be.alloc(len)?);
        }
        let x = self.xfer.as_mut().ok_or_else(|| BackendError::Device("sequence-parallel staging buffer missing".into()))?;
        match be.host_view_mut(x) {
            Some(v) => pack(&mut v[..len]),
            None => {
                let mut send = vec![0.0f32; len];
                pack(&mut send);
                be.upload(x, 0, &send)?;
            }
        }
        self.comm.all_to_all(x, Span { off: 0, len }).map_err(comm_err)?;
        match be.host_view(x) {
            Some(v) => unpack(&v[..len]),
            None => unpack(&be.download(x)?[..len]),
        }
    }

    /// `dst` (B, N, parts, H/SP, D) ← `src` (B, n_r, parts, H, D): every token of the image for
    /// this rank's heads (qkv before the attention, datt before its backward).
    #[allow(clippy::too_many_arguments)]
    pub fn tokens_to_heads(&mut self, be: &B, dst: &mut B::Buf, src: &B::Buf, b: usize, n: usize, parts: usize, h: usize, d: usize) -> BResult<()> {
        let (sp, hl, m) = (self.size, h / self.size, self.max_tokens(n));
        let mine = self.local(n);
        let src = values(be, src)?;
        let (row, block) = (parts * h * d, b * m * parts * hl * d);
        // block j: this rank's tokens (padded to m), heads of rank j
        let pack = |send: &mut [f32]| {
            for j in 0..sp {
                for bi in 0..b {
                    for t in 0..mine.len() {
                        for p in 0..parts {
                            let from = (bi * mine.len() + t) * row + (p * h + j * hl) * d;
                            let to = j * block + ((bi * m + t) * parts + p) * hl * d;
                            send[to..to + hl * d].copy_from_slice(&src[from..from + hl * d]);
                        }
                    }
                }
            }
        };
        // every token of every image: all of `dst`'s B·N·parts·H/SP·D values are written
        let unpack = |got: &[f32]| {
            write_values(be, dst, b * n * parts * hl * d, false, |out| {
                for j in 0..sp {
                    let theirs = tokens(n, sp, j);
                    for bi in 0..b {
                        for (t, tok) in theirs.clone().enumerate() {
                            let from = j * block + (bi * m + t) * parts * hl * d;
                            let to = (bi * n + tok) * parts * hl * d;
                            out[to..to + parts * hl * d].copy_from_slice(&got[from..from + parts * hl * d]);
                        }
                    }
                }
            })
        };
        self.exchange(be, sp * block, pack, unpack)
    }

    /// `dst` (B, n_r, parts, H, D) ← `src` (B, N, parts, H/SP, D): this rank's tokens for every
    /// head (the attention's output, the qkv gradient).
    #[allow(clippy::too_many_arguments)]
    pub fn heads_to_tokens(&mut self, be: &B, dst: &mut B::Buf, src: &B::Buf, b: usize, n: usize, parts: usize, h: usize, d: usize) -> BResult<()> {
        let (sp, hl, m) = (self.size, h / self.size, self.max_tokens(n));
        let mine = self.local(n);
        let src = values(be, src)?;
        let block = b * m * parts * hl * d;
        // block j: rank j's tokens (padded to m), this rank's heads
        let pack = |send: &mut [f32]| {
            for j in 0..sp {
                let theirs = tokens(n, sp, j);
                for bi in 0..b {
                    for (t, tok) in theirs.clone().enumerate() {
                        let from = (bi * n + tok) * parts * hl * d;
                        let to = j * block + (bi * m + t) * parts * hl * d;
                        send[to..to + parts * hl * d].copy_from_slice(&src[from..from + parts * hl * d]);
                    }
                }
            }
        };
        let row = parts * h * d;
        // every head of this rank's tokens: all of `dst`'s B·n_r·parts·H·D values are written
        let unpack = |got: &[f32]| {
            write_values(be, dst, b * mine.len() * row, false, |out| {
                for j in 0..sp {
                    for bi in 0..b {
                        for t in 0..mine.len() {
                            for p in 0..parts {
                                let from = j * block + ((bi * m + t) * parts + p) * hl * d;
                                let to = (bi * mine.len() + t) * row + (p * h + j * hl) * d;
                                out[to..to + hl * d].copy_from_slice(&got[from..from + hl * d]);
                            }
                        }
                    }
                }
            })
        };
        self.exchange(be, sp * block, pack, unpack)
    }

    /// `dst` (B, n_r, C) ← this rank's rows of `src` (B, N, C).
    pub fn take_tokens(&self, be: &B, dst: &mut B::Buf, src: &B::Buf, b: usize, n: usize, c: usize) -> BResult<()> {
        let mine = self.local(n);
        let src = values(be, src)?;
        let rows = mine.len() * c;
        write_values(be, dst, b * rows, false, |out| {
            for bi in 0..b {
                out[bi * rows..(bi + 1) * rows].copy_from_slice(&src[(bi * n + mine.start) * c..(bi * n + mine.end) * c]);
            }
        })
    }

    /// `dst` (B, N, C) ← `src` (B, n_r, C) in this rank's rows, zeros in every other rank's:
    /// the embedding's output gradient, whose parameter gradients then cover this rank's tokens.
    pub fn put_tokens(&self, be: &B, dst: &mut B::Buf, src: &B::Buf, b: usize, n: usize, c: usize) -> BResult<()> {
        let mine = self.local(n);
        let src = values(be, src)?;
        write_values(be, dst, b * n * c, true, |out| {
            for bi in 0..b {
                out[(bi * n + mine.start) * c..(bi * n + mine.end) * c].copy_from_slice(&src[bi * mine.len() * c..(bi + 1) * mine.len() * c]);
            }
        })
    }

    /// The pool over the whole group: `out` (B, C) ← the class token (rank 0's token 0), or
    /// the mean of the image's N − prefix patch tokens (`avg`), from `x` (B, n_r, C). The
    /// same values on every rank of the group.
    #[allow(clippy::too_many_arguments)]
    pub fn pool_forward(&mut self, be: &B, out: &mut B::Buf, x: &B::Buf, b: usize, n: usize, c: usize, prefix: usize, avg: bool) -> BResult<()> {
        let mine = self.local(n);
        let x = values(be, x)?;
        // each rank's share of the mean (1/(N − prefix) of its partial sum), summed over the group
        let scale = if avg { 1.0 / (n - prefix) as f32 } else { 1.0 };
        let mut part = vec![0.0f32; b * c];
        for bi in 0..b {
            let o = &mut part[bi * c..(bi + 1) * c];
            for (t, tok) in mine.clone().enumerate() {
                if pooled_token(tok, prefix, avg) {
                    let row = &x[(bi * mine.len() + t) * c..(bi * mine.len() + t + 1) * c];
                    o.iter_mut().zip(row).for_each(|(d, v)| *d += v);
                }
            }
        }
        part.iter_mut().for_each(|d| *d *= scale);
        // summed in f32 (a bf16 `out` would round every partial sum), rounded once into `out`
        let len = b * c;
        if self.pool_sum.as_ref().is_none_or(|s| be.len(s) < len) {
            self.pool_sum = Some(be.alloc_f32(len)?);
        }
        let sum = self.pool_sum.as_mut().ok_or_else(|| BackendError::Device("sequence-parallel pool buffer missing".into()))?;
        be.upload(sum, 0, &part)?;
        self.comm.all_reduce(sum, Span { off: 0, len }, ReduceOp::Sum).map_err(comm_err)?;
        let mut total = be.download(sum)?;
        total.truncate(len);
        be.upload(out, 0, &total)
    }

    /// Backward of `pool_forward`: `dx` (B, n_r, C) ← `dout` (B, C) on the rows this rank's
    /// pool read (zeros elsewhere). `dout` is the same on every rank of the group, so this
    /// needs no communication.
    #[allow(clippy::too_many_arguments)]
    pub fn pool_backward(&self, be: &B, dx: &mut B::Buf, dout: &B::Buf, b: usize, n: usize, c: usize, prefix: usize, avg: bool) -> BResult<()> {
        let mine = self.local(n);
        let dout = values(be, dout)?;
        let inv = if avg { 1.0 / (n - prefix) as f32 } else { 1.0 };
        write_values(be, dx, b * mine.len() * c, true, |out| {
            for bi in 0..b {
                for (t, tok) in mine.clone().enumerate() {
                    if pooled_token(tok, prefix, avg) {
                        let row = &mut out[(bi * mine.len() + t) * c..(bi * mine.len() + t + 1) * c];
                        row.iter_mut().zip(&dout[bi * c..(bi + 1) * c]).for_each(|(d, v)| *d = v * inv);
                    }
                }
            }
        })
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
