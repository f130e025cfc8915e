//! A minimal Python unpickler: just enough of the pickle machine to read the CIFAR "python
//! version" batches (`cifar-10-batches-py/data_batch_1`, `cifar-100-python/train`, …).
//!
//! Why not `serde-pickle`: those files hold their pixels in a NumPy array, which pickle stores as
//! `numpy.core.multiarray._reconstruct(...)` followed by a BUILD whose state carries the raw
//! bytes. serde-pickle rejects (or drops) unknown globals and discards BUILD state, so the pixels
//! would be lost. Here unknown globals stay symbolic: REDUCE makes an [`Value::Object`] holding
//! the callable and its arguments, BUILD attaches the state, and [`ndarray_u8`] reads a uint8
//! array back out of that shape. Nothing is ever executed.
//!
//! Supported: protocols 0–5 as written by Python 2's cPickle and Python 3's pickle for dicts,
//! lists, tuples, ints, floats, strings, bytes and objects built by REDUCE/NEWOBJ/BUILD (no
//! out-of-band buffers). Anything else is an error naming the opcode and its byte offset.
//!
//! Limitation, by design: the memo holds value snapshots, not shared references, so a container
//! that is memoized, then filled, then fetched again from the memo appears as it was when
//! memoized. CIFAR's files never re-reference a container (only the `_codecs.encode` global).

use std::collections::HashMap;
use std::rc::Rc;

/// A decoded pickle value. Byte strings are shared (`Rc`) because the memo duplicates them and
/// CIFAR's are 30 MB.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    None,
    Bool(bool),
    Int(i64),
    Float(f64),
    /// Python 2 `str` (BINSTRING) and Python 3 `bytes`.
    Bytes(Rc<Vec<u8>>),
    Str(String),
    List(Vec<Value>),
    Tuple(Vec<Value>),
    Dict(Vec<(Value, Value)>),
    /// A `module.name` reference that was not called.
    Global(String, String),
    /// The result of calling a global: the callable, its arguments and any BUILD state.
    Object { module: String, name: String, args: Vec<Value>, state: Option<Box<Value>> },
}

/// Why a pickle could not be read; `offset` is the byte offset of the opcode.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("pickle byte offset {offset}: {msg}")]
pub struct PickleError {
    pub offset: usize,
    pub msg: String,
}

impl Value {
    /// Dict lookup by a `str` or `bytes` key (Python 2 pickles have byte-string keys).
    pub fn get(&self, key: &str) -> Option<&Value> {
        match self {
            Value::Dict(items) => items.iter().find(|(k, _)| k.as_text() == Some(key)).map(|(_, v)| v),
            _ => None,
        }
    }

    pub fn as_text(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            Value::Bytes(b) => std::str::from_utf8(b).ok(),
            _ => None,
        }
    }

    pub fn as_int(&self) -> Option<i64> {
        match self {
            Value::Int(i) => Some(*i),
            Value::Bool(b) => Some(i64::from(*b)),
            _ => None,
        }
    }

    /// A short name of the value's kind for error messages.
    pub fn kind(&self) -> &'static str {
        match self {
            Value::None => "None",
            Value::Bool(_) => "bool",
            Value::Int(_) => "int",
            Value::Float(_) => "float",
            Value::Bytes(_) => "bytes",
            Value::Str(_) => "str",
            Value::List(_) => "list",
            Value::Tuple(_) => "tuple",
            Value::Dict(_) => "dict",
            Value::Global(..) => "global",
            Value::Object { .. } => "object",
        }
    }
}

enum Item {
    Mark,
    V(Value),
}

struct Machine<'a> {
    b: &'a [u8],
    pos: usize,
    op_at: usize,
    stack: Vec<Item>,
    memo: HashMap<u64, Value>,
}

