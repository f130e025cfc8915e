//! The parameter table: every tensor of the ViT as (timm key, shape, kind, span in the flat
//! buffer), generated from one `ModelConfig`. Bucketing, sharding, checkpoints, weight decay
//! groups and timm import/export are each one loop over this table.

pub use crate::core::ParamKind;
use crate::core::{ParamGroups, DecaySkip, Span};

use super::spec::{GlobalPool, ModelConfig};

/// One named tensor.
#[derive(Clone, Debug)]
pub struct ParamEntry {
    /// The timm `state_dict` key.
    pub name: String,
    /// The timm shape (e.g. `[1, N, C]` for `pos_embed`, `[C, 3, P, P]` for the patch conv).
    pub shape: Vec<usize>,
    pub kind: ParamKind,
    pub span: Span,
}

/// Spans of one transformer block.
#[derive(Clone, Copy, Debug)]
pub struct BlockSpans {
    pub norm1_w: Span,
    pub norm1_b: Span,
    pub qkv_w: Span,
    pub qkv_b: Option<Span>,
    pub proj_w: Span,
    pub proj_b: Span,
    pub norm2_w: Span,
    pub norm2_b: Span,
    pub fc1_w: Span,
    pub fc1_b: Span,
    pub fc2_w: Span,
    pub fc2_b: Span,
}

/// Spans the forward/backward pass addresses directly.
#[derive(Clone, Debug)]
pub struct ModelSpans {
    pub cls_token: Option<Span>,
    pub pos_embed: Span,
    pub patch_w: Span,
    pub patch_b: Span,
    pub blocks: Vec<BlockSpans>,
    /// `norm` (token pooling) or `fc_norm` (avg pooling): the final LayerNorm.
    pub final_norm_w: Span,
    pub final_norm_b: Span,
    pub head_w: Span,
    pub head_b: Span,
}

/// All parameters of a model, in timm's `state_dict` order.
#[derive(Clone, Debug)]
pub struct ParamTable {
    pub entries: Vec<ParamEntry>,
    pub spans: ModelSpans,
    /// Total elements in the flat buffer.
    pub total: usize,
}

struct Builder {
    entries: Vec<ParamEntry>,
    total: usize,
}

impl Builder {
    fn add(&mut self, name: impl Into<String>, shape: &[usize], kind: ParamKind) -> Span {
        let len = shape.iter().product();
        let span = Span { off: self.total, len };
        self.total += len;
        self.entries.push(ParamEntry { name: name.into(), shape: shape.to_vec(), kind, span });
        span
    }
}

impl ParamTable {
    pub fn new(m: &ModelConfig) -> ParamTable {
        let c = m.embed_dim;
        let f = m.mlp_hidden();
        let p = m.patch_size;
        let mut t = Builder { entries: Vec::new(), total: 0 };
        let cls_token = m.class_token.then(|| t.add("cls_token", &[1, 1, c], ParamKind::ClsToken));
        let pos_embed = t.add("pos_embed", &[1, m.num_tokens(), c], ParamKind::PosEmbed);
        let patch_w = t.add("patch_embed.proj.weight", &[c, m.in_chans, p, p], ParamKind::Weight);
        let patch_b = t.add("patch_embed.proj.bias", &[c], ParamKind::Bias);
        let mut blocks = Vec::with_capacity(m.depth);
        for i in 0..m.depth {
            let k = |s: &str| format!("blocks.{i}.{s}");
            let norm1_w = t.add(k("norm1.weight"), &[c], ParamKind::NormWeight);
            let norm1_b = t.add(k("norm1.bias"), &[c], ParamKind::NormBias);
            let qkv_w = t.add(k("attn.qkv.weight"), &[3 * c, c], ParamKind::Weight);
            let qkv_b = m.qkv_bias.then(|| t.add(k("attn.qkv.bias"), &[3 * c], ParamKind::Bias));
            let proj_w = t.add(k("attn.proj.weight"), &[c, c], ParamKind::Weight);
            let proj_b = t.add(k("attn.proj.bias"), &[c], ParamKind::Bias);
            let norm2_w = t.add(k("norm2.weight"), &[c], ParamKind::NormWeight);
            let norm2_b = t.add(k("norm2.bias"), &[c], ParamKind::NormBias);
            let fc1_w = t.add(k("mlp.fc1.weight"), &[f, c], ParamKind::Weight);
            let fc1_b = t.add(k("mlp.fc1.bias"), &[f], ParamKind::Bias);
            let fc2_w = t.add(k("mlp.fc2.weight"), &[c, f], ParamKind::Weight);
            let fc2_b = t.add(k("mlp.fc2.bias"), &[c], ParamKind::Bias);
            blocks.push(BlockSpans {
                norm1_w, norm1_b, qkv_w, qkv_b, proj_w, proj_b, norm2_w, norm2_b, fc1_w, fc1_b, fc2_w, fc2_b,
            });
        }
        // timm: `norm` before token pooling, `fc_norm` after average pooling.
        let norm_name = match m.global_pool {
            GlobalPool::Token => "norm",
            GlobalPool::Avg => "fc_norm",
        };
        let final_norm_w = t.add(format!("{norm_name}.weight"), &[c], ParamKind::NormWeight);
        let final_norm_b = t.add(format!("{norm_name}.bias"), &[c], ParamKind::NormBias);
        let head_w = t.add("head.weight", &[m.num_classes, c], ParamKind::Weight);
        let head_b = t.add("head.bias", &[m.num_classes], ParamKind::Bias);
        let spans = ModelSpans {
            cls_token, pos_embed, patch_w, patch_b, blocks, final_norm_w, final_norm_b, head_w, head_b,
        };
        ParamTable { entries: t.entries, spans, total: t.total }
    }

