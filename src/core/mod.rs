//! The shared vocabulary below `backend`, `model` and `config`: spans into flat buffers,
//! optimizer hyper-parameters, decay groups, parameter kinds and numerical constants.
//!
//! It names nothing else in the crate, so each of those layers can use these types without
//! depending on another: a backend's optimizer step takes the optimizer's configuration and
//! the decay groups, the model builds the groups from its parameter table, and the config parser
//! fills in the same types from the user's file.

pub mod encoded;

use serde::Serialize;

/// A window of a flat buffer, in elements.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Span {
    pub off: usize,
    pub len: usize,
}

impl Span {
    pub fn range(self) -> std::ops::Range<usize> {
        self.off..self.off + self.len
    }
}

/// A transfer into a device buffer that is still in flight (a collective writing the weights
/// the forward will read). `order` makes every later operation on the device's compute queue
/// wait for it, without the host waiting; an error says why the queue could not be ordered.
pub trait Fence: Send + Sync {
    fn order(&self) -> Result<(), String>;
}

/// LayerNorm epsilon used by timm's ViT (`partial(nn.LayerNorm, eps=1e-6)`).
pub const LN_EPS: f32 = 1e-6;

/// `optimizer.type` with DeepSpeed's meaning and defaults.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "type")]
pub enum OptimizerConfig {
    /// `Adam` / `AdamW` (DeepSpeed FusedAdam): `adam_w_mode` true = decoupled weight decay
    /// (AdamW), false = L2 penalty added to the gradient (classic Adam).
    Adam {
        lr: f64,
        beta1: f64,
        beta2: f64,
        eps: f64,
        weight_decay: f64,
        adam_w_mode: bool,
        bias_correction: bool,
    },
    /// `SGD` (torch.optim.SGD semantics).
    Sgd {
        lr: f64,
        momentum: f64,
        dampening: f64,
        weight_decay: f64,
        nesterov: bool,
    },
}

impl OptimizerConfig {
    /// The learning rate the optimizer was configured with (the base that schedules scale).
    pub fn lr(&self) -> f64 {
        match self {
            OptimizerConfig::Adam { lr, .. } | OptimizerConfig::Sgd { lr, .. } => *lr,
        }
    }
}

/// Elements of f32 optimizer state per parameter, in this order in the state buffer:
/// Adam: m then v (2·P); SGD: the momentum buffer (P).
pub fn optimizer_state_len(opt: &OptimizerConfig, num_params: usize) -> usize {
    match opt {
        OptimizerConfig::Adam { .. } => 2 * num_params,
        OptimizerConfig::Sgd { .. } => num_params,
    }
}

/// Hyper-parameters of one optimizer step, as the engine resolved them for this step.
#[derive(Clone, Copy, Debug)]
pub struct StepHyper {
    /// Learning rate for this step (after the schedule).
    pub lr: f32,
    /// 1-based optimizer step (Adam bias correction).
    pub step: u64,
    /// Multiplies every gradient before use (1/loss-scale, a clipping factor found by the caller).
    pub grad_scale: f32,
    /// When > 0, clips by the global norm inside the step: the gradients (after `grad_scale`)
    /// are further multiplied by min(1, clip_norm / (‖g‖ + 1e-6)), ‖g‖ their L2 norm over the
    /// whole buffer — torch's `clip_grad_norm_`, DeepSpeed's `gradient_clipping`. The backend
    /// computes the norm itself (the CUDA one on the device, so the step never waits for the
    /// host). 0: no clipping beyond `grad_scale`. f64 like the configuration's
    /// `gradient_clipping`, so the CPU's factor is computed from the configured value itself.
    pub clip_norm: f64,
}

impl StepHyper {
    /// `grad_scale` times the clipping factor of `clip_norm` for gradients whose raw L2 norm
    /// is `raw_norm` (f64, as the host computes it).
    pub fn effective_grad_scale(&self, raw_norm: f64) -> f32 {
        let gs = self.grad_scale as f64;
        if self.clip_norm <= 0.0 {
            return self.grad_scale;
        }
        let coef = self.clip_norm / (raw_norm * gs.abs() + 1e-6);
        (gs * coef.min(1.0)) as f32
    }
}

/// `train.weight_decay_skip`: kinds of parameters that get no weight decay.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct DecaySkip {
    pub bias: bool,
    pub norm: bool,
    pub pos_embed: bool,
    pub cls_token: bool,
}

/// What a parameter is, for weight-decay grouping and initialization.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ParamKind {
    /// A matrix of a dense layer (or the patch-embedding convolution).
    Weight,
    Bias,
    NormWeight,
    NormBias,
    PosEmbed,
    ClsToken,
}