impl<'a> Machine<'a> {
    fn err<T>(&self, msg: impl Into<String>) -> Result<T, PickleError> {
        Err(PickleError { offset: self.op_at, msg: msg.into() })
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], PickleError> {
        if self.b.len() - self.pos < n {
            return self.err(format!("truncated: needs {n} more bytes, {} left", self.b.len() - self.pos));
        }
        let s = &self.b[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn u8(&mut self) -> Result<u8, PickleError> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, PickleError> {
        let s = self.take(2)?;
        Ok(u16::from_le_bytes([s[0], s[1]]))
    }
    fn u32(&mut self) -> Result<u32, PickleError> {
        let s = self.take(4)?;
        Ok(u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
    }
    fn u64(&mut self) -> Result<u64, PickleError> {
        let s = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(s);
        Ok(u64::from_le_bytes(a))
    }
    fn line(&mut self) -> Result<&'a str, PickleError> {
        let rest = &self.b[self.pos..];
        let Some(n) = rest.iter().position(|&c| c == b'\n') else { return self.err("unterminated text line") };
        self.pos += n + 1;
        match std::str::from_utf8(&rest[..n]) {
            Ok(s) => Ok(s.trim_end_matches('\r')),
            Err(_) => self.err("text line is not UTF-8"),
        }
    }
    fn sized(&mut self, n: u64) -> Result<&'a [u8], PickleError> {
        match usize::try_from(n) {
            Ok(n) => self.take(n),
            Err(_) => self.err(format!("length {n} too large")),
        }
    }

    fn push(&mut self, v: Value) {
        self.stack.push(Item::V(v));
    }
    fn pop(&mut self) -> Result<Value, PickleError> {
        match self.stack.pop() {
            Some(Item::V(v)) => Ok(v),
            Some(Item::Mark) => self.err("unexpected MARK on the stack"),
            None => self.err("stack underflow"),
        }
    }
    fn top_mut(&mut self) -> Result<&mut Value, PickleError> {
        match self.stack.last_mut() {
            Some(Item::V(v)) => Ok(v),
            _ => Err(PickleError { offset: self.op_at, msg: "stack underflow".into() }),
        }
    }
    /// Pops everything above the topmost MARK (and the mark).
    fn pop_mark(&mut self) -> Result<Vec<Value>, PickleError> {
        let Some(m) = self.stack.iter().rposition(|i| matches!(i, Item::Mark)) else { return self.err("no MARK on the stack") };
        let items = self.stack.split_off(m + 1);
        self.stack.pop();
        Ok(items.into_iter().filter_map(|i| if let Item::V(v) = i { Some(v) } else { None }).collect())
    }
    fn memo_get(&mut self, k: u64) -> Result<(), PickleError> {
        match self.memo.get(&k) {
            Some(v) => {
                let v = v.clone();
                self.push(v);
                Ok(())
            }
            None => self.err(format!("memo key {k} not defined")),
        }
    }
    fn memo_put(&mut self, k: u64) -> Result<(), PickleError> {
        let v = match self.stack.last() {
            Some(Item::V(v)) => v.clone(),
            _ => return self.err("PUT with an empty stack"),
        };
        self.memo.insert(k, v);
        Ok(())
    }
    fn extend_dict(&mut self, kv: Vec<Value>) -> Result<(), PickleError> {
        if !kv.len().is_multiple_of(2) {
            return self.err("SETITEMS with an odd number of items");
        }
        let at = self.op_at;
        match self.top_mut()? {
            Value::Dict(d) => {
                let mut it = kv.into_iter();
                while let (Some(k), Some(v)) = (it.next(), it.next()) {
                    d.push((k, v));
                }
                Ok(())
            }
            other => Err(PickleError { offset: at, msg: format!("SETITEM(S) on a {}", other.kind()) }),
        }
    }
    fn extend_list(&mut self, items: Vec<Value>) -> Result<(), PickleError> {
        let at = self.op_at;
        match self.top_mut()? {
            Value::List(l) => {
                l.extend(items);
                Ok(())
            }
            other => Err(PickleError { offset: at, msg: format!("APPEND(S) on a {}", other.kind()) }),
        }
    }

    /// Calls `callable(*args)` symbolically. The only call interpreted is
    /// `_codecs.encode(text, 'latin1')`, Python 3's protocol-2 spelling of a bytes object.
    fn call(&mut self, callable: Value, args: Vec<Value>) -> Result<Value, PickleError> {
        match callable {
            Value::Global(module, name) => {
                if module == "_codecs" && name == "encode" {
                    if let Some(Value::Str(s)) = args.first() {
                        let bytes: Option<Vec<u8>> = s.chars().map(|c| u8::try_from(c as u32).ok()).collect();
                        return match bytes {
                            Some(b) => Ok(Value::Bytes(Rc::new(b))),
                            None => self.err("_codecs.encode argument is not latin-1"),
                        };
                    }
                }
                Ok(Value::Object { module, name, args, state: None })
            }
            other => self.err(format!("call of a {}", other.kind())),
        }
    }

    fn run(&mut self) -> Result<Value, PickleError> {
        loop {
            self.op_at = self.pos;
            let op = self.u8()?;
            match op {
                0x80 => {
                    let proto = self.u8()?;
                    if proto > 5 {
                        return self.err(format!("unsupported pickle protocol {proto}"));
                    }
                }
                0x95 => {
                    self.u64()?; // FRAME: a length hint only
                }
                b'.' => return self.pop(),
                b'(' => self.stack.push(Item::Mark),
                b'}' => self.push(Value::Dict(Vec::new())),
                b']' => self.push(Value::List(Vec::new())),
                b')' => self.push(Value::Tuple(Vec::new())),
                b'N' => self.push(Value::None),
                0x88 => self.push(Value::Bool(true)),
                0x89 => self.push(Value::Bool(false)),
                b'J' => {
                    let v = self.u32()? as i32;
                    self.push(Value::Int(v as i64))
                }
                b'K' => {
                    let v = self.u8()?;
                    self.push(Value::Int(v as i64))
                }
                b'M' => {
                    let v = self.u16()?;
                    self.push(Value::Int(v as i64))
                }
                0x8a | 0x8b => {
                    // LONG1 / LONG4: little-endian two's complement of n bytes.
                    let n = if op == 0x8a { self.u8()? as u64 } else { self.u32()? as u64 };
                    let bytes = self.sized(n)?;
                    if bytes.len() > 8 {
                        return self.err("integer wider than 64 bits");
                    }
                    let mut v: i64 = 0;
                    for (i, &b) in bytes.iter().enumerate() {
                        v |= (b as i64) << (8 * i);
                    }
                    if let Some(&last) = bytes.last() {
                        if last & 0x80 != 0 && bytes.len() < 8 {
                            v -= 1i64 << (8 * bytes.len());
                        }
                    }
                    self.push(Value::Int(v))
                }
                b'I' | b'L' => {
                    let line = self.line()?;
                    let t = line.trim_end_matches('L');
                    let v = match t {
                        "00" => Value::Bool(false),
                        "01" => Value::Bool(true),
                        _ => match t.parse::<i64>() {
                            Ok(i) => Value::Int(i),
                            Err(_) => return self.err(format!("bad integer literal {line:?}")),
                        },
                    };
                    self.push(v)
                }
                b'G' => {
                    let s = self.take(8)?;
                    let mut a = [0u8; 8];
                    a.copy_from_slice(s);
                    self.push(Value::Float(f64::from_be_bytes(a)))
                }
                b'U' | b'C' => {
                    let n = self.u8()? as u64;
                    let s = self.sized(n)?;
                    self.push(Value::Bytes(Rc::new(s.to_vec())))
                }
                b'T' | b'B' => {
                    let n = self.u32()? as u64;
                    let s = self.sized(n)?;
                    self.push(Value::Bytes(Rc::new(s.to_vec())))
                }
                0x8e | 0x96 => {
                    let n = self.u64()?;
                    let s = self.sized(n)?;
                    self.push(Value::Bytes(Rc::new(s.to_vec())))
                }
                b'X' | 0x8c | 0x8d => {
                    let n = match op {
                        b'X' => self.u32()? as u64,
                        0x8c => self.u8()? as u64,
                        _ => self.u64()?,
                    };
                    let s = self.sized(n)?;
                    match std::str::from_utf8(s) {
                        Ok(t) => self.push(Value::Str(t.to_string())),
                        Err(_) => return self.err("unicode string is not UTF-8"),
                    }
                }
                b'F' => {
                    let line = self.line()?;
                    match line.parse::<f64>() {
                        Ok(f) => self.push(Value::Float(f)),
                        Err(_) => return self.err(format!("bad float literal {line:?}")),
                    }
                }
                b'V' => {
                    // Protocol 0 text: raw-unicode-escape (latin-1 plus \uXXXX / \UXXXXXXXX).
                    let line = self.line()?;
                    match unescape_raw_unicode(line) {
                        Some(t) => self.push(Value::Str(t)),
                        None => return self.err(format!("bad unicode literal {line:?}")),
                    }
                }
                b't' => {
                    let items = self.pop_mark()?;
                    self.push(Value::Tuple(items))
                }
                0x85..=0x87 => {
                    let n = (op - 0x84) as usize;
                    let mut items = Vec::with_capacity(n);
                    for _ in 0..n {
                        items.push(self.pop()?);
                    }
                    items.reverse();
                    self.push(Value::Tuple(items))
                }
                b'l' => {
                    let items = self.pop_mark()?;
                    self.push(Value::List(items))
                }
                b'd' => {
                    let items = self.pop_mark()?;
                    self.push(Value::Dict(Vec::new()));
                    self.extend_dict(items)?
                }
                b'a' => {
                    let v = self.pop()?;
                    self.extend_list(vec![v])?
                }
                b'e' => {
                    let items = self.pop_mark()?;
                    self.extend_list(items)?
                }
                b's' => {
                    let v = self.pop()?;
                    let k = self.pop()?;
                    self.extend_dict(vec![k, v])?
                }
                b'u' => {
                    let items = self.pop_mark()?;
                    self.extend_dict(items)?
                }
                b'c' => {
                    let module = self.line()?.to_string();
                    let name = self.line()?.to_string();
                    self.push(Value::Global(module, name))
                }
                0x93 => {
                    let name = self.pop()?;
                    let module = self.pop()?;
                    match (module.as_text(), name.as_text()) {
                        (Some(m), Some(n)) => {
                            let g = Value::Global(m.to_string(), n.to_string());
                            self.push(g)
                        }
                        _ => return self.err("STACK_GLOBAL needs two strings"),
                    }
                }
                b'R' | 0x81 => {
                    let args = match self.pop()? {
                        Value::Tuple(a) => a,
                        other => return self.err(format!("REDUCE/NEWOBJ arguments are a {}, not a tuple", other.kind())),
                    };
                    let callable = self.pop()?;
                    let v = self.call(callable, args)?;
                    self.push(v)
                }
                b'b' => {
                    let st = self.pop()?;
                    let at = self.op_at;
                    match self.top_mut()? {
                        Value::Object { state, .. } => *state = Some(Box::new(st)),
                        other => return Err(PickleError { offset: at, msg: format!("BUILD on a {}", other.kind()) }),
                    }
                }
                b'p' => {
                    let line = self.line()?;
                    match line.parse::<u64>() {
                        Ok(k) => self.memo_put(k)?,
                        Err(_) => return self.err(format!("bad memo key {line:?}")),
                    }
                }
                b'q' => {
                    let k = self.u8()? as u64;
                    self.memo_put(k)?
                }
                b'r' => {
                    let k = self.u32()? as u64;
                    self.memo_put(k)?
                }
                0x94 => {
                    let k = self.memo.len() as u64;
                    self.memo_put(k)?
                }
                b'g' => {
                    let line = self.line()?;
                    match line.parse::<u64>() {
                        Ok(k) => self.memo_get(k)?,
                        Err(_) => return self.err(format!("bad memo key {line:?}")),
                    }
                }
                b'h' => {
                    let k = self.u8()? as u64;
                    self.memo_get(k)?
                }
                b'j' => {
                    let k = self.u32()? as u64;
                    self.memo_get(k)?
                }
                b'0' => {
                    self.stack.pop();
                }
                b'1' => {
                    self.pop_mark()?;
                }
                b'2' => {
                    let v = self.pop()?;
                    self.push(v.clone());
                    self.push(v)
                }
                _ => return self.err(format!("unsupported opcode 0x{op:02x}")),
            }
        }
    }
}

/// Decodes Python's raw-unicode-escape (the bytes were already checked to be UTF-8 by `line`,
/// which is what protocol 0 writes for ASCII text; escapes carry everything else).
fn unescape_raw_unicode(s: &str) -> Option<String> {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        let n = match chars.next()? {
            'u' => 4,
            'U' => 8,
            other => {
                out.push('\\');
                out.push(other);
                continue;
            }
        };
        let hex: String = chars.by_ref().take(n).collect();
        out.push(char::from_u32(u32::from_str_radix(&hex, 16).ok()?)?);
    }
    Some(out)
}

