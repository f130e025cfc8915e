//! The ViT forward pass and its manual backward, written once over the `Backend` trait.
//! Reads top to bottom like the model: patchify → patch embedding → tokens (+ class token,
//! + position embedding) → `depth` pre-LN blocks → pool + final norm → head → cross-entropy.
//!
//! Every layer's forward saves what its backward needs in `Activations`; backward walks the
//! same list in reverse.
//!
//! Under sequence parallelism (`seq_parallel`, set by `set_sequence_parallel`) a rank's rows
//! are its own tokens of each image (B·n_r instead of B·N): the embedding is computed for the
//! whole image and cut to them, each attention is wrapped in two all-to-alls (tokens → heads
//! before it, heads → tokens after it; the backward mirrors them), and the pool combines the
//! group's tokens. The head's and final norm's parameter gradients are kept by the group's
//! rank 0 alone; every other parameter gradient is this rank's tokens' part, so the sum over
//! the group (the gradient all-reduce over every rank) is the whole image's gradient. Parameter gradients accumulate into `grads` (so micro-batches of a
//! gradient-accumulation window add up), activation gradients overwrite.
//!
//! Under ZeRO-3 (`partition`, set by `Vit::partition`) the whole weights are not kept: each
//! layer reads its parameter group's weights at offset 0 of the group's own buffer (a gather
//! slot for a partitioned block, filled just before the block runs, the next block's gather
//! started meanwhile), and the backward writes each group's gradients through a slot of the
//! same layout into the flat gradient buffer.
//!
//! Memory policy (`Recompute`): the LayerNorm outputs and the GELU output are cheap to
//! regenerate from what is kept anyway (the block input, the saved mean/rstd, the GELU's
//! pre-activation). When recomputing, one shared buffer of each replaces the per-block copies
//! (2·C + F of the 7·C + 2·F values kept per token and block).

use crate::backend::{BResult, Backend, GeluSaved, Span};

use super::drop_path::BranchScales;
use super::params::{BlockSpans, ModelSpans, ParamTable};
use super::partition::Partition;
use super::seq_parallel::SeqParallel;
use super::spec::{GlobalPool, ModelConfig};

/// Which activations the backward regenerates instead of keeping one copy per block.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Recompute {
    /// Regenerate when the backend says it is nearly free at this size
    /// (`Backend::recompute_below`): small batches on a GPU, never on the CPU.
    #[default]
    Auto,
    /// Keep every block's LayerNorm and GELU outputs (fastest when bandwidth-bound).
    Never,
    /// Always regenerate them in the backward.
    Always,
    /// Activation checkpointing per block (timm's `set_grad_checkpointing`, DeepSpeed's
    /// `activation_checkpointing`): the forward keeps each block's output, and the backward
    /// runs each block's forward again from its input before differentiating it, so one
    /// block's activations are held at a time. Where the attention's saved state is no larger
    /// than its output (the fused attention's log-sum-exp; `checkpoint_keeps_attention`) each
    /// block also keeps its attention output and that state, and the recompute skips the
    /// attention core, the most expensive part of a block at long sequences. The recompute never
    /// runs fc2: the backward needs its input, not its output.
    Blocks,
    /// `Blocks` keeping nothing more than each block's output: the recompute runs the attention
    /// core again too (least memory; what timm's and DeepSpeed's checkpointing of a whole block
    /// does).
    #[serde(rename = "blocks_full")]
    BlocksFull,
}

impl Recompute {
    pub const NAMES: &'static [&'static str] = &["auto", "never", "always", "blocks", "blocks_full"];
    pub fn as_str(self) -> &'static str {
        match self {
            Recompute::Auto => "auto",
            Recompute::Never => "never",
            Recompute::Always => "always",
            Recompute::Blocks => "blocks",
            Recompute::BlocksFull => "blocks_full",
        }
    }
    /// Whether this policy checkpoints every block (`Blocks`, `BlocksFull`).
    pub fn checkpoints(self) -> bool {
        matches!(self, Recompute::Blocks | Recompute::BlocksFull)
    }
    pub fn parse(v: &str) -> Result<Recompute, String> {
        match v {
            "auto" => Ok(Recompute::Auto),
            "never" | "none" => Ok(Recompute::Never),
            "always" => Ok(Recompute::Always),
            "blocks" => Ok(Recompute::Blocks),
            "blocks_full" => Ok(Recompute::BlocksFull),
            other => Err(format!("unknown recompute policy {other:?} (auto, never, always, blocks, blocks_full)")),
        }
    }
}

/// Saved activations of one transformer block (B·N rows of width C unless noted). The
/// LayerNorm and GELU outputs are `None` when they are regenerated (see `Regen`).
struct BlockActs<B: Backend> {
    ln1: Option<B::Buf>,
    ln1_mean: B::Buf, // (B·N)
    ln1_rstd: B::Buf, // (B·N)
    qkv: B::Buf,      // (B·N, 3C)
    probs: B::Buf,    // attention saved state (backend-defined, ≤ B·H·N·N; the probabilities on CPU)
    att: B::Buf,      // (B·N, C) attention output before proj
    /// Sequence parallelism: the attention's own output (B, N, H/SP, D), before the all-to-all
    /// back to this rank's tokens (`att`); its backward reads it.
    att_heads: Option<B::Buf>,
    x1: B::Buf,       // residual stream after attention
    ln2: Option<B::Buf>,
    ln2_mean: B::Buf,
    ln2_rstd: B::Buf,
    fc1_pre: B::Buf, // (B·N, F) before GELU, or its derivative (Activations::gelu_saved)
    fc1_act: Option<B::Buf>, // (B·N, F) after GELU
}

/// Whether per-block checkpointing (`Recompute::Blocks`; never `BlocksFull`) keeps each block's
/// attention output ((B·N, C), `rows · c` elements) and saved state (`saved` elements) instead
/// of recomputing the attention core: when that state is no larger than the output itself, the fused
/// attention's per-row log-sum-exp, not the CPU's or the GEMM path's B·H·N·N probabilities
/// (keeping those per block would undo what checkpointing saves). Not under sequence
/// parallelism, whose attention output is the heads' layout exchanged between ranks.
pub fn checkpoint_keeps_attention(saved: f64, rows: f64, c: f64, sequence_parallel: bool) -> bool {
    !sequence_parallel && saved <= rows * c
}

/// A block's attention output and saved state under checkpointing, swapped into the one shared
/// `BlockActs` while that block runs (`Activations::swap_kept_attention`).
struct KeptAttention<B: Backend> {
    att: B::Buf,
    probs: B::Buf,
}

/// Shared buffers standing in for the per-block LayerNorm and GELU outputs when they are
/// regenerated: the forward writes them just before their consumer reads them, and the
/// backward recomputes them just before the weight gradient that needs them.
struct Regen<B: Backend> {
    ln: B::Buf,   // (B·N, C) ln1 or ln2 output
    mean: B::Buf, // (B·N) f32, rewritten with the values the forward saved
    rstd: B::Buf, // (B·N) f32
    act: B::Buf,  // (B·N, F) GELU output
}

/// Sequence parallelism's scratch: the exchanges' other side.
struct SpScratch<B: Backend> {
    qkv: B::Buf,  // (B·n_r, 3C) this rank's tokens' qkv, then their gradient
    full: B::Buf, // (B·N, C) the whole image's embedding, then its output gradient
    datt: B::Buf, // (B, N, H/SP, D) the attention's output gradient for this rank's heads
}

