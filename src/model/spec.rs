//! The shape of a ViT: the `model` section of a run config, the timm-named presets, and the
//! FLOP count per image derived from it.
//!
//! Glossary used in shape comments across the crate:
//! B batch, N tokens (= patches + prefix tokens), NP patches, C width (embed_dim), H heads,
//! D head dim (C / H), F MLP hidden width, P patch size, K classes.

use serde::{Deserialize, Serialize};

pub use crate::core::LN_EPS;

/// How the image representation fed to the head is pooled from the token sequence (timm's
/// `global_pool`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum GlobalPool {
    /// Final LayerNorm (`norm`) on every token, then the class token.
    Token,
    /// Mean of the patch tokens (prefix tokens excluded), then LayerNorm (`fc_norm`), as timm
    /// does when `global_pool='avg'`.
    Avg,
}

impl GlobalPool {
    pub fn as_str(self) -> &'static str {
        match self {
            GlobalPool::Token => "token",
            GlobalPool::Avg => "avg",
        }
    }
}

/// A fully specified ViT architecture (timm `VisionTransformer` arguments of the same names).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    pub image_size: usize,
    pub patch_size: usize,
    pub in_chans: usize,
    pub embed_dim: usize,
    pub depth: usize,
    pub num_heads: usize,
    pub mlp_ratio: f64,
    pub num_classes: usize,
    pub qkv_bias: bool,
    pub class_token: bool,
    pub global_pool: GlobalPool,
}

/// The preset used when a run names none: sized so that `vitscale train` with no arguments
/// reaches high accuracy on the built-in dataset in well under two minutes on two cores.
pub const DEFAULT_PRESET: &str = "vit_builtin_default";

/// Names of every preset, for help text and error messages.
pub const PRESET_NAMES: &[&str] = &[
    "vit_tiny_patch16_224",
    "vit_small_patch16_224",
    "vit_base_patch16_224",
    "vit_large_patch16_224",
    "vit_huge_patch14_224",
    "vit_giant_patch14_224",
    "vit_base_patch16_384",
    "vit_large_patch16_384",
    "vit_tiny_patch4_32",
    "vit_small_patch4_32",
    "vit_base_patch4_32",
    DEFAULT_PRESET,
];

impl ModelConfig {
    /// A preset by its timm name; `None` for an unknown name.
    pub fn preset(name: &str) -> Option<ModelConfig> {
        // timm's shapes: (image, patch, width, depth, heads, MLP ratio, classes)
        let (image_size, patch_size, embed_dim, depth, num_heads, mlp_ratio, num_classes) = match name {
            "vit_tiny_patch16_224" => (224, 16, 192, 12, 3, 4.0, 1000),
            "vit_small_patch16_224" => (224, 16, 384, 12, 6, 4.0, 1000),
            "vit_base_patch16_224" => (224, 16, 768, 12, 12, 4.0, 1000),
            "vit_large_patch16_224" => (224, 16, 1024, 24, 16, 4.0, 1000),
            // head dim 80: the CUDA backend's attention takes its GEMM path (no fused kernel)
            "vit_huge_patch14_224" => (224, 14, 1280, 32, 16, 4.0, 1000),
            // timm's ratio 48/11: int(1408 · 48/11) = 6144; head dim 88, also the GEMM path
            "vit_giant_patch14_224" => (224, 14, 1408, 40, 16, 48.0 / 11.0, 1000),
            "vit_base_patch16_384" => (384, 16, 768, 12, 12, 4.0, 1000),
            "vit_large_patch16_384" => (384, 16, 1024, 24, 16, 4.0, 1000),
            "vit_tiny_patch4_32" => (32, 4, 192, 12, 3, 4.0, 10),
            "vit_small_patch4_32" => (32, 4, 384, 12, 6, 4.0, 10),
            "vit_base_patch4_32" => (32, 4, 768, 12, 12, 4.0, 10),
            DEFAULT_PRESET => (16, 4, 64, 3, 4, 4.0, 10),
            _ => return None,
        };
        Some(ModelConfig {
            image_size,
            patch_size,
            in_chans: 3,
            embed_dim,
            depth,
            num_heads,
            mlp_ratio,
            num_classes,
            qkv_bias: true,
            class_token: true,
            global_pool: GlobalPool::Token,
        })
    }

