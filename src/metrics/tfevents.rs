//! A TensorBoard event-file writer: TFRecord framing (length, masked CRC-32C of the length,
//! the bytes, masked CRC-32C of the bytes) around `Event` protobufs holding scalar
//! `Summary` values. Only the fields TensorBoard's scalar reader needs are encoded, by hand:
//!
//! ```text
//! Event   { double wall_time = 1; int64 step = 2; string file_version = 3; Summary summary = 5; }
//! Summary { repeated Value value = 1; }   Value { string tag = 1; float simple_value = 2; }
//! ```

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

/// TFRecord's checksum: CRC-32C rotated right by 15 bits plus a constant.
pub fn masked_crc32c(bytes: &[u8]) -> u32 {
    let c = crc32c::crc32c(bytes);
    c.rotate_right(15).wrapping_add(0xa282_ead8)
}

fn varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// A length-delimited field (wire type 2).
fn bytes_field(out: &mut Vec<u8>, field: u32, bytes: &[u8]) {
    varint(out, u64::from(field << 3 | 2));
    varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

/// One `Event` message: wall time, step and either the file version or scalar values.
pub fn encode_event(wall_time: f64, step: i64, file_version: Option<&str>, scalars: &[(&str, f32)]) -> Vec<u8> {
    let mut ev = Vec::new();
    ev.push(1 << 3 | 1); // wall_time, 64-bit
    ev.extend_from_slice(&wall_time.to_le_bytes());
    ev.push(2 << 3); // step, varint (int64: two's complement)
    varint(&mut ev, step as u64);
    if let Some(v) = file_version {
        bytes_field(&mut ev, 3, v.as_bytes());
    }
    if !scalars.is_empty() {
        let mut summary = Vec::new();
        for (tag, value) in scalars {
            let mut val = Vec::new();
            bytes_field(&mut val, 1, tag.as_bytes());
            val.push(2 << 3 | 5); // simple_value, 32-bit
            val.extend_from_slice(&value.to_le_bytes());
            bytes_field(&mut summary, 1, &val);
        }
        bytes_field(&mut ev, 5, &summary);
    }
    ev
}

/// TFRecord framing of one record.
pub fn frame(data: &[u8]) -> Vec<u8> {
    let len = (data.len() as u64).to_le_bytes();
    let mut out = Vec::with_capacity(data.len() + 16);
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked_crc32c(&len).to_le_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(&masked_crc32c(data).to_le_bytes());
    out
}

/// Appends scalar events to one `events.out.tfevents.*` file in a directory.
pub struct EventWriter {
    pub path: PathBuf,
    out: BufWriter<File>,
}

fn now() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0)
}

impl EventWriter {
    /// Creates `dir/events.out.tfevents.<seconds>.<host>.<pid>` with its version record.
    pub fn create(dir: &Path) -> std::io::Result<EventWriter> {
        std::fs::create_dir_all(dir)?;
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname").map(|h| h.trim().to_string()).unwrap_or_else(|_| "localhost".into());
        let t = now();
        let path = dir.join(format!("events.out.tfevents.{}.{host}.{}", t as u64, std::process::id()));
        let mut w = EventWriter { out: BufWriter::new(File::create(&path)?), path };
        w.out.write_all(&frame(&encode_event(t, 0, Some("brain.Event:2"), &[])))?;
        w.out.flush()?;
        Ok(w)
    }

    /// One event at `step` with these scalars, flushed (a killed run keeps what it logged).
    pub fn scalars(&mut self, step: i64, values: &[(&str, f32)]) -> std::io::Result<()> {
        self.out.write_all(&frame(&encode_event(now(), step, None, values)))?;
        self.out.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_and_mask_match_the_published_values() {
        // CRC-32C check value of "123456789" (RFC 3720 appendix B.4)
        assert_eq!(crc32c::crc32c(b"123456789"), 0xe306_9283);
        // the mask is a right rotation by 15 plus 0xa282ead8 (TensorFlow's crc32c.h)
        let c = crc32c::crc32c(b"abc");
        assert_eq!(masked_crc32c(b"abc"), ((c >> 15) | (c << 17)).wrapping_add(0xa282_ead8));
    }

    #[test]
    fn framing_carries_the_length_and_both_checksums() {
        let data = encode_event(1.5, 300, None, &[("Train/Samples/lr", 0.25)]);
        let rec = frame(&data);
        assert_eq!(u64::from_le_bytes(rec[0..8].try_into().expect("8 bytes")), data.len() as u64);
        assert_eq!(u32::from_le_bytes(rec[8..12].try_into().expect("4 bytes")), masked_crc32c(&rec[0..8]));
        assert_eq!(&rec[12..12 + data.len()], &data[..]);
        assert_eq!(u32::from_le_bytes(rec[12 + data.len()..].try_into().expect("4 bytes")), masked_crc32c(&data));
        // the event: wall_time (tag 0x09), step 300 as a varint (0xac 0x02), the summary (tag 0x2a)
        assert_eq!(data[0], 0x09);
        assert_eq!(&data[1..9], &1.5f64.to_le_bytes());
        assert_eq!(&data[9..12], &[0x10, 0xac, 0x02]);
        assert_eq!(data[12], 0x2a);
        assert_eq!(&data[data.len() - 4..], &0.25f32.to_le_bytes());
    }
}