/// Every buffer of one forward/backward at a given batch capacity.
struct Activations<B: Backend> {
    cap: usize,
    regen: Option<Regen<B>>,
    /// What the last forward kept in each block's fc1_pre: the derivative where the backend
    /// prefers it and the GELU output is kept (a regenerated output needs pre).
    gelu_saved: GeluSaved,
    img: B::Buf,       // (B, 3, S, S)
    patches: B::Buf,   // (B·NP, 3·P·P)
    patch_emb: B::Buf, // (B·NP, C)
    x0: B::Buf,        // (B·N, C) tokens entering block 0
    /// Each block's saved activations, or under checkpointing (`Recompute::Blocks`) one set
    /// every block's forward and recomputed forward writes in turn.
    blocks: Vec<BlockActs<B>>,
    checkpointing: bool,
    /// Under checkpointing, each block's attention output and saved state when
    /// `checkpoint_keeps_attention` says so (else empty).
    kept_attention: Vec<KeptAttention<B>>,
    /// (B·N, C) each block's output: the residual stream after its MLP, the next block's input.
    outputs: Vec<B::Buf>,
    final_mean: B::Buf,
    final_rstd: B::Buf,
    pooled_raw: B::Buf, // (B, C) the class token or the mean of the patch tokens, before the norm
    pooled: B::Buf,     // (B, C) head input
    logits: B::Buf,     // (B, K)
    targets: B::Buf,    // (B, K) f32
    losses: B::Buf,     // (B) f32
    // gradient scratch, reused across blocks
    dlogits: B::Buf,
    dpooled: B::Buf,     // (B, C)
    dpooled_raw: B::Buf, // (B, C)
    dres_a: B::Buf,      // (B·N, C) residual-stream gradient (ping)
    dres_b: B::Buf,      // (B·N, C) residual-stream gradient (pong)
    dln: B::Buf,         // (B·N, C)
    dqkv: B::Buf,        // (B·N, 3C)
    datt: B::Buf,        // (B·N, C)
    dfc: B::Buf,         // (B·N, F)
    dpatch_emb: B::Buf,  // (B·NP, C)
    // the last block's class-token rows (class token tail): ln1's rows, their queries, and
    // the gradients of both
    cls_ln1: B::Buf, // (B, C)
    cls_q: B::Buf,   // (B, C)
    dcls_q: B::Buf,  // (B, C)
    dcls_ln: B::Buf, // (B, C)
    sp: Option<SpScratch<B>>,
}

impl<B: Backend> Activations<B> {
    /// `sp`: (the most tokens a rank of the group holds, the group's size) under sequence
    /// parallelism: rows are a rank's tokens, the attention runs whole images on H/SP heads.
    fn new(be: &B, m: &ModelConfig, cap: usize, policy: Recompute, sp: Option<(usize, usize)>) -> BResult<Self> {
        let (n_all, np, c, f, k) = (m.num_tokens(), m.num_patches(), m.embed_dim, m.mlp_hidden(), m.num_classes);
        let (n, heads) = sp.map_or((n_all, m.num_heads), |(rows, size)| (rows, m.num_heads / size));
        // (per rank under sequence parallelism, the whole image's tokens for H/SP heads take no
        // more room than its own tokens for every head: qkv and its gradient share the buffers)
        let bn = cap * n;
        let regenerate = match policy {
            Recompute::Auto => bn * f <= be.recompute_below(),
            Recompute::Never | Recompute::Blocks | Recompute::BlocksFull => false,
            Recompute::Always => true,
        };
        let checkpointing = policy.checkpoints();
        let kept = |len: usize| -> BResult<Option<B::Buf>> { if regenerate { Ok(None) } else { be.alloc(len).map(Some) } };
        let regen = if regenerate {
            Some(Regen { ln: be.alloc(bn * c)?, mean: be.alloc_f32(bn)?, rstd: be.alloc_f32(bn)?, act: be.alloc(bn * f)? })
        } else {
            None
        };
        let sets = if checkpointing { m.depth.min(1) } else { m.depth };
        let mut blocks = Vec::with_capacity(sets);
        for _ in 0..sets {
            blocks.push(BlockActs {
                ln1: kept(bn * c)?,
                ln1_mean: be.alloc_f32(bn)?,
                ln1_rstd: be.alloc_f32(bn)?,
                qkv: be.alloc(bn * 3 * c)?,
                probs: be.alloc(be.attention_saved_len(cap, n_all, heads, m.embed_dim / m.num_heads))?,
                att: be.alloc(bn * c)?,
                att_heads: if sp.is_some() { Some(be.alloc(cap * n_all * heads * m.head_dim())?) } else { None },
                x1: be.alloc(bn * c)?,
                ln2: kept(bn * c)?,
                ln2_mean: be.alloc_f32(bn)?,
                ln2_rstd: be.alloc_f32(bn)?,
                fc1_pre: be.alloc(bn * f)?,
                fc1_act: kept(bn * f)?,
            });
        }
        let outputs = (0..m.depth).map(|_| be.alloc(bn * c)).collect::<BResult<Vec<_>>>()?;
        let saved = be.attention_saved_len(cap, n_all, heads, m.embed_dim / m.num_heads);
        let keep_attention = policy == Recompute::Blocks && checkpoint_keeps_attention(saved as f64, bn as f64, c as f64, sp.is_some());
        let kept_attention = if keep_attention {
            (0..m.depth).map(|_| Ok(KeptAttention { att: be.alloc(bn * c)?, probs: be.alloc(saved)? })).collect::<BResult<Vec<_>>>()?
        } else {
            Vec::new()
        };
        Ok(Activations {
            cap,
            regen,
            gelu_saved: GeluSaved::Pre,
            img: be.alloc(cap * m.in_chans * m.image_size * m.image_size)?,
            patches: be.alloc(cap * np * m.patch_dim())?,
            patch_emb: be.alloc(cap * np * c)?,
            x0: be.alloc(bn * c)?,
            blocks,
            checkpointing,
            kept_attention,
            outputs,
            final_mean: be.alloc_f32(cap)?,
            final_rstd: be.alloc_f32(cap)?,
            pooled_raw: be.alloc(cap * c)?,
            pooled: be.alloc(cap * c)?,
            logits: be.alloc(cap * k)?,
            targets: be.alloc_f32(cap * k)?,
            losses: be.alloc_f32(cap)?,
            dlogits: be.alloc(cap * k)?,
            dpooled: be.alloc(cap * c)?,
            dpooled_raw: be.alloc(cap * c)?,
            dres_a: be.alloc(bn * c)?,
            dres_b: be.alloc(bn * c)?,
            dln: be.alloc(bn * c)?,
            dqkv: be.alloc(bn * 3 * c)?,
            datt: be.alloc(bn * c)?,
            dfc: be.alloc(bn * f)?,
            dpatch_emb: be.alloc(cap * np * c)?,
            cls_ln1: be.alloc(cap * c)?,
            cls_q: be.alloc(cap * c)?,
            dcls_q: be.alloc(cap * c)?,
            dcls_ln: be.alloc(cap * c)?,
            sp: match sp {
                Some((_, size)) => Some(SpScratch { qkv: be.alloc(bn * 3 * c)?, full: be.alloc(cap * n_all * c)?, datt: be.alloc(cap * n_all * c / size)? }),
                None => None,
            },
        })
    }

    /// Exchanges block `i`'s kept attention output and state with the shared set's (every
    /// buffer of either has the same size): called before block `i` runs, so that its forward
    /// writes and its backward reads its own, and again after, to put them back. No-op when
    /// nothing is kept.
    fn swap_kept_attention(&mut self, i: usize) {
        if let (Some(k), Some(blk)) = (self.kept_attention.get_mut(i), self.blocks.first_mut()) {
            std::mem::swap(&mut k.att, &mut blk.att);
            std::mem::swap(&mut k.probs, &mut blk.probs);
        }
    }
}

/// The qkv projection split into its query part and its key/value part: (query weight rows,
/// key/value weight rows, query bias, key/value bias) of the (3C × C) weight and 3C bias.
fn split_qkv(s: &BlockSpans, c: usize) -> (Span, Span, Option<Span>, Option<Span>) {
    let w = s.qkv_w;
    let wq = Span { off: w.off, len: c * c };
    let wkv = Span { off: w.off + c * c, len: 2 * c * c };
    let bq = s.qkv_b.map(|b| Span { off: b.off, len: c });
    let bkv = s.qkv_b.map(|b| Span { off: b.off + c, len: 2 * c });
    (wq, wkv, bq, bkv)
}

/// The block's own copy of an activation, or the shared regeneration buffer.
fn kept_or_shared<'a, T>(own: &'a mut Option<T>, shared: Option<&'a mut T>) -> BResult<&'a mut T> {
    match own.as_mut() {
        Some(b) => Ok(b),
        None => shared.ok_or_else(|| crate::backend::BackendError::Device("activation neither kept nor regenerated".into())),
    }
}

fn kept_or_regen<'a, T>(own: &'a Option<T>, shared: Option<&'a T>) -> BResult<&'a T> {
    match own.as_ref() {
        Some(b) => Ok(b),
        None => shared.ok_or_else(|| crate::backend::BackendError::Device("activation neither kept nor regenerated".into())),
    }
}

