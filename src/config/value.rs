//! Reading a key's value by its definition, and writing it back: the getters apply the
//! documented default and word the "expected …" error from the [`KeyDef`], so a key's
//! behaviour and its doc cannot drift apart. Also the checks shared by every section:
//! unknown keys (with a "did you mean"), and warnings for DeepSpeed features we do not
//! implement.

use serde_json::{Map, Value};

use super::key_def::*;

/// Writes `value` under the name of `def`: `config.json` is written key by key from the
/// definitions, never from spelled-out names.
pub(super) fn put(out: &mut Map<String, Value>, def: &KeyDef, value: Value) {
    out.insert(def.name.to_string(), value);
}

/// Edit distance with adjacent transpositions counting one (optimal string alignment), for
/// "did you mean" suggestions: `trian` is one edit from `train`.
fn edit_distance(a: &str, b: &str) -> usize {
    let (a, b): (Vec<char>, Vec<char>) = (a.chars().collect(), b.chars().collect());
    let mut d = vec![vec![0usize; b.len() + 1]; a.len() + 1];
    for (i, row) in d.iter_mut().enumerate() {
        row[0] = i;
    }
    for j in 0..=b.len() {
        d[0][j] = j;
    }
    for i in 1..=a.len() {
        for j in 1..=b.len() {
            let cost = usize::from(a[i - 1] != b[j - 1]);
            let mut v = (d[i - 1][j] + 1).min(d[i][j - 1] + 1).min(d[i - 1][j - 1] + cost);
            if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                v = v.min(d[i - 2][j - 2] + 1);
            }
            d[i][j] = v;
        }
    }
    d[a.len()][b.len()]
}

/// The largest edit distance that still reads as a typo of a word of `len` characters: one
/// edit for short words (`foo` is not a typo of `aio`), about one in four for longer ones.
fn typo_budget(len: usize) -> usize {
    (len / 4).max(1)
}

/// ` (did you mean "k"?)` for the known name `word` most likely mistypes, else "".
pub fn suggest<'a>(word: &str, known: impl IntoIterator<Item = &'a str>) -> String {
    let lw = word.to_lowercase();
    let known: Vec<&str> = known.into_iter().collect();
    // A key that extends the word (`checkpoint` → `checkpoint_every`) is the likeliest meaning.
    if let Some(k) = known.iter().find(|k| lw.len() >= 4 && k.to_lowercase().starts_with(&lw)) {
        return format!(" (did you mean \"{k}\"?)");
    }
    let best = known
        .into_iter()
        .map(|k| (edit_distance(&lw, &k.to_lowercase()), k))
        .min_by_key(|(d, _)| *d);
    match best {
        Some((d, k)) if d <= typo_budget(word.chars().count().min(k.chars().count())) => format!(" (did you mean \"{k}\"?)"),
        _ => String::new(),
    }
}

/// Rejects keys of `obj` that are neither in `table` nor in `extra`.
pub(super) fn check_keys(path: &str, obj: &Map<String, Value>, table: &[KeyDef], extra: &[&str]) -> Result<()> {
    for k in obj.keys() {
        if table.iter().any(|d| d.name == k) || extra.contains(&k.as_str()) {
            continue;
        }
        let names = table.iter().map(|d| d.name).chain(extra.iter().copied());
        let hint = suggest(k, names);
        let known: Vec<&str> = table.iter().map(|d| d.name).collect();
        let where_ = if path.is_empty() { "at the top level".to_string() } else { format!("in `{path}`") };
        let list = if known.len() <= 16 { format!("; known keys: {}", known.join(", ")) } else { String::new() };
        return Err(key_err(full(path, k), format!("unknown key {where_}{hint}{list}")));
    }
    Ok(())
}

/// An optional JSON object at `path` (absent or null = None).
pub(super) fn section<'v>(v: Option<&'v Value>, path: &str) -> Result<Option<&'v Map<String, Value>>> {
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Object(m)) => Ok(Some(m)),
        Some(other) => Err(key_err(path, format!("expected an object, got {}", kind_of(other)))),
    }
}