/// Decodes one pickle.
pub fn loads(bytes: &[u8]) -> Result<Value, PickleError> {
    let mut m = Machine { b: bytes, pos: 0, op_at: 0, stack: Vec::new(), memo: HashMap::new() };
    m.run()
}

/// A 2-D uint8 NumPy array: (rows, cols) and its C-order bytes.
#[derive(Clone, Debug, PartialEq)]
pub struct ArrayU8 {
    pub shape: Vec<usize>,
    pub data: Rc<Vec<u8>>,
}

/// Reads a C-contiguous uint8 `numpy.ndarray` out of its pickled form: protocols ≤ 4 write
/// `_reconstruct(ndarray, (0,), b'b')` + BUILD state `(version, shape, dtype, fortran, bytes)`;
/// protocol 5 writes `_frombuffer(bytearray, dtype, shape, order)`. The error says what was found
/// instead.
pub fn ndarray_u8(v: &Value) -> Result<ArrayU8, String> {
    let Value::Object { module, name, state, args } = v else { return Err(format!("expected a numpy array, found a {}", v.kind())) };
    if module.starts_with("numpy") && name == "_frombuffer" {
        let [data, dtype, shape, order] = args.as_slice() else { return Err(format!("numpy _frombuffer with {} arguments", args.len())) };
        if order.as_text() == Some("F") {
            return Err("numpy array is Fortran-ordered; expected C order".into());
        }
        return array_parts(shape, dtype, data);
    }
    if !(module.starts_with("numpy") && name == "_reconstruct") {
        return Err(format!("expected a numpy array, found a {module}.{name} object"));
    }
    let Some(state) = state.as_deref() else { return Err("numpy array without its state".into()) };
    let Value::Tuple(st) = state else { return Err(format!("numpy array state is a {}", state.kind())) };
    // (version, shape, dtype, is_fortran, data); version may be absent in very old pickles.
    let st: &[Value] = if st.len() == 5 { &st[1..] } else { st };
    let [shape, dtype, fortran, data] = st else { return Err(format!("numpy array state has {} fields", st.len())) };
    if fortran.as_int() == Some(1) {
        return Err("numpy array is Fortran-ordered; expected C order".into());
    }
    array_parts(shape, dtype, data)
}