/// One-hot targets with label smoothing ε: (1 − ε)·onehot + ε/K, as torch's cross-entropy.
/// Which bias gradients a block's backward sums itself, and which a LayerNorm backward it runs
/// sums for another layer (saving a pass over the gradient).
struct BiasSums {
    /// fc2's bias gradient, unless the LayerNorm backward after this block summed it already.
    fc2: Option<Span>,
    /// The ln2 backward sums the projection's bias gradient (not when a branch factor scales
    /// the projection's output gradient).
    proj_in_ln2: bool,
    /// The previous block's fc2 bias, summed by this block's ln1 backward.
    prev_fc2: Option<Span>,
    /// The qkv bias gradient comes from the qkv weight product (`bias_grads_in_products`)
    /// rather than from the attention backward.
    qkv_in_product: bool,
}

/// Block `i`'s backward: `a.dres_a` holds the gradient of its output on entry and of its input
/// on exit; parameter gradients add into `g`. Under checkpointing the block's forward runs again
/// first, from its saved input, into the one shared set of activations.
#[allow(clippy::too_many_arguments)]
fn block_backward<B: Backend>(
    be: &B,
    m: &ModelConfig,
    (s, w): (&BlockSpans, &B::Buf),
    g: &mut B::Buf,
    a: &mut Activations<B>,
    (i, b, class_tail): (usize, usize, bool),
    bias: BiasSums,
    mut dp: Option<&mut BranchScales<B>>,
    mut sp: Option<&mut SeqParallel<B>>,
) -> BResult<()> {
    let (n_all, c, h, d, f) = (m.num_tokens(), m.embed_dim, m.num_heads, m.head_dim(), m.mlp_hidden());
    // rows per image: every token, or this rank's under sequence parallelism
    let n = sp.as_ref().map_or(n_all, |p| p.local(n_all).len());
    let (bn, prefix) = (b * n, m.num_prefix_tokens());
    // the last block with the class token tail: B rows (one per image) after attention
    let rows = if class_tail { b } else { bn };
    let per_image = if class_tail { 1 } else { n };
    // this block's kept attention output and state into the shared set (put back at the end)
    if !class_tail {
        a.swap_kept_attention(i);
    }
    let (prev, rest) = a.outputs.split_at_mut(i);
    let x = if i == 0 { &a.x0 } else { &prev[i - 1] };
    if a.checkpointing {
        // the block's activations again from its saved input, up to the fc2 input (its
        // attention output and state are this block's own when kept: see `Activations`)
        let attention_kept = !class_tail && !a.kept_attention.is_empty();
        let io = BlockIo { x, out: &mut rest[0], cls_ln1: &mut a.cls_ln1, cls_q: &mut a.cls_q };
        let spp = sp.as_deref_mut().zip(a.sp.as_mut());
        block_forward(be, m, (s, w), (i, b, class_tail), io, &mut a.blocks[0], None, a.gelu_saved, dp.as_deref_mut(), spp, Pass::Recompute { attention_kept })?;
    }
    let blk = &a.blocks[if a.checkpointing { 0 } else { i }];
    // MLP: fc2 (with the GELU backward fused), fc1, ln2 (+ residual) → dres_b = dx1
    if let Some(r) = a.regen.as_mut() {
        be.gelu_forward(&mut r.act, &blk.fc1_pre, w, Some(s.fc1_b), rows, f)?;
    }
    let act = kept_or_regen(&blk.fc1_act, a.regen.as_ref().map(|r| &r.act))?;
    // fc2, the GELU gradient, and fc1's bias gradient from that same pass over dfc
    let fc2_b = bias.fc2;
    let dfc2 = branch_gradient(be, dp.as_deref_mut(), (i, 1), &a.dres_a, (rows, per_image), c)?;
    be.matmul_backward_gelu_bias(&mut a.dfc, g, dfc2, act, &blk.fc1_pre, a.gelu_saved, s.fc1_b, w, s.fc2_w, fc2_b, rows, f, c)?;
    if let Some(r) = a.regen.as_mut() {
        be.layernorm_forward(&mut r.ln, &mut r.mean, &mut r.rstd, &blk.x1, w, s.norm2_w, s.norm2_b, rows, c)?;
    }
    let ln2 = kept_or_regen(&blk.ln2, a.regen.as_ref().map(|r| &r.ln))?;
    be.matmul_backward(&mut a.dln, g, &a.dfc, ln2, None, w, s.fc1_w, None, rows, c, f)?;
    // dres_b is the projection's output gradient: its bias gradient comes from this pass
    let proj_b_fused = bias.proj_in_ln2.then_some(s.proj_b);
    be.layernorm_backward(&mut a.dres_b, g, &a.dln, Some(&a.dres_a), &blk.x1, &blk.ln2_mean, &blk.ln2_rstd, w, s.norm2_w, s.norm2_b, rows, c, proj_b_fused)?;
    // attention: proj, core, qkv, ln1 (+ residual) → dres_a = dx
    let dproj = branch_gradient(be, dp.as_deref_mut(), (i, 0), &a.dres_b, (rows, per_image), c)?;
    let proj_b = proj_b_fused.xor(Some(s.proj_b));
    be.matmul_backward(&mut a.datt, g, dproj, &blk.att, None, w, s.proj_w, proj_b, rows, c, c)?;
    let (wq, wkv, bq, bkv) = split_qkv(s, c);
    // the qkv bias gradient from the attention backward's pass where the backend can
    if class_tail {
        // dqkv holds the keys' and values' gradient (B, N, 2, H, D) here
        be.class_attention_backward(&mut a.dcls_q, &mut a.dqkv, g, bkv, &a.datt, &a.cls_q, &blk.qkv, b, n, h, d)?;
    } else if let (Some(p), Some(x)) = (sp.as_mut(), a.sp.as_mut()) {
        // this rank's heads over every token: datt tokens → heads, the attention backward
        // (dqkv (B, N, 3, H/SP, D)), dqkv heads → tokens into the scratch (B·n_r, 3C)
        let att_heads = blk.att_heads.as_ref().ok_or_else(|| crate::backend::BackendError::Device("sequence-parallel attention output missing".into()))?;
        p.tokens_to_heads(be, &mut x.datt, &a.datt, b, n_all, 1, h, d)?;
        be.attention_backward(&mut a.dqkv, &x.datt, &blk.qkv, att_heads, &blk.probs, b, n_all, h / p.size, d)?;
        p.heads_to_tokens(be, &mut x.qkv, &a.dqkv, b, n_all, 3, h, d)?;
    } else {
        match s.qkv_b {
            Some(qb) if !bias.qkv_in_product => be.attention_backward_bias(&mut a.dqkv, g, qb, &a.datt, &blk.qkv, &blk.att, &blk.probs, b, n, h, d)?,
            _ => be.attention_backward(&mut a.dqkv, &a.datt, &blk.qkv, &blk.att, &blk.probs, b, n, h, d)?,
        }
    }
    if let Some(r) = a.regen.as_mut() {
        be.layernorm_forward(&mut r.ln, &mut r.mean, &mut r.rstd, x, w, s.norm1_w, s.norm1_b, bn, c)?;
    }
    let ln1 = kept_or_regen(&blk.ln1, a.regen.as_ref().map(|r| &r.ln))?;
    if class_tail {
        // the keys' and values' part over every token, the queries' over the class
        // tokens (their ln1 rows kept by the forward), added into those rows of dln
        be.matmul_backward(&mut a.dln, g, &a.dqkv, ln1, None, w, wkv, None, bn, c, 2 * c)?;
        be.matmul_backward(&mut a.dcls_ln, g, &a.dcls_q, &a.cls_ln1, None, w, wq, bq, b, c, c)?;
        be.add_class_rows(&mut a.dln, &a.dcls_ln, b, n, c)?;
    } else if let Some(x) = a.sp.as_ref() {
        // (the qkv bias gradient from these rows: the attention saw other heads' layout)
        be.matmul_backward(&mut a.dln, g, &x.qkv, ln1, None, w, s.qkv_w, s.qkv_b, bn, c, 3 * c)?;
    } else {
        let qkv_b = s.qkv_b.filter(|_| bias.qkv_in_product);
        be.matmul_backward(&mut a.dln, g, &a.dqkv, ln1, None, w, s.qkv_w, qkv_b, bn, c, 3 * c)?;
    }
    let dx1 = if class_tail {
        // the residual gradient dx1 lives on the class tokens: spread it over every
        // token's row (zeros elsewhere), in datt, free since the attention backward
        be.pool_backward(&mut a.datt, &a.dres_b, b, n, c, prefix, false)?;
        &a.datt
    } else {
        &a.dres_b
    };
    // dres_a is the previous block's fc2 output gradient: its bias gradient from this pass
    let prev_fc2_b = bias.prev_fc2;
    be.layernorm_backward(&mut a.dres_a, g, &a.dln, Some(dx1), x, &blk.ln1_mean, &blk.ln1_rstd, w, s.norm1_w, s.norm1_b, bn, c, prev_fc2_b)?;
    if !class_tail {
        a.swap_kept_attention(i);
    }
    Ok(())
}