    /// The parameter groups the backward finishes one after another, in its order: head +
    /// final norm, block depth-1 … block 0, the embedding (`Vit::gradient_groups`), as spans of
    /// the flat buffer.
    pub fn gradient_groups(&self) -> Vec<Span> {
        let t = &self.spans;
        let mut out = vec![Span { off: t.final_norm_w.off, len: self.total - t.final_norm_w.off }];
        for blk in t.blocks.iter().rev() {
            out.push(Span { off: blk.norm1_w.off, len: blk.fc2_b.off + blk.fc2_b.len - blk.norm1_w.off });
        }
        let embed_end = t.blocks.first().map_or(t.final_norm_w.off, |blk| blk.norm1_w.off);
        out.push(Span { off: 0, len: embed_end });
        out
    }

    pub fn get(&self, name: &str) -> Option<&ParamEntry> {
        self.entries.iter().find(|e| e.name == name)
    }

    /// Which parameters the optimizer decays under the `train.weight_decay_skip` setting, in
    /// table order.
    pub fn decay_groups(&self, skip: &DecaySkip) -> ParamGroups {
        ParamGroups::from_kinds(self.entries.iter().map(|e| (e.span, e.kind)), skip)
    }
}

impl ParamGroups {
    /// `table.decay_groups(skip)`: defined here because `core`, where the type lives, cannot
    /// name the parameter table.
    pub fn new(table: &ParamTable, skip: &DecaySkip) -> Self {
        table.decay_groups(skip)
    }

    /// These groups (one per table entry, as `new` makes them) with timm's layer-wise
    /// learning-rate factors (`param_groups_layer_decay` over the ViT's `group_matcher`): with D
    /// blocks, the stem (patch embedding, class token, position embedding) trains at
    /// `layer_decay^(D+1)`, block i at `layer_decay^(D−i)`, the final `norm` at `layer_decay`
    /// (timm groups it with the last block), `fc_norm` and the head at 1.
    pub fn with_layer_decay(mut self, table: &ParamTable, layer_decay: f64) -> Self {
        let depth = table.spans.blocks.len() as i32;
        for g in self.groups.iter_mut() {
            let Some(entry) = table.entries.iter().find(|e| e.span == g.span) else { continue };
            let name = entry.name.as_str();
            let power = if let Some(rest) = name.strip_prefix("blocks.") {
                let i: i32 = rest.split('.').next().and_then(|n| n.parse().ok()).unwrap_or(0);
                depth - i
            } else if name.starts_with("norm.") {
                1
            } else if name.starts_with("fc_norm.") || name.starts_with("head.") {
                0
            } else {
                depth + 1
            };
            g.lr_scale = layer_decay.powi(power) as f32;
        }
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vit_b16_has_timm_parameter_count() {
        let m = ModelConfig::preset("vit_base_patch16_224").unwrap();
        let t = ParamTable::new(&m);
        // timm: sum(p.numel() for p in vit_base_patch16_224().parameters()) == 86_567_656
        assert_eq!(t.total, 86_567_656);
        assert_eq!(t.entries.last().unwrap().span.off + t.entries.last().unwrap().span.len, t.total);
    }

    #[test]
    fn avg_pool_uses_fc_norm_and_no_cls() {
        let mut m = ModelConfig::preset("vit_tiny_patch4_32").unwrap();
        m.class_token = false;
        m.global_pool = GlobalPool::Avg;
        m.qkv_bias = false;
        let t = ParamTable::new(&m);
        assert!(t.get("fc_norm.weight").is_some());
        assert!(t.get("norm.weight").is_none());
        assert!(t.get("cls_token").is_none());
        assert!(t.get("blocks.0.attn.qkv.bias").is_none());
        assert_eq!(t.get("pos_embed").unwrap().shape, vec![1, 64, 192]);
    }
}
