//! The ViT forward pass and its manual backward, written once over the `Backend` trait.
//! Reads top to bottom like the model: patchify → patch embedding → tokens (+ class token,
//! + position embedding) → `depth` pre-LN blocks → final norm + pool → head → cross-entropy.
//!
//! Every layer's forward saves what its backward needs in `Activations`; backward walks the
//! same list in reverse. Parameter gradients accumulate into `grads` (so micro-batches of a
//! gradient-accumulation window add up), activation gradients overwrite.

use crate::backend::{BResult, Backend};

use super::params::ParamTable;
use super::spec::{GlobalPool, ModelConfig};

/// Saved activations of one transformer block (B·N rows of width C unless noted).
struct BlockActs<B: Backend> {
    ln1: B::Buf,
    ln1_mean: B::Buf, // (B·N)
    ln1_rstd: B::Buf, // (B·N)
    qkv: B::Buf,      // (B·N, 3C)
    probs: B::Buf,    // attention saved state (backend-defined, ≤ B·H·N·N; the probabilities on CPU)
    att: B::Buf,      // (B·N, C) attention output before proj
    x1: B::Buf,       // residual stream after attention
    ln2: B::Buf,
    ln2_mean: B::Buf,
    ln2_rstd: B::Buf,
    fc1_pre: B::Buf, // (B·N, F) before GELU
    fc1_act: B::Buf, // (B·N, F) after GELU
    x2: B::Buf,      // residual stream after the MLP = block output
}

/// Every buffer of one forward/backward at a given batch capacity.
struct Activations<B: Backend> {
    cap: usize,
    img: B::Buf,       // (B, 3, S, S)
    patches: B::Buf,   // (B·NP, 3·P·P)
    patch_emb: B::Buf, // (B·NP, C)
    x0: B::Buf,        // (B·N, C) tokens entering block 0
    blocks: Vec<BlockActs<B>>,
    final_ln: B::Buf, // token pool: (B·N, C) normed tokens; avg pool: (B, C) normed pooled
    final_mean: B::Buf,
    final_rstd: B::Buf,
    pooled_raw: B::Buf, // avg pool: (B, C) mean of patch tokens before fc_norm
    pooled: B::Buf,     // (B, C) head input
    logits: B::Buf,     // (B, K)
    targets: B::Buf,    // (B, K) f32
    losses: B::Buf,     // (B) f32
    // gradient scratch, reused across blocks
    dlogits: B::Buf,
    dpooled: B::Buf,     // (B, C)
    dpooled_raw: B::Buf, // (B, C)
    dfinal: B::Buf,      // (B·N, C)
    dres_a: B::Buf,      // (B·N, C) residual-stream gradient (ping)
    dres_b: B::Buf,      // (B·N, C) residual-stream gradient (pong)
    dln: B::Buf,         // (B·N, C)
    dqkv: B::Buf,        // (B·N, 3C)
    datt: B::Buf,        // (B·N, C)
    dfc: B::Buf,         // (B·N, F)
    scratch: B::Buf,     // (B·N, C) proj / fc2 outputs before the residual add
    dpatch_emb: B::Buf,  // (B·NP, C)
    dpatches: B::Buf,    // (B·NP, 3·P·P), computed by the generic matmul backward, unused
}