/// Which forward of a block runs: the forward pass, or its rerun in the backward under
/// checkpointing, which stops at fc2's input (the backward reads that, never the block's output)
/// and skips the attention core when the block kept its output and state.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Pass {
    Forward,
    Recompute { attention_kept: bool },
}

/// What one block's forward reads and writes outside its own activations.
struct BlockIo<'a, B: Backend> {
    /// (B·N, C) the block's input.
    x: &'a B::Buf,
    /// (B·N, C) its output (B rows in the class token tail).
    out: &'a mut B::Buf,
    /// (B, C) the class tokens' ln1 rows and queries (the class token tail).
    cls_ln1: &'a mut B::Buf,
    cls_q: &'a mut B::Buf,
}

/// Block `i`'s forward over `b` images: x → x1 = x + proj(attn(ln1(x))) → out = x1 +
/// mlp(ln2(x1)), saving what its backward needs in `blk` (LayerNorm and GELU outputs in the
/// shared `regen` buffers when those are regenerated). `tail_block`: the last block under the
/// class token tail, whose rows past the attention are the class tokens alone. Also what the
/// backward runs again under checkpointing (`pass`): the same kernels on the same input and
/// weights write the same activations.
#[allow(clippy::too_many_arguments)]
fn block_forward<B: Backend>(
    be: &B,
    m: &ModelConfig,
    (s, w): (&BlockSpans, &B::Buf),
    (i, b, tail_block): (usize, usize, bool),
    io: BlockIo<'_, B>,
    blk: &mut BlockActs<B>,
    regen: Option<&mut Regen<B>>,
    gelu_saved: GeluSaved,
    mut dp: Option<&mut BranchScales<B>>,
    sp: Option<(&mut SeqParallel<B>, &mut SpScratch<B>)>,
    pass: Pass,
) -> BResult<()> {
    let (n_all, c, h, d, f) = (m.num_tokens(), m.embed_dim, m.num_heads, m.head_dim(), m.mlp_hidden());
    // rows per image: every token, or this rank's under sequence parallelism
    let n = sp.as_ref().map_or(n_all, |(p, _)| p.local(n_all).len());
    let (bn, prefix) = (b * n, m.num_prefix_tokens());
    let BlockIo { x, out, cls_ln1, cls_q } = io;
    let (mut shared_ln, mut shared_act) = match regen {
        Some(r) => (Some(&mut r.ln), Some(&mut r.act)),
        None => (None, None),
    };
    let ln1 = kept_or_shared(&mut blk.ln1, shared_ln.as_deref_mut())?;
    be.layernorm_forward(ln1, &mut blk.ln1_mean, &mut blk.ln1_rstd, x, w, s.norm1_w, s.norm1_b, bn, c)?;
    // rows of the rest of the block: every token, or (the last block with the class token
    // tail) the class token of each image, its residual row gathered into `out` (overwritten
    // by the block's output below)
    let rows = if tail_block {
        // keys and values of every token (blk.qkv holds (B, N, 2, H, D) here), the queries of
        // the class tokens alone
        let (wq, wkv, bq, bkv) = split_qkv(s, c);
        be.matmul_forward(&mut blk.qkv, None, ln1, w, wkv, bkv, bn, c, 2 * c)?;
        be.pool_forward(cls_ln1, ln1, b, n, c, prefix, false)?;
        be.matmul_forward(cls_q, None, cls_ln1, w, wq, bq, b, c, c)?;
        be.class_attention_forward(&mut blk.att, cls_q, &blk.qkv, b, n, h, d)?;
        be.pool_forward(out, x, b, n, c, prefix, false)?;
        residual_branch(be, dp.as_deref_mut(), (i, 0), &mut blk.x1, out, &blk.att, w, (s.proj_w, s.proj_b), (b, 1), c, c)?;
        b
    } else if let Some((p, scratch)) = sp {
        // this rank's tokens' qkv → every token for this rank's heads (B, N, 3, H/SP, D) →
        // attention → its output back to this rank's tokens, every head (B·n_r, C)
        be.matmul_forward(&mut scratch.qkv, None, ln1, w, s.qkv_w, s.qkv_b, bn, c, 3 * c)?;
        p.tokens_to_heads(be, &mut blk.qkv, &scratch.qkv, b, n_all, 3, h, d)?;
        let att_heads = blk.att_heads.as_mut().ok_or_else(|| crate::backend::BackendError::Device("sequence-parallel attention output missing".into()))?;
        be.attention_forward(att_heads, &mut blk.probs, &blk.qkv, b, n_all, h / p.size, d)?;
        p.heads_to_tokens(be, &mut blk.att, att_heads, b, n_all, 1, h, d)?;
        residual_branch(be, dp.as_deref_mut(), (i, 0), &mut blk.x1, x, &blk.att, w, (s.proj_w, s.proj_b), (bn, n), c, c)?;
        bn
    } else {
        be.matmul_forward(&mut blk.qkv, None, ln1, w, s.qkv_w, s.qkv_b, bn, c, 3 * c)?;
        if pass != (Pass::Recompute { attention_kept: true }) {
            be.attention_forward(&mut blk.att, &mut blk.probs, &blk.qkv, b, n, h, d)?;
        }
        residual_branch(be, dp.as_deref_mut(), (i, 0), &mut blk.x1, x, &blk.att, w, (s.proj_w, s.proj_b), (bn, n), c, c)?;
        bn
    };
    let per_image = if rows == b { 1 } else { n };
    let ln2 = kept_or_shared(&mut blk.ln2, shared_ln.as_deref_mut())?;
    be.layernorm_forward(ln2, &mut blk.ln2_mean, &mut blk.ln2_rstd, &blk.x1, w, s.norm2_w, s.norm2_b, rows, c)?;
    let act = kept_or_shared(&mut blk.fc1_act, shared_act.as_deref_mut())?;
    be.matmul_forward(act, Some((&mut blk.fc1_pre, gelu_saved)), ln2, w, s.fc1_w, Some(s.fc1_b), rows, c, f)?;
    if pass != Pass::Forward {
        return Ok(());
    }
    residual_branch(be, dp, (i, 1), out, &blk.x1, act, w, (s.fc2_w, s.fc2_b), (rows, per_image), f, c)
}

/// A block's residual add `out = residual + inp·Wᵀ + bias` (one fused pass); with stochastic
/// depth the branch goes through the scratch and each image's factor instead:
/// `out = residual + s · (inp·Wᵀ + bias)`. `rows`: the rows computed, `per_image` of them per image.
#[allow(clippy::too_many_arguments)]
fn residual_branch<B: Backend>(
    be: &B,
    drop: Option<&mut BranchScales<B>>,
    (block, branch): (usize, usize),
    out: &mut B::Buf,
    residual: &B::Buf,
    inp: &B::Buf,
    w: &B::Buf,
    (w_span, bias): (Span, Span),
    (rows, per_image): (usize, usize),
    ic: usize,
    oc: usize,
) -> BResult<()> {
    let Some(d) = drop else {
        return be.matmul_forward_residual(out, residual, inp, w, w_span, Some(bias), rows, ic, oc);
    };
    let off = d.offset(block, branch);
    let BranchScales { branch: scratch, scales, .. } = d;
    be.matmul_forward(scratch, None, inp, w, w_span, Some(bias), rows, ic, oc)?;
    be.scale_rows(out, Some(residual), scratch, scales, off, rows, per_image, oc)
}

/// The gradient a residual branch's output receives: the residual stream's `dres` itself, or
/// with stochastic depth each image's factor times it (written into the scratch).
fn branch_gradient<'a, B: Backend>(be: &B, drop: Option<&'a mut BranchScales<B>>, (block, branch): (usize, usize), dres: &'a B::Buf, (rows, per_image): (usize, usize), c: usize) -> BResult<&'a B::Buf> {
    let Some(d) = drop else { return Ok(dres) };
    let off = d.offset(block, branch);
    let BranchScales { branch: scratch, scales, .. } = d;
    be.scale_rows(scratch, None, dres, scales, off, rows, per_image, c)?;
    Ok(scratch)
}

