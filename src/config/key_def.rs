//! The machinery every section's key table is made of: [`KeyDef`] (name, type and accepted
//! values, default, doc, support level, whether a resume may change it), the types behind it,
//! [`ConfigError`], and the resolution context that collects warnings.

use serde_json::Value;

/// Why a configuration was rejected. Every message names the file, the `--set` argument or
/// the dotted key, and what would have been accepted.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("config file {path} is neither JSON nor Hjson (DeepSpeed's grammar): {msg} (line {line}, column {column})")]
    Json { path: String, line: usize, column: usize, msg: String },
    #[error("--set {arg}: {msg}")]
    Set { arg: String, msg: String },
    #[error("{key}: {msg}")]
    Key { key: String, msg: String },
}

pub(super) type Result<T> = std::result::Result<T, ConfigError>;

pub(super) fn key_err(key: impl Into<String>, msg: impl Into<String>) -> ConfigError {
    ConfigError::Key { key: key.into(), msg: msg.into() }
}

/// The type of a key's value, and so the values it accepts.
#[derive(Clone, Copy, Debug)]
pub enum Ty {
    Bool,
    /// An integer in `[lo, hi]`.
    Int { lo: u64, hi: u64 },
    /// A number in the interval; `lo_open` / `hi_open` exclude the bound.
    Num { lo: f64, hi: f64, lo_open: bool, hi_open: bool },
    Str,
    /// One of these strings.
    Choice(&'static [&'static str]),
    /// A list of exactly `n` numbers.
    Nums(usize),
    /// A list of distinct strings, each one of these.
    StrList(&'static [&'static str]),
    /// A JSON object read by its own table.
    Section,
    /// Any JSON value (a DeepSpeed key we accept but do not interpret).
    Any,
}

impl Ty {
    /// "expected …" text for error messages.
    pub fn describe(&self) -> String {
        fn bound(x: f64) -> String {
            if x.is_infinite() { if x > 0.0 { "inf".into() } else { "-inf".into() } } else { format!("{x}") }
        }
        match self {
            Ty::Bool => "true or false".into(),
            Ty::Int { lo, hi } if *hi == u64::MAX => format!("an integer >= {lo}"),
            Ty::Int { lo, hi } => format!("an integer in [{lo}, {hi}]"),
            Ty::Num { lo, hi, lo_open, hi_open } => format!(
                "a number in {}{}, {}{}",
                if *lo_open { "(" } else { "[" },
                bound(*lo),
                bound(*hi),
                if *hi_open { ")" } else { "]" }
            ),
            Ty::Str => "a string".into(),
            Ty::Choice(c) => format!("one of {}", quoted(c)),
            Ty::Nums(n) => format!("a list of {n} numbers"),
            Ty::StrList(c) => format!("a list of distinct strings from {}", quoted(c)),
            Ty::Section => "an object".into(),
            Ty::Any => "any value".into(),
        }
    }
}

/// A key's default, typed, so the value applied is the value documented.
#[derive(Clone, Copy, Debug)]
pub enum Dflt {
    Bool(bool),
    Int(u64),
    Num(f64),
    Str(&'static str),
    Nums(&'static [f64]),
    StrList(&'static [&'static str]),
    /// Computed from other keys; the text says how.
    Derived(&'static str),
    /// Must be given.
    Required,
    /// Absent means off / not used.
    Unset,
}

impl Dflt {
    pub(super) fn describe(&self) -> String {
        match self {
            Dflt::Bool(b) => b.to_string(),
            Dflt::Int(i) => i.to_string(),
            Dflt::Num(x) => format!("{x}"),
            Dflt::Str(s) => format!("\"{s}\""),
            Dflt::Nums(v) => format!("{v:?}"),
            Dflt::StrList(v) => format!("[{}]", quoted(v)),
            Dflt::Derived(d) => (*d).to_string(),
            Dflt::Required => "required".into(),
            Dflt::Unset => "unset".into(),
        }
    }
}

/// How far vitscale implements a key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Support {
    /// Read and honoured.
    Yes,
    /// A DeepSpeed feature we do not implement: accepted, and a warning is recorded whenever
    /// the value asks for the feature (differs from the default / block not disabled).
    Warn,
    /// Accepted, and has no effect in vitscale for the reason in the doc (no warning).
    NoEffect,
}

/// One configuration key: the single place its name, type, default and doc live.
#[derive(Clone, Copy, Debug)]
pub struct KeyDef {
    pub name: &'static str,
    pub ty: Ty,
    pub default: Dflt,
    pub doc: &'static str,
    pub support: Support,
    /// A resumed run may give this key another value than its checkpoint (the run's length,
    /// how often it logs, evaluates and checkpoints, how the same global batch is split and
    /// scheduled); every other key shapes the trajectory and must match (`resume_differences`).
    pub resume_free: bool,
}

impl KeyDef {
    /// The same key, marked free to change on resume.
    pub(super) const fn resume_free(self) -> KeyDef {
        KeyDef { resume_free: true, ..self }
    }