impl<B: Backend> Activations<B> {
    fn new(be: &B, m: &ModelConfig, cap: usize) -> BResult<Self> {
        let (n, np, c, f, k) = (m.num_tokens(), m.num_patches(), m.embed_dim, m.mlp_hidden(), m.num_classes);
        let bn = cap * n;
        let mut blocks = Vec::with_capacity(m.depth);
        for _ in 0..m.depth {
            blocks.push(BlockActs {
                ln1: be.alloc(bn * c)?,
                ln1_mean: be.alloc_f32(bn)?,
                ln1_rstd: be.alloc_f32(bn)?,
                qkv: be.alloc(bn * 3 * c)?,
                probs: be.alloc(be.attention_saved_len(cap, n, m.num_heads, m.embed_dim / m.num_heads))?,
                att: be.alloc(bn * c)?,
                x1: be.alloc(bn * c)?,
                ln2: be.alloc(bn * c)?,
                ln2_mean: be.alloc_f32(bn)?,
                ln2_rstd: be.alloc_f32(bn)?,
                fc1_pre: be.alloc(bn * f)?,
                fc1_act: be.alloc(bn * f)?,
                x2: be.alloc(bn * c)?,
            });
        }
        let final_rows = match m.global_pool {
            GlobalPool::Token => bn,
            GlobalPool::Avg => cap,
        };
        Ok(Activations {
            cap,
            img: be.alloc(cap * m.in_chans * m.image_size * m.image_size)?,
            patches: be.alloc(cap * np * m.patch_dim())?,
            patch_emb: be.alloc(cap * np * c)?,
            x0: be.alloc(bn * c)?,
            blocks,
            final_ln: be.alloc(final_rows * c)?,
            final_mean: be.alloc_f32(final_rows)?,
            final_rstd: be.alloc_f32(final_rows)?,
            pooled_raw: be.alloc(cap * c)?,
            pooled: be.alloc(cap * c)?,
            logits: be.alloc(cap * k)?,
            targets: be.alloc_f32(cap * k)?,
            losses: be.alloc_f32(cap)?,
            dlogits: be.alloc(cap * k)?,
            dpooled: be.alloc(cap * c)?,
            dpooled_raw: be.alloc(cap * c)?,
            dfinal: be.alloc(final_rows * c)?,
            dres_a: be.alloc(bn * c)?,
            dres_b: be.alloc(bn * c)?,
            dln: be.alloc(bn * c)?,
            dqkv: be.alloc(bn * 3 * c)?,
            datt: be.alloc(bn * c)?,
            dfc: be.alloc(bn * f)?,
            scratch: be.alloc(bn * c)?,
            dpatch_emb: be.alloc(cap * np * c)?,
            dpatches: be.alloc(cap * np * m.patch_dim())?,
        })
    }
}

/// One-hot targets with label smoothing ε: (1 − ε)·onehot + ε/K, as torch's cross-entropy.
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
    /// Master weights (f32), laid out by `table`.
    pub params: B::Buf,
    /// Compute-dtype copy of the weights, when the backend computes in a narrower type.
    compute: Option<B::Buf>,
    /// Parameter gradients (f32), same layout as `params`.
    pub grads: B::Buf,
    acts: Option<Activations<B>>,
    /// Batch of the last forward that computed `dlogits` (0 = none pending).
    pending_backward: usize,
}

impl<B: Backend> Vit<B> {
    /// A model with all-zero weights; load or initialize them next.
    pub fn new(be: &B, cfg: ModelConfig) -> BResult<Self> {
        let table = ParamTable::new(&cfg);
        let params = be.alloc_f32(table.total)?;
        let grads = be.alloc_f32(table.total)?;
        let compute = if be.needs_compute_copy() { Some(be.alloc(table.total)?) } else { None };
        Ok(Vit { cfg, table, params, compute, grads, acts: None, pending_backward: 0 })
    }

    /// Replaces all weights from a host vector in table layout.
    pub fn set_params(&mut self, be: &B, host: &[f32]) -> BResult<()> {
        if host.len() != self.table.total {
            return Err(crate::backend::BackendError::Shape {
                op: "set_params",
                msg: format!("{} values for {} parameters", host.len(), self.table.total),
            });
        }
        be.upload(&mut self.params, 0, host)?;
        self.params_changed(be)
    }

    /// Must be called after the master weights change (optimizer step, load).
    pub fn params_changed(&mut self, be: &B) -> BResult<()> {
        if let Some(c) = self.compute.as_mut() {
            be.cast(c, &self.params)?;
        }
        Ok(())
    }

    pub fn params_host(&self, be: &B) -> BResult<Vec<f32>> {
        be.download(&self.params)
    }

    pub fn zero_grads(&mut self, be: &B) -> BResult<()> {
        be.fill(&mut self.grads, 0.0)
    }