pub fn smoothed_targets(labels: &[u32], k: usize, eps: f32) -> Vec<f32> {
    let mut t = vec![eps / k as f32; labels.len() * k];
    for (row, &l) in t.chunks_mut(k).zip(labels) {
        if let Some(v) = row.get_mut(l as usize) {
            *v += 1.0 - eps;
        }
    }
    t
}

/// What one forward pass returns to the host.
#[derive(Clone, Debug)]
pub struct ForwardOut {
    /// Per-image loss against the targets (B).
    pub losses: Vec<f32>,
    /// (B, K) logits.
    pub logits: Vec<f32>,
}

/// A ViT bound to one backend: master weights, gradients, and saved activations.
pub struct Vit<B: Backend> {
    pub cfg: ModelConfig,
    pub table: ParamTable,
    /// Master weights (f32), laid out by `table`; empty once `release_master` handed them to
    /// a ZeRO shard (the weights then live in the compute copy and the rank's shard).
    pub params: B::Buf,
    /// Whether `params` was released (`release_master`).
    master_released: bool,
    /// Spans of the compute copy still being written by a detached transfer (ZeRO's gather of
    /// the updated weights): the forward orders each before the first layer that reads it.
    pending_weights: Vec<(Span, Box<dyn crate::core::Fence>)>,
    /// Compute-dtype copy of the weights, when the backend computes in a narrower type.
    compute: Option<B::Buf>,
    /// Parameter gradients (f32), same layout as `params`.
    pub grads: B::Buf,
    acts: Option<Activations<B>>,
    recompute: Recompute,
    /// Batch size of inputs staged by `stage_inputs` that no forward has read yet.
    unread_inputs: Option<usize>,
    /// Batch of the last forward that computed `dlogits` (0 = none pending).
    pending_backward: usize,
    /// Under token pooling, run the last block past its attention on the class token only
    /// (see `class_token_tail`). On by default; off computes every token as timm does.
    class_token_tail: bool,
    /// Stochastic depth's branch factors for the next training passes (`set_branch_scales`).
    drop: Option<BranchScales<B>>,
    /// Whether the forward awaiting its backward scaled its branches (the backward must too).
    dropped_forward: bool,
    /// This rank's sequence-parallel group (`set_sequence_parallel`); None: whole images.
    sp: Option<SeqParallel<B>>,
    /// ZeRO-3: this rank's share of the weights, the rest gathered per block (`partition`).
    part: Option<Partition<B>>,
}

impl<B: Backend> Vit<B> {
    /// A model with all-zero weights; load or initialize them next.
    pub fn new(be: &B, cfg: ModelConfig) -> BResult<Self> {
        let total = ParamTable::new(&cfg).total;
        Self::with_gradients(be, cfg, total)
    }

    /// A model for forward passes alone (evaluation): no gradient buffer (a backward is an
    /// error), so it costs its weights and activations only.
    pub fn new_for_inference(be: &B, cfg: ModelConfig) -> BResult<Self> {
        Self::with_gradients(be, cfg, 1)
    }

    /// The model with a gradient buffer of `grads_len` values.
    fn with_gradients(be: &B, cfg: ModelConfig, grads_len: usize) -> BResult<Self> {
        let table = ParamTable::new(&cfg);
        let params = be.alloc_f32(table.total)?;
        let grads = be.alloc_f32(grads_len)?;
        let compute = if be.needs_compute_copy() { Some(be.alloc(table.total)?) } else { None };
        Ok(Vit { cfg, table, params, master_released: false, pending_weights: Vec::new(), compute, grads, acts: None, recompute: Recompute::Auto, unread_inputs: None, pending_backward: 0, class_token_tail: true, drop: None, dropped_forward: false, sp: None, part: None })
    }

    /// Replaces all weights from a host vector in table layout.
    pub fn set_params(&mut self, be: &B, host: &[f32]) -> BResult<()> {
        if host.len() != self.table.total {
            return Err(crate::backend::BackendError::Shape {
                op: "set_params",
                msg: format!("{} values for {} parameters", host.len(), self.table.total),
            });
        }
        self.check_master("set_params")?;
        be.upload(&mut self.params, 0, host)?;
        self.params_changed(be)
    }

    /// Frees the whole f32 master weights: a ZeRO rank that keeps its own shard of them
    /// (`train::zero`) and writes the compute copy directly. Only where the forward reads a
    /// compute copy; afterwards `params_host`, `set_params` and `update` are errors.
    pub fn release_master(&mut self, be: &B) -> BResult<()> {
        if self.compute.is_none() {
            return Err(crate::backend::BackendError::Shape { op: "release_master", msg: "the forward reads the master weights (no compute copy)".into() });
        }
        self.params = be.alloc_f32(1)?;
        self.master_released = true;
        Ok(())
    }

    /// ZeRO-3: hands the whole f32 weights over to `part` (this rank's pieces and the resident
    /// groups cut from them), then frees them, and the whole compute copy with them where
    /// there is one (the partition's gathers fill compute-dtype buffers of their own); from
    /// now on the forward and backward gather each partitioned block's weights as they reach
    /// it. The whole gradient buffer is replaced by this rank's partitioned gradients (its
    /// pieces, laid out as `Partition::owned`): with more than one rank every backward must
    /// then be given a `ready` that reduces each group's gradients in the gradient slot
    /// (`backward_reporting`). Under sequence parallelism the group's ranks each hold their
    /// pieces like any other rank: the partition is over the whole world.
    pub fn partition(&mut self, be: &B, mut part: Partition<B>) -> BResult<()> {
        if self.compute.is_some() != part.in_compute_dtype() {
            return Err(crate::backend::BackendError::Shape { op: "partition", msg: "the partition's gathered weights are not in the dtype the forward reads".into() });
        }
        self.check_master("partition")?;
        self.await_weights()?;
        part.seed(be, &be.download(&self.params)?)?;
        self.params = be.alloc_f32(1)?;
        self.compute = None;
        // the gradients are partitioned too: this rank's pieces, laid out as `Partition::owned`
        self.grads = be.alloc_f32(part.owned_len().max(1))?;
        self.master_released = true;
        self.part = Some(part);
        Ok(())
    }

    /// The ZeRO-3 partition, where the weights are partitioned.
    pub fn partitioned(&self) -> Option<&Partition<B>> {
        self.part.as_ref()
    }

    pub fn partitioned_mut(&mut self) -> Option<&mut Partition<B>> {
        self.part.as_mut()
    }

    /// The partition's own weights and the gradients (the ZeRO-3 update reads one, writes the
    /// other).
    pub fn partition_and_grads(&mut self) -> Option<(&mut Partition<B>, &B::Buf)> {
        self.part.as_mut().map(|p| (p, &self.grads))
    }

    /// `span` of the compute copy is being written by a transfer still in flight: the next
    /// forward makes its layers that read the span wait for `fence` (and nothing earlier).
    pub fn weights_arriving(&mut self, span: Span, fence: Box<dyn crate::core::Fence>) {
        self.pending_weights.push((span, fence));
    }

    /// Orders every transfer still writing the weights before whatever the device runs next
    /// (for readers of the weights other than the forward, such as a replayed graph).
    pub fn await_weights(&mut self) -> BResult<()> {
        for (_, f) in self.pending_weights.drain(..) {
            f.order().map_err(crate::backend::BackendError::Device)?;
        }
        Ok(())
    }

    /// Whether the whole master weights were released to a ZeRO shard.
    pub fn master_released(&self) -> bool {
        self.master_released
    }

    /// The gradients and the compute copy (None where the forward reads the master weights).
    pub fn grads_and_compute(&mut self) -> (&B::Buf, Option<&mut B::Buf>) {
        (&self.grads, self.compute.as_mut())
    }

    fn check_master(&self, op: &'static str) -> BResult<()> {
        match self.master_released {
            true => Err(crate::backend::BackendError::Shape { op, msg: "the master weights are sharded across ranks (ZeRO): gather them first".into() }),
            false => Ok(()),
        }
    }

    /// One optimizer step on the accumulated gradients, which also refreshes the compute copy
    /// (no `params_changed` needed after it).
    pub fn update(&mut self, be: &B, state: &mut B::Buf, opt: &crate::core::OptimizerConfig, decay: &crate::core::ParamGroups, hyper: crate::backend::StepHyper) -> BResult<()> {
        self.check_master("update")?;
        match self.compute.as_mut() {
            Some(c) => be.optimizer_step_cast(&mut self.params, &self.grads, state, c, opt, decay, hyper),
            None => be.optimizer_step(&mut self.params, &self.grads, state, opt, decay, hyper),
        }
    }

