//! Keys by name for code outside this module that builds or reads a configuration key by key
//! (the lab's sweep grids and reports, `vitscale bench`): each [`KeyPath`] is taken from the
//! key's definition, so a key is spelled in one place only, and [`ConfigBuilder`] makes a
//! configuration JSON from them.

use std::fmt;

use serde_json::{Map, Value};

use super::key_def::KeyDef;
use super::{data, model, top_level, train, zero};

/// Where a key sits: at the top level, or in one section.
#[derive(Clone, Copy, Debug)]
pub struct KeyPath {
    section: Option<&'static KeyDef>,
    key: &'static KeyDef,
}

impl KeyPath {
    const fn top(key: &'static KeyDef) -> KeyPath {
        KeyPath { section: None, key }
    }

    const fn within(section: &'static KeyDef, key: &'static KeyDef) -> KeyPath {
        KeyPath { section: Some(section), key }
    }

    /// The key's own name, the last part of its dotted path (`stage`).
    pub fn name(&self) -> &'static str {
        self.key.name
    }

    /// The dotted path `--set` and sweep grids use (`zero_optimization.stage`).
    pub fn dotted(&self) -> String {
        match self.section {
            None => self.key.name.to_string(),
            Some(s) => format!("{}.{}", s.name, self.key.name),
        }
    }

    /// Whether `dotted` is this key's dotted path.
    pub fn is(&self, dotted: &str) -> bool {
        match self.section {
            None => dotted == self.key.name,
            Some(s) => dotted.strip_prefix(s.name).and_then(|rest| rest.strip_prefix('.')) == Some(self.key.name),
        }
    }
}

impl fmt::Display for KeyPath {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str(&self.dotted())
    }
}

// The keys named outside this module; add one here when other code needs to name a key.
pub const TRAIN_BATCH_SIZE: KeyPath = KeyPath::top(&top_level::TRAIN_BATCH_SIZE);
pub const MICRO_BATCH: KeyPath = KeyPath::top(&top_level::MICRO_BATCH);
pub const GAS: KeyPath = KeyPath::top(&top_level::GAS);
pub const ZERO_STAGE: KeyPath = KeyPath::within(&zero::ZERO_OPTIMIZATION, &zero::ZERO_STAGE);
pub const MODEL_PRESET: KeyPath = KeyPath::within(&model::MODEL, &model::M_PRESET);
pub const DATA_TRAIN_SIZE: KeyPath = KeyPath::within(&data::DATA, &data::D_TRAIN_SIZE);
pub const DATA_VAL_SIZE: KeyPath = KeyPath::within(&data::DATA, &data::D_VAL_SIZE);
pub const TRAIN_STEPS: KeyPath = KeyPath::within(&train::TRAIN, &train::T_STEPS);
pub const TRAIN_LOG_EVERY: KeyPath = KeyPath::within(&train::TRAIN, &train::T_LOG_EVERY);
pub const TRAIN_PASS_IMAGES: KeyPath = KeyPath::within(&train::TRAIN, &train::T_PASS_IMAGES);
pub const TRAIN_EVAL_BATCH_SIZE: KeyPath = KeyPath::within(&train::TRAIN, &train::T_EVAL_BATCH);
pub const TRAIN_EMULATE_SLOWDOWN: KeyPath = KeyPath::within(&train::TRAIN, &train::T_SLOWDOWN);
pub const TRAIN_BALANCE: KeyPath = KeyPath::within(&train::TRAIN, &train::T_BALANCE);

/// A configuration JSON made key by key, for code that builds a configuration rather than
/// reading one; [`resolve`](super::resolve) validates the result like any other.
#[derive(Clone, Debug, Default)]
pub struct ConfigBuilder {
    root: Map<String, Value>,
}

impl ConfigBuilder {
    pub fn new() -> ConfigBuilder {
        ConfigBuilder::default()
    }

    /// Sets `key` to `value`, making its section when it is the section's first key.
    pub fn set(mut self, key: KeyPath, value: impl Into<Value>) -> ConfigBuilder {
        let value = value.into();
        match key.section {
            None => {
                self.root.insert(key.key.name.to_string(), value);
            }
            Some(section) => {
                // A section's entry is only ever made here, as an object.
                if let Value::Object(block) = self.root.entry(section.name).or_insert_with(|| Value::Object(Map::new())) {
                    block.insert(key.key.name.to_string(), value);
                }
            }
        }
        self
    }

    /// The configuration JSON.
    pub fn build(self) -> Value {
        Value::Object(self.root)
    }
}
