//! The key reference: every key table with the place its keys sit in the JSON, and the help
//! text generated from them (`docs/config.md` is this text; tests/docs.rs keeps it current).
//! The resume check reads the tables' resume flags through the same list.

use super::key_def::{KeyDef, Support, Ty};
use super::{data, model, monitor, optimizer, precision, scheduler, top_level, train, zero};

/// One key table and where its keys sit.
pub(super) struct Table {
    /// The section keys leading to the table's keys, one path per block the table reads (the
    /// monitors' table serves two); an empty path is the top level.
    pub(super) at: &'static [&'static [&'static KeyDef]],
    /// The variant of the section the keys belong to, where the keys depend on its type.
    variant: Option<&'static str>,
    pub(super) keys: &'static [KeyDef],
}

impl Table {
    /// `[optimizer.params (SGD)]`-style heading.
    fn title(&self) -> String {
        let paths: Vec<String> = self.at.iter().map(|path| dotted(path)).collect();
        let place = if paths.iter().all(String::is_empty) { "top level".to_string() } else { paths.join(", ") };
        match self.variant {
            Some(v) => format!("{place} ({v})"),
            None => place,
        }
    }
}

/// `section.sub` of a path of section keys.
pub(super) fn dotted(path: &[&KeyDef]) -> String {
    path.iter().map(|d| d.name).collect::<Vec<_>>().join(".")
}

/// Every table, in the reference's order.
pub(super) const TABLES: &[Table] = &[
    Table { at: &[&[]], variant: None, keys: top_level::TOP_KEYS },
    Table { at: &[&[&optimizer::OPTIMIZER]], variant: None, keys: optimizer::OPT_BLOCK_KEYS },
    Table { at: &[&[&optimizer::OPTIMIZER, &optimizer::OPT_PARAMS]], variant: Some("Adam, AdamW"), keys: optimizer::ADAM_KEYS },
    Table { at: &[&[&optimizer::OPTIMIZER, &optimizer::OPT_PARAMS]], variant: Some("SGD"), keys: optimizer::SGD_KEYS },
    Table { at: &[&[&scheduler::SCHEDULER]], variant: None, keys: scheduler::SCHED_BLOCK_KEYS },
    Table { at: &[&[&scheduler::SCHEDULER, &scheduler::SCHED_PARAMS]], variant: Some("WarmupLR"), keys: scheduler::WARMUP_LR_KEYS },
    Table { at: &[&[&scheduler::SCHEDULER, &scheduler::SCHED_PARAMS]], variant: Some("WarmupDecayLR"), keys: scheduler::WARMUP_DECAY_KEYS },
    Table { at: &[&[&scheduler::SCHEDULER, &scheduler::SCHED_PARAMS]], variant: Some("WarmupCosineLR"), keys: scheduler::WARMUP_COSINE_KEYS },
    Table { at: &[&[&precision::FP16]], variant: None, keys: precision::FP16_KEYS },
    // `bfloat16`, bf16's older spelling, has its own line at the top level.
    Table { at: &[&[&precision::BF16]], variant: None, keys: precision::BF16_KEYS },
    Table { at: &[&[&zero::ZERO_OPTIMIZATION]], variant: None, keys: zero::ZERO_KEYS },
    Table { at: &[&[&model::MODEL]], variant: None, keys: model::MODEL_KEYS },
    Table { at: &[&[&data::DATA]], variant: None, keys: data::DATA_KEYS },
    Table { at: &[&[&train::TRAIN]], variant: None, keys: train::TRAIN_KEYS },
    Table { at: &[&[&train::TRAIN, &train::T_EMA]], variant: None, keys: train::EMA_KEYS },
    Table { at: &[&[&train::ACTIVATION_CHECKPOINTING]], variant: None, keys: train::ACTIVATION_CHECKPOINTING_KEYS },
    Table { at: &[&[&monitor::TENSORBOARD], &[&monitor::CSV_MONITOR]], variant: None, keys: monitor::MONITOR_KEYS },
];

/// Help text for every key, generated from the tables.
pub fn help_text() -> String {
    let mut out = String::new();
    for table in TABLES {
        out.push_str(&format!("[{}]\n", table.title()));
        for d in table.keys {
            let support = match d.support {
                Support::Yes => "",
                Support::Warn => " (accepted, not implemented: warns)",
                Support::NoEffect => " (accepted, no effect)",
            };
            out.push_str(&format!("  {:<32} {}{}\n", d.name, d.doc, support));
            if !matches!(d.ty, Ty::Section | Ty::Any) {
                out.push_str(&format!("  {:<32} {}; default {}\n", "", d.ty.describe(), d.default.describe()));
            }
        }
    }
    let tuning: Vec<&str> = zero::ZERO_TUNING.iter().copied().filter(|k| !zero::ZERO_KEYS.iter().any(|d| d.name == *k)).collect();
    out.push_str(&format!("[{}] also accepts (not implemented: warns): {}\n", zero::ZERO_OPTIMIZATION.name, tuning.join(", ")));
    out
}