    /// Must be called after the master weights change otherwise (load, direct writes).
    pub fn params_changed(&mut self, be: &B) -> BResult<()> {
        self.check_master("params_changed")?;
        if let Some(c) = self.compute.as_mut() {
            be.cast(c, &self.params)?;
        }
        Ok(())
    }

    pub fn params_host(&self, be: &B) -> BResult<Vec<f32>> {
        self.check_master("params_host")?;
        be.download(&self.params)
    }

    /// Sets the activation-memory policy; takes effect when the activations are next allocated
    /// (the next forward after this call).
    pub fn set_recompute(&mut self, policy: Recompute) {
        if policy != self.recompute {
            self.recompute = policy;
            self.acts = None;
        }
    }

    /// Whether the current activations regenerate LayerNorm/GELU outputs (None before the
    /// first forward).
    pub fn recomputing(&self) -> Option<bool> {
        self.acts.as_ref().map(|a| a.regen.is_some())
    }

    /// Under checkpointing, whether each block kept its attention output and saved state
    /// (`checkpoint_keeps_attention`); None before the first forward.
    pub fn checkpoint_kept_attention(&self) -> Option<bool> {
        self.acts.as_ref().map(|a| !a.kept_attention.is_empty())
    }

    /// Whether the last block runs on the class token alone after its keys and values. Under
    /// token pooling the head reads nothing but the class token of the last block's output,
    /// and within that block only the attention mixes tokens: every other token's query,
    /// projection, LayerNorm and MLP there is dead work (5/6 of the block's linear-layer
    /// FLOPs, 6.9 % of ViT-B/16's). The loss and every gradient are the same either way
    /// (the model tests compare both).
    pub fn set_class_token_tail(&mut self, on: bool) {
        self.class_token_tail = on;
    }

    /// True when the last block is computed for the class token only (`set_class_token_tail`;
    /// never under sequence parallelism, where the class token is one rank's).
    fn tail_on_class_token(&self) -> bool {
        self.class_token_tail && self.cfg.global_pool == GlobalPool::Token && self.cfg.depth > 0 && self.sp.is_none()
    }

    /// Splits every image's tokens over `sp`'s group from the next forward on (None: whole
    /// images again). The group's size must divide the heads and not exceed the tokens.
    pub fn set_sequence_parallel(&mut self, sp: Option<SeqParallel<B>>) -> BResult<()> {
        if let Some(p) = &sp {
            let (h, n) = (self.cfg.num_heads, self.cfg.num_tokens());
            if !h.is_multiple_of(p.size) || n < p.size {
                return Err(crate::backend::BackendError::Shape {
                    op: "set_sequence_parallel",
                    msg: format!("a group of {} ranks needs whole heads and a token each: the model has {h} heads and {n} tokens", p.size),
                });
            }
        }
        self.sp = sp;
        self.acts = None;
        self.unread_inputs = None;
        Ok(())
    }

    /// (rank in the group, group size) under sequence parallelism.
    pub fn sequence_parallel(&self) -> Option<(usize, usize)> {
        self.sp.as_ref().map(|p| (p.rank, p.size))
    }

    /// Stochastic depth for the following training passes of `n` images (`model::drop_path`):
    /// `scales` laid out as `DropPath::scales` gives them, `active` says per block whether
    /// any factor can differ from 1. `None` turns it off. Evaluation forwards never scale.
    pub fn set_branch_scales(&mut self, be: &B, scales: Option<(&[f32], Vec<bool>)>, n: usize) -> BResult<()> {
        let Some((host, active)) = scales else {
            self.drop = None;
            return Ok(());
        };
        let depth = self.cfg.depth;
        if host.len() != depth * 2 * n || active.len() != depth {
            return Err(crate::backend::BackendError::Shape {
                op: "set_branch_scales",
                msg: format!("{} factors and {} block flags for {n} images of a {depth}-block model", host.len(), active.len()),
            });
        }
        BranchScales::set(&mut self.drop, be, host, active, n, n * self.cfg.num_tokens() * self.cfg.embed_dim)
    }

    pub fn zero_grads(&mut self, be: &B) -> BResult<()> {
        be.fill(&mut self.grads, 0.0)
    }

    fn ensure_capacity(&mut self, be: &B, b: usize) -> BResult<()> {
        if self.acts.as_ref().is_none_or(|a| a.cap < b) {
            self.acts = None; // free the old set before allocating the larger one
            self.unread_inputs = None;
            let sp = self.sp.as_ref().map(|p| (p.max_tokens(self.cfg.num_tokens()), p.size));
            self.acts = Some(Activations::new(be, &self.cfg, b, self.recompute, sp)?);
        }
        Ok(())
    }

    /// Forward pass over `b` images (`images` (B, 3, S, S) normalized, `targets` (B, K) soft
    /// labels). With `dloss_scale = Some(s)` the loss gradient `s·(softmax − target)` is kept
    /// for the next `backward` (s is 1/global-batch for a mean loss over the global batch).
    pub fn forward(&mut self, be: &B, images: &[f32], targets: &[f32], b: usize, dloss_scale: Option<f32>) -> BResult<ForwardOut> {
        self.stage_inputs(be, images, targets, b)?;
        self.forward_staged(be, b, dloss_scale)?;
        self.forward_out(be, b)
    }

    /// Copies a batch into the model's device input buffers, for `forward_staged`.
    pub fn stage_inputs(&mut self, be: &B, images: &[f32], targets: &[f32], b: usize) -> BResult<()> {
        self.ensure_capacity(be, b)?;
        let a = self.acts.as_mut().ok_or_else(|| crate::backend::BackendError::Device("activations missing".into()))?;
        be.upload_input(&mut a.img, images)?;
        be.upload_input(&mut a.targets, targets)?;
        self.unread_inputs = Some(b);
        Ok(())
    }

    /// `stage_inputs` for images still encoded: the backend decodes `batch.images[range]` (`b`
    /// of them) into the model's input (`Backend::decode_input`).
    pub fn stage_encoded_inputs(&mut self, be: &B, batch: &crate::core::encoded::EncodedBatch, range: std::ops::Range<usize>, targets: &[f32], b: usize) -> BResult<()> {
        if range.len() != b {
            return Err(crate::backend::BackendError::Shape { op: "stage_encoded_inputs", msg: format!("{} encoded images for a batch of {b}", range.len()) });
        }
        self.ensure_capacity(be, b)?;
        let a = self.acts.as_mut().ok_or_else(|| crate::backend::BackendError::Device("activations missing".into()))?;
        be.decode_input(&mut a.img, batch, range)?;
        be.upload_input(&mut a.targets, targets)?;
        self.unread_inputs = Some(b);
        Ok(())
    }

    /// Whether `stage_inputs` staged `b` images that no forward has read yet: a caller that
    /// staged the next batch ahead checks this before skipping the staging (anything that ran a
    /// forward in between, such as an evaluation, replaced those inputs).
    pub fn has_unread_inputs(&self, b: usize) -> bool {
        self.unread_inputs == Some(b)
    }