fn array_parts(shape: &Value, dtype: &Value, data: &Value) -> Result<ArrayU8, String> {
    let Value::Tuple(dims) = shape else { return Err("numpy array shape is not a tuple".into()) };
    let shape: Vec<usize> = dims
        .iter()
        .map(|d| d.as_int().and_then(|i| usize::try_from(i).ok()))
        .collect::<Option<_>>()
        .ok_or("numpy array shape is not a tuple of non-negative ints")?;
    match dtype {
        Value::Object { name, args, .. } if name == "dtype" => match args.first().and_then(Value::as_text) {
            Some("u1") | Some("|u1") | Some("uint8") => {}
            Some(other) => return Err(format!("numpy array dtype is {other}, expected u1 (uint8)")),
            None => return Err("numpy dtype without a type code".into()),
        },
        other => return Err(format!("numpy array dtype is a {}", other.kind())),
    }
    let Value::Bytes(data) = data else { return Err(format!("numpy array data is a {}", data.kind())) };
    let n = shape.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d)).ok_or_else(|| format!("numpy array shape {shape:?} overflows"))?;
    if data.len() != n {
        return Err(format!("numpy array of shape {shape:?} holds {} bytes, expected {n}", data.len()));
    }
    Ok(ArrayU8 { shape, data: data.clone() })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn expect_small(v: &Value) {
        let ints = [1, -2, 300, 70000, 1 << 40].map(Value::Int).to_vec();
        assert_eq!(v.get("a"), Some(&Value::List(ints)));
        assert_eq!(v.get("b"), Some(&Value::Tuple(vec![Value::Bool(true), Value::None, Value::Float(1.5)])));
        assert_eq!(v.get("c"), Some(&Value::Bytes(Rc::new(b"xy".to_vec()))));
    }

    #[test]
    fn small_values_in_protocols_0_2_4() {
        // pickle.dumps({'a': [1, -2, 300, 70000, 2**40], 'b': (True, None, 1.5), 'c': b'xy'},
        // protocol=P) from CPython 3.11.
        let p2: &[u8] = b"\x80\x02}q\x00(X\x01\x00\x00\x00aq\x01]q\x02(K\x01J\xfe\xff\xff\xffM,\x01Jp\x11\x01\x00\x8a\x06\x00\x00\x00\x00\x00\x01eX\x01\x00\x00\x00bq\x03\x88NG?\xf8\x00\x00\x00\x00\x00\x00\x87q\x04X\x01\x00\x00\x00cq\x05c_codecs\nencode\nq\x06X\x02\x00\x00\x00xyq\x07X\x06\x00\x00\x00latin1q\x08\x86q\tRq\nu.";
        let p4: &[u8] = b"\x80\x04\x95>\x00\x00\x00\x00\x00\x00\x00}\x94(\x8c\x01a\x94]\x94(K\x01J\xfe\xff\xff\xffM,\x01Jp\x11\x01\x00\x8a\x06\x00\x00\x00\x00\x00\x01e\x8c\x01b\x94\x88NG?\xf8\x00\x00\x00\x00\x00\x00\x87\x94\x8c\x01c\x94C\x02xy\x94u.";
        let p0: &[u8] = b"(dp0\nVa\np1\n(lp2\nI1\naI-2\naI300\naI70000\naL1099511627776L\nasVb\np3\n(I01\nNF1.5\ntp4\nsVc\np5\nc_codecs\nencode\np6\n(Vxy\np7\nVlatin1\np8\ntp9\nRp10\ns.";
        for p in [p2, p4, p0] {
            expect_small(&loads(p).unwrap());
        }
    }

    #[test]
    fn corrupted_pickles_never_panic() {
        let fixture = include_bytes!("../../tests/fixtures/cifar10_py3_protocol2.pkl");
        let mut rng = crate::data::rng::SplitMix::new(7);
        for _ in 0..3000 {
            let mut b = fixture.to_vec();
            for _ in 0..1 + rng.below(4) {
                let i = rng.below(b.len() as u64) as usize;
                b[i] = rng.next_u64() as u8;
            }
            let cut = b.len() - rng.below(b.len() as u64 / 4) as usize;
            if let Ok(v) = loads(&b[..cut]) {
                if let Some(d) = v.get("data") {
                    let _ = ndarray_u8(d);
                }
            }
        }
    }

    #[test]
    fn errors_carry_offsets() {
        let e = loads(b"\x80\x02}q\x00\xff").unwrap_err();
        assert_eq!(e.offset, 5);
        assert!(e.msg.contains("0xff"));
        let e = loads(b"\x80\x02T\x10\x00\x00\x00abc").unwrap_err();
        assert_eq!(e.offset, 2);
        assert!(e.msg.contains("truncated"));
        assert!(loads(b"").is_err());
        assert!(loads(b"a").is_err());
    }
}
