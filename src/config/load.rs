//! From a file and `--set key.path=JSON` arguments to one JSON value, before any key is
//! interpreted. A config file is read with DeepSpeed's grammar: JSON, or where that fails,
//! Hjson (DeepSpeed loads its config with `hjson`: comments, trailing commas, unquoted keys and
//! strings). Either way a key given twice in one object is an error naming it, as DeepSpeed
//! refuses duplicate keys, rather than the last one silently winning. The overrides are then
//! applied in order.

use std::path::Path;

use serde_json::{Map, Value};

use super::key_def::{full, kind_of, ConfigError, Result};

/// Parses JSON text into a `Value`, refusing an object that names a key twice (serde_json
/// alone keeps the last one): the error names the dotted key.
pub fn parse_json_strict(text: &str) -> std::result::Result<Value, serde_json::Error> {
    use serde::de::DeserializeSeed;
    let mut de = serde_json::Deserializer::from_str(text);
    let v = StrictValue { path: String::new() }.deserialize(&mut de)?;
    de.end()?;
    Ok(v)
}

/// Parses a config file's text as DeepSpeed reads it: JSON, else Hjson. When the text is
/// neither, the error gives JSON's position and message and then Hjson's; a duplicate key is
/// named as such.
pub fn parse_config_text(text: &str) -> std::result::Result<Value, ConfigTextError> {
    let json_err = match parse_json_strict(text) {
        Ok(v) => return Ok(v),
        Err(e) => e,
    };
    match deser_hjson::from_str::<Strict>(text) {
        Ok(Strict(v)) => Ok(v),
        Err(deser_hjson::Error::Serde { line, col, message, .. }) if message.starts_with("duplicate key") => Err(ConfigTextError { line, column: col, msg: message }),
        Err(hjson_err) => Err(ConfigTextError {
            line: json_err.line(),
            column: json_err.column(),
            // serde_json appends the position, which the error prints once itself.
            msg: format!(
                "{}; read as Hjson: {hjson_err}",
                json_err.to_string().trim_end_matches(&format!(" at line {} column {}", json_err.line(), json_err.column()))
            ),
        }),
    }
}

/// Why a config file's text is neither JSON nor Hjson, and where.
#[derive(Debug)]
pub struct ConfigTextError {
    pub line: usize,
    pub column: usize,
    pub msg: String,
}

/// A `Value` read through `StrictValue`, for deserializers that take a type rather than a seed.
struct Strict(Value);

impl<'de> serde::Deserialize<'de> for Strict {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Strict, D::Error> {
        use serde::de::DeserializeSeed;
        StrictValue { path: String::new() }.deserialize(d).map(Strict)
    }
}

/// A `Value` seed that remembers where it is, for the duplicate-key error.
struct StrictValue {
    path: String,
}

impl<'de> serde::de::DeserializeSeed<'de> for StrictValue {
    type Value = Value;
    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> std::result::Result<Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> serde::de::Visitor<'de> for StrictValue {
    type Value = Value;
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_bool<E>(self, v: bool) -> std::result::Result<Value, E> {
        Ok(Value::Bool(v))
    }
    fn visit_i64<E>(self, v: i64) -> std::result::Result<Value, E> {
        Ok(Value::from(v))
    }
    fn visit_u64<E>(self, v: u64) -> std::result::Result<Value, E> {
        Ok(Value::from(v))
    }
    fn visit_f64<E>(self, v: f64) -> std::result::Result<Value, E> {
        Ok(serde_json::Number::from_f64(v).map_or(Value::Null, Value::Number))
    }
    fn visit_str<E>(self, v: &str) -> std::result::Result<Value, E> {
        Ok(Value::String(v.to_string()))
    }
    fn visit_string<E>(self, v: String) -> std::result::Result<Value, E> {
        Ok(Value::String(v))
    }
    fn visit_unit<E>(self) -> std::result::Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_none<E>(self) -> std::result::Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> std::result::Result<Value, A::Error> {
        let mut out = Vec::new();
        while let Some(v) = seq.next_element_seed(StrictValue { path: format!("{}[{}]", self.path, out.len()) })? {
            out.push(v);
        }
        Ok(Value::Array(out))
    }
    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> std::result::Result<Value, A::Error> {
        let mut out = Map::new();
        while let Some(k) = map.next_key::<String>()? {
            let path = full(&self.path, &k);
            if out.contains_key(&k) {
                return Err(serde::de::Error::custom(format!("duplicate key `{path}` (each key may appear once per object)")));
            }
            let v = map.next_value_seed(StrictValue { path })?;
            out.insert(k, v);
        }
        Ok(Value::Object(out))
    }
}

/// Reads the config file (or starts from `{}`) and applies `--set key.path=JSON` overrides in
/// order. A value that is not valid JSON is taken as a plain string
/// (`--set data.dataset=cifar10`).
pub fn load_json(path: Option<&Path>, sets: &[String]) -> Result<Value> {
    let mut root = match path {
        None => Value::Object(Map::new()),
        Some(p) => {
            let shown = p.display().to_string();
            let text = std::fs::read_to_string(p).map_err(|source| ConfigError::Read { path: shown.clone(), source })?;
            let v: Value = parse_config_text(&text).map_err(|e| ConfigError::Json { path: shown.clone(), line: e.line, column: e.column, msg: e.msg })?;
            if !v.is_object() {
                return Err(ConfigError::Json { path: shown, line: 1, column: 1, msg: "the top level must be a JSON object".into() });
            }
            v
        }
    };
    for arg in sets {
        apply_set(&mut root, arg)?;
    }
    Ok(root)
}

/// Applies one `key.path=value` override to `root`.
pub fn apply_set(root: &mut Value, arg: &str) -> Result<()> {
    let set_err = |msg: String| ConfigError::Set { arg: arg.to_string(), msg };
    let (path, raw) = arg
        .split_once('=')
        .ok_or_else(|| set_err("expected key.path=value (e.g. --set optimizer.params.lr=3e-4)".into()))?;
    let parts: Vec<&str> = path.trim().split('.').collect();
    if parts.iter().any(|p| p.is_empty()) {
        return Err(set_err(format!("`{path}` is not a dotted key path (e.g. data.dataset)")));
    }
    // A duplicate key is an error, not a reason to read the value as a string.
    let value = match parse_json_strict(raw) {
        Ok(v) => v,
        Err(e) if e.to_string().contains("duplicate key") => return Err(set_err(e.to_string())),
        Err(_) => Value::String(raw.to_string()),
    };
    let mut node = root;
    for (i, part) in parts.iter().enumerate() {
        let here = parts[..i].join(".");
        let obj = match node {
            Value::Object(m) => m,
            other => {
                return Err(set_err(format!("`{here}` holds {}, not an object, so `{path}` cannot be set", kind_of(other))))
            }
        };
        if i + 1 == parts.len() {
            obj.insert(part.to_string(), value);
            return Ok(());
        }
        node = obj.entry(part.to_string()).or_insert_with(|| Value::Object(Map::new()));
    }
    Ok(())
}