    /// The forward pass on the batch already staged on the device (`stage_inputs`), with no
    /// host transfer, so a device backend can capture it into a graph (benchmarks).
    pub fn forward_staged(&mut self, be: &B, b: usize, dloss_scale: Option<f32>) -> BResult<()> {
        self.ensure_capacity(be, b)?;
        self.unread_inputs = None;
        let m = &self.cfg;
        let t = &self.table.spans;
        let (n, np, c, f, k) = (m.num_tokens(), m.num_patches(), m.embed_dim, m.mlp_hidden(), m.num_classes);
        let tail = self.tail_on_class_token();
        let mut sp = self.sp.as_mut();
        // this rank's rows: every token, or its own under sequence parallelism
        let bn = b * sp.as_ref().map_or(n, |p| p.local(n).len());
        let prefix = m.num_prefix_tokens();
        // weights still arriving: each layer waits for its own (embedding first, as the
        // gather sends them)
        let mut pending = std::mem::take(&mut self.pending_weights);
        let mut arrive = |need: Span| -> BResult<()> {
            let mut i = 0;
            while i < pending.len() {
                let s = pending[i].0;
                if s.off < need.off + need.len && need.off < s.off + s.len {
                    pending.swap_remove(i).1.order().map_err(crate::backend::BackendError::Device)?;
                } else {
                    i += 1;
                }
            }
            Ok(())
        };
        let embed_end = t.blocks.first().map_or(t.final_norm_w.off, |blk| blk.norm1_w.off);
        let w = self.compute.as_ref().unwrap_or(&self.params);
        // ZeRO-3: each group's weights at offset 0 of its own buffer (`model::partition`)
        let mut part = self.part.as_mut();
        let local: Option<ModelSpans> = part.as_ref().map(|p| p.spans.clone());
        let ts = local.as_ref().unwrap_or(t);
        let a = self.acts.as_mut().ok_or_else(|| crate::backend::BackendError::Device("activations missing".into()))?;
        // stochastic depth scales the residual branches of training passes only
        let mut drop = self.drop.as_mut().filter(|_| dloss_scale.is_some());
        if let Some(d) = drop.as_ref().filter(|d| d.n != b) {
            return Err(crate::backend::BackendError::Shape { op: "forward", msg: format!("stochastic depth factors are for {} images, the pass has {b}", d.n) });
        }
        self.dropped_forward = drop.is_some();

        // ---- embedding: patches → tokens
        arrive(Span { off: 0, len: embed_end })?;
        let we = match part.as_deref() {
            Some(p) => p.weights(0)?,
            None => w,
        };
        be.patchify(&mut a.patches, &a.img, b, m.in_chans, m.image_size, m.patch_size)?;
        be.matmul_forward(&mut a.patch_emb, None, &a.patches, we, t.patch_w, Some(t.patch_b), b * np, m.patch_dim(), c)?;
        match (sp.as_deref_mut(), a.sp.as_mut()) {
            // the whole image's tokens, then this rank's of them
            (Some(p), Some(x)) => {
                be.embed_forward(&mut x.full, &a.patch_emb, we, t.pos_embed, t.cls_token, b, np, c)?;
                p.take_tokens(be, &mut a.x0, &x.full, b, n, c)?;
            }
            _ => be.embed_forward(&mut a.x0, &a.patch_emb, we, t.pos_embed, t.cls_token, b, np, c)?,
        }

        // ---- transformer blocks: x → x1 = x + proj(attn(ln1(x))) → x2 = x1 + mlp(ln2(x1))
        let gelu_saved = if a.regen.is_none() && be.gelu_saves_grad(bn, c, f) { GeluSaved::Grad } else { GeluSaved::Pre };
        a.gelu_saved = gelu_saved;
        for i in 0..m.depth {
            let s = &t.blocks[i];
            arrive(Span { off: s.norm1_w.off, len: s.fc2_b.off + s.fc2_b.len - s.norm1_w.off })?;
            // ZeRO-3: this block's weights gathered (or waited for), the next one's started
            let wb = match part.as_deref_mut() {
                Some(p) => {
                    let g = p.forward_block(be, i)?;
                    p.weights(g)?
                }
                None => w,
            };
            let s = &ts.blocks[i];
            let tail_block = tail && i + 1 == m.depth;
            if !tail_block {
                a.swap_kept_attention(i);
            }
            let (prev, rest) = a.outputs.split_at_mut(i);
            let x = if i == 0 { &a.x0 } else { &prev[i - 1] };
            let blk = &mut a.blocks[if a.checkpointing { 0 } else { i }];
            let io = BlockIo { x, out: &mut rest[0], cls_ln1: &mut a.cls_ln1, cls_q: &mut a.cls_q };
            // this block's branch factors, when it can drop anything
            let dp = drop.as_deref_mut().filter(|d| d.active[i]);
            let spp = sp.as_deref_mut().zip(a.sp.as_mut());
            block_forward(be, m, (s, wb), (i, b, tail_block), io, blk, a.regen.as_mut(), gelu_saved, dp, spp, Pass::Forward)?;
            if !tail_block {
                a.swap_kept_attention(i);
            }
        }
        let x_last = a.outputs.last().unwrap_or(&a.x0);

        // ---- pooling + final norm → head input (B, C). timm normalizes every token and then
        // takes the class token (token pool) or normalizes the patch tokens' mean (avg pool,
        // fc_norm); LayerNorm is per row, so pooling first gives the same head input from B
        // rows instead of B·N. With the class token tail the last block's output already is
        // that one row per image (a pool over one token copies it).
        arrive(Span { off: t.final_norm_w.off, len: self.table.total - t.final_norm_w.off })?;
        // (anything left is outside every layer's weights: ordered anyway)
        for (_, f) in pending.drain(..) {
            f.order().map_err(crate::backend::BackendError::Device)?;
        }
        let avg = m.global_pool == GlobalPool::Avg;
        let n_out = if tail { 1 } else { n };
        match sp {
            // over the group: the same pooled features on each of its ranks
            Some(p) => p.pool_forward(be, &mut a.pooled_raw, x_last, b, n, c, prefix, avg)?,
            None => be.pool_forward(&mut a.pooled_raw, x_last, b, n_out, c, prefix, avg)?,
        }
        let wh = match part.as_deref() {
            Some(p) => p.weights(m.depth + 1)?,
            None => w,
        };
        be.layernorm_forward(&mut a.pooled, &mut a.final_mean, &mut a.final_rstd, &a.pooled_raw, wh, ts.final_norm_w, ts.final_norm_b, b, c)?;
        be.matmul_forward(&mut a.logits, None, &a.pooled, wh, ts.head_w, Some(ts.head_b), b, c, k)?;

        // ---- loss (and its gradient, when a backward follows)
        let dl = dloss_scale.map(|_| &mut a.dlogits);
        be.cross_entropy(&mut a.losses, dl, &a.logits, &a.targets, b, k, dloss_scale.unwrap_or(0.0))?;
        // the images were read by the patchify, the targets just now: the next batch may be staged
        be.inputs_consumed()?;
        self.pending_backward = if dloss_scale.is_some() { b } else { 0 };
        Ok(())
    }

    /// Losses and logits of the last forward over `b` images, copied to the host.
    pub fn forward_out(&self, be: &B, b: usize) -> BResult<ForwardOut> {
        let k = self.cfg.num_classes;
        let a = self.acts.as_ref().ok_or_else(|| crate::backend::BackendError::Device("activations missing".into()))?;
        let mut losses = be.download(&a.losses)?;
        losses.truncate(b);
        let mut logits = be.download(&a.logits)?;
        logits.truncate(b * k);
        Ok(ForwardOut { losses, logits })
    }

    /// The device buffer of the last forward's per-image losses (its capacity's length; the
    /// first B entries are the last batch's).
    pub fn losses_buf(&self) -> BResult<&B::Buf> {
        self.acts.as_ref().map(|a| &a.losses).ok_or_else(|| crate::backend::BackendError::Device("activations missing".into()))
    }

    /// Backward of the last `forward` (which must have been given a `dloss_scale`): adds this
    /// micro-batch's parameter gradients into `grads`.
    pub fn backward(&mut self, be: &B) -> BResult<()> {
        self.backward_reporting(be, None::<&mut dyn FnMut(&mut B::Buf, Span) -> BResult<()>>)
    }

    /// `backward`, calling `ready(grads, span)` as soon as the gradients of each contiguous
    /// group of parameters are final for this pass, in the backward's order: the head with the
    /// final norm, then blocks last to first, then the embedding. Each call comes after the
    /// deferred bias sums written so far are flushed, so the span really is complete. Under
    /// ZeRO-3 (`partition`) the buffer is the gradient slot holding this pass's gradients of
    /// the group `span` at offset 0, which `ready` reduces over the ranks in place before it
    /// returns (this rank's pieces of it are then added to the partitioned gradients).
    pub fn backward_reporting<E: From<crate::backend::BackendError>>(
        &mut self,
        be: &B,
        ready: Option<&mut dyn FnMut(&mut B::Buf, Span) -> Result<(), E>>,
    ) -> Result<(), E> {
        // The backend may batch the pass's gradient reductions (the CUDA backend: a few launches).
        be.defer_gradient_sums(true)?;
        let r = self.backward_pass(be, ready);
        let flushed = be.defer_gradient_sums(false);
        r.and(flushed.map_err(E::from))
    }

    /// The parameter groups `backward_reporting` reports, in its order: (head + final norm,
    /// block depth-1 … block 0, embedding), as spans of the flat buffer.
    pub fn gradient_groups(&self) -> Vec<Span> {
        self.table.gradient_groups()
    }