    fn ensure_capacity(&mut self, be: &B, b: usize) -> BResult<()> {
        if self.acts.as_ref().is_none_or(|a| a.cap < b) {
            self.acts = None; // free the old set before allocating the larger one
            self.acts = Some(Activations::new(be, &self.cfg, b)?);
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
        be.upload(&mut a.img, 0, images)?;
        be.upload(&mut a.targets, 0, targets)
    }

    /// The forward pass on the batch already staged on the device (`stage_inputs`), with no
    /// host transfer, so a device backend can capture it into a graph (benchmarks).
    pub fn forward_staged(&mut self, be: &B, b: usize, dloss_scale: Option<f32>) -> BResult<()> {
        self.ensure_capacity(be, b)?;
        let m = &self.cfg;
        let t = &self.table.spans;
        let (n, np, c, h, d, f, k) =
            (m.num_tokens(), m.num_patches(), m.embed_dim, m.num_heads, m.head_dim(), m.mlp_hidden(), m.num_classes);
        let bn = b * n;
        let w = self.compute.as_ref().unwrap_or(&self.params);
        let a = self.acts.as_mut().ok_or_else(|| crate::backend::BackendError::Device("activations missing".into()))?;

        // ---- embedding: patches → tokens
        be.patchify(&mut a.patches, &a.img, b, m.in_chans, m.image_size, m.patch_size)?;
        be.matmul_forward(&mut a.patch_emb, None, &a.patches, w, t.patch_w, Some(t.patch_b), b * np, m.patch_dim(), c)?;
        be.embed_forward(&mut a.x0, &a.patch_emb, w, t.pos_embed, t.cls_token, b, np, c)?;

        // ---- transformer blocks: x → x1 = x + proj(attn(ln1(x))) → x2 = x1 + mlp(ln2(x1))
        for i in 0..m.depth {
            let (done, rest) = a.blocks.split_at_mut(i);
            let x = if i == 0 { &a.x0 } else { &done[i - 1].x2 };
            let blk = &mut rest[0];
            let s = &t.blocks[i];
            be.layernorm_forward(&mut blk.ln1, &mut blk.ln1_mean, &mut blk.ln1_rstd, x, w, s.norm1_w, s.norm1_b, bn, c)?;
            be.matmul_forward(&mut blk.qkv, None, &blk.ln1, w, s.qkv_w, s.qkv_b, bn, c, 3 * c)?;
            be.attention_forward(&mut blk.att, &mut blk.probs, &blk.qkv, b, n, h, d)?;
            be.matmul_forward(&mut a.scratch, None, &blk.att, w, s.proj_w, Some(s.proj_b), bn, c, c)?;
            be.add(&mut blk.x1, x, &a.scratch)?;
            be.layernorm_forward(&mut blk.ln2, &mut blk.ln2_mean, &mut blk.ln2_rstd, &blk.x1, w, s.norm2_w, s.norm2_b, bn, c)?;
            be.matmul_forward(&mut blk.fc1_act, Some(&mut blk.fc1_pre), &blk.ln2, w, s.fc1_w, Some(s.fc1_b), bn, c, f)?;
            be.matmul_forward(&mut a.scratch, None, &blk.fc1_act, w, s.fc2_w, Some(s.fc2_b), bn, f, c)?;
            be.add(&mut blk.x2, &blk.x1, &a.scratch)?;
        }
        let x_last = a.blocks.last().map_or(&a.x0, |blk| &blk.x2);

        // ---- final norm + pooling → head input (B, C)
        let prefix = m.num_prefix_tokens();
        match m.global_pool {
            GlobalPool::Token => {
                be.layernorm_forward(&mut a.final_ln, &mut a.final_mean, &mut a.final_rstd, x_last, w, t.final_norm_w, t.final_norm_b, bn, c)?;
                be.pool_forward(&mut a.pooled, &a.final_ln, b, n, c, prefix, false)?;
            }
            GlobalPool::Avg => {
                be.pool_forward(&mut a.pooled_raw, x_last, b, n, c, prefix, true)?;
                be.layernorm_forward(&mut a.pooled, &mut a.final_mean, &mut a.final_rstd, &a.pooled_raw, w, t.final_norm_w, t.final_norm_b, b, c)?;
            }
        }
        be.matmul_forward(&mut a.logits, None, &a.pooled, w, t.head_w, Some(t.head_b), b, c, k)?;

        // ---- loss (and its gradient, when a backward follows)
        let dl = dloss_scale.map(|_| &mut a.dlogits);
        be.cross_entropy(&mut a.losses, dl, &a.logits, &a.targets, b, k, dloss_scale.unwrap_or(0.0))?;
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

    /// Backward of the last `forward` (which must have been given a `dloss_scale`): adds this
    /// micro-batch's parameter gradients into `grads`.
    pub fn backward(&mut self, be: &B) -> BResult<()> {
        let b = self.pending_backward;
        if b == 0 {
            return Err(crate::backend::BackendError::Device("backward without a training forward".into()));
        }
        self.pending_backward = 0;
        let m = &self.cfg;
        let t = &self.table.spans;
        let (n, np, c, h, d, f, k) =
            (m.num_tokens(), m.num_patches(), m.embed_dim, m.num_heads, m.head_dim(), m.mlp_hidden(), m.num_classes);
        let bn = b * n;
        let w = self.compute.as_ref().unwrap_or(&self.params);
        let g = &mut self.grads;
        let a = self.acts.as_mut().ok_or_else(|| crate::backend::BackendError::Device("activations missing".into()))?;
        let prefix = m.num_prefix_tokens();

        // ---- head, pooling, final norm → residual-stream gradient of the last block (dres_a)
        be.matmul_backward(&mut a.dpooled, g, &a.dlogits, &a.pooled, None, w, t.head_w, Some(t.head_b), b, c, k)?;
        {
            let x_last = a.blocks.last().map_or(&a.x0, |blk| &blk.x2);
            match m.global_pool {
                GlobalPool::Token => {
                    be.pool_backward(&mut a.dfinal, &a.dpooled, b, n, c, prefix, false)?;
                    be.layernorm_backward(&mut a.dres_a, g, &a.dfinal, None, x_last, &a.final_mean, &a.final_rstd, w, t.final_norm_w, t.final_norm_b, bn, c)?;
                }
                GlobalPool::Avg => {
                    be.layernorm_backward(&mut a.dpooled_raw, g, &a.dpooled, None, &a.pooled_raw, &a.final_mean, &a.final_rstd, w, t.final_norm_w, t.final_norm_b, b, c)?;
                    be.pool_backward(&mut a.dres_a, &a.dpooled_raw, b, n, c, prefix, true)?;
                }
            }
        }

        // ---- blocks in reverse; dres_a holds d(block output) on entry and d(block input) on exit
        for i in (0..m.depth).rev() {
            let (done, rest) = a.blocks.split_at(i);
            let x = if i == 0 { &a.x0 } else { &done[i - 1].x2 };
            let blk = &rest[0];
            let s = &t.blocks[i];
            // MLP: fc2 (with the GELU backward fused), fc1, ln2 (+ residual) → dres_b = dx1
            be.matmul_backward(&mut a.dfc, g, &a.dres_a, &blk.fc1_act, Some(&blk.fc1_pre), w, s.fc2_w, Some(s.fc2_b), bn, f, c)?;
            be.matmul_backward(&mut a.dln, g, &a.dfc, &blk.ln2, None, w, s.fc1_w, Some(s.fc1_b), bn, c, f)?;
            be.layernorm_backward(&mut a.dres_b, g, &a.dln, Some(&a.dres_a), &blk.x1, &blk.ln2_mean, &blk.ln2_rstd, w, s.norm2_w, s.norm2_b, bn, c)?;
            // attention: proj, core, qkv, ln1 (+ residual) → dres_a = dx
            be.matmul_backward(&mut a.datt, g, &a.dres_b, &blk.att, None, w, s.proj_w, Some(s.proj_b), bn, c, c)?;
            be.attention_backward(&mut a.dqkv, &a.datt, &blk.qkv, &blk.att, &blk.probs, b, n, h, d)?;
            be.matmul_backward(&mut a.dln, g, &a.dqkv, &blk.ln1, None, w, s.qkv_w, s.qkv_b, bn, c, 3 * c)?;
            be.layernorm_backward(&mut a.dres_a, g, &a.dln, Some(&a.dres_b), x, &blk.ln1_mean, &blk.ln1_rstd, w, s.norm1_w, s.norm1_b, bn, c)?;
        }

        // ---- embedding
        be.embed_backward(&mut a.dpatch_emb, g, &a.dres_a, t.pos_embed, t.cls_token, b, np, c)?;
        be.matmul_backward(&mut a.dpatches, g, &a.dpatch_emb, &a.patches, None, w, t.patch_w, Some(t.patch_b), b * np, m.patch_dim(), c)?;
        Ok(())
    }
}