    /// The same key with another support level.
    pub(super) const fn support(self, support: Support) -> KeyDef {
        KeyDef { support, ..self }
    }
}

/// A key vitscale reads and honours.
pub(super) const fn key(name: &'static str, ty: Ty, default: Dflt, doc: &'static str) -> KeyDef {
    KeyDef { name, ty, default, doc, support: Support::Yes, resume_free: false }
}
/// A DeepSpeed key whose feature is not implemented: accepted, warned about when it asks for it.
pub(super) const fn ds_warn(name: &'static str, default: Dflt, doc: &'static str) -> KeyDef {
    KeyDef { name, ty: Ty::Any, default, doc, support: Support::Warn, resume_free: false }
}
/// A DeepSpeed key that has no effect in vitscale (the doc says why).
pub(super) const fn ds_noop(name: &'static str, doc: &'static str) -> KeyDef {
    KeyDef { name, ty: Ty::Any, default: Dflt::Unset, doc, support: Support::NoEffect, resume_free: false }
}

pub(super) const POS_INT: Ty = Ty::Int { lo: 1, hi: u64::MAX };
pub(super) const NONNEG_INT: Ty = Ty::Int { lo: 0, hi: u64::MAX };
pub(super) const NONNEG: Ty = Ty::Num { lo: 0.0, hi: f64::INFINITY, lo_open: false, hi_open: true };
pub(super) const POSITIVE: Ty = Ty::Num { lo: 0.0, hi: f64::INFINITY, lo_open: true, hi_open: true };
pub(super) const UNIT_HALF_OPEN: Ty = Ty::Num { lo: 0.0, hi: 1.0, lo_open: false, hi_open: true };
pub(super) const UNIT: Ty = Ty::Num { lo: 0.0, hi: 1.0, lo_open: false, hi_open: false };
/// Resolution context: collects warnings.
#[derive(Default)]
pub(super) struct Cx {
    pub(super) warnings: Vec<String>,
}

impl Cx {
    pub(super) fn warn(&mut self, w: String) {
        self.warnings.push(w);
    }
}

/// `path.name`, or `name` at the top level.
pub(super) fn full(path: &str, name: &str) -> String {
    if path.is_empty() { name.to_string() } else { format!("{path}.{name}") }
}

/// `"a", "b", "c"`.
pub(super) fn quoted(c: &[&str]) -> String {
    c.iter().map(|s| format!("\"{s}\"")).collect::<Vec<_>>().join(", ")
}

/// A value as an error message shows what was given.
pub(super) fn kind_of(v: &Value) -> String {
    match v {
        Value::Null => "null".into(),
        Value::Bool(b) => b.to_string(),
        Value::Number(n) => n.to_string(),
        Value::String(s) => format!("\"{s}\""),
        Value::Array(_) => "a list".into(),
        Value::Object(_) => "an object".into(),
    }
}

/// `"auto"`, as Hugging Face writes a value it leaves to the engine.
pub(super) fn is_auto(v: &Value) -> bool {
    v.as_str() == Some("auto")
}