    fn backward_pass<E: From<crate::backend::BackendError>>(&mut self, be: &B, mut ready: Option<&mut dyn FnMut(&mut B::Buf, Span) -> Result<(), E>>) -> Result<(), E> {
        let groups = if ready.is_some() { self.gradient_groups() } else { Vec::new() };
        // ZeRO-3's gradients are partitioned: each group's must be reduced over the ranks
        // before this rank keeps its pieces of it
        if ready.is_none() && self.part.as_ref().is_some_and(|p| p.world_size() > 1) {
            return Err(crate::backend::BackendError::Device("a backward over partitioned gradients (ZeRO stage 3) on several ranks needs the gradient reduction of each group (`backward_reporting`)".into()).into());
        }
        // flushes the deferred sums, then hands the group over
        let mut report = |g: &mut B::Buf, idx: usize| -> Result<(), E> {
            if let Some(f) = ready.as_mut() {
                be.defer_gradient_sums(false)?;
                be.defer_gradient_sums(true)?;
                f(g, groups[idx])?;
            }
            Ok(())
        };
        let b = self.pending_backward;
        if b == 0 {
            return Err(crate::backend::BackendError::Device("backward without a training forward".into()).into());
        }
        self.pending_backward = 0;
        let m = &self.cfg;
        let t = &self.table.spans;
        let (n, np, c, k) = (m.num_tokens(), m.num_patches(), m.embed_dim, m.num_classes);
        let w = self.compute.as_ref().unwrap_or(&self.params);
        let tail = self.tail_on_class_token();
        let mut sp = self.sp.as_mut();
        let g = &mut self.grads;
        // ZeRO-3: each group's weights, and this pass's gradients of it in the gradient slot
        // (zeroed first), at offset 0; the slot is reduced over the ranks (`report`) and this
        // rank's pieces of it are added into `g`, its partitioned gradients (`add_grads`). No
        // LayerNorm backward sums another group's bias gradient
        let mut part = self.part.as_mut();
        let local: Option<ModelSpans> = part.as_ref().map(|p| p.spans.clone());
        let ts = local.as_ref().unwrap_or(t);
        let partitioned = part.is_some();
        let a = self.acts.as_mut().ok_or_else(|| crate::backend::BackendError::Device("activations missing".into()))?;
        let prefix = m.num_prefix_tokens();
        // the forward's stochastic depth: a scaled branch's bias gradient is summed from its
        // scaled output gradient, so no LayerNorm backward may sum it from the unscaled one
        let mut drop = self.drop.as_mut().filter(|_| std::mem::take(&mut self.dropped_forward));
        let dropping: Vec<bool> = (0..m.depth).map(|i| drop.as_ref().is_some_and(|d| d.active[i])).collect();

        // ---- head, pooling, final norm → residual-stream gradient of the last block (dres_a)
        let (wh, gh) = match part.as_deref_mut() {
            Some(p) => {
                let (wb, gs) = p.weights_and_grad_slot(m.depth + 1)?;
                be.fill(gs, 0.0)?;
                (wb, gs)
            }
            None => (w, &mut *g),
        };
        be.matmul_backward(&mut a.dpooled, gh, &a.dlogits, &a.pooled, None, wh, ts.head_w, Some(ts.head_b), b, c, k)?;
        // The final norm's backward also sums its input gradient into the last fc2's bias
        // gradient: the pool's backward spreads dpooled_raw over the tokens without changing its
        // column sums (the class token's row, or N − prefix rows of 1/(N − prefix) each).
        // `fc2_bias_summed`: the block about to be differentiated has its fc2 bias gradient.
        // (not under sequence parallelism: each rank's pool backward spreads a part of it)
        let last_fc2_b = t.blocks.last().map(|s| s.fc2_b).filter(|_| !dropping[m.depth - 1] && sp.is_none() && !partitioned);
        let avg = m.global_pool == GlobalPool::Avg;
        be.layernorm_backward(&mut a.dpooled_raw, gh, &a.dpooled, None, &a.pooled_raw, &a.final_mean, &a.final_rstd, wh, ts.final_norm_w, ts.final_norm_b, b, c, last_fc2_b)?;
        let n_out = if tail { 1 } else { n };
        match sp.as_deref_mut() {
            Some(p) => {
                p.pool_backward(be, &mut a.dres_a, &a.dpooled_raw, b, n, c, prefix, avg)?;
                if p.rank != 0 {
                    // every rank of the group ran the head on the same features: one keeps
                    // their gradients (the deferred bias sums written first)
                    be.defer_gradient_sums(false)?;
                    be.defer_gradient_sums(true)?;
                    for s in [ts.final_norm_w, ts.final_norm_b, ts.head_w, ts.head_b] {
                        be.upload(gh, s.off, &vec![0.0; s.len])?;
                    }
                }
            }
            None => be.pool_backward(&mut a.dres_a, &a.dpooled_raw, b, n_out, c, prefix, avg)?,
        }
        let mut fc2_bias_summed = last_fc2_b.is_some();
        match part.as_deref_mut() {
            Some(p) => {
                report(&mut p.grad_slot, 0)?;
                p.add_grads(be, m.depth + 1, g)?;
            }
            None => report(g, 0)?,
        }

        // ---- blocks in reverse; dres_a holds d(block output) on entry and d(block input) on exit
        // Where the backend's weight products sum the bias gradients from their own operands,
        // no LayerNorm or attention backward sums them.
        let (proj_fc2_in_products, qkv_in_product) = {
            let rows = b * n;
            (be.bias_grads_in_products(rows, c, c) && be.bias_grads_in_products(rows, m.mlp_hidden(), c), be.bias_grads_in_products(rows, c, 3 * c))
        };
        for i in (0..m.depth).rev() {
            // a block's fc2 bias gradient is summed by the LayerNorm backward that follows
            // the block after it (or the final norm's), unless a branch factor scales it
            let prev_fc2_b = i.checked_sub(1).filter(|&p| !dropping[p] && !partitioned && !proj_fc2_in_products).map(|p| t.blocks[p].fc2_b);
            let bias = BiasSums { fc2: (!fc2_bias_summed).then_some(ts.blocks[i].fc2_b), proj_in_ln2: !dropping[i] && !proj_fc2_in_products, prev_fc2: prev_fc2_b, qkv_in_product };
            let dp = drop.as_deref_mut().filter(|d| d.active[i]);
            let cx = (i, b, tail && i + 1 == m.depth);
            match part.as_deref_mut() {
                Some(p) => {
                    // this block's weights (still in a slot from the forward, or gathered
                    // again), the one before it started
                    let grp = p.backward_block(be, i)?;
                    let (wb, gs) = p.weights_and_grad_slot(grp)?;
                    be.fill(gs, 0.0)?;
                    block_backward(be, m, (&ts.blocks[i], wb), gs, a, cx, bias, dp, sp.as_deref_mut())?;
                    report(&mut p.grad_slot, m.depth - i)?;
                    p.add_grads(be, grp, g)?;
                }
                None => {
                    block_backward(be, m, (&t.blocks[i], w), g, a, cx, bias, dp, sp.as_deref_mut())?;
                    report(g, m.depth - i)?;
                }
            }
            fc2_bias_summed = prev_fc2_b.is_some();
        }

        // ---- embedding (its spans start at 0 in the partition too: at stage 3 its gradients
        // go into the gradient slot at the table's offsets)
        let (w, ge) = match part.as_deref_mut() {
            Some(p) => {
                let (wb, gs) = p.weights_and_grad_slot(0)?;
                be.fill(gs, 0.0)?;
                (wb, gs)
            }
            None => (w, &mut *g),
        };
        match (sp, a.sp.as_mut()) {
            // this rank's rows of the whole image's gradient (zeros in the others'): the
            // position embedding, class token and patch embedding gradients of its tokens
            (Some(p), Some(x)) => {
                p.put_tokens(be, &mut x.full, &a.dres_a, b, n, c)?;
                be.embed_backward(&mut a.dpatch_emb, ge, &x.full, t.pos_embed, t.cls_token, b, np, c)?;
            }
            _ => be.embed_backward(&mut a.dpatch_emb, ge, &a.dres_a, t.pos_embed, t.cls_token, b, np, c)?,
        }
        be.matmul_backward_weights(ge, &a.dpatch_emb, &a.patches, w, t.patch_w, Some(t.patch_b), b * np, m.patch_dim(), c)?;
        match part {
            Some(p) => {
                report(&mut p.grad_slot, m.depth + 1)?;
                p.add_grads(be, 0, g)?;
            }
            None => report(g, m.depth + 1)?,
        }
        Ok(())
    }
}