    /// Patches per side.
    pub fn grid(&self) -> usize {
        self.image_size / self.patch_size
    }
    /// NP: patches per image.
    pub fn num_patches(&self) -> usize {
        self.grid() * self.grid()
    }
    /// Tokens before the patches (the class token, if any).
    pub fn num_prefix_tokens(&self) -> usize {
        usize::from(self.class_token)
    }
    /// N: tokens per image.
    pub fn num_tokens(&self) -> usize {
        self.num_patches() + self.num_prefix_tokens()
    }
    /// D: width of one attention head.
    pub fn head_dim(&self) -> usize {
        self.embed_dim / self.num_heads
    }
    /// F: MLP hidden width, as timm computes it (`int(dim * mlp_ratio)`).
    pub fn mlp_hidden(&self) -> usize {
        (self.embed_dim as f64 * self.mlp_ratio) as usize
    }
    /// Length of one flattened patch (3·P·P).
    pub fn patch_dim(&self) -> usize {
        self.in_chans * self.patch_size * self.patch_size
    }

    /// Checks the shape is buildable; the error names the offending `model.*` key.
    pub fn validate(&self) -> Result<(), String> {
        let positive = [
            ("model.image_size", self.image_size),
            ("model.patch_size", self.patch_size),
            ("model.embed_dim", self.embed_dim),
            ("model.depth", self.depth),
            ("model.num_heads", self.num_heads),
            ("model.in_chans", self.in_chans),
        ];
        for (key, v) in positive {
            if v == 0 {
                return Err(format!("{key} must be a positive integer, got 0"));
            }
        }
        if !self.image_size.is_multiple_of(self.patch_size) {
            return Err(format!(
                "model.patch_size ({}) must divide model.image_size ({})",
                self.patch_size, self.image_size
            ));
        }
        if !self.embed_dim.is_multiple_of(self.num_heads) {
            return Err(format!(
                "model.num_heads ({}) must divide model.embed_dim ({})",
                self.num_heads, self.embed_dim
            ));
        }
        if !(self.mlp_ratio.is_finite() && self.mlp_ratio > 0.0) || self.mlp_hidden() == 0 {
            return Err(format!("model.mlp_ratio must be a positive number, got {}", self.mlp_ratio));
        }
        if self.global_pool == GlobalPool::Token && !self.class_token {
            return Err("model.global_pool=\"token\" needs model.class_token=true (use \"avg\" without a class token)".into());
        }
        if self.num_classes == 0 {
            return Err("model.num_classes must be at least 1 (a classifier head is required for training)".into());
        }
        Ok(())
    }

    /// Forward FLOPs for one image (multiply-add = 2 FLOPs), counting every matrix product:
    /// patch embedding, per block qkv / attention scores / attention-weighted values / proj /
    /// fc1 / fc2, and the head. Elementwise work (LayerNorm, GELU, softmax) is left out, as in
    /// the usual MFU accounting. For ViT-B/16 at 224 px this gives 35.1 GFLOP.
    pub fn forward_flops_per_image(&self) -> f64 {
        let np = self.num_patches() as f64;
        let c = self.embed_dim as f64;
        let k = self.num_classes as f64;
        let patch = 2.0 * np * self.patch_dim() as f64 * c;
        patch + self.depth as f64 * self.block_flops(self.num_tokens()) + 2.0 * c * k
    }

    /// Forward FLOPs of one block for one image whose queries, projection and MLP cover `rows`
    /// tokens (keys and values always cover all N).
    fn block_flops(&self, rows: usize) -> f64 {
        let (n, r) = (self.num_tokens() as f64, rows as f64);
        let c = self.embed_dim as f64;
        let f = self.mlp_hidden() as f64;
        2.0 * r * c * c + 2.0 * n * c * 2.0 * c // q, then k and v
            + 2.0 * r * n * c // q·kᵀ over all heads
            + 2.0 * r * n * c // probs·v
            + 2.0 * r * c * c // proj
            + 2.0 * r * c * f * 2.0 // fc1 + fc2
    }

    /// `forward_flops_per_image` as the model executes it with the class token tail
    /// (`Vit::set_class_token_tail`, on by default under token pooling): the last block's
    /// queries, projection and MLP cover the class token alone. MFU counts the full model's
    /// FLOPs, as for the peers; this is what the hardware is given.
    pub fn executed_forward_flops_per_image(&self, class_token_tail: bool) -> f64 {
        let full = self.forward_flops_per_image();
        if !class_token_tail || self.global_pool != GlobalPool::Token || self.depth == 0 {
            return full;
        }
        full - self.block_flops(self.num_tokens()) + self.block_flops(1)
    }