impl ParamKind {
    /// Whether `train.weight_decay_skip` exempts this kind from weight decay.
    pub fn skips_decay(self, skip: &DecaySkip) -> bool {
        match self {
            ParamKind::Weight => false,
            ParamKind::Bias => skip.bias,
            ParamKind::NormWeight | ParamKind::NormBias => skip.norm,
            ParamKind::PosEmbed => skip.pos_embed,
            ParamKind::ClsToken => skip.cls_token,
        }
    }
}

/// One optimizer parameter group (torch's `param_groups` entry, reduced to what differs
/// between ViT parameters): a span of the flat buffer, whether weight decay applies to it, and
/// the factor on the step's learning rate (timm's `lr_scale`: 1 unless layer-wise learning-rate
/// decay gives the group another).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ParamGroup {
    pub span: Span,
    pub decays: bool,
    pub lr_scale: f32,
}

/// The optimizer's parameter groups: what weight decay and learning-rate factor each span of
/// the flat buffer gets. Elements outside every span are updated without decay at factor 1.
#[derive(Clone, Debug)]
pub struct ParamGroups {
    /// One group per named parameter, in table order.
    pub groups: Vec<ParamGroup>,
}

impl ParamGroups {
    /// Groups of these (span, decays) pairs at learning-rate factor 1, kept in the order given.
    pub fn from_spans(spans: impl IntoIterator<Item = (Span, bool)>) -> Self {
        ParamGroups { groups: spans.into_iter().map(|(span, decays)| ParamGroup { span, decays, lr_scale: 1.0 }).collect() }
    }

    /// The groups within `piece`, in the piece's own coordinates (offset 0 = `piece.off`):
    /// what an optimizer step over that piece alone needs (ZeRO shards).
    pub fn restrict(&self, piece: Span) -> ParamGroups {
        let end = piece.off + piece.len;
        let groups = self.groups.iter().filter_map(|g| {
            let (lo, hi) = (g.span.off.max(piece.off), (g.span.off + g.span.len).min(end));
            (lo < hi).then_some(ParamGroup { span: Span { off: lo - piece.off, len: hi - lo }, ..*g })
        });
        ParamGroups { groups: groups.collect() }
    }

    /// The groups of parameters of these kinds under the `train.weight_decay_skip` setting:
    /// a span decays unless its kind is skipped.
    pub fn from_kinds(params: impl IntoIterator<Item = (Span, ParamKind)>, skip: &DecaySkip) -> Self {
        Self::from_spans(params.into_iter().map(|(span, kind)| (span, !kind.skips_decay(skip))))
    }

    /// Whether any group's learning rate differs from the step's.
    pub fn scales_lr(&self) -> bool {
        self.groups.iter().any(|g| g.lr_scale != 1.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decay_groups_follow_the_skip_setting_in_order() {
        let s = |off, len| Span { off, len };
        let params = [(s(0, 4), ParamKind::Weight), (s(4, 2), ParamKind::Bias), (s(6, 2), ParamKind::NormWeight), (s(8, 3), ParamKind::PosEmbed)];
        let skip = DecaySkip { bias: true, norm: false, pos_embed: true, cls_token: true };
        let g = ParamGroups::from_kinds(params, &skip);
        let pairs: Vec<_> = g.groups.iter().map(|g| (g.span, g.decays, g.lr_scale)).collect();
        assert_eq!(pairs, vec![(s(0, 4), true, 1.0), (s(4, 2), false, 1.0), (s(6, 2), true, 1.0), (s(8, 3), false, 1.0)]);
    }

    #[test]
    fn restricting_keeps_the_overlaps_in_piece_coordinates() {
        let s = |off, len| Span { off, len };
        let mut g = ParamGroups::from_spans([(s(0, 4), true), (s(4, 2), false), (s(6, 5), true)]);
        g.groups[1].lr_scale = 0.5;
        let pairs = |g: ParamGroups| g.groups.iter().map(|g| (g.span, g.decays, g.lr_scale)).collect::<Vec<_>>();
        assert_eq!(pairs(g.restrict(s(3, 5))), vec![(s(0, 1), true, 1.0), (s(1, 2), false, 0.5), (s(3, 2), true, 1.0)]);
        assert_eq!(pairs(g.restrict(s(11, 3))), vec![]);
        assert_eq!(g.restrict(s(0, 11)).groups, g.groups);
    }

    #[test]
    fn state_len_per_optimizer() {
        let adam = OptimizerConfig::Adam { lr: 1e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0, adam_w_mode: true, bias_correction: true };
        let sgd = OptimizerConfig::Sgd { lr: 0.1, momentum: 0.9, dampening: 0.0, weight_decay: 0.0, nesterov: false };
        assert_eq!(optimizer_state_len(&adam, 10), 20);
        assert_eq!(optimizer_state_len(&sgd, 10), 10);
        assert_eq!(adam.lr(), 1e-3);
    }
}