/// The value of `def` in `obj`, or None when absent, null or `"auto"` (warned).
pub(super) fn given<'v>(obj: Option<&'v Map<String, Value>>, path: &str, def: &KeyDef, cx: &mut Cx) -> Option<&'v Value> {
    let v = obj?.get(def.name)?;
    if v.is_null() {
        return None;
    }
    if is_auto(v) && !def_accepts_auto(def) {
        cx.warn(format!("{}: \"auto\" taken as not given (default: {})", full(path, def.name), def.default.describe()));
        return None;
    }
    Some(v)
}

fn def_accepts_auto(def: &KeyDef) -> bool {
    matches!(def.ty, Ty::Choice(c) if c.contains(&"auto"))
}

pub(super) fn bad(path: &str, def: &KeyDef, v: &Value) -> ConfigError {
    key_err(full(path, def.name), format!("expected {}, got {}", def.ty.describe(), kind_of(v)))
}

fn num_in(def: &KeyDef, x: f64) -> bool {
    match def.ty {
        Ty::Num { lo, hi, lo_open, hi_open } => {
            x.is_finite() && (if lo_open { x > lo } else { x >= lo }) && (if hi_open { x < hi } else { x <= hi })
        }
        _ => x.is_finite(),
    }
}

fn parse_bool(path: &str, def: &KeyDef, v: &Value) -> Result<bool> {
    v.as_bool().ok_or_else(|| bad(path, def, v))
}

fn parse_int(path: &str, def: &KeyDef, v: &Value) -> Result<u64> {
    // Accept 64.0 as 64 (JSON writers differ), reject 64.5.
    let i = v
        .as_u64()
        .or_else(|| v.as_f64().filter(|f| f.fract() == 0.0 && *f >= 0.0 && *f < 1.8e19).map(|f| f as u64))
        .ok_or_else(|| bad(path, def, v))?;
    if let Ty::Int { lo, hi } = def.ty {
        if i < lo || i > hi {
            return Err(bad(path, def, v));
        }
    }
    Ok(i)
}

fn parse_num(path: &str, def: &KeyDef, v: &Value) -> Result<f64> {
    let x = v.as_f64().ok_or_else(|| bad(path, def, v))?;
    if !num_in(def, x) {
        return Err(bad(path, def, v));
    }
    Ok(x)
}

pub(super) fn get_bool(obj: Option<&Map<String, Value>>, path: &str, def: &KeyDef, cx: &mut Cx) -> Result<bool> {
    match given(obj, path, def, cx) {
        Some(v) => parse_bool(path, def, v),
        None => match def.default {
            Dflt::Bool(b) => Ok(b),
            _ => Err(key_err(full(path, def.name), "is required")),
        },
    }
}

pub(super) fn opt_bool(obj: Option<&Map<String, Value>>, path: &str, def: &KeyDef, cx: &mut Cx) -> Result<Option<bool>> {
    given(obj, path, def, cx).map(|v| parse_bool(path, def, v)).transpose()
}

pub(super) fn opt_int(obj: Option<&Map<String, Value>>, path: &str, def: &KeyDef, cx: &mut Cx) -> Result<Option<u64>> {
    given(obj, path, def, cx).map(|v| parse_int(path, def, v)).transpose()
}

pub(super) fn get_int(obj: Option<&Map<String, Value>>, path: &str, def: &KeyDef, cx: &mut Cx) -> Result<u64> {
    match opt_int(obj, path, def, cx)? {
        Some(i) => Ok(i),
        None => match def.default {
            Dflt::Int(i) => Ok(i),
            _ => Err(key_err(full(path, def.name), format!("is required ({})", def.ty.describe()))),
        },
    }
}

pub(super) fn opt_num(obj: Option<&Map<String, Value>>, path: &str, def: &KeyDef, cx: &mut Cx) -> Result<Option<f64>> {
    given(obj, path, def, cx).map(|v| parse_num(path, def, v)).transpose()
}