    /// Training FLOPs for one image: forward + backward, the backward costing twice the
    /// forward (gradients with respect to inputs and to weights).
    pub fn train_flops_per_image(&self) -> f64 {
        3.0 * self.forward_flops_per_image()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vit_b16_flops_match_the_published_count() {
        let m = ModelConfig::preset("vit_base_patch16_224").unwrap();
        let g = m.forward_flops_per_image() / 1e9;
        assert!((g - 35.1).abs() < 0.2, "ViT-B/16 forward GFLOP = {g}");
        assert_eq!(m.num_tokens(), 197);
    }

    #[test]
    fn class_token_tail_flops() {
        let m = ModelConfig::preset("vit_base_patch16_224").unwrap();
        let full = m.forward_flops_per_image();
        assert_eq!(m.executed_forward_flops_per_image(false), full);
        // the last block keeps its keys and values (2 of its 12 C² units per token) and the
        // class token's row: ≈ 10/12 of one block of twelve fewer
        let share = m.executed_forward_flops_per_image(true) / full;
        assert!((0.92..0.95).contains(&share), "executed share {share}");
        let avg = ModelConfig { global_pool: GlobalPool::Avg, class_token: false, ..m };
        assert_eq!(avg.executed_forward_flops_per_image(true), avg.forward_flops_per_image());
    }

    #[test]
    fn cifar_presets_have_65_tokens() {
        for name in ["vit_tiny_patch4_32", "vit_small_patch4_32", "vit_base_patch4_32"] {
            let m = ModelConfig::preset(name).unwrap();
            assert_eq!(m.num_tokens(), 65, "{name}");
            m.validate().unwrap();
        }
        let s = ModelConfig::preset("vit_small_patch4_32").unwrap();
        let g = s.train_flops_per_image() / 1e9;
        assert!((g - 8.5).abs() < 0.3, "ViT-S/4 train GFLOP = {g}");
    }

    /// timm's shapes for the large presets: MLP width, head dim, tokens, and the parameter
    /// count timm 1.0.31 reports (`sum(p.numel())` of `timm.create_model(name, num_classes=1000)`).
    #[test]
    fn large_presets_have_timms_shapes() {
        for (name, hidden, head_dim, tokens, params) in [
            ("vit_huge_patch14_224", 5120, 80, 257, 632_045_800),
            ("vit_giant_patch14_224", 6144, 88, 257, 1_012_611_432),
            ("vit_base_patch16_384", 3072, 64, 577, 86_859_496),
            ("vit_large_patch16_384", 4096, 64, 577, 304_715_752),
        ] {
            let m = ModelConfig::preset(name).unwrap();
            m.validate().unwrap();
            assert!(PRESET_NAMES.contains(&name), "{name} is not listed");
            assert_eq!((m.mlp_hidden(), m.head_dim(), m.num_tokens()), (hidden, head_dim, tokens), "{name}");
            assert_eq!(crate::model::ParamTable::new(&m).total, params, "{name}");
        }
    }

    /// Any image size the patch divides is a valid model; another names both keys.
    #[test]
    fn image_sizes_the_patch_divides_are_valid() {
        let base = ModelConfig::preset("vit_huge_patch14_224").unwrap();
        for image_size in [14, 28, 196, 238, 336, 392, 518] {
            let m = ModelConfig { image_size, ..base.clone() };
            m.validate().unwrap_or_else(|e| panic!("{image_size}: {e}"));
            assert_eq!(m.grid() * 14, image_size);
        }
        for image_size in [7, 15, 200, 384] {
            let err = ModelConfig { image_size, ..base.clone() }.validate().unwrap_err();
            assert!(err.contains("model.image_size") && err.contains("model.patch_size"), "{image_size}: {err}");
        }
    }

    #[test]
    fn invalid_shapes_name_their_key() {
        let mut m = ModelConfig::preset("vit_tiny_patch16_224").unwrap();
        m.num_heads = 5;
        assert!(m.validate().unwrap_err().contains("model.num_heads"));
        let mut m = ModelConfig::preset("vit_tiny_patch16_224").unwrap();
        m.patch_size = 15;
        assert!(m.validate().unwrap_err().contains("model.patch_size"));
        let mut m = ModelConfig::preset("vit_tiny_patch16_224").unwrap();
        m.class_token = false;
        assert!(m.validate().unwrap_err().contains("global_pool"));
    }
}