pub(super) fn get_num(obj: Option<&Map<String, Value>>, path: &str, def: &KeyDef, cx: &mut Cx) -> Result<f64> {
    match opt_num(obj, path, def, cx)? {
        Some(x) => Ok(x),
        None => match def.default {
            Dflt::Num(x) => Ok(x),
            Dflt::Int(i) => Ok(i as f64),
            _ => Err(key_err(full(path, def.name), format!("is required ({})", def.ty.describe()))),
        },
    }
}

pub(super) fn opt_str<'v>(obj: Option<&'v Map<String, Value>>, path: &str, def: &KeyDef, cx: &mut Cx) -> Result<Option<&'v str>> {
    let Some(v) = given(obj, path, def, cx) else { return Ok(None) };
    let s = v.as_str().ok_or_else(|| bad(path, def, v))?;
    if let Ty::Choice(c) = def.ty {
        if !c.contains(&s) {
            let hint = suggest(s, c.iter().copied());
            return Err(key_err(full(path, def.name), format!("unknown value \"{s}\"{hint}; expected {}", def.ty.describe())));
        }
    }
    Ok(Some(s))
}

pub(super) fn get_str<'v>(obj: Option<&'v Map<String, Value>>, path: &str, def: &KeyDef, cx: &mut Cx) -> Result<&'v str> {
    match opt_str(obj, path, def, cx)? {
        Some(s) => Ok(s),
        None => match def.default {
            Dflt::Str(s) => Ok(s),
            _ => Err(key_err(full(path, def.name), format!("is required ({})", def.ty.describe()))),
        },
    }
}

pub(super) fn opt_nums(obj: Option<&Map<String, Value>>, path: &str, def: &KeyDef, cx: &mut Cx) -> Result<Option<Vec<f64>>> {
    let Some(v) = given(obj, path, def, cx) else { return Ok(None) };
    let n = match def.ty {
        Ty::Nums(n) => n,
        _ => 0,
    };
    let arr = v.as_array().filter(|a| a.len() == n).ok_or_else(|| bad(path, def, v))?;
    let xs: Option<Vec<f64>> = arr.iter().map(|x| x.as_f64().filter(|f| f.is_finite())).collect();
    xs.map(Some).ok_or_else(|| bad(path, def, v))
}

/// Whether a value asks for a feature: null/false/0/""/{}/[] and `{"enabled": false}` do not.
pub(super) fn active(v: &Value) -> bool {
    match v {
        Value::Null => false,
        Value::Bool(b) => *b,
        Value::Number(n) => n.as_f64() != Some(0.0),
        Value::String(s) => !s.is_empty() && s != "none",
        Value::Array(a) => !a.is_empty(),
        Value::Object(m) => match m.get("enabled") {
            Some(e) => e.as_bool().unwrap_or(false) || e.as_str() == Some("true"),
            None => m.values().any(active),
        },
    }
}

/// Whether `v` differs from the documented default of a warn-only key.
fn asks_for_feature(def: &KeyDef, v: &Value) -> bool {
    match def.default {
        Dflt::Bool(b) => !v.is_null() && v.as_bool() != Some(b),
        Dflt::Num(x) => v.as_f64() != Some(x),
        Dflt::Int(i) => v.as_u64() != Some(i),
        _ => active(v),
    }
}

pub(super) fn note_unimplemented(path: &str, obj: &Map<String, Value>, table: &[KeyDef], cx: &mut Cx) {
    for def in table.iter().filter(|d| d.support == Support::Warn) {
        if let Some(v) = obj.get(def.name) {
            if asks_for_feature(def, v) {
                let shown = serde_json::to_string(v).unwrap_or_default();
                let shown = if shown.len() > 60 { format!("{}…", &shown[..shown.char_indices().nth(57).map(|(i, _)| i).unwrap_or(57)]) } else { shown };
                cx.warn(format!("{} = {shown}: accepted but not implemented, no effect. {}", full(path, def.name), def.doc));
            }
        }
    }
}
